"""ZeRO stages 2/3 write linear layers' weight gradients straight into the flat buffer (zero/fusion.py), one process."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.adapters.torch.zero import fusion
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.backends.local import LocalCommunicator


class Block(nn.Module):
    """Two linear layers, the first applied twice; with ``mixed`` its weight also feeds another op."""

    def __init__(self, mixed: str) -> None:
        super().__init__()
        self.first, self.second, self.mixed = nn.Linear(6, 6), nn.Linear(6, 6), mixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.second(torch.tanh(self.first(x)))
        x = torch.tanh(self.first(x))  # the same weight a second time
        if self.mixed == "op":
            x = x + self.first.weight.pow(2).sum() * 0.01
        elif self.mixed == "list":
            x = x + torch.stack([self.first.weight, self.second.weight]).pow(2).sum() * 0.01
        return x


class Twice(nn.Module):
    def __init__(self, mixed: str = "", ckpt: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(mixed) for _ in range(3))
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            # Checkpoint the middle block: it is recomputed in backward, where nothing is fused.
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt and i == 1 else block(x)
        return x.pow(2).mean()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).backward()
        opt.step()


def _pair(stage: int, **kw):
    torch.manual_seed(0)
    model = Twice(**kw)
    ref = Twice(**kw)
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.Adam, stage=stage, comm=LocalCommunicator(), lr=0.01, bucket_cap_bytes=160)
    return model, opt, ref, torch.optim.Adam(ref.parameters(), lr=0.01)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kw", [{}, {"mixed": "op"}, {"mixed": "list"}, {"ckpt": True}],
                         ids=["twice", "mixed", "mixed-in-a-list", "checkpointed"])
def test_fused_weight_gradients_equal_autograd(stage, kw, monkeypatch):
    fused = []
    real = fusion._LinearIntoBuffer.backward
    monkeypatch.setattr(fusion._LinearIntoBuffer, "backward",
                        staticmethod(lambda ctx, dy: fused.append(1) or real(ctx, dy)))
    model, opt, ref, ref_opt = _pair(stage, **kw)
    _train(model, opt)
    _train(ref, ref_opt)
    expected = dict(ref.named_parameters())
    for name, p in opt.full_parameters().items():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    if kw.get("ckpt"):
        assert len(fused) == 3 * 3 * 2, "the two blocks not checkpointed were fused"
    else:
        assert len(fused) == 3 * 3 * 3, "every linear weight gradient went through the fused GEMM"


@pytest.mark.parametrize("stage", [2, 3])
def test_fused_weights_get_no_separate_gradient_tensor(stage, monkeypatch):
    from shardwise.adapters.torch.zero.units import ZeroUnit

    taken = []
    real = ZeroUnit.take_grad

    def take_grad(unit, position, flat, add=False):
        if unit.params[position].grad is not None:
            taken.append(unit.names[position])
        real(unit, position, flat, add)

    monkeypatch.setattr(ZeroUnit, "take_grad", take_grad)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=LocalCommunicator(), lr=0.1)
    model(torch.randn(3, 6)).pow(2).mean().backward()
    opt.step()
    assert sorted(taken) == ["0.bias", "2.bias"], "only the biases went through .grad"


def test_fusion_can_be_turned_off_and_gives_the_same_step():
    results = []
    for fuse in (True, False):
        torch.manual_seed(0)
        model = Twice(mixed="op")
        opt = ZeroOptimizer(model, torch.optim.Adam, stage=3, comm=LocalCommunicator(), lr=0.01,
                            fuse_weight_grads=fuse)
        _train(model, opt)
        results.append(opt.full_parameters())
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-6, atol=1e-7, msg=name)


def test_inference_and_a_failing_forward_leave_no_mode_behind():
    model = Twice()
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=3, comm=LocalCommunicator(), lr=0.1)
    depth = torch._C._len_torch_function_stack()
    with torch.no_grad():
        model(torch.randn(2, 6))
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong width: the first linear layer raises inside the mode
    assert torch._C._len_torch_function_stack() == depth
    model(torch.randn(2, 6)).backward()
    opt.step()


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_a_forward_never_backpropagated_does_not_hold_up_the_next_backward(keep):
    model, opt, ref, ref_opt = _pair(3)
    metric = model(torch.randn(2, 6))  # a forward for a metric, with gradients on and no backward
    if not keep:
        del metric
        assert not opt.reducer.fused_due, "the freed graph withdrew its fused shares"
    reducer, sweeping, early = opt.reducer, [False], []
    real_start, real_end = reducer._start, reducer._end_of_backward

    def start(unit):
        if unit.index not in reducer.started and not sweeping[0]:
            early.append(unit.index)  # started from its last gradient, not from the end-of-backward sweep
        real_start(unit)

    def end_of_backward():
        sweeping[0] = True
        real_end()
        sweeping[0] = False

    reducer._start, reducer._end_of_backward = start, end_of_backward
    _train(model, opt)
    _train(ref, ref_opt)
    expected = dict(ref.named_parameters())
    for name, p in opt.full_parameters().items():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    if not keep:
        assert len(early) == 3 * len(opt.units), "every unit of every step reduced as soon as it was complete"


@pytest.mark.parametrize("stage, how", [(2, "retain_graph"), (2, "gradient_penalty"), (3, "gradient_penalty")])
def test_graphs_backpropagated_twice_or_differentiated_equal_autograd(stage, how):
    # (Stage 3 frees a unit's parameters once its gradients are reduced: a graph cannot be run twice there.)
    model, opt, ref, ref_opt = _pair(stage)
    for m, o in ((model, opt), (ref, ref_opt)):
        for step in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step)).requires_grad_()
            o.zero_grad()
            loss = m(x)
            if how == "retain_graph":
                loss.backward(retain_graph=True)
                loss.backward()  # the same graph again: its gradients add up
            else:
                (dx,) = torch.autograd.grad(loss, x, create_graph=True)
                (loss + dx.pow(2).sum()).backward()
            o.step()
    expected = dict(ref.named_parameters())
    for name, p in opt.full_parameters().items():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6, msg=name)
