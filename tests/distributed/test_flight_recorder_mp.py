"""A stalled collective on real processes: every rank dumps its stacks and last collectives, the missing ranks are named.

The 64-rank run is the acceptance case of issue 55 (oversubscribed on this 2-core machine,
numpy only, about half a minute); the 8-rank one is its quick variant.
"""

from __future__ import annotations

import re

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi
_DUMP = re.compile(r"^\[shardwise flight rank (\d+)/(\d+)\] ===== stall dump at ([0-9.]+) \(\S+\): (.*) =====$", re.M)
_LINE = re.compile(r"^\[shardwise flight rank (\d+)/\d+\] (.*)$", re.M)


def _check_stall(np_: int, missing: list[int], stall_s: float, timeout: float) -> None:
    out = run_mpi(np_, "flight_recorder:stall", missing=missing, stall_s=stall_s, late_s=stall_s + 8,
                  timeout=timeout).output
    start = float(re.search(r"^FLIGHT start ([0-9.]+)$", out, re.M).group(1))
    dumps = {int(m.group(1)): (float(m.group(3)), m.group(4)) for m in _DUMP.finditer(out)}
    assert sorted(dumps) == list(range(np_)), f"ranks without a dump: {sorted(set(range(np_)) - set(dumps))}"
    lines: dict[int, list[str]] = {}
    for m in _LINE.finditer(out):
        lines.setdefault(int(m.group(1)), []).append(m.group(2))
    for rank in range(np_):
        text = "\n".join(lines[rank])
        assert "Python stacks:" in text and "thread MainThread" in text, text[:2000]
        assert "group world: last" in text and "allreduce" in text, text[:2000]
        if rank in missing:
            assert "in slow_data_loader" in text, text[:2000]  # where it is stuck
        else:
            assert re.search(r"allreduce\s+float32\[4\] started .* name='stalled'", text), text[:3000]
    # Every rank dumped within one more stall timeout after the stall timeout ran out.
    latest = max(t for t, _ in dumps.values()) - start
    assert latest < 2 * stall_s, f"the last dump came {latest:.1f} s after the stall began"
    verdicts = [line for rank_lines in lines.values() for line in rank_lines if "stalled: not finished" in line]
    # One verdict, from the lowest rank that reached the call (two if its answer came late to another).
    assert 1 <= len(verdicts) <= 2, verdicts
    for verdict in verdicts:
        assert f"missing ranks {sorted(missing)} have not reached it" in verdict, verdict
        assert "allreduce #5 'stalled' on world" in verdict, verdict
    assert out.count("FLIGHT done rank") == np_  # the late ranks came and the collective completed
    print(f"{np_} ranks: last dump {latest:.1f} s after the stall began (stall timeout {stall_s:g} s); {verdicts[0]}")


def test_stall_dumps_every_rank_and_names_the_missing_8() -> None:
    _check_stall(8, [2, 7], stall_s=3.0, timeout=90)


def test_stall_dumps_every_rank_and_names_the_missing_64() -> None:
    _check_stall(64, [5, 40, 63], stall_s=4.0, timeout=150)
