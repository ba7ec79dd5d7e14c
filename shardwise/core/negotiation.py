"""Horovod-style negotiation of named collectives: which requests are ready, and which are wrong.

Every rank announces the collectives it has submitted (a :class:`RequestMeta` per
named request) once per round; all ranks see the same announcements in the same
order and so compute the same :class:`Response` list. A request is *ready* when
every rank that has not joined announced it; it is then checked across ranks
(kind, dtypes, shapes, op, root, scale factors, device, splits) the way Horovod's
coordinator checks it, and either executed everywhere or failed everywhere with
the same message. Matching is by name, not by call order, so ranks may submit
asynchronous collectives in different orders.

Once a request has been negotiated without error, every rank puts its response in a
:class:`ResponseCache` under the same bit (all ranks update their caches with the same
responses in the same order, so the caches stay identical). The next time a rank submits
that name with the same meta, it announces only that bit: a round whose requests are all
cached is one small AND over the ranks' bit vectors, whose size does not grow with the
number of ranks (Horovod's response cache).

Pure Python: the driver that exchanges announcements over a communicator is
:mod:`shardwise.adapters.horovod.coordinator`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["RequestMeta", "Announcement", "Response", "Negotiator", "ResponseCache", "KINDS", "JOIN_SUPPORTED"]

#: The request kinds the negotiator knows.
KINDS = ("allreduce", "adasum", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")
#: Kinds that may run while some ranks have joined (they contribute zeros), as in Horovod.
JOIN_SUPPORTED = frozenset({"allreduce", "barrier"})
#: Kinds whose first dimension may differ per rank.
_ROW_FLEXIBLE = frozenset({"allgather", "alltoall"})


@dataclass(frozen=True)
class RequestMeta:
    """What one rank says about one named request (one or, when grouped, several tensors)."""

    name: str
    kind: str
    dtypes: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    op: str = ""
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = "cpu"
    #: alltoall: rows sent to each rank.
    splits: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}; expected one of {KINDS}")
        if len(self.dtypes) != len(self.shapes):
            raise ValueError(f"{self.name}: {len(self.dtypes)} dtypes for {len(self.shapes)} shapes")


@dataclass(frozen=True)
class Announcement:
    """One rank's message of one round: new requests, and whether it joined or shuts down."""

    requests: tuple[RequestMeta, ...] = ()
    join: bool = False
    shutdown: bool = False


@dataclass(frozen=True)
class Response:
    """What every rank does next: run ``name`` (or fail it with ``error``), finish a join, or stop."""

    kind: str
    name: str = ""
    #: Each rank's meta for the request (``None`` for ranks that joined instead).
    metas: tuple[Optional[RequestMeta], ...] = ()
    error: Optional[str] = None
    joined: tuple[int, ...] = ()
    #: For ``kind == "join"``: the rank that joined last.
    last_joined: int = -1

    def meta(self) -> RequestMeta:
        """The meta of the first rank that has one (they agree unless ``error`` is set)."""
        return next(m for m in self.metas if m is not None)


@dataclass
class _Entry:
    metas: dict[int, RequestMeta] = field(default_factory=dict)


class Negotiator:
    """The replicated state machine of negotiation; every rank holds an identical copy."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a negotiator needs at least one rank, got size={size}")
        self.size = size
        self._table: dict[str, _Entry] = {}
        self._joined: dict[int, int] = {}
        self._round = 0

    def missing(self, name: str) -> list[int]:
        """Ranks that have not announced ``name`` yet (for stall reports)."""
        entry = self._table.get(name)
        have = set(entry.metas) if entry else set()
        return [r for r in range(self.size) if r not in have and r not in self._joined]

    @property
    def joined(self) -> tuple[int, ...]:
        """Ranks that have joined and not yet been released by the join's response."""
        return tuple(sorted(self._joined))

    def pending_names(self) -> list[str]:
        """Names announced by some rank and not yet ready."""
        return list(self._table)

    def update(self, announcements: Sequence[Announcement]) -> list[Response]:
        """Fold in one round (one announcement per rank, in rank order) and return the responses."""
        if len(announcements) != self.size:
            raise ValueError(f"expected {self.size} announcements, got {len(announcements)}")
        self._round += 1
        for rank, ann in enumerate(announcements):
            for meta in ann.requests:
                self._table.setdefault(meta.name, _Entry()).metas[rank] = meta
            if ann.join and rank not in self._joined:
                self._joined[rank] = self._round
        stopping = [r for r, a in enumerate(announcements) if a.shutdown]
        if stopping:
            return self._shutdown(stopping)
        responses = []
        live = [r for r in range(self.size) if r not in self._joined]
        for name in list(self._table):
            entry = self._table[name]
            if not live or any(r not in entry.metas for r in live):
                continue
            del self._table[name]
            responses.append(self._respond(name, entry))
        if len(self._joined) == self.size:
            last = max(self._joined.items(), key=lambda kv: (kv[1], kv[0]))[0]
            responses.append(Response("join", joined=tuple(sorted(self._joined)), last_joined=last))
            self._joined.clear()
        return responses

    def _shutdown(self, stopping: list[int]) -> list[Response]:
        out = []
        for name, entry in self._table.items():
            metas = tuple(entry.metas.get(r) for r in range(self.size))
            out.append(Response(next(iter(entry.metas.values())).kind, name, metas,
                                error=f"shardwise has been shut down on rank(s) {stopping} before "
                                      f"'{name}' was submitted by every rank"))
        self._table.clear()
        joined = tuple(sorted(self._joined))
        self._joined.clear()
        out.append(Response("shutdown", joined=joined))
        return out

    def _respond(self, name: str, entry: _Entry) -> Response:
        metas = tuple(entry.metas.get(r) for r in range(self.size))
        joined = tuple(sorted(r for r in self._joined if r not in entry.metas))
        present = [(r, m) for r, m in enumerate(metas) if m is not None]
        error = _check(name, present, self.size)
        kind = present[0][1].kind
        if error is None and joined and kind not in JOIN_SUPPORTED:
            error = (f"{kind} '{name}' is not supported while ranks {list(joined)} have joined "
                     f"(only allreduce and barrier run with joined ranks)")
        return Response(kind, name, metas, error=error, joined=joined)


class ResponseCache:
    """Responses negotiated before, by bit; identical on every rank when updated alike.

    A rank may announce a request by its bit when it submits the same name with the
    same meta as its own part of the cached response. ``capacity`` bounds the bits (a
    full cache takes no new entries; the requests are then negotiated in full; 0 turns the
    cache off, as Horovod's ``HOROVOD_CACHE_CAPACITY=0`` does).
    """

    def __init__(self, rank: int, capacity: int = 1024) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"a response cache's capacity is a number of bits >= 0, got capacity={capacity!r}")
        self.rank, self.capacity = rank, capacity
        self._by_name: dict[str, int] = {}
        self._slots: list[Optional[tuple[RequestMeta, Response]]] = []

    @property
    def width(self) -> int:
        """Bits in use (the same on every rank)."""
        return len(self._slots)

    def bit_of(self, name: str) -> Optional[int]:
        """The bit cached under ``name``, whatever its meta, or None."""
        return self._by_name.get(name)

    def lookup(self, meta: RequestMeta) -> Optional[int]:
        """The bit of ``meta`` if this rank's cached meta for its name is equal, else None."""
        bit = self._by_name.get(meta.name)
        if bit is None or self._slots[bit][0] != meta:  # type: ignore[index]
            return None
        return bit

    def response(self, bit: int) -> Response:
        """The cached response of ``bit``."""
        slot = self._slots[bit] if 0 <= bit < len(self._slots) else None
        if slot is None:
            raise KeyError(f"response cache bit {bit} is empty")
        return slot[1]

    @staticmethod
    def cacheable(response: Response) -> bool:
        """True for a request that ran everywhere: no error, nobody joined."""
        return (response.kind in KINDS and response.error is None and not response.joined
                and all(m is not None for m in response.metas))

    def put(self, response: Response) -> Optional[int]:
        """Cache ``response`` (if :meth:`cacheable`, and not full); return its bit."""
        if not self.cacheable(response) or response.name in self._by_name:
            return None
        free = next((b for b, slot in enumerate(self._slots) if slot is None), len(self._slots))
        if free >= self.capacity:
            return None
        entry = (response.metas[self.rank], response)
        if free == len(self._slots):
            self._slots.append(entry)
        else:
            self._slots[free] = entry
        self._by_name[response.name] = free
        return free

    def evict(self, bit: int) -> None:
        """Forget ``bit`` (a rank submitted its name with another meta)."""
        slot = self._slots[bit] if 0 <= bit < len(self._slots) else None
        if slot is not None:
            del self._by_name[slot[1].name]
            self._slots[bit] = None


def _ranks_by(present: list[tuple[int, RequestMeta]], key) -> dict:
    groups: dict = {}
    for r, m in present:
        groups.setdefault(key(m), []).append(r)
    return groups


def _differs(name: str, what: str, present: list[tuple[int, RequestMeta]], key) -> Optional[str]:
    groups = _ranks_by(present, key)
    if len(groups) <= 1:
        return None
    detail = "; ".join(f"rank(s) {ranks}: {value}" for value, ranks in groups.items())
    return f"Mismatched {what} for '{name}': {detail}"


def _check(name: str, present: list[tuple[int, RequestMeta]], size: int) -> Optional[str]:
    """The first disagreement between the ranks' metas, as Horovod's coordinator reports it, or None."""
    checks = [
        ("collective operations", lambda m: m.kind),
        ("number of tensors", lambda m: len(m.shapes)),
        ("data types", lambda m: m.dtypes),
        ("CPU/GPU device selection", lambda m: m.device),
        ("reduction ops", lambda m: m.op),
        ("prescale factors", lambda m: m.prescale),
        ("postscale factors", lambda m: m.postscale),
    ]
    for what, key in checks:
        problem = _differs(name, what, present, key)
        if problem:
            return problem
    kind = present[0][1].kind
    if kind in _ROW_FLEXIBLE:
        problem = _differs(name, f"{kind} tensor ranks", present, lambda m: tuple(len(s) for s in m.shapes))
        problem = problem or _differs(name, f"{kind} tensor shapes beyond the first dimension", present,
                                      lambda m: tuple(s[1:] for s in m.shapes))
    else:
        problem = _differs(name, f"{kind} tensor shapes", present, lambda m: m.shapes)
    if problem:
        return problem
    if kind == "broadcast":
        problem = _differs(name, "broadcast root ranks", present, lambda m: m.root)
        if problem:
            return problem
        root = present[0][1].root
        if not 0 <= root < size:
            return f"broadcast '{name}': root rank {root} is outside the process set of size {size}"
        if root not in [r for r, _ in present]:
            return f"broadcast '{name}': root rank {root} has joined and cannot send"
    if kind == "alltoall":
        for r, m in present:
            if m.splits is None or len(m.splits) != size:
                return f"alltoall '{name}': rank {r} gave {m.splits} splits for {size} ranks"
    return None
