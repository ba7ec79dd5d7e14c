"""Context parallelism for Hugging Face models: the attention function and the batch split.

:class:`ContextParallel` registers one attention function with transformers'
``AttentionInterface`` and points the model's ``config._attn_implementation`` at it, so
every family whose attention goes through that interface (Llama, Qwen, Mistral, Gemma,
OLMo, Phi-3, ...) attends over the whole sequence of its context-parallel group by ring
attention or Ulysses. transformers builds no mask for an attention function it does not
know (the causal mask is the function's own, from the global positions), and the model is
run with the global ``position_ids`` of the rank's chunks, so RoPE rotates each chunk by
its true positions. :meth:`ContextParallel.split` cuts a batch into the rank's chunks and
its labels, shifted over the whole sequence first; :meth:`ContextParallel.loss` sums the
rank's token losses and divides them by the tokens of the group's whole sequences, so
the ranks' losses add up to the one-process mean.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .....core.comm import Communicator
from .....core.context_plan import CONTEXT_MODES, check_heads, chunk_plan, local_positions
from .....core.errors import ConfigError
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ContextParallel", "IGNORE_INDEX"]

#: Label of a position with no next token (Hugging Face's ignore index).
IGNORE_INDEX = -100
#: The name of the attention function in transformers' AttentionInterface.
ATTENTION_NAME = "shardwise_context_parallel"


def _dispatch(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered function: the :class:`ContextParallel` that installed itself on ``module``'s model."""
    context = getattr(module, "_shardwise_context", None)
    if context is None:
        raise ConfigError(f"{type(module).__name__} is set to {ATTENTION_NAME!r} attention but belongs to no "
                          "model that parallelize gave context parallelism (a config shared with such a model?)")
    return context.attention(module, *args, **kwargs)


class ContextParallel:
    """This rank's part of a context-parallel group: its attention function, batch split and loss."""

    def __init__(self, comm: Communicator, mode: str = "ring") -> None:
        if mode not in CONTEXT_MODES:
            raise ConfigError(f"context-parallel attention must be one of {CONTEXT_MODES}, got {mode!r}")
        self.comm, self.mode = comm, mode
        #: Attention calls made through this object (a model that never calls it is refused).
        self.calls = 0

    # ------------------------------------------------------------------ model
    def install(self, model: nn.Module, tp: int = 1) -> None:
        """Route ``model``'s attention through this object; :class:`ConfigError` if its family does not use
        transformers' attention interface or its attention cannot be split here (``tp``: the tensor-parallel
        degree the heads are split by first)."""
        config = getattr(model, "config", None)
        if config is None or not getattr(model, "_supports_attention_backend", False):
            raise ConfigError(f"context parallelism replaces the attention through transformers' "
                              f"AttentionInterface; {type(model).__name__} does not use it")
        for key in ("sliding_window", "attn_logit_softcapping"):
            if getattr(config, key, None):
                raise ConfigError(f"context parallelism does not support {key}={getattr(config, key)!r} "
                                  f"({getattr(config, 'model_type', type(model).__name__)}) yet")
        if getattr(config, "attention_dropout", 0.0):
            raise ConfigError(f"context parallelism needs attention_dropout=0, got {config.attention_dropout}")
        heads = getattr(config, "num_attention_heads", None)
        if self.mode == "ulysses" and isinstance(heads, int):
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            if heads % tp:
                raise ConfigError(f"tp={tp} does not divide the {heads} attention heads")
            check_heads(heads // tp, max(kv_heads // tp, 1), self.comm.size)
        from transformers import AttentionInterface

        for module in model.modules():  # the attention modules find their group here (a config may be shared)
            module._shardwise_context = self
        AttentionInterface.register(ATTENTION_NAME, _dispatch)
        model.set_attn_implementation(ATTENTION_NAME)

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        """transformers' attention signature: ``[b, h, s, d]`` in, ``[b, s, h, d]`` out."""
        self.calls += 1
        if attention_mask is not None:
            raise ConfigError("context parallelism got an attention mask: padding masks are not supported yet")
        if dropout:
            raise ConfigError(f"context parallelism needs attention dropout 0, got {dropout}")
        for name in ("sliding_window", "softcap", "s_aux"):
            if kwargs.get(name) is not None:
                raise ConfigError(f"context parallelism does not support the attention's {name} yet")
        if not getattr(module, "is_causal", True):
            raise ConfigError(f"{type(module).__name__} is not causal: context parallelism splits causal "
                              "attention only")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        fn = ring_attention if self.mode == "ring" else ulysses_attention
        out = fn(query, key, value, self.comm, scale)
        return out.transpose(1, 2).contiguous(), None

    # ------------------------------------------------------------------ batch
    def positions(self, seq_len: int, device: Any = None) -> torch.Tensor:
        """This rank's global positions (head chunk, tail chunk) of a ``seq_len`` sequence."""
        return torch.tensor(local_positions(seq_len, self.comm.size, self.comm.rank), device=device)

    def split(self, inputs: torch.Tensor,
              targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, position_ids, labels)`` of this rank's chunks of ``[batch, seq]`` token ids; the labels are
        the next tokens of the whole sequence (``targets`` shifted by one, the last position ignored)."""
        if inputs.dim() != 2:
            raise ConfigError(f"context parallelism takes [batch, seq] token ids, got shape {tuple(inputs.shape)}")
        chunk_plan(inputs.shape[1], self.comm.size)
        pos = self.positions(inputs.shape[1], inputs.device)
        labels = torch.cat([targets[:, 1:], torch.full_like(targets[:, :1], IGNORE_INDEX)], dim=1)
        position_ids = pos.unsqueeze(0).expand(inputs.shape[0], -1)
        return inputs[:, pos], position_ids, labels[:, pos]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, seq_len: int) -> torch.Tensor:
        """This rank's share of the group's mean next-token loss, times ``cp``: averaged over the data-parallel
        ranks (as gradients are), the ranks' shares give the mean over every token of the global batch."""
        vocab = logits.shape[-1]
        total = F.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                reduction="sum")
        tokens = labels.shape[0] * (seq_len - 1)
        return total * (self.comm.size / tokens)
