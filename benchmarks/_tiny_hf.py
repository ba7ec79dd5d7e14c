"""Tiny configurations of every Hugging Face causal-LM type that carries a parallelism plan.

:func:`plan_types` lists the causal-LM model types of the installed transformers whose
config class has a tensor- or pipeline-parallel plan (``base_model_tp_plan`` /
``base_model_pp_plan``); :func:`tiny_config` shrinks a type's default config to a model
of a few hundred thousand parameters that keeps what makes the family itself: its
attention and MLP layer-type patterns (sliding/full, linear/full, dense-then-MoE), its
grouped KV heads, its MLA / indexer / linear-attention / Mamba dimensions, shrunk
consistently. :func:`build` makes the model after a fixed seed, in fp32, without dropout.

The shrinking is generic (:data:`SIZES` by config key, every per-layer list cut to the
new depth); :data:`OVERRIDES` holds the few keys a family needs besides.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 4, 2, 16, 128, 256
EXPERTS, TOP_K, MOE_FFN = 4, 2, 32

#: Sizes by config key (the value a key takes when the default config has it).
SIZES: dict[str, Any] = {
    # the trunk
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN,
    "num_attention_heads": HEADS, "n_head": HEADS, "swa_num_attention_heads": HEADS,
    "head_dim": HEAD_DIM, "swa_head_dim": HEAD_DIM, "rotary_dim": HEAD_DIM // 2,
    "intermediate_size": FFN, "ffn_hidden_size": FFN, "dense_intermediate_size": FFN, "intermediate_size_mlp": FFN,
    "mlp_only_intermediate_size": FFN, "n_inner": FFN,
    "hidden_size_per_layer_input": 16, "laurel_rank": 8, "altup_num_inputs": 2,
    # experts
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_topk": TOP_K, "moe_k": TOP_K,
    "moe_intermediate_size": MOE_FFN, "expert_ffn_hidden_size": MOE_FFN,
    "shared_expert_intermediate_size": MOE_FFN, "shared_experts_intermediate_size": MOE_FFN,
    "moe_shared_expert_intermediate_size": MOE_FFN, "shared_intermediate_size": MOE_FFN,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "zero_expert_num": 2,
    "router_jitter_noise": 0.0, "router_aux_loss_coef": None,  # None: keep the family's default
    # multi-head latent attention (DeepSeek and its kin), compressed attention, indexers
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "o_lora_rank": 16, "o_groups": 2,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8, "index_num_heads": 2, "index_pool_size": 32,
    "index_block_size": 4, "index_topk_blocks": 2, "index_num_local_tokens": 4, "index_num_sink_tokens": 2,
    "index_compression": 2,
    # linear attention, convolutions, state spaces
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_head_dim": 16, "linear_num_heads": 4, "gated_norm_rank": 8,
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_chunk_size": 8, "mamba_d_ssm": 128,
    "mamba_dt_rank": 8, "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1,
    "chunk_size": 8, "block_size": 8,
    # windows shorter than the 16-token batches, so the sliding layers differ from the full ones
    "sliding_window": 8, "sliding_window_size": 8, "attention_chunk_size": 8, "keep_window_size": 8,
    "rel_extent": 8, "d_rel": 4,
    # others
    "hc_mult": 2, "hc_count": 2, "hc_lowrank": 8, "ple_embed_dim": 16, "heads_per_ngram": 2,
    "ngram_vocab_size_base": 64, "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 2,
    "loop_gate_rank": 8, "number_of_conv_states": 2, "log_scaling_n_floor": 8, "scale_emb": 1,
    "dim_model_base": HIDDEN,
}

#: Keys kept only at most this small (a family's count of shared experts, dense layers).
AT_MOST: dict[str, int] = {"n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1}

#: Keys of the expert count and top-k, set on a MoE type even where its default is None.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
               "num_experts_per_token", "moe_topk", "moe_k")

#: Per-type extra keys (applied last): where a default config does not build, or where the
#: generic cut breaks a family's own invariant.
OVERRIDES: dict[str, dict[str, Any]] = {
    # per-layer-type rope parameters, none given by default
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # its default layer types include indexed attention, but the indexer's sizes default to None
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
    # input, recurrent (looped) and output layers: one each; to_dict lists (attention, mlp) pairs
    "dory": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    # MLA whose sliding layers need head_dim = qk_nope_head_dim + qk_rope_head_dim
    "dots3_note_text": {"head_dim": 16},
    # the last num_kv_shared_layers layers reuse the KV of earlier ones of the same type
    "gemma3n_text": {"_depth": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "num_kv_shared_layers": 2},
    # the audio encoder's conformer: one block, narrow convolutions
    "phi4_multimodal": {"audio_config": {"num_blocks": 1, "ext_pw_out_channel": 64,
                                         "depthwise_separable_out_channel": 64, "nemo_conv_channels": 32}},
    # MoE is a switch here, off by default
    "gemma4_text": {"enable_moe_block": True, "num_experts": EXPERTS, "top_k_experts": TOP_K,
                    "moe_intermediate_size": MOE_FFN},
    # hybrids whose default (or cut) pattern has no attention layer: Mamba layer 0, attention layer 1
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # every 4th layer without rope by default: one of each
    "llama4": {"no_rope_layers": [1, 0]}, "llama4_text": {"no_rope_layers": [1, 0]}, "smollm3": {"no_rope_layers": [1, 0]},
    # attention on every layer by default (full_attn_idxs): keep a convolution layer
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    # layer 0 a dense convolution layer, layer 1 attention with experts
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
}

#: Keys that list one value per layer and are rebuilt for the new depth from the values they use.
PATTERN_KEYS = ("layer_types", "mlp_layer_types", "layers_block_type", "indexer_types")


def plan_types() -> list[str]:
    """Causal-LM model types of the installed transformers whose config carries a tp or pp plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        cls = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
        if cls is not None and (getattr(cls, "base_model_tp_plan", None) or getattr(cls, "base_model_pp_plan", None)):
            out.append(model_type)
    return out


def is_moe(model_type: str) -> bool:
    """Whether the type's config class has an expert-parallel plan (``base_model_ep_plan``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return bool(getattr(CONFIG_MAPPING[model_type], "base_model_ep_plan", None))


def model_class(model_type: str) -> type:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _pattern(values: list, depth: int) -> list:
    """``values`` cut to ``depth`` layers keeping every kind it has, in order of first use."""
    kinds = list(dict.fromkeys(json.dumps(v, sort_keys=True) for v in values))
    return [json.loads(kinds[i % len(kinds)]) for i in range(depth)]


def _depth(defaults: dict, at_least: int = LAYERS) -> int:
    kinds = [len({json.dumps(v) for v in defaults[k]}) for k in PATTERN_KEYS if isinstance(defaults.get(k), list)]
    return max([at_least, *kinds])


def _shrink(defaults: dict, depth_keys: tuple[str, ...], moe: bool = False, depth: int = LAYERS) -> dict[str, Any]:
    """The keys to change in a config whose default values are ``defaults`` (``depth``: layers at least)."""
    layers = next((defaults[k] for k in depth_keys if isinstance(defaults.get(k), int)), None)
    depth = _depth(defaults, depth)
    kw: dict[str, Any] = {}
    for key, value in defaults.items():
        if key in SIZES and SIZES[key] is not None and value is not None and not isinstance(value, bool):
            if isinstance(value, list):
                kw[key] = [SIZES[key]] * depth
            elif isinstance(value, (int, float)):
                kw[key] = SIZES[key]
        elif key in EXPERT_KEYS and value is None and moe:
            kw[key] = SIZES[key]
        elif key in AT_MOST and (isinstance(value, int) or value is None and moe):
            kw[key] = min(value or AT_MOST[key], AT_MOST[key])
        elif ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            kw[key] = 0.0
        elif key in PATTERN_KEYS and isinstance(value, list):
            kw[key] = _pattern(value, depth)
        elif key == "per_layer_config" and value:
            kw[key] = {}
        elif isinstance(value, list) and layers and len(value) == layers and key not in ("eos_token_id",):
            kw[key] = value[:depth]  # one value per layer
    for key in depth_keys:
        if isinstance(defaults.get(key), int):
            kw[key] = depth
    kv = defaults.get("num_key_value_heads")
    heads = defaults.get("num_attention_heads") or defaults.get("n_head")
    if isinstance(kv, int):
        kw["num_key_value_heads"] = KV_HEADS if heads and kv < heads else HEADS
    elif "num_key_value_heads" in defaults:  # None: as many as query heads unless given
        kw["num_key_value_heads"] = KV_HEADS
    if "head_dim" in defaults and defaults["head_dim"] is None:
        kw["head_dim"] = HEAD_DIM
    if isinstance(defaults.get("swa_num_key_value_heads"), int):
        kw["swa_num_key_value_heads"] = KV_HEADS
    if isinstance(defaults.get("kv_lora_rank"), int):  # MLA: the rope part of the head is head_dim
        kw["head_dim"] = SIZES["qk_rope_head_dim"]
        if "qk_head_dim" in defaults:
            kw["qk_head_dim"] = SIZES["qk_rope_head_dim"] + SIZES["qk_nope_head_dim"]
    if defaults.get("q_lora_rank") is None and "q_lora_rank" in kw:
        del kw["q_lora_rank"]
    for key, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(defaults.get(key), int):
            kw[key] = value
        elif isinstance(defaults.get(key), list):
            kw[key] = [value]
    for key in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        if isinstance(defaults.get(key), int) and defaults[key] > 0:
            kw[key] = 1  # layer 0 dense, layer 1 MoE
    if isinstance(defaults.get("moe_layer_end_index"), int):
        kw["moe_layer_end_index"] = depth - 1
    if isinstance(defaults.get("mlp_only_layers"), list) and defaults["mlp_only_layers"]:
        kw["mlp_only_layers"] = [0]
    if isinstance(defaults.get("moe_layers"), list):
        kw["moe_layers"] = list(range(1, depth))
    if "output_router_logits" in defaults:
        kw["output_router_logits"] = True
    if "use_cache" in defaults:
        kw["use_cache"] = False
    return kw


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type`` (fp32, no dropout, aux loss on for MoE types)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    target = getattr(model_class(model_type), "config_class", cls)
    if target is not None and target is not cls and "text_config" in getattr(cls, "sub_configs", {}):
        cls = cls.sub_configs["text_config"]  # a multimodal config whose causal LM takes the text part
    defaults = cls().to_dict()
    extra = dict(OVERRIDES.get(model_type, {}))
    kw = _shrink(defaults, ("num_hidden_layers", "n_layer", "num_layers"), moe=is_moe(model_type),
                 depth=extra.pop("_depth", LAYERS))
    for name, sub in getattr(cls, "sub_configs", {}).items():
        if isinstance(defaults.get(name), dict):
            sub_defaults = sub().to_dict()
            kw[name] = {**sub_defaults, **_shrink(sub_defaults, ("num_hidden_layers", "num_layers", "depth"))}
    for key, value in extra.items():  # a sub-config's keys merge into its shrunk dict
        kw[key] = {**kw[key], **value} if isinstance(value, dict) and isinstance(kw.get(key), dict) else value
    cfg = cls(**kw)
    import torch

    cfg.dtype = torch.float32
    return cfg


def fingerprint(cfg: Any, extra: Optional[dict] = None) -> str:
    """A short hash of a config and ``extra``: a cached reference is reused only for the same one."""
    text = json.dumps({"config": cfg.to_dict(), **(extra or {})}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(model_type: str, seed: int = 0, cfg: Any = None) -> Any:
    """The tiny model of ``model_type`` after ``torch.manual_seed(seed)``, fp32, train mode.

    Built under ``torch.device("meta")`` by the caller, it has the same parameters, unallocated."""
    import torch

    cfg = cfg if cfg is not None else tiny_config(model_type)
    torch.manual_seed(seed)
    model = model_class(model_type)(cfg)
    return model.float().train()


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["plan_types", "is_moe", "tiny_config", "build", "fingerprint", "model_class", "n_params"]
