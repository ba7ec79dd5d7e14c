"""ZeRO-3's check that every rank gathers the same unit at the same point.

Stage 3 gathers a module's parameters when that module runs, so ranks that take
different branches (a data-dependent ``if``, a mixture-of-experts router) would pair
the allgather of one module with another's: an engine error (``MPI_ERR_TRUNCATE``, a
lost gloo connection) when the shards differ in size, silently exchanged parameters
when they do not. FSDP and DeepSpeed ZeRO-3 require the same order too and check it
only in a debug mode (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` fingerprints every collective
with a collective of its own).

Here the check costs no collective of its own once the gathers repeat:

* **Learning** (the first steps, and after a change of course): a fixed-size header
  (unit index, the gather's number in this rank's pass, shard bytes) is exchanged
  before each gather, one int64 allgather on the host (on the data's device for CUDA
  data under the ``torch`` backend, NCCL); a disagreement raises
  :class:`~shardwise.core.errors.DivergenceError` on every rank before any parameter
  moves. The units gathered between two passes' first gathers, the same on every rank
  since every one was checked, become the *plan*: the cycle of gathers of one step.
* **On plan** the next gather is predicted from checked history only, so every rank
  predicts the same unit. A rank whose unit is the predicted one runs the plain
  allgather; a rank about to gather another unit gathers the predicted unit's size into
  a scratch buffer, its own block holding a *pill*: 16 magic bytes, its unit and the
  gather's number in its pass. The sizes agree whatever each rank runs, so no engine
  error and no hang; each rank looks for pills in the first 32 bytes of every block it
  received (one small comparison), and all of them see the same blocks: different units
  raise on every rank, naming what each rank gathered; the same other unit on every
  rank (a branch every rank took) is gathered then, and the check learns again.
  A predicted unit whose shard is under 32 bytes is checked with a header instead.

A header cannot ride inside the parameter gather itself: appended to each rank's shard
it would split the full buffer into blocks that parameters straddle.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from shardwise.core.comm import Communicator, CompletedHandle, Handle
from shardwise.core.errors import DivergenceError

from .._control import control_device
from .units import ZeroUnit

__all__ = ["GatherCheck", "unit_label"]

_HEADER = 4  # unit index, gather number in the pass, shard bytes, reserved (0)
_MAGIC = bytes.fromhex("7ff8d1ce7ff8a11e7ff8b0ba7ff8c0de")  # four float32 NaNs with payloads
_PILL_BYTES = 32  # magic, unit index (int64), gather number (int64)


def unit_label(unit: ZeroUnit) -> str:
    """A unit's name for messages: its module's qualified name, from the parameter names."""
    if unit.module is None:
        return "root parameters"
    parts = [n.split(".")[:-1] for n in unit.names]
    common = parts[0]
    for p in parts[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    return ".".join(common) or unit.names[0]


def _nbytes(unit: ZeroUnit) -> int:
    return unit.shard.numel() * unit.shard.element_size()


class _PlannedGather:
    """A gather started on plan; :meth:`wait` looks for pills before the data is used."""

    def __init__(self, check: "GatherCheck", unit: ZeroUnit, planned: ZeroUnit, s: int, handle: Handle,
                 buffer: torch.Tensor) -> None:
        self.check, self.unit, self.planned, self.s = check, unit, planned, s
        self.handle, self.buffer = handle, buffer

    def done(self) -> bool:
        return self.handle.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Complete the gather; ``self.unit``'s full parameters are then in place, or this raises."""
        self._settle(use=True)
        return self.unit._full

    def discard(self) -> None:
        """Complete a gather whose result is not needed (an unused prefetch); still raises on divergence."""
        self._settle(use=False)

    def _settle(self, use: bool) -> None:
        if self.buffer is None:
            return
        self.handle.wait()
        pills = self.check.read_pills(self.buffer)
        self.buffer = None
        if not any(pills):
            return
        said = [p if p is not None else (self.planned.index, self.s) for p in pills]
        if len(set(said)) > 1:
            raise DivergenceError(self.check.describe([[u, s, -1] for u, s in said]))
        # Every rank gathered the same other unit: a change of course they all took.
        self.check.relearn()
        if use:
            self.check.comm.allgather_into(self.unit._allocated_full(), self.unit.shard)


class GatherCheck:
    """Starts each stage-3 parameter gather of ``units`` (all over ``comm``), checking that every rank
    gathers the same unit."""

    def __init__(self, comm: Communicator, units: Sequence[ZeroUnit]) -> None:
        self.comm = comm
        self.units = {u.index: u for u in units}  # by unit index (a subset of the optimizer's units)
        self.labels = {u.index: unit_label(u) for u in units}
        self.device = control_device(comm, units[0].device) if units else torch.device("cpu")
        self.sequence = 0  # this rank's gathers since its pass began (local: named in errors)
        self.plan: list[int] = []  # the checked cycle of gathers, the same on every rank
        self.position = 0  # in ``plan``, of the next gather (from checked history only)
        self.learned: Optional[list[int]] = None  # checked gathers since a pass began, while learning
        self._magic: dict[torch.device, torch.Tensor] = {}

    def new_pass(self) -> None:
        """A forward pass begins on this rank: gathers are numbered from 0 again."""
        self.sequence = 0

    def relearn(self) -> None:
        """The ranks agreed on a unit the plan did not predict: headers first until the cycle is seen again."""
        self.plan, self.position, self.learned = [], 0, None

    def _gather(self, out: torch.Tensor, block: torch.Tensor, blocking: bool) -> Handle:
        if blocking:
            return CompletedHandle(self.comm.allgather_into(out, block))
        return self.comm.allgather_into_async(out, block)

    def start(self, unit: ZeroUnit, blocking: bool = False) -> Handle:
        """Start the allgather of ``unit``'s parameters into its full buffer (checked).

        With ``blocking`` the gather itself completes before this returns; the returned
        handle's ``wait`` still has to run (it checks what arrived).
        """
        s, self.sequence = self.sequence, self.sequence + 1
        if self.comm.size == 1:
            return self._gather(unit._allocated_full(), unit.shard, blocking)
        if not self.plan:
            self._exchange_header(unit, s)
            self._learn(unit.index, s)
            return self._gather(unit._allocated_full(), unit.shard, blocking)
        planned = self.units[self.plan[self.position]]
        self.position = (self.position + 1) % len(self.plan)
        if _nbytes(planned) < _PILL_BYTES:
            self._exchange_header(unit, s)
            if unit is not planned:
                self.relearn()
            return self._gather(unit._allocated_full(), unit.shard, blocking)
        if planned is unit:
            full = unit._allocated_full()
            return _PlannedGather(self, unit, planned, s, self._gather(full, unit.shard, blocking), full)
        # Not the predicted unit: gather the predicted size, this rank's block saying what it runs.
        scratch = torch.zeros(planned.plan.padded_numel, dtype=planned.dtype, device=planned.device)
        block = scratch[planned.start: planned.end]
        pill = torch.frombuffer(bytearray(_MAGIC + unit.index.to_bytes(8, "little") + s.to_bytes(8, "little")),
                                dtype=torch.uint8)
        block.view(torch.uint8)[:_PILL_BYTES].copy_(pill.to(block.device))
        return _PlannedGather(self, unit, planned, s, self._gather(scratch, block, blocking), scratch)

    def _learn(self, index: int, s: int) -> None:
        """A checked gather while learning: a pass that begins closes the cycle of the one before."""
        if s != 0:
            if self.learned is not None:
                self.learned.append(index)
            return
        if self.learned and self.learned[0] == index:
            self.plan, self.position = self.learned, 1 % len(self.learned)
            self.learned = None
        else:
            self.learned = [index]

    def read_pills(self, gathered: torch.Tensor) -> list[Optional[tuple[int, int]]]:
        """Per rank, the (unit, gather number) of its pill in ``gathered``, or None where its block is data."""
        n = self.comm.size
        heads = gathered.view(torch.uint8).view(n, -1)[:, :_PILL_BYTES]
        magic = self._magic.get(gathered.device)
        if magic is None:
            magic = self._magic[gathered.device] = torch.frombuffer(bytearray(_MAGIC), dtype=torch.uint8).to(
                gathered.device)
        hits = (heads[:, :len(_MAGIC)] == magic).all(dim=1)
        if not bool(hits.any()):
            return [None] * n
        rows = heads.cpu()
        return [(int.from_bytes(bytes(rows[r, 16:24].tolist()), "little"),
                 int.from_bytes(bytes(rows[r, 24:32].tolist()), "little")) if hit else None
                for r, hit in enumerate(hits.tolist())]

    def _exchange_header(self, unit: ZeroUnit, s: int) -> None:
        mine = torch.tensor([unit.index, s, _nbytes(unit), 0], dtype=torch.int64, device=self.device)
        every = torch.as_tensor(self.comm.allgather(mine, uniform=True)).reshape(-1, _HEADER).tolist()
        if any(row != every[0] for row in every):
            raise DivergenceError(self.describe([row[:3] for row in every]))

    def describe(self, every: list[list[int]]) -> str:
        """The error for ranks that gathered ``[unit, gather number, shard bytes or -1]`` each."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, row in enumerate(every):
            groups.setdefault(tuple(row), []).append(rank)
        seqs = {row[1] for row in every}
        where = f"gather #{every[0][1]} of this pass" if len(seqs) == 1 else "the same gather"
        said = []
        for (index, seq, nbytes), ranks in groups.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            size = _nbytes(self.units[index]) if nbytes < 0 and index in self.units else nbytes
            what = f"unit {index} ({self.labels.get(index, '?')}, {size} bytes per rank)"
            if len(seqs) > 1:
                what += f" as gather #{seq} of its pass"
            said.append(f"{who} {'gathered ' if not said else ''}{what}")
        return (f"ZeRO-3 ranks diverged at {where}: {', '.join(said)}: every rank must run the same "
                "modules in the same order (as FSDP and DeepSpeed ZeRO-3 require)")
