"""The manifest that makes a checkpoint directory complete and checkable.

``ckpt-<step>/manifest.json`` lists every file with its size and the CRC-32 of each
block of it (``block_size`` bytes, :mod:`.blocks`; computed while the file was
written), the step, the world size and user metadata; it is written atomically
after every file is on disk, with ``"complete": true`` as its last key. A directory
without it is an interrupted save. Manifests written before block checksums hold a
SHA-256 per file instead, and are checked with it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from ..core.errors import CheckpointError
from .atomic import atomic_write_bytes, sha256_file
from .blocks import BlockChecksums, crc32_blocks, decode_crc32, encode_crc32

__all__ = ["MANIFEST_NAME", "FORMAT", "FileEntry", "Manifest", "write_manifest", "read_manifest", "verify_file"]

MANIFEST_NAME = "manifest.json"
FORMAT = "shardwise-checkpoint/1"


@dataclass(frozen=True)
class FileEntry:
    """Size of one file of a checkpoint and its checksums: the CRC-32 of each ``block_size`` block
    (``crc32``), a SHA-256 of the whole file (``sha256``, what older manifests hold), or both."""

    size: int
    sha256: Optional[str] = None
    block_size: Optional[int] = None
    crc32: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.sha256 is None and self.crc32 is None:
            raise CheckpointError("a checkpoint file entry needs a sha256 or block crc32 checksums")
        if (self.crc32 is None) != (self.block_size is None):
            raise CheckpointError("a checkpoint file entry's crc32 and block_size come together")
        if self.crc32 is not None:
            self.blocks  # noqa: B018 - checks that the blocks cover exactly ``size`` bytes

    @property
    def blocks(self) -> Optional[BlockChecksums]:
        """The block checksums, or None for an entry with a SHA-256 only."""
        if self.crc32 is None or self.block_size is None:
            return None
        return BlockChecksums(self.size, self.block_size, self.crc32)

    @classmethod
    def of_blocks(cls, sums: BlockChecksums) -> "FileEntry":
        """The entry of a file with block checksums ``sums``."""
        return cls(sums.size, None, sums.block_size, sums.crc32)

    def to_json(self) -> dict[str, Any]:
        """The entry as the manifest stores it (the CRC-32s as one hex string, 8 digits per block)."""
        raw: dict[str, Any] = {"size": self.size}
        if self.sha256 is not None:
            raw["sha256"] = self.sha256
        if self.crc32 is not None:
            raw["block_size"] = self.block_size
            raw["crc32"] = encode_crc32(self.crc32)
        return raw


@dataclass
class Manifest:
    """Contents of ``manifest.json``."""

    step: int
    world_size: int
    files: dict[str, FileEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    complete: bool = True

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "step": self.step, "world_size": self.world_size, "created": self.created,
                "files": {n: e.to_json() for n, e in sorted(self.files.items())},
                "metadata": self.metadata, "complete": self.complete}
        return json.dumps(body, indent=1, allow_nan=False).encode()


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Atomically write ``manifest.json`` into ``directory`` (this commits the checkpoint)."""
    try:
        data = manifest.to_json()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata must be JSON data (dicts, lists, numbers, strings): {exc}") from None
    return atomic_write_bytes(Path(directory) / MANIFEST_NAME, data)


def _entry(name: str, raw: Any, where: Path) -> FileEntry:
    def malformed(why: str) -> CheckpointError:
        shown = repr(raw) if len(repr(raw)) <= 200 else repr(raw)[:200] + "..."
        return CheckpointError(f"checkpoint {where}: manifest entry for {name!r} is malformed ({why}): {shown}")

    if not isinstance(raw, Mapping) or not isinstance(raw.get("size"), int) or raw["size"] < 0:
        raise malformed("no size")
    sha256, block_size, crc32 = raw.get("sha256"), raw.get("block_size"), raw.get("crc32")
    if sha256 is not None and not isinstance(sha256, str):
        raise malformed("sha256 is not a string")
    if (crc32 is None) != (block_size is None):
        raise malformed("crc32 and block_size come together")
    blocks = None
    if crc32 is not None:
        if not isinstance(crc32, str) or not isinstance(block_size, int) or isinstance(block_size, bool):
            raise malformed("crc32 must be hex text and block_size an integer")
        try:
            blocks = decode_crc32(crc32)
        except ValueError as exc:
            raise malformed(str(exc)) from None
    try:
        return FileEntry(raw["size"], sha256, block_size, blocks)
    except CheckpointError as exc:
        raise malformed(str(exc)) from None


def read_manifest(directory: Path) -> Manifest:
    """Parse ``directory/manifest.json``; refuse a missing, unreadable or incomplete one."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    if not path.exists():
        raise CheckpointError(f"checkpoint {directory} is incomplete: it has no {MANIFEST_NAME} (the save was "
                              "interrupted); use latest_checkpoint() to pick the newest complete one")
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST_NAME} is unreadable or corrupt: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST_NAME} is not a {FORMAT} manifest")
    if raw.get("complete") is not True:
        raise CheckpointError(f"checkpoint {directory} is marked incomplete in its {MANIFEST_NAME}")
    try:
        files = {str(n): _entry(n, e, directory) for n, e in raw["files"].items()}
        return Manifest(int(raw["step"]), int(raw["world_size"]), files, dict(raw.get("metadata") or {}),
                        float(raw.get("created", 0.0)), True)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST_NAME} lacks a valid field: {exc}") from None


def verify_file(directory: Path, name: str, entry: FileEntry) -> Path:
    """Check one file's presence, size and checksums against its manifest entry: every block's CRC-32
    where the entry has them, else its SHA-256."""
    path = Path(directory) / name
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: file {name!r} listed in the manifest is missing")
    size = path.stat().st_size
    if size != entry.size:
        kind = "truncated" if size < entry.size else "larger than recorded"
        raise CheckpointError(f"checkpoint {directory}: file {name!r} is {kind}: {size} bytes, "
                              f"the manifest says {entry.size}")
    blocks = entry.blocks
    if blocks is not None:
        found = crc32_blocks(path, blocks.block_size).crc32
        if len(found) != len(blocks.crc32):
            raise CheckpointError(f"checkpoint {directory}: file {name!r} changed size while it was checked")
        if found != blocks.crc32:
            bad = [k for k, (a, b) in enumerate(zip(found, blocks.crc32)) if a != b]
            lo, hi = blocks.span(bad[0])
            more = f" (and {len(bad) - 1} more block(s))" if len(bad) > 1 else ""
            raise CheckpointError(f"checkpoint {directory}: file {name!r} is corrupt: block {bad[0]} (bytes [{lo}, "
                                  f"{hi})) has crc32 {found[bad[0]]:08x}, the manifest says "
                                  f"{blocks.crc32[bad[0]]:08x}{more}")
        return path
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise CheckpointError(f"checkpoint {directory}: file {name!r} is corrupt: sha256 {digest[:16]}... "
                              f"does not match the manifest's {entry.sha256[:16]}...")
    return path
