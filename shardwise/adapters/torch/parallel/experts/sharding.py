"""Expert parallelism for Hugging Face Mixture-of-Experts models, from the model's own ``base_model_ep_plan``.

transformers 5 describes each MoE family's experts in its config, e.g.::

    {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
     "layers.*.mlp.experts.down_proj": "grouped_gemm",
     "layers.*.mlp.experts": "ep_dispatch_experts"}

:func:`apply_expert_parallel` keeps, of every ``grouped_gemm`` parameter of an
``ep_dispatch_experts`` module, this rank's contiguous block of experts (dim 0), sets
the module's ``num_experts`` to the local count and wraps its forward: the (token,
expert) pairs go to the experts' owners by an all-to-all (:mod:`.alltoall`),
the module's original forward runs on the rows received with local expert ids and
weight 1 (so the expert maths, activation clamps and biases included, is exactly the
family's), and the results come back to be weighted and summed over the top-k slots.
Routers, shared experts and every other parameter stay whole and untouched.

Each kept piece carries its :class:`~shardwise.core.placement.Placement` (one-process
name, full shape, dim 0, the ep group) and the :func:`is_expert_param` mark, so
pretrained weights are read slice by slice, a meta model is materialized piece by
piece and whole tensors are gathered for checkpoints over the ep group.

Gradients (:func:`reduce_expert_gradients`): the data-parallel loss is the mean of the
dp ranks' local losses. After backward an expert's gradient on its owner is the sum
of the contributions of the ``ep`` ranks whose tokens it ran, so the gradient of the
mean is the sum over its ``dp // ep`` expert-data-parallel replicas divided by dp: an
average over edp, then a division by ep. Norms (:func:`local_squared_norm`): the
global norm adds every rank's squares over the world and divides by dp (a dense
gradient is held by dp replicas); an expert's gradient is held by only ``dp // ep``
of them, so its squares are counted ``ep`` times on each, and each expert counts once.
"""

from __future__ import annotations

import inspect
import re
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from .....core.comm import Communicator
from .....core.errors import ConfigError
from .....core.moe import check_divisible
from .....core.placement import Placement
from ....torch.device_math import squared_norm
from .alltoall import combine, dispatch
from ..grad_average import average_gradients
from ..tp_apply import is_tp_sharded, set_placement

__all__ = ["apply_expert_parallel", "is_expert_param", "expert_parameters", "reduce_expert_gradients",
           "local_squared_norm", "ep_plan_of"]

_EXPERT = "_shardwise_expert_param"
# styles of an ep plan that are the tensor plan's business (or keep a tensor whole)
_OTHER_STYLES = frozenset({"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
                           "replicated_with_grad_allreduce", "replicate", "local_colwise", "local_rowwise",
                           "embedding_rowwise", "embedding_colwise", "packed_rowwise", "local_params"})


def is_expert_param(param: torch.Tensor) -> bool:
    """True for a parameter that holds only this rank's experts (split over the ep group)."""
    return bool(getattr(param, _EXPERT, False))


def expert_parameters(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The expert-parallel parameters among ``params``, in their order."""
    return [p for p in params if is_expert_param(p)]


def ep_plan_of(model: nn.Module) -> dict[str, str]:
    """The Hugging Face config's ``base_model_ep_plan`` (empty when the model has none)."""
    return dict(getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {})


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+") + r"\Z")


def _classify(plan: Mapping[str, str]) -> tuple[list[re.Pattern], list[re.Pattern]]:
    dispatch_keys, params, unknown = [], [], {}
    for key, style in plan.items():
        if style == "ep_dispatch_experts":
            dispatch_keys.append(_pattern(key))
        elif style == "grouped_gemm":
            params.append(_pattern(key))
        elif style not in _OTHER_STYLES:
            unknown.setdefault(style, []).append(key)
    if unknown:
        raise ConfigError("expert-parallel plan styles not implemented by shardwise: " + "; ".join(
            f"{style!r} ({', '.join(keys)})" for style, keys in sorted(unknown.items())))
    return dispatch_keys, params


def _relative(name: str, prefix: str) -> Optional[str]:
    if not prefix:
        return name
    return name[len(prefix) + 1:] if name.startswith(prefix + ".") else None


def _found(model: nn.Module, plan: Mapping[str, str], prefix: str) -> list[tuple[str, nn.Module, list[str]]]:
    """(name, module, names of its grouped_gemm parameters) of every module to dispatch, checked."""
    dispatch_keys, param_keys = _classify(plan)
    out, claimed = [], set()
    for name, module in model.named_modules():
        rel = _relative(name, prefix)
        if rel is None or not any(p.match(rel) for p in dispatch_keys):
            continue
        if not isinstance(getattr(module, "num_experts", None), int):
            raise ConfigError(f"{name}: an 'ep_dispatch_experts' module needs an integer num_experts attribute "
                              f"({type(module).__name__} has none)")
        experts = module.num_experts
        owned = []
        for pname, p in module.named_parameters(recurse=False):
            if not any(k.match(f"{rel}.{pname}") for k in param_keys):
                continue
            if p.dim() == 0 or p.shape[0] != experts:
                raise ConfigError(f"{name}.{pname}: shape {tuple(p.shape)} does not lead with the "
                                  f"{experts} experts")
            if is_tp_sharded(p):
                raise ConfigError(f"{name}.{pname} is split by tensor parallelism; an expert tensor cannot "
                                  "also be split over ep")
            owned.append(pname)
            claimed.add(f"{name}.{pname}")
        if not owned:
            raise ConfigError(f"{name}: the plan names no 'grouped_gemm' parameter of this experts module")
        out.append((name, module, owned))
    stray = [n for n, _ in model.named_parameters()
             if (rel := _relative(n, prefix)) is not None and any(k.match(rel) for k in param_keys)
             and n not in claimed]
    if stray:
        raise ConfigError(f"'grouped_gemm' parameters outside any 'ep_dispatch_experts' module: {', '.join(stray)}")
    return out


def _install(module: nn.Module, comm: Communicator, num_local: int, owned: Sequence[str]) -> None:
    """Replace ``module.forward`` by the dispatch around its original forward."""
    original = module.forward
    names = list(inspect.signature(original).parameters)[:3]

    def untouched() -> torch.Tensor:
        # A rank that runs no expert still gives its expert parameters a (zero) gradient, so that
        # their gradient hooks fire at the same point of backward on every rank (ZeRO starts the
        # reduction of a unit of experts from them, over the expert-data-parallel group).
        return sum(module._parameters[n].reshape(-1)[:1].sum() * 0 for n in owned
                   if module._parameters[n].requires_grad)

    def forward(*args, **kwargs):
        bound = dict(zip(names, args), **kwargs)
        hidden, top_k_index, top_k_weights = (bound[n] for n in names)
        rows, local, routing = dispatch(hidden, top_k_index, comm, num_local)
        if rows.shape[0]:
            out = original(rows, local, torch.ones(local.shape, dtype=rows.dtype, device=rows.device))
        else:  # nothing to run: stay connected to the exchange, whose backward every rank joins
            out = rows * 0
            if torch.is_grad_enabled():
                out = out + untouched()
        return combine(out.to(hidden.dtype), top_k_weights, routing, comm).to(hidden.dtype)

    module.forward = forward


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, ep_comm: Communicator, ep_plan: Mapping[str, str],
                          prefix: str) -> list[nn.Parameter]:
    """Split the experts of every ``ep_dispatch_experts`` module of ``model`` over ``ep_comm``.

    ``ep_plan`` keys are relative to the base model, found under ``prefix`` (the
    model's ``base_model_prefix``, e.g. ``"model"``; ``""`` when ``model`` is the base
    model). Returns the parameters now holding this rank's experts. Every check runs
    before anything changes, so a :class:`ConfigError` (experts not divisible by ep,
    a style shardwise lacks) is raised on every rank alike. A model on the meta device
    stays there (the pieces are meta tensors of the slice's shape).
    """
    found = _found(model, ep_plan, prefix)
    for name, module, _ in found:
        check_divisible(module.num_experts, ep_comm.size, name)
    kept: list[nn.Parameter] = []
    for name, module, owned in found:
        total = module.num_experts
        num_local = total // ep_comm.size
        start = ep_comm.rank * num_local
        for pname in owned:
            old = module._parameters[pname]
            if old.is_meta:
                piece = torch.empty((num_local, *old.shape[1:]), dtype=old.dtype, device="meta")
            else:
                piece = old.detach()[start:start + num_local].clone()
            new = nn.Parameter(piece, requires_grad=old.requires_grad)
            setattr(new, _EXPERT, True)
            set_placement(new, Placement(f"{name}.{pname}", tuple(old.shape), 0, 1, ep_comm.size, ep_comm.rank))
            module._parameters[pname] = new
            kept.append(new)
        module.num_experts = num_local
        _install(module, ep_comm, num_local, owned)
    return kept


@torch.no_grad()
def reduce_expert_gradients(params: Sequence[nn.Parameter], edp_comm: Optional[Communicator], ep: int) -> None:
    """Turn the expert gradients left by backward into those of the dp-mean loss (see the module doc).

    Sums over the expert-data-parallel group and divides by ``dp = ep * edp``; a parameter
    with no gradient (its rank received no token) takes part with zeros. Collective over
    ``edp_comm``; every rank passes its expert parameters in the same order.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if edp_comm is not None and edp_comm.size > 1:
        average_gradients(params, edp_comm)
    if ep > 1:
        for p in params:
            p.grad.div_(ep)


def local_squared_norm(grads: Sequence[tuple[torch.Tensor, torch.Tensor]], ep: int,
                       device: torch.device) -> torch.Tensor:
    """This rank's share of the global squared gradient norm, from (parameter, gradient) pairs it counts.

    The caller sums it over the world and divides by dp, as for dense gradients (held by
    dp replicas each). An expert's gradient is held by ``dp // ep`` replicas only, so its
    squares are weighted by ``ep`` here: every expert then counts exactly once.
    """
    dense = [g for p, g in grads if not is_expert_param(p)]
    experts = [g for p, g in grads if is_expert_param(p)]
    total = squared_norm(dense, device)
    if experts:
        total = total + squared_norm(experts, device) * ep
    return total
