"""The router load-balancing loss of Hugging Face MoE models, over the global batch of data parallelism.

A Hugging Face MoE causal LM with ``config.output_router_logits`` adds
``router_aux_loss_coef * load_balancing_loss_func(router_logits, E, k, mask)`` to its
loss (Switch Transformer's loss, as Mixtral's modeling file writes it)::

    f_e = C_e / R     (top-k assignments to expert e over every layer, per routed row)
    P_e = S_e / R     (softmax probability of expert e summed over every layer, per row)
    aux = E * sum_e f_e * P_e

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
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ....core.comm import Communicator
from ....core.errors import ConfigError

__all__ = ["RouterLogitsCollector", "LoadBalancingLoss", "load_balancing_term"]


def _specs(model: nn.Module) -> list[tuple[Optional[type], Optional[str], Optional[str], int]]:
    """(class, class-name suffix, layer name, output index) of each router-logits recorder of ``model``."""
    recorders = getattr(model, "_can_record_outputs", None) or {}
    specs = recorders.get("router_logits")
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


class RouterLogitsCollector:
    """Forward hooks keeping the router logits of every MoE layer, in call order, until :meth:`take`."""

    def __init__(self, model: nn.Module) -> None:
        self.logits: list[torch.Tensor] = []
        self._handles = []
        specs = _specs(model)
        for name, module in model.named_modules():
            for cls, suffix, layer, index in specs:
                if not ((cls is not None and isinstance(module, cls)) or (suffix and name.endswith(suffix))):
                    continue
                if layer is not None and f".{layer.strip('.')}." not in f"{name}.":
                    continue
                self._handles.append(module.register_forward_hook(self._hook(index)))
                break
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


def load_balancing_term(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        comm: Optional[Communicator], attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's term of the global load-balancing loss (without the coefficient); see the module doc.

    Collective over ``comm`` (the data-parallel group; None or size 1: the local loss,
    Hugging Face's value). ``attention_mask`` ``[batch, seq]`` excludes padding as Hugging
    Face does.
    """
    if not router_logits:
        raise ConfigError("no router logits were recorded in this forward")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    for logits in router_logits:
        weights = torch.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        if mask is None:
            counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).to(torch.float32)
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    stats = torch.cat([counts, rows.reshape(1)]).detach()
    size = 1 if comm is None else comm.size
    if size > 1:
        stats = torch.as_tensor(comm.allreduce(stats.cpu(), "sum")).to(device)
    total = stats[-1]
    return size * num_experts * ((stats[:-1] / total) * probs).sum() / total


def _same_formula(model: nn.Module) -> bool:
    """Whether the model's modeling file computes the loss as Mixtral's does (most MoE families do)."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    try:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as ref
    except ImportError:  # pragma: no cover - transformers without Mixtral
        return False
    if fn is None:
        return False
    a, b = fn.__code__, ref.__code__

    def consts(c: Any) -> tuple:
        return tuple(x for x in c.co_consts if not hasattr(x, "co_code"))
    return (a.co_code, a.co_names, consts(a)) == (b.co_code, b.co_names, consts(b))


class LoadBalancingLoss:
    """``router_aux_loss_coef`` times this rank's term of the global load-balancing loss, per forward."""

    def __init__(self, model: nn.Module, comm: Optional[Communicator]) -> None:
        config = getattr(model, "config", None)
        if not _same_formula(model):
            raise ConfigError(f"{type(model).__name__}: its load-balancing loss is not Mixtral's formula, which is "
                              "the one shardwise computes over the global batch (set output_router_logits=False)")
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
        return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None) is not None

    def __call__(self, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The scaled term of the logits recorded since the last call (collective over the dp group)."""
        return self.coef * load_balancing_term(self.collector.take(), self.num_experts, self.top_k, self.comm,
                                               attention_mask)
