"""Apply a family's tensor-parallel rules to a model: swap its linears for sharded ones, in place.

Each block's layers named by :class:`~shardwise.core.tp_rules.SplitRule` become a
:class:`ColumnParallelLinear` or :class:`RowParallelLinear` holding this rank's
shard of the layer's current weights, so the model keeps whatever values it was
built or loaded with. ``nn.Linear`` and Hugging Face's ``Conv1D`` (a transposed
linear) are both accepted. Attributes that count per-rank features (GPT-2's
``split_size``) are divided by the tp degree. Each sharded parameter carries its
:class:`~shardwise.core.placement.Placement` in the layer's original layout, so that
weights can be loaded into it and gathered out of it under the model's own names. A
model on the meta device stays there: its sharded layers are meta too.

A model with fewer key/value heads than tp (tp a multiple of them) keeps each head on tp / kv
consecutive ranks, as vLLM's ``QKVParallelLinear`` does: the key/value projections hold the rows of
head ``rank // (tp / kv)``, the attention's ``num_key_value_groups`` becomes the rank's query heads,
and the replicas' partial weight gradients are summed over the ranks holding the same head.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch import nn

from ....core.comm import Communicator
from ....core.errors import ConfigError
from ....core.placement import Placement
from ....core.tp_rules import FamilyRules, SplitRule, check_tp_degree, fused_column_order, kv_rank_heads
from .module_paths import get_module, matching_modules, set_module
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, copy_to_tp_region

__all__ = ["apply_tensor_parallel", "is_tp_sharded", "is_grad_summed", "placement_of", "set_placement",
           "set_tp_sharded", "matching_modules", "sum_partial_gradients", "counts_once_over_tp"]

_SHARDED = "_shardwise_tp_sharded"
_PLACEMENT = "_shardwise_placement"
_GRAD_SUMMED = "_shardwise_tp_grad_summed"


def is_grad_summed(param: torch.Tensor) -> bool:
    """True for a whole (replicated) parameter whose gradient is summed over the tp group by a hook."""
    return bool(getattr(param, _GRAD_SUMMED, False))


def is_tp_sharded(param: torch.Tensor) -> bool:
    """True for a parameter that holds only this rank's tensor-parallel slice."""
    return bool(getattr(param, _SHARDED, False))


def placement_of(param: torch.Tensor, name: str) -> Placement:
    """Where ``param`` (named ``name`` in the model) sits in its full tensor: the placement it was given
    when it was split (whose name is the one-process name), or whole under ``name``."""
    placement = getattr(param, _PLACEMENT, None)
    return Placement(name, tuple(param.shape)) if placement is None else placement


def counts_once_over_tp(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether tensor-parallel rank ``tp_rank`` is the one that counts ``param`` (in a gradient norm):
    the first rank for a whole parameter, every rank for a split one, the first of its replicas for a
    replicated key/value head."""
    if not is_tp_sharded(param):
        return tp_rank == 0
    placement = getattr(param, _PLACEMENT, None)
    return placement is None or tp_rank % placement.replicas == 0


def set_tp_sharded(param: torch.Tensor) -> None:
    """Mark ``param`` as holding only this rank's tensor-parallel slice."""
    setattr(param, _SHARDED, True)


def set_placement(param: torch.Tensor, placement: Placement) -> None:
    """Record where ``param`` sits in the one-process tensor ``placement.name``."""
    setattr(param, _PLACEMENT, placement)


def _placements(rule: SplitRule, conv1d: bool, out_features: int, in_features: int, bias: bool,
                 name: str, tp_comm: Communicator, replicas: int = 1) -> list[Placement]:
    """Placements of the sharded weight (and bias, if the split keeps a slice of it) of ``rule``."""
    full = (in_features, out_features) if conv1d else (out_features, in_features)
    size, rank = tp_comm.size, tp_comm.rank
    if rule.kind == "row":
        dim = 0 if conv1d else 1
        return [Placement(f"{name}.weight", full, dim, 1, size, rank, transpose=conv1d)]
    dim = 1 if conv1d else 0
    out = [Placement(f"{name}.weight", full, dim, rule.parts, size, rank, transpose=conv1d, replicas=replicas)]
    if bias:
        out.append(Placement(f"{name}.bias", (out_features,), 0, rule.parts, size, rank, replicas=replicas))
    return out


def _full_linear(layer: nn.Module, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``[out, in]`` weight and the bias of an ``nn.Linear`` or a ``Conv1D``."""
    if isinstance(layer, nn.Linear):
        return layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    if type(layer).__name__ == "Conv1D" and hasattr(layer, "nf"):  # transformers.pytorch_utils.Conv1D
        return layer.weight.detach().t(), layer.bias.detach()
    raise ConfigError(f"tensor-parallel rule for {path!r} expects nn.Linear or Conv1D, got {type(layer).__name__}")


def _sharded(rule: SplitRule, weight: torch.Tensor, bias: torch.Tensor | None,
             tp_comm: Communicator, replicas: int = 1) -> tuple[nn.Module, list[nn.Parameter]]:
    """The sharded layer of ``rule`` and its parameters that hold slices (a row split's bias is whole)."""
    if rule.kind == "row":
        layer = RowParallelLinear.from_full(weight.contiguous(), bias, tp_comm, input_is_parallel=not rule.split_input)
        return layer, [layer.weight]
    if rule.parts > 1:
        order = torch.from_numpy(fused_column_order(weight.shape[0], rule.parts, tp_comm.size))
        weight, bias = weight[order], None if bias is None else bias[order]
    layer = ColumnParallelLinear.from_full(weight.contiguous(), bias, tp_comm, gather_output=rule.gather_output,
                                           replicas=replicas)
    return layer, [layer.weight] + ([layer.bias] if layer.bias is not None else [])


def _summed_over_tp(comm: Communicator) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return comm.allreduce(grad.contiguous(), "sum")
    return hook


def _rope_grad_summed(comm: Communicator, rope_dim: int) -> Any:
    """Forward hook: the output's last ``rope_dim`` features get their gradient summed over ``comm``."""
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        keep, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([keep, copy_to_tp_region(rope, comm)], dim=-1)
    return hook


def _replicated(layer: nn.Module, rule: SplitRule, config: Any, tp_comm: Communicator, path: str) -> None:
    if rule.grad_sum:
        for p in layer.parameters():
            if p.requires_grad and not is_grad_summed(p):
                p.register_hook(_summed_over_tp(tp_comm))
                setattr(p, _GRAD_SUMMED, True)
    if rule.rope_dim_key is not None:
        rope_dim = getattr(config, rule.rope_dim_key, None)
        if not isinstance(rope_dim, int) or rope_dim < 1:
            raise ConfigError(f"{path}: style {rule.style!r} needs config.{rule.rope_dim_key}, got {rope_dim!r}")
        layer.register_forward_hook(_rope_grad_summed(tp_comm, rope_dim))


def _refuse_unsupported(model: nn.Module, rules: FamilyRules) -> None:
    """:class:`ConfigError` naming each style of the plan that shardwise lacks and the modules using it."""
    base = rules.blocks.rpartition(".")[0]
    root = get_module(model, base) if base else model
    used: dict[str, list[str]] = {}
    for pattern, style in rules.unsupported:
        for name in matching_modules(root, pattern):
            used.setdefault(style, []).append(name)
    if used:
        found = "; ".join(f"{style!r} on {len(names)} module(s): {', '.join(names[:3])}"
                          + ("..." if len(names) > 3 else "") for style, names in used.items())
        raise ConfigError(f"{rules.family}: tensor-parallel style(s) not implemented by shardwise: {found}. "
                          f"Override them with parallelize(..., tp_plan={{pattern: 'replicate' or 'colwise'/"
                          f"'rowwise'}}) or train without tensor parallelism")


def _refuse_split_statistics(block: nn.Module, rules: FamilyRules, name: str) -> None:
    """:class:`ConfigError` where a module takes statistics over the features a column split divides:
    Gemma 3n's activation sparsity keeps the gate's values above mean + k x std over the whole
    intermediate width, which one rank's columns would change."""
    for path, module in block.named_modules():
        sparsity = getattr(module, "activation_sparsity", 0.0)
        if not isinstance(sparsity, (int, float)) or sparsity <= 0:
            continue
        prefix = f"{path}." if path else ""
        inside = [rule for rule in rules.rules if rule.splits and rule.path.startswith(prefix)
                  and matching_modules(block, rule.path)]
        if any(rule.kind == "column" for rule in inside):
            blocks = rules.blocks.rpartition(".")[2]
            whole = ", ".join(f"'{blocks}.*.{rule.path}': 'replicate'" for rule in inside)
            raise ConfigError(f"{rules.family}: {name}.{path} keeps activations above a mean + std over the whole "
                              f"width of {inside[0].path} (activation_sparsity={sparsity}), which tensor "
                              f"parallelism splits; train it without tp, or keep it whole with parallelize(..., "
                              f"tp_plan={{{whole}}})")


class _KVReplication:
    """Key/value projections of a model with fewer key/value heads than tp: each head's rows are kept
    by ``replicas`` consecutive ranks (vLLM's ``num_kv_head_replicas``), whose partial weight gradients
    (each from its own query heads) are summed over ``comm``, the ranks holding the same head."""

    def __init__(self, config: Any, rules: FamilyRules, tp_comm: Communicator, replicas: int) -> None:
        self.replicas, self.tp_comm = replicas, tp_comm
        self.q_heads = int(getattr(config, "num_attention_heads"))
        self.kv_heads = tp_comm.size // replicas
        self.family = rules.family
        kv_rank_heads(self.q_heads, self.kv_heads, tp_comm.size, tp_comm.rank)  # checks the head mapping
        self.comm = tp_comm.split(color=tp_comm.rank // replicas)  # collective over the tp group
        hidden = getattr(config, "hidden_size", None)
        self.head_dim = getattr(config, "head_dim", None) or (hidden // self.q_heads if hidden else None)

    def is_kv(self, block: nn.Module, path: str, layer: nn.Module, rule: SplitRule, name: str) -> bool:
        """Whether ``layer`` (a column split inside ``block``) projects the key/value heads: replicated."""
        if rule.kind != "column" or rule.gather_output:
            return False
        owner_path = path.rpartition(".")[0]
        owner = get_module(block, owner_path) if owner_path else block
        head_dim = getattr(owner, "head_dim", None) or self.head_dim
        weight, _ = _full_linear(layer, name)
        if not isinstance(head_dim, int) or weight.shape[0] != self.kv_heads * head_dim:
            return False
        if rule.parts > 1 or not isinstance(getattr(owner, "num_key_value_groups", None), int):
            raise ConfigError(f"{self.family}: tp={self.tp_comm.size} is larger than num_key_value_heads="
                              f"{self.kv_heads}, and shardwise replicates key/value heads only in an attention "
                              f"module with num_key_value_groups and separate key/value projections; {name} is "
                              f"not one (use tp <= {self.kv_heads})")
        return True

    def grad_summed(self, params: list[nn.Parameter]) -> None:
        """Sum the gradients of ``params`` (a replicated head's slices) over the ranks holding the head."""
        for p in params:
            if p.requires_grad:
                p.register_hook(_summed_over_tp(self.comm))

    def regroup(self, owner: nn.Module, name: str) -> None:
        """The attention's query heads per key/value head on this rank: its q / tp query heads share
        its one key/value head."""
        groups = owner.num_key_value_groups
        if groups * self.kv_heads != self.q_heads or groups % self.replicas:
            raise ConfigError(f"{name}: num_key_value_groups={groups} does not match num_attention_heads="
                              f"{self.q_heads} / num_key_value_heads={self.kv_heads}")
        owner.num_key_value_groups = groups // self.replicas


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, rules: FamilyRules, tp_comm: Communicator,
                          on_free: Optional[Callable[[Callable[[], None]], None]] = None) -> int:
    """Shard every block of ``model`` over ``tp_comm`` by ``rules``; returns the layers replaced.

    Where the model has fewer key/value heads than tp (and tp is a multiple of them), each rank keeps
    the rows of key/value head ``rank // (tp / kv_heads)``, its query heads' head (as vLLM does); the
    sub-group of ranks holding the same head is then freed through ``on_free`` (the groups' ``on_free``).
    """
    if tp_comm.size == 1:
        return 0
    _refuse_unsupported(model, rules)
    config = getattr(model, "config", None)
    replicas = check_tp_degree(rules, config.to_dict() if hasattr(config, "to_dict") else {}, tp_comm.size)
    kv = _KVReplication(config, rules, tp_comm, replicas) if replicas > 1 else None
    if kv is not None and on_free is not None:
        on_free(kv.comm.free)
    replaced = 0
    for i, block in enumerate(get_module(model, rules.blocks)):
        _refuse_split_statistics(block, rules, f"{rules.blocks}.{i}")
        regrouped: dict[str, nn.Module] = {}
        attention: dict[str, str] = {}  # owner path -> a split of its heads, in an attention module
        for rule in rules.rules:
            if rule.kind == "column" and not rule.gather_output and rule.parts == 1:
                for path in _matching_parameters(block, rule.path):
                    _split_parameter(block, path, f"{rules.blocks}.{i}.{path}", tp_comm)
                    replaced += 1
            for path in matching_modules(block, rule.path):
                layer = get_module(block, path)
                name = f"{rules.blocks}.{i}.{path}"
                if not rule.splits:
                    _replicated(layer, rule, config, tp_comm, name)
                    continue
                copies = 1
                owner_path = path.rpartition(".")[0]
                if kv is not None and rule.kind == "column" and not rule.gather_output and hasattr(
                        get_module(block, owner_path) if owner_path else block, "num_key_value_groups"):
                    attention[owner_path] = name
                if kv is not None and kv.is_kv(block, path, layer, rule, name):
                    copies = replicas
                    regrouped[owner_path] = get_module(block, owner_path) if owner_path else block
                new = _split_layer(block, path, layer, rule, name, tp_comm, copies)
                if copies > 1:
                    kv.grad_summed([p for p in new.parameters()])
                replaced += 1
        for owner_path, split in attention.items():
            if owner_path not in regrouped:
                raise ConfigError(f"{rules.family}: tp={tp_comm.size} is larger than num_key_value_heads="
                                  f"{kv.kv_heads}, but no key/value projection of {kv.kv_heads} x head_dim "
                                  f"{kv.head_dim} outputs was found beside {split} to replicate (use tp <= "
                                  f"{kv.kv_heads})")
        for owner_path, owner in regrouped.items():
            kv.regroup(owner, f"{rules.blocks}.{i}.{owner_path}")
        for path in rules.divided_attrs:
            owner_path, _, attr = path.rpartition(".")
            owner = get_module(block, owner_path) if owner_path else block
            value = getattr(owner, attr)
            if value % tp_comm.size:
                raise ConfigError(f"{rules.family}: {path}={value} is not divisible by tp={tp_comm.size}")
            setattr(owner, attr, value // tp_comm.size)
    return replaced


def _matching_parameters(root: nn.Module, path: str) -> list[str]:
    """Names of parameters (not modules) of ``root`` at dotted ``path`` (``self_attn.sinks``)."""
    owner_path, _, attr = path.rpartition(".")
    owners = matching_modules(root, owner_path) if owner_path else [""]
    found = []
    for owner in owners:
        module = get_module(root, owner) if owner else root
        if isinstance(module._parameters.get(attr), nn.Parameter):
            found.append(f"{owner}.{attr}" if owner else attr)
    return found


def _split_parameter(block: nn.Module, path: str, name: str, tp_comm: Communicator) -> None:
    """Keep this rank's slice along dim 0 of the bare parameter at ``path``: HF's ``colwise`` on a
    parameter, as on ``self_attn.sinks`` (one value per attention head) beside ``local_params``."""
    owner_path, _, attr = path.rpartition(".")
    owner = get_module(block, owner_path) if owner_path else block
    full = owner._parameters[attr]
    size, rank = tp_comm.size, tp_comm.rank
    if full.dim() == 0 or full.shape[0] % size:
        raise ConfigError(f"{name}: a colwise parameter of shape {tuple(full.shape)} does not split over tp={size}")
    rows = full.shape[0] // size
    piece = nn.Parameter(full.detach()[rank * rows:(rank + 1) * rows].clone(), requires_grad=full.requires_grad)
    set_tp_sharded(piece)
    set_placement(piece, Placement(name, tuple(full.shape), 0, 1, size, rank))
    setattr(owner, attr, piece)


def _split_layer(block: nn.Module, path: str, layer: nn.Module, rule: SplitRule, name: str,
                 tp_comm: Communicator, replicas: int = 1) -> nn.Module:
    """Replace the linear at ``path`` of ``block`` by its column- or row-parallel shard, and return it."""
    weight, bias = _full_linear(layer, name)
    conv1d = not isinstance(layer, nn.Linear)
    on_meta = torch.device("meta") if weight.is_meta else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), on_meta:
        # the sharded layers' own init must not move the RNG, nor allocate a meta model
        new, sharded = _sharded(rule, weight, bias, tp_comm, replicas)
    placements = _placements(rule, conv1d, weight.shape[0], weight.shape[1], bias is not None, name, tp_comm,
                             replicas)
    for p, placement in zip(sharded, placements):
        set_tp_sharded(p)
        set_placement(p, placement)
    set_module(block, path, new)
    return new


def sum_partial_gradients(blocks: list[nn.Module], tp_comm: Communicator, hidden_size: int) -> list[str]:
    """Find the whole parameters of a block whose gradient is partial over ``tp_comm``, and sum them.

    A plan marks the usual ones (Qwen3's per-head norms), but any parameter that acts on split
    activations without a split of its own (Apertus's learnable activation inside the MLP) sees only
    this rank's features. One forward and backward of this rank's first block, on the same random
    hidden state on every rank of the group, tells them apart: their gradients differ between
    ranks. Those parameters (by path inside a block) get their gradients summed in every block of
    ``blocks``. Collective over ``tp_comm``; returns the paths found. Nothing else changes: the
    gradients the probe made are dropped, and the generator state is kept.
    """
    if tp_comm.size == 1 or not blocks:
        return []
    probe = blocks[0]
    candidates = [(n, p) for n, p in probe.named_parameters()
                  if p.requires_grad and not (is_tp_sharded(p) or is_grad_summed(p))]
    weights = [p for _, p in probe.named_parameters()]
    if not candidates or any(p.is_meta for p in weights):
        return []
    before = {id(p): p.grad for p in weights}
    device, dtype = weights[0].device, weights[0].dtype
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        was = probe.training
        probe.eval()
        try:
            x = torch.randn(1, 4, hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
            out = probe(x.requires_grad_(True))
            (out.float() * torch.linspace(0.5, 1.5, out.numel(), device=device).view_as(out)).sum().backward()
        finally:
            probe.train(was)
    sums = torch.stack([torch.stack([g.double().sum(), g.double().abs().sum()]) if (g := p.grad) is not None
                        else torch.zeros(2, dtype=torch.float64, device=device) for _, p in candidates])
    gathered = torch.as_tensor(tp_comm.allgather(sums.cpu().reshape(1, -1))).reshape(tp_comm.size, -1, 2)
    for p in weights:
        p.grad = before[id(p)]
    spread = (gathered - gathered[0]).abs().amax(dim=(0, 2))
    scale = gathered.abs().amax(dim=(0, 2)).clamp_min(1e-30)
    partial = [name for (name, _), d, s in zip(candidates, spread.tolist(), scale.tolist()) if d > 1e-5 * s]
    for block in blocks:
        params = dict(block.named_parameters())
        for name in partial:
            p = params.get(name)
            if p is not None and not is_grad_summed(p):
                p.register_hook(_summed_over_tp(tp_comm))
                setattr(p, _GRAD_SUMMED, True)
    return partial
