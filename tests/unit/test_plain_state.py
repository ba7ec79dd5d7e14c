"""Payloads as plain data (shardwise.checkpoint.plain_state) and torch's tensor codec."""

from __future__ import annotations

import ast
import io
import json
import math
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from shardwise.checkpoint.plain_state import (NUMPY_CODEC, TensorCodec, check_plain, from_plain, read_buffers,
                                              to_plain, write_buffers)
from shardwise.core.errors import CheckpointError, ConfigError

ROOT = Path(__file__).resolve().parents[2]


def same(a, b) -> bool:
    """Equal values of equal types, all the way down (nan equal to nan, tensors bit for bit)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (list(a) == list(b) and all(same(a[k], b[k]) for k in a)
                and same(getattr(a, "_metadata", None), getattr(b, "_metadata", None)))
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a).__module__.startswith("torch"):
        import torch

        if not torch.is_tensor(a):
            return False
        bits = (lambda t: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
        return a.dtype == b.dtype and a.shape == b.shape and bits(a).equal(bits(b))
    return a == b


def round_trip(payload, codecs=(NUMPY_CODEC,)):
    plain = to_plain(payload, codecs)
    tree = json.loads(json.dumps(plain.tree, allow_nan=False))  # strict JSON, as the manifest stores it
    f = io.BytesIO()
    write_buffers(f, plain.buffers)
    return from_plain(tree, read_buffers(f.getvalue(), len(plain.buffers)), codecs)


def test_plain_values_round_trip_with_their_types():
    metadata = {"": {"version": 1}, "layer": {"version": 2}}
    ordered = OrderedDict([("b", 1), ("a", 2)])
    ordered._metadata = metadata
    payload = {
        "none": None, "flags": [True, False], "ints": [0, -7, 2 ** 80], "text": "héllo \ud800",
        "floats": [1.0, -0.0, 1e-310, 1e308, math.inf, -math.inf, math.nan],
        "nested": {3: ("a", (1, [2.5, {"k": ()}]), []), -1: {}, "3": "a str key next to the int key 3"},
        "ordered": ordered,
        "arrays": [np.arange(6, dtype=np.int16).reshape(2, 3).T, np.zeros((0, 4), np.float32), np.array(2.5)],
        "scalars": [np.float32(1.5), np.int64(-3), np.bool_(True)],
    }
    back = round_trip(payload)
    assert same(back, payload)
    assert isinstance(back["nested"][3], tuple) and 3 in back["nested"] and "3" in back["nested"]
    assert type(back["ordered"]) is OrderedDict and back["ordered"]._metadata == metadata
    assert back["arrays"][0].flags.writeable and back["arrays"][0].flags.c_contiguous


class Foo:
    pass


@pytest.mark.parametrize("payload, where, why", [
    ({"attributes": {"sampler": Foo()}}, "payload['attributes']['sampler']", "type test_plain_state.Foo is not plain"),
    ({"log": [1, (2, {3})]}, r"payload['log'][1][1]", "type builtins.set is not plain"),
    ({"state": {0: {(1, 2): "x"}}}, "payload['state'][0]", "key (1, 2) of type tuple is not a str or int"),
    ({"flags": {True: 1}}, "payload['flags']", "key True of type bool"),
    ({"objects": np.array([None, 1])}, "payload['objects']", "holds Python objects"),
    ({"d": __import__("collections").defaultdict(list)}, "payload['d']", "type collections.defaultdict"),
    ({"b": b"raw"}, "payload['b']", "type builtins.bytes"),
])
def test_anything_else_is_refused_with_its_place(payload, where, why):
    for check in (to_plain, check_plain):
        with pytest.raises(ConfigError) as info:
            check(payload)
        assert str(info.value).startswith(where + ": ") and why in str(info.value), str(info.value)


def test_a_container_holding_itself_is_refused_and_shared_ones_are_copied():
    loop: list = [1]
    loop.append({"back": loop})
    with pytest.raises(ConfigError, match=r"payload\[1\]\['back'\]: this list contains itself"):
        to_plain(loop)
    shared = [1, 2]
    assert round_trip({"a": shared, "b": shared}) == {"a": [1, 2], "b": [1, 2]}


def test_without_a_codec_tensors_are_refused_and_cannot_be_loaded():
    with pytest.raises(ConfigError, match=r"payload\['w'\]: type numpy.ndarray is not plain data .*kind: none"):
        to_plain({"w": np.ones(2)}, codecs=())
    plain = to_plain({"w": np.ones(2)})
    with pytest.raises(CheckpointError, match=r"payload\['w'\]: a tensor of kind 'numpy', and no codec"):
        from_plain(plain.tree, plain.buffers, codecs=())


def test_a_callers_codec_is_used_for_its_tensors():
    class Blob:
        def __init__(self, data: bytes) -> None:
            self.data = data

    codec = TensorCodec("blob", lambda o: isinstance(o, Blob), lambda b: ("raw", (len(b.data),), b.data),
                        lambda dtype, shape, buf: Blob(bytes(buf)))
    back = round_trip({"x": [Blob(b"abc"), np.int8(4)]}, codecs=(codec, NUMPY_CODEC))
    assert back["x"][0].data == b"abc" and same(back["x"][1], np.int8(4))


@pytest.mark.parametrize("tree, message", [
    ({"tuple": 1}, "a tuple node holds no list"),
    ({"dict": [["a", 1], ["a", 2]]}, "key 'a' appears twice"),
    ({"dict": [[1.5, 1]]}, "malformed dict entry"),
    ({"float": "huge"}, "is not inf, -inf or nan"),
    ({"tuple": [], "dict": []}, "malformed node"),
    ({"tensor": 5, "kind": "numpy", "dtype": "<f4", "shape": [1]}, "malformed tensor node"),
    ({"tensor": 0, "kind": "numpy", "dtype": "<f4", "shape": [3]}, "4 bytes for a <f4 array of shape [3]"),
    ({"tensor": 0, "kind": "numpy", "dtype": "O", "shape": [1]}, "holds objects or records"),
    ({"tensor": 0, "kind": "numpy", "dtype": "<f4", "shape": [1], "scalar": True}, "only a 0-d numpy value"),
])
def test_a_malformed_tree_is_refused_with_its_place(tree, message):
    with pytest.raises(CheckpointError, match="^payload.*" + __import__("re").escape(message)):
        from_plain({"dict": [["x", tree]]}, [memoryview(b"\0" * 4)])


def test_read_buffers_refuses_what_write_buffers_did_not_write():
    f = io.BytesIO()
    write_buffers(f, [memoryview(b"abc"), memoryview(b"")])
    data = f.getvalue()
    assert [bytes(b) for b in read_buffers(data, 2)] == [b"abc", b""]
    with pytest.raises(CheckpointError, match="the tree refers to 3"):
        read_buffers(data, 3)
    with pytest.raises(CheckpointError, match="no safetensors file"):
        read_buffers(b"abc", 0)
    with pytest.raises(CheckpointError, match="a header of"):
        read_buffers(data[:20], 2)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
    return found


def test_the_encoder_imports_numpy_at_most_and_no_pickle():
    imports = _imports(ROOT / "shardwise/checkpoint/plain_state.py")
    assert not {m for m in imports if m.split(".")[0] in ("torch", "pickle", "dill", "cloudpickle")}, imports
    probe = "import sys, shardwise.checkpoint.plain_state; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip() == "False"


# -- torch tensors --------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def torch_codecs():
    from shardwise.adapters.torch.tensor_codec import TORCH_CODEC

    return (TORCH_CODEC, NUMPY_CODEC)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 5).to(torch.bfloat16),
    lambda: torch.randn(4).to(torch.float16),
    lambda: torch.randn(2, 2, dtype=torch.float64),
    lambda: torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),  # not contiguous
    lambda: torch.tensor([True, False, True]),
    lambda: torch.tensor(7, dtype=torch.int64),  # 0-d, as an optimizer's step
    lambda: torch.empty(0, 3),
    lambda: torch.tensor([1 + 2j, -3j], dtype=torch.complex64).conj(),
    lambda: torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn),
    lambda: torch.tensor([1, 255], dtype=torch.uint8),
    lambda: torch.nn.Parameter(torch.randn(2, 3)),
])
def test_torch_tensors_round_trip_bit_for_bit_on_the_cpu(make):
    tensor = make()
    back = round_trip({"t": tensor}, torch_codecs())["t"]
    assert type(back) is torch.Tensor and back.device.type == "cpu" and not back.requires_grad
    expected = tensor.detach().resolve_conj()
    assert back.dtype == expected.dtype and back.shape == expected.shape and back.is_contiguous()
    bits = (lambda t: t.contiguous().reshape(-1).view(torch.uint8))
    assert bits(back).equal(bits(expected))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_stored_from_the_device_and_loaded_on_the_cpu():
    tensor = torch.randn(4, 3, device="cuda").to(torch.bfloat16)
    back = round_trip({"t": tensor}, torch_codecs())["t"]
    assert back.device.type == "cpu" and back.dtype == torch.bfloat16 and back.equal(tensor.cpu())


@pytest.mark.parametrize("make, why", [
    (lambda: torch.eye(3).to_sparse(), "only dense tensors"),
    (lambda: torch.empty(3, device="meta"), "meta device has no values"),
    (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), "quantized"),
    (lambda: torch.Tensor._make_subclass(type("Wrapped", (torch.Tensor,), {}), torch.ones(2)), "subclass Wrapped"),
])
def test_torch_tensors_that_are_not_plain_data_are_refused_with_their_place(make, why):
    for check in (to_plain, check_plain):
        with pytest.raises(ConfigError, match=r"^payload\['model'\]\['w'\]: torch tensor cannot be stored: .*" + why):
            check({"model": {"w": make()}}, torch_codecs())


def test_a_torch_tensor_of_an_unknown_dtype_or_size_is_refused_on_load():
    plain = to_plain({"t": torch.ones(2)}, torch_codecs())
    node = plain.tree["dict"][0][1]
    with pytest.raises(CheckpointError, match=r"payload\['t'\]: 'float128' is not a torch dtype"):
        from_plain({"dict": [["t", dict(node, dtype="float128")]]}, plain.buffers, torch_codecs())
    with pytest.raises(CheckpointError, match=r"payload\['t'\]: 8 bytes for a float32 tensor of shape \[3\]"):
        from_plain({"dict": [["t", dict(node, shape=[3])]]}, plain.buffers, torch_codecs())
