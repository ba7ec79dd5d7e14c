"""Crash-safe file writes: a reader sees the old file or the complete new one, never a torn one.

The data goes to a temporary file in the target's directory, is flushed and
fsynced, renamed over the target with :func:`os.replace` (atomic on POSIX), and
the directory is fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Optional, Union, cast

from .blocks import BLOCK_SIZE, BlockChecksums, ChecksummingFile, crc32_blocks

__all__ = ["atomic_save", "atomic_save_checksummed", "atomic_write_bytes", "fsync_dir", "sha256_file"]

PathLike = Union[str, "os.PathLike[str]"]
_CHUNK = 1 << 20


def fsync_dir(path: PathLike) -> None:
    """Flush a directory's entries (renames, creations) to stable storage."""
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (and Windows) cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _new_file_mode(target: Path) -> int:
    """The mode a plain ``open(target, "w")`` would give (mkstemp's is 0600)."""
    try:
        return target.stat().st_mode & 0o7777
    except FileNotFoundError:
        pass
    umask = 0o022
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o666 & ~umask


def atomic_save(writer: Callable[[BinaryIO], object], path: PathLike) -> Path:
    """Call ``writer(file)`` on a temporary file, then atomically move it to ``path``.

    If ``writer`` raises, ``path`` is untouched and the temporary file is removed.
    """
    return _atomic_save(writer, path, None)[0]


def atomic_save_checksummed(writer: Callable[[BinaryIO], object], path: PathLike,
                            block_size: int = BLOCK_SIZE) -> tuple[Path, BlockChecksums]:
    """:func:`atomic_save`, also returning the CRC-32 of each ``block_size`` block of the file written.

    The blocks are hashed as ``writer`` writes them; only a writer that seeks back or
    writes around the file object (a zip file rewriting its headers) has its file read
    back to hash it.
    """
    target, sums = _atomic_save(writer, path, block_size)
    return target, cast(BlockChecksums, sums)


def _atomic_save(writer: Callable[[BinaryIO], object], path: PathLike,
                 block_size: Optional[int]) -> tuple[Path, Optional[BlockChecksums]]:
    target = Path(path)
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), _new_file_mode(target))
            hashing = ChecksummingFile(f, block_size) if block_size is not None else None
            writer(hashing if hashing is not None else f)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        sums = None
        if hashing is not None:
            sums = hashing.crc.result()
            if not hashing.sequential or sums.size != size:
                sums = crc32_blocks(tmp, block_size)  # type: ignore[arg-type]
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)
    return target, sums


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    """Atomically replace ``path`` with ``data``."""
    return atomic_save(lambda f: f.write(data), path)


def sha256_file(path: PathLike) -> str:
    """Hex SHA-256 of a file's contents."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()
