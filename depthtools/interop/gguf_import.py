"""GGUF (llama.cpp's single-file format) -> a depthtools checkpoint, through the Hugging Face path.

A GGUF file is read with the `gguf` package (an optional extra: pip install -e ".[gguf]"), imported
lazily so depthtools works without it. Its metadata is translated to the `config.json` the same model
has on the Hugging Face hub and its tensors to the HF tensor names, dequantized to float32 with
`gguf.quants.dequantize`; from there the families' own map (depthtools.interop.families) builds the
ModelConfig and the state dict, so a GGUF import and an HF import of one model give the same
checkpoint (up to the quantization the file itself carries).

llama.cpp's converter permutes the rows of q/k for `llama` (its RoPE pairs (2j, 2j+1) where HF's
rotate_half pairs (j, j + hd/2)); `unpermute` undoes that permutation exactly. Qwen2/Qwen3 are
written unpermuted (their RoPE is the NEOX pairing llama.cpp applies as is). Architectures whose
GGUF layout differs further (Gemma's norms stored as 1 + w, fused tensors, ...) are refused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from depthtools.checkpoint import CONFIG, atomic_write_json, read_json
from depthtools.data.tokenizer import vocab_fingerprint
from depthtools.errors import DepthToolsError
from depthtools.fsutil import file_sha256
from depthtools.interop.llama import import_hf

GGUF_EXTRA = 'pip install -e ".[gguf]"'
# GGUF general.architecture -> HF model_type, and whether llama.cpp permuted q/k rows.
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}
LAYER_TENSORS = {  # GGUF blk.N.<name> -> HF model.layers.N.<name>
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
IGNORED_TENSORS = ("rope_freqs.weight",)  # llama.cpp's precomputed RoPE factors: only written for scaled RoPE


def _gguf():
    try:
        import gguf  # optional dependency
    except ImportError:
        raise DepthToolsError(f"reading a .gguf file needs the gguf package: {GGUF_EXTRA}") from None
    return gguf


def open_gguf(path: Path):
    """A GGUFReader of `path`, or a one-line refusal for a missing, truncated or corrupt file."""
    gguf = _gguf()
    if not path.is_file():
        raise DepthToolsError(f"{path} does not exist (expected a .gguf file)")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct/numpy errors... on damaged files
        raise DepthToolsError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def metadata(reader) -> dict[str, Any]:
    """Every scalar/string/array field of the file as Python values (tensor data excluded)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # an unreadable field only matters if we need it; then `_need` names it
            continue
    return out


def _need(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise DepthToolsError(f"{path} has no GGUF metadata {key!r}, needed to rebuild the model's config")
    return meta[key]


def hf_config(meta: dict[str, Any], vocab_rows: int, tied: bool, path: Path) -> dict[str, Any]:
    """The HF config.json equivalent to the GGUF metadata (llama/qwen2/qwen3), or a one-line refusal."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise DepthToolsError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise DepthToolsError(f"{path}: GGUF {arch}.rope.scaling.type={scaling!r} is not supported (scaled RoPE "
                              "cannot be expressed exactly)")
    heads = int(_need(meta, f"{arch}.attention.head_count", path))
    d_model = int(_need(meta, f"{arch}.embedding_length", path))
    head_dim = int(meta.get(f"{arch}.attention.key_length", d_model // heads))
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise DepthToolsError(f"{path}: GGUF {arch}.rope.dimension_count={rope_dims} (partial rotary) is not "
                              f"supported for {arch}; expected {head_dim}")
    hf = {
        "model_type": ARCHITECTURES[arch][0],
        "vocab_size": vocab_rows,
        "hidden_size": d_model,
        "intermediate_size": int(_need(meta, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_need(meta, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_need(meta, f"{arch}.context_length", path)),
        "rms_norm_eps": float(_need(meta, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
    }
    if arch == "qwen3":
        hf["attention_bias"] = False
    for ours, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if key in meta:
            hf[ours] = int(meta[key])
    return hf


def unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation (per head, rows (2j, 2j+1) back to (j, j + hd/2))."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantize(tensor, path: Path) -> torch.Tensor:
    """Float32 values of one GGUF tensor in HF's (out, in) layout."""
    gguf = _gguf()
    qtype = tensor.tensor_type
    try:
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            values = np.asarray(tensor.data, dtype=np.float32)
        else:
            values = gguf.quants.dequantize(np.asarray(tensor.data), qtype)
    except NotImplementedError:
        raise DepthToolsError(f"{path}: tensor {tensor.name} has quantization type {qtype.name}, which the gguf "
                              "package cannot dequantize; re-quantize the file (e.g. Q8_0, F16)") from None
    except Exception as exc:
        raise DepthToolsError(f"{path}: tensor {tensor.name} ({qtype.name}) cannot be read: {exc}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists dimensions innermost first
    if int(np.prod(shape)) != values.size:
        raise DepthToolsError(f"{path}: tensor {tensor.name} holds {values.size} values, its shape {shape} implies "
                              f"{int(np.prod(shape))} (truncated file?)")
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def hf_tensors(reader, hf: dict[str, Any], permuted: bool, path: Path) -> dict[str, torch.Tensor]:
    """Every GGUF tensor under its HF name (q/k un-permuted where llama.cpp permuted them)."""
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in IGNORED_TENSORS:
            continue
        if name in GLOBAL_TENSORS:
            hf_name = GLOBAL_TENSORS[name]
        else:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in LAYER_TENSORS:
                raise DepthToolsError(f"{path}: unexpected GGUF tensor {name!r} for a {hf['model_type']} model")
            hf_name = f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
        value = _dequantize(tensor, path)
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hf["num_attention_heads"] if "attn_q" in name else hf["num_key_value_heads"]
            if value.shape[0] % (2 * heads):
                raise DepthToolsError(f"{path}: tensor {name} has {value.shape[0]} rows, not a multiple of 2 x {heads} heads")
            value = unpermute(value, heads)
        out[hf_name] = value
    return out


def gguf_tokenizer(meta: dict[str, Any], vocab_size: int):
    """(tokenizers.Tokenizer, None) rebuilt exactly from the file's metadata, or (None, why not).

    Rebuilt: byte-level BPE (`tokenizer.ggml.model` "gpt2") with GPT-2's own pre-tokenizer
    (`tokenizer.ggml.pre` "gpt2" or absent). Other pre-tokenizers (llama-bpe, qwen2, ...) are regexes
    llama.cpp keeps in C++, and SentencePiece ("llama") files store scores, not the model: neither can
    be rebuilt exactly here, so the weights are imported without a tokenizer.
    """
    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if model is None:
        return None, "the file has no tokenizer metadata"
    if model != "gpt2" or pre not in ("gpt2", "default"):
        return None, f"tokenizer model {model!r} with pre-tokenizer {pre!r} cannot be rebuilt exactly from GGUF"
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        return None, "the file's tokenizer has no tokens or merges"
    if len(tokens) > vocab_size:
        raise DepthToolsError(f"GGUF tokenizer has {len(tokens)} tokens but the embedding has only {vocab_size} rows")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, None


def vocab_record(meta: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer record of a GGUF import whose tokenizer could not be rebuilt: the vocabulary's identity
    (`vocab_fingerprint` of `tokenizer.ggml.tokens`), so `--data` prepared with another tokenizer is refused
    in one line (depthtools.analysis.tokens.checkpoint_data_dir) instead of being read as this model's ids.
    No file and no `fingerprint`: --text needs a tokenizer.json and is refused."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    return {"name": f"gguf-{meta.get('tokenizer.ggml.model')}-{len(tokens)}", "format": "gguf-vocab",
            "file": None, "vocab_fingerprint": vocab_fingerprint(tokens), "vocab_size": len(tokens),
            "sep_id": hf.get("eos_token_id")}


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """(HF config dict, HF-named float32 tensors, metadata) of a GGUF file."""
    path = Path(path)
    reader = open_gguf(path)
    meta = metadata(reader)
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise DepthToolsError(f"{path} has no token_embd.weight tensor (not a decoder language model?)")
    vocab_rows = int(names["token_embd.weight"].shape.tolist()[-1])
    hf = hf_config(meta, vocab_rows, tied="output.weight" not in names, path=path)
    permuted = ARCHITECTURES[meta["general.architecture"]][1]
    return hf, hf_tensors(reader, hf, permuted, path), meta


def import_gguf(path: str | Path, name: str | None = None, out: str | Path | None = None, force: bool = False,
                max_seq_len: int | None = None) -> dict[str, Any]:
    """Convert a GGUF file into a depthtools checkpoint (as `import_hf` does a folder); returns a summary.

    The file is translated into a temporary HF folder (config.json, model.safetensors, tokenizer.json
    when it can be rebuilt exactly) which `import_hf` imports, so every check and the all-or-nothing
    write of the HF path apply; the provenance then names the GGUF file.
    """
    path = Path(path)
    hf, tensors, meta = read_gguf(path)
    tokenizer, why = gguf_tokenizer(meta, hf["vocab_size"])
    staging = Path(tempfile.mkdtemp(prefix="depthtools-gguf-"))
    try:
        (staging / "config.json").write_text(json.dumps(hf), encoding="utf-8")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"))
        if tokenizer is not None:
            tokenizer.save(str(staging / "tokenizer.json"))
        summary = import_hf(staging, name=name, out=out, force=force, max_seq_len=max_seq_len)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    target = Path(summary["checkpoint"])
    config = read_json(target / CONFIG)
    config["source"] = {"format": f"gguf-{meta.get('general.architecture')}", "path": str(path.resolve()),
                        "hf_config": hf, "gguf_sha256": file_sha256(path),
                        "quantization": sorted({t.tensor_type.name for t in open_gguf(path).tensors})}
    if tokenizer is None and meta.get("tokenizer.ggml.tokens"):
        config["tokenizer"] = vocab_record(meta, hf)
    atomic_write_json(target / CONFIG, config)
    summary["source"] = str(path)
    summary["notes"] = [] if tokenizer is not None else [f"no tokenizer was carried: {why}"]
    return summary


__all__ = ["import_gguf", "read_gguf", "hf_config", "unpermute", "gguf_tokenizer", "ARCHITECTURES"]
