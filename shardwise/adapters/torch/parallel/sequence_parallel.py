"""Sequence parallelism (Megatron): the activations between tensor-parallel regions split along the sequence.

Inside a tensor-parallel block, norms, dropout and residual additions run on every tp
rank on the whole sequence. With sequence parallelism each rank holds ``seq / tp``
positions of them instead: a tensor-parallel region (the attention, the MLP: the
parents of the rule table's column layers) gathers the sequence at its input and its
row-parallel linear reduce-scatters the partial sums back into the rank's part, so
the allreduce of each sub-layer becomes a reduce-scatter plus an allgather (the same
bytes) and those activations take ``tp`` times less memory. Each column layer keeps
only the rank's part of its input for backward and gathers it again there. The
embedding's output is cut into the ranks' parts and the head's input gathered whole.
A block's replicated parameters (norm weights, the row layers' biases) then see only
their rank's positions: their gradients are summed over tp as they are produced.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ....core.comm import Communicator
from ....core.errors import ConfigError
from ....core.tp_rules import FamilyRules
from .module_paths import get_module
from .tensor_parallel import RowParallelLinear, _ShardedLinear, gather_sequence, scatter_sequence
from .tp_apply import is_grad_summed, is_tp_sharded

__all__ = ["apply_sequence_parallel"]


def _summed_over(comm: Communicator) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return comm.allreduce(grad.contiguous(), "sum")
    return hook


def _gathers_input(comm: Communicator) -> Any:
    """Forward pre-hook: the region's hidden states (first argument or ``hidden_states=``) gathered."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=gather_sequence(kwargs["hidden_states"], comm))
        else:
            args = (gather_sequence(args[0], comm), *args[1:])
        return args, kwargs
    return hook


def apply_sequence_parallel(stages: Sequence[nn.Module], blocks: Sequence[bool], rules: FamilyRules,
                            tp_comm: Communicator) -> None:
    """Run ``stages`` (embedding, blocks, head of a causal LM of ``rules``' family; ``blocks[i]`` marks
    a block) with the blocks' activations split along the sequence over ``tp_comm``."""
    odd = [r.path for r in rules.rules if r.gather_output or r.split_input or r.rope_dim_key or "*" in r.path]
    if odd:
        raise ConfigError(f"sequence_parallel: {rules.family}'s rules gather or split whole activations inside "
                          f"a block ({', '.join(odd[:3])}); train it without sequence_parallel")
    regions = sorted({rule.path.rpartition(".")[0] for rule in rules.rules if rule.kind == "column"})
    for stage, is_block in zip(stages, blocks):
        if not is_block:
            continue
        for region in regions:  # inside a region each rank sees the whole sequence: whole weights see it too
            for name, p in get_module(stage.block, region).named_parameters():
                row_bias = isinstance(get_module(stage.block, f"{region}.{name}".rpartition(".")[0]),
                                      RowParallelLinear)  # added to the rank's positions after the sum
                if p.requires_grad and not (is_tp_sharded(p) or is_grad_summed(p) or row_bias):
                    raise ConfigError(f"sequence_parallel: {region}.{name} is kept whole inside a "
                                      f"tensor-parallel region of {rules.family}; train it without "
                                      f"sequence_parallel")
        for module in stage.modules():
            if isinstance(module, _ShardedLinear):
                module.sequence_parallel = True
        stage.sequence_parts = tp_comm.size  # rotary positions count the whole sequence
        for region in regions:
            get_module(stage.block, region).register_forward_pre_hook(_gathers_input(tp_comm), with_kwargs=True)
        for p in stage.parameters():
            if p.requires_grad and not (is_tp_sharded(p) or is_grad_summed(p)):
                p.register_hook(_summed_over(tp_comm))
    stages[0].register_forward_hook(lambda module, args, out: scatter_sequence(out, tp_comm))
    stages[-1].register_forward_pre_hook(
        lambda module, args: (gather_sequence(args[0], tp_comm, grad_summed=True), *args[1:]))
