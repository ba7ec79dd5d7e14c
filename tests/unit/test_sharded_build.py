"""Placements, the replayed initialisation, streamed safetensors and the weight sources, in one process."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.core.errors import CheckpointError, ConfigError
from shardwise.core.placement import Placement, split_ranges, uneven_range

torch = pytest.importorskip("torch")


# -- placements (pure maths) -------------------------------------------------------------------------
def test_split_ranges_give_each_rank_its_slice_of_every_part() -> None:
    assert split_ranges(12, 3, 2, 0) == ((0, 2), (4, 6), (8, 10))
    assert split_ranges(12, 3, 2, 1) == ((2, 4), (6, 8), (10, 12))
    assert split_ranges(8, 1, 4, 3) == ((6, 8),)


def test_an_uneven_split_gives_blocks_of_the_ceiling_and_the_last_rank_the_rest() -> None:
    assert [uneven_range(97, 4, r) for r in range(4)] == [(0, 25), (25, 50), (50, 75), (75, 97)]
    assert [uneven_range(96, 4, r) for r in range(4)] == [(0, 24), (24, 48), (48, 72), (72, 96)]
    with pytest.raises(ConfigError, match="5 rows leave a rank of 4 without any"):
        uneven_range(5, 4, 0)
    full = np.arange(97 * 3).reshape(97, 3)
    pieces = [Placement("w", (97, 3), 0, 1, 4, r, uneven=True) for r in range(4)]
    assert [p.local_shape for p in pieces] == [(25, 3), (25, 3), (25, 3), (22, 3)]
    assert np.array_equal(pieces[0].merge([p.take(full) for p in pieces]), full)
    with pytest.raises(ConfigError, match="one part"):
        Placement("w", (96, 3), 0, 3, 2, 0, uneven=True)


@pytest.mark.parametrize("length, parts, size, rank", [(10, 3, 1, 0), (12, 3, 8, 0), (8, 1, 2, 2), (8, 0, 2, 0)])
def test_split_ranges_refuse_what_does_not_split(length: int, parts: int, size: int, rank: int) -> None:
    with pytest.raises(ConfigError):
        split_ranges(length, parts, size, rank)


@pytest.mark.parametrize("dim, parts, transpose", [(0, 1, False), (1, 1, False), (1, 3, True), (0, 3, True),
                                                   (None, 1, False)])
def test_take_then_merge_is_the_whole_tensor(dim: int, parts: int, transpose: bool) -> None:
    full = np.arange(12 * 18, dtype=np.float32).reshape(12, 18)
    size = 1 if dim is None else 2
    places = [Placement("w", (12, 18), dim, parts, size, r, transpose) for r in range(size)]
    pieces = [p.take(full) for p in places]
    for p, piece in zip(places, pieces):
        assert piece.shape == p.local_shape
    merged = places[0].merge(pieces) if dim is not None else pieces[0]
    np.testing.assert_array_equal(merged, full)


def test_placement_refuses_a_bad_split() -> None:
    with pytest.raises(ConfigError, match="split dim 2"):
        Placement("w", (4, 4), dim=2, size=2)
    with pytest.raises(ConfigError, match="transposed"):
        Placement("b", (4,), dim=0, size=2, transpose=True)


def test_torch_take_and_merge_match_the_numpy_reference() -> None:
    from shardwise.adapters.torch.parallel.weights import merge, take

    full = torch.randn(8, 12)
    places = [Placement("w", (8, 12), 1, 3, 2, r, True) for r in range(2)]
    pieces = [take(full, p) for p in places]
    for p, piece in zip(places, pieces):
        np.testing.assert_array_equal(piece.numpy(), p.take(full.numpy()))
    assert torch.equal(merge(pieces, places[0]), full)


# -- replayed initialisation ----------------------------------------------------------------------------
def _gpt2_config():  # noqa: ANN202
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)


def _llama_config():  # noqa: ANN202
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=128, vocab_size=1000,
                                    max_position_embeddings=64)


@pytest.mark.parametrize("config", [_gpt2_config, _llama_config], ids=["gpt2", "llama"])
def test_replayed_init_equals_a_normal_build_tensor_by_tensor(config) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    from shardwise.adapters.torch.parallel.init_replay import record_init

    torch.manual_seed(3)
    ref = AutoModelForCausalLM.from_config(config())
    after_normal = torch.rand(5)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config())
    record = record_init(meta, threshold=1000)
    assert torch.equal(torch.rand(5), after_normal), "the generator must end where a normal build leaves it"
    tensors = dict(ref.named_parameters(remove_duplicate=False))
    tensors.update(dict(ref.named_buffers()))
    for name, want in tensors.items():
        assert torch.equal(record.full(name), want.detach()), name
    assert not any(p.numel() >= 1000 and not p.is_meta for p in record.model.parameters()), \
        "large tensors must never be allocated whole while recording"


def test_replayed_init_of_a_plain_module_replays_reset_parameters() -> None:
    from shardwise.adapters.torch.parallel.init_replay import record_init

    torch.manual_seed(5)
    ref = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10))
    torch.manual_seed(5)
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10))
    record = record_init(meta)
    for name, p in ref.named_parameters():
        assert torch.equal(record.full(name), p.detach()), name


class _ReadsItsWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(300, 300))  # initialised by reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.weight)
        self.scale = float(self.weight.std())  # an out-of-place read of the whole tensor


def test_an_init_that_reads_a_large_tensor_is_refused_by_name() -> None:
    from shardwise.adapters.torch.parallel.init_replay import UnreplayableInitError, record_init

    with torch.device("meta"):
        model = torch.nn.Sequential(_ReadsItsWeight())
    with pytest.raises(UnreplayableInitError, match="std"):
        record_init(model, threshold=100)


# -- streamed safetensors ---------------------------------------------------------------------------------
def test_streamed_file_reads_back_with_safetensors(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    from shardwise.checkpoint.safetensors_stream import SafetensorsWriter

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16(),
               "s": torch.tensor(3.0)}
    codes = {torch.float32: "F32", torch.int64: "I64", torch.bfloat16: "BF16"}
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        out = SafetensorsWriter(f, [(k, codes[t.dtype], tuple(t.shape)) for k, t in tensors.items()],
                                {"format": "pt"})
        for k, t in tensors.items():
            out.write(k, t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out.close()
    back = safetensors.load_file(str(path))
    for k, t in tensors.items():
        assert torch.equal(back[k], t), k


def test_streamed_file_refuses_out_of_order_or_missing_tensors() -> None:
    from shardwise.checkpoint.safetensors_stream import SafetensorsWriter

    out = SafetensorsWriter(io.BytesIO(), [("a", "F32", (2,)), ("b", "F32", (1,))])
    with pytest.raises(CheckpointError, match="'b' written where 'a' was due"):
        out.write("b", b"\0" * 4)
    with pytest.raises(CheckpointError, match="header says 8"):
        out.write("a", b"\0" * 4)
    out.write("a", b"\0" * 8)
    with pytest.raises(CheckpointError, match="never written"):
        out.close()


# -- weight sources ------------------------------------------------------------------------------------------
def test_pretrained_directory_reads_only_pieces_and_names_what_differs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from shardwise.adapters.torch.parallel.weights import SafetensorsSource

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_gpt2_config())
    model.save_pretrained(str(tmp_path), max_shard_size="50KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    source = SafetensorsSource.from_pretrained_dir(tmp_path)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    source.check(expected)
    name = "transformer.h.1.attn.c_attn.weight"
    full = dict(model.named_parameters())[name].detach()
    placement = Placement(name, tuple(full.shape), 1, 3, 2, 1, transpose=True)
    assert torch.equal(source.read(name, placement), torch.from_numpy(placement.take(full.numpy())))
    with pytest.raises(CheckpointError, match=r"missing extra\.weight.*shape differs for transformer\.wte\.weight"):
        source.check({**expected, "extra.weight": (2,), "transformer.wte.weight": (3, 3)})
    with pytest.raises(CheckpointError, match="unexpected lm_head"):
        SafetensorsSource({"lm_head.weight": tmp_path / "x"}, "d").check({})
    source.close()


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    from shardwise.adapters.torch.parallel.weights import SafetensorsSource

    with pytest.raises(CheckpointError, match="no model.safetensors"):
        SafetensorsSource.from_pretrained_dir(tmp_path)


def test_plain_reads_match_safetensors_and_name_a_truncated_file(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    from shardwise.adapters.torch.checkpoint.safetensors_torch import TorchSafetensorsFile as SafetensorsFile

    tensors = {"w": torch.randn(6, 10), "b": torch.randn(4).bfloat16(), "s": torch.tensor(2.0),
               "i": torch.arange(12, dtype=torch.int64).reshape(3, 4)}
    path = tmp_path / "x.safetensors"
    safetensors.save_file(tensors, str(path))
    with SafetensorsFile(path) as f:
        assert sorted(f.keys()) == sorted(tensors) and f.shape("w") == (6, 10)
        for name, t in tensors.items():
            assert torch.equal(f.read(name), t), name
        assert torch.equal(f.read("w", (slice(2, 5), slice(3, 7))), tensors["w"][2:5, 3:7])
        assert torch.equal(f.read("i", (slice(1, 3),)), tensors["i"][1:3])
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=r"x\.safetensors: truncated"):
        SafetensorsFile(path)
    path.write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        SafetensorsFile(path)
