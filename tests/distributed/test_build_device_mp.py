"""A meta-built model on real ranks lands on the device parallelize is given, with one-process values."""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

CASES = [
    ["gpt2", {"dp": 2, "zero_stage": 3}],
    ["gpt2", {"dp": 2, "zero_stage": 1}],
    ["llama", {"tp": 2}],
]


def test_meta_build_places_every_tensor_on_the_build_device() -> None:
    result = run_mpi(2, "build_device:on_device", backend="torch", cases=CASES, timeout=240, shared=True)
    ok = [line for line in result.output.splitlines() if line.startswith("OK device")]
    assert len(ok) == 2 * len(CASES), result.output[-3000:]
