"""Train a small character-level GPT with data, pipeline and tensor parallelism (dp x pp x tp).

The text ships with Python: the Zen of Python (``this``, stored rot13-encoded) and
the source of ``textwrap``. Attention and MLP are Megatron-style tensor-parallel
(column-parallel q/k/v and fc, row-parallel projections), the token embedding is
vocab-parallel and the loss is a vocab-parallel cross-entropy; the model is a
``nn.Sequential`` cut into pipeline stages by parameter count and run by a 1F1B
(or GPipe / interleaved) schedule; gradients are averaged over the dp group.

    mpirun -np 4 python examples/gpt_3d.py --pp 2 --tp 2          # 2x2 mesh, dp inferred
    mpirun -np 4 python examples/gpt_3d.py --dp 2 --pp 2 --tp 1 --schedule gpipe
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import importlib.util
import json
import math
import pathlib
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise import Communicator
from shardwise.torch.parallel import (ColumnParallelLinear, PipelineExecutor, RowParallelLinear,
                                      VocabParallelEmbedding, average_gradients, build_groups, build_schedule,
                                      padded_vocab_size, split_sequential_chunks, vocab_parallel_cross_entropy)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model sizes; ``dim`` and ``heads`` must divide by the tensor-parallel degree."""

    vocab: int
    seq_len: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 4


def _linear(tp: Optional[Communicator], d_in: int, d_out: int, kind: str, bias: bool = True) -> nn.Module:
    if tp is None:
        return nn.Linear(d_in, d_out, bias=bias)
    if kind == "column":
        return ColumnParallelLinear(d_in, d_out, tp, bias=bias)
    return RowParallelLinear(d_in, d_out, tp, bias=bias)


class Embed(nn.Module):
    """Token (vocab-parallel) plus learned position embedding."""

    def __init__(self, cfg: GPTConfig, tp: Optional[Communicator]) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim) if tp is None else VocabParallelEmbedding(cfg.vocab, cfg.dim, tp)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class Block(nn.Module):
    """Pre-norm transformer block; each tp rank holds ``heads / tp`` heads and ``1 / tp`` of the MLP."""

    def __init__(self, cfg: GPTConfig, tp: Optional[Communicator]) -> None:
        super().__init__()
        size = 1 if tp is None else tp.size
        self.heads = cfg.heads // size
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.q, self.k, self.v = (_linear(tp, cfg.dim, cfg.dim, "column") for _ in range(3))
        self.proj = _linear(tp, cfg.dim, cfg.dim, "row")
        self.fc = _linear(tp, cfg.dim, 4 * cfg.dim, "column")
        self.out = _linear(tp, 4 * cfg.dim, cfg.dim, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final norm and LM head; with tp the head is column-parallel over the padded vocab."""

    def __init__(self, cfg: GPTConfig, tp: Optional[Communicator]) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.dim)
        vocab = cfg.vocab if tp is None else padded_vocab_size(cfg.vocab, tp.size)
        self.lm = _linear(tp, cfg.dim, vocab, "column", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def build_gpt(cfg: GPTConfig, tp: Optional[Communicator] = None) -> nn.Sequential:
    """The model as ``[Embed, Block x layers, Head]``; plain torch layers when ``tp`` is None."""
    return nn.Sequential(Embed(cfg, tp), *(Block(cfg, tp) for _ in range(cfg.layers)), Head(cfg, tp))


def gpt_loss(cfg: GPTConfig, tp: Optional[Communicator] = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean next-token cross-entropy of logits (vocab-parallel with ``tp``)."""
    if tp is None:
        return lambda logits, target: F.cross_entropy(logits.reshape(-1, cfg.vocab), target.reshape(-1))
    return lambda logits, target: vocab_parallel_cross_entropy(logits, target, tp, vocab_size=cfg.vocab).mean()


def pad_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """``full`` with zero rows appended up to ``rows`` (vocab padding of the LM head)."""
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])]) if rows > full.shape[0] else full


@torch.no_grad()
def load_reference(parallel: nn.Module, reference: nn.Module) -> None:
    """Copy a plain model's weights into the matching (same-named) modules of a parallel one."""
    ref = dict(reference.named_modules())
    for name, mod in parallel.named_modules():
        src = ref[name]
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            bias = None if src.bias is None else pad_rows(src.bias, mod.out_features)
            mod.load_full(pad_rows(src.weight, mod.out_features), bias)
        elif isinstance(mod, VocabParallelEmbedding):
            mod.load_full(src.weight)
        else:
            for pname, p in mod.named_parameters(recurse=False):
                p.copy_(getattr(src, pname))


def char_corpus() -> str:
    """The Zen of Python followed by the source of ``textwrap`` (both ship with Python)."""
    def source(name: str) -> str:
        return pathlib.Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8")
    zen = codecs.decode(source("this").split('"""')[1], "rot13")
    return zen + "\n" + source("textwrap")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=-1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--checkpoint", action="store_true", help="recompute stage forwards in backward")
    args = parser.parse_args()
    torch.set_num_threads(1)

    world = shardwise.init().world
    groups = build_groups(world, dp=args.dp, pp=args.pp, tp=args.tp)
    text = char_corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cfg = GPTConfig(vocab=len(chars), layers=args.layers)
    if args.batch % groups.dp.size:
        raise shardwise.ConfigError(f"--batch {args.batch} is not divisible by dp={groups.dp.size}")

    torch.manual_seed(0)  # every rank builds the same full model, then keeps its stage and tp shard
    model = build_gpt(cfg, groups.tp)
    chunks = split_sequential_chunks(model, groups.pp.size, groups.pp.rank, args.virtual)
    schedule = build_schedule(args.schedule, groups.pp.size, args.microbatches, args.virtual)
    pipe = PipelineExecutor(chunks, schedule, groups.pp, gpt_loss(cfg, groups.tp), checkpoint=args.checkpoint)
    params = pipe.parameters()
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    report = pipe.is_last and groups.dp.rank == 0 and groups.tp.rank == 0
    if world.rank == 0:
        print(f"mesh {groups.mesh}, schedule {schedule.name} m={args.microbatches} v={args.virtual}, "
              f"vocab {cfg.vocab}, {len(text)} chars", flush=True)

    gen = torch.Generator().manual_seed(1234)  # the same global batches on every rank
    local = args.batch // groups.dp.size
    loss_value, losses = math.nan, []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - cfg.seq_len - 1, (args.batch,), generator=gen)
        mine = starts[groups.dp.rank * local:(groups.dp.rank + 1) * local]
        window = torch.stack([data[s:s + cfg.seq_len + 1] for s in mine.tolist()])
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(window[:, :-1], window[:, 1:])
        average_gradients(params, groups.dp)
        opt.step()
        if pipe.is_last:
            loss_value = float(groups.dp.allreduce(loss, "average"))
            if report:
                losses.append(loss_value)
                print(f"step {step}: loss={loss_value:.4f}", flush=True)
    if report:
        seconds = time.perf_counter() - start
        print(f"final: loss={loss_value:.4f} steps={args.steps} time={seconds:.1f}s", flush=True)
        # One machine-readable line for scripts and tests (the lines above are for people).
        print("SHARDWISE_RESULT " + json.dumps({"example": "gpt_3d", "ranks": world.size, "dp": groups.dp.size,
                                                "tp": groups.tp.size, "pp": groups.pp.size,
                                                "schedule": schedule.name, "steps": args.steps,
                                                "loss": loss_value, "losses": losses, "seconds": seconds}),
              flush=True)
    groups.free()


if __name__ == "__main__":
    main()
