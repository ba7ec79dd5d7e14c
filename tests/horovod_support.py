"""Whether the horovod backend can run here, asked once per test session in a subprocess.

Importing ``horovod.torch`` loads Horovod's C++ library; a broken build can crash the
importing process, so the pytest process never imports it itself.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

_PROBE = ("import horovod, horovod.torch as hvd; "
          "assert hvd.mpi_built(), 'Horovod was built without MPI'; print(horovod.__version__)")


@functools.lru_cache(maxsize=None)
def horovod_skip_reason() -> str:
    """Empty when ``horovod.torch`` (with MPI) imports in this Python, else why not."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot probe Horovod: {exc}"
    if out.returncode == 0:
        return ""
    lines = (out.stderr or out.stdout).strip().splitlines() or [f"exit {out.returncode}"]
    return (f"Horovod is not built in this venv ({lines[-1][:200]}); "
            "build it with: bash scripts/horovod/build.sh")


def needs_horovod(backend: str) -> list:
    """pytest marks for a test parametrized on ``backend``: a skip when it is horovod and Horovod is missing."""
    if backend != "horovod":
        return []
    reason = horovod_skip_reason()
    return [pytest.mark.skipif(bool(reason), reason=reason or "horovod available")]
