"""The coordinator's small agreement: an element-wise minimum of every rank's bytes, by recursive doubling.

Each round of negotiation whose requests are all in the response cache is one
:func:`tree_min` over a vector of 0/1 bytes (the minimum of 0/1 values is their AND):
``ceil(log2 N)`` exchanges with a partner ``rank XOR 2^k``, plus one message in and one
out for the ranks beyond the largest power of two, which first hand their vector to a
partner below it and get the result back. Every message carries the vector alone, so
a rank's traffic per round is ``O(log N)`` messages of a size that does not depend on N.

Point-to-point on the coordinator's own communicator, on a reserved tag, so that its
messages are counted exactly (:class:`BitTraffic`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardwise.core.comm import Communicator

__all__ = ["TREE_TAG", "BitTraffic", "tree_min"]

#: Point-to-point tag of the agreement on the coordinator's communicator (within MPI's minimum TAG_UB).
TREE_TAG = 32_003


@dataclass
class BitTraffic:
    """Messages and bytes one rank sent and received in one :func:`tree_min`."""

    messages: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


def _swap(comm: Communicator, buf: np.ndarray, peer: int, traffic: BitTraffic) -> np.ndarray:
    """Send ``buf`` to ``peer`` and receive its vector, both at once (neither waits on the other)."""
    got = np.empty_like(buf)
    receiving = comm.recv_async(got, peer, TREE_TAG)
    sending = comm.send_async(buf, peer, TREE_TAG)
    receiving.wait()
    sending.wait()
    traffic.messages += 1
    traffic.bytes_sent += buf.nbytes
    traffic.bytes_received += got.nbytes
    return got


def tree_min(comm: Communicator, vec: np.ndarray) -> tuple[np.ndarray, BitTraffic]:
    """The element-wise minimum of every rank's ``vec`` (same length and dtype everywhere), and this rank's traffic."""
    buf = np.array(vec, copy=True)
    traffic = BitTraffic()
    size, rank = comm.size, comm.rank
    if size == 1:
        return buf, traffic
    power = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    if rank >= power:  # hand the vector to rank - power and get the answer back
        comm.send(buf, rank - power, TREE_TAG)
        comm.recv(buf, rank - power, TREE_TAG)
        traffic.messages += 1
        traffic.bytes_sent += buf.nbytes
        traffic.bytes_received += buf.nbytes
        return buf, traffic
    extra = rank + power < size
    if extra:
        got = np.empty_like(buf)
        comm.recv(got, rank + power, TREE_TAG)
        traffic.bytes_received += got.nbytes
        np.minimum(buf, got, out=buf)
    mask = 1
    while mask < power:
        np.minimum(buf, _swap(comm, buf, rank ^ mask, traffic), out=buf)
        mask <<= 1
    if extra:
        comm.send(buf, rank + power, TREE_TAG)
        traffic.messages += 1
        traffic.bytes_sent += buf.nbytes
    return buf, traffic
