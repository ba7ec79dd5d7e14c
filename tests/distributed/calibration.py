"""The planner's memory predictions against what real pipeline ranks hold."""

from __future__ import annotations

import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.parallel import PipelineExecutor, split_sequential
from shardwise.core.cost_model import estimate
from shardwise.core.hardware import Hardware
from shardwise.core.model_spec import ModelSpec
from shardwise.core.pipeline import build_schedule

torch.set_num_threads(1)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def pipeline_memory(backend: str, layers: int = 8, width: int = 96) -> None:
    """Per-stage params + grads + Adam state after a pipeline step, within 10% of the planner."""
    world = shardwise.init(backend=backend).world
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    total = sum(p.numel() for p in model.parameters())
    stage = split_sequential(model, world.size, world.rank)
    schedule = build_schedule("1f1b", world.size, 4)
    pipe = PipelineExecutor(stage, schedule, world, loss_fn=nn.functional.mse_loss,
                            activation_shape=(2, width))
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    pipe.step(torch.randn(8, width, generator=g), torch.randn(8, width, generator=g))
    opt.step()
    params = list(stage.parameters())
    measured = _storage_bytes(params) + _storage_bytes(p.grad for p in params) + _storage_bytes(
        v for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    predicted = estimate(ModelSpec(num_params=total, num_layers=layers, hidden_size=width, seq_len=1,
                                   vocab_size=2, num_heads=1), Hardware(num_devices=world.size),
                         dp=1, pp=world.size, micro_batches=4, global_batch=8, optimizer="adam",
                         precision="fp32").memory
    planned = predicted.params + predicted.grads + predicted.optimizer
    assert abs(planned - measured) <= 0.10 * measured, \
        f"stage {world.rank}: planner predicts {planned} B of model states, measured {measured} B"
