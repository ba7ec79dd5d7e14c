"""The order in which a pipeline rank's messages arrive from each peer.

Tags make the order of receives irrelevant on MPI and gloo, but not on NCCL: torch's NCCL
group ignores tags, and a rank's receives from one peer take that peer's sends in the
order both sides posted them. An executor that posts receives ahead of need must therefore
post each peer's in :func:`arrival_order`, and never skip one whose buffer it cannot size
yet (a gradient whose forward has not run, an activation whose shape header has not come)
to post a later one: under interleaved schedules, where the ranks at the ends of the ring
send each other activations and gradients, that took one message for another (equal shapes
swap silently, unequal ones fail).
"""

from __future__ import annotations

from typing import NamedTuple

from .pipeline import Action, Schedule

__all__ = ["Arrival", "arrival_order"]

_FORWARD_KINDS = frozenset({"forward", "send_act", "recv_act"})


class Arrival(NamedTuple):
    """One message from a peer: the receive action it completes, and whether a header precedes it."""

    receive: Action
    after_header: bool


def arrival_order(schedule: Schedule, rank: int, *, forward_only: bool = False,
                  headers: bool = False) -> dict[int, list[Arrival]]:
    """Per peer, the receives of ``rank`` in the order that peer sends their messages.

    ``forward_only``: the schedule runs its forward actions only (prediction).
    ``headers``: a sender announces the first activation it sends to each model stage in a
    step with a header message sent just before it (:attr:`Arrival.after_header`).
    """
    def runs(a: Action) -> bool:
        return not forward_only or a.kind in _FORWARD_KINDS

    mine = {schedule.tag(rank, a): a for a in schedule.actions[rank]
            if a.kind in ("recv_act", "recv_grad") and runs(a)}
    order: dict[int, list[Arrival]] = {}
    for peer, actions in enumerate(schedule.actions):
        announced: set[int] = set()
        for a in actions:
            if peer == rank or a.peer != rank or a.kind not in ("send_act", "send_grad") or not runs(a):
                continue
            header = False
            if headers and a.kind == "send_act":
                stage = schedule.model_stage(peer, a.chunk) + 1
                header = stage not in announced
                announced.add(stage)
            order.setdefault(peer, []).append(Arrival(mine[schedule.tag(peer, a)], header))
    return order
