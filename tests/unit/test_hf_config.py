"""Model specs from Hugging Face configs: exact parameter counts, presets and ``shardwise plan --model``."""

import json

import pytest

from shardwise.cli import main
from shardwise.core.errors import ConfigError
from shardwise.core.hf_config import HF_PRESETS, hf_model_fields, load_hf_config
from shardwise.core.model_spec import ModelSpec

SMALL_GPT2 = dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
SMALL_LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=160,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def test_presets_are_gpt2_small_and_llama_7b():
    gpt2 = ModelSpec.from_hf_config(load_hf_config("gpt2"))
    assert (gpt2.num_params, gpt2.num_layers, gpt2.hidden_size, gpt2.heads, gpt2.seq_len, gpt2.vocab_size) == \
        (124_439_808, 12, 768, 12, 1024, 50257)
    assert (gpt2.ffn_multiplier, gpt2.mlp_matrices, gpt2.num_kv_heads) == (4.0, 2, 12)
    llama = ModelSpec.from_hf_config(load_hf_config("llama"))
    assert (llama.num_params, llama.num_layers, llama.hidden_size, llama.heads, llama.seq_len, llama.vocab_size) == \
        (6_738_415_616, 32, 4096, 32, 2048, 32000)
    assert (llama.ffn_multiplier, llama.mlp_matrices, llama.num_kv_heads) == (11008 / 4096, 3, 32)
    assert load_hf_config("gpt2") is not HF_PRESETS["gpt2"]  # a copy: callers may edit it


def test_gpt2_count_by_hand():
    h, f, v, p = 64, 256, 256, 128
    layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * f + f) + (f * h + h)
    tied = v * h + p * h + 2 * layer + 2 * h
    assert hf_model_fields(SMALL_GPT2)["num_params"] == tied
    assert hf_model_fields({**SMALL_GPT2, "tie_word_embeddings": False})["num_params"] == tied + v * h
    assert hf_model_fields({**SMALL_GPT2, "n_inner": 100})["ffn_multiplier"] == 100 / 64


def test_llama_count_by_hand_and_layer_params():
    h, f, v, kv = 64, 160, 256, 2 * 16
    layer = h * h + 2 * h * kv + h * h + 3 * h * f + 2 * h
    spec = ModelSpec.from_hf_config(SMALL_LLAMA, seq_len=64)
    assert spec.num_params == v * h + 2 * layer + h + v * h
    assert spec.seq_len == 64 and spec.num_kv_heads == 2
    assert spec.layer_params == layer - 2 * h  # weights only, norms left out
    tied = ModelSpec.from_hf_config({**SMALL_LLAMA, "tie_word_embeddings": True})
    assert tied.num_params == spec.num_params - v * h


def test_missing_keys_take_the_transformers_defaults():
    medium = hf_model_fields({"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16})
    assert medium["num_params"] == 354_823_168  # GPT-2 medium
    assert hf_model_fields({"model_type": "llama"}) == hf_model_fields(HF_PRESETS["llama"])
    small = hf_model_fields({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    assert small["num_kv_heads"] == 4  # num_key_value_heads None -> heads; head_dim from hidden/heads


def test_existing_spec_behaviour_is_kept():
    spec = ModelSpec(num_params=10**9, num_layers=16, hidden_size=2048)
    assert spec.layer_params == 12 * 2048 ** 2 and spec.num_kv_heads == spec.heads and spec.mlp_matrices == 2


@pytest.mark.parametrize("config, message", [
    ({"model_type": "bert"}, "model_type 'bert'"),
    ({"n_layer": 2}, "model_type None"),
    ({**SMALL_GPT2, "n_embd": "64"}, "n_embd must be an integer"),
    ({**SMALL_GPT2, "tie_word_embeddings": None}, "tie_word_embeddings must be true or false"),
    ({**SMALL_LLAMA, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ([1, 2], "must be a mapping"),
])
def test_bad_configs(config, message):
    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_hf_config(config)


def test_bad_spec_fields():
    with pytest.raises(ConfigError, match="mlp_matrices"):
        ModelSpec(num_params=10, num_layers=1, hidden_size=64, mlp_matrices=4)
    with pytest.raises(ConfigError, match="not a multiple of num_kv_heads"):
        ModelSpec(num_params=10, num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=3)


def test_load_hf_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL_LLAMA))
    assert load_hf_config(str(path)) == SMALL_LLAMA
    with pytest.raises(ConfigError, match="neither a preset"):
        load_hf_config(str(tmp_path / "missing.json"))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_hf_config(str(path))
    path.write_text("[]")
    with pytest.raises(ConfigError, match="not a config object"):
        load_hf_config(str(path))


@pytest.mark.parametrize("kind, config", [
    ("gpt2", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)),
    ("gpt2", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128, n_inner=100,
                  tie_word_embeddings=False)),
    ("llama", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)),
    ("llama", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                   vocab_size=256, max_position_embeddings=128, tie_word_embeddings=True, attention_bias=True,
                   mlp_bias=True, head_dim=32)),
    ("mistral", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)),
    ("qwen2", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)),
    ("qwen2", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=True)),
])
def test_counts_match_transformers(kind, config):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    cfg = transformers.AutoConfig.for_model(kind, bos_token_id=0, eos_token_id=0, **config)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    expected = sum(p.numel() for p in model.parameters())  # shared (tied) tensors are listed once
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    assert spec.num_params == expected
    assert ModelSpec.from_hf_config({"model_type": kind, **config}).num_params == expected
    assert spec.tied_embeddings == (model.get_output_embeddings().weight is model.get_input_embeddings().weight)


def test_presets_match_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    for name, cls in (("gpt2", transformers.GPT2Config), ("llama", transformers.LlamaConfig),
                      ("mistral", transformers.MistralConfig), ("qwen2", transformers.Qwen2Config)):
        defaults = cls().to_dict()
        assert hf_model_fields(defaults) == hf_model_fields(HF_PRESETS[name])


PLAN = ["plan", "--devices", "4", "--global-batch", "8", "--json"]


def test_cli_plan_model(capsys, tmp_path):
    assert main(PLAN + ["--model", "gpt2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["num_params"] == 124_439_808 and doc["model"]["seq_len"] == 1024
    assert {"dp", "tp", "pp", "zero", "micro_batches", "checkpointing"} <= set(doc["best"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL_LLAMA))
    assert main(PLAN + ["--model", str(path), "--seq-len", "256"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["seq_len"] == 256 and doc["model"]["num_kv_heads"] == 2
    assert main(PLAN + ["--params", "125M"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["seq_len"] == 2048


def test_cli_plan_model_errors(capsys):
    assert main(PLAN + ["--model", "gpt2", "--layers", "4"]) == 2
    assert "--layers cannot be combined with --model" in capsys.readouterr().err
    assert main(PLAN + ["--model", "gpt3"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    for argv in (PLAN, PLAN + ["--model", "gpt2", "--params", "1B"]):
        with pytest.raises(SystemExit):
            main(argv)
