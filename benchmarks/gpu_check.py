"""Multi-rank device check: shardwise's training paths on 2 ranks, each against one process on the same device.

    python benchmarks/gpu_check.py                  # --device cuda (what benchmarks/gpu_check.sh runs)
    python benchmarks/gpu_check.py --device cpu     # the same cases on the CPU

The cases are the functions of ``tests/distributed/device_scenarios.py``, the ones CI runs on
the CPU (``tests/distributed/test_device_scenarios_mp.py``): DP (``DistributedOptimizer``,
``DistributedDataParallel``), ZeRO 1/2/3 with global-norm clipping in fp32 and with bf16
parameters (fp32 masters), the pipeline schedules (GPipe, 1F1B, interleaved) at pp=2,
``parallelize`` dp2 / tp2 / pp2 on a small GPT-2 and the elastic state's commit and restore
(``DistributedOptimizer`` and ZeRO-3). Each rank trains through shardwise and, on the same
device, the same model in one process on the global batch, and compares.

The ranks are started by ``mpirun`` as ``shardwise run -np 2`` starts them
(:func:`shardwise.cli.launch.build_command`), once per backend. On CUDA each rank takes
``cuda:local_rank % device_count``, so with one GPU both ranks share it, over ``mpi`` (the mpi
backend, CUDA tensors staged through host memory) and ``gloo`` (the torch backend on a gloo
group), both with CUDA tensors; with a GPU per rank also over ``mpi-nccl`` (the mpi backend
routing CUDA tensors through NCCL) and ``torch`` (NCCL, as ``shardwise.init`` sets it up). On
the CPU: ``mpi`` and ``torch`` (gloo). A case that fails or hangs (``--timeout``) ends its job
and the cases after it run in a fresh one; cases not finished within ``--budget`` (470 s) fail.

Printed: a row per backend and case: PASS/FAIL, the largest difference from one process, the
median step time (device synchronised, first step left out; the slower rank), the one-process
step time on the global batch, and the peak memory of the shardwise run
(``torch.cuda.max_memory_allocated`` on CUDA, ``VmHWM`` on the CPU, above the start of the case;
the larger rank). Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "tests" / "distributed"
TAG = "GPUCHECK "
#: Backends of the check: the scenario backend each runs on and the environment it adds. ``mpi``
#: keeps CUDA tensors on MPI (staged through host memory), ``mpi-nccl`` routes them through an
#: NCCL group built from the MPI world (``shardwise.backends.mpi._device_route``; a GPU per rank).
BACKENDS = {"mpi": ("mpi", {"SHARDWISE_DEVICE_ENGINE": "off"}),
            "mpi-nccl": ("mpi", {"SHARDWISE_DEVICE_ENGINE": "nccl"}),
            "gloo": ("gloo", {}), "torch": ("torch", {})}


# -- one rank (started by the launcher) ---------------------------------------------------------------
def worker(backend: str, device: str, cases: list[str], steps: int) -> None:
    """Run ``cases`` on this rank; print a tagged JSON line per event; abort the job on a failure."""
    sys.path.insert(0, str(SCENARIOS))
    import device_scenarios

    current = {"case": None}

    def report(case: str, row: dict) -> None:
        current["case"] = case if row["event"] == "start" else None
        if _rank() == 0:
            print(TAG + json.dumps({"case": case, **row}), flush=True)

    try:
        device_scenarios.run_cases(backend, device, cases, steps, report=report)
    except BaseException as exc:  # noqa: BLE001 - any failure ends the job: a peer may wait in a collective
        import traceback

        traceback.print_exc()
        print(TAG + json.dumps({"case": current["case"], "event": "fail", "rank": _rank(),
                                "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
        sys.stderr.flush()
        import shardwise

        if shardwise.is_initialized():
            shardwise.current().world.abort(1)
        os._exit(1)


def _rank() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


# -- the driver ---------------------------------------------------------------------------------------------
def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process of its session (OpenMPI gives each rank a process group)."""
    import signal

    members = [proc.pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[3]) == proc.pid:
                members.append(int(entry.name))
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class Job:
    """One launcher job of the workers on ``cases``; yields their events, kills it on a hang."""

    def __init__(self, np: int, backend: str, device: str, cases: list[str], steps: int, log: Path) -> None:
        from shardwise.cli.launch import build_command, find_launcher, launch_env

        scenario_backend, extra = BACKENDS[backend]
        env = launch_env(dict(os.environ, **extra))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--backend", scenario_backend,
                   "--device", device, "--cases", ",".join(cases), "--steps", str(steps)]
        argv = build_command(find_launcher(), np, command, env=env)
        self.log = log.open("a", encoding="utf-8")
        self.log.write(f"$ {' '.join(argv)}\n")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=ROOT, start_new_session=True)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.tail: list[str] = []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def events(self, timeout: float, deadline: float) -> Any:
        """Each tagged event; then ``{"event": "end", "code": rc}``, or ``{"event": "hung"}`` after
        ``timeout`` seconds without one or at ``deadline`` (the job killed)."""
        wait_until = min(time.monotonic() + timeout, deadline)
        while True:
            try:
                line = self.lines.get(timeout=max(wait_until - time.monotonic(), 0.01))
            except queue.Empty:
                _kill(self.proc)
                yield {"event": "hung"}
                return
            if line is None:
                yield {"event": "end", "code": self.proc.wait()}
                return
            self.log.write(line)
            self.tail = (self.tail + [line.rstrip()])[-20:]
            if line.startswith(TAG):
                wait_until = min(time.monotonic() + timeout, deadline)
                yield json.loads(line[len(TAG):])

    def close(self) -> None:
        if self.proc.poll() is None:
            _kill(self.proc)
        self.log.close()


def check_backend(np: int, backend: str, device: str, cases: list[str], steps: int, timeout: float,
                  deadline: float, log: Path, table: "Table") -> None:
    """Run ``cases`` on ``backend``; after a case fails or hangs, the rest go on in a new job.

    ``timeout``: seconds a case (or the set-up) may take; ``deadline`` (``time.monotonic()``):
    the cases not finished by then fail as not run."""
    remaining = list(cases)
    while remaining:
        left = deadline - time.monotonic()
        if left <= 0:
            for rest in remaining:
                table.add(backend, rest, "FAIL", {"detail": "not run: the time budget (--budget) is spent"})
            return
        job = Job(np, backend, device, remaining, steps, log)
        current: Optional[str] = None
        try:
            for ev in job.events(timeout, deadline):
                case, kind = ev.get("case") or current, ev["event"]
                if kind == "start":
                    current = case
                    continue
                if kind == "pass":
                    table.add(backend, case, "PASS", ev)
                    remaining.remove(case)
                    current = None
                    continue
                # "fail", "hung" or "end": this job is over
                if kind == "end" and not remaining:
                    if ev["code"]:
                        table.add(backend, "(exit)", "FAIL", {"detail": _why(ev, job, timeout, deadline)})
                else:
                    failed = [case] if case else list(remaining)  # no case begun: the set-up failed
                    for name in failed:
                        table.add(backend, name, "FAIL", {"detail": _why(ev, job, timeout, deadline)})
                    remaining = [n for n in remaining if n not in failed]
                break
        finally:
            job.close()


def _why(ev: dict, job: Job, timeout: float, deadline: float) -> str:
    """The reason a job ended a case: a rank's error, a hang, or an exit."""
    if ev["event"] == "fail":
        return f"rank {ev.get('rank')}: {ev.get('error')}"
    if ev["event"] == "hung":
        late = time.monotonic() >= deadline
        return ("still running when the time budget was spent" if late else f"no progress in {timeout:.0f} s") + \
            ": killed"
    return f"the job ended (exit {ev.get('code')}): {' | '.join(job.tail[-3:])}"


class Table:
    """The rows as they come, printed at once and counted."""

    HEADER = (f"{'backend':<8} {'case':<17} {'result':<6} {'max diff':>9} {'step ms':>9} {'1-proc ms':>9} "
              f"{'peak MiB':>9}  note")

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        print(self.HEADER, flush=True)

    def add(self, backend: str, case: str, result: str, ev: dict) -> None:
        self.rows.append((backend, case, result))
        if result == "PASS":
            line = (f"{backend:<8} {case:<17} {result:<6} {ev['diff']:9.1e} {ev['step_ms']:9.2f} "
                    f"{ev['reference_ms']:9.2f} {ev['peak_mib']:9.1f}  {ev.get('detail', '')}")
        else:
            line = f"{backend:<8} {case:<17} {result:<6} {'':>9} {'':>9} {'':>9} {'':>9}  {ev['detail'][:300]}"
        print(line.rstrip(), flush=True)

    @property
    def failed(self) -> int:
        return sum(r[2] != "PASS" for r in self.rows)


def default_backends(device: str, np: int) -> list[str]:
    """cpu: mpi, torch (gloo); cuda: mpi and gloo (ranks may share a GPU), and with a GPU per
    rank also mpi-nccl and torch (NCCL, which needs a GPU of its own for each rank)."""
    if device == "cpu":
        return ["mpi", "torch"]
    import torch

    return ["mpi", "gloo"] + (["mpi-nccl", "torch"] if torch.cuda.device_count() >= np else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--backends", help=f"comma-separated, of {', '.join(BACKENDS)} (default: see the docstring)")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--np", type=int, default=2, help="ranks (an even number; default 2)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per case (default 6)")
    parser.add_argument("--timeout", type=float, default=150, help="seconds a case may take (default 150)")
    parser.add_argument("--budget", type=float, default=470,
                        help="seconds for the whole check; cases not run by then fail (default 470)")
    parser.add_argument("--log", default=None, help="the jobs' output (default /tmp/gpu_check-<time>.log)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.np < 2 or args.np % 2:
        parser.error(f"--np must be an even number of ranks (the cases split in two), got {args.np}")
    if args.worker:
        worker(args.backend, args.device, args.cases.split(","), args.steps)
        return
    sys.path.insert(0, str(SCENARIOS))
    sys.path.insert(0, str(ROOT))
    import torch

    from device_scenarios import CASES

    cases = args.cases.split(",") if args.cases else list(CASES)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("FAIL: --device cuda but torch.cuda.is_available() is False (--device cpu runs here)")
    backends = args.backends.split(",") if args.backends else default_backends(args.device, args.np)
    if sorted(set(backends) - set(BACKENDS)):
        parser.error(f"unknown backend(s) {sorted(set(backends) - set(BACKENDS))}; known: {', '.join(BACKENDS)}")
    log = Path(args.log or f"/tmp/gpu_check-{time.strftime('%Y%m%d-%H%M%S')}.log")
    gpus = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "cpu")
    print(f"# gpu_check: {args.np} ranks on {gpus}, backends {', '.join(backends)}, torch {torch.__version__}, "
          f"{args.steps} steps per case, TF32 off; log {log}", flush=True)
    t0 = time.monotonic()
    table = Table()
    for backend in backends:
        check_backend(args.np, backend, args.device, cases, args.steps, args.timeout, t0 + args.budget, log, table)
    print(f"{len(table.rows) - table.failed}/{len(table.rows)} PASS in {time.monotonic() - t0:.0f} s", flush=True)
    sys.exit(1 if table.failed else 0)


if __name__ == "__main__":
    main()
