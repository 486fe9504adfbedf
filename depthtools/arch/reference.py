"""Plain-autograd references of every fused `torch.autograd.Function` in depthtools.arch.

The fast paths of HC/mHC (hyper.py), AttnRes/DenseFormer (bankops.py) and MoDA (moda.py) are
custom autograd Functions with hand-written backward (and, for hyper._Update, forward-mode jvp) passes,
or torch custom ops (depthtools/arch/ops) running C kernels. Each has its reference here: the same function
written in ordinary torch ops, so autograd derives the gradients and jvps. Read these to see what a
fused Function computes; select them for a whole model with option `fused: False` (hc, mhc, attnres, blockattnres, denseformer and moda
declare it in their option schemas);
tests/test_fused_reference.py checks every Function against its reference (outputs, gradients
and jvps, and torch.autograd.gradcheck in float64) and fused against reference models.

    fused Function             reference here             used by
    op sinkhorn_tokens_last    sinkhorn                   mHC H_res (hyper.sinkhorn_knopp; ops/sinkhorn.py)
    hyper._Update              stream_update              every HC/mHC sublayer
    op hc_connect              hc_connect                 HC connector (no weights hook; ops/connector.py)
    op mhc_connect             mhc_connect                mHC connector (no weights hook; ops/connector.py)
    bankops._WeightedSum       weighted_sum               DenseFormer DWA, AttnRes hooked mixes
    bankops._BankLogits        bank_logits                AttnRes hooked mixes
    bankops._Push + _Mix       depth_mix                  AttnRes mixes over a DepthBank
    moda._AppendSlots          append_slots               MoDA depth K/V cache
    moda._DepthAttention       depth_attention            MoDA attention (CPU, no pattern hook)

Shapes and argument order follow the Function each replaces (see its docstring there).
"""

from __future__ import annotations

import torch


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dim, keepdim."""
    return torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


# -- HC / mHC (hyper.py) ------------------------------------------------------------------------

def sinkhorn(logits: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """The op sinkhorn_tokens_last (ops.sinkhorn.sinkhorn): logits [..., n_out, n_in] -> softmax over the dim `first` names (1 = along each
    row, "cols_last"; 0 = down each column, "rows_last"), then 2·t_max - 1 alternating half-steps
    M ← M / (sums along the other dim), each sum clamped at the smallest normal number."""
    dim = {0: -2, 1: -1}  # the fused kernel's tokens-last [n_out, n_in, N] dims, here
    tiny = torch.finfo(logits.dtype).tiny
    m = torch.softmax(logits, dim=dim[first])
    for step in range(2 * t_max - 1):
        m = m / m.sum(dim[(first + 1 + step) % 2], keepdim=True).clamp_min(tiny)
    return m


def proj_rms(x: torch.Tensor, w: torch.Tensor, eps: float):
    """(x @ w [M,m], 1/rms(x) [M,1]) for rows x [M,k] and w [k,m]: the connectors' projection and norm."""
    return x @ w, _inverse_rms(x, eps)


def stream_mix(routing: torch.Tensor, H: torch.Tensor):
    """(u [N,d], R H [N,n,d]) = rows of [w; R] @ H for routing [N,n+1,n], streams H [N,n,d].

    Under torch.compile: the same sums as n multiply-adds per output row (`stream_mix_unrolled`), which
    inductor fuses with the connector's other elementwise work; a [N,n+1,n] @ [N,n,d] bmm is an extern
    call it cannot fuse (its backward two more)."""
    if torch.compiler.is_compiling():
        return stream_mix_unrolled(routing, H)
    out = routing @ H
    u, mixed = out.split([1, out.shape[1] - 1], 1)  # split: its backward is one cat (indexing: zero-filled adds)
    return u.squeeze(1), mixed


def stream_mix_unrolled(routing: torch.Tensor, H: torch.Tensor):
    """`stream_mix` as Σ_s routing[:, j, s] H_s, one multiply-add per stream s (index order)."""
    n = H.shape[1]
    rows = []
    for j in range(routing.shape[1]):
        acc = routing[:, j, 0, None] * H[:, 0]
        for s in range(1, n):
            acc = acc + routing[:, j, s, None] * H[:, s]
        rows.append(acc)
    return rows[0], torch.stack(rows[1:], 1)


def stream_update(mixed: torch.Tensor, depth: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """_Update: H' = R H + β ⊗ y for mixed [...,n,d], β [...,n], y [...,d]."""
    return mixed + depth.unsqueeze(-1) * y.unsqueeze(-2)


def hc_coefficients(H, Wa, wb, Sa, sb, sa, sbeta, eps, proj_rms=proj_rms):
    """The HC connector's weights on streams H [..., n, d]: ([w; R] [..., n+1, n], β [..., n]).

        raw = H_s @ [W_a | w_b], Hbar @ [W_a | w_b] = raw · 1/rms(H_s) per stream (no gain)
        alpha = S_a + s_a · tanh(Hbar @ W_a)   [..., n, n+1] = [A_m | A_r], rows = streams
        beta  = S_b + s_b · tanh(Hbar @ w_b)   [..., n]
        [w; R] = [A_m | A_r]ᵀ

    `proj_rms`: how (raw, 1/rms) are formed (default `proj_rms`)."""
    n = H.shape[-2]
    _, _, t = hc_terms(H, Wa, wb, eps, proj_rms)
    coeffs = torch.cat([Sa, sb.unsqueeze(-1)], -1) + torch.cat([sa.expand(n + 1), sbeta.reshape(1)]) * t
    return coeffs[..., : n + 1].transpose(-1, -2), coeffs[..., n + 1]


def hc_terms(H, Wa, wb, eps, proj_rms=proj_rms):
    """`hc_coefficients`' first step: (raw [M, n+2], 1/rms [M, 1], t = tanh(raw · 1/rms) [..., n, n+2]) for
    streams H [..., n, d], M rows of H. (The connector op saves raw, inv and t for its backward.)"""
    n = H.shape[-2]
    raw, inv = proj_rms(H.reshape(-1, H.shape[-1]), torch.cat([Wa, wb.unsqueeze(-1)], -1), eps)  # one GEMM
    return raw, inv, torch.tanh((raw * inv).view(*H.shape[:-1], n + 2))


def hc_connect(H, Wa, wb, Sa, sb, sa, sbeta, eps):
    """ops.connector.hc_connect (the op `depthtools::hc_connect`): the HC connector on streams H [N,n,d],
    (u, R H, β) with u = Σ_s A_m[s] H_s, (R H)_j = Σ_s A_r[s,j] H_s (`hc_coefficients`)."""
    routing, beta = hc_coefficients(H, Wa, wb, Sa, sb, sa, sbeta, eps)
    u, mixed = stream_mix(routing, H)
    return u, mixed, beta


def mhc_coefficients(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first,
                     sinkhorn_fn=None, proj_rms=proj_rms):
    """The mHC connector's weights on streams H [..., n, d]: ([H_pre; H_res] [..., n+1, n], H_post [..., n]).

        x = RMSNorm(vec H) over n·d (no gain), formed as (vec H @ φ) · 1/rms(vec H)
        H_pre = σ(g_pre · x φ_pre + b_pre), H_post = 2σ(g_post · x φ_post + b_post)
        H_res = Sinkhorn(g_res · mat(x φ_res) + b_res)   [..., n_out, n_in], mat() row-major

    `sinkhorn_fn`: another implementation of `sinkhorn` with its signature (the op, ops.sinkhorn.sinkhorn);
    `proj_rms`: as for `hc_coefficients`."""
    n = H.shape[-2]
    raw, inv = mhc_terms(H, phi_pre, phi_post, phi_res, eps, proj_rms)
    pre, post, res = (raw * inv).view(*H.shape[:-2], -1).split([n, n, n * n], -1)
    h_pre = torch.sigmoid(g_pre * pre + b_pre)
    h_post = 2 * torch.sigmoid(g_post * post + b_post)
    h_res = (sinkhorn_fn or sinkhorn)(g_res * res.unflatten(-1, (n, n)) + b_res, t_max, first)
    return torch.cat([h_pre.unsqueeze(-2), h_res], -2), h_post


def mhc_terms(H, phi_pre, phi_post, phi_res, eps, proj_rms=proj_rms):
    """`mhc_coefficients`' first step: (raw = vec H @ [φ_pre | φ_post | φ_res] [M, 2n+n²], 1/rms(vec H) [M, 1]) for
    streams H [..., n, d], M tokens. (The connector op saves raw and inv for its backward.)"""
    x = H.flatten(-2)
    return proj_rms(x.reshape(-1, x.shape[-1]), torch.cat([phi_pre, phi_post, phi_res], 1), eps)  # one GEMM


def mhc_connect(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first,
                sinkhorn_fn=None):
    """ops.connector.mhc_connect (the op `depthtools::mhc_connect`): the mHC connector on streams H [N,n,d],
    (u, H_res H, H_post) = rows of [H_pre; H_res] @ H and H_post (`mhc_coefficients`)."""
    routing, h_post = mhc_coefficients(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps,
                                       t_max, first, sinkhorn_fn)
    u, mixed = stream_mix(routing, H)
    return u, mixed, h_post


# -- AttnRes / DenseFormer (bankops.py) ----------------------------------------------------------

def weighted_sum(weights: torch.Tensor, sources) -> torch.Tensor:
    """_WeightedSum: Σ_i w[..., i] v_i for weights [n] (one per source) or [*lead, n] (per token)."""
    bank = torch.stack(tuple(sources), -1)  # [*lead, d, n]
    if weights.dim() == 1:
        return bank @ weights
    return (bank * weights.unsqueeze(-2)).sum(-1)


def bank_logits(query: torch.Tensor, sources, scales) -> torch.Tensor:
    """_BankLogits: [*lead, n] logits r_i · (v_i · q) for sources v_i [*lead,d], scales r_i [*lead], q [d]."""
    return torch.stack([(v @ query) * r for v, r in zip(sources, scales)], -1)


def depth_mix(query: torch.Tensor, sources, eps: float) -> torch.Tensor:
    """What a DepthBank mix (bankops._Push of each source, then _Mix) computes: the AttnRes depth
    attention h = Σ_i α_i v_i, α = softmax_i(r_i · (v_i · q)), r_i = 1/rms(v_i), for the mixer's
    q = w ⊙ γ (pseudo-query times key-norm gain) over sources v_i [*lead,d] (the partial sum, if
    any, last). Softmax logits are the key-RMSNorm dot products, without temperature."""
    scales = [_inverse_rms(v, eps).squeeze(-1) for v in sources]
    return weighted_sum(bank_logits(query, sources, scales).softmax(-1), sources)


# -- MoDA (moda.py) ------------------------------------------------------------------------------

def append_slots(keys, values, new):
    """_AppendSlots: (keys', values') = the depth cache [B,T,Hkv,S,hd] (or None) with the new slots
    new = (k_0, v_0, k_1, v_1, ...), each [B,T,Hkv,hd], concatenated on the slot axis."""
    new_keys, new_values = torch.stack(new[0::2], 3), torch.stack(new[1::2], 3)
    if keys is None:
        return new_keys, new_values
    return torch.cat([keys, new_keys.to(keys.dtype)], 3), torch.cat([values, new_values.to(values.dtype)], 3)


def depth_attention(q, k, v, q_depth, keys, values, invalid, seq_hook=None, depth_hook=None) -> torch.Tensor:
    """_DepthAttention: z [B,T,H,hd] = one softmax (scale 1/sqrt(hd)) over the causal sequence keys
    k [B,T,H,hd] (values v, already expanded to H heads) and each position's S depth keys
    keys [B,T,Hkv,S,hd] (values `values`; query head h reads kv head h // (H/Hkv)) scored with
    q_depth [B,T,H,hd]; slots where `invalid` [S] is True get no weight.

    The two parts of the pattern are formed explicitly: the sequence part [B,H,T,T] and the depth
    part [B,H,T,S] pass through `seq_hook` / `depth_hook` (MoDA's hook_pattern and
    hook_moda_depth_pattern), whose returned weights are used as they are.
    """
    B, T, H, hd = q.shape
    Hkv, S = keys.shape[2], keys.shape[3]
    groups = H // Hkv
    scale = hd**-0.5

    # sequence scores [B,H,T,T] (causal)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B,H,T,hd]
    seq_scores = (qh @ kh.transpose(-1, -2)) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    seq_scores = seq_scores.masked_fill(~causal, float("-inf"))

    # depth scores [B,H,T,S]: per position t, its query against its own S depth keys
    qd = q_depth.reshape(B, T, Hkv, groups, hd)  # q head = kv head * groups + g (as GQA)
    depth_scores = (qd @ keys.to(q.dtype).transpose(-1, -2)) * scale  # [B,T,Hkv,g,S]
    depth_scores = depth_scores.reshape(B, T, H, S).transpose(1, 2)  # [B,H,T,S]
    if invalid is not None:
        depth_scores = depth_scores.masked_fill(invalid, float("-inf"))

    probs = torch.cat([seq_scores, depth_scores], dim=-1).softmax(-1)  # [B,H,T,T+S]
    seq_pattern, depth_pattern = probs.split([T, S], dim=-1)
    if seq_hook is not None:
        seq_pattern = seq_hook(seq_pattern)
    if depth_hook is not None:
        depth_pattern = depth_hook(depth_pattern)

    z = (seq_pattern @ vh).transpose(1, 2)  # [B,T,H,hd]
    depth_p = depth_pattern.transpose(1, 2).reshape(B, T, Hkv, groups, S)
    z_depth = (depth_p @ values.to(q.dtype)).reshape(B, T, H, hd)  # [B,T,Hkv,g,hd] -> [B,T,H,hd]
    return z + z_depth
