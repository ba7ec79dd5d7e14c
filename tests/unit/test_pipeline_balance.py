"""The router load-balancing loss of a pipeline step in one process: per micro-batch sums met once,
the value and gradients of Hugging Face's loss over the whole batch; where the step's collective runs."""

import pytest
import torch

from shardwise.adapters.torch.parallel.experts.training import pipeline_schedule
from shardwise.adapters.torch.parallel.pipeline import _forwards_first, _meeting_point
from shardwise.adapters.torch.parallel.experts.router_balance import LoadBalancingLoss, PipelineBalance, router_sums
from shardwise.core.errors import ConfigError
from shardwise.core.layout import ParallelLayout
from shardwise.core.pipeline import build_schedule

transformers = pytest.importorskip("transformers")


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=32, vocab_size=64, num_local_experts=4, num_experts_per_tok=2,
                        output_router_logits=True, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def _router_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_micro_batch_terms_give_the_whole_batch_loss_and_gradients() -> None:
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    model = _mixtral()
    (model.router_aux_loss_coef * model(ids).aux_loss).backward()
    with torch.no_grad():
        want_value = float(model.router_aux_loss_coef * model(ids).aux_loss)
    want = _router_grads(model)
    model.zero_grad(set_to_none=True)

    balance = PipelineBalance(LoadBalancingLoss(model, None), None, None, torch.device("cpu"), scale=lambda: 1.0)
    balance.begin_step()
    for j, part in enumerate(ids.chunk(2)):
        balance.begin_forward()
        model(part)
        balance.end_forward(j)
    value = balance.meet()
    assert float(value) == pytest.approx(want_value, rel=1e-6)
    terms = [balance.term(j) for j in range(2)]
    assert float(sum(terms)) == pytest.approx(want_value, rel=1e-6)  # dp=1: the terms add up to the loss
    sum(terms).backward()
    got = _router_grads(model)
    assert set(got) == set(want) and any("gate" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-8)


def test_term_before_meet_and_an_empty_step_are_refused() -> None:
    balance = PipelineBalance(LoadBalancingLoss(_mixtral(), None), None, None, torch.device("cpu"))
    balance.begin_step()
    balance.end_forward(0)  # a stage without MoE layers records nothing
    with pytest.raises(ConfigError, match="before meet"):
        balance.term(0)
    with pytest.raises(ConfigError, match="no routed rows"):
        balance.meet()


def test_router_sums_without_logits_are_zeros() -> None:
    counts, probs, rows = router_sums([], 4, 2)
    assert counts.tolist() == [0.0] * 4 and probs.tolist() == [0.0] * 4 and float(rows) == 0.0


def test_meeting_point_follows_the_last_forward_and_its_sends() -> None:
    for p in (2, 3):
        schedule = build_schedule("gpipe", p, 4)
        assert _forwards_first(schedule)
        for actions in schedule.actions:
            k = _meeting_point(actions)
            assert all(a.kind != "forward" for a in actions[k:])
            assert actions[k].kind in ("backward", "recv_grad")
            assert actions[k - 1].kind in ("forward", "send_act")
    assert not _forwards_first(build_schedule("1f1b", 2, 4))
    assert _forwards_first(build_schedule("1f1b", 2, 1))


def test_the_balance_loss_runs_1f1b_in_gpipe_order() -> None:
    layout = ParallelLayout(pp=2, micro_batches=4)
    assert pipeline_schedule(layout, balance=True) == "gpipe"
    assert pipeline_schedule(layout, balance=False) == "1f1b"
    assert pipeline_schedule(ParallelLayout(pp=2, micro_batches=4, schedule="gpipe"), balance=True) == "gpipe"
