"""HC's and mHC's whole connectors as torch custom ops: `depthtools::hc_connect`, `depthtools::mhc_connect` (and
their backward ops).

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

raw, inv (and HC's t) are outputs only so that autograd saves them for the backward op. One implementation each:
the C kernels of library "connector" (csrc/connector.c; cpu_kernels builds them) for CPU float32/float64 when
built (`cpu_kernels.connector_usable`), else the plain-PyTorch twin below -- the hand-written torch-op forward and
backward the eager connectors had (what CUDA eager runs): a few large ops, tokens last where n is the short dim,
rather than a vjp of the reference (which would recompute the forward and record ~30 autograd nodes per call).
Fake implementations let torch.compile and the meta device trace the ops without running them.

`hc_connect` / `mhc_connect` below have the references' signatures and return (u, R H, β). Custom ops have no
forward-mode derivative (under torch.func.jvp one silently yields a zero tangent) and no torch.func.grad rule, so
`uses_op` sends a connector under forward AD or a torch.func transform to the reference (plain autograd).
"""

from __future__ import annotations

import torch

from depthtools.arch import cpu_kernels
from depthtools.arch.layers import fused_inverse_rms, inverse_rms_derivative
from depthtools.arch.sinkhorn_torch import sinkhorn_backward, sinkhorn_forward
from depthtools.arch.torch_private import forward_ad_active


def uses_op(*tensors: torch.Tensor) -> bool:
    """Whether a connector on these tensors (streams first, then its parameters) runs as its op: not when forward AD
    or a torch.func transform may see it (`torch_private.forward_ad_active`: the reference then); traced by
    torch.compile only on CPU, where the C kernel beats inductor's code (elsewhere inductor fuses the reference)."""
    if torch.compiler.is_compiling():
        return tensors[0].device.type == "cpu"
    return not forward_ad_active(*tensors)


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


def _kernel(name: str, t: torch.Tensor):
    return cpu_kernels.function("connector", name, t.dtype)


def hc_kernel_forward(H: torch.Tensor, Pt: torch.Tensor, S: torch.Tensor, scale: torch.Tensor, eps: float):
    """The HC connector's C kernel on streams H [N,n,d] (all contiguous, `connector_usable`):
    (out [N,n+1,d], depth [N,n], raw [N,n,n+2], inv [N,n], t [N,n,n+2]) for the packed parameters (`hc_pack`)."""
    N, n, d = H.shape
    out, depth = H.new_empty(N, n + 1, d), H.new_empty(N, n)
    raw, inv, t = H.new_empty(N, n, n + 2), H.new_empty(N, n), H.new_empty(N, n, n + 2)
    _kernel("hc_connect_forward", H)(H.data_ptr(), Pt.data_ptr(), S.data_ptr(), scale.data_ptr(), N, n, d, eps,
                                     out.data_ptr(), depth.data_ptr(), raw.data_ptr(), inv.data_ptr(), t.data_ptr(),
                                     torch.get_num_threads())
    return out, depth, raw, inv, t


def hc_kernel_backward(H, Pt, S, scale, raw, inv, t, g_out, g_depth):
    """(dL/dH, dL/dPt, dL/dS, dL/dscale) from the gradients g_out [N,n+1,d], g_depth [N,n] of `hc_kernel_forward`'s
    first two outputs (all contiguous); parameter gradients summed in float64 per fixed chunk of tokens."""
    N, n, d = H.shape
    gH, gPt, gS, gscale = torch.empty_like(H), torch.empty_like(Pt), torch.empty_like(S), torch.empty_like(scale)
    if _kernel("hc_connect_backward", H)(H.data_ptr(), Pt.data_ptr(), S.data_ptr(), scale.data_ptr(), raw.data_ptr(),
                                         inv.data_ptr(), t.data_ptr(), g_out.data_ptr(), g_depth.data_ptr(), N, n, d,
                                         gH.data_ptr(), gPt.data_ptr(), gS.data_ptr(), gscale.data_ptr(),
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
    if _kernel("mhc_connect_forward", H)(H.data_ptr(), PhiT.data_ptr(), gates.data_ptr(), b_pre.data_ptr(),
                                         b_post.data_ptr(), b_res.data_ptr(), N, n, d, eps, t_max, first,
                                         torch.finfo(H.dtype).tiny, out.data_ptr(), depth.data_ptr(), raw.data_ptr(),
                                         inv.data_ptr(), torch.get_num_threads()):
        raise MemoryError("mHC connector CPU kernel: out of memory")
    return out, depth, raw, inv


def mhc_kernel_backward(H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth, t_max: int, first: int):
    """(dL/dH, dL/dPhiT, dL/dgates, dL/db_pre, dL/db_post, dL/db_res) from the gradients g_out [N,n+1,d],
    g_depth [N,n] of `mhc_kernel_forward`'s first two outputs; parameter gradients summed in float64."""
    N, n, d = H.shape
    grads = [torch.empty_like(x) for x in (H, PhiT, gates, b_pre, b_post, b_res)]
    if _kernel("mhc_connect_backward", H)(H.data_ptr(), PhiT.data_ptr(), gates.data_ptr(), b_pre.data_ptr(),
                                          b_post.data_ptr(), b_res.data_ptr(), raw.data_ptr(), inv.data_ptr(),
                                          g_out.data_ptr(), g_depth.data_ptr(), N, n, d, t_max, first,
                                          torch.finfo(H.dtype).tiny, *(g.data_ptr() for g in grads),
                                          torch.get_num_threads()):
        raise MemoryError("mHC connector CPU kernel: out of memory")
    return tuple(grads)


def tanh_f32(x: torch.Tensor) -> torch.Tensor:
    """The connector kernels' float32 tanh over a contiguous float32 tensor (for tests)."""
    y = torch.empty_like(x)
    cpu_kernels.library("connector").tanh_f32_array(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """The connector kernels' float32 exp over a contiguous float32 tensor (for tests)."""
    y = torch.empty_like(x)
    cpu_kernels.library("connector").exp_f32_array(x.data_ptr(), y.data_ptr(), x.numel())
    return y


# -- HC: the twin (torch ops) ---------------------------------------------------------------------------------------

def hc_twin_forward(H, Wa, wb, Sa, sb, sa, sbeta, eps):
    """`hc_connect_op`'s outputs by torch ops (any device; H contiguous)."""
    N, n, d = H.shape
    scale = torch.cat([sa.expand(n + 1), sbeta.reshape(1)])
    P = torch.cat([Wa, wb.unsqueeze(1)], 1)  # [d, n+2]
    Hf = H.view(N * n, d)
    raw = (P.t() @ Hf.t()).t().contiguous()  # [Nn, n+2]; (Pᵀ Hᵀ)ᵀ: the faster CPU GEMM orientation at n+2 = 6
    inv = fused_inverse_rms(Hf, eps, keepdim=True)  # [Nn, 1]
    t = torch.tanh(raw * inv)  # (2σ(2x) - 1 measured 3x slower than torch.tanh: bench_speedups.py tanh)
    coeffs = (t.view(N, n, n + 2) * scale).add_(torch.cat([Sa, sb.unsqueeze(1)], 1))
    out = torch.bmm(coeffs[..., : n + 1].transpose(1, 2).contiguous(), H)  # [w; R] @ H
    return out, coeffs[..., n + 1].contiguous(), raw.view(N, n, n + 2), inv.view(N, n), t.view(N, n, n + 2)


def hc_twin_backward(H, Wa, wb, Sa, sb, sa, sbeta, raw, inv, t, g_out, g_depth):
    """The gradients of `hc_connect_op`'s seven tensor inputs by torch ops, from the saved raw, inv, t."""
    N, n, d = H.shape
    scale = torch.cat([sa.expand(n + 1), sbeta.reshape(1)])
    raw, inv, t = raw.reshape(N * n, n + 2), inv.reshape(N * n, 1), t.reshape(N * n, n + 2)
    routing_t = (t.view(N, n, n + 2)[..., : n + 1] * scale[: n + 1]).add_(Sa)  # [w; R]ᵀ [N, n, n+1]
    g_coeffs = H.new_empty(N, n, n + 2)
    g_coeffs[..., : n + 1] = torch.bmm(H, g_out.transpose(1, 2))  # = (g_out Hᵀ)ᵀ = dL/d[w; R]ᵀ
    g_coeffs[..., n + 1] = g_depth
    gH = torch.bmm(routing_t, g_out)
    g_flat = g_coeffs.view(N * n, n + 2)
    g_S = g_coeffs.sum(0)  # [n, n+2]
    g_scale = (g_flat * t).sum(0)
    g_a = (g_flat * scale).mul_(1 - t * t)  # through tanh
    g_raw = g_a * inv
    P = torch.cat([Wa, wb.unsqueeze(1)], 1)
    Hf = H.view(N * n, d)
    g_inv = (g_a * raw).sum(-1, keepdim=True)
    gHf = gH.view(N * n, d)
    gHf.addmm_(g_raw, P.t())
    gHf.addcmul_(Hf, inverse_rms_derivative(g_inv, inv, d))
    g_P = (g_raw.t() @ Hf).t()
    return (gH, _own(g_P[:, : n + 1]), _own(g_P[:, n + 1]), _own(g_S[:, : n + 1]), _own(g_S[:, n + 1]),
            g_scale[: n + 1].sum(), _own(g_scale[n + 1]))


# -- HC: the op -----------------------------------------------------------------------------------------------------

@torch.library.custom_op("depthtools::hc_connect", mutates_args=())
def hc_connect_op(H: torch.Tensor, Wa: torch.Tensor, wb: torch.Tensor, Sa: torch.Tensor, sb: torch.Tensor,
                  sa: torch.Tensor, sbeta: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out = [w; R] @ H [N,n+1,d], β [N,n], raw, inv, t): the HC connector on streams H [N,n,d] (module docstring)."""
    H = H.contiguous()
    if cpu_kernels.connector_usable(H, Wa, wb, Sa, sb, sa, sbeta):
        return hc_kernel_forward(H, *hc_pack(Wa, wb, Sa, sb, sa, sbeta), eps)
    return hc_twin_forward(H, Wa, wb, Sa, sb, sa, sbeta, eps)


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
    first two outputs, with its saved raw, inv, t."""
    H, raw, inv, t, g_out, g_depth = (x.contiguous() for x in (H, raw, inv, t, g_out, g_depth))
    if cpu_kernels.connector_usable(H, Wa, wb, Sa, sb, sa, sbeta, g_out, g_depth):
        n = H.shape[1]
        gH, gPt, gS, g_scale = hc_kernel_backward(H, *hc_pack(Wa, wb, Sa, sb, sa, sbeta), raw, inv, t, g_out, g_depth)
        return [gH, gPt[: n + 1].t().contiguous(), _own(gPt[n + 1]), gS[:, : n + 1].contiguous(),
                gS[:, n + 1].contiguous(), g_scale[: n + 1].sum(), _own(g_scale[n + 1])]
    return list(hc_twin_backward(H, Wa, wb, Sa, sb, sa, sbeta, raw, inv, t, g_out, g_depth))


@hc_connect_backward_op.register_fake
def _(H, Wa, wb, Sa, sb, sa, sbeta, raw, inv, t, g_out, g_depth):
    return [x.new_empty(x.shape) for x in (H, Wa, wb, Sa, sb, sa, sbeta)]


def _hc_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7], *output[2:])
    ctx.mark_non_differentiable(*output[2:])


def _hc_backward(ctx, g_out, g_depth, *_):
    H, Wa, wb, Sa, sb, sa, sbeta, raw, inv, t = ctx.saved_tensors
    N, n, d = H.shape
    g_out = H.new_zeros(N, n + 1, d) if g_out is None else g_out
    g_depth = H.new_zeros(N, n) if g_depth is None else g_depth
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


# -- mHC: the twin (torch ops, tokens last) -------------------------------------------------------------------------

def _mhc_coefficients(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, raw_t, inv, t_max,
                      first):
    """(routing [N,n+1,n] = [H_pre; H_res], mix, h_pre, h_post [n,N], the Sinkhorn's saved terms) from raw_t [J,N]."""
    N, n, _ = H.shape
    mix = raw_t * inv  # [J, N]
    h_pre = torch.sigmoid(mix[:n] * g_pre + b_pre.unsqueeze(1))  # [n, N]
    h_post = torch.sigmoid(mix[n : 2 * n] * g_post + b_post.unsqueeze(1)).mul_(2)  # [n, N]
    logits = mix[2 * n :].view(n, n, N) * g_res + b_res.unsqueeze(-1)  # [n_out, n_in, N]
    h_res, sk_saved = sinkhorn_forward(logits, t_max, first)
    routing = H.new_empty(N, n + 1, n)
    routing[:, 0] = h_pre.t()
    routing[:, 1:] = h_res.permute(2, 0, 1)
    return routing, mix, h_pre, h_post, sk_saved


def mhc_twin_forward(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first):
    """`mhc_connect_op`'s outputs by torch ops (any device; H contiguous)."""
    N, n, d = H.shape
    x = H.view(N, n * d)
    raw_t = torch.cat([phi_pre, phi_post, phi_res], 1).t() @ x.t()  # [J, N]: coefficients first, tokens last
    inv = fused_inverse_rms(x, eps)  # [N]
    routing, _, _, h_post, _ = _mhc_coefficients(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post,
                                                 b_res, raw_t, inv, t_max, first)
    return torch.bmm(routing, H), h_post.t().contiguous(), raw_t.t().contiguous(), inv


def mhc_twin_backward(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, raw, inv, g_out,
                      g_depth, t_max, first):
    """The gradients of `mhc_connect_op`'s ten tensor inputs by torch ops, from the saved raw, inv (the coefficients
    and the Sinkhorn's terms are recomputed from them, as the C kernel does: no pass over the streams)."""
    N, n, d = H.shape
    raw_t = raw.t().contiguous()  # [J, N], tokens last
    routing, mix, h_pre, h_post, sk_saved = _mhc_coefficients(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res,
                                                              b_pre, b_post, b_res, raw_t, inv, t_max, first)
    g_routing = torch.bmm(H, g_out.transpose(1, 2))  # [N, n_in, n+1] = (g_out Hᵀ)ᵀ
    gH = torch.bmm(routing.transpose(1, 2), g_out)
    g_mix = torch.empty_like(mix)  # [J, N]
    g_mix[:n] = g_routing[:, :, 0].t()
    g_mix[:n].mul_(h_pre * (1 - h_pre))  # H_pre = σ(z): dz = g σ (1 - σ)
    g_mix[n : 2 * n] = g_depth.t()
    g_mix[n : 2 * n].mul_(h_post * (1 - h_post * 0.5))  # H_post = 2σ(z): dz = g · H_post (1 - H_post / 2)
    g_logits = sinkhorn_backward(sk_saved, g_routing[:, :, 1:].permute(2, 1, 0).contiguous())  # [n_out, n_in, N]
    g_mix[2 * n :] = g_logits.view(n * n, N)
    g_b_pre, g_b_post, g_b_res = g_mix[:n].sum(1), g_mix[n : 2 * n].sum(1), g_logits.sum(2)
    g_gates = [(g_mix[lo:hi] * mix[lo:hi]).sum() for lo, hi in ((0, n), (n, 2 * n), (2 * n, 2 * n + n * n))]
    g_mix[:n].mul_(g_pre)
    g_mix[n : 2 * n].mul_(g_post)
    g_mix[2 * n :].mul_(g_res)
    g_raw = g_mix * inv  # [J, N]
    x = H.view(N, n * d)
    gx = gH.view(N, n * d)
    gx.addmm_(g_raw.t(), torch.cat([phi_pre, phi_post, phi_res], 1).t())
    g_inv = (g_mix * raw_t).sum(0)  # [N]
    gx.addcmul_(x, inverse_rms_derivative(g_inv, inv, n * d).unsqueeze(1))
    g_phi = g_raw @ x  # [J, nd]
    return (gH, g_phi[:n].t().contiguous(), g_phi[n : 2 * n].t().contiguous(), g_phi[2 * n :].t().contiguous(),
            *g_gates, g_b_pre, g_b_post, g_b_res)


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
    return mhc_twin_forward(H, *params, eps, t_max, first)


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
    """The gradients of `mhc_connect_op`'s ten tensor inputs from those of its first two outputs (saved raw, inv)."""
    H, raw, inv, g_out, g_depth = (x.contiguous() for x in (H, raw, inv, g_out, g_depth))
    params = (phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res)
    if cpu_kernels.connector_usable(H, *params, g_out, g_depth):
        n = H.shape[1]
        gH, g_phi_t, g_gates, g_b_pre, g_b_post, g_b_res = mhc_kernel_backward(
            H, *mhc_pack(*params), raw, inv, g_out, g_depth, t_max, first)
        return [gH, g_phi_t[:n].t().contiguous(), g_phi_t[n : 2 * n].t().contiguous(), g_phi_t[2 * n :].t().contiguous(),
                *(_own(g) for g in g_gates), g_b_pre, g_b_post, g_b_res.view(n, n)]
    return list(mhc_twin_backward(H, *params, raw, inv, g_out, g_depth, t_max, first))


@mhc_connect_backward_op.register_fake
def _(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, raw, inv, g_out, g_depth, t_max,
      first):
    return [x.new_empty(x.shape) for x in (H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res)]


def _mhc_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10], *output[2:])
    ctx.mark_non_differentiable(*output[2:])
    ctx.t_max, ctx.first = inputs[11:]


def _mhc_backward(ctx, g_out, g_depth, *_):
    H, *params, raw, inv = ctx.saved_tensors
    N, n, d = H.shape
    g_out = H.new_zeros(N, n + 1, d) if g_out is None else g_out
    g_depth = H.new_zeros(N, n) if g_depth is None else g_depth
    grads = mhc_connect_backward_op(H, *params, raw, inv, g_out, g_depth, ctx.t_max, ctx.first)
    return (*grads, None, None, None)


mhc_connect_op.register_autograd(_mhc_backward, setup_context=_mhc_setup)


def mhc_connect(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first):
    """`reference.mhc_connect` on the op: (u [N,d], H_res H [N,n,d], H_post [N,n]) for streams H [N,n,d]."""
    out, depth, *_ = mhc_connect_op(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps,
                                    t_max, first)
    return (*_branch_and_streams(out), depth)
