"""Elastic ZeRO scenarios: the full optimizer state, and resharding it onto a smaller world.

Every run is compared with a single-process reference: plain ``torch.optim.Adam`` on
the whole model over the same global batches.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pytest
import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.core.errors import CheckpointError
from zero_scenarios import _batch, _local, _model

torch.set_num_threads(1)

LR = 1e-2
RTOL = 1e-5


def _zero(comm, stage: int, seed: int = 0, lr: float = LR) -> tuple[nn.Module, ZeroOptimizer]:
    model = _model(seed)
    return model, ZeroOptimizer(model, torch.optim.Adam, stage=stage, comm=comm, lr=lr)


def _train(model: nn.Module, opt: ZeroOptimizer, comm, steps: Iterable[int]) -> None:
    """One optimizer step per global batch; each rank of ``comm`` takes its slice of it."""
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(_local(x, comm)), _local(y, comm)).backward()
        opt.step()


def _reference(steps: int) -> tuple[nn.Module, torch.optim.Adam]:
    """Single process, whole global batch, plain torch Adam."""
    model = _model()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    want = want.detach().float()
    atol = 1e-6 * max(float(want.abs().max()), 1e-12)
    np.testing.assert_allclose(got.float().numpy(), want.numpy(), rtol=RTOL, atol=atol, err_msg=what)


def _assert_identical(a: Any, b: Any, where: str = "full state") -> None:
    """Bit-exact equality of nested dicts/lists of tensors and plain values."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), f"{where}: {type(a)} vs {type(b)}"
        assert a.device.type == "cpu" and b.device.type == "cpu", f"{where}: not on the CPU"
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for key in a:
            _assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _assert_matches_reference(full: dict, ref: nn.Module, ref_opt: torch.optim.Adam, stage: int) -> None:
    trainable = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(full["master"]) == sorted(trainable) == sorted(full["state"])
    assert full["optimizer"] == "Adam" and full["stage"] == stage
    assert full["param_groups"][0]["lr"] == LR and full["param_groups"][0]["betas"] == (0.9, 0.999)
    assert "params" not in full["param_groups"][0]
    assert full["loss_scaler"]["skipped_steps"] == 0
    assert ("parameters" in full) == (stage == 3), "only stage 3 carries the model parameters"
    for name, p in trainable.items():
        assert full["master"][name].dtype == torch.float32 and full["master"][name].shape == p.shape
        _close(full["master"][name], p, f"stage {stage} master {name}")
        if stage == 3:
            _close(full["parameters"][name], p, f"stage 3 parameter {name}")
        want = ref_opt.state[p]
        assert sorted(full["state"][name]) == sorted(want), f"{name}: {sorted(full['state'][name])}"
        for key, value in want.items():
            got = full["state"][name][key]
            if value.dim() == 0:
                assert float(got) == float(value), f"{name} {key}: {got} vs {value}"
            else:
                _close(got, value, f"stage {stage} {key} of {name}")


def full_state(backend: str, stage: int, steps: int = 4, more: int = 3) -> None:
    """full_state_dict is identical on every rank and equals the single-process Adam state."""
    comm = shardwise.init(backend=backend).world
    model, opt = _zero(comm, stage)
    _train(model, opt, comm, range(steps))
    full = opt.full_state_dict()
    _assert_identical(full, comm.broadcast_object(full, 0), f"rank {comm.rank} vs rank 0")
    ref, ref_opt = _reference(steps)
    _assert_matches_reference(full, ref, ref_opt, stage)

    # Loaded into a fresh optimizer (other initial values and lr), it gives the same state back
    # and training goes on like the reference. Frozen parameters are the module's state, not the
    # optimizer's: copy them as the module's own state_dict would.
    other, opt2 = _zero(comm, stage, seed=3, lr=0.5)
    other.frozen.load_state_dict(model.frozen.state_dict())
    opt2.load_full_state_dict(full)
    assert opt2.param_groups[0]["lr"] == LR
    _assert_identical(opt2.full_state_dict(), full, "reloaded full state")
    _train(other, opt2, comm, range(steps, steps + more))
    ref, ref_opt = _reference(steps + more)
    _assert_matches_reference(opt2.full_state_dict(), ref, ref_opt, stage)

    # The state does not depend on the stage's partition either.
    other_stage = stage % 3 + 1
    _, opt3 = _zero(comm, other_stage, seed=5)
    opt3.load_full_state_dict(full)
    again = opt3.full_state_dict()
    for key in ("master", "state", "param_groups", "loss_scaler"):
        _assert_identical(again[key], full[key], f"stage {stage} -> {other_stage} {key}")

    # A state of another model is refused with the names and shapes at fault.
    renamed = dict(full, master={("renamed." + k if k == "scale" else k): v for k, v in full["master"].items()})
    with pytest.raises(CheckpointError, match="renamed.scale"):
        opt2.load_full_state_dict(renamed)
    reshaped = dict(full, master=dict(full["master"], scale=torch.zeros(7)))
    with pytest.raises(CheckpointError, match="scale"):
        opt2.load_full_state_dict(reshaped)
    bad_state = dict(full, state=dict(full["state"], scale=dict(full["state"]["scale"], exp_avg=torch.zeros(3))))
    with pytest.raises(CheckpointError, match="exp_avg"):
        opt2.load_full_state_dict(bad_state)
    with pytest.raises(CheckpointError, match="SGD"):
        opt2.load_full_state_dict(dict(full, optimizer="SGD"))


def shrink(backend: str, stage: int, to: int, steps: int = 3, more: int = 3) -> None:
    """Train on the whole world, keep ranks [0, to), reshard, load the full state, train on.

    The global batch stays the same (each remaining rank takes a larger slice), so the
    final parameters equal the single-process reference over all ``steps + more`` batches.
    """
    comm = shardwise.init(backend=backend).world
    model, opt = _zero(comm, stage)
    _train(model, opt, comm, range(steps))
    full = opt.full_state_dict()
    sub = comm.split(ranks=list(range(to)))
    if sub is None:
        return  # this worker was "lost"
    assert sub.size == to
    opt.reshard(sub)
    assert opt.comm is sub and all(u.comm is sub and u.plan.world_size == to for u in opt.units)
    # The old partition's hooks are gone: one gradient hook per parameter, as after construction
    # (a leftover one would run collectives on the old group and hang).
    for unit in opt.units:
        for p in unit.params:
            assert len(p._post_accumulate_grad_hooks) == 1, "reshard left old gradient hooks behind"
    opt.load_full_state_dict(full)
    _assert_identical(opt.full_state_dict(), full, f"full state after resharding {comm.size} -> {to}")
    _train(model, opt, sub, range(steps, steps + more))
    ref, ref_opt = _reference(steps + more)
    got = opt.full_parameters()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            _close(got[name], p, f"stage {stage} {comm.size} -> {to} ranks: {name}")
    _assert_matches_reference(opt.full_state_dict(), ref, ref_opt, stage)
    with torch.no_grad():  # the model is usable for evaluation (stage 3 gathers over the new group)
        out = model(torch.ones(2, 12))
    _close(out, ref(torch.ones(2, 12)), "model output after resharding")
