"""The door's handler of a data-parallel ``ZeroOptimizer`` (kind ``torch.zero_optimizer``, stages 1, 2, 3).

Each rank contributes, for every parameter of every partition unit, the element range of the
whole parameter that its shard holds (``plan.rank_params(rank)``), under the parameter's name
in the optimizer's module (``module.named_parameters()``):

- ``<name>``: the parameter, in the model's dtype (at stage 3 the only copy of the weights);
- ``master/<name>``: the fp32 master, where it is not the shard itself (a 16-bit model);
- ``optimizer/<key>/<name>``: the inner optimizer's element-wise state (Adam's ``exp_avg``...);
  scalar state (Adam's ``step``) is a 0-d tensor every rank holds alike, written once.

The entry's metadata holds the optimizer class, the stage, every parameter's shape, the
hyperparameters (``param_groups`` without ``params``) and the loss scaler's state. These are
the pieces a ParallelModel at ZeRO writes (:mod:`.parallel.local_pieces`), and loading reads
them the same way (:func:`.parallel.full_tensors._stage_zero`): any world size, any stage,
bit for bit.

A module whose trainable parameters a stage-3 ZeroOptimizer partitions holds none of them
itself (they are freed between uses): the ``torch.module`` handler leaves them out of the
module's entry (the rest, buffers and frozen parameters, stays there) and the
ZeroOptimizer's entry carries them, so ``save(d, step, {"model": model, "opt": zero_opt})``
is the whole state. See :mod:`.state`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ....checkpoint.door import EntryView, Piece, register_handler
from .pieces import encode_placement, entry_source
from ....checkpoint.state import check_mismatch
from ....core.errors import CheckpointError
from ....core.placement import Placement
from .kinds import ZERO_OPTIMIZER, dtype_code, tensor_bytes
from ..zero import ZeroOptimizer

__all__ = ["ZERO_OPTIMIZER", "as_pieces", "set_hyperparameters"]


def as_pieces(local: list) -> list[Piece]:
    """Door pieces of :class:`~.parallel.local_pieces.LocalPiece` s (bytes produced when written)."""
    return [Piece(lp.key, lp.placement.full_shape, encode_placement(lp.placement), lp.start, lp.stop,
                  dtype_code(lp.key, torch.empty(0, dtype=lp.dtype)), lambda lp=lp: tensor_bytes(lp.values())())
            for lp in local]


def set_hyperparameters(param_groups: list[dict], saved: list[dict]) -> None:
    """Set each group's hyperparameters to a saved JSON copy's (tuples stay tuples; tensors and None kept)."""
    for group, values in zip(param_groups, saved):
        for k, v in values.items():
            if k != "params" and k in group and v is not None and not torch.is_tensor(group[k]):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


class _Names:
    """A ZeroOptimizer's parameters' names and whole-tensor placements, asked for as ``pm.tensors``
    by the ParallelModel's ZeRO functions (:func:`~.parallel.local_pieces._zero_unit`,
    :func:`~.parallel.full_tensors._stage_zero`): a data-parallel optimizer holds every tensor whole."""

    def __init__(self, opt: ZeroOptimizer) -> None:
        self._of = {id(p): (slot.name, tuple(slot.shape)) for unit in opt.units
                    for slot, p in zip(unit.plan.params, unit.params)}
        self.tensors = self

    def name(self, p: nn.Parameter) -> str:
        return self._of[id(p)][0]

    def placement(self, p: nn.Parameter) -> Placement:
        name, shape = self._of[id(p)]
        return Placement(name, shape)


def _shapes(opt: ZeroOptimizer) -> dict[str, list[int]]:
    return {slot.name: list(slot.shape) for unit in opt.units for slot in unit.plan.params}


def _save_zero(opt: ZeroOptimizer) -> tuple[list[Piece], dict]:
    from .parallel import _jsonable, _jsonable_dict
    from ..parallel.local_pieces import _zero_unit

    opt.wait_parameters()
    names = _Names(opt)
    local = [lp for unit in opt.units for lp in _zero_unit(names, opt, unit, set(), True, True)]
    meta = {"optimizer": opt.optimizer_class.__name__, "stage": opt.stage, "world_size": opt.comm.size,
            "parameters": _shapes(opt),
            "param_groups": [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "loss_scaler": _jsonable_dict(opt.loss_scaler.state_dict())}
    return as_pieces(local), meta


def _load_zero(opt: ZeroOptimizer, view: EntryView) -> Callable[[], None]:
    from ..parallel.full_tensors import _stage_zero
    from ..zero.elastic import _discard_gradients

    saved_class = view.meta.get("optimizer")
    if saved_class != opt.optimizer_class.__name__:
        raise CheckpointError(f"{view.where}: entry {view.name!r} holds {saved_class} state, this ZeroOptimizer "
                              f"wraps {opt.optimizer_class.__name__}")
    saved = {n: tuple(s) for n, s in view.meta.get("parameters", {}).items()}
    check_mismatch({n: tuple(s) for n, s in _shapes(opt).items()}, saved, what=f"checkpoint entry {view.name!r}")
    groups = list(view.meta.get("param_groups", []))
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"{view.where}: entry {view.name!r} has {len(groups)} parameter groups, this "
                              f"ZeroOptimizer {len(opt.param_groups)}")
    apply_tensors = _stage_zero(_Names(opt), opt, entry_source(view), True)
    scaler: Any = view.meta.get("loss_scaler")

    def apply() -> None:
        _discard_gradients(opt)
        apply_tensors()
        set_hyperparameters(opt.param_groups, groups)
        if scaler:
            opt.loss_scaler.load_state_dict(scaler)
    return apply


register_handler(ZERO_OPTIMIZER, lambda obj: isinstance(obj, ZeroOptimizer), _save_zero, _load_zero,
                 comm=lambda opt: opt.comm)
