"""Elastic ZeRO: the optimizer's full (unsharded) state, and re-partitioning for a new world size.

:func:`full_state_dict` (collective) gathers every rank's shards into one state that
depends only on parameter names and shapes, never on the world size, the bucket
plan, the alignment or the stage. Every value is a CPU tensor or a plain Python
object, identical on every rank::

    {"format": 1, "stage": 2, "optimizer": "Adam",
     "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), ...}],  # hyperparameters, no "params"
     "loss_scaler": {"scale": 1.0, ...},                           # LossScaler.state_dict()
     "elementwise": ["exp_avg", "exp_avg_sq"],                     # state keys shaped like the parameter
     "master": {name: fp32 tensor of the parameter's shape},
     "state": {name: {"step": tensor(5.), "exp_avg": tensor, "exp_avg_sq": tensor}},
     "parameters": {name: tensor in the model's dtype}}            # stage 3 only

``state[name]`` looks like a plain torch optimizer's state of that parameter:
element-wise tensors are cut out of the gathered unit buffers (padding removed),
scalar states (Adam's ``step``, shared by all parameters of a partition unit) are
repeated for each of its parameters.

The model parameters are left out at stages 1 and 2: they are complete on every
rank, so the module's own ``state_dict`` holds them. At stage 3 the module's
``state_dict`` holds *empty* tensors for the trainable parameters (they are freed
between uses), so ``"parameters"`` carries them, complete, in the model's dtype.
They always equal the masters cast to that dtype, which is what
:func:`load_full_state_dict` publishes; on loading only their names and shapes are
checked.

:func:`load_full_state_dict` is local: each rank cuts its own slice out of the full
tensors for its current partition. :func:`reshard` rebuilds the partition over a
new communicator (collective over that communicator only, so it works after the
old one lost ranks).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
from torch import nn

from shardwise.checkpoint.state import check_mismatch
from shardwise.core.comm import Communicator
from shardwise.core.errors import CheckpointError, ConfigError, ShardwiseError
from shardwise.core.zero import ParamSlot

from .units import ZeroUnit

if TYPE_CHECKING:
    from .optimizer import ZeroOptimizer

__all__ = ["full_state_dict", "load_full_state_dict", "reshard", "HookRecorder"]

FORMAT = 1


class HookRecorder:
    """Remembers the hooks registered on a module tree and on units' parameters inside a ``with`` block.

    :class:`~.grads.GradReducer` and :class:`~.stage3.Stage3Hooks` do not
    keep their hook handles; :meth:`remove` takes exactly the hooks they added off
    again, so a resharded optimizer does not leave the old partition's hooks behind.
    """

    def __init__(self, module: nn.Module, units: list[ZeroUnit]) -> None:
        self.module, self.units = module, units
        self.added: list[tuple[dict, Any, list[dict]]] = []
        self._before: dict[int, set] = {}

    def _tables(self) -> list[tuple[dict, list[dict]]]:
        tables: list[tuple[dict, list[dict]]] = []
        modules = {id(m): m for m in self.module.modules()}
        modules.update((id(u.module), u.module) for u in self.units if u.module is not None)
        for m in modules.values():
            tables.append((m._forward_pre_hooks, [getattr(m, "_forward_pre_hooks_with_kwargs", {})]))
            tables.append((m._forward_hooks, [getattr(m, "_forward_hooks_with_kwargs", {}),
                                              getattr(m, "_forward_hooks_always_called", {})]))
        for unit in self.units:
            for p in unit.params:
                if p._post_accumulate_grad_hooks is not None:
                    tables.append((p._post_accumulate_grad_hooks, []))
        return tables

    def __enter__(self) -> "HookRecorder":
        self._before = {id(table): set(table) for table, _ in self._tables()}
        return self

    def __exit__(self, *exc: Any) -> None:
        for table, extras in self._tables():
            old = self._before.get(id(table), set())
            self.added.extend((table, key, extras) for key in table if key not in old)
        self._before = {}

    def remove(self) -> None:
        """Unregister every recorded hook (idempotent)."""
        for table, key, extras in self.added:
            table.pop(key, None)
            for extra in extras:
                extra.pop(key, None)
        self.added = []


# -- full state --------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    return value.detach().cpu().clone() if torch.is_tensor(value) else copy.deepcopy(value)


def _hyperparameters(opt: "ZeroOptimizer") -> list[dict[str, Any]]:
    return [{k: _plain(v) for k, v in group.items() if k != "params"} for group in opt.param_groups]


def _gather_flat(comm: Communicator, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's shard of each 1-D tensor, concatenated (the padded flat buffer), on the CPU.

    Tensors of one dtype and device travel in one allgather (on that device: a master shard
    offloaded to the host and a parameter shard on a GPU go separately).
    """
    out: dict[str, torch.Tensor] = {}
    by_kind: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for key, t in tensors.items():
        by_kind.setdefault((t.dtype, t.device), []).append(key)
    for keys in by_kind.values():
        stacked = torch.stack([tensors[k].detach().reshape(-1) for k in keys])  # (k, shard)
        k, shard = stacked.shape
        gathered = comm.allgather(stacked.reshape(1, k * shard))  # (world, k * shard)
        rows = gathered.reshape(comm.size, k, shard).transpose(0, 1).reshape(k, comm.size * shard).cpu()
        out.update(zip(keys, rows))
    return out


def _cut(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """A copy of one parameter's elements of a padded flat buffer, in the parameter's shape."""
    return flat[slot.offset: slot.offset + slot.numel].reshape(slot.shape).clone()


def _unit_state(opt: "ZeroOptimizer", unit: ZeroUnit) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The inner optimizer's state of ``unit``'s master, split into element-wise and scalar parts."""
    elementwise, scalars = {}, {}
    for key, value in opt.inner.state.get(unit.master, {}).items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape != unit.master.shape:
                raise ConfigError(f"optimizer state {key!r} of ZeRO unit {unit.index} has shape "
                                  f"{tuple(value.shape)}, not the master shard's {tuple(unit.master.shape)}: "
                                  f"{opt.optimizer_class.__name__} keeps state that cannot be resharded")
            elementwise[key] = value
        else:
            scalars[key] = value
    return elementwise, scalars


def _refuse_experts(opt: "ZeroOptimizer", what: str) -> None:
    """:class:`ConfigError` for an optimizer with expert units: their state is not one tensor per name."""
    if opt._experts:
        raise ConfigError(f"{what} of a ZeroOptimizer with expert_params is not supported: each expert-parallel "
                          "rank holds other experts under the same names; use the parallel model's "
                          "save_checkpoint / load_checkpoint, which reshard expert parallelism")


def full_state_dict(opt: "ZeroOptimizer") -> dict[str, Any]:
    """Collective over ``opt.comm``: the complete optimizer state (layout in the module docstring)."""
    _refuse_experts(opt, "full_state_dict")
    parts = [_unit_state(opt, unit) for unit in opt.units]
    mine = [(u.index, u.plan.fingerprint(), sorted((k, str(v.dtype)) for k, v in e.items()), sorted(s))
            for u, (e, s) in zip(opt.units, parts)]
    every = opt.comm.allgather_object(mine)
    differing = [r for r, other in enumerate(every) if other != every[0]]
    if differing:
        raise ShardwiseError(f"full_state_dict: ranks {differing} hold other partitions or optimizer state keys "
                             "than rank 0 (did every rank take the same steps?)")
    master: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    params: dict[str, torch.Tensor] = {}
    keys: list[str] = []
    for unit, (elementwise, scalars) in zip(opt.units, parts):
        tensors = {"master": unit.master.detach(), **{f"state/{k}": v for k, v in elementwise.items()}}
        if opt.stage == 3 and not unit.master_is_shard:
            tensors["parameter"] = unit.shard
        full = _gather_flat(unit.comm, tensors)
        keys.extend(k for k in elementwise if k not in keys)
        for slot in unit.plan.params:
            master[slot.name] = _cut(full["master"], slot)
            state[slot.name] = {k: _plain(v) for k, v in scalars.items()}
            state[slot.name].update((k, _cut(full[f"state/{k}"], slot)) for k in elementwise)
            if opt.stage == 3:  # the shard always equals the master cast to the model's dtype
                params[slot.name] = (_cut(full["parameter"], slot) if "parameter" in full
                                     else master[slot.name].to(unit.dtype, copy=True))
    out = {"format": FORMAT, "stage": opt.stage, "optimizer": opt.optimizer_class.__name__,
           "param_groups": _hyperparameters(opt), "loss_scaler": dict(opt.loss_scaler.state_dict()),
           "elementwise": keys, "master": master, "state": state}
    if opt.stage == 3:
        out["parameters"] = params
    return out


# -- loading -----------------------------------------------------------------------------------------
def _shapes(tensors: Any, what: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(tensors, Mapping) or not all(torch.is_tensor(v) for v in tensors.values()):
        raise CheckpointError(f"the full ZeRO state's {what!r} must map parameter names to tensors")
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _check_full_state(opt: "ZeroOptimizer", state: Any) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(f"a full ZeRO state must be a dict from full_state_dict(), got {type(state).__name__}")
    missing = [k for k in ("format", "optimizer", "param_groups", "loss_scaler", "master", "state") if k not in state]
    if missing:
        raise CheckpointError(f"the full ZeRO state lacks {missing}: not made by ZeroOptimizer.full_state_dict()")
    if state["format"] != FORMAT:
        raise CheckpointError(f"full ZeRO state has format {state['format']!r}; this shardwise reads {FORMAT}")
    if state["optimizer"] != opt.optimizer_class.__name__:
        raise CheckpointError(f"full ZeRO state is of a {state['optimizer']} optimizer, "
                              f"this ZeroOptimizer wraps {opt.optimizer_class.__name__}")
    expected = {s.name: s.shape for u in opt.units for s in u.plan.params}
    check_mismatch(expected, _shapes(state["master"], "master"), what="full ZeRO state")
    if not isinstance(state["state"], Mapping) or not all(isinstance(v, Mapping) for v in state["state"].values()):
        raise CheckpointError("the full ZeRO state's 'state' must map parameter names to dicts of optimizer state")
    check_mismatch(expected, {k: expected.get(k, ()) for k in state["state"]}, what="full ZeRO optimizer state")
    if "parameters" in state:
        check_mismatch(expected, _shapes(state["parameters"], "parameters"), what="full ZeRO state's parameters")
    elementwise = set(state.get("elementwise", ()))
    for name, per in state["state"].items():
        for key, value in per.items():
            if key in elementwise and (not torch.is_tensor(value) or tuple(value.shape) != tuple(expected[name])):
                shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise CheckpointError(f"optimizer state {key!r} of {name!r} is {shape} in the full ZeRO state, "
                                      f"the parameter is {tuple(expected[name])}")
    if len(state["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"full ZeRO state has {len(state['param_groups'])} parameter groups, "
                              f"the optimizer {len(opt.param_groups)}")


def _own_slice(unit: ZeroUnit, full: Mapping[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the padded flat buffer of ``full`` (one tensor per parameter name).

    Floating-point values take ``like``'s dtype (as ``torch.optim.Optimizer.load_state_dict``
    casts state to its parameter's); the result is on ``like``'s device.
    """
    source = full[unit.plan.params[0].name].dtype
    out = torch.zeros(unit.end - unit.start, device=like.device,
                      dtype=like.dtype if source.is_floating_point else source)
    for piece in unit.plan.rank_params(unit.comm.rank):
        src = full[piece.name].reshape(-1)[piece.param_offset: piece.param_offset + piece.length]
        out[piece.shard_offset: piece.shard_offset + piece.length].copy_(src)
    return out


def _unit_inner_state(opt: "ZeroOptimizer", unit: ZeroUnit, state: Mapping[str, Any]) -> dict[str, Any]:
    names = [s.name for s in unit.plan.params]
    per = [state["state"][n] for n in names]
    keys = list(per[0])
    for name, p in zip(names, per):
        if sorted(p) != sorted(keys):
            raise CheckpointError(f"full ZeRO state: {name!r} has optimizer state {sorted(p)}, {names[0]!r} has "
                                  f"{sorted(keys)}, but they share one partition unit (one optimizer state)")
    elementwise = set(state.get("elementwise", ()))
    group = next((g for g in opt.param_groups if any(q is unit.master for q in g["params"])), {})
    on_device = bool(group.get("capturable") or group.get("fused"))
    out: dict[str, Any] = {}
    for key in keys:
        if key in elementwise:
            out[key] = _own_slice(unit, {n: p[key] for n, p in zip(names, per)}, unit.master.detach())
            continue
        value = per[0][key]
        for name, p in zip(names[1:], per[1:]):
            other = p[key]
            same = torch.equal(other, value) if torch.is_tensor(value) and torch.is_tensor(other) else other == value
            if not same:
                raise CheckpointError(f"full ZeRO state: {key!r} of {name!r} differs from {names[0]!r}'s, "
                                      "but they share one partition unit")
        value = _plain(value)
        out[key] = value.to(unit.master.device) if torch.is_tensor(value) and on_device else value
    return out


def _discard_gradients(opt: "ZeroOptimizer") -> None:
    opt.reducer.discard()
    for unit in opt.units:
        unit.master.grad = None
        if not unit.zero_grads_in_place():
            unit.drop_full_grads()


def load_full_state_dict(opt: "ZeroOptimizer", state: Mapping[str, Any]) -> None:
    """Load a :func:`full_state_dict` into ``opt``'s current partition; local, no collective."""
    _check_full_state(opt, state)
    inner_states = [_unit_inner_state(opt, unit, state) for unit in opt.units]
    _discard_gradients(opt)
    with torch.no_grad():
        for unit, inner in zip(opt.units, inner_states):
            unit.master.copy_(_own_slice(unit, state["master"], unit.master.detach()))
            if inner:
                opt.inner.state[unit.master] = inner
            else:
                opt.inner.state.pop(unit.master, None)
            # Publish like step() does, from the full masters at hand instead of an allgather.
            unit.pending = None
            if unit.stage < 3:
                for slot in unit.plan.params:
                    unit.flat[slot.offset: slot.offset + slot.numel].copy_(
                        state["master"][slot.name].reshape(-1).to(unit.flat.device, unit.dtype))
            else:
                unit.publish_master()
                if unit.gathered:
                    unit.release()
    for group, saved in zip(opt.param_groups, state["param_groups"]):
        group.update((k, _plain(v)) for k, v in saved.items() if k != "params")
    opt.loss_scaler.load_state_dict(state["loss_scaler"])


# -- resharding --------------------------------------------------------------------------------------
def reshard(opt: "ZeroOptimizer", comm: Optional[Communicator]) -> None:
    """Rebuild ``opt``'s partition over ``comm`` (collective over ``comm``, never the old communicator)."""
    _refuse_experts(opt, "reshard")
    if not isinstance(comm, Communicator):
        raise ConfigError(f"reshard needs a Communicator, got {type(comm).__name__} "
                          "(a rank outside a split group gets None: it has nothing to reshard)")
    hyper = _hyperparameters(opt)
    opt._zero_hooks.remove()
    for unit in opt.units:
        unit.pending = None
        unit.master.grad = None
        for slot, p in zip(unit.plan.params, unit.params):
            p.grad = None
            if not unit.gathered:  # stage 3: the values are spread over the old group; load them afterwards
                p.data = torch.zeros(slot.shape, dtype=unit.dtype, device=unit.device)
    opt._build(comm)
    opt._expose_inner()
    for group, saved in zip(opt.param_groups, hyper):
        group.update(saved)
