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
from typing import Mapping, Optional

import numpy as np

from .errors import ConfigError
from .tensor_parallel import TensorParallelError

__all__ = ["SplitRule", "FamilyRules", "FAMILIES", "rules_for", "check_tp_degree", "kv_head_replicas", "kv_rank_heads",
           "fused_column_order"]


@dataclass(frozen=True)
class SplitRule:
    """How the layers at ``path`` inside a block split over the tensor-parallel group.

    ``path`` is dotted and may hold ``*`` wildcards (one name each: ``experts.*.w1``).
    ``kind``: "column" (output features), "row" (input features) or "replicated" (kept whole).
    """

    path: str
    kind: str
    parts: int = 1
    """Fused outputs of a column split (GPT-2's QKV: 3), each split on its own."""
    gather_output: bool = False
    """Column: all-gather the output, so the layer's consumer sees every feature (HF ``colwise_gather_output``)."""
    split_input: bool = False
    """Row: the input is whole and is split here (HF ``rowwise_split_input``)."""
    grad_sum: bool = False
    """Replicated: its parameters see only this rank's heads, so their gradients are summed over the
    group (HF ``replicated_with_grad_allreduce``: Qwen3's per-head q/k norms)."""
    rope_dim_key: Optional[str] = None
    """Replicated: the last ``config[rope_dim_key]`` output features go straight into this rank's heads,
    so their gradient is summed over the group (HF ``mla_kv_a_proj``: MLA's shared rotary key)."""
    style: str = ""
    """The Hugging Face style name the rule came from ("" for shardwise's own rules)."""

    def __post_init__(self) -> None:
        if self.kind not in ("column", "row", "replicated"):
            raise ConfigError(f"split kind must be 'column', 'row' or 'replicated', got {self.kind!r}")
        if self.parts < 1 or (self.parts > 1 and self.kind != "column"):
            raise ConfigError(f"{self.path}: only column splits can be fused, got parts={self.parts}")
        if self.gather_output and self.kind != "column" or self.split_input and self.kind != "row":
            raise ConfigError(f"{self.path}: gather_output is for column splits and split_input for row splits")

    @property
    def splits(self) -> bool:
        """Whether the layer's weight is cut (column or row), not kept whole."""
        return self.kind != "replicated"


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
    source: str = ""
    """Where the rules came from, for people: the model's own plan or shardwise's table."""
    generic: bool = False
    """The blocks are called as the Hugging Face base model calls them (:mod:`...parallel.hf_stages`):
    their keyword arguments (masks, rotary embeddings) come from the base model's own forward."""
    unsupported: tuple[tuple[str, str], ...] = ()
    """(pattern, style) of the model's plan that shardwise does not implement; refused at tp > 1."""
    outside: tuple[tuple[str, str], ...] = ()
    """(pattern, style) of the plan outside the blocks (token table, LM head), kept whole unless
    ``vocab_parallel`` splits them."""


_GPT2 = FamilyRules(
    family="gpt2", source="shardwise's gpt2 rules (fused QKV split per part)", blocks="transformer.h", embed=("transformer.wte", "transformer.wpe", "transformer.drop"),
    final=("transformer.ln_f", "lm_head"),
    rules=(SplitRule("attn.c_attn", "column", parts=3), SplitRule("attn.c_proj", "row"),
           SplitRule("mlp.c_fc", "column"), SplitRule("mlp.c_proj", "row")),
    divided_attrs=("attn.split_size", "attn.num_heads"),
    head_keys=("n_head",))

#: shardwise's own rule tables by Hugging Face ``model_type``, where the model's own plan lacks
#: something: GPT-2 has none (and a fused QKV projection). Every model whose config carries a
#: ``base_model_tp_plan`` / ``base_model_pp_plan`` is read from it instead (:mod:`.hf_plan`).
FAMILIES: Mapping[str, FamilyRules] = MappingProxyType({"gpt2": _GPT2})


def rules_for(model_type: str) -> FamilyRules:
    """The rules of a Hugging Face ``model_type``; :class:`ConfigError` names the known ones."""
    try:
        return FAMILIES[str(model_type).lower()]
    except KeyError:
        raise ConfigError(f"no tensor/pipeline rules for model_type {model_type!r}: its config carries no "
                          f"base_model_tp_plan / base_model_pp_plan and shardwise's own tables know "
                          f"{', '.join(sorted(FAMILIES))}; give parallelize(..., tp_plan={{...}}) or use "
                          f"data parallelism / ZeRO, which need no rules") from None


def kv_head_replicas(kv_heads: int, tp: int, family: str = "model") -> int:
    """How many tensor-parallel ranks hold each key/value head: 1 where tp divides ``kv_heads``,
    ``tp // kv_heads`` where ``kv_heads`` divides a larger tp (each head replicated, as vLLM's
    ``QKVParallelLinear`` does); :class:`TensorParallelError` naming both numbers otherwise."""
    if tp < 1 or kv_heads < 1:
        raise TensorParallelError(f"{family}: num_key_value_heads={kv_heads} and tp={tp} must both be >= 1")
    if kv_heads % tp == 0:
        return 1
    if kv_heads < tp and tp % kv_heads == 0:
        return tp // kv_heads
    if kv_heads < tp:
        raise TensorParallelError(f"{family}: num_key_value_heads={kv_heads} is fewer than tp={tp} and tp={tp} is "
                                  f"not a multiple of it, so the key/value heads can neither be split nor "
                                  f"replicated evenly (use a tp that {kv_heads} divides or that divides {kv_heads})")
    raise TensorParallelError(f"{family}: num_key_value_heads={kv_heads} is not divisible by tp={tp}")


def kv_rank_heads(q_heads: int, kv_heads: int, tp: int, rank: int) -> tuple[range, range]:
    """The query heads and key/value heads tensor-parallel rank ``rank`` of ``tp`` keeps.

    Query heads split evenly; key/value heads split evenly where tp divides them, else (fewer than tp)
    rank ``r`` keeps head ``r // (tp / kv_heads)``. Checks that every query head of the rank uses a
    key/value head of the rank (query head ``h`` uses ``h // (q_heads / kv_heads)``), so attention
    on the rank's heads alone is the one-process attention of those heads.
    """
    if q_heads % tp:
        raise TensorParallelError(f"num_attention_heads={q_heads} is not divisible by tp={tp}")
    if q_heads % kv_heads:
        raise TensorParallelError(f"num_attention_heads={q_heads} is not a multiple of num_key_value_heads={kv_heads}")
    if not 0 <= rank < tp:
        raise TensorParallelError(f"rank {rank} is not in a tensor-parallel group of {tp}")
    replicas = kv_head_replicas(kv_heads, tp)
    local_q = q_heads // tp
    queries = range(rank * local_q, (rank + 1) * local_q)
    local_kv = kv_heads * replicas // tp
    group = rank // replicas
    keys = range(group * local_kv, (group + 1) * local_kv)
    per_kv = q_heads // kv_heads
    for h in queries:
        if h // per_kv not in keys:
            raise TensorParallelError(f"query head {h} of tp rank {rank} uses key/value head {h // per_kv}, "
                                      f"which the rank does not hold (it holds {list(keys)})")
    return queries, keys


def check_tp_degree(rules: FamilyRules, config: Mapping[str, object], tp: int) -> int:
    """Raise :class:`TensorParallelError` if a head count or width in ``config`` does not divide by ``tp``;
    returns how many ranks hold each key/value head (:func:`kv_head_replicas`; 1 when not replicated)."""
    if tp < 1:
        raise TensorParallelError(f"tp must be >= 1, got {tp}")
    replicas = 1
    for key in rules.head_keys:
        value = config.get(key)
        if value is None and key == "num_key_value_heads":
            value = config.get("num_attention_heads")
        if key == "num_key_value_heads" and isinstance(value, int):
            replicas = kv_head_replicas(value, tp, rules.family)
        elif isinstance(value, int) and value % tp:
            raise TensorParallelError(f"{rules.family}: {key}={value} is not divisible by tp={tp}")
    return replicas


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
