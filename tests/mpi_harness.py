"""Run a scenario function on N real processes under mpirun and report per-rank failures.

A scenario is ``tests/distributed/<module>.py::<function>(**kwargs)``; each rank runs
it through ``tests/distributed/_runner.py``, which prints a rank-tagged traceback
and aborts the whole job when the scenario raises, so a failure never turns into
a hang. A wall-clock timeout kills the job if it hangs anyway.

``run_mpi(..., shared=True)`` runs the scenario in a job that stays up for the next
scenario with the same ranks and environment (the Keras tests: each rank's
``import keras`` costs 5-12 s on the CI machine). A failure or timeout ends that
job; the next test starts a fresh one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import pytest

from shardwise.cli.launch import build_command, find_launcher, launch_env

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "distributed" / "_runner.py"
_FAILURE = re.compile(r"^=+ SHARDWISE TEST FAILURE rank (\d+) =+$", re.M)
_END = re.compile(r"^===== SHARDWISE SCENARIO END (\d+) rank (\d+) =====$")  # _runner.END_MARKER
#: Shared jobs kept up at once (a 4-rank Keras job holds about 3 GB).
_MAX_SHARED = 2
#: Open MPI's launcher giving up before any rank starts, when PMIx cannot start its listener thread
#: (seen now and then on a busy machine, with "ptl_tool: problems getting address for index 0" in
#: Open MPI's own CI reports too). No scenario ran, so the job is simply started again.
_LAUNCH_FAILED = "The PMIx server's listener thread failed to start"
_LAUNCH_TRIES = 3


class _LaunchFailed(Exception):
    """mpirun failed before any rank ran (see :data:`_LAUNCH_FAILED`)."""


def _launch_failed(returncode: int, out: str) -> bool:
    return returncode != 0 and _LAUNCH_FAILED in out and not _FAILURE.search(out)


class MPIRunResult:
    def __init__(self, returncode: int, output: str) -> None:
        self.returncode = returncode
        self.output = output


def _child_env(env: Optional[dict[str, str]]) -> dict[str, str]:
    child_env = launch_env(dict(os.environ, **(env or {})))
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), child_env.get("PYTHONPATH")]))
    child_env.setdefault("OMP_NUM_THREADS", "1")
    return child_env


def _fail_job(target: str, np: int, returncode: int, out: str) -> None:
    ranks = sorted(set(_FAILURE.findall(out)))
    who = f"rank(s) {', '.join(ranks)} failed" if ranks else "the job failed"
    pytest.fail(f"{target} on {np} ranks: {who} (exit {returncode})\n{out[-6000:]}")


def _session(leader: int) -> list[int]:
    """The processes of the session ``leader`` started (``start_new_session``), on Linux."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[3]) == leader:
            members.append(int(entry.name))
    return members


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL an mpirun job, ranks included.

    OpenMPI puts each rank in a process group of its own, so killing mpirun's group
    would leave a hung rank running; every process of mpirun's session goes.
    """
    members = _session(proc.pid) if Path("/proc/self/stat").exists() else []
    for pid in [proc.pid, *members]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_mpi(np: int, target: str, *, timeout: float = 120, expect_ok: bool = True,
            env: Optional[dict[str, str]] = None, shared: bool = False, **kwargs: Any) -> MPIRunResult:
    """Run ``module:function`` on ``np`` ranks; fail the test with each failing rank's traceback.

    ``shared=True`` runs it in the shared job for ``np`` and ``env`` (see the module
    docstring); only for scenarios that leave no process-wide state behind.
    """
    if shared:
        if not expect_ok:
            raise ValueError("a scenario expected to fail ends its job: run it with shared=False")
        for attempt in range(_LAUNCH_TRIES):
            try:
                return SHARED_JOBS.get(np, env).run(target, kwargs, timeout, last_try=attempt == _LAUNCH_TRIES - 1)
            except _LaunchFailed:
                time.sleep(1.0)
        raise AssertionError("unreachable: the last try fails the test itself")
    child_env = _child_env(env)
    command = [sys.executable, str(RUNNER), target, json.dumps(kwargs)]
    argv = build_command(find_launcher(), np, command, env=child_env)
    for _ in range(_LAUNCH_TRIES):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env, cwd=ROOT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_job(proc)
            out, _ = proc.communicate()
            pytest.fail(f"{target} on {np} ranks hung: killed after {timeout:.0f} s\n{out[-4000:]}")
        if not _launch_failed(proc.returncode, out):
            break
        time.sleep(1.0)
    result = MPIRunResult(proc.returncode, out)
    if expect_ok and proc.returncode != 0:
        _fail_job(target, np, proc.returncode, out)
    return result


class _SharedJob:
    """One mpirun job whose ranks run the scenarios sent to them, one after another."""

    def __init__(self, np: int, env: Optional[dict[str, str]]) -> None:
        self.np = np
        self.commands = Path(tempfile.mkdtemp(prefix="shardwise-shared-job-"))
        self.sent = 0
        child_env = _child_env(env)
        command = [sys.executable, str(RUNNER), "--serve", str(self.commands), str(os.getpid())]
        argv = build_command(find_launcher(), np, command, env=child_env)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=child_env, cwd=ROOT, start_new_session=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        self.proc.wait()
        with self.changed:
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _send(self, command: Any) -> None:
        path = self.commands / f"{self.sent:05d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(command))
        os.replace(tmp, path)  # a rank never reads a half-written command
        self.sent += 1

    def run(self, target: str, kwargs: dict, timeout: float, last_try: bool = True) -> MPIRunResult:
        with self.changed:
            start = len(self.lines)
        index = self.sent
        self._send({"target": target, "kwargs": kwargs})
        try:
            ended, out = self._wait_for_end(index, start, timeout)
        except BaseException:  # pytest-timeout or ^C while the ranks still run this scenario
            self.kill()
            raise
        if ended:
            return MPIRunResult(0, "".join(line for line in out.splitlines(keepends=True) if not _END.match(line)))
        if self.alive():
            self.kill()
            pytest.fail(f"{target} on {self.np} ranks (shared job) hung: killed after {timeout:.0f} s\n{out[-4000:]}")
        self.reader.join(timeout=10)
        with self.changed:
            out = "".join(self.lines[start:])
        if index == 0 and not last_try and _launch_failed(self.proc.returncode, out):
            raise _LaunchFailed(out)
        _fail_job(target, self.np, self.proc.returncode, out)
        raise AssertionError("unreachable")  # pytest.fail raises

    def _wait_for_end(self, index: int, start: int, timeout: float) -> tuple[bool, str]:
        """Whether every rank ended scenario ``index`` before the timeout or the job's end; its output so far."""
        deadline = time.monotonic() + timeout
        ended: set[str] = set()
        seen = start
        with self.changed:
            while True:
                for line in self.lines[seen:]:
                    hit = _END.match(line.rstrip("\n"))
                    if hit and int(hit.group(1)) == index:
                        ended.add(hit.group(2))
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if len(ended) == self.np or left <= 0 or not self.reader.is_alive():
                    return len(ended) == self.np, "".join(self.lines[start:])
                self.changed.wait(min(left, 1.0))

    def kill(self) -> None:
        _kill_job(self.proc)

    def close(self) -> None:
        """Let the ranks leave their loop and exit; kill them if they do not within 30 s."""
        if self.alive():
            self._send(None)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.commands, ignore_errors=True)


class _SharedJobs:
    """The shared jobs kept up, by ranks and environment; the least recently used closes first."""

    def __init__(self) -> None:
        self.jobs: OrderedDict[tuple, _SharedJob] = OrderedDict()

    def get(self, np: int, env: Optional[dict[str, str]]) -> _SharedJob:
        key = (np, tuple(sorted((env or {}).items())))
        job = self.jobs.pop(key, None)
        if job is not None and not job.alive():
            job.close()
            job = None
        if job is None:
            while len(self.jobs) >= _MAX_SHARED:
                self.jobs.popitem(last=False)[1].close()
            job = _SharedJob(np, env)
        self.jobs[key] = job
        return job

    def close_all(self) -> None:
        while self.jobs:
            self.jobs.popitem(last=False)[1].close()


#: This test session's shared jobs (the only state the harness keeps between tests).
SHARED_JOBS = _SharedJobs()


def close_shared_jobs() -> None:
    """End every shared job (conftest calls this when the session finishes)."""
    SHARED_JOBS.close_all()
