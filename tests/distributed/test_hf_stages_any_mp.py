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
    _run(2, [["mixtral", PP2], ["qwen3_moe", {"pp": 2, "micro_batches": 4}]])


def test_moe_aux_loss_at_pp2_with_dp_ep_and_tp_equals_one_process() -> None:
    _run(4, [["qwen3_moe", {"dp": 2, **PP2}], ["mixtral", {"dp": 2, "ep": 2, **PP2}],
             ["mixtral", {"tp": 2, **PP2}]])
