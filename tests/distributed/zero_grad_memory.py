"""ZeRO stages 2/3: the full (unsharded) gradients alive during backward stay under two units;
stage 3: the full parameters alive during forward and backward stay within two units.

A dispatch mode follows every torch op during ``backward``: a tensor holds "full
gradient" bytes when it is a parameter's ``.grad``, a flat buffer ZeRO is filling
(fused GEMMs write weight gradients straight into it), or was written by an op that
read one (the flat buffers ZeRO copies gradients into, any copy a backend makes of them).
Such storages are held here and counted until nobody else references them (storage
use count), so a buffer kept alive inside a collective's work object counts too. The
master gradients (this rank's shards) are left out; collectives' outputs are shards.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardwise
from shardwise.adapters.torch.zero import ZeroOptimizer

torch.set_num_threads(1)


#: Ops that make a tensor from another one's metadata only: their outputs hold no gradient yet.
_NO_DATA_READ = {torch.ops.aten.new_empty, torch.ops.aten.new_zeros, torch.ops.aten.new_ones,
                 torch.ops.aten.new_full, torch.ops.aten.empty_like, torch.ops.aten.zeros_like,
                 torch.ops.aten.ones_like, torch.ops.aten.full_like, torch.ops.aten.new_empty_strided}


def _written(func, args: tuple, kwargs: dict, out) -> list[torch.Tensor]:
    """The tensors an op produced or wrote: its outputs and its mutated (``out=``, in-place) arguments."""
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    named = dict(zip((a.name for a in func._schema.arguments), args), **(kwargs or {}))
    for arg in func._schema.arguments:
        if arg.alias_info is not None and arg.alias_info.is_write and arg.name in named:
            tensors += [t for t in tree_leaves(named[arg.name]) if isinstance(t, torch.Tensor)]
    return tensors


class FullGradBytes(TorchDispatchMode):
    """Peak bytes of live full gradients, sampled after every op (see the module docstring)."""

    def __init__(self, opt: ZeroOptimizer) -> None:
        super().__init__()
        self.opt = opt
        self.held: dict[int, torch.UntypedStorage] = {}
        self.peak = 0

    def _grads(self) -> dict[int, torch.UntypedStorage]:
        grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage()
                 for u in self.opt.units for p in u.params if p.grad is not None}
        # The flat buffers being filled: fused GEMMs write weight gradients into them directly.
        grads.update((t.untyped_storage().data_ptr(), t.untyped_storage()) for t in self.opt.reducer.filling.values())
        return grads

    def sample(self) -> None:
        for key, storage in list(self.held.items()):
            if torch._C._storage_Use_Count(storage._cdata) <= 1:  # only our reference is left
                del self.held[key]
        live = {**self.held, **self._grads()}
        for u in self.opt.units:
            if u.master.grad is not None:
                live.pop(u.master.grad.untyped_storage().data_ptr(), None)
        self.peak = max(self.peak, sum(s.nbytes() for s in live.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and func.overloadpacket not in _NO_DATA_READ:
            grads = self._grads().keys() | self.held.keys()
            read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() in grads for t in read):
                for t in _written(func, args, kwargs, out):
                    self.held.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        self.sample()
        return out


class Blocks(nn.Module):
    """``n`` equal blocks of two linear layers: the ZeRO units (stage 3 wraps each block)."""

    def __init__(self, n: int = 6, width: int = 48) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
                                    for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _six_units(backend: str, stage: int) -> tuple[Blocks, ZeroOptimizer, int, torch.Generator]:
    """``Blocks`` under SGD ZeRO at ``stage`` in 6 equal units: model, optimizer, unit bytes, this rank's data generator."""
    comm = shardwise.init(backend=backend).world
    torch.manual_seed(0)
    model = Blocks()
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=comm, lr=0.01, bucket_cap_bytes=block_bytes)
    sizes = {u.plan.padded_numel * u.params[0].element_size() for u in opt.units}
    if len(opt.units) != 6 or len(sizes) != 1:
        raise AssertionError(f"expected 6 equal units, got {len(opt.units)} of {sorted(sizes)} bytes")
    return model, opt, sizes.pop(), torch.Generator().manual_seed(comm.rank)


def bounded_grad_memory(backend: str, stage: int) -> None:
    """Peak full-gradient bytes during backward stay below two units' worth (6 equal units)."""
    model, opt, unit_bytes, g = _six_units(backend, stage)
    for step in range(3):
        x, y = torch.randn(4, 48, generator=g), torch.randn(4, 48, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        tracker = FullGradBytes(opt)
        with tracker:
            loss.backward()
        opt.step()
        if not unit_bytes <= tracker.peak < 2 * unit_bytes:
            raise AssertionError(f"stage {stage} step {step}: {tracker.peak} B of full gradients alive at once "
                                 f"during backward; a unit is {unit_bytes} B (want at least one, under two)")


class FullParamBytes(TorchDispatchMode):
    """Peak bytes of live full-parameter storages over forward and backward, sampled after every op.

    Every storage a unit's parameters were seen gathered in is held here and counts while it
    has memory and anyone besides us references it: tensors autograd saved in forward (a
    weight's transpose) keep a released unit's parameters alive just as the unit itself would.
    """

    def __init__(self, opt: ZeroOptimizer) -> None:
        super().__init__()
        self.opt = opt
        self.held: dict[int, torch.UntypedStorage] = {}
        self.peak = 0

    def sample(self) -> None:
        for u in self.opt.units:
            for p in u.params:
                if p.numel():
                    storage = p.untyped_storage()
                    self.held.setdefault(storage._cdata, storage)
        for key, storage in list(self.held.items()):
            if torch._C._storage_Use_Count(storage._cdata) <= 1:
                del self.held[key]
        self.peak = max(self.peak, sum(s.nbytes() for s in self.held.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def bounded_param_memory(backend: str) -> None:
    """Stage 3 (6 equal units): at most two units' full parameters are alive at once, in forward and backward."""
    model, opt, unit_bytes, g = _six_units(backend, 3)
    for step in range(3):
        x, y = torch.randn(4, 48, generator=g), torch.randn(4, 48, generator=g)
        opt.zero_grad()
        tracker = FullParamBytes(opt)
        with tracker:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        if not unit_bytes <= tracker.peak <= 2 * unit_bytes:
            raise AssertionError(f"step {step}: {tracker.peak} B of full parameters alive at once; a unit is "
                                 f"{unit_bytes} B (want at least one, at most two: the unit at work and the "
                                 "one prefetched)")
