"""Strategy selection of shardwise.tensorflow: detection results are injected, no processes or devices."""

from __future__ import annotations

import json

import pytest

tf = pytest.importorskip("tensorflow")

import importlib  # noqa: E402
import os  # noqa: E402

from shardwise.core.errors import BackendError  # noqa: E402

# The package re-exports a function named ``strategy``; fetch the module itself.
st = importlib.import_module("shardwise.adapters.tensorflow.strategy")


class _Resolver:
    def __init__(self, master: str) -> None:
        self._master = master

    def master(self) -> str:
        return self._master


class _Comm:
    """Stands in for a communicator: scripted allgather_object answers."""

    def __init__(self, rank: int, size: int, answers: list[list]) -> None:
        self.rank, self.size, self._answers, self.calls = rank, size, list(answers), 0

    def allgather_object(self, obj):
        self.calls += 1
        return self._answers.pop(0)


@pytest.mark.parametrize("found, kind", [
    (st.Detection(_Resolver("grpc://10.0.0.2:8470"), world_size=4, local_gpus=8), "tpu"),
    (st.Detection(None, world_size=2, local_gpus=0), "multi_worker"),
    (st.Detection(None, world_size=2, local_gpus=4), "multi_worker"),
    (st.Detection(None, world_size=1, local_gpus=2), "mirrored"),
    (st.Detection(None, world_size=1, local_gpus=1), "default"),
    (st.Detection(None, world_size=1, local_gpus=0), "default"),
])
def test_choose_strategy(found: st.Detection, kind: str) -> None:
    choice = st.choose_strategy(found)
    assert choice.kind == kind and choice.reason


def test_detect_tpu_fails_over_cleanly() -> None:
    def no_tpu():
        raise ValueError("Please provide a TPU Name to connect to.")

    assert st.detect_tpu(no_tpu) is None
    assert st.detect_tpu(lambda: _Resolver("")) is None
    resolver = _Resolver("grpc://10.0.0.2:8470")
    assert st.detect_tpu(lambda: resolver) is resolver
    assert st.detect_tpu() is None  # this machine has no TPU: the real resolver must not raise


def test_detect_uses_the_communicator_size() -> None:
    found = st.detect(_Comm(0, 3, []), tpu_factory=lambda: _Resolver(""))
    assert found == st.Detection(None, 3, len(tf.config.list_physical_devices("GPU")))
    assert st.choose_strategy(found).kind == "multi_worker"


def test_tf_config_and_endpoints() -> None:
    single = st.worker_endpoints([("node", "10.0.0.1", 4000), ("node", "10.0.0.1", 4001)])
    assert single == ["localhost:4000", "localhost:4001"]
    multi = st.worker_endpoints([("a", "10.0.0.1", 4000), ("b", "10.0.0.2", 4000)])
    assert multi == ["10.0.0.1:4000", "10.0.0.2:4000"]
    assert st.tf_config(1, multi) == {"cluster": {"worker": multi}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(BackendError):
        st.tf_config(2, multi)


def test_endpoint_exchange_repicks_duplicate_ports() -> None:
    clash = [("node", "10.0.0.1", 5000), ("node", "10.0.0.1", 5000)]
    fine = [("node", "10.0.0.1", 5000), ("node", "10.0.0.1", 5001)]
    comm = _Comm(1, 2, [clash, fine])
    assert st._exchange_endpoints(comm) == ["localhost:5000", "localhost:5001"] and comm.calls == 2
    with pytest.raises(BackendError, match="distinct worker ports"):
        st._exchange_endpoints(_Comm(0, 2, [clash] * st._PORT_ATTEMPTS))


def test_default_strategy_for_one_process() -> None:
    assert st.strategy(st.Detection(None, 1, 0)) is tf.distribute.get_strategy()


def test_strategy_builds_what_was_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple] = []
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy", lambda: made.append(("mwms",)) or "mwms")
    monkeypatch.setattr(tf.distribute, "MirroredStrategy", lambda: "mirrored")
    monkeypatch.setattr(tf.distribute, "TPUStrategy", lambda r: made.append(("tpu", r)) or "tpu")
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r: made.append(("connect", r)))
    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", lambda r: made.append(("init", r)))
    monkeypatch.setenv("TF_CONFIG", "")  # so that teardown restores the original (strategy() writes it)
    monkeypatch.delenv("TF_CONFIG")

    comm = _Comm(1, 2, [[("a", "10.0.0.1", 4000), ("b", "10.0.0.2", 4001)]])
    assert st.strategy(st.Detection(None, 2, 0), comm=comm) == "mwms"
    assert json.loads(os.environ["TF_CONFIG"]) == {
        "cluster": {"worker": ["10.0.0.1:4000", "10.0.0.2:4001"]}, "task": {"type": "worker", "index": 1}}
    given = json.dumps(st.tf_config(0, ["h:1", "h:2"]))
    monkeypatch.setenv("TF_CONFIG", given)  # a user's TF_CONFIG is kept ...
    assert st.strategy(st.Detection(None, 2, 0), comm=_Comm(0, 2, [])) == "mwms"
    assert os.environ["TF_CONFIG"] == given
    with pytest.raises(BackendError, match="3 ranks"):  # ... if it fits the job
        st.strategy(st.Detection(None, 3, 0), comm=_Comm(0, 3, []))
    monkeypatch.setenv("TF_CONFIG", "not json")
    with pytest.raises(BackendError, match="not a valid"):
        st.strategy(st.Detection(None, 2, 0), comm=_Comm(0, 2, []))

    assert st.strategy(st.Detection(None, 1, 2)) == "mirrored"
    resolver = _Resolver("grpc://10.0.0.2:8470")
    assert st.strategy(st.Detection(resolver, 2, 0)) == "tpu"
    assert made[-3:] == [("connect", resolver), ("init", resolver), ("tpu", resolver)]
