"""Hugging Face models of any plan-carrying family through ``parallelize`` at 4 ranks, vs one process (issue 53).

Dense Qwen3, Gemma 3, Phi-3 and OLMo-2 at tp2 x pp2, dp4 ZeRO-3 and dp2 x tp2; MoE Mixtral,
Qwen3-MoE, DeepSeek-V3 and gpt-oss at ep2 x dp2 ZeRO-3, ep2 x tp2 and ep4, the router's aux loss
included; the meta build; a checkpoint saved at ep4 resumed at ep2 x dp2; bad input refused on
every rank. One shared 4-rank job runs them all (see mpi_harness).
"""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

DENSE = ["qwen3", "gemma3_text", "phi3", "olmo2"]
MOE = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]
DENSE_LAYOUTS = [
    {"tp": 2, "pp": 2, "micro_batches": 2},
    {"dp": 4, "zero_stage": 3},
    {"dp": 2, "tp": 2},
]
MOE_LAYOUTS = [
    {"dp": 4, "ep": 2, "zero_stage": 3},
    {"dp": 2, "ep": 2, "tp": 2},
    {"dp": 4, "ep": 4},
]


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


@pytest.mark.parametrize("model_type", DENSE + MOE)
def test_model_matches_one_process(model_type: str) -> None:
    cases = [[model_type, fields] for fields in (DENSE_LAYOUTS if model_type in DENSE else MOE_LAYOUTS)]
    result = run_mpi(4, "hf_any:layouts", backend="mpi", cases=cases, timeout=150, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_sinks_split_by_head_beside_local_params() -> None:
    """Granite-SWA's plan splits its per-head sinks (a parameter) "colwise" and marks the attention
    module "local_params": tp2 and tp2 x pp2 equal one process, the meta build too."""
    cases = [["granite_swa", {"dp": 2, "tp": 2}], ["granite_swa", {"tp": 2, "pp": 2, "micro_batches": 2}]]
    result = run_mpi(4, "hf_any:layouts", backend="mpi", cases=cases, timeout=150, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]
    result = run_mpi(4, "hf_any:meta_build", backend="mpi", cases=cases[:1], timeout=150, shared=True)
    assert len(_ok_lines(result.output)) == 1, result.output[-3000:]


#: A dense model with a pipeline, MLA with shared experts under ZeRO-3, sinks and sliding layers at ep x tp.
META = [
    ["qwen3", {"tp": 2, "pp": 2, "micro_batches": 2}],
    ["deepseek_v3", {"dp": 4, "ep": 2, "zero_stage": 3}],
    ["gpt_oss", {"dp": 2, "ep": 2, "tp": 2}],
]


def test_meta_build_matches_seeded_build() -> None:
    result = run_mpi(4, "hf_any:meta_build", backend="mpi", cases=META, timeout=150, shared=True)
    assert len(_ok_lines(result.output)) == len(META), result.output[-3000:]


def test_checkpoint_at_ep4_resumes_at_ep2_dp2(tmp_path) -> None:
    result = run_mpi(4, "hf_any:resume", backend="mpi", directory=str(tmp_path), timeout=150, shared=True)
    assert len(_ok_lines(result.output)) == 1, result.output[-3000:]


def test_bad_input_is_refused_on_every_rank() -> None:
    result = run_mpi(4, "hf_any:bad_input", backend="mpi", timeout=120, shared=True)
    assert len(_ok_lines(result.output)) == 4, result.output[-3000:]
