"""``shardwise.checkpoint.save``/``load`` under mpirun: a recommendation model (dense MLP, SGD with momentum,
sharded tables, Adagrad) saved with one call at 4 ranks resumes with one call at 2 ranks on another plan
equal to one uninterrupted process; a load that fails on one rank changes nothing on any rank."""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("save, load", [
    ((4, "mpi", {"mixed": True, "local_size": 2, "ddp": True}), (2, "mpi", {"sharding": "row_wise"})),
])
def test_a_recommendation_model_resumes_through_one_door(tmp_path, save, load) -> None:
    (n1, b1, kw1), (n2, b2, kw2) = save, load
    saved = run_mpi(n1, "one_door:resume", backend=b1, directory=str(tmp_path), phase="save", timeout=120,
                    shared=True, **kw1)
    assert "OK saved ckpt-5 on 4 ranks" in saved.output, saved.output[-3000:]
    resumed = run_mpi(n2, "one_door:resume", backend=b2, directory=str(tmp_path), phase="load", timeout=120,
                      shared=True, **kw2)
    assert f"OK resumed on {n2} ranks" in resumed.output, resumed.output[-3000:]


def test_a_load_failing_on_one_rank_changes_nothing_on_any_rank(tmp_path) -> None:
    saved = run_mpi(4, "one_door:save_both", backend="mpi", directory=str(tmp_path), timeout=120, shared=True)
    assert "OK saved both on 4 ranks" in saved.output, saved.output[-3000:]
    refused = run_mpi(2, "one_door:all_or_nothing", backend="mpi", directory=str(tmp_path), timeout=120, shared=True)
    lines = [line for line in refused.output.splitlines() if line.startswith("OK refused on every rank")]
    assert len(lines) == 6, refused.output[-3000:]
    # one rank's read failed (the scenario checks which), or every rank's size check (a truncated embedding file)
    for case in ("door truncate", "door header", "door flip", "tables header", "tables flip"):
        line = next(line for line in lines if case in line)
        assert "failed on rank" in line and "more rank(s)" not in line and "rank-000" in line, line
        if "flip" in case:  # same size, a sound header: the block checksums catch it
            assert "damaged: block 0" in line and "crc32" in line, line
    line = next(line for line in lines if "tables truncate" in line)
    assert "the manifest says" in line, line


def test_a_parallel_model_is_one_entry_and_loads_on_another_layout(tmp_path) -> None:
    saved = run_mpi(2, "one_door:parallel_model", backend="mpi", directory=str(tmp_path), phase="save",
                    layout={"dp": 2, "zero_stage": 3}, timeout=180, shared=True)
    assert "OK saved" in saved.output, saved.output[-3000:]
    resumed = run_mpi(2, "one_door:parallel_model", backend="mpi", directory=str(tmp_path), phase="load",
                      layout={"tp": 2}, timeout=180, shared=True)
    assert "OK resumed as" in resumed.output, resumed.output[-3000:]


def test_a_zero_optimizer_saved_at_stage_3_resumes_at_stages_1_and_2_on_fewer_ranks(tmp_path) -> None:
    saved = run_mpi(4, "one_door:zero_optimizer", backend="mpi", directory=str(tmp_path), phase="save", stage=3,
                    timeout=120, shared=True)
    assert "OK saved a stage-3 ZeroOptimizer on 4 ranks" in saved.output, saved.output[-3000:]
    for stage in (1, 2):
        resumed = run_mpi(2, "one_door:zero_optimizer", backend="mpi", directory=str(tmp_path), phase="load",
                          stage=stage, timeout=120, shared=True)
        assert f"OK resumed at stage {stage} on 2 ranks" in resumed.output, resumed.output[-3000:]
    refused = run_mpi(2, "one_door:zero_optimizer", backend="mpi", directory=str(tmp_path), phase="refuse",
                      stage=2, timeout=120, shared=True)
    line = next(line for line in refused.output.splitlines() if line.startswith("OK refused on every rank"))
    assert "failed on rank 1; nothing was changed on any rank" in line and "OSError: injected" in line, line
