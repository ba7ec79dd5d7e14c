"""Megatron-style tensor-parallel layers for PyTorch over a shardwise communicator.

The four region operators (each a pair of collectives, forward and backward, in one autograd function):

* :func:`copy_to_tp_region` ("f"): identity forward, allreduce(sum) backward;
* :func:`reduce_from_tp_region` ("g"): allreduce(sum) forward, identity backward;
* :func:`gather_from_tp_region`: allgather on the last dim forward, split backward;
* :func:`scatter_to_tp_region`: split on the last dim forward, allgather backward.

Split rules (which rows/columns a rank owns) come from
:mod:`shardwise.core.tensor_parallel`. Default initialisation draws the *full*
weight exactly as ``nn.Linear`` / ``nn.Embedding`` would from the global torch
RNG and keeps this rank's shard, so every tensor-parallel rank must be seeded
identically; ``from_full`` / ``load_full`` load an existing full weight instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ....core.comm import Communicator
from ....core.tensor_parallel import (TensorParallelError, column_parallel_shard, padded_vocab_size,
                                     row_parallel_shard, vocab_parallel_range)
from ..compiling import not_traced

__all__ = [
    "copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region", "scatter_to_tp_region",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "gather_sequence", "reduce_scatter_sequence", "scatter_sequence",
]


def _allreduce(x: torch.Tensor, comm: Communicator, op: str = "sum") -> torch.Tensor:
    return x if comm.size == 1 else comm.allreduce(x.contiguous(), op)


def _gather_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    if comm.size == 1:
        return x
    full = comm.allgather(x.movedim(-1, 0).contiguous())  # allgather concatenates dim 0
    return full.movedim(0, -1).contiguous()


def _split_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    if comm.size == 1:
        return x
    if x.shape[-1] % comm.size:
        raise TensorParallelError(f"last dim {x.shape[-1]} is not divisible by tp size {comm.size}")
    return x.chunk(comm.size, dim=-1)[comm.rank].contiguous()


Op = Callable[[torch.Tensor, Communicator], torch.Tensor]


class _Conjugate(torch.autograd.Function):
    """``forward_op`` on the input, ``backward_op`` on its gradient: the pairs of collectives of a
    tensor- or sequence-parallel region (Megatron's mappings), each op taking ``(tensor, comm)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, forward_op: Op, backward_op: Op) -> torch.Tensor:
        ctx.comm, ctx.backward_op = comm, backward_op
        return forward_op(x, comm)

    @staticmethod
    @not_traced
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.backward_op(grad, ctx.comm), None, None, None


def _same(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The identity of a region's other direction (a view: autograd needs a new tensor forward)."""
    return x.view_as(x)


def _whole(op: Op) -> Op:
    """``op`` where ``comm`` has more than one rank, else the identity."""
    return lambda x, comm: op(x, comm) if comm.size > 1 else x.view_as(x)


@not_traced
def copy_to_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Identity forward; the input gradient is summed over ``comm`` in backward."""
    return _Conjugate.apply(x, comm, _same, _allreduce)


@not_traced
def reduce_from_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum partial results over ``comm`` forward; identity backward."""
    return _Conjugate.apply(x, comm, _whole(_allreduce), _same)


@not_traced
def gather_from_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Concatenate the ranks' last-dim shards forward; keep this rank's slice of the gradient."""
    return _Conjugate.apply(x, comm, _whole(_gather_last), _split_last)


@not_traced
def scatter_to_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Keep this rank's last-dim slice forward; allgather the gradient in backward."""
    return _Conjugate.apply(x, comm, _whole(_split_last), _gather_last)


# -- sequence parallelism: activations split along the sequence (dim 1 of [batch, seq, hidden]) ----
def _seq_split(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    if x.shape[1] % comm.size:
        raise TensorParallelError(f"sequence length {x.shape[1]} is not divisible by tp={comm.size} "
                                  "(sequence parallelism splits the sequence over the tensor-parallel ranks)")
    return x.chunk(comm.size, dim=1)[comm.rank].contiguous()


def _seq_gather(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return comm.allgather(x.movedim(1, 0).contiguous(), uniform=True).movedim(0, 1).contiguous()


def _seq_reduce_scatter(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    if x.shape[1] % comm.size:
        raise TensorParallelError(f"sequence length {x.shape[1]} is not divisible by tp={comm.size}")
    return comm.reduce_scatter(x.movedim(1, 0).contiguous(), "sum").movedim(0, 1).contiguous()


class _ColumnFromSequence(torch.autograd.Function):
    """A column-parallel linear on a gathered sequence that keeps only this rank's part of its input
    for backward and gathers it again there (Megatron's sequence-parallel linear): the whole input
    is not held from forward to backward."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, part: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], comm: Communicator) -> torch.Tensor:
        ctx.save_for_backward(part, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    @not_traced
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        part, weight = ctx.saved_tensors
        full = _seq_gather(part, ctx.comm)
        grad_input = grad.matmul(weight)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]))
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_input, None, grad_weight, grad_bias, None


@not_traced
def _column_from_sequence(full: torch.Tensor, part: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          comm: Communicator) -> torch.Tensor:
    return _ColumnFromSequence.apply(full, part, weight, bias, comm)


#: Attribute of a gathered sequence naming the part of it this rank gathered from.
_PART = "_shardwise_sequence_part"


@not_traced
def gather_sequence(x: torch.Tensor, comm: Communicator, *, grad_summed: bool = False) -> torch.Tensor:
    """The whole sequence from every rank's part forward. Backward: the gradient is reduce-scattered
    (each rank's computation used the whole sequence), or with ``grad_summed`` (the gradient is
    already the same on every rank) this rank's part is kept."""
    if comm.size == 1:
        return x
    full = _Conjugate.apply(x, comm, _seq_gather, _seq_split if grad_summed else _seq_reduce_scatter)
    setattr(full, _PART, x)  # a column layer fed with it keeps only ``x`` for backward
    return full


@not_traced
def reduce_scatter_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum partial results over ``comm`` and keep this rank's part of the sequence; allgather backward."""
    return _Conjugate.apply(x, comm, _seq_reduce_scatter, _seq_gather) if comm.size > 1 else x


@not_traced
def scatter_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's part of a sequence every rank holds whole; allgather backward."""
    return _Conjugate.apply(x, comm, _seq_split, _seq_gather) if comm.size > 1 else x


def _linear_init(out_features: int, in_features: int, bias: bool,
                 dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A full weight and bias drawn exactly as ``nn.Linear.reset_parameters`` draws them."""
    weight = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features)
        b = torch.empty(out_features, dtype=dtype).uniform_(-bound, bound)
    return weight, b


def _check_full(name: str, full: torch.Tensor, shape: tuple[int, ...], layer: str) -> None:
    if tuple(full.shape) != shape:
        raise TensorParallelError(f"{layer}: full {name} has shape {tuple(full.shape)}, expected {shape}")


class _ShardedLinear(nn.Module):
    """Shared parameter handling of the column- and row-parallel linears.

    ``sequence_parallel`` (set by :func:`~.sequence_parallel.apply_sequence_parallel`): the
    activations outside the layer pair are split along the sequence (dim 1) over the tp group;
    the region (attention, MLP) gathers its input, so a column layer takes it as it is, and a
    row layer reduce-scatters its output.
    """

    _split_dim = 0
    sequence_parallel = False

    def __init__(self, in_features: int, out_features: int, tp_comm: Communicator, bias: bool,
                 dtype: Optional[torch.dtype], device: Optional[torch.device] = None, replicas: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features, self.tp_comm = in_features, out_features, tp_comm
        if replicas < 1 or tp_comm.size % replicas or (replicas > 1 and self._split_dim != 0):
            raise TensorParallelError(f"{type(self).__name__}: {replicas} replicas of each piece over tp="
                                      f"{tp_comm.size} (only a column split, by a divisor of tp)")
        self.replicas = replicas
        shard = column_parallel_shard if self._split_dim == 0 else row_parallel_shard
        self._rows, self._cols = shard(out_features, in_features, tp_comm.size // replicas, tp_comm.rank // replicas)
        rows, cols = self._rows.stop - self._rows.start, self._cols.stop - self._cols.start
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device))
        bias_len = rows if self._split_dim == 0 else out_features
        self.bias = nn.Parameter(torch.empty(bias_len, dtype=dtype, device=device)) if bias else None
        # drawn on the host, as a CPU-built nn.Linear draws, then copied to ``device``
        self.load_full(*_linear_init(out_features, in_features, bias, dtype))

    def shard_like(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size tensor shaped like parameter ``name`` (e.g. a gradient)."""
        if name == "weight":
            _check_full(name, full, (self.out_features, self.in_features), type(self).__name__)
            return full[self._rows, self._cols]
        if name == "bias":
            _check_full(name, full, (self.out_features,), type(self).__name__)
            return full[self._rows] if self._split_dim == 0 else full
        raise TensorParallelError(f"{type(self).__name__} has no parameter {name!r}")

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copy this rank's shard of a full ``[out, in]`` weight (and full bias) into the layer."""
        self.weight.copy_(self.shard_like("weight", weight))
        if (bias is None) != (self.bias is None):
            raise TensorParallelError(f"{type(self).__name__}: bias given={bias is not None} but "
                                      f"layer has bias={self.bias is not None}")
        if bias is not None:
            self.bias.copy_(self.shard_like("bias", bias))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_comm.size}, "
                f"shard={tuple(self.weight.shape)}" + (f", replicas={self.replicas}" if self.replicas > 1 else ""))


class ColumnParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with ``W``'s output rows (and ``b``) split over the tp group.

    The output is this rank's slice of ``y`` on the last dim, or the whole ``y``
    with ``gather_output=True``. With ``replicas`` > 1 the rows are split ``tp / replicas`` ways and
    rank ``r`` keeps slice ``r // replicas`` (a key/value projection with fewer heads than tp, each
    head kept by ``replicas`` ranks); the weight's gradient is then partial on each of them and is
    summed over them by the caller (:mod:`.tp_apply`).
    """

    _split_dim = 0

    def __init__(self, in_features: int, out_features: int, tp_comm: Communicator,
                 gather_output: bool = False, bias: bool = True, *, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None, replicas: int = 1) -> None:
        if replicas > 1 and gather_output:
            raise TensorParallelError("ColumnParallelLinear: a replicated split cannot gather its output")
        super().__init__(in_features, out_features, tp_comm, bias, dtype, device, replicas)
        self.gather_output = gather_output

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], tp_comm: Communicator,
                  gather_output: bool = False, replicas: int = 1) -> "ColumnParallelLinear":
        """A layer holding this rank's shard of a full ``[out, in]`` weight and bias, on ``weight``'s device."""
        layer = cls(weight.shape[1], weight.shape[0], tp_comm, gather_output, bias is not None, dtype=weight.dtype,
                    device=weight.device, replicas=replicas)
        layer.load_full(weight, bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = getattr(x, _PART, None) if self.sequence_parallel else None
        if part is not None:  # the region gathered its input (and reduces the input gradient there)
            y = _column_from_sequence(x, part, self.weight, self.bias, self.tp_comm)
        elif self.sequence_parallel:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = F.linear(copy_to_tp_region(x, self.tp_comm), self.weight, self.bias)
        return gather_from_tp_region(y, self.tp_comm) if self.gather_output else y


class RowParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with ``W``'s input columns split; partial products are summed over tp.

    With ``input_is_parallel=True`` (default) ``x`` is already this rank's slice of
    the input's last dim (e.g. a :class:`ColumnParallelLinear` output); else the
    full ``x`` is split here. ``b`` is replicated and added once after the sum.
    """

    _split_dim = 1

    def __init__(self, in_features: int, out_features: int, tp_comm: Communicator,
                 input_is_parallel: bool = True, bias: bool = True, *, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(in_features, out_features, tp_comm, bias, dtype, device)
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], tp_comm: Communicator,
                  input_is_parallel: bool = True) -> "RowParallelLinear":
        """A layer holding this rank's input columns of a full ``[out, in]`` weight, and the bias, on its device."""
        layer = cls(weight.shape[1], weight.shape[0], tp_comm, input_is_parallel, bias is not None,
                    dtype=weight.dtype, device=weight.device)
        layer.load_full(weight, bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_comm)
        if self.sequence_parallel:  # sum the partial products into this rank's part of the sequence
            y = reduce_scatter_sequence(F.linear(x, self.weight), self.tp_comm)
        else:
            y = reduce_from_tp_region(F.linear(x, self.weight), self.tp_comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows (token ids) over the tp group; lookups are summed.

    The vocab is padded to a multiple of ``tp size * multiple``; padding rows are zero.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_comm: Communicator, *,
                 multiple: int = 1, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp_comm = num_embeddings, embedding_dim, tp_comm
        self.padded = padded_vocab_size(num_embeddings, tp_comm.size, multiple)
        self.start, self.end = vocab_parallel_range(num_embeddings, tp_comm.size, tp_comm.rank, multiple)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, embedding_dim, dtype=dtype, device=device))
        self.load_full(torch.randn(num_embeddings, embedding_dim, dtype=dtype))  # as nn.Embedding

    @classmethod
    def from_full(cls, weight: torch.Tensor, tp_comm: Communicator, *, multiple: int = 1) -> "VocabParallelEmbedding":
        """A table holding this rank's rows of a full ``[num_embeddings, dim]`` weight, on its device."""
        layer = cls(weight.shape[0], weight.shape[1], tp_comm, multiple=multiple, dtype=weight.dtype,
                    device=weight.device)
        layer.load_full(weight)
        return layer

    def shard_like(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's (zero-padded) rows of a full-size ``[num_embeddings, dim]`` tensor."""
        if name != "weight":
            raise TensorParallelError(f"VocabParallelEmbedding has no parameter {name!r}")
        _check_full(name, full, (self.num_embeddings, self.embedding_dim), "VocabParallelEmbedding")
        pad = full.new_zeros(self.padded - self.num_embeddings, self.embedding_dim)
        return torch.cat([full, pad])[self.start:self.end]

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a full ``[num_embeddings, dim]`` table into the layer."""
        self.weight.copy_(self.shard_like("weight", weight))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_comm.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return reduce_from_tp_region(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_comm)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_comm.size}, rows=[{self.start}, {self.end})"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """One copy of the logits slice in forward (shifted, exponentiated and normalised in place, kept
    as the softmax) and none in backward (the softmax becomes the gradient), as in Megatron."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Communicator,
                vocab_size: Optional[int], start: Optional[int]) -> torch.Tensor:
        part = logits.shape[-1]
        start = comm.rank * part if start is None else start
        logits = logits.detach()
        if vocab_size is not None and start + part > vocab_size:
            logits = logits.clone()
            logits[..., max(vocab_size - start, 0):] = -math.inf  # padding ids take no probability
        shifted = logits - _allreduce(logits.max(dim=-1).values, comm, "max").unsqueeze(-1)
        outside = (target < start) | (target >= start + part)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        # target logit and sum of exp, both summed over tp, in one allreduce
        picked, sum_exp = _allreduce(torch.stack([picked, exp.sum(dim=-1)]), comm).unbind(0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        ctx.used = False
        return sum_exp.log() - picked

    @staticmethod
    @not_traced
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.used:
            raise TensorParallelError("vocab_parallel_cross_entropy: backward ran twice through one graph "
                                      "(retain_graph=True); its saved softmax became the first gradient")
        ctx.used = True
        softmax, local, outside = ctx.saved_tensors
        softmax.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        return softmax.mul_(grad.unsqueeze(-1)), None, None, None, None


@not_traced
def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, tp_comm: Communicator,
                                 vocab_size: Optional[int] = None, start: Optional[int] = None) -> torch.Tensor:
    """Per-token cross-entropy (``target.shape``) of logits split on the last dim over ``tp_comm``.

    Rank ``r`` holds logits of ids ``[start, start + V_r)`` (default ``start = r * V_r``: equal
    slices); ids ``>= vocab_size`` (vocab padding) are masked out. The full logits are never
    materialised.
    """
    if logits_shard.shape[:-1] != target.shape:
        raise TensorParallelError(f"logits shape {tuple(logits_shard.shape)} does not match "
                                  f"target shape {tuple(target.shape)} (+ vocab dim)")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, tp_comm, vocab_size, start)
