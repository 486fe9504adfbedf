"""OLMo-core and DepthBench checkpoints -> depthtools: the config map and the parameter names, as data.

DepthBench (keyu-wang-2002/DepthBench) trains its ten architectures with a fork of OLMo-core. A saved step holds
`config.json`, whose `model` section is OLMo-core's `TransformerConfig` serialised (`Config.as_config_dict()`:
enums as strings, `_CLASS_` keys), and the model tensors under OLMo-core's module names. This module turns the two
into a depthtools `ModelConfig` and a state dict in our names:

    cfg, state, provenance = build_from_olmo_core(config, tensors, source)

* The config map reads `model.block.name` (the block type) and every option of the block, its attention, norms,
  feed-forward, LM head and (HC/mHC) `hyper_connections`. Each key is known: either it cannot change the function
  (dtype, init, backends, weight decay), or it is read into our options, or it must hold the one value whose
  function depthtools computes. Anything else -- an unknown block type, an unknown key, a value our model cannot
  compute exactly -- is one `DepthToolsError` line naming the config key (`model.block.name='x'`).
* The parameter names are tables (`TABLES`): our name -> `Src` (the fork's name, "{i}" the block, "{j}" = i + 1,
  and an invertible transform). The same tables give the inverse (`to_olmo_core`), so a test writes a state dict
  under DepthBench's names from our model and maps it back bit for bit. The names were read from the fork's
  `nn/transformer/block.py` (TransformerBlock, ReorderedNorm, PeriNorm, LayerNormScaled, DeepNorm, Keel, AttnRes,
  HyperConnections blocks), `nn/transformer/model.py` (`embeddings`, `res_proj`/`res_norm`), `nn/hyper_connections.py`
  (HyperConnection "hc"/"mhc", LigerHyperConnection) and `nn/lm_head.py` (`lm_head.norm`, `lm_head.w_out`).
* HC/mHC blocks register their norm and sublayer a second time inside the connector's `branch`, so a state dict
  holds those tensors under two names (`ALIASES`); both are read, and must be equal.
* Every tensor is accounted for: a missing or unexpected tensor, a shape the config does not imply, a non-float
  dtype or a NaN/inf entry is one line naming the OLMo-core tensor.

DepthBench's conventions followed (docs/olmo-core-mapping.md has the table per architecture): the HC / PyTorch-mHC
head normalises every stream with `lm_head.norm` and sums (`readout="normed_sum"`), Liger mHC averages the streams
and normalises (`readout="mean"`); connector norms without a gain at the fork's eps (1e-8; Liger `liger_rms_eps`);
PyTorch mHC's log-domain Sinkhorn rows-then-columns in its own orientation (H_res^T: our `rows_last` on the
transposed logits); Liger's rows-then-columns in the paper's orientation (`cols_last`); DeepNorm's post-norms a
LayerNorm without bias when `layer_norm.name` is "default"; every norm at the config's `layer_norm.eps`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from depthtools.arch import DepthModel
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

FORMAT = "olmo-core"
DEFAULT_RMS_EPS = 1e-5  # OLMo-core's RMSNorm/LayerNorm eps when a LayerNormConfig leaves `eps` unset
HC_CONNECTOR_EPS = 1e-8  # the fork's `_rms_norm` default, used by HyperConnection "hc" and "mhc"
DEFAULT_SEQ_LEN = 2048  # DepthBench's context when the config names none


# -- reading a config section: every key known ------------------------------------------------------------------
def refusal(key: str, value: Any, why: str) -> DepthToolsError:
    """The one-line refusal of an OLMo-core config value depthtools cannot compute exactly."""
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return DepthToolsError(f"unsupported OLMo-core config: {key}={shown} ({why})")


class Section:
    """One dict of the serialised config, read key by key; `done()` refuses every key nobody read.

    `path` names the section in messages ("model.block.sequence_mixer"). A key whose value is null counts as
    absent (OLMo-core serialises unset optionals as null or leaves them out)."""

    def __init__(self, obj: Any, path: str):
        if not isinstance(obj, dict):
            raise refusal(path, obj, "expected a JSON object")
        self.obj, self.path, self.read = obj, path, {"_CLASS_"}

    def key(self, name: str) -> str:
        return f"{self.path}.{name}"

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        value = self.obj.get(name)
        return default if value is None else value

    def number(self, name: str, default: Any = None, positive: bool = True, required: bool = False) -> Any:
        """A finite number (an integer where `default` is one); `positive`: > 0; `required`: absent is refused
        (`default` then only gives the kind)."""
        if required and self.obj.get(name) is None:
            raise refusal(self.key(name), None, "required")
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                positive and value <= 0) or (isinstance(default, int) and not isinstance(value, int)):
            kind = "a positive integer" if isinstance(default, int) else "a positive number"
            raise refusal(self.key(name), value, f"expected {kind}")
        return value

    def require(self, name: str, allowed: tuple, why: str) -> Any:
        """The value of `name` (null = absent = allowed[0]), refused unless it is one of `allowed`."""
        value = self.get(name, allowed[0])
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise refusal(self.key(name), value, why)
        return value

    def ignore(self, *names: str) -> None:
        """Keys that cannot change the function the weights compute (dtypes, init, backends, optimiser)."""
        self.read.update(names)

    def sub(self, name: str) -> Section | None:
        value = self.get(name)
        return None if value is None else Section(value, self.key(name))

    def done(self) -> None:
        unknown = sorted(set(self.obj) - self.read)
        if unknown:
            raise refusal(self.key(unknown[0]), self.obj[unknown[0]],
                          "not an option depthtools knows; it may change the model, so nothing is imported")


# -- the parameter names as data --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Src:
    """Where one of our tensors lives in an OLMo-core state dict: `name` ("{i}" = our index, "{j}" = i + 1) and
    `transform`: "" (as is), "flat" ([1, d] Linear weight <-> [d] query), "streams_t" (the mHC residual logits in
    the transposed orientation: [n, n] transposed, [k, n*n] columns permuted), or "liger:<part>" (one part of
    Liger's fused phi [k, n*n + 2n] / b [n*n + 2n] / alpha scalar: pre, post or res)."""

    name: str
    transform: str = ""


ATTN = {f"blocks.{{i}}.attn.w_{ours}.{kind}": Src(f"blocks.{{i}}.attention.w_{theirs}.{kind}")
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out")) for kind in ("weight", "bias")}
BACKBONE = {
    "tok_embed.weight": Src("embeddings.weight"),
    "unembed.weight": Src("lm_head.w_out.weight"),
    "ln_final.weight": Src("lm_head.norm.weight"),
    "ln_final.bias": Src("lm_head.norm.bias"),
    **ATTN,
    "blocks.{i}.attn.q_norm.weight": Src("blocks.{i}.attention.q_norm.weight"),
    "blocks.{i}.attn.k_norm.weight": Src("blocks.{i}.attention.k_norm.weight"),
    **{f"blocks.{{i}}.mlp.{w}.{kind}": Src(f"blocks.{{i}}.feed_forward.{w}.{kind}")
       for w in ("w1", "w2", "w3") for kind in ("weight", "bias")},
}


def _norms(**pairs: str) -> dict[str, Src]:
    """Our block norm (weight and bias) -> the fork's module: _norms(attn_norm="attention_norm")."""
    return {f"blocks.{{i}}.{ours}.{kind}": Src(f"blocks.{{i}}.{theirs}.{kind}")
            for ours, theirs in pairs.items() for kind in ("weight", "bias")}


PRE_NORMS = _norms(attn_norm="attention_norm", mlp_norm="feed_forward_norm")
HC_NAMES = ("static_alpha", "dynamic_alpha", "alpha_scale", "static_beta", "dynamic_beta", "beta_scale")
HC_FORK = ("static_alpha", "dynamic_alpha_proj", "dynamic_alpha_scale", "static_beta", "dynamic_beta_proj",
           "dynamic_beta_scale")
CONNECTORS = (("attn_hc", "attention_hyper_connection"), ("mlp_hc", "feed_forward_hyper_connection"))


def _connector(pairs: dict[str, Src]) -> dict[str, Src]:
    """Our attn_hc/mlp_hc parameter -> the fork's connector parameter, for both connectors of block i."""
    return {f"blocks.{{i}}.{ours_c}.{ours}": Src(f"blocks.{{i}}.{theirs_c}.{src.name}", src.transform)
            for ours_c, theirs_c in CONNECTORS for ours, src in pairs.items()}


MHC_TORCH = {"phi_pre": Src("pre_dynamic_proj"), "phi_post": Src("post_dynamic_proj"),
             "phi_res": Src("residual_dynamic_proj", "streams_t"), "gate_pre": Src("pre_gate"),
             "gate_post": Src("post_gate"), "gate_res": Src("residual_gate"), "bias_pre": Src("pre_bias"),
             "bias_post": Src("post_bias"), "bias_res": Src("residual_bias", "streams_t")}
MHC_LIGER = {"phi_pre": Src("phi", "liger:pre"), "phi_post": Src("phi", "liger:post"),
             "phi_res": Src("phi", "liger:res"), "bias_pre": Src("b", "liger:pre"), "bias_post": Src("b", "liger:post"),
             "bias_res": Src("b", "liger:res"), "gate_pre": Src("alpha_pre"), "gate_post": Src("alpha_post"),
             "gate_res": Src("alpha_res")}
ATTNRES = {
    "scheme.attn_res.{i}.query": Src("blocks.{j}.attn_res_proj.weight", "flat"),
    "scheme.attn_res.{i}.key_norm.weight": Src("blocks.{j}.attn_res_norm.weight"),
    "blocks.{i}.mlp_res.query": Src("blocks.{i}.mlp_res_proj.weight", "flat"),
    "blocks.{i}.mlp_res.key_norm.weight": Src("blocks.{i}.mlp_res_norm.weight"),
    "scheme.final_res.query": Src("res_proj.weight", "flat"),
    "scheme.final_res.key_norm.weight": Src("res_norm.weight"),
}



def _moda_names() -> dict[str, Src]:
    """MoDA blocks wrap the attention (`MoDAAttention.attention`) and the feed-forward
    (`MoDAFeedForwardDepthCache.feed_forward`, beside its depth `kv_proj`)."""
    wrapped = {}
    for ours, src in BACKBONE.items():
        name = src.name.replace("blocks.{i}.attention.", "blocks.{i}.attention.attention.")
        wrapped[ours] = Src(name.replace("blocks.{i}.feed_forward.", "blocks.{i}.feed_forward.feed_forward."))
    kv = {f"blocks.{{i}}.kv_proj.{kind}": Src(f"blocks.{{i}}.feed_forward.kv_proj.{kind}") for kind in ("weight", "bias")}
    return {**wrapped, **kv}


# layout -> our name template -> Src. A layout is a block type of the fork (and for mHC its backend).
TABLES: dict[str, dict[str, Src]] = {
    "default": {**BACKBONE, **PRE_NORMS},
    "reordered_norm": {**BACKBONE, **_norms(attn_out_norm="attention_norm", mlp_out_norm="feed_forward_norm")},
    "peri_norm": {**BACKBONE, **PRE_NORMS,
                  **_norms(attn_out_norm="post_attention_norm", mlp_out_norm="post_feed_forward_norm")},
    "default_scaled": {**BACKBONE, **PRE_NORMS},
    "depth_mup": {**BACKBONE, **PRE_NORMS},
    "completep": {**BACKBONE, **PRE_NORMS},
    "deepnorm": {**BACKBONE, **_norms(attn_post_norm="attention_norm", mlp_post_norm="feed_forward_norm")},
    "keel": {**BACKBONE, **PRE_NORMS,
             **_norms(attn_post_norm="post_attention_norm", mlp_post_norm="post_feed_forward_norm")},
    "hc": {**BACKBONE, **PRE_NORMS, **_connector({ours: Src(theirs) for ours, theirs in zip(HC_NAMES, HC_FORK)})},
    "mhc": {**BACKBONE, **PRE_NORMS, **_connector(MHC_TORCH)},
    "liger_mhc": {**BACKBONE, **PRE_NORMS, **_connector(MHC_LIGER)},
    "attnres": {**BACKBONE, **PRE_NORMS, **ATTNRES},
    "moda": {**_moda_names(), **PRE_NORMS},
    "post_norm_moda": {**_moda_names(), **_norms(attn_post_norm="attention_norm", mlp_post_norm="feed_forward_norm")},
}
# HC/mHC blocks hold their norm and sublayer twice: as the block's own module and as the connector's `branch`.
ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
    layout: (("blocks.{i}.attention_hyper_connection.branch.norm.", "blocks.{i}.attention_norm."),
             ("blocks.{i}.attention_hyper_connection.branch.attention.", "blocks.{i}.attention."),
             ("blocks.{i}.feed_forward_hyper_connection.branch.norm.", "blocks.{i}.feed_forward_norm."),
             ("blocks.{i}.feed_forward_hyper_connection.branch.feed_forward.", "blocks.{i}.feed_forward."))
    for layout in ("hc", "mhc", "liger_mhc")}
_INDEX = re.compile(r"^(blocks|scheme\.attn_res)\.(\d+)\.")


def _template(ours: str) -> tuple[str, int | None]:
    """'blocks.3.attn.w_q.weight' -> ('blocks.{i}.attn.w_q.weight', 3); names without an index -> (name, None)."""
    match = _INDEX.match(ours)
    if match is None:
        return ours, None
    return f"{match.group(1)}.{{i}}." + ours[match.end():], int(match.group(2))


def _fork_name(src: Src, index: int | None) -> str:
    return src.name if index is None else src.name.format(i=index, j=index + 1)


# -- transforms (each with its inverse) ---------------------------------------------------------------------------
def _liger_slice(part: str, n: int) -> slice:
    return {"pre": slice(0, n), "post": slice(n, 2 * n), "res": slice(2 * n, 2 * n + n * n)}[part]


def _streams_t(t: torch.Tensor, n: int) -> torch.Tensor:
    """The residual logits in the other orientation (an involution): [n, n] transposed; [k, n*n] columns (o, i)
    <-> (i, o)."""
    if t.dim() == 2 and tuple(t.shape) == (n, n):
        return t.t()
    return t.reshape(t.shape[0], n, n).transpose(1, 2).reshape(t.shape[0], n * n)


def to_ours(src: Src, t: torch.Tensor, n: int) -> torch.Tensor:
    """The fork's tensor `t` as our tensor (n: HC/mHC streams)."""
    kind, _, part = src.transform.partition(":")
    if kind == "flat":
        return t.reshape(-1)
    if kind == "streams_t":
        return _streams_t(t, n)
    if kind == "liger":
        if t.dim() == 0:
            return t
        piece = t[..., _liger_slice(part, n)]
        return piece.reshape(n, n) if (part == "res" and t.dim() == 1) else piece
    return t


def to_fork_parts(src: Src, t: torch.Tensor, n: int) -> torch.Tensor:
    """Our tensor `t` as (the fork's part of) its tensor: the inverse of `to_ours` (Liger parts are joined in
    `to_olmo_core`)."""
    kind, _, part = src.transform.partition(":")
    if kind == "flat":
        return t.reshape(1, -1)
    if kind == "streams_t":
        return _streams_t(t, n)
    if kind == "liger" and part == "res" and t.dim() == 2 and tuple(t.shape) == (n, n):
        return t.reshape(n * n)
    return t


# -- the config map ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mapping:
    """What a config.json's `model` section imports as: our config, the name table, and notes for provenance."""

    cfg: ModelConfig
    layout: str
    block_type: str
    notes: tuple[str, ...] = ()

    @property
    def n_streams(self) -> int:
        return int(self.cfg.options.get("n_streams", 1))

    @property
    def table(self) -> dict[str, Src]:
        return TABLES[self.layout]


NORM_KINDS = {"rms": "rms", "fused_rms": "rms", "default": "layer"}  # OLMo-core LayerNormType -> ours


def _norm(section: Section | None, what: str) -> tuple[str, float, bool]:
    """(kind "rms"/"layer", eps, bias) of a LayerNormConfig; elementwise affine is required."""
    if section is None:
        raise refusal(what, None, "a norm config is required")
    name = section.get("name", "default")
    if name not in NORM_KINDS:
        raise refusal(section.key("name"), name, f"norm types depthtools computes: {', '.join(NORM_KINDS)}")
    eps = section.number("eps", DEFAULT_RMS_EPS)
    section.require("elementwise_affine", (True,), "norms without a gain are not supported")
    bias = bool(section.get("bias", name == "default"))
    section.ignore("full_precision", "dtype")
    section.done()
    return NORM_KINDS[name], float(eps), bias


@dataclass
class _Read:
    """What the block's config says, gathered before the architecture is chosen."""

    shape: dict[str, Any]
    options: dict[str, Any]
    norm: tuple[str, float, bool]
    bias: bool
    mlp_bias: bool


def _attention(sec: Section, d_model: int, eps: float, options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(ModelConfig shape fields, bias) from an AttentionConfig; Pre-LN options (qk_norm, head_dim, rotary
    fraction) go into `options`."""
    sec.require("name", ("default",), "depthtools reads the default attention's w_q/w_k/w_v/w_out (fused qkv "
                "and normalized attention are not supported)")
    sec.require("type", ("attention",), "only attention sequence mixers are supported")
    n_heads = sec.number("n_heads", 1, required=True)
    n_kv = sec.number("n_kv_heads", n_heads)
    if n_heads % n_kv:
        raise refusal(sec.key("n_kv_heads"), n_kv, f"must divide n_heads={n_heads}")
    head_dim = sec.get("head_dim")
    if head_dim is not None and (d_model % n_heads or head_dim != d_model // n_heads):
        options["head_dim"] = sec.number("head_dim", 1)
    bias = bool(sec.require("bias", (False, True), "expected true or false"))
    for name, why in (("clip_qkv", "clipped q/k/v"), ("softmax_scale", "a custom softmax scale"),
                      ("sliding_window", "sliding-window attention"), ("gate", "gated attention"),
                      ("scalable_softmax", "scalable softmax"), ("attention_sinks", "attention sinks"),
                      ("use_sinks", "attention sinks"), ("qk_norm_type", "a custom QK norm"),
                      ("qk_norm_per_head_gains", "per-head QK-norm gains")):
        value = sec.get(name)
        if value not in (None, False):
            raise refusal(sec.key(name), value, f"{why} is not supported")
    qk = sec.sub("qk_norm")
    if qk is not None:
        kind, qk_eps, qk_bias = _norm(qk, sec.key("qk_norm"))
        if kind != "rms" or qk_bias or qk_eps != eps:
            raise refusal(sec.key("qk_norm"), qk.obj, f"QK norms must be RMSNorm without bias at eps {eps}")
        options["qk_norm"] = "head" if sec.get("use_head_qk_norm", False) else "full"
    else:
        sec.get("use_head_qk_norm")
    rope = sec.sub("rope")
    if rope is None:
        raise refusal(sec.key("rope"), None, "attention without RoPE is not supported")
    rope.require("name", ("default",), "plain RoPE only (rotate-half pairing, no scaling)")
    theta = rope.number("theta", 500000, required=True)
    rope.require("no_global_rope", (False,), "every layer is rotated here")
    if rope.get("scaling") is not None:
        raise refusal(rope.key("scaling"), rope.obj["scaling"], "scaled RoPE is not supported")
    fraction = rope.number("partial_rotary_factor", 1.0)
    if fraction != 1.0:
        options["rotary_fraction"] = float(fraction)
    rope.ignore("full_precision")
    rope.done()
    # compute precision and recomputation of the training run (like bf16 autocast), not the weights' function
    sec.ignore("dropout", "use_flash", "backend", "dtype", "mxfp8_projections", "mxfp8_qkv_projection",
               "mxfp8_out_projection", "use_recompute_qkv_prep", "mxfp8_save_qkv_for_backward")
    sec.done()
    return {"n_heads": n_heads, "n_kv_heads": n_kv, "rope_theta": float(theta)}, bias


def _feed_forward(sec: Section | None, path: str) -> tuple[int, bool]:
    """(d_ff, bias) of a SwiGLU FeedForwardConfig: w2(silu(w1 x) * w3 x)."""
    if sec is None:
        raise refusal(path, None, "a dense feed-forward is required (MoE is not supported)")
    sec.require("name", ("default",), "the SwiGLU feed-forward only")
    sec.require("activation", ("silu",), "SwiGLU with silu only")
    hidden = sec.number("hidden_size", 1, required=True)
    bias = bool(sec.require("bias", (False, True), "expected true or false"))
    sec.ignore("dtype")
    sec.done()
    return hidden, bias


def _read_backbone(model: Section, block: Section) -> _Read:
    """Shape, norms and Pre-LN options shared by every architecture."""
    d_model = model.number("d_model", 1, required=True)
    shape = {"vocab_size": model.number("vocab_size", 1, required=True), "d_model": d_model, "n_layer": model.number("n_layers", 1, required=True)}
    norm = _norm(block.sub("layer_norm"), block.key("layer_norm"))
    options: dict[str, Any] = {}
    attention_key = "sequence_mixer" if block.obj.get("sequence_mixer") is not None else "attention"
    if block.obj.get("sequence_mixer") is not None and block.obj.get("attention") is not None:
        raise refusal(block.key("attention"), "...", "give sequence_mixer or attention, not both")
    block.get("attention"), block.get("sequence_mixer")
    attention = Section(block.obj.get(attention_key), block.key(attention_key))
    attn_shape, bias = _attention(attention, d_model, norm[1], options)
    d_ff, mlp_bias = _feed_forward(block.sub("feed_forward"), block.key("feed_forward"))
    if block.get("feed_forward_moe") is not None:
        raise refusal(block.key("feed_forward_moe"), "...", "mixture-of-experts blocks are not supported")
    for name in ("attention_residual_alpha", "feed_forward_residual_alpha"):
        block.require(name, (1.0, 1), "a residual multiplier other than 1 is not supported")
    block.ignore("dropout")
    shape.update(attn_shape, d_ff=d_ff, norm_eps=norm[1])
    return _Read(shape, options, norm, bias, mlp_bias)


# block type -> our architecture (HC/mHC and AttnRes choose within `_arch_options`)
BLOCK_TYPES = {"default": "preln", "reordered_norm": "preln", "peri_norm": "periln", "default_scaled": "lns",
               "deepnorm": "deepnorm", "keel": "keel", "hc": "hc", "mhc": "mhc", "attnres": "attnres",
               "depth_mup": "depthmup", "completep": "completep", "moda": "moda", "post_norm_moda": "moda"}
MODA_TYPES = ("moda", "post_norm_moda")
DEPTH_SCALED_BASE = 24  # depthtools' depth-muP / CompleteP reference depth


def _refuse_preln_extras(read: _Read, arch: str, block: Section) -> None:
    """Options only the Pre-LN backbone expresses (biases, QK norms, head_dim, partial RoPE) on another arch."""
    extras = {**read.options, **({"bias": True} if read.bias else {}), **({"mlp_bias": True} if read.mlp_bias else {})}
    if extras:
        name = min(extras)
        where = {"qk_norm": "sequence_mixer.qk_norm", "head_dim": "sequence_mixer.head_dim",
                 "rotary_fraction": "sequence_mixer.rope.partial_rotary_factor", "bias": "sequence_mixer.bias",
                 "mlp_bias": "feed_forward.bias"}[name]
        raise refusal(block.key(where), extras[name], f"depthtools' {arch} has the plain Llama backbone "
                      "(no biases, QK norms, custom head_dim or partial RoPE)")


def _preln_options(read: _Read, block_type: str) -> dict[str, Any]:
    options = dict(read.options)
    if read.bias:
        options.update(qkv_bias=True, attn_out_bias=True)
    if read.mlp_bias:
        options["mlp_bias"] = True
    kind, _, norm_bias = read.norm
    if kind == "layer":
        options["norm"] = "layer"
    if norm_bias:
        options["norm_bias"] = True
    if block_type == "reordered_norm":
        options.update(pre_norm=False, out_norm=True, family="olmo2")
    return options


def _hyper_options(block: Section, block_type: str) -> tuple[str, dict[str, Any], list[str]]:
    """(layout, options, notes) of an HC/mHC block from its `hyper_connections` section."""
    hc = block.sub("hyper_connections") or Section({}, block.key("hyper_connections"))
    default_kind = "hc" if block_type == "hc" else "mhc"
    kind = hc.get("kind", default_kind)
    allowed = ("hc",) if block_type == "hc" else ("mhc", "liger_mhc")
    if kind not in allowed:
        why = "mHC's static variant is not a depthtools architecture" if kind == "mhc_static" else \
            f"a {block_type} block takes kind {' or '.join(allowed)}"
        raise refusal(hc.key("kind"), kind, why)
    n = hc.number("num_residual_streams", 4)
    tanh = hc.get("tanh", kind == "hc")
    if bool(tanh) != (kind == "hc"):
        raise refusal(hc.key("tanh"), tanh, "depthtools' HC uses tanh and its mHC none, as the papers do")
    collapse = hc.get("collapse", "auto")
    if collapse not in ("auto", "sum", "mean"):
        raise refusal(hc.key("collapse"), collapse, "one of auto, sum, mean")
    reduce = ("mean" if kind == "liger_mhc" else "sum") if collapse == "auto" else collapse
    options: dict[str, Any] = {"n_streams": n, "readout": "normed_sum" if reduce == "sum" else "mean",
                               "scale_output_init_by_sqrt_n": bool(hc.get("scale_output_init_by_sqrt_n", True))}
    notes: list[str] = []
    hc.ignore("gating_factor_init", "disable_static_weight_decay", "liger_phi_dtype", "liger_allow_fp32")
    if kind == "hc":
        options["connector_norm_eps"] = HC_CONNECTOR_EPS
        hc.ignore("sinkhorn_iters", "sinkhorn_tau", "liger_rms_eps", "liger_pre_eps", "liger_sinkhorn_eps",
                  "liger_post_mult")
    else:
        options["sinkhorn_iters"] = hc.number("sinkhorn_iters", 20)
    if kind == "mhc":
        hc.require("sinkhorn_tau", (1.0, 1), "a Sinkhorn temperature other than 1 is not supported")
        options.update(connector_norm_eps=HC_CONNECTOR_EPS, mhc_init="hc_like", sinkhorn_order="rows_last")
        hc.ignore("liger_rms_eps", "liger_pre_eps", "liger_sinkhorn_eps", "liger_post_mult")
    if kind == "liger_mhc":
        hc.ignore("sinkhorn_tau")  # the Liger backend does not read it
        options.update(connector_norm_eps=float(hc.number("liger_rms_eps", 1e-6)), mhc_init="uniform",
                       sinkhorn_order="cols_last")
        hc.require("liger_pre_eps", (0.0, 0), "depthtools' H_pre = sigmoid(...) has no added eps")
        hc.require("liger_post_mult", (2.0, 2), "depthtools' H_post = 2·sigmoid(...)")
        sinkhorn_eps = hc.number("liger_sinkhorn_eps", 1e-6, positive=False)
        if sinkhorn_eps:
            notes.append(f"Liger's Sinkhorn adds liger_sinkhorn_eps={sinkhorn_eps:g} to each normalisation; "
                         "depthtools' Sinkhorn adds none (a relative difference of that order in H_res)")
    hc.done()
    return kind, options, notes


def _moda_options(block: Section, block_type: str, read: _Read) -> dict[str, Any]:
    """MoDA options from the block's `moda` section (DepthBench's `configure_moda`): depth K/V from every
    sublayer (the MLP's through `kv_proj`), scored with the rotated query against the un-rotated cache."""
    moda = block.sub("moda")
    if moda is None:
        raise refusal(block.key("moda"), None, "a MoDA block needs its moda config")
    moda.require("extra_ffn_kv_proj", (True,), "depthtools' MoDA writes an MLP depth slot through kv_proj")
    moda.require("extra_attn_kv_proj", (False,), "an extra attention K/V projection is not supported")
    scale = moda.get("attention_scale")
    head_dim = read.shape["d_model"] // read.shape["n_heads"]
    if scale is not None and not math.isclose(scale, head_dim ** -0.5, rel_tol=1e-12):
        raise refusal(moda.key("attention_scale"), scale, f"depthtools scales by head_dim^-1/2 = {head_dim ** -0.5:g}")
    moda.ignore("backend", "depth_bs", "depth_warps", "cache_post_norm_k")  # kernel choice/tiling; no QK norm here
    moda.done()
    block.require("moda_skip_ffn_kv", (False,), "only the last block skips its MLP depth slot (block_overrides)")
    return {"moda_norm": "post" if block_type == "post_norm_moda" else "pre", "moda_depth_rope": "query"}


def _check_overrides(model: Section, block_type: str, n_layer: int) -> None:
    """Per-block overrides: none, except DepthBench's MoDA last block (the same block with moda_skip_ffn_kv)."""
    overrides = model.get("block_overrides")
    if overrides in (None, {}, []):
        if block_type in MODA_TYPES:
            raise refusal(model.key("block_overrides"), overrides, "DepthBench's MoDA skips the last block's MLP "
                          f"depth slot (block_overrides {{{n_layer - 1}: moda_skip_ffn_kv=true}}); this config "
                          "keeps it, which depthtools' MoDA does not")
        return
    last = overrides.get(str(n_layer - 1), overrides.get(n_layer - 1)) if isinstance(overrides, dict) else None
    if block_type not in MODA_TYPES or len(overrides) != 1 or not isinstance(last, dict):
        raise refusal(model.key("block_overrides"), overrides, "per-block overrides are not supported")
    block = {k: v for k, v in model.obj["block"].items() if k != "moda_skip_ffn_kv"}
    if {k: v for k, v in last.items() if k != "moda_skip_ffn_kv"} != block or last.get("moda_skip_ffn_kv") is not True:
        raise refusal(model.key(f"block_overrides.{n_layer - 1}"), "...", "the override may only set "
                      "moda_skip_ffn_kv=true on the last block")


def _arch_options(block: Section, block_type: str, read: _Read) -> tuple[str, str, dict, list]:  # noqa: C901 (one branch per DepthBench block type, read as the fork's config reads it)
    """(arch, layout, options, notes) for one block type."""
    if block_type not in BLOCK_TYPES:
        raise refusal(block.key("name"), block_type, f"block types depthtools imports: {', '.join(BLOCK_TYPES)}")
    arch, layout, options, notes = BLOCK_TYPES[block_type], block_type, {}, []
    attnres_size = block.get("attnres_block_size")
    if block_type == "default" and attnres_size is not None:  # the fork's older AttnRes: a default block with a size
        arch = "attnres"
    if block_type in ("hc", "mhc"):
        layout, options, notes = _hyper_options(block, block_type)
    elif block.get("hyper_connections") is not None:
        raise refusal(block.key("hyper_connections"), "...", "only HC and mHC blocks take hyper_connections")
    if arch == "attnres":
        size = 1 if attnres_size is None else block.number("attnres_block_size", 1)
        layout = "attnres"
        if size != 1:
            arch, options = "blockattnres", {"attnres_block_size": int(size)}
        if read.norm[1] != DEFAULT_RMS_EPS:  # the fork's res norms (keys, fused output norm, final) keep 1e-5
            options["mix_eps"] = DEFAULT_RMS_EPS
    elif attnres_size is not None:
        raise refusal(block.key("attnres_block_size"), attnres_size, "only AttnRes blocks take a block size")
    if block_type in ("depth_mup", "completep"):
        base = block.number("residual_scaling_base_depth", DEPTH_SCALED_BASE)
        if base != DEPTH_SCALED_BASE:
            raise refusal(block.key("residual_scaling_base_depth"), base,
                          f"depthtools' {arch} scales by (L/{DEPTH_SCALED_BASE})")
    elif block.get("residual_scaling_base_depth") is not None:
        raise refusal(block.key("residual_scaling_base_depth"), block.obj["residual_scaling_base_depth"],
                      "only depth_mup/completep blocks take a reference depth")
    if block_type in MODA_TYPES:
        options.update(_moda_options(block, block_type, read))
    else:
        for name in ("moda", "moda_skip_ffn_kv"):
            if block.get(name) not in (None, False):
                raise refusal(block.key(name), block.obj[name], "only MoDA blocks take MoDA options")
    kind = read.norm[0]
    if arch == "preln":
        options.update(_preln_options(read, block_type))
        return arch, layout, options, notes
    _refuse_preln_extras(read, arch, block)
    if read.norm[2]:
        raise refusal(block.key("layer_norm.bias"), True, f"depthtools' {arch} norms have no bias")
    if arch == "deepnorm":
        options["norm"] = "layernorm" if kind == "layer" else "rmsnorm"
    elif kind != "rms":
        raise refusal(block.key("layer_norm.name"), block.obj["layer_norm"].get("name"),
                      f"depthtools' {arch} uses RMSNorm")
    return arch, layout, options, notes


def _lm_head(model: Section, block_norm: tuple[str, float, bool], arch: str) -> None:
    """The LM head: our final norm (Pre-LN: the blocks' kind; every other arch: RMSNorm without bias) at the
    blocks' eps, and an unbiased w_out. AttnRes's head norm runs at the res norms' eps (`mix_eps`), not its own."""
    head = model.sub("lm_head")
    if head is None:
        raise refusal(model.key("lm_head"), None, "an LM head is required")
    head.require("name", ("default",), "the default LM head only")
    kind, eps_head, bias = _norm(head.sub("layer_norm"), head.key("layer_norm"))
    eps = block_norm[1]
    if eps_head != eps and arch not in ("attnres", "blockattnres"):
        raise refusal(head.key("layer_norm.eps"), eps_head, f"depthtools has one norm eps; the blocks use {eps:g}")
    want = (block_norm[0], block_norm[2]) if arch == "preln" else ("rms", False)
    if (kind, bias) != want:
        raise refusal(head.key("layer_norm"), head.obj["layer_norm"], "the final norm must be " + (
            "the blocks' norm" if arch == "preln" else "an RMSNorm without bias"))
    head.require("bias", (False,), "a biased output layer is not supported")
    head.ignore("dtype", "loss_implementation", "z_loss_multiplier")
    head.done()


def _seq_len(config: dict[str, Any]) -> tuple[int, list[str]]:
    """The context length the run trained with (dataset.sequence_length or train_module.max_sequence_length)."""
    for section, key in (("dataset", "sequence_length"), ("train_module", "max_sequence_length")):
        part = config.get(section)
        value = part.get(key) if isinstance(part, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, []
    return DEFAULT_SEQ_LEN, [f"config.json names no sequence length; max_seq_len set to {DEFAULT_SEQ_LEN}"]


def olmo_core_mapping(config: dict[str, Any]) -> Mapping:
    """The depthtools config and name table for a step's config.json (its `model` section), or a one-line
    refusal naming the config key."""
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise refusal("model", None if not isinstance(config, dict) else config.get("model"),
                      "config.json must have a `model` section (OLMo-core's TransformerConfig)")
    model = Section(config["model"], "model")
    model.require("name", ("default",), "the default Transformer only (not nGPT or MoE)")
    for name, why in (("embedding_norm", "an embedding norm"), ("block_pattern", "a block pattern")):
        if model.get(name) not in (None, {}, []):
            raise refusal(model.key(name), model.obj[name], f"{why} is not supported")
    model.require("embed_scale", (None, 1.0, 1), "an embedding scale is not supported")
    model.require("tie_word_embeddings", (False,), "tied embeddings are not supported")
    block = model.sub("block")
    if block is None:
        raise refusal(model.key("block"), None, "a block config is required")
    block_type = block.get("name", "default")
    legacy_hc = block.obj.get("hyper_connections")
    if block_type == "default" and isinstance(legacy_hc, dict):  # the fork's older HC/mHC configs (its __post_init__)
        block_type = "hc" if legacy_hc.get("kind", "hc") == "hc" else "mhc"
    if block_type not in BLOCK_TYPES:
        raise refusal(block.key("name"), block_type, f"block types depthtools imports: {', '.join(BLOCK_TYPES)}")
    read = _read_backbone(model, block)
    arch, layout, options, notes = _arch_options(block, block_type, read)
    block.done()
    _check_overrides(model, block_type, read.shape["n_layer"])
    _lm_head(model, read.norm, arch)
    init_std = model.number("init_std", 0.02)
    model.ignore("dtype", "init_method", "init_seed", "embedding_init_std", "freeze_params")
    model.done()
    seq_len, seq_notes = _seq_len(config)
    try:
        cfg = ModelConfig(arch=arch, max_seq_len=seq_len, init_std=float(init_std), tie_embeddings=False,
                          options=options, **read.shape)
    except DepthToolsError as exc:
        raise DepthToolsError(f"OLMo-core config cannot be expressed as a depthtools model: {exc}") from None
    return Mapping(cfg, layout, block_type, tuple(notes + seq_notes))


# -- tensors ----------------------------------------------------------------------------------------------------
def expected_state(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our state dict's names and shapes for `cfg` (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        model = DepthModel(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _src(mapping: Mapping, ours: str) -> tuple[Src, int | None]:
    template, index = _template(ours)
    src = mapping.table.get(template)
    if src is None:
        raise DepthToolsError(f"internal: the OLMo-core {mapping.layout} table has no source for {ours}")
    return src, index


def to_olmo_core(state: dict[str, torch.Tensor], mapping: Mapping) -> dict[str, torch.Tensor]:
    """Our state dict under the fork's names (the inverse of `from_olmo_core`; Liger's parts joined in order, HC
    branch aliases included as a state dict of the fork holds them)."""
    out: dict[str, torch.Tensor] = {}
    liger: dict[str, dict[str, torch.Tensor]] = {}
    n = mapping.n_streams
    for ours, tensor in state.items():
        src, index = _src(mapping, ours)
        name = _fork_name(src, index)
        kind, _, part = src.transform.partition(":")
        if kind == "liger" and tensor.dim() > 0:
            liger.setdefault(name, {})[part] = to_fork_parts(src, tensor, n)
        else:
            out[name] = to_fork_parts(src, tensor, n)
    for name, parts in liger.items():
        out[name] = torch.cat([parts[p] for p in ("pre", "post", "res")], dim=-1)
    for name in list(out):
        for alias, primary in _aliases(mapping):
            if name.startswith(primary):
                out[alias + name[len(primary):]] = out[name]
    return dict(sorted(out.items()))


def _aliases(mapping: Mapping) -> list[tuple[str, str]]:
    """(alias prefix, primary prefix) for every block of the model."""
    return [(alias.format(i=i), primary.format(i=i)) for i in range(mapping.cfg.n_layer)
            for alias, primary in ALIASES.get(mapping.layout, ())]


def olmo_core_shapes(mapping: Mapping) -> dict[str, tuple[int, ...]]:
    """The fork's tensor names and shapes this config implies (aliases included)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in expected_state(mapping.cfg).items()}
    return {name: tuple(t.shape) for name, t in to_olmo_core(meta, mapping).items()}


def _tensor_problem(name: str, tensor: Any, implied: tuple[int, ...] | None) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"OLMo-core entry {name} is a {type(tensor).__name__}, not a tensor"
    if implied is not None and tuple(tensor.shape) != implied:
        return f"OLMo-core tensor {name} has shape {tuple(tensor.shape)}, the config implies {implied}"
    if not tensor.dtype.is_floating_point:
        return f"OLMo-core tensor {name} has dtype {str(tensor.dtype).replace('torch.', '')}, expected floating point"
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        return f"OLMo-core tensor {name} has {bad} non-finite (NaN/inf) value(s) of {tensor.numel()}"
    return None


def _resolve_aliases(tensors: dict[str, torch.Tensor], mapping: Mapping) -> dict[str, torch.Tensor]:
    """The tensors with HC branch aliases folded onto their primary names (equal when both are present)."""
    pairs = _aliases(mapping)
    out = {}
    for name, tensor in tensors.items():
        primary = next((p + name[len(a):] for a, p in pairs if name.startswith(a)), None)
        if primary is None:
            out.setdefault(name, tensor)
            continue
        other = tensors.get(primary)
        if other is not None and (not isinstance(tensor, torch.Tensor) or tensor.shape != other.shape
                                  or not torch.equal(tensor, other)):
            raise DepthToolsError(f"OLMo-core tensors {name} and {primary} hold the same parameter but differ")
        out.setdefault(primary, tensor)
    return out


def from_olmo_core(tensors: dict[str, torch.Tensor], mapping: Mapping) -> dict[str, torch.Tensor]:
    """Our state dict from the fork's tensors: every tensor used, every expected one found, with the shape the
    config implies, floating point and finite; one line naming the OLMo-core tensor otherwise."""
    implied = olmo_core_shapes(mapping)
    tensors = _resolve_aliases(tensors, mapping)
    alias_prefixes = tuple(a for a, _ in _aliases(mapping))
    expected = {n: s for n, s in implied.items() if not n.startswith(alias_prefixes)}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise DepthToolsError(
            f"OLMo-core weights do not match a {mapping.block_type} model of this config: missing {missing[:3]}"
            f"{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}")
    for name in sorted(tensors):
        problem = _tensor_problem(name, tensors[name], implied[name])
        if problem is not None:
            raise DepthToolsError(problem)
    state = {}
    for ours in expected_state(mapping.cfg):
        src, index = _src(mapping, ours)
        state[ours] = to_ours(src, tensors[_fork_name(src, index)], mapping.n_streams).contiguous()
    return state


def build_from_olmo_core(config: dict[str, Any], tensors: dict[str, torch.Tensor],
                         source: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(depthtools config, state dict in our names, provenance) for a step's config.json and its model tensors
    (OLMo-core names without the "model." prefix). `source` names the checkpoint in provenance."""
    mapping = olmo_core_mapping(config)
    state = from_olmo_core(tensors, mapping)
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()})
    provenance = {
        "format": FORMAT,
        "source": str(source),
        "block_type": mapping.block_type,
        "layout": mapping.layout,
        "arch": mapping.cfg.arch,
        "options": dict(mapping.cfg.options),
        "olmo_core_class": config["model"].get("_CLASS_"),
        "tensors": len(tensors),
        "dtypes": dtypes,
        "notes": list(mapping.notes),
    }
    return mapping.cfg, state, provenance


__all__ = [
    "ALIASES",
    "BLOCK_TYPES",
    "FORMAT",
    "TABLES",
    "Mapping",
    "Src",
    "build_from_olmo_core",
    "expected_state",
    "from_olmo_core",
    "olmo_core_mapping",
    "olmo_core_shapes",
    "refusal",
    "to_olmo_core",
]
