"""``ParallelModel.eval_step`` and ``logits`` in one process: the model's loss and logits, eval mode, refusals."""

from typing import Iterator

import pytest
import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.parallel.parallelize import parallelize
from shardwise.core.errors import ConfigError
from shardwise.core.layout import ParallelLayout

transformers = pytest.importorskip("transformers")


@pytest.fixture
def local() -> Iterator[None]:
    shardwise.init(backend="local")
    yield
    shardwise.shutdown()


def _gpt2(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, bos_token_id=0, eos_token_id=0))


def _ids(n: int = 4) -> torch.Tensor:
    return torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(5))


def test_eval_step_and_logits_are_the_models_in_eval_mode_and_leave_its_modes(local: None) -> None:
    model = _gpt2(dropout=0.5)
    ref = _gpt2(dropout=0.5).eval()
    pm = parallelize(model, torch.optim.SGD, ParallelLayout(gradient_accumulation_steps=2), lr=0.1)
    pm.module.train()
    head = pm.chunks[0].stages[-1]
    head.eval()
    ids = _ids()
    rng = torch.get_rng_state()
    loss = pm.eval_step(ids)
    logits = pm.logits(ids)
    assert torch.equal(torch.get_rng_state(), rng)  # no dropout drew
    with torch.no_grad():
        out = ref(ids, labels=ids)
        # two accumulation steps of two samples: the mean of their means
        want = sum(float(ref(x, labels=x).loss) for x in ids.chunk(2)) / 2
    assert loss == pytest.approx(want, rel=1e-6)
    assert loss == pytest.approx(float(out.loss), rel=1e-5)
    assert torch.equal(logits, out.logits)
    assert not logits.requires_grad
    assert pm.module.training and not head.training
    assert all(m.training for m in pm.chunks[0].stages[1].modules())


def test_sequential_model_evaluates_with_its_loss_and_needs_targets(local: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    pm = parallelize(model, torch.optim.SGD, ParallelLayout(), loss_fn=nn.functional.mse_loss, lr=0.1)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with torch.no_grad():
        want_out = model.eval()(x)
    model.train()
    assert pm.eval_step(x, y) == pytest.approx(float(nn.functional.mse_loss(want_out, y)), rel=1e-6)
    assert torch.equal(pm.logits(x), want_out)
    with pytest.raises(ConfigError, match="eval_step needs targets when the model has its own loss_fn"):
        pm.eval_step(x)


def test_batches_that_do_not_fit_are_refused(local: None) -> None:
    pm = parallelize(_gpt2(dropout=0.0), torch.optim.SGD, ParallelLayout(gradient_accumulation_steps=2), lr=0.1)
    ids = _ids(4)
    with pytest.raises(ConfigError, match=r"a batch of 3 samples does not split into 2 equal parts "
                                          r"\(gradient_accumulation_steps=2\)"):
        pm.eval_step(ids[:3])
    with pytest.raises(ConfigError, match="4 input samples but 2 targets"):
        pm.eval_step(ids, ids[:2])
    with pytest.raises(ConfigError, match="a batch of 0 samples"):
        pm.logits(ids[:0])
    with pytest.raises(ConfigError, match="needs a tensor batch with a sample dimension, got list"):
        pm.eval_step(ids.tolist())
    with pytest.raises(ConfigError, match="needs a tensor batch with a sample dimension, got Tensor"):
        pm.logits(torch.tensor(3))
    assert pm.logits(ids[:3]).shape == (3, 16, 64)  # logits run the batch whole: any size
