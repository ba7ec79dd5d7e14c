"""Horovod semantics of ``shardwise.torch`` that Horovod's own suite checks, as the project's scenarios.

Each rank asserts; a failure aborts the job with the rank's traceback (see mpi_harness).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

import shardwise.torch as hvd
from torch_dp import _expect


def _eq(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want), f"{what}: got {got}, want {want}"


def errors_keep_ranks_in_step() -> None:
    """Each error case fails on every rank with the suite's exception type; the next call works."""
    hvd.init()
    r, p = hvd.rank(), hvd.size()
    ok = torch.ones(3)
    cases = [
        ("shape", lambda: hvd.allreduce(torch.ones([17 + r] * 3))),
        ("rank", lambda: hvd.allreduce(torch.ones(17, 23 * 57) if r == 0 else torch.ones(17, 23, 57))),
        ("dtype", lambda: hvd.allreduce(torch.ones(4, dtype=torch.int32 if r % 2 else torch.float32))),
        ("allgather dims", lambda: hvd.allgather(torch.ones(2, 3 + r))),
        ("broadcast root", lambda: hvd.broadcast(torch.ones(3), r)),
        ("broadcast shape", lambda: hvd.broadcast(torch.ones(3 + r), 0)),
        ("alltoall dims", lambda: hvd.alltoall(torch.ones(2 * p, 10 * (r + 1)))),
        ("reducescatter dtype", lambda: hvd.reducescatter(torch.ones(2 * p, dtype=torch.int64 if r else
                                                                     torch.float32))),
        ("grouped", lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(2 + r)])),
        ("op", lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max)),
        ("prescale", lambda: hvd.allreduce(torch.ones(2), prescale_factor=1.0 + r)),
    ]
    for what, call in cases:
        message = _expect(RuntimeError, "", call)
        assert "Mismatched" in message or "root" in message, (what, message)
        _eq(hvd.allreduce(ok, op=hvd.Sum), torch.full((3,), float(p)), f"allreduce after the {what} error")
    # local errors: the same exception everywhere, nothing sent
    _expect(ValueError, "divisible", lambda: hvd.alltoall(torch.ones(p + 1)))
    _expect(ValueError, "sum", lambda: hvd.alltoall(torch.ones(p - 1), torch.ones(p, dtype=torch.int32)))
    _expect(ValueError, "integers", lambda: hvd.alltoall(torch.ones(p), torch.ones(p)))
    _expect(ValueError, "scalar", lambda: hvd.reducescatter(torch.tensor(1.0)))
    _expect(RuntimeError, "Adasum", lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum))
    # a name in flight twice on one rank; ranks submit in different orders (matched by name)
    t = torch.ones(5)
    if r == 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        _expect(ValueError, "already in flight", lambda: hvd.allreduce_async(t, name="dup"))
    hvd.barrier()
    if r != 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        _expect(ValueError, "already in flight", lambda: hvd.allreduce_async(t, name="dup"))
    hvd.barrier()
    _eq(hvd.synchronize(first), torch.full((5,), float(p)), "the first 'dup' completes")
    a = hvd.allreduce_async(torch.full((2,), float(r)), name="a", op=hvd.Sum)
    b = hvd.allreduce_async(torch.full((3,), 1.0), name="b", op=hvd.Sum)
    if r % 2:
        a, b = b, a
    got = sorted((hvd.synchronize(a).tolist(), hvd.synchronize(b).tolist()), key=len)
    assert got == [[float(sum(range(p)))] * 2, [float(p)] * 3], got
    hvd.shutdown()


def join_and_scaling() -> None:
    """join(): zeros from joined ranks in allreduce, errors for allgather/broadcast; Horovod's scaling."""
    hvd.init()
    r, p = hvd.rank(), hvd.size()
    for first in range(p):
        tensor = torch.arange(10, dtype=torch.int32) * 3 + 1
        if r == first:
            last = hvd.join()
        else:
            averaged = hvd.allreduce(tensor, name="joined")
            _eq(averaged, (tensor * (p - 1)).div(p, rounding_mode="trunc"), "allreduce with a joined rank")
            _expect(RuntimeError, "joined", lambda: hvd.allgather(tensor))
            last = hvd.join()
        assert last != first or p == 1
        assert hvd.allgather_object(last) == [last] * p
    # prescale/postscale on integers and halves scale in float64 / float32, then cast back
    for dtype in (torch.int32, torch.int64, torch.float16, torch.float32):
        x = (torch.arange(8) - 3).to(dtype)
        pre = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.37)
        wide = torch.float64 if not dtype.is_floating_point else torch.float32 if dtype == torch.float16 else dtype
        _eq(pre, ((x.to(wide) * 0.37).to(dtype)) * p, f"prescale {dtype}")
        post = hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.37)
        _eq(post, ((x.to(wide) * p) * 0.37).to(dtype), f"postscale {dtype}")
    hvd.shutdown()


def grouped_sparse_timeline() -> None:
    """Grouped ops as one request, sparse allreduce, process sets, the timeline file."""
    hvd.init()
    r, p = hvd.rank(), hvd.size()
    xs = [torch.full((k + 1,), float(r + k)) for k in range(3)] + [torch.ones(2, dtype=torch.int64)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    for k in range(3):
        _eq(outs[k], torch.full((k + 1,), float(sum(q + k for q in range(p)))), f"grouped allreduce {k}")
    _eq(outs[3], torch.full((2,), p, dtype=torch.int64), "grouped allreduce of a second dtype")
    same = [x.clone() for x in xs]
    done = hvd.synchronize(hvd.grouped_allreduce_async_(same, op=hvd.Sum))
    assert all(d is x for d, x in zip(done, same)), "the in-place grouped allreduce returns its inputs"
    for k, (x, want) in enumerate(zip(same, outs)):
        _eq(x, want, f"in-place grouped allreduce {k}")
    apart = hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Sum))
    assert all(a is not x for a, x in zip(apart, xs)), "the out-of-place grouped allreduce makes new tensors"
    _eq(apart[0], outs[0], "out-of-place grouped allreduce, async")
    gathered = hvd.grouped_allgather([torch.full((r + 1, 2), float(r)), torch.full((1,), float(r))])
    _eq(gathered[1], torch.arange(p, dtype=torch.float32), "grouped allgather")
    assert gathered[0].shape == (p * (p + 1) // 2, 2)
    scattered = hvd.grouped_reducescatter([torch.ones(2 * p), torch.ones(p, 3)], op=hvd.Sum)
    _eq(scattered[0], torch.full((2,), float(p)), "grouped reducescatter")
    assert scattered[1].shape == (1, 3)
    dense = torch.zeros(6, 3)
    dense[r % 6, 1] = 1.0 + r
    reduced = hvd.synchronize(hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Average))
    assert torch.allclose(reduced.to_dense(), hvd.allreduce(dense)), "sparse allreduce"
    if p > 1:
        odd = hvd.add_process_set(list(range(1, p, 2)))
        even = hvd.add_process_set(list(range(0, p, 2)))
        mine = odd if r % 2 else even
        _eq(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=mine),
            torch.full((2,), float(mine.size())), "process set allreduce")
        _eq(hvd.broadcast(torch.full((1,), float(r)), mine.ranks[-1], process_set=mine),
            torch.full((1,), float(mine.ranks[-1])), "process set broadcast from a global root rank")
        hvd.barrier(process_set=mine)
        assert hvd.remove_process_set(odd) and hvd.remove_process_set(even)
    with tempfile.TemporaryDirectory() as tmp:
        path = hvd.broadcast_object(os.path.join(tmp, "timeline.json"))
        hvd.start_timeline(path, mark_cycles=True)
        hvd.allreduce(torch.ones(3), name="traced")
        hvd.stop_timeline()
        if r == 0:
            text = open(path).read()
            json.loads(text)
            for needed in ("allreduce.traced", "NEGOTIATE_ALLREDUCE", "CYCLE_START",
                           "start_time_since_epoch_in_micros"):
                assert needed in text, needed
        hvd.barrier()
    hvd.shutdown()
    hvd.init()  # re-initialising after shutdown works, as the suite does between tests
    _eq(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(p)), "allreduce after re-init")
    hvd.shutdown()
