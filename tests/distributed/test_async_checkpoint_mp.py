"""Background checkpoint saves on real ranks: equal to sync saves, training goes on, crash-safe."""

import json
from pathlib import Path

import pytest

from mpi_harness import run_mpi
from shardwise.checkpoint.store import latest_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_async_save_equals_sync_and_keeps_the_state_at_the_call(tmp_path: Path, backend: str) -> None:
    result = run_mpi(2, "async_checkpoint:equal_and_in_flight", backend=backend, directory=str(tmp_path),
                     timeout=180, shared=True)
    ok = [line for line in result.output.splitlines() if line.startswith(f"OK async {backend}")]
    assert len(ok) == 1, result.output[-3000:]
    assert "(threaded commit)" in ok[0], ok[0]  # mpi4py runs MPI at THREAD_MULTIPLE; torch: a gloo group


def test_deferred_commit_and_kill_during_background_save(tmp_path: Path) -> None:
    # One job, MPI at MPI_THREAD_SERIALIZED: on the mpi backend no collective may run on a second
    # thread, so saves commit at the next wait (deferred); then, on the torch backend (a gloo group
    # of its own for the background commit), both ranks are SIGKILLed while rank 0's file of step 2
    # is written and rank 1's is held back.
    result = run_mpi(2, "async_checkpoint:deferred_then_kill", directory=str(tmp_path), timeout=240,
                     env={"MPI4PY_RC_THREAD_LEVEL": "serialized"}, expect_ok=False)
    ok = [line for line in result.output.splitlines() if line.startswith("OK async mpi")]
    assert len(ok) == 1 and "(deferred commit)" in ok[0], result.output[-3000:]
    killed = "while the background save is in flight (threaded commit, torch backend)"
    assert result.output.count(killed) == 2 and result.returncode != 0, result.output[-3000:]
    root = tmp_path / "killed"
    assert (root / "ckpt-1" / "manifest.json").exists()
    assert (root / "ckpt-2" / "rank-00000.safetensors").exists()  # the kill came mid-save
    assert not (root / "ckpt-2" / "manifest.json").exists()
    assert latest_checkpoint(root) == root / "ckpt-1"
    manifest = json.loads((root / "ckpt-1" / "manifest.json").read_text())
    assert manifest["metadata"]["extra"] == {"next_batch": 1}
    # The newest complete checkpoint loads, and training resumed from it equals an uninterrupted run.
    resumed = run_mpi(2, "sharded_build:resume", backend="mpi", directory=str(root), family="gpt2",
                      fields={"dp": 2, "zero_stage": 3}, start=1, stop=2, save=False, kill=False,
                      optimizer="sgd", timeout=240, shared=True)
    assert "OK resume" in resumed.output, resumed.output[-3000:]
