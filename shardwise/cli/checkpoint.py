"""``shardwise checkpoint consolidate`` and ``shardwise checkpoint info``, dispatched on the checkpoint's format.

A checkpoint names its format: the ``"format"`` of its manifest's metadata (a
``ckpt-<step>/`` directory of the checkpoint store, or a directory of them: the newest
complete one), or, for a torch ZeRO checkpoint (not a store directory), its
``zero-meta.json``. :data:`FORMATS` says for each format what it is, what it consolidates
into (a torch ZeRO checkpoint into one fp32 state dict, ``.pt`` or ``.npz``; a sharded Keras
checkpoint into a plain ``.keras`` file) or what to do with it instead, and what ``info``
prints about it. A ``shardwise-state`` checkpoint holding a Keras model (an entry of kind
``keras.model``, as the Keras adapter's ``save_checkpoint`` writes) is a sharded Keras
checkpoint: it consolidates into ``.keras`` too. Nothing here imports torch or Keras until a consolidation runs; an output
suffix of another format is refused before anything is read.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..checkpoint.manifest import MANIFEST_NAME, read_manifest
from ..checkpoint.store import list_checkpoints
from ..core.errors import CheckpointError

__all__ = ["CheckpointFormat", "FORMATS", "register_format", "checkpoint_format", "consolidate", "info"]

#: ``shardwise.adapters.torch.checkpoint.zero.META`` and ``shardwise.adapters.keras.checkpoint.FORMAT``, which import
#: torch and Keras (a unit test ties them together)
ZERO_META = "zero-meta.json"
KERAS_FORMAT = "shardwise-keras-sharded"
#: The name this command gives the torch ZeRO format (its ``zero-meta.json`` holds a bare version number).
ZERO_FORMAT = "shardwise-zero"
#: ``save_training``'s checkpoints carry no format name; their metadata has these keys.
TRAINING_FORMAT = "shardwise-training"


@dataclass(frozen=True)
class CheckpointFormat:
    """What the ``checkpoint`` command knows of one format.

    ``what``: the format in words; ``suffixes``: the outputs ``consolidate`` writes (none:
    it does not consolidate, and ``instead`` says what to do); ``run(directory, out)``
    consolidates and returns the line to print; ``describe(metadata)``: ``info``'s lines.
    """

    name: str
    what: str
    suffixes: tuple[str, ...] = ()
    run: Optional[Callable[[Path, Path], str]] = None
    instead: str = ""
    describe: Optional[Callable[[dict], list[str]]] = None


def _consolidate_zero(directory: Path, out: Path) -> str:
    from ..adapters.torch.checkpoint.zero import consolidate_zero_checkpoint

    full = consolidate_zero_checkpoint(directory, out)
    total = sum(v.size for v in full.values())
    return f"wrote {out}: {len(full)} tensors, {total} parameters (fp32)"


def _consolidate_keras(directory: Path, out: Path) -> str:
    from ..adapters.keras.checkpoint import consolidate_checkpoint

    consolidate_checkpoint(directory, out)
    return f"wrote {out}: a .keras file (keras.saving.load_model opens it without shardwise)"


_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _stored_bytes(info: dict) -> int:
    return sum((int(b) - int(a)) * _SIZES.get(info.get("dtype"), 4) for _, _, _, a, b in info.get("pieces", []))


def _describe_state(meta: dict) -> list[str]:
    tensors = meta.get("tensors", {})
    lines = []
    for name, entry in meta.get("entries", {}).items():
        mine = {k: v for k, v in tensors.items() if k.startswith(name + "/")}
        size = sum(_stored_bytes(v) for v in mine.values())
        lines.append(f"  {name}: {entry.get('kind')}, {len(mine)} tensors, {size} bytes")
    if meta.get("extra"):
        lines.append(f"extra: {json.dumps(meta['extra'], sort_keys=True)}")
    return lines


def _describe_keras_state(meta: dict) -> list[str]:
    lines = _describe_state(meta)
    for name, entry in meta.get("entries", {}).items():
        if entry.get("kind") != KERAS_MODEL:
            continue
        keras_meta = entry.get("meta") or {}
        opt = keras_meta.get("optimizer")
        held = "no optimizer state" if not opt else f"{opt.get('class')} state, ZeRO stage {opt.get('stage')}"
        lines.append(f"  {name}: Keras {keras_meta.get('keras')} on {keras_meta.get('backend')}, "
                     f"{len((keras_meta.get('model') or {}).get('variables', []))} variables, {held}, "
                     f"position {json.dumps(keras_meta.get('position'), sort_keys=True)}")
    return lines


def _describe_embeddings(meta: dict) -> list[str]:
    plan = meta.get("plan", {})
    lines = [f"  {name}: {rows} x {dim}, {plan.get(name, '?')}" for name, (rows, dim) in meta.get("tables", {}).items()]
    return lines + [f"optimizer: {meta.get('optimizer')}"]


def _describe_parallel(meta: dict) -> list[str]:
    return [f"layout: {meta.get('layout')}", f"optimizer: {meta.get('optimizer')}, ZeRO stage {meta.get('zero_stage')}",
            f"tensors: {len(meta.get('model', {}))} in the model"]


def _describe_zero(meta: dict) -> list[str]:
    return [f"optimizer: {meta.get('optimizer')}, ZeRO stage {meta.get('stage')}",
            f"partition units: {len(meta.get('units', []))}"]


#: The entry kind of a Keras model in a ``shardwise-state`` checkpoint
#: (``shardwise.adapters.keras.checkpoint_state.KERAS_MODEL``, which imports Keras).
KERAS_MODEL = "keras.model"
#: A ``shardwise-state`` checkpoint with a Keras model entry: what ``checkpoint_format`` returns for one.
KERAS_STATE = CheckpointFormat("shardwise-state", "a sharded Keras checkpoint", (".keras",), _consolidate_keras,
                               describe=_describe_keras_state)

#: The one registry of checkpoint formats this command knows, by name.
FORMATS: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> None:
    """Add (or replace) a format of :data:`FORMATS`."""
    FORMATS[fmt.name] = fmt


for _fmt in (
        CheckpointFormat(ZERO_FORMAT, "a torch ZeRO checkpoint", (".pt", ".npz"), _consolidate_zero,
                         describe=_describe_zero),
        CheckpointFormat(KERAS_FORMAT, "a sharded Keras checkpoint", (".keras",), _consolidate_keras),
        CheckpointFormat("shardwise-parallel", "a ParallelModel checkpoint",
                         instead="a ParallelModel checkpoint converts with 'shardwise checkpoint export'",
                         describe=_describe_parallel),
        CheckpointFormat("shardwise-embeddings", "a sharded embedding-table checkpoint",
                         instead="load_embedding_checkpoint loads it on any plan and world size",
                         describe=_describe_embeddings),
        CheckpointFormat("shardwise-state", "a shardwise-state checkpoint (shardwise.checkpoint.save)",
                         instead="shardwise.checkpoint.load loads it on any world size; 'shardwise checkpoint "
                                 "info' lists its entries", describe=_describe_state),
        CheckpointFormat(TRAINING_FORMAT, "a save_training checkpoint (torch.save files)",
                         instead="its model.pt and optimizer.pt are whole already (restore_training loads them)")):
    register_format(_fmt)


def _newest(directory: Path) -> Path:
    if (directory / MANIFEST_NAME).exists():
        return directory
    complete = [p for _, p in reversed(list_checkpoints(directory)) if (p / MANIFEST_NAME).exists()]
    if not complete:
        steps = [s for s, _ in list_checkpoints(directory)]
        raise CheckpointError(f"{directory} holds no complete checkpoint ({ZERO_META}, {MANIFEST_NAME}, or a "
                              f"ckpt-<step>/ with one; steps found: {steps})")
    return complete[0]


def checkpoint_format(directory: Path) -> tuple[CheckpointFormat, Path, dict]:
    """The format of the checkpoint in ``directory`` (or of the newest complete one under it), the
    checkpoint's directory and its metadata; refuses a format not in :data:`FORMATS`, naming it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    if (directory / ZERO_META).exists():
        try:
            meta = json.loads((directory / ZERO_META).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{directory / ZERO_META} is unreadable: {exc}") from None
        return FORMATS[ZERO_FORMAT], directory, meta
    where = _newest(directory)
    manifest = read_manifest(where)
    meta = dict(manifest.metadata, step=manifest.step, world_size=manifest.world_size)
    name = manifest.metadata.get("format")
    if name is None and {"position", "user"} <= set(manifest.metadata):
        name = TRAINING_FORMAT
    if name not in FORMATS:
        raise CheckpointError(f"{directory} is a checkpoint of format {name!r}, which this shardwise does not know "
                              f"(it knows {', '.join(sorted(FORMATS))}): upgrade shardwise to read it")
    entries = meta.get("entries") if isinstance(meta.get("entries"), dict) else {}
    if name == "shardwise-state" and [e.get("kind") for e in entries.values() if isinstance(e, dict)].count(
            KERAS_MODEL) == 1:
        return KERAS_STATE, where, meta
    return FORMATS[name], where, meta


def consolidate(args: argparse.Namespace) -> int:
    """``shardwise checkpoint consolidate DIRECTORY OUT``."""
    directory, out = Path(args.directory), Path(args.out)
    fmt, _, _ = checkpoint_format(directory)
    if fmt.run is None:
        able = [f for f in FORMATS.values() if f.run is not None]
        raise CheckpointError(f"{directory} is a checkpoint of format {fmt.name!r} ({fmt.what}): consolidate reads "
                              + " and ".join(f"{f.what} (into {' or '.join(f.suffixes)})" for f in able)
                              + f"; {fmt.instead}")
    if out.suffix not in fmt.suffixes:
        other = next((f for f in FORMATS.values() if f is not fmt and out.suffix in f.suffixes), None)
        hint = f" ({' and '.join(other.suffixes)} is for {other.what})" if other is not None else ""
        raise CheckpointError(f"{directory} is {fmt.what}: it consolidates into {' or '.join(fmt.suffixes)}, "
                              f"not {out.name!r}{hint}")
    print(fmt.run(directory, out))
    return 0


def info(args: argparse.Namespace) -> int:
    """``shardwise checkpoint info DIRECTORY``: the format, step, world size and contents, from metadata only."""
    fmt, where, meta = checkpoint_format(Path(args.directory))
    print(f"{where}: {fmt.what} (format {fmt.name!r}"
          + (f", version {meta['version']})" if "version" in meta else ")"))
    print(f"step {meta.get('step')}, written by {meta.get('world_size')} rank(s)")
    for line in (fmt.describe(meta) if fmt.describe is not None else []):
        print(line)
    if fmt.run is not None:
        print(f"consolidates into {' or '.join(fmt.suffixes)} ('shardwise checkpoint consolidate')")
    elif fmt.instead:
        print(fmt.instead)
    return 0
