"""Split rules from a Hugging Face model's own plans.

transformers ships, with most causal-LM configs, the plans its own distributed
training uses: ``base_model_tp_plan`` (module pattern -> tensor-parallel style, e.g.
``{"layers.*.self_attn.q_proj": "colwise", ...}``) and ``base_model_pp_plan`` (the
base model's parts in order: token table, blocks, final norm). :func:`hf_family`
turns them into a :class:`~.tp_rules.FamilyRules`, so any model type that has a
plan is split without a table of its own. A user's ``tp_plan`` adds to or
overrides the model's entries.

Styles and what shardwise does with them (inside the blocks):

* ``colwise`` / ``rowwise``: Megatron's column / row split;
* ``colwise_gather_output``: a column split whose output is all-gathered (its consumer
  needs every feature, e.g. OLMo-2's norm over all heads), ``rowwise_split_input``: a
  row split that cuts its whole input itself;
* ``replicated_with_grad_allreduce``: kept whole, its gradient summed over the group
  (a per-head norm that sees this rank's heads only);
* ``mla_kv_a_proj``: kept whole, the gradient of its rotary-key part summed (MLA);
* ``replicate``: kept whole.

Entries outside the blocks (``embed_tokens: embedding_rowwise``, the class's
``lm_head: colwise_gather_output``) are kept whole; ``vocab_parallel`` splits the
token table and head by vocabulary instead. Other styles (the MoE ones, which expert
parallelism handles, ``local_params``, ``packed_rowwise``, ``unit_colwise``) are
recorded and refused, by name, when tensor parallelism would need them.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .errors import ConfigError
from .tp_rules import FamilyRules, SplitRule

__all__ = ["hf_family", "has_hf_plan", "STYLES", "describe_rules"]

#: Hugging Face tensor-parallel styles shardwise implements inside a block, as rule arguments.
STYLES: Mapping[str, dict[str, Any]] = {
    "colwise": {"kind": "column"},
    "rowwise": {"kind": "row"},
    "colwise_gather_output": {"kind": "column", "gather_output": True},
    "rowwise_split_input": {"kind": "row", "split_input": True},
    "replicated_with_grad_allreduce": {"kind": "replicated", "grad_sum": True},
    "mla_kv_a_proj": {"kind": "replicated", "rope_dim_key": "qk_rope_head_dim"},
    "replicate": {"kind": "replicated"},
    # The module's own parameters are plain local tensors, each split by a rule of its own
    # ("self_attn.sinks": "colwise"); nothing to do on the module itself.
    "local_params": {"kind": "replicated"},
}

_LAYER_KEYS = ("layers", "h", "blocks", "block", "decoder_layers")


def has_hf_plan(config: Mapping[str, Any]) -> bool:
    """Whether a Hugging Face config dict carries a tensor- or pipeline-parallel plan."""
    return bool(config.get("base_model_tp_plan") or config.get("base_model_pp_plan"))


def _blocks_key(tp_plan: Mapping[str, str], pp_plan: Mapping[str, Any], found: Optional[str] = None) -> str:
    """The base model's attribute holding its blocks: the pipeline plan's middle entry, else the first
    name that the tensor-parallel plan's block patterns (``<name>.*.``) start with, else ``found`` (the
    base model's one list of ``num_hidden_layers`` modules, as the caller found it on the model)."""
    for key in pp_plan:
        if key in _LAYER_KEYS:
            return key
    for pattern in tp_plan:
        head, sep, _ = pattern.partition(".*.")
        if sep and "." not in head:
            return head
    if found:
        return found
    raise ConfigError(f"the model's plans name no blocks (pipeline plan {list(pp_plan)}, "
                      f"tensor-parallel plan {list(tp_plan)[:4]}...) and its base model has no single list "
                      f"of config.num_hidden_layers blocks")


def _strip(pattern: str, base: str) -> str:
    return pattern[len(base) + 1:] if base and pattern.startswith(base + ".") else pattern


def hf_family(config: Mapping[str, Any], *, base: str, head_plan: Optional[Mapping[str, str]] = None,
              user_plan: Optional[Mapping[str, Optional[str]]] = None,
              found: Optional[Mapping[str, Optional[str]]] = None) -> FamilyRules:
    """The rules of a Hugging Face causal LM from its config dict (``config.to_dict()``).

    ``base`` is the base model's attribute (``model.base_model_prefix``, e.g. "model");
    ``head_plan`` the model class's ``_tp_plan`` (``{"lm_head": ...}``); ``user_plan``
    entries (patterns relative to the base model, or prefixed with ``base``) override
    the model's (``None`` or "replicate" keeps a module whole). ``found`` names the base
    model's ``"blocks"``, ``"embed"`` and ``"norm"`` attributes as read off the model itself;
    they stand in where the pipeline plan (or, for the blocks, the tensor-parallel plan) does
    not name them (configs with a tensor-parallel plan only; a final norm not called "norm").
    """
    model_type = str(config.get("model_type", "?"))
    tp_plan: dict[str, str] = dict(config.get("base_model_tp_plan") or {})
    pp_plan: Mapping[str, Any] = config.get("base_model_pp_plan") or {}
    for pattern, style in (user_plan or {}).items():
        if not isinstance(pattern, str) or not (style is None or isinstance(style, str)):
            raise ConfigError(f"tp_plan maps module patterns to style names, got {pattern!r}: {style!r}")
        tp_plan[_strip(pattern, base)] = style or "replicate"
    if not tp_plan and not pp_plan:
        raise ConfigError(f"model_type {model_type!r} has no base_model_tp_plan or base_model_pp_plan in its "
                          f"config; give parallelize(..., tp_plan={{...}}) or use data parallelism / ZeRO")
    found = found or {}
    blocks = _blocks_key(tp_plan, pp_plan, found.get("blocks"))
    pp_keys = list(pp_plan)
    embed_key = pp_keys[0] if pp_keys and pp_keys[0] != blocks else (found.get("embed") or "embed_tokens")
    norm_key = pp_keys[-1] if len(pp_keys) > 1 and pp_keys[-1] != blocks else (found.get("norm") or "norm")
    rules, unsupported, outside = [], [], []
    prefix = f"{blocks}.*."
    for pattern, style in tp_plan.items():
        if not pattern.startswith(prefix):
            outside.append((pattern, style))
            continue
        if style not in STYLES:
            unsupported.append((pattern, style))
            continue
        rules.append(SplitRule(pattern[len(prefix):], style=style, **STYLES[style]))
    for pattern, style in (head_plan or {}).items():
        outside.append((pattern, style))
    heads = any(r.kind == "column" and not r.gather_output for r in rules)
    origin = "the model's own plan (config.base_model_tp_plan"
    origin += f" + {len(user_plan)} of tp_plan=)" if user_plan else ")"
    return FamilyRules(
        family=model_type, blocks=f"{base}.{blocks}" if base else blocks,
        embed=(f"{base}.{embed_key}" if base else embed_key,),
        final=(f"{base}.{norm_key}" if base else norm_key, "lm_head"),
        rules=tuple(rules), head_keys=("num_attention_heads", "num_key_value_heads") if heads else (),
        source=f"{origin}, {len(rules)} block rules)", generic=True, unsupported=tuple(unsupported),
        outside=tuple(outside))


def describe_rules(rules: FamilyRules) -> list[str]:
    """Lines for people: where the rules came from, each block rule, and what is kept whole or refused."""
    lines = [f"tensor/pipeline rules for {rules.family}: {rules.source or 'shardwise'}",
             f"  blocks: {rules.blocks}; before them {', '.join(rules.embed)}; after them {', '.join(rules.final)}"]
    for rule in rules.rules:
        lines.append(f"  {rules.blocks}.*.{rule.path}: {rule.style or rule.kind}"
                     + (f" (fused, {rule.parts} parts)" if rule.parts > 1 else ""))
    for pattern, style in rules.outside:
        lines.append(f"  {pattern}: {style} -> kept whole (vocab_parallel splits the token table and head)")
    for pattern, style in rules.unsupported:
        lines.append(f"  {pattern}: {style} -> not implemented by shardwise (refused at tp > 1)")
    return lines
