"""``shardwise checkpoint consolidate`` on one process: the checkpoint's kind picks the consolidation,
an output of the other kind is refused with a message that names both."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardwise import cli
from shardwise.cli.checkpoint import KERAS_FORMAT, ZERO_META


def _consolidate(directory: Path, out: Path) -> int:
    return cli.main(["checkpoint", "consolidate", str(directory), str(out)])


@pytest.fixture
def keras_checkpoint(tmp_path: Path):
    """A one-process sharded Keras checkpoint (Adam, 2 steps) under ``tmp_path/ckpts``, and its model."""
    keras = pytest.importorskip("keras")
    from shardwise.adapters.keras.checkpoint import save_checkpoint

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(8, 5)), rng.normal(size=(8, 2)), batch_size=4, epochs=1, verbose=0)
    save_checkpoint(model, tmp_path / "ckpts", epoch=1)
    return tmp_path / "ckpts", model


def test_the_format_names_are_the_modules(keras_checkpoint) -> None:
    pytest.importorskip("torch")
    from shardwise.adapters.keras.checkpoint import FORMAT
    from shardwise.adapters.torch.checkpoint.zero import META

    assert (ZERO_META, KERAS_FORMAT) == (META, FORMAT)


def test_a_keras_checkpoint_consolidates_into_a_keras_file(keras_checkpoint, tmp_path: Path, capsys) -> None:
    import keras

    directory, model = keras_checkpoint
    probe = np.random.default_rng(1).normal(size=(3, 5)).astype("float32")
    for source in (directory, directory / "ckpt-2"):  # a directory of checkpoints, or one
        out = tmp_path / f"{source.name}.keras"
        assert _consolidate(source, out) == 0, capsys.readouterr().err
        assert f"wrote {out}" in capsys.readouterr().out
        plain = keras.saving.load_model(out)
        np.testing.assert_array_equal(plain.predict(probe, verbose=0), model.predict(probe, verbose=0))
        assert int(plain.optimizer.iterations) == 2


@pytest.mark.parametrize("suffix", [".pt", ".npz", ".h5"])
def test_a_keras_checkpoint_refuses_other_outputs(keras_checkpoint, tmp_path: Path, capsys, suffix: str) -> None:
    directory, _ = keras_checkpoint
    out = tmp_path / f"full{suffix}"
    assert _consolidate(directory, out) == 2
    err = capsys.readouterr().err
    assert f"is a sharded Keras checkpoint: it consolidates into .keras, not 'full{suffix}'" in err, err
    if suffix != ".h5":
        assert ".pt and .npz is for a torch ZeRO checkpoint" in err, err
    assert not out.exists()


def test_a_torch_zero_checkpoint_refuses_a_keras_output(tmp_path: Path, capsys) -> None:
    torch = pytest.importorskip("torch")
    from shardwise.adapters.torch.zero import ZeroOptimizer
    from shardwise.backends.local import LocalCommunicator
    from shardwise.adapters.torch.checkpoint.zero import save_zero_checkpoint

    opt = ZeroOptimizer(torch.nn.Linear(4, 3), stage=3, comm=LocalCommunicator(), lr=0.1)
    save_zero_checkpoint(opt, tmp_path / "zero")
    assert _consolidate(tmp_path / "zero", tmp_path / "model.keras") == 2
    err = capsys.readouterr().err
    assert "is a torch ZeRO checkpoint: it consolidates into .pt or .npz, not 'model.keras' (.keras is for a " \
           "sharded Keras checkpoint)" in err, err
    assert not (tmp_path / "model.keras").exists()
    assert _consolidate(tmp_path / "zero", tmp_path / "full.npz") == 0
    assert sorted(np.load(tmp_path / "full.npz").files) == sorted(opt.full_parameters())


def test_what_is_not_a_consolidatable_checkpoint_is_named(tmp_path: Path, capsys) -> None:
    from shardwise.checkpoint.store import save_checkpoint

    assert _consolidate(tmp_path / "absent", tmp_path / "m.keras") == 2
    assert "absent is not a directory" in capsys.readouterr().err
    (tmp_path / "torn" / "ckpt-3").mkdir(parents=True)  # a save that never committed its manifest
    assert _consolidate(tmp_path / "torn", tmp_path / "m.keras") == 2
    err = capsys.readouterr().err
    assert "holds no complete checkpoint" in err and "steps found: [3]" in err, err
    save_checkpoint(tmp_path / "other", 5, {"x.bin": b"0"}, metadata={"format": "shardwise-parallel"})
    assert _consolidate(tmp_path / "other", tmp_path / "m.keras") == 2
    err = capsys.readouterr().err
    assert "is a checkpoint of format 'shardwise-parallel'" in err and "checkpoint export" in err, err
