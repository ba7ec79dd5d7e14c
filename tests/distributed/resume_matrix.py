"""Checkpoint resume matrix: saved at any layout and world size, resumed at any other (issue 52).

A model built on the meta device trains :data:`SAVED` steps at layout A and is saved
(one launch per world size saves every layout that fills it, each into a directory of
its own); a later launch at layout B, built from another seed so that nothing but the
load can make it right, loads that checkpoint and trains steps ``[SAVED, STOP)``. Every
loss, and every parameter afterwards, must equal an uninterrupted one-process run
(SGD with momentum, rtol 1e-5), so the optimizer state, the step and the data position
round-trip too.

Model shapes (:data:`MODELS`) vary the vocabulary, hidden and MLP sizes so that tensor-
parallel slice boundaries and ZeRO shard boundaries fall inside, at and past each
other. :func:`save` and :func:`load` run under ``tests/distributed/_runner.py``;
``strict=False`` reports a failing pair on one line (``RESUME FAIL``, with the first
failing rank's error) and goes on with the next, for the whole-matrix script
``benchmarks/resume_matrix.py``.
"""

from __future__ import annotations

import bisect
import itertools
import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import shardwise
from hf_parallel import OPT_ARGS, OPTIMIZER, _batches
from sharded_build import _compare, _count, _meta, _one_process, _train_from, _whole
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.core.layout import ParallelLayout

#: Steps trained before the save, and the step the resumed run trains up to.
SAVED, STOP = 2, 4

_INTERLEAVED = {"pp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"}

#: Every layout of the matrix by name; each runs on ``dp * tp * pp`` ranks.
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp1": {},
    "dp2": {"dp": 2},
    "dp2-z1": {"dp": 2, "zero_stage": 1},
    "dp2-z2": {"dp": 2, "zero_stage": 2},
    "dp2-z3": {"dp": 2, "zero_stage": 3},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "micro_batches": 2},
    "pp2-v2": dict(_INTERLEAVED),
    "dp4": {"dp": 4},
    "dp4-z1": {"dp": 4, "zero_stage": 1},
    "dp4-z2": {"dp": 4, "zero_stage": 2},
    "dp4-z3": {"dp": 4, "zero_stage": 3},
    "tp2xpp2": {"tp": 2, "pp": 2, "micro_batches": 2},
    "dp2xtp2-z1": {"dp": 2, "tp": 2, "zero_stage": 1},
    "dp2xtp2-z2": {"dp": 2, "tp": 2, "zero_stage": 2},
    "dp2xtp2-z3": {"dp": 2, "tp": 2, "zero_stage": 3},
    "dp2xpp2-v2-z1": {"dp": 2, "zero_stage": 1, **_INTERLEAVED},
}

#: Model shapes per family, as ``hf_parallel.build`` reads them (family:vocab:hidden:ffn). GPT-2:
#: tied embeddings and fused QKV Conv1D (3 x hidden columns); Llama: GQA 4/2 heads, untied head.
#: Odd vocabularies and hidden sizes of 24/32/40 move the ZeRO shard boundaries of the flat
#: buffers against the rows and tensor-parallel halves of the tensors they cut.
MODELS: dict[str, list[str]] = {
    "gpt2": ["gpt2", "gpt2:97:24:72", "gpt2:101:40:100"],
    "llama": ["llama", "llama:101:40:88", "llama:97:24:60"],
}


def ranks(layout: str) -> int:
    """The world size layout ``layout`` runs on."""
    fields = LAYOUTS[layout]
    return fields.get("dp", 1) * fields.get("tp", 1) * fields.get("pp", 1)


def checkpoint_dir(directory: str, model: str, layout: str) -> Path:
    """Where layout ``layout`` saves model ``model``'s checkpoint."""
    return Path(directory) / model.replace(":", "-") / layout


def pairs(models: list[str], layouts: list[str], *, loading_ranks: Optional[int] = None) -> list[list[str]]:
    """Every ordered pair (A, B) of ``layouts`` (A == B included) for each model, as
    ``[model, A, B]``; only those whose B runs on ``loading_ranks`` ranks when given."""
    return [[m, a, b] for m in models for a, b in itertools.product(layouts, layouts)
            if loading_ranks is None or ranks(b) == loading_ranks]


def _reference(model: str, batches: list[torch.Tensor]) -> tuple[torch.nn.Module, list[float]]:
    return _one_process(model, "sgd", batches)


def _agree(world: Any, error: Optional[str]) -> Optional[str]:
    """Collective: the first rank's error (``rank r: ...``), or None where every rank succeeded."""
    errors = world.allgather_object(error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def _attempt(call: Callable[[], Any]) -> tuple[Any, Optional[str]]:
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 - reported on one line, agreed across ranks
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _fresh(model: str, layout: str, seed: int) -> ParallelModel:
    torch.manual_seed(seed)
    return parallelize(_meta(model, seed), OPTIMIZER, ParallelLayout(**LAYOUTS[layout]), **OPT_ARGS)


def save(backend: str, directory: str, cases: list[list[str]], strict: bool = True) -> None:
    """For each ``[model, layout]``: train ``model`` :data:`SAVED` steps at ``layout`` (checking its losses
    against one process) and save it in its own directory. Every layout must fill this world;
    prints ``SAVE OK`` or ``SAVE FAIL`` per case (rank 0)."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches(seed=3)
    references: dict[str, list[float]] = {}
    for model, layout in cases:
        if model not in references:
            references[model] = _reference(model, batches[:SAVED])[1]
        pm: list[ParallelModel] = []

        def run() -> None:
            pm.append(_fresh(model, layout, 0))
            _train_from(pm[0], batches, 0, SAVED, references[model])
            pm[0].save_checkpoint(checkpoint_dir(directory, model, layout), SAVED, extra={"next_batch": SAVED})

        error = _agree(world, _attempt(run)[1])
        if pm:
            pm[0].groups.free()
        if world.rank == 0:
            print(f"{'SAVE OK' if error is None else 'SAVE FAIL'} {model} {layout}({world.size})"
                  + (f": {error}" if error else ""), flush=True)
        if error and strict:
            raise AssertionError(f"saving {model} at {layout}: {error}")


def load(backend: str, directory: str, cases: list[list[str]], strict: bool = True) -> None:
    """For each ``[model, A, B]``: build ``model`` at layout B (from another seed), load A's checkpoint,
    train steps ``[SAVED, STOP)`` and compare every loss and parameter with an uninterrupted
    one-process run. Prints ``RESUME PASS`` or ``RESUME FAIL`` per case (rank 0)."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches(seed=3)
    references: dict[str, tuple[torch.nn.Module, list[float]]] = {}
    for model, saved, loaded in cases:
        if model not in references:
            references[model] = _reference(model, batches[:STOP])
        trained, want = references[model]
        pm: list[ParallelModel] = []

        def resume() -> None:
            pm.append(_fresh(model, loaded, 1))
            extra = pm[0].load_checkpoint(checkpoint_dir(directory, model, saved))
            if extra["step"] != SAVED or extra["next_batch"] != SAVED:
                raise AssertionError(f"checkpoint at step {extra['step']} (batch {extra['next_batch']}), "
                                     f"expected {SAVED}")

        error = _agree(world, _attempt(resume)[1])
        checked = 0
        if error is None:  # every rank loaded: the collectives of training line up
            _, error = _attempt(lambda: _train_from(pm[0], batches, SAVED, STOP, want))
            error = _agree(world, error)
        if error is None:
            whole = _whole(pm[0])
            checked, error = _attempt(lambda: _compare(whole, trained, f"parameters after step {STOP - 1}"))
            checked = _count(world, checked or 0)
            error = _agree(world, error)
            expected = len(dict(trained.named_parameters()))
            if error is None and checked != expected:
                error = f"{checked} parameters compared, the model has {expected}"
        if pm:
            pm[0].groups.free()
        what = f"{model} {saved}({ranks(saved)}) -> {loaded}({world.size})"
        if world.rank == 0:
            print(f"RESUME PASS {what}: steps {SAVED}-{STOP - 1} and {checked} parameters equal to one process"
                  if error is None else f"RESUME FAIL {what}: {error}", flush=True)
        if error and strict:
            raise AssertionError(f"resuming {what}: {error}")


def _intervals(directory: str, model: str, layout: str) -> dict[str, list[tuple[int, int]]]:
    """Every stored piece of ``layout``'s checkpoint of ``model`` as runs of consecutive row-major
    elements of its whole tensor, by tensor (generator states left out)."""
    from shardwise.adapters.torch.checkpoint.pieces import decode_placement
    from shardwise.checkpoint.store import load_checkpoint

    meta = load_checkpoint(checkpoint_dir(directory, model, layout) / f"ckpt-{SAVED}", verify=False).metadata
    out: dict[str, list[tuple[int, int]]] = {}
    for key, info in meta["tensors"].items():
        if key.startswith("rng/"):
            continue
        shape = tuple(int(n) for n in info["shape"])
        index = torch.arange(math.prod(shape)).reshape(shape)
        runs = out.setdefault(key, [])
        for _, _, raw, start, stop in info["pieces"]:
            placement = decode_placement(key, shape, raw)
            local = torch.cat([index[box] for box in placement.boxes()], dim=placement.dim or 0) if shape else index
            local = (local.t() if placement.transpose else local).reshape(-1)[int(start): int(stop)]
            if not local.numel():
                continue
            breaks = (torch.nonzero(local[1:] - local[:-1] != 1).reshape(-1) + 1).tolist()
            edges = [0, *breaks, local.numel()]
            runs += [(int(local[a]), int(local[b - 1]) + 1) for a, b in zip(edges, edges[1:])]
    return out


def boundary_relations(directory: str, model: str, saved: str, loaded: str,
                       cache: Optional[dict] = None) -> dict[str, int]:
    """Where the pieces ``loaded`` holds start and end against the pieces ``saved`` stored, in whole-tensor
    element order, from both layouts' checkpoints: ``inside`` (an edge of a kept piece strictly inside
    a stored one), ``at`` (on a stored edge) and ``past`` (a stored edge strictly inside a kept piece:
    the piece is read from several stored ones), summed over the tensors; whole-tensor ends not
    counted."""
    cache = {} if cache is None else cache
    for layout in (saved, loaded):
        if (model, layout) not in cache:
            cache[(model, layout)] = _intervals(directory, model, layout)
    stored, kept = cache[(model, saved)], cache[(model, loaded)]
    counts = {"inside": 0, "at": 0, "past": 0}
    for key, runs in kept.items():  # the stored pieces, and the kept ones, cover each tensor once
        end = max(b for _, b in runs)
        edges = sorted({e for run in stored.get(key, []) for e in run} - {0, end})
        known = set(edges)
        for edge in {e for run in runs for e in run} - {0, end}:
            counts["at" if edge in known else "inside"] += 1
        counts["past"] += sum(bisect.bisect_left(edges, b) - bisect.bisect_right(edges, a) for a, b in runs)
    return counts
