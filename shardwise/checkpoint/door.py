"""One door for every kind of training state: ``save(directory, step, state)`` and ``load(path, state)``.

``state`` maps names to stateful objects (a model, its optimizer, sharded embedding tables,
their sparse optimizer, ...). Each object is turned into *pieces* by the handler registered
for its kind: a piece is a box of one of the object's tensors as a rank holds it (its
:class:`~shardwise.core.placement.Placement` and a range of its row-major elements), plus
JSON metadata for the rest (hyperparameters, table shapes). On disk there is one format,
``"shardwise-state"``: a ``ckpt-<step>/`` directory of the checkpoint store (atomic files,
the manifest written last) with one ``rank-<r>.safetensors`` per rank holding the pieces
that rank writes, stored 1-D. A piece several ranks hold identically (a replicated dense
model's weights) is written by one of them, chosen to even out the bytes. The manifest's
metadata names the format and version, each entry's kind and metadata, and every tensor's
shape and pieces (as the ``ParallelModel`` checkpoint does), tensors named
``<entry>/<key>``.

Loading is all or nothing: every handler reads and checks what this rank needs into
staging, the ranks agree (:func:`~.agree.agree_loaded`: one small collective), and only then
is any object changed. A checkpoint of other objects, a newer format or a failed read on any
rank raises the same :class:`~shardwise.core.errors.CheckpointError` on every rank and
leaves every rank as it was.

This module imports no framework. Handlers live with their framework's adapter (torch:
:mod:`shardwise.adapters.torch.checkpoint.state`, imported on first use by an object of a
``torch`` or ``shardwise.adapters.torch`` type, or by a kind starting with ``torch.``; Keras:
:mod:`shardwise.adapters.keras.checkpoint_state`, likewise for ``keras`` types and ``keras.``
kinds). An object of several frameworks' types (a Keras model on the torch backend is a
``torch.nn.Module`` too) is taken by the handler of the framework nearest its own class.
Pieces that are flat element ranges of whole tensors read back with numpy alone
(:meth:`EntryView.flat_source`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Mapping, Optional, Sequence

from ..core.comm import Communicator
from ..core.errors import CheckpointError
from .agree import agree_loaded
from .atomic import PathLike
from .manifest import MANIFEST_NAME
from .safetensors_stream import DTYPE_SIZES, SafetensorsWriter
from .store import check_format, list_checkpoints, load_checkpoint, save_checkpoint
from ..context import current, is_initialized

if TYPE_CHECKING:
    from .flat_pieces import FlatPiecesReader

__all__ = ["FORMAT", "FORMAT_VERSION", "Piece", "EntryView", "StateHandler", "register_handler", "handler_for",
           "handler_of_kind", "save", "load", "assign_writers", "pieces_writer", "resolve_checkpoint", "entry_views"]

FORMAT = "shardwise-state"
#: Version of the layout of the files and metadata; a reader refuses a newer one.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` (row-major) of the local tensor that ``placement`` describes.

    ``key`` names the tensor within its entry; ``shape`` is the whole (canonical) tensor's;
    ``placement`` is the JSON form of this rank's split of it (torch:
    :func:`shardwise.adapters.torch.checkpoint.pieces.encode_placement`); ``dtype`` a safetensors
    code (``"F32"``, ``"I64"``, ...); ``data()``
    returns the piece's bytes, C order, when the file is written. Pieces with the same key,
    shape, placement and range on several ranks must hold the same values (one is written).
    """

    key: str
    shape: tuple[int, ...]
    placement: list
    start: int
    stop: int
    dtype: str
    data: Callable[[], Any] = field(compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * DTYPE_SIZES[self.dtype]


@dataclass
class EntryView:
    """What a handler loads from: its entry's metadata and tensors, named without the entry prefix, and
    ``comm``, the ranks taking part in the load (None: this process alone)."""

    name: str
    kind: str
    meta: dict
    tensors: dict[str, dict]
    files: list[str]
    where: Path
    comm: Optional[Communicator] = None
    _sources: list = field(default_factory=list, repr=False)

    def shape(self, key: str) -> tuple[int, ...]:
        """The whole shape of tensor ``key`` of this entry."""
        try:
            return tuple(int(s) for s in self.tensors[key]["shape"])
        except KeyError:
            raise CheckpointError(f"{self.where}: entry {self.name!r} has no tensor {key!r}") from None

    def adopt(self, reader: Any) -> Any:
        """Keep ``reader`` (anything with ``close()``) to be closed when :func:`load` is done; returns it.
        A framework's handler opens its own reader over :attr:`files` and :attr:`tensors` (torch:
        :func:`shardwise.adapters.torch.checkpoint.pieces.entry_source`)."""
        self._sources.append(reader)
        return reader

    def flat_source(self, declared: Optional[Mapping[str, Sequence[int]]] = None) -> "FlatPiecesReader":
        """A numpy :class:`~shardwise.checkpoint.flat_pieces.FlatPiecesReader` of whole-tensor element ranges
        over this entry's tensors (closed by :func:`load`); ``declared``: key -> shape of tensors that may
        have no stored piece because they have no elements."""
        from .flat_pieces import FlatPiecesReader

        source = FlatPiecesReader.from_table(self.files, self.tensors, self.where,
                                             f"{self.where} (entry {self.name!r})", declared)
        self._sources.append(source)
        return source

    def close(self) -> None:
        for source in self._sources:
            source.close()
        self._sources.clear()


@dataclass(frozen=True)
class StateHandler:
    """How one kind of object is saved and loaded.

    ``matches(obj)``: whether this handler takes ``obj``. ``save_pieces(obj)``: this rank's
    pieces and the entry's JSON metadata (the same on every rank; rank 0's is kept).
    ``load(obj, view)``: read and check everything this rank needs from ``view`` into
    staging, changing nothing, and return the function that applies it (its readers stay open
    until that function returns, so a handler may read again there what it checked, rather than
    hold a copy of it). ``comm(obj)``
    (optional): the communicator ``obj`` lives on, used when :func:`save`/:func:`load` get none.
    ``with_comm``: ``save_pieces`` is called as ``save_pieces(obj, comm)`` with the save's
    communicator (None: one process), for objects whose pieces depend on the rank and world size.
    ``parts(obj)`` (optional): objects inside ``obj`` that are saved and loaded as entries of their
    own, ``{suffix: object}``, named ``<name>.<suffix>`` (a model's sharded tables, the optimizers a
    combined optimizer steps), so that one entry given to :func:`save`/:func:`load` takes them all;
    a part also given under a name of its own is left to that entry.
    """

    kind: str
    matches: Callable[[Any], bool]
    save_pieces: Callable[..., tuple[list[Piece], dict]]
    load: Callable[[Any, EntryView], Callable[[], None]]
    comm: Optional[Callable[[Any], Optional[Communicator]]] = None
    with_comm: bool = False
    parts: Optional[Callable[[Any], Mapping[str, Any]]] = None


#: The one registry of state handlers, by kind, in registration order. Handlers registered later are
#: tried first, so a handler for a specific type registered after a general one (a module) wins.
_HANDLERS: dict[str, StateHandler] = {}

#: Adapter modules that register handlers, by the top-level package of the types (or kinds) they handle.
_ADAPTERS = {"torch": "shardwise.adapters.torch.checkpoint.state",
             "keras": "shardwise.adapters.keras.checkpoint_state"}


def register_handler(kind: str, matches: Callable[[Any], bool], save_pieces: Callable[..., tuple[list[Piece], dict]],
                     load: Callable[[Any, EntryView], Callable[[], None]], *,
                     comm: Optional[Callable[[Any], Optional[Communicator]]] = None,
                     with_comm: bool = False,
                     parts: Optional[Callable[[Any], Mapping[str, Any]]] = None) -> StateHandler:
    """Register (or replace) the handler of ``kind``; see :class:`StateHandler` for the callables."""
    if not kind or "/" in kind:
        raise CheckpointError(f"a state kind must be a non-empty name without '/', got {kind!r}")
    handler = StateHandler(kind, matches, save_pieces, load, comm, with_comm, parts)
    _HANDLERS.pop(kind, None)
    _HANDLERS[kind] = handler
    return handler


def _import_adapter(package: str) -> None:
    module = _ADAPTERS.get(package)
    if module is not None:
        import importlib

        importlib.import_module(module)


def _packages(obj: Any) -> list[str]:
    """Adapter packages that may handle ``obj``: of its type and base types' modules, nearest first."""
    found: list[str] = []
    for cls in type(obj).__mro__:
        module = cls.__module__ or ""
        top = module.split(".")[0]
        package = top if top in _ADAPTERS else module.split(".")[2] if module.startswith("shardwise.adapters.") \
            and module.count(".") >= 2 else None
        if package is not None and package not in found:
            found.append(package)
    return found


def handler_for(obj: Any) -> StateHandler:
    """The handler that takes ``obj`` (importing its frameworks' handlers on first use).

    Of the handlers that match, those of kinds outside the object's frameworks (registered by
    users) come first, then the framework nearest the object's own class; among equals, the
    latest registered.
    """
    packages = _packages(obj)
    for package in packages:  # all of them: another framework's handler may match a base type
        _import_adapter(package)
    nearest = {p: i for i, p in enumerate(packages)}
    matching = [h for h in reversed(list(_HANDLERS.values())) if h.matches(obj)]
    if matching:
        return min(matching, key=lambda h: nearest.get(h.kind.split(".")[0], -1))
    raise CheckpointError(f"no checkpoint handler takes a {type(obj).__module__}.{type(obj).__qualname__}; "
                          f"kinds known: {', '.join(_HANDLERS) or 'none'} (register one with "
                          "shardwise.checkpoint.register_handler)")


def handler_of_kind(kind: str) -> StateHandler:
    """The handler registered for ``kind`` (importing its framework's handlers on first use)."""
    if kind not in _HANDLERS:
        _import_adapter(str(kind).split(".")[0])
    try:
        return _HANDLERS[kind]
    except KeyError:
        raise CheckpointError(f"no checkpoint handler for state of kind {kind!r}; kinds known: "
                              f"{', '.join(_HANDLERS) or 'none'}") from None


def assign_writers(every: Sequence[Sequence[tuple[Any, int]]]) -> dict[Any, int]:
    """The rank that writes each distinct piece. ``every[r]``: rank r's ``(identity, bytes)`` pairs.

    Of the ranks holding a piece, the one with the fewest bytes assigned so far (ties: the
    lowest rank) writes it: the same answer on every rank, given the same ``every``.
    """
    holders: dict[Any, list[int]] = {}
    size: dict[Any, int] = {}
    for rank, pieces in enumerate(every):
        for ident, nbytes in pieces:
            holders.setdefault(ident, []).append(rank)
            size[ident] = nbytes
    load = [0] * len(every)
    chosen = {}
    for ident in holders:
        rank = min(holders[ident], key=lambda r: (load[r], r))
        chosen[ident] = rank
        load[rank] += size[ident]
    return chosen


def pieces_writer(listed: Sequence[tuple[str, str, Sequence[int], Callable[[], Any]]]) -> Callable[[BinaryIO], None]:
    """A store writer streaming tensors ``[(name, dtype code, shape, data()), ...]`` into one safetensors
    file, each tensor's bytes produced only when it is due."""

    def write(f: BinaryIO) -> None:
        out = SafetensorsWriter(f, [(name, dtype, shape) for name, dtype, shape, _ in listed])
        for name, _, _, data in listed:
            out.write(name, data())
        out.close()
    return write


def resolve_checkpoint(path: PathLike) -> Path:
    """``path`` if it is a checkpoint, else its newest ``ckpt-<step>`` with a manifest."""
    path = Path(path)
    if (path / MANIFEST_NAME).exists() or path.name.startswith("ckpt-"):
        return path
    for _, found in reversed(list_checkpoints(path)):
        if (found / MANIFEST_NAME).exists():
            return found
    raise CheckpointError(f"{path} holds no complete checkpoint")


def _comm(state: Mapping[str, Any], handlers: Mapping[str, StateHandler],
          comm: Optional[Communicator]) -> Optional[Communicator]:
    if comm is not None:
        return comm
    for name, obj in state.items():
        found = handlers[name].comm(obj) if handlers[name].comm is not None else None
        if found is not None:
            return found

    return current().world if is_initialized() else None


def _with_parts(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with the parts of its objects (:attr:`StateHandler.parts`) added as entries of their own,
    except parts that ``state`` already holds under another name."""
    out = dict(state)
    given = {id(obj) for obj in state.values()}
    todo = list(state.items())
    while todo:
        name, obj = todo.pop(0)
        handler = handler_for(obj)
        if handler.parts is None:
            continue
        for suffix, part in handler.parts(obj).items():
            if id(part) in given:
                continue
            given.add(id(part))
            out[f"{name}.{suffix}"] = part
            todo.append((f"{name}.{suffix}", part))
    return out


def _check_names(state: Mapping[str, Any]) -> None:
    bad = [n for n in state if not isinstance(n, str) or not n or "/" in n or "#" in n]
    if bad:
        raise CheckpointError(f"state names must be non-empty strings without '/' or '#', got {bad}")


def save(directory: PathLike, step: int, state: Mapping[str, Any], *, comm: Optional[Communicator] = None,
         extra: Optional[dict] = None, keep: Optional[int] = None) -> Path:
    """Collective: write every object of ``state`` (name -> object) as ``<directory>/ckpt-<step>``.

    Every rank calls it with the same names. ``comm``: the ranks taking part (default: an
    object's own communicator, e.g. sharded tables', else the world of ``shardwise.init()``,
    else this process alone). ``extra`` (JSON data) comes back from :func:`load`; ``keep``
    prunes all but the newest ``keep`` complete checkpoints. Returns the checkpoint directory.
    """
    _check_names(state)
    state = _with_parts(state)
    handlers = {name: handler_for(obj) for name, obj in state.items()}
    comm = _comm(state, handlers, comm)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    pieces: list[tuple[tuple, Piece]] = []
    entries: dict[str, dict] = {}
    failure = None
    try:
        for name, obj in state.items():
            handler = handlers[name]
            held, meta = handler.save_pieces(obj, comm) if handler.with_comm else handler.save_pieces(obj)
            entries[name] = {"kind": handlers[name].kind, "meta": meta}
            for p in held:
                if p.stop > p.start:
                    pieces.append(((f"{name}/{p.key}", tuple(p.shape), json.dumps(p.placement), p.start, p.stop), p))
    except Exception as exc:  # reported to every rank below, so no rank waits for this one
        failure = f"{type(exc).__name__}: {exc}"
    described = ([(ident, p.nbytes, p.dtype) for ident, p in pieces], {n: e["kind"] for n, e in entries.items()},
                 failure)
    every = comm.allgather_object(described) if comm is not None else [described]
    failed = [(r, f) for r, (_, _, f) in enumerate(every) if f is not None]
    if failed:
        raise CheckpointError(f"saving checkpoint step {step} in {directory} failed on rank {failed[0][0]}; nothing "
                              f"was written. Rank {failed[0][0]}: {failed[0][1]}")
    kinds = [k for _, k, _ in every]
    if any(k != kinds[0] for k in kinds):
        differ = next(r for r, k in enumerate(kinds) if k != kinds[0])
        raise CheckpointError(f"save: the ranks were given different state: rank 0 {kinds[0]}, rank {differ} "
                              f"{kinds[differ]}")
    chosen = assign_writers([[(ident, nbytes) for ident, nbytes, _ in held] for held, _, _ in every])
    files = [f"rank-{r:05d}.safetensors" for r in range(size)]
    tensors: dict[str, dict[str, Any]] = {}
    held_here = dict(pieces)
    mine: list[tuple[str, str, Sequence[int], Callable[[], Any]]] = []
    for r, (held, _, _) in enumerate(every):
        counts: dict[str, int] = {}
        for ident, _, dtype in held:
            if chosen[ident] != r:
                continue
            key, shape, placement, start, stop = ident
            stored = f"{key}#{counts.get(key, 0)}"
            counts[key] = counts.get(key, 0) + 1
            info = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "pieces": []})
            info["pieces"].append([r, stored, json.loads(placement), start, stop])
            if r == rank:
                mine.append((stored, dtype, (stop - start,), held_here[ident].data))
    metadata = {"format": FORMAT, "version": FORMAT_VERSION, "step": int(step), "world_size": size,
                "entries": entries, "extra": dict(extra or {}), "files": files, "tensors": tensors}
    return save_checkpoint(directory, step, {files[rank]: pieces_writer(mine)}, comm=comm, metadata=metadata,
                           keep=keep)


def entry_views(meta: dict, where: Path, comm: Optional[Communicator] = None) -> dict[str, EntryView]:
    """The entries of a ``shardwise-state`` checkpoint in ``where`` (its manifest ``meta``data), by name;
    ``comm``: the ranks loading it."""
    try:
        files = [str(f) for f in meta["files"]]
        entries = {str(n): (str(e["kind"]), dict(e.get("meta") or {})) for n, e in meta["entries"].items()}
        tensors: dict[str, dict[str, dict]] = {n: {} for n in entries}
        for key, info in meta["tensors"].items():
            name, _, rest = key.partition("/")
            tensors[name][rest] = info
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{where}: the manifest's entry or tensor table is malformed ({exc!r})") from None
    return {n: EntryView(n, kind, m, tensors[n], files, where, comm) for n, (kind, m) in entries.items()}


def load(path: PathLike, state: Mapping[str, Any], *, comm: Optional[Communicator] = None) -> dict:
    """Collective: load a checkpoint (``ckpt-<step>``, or the newest complete one under ``path``) into
    the objects of ``state`` (name -> object; a subset of the saved names is fine).

    All or nothing: each rank reads and checks what its objects need into staging, the ranks
    agree, and only then is anything changed; a failure on any rank raises the same
    :class:`CheckpointError` on every rank. Returns the saved ``extra`` plus ``"step"``.
    """
    _check_names(state)
    failure: Optional[BaseException] = None
    handlers: dict[str, StateHandler] = {}
    try:
        state = _with_parts(state)
    except CheckpointError as exc:  # every rank is given the same objects: the same error everywhere
        failure = exc
    for name, obj in state.items():
        try:
            handlers[name] = handler_for(obj)
        except CheckpointError as exc:  # every rank is given the same objects: the same error everywhere
            failure = failure or exc
    comm = _comm(state, handlers, comm) if failure is None else comm
    where, meta, applies = Path(path), {}, []
    views: dict[str, EntryView] = {}
    try:
        if failure is not None:
            raise failure
        where = resolve_checkpoint(path)
        meta = load_checkpoint(where, verify=False).metadata
        check_format(meta, where, FORMAT, FORMAT_VERSION, "a shardwise-state checkpoint")
        views = entry_views(meta, where, comm)
        missing = [n for n in state if n not in views]
        if missing:
            raise CheckpointError(f"{where} has no entry {', '.join(map(repr, missing))}; it holds "
                                  + ", ".join(f"{n!r} ({v.kind})" for n, v in views.items()))
        for name, obj in state.items():
            view = views[name]
            if handlers[name].kind != view.kind:
                raise CheckpointError(f"{where}: entry {name!r} holds {view.kind} state, the object given for it is "
                                      f"a {type(obj).__qualname__} ({handlers[name].kind})")
            applies.append(handlers[name].load(obj, view))
    except Exception as exc:  # any rank's failure must reach every rank, not leave one rank loaded
        failure = exc
    try:
        agree_loaded(comm, failure, f"checkpoint {where}")
        for apply in applies:
            apply()
    finally:  # after the applies: a handler may read again what it checked (to keep memory bounded)
        for view in views.values():
            view.close()
    return {**meta.get("extra", {}), "step": meta["step"]}
