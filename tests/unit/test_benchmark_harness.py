"""The benchmark harness measures every table's memory before it times any table.

A peak measured after another table's timing in the same process reads far too high
(the GPT's ZeRO-1 row 317.8 MiB against 174.8 MiB), so ``run_transports`` must finish
every memory phase, on every transport, before the first timing starts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import _common  # noqa: E402
from shardwise.backends.local import LocalCommunicator  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class _Recorded(_common.Transport):
    """A transport on a one-rank world that logs when it opens and closes."""

    def __init__(self, backend: str, tables: list[str], log: list) -> None:
        def make(world: Any) -> dict:
            return {key: {f"{backend} row": lambda: (lambda: None)} for key in tables}

        def report(world: Any, results: dict) -> None:
            log.append(("report", backend, {key: dict(rows) for key, rows in results.items()}))

        super().__init__(backend, make, report)
        self.log = log

    def open(self) -> Any:
        self.log.append(("open", self.backend))
        return LocalCommunicator()

    def close(self) -> None:
        self.log.append(("close", self.backend))


def test_every_memory_phase_comes_before_any_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list = []

    def memory(builds: dict, comm: Any) -> dict:
        log.append(("memory", next(iter(builds))))
        return {name: 1000 for name in builds}

    def timing(builds: dict, comm: Any, rounds: int, steps: int) -> dict:
        log.append(("time", next(iter(builds))))
        return {name: (0.5, [0.5] * rounds) for name in builds}

    monkeypatch.setattr(_common, "memory_phase", memory)
    monkeypatch.setattr(_common, "time_interleaved", timing)
    transports = [_Recorded("torch", ["mlp", "gpt"], log), _Recorded("mpi", ["mlp"], log)]
    _common.run_transports(transports, rounds=2, steps=1)

    kinds = [entry[:2] for entry in log]
    assert kinds == [("open", "torch"), ("memory", "torch row"), ("memory", "torch row"), ("close", "torch"),
                     ("open", "mpi"), ("memory", "mpi row"), ("close", "mpi"),
                     ("open", "torch"), ("time", "torch row"), ("time", "torch row"), ("report", "torch"),
                     ("close", "torch"),
                     ("open", "mpi"), ("time", "mpi row"), ("report", "mpi"), ("close", "mpi")]
    reports = {entry[1]: entry[2] for entry in log if entry[0] == "report"}
    assert reports["torch"]["gpt"]["torch row"] == (0.5, [0.5, 0.5], 1000)
    assert reports["mpi"]["mlp"]["mpi row"] == (0.5, [0.5, 0.5], 1000)


def test_without_memory_no_memory_phase_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list = []
    monkeypatch.setattr(_common, "memory_phase", lambda builds, comm: pytest.fail("memory phase ran"))
    monkeypatch.setattr(_common, "time_interleaved",
                        lambda builds, comm, rounds, steps: {name: (0.1, [0.1]) for name in builds})
    _common.run_transports([_Recorded("torch", ["mlp"], log)], rounds=1, steps=1, memory=False)
    assert [entry[0] for entry in log] == ["open", "report", "close"]
    assert log[1][2]["mlp"]["torch row"] == (0.1, [0.1], None)


def test_timing_reports_cpu_time_apart_from_wall_time() -> None:
    """A step that sleeps takes wall time but almost no CPU; one that computes takes both."""
    import time

    def build_sleeper():
        return lambda: time.sleep(0.02)

    def build_worker():
        def step() -> None:
            end = time.process_time() + 0.02
            while time.process_time() < end:
                pass
        return step

    out = _common.time_interleaved({"sleep": build_sleeper, "work": build_worker}, LocalCommunicator(),
                                   rounds=2, steps=2, warmup=0)
    sleep_wall, _, sleep_cpu = out["sleep"]
    work_wall, _, work_cpu = out["work"]
    assert sleep_wall >= 0.02 and sleep_cpu < 0.005
    assert work_cpu >= 0.02 and work_wall >= work_cpu * 0.9


def test_tables_show_the_cpu_column_only_when_measured(capsys: pytest.CaptureFixture) -> None:
    _common.print_results("t", {"a": _common.Row(0.1, [0.1], None, 0.05), "b": (0.2, [0.2], 2**20)})
    lines = capsys.readouterr().out.splitlines()
    assert "CPU ms/step" in lines[2]
    assert lines[4].startswith("| a | 100.0 | 50.0 |") and lines[5].startswith("| b | 200.0 | n/a |")
    _common.print_results("t", {"b": (0.2, [0.2], 2**20)})
    assert "CPU ms/step" not in capsys.readouterr().out


def test_ratio_table_pairs_the_interleaved_rounds(capsys: pytest.CaptureFixture) -> None:
    """Round k of both contenders ran back to back: the per-round ratio divides those, not the medians."""
    ours, peer = [0.09, 0.18, 0.10], [0.10, 0.20, 0.09]  # a slow middle round hits both
    assert _common.paired_ratios(ours, peer) == "0.90x (0.90-1.11), 2/3"
    assert _common.paired_ratios([], []) == "n/a"
    _common.print_results("t", {"ours": (0.10, ours, 2**20), "peer": (0.10, peer, 2**21)}, [("ours", "peer")])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ours | peer |")]
    assert row == ["| ours | peer | 1.00x | 0.90x (0.90-1.11), 2/3 | 0.50x |"]


def test_ratio_table_shows_the_floor_over_the_peer_when_a_floor_row_is_named(capsys: pytest.CaptureFixture) -> None:
    """A table with a no-communication row says how low any library's ratio could go."""
    results = {"ours": (0.10, [0.10], 2**20), "peer": (0.20, [0.20], 2**20), "floor": (0.19, [0.19], 2**20)}
    _common.print_results("t", results, [("ours", "peer")], floor="floor")
    out = capsys.readouterr().out.splitlines()
    row = [line for line in out if line.startswith("| ours | peer |")]
    assert row == ["| ours | peer | 0.50x | 0.50x (0.50-0.50), 1/1 | 1.00x | 0.95x |"]
    assert any(line.endswith("| floor / peer |") for line in out)
    _common.print_results("t", results, [("ours", "peer")], floor="not a row")
    assert "floor / peer" not in capsys.readouterr().out
