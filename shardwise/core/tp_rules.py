"""Tensor-parallel rules per architecture family: which layers split by column, which by row.

Megatron's recipe for a transformer block: the first linear of the attention
(QKV) and of the MLP are split by output columns, the second (attention output,
MLP down projection) by input rows, so each block needs one all-reduce in forward
and one in backward per sub-layer. Embeddings, norms and the LM head stay
replicated. A rule table names those layers by their path inside a block, so a
family is supported by data, not by editing the model.

Fused projections (GPT-2's ``c_attn`` holds Q, K and V side by side) are split
part by part: :func:`fused_column_order` permutes the output features so that a
contiguous column split gives each rank its heads of every part.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np

from .errors import ConfigError
from .tensor_parallel import TensorParallelError

__all__ = ["SplitRule", "FamilyRules", "FAMILIES", "rules_for", "check_tp_degree", "fused_column_order"]


@dataclass(frozen=True)
class SplitRule:
    """One layer inside a block: ``path`` (dotted), ``kind`` ("column"/"row"), ``parts`` fused outputs."""

    path: str
    kind: str
    parts: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("column", "row"):
            raise ConfigError(f"split kind must be 'column' or 'row', got {self.kind!r}")
        if self.parts < 1 or (self.parts > 1 and self.kind != "column"):
            raise ConfigError(f"{self.path}: only column splits can be fused, got parts={self.parts}")


@dataclass(frozen=True)
class FamilyRules:
    """Where a family keeps its blocks, how each block splits, and the head counts that must divide."""

    family: str
    blocks: str
    """Dotted path of the ``ModuleList`` of transformer blocks."""
    embed: tuple[str, ...]
    """Dotted paths of the modules before the blocks (token and position embeddings)."""
    final: tuple[str, ...]
    """Dotted paths of the modules after the blocks (final norm, LM head)."""
    rules: tuple[SplitRule, ...]
    divided_attrs: tuple[str, ...] = ()
    """Dotted attribute paths inside a block that count per-rank features (divided by tp)."""
    head_keys: tuple[str, ...] = ()
    """Config keys whose values must be divisible by tp (head counts, MLP width)."""


_GPT2 = FamilyRules(
    family="gpt2", blocks="transformer.h", embed=("transformer.wte", "transformer.wpe", "transformer.drop"),
    final=("transformer.ln_f", "lm_head"),
    rules=(SplitRule("attn.c_attn", "column", parts=3), SplitRule("attn.c_proj", "row"),
           SplitRule("mlp.c_fc", "column"), SplitRule("mlp.c_proj", "row")),
    divided_attrs=("attn.split_size", "attn.num_heads"),
    head_keys=("n_head",))

_LLAMA = FamilyRules(
    family="llama", blocks="model.layers", embed=("model.embed_tokens",), final=("model.norm", "lm_head"),
    rules=(SplitRule("self_attn.q_proj", "column"), SplitRule("self_attn.k_proj", "column"),
           SplitRule("self_attn.v_proj", "column"), SplitRule("self_attn.o_proj", "row"),
           SplitRule("mlp.gate_proj", "column"), SplitRule("mlp.up_proj", "column"),
           SplitRule("mlp.down_proj", "row")),
    head_keys=("num_attention_heads", "num_key_value_heads", "intermediate_size"))

#: Families by Hugging Face ``model_type``; Mistral and Qwen2 share Llama's block layout.
FAMILIES: Mapping[str, FamilyRules] = MappingProxyType({
    "gpt2": _GPT2, "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA,
})


def rules_for(model_type: str) -> FamilyRules:
    """The rules of a Hugging Face ``model_type``; :class:`ConfigError` names the known ones."""
    try:
        return FAMILIES[str(model_type).lower()]
    except KeyError:
        raise ConfigError(f"no tensor/pipeline rules for model_type {model_type!r}; known: "
                          f"{', '.join(sorted(FAMILIES))}") from None


def check_tp_degree(rules: FamilyRules, config: Mapping[str, object], tp: int) -> None:
    """Raise :class:`TensorParallelError` if a head count or width in ``config`` does not divide by ``tp``."""
    if tp < 1:
        raise TensorParallelError(f"tp must be >= 1, got {tp}")
    for key in rules.head_keys:
        value = config.get(key)
        if value is None and key == "num_key_value_heads":
            value = config.get("num_attention_heads")
        if isinstance(value, int) and value % tp:
            raise TensorParallelError(f"{rules.family}: {key}={value} is not divisible by tp={tp}")


def fused_column_order(out_features: int, parts: int, tp: int) -> np.ndarray:
    """Output-feature order that makes a contiguous column split give each rank a slice of every part.

    The ``out_features`` are ``parts`` equal blocks (e.g. Q, K, V); rank ``r`` of
    ``tp`` gets the ``r``-th slice of each block, in block order.
    """
    if out_features % parts or (out_features // parts) % tp:
        raise TensorParallelError(f"{out_features} fused features in {parts} parts do not split over tp={tp}")
    width = out_features // parts
    step = width // tp
    return np.array([p * width + r * step + i for r in range(tp) for p in range(parts) for i in range(step)],
                    dtype=np.int64)
