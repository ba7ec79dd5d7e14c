"""Payloads as plain data: a JSON tree plus raw tensor bytes, and back, with no pickle.

:func:`to_plain` turns a payload built of dicts (``str`` or ``int`` keys), lists,
tuples, ``str``, ``int``, ``float`` (``inf`` and ``nan`` included), ``bool``, ``None``
and tensors into a :class:`PlainState`: a tree of JSON data and the tensors' bytes,
one buffer per tensor. :func:`from_plain` rebuilds the payload from them. Tensors go
through :class:`TensorCodec` objects the caller passes (numpy arrays and numpy scalars
through :data:`NUMPY_CODEC`; torch's codec lives in the torch adapter, so this module
never imports torch). Anything else is refused with a :class:`ConfigError` naming
where in the payload it is, e.g. ``payload['attributes']['sampler']: type Foo is not
plain data``.

The tree: ``null``, ``true``/``false``, integers, strings and finite floats are
themselves (JSON tells ``1`` from ``1.0``); lists are JSON arrays; every JSON object
is a tagged node with one of these keys:

* ``{"tuple": [...]}``;
* ``{"dict": [[key, value], ...]}`` (keys are strings or integers, in order), with
  ``"ordered": true`` for an ``OrderedDict`` and ``"metadata": tree`` for the
  ``_metadata`` attribute a torch module's ``state_dict`` carries;
* ``{"float": "inf" | "-inf" | "nan"}``;
* ``{"tensor": index, "kind": codec kind, "dtype": ..., "shape": [...]}``, its bytes
  being ``buffers[index]`` (C order); ``"scalar": true`` for a numpy scalar.

:func:`write_buffers` / :func:`read_buffers` store the buffers in one safetensors
file, each tensor as raw bytes (``U8``, 1-D, named ``t<index>``): its true dtype and
shape are in the tree.
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Optional, Sequence, Union

import numpy as np

from ..core.errors import CheckpointError, ConfigError
from .safetensors_stream import SafetensorsWriter

__all__ = ["TensorCodec", "NUMPY_CODEC", "PlainState", "to_plain", "check_plain", "from_plain", "write_buffers",
           "read_buffers"]

#: Bytes of a tensor as a codec hands them over or receives them.
Buffer = Union[bytes, bytearray, memoryview]
_TAGS = ("tuple", "dict", "float", "tensor")
_EXTRA_KEYS = {"tuple": set(), "dict": {"ordered", "metadata"}, "float": set(),
               "tensor": {"kind", "dtype", "shape", "scalar"}}
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorCodec:
    """How tensors of one library become bytes and back.

    ``kind`` names the codec in the tree; ``matches(obj)`` says whether ``obj`` is
    one of its tensors; ``to_bytes(obj)`` gives ``(dtype, shape, buffer)`` with the
    bytes in C order (raising :class:`ConfigError` for a tensor it cannot store);
    ``from_bytes(dtype, shape, buffer)`` rebuilds the tensor (raising
    :class:`CheckpointError` when the dtype, shape and size do not fit).
    ``check(obj)``, optional, raises the :class:`ConfigError` that ``to_bytes``
    would, without converting anything (what :func:`check_plain` calls).
    """

    kind: str
    matches: Callable[[Any], bool]
    to_bytes: Callable[[Any], tuple[str, tuple[int, ...], Buffer]]
    from_bytes: Callable[[str, tuple[int, ...], memoryview], Any]
    check: Optional[Callable[[Any], None]] = None


def _numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype ``name``; CheckpointError for one whose values are not raw bytes (objects, records)."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise CheckpointError(f"unknown numpy dtype {name!r}") from None
    if dtype.kind in "OV":
        raise CheckpointError(f"numpy dtype {name!r} holds objects or records, not raw values")
    return dtype


def _numpy_check(array: Any) -> None:
    """ConfigError for a numpy array (or scalar) of objects or records."""
    dtype = np.asarray(array).dtype if isinstance(array, np.generic) else array.dtype
    if dtype.kind in "OV":
        raise ConfigError(f"a numpy array of dtype {dtype} holds Python objects or records, not plain data")


def _numpy_to_bytes(array: Any) -> tuple[str, tuple[int, ...], Buffer]:
    """A numpy array (or scalar) as ``(dtype, shape, bytes)``."""
    array = np.asarray(array)
    _numpy_check(array)
    flat = np.ascontiguousarray(array).reshape(-1)  # (ascontiguousarray makes a 0-d array 1-d)
    return array.dtype.str, tuple(int(s) for s in array.shape), memoryview(flat.view(np.uint8))


def _numpy_from_bytes(dtype: str, shape: tuple[int, ...], buffer: memoryview) -> np.ndarray:
    """The numpy array of ``dtype`` and ``shape`` whose bytes are ``buffer`` (a copy of them)."""
    kind = _numpy_dtype(dtype)
    want = kind.itemsize * math.prod(shape)
    if buffer.nbytes != want:
        raise CheckpointError(f"{buffer.nbytes} bytes for a {dtype} array of shape {list(shape)} ({want} bytes)")
    return np.frombuffer(buffer, dtype=kind).reshape(shape).copy()


#: numpy arrays (and, with ``"scalar": true`` in the tree, numpy scalars); always available.
NUMPY_CODEC = TensorCodec("numpy", lambda obj: isinstance(obj, np.ndarray), _numpy_to_bytes, _numpy_from_bytes,
                          _numpy_check)


@dataclass(frozen=True)
class PlainState:
    """A payload as plain data: ``tree`` (JSON data) and ``buffers``, the bytes of each tensor in it."""

    tree: Any
    buffers: list[memoryview]


def _where(root: str, path: Sequence[Union[str, int]]) -> str:
    return root + "".join(f"[{key!r}]" for key in path)


class _Encoder:
    """One walk over a payload; with ``convert`` False it only checks that the payload is plain data."""

    def __init__(self, codecs: Sequence[TensorCodec], root: str, convert: bool) -> None:
        self.codecs, self.root, self.convert = tuple(codecs), root, convert
        self.buffers: list[memoryview] = []
        self.open: set[int] = set()  # containers on the current path, to refuse cycles

    def refuse(self, path: list, why: str) -> ConfigError:
        return ConfigError(f"{_where(self.root, path)}: {why}")

    def encode(self, obj: Any, path: list) -> Any:
        kind = type(obj)
        if obj is None or kind is bool or kind is int or kind is str:
            return obj
        if kind is float:
            if math.isfinite(obj):
                return obj
            return {"float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
        for codec in self.codecs:
            if codec.matches(obj):
                return self.tensor(codec, obj, path, scalar=False)
        if isinstance(obj, np.generic) and any(c.kind == NUMPY_CODEC.kind for c in self.codecs):
            return self.tensor(NUMPY_CODEC, obj, path, scalar=True)
        if kind in (list, tuple, dict, OrderedDict):
            if id(obj) in self.open:
                raise self.refuse(path, f"this {kind.__name__} contains itself")
            self.open.add(id(obj))
            try:
                return self.container(obj, path)
            finally:
                self.open.discard(id(obj))
        kinds = ", ".join(c.kind for c in self.codecs) or "none"
        raise self.refuse(path, f"type {kind.__module__}.{kind.__qualname__} is not plain data (dicts with str or "
                                f"int keys, lists, tuples, str, int, float, bool, None, or tensors of kind: {kinds})")

    def container(self, obj: Any, path: list) -> Any:
        if isinstance(obj, list):
            return [self.encode(item, path + [i]) for i, item in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"tuple": [self.encode(item, path + [i]) for i, item in enumerate(obj)]}
        items = []
        for key, value in obj.items():
            if type(key) is not str and type(key) is not int:
                raise self.refuse(path, f"key {key!r} of type {type(key).__name__} is not a str or int")
            items.append([key, self.encode(value, path + [key])])
        node: dict[str, Any] = {"dict": items}
        if type(obj) is OrderedDict:
            node["ordered"] = True
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:
                node["metadata"] = self.encode(metadata, path + ["._metadata"])
        return node

    def tensor(self, codec: TensorCodec, obj: Any, path: list, scalar: bool) -> Any:
        try:
            if not self.convert:
                if codec.check is not None:
                    codec.check(obj)
                return None
            dtype, shape, buffer = codec.to_bytes(obj)
        except (ConfigError, TypeError, ValueError, RuntimeError) as exc:
            raise self.refuse(path, f"{codec.kind} tensor cannot be stored: {exc}") from None
        node: dict[str, Any] = {"tensor": len(self.buffers), "kind": codec.kind, "dtype": str(dtype),
                                "shape": [int(s) for s in shape]}
        if scalar:
            node["scalar"] = True
        view = memoryview(buffer)
        self.buffers.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
        return node


def to_plain(payload: Any, codecs: Sequence[TensorCodec] = (NUMPY_CODEC,), root: str = "payload") -> PlainState:
    """``payload`` as a JSON tree and tensor buffers; :class:`ConfigError` naming the place (from ``root``)
    of anything that is not plain data or a tensor one of ``codecs`` takes."""
    encoder = _Encoder(codecs, root, convert=True)
    tree = encoder.encode(payload, [])
    return PlainState(tree, encoder.buffers)


def check_plain(payload: Any, codecs: Sequence[TensorCodec] = (NUMPY_CODEC,), root: str = "payload") -> None:
    """Raise the :class:`ConfigError` :func:`to_plain` would for ``payload``, converting nothing (a codec
    without ``check`` refuses only in :func:`to_plain`)."""
    _Encoder(codecs, root, convert=False).encode(payload, [])


class _Decoder:
    """One walk over a tree, rebuilding the payload; CheckpointError naming the place of a malformed node."""

    def __init__(self, buffers: Sequence[memoryview], codecs: Sequence[TensorCodec], root: str) -> None:
        self.buffers, self.root = buffers, root
        self.codecs = {c.kind: c for c in codecs}

    def bad(self, path: list, why: str) -> CheckpointError:
        return CheckpointError(f"{_where(self.root, path)}: {why}")

    def decode(self, node: Any, path: list) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(item, path + [i]) for i, item in enumerate(node)]
        if not isinstance(node, dict):
            raise self.bad(path, f"a {type(node).__name__} is not a node of a plain-data tree")
        tags = [t for t in _TAGS if t in node]
        if len(tags) != 1 or set(node) - {tags[0]} - _EXTRA_KEYS[tags[0]]:
            raise self.bad(path, f"malformed node with keys {sorted(node)}")
        tag, body = tags[0], node[tags[0]]
        if tag == "tuple":
            if not isinstance(body, list):
                raise self.bad(path, "a tuple node holds no list")
            return tuple(self.decode(item, path + [i]) for i, item in enumerate(body))
        if tag == "float":
            if body not in _NONFINITE:
                raise self.bad(path, f"float {body!r} is not inf, -inf or nan")
            return _NONFINITE[body]
        if tag == "dict":
            return self.mapping(node, body, path)
        return self.tensor(node, path)

    def mapping(self, node: dict, body: Any, path: list) -> Any:
        out: dict = OrderedDict() if node.get("ordered") is True else {}
        if not isinstance(body, list):
            raise self.bad(path, "a dict node holds no list of pairs")
        for pair in body:
            if (not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], (str, int))):
                raise self.bad(path, f"malformed dict entry {str(pair)[:80]}")
            key = pair[0]
            if key in out:
                raise self.bad(path, f"key {key!r} appears twice")
            out[key] = self.decode(pair[1], path + [key])
        if "metadata" in node:
            if not isinstance(out, OrderedDict):
                raise self.bad(path, "metadata on a dict that is not ordered")
            out._metadata = self.decode(node["metadata"], path + ["._metadata"])  # type: ignore[attr-defined]
        return out

    def tensor(self, node: dict, path: list) -> Any:
        index, kind, dtype, shape = node["tensor"], node.get("kind"), node.get("dtype"), node.get("shape")
        if (isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.buffers)
                or not isinstance(dtype, str) or not isinstance(shape, list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise self.bad(path, f"malformed tensor node {str(node)[:200]}")
        codec = self.codecs.get(kind)  # type: ignore[arg-type]
        if codec is None:
            raise self.bad(path, f"a tensor of kind {kind!r}, and no codec for it was given "
                                 f"(have: {', '.join(self.codecs) or 'none'})")
        try:
            value = codec.from_bytes(dtype, tuple(shape), self.buffers[index])
        except CheckpointError as exc:
            raise self.bad(path, str(exc)) from None
        if node.get("scalar") is True:
            if kind != NUMPY_CODEC.kind or shape:
                raise self.bad(path, "only a 0-d numpy value can be a scalar")
            value = value[()]
        return value


def from_plain(tree: Any, buffers: Sequence[memoryview], codecs: Sequence[TensorCodec] = (NUMPY_CODEC,),
               root: str = "payload") -> Any:
    """The payload that :func:`to_plain` turned into ``tree`` and ``buffers`` (tensors through ``codecs``);
    :class:`CheckpointError` naming the place of a malformed node or a tensor of no given codec."""
    return _Decoder(buffers, codecs, root).decode(tree, [])


def _name(index: int) -> str:
    return f"t{index}"


def write_buffers(f: BinaryIO, buffers: Sequence[memoryview], metadata: Optional[dict[str, str]] = None) -> None:
    """Write ``buffers`` into ``f`` as one safetensors file of 1-D ``U8`` tensors ``t0``, ``t1``, ..."""
    writer = SafetensorsWriter(f, [(_name(i), "U8", (b.nbytes,)) for i, b in enumerate(buffers)], metadata)
    for i, buffer in enumerate(buffers):
        writer.write(_name(i), buffer)
    writer.close()


def read_buffers(data: Union[bytes, memoryview], count: int, where: str = "the commit file") -> list[memoryview]:
    """The ``count`` buffers :func:`write_buffers` stored in safetensors bytes ``data`` (views, no copy);
    :class:`CheckpointError` for anything else."""
    view = memoryview(data).cast("B")
    if view.nbytes < 8:
        raise CheckpointError(f"{where}: {view.nbytes} bytes is no safetensors file")
    (length,) = struct.unpack("<Q", view[:8])
    if length > min(_MAX_HEADER, view.nbytes - 8):
        raise CheckpointError(f"{where}: a header of {length} bytes in a file of {view.nbytes}")
    try:
        header = json.loads(bytes(view[8:8 + length]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: the safetensors header is no JSON object")
    header.pop("__metadata__", None)
    if set(header) != {_name(i) for i in range(count)}:
        raise CheckpointError(f"{where}: holds tensors {sorted(header)[:5]}..., the tree refers to {count}")
    start, out = 8 + length, []
    for i in range(count):
        entry = header[_name(i)]
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            ok = entry["dtype"] == "U8" and [int(s) for s in entry["shape"]] == [end - begin]
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or begin < 0 or start + end > view.nbytes:
            raise CheckpointError(f"{where}: bad safetensors entry for {_name(i)}: {str(entry)[:200]}")
        out.append(view[start + begin:start + end])
    return out
