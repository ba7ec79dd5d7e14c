"""Sharded sequence embeddings (unpooled rows per id) under mpirun: every sharding type (data_parallel in
the mixed plans), SGD, Adagrad and row-wise Adagrad, uneven batches (one rank's empty), at 2 and 4 ranks,
equal to one process with unsharded nn.Embeddings; bad input refused on every rank; equal to TorchRec's
EmbeddingCollection where TorchRec is installed."""

import importlib.util

import pytest
import torch

from mpi_harness import run_mpi
from shardwise.adapters.torch.embedding.sequence import JaggedTensor
from shardwise.core.errors import ShapeMismatchError

CASES = {
    (2, "torch"): [{"sharding": "row_wise", "kind": "sgd", "skew": True},
                   {"sharding": "column_wise", "kind": "adagrad"},
                   {"sharding": "table_wise", "kind": "adagrad", "skew": True},
                   {"kind": "sgd"},
                   {"sharding": "row_wise", "kind": "rowwise_adagrad", "skew": True}],
    (4, "torch"): [{"sharding": "table_row_wise", "kind": "adagrad", "local_size": 2, "skew": True},
                   {"kind": "sgd", "local_size": 2, "skew": True},
                   {"sharding": "row_wise", "kind": "adagrad"},
                   {"sharding": "column_wise", "kind": "sgd", "skew": True},
                   {"sharding": "table_wise", "kind": "rowwise_adagrad"}],
    (2, "mpi"): [{"kind": "adagrad", "skew": True}],
}
#: TorchRec (benchmarks/setup.sh, scripts/setup.sh) is optional: compared with where installed
TORCHREC = importlib.util.find_spec("torchrec") is not None


@pytest.mark.mpi
@pytest.mark.parametrize("np_, backend", list(CASES))
def test_sequence_embeddings_train_like_one_process(np_: int, backend: str) -> None:
    cases = CASES[(np_, backend)]
    extra = backend == "mpi"  # the refusals and TorchRec's collection, in the 2-rank mpi job
    result = run_mpi(np_, "sequence_embeddings:cases", backend=backend, cases=cases, refuse=extra,
                     torchrec=extra and TORCHREC, timeout=180, shared=True)
    ok = [line for line in result.output.splitlines() if line.startswith("OK sequence ")]
    assert len(ok) == len(cases) + extra + (extra and TORCHREC), result.output[-3000:]
    if extra:
        assert "OK sequence lookups refused on every rank" in ok, result.output[-3000:]
    if extra and TORCHREC:
        assert any(line.startswith("OK sequence rows equal TorchRec's") for line in ok), result.output[-3000:]


@pytest.mark.timeout(30)
def test_jagged_tensor_pads_cuts_and_splits() -> None:
    values = torch.arange(12.0).view(6, 2)
    jt = JaggedTensor(values, torch.tensor([2, 0, 3, 1]))
    assert jt.offsets().tolist() == [0, 2, 2, 5, 6]
    assert [t.shape[0] for t in jt.to_dense()] == [2, 0, 3, 1]
    padded = jt.to_padded_dense(2, padding_value=-1.0)
    assert padded.shape == (4, 2, 2)
    assert padded[0].tolist() == [[0, 1], [2, 3]] and padded[1].tolist() == [[-1, -1], [-1, -1]]
    assert padded[2].tolist() == [[4, 5], [6, 7]] and padded[3].tolist() == [[10, 11], [-1, -1]]
    assert jt.to_padded_dense().shape == (4, 3, 2)
    with pytest.raises(ShapeMismatchError, match="lengths add up to 5"):
        JaggedTensor(values, torch.tensor([2, 3]))
