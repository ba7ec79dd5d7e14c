"""The parallel layout: one validated, frozen description of how a model is trained in parallel.

A :class:`ParallelLayout` is what the runtime consumes (``shardwise.torch.parallelize``).
It comes from one of three places, always through this class so that it is
validated the same way:

* by hand: ``ParallelLayout(dp=2, tp=2, zero_stage=1)``;
* from a :class:`~shardwise.core.config.TrainingConfig` (and so from a DeepSpeed
  JSON): :meth:`ParallelLayout.from_config`;
* from the planner: :meth:`ParallelLayout.from_plan` takes a
  :class:`~shardwise.core.planner.PlanResult`, one of its candidates, or the JSON
  that ``shardwise plan --json`` wrote.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from .context_plan import CONTEXT_MODES
from .config import ConfigWarning, PrecisionConfig, TrainingConfig, _bool, _check_keys, _choice, _float, _int
from .errors import ConfigError, MeshError
from .loss_scale import LossScaler

__all__ = ["ParallelLayout", "SCHEDULES", "PRECISIONS", "read_json"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")

_BYTES_PER_ELEMENT = 4  # DeepSpeed sizes reduce buckets in elements; our buckets are in bytes of fp32 gradients


def read_json(path: Union[str, "os.PathLike[str]"], what: str) -> Any:
    """The JSON document at ``path``; :class:`ConfigError` naming ``what`` and the path if unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {what} {os.fspath(path)!r}: {exc}") from exc


def _agree(given: int, configured: int, name: str, field: str) -> int:
    """The degree from the argument or the config; both set to different values is an error."""
    if given > 1 and configured > 1 and given != configured:
        raise ConfigError(f"{name}={given} was given, but the config's {field} is {configured}")
    return max(given, configured)


def _warn_inert(config: TrainingConfig) -> None:
    """Warn about ZeRO settings of ``config`` that the torch runtime cannot honour as asked."""
    zero, inert = config.zero, []
    if not zero.overlap_comm and zero.stage:
        inert.append("overlap_comm=false (gradient reduction always overlaps backward)")
    if not zero.contiguous_gradients:
        inert.append("contiguous_gradients=false (gradients are always bucketed contiguously)")
    if zero.allgather_bucket_size != zero.reduce_bucket_size and zero.stage in (1, 2):
        inert.append("allgather_bucket_size (parameters are gathered per reduce bucket)")
    if inert:
        warnings.warn("ZeRO settings with no effect here: " + "; ".join(inert), ConfigWarning, stacklevel=3)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How one training job is split: mesh degrees, ZeRO, pipelining and the step's numerics."""

    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel ranks per replica (Megatron column/row split of the linear layers)."""
    pp: int = 1
    """Pipeline stages per replica (the model's layers cut by the balanced partitioner)."""
    ep: int = 1
    """Expert-parallel degree, carved out of data parallelism (DeepSpeed's ``ep_size``): the experts of
    each Mixture-of-Experts layer are split over groups of ``ep`` data-parallel ranks, and each expert is
    replicated over the ``dp // ep`` ranks of its expert-data-parallel group; ``ep`` divides ``dp``."""
    dp_replicate: int = 1
    """Hybrid sharding (FSDP2's HSDP, DeepSpeed's MiCS): the data-parallel ranks form ``dp_replicate``
    groups of ``dp_shard`` consecutive ranks (put one group on one node); ZeRO shards within a group,
    so its parameter gathers never leave it, and each reduced gradient shard is averaged across the
    groups. 1: one group, plain ZeRO."""
    cp: int = 1
    """Context-parallel degree, carved out of data parallelism (torchtitan's ``context_parallel_degree``):
    groups of ``cp`` consecutive data-parallel ranks train on the same samples, each holding a head and a
    tail chunk of every sequence (``2 * cp`` must divide the sequence length), and attend over the whole
    sequence together; ``cp`` divides ``dp``. Gradients and ZeRO stay over the whole dp group."""
    cp_attention: str = "ring"
    """How attention is split over the context-parallel group: "ring" (key/value blocks passed around
    it) or "ulysses" (all-to-all between the sequence and the head split; cp divides the heads)."""
    dp_shard: int = 0
    """Ranks per ZeRO shard group; 0 means ``dp // dp_replicate``. ``dp_shard`` and ``dp_replicate``
    given without ``dp`` set ``dp`` to their product."""
    zero_stage: int = 0
    """ZeRO over the data-parallel group: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters
    (with ``ep > 1`` the expert state is sharded over the expert-data-parallel group instead)."""
    micro_batches: int = 1
    """Pipeline micro-batches per batch (pp > 1 only)."""
    schedule: str = "1f1b"
    """Pipeline schedule: "gpipe", "1f1b" or "interleaved_1f1b"."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule only)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them."""
    sequence_parallel: bool = False
    """Split the activations between tensor-parallel regions (norms, residuals) along the sequence
    over tp (Megatron's sequence parallelism): each allreduce becomes a reduce-scatter and an
    allgather, those activations take tp times less memory (tp > 1)."""
    vocab_parallel: bool = False
    """Split the token embedding and the LM head by vocabulary over tp (tied ones stay tied) and take
    the loss from the logits slices, never forming the full logits (tp > 1)."""
    precision: str = "fp32"
    """Parameter dtype: "fp32", "bf16" or "fp16", the 16-bit ones with fp32 master weights (in ZeRO,
    or beside the parameters without it) and fp16 with a dynamic loss scale."""
    loss_scaling: Optional[PrecisionConfig] = None
    """fp16's loss-scale schedule (DeepSpeed's ``fp16`` section, a :class:`PrecisionConfig` or its
    dict); None: dynamic, starting at 2**16, doubled after 1000 clean steps, halved after 2 overflows."""
    bucket_bytes: int = 25_000_000
    """Gradient bucket size (fusion buffer) in bytes."""
    gradient_accumulation_steps: int = 1
    """Batches (each split over the mesh) whose gradients are averaged into one optimizer step."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    offload_optimizer: str = "none"
    """Where ZeRO keeps optimizer states and runs the step: "none" or "cpu"."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "cp", "dp_replicate", "micro_batches", "virtual_stages", "bucket_bytes",
                     "gradient_accumulation_steps"):
            object.__setattr__(self, name, _int(getattr(self, name), name))
        self._resolve_hybrid()
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        object.__setattr__(self, "schedule", _choice(self.schedule, "schedule", SCHEDULES))
        object.__setattr__(self, "precision", _choice(self.precision, "precision", PRECISIONS))
        object.__setattr__(self, "cp_attention", _choice(self.cp_attention, "cp_attention", CONTEXT_MODES))
        if isinstance(self.loss_scaling, Mapping):
            object.__setattr__(self, "loss_scaling", PrecisionConfig.from_dict(
                {**self.loss_scaling, "dtype": "fp16"}))
        if self.loss_scaling is not None:
            if not isinstance(self.loss_scaling, PrecisionConfig):
                raise ConfigError(f"loss_scaling must be a PrecisionConfig or a dict, got {self.loss_scaling!r}")
            if self.precision != "fp16":
                raise ConfigError(f"loss_scaling applies to precision 'fp16', not {self.precision!r}")
        object.__setattr__(self, "offload_optimizer",
                           _choice(self.offload_optimizer, "offload_optimizer", ("none", "cpu")))
        object.__setattr__(self, "gradient_clipping", _float(self.gradient_clipping, "gradient_clipping"))
        _bool(self.activation_checkpointing, "activation_checkpointing")
        _bool(self.vocab_parallel, "vocab_parallel")
        _bool(self.sequence_parallel, "sequence_parallel")
        self._check_combination()

    def _resolve_hybrid(self) -> None:
        """Fill in whichever of ``dp``, ``dp_shard`` and ``dp_replicate`` follows from the others."""
        shard = self.dp_shard
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
            raise ConfigError(f"dp_shard must be a non-negative integer (0: dp // dp_replicate), got {shard!r}")
        dp, replicate = self.dp, self.dp_replicate
        if dp == 1:
            dp = max(shard, 1) * replicate
        if shard == 0:
            if dp % replicate:
                raise ConfigError(f"dp_replicate={replicate} must divide dp={dp}: the data-parallel ranks form "
                                  "dp_replicate shard groups of equal size")
            shard = dp // replicate
        elif replicate == 1:
            if dp % shard:
                raise ConfigError(f"dp_shard={shard} must divide dp={dp}: the data-parallel ranks form shard "
                                  "groups of equal size")
            replicate = dp // shard
        if shard * replicate != dp:
            raise ConfigError(f"dp_shard={shard} x dp_replicate={replicate} must equal dp={dp}")
        for name, value in (("dp", dp), ("dp_shard", shard), ("dp_replicate", replicate)):
            object.__setattr__(self, name, value)

    @property
    def hybrid(self) -> bool:
        """True when ZeRO shards within groups and replicates across them (``dp_replicate > 1``)."""
        return self.dp_replicate > 1

    def _check_combination(self) -> None:
        if self.hybrid and not self.zero_stage:
            raise ConfigError(f"dp_replicate={self.dp_replicate} groups ZeRO's shards, but zero_stage=0 shards "
                              "nothing: set zero_stage 1, 2 or 3, or use dp alone")
        if self.hybrid and self.ep > 1:
            raise ConfigError(f"hybrid sharding (dp_replicate={self.dp_replicate}) with ep={self.ep} is not "
                              "supported yet")
        if self.dp % self.ep:
            raise ConfigError(f"ep={self.ep} must divide dp={self.dp}: the experts are split over groups of "
                              "ep data-parallel ranks")
        if self.dp % self.cp:
            raise ConfigError(f"cp={self.cp} must divide dp={self.dp}: the context-parallel groups are carved out "
                              f"of the data-parallel ranks (dp={self.dp} is {self.dp // self.cp or 0} groups of "
                              f"cp={self.cp} and {self.dp % self.cp} left over)")
        if self.cp > 1:
            other = [f"{name}={getattr(self, name)}" for name in ("pp", "ep", "dp_replicate")
                     if getattr(self, name) > 1]
            other += [name for name in ("sequence_parallel", "vocab_parallel") if getattr(self, name)]
            if other:
                raise ConfigError(f"cp={self.cp} with {', '.join(other)} is not supported yet; context "
                                  "parallelism composes with dp, ZeRO 1-3 and tp for now")
        if self.ep > 1 and self.sequence_parallel:
            raise ConfigError(f"sequence_parallel with ep={self.ep} is not supported yet")
        if self.zero_stage and self.dp == 1:
            raise ConfigError(f"zero_stage {self.zero_stage} shards over data-parallel ranks, but dp=1")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel splits the sequence over tensor-parallel ranks, but tp=1")
        if self.vocab_parallel and self.tp == 1:
            raise ConfigError("vocab_parallel splits the vocabulary over tensor-parallel ranks, but tp=1")
        if self.zero_stage == 3 and self.pp > 1:
            raise ConfigError(f"zero_stage 3 with pp={self.pp} is not supported: a pipeline stage would gather "
                              "its parameters once per micro-batch, forward and backward (DeepSpeed refuses "
                              "it too); use zero_stage 1 or 2 with pipelines")
        if self.offload_optimizer != "none" and not self.zero_stage:
            raise ConfigError("offload_optimizer needs zero_stage >= 1")
        if self.pp == 1 and (self.micro_batches != 1 or self.virtual_stages != 1):
            raise ConfigError(f"micro_batches={self.micro_batches} and virtual_stages={self.virtual_stages} "
                              "are pipeline settings; with pp=1 use gradient_accumulation_steps")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ConfigError(f"virtual_stages={self.virtual_stages} needs schedule 'interleaved_1f1b'")

    # ----------------------------------------------------------------- queries
    def loss_scaler(self) -> LossScaler:
        """A fresh loss scaler for this layout: fp16's schedule, else a constant 1."""
        if self.precision != "fp16":
            return LossScaler(dynamic=False)
        c = self.loss_scaling or PrecisionConfig(dtype="fp16")
        return LossScaler(initial_scale_power=c.initial_scale_power, window=c.loss_scale_window,
                          hysteresis=c.hysteresis, min_scale=c.min_loss_scale, dynamic=c.dynamic,
                          static_scale=c.static_loss_scale)

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    def check_world(self, world_size: int) -> None:
        """Raise :class:`MeshError` unless the layout fills exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            raise MeshError(f"layout dp={self.dp} x tp={self.tp} x pp={self.pp} needs {self.world_size} "
                            f"ranks, but the job has {world_size}")

    def describe(self) -> str:
        """One line, e.g. ``dp=2 tp=1 pp=2 zero=0 mb=4 1f1b``."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}", f"zero={self.zero_stage}"]
        if self.ep > 1:
            parts.insert(3, f"ep={self.ep}")
        if self.cp > 1:
            parts.insert(1, f"(cp={self.cp} {self.cp_attention})")
        if self.hybrid:
            parts.insert(1, f"(dp_shard={self.dp_shard} x dp_replicate={self.dp_replicate})")
        if self.pp > 1:
            parts += [f"micro_batches={self.micro_batches}", self.schedule]
        if self.gradient_accumulation_steps > 1:
            parts.append(f"accumulation={self.gradient_accumulation_steps}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.sequence_parallel:
            parts.append("sequence_parallel")
        if self.vocab_parallel:
            parts.append("vocab_parallel")
        if self.gradient_clipping:
            parts.append(f"clip={self.gradient_clipping:g}")
        if self.precision != "fp32":
            parts.append(self.precision)
        if self.loss_scaling is not None:
            c = self.loss_scaling
            parts.append(f"loss_scale=2^{c.initial_scale_power}/window {c.loss_scale_window}" if c.dynamic
                         else f"loss_scale={c.static_loss_scale:g}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, readable by :meth:`from_dict`."""
        return dataclasses.asdict(self)

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParallelLayout":
        """Build from field names, refusing unknown keys."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a layout must be a JSON object, got {data!r}")
        _check_keys(data, [f.name for f in dataclasses.fields(cls)], "layout")
        return cls(**data)

    @classmethod
    def from_config(cls, config: TrainingConfig, world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1,
                    micro_batches: int = 1, schedule: str = "1f1b",
                    activation_checkpointing: bool = False) -> "ParallelLayout":
        """The layout a training config asks for on ``world_size`` ranks (dp = world / (tp * pp)).

        ZeRO stage, optimizer offload, precision, gradient clipping, the reduce
        bucket size and the gradient accumulation steps (resolved from the batch
        sizes for this dp degree) come from ``config``, and so do ``tp``, ``pp``,
        vocabulary parallelism, recomputation and the expert-parallel degree where the
        config sets them (a DeepSpeed ``tensor_parallel``, ``pipeline`` or
        ``expert_parallel`` section; a ``tp``/``pp``/``ep`` given here as well must
        agree). Pipeline stages from the config take its
        accumulation steps as their micro-batches, as DeepSpeed's pipeline engine does.
        """
        if not isinstance(config, TrainingConfig):
            raise ConfigError(f"expected a TrainingConfig, got {type(config).__name__}")
        world = _int(world_size, "world_size")
        tp = _agree(_int(tp, "tp"), config.tensor_parallel, "tp", "tensor_parallel")
        pp = _agree(_int(pp, "pp"), config.pipeline_stages, "pp", "pipeline_stages")
        ep = _agree(_int(ep, "ep"), config.expert_parallel, "ep", "expert_parallel")
        if world % (tp * pp):
            raise MeshError(f"world size {world} is not divisible by tp={tp} x pp={pp}")
        dp = world // (tp * pp)
        batch = config.resolve_batch(dp)
        accumulation = batch.gradient_accumulation_steps
        if config.pipeline_stages > 1 and micro_batches == 1:
            micro_batches, accumulation = accumulation, 1
        _warn_inert(config)
        shard = config.zero.shard_size
        if shard and (shard > dp or dp % shard):
            raise ConfigError(f"the config's ZeRO shard_size (mics_shard_size) {shard} must divide dp={dp} "
                              f"(world {world} / (tp={tp} x pp={pp}))")
        return cls(dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=config.zero.stage, micro_batches=micro_batches,
                   dp_shard=shard if shard else 0,
                   schedule=schedule,
                   activation_checkpointing=activation_checkpointing or config.activation_checkpointing,
                   vocab_parallel=config.vocab_parallel, precision=config.precision.dtype,
                   loss_scaling=config.precision if config.precision.uses_loss_scaling else None,
                   bucket_bytes=config.zero.reduce_bucket_size * _BYTES_PER_ELEMENT,
                   gradient_accumulation_steps=accumulation,
                   gradient_clipping=config.gradient_clipping,
                   offload_optimizer=config.zero.offload_optimizer)

    @classmethod
    def from_plan(cls, plan: Union[Any, Mapping[str, Any], str, "os.PathLike[str]"],
                  precision: Optional[str] = None) -> "ParallelLayout":
        """The layout of a planner result: its best candidate, a candidate, or ``plan --json`` output.

        ``plan`` may be a :class:`~shardwise.core.planner.PlanResult`, a
        :class:`~shardwise.core.cost_model.Candidate`, the dict of either, or a path
        to the JSON file. The candidate's ``micro_batches`` are pipeline
        micro-batches when ``pp > 1`` and accumulation steps otherwise.
        """
        if isinstance(plan, (str, os.PathLike)):
            plan = read_json(plan, "plan")
        if hasattr(plan, "best") and not isinstance(plan, Mapping):
            plan = plan.best
        if hasattr(plan, "to_dict") and not isinstance(plan, Mapping):
            plan = plan.to_dict()
        if not isinstance(plan, Mapping):
            raise ConfigError(f"expected a plan result, a candidate or their JSON, got {type(plan).__name__}")
        cand = plan.get("best", plan)
        missing = [k for k in ("dp", "tp", "pp", "zero", "micro_batches", "checkpointing") if k not in cand]
        if missing:
            raise ConfigError(f"the plan has no {', '.join(missing)}: not a `shardwise plan --json` output")
        pp, m = int(cand["pp"]), int(cand["micro_batches"])
        dtype = precision or (plan.get("precision") if "best" in plan else None) or "fp32"
        return cls(dp=int(cand["dp"]), tp=int(cand["tp"]), pp=pp, ep=int(cand.get("ep", 1)),
                   cp=int(cand.get("cp", 1)), cp_attention=str(cand.get("cp_attention", "ring")),
                   dp_replicate=int(cand.get("dp_replicate", 1)),
                   zero_stage=int(cand["zero"]),
                   micro_batches=m if pp > 1 else 1, gradient_accumulation_steps=1 if pp > 1 else m,
                   activation_checkpointing=bool(cand["checkpointing"]),
                   sequence_parallel=bool(cand.get("sequence_parallel", False)),
                   vocab_parallel=bool(cand.get("vocab_parallel", False)), precision=dtype)
