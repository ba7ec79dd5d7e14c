"""Sharded ZeRO checkpoints: each rank writes its shard; load into any world size.

Layout of a checkpoint directory::

    zero-meta.json                   plans, world size, step, optimizer (written last)
    zero-shard-00000-of-00004.npz    rank 0's fp32 master shard and optimizer state
    ...

Shards are plain ``.npz`` files read with ``allow_pickle=False``; every file is
written to a temporary name, fsynced and renamed, and the metadata file, written
after all shards, marks the checkpoint complete. Loading gathers the old shards,
re-splits them for the new world size (:func:`shardwise.core.zero.reshard`) and is
bit-exact.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

from ....core.errors import CheckpointError
from ....core.zero import PartitionPlan, unflatten, unshard
from ....checkpoint.atomic import atomic_write_bytes
from ....checkpoint.state import check_mismatch

if TYPE_CHECKING:  # annotations only: the optimizer's package need not be imported to consolidate
    from ..zero import ZeroOptimizer

__all__ = ["save_zero_checkpoint", "load_zero_checkpoint", "consolidate_zero_checkpoint"]

META = "zero-meta.json"
FORMAT = 1


def _shard_name(rank: int, world: int) -> str:
    return f"zero-shard-{rank:05d}-of-{world:05d}.npz"


def _hyperparams(opt: ZeroOptimizer) -> list[dict[str, Any]]:
    out = []
    for group in opt.param_groups:
        out.append({k: (v if isinstance(v, (int, float, str, bool, type(None), list, tuple)) else repr(v))
                    for k, v in group.items() if k != "params"})
    return out


def save_zero_checkpoint(opt: ZeroOptimizer, directory: Union[str, Path], step: int = 0,
                         extra: dict[str, Any] | None = None) -> Path:
    """Collective: every rank writes its shard; rank 0 writes the metadata last.

    With hybrid sharding (``replicate_comm``) the first shard group writes and the others,
    which hold the same shards, wait for it."""
    from ..zero.elastic import _refuse_experts

    _refuse_experts(opt, "save_zero_checkpoint")
    opt.wait_parameters()  # no parameter gather of the last step left in flight (overlap_publish)
    directory = Path(directory)
    comm = opt.comm
    writes = opt.replicate_comm is None or opt.replicate_comm.rank == 0
    if comm.rank == 0 and writes:
        directory.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    arrays: dict[str, np.ndarray] = {}
    for unit in opt.units:
        arrays[f"u{unit.index}/master"] = unit.master.detach().cpu().numpy()
        for key, value in opt.inner.state.get(unit.master, {}).items():
            if torch.is_tensor(value):
                arrays[f"u{unit.index}/state/{key}"] = value.detach().cpu().numpy()
    if writes:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(directory / _shard_name(comm.rank, comm.size), buf.getvalue())
    comm.barrier()
    if comm.rank == 0 and writes:
        meta = {"format": FORMAT, "world_size": comm.size, "stage": opt.stage, "step": int(step),
                "optimizer": opt.optimizer_class.__name__, "param_groups": _hyperparams(opt),
                "units": [u.plan.to_dict() for u in opt.units],
                "loss_scaler": opt.loss_scaler.state_dict(), "extra": extra or {}}
        atomic_write_bytes(directory / META, json.dumps(meta, indent=1).encode())
    comm.barrier()
    if opt.replicate_comm is not None:
        opt.replicate_comm.barrier()  # the other groups return once the first group's files are complete
    return directory


def _read_meta(directory: Path) -> dict[str, Any]:
    path = directory / META
    if not path.exists():
        raise CheckpointError(f"{directory} is not a complete shardwise ZeRO checkpoint: {META} is missing")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}; this shardwise reads {FORMAT}")
    return meta


def _read_shards(directory: Path, meta: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    world = int(meta["world_size"])
    shards = []
    for rank in range(world):
        path = directory / _shard_name(rank, world)
        try:
            with np.load(path, allow_pickle=False) as data:
                shards.append({k: data[k] for k in data.files})
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise CheckpointError(f"checkpoint shard {path} is missing or corrupt: {exc}") from None
    return shards


def _check_model(meta: dict[str, Any], opt_plans: list[PartitionPlan]) -> list[PartitionPlan]:
    saved = [PartitionPlan.from_dict(u) for u in meta["units"]]
    check_mismatch({s.name: s.shape for p in opt_plans for s in p.params},
                   {s.name: s.shape for p in saved for s in p.params}, what="ZeRO checkpoint")
    if len(saved) != len(opt_plans):
        raise CheckpointError(f"ZeRO checkpoint has {len(saved)} partition units, the optimizer {len(opt_plans)}: "
                              "saved with another ZeRO stage or bucket size")
    return saved


def load_zero_checkpoint(opt: ZeroOptimizer, directory: Union[str, Path]) -> dict[str, Any]:
    """Load a checkpoint saved at any world size into ``opt``; returns its metadata."""
    from ..zero.elastic import _refuse_experts

    _refuse_experts(opt, "load_zero_checkpoint")
    opt.wait_parameters()  # the masters are about to be overwritten and published again
    directory = Path(directory)
    meta = _read_meta(directory)
    saved = _check_model(meta, [u.plan for u in opt.units])
    shards = _read_shards(directory, meta)
    for unit, old_plan in zip(opt.units, saved):
        prefix = f"u{unit.index}/"
        keys = sorted({k for k in shards[0] if k.startswith(prefix)})
        state: dict[str, Any] = {}
        for key in keys:
            parts = [s[key] for s in shards]
            if parts[0].ndim == 0:  # a scalar (e.g. Adam's step) is the same on every rank
                value = torch.from_numpy(parts[0].copy())
            else:  # re-split the saved elements for this world size and alignment
                flat = np.zeros(unit.plan.padded_numel, dtype=parts[0].dtype)
                flat[:old_plan.numel] = unshard(parts, old_plan)[:old_plan.numel]
                value = torch.from_numpy(flat[unit.start: unit.end].copy())
            if key == prefix + "master":
                with torch.no_grad():
                    unit.master.copy_(value.to(unit.master.dtype))
            else:
                state[key[len(prefix + "state/"):]] = value.to(unit.master.device)
        if state:
            opt.inner.state[unit.master] = state
        unit.publish_master()
    for group, saved_group in zip(opt.param_groups, meta["param_groups"]):
        for k, v in saved_group.items():
            if k in group and isinstance(v, (int, float)) and not isinstance(v, bool):
                group[k] = v
    opt.loss_scaler.load_state_dict(meta["loss_scaler"])
    return meta


def consolidate_zero_checkpoint(directory: Union[str, Path], out: Union[str, Path]) -> dict[str, np.ndarray]:
    """Write one full fp32 state dict (``.pt`` via torch.save, or ``.npz``) from a sharded checkpoint."""
    directory = Path(directory)
    meta = _read_meta(directory)
    shards = _read_shards(directory, meta)
    full: dict[str, np.ndarray] = {}
    for i, plan_dict in enumerate(meta["units"]):
        plan = PartitionPlan.from_dict(plan_dict)
        flat = unshard([s[f"u{i}/master"] for s in shards], plan)
        full.update({k: np.array(v) for k, v in unflatten(flat, plan).items()})
    out = Path(out)
    buf = io.BytesIO()
    if out.suffix == ".npz":
        np.savez(buf, **full)
    else:
        torch.save({k: torch.from_numpy(v) for k, v in full.items()}, buf)
    atomic_write_bytes(out, buf.getvalue())
    return full
