"""``parallelize``: one call from a model, an optimizer class and a layout to a training step.

It builds the mesh groups, shards the blocks by the model family's tensor-parallel
rules, cuts the stages over the pipeline ranks with the balanced partitioner,
turns on per-block activation checkpointing, and wraps the optimizer in ZeRO (or
overlapped data-parallel gradient averaging). :meth:`ParallelModel.train_step`
then runs one optimizer step on a batch: the pipeline schedule when ``pp > 1``,
gradient accumulation, clipping of the global norm, and returns the batch loss.

The model passed in is consumed: its linears are replaced by sharded ones and the
parameters of stages that live on other pipeline ranks are freed.

A model built on the meta device (``with torch.device("meta"): ...``) is never
allocated whole: each rank materializes only its stages, its tensor-parallel
slices and (ZeRO-3) its partition, one unit at a time, with the values a normal
one-process build would have given them after the same seed (:mod:`.init_replay`),
or with pretrained weights read slice by slice (``weights=``, :mod:`.weights`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from ....checkpoint.agree import agree_loaded, stage_or_fail
from ....core.errors import ConfigError
from ....core.layer_partition import partition_layers
from ....core.layout import ParallelLayout
from ....core.tp_rules import FamilyRules
from ....core.pipeline import build_schedule
from ....core.zero import PartitionPlan
from ...torch.device_math import accumulation_dtype, clip_by_total_norm, unscale_and_flag
from ...torch.grad_sync import GradientSynchronizer
from ...torch.zero import ZeroOptimizer
from .context import ContextParallel
from .evaluate import eval_loss, full_logits
from .experts.sharding import is_expert_param, local_squared_norm
from .experts.training import ExpertTraining, pipeline_schedule
from .hf_conversion import ConvertedSource, is_hf_model, load_buffers, pretrained_source
from .init_replay import InitRecord, record_init
from .layout_spec import LayoutSpec, resolve_layout
from .master_weights import MasterWeightsOptimizer
from .materialize import DeviceLike, ModelTensors, is_meta_model, materialize_buffers, move_materialized, \
    resolve_build_device
from ....core.mesh_groups import ParallelGroups, build_groups
from .grad_average import average_gradients
from .pipeline import PipelineExecutor
from .sequence_parallel import apply_sequence_parallel
from .module_paths import get_module
from .stages import StageStack, WholeModel, block_units, causal_lm_loss, causal_lm_stages, \
    enable_block_checkpointing, model_family
from .tp_apply import apply_tensor_parallel, counts_once_over_tp, sum_partial_gradients
from .vocab_chunks import chunk_vocabulary, zero3_wrap
from .vocab_parallel import apply_vocab_parallel, vocab_parallel_lm_loss
from .weights import DeferredFailures, InitSource, PathLike, SafetensorsSource, WeightSource
from ....context import current

__all__ = ["parallelize", "ParallelModel"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: Module pattern -> Hugging Face tensor-parallel style ("colwise", "rowwise", ..., None to keep it whole).
TPPlan = Mapping[str, Optional[str]]


def _stage_cost(stage: nn.Module) -> float:
    """Matmul parameters of a stage (embedding lookups cost ~nothing); at least 1."""
    cost = sum(p.numel() for m in stage.modules() if not isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False))
    return float(max(cost, 1))


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _unique(params: Any) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for p in params if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]


class ParallelModel:
    """This rank's part of a parallelized model, its optimizer, and the training step."""

    def __init__(self, model: nn.Module, optimizer_class: type, layout: ParallelLayout, groups: ParallelGroups,
                 loss_fn: Optional[LossFn], optimizer_kwargs: dict[str, Any],
                 weights: Optional[PathLike] = None, device: Optional[DeviceLike] = None,
                 tp_plan: Optional[TPPlan] = None) -> None:
        self.layout, self.groups = layout, groups
        self.config = getattr(model, "config", None)
        meta = is_meta_model(model)
        self._device = resolve_build_device(model, device)
        source: Optional[WeightSource] = pretrained_source(weights, model, groups.world) if weights else None
        #: The model passed in, for transformers' own renaming of its tensors in ``save_pretrained``.
        self.hf_root: Optional[nn.Module] = model if is_hf_model(model) else None
        record = _record(model, groups, draw=source is None) if meta else None
        if record is not None:
            materialize_buffers(model, record, self._device)
            move_materialized(model, self._device)
            source = source or InitSource(record)
        family, split_whole = self._family(model, layout, tp_plan, loss_fn)
        #: Context parallelism (cp > 1): the attention over the group's whole sequence, the batch split.
        self.context: Optional[ContextParallel] = None
        if groups.cp is not None:
            if loss_fn is not None:
                raise ConfigError("context parallelism computes the causal LM loss over the split sequence itself; "
                                  "it takes no loss_fn=")
            self.context = ContextParallel(groups.cp, layout.cp_attention)
            self.context.install(model, tp=layout.tp)
            # trained whole, so that the model's own forward takes the chunks' positions; with tp its
            # linears are split by the family's rules first
            family, split_whole = (family, True) if layout.tp > 1 else (None, False)
        #: The model runs as one stage through its own forward: no split rules (data parallelism, ZeRO),
        #: or tensor parallelism alone on blocks that cannot be stages of their own.
        whole = family is None and not isinstance(model, nn.Sequential) or split_whole
        self.loss_fn: LossFn = loss_fn or causal_lm_loss
        self.causal = loss_fn is None
        if layout.precision in _DTYPES:
            model.to(_DTYPES[layout.precision])
        if family is not None:
            apply_tensor_parallel(model, family, groups.tp, on_free=groups.on_free)
            if layout.vocab_parallel:
                start, _, vocab = apply_vocab_parallel(model, family, groups.tp)
                if loss_fn is None:
                    self.loss_fn = functools.partial(vocab_parallel_lm_loss, tp_comm=groups.tp, start=start,
                                                     vocab_size=vocab)
            if layout.zero_stage == 3 and layout.pp == 1:  # gather the vocabulary tables a chunk at a time
                block = get_module(model, family.blocks)[0]
                chunk_vocabulary(model, family, sum(p.numel() for p in block.parameters()))
        #: Expert parallelism (ep > 1) and the global router load-balancing loss of MoE models.
        self.moe = ExpertTraining(model, layout, groups)
        #: Canonical (one-process) name and placement of every parameter of the model.
        self.tensors = ModelTensors(model, self._device)
        if isinstance(source, SafetensorsSource):
            stage_or_fail(groups.world, lambda: source.check(self.tensors.expected), f"weights {weights}")
            if isinstance(source, ConvertedSource):  # persistent buffers (DeepSeek-V3's score-correction bias)
                load_buffers(model, stage_or_fail(groups.world, source.buffer_values, f"weights {weights}"))
            source = DeferredFailures(source)
        if family is not None and not split_whole:
            stages, blocks = causal_lm_stages(model, family)
            if layout.sequence_parallel:
                apply_sequence_parallel(stages, blocks, family, groups.tp)
        elif whole:
            stages, blocks = [WholeModel(model, hf=loss_fn is None)], [False]
            if layout.activation_checkpointing:
                enable_block_checkpointing(model)
        else:
            stages = list(model)
            blocks = [any(True for _ in s.parameters()) for s in stages]
        ckpt = [b and layout.activation_checkpointing for b in blocks]
        chunks = layout.pp * layout.virtual_stages
        ranges = partition_layers([_stage_cost(s) for s in stages], chunks)
        mine = [ranges[c * layout.pp + groups.pp_rank] for c in range(layout.virtual_stages)]
        self.chunks = [StageStack([stages[i] for i in r], [ckpt[i] for i in r]) for r in mine]
        self.stage_ranges = mine
        self.module: nn.Module = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        self.params = _unique(self.module.parameters())
        self.moe.keep_local(self.params)
        self._find_tied(stages, ranges)
        self._free_other_stages(stages, mine)
        self._scale = 1.0 / layout.gradient_accumulation_steps
        if source is not None and (layout.zero_stage != 3 or not meta):
            self.tensors.fill(self.module.parameters(), source, only_meta=meta)
        if family is not None and groups.tp.size > 1 and not layout.sequence_parallel and not split_whole:
            hidden = getattr(self.config, "hidden_size", None) or getattr(self.config, "n_embd", None)
            mine_blocks = [stages[i] for r in mine for i in r if blocks[i]]
            if isinstance(hidden, int) and not (meta and layout.zero_stage == 3):
                #: Paths (inside a block) of whole parameters found to see split activations: summed over tp.
                self.partial_over_tp = sum_partial_gradients(mine_blocks, groups.tp, hidden)
        self._build_optimizer(optimizer_class, optimizer_kwargs, self.tensors.materializer(source) if meta else None)
        if meta:  # parameters no ZeRO-3 unit took (frozen ones)
            self.tensors.fill(self.module.parameters(), source)
        if isinstance(source, DeferredFailures):
            source.inner.close()
            agree_loaded(groups.world, source.failure, f"weights {weights}")
        self.executor: Optional[PipelineExecutor] = None
        if layout.pp > 1:
            balance = self.moe.for_pipeline(self._device, lambda: self._scale * self.loss_scale)
            schedule = build_schedule(pipeline_schedule(layout, balance is not None), layout.pp,
                                      layout.micro_batches, layout.virtual_stages)
            dtype = _DTYPES.get(layout.precision, torch.get_default_dtype())
            # ZeRO takes gradients from autograd's hooks, and a sequence-parallel linear computes its own:
            # no weight gradients deferred past them
            self.executor = PipelineExecutor(self.chunks, schedule, groups.pp, self._scaled_loss,
                                             activation_dtype=dtype, down_comm=groups.pp_down,
                                             fuse_weight_grads=not (layout.zero_stage or layout.sequence_parallel),
                                             balance=balance)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _family(model: nn.Module, layout: ParallelLayout, tp_plan: Optional[TPPlan],
                loss_fn: Optional[LossFn]) -> tuple[Optional[FamilyRules], bool]:
        """The split rules of ``model``; None where the layout needs none (data parallelism and ZeRO
        train any module whole). :class:`ConfigError` where it needs them and the model has none.
        And whether the model, split by them, runs whole through its own forward: tensor parallelism
        alone (no pipeline, sequence or vocabulary split) on blocks that cannot be stages of their
        own (Gemma 3n's per-layer inputs)."""
        needs = [name for name, on in (("tensor parallelism", layout.tp > 1), ("pipeline parallelism", layout.pp > 1),
                                       ("sequence_parallel", layout.sequence_parallel),
                                       ("vocab_parallel", layout.vocab_parallel)) if on]
        try:
            family = model_family(model, tp_plan)
        except ConfigError:
            if needs or tp_plan:
                raise
            family = None
        if family is None and needs and not (isinstance(model, nn.Sequential) and needs == ["pipeline parallelism"]):
            raise ConfigError(f"{' and '.join(needs)} need(s) a model with split rules (a Hugging Face causal LM "
                              f"with a plan, or GPT-2); {type(model).__name__} has none")
        split_whole = False
        if family is not None and family.generic and needs in ([], ["tensor parallelism"]) \
                and not (tp_plan and not needs):
            try:  # data parallelism, ZeRO and tp alone can train the model whole where its blocks cannot be stages
                causal_lm_stages(model, family)
            except ConfigError:
                if needs:
                    split_whole = True
                else:
                    family = None
        if family is None and loss_fn is None and not hasattr(model, "config"):
            raise ConfigError(f"a {type(model).__name__} that is not a Hugging Face causal LM needs loss_fn=")
        return family, split_whole

    @staticmethod
    def _free_other_stages(stages: Sequence[nn.Module], mine: Sequence[range]) -> None:
        local = {id(p) for r in mine for i in r for p in stages[i].parameters()}
        for i, stage in enumerate(stages):
            if any(i in r for r in mine):
                continue
            for p in stage.parameters():
                if id(p) not in local:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _find_tied(self, stages: Sequence[nn.Module], ranges: Sequence[range]) -> None:
        """Parameters held by several pipeline ranks (tied embeddings), in one order on every rank.

        For each: the parameter (``None`` where this rank does not hold it), its shape, and
        the first pipeline rank holding it (the one that counts it in the gradient norm).
        """
        holders: dict[int, set[int]] = {}
        order: dict[int, nn.Parameter] = {}
        for c, r in enumerate(ranges):
            for i in r:
                for p in stages[i].parameters():
                    holders.setdefault(id(p), set()).add(c % self.layout.pp)
                    order.setdefault(id(p), p)
        local = {id(p) for p in self.params}
        self._tied = [(p if id(p) in local else None, tuple(p.shape), p.dtype, min(holders[k]))
                      for k, p in order.items() if len(holders[k]) > 1]

    def _build_optimizer(self, optimizer_class: type, kwargs: dict[str, Any], materialize: Any) -> None:
        layout, dp = self.layout, self.groups.dp
        self._sync: Optional[GradientSynchronizer] = None
        if layout.zero_stage:
            # One ZeRO-3 unit per stage, and per table of an embedding stage (token and position
            # embeddings are gathered, and their gradients reduced, one table at a time).
            stages = [m for m in (self.chunks[0].stages if layout.pp == 1 else [])]
            wrap = [u for m in stages for u in (block_units(m) if isinstance(m, WholeModel) else zero3_wrap(m))
                    if any(True for _ in u.parameters())]
            pipeline = layout.pp > 1
            # A pipeline runs one backward per micro-batch and chunk and scales the loss itself;
            # a parameter tied across stages gets a unit of its own, the same on both stages.
            passes = layout.gradient_accumulation_steps * (layout.micro_batches * layout.virtual_stages
                                                           if pipeline else 1)
            tied = [p for p, _, _, _ in self._tied if p is not None]
            # hybrid sharding: ZeRO shards within the shard group, gradients averaged across the groups
            zero = self.groups.zero
            self.optimizer: torch.optim.Optimizer = ZeroOptimizer(
                self.module, optimizer_class, stage=layout.zero_stage, comm=zero,
                replicate_comm=self.groups.dp_replicate,
                clip_grad_norm=layout.gradient_clipping or None, offload_optimizer=layout.offload_optimizer,
                bucket_cap_bytes=layout.bucket_bytes, wrap=wrap or None, gradient_accumulation_steps=passes,
                materialize=materialize, isolate=tied, scale_accumulated=not pipeline,
                loss_scaler=layout.loss_scaler(),
                fuse_weight_grads=not (pipeline or layout.sequence_parallel),
                norm_comm=self.groups.world if self.groups.world.size > zero.size else None,
                norm_counted=self._counts_in_norm,
                # expert parallelism: this rank's experts are partitioned over their expert-data-parallel
                # group, and their gradients, averaged over it, divided by ep (the dp-mean loss's)
                expert_params=self.moe.experts, expert_comm=self.groups.edp,
                expert_grad_scale=1.0 / layout.ep, **kwargs)
            return
        if layout.precision in _DTYPES:  # fp32 masters; fp16 with a dynamic loss scale
            self.optimizer = MasterWeightsOptimizer(self.params, optimizer_class, layout.loss_scaler(), **kwargs)
        else:
            self.optimizer = optimizer_class(self.params, **kwargs)
        if layout.pp == 1 and dp.size > 1:
            named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and not is_expert_param(p)]
            self._sync = GradientSynchronizer(named, dp, bucket_cap_bytes=layout.bucket_bytes,
                                              backward_passes_per_step=layout.gradient_accumulation_steps)

    # -------------------------------------------------------------------- step
    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (fp16's dynamic loss scale, else 1)."""
        scaler = getattr(self.optimizer, "loss_scaler", None)
        return scaler.scale if scaler is not None else 1.0

    def _scaled_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(out, target) * (self._scale * self.loss_scale)

    def shard_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's data-parallel slice of a global batch (equal slices along dim 0); the ranks of a
        context-parallel group get the same slice (each trains on its chunks of those sequences)."""
        dp, cp = self.groups.dp, self.groups.cp_size
        replicas = dp.size // cp
        if batch.shape[0] % replicas:
            raise ConfigError(f"global batch of {batch.shape[0]} does not split over dp={dp.size}"
                              + (f" / cp={cp} = {replicas} data replicas" if cp > 1 else ""))
        return batch.chunk(replicas)[dp.rank // cp]

    def train_step(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> float:
        """One optimizer step on this replica's batch; returns the loss averaged over the global batch.

        ``inputs`` (and ``targets``; for a causal LM they default to the inputs, shifted
        inside the loss) hold this data-parallel rank's samples and are the same on
        every rank of its pipeline and tensor-parallel groups.
        """
        if targets is None:
            if not self.causal:
                raise ConfigError("train_step needs targets when the model has its own loss_fn")
            targets = inputs
        k = self.layout.gradient_accumulation_steps
        if inputs.shape[0] % k or targets.shape[0] != inputs.shape[0]:
            raise ConfigError(f"batch of {inputs.shape[0]} samples (targets {targets.shape[0]}) does not split "
                              f"into gradient_accumulation_steps={k}")
        m = self.layout.micro_batches
        if self.executor is not None and (inputs.shape[0] // k) % m:
            # checked on every rank: a middle pipeline stage never sees the batch split, and would wait
            raise ConfigError(f"batch of {inputs.shape[0]} samples does not split into gradient_accumulation_steps="
                              f"{k} x micro_batches={m}")
        device = self.device
        total = torch.zeros((), dtype=accumulation_dtype(device), device=device)  # read once, in _report
        scale = self.loss_scale
        for x, t in zip(inputs.chunk(k), targets.chunk(k)):
            if self.executor is not None:
                loss = self.executor.step(x, t)
                if loss is not None:
                    total += loss.detach().to(device, total.dtype).reshape(()) / scale
                    if self.executor.balance is not None:  # the step's load-balancing loss, met over the stages
                        total += self.executor.balance.value.to(device, total.dtype) * self._scale
            elif self.context is not None:
                loss = self._context_loss(x, t)
                (loss * (scale if self.layout.zero_stage else self._scale * scale)).backward()
                total += loss.detach().to(device, total.dtype) * self._scale
            else:
                self.moe.start_forward()
                loss = self.moe.add_balance(self.loss_fn(self.module(x), t))
                # ZeRO averages over its accumulation window itself; plain DP sums, so scale here.
                (loss * (scale if self.layout.zero_stage else self._scale * scale)).backward()
                total += loss.detach().to(device, total.dtype) * self._scale
        if self._finish_gradients():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._report(total)

    def _context_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Context parallelism: this rank's chunks through the model at their global positions, and its share
        of the mean token loss (see :meth:`ContextParallel.loss`)."""
        context = self.context
        assert context is not None
        ids, positions, labels = context.split(inputs, targets)
        calls = context.calls
        logits = self.module(ids, position_ids=positions)
        if context.calls == calls:
            raise ConfigError(f"{type(self.hf_root or self.module).__name__}'s forward never called the attention "
                              "function context parallelism installed: its attention does not go through "
                              "transformers' AttentionInterface")
        return context.loss(logits, labels, inputs.shape[1])

    def eval_step(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> float:
        """The loss of this replica's batch under the current parameters, averaged over the global
        batch like :meth:`train_step`'s, with no update: no gradient, optimizer, loss-scale or
        generator state changes, and dropout is off (eval mode; each module's mode is restored).
        Batches as :meth:`train_step` takes them; collective."""
        self._refuse_context("eval_step")
        return eval_loss(self, inputs, targets)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output (``[batch, seq, vocab]`` logits for a causal LM, the whole vocabulary)
        for this replica's batch, on every rank of its pipeline and tensor-parallel groups; forward
        only, in eval mode, nothing changes. ``inputs`` as :meth:`train_step` takes them; collective."""
        self._refuse_context("logits")
        return full_logits(self, inputs)

    def _refuse_context(self, what: str) -> None:
        if self.context is not None:
            raise ConfigError(f"{what} is not supported with context parallelism (cp={self.layout.cp}) yet: the "
                              "attention is split over the cp group only inside train_step")

    def _counts_in_norm(self, p: nn.Parameter) -> bool:
        """Whether this rank counts ``p`` in the global gradient norm: a parameter replicated over
        tensor parallelism on its first rank (a replicated key/value head on the first of its
        replicas), one held by several stages on the first of them."""
        if not counts_once_over_tp(p, self.groups.tp_rank):
            return False
        return not any(p is q and first != self.groups.pp_rank for q, _, _, first in self._tied)

    def _finish_gradients(self) -> bool:
        """Reduce, and (without ZeRO) unscale, check and clip the gradients; False: skip this step."""
        if self.layout.zero_stage:
            if self._tied:
                self._sum_tied_shards()
            return True  # unscaled, checked, clipped and stepped inside ZeroOptimizer
        if self._sync is not None:
            self._sync.synchronize()
        if self._tied:
            self._sum_tied()
        if self.layout.pp > 1:
            average_gradients([p for p in self.params if not is_expert_param(p)], self.groups.dp)
        self.moe.reduce_gradients()
        if isinstance(self.optimizer, MasterWeightsOptimizer):
            pairs = self.optimizer.take_gradients()
            scaler = self.optimizer.loss_scaler
            if scaler.dynamic:
                flag = unscale_and_flag([g for _, g in pairs], 1.0, self.device)  # checks only (scale 1)
                bad = bool(self.groups.world.allreduce(flag, "max")[0])
                if not scaler.update(bad):
                    return False  # the same decision on every rank
        if self.layout.gradient_clipping:
            self._clip_on_device(self.layout.gradient_clipping)
        return True

    @torch.no_grad()
    def _sum_tied(self) -> None:
        """Sum the gradients of parameters held by several pipeline ranks (e.g. tied embeddings)."""
        for p, shape, dtype, _ in self._tied:
            if p is not None:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            else:
                g = torch.zeros(shape, dtype=dtype, device=self.device)
            summed = self.groups.pp.allreduce(g.contiguous(), "sum")
            if p is not None:
                p.grad = summed.view_as(p)

    @torch.no_grad()
    def _sum_tied_shards(self) -> None:
        """ZeRO: sum over the stages the reduced gradient shards of a parameter several stages hold.

        Each such parameter is a unit of its own (``isolate``), so its shard covers the same
        elements on every stage; stages that do not hold it add zeros of that shard's size.
        """
        units = {id(u.params[0]): u for u in self.optimizer.units if len(u.params) == 1}
        dp = self.groups.zero
        for p, shape, _, _ in self._tied:
            unit = units.get(id(p)) if p is not None else None
            if unit is not None:
                grad = unit.master.grad if unit.master.grad is not None else torch.zeros_like(unit.master)
            else:
                start, end = PartitionPlan.build([("tied", shape)], dp.size).owned_range(dp.rank)
                grad = torch.zeros(end - start, dtype=torch.float32, device=self.optimizer.master_device)
            summed = self.groups.pp.allreduce(grad.contiguous(), "sum")
            if unit is not None:
                unit.master.grad = summed.to(unit.master.dtype).view_as(unit.master)

    def _gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, gradient the optimizer steps with) pairs: the fp32 master's with master weights."""
        if isinstance(self.optimizer, MasterWeightsOptimizer):
            return [(p, self.optimizer.master(p).grad) for p in self.params
                    if self.optimizer.master(p).grad is not None]
        return [(p, p.grad) for p in self.params if p.grad is not None]

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to a global L2 norm over every shard and stage; returns the norm."""
        return float(self._clip_on_device(max_norm))

    def _clip_on_device(self, max_norm: float) -> torch.Tensor:
        pairs = self._gradients()
        # an expert's squares count ep times: dp // ep replicas hold it, and the sum is divided by dp
        local = local_squared_norm([(p, g) for p, g in pairs if self._counts_in_norm(p)], self.layout.ep,
                                   self.device)
        total = self.groups.world.allreduce(local, "sum") / self.groups.dp.size
        return clip_by_total_norm([g for _, g in pairs], total, max_norm)

    @property
    def device(self) -> torch.device:
        """The device of this rank's parameters: where the step's own tensors (loss total, norms) live
        (for a model built on the meta device, the one ``parallelize`` materialized it on)."""
        return self._device

    def _report(self, total: torch.Tensor) -> float:
        loss = total.reshape(1)
        if self.layout.pp > 1:
            loss = self.groups.pp.broadcast(loss, root=self.groups.pp.size - 1)
        if self.groups.dp.size > 1:
            loss = self.groups.dp.allreduce(loss, "average")
        return float(loss[0])

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters (shards and local stages only)."""
        return list(self.params)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: PathLike, step: int, *, extra: Optional[dict] = None,
                        keep: Optional[int] = None, async_save: bool = False) -> Any:
        """Collective: save model, optimizer state, generator states and ``extra`` (e.g. the data
        position) as ``<directory>/ckpt-<step>``, atomically; it loads on any layout and world size.
        ``keep`` prunes all but the newest ``keep`` checkpoints. Returns the checkpoint's path.

        ``async_save=True`` returns once this rank's state is copied to host buffers, with a
        :class:`~shardwise.checkpoint.async_save.SaveHandle` (``.wait()`` -> path, ``.done()``);
        a background thread writes and commits it (the manifest last), so training goes on, and
        the checkpoint holds the state at this call. A save (or load, or :meth:`wait_checkpoint`)
        first finishes the one in flight, raising its error on every rank."""
        from ..checkpoint.parallel import save_parallel_checkpoint

        return save_parallel_checkpoint(self, directory, step, extra=extra, keep=keep, async_save=async_save)

    @functools.cached_property
    def checkpoint_saver(self) -> Any:
        """This model's :class:`~shardwise.checkpoint.async_save.BackgroundSaver` (made on first use),
        which :meth:`groups` ``.free()`` closes after waiting for the save in flight."""
        from ....checkpoint.async_save import BackgroundSaver
        from ..checkpoint.staging import HostStaging

        saver = BackgroundSaver(self.groups.world, HostStaging())
        self.groups.on_free(saver.close)
        return saver

    def wait_checkpoint(self) -> Any:
        """Collective: finish the background save in flight (``save_checkpoint(..., async_save=True)``),
        if any; returns its path (None: none in flight) or raises its error on every rank."""
        saver = self.__dict__.get("checkpoint_saver")
        return saver.wait() if saver is not None else None

    def load_checkpoint(self, path: PathLike, *, optimizer: bool = True) -> dict:
        """Collective-free: load a checkpoint (``ckpt-<step>``, or the newest complete one under
        ``path``), whatever layout saved it; returns its ``extra`` and ``"step"``. A background
        save in flight is finished first."""
        from ..checkpoint.parallel import load_parallel_checkpoint

        self.wait_checkpoint()
        return load_parallel_checkpoint(self, path, optimizer=optimizer)

    def save_pretrained(self, directory: PathLike) -> Any:
        """Collective: write the model as a Hugging Face directory (safetensors shards, index,
        ``config.json``) that ``from_pretrained`` loads without shardwise."""
        from ..checkpoint.parallel import save_pretrained

        return save_pretrained(self, directory)

    def __repr__(self) -> str:
        return (f"ParallelModel({self.layout.describe()}, rank {self.groups.world.rank}: stages "
                f"{[list(r) for r in self.stage_ranges]}, {sum(p.numel() for p in self.params)} parameters)")


def _record(model: nn.Module, groups: ParallelGroups, draw: bool) -> InitRecord:
    """Record the normal build of a meta ``model`` from rank 0's generator state (see :mod:`.init_replay`).

    Every rank then holds pieces of one and the same model, however it was seeded. With
    ``draw=False`` (pretrained weights replace the drawn values) the generator is left as it was.
    """
    state = groups.world.broadcast_object(torch.get_rng_state().numpy().tobytes(), root=0)
    if not draw:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
            return record_init(model)
    torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return record_init(model)


def parallelize(model: nn.Module, optimizer_class: type = torch.optim.AdamW, layout: LayoutSpec = "auto", *,
                loss_fn: Optional[LossFn] = None, tp: int = 1, pp: int = 1, seq_len: Optional[int] = None,
                global_batch: Optional[int] = None, weights: Optional[PathLike] = None,
                device: Optional[DeviceLike] = None, tp_plan: Optional[TPPlan] = None,
                **optimizer_kwargs: Any) -> ParallelModel:
    """Parallelize ``model`` over the job's ranks by ``layout`` and build its optimizer.

    ``layout`` is a :class:`~shardwise.core.layout.ParallelLayout`, a
    :class:`~shardwise.core.config.TrainingConfig`, a DeepSpeed config or
    ``shardwise plan --json`` result (dict or JSON path; ``tp``/``pp`` complete a
    config that has no mesh), or ``"auto"`` (the planner, given ``seq_len`` and
    ``global_batch``). ``optimizer_kwargs`` go to ``optimizer_class``.
    A ``model`` built on the meta device is materialized piece by piece on each rank,
    with the values of a normal build after the same seed (rank 0's generator state),
    or with ``weights``: a ``save_pretrained`` directory (``model.safetensors`` or a
    sharded index), of which each rank reads only the slices it keeps. Its keys are mapped as
    transformers' ``from_pretrained`` maps them (the model type's conversion mapping: a
    Mixture-of-Experts checkpoint's per-expert tensors are read as the fused experts, each rank
    reading only those of its own experts), and the model's persistent buffers are read too.
    ``device``: where a meta model's parameters and buffers are materialized and where ZeRO's
    shards and fp32 masters live (masters on the CPU with ``offload_optimizer="cpu"``). Default:
    this rank's bound CUDA device (``torch.cuda.current_device()``, ``cuda:local_rank`` after
    ``shardwise.init()``) when CUDA is available and the model is on the meta device; otherwise
    the device the model's parameters are on (the CPU for a meta model without CUDA). Values are
    computed (or read) on the CPU one piece at a time and each piece is then moved, so they are
    bit-identical to a one-process build and the host holds one piece at most. A model that is
    not on the meta device is not moved: ``device`` must then be the one it is on.
    Split rules: a Hugging Face causal LM is split by its own plans (``config.base_model_tp_plan``,
    ``base_model_pp_plan``); ``tp_plan`` (module pattern -> Hugging Face style, as
    ``from_pretrained(tp_plan=...)`` takes it, relative to the base model or not) adds to them or
    overrides them. Data parallelism and ZeRO need no rules: any ``nn.Module`` trains whole (a
    Hugging Face model with its causal LM loss, any other with ``loss_fn``).
    Collective: every rank calls it with the same arguments.
    """
    ctx = current()
    world = ctx.world
    resolved = resolve_layout(layout, world.size, tp=tp, pp=pp, model=model, seq_len=seq_len,
                              global_batch=global_batch, local_size=ctx.local_size)
    groups = build_groups(world, dp=resolved.dp, pp=resolved.pp, tp=resolved.tp, ep=resolved.ep,
                          dp_shard=resolved.dp_shard if resolved.hybrid else 0, cp=resolved.cp)
    return ParallelModel(model, optimizer_class, resolved, groups, loss_fn, dict(optimizer_kwargs), weights,
                         device, tp_plan)
