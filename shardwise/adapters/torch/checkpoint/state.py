"""Torch handlers of :mod:`shardwise.checkpoint.door`: what ``shardwise.checkpoint.save``/``load`` do with
torch objects.

Kinds (registered when this module is imported, which the door does on first meeting a
torch object or a ``torch.*`` kind):

- ``torch.module``: a replicated ``nn.Module`` (plain, or wrapped by DDP or shardwise's
  ``DistributedDataParallel``: the wrapped module's names are stored). Every rank holds the
  same tensors, so each is written once. Sharded embedding tables inside it are left out:
  they are saved as entries of their own (``torch.sharded_embeddings``), ``<name>.tables.<submodule>``,
  unless given under a name of their own. So are the parameters
  a stage-3 ``ZeroOptimizer`` partitions (no rank holds them whole): that optimizer's entry
  carries them, so save both (``{"model": model, "opt": zero_opt}``); the module's entry
  keeps its buffers and frozen parameters and lists the names left out (``"zero3"``).
- ``torch.optimizer``: a ``torch.optim.Optimizer`` (or shardwise's ``DistributedOptimizer``)
  over such a module: its ``state_dict()``'s tensors, written once, and its ``param_groups``
  as JSON. Sharded optimizers (ZeRO) are not this kind.
- ``torch.zero_optimizer``: a data-parallel ``ZeroOptimizer`` (stages 1, 2, 3): each rank's
  element ranges of the parameters, fp32 masters and optimizer state; loaded at any world
  size and stage (:mod:`.zero_state`).
- ``torch.sharded_embeddings``: a :class:`ShardedEmbeddingBagCollection`'s shards as each rank
  holds them (row or column blocks of a table); loaded on any plan and world size.
- ``torch.sparse_optimizer``: a :class:`SparseOptimizer`'s accumulators, stored like
  :func:`~shardwise.adapters.torch.checkpoint.embedding.save_embedding_checkpoint` stores them.
- ``torch.combined_optimizer``: a :class:`CombinedOptimizer`: no tensors of its own; each optimizer
  it steps is an entry of its own kind, ``<name>.<part>``.
- ``torch.parallel_model``: a ``ParallelModel`` (model, optimizer, each rank's generator
  state) as its own checkpoints store it: the pieces each rank holds (tensor-parallel
  slices, ZeRO shards), written once; loaded on any layout and world size.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ....checkpoint.door import EntryView, Piece, register_handler
from .embedding import _placement, _row_state, written_shards
from .pieces import encode_placement, entry_source
from ....checkpoint.state import check_mismatch
from ....core.errors import CheckpointError
from ....core.placement import Placement
from ..embedding import CombinedOptimizer, ShardedEmbeddingBagCollection, SparseOptimizer
from ..parallel.full_tensors import DTYPE_CODES
from .kinds import (COMBINED_OPTIMIZER, MODULE, OPTIMIZER, PARALLEL_MODEL, SHARDED_EMBEDDINGS, SPARSE_OPTIMIZER, ZERO_OPTIMIZER,
                    dtype_code, tensor_bytes)

__all__ = ["MODULE", "OPTIMIZER", "SHARDED_EMBEDDINGS", "SPARSE_OPTIMIZER", "PARALLEL_MODEL", "ZERO_OPTIMIZER"]

def _whole(key: str, t: torch.Tensor) -> Piece:
    """All of tensor ``t`` (held whole, the same on every rank that holds it)."""
    shape = tuple(t.shape)
    return Piece(key, shape, encode_placement(Placement(key, shape)), 0, t.numel(), dtype_code(key, t), tensor_bytes(t))


def _box(key: str, full: tuple[int, ...], rows: tuple[int, int], cols: Optional[tuple[int, int]],
         t: torch.Tensor) -> Piece:
    """Rows ``rows`` (and columns ``cols``) of a tensor of shape ``full``, held as ``t``."""
    return Piece(key, full, encode_placement(_placement(key, full, rows, cols)), 0, t.numel(), dtype_code(key, t), tensor_bytes(t))


def _read_whole(source: Any, key: str, like: torch.Tensor) -> torch.Tensor:
    return source.read_box(key, ()).reshape(like.shape).to(like.dtype)


# -- replicated modules ----------------------------------------------------------------------------

def _unwrap(module: nn.Module) -> nn.Module:
    from ..ddp import DistributedDataParallel

    while isinstance(module, (nn.parallel.DistributedDataParallel, DistributedDataParallel)):
        module = module.module
    return module


def _zero_partitioned(module: nn.Module, stage3: bool) -> set[str]:
    """Names of the module's parameters a ZeroOptimizer partitions (with ``stage3``: a stage-3 one)."""
    from ..zero.optimizer import zero_owner

    out = set()
    for name, p in _unwrap(module).named_parameters(remove_duplicate=False):
        owner = zero_owner(p)
        if owner is not None and (owner.stage == 3 or not stage3):
            out.add(name)
    return out


def _module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state-dict tensors, without those of sharded tables inside it or of a ZeRO-3 partition."""
    inner = _unwrap(module)
    sharded = [name + "." for name, sub in inner.named_modules() if isinstance(sub, ShardedEmbeddingBagCollection)]
    zero3 = _zero_partitioned(module, stage3=True)
    return {k: v for k, v in inner.state_dict().items()
            if torch.is_tensor(v) and k not in zero3 and not any(k.startswith(prefix) for prefix in sharded)}


def _save_module(module: nn.Module) -> tuple[list[Piece], dict]:
    state = _module_state(module)
    meta = {"class": type(_unwrap(module)).__qualname__,
            "tensors": {k: [list(v.shape), dtype_code(k, v)] for k, v in state.items()},
            "zero3": sorted(_zero_partitioned(module, stage3=True))}
    return [_whole(k, v) for k, v in state.items()], meta


def _load_module(module: nn.Module, view: EntryView) -> Callable[[], None]:
    state = _module_state(module)
    saved = {k: tuple(shape) for k, (shape, _) in view.meta.get("tensors", {}).items()}
    # Parameters a ZeroOptimizer entry carries: saved under ZeRO-3 (not in this entry), or partitioned by a
    # ZeRO-3 optimizer here (not set by this entry, whatever it holds). The optimizer's entry sets them.
    in_optimizer = set(view.meta.get("zero3", [])) & set(state)
    not_ours = sorted(in_optimizer - _zero_partitioned(module, stage3=False))
    if not_ours:
        raise CheckpointError(f"{view.where}: entry {view.name!r} was saved with parameters a ZeRO-3 ZeroOptimizer "
                              f"partitioned ({', '.join(not_ours[:4])}{', ...' if len(not_ours) > 4 else ''}): "
                              "they are in that optimizer's entry, not the module's. Load both into a model with "
                              "a ZeroOptimizer: load(path, {'model': model, 'opt': zero_opt})")
    state = {k: v for k, v in state.items() if k not in in_optimizer}
    saved = {k: v for k, v in saved.items() if k not in _zero_partitioned(module, stage3=True)}
    check_mismatch({k: tuple(v.shape) for k, v in state.items()}, saved, what=f"checkpoint entry {view.name!r}")
    source = entry_source(view)
    staged = {k: _read_whole(source, k, v) for k, v in state.items()}

    def apply() -> None:
        with torch.no_grad():
            for k, v in state.items():
                v.copy_(staged[k])
    return apply


def _is_module(obj: Any) -> bool:
    return isinstance(obj, nn.Module) and not isinstance(obj, ShardedEmbeddingBagCollection)


def _module_parts(module: nn.Module) -> dict[str, ShardedEmbeddingBagCollection]:
    """The sharded tables inside ``module``, by submodule name: entries of their own."""
    return {f"tables.{name}": sub for name, sub in _unwrap(module).named_modules()
            if name and isinstance(sub, ShardedEmbeddingBagCollection)}


def _save_combined(opt: CombinedOptimizer) -> tuple[list[Piece], dict]:
    return [], {"parts": list(opt.optimizers)}


def _load_combined(opt: CombinedOptimizer, view: EntryView) -> Callable[[], None]:
    saved = view.meta.get("parts", [])
    if saved != list(opt.optimizers):
        raise CheckpointError(f"{view.where}: entry {view.name!r} combined optimizers {saved}, this one combines "
                              f"{list(opt.optimizers)}")
    return lambda: None


# -- optimizers over replicated modules ------------------------------------------------------------

def _json_value(value: Any) -> tuple[bool, Any]:
    """(whether ``value`` is JSON data, its JSON form): numbers, strings, None, lists/tuples of them."""
    if torch.is_tensor(value) and value.numel() == 1:
        return True, value.item()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return True, value
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    return False, None


def _inner_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(opt, "_optimizer", opt)


def _save_optimizer(opt: torch.optim.Optimizer) -> tuple[list[Piece], dict]:
    sd = opt.state_dict()
    pieces, scalars = [], {}
    for index, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                pieces.append(_whole(f"state/{index}/{k}", v))
            else:
                ok, value = _json_value(v)
                if not ok:
                    raise CheckpointError(f"optimizer state {k!r} of parameter {index} is a {type(v).__name__}, "
                                          "which is neither a tensor nor JSON data")
                scalars.setdefault(str(index), {})[k] = value
    groups = []
    for group in sd["param_groups"]:
        kept = {}
        for k, v in group.items():
            ok, value = _json_value(v)
            if ok:
                kept[k] = value
        groups.append(kept)
    meta = {"class": type(_inner_optimizer(opt)).__qualname__, "param_groups": groups, "scalars": scalars,
            "tensors": {p.key: list(p.shape) for p in pieces}}
    return pieces, meta


def _load_optimizer(opt: torch.optim.Optimizer, view: EntryView) -> Callable[[], None]:
    mine = type(_inner_optimizer(opt)).__qualname__
    if view.meta.get("class") != mine:
        raise CheckpointError(f"{view.where}: entry {view.name!r} holds {view.meta.get('class')} state, this "
                              f"optimizer is {mine}")
    current = opt.state_dict()["param_groups"]
    saved_groups = view.meta.get("param_groups", [])
    sizes = [len(g["params"]) for g in current]
    saved_sizes = [len(g.get("params", [])) for g in saved_groups]
    if sizes != saved_sizes:
        raise CheckpointError(f"{view.where}: entry {view.name!r} has parameter groups of {saved_sizes} parameters, "
                              f"this optimizer {sizes}")
    params = [p for group in _inner_optimizer(opt).param_groups for p in group["params"]]
    ids = [i for g in current for i in g["params"]]
    position = {pid: params[n] for n, pid in enumerate(ids)}
    saved_ids = [i for g in saved_groups for i in g["params"]]
    to_mine = dict(zip(saved_ids, ids))
    source = entry_source(view)
    state: dict[int, dict[str, Any]] = {}
    for key, shape in view.meta.get("tensors", {}).items():
        _, index, name = key.split("/", 2)
        if int(index) not in to_mine:
            raise CheckpointError(f"{view.where}: entry {view.name!r} has state for parameter {index}, which its "
                                  "parameter groups do not list")
        mine_id = to_mine[int(index)]
        param = position[mine_id]
        if len(shape) == param.dim() > 0 and tuple(shape) != tuple(param.shape):  # a buffer per element, another size
            raise CheckpointError(f"{view.where}: entry {view.name!r}: state {name!r} of parameter {index} has shape "
                                  f"{tuple(shape)}, the parameter {tuple(param.shape)}")
        state.setdefault(mine_id, {})[name] = source.read_box(key, ()).reshape(tuple(shape))
    for index, values in view.meta.get("scalars", {}).items():
        state.setdefault(to_mine[int(index)], {}).update(values)
    groups = []
    for mine_group, saved in zip(current, saved_groups):
        group = dict(mine_group)
        for k, v in saved.items():
            if k == "params" or k not in group:
                continue
            group[k] = tuple(v) if isinstance(group[k], tuple) and isinstance(v, list) else v
        groups.append(group)
    staged = {"state": state, "param_groups": groups}

    def apply() -> None:
        opt.load_state_dict(staged)
    return apply


def _is_optimizer(obj: Any) -> bool:
    from ..zero import ZeroOptimizer

    return isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, ZeroOptimizer)


# -- sharded embedding tables and their sparse optimizer -------------------------------------------

def _tables(ebc: ShardedEmbeddingBagCollection) -> dict[str, list[int]]:
    return {t.name: [t.num_embeddings, t.embedding_dim] for t in ebc.tables.values()}


def _check_tables(ebc: ShardedEmbeddingBagCollection, view: EntryView) -> None:
    saved = {n: list(s) for n, s in view.meta.get("tables", {}).items()}
    mine = _tables(ebc)
    if saved != mine:
        differ = sorted(n for n in set(saved) | set(mine) if saved.get(n) != mine.get(n))
        raise CheckpointError(f"{view.where}: entry {view.name!r} holds other tables: " + "; ".join(
            f"{n}: saved {tuple(saved[n]) if n in saved else None}, here {tuple(mine[n]) if n in mine else None}"
            for n in differ))


def _save_tables(ebc: ShardedEmbeddingBagCollection) -> tuple[list[Piece], dict]:
    pieces = []
    for name in written_shards(ebc):
        table, shard = ebc.shard_of(name)
        full = (table.num_embeddings, table.embedding_dim)
        pieces.append(_box(table.name, full, (shard.row_start, shard.row_end), (shard.col_start, shard.col_end),
                           ebc.shard(name)))
    meta = {"tables": _tables(ebc), "plan": {p.table.name: p.sharding.value for p in ebc.plan.placements}}
    return pieces, meta


def _load_tables(ebc: ShardedEmbeddingBagCollection, view: EntryView) -> Callable[[], None]:
    _check_tables(ebc, view)
    source = entry_source(view)
    staged = {}
    for name in ebc.shard_names():
        table, shard = ebc.shard_of(name)
        box = (slice(shard.row_start, shard.row_end), slice(shard.col_start, shard.col_end))
        staged[name] = source.read_box(table.name, box)

    def apply() -> None:
        with torch.no_grad():
            for name, values in staged.items():
                ebc.shard(name).copy_(values)
        ebc.clear_grads()
    return apply


def _save_sparse(opt: SparseOptimizer) -> tuple[list[Piece], dict]:
    ebc = opt.collection
    pieces = []
    written = set(written_shards(ebc))
    for name, state in opt.state.items():
        if name not in written:
            continue
        table, shard = ebc.shard_of(name)
        rows, cols = (shard.row_start, shard.row_end), (shard.col_start, shard.col_end)
        if opt.kind == "adagrad":
            pieces.append(_box(f"adagrad/{table.name}", (table.num_embeddings, table.embedding_dim), rows, cols,
                               state))
        else:
            key = f"rowwise_adagrad/{table.name}"
            if cols != (0, table.embedding_dim):
                key += f"@{cols[0]}:{cols[1]}"
            pieces.append(_box(key, (table.num_embeddings,), rows, None, state))
    meta = {"kind": opt.kind, "lr": opt.lr, "eps": opt.eps, "tables": _tables(ebc)}
    return pieces, meta


def _load_sparse(opt: SparseOptimizer, view: EntryView) -> Callable[[], None]:
    if view.meta.get("kind") != opt.kind:
        raise CheckpointError(f"{view.where}: entry {view.name!r} holds {view.meta.get('kind')} optimizer state, "
                              f"this sparse optimizer is {opt.kind}")
    _check_tables(opt.collection, view)
    source = entry_source(view) if opt.kind != "sgd" else None
    staged = {}
    for name in opt.state:
        table, shard = opt.collection.shard_of(name)
        rows, cols = (shard.row_start, shard.row_end), (shard.col_start, shard.col_end)
        if opt.kind == "adagrad":
            staged[name] = source.read_box(f"adagrad/{table.name}", (slice(*rows), slice(*cols)))
        else:
            staged[name] = _row_state(source, table.name, rows, cols, table.embedding_dim, prefix="")
    lr, eps = float(view.meta.get("lr", opt.lr)), float(view.meta.get("eps", opt.eps))

    def apply() -> None:
        with torch.no_grad():
            for name, values in staged.items():
                opt.state[name].copy_(values)
        opt.lr, opt.eps = lr, eps
        opt.zero_grad()
    return apply


# -- ParallelModel: its pieces as each rank holds them -----------------------------------------------

def _is_parallel_model(obj: Any) -> bool:
    from ..parallel.parallelize import ParallelModel

    return isinstance(obj, ParallelModel)


def _save_parallel(pm: Any) -> tuple[list[Piece], dict]:
    from .parallel import _hyperparameters, _jsonable_dict
    from ..parallel.local_pieces import local_pieces

    pieces = [Piece(lp.key, lp.placement.full_shape, encode_placement(lp.placement), lp.start, lp.stop,
                    DTYPE_CODES[lp.dtype], lambda lp=lp: tensor_bytes(lp.values())())
              for lp in local_pieces(pm)]
    pieces.append(_whole(f"rng/torch/{pm.groups.world.rank}", torch.get_rng_state()))  # one per rank
    scaler = getattr(pm.optimizer, "loss_scaler", None)
    meta = {"layout": pm.layout.describe(), "optimizer": type(getattr(pm.optimizer, "inner", pm.optimizer)).__name__,
            "zero_stage": pm.layout.zero_stage, "model": {n: list(s) for n, s in pm.tensors.expected.items()},
            "param_groups": _hyperparameters(pm),
            "loss_scaler": _jsonable_dict(scaler.state_dict()) if scaler is not None else None}
    return pieces, meta


def _load_parallel(pm: Any, view: EntryView) -> Callable[[], None]:
    from . import parallel as parallel_torch
    from ..parallel.full_tensors import stage_tensors

    # the same checks as a ParallelModel checkpoint's: names, shapes and optimizer class
    parallel_torch._check(pm, {**view.meta, "format": parallel_torch.FORMAT, "version": parallel_torch.FORMAT_VERSION},
                          view.where)
    source = entry_source(view)
    apply_tensors = stage_tensors(pm, source, optimizer=True)
    rank = pm.groups.world.rank
    rng = source.read_box(f"rng/torch/{rank}" if f"rng/torch/{rank}" in view.tensors else "rng/torch/0", ())
    groups, scaler_state = view.meta.get("param_groups", []), view.meta.get("loss_scaler")

    def apply() -> None:
        apply_tensors()
        for group, saved in zip(pm.optimizer.param_groups, groups):
            for k, v in saved.items():
                if k in group and v is not None and not torch.is_tensor(group[k]):
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
        scaler = getattr(pm.optimizer, "loss_scaler", None)
        if scaler is not None and scaler_state:
            scaler.load_state_dict(scaler_state)
        torch.set_rng_state(rng.to(torch.uint8))
    return apply


register_handler(MODULE, _is_module, _save_module, _load_module, parts=_module_parts)
register_handler(COMBINED_OPTIMIZER, lambda obj: isinstance(obj, CombinedOptimizer), _save_combined, _load_combined,
                 parts=lambda opt: dict(opt.optimizers))
register_handler(OPTIMIZER, _is_optimizer, _save_optimizer, _load_optimizer)
register_handler(SHARDED_EMBEDDINGS, lambda obj: isinstance(obj, ShardedEmbeddingBagCollection), _save_tables,
                 _load_tables, comm=lambda ebc: ebc.comm)
register_handler(SPARSE_OPTIMIZER, lambda obj: isinstance(obj, SparseOptimizer), _save_sparse, _load_sparse,
                 comm=lambda opt: opt.collection.comm)
register_handler(PARALLEL_MODEL, _is_parallel_model, _save_parallel, _load_parallel, comm=lambda pm: pm.groups.world)

from . import zero_state  # noqa: E402,F401  (registers torch.zero_optimizer, after the general kinds)
