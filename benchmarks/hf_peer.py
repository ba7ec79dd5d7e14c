"""shardwise's ``parallelize`` against transformers' own ``DistributedConfig``: step time, peak memory, losses.

Run on 2 ranks (one launch, one gloo group for both libraries):
    torchrun --nproc_per_node 2 benchmarks/hf_peer.py
Quick try:
    torchrun --nproc_per_node 2 benchmarks/hf_peer.py --tables dense --rounds 1 --steps 1
(the peer needs ``accelerate``: ``bash benchmarks/setup.sh``).

``shardwise.init(backend="torch")`` opens the gloo group from torchrun's environment;
transformers finds it initialised and builds its device meshes on it, so both libraries
send over the same transport. Rank 0 writes each model once with ``save_pretrained``
(seed 0) and both sides load that directory: transformers with ``from_pretrained(dir,
distributed_config=...)``, shardwise by building the model on the meta device and
``parallelize(..., weights=dir)``. fp32, ``torch.optim.AdamW(lr=1e-3)`` on both sides;
each step is ``loss.backward()`` + ``step()`` + ``zero_grad()`` on the peer and
``ParallelModel.train_step`` on shardwise, over the same global batch of ``--batch``
sequences of ``--seq-len`` tokens (ranks of a tensor-parallel group see all of it, ranks of
a data-parallel group their half).

Tables:

* ``dense``: a Qwen3 (8 layers x 384, 6 heads / 2 KV heads of 64, MLP 1024, vocabulary 8192,
  untied head: 19.3M parameters). Peer ``DistributedConfig(tp_size=2)`` (the model's own
  ``base_model_tp_plan``; transformers splits the token table by vocabulary, and the head with
  ``colwise_gather_output``) vs ``ParallelLayout(tp=2)`` and ``ParallelLayout(tp=2,
  vocab_parallel=True)``.
* ``moe``: a Qwen3-MoE (6 layers x 384, 8 experts of 384, top-2, same attention and vocabulary:
  29.9M parameters). transformers takes expert parallelism on 2 ranks in two ways
  (``ep_size`` must be a multiple of ``tp_size`` and divide ``fsdp_size * tp_size``):
  ``DistributedConfig(ep_size=2, tp_size=2, tp_plan={})`` (both ranks run the whole batch's
  attention, each half of the experts; outputs summed) and ``DistributedConfig(ep_size=2,
  fsdp_size=2)`` (each rank its half of the batch, tokens exchanged by all-to-all, dense
  parameters FSDP-sharded). shardwise: ``ParallelLayout(dp=2, ep=2)`` and ``ParallelLayout(dp=2,
  ep=2, zero_stage=3)`` (the dense parameters sharded over dp, as FSDP does), built on the meta
  device with ``weights=dir`` as above (``save_pretrained`` writes a Hugging Face 5 MoE's fused
  experts back as one tensor per expert, which ``weights=`` reads through transformers' own
  conversion mapping, each rank its own experts); ``--from-pretrained`` adds the row whose model
  every rank loads with ``from_pretrained(dir)`` before ``parallelize``.

Figures as in the other benchmarks (``_common.py``): every table's memory phase first (one
contender at a time, peak VmHWM above the resident set before it was built, largest rank,
3 steps), then one loss phase (each contender built afresh, ``--loss-steps`` steps on
distinct batches, the loss averaged over the global batch, against one process training the
same directory on the whole batch), then the timing: contenders interleaved round by round,
the slowest rank's median step per round, the median over rounds. A shardwise contender
that refuses the model is shown with its refusal and left out.
``--profile "NAME;NAME"`` prints torch.profiler's busiest operators of 2 steps of each contender whose
name contains one of them, on rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import warnings
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from _common import Row, init_gloo, memory_phase, print_results, set_threads, time_interleaved  # noqa: E402
from _peak import timing_allocator  # noqa: E402

LR = 1e-3
VOCAB = 8192
ATTENTION = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
                 max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0,
                 eos_token_id=0)
MODELS = {
    "dense": ("qwen3", dict(ATTENTION, intermediate_size=1024, num_hidden_layers=8)),
    "moe": ("qwen3_moe", dict(ATTENTION, intermediate_size=1024, moe_intermediate_size=384, num_hidden_layers=6,
                              num_local_experts=8, num_experts_per_tok=2)),
}
PEER_TP = "transformers DistributedConfig(tp_size=2)"
SW_TP = "shardwise ParallelLayout(tp=2)"
SW_TP_VP = "shardwise ParallelLayout(tp=2, vocab_parallel=True)"
PEER_EP_TP = "transformers DistributedConfig(ep_size=2, tp_size=2, tp_plan={})"
PEER_EP_FSDP = "transformers DistributedConfig(ep_size=2, fsdp_size=2)"
SW_EP = "shardwise ParallelLayout(dp=2, ep=2)"
SW_EP_LOADED = "shardwise ParallelLayout(dp=2, ep=2), model from from_pretrained"
SW_EP_Z3 = "shardwise ParallelLayout(dp=2, ep=2, zero_stage=3)"

Step = Callable[[torch.Tensor], torch.Tensor]  # the global batch -> this step's loss (a 0-d tensor)


def save_model(world: Any, kind: str) -> str:
    """Rank 0 writes the table's model (seed 0) with save_pretrained; every rank gets the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = None
    if world.rank == 0:
        model_type, shape = MODELS[kind]
        path = tempfile.mkdtemp(prefix=f"hf_peer_{kind}_")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape)).save_pretrained(path)
    path = world.allgather_object(path)[0]
    world.barrier()
    return path


def peer(path: str, world: Any, split_batch: bool, **distributed: Any) -> Callable[[], Step]:
    """transformers' own distributed training: from_pretrained(distributed_config=...) + AdamW."""
    def build() -> Step:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**distributed),
                                                     dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def step(batch: torch.Tensor) -> torch.Tensor:
            ids = batch.chunk(world.size)[world.rank] if split_batch else batch
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        step.split = split_batch  # type: ignore[attr-defined]
        return step
    return build


def ours(path: str, loaded: bool = False, **layout: Any) -> Callable[[], Step]:
    """shardwise: the model built on the meta device, parallelize(..., weights=path), train_step; or, with
    ``loaded``, the model from_pretrained(path) on every rank, then parallelize."""
    def build() -> Step:
        from transformers import AutoConfig, AutoModelForCausalLM

        from shardwise.torch import ParallelLayout, parallelize

        if loaded:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            pm = parallelize(model, torch.optim.AdamW, ParallelLayout(**layout), lr=LR)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
            pm = parallelize(model, torch.optim.AdamW, ParallelLayout(**layout), weights=path, lr=LR)

        def step(batch: torch.Tensor) -> torch.Tensor:
            return torch.tensor(pm.train_step(pm.shard_batch(batch)))
        step.split = False  # type: ignore[attr-defined]  # train_step returns the global batch's loss
        return step
    return build


def one_process(path: str, batches: list[torch.Tensor]) -> list[float]:
    """The reference: the same directory trained by one process on the whole batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def fixed(build: Callable[[], Step], batch: torch.Tensor) -> Callable[[], Callable[[], Any]]:
    """A build for ``_common``: its step function trains on ``batch`` every time."""
    def timed_build() -> Callable[[], Any]:
        step = build()
        return lambda: step(batch)
    return timed_build


def admitted(world: Any, builds: dict[str, Callable[[], Step]], batch: torch.Tensor) -> dict[str, str]:
    """Contenders that refuse the model (build or first step raised): name -> the refusal, same on every rank."""
    refused: dict[str, str] = {}
    for name, build in builds.items():
        try:
            build()(batch)
        except Exception as exc:  # noqa: BLE001 - a refusal is reported, not raised
            refused[name] = f"refused: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        gc.collect()
        world.barrier()
    every = world.allgather_object(refused)
    return {k: v for r in every for k, v in r.items()}


def loss_phase(world: Any, path: str, builds: dict[str, Callable[[], Step]],
               batches: list[torch.Tensor]) -> tuple[list[float], dict[str, list[float]]]:
    """Each contender's losses on ``batches`` (averaged over the global batch) and the one-process reference."""
    reference = one_process(path, batches)
    out = {}
    for name, build in builds.items():
        step = build()
        losses = []
        for ids in batches:
            loss = float(step(ids))
            if step.split:  # type: ignore[attr-defined]  # each rank's loss is its half's mean
                loss = statistics.fmean(world.allgather_object(loss))
            losses.append(loss)
        out[name] = losses
        del step
        gc.collect()
        world.barrier()
    return reference, out


def profile(world: Any, name: str, build: Callable[[], Step], batch: torch.Tensor) -> None:
    """torch.profiler's busiest operators of 2 steps of one contender (warmed up), printed by rank 0."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step = build()
    step(batch)
    world.barrier()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step(batch)
    if world.rank == 0:
        print(f"\n### profile of {name} (rank 0, 2 steps)\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    world.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", default="dense,moe", help="comma-separated: " + ",".join(MODELS))
    parser.add_argument("--from-pretrained", action="store_true",
                        help="also the MoE row whose model every rank loads with from_pretrained before parallelize")
    parser.add_argument("--batch", type=int, default=8, help="sequences per global batch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender and round")
    parser.add_argument("--loss-steps", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    parser.add_argument("--profile", metavar="NAME[;NAME]",
                        help="profile the contenders whose names contain one of the ;-separated NAMEs")
    args = parser.parse_args()
    threads = set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    world = init_gloo()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (args.batch, args.seq_len), generator=gen) for _ in range(args.loss_steps)]
    batch = batches[0]
    if world.rank == 0:
        import accelerate
        import transformers

        print(f"# shardwise vs transformers DistributedConfig, {world.size} ranks (torchrun), transport gloo for "
              f"both (one process group), {threads} thread(s)/rank, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, accelerate {accelerate.__version__}; {platform.node()}, "
              f"{os.cpu_count()} CPUs, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; fp32 "
              f"AdamW(lr={LR}), global batch {args.batch} x {args.seq_len} tokens; median of {args.rounds} rounds x "
              f"{args.steps} steps (slowest rank per round); {timing_allocator(not args.no_memory)}; load average "
              f"at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    tables, refusals, paths = {}, {}, {}
    for kind in args.tables.split(","):
        path = paths[kind] = save_model(world, kind)
        if kind == "dense":
            builds = {PEER_TP: peer(path, world, False, tp_size=2), SW_TP: ours(path, tp=2),
                      SW_TP_VP: ours(path, tp=2, vocab_parallel=True)}
        else:
            builds = {PEER_EP_TP: peer(path, world, False, ep_size=2, tp_size=2, tp_plan={}),
                      PEER_EP_FSDP: peer(path, world, True, ep_size=2, fsdp_size=2), SW_EP: ours(path, dp=2, ep=2),
                      SW_EP_Z3: ours(path, dp=2, ep=2, zero_stage=3)}
            if args.from_pretrained:
                builds[SW_EP_LOADED] = ours(path, True, dp=2, ep=2)
        refusals[kind] = admitted(world, builds, batch)
        tables[kind] = {k: v for k, v in builds.items() if k not in refusals[kind]}
    if args.profile:
        for kind, builds in tables.items():
            for name, build in builds.items():
                if any(part in name for part in args.profile.split(";")):
                    profile(world, name, build, batch)
    peaks = {} if args.no_memory else \
        {kind: memory_phase({k: fixed(b, batch) for k, b in builds.items()}, world) for kind, builds in tables.items()}
    losses = {kind: loss_phase(world, paths[kind], builds, batches) for kind, builds in tables.items()}
    for kind, builds in tables.items():
        timed = time_interleaved({k: fixed(b, batch) for k, b in builds.items()}, world, args.rounds, args.steps)
        if world.rank == 0:
            report(kind, paths[kind], timed, peaks.get(kind, {}), refusals[kind], losses[kind])
        sys.stdout.flush()
    world.barrier()
    if world.rank == 0:
        for path in paths.values():
            shutil.rmtree(path, ignore_errors=True)


def report(kind: str, path: str, timed: dict, peaks: dict, refused: dict, losses: tuple) -> None:
    from transformers import AutoConfig

    from shardwise.core.model_spec import ModelSpec

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(path).to_dict())
    results = {name: Row(t, per, peaks.get(name), cpu) for name, (t, per, cpu) in timed.items()}
    moe = f", {spec.num_experts} experts top-{spec.experts_per_token}" if spec.is_moe else ""
    title = f"## {MODELS[kind][0]} {spec.num_params / 1e6:.1f}M params{moe} - transport: gloo (both sides)"
    pairs = [(SW_TP, PEER_TP), (SW_TP_VP, PEER_TP)] if kind == "dense" else \
        [(sw, hf) for sw in (SW_EP, SW_EP_Z3, SW_EP_LOADED) if sw in results or sw in refused
         for hf in (PEER_EP_TP, PEER_EP_FSDP)]
    print_results(title, results, pairs, missing=refused)
    reference, got = losses
    print(f"\nlosses of {len(reference)} AdamW steps on distinct batches (global-batch mean), "
          f"against one process on the whole batch:\n")
    print("| contender | " + " | ".join(f"step {i + 1}" for i in range(len(reference))) + " | max abs diff |")
    print("|---|" + "---|" * (len(reference) + 1))
    print("| one process (reference) | " + " | ".join(f"{x:.6f}" for x in reference) + " | - |")
    for name, values in got.items():
        diff = max(abs(a - b) for a, b in zip(values, reference))
        print(f"| {name} | " + " | ".join(f"{x:.6f}" for x in values) + f" | {diff:.2e} |")


if __name__ == "__main__":
    main()
