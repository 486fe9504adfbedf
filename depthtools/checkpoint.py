"""Checkpoints: safetensors weights + JSON config, atomic writes, name resolution (docs/design.md §5).

Layout of one cell directory `checkpoints/<grid>/<arch>_L<n>/`:
    model.safetensors   weights (no pickle: loading cannot run code)
    config.json         {"model": ModelConfig, "train": TrainConfig|null, "tokenizer": ..., "data": ...,
                         "params": {...}, "depthtools_version": ...}
    metrics.jsonl       training curve (written by the trainer)
    eval.json           final per-domain losses (written by the trainer)

`load("hc_L96")` resolves a path, or a cell name searched under $DEPTHTOOLS_CHECKPOINTS
(default ./checkpoints); unknown or ambiguous names list the candidates.
"""

from __future__ import annotations

import contextvars
import json
import math
import os
import re
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from depthtools import __version__
from depthtools.config import ModelConfig
from depthtools.errors import CheckpointError, DepthToolsError
from depthtools.fsutil import (  # noqa: F401 - atomic_write_bytes/json re-exported: many callers import them here
    AtomicFile,
    atomic_write_bytes,
    atomic_write_json,
    json_section,
    read_json_object,
    write_error,
)

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that handle tensors: the JSON, header and name readers here serve
# torch-free modules (reports, grid specs, `grid status`), which must not pay torch's import.

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint: {"weight_map": {tensor: shard file}}
CONFIG = "config.json"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")  # weights depthtools never reads (unpickling runs code)


def checkpoints_root() -> Path:
    return Path(os.environ.get("DEPTHTOOLS_CHECKPOINTS") or "checkpoints")


# -- atomic file writes (the helpers live in fsutil; atomic_write_bytes/json are re-exported for callers) ----------
def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """safetensors save through fsutil.AtomicFile (a hidden temporary file, then rename; not fsynced, as before)."""
    from safetensors.torch import save_file  # lazy: safetensors.torch imports torch (see the note at the top)

    with AtomicFile(path, fsync=False) as out:
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, out.temp, metadata=metadata)
        except (OSError, SafetensorError) as exc:  # a full disk reaches us as a SafetensorError naming no file
            raise write_error(exc, path) from None


def _weights_error(path: Path, exc: BaseException) -> CheckpointError:
    """A weights file that cannot be opened (permission, I/O) or that is not valid safetensors, in one line."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno is not None:
        return CheckpointError(f"cannot read weights file {path}: {exc.strerror}")
    code = re.search(r"os error (\d+)", text)
    if code:
        return CheckpointError(f"cannot read weights file {path}: {os.strerror(int(code.group(1)))}")
    return CheckpointError(f"corrupt weights file {path}: {text}")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file; a corrupt or truncated file is a one-line CheckpointError."""
    from safetensors.torch import load_file  # lazy: safetensors.torch imports torch (see the note at the top)

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing weights file {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _weights_error(path, exc) from None


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header alone (nothing is loaded or allocated)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing weights file {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _weights_error(path, exc) from None


_SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors dtypes a trained model's weights can have


def weight_shards(path: str | Path) -> list[Path] | str:
    """The safetensors file(s) that hold a checkpoint's weights, given `<dir>/model.safetensors`: that file, or,
    when it is absent beside a model.safetensors.index.json (a sharded checkpoint: a streamed import,
    `write_sharded`), the shards the index names (`weight_files`' checks) -- or why the index is unusable."""
    path = Path(path)
    index = path.parent / WEIGHTS_INDEX
    if path.name != WEIGHTS or path.exists() or not index.is_file():
        return [path]
    try:
        return sorted(set(weight_files(path.parent).values()))
    except CheckpointError as exc:
        return str(exc)


def has_weights(directory: str | Path) -> bool:
    """Whether a folder holds weights: model.safetensors, or a sharded checkpoint's index."""
    return (Path(directory) / WEIGHTS).is_file() or (Path(directory) / WEIGHTS_INDEX).is_file()


def weights_problem(path: str | Path, model: dict[str, Any] | None = None) -> str | None:
    """Why a safetensors file cannot be the checkpoint's weights, from its header alone (None: it looks whole).

    Reads the 8-byte header length and the JSON header, and compares the file's size with the end of
    the last tensor's data_offsets (and each tensor's byte range with its dtype and shape): a missing,
    empty, truncated or padded file is caught without reading the weights. Every tensor must have a
    floating-point dtype (an int64 file would load as a meaningless model). Given `model` (config.json's
    "model" section), the tensor names and shapes must be the ones that config builds (`check_shapes`).
    A sharded checkpoint (`weight_shards`) is checked shard by shard, its names and shapes together.
    The one check of `info`, `report`, `grid status` and `grid train`, which otherwise call a cell whose
    eval.json exists finished."""
    shards = weight_shards(path)
    if isinstance(shards, str):
        return shards
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        header, problem = _header_of(shard)
        if problem is not None:
            return problem
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info.get("dtype") not in FLOAT_DTYPES:
                return (f"weights file {shard} does not hold a trained model: tensor {name} has dtype "
                        f"{info.get('dtype')}, not a floating-point dtype ({', '.join(FLOAT_DTYPES)})")
            shapes[name] = tuple(int(d) for d in info["shape"])
    if model is None:
        return None
    return _config_problem(Path(path), model, shapes)


def _config_problem(path: Path, model: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why the tensor names and shapes in `shapes` are not those config.json's `model` builds (None: they are)."""
    from depthtools.arch.registry import upgrade_options  # lazy: TransformerLens (~2.5 s) only where a model is built

    try:
        cfg = ModelConfig.from_dict(upgrade_options(model))
        check_shapes(cfg, shapes, path.parent)
    except (DepthToolsError, KeyError, TypeError, ValueError) as exc:
        return f"weights file {path} does not match config.json: {str(exc).splitlines()[0] if str(exc) else exc!r}"
    return None


def _header_of(path: Path) -> tuple[dict[str, Any], str | None]:
    """(safetensors header, None) of a whole-looking file, or ({}, why it is missing or damaged)."""
    if not path.is_file():
        return {}, f"weights file {path} is missing"
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return {}, f"weights file {path} is damaged: {size} bytes, too short for a safetensors header"
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                return {}, f"weights file {path} is damaged (truncated): {size:,} bytes, its header alone claims {length + 8:,}"
            header = json.loads(handle.read(length).decode("utf-8"))
    except OSError as exc:
        return {}, f"weights file {path} cannot be read: {exc.strerror or exc}"
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}, f"weights file {path} is damaged: its header is not valid safetensors JSON"
    if not isinstance(header, dict):
        return {}, f"weights file {path} is damaged: its header is not a JSON object"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(v) for v in info["data_offsets"])
            expected = math.prod(int(d) for d in info["shape"]) * _SAFETENSORS_DTYPE_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            return {}, f"weights file {path} is damaged: its header entry for {name} is not valid"
        if stop < begin or (expected and stop - begin != expected):
            return {}, f"weights file {path} is damaged: tensor {name} spans bytes {begin}..{stop}, its shape needs {expected}"
        end = max(end, stop)
    if size != 8 + length + end:
        kind = "truncated" if size < 8 + length + end else "extra bytes at the end"
        return {}, f"weights file {path} is damaged ({kind}): {size:,} bytes, its header says {8 + length + end:,}"
    return header, None


def _block_count(names) -> int | None:
    indices = {int(k.split(".")[1]) for k in names if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    return max(indices) + 1 if indices else None


def check_shapes(cfg: ModelConfig, header: dict[str, tuple[int, ...]], directory: Path) -> None:
    """Refuse a config.json that does not describe the weights file, comparing what the config implies
    with the file's header, before a model of the config's size exists: a d_model of 2**20 or a
    vocab_size of 1e12 in config.json is one line, not an attempt to allocate terabytes.

    The block count and the embedding are checked first (cheap); then a model built on the meta device
    (shapes, no storage) gives every tensor name and shape."""
    import torch  # lazy: see the note at the top

    from depthtools.arch import DepthModel  # lazy: TransformerLens (~2.5 s) only where a model is built

    blocks = _block_count(header)
    if blocks is not None and blocks != cfg.n_layer:
        raise CheckpointError(f"weights in {directory} do not match config: config.json says n_layer={cfg.n_layer}, "
                              f"the weights hold {blocks} blocks")
    embed = header.get("tok_embed.weight")
    if embed is not None and embed != (cfg.vocab_size, cfg.d_model):
        raise CheckpointError(f"weights in {directory} do not match config: tok_embed.weight has shape {embed}, "
                              f"config implies {(cfg.vocab_size, cfg.d_model)} (vocab_size, d_model)")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_state(DepthModel(cfg)).items()}
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {directory} do not match config ({cfg.arch}, L={cfg.n_layer}, d={cfg.d_model}): "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )
    wrong = [k for k in expected if expected[k] != header[k]]
    if wrong:
        k = wrong[0]
        raise CheckpointError(f"weights in {directory} do not match config: {k} has shape {header[k]}, "
                              f"config implies {expected[k]}")


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, eval.json, train state): an object, or one CheckpointError
    line naming the file (missing, unreadable, not UTF-8, not JSON, too deeply nested, not an object)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing {path.name} in {path.parent}")
    return read_json_object(path, f"a checkpoint's {path.name}", CheckpointError)


def model_section(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """config.json's "model" section, which must be an object (one line naming the file otherwise)."""
    return json_section(config, "model", Path(directory) / CONFIG, dict, CheckpointError)


# -- save / load ---------------------------------------------------------------------------------
def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict without duplicated storage (tied unembedding is saved once)."""
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("unembed.weight", None)
    return state


def save(model, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `model.safetensors` + `config.json` into `directory` atomically; returns the directory.

    `extra` adds fields to config.json (train config, tokenizer and data fingerprints, ...).
    """
    directory = Path(directory)
    atomic_save_tensors(directory / WEIGHTS, model_state(model), metadata={"format": "pt", "arch": model.config.arch})
    config = {
        "model": model.config.to_dict(),
        "params": model.param_counts(),
        "depthtools_version": __version__,
        **(extra or {}),
    }
    atomic_write_json(directory / CONFIG, config)
    return directory


def resolve(name: str | Path, root: str | Path | None = None) -> Path:
    """A checkpoint directory from a path or a cell name like `hc_L96` (searched under root)."""
    path = Path(name)
    if (path / CONFIG).is_file() or (path / WEIGHTS).is_file():
        return path
    root = Path(root) if root is not None else checkpoints_root()
    if path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (no {CONFIG})")
    candidates = sorted(p.parent for p in root.rglob(CONFIG)) if root.is_dir() else []
    if "/" in str(name):  # a tail of whole path components: "gridC/preln_L4" is not "xgridC/preln_L4"
        parts = tuple(p for p in Path(str(name).strip("/")).parts if p not in ("", "."))
        matches = [c for c in candidates if c.parts[-len(parts):] == parts] if parts else []
    else:
        matches = [c for c in candidates if c.name == str(name)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        listed = ", ".join(str(m) for m in matches)
        raise CheckpointError(f"checkpoint name {name!r} is ambiguous under {root}: {listed}")
    raise CheckpointError(f"unknown checkpoint {name!r} (searched {root}); available: {_listing(candidates, root)}")


def _listing(candidates: list[Path], root: Path, most: int = 20) -> str:
    """The checkpoints under root as unique names with the folders holding them ("preln_L2 (in g1, g2),
    hc_L2 (in g1)"): a cell name shared by several grids is listed once, with where to find each."""
    folders: dict[str, list[str]] = {}
    for c in candidates:
        parent = c.parent.relative_to(root) if c.parent != root and c.is_relative_to(root) else None
        folders.setdefault(c.name, []).append("." if parent is None else str(parent))
    if not folders:
        return "none"
    shown = [f"{n} (in {', '.join(where)})" if where != ["."] else n for n, where in list(folders.items())[:most]]
    more = f", ... {len(folders) - most} more" if len(folders) > most else ""
    return ", ".join(shown) + more + (" (pass the path, or GRID/NAME)" if any(len(w) > 1 for w in folders.values())
                                      else "")


def read_config(name: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint."""
    return read_json(resolve(name) / CONFIG)


def tensor_problem(key: str, tensor: torch.Tensor) -> str | None:
    """Why a weight tensor cannot belong to a trained model, or None: a non-floating dtype (int64 would be
    cast to a meaningless model silently) or a NaN/inf entry (every metric would be NaN). Shared by `load`
    and the importers (`depthtools.interop.checks`), so both refuse the same tensors in the same words."""
    import torch  # lazy: see the note at the top (the caller holds a tensor: torch is loaded already)

    if not tensor.dtype.is_floating_point:
        return f"tensor {key} has dtype {str(tensor.dtype).replace('torch.', '')}, expected a floating-point dtype"
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        return f"tensor {key} has {bad} non-finite (NaN/inf) value(s) of {tensor.numel()}; the weights are unusable"
    return None


def weights_values_problem(path: str | Path) -> str | None:
    """The first tensor of a whole safetensors file (`weights_problem` is None) whose values make it
    unusable (`tensor_problem`: NaN/inf entries), reading one tensor at a time so that memory stays at
    the largest tensor; None when every value is finite. For `info`, which reads one checkpoint: the
    header alone cannot show an all-NaN file."""
    shards = weight_shards(path)
    if isinstance(shards, str):
        return shards
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as handle:
                for key in handle.keys():
                    problem = tensor_problem(key, handle.get_tensor(key))
                    if problem is not None:
                        return f"weights file {shard} does not hold a usable model: {problem}"
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            return str(_weights_error(shard, exc))
    return None


def check_weights(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Refuse weights that cannot be a trained model (`tensor_problem`). One line, naming the tensor."""
    for key in sorted(tensors):
        problem = tensor_problem(key, tensors[key])
        if problem is not None:
            raise CheckpointError(f"weights in {directory}: {problem}")


# How `load` builds models when its caller does not say: the CLI's --stream / --devices N (`loading`), so that every
# probe command and `analyze` reach the loader without each signature growing the options.
LOAD_OPTIONS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("load_options", default={})


@contextmanager
def loading(stream: bool = False, devices: int | None = None, budget: int | None = None):
    """Within it, `load` streams weights (`stream`) and/or places blocks over `devices` CUDA devices."""
    token = LOAD_OPTIONS.set({"stream": stream, "devices": devices, "budget": budget})
    try:
        yield
    finally:
        LOAD_OPTIONS.reset(token)


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: model.safetensors, or the shards named by
    model.safetensors.index.json (each inside the folder, each whole by its header: `_header_of`). A folder
    whose only weights are pickles is refused without opening them; a damaged shard is one line."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise CheckpointError(f"corrupt {index}: weight_map must be an object of tensor name -> shard file name")
        shards = {shard: directory / shard for shard in set(weight_map.values())}
        for shard, path in sorted(shards.items()):
            if Path(shard).anchor or ".." in Path(shard).parts or path.parent != directory:
                raise CheckpointError(f"{index} names a shard outside the checkpoint folder: {shard!r}")
    elif (directory / WEIGHTS).is_file() or not _pickled(directory):
        weight_map, shards = None, {WEIGHTS: directory / WEIGHTS}
    else:
        raise CheckpointError(f"{directory} holds only pickled weights ({_pickled(directory)[0]}); depthtools reads "
                              "safetensors only and never unpickles (re-save with safetensors)")
    headers = {}
    for shard, path in sorted(shards.items()):
        header, problem = _header_of(path)
        if problem is not None:
            raise CheckpointError(problem)
        headers[shard] = [k for k in header if k != "__metadata__"]
    if weight_map is None:
        return {name: shards[WEIGHTS] for name in headers[WEIGHTS]}
    for shard, names in headers.items():
        if any(weight_map.get(name) != shard for name in names):
            raise CheckpointError(f"{directory / shard} holds tensors {WEIGHTS_INDEX} does not map to it")
    return {name: shards[shard] for name, shard in weight_map.items()}


# -- writing a sharded checkpoint, one tensor at a time ----------------------------------------------------
def write_sharded(directory: Path, tensors, shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None) -> Path:
    """Write `tensors` (an iterable of (name, tensor), consumed lazily) as safetensors shards of at most about
    `shard_bytes` each plus model.safetensors.index.json (the Hugging Face layout `checkpoint.weight_files`
    reads), cast to `dtype` if given. Memory stays at one shard: a model larger than RAM can be written from a
    generator. Each file is written atomically (a hidden temporary file, then rename); returns the index path."""
    from safetensors.torch import save_file  # lazy: safetensors.torch imports torch (see the note at the top)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    count = 0

    def flush() -> None:
        nonlocal count, shard
        if shard:
            count += 1
            name = f"model-{count:05d}.safetensors"
            with AtomicFile(directory / name, fsync=False) as out:
                save_file(shard, out.temp, metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
            shard = {}

    for name, tensor in tensors:
        tensor = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
        if shard and sum(t.numel() * t.element_size() for t in shard.values()) + tensor.nbytes > shard_bytes:
            flush()
        shard[name] = tensor
    flush()
    index = directory / WEIGHTS_INDEX
    atomic_write_json(index, {"metadata": {"format": "pt"}, "weight_map": weight_map})
    return index


def _pickled(directory: Path) -> list[str]:
    return sorted(p.name for pattern in PICKLED for p in Path(directory).glob(pattern))


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the headers of the weight files (nothing is loaded)."""
    shapes = {}
    for path in sorted(set(files.values())):
        shapes.update(read_header(path))
    return {name: shapes[name] for name in files}


def _load_in_dtype(model_cls, cfg, tensors: dict, dtype):
    """A model whose parameters are the checkpoint's tensors cast to `dtype` (its buffers cast from their
    float32 tables, as `model.to(dtype)` would), or None when the checkpoint lacks a parameter (then the
    caller takes the float32 path, whose init fills it)."""
    import torch  # lazy

    from depthtools.arch.stream import params_on_meta  # lazy: torch

    with params_on_meta():
        model = model_cls(cfg)
    tied = getattr(model.config, "tie_embeddings", False)
    names = {name for name, _ in model.named_parameters()} - ({"unembed.weight"} if tied else set())
    if not names <= set(tensors):
        return None
    model = model.to(dtype)  # buffers; the parameters are meta
    with torch.no_grad():
        model.load_state_dict({k: v.to(dtype) for k, v in tensors.items() if k in names}, strict=False, assign=True)
    if tied:
        model.unembed.weight = model.tok_embed.weight
    return model


def load(name: str | Path, device: str | torch.device = "cpu", root: str | Path | None = None,
         dtype: "str | torch.dtype | None" = None, stream: bool | None = None, devices: int | None = None,
         budget: int | None = None):
    """Load a checkpoint as an eval-mode `DepthModel`; bit-identical to the saved model.

    dtype (e.g. "bfloat16", "float16"): the weights are cast tensor by tensor straight into that dtype
    (`_load_in_dtype`), never through a float32 copy of the model; None: float32 (the model's default).

    stream=True: nothing of the weights' size is loaded; each block is read from the
    safetensors file(s) when it runs and released after (`depthtools.arch.stream`), keeping up to `budget`
    bytes of blocks between uses. devices=N: blocks over the first N CUDA devices, split by bytes. Either
    defaults to the enclosing `loading(...)` (the CLI's --stream / --devices)."""
    import torch  # lazy: see the note at the top

    from depthtools.arch import DepthModel  # lazy: TransformerLens (~2.5 s) only where a model is built
    from depthtools.arch.registry import upgrade_options  # lazy: TransformerLens (~2.5 s) only where a model is built
    from depthtools.arch.stream import attach, check_devices  # lazy: torch

    options = LOAD_OPTIONS.get()
    stream = bool(options.get("stream")) if stream is None else stream
    devices = options.get("devices") if devices is None else devices
    budget = options.get("budget") if budget is None else budget
    directory = resolve(name, root)
    targets = check_devices(str(torch.device(device).type), devices) if devices else [str(device)]
    files = weight_files(directory) if stream or (directory / WEIGHTS_INDEX).is_file() else None
    config = read_json(directory / CONFIG)
    try:
        cfg = ModelConfig.from_dict(upgrade_options(model_section(config, directory)))  # options a config predates: old defaults
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"config.json in {directory} has no valid 'model' section: {exc}") from None
    except DepthToolsError as exc:
        raise CheckpointError(f"config.json in {directory}: {exc}") from None
    shapes = _shapes(files) if files is not None else read_header(directory / WEIGHTS)
    check_shapes(cfg, shapes, directory)  # before anything of that size is allocated
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if stream:
        model = _streamed(cfg, files, directory, targets, budget)
        return model if dtype in (None, torch.float32) else model.to(dtype)
    tensors = {}
    for path in sorted(set(files.values())) if files is not None else [directory / WEIGHTS]:
        tensors.update(read_tensors(path))
    check_weights(tensors, directory)
    model = None if dtype in (None, torch.float32) else _load_in_dtype(DepthModel, cfg, tensors, dtype)
    if model is None:
        model = DepthModel(cfg)
        with torch.no_grad():
            model.load_state_dict(tensors, strict=False)  # tied unembedding shares tok_embed's storage
        model = model if dtype in (None, torch.float32) else model.to(dtype)
    model.checkpoint_dir = directory
    model = model.to(targets[0]).eval()
    if len(targets) > 1:
        attach(model, None, targets)
    return model


def _streamed(cfg: ModelConfig, files: dict[str, Path], directory: Path, targets: list[str], budget: int | None):
    """An eval-mode model whose blocks and head are read from `files` when they run (`depthtools.arch.stream`);
    the embedding and the scheme's model-level parameters are read now (float32, checked like `load`'s)."""
    import torch  # lazy: see the note at the top

    from depthtools.arch import DepthModel  # lazy: TransformerLens (~2.5 s) only where a model is built
    from depthtools.arch.stream import (  # lazy: torch
        DEFAULT_BUDGET,
        TensorSource,
        attach,
        params_on_meta,
        unit_of,
    )

    with params_on_meta():
        model = DepthModel(cfg)
    model.checkpoint_dir = directory
    source = TensorSource(files)

    names = [n for n, _ in model.named_parameters() if unit_of(n) in ("embed", "rest")]
    tensors = source.read(names, torch.float32)  # float32, as an in-memory load holds them
    for name in names:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[attr] = torch.nn.Parameter(tensors.pop(name))
    if model.config.tie_embeddings:  # the unembedding is the embedding's (now real) parameter again
        model.unembed.weight = model.tok_embed.weight
    attach(model, source, targets, DEFAULT_BUDGET if budget is None else budget)
    return model.eval()


def read_metrics(directory: str | Path) -> list[dict[str, Any]]:
    """The training curve (metrics.jsonl) as a list of records; [] if absent. Bad lines are skipped."""
    path = Path(directory) / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    records = []
    for number, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:  # the trainer writes ASCII JSON: these bytes came from elsewhere
            raise CheckpointError(f"{path} line {number} is not UTF-8 text (not written by the trainer); "
                                  "delete that line or the file") from None
        try:
            record = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            continue  # a line cut by a crash mid-write
        if not isinstance(record, dict):
            raise CheckpointError(f"{path} line {number} is not a JSON object (a metrics record); "
                                  "delete that line or the file")
        records.append(record)
    return records


def imported_from(config: dict[str, Any]) -> str | None:
    """'imported from <format> <path>' for a checkpoint `import-hf` wrote (its config.json "source"), else
    None. An imported model is finished as it is: it has no training run, eval.json or loss curve."""
    source = config.get("source") if isinstance(config, dict) else None
    if not isinstance(source, dict) or not source.get("path"):
        return None
    step = f" step {source['step']}" if isinstance(source.get("step"), int) else ""  # an OLMo-core run's step
    return f"imported from {source.get('format') or 'an external model'} {source['path']}{step}"


def source_summary(config: dict[str, Any]) -> dict[str, Any]:
    """The scalar facts of an imported checkpoint's config.json "source" (format, path, step, digests) and of the
    OLMo-core mapping it records (block type, layout, notes), for `info`; {} for a trained checkpoint."""
    source = config.get("source") if isinstance(config, dict) else None
    if not isinstance(source, dict):
        return {}
    out = {k: v for k, v in source.items() if isinstance(v, (str, int, float, bool)) and not isinstance(v, dict)}
    mapping = source.get("olmo_core")
    if isinstance(mapping, dict):
        for key in ("block_type", "layout", "olmo_core_class", "tensors"):
            if isinstance(mapping.get(key), (str, int)):
                out[key] = mapping[key]
        if isinstance(mapping.get("dtypes"), list):
            out["dtypes"] = ", ".join(map(str, mapping["dtypes"]))
        if isinstance(mapping.get("notes"), list) and mapping["notes"]:
            out["notes"] = "; ".join(map(str, mapping["notes"]))
    return out


def checkpoint_summary(name: str | Path, scan_values: bool = True) -> dict[str, Any]:
    """Config, sizes and training/eval summary of a checkpoint, without building its model.

    "weights" is "ok" or why the weights file cannot be this checkpoint's model: `weights_problem` (the
    header: damage, dtype, tensor names and shapes against config.json) and, with `scan_values`,
    `weights_values_problem` (NaN/inf values, read one tensor at a time); "finished" is True only when
    training finished (eval.json) or the model was imported, and the weights pass both."""
    directory = resolve(name)
    config = read_json(directory / CONFIG)
    model = model_section(config, directory)
    params = json_section(config, "params", directory / CONFIG, dict, CheckpointError, required=False) or {}
    metrics = read_metrics(directory)
    eval_path = directory / "eval.json"
    last = metrics[-1] if metrics else {}
    damaged = weights_problem(directory / WEIGHTS, model)
    if damaged is None and scan_values:
        damaged = weights_values_problem(directory / WEIGHTS)
    provenance = imported_from(config)
    summary = {
        "name": directory.name,
        "path": str(directory),
        "arch": model.get("arch"),
        # a run whose weights are gone is not usable; an imported model is finished as imported
        "finished": (eval_path.is_file() or provenance is not None) and damaged is None,
        "weights": damaged or "ok",
        "model": model,
        "params": params,
        "training": {k: last[k] for k in ("step", "tokens", "train_loss", "val_loss") if k in last},
        "eval": read_json(eval_path) if eval_path.is_file() else {},
    }
    if provenance is not None:
        summary["provenance"] = provenance
        summary["source"] = source_summary(config)
    return summary
