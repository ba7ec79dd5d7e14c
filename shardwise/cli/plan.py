"""``shardwise plan``: rank parallel strategies for a model on a cluster (see :mod:`shardwise.core.planner`)."""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from ..core.errors import ConfigError, ShardwiseError
from ..core.hardware import Hardware
from ..core.hf_config import load_hf_config
from ..core.memory import OPTIMIZER_STATE_BYTES, PRECISIONS
from ..core.model_spec import ModelSpec
from ..core.planner import Candidate, PlanResult, plan
from .plan_rules import rule_lines

__all__ = ["add_arguments", "model_spec", "run", "format_table", "plot_memory"]

_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
_SEQ_LEN, _VOCAB = 2048, 50257
_SHAPE_OPTIONS = (("layers", "--layers"), ("hidden", "--hidden"), ("heads", "--heads"), ("vocab", "--vocab"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` options to ``parser``."""
    model = parser.add_argument_group("model", "give --params (and optionally its shape) or --model")
    which = model.add_mutually_exclusive_group(required=True)
    which.add_argument("--params", help="parameter count, e.g. 30B, 1.3B, 350M")
    which.add_argument("--model", metavar="gpt2|llama|mistral|qwen2|CONFIG.json|DIR",
                       help="a preset (transformers' default config of that family), the Hugging Face "
                            "config.json of any decoder-only model (dense or Mixture-of-Experts), or a "
                            "save_pretrained directory: shape and parameter count (exact for the families "
                            "shardwise knows; the report says when it is not)")
    model.add_argument("--layers", type=int, help="transformer layers (derived from --params if omitted)")
    model.add_argument("--hidden", type=int, help="hidden size (derived from --params if omitted)")
    model.add_argument("--heads", type=int, help="attention heads (default hidden/128, hidden/64 if small)")
    model.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {_SEQ_LEN}; with --model, "
                                                    "the config's context length)")
    model.add_argument("--vocab", type=int, help=f"vocabulary size (default {_VOCAB})")
    train = parser.add_argument_group("training")
    train.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    train.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_STATE_BYTES))
    train.add_argument("--precision", default="bf16", choices=sorted(PRECISIONS))
    train.add_argument("--overlap", type=float, default=0.8,
                       help="share of backward that can hide gradient communication (default 0.8)")
    train.add_argument("--max-micro-batches", type=int, help="largest micro-batch count tried")
    train.add_argument("--moe-imbalance", type=float, default=1.0,
                       help="Mixture of Experts: the busiest expert-parallel rank's routed tokens over the mean "
                            "(default 1.0, even routing); scales its expert compute and all-to-all")
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--devices", type=int, required=True, help="number of devices")
    hw.add_argument("--device-memory", default="80GB", help="memory per device, e.g. 80GB, 40GiB")
    hw.add_argument("--devices-per-node", type=int, default=8, help="devices per node (default 8)")
    hw.add_argument("--intra-node", default="300GB/s", help="per-device intra-node bandwidth (300GB/s)")
    hw.add_argument("--intra-node-gbps", type=float, metavar="GBIT_S",
                    help="the same in gigabits per second (overrides --intra-node)")
    hw.add_argument("--intra-latency", default="5us", help="intra-node latency (5us)")
    hw.add_argument("--interconnect", default="100Gbps", help="per-device inter-node bandwidth (100Gbps)")
    hw.add_argument("--inter-node-gbps", type=float, metavar="GBIT_S",
                    help="the same in gigabits per second (overrides --interconnect); with an intra-node "
                         "bandwidth above it, ZeRO layouts that span nodes are also weighed as hybrid sharding "
                         "(shard within a node, replicate across: HSDP)")
    hw.add_argument("--inter-latency", default="10us", help="inter-node latency (10us)")
    hw.add_argument("--flops", default="312TFLOPS", help="peak FLOP/s per device (312TFLOPS)")
    hw.add_argument("--efficiency", type=float, default=0.5, help="achievable share of peak (0.5)")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="layouts to list (0 = all; default 10)")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--rules", action="store_true",
                     help="with --model: list every split rule parallelize would apply, not only their source")
    out.add_argument("--plot", metavar="PATH", help="save a stacked memory bar chart (needs matplotlib)")


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _units(result: PlanResult) -> tuple[float, str, float, str]:
    """Memory and time units that keep the best candidate's figures readable (GB and s, or MB and ms)."""
    best = result.best
    mem = (1e9, "GB") if best.memory.total >= 1e9 else (1e6, "MB")
    time = (1.0, "s") if best.step_time >= 0.1 else (1e-3, "ms")
    return mem[0], mem[1], time[0], time[1]


def _row(c: Candidate, mark: str, units: tuple[float, str, float, str], moe: bool = False, width: int = 18) -> str:
    mem, _, sec, _ = units
    ep = f" {c.ep:>3}" if moe else ""
    return (f"{mark} {c.strategy:<{width}} {c.dp:>4} {c.tp:>3} {c.pp:>3}{ep} {c.zero:>4} {c.micro_batches:>5} "
            f"{c.micro_batch_size:>4} {'yes' if c.checkpointing else 'no':>4} {c.memory.total / mem:>7.1f} "
            f"{c.step_time / sec:>9.2f} {_pct(c.comm_fraction):>5}  {c.reason}")


def _shown(result: PlanResult, top: int) -> tuple[list[Candidate], list[Candidate]]:
    """The fitting layouts to list and the rejected strategies."""
    fitting = [c for c in result.layouts() if c.fits]
    return fitting[:top] if top > 0 else fitting, result.rejected_strategies()


def _size(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_table(result: PlanResult, top: int = 10, rules: Sequence[str] = ()) -> str:
    """The human-readable report: inputs, the split rules' sources, ranked layouts, rejected strategies,
    best breakdown."""
    m, hw, best = result.model, result.hardware, result.best
    units = _units(result)
    mem_scale, mem_unit, sec_scale, sec_unit = units
    nodes = max(1, hw.num_devices // hw.node_size)
    lines = [f"model     {_size(m.num_params)} params: {m.num_layers} layers x {m.hidden_size} hidden, "
             f"{m.heads} heads, seq {m.seq_len}, vocab {m.vocab_size}; {result.optimizer}/{result.precision}, "
             f"global batch {result.global_batch}"]
    if m.is_moe:
        lines.append(f"          Mixture of Experts: {m.num_experts} experts, top-{m.experts_per_token}, in "
                     f"{m.moe_layers} of {m.num_layers} layers; {_size(m.expert_params)} expert params, "
                     f"{_size(m.active_params)} active per token; routing imbalance {result.moe_imbalance:g}")
    if not m.counted_exactly:
        lines.append("          parameter count estimated: the config does not say everything (norms, biases or "
                     "the MLP gate of an unknown model type were taken as Llama's); give --params to override")
    lines += [f"          {line}" for line in rules]
    shown, rejected = _shown(result, top)
    width = max([18] + [len(c.strategy) for c in shown + rejected])
    lines += [
             f"hardware  {hw.num_devices} device{'s' * (hw.num_devices > 1)} ({nodes} "
             f"node{'s' * (nodes > 1)} x {hw.node_size}), "
             f"{hw.memory_per_device / 1e9:.1f} GB each, intra {hw.intra_node_bandwidth / 1e9:.0f} GB/s, "
             f"inter {hw.inter_node_bandwidth / 1e9:.1f} GB/s, {hw.peak_flops / 1e12:.0f} TFLOP/s x "
             f"{hw.efficiency:.2f}",
             f"{len(result.candidates)} candidates, {len(result.fitting)} fit; fastest per layout "
             f"(* = best):", "",
             f"  {'strategy':<{width}} {'dp':>4} {'tp':>3} {'pp':>3}" + (f" {'ep':>3}" if m.is_moe else "")
             + f" {'zero':>4} {'m':>5} {'mbs':>4} {'ckpt':>4} "
             f"{'mem ' + mem_unit:>7} {'step ' + sec_unit:>9} {'comm':>5}  verdict"]
    lines += [_row(c, "*" if c is best else " ", units, m.is_moe, width) for c in shown]
    if rejected:
        lines += ["", "rejected strategies (smallest memory of each):"]
        lines += [_row(c, " ", units, m.is_moe, width) for c in rejected]
    mem = best.memory
    parts = ", ".join(f"{k} {getattr(mem, k) / mem_scale:.1f}" for k in _PARTS)
    lines += ["", f"best: {best.strategy} ({best.describe()}), micro-batch {best.micro_batch_size}: "
                  f"{mem.total / mem_scale:.1f} {mem_unit}/device ({parts} {mem_unit})",
              *([f"      all-to-all: {best.comm_bytes.expert_parallel / mem_scale:.2f} {mem_unit} sent per "
                 f"device per step (ep={best.ep})"] if best.ep > 1 else []),
              f"      {best.step_time / sec_scale:.2f} {sec_unit}/step = compute "
              f"{best.compute_time / sec_scale:.2f} {sec_unit} + exposed comm "
              f"{best.exposed_comm_time / sec_scale:.2f} {sec_unit} (of {best.comm_time / sec_scale:.2f} {sec_unit}), "
              f"{result.global_batch * m.seq_len / best.step_time:,.0f} tokens/s",
              f"      checkpoint: {best.checkpoint_bytes / mem_scale:.1f} {mem_unit} written per device "
              f"(parameters and optimizer state, {best.checkpoint_bytes * hw.num_devices / mem_scale:.1f} "
              f"{mem_unit} in all)"]
    return "\n".join(lines)


def plot_memory(result: PlanResult, path: str, top: int = 10) -> None:
    """Save stacked per-device memory bars of the listed strategies with a device-memory line."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ShardwiseError("--plot needs matplotlib: pip install matplotlib") from exc
    shown, rejected = _shown(result, top)
    rows = shown + rejected
    fig = Figure(figsize=(max(6.0, 0.7 * len(rows) + 2), 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for part in _PARTS:
        heights = [getattr(c.memory, part) / 1e9 for c in rows]
        ax.bar(xs, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    limit = result.hardware.memory_per_device / 1e9
    ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"device memory {limit:.0f} GB")
    ax.set_xticks(xs, [("* " if c is result.best else "") + f"{c.strategy}\n{c.dp}/{c.tp}/{c.pp} z{c.zero}"
                       for c in rows], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("GB per device")
    top_gb = min(max(bottom + [limit]) * 1.08, limit * 3)
    ax.set_ylim(0, top_gb)
    for x, total in zip(xs, bottom):  # totals; bars above the axis are clipped
        ax.text(x, min(total, top_gb * 0.97), f"{total:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_title(f"{result.model.num_params / 1e9:.1f}B params on {result.hardware.num_devices} devices "
                 "(dp/tp/pp, ZeRO stage)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def model_spec(args: argparse.Namespace, config: Optional[dict] = None) -> ModelSpec:
    """The model of parsed ``plan`` options: from ``--model`` (a preset or config file; ``config`` if
    already loaded) or ``--params``."""
    if args.model is None:
        return ModelSpec.from_params(args.params, seq_len=_SEQ_LEN if args.seq_len is None else args.seq_len,
                                     vocab_size=_VOCAB if args.vocab is None else args.vocab,
                                     num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads)
    given = [flag for name, flag in _SHAPE_OPTIONS if getattr(args, name) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} cannot be combined with --model, which sets the shape: "
                          "edit the config or use --params")
    return ModelSpec.from_hf_config(config if config is not None else load_hf_config(args.model),
                                    seq_len=args.seq_len)


def _gbps(gbit_per_s: Optional[float], otherwise: str) -> str:
    """A ``--*-gbps`` number as a bandwidth ``Hardware.parse`` reads, else the other flag's value."""
    if gbit_per_s is None:
        return otherwise
    if not gbit_per_s > 0:
        raise ConfigError(f"a bandwidth in Gbit/s must be positive, got {gbit_per_s:g}")
    return f"{gbit_per_s:g}Gbps"


def run(args: argparse.Namespace) -> int:
    """Run ``shardwise plan`` with parsed ``args``; print the table or JSON."""
    config = load_hf_config(args.model) if args.model is not None else None
    model = model_spec(args, config)
    rules = rule_lines(config, is_moe=model.is_moe, detail=args.rules) if config is not None else []
    hardware = Hardware.parse(num_devices=args.devices,
                              memory_per_device=args.device_memory, devices_per_node=args.devices_per_node,
                              intra_node_bandwidth=_gbps(args.intra_node_gbps, args.intra_node),
                              intra_node_latency=args.intra_latency,
                              inter_node_bandwidth=_gbps(args.inter_node_gbps, args.interconnect),
                              inter_node_latency=args.inter_latency,
                              peak_flops=args.flops, efficiency=args.efficiency)
    result = plan(model, hardware, global_batch=args.global_batch, optimizer=args.optimizer,
                  precision=args.precision, overlap=args.overlap, max_micro_batches=args.max_micro_batches,
                  moe_imbalance=args.moe_imbalance)
    if args.plot:
        plot_memory(result, args.plot, args.top)
    if args.json:
        doc = result.to_dict(args.top if args.top > 0 else None)
        if config is not None:
            doc["rules"] = rules
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(result, args.top, rules))
        if args.plot:
            print(f"memory plot written to {args.plot}")
    return 0

