"""Typed training config: validation, shardwise dicts and DeepSpeed JSON."""

import dataclasses
import json
import warnings

import pytest

from shardwise.core.config import (BatchSizes, ConfigWarning, PrecisionConfig, TrainingConfig,
                                   ZeroConfig)
from shardwise.core.errors import ConfigError

# A DeepSpeed config of the kind shipped with Megatron/HF examples.
DS_CONFIG = {
    "train_batch_size": 512,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1000}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "initial_scale_power": 12,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {
        "stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
        "reduce_scatter": True, "reduce_bucket_size": 5e7, "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
}


def test_defaults_are_valid():
    cfg = TrainingConfig()
    assert cfg.zero.stage == 0 and cfg.zero.reduce_bucket_size == 500_000_000
    assert cfg.precision.dtype == "fp32" and not cfg.precision.uses_loss_scaling
    assert cfg.resolve_batch(4) == BatchSizes(4, 1, 1)


def test_deepspeed_realistic_config():
    with pytest.warns(ConfigWarning) as record:
        cfg = TrainingConfig.from_deepspeed(DS_CONFIG)
    text = " ".join(str(w.message) for w in record)
    for key in ("optimizer", "scheduler", "steps_per_print", "allgather_partitions", "pin_memory"):
        assert key in text
    z, p = cfg.zero, cfg.precision
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size) == (2, 50_000_000, 200_000_000)
    assert isinstance(z.reduce_bucket_size, int)
    assert z.overlap_comm and z.contiguous_gradients and z.offload_optimizer == "cpu"
    assert (p.dtype, p.dynamic, p.initial_scale_power, p.loss_scale_window) == ("fp16", True, 12, 500)
    assert (p.hysteresis, p.min_loss_scale) == (2, 1.0)
    assert cfg.gradient_clipping == 1.0
    assert cfg.resolve_batch(8) == BatchSizes(512, 8, 8)
    with pytest.raises(ConfigError, match="do not fit world size 4"):
        cfg.resolve_batch(4)


def test_deepspeed_from_path_bf16_and_static_scale(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "train_batch_size": 64,
                                "zero_optimization": {"stage": 3}}))
    cfg = TrainingConfig.from_deepspeed(str(path))
    assert cfg.precision.dtype == "bf16" and cfg.zero.stage == 3
    assert cfg.zero.overlap_comm  # DeepSpeed turns overlap on by default at stage 3
    assert cfg.resolve_batch(8) == BatchSizes(64, 8, 1)
    static = TrainingConfig.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}})
    assert not static.precision.dynamic and static.precision.static_loss_scale == 128.0
    assert TrainingConfig.from_deepspeed({"zero_optimization": True}).zero.stage == 1
    with pytest.raises(ConfigError, match="cannot read DeepSpeed config"):
        TrainingConfig.from_deepspeed(tmp_path / "missing.json")


@pytest.mark.parametrize("cfg, match", [
    ({"zero_optimization": {"stgae": 2}}, "unknown key 'stgae' in zero_optimization; did you mean 'stage'?"),
    ({"gradient_clipings": 1.0}, "unknown key 'gradient_clipings' in DeepSpeed config; did you mean "
                                 "'gradient_clipping'?"),
    ({"fp16": {"enable": True}}, "unknown key 'enable' in fp16; did you mean 'enabled'?"),
    ({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}}, "did you mean 'device'"),
    ({"zero_optimization": {"stage": 4}}, "zero stage must be 0, 1, 2 or 3, got 4"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "offload_optimizer.device must be one of 'none', 'cpu', got 'nvme'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "does not offload parameters"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights=true"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "cannot both be enabled"),
    ({"train_batch_size": "auto"}, "train_batch_size is 'auto'"),
    ({"zero_optimization": {"reduce_bucket_size": "auto"}}, "reduce_bucket_size is 'auto'"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled must be true or false"),
    ({"fp16": True}, "fp16 must be a JSON object"),
])
def test_deepspeed_bad_configs(cfg, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with pytest.raises(ConfigError, match=match):
            TrainingConfig.from_deepspeed(cfg)


def test_stage3_tuning_keys_are_ignored_with_warning():
    cfg = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9,
                                 "stage3_prefetch_bucket_size": 5e7, "offload_param": {"device": "none"}}}
    with pytest.warns(ConfigWarning, match="stage3_max_live_parameters, stage3_prefetch_bucket_size"):
        assert TrainingConfig.from_deepspeed(cfg).zero.stage == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(stage=4), "zero stage must be 0, 1, 2 or 3, got 4"),
    (dict(stage=-1), "zero stage must be 0, 1, 2 or 3, got -1"),
    (dict(stage="2"), "zero stage must be 0, 1, 2 or 3, got '2'"),
    (dict(reduce_bucket_size=0), "reduce_bucket_size must be >= 1, got 0"),
    (dict(allgather_bucket_size=1.5), "allgather_bucket_size must be an integer, got 1.5"),
    (dict(overlap_comm=1), "overlap_comm must be true or false, got 1"),
    (dict(contiguous_gradients="no"), "contiguous_gradients must be true or false"),
    (dict(offload_optimizer="nvme"), "offload_optimizer must be one of 'none', 'cpu', got 'nvme'"),
    (dict(offload_optimizer="cpu"), "needs zero stage 1, 2 or 3, got stage 0"),
    (dict(alignment=0), "alignment must be >= 1, got 0"),
])
def test_zero_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="fp8"), "precision dtype must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
    (dict(dynamic="true"), "dynamic must be true or false"),
    (dict(initial_scale_power=-1), "initial_scale_power must be >= 0, got -1"),
    (dict(initial_scale_power=65), "initial_scale_power must be <= 64, got 65"),
    (dict(loss_scale_window=0), "loss_scale_window must be >= 1, got 0"),
    (dict(hysteresis=0), "hysteresis must be >= 1, got 0"),
    (dict(min_loss_scale=0), "min_loss_scale must be > 0"),
    (dict(static_loss_scale=-2.0), "static_loss_scale must be > 0"),
])
def test_precision_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PrecisionConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be >= 1, got 0"),
    (dict(train_micro_batch_size_per_gpu=True), "train_micro_batch_size_per_gpu must be an integer"),
    (dict(gradient_clipping=-1.0), "gradient_clipping must be >= 0"),
    (dict(train_batch_size=10, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1),
     "train_batch_size 10 is not a multiple"),
    (dict(zero="stage2"), "zero must be a ZeroConfig"),
    (dict(zero={"stgae": 1}), "unknown key 'stgae' in zero; did you mean 'stage'?"),
])
def test_training_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TrainingConfig(**kwargs)


def test_resolve_batch_like_deepspeed():
    assert TrainingConfig(train_batch_size=64, train_micro_batch_size_per_gpu=4).resolve_batch(4) == (64, 4, 4)
    assert TrainingConfig(train_batch_size=64, gradient_accumulation_steps=2).resolve_batch(4) == (64, 8, 2)
    assert TrainingConfig(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2).resolve_batch(5) \
        == (30, 3, 2)
    with pytest.raises(ConfigError, match="do not fit world size 8"):
        TrainingConfig(train_batch_size=4).resolve_batch(8)


def test_shardwise_dict_round_trip_and_unknown_keys():
    cfg = TrainingConfig(zero=ZeroConfig(stage=1, alignment=8), precision=PrecisionConfig(dtype="bf16"),
                         train_micro_batch_size_per_gpu=2, gradient_clipping=0.5)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert TrainingConfig.from_dict(data) == cfg
    assert dataclasses.replace(cfg.zero, stage=3).stage == 3
    with pytest.raises(ConfigError, match="unknown key 'precison' in training config; did you mean 'precision'?"):
        TrainingConfig.from_dict({"precison": {"dtype": "bf16"}})
    with pytest.raises(ConfigError, match="unknown key 'dtyp' in precision; did you mean 'dtype'?"):
        PrecisionConfig.from_dict({"dtyp": "bf16"})
    with pytest.raises(ConfigError, match="unknown key 'zzz' in zero; known keys: alignment, allgather_bucket_size"):
        ZeroConfig.from_dict({"zzz": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero.stage = 2  # type: ignore[misc]
