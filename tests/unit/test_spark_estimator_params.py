"""The Spark estimators' parameter checks: each bad value is a ConfigError that names it (no JVM started)."""

from __future__ import annotations

import pytest

from shardwise.core.errors import ConfigError

pytest.importorskip("pyspark", reason="the Spark estimators need pyspark >= 4: pip install 'pyspark>=4'")
torch = pytest.importorskip("torch")

from shardwise.core.layout import ParallelLayout  # noqa: E402
from shardwise.spark.estimator.common import EstimatorParams  # noqa: E402
from shardwise.spark.estimator.torch import TorchEstimator  # noqa: E402
from shardwise.spark.store import LocalStore  # noqa: E402


def make(tmp_path, **overrides) -> TorchEstimator:
    net = torch.nn.Linear(4, 3)
    kwargs = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5),
                  loss=torch.nn.functional.cross_entropy, feature_cols=["x"], label_cols=["y"],
                  store=LocalStore(str(tmp_path)))
    kwargs.update(overrides)
    return TorchEstimator(**kwargs)


@pytest.mark.timeout(30)
def test_a_good_estimator_keeps_horovods_names(tmp_path) -> None:
    est = make(tmp_path, feature_cols="x", strategy="zero3", batch_size=8, epochs=2)
    assert est.getFeatureCols() == ["x"] and est.getLabelCols() == ["y"]
    assert (est.getBatchSize(), est.getEpochs(), est.getStrategy()) == (8, 2, "zero3")
    cls, kwargs = est.getOptimizer()
    assert cls is torch.optim.SGD and kwargs["lr"] == 0.1 and kwargs["momentum"] == 0.5
    params = EstimatorParams(num_proc=None, feature_cols=("x",), label_cols=("a", "b"), store=LocalStore("/tmp"))
    assert params.outputs() == ("a__output", "b__output")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("overrides, match", [
    ({"strategy": "zero4"}, r"unknown strategy 'zero4'; expected one of \['dp', 'zero1', 'zero2', 'zero3'\]"),
    ({"strategy": ParallelLayout(dp=1, tp=2)}, "data parallel and ZeRO layouts only"),
    ({"strategy": 3}, "unknown strategy 3"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"epochs": 1.5}, "epochs must be an integer >= 1, got 1.5"),
    ({"num_proc": 0}, "num_proc must be an integer >= 1, got 0"),
    ({"feature_cols": None}, "feature_cols is required"),
    ({"label_cols": []}, "label_cols must name at least one column"),
    ({"validation": 1.5}, "validation must be a fraction in"),
    ({"store": "/tmp/somewhere"}, r"store must be a shardwise.spark.store.Store \(Store.create\(path\)\), got str"),
    ({"backend": "nccl"}, "unknown backend 'nccl'"),
    ({"output_cols": ["a", "b"]}, "one column per label column"),
    ({"model": "net"}, "model must be a torch.nn.Module, got str"),
    ({"loss": "mse"}, "loss must be a callable"),
    ({"run_id": "a/b"}, "run_id must be a non-empty string without '/'"),
])
def test_bad_parameters_are_config_errors(tmp_path, overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make(tmp_path, **overrides)


@pytest.mark.timeout(30)
def test_optimizer_with_two_groups_is_refused(tmp_path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD([{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": 0.01}], lr=0.1)
    with pytest.raises(ConfigError, match="2 parameter groups"):
        make(tmp_path, model=net, optimizer=opt)
