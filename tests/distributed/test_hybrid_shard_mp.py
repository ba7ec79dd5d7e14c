"""Hybrid sharding (dp_shard x dp_replicate) at 4 real ranks as 2 groups of 2, equal to one process (issue 55).

One shared 4-rank job runs the scenarios of hybrid_shard.py (see mpi_harness).
"""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

HYBRID = {"dp_shard": 2, "dp_replicate": 2}

LAYOUTS = [
    ["qwen3", {**HYBRID, "zero_stage": 3}],
    ["qwen3", {**HYBRID, "zero_stage": 2, "gradient_clipping": 0.05}],
    ["qwen3", {**HYBRID, "zero_stage": 1, "gradient_clipping": 0.05}],
    ["gemma3_text", {**HYBRID, "zero_stage": 3, "gradient_clipping": 0.05}],
    ["mixtral", {**HYBRID, "zero_stage": 3}],
    ["qwen3", {"tp": 2, "dp_shard": 1, "dp_replicate": 2, "zero_stage": 2, "gradient_clipping": 0.05}],
    ["qwen3", {"pp": 2, "micro_batches": 2, "dp_shard": 1, "dp_replicate": 2, "zero_stage": 1}],
]

RESUME = [
    [{**HYBRID, "zero_stage": 3}, {"dp": 4, "zero_stage": 3}],
    [{"dp": 4, "zero_stage": 3}, {**HYBRID, "zero_stage": 2}],
    [{**HYBRID, "zero_stage": 1}, {"tp": 2, "dp": 2, "zero_stage": 1}],
]


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


def test_hybrid_layouts_train_as_one_process() -> None:
    result = run_mpi(4, "hybrid_shard:layouts", backend="mpi", cases=LAYOUTS, timeout=240, shared=True)
    assert len(_ok_lines(result.output)) == len(LAYOUTS), result.output[-3000:]


def test_hybrid_meta_build_equals_the_seeded_build() -> None:
    result = run_mpi(4, "hf_any:meta_build", backend="mpi", cases=[["qwen3", {**HYBRID, "zero_stage": 3}]],
                     timeout=120, shared=True)
    assert len(_ok_lines(result.output)) == 1, result.output[-3000:]


def test_checkpoints_reshard_between_hybrid_and_flat() -> None:
    result = run_mpi(4, "hybrid_shard:resume", backend="mpi", pairs=RESUME, timeout=240, shared=True)
    assert len(_ok_lines(result.output)) == len(RESUME), result.output[-3000:]


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_zero_optimizer_over_shard_and_replicate_groups(backend: str) -> None:
    result = run_mpi(4, "hybrid_shard:zero_optimizer", backend=backend, timeout=120, shared=backend == "mpi")
    assert len(_ok_lines(result.output)) == 3, result.output[-3000:]
