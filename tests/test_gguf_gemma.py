"""GGUF import of Gemma, Gemma-2 and Gemma-3: files written here with the gguf package's GGUFWriter from tiny
random transformers models the way llama.cpp's convert_hf_to_gguf.py writes them (RMSNorm gains stored as
1 + w, tensor names of gguf's tensor map, the metadata keys its Gemma* classes add; no query_pre_attn_scalar,
no layer pattern: llama.cpp's runtime implies them). Our imported logits must equal the transformers model's
(F32, <= 1e-4), and transformers' own GGUF loader, reading the same file, must agree with it too: an
independent check that the file is in llama.cpp's layout.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

runner = CliRunner()
T = 12  # longer than the sliding window below: the window matters
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")
CASES = {  # GGUF architecture -> (config class, model class, kwargs)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_hidden_layers=2, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=7, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}
LAYER = {  # HF model.layers.N.<module> -> llama.cpp blk.N.<name> (gguf.tensor_mapping's Gemma entries)
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
}
GEMMA1_NORMS = {"post_attention_layernorm": "ffn_norm"}
SANDWICH_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}


def build(arch: str, seed: int = 0, **changes):
    """A tiny random transformers model of `arch`, every weight (norm gains included) moved off its init."""
    config_cls, model_cls, extra = CASES[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra, **changes})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.empty_like(p).uniform_(-0.5, 0.5) if p.dim() == 1 else 0.1 * torch.randn_like(p))
    return model


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, every `*norm.weight` stored as 1 + w (convert_hf_to_gguf's
    Gemma/Gemma2/Gemma3 modify_tensors); the tied head is not written."""
    names = {**LAYER, **(GEMMA1_NORMS if arch == "gemma" else SANDWICH_NORMS)}
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy().copy()
        if name == "lm_head.weight":
            continue
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{names[module]}.{kind}"
        out[gname] = w + 1 if gname.endswith("norm.weight") else w
    return out


def write_gguf(model, arch: str, path: Path, rope_base: float | None = None) -> None:
    """Write `model` as llama.cpp's converter would: its Gemma classes' metadata keys, F32 tensors."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(rope_base or full["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    for name, w in gguf_tensors(model, arch).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


def import_logits(path: Path, out: Path, x: torch.Tensor) -> torch.Tensor:
    result = runner.invoke(app, ["import-hf", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        return ck.load(out).eval()(x)


@pytest.mark.parametrize("arch", list(CASES))
def test_f32_gemma_gguf_matches_transformers(arch, tmp_path):
    model = build(arch)
    write_gguf(model, arch, tmp_path / "m.gguf")
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(x).logits
    mine = import_logits(tmp_path / "m.gguf", tmp_path / "ck", x)
    assert theirs.abs().max() > 0.3
    gap = (mine - theirs).abs().max().item()
    assert gap <= 1e-4, gap
    config = ck.read_json(tmp_path / "ck" / ck.CONFIG)
    assert config["source"]["format"] == f"gguf-{arch}"
    assert config["model"]["tie_embeddings"] is True
    hf = config["source"]["hf_config"]
    if arch != "gemma":
        assert hf["query_pre_attn_scalar"] == 16 and hf["sliding_window"] == 5
        assert hf["layer_types"] == list(model.config.layer_types)


def test_the_norm_shift_and_the_sandwich_norms_matter(tmp_path):
    """A file whose gains were not shifted by 1 (or a Gemma-2 read with Gemma-1's norm names) would give other
    logits: the test above can fail."""
    model = build("gemma2", seed=1)
    write_gguf(model, "gemma2", tmp_path / "m.gguf")
    x = tokens(model.config.vocab_size, seed=1)
    mine = import_logits(tmp_path / "m.gguf", tmp_path / "ck", x)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_feedforward_layernorm.weight.add_(1.0)
        shifted = model(x).logits
    assert (mine - shifted).abs().max() > 1e-2


def test_gemma3_linear_rope_scaling_scales_the_full_layers_only(tmp_path):
    """Gemma-3's rope.scaling (linear) goes to the full-attention layers; positions past the window and a
    scaled base: a file imported without the scaling differs."""
    model = build("gemma3", seed=2)
    write_gguf(model, "gemma3", tmp_path / "m.gguf")
    x = tokens(model.config.vocab_size, seed=2)
    mine = import_logits(tmp_path / "m.gguf", tmp_path / "ck", x)
    plain = build("gemma3", seed=2, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e5},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 10000.0}})
    with torch.no_grad():
        assert (mine - model(x).logits).abs().max().item() <= 1e-4
        assert (mine - plain(x).logits).abs().max().item() > 1e-3
    hf = ck.read_json(tmp_path / "ck" / ck.CONFIG)["source"]["hf_config"]
    assert hf["rope_scaling"] == {"rope_type": "linear", "factor": 4.0} and hf["rope_local_base_freq"] == 10000.0


def test_the_27b_query_scale_follows_llama_cpp(tmp_path):
    """Without attention.scale, llama.cpp scales queries by (n_embd / n_head)^-1/2 for the 27B models (46 layers
    for Gemma-2) and by head_dim^-1/2 otherwise; attention.scale, where written, wins."""
    from depthtools.interop.gguf_import import hf_config

    meta = {"general.architecture": "gemma2", "gemma2.embedding_length": 4608, "gemma2.block_count": 46,
            "gemma2.feed_forward_length": 36864, "gemma2.attention.head_count": 32,
            "gemma2.attention.head_count_kv": 16, "gemma2.attention.key_length": 128,
            "gemma2.context_length": 8192, "gemma2.attention.layer_norm_rms_epsilon": 1e-6}
    hf = hf_config(meta, 256000, True, tmp_path / "m.gguf")
    assert hf["query_pre_attn_scalar"] == 144
    assert (hf["attn_logit_softcapping"], hf["final_logit_softcapping"]) == (50.0, 30.0)  # llama.cpp's defaults
    assert hf_config({**meta, "gemma2.block_count": 42}, 256000, True, tmp_path)["query_pre_attn_scalar"] == 128
    scaled = hf_config({**meta, "gemma2.attention.scale": 0.125}, 256000, True, tmp_path)
    assert scaled["query_pre_attn_scalar"] == pytest.approx(64.0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_transformers_gguf_loader_reads_our_file_alike(arch, tmp_path):
    """transformers' own GGUF loader (which knows llama.cpp's 1 + w convention) reads the file we wrote to the
    same logits as our import. Its loader takes query_pre_attn_scalar and layer pattern from its config
    defaults (256, every 2nd / 6th layer full), so this model uses head_dim 256, the real Gemma's; it reads
    no softcaps (Gemma-2's defaults 50 / 30 here) and no RoPE scaling (none here)."""
    extra = dict(head_dim=256, query_pre_attn_scalar=256, num_attention_heads=2, num_key_value_heads=1)
    if arch == "gemma2":
        extra.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if arch == "gemma3":
        extra["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    model = build(arch, seed=3, **extra)
    write_gguf(model, arch, tmp_path / "m.gguf")
    x = tokens(model.config.vocab_size, seed=3)
    mine = import_logits(tmp_path / "m.gguf", tmp_path / "ck", x)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        theirs, original = loaded(x).logits, model(x).logits
    assert (theirs - original).abs().max().item() <= 1e-4  # their loader reads the file as the model we wrote
    assert (mine - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("pattern,expected", [
    (None, "sfsfs"), (3, "ssfss"), ([True, False, False, True, True], "sffss")])
def test_the_sliding_layer_pattern_follows_llama_cpp(pattern, expected, tmp_path):
    """Gemma-2 without attention.sliding_window_pattern: every 2nd layer full (llama.cpp's fixed pattern); an int
    n: every n-th; a bool per layer: true = sliding."""
    from depthtools.interop.gguf_import import hf_config

    meta = {"general.architecture": "gemma2", "gemma2.embedding_length": 64, "gemma2.block_count": 5,
            "gemma2.feed_forward_length": 96, "gemma2.attention.head_count": 4, "gemma2.attention.key_length": 16,
            "gemma2.context_length": 64, "gemma2.attention.layer_norm_rms_epsilon": 1e-6}
    if pattern is not None:
        meta["gemma2.attention.sliding_window_pattern"] = pattern
    types = hf_config(meta, 300, True, tmp_path / "m.gguf")["layer_types"]
    assert "".join(t[0] for t in types) == expected


def test_a_bad_sliding_pattern_is_one_line(tmp_path):
    from depthtools.errors import DepthToolsError
    from depthtools.interop.gguf_import import hf_config

    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 64, "gemma3.block_count": 5,
            "gemma3.feed_forward_length": 96, "gemma3.attention.head_count": 4, "gemma3.attention.key_length": 16,
            "gemma3.context_length": 64, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.attention.sliding_window_pattern": [True, False]}
    with pytest.raises(DepthToolsError, match=r"sliding_window_pattern=\[True, False\] \(expected an integer >= 1 or "
                                              r"one bool per layer\)"):
        hf_config(meta, 300, True, tmp_path / "m.gguf")
