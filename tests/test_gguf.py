"""GGUF import: files written here by the gguf package's own GGUFWriter from tiny random transformers
Llama / Qwen2 / Qwen3 models, the way llama.cpp's converter writes them (llama's q/k rows permuted into
interleaved RoPE pairs; qwen not), in F32 and in Q8_0 (gguf.quants.quantize). Our imported logits must
equal transformers' (F32: <= 1e-4) and, for Q8_0, transformers' model loaded with the gguf package's own
dequantization of the file (gguf.quants.dequantize). Bad input: one line, exit 2, nothing written.
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
from depthtools.interop import bytes_to_unicode

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

runner = CliRunner()
T = 12
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")
CASES = {  # GGUF architecture -> (config class, model class, extra kwargs)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=5e5, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
}
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def byte_bpe() -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary: the 256 byte symbols and a few merges (GPT-2 style)."""
    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    return symbols + ["Ġt", "he", "Ġthe", "in", "an"], merges


def build(arch: str, seed: int = 0):
    """A tiny random transformers model of `arch`, norm gains moved off 1."""
    config_cls, model_cls, extra = CASES[arch]
    vocab = len(byte_bpe()[0]) + 3  # rows past the tokenizer (as padded vocabularies have)
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(vocab_size=vocab, **COMMON, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.empty_like(p).uniform_(-0.5, 0.5) if p.dim() == 1 else 0.1 * torch.randn_like(p))
    return model


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for llama (HF rotate_half pairs -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names, q/k permuted for llama (as convert_hf_to_gguf does)."""
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = w
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                w = permute(w, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                w = permute(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{HF_TO_GGUF[module]}.{kind}"] = w
    return out


def write_gguf(model, arch: str, path: Path, qtype: str = "F32", tokenizer: bool = True, heads=None,
               bpe: tuple[list[str], list[str]] | None = None,
               extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write `model` as a GGUF file with GGUFWriter; returns the float32 values the file holds per tensor
    (dequantized by gguf itself for quantized ones). `heads`: another attention.head_count value (an int, a
    per-layer list, a string); `bpe`: other (tokens, merges)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    if heads is None:
        writer.add_head_count(cfg.num_attention_heads)
    elif isinstance(heads, list):
        writer.add_array(f"{arch}.attention.head_count", heads)
    elif isinstance(heads, str):
        writer.add_string(f"{arch}.attention.head_count", heads)
    else:
        writer.add_uint32(f"{arch}.attention.head_count", heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if tokenizer:
        tokens, merges = bpe or byte_bpe()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
    held: dict[str, np.ndarray] = {}
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    for name, w in gguf_tensors(model, arch).items():
        if qtype != "F32" and w.ndim == 2:  # llama.cpp keeps 1-D tensors (norms, biases) in F32
            q = gguf.quants.quantize(w, kind)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
            held[name] = gguf.quants.dequantize(q, kind)
        else:
            writer.add_tensor(name, w)
            held[name] = w
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def reference_with(model, held: dict[str, np.ndarray], arch: str):
    """A copy of `model` whose weights are the file's values (un-permuted by the test's own inverse)."""
    import copy

    cfg = model.config
    ref = copy.deepcopy(model)
    back = {v: k for k, v in HF_TO_GGUF.items()}
    with torch.no_grad():
        for name, w in held.items():
            if name == "token_embd.weight":
                target = "model.embed_tokens.weight"
            elif name == "output_norm.weight":
                target = "model.norm.weight"
            elif name == "output.weight":
                target = "lm_head.weight"
            else:
                _, i, module, kind = name.split(".")
                target = f"model.layers.{i}.{back[module]}.{kind}"
                heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(module)
                if arch == "llama" and heads and kind == "weight":  # invert the permutation by its row index
                    index = permute(np.arange(w.shape[0])[:, None], heads)[:, 0]  # file row r = HF row index[r]
                    original = np.empty_like(w)
                    original[index] = w
                    w = original
            ref.state_dict()[target].copy_(torch.from_numpy(np.ascontiguousarray(w)))
    return ref


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


def our_logits(ckpt: Path, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ck.load(ckpt).eval()(x)


@pytest.mark.parametrize("arch", list(CASES))
def test_f32_gguf_matches_transformers(arch, tmp_path):
    model = build(arch)
    write_gguf(model, arch, tmp_path / "m.gguf")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(x).logits
    mine = our_logits(tmp_path / "ck", x)
    assert theirs.abs().max() > 0.3
    gap = (mine - theirs).abs().max().item()
    assert gap <= 1e-4, gap
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    config = ck.read_json(tmp_path / "ck" / ck.CONFIG)
    assert config["source"]["format"] == f"gguf-{arch}" and config["source"]["path"].endswith("m.gguf")
    assert config["model"]["tie_embeddings"] == model.config.tie_word_embeddings


def test_llama_permutation_is_undone(tmp_path):
    """Importing without undoing llama.cpp's q/k permutation would give other logits: the unpermute matters."""
    from depthtools.interop.gguf_import import unpermute

    w = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    assert torch.equal(unpermute(torch.from_numpy(permute(w.numpy(), 2)), 2), w)
    assert not torch.equal(torch.from_numpy(permute(w.numpy(), 2)), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_0_gguf_matches_gguf_dequantization(arch, tmp_path):
    model = build(arch, seed=1)
    held = write_gguf(model, arch, tmp_path / "q.gguf", qtype="Q8_0")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "q.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    ref = reference_with(model, held, arch)
    x = tokens(model.config.vocab_size, seed=3)
    with torch.no_grad():
        theirs, original = ref(x).logits, model(x).logits
    mine = our_logits(tmp_path / "ck", x)
    assert (theirs - original).abs().max() > 1e-4  # the quantization is visible: we compare against it
    gap = (mine - theirs).abs().max().item()
    assert gap <= 1e-4, gap
    config = ck.read_json(tmp_path / "ck" / ck.CONFIG)
    assert "Q8_0" in config["source"]["quantization"]


def test_tokenizer_rebuilt_from_metadata(tmp_path):
    from tokenizers import Tokenizer

    model = build("qwen2")
    write_gguf(model, "qwen2", tmp_path / "m.gguf")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    tok = Tokenizer.from_file(str(tmp_path / "ck" / "tokenizer.json"))
    ids = tok.encode("the then in an the").ids
    tokens_list = byte_bpe()[0]
    assert tokens_list.index("Ġthe") in ids and tokens_list.index("he") in ids  # merges applied
    assert tok.decode(ids) == "the then in an the"
    config = ck.read_json(tmp_path / "ck" / ck.CONFIG)
    assert config["tokenizer"]["file"] == "tokenizer.json"


def test_no_tokenizer_metadata_is_said_in_one_line(tmp_path):
    model = build("llama")
    write_gguf(model, "llama", tmp_path / "m.gguf", tokenizer=False)
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    assert "no tokenizer was carried" in result.output
    assert not (tmp_path / "ck" / "tokenizer.json").exists()


def _refused(args: list[str], needle: str, out: Path) -> None:
    result = runner.invoke(app, ["import-hf", *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert needle in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists()


def test_bad_gguf_files_exit_2_in_one_line_and_write_nothing(tmp_path, monkeypatch):
    model = build("llama")
    good = tmp_path / "good.gguf"
    write_gguf(model, "llama", good, qtype="Q8_0")
    data = good.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) // 2])
    _refused([str(tmp_path / "trunc.gguf")], "trunc.gguf", tmp_path / "o1")
    (tmp_path / "junk.gguf").write_bytes(b"NOTAGGUF" * 64)
    _refused([str(tmp_path / "junk.gguf")], "not a readable GGUF file", tmp_path / "o2")
    _refused([str(tmp_path / "missing.gguf")], "does not exist", tmp_path / "o3")

    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    _refused([str(tmp_path / "falcon.gguf")], "GGUF architecture 'falcon' is not supported", tmp_path / "o4")

    def cannot(data, qtype):  # a quantization type the gguf package has no dequantizer for
        raise NotImplementedError(f"Quantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", cannot)
    _refused([str(good)], "Q8_0, which the gguf package cannot dequantize", tmp_path / "o5")


def test_without_the_gguf_package_one_line_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name == "gguf":
            raise ImportError("No module named 'gguf'")
        return real(name, *args, **kwargs)

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(builtins, "__import__", no_gguf)
    _refused([str(tmp_path / "m.gguf")], 'pip install -e ".[gguf]"', tmp_path / "o")


# -- issue 43 item 12: hostile GGUF metadata -------------------------------------------------------------------
@pytest.mark.parametrize("heads,needle", [
    (0, "llama.attention.head_count=0 (expected a value >= 1)"),
    ([4, 4, 2, 2], "llama.attention.head_count=[4, 4, 2, 2] (per-layer values that differ are not supported)"),
    ("four", "llama.attention.head_count='four' (expected an integer)"),
])
def test_hostile_head_counts_are_one_line_naming_the_file(heads, needle, tmp_path):
    write_gguf(build("llama"), "llama", tmp_path / "m.gguf", heads=heads)
    _refused([str(tmp_path / "m.gguf")], needle, tmp_path / "ck")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.stderr.startswith(f"error: {tmp_path / 'm.gguf'}: "), result.stderr


def test_a_per_layer_head_count_array_of_equal_entries_is_that_count(tmp_path):
    model = build("qwen2")
    write_gguf(model, "qwen2", tmp_path / "m.gguf", heads=[4, 4])
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert (our_logits(tmp_path / "ck", x) - model(x).logits).abs().max().item() <= 1e-4


def _no_space(bpe):
    return bpe[0], [*bpe[1], "Ġthe"]


def _unknown_part(bpe):
    return bpe[0], [*bpe[1], "x qq"]


def _duplicate(bpe):
    return [*bpe[0], "he"], bpe[1]


@pytest.mark.parametrize("edit,needle", [
    (_no_space, "merges entry 'Ġthe' is not two tokens separated by one space"),
    (_unknown_part, "merges entry 'x qq' merges into or from 'qq', which is not in tokenizer.ggml.tokens"),
    (_duplicate, "tokenizer.ggml.tokens lists 'he' twice (ids 257 and 261)"),
], ids=["merge-without-space", "merge-of-unknown-token", "duplicate-token"])
def test_hostile_gguf_vocabularies_are_one_line_naming_the_file(edit, needle, tmp_path):
    write_gguf(build("qwen2"), "qwen2", tmp_path / "m.gguf", bpe=edit(byte_bpe()))
    _refused([str(tmp_path / "m.gguf")], needle, tmp_path / "ck")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.stderr.startswith(f"error: {tmp_path / 'm.gguf'}: "), result.stderr


def test_a_refusal_inside_the_conversion_names_the_gguf_not_the_temporary_folder(tmp_path):
    model = build("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    write_gguf(model, "llama", tmp_path / "m.gguf")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith(f"error: {tmp_path / 'm.gguf'}: ") and "non-finite" in line and "depthtools-gguf-" not in line, line
    assert len(line.splitlines()) == 1 and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("arch,converts", [("mistral", True), ("qwen2moe", True), ("qwen3moe", True),
                                           ("gemma3n", False), ("falcon", False)])
def test_an_unsupported_architecture_is_refused_before_the_vocabulary_is_parsed(arch, converts, tmp_path,
                                                                              monkeypatch):
    """The architecture key is read from the header: the gguf reader (which parses every metadata array, minutes
    for a 256k vocabulary) is never opened. Where transformers converts the file, the line says how."""
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(5000)])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()

    def never(*args, **kwargs):
        raise AssertionError("the GGUF reader was opened")

    monkeypatch.setattr(gguf, "GGUFReader", never)
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 2, (result.output, result.exception)
    line = result.stderr.strip()
    assert f"{tmp_path / 'm.gguf'}: GGUF architecture {arch!r} is not supported" in line
    assert len(line.splitlines()) == 1 and not (tmp_path / "ck").exists()
    assert (f"transformers converts a {arch} GGUF to a Hugging Face folder" in line) == converts, line


def test_the_architectures_said_to_convert_are_transformers_and_import_families():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from depthtools.interop.families import FAMILIES
    from depthtools.interop.gguf_import import ARCHITECTURES, TRANSFORMERS_CONVERTS

    hf_type = {"gemma3": "gemma3_text"}  # transformers' GGUF loader renames it
    assert set(TRANSFORMERS_CONVERTS) <= set(GGUF_SUPPORTED_ARCHITECTURES)
    assert all(hf_type.get(a, a) in FAMILIES for a in TRANSFORMERS_CONVERTS)
    assert not set(TRANSFORMERS_CONVERTS) & set(ARCHITECTURES)
    missed = {a for a in GGUF_SUPPORTED_ARCHITECTURES if hf_type.get(a, a) in FAMILIES} - set(ARCHITECTURES)
    assert missed == set(TRANSFORMERS_CONVERTS)


# -- Llama-3.1+ RoPE scaling: llama.cpp writes it as a rope_freqs tensor ------------------------------------------
def llama3_rope_freqs(cfg) -> np.ndarray:
    """The divisors convert_hf_to_gguf.py's LlamaModel computes for a llama3 rope_scaling (its formula, written
    out here): 1 above the high-frequency wavelength bound, `factor` below the low one, a smooth blend between."""
    import math

    params = cfg.rope_parameters
    base, dim = params["rope_theta"], cfg.head_dim
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_are_applied_exactly(tmp_path):
    """A Llama-3.1-style file (rope_freqs tensor, no rope.scaling key): our logits equal transformers' llama3
    model's at 40 positions, past the original context of 32; ignoring the tensor would not."""
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 2.0, "original_max_position_embeddings": 32}
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(byte_bpe()[0]), **{**COMMON, "head_dim": 32},
                                   rope_parameters=rope, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    freqs = llama3_rope_freqs(cfg)
    assert 1.0 < freqs.max() and freqs.min() == 1.0 and len(set(freqs.tolist())) > 3  # all three regimes present
    write_gguf(model, "llama", tmp_path / "m.gguf", extra={"rope_freqs.weight": freqs})
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    x = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, **{**COMMON, "head_dim": 32}, rope_theta=500.0, tie_word_embeddings=False)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        theirs, unscaled = model(x).logits, plain(x).logits
    mine = our_logits(tmp_path / "ck", x)
    assert (mine - theirs).abs().max().item() <= 1e-4
    assert (mine - unscaled).abs().max().item() > 1e-3


def test_bad_rope_freqs_are_one_line(tmp_path):
    write_gguf(build("llama"), "llama", tmp_path / "m.gguf", extra={"rope_freqs.weight": np.full(3, 2.0, np.float32)})
    _refused([str(tmp_path / "m.gguf")], "tensor rope_freqs.weight has 3 values; expected 8 positive", tmp_path / "ck")
