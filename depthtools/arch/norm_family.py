"""The normalisation family: one additive residual with per-sublayer settings.

Every member (Pre-LN, Post-LN, Peri-LN, LNS, DeepNorm, KEEL, Mix-LN, ReZero, LayerScale,
depth-μP, CompleteP) is the same sublayer update with different switches:

    x = h
    if pre_norm:  x = NormIn(x)
    x = input_scale · x                       (LNS: 1/sqrt(b+1))
    y = f(x)                                  (attention or SwiGLU)
    if out_norm:  y = NormOut(y)              (Peri-LN)
    y = gain ⊙ y · branch_mult               (ReZero scalar, LayerScale vector, depth-μP constant)
    h = alpha · h + y                         (DeepNorm (2L)^¼, KEEL 2L)
    if post_norm: h = NormPost(h)             (Post-LN, DeepNorm, KEEL, Mix-LN prefix)

Equations and constants: docs/reference/architectures.md §2. The state is the plain residual
stream [B,T,d]; z_l = block output (already normalised for post-norm placements); skip = identity.

Swap semantics: parameters (norm gains, ReZero/LayerScale gains, LNS's 1/sqrt(b+1) from the
block's own index) travel with the block; structure (Mix-LN's post/pre placement, KEEL's block-0
special case, DeepNorm/KEEL alpha) is tied to the position. A norm the running block lacks is
taken from the position's own block (DepthBench leaves mismatched tensors in place).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from depthtools.arch.backbone import OPTIONS as BACKBONE_OPTIONS, backbone
from depthtools.arch.layers import make_norm
from depthtools.arch.scheme import ArchSpec, NormSite, Option, ResidualScheme, profile_defaults
from depthtools.errors import DepthToolsError

if TYPE_CHECKING:  # annotations only (depthtools.config imports nothing from arch/: no circle either way)
    from depthtools.config import ModelConfig

SUBLAYERS = ("attn", "mlp")


@dataclass(frozen=True)
class SublayerSpec:
    """Switches for one sublayer update (see the module docstring)."""

    pre_norm: bool = True
    out_norm: bool = False
    post_norm: bool = False
    alpha: float = 1.0
    branch_mult: float = 1.0
    gain: str | None = None  # None | "scalar" (ReZero) | "vector" (LayerScale)
    gain_init: float = 1.0
    lns_scale: bool = False  # multiply the normalised input by 1/sqrt(block_index + 1)


def deepnorm_constants(n_layer: int) -> tuple[float, float]:
    """DeepNet decoder-only constants: alpha = (2L)^(1/4), init beta = (8L)^(-1/4)."""
    return (2 * n_layer) ** 0.25, (8 * n_layer) ** -0.25


def layerscale_init(n_layer: int) -> float:
    """CaiT's LayerScale epsilon by depth: 0.1 (<=18), 1e-5 (<=24), 1e-6 beyond."""
    return 0.1 if n_layer <= 18 else 1e-5 if n_layer <= 24 else 1e-6


def mixln_post_blocks(n_layer: int, fraction: float = 0.25) -> int:
    """Number of leading Post-LN blocks in Mix-LN: floor(fraction · L)."""
    return int(math.floor(fraction * n_layer + 1e-9))


def depth_multiplier(n_layer: int, exponent: float, base_layers: int = 24) -> float:
    """depth-μP / CompleteP branch multiplier (L / L_base)^(-a)."""
    return (n_layer / base_layers) ** (-exponent)


# DeepNorm's option `norm` -> backbone.Norm kind of its blocks' norms. "layernorm" is DepthBench's choice
# (`examples/pretrain_deepnorm.py` sets the blocks' `layer_norm.name = LayerNormType.default` of `llama_like`'s
# `bias=False` config): the two post-norms of every block become LayerNorm without bias, eps `norm_eps`; the
# final norm stays RMSNorm (DepthBench's LM head has its own norm config, which the launcher leaves as RMSNorm).
DEEPNORM_NORMS = {"rmsnorm": "rms", "layernorm": "layer"}


@dataclass(frozen=True)
class Recipe:
    """What makes one normalisation-family architecture: data, read by `sublayer_specs` (no test of its name).

    block:       the switches of every block's two sublayers;
    first_block: (attention, MLP) switches of block 0 instead, or None (KEEL: plain Pre-LN attention, Post-LN MLP
                 without alpha);
    prefix:      the switches of the leading floor(post_fraction·L) blocks (option `post_fraction`), or None (Mix-LN);
    deepnorm:    alpha = (2L)^¼ and init beta = (8L)^-¼ on w1/w2/w3/w_v/w_o (DeepNorm).
    Options, where the architecture declares them, set the rest: `keel_alpha` (alpha), `layerscale_init` (gain
    init), `depth_exponent`/`base_layers` (branch multiplier), the backbone's `pre_norm`/`out_norm` (Pre-LN).
    """

    block: SublayerSpec = SublayerSpec()
    first_block: tuple[SublayerSpec, SublayerSpec] | None = None
    prefix: SublayerSpec | None = None
    deepnorm: bool = False


_POST = SublayerSpec(pre_norm=False, post_norm=True)
RECIPES = {
    "preln": Recipe(),
    "postln": Recipe(_POST),
    "periln": Recipe(SublayerSpec(out_norm=True)),
    "lns": Recipe(SublayerSpec(lns_scale=True)),
    "deepnorm": Recipe(_POST, deepnorm=True),
    "keel": Recipe(SublayerSpec(post_norm=True), first_block=(SublayerSpec(), SublayerSpec(post_norm=True))),
    "mixln": Recipe(SublayerSpec(), prefix=_POST),
    "rezero": Recipe(SublayerSpec(pre_norm=False, gain="scalar", gain_init=0.0)),
    "layerscale": Recipe(SublayerSpec(gain="vector")),
    "depthmup": Recipe(),
    "completep": Recipe(),
}


def recipe(cfg: ModelConfig) -> Recipe:
    if cfg.arch not in RECIPES:
        raise DepthToolsError(f"{cfg.arch!r} is not a normalisation-family architecture; valid: {', '.join(RECIPES)}")
    return RECIPES[cfg.arch]


def sublayer_specs(cfg: ModelConfig, position: int) -> tuple[SublayerSpec, SublayerSpec]:
    """(attention, MLP) specs of the block at `position`: the architecture's `Recipe` and its options."""
    rec, L = recipe(cfg), cfg.n_layer
    opts = NormFamilyScheme.options_for(cfg).as_dict()
    if rec.first_block is not None and position == 0:
        return rec.first_block
    spec = rec.block
    if rec.prefix is not None and position < mixln_post_blocks(L, float(opts["post_fraction"])):
        spec = rec.prefix
    changes = {}
    if "pre_norm" in opts:  # the configurable Pre-LN block (backbone.py): OLMo-2 has no pre-norm, Gemma-2/3 and
        bb = backbone(cfg)  # OLMo-2 norm each sublayer's output
        changes.update(pre_norm=bb.pre_norm, out_norm=bb.out_norm)
    if rec.deepnorm:
        changes["alpha"] = deepnorm_constants(L)[0]
    if "keel_alpha" in opts:
        changes["alpha"] = float(opts["keel_alpha"])
    if "layerscale_init" in opts:
        changes["gain_init"] = float(opts["layerscale_init"])
    if "depth_exponent" in opts:
        changes["branch_mult"] = depth_multiplier(L, float(opts["depth_exponent"]), int(opts["base_layers"]))
    spec = replace(spec, **changes) if changes else spec
    return spec, spec


_DEPTH_SCALED = {"depthmup": 0.5, "completep": 1.0}  # default exponent a of (L/L_base)^-a
_OPTIONS = {  # read by sublayer_specs
    "preln": BACKBONE_OPTIONS,  # the pretrained families' block options (depthtools.arch.backbone)
    "deepnorm": {"norm": Option("str", "rmsnorm", choices=tuple(DEEPNORM_NORMS),
                                doc="the post-norms: RMSNorm, or LayerNorm without bias (DepthBench)")},
    "keel": {"keel_alpha": Option("number", lambda c: 2 * c.n_layer, doc="residual weight alpha (default 2L)")},
    "mixln": {"post_fraction": Option("number", 0.25, low=0, high=1, doc="share of leading Post-LN blocks")},
    "layerscale": {"layerscale_init": Option("number", lambda c: layerscale_init(c.n_layer), doc="initial λ")},
    **{arch: {"depth_exponent": Option("number", a, doc="a in (L/L_base)^-a"),
              "base_layers": Option("int", 24, low=1, doc="L_base")} for arch, a in _DEPTH_SCALED.items()},
}


class NormFamilyScheme(ResidualScheme):
    """One additive residual stream; per-sublayer switches from `sublayer_specs`."""

    single_stream = True
    compile_region = "step"
    depthbench_family = "residual"  # DepthBench's residual family: the state is z_l, a skip is the identity

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        # (attention, MLP) switches per position, worked out once (a step reads them on every forward)
        self.specs = tuple(sublayer_specs(cfg, p) for p in range(cfg.n_layer))

    def compile_key(self, position: int):
        """Blocks with the same sublayer switches compute the same step (LNS' scale reads the index)."""
        specs, bb = self.specs[position], backbone(self.cfg)
        return specs, position if any(spec.lns_scale for spec in specs) else None, bb.window(position)

    @classmethod
    def option_schema(cls, arch: str) -> dict[str, Option]:
        return _OPTIONS.get(arch, {})

    def build_block(self, block: nn.Module) -> None:
        d = self.cfg.d_model
        kind = DEEPNORM_NORMS.get(getattr(self.opts, "norm", None))  # DeepNorm's option; others: the backbone's
        for name, spec in zip(SUBLAYERS, self.specs[block.index]):
            if spec.pre_norm:
                setattr(block, f"{name}_norm", make_norm(self.cfg, kind=kind))
            if spec.out_norm:
                setattr(block, f"{name}_out_norm", make_norm(self.cfg, kind=kind))
            if spec.post_norm:
                setattr(block, f"{name}_post_norm", make_norm(self.cfg, kind=kind))
            if spec.gain is not None:
                shape = (1,) if spec.gain == "scalar" else (d,)
                setattr(block, f"{name}_gain", nn.Parameter(torch.full(shape, spec.gain_init)))

    def init_weights(self, model: nn.Module) -> None:
        """DeepNorm (`Recipe.deepnorm`): scale SwiGLU w1/w2/w3 and attention v/o by beta = (8L)^(-1/4)."""
        if not recipe(self.cfg).deepnorm:
            return
        beta = deepnorm_constants(self.cfg.n_layer)[1]
        with torch.no_grad():
            for block in model.blocks:
                for weight in (block.mlp.w1, block.mlp.w2, block.mlp.w3, block.attn.w_v, block.attn.w_o):
                    weight.weight.mul_(beta)

    def no_decay_names(self) -> tuple[str, ...]:
        return ("_gain",)

    def step(self, position, block, state, home, rope):
        attn_spec, mlp_spec = self.specs[position]
        h = block.hook_resid_pre(state)
        attn = lambda x: block.attn(x, *rope)  # noqa: E731
        if self.parallel:  # GPT-NeoX: h + (attn(N1 h) + mlp(N2 h)); resid_mid = h + attn (the MLP reads h)
            a = self._branch(h, "attn", attn, attn_spec, block, home)
            block.hook_resid_mid(h + a)
            return block.hook_resid_post(h + (a + self._branch(h, "mlp", block.mlp, mlp_spec, block, home)))
        h = block.hook_resid_mid(self._sublayer(h, "attn", attn, attn_spec, block, home))
        h = self._sublayer(h, "mlp", block.mlp, mlp_spec, block, home)
        return block.hook_resid_post(h)

    def step_suffix(self, position, block, rows, home, rope, start: int, past):
        """`step` on the rows at positions start..T-1 only: rows [B,T-start,d] of the block's input stream,
        `past` the (k, v) of rows 0..start-1 at this block (None at start 0; from an earlier call's return);
        returns (the block's output rows [B,T-start,d], (k, v) of rows 0..T-1).

        The contract of a scheme's suffix step (`analysis.causal.suffix_support` looks for this method; a
        scheme without it runs whole sequences): the result equals rows start.. of `step` on any stream whose
        rows before `start` have keys and values `past`, and `geometry` is per row. Exact here because every
        part of the family's step but attention is per token (norms, the LNS scale, gains, output norms, alpha,
        post-norms, the parallel residual, the MLP or mixture of experts), and `Attention.attend_rows` gives
        each row what attention gives it in the whole sequence. Hook points are passed over (identity when
        unhooked; the caller refuses hooked models)."""
        attn_spec, mlp_spec = self.specs[position]
        caches = []

        def attn(x):
            y, kv = block.attn.attend_rows(x, start, past, *rope)
            caches.append(kv)
            return y

        h = rows
        if self.parallel:
            a = self._branch(h, "attn", attn, attn_spec, block, home)
            return h + (a + self._branch(h, "mlp", block.mlp, mlp_spec, block, home)), caches[0]
        h = self._sublayer(h, "attn", attn, attn_spec, block, home)
        return self._sublayer(h, "mlp", block.mlp, mlp_spec, block, home), caches[0]

    @property
    def parallel(self) -> bool:
        """Attention and MLP both read the block's input (the Pre-LN option `parallel`)."""
        return backbone(self.cfg).parallel

    def _sublayer(self, h, name, fn, spec: SublayerSpec, block, home) -> torch.Tensor:
        y = self._branch(h, name, fn, spec, block, home)
        h = h + y if spec.alpha == 1.0 else spec.alpha * h + y
        if spec.post_norm:
            h = self._part(block, home, f"{name}_post_norm")(h)
        return h

    def _branch(self, h, name, fn, spec: SublayerSpec, block, home) -> torch.Tensor:
        """The sublayer's hooked output y (what is added to the stream)."""
        x = self._part(block, home, f"{name}_norm")(h) if spec.pre_norm else h
        if spec.lns_scale:
            x = x * (1.0 / math.sqrt(block.index + 1))
        y = fn(x)
        if spec.out_norm:
            y = self._part(block, home, f"{name}_out_norm")(y)
        if spec.gain is not None:
            y = y * self._part(block, home, f"{name}_gain")
        if spec.branch_mult != 1.0:
            y = y * spec.branch_mult
        return getattr(block, f"hook_{name}_out")(y)

    # -- TransformerLens' cache functions ------------------------------------------------------
    def tl_limits(self) -> dict[str, str]:
        """The stream is always the depth state; it is a plain sum of the sublayer outputs unless a
        sublayer rescales (alpha) or renormalises (post-norm) it; an output norm makes the branch
        output nonlinear in its heads / neurons."""
        arch, limits = backbone(self.cfg).name(self.cfg.arch), {}
        specs = [(p, name, spec) for p in range(self.cfg.n_layer)
                 for name, spec in zip(SUBLAYERS, self.specs[p])]
        for p, name, spec in specs:
            if spec.post_norm or spec.alpha != 1.0:
                how = ("renormalises the stream after the residual add (post-norm)" if spec.post_norm
                       else f"scales the stream by alpha = {spec.alpha:g} before adding")
                limits["sum"] = (f"{arch} is not an additive residual stream: block {p}'s {name} sublayer {how}, "
                                 "so the stream is not hook_embed + the sum of hook_attn_out/hook_mlp_out; "
                                 "use depthtools.analysis.contrib for its per-block decomposition")
                break
        if backbone(self.cfg).moe_experts:
            limits["neurons"] = (f"{arch} routes each token through its top-k experts, so hook_mlp_out is not one "
                                 "linear map of one hook_post; use depthtools.analysis.contrib for per-block "
                                 "contributions")
        if any(spec.out_norm for _, _, spec in specs):
            why = (f"{arch} normalises each sublayer's output (output norm) before adding it, so hook_{{}}_out "
                   "is not linear in the {}; use depthtools.analysis.contrib for per-block contributions")
            limits["heads"], limits["neurons"] = why.format("attn", "per-head results"), why.format("mlp", "neurons")
        cap = backbone(self.cfg).final_softcap
        if cap:
            limits["linear_head"] = (f"{arch} soft-caps its logits ({cap:g}·tanh(z/{cap:g})), so they are not the "
                                     "normed stream @ W_U + b_U; use depthtools.analysis.lens (model.head applies the cap)")
        return limits

    def tl_norm_site(self, block, sublayer: str):
        spec = self.specs[block.index][SUBLAYERS.index(sublayer)]
        if not spec.pre_norm:
            return (f"{backbone(self.cfg).name(self.cfg.arch)} block {block.index}'s {sublayer} sublayer reads "
                    "the stream without a pre-norm, so there is no norm scale to apply at its input")
        mid = sublayer == "mlp" and not self.parallel  # a parallel block's MLP reads the block input
        hook = f"blocks.{block.index}.hook_resid_{'mid' if mid else 'pre'}"
        return NormSite(hook, getattr(block, f"{sublayer}_norm"),
                        1.0 / math.sqrt(block.index + 1) if spec.lns_scale else 1.0)

    def tl_branch_scale(self, block, sublayer: str):
        spec = self.specs[block.index][SUBLAYERS.index(sublayer)]
        scale = spec.branch_mult
        return scale if spec.gain is None else getattr(block, f"{sublayer}_gain") * scale

    @staticmethod
    def _part(block, home, name: str):
        """The running block's module/parameter `name`, or the position's own if it lacks one."""
        part = getattr(block, name, None)
        return part if part is not None else getattr(home, name)


def _rows():
    zero = lambda c: 0  # noqa: E731
    return [  # name, family, description, extra-parameter formula and function, paper, in DepthBench, aliases
        ("preln", "baseline", "Pre-LN: h + f(Norm h)", "0", zero,
         "Xiong et al. 2020, arXiv 2002.04745", True, ()),
        ("postln", "normalisation", "Post-LN: Norm(h + f(h))", "0", zero,
         "Vaswani et al. 2017, arXiv 1706.03762", False, ()),
        ("periln", "normalisation", "Peri-LN / Sandwich: h + NormOut(f(NormIn h))", "2·d·L",
         lambda c: 2 * c.d_model * c.n_layer, "Kim et al. 2025, arXiv 2502.02732", True, ("sandwich",)),
        ("lns", "normalisation", "LayerNorm Scaling: h + f(Norm(h)/sqrt(b+1))", "0", zero,
         "Sun et al. 2025, arXiv 2502.05795", True, ()),
        ("deepnorm", "normalisation", "DeepNorm: Norm(a·h + f(h)), a=(2L)^1/4, init beta=(8L)^-1/4", "0", zero,
         "Wang et al. 2022, arXiv 2203.00555", True, ()),
        ("keel", "normalisation", "KEEL: Norm(2L·h + f(Norm h)), block 0 special", "(2L-1)·d",
         lambda c: (2 * c.n_layer - 1) * c.d_model, "Chen & Wei 2026, arXiv 2601.19895", True, ()),
        ("mixln", "normalisation", "Mix-LN: first floor(L/4) blocks Post-LN, rest Pre-LN", "0", zero,
         "Li et al. 2024, arXiv 2412.13795", False, ()),
        ("rezero", "normalisation", "ReZero: h + a·f(h), a=0 init, no block norms", "2·L − 2·d·L",
         lambda c: 2 * c.n_layer - 2 * c.d_model * c.n_layer, "Bachlechner et al. 2020, arXiv 2003.04887",
         False, ()),
        ("layerscale", "normalisation", "LayerScale: h + diag(λ)·f(Norm h), λ=ε init", "2·d·L",
         lambda c: 2 * c.d_model * c.n_layer, "Touvron et al. 2021 (CaiT), arXiv 2103.17239", False, ()),
        ("depthmup", "normalisation", "depth-μP: h + (L/24)^-½·f(Norm h)", "0", zero,
         "Yang et al. 2023, arXiv 2310.02244", False, ()),
        ("completep", "normalisation", "CompleteP: h + (L/24)^-1·f(Norm h)", "0", zero,
         "Dey et al. 2025, arXiv 2505.01618", False, ()),
    ]


# The `depthbench` recipe profile (depthtools.profiles): DeepNorm's post-norms as LayerNorm without bias
# (`examples/pretrain_deepnorm.py` renames the blocks' norm config to `LayerNormType.default`, bias=False)
_PROFILES = {"deepnorm": {"depthbench": profile_defaults({"norm": "layernorm"})}}

ARCH_SPECS = [ArchSpec(name, family, desc, formula, extra, paper, NormFamilyScheme, in_db, aliases,
                       reference=family == "baseline",  # preln: what extra parameters are counted against
                       backbone_options=_OPTIONS.get(name) is BACKBONE_OPTIONS,  # preln: the pretrained families'
                       profiles=_PROFILES.get(name, {}))
              for name, family, desc, formula, extra, paper, in_db, aliases in _rows()]
