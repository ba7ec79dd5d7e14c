"""Training steps that create no tensor on the default device behind the user's back (run under mpirun).

Each case builds a small model and its shardwise optimizer, takes two warm-up steps
(bucket plans, optimizer state and other lazily built buffers), then takes two more
under :class:`~device_guard.FactoryCallsWithoutDevice`: any ``torch.zeros``/``torch.tensor``/...
called from shardwise without a device during a step fails the case, naming file and
line. With CUDA parameters such a tensor would be a CPU tensor meeting CUDA ones (an error,
or a silent host round trip in a collective).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
import shardwise.torch as swt
from device_guard import FactoryCallsWithoutDevice
from shardwise.adapters.torch.embedding import (KeyedJaggedTensor, ShardedEmbeddingBagCollection, SparseOptimizer,
                                                TableConfig, plan_tables)
from shardwise.adapters.torch.parallel.parallelize import parallelize
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.core.layout import ParallelLayout
from shardwise.core.loss_scale import LossScaler

torch.set_num_threads(1)
Step = Callable[[int], float]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def _batch(step: int, comm: Any, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + comm.rank)
    return torch.randn(rows, 12, generator=g), torch.randn(rows, 5, generator=g)


def _dp(world: Any) -> Step:
    model = _model()
    opt = swt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())

    def step(s: int) -> float:
        x, y = _batch(s, world)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def _zero(stage: int) -> Callable[[Any], Step]:
    def build(world: Any) -> Step:
        model = _model()
        opt = ZeroOptimizer(model, torch.optim.Adam, stage=stage, comm=world, clip_grad_norm=0.05,
                            loss_scaler=LossScaler(initial_scale_power=8), lr=1e-2)

        def step(s: int) -> float:
            x, y = _batch(s, world)
            loss = F.mse_loss(model(x), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            return float(loss.detach())
        return step
    return build


def _parallelize(precision: str, zero_stage: int) -> Callable[[Any], Step]:
    def build(world: Any) -> Step:
        layout = ParallelLayout(dp=world.size, zero_stage=zero_stage, precision=precision, gradient_clipping=0.05)
        pm = parallelize(_model(), torch.optim.SGD, layout, loss_fn=F.mse_loss, lr=0.05)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]

        def step(s: int) -> float:
            x, y = _batch(s, world)
            return pm.train_step(x.to(dtype), y.to(dtype))
        return step
    return build


def _embeddings(world: Any) -> Step:
    tables = [TableConfig(name="t0", num_embeddings=41, embedding_dim=4),
              TableConfig(name="t1", num_embeddings=23, embedding_dim=4, pooling="mean")]
    ebc = ShardedEmbeddingBagCollection(tables, plan_tables(tables, world.size), comm=world, seed=3)
    opt = SparseOptimizer(ebc, "rowwise_adagrad", lr=0.05)
    features = [f for t in tables for f in t.feature_names]

    def step(s: int) -> float:
        g = torch.Generator().manual_seed(10 * s + world.rank)
        lengths = torch.randint(0, 3, (len(features) * 4,), generator=g)
        values = torch.cat([torch.randint(0, t.num_embeddings, (int(lengths[k * 4:(k + 1) * 4].sum()),), generator=g)
                            for k, t in enumerate(tables)])
        out = ebc(KeyedJaggedTensor.from_lengths(features, values, lengths))
        loss = sum((v ** 2).sum() for v in out.values())
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


CASES: dict[str, Callable[[Any], Step]] = {
    "dp": _dp,
    "zero1": _zero(1), "zero2": _zero(2), "zero3": _zero(3),
    "parallelize_fp16": _parallelize("fp16", 0),
    "parallelize_zero2_bf16": _parallelize("bf16", 2),
    "embeddings": _embeddings,
}


def steps_name_their_device(backend: str, cases: Sequence[str] = tuple(CASES)) -> None:
    """Every case's steps: no deviceless factory call from shardwise, and finite losses."""
    world = shardwise.init(backend).world
    problems: dict[str, list[str]] = {}
    for name in cases:
        step = CASES[name](world)
        for s in range(2):
            step(s)
        with FactoryCallsWithoutDevice() as guard:
            losses = [step(s) for s in range(2, 4)]
        if not all(math.isfinite(v) for v in losses):
            raise AssertionError(f"{name}: losses {losses}")
        if guard.found:
            problems[name] = sorted(set(guard.found))
    if problems:
        detail = "; ".join(f"{name}: {', '.join(sites)}" for name, sites in problems.items())
        raise AssertionError(f"tensors created without a device during a training step: {detail}")
    print(f"OK rank {world.rank}: {', '.join(cases)}", flush=True)
