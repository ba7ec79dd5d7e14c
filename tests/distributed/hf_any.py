"""Any Hugging Face causal LM through ``parallelize``, dense and Mixture-of-Experts, against one process.

The models are tiny configs of eight families (:data:`CONFIGS`): Qwen3, Gemma 3 (sliding and
full attention), Phi-3 and OLMo-2 (dense); Mixtral, Qwen3-MoE, DeepSeek-V3 (multi-head latent
attention, a shared expert, a sigmoid router with a score-correction bias, a dense first layer)
and gpt-oss (attention sinks and biases, sliding and full layers) with 4 experts, top-2, and
``output_router_logits=True`` so that Hugging Face's loss includes the router's load-balancing
loss. Nothing in them is a shardwise rule table: ``parallelize`` reads the model's own plans.

Every scenario compares with one process: the same model built after the same seed and trained
by Hugging Face's own loss (``model(input_ids=ids, labels=ids).loss``) on the whole global batch
with SGD and momentum. The losses of all steps and every parameter after them, gathered whole by
:class:`StageTensors` (each one handed to exactly one rank), must be within
:data:`RTOL` / :data:`ATOL` of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

import shardwise
from shardwise.adapters.torch.parallel.full_tensors import StageTensors
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.core.errors import ConfigError
from shardwise.core.layout import ParallelLayout

#: Issue 53's tolerance: rtol 2e-5 in fp32, with hf_parallel's atol.
RTOL, ATOL = 2e-5, 2e-6
STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 256
#: SGD with momentum, as hf_parallel: AdamW divides each gradient by sqrt(v), so an element whose gradient
#: is fp32 rounding noise (a k_proj bias, a unit that is nearly off) moves by up to lr whatever the noise
#: was; a one-process run that only splits its batch in two accumulated halves already breaks rtol 2e-5
#: that way. benchmarks/hf_models.py measures AdamW against the fp32 floor instead.
OPTIMIZER, OPT_ARGS = torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}

_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, attention_dropout=0.0, use_cache=False)
_MOE = dict(num_experts_per_tok=2, output_router_logits=True)

#: model type -> the keys of its tiny config (on top of the type's defaults).
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": _SHAPE,
    "gemma3_text": {**_SHAPE, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "phi3": {**{k: v for k, v in _SHAPE.items() if k != "head_dim"}, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "olmo2": {**{k: v for k, v in _SHAPE.items() if k != "head_dim"}, "pad_token_id": 0, "eos_token_id": 2},
    # per-head attention sinks split by HF's "colwise" on a parameter, beside "local_params"
    "granite_swa": {**{k: v for k, v in _SHAPE.items() if k != "head_dim"}, "sliding_window": 8,
                    "layer_types": ["full_attention", "sliding_attention"], "layer_rope_theta": [10000.0, 10000.0],
                    "embedding_multiplier": 2.0, "logits_scaling": 1.5, "bos_token_id": 1, "eos_token_id": 2},
    "mixtral": {**_SHAPE, **_MOE, "num_local_experts": 4, "router_jitter_noise": 0.0, "bos_token_id": 1,
                "eos_token_id": 2},
    "qwen3_moe": {**_SHAPE, **_MOE, "num_local_experts": 4, "moe_intermediate_size": 32},
    "deepseek_v3": {**_SHAPE, **_MOE, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
                    "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "qk_head_dim": 16, "v_head_dim": 16, "head_dim": 8, "bos_token_id": 1, "eos_token_id": 2},
    "gpt_oss": {**_SHAPE, **_MOE, "num_local_experts": 4, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
}


def config(model_type: str, **changes: Any) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **changes})
    cfg.dtype = torch.float32
    return cfg


def build(model_type: str, seed: int = 0, meta: bool = False, cfg: Any = None) -> torch.nn.Module:
    """The tiny ``model_type`` after ``torch.manual_seed(seed)`` (on the meta device: unallocated)."""
    from transformers import AutoModelForCausalLM

    cfg = cfg if cfg is not None else config(model_type)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def batches(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def one_process(model_type: str, data: list[torch.Tensor], cfg: Any = None,
                clip: float = 0.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Hugging Face's own training in one process (of ``cfg``, else the type's tiny config; the gradient
    norm clipped to ``clip`` when given): the losses, and the parameters after."""
    model = build(model_type, cfg=cfg)
    opt = OPTIMIZER(model.parameters(), **OPT_ARGS)
    losses = []
    for ids in data:
        out = model(input_ids=ids, labels=ids)
        if getattr(model.config, "output_router_logits", False) and getattr(out, "aux_loss", None) is None \
                and model_type != "deepseek_v3":
            raise AssertionError(f"{model_type}: Hugging Face's loss has no aux loss to compare with")
        out.loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def whole(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """The whole parameters this rank is handed (each parameter lands on exactly one rank of its stage)."""
    got: dict[str, torch.Tensor] = {}
    StageTensors(pm, optimizer=False, masters=False).stream(lambda e, t: got.__setitem__(e.key, t.clone()))
    return got


def _close(got: float, want: float, what: str) -> None:
    if abs(got - want) > ATOL + RTOL * abs(want):
        raise AssertionError(f"{what}: got {got!r}, one-process {want!r} (rel {abs(got - want) / abs(want):.2g})")


def compare(world: Any, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
            exact: bool = False) -> int:
    """Every tensor a rank holds equals the one-process one and every parameter is held by some rank;
    otherwise the same AssertionError, naming the worst tensor, on every rank. Returns the count."""
    problems: list[tuple[float, str]] = []
    for name, t in got.items():
        w = want.get(name)
        if w is None or t.shape != w.shape:
            problems.append((float("inf"), f"{name} is {tuple(t.shape)}, one-process " +
                             (f"{tuple(w.shape)}" if w is not None else "has no such parameter")))
            continue
        same = torch.equal(t, w) if exact else torch.allclose(t.float(), w.float(), rtol=RTOL, atol=ATOL)
        if not same:
            diff = (t.float() - w.float()).abs()
            off = int((diff > (0 if exact else ATOL) + (0 if exact else RTOL) * w.float().abs()).sum())
            rel = float(diff.max()) / max(float(w.float().abs().max()), 1e-30)
            problems.append((rel, f"{name} differs from one process by {float(diff.max()):.3g} (max |value| "
                                  f"{float(w.abs().max()):.3g}, {off} of {w.numel()} elements off)"))
    every = world.allgather_object((sorted(got), problems))
    held = {n for names, _ in every for n in names}
    found = sorted((p for _, mine in every for p in mine), reverse=True)
    if held != set(want):
        found.insert(0, (float("inf"), f"parameters gathered {len(held)}, the model has {len(want)}; missing "
                                       f"{sorted(set(want) - held)[:4]}"))
    if found:
        raise AssertionError(f"{what}: {len(found)} tensor(s) differ; " + "; ".join(p for _, p in found[:3]))
    return len(held)


def _train(pm: ParallelModel, data: list[torch.Tensor], want: list[float], what: str, start: int = 0) -> None:
    for step in range(start, len(data)):
        _close(pm.train_step(pm.shard_batch(data[step])), want[step], f"{what} step {step} loss")


def layouts(backend: str, cases: list[list[Any]], config_of: Callable[[str], Any] = config) -> None:
    """Each case is ``[model type, layout fields]``: 3 steps and every parameter equal to one process
    (each type built from ``config_of(type)``)."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    references: dict[str, tuple[list[float], dict]] = {}
    for model_type, fields in cases:
        if model_type not in references:
            references[model_type] = one_process(model_type, data, config_of(model_type))
        want_losses, want_params = references[model_type]
        model = build(model_type, cfg=config_of(model_type))
        pm = parallelize(model, OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
        what = f"{model_type} {pm.layout.describe()}"
        _train(pm, data, want_losses, what)
        checked = compare(world, whole(pm), want_params, what)
        pm.groups.free()
        if world.rank == 0:
            print(f"OK {what}: 3 losses and {checked} parameters equal to one process", flush=True)


def meta_build(backend: str, cases: list[list[Any]]) -> None:
    """A model built on the meta device starts from the one-process seeded build's weights bit for bit,
    leaves the generator where that build does, and trains like one process."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    for model_type, fields in cases:
        initial = {n: p.detach().clone() for n, p in build(model_type).named_parameters()}
        after_build = torch.rand(4)
        model = build(model_type, meta=True)
        pm = parallelize(model, OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
        what = f"meta {model_type} {pm.layout.describe()}"
        if not torch.equal(torch.rand(4), after_build):
            raise AssertionError(f"{what}: the generator after parallelize differs from after a normal build")
        if any(p.is_meta for p in pm.module.parameters()) or any(b.is_meta for b in pm.module.buffers()):
            raise AssertionError(f"{what}: a parameter or buffer is still on the meta device")
        checked = compare(world, whole(pm), initial, f"{what} initial weights", exact=True)
        want_losses, want_params = one_process(model_type, data)
        _train(pm, data, want_losses, what)
        compare(world, whole(pm), want_params, f"{what} trained")
        pm.groups.free()
        if world.rank == 0:
            print(f"OK {what}: {checked} tensors equal to the seeded build, trained as one process", flush=True)


def resume(backend: str, directory: str, model_type: str = "mixtral") -> None:
    """2 steps at ep4 saved; a model built from another seed at ep2 x dp2 loads it and takes step 3:
    the loss and every parameter equal to one process trained 3 steps without interruption."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    data = batches()
    want_losses, want_params = one_process(model_type, data)
    first = parallelize(build(model_type, meta=True), OPTIMIZER, ParallelLayout(dp=world.size, ep=4),
                       **OPT_ARGS)
    _train(first, data[:2], want_losses, f"{model_type} {first.layout.describe()}")
    path = first.save_checkpoint(Path(directory), 2, extra={"next_batch": 2})
    saved_as = first.layout.describe()
    first.groups.free()
    second = parallelize(build(model_type, seed=1, meta=True), OPTIMIZER,
                         ParallelLayout(dp=world.size, ep=2), **OPT_ARGS)
    extra = second.load_checkpoint(path)
    if extra.get("next_batch") != 2 or extra.get("step") != 2:
        raise AssertionError(f"the checkpoint says {extra}, expected step 2 and next_batch 2")
    what = f"{model_type} {saved_as} -> {second.layout.describe()}"
    _train(second, data, want_losses, what, start=2)
    checked = compare(world, whole(second), want_params, what)
    second.groups.free()
    if world.rank == 0:
        print(f"OK resume {what}: step 3 and {checked} parameters equal to an uninterrupted run", flush=True)


def _refused(world: Any, what: str, call: Callable[[], Any], needles: list[str]) -> None:
    """``call`` raises a ConfigError on every rank, whose message holds every one of ``needles``."""
    try:
        call()
    except ConfigError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{what} was accepted")
    every = world.allgather_object(message)
    missing = [n for n in needles if n not in message]
    if missing:
        raise AssertionError(f"{what}: the error does not say {missing}: {message}")
    if world.rank == 0:
        print(f"OK refused {what} on all {len(every)} ranks: {message.splitlines()[0]}", flush=True)


def bad_input(backend: str) -> None:
    """Experts that ep does not divide, an ep that does not divide dp, a plan style shardwise does not
    implement, a custom tp_plan naming no module: a ConfigError on every rank, not a hang."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    six = config("mixtral", num_local_experts=6)
    _refused(world, "6 experts over ep=4",
             lambda: parallelize(build("mixtral", cfg=six), OPTIMIZER, ParallelLayout(dp=world.size, ep=4),
                                 **OPT_ARGS), ["6", "ep=4"])
    _refused(world, "ep=3 on 4 ranks",
             lambda: parallelize(build("mixtral"), OPTIMIZER, ParallelLayout(dp=world.size, ep=3), **OPT_ARGS),
             ["ep=3"])
    plan = config("qwen3")
    plan.base_model_tp_plan = {**plan.base_model_tp_plan, "layers.*.mlp.down_proj": "bogus_rowwise"}
    _refused(world, "the plan style 'bogus_rowwise'",
             lambda: parallelize(build("qwen3", cfg=plan), OPTIMIZER, ParallelLayout(dp=2, tp=2), **OPT_ARGS),
             ["bogus_rowwise", "down_proj"])
    _refused(world, "a tp_plan naming no module",
             lambda: parallelize(build("qwen3"), OPTIMIZER, ParallelLayout(dp=2, tp=2), **OPT_ARGS,
                                 tp_plan={"layers.*.mlp.no_such_proj": "colwise"}), ["no_such_proj"])
