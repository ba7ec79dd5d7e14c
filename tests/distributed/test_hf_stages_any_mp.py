"""Hugging Face models as pipeline stages beyond the usual shape, vs one process (issue 53): MoE with the
router's load-balancing loss at pp > 1 (with dp, ep and tp), and families without a pipeline plan or
with another name for their final norm at pp2 / tp2. See hf_stages_any."""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

PP2 = {"pp": 2, "micro_batches": 2}


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


def _run(np: int, cases: list) -> None:
    result = run_mpi(np, "hf_stages_any:layouts", backend="mpi", cases=cases, timeout=240, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_moe_aux_loss_at_pp2_equals_one_process() -> None:
    # Doge routes over product keys and counts each of its k choices 1/k in the loss; its router mixes
    # the batch's samples, so its batch stays whole (one micro-batch)
    _run(2, [["mixtral", PP2], ["qwen3_moe", {"pp": 2, "micro_batches": 4}], ["doge", {"pp": 2, "micro_batches": 1}]])


def test_moe_aux_loss_at_pp2_with_dp_ep_and_tp_equals_one_process() -> None:
    _run(4, [["qwen3_moe", {"dp": 2, **PP2}], ["mixtral", {"dp": 2, "ep": 2, **PP2}],
             ["mixtral", {"tp": 2, **PP2}]])


def test_families_without_a_pipeline_plan_or_a_norm_called_norm_equal_one_process() -> None:
    # DiffLlama and Hunyuan dense have a tensor-parallel plan only; LFM2's final norm is embedding_norm,
    # Jamba's final_layernorm (hybrid Mamba and MoE layers, the aux loss on)
    _run(2, [["diffllama", PP2], ["diffllama", {"tp": 2}], ["hunyuan_v1_dense", PP2], ["lfm2", PP2],
             ["lfm2", {"tp": 2}], ["jamba", PP2], ["longcat_flash", PP2]])


def test_blocks_that_cannot_be_stages_train_whole_at_zero3() -> None:
    # Bamba's base model unpacks its blocks' outputs; Jamba at dp needs no names at all
    _run(2, [["bamba", {"dp": 2, "zero_stage": 3}], ["jamba", {"dp": 2, "zero_stage": 3}], ["bamba", PP2]])


def test_tp_alone_on_blocks_that_cannot_be_stages_runs_the_model_whole() -> None:
    # HY-V4 hands its blocks hyper-connection streams: at tp2 (no pipeline) its own forward runs, split
    # Dory's forward loops over its middle block: at tp2 its own forward runs, split
    _run(2, [["hy_v4", {"tp": 2}], ["dory", {"tp": 2}]])


def test_splits_that_would_change_the_model_are_refused() -> None:
    result = run_mpi(2, "hf_stages_any:refusals", backend="mpi", timeout=120)
    assert len(_ok_lines(result.output)) == 3, result.output[-3000:]


@pytest.mark.parametrize("failing_stage", [0, 1])
def test_a_stage_that_raises_stops_the_other_instead_of_hanging(failing_stage: int) -> None:
    result = run_mpi(2, "hf_stages_any:peer_failure", backend="mpi", failing_stage=failing_stage, timeout=60)
    assert len(_ok_lines(result.output)) == 2, result.output[-3000:]
