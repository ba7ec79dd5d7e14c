"""ZeRO-3's check that every rank gathers the same unit at the same point.

Stage 3 gathers a module's parameters when that module runs, so ranks that take
different branches (a data-dependent ``if``, a mixture-of-experts router) would pair
the allgather of one module with another's: an engine error (``MPI_ERR_TRUNCATE``, a
lost gloo connection) when the shards differ in size, silently exchanged parameters
when they do not. FSDP and DeepSpeed ZeRO-3 require the same order too and check it
only in a debug mode (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` fingerprints every collective).

Here every gather is preceded by the exchange of a fixed-size header (unit index,
sequence number of the gather in this pass, shard size in bytes): 4 int64 per rank,
on the host unless the data is on CUDA under the ``torch`` backend (NCCL). Its size
never depends on the unit, so a disagreement is seen by every rank, which raises
:class:`~shardwise.core.errors.DivergenceError` naming what each rank was about to
gather, before any parameter moves. The header cannot ride inside the parameter
gather itself: appended to each rank's shard it would split the full buffer into
blocks that parameters straddle, and a header whose units differ in size would
arrive truncated, which is the failure it is meant to replace.
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardwise.core.comm import Communicator
from shardwise.core.errors import DivergenceError

from .._control import control_device
from .units import ZeroUnit

__all__ = ["GatherCheck", "unit_label"]

_FIELDS = 4  # unit index, gather sequence number, shard bytes, reserved (0)


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


class GatherCheck:
    """Called by each unit before it starts an allgather of its parameters (stage 3)."""

    def __init__(self, comm: Communicator, units: Sequence[ZeroUnit]) -> None:
        self.comm = comm
        self.labels = {u.index: unit_label(u) for u in units}
        self.device = control_device(comm, units[0].device) if units else torch.device("cpu")
        self.sequence = 0  # gathers since the pass began

    def new_pass(self) -> None:
        """A forward pass begins: gathers count from 0 again (on every rank at the same point)."""
        self.sequence = 0

    def __call__(self, unit: ZeroUnit) -> None:
        """Exchange what this rank is about to gather; raise on every rank if the ranks differ."""
        if self.comm.size == 1:
            return
        mine = torch.tensor([unit.index, self.sequence, unit.shard.numel() * unit.shard.element_size(), 0],
                            dtype=torch.int64, device=self.device)
        self.sequence += 1
        every = torch.as_tensor(self.comm.allgather(mine, uniform=True)).reshape(-1, _FIELDS).tolist()
        if any(row != every[0] for row in every):
            raise DivergenceError(self._describe(every))

    def _describe(self, every: list[list[int]]) -> str:
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, row in enumerate(every):
            groups.setdefault(tuple(row), []).append(rank)
        seqs = {row[1] for row in every}
        where = f"gather #{every[0][1]} of this pass" if len(seqs) == 1 else "the same gather"
        said = []
        for (index, seq, nbytes, _), ranks in groups.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            what = f"unit {index} ({self.labels.get(index, '?')}, {nbytes} bytes per rank)"
            if len(seqs) > 1:
                what += f" as gather #{seq} of its pass"
            said.append(f"{who} {'gathered ' if not said else ''}{what}")
        return (f"ZeRO-3 ranks diverged at {where}: {', '.join(said)}: every rank must run the same "
                "modules in the same order (as FSDP and DeepSpeed ZeRO-3 require)")
