"""ZeRO stages 1, 2 and 3 for PyTorch, around any ``torch.optim`` optimizer class.

* stage 1: gradients are reduce-scattered over the data-parallel group, so each rank
  gets the averaged gradient of the shard it owns and steps only its shard of the
  (fp32 master) parameters; then the shards are all-gathered in place into the full
  parameter buffer.
* stage 2: gradients are reduce-scattered, so each rank only keeps the gradient
  shard it owns; full gradients are freed as soon as their bucket is reduced.
* stage 3: parameters are stored sharded too; each wrapped module's parameters are
  gathered just before its forward and its backward and freed after
  (see :mod:`.stage3`).

Stages 1 and 2 partition gradient buckets planned by
:func:`shardwise.core.buckets.plan_buckets` — the fusion plan of data parallelism
— and reduce each bucket from autograd hooks as soon as it is complete
(:mod:`.grads`), so communication overlaps the rest of backward.

The partitioning is :class:`shardwise.core.zero.PartitionPlan`; the memory it
should take is :func:`shardwise.core.memory.plan_state_bytes`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.context import current
from shardwise.core.buckets import DEFAULT_BUCKET_CAP_BYTES, plan_buckets
from shardwise.core.comm import Communicator
from shardwise.core.errors import ConfigError, ShardwiseError
from shardwise.core.loss_scale import LossScaler
from shardwise.core.memory import ModelStateMemory, plan_state_bytes

from ..compiling import not_traced, unwrap_compiled
from ..device_math import clip_by_total_norm, squared_norm, unscale_and_flag
from . import elastic
from .elastic import HookRecorder
from .grads import GradReducer
from .step import DeferredPublish, step_and_publish
from .units import Materializer, ZeroUnit, stage3_units

__all__ = ["ZeroOptimizer", "zero_owner"]

_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

#: Each partitioned parameter's ZeroOptimizer (a weak reference: neither outlives the other here).
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def zero_owner(p: nn.Parameter) -> Optional["ZeroOptimizer"]:
    """The ZeroOptimizer whose units partition ``p`` (the latest built over it), or None."""
    ref = _OWNERS.get(p)
    return ref() if ref is not None else None


def _world() -> Communicator:
    return current().world


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard optimizer state (1), gradients (2) and parameters (3) over ``comm``.

    ``module`` is the model (its trainable parameters are taken in registration
    order); ``optimizer_class(**defaults)`` is built over this rank's fp32 master
    shard(s). Use it like any optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``.
    With fp16 parameters call ``opt.backward(loss)`` so the dynamic loss scale applies.
    ``gradient_accumulation_steps`` backward passes make one step (gradients averaged
    over them, like DeepSpeed's ``gradient_accumulation_steps``).
    ``overlap_publish`` (stages 1, 2) lets the gather of the updated parameters run into the
    next forward: each module waits for its own parameters in a forward pre-hook. Code that
    reads parameters between ``step()`` and the next forward calls :meth:`wait_parameters`
    first (the module's ``state_dict`` and this optimizer's methods do it themselves).
    ``fuse_weight_grads`` (stages 2, 3): the linear layers that ``module``'s forward calls write
    their weight gradients straight into the reduce-scatter buffers, with no ``.grad`` in between
    (:mod:`.fusion`); off, with a warning, for a model that runs compiled.
    ``module`` may be compiled, whole (``torch.compile(model)``, which the optimizer unwraps)
    or per block; stage 3's hooks then run between the compiled graphs.
    ``reshard_after_forward`` (stage 3, default True, as in FSDP2): False keeps each module's
    gathered parameters from its forward to its backward, which then gathers nothing: one
    allgather per module and step instead of two, for the full parameters held through forward.
    ``materialize`` fills parameters that are still on the meta device, one unit at a time,
    just before the unit is partitioned (stage 3: each rank then keeps only its shard); the
    masters of meta parameters go on ``materialize.device`` where it has one (else the CPU),
    unless ``offload_optimizer="cpu"``.
    ``isolate`` (stages 1, 2): parameters that get a partition unit of their own, so that the
    same parameter held on several ranks outside ``comm`` (a tied embedding on two pipeline
    stages) has the same shard layout on each of them.
    ``scale_accumulated`` (default True) divides the gradients summed over an accumulation
    window by its length; False when the loss was scaled already (a pipeline's micro-batches).
    ``norm_comm`` and ``norm_counted``: the global gradient norm (clipping) and the non-finite
    check span ``norm_comm`` (default ``comm``), each rank counting the shards of the parameters
    for which ``norm_counted(param)`` is true (default all): with tensor or pipeline
    parallelism, ``norm_comm`` is every rank and a parameter replicated over the tensor-parallel
    group counts on one of its ranks.
    ``replicate_comm`` (hybrid sharding, as FSDP2's HSDP and DeepSpeed's MiCS): ``comm`` is then one
    shard group, and ``replicate_comm`` the ranks holding the same shard in the other groups. Parameters,
    gradients and optimizer state are sharded within the group (its gathers never leave it); each
    reduced gradient shard is then averaged over ``replicate_comm``, so the gradient is the mean over
    every replica. Expert parameters keep their own group (``expert_comm``).
    """

    def __init__(self, module: nn.Module, optimizer_class: type = torch.optim.Adam, *, stage: int = 1,
                 comm: Optional[Communicator] = None, clip_grad_norm: Optional[float] = None,
                 offload_optimizer: str = "none", alignment: int = 1, prefetch: bool = True,
                 loss_scaler: Optional[LossScaler] = None, wrap: Optional[Sequence[nn.Module]] = None,
                 measure_memory: bool = False, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 gradient_accumulation_steps: int = 1, overlap_publish: bool = False,
                 fuse_weight_grads: bool = True, reshard_after_forward: bool = True,
                 materialize: Optional[Materializer] = None, isolate: Sequence[nn.Parameter] = (),
                 scale_accumulated: bool = True, norm_comm: Optional[Communicator] = None,
                 norm_counted: Optional[Callable[[nn.Parameter], bool]] = None,
                 expert_params: Sequence[nn.Parameter] = (), expert_comm: Optional[Communicator] = None,
                 expert_grad_scale: float = 1.0, replicate_comm: Optional[Communicator] = None,
                 **defaults: Any) -> None:
        if stage not in (1, 2, 3):
            raise ConfigError(f"ZeroOptimizer stage must be 1, 2 or 3, got {stage!r} "
                              "(stage 0 is plain data parallel: use DistributedOptimizer)")
        if gradient_accumulation_steps < 1:
            raise ConfigError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        if not reshard_after_forward and stage != 3:
            raise ConfigError("reshard_after_forward=False applies to stage 3: stages 1 and 2 keep the full "
                              "parameters at all times")
        if overlap_publish and stage == 3:
            raise ConfigError("overlap_publish applies to stages 1 and 2: stage 3 gathers parameters in "
                              "forward already")
        if offload_optimizer not in ("none", "cpu"):
            raise ConfigError(f"offload_optimizer must be 'none' or 'cpu', got {offload_optimizer!r}")
        if isolate and stage == 3:
            raise ConfigError("isolate applies to stages 1 and 2: stage 3 builds its units from wrap=")
        if expert_params and expert_comm is None:
            raise ConfigError("expert_params need expert_comm= (the expert-data-parallel group they are "
                              "partitioned over)")
        if any(not p.requires_grad for p in expert_params):
            raise ConfigError("expert_params must be trainable (requires_grad=True)")
        if {id(p) for p in expert_params} & {id(p) for p in isolate}:
            raise ConfigError("a parameter cannot be both isolated and an expert parameter")
        module = unwrap_compiled(module)  # torch.compile(model): its hooks go on the model it compiles
        self.stage, self.clip_grad_norm, self.module = stage, clip_grad_norm, module
        self.optimizer_class = optimizer_class
        # The constructor's arguments, kept so that :meth:`reshard` can rebuild the partition.
        self.offload_optimizer, self.alignment, self.prefetch = offload_optimizer, alignment, prefetch
        self.wrap = list(wrap) if wrap is not None else None
        self.bucket_cap_bytes, self.gradient_accumulation_steps = bucket_cap_bytes, gradient_accumulation_steps
        self.optimizer_defaults = dict(defaults)
        self.measure_memory, self.overlap_publish = measure_memory, overlap_publish
        self.fuse_weight_grads, self.reshard_after_forward = fuse_weight_grads, bool(reshard_after_forward)
        self._deferred: Optional[DeferredPublish] = None
        self._materialize = materialize
        self._isolate = {id(p) for p in isolate}
        self.scale_accumulated = bool(scale_accumulated)
        self.norm_comm, self.norm_counted = norm_comm, norm_counted
        self._experts = {id(p) for p in expert_params}
        self.expert_comm, self.expert_grad_scale = expert_comm, float(expert_grad_scale)
        self.replicate_comm = replicate_comm if replicate_comm is not None and replicate_comm.size > 1 else None
        #: Model-state bytes measured at the last step (with ``measure_memory=True``).
        self.last_state_bytes: Optional[ModelStateMemory] = None
        self._build(comm if comm is not None else _world())
        model_dtype = next(p for p in module.parameters() if p.requires_grad).dtype
        self.precision = _PRECISION.get(model_dtype, "fp32")
        self.loss_scaler = loss_scaler if loss_scaler is not None else (
            LossScaler() if model_dtype == torch.float16 else LossScaler(dynamic=False))
        super().__init__([u.master for u in self.units], self.inner.defaults)
        self._expose_inner()
        if overlap_publish:
            module.register_state_dict_pre_hook(lambda *_args, **_kw: self.wait_parameters())
            module.register_load_state_dict_pre_hook(lambda *_args, **_kw: self.wait_parameters())

    def _build(self, comm: Communicator) -> None:
        """Partition the module's trainable parameters over ``comm``: units, inner optimizer, hooks."""
        self.comm = comm
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameter")
        self._check_same_model(named)
        device = named[0][1].device
        if device.type == "meta":  # the masters go where the materializer will put the parameters
            device = torch.device(getattr(self._materialize, "device", None) or "cpu")
        master_device = torch.device("cpu") if self.offload_optimizer == "cpu" else device
        experts = self._experts
        if self.stage < 3:
            rest = [(n, p) for n, p in named if id(p) not in self._isolate and id(p) not in experts]
            groups = self._buckets(rest, comm)
            position = {id(p): i for i, (_, p) in enumerate(named)}
            groups += [(None, [(n, p)], comm) for n, p in named if id(p) in self._isolate]
            if experts:
                groups += self._buckets([(n, p) for n, p in named if id(p) in experts], self.expert_comm)
            groups.sort(key=lambda g: position[id(g[1][0][1])])  # model order, the same on every rank
        else:
            groups = self._stage3_groups(stage3_units(self.module, self.wrap), comm)
        self.units = [ZeroUnit(i, ps, unit_comm, self.stage, torch.float32, master_device, self.alignment, m,
                               materialize=self._materialize)
                      for i, (m, ps, unit_comm) in enumerate(groups)]
        for unit in self.units:
            expert = id(unit.params[0]) in experts
            unit.grad_scale = self.expert_grad_scale if expert else 1.0
            unit.replicate = None if expert else self.replicate_comm
        for unit in self.units:
            for p in unit.params:
                _OWNERS[p] = weakref.ref(self)
        self.inner = self.optimizer_class([u.master for u in self.units], **self.optimizer_defaults)
        with HookRecorder(self.module, self.units) as hooks:
            self._stage3 = None
            if self.stage == 3:
                from .stage3 import Stage3Hooks

                self._stage3 = Stage3Hooks(self.module, self.units, prefetch=self.prefetch,
                                           reshard_after_forward=self.reshard_after_forward)
            if self.overlap_publish:
                self._deferred = DeferredPublish(self.module, self.units)
            self.reducer = GradReducer(self.units, self.stage, self.gradient_accumulation_steps,
                                       after_reduce=(lambda unit: unit.release()) if self.stage == 3
                                       else (lambda unit: None))
            self._fusion = None
            if self.stage > 1 and self.fuse_weight_grads:
                from .fusion import FusionHooks

                self._fusion = FusionHooks(self.module, self.units, self.reducer, self.stage)
        self._zero_hooks = hooks

    def _buckets(self, named: list[tuple[str, nn.Parameter]], comm: Communicator) -> list[tuple[Any, list, Communicator]]:
        """Stages 1, 2: ``named`` in reduce buckets (the data-parallel fusion plan), each a unit over ``comm``."""
        if not named:
            return []
        plan = plan_buckets([p.numel() for _, p in named], [str(p.dtype) for _, p in named],
                            [p.element_size() for _, p in named], self.bucket_cap_bytes)
        return [(None, [named[i] for i in sorted(b.params)], comm) for b in plan.buckets]

    def _stage3_groups(self, groups: list[tuple[Optional[nn.Module], list]],
                       comm: Communicator) -> list[tuple[Optional[nn.Module], list, Communicator]]:
        """Stage 3: the units over ``comm``, each module owning expert parameters taken out of its unit
        into a unit of its own over ``expert_comm``, right after it (so gathered over that group only)."""
        if not self._experts:
            return [(m, ps, comm) for m, ps in groups]
        owner: dict[int, nn.Module] = {}
        for sub in self.module.modules():
            for p in sub.parameters(recurse=False):
                if id(p) in self._experts:
                    owner.setdefault(id(p), sub)
        out: list[tuple[Optional[nn.Module], list, Communicator]] = []
        for m, ps in groups:
            dense = [(n, p) for n, p in ps if id(p) not in self._experts]
            if dense:
                out.append((m, dense, comm))
            by_module: dict[int, tuple[nn.Module, list]] = {}
            for n, p in ps:
                if id(p) in self._experts:
                    by_module.setdefault(id(owner[id(p)]), (owner[id(p)], []))[1].append((n, p))
            out.extend((sub, mine, self.expert_comm) for sub, mine in by_module.values())
        return out

    def _expose_inner(self) -> None:
        # The wrapper is the inner optimizer as far as schedulers and users can see.
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    # -- set-up checks --------------------------------------------------------------------------------
    def _check_same_model(self, named: list[tuple[str, nn.Parameter]]) -> None:
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        every = self.comm.allgather_object(mine)
        differing = [r for r, other in enumerate(every) if other != every[0]]
        if differing:
            first = every[differing[0]]
            diff = sorted(set(map(str, every[0])) ^ set(map(str, first)))[:6]
            raise ShardwiseError(f"ZeroOptimizer: ranks {differing} have a different model than rank 0 "
                                 f"(differing parameters: {', '.join(diff)})")

    # -- gradients --------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss scaled by the dynamic loss scale (fp16)."""
        (loss * self.loss_scaler.scale).backward()

    def _master_grads(self) -> list[torch.Tensor]:
        return [u.master.grad for u in self.units if u.master.grad is not None]

    @property
    def master_device(self) -> torch.device:
        """Where the master shards (and so their gradients, norms and flags) live."""
        return self.units[0].master.device if self.units else torch.device("cpu")

    def _unscale_and_check(self) -> bool:
        """Divide by the loss scale; True when every rank's gradients are finite.

        Only a dynamic scale (fp16) checks: fp32 and bf16 steps apply whatever the
        gradients are, as torch optimizers and DeepSpeed do, without a scan and a
        blocking collective per step. The check is one fused pass per device and one
        device-side flag, reduced over the ranks and read once (the step's host sync).
        """
        grads = self._master_grads()
        scale = self.loss_scaler.scale
        if not self.loss_scaler.dynamic:
            if scale != 1.0 and grads:
                torch._foreach_div_(grads, scale)
            return True
        flag = unscale_and_flag(grads, scale, self.master_device)
        flag = (self.norm_comm or self.comm).allreduce(flag, "max")
        return not bool(flag[0])

    def _counted_squares(self) -> torch.Tensor:
        """This rank's sum of squared master gradients over the shards of counted parameters (on their device)."""
        counted: list[torch.Tensor] = []
        for unit in self.units:
            g = unit.master.grad
            if g is None:
                continue
            if unit.replicate is not None and self.norm_comm is not None and unit.replicate.rank != 0:
                continue  # the same shard is counted on its first replica (norm_comm spans the replicas)
            if self.norm_counted is None:
                counted.append(g)
                continue
            params = dict(zip(unit.names, unit.params))
            counted.extend(g[piece.shard_offset: piece.shard_offset + piece.length]
                           for piece in unit.plan.rank_params(unit.comm.rank) if self.norm_counted(params[piece.name]))
        return squared_norm(counted, self.master_device)

    def _clip_on_device(self, max_norm: float) -> torch.Tensor:
        """Clip the master gradients to a global L2 norm; the norm stays a device tensor (no host sync)."""
        total = (self.norm_comm or self.comm).allreduce(self._counted_squares(), "sum")
        return clip_by_total_norm(self._master_grads(), total, max_norm)

    def clip_global_norm(self, max_norm: float) -> float:
        """Clip the master gradients to a global L2 norm computed across all shards (and ``norm_comm``)."""
        return float(self._clip_on_device(max_norm))

    # -- optimizer protocol ---------------------------------------------------------------------------------
    @not_traced  # inside a compiled train step: collectives and shard updates run eagerly
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Reduce gradients (stages 1/2), step this rank's shard, publish the new parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fusion is not None:
            self._fusion.settle()  # a compiled forward may have turned the fusion off
        if self.reducer.backward_passes == 0:
            return loss  # no gradient yet, like a torch optimizer without grads
        self.wait_parameters()
        if not self.reducer.window_complete():
            raise ShardwiseError(
                f"step() after {self.reducer.backward_passes} backward pass(es) with "
                f"gradient_accumulation_steps={self.reducer.accumulation_steps}: call step() once per "
                "full accumulation window, after backward()")
        self.reducer.reset()
        k = self.reducer.accumulation_steps
        if k > 1 and self.scale_accumulated:
            for g in self._master_grads():
                g.div_(k)
        for unit in self.units:  # expert units: averaged over their group, then 1 / ep
            if unit.grad_scale != 1.0 and unit.master.grad is not None:
                unit.master.grad.mul_(unit.grad_scale)
        finite = self._unscale_and_check()
        if self.loss_scaler.update(not finite):
            if self.clip_grad_norm is not None:
                self._clip_on_device(self.clip_grad_norm)
            deferred = self._deferred
            step_and_publish(self.inner, deferred.forward_order if deferred else self.units, defer=bool(deferred))
            if self.measure_memory:
                self.last_state_bytes = self.measured_state_bytes()
        for unit in self.units:
            unit.master.grad = None
        return loss

    def wait_parameters(self) -> None:
        """Block until the parameters updated by the last step are complete on this rank.

        Only needed with ``overlap_publish``, for reads of parameters before the next forward.
        """
        if self._deferred is not None:
            self._deferred.wait_all()

    @not_traced
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.reducer.backward_passes % self.reducer.accumulation_steps:
            return  # inside an accumulation window: keep accumulating
        for unit in self.units:
            unit.master.grad = None
            # Stage 1 keeps its flat gradient buffer: set_to_none only detaches the views (the
            # next gradients are copied in as they arrive), otherwise the buffer is zeroed.
            if not set_to_none and unit.zero_grads_in_place():
                continue
            for p in unit.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def remove(self) -> None:
        """Take every hook this optimizer registered off the model (idempotent).

        Afterwards the model runs plain: no gather, reduction or publish in forward or backward.
        Stage 3 first gathers every unit, so the parameters are complete on every rank: a
        collective, which every rank calls at the same point. :meth:`step` then has no reduced
        gradient to apply and returns.
        """
        self.wait_parameters()
        self.reducer.remove()
        if self._stage3 is not None:
            self._stage3.remove()
        self._zero_hooks.remove()  # and the hooks of weight-gradient fusion and overlap_publish
        for unit in self.units:  # same order on every rank
            unit.discard_prefetch()
            unit.gather()
        self.reducer.discard()

    # -- elastic training (see :mod:`.elastic`) ---------------------------------------------------------
    def full_state_dict(self) -> dict[str, Any]:
        """Collective: the complete, unsharded optimizer state, identical on every rank.

        Plain CPU tensors and Python objects keyed by parameter name, so it does not
        depend on the world size: fp32 masters, per-parameter optimizer state,
        hyperparameters, loss scaler and, at stage 3 only, the full parameters
        (layout in :mod:`.elastic`).
        """
        self.wait_parameters()
        return elastic.full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's slice of a :meth:`full_state_dict` and publish the parameters (no collective).

        Raises :class:`~shardwise.core.errors.CheckpointError` when ``state`` does not
        match the model. Gradients accumulated since the last step are discarded.
        """
        self.wait_parameters()
        elastic.load_full_state_dict(self, state)

    def reshard(self, comm: Communicator) -> None:
        """Re-partition over ``comm`` (a new world size); follow with :meth:`load_full_state_dict`.

        Collective over ``comm`` only. Rebuilds the units, the inner optimizer (same
        class and hyperparameters, empty state), the gradient reducer and the stage-3
        hooks; stage-3 parameter values are not carried over (zeros until loaded).
        """
        self.wait_parameters()
        elastic.reshard(self, comm)

    # -- introspection --------------------------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, complete, on every rank (stage 3 gathers them)."""
        self.wait_parameters()
        out = {}
        for unit in self.units:
            full = unit.comm.allgather(unit.shard, uniform=True) if self.stage == 3 else unit.flat
            for slot in unit.plan.params:
                out[slot.name] = full[slot.offset: slot.offset + slot.numel].view(slot.shape).clone()
        return out

    def measured_state_bytes(self) -> ModelStateMemory:
        """Bytes this rank holds for parameters, gradients and optimizer state (tensor storage)."""
        seen: set[int] = set()

        def size(t: Optional[torch.Tensor]) -> int:
            if t is None or t.numel() == 0:
                return 0
            key = t.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return t.untyped_storage().nbytes()

        params = sum(size(u.flat) if u.flat is not None else size(u.shard) for u in self.units)
        params += sum(size(p.data) for u in self.units for p in u.params)
        grads = sum(size(p.grad) for u in self.units for p in u.params)
        grads += sum(size(u.master.grad) for u in self.units)
        states = sum(size(u.master.data) for u in self.units)
        for per_param in self.inner.state.values():
            states += sum(size(v) for v in per_param.values() if torch.is_tensor(v) and v.dim() > 0)
        return ModelStateMemory(params=params, grads=grads, optimizer_states=states)

    def expected_state_bytes(self, optimizer: str) -> ModelStateMemory:
        """The core memory model's prediction for this rank (sum over units)."""
        parts = [plan_state_bytes(u.plan, self.stage, optimizer, self.precision) for u in self.units]
        return ModelStateMemory(params=sum(p.params for p in parts), grads=sum(p.grads for p in parts),
                                optimizer_states=sum(p.optimizer_states for p in parts))
