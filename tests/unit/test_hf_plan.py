"""Split rules read from Hugging Face plans (``shardwise.core.hf_plan``) and their use on a model."""

from __future__ import annotations

import pytest

from shardwise.core.errors import ConfigError
from shardwise.core.hf_plan import STYLES, describe_rules, has_hf_plan, hf_family

QWEN3 = {
    "model_type": "qwen3",
    "base_model_tp_plan": {
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise"},
    "base_model_pp_plan": {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
                           "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
                           "norm": (["hidden_states"], ["hidden_states"])},
}


def test_a_plan_becomes_block_rules_with_its_styles() -> None:
    rules = hf_family(QWEN3, base="model", head_plan={"lm_head": "colwise_gather_output"})
    assert (rules.family, rules.blocks, rules.embed, rules.final) == (
        "qwen3", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"))
    kinds = {r.path: (r.kind, r.style) for r in rules.rules}
    assert kinds["self_attn.q_proj"] == ("column", "colwise")
    assert kinds["self_attn.o_proj"] == ("row", "rowwise")
    assert kinds["self_attn.q_norm"] == ("replicated", "replicated_with_grad_allreduce")
    assert [r.grad_sum for r in rules.rules if r.path == "self_attn.q_norm"] == [True]
    assert rules.generic and rules.head_keys == ("num_attention_heads", "num_key_value_heads")
    assert rules.outside == (("lm_head", "colwise_gather_output"),) and rules.unsupported == ()
    assert "the model's own plan (config.base_model_tp_plan), 7 block rules" in rules.source


def test_gathering_and_splitting_styles() -> None:
    rules = hf_family({"model_type": "phi3", "base_model_tp_plan": {
        "layers.*.self_attn.qkv_proj": "colwise_gather_output",
        "layers.*.self_attn.o_proj": "rowwise_split_input",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}}, base="model")
    by = {r.path: r for r in rules.rules}
    assert by["self_attn.qkv_proj"].gather_output and by["self_attn.o_proj"].split_input
    assert by["self_attn.kv_a_proj_with_mqa"].rope_dim_key == "qk_rope_head_dim"
    assert rules.head_keys == ()  # every head is computed whole: no head count must divide


def test_unknown_styles_are_recorded_not_guessed() -> None:
    rules = hf_family({"model_type": "beam", "base_model_tp_plan": {
        "layers.*.self_attn.o_proj": "packed_rowwise", "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.experts": "moe_tp_experts", "embed_tokens": "embedding_rowwise"}}, base="model")
    assert rules.unsupported == (("layers.*.self_attn.o_proj", "packed_rowwise"),
                                 ("layers.*.mlp.experts", "moe_tp_experts"))
    assert rules.outside == (("embed_tokens", "embedding_rowwise"),)
    text = "\n".join(describe_rules(rules))
    assert "packed_rowwise -> not implemented by shardwise" in text
    assert "embedding_rowwise -> kept whole" in text


def test_local_params_marks_a_module_whose_parameters_have_rules_of_their_own() -> None:
    rules = hf_family({"model_type": "granite_swa", "base_model_tp_plan": {
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.sinks": "colwise",
        "layers.*.self_attn": "local_params"}}, base="model")
    by = {r.path: r for r in rules.rules}
    assert rules.unsupported == ()
    assert by["self_attn"].kind == "replicated" and not by["self_attn"].grad_sum
    assert by["self_attn.sinks"].kind == "column"


def test_a_user_plan_adds_and_overrides() -> None:
    rules = hf_family(QWEN3, base="model", user_plan={"model.layers.*.mlp.up_proj": "colwise",
                                                      "layers.*.self_attn.q_norm": None})
    by = {r.path: r for r in rules.rules}
    assert by["mlp.up_proj"].kind == "column"
    assert by["self_attn.q_norm"].kind == "replicated" and not by["self_attn.q_norm"].grad_sum
    assert "+ 2 of tp_plan=" in rules.source
    with pytest.raises(ConfigError, match="tp_plan maps module patterns to style names"):
        hf_family(QWEN3, base="model", user_plan={"layers.*.mlp.up_proj": 3})


def test_blocks_are_found_from_either_plan() -> None:
    gptj = hf_family({"model_type": "gptj", "base_model_tp_plan": {"h.*.attn.q_proj": "colwise",
                                                                   "wte": "embedding_rowwise"}}, base="transformer")
    assert gptj.blocks == "transformer.h"
    with pytest.raises(ConfigError, match="has no base_model_tp_plan or base_model_pp_plan"):
        hf_family({"model_type": "opt"}, base="model")
    assert has_hf_plan(QWEN3) and not has_hf_plan({"model_type": "opt", "base_model_tp_plan": None})


def test_every_style_in_the_table_builds_a_valid_rule() -> None:
    for style in STYLES:
        rules = hf_family({"model_type": "x", "base_model_tp_plan": {"layers.*.a.b": style}}, base="")
        assert rules.blocks == "layers" and rules.rules[0].style == style


TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, vocab_size=64, max_position_embeddings=32, pad_token_id=0, bos_token_id=0,
            eos_token_id=0)


@pytest.mark.parametrize("model_type, extra", [
    ("qwen3", {}),
    ("gemma3_text", {"sliding_window": 4, "final_logit_softcapping": 3.0}),  # scaled table, 2 rotaries
    ("cohere", {"logit_scale": 0.5}),
    ("granite", {"logits_scaling": 4.0, "embedding_multiplier": 2.0}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
])
def test_stages_compute_what_the_model_computes(model_type: str, extra: dict) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from shardwise.adapters.torch.parallel.stages import StageStack, causal_lm_stages, model_family

    cfg = transformers.AutoConfig.for_model(model_type, **TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids).logits
    stages, blocks = causal_lm_stages(model, model_family(model))
    assert blocks == [False, True, True, True, False]
    got = StageStack(stages)(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # every parameter of the model belongs to a stage; only a tied head's table to two
    owned = [id(p) for s in stages for p in s.parameters()]
    assert set(owned) == {id(p) for p in model.parameters()}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert len(owned) == len(set(owned)) + tied
