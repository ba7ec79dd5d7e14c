"""ZeroOptimizer.remove(): every hook off, a model that then trains as plain torch does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.backends.local import LocalCommunicator
from shardwise.core.comm import Handle


class Counting(LocalCommunicator):
    """A one-rank communicator that counts the collectives it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def allreduce_async(self, tensor: Any, *args: Any, **kwargs: Any) -> Handle:
        self.calls.append("allreduce")
        return super().allreduce_async(tensor, *args, **kwargs)

    def reduce_scatter_async(self, tensor: Any, *args: Any, **kwargs: Any) -> Handle:
        self.calls.append("reduce_scatter")
        return super().reduce_scatter_async(tensor, *args, **kwargs)

    def allgather_async(self, tensor: Any, *args: Any, **kwargs: Any) -> Handle:
        self.calls.append("allgather")
        return super().allgather_async(tensor, *args, **kwargs)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _hook_count(model: nn.Module) -> int:
    tables = 0
    for m in model.modules():
        tables += len(m._forward_pre_hooks) + len(m._forward_hooks)
    for p in model.parameters():
        tables += len(p._post_accumulate_grad_hooks or {})
    return tables


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("fuse", [True, False])
def test_remove_takes_every_hook_off_and_the_model_trains_plain(stage: int, fuse: bool) -> None:
    model, comm = _model(), Counting()
    before = _hook_count(model)
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=comm, lr=0.1, fuse_weight_grads=fuse)
    assert _hook_count(model) > before
    x = torch.randn(4, 5)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    trained = {n: p.detach().clone() for n, p in opt.full_parameters().items()}

    opt.remove()
    opt.remove()  # idempotent
    assert _hook_count(model) == before
    assert all(u.pending is None for u in opt.units)
    for name, p in model.named_parameters():  # complete and equal to the trained values (stage 3 too)
        torch.testing.assert_close(p.detach(), trained[name], msg=name)

    ref = _model()
    ref.load_state_dict({n: t.clone() for n, t in trained.items()})
    comm.calls.clear()
    model(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert comm.calls == [], f"collectives after remove(): {comm.calls}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert opt.step() is None and comm.calls == []


def test_remove_waits_for_a_deferred_publish() -> None:
    model, comm = _model(), Counting()
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=2, comm=comm, lr=0.1, overlap_publish=True)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    opt.remove()
    assert all(u.publishing is None for u in opt.units)
