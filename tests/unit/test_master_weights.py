"""fp32 master weights beside bf16/fp16 parameters (layouts without ZeRO)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shardwise.adapters.torch.parallel.master_weights import MasterWeightsOptimizer  # noqa: E402
from shardwise.core.loss_scale import LossScaler  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _pair(dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.nn.Linear, torch.nn.Linear, MasterWeightsOptimizer]:
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    low = torch.nn.Linear(8, 4).to(dtype)
    low.load_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
    ref.load_state_dict({k: v.to(dtype).float() for k, v in ref.state_dict().items()})
    scaler = LossScaler(dynamic=False, static_scale=scale)
    return ref, low, MasterWeightsOptimizer(low.parameters(), torch.optim.SGD, scaler, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, 1.0), (torch.float16, 1024.0)])
def test_steps_fp32_masters_with_unscaled_gradients_and_copies_them_back(dtype: torch.dtype, scale: float) -> None:
    ref, low, opt = _pair(dtype, scale)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 8)
    for _ in range(3):
        (ref(x).pow(2).mean()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (low(x.to(dtype)).float().pow(2).mean() * scale).backward()
        pairs = opt.take_gradients()
        assert all(g.dtype == torch.float32 for _, g in pairs) and len(pairs) == 2
        opt.step()
        opt.zero_grad()
    for m, r, p in zip(opt.masters, ref.parameters(), low.parameters()):
        assert torch.allclose(m, r, rtol=0.05, atol=0.02)  # fp32 masters track fp32 training
        assert p.dtype == dtype and torch.equal(p, m.to(dtype))  # the parameters are the rounded masters


def test_is_a_torch_optimizer_for_schedulers_and_round_trips_its_state() -> None:
    _, low, opt = _pair(torch.bfloat16)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    assert opt.param_groups[0]["lr"] == 0.1
    low(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.take_gradients()
    opt.step()
    sched.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.05)
    saved = opt.state_dict()
    _, other_low, other = _pair(torch.bfloat16)
    other.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(other.masters, opt.masters))
    assert all(torch.equal(a, b) for a, b in zip(other_low.parameters(), low.parameters()))
    assert torch.equal(other.inner.state[other.masters[0]]["momentum_buffer"],
                       opt.inner.state[opt.masters[0]]["momentum_buffer"])
