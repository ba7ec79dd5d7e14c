"""Checkpoints of a ``ParallelModel`` that load on any layout and world size, and Hugging Face export.

A checkpoint is a ``ckpt-<step>/`` directory of the checkpoint store (atomic files,
a manifest written last, so a save killed at any moment leaves the previous
checkpoint as the newest complete one). Each rank writes one safetensors file,
``rank-<r>.safetensors``, with the pieces it holds, as it holds them: its
tensor-parallel slice of a parameter, or its ZeRO shard of that slice, stored 1-D;
no tensor moves between ranks, and a piece several ranks hold (data-parallel
replicas) is written by one of them, chosen to even out the bytes. Tensors are
named as in one process (Hugging Face names): parameters, fp32 masters where the
model is not fp32 (``master/<name>``), optimizer state (``optimizer/<key>/<name>``)
and each rank's generator state (``rng/torch/<rank>``). The manifest's metadata holds
the format version, every tensor's shape and pieces (file, placement, element
range), the names and shapes of the model, hyperparameters, the step and the
caller's ``extra`` (the data position).

Loading reads, for each piece the new layout keeps, only the element ranges of the
stored pieces that overlap it (:mod:`.pieces`), straight into the shards where the
stored and kept pieces are both flat ranges of a whole tensor; so a checkpoint does
not depend on the layout that wrote it. ``benchmarks/checkpoint.py`` measures save
and load against ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Optional, Union

import torch

from ....core.errors import CheckpointError
from ....core.placement import Placement
from ....checkpoint.agree import stage_or_fail
from ....checkpoint.atomic import PathLike, atomic_save, atomic_write_bytes, fsync_dir
from ....checkpoint.door import assign_writers, pieces_writer, resolve_checkpoint
from .pieces import PiecesSource, encode_placement
from ....checkpoint.safetensors_stream import SafetensorsWriter
from ....checkpoint.store import check_file_sizes, check_format, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from ..parallel.parallelize import ParallelModel
    from ....checkpoint.async_save import SaveHandle

__all__ = ["FORMAT", "FORMAT_VERSION", "save_parallel_checkpoint", "load_parallel_checkpoint", "save_pretrained"]

FORMAT = "shardwise-parallel"
#: Version of the layout of the files and metadata; a reader refuses a newer one.
#: 1: whole tensors, gathered to a writer; 2: the pieces each rank holds.
FORMAT_VERSION = 2


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _as_is(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key: tensor}


def _writer(stage: Any, extra_entries: list[tuple[str, torch.Tensor]], metadata: Optional[dict],
            convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] = _as_is):  # noqa: ANN202
    """Whole tensors assembled by ``stage`` (a save_pretrained file), each written as the tensors
    ``convert(key, whole)`` gives (a transformers model's per-expert tensors, renamed keys)."""
    from ..parallel.full_tensors import DTYPE_CODES

    def write(f: BinaryIO) -> None:
        listed = [(k, DTYPE_CODES[e.dtype], tuple(t.shape)) for e in stage.entries if e.mine
                  for k, t in convert(e.key, torch.empty(e.shape, dtype=e.dtype, device="meta")).items()]
        listed += [(k, DTYPE_CODES[t.dtype], tuple(t.shape)) for k, t in extra_entries]
        out = SafetensorsWriter(f, listed, metadata)

        def put(entry: Any, whole: torch.Tensor) -> None:
            for k, t in convert(entry.key, whole.to(entry.dtype)).items():
                out.write(k, _bytes(t))
        stage.stream(put)
        for key, t in extra_entries:
            out.write(key, _bytes(t))
        out.close()
    return write


def _piece_writer(pieces: list[tuple[str, Any]], extra_entries: list[tuple[str, torch.Tensor]]):  # noqa: ANN202
    """This rank's pieces, each under its name in the file, as they are in memory."""
    from ..parallel.full_tensors import DTYPE_CODES

    listed = [(name, DTYPE_CODES[lp.dtype], (lp.stop - lp.start,), lambda lp=lp: _bytes(lp.values()))
              for name, lp in pieces]
    listed += [(k, DTYPE_CODES[t.dtype], tuple(t.shape), lambda t=t: _bytes(t)) for k, t in extra_entries]
    return pieces_writer(listed)


#: The rank that writes each distinct piece (shared with :mod:`.door`).
_assign = assign_writers


def _jsonable(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return None


def _hyperparameters(pm: "ParallelModel") -> list[dict[str, Any]]:
    return [{k: _jsonable(v) for k, v in group.items() if k != "params"} for group in pm.optimizer.param_groups]


def save_parallel_checkpoint(pm: "ParallelModel", directory: PathLike, step: int, *,
                             extra: Optional[dict] = None, keep: Optional[int] = None,
                             async_save: bool = False) -> Union[Path, "SaveHandle"]:
    """Collective: write ``pm``'s model, optimizer, step, generator states and ``extra`` as ``ckpt-<step>``.

    Each rank writes the pieces it holds (of a piece several ranks hold, one copy), with no
    tensor moved between ranks. Returns the checkpoint directory.

    ``async_save=True``: plan as above, copy this rank's pieces into host staging buffers (kept
    and reused by later saves; pinned for CUDA tensors), and return a
    :class:`~.async_save.SaveHandle` at once, while a background thread writes the file and
    commits the checkpoint (manifest last) with collectives of its own (:mod:`.async_save`).
    The checkpoint holds the state at the call: training may change it right away. Any save
    first waits for the one in flight, raising its error.
    """
    from ..parallel.full_tensors import DTYPE_CODES
    from ..parallel.local_pieces import local_pieces

    saver = pm.checkpoint_saver
    saver.wait()  # the previous background save, if any: its staging buffers are reused below
    world = pm.groups.world
    pieces = local_pieces(pm)
    described = [(lp.ident, lp.nbytes, DTYPE_CODES[lp.dtype], encode_placement(lp.placement)) for lp in pieces]
    every = world.allgather_object(described)
    chosen = _assign([[(ident, nbytes) for ident, nbytes, _, _ in ranks] for ranks in every])
    files = [f"rank-{r:05d}.safetensors" for r in range(world.size)]
    tensors: dict[str, dict[str, Any]] = {}
    mine: list[tuple[str, Any]] = []
    held = {lp.ident: lp for lp in pieces}
    for rank, ranks in enumerate(every):
        counts: dict[str, int] = {}
        for ident, _, dtype, placement in ranks:
            if chosen[ident] != rank:
                continue
            key, shape, start, stop = ident[0], ident[1], ident[-2], ident[-1]
            name = f"{key}#{counts.get(key, 0)}"
            counts[key] = counts.get(key, 0) + 1
            info = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "pieces": []})
            info["pieces"].append([rank, name, placement, start, stop])
            if rank == world.rank:
                mine.append((name, held[ident]))
    rng = torch.get_rng_state()
    for rank in range(world.size):
        key = f"rng/torch/{rank}"
        tensors[key] = {"shape": list(rng.shape), "dtype": "U8",
                        "pieces": [[rank, key, encode_placement(Placement(key, tuple(rng.shape))), 0, rng.numel()]]}
    scaler = getattr(pm.optimizer, "loss_scaler", None)
    metadata = {
        "format": FORMAT, "version": FORMAT_VERSION, "step": int(step), "world_size": world.size,
        "layout": pm.layout.describe(), "optimizer": type(getattr(pm.optimizer, "inner", pm.optimizer)).__name__,
        "zero_stage": pm.layout.zero_stage,
        "model": {n: list(s) for n, s in pm.tensors.expected.items()},
        "param_groups": _hyperparameters(pm),
        "loss_scaler": _jsonable_dict(scaler.state_dict()) if scaler is not None else None,
        "extra": extra or {},
        "hf_config": json.loads(pm.config.to_json_string()) if pm.config is not None else None,
        "files": files, "tensors": tensors,
    }
    rng_flat = [(f"rng/torch/{world.rank}", rng.reshape(-1))]
    if async_save:
        contents, failure = None, None
        try:
            staged = saver.staging.stage([(name, lp.values()) for name, lp in mine] + rng_flat)
            contents = {files[world.rank]: _piece_writer([], staged)}  # the same bytes as the sync writer's
        except Exception as exc:  # e.g. out of memory for the buffers: every rank raises, none hangs
            failure = exc
        return saver.start(directory, step, contents, metadata=metadata, keep=keep, failure=failure)
    return save_checkpoint(directory, step, {files[world.rank]: _piece_writer(mine, rng_flat)}, comm=world,
                           metadata=metadata, keep=keep)


def _jsonable_dict(state: dict) -> dict:
    return {k: _jsonable(v) for k, v in state.items()}


#: ``path`` if it is a checkpoint, else its newest ``ckpt-<step>`` with a manifest (its files are checked
#: when it is loaded, not by reading them all here).
_resolve = resolve_checkpoint


def _check(pm: "ParallelModel", meta: dict, where: Path) -> None:
    check_format(meta, where, FORMAT, FORMAT_VERSION, "a parallel-model checkpoint")
    saved = {n: tuple(s) for n, s in meta.get("model", {}).items()}
    expected = pm.tensors.expected
    missing = [n for n in expected if n not in saved]
    extra = [n for n in saved if n not in expected]
    shaped = [f"{n} {saved[n]} (the model has {expected[n]})" for n in expected if n in saved and saved[n] != expected[n]]
    if missing or extra or shaped:
        parts = [f"{label} {', '.join(names[:8])}" for label, names in
                 (("missing", missing), ("unexpected", extra), ("shape differs for", shaped)) if names]
        raise CheckpointError(f"{where} is of another model: {'; '.join(parts)}")
    mine = type(getattr(pm.optimizer, "inner", pm.optimizer)).__name__
    if meta.get("optimizer") != mine:
        raise CheckpointError(f"{where} holds {meta.get('optimizer')} state, this model's optimizer is {mine}")


def load_parallel_checkpoint(pm: "ParallelModel", path: PathLike, *, optimizer: bool = True) -> dict:
    """Load a checkpoint (a ``ckpt-<step>`` directory, or the newest complete one under ``path``) into ``pm``.

    Works whatever layout and world size wrote it. All or nothing: every rank reads and
    checks what it keeps into staging first, and the ranks agree (one small collective)
    before any parameter, optimizer state, generator or step changes. A checkpoint of
    another model, a newer format, a missing, truncated or damaged file, or a failed read on
    any rank gives the same :class:`CheckpointError` on every rank, naming the rank, and
    leaves every rank as it was. Returns the ``extra`` saved with it, plus ``"step"``.
    """
    from ..parallel.full_tensors import stage_tensors

    world = pm.groups.world
    where = Path(path)

    def read() -> tuple[dict, Any, torch.Tensor]:
        nonlocal where
        where = _resolve(path)
        meta = load_checkpoint(where, verify=False).metadata
        _check(pm, meta, where)
        check_file_sizes(where)
        source = PiecesSource.from_metadata(meta, where)
        try:
            apply = stage_tensors(pm, source, optimizer=optimizer)
            rank = world.rank
            rng_key = f"rng/torch/{rank}" if f"rng/torch/{rank}" in source.files else "rng/torch/0"
            rng = source.read_box(rng_key, ()).to(torch.uint8)
        finally:
            source.close()
        return meta, apply, rng

    meta, apply, rng = stage_or_fail(world, read, f"checkpoint {where}")
    apply()
    if optimizer:
        for group, saved in zip(pm.optimizer.param_groups, meta.get("param_groups", [])):
            for k, v in saved.items():
                if k in group and v is not None and not torch.is_tensor(group[k]):
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
        scaler = getattr(pm.optimizer, "loss_scaler", None)
        if scaler is not None and meta.get("loss_scaler"):
            scaler.load_state_dict(meta["loss_scaler"])
    torch.set_rng_state(rng)
    return {**meta.get("extra", {}), "step": meta["step"]}


def save_pretrained(pm: "ParallelModel", directory: PathLike) -> Path:
    """Collective: write ``pm``'s model as a Hugging Face ``save_pretrained`` directory.

    Sharded safetensors (one file per rank that holds tensors to write, and
    ``model.safetensors.index.json``) plus ``config.json``: ``from_pretrained`` loads it
    with no shardwise installed. Tensors are assembled and written one at a time. A
    transformers model is written as its own ``save_pretrained`` writes it: the keys and
    tensors of transformers' reverse conversion (one tensor per expert of a Mixture-of-Experts
    layer, the checkpoint's names), and its persistent buffers (written by rank 0).
    """
    from ..parallel.full_tensors import StageTensors
    from ..parallel.hf_conversion import export_tensors, persistent_buffers

    world = pm.groups.world
    root = Path(directory)
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    world.barrier()
    hf_root = getattr(pm, "hf_root", None)
    convert = _as_is if hf_root is None else functools.partial(export_tensors, hf_root)
    stage = StageTensors(pm, optimizer=False, masters=False)
    mine = [e for e in stage.entries if e.mine]
    extra = [(k, t) for name, buf in (persistent_buffers(hf_root).items() if hf_root is not None and world.rank == 0
                                      else ()) for k, t in convert(name, buf.detach().cpu()).items()]
    listed = [(k, list(t.shape), str(t.dtype)) for e in mine
              for k, t in convert(e.key, torch.empty(e.shape, dtype=e.dtype, device="meta")).items()]
    every = world.allgather_object(listed + [(k, list(t.shape), str(t.dtype)) for k, t in extra])
    holders = [r for r, keys in enumerate(every) if keys]
    name = {r: f"model-{i + 1:05d}-of-{len(holders):05d}.safetensors" for i, r in enumerate(holders)}
    if mine or extra:
        atomic_save(_writer(stage, extra, {"format": "pt"}, convert), root / name[world.rank])
    else:
        stage.stream(lambda entry, whole: None)
    if world.rank == 0:
        itemsize = {str(d): torch.empty(0, dtype=d).element_size() for d in
                    (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
        total = sum(itemsize.get(dt, 4) * _numel(shape) for keys in every for _, shape, dt in keys)
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name[r] for r, keys in enumerate(every) for k, _, _ in keys}}
        atomic_write_bytes(root / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True).encode())
        if pm.config is not None:
            pm.config.save_pretrained(str(root))
        fsync_dir(root)
    world.barrier()
    return root


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
