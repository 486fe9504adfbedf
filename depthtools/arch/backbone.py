"""The Pre-LN block's typed options: one configurable decoder block for the pretrained families.

`preln` is the Llama block (RMSNorm, RoPE, bias-free grouped-query attention, SwiGLU). The options
below are ordinary `ModelConfig.options` of `preln` (validated by the registry like every scheme
option; usable when training too) and express the open decoder families depthtools imports
(`depthtools.interop.families`): biases, QK-norm, LayerNorm and Gemma's (1+w) RMSNorm, √d embedding
scale, sublayer output norms, GELU/GeGLU/plain MLPs, a parallel residual, partial rotary, learned
absolute positions, soft-capping, per-layer sliding windows and RoPE bases, a query scale.

Every default is the Llama block, so a config without these keys builds exactly the model it built
before (same modules, same parameter names, same initialisation order, same arithmetic). Every other
architecture reads `Backbone()` (the defaults): they do not accept these options.

One definition: `OPTIONS` (the rope_* records come from `depthtools.arch.rope.ROPE_OPTIONS`) is the schema the
registry validates against, and the typed `Backbone` record is generated from it (`scheme.schema_record`: one
field per option, its kind's type, its default), as is `RopeScaling`; `DEFAULTS` is every option at its default.

Option semantics (h: the residual stream, x: a sublayer input; equations in docs/pretrained.md):

    head_dim          per-head width (0: d_model / n_heads)
    qkv_bias          biases on the q/k/v projections        attn_out_bias  bias on the output projection
    qkv_clip          clamp q, k, v to [-c, c] after projection (OLMo's clip_qkv; 0: off)
    clip_after_norm   clamp after the QK-norm instead of before it (OLMoE)
    qk_norm           "none" | "head" (a norm over each head's hd features) | "full" (over the whole
                      projection, OLMo-2); the block's norm kind, before RoPE
    attn_scale        score scale (0: head_dim^-1/2; Gemma-2/3: query_pre_attn_scalar^-1/2)
    attn_softcap      scores -> c·tanh(scores/c) before the mask (0: off)
    sliding_window    W: a sliding layer's query q attends to keys q-W < k <= q (0: none)
    layer_types       one character per layer, "s" sliding / "f" full ("": all "s" when a window is set)
    rope_theta_sliding  RoPE base of sliding layers (0: rope_theta)
    rotary_fraction   share of each head's features rotated (NeoX rotary_pct), the rest pass through
    rope_type         "default" | "linear" | "dynamic" | "yarn" | "longrope" | "llama3": scaled RoPE
                      (`depthtools.arch.rope`), with rope_factor, rope_original_context (the pretraining
                      context L; dynamic: max_position_embeddings), rope_low/high_freq_factor (llama3),
                      rope_beta_fast/slow and rope_truncate (yarn), rope_attention_factor (yarn, longrope;
                      0: the type's default), rope_short/long_factor (longrope: one per rotated pair).
                      Layers with their own base (rope_theta_sliding, Gemma-3's local layers) stay plain.
    positions         "rope" | "learned" (absolute position embeddings added to the token embedding)
    norm              "rms" | "layer"      norm_gain "weight" | "one_plus" (x̂·(1+w), Gemma) | "none"
    norm_bias         LayerNorm bias
    pre_norm          norm the sublayer input (False: OLMo-2, which norms the output instead)
    out_norm          norm each sublayer's output before the residual add (Gemma-2/3 sandwich, OLMo-2)
    parallel          h + attn(N1 h) + mlp(N2 h) (GPT-NeoX / Pythia use_parallel_residual)
    mlp               "gated" (w2(act(w1 x)·w3 x): SwiGLU, GeGLU) | "plain" (w2 act(w1 x))
    mlp_act           "silu" | "gelu" (exact) | "gelu_tanh" | "relu"      mlp_bias  biases on w1, w3, w2
    embed_scale       the token embedding times this (Gemma: √d_model)
    final_softcap     logits -> c·tanh(logits/c) (Gemma-2; 0: off)
    head_bias         a bias on the unembedding (Phi-1/1.5/2's lm_head)
    moe_experts       E > 0: the MLP is a mixture of E experts (`depthtools.arch.moe`): a float32 softmax
                      router, the top moe_top_k experts weighted by their probabilities (renormalised to sum
                      1 when moe_norm_topk), each a (gated) MLP of width moe_ff (0: d_ff); moe_shared_ff > 0
                      adds a shared expert (sigmoid-gated when moe_shared_gate, Qwen2-MoE); moe_layers: one
                      character per layer, "m" MoE / "d" dense MLP of width d_ff ("": every layer MoE)
    family            the pretrained family a config reproduces ("" for our own models); informational,
                      named in refusals
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch.rope import NEEDS_CONTEXT, ROPE_OPTIONS, RopeScaling
from depthtools.arch.scheme import Option, schema_record
from depthtools.arch.torch_private import is_hooked
from depthtools.errors import DepthToolsError

BACKBONE_ARCHS = ("preln",)  # the architectures that accept these options

NORMS = ("rms", "layer")
NORM_GAINS = ("weight", "one_plus", "none")
QK_NORMS = ("none", "head", "full")
MLPS = ("gated", "plain")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
POSITIONS = ("rope", "learned")

FAMILIES = ("", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "gpt2",
            "gpt_neox", "phi3", "phi", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # interop.families ("": none)

OPTIONS: dict[str, Option] = {
    "family": Option("str", "", choices=FAMILIES, doc="pretrained family this config reproduces (informational)"),
    "head_dim": Option("int", 0, low=0, doc="per-head width (0: d_model / n_heads)"),
    "qkv_bias": Option("bool", False, doc="biases on the q/k/v projections"),
    "attn_out_bias": Option("bool", False, doc="bias on the attention output projection"),
    "qkv_clip": Option("number", 0.0, low=0, doc="clamp q, k, v to [-c, c] (0: off)"),
    "clip_after_norm": Option("bool", False, doc="clamp q, k after the QK-norm (OLMoE) rather than before"),
    "qk_norm": Option("str", "none", choices=QK_NORMS, doc="norm on queries and keys before RoPE"),
    "attn_scale": Option("number", 0.0, low=0, doc="attention score scale (0: head_dim^-1/2)"),
    "attn_softcap": Option("number", 0.0, low=0, doc="attention score soft-cap c·tanh(s/c) (0: off)"),
    "sliding_window": Option("int", 0, low=0, doc="sliding layers attend to the last W positions (0: none)"),
    "layer_types": Option("str", "", doc="per layer 's' (sliding) or 'f' (full); '': all 's' if a window is set"),
    "rope_theta_sliding": Option("number", 0.0, low=0, doc="RoPE base of sliding layers (0: rope_theta)"),
    "rotary_fraction": Option("number", 1.0, low=0, high=1, low_open=True, doc="share of head features rotated"),
    **ROPE_OPTIONS,  # rope_type ... rope_long_factor: their records live with RopeScaling (depthtools.arch.rope)
    "positions": Option("str", "rope", choices=POSITIONS, doc="rotary or learned absolute positions"),
    "norm": Option("str", "rms", choices=NORMS, doc="RMSNorm or LayerNorm"),
    "norm_gain": Option("str", "weight", choices=NORM_GAINS, doc="norm gain: w, (1+w) or none"),
    "norm_bias": Option("bool", False, doc="LayerNorm bias"),
    "pre_norm": Option("bool", True, doc="norm each sublayer's input"),
    "out_norm": Option("bool", False, doc="norm each sublayer's output before the residual add"),
    "parallel": Option("bool", False, doc="parallel attention + MLP residual"),
    "mlp": Option("str", "gated", choices=MLPS, doc="gated (SwiGLU/GeGLU) or plain MLP"),
    "mlp_act": Option("str", "silu", choices=ACTIVATIONS, doc="MLP activation"),
    "mlp_bias": Option("bool", False, doc="biases on the MLP projections"),
    "embed_scale": Option("number", 1.0, low=0, low_open=True, doc="token embedding multiplier"),
    "final_softcap": Option("number", 0.0, low=0, doc="final logit soft-cap c·tanh(z/c) (0: off)"),
    "head_bias": Option("bool", False, doc="bias on the unembedding (Phi)"),
    "moe_experts": Option("int", 0, low=0, doc="mixture-of-experts MLP with this many experts (0: dense)"),
    "moe_top_k": Option("int", 1, low=1, doc="experts each token is routed to"),
    "moe_ff": Option("int", 0, low=0, doc="each expert's hidden width (0: d_ff)"),
    "moe_norm_topk": Option("bool", True, doc="renormalise the top-k routing weights to sum 1"),
    "moe_shared_ff": Option("int", 0, low=0, doc="a shared expert of this width (0: none)"),
    "moe_shared_gate": Option("bool", True, doc="gate the shared expert by sigmoid(g·x)"),
    "moe_layers": Option("str", "", doc="per layer 'm' (MoE) or 'd' (dense MLP); '': every layer MoE"),
}


class _BackboneRules:
    """Backbone's methods: what the options mean for one block (its fields are generated from OPTIONS)."""

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer`'s MLP is the mixture of experts."""
        return bool(self.moe_experts) and (not self.moe_layers or self.moe_layers[layer] == "m")

    @property
    def default_norm(self) -> bool:
        """The plain RMSNorm with a gain (every scheme's own norm)."""
        return self.norm == "rms" and self.norm_gain == "weight" and not self.norm_bias

    def name(self, arch: str) -> str:
        """`arch`, with the family in brackets when the config reproduces one (for messages)."""
        return f"{arch} ({self.family})" if self.family else arch

    def is_sliding(self, layer: int) -> bool:
        """Whether block `layer` attends through the sliding window."""
        if not self.sliding_window:
            return False
        return not self.layer_types or self.layer_types[layer] == "s"

    def window(self, layer: int) -> int:
        """Block `layer`'s window (0: full causal attention)."""
        return self.sliding_window if self.is_sliding(layer) else 0

    @property
    def rope(self) -> RopeScaling:
        """The model's RoPE type and parameters (`depthtools.arch.rope`)."""
        return RopeScaling.from_options(self)

    def own_rope_base(self, layer: int, theta: float) -> bool:
        """Whether block `layer` rotates with its own plain RoPE of base rope_theta_sliding (a sliding layer
        of Gemma-3) rather than the model's tables."""
        return bool(self.window(layer) and self.rope_theta_sliding
                    and (self.rope_theta_sliding != theta or self.rope_type != "default"))


# The typed options ARE the schema: one field per Option, in its order, with its kind and default (one definition).
Backbone = schema_record("Backbone", OPTIONS, _BackboneRules,
                         doc="The resolved Pre-LN options (see the module docstring); defaults = the Llama block.")
DEFAULTS = Backbone()  # every option at its default (the Llama block); `interop.families` reads its defaults here


def backbone(cfg) -> Backbone:
    """The Backbone of a ModelConfig: its options for the architectures that take them, else the defaults."""
    if cfg.arch not in BACKBONE_ARCHS:
        return Backbone()
    return Backbone(**{k: cfg.options[k] for k in OPTIONS if k in cfg.options})


def check_heads(cfg) -> None:
    """The head shape every architecture needs (one line each): d_model splits into n_heads unless the
    head_dim option sets the width, and RoPE rotates pairs, so a rotary head_dim is even. Runs before the
    options are validated (a bad value here is read as unset; the option check names it next)."""
    if cfg.d_model % cfg.n_heads and not cfg.options.get("head_dim"):
        raise DepthToolsError(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
    if cfg.head_dim % 2 and cfg.options.get("positions", OPTIONS["positions"].default) == "rope":
        raise DepthToolsError(f"head_dim=d_model/n_heads={cfg.head_dim} must be even for RoPE")


def check_backbone(cfg) -> None:
    """Cross-option checks the per-option schema cannot make (one line each)."""
    bb = backbone(cfg)
    name = bb.name(cfg.arch)
    if bb.layer_types:
        if len(bb.layer_types) != cfg.n_layer or set(bb.layer_types) - {"s", "f"}:
            raise DepthToolsError(f"{name} option layer_types must be {cfg.n_layer} characters 's' or 'f' "
                                  f"(one per layer), got {bb.layer_types!r}")
        if not bb.sliding_window and "s" in bb.layer_types:
            raise DepthToolsError(f"{name} option layer_types marks sliding layers but sliding_window is 0")
    if bb.norm == "rms" and bb.norm_bias:
        raise DepthToolsError(f"{name} option norm_bias needs norm 'layer' (an RMSNorm has no bias)")
    if bb.norm_gain == "none" and bb.norm_bias:
        raise DepthToolsError(f"{name}: norm_bias without a gain is not a supported norm; use norm_gain 'weight'")
    if not bb.pre_norm and bb.parallel:
        raise DepthToolsError(f"{name}: a parallel residual needs pre_norm (both sublayers read a normed stream)")
    rot = rotary_dim(cfg)
    if bb.positions == "rope" and (rot < 2 or rot % 2):
        raise DepthToolsError(f"{name}: rotary_fraction {bb.rotary_fraction:g} of head_dim {cfg.head_dim} gives "
                              f"{rot} rotated features; it must be a positive even number")
    _check_rope(bb, name, rot)
    _check_moe(bb, name, cfg.n_layer)


def _check_moe(bb: Backbone, name: str, n_layer: int) -> None:
    """The mixture-of-experts options agree with each other and the depth (one line each)."""
    if bb.moe_layers and (len(bb.moe_layers) != n_layer or set(bb.moe_layers) - {"m", "d"}):
        raise DepthToolsError(f"{name} option moe_layers must be {n_layer} characters 'm' or 'd' (one per layer), "
                              f"got {bb.moe_layers!r}")
    if not bb.moe_experts:
        set_options = [k for k in ("moe_ff", "moe_shared_ff", "moe_layers") if getattr(bb, k)]
        if set_options or bb.moe_top_k != 1:
            raise DepthToolsError(f"{name} option {(set_options or ['moe_top_k'])[0]} needs moe_experts > 0")
        return
    if bb.moe_top_k > bb.moe_experts:
        raise DepthToolsError(f"{name} option moe_top_k {bb.moe_top_k} exceeds moe_experts {bb.moe_experts}")


def _check_rope(bb: Backbone, name: str, rot: int) -> None:
    """The scaled-RoPE options a type reads are present and consistent (one line each)."""
    kind = bb.rope_type
    if kind in NEEDS_CONTEXT and bb.rope_original_context < 1:
        raise DepthToolsError(f"{name}: rope_type {kind!r} needs rope_original_context (the pretraining context)")
    if kind == "dynamic" and rot <= 2:
        raise DepthToolsError(f"{name}: rope_type 'dynamic' needs more than 2 rotated features, got {rot}")
    if kind == "llama3" and bb.rope_high_freq_factor <= bb.rope_low_freq_factor:
        raise DepthToolsError(f"{name}: rope_high_freq_factor {bb.rope_high_freq_factor:g} must exceed "
                              f"rope_low_freq_factor {bb.rope_low_freq_factor:g}")
    if kind == "longrope":
        for key in ("rope_short_factor", "rope_long_factor"):
            if len(getattr(bb, key)) != rot // 2:
                raise DepthToolsError(f"{name}: {key} has {len(getattr(bb, key))} entries, the {rot} rotated "
                                      f"features need {rot // 2}")
    elif bb.rope_short_factor or bb.rope_long_factor:
        raise DepthToolsError(f"{name}: rope_short_factor / rope_long_factor are longrope options; rope_type is "
                              f"{kind!r}")


def rotary_dim(cfg) -> int:
    """Features of each head that RoPE rotates (the first ones; transformers' int(head_dim · fraction))."""
    return int(cfg.head_dim * backbone(cfg).rotary_fraction)


# -- norms -------------------------------------------------------------------------------------------
class Norm(nn.Module):
    """RMSNorm or LayerNorm with a gain w, (1+w) (Gemma) or none, and an optional LayerNorm bias.

    `gain` is the effective per-feature multiplier (None: none), which TransformerLens' cache functions
    fold (tl_cache.py). The plain RMSNorm with a gain is `layers.RMSNorm` (see `make_norm`)."""

    def __init__(self, dim: int, eps: float, kind: str = "rms", gain: str = "weight", bias: bool = False):
        super().__init__()
        self.dim, self.eps, self.kind, self.gain_kind = dim, eps, kind, gain
        init = 0.0 if gain == "one_plus" else 1.0
        self.weight = nn.Parameter(torch.full((dim,), init)) if gain != "none" else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @property
    def gain(self) -> torch.Tensor | None:
        if self.weight is None:
            return None
        return 1.0 + self.weight if self.gain_kind == "one_plus" else self.weight

    @property
    def centers(self) -> bool:
        return self.kind == "layer"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, (self.dim,), self.gain, self.bias, self.eps)
        return F.rms_norm(x, (self.dim,), self.gain, self.eps)


class HookedNorm(Norm):
    """`Norm` exposing TransformerLens' `hook_scale` and `hook_normalized` (for `ln_final`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hook_scale = HookPoint()  # [B,T,1]: rms, or the standard deviation for LayerNorm
        self.hook_normalized = HookPoint()  # [B,T,d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_hooked(self.hook_scale, self.hook_normalized):
            return super().forward(x)
        if self.kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        out = x / scale
        if self.weight is not None:
            out = out * self.gain
        if self.bias is not None:
            out = out + self.bias
        return self.hook_normalized(out)


def norm_gain(norm: nn.Module) -> torch.Tensor | None:
    """The effective per-feature gain of any of our norms (None: none)."""
    return norm.gain if isinstance(norm, Norm) else norm.weight


def norm_centers(norm: nn.Module) -> bool:
    """Whether the norm subtracts the mean first (LayerNorm)."""
    return isinstance(norm, Norm) and norm.centers


# -- activations -------------------------------------------------------------------------------------
def activation(name: str):
    """The MLP activation function by option name."""
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise DepthToolsError(f"unknown activation {name!r}; valid: {', '.join(ACTIVATIONS)}")


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(x / cap): Gemma-2's soft-capping (cap 0: x unchanged)."""
    return x if not cap else torch.tanh(x / cap) * cap


def banded_causal_mask(T: int, window: int, device) -> torch.Tensor:
    """[T,T] bool, True where query q may read key k: q - window < k <= q (transformers' sliding window)."""
    q = torch.arange(T, device=device)[:, None]
    k = torch.arange(T, device=device)[None, :]
    return (k <= q) & (k > q - window)
