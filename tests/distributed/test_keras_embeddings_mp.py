"""Keras 3 sharded embedding bags under mpirun, on the torch and JAX Keras backends: ``model.fit`` with a
mixed plan (row-, column- and table-wise tables, sum and mean pooling, empty bags), SGD, Adagrad and row-wise
Adagrad (with per-id weights) on the tables, ends equal to one process with whole tables (on mpi collectives,
and on torch.distributed's); a bad id fails on every rank; a checkpoint saved on 4 torch-backend ranks resumes
on 2 JAX ranks with another plan, equal to an uninterrupted run; the JAX path runs without torch."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keras_matrix import env_for, keras_backends
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi]

CASES = [{"kind": "sgd"}, {"kind": "adagrad"}, {"kind": "rowwise_adagrad", "weighted": True}]
HERE = Path(__file__).resolve().parent
_MISSING = [m for m in ("torch", "jax") if importlib.util.find_spec(m) is None]


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("keras_backend", keras_backends("torch", "jax"))
def test_keras_sharded_tables_train_like_one_process(keras_backend: str, np_: int) -> None:
    result = run_mpi(np_, "keras_embeddings:cases", cases=CASES, timeout=240, env=env_for(keras_backend),
                     shared=True)
    lines = _ok_lines(result.output)
    want = f"on {np_} ranks ({keras_backend}, mpi collectives)"
    assert len(lines) == len(CASES) and all(want in line for line in lines), result.output[-3000:]
    assert f"rowwise_adagrad weighted on {np_} ranks ({keras_backend}" in result.output, result.output[-3000:]


@pytest.mark.parametrize("keras_backend", keras_backends("torch", "jax"))
def test_keras_bad_id_fails_on_every_rank(keras_backend: str) -> None:
    result = run_mpi(2, "keras_embeddings:bad_ids", timeout=120, env=env_for(keras_backend), shared=True)
    assert f"OK refused on every rank ({keras_backend}, 2 of 2): bad input on rank(s) [1]" in result.output, \
        result.output[-3000:]


@pytest.mark.parametrize("keras_backend", keras_backends("torch", "jax"))
def test_keras_sharded_tables_on_torch_distributed_collectives(keras_backend: str) -> None:
    """The same on shardwise's ``torch`` backend (gloo): a fresh job, since a shared one runs on ``mpi``."""
    result = run_mpi(2, "keras_embeddings:cases", cases=[{"kind": "adagrad", "backend": "torch"}], timeout=180,
                     env=env_for(keras_backend))
    assert f"on 2 ranks ({keras_backend}, torch collectives)" in result.output, result.output[-3000:]


@pytest.mark.skipif(bool(_MISSING), reason=f"{_MISSING} not installed")
@pytest.mark.parametrize("keras_backend", ["torch"])  # the saving side's: run in the torch block, its jobs warm
def test_keras_checkpoint_saved_on_4_torch_ranks_resumes_on_2_jax_ranks(tmp_path: Path, keras_backend: str) -> None:
    """Two launches: 4 torch-backend ranks (mixed plan) train 2 steps and save model and tables through the
    checkpoint door; 2 JAX ranks (another plan) load, train the other 2 and equal the uninterrupted reference."""
    directory = str(tmp_path / "ckpts")
    saved = run_mpi(4, "keras_embeddings:resume_save", directory=directory, timeout=240, env=env_for(keras_backend),
                    shared=True)
    want = "OK saved rowwise_adagrad tables (row_wise+column_wise+table_wise+row_wise) at step 2 on 4 ranks (torch)"
    assert want in saved.output, saved.output[-3000:]
    resumed = run_mpi(2, "keras_embeddings:resume_load", directory=directory, timeout=240, env=env_for("jax"),
                      shared=True)
    want = "OK resumed rowwise_adagrad tables at step 2 on 2 ranks (jax, column_wise+row_wise+row_wise+table_wise)"
    assert want in resumed.output, resumed.output[-3000:]
    assert "other tables refused on every rank" in resumed.output, resumed.output[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_keras_jax_path_runs_without_torch(tmp_path: Path) -> None:
    """One process on JAX with ``import torch`` failing (and recorded): the layer trains (weighted, row-wise
    Adagrad), checkpoints and loads, and no torch module is loaded."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import keras_embeddings as k; k.block_torch(); "
            f"k.jax_without_torch({str(tmp_path / 'ckpts')!r})")
    env = dict(os.environ, **env_for("jax"), PYTHONPATH=os.pathsep.join(
        [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    env.pop("SHARDWISE_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "OK jax without torch" in output, output[-3000:]
