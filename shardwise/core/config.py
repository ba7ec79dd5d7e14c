"""Typed, validated training configuration, readable from shardwise or DeepSpeed JSON.

Configs are frozen keyword-only dataclasses validated in ``__post_init__`` (bad
values raise :class:`~shardwise.core.errors.ConfigError` naming the field);
change one with :func:`dataclasses.replace`, which validates again. Unknown keys
raise with a "did you mean" hint; DeepSpeed keys are handled as described in
:meth:`TrainingConfig.from_deepspeed`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import operator
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping, NamedTuple, Optional, Union

from .errors import ConfigError

__all__ = ["ConfigWarning", "ZeroConfig", "PrecisionConfig", "TrainingConfig", "BatchSizes"]


class ConfigWarning(UserWarning):
    """A config key was accepted but has no effect in shardwise."""


def _value(v: Any, what: str, kinds: tuple, kind_name: str) -> Any:
    if isinstance(v, str) and v.strip().lower() == "auto":
        raise ConfigError(f"{what} is 'auto'; shardwise does not resolve DeepSpeed 'auto' values, "
                          f"give {kind_name}")
    if not isinstance(v, kinds):
        raise ConfigError(f"{what} must be {kind_name}, got {v!r}")
    return v


def _int(v: Any, what: str, minimum: int = 1) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # DeepSpeed configs write 5e8
    if isinstance(v, bool):
        raise ConfigError(f"{what} must be an integer, got {v!r}")
    try:
        v = operator.index(_value(v, what, (object,), "an integer"))
    except TypeError:
        raise ConfigError(f"{what} must be an integer, got {v!r}") from None
    if v < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {v}")
    return v


def _float(v: Any, what: str, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(v, bool):
        raise ConfigError(f"{what} must be a number, got {v!r}")
    v = float(_value(v, what, (int, float), "a number"))
    if v < minimum or (strict and v == minimum):
        raise ConfigError(f"{what} must be {'>' if strict else '>='} {minimum}, got {v}")
    return v


def _bool(v: Any, what: str) -> bool:
    return _value(v, what, (bool,), "true or false")


def _choice(v: Any, what: str, choices: tuple[str, ...]) -> str:
    key = v.lower() if isinstance(v, str) else v
    if key not in choices:
        raise ConfigError(f"{what} must be one of {', '.join(repr(c) for c in choices)}, got {v!r}")
    return key


def _section(v: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{what} must be a JSON object, got {v!r}")
    return v


def _check_keys(data: Mapping[str, Any], known: Iterable[str], section: str) -> None:
    """Raise on the first key not in ``known``, suggesting the closest known one."""
    known = sorted(known)
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            raise ConfigError(f"unknown key {key!r} in {section}; {hint}")


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


class _FromDict:
    _SECTION: ClassVar[str]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """Build from shardwise key names, refusing unknown keys."""
        _check_keys(_section(data, cls._SECTION), [f.name for f in dataclasses.fields(cls)], cls._SECTION)
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(_FromDict):
    """ZeRO data parallelism: what is partitioned and how gradients move."""

    _SECTION: ClassVar[str] = "zero"

    stage: int = 0
    """0 plain data parallel; 1 shard optimizer states; 2 also gradients; 3 also parameters."""
    reduce_bucket_size: int = 500_000_000
    """Elements reduced per collective (DeepSpeed's default 5e8)."""
    allgather_bucket_size: int = 500_000_000
    """Elements all-gathered per collective (DeepSpeed's default 5e8)."""
    overlap_comm: bool = False
    """Overlap gradient reduction with the backward pass."""
    offload_optimizer: str = "none"
    """Where optimizer states and the step live: "none" (accelerator) or "cpu"."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    alignment: int = 2
    """Shard length multiple, in elements (2 = DeepSpeed's NCCL start alignment for 16-bit)."""
    shard_size: int = 0
    """Hybrid sharding (DeepSpeed's ``mics_shard_size``, FSDP2's HSDP): shard over groups of this many
    data-parallel ranks and replicate across the groups; 0 shards over all of them."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero stage must be 0, 1, 2 or 3, got {self.stage!r}")
        _set(self, "stage", int(self.stage))
        _set(self, "reduce_bucket_size", _int(self.reduce_bucket_size, "reduce_bucket_size"))
        _set(self, "allgather_bucket_size", _int(self.allgather_bucket_size, "allgather_bucket_size"))
        _bool(self.overlap_comm, "overlap_comm")
        _bool(self.contiguous_gradients, "contiguous_gradients")
        _set(self, "offload_optimizer", _choice(self.offload_optimizer, "offload_optimizer", ("none", "cpu")))
        _set(self, "alignment", _int(self.alignment, "alignment"))
        _set(self, "shard_size", _int(self.shard_size, "shard_size", minimum=0))
        if self.shard_size and self.stage == 0:
            raise ConfigError(f"shard_size={self.shard_size} groups ZeRO's shards, but zero stage 0 shards nothing")
        if self.offload_optimizer == "cpu" and self.stage == 0:
            raise ConfigError("offload_optimizer='cpu' needs zero stage 1, 2 or 3, got stage 0")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig(_FromDict):
    """Training dtype and, for fp16, the loss-scaling schedule."""

    _SECTION: ClassVar[str] = "precision"

    dtype: str = "fp32"
    """Parameter and gradient dtype: "fp32", "bf16" or "fp16" (16-bit keep an fp32 master copy)."""
    dynamic: bool = True
    """fp16 only: adapt the loss scale to overflows (False: use static_loss_scale)."""
    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16: overflow-free steps before the scale is doubled."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale is halved."""
    min_loss_scale: float = 1.0
    """fp16: the dynamic scale never drops below this."""
    static_loss_scale: float = 1.0
    """fp16 with dynamic=False: the fixed loss scale."""

    def __post_init__(self) -> None:
        _set(self, "dtype", _choice(self.dtype, "precision dtype", ("fp32", "bf16", "fp16")))
        _bool(self.dynamic, "dynamic")
        power = _int(self.initial_scale_power, "initial_scale_power", minimum=0)
        if power > 64:
            raise ConfigError(f"initial_scale_power must be <= 64, got {power}")
        _set(self, "initial_scale_power", power)
        _set(self, "loss_scale_window", _int(self.loss_scale_window, "loss_scale_window"))
        _set(self, "hysteresis", _int(self.hysteresis, "hysteresis"))
        _set(self, "min_loss_scale", _float(self.min_loss_scale, "min_loss_scale", strict=True))
        _set(self, "static_loss_scale", _float(self.static_loss_scale, "static_loss_scale", strict=True))

    @property
    def uses_loss_scaling(self) -> bool:
        """True for fp16, the only dtype that needs a loss scale."""
        return self.dtype == "fp16"


class BatchSizes(NamedTuple):
    """Global batch, per-rank micro batch and accumulation steps for one world size."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig(_FromDict):
    """Everything the training engine reads; batch sizes follow DeepSpeed's rules."""

    _SECTION: ClassVar[str] = "training config"

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO settings."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Dtype and loss scaling."""
    train_batch_size: Optional[int] = None
    """Global batch = micro batch * accumulation steps * data-parallel size (None: derived)."""
    train_micro_batch_size_per_gpu: Optional[int] = None
    """Samples per rank per forward/backward (None: derived, or 1)."""
    gradient_accumulation_steps: Optional[int] = None
    """Micro batches per optimizer step (None: derived, or 1)."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    tensor_parallel: int = 1
    """Tensor-parallel degree (DeepSpeed's ``tensor_parallel.autotp_size``); dp fills the other ranks."""
    expert_parallel: int = 1
    """Expert-parallel degree, carved out of data parallelism (DeepSpeed's
    ``expert_parallel.autoep_size``); it divides the data-parallel degree."""
    pipeline_stages: int = 1
    """Pipeline stages (DeepSpeed's ``pipeline.stages``); as in DeepSpeed's pipeline engine, the
    accumulation steps are then the pipeline's micro-batches."""
    vocab_parallel: bool = False
    """Split the token table and LM head by vocabulary over tp (DeepSpeed's
    ``tensor_parallel.vocab_parallel_lm_head``)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (DeepSpeed's
    ``pipeline.activation_checkpoint_interval`` > 0)."""

    def __post_init__(self) -> None:
        if isinstance(self.zero, Mapping):
            _set(self, "zero", ZeroConfig.from_dict(self.zero))
        if isinstance(self.precision, Mapping):
            _set(self, "precision", PrecisionConfig.from_dict(self.precision))
        if not isinstance(self.zero, ZeroConfig):
            raise ConfigError(f"zero must be a ZeroConfig, got {self.zero!r}")
        if not isinstance(self.precision, PrecisionConfig):
            raise ConfigError(f"precision must be a PrecisionConfig, got {self.precision!r}")
        for name in _BATCH:
            if getattr(self, name) is not None:
                _set(self, name, _int(getattr(self, name), name))
        _set(self, "gradient_clipping", _float(self.gradient_clipping, "gradient_clipping"))
        _set(self, "tensor_parallel", _int(self.tensor_parallel, "tensor_parallel"))
        _set(self, "pipeline_stages", _int(self.pipeline_stages, "pipeline_stages"))
        _set(self, "expert_parallel", _int(self.expert_parallel, "expert_parallel"))
        for name in ("vocab_parallel", "activation_checkpointing"):
            _set(self, name, _bool(getattr(self, name), name))
        train, micro, gas = (getattr(self, n) for n in _BATCH)
        if None not in (train, micro, gas) and train % (micro * gas):
            raise ConfigError(f"train_batch_size {train} is not a multiple of "
                              f"train_micro_batch_size_per_gpu {micro} * gradient_accumulation_steps {gas}")

    def resolve_batch(self, world_size: int) -> BatchSizes:
        """Fill in the missing batch sizes for ``world_size`` data-parallel ranks and check them."""
        world = _int(world_size, "world_size")
        train, micro, gas = (getattr(self, n) for n in _BATCH)
        if train is not None and (micro is None or gas is None):
            if micro is None and gas is None:
                gas = 1
            if micro is None:
                micro = train // (world * gas)
            else:
                gas = train // (world * micro)
        micro, gas = micro or 1, gas or 1
        train = train if train is not None else micro * gas * world
        if micro < 1 or gas < 1 or train != micro * gas * world:
            raise ConfigError(f"batch sizes do not fit world size {world}: train_batch_size {train} != "
                              f"micro batch {micro} * accumulation steps {gas} * {world}")
        return BatchSizes(train, micro, gas)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, readable by :meth:`from_dict`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_deepspeed(cls, config: Union[Mapping[str, Any], str, "os.PathLike[str]"]) -> "TrainingConfig":
        """Read a DeepSpeed JSON config (a dict or a path to a JSON file).

        Maps ``zero_optimization``, ``fp16``/``bf16``, the batch sizes,
        ``gradient_clipping``, ``pipeline`` (``stages``, ``activation_checkpoint_interval``)
        ``tensor_parallel`` (``autotp_size``, ``vocab_parallel_lm_head``) and ``expert_parallel``
        (AutoEP's ``enabled``, ``autoep_size``); known DeepSpeed
        keys without an effect here (``optimizer``, ``scheduler``, ``stage3_*`` tuning, ...) are
        ignored with a :class:`ConfigWarning`; keys asking for missing features raise.
        """
        if not isinstance(config, Mapping):
            try:
                with open(config, encoding="utf-8") as fh:
                    config = json.load(fh)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read DeepSpeed config {os.fspath(config)!r}: {exc}") from exc
        return _from_deepspeed(cls, _section(config, "DeepSpeed config"))


# -- DeepSpeed key tables -----------------------------------------------------------
_DS_TOP = {"zero_optimization", "fp16", "bf16", "bfloat16", "gradient_clipping", "pipeline", "tensor_parallel",
           "expert_parallel", *_BATCH}
_DS_TOP_IGNORED = frozenset("""
    optimizer scheduler steps_per_print wall_clock_breakdown dump_state memory_breakdown
    prescale_gradients gradient_predivide_factor sparse_gradients zero_allow_untested_optimizer
    zero_force_ds_cpu_optimizer communication_data_type seq_parallel_communication_data_type
    amp torch_autocast tensorboard wandb csv_monitor comet flops_profiler activation_checkpointing
    checkpoint data_types aio elasticity autotuning comms_logger compression_training
    data_efficiency curriculum_learning sparse_attention eigenvalue progressive_layer_drop
    quantize_training nebula hybrid_engine dataloader_drop_last disable_allgather timers compile
    graph_harvesting use_data_before_expert_parallelism weight_quantization""".split())
_DS_ZERO = {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
            "contiguous_gradients", "offload_optimizer", "cpu_offload", "mics_shard_size", "zero_hpz_partition_size"}
_DS_ZERO_IGNORED = frozenset("""
    reduce_scatter allgather_partitions load_from_fp32_weights ignore_unused_parameters
    round_robin_gradients sub_group_size elastic_checkpoint legacy_stage1 offload_param
    cpu_offload_param cpu_offload_use_pin_memory use_multi_rank_bucket_allreduce
    stage3_max_live_parameters stage3_max_reuse_distance stage3_prefetch_bucket_size
    stage3_param_persistence_threshold stage3_model_persistence_threshold
    stage3_gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save
    stage3_module_granularity_threshold stage3_use_all_reduce_for_fetch_params
    zero_quantized_weights zero_quantized_nontrainable_weights
    zero_quantized_gradients zeropp_loco_param mics_hierarchical_params_gather
    memory_efficient_linear pipeline_loading_checkpoint override_module_apply""".split())
_DS_OFFLOAD_IGNORED = frozenset(
    "pin_memory ratio buffer_count fast_init nvme_path pipeline pipeline_read pipeline_write".split())
_DS_FP16 = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
            "min_loss_scale"}
_DS_FP16_IGNORED = frozenset({"auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"})
_DS_BF16_IGNORED = frozenset({"immediate_grad_update"})
_DS_PIPELINE = {"stages", "activation_checkpoint_interval"}
# the stage partition is shardwise's own (balanced by parameters), seeds follow the one-process build
_DS_PIPELINE_IGNORED = frozenset({"partition", "seed_layers", "pipe_partitioned", "grad_partitioned",
                                  "use_reentrant"})
_DS_TP = {"autotp_size", "vocab_parallel_lm_head", "tp", "partition_config"}
_DS_TP_IGNORED = frozenset({"enabled", "dtype", "tp_overlap_comm", "preset_model", "tp_grain_size",
                            "keep_module_on_host", "injection_policy_tuple", "vocab_parallel_ce_backend"})

# AutoEP (DeepSpeed's ``expert_parallel`` section): the size is used; routing and kernel settings are the
# model's own here (HF's router and experts forward run as they are), so they have no effect
_DS_EP = {"enabled", "autoep_size", "expert_tensor_parallel_size"}
_DS_EP_IGNORED = frozenset("""
    preset_model moe_layer_pattern expert_pattern router_pattern use_grouped_mm grouped_mm_backend
    disable_triton_grouped_mm route_norm route_scale score_apply combine_impl comm_backend comm_num_sm
    comm_qp_margin comm_max_tokens_per_rank num_expert_groups num_limited_groups score_func top_k
    load_balance_coeff routed_scaling_factor validate_folding_routing async_split_plan layer_specs
    expert_w1 expert_w2 expert_w3""".split())


def _ds_keys(data: Mapping[str, Any], used: Iterable[str], ignored: frozenset, section: str) -> None:
    """Refuse unknown keys and warn once about known DeepSpeed keys that have no effect."""
    _check_keys(data, set(used) | ignored, section)
    dropped = sorted(k for k in data if k in ignored)
    if dropped:
        warnings.warn(f"ignoring DeepSpeed keys in {section} that shardwise does not use: "
                      f"{', '.join(dropped)}", ConfigWarning, stacklevel=2)


def _ds_unsupported(zero: Mapping[str, Any]) -> None:
    """Raise for ignored-list keys whose value asks for a feature shardwise lacks."""
    param = zero.get("offload_param")
    if isinstance(param, Mapping) and str(param.get("device", "none")).lower() != "none":
        raise ConfigError(f"zero_optimization.offload_param device {param.get('device')!r} is not "
                          "supported; shardwise does not offload parameters")
    for key in ("cpu_offload_param", "zero_quantized_weights", "zero_quantized_gradients",
                "zero_quantized_nontrainable_weights"):
        if zero.get(key) is True:
            raise ConfigError(f"zero_optimization.{key}=true is not supported by shardwise")


def _ds_hybrid(zero: Mapping[str, Any]) -> dict[str, int]:
    """``mics_shard_size`` as hybrid sharding; ZeRO++'s hpZ (a second, node-local copy of the shards,
    with the optimizer state still over every rank) is refused, not silently trained without."""
    hpz = _int(zero.get("zero_hpz_partition_size", 1), "zero_optimization.zero_hpz_partition_size")
    if hpz > 1:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size={hpz} (ZeRO++ hpZ) is not supported; "
                          f"mics_shard_size={hpz} shards everything within groups of {hpz} ranks and replicates "
                          "across them (hybrid sharding), so its gathers stay within the group too")
    mics = _int(zero.get("mics_shard_size", -1), "zero_optimization.mics_shard_size", minimum=-1)
    return {"shard_size": mics} if mics > 0 else {}


def _ds_zero(zero: Any) -> ZeroConfig:
    if isinstance(zero, bool):  # deprecated DeepSpeed form: true means stage 1
        return ZeroConfig(stage=int(zero))
    zero = _section(zero, "zero_optimization")
    _ds_keys(zero, _DS_ZERO, _DS_ZERO_IGNORED, "zero_optimization")
    _ds_unsupported(zero)
    kwargs = {k: zero[k] for k in _DS_ZERO - {"offload_optimizer", "cpu_offload", "mics_shard_size",
                                              "zero_hpz_partition_size"} if k in zero}
    kwargs.update(_ds_hybrid(zero))
    kwargs.setdefault("overlap_comm", zero.get("stage", 0) == 3)  # DeepSpeed's dynamic default
    if _bool(zero.get("cpu_offload", False), "zero_optimization.cpu_offload"):
        kwargs["offload_optimizer"] = "cpu"
    if "offload_optimizer" in zero and zero["offload_optimizer"] is not None:
        off = _section(zero["offload_optimizer"], "zero_optimization.offload_optimizer")
        _ds_keys(off, {"device"}, _DS_OFFLOAD_IGNORED, "zero_optimization.offload_optimizer")
        device = off.get("device", "none")
        kwargs["offload_optimizer"] = _choice("none" if device is None else device,
                                              "zero_optimization.offload_optimizer.device", ("none", "cpu"))
    return ZeroConfig(**kwargs)


def _ds_precision(cfg: Mapping[str, Any]) -> PrecisionConfig:
    fp16 = _section(cfg.get("fp16", {}), "fp16")
    bf16 = _section(cfg.get("bf16", cfg.get("bfloat16", {})), "bf16")
    _ds_keys(fp16, _DS_FP16, _DS_FP16_IGNORED, "fp16")
    _ds_keys(bf16, {"enabled"}, _DS_BF16_IGNORED, "bf16")
    use_fp16 = _bool(fp16.get("enabled", False), "fp16.enabled")
    use_bf16 = _bool(bf16.get("enabled", False), "bf16.enabled")
    if use_fp16 and use_bf16:
        raise ConfigError("fp16 and bf16 cannot both be enabled")
    kwargs: dict[str, Any] = {"dtype": "fp16" if use_fp16 else "bf16" if use_bf16 else "fp32"}
    kwargs.update({k: fp16[k] for k in ("initial_scale_power", "loss_scale_window", "hysteresis",
                                         "min_loss_scale") if k in fp16})
    scale = _float(fp16.get("loss_scale", 0), "fp16.loss_scale")
    kwargs["dynamic"] = scale == 0  # DeepSpeed: 0 means dynamic
    if scale:
        kwargs["static_loss_scale"] = scale
    return PrecisionConfig(**kwargs)


def _ds_pipeline(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """TrainingConfig fields of DeepSpeed's ``pipeline`` section (``stages: "auto"`` leaves pp to the caller)."""
    pipe = _section(cfg.get("pipeline", {}), "pipeline")
    _ds_keys(pipe, _DS_PIPELINE, _DS_PIPELINE_IGNORED, "pipeline")
    out: dict[str, Any] = {}
    stages = pipe.get("stages", "auto")
    if not (isinstance(stages, str) and stages.strip().lower() == "auto"):
        out["pipeline_stages"] = _int(stages, "pipeline.stages")
    if _int(pipe.get("activation_checkpoint_interval", 0), "pipeline.activation_checkpoint_interval", 0):
        out["activation_checkpointing"] = True  # shardwise recomputes every block
    return out


def _ds_tensor_parallel(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """TrainingConfig fields of DeepSpeed's ``tensor_parallel`` (AutoTP training) section."""
    tp = _section(cfg.get("tensor_parallel", {}), "tensor_parallel")
    _ds_keys(tp, _DS_TP, _DS_TP_IGNORED, "tensor_parallel")
    if tp.get("partition_config") is not None:
        raise ConfigError("tensor_parallel.partition_config is not supported: shardwise splits a model by "
                          "its family's rules (GPT-2, Llama, Mistral, Qwen2)")
    inner = _section(tp.get("tp") or {}, "tensor_parallel.tp")
    _ds_keys(inner, {"tp_size"}, frozenset({"tp_grain_size", "mpu", "tp_group"}), "tensor_parallel.tp")
    size = tp.get("autotp_size", 0) or inner.get("tp_size", 1)
    out: dict[str, Any] = {"tensor_parallel": _int(size, "tensor_parallel.autotp_size")}
    if "vocab_parallel_lm_head" in tp:
        out["vocab_parallel"] = _bool(tp["vocab_parallel_lm_head"], "tensor_parallel.vocab_parallel_lm_head")
    return out


def _ds_expert_parallel(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """TrainingConfig fields of DeepSpeed's ``expert_parallel`` (AutoEP) section."""
    ep = _section(cfg.get("expert_parallel", {}), "expert_parallel")
    _ds_keys(ep, _DS_EP, _DS_EP_IGNORED, "expert_parallel")
    if not _bool(ep.get("enabled", False), "expert_parallel.enabled"):  # DeepSpeed's default: off
        if _int(ep.get("autoep_size", 1), "expert_parallel.autoep_size") > 1:
            warnings.warn(f"expert_parallel.autoep_size={ep['autoep_size']} has no effect: expert_parallel."
                          "enabled is not true", ConfigWarning, stacklevel=3)
        return {}
    etp = _int(ep.get("expert_tensor_parallel_size", 1), "expert_parallel.expert_tensor_parallel_size")
    if etp != 1:
        raise ConfigError(f"expert_parallel.expert_tensor_parallel_size={etp} is not supported: shardwise keeps "
                          "each expert whole on its expert-parallel rank")
    return {"expert_parallel": _int(ep.get("autoep_size", 1), "expert_parallel.autoep_size")}


def _from_deepspeed(cls: type, cfg: Mapping[str, Any]) -> TrainingConfig:
    _ds_keys(cfg, _DS_TOP, _DS_TOP_IGNORED, "DeepSpeed config")
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ConfigError("DeepSpeed config has both 'bf16' and 'bfloat16'; keep one")
    kwargs = {k: cfg[k] for k in (*_BATCH, "gradient_clipping") if k in cfg}
    kwargs.update(_ds_pipeline(cfg), **_ds_tensor_parallel(cfg), **_ds_expert_parallel(cfg))
    return cls(zero=_ds_zero(cfg.get("zero_optimization", {})), precision=_ds_precision(cfg), **kwargs)
