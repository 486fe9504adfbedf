"""Backbone layers shared by every architecture: RMSNorm, RoPE, causal attention, SwiGLU.

Llama-style, no biases. Hook points follow TransformerLens names (docs/design.md §4). Attention runs
PyTorch's fused SDPA unless a hook is attached to `hook_pattern` (then the pattern is formed
explicitly so it can be read or edited) — so hooks cost nothing when none are attached.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch.backbone import HookedNorm, Norm, activation, backbone, banded_causal_mask, rotary_dim, softcap
from depthtools.arch.rope import PLAIN, RopeScaling
from depthtools.arch.torch_private import is_hooked, storage_unshared
from depthtools.errors import DepthToolsError

if TYPE_CHECKING:  # annotations only (depthtools.config imports nothing from arch/: no circle either way)
    from depthtools.config import ModelConfig


def fused_inverse_rms(x: torch.Tensor, eps: float, keepdim: bool = False,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """1/sqrt(mean(x²) + eps) over the last dim, from one fused norm (no x² temporary) and in-place
    arithmetic on its result: only where autograd does not record, i.e. inside the forward of a
    custom autograd Function (the hand-written HC/mHC connectors and AttnRes bank operations)."""
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=keepdim, out=out)
    return r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


def inverse_rms_derivative(t: torch.Tensor, inv: torch.Tensor, dim: int) -> torch.Tensor:
    """-t · inv³ / dim, the derivative of inv = 1/rms(x) over `dim` features (d inv/dx = -inv³ x / dim):
    backward, dL/dx += inverse_rms_derivative(dL/d inv, inv, dim) · x; forward mode,
    d inv = inverse_rms_derivative(x · dx, inv, dim). Companion of `fused_inverse_rms`."""
    return t * inv.pow(3) * (-1.0 / dim)


class BufferPool(dict):
    """Work buffers a scheme keeps from one step to the next (AttnRes gradients, MoDA depth K/V).

    Why: fresh allocations of tens of MB come back from the OS as page faults every step (counts in
    benchmarks/RESULTS.md). Not model state:
    a deep copy of the model starts empty."""

    def __deepcopy__(self, memo):
        return type(self)()

    def take(self, role: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised buffer: the one kept for this role and shape when nothing else uses it any
        more, else a new one (kept from now on, in place of any other shape of this role). Safe:
        a buffer that a state, view or gradient still references is never handed out again: neither a
        tensor sharing its storage (a view, a saved tensor) nor a holder of the buffer itself (e.g. the
        gradient accumulator of a MoDA slot store or AttnRes bank that took it and is still in its
        backward pass: references to the pool, to `kept` and getrefcount's argument are the 3 expected)."""
        key = (role, tuple(shape), dtype, device)
        kept = self.get(key)
        if kept is not None and sys.getrefcount(kept) <= 3 and storage_unshared(kept):
            return kept
        fresh = torch.empty(shape, dtype=dtype, device=device)
        for other in [k for k in self if k[0] == role]:
            del self[other]
        self[key] = fresh
        return fresh


class RMSNorm(nn.Module):
    """x / rms(x) · gamma over the last dimension (gamma init 1); `affine=False` drops gamma."""

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


class HookedRMSNorm(RMSNorm):
    """RMSNorm exposing TransformerLens' `hook_scale` and `hook_normalized` (for `ln_final`)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps)
        self.hook_scale = HookPoint()  # [B,T,1] root-mean-square
        self.hook_normalized = HookPoint()  # [B,T,d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_hooked(self.hook_scale, self.hook_normalized):
            return super().forward(x)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale * self.weight)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: RopeScaling = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, head_dim/2] for rotary embeddings (Llama convention, half-split), computed in
    float64. With partial rotary (`backbone.rotary_dim`), `head_dim` is the rotated width; `scaling`: a
    scaled RoPE type (`depthtools.arch.rope`; a length-dependent type gives its tables for T <= its context)."""
    return scaling.tables(head_dim, theta, max_seq_len)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B,T,H,hd] by position: pairs (i, i+r/2) as in HF Llama `rotate_half`, over the first
    r = 2·cos.shape[-1] features (r < hd: partial rotary, GPT-NeoX; the rest pass through)."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    T = x.shape[1]
    cos = cos[:T, None, :].to(x.dtype)  # [T,1,r/2]
    sin = sin[:T, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def make_norm(cfg: ModelConfig, dim: int | None = None, hooked: bool = False, kind: str | None = None) -> nn.Module:
    """The configured norm over `dim` features (default d_model): `RMSNorm` (or `HookedRMSNorm`) for the
    default options, so every existing model is unchanged; else a `backbone.Norm` of the configured kind.
    `kind` ("rms" | "layer") overrides the backbone's kind for a scheme's own choice (DeepNorm's `norm`),
    keeping the backbone's gain and bias settings and the model's `norm_eps`."""
    bb, dim = backbone(cfg), dim or cfg.d_model
    kind = kind or bb.norm
    if bb.default_norm and kind == "rms":
        return HookedRMSNorm(dim, cfg.norm_eps) if hooked else RMSNorm(dim, cfg.norm_eps)
    return (HookedNorm if hooked else Norm)(dim, cfg.norm_eps, kind, bb.norm_gain, bb.norm_bias)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with RoPE.

    Split into `qkv` / `attend` / `out` so architectures that attend to extra keys (MoDA) reuse
    the projections. Hooks: hook_q/k/v [B,T,H,hd] (after any QK-norm, before RoPE), hook_pattern
    [B,H,T,T], hook_z [B,T,H,hd]. The Pre-LN options (`backbone.Backbone`) add biases, QK-norm, clipping,
    a score scale and soft-cap, a sliding window and this layer's own RoPE base; `layer` is the block's
    index (its window and RoPE base are per layer).
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        bb = backbone(cfg)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.w_q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=bb.qkv_bias)
        self.w_k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=bb.qkv_bias)
        self.w_v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=bb.qkv_bias)
        self.w_o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=bb.attn_out_bias)
        if bb.qk_norm != "none":
            per_head = bb.qk_norm == "head"
            self.q_norm = make_norm(cfg, cfg.head_dim if per_head else cfg.n_heads * cfg.head_dim)
            self.k_norm = make_norm(cfg, cfg.head_dim if per_head else cfg.n_kv_heads * cfg.head_dim)
        self.qk_norm, self.clip, self.clip_after_norm = bb.qk_norm, bb.qkv_clip, bb.clip_after_norm
        self.rotary = bb.positions == "rope"
        self.scale = bb.attn_scale or None  # None: SDPA's own head_dim^-1/2
        self.softcap, self.window = bb.attn_softcap, bb.window(layer)
        # Tables per sequence length (dynamic / longrope RoPE): (rope, rotated features, base), and the last made
        self.length_rope: tuple[RopeScaling, int, float] | None = None
        self._length_tables: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None
        if self.rotary and bb.own_rope_base(layer, cfg.rope_theta):
            cos, sin = rope_tables(rotary_dim(cfg), cfg.max_seq_len, bb.rope_theta_sliding)
            self.register_buffer("rope_cos", cos, persistent=False)  # this layer's own plain base (Gemma-3 local)
            self.register_buffer("rope_sin", sin, persistent=False)
        elif self.rotary and bb.rope.length_dependent:
            self.length_rope = (bb.rope, rotary_dim(cfg), cfg.rope_theta)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_pattern, self.hook_z = HookPoint(), HookPoint()

    def _project(self, linear: nn.Linear, norm_name: str, x: torch.Tensor, heads: int) -> torch.Tensor:
        """linear(x) [B,T,heads,hd], clipped and normed as configured (before its hook and RoPE)."""
        B, T, _ = x.shape
        y = linear(x)
        if self.clip and not self.clip_after_norm:
            y = y.clamp(-self.clip, self.clip)
        if self.qk_norm == "full" and norm_name:
            y = getattr(self, norm_name)(y)
        y = y.view(B, T, heads, self.head_dim)
        if self.qk_norm == "head" and norm_name:
            y = getattr(self, norm_name)(y)
        if self.clip and self.clip_after_norm:
            y = y.clamp(-self.clip, self.clip)
        return y

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected, hooked and rotated q [B,T,H,hd], k and v [B,T,Hkv,hd]."""
        q = self.hook_q(self._project(self.w_q, "q_norm", x, self.n_heads))
        k = self.hook_k(self._project(self.w_k, "k_norm", x, self.n_kv_heads))
        v = self.hook_v(self._project(self.w_v, "", x, self.n_kv_heads))
        if not self.rotary:
            return q, k, v
        own = getattr(self, "rope_cos", None)
        if own is not None:
            cos, sin = own, self.rope_sin
        elif self.length_rope is not None:
            cos, sin = self.tables_for_length(q.shape[1], q.device)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def tables_for_length(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, r/2] of a length-dependent RoPE (dynamic, longrope) for a sequence of T tokens: its
        frequencies depend on T, so a sequence and its prefix rotate differently (as in transformers).
        The last length's tables are kept (every block reads the same length in one forward)."""
        kept = self._length_tables
        if kept is None or kept[0] != T or kept[1] != device:
            rope, dim, theta = self.length_rope
            cos, sin = rope.tables(dim, theta, T, seq_len=T)
            kept = self._length_tables = (T, device, cos.to(device), sin.to(device))
        return kept[2], kept[3]

    def _mask(self, T: int, device) -> torch.Tensor | None:
        """The banded causal mask of a sliding layer whose window binds at length T (None: plain causal)."""
        if not self.window or self.window >= T:
            return None
        return banded_causal_mask(T, self.window, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention; returns z [B,T,H,hd]."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B,H,T,hd]
        mask = self._mask(q.shape[2], q.device)
        if is_hooked(self.hook_pattern) or self.softcap:  # (a backward hook needs the pattern in the graph too)
            z = self._explicit_attention(q, k, v, mask)
        elif mask is not None:
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.n_kv_heads != self.n_heads)
        elif self.scale is not None:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            z = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
            )
        return self.hook_z(z.transpose(1, 2))

    def _explicit_attention(self, q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same attention with the pattern formed explicitly, so hooks can read/edit it."""
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        T = q.shape[2]
        if self.scale is None:
            scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
        else:
            scores = q @ k.transpose(-1, -2) * self.scale
        scores = softcap(scores, self.softcap)
        if mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        pattern = self.hook_pattern(scores.masked_fill(~mask, float("-inf")).softmax(-1))
        return pattern @ v

    def attend_rows(self, x: torch.Tensor, start: int, past, cos: torch.Tensor, sin: torch.Tensor):
        """Attention output [B,S,d] of the rows at positions start..start+S-1 of a sequence, x [B,S,d] their
        (normed) sublayer input, given `past` = (k, v) [B,start,Hkv,hd] of the rows before them (rotated; None
        at start 0); returns (output, (k, v) of all start+S rows) so a later call can extend the sequence.

        Why: the causal probe's future-effect runs share their first rows (`analysis.causal`), and attention
        is the only part of a block that reads other rows, only through their keys and values. Exact: q, k, v
        are per-row projections (biases, clip, QK-norm), RoPE rotates each row by its absolute position
        (the tables of length start+S: a length-dependent RoPE gets the whole sequence's), and the rows
        attend through `attend` itself over the whole length, the queries of rows < start zero (their
        outputs are dropped): the same causal or sliding-window mask, soft-cap and kernel, so each row gets
        what `forward` gives it, to the bit (the attention products of the zero rows are the only work
        spent on them). Hook points are not called on whole tensors: callers use it on unhooked models."""
        if (past is None) != (start == 0) or (past is not None and past[0].shape[1] != start):
            raise DepthToolsError(f"attend_rows needs the keys and values of exactly the {start} earlier rows")
        B, S, _ = x.shape
        T = start + S
        q = self._project(self.w_q, "q_norm", x, self.n_heads)
        k = self._project(self.w_k, "k_norm", x, self.n_kv_heads)
        v = self._project(self.w_v, "", x, self.n_kv_heads)
        if self.rotary:
            own = getattr(self, "rope_cos", None)
            if own is not None:
                cos, sin = own, self.rope_sin
            elif self.length_rope is not None:
                cos, sin = self.tables_for_length(T, q.device)
            q, k = apply_rope(q, cos[start:T], sin[start:T]), apply_rope(k, cos[start:T], sin[start:T])
        if past is not None:
            k, v = torch.cat((past[0], k), dim=1), torch.cat((past[1], v), dim=1)
            q = torch.cat((q.new_zeros(B, start, *q.shape[2:]), q), dim=1)
        return self.out(self.attend(q, k, v)[:, start:]), (k, v)

    def out(self, z: torch.Tensor) -> torch.Tensor:
        return self.w_o(z.flatten(2))

    @property
    def W_O(self) -> torch.Tensor:
        """[H, hd, d] output projection per head, as TransformerLens reads it: out(z) = Σ_h z_h @ W_O[h] (+ b_O)."""
        return self.w_o.weight.T.reshape(self.n_heads, self.head_dim, -1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.out(self.attend(*self.qkv(x, cos, sin)))


class SwiGLU(nn.Module):
    """The MLP: w2(silu(w1 x) · w3 x) by default; hook_post is the hidden activation [B,T,d_ff].

    The Pre-LN options make it GeGLU (`mlp_act`), a plain w2(act(w1 x)) (`mlp` "plain": no w3) and give
    it biases (`mlp_bias`)."""

    def __init__(self, cfg: ModelConfig, d_ff: int | None = None):
        super().__init__()
        bb, d_ff = backbone(cfg), d_ff or cfg.d_ff  # d_ff: a mixture-of-experts expert's own width
        self.gated, self.act = bb.mlp == "gated", activation(bb.mlp_act)
        self.w1 = nn.Linear(cfg.d_model, d_ff, bias=bb.mlp_bias)
        if self.gated:
            self.w3 = nn.Linear(cfg.d_model, d_ff, bias=bb.mlp_bias)
        self.w2 = nn.Linear(d_ff, cfg.d_model, bias=bb.mlp_bias)
        self.hook_post = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.w1(x))
        if self.gated:
            hidden = hidden * self.w3(x)
        return self.w2(self.hook_post(hidden))

    @property
    def W_out(self) -> torch.Tensor:
        """[d_ff, d] output projection, as TransformerLens reads it: forward = hook_post @ W_out (+ b_out)."""
        return self.w2.weight.T
