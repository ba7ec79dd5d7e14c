"""The whole checkpoint resume matrix: every ordered pair of layouts, at world sizes 1, 2 and 4.

Run:  python benchmarks/resume_matrix.py                 (12 to 20 minutes on 2 busy CPU cores)
      python benchmarks/resume_matrix.py --models llama --layouts tp2 dp2-z3     (a part of it)

For each model of ``tests/distributed/resume_matrix.py`` (GPT-2 with tied embeddings and
fused QKV, Llama with GQA and an untied head, three shapes each) and each layout of its
``LAYOUTS`` (dp at ZeRO 0/1/2/3 on 1, 2 and 4 ranks, tp2, pp2, tp2 x pp2, interleaved pp,
dp x tp with ZeRO), the model trains 2 steps and is saved; then, for every ordered pair
(A, B), a new launch at B's world size builds B, loads A's checkpoint, trains 2 more steps
and compares every loss and parameter with an uninterrupted one-process run (SGD with
momentum, rtol 1e-5). One mpirun launch per world size saves every layout of that size;
one per world size loads every pair whose B runs at that size.

Prints each launch's pass/fail lines, then a table of pairs passed per model and family,
one by saving and loading world size, and every failure with its error. Exits 1 when a
pair failed or gave no result.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
sys.path.insert(0, str(ROOT / "tests"))

from mpi_harness import _kill_job  # noqa: E402
from resume_matrix import LAYOUTS, MODELS, boundary_relations, pairs, ranks  # noqa: E402

from shardwise.cli.launch import build_command, find_launcher, launch_env  # noqa: E402

RUNNER = ROOT / "tests" / "distributed" / "_runner.py"
LINE = re.compile(r"^(RESUME|SAVE) (PASS|OK|FAIL) (\S+) (\S+?)\(\d+\)(?: -> (\S+?)\(\d+\))?(?::\s*(.*))?$")


def launch(np_: int, target: str, kwargs: dict, timeout: float) -> list[str]:
    """Run ``target`` on ``np_`` ranks; its output lines (echoed as they come)."""
    env = launch_env(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    argv = build_command(find_launcher(), np_, [sys.executable, str(RUNNER), target, json.dumps(kwargs)], env=env)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if LINE.match(lines[-1]) or "SHARDWISE TEST FAILURE" in line:
                print(f"  [{np_}] {lines[-1]}", flush=True)
            if time.monotonic() > deadline:
                print(f"  [{np_}] launch killed after {timeout:.0f} s", flush=True)
                break
    finally:
        if proc.poll() is None:
            _kill_job(proc)  # mpirun and every rank (each in a process group of its own)
    proc.wait()
    if proc.returncode:
        print(f"  [{np_}] launch exited {proc.returncode}; last lines:\n    " + "\n    ".join(lines[-15:]), flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(MODELS), choices=list(MODELS),
                        help="every model of these families of MODELS (default: all)")
    parser.add_argument("--models", nargs="+", default=None,
                        help="model specs as hf_parallel.build reads them (family:vocab:hidden:ffn), instead")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--tmpdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    args = parser.parse_args()
    models = args.models or [m for f in args.families for m in MODELS[f]]
    family = {m: m.split(":")[0] for m in models}
    sizes = sorted({ranks(layout) for layout in args.layouts})
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.tmpdir, prefix="resume-matrix-") as directory:
        out: list[str] = []
        for n in sizes:
            mine = [layout for layout in args.layouts if ranks(layout) == n]
            print(f"saving {len(models)} models x {len(mine)} layouts on {n} rank(s)", flush=True)
            out += launch(n, "resume_matrix:save", {"backend": "mpi", "directory": directory, "strict": False,
                                                     "cases": [[m, layout] for m in models for layout in mine]},
                          args.timeout)
        for n in sizes:
            cases = pairs(models, args.layouts, loading_ranks=n)
            print(f"loading {len(cases)} pairs on {n} rank(s)", flush=True)
            out += launch(n, "resume_matrix:load", {"backend": "mpi", "directory": directory, "cases": cases,
                                                     "strict": False}, args.timeout)
        relations = {}
        cache: dict = {}
        for model, saved, loaded in pairs(models, args.layouts):
            try:
                relations[(model, saved, loaded)] = boundary_relations(directory, model, saved, loaded, cache)
            except Exception:  # noqa: BLE001 - a layout that failed to save has no manifest
                pass
    results: dict[tuple[str, str, str], tuple[bool, str]] = {}
    for line in out:
        hit = LINE.match(line)
        if hit and hit.group(1) == "RESUME":
            results[(hit.group(3), hit.group(4), hit.group(5))] = (hit.group(2) == "PASS", hit.group(6) or "")
    every = pairs(models, args.layouts)
    missing = [tuple(c) for c in every if tuple(c) not in results]
    for case in missing:
        results[case] = (False, "no result (the launch ended before this pair)")
    minutes = (time.monotonic() - started) / 60
    print(f"\nResume matrix: {len(models)} models x {len(args.layouts)} layouts, every ordered pair "
          f"({len(every)} resumes), 2 steps saved + 2 resumed, SGD momentum, rtol 1e-5 against one process; "
          f"{minutes:.1f} min")
    print(f"layouts: {', '.join(f'{k}({ranks(k)})' for k in args.layouts)}\n")
    print(f"{'family':<8} {'model (vocab:hidden:ffn)':<26} {'pairs':>6} {'passed':>7} {'failed':>7}")
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for m in models:
        got = [ok for (model, _, _), (ok, _) in results.items() if model == m]
        print(f"{family[m]:<8} {m:<26} {len(got):>6} {sum(got):>7} {len(got) - sum(got):>7}")
        for key in (family[m], "all"):
            totals[key][0] += len(got)
            totals[key][1] += sum(got)
    for key in sorted(set(family.values())) + ["all"]:
        n, ok = totals[key]
        print(f"{key:<8} {'(total)':<26} {n:>6} {ok:>7} {n - ok:>7}")
    print("\npassed / pairs by saving world size (rows) and loading world size (columns)")
    print("save\\load " + "".join(f"{n:>10}" for n in sizes))
    for a in sizes:
        cells = []
        for b in sizes:
            got = [ok for (_, s, lo), (ok, _) in results.items() if ranks(s) == a and ranks(lo) == b]
            cells.append(f"{sum(got)}/{len(got)}")
        print(f"{a:<10}" + "".join(f"{c:>10}" for c in cells))
    print("\nwhere the loading layout's pieces start and end against the stored pieces, in whole-tensor element"
          "\norder: pairs (A != B) with an edge inside a stored piece, on a stored edge, and a stored edge"
          "\ninside a kept piece; 'tp <-> zero': one of A, B splits tensors over tp, the other shards over ZeRO")
    print(f"{'family':<8} {'pairs':<12} {'of':>5} {'inside':>7} {'at':>7} {'past':>7} {'all 3':>7}")

    def tp_zero(a: str, b: str) -> bool:
        tp, zero = (lambda x: LAYOUTS[x].get("tp", 1) > 1), (lambda x: LAYOUTS[x].get("zero_stage", 0) > 0)
        return (tp(a) and zero(b)) or (zero(a) and tp(b))

    for fam in sorted(set(family.values())):
        for label, keep in (("all", lambda a, b: a != b), ("tp <-> zero", tp_zero)):
            rel = [r for (m, a, b), r in relations.items() if family[m] == fam and keep(a, b)]
            hits = {k: sum(r[k] > 0 for r in rel) for k in ("inside", "at", "past")}
            every3 = sum(all(r[k] > 0 for k in hits) for r in rel)
            print(f"{fam:<8} {label:<12} {len(rel):>5} {hits['inside']:>7} {hits['at']:>7} {hits['past']:>7} "
                  f"{every3:>7}")
    failed = [(case, why) for case, (ok, why) in results.items() if not ok]
    print(f"\n{len(results) - len(failed)} of {len(results)} pairs passed")
    for (model, saved, loaded), why in failed:
        print(f"FAILED {model} {saved}({ranks(saved)}) -> {loaded}({ranks(loaded)}): {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
