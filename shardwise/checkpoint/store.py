"""Checkpoint directories ``<dir>/ckpt-<step>/``: collective save, newest-complete lookup, verified load.

Every rank writes its own files (atomically) into the step's directory, hashing each
block of them as it writes; rank 0 then writes the manifest with every file's size and
block checksums. A save interrupted
at any point leaves the previous checkpoints untouched and, at worst, a step
directory without manifest, which :func:`latest_checkpoint` skips (re-saving an
existing step first withdraws its manifest). All ranks must see the same
directory (one node, or a shared filesystem).
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Mapping, Optional, Union

import numpy as np

from ..core.comm import Communicator
from ..core.errors import CheckpointError
from .atomic import PathLike, atomic_save_checksummed, fsync_dir
from .manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest, verify_file, write_manifest

__all__ = ["Checkpoint", "checkpoint_dir", "list_checkpoints", "latest_checkpoint", "load_checkpoint",
           "save_checkpoint", "prepare_step_dir", "commit_checkpoint", "check_format", "check_file_sizes"]

_LOG = logging.getLogger("shardwise.checkpoint")
_STEP_DIR = re.compile(r"^ckpt-(\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

#: What a rank contributes: file name -> bytes, or a function writing the file's contents.
Contents = Union[bytes, Callable[[BinaryIO], object]]


def checkpoint_dir(directory: PathLike, step: int) -> Path:
    """``<directory>/ckpt-<step>``."""
    if int(step) < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
    return Path(directory) / f"ckpt-{int(step)}"


def list_checkpoints(directory: PathLike) -> list[tuple[int, Path]]:
    """Every ``ckpt-<step>`` directory under ``directory`` (complete or not), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


@dataclass
class Checkpoint:
    """A loaded checkpoint: its directory and manifest; files are verified before they are read."""

    path: Path
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def metadata(self) -> dict:
        return self.manifest.metadata

    def has(self, name: str) -> bool:
        return name in self.manifest.files

    def file(self, name: str) -> Path:
        """Path of file ``name`` after checking its size and checksums."""
        entry = self.manifest.files.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.path} has no file {name!r}; it has: "
                                  f"{', '.join(sorted(self.manifest.files)) or 'none'}")
        return verify_file(self.path, name, entry)

    def read_bytes(self, name: str) -> bytes:
        return self.file(name).read_bytes()

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        """The numpy arrays of an ``.npz`` file (loaded without pickle)."""
        from .state import load_arrays

        return load_arrays(self.file(name))


def load_checkpoint(path: PathLike, *, verify: bool = True) -> Checkpoint:
    """Open a checkpoint directory; refuse it if incomplete, or (``verify``) if any file is damaged."""
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        for name, entry in manifest.files.items():
            verify_file(path, name, entry)
    return Checkpoint(path, manifest)


def check_format(meta: dict, where: Path, fmt: str, version: int, what: str) -> None:
    """Refuse a checkpoint whose metadata is not of format ``fmt`` or is of a version newer than ``version``."""
    if meta.get("format") != fmt:
        raise CheckpointError(f"{where} is not {what} (format {meta.get('format')!r})")
    found = meta.get("version")
    if not isinstance(found, int) or found > version:
        raise CheckpointError(f"{where} was written in checkpoint format version {found}, newer than this "
                              f"shardwise reads ({version}): upgrade shardwise to load it")


def check_file_sizes(where: Path) -> None:
    """Refuse a checkpoint with a file missing or of another size than its manifest says (cheap: no hashing)."""
    for name, entry in read_manifest(where).files.items():
        size = (where / name).stat().st_size if (where / name).exists() else None
        if size != entry.size:
            raise CheckpointError(f"{where / name}: {'missing' if size is None else f'{size} bytes'}, the manifest "
                                  f"says {entry.size} bytes (a damaged or truncated checkpoint)")


def latest_checkpoint(directory: PathLike) -> Optional[Path]:
    """The newest complete checkpoint whose files all verify, or None; damaged newer ones are skipped."""
    for step, path in reversed(list_checkpoints(directory)):
        try:
            load_checkpoint(path)
        except CheckpointError as exc:
            _LOG.warning("skipping checkpoint: %s", exc)
            continue
        return path
    return None


def _write_own(step_dir: Path, contents: Mapping[str, Contents]) -> dict[str, FileEntry]:
    """Write this rank's files into ``step_dir`` atomically; their manifest entries (size, block CRC-32s,
    hashed as the bytes were written)."""
    entries = {}
    for name, data in contents.items():
        if not _NAME.match(name) or name == MANIFEST_NAME:
            raise CheckpointError(f"bad checkpoint file name {name!r}: use letters, digits, '.', '_', '-'")
        writer = (lambda f, d=data: f.write(d)) if isinstance(data, (bytes, bytearray)) else data
        _, sums = atomic_save_checksummed(writer, step_dir / name)
        entries[name] = FileEntry.of_blocks(sums)
    return entries


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def prepare_step_dir(directory: PathLike, step: int, comm: Optional[Communicator] = None) -> Path:
    """First phase of a save, collective over ``comm``: rank 0 makes ``<directory>/ckpt-<step>/`` and
    withdraws a manifest left there by an earlier save of that step; every rank returns once it exists,
    or raises if rank 0 could not make it (rank 0 its own error, the others a :class:`CheckpointError`)."""
    rank = comm.rank if comm is not None else 0
    step_dir = checkpoint_dir(directory, step)
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            step_dir.mkdir(parents=True, exist_ok=True)
            stale = step_dir / MANIFEST_NAME
            if stale.exists():  # re-saving a step: it is incomplete until the new manifest lands
                stale.unlink()
                fsync_dir(step_dir)
            fsync_dir(step_dir.parent)
        except OSError as exc:  # every rank must hear of it, not wait for rank 0 forever
            error = exc
    _share_rank0_outcome(comm, error, f"checkpoint {step_dir}: rank 0 could not make the directory")
    return step_dir


def commit_checkpoint(directory: PathLike, step: int, entries: Optional[Mapping[str, FileEntry]], *,
                      comm: Optional[Communicator] = None, metadata: Optional[dict] = None,
                      keep: Optional[int] = None, failure: Optional[BaseException] = None) -> Path:
    """Last phase of a save, collective over ``comm``: gather every rank's file ``entries`` (what
    :func:`_write_own` returned), and on rank 0 write the manifest, last, then prune to ``keep``.

    ``failure`` is this rank's error while writing its files (``entries`` is then unused). If any
    rank failed, no manifest is written and every rank raises: the failing rank its own error, the
    others a :class:`CheckpointError` naming it. An error of rank 0's commit (two ranks wrote the
    same file name, the manifest could not be written) is raised on every rank the same way.
    Returns the checkpoint directory.
    """
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    step_dir = checkpoint_dir(directory, step)
    mine = (dict(entries or {}), None) if failure is None else (None, _describe(failure))
    every = comm.allgather_object(mine) if comm is not None else [mine]
    failed = [(r, message) for r, (_, message) in enumerate(every) if message is not None]
    if failed:
        if failure is not None:
            raise failure
        r, message = failed[0]
        raise CheckpointError(f"checkpoint {step_dir} was not committed (no manifest): rank {r} failed to write "
                              f"its files: {message}")
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            files: dict[str, FileEntry] = {}
            for r, (part, _) in enumerate(every):
                clash = sorted(set(files) & set(part))
                if clash:
                    raise CheckpointError(f"checkpoint {step_dir}: rank {r} wrote {clash}, which another rank "
                                          "wrote too; give per-rank files distinct names (e.g. rank-00001.npz)")
                files.update(part)
            write_manifest(step_dir, Manifest(int(step), size, files, dict(metadata or {})))
            if keep is not None:
                _prune(Path(directory), int(step), keep)
        except Exception as exc:  # every rank must hear of it, not wait for rank 0 forever
            error = exc
    _share_rank0_outcome(comm, error, f"checkpoint {step_dir}: rank 0 failed to commit it")
    return step_dir


def _share_rank0_outcome(comm: Optional[Communicator], error: Optional[BaseException], what: str) -> None:
    """Collective: raise rank 0's ``error`` there, and a :class:`CheckpointError` saying ``what`` and
    its message on every other rank; return everywhere when rank 0 had none."""
    outcome = None if error is None else _describe(error)
    if comm is not None:
        outcome = comm.broadcast_object(outcome, root=0)
    if error is not None:
        raise error
    if outcome is not None:
        raise CheckpointError(f"{what}: {outcome}")


def save_checkpoint(directory: PathLike, step: int, contents: Mapping[str, Contents], *,
                    comm: Optional[Communicator] = None, metadata: Optional[dict] = None,
                    keep: Optional[int] = None) -> Path:
    """Write this rank's ``contents`` into ``<directory>/ckpt-<step>/`` and commit the checkpoint.

    Collective over ``comm`` (every rank calls it; file names must differ between
    ranks). ``metadata`` (JSON data) is rank 0's. ``keep`` prunes all but the newest
    ``keep`` complete checkpoints afterwards. Returns the checkpoint directory.
    The three phases, :func:`prepare_step_dir`, :func:`_write_own` and
    :func:`commit_checkpoint`, are also run apart by :mod:`.async_save` (the write and
    the commit on a background thread). A rank's failure to write raises on every rank.
    """
    step_dir = prepare_step_dir(directory, step, comm)
    entries: Optional[dict[str, FileEntry]] = None
    failure: Optional[BaseException] = None
    try:
        entries = _write_own(step_dir, contents)
    except Exception as exc:  # reported to every rank by the commit
        failure = exc
    return commit_checkpoint(directory, step, entries, comm=comm, metadata=metadata, keep=keep, failure=failure)


def _prune(directory: Path, newest: int, keep: int) -> None:
    """Remove all but the ``keep`` newest complete checkpoints, and incomplete ones older than ``newest``."""
    if keep < 1:
        raise CheckpointError(f"keep must be at least 1, got {keep}")
    complete = [(s, p) for s, p in list_checkpoints(directory) if (p / MANIFEST_NAME).exists()]
    doomed = {p for _, p in complete[:-keep]}
    doomed |= {p for s, p in list_checkpoints(directory) if s < newest and not (p / MANIFEST_NAME).exists()}
    for path in sorted(doomed):
        (path / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete first, so a crash mid-removal is harmless
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        fsync_dir(directory)
