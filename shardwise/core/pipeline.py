"""Pipeline-parallel schedules as data, and a discrete-event simulator for them.

A :class:`Schedule` is one list of :class:`Action` per pipeline rank. An executor
runs a rank's list in order:

* ``forward`` / ``backward`` compute model chunk ``chunk`` of this rank on a
  micro-batch. Chunk ``c`` of rank ``r`` is model stage ``c * num_stages + r``
  (one chunk per rank unless the schedule is interleaved).
* ``send_act`` / ``send_grad`` send the activation (after a forward) or the input
  gradient (after a backward) of ``(microbatch, chunk)`` to rank ``peer``.
* ``recv_act`` / ``recv_grad`` receive the input activation of a forward, or the
  output gradient of a backward, of ``(microbatch, chunk)`` from rank ``peer``.

Communication contract: **sends are non-blocking (buffered / ``isend`` waited
lazily), receives are blocking.** Every schedule built here is deadlock-free
under that contract; :func:`simulate` models exactly that and proves it per
schedule. Pairing *blocking* (rendezvous) sends naively between neighbours is
NOT supported: in the 1F1B steady state rank ``s`` sends an activation forward
while rank ``s + 1`` sends a gradient back, and two rendezvous sends would wait
on each other. Messages between a pair of ranks are received in the order they
were sent, so an executor may match them FIFO per ``(src, dst, act|grad)``
channel or use :meth:`Schedule.tag`, which is equal on both ends. On engines that
ignore tags (NCCL), receives from a peer must be posted in the order it sends
(:func:`~shardwise.core.pipeline_arrivals.arrival_order`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, Optional

from .errors import ConfigError

__all__ = [
    "ACTION_KINDS", "Action", "Schedule", "SimResult", "ScheduleError", "ScheduleDeadlockError",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "build_schedule", "simulate",
    "bubble_fraction", "peak_activations",
]

ACTION_KINDS = ("forward", "backward", "send_act", "recv_act", "send_grad", "recv_grad")
_COMPUTE = frozenset({"forward", "backward"})
_ALIASES: Mapping[str, str] = MappingProxyType({
    "gpipe": "gpipe", "1f1b": "1f1b", "one_f_one_b": "1f1b",
    "interleaved_1f1b": "interleaved_1f1b", "interleaved": "interleaved_1f1b",
})


class ScheduleError(ConfigError):
    """Invalid pipeline schedule arguments, or a schedule that breaks the data flow."""


class ScheduleDeadlockError(ScheduleError):
    """Every unfinished rank waits on a receive whose send never happens."""


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one rank: compute, or send/receive to/from rank ``peer``."""

    kind: str
    microbatch: int
    chunk: int = 0
    peer: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; expected one of {ACTION_KINDS}")
        if (self.peer is None) != (self.kind in _COMPUTE):
            raise ScheduleError(f"{self.kind} needs {'no' if self.kind in _COMPUTE else 'a'} peer")

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind}(mb={self.microbatch},chunk={self.chunk}){peer}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the shape of the pipeline they were built for."""

    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    actions: list[list[Action]]

    @property
    def num_model_stages(self) -> int:
        """Number of model chunks in the whole pipeline (``num_stages * virtual_stages``)."""
        return self.num_stages * self.virtual_stages

    def model_stage(self, rank: int, chunk: int) -> int:
        """Model stage held as ``chunk`` by ``rank``."""
        return chunk * self.num_stages + rank

    def tag(self, rank: int, action: Action) -> int:
        """Message tag of a send/recv action, identical on the sending and receiving rank."""
        if action.kind in _COMPUTE:
            raise ScheduleError(f"{action.kind} has no message tag")
        # key a message by the model stage that receives it
        shift = {"send_act": 1, "send_grad": -1}.get(action.kind, 0)
        stage = self.model_stage(rank, action.chunk) + shift
        return (action.microbatch * self.num_model_stages + stage) * 2 + int(action.kind.endswith("_grad"))


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`; ``bubble_fraction`` is the idle share of compute time."""

    makespan: float
    busy: list[float]
    bubble_fraction: float


def _check_counts(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    for label, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                         ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{label} must be an integer >= 1, got {value!r}")


def _steps(rank: int, p: int, v: int, mb: int, chunk: int, forward: bool) -> list[Action]:
    """recv -> compute -> send of one (micro-batch, chunk); no messages within a rank."""
    stage, last, fam = chunk * p + rank, p * v - 1, "act" if forward else "grad"
    src, dst = ((rank - 1) % p, (rank + 1) % p) if forward else ((rank + 1) % p, (rank - 1) % p)
    steps = []
    if p > 1 and (stage > 0 if forward else stage < last):
        steps.append(Action("recv_" + fam, mb, chunk, src))
    steps.append(Action("forward" if forward else "backward", mb, chunk))
    if p > 1 and (stage < last if forward else stage > 0):
        steps.append(Action("send_" + fam, mb, chunk, dst))
    return steps


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards (both in micro-batch order)."""
    _check_counts(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    actions = []
    for r in range(p):
        steps = [a for i in range(m) for a in _steps(r, p, 1, i, 0, True)]
        steps += [a for i in range(m) for a in _steps(r, p, 1, i, 0, False)]
        actions.append(steps)
    return Schedule("gpipe", p, m, 1, actions)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): ``p - s - 1`` warm-up forwards, steady 1F1B, cool-down backwards.

    ``num_microbatches < num_stages`` is allowed: the warm-up is clipped to ``m``
    and the schedule degenerates to GPipe on the first ranks (same bubble formula).
    """
    _check_counts(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    actions = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        steps = [a for i in range(warmup) for a in _steps(r, p, 1, i, 0, True)]
        for j in range(m - warmup):
            steps += _steps(r, p, 1, warmup + j, 0, True)
            steps += _steps(r, p, 1, j, 0, False)
        for j in range(m - warmup, m):
            steps += _steps(r, p, 1, j, 0, False)
        actions.append(steps)
    return Schedule("1f1b", p, m, 1, actions)


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron interleaved 1F1B: each rank holds ``virtual_stages`` model chunks.

    Micro-batches go through the chunks in groups of ``num_stages``, so
    ``num_microbatches % num_stages == 0`` is required when ``virtual_stages > 1``.
    With ``virtual_stages == 1`` the actions are those of :func:`one_f_one_b`.
    """
    _check_counts(num_stages, num_microbatches, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if v == 1:
        return dataclasses.replace(one_f_one_b(p, m), name="interleaved_1f1b")
    if m % p != 0:
        raise ScheduleError(
            f"interleaved 1F1B needs num_microbatches ({m}) divisible by num_stages ({p}) "
            f"when virtual_stages ({v}) > 1")
    total, group = m * v, p * v

    def mb_of(k: int) -> int:
        return (k // group) * p + k % p

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % group) // p
        return c if forward else v - 1 - c

    actions = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        steps = [a for k in range(warmup) for a in _steps(r, p, v, mb_of(k), chunk_of(k, True), True)]
        for k in range(total - warmup):
            kf = warmup + k
            steps += _steps(r, p, v, mb_of(kf), chunk_of(kf, True), True)
            steps += _steps(r, p, v, mb_of(k), chunk_of(k, False), False)
        for k in range(total - warmup, total):
            steps += _steps(r, p, v, mb_of(k), chunk_of(k, False), False)
        actions.append(steps)
    return Schedule("interleaved_1f1b", p, m, v, actions)


def build_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name: ``gpipe``, ``1f1b`` or ``interleaved_1f1b``."""
    key = _canonical(name)
    if key == "interleaved_1f1b":
        return interleaved_1f1b(num_stages, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ScheduleError(f"schedule {name!r} has no virtual stages, got virtual_stages={virtual_stages}")
    build = gpipe if key == "gpipe" else one_f_one_b
    return build(num_stages, num_microbatches)


def _canonical(name: str) -> str:
    key = _ALIASES.get(str(name).strip().lower())
    if key is None:
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {sorted(set(_ALIASES.values()))}")
    return key


def bubble_fraction(schedule_name: str, p: int, m: int, v: int = 1) -> float:
    """Closed-form idle fraction: ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v*m+p-1)``."""
    key = _canonical(schedule_name)
    _check_counts(p, m, v)
    if key != "interleaved_1f1b" and v != 1:
        raise ScheduleError(f"schedule {schedule_name!r} has no virtual stages, got v={v}")
    return (p - 1) / (v * m + p - 1)


def simulate(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0,
             comm_cost: float = 0.0) -> SimResult:
    """Run the schedule as a discrete-event simulation and check its data flow.

    Costs are per micro-batch for one rank's share of the model (an interleaved
    chunk costs ``1 / virtual_stages`` of it). A send costs the sender nothing and
    arrives ``comm_cost`` later; a receive blocks until its message arrived. With
    ``comm_cost=0`` the schedules built here reach :func:`bubble_fraction` exactly,
    for any forward/backward ratio. Raises :class:`ScheduleDeadlockError` if ranks
    wait forever, :class:`ScheduleError` if an action lacks its input, a (micro-batch,
    model stage) is not run forward and backward exactly once, or a message is lost.
    """
    if min(forward_cost, backward_cost, comm_cost) < 0:
        raise ScheduleError("simulation costs must be >= 0")
    p, v, m = schedule.num_stages, schedule.virtual_stages, schedule.num_microbatches
    if len(schedule.actions) != p:
        raise ScheduleError(f"schedule has {len(schedule.actions)} action lists for {p} stages")
    last = p * v - 1
    cost = {"forward": forward_cost / v, "backward": backward_cost / v}
    clock, busy, pc = [0.0] * p, [0.0] * p, [0] * p
    inbox: dict[tuple[str, int, int], float] = {}  # (act|grad, mb, receiving stage) -> arrival
    # ("in"|"out"|"fwd"|"bwd", mb, model stage) available on the stage's rank
    have = {(k, i, s) for i in range(m) for k, s in (("in", 0), ("out", last))}
    runnable = list(range(p))
    while runnable:
        r = runnable.pop()
        steps, i, t = schedule.actions[r], pc[r], clock[r]
        while i < len(steps):
            a = steps[i]
            s = a.chunk * p + r
            if not 0 <= a.microbatch < m or not 0 <= a.chunk < v:
                raise ScheduleError(f"stage {r}: {a} is out of range")
            if a.kind in _COMPUTE:
                fwd = a.kind == "forward"
                key = ("fwd" if fwd else "bwd", a.microbatch, s)
                if key in have:
                    raise ScheduleError(f"stage {r}: {a} runs twice")
                for need in (("in",) if fwd else ("fwd", "out")):
                    if (need, a.microbatch, s) not in have:
                        raise ScheduleError(f"stage {r}: {a} runs before its input ({need}) is available")
                have.add(key)
                nxt = s + 1 if fwd else s - 1
                if 0 <= nxt <= last and nxt % p == r:  # next stage on this rank: no message
                    have.add(("in" if fwd else "out", a.microbatch, nxt))
                t += cost[a.kind]
                busy[r] += cost[a.kind]
            elif a.kind.startswith("send"):
                fwd = a.kind == "send_act"
                dst = s + 1 if fwd else s - 1
                if not 0 <= dst <= last:
                    raise ScheduleError(f"stage {r}: {a} has no model stage to send to")
                if a.peer != dst % p:
                    raise ScheduleError(f"stage {r}: {a} names the wrong peer (expected {dst % p})")
                if (("fwd" if fwd else "bwd"), a.microbatch, s) not in have:
                    raise ScheduleError(f"stage {r}: {a} runs before the {a.kind[5:]} exists")
                msg = ("act" if fwd else "grad", a.microbatch, dst)
                if msg in inbox:
                    raise ScheduleError(f"stage {r}: {a} is sent twice")
                inbox[msg] = t + comm_cost
                if pc[a.peer] < len(schedule.actions[a.peer]) and a.peer not in runnable:
                    runnable.append(a.peer)  # wake the receiver if it is blocked
            else:
                fwd = a.kind == "recv_act"
                msg = ("act" if fwd else "grad", a.microbatch, s)
                if msg not in inbox:
                    break  # blocked: resume when the matching send happened
                if a.peer != (s - 1 if fwd else s + 1) % p:
                    raise ScheduleError(f"stage {r}: {a} names the wrong peer")
                t = max(t, inbox.pop(msg))
                have.add(("in" if fwd else "out", a.microbatch, s))
            i += 1
        pc[r], clock[r] = i, t
    stuck = [r for r in range(p) if pc[r] < len(schedule.actions[r])]
    if stuck:
        detail = ", ".join(f"stage {r} at {schedule.actions[r][pc[r]]}" for r in stuck)
        raise ScheduleDeadlockError(f"schedule {schedule.name!r} deadlocks: {detail}")
    if inbox:
        raise ScheduleError(f"messages sent but never received: {sorted(inbox)[:4]}")
    for kind in ("fwd", "bwd"):
        missing = [(i, s) for i in range(m) for s in range(last + 1) if (kind, i, s) not in have]
        if missing:
            raise ScheduleError(f"{kind} never runs for (microbatch, stage) {missing[:4]}")
    makespan = max(clock)
    frac = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, busy, frac)


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the most forwards whose backward has not run yet (in chunk units)."""
    peaks = []
    for steps in schedule.actions:
        live = peak = 0
        for a in steps:
            live += int(a.kind == "forward") - int(a.kind == "backward")
            peak = max(peak, live)
        peaks.append(peak)
    return peaks
