"""A representative part of the checkpoint resume matrix (issue 52), on real ranks.

Checkpoints are saved by one launch per world size (2 and 4 ranks) and resumed by other
launches, at other layouts and world sizes (1, 2 and 4 ranks); each resume is compared with
an uninterrupted one-process run (``resume_matrix.load``). ``benchmarks/resume_matrix.py``
runs every pair.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
# The first test also waits for the saving launches (the module's fixture).
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(480)]

#: The exact model of the issue (hidden 32, MLP 64, GQA 4/2 heads, untied head) and a GPT-2 (tied
#: embeddings, fused QKV) whose odd vocabulary and hidden size 24 put ZeRO's shard boundaries inside
#: rows and tensor-parallel halves.
LLAMA, GPT2 = "llama", "gpt2:97:24:72"
#: What each saving launch saves: [model, layout], by world size.
SAVED = {2: [[LLAMA, "tp2"], [GPT2, "pp2-v2"]],
         4: [[LLAMA, "tp2xpp2"], [GPT2, "tp2xpp2"], [LLAMA, "dp2xtp2-z3"]]}


def _passed(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("RESUME PASS")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("resume-matrix")
    for np_, cases in SAVED.items():
        result = run_mpi(np_, "resume_matrix:save", backend="mpi", directory=str(directory), cases=cases,
                         timeout=150)
        assert result.output.count("SAVE OK") == len(cases), result.output[-3000:]
    return directory


def _load(np_: int, directory: Path, cases: list[list[str]]) -> None:
    result = run_mpi(np_, "resume_matrix:load", backend="mpi", directory=str(directory), cases=cases, timeout=150)
    assert len(_passed(result.output)) == len(cases), result.output[-3000:]


def test_tensor_parallel_slices_resume_at_dp2_zero3(saved: Path) -> None:
    # Issue 52: Llama tp2 -> dp2 ZeRO-3 failed on rank 1 only (a slice's element range taken for the
    # whole tensor's); the same from tp2 x pp2 on 4 ranks.
    _load(2, saved, [[LLAMA, "tp2", "dp2-z3"], [LLAMA, "tp2xpp2", "dp2-z3"], [GPT2, "tp2xpp2", "dp2-z3"]])


def test_checkpoints_resume_across_world_sizes_1_2_4(saved: Path) -> None:
    # 2 -> 4 (tp2 slices into dp4 ZeRO-3 shards, into ZeRO-3 shards of tp2 slices; interleaved stages
    # into tp2 x pp2), 4 -> 4, then 4 -> 1 and 2 -> 1.
    _load(4, saved, [[LLAMA, "tp2", "dp4-z3"], [LLAMA, "tp2", "dp2xtp2-z3"], [GPT2, "pp2-v2", "tp2xpp2"],
                     [GPT2, "tp2xpp2", "dp2xtp2-z3"]])
    _load(1, saved, [[GPT2, "tp2xpp2", "dp1"], [LLAMA, "dp2xtp2-z3", "dp1"], [GPT2, "pp2-v2", "dp1"]])
