"""The training process a Spark task starts: ``python -m shardwise.spark._child CALL RESULT``.

It unpickles ``(fn, args, kwargs)`` from the file CALL, runs it and writes
``(True, result, rank, False)`` or ``(False, traceback text, rank, peer_lost)`` to
the file RESULT (``rank`` in the job it last joined, -1 if none; ``peer_lost`` when
the function failed because another rank went away, so the other rank's failure
is the one to report). It dies with
the Spark task that started it, so a task Spark kills leaves no training process
behind (blocked in a collective, say).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback


def _die_with_parent() -> None:
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:  # where prctl is not available
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="shardwise-parent-watch", daemon=True).start()


def main(call_path: str, result_path: str) -> int:
    import cloudpickle

    from .. import context
    from ..core.errors import is_peer_loss

    _die_with_parent()
    peer_lost = False
    try:
        with open(call_path, "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        outcome = (True, fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver with its traceback
        outcome, peer_lost = (False, traceback.format_exc()), is_peer_loss(exc)
    rank = context.current().world.rank if context.is_initialized() else -1
    try:
        data = cloudpickle.dumps((*outcome, rank, peer_lost))
    except Exception:  # noqa: BLE001 - an unpicklable result is this rank's failure, not a crash
        outcome = (False, traceback.format_exc())
        data = cloudpickle.dumps((*outcome, rank, False))
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, result_path)
    try:
        context.shutdown()
    except Exception:  # noqa: BLE001 - the result is written; a failing teardown must not lose it
        pass
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
