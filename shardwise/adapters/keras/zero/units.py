"""A ZeRO partition unit of the Keras optimizer: model variables laid out flat together, and this rank's shard.

Stages 1 and 2 (:mod:`.optimizer`, one unit per gradient bucket) and the JAX
stage 3 (:mod:`.jax.stage3`, one unit per variable) cut and fill shards the same
way, so both build on this one type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import keras

from ....core.zero import PartitionPlan

__all__ = ["ZeroUnit"]


@dataclass
class ZeroUnit:
    """Model variables partitioned together, and this rank's flat shard of them."""

    index: int
    members: tuple[int, ...]  # positions in the optimizer's variable list, in flat order
    plan: PartitionPlan
    shard: Any  # keras.Variable of plan.shard_numel elements
    dtype: str

    def owned_slice(self, variables: Sequence[Any], rank: int) -> Any:
        """This rank's shard of the current model values (zeros where it is padding)."""
        ops = keras.ops
        by_name = {slot.name: variables[m] for slot, m in zip(self.plan.params, self.members)}
        pieces = []
        for piece in self.plan.rank_params(rank):
            flat = ops.reshape(ops.convert_to_tensor(by_name[piece.name]), (-1,))
            pieces.append(ops.cast(flat[piece.param_offset:piece.param_offset + piece.length], self.dtype))
        pad = self.plan.padding(rank)
        if pad:
            pieces.append(ops.zeros((pad,), self.dtype))
        return ops.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]

    def flat_grads(self, grads: Sequence[Optional[Any]]) -> Any:
        """The unit's gradients in one zero-padded flat buffer (zeros for ``None``)."""
        ops = keras.ops
        pieces = []
        for slot, m in zip(self.plan.params, self.members):
            g = grads[m]
            pieces.append(ops.zeros((slot.numel,), self.dtype) if g is None
                          else ops.cast(ops.reshape(g, (-1,)), self.dtype))
        if self.plan.padded_numel > self.plan.numel:
            pieces.append(ops.zeros((self.plan.padded_numel - self.plan.numel,), self.dtype))
        return ops.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
