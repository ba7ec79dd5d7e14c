"""Hugging Face models cut into pipeline stages beyond the usual shape, against one process (issue 53).

* Mixture-of-Experts with the router's load-balancing loss at pp > 1: each stage computes its own
  layers' part and the stages' router sums meet once per step, so the loss and gradients are those
  of Hugging Face's loss over every layer and the whole batch (Mixtral, Qwen3-MoE; with dp and ep).
* Families whose config has no pipeline plan (DiffLlama, Hunyuan dense: the blocks, token table and
  final norm found on the model) or whose final norm has another name (Jamba's ``final_layernorm``,
  LFM2's ``embedding_norm``), at pp2 and tp2; at dp / ZeRO-3 a family whose blocks cannot run as
  stages of their own is trained whole.

Each case trains 3 steps against Hugging Face's own training of the same model in one process (SGD
with momentum, as :mod:`hf_any`) and compares the losses and every parameter gathered whole.
"""

from __future__ import annotations

from typing import Any

import torch

import shardwise
from shardwise.adapters.torch.parallel.parallelize import parallelize
from shardwise.core.layout import ParallelLayout

import hf_any
from hf_any import VOCAB

_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attention_dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)

#: model type -> the keys of its tiny config (on top of the type's defaults).
CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {**_SHAPE, **_MOE, "num_local_experts": 4, "router_jitter_noise": 0.0},
    "qwen3_moe": {**_SHAPE, **_MOE, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16},
    "diffllama": {**_SHAPE},
    "hunyuan_v1_dense": {**_SHAPE, "head_dim": 16},
    "lfm2": {**_SHAPE, "layer_types": ["conv", "full_attention"], "block_ff_dim": 128},
    "jamba": {**_SHAPE, **_MOE, "num_experts": 4, "expert_layer_period": 2, "expert_layer_offset": 1,
              "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_expand": 2},
    # two sub-layers per block: num_hidden_layers counts 4, num_layers the 2 blocks
    "longcat_flash": {"vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 4, "use_cache": False, "ffn_hidden_size": 128, "q_lora_rank": 32,
                      "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "head_dim": 8,
                      "v_head_dim": 16, "qk_head_dim": 16, "moe_topk": 2, "n_routed_experts": 4,
                      "zero_expert_num": 2, "expert_ffn_hidden_size": 32},
    # hyper-connections (hidden state [b, s, hc, h] between blocks), indexed attention, MLA, sinks
    "hy_v4": {**_SHAPE, **_MOE, "num_key_value_heads": 4, "head_dim": 8, "moe_intermediate_size": 32,
              "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32,
              "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
              "qk_head_dim": 16, "mlp_layer_types": ["dense", "sparse"],
              "layer_types": ["indexed_attention", "indexed_attention"], "index_topk": 8, "index_head_dim": 16,
              "index_n_heads": 2, "indexer_types": ["full", "shared"], "hc_mult": 2,
              "output_router_logits": False},  # balanced by a score-correction bias: HF adds no aux loss
    # routing over product keys (4 experts = 2 x 2 keys), a load-balancing loss of its own formula
    "doge": {**_SHAPE, **_MOE, "is_moe": True, "num_experts": 4, "head_dim": 16, "num_key_value_heads": 4},
    # a recurrent loop: the middle block runs twice per forward
    "dory": {**_SHAPE, "num_hidden_layers": 3, "head_dim": 16, "n_input_layers": 1, "n_recurrent_layers": 1,
             "n_output_layers": 1, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # per-layer inputs beside the hidden state; activation sparsity over the MLP's whole width
    "gemma3n_text": {**_SHAPE, "num_hidden_layers": 4, "head_dim": 16, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2, "vocab_size_per_layer_input": VOCAB,
                     "hidden_size_per_layer_input": 8, "laurel_rank": 8, "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0]},
    "bamba": {**_SHAPE, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
              "mamba_chunk_size": 8, "mamba_n_groups": 1},
}


def config(model_type: str) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    cfg.dtype = torch.float32
    return cfg


def layouts(backend: str, cases: list[list[Any]]) -> None:
    """Each case is ``[model type, layout fields]``, of :data:`CONFIGS`: as :func:`hf_any.layouts`."""
    hf_any.layouts(backend, cases, config_of=config)


def refusals(backend: str) -> None:
    """Models whose own code the split would silently change are refused on every rank: Dory's
    recurrent loop at pp2 (a block called twice per forward cannot be a stage), Gemma 3n's
    activation sparsity at tp2 (a mean and std over the MLP's whole width), Doge's MoE router at dp2
    (its logits mix the samples of the batch)."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    hf_any._refused(world, "Dory's recurrent loop at pp2",
                    lambda: parallelize(hf_any.build("dory", cfg=config("dory")), hf_any.OPTIMIZER,
                                        ParallelLayout(pp=2, micro_batches=2), **hf_any.OPT_ARGS),
                    ["more than once"])
    hf_any._refused(world, "Gemma 3n's activation sparsity at tp2",
                    lambda: parallelize(hf_any.build("gemma3n_text", cfg=config("gemma3n_text")), hf_any.OPTIMIZER,
                                        ParallelLayout(tp=2), **hf_any.OPT_ARGS),
                    ["activation_sparsity", "'layers.*.mlp.gate_proj': 'replicate'"])
    hf_any._refused(world, "Doge's batch-mixing router at dp2 ZeRO-3",
                    lambda: parallelize(hf_any.build("doge", cfg=config("doge")), hf_any.OPTIMIZER,
                                        ParallelLayout(dp=2, zero_stage=3), **hf_any.OPT_ARGS),
                    ["DogeCDMoE", "dp=2"])


class _Fails(torch.nn.Module):
    """A layer that raises in its forward (a family's own code failing on one pipeline stage)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this stage's forward fails")


def peer_failure(backend: str, failing_stage: int) -> None:
    """A stage raising mid-step: its own error there, PeerFailedError (not a hang) on the other stage, and
    every later step refused on both."""
    from shardwise.core.errors import PeerFailedError

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    layers.insert(0 if failing_stage == 0 else len(layers), _Fails())  # first or last of the stages
    pm = parallelize(torch.nn.Sequential(*layers), torch.optim.SGD, ParallelLayout(pp=2, micro_batches=2),
                     loss_fn=lambda out, t: ((out - t) ** 2).mean(), lr=0.1)
    x = torch.ones(4, 8)
    mine = pm.groups.pp_rank == failing_stage
    for attempt in range(2):
        try:
            pm.train_step(x, x)
        except PeerFailedError as exc:
            assert not mine or attempt == 1, f"the failing stage got {exc!r}"
            assert attempt == 1 or f"pipeline rank {failing_stage} raised" in str(exc), str(exc)
        except RuntimeError as exc:
            assert mine and attempt == 0 and "this stage's forward fails" in str(exc), repr(exc)
        else:
            raise AssertionError(f"step {attempt} did not fail on rank {world.rank}")
    world.barrier()
    print(f"OK peer failure at stage {failing_stage} reached rank {world.rank}", flush=True)
