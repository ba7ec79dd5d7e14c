"""The router load-balancing loss of Hugging Face MoE models, over the global batch of data parallelism.

A Hugging Face MoE causal LM with ``config.output_router_logits`` adds
``router_aux_loss_coef * load_balancing_loss_func(router_logits, E, k, mask)`` to its
loss (Switch Transformer's loss, as Mixtral's modeling file writes it)::

    f_e = C_e / R     (top-k assignments to expert e over every layer, per routed row)
    P_e = S_e / R     (softmax probability of expert e summed over every layer, per row)
    aux = E * sum_e f_e * P_e

(Doge routes over product keys and counts each of the k choices 1/k: ``f_e = C_e / (k R)``.)

A product of two batch means is not the mean of the ranks' products, so each
data-parallel rank computing it on its own slice would not give the one-process value.
:class:`LoadBalancingLoss` makes it global: ``C_e`` and ``R`` (not differentiable) are
summed over the dp group by one all-reduce, and each rank's differentiable term is its
share of the sum, ``dp * E * sum_e f_e * S_e(local) / R``. The mean over dp of these
terms (the mean the data-parallel loss and gradients take) is exactly the one-process
aux loss on the concatenated batch, and so are its gradients.

The router logits are those Hugging Face records (``model._can_record_outputs
["router_logits"]``: a module class and an output index), taken by forward hooks of
:class:`RouterLogitsCollector`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .....core.comm import Communicator
from .....core.errors import ConfigError

__all__ = ["RouterLogitsCollector", "LoadBalancingLoss", "PipelineBalance", "load_balancing_term", "router_sums"]


def _specs(model: nn.Module) -> list[tuple[Optional[type], Optional[str], Optional[str], int]]:
    """(class, class-name suffix, layer name, output index) of each router-logits recorder of ``model``."""
    specs = None
    for module in model.modules():  # the causal LM's, else its base model's (Qwen4-Exp sets it there only)
        specs = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if specs is not None:
            break
    if specs is None:
        raise ConfigError(f"{type(model).__name__} records no router logits (_can_record_outputs has no "
                          "'router_logits'): its load-balancing loss cannot be computed")
    out = []
    for spec in specs if isinstance(specs, list) else [specs]:
        if isinstance(spec, (type, str)):  # Hugging Face's shorthand: a class or a class-name suffix, output 1
            out.append((spec if isinstance(spec, type) else None, spec if isinstance(spec, str) else None, None, 1))
        else:
            out.append((spec.target_class, spec.class_name, spec.layer_name, spec.index))
    return out


def _routers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(module, output index) of each module whose output Hugging Face records as router logits."""
    specs = _specs(model)
    found = []
    for name, module in model.named_modules():
        for cls, suffix, layer, index in specs:
            if not ((cls is not None and isinstance(module, cls)) or (suffix and name.endswith(suffix))):
                continue
            if layer is not None and f".{layer.strip('.')}." not in f"{name}.":
                continue
            found.append((module, index))
            break
    return found


class RouterLogitsCollector:
    """Forward hooks keeping the router logits of every MoE layer, in call order, until :meth:`take`."""

    def __init__(self, model: nn.Module) -> None:
        self.logits: list[torch.Tensor] = []
        self._handles = [module.register_forward_hook(self._hook(index)) for module, index in _routers(model)]
        if not self._handles:
            raise ConfigError(f"{type(model).__name__}: no module matches its router-logits recorder")

    def _hook(self, index: int) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            self.logits.append(output[index] if isinstance(output, (tuple, list)) else output)
        return keep

    def take(self) -> list[torch.Tensor]:
        """The logits recorded since the last take (or clear), and forget them."""
        out, self.logits = self.logits, []
        return out

    def clear(self) -> None:
        """Forget what was recorded (e.g. by a recomputation in backward)."""
        self.logits = []

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _softmax_route(logits: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's routing: the softmax over the experts ``[rows, E]`` and its top-k ``[rows, k]``."""
    weights = torch.softmax(logits, dim=-1)
    return weights, torch.topk(weights, top_k, dim=-1)[1]


def _product_key_route(logits: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Doge's routing over product keys: logits ``[2, rows, K]`` with ``K = floor(sqrt(E))``; expert
    ``i * K + j`` scores ``x_i + y_j``; the softmax is over the top K x K pairs, and the top-k of them."""
    keys = logits.shape[-1]
    (sx, sy), (ix, iy) = logits.topk(keys, dim=-1)
    scores = (sx.unsqueeze(-1) + sy.unsqueeze(-2)).flatten(-2)
    indices = (ix.unsqueeze(-1) * keys + iy.unsqueeze(-2)).flatten(-2)
    chosen = indices.gather(-1, scores.topk(top_k, dim=-1)[1])
    weights = torch.zeros(scores.shape[0], num_experts, dtype=scores.dtype, device=scores.device)
    return weights.scatter(-1, indices, torch.softmax(scores, dim=-1)), chosen


class _Formula:
    """How a family's modeling file routes (``route``: logits -> per-expert weights, chosen experts) and
    scales the assignment fractions: Mixtral's ``f_e = C_e / R``, Doge's ``C_e / (k R)``."""

    def __init__(self, route: Callable[..., tuple[torch.Tensor, torch.Tensor]], per_choice: bool) -> None:
        self.route, self.per_choice = route, per_choice


MIXTRAL = _Formula(_softmax_route, per_choice=False)
PRODUCT_KEYS = _Formula(_product_key_route, per_choice=True)


def router_sums(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                attention_mask: Optional[torch.Tensor] = None,
                device: Optional[torch.device] = None,
                formula: _Formula = MIXTRAL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(C, S, R)`` of some layers' router logits: the top-k assignments per expert ``[E]`` and
    the routed rows (not differentiable), and the routing probabilities summed per expert ``[E]``
    (differentiable), all fp32. ``attention_mask`` ``[batch, seq]`` excludes padding as Hugging
    Face does. No logits: zeros (a pipeline stage without MoE layers). With Doge's ``formula``,
    ``C`` counts each choice ``1 / k``, so that ``C / R`` is its fraction of the assignments."""
    if device is None:
        device = router_logits[0].device if router_logits else torch.device("cpu")
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    for logits in router_logits:
        weights, chosen = formula.route(logits.to(device), num_experts, top_k)
        if mask is None:
            counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).to(torch.float32)
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    if formula.per_choice:
        counts = counts / top_k
    return counts.detach(), probs, rows.detach()


def load_balancing_term(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        comm: Optional[Communicator], attention_mask: Optional[torch.Tensor] = None,
                        formula: _Formula = MIXTRAL) -> torch.Tensor:
    """This rank's term of the global load-balancing loss (without the coefficient); see the module doc.

    Collective over ``comm`` (the data-parallel group; None or size 1: the local loss,
    Hugging Face's value). ``attention_mask`` ``[batch, seq]`` excludes padding as Hugging
    Face does.
    """
    if not router_logits:
        raise ConfigError("no router logits were recorded in this forward")
    device = router_logits[0].device
    counts, probs, rows = router_sums(router_logits, num_experts, top_k, attention_mask, device, formula)
    stats = torch.cat([counts, rows.reshape(1)])
    size = 1 if comm is None else comm.size
    if size > 1:
        stats = torch.as_tensor(comm.allreduce(stats.cpu(), "sum")).to(device)
    total = stats[-1]
    return size * num_experts * ((stats[:-1] / total) * probs).sum() / total


def _formula_of(model: nn.Module) -> Optional[_Formula]:
    """The formula of the model's modeling file when it is Mixtral's (most MoE families) or Doge's, by
    its code; None for any other."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if fn is None:
        return None

    def same(module: str) -> bool:
        try:
            ref = getattr(__import__(module, fromlist=["load_balancing_loss_func"]), "load_balancing_loss_func")
        except (ImportError, AttributeError):  # pragma: no cover - a transformers without that family
            return False
        a, b = fn.__code__, ref.__code__

        def consts(c: Any) -> tuple:
            return tuple(x for x in c.co_consts if not hasattr(x, "co_code"))
        return (a.co_code, a.co_names, consts(a)) == (b.co_code, b.co_names, consts(b))
    if same("transformers.models.mixtral.modeling_mixtral"):
        return MIXTRAL
    if same("transformers.models.doge.modeling_doge"):
        return PRODUCT_KEYS
    return None


class LoadBalancingLoss:
    """``router_aux_loss_coef`` times this rank's term of the global load-balancing loss, per forward."""

    def __init__(self, model: nn.Module, comm: Optional[Communicator]) -> None:
        config = getattr(model, "config", None)
        formula = _formula_of(model)
        if formula is None:
            raise ConfigError(f"{type(model).__name__}: its load-balancing loss is neither Mixtral's formula nor "
                              "Doge's, the ones shardwise computes over the global batch (set "
                              "output_router_logits=False)")
        self.formula = formula
        self.num_experts = int(getattr(model, "num_experts", None) or getattr(config, "num_local_experts", None)
                               or config.num_experts)
        self.top_k = int(getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok)
        self.coef = float(getattr(model, "router_aux_loss_coef", None) if hasattr(model, "router_aux_loss_coef")
                          else config.router_aux_loss_coef)
        self.comm = comm
        self.collector = RouterLogitsCollector(model)

    @staticmethod
    def wanted(model: nn.Module) -> bool:
        """Whether Hugging Face's forward of ``model`` adds the loss: ``config.output_router_logits`` and a
        modeling file that has one (the DeepSeek-style families balance with a router bias instead, and
        their forward adds nothing even with ``output_router_logits``)."""
        if not getattr(getattr(model, "config", None), "output_router_logits", False):
            return False
        if getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None) is None:
            return False
        # a model without routers (Doge with is_moe=False) records no logits, and Hugging Face adds nothing
        return bool(_routers(model))

    def __call__(self, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The scaled term of the logits recorded since the last call (collective over the dp group)."""
        return self.coef * load_balancing_term(self.collector.take(), self.num_experts, self.top_k, self.comm,
                                               attention_mask, self.formula)


class PipelineBalance:
    """The load-balancing loss of a pipeline step, each stage computing its own layers' part.

    Hugging Face concatenates the router logits of every layer before it takes the two
    means, so the loss is ``coef * E * sum_e (C_e / R) * (S_e / R)`` with ``C``, ``S`` and
    ``R`` summed over every layer, micro-batch and data-parallel rank: not a sum of
    per-stage (or per-micro-batch) losses. Each stage keeps its layers' sums per
    micro-batch (:meth:`end_forward`); once every forward of the step has run,
    :meth:`meet` sums ``C``, ``S`` (detached) and ``R`` over the data-parallel group, then
    over the pipeline group (collective; the schedule must run all forwards before the
    first backward, as GPipe does). Micro-batch ``j``'s backward on a stage then adds
    :meth:`term`, ``coef * dp * E * sum_e (C_e / R) * S_e(j, this stage) / R``: its
    gradient is the one-process loss's through this stage's routers (``C`` and ``R`` are
    not differentiable, and the loss is linear in ``S``), and the mean over dp of the
    terms summed over stages and micro-batches is the one-process value, :attr:`value`.
    """

    def __init__(self, balance: LoadBalancingLoss, dp: Optional[Communicator], pp: Communicator,
                 device: torch.device, scale: Callable[[], float] = lambda: 1.0) -> None:
        self.balance, self.dp, self.pp, self.device, self.scale = balance, dp, pp, device, scale
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._fractions: Optional[torch.Tensor] = None
        self._rows: Optional[torch.Tensor] = None
        #: The step's load-balancing loss (with its coefficient), the same on every rank; after :meth:`meet`.
        self.value: Optional[torch.Tensor] = None

    def begin_step(self) -> None:
        """Forget the previous step's sums."""
        self._sums, self._fractions, self._rows, self.value = {}, None, None, None
        self.balance.collector.clear()

    def begin_forward(self) -> None:
        """Before a stage's forward of one micro-batch (drops logits a recomputation recorded)."""
        self.balance.collector.clear()

    def end_forward(self, microbatch: int) -> None:
        """After a stage's forward of ``microbatch``: keep its layers' router sums."""
        b = self.balance
        self._sums[microbatch] = router_sums(b.collector.take(), b.num_experts, b.top_k, device=self.device,
                                             formula=b.formula)

    def meet(self) -> torch.Tensor:
        """Sum the step's counts, probabilities and rows over dp and pp (collective); returns :attr:`value`."""
        e = self.balance.num_experts
        stats = torch.zeros(2 * e + 1, dtype=torch.float32, device=self.device)
        for counts, probs, rows in self._sums.values():
            stats = stats + torch.cat([counts, probs.detach(), rows.reshape(1)])
        for comm in (self.dp, self.pp):
            if comm is not None and comm.size > 1:
                stats = torch.as_tensor(comm.allreduce(stats.cpu(), "sum")).to(self.device, torch.float32)
        rows = stats[-1]
        if not float(rows) > 0:
            raise ConfigError("no router logits were recorded in this pipeline step: the load-balancing loss "
                              "has no routed rows")
        self._fractions, self._rows = stats[:e] / rows, rows
        self.value = self.balance.coef * e * (self._fractions * stats[e:2 * e] / rows).sum()
        return self.value

    def term(self, microbatch: int) -> Optional[torch.Tensor]:
        """This stage's differentiable part of the loss for ``microbatch`` (scaled as the step's loss is),
        or None where its layers route nothing; after :meth:`meet`."""
        if self._fractions is None or self._rows is None:
            raise ConfigError("PipelineBalance.term before meet: every forward of the step must run first")
        _, probs, _ = self._sums.pop(microbatch)
        if not probs.requires_grad:
            return None
        size = 1 if self.dp is None else self.dp.size
        b = self.balance
        return (b.coef * size * b.num_experts * self.scale()) * (self._fractions * probs).sum() / self._rows
