"""Flat element ranges read with numpy from a shardwise-state checkpoint's safetensors pieces, and Keras models
through the door, one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardwise.checkpoint.door import pieces_writer
from shardwise.checkpoint.flat_pieces import WHOLE_PLACEMENT, FlatPiecesReader, safetensors_code
from shardwise.checkpoint.store import save_checkpoint
from shardwise.core.errors import CheckpointError
from shardwise.core.zero import PartitionPlan

ROOT = Path(__file__).resolve().parents[2]


def _write(where: Path, tensor: np.ndarray, bounds: list[tuple[int, int, int]],
           placement: list = list(WHOLE_PLACEMENT)) -> tuple[list[str], dict]:
    """``tensor``'s elements ``[a, b)`` stored as file ``f``'s piece for each ``(f, a, b)``, as the door lays
    them out; returns the files and the tensor table."""
    flat = tensor.reshape(-1)
    files = sorted({f"rank-{f:05d}.safetensors" for f, _, _ in bounds})
    listed: dict[str, list] = {name: [] for name in files}
    pieces = []
    for i, (f, a, b) in enumerate(bounds):
        stored = f"t#{i}"
        chunk = np.ascontiguousarray(flat[a:b])
        listed[f"rank-{f:05d}.safetensors"].append(
            (stored, safetensors_code(chunk.dtype), (b - a,), lambda c=chunk: memoryview(c.view(np.uint8))))
        pieces.append([files.index(f"rank-{f:05d}.safetensors"), stored, placement, a, b])
    save_checkpoint(where, 1, {name: pieces_writer(items) for name, items in listed.items()})
    return files, {"t": {"shape": list(tensor.shape), "dtype": safetensors_code(tensor.dtype), "pieces": pieces}}


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
def test_any_range_reads_back_exactly(tmp_path: Path, dtype: str) -> None:
    tensor = np.arange(5 * 7).astype(dtype).reshape(5, 7)
    files, table = _write(tmp_path, tensor, [(0, 0, 12), (1, 12, 20), (2, 20, 35)])
    reader = FlatPiecesReader.from_table(files, table, tmp_path / "ckpt-1")
    try:
        np.testing.assert_array_equal(reader.read_whole("t"), tensor)
        assert reader.read_whole("t").dtype == tensor.dtype
        for a, b in [(0, 1), (3, 17), (10, 35), (34, 35), (12, 12), (11, 21)]:
            np.testing.assert_array_equal(reader.read("t", a, b), tensor.reshape(-1)[a:b])
        plan = PartitionPlan.build([("0:t", (5, 7))], 3)
        for r in range(3):  # re-split for another world size, into another dtype
            out = np.zeros(plan.shard_numel, np.float32)
            reader.read_into(out, [("t", p.param_offset, p.shard_offset, p.length) for p in plan.rank_params(r)])
            want = np.zeros(plan.padded_numel, np.float32)
            want[:35] = tensor.reshape(-1)
            start, end = plan.owned_range(r)
            np.testing.assert_array_equal(out, want[start:end])
        with pytest.raises(CheckpointError, match="outside tensor 't'"):
            reader.read("t", 30, 36)
        with pytest.raises(CheckpointError, match="has no tensor 'u'"):
            reader.read_whole("u")
    finally:
        reader.close()


def test_a_gap_a_slice_and_a_damaged_block_are_refused(tmp_path: Path) -> None:
    tensor = np.arange(40, dtype=np.float32)
    files, table = _write(tmp_path / "gap", tensor, [(0, 0, 10), (1, 20, 40)])
    reader = FlatPiecesReader.from_table(files, table, tmp_path / "gap" / "ckpt-1", origin="ckpt-9")
    np.testing.assert_array_equal(reader.read("t", 0, 10), tensor[:10])
    with pytest.raises(CheckpointError, match=r"ckpt-9: tensor 't': its pieces cover elements \[5, 10\) of the "
                                              r"\[5, 25\) asked for \(a damaged checkpoint\)"):
        reader.read("t", 5, 25)
    reader.close()
    sliced = [1, 2, 2, 0, False, None, False]  # a tensor-parallel half: its ranges count in the slice
    files, table = _write(tmp_path / "tp", tensor, [(0, 0, 40)], placement=sliced)
    with pytest.raises(CheckpointError, match="stored as tensor-parallel slices"):
        FlatPiecesReader.from_table(files, table, tmp_path / "tp" / "ckpt-1")
    files, table = _write(tmp_path / "bad", tensor, [(0, 0, 40)])
    path = tmp_path / "bad" / "ckpt-1" / files[0]
    raw = bytearray(path.read_bytes())
    raw[-8] ^= 0xFF
    path.write_bytes(bytes(raw))
    reader = FlatPiecesReader.from_table(files, table, tmp_path / "bad" / "ckpt-1")
    with pytest.raises(CheckpointError, match="damaged: block 0"):
        reader.read("t", 36, 40)
    reader.close()


def test_a_declared_empty_tensor_reads_as_empty(tmp_path: Path) -> None:
    files, table = _write(tmp_path, np.ones(4, np.float32), [(0, 0, 4)])
    reader = FlatPiecesReader.from_table(files, table, tmp_path / "ckpt-1", declared={"e": [0, 3], "t": [4]})
    assert reader.read_whole("e").shape == (0, 3)
    with pytest.raises(CheckpointError, match="has no tensor 'f'"):
        reader.read_whole("f")
    reader.close()


_DOOR_KERAS = """
import json, sys
import numpy as np
import keras
from shardwise import checkpoint as ckpt
from shardwise.checkpoint import door
door.handler_of_kind("keras.model")
# torch's handlers registered after Keras's: a Keras-on-torch model is an nn.Module, but keras.model must win
if keras.backend.backend() == "torch":
    door.handler_of_kind("torch.module")

def build():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    return model

model = build()
rng = np.random.default_rng(0)
model.fit(rng.normal(size=(4, 3)), rng.normal(size=(4, 2)), epochs=1, verbose=0)
assert door.handler_for(model).kind == "keras.model", door.handler_for(model).kind
path = ckpt.save(sys.argv[1], 5, {"net": model}, extra={"epoch": 1})
other = build()
assert ckpt.load(sys.argv[1], {"net": other}) == {"epoch": 1, "step": 5}
same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), other.get_weights()))
slots = all(np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
            for a, b in zip(model.optimizer.variables, other.optimizer.variables))
meta = json.loads((path / "manifest.json").read_text())["metadata"]
print(json.dumps({"same": same, "slots": same and slots, "kind": meta["entries"]["net"]["kind"],
                  "tensors": sorted(meta["tensors"]), "backend": meta["entries"]["net"]["meta"]["backend"]}))
"""


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_keras_model_goes_through_the_door(tmp_path: Path, backend: str) -> None:
    """shardwise.checkpoint.save/load take a Keras model (weights and Adam state exact), by the keras.model
    handler even on the torch backend, where the model is also a torch module."""
    pytest.importorskip("keras")
    pytest.importorskip(backend)
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _DOOR_KERAS, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=180, cwd=str(ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"same": True, "slots": True, "kind": "keras.model", "backend": backend,
                   "tensors": ["net/v0", "net/v0/momentum", "net/v0/velocity", "net/v1", "net/v1/momentum",
                               "net/v1/velocity"]}, out
