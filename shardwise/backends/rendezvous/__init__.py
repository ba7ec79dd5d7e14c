"""The elastic job's rendezvous: a secret-protected key-value store and the generations kept in it.

Below the context (which joins a generation at init) and above nothing but core:
:mod:`shardwise.elastic` (state, commits, restarts) and :mod:`shardwise.ray` use it.
"""

from .membership import (ADDR_ENV, ID_ENV, SECRET_ENV, Assignment, Membership, WorkerEndpoint, change_wanted,
                         endpoint_from_env, join)
from .store import StoreClient, StoreServer, new_secret

__all__ = ["ADDR_ENV", "ID_ENV", "SECRET_ENV", "Assignment", "Membership", "WorkerEndpoint", "change_wanted",
           "endpoint_from_env", "join", "StoreClient", "StoreServer", "new_secret"]
