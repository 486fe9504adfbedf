"""The config.json schema of each imported family: type, range and allowed values of every key its map reads.

`check_config(hf, model_type)` runs before anything is computed from the values, so a hostile config.json is
one line naming the key and what would be valid, never a traceback or a silently wrong model: `"false"` is
not false (a non-empty string is truthy), `"1"` is not a token id, 0 heads would divide by zero,
`query_pre_attn_scalar: -4` would give a complex scale.

The rows mirror transformers 5.x's config classes (`@strict` dataclasses: the `bool`/`int`/`float`/`str`
annotation of each field; tests/test_config_schema.py compares every row with the installed class), with
two deliberate differences: a whole number is accepted where a float is annotated (JSON has one number
type: `"rms_norm_eps": 1` means 1.0), and ranges the classes leave unchecked but the model needs (at least
one head, a positive eps and `query_pre_attn_scalar`, a softcap that is positive or null) are
checked. Legacy v4 keys the families still read (`rope_theta`, `rotary_emb_base`, `rotary_pct`,
`rope_local_base_freq`, `sliding_window_pattern`) have rows too. `null` counts as absent everywhere (the
families then apply transformers' default), as `families.Reader` reads it.

The RoPE dicts (`rope_parameters`, flat or one per layer type, and v4 `rope_scaling`) have their sub-keys
checked by `ROPE_KEYS`, whatever the dict's rope_type: transformers' `RopeParameters` gives each key one type
for every RoPE type (tests/test_config_schema.py compares them), and the ranges are what the scaled-RoPE
formulas need (`depthtools.arch.rope`): a positive factor, attention factor and beta_fast/beta_slow, a
pretraining context of at least 1, non-negative mscale/mscale_all_dim (a negative one can make yarn's
attention-factor quotient divide by zero), lists of positive numbers for longrope. An unknown rope_type, a
required key missing and the cross-key rules (llama3's high_freq_factor > low_freq_factor, a longrope list's
length) stay with `families.rope` and the backbone, one refusal each.

The mixture-of-experts families (mixtral, qwen2_moe, qwen3_moe, olmoe) add their routing keys (`MOE`):
expert counts and top-k of at least 1, widths, `norm_topk_prob`, Qwen-MoE's `decoder_sparse_step` and
`mlp_only_layers`, and the keys of other MoE designs that `families.MOE_REFUSALS` reads to refuse.

A new family adds one row to `SCHEMAS` (usually `{**LLAMA, <its own keys>}`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from depthtools.errors import DepthToolsError

SHOWN = 60  # characters of a bad value quoted in a refusal


@dataclass(frozen=True)
class Check:
    """One key's rule: `kind` (bool, int, number, str, id, ids, ints, numbers, strs, dict, rope), an optional
    range [low, high] (`open_low`: low itself excluded; of each item of ints/numbers) and allowed values (of a
    str, or of each item of strs)."""

    kind: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    allowed: tuple[str, ...] = ()

    def expected(self) -> str:
        """What a valid value looks like, in words."""
        base = {"bool": "a JSON boolean, true or false", "int": "an integer", "number": "a number",
                "str": "a string", "id": "an integer token id", "ids": "an integer token id or a list of them",
                "strs": "a list of strings", "dict": "an object (dict)", "rope": "an object (dict)",
                "ints": "a list of integers", "numbers": "a list of numbers"}[self.kind]
        if self.kind in ("ints", "numbers") and self.low is not None:
            base += ", each"
        if self.low is not None and self.high is not None:
            base += f" in {'(' if self.open_low else '['}{_num(self.low)}, {_num(self.high)}]"
        elif self.low is not None:
            base += f" {'>' if self.open_low else '>='} {_num(self.low)}"
        if self.allowed:
            base += f" from {', '.join(self.allowed)}"
        return base

    def ok(self, value: Any) -> bool:
        """Whether `value` (not None) satisfies the rule; `rope` checks only that it is a dict (see `_rope`)."""
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind in ("str", "strs"):
            items = [value] if self.kind == "str" else value
            return isinstance(items, list) and all(isinstance(v, str) and (not self.allowed or v in self.allowed)
                                                   for v in items)
        if self.kind in ("dict", "rope"):
            return isinstance(value, dict)
        if self.kind == "ids":
            values = value if isinstance(value, list) else [value]
            return all(_is_int(v) for v in values)
        if self.kind in ("ints", "numbers"):
            item = _is_int if self.kind == "ints" else _is_number
            return isinstance(value, list) and all(item(v) and self._in_range(v) for v in value)
        if self.kind in ("int", "id"):
            return _is_int(value) and self._in_range(value)
        return _is_number(value) and self._in_range(value)

    def _in_range(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.open_low and value == self.low)):
            return False
        return self.high is None or value <= self.high


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def invalid(key: str, value: Any, expected: str) -> DepthToolsError:
    """The one-line refusal of a config.json value of the wrong type or range."""
    return DepthToolsError(f"invalid Hugging Face config: {key}={_shown(value)} (expected {expected})")


# -- the rules ---------------------------------------------------------------------------------------------------
BOOL = Check("bool")
STR = Check("str")
SIZE = Check("int", low=1)  # a count or a dimension
# A sanity bound, not transformers' (the largest published decoders have < 200 layers): a config saying 10**9
# layers would have per-layer lists and a 10**9-block model built before the weights could contradict it.
LAYERS = Check("int", low=1, high=10_000)
COUNT0 = Check("int", low=0)
POSITIVE = Check("number", low=0, open_low=True)
NONNEGATIVE = Check("number", low=0)
FRACTION = Check("number", low=0, high=1, open_low=True)
ID, IDS = Check("id"), Check("ids")
ROPE = Check("rope")
LAYER_TYPES = Check("strs", allowed=("full_attention", "sliding_attention"))
# rope_parameters (flat, or one such dict per layer type) and rope_scaling: the sub-keys the families read
# (families.rope, families.ROPE_KEYS), typed as transformers' RopeParameters types them; `type`: v4's rope_type
ROPE_KEYS = {
    "rope_type": STR, "type": STR, "rope_theta": POSITIVE, "partial_rotary_factor": FRACTION,
    "factor": POSITIVE, "original_max_position_embeddings": SIZE, "attention_factor": POSITIVE,
    "beta_fast": POSITIVE, "beta_slow": POSITIVE, "mscale": NONNEGATIVE, "mscale_all_dim": NONNEGATIVE,
    "truncate": BOOL, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
    "short_factor": Check("numbers", low=0, open_low=True), "long_factor": Check("numbers", low=0, open_low=True),
}

COMMON = {  # keys read for every family (families.GENERIC_REFUSALS, checks.check_special_ids)
    "model_type": STR, "quantization_config": Check("dict"), "is_encoder_decoder": BOOL,
    "bos_token_id": ID, "eos_token_id": IDS, "pad_token_id": ID, "tie_word_embeddings": BOOL,
    "vocab_size": SIZE, "initializer_range": Check("number", low=0, high=1),
    "rope_parameters": ROPE, "rope_scaling": ROPE, "rope_theta": POSITIVE, "partial_rotary_factor": FRACTION,
    "original_max_position_embeddings": SIZE,  # scaled RoPE's pretraining context (Phi-3 keeps it at the top)
}
LLAMA = {
    **COMMON, "hidden_size": SIZE, "num_hidden_layers": LAYERS, "num_attention_heads": SIZE,
    "num_key_value_heads": SIZE, "intermediate_size": SIZE, "max_position_embeddings": SIZE,
    "rms_norm_eps": POSITIVE, "head_dim": COUNT0, "attention_bias": BOOL, "mlp_bias": BOOL, "hidden_act": STR,
}
WINDOWED = {"sliding_window": SIZE}
QWEN = {**LLAMA, **WINDOWED, "use_sliding_window": BOOL, "max_window_layers": COUNT0, "layer_types": LAYER_TYPES}
GEMMA = {**LLAMA, "head_dim": SIZE, "use_bidirectional_attention": BOOL}
# mixture of experts: top-k, and the keys of other MoE designs families.MOE_REFUSALS reads (to refuse them)
MOE = {"num_experts_per_tok": SIZE, "scoring_func": STR, "routed_scaling_factor": Check("number"),
       "n_group": SIZE, "topk_group": SIZE, "first_k_dense_replace": COUNT0, "n_shared_experts": COUNT0}
EXPERTS = {**MOE, "num_experts": SIZE, "num_local_experts": SIZE, "norm_topk_prob": BOOL}  # Qwen-MoE, OLMoE
QWEN_MOE = {**EXPERTS, "moe_intermediate_size": SIZE, "decoder_sparse_step": SIZE,
            "mlp_only_layers": Check("ints", low=0)}
GEMMA2 = {**GEMMA, **WINDOWED, "hidden_activation": STR, "query_pre_attn_scalar": SIZE,
          "attn_logit_softcapping": POSITIVE, "final_logit_softcapping": POSITIVE, "layer_types": LAYER_TYPES}

SCHEMAS: dict[str, dict[str, Check]] = {  # model_type -> config.json key -> rule
    "llama": LLAMA,
    "mistral": {**LLAMA, **WINDOWED},
    "qwen2": QWEN,
    "qwen3": {**QWEN, "head_dim": SIZE},
    "gemma": GEMMA,
    "gemma2": GEMMA2,
    "gemma3_text": {**GEMMA2, "rope_local_base_freq": POSITIVE, "sliding_window_pattern": SIZE},
    "olmo": {**LLAMA, "clip_qkv": POSITIVE},
    "olmo2": LLAMA,
    "gpt2": {**COMMON, "n_embd": SIZE, "hidden_size": SIZE, "n_layer": LAYERS, "num_hidden_layers": LAYERS,
             "n_head": SIZE, "num_attention_heads": SIZE, "n_inner": SIZE, "n_positions": SIZE,
             "max_position_embeddings": SIZE, "layer_norm_epsilon": POSITIVE, "activation_function": STR,
             "scale_attn_by_inverse_layer_idx": BOOL, "scale_attn_weights": BOOL, "add_cross_attention": BOOL},
    "gpt_neox": {**LLAMA, "layer_norm_eps": POSITIVE, "use_parallel_residual": BOOL, "rotary_emb_base": POSITIVE,
                 "rotary_pct": FRACTION},
    "phi3": {**LLAMA, **WINDOWED},
    "phi": {**LLAMA, "layer_norm_eps": POSITIVE, "qk_layernorm": BOOL},
    "mixtral": {**LLAMA, **WINDOWED, **MOE, "num_local_experts": SIZE},
    # Qwen2MoeConfig writes sliding_window 0 when use_sliding_window is false (families reads it only when true)
    "qwen2_moe": {**QWEN, **QWEN_MOE, "sliding_window": COUNT0, "shared_expert_intermediate_size": COUNT0,
                  "qkv_bias": BOOL},
    "qwen3_moe": {**LLAMA, **WINDOWED, **QWEN_MOE, "use_sliding_window": BOOL},
    "olmoe": {**LLAMA, **EXPERTS, "clip_qkv": POSITIVE},
}


def nested_rope(value: Any) -> bool:
    """Whether a RoPE dict is keyed by layer type: it names a layer type (as transformers' nested keys are the
    layer types), or all its values are dicts (an unknown layer type, which families.rope refuses)."""
    return isinstance(value, dict) and bool(value) and (
        any(key in LAYER_TYPES.allowed for key in value) or all(isinstance(v, dict) for v in value.values()))


def _rope(value: dict[str, Any], where: str) -> None:
    """rope_parameters / rope_scaling: flat, or keyed by layer type (each layer type's value a flat dict or
    null); each sub-key the families read checked by `ROPE_KEYS`, named as `<key>[.<layer type>].<sub-key>`."""
    keyed = nested_rope(value)
    for name, params in (value.items() if keyed else [("", value)]):
        if keyed and (params is None or name not in LAYER_TYPES.allowed):
            continue  # null: that layer type's defaults; a key that is no layer type: refused by families.rope
        if not isinstance(params, dict):
            raise invalid(f"{where}.{name}", params, "an object (dict) or null")
        for key, rule in ROPE_KEYS.items():
            sub = params.get(key)
            if sub is not None and not rule.ok(sub):
                raise invalid(f"{where}.{name + '.' if name else ''}{key}", sub, rule.expected())


def check_config(hf: dict[str, Any], model_type: str) -> None:
    """Refuse, in one line naming the key, the first config.json value of `model_type`'s schema that has the
    wrong type, lies out of range or is not an allowed value (None: absent, always allowed)."""
    for key, rule in SCHEMAS.get(model_type, LLAMA).items():
        value = hf.get(key)
        if value is None:
            continue
        if not rule.ok(value):
            raise invalid(key, value, rule.expected())
        if rule.kind == "rope":
            _rope(value, key)


__all__ = ["SCHEMAS", "Check", "check_config", "invalid", "nested_rope"]
