"""Train a Hugging Face causal LM (random weights, built from a config) with any parallel layout.

The text is the documentation that ships with Python (``pydoc_data.topics``), as
bytes (vocabulary 256), so nothing is downloaded. One call, ``parallelize``,
applies the layout: data, tensor and pipeline parallelism, ZeRO, activation
checkpointing, accumulation and clipping.

    mpirun -np 2 python examples/hf_causal_lm.py --layout auto
    mpirun -np 4 python examples/hf_causal_lm.py --model llama --dp 2 --tp 2
    mpirun -np 4 python examples/hf_causal_lm.py --pp 2 --dp 2 --micro-batches 4
    mpirun -np 2 python examples/hf_causal_lm.py --deepspeed ds_config.json

Any model type of the installed transformers whose config carries a plan, at this size
(``--model qwen3``, ``gemma3_text``, ``phi3``, ...), Mixture-of-Experts ones with expert
parallelism (``--ep``: the experts of each layer split over groups of ep data-parallel ranks):

    mpirun -np 2 python examples/hf_causal_lm.py --model qwen3 --tp 2
    mpirun -np 4 python examples/hf_causal_lm.py --model mixtral --ep 4 --experts 8
    mpirun -np 4 python examples/hf_causal_lm.py --model qwen3_moe --ep 2     # each expert on 2 ranks
    mpirun -np 4 python examples/hf_causal_lm.py --model deepseek_v3 --ep 2 --tp 2

    python examples/hf_causal_lm.py --write-config small.json
    shardwise plan --model small.json --devices 4 --device-memory 2GB --global-batch 16 --precision fp32 \
        --json > plan.json
    mpirun -np 4 python examples/hf_causal_lm.py --model small.json --layout plan.json

The model is built on the meta device and each rank materializes only its part
(``--eager`` builds it whole on every rank first, as before). Bigger than one rank:

    mpirun -np 4 python examples/hf_causal_lm.py --tp 2 --pp 2 --steps 20 --checkpoint-dir ckpts
    mpirun -np 2 python examples/hf_causal_lm.py --zero 3 --steps 40 --checkpoint-dir ckpts --export out
    mpirun -np 2 python examples/hf_causal_lm.py --zero 3 --weights out      # start from exported weights

Every ``--log-every`` steps rank 0 prints the loss, tokens/s and the share of
the step spent waiting for communication.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import torch

import shardwise
from shardwise.checkpoint import latest_checkpoint
from shardwise.torch import ParallelLayout, parallelize

VOCAB = 256


def corpus() -> torch.Tensor:
    """Python's own topic documentation as a byte tensor (about 0.8 MB)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


#: Expert-count keys of the Mixture-of-Experts configs, and the routed-expert width keys.
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_EXPERT_WIDTH_KEYS = ("moe_intermediate_size", "expert_intermediate_size")


def preset(model_type: str, layers: int, hidden: int, heads: int, seq_len: int, vocab_size: int,
           experts: int) -> Any:
    """A config of ``model_type`` at this size: grouped-query attention with half as many key/value heads,
    a gated MLP of ~8/3 x hidden, and (MoE types) ``experts`` experts of which each token takes 2."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    shape: dict[str, Any] = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                 num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                                 intermediate_size=int(hidden * 8 / 3) // 8 * 8, max_position_embeddings=seq_len,
                                 vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if hasattr(defaults, "kv_lora_rank"):  # multi-head latent attention (DeepSeek): its own head widths
        del shape["head_dim"]
        shape["num_key_value_heads"] = heads  # every head has its own key, from the shared latent
        shape.update(qk_rope_head_dim=hidden // heads // 2, qk_nope_head_dim=hidden // heads,
                     v_head_dim=hidden // heads, kv_lora_rank=hidden // 2, q_lora_rank=hidden)
    shape.update({k: 1 for k in ("n_group", "topk_group", "first_k_dense_replace") if hasattr(defaults, k)})
    moe = [k for k in _EXPERT_KEYS if isinstance(getattr(defaults, k, None), int)]
    if moe:
        shape.update({k: experts for k in moe}, num_experts_per_tok=2, output_router_logits=True)
        shape.update({k: hidden for k in _EXPERT_WIDTH_KEYS if hasattr(defaults, k)})
    return AutoConfig.for_model(model_type, **shape)


def build_model(name: str, layers: int, hidden: int, heads: int, seq_len: int,
                vocab_size: int = VOCAB, experts: int = 4) -> torch.nn.Module:
    """A causal LM with random weights: a family preset at the given size, or a Hugging Face config JSON.

    Built under ``torch.device("meta")`` this allocates nothing; ``parallelize`` then gives
    each rank only its part, with the values this build would have drawn."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig

    if name == "gpt2":
        cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq_len, vocab_size=vocab_size,
                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif name == "llama":
        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                          num_key_value_heads=heads, intermediate_size=int(hidden * 8 / 3) // 8 * 8,
                          max_position_embeddings=seq_len, vocab_size=vocab_size, bos_token_id=0, eos_token_id=0)
    elif not name.endswith(".json"):
        cfg = preset(name, layers, hidden, heads, seq_len, vocab_size, experts)
    else:
        with open(name, encoding="utf-8") as fh:
            data = json.load(fh)
        data["vocab_size"] = vocab_size
        cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    return AutoModelForCausalLM.from_config(cfg)


def layout_arg(args: argparse.Namespace) -> Any:
    """What to hand to parallelize: a DeepSpeed file, a plan/layout file, 'auto', or the explicit degrees."""
    if args.deepspeed:
        return args.deepspeed
    if args.layout:
        return args.layout
    world = shardwise.current().world.size
    dp = args.dp or world // (args.tp * args.pp)
    return ParallelLayout(dp=dp, tp=args.tp, pp=args.pp, ep=args.ep, zero_stage=args.zero,
                          micro_batches=args.micro_batches if args.pp > 1 else 1, schedule=args.schedule,
                          activation_checkpointing=args.checkpointing, gradient_clipping=args.clip,
                          gradient_accumulation_steps=args.accumulation)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2",
                   help="gpt2, llama, any Hugging Face model type (qwen3, mixtral, ...), or a config JSON")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (MoE model types)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides dp)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per optimizer step)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--backend", default=None, help="shardwise backend (default: from the launcher)")
    p.add_argument("--layout", help="'auto', or a `shardwise plan --json` / layout JSON file")
    p.add_argument("--deepspeed", help="a DeepSpeed JSON config")
    p.add_argument("--dp", type=int, default=0, help="data-parallel degree (default: what tp x pp leave)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--micro-batches", type=int, default=4, help="pipeline micro-batches (pp > 1)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    p.add_argument("--checkpointing", action="store_true", help="recompute block activations in backward")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eager", action="store_true",
                   help="build the whole model on every rank first (default: on the meta device, sharded build)")
    p.add_argument("--weights", metavar="DIR", help="start from a save_pretrained directory (safetensors)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save a checkpoint there every --save-every steps; resume from its newest one")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--export", metavar="DIR", help="at the end, write a Hugging Face directory (from_pretrained)")
    p.add_argument("--write-config", metavar="PATH",
                   help="write the model's Hugging Face config (for `shardwise plan --model PATH`) and exit")
    args = p.parse_args()
    if args.write_config:
        build_model(args.model, args.layers, args.hidden, args.heads, args.seq_len, experts=args.experts).config.to_json_file(
            args.write_config)
        return

    torch.set_num_threads(1)
    ctx = shardwise.init(backend=args.backend, monitor=True)
    rank = ctx.world.rank
    torch.manual_seed(0)  # the same initial weights on every rank (parallelize uses rank 0's anyway)
    with contextlib.nullcontext() if args.eager else torch.device("meta"):
        model = build_model(args.model, args.layers, args.hidden, args.heads, args.seq_len, experts=args.experts)
    pm = parallelize(model, torch.optim.AdamW, layout_arg(args), seq_len=args.seq_len, global_batch=args.batch,
                     weights=args.weights, lr=args.lr, weight_decay=0.01)
    if rank == 0:
        print(f"layout: {pm.layout.describe()} on {ctx.world.size} ranks ({ctx.backend})", flush=True)
    first = 1
    if args.checkpoint_dir and latest_checkpoint(args.checkpoint_dir) is not None:
        first = pm.load_checkpoint(args.checkpoint_dir)["next_step"]
        if rank == 0:
            print(f"resumed at step {first} from {args.checkpoint_dir}", flush=True)
    data = corpus()
    gen = torch.Generator().manual_seed(1234)  # the same batches on every rank
    tokens, losses = 0, {}
    last = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, data.numel() - args.seq_len, (args.batch,), generator=gen)
        if step < first:
            continue  # the data position: batches the checkpointed run already took
        batch = torch.stack([data[s:s + args.seq_len] for s in starts.tolist()])
        with ctx.monitor.step():
            loss = pm.train_step(pm.shard_batch(batch))
        tokens += batch.numel()
        losses[step] = loss
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            now = time.perf_counter()
            comm = ctx.monitor.steps[-1].fraction
            print(f"step {step}: loss={loss:.4f} tokens/s={tokens / (now - last):.0f} comm={comm:.0%}", flush=True)
            tokens, last = 0, now
        if args.checkpoint_dir and step % args.save_every == 0:
            pm.save_checkpoint(args.checkpoint_dir, step, extra={"next_step": step + 1}, keep=2)
    if args.export:
        pm.save_pretrained(args.export)
        if rank == 0:
            print(f"exported to {args.export}", flush=True)
    if rank == 0 and first <= args.steps:
        print(f"final: loss={loss:.4f}", flush=True)
        # One machine-readable line for scripts and tests (the lines above are for people).
        layout = pm.layout
        print("SHARDWISE_RESULT " + json.dumps({
            "example": "hf_causal_lm", "ranks": ctx.world.size, "backend": str(ctx.backend),
            "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep,
                       "zero_stage": layout.zero_stage, "text": layout.describe()},
            "first_step": first, "steps": args.steps, "loss": float(loss),
            "losses": {str(s): float(v) for s, v in losses.items()}}), flush=True)


if __name__ == "__main__":
    main()
