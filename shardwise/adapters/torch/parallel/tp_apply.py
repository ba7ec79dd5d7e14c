"""Apply a family's tensor-parallel rules to a model: swap its linears for sharded ones, in place.

Each block's layers named by :class:`~shardwise.core.tp_rules.SplitRule` become a
:class:`ColumnParallelLinear` or :class:`RowParallelLinear` holding this rank's
shard of the layer's current weights, so the model keeps whatever values it was
built or loaded with. ``nn.Linear`` and Hugging Face's ``Conv1D`` (a transposed
linear) are both accepted. Attributes that count per-rank features (GPT-2's
``split_size``) are divided by the tp degree.
"""

from __future__ import annotations

import torch
from torch import nn

from ....core.comm import Communicator
from ....core.errors import ConfigError
from ....core.tp_rules import FamilyRules, SplitRule, check_tp_degree, fused_column_order
from .stages import get_module, set_module
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["apply_tensor_parallel", "is_tp_sharded"]

_SHARDED = "_shardwise_tp_sharded"


def is_tp_sharded(param: torch.Tensor) -> bool:
    """True for a parameter that holds only this rank's tensor-parallel slice."""
    return bool(getattr(param, _SHARDED, False))


def _full_linear(layer: nn.Module, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``[out, in]`` weight and the bias of an ``nn.Linear`` or a ``Conv1D``."""
    if isinstance(layer, nn.Linear):
        return layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    if type(layer).__name__ == "Conv1D" and hasattr(layer, "nf"):  # transformers.pytorch_utils.Conv1D
        return layer.weight.detach().t(), layer.bias.detach()
    raise ConfigError(f"tensor-parallel rule for {path!r} expects nn.Linear or Conv1D, got {type(layer).__name__}")


def _sharded(rule: SplitRule, weight: torch.Tensor, bias: torch.Tensor | None,
             tp_comm: Communicator) -> tuple[nn.Module, list[nn.Parameter]]:
    """The sharded layer of ``rule`` and its parameters that hold slices (a row split's bias is whole)."""
    if rule.kind == "row":
        layer = RowParallelLinear.from_full(weight.contiguous(), bias, tp_comm)
        return layer, [layer.weight]
    if rule.parts > 1:
        order = torch.from_numpy(fused_column_order(weight.shape[0], rule.parts, tp_comm.size))
        weight, bias = weight[order], None if bias is None else bias[order]
    layer = ColumnParallelLinear.from_full(weight.contiguous(), bias, tp_comm)
    return layer, [layer.weight] + ([layer.bias] if layer.bias is not None else [])


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, rules: FamilyRules, tp_comm: Communicator) -> int:
    """Shard every block of ``model`` over ``tp_comm`` by ``rules``; returns the layers replaced."""
    if tp_comm.size == 1:
        return 0
    config = getattr(model, "config", None)
    check_tp_degree(rules, config.to_dict() if hasattr(config, "to_dict") else {}, tp_comm.size)
    replaced = 0
    for block in get_module(model, rules.blocks):
        for rule in rules.rules:
            weight, bias = _full_linear(get_module(block, rule.path), rule.path)
            with torch.random.fork_rng(devices=[]):  # the sharded layers' own init must not move the RNG
                new, sharded = _sharded(rule, weight, bias, tp_comm)
            for p in sharded:
                setattr(p, _SHARDED, True)
            set_module(block, rule.path, new)
            replaced += 1
        for path in rules.divided_attrs:
            owner_path, _, attr = path.rpartition(".")
            owner = get_module(block, owner_path) if owner_path else block
            value = getattr(owner, attr)
            if value % tp_comm.size:
                raise ConfigError(f"{rules.family}: {path}={value} is not divisible by tp={tp_comm.size}")
            setattr(owner, attr, value // tp_comm.size)
    return replaced
