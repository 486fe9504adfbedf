"""Hyper-Connections (HC) and Manifold-Constrained Hyper-Connections (mHC): n residual streams.

Equations, inits and sources: shared/reference/architectures.md §3.1 (HC), §3.2 (mHC), §4.

State: H [B,T,n,d], n parallel residual streams per token (n = options["n_streams"], default 4);
z_0 = n copies of the embedding. Every sublayer (attention, then MLP: 2 per block, sublayer
index i = 2b + {0,1}) has a *connector* that reads H and returns three per-token weights

    width  w [n]     branch input   u = Σ_s w_s H_s                 (what the sublayer reads)
    res    R [n,n]   stream mixing  row o of R mixes the streams into output stream o
    depth  β [n]     output weights H ← R @ H + β ⊗ f(Norm_i(u))

where Norm_i is the sublayer's own pre-norm (block.attn_norm / block.mlp_norm, RMSNorm with gamma).

HC (Zhu et al. 2024), lucidrains layout: alpha = [A_m | A_r] is [n, n+1] with rows = streams,
    Hbar  = RMSNorm(H) per stream, no gamma, eps 1e-8 (DepthBench)
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

Readout (one collapse for logits and lens): Σ_s H_s, then the model's ln_final and unembedding.
DepthBench's Liger mHC uses the mean; FinalNorm makes sum ≡ mean up to its eps. Option
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

Options: n_streams (4), scale_output_init_by_sqrt_n (True: attention w_o and MLP w2 init / √n,
as DepthBench; not in the papers), head_mixer (False), connector_norm_eps (1e-8 HC, 1e-6 mHC),
and for mHC mhc_init ("hc_like") and sinkhorn_iters (20). Weight decay: static routing params,
gates and biases are excluded (`no_decay_names`, as DepthBench's disable_static_weight_decay);
the dynamic projections (dynamic_alpha/beta, φ, head_fn) decay like other matrices.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch.layers import RMSNorm
from depthtools.arch.registry import ArchSpec
from depthtools.arch.scheme import ResidualScheme
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

MHC_INITS = ("hc_like", "uniform", "lucidrains")
HEAD_EPS = 1e-6  # DeepSeek-V4 hc_eps: keeps every head-mixer weight strictly positive
GAP = 8.0  # |bias| of the hc_like mHC init (DepthBench "gap8")

_COMMON_OPTIONS = {"n_streams": 4, "scale_output_init_by_sqrt_n": True, "head_mixer": False}
_DEFAULTS = {
    "hc": {**_COMMON_OPTIONS, "connector_norm_eps": 1e-8},
    "mhc": {**_COMMON_OPTIONS, "connector_norm_eps": 1e-6, "mhc_init": "hc_like", "sinkhorn_iters": 20},
}


def hyper_options(cfg: ModelConfig) -> dict:
    """cfg.options merged over this architecture's defaults, validated (one-line errors)."""
    defaults = _DEFAULTS[cfg.arch]
    unknown = sorted(set(cfg.options) - set(defaults))
    if unknown:
        raise DepthToolsError(f"unknown {cfg.arch} option(s) {unknown}; valid: {sorted(defaults)}")
    opts = {**defaults, **cfg.options}
    n = opts["n_streams"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DepthToolsError(f"{cfg.arch} option n_streams must be a positive integer, got {n!r}")
    if opts.get("mhc_init", "hc_like") not in MHC_INITS:
        raise DepthToolsError(f"mhc option mhc_init must be one of {list(MHC_INITS)}, got {opts['mhc_init']!r}")
    for flag in ("scale_output_init_by_sqrt_n", "head_mixer"):
        if not isinstance(opts[flag], bool):
            raise DepthToolsError(f"{cfg.arch} option {flag} must be true or false, got {opts[flag]!r}")
    iters = opts.get("sinkhorn_iters", 20)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise DepthToolsError(f"mhc option sinkhorn_iters must be a positive integer, got {iters!r}")
    eps = opts["connector_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise DepthToolsError(f"{cfg.arch} option connector_norm_eps must be > 0, got {opts['connector_norm_eps']!r}")
    return opts


# -- numerics ---------------------------------------------------------------------------------

def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs, else the input's own (float64 stays float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _full_precision(t: torch.Tensor):
    """A context that switches autocast off (routing weights are computed in float32 or wider)."""
    device = t.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else nullcontext()


def sinkhorn_knopp(logits: torch.Tensor, t_max: int = 20) -> torch.Tensor:
    """Doubly stochastic projection of logits [..., n, n] (mHC Eq.: M = exp(logits), then t_max
    rounds of row then column normalisation), in float32 or wider even under bf16/autocast.

    The first row normalisation of exp(logits) is a softmax (max-subtracted, no overflow). The
    result's columns sum to 1 exactly; rows to 1 up to Sinkhorn convergence. Differentiable: the
    gradient is the exact gradient of the unrolled t_max iterations.
    """
    with _full_precision(logits):
        return _SinkhornKnopp.apply(logits.to(_compute_dtype(logits)), t_max)


def _tokens_last(x: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of x [..., n, n] laid out as [n, n, N] (N = all leading dims)."""
    n = x.shape[-1]
    tokens = x.numel() // (n * n)
    out = x.new_empty(n * n, tokens)
    out.copy_(x.reshape(tokens, n * n).T)
    return out.view(n, n, tokens)


class _SinkhornKnopp(torch.autograd.Function):
    """The unrolled Sinkhorn iteration with a hand-written backward, run with tokens last.

    Why: n is tiny (4), and PyTorch's CPU kernels for reductions/softmax over a size-4 last
    dimension are ~10-100x slower than over a contiguous token dimension; autograd would also
    record ~6 nodes per half-step. Layout inside: [n_out, n_in, N] with N = all leading dims.
    Each half-step is y = m / s with s = m.sum(dim) (clamped at the smallest normal so an
    underflowed line cannot give 0/0); its backward is dm = (g - sum(g·y, dim)) / s.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, t_max: int) -> torch.Tensor:
        n = logits.shape[-1]
        z = _tokens_last(logits)  # [n, n, N]
        m = p = torch.softmax(z, dim=1)  # exp + first row normalisation
        tiny = torch.finfo(m.dtype).tiny
        trace = []  # (y, s) of each half-step: columns, rows, columns, ..., columns
        for step in range(2 * t_max - 1):
            s = m.sum(dim=0 if step % 2 == 0 else 1, keepdim=True).clamp_min_(tiny)
            m = m / s
            trace += [m, s]
        ctx.save_for_backward(p, *trace)
        return m.view(n * n, -1).T.reshape(logits.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        p, *trace = ctx.saved_tensors
        n = p.shape[0]
        g = _tokens_last(grad)  # a fresh copy: updated in place below
        gy = torch.empty_like(g)
        for step in reversed(range(len(trace) // 2)):
            y, s = trace[2 * step], trace[2 * step + 1]
            torch.mul(g, y, out=gy)
            g.sub_(gy.sum(dim=0 if step % 2 == 0 else 1, keepdim=True)).div_(s)
        g = p * (g - (g * p).sum(dim=1, keepdim=True))  # softmax backward
        return g.view(n * n, -1).T.reshape(grad.shape), None


# -- connectors -------------------------------------------------------------------------------

class _Connector(nn.Module):
    """Routes the streams around one sublayer: subclasses define `weights(H) -> (routing, β)`,
    routing [B,T,n+1,n] = [w; R] (row 0: branch-input weights, rows 1..n: stream mixing)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.n, self.eps = n, eps
        self.hook_width_weights = HookPoint()  # [B,T,n]    w: branch-input weights
        self.hook_res_weights = HookPoint()  # [B,T,n,n]    R: new streams = R @ streams
        self.hook_depth_weights = HookPoint()  # [B,T,n]    β: branch-output weights
        self.hook_branch_in = HookPoint()  # [B,T,d]        u = Σ_s w_s H_s

    def weights(self, H: torch.Tensor):
        raise NotImplementedError

    def forward(self, H: torch.Tensor):
        """(u [B,T,d], R @ H [B,T,n,d], β [B,T,n]) for streams H [B,T,n,d]."""
        with _full_precision(H):
            routing, depth = self.weights(H)  # [B,T,n+1,n], [B,T,n]
            if self.hook_width_weights._forward_hooks or self.hook_res_weights._forward_hooks:
                width, res = routing.split([1, self.n], dim=-2)  # split only when hooked: no copies
                width = self.hook_width_weights(width.squeeze(-2)).unsqueeze(-2)
                routing = torch.cat([width, self.hook_res_weights(res)], dim=-2)
            depth = self.hook_depth_weights(depth)
            # one batched matmul per token (a 3-d bmm: CPU's 4-d matmul path is ~30x slower here)
            mixed = torch.bmm(routing.to(H.dtype).flatten(0, -3), H.flatten(0, -3))  # [B·T, n+1, d]
            u, mixed = mixed.view(*H.shape[:-2], self.n + 1, H.shape[-1]).split([1, self.n], dim=-2)
        return self.hook_branch_in(u.squeeze(-2)), mixed, depth.to(H.dtype)


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dim, keepdim: RMSNorm without gamma is x · this.

    Projections of a normalised vector are computed as (x @ W) · inverse_rms (as in Liger's
    reference), which avoids materialising the normalised [B,T,n,d] copy.
    """
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class HyperConnection(_Connector):
    """HC connector (static + tanh-dynamic width/depth connections), lucidrains parameter layout.

    static_alpha [n, n+1] = [S_m | S_r], dynamic_alpha [d, n+1] = [W_m | W_r], static_beta [n] = S_b,
    dynamic_beta [d] = W_b, alpha_scale = s_a, beta_scale = s_b.
    """

    def __init__(self, n: int, d: int, sublayer_index: int, eps: float):
        super().__init__(n, eps)
        static_alpha = torch.cat([F.one_hot(torch.tensor(sublayer_index % n), n)[:, None].float(), torch.eye(n)], 1)
        self.static_alpha = nn.Parameter(static_alpha)  # [n, n+1]
        self.dynamic_alpha = nn.Parameter(torch.zeros(d, n + 1))
        self.alpha_scale = nn.Parameter(torch.tensor(0.01))
        self.static_beta = nn.Parameter(torch.ones(n))
        self.dynamic_beta = nn.Parameter(torch.zeros(d))
        self.beta_scale = nn.Parameter(torch.tensor(0.01))

    def weights(self, H):
        n, dtype = self.n, _compute_dtype(H)
        H = H.to(dtype)
        # all of [A_m | A_r | B] at once: rows = input streams s, columns = w | A_r | β
        static = torch.cat([self.static_alpha, self.static_beta[:, None]], 1).to(dtype)  # [n, n+2]
        scale = torch.cat([self.alpha_scale.expand(n + 1), self.beta_scale[None]]).to(dtype)  # [n+2]
        proj = torch.cat([self.dynamic_alpha, self.dynamic_beta[:, None]], 1).to(dtype)  # [d, n+2]
        coeffs = static + scale * torch.tanh((H @ proj) * _inverse_rms(H, self.eps))  # tanh(Hbar @ proj)
        return coeffs[..., : n + 1].transpose(-1, -2), coeffs[..., n + 1]  # [A_m | A_r]^T = [w; R], β


class ManifoldHyperConnection(_Connector):
    """mHC connector: sigmoid width, 2·sigmoid depth, Sinkhorn residual mixing, from vec(H).

    phi_pre [n·d, n], phi_post [n·d, n], phi_res [n·d, n²] (row-major [o,i]); bias_pre [n],
    bias_post [n], bias_res [n, n]; gate_pre/post/res scalars (the paper's alpha gating factors).
    """

    def __init__(self, n: int, d: int, sublayer_index: int, eps: float, init: str, t_max: int):
        super().__init__(n, eps)
        self.t_max = t_max
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

    def weights(self, H):
        n, dtype = self.n, _compute_dtype(H)
        x = H.flatten(-2).to(dtype)  # [B,T,n·d]
        phi = torch.cat([self.phi_pre, self.phi_post, self.phi_res], 1).to(dtype)  # [n·d, 2n+n²]
        mix = (x @ phi) * _inverse_rms(x, self.eps)  # [B,T,2n+n²] = x' @ phi
        pre, post, res = mix.split([n, n, n * n], dim=-1)
        p = lambda t: t.to(dtype)  # noqa: E731
        h_pre = torch.sigmoid(p(self.gate_pre) * pre + p(self.bias_pre))
        h_post = 2 * torch.sigmoid(p(self.gate_post) * post + p(self.bias_post))
        h_res = sinkhorn_knopp(p(self.gate_res) * res.unflatten(-1, (n, n)) + p(self.bias_res), self.t_max)
        return torch.cat([h_pre.unsqueeze(-2), h_res], dim=-2), h_post


# -- the scheme -------------------------------------------------------------------------------

class HyperScheme(ResidualScheme):
    """HC / mHC: n-stream state [B,T,n,d], one connector per sublayer (see the module docstring)."""

    single_stream = False
    skip_rules = ("identity", "branch")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.opts = hyper_options(cfg)
        self.n = self.opts["n_streams"]
        self._blocks: list[nn.Module] = []  # plain list (not registered): for the "branch" skip
        if self.opts["head_mixer"]:
            nd = self.n * cfg.d_model
            self.head_fn = nn.Parameter(torch.zeros(self.n, nd))  # [n, n·d]
            self.head_base = nn.Parameter(torch.zeros(self.n))
            self.head_scale = nn.Parameter(torch.ones(1))
        else:
            self.head_fn = None

    # -- construction -------------------------------------------------------------------------
    def _connector(self, sublayer_index: int) -> _Connector:
        opts, d = self.opts, self.cfg.d_model
        if self.cfg.arch == "hc":
            return HyperConnection(self.n, d, sublayer_index, opts["connector_norm_eps"])
        return ManifoldHyperConnection(
            self.n, d, sublayer_index, opts["connector_norm_eps"], opts["mhc_init"], opts["sinkhorn_iters"]
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
                if self.opts["scale_output_init_by_sqrt_n"]:
                    block.attn.w_o.weight.div_(math.sqrt(self.n))
                    block.mlp.w2.weight.div_(math.sqrt(self.n))
                if self.cfg.arch == "mhc" and self.opts["mhc_init"] == "uniform":
                    for conn in (block.attn_hc, block.mlp_hc):
                        for phi in (conn.phi_pre, conn.phi_post, conn.phi_res):
                            nn.init.normal_(phi, std=0.02)

    def no_decay_names(self) -> tuple[str, ...]:
        routing = ("static_alpha", "static_beta", "alpha_scale", "beta_scale") if self.cfg.arch == "hc" else (
            "bias_pre", "bias_post", "bias_res", "gate_pre", "gate_post", "gate_res")
        return routing + ("head_base", "head_scale")

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

    @staticmethod
    def _sublayer(H, connector, norm, fn, hook_out) -> torch.Tensor:
        """H ← R @ H + β ⊗ f(Norm(u)) for one sublayer."""
        u, mixed, depth = connector(H)  # [B,T,d], [B,T,n,d], [B,T,n]
        y = hook_out(fn(norm(u)))  # [B,T,d]
        return torch.addcmul(mixed, depth.unsqueeze(-1), y.unsqueeze(-2))

    def skip(self, position, state, rule=None):
        """"identity": streams unchanged; "branch": R mixing of both sublayers, no branch output."""
        if self._check_rule(rule) == "identity":
            return state
        block = self._blocks[position]
        for connector in (block.attn_hc, block.mlp_hc):
            state = connector(state)[1]
        return state

    def readout(self, state: torch.Tensor) -> torch.Tensor:
        """[B,T,d]: Σ_s H_s, or the learned head mixer Σ_s p_s H_s when enabled."""
        if self.head_fn is None:
            return state.sum(-2)
        with _full_precision(state):
            dtype = _compute_dtype(state)
            x = state.flatten(-2).to(dtype)  # [B,T,n·d]
            mix = (x @ self.head_fn.to(dtype).T) * _inverse_rms(x, self.opts["connector_norm_eps"])  # x' W^T
            logits = self.head_scale.to(dtype) * mix + self.head_base.to(dtype)  # [B,T,n]
            p = torch.sigmoid(logits) + HEAD_EPS  # [B,T,n]
        return (p.to(state.dtype).unsqueeze(-1) * state).sum(-2)

    def geometry(self, state: torch.Tensor) -> torch.Tensor:
        """The streams concatenated: [B,T,n,d] -> [B,T,n·d]."""
        return state.flatten(-2)


# -- registry ---------------------------------------------------------------------------------

def _n(cfg: ModelConfig) -> int:
    return int(cfg.options.get("n_streams", 4))


def _head_mixer_params(cfg: ModelConfig) -> int:
    n = _n(cfg)
    return n * n * cfg.d_model + n + 1 if cfg.options.get("head_mixer", False) else 0


def hc_extra_params(cfg: ModelConfig) -> int:
    """2L·(n² + 2n + 2 + d(n+2)) (+ n²d + n + 1 with the head mixer)."""
    n, d, L = _n(cfg), cfg.d_model, cfg.n_layer
    return 2 * L * (n * n + 2 * n + 2 + d * (n + 2)) + _head_mixer_params(cfg)


def mhc_extra_params(cfg: ModelConfig) -> int:
    """2L·(nd(n² + 2n) + n² + 2n + 3) (+ n²d + n + 1 with the head mixer)."""
    n, d, L = _n(cfg), cfg.d_model, cfg.n_layer
    return 2 * L * (n * d * (n * n + 2 * n) + n * n + 2 * n + 3) + _head_mixer_params(cfg)


ARCH_SPECS = [
    ArchSpec(
        name="hc", family="multi-stream",
        description="Hyper-Connections: n streams, static + tanh-dynamic width/depth connections per sublayer",
        extra_formula="2L·(n² + 2n + 2 + d(n+2)) [+ n²d + n + 1 head mixer]",
        extra_params=hc_extra_params,
        paper="Zhu et al. 2024, Hyper-Connections, arXiv 2409.19606",
        scheme=HyperScheme, in_depthbench=True,
    ),
    ArchSpec(
        name="mhc", family="multi-stream",
        description="mHC: hyper-connections with sigmoid pre/post and Sinkhorn doubly stochastic stream mixing",
        extra_formula="2L·(nd(n² + 2n) + n² + 2n + 3) [+ n²d + n + 1 head mixer]",
        extra_params=mhc_extra_params,
        paper="Xie et al. 2025, mHC: Manifold-Constrained Hyper-Connections, arXiv 2512.24880",
        scheme=HyperScheme, in_depthbench=True,
    ),
]
