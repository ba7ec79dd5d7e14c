"""``parallelize`` on Hugging Face GPT-2 and Llama models, against one-process training.

Every rank builds the same randomly initialised model (fixed seed, no dropout)
and trains a copy of it in one process on the whole global batch with the same
optimizer; then it trains the model through ``parallelize`` with a layout and
checks the loss of every step and, where parameters are not sharded by ZeRO-3,
its own shards and stages after training against the same shards of the
one-process result.
"""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any, Optional

import torch

import shardwise
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.adapters.torch.parallel.stages import StageStack, causal_lm_stages, model_family
from shardwise.adapters.torch.parallel.tp_apply import apply_tensor_parallel
from shardwise.adapters.torch.parallel.vocab_parallel import apply_vocab_parallel
from shardwise.core.config import TrainingConfig
from shardwise.core.errors import MeshError
from shardwise.core.layout import ParallelLayout

RTOL, ATOL = 2e-5, 2e-6
STEPS, BATCH, SEQ, VOCAB = 4, 8, 16, 96
# SGD with momentum: Adam's division by sqrt(v) turns fp32 rounding of near-zero gradients into
# lr-sized parameter differences, which would force a loose tolerance.
OPTIMIZER, OPT_ARGS = torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A small causal LM of ``family`` with random weights and no dropout (``"gpt2:97"``: a vocabulary
    of 97 tokens instead of :data:`VOCAB`, the batches using the first :data:`VOCAB`; ``"llama:101:40:88"``:
    vocabulary 101, hidden size 40 and MLP size 88 instead of 32 and 64 (GPT-2: 4 x hidden);
    ``"llama-mha"``: as many key/value heads as query heads)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    family, *sizes = family.split(":")
    vocab, hidden, ffn = [int(s) for s in sizes] + [None] * (3 - len(sizes))
    vocab, hidden = vocab or VOCAB, hidden or 32
    family, mha = family.removesuffix("-mha"), family.endswith("-mha")  # 4 key/value heads: tp4 divides them
    if family == "gpt2":
        cfg = GPT2Config(n_layer=4, n_embd=hidden, n_head=4, n_inner=ffn, vocab_size=vocab, n_positions=SEQ,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    shape = dict(num_hidden_layers=4, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=4 if mha else 2,
                 intermediate_size=ffn or 64, vocab_size=vocab, max_position_embeddings=SEQ, bos_token_id=0,
                 eos_token_id=0)
    if family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        return MistralForCausalLM(MistralConfig(**shape, sliding_window=None))
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**shape))
    return LlamaForCausalLM(LlamaConfig(**shape))


def _batches(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _reference(model: torch.nn.Module, batches: list[torch.Tensor], clip: float = 0.0) -> list[float]:
    opt = OPTIMIZER(model.parameters(), **OPT_ARGS)
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _close(got: float, want: float, what: str) -> None:
    if abs(got - want) > ATOL + RTOL * abs(want):
        raise AssertionError(f"{what}: got {got!r}, one-process {want!r} (diff {abs(got - want):.3g})")


def _check_params(pm: ParallelModel, trained_ref: torch.nn.Module) -> float:
    """Compare this rank's stages and shards with the same part of the one-process model."""
    family = model_family(trained_ref)
    apply_tensor_parallel(trained_ref, family, pm.groups.tp)
    if pm.layout.vocab_parallel:
        apply_vocab_parallel(trained_ref, family, pm.groups.tp)
    stages, _ = causal_lm_stages(trained_ref, family)
    worst = 0.0
    for chunk, rng in zip(pm.chunks, pm.stage_ranges):
        ref = StageStack([stages[i] for i in rng])
        for (name, got), (ref_name, want) in zip(chunk.named_parameters(), ref.named_parameters()):
            if name != ref_name or got.shape != want.shape:
                raise AssertionError(f"parameter {name} {tuple(got.shape)} vs {ref_name} {tuple(want.shape)}")
            diff = float((got.detach() - want.detach()).abs().max())
            if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                raise AssertionError(f"parameter {name} differs from one-process training by {diff:.3g}")
            worst = max(worst, diff)
    return worst


def _run(family: str, layout: Any, clip: float = 0.0, **kw: Any) -> tuple[ParallelModel, float]:
    batches = _batches()
    ref = build(family)
    want = _reference(copy.deepcopy(ref), batches, clip)
    pm = parallelize(ref, OPTIMIZER, layout, **OPT_ARGS, **kw)
    worst = 0.0
    for step, ids in enumerate(batches):
        got = pm.train_step(pm.shard_batch(ids))
        _close(got, want[step], f"{family} {pm.layout.describe()} step {step} loss")
        worst = max(worst, abs(got - want[step]))
    if pm.layout.zero_stage != 3:
        trained = build(family)
        _reference(trained, batches, clip)
        worst = max(worst, _check_params(pm, trained))
    pm.groups.free()
    return pm, worst


def layouts(backend: str, cases: list[list[Any]]) -> None:
    """Each case is ``[family, layout fields]``; rank 0 prints one line per case."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    for family, fields in cases:
        pm, worst = _run(family, ParallelLayout(**fields), clip=fields.get("gradient_clipping", 0.0))
        if world.rank == 0:
            print(f"OK {family} {pm.layout.describe()}: max diff vs one process {worst:.2e}", flush=True)


def deepspeed_config(backend: str, mesh: bool = False) -> None:
    """A DeepSpeed JSON (ZeRO-2, accumulation 2, clipping) trains as the same explicit layout and as one process.

    ``mesh``: on 4 ranks, its ``pipeline`` and ``tensor_parallel`` sections instead of ZeRO make it
    tp2 x pp2 with the vocabulary split and each block recomputed, the accumulation steps running as
    the pipeline's micro-batches (DeepSpeed's pipeline engine).
    """
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    ds = {"train_batch_size": BATCH, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
          "zero_optimization": {"stage": 0 if mesh else 2, "reduce_bucket_size": 20000},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "steps_per_print": 10}
    if mesh:
        ds.update(pipeline={"stages": 2, "activation_checkpoint_interval": 1},
                  tensor_parallel={"autotp_size": 2, "vocab_parallel_lm_head": True})
    path = f"/tmp/shardwise_ds_{world.size}{'_mesh' * mesh}.json"
    if world.rank == 0:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(ds, fh)
    world.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_ds, _ = _run("gpt2", path, clip=0.05)
    if not any("optimizer" in str(w.message) for w in caught):
        raise AssertionError("the ignored DeepSpeed 'optimizer' key gave no warning")
    explicit = ParallelLayout(dp=world.size, zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=0.05,
                              bucket_bytes=80000)
    if mesh:
        explicit = ParallelLayout(dp=world.size // 4, tp=2, pp=2, micro_batches=2, gradient_clipping=0.05,
                                  bucket_bytes=80000, vocab_parallel=True, activation_checkpointing=True)
    if from_ds.layout != explicit:
        raise AssertionError(f"DeepSpeed layout {from_ds.layout} != explicit {explicit}")
    _run("gpt2", explicit, clip=0.05)
    expected = ParallelLayout.from_config(TrainingConfig.from_deepspeed(ds), world.size)
    if expected != explicit:
        raise AssertionError(f"{expected} != {explicit}")
    if world.rank == 0:
        print(f"OK deepspeed {from_ds.layout.describe()}", flush=True)


def bad_layout(backend: str, layout: Optional[dict] = None) -> None:
    """A layout that does not fill the world fails on every rank with a clear error, not a hang."""
    world = shardwise.init(backend=backend).world
    try:
        parallelize(build("gpt2"), torch.optim.AdamW, ParallelLayout(**(layout or {"dp": world.size + 1})))
    except MeshError as exc:
        if "needs" not in str(exc):
            raise
        if world.rank == 0:
            print(f"OK refused: {exc}", flush=True)
        return
    raise AssertionError("a layout for the wrong world size was accepted")


def example(argv: list[str]) -> None:
    """Run ``examples/hf_causal_lm.py`` with ``argv``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import hf_causal_lm

    sys.argv = ["hf_causal_lm.py", *argv]
    hf_causal_lm.main()


def bf16(backend: str) -> None:
    """bf16 parameters with ZeRO's fp32 master weights: trains, and stays near fp32 training."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches()
    ref = build("gpt2")
    want = _reference(copy.deepcopy(ref), batches)
    pm = parallelize(ref, torch.optim.SGD, ParallelLayout(dp=world.size, zero_stage=1, precision="bf16"),
                     **OPT_ARGS)
    if {p.dtype for p in pm.parameters()} != {torch.bfloat16}:
        raise AssertionError(f"parameters are {({p.dtype for p in pm.parameters()})}, expected bfloat16")
    got = [pm.train_step(pm.shard_batch(ids)) for ids in batches]
    for step, (g, w) in enumerate(zip(got, want)):
        if abs(g - w) > 0.05 * abs(w):
            raise AssertionError(f"bf16 step {step}: loss {g} vs fp32 {w}")
    if world.rank == 0:
        print(f"OK bf16 losses {[round(v, 4) for v in got]} vs fp32 {[round(v, 4) for v in want]}", flush=True)


def mixed_precision(backend: str, cases: list[list[Any]], steps: int = 20) -> None:
    """bf16 and fp16 (dynamic loss scale) without ZeRO and with it: losses within 2% of one fp32
    process over ``steps`` steps; an overflow forced on one rank is skipped on every rank."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = [_batches(seed=s)[i] for s in range(1, 1 + -(-steps // STEPS)) for i in range(STEPS)][:steps]
    for family, fields in cases:
        ref = build(family)
        want = _reference(copy.deepcopy(ref), batches, fields.get("gradient_clipping", 0.0))
        pm = parallelize(ref, OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
        forced = steps // 2
        poisoned = {"step": -1}
        if fields["precision"] == "fp16" and world.rank == world.size - 1:
            p = pm.parameters()[0]
            p.register_hook(lambda g: g * float("inf") if poisoned["step"] == forced else g)
        got = []
        for step, ids in enumerate(batches):
            poisoned["step"] = step
            scaler = getattr(pm.optimizer, "loss_scaler", None)
            before = scaler.skipped_steps if scaler is not None else 0
            got.append(pm.train_step(pm.shard_batch(ids)))
            skipped = (scaler.skipped_steps if scaler is not None else 0) - before
            every = world.allgather_object(skipped)
            if len(set(every)) != 1:
                raise AssertionError(f"{pm.layout.describe()} step {step}: ranks skipped differently: {every}")
            if step == forced and fields["precision"] == "fp16" and every[0] != 1:
                raise AssertionError(f"{pm.layout.describe()}: the overflow forced at step {step} was not skipped")
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        if worst > 0.02:
            raise AssertionError(f"{pm.layout.describe()}: losses {got} vs fp32 {want} (worst {worst:.3%})")
        scaler = getattr(pm.optimizer, "loss_scaler", None)
        if world.rank == 0:
            print(f"OK {fields['precision']} {pm.layout.describe()}: {steps} steps, worst loss difference from fp32 "
                  f"{worst:.2%}, skipped steps {scaler.skipped_steps if scaler else 0}, final loss scale "
                  f"{scaler.scale if scaler else 1.0:g}", flush=True)
        pm.groups.free()


def zero_pipeline_state(backend: str) -> None:
    """dp2 x pp2 with ZeRO-1 and AdamW: each rank holds about half of its stage's optimizer state."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    pm = parallelize(build("gpt2"), torch.optim.AdamW, ParallelLayout(dp=2, pp=2, micro_batches=2, zero_stage=1),
                     lr=1e-3)
    pm.train_step(pm.shard_batch(_batches()[0]))
    stage = sum(p.numel() for p in pm.module.parameters())
    held = pm.optimizer.measured_state_bytes().optimizer_states  # fp32 masters are the shards: Adam's two moments
    fraction = held / (2 * 4 * stage)
    every = world.allgather_object(round(fraction, 3))
    if not all(0.45 <= f <= 0.55 for f in every):
        raise AssertionError(f"ZeRO-1 with pp2: ranks hold {every} of their stage's Adam state, expected about 1/2")
    if world.rank == 0:
        print(f"OK zero-1 pp2: each rank holds {every} of its stage's Adam state (dp=2)", flush=True)


class _Residual(torch.nn.Module):
    """No config, not a Sequential: ``parallelize`` trains it whole, each block a ZeRO-3 unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


def any_module(backend: str, stages: list[int]) -> None:
    """Any ``nn.Module`` (with its ``loss_fn``), and a Hugging Face model whose config has no plan (OPT),
    under ZeRO ``stages`` on every rank, equal to one-process training (losses and parameters)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 6, generator=gen) for _ in range(STEPS)]
    ys = [torch.randn(8, 2, generator=gen) for _ in range(STEPS)]
    mse = torch.nn.functional.mse_loss
    for stage in stages:
        torch.manual_seed(0)
        model = _Residual()
        ref = copy.deepcopy(model)
        opt = OPTIMIZER(ref.parameters(), **OPT_ARGS)
        pm = parallelize(model, OPTIMIZER, ParallelLayout(dp=world.size, zero_stage=stage), loss_fn=mse, **OPT_ARGS)
        for step, (x, y) in enumerate(zip(xs, ys)):
            got = pm.train_step(pm.shard_batch(x), pm.shard_batch(y))
            loss = mse(ref(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            _close(got, float(loss), f"module zero {stage} step {step} loss")
        if stage == 3:
            units = len(pm.optimizer.units)
            if units < 5:
                raise AssertionError(f"ZeRO-3 of a module trained whole made {units} units, expected one per "
                                     f"block and per other child (5)")
        if stage != 3:
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if not torch.allclose(p, q, rtol=RTOL, atol=ATOL):
                    raise AssertionError(f"zero {stage}: {name} differs from one-process training")
        pm.groups.free()
        if world.rank == 0:
            print(f"OK module zero {stage}", flush=True)
    cfg = OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                    bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    model = OPTForCausalLM(cfg)
    batches = _batches()
    want = _reference(copy.deepcopy(model), batches)
    pm = parallelize(model, OPTIMIZER, ParallelLayout(dp=world.size, zero_stage=3), **OPT_ARGS)
    for step, ids in enumerate(batches):
        _close(pm.train_step(pm.shard_batch(ids)), want[step], f"opt zero 3 step {step} loss")
    pm.groups.free()
    if world.rank == 0:
        print("OK opt zero 3", flush=True)
