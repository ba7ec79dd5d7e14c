"""What ``parallelize`` does for Mixture-of-Experts models: one object, a few calls from the training step.

:class:`ExpertTraining` splits the experts over the ep group (``layout.ep > 1``, by the
model's ``base_model_ep_plan``), turns the expert gradients into those of the global
loss after backward (over the expert-data-parallel group), and adds the router
load-balancing loss over the global batch where the model's config asks for it
(``output_router_logits``). Dense parameters keep the data-parallel path they had;
:func:`~.sharding.local_squared_norm` makes the clipping norm count each expert once.

With ZeRO (stages 1-3) the expert parameters are partitioned over the expert-data-parallel
group in ZeRO units of their own (``ZeroOptimizer(expert_params=...)``, DeepSpeed's MoE
parameter groups), the rest over dp; ZeRO then reduces their gradients (averaged over edp,
times ``1 / ep``) and counts each expert once in the norm, and :meth:`ExpertTraining.reduce_gradients`
is not used.

Refused with ep > 1, each with a :class:`ConfigError` on every rank: sequence parallelism
(by the layout), a model without an expert-parallel plan (here).

With pipelines (pp > 1) each stage computes its own layers' part of the load-balancing
loss and the stages' router sums meet once per step (:class:`~.router_balance.PipelineBalance`):
every micro-batch's forward must run before the first backward, so ``parallelize`` runs
the 1F1B schedule in GPipe's order (:func:`pipeline_schedule`); the interleaved schedule
is refused.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .....core.errors import ConfigError
from .....core.layout import ParallelLayout
from .sharding import apply_expert_parallel, ep_plan_of, reduce_expert_gradients
from .....core.mesh_groups import ParallelGroups
from .router_balance import LoadBalancingLoss, PipelineBalance

__all__ = ["ExpertTraining", "pipeline_schedule"]


def pipeline_schedule(layout: ParallelLayout, balance: bool) -> str:
    """The schedule a pipeline runs: the layout's, or GPipe's order in place of 1F1B where the step has
    the load-balancing loss (its expert fractions are over every micro-batch, so every forward runs
    before the first backward; the same arithmetic, more activations held)."""
    if balance and layout.pp > 1 and layout.micro_batches > 1 and layout.schedule in ("1f1b", "one_f_one_b"):
        return "gpipe"
    return layout.schedule


#: MoE modules whose forward mixes the rows of the batch: Doge's router output ``[b, s, 2K]`` is viewed
#: as ``[2, b * s, K]``, so a token's experts depend on the other samples of its batch.
_BATCH_MIXING = ("DogeCDMoE",)


def _refuse_batch_mixing(model: nn.Module, layout: ParallelLayout) -> None:
    """:class:`ConfigError` where the layout splits the batch of a model whose forward mixes its rows."""
    found = next((type(m).__name__ for m in model.modules() if type(m).__name__ in _BATCH_MIXING), None)
    if found is None:
        return
    splits = [f"{name}={value}" for name, value in (("dp", layout.dp), ("gradient_accumulation_steps",
              layout.gradient_accumulation_steps), ("micro_batches", layout.micro_batches if layout.pp > 1 else 1))
              if value > 1]
    if splits:
        raise ConfigError(f"{type(model).__name__}: {found} routes each token by logits it mixes across the "
                          f"samples of the batch, so splitting the batch ({', '.join(splits)}) changes the model; "
                          f"train it with the whole batch on each rank (tp or pp with micro_batches=1)")


class ExpertTraining:
    """This rank's expert parameters, their gradient reduction and the global load-balancing loss."""

    def __init__(self, model: nn.Module, layout: ParallelLayout, groups: ParallelGroups) -> None:
        _refuse_batch_mixing(model, layout)
        self.ep, self.edp = layout.ep, groups.edp
        self.experts: list[nn.Parameter] = []
        self.balance: Optional[LoadBalancingLoss] = None
        if layout.ep > 1:  # the layout refuses sequence parallelism with ep > 1
            plan = ep_plan_of(model)
            if not any(style == "ep_dispatch_experts" for style in plan.values()):
                raise ConfigError(f"ep={layout.ep} needs a Mixture-of-Experts model with an expert-parallel plan "
                                  f"(config.base_model_ep_plan); {type(model).__name__} has none")
            self.experts = apply_expert_parallel(model, groups.ep, plan, getattr(model, "base_model_prefix", ""))
        self._groups = groups
        if LoadBalancingLoss.wanted(model):
            if layout.pp > 1 and layout.virtual_stages > 1:
                raise ConfigError("output_router_logits (the router load-balancing loss) with the interleaved "
                                  "pipeline schedule is not supported: its expert fractions are over every "
                                  "micro-batch, so every forward must run before the first backward; use "
                                  "schedule='1f1b' or 'gpipe', or set config.output_router_logits=False")
            self.balance = LoadBalancingLoss(model, groups.dp)

    def for_pipeline(self, device: torch.device, scale: Callable[[], float]) -> Optional[PipelineBalance]:
        """The load-balancing loss of a pipeline's steps (None without one); ``scale()`` is the factor
        the step's loss is multiplied by before backward."""
        if self.balance is None:
            return None
        return PipelineBalance(self.balance, self._groups.dp, self._groups.pp, device, scale)

    def keep_local(self, params: Iterable[nn.Parameter]) -> None:
        """Forget the expert parameters of stages this rank does not hold (pipelines)."""
        local = {id(p) for p in params}
        self.experts = [p for p in self.experts if id(p) in local]

    def start_forward(self) -> None:
        """Before a forward whose loss gets the load-balancing term: forget logits recorded since
        (a recomputation in backward records them again)."""
        if self.balance is not None:
            self.balance.collector.clear()

    def add_balance(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus this rank's term of the global load-balancing loss, where the model has one."""
        if self.balance is None:
            return loss
        return loss + self.balance().to(loss.device)

    def reduce_gradients(self) -> None:
        """After the last backward of a step: expert gradients of the dp-mean loss (collective over edp)."""
        if self.experts:
            reduce_expert_gradients(self.experts, self.edp, self.ep)
