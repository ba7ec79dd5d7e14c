"""weights= of transformers' per-expert checkpoints and save_pretrained at expert parallelism, 2 and 4 real ranks,
vs one process (scenarios: moe_weights.py)."""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.mpi


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


def test_two_ranks_ep2_weights_and_save_pretrained_equal_transformers(tmp_path) -> None:
    cases = [["mixtral", 4, {"dp": 2, "ep": 2}, "meta"], ["qwen3_moe", 4, {"dp": 2, "ep": 2}, "built"],
             ["deepseek_v3", 4, {"dp": 2, "ep": 2}, "built"], ["deepseek_v3", 4, {"dp": 2, "ep": 2}, "meta"],
             ["gpt_oss", 4, {"dp": 2, "ep": 2}, "meta"]]  # stored fused: no conversion
    result = run_mpi(2, "moe_weights:load_and_export", backend="mpi", directory=str(tmp_path), cases=cases,
                     timeout=400, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_four_ranks_ep2_tp2_and_ep4_weights_and_save_pretrained_equal_transformers(tmp_path) -> None:
    cases = [["qwen3_moe", 4, {"dp": 2, "tp": 2, "ep": 2}, "meta"],
             ["mixtral", 4, {"dp": 2, "tp": 2, "ep": 2}, "built"],
             ["deepseek_v3", 8, {"dp": 4, "ep": 4}, "meta"]]
    result = run_mpi(4, "moe_weights:load_and_export", backend="torch", directory=str(tmp_path), cases=cases,
                     timeout=600, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_unknown_key_and_unsupported_conversion_refused_on_every_rank(tmp_path) -> None:
    # not shared: it registers (and then restores) a conversion mapping in transformers' process-wide table
    result = run_mpi(2, "moe_weights:refusals", backend="mpi", directory=str(tmp_path), timeout=300)
    assert len(_ok_lines(result.output)) == 2, result.output[-3000:]
