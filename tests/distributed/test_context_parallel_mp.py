"""Context parallelism against one process (issue 55): ring and Ulysses attention alone (outputs and
gradients); Llama (grouped-query attention) and Qwen3 trained 3 SGD steps at cp4, at cp2 x dp2 with ZeRO-3
and at cp2 x tp2 (ZeRO-1 for Ulysses); ZeRO-1 with activation checkpointing, a meta build, Phi-3 and
OLMo-2; bad input refused on every rank. One shared 4-rank job runs those (see mpi_harness); cp4 with
dp2 ZeRO-3 and with tp2 runs at 8 ranks (slow)."""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

#: [mode, cp, heads, kv_heads, seq]
ATTENTION = [["ring", 2, 4, 2, 16], ["ring", 4, 4, 2, 16], ["ring", 4, 4, 4, 32],
             ["ulysses", 2, 4, 2, 16], ["ulysses", 4, 4, 2, 16], ["ulysses", 4, 8, 4, 32]]
LAYOUTS = [
    {"dp": 4, "cp": 4},
    {"dp": 4, "cp": 4, "cp_attention": "ulysses"},
    {"dp": 4, "cp": 2, "zero_stage": 3},
    {"dp": 4, "cp": 2, "zero_stage": 3, "cp_attention": "ulysses"},
    {"dp": 2, "tp": 2, "cp": 2},
    {"dp": 2, "tp": 2, "cp": 2, "zero_stage": 1, "cp_attention": "ulysses"},
]


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


def test_ring_and_ulysses_attention_match_one_process() -> None:
    result = run_mpi(4, "context_parallel:attention", backend="mpi", cases=ATTENTION, timeout=150, shared=True)
    assert len(_ok_lines(result.output)) == len(ATTENTION), result.output[-3000:]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_model_matches_one_process(model_type: str) -> None:
    cases = [[model_type, fields] for fields in LAYOUTS]
    result = run_mpi(4, "context_parallel:layouts", backend="mpi", cases=cases, timeout=300, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_more_families() -> None:
    """Phi-3 (fused qkv projection) and OLMo-2 (q/k norms over all heads) through the same attention function."""
    cases = [["phi3", {"dp": 4, "cp": 4}], ["olmo2", {"dp": 4, "cp": 2, "zero_stage": 3, "cp_attention": "ulysses"}]]
    result = run_mpi(4, "context_parallel:layouts", backend="mpi", cases=cases, timeout=200, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_checkpointing_zero1_and_meta_build() -> None:
    cases = [["llama", {"dp": 4, "cp": 2, "zero_stage": 1, "activation_checkpointing": True}],
             ["llama", {"dp": 4, "cp": 4, "zero_stage": 2, "meta": True}]]
    result = run_mpi(4, "context_parallel:layouts", backend="mpi", cases=cases, timeout=200, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_bad_input_is_refused_on_every_rank() -> None:
    result = run_mpi(4, "context_parallel:bad_input", backend="mpi", timeout=120, shared=True)
    assert len(_ok_lines(result.output)) == 5, result.output[-3000:]


@pytest.mark.slow
def test_cp4_with_dp2_zero3_and_with_tp2_at_8_ranks() -> None:
    """cp4 composed with a second data replica under ZeRO-3 (ring and Ulysses) and with tp2 (ring: Ulysses
    would need cp to divide the 2 heads a tp rank keeps), 8 ranks."""
    cases = [["llama", {"dp": 8, "cp": 4, "zero_stage": 3}],
             ["llama", {"dp": 8, "cp": 4, "zero_stage": 3, "cp_attention": "ulysses"}],
             ["llama", {"dp": 4, "tp": 2, "cp": 4}]]
    result = run_mpi(8, "context_parallel:layouts", backend="mpi", cases=cases, timeout=500)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]
