"""All-or-nothing loads on real ranks: a read that fails on one rank fails the load on every rank, unchanged.

Each scenario damages what only one rank reads (bytes flipped inside one rank's shard file,
at the same size, or a read error on one rank's disk), loads, and checks that every rank
raised a :class:`CheckpointError` with the same message naming the failing rank, that no
parameter, optimizer state or generator changed on any rank, and that the same model then
loads the undamaged checkpoint and trains on as one process does.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

import shardwise
from hf_parallel import OPT_ARGS, OPTIMIZER, _batches
from sharded_build import _meta
from shardwise.adapters.torch.parallel.full_tensors import StageTensors
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.adapters.torch.checkpoint.safetensors_torch import TorchSafetensorsFile as SafetensorsFile
from shardwise.core.errors import CheckpointError
from shardwise.core.layout import ParallelLayout


def _state(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every whole tensor of ``pm`` this rank is handed (parameters, masters, optimizer state), and its
    generator state."""
    got: dict[str, torch.Tensor] = {}
    StageTensors(pm).stream(lambda e, t: got.__setitem__(e.key, t.clone()))
    got["rng"] = torch.get_rng_state()
    return got


def _unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], what: str) -> int:
    if before.keys() != after.keys():
        raise AssertionError(f"{what}: the state's tensors changed names")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    if changed:
        raise AssertionError(f"{what}: {len(changed)} of {len(before)} tensors changed, e.g. {changed[:4]}")
    return len(before)


def _refused_alike(world: Any, call: Callable[[], Any], what: str, failing: int) -> str:
    """Run ``call`` on every rank; it must raise CheckpointError on every rank with one message naming
    rank ``failing``."""
    try:
        call()
        message = None
    except CheckpointError as exc:
        message = str(exc)
    every = world.allgather_object(message)
    if any(m is None for m in every):
        raise AssertionError(f"{what}: ranks {[r for r, m in enumerate(every) if m is None]} loaded without error; "
                             f"the others said {[m for m in every if m is not None][:1]}")
    if len(set(every)) != 1:
        raise AssertionError(f"{what}: the ranks raised different errors: {every}")
    if f"rank {failing}" not in every[0]:
        raise AssertionError(f"{what}: the error does not name rank {failing}: {every[0]}")
    return every[0]


def _flip_own_piece(step_dir: Path, rank: int, count: int = 64) -> str:
    """Flip ``count`` bytes in the middle of the biggest piece of rank ``rank``'s file that no other rank
    reads when the same layout loads it (a tensor-parallel slice where there is one), keeping the file's
    size; returns the piece's name."""
    import json
    import struct

    from shardwise.checkpoint.manifest import read_manifest

    meta = read_manifest(step_dir).metadata
    name = f"rank-{rank:05d}.safetensors"
    index = meta["files"].index(name)
    pieces = [(placement[0] is not None, b - a, piece) for info in meta["tensors"].values()
              for f, piece, placement, a, b in info["pieces"] if f == index]
    piece = max(pieces)[2]
    path = step_dir / name
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8: 8 + length])[piece]["data_offsets"]
    at = 8 + length + (begin + end) // 2
    for i in range(at, at + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return piece


class _DiskError:
    """Makes this rank's reads of one file fail as a disk error would (only on this rank)."""

    def __init__(self, name: str) -> None:
        self.name, self.read = name, SafetensorsFile._pread_into

    def __enter__(self) -> "_DiskError":
        name, read = self.name, self.read

        def failing(f: SafetensorsFile, tensor: str, out: Any, offset: int) -> None:
            if f.path.name == name:
                raise OSError(errno.EIO, f"Input/output error reading {f.path}")
            read(f, tensor, out, offset)

        SafetensorsFile._pread_into = failing  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        SafetensorsFile._pread_into = self.read  # type: ignore[method-assign]


def load_checkpoint(backend: str, directory: str, family: str, fields: dict) -> None:
    """``pm.load_checkpoint`` of a checkpoint only one rank cannot read: the same error everywhere, no change.

    ``family`` gives sizes big enough (``"llama:2048:256:512"``) that each rank's file spans several
    checksum blocks, so that bytes flipped in the last rank's own pieces are read by that rank only."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    root = Path(directory)
    batches = _batches(seed=3)
    torch.manual_seed(0)
    pm = parallelize(_meta(family), OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
    pm.train_step(pm.shard_batch(batches[0]))
    saved = pm.save_checkpoint(root / "good", 1)
    at_save = _state(pm)
    pm.train_step(pm.shard_batch(batches[1]))
    failing = world.size - 1
    flipped = root / "flipped" / "ckpt-1"
    if world.rank == 0:
        shutil.copytree(saved, flipped)
        _flip_own_piece(flipped, failing)
    world.barrier()
    before = _state(pm)
    said = _refused_alike(world, lambda: pm.load_checkpoint(flipped), "flipped bytes in one rank's file", failing)
    checked = _unchanged(before, _state(pm), "after the refused load of flipped bytes")
    if world.rank == 0:
        print(f"OK flipped bytes refused on every rank, {checked} tensors unchanged: {said}", flush=True)

    def disk_error() -> None:
        if world.rank == failing:
            with _DiskError(f"rank-{failing:05d}.safetensors"):
                pm.load_checkpoint(saved)
        else:
            pm.load_checkpoint(saved)

    said = _refused_alike(world, disk_error, "a read error on one rank", failing)
    checked = _unchanged(before, _state(pm), "after the refused load of a read error")
    if world.rank == 0:
        print(f"OK a read error on one rank refused on every rank, {checked} tensors unchanged: {said}", flush=True)
    pm.load_checkpoint(saved)
    _unchanged(at_save, _state(pm), "the undamaged checkpoint, loaded after the refusals")
    if world.rank == 0:
        print(f"OK {family} {pm.layout.describe()}: the undamaged checkpoint then loads exactly", flush=True)
    pm.groups.free()


def weights(backend: str, directory: str, family: str, fields: dict) -> None:
    """``parallelize(weights=...)`` whose file only one rank cannot read: the same error on every rank."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    from hf_parallel import build

    path = Path(directory) / f"weights-{family}"
    if world.rank == 0 and not path.exists():
        build(family, seed=7).save_pretrained(str(path), max_shard_size="20KB")  # a sharded index
    world.barrier()
    failing = world.size - 1
    files = sorted(p.name for p in path.glob("model-*.safetensors"))
    # the last rank's read of the last file fails: with any layout some rank reads it
    victim = files[-1]

    def build_it() -> ParallelModel:
        return parallelize(_meta(family), OPTIMIZER, ParallelLayout(**fields), weights=str(path), **OPT_ARGS)

    def disk_error() -> None:
        if world.rank == failing:
            with _DiskError(victim):
                build_it()
        else:
            build_it()

    said = _refused_alike(world, disk_error, "a weights read error on one rank", failing)
    pm = build_it()  # undamaged: builds on every rank
    if world.rank == 0:
        print(f"OK weights {family} {pm.layout.describe()}: a read error on rank {failing} refused on every rank "
              f"({said}); then built", flush=True)
    pm.groups.free()
