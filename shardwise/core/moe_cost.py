"""The planner's cost of Mixture-of-Experts layers under expert parallelism (``ep``).

With ``ep`` expert-parallel ranks (carved out of the ``dp`` data-parallel ranks, as in
:class:`~shardwise.core.layout.ParallelLayout`), each rank keeps ``1 / ep`` of every MoE
layer's routed experts, replicated over the ``dp / ep`` ranks of its expert-data-parallel
(edp) group; tensor parallelism splits attention and the dense MLPs, not the routed experts
(Hugging Face's plans leave them out of ``base_model_tp_plan``). Under ZeRO the expert
states are partitioned over edp, the dense ones over dp.

Per step, every MoE layer of a rank's stage runs an all-to-all to dispatch its tokens'
``experts_per_token`` rows to their experts' owners and one to combine the results,
and backward mirrors both: 4 per layer and micro-batch (6 with recomputation, which
runs the forward again), each sending the ``(ep - 1) / ep`` share of the rows that leaves
the rank (:func:`~shardwise.core.moe.alltoall_bytes_per_step`). Routing is rarely even:
``imbalance`` (>= 1, the busiest rank's rows over the mean, as
:func:`~shardwise.core.moe.routing_imbalance` measures it) multiplies the busiest rank's
expert compute and its all-to-all bytes; with ``ep = 1`` every rank computes all of its own
tokens' experts and the factor has no effect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError
from .hardware import Hardware
from .model_spec import ModelSpec
from .moe import alltoall_bytes_per_step, check_divisible

__all__ = ["ExpertCost", "expert_cost", "check_ep", "check_imbalance"]


@dataclass(frozen=True)
class ExpertCost:
    """What the routed experts add to one rank's memory, compute and communication."""

    params: int
    """Routed-expert parameters this rank keeps (its stage's MoE layers, ``1 / ep`` of their experts)."""
    edp: int
    """Ranks holding the same experts (``dp / ep``): their ZeRO partitions and gradient averaging group."""
    alltoall_bytes: float
    """Bytes the busiest rank sends in the step's all-to-alls."""
    alltoall_time: float
    """Seconds of those all-to-alls (exposed: the experts wait for their tokens)."""
    buffers: int
    """Bytes of one layer's dispatched rows, sent and received (the busiest rank's)."""
    extra_flops: float
    """FLOPs the busiest rank computes beyond an even share (routing imbalance), per device."""


def check_imbalance(imbalance: object) -> float:
    """``imbalance`` as a float >= 1; :class:`ConfigError` otherwise."""
    if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or not imbalance >= 1.0 \
            or not math.isfinite(imbalance):
        raise ConfigError(f"moe_imbalance must be a number >= 1.0 (the busiest expert-parallel rank's tokens "
                          f"over the mean), got {imbalance!r}")
    return float(imbalance)


def check_ep(model: ModelSpec, dp: int, ep: int) -> None:
    """Raise :class:`ConfigError` unless ``ep`` divides ``dp`` and the model's experts."""
    if ep == 1:
        return
    if not model.is_moe:
        raise ConfigError(f"ep={ep} splits the experts of Mixture-of-Experts layers, but the model has none")
    if dp % ep:
        raise ConfigError(f"ep={ep} must divide dp={dp}: the experts are split over groups of ep "
                          "data-parallel ranks")
    check_divisible(model.num_experts, ep)


def expert_cost(model: ModelSpec, hardware: Hardware, *, dp: int, tp: int, pp: int, ep: int,
                micro_batches: int, micro_batch_size: int, checkpointing: bool, sequence_parallel: bool,
                act_bytes: int, imbalance: float = 1.0) -> ExpertCost:
    """The experts' share of one configuration's cost (all zero for a dense model)."""
    check_ep(model, dp, ep)
    imbalance = check_imbalance(imbalance)
    if not model.is_moe:
        return ExpertCost(params=0, edp=dp, alltoall_bytes=0.0, alltoall_time=0.0, buffers=0, extra_flops=0.0)
    layers = -(-model.moe_layers // pp)  # the largest stage's MoE layers
    params = layers * (model.expert_layer_params // ep)
    # Tokens of one micro-batch on this rank: tensor-parallel ranks hold the same ones, unless
    # sequence parallelism splits them.
    tokens = micro_batch_size * model.seq_len // (tp if sequence_parallel else 1)
    k, h = model.experts_per_token, model.hidden_size
    buffers = int(2 * tokens * k * h * act_bytes * (imbalance if ep > 1 else 1.0)) if ep > 1 else 0
    sent = 0.0
    seconds = 0.0
    if ep > 1:
        per_micro = alltoall_bytes_per_step(tokens, k, h, ep, layers=layers, bytes_per_element=act_bytes)
        exchanges = layers * micro_batches * (6 if checkpointing else 4)  # a layer's 4, 6 recomputing
        sent = per_micro * (1.5 if checkpointing else 1.0) * micro_batches * imbalance
        bandwidth, latency = hardware.link(tp * ep)
        seconds = exchanges * (ep - 1) * latency + sent / bandwidth
    # Expert FLOPs of the step (6 per active parameter and token; 8 recomputing), of which the busiest
    # rank does ``imbalance`` times its even share.
    tokens_step = micro_batch_size * micro_batches * dp * model.seq_len
    active_experts = model.expert_params * model.experts_per_token / model.num_experts
    flops = (8 if checkpointing else 6) * active_experts * tokens_step
    extra = flops * (imbalance - 1.0) / hardware.num_devices if ep > 1 else 0.0
    return ExpertCost(params=params, edp=dp // ep, alltoall_bytes=sent, alltoall_time=seconds,
                      buffers=buffers, extra_flops=extra)
