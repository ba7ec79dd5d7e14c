"""Atomic writes, manifests, checksums, latest-complete selection and torch helpers (no processes)."""

from __future__ import annotations

import json
import os
import random
import zlib
from pathlib import Path

import numpy as np
import pytest

from shardwise import checkpoint as ck
from shardwise.core.errors import CheckpointError


def _save(root: Path, step: int, value: float = 1.0) -> Path:
    arrays = {"w": np.full((3, 4), value, np.float32), "b": np.arange(4)}
    return ck.save_checkpoint(root, step, {"model.npz": lambda f: np.savez(f, **arrays), "note.txt": b"hi"},
                              metadata={"position": {"epoch": 0, "step": step}})


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.bin"
    ck.atomic_write_bytes(target, b"one")
    ck.atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.bin"]


def test_atomic_save_failure_keeps_old_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    ck.atomic_write_bytes(target, b"old")

    def broken(f) -> None:
        f.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ck.atomic_save(broken, target)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_manifest_layout_and_roundtrip(tmp_path: Path) -> None:
    path = _save(tmp_path, 7)
    assert path == tmp_path / "ckpt-7"
    raw = json.loads((path / "manifest.json").read_text())
    assert list(raw)[-1] == "complete" and raw["complete"] is True
    assert raw["step"] == 7 and raw["world_size"] == 1 and set(raw["files"]) == {"model.npz", "note.txt"}
    assert raw["files"]["note.txt"] == {"size": 2, "block_size": 1 << 20, "crc32": f"{zlib.crc32(b'hi'):08x}"}
    loaded = ck.load_checkpoint(path)
    assert loaded.step == 7 and loaded.metadata == {"position": {"epoch": 0, "step": 7}}
    arrays = loaded.arrays("model.npz")
    assert arrays["w"].dtype == np.float32 and (arrays["b"] == np.arange(4)).all()
    with pytest.raises(CheckpointError, match="has no file 'x.pt'; it has: model.npz, note.txt"):
        loaded.file("x.pt")


@pytest.mark.parametrize("damage, message", [
    ("truncate", "file 'model.npz' is truncated: 10 bytes, the manifest says"),
    ("flip", "file 'model.npz' is corrupt: block 0 (bytes"),
    ("delete", "file 'model.npz' listed in the manifest is missing"),
    ("no_manifest", "is incomplete: it has no manifest.json (the save was interrupted)"),
    ("bad_manifest", "manifest.json is unreadable or corrupt"),
])
def test_damaged_newest_is_refused_and_previous_is_chosen(tmp_path: Path, damage: str, message: str) -> None:
    good = _save(tmp_path, 10)
    good_bytes = {p.name: p.read_bytes() for p in good.iterdir()}
    bad = _save(tmp_path, 20, value=2.0)
    model = bad / "model.npz"
    if damage == "truncate":
        model.write_bytes(model.read_bytes()[:10])
    elif damage == "flip":
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0xFF
        model.write_bytes(bytes(data))
    elif damage == "delete":
        model.unlink()
    elif damage == "no_manifest":
        (bad / "manifest.json").unlink()
    else:
        (bad / "manifest.json").write_text('{"format": "shardwise-checkpoint/1", "step": 2')
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ck.load_checkpoint(bad)
    assert ck.latest_checkpoint(tmp_path) == good
    assert {p.name: p.read_bytes() for p in good.iterdir()} == good_bytes
    assert ck.load_checkpoint(good).arrays("model.npz")["w"][0, 0] == 1.0


def test_latest_orders_steps_numerically_and_handles_empty(tmp_path: Path) -> None:
    assert ck.latest_checkpoint(tmp_path / "none") is None
    for step in (9, 10, 100):
        _save(tmp_path, step)
    (tmp_path / "ckpt-x").mkdir()
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "ckpt-100"
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [9, 10, 100]


def test_resave_same_step_and_keep(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, step, {"a.bin": b"x" * step}, keep=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 3]
    ck.save_checkpoint(tmp_path, 3, {"a.bin": b"new"})
    assert ck.load_checkpoint(tmp_path / "ckpt-3").read_bytes("a.bin") == b"new"


def test_bad_file_names_and_metadata(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="bad checkpoint file name '../x'"):
        ck.save_checkpoint(tmp_path, 1, {"../x": b""})
    with pytest.raises(CheckpointError, match="metadata must be JSON data"):
        ck.save_checkpoint(tmp_path, 2, {"a": b""}, metadata={"obj": object()})


def test_arrays_refuse_pickle(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="dtype object"):
        ck.save_arrays(tmp_path / "a.npz", {"x": np.array([{"a": 1}], dtype=object)})
    np.savez(tmp_path / "evil.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        ck.load_arrays(tmp_path / "evil.npz")
    ck.save_arrays(tmp_path / "ok.npz", {"x": np.arange(3)})
    assert ck.load_arrays(tmp_path / "ok.npz")["x"].tolist() == [0, 1, 2]


def test_rng_capture_restore_roundtrip() -> None:
    torch = pytest.importorskip("torch")
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(ck.capture_rng()))  # must survive JSON
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ck.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    with pytest.raises(CheckpointError, match="cannot restore RNG state"):
        ck.restore_rng({"python": {}})


def test_mismatch_lists_every_kind_of_difference() -> None:
    model = {"fc.weight": (4, 3), "fc.bias": (4,), "head.weight": (2, 4)}
    found = {"fc.weight": (4, 5), "fc.bias": (4,), "extra.scale": ()}
    with pytest.raises(CheckpointError) as info:
        ck.check_mismatch(model, found)
    assert str(info.value) == ("checkpoint does not match the model: missing from the checkpoint (1): head.weight; "
                               "unexpected in the checkpoint (1): extra.scale; shape differs (1): "
                               "fc.weight checkpoint (4, 5) vs model (4, 3)")
    ck.check_mismatch(model, dict(model))


def test_torch_helpers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from shardwise.adapters.torch.checkpoint.training import check_state_dict, load_torch, restore_training, save_torch, save_training

    model = torch.nn.Linear(3, 2)
    save_torch(model.state_dict(), tmp_path / "m.pt")
    assert torch.equal(load_torch(tmp_path / "m.pt")["weight"], model.weight)
    torch.save({"obj": Path("x")}, tmp_path / "evil.pt")  # a pickled non-tensor object
    with pytest.raises(CheckpointError, match="refused to load with weights_only=True"):
        load_torch(tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(1\): bias; shape differs"):
        check_state_dict(torch.nn.Linear(4, 2), {"weight": torch.zeros(2, 3)})

    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_training(tmp_path / "run", 5, model=model, optimizer=opt, position={"epoch": 1, "step": 5})
    fresh, fresh_opt = torch.nn.Linear(3, 2), None
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    info = restore_training(tmp_path / "run", model=fresh, optimizer=fresh_opt)
    assert info is not None and info["step"] == 5 and info["position"] == {"epoch": 1, "step": 5}
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert restore_training(tmp_path / "empty", model=fresh) is None
    with pytest.raises(CheckpointError, match="does not match the model"):
        restore_training(tmp_path / "run", model=torch.nn.Linear(5, 2))
    assert os.path.exists(tmp_path / "run" / "ckpt-5" / "rng-rank-00000.json")
