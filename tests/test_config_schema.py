"""config.json values are type-checked the way transformers' config classes check them (issue 43 items 3, 11).

Every key a family's map reads has a rule in `depthtools.interop.schema.SCHEMAS` (found by recording the keys
`hf_to_model_config` reads), each rule agrees with the installed transformers config class's annotation, and
each hostile value found by the issue's runs is one line naming the key: `"false"` is refused, not read as
true; 0 heads, `"abc"` thetas and a negative `query_pre_attn_scalar` never reach a division or a power.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from depthtools.errors import DepthToolsError
from depthtools.interop.families import FAMILIES, hf_to_model_config
from depthtools.interop.schema import ROPE_KEYS, SCHEMAS

transformers = pytest.importorskip("transformers")
from test_families import CONFIG_CLASS, VOCAB, build_hf

runner = CliRunner()


def sizes(family: str) -> dict:
    out = ({"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4} if family == "gpt2" else
           {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2 if family != "gpt_neox" else 4})
    if family.startswith("gemma"):
        out["head_dim"] = 16
    return out


class Recording(dict):
    """A config.json dict that records every key read from it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def test_every_family_has_a_schema_row():
    assert set(SCHEMAS) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_key_a_family_reads_has_a_rule(family):
    full = getattr(transformers, CONFIG_CLASS[family])(**sizes(family)).to_dict()
    read: set[str] = set()
    for config in (full, {"model_type": family, **sizes(family)}):
        recording = Recording(config)
        hf_to_model_config(recording, max_seq_len=64)
        read |= recording.read
    assert read - set(SCHEMAS[family]) == set()


KINDS = {bool: {"bool"}, int: {"int", "id"}, float: {"number"}, str: {"str"}, dict: {"dict", "rope"}}


def _kinds(annotation) -> set[str]:
    """Our rule kinds compatible with a transformers field annotation (None dropped: null is absent)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if isinstance(
        annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else [annotation]
    if any(typing.get_origin(a) is list and typing.get_args(a) == (int,) for a in args):
        return {"ids"} if int in args else {"ints"}
    if any(typing.get_origin(a) is list and typing.get_args(a) == (float,) for a in args):
        return {"numbers"}
    if any(typing.get_origin(a) is list for a in args):
        return {"strs"}
    if float in args:
        return {"number"}
    kinds: set[str] = set()
    for a in args:
        kinds |= KINDS.get(a, {"rope"} if "Rope" in str(a) else set())
    return kinds


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rules_mirror_the_config_class(family):
    """Each rule's kind is the class field's annotation; the class's own default passes the rule."""
    cls = getattr(transformers, CONFIG_CLASS[family])
    fields, hints = {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls, localns={"torch": torch})
    checked = 0
    for key, rule in SCHEMAS[family].items():
        if key not in fields:
            continue  # a legacy (4.x) key the family still reads
        assert rule.kind in _kinds(hints[key]), (key, hints[key], rule.kind)
        default = fields[key].default
        if default is not None and not isinstance(default, dataclasses._MISSING_TYPE):
            assert rule.ok(default), (key, default)
        checked += 1
    assert checked >= 8


HOSTILE = [  # (config.json changes, the key the one line names)  -- the inputs, then more
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false'"),
    ({"model_type": "gpt_neox", "use_parallel_residual": "false"}, "use_parallel_residual='false'"),
    ({"bos_token_id": "1"}, "bos_token_id='1'"),
    ({"model_type": ["llama"]}, "model_type=['llama']"),
    ({"model_type": {"name": "llama"}}, "model_type={'name': 'llama'}"),
    ({"model_type": "qwen3", "num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({"model_type": "qwen3", "num_attention_heads": 0}, "num_attention_heads=0"),
    ({"rope_theta": "abc"}, "rope_theta='abc'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": [1, 2]}}, "rope_parameters.rope_theta=[1, 2]"),
    ({"model_type": "gpt_neox", "rotary_emb_base": "abc"}, "rotary_emb_base='abc'"),
    ({"model_type": "qwen2", "max_window_layers": "x"}, "max_window_layers='x'"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": -4}, "query_pre_attn_scalar=-4"),
    ({"model_type": "gemma2", "final_logit_softcapping": "abc"}, "final_logit_softcapping='abc'"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id=[1, '2']"),
    ({"hidden_act": ["silu"]}, "hidden_act=['silu']"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0"),
    ({"initializer_range": 5}, "initializer_range=5"),
    ({"model_type": "olmo", "clip_qkv": "0.3"}, "clip_qkv='0.3'"),
    ({"model_type": "gpt2", "n_inner": "48"}, "n_inner='48'"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_theta": "x"},
                                                       "sliding_attention": {}}},
     "rope_parameters.full_attention.rope_theta='x'"),
    ({"model_type": "qwen2", "layer_types": ["full_attention", "global"]}, "layer_types=['full_attention', 'global']"),
    ({"vocab_size": 61.0}, "vocab_size=61.0"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True"),
    ({"model_type": "phi3", "partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5"),
    ({"model_type": "qwen2", "num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),  # not a 10**9 list
    ({"model_type": "mistral", "sliding_window": "4096"}, "sliding_window='4096'"),
    ({"rope_parameters": {"rope_theta": float("nan")}}, "rope_parameters.rope_theta=nan"),
    ({"pad_token_id": 1.5}, "pad_token_id=1.5"),
    # the mixture-of-experts families' keys
    ({"model_type": "mixtral", "num_local_experts": 0}, "num_local_experts=0"),
    ({"model_type": "mixtral", "num_experts_per_tok": "2"}, "num_experts_per_tok='2'"),
    ({"model_type": "mixtral", "n_group": "4"}, "n_group='4'"),
    ({"model_type": "qwen2_moe", "num_experts": 2.5}, "num_experts=2.5"),
    ({"model_type": "qwen2_moe", "moe_intermediate_size": 0}, "moe_intermediate_size=0"),
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size=-1"),
    ({"model_type": "qwen2_moe", "norm_topk_prob": "true"}, "norm_topk_prob='true'"),
    ({"model_type": "qwen2_moe", "qkv_bias": "false"}, "qkv_bias='false'"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 0}, "decoder_sparse_step=0"),  # (l + 1) % 0
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0, "1"]}, "mlp_only_layers=[0, '1']"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": 1}, "mlp_only_layers=1"),
    ({"model_type": "qwen3_moe", "use_sliding_window": "yes"}, "use_sliding_window='yes'"),
    ({"model_type": "olmoe", "num_experts": True}, "num_experts=True"),
    ({"model_type": "olmoe", "clip_qkv": -1}, "clip_qkv=-1"),
    ({"model_type": "olmoe", "first_k_dense_replace": "1"}, "first_k_dense_replace='1'"),
    # phi
    ({"model_type": "phi", "qk_layernorm": "false"}, "qk_layernorm='false'"),
    ({"model_type": "phi", "layer_norm_eps": -1e-5}, "layer_norm_eps=-1e-05"),
    ({"model_type": "phi", "partial_rotary_factor": 0}, "partial_rotary_factor=0"),
    # scaled RoPE parameters, in rope_parameters (flat or per layer type) and v4 rope_scaling
    ({"rope_parameters": {"rope_type": 8}}, "rope_parameters.rope_type=8"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "rope_parameters.factor=0"),  # f / 0
    ({"rope_parameters": {"rope_type": "dynamic", "factor": -2.0}}, "rope_parameters.factor=-2.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling.factor='2'"),
    ({"rope_scaling": {"type": "dynamic", "factor": float("inf")}}, "rope_scaling.factor=inf"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}},
     "rope_parameters.original_max_position_embeddings=0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8.5}},
     "rope_parameters.original_max_position_embeddings=8.5"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}}, "rope_parameters.beta_fast=0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_slow": "1"}}, "rope_parameters.beta_slow='1'"),
    # 0 would zero cos and sin in transformers, but means "the type's default" as our option: refused
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}},
     "rope_parameters.attention_factor=0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": -10.0}},
     "rope_parameters.mscale_all_dim=-10.0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": "false"}}, "rope_parameters.truncate='false'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0}},
     "rope_parameters.low_freq_factor=0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": [4]}},
     "rope_parameters.high_freq_factor=[4]"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                                                "long_factor": [1.0, 0.0, 1.0, 1.0]}},
     "rope_parameters.long_factor=[1.0, 0.0, 1.0, 1.0]"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "short_factor": "1.0",
                                                "long_factor": [1.0] * 4}}, "rope_parameters.short_factor='1.0'"),
    ({"model_type": "phi3", "original_max_position_embeddings": 0}, "original_max_position_embeddings=0"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": [2]},
                                                       "sliding_attention": {}}},
     "rope_parameters.full_attention.factor=[2]"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": "linear", "sliding_attention": {}}},
     "rope_parameters.full_attention='linear'"),
]


@pytest.mark.parametrize("change,needle", HOSTILE, ids=lambda v: v if isinstance(v, str) else None)
def test_hostile_values_are_one_line_naming_the_key(change, needle):
    family = change.get("model_type") if isinstance(change.get("model_type"), str) else "llama"
    config = {"model_type": family, **sizes(family), **change}
    with pytest.raises(DepthToolsError) as err:
        hf_to_model_config(config)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert "j)" not in str(err.value)  # no complex number


def test_a_false_string_on_the_command_line_is_exit_2_and_writes_nothing(tmp_path):
    folder = tmp_path / "hf"
    build_hf("gpt2", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": "false"}))
    result = runner.invoke(app, ["import-hf", str(folder), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 2 and "tie_word_embeddings='false'" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not Path(tmp_path / "ck").exists()


def test_real_configs_still_pass():
    """The full config.json transformers writes for each family, with its defaults, passes every rule."""
    for family in FAMILIES:
        hf_to_model_config(getattr(transformers, CONFIG_CLASS[family])(**sizes(family)).to_dict(), max_seq_len=64)


def test_rope_rules_mirror_rope_parameters():
    """Each RoPE sub-key's rule has the kind transformers' RopeParameters annotates (`type`: v4's rope_type)."""
    from transformers.modeling_rope_utils import RopeParameters

    hints = typing.get_type_hints(RopeParameters)
    for key, rule in ROPE_KEYS.items():
        assert rule.kind in _kinds(hints["rope_type" if key == "type" else key]), (key, rule.kind)


SCALED = {  # one rope_parameters per type the backbone implements, with every parameter transformers reads for it
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16,
             "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
                 "attention_factor": 1.2, "short_factor": [1.0, 1.5, 2, 3.0], "long_factor": [2.0] * 4},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16,
               "low_freq_factor": 1, "high_freq_factor": 4.0},
}


@pytest.mark.parametrize("kind", sorted(SCALED))
def test_scaled_rope_configs_pass_and_every_parameter_read_has_a_rule(kind):
    """The rope_parameters transformers' LlamaConfig writes for each scaled type are imported as that type,
    and every sub-key the families read from it has a rule in ROPE_KEYS."""
    written = transformers.LlamaConfig(**sizes("llama"), max_position_embeddings=64,
                                       rope_parameters=dict(SCALED[kind])).to_dict()
    recording = Recording(written["rope_parameters"])
    cfg = hf_to_model_config({**written, "rope_parameters": recording}, max_seq_len=64)
    assert cfg.options["rope_type"] == kind
    assert recording.read - set(ROPE_KEYS) == set()


def test_an_unknown_rope_type_is_one_refusal_naming_it():
    """The schema only checks that rope_type is a string; the families' refusal (the supported types) is the one line."""
    with pytest.raises(DepthToolsError) as err:
        hf_to_model_config({"model_type": "llama", **sizes("llama"), "rope_parameters": {"rope_type": "ntk"}})
    assert str(err.value) == ("unsupported Hugging Face config: rope_parameters.rope_type='ntk' (supported: default, "
                              "linear, dynamic, yarn, longrope, llama3)")


GEMMA3 = {"model_type": "gemma3_text", **sizes("gemma3_text")}


@pytest.mark.parametrize("nested", [
    {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, "sliding_attention": None},
    {"full_attention": None, "sliding_attention": {"rope_theta": 1e3}},
])
def test_a_null_layer_type_in_rope_parameters_reads_as_transformers_fills_it(nested):
    """A layer type set to null keeps the dict per layer type (the other type's scaling is not dropped) and takes
    that type's defaults, as Gemma3TextConfig fills them."""
    cfg = hf_to_model_config({**GEMMA3, "rope_parameters": nested}, max_seq_len=64)
    filled = transformers.Gemma3TextConfig(**sizes("gemma3_text"), rope_parameters=nested).rope_parameters
    full, local = filled["full_attention"], filled["sliding_attention"]
    assert cfg.rope_theta == full["rope_theta"] and cfg.options["rope_theta_sliding"] == local["rope_theta"]
    assert cfg.options.get("rope_type", "default") == full["rope_type"] and local["rope_type"] == "default"
    assert cfg.options.get("rope_factor") == full.get("factor")


@pytest.mark.parametrize("change,needle", [
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {},
                          "rope_type": "default"}}, "rope_parameters=['rope_type']"),
    ({"rope_scaling": {"full_attention": {"rope_type": "linear", "factor": 8.0}}}, "rope_scaling=['full_attention']"),
])
def test_a_rope_dict_mixing_layer_types_and_parameters_is_refused_not_read_flat(change, needle):
    """Such a dict was read as a flat, plain RoPE dict: the full layers' scaling silently dropped."""
    with pytest.raises(DepthToolsError) as err:
        hf_to_model_config({**GEMMA3, **change})
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
