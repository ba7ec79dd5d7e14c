"""Hugging Face ``config.json`` dictionaries: the exact parameter count and shape of GPT-2, Llama,
Mistral and Qwen2.

:func:`hf_model_fields` reads a config (``model_type`` ``"gpt2"``, ``"llama"``, ``"mistral"`` or
``"qwen2"``) and counts the trainable parameters of ``GPT2LMHeadModel`` / ``LlamaForCausalLM``
(whose layer Mistral and Qwen2 share, Qwen2 with biased q, k, v) from the architecture;
:func:`load_hf_config` resolves a preset name or a ``config.json`` path. Keys a config lacks
take the defaults of transformers' ``GPT2Config()``, ``LlamaConfig()``, ``MistralConfig()`` or
``Qwen2Config()``, as ``from_pretrained`` would; those defaults are the presets ``"gpt2"``
(GPT-2 small, 124M), ``"llama"`` (Llama 7B shape), ``"mistral"`` and ``"qwen2"``. transformers is
never imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from .errors import ConfigError

__all__ = ["HF_PRESETS", "hf_model_fields", "load_hf_config"]

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


def _int(config: Mapping[str, Any], key: str, default: Optional[int] = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{config['model_type']} config: {key} must be an integer >= 1, got {value!r}")
    return value


def _flag(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key)
    if not isinstance(value, bool):
        raise ConfigError(f"{config['model_type']} config: {key} must be true or false, got {value!r}")
    return value


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


def _llama(c: Mapping[str, Any]) -> dict[str, Any]:
    """LlamaForCausalLM: rotary positions, grouped-query attention, gated MLP, RMSNorms, no biases by default."""
    layers, h, heads = _int(c, "num_hidden_layers"), _int(c, "hidden_size"), _int(c, "num_attention_heads")
    vocab, positions, f = _int(c, "vocab_size"), _int(c, "max_position_embeddings"), _int(c, "intermediate_size")
    kv_heads = _int(c, "num_key_value_heads", default=heads)
    head_dim = _int(c, "head_dim", default=h // heads)
    if heads % kv_heads:
        raise ConfigError(f"{c['model_type']} config: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv + h) * _flag(c, "attention_bias")
    if c["model_type"] == "qwen2":  # Qwen2Attention: q, k and v always biased, o never
        attention += q + 2 * kv
    mlp = 3 * h * f + (2 * f + h) * _flag(c, "mlp_bias")
    total = vocab * h + layers * (attention + mlp + 2 * h) + h  # embed_tokens, blocks, final norm
    if not _flag(c, "tie_word_embeddings"):
        total += vocab * h  # lm_head
    # Saved for backward per token, in units of h: the two RMSNorms keep about 3 h each; attention
    # (projections and rotary embedding) about 5.25 h; the gated MLP about 4.75 f (gate output,
    # its SiLU, the up projection and their product).
    return dict(num_params=total, num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=kv_heads,
                vocab_size=vocab, seq_len=positions, ffn_multiplier=f / h, mlp_matrices=3,
                saved_activations=(6.0, 5.25 + 4.75 * f / h), tied_embeddings=_flag(c, "tie_word_embeddings"))


_READERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _llama, "qwen2": _llama}


def hf_model_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`~shardwise.core.model_spec.ModelSpec` fields of a GPT-2, Llama, Mistral or Qwen2 config.

    ``num_params`` is the exact trainable parameter count (tied embeddings counted
    once); ``seq_len`` is the config's context length.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"a Hugging Face config must be a mapping (a config.json object), got "
                          f"{type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in _READERS:
        raise ConfigError(f"Hugging Face config with model_type {model_type!r}: shardwise counts the "
                          f"parameters of {' and '.join(sorted(_READERS))} configs only (give the count instead)")
    return _READERS[model_type]({**HF_PRESETS[model_type], **config})


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
