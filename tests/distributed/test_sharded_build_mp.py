"""Meta-device builds, Hugging Face weights in and out, and checkpoints across layouts, on real ranks."""

import json
from pathlib import Path

import pytest

from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.mpi


def _ok(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


TWO_RANKS = [
    ["gpt2", {"dp": 2}],
    ["gpt2", {"dp": 2, "zero_stage": 3}],
    ["llama", {"tp": 2}],
    ["llama", {"pp": 2, "micro_batches": 2}],
]

FOUR_RANKS = [
    ["gpt2", {"tp": 2, "pp": 2, "micro_batches": 2}],
    ["llama", {"tp": 2, "pp": 2, "micro_batches": 2}],
    ["gpt2", {"dp": 2, "tp": 2, "zero_stage": 3}],
    ["llama", {"dp": 2, "tp": 2, "zero_stage": 2}],
    ["gpt2", {"pp": 2, "dp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"}],
]


def test_meta_build_starts_from_one_process_weights_on_two_ranks() -> None:
    result = run_mpi(2, "sharded_build:meta_init", backend="torch", cases=TWO_RANKS, timeout=240, shared=True)
    assert len(_ok(result.output, "OK meta")) == len(TWO_RANKS), result.output[-3000:]


def test_meta_build_starts_from_one_process_weights_on_four_ranks() -> None:
    result = run_mpi(4, "sharded_build:meta_init", backend="mpi", cases=FOUR_RANKS, timeout=300, shared=True)
    assert len(_ok(result.output, "OK meta")) == len(FOUR_RANKS), result.output[-3000:]


def test_pretrained_weights_load_into_each_layout_and_export_to_transformers(tmp_path: Path) -> None:
    two = [["gpt2", {"dp": 2, "zero_stage": 3}], ["llama", {"tp": 2}]]
    four = [["gpt2", {"tp": 2, "pp": 2, "micro_batches": 2}], ["llama", {"dp": 2, "tp": 2, "zero_stage": 3}]]
    result = run_mpi(2, "sharded_build:hf_weights", backend="mpi", directory=str(tmp_path), cases=two,
                     timeout=240, shared=True)
    assert len(_ok(result.output, "OK weights")) == len(two), result.output[-3000:]
    result = run_mpi(4, "sharded_build:hf_weights", backend="torch", directory=str(tmp_path), cases=four,
                     timeout=300, shared=True)
    assert len(_ok(result.output, "OK weights")) == len(four), result.output[-3000:]


def _resume(np_: int, directory: Path, fields: dict, start: int, stop: int, *, kill: bool = False,
            save: bool = True, optimizer: str = "sgd", family: str = "gpt2") -> str:
    result = run_mpi(np_, "sharded_build:resume", backend="mpi", directory=str(directory), family=family,
                     fields=fields, start=start, stop=stop, save=save, kill=kill, optimizer=optimizer,
                     timeout=240, expect_ok=not kill)
    assert len(_ok(result.output, "OK resume")) == 1, result.output[-3000:]
    if kill:
        assert result.returncode != 0, "the ranks were to be killed after the save"
    return result.output


def test_checkpoint_resumes_on_other_layouts_and_world_sizes_after_kill(tmp_path: Path) -> None:
    # tp2 x pp2 on 4 ranks, SIGKILLed right after saving; dp2 ZeRO-3 with accumulation on 2; dp2 x tp2 on 4.
    _resume(4, tmp_path, {"tp": 2, "pp": 2, "micro_batches": 2}, 0, 2, kill=True)
    _resume(2, tmp_path, {"dp": 2, "zero_stage": 3, "gradient_accumulation_steps": 2}, 2, 4)
    _resume(4, tmp_path, {"dp": 2, "tp": 2}, 4, 6, save=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-2", "ckpt-4"]


def test_adamw_state_round_trips_bit_for_bit(tmp_path: Path) -> None:
    fields = {"dp": 2, "zero_stage": 3}
    _resume(2, tmp_path, fields, 0, 2, optimizer="adamw", family="llama")
    out = _resume(2, tmp_path, fields, 2, 4, save=False, optimizer="adamw", family="llama")
    assert "39 parameters equal" in out


SAVE_CASES = [
    ["gpt2", {"dp": 4}, {"pp": 2, "dp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"}],
    ["gpt2", {"pp": 2, "dp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"},
     {"dp": 2, "tp": 2, "zero_stage": 1}],
    ["llama", {"dp": 2, "tp": 2, "zero_stage": 2}, {"tp": 2, "pp": 2, "micro_batches": 2}],
    ["llama", {"dp": 4, "zero_stage": 1, "precision": "bf16"},
     {"dp": 2, "tp": 2, "zero_stage": 3, "precision": "bf16"}],
    ["gpt2", {"dp": 2, "pp": 2, "micro_batches": 2, "precision": "bf16"},
     {"dp": 4, "zero_stage": 2, "precision": "bf16"}],
    ["llama", {"dp": 2, "pp": 2, "micro_batches": 2, "zero_stage": 1}, {"dp": 2, "tp": 2}],
    ["gpt2", {"dp": 2, "pp": 2, "micro_batches": 2, "zero_stage": 2},
     {"dp": 2, "pp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b", "zero_stage": 1}],
    ["gpt2:97", {"tp": 2, "pp": 2, "micro_batches": 2, "vocab_parallel": True},
     {"dp": 2, "tp": 2, "zero_stage": 2, "vocab_parallel": True}],
]


def test_every_layout_saves_its_pieces_and_another_layout_loads_them(tmp_path: Path) -> None:
    # Replicas write once (dp4), tied embeddings across interleaved stages, ZeRO shards of tensor-parallel
    # slices, bf16 with fp32 masters in ZeRO and without it, ZeRO with a pipeline, vocabulary slices of
    # unequal sizes.
    result = run_mpi(4, "sharded_build:save_layouts", backend="mpi", directory=str(tmp_path), cases=SAVE_CASES,
                     timeout=300, shared=True)
    assert len(_ok(result.output, "OK save")) == len(SAVE_CASES), result.output[-3000:]


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    result = run_mpi(2, "sharded_build:kill_mid_save", backend="mpi", directory=str(tmp_path), timeout=180,
                     expect_ok=False)
    assert "killing rank 1 mid-save" in result.output and result.returncode != 0, result.output[-3000:]
    assert (tmp_path / "ckpt-1" / "manifest.json").exists()
    assert not (tmp_path / "ckpt-2" / "manifest.json").exists()
    manifest = json.loads((tmp_path / "ckpt-1" / "manifest.json").read_text())
    assert manifest["metadata"]["extra"] == {"next_batch": 1}
    _resume(2, tmp_path, {"dp": 2, "zero_stage": 3}, 1, 2, save=False)


def test_bad_weights_and_checkpoints_are_refused_on_every_rank(tmp_path: Path) -> None:
    result = run_mpi(2, "sharded_build:bad_inputs", backend="mpi", directory=str(tmp_path), timeout=240, shared=True)
    assert len(_ok(result.output, "OK refused")) == 6, result.output[-3000:]
    assert "OK nothing changed by the refused loads" in result.output
