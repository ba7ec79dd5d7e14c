"""The planner on any Hugging Face config and on Mixture-of-Experts models: counts, expert parallelism, the CLI.

The counts are checked against transformers' own models, built tiny on the meta device.
"""

import json
import re

import pytest

from shardwise.cli import main
from shardwise.core.errors import ConfigError
from shardwise.core.hardware import Hardware
from shardwise.core.hf_config import FAMILIES, hf_model_fields
from shardwise.core.model_spec import ModelSpec
from shardwise.core.moe import alltoall_bytes_per_step
from shardwise.core.moe_cost import expert_cost
from shardwise.core.planner import estimate, plan

#: Keys shrunk when a default config has them (the other keys keep transformers' defaults).
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, moe_intermediate_size=64, num_local_experts=4,
            num_experts=4, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
            q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
            shared_expert_intermediate_size=96, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=0,
            eos_token_id=0)


def _tiny(model_type: str, **overrides):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    defaults = transformers.AutoConfig.for_model(model_type).to_dict()
    kw = {k: v for k, v in TINY.items() if k in defaults}
    return transformers.AutoConfig.for_model(model_type, **{**kw, **overrides})


def _built(cfg):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _routed(name: str) -> bool:
    return ".experts." in name and "shared" not in name


# -- exact counts ------------------------------------------------------------------------------------------
EXACT = [
    ("qwen3", {}), ("gemma3_text", {}), ("phi3", {}), ("olmo2", {}), ("mixtral", {}), ("qwen3_moe", {}),
    ("deepseek_v3", {"first_k_dense_replace": 1}), ("gpt_oss", {}),
    ("deepseek_v3", {"first_k_dense_replace": 0, "q_lora_rank": None, "attention_bias": True}),
    ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    ("qwen2_moe", {}), ("qwen2", {"attention_bias": True}), ("olmoe", {}), ("gemma2", {}),
    ("llama", {"mlp_bias": True, "attention_bias": True, "head_dim": 48}), ("gemma3_text", {"head_dim": 40}),
    ("llama4_text", {}), ("starcoder2", {}), ("phi", {}), ("gpt_neox", {}), ("glm4", {}),
]


@pytest.mark.parametrize("model_type, overrides", EXACT, ids=[f"{t}-{i}" for i, (t, _) in enumerate(EXACT)])
def test_counts_equal_transformers_models(model_type, overrides):
    cfg = _tiny(model_type, **overrides)
    model = _built(cfg)
    expected = sum(p.numel() for p in model.parameters())  # tied tensors are listed once
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    assert spec.num_params == expected and spec.counted_exactly
    routed = sum(p.numel() for n, p in model.named_parameters() if _routed(n))
    assert spec.expert_params == routed
    layers = {n.split(".layers.")[1].split(".")[0] for n, _ in model.named_parameters() if _routed(n)}
    assert spec.moe_layers == len(layers)
    if routed:
        assert spec.num_experts == 4 and spec.experts_per_token == 2 and spec.is_moe
    assert spec.tied_embeddings == (model.get_output_embeddings().weight is model.get_input_embeddings().weight)


@pytest.mark.parametrize("model_type", ["apertus", "laguna", "nanochat", "flint", "cohere2_moe"])
def test_unknown_types_are_close_and_say_so(model_type):
    """Types outside shardwise's family table: counted as Llama-like blocks, within 0.5 % of transformers'
    count at this tiny size (norm variants and per-head scalars the config does not describe)."""
    assert model_type not in FAMILIES
    cfg = _tiny(model_type)
    expected = sum(p.numel() for p in _built(cfg).parameters())
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    assert not spec.counted_exactly
    assert abs(spec.num_params - expected) / expected < 0.005


def test_every_family_in_the_table_is_a_causal_lm_of_this_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(FAMILIES) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), transformers.__version__


def test_published_sizes_from_default_configs():
    """transformers' default configs are the published shapes: Mixtral 8x7B (46.7B, 12.9B active) and
    DeepSeek-V3 (671B, 37B active)."""
    mixtral = ModelSpec.from_hf_config(dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                                            intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                                            max_position_embeddings=32768, tie_word_embeddings=False))
    assert mixtral.num_params == 46_702_792_704 and round(mixtral.active_params / 1e9, 1) == 12.9
    assert mixtral.params_per_expert == 3 * 4096 * 14336 and mixtral.ffn_multiplier == 0
    dsv3 = ModelSpec.from_hf_config(dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, num_experts_per_tok=8, first_k_dense_replace=3,
        tie_word_embeddings=False, max_position_embeddings=4096))
    assert round(dsv3.num_params / 1e9) == 671 and round(dsv3.active_params / 1e9) == 38
    assert (dsv3.num_experts, dsv3.experts_per_token, dsv3.moe_layers) == (256, 8, 58)


def test_config_shapes_without_transformers():
    base = dict(model_type="my_decoder", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=100, intermediate_size=128, max_position_embeddings=32, tie_word_embeddings=True)
    spec = ModelSpec.from_hf_config(base)
    assert not spec.counted_exactly and spec.mlp_matrices == 3  # gated unless the type is known to be plain
    layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert spec.num_params == 100 * 64 + 2 * layer + 64
    aliases = dict(model_type="my_decoder", d_model=64, n_layer=2, n_head=4, vocab_size=100, ffn_dim=128,
                   n_positions=32, tie_word_embeddings=True)
    assert ModelSpec.from_hf_config(aliases).num_params == spec.num_params
    no_tie = ModelSpec.from_hf_config({k: v for k, v in base.items() if k != "tie_word_embeddings"})
    assert no_tie.tied_embeddings and not no_tie.counted_exactly
    wrapped = ModelSpec.from_hf_config({"model_type": "my_vlm", "text_config": {**base, "model_type": "t"}})
    assert wrapped.num_params == spec.num_params and not wrapped.counted_exactly


def test_moe_fields_from_config_keys():
    base = dict(model_type="mixtral", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, intermediate_size=96, max_position_embeddings=32,
                tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2)
    spec = ModelSpec.from_hf_config(base)
    assert (spec.num_experts, spec.experts_per_token, spec.moe_layers) == (8, 2, 4)
    assert spec.expert_params == 4 * 8 * 3 * 64 * 96 and spec.expert_layer_params == 8 * 3 * 64 * 96
    assert spec.active_params == spec.num_params - spec.expert_params + spec.expert_params // 4
    dense_first = ModelSpec.from_hf_config({**base, "model_type": "deepseek_v3", "n_routed_experts": 8,
                                            "num_local_experts": None, "moe_intermediate_size": 32,
                                            "first_k_dense_replace": 1, "n_shared_experts": 2})
    assert dense_first.moe_layers == 3 and dense_first.params_per_expert == 3 * 64 * 32
    # the dense MLP a token passes besides its experts: one dense layer of 96, three shared experts of 64
    assert dense_first.ffn_multiplier == pytest.approx((96 + 3 * 64) / 4 / 64)


@pytest.mark.parametrize("config, message", [
    (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=None), "no experts per token"),
    (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=5), "5 experts per token but only 4"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, mlp_only_layers="0"),
     "mlp_only_layers must be a list"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, decoder_sparse_step=-1),
     "decoder_sparse_step must be a non-negative integer"),
    (dict(model_type="llama", hidden_size=None, n_embd=None), "no hidden size"),
    (dict(model_type="t5"), "not a decoder-only"),
    (dict(model_type="llama", attention_bias="yes"), "attention_bias must be true or false"),
])
def test_bad_moe_and_generic_configs(config, message):
    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
                intermediate_size=96, max_position_embeddings=32, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_hf_config({**base, **config})


@pytest.mark.parametrize("fields, message", [
    (dict(num_experts=-1), "num_experts must be an integer >= 0"),
    (dict(num_experts=0, experts_per_token=2), "but num_experts is 0"),
    (dict(num_experts=8, experts_per_token=9, expert_params=8 * 1000), "between 1 and num_experts=8"),
    (dict(num_experts=8, experts_per_token=2, expert_params=10**9), "expert_params must be between"),
    (dict(num_experts=8, experts_per_token=2, expert_params=8 * 4 * 1000 + 1), "not divisible by 32"),
    (dict(num_experts=8, experts_per_token=2, expert_params=8000, moe_layers=5), "exceeds the model's 4 layers"),
    (dict(counted_exactly="yes"), "counted_exactly must be true or false"),
    (dict(ffn_multiplier=0.0), "0 only for a Mixture of Experts"),
])
def test_spec_validates_moe_fields(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelSpec(num_params=10**6, num_layers=4, hidden_size=64, **fields)


def test_spec_moe_defaults_and_properties():
    dense = ModelSpec(num_params=10**6, num_layers=4, hidden_size=64)
    assert not dense.is_moe and dense.active_params == dense.num_params and dense.expert_layer_params == 0
    moe = ModelSpec(num_params=10**6, num_layers=4, hidden_size=64, num_experts=8, experts_per_token=2,
                    expert_params=8 * 4 * 20_000)
    assert moe.moe_layers == 4 and moe.params_per_expert == 20_000 and moe.expert_layer_params == 160_000
    assert moe.active_params == 10**6 - 640_000 + 160_000 and moe.counted_exactly


# -- expert parallelism in the cost model -------------------------------------------------------------------
MOE = ModelSpec(num_params=2_000_000_000, num_layers=8, hidden_size=2048, seq_len=1024, vocab_size=32000,
                num_experts=16, experts_per_token=2, expert_params=16 * 8 * 12_000_000, tied_embeddings=False)
NODE = Hardware.parse(num_devices=8, memory_per_device="80GB", intra_node_bandwidth="100GB/s",
                      intra_node_latency="5us")


def test_expert_states_split_over_ep_and_partitioned_over_edp():
    dense = MOE.num_params - MOE.expert_params
    for ep in (1, 2, 4, 8):
        for zero in (0, 1, 2, 3):
            c = estimate(MOE, NODE, dp=8, ep=ep, zero=zero, global_batch=8, precision="fp32", optimizer="adam")
            own = MOE.expert_params // ep
            edp = 8 // ep
            dense_p = -(-dense // 8) if zero == 3 else dense
            own_p = -(-own // edp) if zero == 3 else own
            assert c.memory.params == 4 * (dense_p + own_p)
            dense_o = -(-dense // 8) if zero >= 1 else dense
            own_o = -(-own // edp) if zero >= 1 else own
            assert c.memory.optimizer == 8 * (dense_o + own_o)
            assert c.ep == ep and ("EP" in c.strategy) == (ep > 1) and (f"ep={ep}" in c.describe()) == (ep > 1)


def test_alltoall_bytes_and_time():
    base = dict(dp=8, zero=1, global_batch=16, precision="bf16")
    for ep in (2, 4, 8):
        c = estimate(MOE, NODE, ep=ep, **base)
        tokens = 2 * 1024  # 2 sequences per rank
        per_layer = 4 * tokens * 2 * 2048 * 2 * (ep - 1) / ep  # 2 dispatch + 2 combine, top-2, bf16
        assert c.comm_bytes.expert_parallel == int(8 * per_layer)
        assert per_layer * 8 == alltoall_bytes_per_step(tokens, 2, 2048, ep, layers=8, bytes_per_element=2)
        expected_time = 8 * 4 * (ep - 1) * 5e-6 + 8 * per_layer / 100e9
        no_ep = estimate(MOE, NODE, ep=1, **base)
        assert c.comm_bytes.total == no_ep.comm_bytes.total - no_ep.comm_bytes.data_parallel \
            + c.comm_bytes.data_parallel + c.comm_bytes.expert_parallel
        cost = expert_cost(MOE, NODE, dp=8, tp=1, pp=1, ep=ep, micro_batches=1, micro_batch_size=2,
                           checkpointing=False, sequence_parallel=False, act_bytes=2)
        assert cost.alltoall_time == pytest.approx(expected_time) and cost.edp == 8 // ep
        assert cost.params == MOE.expert_params // ep
        assert c.exposed_comm_time >= expected_time  # the experts wait for their tokens: never hidden
    assert estimate(MOE, NODE, ep=1, **base).comm_bytes.expert_parallel == 0
    ckpt = estimate(MOE, NODE, ep=2, checkpointing=True, **base)
    assert ckpt.comm_bytes.expert_parallel == int(1.5 * estimate(MOE, NODE, ep=2, **base).comm_bytes.expert_parallel)
    micro = estimate(MOE, NODE, ep=2, micro_batches=2, **base)  # 2 micro-batches of half the tokens
    assert micro.comm_bytes.expert_parallel == estimate(MOE, NODE, ep=2, **base).comm_bytes.expert_parallel


def test_imbalance_slows_the_busiest_rank_only_with_ep():
    base = dict(dp=8, zero=1, global_batch=16, precision="bf16")
    even, skew = (estimate(MOE, NODE, ep=4, moe_imbalance=f, **base) for f in (1.0, 1.5))
    assert skew.comm_bytes.expert_parallel == int(1.5 * even.comm_bytes.expert_parallel)
    expert_flops = 6 * MOE.expert_params * 2 / 16 * 16 * 1024
    assert skew.compute_time - even.compute_time == pytest.approx(
        expert_flops * 0.5 / 8 / (NODE.peak_flops * NODE.efficiency))
    assert skew.memory.buffers > even.memory.buffers
    flat = [estimate(MOE, NODE, ep=1, moe_imbalance=f, **base) for f in (1.0, 1.5)]
    assert flat[0].step_time == flat[1].step_time and flat[0].memory == flat[1].memory


def test_moe_compute_counts_active_parameters():
    c = estimate(MOE, NODE, dp=8, global_batch=16, precision="bf16")
    assert c.compute_time == pytest.approx(6 * MOE.active_params * 16 * 1024 / (8 * NODE.peak_flops * NODE.efficiency))


@pytest.mark.parametrize("kwargs, message", [
    (dict(model=ModelSpec(num_params=10**9, num_layers=8, hidden_size=2048), ep=2), "but the model has none"),
    (dict(ep=3), "ep=3 must divide dp=8"),
    (dict(model=ModelSpec(num_params=10**9, num_layers=8, hidden_size=2048, num_experts=6, experts_per_token=2,
                          expert_params=6 * 8 * 1000), ep=4), "6 experts do not split over ep=4"),
    (dict(ep=2, moe_imbalance=0.9), "moe_imbalance must be a number >= 1.0"),
    (dict(ep=0), "ep must be an integer >= 1"),
])
def test_bad_expert_parallel_configurations(kwargs, message):
    model = kwargs.pop("model", MOE)
    with pytest.raises(ConfigError, match=message):
        estimate(model, NODE, dp=8, global_batch=8, **kwargs)


def test_planner_tries_expert_parallel_degrees_for_moe_only():
    result = plan(MOE, NODE, global_batch=16, max_micro_batches=2)
    eps = {(c.dp, c.ep) for c in result.candidates}
    assert {e for _, e in eps} == {1, 2, 4, 8} and all(dp % ep == 0 for dp, ep in eps)
    assert len({(c.layout, c.ep) for c in result.layouts()}) == len(result.layouts())
    assert result.to_dict()["best"]["ep"] == result.best.ep and result.to_dict()["moe_imbalance"] == 1.0
    dense = plan(ModelSpec(num_params=10**9, num_layers=8, hidden_size=2048), NODE, global_batch=16)
    assert {c.ep for c in dense.candidates} == {1}
    odd = ModelSpec(num_params=10**9, num_layers=8, hidden_size=2048, num_experts=6, experts_per_token=2,
                    expert_params=6 * 8 * 1000)
    assert {c.ep for c in plan(odd, NODE, global_batch=16).candidates} == {1, 2}
    with pytest.raises(ConfigError, match="moe_imbalance"):
        plan(MOE, NODE, global_batch=16, moe_imbalance=True)


def test_expert_parallelism_wins_when_the_experts_do_not_fit_replicated():
    small = Hardware.parse(num_devices=8, memory_per_device="24GB", intra_node_bandwidth="100GB/s")
    best = plan(MOE, small, global_batch=16, precision="bf16").best
    assert best.ep > 1 and best.fits
    replicated = estimate(MOE, small, dp=8, zero=best.zero, global_batch=16, micro_batches=best.micro_batches,
                          checkpointing=best.checkpointing)
    assert best.memory.total < replicated.memory.total


def test_imbalance_slows_the_planned_step():
    result = [plan(MOE, NODE, global_batch=16, moe_imbalance=f).best for f in (1.0, 4.0)]
    assert result[1].step_time > result[0].step_time


def test_layout_from_plan_keeps_ep():
    from shardwise.core.layout import ParallelLayout

    if "ep" not in {f for f in ParallelLayout.__dataclass_fields__}:
        pytest.skip("ParallelLayout has no ep yet")
    small = Hardware.parse(num_devices=8, memory_per_device="24GB", intra_node_bandwidth="100GB/s")
    result = plan(MOE, small, global_batch=16, precision="bf16")
    layout = ParallelLayout.from_plan(result)
    assert layout.ep == result.best.ep > 1 and layout.dp == result.best.dp
    assert ParallelLayout.from_plan(json.loads(json.dumps(result.to_dict()))).ep == result.best.ep


def test_every_candidate_is_a_layout_parallelize_accepts():
    """The planner proposes only what ParallelLayout takes (a MoE plan once offered sequence
    parallelism with ep, which parallelize refuses)."""
    from shardwise.core.layout import ParallelLayout

    result = plan(MOE, NODE, global_batch=16, max_micro_batches=2)
    assert any(c.ep > 1 for c in result.candidates)
    for candidate in result.candidates:
        ParallelLayout.from_plan(candidate)


# -- shardwise plan --model ---------------------------------------------------------------------------------
PLAN = ["plan", "--devices", "4", "--global-batch", "8", "--device-memory", "8GB"]


def test_cli_plans_a_moe_config_with_imbalance_and_names_its_rules(tmp_path, capsys):
    cfg = _tiny("mixtral", num_local_experts=8, hidden_size=256, num_hidden_layers=4)
    cfg.save_pretrained(tmp_path)
    assert main(PLAN + ["--model", str(tmp_path), "--moe-imbalance", "1.3"]) == 0
    out = capsys.readouterr().out
    assert "Mixture of Experts: 8 experts, top-2, in 4 of 4 layers" in out and "routing imbalance 1.3" in out
    assert re.search(r"tensor-parallel rules: the model's own plan \(MixtralConfig\.base_model_tp_plan, 4 rules: "
                     r"3 colwise, 1 rowwise\)", out)
    assert "pipeline rules: the model's own plan (MixtralConfig.base_model_pp_plan: embed_tokens, layers, norm)" in out
    assert "expert-parallel rules: the model's own plan (MixtralConfig.base_model_ep_plan, 3 rules" in out
    assert re.search(r"^\s+strategy\s+dp\s+tp\s+pp\s+ep\s+zero", out, re.M)
    assert "parameter count estimated" not in out
    assert main(PLAN + ["--model", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["num_experts"] == 8 and "ep" in doc["best"] and len(doc["rules"]) == 3


def test_cli_rule_sources(tmp_path, capsys):
    assert main(PLAN + ["--model", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel rules: shardwise's gpt2 rules (fused QKV" in out
    assert "pipeline rules: shardwise's gpt2 rules (transformer.h cut into stages)" in out
    assert re.search(r"^\s+strategy\s+dp\s+tp\s+pp\s+zero", out, re.M)  # no ep column for a dense model
    own = dict(model_type="my_decoder", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               vocab_size=100, intermediate_size=128, max_position_embeddings=32, tie_word_embeddings=True,
               base_model_tp_plan={"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
                                   "layers.*.mlp.w": "packed_rowwise"})
    (tmp_path / "config.json").write_text(json.dumps(own))
    assert main(PLAN + ["--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("tensor-parallel rules: the model's own plan (config.base_model_tp_plan, 3 rules: 1 colwise, "
            "1 rowwise, 1 packed_rowwise); styles shardwise does not implement: packed_rowwise") in out
    assert "parameter count estimated" in out
    assert main(PLAN + ["--model", str(tmp_path), "--rules"]) == 0
    out = capsys.readouterr().out
    assert "layers.*.mlp.up_proj: colwise" in out and "layers.*.mlp.w: packed_rowwise -> not implemented" in out
    del own["base_model_tp_plan"]
    (tmp_path / "config.json").write_text(json.dumps(own))
    assert main(PLAN + ["--model", str(tmp_path)]) == 0
    assert "tensor-parallel rules: none" in capsys.readouterr().out


def test_cli_rejects_a_bad_imbalance(capsys):
    assert main(PLAN + ["--params", "1B", "--moe-imbalance", "0.5"]) == 2
    assert "moe_imbalance must be a number >= 1.0" in capsys.readouterr().err


def test_torch_module_spec_takes_the_hf_shape_and_the_counted_total():
    cfg = _tiny("qwen3_moe")
    model = _built(cfg)
    spec = ModelSpec.from_torch_module(model, seq_len=64)
    assert spec.num_params == sum(p.numel() for p in model.parameters()) and spec.counted_exactly
    assert spec.num_experts == 4 and spec.expert_params == ModelSpec.from_hf_config(cfg.to_dict()).expert_params
    assert spec.seq_len == 64
    unknown = _tiny("laguna")  # counted approximately from its config; the module's own count wins
    spec = ModelSpec.from_torch_module(_built(unknown))
    trainable = sum(p.numel() for p in _built(unknown).parameters() if p.requires_grad)
    assert spec.num_params == trainable and spec.counted_exactly
