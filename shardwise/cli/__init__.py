"""The ``shardwise`` command: ``run``, ``check``, ``bench``, ``checkpoint`` and ``plan``.

This module holds the argument parser and the dispatch (:func:`main`, the console
script); :mod:`.launch` builds the launcher command lines and :mod:`.plan` is
``shardwise plan``. ``python -m shardwise.cli`` runs :func:`main` too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import signal
import subprocess
import sys
from typing import Optional, Sequence

from ..core.errors import ShardwiseError

__all__ = ["main"]


_ELASTIC_ONLY = ("min_np", "max_np", "nproc_per_node", "max_restarts", "rdzv_endpoint", "rdzv_id")


def _launch(argv: list[str], env: dict[str, str], dry_run: bool, shown: str) -> int:
    """Print ``shown`` (dry run) or run ``argv`` and return its exit status, passing on Ctrl-C."""
    if dry_run:
        print(shown)
        return 0
    proc = subprocess.Popen(argv, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        return proc.wait()


def _run_elastic(args: argparse.Namespace, command: list[str]) -> int:
    """``shardwise run --elastic``: the job under torchrun's elastic agent (this node's agent)."""
    import shlex

    from ..core.errors import ConfigError
    from .launch import build_torchrun_command, torchrun_env

    others = (("-np", args.np is not None), ("-H", args.hosts), ("--hostfile", args.hostfile),
              ("--horovodrun", args.horovodrun), ("--no-oversubscribe", args.no_oversubscribe))
    clashing = [flag for flag, given in others if given]
    if clashing:
        raise ConfigError(f"--elastic runs under torchrun, which takes no {', '.join(clashing)}: give "
                          "--min-np/--max-np (processes) and --nproc-per-node, and start it on every node")
    if args.min_np is None or args.max_np is None:
        raise ConfigError("--elastic needs --min-np N and --max-np M (numbers of processes)")
    argv = build_torchrun_command(command, min_np=args.min_np, max_np=args.max_np,
                                  nproc_per_node=args.nproc_per_node or 1,
                                  max_restarts=3 if args.max_restarts is None else args.max_restarts,
                                  rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                                  torchrun=[args.launcher] if args.launcher else None)
    env = torchrun_env()
    shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("SHARDWISE_BACKEND", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"))
    return _launch(argv, env, args.dry_run, f"{shown} {shlex.join(argv)}")


def _run(args: argparse.Namespace) -> int:
    from ..core.errors import ConfigError
    from .launch import build_command, find_launcher, launch_env

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.elastic:
        return _run_elastic(args, command)
    given = [name for name in _ELASTIC_ONLY if getattr(args, name) is not None]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} is an option of elastic jobs: add --elastic")
    if args.np is None:
        raise ConfigError("shardwise run needs -np N (or --elastic --min-np N --max-np M)")
    env = launch_env()
    if args.horovodrun:
        from .launch import build_horovodrun_command

        env.setdefault("SHARDWISE_BACKEND", "horovod")
        argv = build_horovodrun_command(args.np, command, hosts=args.hosts, hostfile=args.hostfile,
                                        path=args.launcher)
    else:
        launcher = find_launcher(args.launcher)
        argv = build_command(launcher, args.np, command, hosts=args.hosts, hostfile=args.hostfile,
                             oversubscribe=not args.no_oversubscribe, env=env)
    return _launch(argv, env, args.dry_run, " ".join(argv))


def _version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


_HOROVOD_PROBE = """
import importlib, json
out = {}
for fw in ("torch", "tensorflow"):
    try:
        importlib.import_module("horovod." + fw)
        out[fw] = "ok"
    except Exception as exc:
        out[fw] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
if out["torch"] == "ok":
    import horovod.torch as hvd
    out.update(mpi=hvd.mpi_built(), gloo=hvd.gloo_built(), nccl=hvd.nccl_built())
print(json.dumps(out))
"""


def _horovod_report() -> str:
    """Which Horovod frameworks import and which controllers it was built with (in a subprocess)."""
    try:
        out = subprocess.run([sys.executable, "-c", _HOROVOD_PROBE], capture_output=True, text=True,
                             timeout=180, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot probe: {exc}"
    import json

    try:
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return f"import crashed (exit {out.returncode}): {tail[:160]}"
    frameworks = ", ".join(f"horovod.{fw} {'imports' if v == 'ok' else 'fails: ' + v}"
                           for fw, v in info.items() if fw in ("torch", "tensorflow"))
    if "mpi" not in info:
        return frameworks
    controllers = "+".join(c for c in ("mpi", "gloo") if info[c]) or "none"
    return f"controllers {controllers}, nccl {'yes' if info['nccl'] else 'no'}; {frameworks}"


def _check(args: argparse.Namespace) -> int:
    from ..backends import backend_status
    from .launch import find_launcher

    print(f"shardwise      {_version('shardwise')}")
    print(f"python         {platform.python_version()} ({sys.executable})")
    for dist, label in (("numpy", "numpy"), ("torch", "torch"), ("tensorflow-cpu", "tensorflow-cpu"),
                        ("tensorflow", "tensorflow"), ("keras", "keras"), ("mpi4py", "mpi4py"),
                        ("horovod", "horovod")):
        version = _version(dist)
        if version != "not installed" or dist in ("numpy", "torch", "mpi4py"):
            print(f"{label:<14} {version}")
    try:
        launcher = find_launcher()
        print(f"launcher       {launcher.path} ({launcher.implementation} {launcher.version})")
    except ShardwiseError as exc:
        print(f"launcher       none: {exc}")
    if _version("mpi4py") != "not installed":
        try:
            out = subprocess.run([sys.executable, "-c",
                                  "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"],
                                 capture_output=True, text=True, timeout=60)
            lines = out.stdout.strip().splitlines() or out.stderr.strip().splitlines()[-1:] or ["?"]
            print(f"MPI library    {lines[0]}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"MPI library    unavailable: {exc}")
    if _version("horovod") != "not installed":
        print(f"horovod build  {_horovod_report()}")
    for name, status in backend_status().items():
        print(f"backend {name:<6} {status}")
    gpus = "none"
    if _version("torch") != "not installed":
        import torch

        if torch.cuda.is_available():
            gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print(f"GPUs           {gpus}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ..core.launch_env import detect_launch

    if detect_launch().size == 1 and args.np > 1:
        from .launch import build_command, find_launcher, launch_env

        env = launch_env()
        argv = build_command(find_launcher(), args.np,
                             [sys.executable, "-m", "shardwise.cli"] + [a for a in sys.argv[1:]], env=env)
        return subprocess.call(argv, env=env)
    from ..bench import allreduce_table

    allreduce_table(backend=args.backend, sizes=args.sizes, iters=args.iters, chunk_bytes=args.chunk_bytes)
    return 0


def _checkpoint_export(args: argparse.Namespace) -> int:
    from ..adapters.torch.checkpoint.convert import export_hf, from_dcp, to_dcp

    if args.format == "hf":
        out = export_hf(args.checkpoint, args.out)
        print(f"wrote {out}: a Hugging Face directory (AutoModelForCausalLM.from_pretrained loads it)")
    elif args.format == "dcp":
        out = to_dcp(args.checkpoint, args.out)
        print(f"wrote {out}: a torch.distributed.checkpoint directory ('model', 'optim')")
    else:
        out = from_dcp(args.checkpoint, args.out, args.step)
        print(f"wrote {out}: a shardwise checkpoint (ParallelModel.load_checkpoint loads it on any layout)")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    from .checkpoint import consolidate

    return consolidate(args)


def _checkpoint_info(args: argparse.Namespace) -> int:
    from .checkpoint import info

    return info(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description="Distributed training with shardwise.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a command on N ranks through mpirun/mpiexec (or torchrun, elastic)",
                         usage="shardwise run -np N [-H host:slots,...] [--hostfile F] -- COMMAND ...\n"
                               "       shardwise run --elastic --min-np N --max-np M [--nproc-per-node K] "
                               "[--max-restarts R] [--rdzv-endpoint host:port --rdzv-id ID] -- COMMAND ...")
    run.add_argument("-np", "--np", dest="np", type=int, help="number of ranks")
    run.add_argument("-H", "--hosts", help="hosts as host1:slots,host2:slots")
    run.add_argument("--hostfile", help="an MPI hostfile")
    run.add_argument("--launcher", help="path of mpirun/mpiexec, of horovodrun with --horovodrun, or of "
                                        "torchrun with --elastic (default: beside python, then PATH)")
    run.add_argument("--no-oversubscribe", action="store_true", help="refuse more ranks than cores")
    run.add_argument("--dry-run", action="store_true", help="print the launcher command and exit")
    run.add_argument("--horovodrun", action="store_true",
                     help="launch with 'horovodrun --gloo' and the horovod backend (mpirun + "
                          "SHARDWISE_BACKEND=horovod uses Horovod's MPI controller instead)")
    elastic = run.add_argument_group(
        "elastic jobs", "--elastic runs the job under torchrun's elastic agent (SHARDWISE_BACKEND=torch): start "
        "the same command on every node; nodes may leave and join between --min-np and --max-np processes, and "
        "hvd.elastic.run resumes from the last commit, kept in SHARDWISE_ELASTIC_DIR (with several nodes, a "
        "directory on a shared file system)")
    elastic.add_argument("--elastic", action="store_true", help="run under torchrun's elastic agent")
    elastic.add_argument("--min-np", type=int, help="fewest processes the job runs with")
    elastic.add_argument("--max-np", type=int, help="most processes the job runs with")
    elastic.add_argument("--nproc-per-node", type=int, help="processes each node's agent starts (default 1)")
    elastic.add_argument("--max-restarts", type=int, help="failures each agent restarts its workers after "
                                                          "(default 3; nodes joining do not count)")
    elastic.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous, the same on every node "
                                                 "(default for one node: 127.0.0.1:29400)")
    elastic.add_argument("--rdzv-id", help="the job's id, the same on every node, new for each job "
                                           "(default for one node: a fresh one)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    run.set_defaults(func=_run)

    check = sub.add_parser("check", help="report frameworks, MPI, backends and GPUs")
    check.set_defaults(func=_check)

    bench = sub.add_parser("bench", help="collective benchmarks (nccl-tests style)")
    bench.add_argument("what", choices=["allreduce"])
    bench.add_argument("--backend", default="auto")
    bench.add_argument("-np", "--np", dest="np", type=int, default=2,
                       help="ranks to launch when not already under a launcher")
    bench.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M", "4M", "16M", "64M"],
                       help="message sizes, e.g. 4K 1M 64M")
    bench.add_argument("--iters", type=int, default=20)
    bench.add_argument("--chunk-bytes", type=int, default=None, help="allreduce piece size (mpi backend)")
    bench.set_defaults(func=_bench)

    ckpt = sub.add_parser("checkpoint", help="sharded checkpoint tools")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    consolidate = ckpt_sub.add_parser("consolidate", help="merge a sharded checkpoint into one file: a torch ZeRO "
                                      "checkpoint into an fp32 state dict, a sharded Keras checkpoint into a .keras "
                                      "file")
    consolidate.add_argument("directory", help="a torch ZeRO checkpoint directory (with zero-meta.json), or a "
                                               "sharded Keras checkpoint (ckpt-<step>/, or a directory of them: "
                                               "the newest complete one)")
    consolidate.add_argument("out", help="output file: .pt (torch.save) or .npz for ZeRO, .keras for Keras")
    consolidate.set_defaults(func=_checkpoint)
    info = ckpt_sub.add_parser("info", help="what a checkpoint is (its format), its step, world size and contents, "
                               "read from its metadata")
    info.add_argument("directory", help="a checkpoint (ckpt-<step>/, a ZeRO directory), or a directory of them "
                                        "(the newest complete one)")
    info.set_defaults(func=_checkpoint_info)
    export = ckpt_sub.add_parser("export", help="convert a ParallelModel checkpoint, offline: to a Hugging Face "
                                 "directory (--hf), to DCP (--dcp), or from DCP (--from-dcp)")
    kind = export.add_mutually_exclusive_group(required=True)
    kind.add_argument("--hf", dest="format", action="store_const", const="hf",
                      help="write a save_pretrained directory (safetensors, config.json)")
    kind.add_argument("--dcp", dest="format", action="store_const", const="dcp",
                      help="write a torch.distributed.checkpoint directory")
    kind.add_argument("--from-dcp", dest="format", action="store_const", const="from-dcp",
                      help="read a DCP directory, write <out>/ckpt-<step>")
    export.add_argument("checkpoint", help="a ckpt-<step> directory, or a directory of them (the newest), or DCP")
    export.add_argument("out", help="output directory")
    export.add_argument("--step", type=int, default=0, help="step of the checkpoint written by --from-dcp")
    export.set_defaults(func=_checkpoint_export)

    from .plan import add_arguments as _plan_arguments, run as _plan_run

    plan = sub.add_parser("plan", help="rank dp/tp/pp/ZeRO strategies for a model on a cluster")
    _plan_arguments(plan)
    plan.set_defaults(func=_plan_run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``shardwise`` console script."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ShardwiseError as exc:
        print(f"shardwise: error: {exc}", file=sys.stderr)
        return 2
