"""Keras-on-torch gradient overlap (shardwise.adapters.keras.torch_overlap) in one process.

The synchroniser only needs torch parameters behind ``.value``; the communicator is the
single-process one, so what is checked is the bucket plan and where gradients travel.
"""

from __future__ import annotations

import types

import pytest
import torch

from shardwise.adapters.keras.torch_overlap import BackwardOverlap
from shardwise.backends.local import LocalCommunicator
from shardwise.core.buckets import DEFAULT_SOLO_BYTES
from shardwise.core.comm import ReduceOp

pytestmark = pytest.mark.timeout(60)


def _variables(shapes: list[tuple[int, ...]]) -> list[types.SimpleNamespace]:
    torch.manual_seed(0)
    return [types.SimpleNamespace(value=torch.nn.Parameter(torch.randn(s))) for s in shapes]


def test_buckets_start_from_the_last_layer() -> None:
    # 300 floats each, cap 2 KiB: after the 1 MiB first bucket (the last parameter alone
    # fills it), the rest pair up from the back.
    vs = _variables([(300,)] * 5)
    overlap = BackwardOverlap(vs, LocalCommunicator(), ReduceOp.AVERAGE, cap_bytes=2400)
    firsts = [bucket[0] for bucket in overlap.buckets]
    assert firsts == sorted(firsts, reverse=True), overlap.buckets
    assert overlap.buckets[0][0] == 4


def test_large_gradients_are_reduced_in_their_own_tensor() -> None:
    rows = DEFAULT_SOLO_BYTES // 4 // 256
    vs = _variables([(rows, 256), (8,), (rows, 256), (8,)])
    overlap = BackwardOverlap(vs, LocalCommunicator(), ReduceOp.AVERAGE, cap_bytes=25 << 20)
    grads = []
    for v in reversed(vs):  # as autograd would: last layer first
        v.value.grad = torch.randn(v.value.shape)
        grads.append(v.value.grad.clone())
        for hook in [overlap._on_grad]:
            hook(v.value)
    out = overlap.take([v.value.grad for v in vs])
    assert out is not None
    for v, got, want in zip(vs, out, reversed(grads)):
        torch.testing.assert_close(got, want)
        if v.value.numel() * 4 >= DEFAULT_SOLO_BYTES:
            assert got.data_ptr() == v.value.grad.data_ptr(), "a large gradient travels in place"
    for members, flat in zip(overlap.buckets, overlap.flats):
        large = any(vs[i].value.numel() * 4 >= DEFAULT_SOLO_BYTES for i in members)
        assert (flat is None) == large, f"bucket {members}: only small parameters get a buffer"
    overlap.remove()
