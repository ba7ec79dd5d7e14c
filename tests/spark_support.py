"""What the Spark tests share: skipping where Spark cannot run, and reading a driver script's verdicts.

Each Spark test module runs one driver script (one Spark session, one JVM start) that
prints a JSON line ``{"scenario": name, ...}`` per scenario; the tests assert on those.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Optional

import pytest


def require_spark() -> None:
    """Skip the calling module, naming what to install, where pyspark or Java is missing."""
    pytest.importorskip("pyspark", reason="the Spark tests need pyspark: pip install 'shardwise[spark]'")
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        pytest.skip("the Spark tests need a Java runtime (Java 17 or 21): apt-get install "
                    "openjdk-17-jre-headless, or set JAVA_HOME", allow_module_level=True)


def driver_verdicts(script: str, args: tuple[str, ...] = (), env: Optional[dict[str, str]] = None,
                    timeout: float = 280) -> dict[str, dict]:
    """Run a driver script; its verdicts by scenario (fails with the driver's stderr if it failed)."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=os.path.dirname(script))
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            found[record.pop("scenario")] = record
    assert proc.returncode == 0, f"driver failed ({proc.returncode}), verdicts {found}:\n{proc.stderr[-6000:]}"
    return found


def check_rank_failure(failure: dict, rank: int, text: str, within: float = 30.0) -> None:
    """A driver's failure verdict: JobFailedError naming ``rank``, ``text`` in its traceback, in time."""
    assert failure["raised"] == "JobFailedError" and failure["rank"] == rank, failure
    assert text in failure["message"], failure["message"]
    assert failure["seconds"] < within, failure
