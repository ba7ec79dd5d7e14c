"""One block of attention with its log-sum-exp, forward and backward (flash attention's maths).

On the CPU these are ATen's flash kernels (``_scaled_dot_product_flash_attention_for_cpu``
and its backward: memory linear in the sequence); elsewhere the same maths written out
(the scores of one block are formed whole). Tensors are ``[batch, heads, seq, head_dim]``;
the log-sum-exp is ``[batch, heads, seq]`` in fp32.
"""

from __future__ import annotations

import torch

__all__ = ["attend", "attend_backward", "repeat_heads"]


def _cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _causal_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(m - n + 1), float("-inf"))
    return s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(q k^T * scale) v, logsumexp)``; ``causal``: query ``i`` sees keys ``j <= i``."""
    if _cpu(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    s = _causal_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    return out, lse


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """Gradients of one block for the whole attention's ``out`` and ``lse`` (its rows' totals)."""
    if _cpu(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(  # takes strided views
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    p = torch.exp(_causal_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.float().transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (head ``h`` serves queries ``h*g .. h*g+g-1``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)
