"""ZeRO stages 2 and 3: linear layers' weight gradients computed straight into the reduce-scatter buffer.

Autograd computes a linear layer's weight gradient ``dY^T X`` into a tensor of its
own, and ZeRO's hook then copies it into the unit's flat gradient buffer: for a
moment that gradient exists twice, and a unit's backward needs one weight's worth of
memory more than the gradients themselves. While the model's forward runs under
:class:`FusedWeightGrads`, ``F.linear`` with the weight of a partitioned unit runs
through :class:`_LinearIntoBuffer`, whose backward writes ``dY^T X`` with one GEMM
into the weight's slot of that buffer (``torch.mm(..., out=)``, or ``addmm_`` for a
second use), as Megatron-LM's gradient-accumulation fusion writes into its main-grad
buffer; the reducer is told each such contribution in forward
(:meth:`~.grads.GradReducer.expect`) and as it lands in backward.

A weight also used by another differentiable op in the same forward gets that share
through ``.grad`` as usual, and the reducer waits for both. The fused path is only
taken where it is invisible: a plain leaf weight with no tensor hook of its own, no
autocast, grad mode on, outside backward (a forward recomputed by activation
checkpointing) and without saved-tensor hooks (checkpointing, ``save_on_cpu``),
whose recomputation must save what the first forward saved. A backward that does not
accumulate into ``.grad`` (``torch.autograd.grad``) or builds a graph
(``create_graph``, a gradient penalty) gets the gradient back from autograd instead.
A graph freed without its backward withdraws its shares when it is collected. The
stage-3 root unit (parameters shared between modules, tied embeddings) is never fused.

``torch.compile`` cannot trace the mode, so the fusion turns itself off, with one warning,
for a model that runs compiled: compiled modules found at construction or at the first
forward, or the model's forward itself being traced; a module compiled later is met under
the mode, which lets it pass untouched and is off from the end of that forward on. A
forward traced with the hooks (``torch.compile(model)``, ``fullgraph=True`` too) turns it
off without breaking the graph, and the warning comes at the optimizer's next step.
Its linear layers' gradients then reach the buffers through ``.grad``: the same values.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..compiling import compiled_modules, not_traced
from ..parallel.wgrad import _accumulate_grad_runs, fusable_linear, linear_grads, linear_operands
from .grads import GradReducer
from .stage3 import _in_backward
from .units import ZeroUnit


#: ``F.linear`` itself: a library that swaps ``torch.nn.functional.linear`` for a wrapper of its own
#: (DeepSpeed's ZeRO-3 does, for the whole process) still reaches it underneath.
_LINEAR = torch._C._nn.linear


class _Target:
    """Where one fused weight's gradient goes: ``reducer``'s flat buffer of ``unit``, at ``position``."""

    __slots__ = ("reducer", "unit", "position")

    def __init__(self, reducer: GradReducer, unit: ZeroUnit, position: int) -> None:
        self.reducer, self.unit, self.position = reducer, unit, position


class _LinearIntoBuffer(torch.autograd.Function):
    """``F.linear`` whose backward writes the weight gradient into the ZeRO unit's flat gradient buffer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                target: _Target) -> torch.Tensor:
        out = _LINEAR(x, weight, bias)
        ctx.save_for_backward(x)
        ctx.weight, ctx.target = weight, target  # the Parameter itself: stage 3 rebinds its data for backward
        reducer = target.reducer
        reducer.expect(target.unit, target.position, fused=True)
        # A graph freed without its backward (a forward only for a metric) withdraws its share, so the
        # next backward does not wait for it.
        ctx.unused = [True]
        weakref.finalize(ctx, reducer.withdraw_fused, target.unit, target.position, reducer.passes, ctx.unused)
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        (x,) = ctx.saved_tensors
        weight, target = ctx.weight, ctx.target
        dx, dy2, x2, db = linear_grads(ctx, dy, x, weight)
        if torch.is_grad_enabled() or not _accumulate_grad_runs(weight):
            # ``autograd.grad`` or ``create_graph``: the gradient goes back to autograd, and the share
            # stays announced (a later backward of this graph, or the end-of-backward sweep, settles it).
            if torch.is_grad_enabled():  # the graph built here reaches the weight's ``.grad`` in a later backward
                target.reducer.expect(target.unit, target.position, fused=False)
            return dx, dy2.t().mm(x2), db, None
        ctx.unused[0] = False
        slot, again = target.reducer.fused_grad_slot(target.unit, target.position)
        if again:
            slot.addmm_(dy2.t().to(slot.dtype), x2.to(slot.dtype))
        else:
            torch.mm(dy2.t().to(slot.dtype), x2.to(slot.dtype), out=slot)
        target.reducer.fused_grad_written(target.unit, target.position)
        return dx, None, db, None


class FusedWeightGrads(TorchFunctionMode):
    """Active during the model's forward: routes the units' linear weight gradients into the flat buffers."""

    def __init__(self, hooks: "FusionHooks") -> None:
        super().__init__()
        self.hooks, self.targets = hooks, hooks.targets

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # Dynamo traces a compiled region under this mode: it keeps autograd's own weight gradients.
            self.hooks.traced = True
            return func(*args, **kwargs)
        if func is _LINEAR:
            x, weight, bias = linear_operands(args, kwargs)
            target = self.targets.get(id(weight))
            if (target is not None and fusable_linear(x, weight, bias) and not weight._backward_hooks
                    and x.dtype == weight.dtype and not _in_backward()):
                return _LinearIntoBuffer.apply(x, weight, bias, target)
        out = func(*args, **kwargs)
        if torch.is_grad_enabled():
            self._note_other_uses(args, kwargs, out)
        return out

    def _note_other_uses(self, args: tuple, kwargs: dict, out: Any) -> None:
        """A fused weight read by any other op whose result needs gradients also gets a share through ``.grad``."""
        flat = [b for a in (*args, *kwargs.values()) for b in (a if isinstance(a, (list, tuple)) else (a,))]
        used = [a for a in flat if type(a) is nn.Parameter and id(a) in self.targets]
        if not used or not any(isinstance(t, torch.Tensor) and t.requires_grad
                               for t in (out if isinstance(out, (tuple, list)) else (out,))):
            return
        for weight in used:
            target = self.targets[id(weight)]
            target.reducer.expect(target.unit, target.position, fused=False)


class FusionHooks:
    """Runs ``root``'s forward under :class:`FusedWeightGrads` for the eligible units' 2-D weights.

    Off, with one warning, once ``root`` runs compiled (see the module's docstring);
    ``enabled`` tells whether it still fuses. The optimizer calls :meth:`settle` at each step.
    """

    def __init__(self, root: nn.Module, units: list[ZeroUnit], reducer: GradReducer, stage: int) -> None:
        self.targets: dict[int, _Target] = {}
        for unit in units:
            if stage == 3 and unit.module is None:
                continue  # the root unit: shared parameters, used by several modules
            for position, (p, slot) in enumerate(zip(unit.params, unit.plan.params)):
                if len(slot.shape) == 2:  # stage 3 has released the parameters: their shapes are in the plan
                    self.targets[id(p)] = _Target(reducer, unit, position)
        self.active: list[Optional[FusedWeightGrads]] = []  # one per root forward in progress
        self.enabled = bool(self.targets)
        self.traced = False  # a compiled region ran under the mode
        self._scanned = False  # the first forward looked for compiled modules
        self.pending: Optional[str] = None  # why a compiled forward turned the fusion off, until settle() warns
        self._handles: list[Any] = []
        if not self.targets:
            return
        compiled = compiled_modules(root)
        if compiled:
            self._turn_off(_compiled_reason(compiled))
            return
        self._handles = [root.register_forward_pre_hook(self._enter),
                         root.register_forward_hook(self._exit, always_call=True)]

    @not_traced
    def remove(self) -> None:
        """Take the forward hooks off the model (idempotent); a forward in progress finishes as it started."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def settle(self) -> None:
        """Outside any forward (the optimizer's step): warn about a turn-off decided in a compiled forward."""
        if self.pending is not None:
            reason, self.pending = self.pending, None
            self._warn(reason)
        if not self.enabled and not self.active:
            self.remove()

    @not_traced
    def _turn_off(self, reason: str) -> None:
        if self.enabled:
            self.enabled = False
            self._warn(reason)

    @staticmethod
    def _warn(reason: str) -> None:
        warnings.warn(f"ZeroOptimizer: weight-gradient fusion is off because {reason}; torch.compile cannot "
                      "trace its TorchFunctionMode, so linear layers' weight gradients reach the reduce-scatter "
                      "buffers through .grad (the same values, one weight's gradient more in memory per unit "
                      "in backward). Pass fuse_weight_grads=False to ZeroOptimizer to silence this warning.",
                      UserWarning, stacklevel=3)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.enabled:
            if torch.compiler.is_compiling():
                # Traced: nothing here may break the graph (fullgraph=True); settle() warns after the step.
                self.enabled, self.pending = False, "the model's forward is compiled"
            elif not self._scanned:  # once: later compiles are caught inside the mode, at no cost per forward
                self._scanned = True
                compiled = compiled_modules(module)
                if compiled:
                    self._turn_off(_compiled_reason(compiled))
        # nothing to fuse in inference
        mode = FusedWeightGrads(self) if self.enabled and torch.is_grad_enabled() else None
        if mode is not None:
            mode.__enter__()
        self.active.append(mode)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        mode = self.active.pop() if self.active else None
        if mode is not None:
            mode.__exit__(None, None, None)
        if self.traced:  # the root runs eagerly here: the mode was entered
            self._turn_off("part of the model's forward ran compiled")
        if not self.enabled and not self.active and not torch.compiler.is_compiling():
            self.remove()


def _compiled_reason(names: list[str]) -> str:
    shown = ", ".join(repr(n) if n else "the model itself" for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"the model has compiled modules ({shown}{more})"
