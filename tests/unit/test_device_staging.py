"""Host staging of tensors for the host-memory engines (mpi, local): CPU behaviour everywhere,
the CUDA path (pinned buffers, copies on the caller's stream) where a GPU is present."""

from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np
import pytest
import torch

from shardwise.backends._arrays import empty_like_host, finalize, host_view
from shardwise.backends._device_staging import caller_stream
from shardwise.backends._worker import OrderedWorker
from shardwise.backends.local import LocalCommunicator

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_contiguous_cpu_tensors_are_viewed_not_copied() -> None:
    t = torch.arange(12, dtype=torch.float32)
    view = host_view(t)
    assert view.writeback is None
    view.array[0] = 42.0
    assert t[0].item() == 42.0


def test_non_contiguous_cpu_tensor_is_copied_and_written_back() -> None:
    base = torch.zeros(4, 6)
    t = base[:, ::2]
    view = host_view(t)
    assert view.writeback is not None
    view.array[...] = 7.0
    assert base.sum().item() == 0.0
    view.publish()
    assert torch.equal(t, torch.full((4, 3), 7.0)) and base[:, 1::2].sum().item() == 0.0


def test_worker_runs_calls_under_a_stream_context_and_in_order() -> None:
    worker = OrderedWorker("test-staging")
    seen: list[tuple[int, str]] = []
    handles = [worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i, "call", 10.0)
               for i in range(5)]
    assert [h.wait() for h in handles] == list(range(5))
    assert [i for i, _ in seen] == list(range(5))
    assert all(name.startswith("test-staging") for _, name in seen)
    worker.shutdown()


def test_caller_stream_is_a_no_op_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    factory = caller_stream()
    assert factory is contextlib.nullcontext  # nothing captured: CUDA was never initialised
    ran: list[object] = []
    with factory() as entered:
        ran.append(entered)
    assert ran == [None]
    # Entered on the worker thread the collectives run on, it is a no-op there as well.
    worker = OrderedWorker("test-caller-stream")
    handle = worker.submit(lambda: factory().__enter__(), "call", 10.0)
    assert handle.wait() is None
    worker.shutdown()
    assert not torch.cuda.is_initialized()  # asking for the caller's stream did not initialise CUDA
    monkeypatch.delitem(sys.modules, "torch")  # numpy users: torch never imported
    assert caller_stream() is contextlib.nullcontext


@cuda
def test_cuda_tensor_is_staged_in_pinned_memory_and_written_back() -> None:
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    view = host_view(t)
    assert view.writeback is not None
    assert torch.from_numpy(view.array).is_pinned()
    np.testing.assert_array_equal(view.array, np.arange(1 << 16, dtype=np.float32))
    view.array *= 2
    view.publish()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(t, 2 * torch.arange(1 << 16, dtype=torch.float32, device="cuda"))


@cuda
def test_cuda_output_is_filled_on_host_then_moved_to_the_device() -> None:
    x = torch.ones(3, 5, device="cuda", dtype=torch.bfloat16)
    out, dst = empty_like_host(x, (6, 5))
    assert torch.from_numpy(dst.array).is_pinned()
    dst.array[...] = host_view(torch.full((6, 5), 3.0, dtype=torch.bfloat16)).array
    result = finalize(out)
    assert result.device.type == "cuda" and result.dtype == torch.bfloat16
    assert torch.equal(result.cpu(), torch.full((6, 5), 3.0, dtype=torch.bfloat16))


@cuda
def test_local_backend_collectives_on_cuda_follow_the_current_stream() -> None:
    comm = LocalCommunicator()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.randn(1 << 20, device="cuda")
        x.mul_(3.0)  # queued on `stream`: staging must wait for it
        got = comm.allgather(x)
        total = comm.allreduce(x)
    stream.synchronize()
    assert got.device.type == "cuda" and torch.equal(got, x) and torch.equal(total, x)
