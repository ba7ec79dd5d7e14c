"""Sharded Keras checkpoints under mpirun: written on 4 ranks of one backend, resumed on 2 ranks of another."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_matrix import env_for
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

#: [saved with, resumed with]: every stage resumes at another stage or without ZeRO, and back.
PLAN = [["zero1", "zero2"], ["zero2", "zero3"], ["zero3", "zero1"], ["dp", "zero3"], ["zero3", "dp"]]


@pytest.mark.parametrize("saved_on,resumed_on", [("torch", "jax"), ("jax", "torch")])
def test_save_on_4_ranks_resume_on_2_ranks_of_another_backend(tmp_path, saved_on: str, resumed_on: str) -> None:
    """Adam, ZeRO stages 1-3 and DistributedOptimizer; the resumed run ends where one uninterrupted
    one-process run ends (rtol 1e-5)."""
    for backend in (saved_on, resumed_on):
        pytest.importorskip(backend)
    run_mpi(4, "keras_ckpt:save", directory=str(tmp_path), kinds=["zero1", "zero2", "zero3", "dp"], timeout=240,
            env=env_for(saved_on), shared=True)
    run_mpi(2, "keras_ckpt:resume", directory=str(tmp_path), plan=PLAN, timeout=240, env=env_for(resumed_on),
            shared=True)


@pytest.mark.parametrize("keras_backend,kind", [pytest.param(*p, id="-".join(p)) for p in
                                                 [("torch", "zero3"), ("jax", "zero2")]])
def test_consolidate_load_model_and_refusals(tmp_path, keras_backend: str, kind: str) -> None:
    """One call makes a plain .keras file (loaded in a process without shardwise: same predictions and
    Adam state); hvd.load_model restores a checkpoint directory; mismatched models are refused."""
    pytest.importorskip(keras_backend)
    run_mpi(2, "keras_ckpt:lifecycle", directory=str(tmp_path / "ckpts"), kind=kind, timeout=240,
            env=env_for(keras_backend), shared=True)


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path) -> None:
    """Rank 1 dies while writing its file: that step has no manifest, the one before loads."""
    pytest.importorskip("torch")
    result = run_mpi(2, "keras_ckpt:crash_mid_save", directory=str(tmp_path), timeout=180, expect_ok=False,
                     env=env_for("torch"))
    assert result.returncode != 0 and "crashing in the middle of its checkpoint file" in result.output, \
        result.output[-3000:]
    run_mpi(2, "keras_ckpt:after_crash", directory=str(tmp_path), timeout=120, env=env_for("torch"), shared=True)


def test_tensorflow_checkpoint_resumes_on_jax(tmp_path) -> None:
    """The third backend: ZeRO-2 and DistributedOptimizer checkpoints from TensorFlow resume at stages 3 and 1."""
    for backend in ("tensorflow", "jax"):
        pytest.importorskip(backend)
    run_mpi(2, "keras_ckpt:save", directory=str(tmp_path), kinds=["zero2", "dp"], timeout=240,
            env=env_for("tensorflow"), shared=True)
    run_mpi(2, "keras_ckpt:resume", directory=str(tmp_path), plan=[["zero2", "zero3"], ["dp", "zero1"]],
            timeout=240, env=env_for("jax"), shared=True)


@pytest.mark.parametrize("saved_on,resumed_on", [("torch", "jax"), ("jax", "torch")])
def test_mixed_precision_zero3_resumes_on_another_backend(tmp_path, saved_on: str, resumed_on: str) -> None:
    """mixed_float16, LossScaleOptimizer(ZeroOptimizer(Adam, stage=3)) at 2 ranks: the loss scale, its counter
    and the float32 masters load exactly; the continued run ends float16-close (rtol 1e-3) to the
    uninterrupted runs on either backend and to one process, on the same loss scale and counter."""
    for backend in (saved_on, resumed_on):
        pytest.importorskip(backend)
    run_mpi(2, "keras_ckpt_zero3:mixed_save", directory=str(tmp_path), timeout=180, env=env_for(saved_on),
            shared=True)
    run_mpi(2, "keras_ckpt_zero3:mixed_resume", directory=str(tmp_path), saved_on=saved_on, timeout=180,
            env=env_for(resumed_on), shared=True)


_PREDICT_PLAIN = """
import json, sys
import numpy as np
import keras
model = keras.saving.load_model(sys.argv[1])
assert not any(m == "shardwise" or m.startswith("shardwise.") for m in sys.modules), "shardwise was imported"
np.save(sys.argv[3], model.predict(np.load(sys.argv[2]), verbose=0))
print(json.dumps({"optimizer": type(model.optimizer).__name__, "iterations": int(model.optimizer.iterations)}))
"""


@pytest.mark.parametrize("keras_backend", ["torch", "jax"])
def test_sharded_build_checkpoint_and_cli_consolidation(tmp_path, keras_backend: str) -> None:
    """ZeRO-3 models built under sharded_build save and load a checkpoint holding only their shards (torch:
    the load's peak stays under one layer's worth) and resume bitwise; then ``shardwise checkpoint
    consolidate <dir> <out.keras>`` makes a file that plain Keras, without shardwise, predicts the same with."""
    pytest.importorskip(keras_backend)
    run_mpi(2, "keras_ckpt_zero3:sharded_save_load", directory=str(tmp_path), timeout=240,
            env=env_for(keras_backend))
    env = dict(os.environ, **env_for(keras_backend))
    out = tmp_path / "consolidated.keras"
    cli = subprocess.run([sys.executable, "-m", "shardwise.cli", "checkpoint", "consolidate", str(tmp_path / "ckpts"),
                          str(out)], capture_output=True, text=True, env=env, timeout=180,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert cli.returncode == 0 and f"wrote {out}" in cli.stdout, cli.stdout + cli.stderr[-3000:]
    wrong = subprocess.run([sys.executable, "-m", "shardwise.cli", "checkpoint", "consolidate",
                            str(tmp_path / "ckpts"), str(tmp_path / "full.pt")], capture_output=True, text=True,
                           env=env, timeout=180, cwd=str(Path(__file__).resolve().parents[2]))
    assert wrong.returncode == 2 and "consolidates into .keras, not 'full.pt'" in wrong.stderr, wrong.stderr[-3000:]
    plain_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    plain = subprocess.run([sys.executable, "-c", _PREDICT_PLAIN, str(out), str(tmp_path / "probe.npy"),
                            str(tmp_path / "plain.npy")], capture_output=True, text=True, env=plain_env,
                           timeout=180, cwd=str(tmp_path))
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert json.loads(plain.stdout.strip().splitlines()[-1]) == {"optimizer": "Adam", "iterations": 8}, plain.stdout
    np.testing.assert_allclose(np.load(tmp_path / "plain.npy"), np.load(tmp_path / "expected.npy"), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("kind", ["zero3", "dp"])
def test_a_read_error_on_one_rank_fails_the_load_on_every_rank_unchanged(tmp_path, kind: str) -> None:
    """All-or-nothing: every rank raises the same error and keeps its weights and optimizer state."""
    pytest.importorskip("torch")
    result = run_mpi(2, "keras_ckpt:one_rank_fails", directory=str(tmp_path), kind=kind, timeout=180,
                     env=env_for("torch"), shared=True)
    assert "OK keras" in result.output, result.output[-3000:]


def test_one_format_on_jax_without_torch_and_the_old_format_still_loads(tmp_path) -> None:
    """Keras checkpoints are shardwise.checkpoint's one format (safetensors pieces, a keras.model entry): saved
    and loaded on JAX ranks where torch cannot be imported; a checkpoint of the earlier .npz format still
    loads, resumes and consolidates; ``shardwise checkpoint info`` shows the Keras entry."""
    pytest.importorskip("jax")
    result = run_mpi(2, "keras_ckpt:no_torch_and_legacy", directory=str(tmp_path), timeout=300,
                     env=env_for("jax"))
    assert "OK no torch" in result.output, result.output[-3000:]
    env = dict(os.environ, **env_for("jax"))
    shown = {}
    for name in ("new", "old"):
        run = subprocess.run([sys.executable, "-m", "shardwise.cli", "checkpoint", "info", str(tmp_path / name)],
                             capture_output=True, text=True, env=env, timeout=120,
                             cwd=str(Path(__file__).resolve().parents[2]))
        assert run.returncode == 0, run.stderr[-3000:]
        shown[name] = run.stdout
    assert "a sharded Keras checkpoint (format 'shardwise-state', version 1)" in shown["new"], shown["new"]
    assert "  model: keras.model, 18 tensors" in shown["new"], shown["new"]
    assert "on jax, 6 variables, Adam state, ZeRO stage 2" in shown["new"], shown["new"]
    assert "consolidates into .keras" in shown["new"], shown["new"]
    assert "a sharded Keras checkpoint (format 'shardwise-keras-sharded'" in shown["old"], shown["old"]
