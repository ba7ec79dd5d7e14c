"""Keras 3 sharded embedding bags under mpirun, on the torch and JAX Keras backends: ``model.fit`` with a
mixed plan (row-, column- and table-wise tables, sum and mean pooling, empty bags), SGD and Adagrad on the
tables, ends equal to one process with whole tables (on mpi collectives, and on torch.distributed's); a bad id
fails on every rank."""

import pytest

from keras_matrix import env_for, keras_backends
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi]

CASES = [{"kind": "sgd"}, {"kind": "adagrad"}]


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
