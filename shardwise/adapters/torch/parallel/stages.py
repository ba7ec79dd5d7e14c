"""A model as a list of stages (embedding, blocks, head) that run one after the other.

Pipeline splitting, per-block activation checkpointing and ZeRO-3 units all need
a model as a sequence of modules, each taking and returning one tensor. An
``nn.Sequential`` already is one. A Hugging Face causal LM is cut at the paths of its
rules (its own plans, :mod:`shardwise.core.hf_plan`, or GPT-2's table in
:data:`shardwise.core.tp_rules.FAMILIES`): the embedding stage, one stage per
transformer block, the final norm and LM head. The stage modules share the model's
layers (nothing is copied), so they compute exactly what the model's own ``forward``
computes without a padding mask (:mod:`.hf_stages` for the families read from plans).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from ....core.errors import ConfigError
from ....core.hf_plan import has_hf_plan, hf_family
from ....core.tp_rules import FAMILIES, FamilyRules, rules_for
from .module_paths import get_module, matching_modules, set_module

__all__ = ["StageStack", "model_family", "causal_lm_stages", "causal_lm_loss",
           "embedding_tables", "WholeModel", "block_units", "enable_block_checkpointing"]


def model_family(model: nn.Module, tp_plan: Optional[Mapping[str, Optional[str]]] = None) -> Optional[FamilyRules]:
    """The rules of a Hugging Face model: shardwise's table for its ``model_type`` where it has one
    (GPT-2), else the model's own plans with ``tp_plan`` over them; ``None`` for other modules.

    :class:`ConfigError` for a Hugging Face model with neither.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None or not hasattr(config, "to_dict"):
        if tp_plan:
            raise ConfigError(f"tp_plan= needs a Hugging Face model (with a config); got {type(model).__name__}")
        return None
    if str(model_type).lower() in FAMILIES and not tp_plan:
        return rules_for(model_type)
    values = dict(config.to_dict())
    for key in ("base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan"):  # class attributes
        values.setdefault(key, getattr(config, key, None))
    if not has_hf_plan(values) and not tp_plan:
        return rules_for(model_type)  # the refusal names what is missing
    if getattr(model, "base_model_prefix", "") and not hasattr(model, "lm_head"):
        raise ConfigError(f"{type(model).__name__} is not a causal LM with an lm_head")
    base = base_model_attr(model)
    _check_user_plan(model, base, tp_plan or {})
    return hf_family(values, base=base, head_plan=getattr(model, "_tp_plan", None), user_plan=tp_plan,
                     found=hf_parts(model, base))


def hf_parts(model: nn.Module, base: str) -> dict[str, Optional[str]]:
    """The base model's attributes holding its blocks (its one ``nn.ModuleList`` of
    ``config.num_hidden_layers`` modules), token table (``get_input_embeddings()``) and final norm
    (its one other child whose class is a norm, or the one named "norm"); None where not one."""
    try:
        root = model.get_submodule(base) if base else model
    except AttributeError:
        return {"blocks": None, "embed": None, "norm": None}
    children = dict(root.named_children())
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    lists = [n for n, c in children.items() if isinstance(c, nn.ModuleList) and (layers is None or len(c) == layers)]
    blocks = lists[0] if len(lists) == 1 else None
    try:
        table = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError):
        table = None
    embed = next((n for n, c in children.items() if table is not None and c is table), None)
    norms = [n for n, c in children.items() if n not in (blocks, embed) and "norm" in type(c).__name__.lower()]
    norm = norms[0] if len(norms) == 1 else ("norm" if "norm" in norms else None)
    return {"blocks": blocks, "embed": embed, "norm": norm}


def base_model_attr(model: nn.Module) -> str:
    """The attribute holding a Hugging Face causal LM's base model: its ``base_model_prefix`` where
    the model has it, else the one child with a config other than the head (Llama 4's text model
    names its prefix ``language_model`` but keeps the base model in ``model``)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    bases = [name for name, child in model.named_children() if name != "lm_head" and hasattr(child, "config")]
    if len(bases) == 1:
        return bases[0]
    return prefix or "model"


def _check_user_plan(model: nn.Module, base: str, plan: Mapping[str, Optional[str]]) -> None:
    """:class:`ConfigError` for a ``tp_plan`` pattern that names no module of ``model``."""

    root = model.get_submodule(base) if base else model
    for pattern in plan:
        if not isinstance(pattern, str):
            raise ConfigError(f"tp_plan keys are module patterns, got {pattern!r}")
        inner = pattern[len(base) + 1:] if base and pattern.startswith(base + ".") else pattern
        if not matching_modules(root, inner) and not matching_modules(model, pattern):
            raise ConfigError(f"tp_plan pattern {pattern!r} names no module of {type(model).__name__} "
                              f"(patterns are dotted module names, '*' for any one name, e.g. "
                              f"'layers.*.self_attn.q_proj')")


class _PositionalEmbed(nn.Module):
    """GPT-2's input: token plus learned position embeddings, then dropout."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(pos))


def embedding_tables(stage: nn.Module) -> list[nn.Module]:
    """The separate tables of an embedding stage (GPT-2's token and position embeddings), else []."""
    return [stage.wte, stage.wpe] if isinstance(stage, _PositionalEmbed) else []


class _Block(nn.Module):
    """One GPT-2 block on a hidden state (its positions were added by the embedding stage)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        #: Ranks the sequence is split over (sequence parallelism): ``hidden`` holds 1/parts of it.
        self.sequence_parts = 1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class StageStack(nn.Module):
    """Stages run in order; ``checkpoint[i]`` recomputes stage ``i`` in backward."""

    def __init__(self, stages: Sequence[nn.Module], checkpoint: Optional[Sequence[bool]] = None) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.checkpoint = list(checkpoint) if checkpoint is not None else [False] * len(self.stages)
        if len(self.checkpoint) != len(self.stages):
            raise ConfigError(f"{len(self.checkpoint)} checkpoint flags for {len(self.stages)} stages")

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``kwargs`` (e.g. ``position_ids``) go to the first stage."""
        for i, (stage, ckpt) in enumerate(zip(self.stages, self.checkpoint)):
            extra = kwargs if i == 0 else {}
            if ckpt and torch.is_grad_enabled():
                x = _checkpoint(stage, x, use_reentrant=False, **extra)
            else:
                x = stage(x, **extra)
        return x


def causal_lm_stages(model: nn.Module, rules: FamilyRules) -> tuple[list[nn.Module], list[bool]]:
    """The stages of a Hugging Face causal LM and, per stage, whether it is a transformer block."""
    if rules.generic:
        from .hf_stages import hf_stages

        return hf_stages(model, rules.blocks, rules.final[0])
    embed = _PositionalEmbed(*(get_module(model, p) for p in rules.embed))
    blocks = [_Block(b) for b in get_module(model, rules.blocks)]
    head = nn.Sequential(*(get_module(model, p) for p in rules.final))
    return [embed, *blocks, head], [False] + [True] * len(blocks) + [False]


class WholeModel(nn.Module):
    """A model trained whole (no split rules): a Hugging Face model's logits, or any module's output."""

    def __init__(self, model: nn.Module, hf: bool) -> None:
        super().__init__()
        self.model, self._hf = model, hf

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._hf:
            if position_ids is not None:
                return self.model(input_ids=x, position_ids=position_ids, use_cache=False).logits
            return self.model(input_ids=x, use_cache=False).logits
        return self.model(x)


def block_units(model: nn.Module) -> list[nn.Module]:
    """ZeRO-3 units of a model trained whole: each element of its module lists (the blocks), and each
    other child holding parameters; what is left (the root's own parameters) is the root unit."""
    units: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                units.extend(c for c in child.children() if any(True for _ in c.parameters()))
            elif any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in child.modules()):
                walk(child)
            elif any(True for _ in child.parameters()):
                units.append(child)

    walk(model)
    return units


def enable_block_checkpointing(model: nn.Module) -> None:
    """Recompute each block in backward: Hugging Face's own gradient checkpointing (non-reentrant)."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"activation_checkpointing of a model trained whole needs a Hugging Face model that "
                          f"supports gradient checkpointing; {type(model).__name__} does not")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position ``t`` predicts token ``t + 1`` (Hugging Face's LM loss)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))
