"""Run a scenario function on N real processes under mpirun and report per-rank failures.

A scenario is ``tests/distributed/<module>.py::<function>(**kwargs)``; each rank runs
it through ``tests/distributed/_runner.py``, which prints a rank-tagged traceback
and aborts the whole job when the scenario raises, so a failure never turns into
a hang. A wall-clock timeout kills the job if it hangs anyway.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from shardwise.cli.launch import build_command, find_launcher, launch_env

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "distributed" / "_runner.py"
_FAILURE = re.compile(r"^=+ SHARDWISE TEST FAILURE rank (\d+) =+$", re.M)


class MPIRunResult:
    def __init__(self, returncode: int, output: str) -> None:
        self.returncode = returncode
        self.output = output


def run_mpi(np: int, target: str, *, timeout: float = 120, expect_ok: bool = True,
            env: Optional[dict[str, str]] = None, **kwargs: Any) -> MPIRunResult:
    """Run ``module:function`` on ``np`` ranks; fail the test with each failing rank's traceback."""
    launcher = find_launcher()
    child_env = launch_env(dict(os.environ, **(env or {})))
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), child_env.get("PYTHONPATH")]))
    child_env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, str(RUNNER), target, json.dumps(kwargs)]
    argv = build_command(launcher, np, command, env=child_env)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{target} on {np} ranks hung: killed after {timeout:.0f} s\n{out[-4000:]}")
    result = MPIRunResult(proc.returncode, out)
    if expect_ok and proc.returncode != 0:
        ranks = sorted(set(_FAILURE.findall(out)))
        who = f"rank(s) {', '.join(ranks)} failed" if ranks else "the job failed"
        pytest.fail(f"{target} on {np} ranks: {who} (exit {proc.returncode})\n{out[-6000:]}")
    return result
