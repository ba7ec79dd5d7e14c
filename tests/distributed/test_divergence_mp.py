"""Divergent ranks raise DivergenceError on every rank (never a hang or a silent swap); ZeRO's remove()."""

import re

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

_ZERO3 = re.compile(r"DIVERGENCE rank (\d): ZeRO-3 ranks diverged at gather #0 of this pass: rank 0 gathered "
                    r"unit 0 \(a, (\d+) bytes per rank\), rank 1 unit 1 \(b, (\d+) bytes per rank\): every rank must "
                    r"run the same modules in the same order \(as FSDP and DeepSpeed ZeRO-3 require\)")


def _ranks_caught(output: str, pattern: re.Pattern) -> list[re.Match]:
    found = [m for m in pattern.finditer(output)]
    assert sorted(int(m.group(1)) for m in found) == [0, 1], output[-3000:]
    return found


@pytest.mark.parametrize("backend", ["mpi", "torch"])
@pytest.mark.parametrize("same_size", [True, False])
@pytest.mark.parametrize("agreeing_steps", [0, 2])  # caught by the headers of the first step, or on plan
def test_zero3_modules_in_different_orders_raise_on_every_rank(backend, same_size, agreeing_steps):
    out = run_mpi(2, "divergence:zero3_order", backend=backend, same_size=same_size,
                  agreeing_steps=agreeing_steps, timeout=60).output
    for m in _ranks_caught(out, _ZERO3):
        a, b = int(m.group(2)), int(m.group(3))  # a's shard and b's: 21 and 21 floats, or 21 and 18
        assert (a, b) == ((84, 84) if same_size else (84, 72)), m.group(0)


@pytest.mark.parametrize("backend", ["mpi", "torch"])
@pytest.mark.parametrize("how, said", [
    ("microbatches", "4 micro-batches.*2 micro-batches"),
    ("schedule", "schedule '1f1b'.*schedule 'gpipe'"),
    ("shape_given", "shape headers.*activation_shape given"),
    ("mode", r"rank 0 runs step 1 \(training\).*rank 1 step 1 \(prediction\)"),
])
def test_pipeline_ranks_that_disagree_raise_on_every_rank(backend, how, said):
    out = run_mpi(2, "divergence:pipeline_disagree", backend=backend, how=how, timeout=60).output
    pattern = re.compile(r"DIVERGENCE rank (\d): pipeline ranks disagree: .*" + said
                         + r".*: every pipeline rank must run the same schedule, step for step")
    _ranks_caught(out, pattern)


def test_pipeline_ranks_that_connect_other_pairs_raise_instead_of_waiting():
    """The executor connects its rank pairs when built (NCCL needs it): ranks whose schedules use other pairs
    must still reach the first step's agreement, not wait for a connection that never comes."""
    out = run_mpi(4, "divergence:pipeline_pairs_disagree", backend="mpi", timeout=60).output
    found = re.findall(r"DIVERGENCE rank (\d): pipeline ranks disagree: ranks 0, 1, 2 runs step 0 \(training\) of "
                       r"schedule '1f1b'.*rank 3 step 0 \(training\) of schedule 'interleaved_1f1b'", out)
    assert sorted(found) == ["0", "1", "2", "3"], out[-3000:]


@pytest.mark.parametrize("backend, stage", [("mpi", 1), ("mpi", 2), ("mpi", 3), ("torch", 3)])
def test_zero_remove_leaves_a_model_that_runs_plain(backend, stage):
    out = run_mpi(2, "divergence:zero_remove_runs_plain", backend=backend, stage=stage, timeout=60).output
    assert sorted(re.findall(r"REMOVED rank (\d): plain", out)) == ["0", "1"], out[-3000:]
