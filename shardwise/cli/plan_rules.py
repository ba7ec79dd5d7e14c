"""Which split rules ``shardwise plan --model`` would use, and where each set comes from.

A ``config.json`` written by ``save_pretrained`` does not carry the model's own plans:
transformers keeps ``base_model_tp_plan``, ``base_model_pp_plan`` and ``base_model_ep_plan``
on the config class. They are read from the config dict when it has them, else from
transformers' config class of the ``model_type`` when transformers is installed.
GPT-2 has no plan of its own; shardwise's table splits its fused QKV projection. The rules are
the ones ``parallelize`` builds (:func:`~shardwise.core.hf_plan.hf_family`,
:data:`~shardwise.core.tp_rules.FAMILIES`), so the styles it would refuse are named too.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..core.errors import ConfigError
from ..core.hf_plan import describe_rules, hf_family
from ..core.tp_rules import FAMILIES, FamilyRules

__all__ = ["model_plans", "rule_lines"]

_PLAN_KEYS = ("base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan")


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


def _rules(config: Mapping[str, Any], plans: Mapping[str, Any]) -> Optional[FamilyRules]:
    """The split rules parallelize would build (block paths relative to the base model), if any."""
    own = FAMILIES.get(str(config.get("model_type")).lower())
    if own is not None:
        return own
    try:
        return hf_family({**config, **plans}, base="")
    except ConfigError:
        return None


def rule_lines(config: Mapping[str, Any], *, is_moe: bool = False, detail: bool = False) -> list[str]:
    """One line per rule set (tensor, pipeline, expert parallel): which rules apply and their source;
    ``detail`` adds every rule (:func:`~shardwise.core.hf_plan.describe_rules`)."""
    model_type = str(config.get("model_type"))
    plans, origin = model_plans(config)
    where = "config" if origin == "config" else f"{origin}"
    lines = []
    tp: Optional[Mapping[str, str]] = plans.get("base_model_tp_plan")
    rules = _rules(config, plans)
    own = model_type.lower() in FAMILIES
    if own and rules is not None:
        lines.append(f"tensor-parallel rules: {rules.source}")
    elif tp:
        line = (f"tensor-parallel rules: the model's own plan ({where}.base_model_tp_plan, {len(tp)} rules: "
                f"{_styles(tp)})")
        refused = sorted({style for _, style in rules.unsupported}) if rules is not None else []
        if refused:
            line += f"; styles shardwise does not implement: {', '.join(refused)} (refused at tp > 1)"
        lines.append(line)
    else:
        lines.append(f"tensor-parallel rules: none ({origin if origin != 'config' else 'the config'} has no "
                     f"base_model_tp_plan): data parallelism and ZeRO need none; tp > 1 needs "
                     f"parallelize(..., tp_plan={{...}})")
    pp = plans.get("base_model_pp_plan")
    if own and rules is not None:
        lines.append(f"pipeline rules: {rules.source.split(' (')[0]} ({rules.blocks} cut into stages)")
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
    if detail and rules is not None:
        lines += describe_rules(rules)
    return lines
