"""The horovod backend on real processes (Horovod's MPI controller under mpirun, and Gloo
under horovodrun): torch data parallelism equals single-process training, Horovod's
own DistributedOptimizer agrees, and the backend's Horovod specifics hold.

Skipped, with the reason, when Horovod is not built (bash scripts/horovod/build.sh).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_support import horovod_skip_reason
from mpi_harness import ROOT, run_mpi

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(bool(horovod_skip_reason()), reason=horovod_skip_reason() or "ok")]


@pytest.mark.parametrize("np_", [2, 4], ids=lambda n: f"np{n}")
def test_data_parallel(np_: int) -> None:
    run_mpi(np_, "horovod_scenarios:data_parallel", backend="horovod", timeout=240)


def test_zero_on_horovod() -> None:
    """ZeRO stages 1-3 on the horovod backend equal plain data parallelism (and the memory model)."""
    run_mpi(2, "zero_scenarios:equivalence", backend="horovod", steps=5, timeout=240)


def test_keras_data_parallel_on_horovod() -> None:
    """Keras fit with DistributedOptimizer on the horovod backend equals one-process fit."""
    pytest.importorskip("tensorflow")
    run_mpi(2, "keras_dp:fit_equivalence", optimizers=["sgd", "adam"], extras=False, backend="horovod",
            timeout=240, env={"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("np_", [2, 4], ids=lambda n: f"np{n}")
def test_engine(np_: int) -> None:
    run_mpi(np_, "horovod_scenarios:engine", backend="horovod", timeout=180)


def test_shardwise_run_horovodrun_gloo() -> None:
    """``shardwise run --horovodrun`` starts ranks with Horovod's Gloo controller and the horovod backend."""
    horovodrun = Path(sys.executable).parent / "horovodrun"
    if not horovodrun.exists():
        pytest.skip("horovodrun is not installed beside this python")
    code = ("import shardwise, numpy as np, horovod.torch as hvd; w = shardwise.init().world; "
            "assert shardwise.current().backend == 'horovod' and hvd.gloo_enabled(); "
            "s = w.allreduce(np.array([w.rank + 1.0])); "
            "assert w.alltoall(np.arange(2.0) + 10 * w.rank).tolist() == [10.0 * r + w.rank for r in range(2)]; "
            "print('GLOO-OK', w.rank, s[0], flush=True); shardwise.shutdown()")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("SHARDWISE_BACKEND", None)
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "run", "--horovodrun", "-np", "2", "--",
                          sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=240, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert text.count("GLOO-OK") == 2 and " 3.0" in text, text[-4000:]
