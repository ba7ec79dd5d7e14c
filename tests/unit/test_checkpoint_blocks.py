"""Block checksums: computed while a checkpoint file is written, checked on every read of a part of it."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardwise import checkpoint as ck
from shardwise.checkpoint import blocks
from shardwise.checkpoint.atomic import atomic_save_checksummed
from shardwise.checkpoint.blocks import BlockChecksums, crc32_blocks
from shardwise.checkpoint.manifest import Manifest, write_manifest
from shardwise.adapters.torch.checkpoint.pieces import PiecesSource, encode_placement
from shardwise.adapters.torch.checkpoint.safetensors_torch import TorchSafetensorsFile as SafetensorsFile
from shardwise.checkpoint.safetensors_stream import SafetensorsWriter
from shardwise.core.errors import CheckpointError
from shardwise.core.placement import Placement

pytestmark = pytest.mark.timeout(120)


def _crcs(data: bytes, block: int) -> tuple[int, ...]:
    """The expected checksums, computed independently of shardwise's code."""
    return tuple(zlib.crc32(data[i: i + block]) for i in range(0, len(data), block))


def _tensors(sizes: list[int], seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}", torch.randn(n, generator=gen)) for i, n in enumerate(sizes)]


def _safetensors_writer(tensors: list[tuple[str, torch.Tensor]]):  # noqa: ANN202
    def write(f: Any) -> None:
        out = SafetensorsWriter(f, [(n, "F32", tuple(t.shape)) for n, t in tensors])
        for n, t in tensors:
            out.write(n, memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        out.close()
    return write


def _flip(path: Path, at: int, count: int = 1) -> None:
    """Invert ``count`` bytes of ``path`` from byte ``at`` on; the size stays the same."""
    data = bytearray(path.read_bytes())
    for i in range(at, at + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _span(f: SafetensorsFile, name: str) -> tuple[int, int]:
    """Byte range of tensor ``name`` in the file."""
    _, _, begin, end = f._entry(name)
    return f._data + begin, f._data + end


def test_save_records_the_crc32_of_every_block_as_written_without_reading_back(tmp_path: Path,
                                                                            monkeypatch: Any) -> None:
    sizes = [3, 300_000, 1, 0, 700_000, 17]  # ~4 MiB: several 1 MiB blocks, tensors across their edges
    tensors = _tensors(sizes)
    arrays = {"w": np.arange(300_000, dtype=np.float64)}
    reads: list[str] = []
    real_crc32_blocks = blocks.crc32_blocks

    def counted(path: Any, block_size: int = blocks.BLOCK_SIZE) -> BlockChecksums:
        reads.append(Path(path).name)
        return real_crc32_blocks(path, block_size)

    monkeypatch.setattr("shardwise.checkpoint.atomic.crc32_blocks", counted)
    path = ck.save_checkpoint(tmp_path, 1, {"rank-00000.safetensors": _safetensors_writer(tensors),
                                            "state.npz": lambda f: np.savez(f, **arrays), "note.txt": b"x" * 5})
    # Appending writers are hashed as they write; np.savez seeks back to finish its zip headers, so
    # only its file is read back.
    assert len(reads) == 1 and reads[0].startswith(".state.npz."), reads
    manifest = ck.read_manifest(path)
    raw = json.loads((path / "manifest.json").read_text())
    for name in ("rank-00000.safetensors", "state.npz", "note.txt"):
        data = (path / name).read_bytes()
        entry = manifest.files[name]
        assert entry.block_size == blocks.BLOCK_SIZE == 1 << 20
        assert entry.crc32 == _crcs(data, 1 << 20) and entry.size == len(data) and entry.sha256 is None
        assert raw["files"][name] == {"size": len(data), "block_size": 1 << 20,
                                      "crc32": "".join(f"{c:08x}" for c in _crcs(data, 1 << 20))}
    assert len(manifest.files["rank-00000.safetensors"].crc32) == 4
    assert ck.load_checkpoint(path).step == 1


@pytest.mark.parametrize("block", [1, 7, 64, 4096])
def test_checksums_while_writing_equal_recomputation_for_any_block_size(tmp_path: Path, block: int) -> None:
    tensors = _tensors([0, 5, 33, 1, 250, 64, 3])
    path, sums = atomic_save_checksummed(_safetensors_writer(tensors), tmp_path / "f.safetensors", block)
    data = path.read_bytes()
    assert sums == BlockChecksums(len(data), block, _crcs(data, block)) == crc32_blocks(path, block)


def _file_of_tensors(tmp_path: Path, sizes: list[int], block: int) -> tuple[Path, BlockChecksums, dict]:
    tensors = _tensors(sizes, seed=1)
    path, sums = atomic_save_checksummed(_safetensors_writer(tensors), tmp_path / "f.safetensors", block)
    return path, sums, dict(tensors)


def test_reads_check_every_block_they_touch_and_only_those(tmp_path: Path) -> None:
    # Blocks of 256 bytes (64 floats): t1 spans many blocks, the small tensors share one.
    path, sums, tensors = _file_of_tensors(tmp_path, [10, 1000, 3, 3, 3, 200, 7], 256)
    with SafetensorsFile(path, sums) as f:
        spans = {n: _span(f, n) for n in tensors}
        header_blocks = (f._data - 1) // 256 + 1
    assert path.stat().st_size % 256  # the last block is a short one
    cases = {"a block inside t1": (spans["t1"][0] + 2000, "t1"),
             "the last byte of t1, in a block it shares with t2-t4": (spans["t1"][1] - 1, "t1"),
             "t3": (spans["t3"][0] + 5, "t3"),
             "the last byte of the file": (path.stat().st_size - 1, "t6")}
    original = path.read_bytes()
    for label, (at, victim) in cases.items():
        bad = at // 256
        assert bad >= header_blocks, label  # the damage is not in the blocks the header is read from
        _flip(path, at)
        with SafetensorsFile(path, sums) as f:
            with pytest.raises(CheckpointError) as info:
                f.read(victim)
            message = str(info.value)
            assert message.startswith(f"{path}: damaged: block {bad} (bytes [{bad * 256}, "), (label, message)
            assert f"found while reading tensor {victim!r}" in message, (label, message)
            for name, (lo, hi) in spans.items():  # tensors sharing no block with the damage still read
                if hi <= bad * 256 or lo >= (bad + 1) * 256:
                    assert torch.equal(f.read(name), tensors[name]), (label, name)
            if victim == "t1":  # a box of t1 away from the damaged block reads; one over it does not
                first = (bad * 256 - spans["t1"][0]) // 4  # t1's first element in the damaged block
                far = slice(0, 10) if first > 200 else slice(900, 1000)
                assert torch.equal(f.read("t1", (far,)), tensors["t1"][far])
                with pytest.raises(CheckpointError, match=f"block {bad} "):
                    f.read("t1", (slice(first - 3, first + 70),))
                start = first - 30
                with pytest.raises(CheckpointError, match=f"block {bad} "):
                    f.read_into("t1", start, torch.empty(min(64, 1000 - start)))
        with SafetensorsFile(path) as f:  # without checksums the damage reads silently
            f.read(victim)
        path.write_bytes(original)


def test_a_damaged_header_is_caught_when_the_file_is_opened(tmp_path: Path) -> None:
    path, sums, tensors = _file_of_tensors(tmp_path, [10, 20], 4096)
    data = path.read_bytes()
    at = data.index(b'"t1"') + 2  # rename t1 to t2 inside the header: still valid JSON ...
    path.write_bytes(data[:at] + b"2" + data[at + 1:])
    with SafetensorsFile(path) as f:  # ... which opens without checksums, naming another tensor
        assert "t2" in f.keys()
    with pytest.raises(CheckpointError, match=r"f\.safetensors: damaged: block 0 \(bytes \[0, \d+\)\) has crc32 "
                                              r"[0-9a-f]{8}, the manifest says [0-9a-f]{8}; found while reading the "
                                              r"header"):
        SafetensorsFile(path, sums)


def test_clean_reads_of_every_box_match_and_small_tensors_share_one_read_of_their_block(tmp_path: Path,
                                                                                      monkeypatch: Any) -> None:
    path, sums, tensors = _file_of_tensors(tmp_path, [1, 2, 3, 4, 5, 6, 7, 8, 300, 5], 512)
    calls: list[list[int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        calls.append([memoryview(b).nbytes for b in buffers])
        return real(fd, buffers, offset)

    monkeypatch.setattr(blocks.os, "preadv", preadv)
    with SafetensorsFile(path, sums) as f:
        opened = len(calls)
        spans = {n: _span(f, n) for n in tensors}
        header_end_block = (f._data - 1) // 512
        assert all(spans[f"t{i}"][1] <= (header_end_block + 1) * 512 for i in range(8))  # the premise
        for name in [f"t{i}" for i in range(8)]:  # in blocks read and checked with the header: no read
            assert torch.equal(f.read(name), tensors[name])
        assert len(calls) == opened, calls
        assert torch.equal(f.read("t8"), tensors["t8"])
        # One scattered read: the blocks wholly inside t8 straight into the tensor, then its tail edge
        # block into a buffer (its head edge block, shared with the header, is cached).
        lo, hi = spans["t8"]
        inner = (hi // 512) * 512 - (lo // 512 + 1) * 512
        assert lo % 512 and inner > 0 and calls[opened:] == [[inner, sums.span(hi // 512)[1] - hi // 512 * 512]]
        for a in range(0, 300, 37):
            for b in (a, a + 1, a + 130, 300):
                if b <= 300:
                    assert torch.equal(f.read("t8", (slice(a, b),)), tensors["t8"][a:b])
                    out = torch.empty(b - a)
                    f.read_into("t8", a, out)
                    assert torch.equal(out, tensors["t8"][a:b])
        assert torch.equal(f.read("t9"), tensors["t9"])


def test_a_file_of_another_size_than_its_checksums_is_refused(tmp_path: Path) -> None:
    path, sums, _ = _file_of_tensors(tmp_path, [10], 64)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match=rf"f\.safetensors: {sums.size + 1} bytes, the manifest says "
                                              rf"{sums.size} bytes"):
        SafetensorsFile(path, sums)


def _pieced_checkpoint(root: Path, step: int = 1) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A checkpoint of two rank files holding tensors ``big`` (4 MiB, cut in two pieces) and ``small``."""
    big = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(2))
    small = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flat = big.reshape(-1)
    half = flat.numel() // 2
    whole, plain = encode_placement(Placement("big", (1024, 1024))), encode_placement(Placement("small", (3, 4)))
    meta = {"files": ["rank-00000.safetensors", "rank-00001.safetensors"],
            "tensors": {"big": {"shape": [1024, 1024], "dtype": "F32",
                                "pieces": [[0, "big#0", whole, 0, half], [1, "big#1", whole, half, flat.numel()]]},
                        "small": {"shape": [3, 4], "dtype": "F32", "pieces": [[1, "small#0", plain, 0, 12]]}}}
    files = {meta["files"][0]: _safetensors_writer([("big#0", flat[:half])]),
             meta["files"][1]: _safetensors_writer([("small#0", small.reshape(-1)), ("big#1", flat[half:])])}
    return ck.save_checkpoint(root, step, files, metadata=meta), big, small


def test_a_checkpoints_reads_check_the_blocks_its_manifest_records(tmp_path: Path) -> None:
    path, big, small = _pieced_checkpoint(tmp_path)
    meta = ck.load_checkpoint(path).metadata
    source = PiecesSource.from_metadata(meta, path)
    assert torch.equal(source.read_box("big", ()), big) and torch.equal(source.read_box("small", ()), small)
    source.close()
    # 64 bytes flipped near the end of the second file: in the last rows of ``big``.
    rank1 = path / "rank-00001.safetensors"
    at = rank1.stat().st_size - 100_000
    _flip(rank1, at, 64)
    bad = at // (1 << 20)
    source = PiecesSource.from_metadata(meta, path)
    assert torch.equal(source.read_box("small", ()), small)  # in block 0, undamaged
    assert torch.equal(source.read_box("big", (slice(0, 600),)), big[:600])  # rows in undamaged blocks
    with pytest.raises(CheckpointError, match=rf"rank-00001\.safetensors: damaged: block {bad} .*tensor 'big#1'"):
        source.read_box("big", (slice(1000, 1024),))
    with pytest.raises(CheckpointError, match=rf"rank-00001\.safetensors: damaged: block {bad} .*tensor 'big#1'"):
        source.read_flat_into("big", 0, torch.empty(1024 * 1024))
    source.close()
    with pytest.raises(CheckpointError, match=rf"file 'rank-00001.safetensors' is corrupt: block {bad} "):
        ck.load_checkpoint(path)
    assert ck.latest_checkpoint(tmp_path) is None


def test_manifests_with_sha256_only_still_load_and_verify(tmp_path: Path) -> None:
    path, big, small = _pieced_checkpoint(tmp_path)
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"] = {n: {"sha256": ck.sha256_file(path / n), "size": (path / n).stat().st_size}
                    for n in ("rank-00000.safetensors", "rank-00001.safetensors")}
    (path / "manifest.json").write_text(json.dumps(raw, indent=1))  # the layout older shardwise wrote
    loaded = ck.load_checkpoint(path)  # verified with the SHA-256s
    entry = loaded.manifest.files["rank-00000.safetensors"]
    assert entry.crc32 is None and entry.block_size is None and isinstance(entry.sha256, str)
    source = PiecesSource.from_metadata(loaded.metadata, path)
    assert torch.equal(source.read_box("big", ()), big) and torch.equal(source.read_box("small", ()), small)
    source.close()
    assert ck.latest_checkpoint(tmp_path) == path
    # Rewritten by this shardwise, the entries keep their form.
    write_manifest(path, Manifest(1, 1, loaded.manifest.files, loaded.metadata))
    assert json.loads((path / "manifest.json").read_text())["files"] == raw["files"]
    _flip(path / "rank-00000.safetensors", 5000)
    with pytest.raises(CheckpointError, match="file 'rank-00000.safetensors' is corrupt: sha256"):
        ck.load_checkpoint(path)
    assert ck.latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("entry, why", [
    ({"size": 3}, "a sha256 or block crc32"),
    ({"size": 3, "crc32": "0000000a"}, "crc32 and block_size come together"),
    ({"size": 3, "block_size": 2, "crc32": "0000000a"}, "1 block checksums of 2 bytes cannot describe a file of 3"),
    ({"size": 3, "block_size": 4, "crc32": "0000000x"}, "non-hexadecimal"),
    ({"size": 3, "block_size": 4, "crc32": "00 00 0a"}, "other than hex digits"),
    ({"size": 3, "block_size": 4, "crc32": 10}, "crc32 must be hex text"),
    ({"size": 3, "block_size": 4, "crc32": "000000"}, "not 8 hex digits per block"),
    ({"sha256": "ab"}, "no size"),
])
def test_malformed_entries_are_refused_with_the_reason(tmp_path: Path, entry: dict, why: str) -> None:
    path = ck.save_checkpoint(tmp_path, 1, {"a.bin": b"abc"})
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"]["a.bin"] = entry
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"manifest entry for 'a.bin' is malformed .*({why})"):
        ck.read_manifest(path)


def test_format_1_checkpoints_of_whole_tensors_are_checked_too(tmp_path: Path) -> None:
    w = torch.randn(600, 1000, generator=torch.Generator().manual_seed(3))  # 2.4 MB: three blocks
    meta = {"weight_map": {"w": "rank-00000.safetensors", "v": "rank-00000.safetensors"}}
    path = ck.save_checkpoint(tmp_path, 1, {"rank-00000.safetensors": _safetensors_writer([("v", w[0]), ("w", w)])},
                              metadata=meta)
    _flip(path / "rank-00000.safetensors", (2 << 20) + 10)  # in block 2: rows of w from about 520 on
    source = PiecesSource.from_metadata(ck.load_checkpoint(path, verify=False).metadata, path)
    assert torch.equal(source.read_box("w", (slice(0, 400),)), w[:400])
    assert torch.equal(source.read_box("v", ()), w[0])
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors: damaged: block 2 .*tensor 'w'"):
        source.read_box("w", (slice(500, 600),))
    with pytest.raises(CheckpointError, match="damaged: block 2 "):
        source.read_flat_into("w", 0, torch.empty(600 * 1000))
    source.close()
