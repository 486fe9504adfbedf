"""mHC's Sinkhorn as torch ops, tokens last: the plain-PyTorch twin of the C kernel (csrc/sinkhorn.c).

`sinkhorn_forward` / `sinkhorn_backward` run on any device and dtype: the ops `depthtools::sinkhorn_tokens_last`
(ops/sinkhorn.py) and the twin of `depthtools::mhc_connect` (ops/connector.py) run them where the C kernel does not
apply (not CPU float32/float64, or no C compiler). Layout: [n_out, n_in, N], N = tokens.
"""

from __future__ import annotations

import torch


def half_step_dim(step: int, first: int) -> int:
    """Dim normalised by half-step `step` after a softmax over dim `first` (they alternate)."""
    return (first + 1 + step) % 2


def sinkhorn_loop(p: torch.Tensor, t_max: int, tiny: float, first: int = 1):
    """2·t_max - 1 half-steps y = m / s on [n_out, n_in, N], alternating, starting with the dim
    the softmax did not normalise (`first`: 1 = rows were first, 0 = columns): (result, ys, ss)."""
    m = p
    ys: list[torch.Tensor] = []
    ss: list[torch.Tensor] = []
    for step in range(2 * t_max - 1):
        s = m.sum(half_step_dim(step, first), keepdim=True).clamp_min_(tiny)  # dim 0 = column sums, 1 = row sums
        m = m / s
        ys.append(m)
        ss.append(s)
    return m, ys, ss


def sinkhorn_loop_backward(g: torch.Tensor, p: torch.Tensor, ys: list[torch.Tensor], ss: list[torch.Tensor],
                            first: int = 1):
    """Gradient of the softmax logits from the gradient g of the result (same order as the forward)."""
    for step in range(len(ys) - 1, -1, -1):
        g = (g - (g * ys[step]).sum(half_step_dim(step, first), keepdim=True)) / ss[step]
    return p * (g - (g * p).sum(first, keepdim=True))  # softmax backward over the first dim


def sinkhorn_forward(z: torch.Tensor, t_max: int, first: int = 1):
    """Sinkhorn of tokens-last logits z [n_out, n_in, N]: (result [n,n,N], saved for backward).

    Softmax over dim `first` (exp + the first normalisation: 0 = columns, the paper's "rows_last"
    order; 1 = rows, "cols_last"), then 2·t_max - 1 alternating half-steps y = m / s, s =
    m.sum(dim) (clamped at the smallest normal so an underflowed line cannot give 0/0).
    """
    p = torch.softmax(z, dim=first)
    m, ys, ss = sinkhorn_loop(p, t_max, torch.finfo(z.dtype).tiny, first)
    return m, (p, ys, ss, first)


def sinkhorn_backward(saved, g: torch.Tensor) -> torch.Tensor:
    """Gradient of the logits from the gradient g [n,n,N] of the result: half-step backward
    dm = (g - Σ_dim g·y) / s in reverse order, then the softmax backward."""
    p, ys, ss, first = saved
    return sinkhorn_loop_backward(g, p, ys, ss, first)
