"""ZeRO stage 3 for Keras on the torch backend: the torch adapter's ZeRO-3 driven by Keras layers.

Keras layers on torch are ``torch.nn.Module``s and a Keras variable's value is a
``torch.nn.Parameter``, so the torch adapter's pieces are reused as they are:
:class:`~shardwise.adapters.torch.zero.units.ZeroUnit` (one per layer owning
trainable variables: a shard kept between uses, the full variables gathered into one
buffer and freed), :class:`~shardwise.adapters.torch.zero.stage3.Stage3Hooks` (gather
before a layer's forward and again for its backward, the next gather prefetched,
ranks that run different layers stopped with a
:class:`~shardwise.core.errors.DivergenceError`) and
:class:`~shardwise.adapters.torch.zero.grads.GradReducer` (each gradient moved into
its unit's flat buffer as autograd produces it, the unit reduce-scattered, its full
gradient freed).

What differs is the step. Keras's torch ``train_step`` reads ``v.value.grad`` of
every trainable variable after ``loss.backward()`` and calls ``optimizer.apply``;
here nothing full is left for it: each unit's reduced gradient shard is applied to
the unit's shard by the inner Keras optimizer as soon as it arrives during backward
and then dropped, so shard gradients never all live at once (``apply`` only counts
the step). Under loss scaling (``mixed_float16``) the shard gradients are kept until
the ``LossScaleOptimizer`` has decided, with every rank, whether they are finite
(:meth:`TorchStage3.local_finite`); ``apply`` then unscales and steps them, and a
skipped step drops them. Weight regularizers are computed where their layer is
gathered (:mod:`.penalties`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import keras
import torch

from .....core.errors import ConfigError, ShardwiseError
from .....core.zero import PartitionPlan
from ....torch.zero.grads import GradReducer
from ....torch.zero.stage3 import Stage3Hooks
from ....torch.zero.units import ZeroUnit
from ...bridges import bridge
from ...ops import world
from ..access import install_access, register_layer, register_variables
from .penalties import Penalties, install_penalties

__all__ = ["TorchStage3", "Stage3Unit"]


@dataclass
class Stage3Unit:
    """One Keras layer's trainable variables, sharded (the :class:`~.stage3.Stage3Engine` unit)."""

    index: int
    members: tuple[int, ...]  # positions in the optimizer's variable list, in flat order
    plan: PartitionPlan
    shard: Any  # keras.Variable over this rank's range; its Parameter shares the torch unit's shard
    dtype: str
    torch_unit: "_KerasUnit"
    layer_path: str


class _KerasUnit(ZeroUnit):
    """A torch ZeRO-3 unit whose reduced gradient shard is handed to the engine as it arrives."""

    engine: "TorchStage3"

    def accumulate_master_grad(self, shard_grad: torch.Tensor) -> None:
        self.engine._gradient_arrived(self, shard_grad)


class _KerasHooks(Stage3Hooks):
    """Stage-3 module hooks that leave Keras's symbolic calls (shape inference) alone: they read no value."""

    def _root_pre_forward(self, module: Any, args: Any) -> None:
        if not _symbolic(args):
            super()._root_pre_forward(module, args)

    def _pre_forward(self, unit: ZeroUnit) -> Any:
        hook = super()._pre_forward(unit)

        def pre(module: Any, args: Any) -> None:
            if not _symbolic(args):
                hook(module, args)
                unit.engine.penalties.computed_in_forward(unit.index, unit.params)
        return pre

    def _post_forward(self, unit: ZeroUnit) -> Any:
        hook = super()._post_forward(unit)

        def post(module: Any, args: Any, output: Any) -> None:
            if not _symbolic(args):
                hook(module, args, output)
        return post


def _symbolic(args: Any) -> bool:
    return any(isinstance(a, keras.KerasTensor) for a in keras.tree.flatten(args))


def _path(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "variable"))


def _parent(variable: Any) -> str:
    return _path(variable).rpartition("/")[0]


class TorchStage3:
    """The torch backend's :class:`~.stage3.Stage3Engine`: one unit per Keras layer owning trainable variables.

    Made by ``ZeroOptimizer.build``: the variables are cut into shards there (the
    values of rank 0, so that every rank trains rank 0's model, as after
    ``BroadcastGlobalVariablesCallback(0)``) and their Parameters emptied; a variable
    still uninitialized from :func:`~..build.sharded_build` is initialized then,
    one unit at a time, so no rank ever holds the whole model.
    """

    def __init__(self, optimizer: Any, var_list: Sequence[Any]) -> None:
        self.optimizer = optimizer
        self.inner = optimizer.inner_optimizer
        _check_inner(self.inner)
        self.comm = world(optimizer._comm)
        self.variables = list(var_list)
        self.model: Optional[Any] = None
        self._hooks: Optional[_KerasHooks] = None
        self._reducer: Optional[GradReducer] = None
        self._lr: Any = None  # the learning rate of the step in progress, read once
        self._held: dict[int, torch.Tensor] = {}  # loss scaling: shard gradients until the step is decided
        self._loss_scaled = False
        self.units = self._make_units()
        regularized = {u.index: [(k, self.variables[m]) for k, m in enumerate(u.members)
                                 if getattr(self.variables[m], "regularizer", None) is not None] for u in self.units}
        self.penalties = Penalties(regularized, self._gradient_scale)
        with bridge().init_scope():
            for unit in self.units:
                unit.shard = keras.Variable(unit.torch_unit.master, name=f"zero3_shard_{unit.index}")
        if not self.inner.built:
            self.inner.build([u.shard for u in self.units])
        self._unit_of = {id(v): u for u in self.units for v in (self.variables[m] for m in u.members)}
        register_variables(self.variables, self)
        install_access()

    # -- units ------------------------------------------------------------------------------
    def _make_units(self) -> list[Stage3Unit]:
        groups: dict[tuple[str, str], list[int]] = {}
        for i, v in enumerate(self.variables):
            if getattr(v, "constraint", None) is not None:
                raise ConfigError(f"ZeroOptimizer stage 3 does not support variable constraints ({_path(v)}): "
                                  "a constraint needs the whole variable, the optimizer steps a shard")
            groups.setdefault((_parent(v), keras.backend.standardize_dtype(v.dtype)), []).append(i)
        units = []
        for index, ((parent, dtype), members) in enumerate(groups.items()):
            params = []
            for m in members:
                v = self.variables[m]
                if v._value is None:  # built under sharded_build: initialized now, this unit only
                    v._deferred_initialize()
                p = v._value
                if self.comm.size > 1:  # rank 0's model on every rank
                    self.comm.broadcast(p.data, 0, inplace=True)
                params.append((f"{m}:{_path(v)}", p))
            unit = _KerasUnit(index, params, self.comm, 3, params[0][1].dtype, params[0][1].device,
                              alignment=self.optimizer.alignment)
            unit.engine = self
            units.append(Stage3Unit(index, tuple(members), unit.plan, None, dtype, unit, parent))
        return units

    @property
    def sharded_variables(self) -> list[Any]:
        """The shards and the inner optimizer's slots (its iteration count and learning rate are replicated)."""
        replicated = {id(getattr(self.inner, "_iterations", None)), id(getattr(self.inner, "_learning_rate", None))}
        return [u.shard for u in self.units] + [v for v in self.inner.variables if id(v) not in replicated]

    def units_of(self, variables: Sequence[Any]) -> list[Stage3Unit]:
        """The units holding any of ``variables``, in unit order."""
        wanted = {id(self._unit_of[id(v)]) for v in variables if id(v) in self._unit_of}
        return [u for u in self.units if id(u) in wanted]

    # -- the model ----------------------------------------------------------------------------
    def attach(self, model: Any) -> None:
        """Install the gather/free hooks on ``model``'s layers and the gradient reducer (once per model)."""
        if self.model is model:
            return
        if self.model is not None:
            raise ConfigError("this ZeroOptimizer (stage 3) already trains another model; compile a new one")
        self.model = model
        for v in model.variables:  # replicated variables of a sharded build (Dropout seeds, BN statistics)
            if v._value is None:
                v._deferred_initialize()
        owner = self._owners(model)
        torch_units = []
        for unit in self.units:
            layer = owner.get(unit.layer_path)
            unit.torch_unit.module = layer if layer is not None and layer is not model else None
            torch_units.append(unit.torch_unit)
        for layer in [model] + list(model._flatten_layers(include_self=False)):
            if hasattr(layer, "_torch_params"):
                layer._track_variables()  # parameters tracked before a sharded build's initialization
            register_layer(layer, self)
        self._loss_scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        self._hooks = _KerasHooks(model, torch_units)
        self._reducer = GradReducer(torch_units, 3, 1, before_reduce=self._add_penalty_gradients,
                                    after_reduce=lambda u: u.release())
        if self.penalties.by_unit:
            install_penalties()
        model.register_forward_pre_hook(self._new_step, prepend=True)  # before a model-level unit's gather

    def _owners(self, model: Any) -> dict[str, Any]:
        """Layer by the path prefix of its own variables."""
        owners = {}
        for layer in [model] + list(model._flatten_layers(include_self=False)):
            for v in getattr(layer, "_trainable_variables", []):
                owners.setdefault(_parent(v), layer)
        return owners

    def _new_step(self, module: Any, args: Any) -> None:
        if _symbolic(args):
            return
        self.penalties.new_step()
        if self._held and torch.is_grad_enabled():
            self._held.clear()  # the loss scale skipped the last step: its gradients go

    # -- weight regularizers ------------------------------------------------------------------
    def regularization_losses(self, layer: Any) -> list[Any]:
        """``layer``'s weight penalties of this step (what Keras's ``layer.losses`` reports)."""
        return self.penalties.losses(layer, lambda v: id(v) in self._unit_of)

    def _add_penalty_gradients(self, torch_unit: ZeroUnit) -> None:
        """Before ``torch_unit`` is reduce-scattered: its penalties' gradients, if its layer ran this step."""
        if not self.penalties.due(torch_unit.index):
            return
        if not torch_unit.gathered:  # its output got no gradient; every rank sweeps it here, in one order
            torch_unit.gather()
        self.penalties.add_gradients(torch_unit.index, torch_unit.params, torch_unit.plan,
                                     self._reducer.grad_buffer(torch_unit))

    def _gradient_scale(self) -> float:
        """What the model's optimizer multiplies the loss by before backward (the loss scale, or 1)."""
        outer = getattr(self.model, "optimizer", None) or self.optimizer
        return float(keras.ops.convert_to_numpy(outer.scale_loss(1.0)))

    def shards_changed(self) -> None:
        """The shards were assigned from outside: drop prefetched and gathered copies (same order everywhere)."""
        for unit in self.units:
            unit.torch_unit.discard_prefetch()
            if unit.torch_unit.gathered:
                unit.torch_unit.release()
        self._held.clear()

    # -- the step ---------------------------------------------------------------------------
    def _gradient_arrived(self, torch_unit: _KerasUnit, shard_grad: torch.Tensor) -> None:
        unit = self.units[torch_unit.index]
        if self._loss_scaled:
            held = self._held.get(unit.index)
            self._held[unit.index] = shard_grad if held is None else held.add_(shard_grad)
            return
        self._step_unit(unit, shard_grad)

    @torch.no_grad()
    def _step_unit(self, unit: Stage3Unit, grad: torch.Tensor) -> None:
        """One unit's share of the step: the inner optimizer's update of its shard (no iteration counted)."""
        inner = self.inner
        if self._lr is None:
            self._lr = keras.ops.convert_to_tensor(inner.learning_rate)
        factor = inner.loss_scale_factor
        if factor is not None:
            grad = grad / factor
        grads = inner._clip_gradients([grad])
        inner._apply_weight_decay([unit.shard])
        inner._backend_update_step(grads, [unit.shard], self._lr)

    def local_finite(self) -> torch.Tensor:
        """True when this rank's held shard gradients are all finite (loss scaling; no collective)."""
        held = list(self._held.values())
        if not held:
            return torch.tensor(True)
        return torch.stack([torch.isfinite(g).all() for g in held]).all()

    def apply(self, grads: Sequence[Any], trainable_variables: Any = None) -> None:
        """End the step: the shards were updated during backward; unscale and apply held gradients; count it."""
        full = [i for i, g in enumerate(grads) if g is not None and getattr(g, "numel", lambda: 1)() > 0]
        if full:
            raise ConfigError(
                f"ZeroOptimizer stage 3 (torch) got {len(full)} full gradient(s) in apply(): gradients are "
                "reduce-scattered during loss.backward(), which leaves every variable's .grad empty. Compute "
                "them with loss.backward() (Keras's train_step does) and pass the empty .grad values")
        if self._held:
            scale = self._loss_scale()
            for unit in self.units:
                grad = self._held.pop(unit.index, None)
                if grad is not None:
                    self._step_unit(unit, grad / scale if scale != 1.0 else grad)
        self._lr = None
        self.inner.iterations.assign_add(1)

    def _loss_scale(self) -> float:
        outer = getattr(self.model, "optimizer", None)
        scale = getattr(outer, "dynamic_scale", None) if self._loss_scaled else None
        return 1.0 if scale is None else float(keras.ops.convert_to_numpy(scale))

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        raise ShardwiseError("stateless_apply is JAX's functional step; the torch backend steps in apply()")

    # -- whole variables for the user -----------------------------------------------------------
    def gather(self, units: Sequence[Stage3Unit]) -> list[tuple[Stage3Unit, torch.Tensor]]:
        """Collective: bind ``units`` not gathered yet to whole values, in a buffer of their own.

        Not the unit's gather buffer: reading a variable as numpy pins its storage,
        which the training gathers free by resizing. Returns what :meth:`release` frees.
        """
        done = []
        for unit in units:
            tu = unit.torch_unit
            if tu.gathered:
                continue
            full = torch.empty(tu.plan.padded_numel, dtype=tu.dtype, device=tu.device)
            self.comm.allgather_into(full, tu.shard)
            tu._bind(full)
            tu.gathered = True
            done.append((unit, full))
        return done

    def release(self, gathered: Sequence[tuple[Stage3Unit, torch.Tensor]], write_back: bool) -> None:
        """Free what :meth:`gather` bound; with ``write_back`` first copy this rank's range into the shard."""
        for unit, full in gathered:
            tu = unit.torch_unit
            if write_back:
                with torch.no_grad():
                    tu.shard.copy_(full[tu.start:tu.end])
            tu.release()


def _check_inner(inner: Any) -> None:
    if getattr(inner, "gradient_accumulation_steps", None):
        raise ConfigError("ZeroOptimizer stage 3 does not support the inner optimizer's "
                          "gradient_accumulation_steps: each unit steps as soon as its gradient is reduced")
