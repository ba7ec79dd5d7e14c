"""``ParallelModel.eval_step`` and ``logits`` on real ranks: one process's loss and logits, and no update."""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

#: ZeRO-3 (with accumulation), an interleaved pipeline, and the vocabulary split over tp (a vocabulary
#: of 97 that 2 does not divide, tied for GPT-2).
TWO_RANKS = [
    ["gpt2", {"dp": 2, "zero_stage": 3, "gradient_accumulation_steps": 2}],
    ["llama", {"dp": 2, "zero_stage": 3}],
    ["gpt2", {"pp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"}],
    ["llama", {"pp": 2, "micro_batches": 4, "virtual_stages": 2, "schedule": "interleaved_1f1b"}],
    ["gpt2:97", {"tp": 2, "vocab_parallel": True}],
    ["llama", {"tp": 2, "vocab_parallel": True, "sequence_parallel": True}],
]

#: tp2 x pp2: 1F1B with the vocabulary and the sequence split (GPT-2), GPipe (Llama).
FOUR_RANKS = [
    ["gpt2", {"tp": 2, "pp": 2, "micro_batches": 2, "vocab_parallel": True, "sequence_parallel": True}],
    ["llama", {"tp": 2, "pp": 2, "micro_batches": 2, "schedule": "gpipe"}],
]


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


def test_eval_step_and_logits_match_one_process_and_change_nothing_on_two_ranks() -> None:
    result = run_mpi(2, "hf_eval:evaluation", backend="torch", cases=TWO_RANKS, timeout=300, shared=True)
    assert len(_ok_lines(result.output)) == len(TWO_RANKS), result.output[-3000:]


def test_eval_step_and_logits_match_one_process_at_tp2_pp2() -> None:
    result = run_mpi(4, "hf_eval:evaluation", backend="mpi", cases=FOUR_RANKS, timeout=300, shared=True)
    assert len(_ok_lines(result.output)) == len(FOUR_RANKS), result.output[-3000:]


def test_batches_that_do_not_fit_are_refused_on_every_rank() -> None:
    result = run_mpi(2, "hf_eval:bad_batches", backend="mpi", timeout=120, shared=True)
    lines = _ok_lines(result.output)
    assert len(lines) == 6 and lines[-1].startswith("OK evaluates after refusals"), result.output[-3000:]
