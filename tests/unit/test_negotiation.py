"""The negotiation state machine behind Horovod-style collectives, without processes."""

import pytest

from shardwise.core.negotiation import Announcement, Negotiator, RequestMeta

pytestmark = pytest.mark.timeout(30)


def meta(name: str = "allreduce.x", kind: str = "allreduce", shape=(4,), dtype: str = "float32",
         **kw) -> RequestMeta:
    return RequestMeta(name, kind, (dtype,), (tuple(shape),), **kw)


def ann(*requests: RequestMeta, join: bool = False, shutdown: bool = False) -> Announcement:
    return Announcement(tuple(requests), join=join, shutdown=shutdown)


def test_ready_only_when_every_rank_announced_and_matched_by_name() -> None:
    neg = Negotiator(2)
    assert neg.update([ann(meta("a"), meta("b")), ann(meta("b"))]) and neg.pending_names() == ["a"]
    assert neg.missing("a") == [1]
    (resp,) = neg.update([ann(), ann(meta("a"))])
    assert resp.name == "a" and resp.error is None and resp.kind == "allreduce"


def test_responses_in_the_same_order_on_every_rank() -> None:
    rounds = [[ann(meta("a"), meta("b"), meta("c")), ann(meta("c"), meta("a"), meta("b"))]]
    orders = []
    for _ in range(2):
        neg = Negotiator(2)
        orders.append([r.name for rd in rounds for r in neg.update(rd)])
    assert orders[0] == orders[1] == ["a", "b", "c"]


@pytest.mark.parametrize("other, fragment", [
    (meta(shape=(5,)), "tensor shapes"),
    (meta(dtype="int32"), "data types"),
    (meta(kind="allgather"), "collective operations"),
    (meta(op="min"), "reduction ops"),
    (meta(prescale=2.0), "prescale"),
    (meta(device="gpu"), "CPU/GPU"),
])
def test_mismatch_fails_the_request_on_every_rank(other: RequestMeta, fragment: str) -> None:
    neg = Negotiator(2)
    (resp,) = neg.update([ann(meta()), ann(other)])
    assert resp.error is not None and fragment in resp.error and "rank(s) [1]" in resp.error
    # and the next request still works
    (resp,) = neg.update([ann(meta("y")), ann(meta("y"))])
    assert resp.error is None


def test_allgather_first_dimension_may_differ_but_not_the_rest() -> None:
    neg = Negotiator(2)
    (ok,) = neg.update([ann(meta("g", "allgather", (2, 3))), ann(meta("g", "allgather", (5, 3)))])
    assert ok.error is None and [m.shapes[0][0] for m in ok.metas] == [2, 5]
    (bad,) = neg.update([ann(meta("g", "allgather", (2, 3))), ann(meta("g", "allgather", (2, 4)))])
    assert "beyond the first dimension" in bad.error
    (bad,) = neg.update([ann(meta("g", "allgather", (2, 3))), ann(meta("g", "allgather", (6,)))])
    assert "tensor ranks" in bad.error


def test_broadcast_roots_must_agree_and_exist() -> None:
    neg = Negotiator(2)
    (bad,) = neg.update([ann(meta("b", "broadcast", root=0)), ann(meta("b", "broadcast", root=1))])
    assert "root ranks" in bad.error
    (bad,) = neg.update([ann(meta("b", "broadcast", root=3)), ann(meta("b", "broadcast", root=3))])
    assert "outside the process set" in bad.error


def test_alltoall_needs_one_split_per_rank() -> None:
    neg = Negotiator(2)
    (bad,) = neg.update([ann(meta("t", "alltoall", splits=(4,))), ann(meta("t", "alltoall", splits=(2, 2)))])
    assert "splits" in bad.error


def test_join_lets_the_others_allreduce_and_returns_the_last_joined_rank() -> None:
    neg = Negotiator(3)
    assert neg.update([ann(join=True), ann(), ann()]) == []
    (resp,) = neg.update([ann(), ann(meta("a")), ann(meta("a"))])
    assert resp.error is None and resp.joined == (0,) and resp.metas[0] is None
    (bad,) = neg.update([ann(), ann(meta("g", "allgather")), ann(meta("g", "allgather"))])
    assert "joined" in bad.error
    assert neg.update([ann(), ann(join=True), ann()]) == []
    (done,) = neg.update([ann(), ann(), ann(join=True)])
    assert done.kind == "join" and done.last_joined == 2
    # the join is over: the next allreduce needs every rank again
    assert neg.update([ann(), ann(meta("z")), ann(meta("z"))]) == []


def test_shutdown_fails_what_is_pending_and_stops_everyone() -> None:
    neg = Negotiator(2)
    neg.update([ann(meta("a")), ann()])
    responses = neg.update([ann(), ann(shutdown=True)])
    assert [r.kind for r in responses] == ["allreduce", "shutdown"]
    assert "shut down" in responses[0].error


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown collective kind"):
        RequestMeta("x", "gossip")
    with pytest.raises(ValueError, match="at least one rank"):
        Negotiator(0)
    with pytest.raises(ValueError, match="expected 2 announcements"):
        Negotiator(2).update([ann()])
