"""Streamed weights and blocks over several devices: a `DepthModel` larger than memory, or than one device.

`streamed(cfg, files, ...)` builds the model with every parameter on the `meta` device (shapes, no storage),
keeps the embedding and the scheme's model-level parameters resident, and materialises each block (and the
head: final norm + unembedding) from the checkpoint's safetensors files when it runs, in the model's dtype,
then releases it. A small byte budget keeps the first blocks that fit materialised, so a sweep that runs the
same blocks again reads them once (the rest are read on each use: a cyclic scan under LRU would miss every
time; keeping the first ones hits the budget's share of every pass). Results are those of the in-memory model,
bit for bit: the same tensors, cast the same way, run by the same code. Tensors are read from the files with
positioned reads in chunks, cast as they arrive (`TensorSource`): a memory map's touched pages would count as
the process' memory, and a bf16 copy beside its float32 cast would double a large head's footprint. The content
hash of the weights (`StreamedWeights`, for `lens.model_fingerprint`) materialises each unit through the streamer,
so on a model within the budget that hash is the probe's first read of the blocks, not a second one.

`place(model, devices)` (and `streamed(..., devices=...)`) puts contiguous block ranges on several devices with
a split balanced by bytes (`split_by_bytes`, a pure function): embedding on the first device, head on the last.
States live on the first device; a block's input moves to the block's device and its output back, so every
analysis sees its states where it expects them.

Both hook into `DepthModel.block_step` through `model.stream` (a `Streamer`) and into the head through forward
pre-hooks on `ln_final` and `unembed`; nothing else of the model changes. The files are checked by the caller
(`depthtools.checkpoint.load`); this module reads tensors only from safetensors files (never pickles).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import struct
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from depthtools.errors import CheckpointError, DepthToolsError


def _libc():
    """glibc through ctypes, or None elsewhere (then memory is left to the platform's allocator)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


LIBC = _libc()
M_MMAP_THRESHOLD = -3


def return_freed_memory(fixed_threshold: bool = False) -> None:
    """Give freed heap memory back to the system (glibc malloc_trim), and with `fixed_threshold` serve every
    allocation of 4 MiB or more by its own mapping from now on (glibc otherwise raises that threshold to 32 MiB
    after the first large free, and keeps mid-sized tensors of released blocks in fragmented heaps: a stream
    of blocks then grows the process by GBs). A no-op off glibc."""
    if LIBC is None:
        return
    if fixed_threshold:
        LIBC.mallopt(M_MMAP_THRESHOLD, 4 << 20)
    LIBC.malloc_trim(0)


DEFAULT_BUDGET = 1 << 30  # bytes of materialised blocks kept between uses (1 GiB)
EMBED, HEAD, REST = "embed", "head", "rest"
# Block parameters a scheme reads at every depth, not only when the block runs: the AttnRes mixers (each block's
# query and key norm are stacked into one depth bank at the embedding). They stay resident (REST).
EVERY_DEPTH = ("attn_res", "mlp_res")


# -- placement: a pure function of byte sizes ----------------------------------------------------------------
def split_by_bytes(sizes: list[int], n: int) -> list[int]:
    """The device index (0..n-1) of each unit, for units of `sizes` bytes in order: contiguous ranges, every
    device at least one unit, minimising the largest device's bytes. Callers pass [embedding, block 0, ...,
    block L-1, head], so the embedding lands on the first device and the head on the last.

    Exact, by dynamic programming over (devices used, units placed): O(n L^2) for L units, nothing at model sizes."""
    if n < 1 or n > len(sizes):
        raise DepthToolsError(f"cannot split {len(sizes)} units over {n} devices")
    if any(s < 0 for s in sizes):
        raise DepthToolsError("unit sizes must be >= 0 bytes")
    count = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: the smallest largest load placing the first i units on k devices; cut[k][i]: where device k starts
    best = [[inf] * (count + 1) for _ in range(n + 1)]
    cut = [[0] * (count + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for i in range(k, count - (n - k) + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i], cut[k][i] = load, j
    where, i = [0] * count, count
    for k in range(n, 0, -1):
        j = cut[k][i]
        where[j:i] = [k - 1] * (i - j)
        i = j
    return where


def check_devices(device: str, n: int | None, available: int | None = None) -> list[str]:
    """The device names `--device D --devices N` places blocks on, or a one-line error: N needs CUDA and at
    most the visible count (`available`: torch.cuda.device_count() unless given)."""
    if n is None or n == 1 and device == "cpu":
        return [device]
    if n < 1:
        raise DepthToolsError(f"--devices must be >= 1, got {n}")
    if device != "cuda":
        raise DepthToolsError(f"--devices {n} places blocks across CUDA devices; it needs --device cuda")
    count = torch.cuda.device_count() if available is None else available
    if count == 0:
        raise DepthToolsError(f"--devices {n} needs CUDA devices, but none is available")
    if n > count:
        raise DepthToolsError(f"--devices {n} asks for more CUDA devices than the {count} visible")
    return [f"cuda:{i}" for i in range(n)]


# -- moving states ----------------------------------------------------------------------------------------
def move(state: Any, device: torch.device) -> Any:
    """`state` with every tensor on `device` (tensors, tuples and named tuples, lists, dicts, dataclasses)."""
    if isinstance(state, torch.Tensor):
        return state if state.device == device else state.to(device)
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(move(v, device) for v in state))
    if isinstance(state, (tuple, list)):
        return type(state)(move(v, device) for v in state)
    if isinstance(state, dict):
        return {k: move(v, device) for k, v in state.items()}
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return dataclasses.replace(state, **{f.name: move(getattr(state, f.name), device)
                                             for f in dataclasses.fields(state) if f.init})
    return state


# -- building without weights --------------------------------------------------------------------------------
@contextmanager
def params_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered inside is moved to `meta` (no storage; buffers stay real: RoPE tables)."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def unit_of(name: str) -> str | int:
    """The unit a parameter belongs to: a block index, EMBED, HEAD, or REST (the scheme's model-level ones)."""
    top = name.split(".")[0]
    if top == "blocks":
        return REST if any(part in EVERY_DEPTH for part in name.split(".")[2:]) else int(name.split(".")[1])
    if top in ("tok_embed", "pos_embed"):
        return EMBED
    if top in ("ln_final", "unembed"):
        return HEAD
    return REST


STORED = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
CHUNK_BYTES = 64 << 20  # bytes read (and converted) at a time


class TensorSource:
    """Tensor name -> its safetensors file; `read` converts one tensor out of the file into memory of its own.

    The bytes are read with plain positioned reads in chunks of CHUNK_BYTES and cast into the output as they
    come (the cast `Tensor.to` does), so reading a bf16 tensor into float32 holds the float32 result and one
    chunk, not the file's mapping (whose touched pages count as the process' memory) plus a bf16 copy plus the
    result. The headers were checked whole by `checkpoint.weight_files`; a file changed since is one line."""

    def __init__(self, files: Mapping[str, Path]):
        self.files = dict(files)
        self.entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for path in sorted(set(self.files.values())):
            self._index(path)

    def _index(self, path: Path) -> None:
        """Record (file, dtype, shape, first byte, last byte) of every tensor the file's header lists."""
        try:
            with open(path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length).decode("utf-8"))
        except (OSError, ValueError, struct.error) as exc:
            raise CheckpointError(f"cannot stream weights file {path}: {exc}") from None
        for name, info in header.items():
            if name != "__metadata__" and self.files.get(name) == path:
                begin, stop = (8 + length + int(v) for v in info["data_offsets"])
                self.entries[name] = (path, info["dtype"], tuple(int(d) for d in info["shape"]), begin, stop)

    def read(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensors `names` on the CPU, in `dtype` (None: as stored); non-finite or non-float ones refused."""
        out = {}
        for name in names:
            if name not in self.entries:
                raise CheckpointError(f"streamed weights have no tensor {name}")
            out[name] = self._read(name, dtype)
        return out

    def _read(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """One tensor: read straight into its result when the file holds it in `dtype`, else chunk by chunk
        through one reused buffer, cast as it arrives; each chunk checked finite (`_check_finite`)."""
        path, stored, shape, begin, stop = self.entries[name]
        source = STORED.get(stored)
        if source is None:
            raise CheckpointError(f"weights file {path}: tensor {name} has dtype {stored}, expected a floating-point "
                                  "dtype; the weights are unusable")
        target, size = dtype or source, torch.empty((), dtype=source).element_size()
        numel = torch.Size(shape).numel()
        if stop - begin != numel * size:
            raise CheckpointError(f"weights file {path} is damaged: tensor {name} spans {stop - begin} bytes, "
                                  f"its shape needs {numel * size}")
        direct = target == source and numel > 0
        # Python buffers, never a tensor's data pointer (torch.func.jvp runs blocks whose weights arrive here).
        whole = _aligned_buffer(numel * size) if direct else None
        result = torch.frombuffer(whole, dtype=source) if direct else torch.empty(numel, dtype=target)
        step = max(1, CHUNK_BYTES // size)
        raw = None if direct else bytearray(min(step, numel) * size)
        try:
            with open(path, "rb") as handle:
                handle.seek(begin)
                for lo in range(0, numel, step):
                    count = min(step, numel - lo)
                    view = memoryview(whole)[lo * size:(lo + count) * size] if direct else memoryview(raw)[:count * size]
                    if handle.readinto(view) != count * size:
                        raise CheckpointError(f"weights file {path} is damaged (truncated): it ends inside "
                                              f"tensor {name}")
                    values = result[lo:lo + count] if direct else torch.frombuffer(raw, dtype=source, count=count)
                    _check_finite(values, path, name)
                    if not direct:
                        result[lo:lo + count].copy_(values)
        except OSError as exc:
            raise CheckpointError(f"cannot stream weights file {path}: {exc.strerror or exc}") from None
        return result.view(shape)


ALIGN = 64  # bytes: a weight's first element where torch's own allocator puts it (vector loads, matmul kernels)


def _aligned_buffer(nbytes: int) -> memoryview:
    """A writable buffer of `nbytes` zero bytes whose first byte is ALIGN-aligned: a slice of a slightly larger
    bytearray (a large bytearray starts 16 bytes into its mapping). The slice keeps the bytearray alive."""
    raw = bytearray(nbytes + ALIGN)
    address = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    start = -address % ALIGN
    return memoryview(raw)[start:start + nbytes]


def _check_finite(values: torch.Tensor, path: Path, name: str) -> None:
    """Refuse NaN/inf in one line. A finite sum means every value is finite (NaN and inf propagate); only a sum
    that is not (non-finite values, or an overflow of finite ones) pays the exact elementwise check, ~35x slower."""
    if bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all()):
        return
    raise CheckpointError(f"weights file {path}: tensor {name} has non-finite (NaN/inf) values; "
                          "the weights are unusable")


class Streamer:
    """Which device each unit lives on, which units are materialised, and the step that uses them.

    `source` None: every weight is resident (placement over devices only)."""

    def __init__(self, model, source: TensorSource | None, devices: list[torch.device], budget: int):
        self.model, self.source, self.budget = model, source, budget
        self.devices = devices
        self.params: dict[Any, list[tuple[nn.Module, str, str]]] = {}
        for name, _ in model.named_parameters():
            module_name, _, attr = name.rpartition(".")
            self.params.setdefault(unit_of(name), []).append((model.get_submodule(module_name), attr, name))
        units = [EMBED, *range(model.n_layer), HEAD]
        sizes = [self.nbytes(u) for u in units]
        where = split_by_bytes(sizes, len(devices)) if len(devices) > 1 else [0] * len(units)
        self.where = {u: i for u, i in zip(units, where)}  # unit -> index into devices
        self.where[REST] = 0
        self.device = {u: devices[i] for u, i in self.where.items()}
        self.kept: dict[Any, int] = {}  # materialised units held between uses (bytes), within the budget
        self.transient: set[Any] = set()  # materialised beyond the budget: released at the next materialisation
        self.ropes: dict[torch.device, tuple] = {}
        self.reads = 0  # units read from the files (for tests and benchmarks)

    def nbytes(self, unit) -> int:
        """Bytes of a unit's parameters in the model's current dtype."""
        return sum(getattr(m, a).numel() * getattr(m, a).element_size() for m, a, _ in self.params.get(unit, []))

    def materialised(self, unit) -> bool:
        return all(not getattr(m, a).is_meta for m, a, _ in self.params.get(unit, []))

    def ensure(self, keep: tuple, device: torch.device | None = None) -> None:
        """Materialise the units `keep` (on `device`, else their own), releasing transient others first."""
        for unit in list(self.transient):
            if unit not in keep:
                self.release(unit)
        for unit in keep:
            target = device or self.device[unit]
            if self.source is None or unit in (EMBED, REST):
                self.relocate(unit, target)
                continue
            if self.materialised(unit):
                self.relocate(unit, target)
                continue
            self.load(unit, target)

    def load(self, unit, device: torch.device) -> None:
        """Read a unit's tensors and put them in place as parameters of the model's dtype on `device`."""
        entries = self.params.get(unit, [])
        size = 0
        for module, attr, name in entries:
            meta = getattr(module, attr)
            value = self.source.read([name], meta.dtype)[name].to(device)  # memory of its own, cast as read
            module._parameters[attr] = nn.Parameter(value, requires_grad=meta.requires_grad)
            size += value.numel() * value.element_size()
        self.reads += 1
        if sum(self.kept.values()) + size <= self.budget:
            self.kept[unit] = size
        else:
            self.transient.add(unit)

    def release(self, unit) -> None:
        """Put a unit's parameters back on `meta` (their storage is freed)."""
        for module, attr, _ in self.params.get(unit, []):
            param = getattr(module, attr)
            module._parameters[attr] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                    requires_grad=param.requires_grad)
        self.transient.discard(unit)
        self.kept.pop(unit, None)
        return_freed_memory()

    def relocate(self, unit, device: torch.device) -> None:
        """Move a materialised unit's parameters to `device` (a swapped block run beside another device's)."""
        for module, attr, _ in self.params.get(unit, []):
            param = getattr(module, attr)
            if param.device != device:
                module._parameters[attr] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)

    def rope(self, device: torch.device) -> tuple:
        """The model's RoPE tables on `device` (copied once per device and dtype)."""
        cos, sin = self.model.rope_cos, self.model.rope_sin
        if cos.device == device:
            return cos, sin
        cached = self.ropes.get(device)
        if cached is None or cached[0] is not cos:
            cached = self.ropes[device] = (cos, sin, cos.to(device), sin.to(device))
        return cached[2], cached[3]

    def step(self, position: int, running: nn.Module, state, home: nn.Module):
        """`DepthModel.block_step` with materialised blocks: the running block on its device (the home block,
        whose position-bound tensors the scheme may read, beside it), the state moved there and back."""
        device = self.device[running.index]
        self.ensure(tuple(dict.fromkeys((running.index, home.index))), device)
        out = self.model.scheme.step(position, running, move(state, device), home, self.rope(device))
        return move(out, self.devices[0])

    def skip(self, position: int, state, rule: str | None):
        """`scheme.skip` with block `position` materialised (a skip rule may read its connection weights)."""
        device = self.device[position]
        self.ensure((position,), device)
        return move(self.model.scheme.skip(position, move(state, device), rule), self.devices[0])

    def before_head(self, module, args):
        """Forward pre-hook of ln_final / unembed: the head materialised, its input on the head's device."""
        self.ensure((HEAD,))
        return move(args, self.device[HEAD])

    def after_head(self, module, args, output):
        """Forward hook of ln_final / unembed: outputs back on the first device, where the states live."""
        return move(output, self.devices[0])


class StreamedWeights(Mapping):
    """The model's state dict, one tensor at a time, for a content hash of a streamed model's weights
    (`lens.model_fingerprint`). A tensor of a block or of the head that is not materialised is read by
    materialising its unit through the streamer (`Streamer.ensure`): a unit that fits the budget is kept, so the
    hash's read of the weights is also the probe's first read of them (one read of the file, not two); one that
    does not is released at the next unit's, as a forward releases it. Resident tensors are returned as they are."""

    def __init__(self, model, streamer: Streamer):
        self.model, self.streamer = model, streamer
        self.names = list(model.state_dict(keep_vars=True).keys())
        self.fingerprints: dict = {}  # `lens.model_fingerprint` per dtype: the files do not change under a model

    def _current(self, name: str) -> torch.Tensor:
        """The model's tensor `name` now (a parameter or buffer: found by its module path, not by rebuilding the
        whole state dict for each name, which cost more than the read at SmolLM-135M's size)."""
        module_name, _, attr = name.rpartition(".")
        try:
            value = getattr(self.model.get_submodule(module_name), attr)
        except AttributeError:
            value = None
        if not isinstance(value, torch.Tensor):  # a custom state-dict entry: the slow, general way
            value = self.model.state_dict(keep_vars=True)[name]
        return value

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        value = self._current(name)
        if value.is_meta and self.streamer.source is not None:
            unit = unit_of(name)
            if unit not in (EMBED, REST):
                self.streamer.ensure((unit,))
                value = self._current(name)
            if value.is_meta:  # not a unit's parameter (cannot happen for a DepthModel): read it alone
                return self.streamer.source.read([name], value.dtype)[name]
        return value.detach()

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def attach(model, source: TensorSource | None, devices: list[str], budget: int = DEFAULT_BUDGET) -> Streamer:
    """Hook a Streamer into `model` (block_step, head) and put its resident units on their devices."""
    targets = [torch.device(d) for d in devices]
    streamer = Streamer(model, source, targets, budget)
    if len(set(targets)) > 1 and streamer.params.get(REST):
        raise DepthToolsError(f"--devices: the {model.config.arch} architecture keeps parameters outside its blocks "
                              "(used at every depth), which cannot be split over devices; use one device")
    for name, buf in list(model.named_buffers()):  # RoPE tables and any block's buffers: where their unit runs
        module_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(module_name)
        owner._buffers[attr] = buf.to(streamer.device.get(unit_of(name), targets[0]))
    for unit in [EMBED, REST, *([] if source is not None else [*range(model.n_layer), HEAD])]:
        streamer.relocate(unit, streamer.device[unit])
    for module in (model.ln_final, model.unembed):
        module.register_forward_pre_hook(streamer.before_head)
        module.register_forward_hook(streamer.after_head)
    model.stream = streamer
    streamed_bytes = sum(streamer.nbytes(u) for u in [*range(model.n_layer), HEAD])
    if source is not None and streamed_bytes > budget:  # blocks will be released and read again: keep RSS flat
        return_freed_memory(fixed_threshold=True)  # (not when all fit: fresh mappings cost large activations time)
    if source is not None:
        model.streamed_weights = StreamedWeights(model, streamer)
    return streamer

