"""The parts of a Hugging Face base model that its plans do not name, found on the model; stand-in
blocks for a base model that unpacks its blocks' outputs."""

import pytest
import torch

from shardwise.core.errors import ConfigError
from shardwise.core.hf_plan import hf_family

transformers = pytest.importorskip("transformers")

_TP_ONLY = {"model_type": "x", "base_model_tp_plan": {"embed_tokens": "embedding_rowwise"}}


def test_plans_naming_no_blocks_take_the_found_parts() -> None:
    rules = hf_family(_TP_ONLY, base="model", found={"blocks": "layers", "embed": "embeddings", "norm": "norm_f"})
    assert rules.blocks == "model.layers" and rules.embed == ("model.embeddings",)
    assert rules.final == ("model.norm_f", "lm_head")
    with pytest.raises(ConfigError, match="name no blocks"):
        hf_family(_TP_ONLY, base="model", found={"blocks": None})


def test_the_pipeline_plan_comes_before_the_found_parts() -> None:
    config = {"model_type": "x", "base_model_pp_plan": {"embed_tokens": 0, "layers": 0, "norm": 0}}
    rules = hf_family(config, base="model", found={"blocks": "other", "embed": "e", "norm": "n"})
    assert (rules.blocks, rules.embed, rules.final[0]) == ("model.layers", ("model.embed_tokens",), "model.norm")
    tp = {"model_type": "x", "base_model_tp_plan": {"layers.*.self_attn.q_proj": "colwise"}}
    assert hf_family(tp, base="model", found={"norm": "final_layernorm"}).final[0] == "model.final_layernorm"


def _tiny(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_parts_found_on_models_with_other_names() -> None:
    from shardwise.adapters.torch.parallel.stages import hf_parts, model_family

    assert hf_parts(_tiny("diffllama"), "model") == {"blocks": "layers", "embed": "embed_tokens", "norm": "norm"}
    lfm2 = _tiny("lfm2", layer_types=["conv", "full_attention"], block_ff_dim=64)
    assert hf_parts(lfm2, "model")["norm"] == "embedding_norm"
    assert model_family(lfm2).final == ("model.embedding_norm", "lm_head")


def test_blocks_whose_outputs_are_unpacked_get_pairs_from_the_stand_ins() -> None:
    from shardwise.adapters.torch.parallel.stages import causal_lm_stages, model_family

    model = _tiny("bamba", attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                  mamba_chunk_size=4, mamba_n_groups=1).eval()
    stages, blocks = causal_lm_stages(model, model_family(model))
    assert blocks == [False, True, True, False]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    x = ids
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
        torch.testing.assert_close(x, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


class _Block(torch.nn.Module):
    def forward(self, hidden, scale=1.0):
        return hidden * scale


class _Base(torch.nn.Module):
    """A base model's forward in miniature: ``streams`` > 0 widens the blocks' hidden state
    (hyper-connections); ``unpack`` takes each block's output apart as Bamba's does."""

    def __init__(self, streams: int = 0, unpack: bool = False, index: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.streams, self.unpack, self.index = streams, unpack, index

    def forward(self, inputs_embeds, use_cache=False):
        hidden = inputs_embeds
        if self.streams:
            hidden = hidden.unsqueeze(2).expand(-1, -1, self.streams, -1)
        for layer in self.layers:
            if self.unpack:
                hidden, _ = layer(hidden, scale=2.0)
            elif self.index:  # Falcon-H1: layer_outputs[0]
                hidden = layer(hidden, scale=2.0)[0]
            else:
                hidden = layer(hidden, scale=2.0)
        return hidden


def test_stand_ins_refuse_blocks_on_another_shape_and_answer_pairs_where_unpacked() -> None:
    from shardwise.adapters.torch.parallel.hf_stages import BlockArguments

    with pytest.raises(ConfigError, match=r"hidden state of shape \(1, 2, 2, 4\), not the embeddings' \(1, 2, 4\)"):
        BlockArguments(_Base(streams=2), "layers", 2)(0, (1, 2, 4), torch.float32, torch.device("cpu"))
    arguments = BlockArguments(_Base(unpack=True), "layers", 2)
    assert arguments(1, (1, 2, 4), torch.float32, torch.device("cpu")) == {"scale": 2.0}
    assert arguments._pair is True
    indexed = BlockArguments(_Base(index=True), "layers", 2)
    assert indexed(1, (1, 2, 4), torch.float32, torch.device("cpu")) == {"scale": 2.0}
    assert indexed._pair is True
    plain = BlockArguments(_Base(), "layers", 2)
    assert plain(0, (1, 2, 4), torch.float32, torch.device("cpu")) == {"scale": 2.0} and plain._pair is False


def test_the_head_stage_scales_as_the_model_does() -> None:
    """Inkling divides the final hidden state by logits_mup_width_multiplier before its head; Granite
    divides the logits by logits_scaling: the head stage does the same."""
    from types import SimpleNamespace

    from shardwise.adapters.torch.parallel.hf_stages import HFHead

    torch.manual_seed(0)
    norm, head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 16, bias=False)
    hidden = torch.randn(2, 3, 8)
    model = torch.nn.Module()
    model.config = SimpleNamespace(logits_mup_width_multiplier=4.0, logits_scaling=2.0)
    got = HFHead(norm, head, model)(hidden)
    assert torch.allclose(got, head(norm(hidden) / 4.0) / 2.0)
    model.config = SimpleNamespace(unpadded_vocab_size=12)
    with pytest.raises(ConfigError, match="unpadded_vocab_size=12"):
        HFHead(norm, head, model)


def test_cutting_a_model_into_stages_leaves_its_own_router_logits_recorded() -> None:
    """The stand-ins' probe may be the base model's first forward, where transformers installs its
    output-capturing hooks: they must land on the real routers, so the whole model's own forward
    still records router logits and adds its aux loss."""
    from shardwise.adapters.torch.parallel.stages import causal_lm_stages, model_family

    model = _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True).eval()
    causal_lm_stages(model, model_family(model))
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))
    assert len(out.router_logits) == 2 and out.aux_loss is not None
