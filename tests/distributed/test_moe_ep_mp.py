"""Expert parallelism on Hugging Face MoE models, 2 and 4 real ranks, vs one process (scenarios: moe_ep.py)."""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


def test_two_ranks_ep2_equal_one_process() -> None:
    cases = [[family, 2, 4] for family in FAMILIES]
    result = run_mpi(2, "moe_ep:module_level", backend="mpi", cases=cases, timeout=300, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_four_ranks_ep4_and_ep2_within_dp4_equal_one_process() -> None:
    # ep4 with 8 experts (2 per rank); ep2 x edp2 (each expert on 2 ranks, averaged over them)
    cases = [[family, 4, 8] for family in FAMILIES] + [[family, 2, 4] for family in FAMILIES]
    # every token routed to experts of one rank: the other three receive empty blocks
    cases += [["mixtral", 4, 8, "skewed"], ["gpt_oss", 4, 8, "skewed"]]
    result = run_mpi(4, "moe_ep:module_level", backend="torch", cases=cases, timeout=600, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_experts_not_divisible_by_ep_refused_on_every_rank() -> None:
    result = run_mpi(4, "moe_ep:indivisible", backend="mpi", family="qwen3_moe", ep=4, experts=6, timeout=300,
                     shared=True)
    assert "OK refused on every rank: model.layers.0.mlp.experts: 6 experts do not split over ep=4" in result.output


def test_ep_not_dividing_dp_refused() -> None:
    result = run_mpi(2, "moe_ep:layout_checks", backend="mpi", timeout=120, shared=True)
    assert "OK refused: ep=3 must divide dp=2" in result.output


def test_train_step_two_ranks_ep2_equals_one_process_adamw() -> None:
    cases = [["mixtral", 4, {"dp": 2, "ep": 2}],
             ["mixtral", 4, {"dp": 2, "ep": 2, "gradient_clipping": 0.05, "gradient_accumulation_steps": 2}],
             ["qwen3_moe", 4, {"dp": 2, "ep": 2}], ["deepseek_v3", 4, {"dp": 2, "ep": 2}],
             ["gpt_oss", 4, {"dp": 2, "ep": 2}]]
    result = run_mpi(2, "moe_ep:train", backend="mpi", cases=cases, timeout=400, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_train_step_four_ranks_ep4_ep2_within_dp4_with_tp_and_pp() -> None:
    cases = [["mixtral", 8, {"dp": 4, "ep": 4}],
             ["mixtral", 4, {"dp": 4, "ep": 2, "gradient_clipping": 0.05}],
             ["mixtral", 4, {"dp": 2, "tp": 2, "ep": 2}],
             # the load-balancing loss is refused with pipelines: the model is built without it
             ["mixtral", 4, {"dp": 2, "pp": 2, "ep": 2, "micro_batches": 2}, {"aux": False}]]
    result = run_mpi(4, "moe_ep:train", backend="torch", cases=cases, timeout=600, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_parallelize_refusals_with_ep() -> None:
    result = run_mpi(2, "moe_ep:refusals", backend="mpi", timeout=300, shared=True)
    assert len(_ok_lines(result.output)) == 3, result.output[-3000:]


def test_meta_build_checkpoint_resharding_and_hf_export_with_ep(tmp_path) -> None:
    result = run_mpi(4, "moe_ep:lifecycle", backend="mpi", directory=str(tmp_path), timeout=400, shared=True)
    assert len(_ok_lines(result.output)) == 1, result.output[-3000:]


def test_train_step_four_ranks_ep2_within_dp4_zero_1_2_3_equals_one_process() -> None:
    # the experts' ZeRO units are sharded over edp2 (ranks holding the same experts), the rest over dp4
    cases = [["mixtral", 4, {"dp": 4, "ep": 2, "zero_stage": 1, "gradient_clipping": 0.05}],
             ["mixtral", 4, {"dp": 4, "ep": 2, "zero_stage": 2, "gradient_accumulation_steps": 2}],
             ["mixtral", 4, {"dp": 4, "ep": 2, "zero_stage": 3, "gradient_clipping": 0.05}],
             # dp rank 0 runs no expert while its edp peer does: its experts still reduce in step
             ["mixtral", 4, {"dp": 4, "ep": 2, "zero_stage": 3}, {"by_token": True}],
             ["mixtral", 4, {"dp": 4, "ep": 2, "zero_stage": 2}, {"by_token": True}],
             ["deepseek_v3", 4, {"dp": 4, "ep": 2, "zero_stage": 3, "gradient_clipping": 0.05}],
             # with tensor parallelism (edp of one rank) and a pipeline
             ["mixtral", 4, {"dp": 2, "tp": 2, "ep": 2, "zero_stage": 3, "gradient_clipping": 0.05}],
             ["mixtral", 4, {"dp": 2, "pp": 2, "ep": 2, "zero_stage": 1, "micro_batches": 2}]]
    result = run_mpi(4, "moe_ep:train", backend="mpi", cases=cases, timeout=600, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_checkpoint_at_ep2_zero3_resumes_at_ep4_zero1_and_exports(tmp_path) -> None:
    result = run_mpi(4, "moe_ep:zero_resume", backend="mpi", directory=str(tmp_path), timeout=400, shared=True)
    assert len(_ok_lines(result.output)) == 1, result.output[-3000:]


def test_frozen_parameter_kept_under_zero3_and_zero1(tmp_path) -> None:
    result = run_mpi(2, "moe_ep:frozen_under_zero", backend="mpi", directory=str(tmp_path), timeout=300,
                     shared=True)
    assert len(_ok_lines(result.output)) == 2, result.output[-3000:]
