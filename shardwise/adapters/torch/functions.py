"""Horovod's state helpers: broadcast parameters, optimizer state and objects; gather objects."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from shardwise.core.comm import Communicator

from .grad_sync import ModelMismatchError, agree_parameters, dtype_name
from ..horovod.process_sets import ProcessSet, comm_of, global_process_set

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
           "broadcast_tensors"]


def broadcast_tensors(tensors: list[torch.Tensor], root_rank: int, comm: Communicator) -> None:
    """Overwrite ``tensors`` in place with ``root_rank``'s, one flat broadcast per dtype and device."""
    if comm.size == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    pending = []
    for (dtype, _), group in groups.items():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        if dtype == torch.bool:  # not every engine moves bool
            flat = flat.to(torch.uint8)
        pending.append((group, flat, comm.broadcast_async(flat, root_rank, inplace=True)))
    with torch.no_grad():
        for group, flat, handle in pending:
            handle.wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape).to(t.dtype))
                offset += t.numel()


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (f"tensor.{i}", p) for i, p in enumerate(params)]
    else:
        raise ValueError(f"broadcast_parameters takes a state_dict, named_parameters() or a list of "
                         f"tensors, got {type(params).__name__}")
    return [(str(n), t) for n, t in items if isinstance(t, torch.Tensor)]


def broadcast_parameters(params: Union[dict, Iterable], root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite tensors in place with ``root_rank``'s (a ``state_dict()``, ``named_parameters()`` or list).

    Ranks whose tensors differ in names, shapes or dtypes get a :class:`ModelMismatchError`.
    """
    comm = comm_of(process_set)
    named = _named_tensors(params)
    if comm.size == 1:
        return
    agree_parameters(comm, [(n, tuple(t.shape), dtype_name(t)) for n, t in named], "set of broadcast tensors")
    broadcast_tensors([t for _, t in named], set_root(root_rank, process_set), comm)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _layout(state_dict: dict) -> list[int]:
    return [len(g["params"]) for g in state_dict["param_groups"]]


def _materialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer with no state yet its state, as Horovod does: one step on zero gradients.

    Parameters that need gradients and have none get zero gradients (and keep them);
    the step is the wrapped torch optimizer's own, never a synchronising one.
    """
    if optimizer.state_dict()["state"]:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, torch.optim.LBFGS):
        inner.step(lambda: torch.zeros(()))
    else:
        inner.step()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set, model: Optional[Any] = None) -> None:
    """Make every rank's optimizer state (tensors, scalars and hyperparameters) equal ``root_rank``'s.

    ``root_rank``'s ``state_dict()`` travels as a pickled object (exact values,
    lazily created state included) and is loaded on the other ranks.
    """
    comm = comm_of(process_set)
    if comm.size == 1:
        return
    _materialize_state(optimizer)
    root_rank = set_root(root_rank, process_set)
    root_state = comm.broadcast_object(_to_cpu(optimizer.state_dict()) if comm.rank == root_rank else None,
                                       root_rank)
    mine = _layout(optimizer.state_dict())
    problem = None if mine == _layout(root_state) else f"parameters per group {mine} vs {_layout(root_state)}"
    problems = comm.allgather_object(problem)
    bad = {r: p for r, p in enumerate(problems) if p is not None}
    if bad:
        detail = "; ".join(f"rank {r}: {p}" for r, p in bad.items())
        raise ModelMismatchError(f"optimizers differ from rank {root_rank}'s on rank(s) {sorted(bad)} ({detail})")
    if comm.rank != root_rank:
        optimizer.load_state_dict(root_state)


def set_root(root_rank: int, process_set: Optional[ProcessSet]) -> int:
    """``root_rank`` (a world rank, as in Horovod) as a rank of ``process_set``'s communicator."""
    if process_set is None or not isinstance(process_set, ProcessSet) or process_set.is_global():
        return int(root_rank)
    ranks = process_set.ranks
    if int(root_rank) not in ranks:
        raise ValueError(f"root rank {root_rank} is not in the process set {ranks}")
    return ranks.index(int(root_rank))


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object, on every rank (``root_rank`` is a world rank)."""
    return comm_of(process_set).broadcast_object(obj, set_root(root_rank, process_set))


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order."""
    return comm_of(process_set).allgather_object(obj)
