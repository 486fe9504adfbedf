"""AttnRes' depth-bank kernels as torch custom ops: `depthtools::bank_mix_forward`, `bank_prefix`, `bank_flush`.

The bank (`bankops.DepthBank`) keeps one run's sources in append-only buffers, slot-major: values [cap,N,d],
inv_rms [cap,N] (1/rms of each source), dots [cap,M,N] (each source's key dots with the M mixers' queries). Each op
below is one unit: a typed schema, a fake (shapes only: torch.compile's tracing and the `meta` device), and one
implementation that runs the C kernel (`csrc/bank_impl.h`, library "bank") where `cpu_kernels.bank_usable` says so
(CPU float32/float64, the library built) and its plain-PyTorch twin -- the same computation in torch ops --
everywhere else (CUDA, other dtypes, no compiler). Callers never choose between them.

No autograd is registered on these ops, by design: they are the low-level pieces of `bankops._Mix` / `_Push`,
autograd Functions that own the bank's gradient. A mix's source gradients are not formed in its own backward but
deferred and flushed in bulk into the bank's gradient buffers when the sources' `_Push` backward runs (many mixes
per pass over the buffers: see the comment above `DepthBank`), and the buffers the ops read grow by later pushes
(in-place writes an op-level autograd would have to save and version-check). An autograd formula per op would undo
exactly that batching. `bank_flush` is that backward, and mutates its three gradient buffers.
"""

from typing import Optional

import torch
from torch import Tensor

from depthtools.arch import cpu_kernels

_MIX = cpu_kernels.Kernel("bank", "bank_mix_forward",
                          "values inv_rms dots N d M n col plogit pf n0 mu P p_stride h alpha threads")
_PREFIX = cpu_kernels.Kernel("bank", "bank_prefix", "values inv_rms dots N d M n0 G cols mu P threads")
_FLUSH = cpu_kernels.Kernel("bank", "bank_flush",
                            "values inv_rms dots N d M lo hi K grads weights rhos cols gv gdots ginv threads")


def _dense(*tensors):
    """The tensors as the kernels read them: contiguous (no copy for the bank's buffers, which are)."""
    return tuple(None if x is None else x.contiguous() for x in tensors)


def _out_of_memory(status: int) -> None:
    if status:
        raise MemoryError("AttnRes bank CPU kernel: out of memory")


# -- a mix: logits from the stored key dots, softmax, weighted sum -----------------------------------------------

@torch.library.custom_op("depthtools::bank_mix_forward", mutates_args=())
def bank_mix_forward(values: Tensor, inv_rms: Tensor, dots: Tensor, n: int, col: int, partial: Optional[Tensor],
                     partial_logit: Optional[Tensor], n0: int, mu: Optional[Tensor], P: Optional[Tensor]
                     ) -> tuple[Tensor, Tensor]:
    """(h [N,d], alpha [n(+1), N]) of one depth mix over the first n sources of a bank (values [cap,N,d], inv_rms
    [cap,N], dots [cap,M,N], contiguous), with logits dots[i, col] * inv_rms[i], plus an optional partial source
    [N,d] with its logit [N] (alpha's last row). Two-phase (P given): the sources below n0 enter through mu [N] (the
    max of their logits) and P [N,d] = Σ_{i<n0} exp(logit_i - mu) v_i (rows may be strided: a column of
    `bank_prefix`'s P), see `bankops.DepthBank.prefix_mix`."""
    if cpu_kernels.bank_usable(values):
        return _kernel_mix(values, inv_rms, dots, n, col, partial, partial_logit, n0, mu, P)
    return _torch_mix(values, inv_rms, dots, n, col, partial, partial_logit, n0, mu, P)


@bank_mix_forward.register_fake
def _(values, inv_rms, dots, n, col, partial, partial_logit, n0, mu, P):
    N, d = values.shape[1], values.shape[2]
    return values.new_empty(N, d), values.new_empty(n + (partial is not None), N)


def _kernel_mix(values, inv_rms, dots, n, col, partial, partial_logit, n0, mu, P):
    values, inv_rms, dots, partial, partial_logit, mu = _dense(values, inv_rms, dots, partial, partial_logit, mu)
    if P is not None and P.stride(1) != 1:
        P = P.contiguous()
    N, d, M = values.shape[1], values.shape[2], dots.shape[1]
    h = values.new_empty(N, d)
    alpha = values.new_empty(n + (partial is not None), N)
    if P is None:
        n0 = 0
    _out_of_memory(_MIX(values.dtype, values, inv_rms, dots, N, d, M, n, col, partial_logit, partial, n0, mu, P,
                        0 if P is None else P.stride(0), h, alpha, torch.get_num_threads()))
    return h, alpha


def _torch_mix(values, inv_rms, dots, n, col, partial, partial_logit, n0, mu, P):
    """`bank_mix_forward`'s twin in torch ops."""
    logits = dots[:n, col] * inv_rms[:n]  # [n,N]
    if partial is not None:
        logits = torch.cat([logits, partial_logit.unsqueeze(0)], 0)
    if P is not None:  # two-phase: h = exp(μ - lse) P + Σ_{n0≤i<n} α_i v_i
        lse = torch.logsumexp(logits, dim=0)  # [N]
        alpha = (logits - lse).exp_()  # [n(+1), N]
        h = P * (mu - lse).exp_().unsqueeze(1)
        for i in range(n0, n):
            h.addcmul_(values[i], alpha[i].unsqueeze(1))
    else:
        alpha = torch.softmax(logits, dim=0)  # [n(+1), N]
        if n * values.shape[-1] < 400:  # (bmm's slow per-item kernel below this size: a loop)
            h = values[0] * alpha[0].unsqueeze(1)
            for i in range(1, n):
                h.addcmul_(values[i], alpha[i].unsqueeze(1))
        else:
            h = torch.bmm(alpha[:n].t().contiguous().unsqueeze(1), values[:n].transpose(0, 1)).squeeze(1)  # [N,d]
    if partial is not None:
        h.addcmul_(partial, alpha[n].unsqueeze(1))
    return h, alpha


# -- a group's two-phase prefix -------------------------------------------------------------------------------

@torch.library.custom_op("depthtools::bank_prefix", mutates_args=())
def bank_prefix(values: Tensor, inv_rms: Tensor, dots: Tensor, n0: int, cols: list[int]) -> tuple[Tensor, Tensor]:
    """(mu [G,N], P [N,G,d]): the two-phase prefix of the G mixers `cols` over the first n0 sources of a bank
    (`bankops.DepthBank.prefix_mix`): mu = max_i logit, P = Σ_i exp(logit_i - mu) v_i."""
    if cpu_kernels.bank_usable(values):
        return _kernel_prefix(values, inv_rms, dots, n0, cols)
    return _torch_prefix(values, inv_rms, dots, n0, cols)


@bank_prefix.register_fake
def _(values, inv_rms, dots, n0, cols):
    N, d = values.shape[1], values.shape[2]
    return values.new_empty(len(cols), N), values.new_empty(N, len(cols), d)


def _kernel_prefix(values, inv_rms, dots, n0, cols):
    values, inv_rms, dots = _dense(values, inv_rms, dots)
    N, d, M = values.shape[1], values.shape[2], dots.shape[1]
    G = len(cols)
    mu, P = values.new_empty(G, N), values.new_empty(N, G, d)
    table = torch.tensor(cols, dtype=torch.long)
    _out_of_memory(_PREFIX(values.dtype, values, inv_rms, dots, N, d, M, n0, G, table, mu, P, torch.get_num_threads()))
    return mu, P


def _torch_prefix(values, inv_rms, dots, n0, cols):
    """`bank_prefix`'s twin in torch ops."""
    logits = dots[:n0, cols] * inv_rms[:n0].unsqueeze(1)  # [n0,G,N]
    mu = logits.amax(0)  # [G,N]
    weights = logits.sub_(mu).exp_().permute(2, 1, 0).contiguous()  # [N,G,n0]
    return mu, torch.bmm(weights, values[:n0].transpose(0, 1))  # [N,G,d]


# -- the backward flush: pending mixes into a range of sources' gradients -------------------------------------

@torch.library.custom_op("depthtools::bank_flush", mutates_args=("gv", "gdots", "ginv"))
def bank_flush(values: Tensor, inv_rms: Tensor, dots: Tensor, lo: int, hi: int, grads: list[Tensor],
               weights: list[Tensor], rhos: list[Tensor], cols: list[int], gv: Tensor, gdots: Tensor,
               ginv: Tensor) -> None:
    """Add the contributions of K recorded mixes (output gradients grads K x [N,d], rho = g·h K x [N], softmax
    weights K x [n_k, N] with n_k >= hi, mixer columns cols) to the gradients of sources lo..hi-1, in place:
    gv [cap,N,d], gdots [cap,M,N], ginv [cap,N] (the bank's dtype; the kernel takes contiguous ones, the twin any). Mix k gives dα_i = g·v_i,
    dlogit_i = α_i (dα_i - ρ): gv[i] += α_i g, gdots[i, col] += dlogit_i r_i, ginv[i] += dlogit_i dots[i, col]."""
    if cpu_kernels.bank_usable(values) and gv.is_contiguous() and gdots.is_contiguous() and ginv.is_contiguous():
        _kernel_flush(values, inv_rms, dots, lo, hi, grads, weights, rhos, cols, gv, gdots, ginv)
    else:
        _torch_flush(values, inv_rms, dots, lo, hi, grads, weights, rhos, cols, gv, gdots, ginv)


@bank_flush.register_fake
def _(values, inv_rms, dots, lo, hi, grads, weights, rhos, cols, gv, gdots, ginv):
    return None


def _kernel_flush(values, inv_rms, dots, lo, hi, grads, weights, rhos, cols, gv, gdots, ginv):
    values, inv_rms, dots = _dense(values, inv_rms, dots)
    grads, weights, rhos = (_dense(*xs) for xs in (grads, weights, rhos))  # (kept alive through the call)
    N, d, M = values.shape[1], values.shape[2], dots.shape[1]
    table = torch.tensor([[x.data_ptr() for x in xs] for xs in (grads, weights, rhos)] + [list(cols)], dtype=torch.long)
    _FLUSH(values.dtype, values, inv_rms, dots, N, d, M, lo, hi, len(cols), table[0], table[1], table[2], table[3], gv,
           gdots, ginv, torch.get_num_threads())


def _torch_flush(values, inv_rms, dots, lo, hi, grads, weights, rhos, cols, gv, gdots, ginv):
    """`bank_flush`'s twin in torch ops: one source mix by mix, a range of sources in two batched matmuls."""
    if hi - lo == 1:  # mix by mix
        j = lo
        v, r_j = values[j], inv_rms[j]
        for g, w, rho, col in zip(grads, weights, rhos, cols):
            a = w[j]  # [N]
            dlogit = (torch.linalg.vecdot(g, v) - rho).mul_(a)
            gv[j].addcmul_(g, a.unsqueeze(1))
            gdots[j, col].addcmul_(dlogit, r_j)
            ginv[j].addcmul_(dlogit, dots[j, col])
        return
    G = torch.stack(grads, 1)  # [N,K,d]
    W = torch.stack([w[lo:hi] for w in weights], 0)  # [K,J,N]
    rho = torch.stack(rhos, 0)  # [K,N]
    index = torch.tensor(cols, device=G.device)
    dalpha = torch.bmm(G, values[lo:hi].permute(1, 2, 0)).permute(1, 2, 0)  # [K,J,N] = g·v
    dlogit = dalpha.sub_(rho.unsqueeze(1)).mul_(W)  # softmax backward
    # Σ_mixes α g: [N,J,K] @ [N,K,d]. (bmm wants unit-stride items and an unstrided output, else it falls back to
    # a per-token loop: hence the contiguous copy and the separate add.)
    gv[lo:hi] += torch.bmm(W.permute(2, 1, 0).contiguous(), G).transpose(0, 1)
    gdots[lo:hi].index_add_(1, index, (dlogit * inv_rms[lo:hi]).transpose(0, 1))  # logit = dot · r
    ginv[lo:hi] += (dlogit.transpose(0, 1) * dots[lo:hi, index]).sum(1)
