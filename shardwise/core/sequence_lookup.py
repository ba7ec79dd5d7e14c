"""Where the rows of a sequence (unpooled) embedding lookup go back to, framework-neutral (numpy).

A sequence lookup sends ids to the table shards' owners exactly as the pooled one does
(:func:`~.embedding_lookup.pack_ids`: per slot, the ids that fall into its shard, in bag order),
but the owners return one row block per id instead of one pooled block per bag. The sender
puts each returned block back at the position its id had in the feature: every id of a
table- or column-wise shard (whose blocks are columns side by side), only the ids in its row
range for a row-wise one (so rows that came from different ranks end up in id order again).
The same positions route the rows' gradients to the owners in backward.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .embedding_lookup import FeatureIds
from .embedding_plan import LookupSlot

__all__ = ["slot_positions", "route_rows"]


def slot_positions(slot: LookupSlot, feature: FeatureIds) -> np.ndarray:
    """Positions (in the feature's ids, bag order) of the ids ``slot``'s shard serves, in the order
    :func:`~.embedding_lookup.pack_ids` sends them: the ``k``-th row block the owner returns for the
    slot belongs to ``positions[k]``."""
    if slot.full_rows:
        return np.arange(feature.values.size, dtype=np.int64)
    values = feature.values
    return np.flatnonzero((values >= slot.shard.row_start) & (values < slot.shard.row_end)).astype(np.int64)


def route_rows(to: Sequence[Sequence[LookupSlot]], per: dict[str, FeatureIds]) -> list[list[np.ndarray]]:
    """Per destination rank (``to[d]``: its slots), per slot: :func:`slot_positions` of this rank's ids."""
    return [[slot_positions(slot, per[slot.feature]) for slot in slots] for slots in to]
