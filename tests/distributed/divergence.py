"""Ranks that run different code: ZeRO-3 modules in different orders, pipelines that disagree.

Each scenario catches the expected :class:`DivergenceError` on every rank, prints it as
``DIVERGENCE rank <r>: <message>`` for the test to read, and then runs one more collective
to show the communicator is still in step (the error came before any mismatched data moved).
A rank that does not raise fails the job; one that hangs is killed by the test's timeout.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.adapters.torch.parallel import pipeline_from_sequential
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.core.comm import Communicator
from shardwise.core.errors import DivergenceError

torch.set_num_threads(1)


class TwoBranches(nn.Module):
    """Modules ``a`` and ``b`` (stage-3 units 0 and 1), run in the order given per forward."""

    def __init__(self, same_size: bool) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6, bias=same_size)
        self.a_first = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if self.a_first else (self.b, self.a)
        return second(torch.tanh(first(x)))


def _caught(comm: Communicator, run: Callable[[], Any]) -> str:
    """Run ``run``, which must raise DivergenceError here; print it; show the group is still in step."""
    try:
        run()
    except DivergenceError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"rank {comm.rank}: the divergence went unnoticed")
    print(f"DIVERGENCE rank {comm.rank}: {message}", flush=True)
    total = comm.allreduce(torch.tensor([float(comm.rank + 1)]), "sum")
    assert float(total[0]) == comm.size * (comm.size + 1) / 2, total
    return message


def zero3_order(backend: str, same_size: bool, agreeing_steps: int = 2) -> None:
    """Stage 3 trains ``agreeing_steps`` steps in one order (prefetch on), then rank 1 swaps a and b."""
    comm = shardwise.init(backend=backend).world
    torch.manual_seed(0)
    model = TwoBranches(same_size)
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=3, comm=comm, lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank))
    for _ in range(agreeing_steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(u.pending is None and not u.gathered for u in opt.units)
    check = opt.units[0].check
    assert bool(check.plan) == (agreeing_steps > 1), check.plan  # on plan from the second step
    model.a_first = comm.rank != 1
    _caught(comm, lambda: model(x))


def pipeline_disagree(backend: str, how: str) -> None:
    """Two pipeline ranks whose schedules differ in ``how``, or (``mode``) one that trains while the other predicts."""
    comm = shardwise.init(backend=backend).world
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    options: dict[str, Any] = {"schedule": "1f1b", "num_microbatches": 4}
    if comm.rank == 1 and how != "mode":
        options.update({"microbatches": {"num_microbatches": 2}, "schedule": {"schedule": "gpipe"},
                        "shape_given": {"activation_shape": (2, 8)}}[how])
    pipe = pipeline_from_sequential(model, comm, F.mse_loss, **options)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    if how == "mode":
        pipe.step(x, y)  # the ranks agree on this one
        _caught(comm, lambda: pipe.step(x, y) if comm.rank == 0 else pipe.predict(x))
    else:
        _caught(comm, lambda: pipe.step(x, y))


def pipeline_pairs_disagree(backend: str) -> None:
    """4 ranks: rank 3 builds interleaved 1F1B, whose ring also connects ranks 3 and 0; the others 1F1B."""
    comm = shardwise.init(backend=backend).world
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    v = 2 if comm.rank == 3 else 1
    pipe = pipeline_from_sequential(model, comm, F.mse_loss, schedule="interleaved" if v > 1 else "1f1b",
                                    num_microbatches=4, virtual_stages=v)
    _caught(comm, lambda: pipe.step(torch.randn(8, 4), torch.randn(8, 4)))


_COLLECTIVES = ("allreduce_async", "reduce_scatter_async", "reduce_scatter_in_place_async", "allgather_async",
                "allgather_into_async", "allgather_into", "broadcast_async", "alltoall_async", "send_async",
                "recv_async", "barrier", "allgather_object", "broadcast_object")


def _counting(comm: Communicator) -> list[str]:
    """Record every collective ``comm`` is asked for from now on (the calls still run)."""
    calls: list[str] = []
    for name in _COLLECTIVES:
        method = getattr(comm, name)

        def counted(*args: Any, _name: str = name, _method: Callable = method, **kwargs: Any) -> Any:
            calls.append(_name)
            return _method(*args, **kwargs)

        setattr(comm, name, counted)
    return calls


def zero_remove_runs_plain(backend: str, stage: int) -> None:
    """After remove(), forward + backward issue no collective, and the gradients are plain autograd's."""
    comm = shardwise.init(backend=backend).world
    sub = comm.duplicate()  # the optimizer's own communicator, counted
    torch.manual_seed(0)
    model = TwoBranches(same_size=False)
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=sub, lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    trained = {n: t.clone() for n, t in opt.full_parameters().items()}
    opt.remove()
    calls = _counting(sub)
    ref = TwoBranches(same_size=False)
    ref.load_state_dict(trained)
    # Rank 1 runs two passes, rank 0 one: a collective among them would pair with nothing.
    for _ in range(comm.rank + 1):
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
    assert calls == [], f"rank {comm.rank}: collectives after remove(): {calls}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name)
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    comm.barrier()
    print(f"REMOVED rank {comm.rank}: plain", flush=True)


if __name__ == "__main__":  # pragma: no cover - run through tests/distributed/_runner.py
    sys.exit("run through tests/distributed/_runner.py")
