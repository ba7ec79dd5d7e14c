"""``ParallelModel.eval_step`` and ``logits`` against one Hugging Face process, and what they must not change.

Each case evaluates a held-out batch before the first training step and after it, with every
dropout of the parallel model raised to 0.5 while it evaluates (eval mode must switch it off):
the loss must equal ``model(ids, labels=ids).loss`` and the logits ``model(ids).logits`` of one
process in eval mode, the parameters, ZeRO masters, gradients, optimizer and loss-scale state,
generator state and each module's train/eval flag must be bit-identical before and after, no
ZeRO-3 unit may stay gathered, and the training losses around the evaluations must follow the
one-process training that had no evaluation at all.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.core.errors import ConfigError
from shardwise.core.layout import ParallelLayout

from hf_parallel import BATCH, OPT_ARGS, OPTIMIZER, RTOL as TRAIN_RTOL, ATOL as TRAIN_ATOL, SEQ, VOCAB, \
    _batches, build

LOSS_RTOL = 1e-5
LOGITS_RTOL, LOGITS_ATOL = 1e-5, 1e-5
TRAIN_STEPS = 3
EVAL_BEFORE = (0, 1)  # evaluate before these training steps
DROPOUT = 0.5


def _one_process(model: nn.Module, batches: list[torch.Tensor], held_out: torch.Tensor) -> tuple[list, list]:
    """One-process training losses, and (loss, logits) of ``held_out`` in eval mode before each step of EVAL_BEFORE."""
    opt = OPTIMIZER(model.parameters(), **OPT_ARGS)
    train, evals = [], []
    for step, ids in enumerate(batches):
        if step in EVAL_BEFORE:
            model.eval()
            with torch.no_grad():
                out = model(held_out, labels=held_out)
            evals.append((float(out.loss), out.logits))
            model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        train.append(float(loss))
    return train, evals


def _set_dropout(module: nn.Module, p: float) -> None:
    """Every dropout of ``module``: nn.Dropout layers and the attention's own probability (Llama)."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = p


def _snapshot(pm: ParallelModel) -> dict[str, Any]:
    """Everything an evaluation must leave as it found it, cloned."""
    opt = pm.optimizer
    state = opt.state_dict()
    units = getattr(opt, "units", [])
    scaler = getattr(opt, "loss_scaler", None)
    return {
        "params": [p.detach().clone() for p in pm.parameters()],
        "grads": [p.grad is not None for p in pm.parameters()] + [u.master.grad is not None for u in units],
        "masters": [u.master.detach().clone() for u in units],
        "optimizer": copy.deepcopy(state),
        "scaler": copy.deepcopy(vars(scaler)) if scaler is not None else None,
        "rng": torch.get_rng_state(),
        "modes": [m.training for m in pm.module.modules()],
    }


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check_unchanged(pm: ParallelModel, before: dict[str, Any], what: str) -> None:
    after = _snapshot(pm)
    for key in before:
        if not _same(before[key], after[key]):
            raise AssertionError(f"{what} changed the {key}")
    for unit in getattr(pm.optimizer, "units", []):
        if pm.layout.zero_stage == 3 and (unit.gathered or unit.pending is not None):
            raise AssertionError(f"{what} left ZeRO-3 unit {unit.index} gathered")


def _evaluate(pm: ParallelModel, held_out: torch.Tensor, want_loss: float, want_logits: torch.Tensor,
              label: str) -> tuple[float, float]:
    """eval_step and logits of ``held_out`` with dropout raised; returns the loss and logits differences."""
    pm.module.train()
    pm.chunks[0].stages[0].eval()  # a module already in eval mode stays in it
    _set_dropout(pm.module, DROPOUT)
    before = _snapshot(pm)
    got = pm.eval_step(pm.shard_batch(held_out))
    _check_unchanged(pm, before, f"{label} eval_step")
    logits = pm.logits(pm.shard_batch(held_out))
    _check_unchanged(pm, before, f"{label} logits")
    _set_dropout(pm.module, 0.0)
    if abs(got - want_loss) > LOSS_RTOL * abs(want_loss):
        raise AssertionError(f"{label} eval_step: got {got!r}, one process {want_loss!r}")
    every = pm.groups.world.allgather_object(got)
    if len(set(every)) != 1:
        raise AssertionError(f"{label} eval_step: ranks report different losses {every}")
    want = pm.shard_batch(want_logits)
    if logits.shape != want.shape or logits.dtype != want.dtype:
        raise AssertionError(f"{label} logits: {tuple(logits.shape)} {logits.dtype}, one process "
                             f"{tuple(want.shape)} {want.dtype}")
    logits_diff = float((logits - want).abs().max())
    if not torch.allclose(logits, want, rtol=LOGITS_RTOL, atol=LOGITS_ATOL):
        raise AssertionError(f"{label} logits differ from one process by {logits_diff:.3g}")
    return abs(got - want_loss), logits_diff


def evaluation(backend: str, cases: list[list[Any]]) -> None:
    """Each case is ``[family, layout fields]``; rank 0 prints one line per case."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches()[:TRAIN_STEPS]
    held_out = _batches(seed=7)[0]
    for family, fields in cases:
        ref = build(family)
        want_train, want_eval = _one_process(copy.deepcopy(ref), batches, held_out)
        pm = parallelize(ref, OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
        label = f"{family} {pm.layout.describe()}"
        worst_loss = worst_logits = 0.0
        for step, ids in enumerate(batches):
            if step in EVAL_BEFORE:
                loss_diff, logits_diff = _evaluate(pm, held_out, *want_eval[EVAL_BEFORE.index(step)],
                                                   f"{label} before step {step}")
                worst_loss, worst_logits = max(worst_loss, loss_diff), max(worst_logits, logits_diff)
            got = pm.train_step(pm.shard_batch(ids))
            if abs(got - want_train[step]) > TRAIN_ATOL + TRAIN_RTOL * abs(want_train[step]):
                raise AssertionError(f"{label} step {step}: training loss {got!r} after evaluating, one process "
                                     f"(never evaluated) {want_train[step]!r}")
        pm.groups.free()
        if world.rank == 0:
            print(f"OK {label}: max diff vs one process: loss {worst_loss:.2e}, logits {worst_logits:.2e}",
                  flush=True)


def bad_batches(backend: str) -> None:
    """Batches that do not fit the layout raise the same ConfigError on every rank, even when only one
    rank's batch is wrong; the model evaluates normally afterwards."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    pm = parallelize(build("gpt2"), OPTIMIZER, ParallelLayout(pp=world.size, micro_batches=2), **OPT_ARGS)
    ids = _batches()[0]
    odd = ids[:3] if world.rank == world.size - 1 else ids[:4]
    attempts = [
        ("eval_step", lambda: pm.eval_step(ids[:3]), "does not split into 2 equal parts"),
        ("eval_step (one rank)", lambda: pm.eval_step(odd), "does not split into 2 equal parts"),
        ("logits (one rank)", lambda: pm.logits(odd), "does not split into 2 equal parts"),
        ("eval_step (targets)", lambda: pm.eval_step(ids, ids[:4]), "8 input samples but 4 targets"),
        ("eval_step (shapes)", lambda: pm.eval_step(ids[:, :SEQ - 2 * world.rank]), "need the same batch"),
    ]
    for what, call, message in attempts:
        try:
            call()
        except ConfigError as exc:
            if message not in str(exc):
                raise AssertionError(f"{what}: unexpected message {exc}") from exc
            if world.rank == 0:
                print(f"OK refused {what}: {exc}", flush=True)
            continue
        raise AssertionError(f"{what} was accepted")
    loss = pm.eval_step(ids)
    if not 0 < loss < 2 * torch.log(torch.tensor(float(VOCAB))).item():
        raise AssertionError(f"loss {loss} after the refusals")
    if world.rank == 0:
        print(f"OK evaluates after refusals: {loss:.4f} (batch {BATCH})", flush=True)
