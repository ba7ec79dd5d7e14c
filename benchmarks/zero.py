"""ZeRO: step time and peak per-rank memory, shardwise vs torch and DeepSpeed, one transport per table.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/zero.py
(DeepSpeed rows need `bash benchmarks/setup.sh`; without DeepSpeed they are shown as not
installed.)

Per model (``--models``: the 21M-parameter MLP and the small GPT of benchmarks/_models.py),
Adam fp32, every contender built from the same weights and the same DeepSpeed JSON config:

* gloo (one torch.distributed process group for all rows): shardwise ``ZeroOptimizer``
  stage 1/2/3 on the torch backend (stages 1 and 2 also with ``overlap_publish=True``: the
  gather of the updated parameters runs into the next forward) vs torch ``ZeroRedundancyOptimizer`` + DDP (stage 1),
  FSDP2 ``fully_shard`` (stage 3; one unit per Linear / transformer layer, plus the root; and
  both stage-3 libraries again with ``reshard_after_forward=False``, against each other),
  DeepSpeed ZeRO 1/2/3 (its CPU accelerator, gloo); and, as a floor, one rank's own step with
  Adam and no communication at all (no sharded optimizer can go much under it: only its share
  of the Adam update is smaller);
* MPI (shardwise on the mpi backend, the gloo group shut down): shardwise
  ZeRO 1/2/3, absolute figures; no MPI peer exists (DeepSpeed and torch run on gloo).

Timing: contenders interleaved round by round, median step of the slowest rank per round,
median over rounds. Memory (benchmarks/_peak.py): one contender at a time, every table's
memory phase before any timing (``_common.run_transports``), peak VmHWM above the resident
set before it was built, 3 steps, largest rank.
"model states" is ``shardwise.core.memory``'s size of parameters + gradients + Adam state
per rank for the stage, the floor that the peak adds activations and buffers to.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: gloo, no oneCCL
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".venv", "torch_extensions"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

warnings.filterwarnings("ignore", message=r".*(is deprecated|ignoring DeepSpeed keys).*")

import shardwise  # noqa: E402
from _common import Transport, print_results, run_transports, set_threads  # noqa: E402
from _peak import timing_allocator  # noqa: E402
from _models import WORKLOADS, Workload  # noqa: E402
from shardwise.core.config import TrainingConfig  # noqa: E402
from shardwise.core.launch_env import detect_launch  # noqa: E402
from shardwise.core.memory import model_state_bytes  # noqa: E402


def ds_config(w: Workload, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": w.batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}


def _loop(model, opt, w: Workload, x, y):
    def step():
        opt.zero_grad()
        w.loss(model(x), y).backward()
        opt.step()
    return step


def shardwise_zero(w: Workload, stage: int, x, y, overlap: bool = False, reshard: bool = True):
    def build():
        from shardwise.adapters.torch.zero import ZeroOptimizer

        cfg = TrainingConfig.from_deepspeed(ds_config(w, stage))
        model = w.model()
        opt = ZeroOptimizer(model, torch.optim.Adam, stage=cfg.zero.stage, comm=shardwise.current().world, lr=1e-3,
                            overlap_publish=overlap, reshard_after_forward=reshard)
        return _loop(model, opt, w, x, y)
    return build


def torch_zero_redundancy(w: Workload, x, y):
    def build():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = nn.parallel.DistributedDataParallel(w.model())
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        return _loop(model, opt, w, x, y)
    return build


def torch_fsdp2(w: Workload, x, y, reshard: bool = True):
    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        model = w.model()
        for unit in w.units(model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), w, x, y)
    return build


def deepspeed_zero(w: Workload, stage: int, x, y):
    def build():
        import deepspeed

        model = w.model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        torch_linear = nn.functional.linear
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(w, stage))
        # Stage 3 replaces ``torch.nn.functional.linear`` for the whole process ("This will persist
        # unless manually reset"): DeepSpeed's steps run with its linear, every other contender with torch's.
        ds_linear, nn.functional.linear = nn.functional.linear, torch_linear

        def step():
            nn.functional.linear = ds_linear
            try:
                loss = w.loss(engine(x), y)
                engine.backward(loss)
                engine.step()
            finally:
                nn.functional.linear = torch_linear
        return step
    return build


FLOOR = "one rank's own step with Adam, no communication (floor)"
#: Stage 3 with each unit's parameters kept from its forward to its backward, on both sides.
NO_RESHARD = "shardwise ZeRO-3 reshard_after_forward=False (torch backend)"
FSDP2_NO_RESHARD = "torch FSDP2 fully_shard reshard_after_forward=False"


def local_only(w: Workload, x, y):
    """The plain single-process step: no ZeRO library can go under it (its optimizer steps every parameter)."""
    def build():
        model = w.model()
        return _loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), w, x, y)
    return build


def _deepspeed_missing() -> str:
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken accelerator set-up
        return f"not installed ({type(exc).__name__}; run bash benchmarks/setup.sh)"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp-zero,gpt", help="comma-separated: " + ",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--no-mpi", action="store_true", help="skip the MPI tables")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    args = parser.parse_args()
    threads = set_threads()
    ds_missing = "skipped (--no-deepspeed)" if args.no_deepspeed else _deepspeed_missing()
    workloads = [WORKLOADS[key] for key in args.models.split(",")]
    ds_names = [f"DeepSpeed ZeRO-{s}" for s in (1, 2, 3)]

    def adopt_gloo(world) -> None:
        if ds_missing == "":
            import logging

            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group that is already up
            deepspeed.utils.logger.setLevel(logging.WARNING)

    def release_gloo() -> None:
        if ds_missing == "":
            import deepspeed

            deepspeed.comm.destroy_process_group()  # and forget the groups it cached, for the next open

    def states(w: Workload, n: int, names: dict) -> tuple[str, dict]:
        psi = w.params()
        title = f"{w.label}, {psi / 1e6:.1f}M params, batch {w.batch}/rank"
        return title, {name: f"{model_state_bytes(psi, n, s, 'adam', 'fp32').total / 2**20:.1f}"
                       for name, s in names.items()}

    def stage_of(name: str) -> int:
        if name == FLOOR:
            return 0
        return int(name.split("ZeRO-")[1][0]) if "ZeRO-" in name else (1 if "Redundancy" in name else 3)

    def gloo_tables(world) -> dict:
        tables = {}
        for w in workloads:
            x, y = w.data(world.rank, w.batch, torch.device("cpu"))
            builds = {f"shardwise ZeRO-{s} (torch backend)": shardwise_zero(w, s, x, y) for s in (1, 2, 3)}
            builds.update({f"shardwise ZeRO-{s} overlap_publish (torch backend)": shardwise_zero(w, s, x, y, True)
                           for s in (1, 2)})
            builds["torch ZeroRedundancyOptimizer + DDP"] = torch_zero_redundancy(w, x, y)
            builds["torch FSDP2 fully_shard"] = torch_fsdp2(w, x, y)
            builds[NO_RESHARD] = shardwise_zero(w, 3, x, y, reshard=False)
            builds[FSDP2_NO_RESHARD] = torch_fsdp2(w, x, y, reshard=False)
            if not ds_missing:
                builds.update({name: deepspeed_zero(w, s, x, y) for name, s in zip(ds_names, (1, 2, 3))})
            builds[FLOOR] = local_only(w, x, y)
            tables[w.name] = builds
        return tables

    def gloo_report(world, results: dict) -> None:
        if world.rank != 0:
            return
        pairs = [("shardwise ZeRO-1 (torch backend)", "torch ZeroRedundancyOptimizer + DDP"),
                 ("shardwise ZeRO-3 (torch backend)", "torch FSDP2 fully_shard")]
        pairs += [(f"shardwise ZeRO-{s} (torch backend)", f"DeepSpeed ZeRO-{s}") for s in (1, 2, 3)]
        pairs += [(NO_RESHARD, FSDP2_NO_RESHARD)]
        pairs += [("shardwise ZeRO-1 overlap_publish (torch backend)", "torch ZeroRedundancyOptimizer + DDP")]
        pairs += [(f"shardwise ZeRO-{s} overlap_publish (torch backend)", f"DeepSpeed ZeRO-{s}") for s in (1, 2)]
        for w in workloads:
            res = results[w.name]
            title, extra = states(w, world.size, {name: stage_of(name) for name in res.keys() | set(ds_names)})
            print_results(f"## {title} - transport: gloo", res, pairs, items=w.batch * world.size, extra=extra,
                          extra_header="model states MiB",
                          missing={k: ds_missing for k in ds_names} if ds_missing else None, floor=FLOOR)
            sys.stdout.flush()

    def mpi_tables(world) -> dict:
        tables = {}
        for w in workloads:
            x, y = w.data(world.rank, w.batch, torch.device("cpu"))
            tables[w.name] = {f"shardwise ZeRO-{s} (mpi backend)": shardwise_zero(w, s, x, y) for s in (1, 2, 3)}
        return tables

    def mpi_report(world, results: dict) -> None:
        if world.rank != 0:
            return
        for w in workloads:
            res = results[w.name]
            title, extra = states(w, world.size, {name: stage_of(name) for name in res})
            print_results(f"## {title} - transport: MPI (no MPI peer: absolute figures only)", res,
                          items=w.batch * world.size, extra=extra, extra_header="model states MiB")
            sys.stdout.flush()

    launch = detect_launch()
    if launch.rank == 0:
        ds = "DeepSpeed " + (importlib.import_module("deepspeed").__version__ if not ds_missing else ds_missing)
        print(f"# ZeRO, {launch.size} ranks, {threads} thread(s)/rank, torch {torch.__version__}, {ds}, Adam fp32; "
              f"median of {args.rounds} rounds x {args.steps} steps (slowest rank per round); "
              f"{timing_allocator(not args.no_memory)}")
    transports = [Transport("torch", gloo_tables, gloo_report, adopt_gloo, release_gloo)]
    if not args.no_mpi:
        transports.append(Transport("mpi", mpi_tables, mpi_report))
    run_transports(transports, args.rounds, args.steps, memory=not args.no_memory)


if __name__ == "__main__":
    main()
