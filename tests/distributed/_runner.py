"""Entry point each rank runs: ``_runner.py module:function '{json kwargs}'``."""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rank() -> int:
    import os
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def main() -> int:
    target, raw = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}"
    module_name, func_name = target.split(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        func(**json.loads(raw))
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
    try:
        import shardwise
        shardwise.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
