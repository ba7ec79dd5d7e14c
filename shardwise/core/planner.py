"""Choose data / tensor / pipeline parallelism, ZeRO stage, micro-batching and recomputation.

:func:`plan` scores with :func:`~shardwise.core.cost_model.estimate` every layout
``dp x tp x pp = num_devices`` (``tp`` dividing the node size and the head count,
``pp`` at most the layer count, ``dp`` dividing the global batch), every ZeRO stage
(0 when ``dp == 1``; 0-2 with pipelining: ZeRO-3 would gather every stage once per
micro-batch, and DeepSpeed refuses it too), power-of-two micro-batch counts,
recomputation on/off and, when ``tp > 1``, sequence and vocabulary parallelism on/off, and
ranks those that fit in device memory by step time. For a Mixture-of-Experts model it also
tries every expert-parallel degree ``ep`` that divides both ``dp`` and the expert count
(the experts split over ep ranks, all-to-all token exchange; ``moe_imbalance`` is the
busiest rank's share of the routed tokens over the mean, see :mod:`.moe_cost`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from itertools import product
from typing import Any, Iterator, Optional

from .cost_model import Candidate, CommBytes, MemoryBreakdown, estimate
from .errors import ConfigError
from .hardware import Hardware
from .memory import DtypePolicy
from .model_spec import ModelSpec
from .moe_cost import check_imbalance

__all__ = ["MemoryBreakdown", "CommBytes", "Candidate", "PlanResult", "PlanError", "estimate", "plan"]


class PlanError(ConfigError):
    """No candidate fits; ``smallest`` is the one that needs the least memory (if any)."""

    def __init__(self, message: str, smallest: Optional["Candidate"] = None) -> None:
        super().__init__(message)
        self.smallest = smallest


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """Every candidate of :func:`plan`, the fitting ones first by step time, then the rest by memory."""

    model: ModelSpec
    """The model planned for."""
    hardware: Hardware
    """The cluster planned for."""
    global_batch: int
    """Sequences per optimizer step."""
    optimizer: str
    """Optimizer name, as given."""
    precision: str
    """Training precision, as given."""
    candidates: tuple[Candidate, ...]
    moe_imbalance: float = 1.0
    """Routing imbalance assumed for expert parallelism (the busiest rank's tokens over the mean)."""
    """All candidates, ranked; ``candidates[0]`` is the best."""

    @property
    def best(self) -> Candidate:
        """The fastest candidate that fits."""
        return self.candidates[0]

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        """Candidates that fit, fastest first."""
        return tuple(c for c in self.candidates if c.fits)

    def layouts(self) -> list[Candidate]:
        """The best candidate of each ``(dp, tp, pp, zero)``, expert-parallel degree and hybrid sharding,
        in rank order."""
        seen: set[tuple[tuple[int, int, int, int], int, int]] = set()
        return [c for c in self.candidates
                if not ((c.layout, c.ep, c.dp_replicate) in seen or seen.add((c.layout, c.ep, c.dp_replicate)))]

    def rejected_strategies(self) -> list[Candidate]:
        """For each strategy name with no fitting candidate, its smallest-memory candidate."""
        ok = {c.strategy for c in self.fitting}
        seen: set[str] = set()
        return [c for c in self.candidates
                if not c.fits and c.strategy not in ok and not (c.strategy in seen or seen.add(c.strategy))]

    def to_dict(self, top: Optional[int] = None) -> dict[str, Any]:
        """JSON-ready: inputs, best, the best ``top`` layouts (all if ``None``), rejected strategies."""
        rows = self.layouts()
        return {"model": asdict(self.model), "hardware": asdict(self.hardware),
                "global_batch": self.global_batch, "optimizer": self.optimizer,
                "precision": self.precision, "moe_imbalance": self.moe_imbalance,
                "num_candidates": len(self.candidates),
                "num_fitting": len(self.fitting), "best": self.best.to_dict(),
                "layouts": [c.to_dict() for c in rows[:top]],
                "rejected_strategies": [c.to_dict() for c in self.rejected_strategies()]}


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _configs(model: ModelSpec, hardware: Hardware, global_batch: int, max_micro_batches: Optional[int],
             split_options: tuple[bool, ...]) -> Iterator[dict[str, Any]]:
    """Keyword arguments of :func:`estimate` for every valid configuration."""
    n, node = hardware.num_devices, hardware.node_size
    for tp in _divisors(n):
        kv = int(model.num_kv_heads or model.heads)
        if node % tp or model.heads % tp or (kv % tp and tp % kv):  # key/value heads split or replicated
            continue
        for pp, cp in ((pp, cp) for pp in _divisors(n // tp) for cp in _context_degrees(model, n // (tp * pp), tp, pp,
                                                                                         node, global_batch)):
            dp = n // (tp * pp)
            if pp > model.num_layers:
                continue
            per_replica = global_batch // (dp // cp)
            counts = {m for m in (2 ** k for k in range(per_replica.bit_length())) if per_replica % m == 0}
            counts.add(per_replica)
            zeros = (0,) if dp == 1 else (0, 1, 2, 3) if pp == 1 else (0, 1, 2)
            eps = [e for e in _divisors(dp) if model.num_experts % e == 0] if model.is_moe and cp == 1 else [1]
            for m in sorted(counts):
                if max_micro_batches is not None and m > max_micro_batches:
                    continue
                splits = split_options if tp > 1 and cp == 1 else (False,)
                for ep, zero, ckpt, sp, vp in product(eps, zeros, (False, True), splits, splits):
                    if ep > 1 and sp:  # ParallelLayout refuses sequence parallelism with ep (not built)
                        continue
                    for replicate in _replicas(dp, tp, node, zero, ep) if cp == 1 else [1]:
                        yield dict(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, micro_batches=m, checkpointing=ckpt,
                                   sequence_parallel=sp, vocab_parallel=vp, dp_replicate=replicate, cp=cp)


def _context_degrees(model: ModelSpec, dp: int, tp: int, pp: int, node: int, global_batch: int) -> list[int]:
    """1 where the global batch splits over the dp ranks; otherwise the context-parallel degrees that let it
    (carved out of dp, the ring within a node, 2 cp dividing the sequence, no pipeline or experts): with the
    same data replicas, context parallelism holds no fewer tokens per rank, so it is weighed only where the
    batch is too small to give every rank whole sequences."""
    if global_batch % dp == 0:
        return [1]
    if pp > 1 or model.is_moe:
        return []
    return [c for c in _divisors(dp) if c > 1 and tp * c <= node and model.seq_len % (2 * c) == 0
            and global_batch % (dp // c) == 0]


def _replicas(dp: int, tp: int, node: int, zero: int, ep: int) -> list[int]:
    """1 (ZeRO over every data-parallel rank) and, where dp spans nodes, hybrid sharding with one shard
    group per node (the dp ranks of one node: ``node // tp`` of them)."""
    per_node = node // tp
    if zero and ep == 1 and dp > per_node > 1 and dp % per_node == 0:
        return [1, dp // per_node]
    return [1]


def _secs(seconds: float) -> str:
    """Seconds with two decimals, or three significant digits below one second."""
    return f"{seconds:.2f}" if seconds >= 1 else f"{seconds:.3g}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def plan(model: ModelSpec, hardware: Hardware, *, global_batch: int, optimizer: str = "adam",
         precision: str = "bf16", overlap: float = 0.8, bucket_bytes: int = 25_000_000,
         max_micro_batches: Optional[int] = None, sequence_and_vocab_parallel: bool = True,
         moe_imbalance: float = 1.0) -> PlanResult:
    """Rank every configuration; raise :class:`PlanError` naming the smallest need if none fits.

    Ties in step time go to less communication, then the simpler layout (lower
    ZeRO stage, fewer micro-batches, no recomputation, no sequence or vocabulary
    parallelism, smaller ``tp``, ``pp`` and ``ep``). ``sequence_and_vocab_parallel=False`` leaves
    those two switches off (a model without tensor-parallel rules for them).
    ``moe_imbalance`` (>= 1) scales the busiest expert-parallel rank's expert compute and all-to-all.
    """
    _positive(global_batch, "global_batch")
    moe_imbalance = check_imbalance(moe_imbalance)
    if max_micro_batches is not None:
        _positive(max_micro_batches, "max_micro_batches")
    DtypePolicy.of(precision, optimizer)  # fail early on a bad name
    found = [estimate(model, hardware, global_batch=global_batch, optimizer=optimizer,
                      precision=precision, overlap=overlap, bucket_bytes=bucket_bytes,
                      moe_imbalance=moe_imbalance, **kw)
             for kw in _configs(model, hardware, global_batch, max_micro_batches,
                                (False, True) if sequence_and_vocab_parallel else (False,))]
    if not found:
        raise PlanError(f"no layout of {hardware.num_devices} devices divides global batch {global_batch} "
                        f"(data-parallel degree must divide it)")
    fits = sorted((c for c in found if c.fits),
                  key=lambda c: (c.step_time, c.comm_bytes.total, c.zero, c.dp_replicate, c.micro_batches,
                                 c.checkpointing, c.sequence_parallel, c.vocab_parallel, c.tp, c.pp, c.ep))
    rest = sorted((c for c in found if not c.fits), key=lambda c: (c.memory.total, c.step_time))
    limit = _gb(hardware.memory_per_device)
    if not fits:
        low = rest[0]
        raise PlanError(f"nothing fits in {limit} per device: the smallest candidate needs "
                        f"{_gb(low.memory.total)} ({low.strategy}, {low.describe()}); add devices or "
                        f"memory per device, or shorten the sequence", smallest=low)
    best = fits[0]
    ranked = [replace(best, reason="best")]
    for c in fits[1:]:
        why = (f"slower: {_secs(c.step_time)} s/step vs best {_secs(best.step_time)} s "
               f"(comm {c.comm_fraction:.0%})") if c.step_time > best.step_time * (1 + 1e-9) else \
            "as fast as best, but more communication or a more complex layout"
        ranked.append(replace(c, reason=why))
    ranked += [replace(c, reason=f"does not fit: {_gb(c.memory.total)} > {limit}") for c in rest]
    return PlanResult(model=model, hardware=hardware, global_batch=global_batch, optimizer=optimizer,
                      precision=precision, candidates=tuple(ranked), moe_imbalance=moe_imbalance)
