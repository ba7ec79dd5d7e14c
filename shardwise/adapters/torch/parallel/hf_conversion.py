"""Hugging Face checkpoints whose keys differ from the model's, read slice by slice through transformers' own
conversion mapping.

transformers 5 keeps a Mixture-of-Experts layer's experts fused in memory
(``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) but
``save_pretrained`` and the hub write one tensor per expert (Mixtral's
``block_sparse_moe.experts.<e>.w1/w2/w3.weight``, Qwen3-MoE's and DeepSeek-V3's
``mlp.experts.<e>.gate_proj/up_proj/down_proj.weight``); ``from_pretrained`` converts
them with the model type's conversion mapping (``transformers.conversion_mapping``:
``WeightRenaming``, and ``WeightConverter`` with ``MergeModulelist`` then ``Concatenate``).

:func:`pretrained_source` takes that same mapping from the installed transformers
(:func:`transformers.conversion_mapping.get_model_conversion_mapping`), renames the
checkpoint's keys with transformers' own :func:`~transformers.core_model_loading.rename_source_key`,
and describes each converted tensor as a :class:`Stacked`: per source pattern, the
per-expert tensors stacked along one dim, the patterns concatenated along another.
A rank's piece of it (its experts at ep, its slice at tp) reads only the per-expert
tensors and rows it covers: no rank holds every expert. A converter with any other
operation is refused with a :class:`ConfigError` naming the keys.

:func:`export_names` goes the other way for ``save_pretrained``: one whole model
tensor to the keys and tensors transformers' own ``save_pretrained`` writes
(:func:`~transformers.core_model_loading.revert_weight_conversion`), so the export is
the hub's layout and ``from_pretrained`` reads it back equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from ....checkpoint.agree import stage_or_fail
from ....core.comm import Communicator
from ....core.errors import CheckpointError, ConfigError
from ....core.placement import Placement
from ..checkpoint.pieces import PiecesSource, StoredPiece
from .weights import PathLike, SafetensorsSource, hf_weight_files

__all__ = ["Stacked", "ConvertedSource", "pretrained_source", "persistent_buffers", "load_buffers", "export_tensors",
           "is_hf_model"]


@dataclass(frozen=True)
class Stacked:
    """Model tensor ``name`` made of checkpoint tensors: each part's keys (experts in order) stacked along
    ``stack_dim`` (None: a part is one key, taken as it is), the parts concatenated along ``concat_dim``
    (None: one part)."""

    name: str
    parts: tuple[tuple[str, ...], ...]
    stack_dim: Optional[int]
    concat_dim: Optional[int]


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (False without transformers installed)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _conversions(model: nn.Module) -> list[Any]:
    """transformers' load-time weight transforms of ``model`` (empty for a model transformers does not know)."""
    if not is_hf_model(model):
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor of every persistent buffer of ``model`` (those ``state_dict`` and ``save_pretrained``
    hold, e.g. DeepSeek-V3's ``e_score_correction_bias``)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.setdefault(f"{prefix}.{name}" if prefix else name, buf)
    return out


def _plan(model: nn.Module, stored: Iterable[str],
          expected: set[str]) -> tuple[dict[str, str], dict[str, Stacked]]:
    """(model name -> checkpoint key for a tensor stored whole, model name -> :class:`Stacked`) of the
    checkpoint keys ``stored``; keys already named as the model names them stay as they are."""
    stored = list(stored)
    renames = {k: k for k in stored if k in expected}
    rest = [k for k in stored if k not in expected]
    transforms = _conversions(model) if rest else []
    if not transforms:
        renames.update({k: k for k in rest})
        return renames, {}
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known = {name: True for name in expected}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(rest, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                            known)
        if pattern is None:
            if target in renames:
                raise ConfigError(f"checkpoint keys {renames[target]!r} and {key!r} both rename to {target!r}")
            renames[target] = key
            continue
        converter = by_pattern[pattern]
        entry = groups.setdefault(target, (converter, {}))
        if entry[0] is not converter:
            raise ConfigError(f"{target!r} is converted by two transforms of transformers' mapping")
        entry[1].setdefault(pattern, []).append(key)
    stacked: dict[str, Stacked] = {}
    refused = []
    for target, (converter, keys) in groups.items():
        ops = [type(op).__name__ for op in converter.operations]
        present = [p for p in converter.source_patterns if p in keys]
        shown = ", ".join(k for p in present for k in keys[p][:2])
        if ops == ["MergeModulelist"] and len(present) == 1:
            s = Stacked(target, (tuple(keys[present[0]]),), converter.operations[0].dim, None)
        elif ops == ["MergeModulelist", "Concatenate"]:
            s = Stacked(target, tuple(tuple(keys[p]) for p in present), converter.operations[0].dim,
                        converter.operations[1].dim)
        elif ops == ["Concatenate"] and all(len(keys[p]) == 1 for p in present):
            s = Stacked(target, tuple(tuple(keys[p]) for p in present), None, converter.operations[0].dim)
        else:
            refused.append(f"{target} from {shown} ... by {' + '.join(ops)}")
            continue
        if len(present) != len(converter.source_patterns):
            missing = [p for p in converter.source_patterns if p not in keys]
            raise CheckpointError(f"{target}: the checkpoint has {shown} ... but no key matching "
                                  f"{', '.join(missing)}")
        stacked[target] = s
    if refused:
        more = " ..." if len(refused) > 6 else ""
        raise ConfigError("weights=: transformers converts these checkpoint tensors with operations shardwise "
                          f"cannot read slice by slice: {'; '.join(refused[:6])}{more}")
    return renames, stacked


class ConvertedSource(SafetensorsSource):
    """A ``save_pretrained`` directory read under the model's names: tensors stored whole under another key
    (renamed) and tensors converted from several checkpoint tensors (:class:`Stacked`), plus the model's
    persistent buffers."""

    def __init__(self, files: Mapping[str, Path], renames: Mapping[str, str], stacked: Mapping[str, Stacked],
                 origin: str, buffers: Optional[Mapping[str, tuple[int, ...]]] = None) -> None:
        """``files``: checkpoint key -> file; ``renames``: model name -> checkpoint key of a whole tensor;
        ``stacked``: model name -> how it is made; ``buffers``: persistent buffer name -> shape."""
        PiecesSource.__init__(self, {name: ((), [StoredPiece(Path(files[key]), key, Placement(name, ()), 0, 0)])
                                     for name, key in renames.items()}, origin)
        self._stored = {k: Path(f) for k, f in files.items()}
        self.stacked = dict(stacked)
        self.buffers = dict(buffers or {})
        for name in self.stacked:
            self.files[name] = []
        self._part_shapes = {name: self._shapes_of(s) for name, s in self.stacked.items()}

    def _key_file(self, key: str) -> Any:
        return self._file(self._stored[key])

    def _shapes_of(self, s: Stacked) -> list[tuple[int, ...]]:
        """The shape of each part of ``s`` (its keys stacked), checked to agree."""
        shapes = []
        for keys in s.parts:
            each = {self._key_file(k).shape(k) for k in keys}
            if len(each) != 1:
                raise CheckpointError(f"{self.origin}: the tensors {keys[0]} ... making {s.name} differ in shape: "
                                      f"{sorted(each)}")
            shape = list(each.pop())
            if s.stack_dim is not None:
                shape.insert(s.stack_dim, len(keys))
            shapes.append(tuple(shape))
        if s.concat_dim is not None:
            rest = {sh[:s.concat_dim] + sh[s.concat_dim + 1:] for sh in shapes}
            if len(rest) != 1:
                raise CheckpointError(f"{self.origin}: {s.name} concatenates tensors of shapes {shapes} along dim "
                                      f"{s.concat_dim}")
        return shapes

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.stacked:
            return super().shape(name)
        shapes, c = self._part_shapes[name], self.stacked[name].concat_dim
        if c is None:
            return shapes[0]
        out = list(shapes[0])
        out[c] = sum(sh[c] for sh in shapes)
        return tuple(out)

    def dtype(self, name: str) -> torch.dtype:
        if name not in self.stacked:
            return super().dtype(name)
        key = self.stacked[name].parts[0][0]
        return self._key_file(key).dtype(key)

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> bool:
        return False if name in self.stacked else super().read_flat_into(name, start, out)

    def read_box(self, name: str, box: Iterable[slice]) -> torch.Tensor:
        """Box ``box`` of model tensor ``name``; of a :class:`Stacked` one, only the checkpoint tensors (experts)
        and rows the box covers are read."""
        s = self.stacked.get(name)
        if s is None:
            return super().read_box(name, box)
        full = self.shape(name)
        want = [sl.indices(n)[:2] for sl, n in zip(tuple(box) + (slice(None),) * len(full), full)]
        pieces, at = [], 0
        for keys, shape in zip(s.parts, self._part_shapes[name]):
            sub = list(want)
            if s.concat_dim is not None:
                c = s.concat_dim
                a, b = at, at + shape[c]
                at = b
                lo, hi = max(want[c][0], a), min(want[c][1], b)
                if lo >= hi:
                    continue
                sub[c] = (lo - a, hi - a)
            pieces.append(self._read_part(keys, s.stack_dim, sub))
        if not pieces:
            return torch.empty([b - a for a, b in want], dtype=self.dtype(name))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=s.concat_dim or 0)

    def _read_part(self, keys: tuple[str, ...], stack_dim: Optional[int], box: list[tuple[int, int]]) -> torch.Tensor:
        if stack_dim is None:
            return self._key_file(keys[0]).read(keys[0], tuple(slice(a, b) for a, b in box))
        (first, last), inner = box[stack_dim], box[:stack_dim] + box[stack_dim + 1:]
        slices = tuple(slice(a, b) for a, b in inner)
        return torch.stack([self._key_file(keys[e]).read(keys[e], slices) for e in range(first, last)], dim=stack_dim)

    def _shown(self, name: str) -> str:
        """``name`` with the checkpoint key(s) it is read from, where they differ."""
        if name in self.stacked:
            return f"{name} (from {self.stacked[name].parts[0][0]} ...)"
        key = self.files[name][0].name
        return name if key == name else f"{key} (read as {name})"

    def check(self, expected: Mapping[str, tuple[int, ...]], *, allow_extra: bool = False) -> None:
        """Raise :class:`CheckpointError` naming every missing, unexpected or mis-shaped tensor (by its checkpoint
        key); the model's persistent buffers count as expected where the checkpoint holds them."""
        expected = {**expected, **{n: s for n, s in self.buffers.items() if n in self.files}}
        missing = [n for n in expected if n not in self.files]
        extra = [] if allow_extra else [self._shown(n) for n in self.files if n not in expected]
        shaped = [f"{self._shown(n)} {self.shape(n)} (the model has {tuple(s)})" for n, s in expected.items()
                  if n in self.files and self.shape(n) != tuple(s)]
        problems = [f"{what} {', '.join(names[:8])}" + (" ..." if len(names) > 8 else "")
                    for what, names in (("missing", missing), ("unexpected", extra), ("shape differs for", shaped))
                    if names]
        if problems:
            raise CheckpointError(f"{self.origin} does not match the model: {'; '.join(problems)}")

    def buffer_values(self) -> dict[str, torch.Tensor]:
        """The checkpoint's value of every persistent buffer of the model it holds."""
        return {name: self.read_whole(name) for name in self.buffers if name in self.files}


def pretrained_source(directory: PathLike, model: nn.Module, comm: Optional[Communicator] = None) -> "ConvertedSource":
    """Collective over ``comm``: the weight source of ``parallelize(..., weights=directory)`` for ``model``
    (before any split): the checkpoint's tensors under ``model``'s names, converted as transformers'
    ``from_pretrained`` would. A read that fails on any rank raises the same :class:`CheckpointError` on
    every rank; a conversion shardwise cannot read slice by slice is a :class:`ConfigError` on every rank
    (each rank plans from the same keys)."""
    where = f"weights {directory}"
    files = stage_or_fail(comm, lambda: hf_weight_files(directory), where)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = persistent_buffers(model)
    renames, stacked = _plan(model, files, expected | set(buffers))
    shapes = {n: tuple(b.shape) for n, b in buffers.items()}
    return stage_or_fail(comm, lambda: ConvertedSource(files, renames, stacked, str(directory), shapes), where)


@torch.no_grad()
def load_buffers(model: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Set ``model``'s persistent buffers named in ``values`` (a meta one is replaced, any other copied into)."""
    for name, buf in persistent_buffers(model).items():
        if name not in values:
            continue
        value = values[name]
        if tuple(value.shape) != tuple(buf.shape):
            raise CheckpointError(f"buffer {name}: shape {tuple(value.shape)} in the checkpoint, the model has "
                                  f"{tuple(buf.shape)}")
        if buf.is_meta:
            prefix, _, leaf = name.rpartition(".")
            module = model.get_submodule(prefix) if prefix else model
            module._buffers[leaf] = value.to(dtype=buf.dtype)
        else:
            buf.copy_(value)


def export_tensors(model: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keys and tensors transformers' ``save_pretrained`` writes for ``model``'s whole tensor ``name``
    (per-expert tensors for fused experts, renamed keys), by its own ``revert_weight_conversion``;
    ``{name: tensor}`` for a model transformers does not convert. A meta ``tensor`` gives the names and shapes."""
    if not is_hf_model(model):
        return {name: tensor}
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, {name: tensor}))

