"""Crash-safe, verified checkpoints: atomic files, ``ckpt-<step>/`` directories with a manifest.

One door for training state of any kind (every rank; see :mod:`.door`)::

    from shardwise import checkpoint as ckpt
    ckpt.save("run/ckpts", step, {"model": model, "opt": opt, "tables": ebc, "sparse": sparse_opt},
              extra={"epoch": e}, keep=3)
    info = ckpt.load("run/ckpts", {"model": model, "opt": opt, "tables": ebc, "sparse": sparse_opt})
    # all or nothing on every rank; info == {"epoch": e, "step": step}

The store underneath, for files of your own (every rank)::

    from shardwise import checkpoint as ckpt
    ckpt.save_checkpoint("run/ckpts", step, {f"rank-{rank:05d}.npz": writer}, comm=world,
                         metadata={"position": {"epoch": e, "step": s}}, keep=3)
    path = ckpt.latest_checkpoint("run/ckpts")      # newest complete and verified, or None
    loaded = ckpt.load_checkpoint(path)             # CheckpointError if incomplete or damaged

This package is framework-neutral (it imports numpy at most). Framework code lives in the
adapters: torch's handlers and its older checkpoint families (``ParallelModel``, ZeRO,
embedding tables, ``save_training``, conversions) in :mod:`shardwise.adapters.torch.checkpoint`,
Keras's in :mod:`shardwise.adapters.keras.checkpoint_state`; the door imports them when it
first meets an object of theirs.
"""

from .atomic import atomic_save, atomic_write_bytes, fsync_dir, sha256_file
from .door import load, register_handler, save
from .manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest
from .state import capture_rng, check_mismatch, load_arrays, restore_rng, save_arrays
from .store import (Checkpoint, checkpoint_dir, latest_checkpoint, list_checkpoints, load_checkpoint,
                    save_checkpoint)

__all__ = ["save", "load", "register_handler", "atomic_save", "atomic_write_bytes", "fsync_dir", "sha256_file",
           "MANIFEST_NAME", "FileEntry", "Manifest", "read_manifest", "capture_rng", "restore_rng", "check_mismatch",
           "save_arrays", "load_arrays", "Checkpoint", "checkpoint_dir", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "save_checkpoint"]
