"""TorchRec interop under mpirun (2 ranks, torch backend): a TorchRec EmbeddingBagCollection's tables, weights
and batches move onto shardwise's sharded tables and back, equal to TorchRec's unsharded collection and to one
process; whole tables gather and load; what shardwise cannot express is refused."""

import importlib.util

import pytest

from mpi_harness import run_mpi

# find_spec, not importorskip: importing torchrec takes seconds, paid at collection by every run
if importlib.util.find_spec("torchrec") is None:
    pytest.skip("torchrec is not installed", allow_module_level=True)

pytestmark = pytest.mark.mpi

CASES = [f"OK torchrec {sharding} {kind}:" for sharding in ("table_wise", "row_wise", "column_wise")
         for kind in ("sum+mean", "weighted sum")]


@pytest.mark.timeout(240)
def test_a_torchrec_model_moves_to_shardwise_and_back() -> None:
    result = run_mpi(2, "torchrec_interop:interop", backend="torch", timeout=180, shared=True)
    lines = [line for line in result.output.splitlines() if line.startswith("OK ")]
    for case in CASES:
        assert any(line.startswith(case) for line in lines), f"no {case!r} line\n{result.output[-3000:]}"
    assert any(line.startswith("OK replicated table taken once") for line in lines), result.output[-3000:]
    assert any(line.startswith("OK refused:") for line in lines), result.output[-3000:]
