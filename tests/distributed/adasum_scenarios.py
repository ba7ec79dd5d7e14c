"""Adasum scenarios run on every rank (see test_adasum_mp.py).

Each rank regenerates every other rank's vector (seeded by rank) and checks the
distributed result against a single-process tree of the pairwise formula, whose
own correctness tests/unit/test_adasum.py checks on hand-computed cases.
"""

from __future__ import annotations

import numpy as np

LENGTHS = (1, 7, 1000)
RTOL = {"float64": 1e-10, "float32": 1e-5}


def _vector(rank: int, n: int, dtype: str) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(n).astype(dtype)


def _tree(vectors: list[np.ndarray]) -> np.ndarray:
    """((v0 + v1) + (v2 + v3)) + ..., + being the Adasum pair, in float64."""
    from shardwise.core.adasum import adasum_pair

    if len(vectors) == 1:
        return np.asarray(vectors[0], np.float64)
    half = len(vectors) // 2
    return adasum_pair(_tree(vectors[:half]), _tree(vectors[half:]))


def _check(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype}, expected {dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_allclose(got, want, rtol=RTOL[dtype], atol=RTOL[dtype], err_msg=what)


def allreduce(backend: str) -> None:
    """adasum_allreduce on the world, then hvd.allreduce(op=hvd.Adasum)."""
    import torch

    import shardwise
    import shardwise.torch as hvd
    from shardwise.core.adasum import adasum_allreduce

    hvd.init(backend=backend)
    world = shardwise.current().world
    rank, size = world.rank, world.size
    for dtype in ("float64", "float32"):
        for n in LENGTHS:
            x = _vector(rank, n, dtype)
            got = adasum_allreduce(world, x)
            want = _tree([_vector(r, n, dtype) for r in range(size)])
            _check(got, want, dtype, f"adasum_allreduce {dtype} n={n}")
            # Every rank must hold bitwise the same result.
            every = world.allgather(got.reshape(1, -1))
            assert (every == every[0]).all(), f"adasum_allreduce {dtype} n={n}: ranks disagree"

    for dtype in ("float64", "float32"):
        t = torch.from_numpy(_vector(rank, 15, dtype).reshape(3, 5))
        got = hvd.allreduce(t, op=hvd.Adasum, name=f"adasum.{dtype}")
        want = _tree([_vector(r, 15, dtype) for r in range(size)]).reshape(3, 5)
        assert got.dtype == t.dtype, f"hvd.allreduce Adasum: dtype {got.dtype}, expected {t.dtype}"
        _check(got.numpy(), want, dtype, f"hvd.allreduce(op=hvd.Adasum) {dtype}")
