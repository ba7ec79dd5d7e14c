"""Handle implementations shared by the backends."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ..core.comm import Handle
from ..core.errors import CollectiveTimeoutError


class PollingHandle(Handle):
    """A handle over engine requests, completed by ``wait_all`` or polled by ``test_all``.

    ``finish`` runs once after completion and produces the result (copy-back,
    averaging, down-casting). A wait with a timeout polls so that a missing peer
    becomes a :class:`CollectiveTimeoutError` naming ``what`` instead of a hang.
    """

    def __init__(self, what: str, wait_all: Callable[[], None], test_all: Callable[[], bool],
                 finish: Callable[[], Any], default_timeout: Optional[float] = None,
                 keepalive: Any = None) -> None:
        self._what = what
        # Buffers of a non-blocking operation must outlive it.
        self._keepalive = keepalive
        self._wait_all = wait_all
        self._test_all = test_all
        self._finish = finish
        self._default_timeout = default_timeout
        self._completed = False
        self._result: Any = None

    def done(self) -> bool:
        return self._completed or self._test_all()

    def wait(self, timeout: Optional[float] = None) -> Any:
        if self._completed:
            return self._result
        timeout = self._default_timeout if timeout is None else timeout
        if timeout is None:
            self._wait_all()
        else:
            deadline = time.monotonic() + timeout
            pause = 1e-5
            while not self._test_all():
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"{self._what} did not complete within {timeout:g} s: at least one rank "
                        "never joined it (it crashed, hung, or called a different collective)")
                time.sleep(pause)
                pause = min(pause * 2, 5e-3)
        self._result = self._finish()
        self._completed = True
        self._keepalive = None
        return self._result
