"""Sharded Keras 3 checkpoints: each rank writes what it holds; any rank count, stage or backend loads it.

Typical use (every rank)::

    import shardwise.keras as hvd
    model.fit(..., callbacks=[hvd.callbacks.ShardedCheckpoint("run/ckpts")])    # or save_checkpoint(model, ...)
    info = hvd.load_checkpoint(model, "run/ckpts")        # newest complete one; before or after compile/fit
    model.fit(..., initial_epoch=info.epoch)
    hvd.consolidate_checkpoint("run/ckpts", "model.keras")  # one process: a plain .keras file

A checkpoint is a ``<directory>/ckpt-<step>/`` of :mod:`shardwise.checkpoint.store`:
one ``rank-RRRRR-of-NNNNN.npz`` per rank (written atomically), then the manifest,
written by rank 0 once every rank's file is on disk, with each file's size and
SHA-256 and this module's metadata: every model variable's path, shape and dtype,
the optimizer's slot names per variable, its iterations, learning rate and
loss-scale state, the model's Keras config (for :func:`consolidate_checkpoint`
and :func:`load_model_from_checkpoint`), and where each tensor's flat ranges lie
(:mod:`shardwise.checkpoint.flat`). A save interrupted at any point leaves the
earlier checkpoints as they were and a step directory without manifest, which
loading skips. Every rank must see the directory (one node or a shared filesystem).

What a rank writes and reads is :mod:`.sharded_state`'s: its ZeRO shards at
stages 1-3, an even slice of replicated values, so a checkpoint written with
``ZeroOptimizer(stage=1)`` on 4 torch ranks resumes with ``stage=2``, ``stage=3``
or ``DistributedOptimizer`` on 2 JAX ranks, bit for bit.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import keras
import numpy as np

from ...checkpoint.agree import stage_or_fail
from ...checkpoint.atomic import fsync_dir
from ...checkpoint.flat import FlatReader, FlatTensor, merge_tables
from ...checkpoint.manifest import MANIFEST_NAME, read_manifest
from ...checkpoint.store import (Checkpoint, check_file_sizes, check_format, latest_checkpoint, list_checkpoints,
                                 save_checkpoint as save_files)
from ...core.comm import Communicator
from ...core.errors import CheckpointError
from .bridge import backend_name
from .callbacks import sync_backend_state
from .hooks import find_distributed_optimizer
from .optimizer import DistributedOptimizer
from .sharded_state import TrainingState, describe_variables
from .slots import base_optimizer
from .zero import ZeroOptimizer

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate_checkpoint", "load_model_from_checkpoint",
           "CheckpointInfo", "is_sharded_checkpoint"]

FORMAT = "shardwise-keras-sharded"
VERSION = 1
PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that was loaded: its directory, step (optimizer iterations) and where training stood."""

    path: Path
    step: int
    epoch: int
    batch: int
    metadata: dict


def _file_name(rank: int, size: int) -> str:
    return f"rank-{rank:05d}-of-{size:05d}.npz"


def _comm(model: Any, comm: Optional[Communicator]) -> Optional[Communicator]:
    """``comm``, else the distributed optimizer's, else the world if shardwise is initialized, else None."""
    if comm is not None:
        return comm
    dist = find_distributed_optimizer(model)
    if dist is not None and dist._comm is not None:
        return dist._comm
    import shardwise

    return shardwise.current().world if shardwise.is_initialized() else None


def _portable(config: Any) -> Any:
    """A Keras config that deserializes on every backend: built-in optimizers are saved under a
    backend module (``keras.src.backend.torch.optimizers...``), which would bring torch's class to JAX."""
    if isinstance(config, dict):
        out = {k: _portable(v) for k, v in config.items()}
        if str(out.get("module", "")).startswith("keras.src.backend.") and "class_name" in out:
            out["module"], out["registered_name"] = "keras.optimizers", None
        return out
    if isinstance(config, list):
        return [_portable(v) for v in config]
    return config


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON data")


def _config(obj: Any) -> Optional[dict]:
    """``obj``'s portable Keras serialization as JSON data, or None when it has none."""
    try:
        raw = keras.saving.serialize_keras_object(obj)
        return _portable(json.loads(json.dumps(raw, default=_jsonable)))
    except (NotImplementedError, TypeError, ValueError):
        return None


def save_checkpoint(model: keras.Model, directory: PathLike, step: Optional[int] = None, *,
                    include_optimizer: bool = True, keep: Optional[int] = None, epoch: int = 0, batch: int = 0,
                    comm: Optional[Communicator] = None) -> Path:
    """Write ``model``'s (and its optimizer's) state to ``<directory>/ckpt-<step>/``; collective.

    ``step`` defaults to the optimizer's iterations; ``epoch`` and ``batch`` record
    where training stands (``epoch`` epochs done, ``batch`` batches into the next),
    returned by :func:`load_checkpoint`. ``keep`` prunes all but the newest ``keep``
    complete checkpoints. Returns the checkpoint's directory.
    """
    sync_backend_state(model)
    comm = _comm(model, comm)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    state = TrainingState(model, rank, size, with_optimizer=include_optimizer)
    pieces = state.write()
    tables = comm.allgather_object(pieces.table) if comm is not None and size > 1 else [pieces.table]
    tensors = merge_tables(tables)
    scalars = state.scalars()
    if step is None:
        step = int(scalars.get("iterations", 0))
    optimizer = None
    if state.optimizer is not None:
        optimizer = {"class": type(base_optimizer(state.optimizer)).__name__, "stage": state.stage,
                     "config": _config(base_optimizer(state.optimizer)), "slots": state.slot_table(),
                     "scalars": scalars}
    meta = {"format": FORMAT, "version": VERSION, "backend": backend_name(), "keras": keras.__version__,
            "position": {"epoch": int(epoch), "batch": int(batch)},
            "model": {"config": _config(model), "variables": describe_variables(state.variables)},
            "optimizer": optimizer, "tensors": {k: t.to_json() for k, t in tensors.items()}}
    arrays = pieces.arrays
    return save_files(directory, int(step), {_file_name(rank, size): lambda f: np.savez(f, **arrays)},
                      comm=comm if size > 1 else None, metadata=meta, keep=keep)


def is_sharded_checkpoint(path: PathLike) -> bool:
    """True when ``path`` is a checkpoint directory of this module or a directory of ``ckpt-<step>/`` ones."""
    path = Path(path)
    if not path.is_dir():
        return False
    return (path / MANIFEST_NAME).exists() or bool(list_checkpoints(path))


def _resolve(path: PathLike) -> Path:
    """The checkpoint ``path`` names: itself if it holds a manifest, else its newest complete ``ckpt-<step>/``."""
    path = Path(path)
    if (path / MANIFEST_NAME).exists() or not list_checkpoints(path):
        return path
    found = latest_checkpoint(path)
    if found is None:
        steps = [s for s, _ in list_checkpoints(path)]
        raise CheckpointError(f"{path} holds no complete, undamaged checkpoint (steps {steps} are incomplete or "
                              "damaged: interrupted saves)")
    return found


def _open(path: PathLike) -> tuple[Checkpoint, dict]:
    where = _resolve(path)
    manifest = read_manifest(where)
    meta = manifest.metadata
    check_format(meta, where, FORMAT, VERSION, "a sharded Keras checkpoint")
    check_file_sizes(where)
    return Checkpoint(where, manifest), meta


def _reader(ckpt: Checkpoint, meta: dict) -> FlatReader:
    size = ckpt.manifest.world_size
    tensors = {k: FlatTensor.from_json(v) for k, v in meta["tensors"].items()}
    return FlatReader(tensors, lambda r: np.load(ckpt.file(_file_name(r, size)), allow_pickle=False),
                      origin=str(ckpt.path))


def _info(ckpt: Checkpoint, meta: dict) -> CheckpointInfo:
    position = meta.get("position") or {}
    return CheckpointInfo(ckpt.path, ckpt.step, int(position.get("epoch", 0)), int(position.get("batch", 0)), meta)


def _restore(model: Any, ckpt: Checkpoint, meta: dict, include_optimizer: Optional[bool], rank: int,
             size: int, comm: Optional[Communicator] = None) -> None:
    """Read this rank's values into staging, agree over ``comm`` that every rank read its part, then assign
    (all or nothing: a failure on any rank raises the same error on every rank before any assignment)."""
    saved_opt = meta.get("optimizer")
    if include_optimizer is None:
        include_optimizer = saved_opt is not None
    if not model.built:
        build = (meta["model"].get("config") or {}).get("build_config")
        if not build:
            raise CheckpointError("the model is not built and the checkpoint has no build config: build it first")
        model.build_from_config(build)
    state = TrainingState(model, rank, size, with_optimizer=include_optimizer)

    def read() -> Callable[[], None]:
        reader = _reader(ckpt, meta)
        try:
            return state.stage_values(reader, meta["model"]["variables"], saved_opt["slots"] if saved_opt else None,
                                      saved_opt["scalars"] if saved_opt else {})
        finally:
            reader.close()

    stage_or_fail(comm, read, f"checkpoint {ckpt.path}")()


def load_checkpoint(model: keras.Model, path: PathLike, *, include_optimizer: Optional[bool] = None,
                    comm: Optional[Communicator] = None) -> CheckpointInfo:
    """Restore ``model`` (and its optimizer) from a checkpoint written at any rank count, stage or backend.

    ``path`` is a checkpoint directory or a directory of them (the newest complete
    one is taken). Collective when the model trains with a ZeroOptimizer. An
    optimizer not built yet is built first, as ``fit`` would. ``include_optimizer``:
    None restores the optimizer state when the checkpoint has it, True requires it,
    False takes the model's values only. A model whose variables do not match the
    checkpoint's is refused with :class:`~shardwise.CheckpointError`, naming them.
    """
    comm = _comm(model, comm)
    ckpt, meta = stage_or_fail(comm, lambda: _open(path), f"checkpoint {path}")
    sync_backend_state(model)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    _restore(model, ckpt, meta, include_optimizer, rank, size, comm)
    return _info(ckpt, meta)


def _model_from_config(meta: dict, where: Path, custom_objects: Optional[dict], optimizer_config: Any) -> Any:
    config = meta["model"].get("config")
    if config is None:
        raise CheckpointError(f"{where}: the model had no Keras config when saved (a subclassed model without "
                              "get_config): build it yourself and use load_checkpoint")
    config = copy.deepcopy(config)
    compile_config = config.get("compile_config")
    if compile_config is not None:
        if optimizer_config is False:
            config.pop("compile_config")
        elif optimizer_config is not None:
            compile_config["optimizer"] = optimizer_config
        if meta.get("backend") != backend_name() and isinstance(compile_config.get("jit_compile"), bool):
            compile_config["jit_compile"] = "auto"  # the saving backend's resolved choice
    objects = {"DistributedOptimizer": DistributedOptimizer, "ZeroOptimizer": ZeroOptimizer}
    objects.update(custom_objects or {})
    return keras.saving.deserialize_keras_object(config, custom_objects=objects)


def load_model_from_checkpoint(path: PathLike, *, custom_objects: Optional[dict] = None,
                               compression: Any = None) -> keras.Model:
    """Rebuild the saved model, compiled with the optimizer it was saved with, and restore its state.

    Collective. A plain optimizer comes back inside a :class:`DistributedOptimizer`
    (Horovod's ``hvd.load_model``); a ZeroOptimizer comes back with its stage, now
    sharded over this job's ranks.
    """
    ckpt, meta = _open(path)
    model = _model_from_config(meta, ckpt.path, custom_objects, None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and find_distributed_optimizer(model) is None:
        kwargs = {"compression": compression} if compression is not None else {}
        model.optimizer = DistributedOptimizer(optimizer, **kwargs)
    comm = _comm(model, None)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    _restore(model, ckpt, meta, None, rank, size, comm)
    return model


def consolidate_checkpoint(path: PathLike, out: PathLike, *, include_optimizer: bool = True,
                           custom_objects: Optional[dict] = None) -> Path:
    """Write a sharded checkpoint as one plain ``.keras`` file that ``keras.saving.load_model`` opens
    without shardwise: the model with its full values, compiled with the inner Keras optimizer
    (ZeRO's or ``DistributedOptimizer``'s) holding the consolidated state. One process; no collective.
    """
    out = Path(out)
    if out.suffix != ".keras":
        raise CheckpointError(f"consolidate_checkpoint writes a .keras file, got {str(out)!r}")
    ckpt, meta = _open(path)
    saved_opt = meta.get("optimizer")
    with_optimizer = include_optimizer and saved_opt is not None and saved_opt.get("config") is not None
    model = _model_from_config(meta, ckpt.path, custom_objects, saved_opt["config"] if with_optimizer else False)
    _restore(model, ckpt, meta, with_optimizer, 0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp.keras")
    try:
        model.save(tmp)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(out.parent)
    return out
