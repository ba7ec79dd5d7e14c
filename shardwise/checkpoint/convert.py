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

from ..core.errors import CheckpointError
from .atomic import PathLike, atomic_save, atomic_write_bytes, fsync_dir
from .manifest import MANIFEST_NAME
from .safetensors_stream import SafetensorsWriter
from .store import list_checkpoints, load_checkpoint, save_checkpoint

__all__ = ["export_hf", "to_dcp", "from_dcp", "is_model_key"]

_PREFIXES = ("optimizer/", "master/", "rng/")


def is_model_key(key: str) -> bool:
    """True for a checkpoint tensor that is a model parameter (not optimizer state, a master or an RNG)."""
    return not key.startswith(_PREFIXES)


def _open(path: PathLike) -> Any:
    from .parallel_torch import FORMAT, FORMAT_VERSION

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


def export_hf(checkpoint: PathLike, out: PathLike) -> Path:
    """Write the model of ``checkpoint`` (a ``ckpt-<step>`` or a directory of them) as a HF directory."""
    import torch
    from safetensors import safe_open

    ckpt = _open(checkpoint)
    meta = ckpt.metadata
    if not meta.get("hf_config"):
        raise CheckpointError(f"{ckpt.path} was saved from a model without a Hugging Face config")
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[str]] = {}
    for key, file in meta["weight_map"].items():
        if is_model_key(key):
            by_file.setdefault(file, []).append(key)
    files = sorted(by_file)
    weight_map: dict[str, str] = {}
    total = 0
    for i, file in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        with safe_open(str(ckpt.file(file)), framework="pt") as f:
            keys = by_file[file]
            listed = [(k, f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in keys]

            def write(handle: Any, f: Any = f, keys: list[str] = keys, listed: list = listed) -> None:
                writer = SafetensorsWriter(handle, listed, {"format": "pt"})
                for k in keys:  # one tensor in memory at a time
                    writer.write(k, memoryview(f.get_tensor(k).contiguous().reshape(-1).view(torch.uint8).numpy()))
                writer.close()

            atomic_save(write, root / name)
        for k, _, shape in listed:
            weight_map[k] = name
        total += (root / name).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_bytes(root / "model.safetensors.index.json", json.dumps(index, indent=2).encode())
    atomic_write_bytes(root / "config.json", json.dumps(meta["hf_config"], indent=2, sort_keys=True).encode())
    fsync_dir(root)
    return root


def _all_tensors(ckpt: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for file in sorted(set(ckpt.metadata["weight_map"].values())):
        out.update(load_file(str(ckpt.file(file))))
    return out


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
    meta.pop("weight_map", None)
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

    from .parallel_torch import FORMAT, FORMAT_VERSION

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
    from ..adapters.torch.parallel.full_tensors import DTYPE_CODES

    file = "rank-00000.safetensors"
    meta.update({"format": FORMAT, "version": FORMAT_VERSION, "step": int(step), "world_size": 1,
                 "weight_map": {k: file for k in tensors}})
    meta.setdefault("model", {k: list(v.shape) for k, v in nested.get("model", {}).items()})
    meta.setdefault("optimizer", "unknown")
    meta.setdefault("extra", {})

    def write(handle: Any) -> None:
        writer = SafetensorsWriter(handle, [(k, DTYPE_CODES[t.dtype], tuple(t.shape)) for k, t in tensors.items()])
        for k, t in tensors.items():
            writer.write(k, memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        writer.close()

    return save_checkpoint(out, step, {file: write}, metadata=meta)
