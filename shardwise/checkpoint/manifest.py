"""The manifest that makes a checkpoint directory complete and checkable.

``ckpt-<step>/manifest.json`` lists every file with its size and SHA-256, the step,
the world size and user metadata; it is written atomically after every file is
on disk, with ``"complete": true`` as its last key. A directory without it is an
interrupted save.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..core.errors import CheckpointError
from .atomic import atomic_write_bytes, sha256_file

__all__ = ["MANIFEST_NAME", "FORMAT", "FileEntry", "Manifest", "write_manifest", "read_manifest", "verify_file"]

MANIFEST_NAME = "manifest.json"
FORMAT = "shardwise-checkpoint/1"


@dataclass(frozen=True)
class FileEntry:
    """Size and SHA-256 of one file of a checkpoint."""

    sha256: str
    size: int


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
                "files": {n: {"sha256": e.sha256, "size": e.size} for n, e in sorted(self.files.items())},
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
    if not isinstance(raw, Mapping) or not isinstance(raw.get("sha256"), str) or not isinstance(raw.get("size"), int):
        raise CheckpointError(f"checkpoint {where}: manifest entry for {name!r} is malformed: {raw!r}")
    return FileEntry(raw["sha256"], raw["size"])


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
    """Check one file's presence, size and SHA-256 against its manifest entry."""
    path = Path(directory) / name
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: file {name!r} listed in the manifest is missing")
    size = path.stat().st_size
    if size != entry.size:
        kind = "truncated" if size < entry.size else "larger than recorded"
        raise CheckpointError(f"checkpoint {directory}: file {name!r} is {kind}: {size} bytes, "
                              f"the manifest says {entry.size}")
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise CheckpointError(f"checkpoint {directory}: file {name!r} is corrupt: sha256 {digest[:16]}... "
                              f"does not match the manifest's {entry.sha256[:16]}...")
    return path
