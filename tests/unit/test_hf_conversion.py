"""weights= through transformers' conversion mapping: per-expert checkpoint tensors read as the model's fused
experts, any box, reading only the experts it covers; and the reverse for save_pretrained (one process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from shardwise.adapters.torch.parallel.hf_conversion import export_tensors, pretrained_source  # noqa: E402
from shardwise.core.errors import CheckpointError, ConfigError  # noqa: E402
from shardwise.core.placement import Placement  # noqa: E402


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "deepseek_v3"])
def saved(request, tmp_path_factory):
    from moe_ep import build

    model = build(request.param, 4, seed=3)
    where = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(where))
    return model, where


def _recording(source):
    read: list[str] = []
    original = source._key_file

    def key_file(key):
        read.append(key)
        return original(key)
    source._key_file = key_file
    return read


def test_every_tensor_reads_as_the_models(saved) -> None:
    model, where = saved
    source = pretrained_source(where, model)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    source.check(expected)
    assert source.stacked, "the checkpoint's per-expert tensors were not recognised"
    for name, p in model.named_parameters():
        assert torch.equal(source.read_whole(name), p.detach()), name


def test_boxes_of_fused_experts_read_only_their_experts(saved) -> None:
    model, where = saved
    source = pretrained_source(where, model)
    params = dict(model.named_parameters())
    for name in source.stacked:
        full = params[name].detach()
        e, rows, cols = full.shape
        # ep ranks (dim 0), tp's packed gate/up halves (dim 1, 2 parts), a column split (dim 2)
        shape = tuple(full.shape)
        for placement in [Placement(name, shape, 0, 1, 2, 1), Placement(name, shape, 1, 2, 2, 0),
                          Placement(name, shape, 2, 1, 2, 1)]:
            read = _recording(source)
            want = torch.cat([full[box] for box in placement.boxes()], dim=placement.dim)
            assert torch.equal(source.read(name, placement), want), (name, placement)
            experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read}
            assert experts == (set(range(2, 4)) if placement.dim == 0 else set(range(e))), (name, experts)
        read = _recording(source)
        box = (slice(1, 3), slice(rows // 4, 3 * rows // 4), slice(1, cols - 1))
        assert torch.equal(source.read_box(name, box), full[box])
        assert {int(k.split(".experts.")[1].split(".")[0]) for k in read} == {1, 2}


def test_export_writes_transformers_keys_and_tensors(saved) -> None:
    from safetensors.torch import load_file

    model, where = saved
    stored = load_file(str(where / "model.safetensors"))
    written: dict = {}
    for name, p in model.named_parameters():
        meta = export_tensors(model, name, torch.empty(p.shape, device="meta"))
        real = export_tensors(model, name, p.detach())
        assert {k: tuple(t.shape) for k, t in meta.items()} == {k: tuple(t.shape) for k, t in real.items()}
        written.update(real)
    for name, buf in model.named_buffers():
        if name in stored:
            written.update(export_tensors(model, name, buf))
    assert sorted(written) == sorted(stored)
    for k, t in stored.items():
        assert torch.equal(written[k], t), k


def test_missing_half_of_a_fused_tensor_and_unknown_conversions_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)
    from transformers.core_model_loading import Transpose, WeightConverter

    from moe_ep import build

    model = build("qwen3_moe", 4, seed=3)
    model.save_pretrained(str(tmp_path / "ok"))
    tensors = {k: v for k, v in load_file(str(tmp_path / "ok" / "model.safetensors")).items() if "up_proj" not in k
               or "shared" in k}
    (tmp_path / "no_up").mkdir()
    save_file(tensors, str(tmp_path / "no_up" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.gate_up_proj: the checkpoint has .*gate_proj.* but no "
                                              r"key matching mlp\.experts\.\*\.up_proj\.weight"):
        pretrained_source(tmp_path / "no_up", model)
    original = get_checkpoint_conversion_mapping("qwen3_moe")
    odd = [WeightConverter(source_patterns="mlp.experts.*.down_proj.weight", target_patterns="mlp.experts.down_proj",
                           operations=[Transpose(1, 2)]), original[0]]
    register_checkpoint_conversion_mapping("qwen3_moe", odd, overwrite=True)
    try:
        with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.experts\.down_proj from "
                                              r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight.* by Transpose"):
            pretrained_source(tmp_path / "ok", model)
    finally:
        register_checkpoint_conversion_mapping("qwen3_moe", original, overwrite=True)
