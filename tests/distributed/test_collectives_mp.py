"""Every collective on real processes: mpi, torch and horovod backends, 2 and 4 ranks.

The horovod cases run Horovod's MPI controller under mpirun; they are skipped, with
the reason, when Horovod is not built in the venv (bash scripts/horovod/build.sh).
"""

import pytest

from horovod_support import needs_horovod
from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

SCENARIOS = ["allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "point_to_point"]
BACKENDS = [pytest.param(b, marks=needs_horovod(b)) for b in ("mpi", "torch", "horovod")]


@pytest.mark.parametrize("np_", [2, 4], ids=lambda n: f"np{n}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_collectives(backend: str, np_: int) -> None:
    # every scenario in one job: a failing one names itself in the rank's traceback; the
    # 4-rank job (subgroups, rank orders, uneven splits) runs one dtype of each family, as
    # every dtype's path is the same at any world size and the 2-rank job runs them all
    run_mpi(np_, "collectives:scenarios", backend=backend, names=SCENARIOS, core_dtypes=np_ > 2, timeout=900)


@pytest.mark.parametrize("np_", [2, 4], ids=lambda n: f"np{n}")
def test_mpi_halving_average(np_: int) -> None:
    run_mpi(np_, "collectives:mpi_halving", timeout=300)


#: The tf backend: TensorFlow's collective ops on CPU, 2 ranks only (each process imports TF).
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["shared", "tf_backend:extras", "tf_backend:keras", "tf_backend:horovod_order"])
def test_collective_tf(scenario: str) -> None:
    """The shared suite in one job (numpy: NUMPY_DTYPES, TF tensors: all of TF_DTYPES), and tf-only scenarios."""
    pytest.importorskip("tensorflow")
    if scenario == "shared":  # one launch: each process imports TensorFlow once, not once per scenario
        run_mpi(2, "collectives:scenarios", backend="tf", names=SCENARIOS, timeout=600, env=TF_ENV)
    else:
        run_mpi(2, scenario, timeout=300, env=TF_ENV)
