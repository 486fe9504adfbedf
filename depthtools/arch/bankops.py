"""Memory-light operations over a bank of same-shape source tensors (AttnRes, DenseFormer).

Cross-layer schemes mix a growing bank of n sources [B,T,d] at every step. Written naively
(`torch.stack` then `einsum`), autograd keeps each step's stacked copy for backward: O(L²·B·T·d)
activation memory, which at depth dominates the whole model. The two functions here compute the
same contractions source by source (no stacked copy is ever made — copying the bank at every
step costs more than the mixing itself) and save only *references* to the sources (alive anyway)
plus small [B,T,n] tensors. Each source gets its own gradient tensor: views into one [n,...]
gradient would keep it alive until every source's gradient is accumulated. First-order only.

    weighted_sum(w, sources)          = Σ_i w[..., i] · v_i              -> [B,T,d]
    bank_logits(q, sources, inv_rms)  = [ r_i · (v_i · q) ]_i            -> [B,T,n]

With r_i = 1/rms(v_i) and q = query ⊙ gamma, `bank_logits` is query · RMSNorm_gamma(v_i) — the
AttnRes key logits — without materialising the n normalised keys.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1/sqrt(mean(x²) + eps) over the last dimension: [B,T,d] -> [B,T] (what RMSNorm divides by)."""
    return x.pow(2).mean(-1).add(eps).rsqrt()


class _WeightedSum(torch.autograd.Function):
    """out = Σ_i w[..., i] v_i; w is [n] (one scalar per source) or [*lead, n] (per token)."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weights, *sources)  # references, not copies
        w = _per_source(weights)
        out = sources[0] * w[0]
        for i in range(1, len(sources)):
            out.addcmul_(sources[i], w[i])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        weights, *sources = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[0]:  # d out / d w_i = <grad_out, v_i> (per token, or summed)
            if weights.dim() == 1:
                grad_w = torch.stack([torch.dot(grad_out.flatten(), v.flatten()) for v in sources])
            else:
                grad_w = torch.stack([torch.linalg.vecdot(grad_out, v) for v in sources], -1)
        w = _per_source(weights)
        grad_sources = tuple(grad_out * w[i] if ctx.needs_input_grad[1 + i] else None for i in range(len(sources)))
        return (grad_w, *grad_sources)


def _per_source(weights: torch.Tensor) -> list[torch.Tensor]:
    """Weight of each source, broadcastable against a source [*lead,d]: scalar, or [*lead,1]."""
    return list(weights.unbind(0)) if weights.dim() == 1 else list(weights.unsqueeze(-1).unbind(-2))


class _BankLogits(torch.autograd.Function):
    """logits[..., i] = r_i · (v_i · q) for sources v_i [*lead,d], scales r_i [*lead], q [d]."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, n: int, *tensors: torch.Tensor) -> torch.Tensor:
        sources, scales = tensors[:n], tensors[n:]
        dots = torch.stack([v @ query for v in sources], -1)  # [*lead,n]
        ctx.n = n
        ctx.save_for_backward(query, dots, *tensors)  # dots is small: [*lead,n]
        return dots * torch.stack(scales, -1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        query, dots, *tensors = ctx.saved_tensors
        n = ctx.n
        sources, scales = tensors[:n], tensors[n:]
        grad_dots = grad_out * torch.stack(scales, -1)  # [*lead,n]
        g = grad_dots.unbind(-1)
        acc = sources[0] * g[0].unsqueeze(-1)  # Σ_i g_i v_i per token, then summed: dL/dq
        for i in range(1, n):
            acc.addcmul_(sources[i], g[i].unsqueeze(-1))
        grad_q = acc.flatten(0, -2).sum(0)
        grad_sources = tuple(g[i].unsqueeze(-1) * query for i in range(n))  # separate tensors
        grad_scales = (grad_out * dots).unbind(-1)
        return (grad_q, None, *grad_sources, *grad_scales)


def weighted_sum(weights: torch.Tensor, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Σ_i weights[..., i] · sources[i]; weights [n] or [B,T,n], sources n × [B,T,d] -> [B,T,d]."""
    return _WeightedSum.apply(weights, *sources)


def bank_logits(query: torch.Tensor, sources: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[B,T,n] logits r_i · (v_i · query) for sources n × [B,T,d] and scales n × [B,T]."""
    return _BankLogits.apply(query, len(sources), *sources, *scales)
