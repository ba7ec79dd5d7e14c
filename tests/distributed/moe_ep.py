"""Expert parallelism on Hugging Face MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss) vs one process.

Every rank builds the same tiny model (fixed seed). The one-process reference runs
the whole global batch through Hugging Face's own forward (its loss includes the
load-balancing term where the family has one). The expert-parallel copy, split by
:func:`apply_expert_parallel` over the ep ranks, takes this rank's slice of the batch
and adds :class:`LoadBalancingLoss`'s term; per-token logits, the dp-mean loss and
every gradient (dense ones averaged over dp, expert slices by
:func:`reduce_expert_gradients`) must equal the reference's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import shardwise
from shardwise.adapters.torch.parallel.experts.sharding import (apply_expert_parallel, ep_plan_of, expert_parameters,
                                                               local_squared_norm, reduce_expert_gradients)
from shardwise.adapters.torch.parallel.grad_average import average_gradients
from shardwise.core.mesh_groups import build_groups
from shardwise.adapters.torch.parallel.experts.router_balance import LoadBalancingLoss
from shardwise.adapters.torch.parallel.tp_apply import placement_of
from shardwise.core.errors import ConfigError
from shardwise.core.layout import ParallelLayout

RTOL, ATOL = 2e-5, 2e-6
SEQ, VOCAB, PER_RANK = 16, 128, 2

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
               max_position_embeddings=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_FAMILIES: dict[str, Any] = {
    "mixtral": lambda e: dict(num_key_value_heads=2, num_local_experts=e, num_experts_per_tok=2,
                              intermediate_size=64, output_router_logits=True, router_aux_loss_coef=0.02),
    "qwen3_moe": lambda e: dict(num_key_value_heads=2, num_experts=e, num_experts_per_tok=2, head_dim=16,
                                intermediate_size=64, moe_intermediate_size=32, output_router_logits=True,
                                router_aux_loss_coef=0.02),
    # MLA attention, one shared expert, a sigmoid router with a score-correction bias, no aux loss
    "deepseek_v3": lambda e: dict(num_key_value_heads=4, n_routed_experts=e, num_experts_per_tok=2,
                                  moe_intermediate_size=32, intermediate_size=64, n_shared_experts=1,
                                  first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    # clamped SwiGLU with expert biases, a router with a bias, sliding and full attention layers
    "gpt_oss": lambda e: dict(num_key_value_heads=2, num_local_experts=e, num_experts_per_tok=2,
                              intermediate_size=64, head_dim=16, sliding_window=8, output_router_logits=True,
                              router_aux_loss_coef=0.02),
}


def build(family: str, experts: int = 4, seed: int = 0) -> torch.nn.Module:
    """A tiny ``family`` model with ``experts`` experts per MoE layer, the same on every rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **_COMMON, **_FAMILIES[family](experts))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # give zero-initialised biases values, so that they are exercised
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("_bias", "router.bias", "e_score_correction_bias")):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    return model


def _batch(world: int, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=gen)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, one-process {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        raise AssertionError(f"{what}: differs from one process by {float((got - want).abs().max()):.3g}")


def _slice(full: torch.Tensor, p: torch.nn.Parameter, name: str) -> torch.Tensor:
    placement = placement_of(p, name)
    if placement.dim is None:
        return full
    (a, b), = placement.ranges()
    return full.narrow(placement.dim, a, b - a)


def module_level(backend: str, cases: list[list[Any]]) -> None:
    """Each case ``[family, ep, experts]`` or ``[family, ep, experts, "skewed"]``: :func:`check_module` on
    dp = world; rank 0 prints a line per case."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    for family, ep, experts, *skewed in cases:
        check_module(world, family, ep, experts, skewed=bool(skewed))


def check_module(world: Any, family: str, ep: int, experts: int = 4, skewed: bool = False) -> None:
    """Logits, loss (aux included) and gradients of ``family`` split over ep, dp = world, vs one process.

    ``skewed``: the routers' weights are zero, so every token ties and goes to the same top-k
    experts (torch's top-k picks experts 6 and 5 of 8: both on the last of 4 ep ranks); the
    others receive no row, run no expert and still take part in every exchange, forward and
    backward."""
    groups = build_groups(world, dp=world.size, ep=ep)
    ids = _batch(world.size)
    mine = ids.chunk(world.size)[world.rank]

    ref = build(family, experts)
    if skewed:
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name.endswith(("mlp.gate.weight", "router.weight", "router.bias")):
                    p.zero_()
    model = copy.deepcopy(ref)
    out = ref(ids, labels=ids)
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    aux = LoadBalancingLoss(model, groups.dp) if LoadBalancingLoss.wanted(model) else None
    kept = apply_expert_parallel(model, groups.ep, ep_plan_of(model), model.base_model_prefix)
    if len(kept) != len(expert_parameters(model.parameters())) or not kept:
        raise AssertionError(f"{len(kept)} expert parameters kept")
    got = model(mine, labels=mine, output_router_logits=False)
    loss = got.loss + (aux() if aux is not None else 0.0)
    _close(got.logits, out.logits.chunk(world.size)[world.rank], f"{family} ep{ep} logits")
    mean = groups.dp.allreduce(loss.detach().reshape(1), "average")
    _close(mean[0], out.loss, f"{family} ep{ep} loss")
    loss.backward()

    named = [(n, p) for n, p in model.named_parameters()]
    experts_ids = {id(p) for p in kept}
    dense = [p for _, p in named if id(p) not in experts_ids]
    average_gradients(dense, groups.dp)
    reduce_expert_gradients(kept, groups.edp, groups.ep_size)
    for name, p in named:
        if p.grad is None and ref_grads[name] is None:
            continue
        _close(p.grad, _slice(ref_grads[name], p, name), f"{family} ep{ep} gradient of {name}")
    # the global norm counts each expert once
    local = local_squared_norm([(p, p.grad) for _, p in named], groups.ep_size, torch.device("cpu"))
    total = world.allreduce(local, "sum") / groups.dp.size
    want = sum(float(g.double().pow(2).sum()) for g in ref_grads.values() if g is not None)
    _close(total.sqrt().reshape(()), torch.tensor(want).sqrt(), f"{family} ep{ep} gradient norm")
    if world.rank == 0:
        print(f"OK {family} ep{ep} edp{groups.dp.size // ep} experts{experts}{' skewed' * skewed}: logits, loss "
              f"{float(mean[0]):.6f}, {len(named)} gradients and the norm equal one process", flush=True)
    groups.free()


def indivisible(backend: str, family: str, ep: int, experts: int) -> None:
    """Experts that ep does not divide: a ConfigError on every rank naming the module."""
    world = shardwise.init(backend=backend).world
    groups = build_groups(world, dp=world.size, ep=ep)
    model = build(family, experts)
    try:
        apply_expert_parallel(model, groups.ep, ep_plan_of(model), model.base_model_prefix)
    except ConfigError as exc:
        text = str(exc)
        if "model.layers.0.mlp.experts" not in text or f"{experts} experts" not in text or f"ep={ep}" not in text:
            raise AssertionError(f"the refusal does not name the module and both numbers: {text}") from exc
        flags = world.allgather_object(True)
        if world.rank == 0 and all(flags):
            print(f"OK refused on every rank: {text}", flush=True)
        groups.free()
        return
    raise AssertionError(f"{experts} experts were split over ep={ep}")


def layout_checks(backend: str) -> None:
    """ep must divide dp: refused by the layout on every rank, before any group is built."""
    world = shardwise.init(backend=backend).world
    try:
        ParallelLayout(dp=world.size, ep=world.size + 1)
    except ConfigError as exc:
        if f"ep={world.size + 1} must divide dp={world.size}" not in str(exc):
            raise
        if world.rank == 0:
            print(f"OK refused: {exc}", flush=True)
        return
    raise AssertionError("an ep not dividing dp was accepted")


#: AdamW's eps bounds how much its division by sqrt(v) magnifies the fp32 rounding of gradients that are
#: nearly zero: at the default 1e-8, plain dp2 or tp2 training of these models without ep already ends
#: 3e-5 to 5e-5 from one process (up to half a percent of lr x steps). At 1e-6 the layouts without ep end
#: up to 3.3e-6 from it here (Mixtral dp2 x pp2), those with ep as close; parameters are compared at
#: 1e-5 absolute (a third of a percent of lr x steps), losses at ATOL.
STEPS, LR, EPS = 3, 3e-3, 1e-6
PARAM_ATOL = 1e-5


def _hf_training(model: torch.nn.Module, batches: list[torch.Tensor], clip: float, accumulation: int,
                 dp: int) -> list[float]:
    """One-process AdamW training with Hugging Face's own loss (load-balancing term included), each batch
    in ``accumulation`` micro-batches whose losses are averaged (as Hugging Face's Trainer accumulates:
    the load-balancing term is then one per micro-batch), each the union of the ``dp`` ranks' micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for ids in batches:
        total = 0.0
        for micro in _micro(ids, accumulation, dp):
            loss = model(micro, labels=micro).loss / accumulation
            loss.backward()
            total += float(loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _skew(model: torch.nn.Module) -> None:
    """Zero the routers' weights (see :func:`check_module`'s ``skewed``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight", "router.bias")):
                p.zero_()


def _route_by_token(model: torch.nn.Module) -> None:
    """Route by token (Mixtral, 4 experts, ep2): the embedding's first feature is +1 for tokens below
    VOCAB / 2 and -1 above, and the routers score experts 0, 1 (ep rank 0) by +5 that feature and experts
    2, 3 (ep rank 1) by -5 it, so that tokens above VOCAB / 2 run only on ep rank 1."""
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[: VOCAB // 2, 0] = 1.0
        embed[VOCAB // 2:, 0] = -1.0
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()
                p[:, 0] = torch.tensor([5.0, 4.9, -5.0, -4.9])


def _micro(ids: torch.Tensor, accumulation: int, dp: int = 1) -> list[torch.Tensor]:
    """The global micro-batches of ``ids`` as ``dp`` ranks each cutting their slice into ``accumulation``."""
    slices = [s.chunk(accumulation) for s in ids.chunk(dp)]
    return [torch.cat([s[i] for s in slices]) for i in range(accumulation)]


def train(backend: str, cases: list[list[Any]]) -> None:
    """Each case ``[family, experts, layout fields, options]``: ``parallelize`` + ``train_step`` for
    :data:`STEPS` AdamW steps equal one-process Hugging Face training, losses and this rank's parameters
    (expert slices too; at ZeRO-3 the whole tensors :class:`StageTensors` assembles). Options: ``param_atol``
    (default :data:`PARAM_ATOL`), ``aux`` (False: build the model without ``output_router_logits``),
    ``skewed`` (:func:`_skew`), ``by_token`` (:func:`_route_by_token`, Mixtral with 4 experts at ep2)."""
    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.adapters.torch.parallel.weights import take

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    for family, experts, fields, *options in cases:
        opts = options[0] if options else {}
        layout = ParallelLayout(**fields)
        gen = torch.Generator().manual_seed(11)
        batches = [torch.randint(0, VOCAB, (4 * layout.dp, SEQ), generator=gen) for _ in range(STEPS)]
        ref = build(family, experts)
        ref.config.output_router_logits = opts.get("aux", True) and ref.config.output_router_logits
        if opts.get("skewed"):  # the first step routes every token to the experts of one ep rank
            _skew(ref)
        if opts.get("by_token"):  # dp rank 0 runs no expert, its edp peer dp rank ep does
            _route_by_token(ref)
            rows = 4 * layout.ep  # the first ep group's samples: tokens that go to ep rank 1's experts
            batches = [torch.cat([ids[:rows] % (VOCAB // 2) + VOCAB // 2, ids[rows:]]) for ids in batches]
        pm = parallelize(copy.deepcopy(ref), torch.optim.AdamW, layout, lr=LR, eps=EPS)
        want = _hf_training(ref, batches, layout.gradient_clipping, layout.gradient_accumulation_steps, layout.dp)
        for step, ids in enumerate(batches):
            got = pm.train_step(pm.shard_batch(ids))
            _close(torch.tensor(got), torch.tensor(want[step]), f"{family} {layout.describe()} step {step} loss")
        ref.eval()
        k = layout.gradient_accumulation_steps
        with torch.no_grad():  # eval_step averages the micro-batches' losses as train_step does
            want_eval = sum(float(ref(m, labels=m).loss) for m in _micro(batches[0], k, layout.dp)) / k
        _close(torch.tensor(pm.eval_step(pm.shard_batch(batches[0]))), torch.tensor(want_eval),
               f"{family} {layout.describe()} eval_step")
        full = dict(ref.named_parameters())
        checked, worst = 0, 0.0
        if layout.zero_stage == 3:  # parameters live as shards: compare the whole tensors StageTensors assembles
            got_whole = _whole(pm)
            checked = _compare_whole(world, got_whole, ref, f"{family} {layout.describe()}",
                                     atol=opts.get("param_atol", PARAM_ATOL))
            if checked != len(full):
                raise AssertionError(f"{family} {layout.describe()}: {checked} whole tensors, the model has {len(full)}")
            worst = max((float((t - full[n].detach()).abs().max()) for n, t in got_whole.items()), default=0.0)
        for p in (pm.parameters() if layout.zero_stage != 3 else []):
            placement = pm.tensors.placement(p)
            want_p = take(full[placement.name].detach(), placement)
            diff = float((p.detach() - want_p).abs().max())
            if not torch.allclose(p.detach(), want_p, rtol=RTOL, atol=opts.get("param_atol", PARAM_ATOL)):
                raise AssertionError(f"{family} {layout.describe()} {placement.name}: differs from one-process "
                                     f"training by {diff:.3g}")
            worst, checked = max(worst, diff), checked + 1
        if world.rank == 0:
            print(f"OK train {family} experts{experts} {layout.describe()}: {STEPS} AdamW steps, losses "
                  f"{', '.join(f'{w:.5f}' for w in want)}, eval_step and {checked} parameters equal one process "
                  f"(parameters within {worst:.2g})", flush=True)
        pm.groups.free()


def refusals(backend: str) -> None:
    """What ``parallelize`` refuses with ep > 1, on every rank alike, before any exchange."""
    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from transformers import LlamaConfig, LlamaForCausalLM

    world = shardwise.init(backend=backend).world
    dense = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB))
    cases = [(copy.deepcopy(dense), dict(dp=world.size, ep=2, zero_stage=1),
              "needs a Mixture-of-Experts model with an expert-parallel plan"),
             (dense, dict(dp=world.size, ep=2), "needs a Mixture-of-Experts model with an expert-parallel plan"),
             (build("mixtral", 3), dict(dp=world.size, ep=2), "3 experts do not split over ep=2")]
    for model, layout, message in cases:
        try:
            parallelize(model, torch.optim.AdamW, layout)
        except ConfigError as exc:
            if message not in str(exc):
                raise
            if all(world.allgather_object(True)) and world.rank == 0:
                print(f"OK refused on every rank: {exc}", flush=True)
            continue
        raise AssertionError(f"{layout} was accepted")


def _whole(pm: Any) -> dict[str, torch.Tensor]:
    """The whole parameters this rank is handed by StageTensors (expert pieces gathered over ep)."""
    from shardwise.adapters.torch.parallel.full_tensors import StageTensors

    got: dict[str, torch.Tensor] = {}
    StageTensors(pm, optimizer=False, masters=False).stream(lambda e, t: got.__setitem__(e.key, t.clone()))
    return got


def _compare_whole(world: Any, got: dict[str, torch.Tensor], want: torch.nn.Module, what: str,
                   atol: float = 0.0) -> int:
    """Compare the whole tensors handed to this rank with ``want``'s (exactly when ``atol`` is 0); returns how
    many tensors all ranks compared together."""
    ref = dict(want.named_parameters())
    for name, t in got.items():
        w = ref[name].detach()
        same = torch.equal(t, w) if not atol else torch.allclose(t, w, rtol=RTOL, atol=atol)
        if not same:
            raise AssertionError(f"{what}: {name} differs by {float((t - w).abs().max()):.3g}")
    return int(world.allreduce(torch.tensor([float(len(got))]), "sum")[0])


def lifecycle(backend: str, directory: str) -> None:
    """4 ranks, Mixtral with 8 experts: a meta build at ep4 starts from the one-process initial weights;
    a checkpoint saved at ep4 after one step resumes at dp4 x ep2 equal to uninterrupted one-process
    training; ``save_pretrained`` at ep2 loads with ``from_pretrained``; ``weights=`` of that directory
    gives a meta build at ep4 the same weights."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from shardwise.adapters.torch.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    root = Path(directory)
    ep4, ep2 = ParallelLayout(dp=world.size, ep=world.size), ParallelLayout(dp=world.size, ep=2)
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, VOCAB, (4 * world.size, SEQ), generator=gen) for _ in range(STEPS)]
    ref = build("mixtral", 8)
    want = _hf_training(copy.deepcopy(ref), batches, 0.0, 1, world.size)
    trained = copy.deepcopy(ref)
    _hf_training(trained, batches, 0.0, 1, world.size)

    def meta(seed: int = 0) -> torch.nn.Module:
        with torch.device("meta"):
            return build("mixtral", 8, seed)

    torch.manual_seed(0)
    pm = parallelize(meta(), torch.optim.AdamW, ep4, lr=LR, eps=EPS)
    if any(p.is_meta for p in pm.module.parameters()):
        raise AssertionError("a parameter is still on the meta device")
    n = _compare_whole(world, _whole(pm), ref, "meta build at ep4, initial weights")
    if n != len(dict(ref.named_parameters())):
        raise AssertionError(f"{n} tensors compared, the model has {len(dict(ref.named_parameters()))}")
    _close(torch.tensor(pm.train_step(pm.shard_batch(batches[0]))), torch.tensor(want[0]), "ep4 step 0")
    ckpt = pm.save_checkpoint(root / "ckpt", 1)
    pm.groups.free()

    other = parallelize(meta(seed=5), torch.optim.AdamW, ep2, lr=LR, eps=EPS)
    other.load_checkpoint(ckpt)
    for step in range(1, STEPS):
        got = other.train_step(other.shard_batch(batches[step]))
        _close(torch.tensor(got), torch.tensor(want[step]), f"resumed at {ep2.describe()} step {step}")
    _compare_whole(world, _whole(other), trained, "resumed at ep2, trained weights", atol=PARAM_ATOL)
    export = root / "export"
    other.save_pretrained(export)
    exported = _whole(other)
    other.groups.free()
    if world.rank == 0:
        loaded = dict(AutoModelForCausalLM.from_pretrained(str(export)).named_parameters())
        bad = [k for k, v in dict(trained.named_parameters()).items()
               if not torch.allclose(loaded[k], v, rtol=RTOL, atol=PARAM_ATOL)]
        if bad or set(loaded) != set(dict(trained.named_parameters())):
            raise AssertionError(f"from_pretrained of the export differs: {bad}")
    world.barrier()

    again = parallelize(meta(seed=9), torch.optim.AdamW, ep4, weights=str(export), lr=LR, eps=EPS)
    mine = _whole(again)
    every = world.allgather_object({k: v for k, v in exported.items()})
    whole = {k: v for part in every for k, v in part.items()}
    for k, v in mine.items():
        if not torch.equal(v, whole[k]):
            raise AssertionError(f"weights= at ep4: {k} differs from the exported tensor")
    again.groups.free()
    if world.rank == 0:
        print(f"OK lifecycle mixtral experts8: meta build at {ep4.describe()} ({n} tensors), checkpoint "
              f"{ep4.describe()} -> {ep2.describe()} resumed, save_pretrained -> from_pretrained, weights= at "
              f"{ep4.describe()}", flush=True)


def zero_resume(backend: str, directory: str) -> None:
    """4 ranks, Mixtral with 4 experts: one step at dp4 x ep2 ZeRO-3 (experts sharded over edp2), saved;
    ``save_pretrained`` there loads with ``from_pretrained``; a model from another seed at dp4 x ep4
    ZeRO-1 loads the checkpoint and trains on, equal to uninterrupted one-process AdamW training."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from shardwise.adapters.torch.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    root = Path(directory)
    saved_at = ParallelLayout(dp=world.size, ep=2, zero_stage=3, gradient_clipping=0.05)
    resumed_at = ParallelLayout(dp=world.size, ep=4, zero_stage=1, gradient_clipping=0.05)
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, VOCAB, (4 * world.size, SEQ), generator=gen) for _ in range(STEPS)]
    ref = build("mixtral", 4)
    after_one = copy.deepcopy(ref)
    want = _hf_training(copy.deepcopy(ref), batches, 0.05, 1, world.size)
    _hf_training(after_one, batches[:1], 0.05, 1, world.size)
    trained = copy.deepcopy(ref)
    _hf_training(trained, batches, 0.05, 1, world.size)

    pm = parallelize(copy.deepcopy(ref), torch.optim.AdamW, saved_at, lr=LR, eps=EPS)
    _close(torch.tensor(pm.train_step(pm.shard_batch(batches[0]))), torch.tensor(want[0]),
           f"{saved_at.describe()} step 0")
    ckpt = pm.save_checkpoint(root / "ckpt", 1)
    export = root / "export"
    pm.save_pretrained(export)
    pm.groups.free()
    if world.rank == 0:
        loaded = dict(AutoModelForCausalLM.from_pretrained(str(export)).named_parameters())
        expected = dict(after_one.named_parameters())
        bad = [k for k, v in expected.items() if not torch.allclose(loaded[k], v, rtol=RTOL, atol=PARAM_ATOL)]
        if bad or set(loaded) != set(expected):
            raise AssertionError(f"from_pretrained of the {saved_at.describe()} export differs: {bad}")
    world.barrier()

    other = parallelize(build("mixtral", 4, seed=5), torch.optim.AdamW, resumed_at, lr=LR, eps=EPS)
    extra = other.load_checkpoint(ckpt)
    if extra.get("step") != 1:
        raise AssertionError(f"the checkpoint says {extra}, expected step 1")
    for step in range(1, STEPS):
        got = other.train_step(other.shard_batch(batches[step]))
        _close(torch.tensor(got), torch.tensor(want[step]), f"resumed at {resumed_at.describe()} step {step}")
    n = _compare_whole(world, _whole(other), trained, f"resumed at {resumed_at.describe()}", atol=PARAM_ATOL)
    if n != len(dict(trained.named_parameters())):
        raise AssertionError(f"{n} whole tensors, the model has {len(dict(trained.named_parameters()))}")
    other.groups.free()
    # and at ep2 ZeRO-2 from a model of another seed: experts sharded over edp2 again, read from the pieces
    again_at = ParallelLayout(dp=world.size, ep=2, zero_stage=2, gradient_clipping=0.05)
    again = parallelize(build("mixtral", 4, seed=7), torch.optim.AdamW, again_at, lr=LR, eps=EPS)
    again.load_checkpoint(ckpt)
    _close(torch.tensor(again.train_step(again.shard_batch(batches[1]))), torch.tensor(want[1]),
           f"resumed at {again_at.describe()} step 1")
    again.groups.free()
    if world.rank == 0:
        print(f"OK zero_resume mixtral experts4: checkpoint {saved_at.describe()} -> {resumed_at.describe()} "
              f"resumed ({n} tensors) and -> {again_at.describe()}, save_pretrained at {saved_at.describe()} "
              "-> from_pretrained", flush=True)


def _afmoe() -> torch.nn.Module:
    """A tiny AFMoE (its router's ``mlp.expert_bias`` is an ``nn.Parameter(requires_grad=False)``), with that
    bias given values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("afmoe", **{**_COMMON, "max_position_embeddings": 256}, num_key_value_heads=2,
                               intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2, num_dense_layers=1, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def frozen_under_zero(backend: str, directory: str) -> None:
    """2 ranks, dp2 ZeRO-3 (and ZeRO-1) of a model with a frozen parameter (AFMoE's ``expert_bias``): the
    parameter stays whole on every rank, ``save_pretrained`` writes it (``from_pretrained`` gets its
    value), and a checkpoint holds it: a model whose frozen parameter differs takes it back on load,
    at ZeRO-3 and without ZeRO."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from shardwise.adapters.torch.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    root = Path(directory)
    ref = _afmoe()
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    if not frozen:
        raise AssertionError("the AFMoE model has no frozen parameter")
    ids = torch.randint(0, VOCAB, (2 * world.size, SEQ), generator=torch.Generator().manual_seed(3))
    for stage in (3, 1):
        layout = ParallelLayout(dp=world.size, zero_stage=stage)
        pm = parallelize(copy.deepcopy(ref), torch.optim.SGD, layout, lr=0.1, momentum=0.9)
        pm.train_step(pm.shard_batch(ids))
        export = root / f"export-zero{stage}"
        pm.save_pretrained(export)
        ckpt = pm.save_checkpoint(root / f"ckpt-zero{stage}", 1)
        got = _whole(pm)
        every = world.allgather_object(sorted(got))
        held = {n for names in every for n in names}
        missing = sorted(set(frozen) - held)
        if missing:
            raise AssertionError(f"{layout.describe()}: StageTensors lacks the frozen {missing}")
        for n, t in got.items():
            if n in frozen and not torch.equal(t, frozen[n]):
                raise AssertionError(f"{layout.describe()}: frozen {n} changed")
        pm.groups.free()
        if world.rank == 0:
            loaded = dict(AutoModelForCausalLM.from_pretrained(str(export)).named_parameters())
            for n, v in frozen.items():
                if n not in loaded or not torch.equal(loaded[n], v):
                    raise AssertionError(f"save_pretrained at {layout.describe()} lost the frozen {n}")
        world.barrier()
        for into in (ParallelLayout(dp=world.size, zero_stage=3), ParallelLayout(dp=world.size)):
            other_model = copy.deepcopy(ref)
            with torch.no_grad():
                for n, p in other_model.named_parameters():
                    if not p.requires_grad:
                        p.fill_(7.0)
            other = parallelize(other_model, torch.optim.SGD, into, lr=0.1, momentum=0.9)
            other.load_checkpoint(ckpt)
            mine = {n: p for n, p in other_model.named_parameters() if n in frozen}
            for n, p in mine.items():
                if not torch.equal(p.detach(), frozen[n]):
                    raise AssertionError(f"checkpoint of {layout.describe()} loaded at {into.describe()}: frozen "
                                         f"{n} is {p.detach().reshape(-1)[:3].tolist()}, saved as "
                                         f"{frozen[n].reshape(-1)[:3].tolist()}")
            other.groups.free()
        if world.rank == 0:
            print(f"OK frozen under {layout.describe()}: {', '.join(sorted(frozen))} kept whole, written by "
                  "save_pretrained and save_checkpoint, loaded at zero=3 and zero=0", flush=True)
