"""The open decoder families as data: config.json fields -> Pre-LN options, HF tensor names -> ours.

Every family (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, olmo, olmo2, gpt2, gpt_neox, phi3, phi,
and the mixture-of-experts mixtral, qwen2_moe, qwen3_moe, olmoe) becomes one `preln` DepthModel whose typed
options (`depthtools.arch.backbone`: scaled RoPE and MoE MLPs included) express it; there is no per-family
forward code. A `Family` says:

* `shape`: ModelConfig's fields from config.json keys, with transformers' own config-class defaults
  (tests/test_families.py checks each default against the installed config class);
* `options`: Pre-LN options, constants or functions of the config (`Reader`);
* `refuse`: config values our block cannot express, each refused in one line naming the field and value;
* `tensors`: our parameter name -> `Src` (HF name, with "{i}" the layer and "{e}" an MoE expert; a
  transpose for GPT-2's Conv1D; a split of a fused tensor: Phi-3's qkv and gate_up, GPT-2's c_attn, NeoX's
  per-head interleaved qkv). An MoE family's expert count is checked against its weights (`experts_key`).

What transformers does, read from its 5.x sources (modeling_<family>.py), is the reference: e.g. which
config keys a family's forward actually reads (Llama ignores `sliding_window`; Mistral applies it even
with `use_sliding_window: false`; Qwen2/3 only with it), Gemma's (1+w) norms and √d embedding scale,
OLMo's non-parametric LayerNorm with its fixed eps 1e-5.

Importing is `hf_to_model_config` (config -> ModelConfig, or a refusal) and `hf_state` (HF tensors ->
our state dict, every tensor accounted for: a missing or unexpected tensor, or a shape that disagrees
with the config, is one line naming it). A streamed import (a model larger than memory) uses the same map one
tensor at a time: `hf_state_plan` makes those checks from the headers, `hf_state_stream` yields the tensors.
No family's conversion needs two HF tensors at once (a fused tensor is split, experts are separate tensors).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from depthtools.arch.backbone import DEFAULTS as BACKBONE_DEFAULTS, backbone
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError
from depthtools.interop.schema import check_config, nested_rope

REQUIRED = object()  # a Field without a default: config.json must have it


def refusal(field_name: str, value: Any, why: str) -> DepthToolsError:
    """The one-line refusal of a config value depthtools cannot express exactly."""
    return DepthToolsError(f"unsupported Hugging Face config: {field_name}={value!r} ({why})")


@dataclass(frozen=True)
class Field:
    """A config.json value: the first of `keys` present (None counts as absent), else `default`."""

    keys: tuple[str, ...]
    default: Any = REQUIRED

    def __init__(self, *keys: str, default: Any = REQUIRED):
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "default", default)


@dataclass(frozen=True)
class Src:
    """Where one of our tensors comes from: HF name ("{i}" = layer), transposed (Conv1D stores [in, out]),
    and for a fused tensor which part: split "qkv" (rows q | k | v), "neox_qkv" (rows per head q | k | v),
    "halves" (rows gate | up)."""

    name: str
    transpose: bool = False
    split: str = ""
    part: int = 0


@dataclass(frozen=True)
class Refuse:
    """Refuse config key `key` when `bad(value)` (value None when absent), saying `why`."""

    key: str
    bad: Callable[[Any], bool]
    why: str


@dataclass(frozen=True)
class Family:
    model_type: str
    shape: dict[str, Field]
    options: dict[str, Any]
    tensors: dict[str, Src]
    refuse: tuple[Refuse, ...] = ()
    ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)  # HF buffers some checkpoints saved; recomputed
    windows: Callable[["Reader", int], list[int]] | None = None  # per-layer sliding window (0: full)
    experts_key: str = ""  # config.json's expert count (MoE families), named when the weights disagree


class Reader:
    """config.json with transformers' defaults for one family."""

    def __init__(self, hf: dict[str, Any], family: Family):
        self.hf, self.family = hf, family

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key)
        return default if value is None else value

    def read(self, spec: Field) -> Any:
        for key in spec.keys:
            if self.hf.get(key) is not None:
                return self.hf[key]
        if spec.default is REQUIRED:
            raise DepthToolsError(f"Hugging Face config ({self.family.model_type}) has no {' or '.join(spec.keys)}")
        return spec.default(self) if callable(spec.default) else spec.default


# -- shared readers ----------------------------------------------------------------------------------
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": None, "relu": "relu"}  # HF ACT2FN name -> our mlp_act


def activation(r: Reader, *keys: str, default: str = "silu") -> str:
    """Our mlp_act for the HF activation name under the first present key."""
    name = next((r.hf[k] for k in keys if r.hf.get(k) is not None), default)
    ours = ACTIVATIONS.get(name)
    if ours is None:
        raise refusal(keys[0], name, f"supported activations: {', '.join(k for k, v in ACTIVATIONS.items() if v)}")
    return ours


DEFAULT_ROPE_TYPES = (None, "default")
LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")
SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")  # depthtools.arch.rope
# rope-parameter key -> our option, per scaled type (the keys transformers' _compute_<type>_parameters read)
ROPE_KEYS = {"linear": {"factor": "rope_factor"},
             "dynamic": {"factor": "rope_factor"},
             "yarn": {"factor": "rope_factor", "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
                      "attention_factor": "rope_attention_factor", "truncate": "rope_truncate"},
             "longrope": {"factor": "rope_factor", "attention_factor": "rope_attention_factor",
                          "short_factor": "rope_short_factor", "long_factor": "rope_long_factor"},
             "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                        "high_freq_factor": "rope_high_freq_factor"}}
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (), "longrope": ("short_factor", "long_factor"),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _rope_kind(params: Any, where: str, aliases: dict[str, str] | None = None) -> str:
    """The rope_type of a rope-parameters dict ("default" when absent), or a refusal naming `where`."""
    if not isinstance(params, dict):
        raise refusal(where, params, "expected a dict or null")
    kind = params.get("rope_type", params.get("type"))
    kind = (aliases or {}).get(kind, kind)
    if kind in DEFAULT_ROPE_TYPES:
        return "default"
    if kind not in SCALED_ROPE_TYPES:
        raise refusal(f"{where}.rope_type", kind, f"supported: default, {', '.join(SCALED_ROPE_TYPES)}")
    return kind


def _rope_value(value: Any, option: str) -> Any:
    """A RoPE parameter as our option's kind: a bool (truncate), a list of numbers (longrope) or a float. Its
    type and range were checked with the rest of config.json (`schema.ROPE_KEYS`)."""
    if option == "rope_truncate" or option in ("rope_short_factor", "rope_long_factor"):
        return value
    return float(value)


def _scaled_rope(r: Reader, params: dict[str, Any], kind: str, where: str,
                 original_default: int | None = None) -> dict[str, Any]:
    """Our rope_* options for a scaled RoPE dict, with transformers' defaults: the pretraining context is
    a top-level `original_max_position_embeddings` (Phi-3 always has one), else the dict's, else
    max_position_embeddings (dynamic: always max_position_embeddings); a yarn/longrope factor absent is
    max_position_embeddings / that context; yarn's attention factor from mscale / mscale_all_dim."""
    if kind == "default":
        return {}
    missing = [key for key in ROPE_REQUIRED[kind] if params.get(key) is None]
    if missing:
        raise refusal(f"{where}.{missing[0]}", None, f"rope_type {kind!r} needs it")
    max_pos = r.read(r.family.shape["max_seq_len"])
    out: dict[str, Any] = {"rope_type": kind}
    if kind == "dynamic":
        out["rope_original_context"] = max_pos
    elif kind != "linear":
        context = r.hf.get("original_max_position_embeddings", original_default)
        context = params.get("original_max_position_embeddings") if context is None else context
        out["rope_original_context"] = max_pos if context is None else context  # an int >= 1 (schema)
    for key, option in ROPE_KEYS[kind].items():
        if params.get(key) is not None:
            out[option] = _rope_value(params[key], option)
    if kind in ("yarn", "longrope") and "rope_factor" not in out:
        out["rope_factor"] = max_pos / out["rope_original_context"]
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if kind == "yarn" and params.get("attention_factor") is None and mscale and mscale_all:
        def get_mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        out["rope_attention_factor"] = get_mscale(out["rope_factor"], mscale) / get_mscale(out["rope_factor"], mscale_all)
    return out


def rope(r: Reader, default_theta: float = 10000.0, legacy_theta: str = "rope_theta",
         legacy_fraction: tuple[str, float] | None = None, per_layer: bool = False,
         aliases: dict[str, str] | None = None, original_default: int | None = None) -> dict[str, Any]:
    """{"rope_theta", "rotary_fraction", "rope_theta_sliding", rope_* scaling options} from v5
    `rope_parameters` (flat, or keyed by layer type where `per_layer`: Gemma-3, whose full layers may be
    scaled and whose sliding layers are plain) or v4 `rope_theta`/`rope_scaling` (which wins over
    rope_parameters, as in transformers) and legacy keys. `aliases`: a family's other names of a type
    (Phi-3 reads 'su' and 'yarn' as longrope)."""
    params = r.hf.get("rope_parameters")
    scaling = r.hf.get("rope_scaling")
    out: dict[str, Any] = {}
    if nested_rope(params):
        if not per_layer:
            raise refusal("rope_parameters", sorted(params), f"per-layer-type RoPE is not a {r.family.model_type} feature")
        unknown = sorted(set(params) - set(LAYER_TYPE_KEYS))
        if unknown:
            raise refusal("rope_parameters", unknown, f"layer types known: {', '.join(LAYER_TYPE_KEYS)}")
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}  # null: defaults
        where = "rope_parameters.full_attention"
        out.update(_scaled_rope(r, full, _rope_kind(full, where, aliases), where, original_default))
        if _rope_kind(local, "rope_parameters.sliding_attention") != "default":
            raise refusal("rope_parameters.sliding_attention.rope_type", local.get("rope_type", local.get("type")),
                          "scaled RoPE on sliding layers is not supported (only on full-attention layers)")
        out["rope_theta"] = float(full.get("rope_theta", default_theta))
        out["rope_theta_sliding"] = float(local.get("rope_theta", 10000.0))
        fraction = 1.0
    else:
        if nested_rope(scaling):
            raise refusal("rope_scaling", sorted(scaling), "per-layer-type RoPE is read from rope_parameters only")
        flat = params if isinstance(params, dict) else ({} if params is None else params)
        where = "rope_scaling" if scaling else "rope_parameters"
        chosen = scaling or flat
        out.update(_scaled_rope(r, chosen, _rope_kind(chosen, where, aliases), where, original_default))
        theta = chosen.get("rope_theta", flat.get("rope_theta") if isinstance(flat, dict) else None)
        out["rope_theta"] = float(theta if theta is not None else r.get(legacy_theta, default_theta))
        fraction = chosen.get("partial_rotary_factor", r.hf.get("partial_rotary_factor"))
        if fraction is None and legacy_fraction is not None:
            fraction = r.get(legacy_fraction[0], legacy_fraction[1])
        fraction = 1.0 if fraction is None else fraction
        if per_layer:  # v4 Gemma-3: rope_local_base_freq (its rope_scaling scales the full layers only)
            out["rope_theta_sliding"] = float(r.get("rope_local_base_freq", 10000.0))
    theta = out["rope_theta"]
    if isinstance(theta, bool) or not math.isfinite(theta) or theta <= 0:
        raise refusal("rope_theta", theta, "must be a positive number")
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise refusal("partial_rotary_factor", fraction, "must lie in (0, 1]")
    out["rotary_fraction"] = float(fraction)
    return out


def _window_value(r: Reader, key: str, default: Any) -> int | None:
    value = r.hf.get(key, default) if key in r.hf else default
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refusal(key, value, "expected a positive integer or null")
    return value


def all_layers_window(default: int | None):
    """Mistral / Phi-3: `sliding_window` (absent: `default`) applies to every layer."""
    def windows(r: Reader, n_layer: int) -> list[int]:
        window = _window_value(r, "sliding_window", default)
        return [window or 0] * n_layer
    return windows


def typed_layers_window(default_window: int | None, default_types: Callable[[Reader, int], list[str]],
                        flag: str | None = None):
    """Qwen2/3, Gemma-2/3: `layer_types` (absent: the family's default pattern) marks sliding layers; the
    window is `sliding_window`, and for Qwen only when `use_sliding_window` (`flag`) is true."""
    def windows(r: Reader, n_layer: int) -> list[int]:
        off = flag is not None and not r.get(flag, False)  # (Qwen2-MoE writes sliding_window 0 when off)
        window = None if off else _window_value(r, "sliding_window", default_window)
        types = r.hf.get("layer_types") or default_types(r, n_layer)
        if not isinstance(types, list) or len(types) != n_layer:
            raise refusal("layer_types", types, f"expected one entry per layer ({n_layer})")
        unknown = sorted(set(types) - set(LAYER_TYPE_KEYS))
        if unknown:
            raise refusal("layer_types", unknown[0], f"layer types known: {', '.join(LAYER_TYPE_KEYS)}")
        return [window if (window and kind == "sliding_attention") else 0 for kind in types]
    return windows


def _qwen_types(r: Reader, n_layer: int) -> list[str]:
    first = r.get("max_window_layers", 28)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]


def _qwen2_moe_types(r: Reader, n_layer: int) -> list[str]:  # Qwen2-MoE: odd-numbered layers below max_window_layers
    first = r.get("max_window_layers", 28)
    return ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(n_layer)]


def _flagged_all_layers_window(r: Reader, n_layer: int) -> list[int]:
    """Qwen3-MoE: `sliding_window` (default 4096) on every layer, only when `use_sliding_window`."""
    window = _window_value(r, "sliding_window", 4096) if r.get("use_sliding_window", False) else None
    return [window or 0] * n_layer


def _every_other(r: Reader, n_layer: int) -> list[str]:  # Gemma-2: even layers slide
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layer)]


def _gemma3_types(r: Reader, n_layer: int) -> list[str]:  # Gemma-3: every sliding_window_pattern-th layer is full
    pattern = r.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]


def truthy(value: Any) -> bool:
    return bool(value)


PHI_LAYER = "model.layers.{i}."
# Phi-1/1.5/2: one input LayerNorm feeds both parallel sublayers (our attn_norm and mlp_norm both read it), biased
# q/k/v/dense, fc1/fc2, optional per-head q/k LayerNorms, a final LayerNorm and a biased head
PHI_TENSORS = {
    "tok_embed.weight": Src("model.embed_tokens.weight"), "unembed.weight": Src("lm_head.weight"),
    "unembed.bias": Src("lm_head.bias"),
    **{f"ln_final.{kind}": Src(f"model.final_layernorm.{kind}") for kind in ("weight", "bias")},
    **{f"blocks.{{i}}.{ours}_norm.{kind}": Src(f"{PHI_LAYER}input_layernorm.{kind}")
       for ours in ("attn", "mlp") for kind in ("weight", "bias")},
    **{f"blocks.{{i}}.attn.{ours}.{kind}": Src(f"{PHI_LAYER}self_attn.{hf}.{kind}")
       for ours, hf in (("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_o", "dense"),
                        ("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")) for kind in ("weight", "bias")},
    **{f"blocks.{{i}}.mlp.{ours}.{kind}": Src(f"{PHI_LAYER}mlp.{hf}.{kind}")
       for ours, hf in (("w1", "fc1"), ("w2", "fc2")) for kind in ("weight", "bias")},
}


# -- mixture of experts (depthtools.arch.moe) ---------------------------------------------------------
def _sparse_layers(r: Reader, n_layer: int) -> str:
    """Qwen-MoE's per-layer MoE pattern: layer l is sparse unless listed in `mlp_only_layers` or
    (l + 1) is not a multiple of `decoder_sparse_step` (transformers' Qwen2/3-MoE decoder layer)."""
    dense = r.get("mlp_only_layers", [])  # a list of integers >= 0, and a step >= 1 (schema.QWEN_MOE)
    step = r.get("decoder_sparse_step", 1)
    pattern = "".join("d" if (i in dense or (i + 1) % step) else "m" for i in range(n_layer))
    return "" if set(pattern) == {"m"} else pattern


def moe(experts: Field, top_k_default: int, norm_topk: bool | None, ff: Field | None = None,
        shared_ff: Field | None = None, per_layer: bool = False):
    """The moe_* options of a family: expert count, top-k, expert width, whether the top-k weights are
    renormalised (a constant, or None: config.json's `norm_topk_prob`, default False), a gated shared expert."""
    def options(r: Reader) -> dict[str, Any]:
        out = {"moe_experts": r.read(experts), "moe_top_k": r.get("num_experts_per_tok", top_k_default),
               "moe_norm_topk": bool(r.get("norm_topk_prob", False)) if norm_topk is None else norm_topk}
        if out["moe_top_k"] > out["moe_experts"]:  # transformers' torch.topk would fail in the first forward
            key = next((k for k in experts.keys if r.hf.get(k) is not None), experts.keys[0])
            raise refusal("num_experts_per_tok", out["moe_top_k"], f"exceeds {key}={out['moe_experts']}")
        if ff is not None:
            out["moe_ff"] = r.read(ff)
        if shared_ff is not None and r.read(shared_ff):
            out["moe_shared_ff"] = r.read(shared_ff)
        if per_layer:
            out["moe_layers"] = _sparse_layers(r, r.read(r.family.shape["n_layer"]))
        return {k: v for k, v in out.items() if v != ""}
    return options


def moe_tensors(prefix: str, router: str, w1: str, w3: str, w2: str) -> dict[str, Src]:
    """Our router and per-expert MLP names ("{e}": the expert) -> HF names under `prefix` ("{i}": the layer)."""
    return {"blocks.{i}.mlp.router.weight": Src(prefix + router),
            **{f"blocks.{{i}}.mlp.experts.{{e}}.{ours}.weight": Src(f"{prefix}experts.{{e}}.{hf}.weight")
               for ours, hf in (("w1", w1), ("w3", w3), ("w2", w2))}}


# MoE settings our block does not implement, which some checkpoints of other MoE families set: refused in one
# line rather than imported as a model that routes differently
MOE_REFUSALS = (
    Refuse("scoring_func", lambda v: v not in (None, "softmax"), "depthtools routes by a softmax over the experts"),
    Refuse("routed_scaling_factor", lambda v: v not in (None, 1, 1.0), "routing weights are not rescaled here"),
    Refuse("n_group", lambda v: v not in (None, 1), "grouped top-k routing is not implemented"),
    Refuse("topk_group", lambda v: v not in (None, 1), "grouped top-k routing is not implemented"),
    Refuse("first_k_dense_replace", truthy, "use mlp_only_layers (Qwen-MoE) for dense layers"),
    Refuse("n_shared_experts", truthy, "only Qwen2-MoE's one gated shared expert is implemented"),
)


# -- the maps --------------------------------------------------------------------------------------
LLAMA_SHAPE = {
    "vocab_size": Field("vocab_size"), "d_model": Field("hidden_size"), "n_layer": Field("num_hidden_layers"),
    "n_heads": Field("num_attention_heads"), "n_kv_heads": Field("num_key_value_heads", "num_attention_heads"),
    "d_ff": Field("intermediate_size"), "max_seq_len": Field("max_position_embeddings", default=2048),
    "norm_eps": Field("rms_norm_eps", default=1e-6), "tie_embeddings": Field("tie_word_embeddings", default=False),
    "init_std": Field("initializer_range", default=0.02),
}


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


def llama_tensors(prefix: str = "model.layers.{i}.", attn_norm: str = "input_layernorm",
                  mlp_norm: str = "post_attention_layernorm", **extra: Src) -> dict[str, Src]:
    """The Llama layout (q/k/v/o_proj, gate/up/down_proj, RMSNorms), with optional biases and QK-norms."""
    p = prefix
    names = {
        "tok_embed.weight": Src("model.embed_tokens.weight"), "ln_final.weight": Src("model.norm.weight"),
        "ln_final.bias": Src("model.norm.bias"), "unembed.weight": Src("lm_head.weight"),
        "blocks.{i}.attn_norm.weight": Src(p + attn_norm + ".weight"),
        "blocks.{i}.mlp_norm.weight": Src(p + mlp_norm + ".weight"),
        "blocks.{i}.attn.q_norm.weight": Src(p + "self_attn.q_norm.weight"),
        "blocks.{i}.attn.k_norm.weight": Src(p + "self_attn.k_norm.weight"),
        "blocks.{i}.mlp.w1.weight": Src(p + "mlp.gate_proj.weight"),
        "blocks.{i}.mlp.w3.weight": Src(p + "mlp.up_proj.weight"),
        "blocks.{i}.mlp.w2.weight": Src(p + "mlp.down_proj.weight"),
        "blocks.{i}.mlp.w1.bias": Src(p + "mlp.gate_proj.bias"),
        "blocks.{i}.mlp.w3.bias": Src(p + "mlp.up_proj.bias"),
        "blocks.{i}.mlp.w2.bias": Src(p + "mlp.down_proj.bias"),
    }
    for ours, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
        for kind in ("weight", "bias"):
            names[f"blocks.{{i}}.attn.w_{ours}.{kind}"] = Src(f"{p}self_attn.{hf}.{kind}")
    names.update(extra)
    return names


def _llama_options(r: Reader) -> dict[str, Any]:
    bias = bool(r.get("attention_bias", False))
    return {"qkv_bias": bias, "attn_out_bias": bias, "mlp_bias": bool(r.get("mlp_bias", False)),
            "mlp_act": activation(r, "hidden_act")}


def _head_dim(r: Reader) -> int:
    return r.get("head_dim", 0) or 0


PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}  # Phi3Config renames these types to longrope
NOT_BIDIRECTIONAL = Refuse("use_bidirectional_attention", truthy, "depthtools models are causal decoders")
GEMMA_SANDWICH = {"blocks.{i}.attn_out_norm.weight": Src("model.layers.{i}.post_attention_layernorm.weight"),
                  "blocks.{i}.mlp_out_norm.weight": Src("model.layers.{i}.post_feedforward_layernorm.weight")}


def _gemma_options(r: Reader, act_key: str) -> dict[str, Any]:
    bias = bool(r.get("attention_bias", False))
    return {"norm_gain": "one_plus", "embed_scale": float(r.read(LLAMA_SHAPE["d_model"])) ** 0.5,
            "qkv_bias": bias, "attn_out_bias": bias, "mlp_act": activation(r, act_key, "hidden_act",
                                                                            default="gelu_pytorch_tanh")}


def _gemma2_options(r: Reader) -> dict[str, Any]:
    return {**_gemma_options(r, "hidden_activation"), "out_norm": True,
            "attn_scale": float(r.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": float(r.hf.get("attn_logit_softcapping", 50.0) or 0.0),
            "final_softcap": float(r.hf.get("final_logit_softcapping", 30.0) or 0.0)}


def _gemma3_options(r: Reader) -> dict[str, Any]:
    return {**_gemma_options(r, "hidden_activation"), "out_norm": True, "qk_norm": "head",
            "attn_scale": float(r.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": float(r.get("attn_logit_softcapping", 0.0)),
            "final_softcap": float(r.get("final_logit_softcapping", 0.0))}


GEMMA_TENSORS = llama_tensors(mlp_norm="pre_feedforward_layernorm", **GEMMA_SANDWICH)

GPT2_LAYER = "transformer.h.{i}."
NEOX_LAYER = "gpt_neox.layers.{i}."

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", LLAMA_SHAPE, {"head_dim": _head_dim, "_": _llama_options, "_rope": rope}, llama_tensors()),
    Family("mistral", LLAMA_SHAPE, {"head_dim": _head_dim, "_": _llama_options, "_rope": rope}, llama_tensors(),
           windows=all_layers_window(4096)),
    Family("qwen2", LLAMA_SHAPE,
           {"qkv_bias": True, "head_dim": _head_dim, "mlp_act": lambda r: activation(r, "hidden_act"), "_rope": rope},
           llama_tensors(), windows=typed_layers_window(4096, _qwen_types, flag="use_sliding_window")),
    Family("qwen3", LLAMA_SHAPE,
           {"qk_norm": "head", "head_dim": lambda r: r.get("head_dim", 128), "_": _llama_options, "_rope": rope},
           llama_tensors(), windows=typed_layers_window(4096, _qwen_types, flag="use_sliding_window")),
    Family("gemma", _with(LLAMA_SHAPE, tie_embeddings=Field("tie_word_embeddings", default=True)),
           {"head_dim": lambda r: r.get("head_dim", 256), "_": lambda r: _gemma_options(r, "hidden_act"),
            "_rope": rope},
           llama_tensors(), refuse=(NOT_BIDIRECTIONAL,)),
    Family("gemma2", _with(LLAMA_SHAPE, tie_embeddings=Field("tie_word_embeddings", default=True)),
           {"head_dim": lambda r: r.get("head_dim", 256), "_": _gemma2_options, "_rope": rope},
           GEMMA_TENSORS, refuse=(NOT_BIDIRECTIONAL,), windows=typed_layers_window(4096, _every_other)),
    Family("gemma3_text", _with(LLAMA_SHAPE, tie_embeddings=Field("tie_word_embeddings", default=True)),
           {"head_dim": lambda r: r.get("head_dim", 256), "_": _gemma3_options,
            "_rope": lambda r: rope(r, default_theta=1e6, per_layer=True)},
           GEMMA_TENSORS, refuse=(NOT_BIDIRECTIONAL,), windows=typed_layers_window(4096, _gemma3_types)),
    Family("olmo", _with(LLAMA_SHAPE, norm_eps=Field(default=1e-5)),  # OlmoLayerNorm's eps is fixed
           {"norm": "layer", "norm_gain": "none", "qkv_clip": lambda r: float(r.get("clip_qkv", 0.0)),
            "_": _llama_options, "_rope": rope},
           llama_tensors()),
    Family("olmo2", _with(LLAMA_SHAPE, norm_eps=Field("rms_norm_eps", default=1e-5)),
           {"pre_norm": False, "out_norm": True, "qk_norm": "full", "_": _llama_options, "_rope": rope},
           llama_tensors(**{"blocks.{i}.attn_out_norm.weight": Src("model.layers.{i}.post_attention_layernorm.weight"),
                            "blocks.{i}.mlp_out_norm.weight": Src("model.layers.{i}.post_feedforward_layernorm.weight")})),
    Family("gpt2",
           {"vocab_size": Field("vocab_size"), "d_model": Field("n_embd", "hidden_size"),
            "n_layer": Field("n_layer", "num_hidden_layers"), "n_heads": Field("n_head", "num_attention_heads"),
            "n_kv_heads": Field("n_head", "num_attention_heads"),
            "d_ff": Field("n_inner", default=lambda r: 4 * r.read(Field("n_embd", "hidden_size"))),
            "max_seq_len": Field("n_positions", "max_position_embeddings", default=1024),
            "norm_eps": Field("layer_norm_epsilon", default=1e-5), "tie_embeddings": Field("tie_word_embeddings", default=True),
            "init_std": Field("initializer_range", default=0.02)},
           {"positions": "learned", "norm": "layer", "norm_bias": True, "mlp": "plain", "qkv_bias": True,
            "attn_out_bias": True, "mlp_bias": True,
            "mlp_act": lambda r: activation(r, "activation_function", default="gelu_new")},
           {"tok_embed.weight": Src("transformer.wte.weight"), "pos_embed.weight": Src("transformer.wpe.weight"),
            "ln_final.weight": Src("transformer.ln_f.weight"), "ln_final.bias": Src("transformer.ln_f.bias"),
            "unembed.weight": Src("lm_head.weight"),
            **{f"blocks.{{i}}.{ours}_norm.{kind}": Src(f"{GPT2_LAYER}{hf}.{kind}")
               for ours, hf in (("attn", "ln_1"), ("mlp", "ln_2")) for kind in ("weight", "bias")},
            **{f"blocks.{{i}}.attn.w_{ours}.{kind}": Src(f"{GPT2_LAYER}attn.c_attn.{kind}", kind == "weight", "qkv", n)
               for n, ours in enumerate("qkv") for kind in ("weight", "bias")},
            "blocks.{i}.attn.w_o.weight": Src(GPT2_LAYER + "attn.c_proj.weight", transpose=True),
            "blocks.{i}.attn.w_o.bias": Src(GPT2_LAYER + "attn.c_proj.bias"),
            "blocks.{i}.mlp.w1.weight": Src(GPT2_LAYER + "mlp.c_fc.weight", transpose=True),
            "blocks.{i}.mlp.w1.bias": Src(GPT2_LAYER + "mlp.c_fc.bias"),
            "blocks.{i}.mlp.w2.weight": Src(GPT2_LAYER + "mlp.c_proj.weight", transpose=True),
            "blocks.{i}.mlp.w2.bias": Src(GPT2_LAYER + "mlp.c_proj.bias")},
           refuse=(Refuse("scale_attn_by_inverse_layer_idx", truthy, "depthtools scales scores by head_dim^-1/2 only"),
                   Refuse("scale_attn_weights", lambda v: v is False, "depthtools always scales attention scores"),
                   Refuse("add_cross_attention", truthy, "a decoder-only model has no cross-attention")),
           ignored=(".attn.bias", ".attn.masked_bias")),  # old checkpoints' causal-mask buffers
    Family("gpt_neox",
           _with(LLAMA_SHAPE, norm_eps=Field("layer_norm_eps", default=1e-5),
                 n_kv_heads=Field("num_attention_heads")),
           {"norm": "layer", "norm_bias": True, "mlp": "plain", "mlp_bias": True,
            "parallel": lambda r: bool(r.get("use_parallel_residual", True)),
            "qkv_bias": lambda r: bool(r.get("attention_bias", True)),
            "attn_out_bias": lambda r: bool(r.get("attention_bias", True)),
            "mlp_act": lambda r: activation(r, "hidden_act", default="gelu"),
            "_rope": lambda r: rope(r, legacy_theta="rotary_emb_base", legacy_fraction=("rotary_pct", 0.25))},
           {"tok_embed.weight": Src("gpt_neox.embed_in.weight"),
            "ln_final.weight": Src("gpt_neox.final_layer_norm.weight"),
            "ln_final.bias": Src("gpt_neox.final_layer_norm.bias"), "unembed.weight": Src("embed_out.weight"),
            **{f"blocks.{{i}}.{ours}_norm.{kind}": Src(f"{NEOX_LAYER}{hf}.{kind}")
               for ours, hf in (("attn", "input_layernorm"), ("mlp", "post_attention_layernorm"))
               for kind in ("weight", "bias")},
            **{f"blocks.{{i}}.attn.w_{ours}.{kind}": Src(f"{NEOX_LAYER}attention.query_key_value.{kind}", False,
                                                         "neox_qkv", n)
               for n, ours in enumerate("qkv") for kind in ("weight", "bias")},
            **{f"blocks.{{i}}.attn.w_o.{kind}": Src(f"{NEOX_LAYER}attention.dense.{kind}") for kind in ("weight", "bias")},
            **{f"blocks.{{i}}.mlp.{ours}.{kind}": Src(f"{NEOX_LAYER}mlp.{hf}.{kind}")
               for ours, hf in (("w1", "dense_h_to_4h"), ("w2", "dense_4h_to_h")) for kind in ("weight", "bias")}},
           ignored=("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")),
    Family("phi3", _with(LLAMA_SHAPE, norm_eps=Field("rms_norm_eps", default=1e-5)),
           {"head_dim": _head_dim, "mlp_act": lambda r: activation(r, "hidden_act"),
            "_rope": lambda r: rope(r, aliases=PHI3_ROPE_ALIASES, original_default=4096)},
           llama_tensors(**{f"blocks.{{i}}.attn.w_{ours}.weight": Src("model.layers.{i}.self_attn.qkv_proj.weight",
                                                                      split="qkv", part=n)
                            for n, ours in enumerate("qkv")},
                         **{f"blocks.{{i}}.mlp.{ours}.weight": Src("model.layers.{i}.mlp.gate_up_proj.weight",
                                                                   split="halves", part=n)
                            for n, ours in enumerate(("w1", "w3"))}),
           windows=all_layers_window(None)),
    Family("phi", _with(LLAMA_SHAPE, norm_eps=Field("layer_norm_eps", default=1e-5)),
           {"norm": "layer", "norm_bias": True, "parallel": True, "mlp": "plain", "mlp_bias": True,
            "qkv_bias": True, "attn_out_bias": True, "head_bias": True,
            "qk_norm": lambda r: "head" if r.get("qk_layernorm", False) else "none",
            "mlp_act": lambda r: activation(r, "hidden_act", default="gelu_new"),
            "_rope": lambda r: rope(r, legacy_fraction=("partial_rotary_factor", 0.5))},
           PHI_TENSORS),
    Family("mixtral", _with(LLAMA_SHAPE, norm_eps=Field("rms_norm_eps", default=1e-5),
                            max_seq_len=Field("max_position_embeddings", default=4096 * 32)),
           {"head_dim": _head_dim, "mlp_act": lambda r: activation(r, "hidden_act"),
            "_moe": moe(Field("num_local_experts", default=8), 2, True),
            "_rope": lambda r: rope(r, default_theta=1e6)},
           _with(llama_tensors(), **moe_tensors("model.layers.{i}.block_sparse_moe.", "gate.weight", "w1", "w3", "w2")),
           refuse=MOE_REFUSALS, windows=all_layers_window(None), experts_key="num_local_experts"),
    Family("qwen2_moe", _with(LLAMA_SHAPE, max_seq_len=Field("max_position_embeddings", default=32768)),
           {"head_dim": _head_dim, "qkv_bias": lambda r: bool(r.get("qkv_bias", True)),
            "mlp_act": lambda r: activation(r, "hidden_act"),
            "_moe": moe(Field("num_experts", "num_local_experts", default=60), 4, None,
                        Field("moe_intermediate_size", default=1408),
                        Field("shared_expert_intermediate_size", default=5632), per_layer=True),
            "_rope": rope},
           _with(llama_tensors(), **moe_tensors("model.layers.{i}.mlp.", "gate.weight", "gate_proj", "up_proj",
                                                "down_proj"),
                 **{f"blocks.{{i}}.mlp.shared.{ours}.weight": Src(f"model.layers.{{i}}.mlp.shared_expert.{hf}.weight")
                    for ours, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
                 **{"blocks.{i}.mlp.shared_gate.weight": Src("model.layers.{i}.mlp.shared_expert_gate.weight")}),
           refuse=MOE_REFUSALS, windows=typed_layers_window(4096, _qwen2_moe_types, flag="use_sliding_window"),
           experts_key="num_experts"),
    Family("qwen3_moe", _with(LLAMA_SHAPE, max_seq_len=Field("max_position_embeddings", default=32768)),
           {"head_dim": _head_dim, "qk_norm": "head", "_": _llama_options,
            "_moe": moe(Field("num_experts", "num_local_experts", default=128), 8, None,
                        Field("moe_intermediate_size", default=768), per_layer=True),
            "_rope": rope},
           _with(llama_tensors(), **moe_tensors("model.layers.{i}.mlp.", "gate.weight", "gate_proj", "up_proj",
                                                "down_proj")),
           refuse=MOE_REFUSALS, windows=_flagged_all_layers_window, experts_key="num_experts"),
    Family("olmoe", _with(LLAMA_SHAPE, norm_eps=Field("rms_norm_eps", default=1e-5),
                          max_seq_len=Field("max_position_embeddings", default=4096)),
           {"qk_norm": "full", "qkv_clip": lambda r: float(r.get("clip_qkv", 0.0)), "_": _llama_options,
            "clip_after_norm": lambda r: bool(r.get("clip_qkv")),  # OLMoE clamps the normed q, k
            "_moe": moe(Field("num_experts", "num_local_experts", default=64), 8, None),
            "_rope": rope},
           _with(llama_tensors(), **moe_tensors("model.layers.{i}.mlp.", "gate.weight", "gate_proj", "up_proj",
                                                "down_proj")),
           refuse=MOE_REFUSALS, experts_key="num_experts"),
)}
# gpt_neox names its head embed_out in old checkpoints and lm_head in transformers 5 (see `hf_state`)
ALIASES = {"embed_out.weight": ("lm_head.weight",)}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
GENERIC_REFUSALS = (
    Refuse("quantization_config", truthy, "quantized weights are not supported; use an unquantized checkpoint"),
    Refuse("is_encoder_decoder", truthy, "depthtools models are decoder-only"),
)


# -- config -> ModelConfig ---------------------------------------------------------------------------
def family_of(hf: dict[str, Any]) -> Family:
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise refusal("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return FAMILIES[model_type]


# Options a family reader always sets that are left out of the config at their default (the Pre-LN schema's,
# `depthtools.arch.backbone.OPTIONS`), so a family that does not use them gives the config plain Llama gives.
OMIT_AT_DEFAULT = ("qkv_bias", "attn_out_bias", "mlp_bias", "mlp_act", "qkv_clip", "clip_after_norm", "attn_softcap",
                   "final_softcap", "rotary_fraction", "rope_theta_sliding")


def hf_to_model_config(hf: dict[str, Any], max_seq_len: int | None = None) -> ModelConfig:
    """The `preln` ModelConfig equivalent to a supported family's `config.json`, or a one-line refusal."""
    family = family_of(hf)
    check_config(hf, family.model_type)  # types and ranges first: nothing below computes with a bad value
    r = Reader(hf, family)
    for check in (*GENERIC_REFUSALS, *family.refuse):
        value = hf.get(check.key)
        if check.bad(value):
            shown = value.get("quant_method", value) if isinstance(value, dict) else value
            raise refusal(check.key, shown, check.why)
    shape = {name: r.read(spec) for name, spec in family.shape.items()}
    for name in ("vocab_size", "d_model", "n_layer", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
        if isinstance(shape[name], bool) or not isinstance(shape[name], int):
            key = family.shape[name].keys[0]
            raise DepthToolsError(f"Hugging Face config has no integer {key} (got {shape[name]!r})")
    if shape["n_heads"] % shape["n_kv_heads"]:
        raise refusal("num_key_value_heads", shape["n_kv_heads"], f"must divide num_attention_heads={shape['n_heads']}")
    options: dict[str, Any] = {"family": family.model_type}
    for name, value in family.options.items():
        value = value(r) if callable(value) else value
        if name.startswith("_"):  # a reader of several values
            options.update(value)
        else:
            options[name] = value
    shape["rope_theta"] = options.pop("rope_theta", 10000.0)
    head_dim, d, heads = options.pop("head_dim", 0), shape["d_model"], shape["n_heads"]
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 0:
        raise refusal("head_dim", head_dim, "expected a positive integer")
    if head_dim and (d % heads or head_dim != d // heads):
        options["head_dim"] = head_dim
    elif d % heads:
        raise refusal("hidden_size", shape["d_model"], f"not divisible by num_attention_heads={shape['n_heads']}")
    if max_seq_len is not None:
        shape["max_seq_len"] = int(max_seq_len)
    _set_windows(family, r, shape["n_layer"], options)
    options = {k: v for k, v in options.items() if not (k in OMIT_AT_DEFAULT and v == getattr(BACKBONE_DEFAULTS, k))}
    plain_theta_sliding = options.get("rope_theta_sliding") == shape["rope_theta"] and "rope_type" not in options
    if plain_theta_sliding or not options.get("sliding_window"):
        options.pop("rope_theta_sliding", None)
    if options == {"family": "llama"}:  # a plain Llama is `preln` itself (an export re-imports to the same config)
        options = {}
    try:
        return ModelConfig(arch="preln", options=options, **shape)
    except DepthToolsError as exc:
        raise DepthToolsError(f"Hugging Face config cannot be expressed as a depthtools model: {exc}") from None


def _set_windows(family: Family, r: Reader, n_layer: int, options: dict[str, Any]) -> None:
    """sliding_window / layer_types options from the family's per-layer windows (all equal where set)."""
    if family.windows is None:
        return
    windows = family.windows(r, n_layer)
    sizes = sorted({w for w in windows if w})
    if not sizes:
        return
    if len(sizes) > 1:
        raise refusal("sliding_window", sizes, "one window size per model is supported")
    options["sliding_window"] = sizes[0]
    if not all(windows):
        options["layer_types"] = "".join("s" if w else "f" for w in windows)


# -- a tied config whose file holds its own head -------------------------------------------------------------
def head_from_file(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> ModelConfig:
    """`cfg` untied when it says tie_word_embeddings but the weights hold a head that differs from the embedding.

    transformers 5.x ties only a head the file lacks: `from_pretrained` of a tied config whose file holds a
    different lm_head.weight keeps the file's head (checked for every family with 5.25: tests/test_families.py
    builds each model, saves a different head and loads it). A head equal to the embedding stays tied (the
    same function either way)."""
    if not cfg.tie_embeddings:
        return cfg
    family = FAMILIES[cfg.options.get("family") or "llama"]
    head_name = family.tensors["unembed.weight"].name
    head = next((tensors[n] for n in (head_name, *ALIASES.get(head_name, ())) if n in tensors), None)
    embed = tensors.get(family.tensors["tok_embed.weight"].name)
    if head is None or (embed is not None and head.shape == embed.shape and head.dtype == embed.dtype
                        and torch.equal(head, embed)):
        return cfg
    return cfg.replace(tie_embeddings=False)


def untied_note(hf: dict[str, Any]) -> str:
    """The one line an import prints when `head_from_file` untied the config."""
    return (f"config.json says tie_word_embeddings but the weights hold a different output head: imported "
            f"untied, with the file's head, as transformers 5.x loads a {hf.get('model_type')} folder")


# -- tensors -------------------------------------------------------------------------------------------
def _split(tensor: torch.Tensor, src: Src, cfg: ModelConfig, where: str) -> torch.Tensor:
    """The `src.part`-th piece of a fused tensor (rows; a bias splits the same way)."""
    hd, H, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    if src.split == "qkv":
        sizes = [H * hd, Hkv * hd, Hkv * hd]
    elif src.split == "halves":
        sizes = [cfg.d_ff, cfg.d_ff]
    elif src.split == "neox_qkv":  # rows [head][q|k|v][hd]
        if tensor.shape[0] != 3 * H * hd:
            raise DepthToolsError(f"{where} has shape {tuple(tensor.shape)}, config implies {3 * H * hd} rows")
        return tensor.reshape(H, 3, hd, *tensor.shape[1:])[:, src.part].reshape(H * hd, *tensor.shape[1:])
    else:
        raise DepthToolsError(f"unknown split {src.split!r}")
    if tensor.shape[0] != sum(sizes):
        raise DepthToolsError(f"{where} has shape {tuple(tensor.shape)}, config implies {sum(sizes)} rows "
                              f"({' + '.join(map(str, sizes))})")
    start = sum(sizes[: src.part])
    return tensor[start: start + sizes[src.part]]


def _template(ours: str) -> tuple[str, dict[str, str]]:
    """Our name as its map's key ("blocks.{i}.", and an expert's "experts.{e}.") and the values to fill in."""
    parts, fill = ours.split("."), {}
    if parts[0] == "blocks":
        fill["i"], parts[1] = parts[1], "{i}"
        if len(parts) > 4 and parts[3] == "experts":
            fill["e"], parts[4] = parts[4], "{e}"
    return ".".join(parts), fill


def _check_expert_count(tensors: dict[str, torch.Tensor], cfg: ModelConfig, family: Family) -> None:
    """An MoE family's weights hold as many experts per layer as config.json says (one line naming both)."""
    experts = backbone(cfg).moe_experts
    src = family.tensors.get("blocks.{i}.mlp.experts.{e}.w1.weight")
    if not experts or src is None:
        return
    head, tail = src.name.split("{e}")
    for layer in range(cfg.n_layer):
        prefix, suffix = head.format(i=layer), tail.format(i=layer)
        found = {k[len(prefix):-len(suffix)] for k in tensors if k.startswith(prefix) and k.endswith(suffix)}
        if found and len(found) != experts:
            raise DepthToolsError(f"Hugging Face weights hold {len(found)} experts in layer {layer} "
                                  f"({prefix}*{suffix}), config.json's {family.experts_key} says {experts}")


def _source(family: Family, ours: str, names: Collection[str]) -> tuple[Src, str]:
    """Where our tensor `ours` comes from: its `Src` and the HF name (an alias of it where only that is present)."""
    template, fill = _template(ours)
    src = family.tensors.get(template)
    if src is None:
        raise DepthToolsError(f"internal: the {family.model_type} map has no source for {ours}")
    name = src.name.format(**fill)
    if name not in names:
        name = next((alias for alias in ALIASES.get(name, ()) if alias in names), name)
    return src, name


def _converted(tensor: torch.Tensor, src: Src, cfg: ModelConfig, name: str, ours: str,
               shape: tuple[int, ...]) -> torch.Tensor:
    """HF tensor `name` as our `ours` (transposed / the part of a fused tensor, per `src`), refused unless it has
    the `shape` the config implies and a floating-point dtype. Works on `meta` tensors too (checks from headers)."""
    original = tuple(tensor.shape)
    if src.transpose and tensor.dim() == 2:
        tensor = tensor.t()
    if src.split:
        tensor = _split(tensor, src, cfg, name)
    if tuple(tensor.shape) != tuple(shape):
        raise DepthToolsError(f"Hugging Face tensor {name} has shape {original}, "
                              f"the config implies {tuple(shape)} for {ours}")
    if not tensor.dtype.is_floating_point:
        raise DepthToolsError(f"Hugging Face tensor {name} has dtype {str(tensor.dtype).replace('torch.', '')}, "
                              "expected a floating-point dtype")
    return tensor


def _check_finite(tensor: torch.Tensor, name: str) -> None:
    """Refuse a tensor with NaN/inf entries (the model would be unusable), naming the HF tensor."""
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise DepthToolsError(f"Hugging Face tensor {name} has {bad} non-finite (NaN/inf) value(s) of "
                              f"{tensor.numel()}; the model is unusable")


def _check_accounted(family: Family, cfg: ModelConfig, names: Collection[str], used: set[str],
                     missing: list[str]) -> None:
    """Every expected tensor found and every HF tensor used (or a tied head, or a known buffer): else one line."""
    tied_head = {"lm_head.weight", "embed_out.weight"} if cfg.tie_embeddings else set()
    unexpected = sorted(k for k in names if k not in used and k not in tied_head and not k.endswith(family.ignored))
    if missing or unexpected:
        raise DepthToolsError(
            f"Hugging Face weights do not match a {family.model_type} of this config: missing {sorted(set(missing))[:3]}"
            f"{'...' if len(set(missing)) > 3 else ''}, unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}")


def hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig, expected: dict[str, tuple[int, ...]],
             dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our state dict (names and shapes `expected`) from a family's HF tensors, cast to `dtype`; every HF
    tensor must be used (or be a known buffer), every expected one found, with the implied shape."""
    state: dict[str, torch.Tensor] = {}
    for ours, shape, src, name in _mapped(tensors, cfg, expected):
        tensor = _converted(tensors[name], src, cfg, name, ours, shape)
        _check_finite(tensor, name)
        state[ours] = tensor.to(dtype).contiguous()
    return state


def _mapped(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig,
            expected: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, tuple[int, ...], Src, str]]:
    """(our name, its shape, its `Src`, the HF name) of every expected tensor the HF tensors hold, in `expected`'s
    order, after the expert-count check; once all are given, the refusal of a missing or unused HF tensor
    (`_check_accounted`). The one walk `hf_state` (converting each as it comes) and `hf_state_plan` share."""
    family = FAMILIES[cfg.options.get("family") or "llama"]
    _check_expert_count(tensors, cfg, family)
    used: set[str] = set()
    missing: list[str] = []
    for ours, shape in expected.items():
        src, name = _source(family, ours, tensors)
        if name not in tensors:
            missing.append(name)
            continue
        used.add(name)
        yield ours, shape, src, name
    _check_accounted(family, cfg, tensors, used, missing)


# -- the same, one tensor at a time (an import larger than memory) -----------------------------------------
@dataclass(frozen=True)
class Step:
    """One tensor of a streamed import: our name and shape, and the HF tensor (and its `Src`) it comes from."""

    ours: str
    shape: tuple[int, ...]
    src: Src
    name: str


def hf_state_plan(headers: Mapping[str, torch.Tensor], cfg: ModelConfig,
                  expected: dict[str, tuple[int, ...]]) -> list[Step]:
    """The steps of `hf_state_stream`, checked from the HF tensors' headers alone (`headers`: name -> a `meta`
    tensor of the file's shape and dtype): every refusal of `hf_state` but NaN/inf values (a missing, unexpected,
    misshapen or integer tensor; an expert count that disagrees), made before any tensor is read."""
    steps: list[Step] = []
    for ours, shape, src, name in _mapped(headers, cfg, expected):
        _converted(headers[name], src, cfg, name, ours, shape)
        steps.append(Step(ours, tuple(shape), src, name))
    return steps


def hf_state_stream(steps: list[Step], read: Callable[[str], torch.Tensor],
                    cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """`hf_state`'s tensors one at a time, in `steps` order (`hf_state_plan`), in the source's dtype: the same
    names and values (`hf_state`'s cast of each is the cast of each of these). `read(name)` gives one HF tensor;
    one that feeds several of ours (a fused Phi-3 qkv, GPT-2 c_attn or NeoX qkv; Phi's shared input norm) is read
    once and held only until its last use, so memory stays at about one tensor. Each yielded tensor owns its
    storage (one of several from the same HF tensor is a copy): a shard writer may hold several, and safetensors
    refuses to save tensors that share memory."""
    uses = Counter(step.name for step in steps)
    left = Counter(uses)
    held: dict[str, torch.Tensor] = {}
    for step in steps:
        source = held.pop(step.name) if step.name in held else read(step.name)
        left[step.name] -= 1
        if left[step.name]:
            held[step.name] = source
        tensor = _converted(source, step.src, cfg, step.name, step.ours, step.shape)
        _check_finite(tensor, step.name)
        yield step.ours, (tensor.clone(memory_format=torch.contiguous_format) if uses[step.name] > 1
                          else tensor.contiguous())


__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "Field", "Src", "Refuse", "hf_to_model_config",
           "hf_state", "hf_state_plan", "hf_state_stream", "Step", "family_of", "refusal", "head_from_file",
           "untied_note"]
