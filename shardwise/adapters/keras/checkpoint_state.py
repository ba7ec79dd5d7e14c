"""Keras handler of :mod:`shardwise.checkpoint.door`: what ``shardwise.checkpoint.save``/``load`` do with a
Keras model (registered when this module is imported, which the door does on first meeting a ``keras``
object or the ``keras.model`` kind).

Kind ``keras.model``: a Keras 3 model with its optimizer's state (slots and scalars), on
any backend, without torch unless the backend is torch. Each rank's pieces are
:mod:`.sharded_state`'s: flat element ranges ``[start, stop)`` of whole variables (an even
slice of a replicated variable, the pieces of its ZeRO shards), placed "whole tensor", named
``v{i}`` (the model's ``i``-th variable) and ``v{i}/{slot}``. The entry's JSON holds the rest:
the variables' paths, shapes and dtypes, the slot table, the optimizer's class, stage, config
and scalars, the model's Keras config, the position in training and the backend. Loading reads,
with numpy alone (:class:`~shardwise.checkpoint.flat_pieces.FlatPiecesReader`), exactly what
this rank holds in its own layout, so a checkpoint written at any rank count, ZeRO stage or
backend loads on any other.

Pass a model itself, or a :class:`KerasModelState` for options (leave the optimizer out,
record the epoch and batch reached, name the communicator).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import keras
import numpy as np

from ...checkpoint.door import EntryView, Piece, register_handler
from ...checkpoint.flat_pieces import WHOLE_PLACEMENT, safetensors_code
from ...core.comm import Communicator
from ...core.errors import CheckpointError
from .bridges import backend_name
from .hooks import find_distributed_optimizer
from .ops import sync_backend_state
from .sharded_state import TrainingState, describe_variables
from .slots import base_optimizer
from ... import context

__all__ = ["KERAS_MODEL", "KerasModelState", "model_comm", "keras_config", "describe", "save_pieces", "stage_model",
           "declared_shapes"]

KERAS_MODEL = "keras.model"


@dataclass(frozen=True)
class KerasModelState:
    """A Keras model as one entry of a checkpoint, with options.

    ``include_optimizer``: saving, whether the optimizer's state is written (None: yes);
    loading, None restores it when the checkpoint has it, True requires it, False takes the
    model's values only. ``epoch``/``batch``: where training stands, recorded when saving.
    ``comm``: the ranks the model trains on (default: its distributed optimizer's, else the
    world of ``shardwise.init()``, else this process alone).
    """

    model: Any
    include_optimizer: Optional[bool] = None
    epoch: int = 0
    batch: int = 0
    comm: Optional[Communicator] = None


def _as_state(obj: Any) -> KerasModelState:
    return obj if isinstance(obj, KerasModelState) else KerasModelState(obj)


def model_comm(model: Any, comm: Optional[Communicator] = None) -> Optional[Communicator]:
    """``comm``, else the distributed optimizer's, else the world if shardwise is initialized, else None."""
    if comm is not None:
        return comm
    dist = find_distributed_optimizer(model)
    if dist is not None and dist._comm is not None:
        return dist._comm
    return context.current().world if context.is_initialized() else None


def _portable(config: Any) -> Any:
    """A Keras config that deserializes on every backend: built-in optimizers are saved under a
    backend module (``keras.src.backend.torch.optimizers...``), which would bring torch's class to JAX."""
    if isinstance(config, dict):
        out = {k: _portable(v) for k, v in config.items()}
        if str(out.get("module", "")).startswith("keras.src.backend.") and "class_name" in out:
            out["module"], out["registered_name"] = "keras.optimizers", None
        return out
    if isinstance(config, list):
        return [_portable(v) for v in config]
    return config


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON data")


def keras_config(obj: Any) -> Optional[dict]:
    """``obj``'s portable Keras serialization as JSON data, or None when it has none."""
    try:
        raw = keras.saving.serialize_keras_object(obj)
        return _portable(json.loads(json.dumps(raw, default=_jsonable)))
    except (NotImplementedError, TypeError, ValueError):
        return None


def describe(state: TrainingState, model: Any, epoch: int, batch: int) -> dict:
    """The JSON description of ``state``: backend, Keras version, position, the model's config and variables,
    and the optimizer's class, stage, config, slot table and scalars (None without an optimizer)."""
    optimizer = None
    if state.optimizer is not None:
        optimizer = {"class": type(base_optimizer(state.optimizer)).__name__, "stage": state.stage,
                     "config": keras_config(base_optimizer(state.optimizer)), "slots": state.slot_table(),
                     "scalars": state.scalars()}
    return {"backend": backend_name(), "keras": keras.__version__,
            "position": {"epoch": int(epoch), "batch": int(batch)},
            "model": {"config": keras_config(model), "variables": describe_variables(state.variables)},
            "optimizer": optimizer}


def _data(values: np.ndarray) -> Callable[[], memoryview]:
    def data() -> memoryview:
        flat = np.ascontiguousarray(values).reshape(-1)
        return memoryview(flat.view(np.uint8)) if flat.size else memoryview(b"")
    return data


def save_pieces(obj: Any, comm: Optional[Communicator]) -> tuple[list[Piece], dict]:
    """This rank's pieces of a Keras model (or :class:`KerasModelState`) on ``comm``, and the entry's JSON."""
    spec = _as_state(obj)
    model = spec.model
    sync_backend_state(model)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    state = TrainingState(model, rank, size, with_optimizer=spec.include_optimizer is not False)
    written = state.write()
    pieces: list[Piece] = []
    declared: dict[str, list] = {}
    for key, info in written.table.items():
        shape = tuple(int(d) for d in info["shape"])
        declared[key] = [list(shape), info["dtype"]]
        for _, array, start, stop in info["pieces"]:
            values = written.arrays[array]
            pieces.append(Piece(key, shape, list(WHOLE_PLACEMENT), int(start), int(stop),
                                safetensors_code(values.dtype), _data(values)))
    meta = describe(state, model, spec.epoch, spec.batch)
    meta["tensors"] = declared
    return pieces, meta


def stage_model(model: Any, meta: Mapping[str, Any], reader: Any, include_optimizer: Optional[bool], rank: int,
                size: int) -> Callable[[], None]:
    """Read this rank's values of ``model`` (and its optimizer) from ``reader`` (a flat-range reader:
    ``read_whole``, ``read_into``) as the Keras description ``meta`` says, assigning nothing; returns the
    function that assigns them. A model not built yet is built from the saved build config first."""
    saved_opt = meta.get("optimizer")
    if include_optimizer is None:
        include_optimizer = saved_opt is not None
    if not model.built:
        build = ((meta.get("model") or {}).get("config") or {}).get("build_config")
        if not build:
            raise CheckpointError("the model is not built and the checkpoint has no build config: build it first")
        model.build_from_config(build)
    state = TrainingState(model, rank, size, with_optimizer=include_optimizer)
    return state.stage_values(reader, meta["model"]["variables"], saved_opt["slots"] if saved_opt else None,
                              saved_opt["scalars"] if saved_opt else {})


def declared_shapes(meta: Mapping[str, Any]) -> dict[str, list[int]]:
    """Key -> shape of every tensor the entry ``meta`` declares (those of no elements have no stored piece)."""
    return {k: list(v[0]) for k, v in (meta.get("tensors") or {}).items()}


def _load(obj: Any, view: EntryView) -> Callable[[], None]:
    spec = _as_state(obj)
    sync_backend_state(spec.model)
    comm = view.comm
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    return stage_model(spec.model, view.meta, view.flat_source(declared_shapes(view.meta)), spec.include_optimizer,
                       rank, size)


def _matches(obj: Any) -> bool:
    return isinstance(obj, KerasModelState) or isinstance(obj, keras.Model)


register_handler(KERAS_MODEL, _matches, save_pieces, _load, comm=lambda obj: model_comm(_as_state(obj).model,
                                                                                         _as_state(obj).comm),
                 with_comm=True)
