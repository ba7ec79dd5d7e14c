"""Fewer key/value heads than tp: each head replicated over tp / kv ranks, at 4 real ranks vs one process (issue 53).

Qwen3 (8 query, 2 key/value heads) at tp4 and Qwen2 (4 query heads, 1 key/value head, biases) at tp4
with clipping, dp2 x tp2 with ZeRO-2, tp2 x pp2, sequence and vocabulary parallelism; every gradient
of one backward; Gemma 3, OLMo-2 and Phi-3 at tp4; meta builds (ZeRO-3 too); save_pretrained at tp4
loaded by from_pretrained and by weights=; a checkpoint at tp4 resumed at dp2 x tp2; 3 key/value
heads at tp4 refused. One shared 4-rank job runs them all (see mpi_harness).
"""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

#: [case, layout, replicated key/value weights per rank (2 layers x k, v)]
LAYOUTS = [
    ["qwen3-kv2", {"tp": 4}, 4],
    ["qwen2-kv1", {"tp": 4, "gradient_clipping": 0.05}, 4],
    ["qwen2-kv1", {"dp": 2, "tp": 2, "zero_stage": 2, "gradient_clipping": 0.05}, 4],
    ["qwen2-kv1", {"tp": 2, "pp": 2, "micro_batches": 2}, 2],
    ["qwen3-kv2", {"tp": 4, "sequence_parallel": True}, 4],
    ["qwen2-kv1", {"tp": 4, "vocab_parallel": True, "activation_checkpointing": True}, 4],
]

#: hf_any's tiny models (4 query, 2 key/value heads) at tp4: Gemma 3 replicates its heads (and
#: sums its per-head norms), OLMo-2 and Phi-3 gather their attention projections whole.
OTHER_FAMILIES = [["gemma3_text", {"tp": 4}], ["olmo2", {"tp": 4}], ["phi3", {"tp": 4}]]

META = [
    ["qwen3-kv2", {"tp": 4}],
    ["qwen2-kv1", {"dp": 2, "tp": 2, "zero_stage": 3}],
]

RESUME = [
    ["qwen3-kv2", {"tp": 4}, {"dp": 2, "tp": 2}],
    ["qwen2-kv1", {"tp": 4}, {"dp": 2, "tp": 2, "zero_stage": 1}],
]


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


def test_replicated_key_value_heads_train_as_one_process() -> None:
    result = run_mpi(4, "kv_replicas:layouts", backend="mpi", cases=LAYOUTS, timeout=240, shared=True)
    assert len(_ok_lines(result.output)) == len(LAYOUTS), result.output[-3000:]


def test_gradients_of_replicated_heads_are_summed_over_their_replicas() -> None:
    result = run_mpi(4, "kv_replicas:gradients", backend="mpi", cases=["qwen3-kv2", "qwen2-kv1"], timeout=120,
                     shared=True)
    assert len(_ok_lines(result.output)) == 2, result.output[-3000:]


def test_other_families_at_tp4_with_two_key_value_heads() -> None:
    result = run_mpi(4, "hf_any:layouts", backend="mpi", cases=OTHER_FAMILIES, timeout=180, shared=True)
    assert len(_ok_lines(result.output)) == len(OTHER_FAMILIES), result.output[-3000:]


def test_meta_build_matches_seeded_build() -> None:
    result = run_mpi(4, "kv_replicas:meta_build", backend="mpi", cases=META, timeout=180, shared=True)
    assert len(_ok_lines(result.output)) == len(META), result.output[-3000:]


def test_save_pretrained_at_tp4_loads_whole_and_back() -> None:
    result = run_mpi(4, "kv_replicas:pretrained", backend="mpi", timeout=180, shared=True)
    assert len(_ok_lines(result.output)) == 1, result.output[-3000:]


def test_checkpoint_at_tp4_resumes_at_tp2() -> None:
    result = run_mpi(4, "kv_replicas:resume", backend="mpi", cases=RESUME, timeout=240, shared=True)
    assert len(_ok_lines(result.output)) == len(RESUME), result.output[-3000:]


def test_uneven_key_value_heads_are_refused_on_every_rank() -> None:
    result = run_mpi(4, "kv_replicas:bad_input", backend="mpi", timeout=120, shared=True)
    assert len(_ok_lines(result.output)) == 2, result.output[-3000:]
