"""The strategy planner: units, model shapes, the cost model's known answers, ranking and the CLI."""

import json
import re

import pytest

from shardwise.cli import main
from shardwise.core.errors import ConfigError
from shardwise.core.hardware import (Hardware, parse_bandwidth, parse_bytes, parse_count, parse_flops,
                                     parse_seconds)
from shardwise.core.model_spec import ModelSpec
from shardwise.core.pipeline import bubble_fraction
from shardwise.core.planner import PlanError, estimate, plan

GB = 1e9
MODEL_30B = ModelSpec(num_params=30_000_000_000, num_layers=48, hidden_size=7168)
NODE_8X80 = Hardware.parse(num_devices=8, memory_per_device="80GB", intra_node_bandwidth="600GB/s")


@pytest.mark.parametrize("parse, text, expected", [
    (parse_count, "30B", 30e9), (parse_count, "1.3B", 1.3e9), (parse_count, "350M", 350e6),
    (parse_count, "7e9", 7e9), (parse_count, 12, 12),
    (parse_bytes, "80GB", 80e9), (parse_bytes, "80GiB", 80 * 2 ** 30), (parse_bytes, "512MB", 512e6),
    (parse_bytes, "80G", 80e9), (parse_bytes, 1024, 1024),
    (parse_bandwidth, "100Gbps", 12.5e9), (parse_bandwidth, "25Gb/s", 25e9 / 8),
    (parse_bandwidth, "900GB/s", 900e9), (parse_bandwidth, "600GBps", 600e9), (parse_bandwidth, "1e9", 1e9),
    (parse_flops, "312TFLOPS", 312e12), (parse_flops, "312 TFLOP/s", 312e12), (parse_flops, "1.98PF", 1.98e15),
    (parse_seconds, "5us", 5e-6), (parse_seconds, "10µs", 10e-6), (parse_seconds, "2ms", 2e-3),
])
def test_human_units(parse, text, expected):
    assert parse(text) == pytest.approx(expected)


@pytest.mark.parametrize("parse, text, message", [
    (parse_bytes, "80XB", "unknown unit prefix 'X'"), (parse_bytes, "lots", "cannot read"),
    (parse_bytes, "-1GB", "cannot read"), (parse_bandwidth, "100G", "'100Gbps' (bits)"),
    (parse_count, "30Q", "use K, M, B or T"), (parse_flops, "312TW", "unknown unit"),
    (parse_seconds, "5h", "use s, ms, us or ns"), (parse_bytes, True, "must be a number"),
])
def test_bad_units_name_the_problem(parse, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(text)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_devices=0), "num_devices must be an integer >= 1"),
    (dict(num_devices=12, devices_per_node=8), "not a whole number of nodes"),
    (dict(num_devices=8, efficiency=1.5), "efficiency must be in"),
    (dict(num_devices=8, inter_node_bandwidth=0), "inter_node_bandwidth must be a positive"),
])
def test_hardware_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Hardware(**kwargs)


def test_hardware_links():
    hw = Hardware(num_devices=16, devices_per_node=8)
    assert hw.link(8) == (hw.intra_node_bandwidth, hw.intra_node_latency)
    assert hw.link(16) == (hw.inter_node_bandwidth, hw.inter_node_latency)
    assert Hardware(num_devices=4).node_size == 4


@pytest.mark.parametrize("count, layers, hidden", [
    ("125M", 12, 768), ("1.3B", 24, 2048), ("6.7B", 32, 4096), ("30B", 48, 7168), ("175B", 96, 12288),
])
def test_from_params_gives_gpt_like_shapes(count, layers, hidden):
    spec = ModelSpec.from_params(count)
    assert (spec.num_layers, spec.hidden_size) == (layers, hidden)
    rebuilt = spec.layer_params * spec.num_layers + spec.vocab_size * spec.hidden_size
    assert rebuilt == pytest.approx(spec.num_params, rel=0.05)
    assert spec.hidden_size % spec.heads == 0


def test_from_params_keeps_given_dimensions():
    assert ModelSpec.from_params("30B", num_layers=48).hidden_size == 7168
    assert ModelSpec.from_params("30B", hidden_size=7168).num_layers == 48
    with pytest.raises(ConfigError, match="not divisible by num_heads"):
        ModelSpec(num_params=10, num_layers=1, hidden_size=100, num_heads=3)


class _Param:
    def __init__(self, n):
        self.n, self.requires_grad = n, True

    def numel(self):
        return self.n


def test_from_framework_objects_is_duck_typed():
    shared = _Param(1000)

    class Module:  # a torch-like module: tied weights appear twice, config is Hugging Face-like
        config = type("Cfg", (), {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4})()

        def parameters(self):
            return [shared, _Param(500), shared]

    spec = ModelSpec.from_torch_module(Module(), seq_len=128)
    assert (spec.num_params, spec.num_layers, spec.hidden_size, spec.heads, spec.seq_len) == (1500, 2, 64, 4, 128)

    class KerasModel:
        def count_params(self):
            return 7_000_000_000

    assert ModelSpec.from_keras_model(KerasModel()).num_params == 7_000_000_000
    with pytest.raises(ConfigError, match="no parameters"):
        ModelSpec.from_keras_model(type("Empty", (), {"count_params": lambda self: 0})())


def test_gpt3_fp32_parameters_are_700_gb():
    gpt3 = ModelSpec.from_params("175B")
    c = estimate(gpt3, Hardware(num_devices=1), dp=1, global_batch=1, precision="fp32")
    assert c.memory.params == 700 * GB and c.memory.grads == 700 * GB
    assert c.memory.optimizer == 1400 * GB  # Adam moments, no master copy in fp32
    assert not c.fits


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, expected_gb):
    spec = ModelSpec.from_params("7.5B")
    c = estimate(spec, Hardware(num_devices=64), dp=64, zero=stage, global_batch=64, precision="fp16")
    states = c.memory.params + c.memory.grads + c.memory.optimizer
    assert states / GB == pytest.approx(expected_gb, abs=0.05)


def test_30b_on_8x80gb_needs_zero3_not_plain_dp():
    result = plan(MODEL_30B, NODE_8X80, global_batch=512)
    plain = [c for c in result.candidates if c.dp == 8 and c.zero == 0]
    assert plain and not any(c.fits for c in plain)
    assert all(c.memory.params + c.memory.grads + c.memory.optimizer == 16 * 30e9 for c in plain)
    assert all(re.fullmatch(r"does not fit: \d+\.\d GB > 80\.0 GB", c.reason) for c in plain)
    zero3 = [c for c in result.fitting if c.dp == 8 and c.zero == 3]
    assert zero3 and all(c.checkpointing and c.micro_batch_size <= 4 for c in zero3)
    assert all(c.memory.params + c.memory.grads + c.memory.optimizer == 16 * 30e9 / 8 for c in zero3)
    assert "DP" in {c.strategy for c in result.rejected_strategies()}


def test_rules_of_thumb():
    small = plan(ModelSpec.from_params("1B"), NODE_8X80, global_batch=256).best
    assert small.strategy in ("DP", "ZeRO-1") and small.tp == small.pp == 1
    big = plan(ModelSpec.from_params("175B"), Hardware(num_devices=64), global_batch=1536).best
    assert big.tp * big.pp >= 8 and big.fits


def test_ranking_and_reasons():
    result = plan(MODEL_30B, NODE_8X80, global_batch=512)
    assert result.best.reason == "best" and result.best is result.candidates[0]
    times = [c.step_time for c in result.fitting]
    assert times == sorted(times)
    assert all(c.fits for c in result.candidates[:len(result.fitting)])
    slower = [c for c in result.fitting[1:] if c.step_time > result.best.step_time * 1.001]
    assert slower and all(re.fullmatch(r"slower: \d+\.\d\d s/step vs best \d+\.\d\d s \(comm \d+%\)", c.reason)
                          for c in slower)
    layouts = result.layouts()
    assert len({c.layout for c in layouts}) == len(layouts) and layouts[0] is result.best
    json.dumps(result.to_dict(top=5))  # JSON-ready


def test_nothing_fits_names_the_smallest_requirement():
    with pytest.raises(PlanError, match=r"nothing fits in 80\.0 GB per device: the smallest candidate "
                                        r"needs \d+\.\d GB") as info:
        plan(ModelSpec.from_params("175B"), Hardware(num_devices=8), global_batch=64)
    assert isinstance(info.value, ConfigError) and info.value.smallest.memory.total > 80 * GB


def test_cost_model_formulas():
    spec = ModelSpec(num_params=1_000_000_000, num_layers=16, hidden_size=2048, seq_len=1024)
    hw = Hardware(num_devices=8)
    psi, sbh = spec.num_params, 1024 * 4 * 2048
    c0 = estimate(spec, hw, dp=8, zero=0, global_batch=32)
    c3 = estimate(spec, hw, dp=8, zero=3, global_batch=32)
    assert c0.comm_bytes.data_parallel == pytest.approx(2 * 7 / 8 * psi * 2, rel=1e-9)  # ring allreduce
    assert c3.comm_bytes.data_parallel == pytest.approx(3 * 7 / 8 * psi * 2, rel=1e-9)  # AG + AG + RS
    tp = estimate(spec, hw, dp=1, tp=8, global_batch=4)
    assert tp.comm_bytes.tensor_parallel == pytest.approx(16 * 4 * 2 * 7 / 8 * sbh * 2, rel=1e-9)
    pp = estimate(spec, hw, dp=1, pp=8, micro_batches=4, global_batch=16)
    assert pp.comm_bytes.pipeline == 2 * 4 * sbh * 2
    ideal = 6 * psi * 16 * 1024 / (8 * hw.peak_flops * hw.efficiency)
    assert pp.compute_time == pytest.approx(ideal / (1 - bubble_fraction("1f1b", 8, 4)))
    for c in (c0, c3, tp, pp):
        assert c.step_time == pytest.approx(c.compute_time + c.exposed_comm_time)
        assert 0 <= c.exposed_comm_time <= c.comm_time + 1e-12 and 0 <= c.comm_fraction < 1
    totals = [estimate(spec, hw, dp=8, zero=z, global_batch=32).memory.total for z in (0, 1, 2)]
    assert totals == sorted(totals, reverse=True) and c3.memory.params < c0.memory.params
    ckpt = estimate(spec, hw, dp=8, global_batch=32, checkpointing=True)
    assert ckpt.memory.activations < c0.memory.activations and ckpt.compute_time == pytest.approx(
        c0.compute_time * 8 / 6)


def test_data_parallel_across_nodes_uses_the_network():
    spec = ModelSpec.from_params("1B")
    slow = estimate(spec, Hardware(num_devices=16, inter_node_bandwidth=1e9), dp=16, global_batch=64)
    fast = estimate(spec, Hardware(num_devices=16, inter_node_bandwidth=100e9), dp=16, global_batch=64)
    assert slow.comm_time > 10 * fast.comm_time
    one_node = estimate(spec, Hardware(num_devices=16, inter_node_bandwidth=1e9), dp=2, tp=8, global_batch=64)
    other = estimate(spec, Hardware(num_devices=16, inter_node_bandwidth=100e9), dp=2, tp=8, global_batch=64)
    assert one_node.comm_bytes.tensor_parallel == other.comm_bytes.tensor_parallel


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=4), "dp\\*tp\\*pp = 4\\*1\\*1 = 4 != 8 devices"),
    (dict(dp=8, global_batch=12), "global batch 12 is not divisible by dp\\*micro_batches"),
    (dict(dp=8, optimizer="lion"), "optimizer must be one of"),
    (dict(dp=8, zero=4), "zero stage must be 0, 1, 2 or 3"),
    (dict(dp=1, pp=8, model=ModelSpec(num_params=10**6, num_layers=4, hidden_size=64)), "exceeds the model's 4"),
])
def test_estimate_rejects_bad_configurations(kwargs, message):
    kwargs = {"global_batch": 64, "model": MODEL_30B, **kwargs}
    with pytest.raises(ConfigError, match=message):
        estimate(kwargs.pop("model"), NODE_8X80, **kwargs)


CLI_30B = ["plan", "--params", "30B", "--devices", "8", "--device-memory", "80GB", "--devices-per-node", "8",
           "--interconnect", "100Gbps", "--intra-node", "600GB/s", "--flops", "312TFLOPS", "--layers", "48",
           "--hidden", "7168", "--seq-len", "2048", "--global-batch", "512"]


def test_cli_table(capsys):
    assert main(CLI_30B + ["--top", "5"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\* \S+ .* best$", out, re.M)
    assert "rejected strategies" in out and re.search(r"^  DP +8 .*does not fit: 4\d\d\.\d GB > 80\.0 GB", out, re.M)
    assert len([line for line in out.splitlines() if "slower:" in line]) == 4


def test_cli_json(capsys):
    assert main(CLI_30B + ["--json", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["best"]["fits"] and len(doc["layouts"]) == 3 and doc["hardware"]["num_devices"] == 8
    assert set(doc["best"]["memory_gb"]) >= {"params", "grads", "optimizer", "activations", "buffers", "total"}


def test_cli_reports_bad_input(capsys):
    assert main(CLI_30B[:-1] + ["512", "--device-memory", "80XB"]) == 2
    assert "unknown unit prefix 'X'" in capsys.readouterr().err
    assert main(["plan", "--params", "175B", "--devices", "8", "--global-batch", "64"]) == 2
    assert "nothing fits" in capsys.readouterr().err


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    assert main(CLI_30B + ["--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "memory plot written" in capsys.readouterr().out


def test_cli_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    import sys

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail
    assert main(CLI_30B + ["--plot", str(tmp_path / "m.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_ranks_sharing_compute_units_take_turns():
    spec = ModelSpec(num_params=100_000_000, num_layers=8, hidden_size=1024, seq_len=256)
    own = Hardware(num_devices=4, devices_per_node=4)
    shared = Hardware(num_devices=4, devices_per_node=4, compute_units_per_node=2)
    assert (own.sharing, shared.sharing) == (1.0, 2.0)
    dp = [estimate(spec, hw, dp=4, global_batch=16) for hw in (own, shared)]
    assert dp[1].compute_time == pytest.approx(2 * dp[0].compute_time)
    # a pipeline's bubble is another rank's compute time: with 2 of 4 ranks computing at once,
    # pp=4 with 8 micro-batches (bubble 3/11) costs the same compute as data parallelism
    pp = [estimate(spec, hw, dp=1, pp=4, micro_batches=8, global_batch=16) for hw in (own, shared)]
    assert pp[0].compute_time > dp[0].compute_time
    assert pp[1].compute_time == pytest.approx(dp[1].compute_time)
    with pytest.raises(ConfigError, match="compute_units_per_node must be an integer >= 1 or None"):
        Hardware(num_devices=4, compute_units_per_node=0)


# -- models bigger than one rank (issue 36) ---------------------------------------------------------------
def test_zero3_buffers_hold_the_largest_unit_and_its_gradient_embedding_included() -> None:
    # GPT-2 small's 50257 x 768 table is 5.5 layers' worth: ZeRO-3 gathers it whole, with its gradient.
    model = ModelSpec(num_params=124_439_808, num_layers=12, hidden_size=768, seq_len=1024, vocab_size=50257,
                      num_heads=12)
    hw = Hardware(num_devices=8, memory_per_device=80 * 10**9)
    zero3 = estimate(model, hw, dp=8, zero=3, global_batch=8, precision="fp32")
    zero2 = estimate(model, hw, dp=8, zero=2, global_batch=8, precision="fp32")
    table = 50257 * 768 * 4
    assert zero3.memory.buffers - zero2.memory.buffers == 2 * table


def test_checkpoint_bytes_spread_the_whole_state_over_every_device() -> None:
    model = ModelSpec.from_params("1B", seq_len=1024)
    for devices in (1, 8):
        c = estimate(model, Hardware(num_devices=devices, memory_per_device=80 * 10**9), dp=devices,
                     global_batch=8, precision="fp32", optimizer="adam")
        assert c.checkpoint_bytes == -(-(model.num_params * (4 + 8)) // devices)


def test_plan_reads_a_save_pretrained_directory(tmp_path, capsys) -> None:  # noqa: ANN001
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000,
              "n_positions": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path), "--devices", "2", "--device-memory", "1GB",
                 "--global-batch", "4", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"checkpoint: [\d.]+ MB written per device", out), out


# -- sequence and vocabulary parallelism (issue 37) ---------------------------------------------------------
def _gpt2_spec(**overrides: object) -> ModelSpec:
    """A GPT-2 (tied head, tanh GELU) as its Hugging Face config is counted."""
    config = {"model_type": "gpt2", "n_layer": 8, "n_embd": 1024, "n_head": 16, "vocab_size": 32000,
              "n_positions": 1024, **overrides}
    return ModelSpec.from_hf_config(config)


def test_sequence_parallel_splits_the_replicated_activations_over_tp() -> None:
    spec = _gpt2_spec()
    hw = Hardware(num_devices=2, memory_per_device=80 * 10**9)
    plain = estimate(spec, hw, dp=1, tp=2, global_batch=4, precision="fp32")
    sp = estimate(spec, hw, dp=1, tp=2, global_batch=4, precision="fp32", sequence_parallel=True)
    replicated, split = spec.saved_activations
    sbh = 1024 * 4 * 1024
    per_layer = (replicated / 2) * sbh * 4
    assert plain.memory.activations - sp.memory.activations == pytest.approx(8 * per_layer, rel=1e-9)
    assert (sp.memory.params, sp.comm_bytes, sp.step_time) == (plain.memory.params, plain.comm_bytes,
                                                                plain.step_time)
    # with recomputation only the layer inputs stay: one sequence part each
    ckpt = estimate(spec, hw, dp=1, tp=2, global_batch=4, precision="fp32", checkpointing=True)
    ckpt_sp = estimate(spec, hw, dp=1, tp=2, global_batch=4, precision="fp32", checkpointing=True,
                       sequence_parallel=True)
    assert ckpt.memory.activations - ckpt_sp.memory.activations == pytest.approx(
        8 * sbh * 4 / 2 + per_layer, rel=1e-9)
    assert sp.describe().endswith("sp") and sp.strategy == "TP+SP"


def test_vocab_parallel_splits_the_table_head_and_logits_over_tp() -> None:
    hw = Hardware(num_devices=4, memory_per_device=80 * 10**9)
    for tied in (True, False):
        spec = _gpt2_spec(tie_word_embeddings=tied)
        plain = estimate(spec, hw, dp=1, tp=4, global_batch=4, precision="fp32")
        vp = estimate(spec, hw, dp=1, tp=4, global_batch=4, precision="fp32", vocab_parallel=True)
        table = 32000 * 1024 * (1 if tied else 2)
        assert spec.vocab_params == table
        # the table (and an untied head) replicated on every tp rank, or a quarter of it each
        assert plain.memory.params - vp.memory.params == (table - table // 4) * 4
        # three copies of the full fp32 logits, or the rank's slice and its softmax
        logits = 4 * 1024 * 32000 * 4
        assert plain.memory.activations - vp.memory.activations == pytest.approx(3 * logits - 2 * logits / 4)
        assert vp.strategy == "TP+VP"
    # with a pipeline, the largest stage holds one V x h matrix (table on the first, head on the last)
    spec = _gpt2_spec(tie_word_embeddings=False)
    staged = estimate(spec, hw, dp=1, tp=2, pp=2, global_batch=4, precision="fp32")
    body = spec.num_params - spec.vocab_params
    assert staged.memory.params == (-(-body // 4) + 32000 * 1024) * 4


def test_sequence_and_vocab_parallel_need_tp() -> None:
    hw = Hardware(num_devices=2, memory_per_device=80 * 10**9)
    for flag in ("sequence_parallel", "vocab_parallel"):
        with pytest.raises(ConfigError, match=f"{flag} splits over tensor-parallel ranks, but tp=1"):
            estimate(_gpt2_spec(), hw, dp=2, global_batch=4, **{flag: True})
        with pytest.raises(ConfigError, match=f"{flag} must be True or False"):
            estimate(_gpt2_spec(), hw, dp=1, tp=2, global_batch=4, **{flag: 1})


def test_planner_turns_on_sequence_and_vocab_parallelism_when_memory_needs_them() -> None:
    spec = _gpt2_spec(n_positions=2048, vocab_size=128000)
    roomy = Hardware(num_devices=2, devices_per_node=2, memory_per_device=10**12)
    result = plan(spec, roomy, global_batch=2, precision="fp32", max_micro_batches=1)
    assert {(c.sequence_parallel, c.vocab_parallel) for c in result.candidates if c.tp == 2} == {
        (False, False), (True, False), (False, True), (True, True)}
    assert not any(c.sequence_parallel or c.vocab_parallel for c in result.candidates if c.tp == 1)
    off = plan(spec, roomy, global_batch=2, precision="fp32", sequence_and_vocab_parallel=False)
    assert not any(c.sequence_parallel or c.vocab_parallel for c in off.candidates)
    # memory between the split and the unsplit tp2 layouts: only vocabulary + sequence parallelism fits
    tp2 = [c for c in result.candidates if c.tp == 2 and c.micro_batches == 1 and not c.checkpointing]
    need = {(c.sequence_parallel, c.vocab_parallel): c.memory.total for c in tp2}
    assert need[(True, True)] < min(need[(True, False)], need[(False, True)]) < need[(False, False)]
    limit = (need[(True, True)] + min(need[(True, False)], need[(False, True)])) // 2
    tight = plan(spec, Hardware(num_devices=2, devices_per_node=2, memory_per_device=limit), global_batch=2,
                 precision="fp32", max_micro_batches=1)
    assert {(c.sequence_parallel, c.vocab_parallel) for c in tight.fitting
            if c.tp == 2 and not c.checkpointing} == {(True, True)}


def test_layout_from_plan_keeps_sequence_and_vocab_parallelism() -> None:
    from shardwise.core.layout import ParallelLayout

    spec = _gpt2_spec()
    hw = Hardware(num_devices=4, memory_per_device=80 * 10**9)
    cand = estimate(spec, hw, dp=2, tp=2, global_batch=4, precision="fp32", sequence_parallel=True,
                    vocab_parallel=True)
    layout = ParallelLayout.from_plan(cand)
    assert (layout.dp, layout.tp, layout.sequence_parallel, layout.vocab_parallel) == (2, 2, True, True)
    assert ParallelLayout.from_plan(cand.to_dict()) == layout
