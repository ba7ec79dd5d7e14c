"""Background checkpoint saves in one process: phases of the store, the saver's order and errors, staging."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from shardwise import checkpoint as ck
from shardwise.checkpoint.async_save import SINGLE, BackgroundSaver
from shardwise.checkpoint.manifest import MANIFEST_NAME
from shardwise.adapters.torch.checkpoint.staging import HostStaging
from shardwise.checkpoint.store import _write_own, commit_checkpoint, prepare_step_dir
from shardwise.core.errors import CheckpointError


def test_phases_give_what_save_checkpoint_gives(tmp_path: Path) -> None:
    contents = {"a.bin": b"alpha", "b.bin": lambda f: f.write(b"beta")}
    whole = ck.save_checkpoint(tmp_path / "whole", 3, contents, metadata={"x": 1}, keep=2)
    step_dir = prepare_step_dir(tmp_path / "phased", 3)
    assert step_dir.is_dir() and not (step_dir / MANIFEST_NAME).exists()
    entries = _write_own(step_dir, contents)
    assert not (step_dir / MANIFEST_NAME).exists()  # the manifest comes with the commit only
    phased = commit_checkpoint(tmp_path / "phased", 3, entries, metadata={"x": 1}, keep=2)
    a, b = ck.load_checkpoint(whole), ck.load_checkpoint(phased)
    assert a.manifest.files == b.manifest.files and a.metadata == b.metadata == {"x": 1}


def test_commit_with_a_failure_writes_no_manifest_and_raises_it(tmp_path: Path) -> None:
    step_dir = prepare_step_dir(tmp_path, 1)
    with pytest.raises(OSError, match="disk full"):
        commit_checkpoint(tmp_path, 1, None, failure=OSError("disk full"))
    assert not (step_dir / MANIFEST_NAME).exists()
    with pytest.raises(CheckpointError, match="bad checkpoint file name"):
        ck.save_checkpoint(tmp_path, 2, {"../x": b"no"})
    assert not (tmp_path / "ckpt-2" / MANIFEST_NAME).exists()


def _held(saver: BackgroundSaver) -> threading.Event:
    gate = threading.Event()
    saver.write_hook = lambda step_dir: None if gate.wait(30) else pytest.fail("never released")
    return gate


def test_background_save_is_committed_after_the_call_returns(tmp_path: Path) -> None:
    saver = BackgroundSaver(None)
    data = bytearray(b"state at the call")
    gate = _held(saver)
    handle = saver.start(tmp_path, 1, {"s.bin": bytes(data)}, metadata={"step": 1})
    assert saver.mode == SINGLE and not handle.done()
    assert handle.path == tmp_path / "ckpt-1" and not (handle.path / MANIFEST_NAME).exists()
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.05)
    gate.set()
    assert handle.wait() == tmp_path / "ckpt-1" and handle.done()
    assert ck.load_checkpoint(handle.path).read_bytes("s.bin") == b"state at the call"
    assert ck.latest_checkpoint(tmp_path) == handle.path
    assert saver.wait() is None  # nothing in flight any more
    saver.close()


def test_the_next_save_waits_and_keep_prunes_after_the_commit(tmp_path: Path) -> None:
    saver = BackgroundSaver(None)
    saver.write_hook = lambda step_dir: time.sleep(0.3)
    first = saver.start(tmp_path, 1, {"s.bin": b"1"}, keep=1)
    t0 = time.perf_counter()
    saver.write_hook = None
    second = saver.start(tmp_path, 2, {"s.bin": b"2"}, keep=1)
    assert first.done() and time.perf_counter() - t0 > 0.2
    second.wait()
    assert [p.name for _, p in ck.list_checkpoints(tmp_path)] == ["ckpt-2"]
    saver.close()


def test_a_background_error_is_raised_once_by_the_next_wait_or_save(tmp_path: Path) -> None:
    saver = BackgroundSaver(None)

    def broken(step_dir: Path) -> None:
        raise OSError("no space left on device")

    saver.write_hook = broken
    failed = saver.start(tmp_path, 1, {"s.bin": b"1"})
    with pytest.raises(OSError, match="no space"):
        saver.wait()
    assert saver.wait() is None and failed.done() and not (failed.path / MANIFEST_NAME).exists()
    saver.start(tmp_path, 2, {"s.bin": b"2"})
    saver.write_hook = None
    with pytest.raises(OSError, match="no space"):  # raised by the next save, which does not start
        saver.start(tmp_path, 3, {"s.bin": b"3"})
    assert not (tmp_path / "ckpt-3").exists()
    saver.start(tmp_path, 4, None, failure=MemoryError("staging buffers"))
    with pytest.raises(MemoryError, match="staging"):  # a staging failure: raised, nothing touched
        saver.wait()
    assert not (tmp_path / "ckpt-4").exists()
    saver.start(tmp_path, 5, {"s.bin": b"5"}).wait()
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "ckpt-5"
    saver.close()
    with pytest.raises(CheckpointError, match="closed"):
        saver.start(tmp_path, 6, {"s.bin": b"6"})


def test_staging_copies_and_reuses_its_buffers() -> None:
    staging = HostStaging()
    a, b = torch.arange(6, dtype=torch.float32), torch.ones(3, 2, dtype=torch.bfloat16)
    first = staging.stage([("a", a), ("b", b)])
    a.add_(100)
    assert torch.equal(first[0][1], torch.arange(6, dtype=torch.float32))  # a copy, not a view
    assert first[1][1].shape == (6,) and first[1][1].dtype == torch.bfloat16
    again = staging.stage([("a", a), ("b", b)])
    assert all(x.data_ptr() == y.data_ptr() for (_, x), (_, y) in zip(first, again))  # reused
    assert torch.equal(again[0][1], a)
    assert staging.nbytes == 6 * 4 + 6 * 2
    other = staging.stage([("a", a)])
    assert len(other) == 1 and staging.nbytes == 24
