"""The planner's analytic cost model: memory and step time of one parallel configuration.

Memory per device: model states from :mod:`shardwise.core.memory` for the parameters a
model-parallel rank holds, ZeRO-partitioned over ``dp``: ``1 / (tp·pp)`` of the blocks, plus
the stage's token table or LM head, replicated over tp unless ``vocab_parallel`` splits them
by vocabulary. Activations from Korthikanti et al. (arXiv 2205.05198),
``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` bytes per layer and micro-batch in 16-bit, or
``s·b·h·(34/t + 5·a·s/(h·t))`` with sequence parallelism (only the ``s·b·h`` layer input, or
its ``1/t`` sequence part, with full recomputation, plus one layer's working set), times
``min(pp, m)`` micro-batches in flight under 1F1B, plus fp32 logits; a model whose
implementation was counted (``ModelSpec.saved_activations``, e.g. the Hugging Face GPT-2 and
Llama blocks) uses that count instead, its replicated part divided by ``t`` under sequence
parallelism, and three fp32 copies of the full logits on every tp rank (logits, shifted
copy, log-softmax), or two of the rank's ``V/t`` slice with ``vocab_parallel`` (the slice
and its softmax); one fp32 copy (``V/t`` wide with ``vocab_parallel``) for a model
without a counted implementation. Buffers are two gradient buckets (or
all gradients, if fewer), ZeRO-3's two gathered layers and the pipeline's send/receive
tensors. Time: ``6·Ψ·tokens`` FLOPs (8 with recomputation) at
``peak x efficiency``, stretched by the 1F1B bubble; ring collectives under an
alpha-beta model (ranks that share compute units, ``Hardware.compute_units_per_node``,
take turns: the step is at least the whole node's work over its units, and a
pipeline bubble is another rank's compute time), tensor parallelism on the intra-node link
(sequence parallelism's reduce-scatter + allgather move the allreduce's bytes), data and
pipeline groups on the inter-node link once they span nodes. Gradient communication hides
behind backward up to ``overlap``; tensor- and pipeline-parallel transfers are
exposed. Attention FLOPs, kernel efficiency at small micro-batches and
fragmentation are not modelled. With ``pp = 1``, ``m > 1`` is gradient accumulation;
ZeRO-2 reduce-scatters and ZeRO-3 gathers once per micro-batch.

A Mixture-of-Experts model counts ``6·Ψ_active·tokens`` FLOPs (its dense part and
``experts_per_token`` experts per MoE layer), and with ``ep > 1`` (expert parallelism, inside
``dp``) its routed experts are split over the ep ranks, their states partitioned over the
``dp / ep`` expert-data-parallel ranks under ZeRO, with the all-to-alls and the routing
imbalance of :mod:`.moe_cost`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ConfigError
from .hardware import Hardware
from .memory import DtypePolicy, model_state_bytes
from .model_spec import ModelSpec
from .moe_cost import expert_cost
from .pipeline import bubble_fraction

__all__ = ["MemoryBreakdown", "CommBytes", "Candidate", "estimate"]


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Peak bytes per device, by kind."""

    params: int
    """Training-dtype parameters."""
    grads: int
    """Training-dtype gradients."""
    optimizer: int
    """fp32 master copy plus optimizer moments."""
    activations: int
    """Activations saved for backward, plus the output logits."""
    buffers: int
    """Communication buckets, ZeRO-3 gathered layers, pipeline send/receive tensors."""
    total: int = field(init=False)
    """The sum of the five."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.params + self.grads + self.optimizer
                           + self.activations + self.buffers)


@dataclass(frozen=True, kw_only=True)
class CommBytes:
    """Bytes one device sends per training step, by parallel dimension."""

    data_parallel: int
    """Gradient allreduce or ZeRO reduce-scatter / allgather traffic."""
    tensor_parallel: int
    """Megatron activation allreduces."""
    pipeline: int
    """Point-to-point activations and gradients between stages."""
    expert_parallel: int = 0
    """All-to-all dispatch and combine of the tokens' rows to and from their experts (busiest rank)."""
    context_parallel: int = 0
    """Ring attention's key/value blocks (and, backward, their gradients) passed around the cp group."""

    @property
    def total(self) -> int:
        """All bytes sent."""
        return self.data_parallel + self.tensor_parallel + self.pipeline + self.expert_parallel + self.context_parallel


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One parallel configuration and its modelled cost."""

    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree (within a node)."""
    pp: int
    """Pipeline-parallel stages."""
    zero: int
    """ZeRO stage over the data-parallel group (0 = plain data parallelism)."""
    micro_batches: int
    """Micro-batches per step: pipeline micro-batches, or gradient accumulation when ``pp == 1``."""
    micro_batch_size: int
    """Sequences per micro-batch per data-parallel replica."""
    checkpointing: bool
    """Full activation recomputation (only layer inputs are kept)."""
    sequence_parallel: bool = False
    """Activations outside the tensor-parallel regions split along the sequence over tp."""
    vocab_parallel: bool = False
    """Token table and LM head split by vocabulary over tp; the loss from the logits slices."""
    ep: int = 1
    """Expert-parallel degree inside ``dp`` (Mixture-of-Experts models): each rank keeps ``1 / ep`` of the
    routed experts."""
    dp_replicate: int = 1
    """Hybrid sharding: ZeRO shards within groups of ``dp // dp_replicate`` ranks (one node's) and
    averages the reduced gradients across the ``dp_replicate`` groups."""
    cp: int = 1
    """Context parallelism inside ``dp``: groups of ``cp`` data-parallel ranks split each sequence
    (ring attention passes the key/value blocks around the group)."""
    memory: MemoryBreakdown
    """Peak memory per device."""
    comm_bytes: CommBytes
    """Bytes sent per device per step."""
    compute_time: float
    """Seconds of compute per step, pipeline bubble included."""
    comm_time: float
    """Seconds of communication per step, hidden or not."""
    exposed_comm_time: float
    """Seconds of communication the step waits for."""
    step_time: float
    """``compute_time + exposed_comm_time``."""
    fits: bool
    """Whether ``memory.total`` fits in the device memory."""
    checkpoint_bytes: int = 0
    """Bytes one device writes per checkpoint: parameters, fp32 masters and optimizer state of the
    whole model (``ParallelModel.save_checkpoint`` spreads whole tensors over every rank)."""
    reason: str = ""
    """Verdict after ranking: ``"best"``, ``"slower: ..."`` or ``"does not fit: ..."``."""

    @property
    def comm_fraction(self) -> float:
        """Exposed communication as a share of the step."""
        return self.exposed_comm_time / self.step_time if self.step_time > 0 else 0.0

    @property
    def strategy(self) -> str:
        """Short name, e.g. ``"DP"``, ``"ZeRO-3"``, ``"ZeRO-1+TP+PP"``, ``"ZeRO-3+EP"``, ``"ZeRO-3+CP4"``,
        ``"single"``."""
        parts = [f"ZeRO-{self.zero}" if self.zero else "DP"] if self.dp > 1 else []
        parts += ["HSDP"] * (self.dp_replicate > 1)
        parts += [f"CP{self.cp}"] * (self.cp > 1)  # the degree: the table has no cp column
        parts += ["EP"] * (self.ep > 1)
        parts += ["TP"] * (self.tp > 1) + ["SP"] * self.sequence_parallel + ["VP"] * self.vocab_parallel
        parts += ["PP"] * (self.pp > 1)
        return "+".join(parts) or "single"

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """``(dp, tp, pp, zero)``."""
        return self.dp, self.tp, self.pp, self.zero

    def describe(self) -> str:
        """``"dp=8 tp=1 pp=1 zero=3 m=16 ckpt"`` (``ep=``, ``sp`` and ``vp`` for expert, sequence and
        vocabulary parallelism)."""
        hybrid = f" (shard {self.dp // self.dp_replicate} x replicate {self.dp_replicate})" * (self.dp_replicate > 1)
        return (f"dp={self.dp}{hybrid} tp={self.tp} pp={self.pp}" + f" ep={self.ep}" * (self.ep > 1)
                + f" cp={self.cp}" * (self.cp > 1)
                + f" zero={self.zero} m={self.micro_batches}"
                + " ckpt" * self.checkpointing + " sp" * self.sequence_parallel + " vp" * self.vocab_parallel)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, plus ``strategy``, ``comm_fraction`` and memory in GB."""
        out = asdict(self)
        out["memory_gb"] = {k: v / 1e9 for k, v in out["memory"].items()}
        out["comm_bytes"]["total"] = self.comm_bytes.total
        out.update(strategy=self.strategy, comm_fraction=self.comm_fraction)
        return out

def _checkpoint_bytes(num_params: int, policy: DtypePolicy, devices: int) -> int:
    """Bytes each device writes per checkpoint: the whole model's parameters and optimizer state, spread."""
    whole = model_state_bytes(num_params, 1, 0, policy=policy)
    return -(-(whole.params + whole.optimizer_states) // devices)


def _dp_ops(zero: int, m: int, elements: int, policy: DtypePolicy) -> list[tuple[int, int, int, bool]]:
    """The data-parallel collectives of ``elements`` parameters: (phases, bytes, repeats, hideable)."""
    grads, params = elements * policy.grad_bytes, elements * policy.param_bytes
    if zero == 0:
        return [(2, grads, 1, True)]
    if zero in (1, 2):
        return [(1, grads, 1 if zero == 1 else m, True), (1, params, 1, False)]
    return [(1, params, 2 * m, True), (1, grads, m, True)]


def _ring(nbytes: float, group: int, link: tuple[float, float], phases: int, messages: int) -> float:
    """Alpha-beta seconds of a ring collective; ``phases`` is 2 for allreduce, 1 for (all)gather/scatter."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = link
    return phases * (group - 1) * (latency * messages + nbytes / (group * bandwidth))


def _int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def estimate(model: ModelSpec, hardware: Hardware, *, dp: int, tp: int = 1, pp: int = 1, zero: int = 0,
             micro_batches: int = 1, checkpointing: bool = False, sequence_parallel: bool = False,
             vocab_parallel: bool = False, global_batch: int,
             optimizer: str = "adam", precision: str = "bf16", overlap: float = 0.8,
             bucket_bytes: int = 25_000_000, ep: int = 1, moe_imbalance: float = 1.0,
             dp_replicate: int = 1, cp: int = 1) -> Candidate:
    """Model the memory and step time of one configuration (``reason`` is left empty).

    ``ep`` and ``moe_imbalance`` apply to a Mixture-of-Experts model (:mod:`.moe_cost`).
    ``dp_replicate > 1`` is hybrid sharding: the states sharded over ``dp // dp_replicate`` ranks,
    whose gathers and reduce-scatters run on that group's links (within a node when it fits in one),
    plus an all-reduce of each reduced gradient shard across the groups (on the inter-node links).
    ``cp > 1`` is context parallelism carved out of dp: ``dp // cp`` data replicas, each sequence split
    over ``cp`` ranks (activations of ``seq_len / cp`` tokens per sequence, ``cp`` times the sequences per
    replica), plus ring attention's key/value blocks passed around the group (forward and backward).
    """
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep), ("dp_replicate", dp_replicate), ("cp", cp),
                        ("micro_batches", micro_batches),
                        ("global_batch", global_batch), ("bucket_bytes", bucket_bytes)):
        _int(value, name)
    if dp * tp * pp != hardware.num_devices:
        raise ConfigError(f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} != {hardware.num_devices} devices")
    if dp % cp or (cp > 1 and (pp > 1 or ep > 1 or dp_replicate > 1 or sequence_parallel or vocab_parallel
                               or model.seq_len % (2 * cp))):
        raise ConfigError(f"cp={cp} must divide dp={dp} and 2*cp the sequence ({model.seq_len}), without "
                          "pipelines, experts, hybrid sharding or sequence/vocabulary parallelism")
    replicas = dp // cp
    if global_batch % (replicas * micro_batches):
        raise ConfigError(f"global batch {global_batch} is not divisible by dp*micro_batches = {dp}*{micro_batches}"
                          if cp == 1 else f"global batch {global_batch} is not divisible by (dp/cp)*micro_batches = "
                          f"{replicas}*{micro_batches}")
    if pp > model.num_layers:
        raise ConfigError(f"pp={pp} exceeds the model's {model.num_layers} layers")
    if dp % dp_replicate or (dp_replicate > 1 and (zero == 0 or ep > 1)):
        raise ConfigError(f"dp_replicate={dp_replicate} needs ZeRO (stage 1-3), no expert parallelism, and to "
                          f"divide dp={dp}")
    dp_shard = dp // dp_replicate
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0 <= overlap <= 1:
        raise ConfigError(f"overlap must be in [0, 1], got {overlap!r}")
    for name, flag in (("sequence_parallel", sequence_parallel), ("vocab_parallel", vocab_parallel)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if flag and tp == 1:
            raise ConfigError(f"{name} splits over tensor-parallel ranks, but tp=1")
    policy = DtypePolicy.of(precision, optimizer)
    m, ckpt, b = micro_batches, bool(checkpointing), global_batch // (replicas * micro_batches)
    experts = expert_cost(model, hardware, dp=dp, tp=tp, pp=pp, ep=ep, micro_batches=m, micro_batch_size=b,
                          checkpointing=ckpt, sequence_parallel=sequence_parallel, act_bytes=policy.param_bytes,
                          imbalance=moe_imbalance)
    # a rank holds seq_len / cp tokens of each of its replica's b sequences
    s, h, a, vocab = model.seq_len // cp, model.hidden_size, model.heads, model.vocab_size
    act = policy.param_bytes  # bytes of one activation element
    profile = model.saved_activations
    vocab_split = tp if vocab_parallel else 1
    seq_split = tp if sequence_parallel else 1
    # The largest stage: its share of the blocks plus the token table (first stage) or the head (last);
    # one stage holds both, and a tied head keeps a copy of the table on the last stage.
    dense_params = model.num_params - model.expert_params
    vocab_params = min(model.vocab_params, dense_params)
    stage_vocab = vocab * h if pp > 1 else vocab_params
    layers = -(-model.num_layers // pp)
    shard = -(-(dense_params - vocab_params) // (tp * pp)) + -(-stage_vocab // vocab_split)
    kv = int(model.num_kv_heads or a)
    if kv < tp:  # each key/value head replicated over tp / kv ranks: a rank keeps 1/kv of k and v, not 1/tp
        kv_width = h * kv // a
        shard += -(-(2 * h * kv_width * (tp - kv) * layers) // (kv * tp))
    states = model_state_bytes(shard, dp_shard, zero, policy=policy)
    if experts.params:  # the routed experts: 1/ep of them, their states partitioned over edp under ZeRO
        own = model_state_bytes(experts.params, experts.edp, zero, policy=policy)
        states = type(states)(params=states.params + own.params, grads=states.grads + own.grads,
                              optimizer_states=states.optimizer_states + own.optimizer_states)

    sbh = s * b * h
    if profile is None:
        per_token = 34 / tp if sequence_parallel else 10 + 24 / tp
        full_layer = sbh * (per_token + 5 * a * s / (h * tp)) * act / 2
        logits = 4 * s * b * vocab / vocab_split
    else:  # counted for the implementation: (replicated, tp-sharded) elements per token and hidden unit
        full_layer = sbh * (profile[0] / seq_split + profile[1] / tp) * act
        # fp32: the full logits, their shifted copy and the log-softmax; or the rank's slice and its softmax
        logits = 2 * 4 * s * b * vocab / tp if vocab_parallel else 3 * 4 * s * b * vocab
    in_flight = min(pp, m)
    layer_input = sbh * act / seq_split
    saved = layers * in_flight * (layer_input if ckpt else full_layer) + (full_layer if ckpt else 0)
    activations = int(saved + logits)
    # Data-parallel fusion buckets: two in flight, or all gradients when they fit in fewer. (Plain data
    # parallelism keeps a bucket buffer per bucket today; with more than two buckets that copy of
    # the gradients is not counted here.)
    fusion = min(2 * bucket_bytes, (shard + experts.params) * policy.grad_bytes)
    buffers = (fusion if dp > 1 else 0) + (2 * layer_input if pp > 1 else 0) + experts.buffers
    # ZeRO-3 holds its largest unit gathered plus that unit's full gradient: a transformer layer, or a
    # token table tied to the head (an untied table and head are gathered in chunks of about a layer),
    # whichever is larger. A meta-device build peaks at the same two units (one gathered, one being
    # materialized), never at the whole model.
    largest_unit = max(model.layer_params // tp + model.expert_layer_params // ep,
                       vocab * h // vocab_split if model.tied_embeddings else 0)
    buffers += 2 * largest_unit * policy.param_bytes if zero == 3 and dp_shard > 1 else 0
    memory = MemoryBreakdown(params=states.params, grads=states.grads, optimizer=states.optimizer_states,
                             activations=activations, buffers=buffers)

    flops = (8 if ckpt else 6) * model.active_params * global_batch * s
    ideal = flops / (hardware.num_devices * hardware.peak_flops * hardware.efficiency)
    ideal += experts.extra_flops / (hardware.peak_flops * hardware.efficiency)  # the busiest expert rank
    compute = ideal / (1 - bubble_fraction("1f1b", pp, m)) if pp > 1 else ideal
    # Ranks sharing compute units take turns; a pipeline bubble on one rank is another's compute time.
    compute = max(compute, ideal * hardware.sharing)
    backward = ideal * (6 / 8 if ckpt else 4 / 6)

    # data parallel / ZeRO: (phases, bytes, repeats, hideable), the dense states over dp and the
    # routed experts' over their edp group
    if zero == 0:
        window = backward / m
    elif zero in (1, 2):
        window = backward / m * (1 if zero == 1 else m)
    else:
        window = ideal
    hidden_time = exposed_time = 0.0
    dp_bytes = 0.0
    dense = [(shard, dp_shard, hardware.link(tp * dp_shard), _dp_ops(zero, m, shard, policy))]
    if dp_replicate > 1:  # each rank's reduced gradient shard, averaged over the groups (per reduction)
        dense.append((shard, dp_replicate, hardware.link(tp * dp),
                      [(2, -(-shard // dp_shard) * policy.grad_bytes, 1 if zero == 1 else m, True)]))
    moe = [(experts.params, experts.edp, hardware.link(tp * dp), _dp_ops(zero, m, experts.params, policy))]
    for elements, group, link, ops in dense + moe:
        for phases, nbytes, repeats, hideable in ops if group > 1 else []:
            messages = max(math.ceil(nbytes / bucket_bytes), layers if zero == 3 else 1)
            t = repeats * _ring(nbytes, group, link, phases, messages)
            if hideable:
                hidden_time += t
            else:
                exposed_time += t
            dp_bytes += repeats * phases * (group - 1) / group * nbytes
    dp_exposed = exposed_time + max(0.0, hidden_time - overlap * window)

    tp_count = layers * m * (6 if ckpt else 4)  # 2 fwd + 2 bwd allreduces per layer, +2 re-run fwd
    tp_time = tp_count * _ring(sbh * act, tp, hardware.link(tp), 2, 1)
    tp_bytes = tp_count * 2 * (tp - 1) / tp * sbh * act
    pp_bandwidth, pp_latency = hardware.link(hardware.num_devices)
    pp_time = 2 * m * (pp_latency + layer_input / pp_bandwidth) if pp > 1 else 0.0
    pp_bytes = int(2 * m * layer_input) if pp > 1 else 0

    # ring attention: per layer and micro-batch, cp - 1 hops of k and v forward, cp hops of k, v and their
    # fp32 gradients backward (+1 forward pass with recomputation), each hop this rank's block
    kv_block = 2 * s * b * (h * kv // a) * act
    cp_hops = layers * m * ((cp - 1) * (2 if ckpt else 1) * kv_block + cp * 2 * kv_block * 4 // act) if cp > 1 else 0
    cp_bandwidth, cp_latency = hardware.link(tp * cp)
    cp_time = cp_hops / cp_bandwidth + layers * m * (3 * cp) * cp_latency if cp > 1 else 0.0
    exposed = dp_exposed + tp_time + pp_time + experts.alltoall_time + (1 - overlap) * cp_time
    return Candidate(dp=dp, tp=tp, pp=pp, zero=zero, micro_batches=m, micro_batch_size=b,
                     checkpointing=ckpt, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel,
                     ep=ep, dp_replicate=dp_replicate, memory=memory,
                     cp=cp,
                     comm_bytes=CommBytes(data_parallel=int(dp_bytes), tensor_parallel=int(tp_bytes),
                                          pipeline=int(pp_bytes), expert_parallel=int(experts.alltoall_bytes),
                                          context_parallel=int(cp_hops)),
                     compute_time=compute,
                     comm_time=hidden_time + exposed_time + tp_time + pp_time + experts.alltoall_time + cp_time,
                     exposed_comm_time=exposed, step_time=compute + exposed,
                     fits=memory.total <= hardware.memory_per_device,
                     checkpoint_bytes=_checkpoint_bytes(model.num_params, policy, hardware.num_devices))
