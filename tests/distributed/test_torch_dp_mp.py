"""PyTorch data parallelism on real processes: mpi and torch backends, 2 and 4 ranks.

Few launches, many checks each (see torch_dp.py): ``data_parallel`` trains against
single-process references (fp32 rtol 1e-5; fp16 compression rtol 1e-3, bf16 1e-2)
and checks errors, state broadcast and SyncBatchNorm; ``hvd_api`` covers the
Horovod functional API and process sets; the digits example runs end to end.
"""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [2, 4], ids=lambda n: f"np{n}")
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_data_parallel(backend: str, np_: int) -> None:
    run_mpi(np_, "torch_dp:data_parallel", backend=backend, timeout=240, shared=True)


@pytest.mark.parametrize("np_", [2, 4], ids=lambda n: f"np{n}")
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_hvd_api(backend: str, np_: int) -> None:
    run_mpi(np_, "torch_dp:hvd_api", timeout=120, env={"SHARDWISE_BACKEND": backend}, shared=True)


def test_digits_example(tmp_path) -> None:
    run_mpi(2, "torch_dp:digits_example", backend="mpi", checkpoint_dir=str(tmp_path / "ckpt"), timeout=180,
            shared=True)
