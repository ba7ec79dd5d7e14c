"""``torch.compile`` next to shardwise's hooks and modes.

Hooks that gather parameters or run collectives (ZeRO-3's module hooks, the buffer
broadcast of :class:`~.ddp.DistributedDataParallel`) and the collectives a model's
forward calls (the tensor-parallel regions, :class:`~.sync_batchnorm.SyncBatchNorm`,
sharded embedding lookups, the Horovod-style ops of :mod:`.ops`) run outside the
compiled graph: :func:`not_traced` and :func:`never_traced` make dynamo break the graph
at them and call them eagerly, as FSDP2 does with its hooks. Traced, the communicators'
Python (mpi4py, ctypes, numpy) would break the graph at every call, and on a sub-group
with shapes made dynamic, fail. What autograd or the user's step calls at run time
(gradient hooks, end-of-backward callbacks, the backward of shardwise's autograd
Functions, the optimizers' ``step`` and ``zero_grad``) is :func:`not_traced` too: in a
train step compiled whole, ``loss.backward()`` and ``opt.step()`` run from a compiled
frame, and dynamo would compile every frame they call.

A ``TorchFunctionMode`` that reroutes ``F.linear`` (ZeRO's weight-gradient fusion,
:mod:`.zero.fusion`; the pipeline's :mod:`.parallel.wgrad`) cannot reach into a
compiled graph: those modes use :func:`compiled_modules` and
``torch.compiler.is_compiling()`` to turn themselves off with a warning.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, TypeVar

import torch
from torch import nn

__all__ = ["not_traced", "never_traced", "compiled_modules", "unwrap_compiled"]

_F = TypeVar("_F", bound=Callable[..., Any])


def not_traced(func: _F) -> _F:
    """``func`` runs eagerly, never compiled, whoever calls it.

    Traced by dynamo (a compiled model calls it), it is a graph break. Called at run time
    from a compiled frame's eager part (a gradient hook fired by the ``loss.backward()``
    of a compiled train step, an optimizer step inside one), it runs with dynamo off for
    everything it calls: dynamo would otherwise compile each frame below it, the
    communicators' included. Eager calls cost one flag check and one dict lookup while
    ``torch._dynamo`` (a second to import) is not imported, and a switch of dynamo's frame
    callback (microseconds) once it is.
    """
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch._dynamo.disable(func, recursive=True, reason="a shardwise hook")(*args, **kwargs)
        if "torch._dynamo.eval_frame" not in sys.modules:  # nothing was compiled in this process
            return func(*args, **kwargs)
        if not disabled:
            disabled.append(torch._dynamo.disable(func, recursive=True, reason="a shardwise hook"))
        return disabled[0](*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _skip_frames_of(code: types.CodeType) -> None:
    """Dynamo runs frames of ``code`` without compiling them (the frames they call are still its to compile).

    :func:`not_traced`'s wrapper turns dynamo off for what it calls; compiled itself, it
    would be compiled again for each new argument shape until dynamo's recompile limit.
    A torch without this (private) switch still gets the same results.
    """
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


_skip_frames_of(not_traced(lambda: None).__code__)


def never_traced(func: _F) -> _F:
    """``torch._dynamo.disable(func)``: dynamo breaks the graph where ``func`` is called and runs it eagerly.

    The same as :func:`not_traced` for compiled callers, without its check in eager ones;
    imports ``torch._dynamo`` (about a second, once per process) where it is applied.
    """
    import torch._dynamo

    return torch._dynamo.disable(func, recursive=True, reason="a shardwise hook")  # type: ignore[return-value]


def _is_compiled(module: nn.Module, optimized: type) -> bool:
    return isinstance(module, optimized) or getattr(module, "_compiled_call_impl", None) is not None


def compiled_modules(module: nn.Module) -> list[str]:
    """Names of ``module`` and its submodules that run compiled (``torch.compile(m)`` or ``m.compile()``).

    ``""`` stands for ``module`` itself. Empty, without a scan, while ``torch._dynamo``
    was never imported (nothing can have been compiled).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return []
    optimized = eval_frame.OptimizedModule
    return [name for name, m in module.named_modules(remove_duplicate=True) if _is_compiled(m, optimized)]


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wrapped (``module`` itself when it is no such wrapper).

    Hooks registered on it are traced into the wrapper's compiled forward.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    while eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        module = module._orig_mod
    return module
