"""The parallel layout: validation, and how configs, DeepSpeed JSON and plans become one."""

import json
import warnings

import numpy as np
import pytest

from shardwise.core.config import ConfigWarning, TrainingConfig
from shardwise.core.errors import ConfigError, MeshError
from shardwise.core.hardware import Hardware
from shardwise.core.layout import ParallelLayout
from shardwise.core.model_spec import ModelSpec
from shardwise.core.planner import plan
from shardwise.core.tensor_parallel import TensorParallelError
from shardwise.core.hf_plan import hf_family
from shardwise.core.tp_rules import check_tp_degree, fused_column_order, rules_for


def test_layout_is_frozen_and_round_trips() -> None:
    layout = ParallelLayout(dp=2, pp=2, gradient_clipping=1.0)
    assert layout.world_size == 4
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(Exception):
        layout.dp = 3  # type: ignore[misc]
    assert layout.describe() == "dp=2 tp=1 pp=2 zero=0 micro_batches=1 1f1b clip=1"


@pytest.mark.parametrize("fields, message", [
    ({"dp": 0}, "dp must be >= 1, got 0"),
    ({"zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3, got 4"),
    ({"zero_stage": 1}, "shards over data-parallel ranks, but dp=1"),
    ({"dp": 2, "pp": 2, "zero_stage": 3}, "zero_stage 3 with pp=2 is not supported"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"vocab_parallel": True}, "vocab_parallel splits the vocabulary over tensor-parallel ranks, but tp=1"),
    ({"sequence_parallel": True}, "sequence_parallel splits the sequence over tensor-parallel ranks, but tp=1"),
    ({"micro_batches": 4}, "are pipeline settings; with pp=1 use gradient_accumulation_steps"),
    ({"pp": 2, "virtual_stages": 2}, "needs schedule 'interleaved_1f1b'"),
    ({"schedule": "zigzag"}, "schedule must be one of"),
])
def test_bad_layouts_are_refused_with_the_reason(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelLayout(**fields)


@pytest.mark.parametrize("fields", [
    {"dp": 2, "pp": 2, "zero_stage": 1, "micro_batches": 2},
    {"dp": 2, "pp": 2, "zero_stage": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"},
    {"dp": 2, "tp": 2, "zero_stage": 1, "gradient_clipping": 1.0},
    {"dp": 2, "tp": 2, "pp": 2, "zero_stage": 2, "gradient_clipping": 1.0},
    {"dp": 2, "precision": "bf16"},
    {"dp": 2, "pp": 2, "precision": "fp16", "gradient_clipping": 1.0},
])
def test_zero_with_pipelines_clipping_with_tensor_parallelism_and_mixed_precision_without_zero(fields: dict) -> None:
    assert ParallelLayout(**fields).world_size == fields["dp"] * fields.get("tp", 1) * fields.get("pp", 1)


def test_unknown_layout_key_is_named() -> None:
    with pytest.raises(ConfigError, match="unknown key 'zero_stag' in layout; did you mean 'zero_stage'"):
        ParallelLayout.from_dict({"dp": 2, "zero_stag": 1})


def test_wrong_world_size_is_a_mesh_error() -> None:
    with pytest.raises(MeshError, match="needs 4 ranks, but the job has 2"):
        ParallelLayout(dp=2, tp=2).check_world(2)


def test_deepspeed_config_becomes_a_layout() -> None:
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "offload_optimizer": {"device": "cpu"}}}
    layout = ParallelLayout.from_config(TrainingConfig.from_deepspeed(ds), 4)
    assert layout == ParallelLayout(dp=4, zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=1.0,
                                    bucket_bytes=200_000_000, offload_optimizer="cpu")
    tp_layout = ParallelLayout.from_config(TrainingConfig.from_deepspeed(dict(ds, gradient_clipping=0)), 8, tp=2)
    assert (tp_layout.dp, tp_layout.tp, tp_layout.zero_stage) == (4, 2, 2)
    with pytest.raises(MeshError, match="not divisible by tp=3"):
        ParallelLayout.from_config(TrainingConfig.from_deepspeed(ds), 4, tp=3)


def test_deepspeed_unknown_key_refused_and_inert_key_warned() -> None:
    with pytest.raises(ConfigError, match="unknown key 'stgae' in zero_optimization; did you mean 'stage'"):
        TrainingConfig.from_deepspeed({"zero_optimization": {"stgae": 2}})
    with pytest.raises(ConfigError, match="unknown key 'zero_optimisation'"):
        TrainingConfig.from_deepspeed({"zero_optimisation": {"stage": 2}})
    cfg = TrainingConfig.from_deepspeed({"zero_optimization": {"stage": 2, "overlap_comm": False}})
    with pytest.warns(ConfigWarning, match="overlap_comm=false"):
        ParallelLayout.from_config(cfg, 2)


def test_layout_from_plan_result_json_and_file(tmp_path) -> None:
    spec = ModelSpec(num_params=125_000_000, num_layers=12, hidden_size=768, seq_len=1024)
    result = plan(spec, Hardware(num_devices=4, memory_per_device=80_000_000_000), global_batch=8,
                  precision="fp32")
    best = result.best
    layout = ParallelLayout.from_plan(result)
    assert (layout.dp, layout.tp, layout.pp, layout.zero_stage) == best.layout
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(result.to_dict()))
    assert ParallelLayout.from_plan(str(path)) == layout
    with pytest.raises(ConfigError, match="not a `shardwise plan --json` output"):
        ParallelLayout.from_plan({"best": {"dp": 1}})


def test_pipeline_candidate_maps_micro_batches() -> None:
    cand = {"dp": 1, "tp": 1, "pp": 2, "zero": 0, "micro_batches": 8, "checkpointing": True}
    layout = ParallelLayout.from_plan(cand)
    assert (layout.pp, layout.micro_batches, layout.gradient_accumulation_steps) == (2, 8, 1)
    assert layout.activation_checkpointing
    accum = ParallelLayout.from_plan(dict(cand, pp=1, dp=2))
    assert (accum.micro_batches, accum.gradient_accumulation_steps) == (1, 8)
    assert ParallelLayout.from_plan(cand, precision="fp16").precision == "fp16"  # masters without ZeRO too


def test_deepspeed_fp16_section_sets_the_loss_scale_schedule() -> None:
    ds = {"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10,
                                          "loss_scale_window": 100, "hysteresis": 3, "min_loss_scale": 2}}
    layout = ParallelLayout.from_config(TrainingConfig.from_deepspeed(ds), 2)
    scaler = layout.loss_scaler()
    assert (layout.precision, scaler.scale, scaler.window, scaler.hysteresis, scaler.min_scale, scaler.dynamic) == \
        ("fp16", 1024.0, 100, 3, 2.0, True)
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    fixed = {"fp16": {"enabled": True, "loss_scale": 128}}
    static = ParallelLayout.from_config(TrainingConfig.from_deepspeed(fixed), 1)
    assert (static.loss_scaler().scale, static.loss_scaler().dynamic) == (128.0, False)
    with pytest.raises(ConfigError, match="loss_scaling applies to precision 'fp16', not 'bf16'"):
        ParallelLayout(precision="bf16", loss_scaling={"initial_scale_power": 4})


def test_fused_column_order_gives_each_rank_a_slice_of_every_part() -> None:
    order = fused_column_order(12, 3, 2)  # q0 q1 | k0 k1 | v0 v1 with 2 features each
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert sorted(order.tolist()) == list(range(12))
    assert np.array_equal(fused_column_order(6, 3, 1), np.arange(6))
    with pytest.raises(TensorParallelError):
        fused_column_order(12, 3, 3)


def test_family_rules_and_head_divisibility() -> None:
    gpt2 = rules_for("GPT2")
    assert [r.kind for r in gpt2.rules] == ["column", "row", "column", "row"]
    # Llama, Mistral, Qwen and the rest are read from their own plans (tests/unit/test_hf_plan.py)
    with pytest.raises(ConfigError, match="no tensor/pipeline rules for model_type 'llama'"):
        rules_for("llama")
    with pytest.raises(ConfigError, match="no tensor/pipeline rules for model_type 'bert'"):
        rules_for("bert")
    check_tp_degree(gpt2, {"n_head": 12}, 4)
    with pytest.raises(TensorParallelError, match="n_head=12 is not divisible by tp=5"):
        check_tp_degree(gpt2, {"n_head": 12}, 5)
    # fewer key/value heads than tp: replicated where tp is a multiple of them (tests/unit/test_kv_replicas.py)
    with pytest.raises(TensorParallelError, match="num_key_value_heads=3 is fewer than tp=4"):
        check_tp_degree(hf_family({"model_type": "llama", "base_model_tp_plan": {
            "layers.*.self_attn.k_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}}, base="model"),
            {"num_attention_heads": 12, "num_key_value_heads": 3}, 4)


def test_deepspeed_pipeline_and_tensor_parallel_sections_shape_the_layout() -> None:
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
          "pipeline": {"stages": 2, "activation_checkpoint_interval": 1},
          "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}
    config = TrainingConfig.from_deepspeed(ds)
    assert (config.pipeline_stages, config.tensor_parallel, config.vocab_parallel,
            config.activation_checkpointing) == (2, 2, True, True)
    layout = ParallelLayout.from_config(config, 8)
    # dp = 8 / (2 x 2) = 2; DeepSpeed's pipeline engine runs the 32 / (2 x 2) = 8 accumulation steps as micro-batches
    assert layout == ParallelLayout(dp=2, tp=2, pp=2, zero_stage=1, micro_batches=8, gradient_accumulation_steps=1,
                                    activation_checkpointing=True, vocab_parallel=True, gradient_clipping=1.0,
                                    bucket_bytes=layout.bucket_bytes)
    assert ParallelLayout.from_config(config, 8, tp=2, pp=2) == layout  # agreeing arguments are fine
    with pytest.raises(ConfigError, match="tp=4 was given, but the config's tensor_parallel is 2"):
        ParallelLayout.from_config(config, 8, tp=4)
    # stages "auto" (DeepSpeed's default) leaves pp to the caller; autotp_size 0 means no tensor parallelism
    auto = TrainingConfig.from_deepspeed({"pipeline": {"stages": "auto"}, "tensor_parallel": {"autotp_size": 0}})
    assert (auto.pipeline_stages, auto.tensor_parallel) == (1, 1)
    assert ParallelLayout.from_config(auto, 4, pp=2).pp == 2


def test_deepspeed_pipeline_and_tensor_parallel_bad_values() -> None:
    with pytest.raises(ConfigError, match="pipeline.stages must be >= 1"):
        TrainingConfig.from_deepspeed({"pipeline": {"stages": 0}})
    with pytest.raises(ConfigError, match="unknown key 'stage' in pipeline; did you mean 'stages'"):
        TrainingConfig.from_deepspeed({"pipeline": {"stage": 2}})
    with pytest.raises(ConfigError, match="partition_config is not supported"):
        TrainingConfig.from_deepspeed({"tensor_parallel": {"autotp_size": 2, "partition_config": {"x": 1}}})
    with pytest.raises(ConfigError, match="vocab_parallel_lm_head must be true or false"):
        TrainingConfig.from_deepspeed({"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": "yes"}})
    with pytest.warns(ConfigWarning, match="ignoring DeepSpeed keys in pipeline that shardwise does not use: "
                                           "partition, seed_layers"):
        TrainingConfig.from_deepspeed({"pipeline": {"stages": 2, "partition": "uniform", "seed_layers": True}})
    with pytest.raises(ConfigError, match="vocab_parallel splits the vocabulary over tensor-parallel ranks"):
        ParallelLayout.from_config(TrainingConfig(vocab_parallel=True), 2)
