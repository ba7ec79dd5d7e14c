"""Checkpoints of :class:`~.layer.ShardedEmbeddingBag`'s tables through :mod:`shardwise.checkpoint`'s door.

Kind ``keras.sharded_embeddings`` (registered when the layer's module is imported)::

    from shardwise import checkpoint as ckpt
    ckpt.save("run/ckpts", step, {"model": model, "tables": layer})     # every rank
    ckpt.load("run/ckpts", {"model": model, "tables": layer})           # any plan, rank count, backend

Each rank writes the shards it holds as they are: a row block, a column block or a whole table,
a box of the canonical ``[num_embeddings, embedding_dim]`` table placed as the torch tables place
theirs (the door's ``"shardwise-state"`` format, the same JSON placements, so the piece/box layout is
one). Tensors of the entry: ``tables/<name>``; the optimizer's state ``adagrad/<name>`` (one value
per element) or ``rowwise_adagrad/<name>`` (one per row; a column-wise table keeps one per column
block, ``...@<first col>:<end col>``, as TorchRec does). The entry's JSON names the tables, the plan
and the optimizer (kind, learning rate, eps). Loading reads, with numpy alone (no torch on JAX), only
the rows and columns each shard of the new plan keeps, from whichever saved pieces overlap them; a
row-wise Adagrad column block that the new plan cuts differently starts from the mean of the saved
blocks' states (torch's rule). Other tables, or another optimizer, are a
:class:`~shardwise.core.errors.CheckpointError`, which the door raises on every rank, before any rank
changes anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from ....checkpoint.door import EntryView, Piece, register_handler
from ....checkpoint.flat_pieces import WHOLE_PLACEMENT, numpy_dtype, safetensors_code
from ....checkpoint.manifest import read_manifest
from ....checkpoint.safetensors_read import SafetensorsFile, open_checked
from ....core.errors import CheckpointError

if TYPE_CHECKING:
    from .host import HostEmbeddingEngine

__all__ = ["SHARDED_EMBEDDINGS", "BoxReader", "save_pieces", "stage_tables"]

SHARDED_EMBEDDINGS = "keras.sharded_embeddings"
Span = tuple[int, int]


def _placement(shape: tuple[int, ...], rows: Span, cols: Optional[Span]) -> list:
    """The JSON placement of a box of a ``[rows, cols]`` (or ``[rows]``) tensor, split along one dim at most
    (the form of :func:`shardwise.adapters.torch.checkpoint.pieces.encode_placement`)."""
    if rows != (0, shape[0]):
        if cols is not None and cols != (0, shape[1]):
            raise CheckpointError(f"a shard of rows {rows} and columns {cols} of a {shape} table is split two ways; "
                                  "a checkpoint piece is split along one dimension at most")
        return [0, 1, 1, 0, False, [list(rows)], False]
    if cols is not None and len(shape) > 1 and cols != (0, shape[1]):
        return [1, 1, 1, 0, False, [list(cols)], False]
    return list(WHOLE_PLACEMENT)


def _data(values: np.ndarray) -> Callable[[], memoryview]:
    def data() -> memoryview:
        flat = np.ascontiguousarray(values).reshape(-1)
        return memoryview(flat.view(np.uint8)) if flat.size else memoryview(b"")
    return data


def _tables(engine: "HostEmbeddingEngine") -> dict[str, list[int]]:
    return {t.name: [t.num_embeddings, t.embedding_dim] for t in engine.tables.values()}


def _engine(obj: Any) -> "HostEmbeddingEngine":
    return getattr(obj, "engine", obj)


def save_pieces(obj: Any) -> tuple[list[Piece], dict]:
    """This rank's pieces of a layer's (or engine's) tables and optimizer state, and the entry's JSON."""
    engine = _engine(obj)
    pieces = []
    for key, shard_values in engine.shards.items():
        table, shard = engine.shard_of(key)
        full = (table.num_embeddings, table.embedding_dim)
        rows, cols = (shard.row_start, shard.row_end), (shard.col_start, shard.col_end)

        def add(name: str, shape: tuple[int, ...], values: np.ndarray, box_cols: Optional[Span]) -> None:
            pieces.append(Piece(name, shape, _placement(shape, rows, box_cols), 0, int(values.size),
                                safetensors_code(values.dtype), _data(values)))

        add(f"tables/{table.name}", full, shard_values, cols)
        if engine.kind == "adagrad":
            add(f"adagrad/{table.name}", full, engine.state[key], cols)
        elif engine.kind == "rowwise_adagrad":
            name = f"rowwise_adagrad/{table.name}"
            if cols != (0, table.embedding_dim):
                name += f"@{cols[0]}:{cols[1]}"
            add(name, (table.num_embeddings,), engine.state[key], None)
    meta = {"tables": _tables(engine), "plan": {p.table.name: p.sharding.value for p in engine.plan.placements},
            "optimizer": {"kind": engine.kind, "lr": engine.lr, "eps": engine.eps}}
    return pieces, meta


class BoxReader:
    """Boxes (row range, column range) of an entry's 1-D or 2-D tensors, read with numpy from the pieces that
    overlap them: each piece a whole tensor, or a block of rows or of columns (as :func:`save_pieces` and
    the torch tables write them), every read checked against the manifest's block checksums."""

    def __init__(self, view: EntryView) -> None:
        self.view = view
        self.origin = f"{view.where} (entry {view.name!r})"
        self._paths = [Path(view.where) / str(f) for f in view.files]
        self._checksums = {Path(view.where) / name: entry.blocks
                           for name, entry in read_manifest(view.where).files.items() if entry.blocks is not None}
        self._handles: dict[Path, SafetensorsFile] = {}

    def has(self, key: str) -> bool:
        return key in self.view.tensors

    def keys(self) -> list[str]:
        return list(self.view.tensors)

    def _piece_box(self, key: str, shape: tuple[int, ...], placement: Any, start: int, stop: int) -> list[Span]:
        box = [(0, n) for n in shape]
        if placement is not None and placement[0] is not None:
            dim, parts, size, _, transpose, bounds = placement[:6]
            if parts != 1 or size != 1 or transpose or not bounds or len(bounds) != 1:
                raise CheckpointError(f"{self.origin}: tensor {key!r} has a piece placed {placement}, not a block "
                                      "of rows or columns")
            box[int(dim)] = (int(bounds[0][0]), int(bounds[0][1]))
        numel = int(np.prod([b - a for a, b in box], dtype=np.int64))
        if (start, stop) != (0, numel):
            raise CheckpointError(f"{self.origin}: tensor {key!r} has a piece of elements [{start}, {stop}), "
                                  f"not its whole box {box}")
        return box

    def read_box(self, key: str, rows: Span, cols: Optional[Span] = None) -> np.ndarray:
        """Rows ``rows`` (and columns ``cols`` of a 2-D tensor) of tensor ``key``, float32."""
        try:
            info = self.view.tensors[key]
            shape = tuple(int(s) for s in info["shape"])
            stored = info["pieces"]
        except KeyError:
            raise CheckpointError(f"{self.origin} has no tensor {key!r} (it holds {sorted(self.view.tensors)})") \
                from None
        want = [rows] + ([cols if cols is not None else (0, shape[1])] if len(shape) > 1 else [])
        out = np.zeros([b - a for a, b in want], np.float32)
        filled = np.zeros(out.shape, bool)
        for f, name, placement, start, stop in stored:
            box = self._piece_box(key, shape, placement, int(start), int(stop))
            lo, hi = max(box[0][0], rows[0]), min(box[0][1], rows[1])
            if lo >= hi:
                continue
            width = box[1][1] - box[1][0] if len(shape) > 1 else 1
            handle = open_checked(self._handles, self._paths[int(f)], self._checksums.get(self._paths[int(f)]),
                                  self.origin)
            values = np.empty((hi - lo) * width, numpy_dtype(handle.code(str(name))))
            handle.read_elements_into(str(name), (lo - box[0][0]) * width, values)
            if len(shape) == 1:
                out[lo - rows[0]:hi - rows[0]] = values
                filled[lo - rows[0]:hi - rows[0]] = True
                continue
            c0, c1 = max(box[1][0], want[1][0]), min(box[1][1], want[1][1])
            if c0 >= c1:
                continue
            block = values.reshape(hi - lo, width)[:, c0 - box[1][0]:c1 - box[1][0]]
            out[lo - rows[0]:hi - rows[0], c0 - want[1][0]:c1 - want[1][0]] = block
            filled[lo - rows[0]:hi - rows[0], c0 - want[1][0]:c1 - want[1][0]] = True
        if not filled.all():
            raise CheckpointError(f"{self.origin}: tensor {key!r}: its pieces do not cover the box {want} "
                                  "(a damaged checkpoint)")
        return out

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def _row_state(source: BoxReader, table: str, rows: Span, cols: Span, width: int) -> np.ndarray:
    """Rows ``rows`` of the row-wise Adagrad state of ``table``'s column block ``cols``: the block's own if it
    was saved so, the whole table's, or the mean of the saved column blocks' (torch's rule)."""
    base = f"rowwise_adagrad/{table}"
    exact = base if cols == (0, width) else f"{base}@{cols[0]}:{cols[1]}"
    if source.has(exact):
        return source.read_box(exact, rows)
    if source.has(base):
        return source.read_box(base, rows)
    blocks = [k for k in source.keys() if k.startswith(base + "@")]
    if not blocks:
        raise CheckpointError(f"{source.origin} has no row-wise Adagrad state of table {table!r}")
    return np.mean([source.read_box(k, rows) for k in blocks], axis=0).astype(np.float32)


def stage_tables(obj: Any, view: EntryView) -> Callable[[], None]:
    """Read this rank's shards (and optimizer state) of a layer (or engine) from ``view`` into staging,
    checking that the checkpoint holds these tables and this optimizer's state; returns the function that
    assigns them."""
    engine = _engine(obj)
    saved = {str(n): [int(d) for d in s] for n, s in (view.meta.get("tables") or {}).items()}
    mine = _tables(engine)
    if saved != mine:
        differ = sorted(n for n in set(saved) | set(mine) if saved.get(n) != mine.get(n))
        raise CheckpointError(f"{view.where}: entry {view.name!r} holds other embedding tables: " + "; ".join(
            f"{n}: saved {tuple(saved[n]) if n in saved else None}, here {tuple(mine[n]) if n in mine else None}"
            for n in differ))
    opt = dict(view.meta.get("optimizer") or {})
    if opt.get("kind") != engine.kind:
        raise CheckpointError(f"{view.where}: entry {view.name!r} holds the tables of a {opt.get('kind')} optimizer, "
                              f"this layer's optimizer is {engine.kind}: build the layer with "
                              f"optimizer={opt.get('kind')!r} to resume")
    source = view.adopt(BoxReader(view))
    staged: dict[str, tuple[np.ndarray, Optional[np.ndarray]]] = {}
    for key in engine.shards:
        table, shard = engine.shard_of(key)
        rows, cols = (shard.row_start, shard.row_end), (shard.col_start, shard.col_end)
        values = source.read_box(f"tables/{table.name}", rows, cols)
        state = None
        if engine.kind == "adagrad":
            state = source.read_box(f"adagrad/{table.name}", rows, cols)
        elif engine.kind == "rowwise_adagrad":
            state = _row_state(source, table.name, rows, cols, table.embedding_dim)
        staged[key] = (values, state)
    lr, eps = float(opt.get("lr", engine.lr)), float(opt.get("eps", engine.eps))

    def apply() -> None:
        for key, (values, state) in staged.items():
            engine.shards[key][...] = values
            if state is not None:
                engine.state[key][...] = state
        engine.lr, engine.eps = lr, eps
        engine.forget()
    return apply


def _matches(obj: Any) -> bool:
    """A :class:`ShardedEmbeddingBag` (known by its engine: the layer's module imports this one) or an engine."""
    from .host import HostEmbeddingEngine

    return isinstance(_engine(obj), HostEmbeddingEngine)


register_handler(SHARDED_EMBEDDINGS, _matches, save_pieces, stage_tables, comm=lambda obj: _engine(obj).comm)
