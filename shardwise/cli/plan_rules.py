"""Which split rules ``shardwise plan --model`` would use, and where each set comes from.

A ``config.json`` written by ``save_pretrained`` does not carry the model's own plans:
transformers keeps ``base_model_tp_plan``, ``base_model_pp_plan`` and ``base_model_ep_plan``
on the config class. They are read from the config dict when it has them, else from
transformers' config class of the ``model_type`` when transformers is installed.
GPT-2 has no plan of its own; shardwise's table splits its fused QKV projection.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["model_plans", "rule_lines"]

_PLAN_KEYS = ("base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan")

#: Hugging Face tensor-parallel styles that shardwise implements inside a block.
_BLOCK_STYLES = frozenset({"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
                           "replicated_with_grad_allreduce", "mla_kv_a_proj", "replicate"})
#: Styles outside the blocks that shardwise keeps whole (or splits by vocabulary with vocab_parallel).
_OUTSIDE_STYLES = frozenset({"embedding_rowwise", "embedding_colwise", "colwise_gather_output", "replicate"})
#: shardwise's own rule tables, where the model has no plan (or lacks what shardwise needs).
_OWN = {"gpt2": "shardwise's gpt2 rules (fused QKV split per part: c_attn, c_proj, c_fc, c_proj)"}


def model_plans(config: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The model's plans by key, and where they were read from (the config dict or transformers' class)."""
    found = {k: config[k] for k in _PLAN_KEYS if config.get(k)}
    if found:
        return found, "config"
    try:  # transformers keeps them on the config class, not in config.json
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return {}, "unknown (transformers is not installed and the config.json carries no plans)"
    try:
        cls = CONFIG_MAPPING[str(config.get("model_type"))]
    except KeyError:
        return {}, f"transformers {_version()} knows no model_type {config.get('model_type')!r}"
    return {k: dict(getattr(cls, k)) for k in _PLAN_KEYS if getattr(cls, k, None)}, f"{cls.__name__}"


def _version() -> str:
    try:
        import transformers
    except ImportError:  # pragma: no cover - only called after an import of it succeeded
        return "?"
    return str(transformers.__version__)


def _styles(plan: Mapping[str, str]) -> str:
    counts: dict[str, int] = {}
    for style in plan.values():
        counts[str(style)] = counts.get(str(style), 0) + 1
    return ", ".join(f"{n} {style}" for style, n in counts.items())


def rule_lines(config: Mapping[str, Any], *, is_moe: bool = False) -> list[str]:
    """One line per rule set (tensor, pipeline, expert parallel): which rules apply and their source."""
    model_type = str(config.get("model_type"))
    plans, origin = model_plans(config)
    where = "config" if origin == "config" else f"{origin}"
    lines = []
    tp: Optional[Mapping[str, str]] = plans.get("base_model_tp_plan")
    if model_type in _OWN:
        lines.append(f"tensor-parallel rules: {_OWN[model_type]}")
    elif tp:
        outside = {p: s for p, s in tp.items() if ".*." not in p}
        inside = {p: s for p, s in tp.items() if ".*." in p}
        refused = sorted({s for s in inside.values() if s not in _BLOCK_STYLES}
                         | {s for s in outside.values() if s not in _OUTSIDE_STYLES})
        line = (f"tensor-parallel rules: the model's own plan ({where}.base_model_tp_plan, {len(tp)} rules: "
                f"{_styles(tp)})")
        if refused:
            line += f"; styles shardwise does not implement: {', '.join(refused)} (refused at tp > 1)"
        lines.append(line)
    else:
        lines.append(f"tensor-parallel rules: none ({origin if origin != 'config' else 'the config'} has no "
                     f"base_model_tp_plan): data parallelism and ZeRO need none; tp > 1 needs "
                     f"parallelize(..., tp_plan={{...}})")
    pp = plans.get("base_model_pp_plan")
    if model_type in _OWN:
        lines.append(f"pipeline rules: {_OWN[model_type].split(' (')[0]} (transformer.h cut into stages)")
    elif pp:
        lines.append(f"pipeline rules: the model's own plan ({where}.base_model_pp_plan: {', '.join(pp)})")
    if is_moe:
        ep = plans.get("base_model_ep_plan")
        if ep:
            lines.append(f"expert-parallel rules: the model's own plan ({where}.base_model_ep_plan, {len(ep)} "
                         f"rules: {_styles(ep)})")
        else:
            lines.append("expert-parallel rules: none in the model's plans (shardwise finds the experts "
                         "by their module layout)")
    return lines
