"""mpirun's rsh agent for Spark jobs: ``python -m shardwise.spark._mpi_rsh [OPTIONS] HOST COMMAND...``.

PRRTE calls its ``plm_ssh_agent`` as it would call ssh, to start its daemon on HOST.
Instead of logging in, this agent puts COMMAND in the job's store (its address and
secret are in mpirun's environment, :data:`~shardwise.spark._mpi.STORE_ENV`), where
the first Spark task on HOST picks it up and runs it as its own child. The agent
stays up while the command runs, as ssh would, and exits with its exit code. If
mpirun stops the agent (SIGTERM, SIGINT, SIGHUP), it asks the task to kill the
command. As Horovod's ``horovod.spark.driver.mpirun_rsh``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from typing import Sequence

from ..backends.rendezvous.store import StoreClient
from ._mpi import END_KEY, HOSTS_KEY, SECRET_ENV, STORE_ENV, rsh_key

_POLL = 0.5


def split_args(argv: Sequence[str]) -> tuple[str, str]:
    """(host, command) from an ssh-style argument list; ssh options before the host are ignored."""
    args = list(argv)
    while args and args[0].startswith("-"):
        args.pop(0)
    if len(args) < 2:
        raise SystemExit("usage: python -m shardwise.spark._mpi_rsh [OPTIONS] HOST COMMAND...")
    return args[0], " ".join(args[1:])


def host_index(host: str, hosts: Sequence[str]) -> int:
    """Which of the job's hosts mpirun means by ``host`` (the same name, else the same address)."""
    if host in hosts:
        return list(hosts).index(host)

    def address(name: str) -> str:
        try:
            return socket.gethostbyname(name)
        except OSError:
            return name

    wanted = address(host)
    for i, h in enumerate(hosts):
        if address(h) == wanted:
            return i
    raise SystemExit(f"shardwise.spark._mpi_rsh: {host!r} is none of the job's hosts {list(hosts)}")


def main(argv: Sequence[str]) -> int:
    host, command = split_args(argv)
    addr, _, port = os.environ[STORE_ENV].rpartition(":")
    store = StoreClient(addr, int(port), os.environ[SECRET_ENV])
    i = host_index(host, json.loads(store.get(HOSTS_KEY)))
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    store.set(rsh_key(i, "cmd"), command.encode())
    while not stop.is_set():
        try:
            if store.check([rsh_key(i, "exit")]):
                return int(store.get(rsh_key(i, "exit"), timeout=1.0))
            if store.check([END_KEY]):
                return 0
        except Exception:  # noqa: BLE001 - the store is gone: the job is over
            return 255
        stop.wait(_POLL)
    try:
        store.set(rsh_key(i, "kill"), b"1")
    except Exception:  # noqa: BLE001 - nothing more to do if the store is gone
        pass
    return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
