"""The device check's cases (device_scenarios.py; benchmarks/gpu_check.sh runs them on CUDA) at 2 ranks on the CPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from device_scenarios import CASES
from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

GPT2 = [name for name in CASES if name.startswith("gpt2")]
PATHS = [name for name in CASES if name not in GPT2]


def _passed(output: str) -> list[str]:
    return re.findall(r"^OK (\S+) on ", output, re.M)


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_training_paths_match_one_process(backend: str) -> None:
    result = run_mpi(2, "device_scenarios:run_cases", backend=backend, device="cpu", cases=PATHS, timeout=240,
                     shared=True)
    assert _passed(result.output) == PATHS, result.output[-3000:]


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_parallelize_gpt2_matches_one_process(backend: str) -> None:
    pytest.importorskip("transformers")
    result = run_mpi(2, "device_scenarios:run_cases", backend=backend, device="cpu", cases=GPT2, timeout=240,
                     shared=True)
    assert _passed(result.output) == GPT2, result.output[-3000:]


def test_gpu_check_script_runs_the_cases_on_the_cpu() -> None:
    """``benchmarks/gpu_check.sh --device cpu`` launches its own jobs and prints its table (two cases here)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), "--device", "cpu", "--backends", "mpi",
                           "--cases", "dp,pp-1f1b", "--steps", "3", "--timeout", "90"],
                          capture_output=True, text=True, env=env, timeout=300)
    rows = re.findall(r"^mpi\s+(\S+)\s+(PASS|FAIL)\b", proc.stdout, re.M)
    assert proc.returncode == 0 and rows == [("dp", "PASS"), ("pp-1f1b", "PASS")], proc.stdout + proc.stderr[-3000:]
    assert "2/2 PASS" in proc.stdout, proc.stdout
