"""Collective scenarios run on every rank; every result is checked against numpy.

Each rank can regenerate every other rank's input (seeded by rank), so the
reference is computed locally with numpy, exactly.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch

import shardwise
from shardwise.core.comm import split_sizes
from shardwise.core.errors import BackendError

SIZES = (0, 1, 7, 1 << 20)
#: allgather moves 3 columns per row to every rank and has no size-dependent path: its largest
#: case needs to be larger than a huge page, not 1M rows (which cost most of the job's time).
GATHER_SIZES = (0, 1, 7, 1 << 17)
TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
#: The tf backend: TF's CPU collectives take all of these (bfloat16 moves as raw bytes).
TF_DTYPES = TORCH_DTYPES
NUMPY_DTYPES = ("float16", "float32", "float64", "int32", "int64")
OPS = ("sum", "average", "min", "max", "product")


@functools.lru_cache(maxsize=64)
def _values(rank: int, n: int, op: str, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s deterministic input (read-only: made once per argument set, every dtype reuses it)."""
    rng = np.random.default_rng(1000 * rank + 17 * n + salt)
    if op == "product":
        values = rng.choice(np.array([1.0, 2.0, -1.0]), size=n)
    else:
        values = rng.integers(-4, 5, size=n).astype(np.float64)
    values.setflags(write=False)
    return values


def _make(kind: str, dtype: str, values: np.ndarray, shape: tuple[int, ...], mutable: bool = False):
    """An input of ``kind``; ``mutable`` ones can be written in place (TF tensors cannot: a tf.Variable)."""
    if kind == "numpy":
        return values.reshape(shape).astype(dtype)
    if kind == "tf":
        import tensorflow as tf

        t = tf.cast(tf.constant(values.reshape(shape)), dtype)
        return tf.Variable(t) if mutable else t
    return torch.from_numpy(values.reshape(shape).copy()).to(getattr(torch, dtype))


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64).numpy()
    return np.asarray(x.numpy()).astype(np.float64)  # TF tensor or variable


def _reduce(stack: np.ndarray, op: str, dtype: str, size: int) -> np.ndarray:
    if op in ("sum", "average"):
        r = stack.sum(0)
        if op == "average":
            r = np.floor_divide(r, size) if dtype.startswith("int") else r / size
        return r
    return {"min": stack.min(0), "max": stack.max(0), "product": stack.prod(0)}[op]


def _tol(dtype: str) -> float:
    return {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}.get(dtype, 0.0)


def _check(got, want: np.ndarray, dtype: str, what: str) -> None:
    g = _to_numpy(got)
    assert g.shape == want.shape, f"{what}: shape {g.shape} != {want.shape}"
    np.testing.assert_allclose(g, want, rtol=_tol(dtype), atol=_tol(dtype), err_msg=what)


#: With ``core_dtypes`` (the 4-rank jobs: the 2-rank jobs run every dtype): one of each family.
CORE_DTYPES = ("bfloat16", "float32", "int64")


def _kinds(comm, core_dtypes: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    if core_dtypes:
        kinds = _kinds(comm)
        return [(kind, tuple(d for d in dtypes if d in CORE_DTYPES)) for kind, dtypes in kinds]
    if comm.backend == "torch":
        return [("torch", TORCH_DTYPES), ("numpy", ("float32", "int64"))]
    if comm.backend == "tf":
        return [("tf", TF_DTYPES), ("numpy", NUMPY_DTYPES)]
    return [("numpy", NUMPY_DTYPES), ("torch", TORCH_DTYPES)]


def _world(backend: str):
    return shardwise.init(backend=backend).world


def _subgroups(comm):
    """World, a colour split (even/odd ranks) and an explicit-ranks split."""
    groups = [("world", comm)]
    if comm.size > 1:
        groups.append(("color", comm.split(color=comm.rank % 2)))
        members = list(range(comm.size - 1, 0, -1))  # reversed order, rank 0 left out
        sub = comm.split(ranks=members)
        assert (sub is None) == (comm.rank == 0)
        if sub is not None:
            assert sub.rank == members.index(comm.rank) and sub.size == len(members)
            groups.append(("ranks", sub))
    return groups


def _group_ranks(comm, sub) -> list[int]:
    """World ranks of ``sub``'s members in sub-rank order."""
    return [int(r) for r in sub.allgather(np.array([comm.rank], dtype=np.int64))]


# -- scenarios ---------------------------------------------------------------------------------
def allreduce(backend: str, core_dtypes: bool = False) -> None:
    world = _world(backend)
    for label, comm in _subgroups(world):
        members = _group_ranks(world, comm)
        for kind, dtypes in _kinds(comm, core_dtypes):
            for dtype in dtypes:
                for n in SIZES if label == "world" else (7, 1 << 20):
                    for op in OPS:
                        if n == 1 << 20 and op not in ("sum", "average"):
                            continue
                        stack = np.stack([_values(r, n, op) for r in members])
                        want = _reduce(stack, op, dtype, comm.size)
                        mine = stack[comm.rank]
                        x = _make(kind, dtype, mine, (n,))
                        what = f"{label} allreduce {kind} {dtype} n={n} op={op}"
                        got = comm.allreduce(x, op)
                        _check(got, want, dtype, what)
                        _check(x, mine, dtype, what + " (input untouched)")
                        y = _make(kind, dtype, mine, (n,), mutable=True)
                        assert comm.allreduce(y, op, inplace=True) is y
                        _check(y, want, dtype, what + " inplace")
                        h = comm.allreduce_async(_make(kind, dtype, mine, (n,)), op)
                        _check(h.wait(), want, dtype, what + " async")
                        assert h.done()
        # Multidimensional, non-contiguous input.
        base = _values(world.rank, 24, "sum").reshape(4, 6).copy()
        x = base.T
        got = comm.allreduce(x, "sum")
        want = np.stack([_values(r, 24, "sum").reshape(4, 6).T for r in members]).sum(0)
        _check(got, want, "float64", f"{label} non-contiguous")
        comm.allreduce(x, "sum", inplace=True)
        _check(x, want, "float64", f"{label} non-contiguous inplace")


def allgather(backend: str, core_dtypes: bool = False) -> None:
    world = _world(backend)
    for label, comm in _subgroups(world):
        members = _group_ranks(world, comm)
        for kind, dtypes in _kinds(comm, core_dtypes):
            for dtype in dtypes:
                for n in GATHER_SIZES if label == "world" else (0, 7):
                    rows = [n + (r % 3 if n else 0) for r in members]  # first dims differ per rank
                    parts = [_values(r, rows[i] * 3, "sum").reshape(rows[i], 3) for i, r in enumerate(members)]
                    x = _make(kind, dtype, parts[comm.rank], (rows[comm.rank], 3))
                    want = np.concatenate(parts)
                    what = f"{label} allgather {kind} {dtype} n={n}"
                    _check(comm.allgather(x), want, dtype, what)
                    _check(comm.allgather_async(x).wait(), want, dtype, what + " async")
                    # Equal shapes promised: no row agreement, same result.
                    even = [_values(r, n * 3, "sum").reshape(n, 3) for r in members]
                    y = _make(kind, dtype, even[comm.rank], (n, 3))
                    _check(comm.allgather(y, uniform=True), np.concatenate(even), dtype, what + " uniform")
                    _check(comm.allgather_async(y, uniform=True).wait(), np.concatenate(even), dtype,
                           what + " uniform async")
                    if kind != "tf":  # into a preallocated buffer, then in place (from its own block)
                        size = len(members)
                        out = _make(kind, dtype, np.zeros(n * size * 3), (n * size, 3), mutable=True)
                        assert comm.allgather_into_async(out, y).wait() is out
                        _check(out, np.concatenate(even), dtype, what + " into")
                        out = _make(kind, dtype, np.zeros(n * size * 3), (n * size, 3), mutable=True)
                        mine = out[comm.rank * n: (comm.rank + 1) * n]
                        mine[...] = y
                        comm.allgather_into_async(out, mine).wait()
                        _check(out, np.concatenate(even), dtype, what + " into, in place")
        objs = comm.allgather_object({"rank": world.rank})
        assert [o["rank"] for o in objs] == members


def reduce_scatter(backend: str, core_dtypes: bool = False) -> None:
    world = _world(backend)
    for label, comm in _subgroups(world):
        members = _group_ranks(world, comm)
        for kind, dtypes in _kinds(comm, core_dtypes):
            for dtype in dtypes:
                for n in SIZES if label == "world" else (7, 1 << 20):
                    for op in ("sum", "average", "max"):
                        stack = np.stack([_values(r, n, op) for r in members])
                        full = _reduce(stack, op, dtype, comm.size)
                        rows = split_sizes(n, comm.size)
                        start = sum(rows[: comm.rank])
                        want = full[start: start + rows[comm.rank]]
                        x = _make(kind, dtype, stack[comm.rank], (n,))
                        what = f"{label} reduce_scatter {kind} {dtype} n={n} op={op}"
                        _check(comm.reduce_scatter(x, op), want, dtype, what)
                        _check(comm.reduce_scatter_async(x, op).wait(), want, dtype, what + " async")
                        if kind != "tf" and op != "max":  # TF tensors are immutable: nothing to reduce into
                            _in_place(comm, kind, dtype, op, stack, want, start, what)


def _in_place(comm, kind: str, dtype: str, op: str, stack: np.ndarray, want: np.ndarray, start: int,
              what: str) -> None:
    """The result lands in this rank's own rows of the input; the other rows keep their values."""
    x = _make(kind, dtype, stack[comm.rank], (stack.shape[1],))
    mine = _to_numpy(comm.reduce_scatter_in_place_async(x, op).wait())
    _check(mine, want, dtype, what + " in place: result")
    after = _to_numpy(x)
    _check(after[start:start + len(want)], want, dtype, what + " in place: own rows")
    others = np.concatenate([after[:start], after[start + len(want):]])
    before = _to_numpy(_make(kind, dtype, stack[comm.rank], (stack.shape[1],)))
    _check(others, np.concatenate([before[:start], before[start + len(want):]]), dtype, what + " in place: others")



def broadcast(backend: str, core_dtypes: bool = False) -> None:
    world = _world(backend)
    for label, comm in _subgroups(world):
        members = _group_ranks(world, comm)
        for kind, dtypes in _kinds(comm, core_dtypes):
            for dtype in dtypes:
                for n in SIZES if label == "world" else (7,):
                    for root in range(comm.size):
                        want = _values(members[root], n, "sum")
                        mine = _values(world.rank, n, "sum")
                        what = f"{label} broadcast {kind} {dtype} n={n} root={root}"
                        x = _make(kind, dtype, mine, (n,), mutable=True)
                        _check(comm.broadcast(x, root), want, dtype, what)
                        _check(x, mine, dtype, what + " (input untouched)")
                        comm.broadcast(x, root, inplace=True)
                        _check(x, want, dtype, what + " inplace")
                        y = _make(kind, dtype, mine, (n,))
                        _check(comm.broadcast_async(y, root).wait(), want, dtype, what + " async")
        assert comm.broadcast_object({"from": world.rank}, root=comm.size - 1) == {"from": members[-1]}


def alltoall(backend: str, core_dtypes: bool = False) -> None:
    world = _world(backend)
    for label, comm in _subgroups(world):
        members = _group_ranks(world, comm)
        p = comm.size
        for kind, dtypes in _kinds(comm, core_dtypes):
            for dtype in dtypes:
                for rows_each in (0, 1, 7):
                    send = {r: _values(r, p * rows_each * 2, "sum").reshape(p * rows_each, 2) for r in members}
                    x = _make(kind, dtype, send[world.rank], (p * rows_each, 2))
                    want = np.concatenate([send[r][comm.rank * rows_each:(comm.rank + 1) * rows_each]
                                           for r in members])
                    what = f"{label} alltoall {kind} {dtype} rows={rows_each}"
                    _check(comm.alltoall(x), want, dtype, what)
                    _check(comm.alltoall_async(x).wait(), want, dtype, what + " async")
                # Uneven splits: rank i sends (i + j) % 3 rows to rank j.
                splits = {r: [(i + j) % 3 for j in range(p)] for i, r in enumerate(members)}
                send = {r: _values(r, sum(splits[r]) * 2, "sum").reshape(-1, 2) for r in members}
                x = _make(kind, dtype, send[world.rank], send[world.rank].shape)
                pieces = []
                for r in members:
                    off = sum(splits[r][: comm.rank])
                    pieces.append(send[r][off: off + splits[r][comm.rank]])
                _check(comm.alltoall(x, splits=splits[world.rank]), np.concatenate(pieces), dtype,
                       f"{label} alltoall uneven {kind} {dtype}")


def point_to_point(backend: str, core_dtypes: bool = False) -> None:
    world = _world(backend)
    for label, comm in _subgroups(world):
        members = _group_ranks(world, comm)
        p, r = comm.size, comm.rank
        if p == 1:
            continue
        right, left = (r + 1) % p, (r - 1) % p
        for kind, dtypes in _kinds(comm, core_dtypes):
            for dtype in dtypes:
                for n in (0, 1, 7, 1 << 20) if label == "world" else (7,):
                    # Ring: everyone sends right and receives from the left, non-blocking.
                    out = _make(kind, dtype, _values(world.rank, n, "sum"), (n,))
                    buf = _make(kind, dtype, np.zeros(n), (n,), mutable=True)
                    hs = comm.send_async(out, right, tag=3)
                    hr = comm.recv_async(buf, left, tag=3)
                    assert hr.wait() is buf
                    hs.wait()
                    _check(buf, _values(members[left], n, "sum"), dtype, f"{label} ring {kind} {dtype} n={n}")
        # Blocking pairs: even sends first, odd receives first.
        x = np.full(5, float(world.rank))
        y = np.empty(5)
        if p % 2 == 0:
            partner = r + 1 if r % 2 == 0 else r - 1
            if r % 2 == 0:
                comm.send(x, partner, tag=9)
                comm.recv(y, partner, tag=9)
            else:
                comm.recv(y, partner, tag=9)
                comm.send(x, partner, tag=9)
            assert (y == members[partner]).all()
        _duplicate(backend, world, comm, label, members)
        comm.barrier()


def _duplicate(backend: str, world, comm, label: str, members: list[int]) -> None:
    """A duplicate (made by this group's members only) has the same ranks and its own message space.

    Horovod builds process sets with every rank of the job: there a sub-group refuses, on all its
    members and before any communication.
    """
    if backend == "horovod" and comm.size != world.size:
        try:
            comm.duplicate()
        except (BackendError, NotImplementedError) as exc:
            assert "every" in str(exc), exc
            return
        raise AssertionError(f"{label}: duplicating a {backend} sub-group should refuse")
    dup = comm.duplicate()
    assert (dup.rank, dup.size) == (comm.rank, comm.size), f"{label} duplicate: rank/size"
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    a, b = np.full(3, 10.0 * world.rank), np.full(3, 10.0 * world.rank + 1)
    got_a, got_b = np.empty(3), np.empty(3)
    sends = [comm.send_async(a, right, tag=5), dup.send_async(b, right, tag=5)]
    dup.recv(got_b, left, tag=5)  # same peer and tag on both: each message stays on its own communicator
    comm.recv(got_a, left, tag=5)
    for h in sends:
        h.wait()
    assert (got_a == 10.0 * members[left]).all() and (got_b == 10.0 * members[left] + 1).all(), label
    total = dup.allreduce(np.array([float(world.rank)]))
    assert total[0] == sum(members), f"{label} duplicate allreduce: {total}"


def mpi_halving(backend: str = "mpi", core_dtypes: bool = False) -> None:
    """Large float averages on the mpi backend go by recursive halving/doubling (power-of-two groups).

    Checked: the path is taken (and not for sums or a 3-rank group), results match float64
    numpy for odd lengths over several pieces, every rank holds the same bytes, and a user's
    message with the halving's own tag on the original communicator is left alone.
    """
    import shardwise.backends.mpi._reductions as reductions
    from shardwise.backends.mpi._halving import _TAG

    world = _world("mpi")
    calls = []
    real = reductions.halving_allreduce

    def counting(comm, flat, scratch):
        calls.append(flat.size)
        real(comm, flat, scratch)

    reductions.halving_allreduce = counting
    try:
        groups = [("world", world), ("pairs", world.split(color=world.rank // 2))]
        if world.size == 4:
            groups.append(("three", world.split(ranks=[0, 1, 2])))
        for label, comm in groups:
            if comm is None:
                continue
            members = _group_ranks(world, comm)
            p, r = comm.size, comm.rank
            two_power = p > 1 and p & (p - 1) == 0
            n = (3 << 20) + 5  # 12 MiB of float32: three 4 MiB pieces and a 20-byte tail
            inputs = [np.random.default_rng(7 * m + 1).standard_normal(n) for m in members]
            for kind, dtype in (("numpy", "float32"), ("torch", "float32"), ("torch", "bfloat16"),
                                ("numpy", "float64")):
                tol = {"float32": 1e-6, "bfloat16": 1e-2, "float64": 1e-12}[dtype]
                # the mean of the inputs as they were sent (rounded to dtype), in float64
                want = np.mean([_to_numpy(_make(kind, dtype, v, (n,))) for v in inputs], axis=0)
                calls.clear()
                x = _make(kind, dtype, inputs[r], (n,), mutable=True)
                peer = r ^ 1 if two_power else None
                pending = None
                if peer is not None:  # a user message on the halving's tag, posted before the average
                    pending = comm.recv_async(np.zeros(3), peer, tag=_TAG)
                got = comm.allreduce_async(x, "average", inplace=True).wait()
                if peer is not None:
                    comm.send(np.full(3, float(members[r])), peer, tag=_TAG)
                    assert (pending.wait() == members[peer]).all(), f"{label}: user message damaged"
                what = f"{label} halving {kind} {dtype}"
                np.testing.assert_allclose(_to_numpy(got), want, rtol=tol, atol=tol, err_msg=what)
                assert (len(calls) > 1) == two_power, f"{what}: halving calls {calls} in a group of {p}"
                digest = zlib.crc32(_to_numpy(got).tobytes())
                assert len(set(comm.allgather_object(digest))) == 1, f"{what}: ranks hold different bytes"
            calls.clear()
            comm.allreduce(np.ones(n, np.float32), "sum", inplace=True)
            assert not calls, f"{label}: a sum went by halving"
    finally:
        reductions.halving_allreduce = real
    world.barrier()


def scenarios(backend: str, names: list[str], core_dtypes: bool = False) -> None:
    """Run several scenarios one after the other in the same job (one launch instead of one each)."""
    for name in names:
        globals()[name](backend, core_dtypes)
