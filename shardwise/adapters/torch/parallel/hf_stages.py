"""Stages of any Hugging Face causal LM, computed by the model's own code.

A pipeline stage, an activation-checkpointed block or a ZeRO-3 unit needs the model
as a sequence of modules taking one tensor each. A Hugging Face base model does more
than run its blocks one after the other: before them it scales the embeddings
(Gemma), builds the causal and sliding-window masks of each layer type and the
rotary embeddings (one per layer type in Gemma 3), and it hands each block those as
keyword arguments. Rather than re-implementing that per family, these stages run the
base model's own ``forward``:

* :class:`HFEmbed` runs it on the token ids and stops it at the first block, whose
  input is the stage's output;
* :class:`HFBlock` calls one block with the keyword arguments the base model gives
  that block, recorded by running the base model's ``forward`` on zeros of the
  hidden state's shape with stand-ins for the blocks (:class:`BlockArguments`; they
  depend on the shape only, so they are cached per shape);
* :class:`HFHead` is the final norm, the LM head and the logits' scaling or
  soft-capping of the families that have one (Gemma 2/3, Cohere, Granite).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import nn

from ....core.errors import ConfigError

__all__ = ["HFEmbed", "HFBlock", "HFHead", "BlockArguments", "hf_stages"]


class _Stop(Exception):
    """Raised by a stand-in block to end the base model's forward early."""

    def __init__(self, hidden: Optional[torch.Tensor] = None) -> None:
        super().__init__("stop")
        self.hidden = hidden


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _Indexed(TypeError):
    """A block was handed the first row of the previous stand-in's output: the base model indexes its
    blocks' outputs (``layer(...)[0]``), so the stand-ins must return ``(hidden, None)``."""


class _StandIn(nn.Module):
    """Stands in for block ``index``: records its keyword arguments, and stops after the last block.
    Attributes the base model reads from its blocks (``attention_type``) come from the real one."""

    def __init__(self, block: nn.Module, index: int, last: bool, record: list, pair: bool = False,
                 shape: Optional[tuple[int, ...]] = None) -> None:
        super().__init__()
        self._real = [block]
        self._index, self._last, self._record = index, last, record
        self._shape = shape  # the embeddings' shape: what a stage hands the next one
        self._pair = pair  # return (hidden, None): a base model that unpacks its blocks' outputs (Bamba)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"][0], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1:  # e.g. Gemma 3n's per-layer inputs, computed from the token ids
            raise ConfigError(f"the base model passes block {self._index} {len(args) - 1} more positional "
                              f"argument(s) than the hidden state: its blocks cannot run as stages of their own")
        hidden = _hidden_of(args, kwargs)
        if self._shape is not None and tuple(hidden.shape) != tuple(self._shape):
            if not self._pair and self._index > 0 and tuple(hidden.shape) == tuple(self._shape[1:]):
                raise _Indexed()  # the base model took [0] of the previous block's output (Falcon-H1)
            raise ConfigError(f"the base model hands block {self._index} a hidden state of shape "
                              f"{tuple(hidden.shape)}, not the embeddings' {tuple(self._shape)} (e.g. "
                              f"hyper-connection streams): its blocks cannot run as stages of their own")
        called = sum(r is not None for r in self._record)
        if called != self._index:  # Dory's recurrent loop runs its middle blocks twice
            raise ConfigError(f"the base model calls block {self._index} where block {called} was due: it runs "
                              f"its blocks out of order or more than once (a loop over them), so its blocks "
                              f"cannot run as stages of their own")
        self._record[self._index] = kwargs
        if self._last:
            raise _Stop()
        return (hidden, None) if self._pair else hidden


class BlockArguments:
    """The keyword arguments the base model gives each of its blocks, per hidden-state shape."""

    def __init__(self, base: nn.Module, blocks_attr: str, num_blocks: int) -> None:
        self._base = [base]  # not a submodule: its parameters belong to the stages
        self._attr, self._count = blocks_attr, num_blocks
        self._cache: dict[tuple, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        #: Whether the stand-ins return ``(hidden, None)``: found by the first recording.
        self._pair: Optional[bool] = None

    def __call__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> dict[str, Any]:
        key = (tuple(shape), dtype, str(device))
        found = self._cache.get(key)
        if found is None:
            with self._lock:
                found = self._cache.get(key) or self._record(shape, dtype, device)
                if len(self._cache) >= 8:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = found
        return found[index]

    def probe(self, model: nn.Module) -> None:
        """Record the arguments of a 1 x 2 hidden state now, so that a family whose blocks cannot run on
        their own is refused where the model is parallelized, on every rank alike."""
        hidden = getattr(model.config, "hidden_size", None)
        tensors = [*model.buffers(), *model.parameters()]
        real = [t for t in tensors if not t.is_meta]
        device = real[0].device if real else torch.device("cpu")
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        if not isinstance(hidden, int):
            raise ConfigError(f"{type(model).__name__}: config.hidden_size is {hidden!r}")
        try:
            self(0, (1, 2, hidden), dtype, device)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the family's own forward is a refusal
            raise ConfigError(f"{type(model).__name__}: its base model's forward fails when its blocks are "
                              f"called as stages ({type(exc).__name__}: {exc})") from exc
        self._cache.clear()

    @torch.no_grad()
    def _record(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[dict[str, Any]]:
        if self._pair is not None:
            return self._record_as(shape, dtype, device, self._pair)
        try:
            found = self._record_as(shape, dtype, device, False)
            self._pair = False
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:  # e.g. "not enough values to unpack": blocks return pairs
            try:
                found = self._record_as(shape, dtype, device, True)
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                raise exc from None
            self._pair = True
        return found

    def _record_as(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   pair: bool) -> list[dict[str, Any]]:
        base = self._base[0]
        real = getattr(base, self._attr)
        _install_output_hooks(base)
        record: list[Optional[dict[str, Any]]] = [None] * self._count
        stand_ins = nn.ModuleList(_StandIn(b, i, i == self._count - 1, record, pair, tuple(shape))
                                  for i, b in enumerate(real))
        base._modules[self._attr] = stand_ins  # no setattr: the real blocks keep their parents
        try:
            base(inputs_embeds=torch.zeros(shape, dtype=dtype, device=device), use_cache=False)
        except _Stop:
            pass
        finally:
            base._modules[self._attr] = real
        if any(r is None for r in record):
            missing = [i for i, r in enumerate(record) if r is None]
            raise ConfigError(f"{type(base).__name__}.forward did not call blocks {missing}: its blocks cannot "
                              f"run as pipeline stages")
        return [dict(r) for r in record]  # type: ignore[arg-type]


def _install_output_hooks(base: nn.Module) -> None:
    """Hugging Face's output-capturing hooks (router logits, ...) on the real blocks, before stand-ins
    replace them: transformers installs them once, at the base model's first forward, on whatever
    modules it holds then (a model whose first forward was the probe's recorded no router logits)."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without output capturing records nothing this way
        return
    if getattr(type(base), "_can_record_outputs", None) is not None or getattr(base, "_can_record_outputs", None):
        maybe_install_capturing_hooks(base)


class HFEmbed(nn.Module):
    """Token ids -> the first block's input, as the base model computes it (embedding, scaling, ...).

    Its submodules are the base model's parts before the blocks (the token table and any other
    table or projection there), so they are this stage's parameters and nothing else is.
    """

    def __init__(self, base: nn.Module, blocks_attr: str, skip: tuple[str, ...]) -> None:
        super().__init__()
        self._base = [base]
        self._attr = blocks_attr
        self.parts = nn.ModuleDict({name: m for name, m in base.named_children()
                                    if name != blocks_attr and name not in skip})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        base = self._base[0]
        first = getattr(base, self._attr)[0]

        def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
            raise _Stop(_hidden_of(args, kwargs))

        handle = first.register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
        try:
            base(input_ids=ids, use_cache=False)
        except _Stop as stopped:
            return stopped.hidden  # type: ignore[return-value]
        finally:
            handle.remove()
        raise ConfigError(f"{type(base).__name__}.forward never reached its first block")


class HFBlock(nn.Module):
    """One block on a hidden state, with the keyword arguments its base model would give it."""

    def __init__(self, block: nn.Module, index: int, arguments: BlockArguments) -> None:
        super().__init__()
        self.block = block
        self._index = index
        self._arguments = [arguments]
        #: Ranks the sequence is split over (sequence parallelism): ``hidden`` holds 1/parts of it.
        self.sequence_parts = 1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = (hidden.shape[0], hidden.shape[1] * self.sequence_parts, *hidden.shape[2:])
        kwargs = self._arguments[0](self._index, shape, hidden.dtype, hidden.device)
        out = self.block(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HFHead(nn.Module):
    """Final norm, LM head, and the family's logits scaling or soft-capping."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, model: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        config = model.config
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self._divide = getattr(config, "logits_scaling", None)  # Granite
        self._multiply = getattr(model, "logit_scale", None)  # Cohere
        if isinstance(self._multiply, nn.Parameter):
            raise ConfigError(f"{type(model).__name__}.logit_scale is a parameter: not supported in stages")
        self._width = getattr(config, "logits_mup_width_multiplier", None)  # Inkling: hidden / width
        unpadded = getattr(config, "unpadded_vocab_size", None)
        rows = getattr(lm_head, "out_features", None)
        if isinstance(unpadded, int) and (not isinstance(rows, int) or unpadded < rows):
            raise ConfigError(f"{type(model).__name__}: a head padded beyond unpadded_vocab_size={unpadded} is not "
                              "supported in stages")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(hidden)
        if isinstance(self._width, (int, float)):
            hidden = hidden / self._width
        logits = self.lm_head(hidden)
        if isinstance(self._multiply, (int, float)):
            logits = logits * self._multiply
        if isinstance(self._divide, (int, float)):
            logits = logits / self._divide
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits


def hf_stages(model: nn.Module, blocks_path: str, norm_path: str) -> tuple[list[nn.Module], list[bool]]:
    """The stages of a Hugging Face causal LM (``model.<base>.<blocks>``) and which are blocks."""
    base_name, _, attr = blocks_path.rpartition(".")
    try:
        base = model.get_submodule(base_name) if base_name else model
        layers = getattr(base, attr)
    except AttributeError as exc:
        raise ConfigError(f"{type(model).__name__} has no blocks at {blocks_path!r} ({exc})") from None
    count = len(layers)
    config = getattr(model, "config", None)
    limit = getattr(config, "num_hidden_layers", count)
    if isinstance(limit, int) and limit != count and getattr(config, "num_layers", None) != count:
        # (LongCat-Flash counts two sub-layers per block in num_hidden_layers, its blocks in num_layers)
        raise ConfigError(f"{type(model).__name__} has {count} blocks but config.num_hidden_layers={limit}")
    norm_attr = norm_path.rpartition(".")[2]
    arguments = BlockArguments(base, attr, count)
    arguments.probe(model)
    embed = HFEmbed(base, attr, skip=(norm_attr,))
    blocks = [HFBlock(b, i, arguments) for i, b in enumerate(layers)]
    try:
        norm, lm_head = model.get_submodule(norm_path), model.get_submodule("lm_head")
    except AttributeError as exc:
        raise ConfigError(f"{type(model).__name__}: no final norm {norm_path!r} or lm_head to end its last "
                          f"pipeline stage with ({exc})") from None
    head = HFHead(norm, lm_head, model)
    return [embed, *blocks, head], [False] + [True] * count + [False]
