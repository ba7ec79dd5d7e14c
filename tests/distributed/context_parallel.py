"""Context parallelism through ``parallelize`` against one process (issue 55).

:func:`attention` checks the two attention algorithms alone: each rank's output and the
gradients of its q, k, v chunks equal causal ``scaled_dot_product_attention`` over the whole
sequence. :func:`layouts` trains tiny Hugging Face models (``hf_any``'s configs) 3 SGD steps with
``ParallelLayout(dp=..., cp=..., cp_attention=...)`` and compares the losses and every parameter
with Hugging Face's own training of the whole batch in one process. :func:`bad_input` expects a
ConfigError on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import shardwise
from shardwise.adapters.torch.parallel.context import ring_attention, ulysses_attention
from shardwise.adapters.torch.parallel.parallelize import parallelize
from shardwise.core.context_plan import local_positions
from shardwise.core.layout import ParallelLayout

from hf_any import _SHAPE, BATCH, OPT_ARGS, OPTIMIZER, STEPS, VOCAB, _close, _refused, build, compare, config, \
    one_process, whole

#: Llama with grouped-query attention (4 query heads over 2 key/value heads), as hf_any's tiny shape.
LLAMA = dict(_SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def model_config(model_type: str) -> Any:
    """The tiny config of ``model_type``: Llama's here, any other hf_any's."""
    if model_type != "llama":
        return config(model_type)
    from transformers import AutoConfig
    import torch as _torch

    cfg = AutoConfig.for_model("llama", **LLAMA)
    cfg.dtype = _torch.float32
    return cfg


def attention(backend: str, cases: list[list[Any]]) -> None:
    """Each case ``[mode, cp, heads, kv_heads, seq]``: the world split into groups of cp ranks, each group
    attending its own random sequence; outputs and q/k/v gradients equal one process's."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    fns = {"ring": ring_attention, "ulysses": ulysses_attention}
    for mode, cp, heads, kv_heads, seq in cases:
        group = world.split(color=world.rank // cp)
        gen = torch.Generator().manual_seed(100 + world.rank // cp)
        b, d = 2, 8
        q = torch.randn(b, heads, seq, d, generator=gen, requires_grad=True)
        k = torch.randn(b, kv_heads, seq, d, generator=gen, requires_grad=True)
        v = torch.randn(b, kv_heads, seq, d, generator=gen, requires_grad=True)
        dout = torch.randn(b, heads, seq, d, generator=gen)
        g = heads // kv_heads
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              is_causal=True)
        want.backward(dout)
        pos = torch.tensor(local_positions(seq, cp, group.rank))
        mine = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        out = fns[mode](*mine, group, d ** -0.5)
        out.backward(dout[:, :, pos])
        what = f"{mode} cp={cp} heads={heads}/{kv_heads} seq={seq}"
        for name, got, ref in (("out", out, want[:, :, pos]), ("dq", mine[0].grad, q.grad[:, :, pos]),
                               ("dk", mine[1].grad, k.grad[:, :, pos]), ("dv", mine[2].grad, v.grad[:, :, pos])):
            if not torch.allclose(got, ref, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"{what}: {name} differs by {float((got - ref).abs().max()):.3g}")
        group.free()
        world.barrier()
        if world.rank == 0:
            print(f"OK attention {what}: output and q/k/v gradients equal one process", flush=True)


def layouts(backend: str, cases: list[list[Any]], seq: int = 16) -> None:
    """Each case is ``[model type, layout fields]``: 3 steps and every parameter equal to one process."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, seq), generator=gen) for _ in range(STEPS)]
    references: dict[str, Any] = {}
    for model_type, fields in cases:
        if model_type not in references:
            references[model_type] = one_process(model_type, data, model_config(model_type))
        want_losses, want_params = references[model_type]
        meta = bool(fields.pop("meta", False))
        pm = parallelize(build(model_type, meta=meta, cfg=model_config(model_type)), OPTIMIZER,
                         ParallelLayout(**fields), **OPT_ARGS)
        what = f"{'meta ' if meta else ''}{model_type} {pm.layout.describe()}"
        for step, batch in enumerate(data):
            _close(pm.train_step(pm.shard_batch(batch)), want_losses[step], f"{what} step {step} loss")
        checked = compare(world, whole(pm), want_params, what)
        pm.groups.free()
        if world.rank == 0:
            print(f"OK {what}: 3 losses and {checked} parameters equal to one process", flush=True)


def bad_input(backend: str) -> None:
    """cp not dividing dp, a sequence 2 cp does not divide, heads cp does not divide (Ulysses), a model
    whose attention does not go through transformers' interface: a ConfigError on every rank."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    n = world.size
    _refused(world, f"cp=3 with dp={n}",
             lambda: parallelize(build("qwen3"), OPTIMIZER, ParallelLayout(dp=n, cp=3), **OPT_ARGS), ["cp=3"])
    pm = parallelize(build("qwen3"), OPTIMIZER, ParallelLayout(dp=n, cp=n), **OPT_ARGS)
    _refused(world, f"a sequence of 12 at cp={n}",
             lambda: pm.train_step(pm.shard_batch(torch.zeros(n, 12, dtype=torch.long))), ["12", f"cp={n}"])
    _refused(world, "eval_step with cp", lambda: pm.eval_step(torch.zeros(1, 16, dtype=torch.long)),
             ["eval_step", "context parallelism"])
    pm.groups.free()
    three = config("qwen3", num_attention_heads=6, num_key_value_heads=3)
    _refused(world, f"Ulysses over 6 heads at cp={n}",
             lambda: parallelize(build("qwen3", cfg=three), OPTIMIZER,
                                 ParallelLayout(dp=n, cp=n, cp_attention="ulysses"), **OPT_ARGS),
             ["6 attention heads", f"cp={n}"])
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    gpt2._supports_attention_backend = False  # stands for a family with its own attention code
    _refused(world, "a model whose attention does not go through the interface",
             lambda: parallelize(gpt2, OPTIMIZER, ParallelLayout(dp=n, cp=2), **OPT_ARGS), ["AttentionInterface"])
