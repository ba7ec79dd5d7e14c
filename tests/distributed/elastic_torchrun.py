"""Driver for the torchrun elastic test: ``python elastic_torchrun.py CONFIG_JSON`` prints a JSON verdict.

Three torchrun agents on this machine play three nodes of one job (``--nnodes=2:3``,
one worker each, c10d rendezvous hosted by the first agent). The worker of rank
``kill_rank`` SIGKILLs its agent and itself mid-epoch (``elastic_train.train``
with ``kill_parent``); the two survivors' agents re-form the job, their new workers
resume from the commit on disk. Once a commit of the 2-node job is on disk the
driver starts a fourth agent: the job grows back to 3 and finishes. Each worker of
the last incarnation writes its result; the verdict compares them with a
one-process replay of the committed log.

``python elastic_torchrun.py --worker CONFIG_JSON OUT_DIR`` is the worker (what the agents run).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import elastic_train  # noqa: E402

RDZV_CONF = "last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=180"


def worker(config: dict, out_dir: str) -> None:
    """One worker: train, then write this rank's result (only the last incarnation gets here)."""
    pids = Path(out_dir).parent / "pids"
    pids.mkdir(exist_ok=True)
    (pids / str(os.getpid())).touch()  # so that the driver can end workers its agents left behind
    result = elastic_train.train(config)
    result.update(rank=int(os.environ["RANK"]), restart_count=int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                  pid=os.getpid(), agent_pid=os.getppid())
    path = Path(out_dir) / f"result-{result['rank']}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(result))
    os.replace(tmp, path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun() -> list[str]:
    beside = Path(sys.executable).parent / "torchrun"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "torch.distributed.run"]


class Job:
    """The agents of one torchrun job, each in its own process group, with a log file each."""

    def __init__(self, config: dict, work: Path) -> None:
        self.config, self.work = config, work
        self.port, self.run_id = _free_port(), f"shardwise-test-{uuid.uuid4().hex[:12]}"
        self.commits = work / "commits"
        self.results = work / "results"
        self.results.mkdir(parents=True)
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: see shardwise.cli.launch.torchrun_env (what shardwise run --elastic sets)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", SHARDWISE_BACKEND="torch", PYTHONUNBUFFERED="1",
                        LOGLEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                        SHARDWISE_ELASTIC_DIR=str(self.commits),
                        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent),
                                                    os.environ.get("PYTHONPATH", "")]))
        self.agents: list[subprocess.Popen] = []

    def start_agent(self, is_host: bool) -> subprocess.Popen:
        index = len(self.agents)
        argv = _torchrun() + ["--nnodes=2:3", "--nproc-per-node=1", "--max-restarts=8",
                              "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
                              f"--rdzv-id={self.run_id}", f"--rdzv-conf=is_host={int(is_host)},{RDZV_CONF}",
                              "--monitor-interval=0.2", f"--log-dir={self.work / f'torchelastic-{index}'}",
                              str(Path(__file__).resolve()), "--worker",
                              json.dumps(dict(self.config, kill_parent=True)), str(self.results)]
        log = open(self.work / f"agent-{index}.log", "wb")
        proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.agents.append(proc)
        return proc

    def commit_meta(self) -> Optional[dict]:
        """World size and log of the commit on disk (None before the first, or while rank 0 replaces it)."""
        from shardwise.adapters.torch.tensor_codec import TORCH_CODEC
        from shardwise.core.errors import CheckpointError
        from shardwise.elastic.persist import CommitFile

        try:
            record = CommitFile(self.commits, codecs=[TORCH_CODEC]).load_record()
        except (CheckpointError, OSError):  # rank 0 pruned the commit while it was read
            return None
        if record is None:
            return None
        return {"world_size": record["meta"].get("world_size"), "log": record["payload"]["attributes"]["log"]}

    def stop(self) -> None:
        """End the agents (SIGTERM: they stop their workers; then SIGKILL), then any worker still alive."""
        live = [p for p in self.agents if p.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid_file in (self.work / "pids").glob("*"):
            try:
                cmdline = Path(f"/proc/{pid_file.name}/cmdline").read_bytes()
            except OSError:
                continue
            if str(self.results).encode() in cmdline:
                try:
                    os.kill(int(pid_file.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def tail(self, lines: int = 40) -> str:
        out = []
        for log in sorted(self.work.glob("agent-*.log")):
            text = log.read_text(errors="replace").splitlines()
            out.append(f"--- {log.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


def _wait(what: str, done: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = done()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def drive(job: Job) -> dict:
    """Run the scenario; the verdict as a JSON-ready dict."""
    started = time.monotonic()
    for i in range(3):
        job.start_agent(is_host=i == 0)
    dead = _wait("an agent to die", lambda: [i for i, p in enumerate(job.agents) if p.poll() is not None], 80)
    killed_at = time.monotonic()
    codes = {i: job.agents[i].returncode for i in dead}
    if codes != {dead[0]: -signal.SIGKILL} or len(dead) != 1:
        raise RuntimeError(f"expected one agent SIGKILLed by its worker, got exit codes {codes}")
    shrunk = _wait("a commit of the 2-node job", lambda: (m := job.commit_meta()) and m["world_size"] == 2 and m, 80)
    reformed_at = time.monotonic()
    job.start_agent(is_host=False)
    _wait("every agent to finish", lambda: all(p.poll() is not None for p in job.agents), 90)
    finished_at = time.monotonic()
    codes = [p.returncode for p in job.agents]
    results = [pickle.loads(p.read_bytes()) for p in sorted(job.results.glob("result-*.pkl"))]
    if sorted(r["rank"] for r in results) != [0, 1, 2]:
        raise RuntimeError(f"results from ranks {[r['rank'] for r in results]}, agent exit codes {codes}")
    log = results[0]["log"]
    reference = elastic_train.replay(log)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(results[0]["params"], reference))
    agree = all(r["log"] == log and all(np.array_equal(a, b) for a, b in zip(r["params"], results[0]["params"]))
                for r in results)
    elastic_train.check_epochs(log)
    sizes = [w for _, w, _ in log]
    return {"agent_exit_codes": codes, "killed_agent": dead[0],
            "size_changes": [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s],
            "steps_per_size": {str(s): sizes.count(s) for s in sorted(set(sizes))},
            "max_diff": worst, "ranks_agree": agree, "final_size": results[0]["size"], "steps": len(log),
            "first_2_node_commit_step": len(shrunk["log"]), "restart_counts": [r["restart_count"] for r in results],
            "resets": [r["resets"] for r in results], "commit_left": any(job.commits.glob("ckpt-*")),
            "seconds_to_kill": killed_at - started, "recovery_seconds": reformed_at - killed_at,
            "regrow_and_finish_seconds": finished_at - reformed_at, "seconds": finished_at - started}


def main() -> None:
    if sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), sys.argv[3])
        return
    config = json.loads(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timed-out test still ends its agents
    work = Path(tempfile.mkdtemp(prefix="elastic-torchrun-"))
    job = Job(config, work)
    try:
        verdict = drive(job)
    except Exception as exc:
        job.stop()
        print(f"driver failed: {type(exc).__name__}: {exc} (logs in {work})\n{job.tail()}", file=sys.stderr)
        sys.exit(1)
    finally:
        job.stop()
    if os.environ.get("ELASTIC_DEBUG"):
        verdict["work_dir"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(verdict))


if __name__ == "__main__":
    main()
