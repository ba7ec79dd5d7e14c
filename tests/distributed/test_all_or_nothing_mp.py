"""All-or-nothing loads under mpirun: one rank's failed read fails the load on every rank, changing nothing."""

from pathlib import Path

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi


def _ok(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


@pytest.mark.parametrize("np_,family,fields", [
    (2, "gpt2:2048:256", {"dp": 2, "zero_stage": 3}),
    (2, "llama:2048:256:512", {"tp": 2}),
    (4, "llama:2048:256:512", {"tp": 2, "pp": 2, "micro_batches": 2}),
])
def test_checkpoint_load_fails_alike_on_every_rank_and_changes_nothing(tmp_path: Path, np_: int, family: str,
                                                                       fields: dict) -> None:
    result = run_mpi(np_, "all_or_nothing:load_checkpoint", backend="mpi", directory=str(tmp_path), family=family,
                     fields=fields, timeout=180, shared=True)
    assert len(_ok(result.output)) == 3, result.output[-3000:]


@pytest.mark.parametrize("np_,family,fields", [
    (2, "gpt2", {"dp": 2, "zero_stage": 3}),
    (2, "llama", {"tp": 2}),
])
def test_weights_read_error_on_one_rank_fails_every_rank(tmp_path: Path, np_: int, family: str, fields: dict) -> None:
    result = run_mpi(np_, "all_or_nothing:weights", backend="mpi", directory=str(tmp_path), family=family,
                     fields=fields, timeout=180, shared=True)
    assert len(_ok(result.output)) == 1, result.output[-3000:]
