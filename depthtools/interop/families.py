"""The open decoder families as data: config.json fields -> Pre-LN options, HF tensor names -> ours.

Every family (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, olmo, olmo2, gpt2, gpt_neox, phi3)
becomes one `preln` DepthModel whose typed options (`depthtools.arch.backbone`) express it; there is no
per-family forward code. A `Family` says:

* `shape`: ModelConfig's fields from config.json keys, with transformers' own config-class defaults
  (tests/test_families.py checks each default against the installed config class);
* `options`: Pre-LN options, constants or functions of the config (`Reader`);
* `refuse`: config values our block cannot express, each refused in one line naming the field and value;
* `tensors`: our parameter name -> `Src` (HF name, with "{i}" the layer; a transpose for GPT-2's Conv1D;
  a split of a fused tensor: Phi-3's qkv and gate_up, GPT-2's c_attn, NeoX's per-head interleaved qkv).

What transformers does, read from its 5.x sources (modeling_<family>.py), is the reference: e.g. which
config keys a family's forward actually reads (Llama ignores `sliding_window`; Mistral applies it even
with `use_sliding_window: false`; Qwen2/3 only with it), Gemma's (1+w) norms and √d embedding scale,
OLMo's non-parametric LayerNorm with its fixed eps 1e-5.

Importing is `hf_to_model_config` (config -> ModelConfig, or a refusal) and `hf_state` (HF tensors ->
our state dict, every tensor accounted for: a missing or unexpected tensor, or a shape that disagrees
with the config, is one line naming it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError
from depthtools.interop.schema import check_config

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


def _plain_rope(params: Any, where: str) -> dict[str, Any]:
    """A rope-parameters dict checked to be plain RoPE (rope_type default), or a refusal naming `where`."""
    if not isinstance(params, dict):
        raise refusal(where, params, "expected a dict or null")
    kind = params.get("rope_type", params.get("type"))
    if kind not in DEFAULT_ROPE_TYPES:
        raise refusal(f"{where}.rope_type", kind, "depthtools implements plain RoPE only (rope_type 'default')")
    return params


def rope(r: Reader, default_theta: float = 10000.0, legacy_theta: str = "rope_theta",
         legacy_fraction: tuple[str, float] | None = None, per_layer: bool = False) -> dict[str, float]:
    """{"rope_theta", "rotary_fraction", "rope_theta_sliding"} from v5 `rope_parameters` (flat, or keyed by
    layer type where `per_layer`) or v4 `rope_theta`/`rope_scaling` (and legacy keys); scaled RoPE is refused."""
    params = r.hf.get("rope_parameters")
    scaling = r.hf.get("rope_scaling")
    out: dict[str, float] = {}
    keyed = isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values())
    if keyed:
        if not per_layer:
            raise refusal("rope_parameters", sorted(params), f"per-layer-type RoPE is not a {r.family.model_type} feature")
        unknown = sorted(set(params) - set(LAYER_TYPE_KEYS))
        if unknown:
            raise refusal("rope_parameters", unknown, f"layer types known: {', '.join(LAYER_TYPE_KEYS)}")
        full = _plain_rope(params.get("full_attention", {}), "rope_parameters.full_attention")
        local = _plain_rope(params.get("sliding_attention", {}), "rope_parameters.sliding_attention")
        out["rope_theta"] = float(full.get("rope_theta", default_theta))
        out["rope_theta_sliding"] = float(local.get("rope_theta", 10000.0))
        fraction = 1.0
    else:
        flat = _plain_rope(params or {}, "rope_parameters")
        if scaling is not None:
            _plain_rope(scaling, "rope_scaling")
        out["rope_theta"] = float(flat.get("rope_theta", r.get(legacy_theta, default_theta)))
        fraction = flat.get("partial_rotary_factor", r.hf.get("partial_rotary_factor"))
        if fraction is None and legacy_fraction is not None:
            fraction = r.get(legacy_fraction[0], legacy_fraction[1])
        fraction = 1.0 if fraction is None else fraction
        if per_layer:  # v4 Gemma-3: rope_local_base_freq
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
        window = _window_value(r, "sliding_window", default_window)
        if flag is not None and not r.get(flag, False):
            window = None
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


def _every_other(r: Reader, n_layer: int) -> list[str]:  # Gemma-2: even layers slide
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layer)]


def _gemma3_types(r: Reader, n_layer: int) -> list[str]:  # Gemma-3: every sliding_window_pattern-th layer is full
    pattern = r.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]


def truthy(value: Any) -> bool:
    return bool(value)


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
           {"head_dim": _head_dim, "mlp_act": lambda r: activation(r, "hidden_act"), "_rope": rope},
           llama_tensors(**{f"blocks.{{i}}.attn.w_{ours}.weight": Src("model.layers.{i}.self_attn.qkv_proj.weight",
                                                                      split="qkv", part=n)
                            for n, ours in enumerate("qkv")},
                         **{f"blocks.{{i}}.mlp.{ours}.weight": Src("model.layers.{i}.mlp.gate_up_proj.weight",
                                                                   split="halves", part=n)
                            for n, ours in enumerate(("w1", "w3"))}),
           windows=all_layers_window(None)),
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
    defaults = {"qkv_bias": False, "attn_out_bias": False, "mlp_bias": False, "mlp_act": "silu", "qkv_clip": 0.0,
                "attn_softcap": 0.0, "final_softcap": 0.0, "rotary_fraction": 1.0, "rope_theta_sliding": 0.0}
    options = {k: v for k, v in options.items() if not (k in defaults and v == defaults[k])}
    if options.get("rope_theta_sliding") == shape["rope_theta"] or not options.get("sliding_window"):
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


def hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig, expected: dict[str, tuple[int, ...]],
             dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our state dict (names and shapes `expected`) from a family's HF tensors, cast to `dtype`; every HF
    tensor must be used (or be a known buffer), every expected one found, with the implied shape."""
    family = FAMILIES[cfg.options.get("family") or "llama"]
    used: set[str] = set()
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for ours, shape in expected.items():
        layer = ours.split(".")[1] if ours.startswith("blocks.") else None
        template = ours if layer is None else ours.replace(f"blocks.{layer}.", "blocks.{i}.", 1)
        src = family.tensors.get(template)
        if src is None:
            raise DepthToolsError(f"internal: the {family.model_type} map has no source for {ours}")
        name = src.name.format(i=layer)
        if name not in tensors:
            name = next((alias for alias in ALIASES.get(name, ()) if alias in tensors), name)
        if name not in tensors:
            missing.append(name)
            continue
        used.add(name)
        tensor = tensors[name]
        if src.transpose and tensor.dim() == 2:
            tensor = tensor.t()
        if src.split:
            tensor = _split(tensor, src, cfg, name)
        if tuple(tensor.shape) != tuple(shape):
            raise DepthToolsError(f"Hugging Face tensor {name} has shape {tuple(tensors[name].shape)}, "
                                  f"the config implies {tuple(shape)} for {ours}")
        if not tensor.dtype.is_floating_point:
            raise DepthToolsError(f"Hugging Face tensor {name} has dtype {str(tensor.dtype).replace('torch.', '')}, "
                                  "expected a floating-point dtype")
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise DepthToolsError(f"Hugging Face tensor {name} has {bad} non-finite (NaN/inf) value(s) of "
                                  f"{tensor.numel()}; the model is unusable")
        state[ours] = tensor.to(dtype).contiguous()
    tied_head = {"lm_head.weight", "embed_out.weight"} if cfg.tie_embeddings else set()
    unexpected = sorted(k for k in tensors if k not in used and k not in tied_head and not k.endswith(family.ignored))
    if missing or unexpected:
        raise DepthToolsError(
            f"Hugging Face weights do not match a {family.model_type} of this config: missing {sorted(set(missing))[:3]}"
            f"{'...' if len(set(missing)) > 3 else ''}, unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}")
    return state


__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "Field", "Src", "Refuse", "hf_to_model_config",
           "hf_state", "family_of", "refusal", "head_from_file", "untied_note"]
