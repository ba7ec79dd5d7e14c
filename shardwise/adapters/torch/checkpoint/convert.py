"""Offline conversions of a parallel-model checkpoint: to a Hugging Face directory, to and from DCP.

* :func:`export_hf`: the model's tensors of a checkpoint as a ``save_pretrained``
  directory (one safetensors file per checkpoint file, an index, ``config.json``),
  copied one tensor at a time.
* :func:`to_dcp` / :func:`from_dcp`: ``torch.distributed.checkpoint`` (DCP) holds
  ``{"model": {name: tensor}, "optim": {"state": {name: {key: tensor}}, "param_groups":
  [...]}}``, the shape ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives
  with full parameter names (what FSDP2 and torchtitan save), plus ``"shardwise"``: this
  checkpoint's metadata. These run in one process and hold the whole checkpoint in
  memory: they are for moving between tools, not for training-time saves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ....core.errors import CheckpointError
from ....checkpoint.atomic import PathLike, atomic_save, atomic_write_bytes, fsync_dir
from ....checkpoint.manifest import MANIFEST_NAME
from ....checkpoint.safetensors_stream import SafetensorsWriter
from ....checkpoint.store import list_checkpoints, load_checkpoint, save_checkpoint

__all__ = ["export_hf", "to_dcp", "from_dcp", "is_model_key"]

_PREFIXES = ("optimizer/", "master/", "rng/")


def is_model_key(key: str) -> bool:
    """True for a checkpoint tensor that is a model parameter (not optimizer state, a master or an RNG)."""
    return not key.startswith(_PREFIXES)


def _open(path: PathLike) -> Any:
    from .parallel import FORMAT, FORMAT_VERSION

    path = Path(path)
    if not (path / MANIFEST_NAME).exists():
        done = [p for _, p in list_checkpoints(path) if (p / MANIFEST_NAME).exists()]
        if not done:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        path = done[-1]
    ckpt = load_checkpoint(path, verify=True)
    meta = ckpt.metadata
    if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int) or meta["version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}; this "
                              f"shardwise reads {FORMAT} up to version {FORMAT_VERSION}")
    return ckpt


def _source(ckpt: Any) -> Any:
    from .pieces import PiecesSource

    return PiecesSource.from_metadata(ckpt.metadata, ckpt.path)


def export_hf(checkpoint: PathLike, out: PathLike) -> Path:
    """Write the model of ``checkpoint`` (a ``ckpt-<step>`` or a directory of them) as a HF directory.

    One output file per checkpoint file (by where each tensor's first piece lies), tensors
    assembled and written one at a time.
    """
    import torch

    from ..parallel.full_tensors import DTYPE_CODES

    ckpt = _open(checkpoint)
    meta = ckpt.metadata
    if not meta.get("hf_config"):
        raise CheckpointError(f"{ckpt.path} was saved from a model without a Hugging Face config")
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    source = _source(ckpt)
    try:
        by_file: dict[str, list[str]] = {}
        for key, pieces in source.files.items():
            if is_model_key(key):
                by_file.setdefault(pieces[0].file.name, []).append(key)
        files = sorted(by_file)
        weight_map: dict[str, str] = {}
        total = 0
        for i, file in enumerate(files):
            name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            keys = by_file[file]
            listed = [(k, DTYPE_CODES[source.dtype(k)], source.shape(k)) for k in keys]

            def write(handle: Any, keys: list[str] = keys, listed: list = listed) -> None:
                writer = SafetensorsWriter(handle, listed, {"format": "pt"})
                for k in keys:  # one tensor in memory at a time
                    writer.write(k, memoryview(source.read_whole(k).contiguous().reshape(-1).view(torch.uint8).numpy()))
                writer.close()

            atomic_save(write, root / name)
            weight_map.update((k, name) for k in keys)
            total += (root / name).stat().st_size
    finally:
        source.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_bytes(root / "model.safetensors.index.json", json.dumps(index, indent=2).encode())
    atomic_write_bytes(root / "config.json", json.dumps(meta["hf_config"], indent=2, sort_keys=True).encode())
    fsync_dir(root)
    return root


def _all_tensors(ckpt: Any) -> dict[str, Any]:
    source = _source(ckpt)
    try:
        return {key: source.read_whole(key) for key in source.files}
    finally:
        source.close()


def to_dcp(checkpoint: PathLike, out: PathLike) -> Path:
    """Write ``checkpoint`` as a DCP directory (one process, the whole checkpoint in memory)."""
    import torch.distributed.checkpoint as dcp

    ckpt = _open(checkpoint)
    tensors = _all_tensors(ckpt)
    model = {k: v for k, v in tensors.items() if is_model_key(k)}
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            slot, name = key[len("optimizer/"):].split("/", 1)
            state.setdefault(name, {})[slot] = value
    extra = {k: v for k, v in tensors.items() if key_kind(k) in ("master", "rng")}
    meta = dict(ckpt.metadata)
    for key in ("weight_map", "files", "tensors"):
        meta.pop(key, None)
    state_dict = {"model": model, "optim": {"state": state, "param_groups": meta.get("param_groups", [])},
                  "extra_tensors": extra, "shardwise": json.dumps(meta)}
    dcp.save(state_dict, checkpoint_id=str(out), no_dist=True)
    return Path(out)


def key_kind(key: str) -> str:
    """``"model"``, ``"optimizer"``, ``"master"`` or ``"rng"``: what a checkpoint tensor is."""
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return prefix[:-1]
    return "model"


def from_dcp(dcp_dir: PathLike, out: PathLike, step: int) -> Path:
    """Write a DCP checkpoint of the :func:`to_dcp` layout as ``<out>/ckpt-<step>`` (one file).

    A DCP of another tool with the same layout (``get_state_dict`` with full names)
    needs ``"shardwise"`` metadata to load into a ``ParallelModel``; without it the
    model names and shapes are taken from the DCP and the optimizer is named ``"unknown"``.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .parallel import FORMAT, FORMAT_VERSION

    reader = FileSystemReader(str(dcp_dir))
    md = reader.read_metadata()
    flat: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    nested: dict[str, Any] = {}
    for fqn, t in flat.items():  # DCP's keys are the state dict's paths joined by "."
        if fqn.startswith("model."):
            nested.setdefault("model", {})[fqn[len("model."):]] = t
        elif fqn.startswith("optim.state."):
            name, slot = fqn[len("optim.state."):].rsplit(".", 1)
            nested.setdefault("optim", {}).setdefault("state", {}).setdefault(name, {})[slot] = t
        elif fqn.startswith("extra_tensors."):
            nested.setdefault("extra_tensors", {})[fqn[len("extra_tensors."):]] = t
    if "shardwise" in md.state_dict_metadata:
        nested["shardwise"] = ""
    dcp.load(nested, checkpoint_id=str(dcp_dir), no_dist=True)
    meta = json.loads(nested["shardwise"]) if nested.get("shardwise") else {}
    tensors: dict[str, torch.Tensor] = dict(nested.get("model", {}))
    for name, slots in nested.get("optim", {}).get("state", {}).items():
        for slot, t in slots.items():
            tensors[f"optimizer/{slot}/{name}"] = t
    tensors.update(nested.get("extra_tensors", {}))
    from ..parallel.full_tensors import DTYPE_CODES
    from ....core.placement import Placement
    from .pieces import encode_placement

    file = "rank-00000.safetensors"
    meta.update({"format": FORMAT, "version": FORMAT_VERSION, "step": int(step), "world_size": 1, "files": [file],
                 "tensors": {k: {"shape": list(t.shape), "dtype": DTYPE_CODES[t.dtype],
                                 "pieces": [[0, k, encode_placement(Placement(k, tuple(t.shape))), 0, t.numel()]]}
                             for k, t in tensors.items()}})
    meta.setdefault("model", {k: list(v.shape) for k, v in nested.get("model", {}).items()})
    meta.setdefault("optimizer", "unknown")
    meta.setdefault("extra", {})

    def write(handle: Any) -> None:
        writer = SafetensorsWriter(handle, [(k, DTYPE_CODES[t.dtype], (t.numel(),)) for k, t in tensors.items()])
        for k, t in tensors.items():
            writer.write(k, memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        writer.close()

    return save_checkpoint(out, step, {file: write}, metadata=meta)
