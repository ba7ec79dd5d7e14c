"""Partition units of ZeRO: groups of parameters sharded together across data-parallel ranks.

Stages 1 and 2 use one unit holding every trainable parameter; stage 3 uses one
unit per wrapped module, so each module's parameters are gathered on their own.
A unit owns a :class:`~shardwise.core.zero.PartitionPlan`, this rank's shard of
the flat parameter buffer and the fp32 master copy the optimizer updates.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from shardwise.backends import host_buffers
from shardwise.core.comm import Communicator, CompletedHandle, Handle
from shardwise.core.errors import ConfigError
from shardwise.core.zero import PartitionPlan

#: Fills meta-device parameters with their values in place (``p.data = ...``), given their names.
Materializer = Callable[[Sequence[tuple[str, nn.Parameter]]], None]


class ZeroUnit:
    """Parameters partitioned together; ``stage`` 3 frees the full parameters between uses."""

    def __init__(self, index: int, named: Sequence[tuple[str, nn.Parameter]], comm: Communicator,
                 stage: int, master_dtype: torch.dtype, master_device: torch.device,
                 alignment: int = 1, module: Optional[nn.Module] = None,
                 materialize: Optional[Materializer] = None) -> None:
        if not named:
            raise ConfigError(f"ZeRO unit {index} has no trainable parameter")
        if any(p.is_meta for _, p in named):
            if materialize is None:
                raise ConfigError(f"ZeRO unit {index} has parameters on the meta device and nothing to "
                                  "materialize them with (build the model through parallelize)")
            # One unit at a time: its full parameters live only until this rank's shard is cut.
            materialize(named)
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ConfigError(f"ZeRO unit {index} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                              "cast the model to one dtype")
        self.index, self.comm, self.stage, self.module = index, comm, stage, module
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.plan = PartitionPlan.build([(n, tuple(p.shape)) for n, p in named], comm.size, alignment=alignment)
        self.start, self.end = self.plan.owned_range(comm.rank)
        flat = torch.zeros(self.plan.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for slot, p in zip(self.plan.params, self.params):
                flat[slot.offset: slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        # Stage 3: the full parameters live in ``_full`` only while gathered; its storage is
        # resized to nothing in between, so that views autograd saved in forward free it too.
        self._full: Optional[torch.Tensor] = None
        self.pending: Optional[Handle] = None  # an allgather started ahead of use (prefetch)
        #: Stage 3: starts each allgather of the parameters, checking that every rank gathers
        #: this unit now (:class:`~.agreement.GatherCheck`); None: the plain allgather.
        self.check: Optional[Any] = None
        if stage < 3:
            self.flat: Optional[torch.Tensor] = flat
            self._bind(flat)
            self.shard = flat[self.start: self.end]
        else:
            self.flat = None
            self.shard = flat[self.start: self.end].clone()
            self._full = flat
            self.release()
        same = master_dtype == self.dtype and master_device == self.device
        master = self.shard if same else self.shard.detach().to(master_device, master_dtype).clone()
        self.master = nn.Parameter(master, requires_grad=True)
        self.master_is_shard = same
        self.grad_flat: Optional[torch.Tensor] = None
        self.gathered = stage < 3
        self.publishing: Optional[Handle] = None  # a deferred gather of updated parameters (stages 1, 2)
        #: Factor applied to the reduced (averaged over ``comm``) gradient before the step: 1, or
        #: ``1 / ep`` for a unit of expert parameters averaged over their expert-data-parallel group.
        self.grad_scale = 1.0
        #: Hybrid sharding: the ranks holding the same shard in the other shard groups, over which the
        #: gradient shard reduced within ``comm`` is then averaged (None: ``comm`` is every replica).
        self.replicate: Optional[Communicator] = None

    @property
    def numel(self) -> int:
        return self.plan.numel

    # -- parameters ------------------------------------------------------------------------------
    def _bind(self, flat: torch.Tensor) -> None:
        for slot, p in zip(self.plan.params, self.params):
            p.data = flat[slot.offset: slot.offset + slot.numel].view(slot.shape)

    def prefetch(self) -> None:
        """Start gathering the full parameters without waiting (stage 3)."""
        if not self.gathered and self.pending is None:
            self.pending = self._start_gather(blocking=False)

    def gather(self) -> None:
        """Make the full parameters available (stage 3: allgather the shards)."""
        if self.gathered:
            return
        handle, self.pending = self.pending, None
        (handle if handle is not None else self._start_gather(blocking=True)).wait()
        self._bind(self._full)
        self.gathered = True

    def _start_gather(self, blocking: bool) -> Handle:
        if self.check is not None:
            return self.check.start(self, blocking)
        if blocking:
            return CompletedHandle(self.comm.allgather_into(self._allocated_full(), self.shard))
        return self.comm.allgather_into_async(self._allocated_full(), self.shard)

    def discard_prefetch(self) -> None:
        """Complete an allgather started ahead that was not used, and drop its result (stage 3)."""
        handle, self.pending = self.pending, None
        if handle is not None:
            getattr(handle, "discard", handle.wait)()
            if not self.gathered:
                self._free_full()

    def release(self) -> None:
        """Free the full parameters (stage 3); they are gathered again when next needed.

        The parameters become empty tensors, and the full buffer's storage is resized to
        nothing (as FSDP frees its unsharded parameters): tensors autograd saved in forward
        (a weight's transpose, say) share that storage, so it is really freed after forward,
        and the gather for backward refills the same storage that those tensors read.
        """
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty
        self.gathered = False
        if self.pending is None:
            self._free_full()

    def _allocated_full(self) -> torch.Tensor:
        """The full buffer with its storage allocated (contents undefined until gathered)."""
        storage, nbytes = self._full.untyped_storage(), self.plan.padded_numel * self._full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self._full

    def _free_full(self) -> None:
        if self._full is not None and self._full.untyped_storage().nbytes():
            self._full.untyped_storage().resize_(0)

    def publish_master(self) -> None:
        """Copy the updated master shard into the parameter shard and, below stage 3, to every rank."""
        self.finish_publish(self.start_publish())

    def start_publish(self) -> Optional[Handle]:
        """Update the parameter shard from the master; below stage 3, start gathering it to every rank."""
        self.discard_prefetch()  # a gather in flight reads the shard, and its result would be stale
        if self.stage == 3 and self.gathered:  # kept from a forward whose backward never came: stale now
            self.release()
        with torch.no_grad():
            if not self.master_is_shard:
                self.shard.copy_(self.master.detach().to(self.shard.device, self.dtype))
        # The shard is this rank's block of the flat buffer: the gather fills the rest in place.
        return self.comm.allgather_into_async(self.flat, self.shard) if self.stage < 3 else None

    @staticmethod
    def finish_publish(handle: Optional[Handle]) -> None:
        """Wait for the gather of :meth:`start_publish`."""
        if handle is not None:
            handle.wait()

    def await_publish(self) -> None:
        """Wait for a gather of :meth:`start_publish` left in flight after the step (``overlap_publish``)."""
        handle, self.publishing = self.publishing, None
        self.finish_publish(handle)

    # -- gradients ---------------------------------------------------------------------------------
    def flat_grads(self, keep: bool = False) -> torch.Tensor:
        """The unit's gradients in one padded flat buffer (zeros for parameters without one).

        With ``keep`` the buffer persists and the parameters' ``.grad`` become views
        of it, so later backward passes accumulate straight into it (no copy).
        """
        flat = self.grad_flat if keep and self.grad_flat is not None else None
        if flat is None:
            flat = host_buffers.zeros((self.plan.padded_numel,), self.dtype, self.device)
        for slot, p in zip(self.plan.params, self.params):
            view = flat[slot.offset: slot.offset + slot.numel]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            if keep:
                p.grad = view.view(slot.shape)
        if keep:
            self.grad_flat = flat
        return flat

    def keep_grad(self, position: int) -> None:
        """Stage 1: move parameter ``position``'s fresh ``.grad`` into the persistent flat buffer (a view)."""
        slot, p = self.plan.params[position], self.params[position]
        if self.grad_flat is None:
            self.grad_flat = host_buffers.zeros((self.plan.padded_numel,), self.dtype, self.device)
        view = self.grad_flat[slot.offset: slot.offset + slot.numel]
        grad = p.grad
        if grad is None or grad.is_sparse or grad.data_ptr() == view.data_ptr():
            return
        with torch.no_grad():
            view.copy_(grad.reshape(-1))
        p.grad = view.view(slot.shape)

    def new_grad_buffer(self) -> torch.Tensor:
        """A zeroed flat gradient buffer of the unit's padded size."""
        return host_buffers.zeros((self.plan.padded_numel,), self.dtype, self.device)

    def take_grad(self, position: int, flat: torch.Tensor, add: bool = False) -> None:
        """Copy (or with ``add``, add) parameter ``position``'s ``.grad`` into ``flat`` and free it."""
        slot, p = self.plan.params[position], self.params[position]
        if p.grad is None:
            return
        view = flat[slot.offset: slot.offset + slot.numel]
        if add:
            view.add_(p.grad.reshape(-1))
        else:
            view.copy_(p.grad.reshape(-1))
        p.grad = None

    def zero_grads_in_place(self) -> bool:
        """Zero the persistent gradient buffer; False when there is none."""
        if self.grad_flat is None:
            return False
        self.grad_flat.zero_()
        return True

    def accumulate_master_grad(self, shard_grad: torch.Tensor) -> None:
        """Add a reduced gradient shard to the master's gradient."""
        g = shard_grad.to(self.master.device, self.master.dtype)
        if self.master.grad is None:
            self.master.grad = g
        else:
            self.master.grad.add_(g)

    def reduced_grad_target(self, shard_grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Hybrid sharding: where the all-reduce of ``shard_grad`` over the replicas runs in place: the
        master gradient itself when it has none yet (True), else a tensor to add to it after (False)."""
        if self.master.grad is None:
            self.accumulate_master_grad(shard_grad)
            return self.master.grad, True
        return shard_grad.to(self.master.device, self.master.dtype, copy=True), False

    def set_master_grad(self, shard_grad: torch.Tensor) -> None:
        """Stage 1: the master gradient is this rank's reduced shard, kept in its slice of the flat buffer."""
        owned = self.grad_flat[self.start: self.end]
        if shard_grad.data_ptr() != owned.data_ptr():
            owned.copy_(shard_grad)  # so that the gradients take one buffer, not one and a shard
        self.master.grad = owned if self.master_is_shard else owned.to(self.master.device, self.master.dtype)

    def drop_full_grads(self) -> None:
        for p in self.params:
            p.grad = None


def stage3_units(module: nn.Module, wrap: Optional[Sequence[nn.Module]] = None) -> list[tuple[Optional[nn.Module], list[tuple[str, nn.Parameter]]]]:
    """Split ``module``'s trainable parameters into stage-3 units.

    Default units are the direct children of ``module`` (containers such as
    ``ModuleList`` are opened); parameters of the root itself, and parameters
    shared between units, form a root unit that stays gathered for the whole
    forward pass.
    """
    if wrap is None:
        wrap = []
        stack = list(module.children())
        while stack:
            child = stack.pop(0)
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                stack[:0] = list(child.children())
            elif any(p.requires_grad for p in child.parameters()):
                wrap.append(child)
    names = {id(p): n for n, p in module.named_parameters()}
    owners: dict[int, list[int]] = {}
    for i, m in enumerate(wrap):
        for p in m.parameters():
            if p.requires_grad:
                owners.setdefault(id(p), []).append(i)
    units: list[tuple[Optional[nn.Module], list[tuple[str, nn.Parameter]]]] = []
    root: list[tuple[str, nn.Parameter]] = []
    per_unit: list[list[tuple[str, nn.Parameter]]] = [[] for _ in wrap]
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        where = owners.get(id(p), [])
        if len(set(where)) == 1:
            per_unit[where[0]].append((name, p))
        else:
            root.append((names[id(p)], p))
    if root:
        units.append((None, root))
    units.extend((m, ps) for m, ps in zip(wrap, per_unit) if ps)
    return units
