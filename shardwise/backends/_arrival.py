"""Arrival handshake with a deadline: who reached a collective, and did they all agree?

Two ways, both ending in a :class:`CollectiveTimeoutError` that names the missing ranks.

:func:`arrive` (point-to-point, used for MPI): every rank sends its call descriptor to rank 0 with a non-blocking point-to-point
message on a reserved tag and waits for rank 0's verdict. Rank 0 collects
descriptors until the deadline; if some never come it tells the ranks that did
come *which* ranks are missing, so every waiting rank raises the same
:class:`CollectiveTimeoutError` naming them. Rank 0 itself missing is seen by the
others after twice the timeout (they allow rank 0 a full timeout of lateness).

Costs one message each way per rank (rank 0 handles ``size - 1`` of each).

:func:`store_arrive` (key-value store, used for torch): gloo closes *every*
connection of a process once one wait times out, so nothing can be told to the
others afterwards. Instead each rank posts its descriptor under
``<prefix>/<seq>/<rank>`` in the rendezvous store and waits for all keys; on
expiry each rank reads which keys are absent. Costs a few store round trips.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Optional, Sequence

import numpy as np

from ..core.comm import Communicator, Handle
from ..core.errors import CollectiveTimeoutError

__all__ = ["HANDSHAKE_TAG", "arrive", "store_arrive", "timeout_message"]

#: Point-to-point tag reserved for the handshake on checked communicators (within MPI's minimum TAG_UB).
HANDSHAKE_TAG = 32_001
_OK, _MISMATCH, _TIMEOUT = 0, 1, 2
#: Busy-poll this long before falling back to the handle's (sleeping) timed wait.
_SPIN = 1e-3
#: Shortest wait granted per message once the deadline has passed (to pick up what already came).
_MIN_WAIT = 0.01


def timeout_message(label: str, timeout: float, missing: Sequence[int]) -> str:
    """``allreduce #7 'x' timed out after 5 s: ranks [1] never arrived``."""
    return f"{label} timed out after {timeout:g} s: ranks {sorted(missing)} never arrived"


def _collect(handles: dict[int, Handle], deadline: float) -> set[int]:
    """Complete what finishes before ``deadline``; return the keys that did not.

    Spins on ``done()`` briefly, then waits with a timeout rather than polling: gloo's
    point-to-point work objects only learn of completion inside ``wait``.
    """
    missing = set()
    for key, handle in handles.items():
        spin_until = min(time.monotonic() + _SPIN, deadline)
        while time.monotonic() < spin_until and not handle.done():
            pass  # ranks usually arrive within microseconds of each other: don't pay a sleep
        try:
            handle.wait(max(deadline - time.monotonic(), _MIN_WAIT))
        except CollectiveTimeoutError:
            missing.add(key)
    return missing


def arrive(comm: Communicator, vec: np.ndarray, timeout: float, label: str) -> bool:
    """Meet every rank of ``comm`` at this call; True if all descriptors equal ``vec``.

    Raises :class:`CollectiveTimeoutError` naming the ranks that did not arrive in time.
    """
    if comm.rank == 0:
        return _coordinate(comm, vec, timeout, label)
    return _report(comm, vec, timeout, label)


def _coordinate(comm: Communicator, vec: np.ndarray, timeout: float, label: str) -> bool:
    bufs = {r: np.empty_like(vec) for r in range(1, comm.size)}
    handles = {r: comm.recv_async(buf, r, HANDSHAKE_TAG) for r, buf in bufs.items()}
    missing = _collect(handles, time.monotonic() + timeout)
    if missing:
        flags = np.ones(comm.size, dtype=np.int64)
        flags[sorted(missing)] = 0
        verdict = np.array([_TIMEOUT, vec[1]], dtype=np.int64)
        sends = []
        for r in sorted(set(bufs) - missing):
            sends += [comm.send_async(verdict, r, HANDSHAKE_TAG), comm.send_async(flags, r, HANDSHAKE_TAG)]
        _collect(dict(enumerate(sends)), time.monotonic() + min(timeout, 5.0))
        raise CollectiveTimeoutError(timeout_message(label, timeout, missing))
    agree = all(np.array_equal(buf, vec) for buf in bufs.values())
    verdict = np.array([_OK if agree else _MISMATCH, vec[1]], dtype=np.int64)
    sends = [comm.send_async(verdict, r, HANDSHAKE_TAG) for r in bufs]
    late = _collect(dict(enumerate(sends)), time.monotonic() + timeout)
    if late:
        raise CollectiveTimeoutError(f"{label}: rank 0 could not deliver the arrival verdict within "
                                     f"{timeout:g} s to ranks {sorted(late)}")
    return agree


def _report(comm: Communicator, vec: np.ndarray, timeout: float, label: str) -> bool:
    verdict = np.empty(2, dtype=np.int64)
    got = comm.recv_async(verdict, 0, HANDSHAKE_TAG)
    sent = comm.send_async(vec, 0, HANDSHAKE_TAG)
    if _collect({0: got}, time.monotonic() + 2 * timeout):
        raise CollectiveTimeoutError(
            f"{label} timed out after {2 * timeout:g} s: ranks [0] never arrived (rank 0 collects the "
            "arrivals, so whether other ranks are missing too is unknown)")
    if _collect({0: sent}, time.monotonic() + timeout):
        raise CollectiveTimeoutError(f"{label}: the arrival message to rank 0 did not complete in {timeout:g} s")
    if verdict[0] == _TIMEOUT:
        flags = np.empty(comm.size, dtype=np.int64)
        if _collect({0: comm.recv_async(flags, 0, HANDSHAKE_TAG)}, time.monotonic() + timeout):
            raise CollectiveTimeoutError(f"{label} timed out after {timeout:g} s: some ranks never arrived "
                                         "(rank 0 could not send the list)")
        raise CollectiveTimeoutError(timeout_message(label, timeout, np.flatnonzero(flags == 0).tolist()))
    return bool(verdict[0] == _OK and verdict[1] == vec[1])


def store_arrive(store: Any, prefix: str, rank: int, size: int, vec: np.ndarray, timeout: float, label: str,
                 previous_seq: Optional[int]) -> np.ndarray:
    """Every rank's descriptor through a ``torch.distributed`` store; raise naming absent ranks."""
    keys = [f"{prefix}/{int(vec[1])}/{r}" for r in range(size)]
    store.set(keys[rank], vec.tobytes())
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch.distributed.DistStoreError
        if "timeout" not in str(exc).lower():
            raise
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise CollectiveTimeoutError(timeout_message(label, timeout, missing)) from None
    table = np.stack([np.frombuffer(raw, dtype=np.int64) for raw in store.multi_get(keys)])
    if previous_seq is not None:  # every rank got here, so every rank has read the previous keys
        store.delete_key(f"{prefix}/{previous_seq}/{rank}")
    return table
