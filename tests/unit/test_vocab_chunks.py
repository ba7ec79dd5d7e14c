"""Which token tables ZeRO-3 cuts into row chunks (one process)."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.adapters.torch.parallel.vocab_chunks import ChunkedEmbedding, chunk_vocabulary
from shardwise.core.tp_rules import FamilyRules

RULES = FamilyRules(family="toy", blocks="model.layers", embed=("model.embed_tokens",), final=("lm_head",), rules=())


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers[0](self.embed_tokens(ids))


class _ReadsWeight(_Base):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # as Llama 4's text model does
        return self.layers[0](self.embed_tokens(ids.to(self.embed_tokens.weight.device)))


class _LM(nn.Module):
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.model, self.lm_head = base, nn.Linear(8, 32, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def test_a_table_is_cut_into_chunks_that_look_up_the_same_rows() -> None:
    torch.manual_seed(0)
    model = _LM(_Base())
    ids = torch.randint(0, 32, (2, 5))
    want = model(ids)
    assert chunk_vocabulary(model, RULES, unit_numel=64) == 4
    assert isinstance(model.model.embed_tokens, ChunkedEmbedding)
    assert torch.allclose(model(ids), want)


def test_a_table_whose_owner_reads_its_weight_stays_whole() -> None:
    model = _LM(_ReadsWeight())
    assert chunk_vocabulary(model, RULES, unit_numel=64) == 0
    assert isinstance(model.model.embed_tokens, nn.Embedding)
