"""Per-block CRC-32 checksums of checkpoint files: computed while a file is written, checked on every read.

A file is cut into blocks of ``block_size`` bytes (the last one may be shorter) and
each block's :func:`zlib.crc32` is recorded in the manifest. The writer hashes the
bytes as they pass to the file (:class:`ChecksummingFile`), so a save never reads
its files back. A reader that opens a file with its :class:`BlockChecksums`
(:class:`VerifiedReader`) reads whole blocks around every range it is asked for and
checks them before handing bytes out: blocks that lie inside the range are read
straight into the destination and hashed there; the partly covered blocks at its
edges go through a small buffer and a cache of recently checked blocks, so many
small tensors in one block read and hash it once. Damage anywhere in what a rank
reads is caught there, without hashing the files or the parts it does not read.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

from ..core.errors import CheckpointError

__all__ = ["BLOCK_SIZE", "BlockChecksums", "BlockCrc32", "ChecksummingFile", "VerifiedReader", "crc32_blocks",
           "preadv_exact", "encode_crc32", "decode_crc32"]

#: Bytes per checksummed block of the files a save writes (recorded in each manifest entry).
BLOCK_SIZE = 1 << 20
#: Blocks a :class:`VerifiedReader` keeps after checking them for the edges of later reads.
CACHED_BLOCKS = 8


@dataclass(frozen=True)
class BlockChecksums:
    """The expected size of a file and the CRC-32 of each ``block_size`` block of it, in order."""

    size: int
    block_size: int
    crc32: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.size < 0 or len(self.crc32) != -(-self.size // self.block_size):
            raise CheckpointError(f"{len(self.crc32)} block checksums of {self.block_size} bytes cannot describe "
                                  f"a file of {self.size} bytes")

    def span(self, block: int) -> tuple[int, int]:
        """Byte range ``[begin, end)`` of block number ``block``."""
        begin = block * self.block_size
        return begin, min(begin + self.block_size, self.size)


def encode_crc32(values: tuple[int, ...]) -> str:
    """The manifest's form of a list of CRC-32 values: 8 hex digits each, concatenated."""
    return struct.pack(f">{len(values)}I", *values).hex()


def decode_crc32(text: str) -> tuple[int, ...]:
    """Inverse of :func:`encode_crc32`; ValueError on text that is not 8 hex digits per value."""
    if len(text) % 8:
        raise ValueError(f"crc32 text of {len(text)} characters is not 8 hex digits per block")
    raw = bytes.fromhex(text)
    if len(raw) * 2 != len(text):  # fromhex skips spaces
        raise ValueError("crc32 text holds characters other than hex digits")
    return struct.unpack(f">{len(raw) // 4}I", raw)


class BlockCrc32:
    """CRC-32 of each ``block_size`` block of a byte stream fed in order through :meth:`update`."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.size = 0
        self._done: list[int] = []
        self._crc = 0
        self._fill = 0

    def update(self, data: Any) -> None:
        """Append ``data`` (any C-contiguous buffer) to the stream."""
        view = _bytes_view(data)
        at, n = 0, view.nbytes
        while at < n:
            take = min(n - at, self.block_size - self._fill)
            self._crc = zlib.crc32(view[at: at + take], self._crc)
            self._fill += take
            at += take
            if self._fill == self.block_size:
                self._done.append(self._crc)
                self._crc, self._fill = 0, 0
        self.size += n

    def result(self) -> BlockChecksums:
        """The checksums of everything fed so far."""
        return BlockChecksums(self.size, self.block_size,
                              tuple(self._done) + ((self._crc,) if self._fill else ()))


def _bytes_view(data: Any) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    return view.cast("B")


def crc32_blocks(path: Union[str, "os.PathLike[str]"], block_size: int = BLOCK_SIZE) -> BlockChecksums:
    """Checksums of the file at ``path``, read block by block."""
    crc = BlockCrc32(block_size)
    buffer = bytearray(block_size)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buffer)
            if not got:
                break
            crc.update(view[:got])
    return crc.result()


class ChecksummingFile:
    """A binary file being written, which hashes into :class:`BlockCrc32` the bytes written through it.

    Writers that only append (safetensors, pickle, ``torch.save``) are hashed as they
    write. A writer that seeks elsewhere (zip files rewrite their headers) or reaches
    past this object (``fileno()``, other attributes) marks it :attr:`sequential` False;
    its caller then hashes the finished file instead (:func:`crc32_blocks`).
    """

    def __init__(self, f: BinaryIO, block_size: int = BLOCK_SIZE) -> None:
        self._f = f
        self.crc = BlockCrc32(block_size)
        self.sequential = True

    def write(self, data: Any) -> int:
        if self.sequential:
            self.crc.update(data)
        written = self._f.write(data)
        return memoryview(data).nbytes if written is None else written

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        where = self._f.tell()
        moved = self._f.seek(offset, whence)
        if moved != where:
            self.sequential = False
        return moved

    def flush(self) -> None:
        self._f.flush()

    def seekable(self) -> bool:
        return self._f.seekable()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._f.closed

    @property
    def name(self) -> Any:
        return self._f.name

    @property
    def mode(self) -> str:
        return "wb"

    def __getattr__(self, attr: str) -> Any:
        # Anything else (fileno, truncate, writelines, ...) may write around the hashing.
        self.sequential = False
        return getattr(self._f, attr)


class VerifiedReader:
    """Reads byte ranges of an open file, checking every block they touch against ``checksums``.

    A mismatch raises :class:`CheckpointError` naming the file, the block and its byte
    range, and what was being read.
    """

    def __init__(self, fd: int, path: Path, checksums: BlockChecksums, cached_blocks: int = CACHED_BLOCKS) -> None:
        self.fd = fd
        self.path = Path(path)
        self.sums = checksums
        self._cache: "OrderedDict[int, memoryview]" = OrderedDict()
        self._cached_blocks = cached_blocks

    def _check(self, block: int, data: memoryview, what: str) -> None:
        got = zlib.crc32(data)
        want = self.sums.crc32[block]
        if got != want:
            begin, end = self.sums.span(block)
            raise CheckpointError(f"{self.path}: damaged: block {block} (bytes [{begin}, {end})) has crc32 "
                                  f"{got:08x}, the manifest says {want:08x}; found while reading {what}")

    def _cached(self, block: int) -> Optional[memoryview]:
        data = self._cache.get(block)
        if data is not None:
            self._cache.move_to_end(block)
        return data

    def _remember(self, block: int, data: memoryview) -> None:
        self._cache[block] = data
        while len(self._cache) > self._cached_blocks:
            self._cache.popitem(last=False)

    def read_into(self, out: memoryview, offset: int, what: str) -> None:
        """Fill ``out`` (a writable byte view) with the file's bytes ``[offset, offset + len(out))``, every
        block they touch checked; ``what`` names the read in errors (e.g. the tensor)."""
        n = out.nbytes
        if n == 0:
            return
        end = offset + n
        if offset < 0 or end > self.sums.size:
            raise CheckpointError(f"{self.path}: {what} lies at bytes [{offset}, {end}), past the "
                                  f"{self.sums.size} bytes the manifest records")
        bs = self.sums.block_size
        first, last = offset // bs, (end - 1) // bs
        inside = [b for b in (first, last) if offset <= b * bs and self.sums.span(b)[1] <= end]
        edges = sorted({b for b in (first, last) if b not in inside})
        inner = range(first + (first in edges), last - (last in edges and last != first) + 1)
        # Reads in file order: an edge block not cached into its own buffer, the inner blocks into ``out``.
        runs: list[tuple[int, Optional[int], memoryview]] = []
        checked: dict[int, memoryview] = {}
        for block in edges:
            data = self._cached(block)
            if data is not None:
                checked[block] = data
        if first in edges and first not in checked:
            runs.append((first * bs, first, memoryview(bytearray(self._length(first)))))
        if len(inner):
            runs.append((inner[0] * bs, None, out[inner[0] * bs - offset: self.sums.span(inner[-1])[1] - offset]))
        if last in edges and last != first and last not in checked:
            runs.append((last * bs, last, memoryview(bytearray(self._length(last)))))
        self._read_runs(runs, what)
        for begin, block, view in runs:
            if block is None:
                for b in inner:
                    lo, hi = self.sums.span(b)
                    self._check(b, view[lo - begin: hi - begin], what)
            else:
                self._check(block, view, what)
                checked[block] = view
                self._remember(block, view)
        for block in edges:
            lo, hi = self.sums.span(block)
            a, b = max(lo, offset), min(hi, end)
            out[a - offset: b - offset] = checked[block][a - lo: b - lo]

    def _length(self, block: int) -> int:
        lo, hi = self.sums.span(block)
        return hi - lo

    def _read_runs(self, runs: list[tuple[int, Optional[int], memoryview]], what: str) -> None:
        """Read each (file offset, _, buffer) of ``runs``; adjacent ones in one scattered read."""
        i = 0
        while i < len(runs):
            start = runs[i][0]
            buffers = [runs[i][2]]
            at = start + buffers[0].nbytes
            j = i + 1
            while j < len(runs) and runs[j][0] == at:
                buffers.append(runs[j][2])
                at += buffers[-1].nbytes
                j += 1
            preadv_exact(self.fd, buffers, start, self.path, what)
            i = j

    def clear(self) -> None:
        """Drop the cached blocks."""
        self._cache.clear()


def preadv_exact(fd: int, buffers: list[memoryview], offset: int, path: Path, what: str) -> None:
    """Fill ``buffers`` from consecutive bytes of ``fd`` at ``offset``; CheckpointError on a short file."""
    pending = [b for b in buffers if b.nbytes]
    while pending:
        got = os.preadv(fd, pending, offset)
        if got <= 0:
            raise CheckpointError(f"{path}: {what} cannot be read (short read at byte {offset})")
        offset += got
        while pending and got >= pending[0].nbytes:
            got -= pending[0].nbytes
            pending.pop(0)
        if pending and got:
            pending[0] = pending[0][got:]
