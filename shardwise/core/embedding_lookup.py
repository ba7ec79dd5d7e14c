"""The id exchange of a sharded embedding lookup, framework-neutral (numpy): what each rank sends the
owners of the table shards, and how an owner reads what it got.

Per destination rank, one int64 packet ``[batch, status, has weights, lengths..., ids...]``: for each
of the destination's slots (:class:`~.embedding_plan.LookupSlot`, a feature on a table shard) the
bag lengths of the sender's ``batch`` samples, then the ids that fall into the shard, relative to
its first row. A nonzero ``status`` (bad input on the sender) carries zero lengths, so every rank
parses every packet and all fail together. Per-id weights (where any feature has them) travel in
a second float32 exchange of the same layout, without the header. The torch and Keras tables both
speak it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from .comm import Communicator
from .embedding_plan import EmbeddingPlan, LookupSlot, TableConfig
from .errors import ConfigError, ShapeMismatchError

__all__ = ["OK", "BAD_ID", "BAD_BATCH", "FeatureIds", "feature_ids", "Source", "pack_ids", "parse_ids", "split_weights",
           "check_sources", "check_plan", "agree_on_tables"]

OK, BAD_ID, BAD_BATCH = 0, 1, 2
_HEADER = 3


class FeatureIds(NamedTuple):
    """One feature of a rank's batch: the ids in bag order, the bag lengths, per-id weights (or None)
    and each id's sample."""

    values: np.ndarray
    lengths: np.ndarray
    weights: Optional[np.ndarray]
    sample: np.ndarray


def feature_ids(values: np.ndarray, lengths: np.ndarray, weights: Optional[np.ndarray] = None) -> FeatureIds:
    """A feature's ids from its values and bag lengths (int64), the sample of each id derived."""
    lengths = np.asarray(lengths, np.int64)
    return FeatureIds(np.asarray(values, np.int64), lengths, weights,
                      np.repeat(np.arange(lengths.size), lengths))


class Source(NamedTuple):
    """What one sender's packet holds for this rank: per slot of this rank, lengths and relative ids."""

    batch: int
    status: int
    has_weights: bool
    lengths: list[np.ndarray]
    ids: list[np.ndarray]

    def sample(self, index: int) -> np.ndarray:
        """The sender's sample of each id of slot ``index``."""
        return np.repeat(np.arange(self.batch), self.lengths[index])


def pack_ids(to: Sequence[Sequence[LookupSlot]], batch: int, status: int,
             per: dict[str, FeatureIds]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per destination rank (``to[d]``: its slots), the id packet and the float32 weights."""
    has_w = int(status == OK and any(f.weights is not None for f in per.values()))
    packets, weights = [], []
    for slots in to:
        lengths, ids, ws = [], [], []
        for slot in slots:
            if status != OK:
                lengths.append(np.zeros(batch, np.int64))
                continue
            f = per[slot.feature]
            if slot.full_rows:
                mask = None
                lengths.append(f.lengths)
            else:
                mask = (f.values >= slot.shard.row_start) & (f.values < slot.shard.row_end)
                lengths.append(np.bincount(f.sample[mask], minlength=batch).astype(np.int64))
            ids.append(f.values if mask is None else f.values[mask] - slot.shard.row_start)
            if has_w:
                w = np.ones(f.values.size, np.float32) if f.weights is None else f.weights
                ws.append(np.asarray(w if mask is None else w[mask], np.float32))
        packets.append(np.concatenate([np.array([batch, status, has_w], np.int64), *lengths, *ids]))
        weights.append(np.concatenate(ws) if ws else np.zeros(0, np.float32))
    return packets, weights


def parse_ids(got: np.ndarray, senders: int, mine: Sequence[LookupSlot]) -> list[Source]:
    """The packets of ``senders`` ranks, concatenated in rank order, for this rank's slots ``mine``."""
    got = np.asarray(got, np.int64)
    sources, pos = [], 0
    for _ in range(senders):
        b, status, has_w = (int(v) for v in got[pos:pos + _HEADER])
        pos += _HEADER
        lengths = []
        for _slot in mine:
            lengths.append(got[pos:pos + b])
            pos += b
        ids = []
        for n in (int(x.sum()) for x in lengths):
            ids.append(got[pos:pos + n])
            pos += n
        sources.append(Source(b, status, bool(has_w), lengths, ids))
    return sources


def split_weights(got: np.ndarray, sources: Sequence[Source]) -> list[list[np.ndarray]]:
    """Per source, per slot: the weights of its ids, from the concatenated weight exchange."""
    out, pos = [], 0
    for s in sources:
        if not s.has_weights:  # this sender's batch had none: it sent none
            out.append([np.zeros(0, np.float32) for _ in s.ids])
            continue
        mine = []
        for ids in s.ids:
            mine.append(np.asarray(got[pos:pos + ids.size], np.float32))
            pos += ids.size
        out.append(mine)
    return out


def check_sources(sources: Sequence[Source], message: str) -> None:
    """:class:`ShapeMismatchError` on every rank where any sender flagged bad input (``message``: ours)."""
    failed = [r for r, s in enumerate(sources) if s.status != OK]
    if failed:
        raise ShapeMismatchError(f"embedding lookup refused on every rank: bad input on rank(s) {failed}"
                                 + (f"; here: {message}" if message else ""))


def check_plan(plan: EmbeddingPlan, tables: Sequence[TableConfig], world_size: int) -> None:
    """:class:`ConfigError` where ``plan`` is not one of ``tables`` over ``world_size`` ranks."""
    if plan.world_size != world_size:
        raise ConfigError(f"the plan is for {plan.world_size} ranks, but the group has {world_size}")
    if sorted(p.table.name for p in plan.placements) != sorted(t.name for t in tables) or any(
            plan.placement(t.name).table != t for t in tables):
        raise ConfigError("the plan was made for other tables than these")


def agree_on_tables(comm: Communicator, plan: Optional[Any], problem: Optional[str]) -> None:
    """Collective, when the tables are built: a :class:`ConfigError` on every rank where any rank found a
    ``problem`` with its tables or plan, or where the ranks' plans differ (their id packets would not
    parse); nothing is built then."""
    seen = comm.allgather_object((problem, repr(plan)))
    if problem is not None:
        raise ConfigError(problem)
    failed = [(r, p) for r, (p, _) in enumerate(seen) if p is not None]
    if failed:
        raise ConfigError(f"rank {failed[0][0]} refused its embedding tables: {failed[0][1]}")
    differ = [r for r, (_, fingerprint) in enumerate(seen) if fingerprint != seen[0][1]]
    if differ:
        raise ConfigError(f"the ranks' embedding tables or plans differ: rank(s) {differ} hold other ones than "
                          "rank 0 (every rank must build the same tables, with the same plan)")
