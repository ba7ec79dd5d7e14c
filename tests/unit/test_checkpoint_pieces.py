"""Pieced checkpoints: the pieces ranks of any layout held read back as any box of the whole tensor."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.adapters.torch.parallel.weights import take
from shardwise.checkpoint.blocks import crc32_blocks
from shardwise.checkpoint.manifest import FileEntry, Manifest, write_manifest
from shardwise.adapters.torch.checkpoint.pieces import PiecesSource, encode_placement, scatter_segment
from shardwise.checkpoint.safetensors_stream import SafetensorsWriter
from shardwise.core.errors import CheckpointError
from shardwise.core.placement import Placement

pytestmark = pytest.mark.timeout(60)


def _reference(shape: tuple[int, ...], box: tuple[tuple[int, int], ...], start: int, stop: int) -> np.ndarray:
    full = np.arange(int(np.prod(shape))).reshape(shape)
    inside = (full >= start) & (full < stop)
    out = np.where(inside, full, -1)
    return out[tuple(slice(a, b) for a, b in box)]


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), ()])
def test_scatter_segment_copies_exactly_the_elements_of_the_segment_inside_the_box(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    numel = int(np.prod(shape))
    for _ in range(200):
        box = tuple(tuple(sorted(rng.integers(0, n + 1, 2))) for n in shape)
        start = int(rng.integers(0, numel + 1))
        stop = int(rng.integers(start, numel + 1))
        if not shape:
            box, start, stop = (), 0, int(rng.integers(0, 2))
        values = torch.arange(numel).reshape(-1)[start:stop].clone()
        dst = torch.full(tuple(b - a for a, b in box), -1, dtype=torch.int64)
        count = scatter_segment(values, start, shape, box, dst)
        want = _reference(shape, box, start, stop)
        assert np.array_equal(dst.numpy(), want), (shape, box, start, stop)
        assert count == int((want >= 0).sum())


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    with open(path, "wb") as f:
        out = SafetensorsWriter(f, [(n, "F32", tuple(t.shape)) for n, t in tensors])
        for n, t in tensors:
            out.write(n, memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        out.close()


def _commit(directory: Path, files: list[str], block_size: int = 64) -> None:
    """Write the manifest of ``files`` in ``directory``, with block checksums (small blocks, so the reads
    below cross many block edges and every read is checked)."""
    entries = {f: FileEntry.of_blocks(crc32_blocks(directory / f, block_size)) for f in files}
    write_manifest(directory, Manifest(0, len(files), entries))


def _pieced(tmp_path: Path, full: torch.Tensor, layouts: list[tuple[Placement, list[int]]],
            drop: int = -1) -> PiecesSource:
    """A checkpoint of ``full`` saved as ``layouts``: each placement's local tensor cut at the given
    element offsets into flat pieces, spread over two files; piece number ``drop`` left out."""
    files = ["a.safetensors", "b.safetensors"]
    stored: list[list[tuple[str, torch.Tensor]]] = [[], []]
    pieces = []
    n = 0
    for placement, cuts in layouts:
        local = take(full, placement).reshape(-1)
        bounds = [0] + cuts + [local.numel()]
        for a, b in zip(bounds, bounds[1:]):
            if n != drop:
                name = f"w#{n}"
                stored[n % 2].append((name, local[a:b]))
                pieces.append([n % 2, name, encode_placement(placement), a, b])
            n += 1
    for file, tensors in zip(files, stored):
        _write(tmp_path / file, tensors)
    _commit(tmp_path, files)
    meta = {"files": files, "tensors": {"w": {"shape": list(full.shape), "dtype": "F32", "pieces": pieces}}}
    return PiecesSource.from_metadata(meta, tmp_path)


def _boxes(shape: tuple[int, ...]):  # noqa: ANN202
    for rows in [(0, shape[0]), (1, shape[0] - 2), (3, 4), (5, shape[0])]:
        for cols in [(0, shape[1]), (2, 7), (0, 1)]:
            yield (slice(*rows), slice(*cols))


def test_any_box_reads_back_from_tensor_parallel_slices_cut_into_zero_shards(tmp_path: Path) -> None:
    full = torch.randn(12, 8)
    qkv = lambda r: Placement("w", (12, 8), dim=0, parts=3, size=2, rank=r)  # noqa: E731
    cols = lambda r: Placement("w", (12, 8), dim=1, size=2, rank=r, transpose=True)  # noqa: E731
    for left, right in ([qkv(0), qkv(1)], [cols(0), cols(1)]):
        source = _pieced(tmp_path, full, [(left, [5, 17]), (right, [30])])
        for box in _boxes((12, 8)):
            assert torch.equal(source.read_box("w", box), full[box]), box
        for target in (qkv(1), cols(0), Placement("w", (12, 8), dim=0, bounds=((2, 9),)), Placement("w", (12, 8))):
            assert torch.equal(source.read("w", target), take(full, target)), target
        assert torch.equal(source.read_rows("w", (12, 8), 3, 7), full[3:7])
        source.close()


def test_flat_pieces_of_a_whole_tensor_are_read_straight_into_the_destination(tmp_path: Path) -> None:
    full = torch.randn(10, 6)
    source = _pieced(tmp_path, full, [(Placement("w", (10, 6)), [7, 31])])
    for start, stop in itertools.combinations([0, 3, 7, 20, 31, 45, 60], 2):
        out = torch.empty(stop - start)
        assert source.read_flat_into("w", start, out)
        assert torch.equal(out, full.reshape(-1)[start:stop])
    assert not source.read_flat_into("w", 0, torch.empty(4, dtype=torch.float64))  # another dtype: the caller casts
    tp = _pieced(tmp_path, full, [(Placement("w", (10, 6), dim=1, size=2, rank=r), []) for r in range(2)])
    assert not tp.read_flat_into("w", 0, torch.empty(4))  # slices: the caller goes through boxes
    source.close()
    tp.close()


def test_a_missing_piece_is_an_error_naming_the_tensor(tmp_path: Path) -> None:
    full = torch.randn(6, 4)
    source = _pieced(tmp_path, full, [(Placement("w", (6, 4)), [10])], drop=1)
    assert torch.equal(source.read_box("w", (slice(0, 2),)), full[:2])  # rows the missing piece does not cover
    with pytest.raises(CheckpointError, match="'w'.*cover 10 of the 24"):
        source.read_box("w", ())
    with pytest.raises(CheckpointError, match="'w'.*cover"):
        source.read_flat_into("w", 0, torch.empty(24))
    with pytest.raises(CheckpointError, match="no tensor 'v'"):
        source.shape("v")
    source.close()


def test_format_1_checkpoints_of_whole_tensors_read_through_the_same_calls(tmp_path: Path) -> None:
    full = torch.randn(6, 4)
    _write(tmp_path / "rank-00000.safetensors", [("w", full)])
    _commit(tmp_path, ["rank-00000.safetensors"])
    source = PiecesSource.from_metadata({"weight_map": {"w": "rank-00000.safetensors"}}, tmp_path)
    assert source.shape("w") == (6, 4) and source.dtype("w") == torch.float32
    assert torch.equal(source.read("w", Placement("w", (6, 4), dim=1, size=2, rank=1)), full[:, 2:])
    out = torch.empty(9)
    assert source.read_flat_into("w", 5, out) and torch.equal(out, full.reshape(-1)[5:14])
    assert torch.equal(source.read_whole("w"), full)
    source.close()
