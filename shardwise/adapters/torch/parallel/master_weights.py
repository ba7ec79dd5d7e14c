"""An optimizer that steps fp32 copies of bf16 or fp16 parameters, for layouts without ZeRO.

Megatron's ``Float16OptimizerWithFloat16Params``: the model computes in low precision,
the optimizer keeps an fp32 master of every parameter (and its state in fp32), takes
the gradients in fp32 divided by the loss scale, steps the masters and copies them
back into the parameters. Whether a step is applied (fp16: no inf/NaN on any rank) is
decided by the caller, the same on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ....core.loss_scale import LossScaler

__all__ = ["MasterWeightsOptimizer"]


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over fp32 masters of ``params``; ``param_groups`` and ``state`` are the inner
    ones, so learning-rate schedulers drive it like any torch optimizer."""

    def __init__(self, params: Iterable[nn.Parameter], optimizer_class: type, loss_scaler: LossScaler,
                 **kwargs: Any) -> None:
        self.params = list(params)
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._master = {id(p): m for p, m in zip(self.params, self.masters)}
        self.inner = optimizer_class(self.masters, **kwargs)
        self.loss_scaler = loss_scaler
        super().__init__(self.masters, self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def master(self, p: nn.Parameter) -> nn.Parameter:
        """The fp32 master of parameter ``p``."""
        return self._master[id(p)]

    @torch.no_grad()
    def take_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Set every master's gradient to its parameter's, in fp32 and divided by the loss scale;
        returns (parameter, master gradient) pairs."""
        out = []
        scale = self.loss_scaler.scale
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            m.grad = p.grad.float() if scale == 1.0 else p.grad.float().div_(scale)
            out.append((p, m.grad))
        return out

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Step the masters and copy them into the parameters."""
        loss = self.inner.step(closure)
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()
            m.grad = None

    def state_dict(self) -> dict:  # type: ignore[override]
        return {"inner": self.inner.state_dict(), "loss_scaler": self.loss_scaler.state_dict(),
                "masters": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state: dict) -> None:  # type: ignore[override]
        self.inner.load_state_dict(state["inner"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                p.copy_(saved)
