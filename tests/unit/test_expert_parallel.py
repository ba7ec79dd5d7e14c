"""Expert parallelism in one process: the plan's checks, placements, the dispatch around HF's experts, the aux loss."""

import copy

import pytest
import torch

from shardwise.adapters.torch.parallel.experts.sharding import (apply_expert_parallel, ep_plan_of, is_expert_param,
                                                               local_squared_norm)
from shardwise.adapters.torch.parallel.experts.router_balance import LoadBalancingLoss, load_balancing_term
from shardwise.adapters.torch.parallel.tp_apply import placement_of
from shardwise.backends.local import LocalCommunicator
from shardwise.core.errors import ConfigError

transformers = pytest.importorskip("transformers")


def _mixtral(experts: int = 4, **extra):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=32, vocab_size=64, num_local_experts=experts, num_experts_per_tok=2,
                        output_router_logits=True, **extra)
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def test_dispatch_around_the_family_experts_gives_hugging_faces_output_and_gradients() -> None:
    ref = _mixtral()
    model = copy.deepcopy(ref)
    kept = apply_expert_parallel(model, LocalCommunicator(), ep_plan_of(model), model.base_model_prefix)
    assert [placement_of(p, "?").name for p in kept] == [
        f"model.layers.{i}.mlp.experts.{n}" for i in range(2) for n in ("gate_up_proj", "down_proj")]
    assert all(is_expert_param(p) and placement_of(p, "?").dim == 0 for p in kept)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    want, got = ref(ids, labels=ids), model(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-6, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_plan_checks_run_before_anything_changes() -> None:
    model = _mixtral(experts=3)
    before = {n: p for n, p in model.named_parameters()}

    class Two(LocalCommunicator):
        size = 2

    with pytest.raises(ConfigError, match="model.layers.0.mlp.experts: 3 experts do not split over ep=2"):
        apply_expert_parallel(model, Two(), ep_plan_of(model), "model")
    assert all(p is before[n] for n, p in model.named_parameters())
    with pytest.raises(ConfigError, match=r"styles not implemented by shardwise: 'sharded_experts' "
                                          r"\(layers.\*.mlp.experts.down_proj\)"):
        apply_expert_parallel(model, LocalCommunicator(), {**ep_plan_of(model),
                                                           "layers.*.mlp.experts.down_proj": "sharded_experts"},
                              "model")
    with pytest.raises(ConfigError, match="'grouped_gemm' parameters outside any 'ep_dispatch_experts' module"):
        apply_expert_parallel(model, LocalCommunicator(), {"layers.*.mlp.experts.down_proj": "grouped_gemm"}, "model")


def test_meta_model_stays_on_meta_with_slice_shapes() -> None:
    with torch.device("meta"):
        model = _mixtral()
    kept = apply_expert_parallel(model, LocalCommunicator(), ep_plan_of(model), "model")
    assert all(p.is_meta for p in kept)
    assert tuple(kept[0].shape) == (4, 64, 32) and placement_of(kept[0], "?").full_shape == (4, 64, 32)


def test_balance_term_alone_is_hugging_faces_loss() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gen = torch.Generator().manual_seed(3)
    logits = tuple(torch.randn(12, 6, generator=gen) for _ in range(3))
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[0, 2:] = 0
    for attention_mask in (None, mask):
        want = load_balancing_loss_func(logits, 6, 2, attention_mask)
        got = load_balancing_term(list(logits), 6, 2, None, attention_mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_collector_takes_what_hugging_face_records() -> None:
    model = _mixtral()
    aux = LoadBalancingLoss(model, None)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids)
    assert len(aux.collector.logits) == 2
    torch.testing.assert_close(aux(), model.router_aux_loss_coef * out.aux_loss)
    assert aux.collector.take() == []  # taken by the call


def test_norm_counts_experts_ep_times() -> None:
    model = _mixtral()
    kept = apply_expert_parallel(model, LocalCommunicator(), ep_plan_of(model), "model")
    dense = next(p for p in model.parameters() if not is_expert_param(p))
    pairs = [(dense, torch.full((2,), 3.0)), (kept[0], torch.full((2,), 4.0))]
    assert float(local_squared_norm(pairs, 2, torch.device("cpu"))) == pytest.approx(2 * 9 + 2 * (2 * 16))


def test_doge_product_key_term_is_hugging_faces_loss_with_and_without_padding() -> None:
    from transformers.models.doge.modeling_doge import load_balancing_loss_func
    from shardwise.adapters.torch.parallel.experts.router_balance import PRODUCT_KEYS

    gen = torch.Generator().manual_seed(2)
    logits = tuple(torch.randn(2, 12, 3, generator=gen) for _ in range(3))  # 9 experts = 3 x 3 keys, 12 rows
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[1, 1:] = 0
    for attention_mask in (None, mask):
        want = load_balancing_loss_func(logits, 9, 3, 2, attention_mask)
        got = load_balancing_term(list(logits), 9, 2, None, attention_mask, PRODUCT_KEYS)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
