"""What the pipeline executor puts on the wire besides tensors: shape headers, the agreement of
each step, and its two directions.

Every step starts with one allgather over the pipeline group of a fixed-size descriptor (the
schedule, the micro-batch count, training or prediction, the step number): ranks that would
pair their messages differently see it on every rank and raise
:class:`~shardwise.core.errors.DivergenceError` before any activation moves, instead of
waiting for a tag that never comes or taking one micro-batch's tensor for another's. A shape
header also names the step, micro-batch and model stage it announces, and its receiver checks them.
Control tensors live on the host, or on the data's CUDA device under NCCL (:func:`control_device`).
"""

from __future__ import annotations

import zlib
import torch

from ....core.comm import Communicator
from ....core.errors import BackendError, ConfigError, DivergenceError
from ....core.pipeline import Schedule
from .._control import control_device

__all__ = ["HEADER_LEN", "StepAgreement", "connect", "control_device", "duplicate_or_same", "make_header",
           "read_header"]

#: dtypes an activation header can name (index = code).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8
#: int64 entries of a header: number of dims, dtype code, the dims (zero-padded), then the
#: step, micro-batch and receiving model stage it belongs to.
HEADER_LEN = _MAX_DIMS + 5
_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def make_header(x: torch.Tensor, step: int, microbatch: int, stage: int,
                device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The shape header announcing activation ``x`` (micro-batch ``microbatch``) to model stage ``stage``."""
    if x.dim() > _MAX_DIMS or x.dtype not in _DTYPES:
        raise ConfigError(f"cannot send an activation of shape {tuple(x.shape)} and dtype {x.dtype}; "
                          f"pass activation_shape= or use <= {_MAX_DIMS} dims of {_DTYPES}")
    dims = list(x.shape) + [0] * (_MAX_DIMS - x.dim())
    return torch.tensor([x.dim(), _DTYPES.index(x.dtype), *dims, step, microbatch, stage],
                        dtype=torch.int64, device=device)


def read_header(header: torch.Tensor, step: int, microbatch: int, stage: int,
                source: int, rank: int) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a header announces; :class:`DivergenceError` if it is not the one expected."""
    values = header.tolist()
    got = tuple(values[_MAX_DIMS + 2:])
    if got != (step, microbatch, stage):
        raise DivergenceError(
            f"pipeline rank {rank} expected the activation header of step {step}, micro-batch {microbatch} "
            f"for model stage {stage} from rank {source}, and got step {got[0]}, micro-batch {got[1]}, "
            f"model stage {got[2]}: every pipeline rank must run the same schedule, step for step")
    ndim, code = values[0], values[1]
    return tuple(values[2:2 + ndim]), _DTYPES[code]


def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class StepAgreement:
    """Checks at the start of each step that every pipeline rank runs the same schedule the same way."""

    def __init__(self, comm: Communicator, schedule: Schedule, headers: bool, device: torch.device) -> None:
        self.comm, self.schedule, self.headers, self.device = comm, schedule, headers, device
        self.fingerprint = _code(repr(schedule.actions))
        self.steps = 0

    def __call__(self, train: bool) -> int:
        """Agree on this step (a collective over the pipeline group); returns its number."""
        step, self.steps = self.steps, self.steps + 1
        if self.comm.size == 1:
            return step
        s = self.schedule
        mine = torch.tensor([_code(s.name), s.num_stages, s.num_microbatches, s.virtual_stages, int(train),
                             step, int(self.headers), self.fingerprint], dtype=torch.int64, device=self.device)
        every = torch.as_tensor(self.comm.allgather(mine, uniform=True)).reshape(self.comm.size, -1).tolist()
        if any(row != every[0] for row in every):
            raise DivergenceError(self._describe(every))
        return step

    def _describe(self, every: list[list[int]]) -> str:
        names = {_code(n): repr(n) for n in (*_SCHEDULES, self.schedule.name)}
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, row in enumerate(every):
            groups.setdefault(tuple(row), []).append(rank)
        said = []
        for (name, p, m, v, train, step, headers, fingerprint), ranks in groups.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            said.append(f"{who} {'runs ' if not said else ''}step {step} ({'training' if train else 'prediction'}) "
                        f"of schedule {names.get(name, 'of another name')} with {p} stages, {m} micro-batches, "
                        f"{v} chunk(s) per rank, actions {fingerprint:08x}, "
                        f"{'shape headers' if headers else 'activation_shape given'}")
        return ("pipeline ranks disagree: " + "; ".join(said)
                + ": every pipeline rank must run the same schedule, step for step")


def duplicate_or_same(comm: Communicator) -> Communicator:
    """``comm.duplicate()``, or ``comm`` where the backend cannot duplicate it (the same on every member)."""
    if comm.size == 1:
        return comm
    try:
        return comm.duplicate()
    except (BackendError, NotImplementedError):
        return comm


def connect(schedule: Schedule, rank: int, up: Communicator, down: Communicator, device: torch.device) -> None:
    """Exchange one small message over every connection the schedule uses, in the same order on every rank.

    NCCL creates the communicator of a pair of ranks at their first message, and that blocks
    both until the other arrives. Left to the first step, a rank that posts a receive ahead of
    need (a gradient, under GPipe) would wait there for a peer that first waits for this rank's
    next activation. Pairs connected one after another in one global order cannot wait on each
    other in a cycle. Messages from a lower to a higher rank travel on ``up``, the others on ``down``.
    Ranks whose schedules use different pairs connect none (a rank would wait for a message that
    never comes): the first step's :class:`StepAgreement` then tells every rank how they differ.
    """
    pairs = sorted({(min(r, a.peer), max(r, a.peer), a.peer < r) for r, actions in enumerate(schedule.actions)
                    for a in actions if a.kind in ("send_act", "send_grad")})
    if up.size == 1 or any(theirs != pairs for theirs in up.allgather_object(pairs)):
        return
    token = torch.zeros(1, device=device)
    for low, high, downward in pairs:
        comm = down if downward else up
        if rank == low:
            comm.send(token, high)
        elif rank == high:
            comm.recv(token, low)
