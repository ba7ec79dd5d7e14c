"""Hybrid sharding at 4 ranks as 2 groups of 2, against one process (issue 55).

ZeRO shards within a group of ``dp_shard`` consecutive data-parallel ranks and averages each
reduced gradient shard over the ``dp_replicate`` groups (FSDP2's HSDP, DeepSpeed's MiCS). Every
scenario compares with one process (hf_any's tiny Hugging Face models, its tolerances and its SGD
with momentum; the one-process run clips its gradient norm where the layout does): the losses and
every whole parameter after 3 steps. Also: every ZeRO unit's group lies inside one shard group (so
its gathers never leave it), a plain ``ZeroOptimizer`` over ``build_groups(dp_shard=2)`` with AdamW,
and checkpoints resharded between hybrid and flat layouts.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

import shardwise
from hf_any import ATOL, OPT_ARGS, OPTIMIZER, RTOL, _close, batches, build, compare, one_process, whole
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.core.layout import ParallelLayout


def _train(pm: ParallelModel, data: list[torch.Tensor], want: list[float], what: str, start: int = 0,
           stop: int | None = None) -> None:
    for step in range(start, len(data) if stop is None else stop):
        _close(pm.train_step(pm.shard_batch(data[step])), want[step], f"{what} step {step} loss")


def _members(comm: Any, world: Any) -> tuple[int, ...]:
    """The world ranks of ``comm`` (collective over it)."""
    return tuple(comm.allgather_object(world.rank))


def _groups_inside(world: Any, pm: ParallelModel, what: str) -> int:
    """Every ZeRO unit shards over one shard group (whose ranks are one "node" of consecutive dp ranks)
    and averages over the ranks holding its shard in the other groups; returns the units checked."""
    groups, opt = pm.groups, pm.optimizer
    shard = _members(groups.dp_shard, world)
    replicate = _members(groups.dp_replicate, world)
    if len(shard) != pm.layout.dp_shard or len(replicate) != pm.layout.dp_replicate:
        raise AssertionError(f"{what}: shard group {shard}, replicate group {replicate}")
    for unit in opt.units:
        if _members(unit.comm, world) != shard:
            raise AssertionError(f"{what}: unit {unit.index} shards over {_members(unit.comm, world)}, "
                                 f"not its shard group {shard}")
        if unit.replicate is None or _members(unit.replicate, world) != replicate:
            raise AssertionError(f"{what}: unit {unit.index} does not average over the replicas {replicate}")
    dp_ranks = tuple(groups.dp_shard.allgather_object(groups.dp.rank))  # data-parallel indices of the group
    if dp_ranks != tuple(range(dp_ranks[0], dp_ranks[0] + len(shard))) or dp_ranks[0] % len(shard):
        raise AssertionError(f"{what}: the shard group holds data-parallel ranks {dp_ranks}, not consecutive ones")
    return len(opt.units)


def layouts(backend: str, cases: list[list[Any]]) -> None:
    """Each case is ``[model type, layout fields]``: 3 steps, every parameter equal to one process, and
    (where ZeRO shards over a group of more than one rank) every unit inside its shard group."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    references: dict[tuple[str, float], tuple[list[float], dict]] = {}
    for model_type, fields in cases:
        clip = fields.get("gradient_clipping", 0.0)
        if (model_type, clip) not in references:
            references[model_type, clip] = one_process(model_type, data, clip=clip)
        want_losses, want_params = references[model_type, clip]
        pm = parallelize(build(model_type), OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
        what = f"{model_type} {pm.layout.describe()}"
        units = _groups_inside(world, pm, what)
        _train(pm, data, want_losses, what)
        checked = compare(world, whole(pm), want_params, what)
        pm.groups.free()
        if world.rank == 0:
            print(f"OK {what}: 3 losses and {checked} parameters equal to one process; {units} ZeRO units "
                  "inside their shard group", flush=True)


def _shared_dir(world: Any) -> Path:
    path = tempfile.mkdtemp(prefix="shardwise_hybrid_") if world.rank == 0 else None
    return Path(world.broadcast_object(path, 0))


def resume(backend: str, pairs: list[list[dict[str, Any]]], model_type: str = "qwen3") -> None:
    """Each pair ``[saved layout, loading layout]``: 2 steps saved, a model of another seed loads the
    checkpoint and takes step 3; the loss and every parameter equal one process trained 3 steps."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    want_losses, want_params = one_process(model_type, data)
    for saved, loading in pairs:
        first = parallelize(build(model_type), OPTIMIZER, ParallelLayout(**saved), **OPT_ARGS)
        _train(first, data, want_losses, f"{model_type} {first.layout.describe()}", stop=2)
        path = first.save_checkpoint(_shared_dir(world) / "ckpt", 2, extra={"next_batch": 2})
        saved_as = first.layout.describe()
        first.groups.free()
        second = parallelize(build(model_type, seed=1), OPTIMIZER, ParallelLayout(**loading), **OPT_ARGS)
        extra = second.load_checkpoint(path)
        if extra.get("next_batch") != 2:
            raise AssertionError(f"the checkpoint says {extra}, expected next_batch 2")
        what = f"{model_type} {saved_as} -> {second.layout.describe()}"
        _train(second, data, want_losses, what, start=2)
        checked = compare(world, whole(second), want_params, what)
        second.groups.free()
        if world.rank == 0:
            print(f"OK resume {what}: step 3 and {checked} parameters equal to an uninterrupted run", flush=True)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in ((12, 24), (24, 24), (24, 5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.tanh(layer(x))
        return x


def zero_optimizer(backend: str) -> None:
    """``ZeroOptimizer(comm=groups.dp_shard, replicate_comm=groups.dp_replicate)`` at stages 1, 2 and 3
    with AdamW and clipping, each rank on its quarter of the batch: every parameter equals one process
    on the whole batch after 3 steps; ``save_zero_checkpoint`` from the hybrid optimizer (the first group
    writes) loads into a flat stage-3 one over all ranks, which holds the same parameters."""
    from shardwise.adapters.torch.checkpoint.zero import load_zero_checkpoint, save_zero_checkpoint
    from shardwise.adapters.torch.zero import ZeroOptimizer

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 12, generator=gen) for _ in range(3)]
    ys = [torch.randn(8, 5, generator=gen) for _ in range(3)]
    args = {"lr": 1e-2, "weight_decay": 0.01}
    torch.manual_seed(0)
    ref = _MLP()
    ref_opt = torch.optim.AdamW(ref.parameters(), **args)
    for x, y in zip(xs, ys):
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    want = {n: p.detach() for n, p in ref.named_parameters()}
    groups = shardwise.build_groups(world, dp=world.size, dp_shard=2)
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = _MLP()
        wrap = list(model.layers) if stage == 3 else None
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, comm=groups.dp_shard,
                            replicate_comm=groups.dp_replicate, clip_grad_norm=0.5, wrap=wrap, **args)
        for x, y in zip(xs, ys):
            torch.nn.functional.mse_loss(model(x.chunk(world.size)[world.rank]),
                                         y.chunk(world.size)[world.rank]).backward()
            opt.step()
            opt.zero_grad()
        got = opt.full_parameters()
        bad = [n for n, w in want.items() if not torch.allclose(got[n], w, rtol=RTOL, atol=ATOL)]
        if any(world.allgather_object(bad)):
            raise AssertionError(f"stage {stage} hybrid: {bad} differ from one process on rank {world.rank}")
        if stage == 3:
            directory = _shared_dir(world) / "zero"
            save_zero_checkpoint(opt, directory, step=3)
            torch.manual_seed(1)
            other = _MLP()
            flat = ZeroOptimizer(other, torch.optim.AdamW, stage=3, comm=world, wrap=list(other.layers), **args)
            meta = load_zero_checkpoint(flat, directory)
            loaded = flat.full_parameters()
            wrong = [n for n, w in want.items() if not torch.allclose(loaded[n], w, rtol=RTOL, atol=ATOL)]
            if meta.get("world_size") != 2 or any(world.allgather_object(wrong)):
                raise AssertionError(f"hybrid checkpoint into a flat optimizer: world {meta.get('world_size')}, "
                                     f"{wrong} differ")
            flat.remove()
        opt.remove()
        if world.rank == 0:
            print(f"OK ZeroOptimizer stage {stage} dp_shard=2 x dp_replicate={world.size // 2}: "
                  f"{len(want)} parameters equal to one process (AdamW, clipping)"
                  + ("; its checkpoint loads flat over 4 ranks" if stage == 3 else ""), flush=True)
    groups.free()
