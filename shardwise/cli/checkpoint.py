"""``shardwise checkpoint consolidate``: one full file from a sharded checkpoint of either kind.

A torch ZeRO checkpoint (a directory holding ``zero-meta.json``) becomes one fp32
state dict, ``.pt`` or ``.npz``; a sharded Keras checkpoint (a ``ckpt-<step>/``
whose manifest is of :mod:`shardwise.adapters.keras.checkpoint`'s format, or a
directory of them: the newest complete one) becomes a plain ``.keras`` file. The
kind is read from the directory without importing torch or Keras, and an output
suffix of the other kind is refused before anything is read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint.manifest import MANIFEST_NAME, read_manifest
from ..checkpoint.store import list_checkpoints
from ..core.errors import CheckpointError

__all__ = ["checkpoint_kind", "consolidate"]

#: ``shardwise.checkpoint.zero_torch.META`` and ``shardwise.adapters.keras.checkpoint.FORMAT``, which import
#: torch and Keras (a unit test ties them together)
ZERO_META = "zero-meta.json"
KERAS_FORMAT = "shardwise-keras-sharded"
SUFFIXES = {"zero": (".pt", ".npz"), "keras": (".keras",)}
_WHAT = {"zero": "a torch ZeRO checkpoint", "keras": "a sharded Keras checkpoint"}


def _manifest_format(step_dir: Path) -> object:
    return read_manifest(step_dir).metadata.get("format")


def checkpoint_kind(directory: Path) -> str:
    """``"zero"`` or ``"keras"``: which consolidation ``directory`` takes; refuses anything else, naming it."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    if (directory / ZERO_META).exists():
        return "zero"
    if (directory / MANIFEST_NAME).exists():
        found = _manifest_format(directory)
    else:
        complete = [p for _, p in reversed(list_checkpoints(directory)) if (p / MANIFEST_NAME).exists()]
        if not complete:
            steps = [s for s, _ in list_checkpoints(directory)]
            raise CheckpointError(f"{directory} holds no complete checkpoint ({ZERO_META}, {MANIFEST_NAME}, or a "
                                  f"ckpt-<step>/ with one; steps found: {steps})")
        found = _manifest_format(complete[0])
    if found == KERAS_FORMAT:
        return "keras"
    raise CheckpointError(f"{directory} is a checkpoint of format {found!r}: consolidate reads torch ZeRO "
                          f"checkpoints ({ZERO_META}) and sharded Keras checkpoints ({KERAS_FORMAT!r}); a "
                          "ParallelModel checkpoint converts with 'shardwise checkpoint export'")


def consolidate(args: argparse.Namespace) -> int:
    """``shardwise checkpoint consolidate DIRECTORY OUT``."""
    directory, out = Path(args.directory), Path(args.out)
    kind = checkpoint_kind(directory)
    if out.suffix not in SUFFIXES[kind]:
        other = next(k for k in SUFFIXES if k != kind)
        hint = f" ({' and '.join(SUFFIXES[other])} is for {_WHAT[other]})" if out.suffix in SUFFIXES[other] else ""
        raise CheckpointError(f"{directory} is {_WHAT[kind]}: it consolidates into {' or '.join(SUFFIXES[kind])}, "
                              f"not {out.name!r}{hint}")
    if kind == "zero":
        from ..checkpoint.zero_torch import consolidate_zero_checkpoint

        full = consolidate_zero_checkpoint(directory, out)
        total = sum(v.size for v in full.values())
        print(f"wrote {out}: {len(full)} tensors, {total} parameters (fp32)")
        return 0
    from ..adapters.keras.checkpoint import consolidate_checkpoint

    consolidate_checkpoint(directory, out)
    print(f"wrote {out}: a .keras file (keras.saving.load_model opens it without shardwise)")
    return 0
