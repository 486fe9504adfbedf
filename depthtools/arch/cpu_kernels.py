"""Small C kernels for HC/mHC, AttnRes and MoDA training and for the analyses' head metrics on CPU: sources in
`depthtools/arch/csrc/`, built by torch.utils.cpp_extension (JIT, with ninja) on the first real CPU call that needs
them (one log line), cached, and called through ctypes.

Five libraries, one source file each (`csrc/<name>.c`, which says what its kernels do and why, with the figures'
places in benchmarks/RESULTS.md): "sinkhorn" (mHC's Sinkhorn), "connector" (HC's and mHC's whole connectors,
forward and backward), "bank" (AttnRes' depth bank: a mix, a two-phase prefix, a backward flush), "moda"
(MoDA's depth attention: forward, backward, slot gradients, slot stores) and "rowmetrics" (the per-row sums
behind a head's metrics, float32 only: `analysis/headmetrics.py` `fused_metrics`). The training kernels are
written once per scalar type and instantiated per type by including `*_impl.h` with `REAL`/`FN` defined (`csrc/generic.h`).

The kernels are called by their torch custom ops in `depthtools/arch/ops/`: `ops/sinkhorn.py`
(`depthtools::sinkhorn_tokens_last`) and `ops/connector.py` (`depthtools::hc_connect`, `depthtools::mhc_connect`),
which the eager and the compiled HC/mHC paths both call; `ops/bank.py` (`bankops.DepthBank`, eager and compiled
steps alike) and `ops/moda.py` (`moda._DepthAttention` and `_AppendSlots`, eager). Each declares the kernels it
calls as `Kernel`s (the C parameter names it passes, in order); the signatures themselves are read from the C
sources (`c_signatures`), set as the ctypes argument types when a library loads, and checked against every
declaration then (`KernelSignatureError`); a call checks each argument against its C type. This module keeps the
build, the load, the bindings and the `usable` / `connector_usable` / `bank_usable` / `moda_usable` checks.
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
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
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
    # the analyses' head metrics (headmetrics.py `fused_metrics`): rows over OpenMP threads; finite-math so the
    # max/min reductions vectorise (csrc/rowmetrics.c says how non-finite logits are still caught)
    "rowmetrics": [_CONNECTOR_FLAGS + ["-ffinite-math-only", "-fopenmp"], _CONNECTOR_FLAGS + ["-ffinite-math-only"],
                   ["-O3"]],
}

# -- the kernels' signatures, read from the C sources, and the checked bindings ------------------------------------
#
# A kernel's C definition is its only signature: `c_signatures` reads the parameter names and types from csrc/,
# the ctypes argument types are set from them when a library loads, and each caller declares (`Kernel`) the
# parameter names it passes, in order; a declaration that differs from the C definition (count, order or name)
# raises KernelSignatureError when the library loads (or at the declaration, if it is already loaded).

class KernelSignatureError(TypeError):
    """A Python caller's declaration of a C kernel differs from the kernel's definition in csrc/ (a programming
    error: raised, never turned into the torch-op fallback)."""


@dataclass(frozen=True)
class CParam:
    """One parameter of a C kernel: its name, its C type with the type macros expanded and the qualifiers (const,
    restrict) dropped ("float", "long", "unsigned short", ...), and whether it is a pointer to that type."""
    name: str
    ctype: str
    pointer: bool


@dataclass(frozen=True)
class CSignature:
    """An exported C function: its symbol (e.g. hc_connect_forward_f32), return type ("void" or "int") and
    parameters."""
    symbol: str
    returns: str
    params: tuple[CParam, ...]


_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
# an exported definition at the start of a line: `int FN(name)(params) {` (type-generic) or `void name(params) {`
_DEFINITION = re.compile(r"^(void|int)\s+(?:FN\((\w+)\)|(\w+))\s*\(([^)]*)\)\s*\{", re.M)
_DIRECTIVE = re.compile(r'^\s*#\s*(?:define\s+(REAL|SFX|KV_T)\s+(.+?)|include\s+"([^"]+)")\s*$', re.M)
_QUALIFIERS = {"const", "restrict", "__restrict__"}
# the element dtypes a pointer parameter takes, by its C type (unsigned short: MoDA's bfloat16 slots; unsigned char:
# a mask); a scalar parameter's ctypes type
_POINTEE_DTYPES = {"float": (torch.float32,), "double": (torch.float64,), "unsigned short": (torch.bfloat16,),
                   "long": (torch.int64,), "unsigned char": (torch.uint8, torch.bool)}
_SCALAR_CTYPES = {"int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float, "double": ctypes.c_double}
_RETURN_CTYPES = {"void": None, "int": ctypes.c_int}


def _param(text: str, macros: dict[str, str]) -> CParam:
    """A CParam from one C parameter declaration, e.g. `const REAL *restrict H` with REAL = float."""
    tokens = [t for t in text.replace("*", " * ").split() if t not in _QUALIFIERS]
    pointer = "*" in tokens
    *type_tokens, name = [t for t in tokens if t != "*"]
    ctype = " ".join(macros.get(t, t) for t in type_tokens)
    if ctype not in _SCALAR_CTYPES and not (pointer and ctype in _POINTEE_DTYPES):
        raise KernelSignatureError(f"C parameter {text.strip()!r}: type {ctype!r} has no binding in cpu_kernels")
    return CParam(name, ctype, pointer)


def _definitions(text: str, macros: dict[str, str], out: dict[str, CSignature]) -> None:
    """Add the exported definitions in source `text` (comments removed) with the type macros `macros`."""
    for returns, generic, plain, params in _DEFINITION.findall(text):
        if generic and "SFX" not in macros:
            raise KernelSignatureError(f"FN({generic}) is defined outside a #define SFX block")
        symbol = f"{generic}_{macros['SFX']}" if generic else plain
        out[symbol] = CSignature(symbol, returns, tuple(_param(p, macros) for p in params.split(",") if p.strip()))


def _read_source(name: str, macros: dict[str, str], out: dict[str, CSignature]) -> None:
    """Read csrc/`name` as the preprocessor would for the type macros: #define REAL/SFX/KV_T sets them, #include
    "x.h" reads x.h with the macros at that point (undef_generic.h clears them), and the definitions found are
    instantiated with the macros in effect at the file's end (a header is included inside one type block)."""
    text = _COMMENT.sub("", (SOURCE_DIR / name).read_text())
    for define, value, include in _DIRECTIVE.findall(text):
        if define:
            macros[define] = value
        elif include == "undef_generic.h":
            macros.clear()
        else:
            _read_source(include, macros, out)
    if not name.endswith(".c"):
        _definitions(text, macros, out)
    else:  # a .c file's own definitions are not type-generic
        _definitions(text, {}, out)


def c_signatures(library: str) -> dict[str, CSignature]:
    """{symbol: CSignature} of every function library `library` exports, read from csrc/<library>.c and the headers
    it includes (a type-generic kernel once per type it is instantiated for: name_f32, name_f64, ...)."""
    out: dict[str, CSignature] = {}
    _read_source(f"{library}.c", {}, out)
    return out


_SUFFIXES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}


class Kernel:
    """One C kernel of library `library` as its Python caller calls it: `name` (FN's name, without the type suffix;
    generic=False: a plain C function) and `params`, the C parameter names the caller passes, in order.

    The declaration is checked against the C definition of every type the kernel is instantiated for when the
    library loads (at once, if it already has): another count, order or name raises KernelSignatureError. A call
    `kernel(dtype, *args)` runs the instantiation for `dtype` (float32, float64, or bfloat16: MoDA's slot type)
    and converts each argument by its C type: a pointer takes a CPU tensor of its element dtype (REAL: the
    kernel's type; None: NULL) and passes its data pointer; int/long take a Python int; float/double a number.
    Anything else raises TypeError naming the kernel and the parameter, before the C code runs."""

    def __init__(self, library: str, name: str, params: str, generic: bool = True):
        self.library, self.name, self.params, self.generic = library, name, tuple(params.split()), generic
        self._calls: dict[torch.dtype | None, tuple] = {}
        _declared.setdefault(library, []).append(self)
        if _libs.get(library) is not None:
            self.bind(_libs[library], c_signatures(library))

    def symbols(self, signatures: dict[str, CSignature]) -> list[str]:
        """The C symbols of this kernel among `signatures` (one per type it is instantiated for)."""
        if not self.generic:
            return [self.name] if self.name in signatures else []
        return [f"{self.name}_{sfx}" for sfx in _SUFFIXES.values() if f"{self.name}_{sfx}" in signatures]

    def check(self, signatures: dict[str, CSignature]) -> None:
        """Raise KernelSignatureError unless every instantiation's parameter names are this declaration's."""
        symbols = self.symbols(signatures)
        if not symbols:
            raise KernelSignatureError(f"kernel {self.name!r}: no C definition in library {self.library!r}")
        for symbol in symbols:
            c_names = tuple(p.name for p in signatures[symbol].params)
            if c_names != self.params:
                raise KernelSignatureError(
                    f"kernel {symbol} (library {self.library!r}): the caller passes {len(self.params)} arguments "
                    f"({' '.join(self.params)}), the C definition takes {len(c_names)} ({' '.join(c_names)})")

    def bind(self, lib: ctypes.CDLL, signatures: dict[str, CSignature]) -> None:
        """Check the declaration, then set each instantiation's ctypes argument and return types from its C
        definition and keep its argument converters."""
        self.check(signatures)
        for symbol in self.symbols(signatures):
            sig = signatures[symbol]
            fn = getattr(lib, symbol)
            fn.argtypes = [ctypes.c_void_p if p.pointer else _SCALAR_CTYPES[p.ctype] for p in sig.params]
            fn.restype = _RETURN_CTYPES[sig.returns]
            dtype = next((t for t, sfx in _SUFFIXES.items() if symbol.endswith(f"_{sfx}")), None)
            self._calls[dtype if self.generic else None] = (fn, tuple(
                (p.name, _POINTEE_DTYPES[p.ctype] if p.pointer else None, p.ctype) for p in sig.params))

    def __call__(self, dtype: torch.dtype | None, *args):
        """Run the kernel's `dtype` instantiation (None for a plain function) on `args` (see the class docstring);
        its C return value (a status: nonzero = failed), or None for a void function."""
        if not self._calls:
            library(self.library)  # loads and binds; a caller checks `*_usable` first, so it is built
        fn, params = self._calls[dtype if self.generic else None]
        if len(args) != len(params):
            raise TypeError(f"kernel {fn.__name__} takes {len(params)} arguments, got {len(args)}")
        converted = []
        for spec, arg in zip(params, args):  # (inline: this runs ~100 times a training step)
            dtypes = spec[1]
            if dtypes is None:  # a number: ctypes converts it, after this check of its kind
                if not isinstance(arg, _NUMBER_KINDS[spec[2]]):
                    raise TypeError(f"kernel {fn.__name__}, argument {spec[0]}: wants a {spec[2]}, got "
                                    f"{type(arg).__name__}")
                converted.append(arg)
            elif arg is None:
                converted.append(None)
            elif type(arg) is torch.Tensor and arg.dtype in dtypes and arg.is_cpu or _cpu_tensor(arg, dtypes):
                converted.append(arg.data_ptr())
            else:
                got = f"{arg.dtype} tensor on {arg.device}" if isinstance(arg, torch.Tensor) else type(arg).__name__
                raise TypeError(f"kernel {fn.__name__}, argument {spec[0]}: wants a CPU tensor of {dtypes[0]} "
                                f"({spec[2]} *), got {got}")
        return fn(*converted)


_NUMBER_KINDS = {"int": int, "long": int, "float": (int, float), "double": (int, float)}


def _cpu_tensor(arg, dtypes) -> bool:
    """Whether `arg` is a CPU tensor (a subclass too, e.g. a Parameter) of one of `dtypes`."""
    return isinstance(arg, torch.Tensor) and arg.dtype in dtypes and arg.is_cpu


_declared: dict[str, list[Kernel]] = {}  # library name: the kernels its callers declared


def _bind_declared(name: str, lib: ctypes.CDLL) -> None:
    """Check and bind every kernel declared for library `name` (KernelSignatureError on a mismatch)."""
    signatures = c_signatures(name)
    for kernel in _declared.get(name, []):
        kernel.bind(lib, signatures)


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
    return lib


def library(name: str = "sinkhorn", folder: Path | None = None) -> ctypes.CDLL | None:
    """The built kernel library `name` ("sinkhorn", "connector", "bank", "moda" or "rowmetrics"), or None (no
    compiler, or the build failed: logged once); built on this first call in `folder` (default `_kernel_folder()`)."""
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
            if lib is not None:
                _bind_declared(name, lib)  # outside the try: a signature mismatch is raised, not a fallback
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


def rowmetrics_usable(z: torch.Tensor) -> bool:
    """Whether the row-metrics kernel takes logits z ([n, V] or [B, T, V]): float32 on CPU, unit stride along the
    vocabulary, and the library built."""
    return (z.dtype == torch.float32 and z.device.type == "cpu" and z.dim() in (2, 3) and z.stride(-1) == 1
            and z.shape[-1] > 0 and library("rowmetrics") is not None)
