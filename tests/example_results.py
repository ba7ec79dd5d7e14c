"""The one machine-readable line an example prints at its end: ``SHARDWISE_RESULT {json}``.

Tests of the examples assert on these values (loss, accuracy, layout, ...) instead of
matching the wording of the lines printed for people. A line may carry a prefix (mpirun's
or Ray's tags of a process's output); the record is the JSON after the marker.
"""

from __future__ import annotations

import json
from typing import Any

MARKER = "SHARDWISE_RESULT "


def example_results(output: str, example: str) -> list[dict[str, Any]]:
    """Every result record of ``example`` in ``output``, in order."""
    found = []
    for line in output.splitlines():
        at = line.find(MARKER)
        if at < 0:
            continue
        record = json.loads(line[at + len(MARKER):])
        assert isinstance(record, dict), line
        if record.get("example") == example:
            found.append(record)
    return found


def example_result(output: str, example: str) -> dict[str, Any]:
    """The one result record of ``example`` in ``output`` (an assertion error unless there is exactly one)."""
    found = example_results(output, example)
    assert len(found) == 1, f"{len(found)} result lines of {example}, expected 1:\n{output[-3000:]}"
    return found[0]
