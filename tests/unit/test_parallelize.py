"""``parallelize`` in one process: the stage view of Hugging Face models, layouts, refusals."""

import copy
from typing import Iterator

import pytest
import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.parallel.layout_spec import resolve_layout
from shardwise.adapters.torch.parallel.parallelize import parallelize
from shardwise.adapters.torch.parallel.stages import StageStack, causal_lm_loss, causal_lm_stages, model_family
from shardwise.core.errors import ConfigError
from shardwise.core.layout import ParallelLayout

transformers = pytest.importorskip("transformers")


@pytest.fixture
def local() -> Iterator[None]:
    shardwise.init(backend="local")
    yield
    shardwise.shutdown()


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stage_view_computes_what_the_model_computes(family: str) -> None:
    model = _model(family)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    stages, blocks = causal_lm_stages(model, model_family(model))
    assert blocks == [False, True, True, False]
    logits = StageStack(stages)(ids)
    out = model(ids, labels=ids)
    assert torch.equal(logits, out.logits)
    assert torch.allclose(causal_lm_loss(logits, ids), out.loss, rtol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_rank_parallelize_trains_like_the_model(local: None, family: str) -> None:
    model = _model(family)
    ref = copy.deepcopy(model)
    pm = parallelize(model, torch.optim.SGD, ParallelLayout(activation_checkpointing=True), lr=0.5)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        got = pm.train_step(ids)
        loss = ref(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert got == pytest.approx(float(loss.detach()), rel=1e-6)


def test_auto_layout_on_one_rank(local: None) -> None:
    pm = parallelize(_model("gpt2"), torch.optim.AdamW, "auto", seq_len=16, global_batch=4, lr=1e-3)
    assert pm.layout.world_size == 1


def test_layout_sources_are_resolved_and_checked(local: None, tmp_path) -> None:
    assert resolve_layout({"dp": 1}, 1) == ParallelLayout()
    assert resolve_layout({"train_batch_size": 4, "gradient_accumulation_steps": 2}, 1) == \
        ParallelLayout(gradient_accumulation_steps=2, bucket_bytes=2_000_000_000)  # DeepSpeed's 5e8 elements
    with pytest.raises(ConfigError, match="unknown key 'zero_optimisation' in DeepSpeed config"):
        resolve_layout({"train_batch_size": 4, "zero_optimisation": {"stage": 1}}, 1)
    with pytest.raises(ConfigError, match="layout='auto' needs the model"):
        resolve_layout("auto", 1)
    with pytest.raises(ConfigError, match="cannot read layout file"):
        resolve_layout(str(tmp_path / "missing.json"), 1)
    with pytest.raises(ConfigError, match="a layout is a ParallelLayout"):
        resolve_layout(3, 1)  # type: ignore[arg-type]


def test_models_without_rules_are_refused_clearly(local: None) -> None:
    with pytest.raises(ConfigError, match="Linear that is not a Hugging Face causal LM needs loss_fn="):
        parallelize(nn.Linear(2, 2), torch.optim.SGD, ParallelLayout(), lr=0.1)
    with pytest.raises(ConfigError, match="needs loss_fn="):
        parallelize(nn.Sequential(nn.Linear(2, 2)), torch.optim.SGD, ParallelLayout(), lr=0.1)
    with pytest.raises(ConfigError, match="tp_plan= needs a Hugging Face model"):
        parallelize(nn.Linear(2, 2), torch.optim.SGD, ParallelLayout(), loss_fn=nn.functional.mse_loss,
                    tp_plan={"weight": "colwise"}, lr=0.1)


class _Residual(nn.Module):
    """Not a Sequential, no config: trained whole, its ModuleList entries ZeRO-3 units."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


def test_any_module_trains_whole(local: None) -> None:
    # ZeRO 1-3 on 2 ranks: tests/distributed/test_hf_parallel_mp.py::test_any_module_under_zero
    torch.manual_seed(0)
    model = _Residual()
    ref = copy.deepcopy(model)
    pm = parallelize(model, torch.optim.AdamW, ParallelLayout(), loss_fn=nn.functional.mse_loss, lr=0.01)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(3):
        got = pm.train_step(x, y)
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert got == pytest.approx(float(loss.detach()), rel=1e-6)
    for p, q in zip(pm.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_sequential_model_with_its_loss(local: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    pm = parallelize(model, torch.optim.SGD, ParallelLayout(gradient_accumulation_steps=2),
                     loss_fn=nn.functional.mse_loss, lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    got = pm.train_step(x, y)
    loss = nn.functional.mse_loss(ref(x), y)
    loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert got == pytest.approx(float(loss.detach()), rel=1e-6)
    for p, q in zip(pm.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-7)
    with pytest.raises(ConfigError, match="needs targets"):
        pm.train_step(x)


def _saved_per_block(model: nn.Module, batch: int = 2, seq: int = 16) -> float:
    """Activation elements one block keeps for backward, per token and hidden unit (autograd's own record)."""
    stages, _ = causal_lm_stages(model, model_family(model))
    h = model.config.hidden_size
    x = torch.randn(batch, seq, h, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) and not (t.is_leaf and t.requires_grad and t is not x):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stages[1](x)
    return sum(storages.values()) / (batch * seq * h * x.element_size())


@pytest.mark.parametrize("family, extra", [("gpt2", {"activation_function": "gelu_new"}),
                                           ("gpt2", {"activation_function": "gelu"}),
                                           ("llama", {"intermediate_size": 128}), ("llama", {"intermediate_size": 256})])
def test_planner_activation_count_matches_what_autograd_keeps(family: str, extra: dict) -> None:
    from shardwise.core.model_spec import ModelSpec

    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **extra)
        model = transformers.GPT2LMHeadModel(config)
    else:
        # head_dim 16: SDPA's fused CPU kernel (no seq x seq scores kept), as at real sizes
        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=4, vocab_size=64, max_position_embeddings=64, **extra)
        model = transformers.LlamaForCausalLM(config)
    replicated, split = ModelSpec.from_hf_config(config.to_dict()).saved_activations
    measured = _saved_per_block(model, batch=4, seq=64)
    assert replicated + split == pytest.approx(measured, rel=0.05), (replicated, split, measured)


def test_auto_layout_describes_this_hosts_cpus() -> None:
    import os

    from shardwise.adapters.torch.parallel.layout_spec import local_hardware

    cores = len(os.sched_getaffinity(0))
    hw = local_hardware(_model("gpt2"), 2 * cores, 2 * cores)
    assert hw.compute_units_per_node == cores and hw.sharing == 2.0
    assert hw.peak_flops > 1e8 and hw.devices_per_node == 2 * cores
    assert local_hardware(_model("gpt2"), 4, 1).compute_units_per_node is None  # one rank per node


def test_auto_layout_weighs_sequence_and_vocab_parallelism_for_models_with_split_rules() -> None:
    from shardwise.adapters.torch.parallel.layout_spec import auto_layout
    from shardwise.core.hardware import Hardware
    from shardwise.core.model_spec import ModelSpec
    from shardwise.core.planner import plan

    config = transformers.GPT2Config(n_layer=8, n_embd=1024, n_head=16, vocab_size=128000, n_positions=2048)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    spec = ModelSpec.from_hf_config(config.to_dict(), seq_len=2048)
    chosen = set()
    for gb in (12, 8, 6, 5, 4):  # tighter and tighter memory on 2 ranks
        hw = Hardware(num_devices=2, devices_per_node=2, memory_per_device=gb * 10**9)
        try:
            best = plan(spec, hw, global_batch=2, precision="fp32").best
        except Exception:  # noqa: BLE001 - nothing fits any more
            break
        layout = auto_layout(model, 2, seq_len=2048, global_batch=2, hardware=hw)
        assert layout == ParallelLayout.from_plan(best, precision="fp32")
        chosen.add((layout.tp, layout.sequence_parallel, layout.vocab_parallel))
    assert any(sp or vp for _, sp, vp in chosen), chosen  # some budget needs a split to fit or be fastest
    # a module without split rules never gets them (nor tensor parallelism)
    seq = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    layout = auto_layout(seq, 2, seq_len=2048, global_batch=2,
                         hardware=Hardware(num_devices=2, devices_per_node=2, memory_per_device=10**12))
    assert (layout.tp, layout.sequence_parallel, layout.vocab_parallel) == (1, False, False)
