"""ZeRO scenarios: equivalence with plain data parallelism, memory, resharding checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.core.cost_model import estimate
from shardwise.core.hardware import Hardware
from shardwise.core.model_spec import ModelSpec
from shardwise.adapters.torch.checkpoint.zero import (consolidate_zero_checkpoint, load_zero_checkpoint,
                                             save_zero_checkpoint)

torch.set_num_threads(1)


class Net(nn.Module):
    """Layers as units for stage 3, plus a parameter owned by the root module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 5)])
        self.norm = nn.LayerNorm(32)
        self.scale = nn.Parameter(torch.ones(5))
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        h = self.norm(torch.tanh(self.layers[1](h)))
        return self.frozen(self.layers[2](h) * self.scale)


def _model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _batch(step: int, global_batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(global_batch, 12, generator=g), torch.randn(global_batch, 5, generator=g)


def _local(x: torch.Tensor, comm) -> torch.Tensor:
    per = x.shape[0] // comm.size
    return x[comm.rank * per:(comm.rank + 1) * per]


OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 1e-2}), "momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}


def _train_plain_dp(comm, name: str, steps: int) -> dict[str, torch.Tensor]:
    model = _model()
    cls, kw = OPTIMIZERS[name]
    opt = cls([p for p in model.parameters() if p.requires_grad], **kw)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(_local(x, comm)), _local(y, comm)).backward()
        for p in model.parameters():
            if p.grad is not None:
                comm.allreduce(p.grad, "average", inplace=True)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _train_zero(comm, name: str, stage: int, steps: int, accumulation: int = 1, **kw) -> ZeroOptimizer:
    model = _model()
    cls, hyper = OPTIMIZERS[name]
    opt = ZeroOptimizer(model, cls, stage=stage, comm=comm, measure_memory=True,
                        gradient_accumulation_steps=accumulation, **kw, **hyper)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        xs, ys = _local(x, comm).chunk(accumulation), _local(y, comm).chunk(accumulation)
        for xm, ym in zip(xs, ys):
            nn.functional.mse_loss(model(xm), ym).backward()
        opt.step()
    opt.model_for_test = model
    return opt


def equivalence(backend: str, steps: int = 20) -> None:
    comm = shardwise.init(backend=backend).world
    for name in OPTIMIZERS:
        want = _train_plain_dp(comm, name, steps)
        totals = []
        for stage in (1, 2, 3):
            opt = _train_zero(comm, name, stage, steps)
            got = opt.full_parameters()
            for key, ref in want.items():
                np.testing.assert_allclose(got[key].numpy(), ref.numpy(), rtol=1e-6, atol=1e-7,
                                           err_msg=f"stage {stage} {name} {key}")
            measured, expected = opt.last_state_bytes, opt.expected_state_bytes(name)
            for part in ("params", "grads", "optimizer_states", "total"):
                m, e = getattr(measured, part), getattr(expected, part)
                assert abs(m - e) <= 0.05 * e, f"stage {stage} {name} {part}: measured {m} B, model {e} B"
            totals.append(measured.total)
            # The planner's model states for this layout (its calibration on this machine).
            psi = sum(u.numel for u in opt.units)
            predicted = estimate(ModelSpec(num_params=psi, num_layers=3, hidden_size=32, seq_len=1, vocab_size=5,
                                           num_heads=1), Hardware(num_devices=comm.size), dp=comm.size,
                                 zero=stage, global_batch=comm.size, optimizer=name, precision="fp32").memory
            planned = predicted.params + predicted.grads + predicted.optimizer
            assert abs(planned - measured.total) <= 0.10 * measured.total, \
                f"planner predicts {planned} B of model states for stage {stage} {name}, measured {measured.total} B"
            # Two accumulated half batches (and tiny buckets) give the same parameters.
            acc = _train_zero(comm, name, stage, 4, accumulation=2, bucket_cap_bytes=2048).full_parameters()
            short = _train_plain_dp(comm, name, 4) if stage == 1 else short
            for key, ref in short.items():
                np.testing.assert_allclose(acc[key].numpy(), ref.numpy(), rtol=1e-5, atol=1e-6,
                                           err_msg=f"stage {stage} {name} {key} with accumulation")
            if stage == 3:  # units kept gathered from forward to backward: the same parameters
                kept = _train_zero(comm, name, stage, 4, accumulation=2, reshard_after_forward=False)
                assert not any(u.gathered for u in kept.units)
                for key, ref in short.items():
                    np.testing.assert_allclose(kept.full_parameters()[key].numpy(), ref.numpy(), rtol=1e-5,
                                               atol=1e-6, err_msg=f"stage 3 {name} {key} without reshard_after_forward")
            if stage < 3:  # the gathers left in flight by the step, several units, waited for by forward
                over = _train_zero(comm, name, stage, steps, overlap_publish=True, bucket_cap_bytes=2048)
                assert len(over.units) > 1 and all(u.publishing is not None for u in over.units)
                got = over.model_for_test.state_dict()  # waits for the last step's gathers
                for key, ref in want.items():
                    np.testing.assert_allclose(got[key].numpy(), ref.numpy(), rtol=1e-6, atol=1e-7,
                                               err_msg=f"stage {stage} {name} {key} with overlap_publish")
            # The model is usable for evaluation after training (stage 3 gathers on demand).
            with torch.no_grad():
                out = opt.model_for_test(torch.ones(2, 12))
            assert out.shape == (2, 5) and torch.isfinite(out).all()
        if comm.size > 1:
            assert totals[0] > totals[1] > totals[2], f"{name}: memory does not fall with the stage: {totals}"


def clipping_and_fp16(backend: str) -> None:
    """Global-norm clipping across shards equals torch's clip_grad_norm_ on the full gradient."""
    comm = shardwise.init(backend=backend).world
    model = _model()
    ref = _model()
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=2, comm=comm, clip_grad_norm=0.1, lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(_local(x, comm)), _local(y, comm)).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.1)
        ref_opt.step()
    got = opt.full_parameters()
    for n, p in ref.named_parameters():
        if p.requires_grad:
            np.testing.assert_allclose(got[n].numpy(), p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=n)
    # fp16 parameters with an fp32 master: an overflow skips the step and lowers the scale.
    half = _model().half()
    hopt = ZeroOptimizer(half, torch.optim.SGD, stage=1, comm=comm, lr=0.1)
    before = {k: v.clone() for k, v in hopt.full_parameters().items()}
    scale = hopt.loss_scaler.scale
    x, y = _batch(0)
    hopt.zero_grad()
    hopt.backward(nn.functional.mse_loss(half(_local(x, comm).half()), _local(y, comm).half()) * 1e4)
    hopt.step()  # 1e4 * 65536 overflows fp16 on every rank
    hopt.zero_grad()
    hopt.backward(nn.functional.mse_loss(half(_local(x, comm).half()), _local(y, comm).half()) * 1e4)
    hopt.step()
    assert hopt.loss_scaler.skipped_steps == 2 and hopt.loss_scaler.scale == scale / 2
    for k, v in hopt.full_parameters().items():
        assert torch.equal(v, before[k]), f"{k} changed although the step overflowed"


def checkpoint_phase(backend: str, directory: str, phase: str, stage: int = 2) -> None:
    """Train and save (phase 'train'), or load an earlier checkpoint and save it again ('reload')."""
    comm = shardwise.init(backend=backend).world
    root = Path(directory)
    if phase == "train":
        opt = _train_zero(comm, "adam", stage, 5)
        save_zero_checkpoint(opt, root / f"ckpt-w{comm.size}", step=5)
        full = {k: v.numpy() for k, v in opt.full_parameters().items()}
        if comm.rank == 0:
            np.savez(root / "trained.npz", **full)
        return
    source = sorted(p for p in root.glob("ckpt-w*") if (p / "zero-meta.json").exists())
    meta = json.loads((root / "order.json").read_text())
    src = root / meta["load"]
    opt = ZeroOptimizer(_model(seed=7), torch.optim.Adam, stage=stage, comm=comm, lr=1e-2)
    loaded = load_zero_checkpoint(opt, src)
    assert loaded["step"] == 5 and source
    trained = np.load(root / "trained.npz")
    for key, value in opt.full_parameters().items():
        assert np.array_equal(value.numpy(), trained[key]), f"{key} not restored bit-exactly from {src.name}"
    save_zero_checkpoint(opt, root / meta["save"], step=5)


def consolidate(directory: str) -> None:
    """Single process: the consolidated state dict equals the trained parameters."""
    root = Path(directory)
    full = consolidate_zero_checkpoint(root / "ckpt-w4", root / "full.pt")
    trained = np.load(root / "trained.npz")
    assert sorted(full) == sorted(trained.files)
    loaded = torch.load(root / "full.pt", weights_only=True)
    for key in trained.files:
        assert np.array_equal(full[key], trained[key]) and np.array_equal(loaded[key].numpy(), trained[key])
