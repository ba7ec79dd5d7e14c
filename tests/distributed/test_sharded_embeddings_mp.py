"""Sharded embedding-bag collections under mpirun: every sharding type, mixed plans, skewed and weighted
batches, on the mpi and torch backends, equal to one process with unsharded nn.EmbeddingBags."""


import pytest

from example_results import example_result
from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

TWO_RANKS = {
    "mpi": [{"sharding": "table_wise", "kind": "adagrad", "uniform": True},
            {"sharding": "column_wise", "kind": "sgd", "weighted": True},
            {"mixed": True, "kind": "adagrad", "skew": True}],
    "torch": [{"sharding": "row_wise", "kind": "rowwise_adagrad", "skew": True},
              {"mixed": True, "kind": "sgd", "weighted": True, "compiled": True},
              {"sharding": "data_parallel", "kind": "adagrad", "weighted": "mixed", "skew": True},
              {"mixed": True, "kind": "adagrad", "weighted": "mixed"}],
}
FOUR_RANKS = {
    "mpi": [{"sharding": "table_row_wise", "kind": "rowwise_adagrad", "local_size": 2},
            {"sharding": "column_wise", "kind": "adagrad"},
            {"sharding": "row_wise", "kind": "sgd", "skew": True}],
    "torch": [{"mixed": True, "kind": "adagrad", "skew": True, "local_size": 2},
              {"sharding": "table_wise", "kind": "rowwise_adagrad", "weighted": True},
              {"sharding": "data_parallel", "kind": "sgd", "weighted": "mixed"},
              {"sharding": "table_wise", "kind": "sgd", "weighted": "mixed", "skew": True, "uniform": True}],
}


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


@pytest.mark.parametrize("np_, backend", [(2, "mpi"), (2, "torch"), (4, "mpi"), (4, "torch")])
def test_sharded_tables_train_like_one_process(np_: int, backend: str) -> None:
    cases = (TWO_RANKS if np_ == 2 else FOUR_RANKS)[backend]
    result = run_mpi(np_, "sharded_embeddings:cases", backend=backend, cases=cases, timeout=240, shared=True)
    assert len(_ok_lines(result.output)) == len(cases), result.output[-3000:]


def test_an_id_outside_its_table_fails_on_every_rank() -> None:
    result = run_mpi(2, "sharded_embeddings:bad_ids", backend="mpi", timeout=120, shared=True)
    assert "OK refused on every rank: embedding lookup refused on every rank: bad input on rank(s) [1]" \
        in result.output, result.output[-3000:]


def test_a_feature_no_table_has_is_refused_on_every_rank_or_dropped_on_request() -> None:
    result = run_mpi(2, "sharded_embeddings:unknown_features", backend="torch", timeout=120, shared=True)
    assert "OK unknown features refused on every rank, or dropped on request" in result.output, result.output[-3000:]


def test_ranks_holding_other_tables_fail_on_every_rank_when_built() -> None:
    result = run_mpi(2, "sharded_embeddings:other_tables", backend="mpi", timeout=120, shared=True)
    assert "OK refused on every rank: the ranks' embedding tables or plans differ: rank(s) [1]" \
        in result.output, result.output[-3000:]


def test_dlrm_example_learns() -> None:
    result = run_mpi(2, "sharded_embeddings:example", argv=["--steps", "40", "--rows", "20000", "--batch", "128"],
                     timeout=240, shared=True)
    found = example_result(result.output, "dlrm")
    losses = found["losses"]
    assert (found["ranks"], found["tables"], found["planned_tables"], found["plan_ranks"]) == (2, 26, 26, 2), found
    assert sum(found["shardings"].values()) == 26, found
    assert found["steps"] == 40 and len(losses) == 40, found
    assert found["first5_loss"] == pytest.approx(sum(losses[:5]) / 5) and \
        found["last5_loss"] == pytest.approx(sum(losses[-5:]) / 5), found
    assert found["last5_loss"] < found["first5_loss"] - 0.05, found


@pytest.mark.parametrize("save, load", [
    ((4, "mpi", {"mixed": True, "local_size": 2, "kind": "adagrad"}), (2, "mpi", {"sharding": "row_wise",
                                                                                  "kind": "adagrad"})),
    ((2, "torch", {"sharding": "column_wise", "kind": "sgd"}), (4, "torch", {"sharding": "table_wise", "kind": "sgd"})),
    ((2, "mpi", {"sharding": "row_wise", "kind": "rowwise_adagrad"}),
     (4, "mpi", {"sharding": "table_row_wise", "local_size": 2, "kind": "rowwise_adagrad"})),
    ((4, "torch", {"sharding": "data_parallel", "kind": "adagrad", "door": True}),
     (2, "torch", {"mixed": True, "kind": "adagrad", "door": True})),
])
def test_a_checkpoint_loads_on_another_plan_and_world_size(tmp_path, save, load) -> None:
    (n1, b1, kw1), (n2, b2, kw2) = save, load
    saved = run_mpi(n1, "sharded_embeddings:resume", backend=b1, directory=str(tmp_path), phase="save", timeout=180,
                    shared=True, **kw1)
    assert "OK saved" in saved.output, saved.output[-3000:]
    resumed = run_mpi(n2, "sharded_embeddings:resume", backend=b2, directory=str(tmp_path), phase="load",
                      timeout=180, shared=True, **kw2)
    assert f"OK resumed on {n2} ranks" in resumed.output and "position 5" in resumed.output, resumed.output[-3000:]
    if n2 == 4 and b2 == "mpi":
        refused = run_mpi(2, "sharded_embeddings:wrong_tables", backend="mpi", directory=str(tmp_path), timeout=120,
                          shared=True)
        assert "OK refused" in refused.output and "holds other tables" in refused.output, refused.output[-3000:]
