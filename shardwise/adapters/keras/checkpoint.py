"""Sharded Keras 3 checkpoints: each rank writes what it holds; any rank count, stage or backend loads it.

Typical use (every rank)::

    import shardwise.keras as hvd
    model.fit(..., callbacks=[hvd.callbacks.ShardedCheckpoint("run/ckpts")])    # or save_checkpoint(model, ...)
    info = hvd.load_checkpoint(model, "run/ckpts")        # newest complete one; before or after compile/fit
    model.fit(..., initial_epoch=info.epoch)
    hvd.consolidate_checkpoint("run/ckpts", "model.keras")  # one process: a plain .keras file

A checkpoint is a ``<directory>/ckpt-<step>/`` of :func:`shardwise.checkpoint.save`'s one
format, ``"shardwise-state"``: one ``rank-RRRRR.safetensors`` per rank with the flat
element ranges of the variables and optimizer slots it holds (written atomically, each
1 MiB block checksummed), then the manifest, written by rank 0 once every rank's file is
on disk, with entry ``"model"`` of kind ``keras.model`` (:mod:`.checkpoint_state`): every
model variable's path, shape and dtype, the optimizer's slot names per variable, its
iterations, learning rate and loss-scale state, the model's Keras config (for
:func:`consolidate_checkpoint` and :func:`load_model_from_checkpoint`), and where each
piece lies. ``shardwise.checkpoint.save(dir, step, {"model": model})`` writes the same.
The model's sharded embedding layers (:class:`~.embedding.ShardedEmbeddingBag`: tables and
their optimizer state, outside Keras's variables) are saved beside it, as entries
``embeddings-<i>`` (the ``i``-th such layer of the model) of kind ``keras.sharded_embeddings``,
and loaded with it, on any plan and rank count (with ``shardwise.checkpoint.save``, name
such entries yourself). Loading reads with numpy alone (no torch on JAX or TensorFlow).
A save interrupted at any point leaves the earlier checkpoints as they were and a step
directory without manifest, which loading skips. Every rank must see the directory (one node or a shared
filesystem). Checkpoints of the earlier Keras format (``FORMAT``: one
``rank-RRRRR-of-NNNNN.npz`` per rank) still load, consolidate and show in
``shardwise checkpoint info``.

What a rank writes and reads is :mod:`.sharded_state`'s: its ZeRO shards at
stages 1-3, an even slice of replicated values, so a checkpoint written with
``ZeroOptimizer(stage=1)`` on 4 torch ranks resumes with ``stage=2``, ``stage=3``
or ``DistributedOptimizer`` on 2 JAX ranks, bit for bit.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import keras
import numpy as np

from ...checkpoint import door
from ...checkpoint.agree import stage_or_fail
from ...checkpoint.atomic import fsync_dir
from ...checkpoint.flat import FlatReader, FlatTensor, merge_tables
from ...checkpoint.manifest import MANIFEST_NAME, read_manifest
from ...checkpoint.store import (Checkpoint, check_file_sizes, check_format, latest_checkpoint, list_checkpoints,
                                 save_checkpoint as save_files)
from ...core.comm import Communicator
from ...core.errors import CheckpointError
from .bridges import backend_name
from .checkpoint_state import KERAS_MODEL, KerasModelState, declared_shapes, describe, model_comm, stage_model
from .embedding import ShardedEmbeddingBag
from .embedding.checkpoint import SHARDED_EMBEDDINGS, stage_tables
from .hooks import find_distributed_optimizer
from .ops import sync_backend_state
from .optimizer import DistributedOptimizer
from .sharded_state import TrainingState
from .zero.optimizer import ZeroOptimizer

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate_checkpoint", "load_model_from_checkpoint",
           "CheckpointInfo", "is_sharded_checkpoint"]

#: The earlier Keras format (per-rank ``.npz`` files), still read; new checkpoints are ``door.FORMAT``.
FORMAT = "shardwise-keras-sharded"
VERSION = 1
#: The name of the Keras entry that :func:`save_checkpoint` writes.
ENTRY = "model"
PathLike = Union[str, "os.PathLike[str]"]


def embedding_entries(model: Any) -> dict[str, ShardedEmbeddingBag]:
    """The model's sharded embedding layers by the name of their checkpoint entry, ``embeddings-<i>``
    (in the model's layer order, so that the names agree between processes whatever the layers are called)."""
    layers = model._flatten_layers(include_self=False, recursive=True) if hasattr(model, "_flatten_layers") else []
    found = [layer for layer in layers if isinstance(layer, ShardedEmbeddingBag)]
    return {f"embeddings-{i}": layer for i, layer in enumerate(found)}


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that was loaded: its directory, step (optimizer iterations), where training stood, and
    its Keras description (backend, model config and variables, optimizer)."""

    path: Path
    step: int
    epoch: int
    batch: int
    metadata: dict


def save_checkpoint(model: keras.Model, directory: PathLike, step: Optional[int] = None, *,
                    include_optimizer: bool = True, keep: Optional[int] = None, epoch: int = 0, batch: int = 0,
                    comm: Optional[Communicator] = None) -> Path:
    """Write ``model``'s (and its optimizer's) state to ``<directory>/ckpt-<step>/``; collective.

    ``step`` defaults to the optimizer's iterations; ``epoch`` and ``batch`` record
    where training stands (``epoch`` epochs done, ``batch`` batches into the next),
    returned by :func:`load_checkpoint`. ``keep`` prunes all but the newest ``keep``
    complete checkpoints. Returns the checkpoint's directory. The format is
    :func:`shardwise.checkpoint.save`'s, entry ``"model"`` of kind ``keras.model``.
    """
    comm = model_comm(model, comm)
    if step is None:
        sync_backend_state(model)
        rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
        state = TrainingState(model, rank, size, with_optimizer=include_optimizer)
        step = int(state.scalars().get("iterations", 0))
    spec = KerasModelState(model, include_optimizer, int(epoch), int(batch), comm)
    return door.save(directory, int(step), {ENTRY: spec, **embedding_entries(model)}, comm=comm, keep=keep)


def save_legacy_checkpoint(model: keras.Model, directory: PathLike, step: Optional[int] = None, *,
                           include_optimizer: bool = True, keep: Optional[int] = None, epoch: int = 0,
                           batch: int = 0, comm: Optional[Communicator] = None) -> Path:
    """:func:`save_checkpoint` in the earlier Keras format (``FORMAT``: per-rank ``.npz`` files), kept so
    that reading that format stays tested; new checkpoints should not use it."""
    sync_backend_state(model)
    comm = model_comm(model, comm)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    state = TrainingState(model, rank, size, with_optimizer=include_optimizer)
    pieces = state.write()
    tables = comm.allgather_object(pieces.table) if comm is not None and size > 1 else [pieces.table]
    tensors = merge_tables(tables)
    described = describe(state, model, epoch, batch)
    if step is None:
        step = int((described["optimizer"] or {}).get("scalars", {}).get("iterations", 0))
    meta = {"format": FORMAT, "version": VERSION, **described,
            "tensors": {k: t.to_json() for k, t in tensors.items()}}
    arrays = pieces.arrays
    return save_files(directory, int(step), {_file_name(rank, size): lambda f: np.savez(f, **arrays)},
                      comm=comm if size > 1 else None, metadata=meta, keep=keep)


def _file_name(rank: int, size: int) -> str:
    return f"rank-{rank:05d}-of-{size:05d}.npz"


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


@dataclass(frozen=True)
class _Opened:
    """A Keras checkpoint opened for reading: its directory, step, Keras description (``meta``: model,
    optimizer, position, backend), how to open a flat-range reader of its tensors, and its other entries
    (sharded embedding tables; none in the earlier format)."""

    path: Path
    step: int
    meta: dict
    reader: Callable[[], Any]
    entries: Callable[[], dict] = dict


def _keras_entry(meta: dict, where: Path) -> door.EntryView:
    """The one ``keras.model`` entry of a ``shardwise-state`` checkpoint."""
    views = door.entry_views(meta, where)
    found = [v for v in views.values() if v.kind == KERAS_MODEL]
    if len(found) != 1:
        held = ", ".join(f"{n!r} ({v.kind})" for n, v in views.items()) or "nothing"
        raise CheckpointError(f"{where} is not a sharded Keras checkpoint: it holds {len(found)} {KERAS_MODEL} "
                              f"entries, not one (it holds {held}); load it with shardwise.checkpoint.load")
    return found[0]


def _open(path: PathLike) -> _Opened:
    where = _resolve(path)
    manifest = read_manifest(where)
    meta = manifest.metadata
    if meta.get("format") == FORMAT:  # the earlier format: per-rank .npz files
        check_format(meta, where, FORMAT, VERSION, "a sharded Keras checkpoint")
        check_file_sizes(where)
        ckpt = Checkpoint(where, manifest)
        return _Opened(where, manifest.step, meta, lambda: _legacy_reader(ckpt, meta))
    if meta.get("format") != door.FORMAT:
        raise CheckpointError(f"{where} is not a sharded Keras checkpoint (format {meta.get('format')!r})")
    check_format(meta, where, door.FORMAT, door.FORMAT_VERSION, "a sharded Keras checkpoint")
    check_file_sizes(where)
    view = _keras_entry(meta, where)
    return _Opened(where, manifest.step, view.meta,
                   lambda: view.flat_source(declared_shapes(view.meta)), lambda: door.entry_views(meta, where))


def _legacy_reader(ckpt: Checkpoint, meta: dict) -> FlatReader:
    size = ckpt.manifest.world_size
    tensors = {k: FlatTensor.from_json(v) for k, v in meta["tensors"].items()}
    return FlatReader(tensors, lambda r: np.load(ckpt.file(_file_name(r, size)), allow_pickle=False),
                      origin=str(ckpt.path))


def _info(opened: _Opened) -> CheckpointInfo:
    position = opened.meta.get("position") or {}
    return CheckpointInfo(opened.path, opened.step, int(position.get("epoch", 0)), int(position.get("batch", 0)),
                          opened.meta)


def _restore(model: Any, opened: _Opened, include_optimizer: Optional[bool], rank: int, size: int,
             comm: Optional[Communicator] = None) -> None:
    """Read this rank's values into staging, agree over ``comm`` that every rank read its part, then assign
    (all or nothing: a failure on any rank raises the same error on every rank before any assignment)."""

    readers = []

    def read() -> Callable[[], None]:
        readers.append(opened.reader())
        applies = [stage_model(model, opened.meta, readers[0], include_optimizer, rank, size)]
        layers = embedding_entries(model)
        if layers:
            views = opened.entries()
            readers.extend(views.values())
            missing = [n for n in layers if n not in views or views[n].kind != SHARDED_EMBEDDINGS]
            if missing:
                raise CheckpointError(f"{opened.path} holds no sharded embedding tables for entries {missing} of "
                                      f"the model's {len(layers)} ShardedEmbeddingBag layer(s)")
            applies += [stage_tables(layer, views[name]) for name, layer in layers.items()]

        def apply() -> None:
            for one in applies:
                one()
        return apply

    try:
        stage_or_fail(comm, read, f"checkpoint {opened.path}")()
    finally:
        for reader in readers:
            reader.close()


def load_checkpoint(model: keras.Model, path: PathLike, *, include_optimizer: Optional[bool] = None,
                    comm: Optional[Communicator] = None) -> CheckpointInfo:
    """Restore ``model`` (and its optimizer) from a checkpoint written at any rank count, stage or backend.

    ``path`` is a checkpoint directory or a directory of them (the newest complete
    one is taken). Collective when the model trains with a ZeroOptimizer. An
    optimizer not built yet is built first, as ``fit`` would. ``include_optimizer``:
    None restores the optimizer state when the checkpoint has it, True requires it,
    False takes the model's values only. A model whose variables do not match the
    checkpoint's is refused with :class:`~shardwise.CheckpointError`, naming them.
    Reads checkpoints of the earlier Keras format too.
    """
    comm = model_comm(model, comm)
    opened = stage_or_fail(comm, lambda: _open(path), f"checkpoint {path}")
    sync_backend_state(model)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    _restore(model, opened, include_optimizer, rank, size, comm)
    return _info(opened)


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
    opened = _open(path)
    model = _model_from_config(opened.meta, opened.path, custom_objects, None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and find_distributed_optimizer(model) is None:
        kwargs = {"compression": compression} if compression is not None else {}
        model.optimizer = DistributedOptimizer(optimizer, **kwargs)
    comm = model_comm(model, None)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    _restore(model, opened, None, rank, size, comm)
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
    opened = _open(path)
    saved_opt = opened.meta.get("optimizer")
    with_optimizer = include_optimizer and saved_opt is not None and saved_opt.get("config") is not None
    model = _model_from_config(opened.meta, opened.path, custom_objects,
                               saved_opt["config"] if with_optimizer else False)
    _restore(model, opened, with_optimizer, 0, 1)
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
