"""Fewer key/value heads than the tensor-parallel degree: each head replicated over tp / kv ranks (issue 53).

As vLLM's ``QKVParallelLinear`` does (``num_kv_head_replicas = tp // num_key_value_heads``), rank
``r`` keeps the rows of key/value head ``r // (tp / kv)`` of ``k_proj`` / ``v_proj`` (and of their
biases), its query heads split tp ways as usual; the weight gradients of a replicated head, partial
on each replica (each from its own query heads), are summed over the ranks holding it.

Tiny configs (:data:`CASES`): Qwen3 with 8 query and 2 key/value heads (per-head q/k norms) and
Qwen2 with 4 query heads and 1 key/value head (q/k/v biases). Every scenario compares with one
process (hf_any's helpers and tolerances: the same seeded build trained by Hugging Face's own loss
with SGD and momentum): the losses, every whole parameter, and each rank's own slice of every split
parameter (so that every replica, not only the one a gather keeps, holds the right values).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

import shardwise
from hf_any import ATOL, OPT_ARGS, OPTIMIZER, RTOL, _close, _refused, batches, compare, whole
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.adapters.torch.parallel.tp_apply import is_tp_sharded
from shardwise.adapters.torch.parallel.weights import take
from shardwise.core.layout import ParallelLayout

_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, attention_dropout=0.0,
              use_cache=False)

#: case name -> (model type, config keys).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-kv2": ("qwen3", {**_SHAPE, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}),
    "qwen2-kv1": ("qwen2", {**_SHAPE, "num_attention_heads": 4, "num_key_value_heads": 1}),
    "qwen3-kv3": ("qwen3", {**_SHAPE, "num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 8}),
}


def build(case: str, seed: int = 0, meta: bool = False) -> torch.nn.Module:
    """The tiny model of ``case`` after ``torch.manual_seed(seed)`` (on the meta device: unallocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, keys = CASES[case]
    cfg = AutoConfig.for_model(model_type, **keys)
    cfg.dtype = torch.float32
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def one_process(case: str, data: list[torch.Tensor], clip: float = 0.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Hugging Face's own training of ``case`` in one process (the gradient norm clipped to ``clip``
    when given): the losses, and the parameters after."""
    model = build(case)
    opt = OPTIMIZER(model.parameters(), **OPT_ARGS)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(pm: ParallelModel, data: list[torch.Tensor], want: list[float], what: str, start: int = 0) -> None:
    for step in range(start, len(data)):
        _close(pm.train_step(pm.shard_batch(data[step])), want[step], f"{what} step {step} loss")


def own_slices(world: Any, pm: ParallelModel, want: dict[str, torch.Tensor], what: str) -> int:
    """Each rank's own slice of every tensor-parallel parameter equals the same slice of the one-process
    tensor (every replica of a key/value head, not just the one a gather keeps); returns how many
    replicated slices this rank checked (the same AssertionError on every rank otherwise)."""
    problems, replicated = [], 0
    for p in pm.module.parameters():
        if not is_tp_sharded(p) or p.numel() == 0:
            continue
        name, placement = pm.tensors.name(p), pm.tensors.placement(p)
        expected = take(want[name], placement)
        if placement.replicas > 1:
            replicated += 1
        if not torch.allclose(p.detach().float(), expected.float(), rtol=RTOL, atol=ATOL):
            problems.append(f"rank {world.rank}: {name} (replicas {placement.replicas}) differs by "
                            f"{float((p.detach() - expected).abs().max()):.3g}")
    every = [q for mine in world.allgather_object(problems) for q in mine]
    if every:
        raise AssertionError(f"{what}: {len(every)} slice(s) differ: " + "; ".join(every[:3]))
    return replicated


def _replicated_count(world: Any, pm: ParallelModel, kv_layers: int) -> None:
    """Every rank holds ``kv_layers`` replicated key/value weights (the layout replicates)."""
    got = sum(1 for p in pm.module.parameters() if is_tp_sharded(p) and pm.tensors.placement(p).replicas > 1
              and pm.tensors.name(p).endswith(".weight"))
    every = world.allgather_object(got)
    if set(every) != {kv_layers}:
        raise AssertionError(f"replicated key/value weights per rank {every}, expected {kv_layers}")


def layouts(backend: str, cases: list[list[Any]]) -> None:
    """Each case is ``[case, layout fields, replicated key/value weights per rank]``: 3 steps, every
    whole parameter and every rank's own slices equal to one process."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    references: dict[tuple[str, float], tuple[list[float], dict]] = {}
    for case, fields, kv_layers in cases:
        clip = fields.get("gradient_clipping", 0.0)
        if (case, clip) not in references:
            references[case, clip] = one_process(case, data, clip)
        want_losses, want_params = references[case, clip]
        pm = parallelize(build(case), OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
        what = f"{case} {pm.layout.describe()}"
        _replicated_count(world, pm, kv_layers)
        _train(pm, data, want_losses, what)
        checked = compare(world, whole(pm), want_params, what)
        slices = own_slices(world, pm, want_params, what) if pm.layout.zero_stage != 3 else 0
        pm.groups.free()
        if world.rank == 0:
            print(f"OK {what}: 3 losses, {checked} parameters and {slices} replicated key/value slices per rank "
                  f"equal to one process", flush=True)


def gradients(backend: str, cases: list[str]) -> None:
    """One forward and backward of the whole batch through the tp4 model (dp1): every rank's gradient
    of every parameter, its own slice for a split one (each replica of a key/value head: the sum over
    the replicas' query heads), equals the same part of the one-process gradient."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    ids = batches()[0]
    for case in cases:
        ref = build(case)
        ref(input_ids=ids, labels=ids).loss.backward()
        want = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        pm = parallelize(build(case), OPTIMIZER, ParallelLayout(tp=world.size), **OPT_ARGS)
        pm.loss_fn(pm.module(ids), ids).backward()  # train_step's forward and loss, no optimizer
        problems, replicated = [], 0
        for p in pm.module.parameters():
            name, placement = pm.tensors.name(p), pm.tensors.placement(p)
            expected = take(want[name], placement) if is_tp_sharded(p) else want[name]
            replicated += int(placement.replicas > 1)
            if p.grad is None or not torch.allclose(p.grad, expected, rtol=RTOL, atol=ATOL):
                diff = "no gradient" if p.grad is None else f"{float((p.grad - expected).abs().max()):.3g}"
                problems.append(f"rank {world.rank}: gradient of {name} (replicas {placement.replicas}): {diff}")
        every = [q for mine in world.allgather_object(problems) for q in mine]
        if every:
            raise AssertionError(f"{case} tp{world.size}: {len(every)} gradient(s) differ: " + "; ".join(every[:3]))
        pm.groups.free()
        if world.rank == 0:
            print(f"OK {case} tp{world.size}: every gradient equal to one process ({replicated} replicated "
                  f"key/value tensors per rank)", flush=True)


def meta_build(backend: str, cases: list[list[Any]]) -> None:
    """Built on the meta device: the seeded build's weights bit for bit, then trained as one process."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    for case, fields in cases:
        initial = {n: p.detach().clone() for n, p in build(case).named_parameters()}
        pm = parallelize(build(case, meta=True), OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
        what = f"meta {case} {pm.layout.describe()}"
        if any(p.is_meta for p in pm.module.parameters()):
            raise AssertionError(f"{what}: a parameter is still on the meta device")
        checked = compare(world, whole(pm), initial, f"{what} initial weights", exact=True)
        if pm.layout.zero_stage != 3:
            own_slices(world, pm, initial, f"{what} initial slices")
        want_losses, want_params = one_process(case, data)
        _train(pm, data, want_losses, what)
        compare(world, whole(pm), want_params, f"{what} trained")
        pm.groups.free()
        if world.rank == 0:
            print(f"OK {what}: {checked} tensors equal to the seeded build, trained as one process", flush=True)


def _shared_dir(world: Any) -> Path:
    path = tempfile.mkdtemp(prefix="shardwise_kv_") if world.rank == 0 else None
    return Path(world.broadcast_object(path, 0))


def pretrained(backend: str, case: str = "qwen3-kv2") -> None:
    """3 steps at tp4, ``save_pretrained``: ``from_pretrained`` in one process holds the one-process
    trained model (the original, un-replicated key/value tensors); ``weights=`` of that directory at
    tp4 into a model of another seed holds it too, on every rank's own slices."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    want_losses, want_params = one_process(case, data)
    pm = parallelize(build(case), OPTIMIZER, ParallelLayout(tp=world.size), **OPT_ARGS)
    _train(pm, data, want_losses, f"{case} tp{world.size}")
    directory = _shared_dir(world) / "export"
    pm.save_pretrained(directory)
    pm.groups.free()
    world.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    reloaded = {n: p.detach() for n, p in loaded.named_parameters()}
    compare(world, reloaded, want_params, f"{case} tp{world.size} save_pretrained -> from_pretrained")
    back = parallelize(build(case, seed=5, meta=True), OPTIMIZER, ParallelLayout(tp=world.size), weights=directory,
                       **OPT_ARGS)
    compare(world, whole(back), reloaded, f"{case} weights= at tp{world.size}", exact=True)
    slices = own_slices(world, back, reloaded, f"{case} weights= at tp{world.size} slices")
    back.groups.free()
    if world.rank == 0:
        print(f"OK {case} tp{world.size} save_pretrained loads in one process as trained, and weights= at "
              f"tp{world.size} gives every rank its slices ({slices} replicated)", flush=True)


def resume(backend: str, cases: list[list[Any]]) -> None:
    """Each case ``[case, saved layout fields, resumed layout fields]``: 2 steps saved, a model of
    another seed loads the checkpoint and takes step 3, equal to one process trained 3 steps."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    root = _shared_dir(world)
    for i, (case, saved, resumed) in enumerate(cases):
        want_losses, want_params = one_process(case, data)
        first = parallelize(build(case, meta=True), OPTIMIZER, ParallelLayout(**saved), **OPT_ARGS)
        _train(first, data[:2], want_losses, f"{case} {first.layout.describe()}")
        path = first.save_checkpoint(root / f"ckpt{i}", 2, extra={"next_batch": 2})
        saved_as = first.layout.describe()
        first.groups.free()
        second = parallelize(build(case, seed=1, meta=True), OPTIMIZER, ParallelLayout(**resumed), **OPT_ARGS)
        extra = second.load_checkpoint(path)
        if extra.get("next_batch") != 2 or extra.get("step") != 2:
            raise AssertionError(f"the checkpoint says {extra}, expected step 2 and next_batch 2")
        what = f"{case} {saved_as} -> {second.layout.describe()}"
        _train(second, data, want_losses, what, start=2)
        checked = compare(world, whole(second), want_params, what)
        own_slices(world, second, want_params, what)
        second.groups.free()
        if world.rank == 0:
            print(f"OK resume {what}: step 3 and {checked} parameters equal to an uninterrupted run", flush=True)


def bad_input(backend: str) -> None:
    """3 key/value heads at tp4 (neither split nor replicated evenly), and query heads split beside key/value
    projections a plan gathers whole (nothing to replicate): refused on every rank, naming both numbers."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    _refused(world, "3 key/value heads at tp=4",
             lambda: parallelize(build("qwen3-kv3"), OPTIMIZER, ParallelLayout(tp=world.size), **OPT_ARGS),
             ["num_key_value_heads=3", f"tp={world.size}"])
    gathered = {f"layers.*.self_attn.{k}_proj": "colwise_gather_output" for k in "kv"}
    _refused(world, "query heads split beside gathered key/value projections at tp=4",
             lambda: parallelize(build("qwen3-kv2"), OPTIMIZER, ParallelLayout(tp=world.size), tp_plan=gathered,
                                 **OPT_ARGS), ["num_key_value_heads=2", f"tp={world.size}", "q_proj"])
