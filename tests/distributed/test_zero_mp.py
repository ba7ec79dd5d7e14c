"""ZeRO stages 1-3 on real processes, and resharding checkpoints across world sizes."""

import json

import numpy as np
import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_, backend", [(2, "mpi"), (4, "mpi"), (2, "torch")])
def test_zero_equals_plain_data_parallel(np_, backend):
    run_mpi(np_, "zero_scenarios:equivalence", backend=backend, timeout=300, shared=True)


@pytest.mark.parametrize("backend, stage", [("torch", 2), ("torch", 3), ("mpi", 3)])
def test_full_gradients_alive_during_backward_stay_under_two_units(backend, stage):
    run_mpi(2, "zero_grad_memory:bounded_grad_memory", backend=backend, stage=stage, timeout=180)


@pytest.mark.parametrize("backend", ["torch", "mpi"])
def test_stage3_full_parameters_alive_stay_within_two_units(backend):
    run_mpi(2, "zero_grad_memory:bounded_param_memory", backend=backend, timeout=180)


def test_zero_clipping_and_fp16_loss_scaling():
    run_mpi(2, "zero_scenarios:clipping_and_fp16", backend="mpi", timeout=180, shared=True)


def _flat_arrays(directory):
    """Every saved array of a checkpoint, unsharded (padding dropped), by key."""
    meta = json.loads((directory / "zero-meta.json").read_text())
    world = meta["world_size"]
    shards = [np.load(directory / f"zero-shard-{r:05d}-of-{world:05d}.npz") for r in range(world)]
    out = {}
    for key in shards[0].files:
        unit = int(key.split("/")[0][1:])
        numel = meta["units"][unit]["params"] and sum(int(np.prod(p["shape"])) for p in meta["units"][unit]["params"])
        parts = [s[key] for s in shards]
        out[key] = parts[0] if parts[0].ndim == 0 else np.concatenate(parts)[:numel]
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_reshards_4_2_1_4_bit_exactly(tmp_path, stage):
    run_mpi(4, "zero_scenarios:checkpoint_phase", backend="mpi", directory=str(tmp_path), phase="train",
            stage=stage, timeout=180)
    for np_, load, save in [(2, "ckpt-w4", "ckpt-w2"), (1, "ckpt-w2", "ckpt-w1"), (4, "ckpt-w1", "ckpt-w4b")]:
        (tmp_path / "order.json").write_text(json.dumps({"load": load, "save": save}))
        run_mpi(np_, "zero_scenarios:checkpoint_phase", backend="mpi", directory=str(tmp_path),
                phase="reload", stage=stage, timeout=180)
        before, after = _flat_arrays(tmp_path / load), _flat_arrays(tmp_path / save)
        assert sorted(before) == sorted(after)
        for key in before:
            assert np.array_equal(before[key], after[key]), f"{key} changed going {load} -> {save}"
    run_mpi(1, "zero_scenarios:consolidate", directory=str(tmp_path), timeout=120)
