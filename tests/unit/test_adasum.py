"""Adasum (shardwise.core.adasum): the formula on hand-computed cases, then the
vector-halving algorithm on in-process thread groups of 2, 4 and 8 ranks against a
numpy tree of the formula. Real processes: tests/distributed/test_adasum_mp.py."""

from __future__ import annotations

import numpy as np
import pytest

from fake_group import FakeComm, run_group
from shardwise.backends.local import LocalCommunicator
from shardwise.core.adasum import adasum_allreduce, adasum_pair
from shardwise.core.errors import ConfigError, ShapeMismatchError

pytestmark = pytest.mark.timeout(60)


def ref_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The Adasum formula, written out (a coefficient is 1 when its norm is 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    dot, aa, bb = a @ b, a @ a, b @ b
    ca = 1.0 if aa == 0 else 1.0 - dot / (2.0 * aa)
    cb = 1.0 if bb == 0 else 1.0 - dot / (2.0 * bb)
    return ca * a + cb * b


def ref_tree(vectors: list[np.ndarray]) -> np.ndarray:
    """((v0 + v1) + (v2 + v3)) + ... with + the Adasum pair, over a power-of-two count."""
    if len(vectors) == 1:
        return np.asarray(vectors[0], np.float64)
    half = len(vectors) // 2
    return ref_pair(ref_tree(vectors[:half]), ref_tree(vectors[half:]))


def _vector(rank: int, n: int, dtype: str = "float64") -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(n).astype(dtype)


# -- the formula ----------------------------------------------------------------------
HAND_CASES = {
    "orthogonal vectors add": ([3.0, 0.0], [0.0, 4.0], [3.0, 4.0]),
    "identical vectors give the vector": ([1.0, -2.0, 2.0], [1.0, -2.0, 2.0], [1.0, -2.0, 2.0]),
    # dot = -|a|^2 = -|b|^2, so both coefficients are 1.5: 1.5 a - 1.5 a = 0.
    "opposite vectors cancel": ([2.0, 1.0], [-2.0, -1.0], [0.0, 0.0]),
    "zero vector leaves the other": ([0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),
    "two zero vectors": ([0.0, 0.0], [0.0, 0.0], [0.0, 0.0]),
    # a=(1,0), b=(1,1): dot 1, |a|^2 1, |b|^2 2 -> 0.5 a + 0.75 b.
    "45 degrees": ([1.0, 0.0], [1.0, 1.0], [1.25, 0.75]),
    # b = 2a: dot 4, |a|^2 2, |b|^2 8 -> 0 * a + 0.75 * b.
    "parallel, twice as long": ([1.0, 1.0], [2.0, 2.0], [1.5, 1.5]),
}


@pytest.mark.parametrize("case", list(HAND_CASES))
def test_pair_hand_computed(case: str) -> None:
    a, b, want = (np.array(v) for v in HAND_CASES[case])
    np.testing.assert_allclose(ref_pair(a, b), want, rtol=0, atol=1e-15)
    np.testing.assert_allclose(adasum_pair(a, b), want, rtol=0, atol=1e-15)
    np.testing.assert_allclose(adasum_pair(b, a), want, rtol=0, atol=1e-15)


def test_tree_hand_computed() -> None:
    # Two vectors: the pair itself.
    np.testing.assert_allclose(ref_tree([np.array([3.0, 0.0]), np.array([0.0, 4.0])]), [3.0, 4.0])
    # Four orthogonal basis vectors: everything adds.
    np.testing.assert_allclose(ref_tree(list(np.eye(4) * [1.0, 2.0, 3.0, 4.0])), [1.0, 2.0, 3.0, 4.0])
    # Four copies of one vector: the vector.
    v = np.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(ref_tree([v] * 4), v, rtol=1e-15)
    # (e0 + e0) + (e1 + 0): e0 and e1 -> (1, 1).
    e0, e1, zero = np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.zeros(2)
    np.testing.assert_allclose(ref_tree([e0, e0, e1, zero]), [1.0, 1.0])
    # ((1,0) + (1,1)) = (1.25, 0.75); ((0,1) + (0,1)) = (0,1); then dot 0.75, norms 2.125 and 1.
    left, right = np.array([1.25, 0.75]), np.array([0.0, 1.0])
    want = (1 - 0.75 / 4.25) * left + (1 - 0.75 / 2) * right
    got = ref_tree([np.array([1.0, 0.0]), np.array([1.0, 1.0]), e1, e1])
    np.testing.assert_allclose(got, want, rtol=1e-15)


def test_pair_rejects_different_shapes() -> None:
    with pytest.raises(ShapeMismatchError, match=r"\(2,\) and \(3,\)"):
        adasum_pair(np.zeros(2), np.zeros(3))


# -- the algorithm, size 1 ------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_local_backend_returns_a_copy(dtype: str) -> None:
    x = _vector(0, 5, dtype)
    got = adasum_allreduce(LocalCommunicator(), x)
    assert got.dtype == x.dtype and got is not x
    np.testing.assert_array_equal(got, x)
    got[0] += 1
    assert got[0] != x[0]


def test_rejects_non_float_and_non_1d() -> None:
    comm = LocalCommunicator()
    with pytest.raises(ShapeMismatchError, match="floating-point.*int64"):
        adasum_allreduce(comm, np.arange(4))
    with pytest.raises(ShapeMismatchError, match=r"1-D.*\(2, 2\)"):
        adasum_allreduce(comm, np.zeros((2, 2)))


# -- the algorithm on thread groups -------------------------------------------------
@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 8, 1001])
def test_group_matches_tree(size: int, n: int) -> None:
    def body(comm: FakeComm) -> np.ndarray:
        return adasum_allreduce(comm, _vector(comm.rank, n))

    results = run_group(size, body)
    want = ref_tree([_vector(r, n) for r in range(size)])
    for rank, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        assert got.dtype == np.float64 and got.shape == (n,)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"rank {rank}")
        np.testing.assert_array_equal(got, results[0])  # bitwise the same on every rank


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-5), ("float16", 2e-3)])
def test_group_keeps_the_dtype(dtype: str, rtol: float) -> None:
    results = run_group(4, lambda comm: adasum_allreduce(comm, _vector(comm.rank, 50, dtype)))
    want = ref_tree([_vector(r, 50, dtype) for r in range(4)])
    for got in results:
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


def test_group_special_vectors() -> None:
    # Rank 1 has a zero vector, ranks 2 and 3 the same vector, rank 0 one orthogonal to it.
    vecs = [np.array([1.0, 0.0, 0.0, 0.0]), np.zeros(4), np.array([0.0, 2.0, 0.0, 1.0]),
            np.array([0.0, 2.0, 0.0, 1.0])]
    results = run_group(4, lambda comm: adasum_allreduce(comm, vecs[comm.rank]))
    for got in results:
        np.testing.assert_allclose(got, [1.0, 2.0, 0.0, 1.0], rtol=1e-15)


def test_group_input_is_left_alone() -> None:
    def body(comm: FakeComm) -> bool:
        x = _vector(comm.rank, 9)
        adasum_allreduce(comm, x)
        return bool(np.array_equal(x, _vector(comm.rank, 9)))

    assert run_group(4, body) == [True] * 4


@pytest.mark.parametrize("size", [3, 6])
def test_non_power_of_two_is_refused_on_every_rank(size: int) -> None:
    results = run_group(size, lambda comm: adasum_allreduce(comm, np.ones(4)))
    assert all(isinstance(r, ConfigError) and isinstance(r, ValueError) for r in results), results
    assert f"power-of-two number of ranks, got {size}" in str(results[0])
