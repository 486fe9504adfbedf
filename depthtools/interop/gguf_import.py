"""GGUF (llama.cpp's single-file format) -> a depthtools checkpoint, through the Hugging Face path.

A GGUF file is read with the `gguf` package (an optional extra: pip install -e ".[gguf]"), imported
lazily so depthtools works without it. Its metadata is translated to the `config.json` the same model
has on the Hugging Face hub and its tensors to the HF tensor names, dequantized to float32 with
`gguf.quants.dequantize`; from there the families' own map (depthtools.interop.families) builds the
ModelConfig and the state dict, so a GGUF import and an HF import of one model give the same
checkpoint (up to the quantization the file itself carries).

llama.cpp's converter permutes the rows of q/k for `llama` (its RoPE pairs (2j, 2j+1) where HF's
rotate_half pairs (j, j + hd/2)); `unpermute` undoes that permutation exactly. Qwen2/Qwen3 are
written unpermuted (their RoPE is the NEOX pairing llama.cpp applies as is), as are Gemma, Gemma-2 and
Gemma-3, whose RMSNorm gains llama.cpp stores as 1 + w (its runtime multiplies by the stored gain, HF's
model by 1 + w): the import subtracts the 1. Gemma settings llama.cpp keeps in its runtime rather than the
file (query scale, sliding-layer pattern, Gemma-3's local RoPE base) are set as that runtime sets them.
The tokenizer is rebuilt by depthtools.interop.gguf_tokenizer. Architectures whose GGUF layout differs
further (fused tensors, experts, ...) are refused.
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

from depthtools.data.tokenizer import vocab_fingerprint
from depthtools.errors import DepthToolsError
from depthtools.fsutil import StagingFolder, file_sha256
from depthtools.interop.gguf_tokenizer import gguf_tokenizer
from depthtools.interop.llama import import_hf

GGUF_EXTRA = 'pip install -e ".[gguf]"'
# GGUF general.architecture -> HF model_type, and whether llama.cpp permuted q/k rows.
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
                 "gemma": ("gemma", False), "gemma2": ("gemma2", False), "gemma3": ("gemma3_text", False)}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales queries by n_embd/n_head for these (27B)
# GGUF architectures transformers 5.x's GGUF loader converts to a family import-hf reads (its
# GGUF_SUPPORTED_ARCHITECTURES; tests/test_gguf.py checks the list): a refusal of one of them says how
TRANSFORMERS_CONVERTS = ("mistral", "phi3", "gpt2", "qwen2_moe", "qwen3_moe")
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
# Gemma-2/3 (sandwich norms): llama.cpp's names of the four per-layer norms
GEMMA2_LAYER_TENSORS = {**LAYER_TENSORS, "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency RoPE divisors (Llama-3.1+'s llama3 scaling): see rope_freqs
IGNORED_TENSORS = (ROPE_FREQS,)  # not a weight: applied through the config


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


def _rope_scaling(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """HF `rope_scaling` of the file's `rope.scaling.type`: none, or linear (llama.cpp's freq_scale = 1/factor,
    transformers' linear type; for Gemma-3 it scales the full-attention layers only, in both). Other types are
    refused: their parameters are not all in the metadata (llama3's divisors are a tensor: `rope_freqs`)."""
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling != "linear":
        raise DepthToolsError(f"{path}: GGUF {arch}.rope.scaling.type={scaling!r} is not supported (only linear RoPE "
                              "scaling can be expressed exactly)")
    return {"rope_type": "linear", "factor": _number(meta, f"{arch}.rope.scaling.factor", path, float, minimum=1e-9)}


def _gemma_config(meta: dict[str, Any], arch: str, hf: dict[str, Any], path: Path) -> dict[str, Any]:
    """The Gemma-specific config.json keys llama.cpp's runtime implies.

    query_pre_attn_scalar: `attention.scale` where written (scale = scalar^-1/2), else llama.cpp's rule:
    n_embd / n_head for the 27B models (46 layers for Gemma-2, 62 for Gemma-3), the head dim otherwise.
    Softcaps: from the metadata; absent, llama.cpp's defaults (Gemma-2: 50 on attention logits, 30 on the output). Sliding layers: llama.cpp's pattern (every 2nd layer
    full for Gemma-2, every 6th for Gemma-3, or `attention.sliding_window_pattern`); Gemma-3's sliding layers
    use RoPE base 10000 (llama.cpp's fixed value)."""
    out: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma":
        return out
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None:
        out["query_pre_attn_scalar"] = _number(meta, f"{arch}.attention.scale", path, float, minimum=1e-12) ** -2
    elif hf["num_hidden_layers"] == GEMMA_27B_LAYERS[arch]:
        out["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"]
    else:
        out["query_pre_attn_scalar"] = hf["head_dim"]
    for key, gemma2_default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        default = gemma2_default if arch == "gemma2" else None  # llama.cpp's: Gemma-2 always caps, Gemma-3 never
        out[key] = _number(meta, f"{arch}.{key}", path, float, minimum=0) if f"{arch}.{key}" in meta else default
    window = meta.get(f"{arch}.attention.sliding_window")
    out["sliding_window"] = _number(meta, f"{arch}.attention.sliding_window", path, int) if window is not None else 4096
    out["layer_types"] = _gemma_layer_types(meta, arch, hf["num_hidden_layers"], path)
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
    return out


def _gemma_layer_types(meta: dict[str, Any], arch: str, n_layer: int, path: Path) -> list[str]:
    """Per-layer attention kinds: `attention.sliding_window_pattern` (an int n: every n-th layer full; or one
    bool per layer, true = sliding) else llama.cpp's fixed pattern (2 for Gemma-2, 6 for Gemma-3)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = meta.get(key, 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list) and len(pattern) == n_layer and all(isinstance(v, (bool, int)) for v in pattern):
        sliding = [bool(v) for v in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        sliding = [bool((i + 1) % pattern) for i in range(n_layer)]
    else:
        raise DepthToolsError(f"{path}: GGUF metadata {key}={pattern!r} (expected an integer >= 1 or one bool per layer)")
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def hf_config(meta: dict[str, Any], vocab_rows: int, tied: bool, path: Path) -> dict[str, Any]:
    """The HF config.json equivalent to the GGUF metadata (llama/qwen2/qwen3/gemma/gemma2/gemma3), or a
    one-line refusal naming the file."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise unsupported_architecture(arch, path)
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
    scaling = _rope_scaling(meta, arch, path)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    if arch == "qwen3":
        hf["attention_bias"] = False
    if arch.startswith("gemma"):
        hf.update(_gemma_config(meta, arch, hf, path))
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


def layer_names(hf: dict[str, Any]) -> dict[str, str]:
    """GGUF blk.N.<name> -> HF model.layers.N.<name> for the config's family."""
    return GEMMA2_LAYER_TENSORS if hf["model_type"] in ("gemma2", "gemma3_text") else LAYER_TENSORS


def hf_tensors(reader, hf: dict[str, Any], permuted: bool, path: Path) -> dict[str, torch.Tensor]:
    """Every GGUF tensor under its HF name (q/k un-permuted where llama.cpp permuted them; Gemma's RMSNorm
    gains, which llama.cpp's converter stores as 1 + w because its runtime multiplies by the stored gain, back
    to HF's w, which the model multiplies by 1 + w)."""
    out: dict[str, torch.Tensor] = {}
    names = layer_names(hf)
    gemma = hf["model_type"].startswith("gemma")
    for tensor in reader.tensors:
        name = tensor.name
        if name in IGNORED_TENSORS:
            continue
        if name in GLOBAL_TENSORS:
            hf_name = GLOBAL_TENSORS[name]
        else:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in names:
                raise DepthToolsError(f"{path}: unexpected GGUF tensor {name!r} for a {hf['model_type']} model")
            hf_name = f"model.layers.{parts[1]}.{names[parts[2]]}"
        value = _dequantize(tensor, path)
        if gemma and name.endswith("norm.weight"):
            value = value - 1.0
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hf["num_attention_heads"] if "attn_q" in name else hf["num_key_value_heads"]
            if value.shape[0] % (2 * heads):
                raise DepthToolsError(f"{path}: tensor {name} has {value.shape[0]} rows, not a multiple of 2 x {heads} heads")
            value = unpermute(value, heads)
        out[hf_name] = value
    return out


def vocab_record(meta: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer record of a GGUF import whose tokenizer could not be rebuilt: the vocabulary's identity
    (`vocab_fingerprint` of `tokenizer.ggml.tokens`), so `--data` prepared with another tokenizer is refused
    in one line (depthtools.analysis.tokens.checkpoint_data_dir) instead of being read as this model's ids.
    No file and no `fingerprint`: --text needs a tokenizer.json and is refused."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    return {"name": f"gguf-{meta.get('tokenizer.ggml.model')}-{len(tokens)}", "format": "gguf-vocab",
            "file": None, "vocab_fingerprint": vocab_fingerprint(tokens), "vocab_size": len(tokens),
            "sep_id": hf.get("eos_token_id")}


def rope_freqs(hf: dict[str, Any], factors: torch.Tensor, path: Path) -> None:
    """Apply llama.cpp's `rope_freqs` tensor to the HF config, exactly.

    llama.cpp's converter writes Llama-3.1+'s llama3 RoPE scaling as one divisor per frequency (theta_i =
    pos * base^(-2i/d) / rope_freqs[i]), not as its parameters. All ones: plain RoPE. Otherwise the config gets
    those divisors as they are: transformers' `longrope` with short = long factors = rope_freqs and attention
    factor 1 computes exactly theta_i / rope_freqs[i] at every length (llama3's smooth blend reproduced by its
    own output, not refitted). With another rope.scaling in the metadata, or of the wrong size, it is refused."""
    values = [float(v) for v in factors.reshape(-1).tolist()]
    if values and all(v == 1.0 for v in values):
        return
    pairs = hf["head_dim"] // 2
    if len(values) != pairs or not all(math.isfinite(v) and v > 0 for v in values):
        raise DepthToolsError(f"{path}: tensor {ROPE_FREQS} has {len(values)} values; expected {pairs} positive "
                              "finite RoPE divisors (one per frequency of the head dimension)")
    if "rope_scaling" in hf:
        raise DepthToolsError(f"{path}: tensor {ROPE_FREQS} and {hf['rope_scaling']['rope_type']} rope.scaling "
                              "together are not supported")
    hf["rope_scaling"] = {"rope_type": "longrope", "short_factor": values, "long_factor": values, "factor": 1.0,
                          "attention_factor": 1.0}


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
    if ROPE_FREQS in names:
        rope_freqs(hf, _dequantize(names[ROPE_FREQS], path), path)
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
