"""``shardwise.checkpoint.save``/``load`` on a recommendation model (run under mpirun).

The model: a dense MLP (SGD with momentum, gradients averaged over the ranks) over the pooled
outputs of a :class:`ShardedEmbeddingBagCollection` (Adagrad through :class:`SparseOptimizer`).
One ``save`` call writes all four objects; one ``load`` call on another world size and plan
restores them, and training on ends equal to one process that never stopped. A load that fails
on one rank (one damaged file) raises the same error on every rank and changes nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from torch import nn

import shardwise
import shardwise.torch as swt
from shardwise import checkpoint
from shardwise.adapters.torch.embedding import ShardedEmbeddingBagCollection, SparseOptimizer, full_table, plan_tables
from shardwise.adapters.torch.checkpoint.embedding import load_embedding_checkpoint, save_embedding_checkpoint
from shardwise.core.errors import CheckpointError
from sharded_embeddings import FEATURES, TABLE_OF, TABLES, WIDTH, _batch, _constraints, _slice, _target

SEED, STEPS, SAVED_AT, SAMPLES, LR, MOMENTUM = 5, 10, 5, 24, 0.05, 0.9


def _dense() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(WIDTH, 6), nn.ReLU(), nn.Linear(6, 1))


def _build(world, sharding: Optional[str], mixed: bool, local_size: Optional[int], ddp: bool) -> tuple:  # noqa: ANN001
    """Tables, dense model (wrapped by shardwise's DDP, or plain under DistributedOptimizer) and both optimizers."""
    plan = plan_tables(TABLES, world.size, local_size=local_size, optimizer="adagrad", memory_per_rank=10**9,
                       constraints=_constraints(sharding, mixed, world.size))
    ebc = ShardedEmbeddingBagCollection(TABLES, plan, comm=world, seed=SEED)
    dense = _dense()
    if ddp:
        model = swt.DistributedDataParallel(dense)
        dense_opt = torch.optim.SGD(dense.parameters(), lr=LR, momentum=MOMENTUM)
    else:
        model = dense
        dense_opt = swt.DistributedOptimizer(torch.optim.SGD(dense.parameters(), lr=LR, momentum=MOMENTUM),
                                             named_parameters=dense.named_parameters())
    return plan, ebc, model, dense_opt, SparseOptimizer(ebc, "adagrad", lr=LR)


def _train(world, ebc, model, dense_opt, sparse_opt, steps: range) -> None:  # noqa: ANN001
    per = SAMPLES // world.size
    mine = slice(world.rank * per, (world.rank + 1) * per)
    for step in steps:
        kjt = _slice(_batch(step, SAMPLES, False, False), mine.start, mine.stop)
        out = ebc(kjt)
        loss = nn.functional.mse_loss(model(torch.cat([out[f] for f in FEATURES], dim=1)),
                                      _target(step, SAMPLES)[mine])
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        sparse_opt.step()


def _reference() -> tuple[dict[str, torch.Tensor], nn.Module]:
    """One process, never interrupted: whole tables as ``nn.EmbeddingBag``s, torch's Adagrad and SGD."""
    bags = nn.ModuleDict({t.name: nn.EmbeddingBag.from_pretrained(full_table(t, SEED), mode=t.pooling, freeze=False)
                          for t in TABLES})
    dense = _dense()
    dense_opt = torch.optim.SGD(dense.parameters(), lr=LR, momentum=MOMENTUM)
    table_opt = torch.optim.Adagrad(bags.parameters(), lr=LR, eps=1e-10)
    for step in range(STEPS):
        kjt = _batch(step, SAMPLES, False, False)
        pooled = []
        for f in FEATURES:
            v, lens, _ = kjt.feature(f)
            pooled.append(bags[TABLE_OF[f].name](v, torch.cumsum(lens, 0) - lens))
        loss = nn.functional.mse_loss(dense(torch.cat(pooled, dim=1)), _target(step, SAMPLES))
        dense_opt.zero_grad()
        table_opt.zero_grad()
        loss.backward()
        table_opt.step()
        dense_opt.step()
    return {t.name: bags[t.name].weight.detach() for t in TABLES}, dense


def _whole_tables(world, ebc: ShardedEmbeddingBagCollection) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every table, gathered whole from the shards of every rank."""
    mine = []
    for name in ebc.shard_names():
        table, shard = ebc.shard_of(name)
        mine.append((table.name, shard.row_start, shard.row_end, shard.col_start, shard.col_end,
                     ebc.shard(name).clone()))
    whole = {t.name: torch.full((t.num_embeddings, t.embedding_dim), float("nan")) for t in TABLES}
    for shards in world.allgather_object(mine):
        for name, r0, r1, c0, c1, values in shards:
            whole[name][r0:r1, c0:c1] = values
    return whole


def _state(ebc, model, dense_opt, sparse_opt) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Copies of everything a load may change on this rank."""
    out = {f"table/{n}": getattr(ebc, n).clone() for n in ebc.shard_names()}
    out.update({f"sparse/{n}": v.clone() for n, v in sparse_opt.state.items()})
    out.update({f"dense/{n}": v.detach().clone() for n, v in model.state_dict().items()})
    for index, values in dense_opt.state_dict()["state"].items():
        out.update({f"momentum/{index}/{k}": v.clone() for k, v in values.items() if torch.is_tensor(v)})
    return out


def resume(backend: str, directory: str, phase: str, sharding: Optional[str] = None, mixed: bool = False,
           local_size: Optional[int] = None, ddp: bool = False) -> None:
    """``phase`` "save": steps 0-4, then ONE ``checkpoint.save``; "load": ONE ``checkpoint.load`` on this
    world size and plan, steps 5-9, then tables (gathered whole) and dense weights equal one process."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    plan, ebc, model, dense_opt, sparse_opt = _build(world, sharding, mixed, local_size, ddp)
    state = {"model": model, "tables": ebc, "dense_opt": dense_opt, "sparse_opt": sparse_opt}
    if phase == "save":
        _train(world, ebc, model, dense_opt, sparse_opt, range(SAVED_AT))
        path = checkpoint.save(directory, SAVED_AT, state, extra={"position": SAVED_AT})
        if world.rank == 0:
            print(f"OK saved {path.name} on {world.size} ranks as "
                  f"{sorted({p.sharding.value for p in plan.placements})}", flush=True)
        return
    info = checkpoint.load(directory, state)
    assert info == {"position": SAVED_AT, "step": SAVED_AT}, info
    _train(world, ebc, model, dense_opt, sparse_opt, range(info["step"], STEPS))
    want_tables, want_dense = _reference()
    got = _whole_tables(world, ebc)
    worst = 0.0
    for name, want in want_tables.items():
        assert not torch.isnan(got[name]).any(), f"table {name}: rows no rank holds"
        assert torch.allclose(got[name], want, rtol=1e-5, atol=1e-7), \
            f"table {name}: max diff {(got[name] - want).abs().max():.3e}"
        worst = max(worst, (got[name] - want).abs().max().item())
    for (n, p), q in zip(model.named_parameters(), want_dense.parameters()):
        assert torch.allclose(p.detach(), q.detach(), rtol=1e-5, atol=1e-7), \
            f"dense {n}: max diff {(p.detach() - q.detach()).abs().max():.3e}"
        worst = max(worst, (p.detach() - q.detach()).abs().max().item())
    if world.rank == 0:
        print(f"OK resumed on {world.size} ranks as {sorted({p.sharding.value for p in plan.placements})} "
              f"with one load: max diff vs one uninterrupted process {worst:.2e}", flush=True)


def save_both(backend: str, directory: str) -> None:
    """Four ranks, table-wise tables, 2 steps; a one-door checkpoint under ``door/`` and an embedding-table
    checkpoint under ``tables/``."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    plan, ebc, model, dense_opt, sparse_opt = _build(world, "table_wise", False, None, False)
    _train(world, ebc, model, dense_opt, sparse_opt, range(2))
    # tables first: the ranks' own shards are assigned before the replicated pieces, which then go to
    # the ranks with the fewest bytes, so some file holds table pieces only
    checkpoint.save(f"{directory}/door", 2, {"tables": ebc, "sparse_opt": sparse_opt, "model": model,
                                             "dense_opt": dense_opt})
    save_embedding_checkpoint(ebc, f"{directory}/tables", 2, optimizer=sparse_opt)
    if world.rank == 0:
        print(f"OK saved both on {world.size} ranks", flush=True)


def _damage(path: Path, how: str) -> None:
    """``truncate``: cut the file in half; ``header``: overwrite its header length (same size, unreadable);
    ``flip``: invert its last 16 bytes, tensor data (same size, a readable header: only the block
    checksums tell)."""
    if how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
        return
    with open(path, "r+b") as f:
        if how == "header":
            f.write(b"\xff" * 8)
            return
        f.seek(-16, os.SEEK_END)
        tail = f.read(16)
        f.seek(-16, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))


def _readers(meta: dict, files: list[str], plan, world_size: int) -> dict[str, set[int]]:  # noqa: ANN001
    """For each file: the ranks of the new ``plan`` that read it (tables and their optimizer state only;
    a file holding anything else is read by every rank)."""
    owners = {p.table.name: {s.rank for s in p.shards} for p in plan.placements}
    readers: dict[str, set[int]] = {f: set() for f in files}
    for key, info in meta["tensors"].items():
        parts = key.split("/")
        table = parts[-1].split("@")[0]
        ranks = owners.get(table, set(range(world_size))) if parts[0] in ("tables", "sparse_opt", "optimizer") \
            else set(range(world_size))
        for piece in info["pieces"]:
            readers[files[piece[0]]] |= ranks
    return readers


def _expect_refusal(world, load, before: dict, after, failing: Optional[int], what: str) -> str:  # noqa: ANN001
    """Run ``load()``: it must raise the same CheckpointError on every rank (naming rank ``failing`` alone,
    when given) and leave ``after()`` equal to ``before`` on every rank."""
    try:
        load()
    except CheckpointError as exc:
        text = str(exc)
    else:
        text = None
    every = world.allgather_object(text)
    loaded = [r for r, t in enumerate(every) if t is None]
    assert not loaded, f"{what}: loaded on rank(s) {loaded}"
    assert len(set(every)) == 1, f"{what}: the ranks' errors differ: {every}"
    if failing is not None:
        assert f"failed on rank {failing};" in text and "more rank(s)" not in text, f"{what}: {text}"
    now = after()
    changed = [k for k in before if not torch.equal(before[k], now[k])]
    assert not changed, f"{what}: changed {changed}"
    return text


def all_or_nothing(backend: str, directory: str) -> None:
    """On two ranks (table-wise), loads of ``save_both``'s checkpoints with one file damaged: a file only one
    rank reads (the door: truncated, its header overwritten or 16 bytes of tensor data flipped; the
    embedding checkpoint: header overwritten or bytes flipped) fails that rank's read alone, and a
    truncated file of the embedding checkpoint fails its size check on every rank; each time every rank raises the same CheckpointError and keeps its tables,
    sparse optimizer state, dense weights and momentum."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    plan, ebc, model, dense_opt, sparse_opt = _build(world, "table_wise", False, None, False)
    _train(world, ebc, model, dense_opt, sparse_opt, range(1))  # a state of its own, unlike the checkpoint's
    state = {"tables": ebc, "sparse_opt": sparse_opt, "model": model, "dense_opt": dense_opt}
    before = _state(ebc, model, dense_opt, sparse_opt)

    def snapshot() -> dict:
        return _state(ebc, model, dense_opt, sparse_opt)

    root = Path(directory)
    lines = []
    for kind, how in (("door", "truncate"), ("door", "header"), ("door", "flip"), ("tables", "header"),
                      ("tables", "flip"), ("tables", "truncate")):
        copy = root / f"{kind}-{how}"
        target, failing = None, None
        if world.rank == 0:
            shutil.copytree(root / kind, copy)
        world.barrier()
        step_dir = copy / "ckpt-2"
        meta = checkpoint.load_checkpoint(step_dir, verify=False).metadata
        readers = _readers(meta, meta["files"], plan, world.size)
        alone = [f for f, ranks in readers.items() if len(ranks) == 1]
        assert alone, f"{kind}: every file is read by several ranks: {readers}"
        target = alone[0]
        if not (kind == "tables" and how == "truncate"):  # the embedding load checks every file's size first
            failing = next(iter(readers[target]))
        world.barrier()
        if world.rank == 0:
            _damage(step_dir / target, how)
        world.barrier()
        if kind == "door":
            load = lambda: checkpoint.load(copy, state)  # noqa: E731
        else:
            load = lambda: load_embedding_checkpoint(ebc, copy, optimizer=sparse_opt)  # noqa: E731
        text = _expect_refusal(world, load, before, snapshot, failing, f"{kind} {how}")
        lines.append(f"{kind} {how}: {text}")
    good = checkpoint.load(root / "door", state)  # the undamaged checkpoint still loads
    assert good["step"] == 2 and any(not torch.equal(before[k], v) for k, v in snapshot().items())
    if world.rank == 0:
        for line in lines:
            print(f"OK refused on every rank, nothing changed: {line}", flush=True)


def parallel_model(backend: str, directory: str, phase: str, layout: dict) -> None:
    """A ParallelModel (GPT-2, SGD with momentum) as one entry of the door: "save" trains 2 steps with
    ``layout`` and saves; "load" builds another layout, loads with one call and trains steps 2-3, whose
    losses (and, without ZeRO-3, parameters) equal one process's."""
    import copy

    from hf_parallel import OPT_ARGS, OPTIMIZER, _batches, _check_params, _close, _reference, build

    from shardwise.core.layout import ParallelLayout
    from shardwise.torch import parallelize

    torch.set_num_threads(1)
    shardwise.init(backend=backend)
    batches = _batches()
    model = build("gpt2")
    want = _reference(copy.deepcopy(model), batches)
    pm = parallelize(model, OPTIMIZER, ParallelLayout(**layout), **OPT_ARGS)
    if phase == "save":
        for ids in batches[:2]:
            pm.train_step(pm.shard_batch(ids))
        checkpoint.save(directory, 2, {"model": pm}, extra={"next": 2})
        if pm.groups.world.rank == 0:
            print(f"OK saved {pm.layout.describe()}", flush=True)
        pm.groups.free()
        return
    info = checkpoint.load(directory, {"model": pm})
    assert info == {"next": 2, "step": 2}, info
    for step in range(info["next"], len(batches)):
        _close(pm.train_step(pm.shard_batch(batches[step])), want[step], f"step {step} loss after the load")
    worst = 0.0
    if pm.layout.zero_stage != 3:
        trained = build("gpt2")
        _reference(trained, batches)
        worst = _check_params(pm, trained)
    if pm.groups.world.rank == 0:
        print(f"OK resumed as {pm.layout.describe()}: losses and parameters equal one process "
              f"(max parameter diff {worst:.2e})", flush=True)
    pm.groups.free()


def _zero_snapshot(model: nn.Module, opt) -> dict:  # noqa: ANN001
    """Collective: the ZeroOptimizer's whole state (masters, optimizer state, hyperparameters, loss scale),
    its whole parameters and the module's own state (frozen parameters), identical on every rank."""
    full = opt.full_state_dict()
    params = opt.full_parameters()
    module = {k: v.clone() for k, v in model.state_dict().items() if k not in params}
    return {key: full[key] for key in ("master", "state", "param_groups", "loss_scaler", "elementwise")} | {
        "parameters": params, "module": module}


def zero_optimizer(backend: str, directory: str, phase: str, stage: int) -> None:
    """A model under a data-parallel ZeroOptimizer (Adam) as two entries of the door.

    "save": 3 steps at ``stage``, ONE ``checkpoint.save`` of ``{"model", "opt"}``, and the whole state
    then (gathered) kept beside it. "load": another model and optimizer (other seed and lr) at ``stage``
    on this world size, ONE ``checkpoint.load``: the whole state equals the saved one bit for bit; 3
    more steps equal one process's plain Adam over all 6 batches (rtol 1e-5).
    "refuse": a read failing on rank 1 alone raises the same error on every rank and changes nothing;
    the same load then succeeds.
    """
    from zero_elastic import _assert_identical, _assert_matches_reference, _close, _reference, _train, _zero

    torch.set_num_threads(1)
    comm = shardwise.init(backend=backend).world
    saved_at, steps = 3, 6
    if phase == "save":
        model, opt = _zero(comm, stage)
        _train(model, opt, comm, range(saved_at))
        checkpoint.save(directory, saved_at, {"model": model, "opt": opt}, extra={"next": saved_at})
        whole = _zero_snapshot(model, opt)
        if comm.rank == 0:
            torch.save(whole, Path(directory) / "whole-at-save.pt")
            print(f"OK saved a stage-{stage} ZeroOptimizer on {comm.size} ranks", flush=True)
        comm.barrier()
        return
    model, opt = _zero(comm, stage, seed=3, lr=0.5)
    state = {"model": model, "opt": opt}
    want = torch.load(Path(directory) / "whole-at-save.pt")
    if phase == "refuse":
        from shardwise.adapters.torch.checkpoint.pieces import PiecesSource

        _train(model, opt, comm, range(1))  # a state of its own
        before = _zero_snapshot(model, opt)
        opened = PiecesSource._file

        def failing(self, path):  # noqa: ANN001, ANN202
            raise OSError(f"injected: reading {path.name} failed")

        if comm.rank == 1:
            PiecesSource._file = failing
        try:
            checkpoint.load(directory, state)
        except CheckpointError as exc:
            text = str(exc)
        else:
            text = None
        finally:
            PiecesSource._file = opened
        every = comm.allgather_object(text)
        assert None not in every and len(set(every)) == 1, f"the ranks' errors differ: {every}"
        assert "failed on rank 1;" in text and "injected" in text, text
        _assert_identical(_zero_snapshot(model, opt), before, "state after a refused load")
        checkpoint.load(directory, state)
        _assert_identical(_zero_snapshot(model, opt), want, "state after the load that followed")
        if comm.rank == 0:
            print(f"OK refused on every rank, nothing changed: {text}", flush=True)
        return
    info = checkpoint.load(directory, state)
    assert info == {"next": saved_at, "step": saved_at}, info
    got = _zero_snapshot(model, opt)
    _assert_identical(got, want, f"stage {stage} on {comm.size} ranks after the load")
    _train(model, opt, comm, range(saved_at, steps))
    ref, ref_opt = _reference(steps)
    _assert_matches_reference(opt.full_state_dict(), ref, ref_opt, stage)
    params = opt.full_parameters()
    for name, p in ref.named_parameters():
        _close(params[name] if name in params else model.state_dict()[name], p, f"{name} after training on")
    if comm.rank == 0:
        print(f"OK resumed at stage {stage} on {comm.size} ranks: bit-equal state, training on equals one process",
              flush=True)
