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
import math
import os
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from depthtools.data.tokenizer import vocab_fingerprint
from depthtools.errors import DepthToolsError
from depthtools.fsutil import StagingFolder, file_sha256
from depthtools.interop.llama import import_hf

GGUF_EXTRA = 'pip install -e ".[gguf]"'
# GGUF general.architecture -> HF model_type, and whether llama.cpp permuted q/k rows.
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}
# GGUF architectures transformers 5.x's GGUF loader converts to a family import-hf reads (its
# GGUF_SUPPORTED_ARCHITECTURES; tests/test_gguf.py checks the list): a refusal of one of them says how
TRANSFORMERS_CONVERTS = ("mistral", "phi3", "gpt2", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe")
# llama.cpp's general.architecture of the MoE Qwens -> the name transformers' GGUF loader lists them under
GGUF_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
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


# GGUF value type -> byte size of a scalar (8: string, 9: array are walked), from the GGUF specification
GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def peek_architecture(path: Path) -> str | None:
    """`general.architecture` read from the file's header alone (None if it cannot be found this way).

    The gguf package's reader parses every metadata array when it opens a file, which takes minutes for a
    256k-token vocabulary; an architecture we refuse anyway is refused before that. Walks the key/value
    pairs (little-endian GGUF v2/v3) until the key; the writer puts it first."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or struct.unpack("<I", f.read(4))[0] not in (2, 3):
                return None
            _tensors, pairs = struct.unpack("<QQ", f.read(16))

            def string() -> bytes:
                return f.read(struct.unpack("<Q", f.read(8))[0])

            def skip(kind: int) -> None:
                if kind == 8:
                    string()
                elif kind == 9:
                    item, count = struct.unpack("<IQ", f.read(12))
                    if item in GGUF_SCALAR_SIZES:
                        f.seek(count * GGUF_SCALAR_SIZES[item], 1)
                    else:
                        for _ in range(count):
                            skip(item)
                elif kind in GGUF_SCALAR_SIZES:
                    f.seek(GGUF_SCALAR_SIZES[kind], 1)
                else:
                    raise ValueError(kind)

            for _ in range(min(pairs, 4096)):
                key, kind = string(), struct.unpack("<I", f.read(4))[0]
                if key == b"general.architecture":
                    return string().decode("utf-8") if kind == 8 else None
                skip(kind)
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError):
        return None
    return None


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


def _number(meta: dict[str, Any], key: str, path: Path, kind: type, default: Any = None, minimum: float = 1,
            layered: bool = False) -> Any:
    """A GGUF metadata value as an int (kind int) or a float (kind float, an integer accepted) >= `minimum`;
    `default` when absent (None: required). For a `layered` key llama.cpp writes a per-layer array where layers
    differ (head counts, FFN sizes of some models): an array of equal entries is that one value, others are
    refused, as are strings, bools and arrays of other keys."""
    value = _need(meta, key, path) if default is None else meta.get(key, default)
    per_layer = isinstance(value, list)
    if per_layer and layered and value and all(v == value[0] for v in value):
        value = value[0]
    if per_layer and isinstance(value, list):
        why = ("per-layer values that differ are not supported" if value and layered else "an empty array" if layered
               else f"expected {'an integer' if kind is int else 'a number'}, not an array")
    elif isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        why = f"expected {'an integer' if kind is int else 'a number'}"
    elif not math.isfinite(value) or value < minimum:
        why = f"expected a {'number' if kind is float else 'value'} >= {minimum:g}"
    else:
        return kind(value)
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise DepthToolsError(f"{path}: GGUF metadata {key}={shown} ({why})")


def unsupported_architecture(arch: Any, path: Path) -> DepthToolsError:
    """The refusal of a GGUF architecture this importer does not read; where transformers' GGUF loader converts
    it to a family import-hf reads (`TRANSFORMERS_CONVERTS`), it says how."""
    line = f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
    if isinstance(arch, str) and GGUF_NAMES.get(arch, arch) in TRANSFORMERS_CONVERTS:
        line += (f"; transformers converts a {arch} GGUF to a Hugging Face folder, which import-hf reads: "
                 f"AutoModelForCausalLM.from_pretrained(DIR, gguf_file={path.name!r}).save_pretrained(OUT) (and "
                 f"AutoTokenizer the same way), then depthtools import-hf OUT")
    return DepthToolsError(line)


def hf_config(meta: dict[str, Any], vocab_rows: int, tied: bool, path: Path) -> dict[str, Any]:
    """The HF config.json equivalent to the GGUF metadata (llama/qwen2/qwen3), or a one-line refusal naming the file."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise unsupported_architecture(arch, path)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise DepthToolsError(f"{path}: GGUF {arch}.rope.scaling.type={scaling!r} is not supported (scaled RoPE "
                              "cannot be expressed exactly)")
    heads = _number(meta, f"{arch}.attention.head_count", path, int, layered=True)
    d_model = _number(meta, f"{arch}.embedding_length", path, int)
    head_dim = _number(meta, f"{arch}.attention.key_length", path, int, default=max(1, d_model // heads))
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and _number(meta, f"{arch}.rope.dimension_count", path, int) != head_dim:
        raise DepthToolsError(f"{path}: GGUF {arch}.rope.dimension_count={rope_dims} (partial rotary) is not "
                              f"supported for {arch}; expected {head_dim}")
    hf = {
        "model_type": ARCHITECTURES[arch][0],
        "vocab_size": vocab_rows,
        "hidden_size": d_model,
        "intermediate_size": _number(meta, f"{arch}.feed_forward_length", path, int, layered=True),
        "num_hidden_layers": _number(meta, f"{arch}.block_count", path, int),
        "num_attention_heads": heads,
        "num_key_value_heads": _number(meta, f"{arch}.attention.head_count_kv", path, int, default=heads, layered=True),
        "head_dim": head_dim,
        "max_position_embeddings": _number(meta, f"{arch}.context_length", path, int),
        "rms_norm_eps": _number(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, float, minimum=0),
        "rope_theta": _number(meta, f"{arch}.rope.freq_base", path, float, default=10000.0, minimum=0),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
    }
    if arch == "qwen3":
        hf["attention_bias"] = False
    for ours, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if key in meta:
            hf[ours] = _number(meta, key, path, int, minimum=0)
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


def bpe_parts(tokens: list[Any], merges: list[Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocabulary, merge pairs) of a GGUF byte-level BPE, or a one-line refusal of what `tokenizers` would choke
    on or silently get wrong: a token listed twice (one id would vanish), a merge that is not two tokens
    separated by a space, a merge of (or into) a token the list lacks."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise DepthToolsError(f"GGUF tokenizer.ggml.tokens[{i}]={token!r} is not a string")
        if token in vocab:
            raise DepthToolsError(f"GGUF tokenizer.ggml.tokens lists {token!r} twice (ids {vocab[token]} and {i}); "
                                  "each token must have one id")
        vocab[token] = i
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2 or not all(parts):
            raise DepthToolsError(f"GGUF tokenizer.ggml.merges entry {merge!r} is not two tokens separated by one space")
        unknown = next((t for t in (*parts, "".join(parts)) if t not in vocab), None)
        if unknown is not None:
            raise DepthToolsError(f"GGUF tokenizer.ggml.merges entry {merge!r} merges into or from {unknown!r}, which "
                                  "is not in tokenizer.ggml.tokens")
        pairs.append((parts[0], parts[1]))
    return vocab, pairs


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

    vocab, pairs = bpe_parts(tokens, merges)
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
    _gguf()
    arch = peek_architecture(path) if path.is_file() else None
    if arch is not None and arch not in ARCHITECTURES:  # before the reader parses the whole vocabulary
        raise unsupported_architecture(arch, path)
    reader = open_gguf(path)
    meta = metadata(reader)
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise DepthToolsError(f"{path} has no token_embd.weight tensor (not a decoder language model?)")
    vocab_rows = int(names["token_embd.weight"].shape.tolist()[-1])
    hf = hf_config(meta, vocab_rows, tied="output.weight" not in names, path=path)
    permuted = ARCHITECTURES[meta["general.architecture"]][1]
    return hf, hf_tensors(reader, hf, permuted, path), meta


@contextmanager
def _naming(path: Path, staging: Path | None = None):
    """Refusals raised inside name the .gguf file, never the temporary folder it was converted into (deleted by
    the time the user reads the line): `staging/x` reads as `x`, and a line without the file's name is prefixed."""
    try:
        yield
    except DepthToolsError as exc:
        line = str(exc)
        if staging is not None:
            line = line.replace(f"{staging}{os.sep}", "").replace(str(staging), "the converted model")
        if str(path) not in line:
            line = f"{path}: {line}"
        raise DepthToolsError(line) from None


def import_gguf(path: str | Path, name: str | None = None, out: str | Path | None = None, force: bool = False,
                max_seq_len: int | None = None) -> dict[str, Any]:
    """Convert a GGUF file into a depthtools checkpoint (as `import_hf` does a folder); returns a summary.

    The file is translated into a temporary HF folder (config.json, model.safetensors, tokenizer.json
    when it can be rebuilt exactly) which `import_hf` imports, so every check and the all-or-nothing
    write of the HF path apply; the provenance then names the GGUF file. The temporary folder
    (`<tmp>/.depthtools-gguf.<random>.convert.tmp`) is owned (`fsutil.StagingFolder`), so one left by a killed
    import is removed by the next GGUF import, never one of an import still running.
    """
    path = Path(path)
    with _naming(path):
        hf, tensors, meta = read_gguf(path)
        tokenizer, why = gguf_tokenizer(meta, hf["vocab_size"])
    source = {"format": f"gguf-{meta.get('general.architecture')}", "path": str(path.resolve()), "hf_config": hf,
              "gguf_sha256": file_sha256(path), "quantization": sorted({t.tensor_type.name for t in open_gguf(path).tensors})}
    scratch = StagingFolder(Path(tempfile.gettempdir()) / "depthtools-gguf", ".convert.tmp")  # owned: a killed
    staging = scratch.path  # import's converted weights are removed by the next GGUF import (only ever discarded)
    try:
        (staging / "config.json").write_text(json.dumps(hf), encoding="utf-8")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"))
        if tokenizer is not None:
            tokenizer.save(str(staging / "tokenizer.json"))
        with _naming(path, staging):
            record = vocab_record(meta, hf) if tokenizer is None and meta.get("tokenizer.ggml.tokens") else None
            summary = import_hf(staging, name=name, out=out, force=force, max_seq_len=max_seq_len, source=source,
                                tokenizer_record=record)
    finally:
        scratch.discard()
    summary["source"] = str(path)
    summary["notes"] = [*summary.get("notes", []), *([] if tokenizer is not None else [f"no tokenizer was carried: {why}"])]
    return summary


__all__ = ["import_gguf", "read_gguf", "hf_config", "unpermute", "gguf_tokenizer", "ARCHITECTURES"]
