"""What both sharded collections do first: their communicator, their tables and a plan every rank agrees on."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ....context import current
from ....core.comm import Communicator
from ....core.embedding_lookup import agree_on_tables, check_plan
from ....core.embedding_plan import EmbeddingPlan, TableConfig, plan_tables
from ....core.errors import ConfigError

__all__ = ["planned_tables"]


def planned_tables(tables: Sequence[Any], plan: Optional[EmbeddingPlan], comm: Optional[Communicator], *,
                   convert: Callable[[Any], list[TableConfig]], optimizer: str,
                   global_batch: int) -> tuple[Communicator, list[TableConfig], EmbeddingPlan]:
    """``comm`` (default: the world), ``tables`` as :class:`TableConfig` (``convert``) and ``plan`` (default:
    :func:`plan_tables` for them); collective: a :class:`ConfigError` on every rank where any rank's
    tables or plan are wrong, or the ranks' differ."""
    if comm is None:
        ctx = current()
        comm, local = ctx.world, ctx.local_size
    else:
        local = comm.size
    problem = None
    try:
        tables = convert(tables)
        if plan is None:
            plan = plan_tables(tables, comm.size, local_size=local if comm.size % local == 0 else comm.size,
                               optimizer=optimizer, global_batch=global_batch)
        check_plan(plan, tables, comm.size)
    except ConfigError as exc:  # refused on every rank below, not on this one alone
        problem = str(exc)
    agree_on_tables(comm, plan, problem)
    return comm, tables, plan
