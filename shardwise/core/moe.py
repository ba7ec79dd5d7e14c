"""Expert parallelism, independent of any framework: who owns which expert, where tokens go, what it costs.

With ``ep`` expert-parallel ranks, rank ``r`` owns the contiguous block of experts
``[r * E / ep, (r + 1) * E / ep)`` of every Mixture-of-Experts layer (as torchtitan,
Megatron-core and Hugging Face's own expert parallelism place them). A token routed
to its top-k experts is dispatched as ``k`` (token, expert) pairs, each to the rank
owning that expert; :func:`dispatch_counts` gives the per-expert counts of one
rank's pairs, from which the all-to-all's send splits follow (:func:`send_splits`),
and the receivers learn which local expert each row they get is for.

The planner's maths lives here too: the expert parameters and optimizer bytes one
rank keeps (:func:`expert_params_per_rank`), the bytes an all-to-all moves per step
(:func:`alltoall_bytes_per_step`) and how uneven a routing is
(:func:`routing_imbalance`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import ConfigError

__all__ = ["check_divisible", "experts_of", "owner_of", "local_expert_ids", "dispatch_counts", "send_splits",
           "expert_params_per_rank", "alltoall_bytes_per_step", "routing_imbalance"]


def _positive(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def check_divisible(num_experts: int, ep: int, module: str = "the model") -> int:
    """Experts per rank; :class:`ConfigError` naming ``module`` and both numbers unless ``ep`` divides them."""
    num_experts, ep = _positive(num_experts, "num_experts"), _positive(ep, "ep")
    if num_experts % ep:
        raise ConfigError(f"{module}: {num_experts} experts do not split over ep={ep} expert-parallel ranks "
                          f"(ep must divide the number of experts)")
    return num_experts // ep


def experts_of(rank: int, ep: int, num_experts: int, module: str = "the model") -> range:
    """The global ids of the experts expert-parallel rank ``rank`` of ``ep`` owns (a contiguous block)."""
    per = check_divisible(num_experts, ep, module)
    if isinstance(rank, bool) or not 0 <= rank < ep:
        raise ConfigError(f"rank {rank!r} is not in an expert-parallel group of {ep}")
    return range(rank * per, (rank + 1) * per)


def owner_of(expert_ids: np.ndarray, ep: int, num_experts: int) -> np.ndarray:
    """The expert-parallel rank owning each expert id of ``expert_ids``."""
    per = check_divisible(num_experts, ep)
    ids = np.asarray(expert_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ConfigError(f"expert ids must lie in [0, {num_experts}), got {ids.min()}..{ids.max()}")
    return ids // per


def local_expert_ids(expert_ids: np.ndarray, ep: int, num_experts: int) -> np.ndarray:
    """Each global expert id as an index among its owner's experts."""
    per = check_divisible(num_experts, ep)
    return np.asarray(expert_ids) % per


def dispatch_counts(top_k_index: np.ndarray, num_experts: int) -> np.ndarray:
    """Pairs routed to each expert by one rank's ``[tokens, k]`` top-k indices: ``int64[num_experts]``.

    Sorted by expert, the pairs are grouped by owning rank (the blocks are contiguous), so
    ``counts.reshape(ep, E // ep)`` is what this rank sends to each rank, expert by expert.
    """
    num_experts = _positive(num_experts, "num_experts")
    ids = np.asarray(top_k_index).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ConfigError(f"expert ids must lie in [0, {num_experts}), got {ids.min()}..{ids.max()}")
    return np.bincount(ids.astype(np.int64), minlength=num_experts).astype(np.int64)


def send_splits(counts: np.ndarray, ep: int) -> list[int]:
    """Rows sent to each of the ``ep`` ranks, from the per-expert ``counts`` of :func:`dispatch_counts`."""
    counts = np.asarray(counts, dtype=np.int64)
    check_divisible(counts.size, ep)
    return [int(n) for n in counts.reshape(ep, -1).sum(axis=1)]


def expert_params_per_rank(num_experts: int, params_per_expert: int, ep: int, *, layers: int = 1,
                           bytes_per_param: float = 16.0, zero_edp: int = 1) -> dict[str, float]:
    """Expert parameters one rank keeps, and their bytes (16 B/param: fp32 weights, gradients and Adam).

    ``zero_edp`` is the expert-data-parallel group the optimizer state is further split over
    (ZeRO over edp); 1 keeps it whole.
    """
    per = check_divisible(num_experts, ep)
    params = per * _positive(params_per_expert, "params_per_expert") * _positive(layers, "layers")
    return {"experts": per * layers, "params": params,
            "bytes": params * float(bytes_per_param) / _positive(zero_edp, "zero_edp")}


def alltoall_bytes_per_step(tokens: int, top_k: int, hidden: int, ep: int, *, layers: int = 1,
                            bytes_per_element: int = 4, backward: bool = True) -> float:
    """Bytes one rank sends in the all-to-alls of a step with uniform routing.

    Each of its ``tokens`` is dispatched as ``top_k`` rows of ``hidden`` elements and the
    results come back the same way (2 all-to-alls per layer forward, 2 more in backward);
    a share ``1 / ep`` of the rows stays on the rank itself.
    """
    tokens, ep = int(tokens), _positive(ep, "ep")
    if tokens < 0:
        raise ConfigError(f"tokens must be >= 0, got {tokens}")
    rows = tokens * _positive(top_k, "top_k") * (ep - 1) / ep
    per_exchange = rows * _positive(hidden, "hidden") * bytes_per_element
    return per_exchange * 2 * (2 if backward else 1) * _positive(layers, "layers")


def routing_imbalance(counts: Sequence[int] | np.ndarray, ep: int) -> float:
    """The busiest rank's rows over the mean (1.0: perfectly balanced), from per-expert counts.

    The step time of an all-to-all expert layer follows the busiest rank; the planner
    multiplies the expert compute by this factor.
    """
    per_rank = np.asarray(send_splits(np.asarray(counts, dtype=np.int64), ep), dtype=np.float64)
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0
