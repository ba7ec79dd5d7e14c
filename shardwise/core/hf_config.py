"""Hugging Face ``config.json`` dictionaries: the shape and parameter count of any decoder-only language model.

:func:`hf_model_fields` reads the config dict of any decoder-only ``model_type`` and counts the
trainable parameters of its ``...ForCausalLM`` from the keys that Hugging Face configs share:
the width (``hidden_size`` / ``n_embd`` / ``d_model``), depth, attention and key/value heads,
``head_dim``, the MLP width, vocabulary, tied head and context length. It also reads
multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_rope_head_dim``,
``qk_nope_head_dim``, ``v_head_dim``) and Mixture-of-Experts layers (routed experts
``num_local_experts`` / ``num_experts`` / ``n_routed_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, shared experts ``n_shared_experts`` / ``shared_expert_intermediate_size``,
dense layers from ``first_k_dense_replace``, ``mlp_only_layers`` and ``decoder_sparse_step``).

A config does not say everything: which norms a block has (Gemma's four, Qwen3's per-head
query/key norms), whether the MLP is gated, which projections carry biases. Those come
from a table of families (:data:`FAMILIES`); a ``model_type`` outside it is counted as a
Llama-like block (gated MLP unless the type is known to be plain, two RMSNorms, biases as
``attention_bias`` / ``mlp_bias`` say), and the result says so: ``counted_exactly`` is
``False``. GPT-2 (fused QKV, learned positions, LayerNorms with biases) has a reader of its own.

:func:`load_hf_config` resolves a preset name or a ``config.json`` path. Keys a config lacks
take the defaults of transformers' ``GPT2Config()``, ``LlamaConfig()``, ``MistralConfig()`` or
``Qwen2Config()`` for those four types, as ``from_pretrained`` would; those defaults are the
presets ``"gpt2"`` (GPT-2 small, 124M), ``"llama"`` (Llama 7B shape), ``"mistral"`` and
``"qwen2"``. transformers is never imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

from .errors import ConfigError

__all__ = ["HF_PRESETS", "FAMILIES", "Family", "hf_model_fields", "load_hf_config"]

HF_PRESETS: dict[str, dict[str, Any]] = {
    # transformers' GPT2Config() defaults (the keys that shape the model)
    "gpt2": {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "n_inner": None, "tie_word_embeddings": True, "activation_function": "gelu_new"},
    # transformers' LlamaConfig() defaults; num_key_value_heads None means num_attention_heads and
    # head_dim None means hidden_size // num_attention_heads, as in LlamaConfig
    "llama": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "head_dim": None, "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False},
    # transformers' MistralConfig() defaults (Mistral 7B): Llama's layer with grouped-query attention
    "mistral": {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": None, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                "attention_bias": False, "mlp_bias": False},
    # transformers' Qwen2Config() defaults: Llama's layer with biased q, k and v projections (key/value
    # heads: as many as attention heads unless given, as in Qwen2Config)
    "qwen2": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "head_dim": None, "max_position_embeddings": 32768, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False},
}

# Key aliases, first present (and not null) wins.
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_FFN = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "moe_topk", "moe_k", "top_k_experts",
          "num_selected_experts")
_EXPERT_FFN = ("moe_intermediate_size", "expert_intermediate_size", "expert_ffn_hidden_size")
_SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_FIRST_DENSE = ("first_k_dense_replace", "num_dense_layers")

#: Types that are not decoder-only language models (refused rather than miscounted).
_NOT_DECODERS = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
                           "deberta-v2", "t5", "mt5", "umt5", "bart", "mbart", "whisper", "marian", "pegasus",
                           "vit", "clip", "siglip"})


@dataclass(frozen=True)
class Family:
    """What a family's config does not say about its blocks (the defaults are Llama's)."""

    plain_mlp: bool = False
    """Two-matrix MLP (up, down) instead of a gated one (gate, up, down)."""
    block_norms: int = 2
    """Width-``h`` norms per block (Gemma 2 and 3: four, around attention and around the MLP; 0: norms
    without weights)."""
    final_norms: int = 1
    """Width-``h`` norms outside the blocks (the final norm)."""
    norm_bias: bool = False
    """LayerNorms with a bias (two vectors of ``h``) instead of RMSNorms."""
    head_vectors: int = 0
    """Vectors of ``head_dim`` per block: 2 for query/key norms per head (Qwen3), 4 for DiffLlama's lambdas."""
    qk_norm_full: bool = False
    """Query/key norms over the whole q and k widths (OLMo 2)."""
    attention_biases: str = "qkvo"
    """Which projections ``attention_bias`` biases (``"qkvo"``, ``"qkv"``), or ``"always_qkv"`` (Qwen2: q, k
    and v whatever the config says, o never) or ``"always_qkvo"``."""
    mlp_biases: bool = False
    """The MLP's projections are biased whatever ``mlp_bias`` says (GPT-NeoX, Phi)."""
    lm_head_bias: bool = False
    """The LM head has a bias (Phi, GPT-J)."""
    attention_sinks: bool = False
    """A learned sink logit per attention head (gpt-oss)."""
    router_bias: bool = False
    """The router is a biased linear (gpt-oss)."""
    expert_bias: bool = False
    """Each routed expert's projections are biased (gpt-oss)."""
    shared_gate: bool = False
    """A sigmoid gate of width 1 on the shared expert's output (Qwen2-MoE)."""
    shared_expert: bool = False
    """One shared expert as wide as a routed one, which the config does not name (Llama 4, Hunyuan-MoE)."""


_LLAMA = Family()
_QK_HEAD = Family(head_vectors=2)
_QK_FULL = Family(qk_norm_full=True)
_PARALLEL_BLOCK = Family(plain_mlp=True, block_norms=1, norm_bias=True, mlp_biases=True, lm_head_bias=True)

#: Families counted exactly, by ``model_type`` (each checked against transformers' own model at a tiny
#: size); ``Family()`` is Llama's block as configured.
FAMILIES: Mapping[str, Family] = MappingProxyType({
    **dict.fromkeys(("llama", "mistral", "mixtral", "phi3", "deepseek_v2", "deepseek_v3", "gemma", "granite",
                     "granitemoe", "granitemoeshared", "ministral", "ministral3", "helium", "internlm3", "smollm3",
                     "vaultgemma", "youtu", "cwm", "exaone", "iquestcoder", "glm4_moe", "ernie4_5",
                     "solar_open", "sarvam_mla"), _LLAMA),
    **dict.fromkeys(("qwen3", "qwen3_moe", "exaone4", "exaone_moe", "hunyuan_v1_dense", "mellum", "param2moe",
                     "sarvam_moe", "lfm2"), _QK_HEAD),
    **dict.fromkeys(("olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2"), _QK_FULL),
    "qwen2": Family(attention_biases="always_qkv"),
    "qwen2_moe": Family(attention_biases="always_qkv", shared_gate=True),
    "gemma2": Family(block_norms=4), "gemma3_text": Family(block_norms=4, head_vectors=2),
    "hyperclovax": Family(block_norms=4), "kolibri1": Family(block_norms=4, head_vectors=2),
    "glm": Family(attention_biases="qkv"), "seed_oss": Family(attention_biases="qkv"),
    "glm4": Family(block_norms=4, attention_biases="qkv"),
    "cohere": Family(block_norms=1), "cohere2": Family(block_norms=1),
    "diffllama": Family(head_vectors=4), "olmo": Family(block_norms=0, final_norms=0),
    "granite_swa": Family(attention_sinks=True), "granitemoe_swa": Family(attention_sinks=True),
    "phimoe": Family(norm_bias=True), "nemotron": Family(plain_mlp=True, norm_bias=True),
    "gpt_neox": Family(plain_mlp=True, norm_bias=True, mlp_biases=True),
    "codegen": _PARALLEL_BLOCK, "gptj": _PARALLEL_BLOCK,
    "phi": Family(plain_mlp=True, block_norms=1, norm_bias=True, attention_biases="always_qkvo", mlp_biases=True,
                  lm_head_bias=True),
    "starcoder2": Family(plain_mlp=True, norm_bias=True, attention_biases="always_qkvo", mlp_biases=True),
    "gpt_oss": Family(attention_sinks=True, router_bias=True, expert_bias=True),
    "llama4_text": Family(shared_expert=True), "hunyuan_v1_moe": Family(shared_expert=True, head_vectors=2),
    "glm4_moe_lite": _LLAMA, "hy_v3": _QK_HEAD,
})

#: Types whose MLP has no gate (up, activation, down); every other type is assumed gated.
_PLAIN_MLP = frozenset({"gpt2", "gpt_neox", "gpt_neo", "gptj", "codegen", "phi", "starcoder2", "falcon",
                        "gpt_bigcode", "opt", "bloom", "mpt", "persimmon", "biogpt", "xglm", "nemotron", "apertus",
                        "apertus1p5_text", "arcee", "nanochat", "jais2"})


def _where(config: Mapping[str, Any]) -> str:
    return f"Hugging Face config (model_type {config.get('model_type')!r})"


def _int(config: Mapping[str, Any], key: str, default: Optional[int] = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{config['model_type']} config: {key} must be an integer >= 1, got {value!r}")
    return value


def _flag(config: Mapping[str, Any], key: str, default: Optional[bool] = None) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{config['model_type']} config: {key} must be true or false, got {value!r}")
    return value


def _key(config: Mapping[str, Any], keys: Sequence[str]) -> Optional[str]:
    """The first of ``keys`` the config sets (not null)."""
    return next((k for k in keys if config.get(k) is not None), None)


def _need(config: Mapping[str, Any], keys: Sequence[str], what: str) -> int:
    key = _key(config, keys)
    if key is None:
        raise ConfigError(f"{_where(config)}: no {what} ({', '.join(keys)})")
    return _int(config, key)


#: Activations that transformers writes as a tanh formula in Python (autograd keeps each step).
_FORMULA_GELUS = frozenset({"gelu_new", "gelu_fast", "gelu_10", "gelu_python"})


def _gpt2(c: Mapping[str, Any]) -> dict[str, Any]:
    """GPT2LMHeadModel: learned positions, biased projections, LayerNorms, lm_head tied to wte by default."""
    layers, h, heads = _int(c, "n_layer"), _int(c, "n_embd"), _int(c, "n_head")
    vocab, positions = _int(c, "vocab_size"), _int(c, "n_positions")
    f = _int(c, "n_inner", default=4 * h)
    layer = (2 * h                      # ln_1
             + h * 3 * h + 3 * h        # c_attn (q, k, v)
             + h * h + h                # attn c_proj
             + 2 * h                    # ln_2
             + h * f + f                # c_fc
             + f * h + h)               # mlp c_proj
    total = vocab * h + positions * h + layers * layer + 2 * h  # wte, wpe, blocks, ln_f
    if not _flag(c, "tie_word_embeddings"):
        total += vocab * h
    # Saved for backward per token, in units of h (fp32, no dropout, SDPA attention): the inputs of
    # ln_1, c_attn, ln_2 and c_fc (replicated under tensor parallelism); q, k, v and the attention
    # output; the MLP keeps its GELU input and c_proj input (2 f), or 5 f with the tanh formula of
    # "gelu_new", which autograd records step by step.
    act = str(c.get("activation_function", "gelu_new"))
    mlp_saved = (5 if act in _FORMULA_GELUS else 2) * f / h
    return dict(num_params=total, num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=heads,
                vocab_size=vocab, seq_len=positions, ffn_multiplier=f / h, mlp_matrices=2,
                saved_activations=(4.0, 4.0 + mlp_saved), tied_embeddings=_flag(c, "tie_word_embeddings"))


@dataclass(frozen=True)
class _Block:
    """The counted pieces of one decoder-only config."""

    h: int
    heads: int
    kv_heads: int
    f: int
    family: Family
    gated: bool


def _attention(c: Mapping[str, Any], b: _Block, head_dim: int) -> int:
    """Weights of one attention block: standard (grouped-query) or multi-head latent attention (MLA)."""
    h, heads, fam = b.h, b.heads, b.family
    bias = _flag(c, "attention_bias", False)
    if c.get("kv_lora_rank") is not None:  # DeepSeek's MLA
        kv_rank, rope = _int(c, "kv_lora_rank"), _int(c, "qk_rope_head_dim")
        nope, v_dim = _int(c, "qk_nope_head_dim"), _int(c, "v_head_dim")
        qk_dim = nope + rope
        if c.get("q_lora_rank") is not None:
            q_rank = _int(c, "q_lora_rank")
            q = h * q_rank + q_rank * bias + q_rank + q_rank * heads * qk_dim  # q_a, its norm, q_b
        else:
            q = h * heads * qk_dim
        kv = h * (kv_rank + rope) + (kv_rank + rope) * bias + kv_rank + kv_rank * heads * (nope + v_dim)
        return q + kv + heads * v_dim * h + h * bias
    q, kv = heads * head_dim, b.kv_heads * head_dim
    total = h * q + 2 * h * kv + q * h
    which = fam.attention_biases
    if which.startswith("always") or bias:
        total += q + 2 * kv + h * which.endswith("o")
    total += fam.head_vectors * head_dim + (q + kv) * fam.qk_norm_full
    return total + heads * fam.attention_sinks


def _mlp(c: Mapping[str, Any], b: _Block, width: int) -> int:
    """Weights of one MLP of ``width`` (gated: gate, up, down; plain: up, down), biases as ``mlp_bias``."""
    matrices = 3 if b.gated else 2
    bias = b.family.mlp_biases or _flag(c, "mlp_bias", False)
    return matrices * b.h * width + ((matrices - 1) * width + b.h) * bias


def _index_list(c: Mapping[str, Any], key: str) -> Optional[list[int]]:
    value = c.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise ConfigError(f"{_where(c)}: {key} must be a list of layer indices, got {value!r}")
    return list(value)


def _moe_layers(c: Mapping[str, Any], layers: int) -> list[int]:
    """Indices of the layers whose MLP is a Mixture of Experts (the rest are dense)."""
    listed = _index_list(c, "moe_layers")  # Llama 4 lists them
    if listed is not None:
        return [i for i in listed if 0 <= i < layers]
    kinds = c.get("mlp_layer_types")  # ["dense", "sparse", ...]
    if kinds is not None:
        if not isinstance(kinds, (list, tuple)) or len(kinds) != layers:
            raise ConfigError(f"{_where(c)}: mlp_layer_types must list one kind per layer ({layers}), got {kinds!r}")
        return [i for i, kind in enumerate(kinds) if kind != "dense"]
    first_key = _key(c, _FIRST_DENSE)
    first_dense = c.get(first_key) if first_key else 0
    step = c.get("decoder_sparse_step") or 1
    freq = c.get("moe_layer_freq") or 1
    for name, value in ((first_key, first_dense), ("decoder_sparse_step", step), ("moe_layer_freq", freq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{_where(c)}: {name} must be a non-negative integer, got {value!r}")
    only = _index_list(c, "mlp_only_layers") or []
    return [i for i in range(layers) if i >= first_dense and i not in only and (i + 1) % step == 0
            and (i - first_dense) % freq == 0]


def _moe(c: Mapping[str, Any], b: _Block, layers: int) -> dict[str, Any]:
    """Routed and shared experts: counts per MoE layer and the MoE fields of the spec."""
    experts_key = _key(c, _EXPERTS)
    experts = _int(c, experts_key) if experts_key else 0
    if experts == 0 or c.get("enable_moe_block") is False:
        return dict(num_experts=0, experts_per_token=0, expert_params=0, moe_layers=0, moe_layer=0,
                    expert_layer=0, width=0, shared_width=0)
    top_k = _need(c, _TOP_K, "experts per token")
    if top_k > experts:
        raise ConfigError(f"{_where(c)}: {top_k} experts per token but only {experts} experts")
    width_key = _key(c, _EXPERT_FFN)
    width = _int(c, width_key) if width_key else b.f
    fam = b.family
    per_expert = _mlp(c, b, width)
    if fam.expert_bias:
        per_expert += (2 if b.gated else 1) * width + b.h
    router = b.h * experts + experts * fam.router_bias
    shared_width = 0
    shared_key = _key(c, _SHARED)
    if c.get("shared_expert_intermediate_size"):
        shared_width = _int(c, "shared_expert_intermediate_size")
    elif shared_key and c[shared_key] != 0:
        shared_width = width * _int(c, shared_key)
    elif fam.shared_expert:
        shared_width = width
    shared = _mlp(c, b, shared_width) + b.h * fam.shared_gate if shared_width else 0
    sparse = _moe_layers(c, layers)
    if not sparse:
        return dict(num_experts=0, experts_per_token=0, expert_params=0, moe_layers=0, moe_layer=0,
                    expert_layer=0, width=0, shared_width=0)
    return dict(num_experts=experts, experts_per_token=top_k, expert_params=len(sparse) * experts * per_expert,
                moe_layers=len(sparse), moe_layer=router + shared, expert_layer=experts * per_expert,
                width=width, shared_width=shared_width)


def _decoder(c: Mapping[str, Any]) -> dict[str, Any]:
    """Any decoder-only causal LM: embeddings, blocks of attention + MLP or MoE with their norms, head."""
    model_type = c.get("model_type")
    family = FAMILIES.get(str(model_type))
    exact = family is not None
    if family is None:
        family = Family(plain_mlp=model_type in _PLAIN_MLP)
    h = _need(c, _HIDDEN, "hidden size")
    layers = _need(c, _LAYERS, "layer count")
    heads = _need(c, _HEADS, "attention head count")
    vocab = _need(c, ("vocab_size",), "vocabulary size")
    kv_key = _key(c, _KV_HEADS)
    kv_heads = _int(c, kv_key) if kv_key else (1 if c.get("multi_query") is True else heads)
    if heads % kv_heads:
        raise ConfigError(f"{model_type} config: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")
    head_dim = _int(c, "head_dim") if c.get("head_dim") is not None else h // heads
    if head_dim < 1:
        raise ConfigError(f"{_where(c)}: hidden size {h} over {heads} heads leaves no head_dim; set head_dim")
    positions_key = _key(c, _POSITIONS)
    positions = _int(c, positions_key) if positions_key else 2048
    ffn_key = _key(c, _FFN)
    if ffn_key is None:  # no MLP width: 4 h, as GPT-2 and most plain-MLP families default
        f, exact = 4 * h, False
    else:
        f = _int(c, ffn_key)
    if "tie_word_embeddings" in c:
        tied = _flag(c, "tie_word_embeddings")
    else:  # PretrainedConfig's old default; the config does not say
        tied, exact = True, False
    block = _Block(h=h, heads=heads, kv_heads=kv_heads, f=f, family=family, gated=not family.plain_mlp)
    moe = _moe(c, block, layers)
    norms = family.block_norms * h * (2 if family.norm_bias else 1)
    attention = _attention(c, block, head_dim)
    dense_layer = attention + _mlp(c, block, f) + norms
    moe_layer = attention + moe["moe_layer"] + moe["expert_layer"] + norms
    sparse, dense = moe["moe_layers"], layers - moe["moe_layers"]
    total = vocab * h + dense * dense_layer + sparse * moe_layer + family.final_norms * h * (1 + family.norm_bias)
    if not tied:
        total += vocab * h + vocab * family.lm_head_bias  # lm_head
    # Saved for backward per token, in units of h: the two RMSNorms keep about 3 h each; attention
    # (projections and rotary embedding) about 5.25 h; the gated MLP about 4.75 f (gate output,
    # its SiLU, the up projection and their product), a plain one 2 f; an MoE layer that for the
    # widths a token passes through (its top-k experts and the shared expert).
    # ``ffn``: the dense MLP width of a block besides the routed experts, averaged over the blocks.
    ffn = (dense * f + sparse * moe["shared_width"]) / layers
    passed = ffn + sparse * moe["experts_per_token"] * moe["width"] / layers
    mlp_saved = (4.75 if block.gated else 2.0) * passed / h
    return dict(num_params=total, num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=kv_heads,
                vocab_size=vocab, seq_len=positions, ffn_multiplier=ffn / h, mlp_matrices=3 if block.gated else 2,
                saved_activations=(6.0, 5.25 + mlp_saved), tied_embeddings=tied,
                num_experts=moe["num_experts"], experts_per_token=moe["experts_per_token"],
                expert_params=moe["expert_params"], moe_layers=sparse, counted_exactly=exact)


def hf_model_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`~shardwise.core.model_spec.ModelSpec` fields of any decoder-only Hugging Face config.

    ``num_params`` is the trainable parameter count (tied embeddings counted once), exact
    for GPT-2 and the types of :data:`FAMILIES` (``counted_exactly`` is then ``True``);
    ``seq_len`` is the config's context length. A multimodal config's ``text_config`` is read
    for its language model (``counted_exactly`` ``False``: the other towers are not counted).
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"a Hugging Face config must be a mapping (a config.json object), got "
                          f"{type(config).__name__}")
    model_type = config.get("model_type")
    if model_type in _NOT_DECODERS or config.get("is_encoder_decoder") is True:
        raise ConfigError(f"Hugging Face config with model_type {model_type!r}: not a decoder-only language "
                          f"model; shardwise counts causal LMs only (give the count instead)")
    if not isinstance(model_type, str):
        raise ConfigError(f"{_where(config)}: a config needs its model_type (a string)")
    text = config.get("text_config")
    if _key(config, _HIDDEN) is None and isinstance(text, Mapping):
        inner = {"model_type": f"{model_type}.text_config", **text}
        return {**hf_model_fields(inner), "counted_exactly": False}
    merged = {**HF_PRESETS.get(model_type, {}), **config}
    if model_type == "gpt2":
        return {**_gpt2(merged), "num_experts": 0, "experts_per_token": 0, "expert_params": 0, "moe_layers": 0,
                "counted_exactly": True}
    return _decoder(merged)


def load_hf_config(model: str) -> dict[str, Any]:
    """The config of preset ``model`` (``"gpt2"``, ``"llama"``, ``"mistral"``, ``"qwen2"``), read from the
    JSON file at path ``model``, or from the ``config.json`` of a ``save_pretrained`` directory."""
    if model in HF_PRESETS:
        return dict(HF_PRESETS[model])
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():  # a save_pretrained directory
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"model {model!r} is neither a preset ({', '.join(sorted(HF_PRESETS))}), a "
                          "Hugging Face config.json file nor a save_pretrained directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read the Hugging Face config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not a config object")
    return config
