"""Where a rank's tensors come from: a replayed initialisation or safetensors files, read slice by slice.

A source answers one question: this rank's piece of canonical tensor ``name`` (a
:class:`~shardwise.core.placement.Placement`). :class:`InitSource` replays the
model's own initialisation of that tensor and keeps the piece;
:class:`SafetensorsSource` reads only the piece's boxes from a ``save_pretrained``
directory (``model.safetensors`` or a sharded ``model.safetensors.index.json``),
reading only the rows of each box it needs (:mod:`shardwise.adapters.torch.checkpoint.pieces`), so
no rank reads a whole model. :func:`take` and :func:`merge` are the torch forms of
the placement's slicing and reassembly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Optional, Protocol, Union

import torch

from ..checkpoint.pieces import WholeTensorsSource
from ..checkpoint.safetensors_torch import TorchSafetensorsFile
from ....core.errors import CheckpointError
from ....core.placement import Placement
from .init_replay import InitRecord

__all__ = ["WeightSource", "InitSource", "SafetensorsSource", "DeferredFailures", "take", "merge", "hf_weight_files"]

PathLike = Union[str, "os.PathLike[str]"]


def take(full: torch.Tensor, placement: Placement) -> torch.Tensor:
    """This rank's piece of ``full`` (a copy, contiguous)."""
    if tuple(full.shape) != placement.full_shape:
        raise CheckpointError(f"{placement.name}: shape {tuple(full.shape)}, the model has {placement.full_shape}")
    if placement.dim is None:
        return full.clone()
    piece = torch.cat([full[box] for box in placement.boxes()], dim=placement.dim)
    return (piece.t() if placement.transpose else piece).contiguous()


def merge(pieces: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    """The full tensor from every group rank's piece, in rank order."""
    if not placement.sharded:
        return pieces[0].t() if placement.transpose else pieces[0]
    full = torch.empty(placement.full_shape, dtype=pieces[0].dtype)
    for r, piece in enumerate(pieces):
        piece = piece.t() if placement.transpose else piece
        at = 0
        for a, b in placement.ranges(r):
            full.narrow(placement.dim, a, b - a).copy_(piece.narrow(placement.dim, at, b - a))
            at += b - a
    return full


class WeightSource(Protocol):
    """Produces this rank's piece of a canonical tensor."""

    def local(self, placement: Placement, dtype: torch.dtype) -> torch.Tensor: ...


class InitSource:
    """The model's own initial values (see :mod:`.init_replay`), one tensor at a time."""

    def __init__(self, record: InitRecord) -> None:
        self.record = record

    def local(self, placement: Placement, dtype: torch.dtype) -> torch.Tensor:
        return take(self.record.full(placement.name), placement).to(dtype)


def hf_weight_files(directory: PathLike) -> dict[str, Path]:
    """Tensor name -> file of a ``save_pretrained`` directory (single or sharded safetensors)."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if single.is_file():
        with TorchSafetensorsFile(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{root} holds no model.safetensors nor model.safetensors.index.json")


class SafetensorsSource(WholeTensorsSource):
    """Pieces of tensors from safetensors files that hold them whole (a ``save_pretrained`` directory)."""

    @classmethod
    def from_pretrained_dir(cls, directory: PathLike) -> "SafetensorsSource":
        return cls(hf_weight_files(directory), str(directory))

    def check(self, expected: Mapping[str, tuple[int, ...]], *, allow_extra: bool = False) -> None:
        """Raise :class:`CheckpointError` naming every missing, unexpected or mis-shaped tensor."""
        missing = [n for n in expected if n not in self.files]
        extra = [] if allow_extra else [n for n in self.files if n not in expected]
        shaped = [f"{n} {self.shape(n)} (the model has {tuple(s)})" for n, s in expected.items()
                  if n in self.files and self.shape(n) != tuple(s)]
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if extra:
            problems.append(f"unexpected {', '.join(extra[:8])}" + (" ..." if len(extra) > 8 else ""))
        if shaped:
            problems.append(f"shape differs for {', '.join(shaped[:8])}")
        if problems:
            raise CheckpointError(f"{self.origin} does not match the model: {'; '.join(problems)}")

    def local(self, placement: Placement, dtype: torch.dtype) -> torch.Tensor:
        return self.read(placement.name, placement).to(dtype)



class DeferredFailures:
    """A weight source whose first failed read is kept for later instead of raised.

    A failed read answers zeros, so that a rank whose read failed still takes part in every
    collective of the build in step with the others; :attr:`failure` is then agreed between
    the ranks at the end (:func:`shardwise.checkpoint.agree.agree_loaded`), and every rank
    raises the same error instead of one rank raising and the others waiting for it.
    """

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner
        self.failure: Optional[BaseException] = None

    def local(self, placement: Placement, dtype: torch.dtype) -> torch.Tensor:
        if self.failure is None:
            try:
                return self.inner.local(placement, dtype)
            except Exception as exc:  # reported on every rank by the agreement after the build
                self.failure = exc
        return torch.zeros(placement.local_shape, dtype=dtype)
