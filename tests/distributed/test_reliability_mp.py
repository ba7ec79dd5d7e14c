"""Reliability on real processes: no hangs, no silent corruption, no lost training.

Kept to a few short launches (2 ranks, 3 for the timeout): the machine is small and shared.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpi_harness import ROOT, run_mpi
from shardwise.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from shardwise.core.errors import CheckpointError

pytestmark = pytest.mark.mpi
SCRIPT = ROOT / "tests" / "distributed" / "reliability.py"


def _lines(output: str, tag: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"RELIABILITY {tag}")]


def _shardwise_run(np_: int, func: str, timeout: float, **kwargs: object) -> tuple[int, str, float]:
    """``shardwise run -np N -- python reliability.py func kwargs``: (exit code, output, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "shardwise.cli", "run", "-np", str(np_), "--", sys.executable, str(SCRIPT),
            func, json.dumps(kwargs)]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{func} hung: killed after {timeout:.0f} s\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - start


def test_shutdown_joins_the_torch_worker_threads() -> None:
    out = run_mpi(2, "reliability:shutdown_joins_torch_workers", timeout=60).output
    assert len(_lines(out, "joined")) == 2, out[-3000:]


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_mismatches_raise_on_every_rank_and_recover(backend: str) -> None:
    start = time.monotonic()
    out = run_mpi(2, "reliability:mismatches", backend=backend, timeout=60).output
    assert time.monotonic() - start < 30
    for what in ("shape", "skip", "gather"):
        lines = _lines(out, what)
        assert len(lines) == 2, out[-3000:]  # both ranks raised
        assert all(float(re.search(r" (\d+\.\d+)s: ", line).group(1)) < 10 for line in lines)
    assert len(_lines(out, "recovered")) == 2


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_timeout_names_the_missing_rank_and_ends_the_job(backend: str) -> None:
    code, out, took = _shardwise_run(3, "missing_rank", timeout=60, backend=backend, seconds=2.0)
    assert code != 0 and took < 30, out[-3000:]
    lines = _lines(out, "timeout")
    assert len(lines) == 2, out[-3000:]  # ranks 0 and 1 both name rank 2
    for line in lines:
        assert line.endswith("allreduce #2 'x' timed out after 2 s: ranks [2] never arrived"), line
    assert "unhandled exception, aborting the job" in out


def test_exception_on_one_rank_ends_the_job_with_one_traceback() -> None:
    code, out, took = _shardwise_run(2, "raise_on_rank1", timeout=60, backend="mpi")
    assert code != 0 and took < 30, out[-3000:]
    assert out.count("RuntimeError: boom on rank 1 at step 3") == 1, out[-3000:]
    assert out.count("Traceback (most recent call last)") == 1
    assert "[shardwise rank 1/2] unhandled exception, aborting the job" in out


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_kill_9_of_one_rank_ends_the_job(backend: str) -> None:
    code, out, _ = _shardwise_run(2, "kill_rank1", timeout=60, backend=backend)
    ended = time.time()
    assert code != 0, out[-3000:]
    killed = _lines(out, "killing rank 1 at ")
    assert killed, out[-3000:]
    latency = ended - float(killed[0].rsplit(" ", 1)[1])
    print(f"kill -9 -> job exit: {latency:.2f} s ({backend})")
    assert latency < 30


def test_crash_and_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    steps, every = 12, 4
    ck = tmp_path / "ck"
    crashed = run_mpi(2, "reliability:train", runs=[{"ckpt_dir": str(ck), "out": str(tmp_path / "x.npz"),
                                                     "crash_in_save": 8}],
                      steps=steps, every=every, expect_ok=False, timeout=90)
    assert crashed.returncode != 0 and _lines(crashed.output, "rank 1 dies while saving step 8"), crashed.output[-3000:]
    assert [s for s, _ in list_checkpoints(ck)] == [4, 8]
    with pytest.raises(CheckpointError, match="is incomplete: it has no manifest.json"):
        load_checkpoint(ck / "ckpt-8")
    assert latest_checkpoint(ck) == ck / "ckpt-4"

    # One launch: an uninterrupted run from scratch, then the resumed run.
    resumed = run_mpi(2, "reliability:train", runs=[
        {"ckpt_dir": str(tmp_path / "straight"), "out": str(tmp_path / "straight.npz")},
        {"ckpt_dir": str(ck), "out": str(tmp_path / "resumed.npz")}], steps=steps, every=every, timeout=90)
    assert len(_lines(resumed.output, "rank 0 starts at step 4")) == 1
    want, got = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(want.files) == sorted(got.files)
    for key in want.files:
        assert np.array_equal(want[key], got[key]), key  # bit-for-bit

    # A damaged newest checkpoint is refused, and the previous one is used.
    newest = ck / "ckpt-12" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="file 'model.pt' is truncated"):
        load_checkpoint(newest.parent)
    assert latest_checkpoint(ck) == ck / "ckpt-8"
