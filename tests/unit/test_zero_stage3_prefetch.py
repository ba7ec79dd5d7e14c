"""ZeRO stage 3 in one process: backward prefetch order, reused and unused units, uniform gathers."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.backends.local import LocalCommunicator
from shardwise.core.comm import Handle


class Recording(LocalCommunicator):
    """Logs each parameter allgather as ("gather" | "prefetch", unit index, uniform)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self.owner: dict[int, int] = {}
        self._blocking = False

    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        self._blocking = True
        try:
            return super().allgather(tensor, name=name, uniform=uniform)
        finally:
            self._blocking = False

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        unit = self.owner.get(tensor.data_ptr())
        if unit is not None:
            self.log.append(("gather" if self._blocking else "prefetch", unit, uniform))
        return super().allgather_async(tensor, name=name, uniform=uniform)


class Chain(nn.Module):
    def __init__(self, reuse: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.unused = nn.Linear(6, 6)
        self.reuse = reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.layers[0](x) if self.reuse else x


def _setup(reuse: bool = False) -> tuple[Chain, ZeroOptimizer, Recording]:
    torch.manual_seed(0)
    model, comm = Chain(reuse), Recording()
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=3, comm=comm, lr=0.1)
    comm.owner = {u.shard.data_ptr(): u.index for u in opt.units}
    for unit in opt.units:
        for p in unit.params:
            p.register_post_accumulate_grad_hook(lambda p, i=unit.index: comm.log.append(("grad", i)))
    return model, opt, comm


def test_backward_prefetches_the_previous_unit_before_this_units_gradients() -> None:
    model, opt, comm = _setup()
    index = {id(u.module): u.index for u in opt.units}
    first, last = index[id(model.layers[0])], index[id(model.layers[3])]
    for step in range(2):  # the first step too: backward uses this step's forward order
        loss = model(torch.ones(2, 6)).sum()
        comm.log.clear()
        loss.backward()
        order = [index[id(model.layers[k])] for k in (3, 2, 1, 0)]
        gathers = [e[1] for e in comm.log if e[0] in ("gather", "prefetch")]
        assert gathers == order, f"step {step}: gathers in backward {comm.log}"
        assert comm.log[0] == ("gather", last, True)
        for k in range(3):  # unit k+1 of the backward order is requested before unit k's gradients
            ask = comm.log.index(("prefetch", order[k + 1], True))
            assert ask < comm.log.index(("grad", order[k])), comm.log
        assert first in [e[1] for e in comm.log if e[0] == "grad"]
        assert all(u.pending is None and not u.gathered for u in opt.units), "prefetch left behind"
        opt.step()
        opt.zero_grad()


def test_reused_and_unused_units_match_plain_autograd() -> None:
    model, opt, comm = _setup(reuse=True)
    torch.manual_seed(0)
    ref = Chain(reuse=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert all(u.pending is None for u in opt.units)
    got = opt.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), msg=name)
