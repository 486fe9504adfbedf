"""Read model tensors from a torch.distributed.checkpoint (DCP) folder without running code from it.

A DCP folder (OLMo-core's `stepN/model_and_optim/`) holds `.metadata`, a Python pickle naming every
entry of the saved state dict, and one `__<rank>_<k>.distcp` file per writer, in which each tensor
chunk is a `torch.save` zip archive at a recorded byte offset and length. `torch.distributed.checkpoint`
reads both with `pickle.load`, which runs whatever a hostile file asks for. Here nothing in the folder
can run code, the promise safetensors makes:

- `.metadata` is read by `_MetadataUnpickler`, which admits only DCP's metadata classes (and
  OLMo-core's copy of `_StorageInfo`), `torch.Size`, torch dtypes/layouts and plain containers, and
  builds our own record classes from them: no class or function of the file's choosing is called.
- a tensor chunk is read from its recorded slice: the zip's `data.pkl` is read by `_TensorUnpickler`,
  which admits only `torch._utils._rebuild_tensor_v2`, the typed storage names and `OrderedDict`,
  and records what they ask for; the tensor is then built from the raw storage bytes by our code.
- optimizer state and non-tensor (pickled bytes) entries are never read: only the entries under
  `prefix` whose metadata says "tensor".

Chunks of a tensor sharded over any number of ranks (FSDP row shards, DTensor, ShardedTensor) are
placed by their recorded offsets, and every element must be covered exactly once. Every refusal is one
`CheckpointError` line naming the file and the entry.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from depthtools.errors import CheckpointError

METADATA = ".metadata"

# Storage class names a `torch.save` archive uses for tensors, and the dtype each holds.
STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


# -- the records `.metadata` is read into (our classes, never the file's) ---------------------------
class _Record:
    """A plain attribute bag that pickle's NEWOBJ + BUILD fill from a state dict; nothing else runs."""

    def __reduce__(self):  # pragma: no cover - never pickled by us
        raise TypeError(f"{type(self).__name__} is read-only")


class TensorMeta(_Record):
    """DCP's TensorStorageMetadata: `properties` (dtype), global `size`, `chunks`."""
    properties: Any = None
    size: tuple = ()
    chunks: list = []


class BytesMeta(_Record):
    """DCP's BytesStorageMetadata: a pickled non-tensor entry (never read here)."""


class Chunk(_Record):
    """DCP's ChunkStorageMetadata: where one saved piece sits in the whole tensor."""
    offsets: tuple = ()
    sizes: tuple = ()


class Properties(_Record):
    """DCP's TensorProperties; pickled as a tuple whose first item is the dtype."""
    dtype: Any = None

    def __setstate__(self, state):
        if not isinstance(state, tuple) or not state or not isinstance(state[0], torch.dtype):
            raise pickle.UnpicklingError("TensorProperties state is not (dtype, ...)")
        self.dtype = state[0]


class Index(_Record):
    """DCP's MetadataIndex: (entry name, chunk offset), the key of `storage_data`."""
    fqn: str = ""
    offset: Any = None
    index: Any = None

    def key(self) -> tuple:
        return self.fqn, None if self.offset is None else tuple(self.offset)

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other) -> bool:
        return isinstance(other, Index) and self.key() == other.key()


class StorageInfo(_Record):
    """DCP's (or OLMo-core's) _StorageInfo: which file, byte offset and length hold one chunk."""
    relative_path: str = ""
    offset: int = 0
    length: int = 0
    transform_descriptors: Any = None


class StorageMeta(_Record):
    """DCP's StorageMeta (checkpoint id, save id); unused."""


class Metadata(_Record):
    """DCP's Metadata: `state_dict_metadata` {name: TensorMeta|BytesMeta}, `storage_data` {Index: StorageInfo}."""
    state_dict_metadata: dict = {}
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


def _size(*args) -> tuple:
    """torch.Size(...) as a plain tuple of non-negative ints."""
    dims = tuple(args[0]) if args else ()
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        raise pickle.UnpicklingError("torch.Size holds something other than non-negative ints")
    return dims


def _layout(name) -> str:
    if name not in ("torch.strided", "torch.sparse_coo"):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return str(name)


def _mem_format(value) -> int:
    if value not in (0, 1, 2):
        raise pickle.UnpicklingError(f"unknown memory format code {value!r}")
    return int(value)


def _path(*parts) -> str:
    """StorageMeta's checkpoint_id is pickled as a pathlib path; kept as a string."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path made of something other than strings")
    return "/".join(parts)


_DCP = "torch.distributed.checkpoint"
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (f"{_DCP}.metadata", "Metadata"): Metadata,
    (f"{_DCP}.metadata", "TensorStorageMetadata"): TensorMeta,
    (f"{_DCP}.metadata", "BytesStorageMetadata"): BytesMeta,
    (f"{_DCP}.metadata", "ChunkStorageMetadata"): Chunk,
    (f"{_DCP}.metadata", "TensorProperties"): Properties,
    (f"{_DCP}.metadata", "MetadataIndex"): Index,
    (f"{_DCP}.metadata", "StorageMeta"): StorageMeta,
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): _mem_format,
    (f"{_DCP}.filesystem", "_StorageInfo"): StorageInfo,
    ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): _size,
    ("torch._utils", "_get_layout"): _layout,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "Path"): _path,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


# torch's dtypes by attribute name, from the module's own namespace (vars: no lazy submodule is imported)
TORCH_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def _torch_dtype(module: str, name: str) -> torch.dtype | None:
    """`torch.float32` and friends are pickled as the global `torch.<name>`."""
    return TORCH_DTYPES.get(name) if module == "torch" else None


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the globals of `_METADATA_GLOBALS` (mapped to our records) and torch dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[module, name]
        dtype = _torch_dtype(module, name)
        if dtype is not None:
            return dtype
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which is not part of DCP's metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent reference, which DCP's metadata never does")


def _unpickle_error(path: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"refusing {path}: not a DCP metadata pickle that can be read without running code "
                           f"({exc}); nothing was loaded from it")


def read_metadata(directory: str | Path) -> Metadata:
    """The `.metadata` of a DCP folder, read by the restricted unpickler and checked for shape.

    Refused in one line: a missing file, a pickle asking for anything outside DCP's metadata classes,
    or records of the wrong types."""
    path = Path(directory) / METADATA
    if not path.is_file():
        raise CheckpointError(f"{Path(directory)} is not a complete DCP checkpoint: {METADATA} is missing "
                              "(a save that did not finish writes it last)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError, KeyError,
            MemoryError, RecursionError) as exc:
        raise _unpickle_error(path, exc) from None
    _check_metadata(meta, path)
    return meta


def _dims(value: Any) -> bool:
    """A shape or offset as DCP records it: a tuple of non-negative ints."""
    return isinstance(value, tuple) and all(isinstance(v, int) and v >= 0 for v in value)


def _check_metadata(meta: Any, path: Path) -> None:
    """The loaded records must have the types DCP writes; anything else is refused, naming the entry."""
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointError(f"refusing {path}: its top-level object is not DCP's Metadata")
    if not isinstance(meta.storage_data, dict):
        raise CheckpointError(f"refusing {path}: it has no storage_data table (not written by a file-system writer)")
    for name, entry in meta.state_dict_metadata.items():
        if not isinstance(name, str) or not isinstance(entry, (TensorMeta, BytesMeta)):
            raise CheckpointError(f"refusing {path}: entry {name!r} is not a tensor or bytes record")
        if isinstance(entry, TensorMeta):
            ok = (isinstance(entry.properties, Properties) and isinstance(entry.properties.dtype, torch.dtype)
                  and _dims(entry.size) and isinstance(entry.chunks, list)
                  and all(isinstance(c, Chunk) and _dims(c.offsets) and _dims(c.sizes)
                          and len(c.offsets) == len(entry.size) == len(c.sizes) for c in entry.chunks))
            if not ok:
                raise CheckpointError(f"refusing {path}: tensor entry {name!r} has malformed size/chunk records")
    for index, info in meta.storage_data.items():
        if not isinstance(index, Index) or not isinstance(info, StorageInfo) or not isinstance(
                info.relative_path, str) or not isinstance(info.offset, int) or not isinstance(info.length, int):
            raise CheckpointError(f"refusing {path}: storage record {getattr(index, 'fqn', index)!r} is malformed")


# -- one chunk: a torch.save zip archive read without running code ------------------------------------
@dataclass
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass
class _TensorSpec:
    storage: _StorageRef
    storage_offset: int
    size: tuple
    stride: tuple


class _StorageType:
    """Stands for `torch.FloatStorage` & co. in a chunk's pickle: only its dtype is used."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None) -> _TensorSpec:
    """Records what `torch._utils._rebuild_tensor_v2` would build; the tensor is made later from raw bytes."""
    if not isinstance(storage, _StorageRef) or not isinstance(storage_offset, int) or storage_offset < 0:
        raise pickle.UnpicklingError("a tensor rebuilt from something other than a storage reference")
    if not isinstance(size, tuple) or not isinstance(stride, tuple) or len(size) != len(stride) or not all(
            isinstance(v, int) and v >= 0 for v in (*size, *stride)):
        raise pickle.UnpicklingError("a tensor with a malformed size or stride")
    if backward_hooks:
        raise pickle.UnpicklingError("a tensor with backward hooks")
    return _TensorSpec(storage, storage_offset, size, stride)


class _TensorUnpickler(pickle.Unpickler):
    """Reads a `torch.save` archive's data.pkl when it holds exactly one plain tensor."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a saved plain tensor never does")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and isinstance(pid[4], int) and pid[4] >= 0):
            raise pickle.UnpicklingError(f"an unknown persistent reference {str(pid)[:80]}")
        return _StorageRef(pid[1].dtype, pid[2], pid[4])


def _archive_member(archive: zipfile.ZipFile, suffix: str) -> str | None:
    names = [n for n in archive.namelist() if n.endswith(suffix) and n.count("/") == suffix.count("/")]
    return names[0] if len(names) == 1 else None


def _tensor_from_archive(blob: bytes, where: str) -> torch.Tensor:
    """The one tensor of a `torch.save` zip archive held in `blob`, built from its raw storage bytes.

    `torch.save` stores its members uncompressed; a compressed member (which could inflate far beyond the
    file) is refused before it is read."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        packed = [i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED]
        if packed:
            raise CheckpointError(f"{where} has compressed members ({packed[0]}), which torch.save never writes")
        pkl = _archive_member(archive, "/data.pkl")
        if pkl is None:
            raise CheckpointError(f"{where} is not a torch.save archive (no data.pkl)")
        root = pkl[: -len("data.pkl")]
        order = archive.read(root + "byteorder").decode() if root + "byteorder" in archive.namelist() else "little"
        if order != "little":
            raise CheckpointError(f"{where} was saved {order}-endian; only little-endian archives are read")
        spec = _TensorUnpickler(io.BytesIO(archive.read(pkl))).load()
        if not isinstance(spec, _TensorSpec):
            raise CheckpointError(f"{where} holds a {type(spec).__name__}, not one tensor")
        raw = archive.read(f"{root}data/{spec.storage.key}")
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, KeyError, EOFError, pickle.UnpicklingError, UnicodeDecodeError, ValueError,
            TypeError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not a readable tensor archive ({exc}); the file may be damaged") from None
    item = torch.empty((), dtype=spec.storage.dtype).element_size()
    if len(raw) != spec.storage.numel * item:
        raise CheckpointError(f"{where}: its storage holds {len(raw)} bytes, expected {spec.storage.numel * item}")
    flat = torch.frombuffer(bytearray(raw), dtype=spec.storage.dtype) if raw else torch.empty(0, dtype=spec.storage.dtype)
    last = spec.storage_offset + sum((s - 1) * st for s, st in zip(spec.size, spec.stride)) if all(spec.size) else -1
    if last >= spec.storage.numel:
        raise CheckpointError(f"{where}: its tensor reaches past the end of its storage")
    return torch.as_strided(flat, spec.size, spec.stride, spec.storage_offset).clone()


# -- reading a folder ----------------------------------------------------------------------------------
class _Files:
    """Open `.distcp` files of one folder; reads byte ranges, refusing missing or short files."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.sizes: dict[str, int] = {}

    def check(self, info: StorageInfo, entry: str) -> Path:
        name = info.relative_path
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"refusing {self.directory / METADATA}: entry {entry!r} points outside the "
                                  f"folder ({name!r})")
        path = self.directory / name
        if name not in self.sizes:
            if not path.is_file():
                raise CheckpointError(f"{path} is missing: entry {entry!r} is stored in it (a rank's file was not "
                                      "copied, or the save did not finish)")
            self.sizes[name] = path.stat().st_size
        if info.offset < 0 or info.length < 0 or info.offset + info.length > self.sizes[name]:
            raise CheckpointError(f"{path} is truncated: entry {entry!r} needs bytes {info.offset}.."
                                  f"{info.offset + info.length}, the file has {self.sizes[name]}")
        return path

    def read(self, info: StorageInfo, entry: str) -> bytes:
        path = self.check(info, entry)
        with open(path, "rb") as handle:
            handle.seek(info.offset)
            return handle.read(info.length)


def _storage_index(meta: Metadata) -> dict[tuple, StorageInfo]:
    return {index.key(): info for index, info in meta.storage_data.items()}


def _numel(sizes) -> int:
    count = 1
    for size in sizes:
        count *= int(size)
    return count


def _check_sizes(name: str, entry: TensorMeta, storage: dict[tuple, StorageInfo], files: _Files) -> None:
    """Before anything of the tensor's size is allocated: its chunks hold as many elements as the tensor, and each
    chunk's bytes fit in the byte range recorded for it (so a metadata claiming a huge tensor is refused, not
    allocated)."""
    item = torch.empty((), dtype=entry.properties.dtype).element_size()
    chunk_total = sum(_numel(c.sizes) for c in entry.chunks)
    if chunk_total != _numel(entry.size):
        raise CheckpointError(f"{files.directory / METADATA}: the chunks of {name!r} hold {chunk_total} element(s), "
                              f"its size {list(entry.size)} has {_numel(entry.size)}")
    for chunk in entry.chunks:
        info = storage.get((name, tuple(chunk.offsets)))
        if info is not None and _numel(chunk.sizes) * item > info.length:
            raise CheckpointError(f"{files.directory / info.relative_path}: chunk {list(chunk.offsets)} of {name!r} "
                                  f"({list(chunk.sizes)}) needs {_numel(chunk.sizes) * item} bytes, its stored "
                                  f"range has {info.length}")


def _assemble(name: str, entry: TensorMeta, storage: dict[tuple, StorageInfo], files: _Files) -> torch.Tensor:
    """One whole tensor from its chunks, each placed at its recorded offsets; every element exactly once."""
    dtype = entry.properties.dtype
    _check_sizes(name, entry, storage, files)
    whole = torch.empty(entry.size, dtype=dtype)
    covered = torch.zeros(entry.size, dtype=torch.uint8)
    for chunk in entry.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if any(o + s > d for o, s, d in zip(offsets, sizes, entry.size)):
            raise CheckpointError(f"{files.directory / METADATA}: chunk at {list(offsets)} of {name!r} "
                                  f"({list(sizes)}) reaches outside its tensor {list(entry.size)}")
        info = storage.get((name, offsets)) or (storage.get((name, None)) if len(entry.chunks) == 1 else None)
        if info is None:
            raise CheckpointError(f"{files.directory / METADATA}: no stored data for chunk {list(offsets)} of {name!r}")
        if info.transform_descriptors:
            raise CheckpointError(f"{files.directory / info.relative_path}: entry {name!r} is stored with "
                                  f"{list(info.transform_descriptors)} (compression/encoding), which is not read")
        piece = _tensor_from_archive(files.read(info, name), f"{files.directory / info.relative_path} "
                                                                f"(entry {name!r} at byte {info.offset})")
        if tuple(piece.shape) != sizes or piece.dtype != dtype:
            raise CheckpointError(f"{files.directory / info.relative_path}: entry {name!r} chunk {list(offsets)} "
                                  f"holds {list(piece.shape)} {piece.dtype}, the metadata says {list(sizes)} {dtype}")
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        whole[region] = piece
        covered[region] += 1
    if covered.numel() and not bool((covered == 1).all()):
        missing, twice = int((covered == 0).sum()), int((covered > 1).sum())
        raise CheckpointError(f"{files.directory / METADATA}: the chunks of {name!r} {list(entry.size)} leave "
                              f"{missing} element(s) unset and cover {twice} more than once")
    return whole


def tensor_entries(meta: Metadata, prefix: str = "model.") -> dict[str, TensorMeta]:
    """The tensor entries under `prefix` (e.g. the model's, not the optimizer's), in the metadata's order."""
    return {name: entry for name, entry in meta.state_dict_metadata.items()
            if name.startswith(prefix) and isinstance(entry, TensorMeta)}


def _check_ranges(directory: Path, meta: Metadata) -> _Files:
    """Every file and byte range the metadata records, the optimizer's included: a short or missing file means
    a damaged copy, refused before any tensor is read (ranges are checked against file sizes, nothing is read)."""
    files = _Files(directory)
    for index, info in meta.storage_data.items():
        files.check(info, index.fqn)
    return files


def check_files(model_and_optim_dir: str | Path) -> Metadata:
    """The metadata of a DCP folder, after checking that every `.distcp` file it records is present and long
    enough; no tensor is read (cheap: a sweep checks all its runs before importing the first)."""
    directory = Path(model_and_optim_dir)
    meta = read_metadata(directory)
    _check_ranges(directory, meta)
    return meta


def read_model_tensors(model_and_optim_dir: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` in a DCP folder, whole, named without the prefix; nothing else is read.

    The restricted unpicklers mean no code from the folder runs; optimizer state and pickled
    non-tensor entries are skipped without being read. A missing or truncated `.distcp`, a chunk whose
    shape or dtype disagrees with the metadata, or chunks that do not tile their tensor are refused in
    one `CheckpointError` line."""
    directory = Path(model_and_optim_dir)
    meta = read_metadata(directory)
    entries = tensor_entries(meta, prefix)
    if not entries:
        found = sorted({n.split(".")[0] for n in meta.state_dict_metadata})
        raise CheckpointError(f"{directory / METADATA} holds no tensors under {prefix!r} (top-level entries: "
                              f"{', '.join(found) or 'none'})")
    storage, files = _storage_index(meta), _check_ranges(directory, meta)
    return {name[len(prefix):]: _assemble(name, entry, storage, files) for name, entry in entries.items()}


__all__ = ["read_model_tensors", "read_metadata", "check_files", "tensor_entries", "METADATA", "Metadata", "TensorMeta"]
