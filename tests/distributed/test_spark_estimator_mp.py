"""Horovod's Spark estimators on shardwise (issue 57): ``TorchEstimator`` (ZeRO-2, and a ZeRO-3
``ParallelLayout``) and ``KerasEstimator`` (data parallel, Keras on torch) fit scikit-learn's digits on 2
Spark barrier tasks of ``local[2]``.

``spark_estimators.py`` runs every scenario once in one SparkSession (a module fixture) and
prints a verdict per scenario: the fitted weights against a one-process replay of the same
global batches (read back from the store's Parquet files with pyarrow), the prediction column
that ``transform`` adds and the accuracy on held-out rows, the checkpoints in the store.
"""

from __future__ import annotations

import os

import pytest

from spark_support import driver_verdicts, require_spark

require_spark()
pytest.importorskip("pyarrow", reason="the Spark estimators need pyarrow: pip install pyarrow")
pytest.importorskip("torch")
pytest.importorskip("keras")
pytest.importorskip("sklearn", reason="the digits data comes from scikit-learn: pip install scikit-learn")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    store = tmp_path_factory.mktemp("spark_store")
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONUNBUFFERED="1")
    return driver_verdicts(os.path.join(HERE, "spark_estimators.py"), (str(store),), env=env, timeout=280)


def scenario(verdicts: dict, name: str) -> dict:
    v = verdicts.get(name)
    assert v is not None, f"no verdict for {name}"
    assert "error" not in v, v["error"]
    return v


def check_fit(v: dict) -> None:
    assert v["allclose_rtol_1e-5_atol_1e-7"], v
    assert v["max_rel_diff_per_tensor"] < 1e-5, v
    assert v["steps_per_epoch"] > 10
    assert len(v["history"]["loss"]) == 5 and len(v["history"]["val_loss"]) == 5
    assert v["history"]["loss"][-1] < v["history"]["loss"][0]
    assert [c.split("/")[0] for c in v["checkpoints"]][::2] == [f"epoch-{e}" for e in range(5)], v["checkpoints"]


def check_transform(v: dict) -> None:
    assert v["columns"] == ["features", "label", "label__output"]
    assert v["held_out_rows"] == 360
    assert v["accuracy"] > 0.9, v["accuracy"]


@pytest.mark.timeout(300)
def test_torch_zero2_fit_equals_one_process_training(verdicts: dict) -> None:
    v = scenario(verdicts, "torch_zero2")
    check_fit(v)
    assert {c.split("/")[1] for c in v["checkpoints"]} == {"model.pt", "zero"}


@pytest.mark.timeout(300)
def test_torch_parallel_layout_zero3_fit_equals_one_process_training(verdicts: dict) -> None:
    """strategy=ParallelLayout(dp=2, zero_stage=3): parallelize's path; the weights gathered from the shards."""
    v = scenario(verdicts, "torch_layout_zero3")
    check_fit(v)
    assert {c.split("/")[1] for c in v["checkpoints"]} == {"model.pt", "parallel"}


@pytest.mark.timeout(300)
def test_torch_transform_adds_predictions(verdicts: dict) -> None:
    check_transform(scenario(verdicts, "torch_zero2"))


@pytest.mark.timeout(300)
def test_keras_dp_fit_equals_one_process_training(verdicts: dict) -> None:
    v = scenario(verdicts, "keras_dp")
    check_fit(v)
    assert {c.split("/")[1] for c in v["checkpoints"]} == {"model.weights.h5", "shardwise"}


@pytest.mark.timeout(300)
def test_keras_transform_adds_predictions(verdicts: dict) -> None:
    check_transform(scenario(verdicts, "keras_dp"))


@pytest.mark.timeout(300)
def test_bad_input_is_a_config_error(verdicts: dict) -> None:
    messages = scenario(verdicts, "bad_input")["messages"]
    assert messages["unknown_strategy"].startswith("ConfigError: unknown strategy 'zero4'"), messages
    assert messages["missing_column"].startswith("ConfigError: columns ['pixels'] not in the DataFrame"), messages
    assert messages["batch_size"] == "ConfigError: batch_size must be an integer >= 1, got 0", messages
    assert messages["no_feature_cols"].startswith("ConfigError: feature_cols is required"), messages
