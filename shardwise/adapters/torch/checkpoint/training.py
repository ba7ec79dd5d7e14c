"""Torch helpers for :mod:`shardwise.checkpoint`: atomic ``torch.save``, safe load, training state.

Loading always uses ``torch.load(..., weights_only=True)``: a checkpoint can hold
tensors, numbers, strings and containers, never arbitrary pickled objects.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ....checkpoint.atomic import PathLike, atomic_save
from ....checkpoint.state import capture_rng, check_mismatch, restore_rng
from ....checkpoint.store import latest_checkpoint, load_checkpoint, save_checkpoint
from ....core.comm import Communicator
from ....core.errors import CheckpointError

__all__ = ["save_torch", "load_torch", "check_state_dict", "save_training", "restore_training"]

_LOG = logging.getLogger("shardwise.checkpoint")
MODEL_FILE, OPTIMIZER_FILE = "model.pt", "optimizer.pt"


def _rng_file(rank: int) -> str:
    return f"rng-rank-{rank:05d}.json"


def save_torch(obj: Any, path: PathLike) -> None:
    """``torch.save`` to a temporary file in the same directory, then atomically rename it."""
    atomic_save(lambda f: torch.save(obj, f), path)


def load_torch(path: PathLike, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``; pickled objects beyond plain data are refused."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = re.search(r"WeightsUnpickler error: ([^\n]*?\.)(?: |$)", str(exc))
        raise CheckpointError(f"{path}: refused to load with weights_only=True, it holds pickled objects beyond "
                              f"tensors and plain containers" + (f" ({reason.group(1)})" if reason else "")) from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable torch file: {str(exc).splitlines()[0]}") from None


def _shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) if hasattr(v, "shape") else () for k, v in state.items()}


def check_state_dict(model: Any, state_dict: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointError` listing keys missing, unexpected or of another shape than ``model``'s."""
    expected = model.state_dict() if hasattr(model, "state_dict") else model
    check_mismatch(_shapes(expected), _shapes(state_dict))


def save_training(directory: PathLike, step: int, *, model: Any, optimizer: Any = None,
                  comm: Optional[Communicator] = None, position: Optional[Mapping[str, int]] = None,
                  metadata: Optional[Mapping[str, Any]] = None, keep: Optional[int] = None) -> Path:
    """Collective: rank 0 saves model and optimizer, every rank its RNG state; returns ``ckpt-<step>``.

    ``position`` (e.g. ``{"epoch": 1, "step": 40}``) is the data loader position to resume from.
    """
    rank = comm.rank if comm is not None else 0
    contents: dict[str, Any] = {_rng_file(rank): json.dumps(capture_rng()).encode()}
    if rank == 0:
        model_state = model.state_dict()
        contents[MODEL_FILE] = lambda f: torch.save(model_state, f)
        if optimizer is not None:
            opt_state = optimizer.state_dict()
            contents[OPTIMIZER_FILE] = lambda f: torch.save(opt_state, f)
    meta = {"position": dict(position or {}), "user": dict(metadata or {})}
    return save_checkpoint(directory, step, contents, comm=comm, metadata=meta, keep=keep)


def restore_training(directory: PathLike, *, model: Any, optimizer: Any = None,
                     comm: Optional[Communicator] = None, strict: bool = True) -> Optional[dict[str, Any]]:
    """Collective: load the newest complete checkpoint into ``model``/``optimizer`` and restore RNGs.

    Returns ``{"step", "position", "metadata", "path"}``, or None when there is no
    checkpoint. Rank 0 picks the checkpoint so every rank resumes from the same one.
    With ``strict`` a model/checkpoint mismatch raises :class:`CheckpointError`.
    """
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    found = latest_checkpoint(directory) if rank == 0 else None
    if comm is not None:
        found = comm.broadcast_object(None if found is None else str(found), root=0)
    if found is None:
        return None
    ckpt = load_checkpoint(found, verify=False)  # each file is verified as it is read
    state = load_torch(ckpt.file(MODEL_FILE))
    if strict:
        check_state_dict(model, state)
    model.load_state_dict(state, strict=strict)
    if optimizer is not None and ckpt.has(OPTIMIZER_FILE):
        optimizer.load_state_dict(load_torch(ckpt.file(OPTIMIZER_FILE)))
    if ckpt.manifest.world_size == size and ckpt.has(_rng_file(rank)):
        restore_rng(json.loads(ckpt.read_bytes(_rng_file(rank))))
    else:
        _LOG.warning("checkpoint %s was written by %d ranks, this job has %d: RNG state not restored",
                     ckpt.path, ckpt.manifest.world_size, size)
    meta = ckpt.metadata
    return {"step": ckpt.step, "position": meta.get("position", {}), "metadata": meta.get("user", {}),
            "path": ckpt.path}
