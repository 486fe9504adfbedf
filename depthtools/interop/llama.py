"""Hugging Face Llama <-> depthtools `preln`: the config map, the weight map, import and export.

A `preln` DepthModel *is* a Llama decoder: RMSNorm before each sublayer (`input_layernorm`,
`post_attention_layernorm`), RoPE with HF's `rotate_half` pairing (i, i+hd/2), grouped-query
attention without biases, SwiGLU `down(silu(gate x) · up x)`, a final RMSNorm and an optionally
tied head. The export map is a pure renaming; no tensor is transposed or permuted, so an export
followed by an import gives back every weight bit for bit. Export writes Llama only.

Import reads every family of `depthtools.interop.families` (Llama, Mistral, Qwen2/3, Gemma 1/2/3,
OLMo 1/2, GPT-2, GPT-NeoX, Phi-3, Phi-1/1.5/2, and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)
into `preln` with the Pre-LN block options that express it (scaled RoPE included).
Only safetensors and JSON are read (never pickles), and `transformers` is not needed for either
direction; it is only needed to *use* an exported directory. Configs our model cannot express
exactly are refused with a one-line `DepthToolsError` naming the field. Sliding windows (Mistral,
read as transformers reads them: `transformers_sliding_window`) are applied exactly.

A folder too large to import in memory (which holds the source, its float32 state and the float32 model) is
streamed (`import_hf(stream=...)`, issue 45): each HF tensor is read alone (`HFWeights`), converted by the same
family map (`families.hf_state_stream`) and written into safetensors shards in its own dtype
(`checkpoint.write_sharded`), so memory stays at about one shard plus one tensor; the checkpoint loads to the
in-memory import's float32 model bit for bit.

Accuracy: the same function as transformers; logits differ only by RoPE rounding (our tables are
computed in float64, transformers' angles in float32), a gap that grows with sequence length and
attention sharpness (~1e-6 at T=64 up to ~1e-3 at T=2048 on tiny random models;
benchmarks/import_accuracy.py and benchmarks/RESULTS.md). With float32 tables they are bit-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from depthtools import __version__
from depthtools.arch import DepthModel, canonical_name, get_arch
from depthtools.checkpoint import (
    CONFIG,
    atomic_save_tensors,
    atomic_write_json,
    check_shapes,
    checkpoints_root,
    load,
    model_state,
    read_header,
    read_json,
    read_tensors,
    resolve,
    save,
    tensor_problem,
    weight_files,
    write_sharded,
)
from depthtools.config import ModelConfig
from depthtools.data.tokenizer import tokenizer_file_fingerprint
from depthtools.errors import CheckpointError, DepthToolsError
from depthtools.fsutil import StagingFolder, check_dir_target, check_name, dir_mode, file_sha256, replace_dir
from depthtools.interop.checks import check_special_ids, validate_imported_weights, validate_tokenizer
from depthtools.interop.families import (
    Step,
    head_from_file,
    hf_state,
    hf_state_plan,
    hf_state_stream,
    hf_to_model_config as family_config,
    untied_note,
)
from depthtools.interop.tokenizer import HF_CARRIED_FILES, HF_TOKENIZER_FILES, import_separator, resolve_tokenizer

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
SOURCE_FILE = "depthtools_source.json"  # provenance written beside an exported model
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig.sliding_window when config.json has no key
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed from theta
IMPORT_STAGING = ".import.tmp"  # suffix of every import's hidden staging folder `.<target>.<random>.import.tmp`


# -- names ---------------------------------------------------------------------------------------
def _layer_map(i: int) -> dict[str, str]:
    """depthtools name -> HF name for block i."""
    ours, hf = f"blocks.{i}.", f"model.layers.{i}."
    return {
        ours + "attn_norm.weight": hf + "input_layernorm.weight",
        ours + "attn.w_q.weight": hf + "self_attn.q_proj.weight",
        ours + "attn.w_k.weight": hf + "self_attn.k_proj.weight",
        ours + "attn.w_v.weight": hf + "self_attn.v_proj.weight",
        ours + "attn.w_o.weight": hf + "self_attn.o_proj.weight",
        ours + "mlp_norm.weight": hf + "post_attention_layernorm.weight",
        ours + "mlp.w1.weight": hf + "mlp.gate_proj.weight",
        ours + "mlp.w3.weight": hf + "mlp.up_proj.weight",
        ours + "mlp.w2.weight": hf + "mlp.down_proj.weight",
    }


def weight_name_map(cfg: ModelConfig) -> dict[str, str]:
    """depthtools state-dict name -> HF `LlamaForCausalLM` name (the tied head is omitted)."""
    names = {"tok_embed.weight": "model.embed_tokens.weight", "ln_final.weight": "model.norm.weight"}
    for i in range(cfg.n_layer):
        names.update(_layer_map(i))
    if not cfg.tie_embeddings:
        names["unembed.weight"] = "lm_head.weight"
    return names


# -- configs -------------------------------------------------------------------------------------
def transformers_sliding_window(hf: dict[str, Any]) -> int | None:
    """The attention window transformers applies for this config.json (None: full causal).

    What transformers 5.25 does, read from its source (4.x not checked): `MistralConfig.sliding_window`
    defaults to 4096 when the key is absent, `"sliding_window": null` means full causal, and
    `MistralAttention` / the mask read only `config.sliding_window` -- `use_sliding_window` (a
    Qwen2 field) is never read by Mistral, so a window set beside `"use_sliding_window": false`
    still applies. `LlamaForCausalLM` reads neither key (full causal whatever the config says).
    With window W, query q attends to keys k with q - W < k <= q (`sliding_window_overlay`).
    """
    if hf.get("model_type") != "mistral":
        return None
    window = hf.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise DepthToolsError(f"unsupported Hugging Face config: sliding_window={window!r} (expected a positive "
                              "integer or null)")
    return window


def hf_to_model_config(hf: dict[str, Any], max_seq_len: int | None = None) -> ModelConfig:
    """The `preln` ModelConfig equivalent to a supported family's `config.json` (Llama, Mistral, Qwen2/3,
    Gemma 1/2/3, OLMo 1/2, GPT-2, GPT-NeoX, Phi-3, Phi, Mixtral, Qwen2/3-MoE, OLMoE:
    depthtools.interop.families), or a one-line refusal."""
    return family_config(hf, max_seq_len)


def model_config_to_hf(cfg: ModelConfig, special_ids: dict[str, int | None] | None = None,
                       dtype: str = "float32") -> dict[str, Any]:
    """A `LlamaForCausalLM` config.json for a `preln` ModelConfig (readable by transformers 4.x and 5.x)."""
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **(special_ids or {})}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,  # transformers 4.x
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers 5.x
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        **ids,
    }


# -- reading an HF directory ---------------------------------------------------------------------
def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a local HF model directory (a depthtools checkpoint is named as such)."""
    path = Path(path)
    if not path.is_dir():
        raise DepthToolsError(f"{path} is not a directory (expected a local Hugging Face model directory)")
    file = path / HF_CONFIG
    if not file.is_file():
        raise DepthToolsError(f"{path} is not a Hugging Face model directory (no {HF_CONFIG})")
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DepthToolsError(f"corrupt JSON {file}: {exc}") from None
    if not isinstance(hf, dict):
        raise DepthToolsError(f"{file} is not a JSON object")
    if "depthtools_version" in hf and "model" in hf:
        raise DepthToolsError(f"{path} is a depthtools checkpoint, not a Hugging Face model directory")
    return hf


def read_weight_map(path: str | Path) -> dict[str, str] | None:
    """The `weight_map` of a folder's model.safetensors.index.json (None: no index), checked before any shard is
    opened: an object of tensor name -> shard file name, each shard inside the folder. Like transformers
    (`_check_shard_filenames_stay_in_model_dir`), an absolute name or one with a `..` part is refused, not
    resolved (hub-cache shards are symlinks)."""
    index = Path(path) / HF_INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise DepthToolsError(f"corrupt {index}: {type(exc).__name__}: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise DepthToolsError(f"corrupt {index}: weight_map must be an object of tensor name -> shard file name")
    for shard in sorted(set(weight_map.values())):
        if Path(shard).anchor or ".." in Path(shard).parts:
            raise DepthToolsError(f"{index} names a shard outside the model folder: {shard!r} (shards must be files "
                                  "of the folder)")
    return weight_map


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors HF checkpoint; pickled weights are refused."""
    path = Path(path)
    weight_map = read_weight_map(path)
    if weight_map is not None:
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(read_tensors(path / shard))
        return tensors
    if (path / HF_WEIGHTS).is_file():
        return read_tensors(path / HF_WEIGHTS)
    raise _no_weights(path)


def hf_weights_file(path: str | Path) -> Callable[[str], Path]:
    """Tensor name -> the safetensors file of `path` that holds it (the index's shard, else model.safetensors),
    so an error about one tensor names the file to look at."""
    path = Path(path)
    weight_map = read_weight_map(path) or {}
    return lambda name: path / str(weight_map.get(name, HF_WEIGHTS))


def hf_state_to_depthtools(tensors: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                           source: str | Path | None = None) -> dict[str, torch.Tensor]:
    """Rename (and split / transpose, per the family's map) HF tensors to depthtools names, cast to `dtype`;
    refuses missing or unexpected weights, shapes that disagree with the config and (before any cast)
    weights `checkpoint.load` would refuse: non-floating dtypes, NaN/inf entries. `source`: the HF folder,
    whose file (the shard of a sharded checkpoint) those refusals name."""
    used = {k: v for k, v in tensors.items() if not k.endswith(IGNORED_HF_SUFFIXES)}
    validate_imported_weights(used, hf_weights_file(source) if source is not None else "the Hugging Face weights")
    with torch.device("meta"):  # names and shapes only: nothing of the model's size is allocated
        expected = {k: tuple(v.shape) for k, v in model_state(DepthModel(cfg)).items()}
    return hf_state(tensors, cfg, expected, dtype)


def _load_state(model, state: dict[str, torch.Tensor], where: str) -> None:
    expected = model_state(model)
    for key, value in expected.items():
        if tuple(state[key].shape) != tuple(value.shape):
            raise DepthToolsError(f"{where}: {key} has shape {tuple(state[key].shape)}, config implies {tuple(value.shape)}")
    with torch.no_grad():
        model.load_state_dict(state, strict=False)  # a tied unembedding shares tok_embed's storage


def from_hf(path: str | Path, max_seq_len: int | None = None, dtype: torch.dtype = torch.float32):
    """A `preln` DepthModel (eval mode) with the weights of a local Llama-family HF checkpoint.

    `path` holds config.json + model.safetensors (or a safetensors index with shards). Half-precision
    weights are cast to `dtype` (float32 by default: exact). `max_seq_len` overrides
    `max_position_embeddings` (the longest sequence the model accepts); for a Mistral whose sliding
    window is shorter than that context, pass max_seq_len <= the window (otherwise refused). A tied config
    whose weights hold a different head is read untied with the file's head, as transformers 5.x loads it
    (`families.head_from_file`).
    """
    path = Path(path)
    cfg = hf_to_model_config(read_hf_config(path), max_seq_len)
    tensors = read_hf_tensors(path)
    cfg = head_from_file(tensors, cfg)  # a tied config with its own head in the file: transformers keeps the head
    state = hf_state_to_depthtools(tensors, cfg, dtype, source=path)
    check_shapes(cfg, {k: tuple(v.shape) for k, v in state.items()}, path)  # before a model of cfg's size exists
    model = DepthModel(cfg)
    _load_state(model, state, str(path))
    return model.to(dtype).eval()


def _tokenizer_size(file: Path) -> int | None:
    """Vocabulary size of a tokenizers JSON file (None if it cannot be read)."""
    try:
        return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception:  # tokenizers raises plain Exception subclasses; the file is only carried along
        return None


def _tokenizer_fingerprint(file: Path) -> str:
    """A tokenizer.json's fingerprint as `data prepare` computes it (one tokenizer, one fingerprint), so data
    prepared with the imported folder's tokenizer.json is accepted for the imported checkpoint; a
    tokenizer.model (SentencePiece, not read by data prepare) is fingerprinted by its bytes."""
    return (tokenizer_file_fingerprint(file) if file.name == "tokenizer.json" else None) or file_sha256(file)


def _tokenizer_record(path: Path, hf: dict[str, Any], carried: list[str],
                      tokenizer_record: dict[str, Any] | None) -> dict[str, Any] | None:
    """config.json's "tokenizer" of an import: the carried tokenizer file's record, else `tokenizer_record`."""
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        return tokenizer_record
    main = "tokenizer.json" if (path / "tokenizer.json").is_file() else "tokenizer.model"
    size = _tokenizer_size(path / main) if main == "tokenizer.json" else None
    return {"name": "huggingface", "format": "huggingface", "file": main, "files": [
        f for f in carried if f in HF_TOKENIZER_FILES], "fingerprint": _tokenizer_fingerprint(path / main),
        "vocab_size": size, **import_separator(path, hf)}  # data prepare's separator rule


def import_hf(path: str | Path, name: str | None = None, out: str | Path | None = None, force: bool = False,
              max_seq_len: int | None = None, source: dict[str, Any] | None = None,
              tokenizer_record: dict[str, Any] | None = None, stream: bool | None = None) -> dict[str, Any]:
    """Convert a local HF Llama directory into a depthtools checkpoint; returns a summary dict.

    The checkpoint lands in `out`, or `$DEPTHTOOLS_CHECKPOINTS/<name>`. Tokenizer files (and
    generation_config.json) are copied beside the weights; config.json records the HF config under
    "source" (or `source`, the provenance a converting caller such as `import_gguf` gives) and the
    tokenizer under "tokenizer" (or `tokenizer_record` when no tokenizer file is carried: a GGUF import's
    vocabulary fingerprint). An existing checkpoint is kept unless `force`; with `force` the whole
    folder is replaced. All or nothing: the new checkpoint is written in a hidden folder beside the
    target and swapped in by renames, so a failure at any point (a full disk) leaves the old one intact;
    the hidden folder of an import that was killed is removed by the next import of the same target
    (`fsutil.StagingFolder`: only when its owner process is gone, one line on stderr).

    `stream`: write the weights tensor by tensor (`plan_streamed`, `write_streamed`: memory about one shard
    plus one tensor, shards in the source's dtype) instead of building the float32 model in memory (one
    float32 model.safetensors); None: stream when the in-memory import would not fit (`stream_wanted`). Both
    checkpoints load to the same float32 model, bit for bit.
    """
    path = Path(path)
    hf = read_hf_config(path)
    target = import_target(name, out, force)
    carried = [f for f in HF_CARRIED_FILES if (path / f).is_file()]
    cfg = hf_to_model_config(hf, max_seq_len)
    # Everything is checked before the target is touched: a refusal leaves no half-written checkpoint
    # (and a forced re-import over an existing one leaves that one as it was).
    check_special_ids(hf, cfg.vocab_size, path / HF_CONFIG)
    validate_tokenizer(path, cfg.vocab_size, tuple(carried))
    weights = _streamed_weights(path, stream)
    plan = plan_streamed(weights, cfg) if weights is not None else None
    model = from_hf(path, max_seq_len) if plan is None else None
    config, params = (model.config, model.param_counts()) if plan is None else (plan.cfg, plan.params)
    notes = [untied_note(hf)] if config.tie_embeddings != cfg.tie_embeddings else []
    tokenizer = _tokenizer_record(path, hf, carried, tokenizer_record)
    if source is None:
        source = {"format": f"huggingface-{hf.get('model_type')}", "path": str(path.resolve()), "hf_config": hf,
                  "weights_sha256": {f.name: file_sha256(f) for f in sorted(path.glob("*.safetensors"))}}
    extra = {"source": source, "tokenizer": tokenizer, "train": None}
    with StagingFolder(target, IMPORT_STAGING) as staging:  # a killed import's leftover is removed here
        for file in carried:
            shutil.copyfile(path / file, staging / file)
        if plan is None:
            save(model, staging, extra=extra)
        else:
            notes.append(write_streamed(staging, weights, plan, extra, target))
    return {"checkpoint": str(target), "model": config.to_dict(), "params": params,
            "tokenizer_files": [f for f in carried if f in HF_TOKENIZER_FILES], "carried": carried, "notes": notes}


# -- a streamed import: one tensor at a time -------------------------------------------------------------------------
STREAM_SHARD_BYTES = 1 << 30  # the shards of a streamed import (its memory: about one shard plus one tensor)
IN_MEMORY_COPIES = 3  # float32 copies of the weights an in-memory import holds at its peak (`stream_wanted`)
KEPT_DTYPES = ("bfloat16", "float16", "float32")  # a streamed import stores these as they are, others as float32
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                      "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
                      "BOOL": "bool"}  # safetensors header dtype -> torch dtype name


def _no_weights(path: Path) -> DepthToolsError:
    """Why a folder without model.safetensors or an index cannot be imported (pickles are never read)."""
    pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
    if pickled:
        return DepthToolsError(f"{path} has only pickled weights ({pickled[0]}); depthtools reads safetensors only "
                               "(re-save with save_pretrained(..., safe_serialization=True))")
    return DepthToolsError(f"{path} has no {HF_WEIGHTS} or {HF_INDEX}")


def hf_weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the files' headers alone: the shards the index names
    (a name in two shards: the later one's, as `read_hf_tensors` reads them) or model.safetensors; a damaged
    file or a folder of pickles only is refused as `read_hf_tensors` refuses it."""
    path = Path(path)
    weight_map = read_weight_map(path)
    if weight_map is not None:
        files = [path / shard for shard in sorted(set(weight_map.values()))]
    elif (path / HF_WEIGHTS).is_file():
        files = [path / HF_WEIGHTS]
    else:
        raise _no_weights(path)
    where: dict[str, Path] = {}
    for file in files:
        where.update(dict.fromkeys(read_header(file), file))
    return where


class HFWeights(Mapping):
    """The tensors of a Hugging Face folder by name, each read from its file only when asked (`safe_open` per
    tensor, so nothing else of the folder stays in memory) and refused there as the in-memory import refuses it
    (`validate_imported_weights`: NaN/inf, non-floating dtypes). `meta`: name -> a `meta` tensor of the stored
    shape and dtype (headers only), for every check that needs no value."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = hf_weight_files(self.path)
        self.meta: dict[str, torch.Tensor] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as handle:  # whole by read_header above
                for name in handle.keys():
                    if self.files.get(name) == file:
                        view = handle.get_slice(name)
                        self.meta[name] = self._meta(file, name, view.get_dtype(), view.get_shape())

    @staticmethod
    def _meta(file: Path, name: str, code: str, shape: list[int]) -> torch.Tensor:
        dtype = getattr(torch, SAFETENSORS_DTYPES.get(str(code).upper(), ""), None)
        if not isinstance(dtype, torch.dtype):
            raise DepthToolsError(f"cannot import {file}: tensor {name} has dtype {code}, expected a floating-point "
                                  "dtype")
        return torch.empty([int(d) for d in shape], dtype=dtype, device="meta")

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self.files[name]  # KeyError for a name the folder lacks (Mapping.get relies on it)
        try:
            with safe_open(str(file), framework="pt") as handle:
                tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read weights file {file}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
                                  ) from None
        validate_imported_weights({name: tensor}, self.files.__getitem__)
        return tensor

    def __contains__(self, name: object) -> bool:  # by name: Mapping's own would read the tensor
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def stored_bytes(self) -> int:
        """Bytes of the weights as stored."""
        return sum(t.numel() * t.element_size() for t in self.meta.values())

    def float32_bytes(self) -> int:
        """Bytes of the weights in float32 (the in-memory import holds about three such copies: `stream_wanted`)."""
        return sum(t.numel() * 4 for t in self.meta.values())


def physical_memory() -> int | None:
    """The machine's RAM in bytes (None where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def stream_wanted(weights: HFWeights, memory: int | None = None) -> bool:
    """Whether an import should stream: the in-memory import's peak is about the source tensors plus
    IN_MEMORY_COPIES float32 copies of the weights (their float32 state, the float32 model, the model's own
    initialisation; measured 6.54 GB = 0.97 + 2.9 x 1.93 GB for a 0.48B bf16 Llama, benchmarks/RESULTS.md
    "Streaming (issue 45)"); stream when that exceeds half of `memory` (default: the machine's RAM; unknown:
    never)."""
    memory = physical_memory() if memory is None else memory
    return bool(memory) and weights.stored_bytes() + IN_MEMORY_COPIES * weights.float32_bytes() > memory // 2


def _streamed_weights(path: Path, stream: bool | None) -> HFWeights | None:
    """The folder's weights when the import streams (`stream`; None: when `stream_wanted`), else None. Deciding
    (None) needs the headers: a folder whose headers cannot be read is left to the in-memory import, which
    refuses it in its own words."""
    if not stream:
        if stream is False:
            return None
        try:
            weights = HFWeights(path)
        except DepthToolsError:
            return None
        return weights if stream_wanted(weights) else None
    return HFWeights(path)


@dataclass(frozen=True)
class StreamPlan:
    """A streamed import checked from the headers: the config (untied where the file holds its own head), the
    parameter counts, and the tensors to write in order (`families.hf_state_plan`)."""

    cfg: ModelConfig
    params: dict[str, int]
    steps: list[Step]


def plan_streamed(weights: HFWeights, cfg: ModelConfig) -> StreamPlan:
    """Every check of `from_hf` that needs no value, from the headers (names, shapes, dtypes, expert counts), and
    the head check (`head_from_file` reads the head and the embedding only), before anything is written."""
    cfg = head_from_file(weights, cfg)
    for name, meta in sorted(weights.meta.items()):  # an integer tensor is refused as the in-memory import does
        if not name.endswith(IGNORED_HF_SUFFIXES) and not meta.dtype.is_floating_point:
            raise DepthToolsError(f"cannot import {weights.files[name]}: {tensor_problem(name, meta)}")
    with torch.device("meta"):  # names and shapes only: nothing of the model's size is allocated
        model = DepthModel(cfg)
    steps = hf_state_plan(weights.meta, cfg, {k: tuple(v.shape) for k, v in model_state(model).items()})
    return StreamPlan(model.config, model.param_counts(), steps)


def write_streamed(directory: Path, weights: HFWeights, plan: StreamPlan, extra: dict[str, Any],
                   target: Path) -> str:
    """Write the plan's tensors into `directory` as shards (`checkpoint.write_sharded`, one tensor read at a time:
    `families.hf_state_stream`) in their source dtype (float64 / float8 as float32), then config.json as `save`
    writes it; the written headers are checked against the config (`check_shapes`, naming `target`). The HF
    tensors the model does not use (a tied head, known buffers) are checked for NaN/inf first, as the in-memory
    import checks them. Returns the note the import prints."""
    used = {step.name for step in plan.steps}
    for name in sorted(set(weights.files) - used):
        if not name.endswith(IGNORED_HF_SUFFIXES):
            _ = weights[name]  # read to be checked (`HFWeights.__getitem__`), then dropped
    kept = tuple(getattr(torch, d) for d in KEPT_DTYPES)
    tensors = hf_state_stream(plan.steps, weights.__getitem__, plan.cfg)
    index = write_sharded(directory, ((k, t if t.dtype in kept else t.float()) for k, t in tensors),
                          STREAM_SHARD_BYTES)
    files = weight_files(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        shapes.update(read_header(file))
    check_shapes(plan.cfg, shapes, target)
    atomic_write_json(directory / CONFIG, {"model": plan.cfg.to_dict(), "params": plan.params,
                                           "depthtools_version": __version__, **extra})
    stored = sorted({d if d in KEPT_DTYPES else "float32" for d in (str(t.dtype).replace("torch.", "")
                                                                    for t in weights.meta.values())})
    return (f"streamed import: weights converted one tensor at a time into {len(set(files.values()))} shard(s) "
            f"({index.name}), stored as {', '.join(stored)}")


def import_target(name: str | None, out: str | Path | None, force: bool) -> Path:
    """Where an import writes (`out`, or `$DEPTHTOOLS_CHECKPOINTS/<name>`), checked before anything is read. Every
    import (Hugging Face, GGUF, OLMo-core) goes through it. The import may replace a new or empty folder, or (with
    `force`) a depthtools checkpoint. Any other folder (files of the user's, a Hugging Face folder, the folder
    being imported) is refused even with `force`: the swap would delete it."""
    if out is None and not name:
        raise DepthToolsError("give a checkpoint name (--name) or an output directory (--out)")
    if name is not None:  # one folder under $DEPTHTOOLS_CHECKPOINTS
        check_name(name, "checkpoint name (--name)")
    target = Path(out) if out is not None else checkpoints_root() / str(name)
    check_dir_target(target, "checkpoint folder (--out)")
    if _is_checkpoint(target):
        if not force:
            raise DepthToolsError(f"{target} already holds a checkpoint; pass --force to overwrite it")
    elif target.is_dir() and any(target.iterdir()):
        raise DepthToolsError(f"{target} holds files but no checkpoint (it holds no depthtools checkpoint, and an "
                              "import replaces its whole folder); choose a new or empty --out or --name")
    return target


def _is_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a depthtools checkpoint (a config.json with its model section)."""
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model"), dict)


# -- export --------------------------------------------------------------------------------------
EXPORTABLE = ("preln",)


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse architectures that transformers' Llama cannot express."""
    arch = canonical_name(cfg.arch)
    if arch not in EXPORTABLE:
        spec = get_arch(arch)
        raise DepthToolsError(
            f"cannot export a {arch!r} checkpoint to transformers: LlamaForCausalLM is Pre-LN (h + f(RMSNorm h)) "
            f"only, and {arch} ({spec.description}) has no transformers equivalent; exportable: {', '.join(EXPORTABLE)}"
        )
    options = sorted(k for k in cfg.options if k != "family")  # the pretrained families' block options
    if options:  # (depthtools.arch.backbone): LlamaForCausalLM has none of them
        family = cfg.options.get("family") or "configured Pre-LN"
        raise DepthToolsError(f"cannot export a {family} model to transformers: export-hf writes LlamaForCausalLM "
                              f"only, and its options {options} have no Llama equivalent")


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under LlamaForCausalLM names (tied head stored once, as HF does)."""
    check_exportable(model.config)

    state = model_state(model)
    return {hf: state[ours].detach().contiguous() for ours, hf in weight_name_map(model.config).items()}


def export_hf(ckpt: str | Path, out: str | Path, tokenizer: str | Path | None = None,
              force: bool = False) -> dict[str, Any]:
    """Write a `preln` checkpoint as a transformers Llama directory; returns a summary dict.

    `out` receives config.json, model.safetensors, generation_config.json and, unless
    tokenizer="none", a tokenizer `AutoTokenizer.from_pretrained(out)` loads offline (see
    `depthtools.interop.tokenizer.resolve_tokenizer` for where it comes from). The directory is
    assembled beside `out` and renamed into place; an existing non-empty `out` is kept unless `force`.
    """
    directory = resolve(ckpt)
    config = read_json(directory / CONFIG)
    if isinstance(config.get("model"), dict) and isinstance(config["model"].get("arch"), str):
        check_exportable(ModelConfig.from_dict(config["model"]))  # refuse before loading any weights
    model = load(directory)
    check_exportable(model.config)
    out = Path(out)
    if out.resolve() == directory.resolve() or out.resolve() in directory.resolve().parents:
        raise DepthToolsError(f"export directory {out} would replace the checkpoint {directory}; choose another")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise DepthToolsError(f"{out} exists and is not empty; pass --force to replace it")
    plan = resolve_tokenizer(directory, config, model.config, tokenizer)
    tensors = to_hf_state_dict(model)
    dtype = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    staging.chmod(dir_mode())  # mkdtemp's 0700 would make the exported folder private whatever the umask
    try:
        atomic_save_tensors(staging / HF_WEIGHTS, tensors, metadata={"format": "pt"})
        atomic_write_json(staging / HF_CONFIG, model_config_to_hf(model.config, plan.special_ids, dtype))
        plan.write(staging)
        if not (staging / "generation_config.json").is_file():
            atomic_write_json(staging / "generation_config.json", {
                "_from_model_config": True, **{k: v for k, v in plan.special_ids.items() if v is not None}})
        atomic_write_json(staging / SOURCE_FILE, {
            "checkpoint": str(directory.resolve()), "arch": model.config.arch, "model": model.config.to_dict(),
            "depthtools_version": config.get("depthtools_version"), "tokenizer": plan.describe(),
            "weights_sha256": file_sha256(directory / "model.safetensors")})
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"out": str(out), "checkpoint": str(directory), "arch": model.config.arch,
            "tensors": len(tensors), "tokenizer": plan.describe(), "notes": list(plan.notes)}


__all__ = [
    "from_hf", "import_hf", "export_hf", "hf_to_model_config", "model_config_to_hf", "read_hf_config",
    "read_hf_tensors", "hf_state_to_depthtools", "to_hf_state_dict", "weight_name_map", "check_exportable",
    "transformers_sliding_window", "HFWeights", "hf_weight_files", "stream_wanted", "plan_streamed", "write_streamed",
]
