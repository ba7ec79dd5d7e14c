"""A model as a list of stages (embedding, blocks, head) that run one after the other.

Pipeline splitting, per-block activation checkpointing and ZeRO-3 units all need
a model as a sequence of modules, each taking and returning one tensor. An
``nn.Sequential`` already is one. A Hugging Face causal LM (GPT-2, Llama and the
families of :data:`shardwise.core.tp_rules.FAMILIES`) is cut at the paths of its
family's rules: the embedding stage, one stage per transformer block, the final
norm and LM head. The stage modules share the model's layers (nothing is copied),
so they compute exactly what the model's own ``forward`` computes without a
padding mask (the causal mask is the attention's own).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from ....core.errors import ConfigError
from ....core.tp_rules import FamilyRules, rules_for

__all__ = ["StageStack", "model_family", "causal_lm_stages", "causal_lm_loss", "get_module", "set_module",
           "embedding_tables"]


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The submodule at dotted ``path`` (``"transformer.h"``)."""
    try:
        return root.get_submodule(path)
    except AttributeError as exc:
        raise ConfigError(f"{type(root).__name__} has no module {path!r}: {exc}") from None


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at dotted ``path``."""
    parent, _, name = path.rpartition(".")
    setattr(get_module(root, parent) if parent else root, name, module)


def model_family(model: nn.Module) -> Optional[FamilyRules]:
    """The rule table of a Hugging Face model (by ``config.model_type``); ``None`` for other modules."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return rules_for(model_type) if model_type is not None else None


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
    """One transformer block on a hidden state; rotary models get their position embeddings here."""

    def __init__(self, block: nn.Module, rotary: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.block = block
        self._rotary = [rotary]  # a list: not a submodule, so its buffers are not this stage's state
        #: Ranks the sequence is split over (sequence parallelism): ``hidden`` holds 1/parts of it.
        self.sequence_parts = 1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        rotary = self._rotary[0]
        if rotary is not None:
            pos = torch.arange(hidden.shape[1] * self.sequence_parts, device=hidden.device).unsqueeze(0)
            kwargs = {"position_embeddings": rotary(hidden, position_ids=pos), "position_ids": pos}
        out = self.block(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class StageStack(nn.Module):
    """Stages run in order; ``checkpoint[i]`` recomputes stage ``i`` in backward."""

    def __init__(self, stages: Sequence[nn.Module], checkpoint: Optional[Sequence[bool]] = None) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.checkpoint = list(checkpoint) if checkpoint is not None else [False] * len(self.stages)
        if len(self.checkpoint) != len(self.stages):
            raise ConfigError(f"{len(self.checkpoint)} checkpoint flags for {len(self.stages)} stages")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, ckpt in zip(self.stages, self.checkpoint):
            if ckpt and torch.is_grad_enabled():
                x = _checkpoint(stage, x, use_reentrant=False)
            else:
                x = stage(x)
        return x


def causal_lm_stages(model: nn.Module, rules: FamilyRules) -> tuple[list[nn.Module], list[bool]]:
    """The stages of a Hugging Face causal LM and, per stage, whether it is a transformer block."""
    if rules.family == "gpt2":
        embed: nn.Module = _PositionalEmbed(*(get_module(model, p) for p in rules.embed))
    else:
        embed = get_module(model, rules.embed[0])
    rotary = None
    if rules.family != "gpt2":
        rotary = get_module(model, rules.blocks.rpartition(".")[0] + ".rotary_emb")
    blocks = [_Block(b, rotary) for b in get_module(model, rules.blocks)]
    head = nn.Sequential(*(get_module(model, p) for p in rules.final))
    return [embed, *blocks, head], [False] + [True] * len(blocks) + [False]


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position ``t`` predicts token ``t + 1`` (Hugging Face's LM loss)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))
