"""Small C kernels for HC/mHC, AttnRes and MoDA training on CPU: sources in `depthtools/arch/csrc/`, built by
torch.utils.cpp_extension (JIT, with ninja) on the first real CPU call that needs them (one log line), cached, and
called through ctypes.

Four libraries, one source file each (`csrc/<name>.c`, which says what its kernels do and why, with the figures'
places in benchmarks/RESULTS.md): "sinkhorn" (mHC's Sinkhorn), "connector" (HC's and mHC's whole connectors,
forward and backward), "bank" (AttnRes' depth bank: a mix, a two-phase prefix, a backward flush) and "moda"
(MoDA's depth attention: forward, backward, slot gradients, slot stores). The kernels are written once per
scalar type and instantiated per type by including `*_impl.h` with `REAL`/`FN` defined (`csrc/generic.h`).

The kernels are called (ctypes wrappers included) by their torch custom ops in `depthtools/arch/ops/`:
`ops/sinkhorn.py` (`depthtools::sinkhorn_tokens_last`) and `ops/connector.py` (`depthtools::hc_connect`,
`depthtools::mhc_connect`), which the eager and the compiled HC/mHC paths both call; `ops/bank.py`
(`bankops.DepthBank`, eager and compiled steps alike) and `ops/moda.py` (`moda._DepthAttention` and
`_AppendSlots`, eager). They look a kernel up with `function`; this module keeps the build, the load and the
`usable` / `connector_usable` / `bank_usable` / `moda_usable` checks.
Only float32/float64 CPU tensors take them (`usable`, `connector_usable`, `bank_usable`, `moda_usable`; MoDA's
may read bfloat16 slots); anything else (CUDA, the meta device, other dtypes, no compiler or ninja, a failed build)
takes torch ops, the same computation (`kernel_status` says which path each library takes, without building).
Nothing is compiled at import or when a model is built (the grid planner builds models on `meta`). Each shared
object is cached next to inductor's cache (`compile_cache.cache_dir()`), keyed by the sources, the compiler, its
flags and this CPU's flags (-march=native).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch

from depthtools.arch.compile_cache import cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")  # <name>.c per library, the *.h files they include

# sinkhorn: -O3 vectorises the blocks' inner loops; no -ffast-math (it would reorder the sums and drop the
# NaN/Inf semantics the torch kernel has); -ffp-contract=off: no fused multiply-adds either.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
# connector, bank, moda: sums may be reassociated (a fixed, compile-time order: deterministic) and multiply-adds
# contracted, so that rows of d vectorise; NaN and Inf still propagate (no -ffinite-math-only).
_CONNECTOR_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fassociative-math",
                    "-fno-signed-zeros", "-fno-trapping-math"]
CONNECTOR_MAX_STREAMS = 16  # NMAX in csrc/common.h: the kernels' per-token arrays

_LIBRARIES = {  # name: flag sets in order of preference (the first that builds is used)
    "sinkhorn": [_FLAGS],
    # the connector kernels split their token loops over torch's intra-op threads with OpenMP (the
    # libgomp torch itself loads); without it they build and run on one thread; a compiler that lacks
    # the x86 / vectorising flags gets plain -O3 (same results up to rounding, slower)
    "connector": [_CONNECTOR_FLAGS + ["-fopenmp"], _CONNECTOR_FLAGS, ["-O3"]],
    "bank": [_CONNECTOR_FLAGS + ["-fopenmp"], _CONNECTOR_FLAGS, ["-O3"]],
    "moda": [_CONNECTOR_FLAGS + ["-fopenmp"], _CONNECTOR_FLAGS, ["-O3"]],
}
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _signatures(name: str, scalar) -> dict[str, list]:
    if name == "sinkhorn":
        return {"sinkhorn_forward": [_P, _P, _L, _I, _I, _I, scalar],
                "sinkhorn_backward": [_P, _P, _P, _L, _I, _I, _I, scalar]}
    if name == "moda":
        return {"moda_forward": [_P, _P, _P, _L, scalar, _P, _L, _P, _L, _P, _I, _I, _I, _I, _L, _P, _P, _P, _P, _I],
                "moda_backward": [_P] * 6 + [_I, _I, _I, _I, _L, scalar, _P, _P, _P, _I],
                "moda_slot_grads": [_I] + [_P] * 5 + [_I, _I, _I, _I, _I, _L, _P, _P, _I, _I],
                "moda_store_slot": [_P, _L, _I, _L, _P, _I, _I]}
    if name == "bank":
        return {"bank_mix_forward": [_P, _P, _P, _L, _I, _I, _I, _I, _P, _P, _I, _P, _P, _L, _P, _P, _I],
                "bank_prefix": [_P, _P, _P, _L, _I, _I, _I, _I, _P, _P, _P, _I],
                "bank_flush": [_P, _P, _P, _L, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I]}
    return {"hc_connect_forward": [_P, _P, _P, _P, _L, _I, _I, scalar, _P, _P, _P, _P, _P, _I],
            "hc_connect_backward": [_P] * 9 + [_L, _I, _I] + [_P] * 4 + [_I],
            "mhc_connect_forward": [_P] * 6 + [_L, _I, _I, scalar, _I, _I, scalar] + [_P] * 4 + [_I],
            "mhc_connect_backward": [_P] * 10 + [_L, _I, _I, _I, _I, scalar] + [_P] * 6 + [_I]}


_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def _compiler() -> str | None:
    """The compiler driver torch.utils.cpp_extension builds with ($CXX, else c++), or None when it or ninja (which
    cpp_extension runs the build with) is not on PATH."""
    cxx = shutil.which(os.environ.get("CXX") or "c++")
    return cxx if cxx and shutil.which("ninja") else None


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _kernel_folder() -> Path:
    """Where built libraries are cached: next to inductor's cache (`compile_cache.cache_dir`)."""
    return cache_dir() / "depthtools_kernels"


def _sources_key() -> str:
    """The text of every file in csrc/ (a library's .c and the headers it may include), for the cache key."""
    return "\0".join(f"{p.name}\0{p.read_text()}" for p in sorted(SOURCE_DIR.iterdir()) if p.suffix in (".c", ".h"))


def _target(name: str, cc: str, flags: list[str], folder: Path) -> Path:
    """The cached shared object of library `name` built by `cc` with `flags`: its build folder is keyed by the
    sources, compiler, flags and CPU (-march=native), so a changed source or another machine builds afresh, and by
    the folder: cpp_extension skips building a name it already loaded in this process, so two folders must not
    share a library name."""
    parts = [_sources_key(), name, cc, *flags, _cpu_key(), str(Path(folder).resolve())]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return folder / f"{name}-{key}" / f"depthtools_{name}_{key}.so"


def _compile(name: str, cc: str, flags: list[str], folder: Path | None = None) -> Path:
    """The shared object of csrc/<name>.c built with `flags` in `folder` (default `_kernel_folder()`), through
    torch.utils.cpp_extension's JIT build (ninja; a lock file makes concurrent builders wait for one build). The
    sources are C: `-x c` compiles them as C with the same flags as a plain `cc` build (same machine code); they
    are called through ctypes, so nothing in them depends on torch's headers or ABI."""
    folder = _kernel_folder() if folder is None else folder
    target = _target(name, cc, flags, folder)
    if not target.exists():
        logger.info("building the %s CPU kernels with %s (first use; cached in %s)", name, cc, folder)
        from torch.utils import cpp_extension  # heavy, one path: it imports setuptools, needed only for a cold build

        target.parent.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(target.parent / "lock")
        cpp_extension.load(name=target.stem, sources=[str(SOURCE_DIR / f"{name}.c")], build_directory=str(target.parent),
                           extra_cflags=["-x", "c", *flags, f"-I{SOURCE_DIR}"],
                           extra_ldflags=["-lm", *(["-fopenmp"] if "-fopenmp" in flags else [])],
                           is_python_module=False, with_cuda=False, verbose=False)
    return target


STALE_LOCK_S = 600  # far longer than any build of these libraries (seconds)


def _clear_stale_lock(lock: Path) -> None:
    """Remove cpp_extension's lock file when it is older than STALE_LOCK_S: a builder killed mid-build leaves it
    behind, and cpp_extension would then wait for it forever."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing a stale kernel build lock %s (a build was interrupted)", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def _build(name: str, folder: Path | None = None) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        logger.info("no compiler or no ninja on PATH (torch.utils.cpp_extension needs both): the %s kernels run "
                    "as torch ops", name)
        return None
    flag_sets = _LIBRARIES[name]
    for i, flags in enumerate(flag_sets):
        try:
            lib = ctypes.CDLL(str(_compile(name, cc, flags, folder)))
            break
        except (OSError, RuntimeError, subprocess.CalledProcessError):  # cpp_extension: RuntimeError
            if i == len(flag_sets) - 1:
                raise
    suffixes = [("f32", ctypes.c_float), ("f64", ctypes.c_double)] + [("bf16", ctypes.c_float)] * (name == "moda")
    for suffix, scalar in suffixes:
        for fn, argtypes in _signatures(name, scalar).items():
            f = getattr(lib, f"{fn}_{suffix}")
            f.argtypes = argtypes
            f.restype = None if fn == "hc_connect_forward" else ctypes.c_int
    if name == "connector":
        for fn in ("tanh_f32_array", "exp_f32_array"):
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = [_P, _P, _L], None
    return lib


def library(name: str = "sinkhorn", folder: Path | None = None) -> ctypes.CDLL | None:
    """The built kernel library `name` ("sinkhorn", "connector", "bank" or "moda"), or None (no compiler, or the
    build failed: logged once); built on this first call in `folder` (default `_kernel_folder()`)."""
    if name in _libs:
        return _libs[name]
    with _lock:
        if name not in _libs:
            lib = None
            try:
                lib = _build(name, folder)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
                logger.warning("%s CPU kernels unavailable (%s); using torch ops", name, str(detail)[:500])
            _libs[name] = lib
    return _libs[name]


def kernel_status() -> dict[str, str]:
    """{library: which path its kernels take on CPU}, without building anything: "C (loaded)", "C (built,
    cached)", "C (builds on first CPU use with <cc>)", or "torch ops (...)" with the reason."""
    cc = _compiler()
    status = {}
    for name, flag_sets in _LIBRARIES.items():
        if name in _libs:
            status[name] = "C (loaded)" if _libs[name] is not None else "torch ops (the C build failed: see the log)"
        elif cc is None:
            status[name] = "torch ops (no compiler or no ninja: set CXX or install g++, and ninja)"
        elif any(_target(name, cc, flags, _kernel_folder()).exists() for flags in flag_sets):
            status[name] = "C (built, cached)"
        else:
            status[name] = f"C (builds on first CPU use with {cc})"
    return status


_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _cpu_float(tensors) -> bool:
    """CPU tensors of one dtype, float32 or float64 (the kernels' scalar types)."""
    t = tensors[0]
    return all(x.device.type == "cpu" and x.dtype == t.dtype for x in tensors) and t.dtype in _SUFFIX


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the Sinkhorn kernel takes these tensors: contiguous float32/float64 CPU tensors of one
    dtype, and the library built."""
    return all(x.is_contiguous() for x in tensors) and _cpu_float(tensors) and library("sinkhorn") is not None


def connector_usable(H: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the connector kernels take streams H [N,n,d] with the other tensors of the call: float32/
    float64 CPU tensors of one dtype, n <= CONNECTOR_MAX_STREAMS, and the library built. (Contiguity is
    not required: the callers pass contiguous copies, as the kernels need.)"""
    return (H.shape[1] <= CONNECTOR_MAX_STREAMS and _cpu_float((H, *others))
            and library("connector") is not None)


def function(lib: str, name: str, dtype: torch.dtype):
    """Kernel `name` of the built library `lib` for scalar type `dtype`: float32, float64, or bfloat16 (moda's slot
    type: `moda_forward`, `moda_backward`, `moda_store_slot` by their slots' dtype) -- the ctypes function the ops
    in `depthtools.arch.ops` call (they check `usable` / `connector_usable` / `bank_usable` / `moda_usable` first)."""
    return getattr(library(lib), f"{name}_{'bf16' if dtype == torch.bfloat16 else _SUFFIX[dtype]}")


def bank_usable(values: torch.Tensor) -> bool:
    """Whether the depth-bank kernels take a bank whose buffers have `values`' dtype and device: float32/
    float64 on CPU, and the library built."""
    return _cpu_float((values,)) and library("bank") is not None


def moda_usable(t: torch.Tensor, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the MoDA depth-attention kernels take tensors like `t` with slots stored as `kv_dtype` (default:
    t's dtype): float32/float64 on CPU (slots of the same dtype, or bfloat16 slots with float32), and the
    library built."""
    kv_dtype = t.dtype if kv_dtype is None else kv_dtype
    return (_cpu_float((t,)) and (kv_dtype == t.dtype or (kv_dtype, t.dtype) == (torch.bfloat16, torch.float32))
            and library("moda") is not None)

