"""Entry point each rank runs.

``_runner.py module:function '{json kwargs}'`` runs one scenario and exits.
``_runner.py --serve DIR PID`` runs the scenarios the harness (process ``PID``)
writes to ``DIR`` as ``00000.json``, ``00001.json``, ... one after another in this
process (a shared job: the ranks pay their imports once), printing an end marker
after each, until a ``null`` command or the harness's end. Either way a scenario
that raises prints a rank-tagged traceback and aborts the whole job, so a failure
never turns into a hang.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: What each rank prints after a scenario of a shared job: ``... END <index> rank <rank> =====``.
END_MARKER = "===== SHARDWISE SCENARIO END {index} rank {rank} ====="


def _rank() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _run(target: str, kwargs: dict) -> None:
    """Run one scenario; on any failure print the traceback and end the whole job."""
    module_name, func_name = target.split(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        func(**kwargs)
    except BaseException:  # noqa: BLE001 - any failure must end the whole job
        sys.stdout.flush()
        sys.stderr.write(f"\n===== SHARDWISE TEST FAILURE rank {_rank()} =====\n{traceback.format_exc()}\n")
        sys.stderr.flush()
        try:
            import shardwise
            if shardwise.is_initialized():
                shardwise.current().world.abort(1)
        finally:
            from os import _exit
            _exit(1)


def _shutdown() -> None:
    try:
        import shardwise
        shardwise.shutdown()
    except Exception:  # noqa: BLE001
        pass


def _reset_settings() -> None:
    """Undo the process-wide settings a scenario may change (a shared job runs more after it)."""
    if "torch" in sys.modules:
        import torch

        torch.set_default_dtype(torch.float32)
    if "keras" in sys.modules:
        import keras

        keras.config.set_floatx("float32")
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.clear_session()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def serve(directory: Path, harness: int) -> None:
    """Run the harness's commands in order until it sends ``null`` or its process ``harness`` is gone."""
    index = 0
    while True:
        path = directory / f"{index:05d}.json"
        polls = 0
        while not path.exists():
            time.sleep(0.05)
            polls += 1
            if polls % 20 == 0 and _gone(harness):  # pytest killed: leave no ranks behind, nor commands
                if _rank() == 0:
                    shutil.rmtree(directory, ignore_errors=True)
                return
        command = json.loads(path.read_text())
        if command is None:
            return
        _run(command["target"], command["kwargs"])
        _shutdown()
        _reset_settings()
        sys.stderr.flush()
        print(END_MARKER.format(index=index, rank=_rank()), flush=True)
        index += 1


def main() -> int:
    if sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        _run(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    _shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
