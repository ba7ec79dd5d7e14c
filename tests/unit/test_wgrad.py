"""Weight-gradient accumulation fused into the GEMM (shardwise.adapters.torch.parallel.wgrad), one process.

Every case runs several micro-batch backwards and compares the accumulated
gradients with plain autograd on an identical model; the fused path must also
really be taken where it applies (the weight's ``.grad`` keeps its storage and no
``AccumulateGrad`` add runs) and must step aside where it would be visible.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.adapters.torch.parallel.wgrad import DeferredWeightGrads, WeightGradFusion

pytestmark = pytest.mark.timeout(60)


def _pair(bias: bool = True) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=bias), nn.GELU(), nn.Linear(8, 5, bias=bias))
    ref = nn.Sequential(nn.Linear(6, 8, bias=bias), nn.GELU(), nn.Linear(8, 5, bias=bias))
    ref.load_state_dict(model.state_dict())
    return model, ref


def _micro_batches(n: int, shape: tuple[int, ...] = (4, 6)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def _deferred_backward(model: nn.Module, deferred: DeferredWeightGrads, x: torch.Tensor) -> None:
    """Forward ``x`` under fusion into ``deferred`` and backpropagate the output's sum."""
    with WeightGradFusion(deferred):
        out = model(x)
    out.sum().backward()


def _close_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6), (6,)], ids=["2d", "3d", "1d"])
def test_accumulated_gradients_equal_autograd(bias: bool, shape: tuple[int, ...]) -> None:
    model, ref = _pair(bias)
    for x in _micro_batches(4, shape):
        with WeightGradFusion():
            out = model(x)
        out.pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    _close_grads(model, ref)


def test_in_place_path_is_taken_after_the_first_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.adapters.torch.parallel import wgrad

    taken: list[bool] = []
    real = wgrad._accumulates_in_place
    monkeypatch.setattr(wgrad, "_accumulates_in_place", lambda w, dy: taken.append(real(w, dy)) or taken[-1])
    model, ref = _pair()
    for x in _micro_batches(3):
        with WeightGradFusion():
            out = model(x)
        out.sum().backward()
        ref(x).sum().backward()
    # two layers: the first micro-batch creates .grad, the two after it add in place
    assert taken == [False, False, True, True, True, True]
    _close_grads(model, ref)


def test_weight_gradient_is_accumulated_in_its_own_storage() -> None:
    model, _ = _pair()
    xs = _micro_batches(3)
    with WeightGradFusion():
        out = model(xs[0])
    out.sum().backward()
    ptr = model[0].weight.grad.data_ptr()
    adds = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: adds.append(1))
    hooked_ptr = None
    for x in xs[1:]:
        with WeightGradFusion():
            out = model(x)
        out.sum().backward()
        hooked_ptr = model[0].weight.grad.data_ptr()
    assert hooked_ptr == ptr
    # With the hook registered the fused path steps aside: AccumulateGrad runs, so the hook fires each time.
    assert len(adds) == 2
    unhooked = model[2].weight
    before = unhooked.grad.data_ptr()
    with WeightGradFusion():
        out = model(xs[0])
    out.sum().backward()
    assert unhooked.grad.data_ptr() == before


def test_input_gradient_flows_to_earlier_layers_and_inputs() -> None:
    model, ref = _pair()
    x = torch.randn(4, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    for _ in range(2):
        with WeightGradFusion():
            out = model(x)
        out.sum().backward()
        ref(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    _close_grads(model, ref)


def test_checkpointed_regions_take_the_ordinary_path() -> None:
    model, ref = _pair()
    for x in _micro_batches(3):
        with WeightGradFusion():
            out = checkpoint(model, x, use_reentrant=False)
        out.pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    _close_grads(model, ref)


def test_frozen_weights_autocast_and_double_backward_are_left_to_autograd() -> None:
    model, ref = _pair()
    model[0].weight.requires_grad_(False)
    ref[0].weight.requires_grad_(False)
    for x in _micro_batches(2):
        with WeightGradFusion():
            out = model(x)
        out.sum().backward()
        ref(x).sum().backward()
    assert model[0].weight.grad is None
    _close_grads(model, ref)

    model, ref = _pair()
    x = _micro_batches(1)[0]
    with WeightGradFusion(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = ref(x)
    out.float().sum().backward()
    ref_out.float().sum().backward()
    _close_grads(model, ref)

    model, ref = _pair()
    for m in (model, ref):
        m(x).sum().backward()  # a first gradient exists: the in-place path would apply
    with WeightGradFusion():
        out = model(x)
    (g,) = torch.autograd.grad(out.pow(2).sum(), model[2].weight, create_graph=True)
    (g_ref,) = torch.autograd.grad(ref(x).pow(2).sum(), ref[2].weight, create_graph=True)
    torch.testing.assert_close(g, g_ref)
    g.sum().backward()
    g_ref.sum().backward()
    _close_grads(model, ref)


def test_autograd_grad_returns_the_gradient_and_leaves_grad_alone() -> None:
    model, ref = _pair()
    x = _micro_batches(1)[0]
    for m in (model, ref):
        m(x).sum().backward()
    kept = model[2].weight.grad.clone()
    with WeightGradFusion():
        out = model(x)
    (g,) = torch.autograd.grad(out.pow(2).sum(), model[2].weight)
    (g_ref,) = torch.autograd.grad(ref(x).pow(2).sum(), ref[2].weight)
    torch.testing.assert_close(g, g_ref)
    torch.testing.assert_close(model[2].weight.grad, kept)


def test_deferred_weight_gradients_wait_for_flush_and_then_equal_autograd() -> None:
    model, ref = _pair()
    x = torch.randn(4, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    deferred = DeferredWeightGrads()
    for i, mb in enumerate(_micro_batches(3)):
        with WeightGradFusion(deferred):
            out = model(mb * x)
        out.pow(2).sum().backward()
        ref(mb * x_ref).pow(2).sum().backward()
        if i == 0:  # no .grad yet: autograd creates it, nothing to defer
            assert len(deferred) == 0
            continue
        # the input gradient and the biases are complete; the weights' GEMMs wait in the queue
        torch.testing.assert_close(x.grad, x_ref.grad)
        torch.testing.assert_close(model[0].bias.grad, ref[0].bias.grad)
        assert len(deferred) == 2
        assert not torch.allclose(model[0].weight.grad, ref[0].weight.grad)
        deferred.flush()
        assert len(deferred) == 0
        _close_grads(model, ref)


def test_flush_adds_into_the_gradient_tensors_autograd_would_have_used() -> None:
    model, _ = _pair()
    deferred = DeferredWeightGrads()
    xs = _micro_batches(2)
    model(xs[0]).sum().backward()
    storage = model[2].weight.grad.data_ptr()
    before = model[2].weight.grad.clone()
    _deferred_backward(model, deferred, xs[1])
    torch.testing.assert_close(model[2].weight.grad, before)
    deferred.flush()
    assert model[2].weight.grad.data_ptr() == storage
    assert not torch.equal(model[2].weight.grad, before)


def test_flush_keeps_the_newest_groups_and_runs_the_rest_oldest_first() -> None:
    model, ref = _pair()
    deferred = DeferredWeightGrads()
    xs = _micro_batches(4)
    for m in (model, ref):  # creates .grad: later micro-batches can be deferred
        m(xs[0]).sum().backward()
    snapshots = []
    for mb in xs[1:]:
        _deferred_backward(model, deferred, mb)
        deferred.seal()
        ref(mb).sum().backward()
        snapshots.append(ref[2].weight.grad.clone())
    assert deferred.groups == 3 and len(deferred) == 6
    deferred.flush(keep=2)  # only micro-batch 1's group runs
    assert deferred.groups == 2
    torch.testing.assert_close(model[2].weight.grad, snapshots[0])
    deferred.run_oldest()
    torch.testing.assert_close(model[2].weight.grad, snapshots[1])
    deferred.flush(keep=5)  # fewer groups than kept: nothing runs
    assert deferred.groups == 1
    deferred.flush()
    assert deferred.groups == 0 and len(deferred) == 0
    _close_grads(model, ref)


def test_an_unsealed_group_counts_and_is_sealed_by_flush() -> None:
    model, _ = _pair()
    deferred = DeferredWeightGrads()
    xs = _micro_batches(2)
    model(xs[0]).sum().backward()
    _deferred_backward(model, deferred, xs[1])
    assert deferred.groups == 1  # the open group
    deferred.flush(keep=1)
    assert deferred.groups == 1
    deferred.run_oldest()
    assert deferred.groups == 0
    deferred.run_oldest()  # an empty queue: nothing to do
