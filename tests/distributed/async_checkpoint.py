"""Background checkpoint saves (``save_checkpoint(..., async_save=True)``) on real ranks.

Each scenario builds a small GPT-2 on the meta device at dp2 ZeRO-3 with AdamW (so the files hold
parameter shards, ``exp_avg``, ``exp_avg_sq`` and step counts). The background write is held back
deterministically with the saver's ``write_hook`` (an event the main thread sets, or a sleep),
never by replacing a collective.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import shardwise
from hf_parallel import OPT_ARGS, OPTIMIZER, _batches, build
from shardwise.adapters.torch.parallel.local_pieces import local_pieces
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.checkpoint.manifest import MANIFEST_NAME
from shardwise.adapters.torch.checkpoint.pieces import PiecesSource
from shardwise.checkpoint.store import latest_checkpoint, load_checkpoint
from shardwise.core.errors import CheckpointError
from shardwise.core.layout import ParallelLayout


def _model(layout: Optional[dict] = None, adamw: bool = True) -> ParallelModel:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build("gpt2")
    cls, kwargs = (torch.optim.AdamW, {"lr": 1e-2}) if adamw else (OPTIMIZER, OPT_ARGS)
    return parallelize(model, cls, ParallelLayout(**(layout or {"dp": 2, "zero_stage": 3})), **kwargs)


def _snapshot(pm: ParallelModel) -> dict[tuple, torch.Tensor]:
    """Every piece this rank holds (parameter shards, optimizer state), cloned, by identity."""
    return {lp.ident: lp.values().clone() for lp in local_pieces(pm)}


def _differences(a: dict[tuple, torch.Tensor], b: dict[tuple, torch.Tensor]) -> list[str]:
    bad = [str(k[0]) for k in set(a) ^ set(b)]
    bad += [str(k[0]) for k in a if k in b and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    return bad


def _mutate(pm: ParallelModel, batch: torch.Tensor) -> None:
    """A training step, then +1 on every piece: nothing this rank holds keeps its value."""
    pm.train_step(pm.shard_batch(batch))
    with torch.no_grad():
        for lp in local_pieces(pm):
            lp.values().add_(1)


def _every_tensor(path: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a checkpoint, whole (read by one rank)."""
    meta = load_checkpoint(path).metadata
    source = PiecesSource.from_metadata(meta, path)
    try:
        return {key: source.read_whole(key).clone() for key in sorted(meta["tensors"])}
    finally:
        source.close()


def _gate(pm: ParallelModel) -> threading.Event:
    """Hold the next background write until the returned event is set."""
    gate = threading.Event()

    def hold(step_dir: Path) -> None:
        if not gate.wait(60):
            raise AssertionError("the test never released the background write")

    pm.checkpoint_saver.write_hook = hold
    return gate


def _expect_error(world: Any, call: Callable[[], Any], rank_error: type, needle: str, what: str) -> str:
    try:
        call()
    except Exception as exc:  # the failing rank raises its own error, the others CheckpointError
        want = rank_error if world.rank == 1 else CheckpointError
        if not isinstance(exc, want) or (world.rank != 1 and needle not in str(exc)):
            raise AssertionError(f"{what}: rank {world.rank} raised {type(exc).__name__}: {exc}") from exc
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{what}: no error on rank {world.rank}")


def equal_and_in_flight(backend: str, directory: str) -> None:
    """Async equals sync bit for bit; training changes the state while the save is in flight and the
    checkpoint keeps the state at the call; the next save waits; errors reach every rank;
    ``groups.free()`` finishes the save in flight."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    root = Path(directory) / backend
    batches = _batches(seed=5)
    pm = _model()
    pm.train_step(pm.shard_batch(batches[0]))

    # --- equal to a synchronous save, and the state at the call although training goes on
    before = _snapshot(pm)
    sync_path = pm.save_checkpoint(root / "sync", 1, extra={"next_batch": 1})
    gate = _gate(pm)
    handle = pm.save_checkpoint(root / "async", 1, extra={"next_batch": 1}, async_save=True)
    _mutate(pm, batches[1])  # training goes on while the write is held back
    if handle.done() or (handle.path / MANIFEST_NAME).exists():
        raise AssertionError("the background save finished before its write was released")
    if not _differences(before, _snapshot(pm)):
        raise AssertionError("the mutation changed nothing")
    gate.set()
    async_path = handle.wait()
    if not handle.done() or async_path != root / "async" / "ckpt-1":
        raise AssertionError(f"after wait: done={handle.done()}, path {async_path}")
    pm.checkpoint_saver.write_hook = None
    mode = pm.checkpoint_saver.mode
    ours = f"rank-{world.rank:05d}.safetensors"
    if (sync_path / ours).read_bytes() != (async_path / ours).read_bytes():
        raise AssertionError(f"{ours} of the async save differs from the sync save's")
    compared = 0
    if world.rank == 0:
        a, b = _every_tensor(sync_path), _every_tensor(async_path)
        if set(a) != set(b):
            raise AssertionError(f"tensors differ: {sorted(set(a) ^ set(b))[:5]}")
        for key in a:
            if a[key].dtype != b[key].dtype or not torch.equal(a[key], b[key]):
                raise AssertionError(f"{key}: the async checkpoint differs from the sync one")
        compared = len(a)
        if load_checkpoint(sync_path).manifest.files != load_checkpoint(async_path).manifest.files:
            raise AssertionError("the manifests' file entries differ")
    loaded = {}
    for name, path in (("sync", sync_path), ("async", async_path)):
        pm.load_checkpoint(path)
        loaded[name] = _snapshot(pm)
        bad = _differences(before, loaded[name])
        if bad:
            raise AssertionError(f"loading the {name} checkpoint does not give the state at the save: {bad[:5]}")

    # --- the next save waits for the one in flight
    delay = 0.5
    pm.checkpoint_saver.write_hook = lambda step_dir: time.sleep(delay)
    t0 = time.perf_counter()
    first = pm.save_checkpoint(root / "async", 2, async_save=True)
    returned = time.perf_counter() - t0
    pm.checkpoint_saver.write_hook = None
    pm.save_checkpoint(root / "async", 3)
    waited = time.perf_counter() - t0
    if not first.done() or not (first.path / MANIFEST_NAME).exists():
        raise AssertionError("the next save returned before the save in flight was committed")
    if returned >= delay or waited < delay:
        raise AssertionError(f"async save returned after {returned:.3f} s, the next save after {waited:.3f} s "
                             f"(the write was held {delay} s)")

    # --- an error of one rank's background write reaches every rank, at the next wait or save
    def fail_on_rank_1(step_dir: Path) -> None:
        if world.rank == 1:
            raise OSError("no space left on device (test)")

    pm.checkpoint_saver.write_hook = fail_on_rank_1
    failed = pm.save_checkpoint(root / "async", 4, async_save=True)
    pm.checkpoint_saver.write_hook = None
    message = _expect_error(world, pm.wait_checkpoint, OSError, "rank 1", "wait_checkpoint after a failed write")
    if (failed.path / MANIFEST_NAME).exists():
        raise AssertionError("a checkpoint whose write failed on one rank got a manifest")
    if pm.wait_checkpoint() is not None:
        raise AssertionError("the error was raised twice")
    pm.checkpoint_saver.write_hook = fail_on_rank_1
    pm.save_checkpoint(root / "async", 5, async_save=True)
    pm.checkpoint_saver.write_hook = None
    _expect_error(world, lambda: pm.save_checkpoint(root / "async", 6, async_save=True), OSError, "rank 1",
                  "the save after a failed write")
    if (root / "async" / "ckpt-6").exists():
        raise AssertionError("the save that reported the previous error went on to save")
    again = pm.save_checkpoint(root / "async", 7, async_save=True, keep=2).wait()
    kept = sorted(p.name for p in (root / "async").iterdir() if (p / MANIFEST_NAME).exists())
    if kept != ["ckpt-3", "ckpt-7"] or latest_checkpoint(root / "async") != again:
        raise AssertionError(f"after keep=2 the complete checkpoints are {kept}")

    # --- freeing the groups finishes the save in flight
    pm.checkpoint_saver.write_hook = lambda step_dir: time.sleep(0.3)
    last = pm.save_checkpoint(root / "async", 8, async_save=True)
    pm.groups.free()
    if not (last.path / MANIFEST_NAME).exists():
        raise AssertionError("groups.free() returned before the save in flight was committed")
    if world.rank == 0:
        print(f"OK async {backend} ({mode} commit): {compared} tensors equal to the sync save bit for bit, loads "
              f"give the state at the call; async returned in {returned:.3f} s, the next save waited "
              f"{waited:.3f} s; rank 0 got: {message}", flush=True)


def deferred_then_kill(directory: str) -> None:
    """In a job whose MPI runs at a lower thread level than ``MPI_THREAD_MULTIPLE``: the ``mpi``
    backend's saves commit at the next wait (deferred); then, on the ``torch`` backend (a gloo group
    for the background commit), every rank is killed while a background save is in flight."""
    from mpi4py import MPI

    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        raise AssertionError("this job's MPI runs at MPI_THREAD_MULTIPLE: set MPI4PY_RC_THREAD_LEVEL")
    equal_and_in_flight("mpi", str(Path(directory) / "deferred"))
    shardwise.shutdown()
    kill_mid_async_save("torch", str(Path(directory) / "killed"))


def kill_mid_async_save(backend: str, directory: str) -> None:
    """Save step 1 in the background and wait; then SIGKILL every rank while step 2's background
    write is in flight (rank 0's file written, rank 1's held back)."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    root = Path(directory)
    batches = _batches(seed=3)
    pm = _model(adamw=False)  # as sharded_build.resume trains, so that it can resume from step 1
    pm.train_step(pm.shard_batch(batches[0]))
    pm.save_checkpoint(root, 1, extra={"next_batch": 1}, async_save=True).wait()
    pm.train_step(pm.shard_batch(batches[1]))
    if world.rank == 1:
        pm.checkpoint_saver.write_hook = lambda step_dir: time.sleep(120)
    handle = pm.save_checkpoint(root, 2, extra={"next_batch": 2}, async_save=True)
    pm.train_step(pm.shard_batch(batches[2]))  # training goes on
    written = handle.path / "rank-00000.safetensors"
    deadline = time.monotonic() + 60
    while not written.exists():
        if time.monotonic() > deadline:
            raise AssertionError("rank 0 never wrote its file of step 2")
        time.sleep(0.01)
    world.barrier()
    if handle.done():
        raise AssertionError("the save of step 2 finished although rank 1's write is held back")
    print(f"killing rank {world.rank} while the background save is in flight ({pm.checkpoint_saver.mode} "
          f"commit, {backend} backend)", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
