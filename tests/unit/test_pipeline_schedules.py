"""Pipeline schedules: deadlock freedom, data-flow invariants, bubbles and memory."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import pytest

from shardwise.core.errors import ConfigError
from shardwise.core.pipeline import (
    Action, Schedule, ScheduleDeadlockError, ScheduleError, bubble_fraction, build_schedule,
    gpipe, interleaved_1f1b, one_f_one_b, peak_activations, simulate,
)
from shardwise.core.pipeline_arrivals import arrival_order

STAGES = range(1, 9)
MICROBATCHES = range(1, 33)


def all_schedules():
    """Every valid (name, p, m, v) of the sweep: p 1..8, m 1..32, v 1..4."""
    for p in STAGES:
        for m in MICROBATCHES:
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            for v in range(1, 5):
                if v == 1 or m % p == 0:
                    yield "interleaved_1f1b", p, m, v


def check_structure(s: Schedule) -> None:
    """Each (mb, model stage) forwarded and backwarded once, with the comms around it."""
    p, v, m = s.num_stages, s.virtual_stages, s.num_microbatches
    last = p * v - 1
    for r, steps in enumerate(s.actions):
        counts = Counter((a.kind, a.microbatch, a.chunk) for a in steps)
        for i in range(m):
            for c in range(v):
                stage = s.model_stage(r, c)
                assert counts[("forward", i, c)] == 1 and counts[("backward", i, c)] == 1
                remote = p > 1
                assert counts[("recv_act", i, c)] == int(remote and stage > 0)
                assert counts[("send_act", i, c)] == int(remote and stage < last)
                assert counts[("recv_grad", i, c)] == int(remote and stage < last)
                assert counts[("send_grad", i, c)] == int(remote and stage > 0)
        for k, a in enumerate(steps):  # local order: recv -> compute -> send
            if a.kind in ("recv_act", "recv_grad"):
                nxt = steps[k + 1]
                assert nxt.kind == ("forward" if a.kind == "recv_act" else "backward")
                assert (nxt.microbatch, nxt.chunk) == (a.microbatch, a.chunk)
            if a.kind in ("send_act", "send_grad"):
                prev = steps[k - 1]
                assert prev.kind == ("forward" if a.kind == "send_act" else "backward")
                assert (prev.microbatch, prev.chunk) == (a.microbatch, a.chunk)


def check_fifo_channels(s: Schedule) -> None:
    """Per (src, dst, act|grad) channel, receives happen in send order, with equal tags."""
    sent, received = defaultdict(list), defaultdict(list)
    for r, steps in enumerate(s.actions):
        for a in steps:
            family = a.kind.split("_")[-1]
            if a.kind.startswith("send"):
                sent[(r, a.peer, family)].append(s.tag(r, a))
            elif a.kind.startswith("recv"):
                received[(a.peer, r, family)].append(s.tag(r, a))
    assert sent == received
    tags = [t for seq in sent.values() for t in seq]
    assert len(tags) == len(set(tags))


def test_sweep_deadlock_free_and_bubble_matches_closed_form():
    count = 0
    for name, p, m, v in all_schedules():
        sched = build_schedule(name, p, m, v)
        result = simulate(sched)  # raises on deadlock or broken data flow
        expected = bubble_fraction(name, p, m, v)
        assert result.bubble_fraction == pytest.approx(expected, abs=1e-12), (name, p, m, v)
        # busy compute per rank is m * (tf + tb), whatever the schedule
        assert result.busy == pytest.approx([m * 3.0] * p)
        count += 1
    assert count > 900


def test_sweep_structure_and_fifo_channels():
    for name, p, m, v in all_schedules():
        sched = build_schedule(name, p, m, v)
        assert (sched.name, sched.num_stages, sched.num_microbatches, sched.virtual_stages) == (name, p, m, v)
        assert len(sched.actions) == p
        check_structure(sched)
        check_fifo_channels(sched)


@pytest.mark.parametrize("p,m", [(4, 8), (3, 2), (8, 32)])
def test_bubble_formula_holds_for_other_cost_ratios(p, m):
    for fwd, bwd in [(1.0, 1.0), (1.0, 3.0), (2.5, 0.5)]:
        for name in ("gpipe", "1f1b"):
            res = simulate(build_schedule(name, p, m), fwd, bwd)
            assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert res.makespan == pytest.approx((m + p - 1) * (fwd + bwd))
        res = simulate(interleaved_1f1b(p, 2 * p, 2), fwd, bwd)
        assert res.makespan == pytest.approx(2 * p * (fwd + bwd) + (p - 1) * (fwd + bwd) / 2)


def test_interleaving_reduces_the_bubble():
    plain = simulate(one_f_one_b(4, 8)).bubble_fraction
    inter = [simulate(interleaved_1f1b(4, 8, v)).bubble_fraction for v in (1, 2, 4)]
    assert inter[0] == pytest.approx(plain)
    assert plain > inter[1] > inter[2]
    assert inter[2] == pytest.approx(3 / (4 * 8 + 3))


def test_comm_cost_lengthens_makespan_and_single_stage_has_no_bubble():
    base = simulate(one_f_one_b(4, 8))
    slow = simulate(one_f_one_b(4, 8), comm_cost=0.5)
    assert slow.makespan > base.makespan and slow.bubble_fraction > base.bubble_fraction
    assert simulate(one_f_one_b(1, 5), comm_cost=10.0).makespan == pytest.approx(15.0)
    assert simulate(gpipe(1, 3)).bubble_fraction == 0.0


def test_one_f_one_b_order_stage_zero():
    steps = [(a.kind, a.microbatch) for a in one_f_one_b(2, 3).actions[0]]
    assert steps == [("forward", 0), ("send_act", 0),
                     ("forward", 1), ("send_act", 1), ("recv_grad", 0), ("backward", 0),
                     ("forward", 2), ("send_act", 2), ("recv_grad", 1), ("backward", 1),
                     ("recv_grad", 2), ("backward", 2)]


def test_interleaved_chunk_mapping_and_peers():
    s = interleaved_1f1b(2, 2, 2)
    assert s.num_model_stages == 4 and s.model_stage(1, 1) == 3
    # rank 1 chunk 0 (model stage 1) sends to rank 0 chunk 1 (model stage 2)
    send = next(a for a in s.actions[1] if a.kind == "send_act" and a.chunk == 0)
    recv = next(a for a in s.actions[0] if a.kind == "recv_act" and a.chunk == 1)
    assert send.peer == 0 and recv.peer == 1 and s.tag(1, send) == s.tag(0, recv)
    # last model stage (rank 1, chunk 1) neither sends activations nor receives grads
    assert not any(a.chunk == 1 and a.kind in ("send_act", "recv_grad") for a in s.actions[1])


def test_peak_activations():
    for p in STAGES:
        for m in MICROBATCHES:
            assert peak_activations(gpipe(p, m)) == [m] * p
            assert peak_activations(one_f_one_b(p, m)) == [min(p - s, m) for s in range(p)]
    # interleaved: Megatron warm-up 2(p-r-1) + (v-1)p, plus one in the steady state (chunk units)
    assert peak_activations(interleaved_1f1b(4, 8, 2)) == [11, 9, 7, 5]


@pytest.mark.parametrize("call,match", [
    (lambda: gpipe(0, 4), r"num_stages must be an integer >= 1, got 0"),
    (lambda: one_f_one_b(2, 0), r"num_microbatches must be an integer >= 1, got 0"),
    (lambda: one_f_one_b(2.0, 3), r"num_stages must be an integer"),
    (lambda: interleaved_1f1b(2, 4, 0), r"virtual_stages must be an integer >= 1, got 0"),
    (lambda: interleaved_1f1b(4, 6, 2),
     r"num_microbatches \(6\) divisible by num_stages \(4\) when virtual_stages \(2\)"),
    (lambda: build_schedule("zero-bubble", 2, 2), r"unknown schedule 'zero-bubble'"),
    (lambda: build_schedule("gpipe", 2, 2, 2), r"has no virtual stages"),
    (lambda: bubble_fraction("1f1b", 2, 4, v=2), r"has no virtual stages"),
    (lambda: Action("fwd", 0), r"unknown action kind 'fwd'"),
    (lambda: Action("send_act", 0), r"send_act needs a peer"),
    (lambda: Action("forward", 0, peer=1), r"forward needs no peer"),
    (lambda: simulate(gpipe(2, 2), forward_cost=-1.0), r"costs must be >= 0"),
])
def test_errors(call, match):
    with pytest.raises(ScheduleError, match=match) as info:
        call()
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_interleaved_with_one_virtual_stage_is_1f1b_and_needs_no_divisibility():
    assert interleaved_1f1b(4, 6, 1).actions == one_f_one_b(4, 6).actions
    assert bubble_fraction("interleaved", 4, 6) == bubble_fraction("1f1b", 4, 6)


def test_1f1b_with_fewer_microbatches_than_stages_degenerates():
    s = one_f_one_b(6, 2)
    assert simulate(s).bubble_fraction == pytest.approx(5 / 7)
    assert peak_activations(s) == [2, 2, 2, 2, 2, 1]


def _with_actions(s: Schedule, actions) -> Schedule:
    return dataclasses.replace(s, actions=actions)


def test_deadlock_is_detected_and_named():
    s = one_f_one_b(2, 2)
    # stage 0 waits for a gradient before sending the activation that produces it
    a0 = [Action("forward", 0), Action("recv_grad", 0, peer=1), Action("send_act", 0, peer=1),
          Action("backward", 0)] + [a for a in s.actions[0] if a.microbatch == 1]
    a1 = [a for a in s.actions[1]]
    with pytest.raises(ScheduleDeadlockError, match=r"deadlocks: stage 0 at recv_grad\(mb=0,chunk=0\)@1, "
                                                  r"stage 1 at recv_act\(mb=0,chunk=0\)@0"):
        simulate(_with_actions(s, [a0, a1]))


def test_broken_data_flow_is_rejected():
    s = gpipe(2, 2)
    missing_backward = [list(s.actions[0]), [a for a in s.actions[1] if a != Action("backward", 1)]]
    with pytest.raises(ScheduleError, match=r"send_grad\(mb=1,chunk=0\)@0 runs before the grad exists"):
        simulate(_with_actions(s, missing_backward))
    no_recv = [list(s.actions[0]), [a for a in s.actions[1] if a.kind != "recv_act"]]
    with pytest.raises(ScheduleError, match=r"forward\(mb=0,chunk=0\) runs before its input \(in\)"):
        simulate(_with_actions(s, no_recv))
    twice = [list(s.actions[0]) + [Action("forward", 0)], list(s.actions[1])]
    with pytest.raises(ScheduleError, match=r"runs twice"):
        simulate(_with_actions(s, twice))
    nowhere = [list(s.actions[0]) + [Action("send_grad", 0, peer=1)], list(s.actions[1])]
    with pytest.raises(ScheduleError, match=r"has no model stage to send to"):
        simulate(_with_actions(s, nowhere))
    extra = [list(s.actions[0]), list(s.actions[1]) + [Action("send_grad", 0, peer=0)]]
    with pytest.raises(ScheduleError, match=r"is sent twice"):
        simulate(_with_actions(s, extra))
    unreceived = [list(s.actions[0]), list(s.actions[1])]
    unreceived[0].remove(Action("recv_grad", 1, peer=1))
    unreceived[0].remove(Action("backward", 1))
    with pytest.raises(ScheduleError, match=r"messages sent but never received: \[\('grad', 1, 0\)\]"):
        simulate(_with_actions(s, unreceived))
    wrong_peer = one_f_one_b(3, 1)
    bad = [list(x) for x in wrong_peer.actions]
    bad[0][1] = Action("send_act", 0, peer=2)
    with pytest.raises(ScheduleError, match=r"send_act\(mb=0,chunk=0\)@2 names the wrong peer "
                                            r"\(expected 1\)"):
        simulate(_with_actions(wrong_peer, bad))
    incomplete = [[a for a in x if a.microbatch == 0] for x in gpipe(2, 2).actions]
    with pytest.raises(ScheduleError, match=r"fwd never runs for \(microbatch, stage\) \[\(1, 0\)"):
        simulate(_with_actions(s, incomplete))


def _sent_to(s: Schedule, peer: int, rank: int, forward_only: bool) -> list[int]:
    kinds = ("send_act",) if forward_only else ("send_act", "send_grad")
    return [s.tag(peer, a) for a in s.actions[peer] if a.kind in kinds and a.peer == rank]


def test_arrival_order_is_each_senders_order_with_one_header_per_stage():
    for name, p, m, v in all_schedules():
        s = build_schedule(name, p, m, v)
        for r in range(p):
            for forward_only in (False, True):
                order = arrival_order(s, r, forward_only=forward_only, headers=True)
                kinds = ("recv_act",) if forward_only else ("recv_act", "recv_grad")
                mine = Counter(a for a in s.actions[r] if a.kind in kinds)
                assert Counter(x.receive for xs in order.values() for x in xs) == mine, (name, p, m, v, r)
                for peer, arrivals in order.items():
                    assert [s.tag(r, x.receive) for x in arrivals] == _sent_to(s, peer, r, forward_only)
                    firsts, seen = [], set()
                    for x in arrivals:
                        stage = s.model_stage(r, x.receive.chunk)
                        firsts.append(x.receive.kind == "recv_act" and stage not in seen)
                        seen.update([stage] if x.receive.kind == "recv_act" else [])
                    assert [x.after_header for x in arrivals] == firsts
                assert not any(x.after_header for xs in arrival_order(s, r).values() for x in xs)


def test_each_rank_receives_from_a_peer_in_the_order_it_sends():
    """Per pair of ranks, across activations and gradients: a rank that posts its receives in its
    own action order without skipping one matches an engine that pairs messages by order (NCCL)."""
    for name, p, m, v in all_schedules():
        s = build_schedule(name, p, m, v)
        for r in range(p):
            for peer, arrivals in arrival_order(s, r).items():
                own = [a for a in s.actions[r] if a.kind in ("recv_act", "recv_grad") and a.peer == peer]
                assert own == [x.receive for x in arrivals], (name, p, m, v, r, peer)
