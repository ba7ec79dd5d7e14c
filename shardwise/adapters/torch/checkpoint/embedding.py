"""Checkpoints of sharded embedding tables that load on another plan and world size.

The same door as :mod:`.parallel`: a ``ckpt-<step>/`` directory of the checkpoint store
(atomic files, the manifest written last), one ``rank-<r>.safetensors`` per rank holding the
shards it owns as they are (stored 1-D), and a tensor table in the manifest giving each
tensor's shape and pieces (file, :class:`~shardwise.core.placement.Placement`: a row block, a
column block or the whole table, element range). Tensors: ``tables/<name>`` and the sparse
optimizer's state, ``optimizer/adagrad/<name>`` (one value per element) or
``optimizer/rowwise_adagrad/<name>`` (one per row; a column-wise table keeps one per column
block, ``...@<first col>:<end col>``). Loading reads for each shard of the new plan only the
rows and columns it keeps (:class:`~.pieces.PiecesSource`). Row-wise Adagrad state of a column
block that the new plan cuts differently starts from the mean of the saved blocks' states.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Optional

import torch

from ....core.errors import CheckpointError
from ....core.placement import Placement
from ....checkpoint.agree import stage_or_fail
from ....checkpoint.atomic import PathLike
from .parallel import _resolve
from .pieces import PiecesSource, encode_placement
from ....checkpoint.safetensors_stream import SafetensorsWriter
from ....checkpoint.store import check_file_sizes, check_format, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from ..embedding import ShardedEmbeddingBagCollection, SparseOptimizer

__all__ = ["FORMAT", "FORMAT_VERSION", "save_embedding_checkpoint", "load_embedding_checkpoint"]

FORMAT = "shardwise-embeddings"
FORMAT_VERSION = 1
_CODES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16"}


def _placement(key: str, shape: tuple[int, ...], rows: tuple[int, int], cols: Optional[tuple[int, int]]) -> Placement:
    """A box of a ``[rows, cols]`` (or ``[rows]``) tensor: split along one dimension at most."""
    if rows != (0, shape[0]):
        return Placement(key, shape, 0, bounds=(rows,))
    if cols is not None and len(shape) > 1 and cols != (0, shape[1]):
        return Placement(key, shape, 1, bounds=(cols,))
    return Placement(key, shape)


def written_shards(ebc: "ShardedEmbeddingBagCollection") -> list[str]:
    """The shards this rank writes: all it holds, but of a data_parallel table (on every rank) rank 0's copy only."""
    return [name for name in ebc.shard_names()
            if not (ebc.plan.placement(ebc.shard_of(name)[0].name).replicated and not name.endswith("__shard0"))]


def _held(ebc: "ShardedEmbeddingBagCollection",
          opt: Optional["SparseOptimizer"]) -> list[tuple[str, Placement, torch.Tensor]]:
    """(tensor key, placement, local values) of everything this rank holds."""
    out = []
    for name in written_shards(ebc):
        table, shard = ebc.shard_of(name)
        rows, cols = (shard.row_start, shard.row_end), (shard.col_start, shard.col_end)
        full = (table.num_embeddings, table.embedding_dim)
        out.append((f"tables/{table.name}", _placement(f"tables/{table.name}", full, rows, cols),
                    ebc.shard(name)))
        if opt is None or name not in opt.state:
            continue
        state = opt.state[name]
        if opt.kind == "adagrad":
            key = f"optimizer/adagrad/{table.name}"
            out.append((key, _placement(key, full, rows, cols), state))
        else:
            key = f"optimizer/rowwise_adagrad/{table.name}"
            if cols != (0, table.embedding_dim):
                key += f"@{cols[0]}:{cols[1]}"
            out.append((key, _placement(key, (table.num_embeddings,), rows, None), state))
    return out


def save_embedding_checkpoint(ebc: "ShardedEmbeddingBagCollection", directory: PathLike, step: int, *,
                              optimizer: Optional["SparseOptimizer"] = None, extra: Optional[dict] = None,
                              keep: Optional[int] = None) -> Path:
    """Collective: every rank writes the shards (and optimizer state) it holds as ``ckpt-<step>``."""
    world = ebc.comm
    held = _held(ebc, optimizer)
    described = [(key, list(p.full_shape), _CODES[t.dtype], encode_placement(p), t.numel()) for key, p, t in held]
    every = world.allgather_object(described)
    files = [f"rank-{r:05d}.safetensors" for r in range(world.size)]
    tensors: dict[str, dict[str, Any]] = {}
    for rank, pieces in enumerate(every):
        for i, (key, shape, dtype, placement, numel) in enumerate(pieces):
            info = tensors.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
            info["pieces"].append([rank, f"{key}#{rank}.{i}", placement, 0, numel])
    metadata = {
        "format": FORMAT, "version": FORMAT_VERSION, "step": int(step), "world_size": world.size,
        "tables": {t.name: [t.num_embeddings, t.embedding_dim] for t in ebc.tables.values()},
        "optimizer": optimizer.kind if optimizer is not None else None,
        "plan": {p.table.name: p.sharding.value for p in ebc.plan.placements},
        "extra": extra or {}, "files": files, "tensors": tensors,
    }

    def write(f: BinaryIO) -> None:
        names = [f"{key}#{world.rank}.{i}" for i, (key, _, _) in enumerate(held)]
        out = SafetensorsWriter(f, [(n, _CODES[t.dtype], (t.numel(),)) for n, (_, _, t) in zip(names, held)])
        for n, (_, _, t) in zip(names, held):
            flat = t.detach().contiguous().reshape(-1)
            out.write(n, memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b""))
        out.close()

    return save_checkpoint(directory, step, {files[world.rank]: write}, comm=world, metadata=metadata, keep=keep)


def _check(ebc: "ShardedEmbeddingBagCollection", opt: Optional["SparseOptimizer"], meta: dict, where: Path) -> None:
    check_format(meta, where, FORMAT, FORMAT_VERSION, "an embedding-table checkpoint")
    saved = {n: tuple(s) for n, s in meta.get("tables", {}).items()}
    mine = {t.name: (t.num_embeddings, t.embedding_dim) for t in ebc.tables.values()}
    if saved != mine:
        differ = sorted(n for n in set(saved) | set(mine) if saved.get(n) != mine.get(n))
        raise CheckpointError(f"{where} holds other tables: " + "; ".join(
            f"{n}: saved {saved.get(n)}, here {mine.get(n)}" for n in differ))
    if opt is not None and meta.get("optimizer") != opt.kind:
        raise CheckpointError(f"{where} holds {meta.get('optimizer')} optimizer state, this optimizer is {opt.kind}")
    check_file_sizes(where)


def _row_state(source: PiecesSource, table: str, rows: tuple[int, int], cols: tuple[int, int],
               width: int, prefix: str = "optimizer/") -> torch.Tensor:
    """Rows ``rows`` of the row-wise Adagrad state of ``table``'s column block ``cols``: the block's own
    if it was saved so, the whole table's, or the mean of the saved column blocks'."""
    base = f"{prefix}rowwise_adagrad/{table}"
    exact = base if cols == (0, width) else f"{base}@{cols[0]}:{cols[1]}"
    if exact in source.files:
        return source.read_box(exact, (slice(*rows),))
    if base in source.files:
        return source.read_box(base, (slice(*rows),))
    blocks = [k for k in source.files if k.startswith(base + "@")]
    return torch.stack([source.read_box(k, (slice(*rows),)) for k in blocks]).mean(dim=0)


def load_embedding_checkpoint(ebc: "ShardedEmbeddingBagCollection", path: PathLike, *,
                              optimizer: Optional["SparseOptimizer"] = None) -> dict:
    """Load a checkpoint (``ckpt-<step>``, or the newest complete one under ``path``) into ``ebc``.

    Any plan and world size may have written it. All or nothing: every rank checks the
    checkpoint and reads the rows it keeps into staging, then the ranks agree (one small
    collective over ``ebc.comm``) before any table or optimizer state changes; other tables,
    a newer format, a damaged file or a failed read on any rank raise the same
    :class:`CheckpointError` on every rank, naming the rank, and leave every rank as it was.
    Returns the ``extra`` saved with it, plus ``"step"``.
    """
    def read() -> tuple[dict, dict[str, list[torch.Tensor]]]:
        where = _resolve(path)
        meta = load_checkpoint(where, verify=False).metadata
        _check(ebc, optimizer, meta, where)
        source = PiecesSource.from_metadata(meta, where)
        try:
            loaded = {}
            for name in ebc.shard_names():
                table, shard = ebc.shard_of(name)
                rows, cols = (shard.row_start, shard.row_end), (shard.col_start, shard.col_end)
                loaded[name] = [source.read_box(f"tables/{table.name}", (slice(*rows), slice(*cols)))]
                if optimizer is not None and optimizer.kind == "adagrad":
                    loaded[name].append(source.read_box(f"optimizer/adagrad/{table.name}",
                                                        (slice(*rows), slice(*cols))))
                elif optimizer is not None and optimizer.kind == "rowwise_adagrad":
                    loaded[name].append(_row_state(source, table.name, rows, cols, table.embedding_dim))
        finally:
            source.close()
        return meta, loaded

    meta, loaded = stage_or_fail(ebc.comm, read, f"checkpoint {Path(path)}")
    with torch.no_grad():
        for name, values in loaded.items():
            ebc.shard(name).copy_(values[0])
            if len(values) > 1:
                optimizer.state[name].copy_(values[1])
    if optimizer is not None:
        optimizer.zero_grad()
    return {**meta.get("extra", {}), "step": meta["step"]}
