"""The benchmark workloads: a model factory, one rank's synthetic batch and the loss.

* ``mlp-dp``: the 11.5M-parameter MLP of the data-parallel benchmark (batch 32/rank, MSE).
* ``mlp-zero``: the 21M-parameter MLP of the ZeRO benchmark (batch 16/rank, mean square of the output).
* ``gpt``: a small GPT-like causal language model - token + position embedding, a stack of
  ``nn.TransformerEncoderLayer`` (pre-norm, GELU, causal mask), a final LayerNorm and an LM
  head - 4 layers x 256, 4 heads, vocabulary 4096 (5.3M parameters), sequence 128,
  batch 8/rank of synthetic tokens from a generator seeded with the rank.
Every model is built from seed 0, so every rank and every contender starts from the same weights.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 4096, width: int = 256, layers: int = 4, heads: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                               activation="gelu", batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = self.mask[:t, :t]
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


@dataclasses.dataclass
class Workload:
    name: str
    label: str
    build: Callable[[], nn.Module]
    batch: int
    data: Callable[[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    units: Callable[[nn.Module], list[nn.Module]]  # FSDP2 sharding units (the root is added)

    def model(self, device: str = "cpu") -> nn.Module:
        torch.manual_seed(0)
        return self.build().to(device)

    def params(self) -> int:
        return sum(p.numel() for p in self.model().parameters())


def _dense(inp: int, out: int) -> Callable:
    def data(rank: int, batch: int, device: torch.device):
        g = torch.Generator().manual_seed(1000 + rank)
        return torch.randn(batch, inp, generator=g).to(device), torch.randn(batch, out, generator=g).to(device)
    return data


def _tokens(vocab: int = 4096, seq: int = 128) -> Callable:
    def data(rank: int, batch: int, device: torch.device):
        g = torch.Generator().manual_seed(1000 + rank)
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return data


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


WORKLOADS = {
    "mlp-dp": Workload("mlp-dp", "MLP 1024-2048-2048-2048-512", lambda: _mlp([1024, 2048, 2048, 2048, 512]), 32,
                       _dense(1024, 512), nn.functional.mse_loss, _linears),
    "mlp-zero": Workload("mlp-zero", "MLP 1024-5x2048-1024", lambda: _mlp([1024] + [2048] * 5 + [1024]), 16,
                         _dense(1024, 1024), lambda out, _: out.pow(2).mean(), _linears),
    "gpt": Workload("gpt", "GPT 4 x 256, 4 heads, vocab 4096, seq 128", TinyGPT, 8, _tokens(), _lm_loss,
                    lambda m: list(m.layers)),
}
