"""mHC's Sinkhorn as one torch custom op, `depthtools::sinkhorn_tokens_last`, and its backward op.

The op takes logits laid out tokens last, z [n_out, n_in, N] (N = every leading dim of the caller's [..., n, n]):
n is tiny (4), and reductions over a contiguous token dim are far faster than over a size-4 last dim
(benchmarks/RESULTS.md). Softmax over dim `first` (0 = down each column: the paper's "rows_last" order; 1 = along
each row: "cols_last"), then 2·t_max - 1 alternating half-steps m ← m / (line sums clamped at the smallest normal
number); the gradient is the exact gradient of the unrolled iteration.

One implementation: the C kernel of library "sinkhorn" (csrc/sinkhorn.c: each token's 4x4 matrix in registers, 64
tokens a block, each half-step a multiply by the reciprocal of the clamped sum) for contiguous CPU float32/float64
when it is built (`cpu_kernels.usable`), else its plain-PyTorch twin (`sinkhorn_torch`, any device and dtype). The
backward recomputes the (cheap) forward for its saved terms, in the kernel and the twin alike. A fake
implementation lets torch.compile and the meta device trace it without running it.

`sinkhorn(logits, t_max, first)` is `reference.sinkhorn`'s signature on the op. Custom ops have no forward-mode
derivative: callers that may run under forward AD or a torch.func transform take `reference.sinkhorn` there
(`hyper.sinkhorn_knopp`, `torch_private.forward_ad_active`).
"""

from __future__ import annotations

import torch

from depthtools.arch import cpu_kernels
from depthtools.arch.sinkhorn_torch import sinkhorn_backward as twin_backward, sinkhorn_forward as twin_forward

# -- the C kernel (library "sinkhorn") --------------------------------------------------------------------------

_FORWARD = cpu_kernels.Kernel("sinkhorn", "sinkhorn_forward", "z out N n t_max first tiny")
_BACKWARD = cpu_kernels.Kernel("sinkhorn", "sinkhorn_backward", "z grad out N n t_max first tiny")


def kernel_forward(z: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """The C kernel's Sinkhorn result [n, n, N] of tokens-last logits z (contiguous; `cpu_kernels.usable(z)`)."""
    n, N = z.shape[0], z.shape[2]
    out = torch.empty_like(z)
    if _FORWARD(z.dtype, z, out, N, n, t_max, first, torch.finfo(z.dtype).tiny):
        raise MemoryError("Sinkhorn CPU kernel: out of memory")
    return out


def kernel_backward(z: torch.Tensor, grad: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """The C kernel's gradient of the logits z [n, n, N] from the result's gradient `grad` (same layout, contiguous)."""
    n, N = z.shape[0], z.shape[2]
    out = torch.empty_like(z)
    if _BACKWARD(z.dtype, z, grad, out, N, n, t_max, first, torch.finfo(z.dtype).tiny):
        raise MemoryError("Sinkhorn CPU kernel: out of memory")
    return out


# -- the op -------------------------------------------------------------------------------------------------------

@torch.library.custom_op("depthtools::sinkhorn_tokens_last", mutates_args=())
def sinkhorn_tokens_last(z: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """Sinkhorn of tokens-last logits z [n_out, n_in, N]; a contiguous result of z's shape."""
    z = z.contiguous()
    if cpu_kernels.usable(z):
        return kernel_forward(z, t_max, first)
    return twin_forward(z, t_max, first)[0].contiguous()


@sinkhorn_tokens_last.register_fake
def _(z, t_max, first):
    return z.new_empty(z.shape)


@torch.library.custom_op("depthtools::sinkhorn_tokens_last_backward", mutates_args=())
def sinkhorn_tokens_last_backward(grad: torch.Tensor, z: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """Gradient of `sinkhorn_tokens_last` w.r.t. z from the result's gradient (recomputes the forward's terms)."""
    grad, z = grad.contiguous(), z.contiguous()
    if cpu_kernels.usable(z, grad):
        return kernel_backward(z, grad, t_max, first)
    _, saved = twin_forward(z, t_max, first)
    return twin_backward(saved, grad).contiguous()


@sinkhorn_tokens_last_backward.register_fake
def _(grad, z, t_max, first):
    return z.new_empty(z.shape)


def _setup(ctx, inputs, output):
    z, t_max, first = inputs
    ctx.save_for_backward(z)
    ctx.t_max, ctx.first = t_max, first


def _backward(ctx, grad):
    (z,) = ctx.saved_tensors
    return sinkhorn_tokens_last_backward(grad, z, ctx.t_max, ctx.first), None, None


sinkhorn_tokens_last.register_autograd(_backward, setup_context=_setup)


def sinkhorn(logits: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """`reference.sinkhorn` (logits [..., n_out, n_in]) on the op: the layout change to tokens last and back is
    differentiable torch ops around it (fused into its neighbours under torch.compile)."""
    n = logits.shape[-1]
    z = logits.reshape(-1, n, n).permute(1, 2, 0).contiguous()
    return sinkhorn_tokens_last(z, t_max, first).permute(2, 0, 1).reshape(logits.shape)
