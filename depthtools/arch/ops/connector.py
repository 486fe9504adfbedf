"""HC's and mHC's whole connectors as torch custom ops: `depthtools::hc_connect`, `depthtools::mhc_connect` (and
their backward ops) -- the C kernels of library "connector" (csrc/connector.c; cpu_kernels builds them), one per
direction.

At d = 64 a connector is many small operations on a 1 MB stream state, so its cost is call overhead and passes
over that state. Each op is the whole connector in one autograd node, one pass over the streams per direction:

    hc_connect(H, W_a, w_b, S_a, s_b, s_a, s_beta, eps)                      (reference.hc_connect)
        raw = H_s · [W_a | w_b] per stream s, inv = 1/rms(H_s), t = tanh(raw · inv)
        coeffs = [S_a | s_b] + [s_a … s_a | s_beta] ⊙ t    [N, n, n+2];  [w; R] = coeffs[..., :n+1]ᵀ, β = coeffs[..., n+1]
        -> (out = [w; R] @ H [N, n+1, d], β [N, n], raw [N, n, n+2], inv [N, n], t [N, n, n+2])
    mhc_connect(H, φ_pre, φ_post, φ_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first)
        x = vec H, raw = x · [φ_pre | φ_post | φ_res], inv = 1/rms(x), mix = raw · inv  (reference.mhc_connect)
        H_pre = σ(g_pre·mix_pre + b_pre), H_post = 2σ(g_post·mix_post + b_post),
        H_res = Sinkhorn(g_res·mat(mix_res) + b_res) (ops.sinkhorn's iteration)
        -> (out = [H_pre; H_res] @ H [N, n+1, d], H_post [N, n], raw [N, 2n+n²], inv [N])

raw, inv (and HC's t) are outputs only so that autograd saves them for the kernel's backward. The connector's math
exists twice: the plain-autograd reference (depthtools/arch/reference.py) and the C kernels. Callers take the op
only where the kernel takes the inputs (`uses_op`: CPU float32/float64, the library built); everywhere else they
run the reference itself, with plain autograd (which inductor fuses in the compiled step off CPU). Called on
inputs the kernel does not take, an op still answers, from the reference: its forward without autograd, and its
autograd formula by autograd of the reference re-run from the inputs -- no third, hand-written form (the backward
ops are the kernel's backward only). The kernels' backward
is tested against autograd of the reference (tests/test_compile.py, tests/test_fused_reference.py: values, every
gradient, gradcheck). Fake implementations let torch.compile and the meta device trace the ops without running
them.

`hc_connect` / `mhc_connect` below have the references' signatures and return (u, R H, β). Custom ops have no
forward-mode derivative (under torch.func.jvp one silently yields a zero tangent) and no torch.func.grad rule, so
`uses_op` sends a connector under forward AD or a torch.func transform to the reference (plain autograd).
"""

from __future__ import annotations

import torch

from depthtools.arch import cpu_kernels, reference
from depthtools.arch.torch_private import forward_ad_active


def uses_op(*tensors: torch.Tensor) -> bool:
    """Whether a connector on these tensors (streams first, then its parameters) runs as its op: where its C kernel
    takes them (`cpu_kernels.connector_usable`: CPU float32/float64, the library built; traced by torch.compile
    too, where the kernel beats inductor's code), and not when forward AD or a torch.func transform may see it
    (`torch_private.forward_ad_active`). Otherwise the caller runs the reference."""
    if not cpu_kernels.connector_usable(*tensors):
        return False
    return torch.compiler.is_compiling() or not forward_ad_active(*tensors)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy (an op's outputs may not be views of one another)."""
    return t.clone(memory_format=torch.contiguous_format)


# -- the C kernels (library "connector"): the parameters in their layout, and the ctypes calls --------------------

def hc_pack(Wa, wb, Sa, sb, sa, sbeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HC's parameters in the kernels' layout: Pt = [W_a | w_b]ᵀ [n+2, d], S = [S_a | s_b] [n, n+2] and
    scale = [s_a (n+1 times), s_beta] [n+2], all contiguous."""
    n = Sa.shape[0]
    return (torch.cat([Wa, wb.unsqueeze(1)], 1).t().contiguous(), torch.cat([Sa, sb.unsqueeze(1)], 1),
            torch.cat([sa.expand(n + 1), sbeta.reshape(1)]))


def mhc_pack(phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res) -> tuple[torch.Tensor, ...]:
    """mHC's parameters in the kernels' layout: (PhiT = [φ_pre | φ_post | φ_res]ᵀ [2n+n², n·d], gates
    (g_pre, g_post, g_res) [3], b_pre, b_post, b_res flattened row-major [n²]), all contiguous."""
    return (torch.cat([phi_pre, phi_post, phi_res], 1).t().contiguous(), torch.stack([g_pre, g_post, g_res]),
            b_pre.contiguous(), b_post.contiguous(), b_res.reshape(-1).contiguous())


_HC_FORWARD = cpu_kernels.Kernel("connector", "hc_connect_forward", "H Pt S scale N n d eps out depth raw inv tt threads")
_HC_BACKWARD = cpu_kernels.Kernel("connector", "hc_connect_backward",
                                  "H Pt S scale raw inv tt g_out g_depth N n d gH gPt gS gscale threads")
_MHC_FORWARD = cpu_kernels.Kernel("connector", "mhc_connect_forward",
                                  "H PhiT gates b_pre b_post b_res N n d eps t_max first tiny out depth raw inv threads")
_MHC_BACKWARD = cpu_kernels.Kernel("connector", "mhc_connect_backward",
                                   "H PhiT gates b_pre b_post b_res raw inv g_out g_depth N n d t_max first tiny "
                                   "gH gPhiT g_gates g_b_pre g_b_post g_b_res threads")
_TANH_F32 = cpu_kernels.Kernel("connector", "tanh_f32_array", "x y n", generic=False)
_EXP_F32 = cpu_kernels.Kernel("connector", "exp_f32_array", "x y n", generic=False)


def hc_kernel_forward(H: torch.Tensor, Pt: torch.Tensor, S: torch.Tensor, scale: torch.Tensor, eps: float):
    """The HC connector's C kernel on streams H [N,n,d] (all contiguous, `connector_usable`):
    (out [N,n+1,d], depth [N,n], raw [N,n,n+2], inv [N,n], t [N,n,n+2]) for the packed parameters (`hc_pack`)."""
    N, n, d = H.shape
    out, depth = H.new_empty(N, n + 1, d), H.new_empty(N, n)
    raw, inv, t = H.new_empty(N, n, n + 2), H.new_empty(N, n), H.new_empty(N, n, n + 2)
    _HC_FORWARD(H.dtype, H, Pt, S, scale, N, n, d, eps, out, depth, raw, inv, t, torch.get_num_threads())
    return out, depth, raw, inv, t


def hc_kernel_backward(H, Pt, S, scale, raw, inv, t, g_out, g_depth):
    """(dL/dH, dL/dPt, dL/dS, dL/dscale) from the gradients g_out [N,n+1,d], g_depth [N,n] of `hc_kernel_forward`'s
    first two outputs (all contiguous); parameter gradients summed in float64 per fixed chunk of tokens."""
    N, n, d = H.shape
    gH, gPt, gS, gscale = torch.empty_like(H), torch.empty_like(Pt), torch.empty_like(S), torch.empty_like(scale)
    if _HC_BACKWARD(H.dtype, H, Pt, S, scale, raw, inv, t, g_out, g_depth, N, n, d, gH, gPt, gS, gscale,
                    torch.get_num_threads()):
        raise MemoryError("HC connector CPU kernel: out of memory")
    return gH, gPt, gS, gscale


def mhc_kernel_forward(H: torch.Tensor, PhiT: torch.Tensor, gates: torch.Tensor, b_pre: torch.Tensor,
                       b_post: torch.Tensor, b_res: torch.Tensor, eps: float, t_max: int, first: int):
    """The mHC connector's C kernel on streams H [N,n,d] (all contiguous, `connector_usable`; parameters packed by
    `mhc_pack`): (out [N,n+1,d], H_post [N,n], raw [N,J], inv [N]), J = 2n + n²; the Sinkhorn as ops.sinkhorn's."""
    N, n, d = H.shape
    J = PhiT.shape[0]
    out, depth, raw, inv = H.new_empty(N, n + 1, d), H.new_empty(N, n), H.new_empty(N, J), H.new_empty(N)
    if _MHC_FORWARD(H.dtype, H, PhiT, gates, b_pre, b_post, b_res, N, n, d, eps, t_max, first,
                    torch.finfo(H.dtype).tiny, out, depth, raw, inv, torch.get_num_threads()):
        raise MemoryError("mHC connector CPU kernel: out of memory")
    return out, depth, raw, inv


def mhc_kernel_backward(H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth, t_max: int, first: int):
    """(dL/dH, dL/dPhiT, dL/dgates, dL/db_pre, dL/db_post, dL/db_res) from the gradients g_out [N,n+1,d],
    g_depth [N,n] of `mhc_kernel_forward`'s first two outputs; parameter gradients summed in float64."""
    N, n, d = H.shape
    grads = [torch.empty_like(x) for x in (H, PhiT, gates, b_pre, b_post, b_res)]
    if _MHC_BACKWARD(H.dtype, H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth, N, n, d, t_max, first,
                     torch.finfo(H.dtype).tiny, *grads, torch.get_num_threads()):
        raise MemoryError("mHC connector CPU kernel: out of memory")
    return tuple(grads)


def tanh_f32(x: torch.Tensor) -> torch.Tensor:
    """The connector kernels' float32 tanh over a contiguous float32 tensor (for tests)."""
    y = torch.empty_like(x)
    _TANH_F32(None, x, y, x.numel())
    return y


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """The connector kernels' float32 exp over a contiguous float32 tensor (for tests)."""
    y = torch.empty_like(x)
    _EXP_F32(None, x, y, x.numel())
    return y


# -- without the kernel: the reference, and autograd of it --------------------------------------------------------

def _outputs(u: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """The ops' first output [u; R H] [N, n+1, d] from the reference's (u [N,d], R H [N,n,d])."""
    return torch.cat([u.unsqueeze(1), mixed], 1)


def _reference_grads(connect, inputs, g_out: torch.Tensor, g_depth: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of `connect`'s tensor inputs (the leading tensors of `inputs`; its other arguments follow) for
    output gradients g_out [N,n+1,d] (of [u; R H]) and g_depth [N,n] (of β / H_post): autograd of the reference
    `connect`, re-run from the inputs: the ops' autograd formula where the kernel does not apply (it runs at the
    autograd level, outside any op's implementation, so plain autograd records the re-run)."""
    tensors = [x.detach().requires_grad_(True) for x in inputs if isinstance(x, torch.Tensor)]
    with torch.enable_grad():
        u, mixed, depth = connect(*tensors, *inputs[len(tensors):])
        grads = torch.autograd.grad((_outputs(u, mixed), depth), tensors, (g_out, g_depth), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(tensors, grads)]


def _kernel_only(op: str):
    return RuntimeError(f"depthtools::{op} is the C kernel's backward (CPU float32/float64, the library built); "
                        "elsewhere the forward op's autograd takes autograd of the reference")


def hc_reference_forward(H, Wa, wb, Sa, sb, sa, sbeta, eps):
    """`hc_connect_op`'s outputs where the kernel does not apply: `reference.hc_connect` and its terms
    (`reference.hc_terms`), without autograd."""
    N, n, _ = H.shape
    with torch.no_grad():
        u, mixed, beta = reference.hc_connect(H, Wa, wb, Sa, sb, sa, sbeta, eps)
        raw, inv, t = reference.hc_terms(H, Wa, wb, eps)
    return _outputs(u, mixed), beta.contiguous(), raw.view(N, n, n + 2), inv.view(N, n), t.contiguous()


# -- HC: the op -----------------------------------------------------------------------------------------------------

@torch.library.custom_op("depthtools::hc_connect", mutates_args=())
def hc_connect_op(H: torch.Tensor, Wa: torch.Tensor, wb: torch.Tensor, Sa: torch.Tensor, sb: torch.Tensor,
                  sa: torch.Tensor, sbeta: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out = [w; R] @ H [N,n+1,d], β [N,n], raw, inv, t): the HC connector on streams H [N,n,d] (module docstring)."""
    H = H.contiguous()
    if cpu_kernels.connector_usable(H, Wa, wb, Sa, sb, sa, sbeta):
        return hc_kernel_forward(H, *hc_pack(Wa, wb, Sa, sb, sa, sbeta), eps)
    return hc_reference_forward(H, Wa, wb, Sa, sb, sa, sbeta, eps)


@hc_connect_op.register_fake
def _(H, Wa, wb, Sa, sb, sa, sbeta, eps):
    N, n, d = H.shape
    return (H.new_empty(N, n + 1, d), H.new_empty(N, n), H.new_empty(N, n, n + 2), H.new_empty(N, n),
            H.new_empty(N, n, n + 2))


@torch.library.custom_op("depthtools::hc_connect_backward", mutates_args=())
def hc_connect_backward_op(H: torch.Tensor, Wa: torch.Tensor, wb: torch.Tensor, Sa: torch.Tensor, sb: torch.Tensor,
                           sa: torch.Tensor, sbeta: torch.Tensor, raw: torch.Tensor, inv: torch.Tensor,
                           t: torch.Tensor, g_out: torch.Tensor, g_depth: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of `hc_connect_op`'s tensor inputs (H, W_a, w_b, S_a, s_b, s_a, s_beta) from those of its
    first two outputs, with its saved raw, inv, t: the C kernel's backward (only: see `_kernel_only`)."""
    H, raw, inv, t, g_out, g_depth = (x.contiguous() for x in (H, raw, inv, t, g_out, g_depth))
    if not cpu_kernels.connector_usable(H, Wa, wb, Sa, sb, sa, sbeta, g_out, g_depth):
        raise _kernel_only("hc_connect_backward")
    n = H.shape[1]
    gH, gPt, gS, g_scale = hc_kernel_backward(H, *hc_pack(Wa, wb, Sa, sb, sa, sbeta), raw, inv, t, g_out, g_depth)
    return [gH, gPt[: n + 1].t().contiguous(), _own(gPt[n + 1]), gS[:, : n + 1].contiguous(),
            gS[:, n + 1].contiguous(), g_scale[: n + 1].sum(), _own(g_scale[n + 1])]


@hc_connect_backward_op.register_fake
def _(H, Wa, wb, Sa, sb, sa, sbeta, raw, inv, t, g_out, g_depth):
    return [x.new_empty(x.shape) for x in (H, Wa, wb, Sa, sb, sa, sbeta)]


def _hc_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7], *output[2:])
    ctx.mark_non_differentiable(*output[2:])
    ctx.eps = inputs[7]


def _hc_backward(ctx, g_out, g_depth, *_):
    H, Wa, wb, Sa, sb, sa, sbeta, raw, inv, t = ctx.saved_tensors
    N, n, d = H.shape
    g_out = H.new_zeros(N, n + 1, d) if g_out is None else g_out
    g_depth = H.new_zeros(N, n) if g_depth is None else g_depth
    if not cpu_kernels.connector_usable(H, Wa, wb, Sa, sb, sa, sbeta, g_out, g_depth):
        return (*_reference_grads(reference.hc_connect, (H, Wa, wb, Sa, sb, sa, sbeta, ctx.eps), g_out, g_depth), None)
    return (*hc_connect_backward_op(H, Wa, wb, Sa, sb, sa, sbeta, raw, inv, t, g_out, g_depth), None)


hc_connect_op.register_autograd(_hc_backward, setup_context=_hc_setup)


def _branch_and_streams(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u [N,d], R H [N,n,d]): views of an op's out = [u; R H] [N,n+1,d]. By `split`, whose backward is one cat of
    the two gradients: indexing (out[:, 0], out[:, 1:]) would make autograd build two zero-filled [N,n+1,d] tensors
    and add them (+~25 ms per L32 d64 HC step in the profiler)."""
    u, mixed = out.split([1, out.shape[1] - 1], 1)
    return u.squeeze(1), mixed


def hc_connect(H, Wa, wb, Sa, sb, sa, sbeta, eps):
    """`reference.hc_connect` on the op: (u [N,d], R H [N,n,d], β [N,n]) for streams H [N,n,d]."""
    out, depth, *_ = hc_connect_op(H, Wa, wb, Sa, sb, sa, sbeta, eps)
    return (*_branch_and_streams(out), depth)


# -- mHC: without the kernel ------------------------------------------------------------------------------------

def mhc_reference_forward(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max,
                          first):
    """`mhc_connect_op`'s outputs where the kernel does not apply: `reference.mhc_connect` and its terms
    (`reference.mhc_terms`), without autograd."""
    N = H.shape[0]
    with torch.no_grad():
        u, mixed, h_post = reference.mhc_connect(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post,
                                                 b_res, eps, t_max, first)
        raw, inv = reference.mhc_terms(H, phi_pre, phi_post, phi_res, eps)
    return _outputs(u, mixed), h_post.contiguous(), raw.contiguous(), inv.view(N)


# -- mHC: the op ----------------------------------------------------------------------------------------------------

@torch.library.custom_op("depthtools::mhc_connect", mutates_args=())
def mhc_connect_op(H: torch.Tensor, phi_pre: torch.Tensor, phi_post: torch.Tensor, phi_res: torch.Tensor,
                   g_pre: torch.Tensor, g_post: torch.Tensor, g_res: torch.Tensor, b_pre: torch.Tensor,
                   b_post: torch.Tensor, b_res: torch.Tensor, eps: float, t_max: int, first: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out = [H_pre; H_res] @ H [N,n+1,d], H_post [N,n], raw, inv): the mHC connector on streams H [N,n,d]."""
    H = H.contiguous()
    params = (phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res)
    if cpu_kernels.connector_usable(H, *params):
        return mhc_kernel_forward(H, *mhc_pack(*params), eps, t_max, first)
    return mhc_reference_forward(H, *params, eps, t_max, first)


@mhc_connect_op.register_fake
def _(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first):
    N, n, d = H.shape
    J = phi_pre.shape[1] + phi_post.shape[1] + phi_res.shape[1]
    return H.new_empty(N, n + 1, d), H.new_empty(N, n), H.new_empty(N, J), H.new_empty(N)


@torch.library.custom_op("depthtools::mhc_connect_backward", mutates_args=())
def mhc_connect_backward_op(H: torch.Tensor, phi_pre: torch.Tensor, phi_post: torch.Tensor, phi_res: torch.Tensor,
                            g_pre: torch.Tensor, g_post: torch.Tensor, g_res: torch.Tensor, b_pre: torch.Tensor,
                            b_post: torch.Tensor, b_res: torch.Tensor, raw: torch.Tensor, inv: torch.Tensor,
                            g_out: torch.Tensor, g_depth: torch.Tensor, t_max: int, first: int) -> list[torch.Tensor]:
    """The gradients of `mhc_connect_op`'s ten tensor inputs from those of its first two outputs (saved raw, inv):
    the C kernel's backward (only: see `_kernel_only`)."""
    H, raw, inv, g_out, g_depth = (x.contiguous() for x in (H, raw, inv, g_out, g_depth))
    params = (phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res)
    if not cpu_kernels.connector_usable(H, *params, g_out, g_depth):
        raise _kernel_only("mhc_connect_backward")
    n = H.shape[1]
    gH, g_phi_t, g_gates, g_b_pre, g_b_post, g_b_res = mhc_kernel_backward(
        H, *mhc_pack(*params), raw, inv, g_out, g_depth, t_max, first)
    return [gH, g_phi_t[:n].t().contiguous(), g_phi_t[n : 2 * n].t().contiguous(), g_phi_t[2 * n :].t().contiguous(),
            *(_own(g) for g in g_gates), g_b_pre, g_b_post, g_b_res.view(n, n)]


@mhc_connect_backward_op.register_fake
def _(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, raw, inv, g_out, g_depth, t_max,
      first):
    return [x.new_empty(x.shape) for x in (H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res)]


def _mhc_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10], *output[2:])
    ctx.mark_non_differentiable(*output[2:])
    ctx.eps, ctx.t_max, ctx.first = inputs[10:]


def _mhc_backward(ctx, g_out, g_depth, *_):
    H, *params, raw, inv = ctx.saved_tensors
    N, n, d = H.shape
    g_out = H.new_zeros(N, n + 1, d) if g_out is None else g_out
    g_depth = H.new_zeros(N, n) if g_depth is None else g_depth
    if not cpu_kernels.connector_usable(H, *params, g_out, g_depth):
        grads = _reference_grads(reference.mhc_connect, (H, *params, ctx.eps, ctx.t_max, ctx.first), g_out, g_depth)
    else:
        grads = mhc_connect_backward_op(H, *params, raw, inv, g_out, g_depth, ctx.t_max, ctx.first)
    return (*grads, None, None, None)


mhc_connect_op.register_autograd(_mhc_backward, setup_context=_mhc_setup)


def mhc_connect(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first):
    """`reference.mhc_connect` on the op: (u [N,d], H_res H [N,n,d], H_post [N,n]) for streams H [N,n,d]."""
    out, depth, *_ = mhc_connect_op(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps,
                                    t_max, first)
    return (*_branch_and_streams(out), depth)
