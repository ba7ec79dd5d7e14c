"""Every Hugging Face causal-LM type with a parallelism plan, through ``parallelize``, against one process.

Run:  python benchmarks/hf_models.py                          (every type, every layout)
      python benchmarks/hf_models.py --layouts tp2 --types qwen3 mixtral     (a part of it)
      python benchmarks/hf_models.py --report                 (the table of the stored results only)

Which types: each causal-LM model type of the installed transformers
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) whose config class carries a ``base_model_tp_plan`` or
``base_model_pp_plan``; the MoE ones are those whose config also has a ``base_model_ep_plan``.
Each is shrunk to a tiny config by ``benchmarks/_tiny_hf.py`` (hidden 64, 2 layers or as few as
keep its layer-type pattern, 4 heads / 2 KV heads, vocabulary 256, 4 experts top-2, fp32, no
dropout, ``output_router_logits=True`` where the config has it) and built after
``torch.manual_seed(0)``.

The reference, computed once per type in one process and cached on disk (keyed by the config,
the batches and the package versions): 3 AdamW steps (lr 1e-3) of HF's own loss,
``model(input_ids=ids, labels=ids).loss`` (the router's aux loss included where it is on),
on fixed random batches of 4 sequences of 16 tokens. Each layout then runs as one
``mpirun -np 2`` launch that loops over the types in one process per rank:
``parallelize(model, torch.optim.AdamW, layout, lr=1e-3)``, the same 3 steps through
``train_step``, then every parameter gathered whole (``StageTensors``, the path
``save_pretrained`` and checkpoints take) and compared with the reference.

``--optimizer sgd`` runs the same with SGD and momentum (lr 0.5, momentum 0.9) instead, kept apart
(``<cache>/sgd``, ``docs/hf_models_sgd.md``): Adam divides each gradient by sqrt(v), so an element
whose gradient is fp32 rounding noise (a key bias, whose gradient is zero in exact arithmetic)
moves by up to lr whatever the noise was, and the AdamW sweep then groups a cell within 3x of how
far one-process fp32 training lands from fp64 as "at the fp32 rounding floor"; SGD has no such
division, so rtol 2e-5 is a strict test with it.

A cell reads "equal" when the 3 losses and every parameter are within rtol 2e-5 (atol 2e-6)
of the reference; "differs (max rel err E ...)" names the worst tensor (max |diff| over
max |reference|) or loss; "refused: <exception's first line>" when shardwise raised one of its
own errors (ConfigError and the like); "error: ..." for any other exception (a bug somewhere);
"hung: ..." when the launch made no progress for --timeout seconds (it is killed, the ranks'
own last errors are quoted, and a new launch goes on with the types left).

The ranks agree on every cell (an allgather of each rank's outcome) before the next type.
Results are kept in ``<cache>/results.json`` (one entry per layout and type, with its time and
git commit), so a partial run updates its cells only; the table printed and written to
``docs/hf_models.md`` covers every stored cell. Exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import _tiny_hf as tiny  # noqa: E402

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "micro_batches": 2},
    "dp2-z3": {"dp": 2, "zero_stage": 3},
    "ep2": {"dp": 2, "ep": 2},
}
MOE_ONLY = {"ep2"}
STEPS, BATCH, SEQ, LR, SEED = 3, 4, 16, 1e-3, 0
#: The optimizers a sweep can train with, and their arguments. AdamW is issue 53's criterion; SGD with
#: momentum (tests/distributed/hf_parallel.py's) does not turn the fp32 rounding of a near-zero gradient
#: into an lr-sized step, so rtol 2e-5 is a strict test of the parallel arithmetic with it.
OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {"adamw": ("AdamW", {"lr": LR}),
                                                        "sgd": ("SGD", {"lr": 0.5, "momentum": 0.9})}
RECIPE = 4  # bump when what a cached reference holds changes
RTOL, ATOL = 2e-5, 2e-6
RANKS = 2
FLOOR_FACTOR = 3.0  # a difference within this factor of the fp32 floor is grouped as rounding
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardwise" / "hf_models"
DOCS = ROOT / "docs" / "hf_models.md"
LINE = re.compile(r"^(START|CELL) (\S+) (\S+)(?: (.*))?$")


# --------------------------------------------------------------------------- the one-process reference
def batches() -> list:
    import torch

    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, tiny.VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def ref_path(cache: Path, model_type: str) -> Path:
    cfg = tiny.tiny_config(model_type)
    key = tiny.fingerprint(cfg, {"steps": STEPS, "batch": BATCH, "seq": SEQ, "lr": LR, "seed": SEED, "recipe": RECIPE,
                                 **_versions()})
    return cache / "refs" / f"{model_type}-{key}.pt"


def make_optimizer(params: Any, optimizer: str) -> Any:
    import torch

    name, kwargs = OPTIMIZERS[optimizer]
    return getattr(torch.optim, name)(params, **kwargs)


def _train(model_type: str, optimizer: str, dtype: Any = None) -> tuple[list[float], dict, bool]:
    """3 steps of HF's own loss (in ``dtype``, from the fp32 initial weights, when given)."""
    import torch

    model = tiny.build(model_type, SEED)
    if dtype is not None:
        model.to(dtype)
        if hasattr(model.config, "_experts_implementation"):  # torch's grouped_mm takes no fp64
            model.config._experts_implementation = "eager"
    opt = make_optimizer(model.parameters(), optimizer)
    losses, aux = [], False
    for ids in batches():
        out = model(input_ids=ids, labels=ids)
        aux = aux or getattr(out, "aux_loss", None) is not None
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, aux


def reference(model_type: str, optimizer: str) -> dict[str, Any]:
    """3 steps of HF's own loss in one process: the losses and the parameters after.

    ``floor``: how far that fp32 training lands from the same training in fp64 (the worst
    tensor's max |diff| / max |value|, and the losses'): fp32 rounding alone, which Adam's
    division by sqrt(v) magnifies where a gradient is near zero (a key bias, whose gradient
    is zero in exact arithmetic). A parallel run as accurate as one process lands about as far
    from the fp32 reference. None where the model does not run in fp64."""
    import torch

    losses, params, aux = _train(model_type, optimizer)
    try:
        exact, other, _ = _train(model_type, optimizer, torch.float64)
        floor = max((_rel_err(params[n], p), n) for n, p in other.items())
        loss_floor = max(abs(a - b) / abs(b) for a, b in zip(losses, exact))
    except Exception:  # noqa: BLE001 - a family with fp32-only kernels
        floor, loss_floor = None, None
    return {"losses": losses, "params": params, "aux_loss": aux, "n_params": sum(p.numel() for p in params.values()),
            "floor": floor, "loss_floor": loss_floor}


def _e(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def _rel_err(got: Any, want: Any) -> float:
    return float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-30)


def compute_references(types: list[str], cache: Path, optimizer: str) -> None:
    """Child process: compute and store the missing references, one ``CELL ref <type> {...}`` line each."""
    import torch

    torch.set_num_threads(1)
    _quiet()
    for model_type in types:
        print(f"START ref {model_type}", flush=True)
        t0 = time.monotonic()
        try:
            path = ref_path(cache, model_type)
            if not path.exists():
                ref = reference(model_type, optimizer)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                torch.save(ref, tmp)
                os.replace(tmp, path)
            result = {"status": "ok", "seconds": round(time.monotonic() - t0, 1)}
        except Exception as exc:  # noqa: BLE001 - a type whose tiny config does not build is reported, not fatal
            result = {"status": "error", "detail": f"reference: {_first_line(exc)}",
                      "trace": traceback.format_exc(limit=-4)}
        print(f"CELL ref {model_type} {json.dumps(result)}", flush=True)


# --------------------------------------------------------------------------- one cell, on every rank
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass


def _gather(pm: Any) -> dict[str, Any]:
    """The whole parameters this rank is handed (each one lands on exactly one rank of its stage)."""
    from shardwise.adapters.torch.parallel.full_tensors import StageTensors

    got: dict[str, Any] = {}
    StageTensors(pm, optimizer=False, masters=False).stream(lambda e, t: got.__setitem__(e.key, t.clone()))
    return got


def run_cell(layout_name: str, model_type: str, ref: dict, optimizer: str) -> dict[str, Any]:
    """This rank's outcome of one type at one layout (nothing raised past here)."""
    import torch

    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.core.errors import ShardwiseError
    from shardwise.core.layout import ParallelLayout

    pm = None
    try:
        layout = ParallelLayout(**LAYOUTS[layout_name])
        model = tiny.build(model_type, SEED)
        name, kwargs = OPTIMIZERS[optimizer]
        pm = parallelize(model, getattr(torch.optim, name), layout, **kwargs)
        losses = [float(pm.train_step(pm.shard_batch(ids))) for ids in batches()]
        got = _gather(pm)
        out: dict[str, Any] = {"losses": losses, "names": sorted(got), "worst": None}
        for name, tensor in got.items():
            want = ref["params"].get(name)
            if want is None:
                out.setdefault("unknown", []).append(name)
                continue
            if tuple(tensor.shape) != tuple(want.shape):
                out.setdefault("shape", []).append(f"{name} {tuple(tensor.shape)} vs {tuple(want.shape)}")
                continue
            tensor, want = tensor.float(), want.float()
            if not torch.allclose(tensor, want, rtol=RTOL, atol=ATOL):
                err = _rel_err(tensor, want)
                if out["worst"] is None or err > out["worst"][0]:
                    out["worst"] = (err, name)
        return out
    except Exception as exc:  # noqa: BLE001 - every outcome is a cell of the table
        return {"error": _first_line(exc), "refused": isinstance(exc, ShardwiseError),
                "trace": traceback.format_exc(limit=-3)}
    finally:
        if pm is not None:
            try:
                pm.groups.free()
            except Exception:  # noqa: BLE001
                pass


def judge(every: list[dict], ref: dict) -> dict[str, Any]:
    """The cell from every rank's outcome."""
    # the rank that raised first, not one that stopped because a pipeline peer had raised
    failed = sorted(((rank, out) for rank, out in enumerate(every) if "error" in out),
                    key=lambda item: item[1]["error"].startswith("PeerFailedError"))
    for rank, out in failed:
        kind = "refused" if out["refused"] else "error"
        return {"status": kind, "detail": out["error"], "rank": rank, "trace": out["trace"]}
    want = ref["losses"]
    for rank, out in enumerate(every):
        for step, (g, w) in enumerate(zip(out["losses"], want)):
            if abs(g - w) > ATOL + RTOL * abs(w):
                aux = "; the reference includes the router's aux loss" if ref["aux_loss"] else ""
                return {"status": "differs", "err": abs(g - w) / abs(w),
                        "detail": f"max rel err {abs(g - w) / abs(w):.1e} in the step-{step} loss "
                                  f"({g:.6f} vs {w:.6f}, rank {rank}; fp32 floor {_e(ref['loss_floor'])}){aux}"}
    problems = []
    for out in every:
        problems += [f"not in the model: {n}" for n in out.get("unknown", [])]
        problems += [f"shape {s}" for s in out.get("shape", [])]
    gathered = {n for out in every for n in out["names"]}
    missing = sorted(set(ref["params"]) - gathered)
    if missing:
        problems.append(f"{len(missing)} of {len(ref['params'])} parameters not gathered, e.g. {missing[0]}")
    if problems:
        return {"status": "differs", "detail": "; ".join(problems[:3]), "err": float("inf")}
    worst = max((out["worst"] for out in every if out["worst"]), default=None)
    if worst is not None:
        floor = ref["floor"]
        return {"status": "differs", "err": worst[0], "floor": floor[0] if floor else None,
                "detail": f"max rel err {worst[0]:.1e} in {worst[1]}; fp32 floor {_e(floor and floor[0])}"}
    return {"status": "equal", "detail": f"{len(gathered)} parameters, losses {[round(v, 5) for v in want]}"}


def worker(layout_name: str, types: list[str], cache: Path, backend: str, log_dir: Path, optimizer: str) -> None:
    """Under mpirun: each type at ``layout_name``; rank 0 prints ``START`` and ``CELL`` lines."""
    import torch

    import shardwise

    torch.set_num_threads(1)
    _quiet()
    world = shardwise.init(backend=backend).world
    log = log_dir / f"{layout_name}-rank{world.rank}.log"
    for model_type in types:
        if world.rank == 0:
            print(f"START {layout_name} {model_type}", flush=True)
        t0 = time.monotonic()
        path = ref_path(cache, model_type)
        ref = torch.load(path) if path.exists() else None
        if ref is None:
            out = {"error": "no reference (its one-process run failed)", "refused": False, "trace": ""}
        else:
            out = run_cell(layout_name, model_type, ref, optimizer)
        if "error" in out:  # read back by the driver if this type hangs the launch
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"type": model_type, "error": out["error"], "trace": out["trace"],
                                     "time": time.time()}) + "\n")
        every = world.allgather_object(out)
        if world.rank == 0:
            cell = judge(every, ref) if ref is not None else {"status": "error", "detail": out["error"]}
            cell["seconds"] = round(time.monotonic() - t0, 1)
            print(f"CELL {layout_name} {model_type} {json.dumps(cell)}", flush=True)


# --------------------------------------------------------------------------- the driver
def _kill(proc: subprocess.Popen) -> None:
    from mpi_harness import _kill_job

    _kill_job(proc)


def launch(argv: list[str], np_: Optional[int], timeout: float, on_line: Any,
           stuck: Any = lambda: False) -> tuple[int, list[str]]:
    """Run ``argv`` (under mpirun when ``np_``); kill it when no line came for ``timeout`` seconds, or
    as soon as ``stuck()`` says so (polled every few seconds)."""
    from shardwise.cli.launch import build_command, find_launcher, launch_env

    env = launch_env(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if np_:
        argv = build_command(find_launcher(), np_, argv, env=env)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    tail: list[str] = []
    killed = False
    last = time.monotonic()
    while True:
        try:
            line = lines.get(timeout=3)
        except queue.Empty:
            if time.monotonic() - last > timeout or stuck():
                killed = True
                _kill(proc)
                break
            continue
        if line is None:
            break
        last = time.monotonic()
        tail = (tail + [line])[-40:]
        on_line(line)
    proc.wait()
    return (-1 if killed else proc.returncode), tail


#: Seconds a cell may go on after one rank raised (and wrote its log) before the launch counts as hung:
#: the other ranks are then waiting in a collective the failed rank never joins.
AFTER_ERROR = 20.0


def _rank_errors(log_dir: Path, layout: str, model_type: str) -> list[tuple[str, dict]]:
    out = []
    for f in sorted(log_dir.glob(f"{layout}-rank*.log")):
        for entry in map(json.loads, f.read_text().splitlines()):
            if entry["type"] == model_type:
                out.append((f.stem.rsplit("rank", 1)[1], entry))
    return out


def run_layout(name: str, types: list[str], cache: Path, args: argparse.Namespace, results: dict) -> None:
    """Launch ``name`` until every type has a cell (a launch killed or crashed goes on after its type)."""
    left = list(types)
    log_dir = cache / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for f in log_dir.glob(f"{name}-rank*.log"):
        f.unlink()
    while left:
        current: list[Optional[str]] = [None]

        def on_line(line: str) -> None:
            hit = LINE.match(line)
            if not hit or hit.group(2) != name:
                return
            if hit.group(1) == "START":
                current[0] = hit.group(3)
                return
            cell = json.loads(hit.group(4))
            _record(results, name, hit.group(3), cell)
            if hit.group(3) in left:
                left.remove(hit.group(3))
            current[0] = None
            print(f"  {name:<7} {hit.group(3):<22} {_cell_text(cell)}  ({cell.get('seconds', '?')} s)", flush=True)

        if name == "ref":
            argv = [sys.executable, str(Path(__file__).resolve()), "--references", "--cache", str(cache),
                    "--optimizer", args.optimizer, "--types", *left]
            np_ = None
        else:
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--cache", str(cache),
                    "--optimizer", args.optimizer, "--backend", args.backend, "--types", *left]
            np_ = RANKS

        def stuck() -> bool:
            if current[0] is None or name == "ref":
                return False
            times = [e.get("time", 0.0) for _, e in _rank_errors(log_dir, name, current[0])]
            return bool(times) and time.time() - min(times) > AFTER_ERROR

        rc, tail = launch(argv, np_, args.timeout, on_line, stuck)
        if not left:
            break
        stuck_type = current[0]
        if stuck_type is None:  # died before its first type, or between types
            detail = f"launch exited {rc} before a result: " + " | ".join(tail[-3:])
            for model_type in left:
                _record(results, name, model_type, {"status": "error", "detail": detail[:400]})
            print(f"  {name}: {detail[:400]}", flush=True)
            break
        what = f"no progress for {args.timeout:.0f} s, launch killed" if rc == -1 else f"launch exited {rc}"
        errors = [f"rank {rank} raised {entry['error']}" for rank, entry in _rank_errors(log_dir, name, stuck_type)]
        if errors and rc == -1:
            what = "the other ranks waited in a collective, launch killed"
        detail = f"{what}" + (f" after {'; '.join(errors)}" if errors else "; no rank raised") + \
                 (f"; last output: {tail[-1][:200]}" if tail and not errors else "")
        status = "hung" if rc == -1 else "error"
        _record(results, name, stuck_type, {"status": status, "detail": detail})
        print(f"  {name:<7} {stuck_type:<22} {status}: {detail}", flush=True)
        left.remove(stuck_type)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "shardwise"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return out.stdout.strip() + ("+local changes" if dirty else "")
    except OSError:
        return "unknown"


_COMMIT = None


def _record(results: dict, layout: str, model_type: str, cell: dict) -> None:
    global _COMMIT
    if _COMMIT is None:
        _COMMIT = _git_commit()
    cell = {k: v for k, v in cell.items() if k != "trace"} | {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _COMMIT}
    results.setdefault(layout, {})[model_type] = cell


def _cell_text(cell: Optional[dict], width: int = 0) -> str:
    if cell is None:
        return "not run"
    status = cell["status"]
    if status == "equal":
        return "equal"
    if status == "ok":
        return "ok"
    if status == "differs":
        text = f"differs ({cell['detail']})"
    else:
        text = f"{status}: {cell['detail']}"
    return text if not width or len(text) <= width else text[: width - 3] + "..."


# --------------------------------------------------------------------------- the table
def _at_floor(cell: dict) -> bool:
    """A cell that differs by no more than FLOOR_FACTOR x the one-process fp32-vs-fp64 distance."""
    return cell["status"] == "differs" and bool(cell.get("floor")) and cell["err"] <= FLOOR_FACTOR * cell["floor"]


def _cause(cell: dict, model_type: str) -> str:
    """A cell's reason with what is particular to its type taken out, to group the cells by cause."""
    if _at_floor(cell):
        return (f"differs at the fp32 rounding floor: the worst parameter is within {FLOOR_FACTOR:g} x of how far "
                "one-process fp32 training lands from fp64")
    text = cell["detail"] if cell["status"] != "differs" else "differs: " + re.sub(
        r"max rel err \S+", "max rel err E", cell["detail"])
    names = {model_type, tiny.model_class(model_type).__name__.removesuffix("ForCausalLM")}
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(re.escape(name), "<type>", text, flags=re.I)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    return (cell["status"] if cell["status"] != "differs" else "") + (": " if cell["status"] != "differs" else "") \
        + text


def table(results: dict, types: list[str], layouts: list[str], markdown: bool) -> tuple[str, dict]:
    """The table (model type x layout), the totals per layout, and the causes grouped."""
    moe = {t: tiny.is_moe(t) for t in types}
    rows, totals = [], {}
    for name in layouts:
        mine = [t for t in types if name not in MOE_ONLY or moe[t]]
        cells = [results.get(name, {}).get(t) for t in mine]
        equal = sum(1 for c in cells if c and c["status"] == "equal")
        rounding = sum(1 for c in cells if c and _at_floor(c))
        totals[name] = (equal, len(mine), sum(1 for c in cells if c is None), rounding)
    causes: dict[str, list[str]] = defaultdict(list)
    for name in layouts:
        for t in types:
            cell = results.get(name, {}).get(t)
            if cell and cell["status"] not in ("equal", "ok") and not (name in MOE_ONLY and not moe[t]):
                causes[_cause(cell, t)].append(f"{t}@{name}")
    width = 0 if markdown else 46
    for t in types:
        cells = []
        for name in layouts:
            if name in MOE_ONLY and not moe[t]:
                cells.append("-")
            else:
                cells.append(_cell_text(results.get(name, {}).get(t), width).replace("|", "\\|"))
        rows.append((t + (" (MoE)" if moe[t] else ""), cells))
    if markdown:
        head = "| model type | " + " | ".join(layouts) + " |\n|---|" + "---|" * len(layouts) + "\n"
        body = "".join(f"| {t} | " + " | ".join(c) + " |\n" for t, c in rows)
    else:
        head = f"{'model type':<26}" + "".join(f"{n:<48}" for n in layouts) + "\n"
        body = "".join(f"{t:<26}" + "".join(f"{c:<48}" for c in cells) + "\n" for t, cells in rows)
    return head + body, {"totals": totals, "causes": causes}


def summary(info: dict, markdown: bool) -> str:
    out = []
    for name, (equal, n, not_run, rounding) in info["totals"].items():
        kind = "MoE types" if name in MOE_ONLY else "plan-carrying types"
        pct = 100.0 * equal / n if n else 0.0
        near = 100.0 * (equal + rounding) / n if n else 0.0
        extra = f", {not_run} not run" if not_run else ""
        out.append(f"{'- ' if markdown else ''}{name}: equal {equal}/{n} ({pct:.1f}% of the {kind}{extra}); "
                   f"equal or at the fp32 rounding floor {equal + rounding}/{n} ({near:.1f}%)")
    return "\n".join(out) + "\n"


def causes_text(info: dict, markdown: bool, limit: int = 40) -> str:
    groups = sorted(info["causes"].items(), key=lambda kv: -len(kv[1]))
    out = []
    for cause, cells in groups[:limit]:
        shown = ", ".join(cells[:8]) + (f", ... ({len(cells) - 8} more)" if len(cells) > 8 else "")
        cause = cause if len(cause) < 400 else cause[:397] + "..."
        out.append(f"- **{len(cells)}** {cause.replace('|', '/')}: {shown}" if markdown else
                   f"{len(cells):>4}  {cause}\n      {shown}")
    if len(groups) > limit:
        out.append(f"... and {len(groups) - limit} more causes")
    return "\n".join(out) + "\n"


def write_docs(path: Path, results: dict, types: list[str], command: str, optimizer: str) -> None:
    import torch
    import transformers

    body, info = table(results, types, list(LAYOUTS), markdown=True)
    whens = sorted({c["when"] for r in results.values() for c in r.values() if "when" in c})
    commits = sorted({c["commit"] for r in results.values() for c in r.values() if "commit" in c})
    n_moe = sum(tiny.is_moe(t) for t in types)
    text = f"""# Every Hugging Face causal LM with a plan, through `parallelize`

Written by `benchmarks/hf_models.py` on {datetime.date.today().isoformat()}: transformers
{transformers.__version__}, torch {torch.__version__}, on 2 ranks (mpirun, shardwise's mpi backend, the CPU).
Command: `{command}`. Cells from runs between {whens[0] if whens else '?'} and {whens[-1] if whens else '?'}
(shardwise at {', '.join(commits) or '?'}).

The {len(types)} causal-LM model types of transformers {transformers.__version__} whose config carries a
tensor- or pipeline-parallel plan ({n_moe} of them MoE: their config also has a `base_model_ep_plan`), each
shrunk to a tiny config (`benchmarks/_tiny_hf.py`: hidden 64, 2 layers or as few as keep the family's
layer-type pattern, 4 heads / 2 KV heads, vocabulary 256, 4 experts top-2, fp32, no dropout, the router's
aux loss on), built after `torch.manual_seed(0)`, trained 3 {OPTIMIZERS[optimizer][0]} steps
({", ".join(f"{k} {v:g}" for k, v in OPTIMIZERS[optimizer][1].items())}; 4 x 16 random tokens)
by `parallelize` at each layout and compared with the same 3 steps of HF's own loss
(`model(input_ids=ids, labels=ids).loss`) in one process: "equal" is the 3 losses and every parameter
after them within rtol {RTOL:g} (atol {ATOL:g}); "differs" names the worst tensor's max |diff| / max |value|;
"refused" quotes shardwise's error, "error" any other exception, "hung" a launch killed for making no
progress. Layouts: tp2 = `ParallelLayout(tp=2)`, pp2 = `ParallelLayout(pp=2, micro_batches=2)`,
dp2-z3 = `ParallelLayout(dp=2, zero_stage=3)`, ep2 = `ParallelLayout(dp=2, ep=2)` (MoE types only).

## Totals

{summary(info, markdown=True)}
Target (issue 53): equal for at least 90% of the plan-carrying types at every layout, and for at
least 90% of the MoE types at ep2.

## Causes, most common first

{causes_text(info, markdown=True, limit=60)}
## The table

{body}"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _load_results(cache: Path) -> dict:
    path = cache / "results.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save_results(cache: Path, results: dict) -> None:
    path = cache / "results.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=None, help="model types (default: every plan-carrying one)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--moe", action="store_true", help="only the MoE types")
    parser.add_argument("--dense", action="store_true", help="only the types without an expert-parallel plan")
    parser.add_argument("--failed", action="store_true", help="only the cells not equal in the stored results")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"references and results ({DEFAULT_CACHE})")
    parser.add_argument("--timeout", type=float, default=120, help="seconds without progress before a launch is "
                        "killed (one type's cell)")
    parser.add_argument("--backend", default="mpi", choices=["mpi", "torch"])
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                        help="adamw (issue 53's criterion, the default) or sgd (with momentum: results, references "
                        "and the table kept apart, in <cache>/sgd and docs/hf_models_sgd.md)")
    parser.add_argument("--docs", type=Path, default=None, help="the markdown table (default docs/hf_models.md)")
    parser.add_argument("--no-docs", action="store_true", help="do not write the markdown table")
    parser.add_argument("--report", action="store_true", help="print (and write) the stored results, run nothing")
    parser.add_argument("--references", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache = args.cache.resolve()
    if args.optimizer != "adamw" and not args.references and not args.worker:
        cache = cache / args.optimizer
    if args.docs is None:
        args.docs = DOCS if args.optimizer == "adamw" else DOCS.with_name(f"hf_models_{args.optimizer}.md")
    if args.references:
        compute_references(args.types, cache, args.optimizer)
        return 0
    if args.worker:
        worker(args.worker, args.types, cache, args.backend, cache / "logs", args.optimizer)
        return 0
    every = tiny.plan_types()
    types = args.types or every
    unknown = sorted(set(types) - set(every))
    if unknown:
        parser.error(f"not a plan-carrying causal-LM type of this transformers: {', '.join(unknown)}")
    if args.moe or args.dense:
        types = [t for t in types if tiny.is_moe(t) == args.moe]
    results = _load_results(cache)
    started = time.monotonic()
    if not args.report:
        print(f"references of {len(types)} types (cached in {cache / 'refs'})", flush=True)
        run_layout("ref", types, cache, args, results)
        for name in args.layouts:
            mine = [t for t in types if name not in MOE_ONLY or tiny.is_moe(t)]
            if args.failed:
                mine = [t for t in mine if results.get(name, {}).get(t, {}).get("status") != "equal"]
            print(f"\n{name} ({LAYOUTS[name]}): {len(mine)} types on {RANKS} ranks", flush=True)
            if mine:
                run_layout(name, mine, cache, args, results)
            _save_results(cache, results)
    _save_results(cache, results)
    shown = every if not args.types and not (args.moe or args.dense) or args.report else types
    body, info = table(results, shown, list(LAYOUTS), markdown=False)
    print(f"\n{body}")
    print(summary(info, markdown=False))
    print("causes, most common first:\n" + causes_text(info, markdown=False))
    if not args.report:
        print(f"{(time.monotonic() - started) / 60:.1f} min")
    if not args.no_docs:
        command = "python benchmarks/hf_models.py" + ("" if not sys.argv[1:] else " " + " ".join(sys.argv[1:]))
        write_docs(args.docs, results, every, command, args.optimizer)
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
