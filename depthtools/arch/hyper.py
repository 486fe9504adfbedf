"""Hyper-Connections (HC) and Manifold-Constrained Hyper-Connections (mHC): n residual streams.

Equations, inits and sources: docs/reference/architectures.md §3.1 (HC), §3.2 (mHC), §4.

State: H [B,T,n,d], n parallel residual streams per token (n = options["n_streams"], default 4);
z_0 = n copies of the embedding. Every sublayer (attention, then MLP: 2 per block, sublayer
index i = 2b + {0,1}) has a *connector* that reads H and returns three per-token weights

    width  w [n]     branch input   u = Σ_s w_s H_s                 (what the sublayer reads)
    res    R [n,n]   stream mixing  row o of R mixes the streams into output stream o
    depth  β [n]     output weights H ← R @ H + β ⊗ f(Norm_i(u))

where Norm_i is the sublayer's own pre-norm (block.attn_norm / block.mlp_norm, RMSNorm with gamma).

HC (Zhu et al. 2024), lucidrains layout: alpha = [A_m | A_r] is [n, n+1] with rows = streams,
    Hbar  = RMSNorm(H) per stream, no gamma, eps 1e-8 (DepthBench); option connector_norm_gain:
            RMSNorm(H)·γ with a learnable γ [d] per connector, init 1 (the paper's norm has learnable
            parameters -- it is a LayerNorm, whose centring and bias we do not offer; lucidrains: RMSNorm γ)
    alpha = static_alpha + alpha_scale · tanh(Hbar @ dynamic_alpha)     [n, n+1]
    beta  = static_beta  + beta_scale  · tanh(Hbar @ dynamic_beta)      [n]
    w = A_m = alpha[:, 0];  R = A_r^T = alpha[:, 1:]^T;  β = beta
  Init (paper = lucidrains = DepthBench): S_m = e_k with k = i mod n, S_r = I, S_b = 1, dynamic
  projections 0, scales 0.01. At init all streams equal the Pre-LN residual stream.

mHC (Xie et al. 2025, DeepSeek): coefficients from the flattened, RMS-normalised state
    x' = RMSNorm(vec H) over n·d, no gamma, eps 1e-6 (DeepSeek-V4 / Liger)
    w = H_pre  = sigmoid(gate_pre · x'φ_pre + bias_pre)
    β = H_post = 2·sigmoid(gate_post · x'φ_post + bias_post)
    R = H_res  = SinkhornKnopp(gate_res · mat(x'φ_res) + bias_res), t_max = 20, in float32
  Sinkhorn order (option "sinkhorn_order"): "rows_last" (default) is the paper's Eq. 9, M(0) = exp,
  M(t) = T_r(T_c(M(t-1))): columns then rows, so R is exactly row-stochastic (each output stream a
  convex combination of the inputs) and column-stochastic up to convergence; "cols_last" runs rows
  then columns (Liger's reference, DeepSeek-V4's kernel, and this project before issue 18): exactly
  column-stochastic. After 20 rounds they differ by up to ~0.05 for logits of spread 4, ~0.15 for 8,
  0 at the hc_like init and < 1e-6 near it. The residual (max |row/column sum - 1|) is in routing stats.
  Orientation: paper/Liger, H ← H_res·H (out_o = Σ_i H_res[o,i] H_i); mat() is row-major
  (column o·n + i of φ_res is entry [o,i]). DeepSeek-V4 / DepthBench-PyTorch use the transpose.
  Inits (option "mhc_init"): "hc_like" (default; DepthBench PyTorch "mhc", gap8-like): φ = 0,
  gates 0.01, bias_pre = +8 at stream i mod n and −8 elsewhere, bias_post = 0, bias_res = +8 on
  the diagonal and −8 off it, so H_pre ≈ e_k, H_post = 1, H_res ≈ I and the model ≡ Pre-LN (the
  pre-norm removes the scale Σ H_pre = 1 + 2σ(−8); identical streams stay identical under a
  row-stochastic H_res). "uniform" (DepthBench-Liger): φ ~ N(0, 0.02), biases 0, gates 0.01 →
  H_pre ≈ ½, H_post ≈ 1, H_res ≈ J/n. "lucidrains": φ = 0, gates 0.01, bias_pre = e_k,
  bias_post = 1, bias_res = I → H_pre = σ(1) on stream k and ½ elsewhere, H_post = 2σ(1) ≈ 1.46,
  H_res = Sinkhorn(exp I) (not the identity; lucidrains also computes coefficients per stream,
  which we do not).

Readout (one collapse for logits and lens; option "readout"): "sum" (default) Σ_s H_s, then the
model's ln_final and unembedding; "mean" (1/n) Σ_s H_s, then ln_final (DepthBench's Liger mHC,
collapse "mean"; the final RMSNorm makes it ≡ "sum" with eps·n², i.e. up to the norm's eps);
"normed_sum" Σ_s ln_final(H_s), then the unembedding (DepthBench's HC and PyTorch mHC head: the final
norm on each folded stream, then the sum) -- a different function: it has no single vector before the
final norm, so `readout` (the lens, task probes) refuses it and `model.head` is the way to logits. Option
"head_mixer" (DeepSeek-V4 `hc_head`): y = Σ_s p_s H_s, p = sigmoid(head_scale·(x' head_fn^T) +
head_base) + 1e-6, x' as for mHC; init head_fn = 0, head_base = 0, head_scale = 1 (≡ sum at init).

Geometry: the streams concatenated [B,T,n·d]. Hooks: blocks.{l}.hook_streams_pre|mid|post
[B,T,n,d]; blocks.{l}.{attn,mlp}_hc.hook_width_weights [B,T,n], hook_res_weights [B,T,n,n]
(always R, rows = output streams, for HC and mHC alike), hook_depth_weights [B,T,n],
hook_branch_in [B,T,d] (u, before the pre-norm); blocks.{l}.hook_attn_out / hook_mlp_out are the
branch outputs f(Norm(u)). hook_resid_* are never used (the state is not one residual stream).

Skip rules: "identity" (default; the block is bypassed, streams unchanged) and "branch" (branch
ablation: each sublayer still mixes the streams with R but adds no branch output; it uses the
connectors of the block built for the skipped position). Swap: every block tensor, connectors
included (so the one-hot S_m / bias_pre of its own index), travels with the block.

Options: fused (True; see "Computation" below), n_streams (4), scale_output_init_by_sqrt_n (True: attention w_o and MLP w2 init / √n, as
the HC paper's implementation section scales the attention out-projection and FFN output inits, and as
DepthBench), head_mixer (False), connector_norm_eps (1e-8 HC, 1e-6 mHC),
for HC connector_norm_gain (False), and for mHC mhc_init ("hc_like"), sinkhorn_iters (20) and
sinkhorn_order ("rows_last").
  connector_norm_gain defaults to False: DepthBench (whose grids these replicate) uses the gain-free
  norm; a True default would give every saved HC checkpoint missing parameters; and the gain is a
  reparametrisation -- RMSNorm(H)·γ @ W = RMSNorm(H) @ (γ ⊙ W) -- so it changes training dynamics
  (γ is not weight-decayed) but not what an HC connector can compute. True adds 2L·d parameters.
  sinkhorn_order: new models record it in their config (`explicit_options`, `DepthModel.config`); an
  mhc config saved without the key predates the option and loads as "cols_last", the order it was
  trained with (the mhc `ArchSpec.legacy_defaults`, applied by `depthtools.checkpoint.load` through
  `registry.upgrade_options`). Weight decay: static routing params,
gates and biases are excluded (`no_decay_names`, as DepthBench's disable_static_weight_decay);
the dynamic projections (dynamic_alpha/beta, φ, head_fn) decay like other matrices.

Computation (performance; same function either way). At d = 64 a connector is many small
operations on a 1 MB stream state, so its cost is call overhead and extra passes. Unless a
weights hook (width/res/depth) is attached, a connector on CPU float32/float64 (the kernel library built) runs as
ONE autograd node, the torch custom op `depthtools::hc_connect` / `depthtools::mhc_connect`
(depthtools/arch/ops/connector.py, through `hc_connect` / `mhc_connect` here): its fused C kernel, one pass over the
stream state per direction (an eager step at L32 d64 went from ~1.9x / ~2.3x eager Pre-LN to ~1.6x / ~1.7x:
benchmarks/RESULTS.md, "Third pass"); the compiled CPU step calls the same op. Everywhere else (CUDA, no compiler,
forward AD or a torch.func transform, which custom ops have no rule for) the connector is its plain-autograd
reference (depthtools/arch/reference.py; traced and fused by inductor in a compiled step off CPU). The connector's
math is written twice, the reference and the kernel; the kernel's backward is tested against autograd of the
reference. The update H ← R H + β ⊗ y is `_Update` (hand-written backward and jvp). With a weights hook the
connector is formed step by step by the reference (`hc_coefficients` / `mhc_coefficients`, with the Sinkhorn op)
so the hooked tensors can be read and edited. Option fused (True): False runs the plain-autograd reference of every
piece instead (the same function, slower), for checking the op and the hand-written backwards and for debugging.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch import reference
from depthtools.arch.compiled import compiling
from depthtools.arch.layers import RMSNorm
from depthtools.arch.ops import connector as connector_ops, sinkhorn as sinkhorn_ops
from depthtools.arch.scheme import ArchSpec, DepthRouting, NormSite, Option, ResidualScheme, profile_defaults
from depthtools.arch.torch_private import forward_ad_active, is_hooked
from depthtools.errors import DepthToolsError

if TYPE_CHECKING:  # annotations only (depthtools.config imports nothing from arch/: no circle either way)
    from depthtools.config import ModelConfig

MHC_INITS = ("hc_like", "uniform", "lucidrains")
# Sinkhorn half-step order (option "sinkhorn_order"), named by the normalisation that runs last and
# so holds exactly: "rows_last" = the paper's Eq. 9, M(t) = T_r(T_c(M(t-1))) (columns, then rows:
# row-stochastic, every output stream a convex combination of the inputs); "cols_last" = rows, then
# columns (column-stochastic: the stream sum is preserved), as Liger's reference / DeepSeek-V4's
# production kernel and this project before issue 18 ran it.
SINKHORN_ORDERS = ("rows_last", "cols_last")
LEGACY_SINKHORN_ORDER = "cols_last"  # what an mhc config saved without the key was trained with
HEAD_EPS = 1e-6  # DeepSeek-V4 hc_eps: keeps every head-mixer weight strictly positive
GAP = 8.0  # |bias| of the hc_like mHC init (DepthBench "gap8")

_COMMON_OPTIONS = {"n_streams": 4, "scale_output_init_by_sqrt_n": True, "head_mixer": False, "fused": True,
                   "readout": "sum"}
READOUTS = ("sum", "mean", "normed_sum")  # option "readout" (see the module docstring)
_DEFAULTS = {
    "hc": {**_COMMON_OPTIONS, "connector_norm_eps": 1e-8, "connector_norm_gain": False},
    "mhc": {**_COMMON_OPTIONS, "connector_norm_eps": 1e-6, "mhc_init": "hc_like", "sinkhorn_iters": 20,
            "sinkhorn_order": "rows_last"},
}
# Options whose default changed: the value a config saved before the option existed implies. New
# models record the resolved value (`explicit_options`), so an absent key means an older checkpoint.
_LEGACY_DEFAULTS = {"mhc": {"sinkhorn_order": LEGACY_SINKHORN_ORDER}}


def explicit_options(cfg: ModelConfig) -> ModelConfig:
    """cfg with every changed-default option written out (what a new model records in config.json)."""
    missing = {k: v for k, v in _LEGACY_DEFAULTS.get(cfg.arch, {}).items() if k not in cfg.options}
    if not missing:
        return cfg
    return cfg.replace(options={**cfg.options, **{k: _DEFAULTS[cfg.arch][k] for k in missing}})


# The `depthbench` recipe profile (depthtools.profiles): HC's head as DepthBench's `Transformer.forward`
# computes it (every stream normed by the final norm, then summed); mHC's Liger-style init and
# `sinkhorn_log`'s order (20 iterations, columns normalised last), and its head per mHC backend (collapse
# "auto"): Liger (our "uniform" init) takes the mean of the streams, then the final norm; its PyTorch mHC
# (any other init) norms each stream, then sums.
MHC_READOUT = {"uniform": "mean"}
_HC_DEPTHBENCH = profile_defaults({"readout": "normed_sum"})
_MHC_DEPTHBENCH = profile_defaults({"mhc_init": "uniform", "sinkhorn_iters": 20, "sinkhorn_order": "cols_last"})


def _mhc_depthbench(given: dict) -> dict:
    """mHC's options under the depthbench profile: the fixed ones, then the readout its init implies unless given."""
    options = _MHC_DEPTHBENCH(given)
    if "readout" not in given:
        options["readout"] = MHC_READOUT.get(options["mhc_init"], "normed_sum")
    return options


def _option(default, choices: tuple = ()) -> Option:
    """The Option of an hc/mhc default: flags, positive integers, an eps > 0, or one of `choices`."""
    if choices:
        return Option("str", default, choices=choices)
    if isinstance(default, bool):
        return Option("bool", default)
    if isinstance(default, int):
        return Option("int", default, low=1)
    return Option("number", default, low=0, low_open=True)


# -- numerics ---------------------------------------------------------------------------------

def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs, else the input's own (float64 stays float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _full_precision(t: torch.Tensor):
    """A context that switches autocast off (routing weights are computed in float32 or wider)."""
    device = t.device.type  # (the meta device has no autocast)
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return nullcontext()


def sinkhorn_knopp(logits: torch.Tensor, t_max: int = 20, order: str = "rows_last", fused: bool = True) -> torch.Tensor:
    """Doubly stochastic projection of logits [..., n, n] (rows = output streams), in float32 or
    wider even under bf16/autocast: M(0) = exp(logits), then t_max rounds.

    order "rows_last" (default): the mHC paper's Eq. 9, M(t) = T_r(T_c(M(t-1))) -- columns, then
    rows; the result's rows sum to 1 exactly, its columns up to Sinkhorn convergence.
    order "cols_last": rows, then columns (Liger / DeepSeek-V4 production, and this project before
    issue 18); columns exact, rows approximate. The two differ by up to ~0.1 for strong logits.
    The first normalisation of exp(logits) is a softmax (max-subtracted, no overflow).
    Differentiable: the gradient is the exact gradient of the unrolled t_max iterations.
    Runs as the op `depthtools::sinkhorn_tokens_last` (ops/sinkhorn.py: its C kernel on CPU, its torch twin
    elsewhere); fused=False, forward AD or a torch.func transform: the plain-autograd `reference.sinkhorn`.
    """
    with _full_precision(logits):
        return _sinkhorn(logits.to(_compute_dtype(logits)), t_max, _softmax_dim(order), fused)


def _sinkhorn(logits: torch.Tensor, t_max: int, first: int, fused: bool = True) -> torch.Tensor:
    """`reference.sinkhorn`'s signature: the op (ops.sinkhorn.sinkhorn), or with fused=False, under forward AD or a
    torch.func transform (custom ops have no forward-mode derivative), `reference.sinkhorn` itself."""
    if fused and (compiling() or not forward_ad_active(logits)):
        return sinkhorn_ops.sinkhorn(logits, t_max, first)
    return reference.sinkhorn(logits, t_max, first)


def _softmax_dim(order: str) -> int:
    """Tokens-last layout [n_out, n_in, N]: the dim of the first normalisation (1 = rows, 0 = columns)."""
    if order not in SINKHORN_ORDERS:
        raise DepthToolsError(f"Sinkhorn order must be one of {list(SINKHORN_ORDERS)}, got {order!r}")
    return 0 if order == "rows_last" else 1


def sinkhorn_residuals(M: torch.Tensor) -> tuple[float, float]:
    """(max |row sum - 1|, max |column sum - 1|) of Sinkhorn results M [..., n, n] (rows = outputs):
    how far the finite iteration is from doubly stochastic (0.0, 0.0 for an empty M)."""
    if M.numel() == 0:
        return 0.0, 0.0
    return float((M.sum(-1) - 1).abs().max()), float((M.sum(-2) - 1).abs().max())


# -- connectors -------------------------------------------------------------------------------

class _Connector(nn.Module):
    """Routes the streams around one sublayer: subclasses define `weights(H) -> (routing, β)`,
    routing [B,T,n+1,n] = [w; R] (row 0: branch-input weights, rows 1..n: stream mixing)."""

    def __init__(self, n: int, eps: float, fused: bool = True):
        super().__init__()
        self.n, self.eps = n, eps
        self.use_fused = fused  # False: the plain-autograd references (option "fused")
        self.hook_width_weights = HookPoint()  # [B,T,n]    w: branch-input weights
        self.hook_res_weights = HookPoint()  # [B,T,n,n]    R: new streams = R @ streams
        self.hook_depth_weights = HookPoint()  # [B,T,n]    β: branch-output weights
        self.hook_branch_in = HookPoint()  # [B,T,d]        u = Σ_s w_s H_s

    def weights(self, H: torch.Tensor):
        raise NotImplementedError

    def fused(self, H: torch.Tensor):
        """(u [N,d], R @ H [N,n,d], β [N,n]) for H [N,n,d] by the connector's op (ops/connector.py), or its
        `reference` where the op does not apply (`connector_ops.uses_op`), or None if n/a."""
        return None

    def reference(self, H: torch.Tensor):
        """What `fused` computes, in plain autograd ops (depthtools/arch/reference.py), or None if n/a."""
        return None

    def forward(self, H: torch.Tensor):
        """(u [B,T,d], R @ H [B,T,n,d], β [B,T,n]) for streams H [B,T,n,d]."""
        lead, (n, d) = H.shape[:-2], H.shape[-2:]
        weight_hooks = (self.hook_width_weights, self.hook_res_weights, self.hook_depth_weights)
        if H.dtype == _compute_dtype(H) and not is_hooked(*weight_hooks):
            with _full_precision(H):
                out = (self.fused if self.use_fused else self.reference)(H.reshape(-1, n, d))
            if out is not None:  # (weights not hooked: the fused connector, same function)
                u, mixed, depth = out
                return self.hook_branch_in(u.view(*lead, d)), mixed.view(*lead, n, d), depth.view(*lead, n)
        with _full_precision(H):
            routing, depth = self.weights(H)  # [B,T,n+1,n], [B,T,n]
            if is_hooked(self.hook_width_weights, self.hook_res_weights):
                width, res = routing.split([1, self.n], dim=-2)  # split only when hooked: no copies
                width = self.hook_width_weights(width.squeeze(-2)).unsqueeze(-2)
                routing = torch.cat([width, self.hook_res_weights(res)], dim=-2)
            depth = self.hook_depth_weights(depth)
            u, mixed = reference.stream_mix(routing.to(H.dtype).reshape(-1, n + 1, n), H.reshape(-1, n, d))
        return self.hook_branch_in(u.view(*lead, d)), mixed.view(*lead, n, d), depth.to(H.dtype)


# -- the stream update (custom autograd with forward-mode jvp, so torch.func.jvp still works) --------------------
#
# Why: at d = 64 every HC/mHC sublayer is a few small operations on a 1 MB stream state, and their cost is per-call
# overhead and extra passes (here: the broadcast-multiply-sum backward of β ⊗ y), not arithmetic.

class _Update(torch.autograd.Function):
    """H' = mixed + β ⊗ y for mixed [...,n,d], β [...,n], y [...,d] (same dtype)."""

    @staticmethod
    def forward(mixed, depth, y):
        return torch.addcmul(mixed, depth.unsqueeze(-1), y.unsqueeze(-2))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])
        ctx.save_for_forward(inputs[1], inputs[2])

    @staticmethod
    def backward(ctx, g):
        depth, y = ctx.saved_tensors
        g_depth = torch.linalg.vecdot(g, y.unsqueeze(-2)) if ctx.needs_input_grad[1] else None
        g_y = None
        if ctx.needs_input_grad[2]:  # Σ_s β_s g_s: n fused multiply-adds beat a multiply-sum
            g_y = g[..., 0, :] * depth[..., 0, None]
            for s in range(1, g.shape[-2]):
                g_y.addcmul_(g[..., s, :], depth[..., s, None])
        return g, g_depth, g_y

    @staticmethod
    def jvp(ctx, d_mixed, d_depth, d_y):
        depth, y = ctx.saved_tensors
        out = torch.zeros(*depth.shape, y.shape[-1], dtype=y.dtype, device=y.device) if d_mixed is None else d_mixed.clone()
        if d_depth is not None:
            out.addcmul_(d_depth.unsqueeze(-1), y.unsqueeze(-2))
        if d_y is not None:
            out.addcmul_(depth.unsqueeze(-1), d_y.unsqueeze(-2))
        return out


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dim, keepdim: RMSNorm without gamma is x · this (the head mixer's).

    Projections of a normalised vector are computed as (x @ W) · inverse_rms (as in Liger's
    reference), which avoids materialising the normalised [B,T,n,d] copy. mean(x²) as one fused
    dot product (no x² temporary; pow's backward is slower on CPU: benchmarks/RESULTS.md).
    """
    return torch.rsqrt(torch.linalg.vecdot(x, x).unsqueeze(-1) / x.shape[-1] + eps)


def hc_connect(H, Wa, wb, Sa, sb, sa, sbeta, eps):
    """The HC connector with `reference.hc_connect`'s signature and result: the op `depthtools::hc_connect`
    (ops/connector.py: one autograd node, its C kernel per direction) where `connector_ops.uses_op` (CPU float32/
    float64, the library built, no forward AD or torch.func transform); else the reference itself, plain autograd
    (CUDA eager, no compiler; traced by torch.compile off CPU, where inductor fuses it)."""
    if connector_ops.uses_op(H, Wa, wb, Sa, sb, sa, sbeta):
        return connector_ops.hc_connect(H, Wa, wb, Sa, sb, sa, sbeta, eps)
    return reference.hc_connect(H, Wa, wb, Sa, sb, sa, sbeta, eps)


def mhc_connect(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first):
    """The mHC connector as `hc_connect` is HC's: the op `depthtools::mhc_connect` where `connector_ops.uses_op`,
    else `reference.mhc_connect` with its Sinkhorn as the op `depthtools::sinkhorn_tokens_last` (its C kernel on CPU,
    its torch twin elsewhere; the plain-autograd `reference.sinkhorn` under forward AD or a torch.func transform)."""
    params = (phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res)
    if connector_ops.uses_op(H, *params):
        return connector_ops.mhc_connect(H, *params, eps, t_max, first)
    sinkhorn = lambda z, t_max, first: _sinkhorn(z, t_max, first)  # noqa: E731  (the op; forward AD: the reference)
    return reference.mhc_connect(H, *params, eps, t_max, first, sinkhorn)


class HyperConnection(_Connector):
    """HC connector (static + tanh-dynamic width/depth connections), lucidrains parameter layout.

    static_alpha [n, n+1] = [S_m | S_r], dynamic_alpha [d, n+1] = [W_m | W_r], static_beta [n] = S_b,
    dynamic_beta [d] = W_b, alpha_scale = s_a, beta_scale = s_b.
    """

    def __init__(self, n: int, d: int, sublayer_index: int, eps: float, norm_gain: bool = False,
                 fused: bool = True):
        super().__init__(n, eps, fused)
        # option connector_norm_gain: the learnable gain of the HC paper's connector norm, init 1
        self.norm_gain = nn.Parameter(torch.ones(d)) if norm_gain else None
        static_alpha = torch.cat([F.one_hot(torch.tensor(sublayer_index % n), n)[:, None].float(), torch.eye(n)], 1)
        self.static_alpha = nn.Parameter(static_alpha)  # [n, n+1]
        self.dynamic_alpha = nn.Parameter(torch.zeros(d, n + 1))
        self.alpha_scale = nn.Parameter(torch.tensor(0.01))
        self.static_beta = nn.Parameter(torch.ones(n))
        self.dynamic_beta = nn.Parameter(torch.zeros(d))
        self.beta_scale = nn.Parameter(torch.tensor(0.01))

    def _dynamic(self):
        """(W_alpha, w_beta) as applied to the gamma-free normalised stream: RMSNorm(H_s)·γ @ W =
        RMSNorm(H_s) @ (γ ⊙ W), so a gain folds exactly into the projections (γ = 1: the same tensors)."""
        if self.norm_gain is None:
            return self.dynamic_alpha, self.dynamic_beta
        return self.dynamic_alpha * self.norm_gain[:, None], self.dynamic_beta * self.norm_gain

    def _params(self, dtype: torch.dtype | None = None):
        """(W_a, w_b, S_a, s_b, s_a, s_beta) in the argument order of the connector op and its reference."""
        dynamic_alpha, dynamic_beta = self._dynamic()
        params = (dynamic_alpha, dynamic_beta, self.static_alpha, self.static_beta, self.alpha_scale, self.beta_scale)
        return params if dtype is None else tuple(p.to(dtype) for p in params)

    def fused(self, H):
        return hc_connect(H, *self._params(), self.eps)

    def reference(self, H):
        return reference.hc_connect(H, *self._params(), self.eps)

    def weights(self, H):
        """([w; R] [B,T,n+1,n], β [B,T,n]) step by step (the reference's `hc_coefficients`), for hooks to read."""
        dtype = _compute_dtype(H)
        return reference.hc_coefficients(H.to(dtype), *self._params(dtype), self.eps)


class ManifoldHyperConnection(_Connector):
    """mHC connector: sigmoid width, 2·sigmoid depth, Sinkhorn residual mixing, from vec(H).

    phi_pre [n·d, n], phi_post [n·d, n], phi_res [n·d, n²] (row-major [o,i]); bias_pre [n],
    bias_post [n], bias_res [n, n]; gate_pre/post/res scalars (the paper's alpha gating factors).
    """

    def __init__(self, n: int, d: int, sublayer_index: int, eps: float, init: str, t_max: int,
                 order: str = "rows_last", fused: bool = True):
        super().__init__(n, eps, fused)
        self.t_max, self.order = t_max, order
        self._first = _softmax_dim(order)
        self.phi_pre = nn.Parameter(torch.zeros(n * d, n))
        self.phi_post = nn.Parameter(torch.zeros(n * d, n))
        self.phi_res = nn.Parameter(torch.zeros(n * d, n * n))
        self.gate_pre, self.gate_post, self.gate_res = (nn.Parameter(torch.tensor(0.01)) for _ in range(3))
        selected, eye = F.one_hot(torch.tensor(sublayer_index % n), n).float(), torch.eye(n)
        if init == "hc_like":
            bias_pre, bias_post, bias_res = GAP * (2 * selected - 1), torch.zeros(n), GAP * (2 * eye - 1)
        elif init == "uniform":
            bias_pre, bias_post, bias_res = torch.zeros(n), torch.zeros(n), torch.zeros(n, n)
        else:  # lucidrains
            bias_pre, bias_post, bias_res = selected, torch.ones(n), eye
        self.bias_pre, self.bias_post = nn.Parameter(bias_pre), nn.Parameter(bias_post)
        self.bias_res = nn.Parameter(bias_res)

    def _params(self, dtype: torch.dtype | None = None):
        """(φ_pre, φ_post, φ_res, g_pre, g_post, g_res, b_pre, b_post, b_res): the connector op's argument order."""
        params = (self.phi_pre, self.phi_post, self.phi_res, self.gate_pre, self.gate_post, self.gate_res,
                  self.bias_pre, self.bias_post, self.bias_res)
        return params if dtype is None else tuple(p.to(dtype) for p in params)

    def fused(self, H):
        return mhc_connect(H, *self._params(), self.eps, self.t_max, self._first)

    def reference(self, H):
        sinkhorn = sinkhorn_ops.sinkhorn if compiling() else None  # compiled: the Sinkhorn stays the opaque op
        return reference.mhc_connect(H, *self._params(), self.eps, self.t_max, self._first, sinkhorn)

    def weights(self, H):
        """([H_pre; H_res] [B,T,n+1,n], H_post [B,T,n]) step by step (the reference's `mhc_coefficients`)."""
        dtype = _compute_dtype(H)
        sinkhorn = lambda z, t_max, first: _sinkhorn(z, t_max, first, self.use_fused)  # noqa: E731
        return reference.mhc_coefficients(H.to(dtype), *self._params(dtype), self.eps, self.t_max, self._first,
                                          sinkhorn)


# -- the scheme -------------------------------------------------------------------------------

class HyperScheme(ResidualScheme):
    """HC / mHC: n-stream state [B,T,n,d], one connector per sublayer (see the module docstring)."""

    single_stream = False
    skip_rules = ("identity", "branch")
    compile_region = "step"  # under torch.compile the connectors take their plain-autograd references
    kernel_libraries = ("connector",)
    # the one structural difference of mHC (MHCScheme) from HC (HCScheme): sigmoid pre/post and a Sinkhorn
    # doubly stochastic stream mixer (ManifoldHyperConnection) instead of tanh-dynamic width/depth connections
    manifold: bool = False

    @classmethod
    def option_schema(cls, arch: str) -> dict[str, Option]:
        """The options of the module docstring, with `_DEFAULTS` (n_streams, sinkhorn_iters: positive
        integers; connector_norm_eps > 0; mhc_init, sinkhorn_order: their listed values)."""
        choices = {"mhc_init": MHC_INITS, "sinkhorn_order": SINKHORN_ORDERS, "readout": READOUTS}
        return {name: _option(default, choices.get(name, ())) for name, default in _DEFAULTS[arch].items()}

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)  # sets self.opts (validated, defaults filled in)
        self.n = self.opts.n_streams
        if self.opts.head_mixer and self.opts.readout != "sum":
            raise DepthToolsError(f"{cfg.arch}: head_mixer weights the streams itself; it needs readout='sum', "
                                  f"got readout={self.opts.readout!r}")
        self._blocks: list[nn.Module] = []  # plain list (not registered): for the "branch" skip
        if self.opts.head_mixer:
            nd = self.n * cfg.d_model
            self.head_fn = nn.Parameter(torch.zeros(self.n, nd))  # [n, n·d]
            self.head_base = nn.Parameter(torch.zeros(self.n))
            self.head_scale = nn.Parameter(torch.ones(1))
        else:
            self.head_fn = None

    def recorded_config(self) -> ModelConfig:
        """mhc: "sinkhorn_order" is always written out (its default changed in issue 18)."""
        return explicit_options(self.cfg)

    def extra_flops(self) -> float:
        """Per sublayer, the connector's projection (HC: each of the n streams [d] @ [d, n+2]; mHC:
        vec H [nd] @ [nd, n²+2n]) and [w; R] @ H ([n+1, n] @ [n, d]); the head mixer's vec H @ head_fnᵀ.
        The update R H + β ⊗ y, the norms, tanh/sigmoid and Sinkhorn are elementwise (not counted)."""
        n, d, L = self.n, self.cfg.d_model, self.cfg.n_layer
        projection = n * d * (n * n + 2 * n) if self.manifold else n * d * (n + 2)
        head = n * n * d if self.head_fn is not None else 0
        return 2.0 * (2 * L * (projection + (n + 1) * n * d) + head)

    # -- construction -------------------------------------------------------------------------
    def _connector(self, sublayer_index: int) -> _Connector:
        opts, d = self.opts, self.cfg.d_model
        if not self.manifold:
            return HyperConnection(self.n, d, sublayer_index, opts.connector_norm_eps, opts.connector_norm_gain,
                                   opts.fused)
        return ManifoldHyperConnection(
            self.n, d, sublayer_index, opts.connector_norm_eps, opts.mhc_init, opts.sinkhorn_iters,
            opts.sinkhorn_order, opts.fused,
        )

    def build_block(self, block: nn.Module) -> None:
        d, eps = self.cfg.d_model, self.cfg.norm_eps
        block.attn_norm, block.mlp_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        block.attn_hc = self._connector(2 * block.index)
        block.mlp_hc = self._connector(2 * block.index + 1)
        block.hook_streams_pre, block.hook_streams_mid, block.hook_streams_post = HookPoint(), HookPoint(), HookPoint()
        self._blocks.append(block)

    def init_weights(self, model: nn.Module) -> None:
        """DepthBench: w_o and w2 / √n; mhc_init="uniform": φ ~ N(0, 0.02)."""
        with torch.no_grad():
            for block in model.blocks:
                if self.opts.scale_output_init_by_sqrt_n:
                    block.attn.w_o.weight.div_(math.sqrt(self.n))
                    block.mlp.w2.weight.div_(math.sqrt(self.n))
                if self.manifold and self.opts.mhc_init == "uniform":
                    for conn in (block.attn_hc, block.mlp_hc):
                        for phi in (conn.phi_pre, conn.phi_post, conn.phi_res):
                            nn.init.normal_(phi, std=0.02)

    def no_decay_names(self) -> tuple[str, ...]:
        routing = ("bias_pre", "bias_post", "bias_res", "gate_pre", "gate_post", "gate_res") if self.manifold else (
            "static_alpha", "static_beta", "alpha_scale", "beta_scale")
        return routing + ("head_base", "head_scale")

    def static_routing_names(self) -> tuple[str, ...]:
        """DepthBench's `HyperConnectionsConfig.static_parameter_patterns`, in our names: HC static_alpha,
        static_beta (its scales and dynamic projections decay); mHC with the Liger init ("uniform", its
        `liger_mhc` backend) the biases b and the gates alpha_pre/post/res = bias_*, gate_* (φ decays);
        mHC with another init (its PyTorch `mhc` backend) the biases pre/post/residual_bias = bias_* only.
        The head mixer is not DepthBench's, so it decays like any other parameter there."""
        if not self.manifold:
            return ("static_alpha", "static_beta")
        biases = ("bias_pre", "bias_post", "bias_res")
        return biases + (("gate_pre", "gate_post", "gate_res") if self.opts.mhc_init == "uniform" else ())

    # -- the depth-state contract -------------------------------------------------------------
    def embed_state(self, x0: torch.Tensor) -> torch.Tensor:
        """n copies of the embedding: [B,T,d] -> [B,T,n,d]."""
        return x0.unsqueeze(-2).repeat(1, 1, self.n, 1)

    def step(self, position, block, state, home, rope):
        attn = lambda x: block.attn(x, *rope)  # noqa: E731
        H = block.hook_streams_pre(state)
        H = block.hook_streams_mid(self._sublayer(H, block.attn_hc, block.attn_norm, attn, block.hook_attn_out))
        H = self._sublayer(H, block.mlp_hc, block.mlp_norm, block.mlp, block.hook_mlp_out)
        return block.hook_streams_post(H)

    def _sublayer(self, H, connector, norm, fn, hook_out) -> torch.Tensor:
        """H ← R @ H + β ⊗ f(Norm(u)) for one sublayer."""
        u, mixed, depth = connector(H)  # [B,T,d], [B,T,n,d], [B,T,n]
        y = hook_out(fn(norm(u)))  # [B,T,d]
        dtype = torch.promote_types(mixed.dtype, y.dtype)
        update = _Update.apply if self.opts.fused and not compiling() else reference.stream_update
        return update(mixed.to(dtype), depth.to(dtype), y.to(dtype))

    def skip(self, position, state, rule=None):
        """"identity": streams unchanged; "branch": R mixing of both sublayers, no branch output."""
        if self._check_rule(rule) == "identity":
            return state
        block = self._blocks[position]
        for connector in (block.attn_hc, block.mlp_hc):
            state = connector(state)[1]
        return state

    # -- DepthBench's protocol (depthtools.analysis.depthbench): its "hyper-connections" family --------
    depthbench_family = "hyper-connections"

    def depthbench_state(self, state: torch.Tensor) -> torch.Tensor:
        """[B,T,n·d]: `forward_depth_states` concatenates the n streams."""
        return state.flatten(-2)

    def depthbench_block_output(self, state: torch.Tensor) -> torch.Tensor:
        """[B·n,T,d]: the older scripts fold the streams into the batch, b-major (`_flatten_from_streams`)."""
        return state.movedim(-2, 1).flatten(0, 1)

    def depthbench_with_input(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The folded streams x [B·n,T,d] back as the state [B,T,n,d]."""
        return x.unflatten(0, (-1, self.n)).movedim(1, -2)

    def depthbench_lens_logits(self, model: nn.Module, state: torch.Tensor) -> torch.Tensor:
        """The model's head, except readout "normed_sum" (DepthBench's HC head, Σ_s Norm(H_s)) without the head
        mixer: DepthBench's lens still decodes Norm(Σ_s H_s), so at l = L it is not the model's output."""
        if self.no_readout() is not None:
            return model.readout_logits(state.sum(-2))
        return model.head(state)

    def no_readout(self) -> tuple[str, str] | None:
        """readout "normed_sum" without the head mixer norms every stream before the sum: no vector before it."""
        if self.head_fn is None and self.opts.readout == "normed_sum":
            return f"{self.cfg.arch} with readout='normed_sum'", "norms each stream before summing them"
        return None

    def readout(self, state: torch.Tensor) -> torch.Tensor:
        """[B,T,d]: Σ_s H_s (readout "sum"), the mean (readout "mean"), or the learned head mixer
        Σ_s p_s H_s when enabled. readout "normed_sum" has no vector before the final norm: an error."""
        if self.head_fn is None:
            mode = self.opts.readout
            if mode == "normed_sum":
                raise DepthToolsError(
                    f"{self.cfg.arch} with readout='normed_sum' norms each stream before summing, so there is no "
                    "single vector before the final norm for this analysis to read; use model.head(state) for logits, "
                    "or a model with readout='sum'")
            return state.mean(-2) if mode == "mean" else state.sum(-2)
        p = self.readout_weights(state)  # [B,T,n]
        return (p.to(state.dtype).unsqueeze(-1) * state).sum(-2)

    def final_hidden(self, state: torch.Tensor, final_norm: nn.Module) -> torch.Tensor:
        """[B,T,d] the unembedding reads: final_norm(readout), or for readout "normed_sum" (DepthBench's
        HC head, `Transformer.forward`: lm_head.norm on every folded stream, then the sum) Σ_s final_norm(H_s)."""
        if self.head_fn is None and self.opts.readout == "normed_sum":
            return final_norm(state).sum(-2)
        return final_norm(self.readout(state))

    def final_weights(self, state: torch.Tensor, final_norm: nn.Module) -> torch.Tensor:
        """[B,T,n] weight of each stream in what the unembedding reads, up to one linear map common to all
        streams: the readout weights, or for readout "normed_sum" the scale final_norm puts on each stream,
        1/sqrt(mean((H_s − centre)²) + eps) (centre: the mean for LayerNorm, 0 for RMSNorm), since
        Σ_s final_norm(H_s) = γ ⊙ C(Σ_s H_s / σ_s) + n·β. In float64; `depth_routing`'s final consumer."""
        if self.head_fn is not None or self.opts.readout != "normed_sum":
            return self.readout_weights(state).to(torch.float64)
        x = state.to(torch.float64)
        if getattr(final_norm, "centers", False):
            x = x - x.mean(-1, keepdim=True)
        return torch.rsqrt(x.pow(2).mean(-1) + final_norm.eps)

    def readout_weights(self, state: torch.Tensor) -> torch.Tensor:
        """[B,T,n] weight of each stream in the readout: ones, or the head mixer's p (in float32 or wider)."""
        if self.head_fn is None:
            return state.new_ones(state.shape[:-1])
        with _full_precision(state):
            dtype = _compute_dtype(state)
            x = state.flatten(-2).to(dtype)  # [B,T,n·d]
            mix = (x @ self.head_fn.to(dtype).T) * _inverse_rms(x, self.opts.connector_norm_eps)  # x' W^T
            logits = self.head_scale.to(dtype) * mix + self.head_base.to(dtype)  # [B,T,n]
            return torch.sigmoid(logits) + HEAD_EPS

    def depth_routing(self, model, tokens, exclude_first):
        """The unfolded layer-to-layer matrix (HC paper; AttnRes paper §6.2). With sublayer j's connector
        weights w_j, R_j, β_j (the hooks hook_{width,res,depth}_weights), the streams before consumer c
        are P_{0→c}(1 ⊗ x_0) + Σ_{j<c} P_{j+1→c} β_j y_j with P_{a→c} = R_{c−1}⋯R_a, so W[c, j+1] =
        w_cᵀ P_{j+1→c} β_j and W[c, 0] = w_cᵀ P_{0→c} 1, per token, then averaged. The final consumer
        reads the readout weights normalised to sum 1 (ln_final is scale invariant); under readout
        "normed_sum" the final norm's per-stream scales 1/σ_s, normalised alike (`final_weights`). mHC adds, per
        sublayer, how far the finite Sinkhorn R_j is from doubly stochastic over every token:
        sinkhorn_row_error = max |Σ_i R_j[o,i] − 1|, sinkhorn_col_error = max |Σ_o R_j[o,i] − 1| (and
        their _max model rows); the normalisation that runs last is exact to rounding."""
        F64, S = torch.float64, 2 * self.cfg.n_layer
        names = {f"blocks.{b}.{side}_hc.hook_{part}_weights": (2 * b + k, part)
                 for b in range(self.cfg.n_layer) for k, side in enumerate(("attn", "mlp"))
                 for part in ("width", "res", "depth")}
        cache: dict[tuple[int, str], torch.Tensor] = {}
        residuals: dict[int, tuple[float, float]] = {}  # sublayer -> (row, column) Sinkhorn error, all tokens

        def store(tensor, hook):
            key = names[hook.name]
            if key[1] == "res" and self.manifold:
                residuals[key[0]] = sinkhorn_residuals(tensor.detach().to(F64))  # exact sums of the stored entries
            cache[key] = tensor.detach()[:, exclude_first:].to(F64).flatten(0, 1)  # [N, ...]

        with torch.no_grad(), model.hooks(fwd_hooks=[(name, store) for name in names]):
            states = model.run_states(tokens)
            final = self.final_weights(states[-1], model.ln_final)[:, exclude_first:].flatten(0, 1)  # [N, n]
        w, R, beta = ([cache[(j, part)] for j in range(S)] for part in ("width", "res", "depth"))
        final = final / final.sum(-1, keepdim=True)
        W = torch.full((S + 1, S + 1), math.nan, dtype=F64)
        for c in range(S + 1):
            a = w[c] if c < S else final  # [N, n]
            for j in range(c - 1, -1, -1):
                W[c, j + 1] = (a * beta[j]).sum(-1).mean()
                a = torch.einsum("noi,no->ni", R[j], a)  # a <- R_jᵀ a
            W[c, 0] = a.sum(-1).mean()
        consumers = [(c, "attn" if c % 2 == 0 else "mlp") for c in range(S)] + [(S, "final")]
        extra = []
        for j, (row, col) in sorted(residuals.items()):
            kind = "attn" if j % 2 == 0 else "mlp"
            extra += [{"metric": f"sinkhorn_{side}_error", "unit": "sublayer_depth", "layer": j, "value": value,
                       "consumer_kind": kind} for side, value in (("row", row), ("col", col))]
        if residuals:
            extra += [{"metric": "sinkhorn_row_error_max", "value": max(r for r, _ in residuals.values())},
                      {"metric": "sinkhorn_col_error_max", "value": max(c for _, c in residuals.values())}]
        return DepthRouting(consumers, W, [], extra)

    # -- TransformerLens' cache functions ------------------------------------------------------
    def tl_limits(self) -> dict[str, str]:
        """Per-sublayer head/neuron results are exact (hook_attn_out/hook_mlp_out are the branch outputs);
        there is no single stream to accumulate or decompose."""
        reason = (f"{self.cfg.arch} has {self.n} residual streams (blocks.{{l}}.hook_streams_pre|mid|post "
                  f"[B,T,{self.n},d]) and no single hook_resid_* stream; read depths with model.readout / "
                  "run_states (depthtools.analysis.lens) and use depthtools.analysis.contrib for its decomposition")
        return {"stream": reason, "sum": reason}

    def tl_norm_site(self, block, sublayer: str):
        return NormSite(f"blocks.{block.index}.{sublayer}_hc.hook_branch_in", getattr(block, f"{sublayer}_norm"))

    def geometry(self, state: torch.Tensor) -> torch.Tensor:
        """The streams concatenated: [B,T,n,d] -> [B,T,n·d]."""
        return state.flatten(-2)


class HCScheme(HyperScheme):
    """HC: tanh-dynamic width/depth connections per sublayer (HyperConnection)."""

    manifold = False


class MHCScheme(HyperScheme):
    """mHC: sigmoid pre/post and a Sinkhorn doubly stochastic stream mixer (ManifoldHyperConnection)."""

    manifold = True


# -- registry ---------------------------------------------------------------------------------

def _n(cfg: ModelConfig) -> int:
    return HyperScheme.options_for(cfg).n_streams


def _head_mixer_params(cfg: ModelConfig) -> int:
    n = _n(cfg)
    return n * n * cfg.d_model + n + 1 if HyperScheme.options_for(cfg).head_mixer else 0


def hc_extra_params(cfg: ModelConfig) -> int:
    """2L·(n² + 2n + 2 + d(n+2)) (+ 2L·d connector norm gains, + n²d + n + 1 with the head mixer)."""
    n, d, L = _n(cfg), cfg.d_model, cfg.n_layer
    gains = 2 * L * d if HyperScheme.options_for(cfg).connector_norm_gain else 0
    return 2 * L * (n * n + 2 * n + 2 + d * (n + 2)) + gains + _head_mixer_params(cfg)


def mhc_extra_params(cfg: ModelConfig) -> int:
    """2L·(nd(n² + 2n) + n² + 2n + 3) (+ n²d + n + 1 with the head mixer)."""
    n, d, L = _n(cfg), cfg.d_model, cfg.n_layer
    return 2 * L * (n * d * (n * n + 2 * n) + n * n + 2 * n + 3) + _head_mixer_params(cfg)


ARCH_SPECS = [
    ArchSpec(
        name="hc", family="multi-stream",
        description="Hyper-Connections: n streams, static + tanh-dynamic width/depth connections per sublayer",
        extra_formula="2L·(n² + 2n + 2 + d(n+2)) [+ 2Ld connector norm gains] [+ n²d + n + 1 head mixer]",
        extra_params=hc_extra_params,
        paper="Zhu et al. 2024, Hyper-Connections, arXiv 2409.19606",
        scheme=HCScheme, in_depthbench=True, profiles={"depthbench": _HC_DEPTHBENCH},
    ),
    ArchSpec(
        name="mhc", family="multi-stream",
        description="mHC: hyper-connections with sigmoid pre/post and Sinkhorn doubly stochastic stream mixing",
        extra_formula="2L·(nd(n² + 2n) + n² + 2n + 3) [+ n²d + n + 1 head mixer]",
        extra_params=mhc_extra_params,
        paper="Xie et al. 2025, mHC: Manifold-Constrained Hyper-Connections, arXiv 2512.24880",
        scheme=MHCScheme, in_depthbench=True, profiles={"depthbench": _mhc_depthbench},
        # an mhc config.json without "sinkhorn_order" was written before the option existed, when the Sinkhorn
        # ran rows then columns: it loads as "cols_last" and reproduces its logits exactly
        legacy_defaults=_LEGACY_DEFAULTS["mhc"],
    ),
]
