"""A ParallelModel checkpoint exported to Hugging Face and through DCP and back, in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import shardwise  # noqa: E402
from shardwise.cli import main as cli  # noqa: E402
from shardwise.core.errors import CheckpointError  # noqa: E402


@pytest.fixture()
def local() -> None:
    shardwise.init(backend="local")
    yield
    shardwise.shutdown()


def _trained(steps: int = 2):  # noqa: ANN202
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardwise.torch import ParallelLayout, parallelize

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    pm = parallelize(model, torch.optim.AdamW, ParallelLayout(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        pm.train_step(torch.randint(0, 96, (4, 16), generator=gen))
    return pm


def _state(pm) -> dict[str, torch.Tensor]:  # noqa: ANN001
    out = {n: p.detach().clone() for n, p in pm.module.named_parameters()}
    for p, state in pm.optimizer.state.items():
        name = pm.tensors.name(p)
        out.update({f"{name}/{k}": v.clone() for k, v in state.items()})
    return out


def test_export_hf_gives_the_trained_logits(tmp_path: Path, local: None) -> None:
    from transformers import AutoModelForCausalLM

    pm = _trained()
    pm.save_checkpoint(tmp_path / "ckpts", 2)
    assert cli(["checkpoint", "export", "--hf", str(tmp_path / "ckpts"), str(tmp_path / "hf")]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert not any(k.startswith(("optimizer/", "rng/")) for k in index["weight_map"])
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        want = pm.module(ids)
        got = exported(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dcp_round_trip_restores_model_and_optimizer(tmp_path: Path, local: None) -> None:
    import torch.distributed.checkpoint as dcp

    pm = _trained()
    pm.save_checkpoint(tmp_path / "ckpts", 2, extra={"next_batch": 2})
    want = _state(pm)
    assert cli(["checkpoint", "export", "--dcp", str(tmp_path / "ckpts"), str(tmp_path / "dcp")]) == 0
    # What a torch user sees: get_state_dict's layout, full parameter names.
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    assert "model.transformer.wte.weight" in meta and "optim.state.transformer.wte.weight.exp_avg" in meta
    assert cli(["checkpoint", "export", "--from-dcp", str(tmp_path / "dcp"), str(tmp_path / "back"),
                "--step", "2"]) == 0
    fresh = _trained(steps=0)
    extra = fresh.load_checkpoint(tmp_path / "back")
    assert extra == {"next_batch": 2, "step": 2}
    got = _state(fresh)
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_export_refuses_an_incomplete_directory(tmp_path: Path) -> None:
    (tmp_path / "ckpt-3").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        from shardwise.adapters.torch.checkpoint.convert import export_hf

        export_hf(tmp_path, tmp_path / "out")
