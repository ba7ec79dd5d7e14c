"""Point-to-point messages for the ``mpi`` backend: send and recv as raw bytes (MPI tags)."""

from __future__ import annotations

from typing import Any

from ...core.comm import Handle
from .._arrays import host_view
from ._base import MPI, _bytes

__all__ = ["MPIPointToPoint"]


class MPIPointToPoint:
    """Mixin for :class:`~shardwise.backends.mpi.MPICommunicator` (uses its members and plumbing)."""

    # -- point to point --------------------------------------------------------------------
    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._size:
            raise ValueError(f"{what} {peer} is out of range for a group of size {self._size}")

    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        self._check_peer(dest, "send destination")
        if self.timeout is not None:
            self.send_async(tensor, dest, tag).wait()
            return
        self._comm.Send([_bytes(host_view(tensor).array), MPI.BYTE], dest=dest, tag=tag)

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        self._check_peer(dest, "send destination")
        view = host_view(tensor)
        buf = _bytes(view.array)  # the tensor's memory, or the host copy staged for it; only read
        return self._run("send", lambda block: [self._comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag)],
                         lambda: None, False)

    def recv(self, tensor: Any, source: int, tag: int = 0) -> Any:
        return self._recv(tensor, source, tag, True).wait()

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        return self._recv(tensor, source, tag, False)

    def _recv(self, tensor: Any, source: int, tag: int, blocking: bool) -> Handle:
        self._check_peer(source, "recv source")
        view = host_view(tensor)
        buf = [_bytes(view.array), MPI.BYTE]

        def start(block: bool) -> list:
            if block:
                self._comm.Recv(buf, source=source, tag=tag)
                return []
            return [self._comm.Irecv(buf, source=source, tag=tag)]

        def finish() -> Any:
            view.publish()
            return tensor

        return self._run(f"recv from rank {source}", start, finish, blocking)
