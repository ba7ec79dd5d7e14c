"""16 ranks on this 2-core machine (oversubscribed): DP, ZeRO-3 and the coordinator's named requests equal one process.

Runs ``benchmarks/scaling.py`` as a user would (its own ``mpirun --oversubscribe -np 16``): every
training step's loss against one process on the whole batch, every named allreduce's result,
and the coordinator's traffic per request, which with the response cache must not carry the
16 ranks' announcements (``benchmarks/README.md`` has the 16/32/64 table).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from mpi_harness import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(200)]


def test_sixteen_ranks_equal_one_process() -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--ranks", "16", "--rows", "dp,zero3,negotiation",
            "--steps", "2", "--reps", "3", "--timeout", "170"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"16 ranks hung: killed after 180 s\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    times = re.search(r"^\| 16 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| yes \|$", out, re.M)
    assert times, out[-3000:]
    counts = re.search(r"^\| 16 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| "
                       r"([0-9.]+) \| 4 \|$", out, re.M)
    assert counts, out[-3000:]
    rounds, messages, bytes_out, bytes_in = (float(g) for g in counts.groups())
    # log2(16) = 4 messages of a few bytes per agreement round (the names repeat: every one is cached)
    assert messages <= 5 * rounds and bytes_in <= 64 * rounds, counts.group(0)
    print(out)
