"""Scaled RoPE imported exactly: for each rope_type (linear, dynamic, yarn, longrope, llama3) and Gemma-3's
per-layer-type RoPE (scaled global layers, plain local ones), a tiny random transformers model (eager, float32)
is saved, imported and compared with transformers on sequences longer than the original context (and, for the
length-dependent types, also shorter), logits and every block's stream to 1e-4. Each case also shows that the
same weights with plain RoPE differ by more than 1e-3, so the scaling is exercised. Bad rope parameters are
one line, exit 2. No hub."""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.arch.rope import RopeScaling
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError
from depthtools.interop import from_hf, import_hf

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")

VOCAB, TOL, CONTEXT = 61, 1e-4, 8  # CONTEXT: the original (pretraining) context of the scaled cases
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=32, attn_implementation="eager",
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
HALF = 8  # head_dim 16: 8 rotated pairs

# case -> (config class, model class, config kwargs, our max_seq_len (None: the config's), lengths compared)
CASES = {
    "linear": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}), None, (20,)),
    "dynamic": ("LlamaConfig", "LlamaForCausalLM",
                dict(max_position_embeddings=CONTEXT, rope_parameters={"rope_type": "dynamic", "factor": 3.0,
                                                                       "rope_theta": 100.0}), 32, (6, 24)),
    "yarn": ("Qwen2Config", "Qwen2ForCausalLM",
             dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000.0,
                                   "original_max_position_embeddings": CONTEXT, "beta_fast": 8.0, "beta_slow": 0.5}),
             None, (20,)),
    "yarn-mscale": ("LlamaConfig", "LlamaForCausalLM",
                    dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000.0, "mscale": 0.8,
                                          "mscale_all_dim": 0.3, "original_max_position_embeddings": CONTEXT}),
                    None, (20,)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": CONTEXT}), None, (20,)),
    "longrope": ("Phi3Config", "Phi3ForCausalLM",
                 dict(original_max_position_embeddings=CONTEXT,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 1000.0,
                                       "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                                       "long_factor": [1.0 + 2.0 * i for i in range(HALF)]}), None, (6, 20)),
    "gemma3-linear-global": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                             dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1e4},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 1e4}}), None, (20,)),
}


def build(case: str, folder) -> torch.nn.Module:
    """A tiny random transformers model of `case` (weights moved off their init), saved to `folder`."""
    config_cls, model_cls, kwargs, _, _ = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.empty_like(p).uniform_(-0.5, 0.5) if p.dim() == 1 and "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    return {case: (root / case, build(case, root / case)) for case in CASES}


def plain_copy(model: DepthModel) -> DepthModel:
    """The same weights with every rope_* scaling option removed (plain RoPE)."""
    options = {k: v for k, v in model.config.options.items() if not k.startswith("rope_") or k == "rope_theta_sliding"}
    other = DepthModel(model.config.replace(options=options)).eval()
    other.load_state_dict(model.state_dict(), strict=False)
    return other


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_rope_matches_transformers(built, case):
    folder, hf = built[case]
    ours = from_hf(folder, max_seq_len=CASES[case][3])
    kind = "linear" if case.startswith("gemma3") else case.split("-")[0]
    assert ours.config.options["rope_type"] == kind
    for T in CASES[case][4]:
        x = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            out = hf(x, output_hidden_states=True)
            mine, states = ours(x), ours.run_states(x)
        gap = (mine - out.logits).abs().max().item()
        assert gap <= TOL, (T, gap)
        for layer in range(ours.config.n_layer):
            assert (states[layer] - out.hidden_states[layer]).abs().max().item() <= TOL, (T, layer)
        assert torch.equal(mine.argmax(-1), out.logits.argmax(-1))
        if T > CONTEXT:  # beyond the original context the scaling matters
            with torch.no_grad():
                assert (plain_copy(ours)(x) - out.logits).abs().max().item() > 1e-3


def test_length_dependent_types_rotate_a_prefix_as_transformers_does(built):
    """longrope switches to its long factors once the sequence exceeds the context: the first 6 positions of a
    20-token sequence differ from the same 6 tokens alone, in transformers and here alike."""
    folder, hf = built["longrope"]
    ours = from_hf(folder)
    x = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        long_prefix, short = ours(x)[:, :6], ours(x[:, :6])
        assert (long_prefix - short).abs().max() > 1e-3
        assert (short - hf(x[:, :6]).logits).abs().max() <= TOL


@pytest.mark.parametrize("case", ["longrope", "gemma3-linear-global", "yarn"])
def test_checkpoint_round_trip_keeps_the_scaling(built, case, tmp_path):
    """The rope_* options (longrope's factor lists too) survive the checkpoint's JSON: bit-identical logits."""
    folder, _ = built[case]
    summary = import_hf(folder, out=tmp_path / "ck")
    again, ours = ck.load(summary["checkpoint"]), from_hf(folder)
    assert again.config.options == ours.config.options
    x = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again(x), ours(x))


def test_llama3_frequencies_against_a_closed_form():
    """Llama 3.1's rule, frequency by frequency: wavelength < L/4 kept, > L/1 divided by 8, blended between."""
    import math
    rope = RopeScaling("llama3", 8.0, 64, 1.0, 4.0)
    f = rope.inv_freq(32, 500.0)
    for i, scaled in enumerate(f.tolist()):
        base = 500.0 ** (-2 * i / 32)
        wave = 2 * math.pi / base
        if wave < 16:
            expected = base
        elif wave > 64:
            expected = base / 8
        else:
            s = (64 / wave - 1) / 3
            expected = (1 - s) * base / 8 + s * base
        assert scaled == pytest.approx(expected, rel=1e-12)


def test_dynamic_is_plain_within_the_context():
    cfg = ModelConfig(arch="preln", vocab_size=VOCAB, d_model=32, n_layer=1, n_heads=2, n_kv_heads=2, d_ff=48,
                      max_seq_len=32, options={"rope_type": "dynamic", "rope_factor": 2.0, "rope_original_context": 8})
    torch.manual_seed(0)
    model = DepthModel(cfg).eval()
    x = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(x), plain_copy(model)(x))
        y = torch.randint(0, VOCAB, (1, 16))
        assert (model(y) - plain_copy(model)(y)).abs().max() > 0


BASE = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=32)


@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope_scaling.rope_type='proportional'"),
    ({"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e4}}, "rope_parameters.rope_type='ntk-by-parts'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters.factor=None"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                          "rope_theta": 1e4}}, "rope_high_freq_factor 1 must exceed"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                                "long_factor": [1.0] * 8}}, "rope_short_factor has 3 entries"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "four", "rope_theta": 1e4}},
     "rope_parameters.factor='four' (expected a number > 0)"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0, "x"],
                                                "long_factor": [1.0] * 8}}, "rope_parameters.short_factor="),
    ({"model_type": "gemma3_text", "head_dim": 16,
      "rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
])
def test_bad_rope_parameters_exit_2_in_one_line(tmp_path, change, needle):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **change}))
    with pytest.raises(DepthToolsError) as err:
        from_hf(tmp_path)
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
    result = CliRunner().invoke(app, ["import-hf", str(tmp_path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and needle in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("v4,config_cls,kwargs", [
    ({"model_type": "llama", "rope_theta": 5e5,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}},
     "LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 16})),
    ({"model_type": "phi3", "original_max_position_embeddings": 16,
      "rope_scaling": {"type": "su", "short_factor": [1.0] * HALF, "long_factor": [3.0] * HALF}},
     "Phi3Config", dict(original_max_position_embeddings=16,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * HALF,
                                         "long_factor": [3.0] * HALF})),
    ({"model_type": "gemma3_text", "head_dim": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     "Gemma3TextConfig", dict(head_dim=16, rope_parameters={
         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
])
def test_v4_rope_scaling_reads_as_the_v5_rope_parameters(v4, config_cls, kwargs):
    """A transformers 4.x config.json (rope_scaling + rope_theta, Phi-3's 'su', Gemma-3's rope_local_base_freq)
    gives the same model as the rope_parameters transformers 5 writes for it."""
    from depthtools.interop.families import hf_to_model_config

    sizes = {k: v for k, v in COMMON.items() if k != "attn_implementation"}
    v5 = getattr(transformers, config_cls)(**{**sizes, **kwargs}).to_dict()
    assert hf_to_model_config({**sizes, **v4}) == hf_to_model_config(v5)
    assert hf_to_model_config(v5).options["rope_type"] in ("llama3", "longrope", "linear")
