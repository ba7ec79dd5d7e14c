"""Forward-only passes of a :class:`~.parallelize.ParallelModel`: the loss and the logits of a batch.

Nothing a training step reads changes: parameters, gradients, optimizer and loss-scaler
state, step counters and the random generators stay as they were, and ZeRO-3 frees each
unit after its forward as in training. The modules run in eval mode (no dropout) under
``torch.no_grad``, each module's train/eval flag restored afterwards; a pipeline runs its
schedule's forward-only (prediction) actions.

Both take batches as :meth:`~.parallelize.ParallelModel.train_step` does: this
data-parallel rank's samples, the same on every rank of its pipeline and tensor-parallel
groups. A batch that does not fit the layout raises :class:`~shardwise.core.errors.ConfigError`
on every rank (one small allgather over the job checks them all before anything else runs),
so no rank is left waiting for another.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn

from ....core.comm import Communicator
from ....core.errors import ConfigError
from ..device_math import accumulation_dtype

if TYPE_CHECKING:
    from .parallelize import ParallelModel

__all__ = ["eval_loss", "full_logits"]


@contextlib.contextmanager
def _inference(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode under ``torch.no_grad``; every submodule's own flag restored after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.training = training


def _problem(pm: "ParallelModel", inputs: Any, targets: Any, parts: int, what: str) -> Optional[str]:
    """Why this rank's batch cannot run (``parts``: the equal pieces it is cut into), or None."""
    if not torch.is_tensor(inputs) or inputs.dim() == 0:
        return f"{what} needs a tensor batch with a sample dimension, got {type(inputs).__name__}"
    if targets is not None:
        if not torch.is_tensor(targets) or targets.dim() == 0:
            return f"{what} needs tensor targets with a sample dimension, got {type(targets).__name__}"
        if targets.shape[0] != inputs.shape[0]:
            return f"{what}: {inputs.shape[0]} input samples but {targets.shape[0]} targets"
    if inputs.shape[0] == 0 or inputs.shape[0] % parts:
        layout = pm.layout
        pieces = [f"gradient_accumulation_steps={layout.gradient_accumulation_steps}"] if what == "eval_step" else []
        if layout.pp > 1:
            pieces.append(f"micro_batches={layout.micro_batches}")
        return (f"{what}: a batch of {inputs.shape[0]} samples does not split into {parts} equal parts "
                f"({' x '.join(pieces) or 'one part'})")
    return None


def _agree_on_batch(pm: "ParallelModel", inputs: Any, targets: Any, parts: int, what: str) -> None:
    """Raise the same :class:`ConfigError` on every rank when any rank's batch does not fit.

    Ranks of one data-parallel replica (its pipeline and tensor-parallel groups) must also
    hold batches of one shape.
    """
    mine = _problem(pm, inputs, targets, parts, what)
    shape = tuple(inputs.shape) if mine is None else None
    world = pm.groups.world
    every = world.allgather_object((pm.groups.dp.rank, shape, mine)) if world.size > 1 else [(0, shape, mine)]
    bad = [f"rank {r}: {problem}" for r, (_, _, problem) in enumerate(every) if problem is not None]
    if bad:
        raise ConfigError("; ".join(bad))
    shapes: dict[int, tuple] = {}
    for r, (replica, shape, _) in enumerate(every):
        first = shapes.setdefault(replica, shape)
        if shape != first:
            raise ConfigError(f"{what}: ranks of data-parallel replica {replica} hold batches of shapes {first} "
                              f"and {shape} (rank {r}); its pipeline and tensor-parallel ranks need the same batch")


def eval_loss(pm: "ParallelModel", inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> float:
    """The loss of the batch under the current parameters, averaged over the global batch as
    ``train_step`` reports it (the same value on every rank); collective."""
    if targets is None:
        if not pm.causal:
            raise ConfigError("eval_step needs targets when the model has its own loss_fn")
        targets = inputs
    layout = pm.layout
    k = layout.gradient_accumulation_steps
    m = layout.micro_batches if layout.pp > 1 else 1
    _agree_on_batch(pm, inputs, targets, k * m, "eval_step")
    device = pm.device
    total = torch.zeros((), dtype=accumulation_dtype(device), device=device)
    with _inference(pm.module):
        for x, t in zip(inputs.chunk(k), targets.chunk(k)):
            if pm.executor is None:
                pm.moe.start_forward()  # a MoE's loss has its load-balancing term, as in training
                total += pm.moe.add_balance(pm.loss_fn(pm.module(x), t)).to(device, total.dtype) / k
                continue
            out = pm.executor.predict(x)
            balance = pm.executor.balance.meet() if pm.executor.balance is not None else None  # collective
            if out is not None:  # the last pipeline stage: one loss per micro-batch, as in training
                for o, tm in zip(out.chunk(m), t.chunk(m)):
                    total += pm.loss_fn(o, tm).to(device, total.dtype) / (k * m)
                if balance is not None:  # a MoE's load-balancing term over the whole batch, as in training
                    total += balance.to(device, total.dtype) / k
    return pm._report(total)


def full_logits(pm: "ParallelModel", inputs: torch.Tensor) -> torch.Tensor:
    """The model's output for this rank's batch on every rank, the whole vocabulary (collective)."""
    layout = pm.layout
    _agree_on_batch(pm, inputs, None, layout.micro_batches if layout.pp > 1 else 1, "logits")
    with _inference(pm.module):
        out = pm.module(inputs) if pm.executor is None else pm.executor.predict(inputs)
        if out is not None and layout.vocab_parallel:
            out = _gather_vocabulary(out, pm.groups.tp)
        if layout.pp > 1:
            out = _from_last_stage(out, pm.groups.pp, pm.device)
    return out


def _gather_vocabulary(part: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """The full last dimension from each tensor-parallel rank's slice of it (in rank order, uneven allowed)."""
    if tp.size == 1:
        return part
    return tp.allgather(part.movedim(-1, 0).contiguous()).movedim(0, -1).contiguous()


def _from_last_stage(out: Optional[torch.Tensor], pp: Communicator, device: torch.device) -> torch.Tensor:
    """The last pipeline rank's ``out`` on every rank of the pipeline."""
    root = pp.size - 1
    spec = pp.broadcast_object((tuple(out.shape), out.dtype) if pp.rank == root else None, root=root)
    buf = out.contiguous() if pp.rank == root else torch.empty(spec[0], dtype=spec[1], device=device)
    return pp.broadcast(buf, root=root)
