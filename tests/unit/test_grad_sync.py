"""The gradient synchroniser in one process: gradients stored once, buckets rebuilt in ready order.

Numerics across real ranks are covered by tests/distributed/torch_dp.py; here the
communicator is the single-process one, so what is checked is where gradients
live and how buckets are planned.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.adapters.torch.grad_sync import GradientSynchronizer
from shardwise.adapters.torch.ops import Average
from shardwise.backends.local import LocalCommunicator

pytestmark = pytest.mark.timeout(60)


class UsedBackwards(nn.Module):
    """Registered first, used last: reverse registration order is not the order gradients arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.mid = nn.Linear(16, 16)
        self.stem = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.stem(x)))))


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model, ref = UsedBackwards(), UsedBackwards()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: what the gradients really occupy."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _step(model: nn.Module, sync: GradientSynchronizer, opt: torch.optim.Optimizer, x: torch.Tensor,
          set_to_none: bool = True) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    model(x).pow(2).sum().backward()
    sync.synchronize()
    opt.step()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_live_in_their_bucket(set_to_none: bool) -> None:
    model, _ = _pair()
    sync = GradientSynchronizer(model.named_parameters(), LocalCommunicator(), bucket_cap_bytes=1200)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for step in range(3):
        _step(model, sync, opt, torch.randn(4, 8), set_to_none)
        grads = [p.grad for p in model.parameters()]
        buffers = list(sync._buffers)
        held = _storage_bytes([g for g in grads if g is not None] + buffers)
        # One copy: the buckets plus the presence flags riding at the end of the last one.
        assert held == grad_bytes + 4 * len(grads), f"step {step}: {held} B held for {grad_bytes} B of gradients"
        assert _storage_bytes(grads) == _storage_bytes(buffers)


def test_without_bucket_views_gradients_are_stored_twice() -> None:
    model, _ = _pair()
    sync = GradientSynchronizer(model.named_parameters(), LocalCommunicator(), gradient_as_bucket_view=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _step(model, sync, opt, torch.randn(4, 8))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    held = _storage_bytes([p.grad for p in model.parameters()] + list(sync._buffers))
    assert held >= 2 * grad_bytes


def test_buckets_rebuilt_in_ready_order_after_first_step() -> None:
    model, _ = _pair()
    sync = GradientSynchronizer(model.named_parameters(), LocalCommunicator(), bucket_cap_bytes=8 * 4)
    before = [b["params"] for b in sync.describe()]
    assert before[0] == ["stem.bias"]  # reverse registration: the stem comes first, but is ready last
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _step(model, sync, opt, torch.randn(4, 8))
    after = [name for b in sync.describe() for name in b["params"]]
    assert after[:2] == ["head.bias", "head.weight"]
    assert after[-2:] == ["stem.bias", "stem.weight"] or after[-2:] == ["stem.weight", "stem.bias"]
    first = [b["params"] for b in sync.describe()]
    _step(model, sync, opt, torch.randn(4, 8))
    assert [b["params"] for b in sync.describe()] == first, "buckets are rebuilt once"


def test_rebuilt_bucket_fills_before_backward_ends() -> None:
    model, _ = _pair()
    sync = GradientSynchronizer(model.named_parameters(), LocalCommunicator(), bucket_cap_bytes=300 * 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _step(model, sync, opt, torch.randn(4, 8))
    started = []
    model.stem.weight.register_post_accumulate_grad_hook(lambda _p: started.append(sync.started_buckets))
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    assert started and started[0] >= 1, "the head's bucket should be in flight before the stem's gradient"
    sync.synchronize()


@pytest.mark.parametrize("passes", [1, 2])
def test_training_matches_plain_torch(passes: int) -> None:
    model, ref = _pair(1)
    sync = GradientSynchronizer(model.named_parameters(), LocalCommunicator(), bucket_cap_bytes=500,
                                backward_passes_per_step=passes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=step % 2 == 0)
        for micro in range(passes):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            model(x).pow(2).sum().backward()
            ref(x).pow(2).sum().backward()
        sync.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_disabled_rebuild_keeps_the_first_plan() -> None:
    model, _ = _pair()
    sync = GradientSynchronizer(model.named_parameters(), LocalCommunicator(), bucket_cap_bytes=8 * 4,
                                rebuild_buckets=False)
    before = sync.describe()
    _step(model, sync, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(4, 8))
    assert sync.describe() == before


def test_sparse_gradients_stay_sparse() -> None:
    torch.manual_seed(0)
    emb, ref = nn.Embedding(10, 4, sparse=True), nn.Embedding(10, 4, sparse=True)
    ref.load_state_dict(emb.state_dict())
    sync = GradientSynchronizer(emb.named_parameters(), LocalCommunicator())
    for step in range(2):
        idx = torch.tensor([1, 3, 3, step])
        emb.zero_grad()
        ref.zero_grad()
        emb(idx).sum().backward()
        ref(idx).sum().backward()
        sync.synchronize()
        assert emb.weight.grad.is_sparse
        torch.testing.assert_close(emb.weight.grad.to_dense(), ref.weight.grad.to_dense())


class Wide(nn.Module):
    """Two layers whose weights are large enough to get buckets of their own (solo_bytes below)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 16)
        self.unused = nn.Linear(64, 64)  # never called: its gradients stay None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_large_gradients_are_reduced_where_they_lie(set_to_none: bool) -> None:
    torch.manual_seed(0)
    model, ref = Wide(), Wide()
    ref.load_state_dict(model.state_dict())
    sync = GradientSynchronizer(model.named_parameters(), LocalCommunicator(), solo_bytes=1024 * 4)
    solos = {b["params"][0] for b in sync.describe() if len(b["params"]) == 1}
    assert {"a.weight", "b.weight", "unused.weight"} <= solos
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        before = {n: p.grad.data_ptr() for n, p in model.named_parameters() if n.endswith("weight") and p.grad is not None}
        sync.synchronize()
        after = {n: p.grad.data_ptr() for n, p in model.named_parameters() if n in before}
        assert before == after, "a solo gradient is reduced in its own tensor, not copied"
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None or not p.grad.any(), n
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        if set_to_none:
            assert model.unused.weight.grad is None, "a gradient None on every rank stays None"
        opt.step()
        ref_opt.step()
    # Solo buckets own no buffer: the buffers hold only the small parameters (and the presence flags).
    small = sum(p.numel() for n, p in model.named_parameters() if n not in solos)
    assert sum(b.numel() for b in sync._buffers) == small + len(list(model.parameters()))


def test_solo_gradient_that_is_not_contiguous_is_reduced_and_written_back() -> None:
    w, b = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(3))
    sync = GradientSynchronizer([("w", w), ("b", b)], LocalCommunicator(), solo_bytes=1024, op=Average)
    assert sync.describe()[0]["params"] == ["w"] and sync._solo[0]
    grad = torch.randn(64, 64).t()  # a transposed view: not contiguous
    expected = grad.clone()
    w.grad, b.grad = grad, torch.ones(3)
    sync._on_grad(1)
    sync._on_grad(0)
    sync.synchronize()
    torch.testing.assert_close(w.grad, expected)
    torch.testing.assert_close(b.grad, torch.ones(3))


def test_rebuild_gives_a_gradient_that_leaves_a_bucket_a_tensor_of_its_own() -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.head, model.mid, model.stem = nn.Linear(16, 3, bias=False), nn.Linear(16, 16, bias=False), \
        nn.Linear(8, 16, bias=False)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model.head(torch.relu(model.mid(torch.relu(model.stem(x)))))

    sync = GradientSynchronizer(model.named_parameters(), LocalCommunicator(), solo_bytes=48 * 4)
    # Reverse registration: the head comes last and carries the presence flags, so it has a buffer.
    assert [b["params"] for b in sync.describe()][-1] == ["head.weight"] and not sync._solo[-1]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        forward(torch.randn(4, 8)).pow(2).sum().backward()
        sync.synchronize()
        opt.step()
        if step == 0:  # rebuilt in ready order: the head is now first, alone, without a buffer
            assert [b["params"] for b in sync.describe()][0] == ["head.weight"] and sync._solo[0]
        buffers = {buf.untyped_storage().data_ptr() for buf in sync._buffers if buf.numel()}
        assert model.head.weight.grad.untyped_storage().data_ptr() not in buffers
        held = _storage_bytes([p.grad for p in model.parameters()] + list(sync._buffers))
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert held == grad_bytes + 4 * 3, f"step {step}: gradients stored once ({held} B)"
