"""Small C kernels for HC/mHC, AttnRes and MoDA training on CPU: sources in `depthtools/arch/csrc/`, built by
torch.utils.cpp_extension (JIT, with ninja) on the first real CPU call that needs them (one log line), cached, and
called through ctypes.

Four libraries, one source file each (`csrc/<name>.c`, which says what its kernels do and why, with the figures'
places in benchmarks/RESULTS.md): "sinkhorn" (mHC's Sinkhorn), "connector" (HC's and mHC's whole connectors,
forward and backward), "bank" (AttnRes' depth bank: a mix, a two-phase prefix, a backward flush) and "moda"
(MoDA's depth attention: forward, backward, slot gradients, slot stores). The kernels are written once per
scalar type and instantiated per type by including `*_impl.h` with `REAL`/`FN` defined (`csrc/generic.h`).

The Sinkhorn kernel serves the compiled path's opaque op (`compiled.sinkhorn_op`); the connector kernels
serve both the compiled step's opaque ops (`compiled.hc_connect_op`, `mhc_connect_op`) and the eager
`hyper._HCConnect` / `_MHCConnect`; the bank and moda kernels are called by the torch custom ops in
`depthtools/arch/ops/bank.py` (`bankops.DepthBank`, eager and compiled steps alike) and `ops/moda.py`
(`moda._DepthAttention` and `_AppendSlots`, eager), which look them up with `entry`.
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
        from torch.utils import cpp_extension  # here: it imports setuptools, needed only for a cold build

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


def hc_pack(Wa: torch.Tensor, wb: torch.Tensor, Sa: torch.Tensor, sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HC's parameters in the kernels' layout: (Pt = [W_a | w_b]ᵀ [n+2,d] contiguous, S = [S_a | s_b] [n,n+2])."""
    return torch.cat([Wa, wb.unsqueeze(1)], 1).t().contiguous(), torch.cat([Sa, sb.unsqueeze(1)], 1)


def mhc_pack(phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res) -> tuple[torch.Tensor, ...]:
    """mHC's parameters in the kernels' layout: (PhiT = [φ_pre | φ_post | φ_res]ᵀ [2n+n², n·d], gates
    (g_pre, g_post, g_res) [3], b_pre, b_post, b_res flattened row-major [n²]), all contiguous."""
    return (torch.cat([phi_pre, phi_post, phi_res], 1).t().contiguous(), torch.stack([g_pre, g_post, g_res]),
            b_pre.contiguous(), b_post.contiguous(), b_res.reshape(-1).contiguous())


def sinkhorn_forward(z: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """The Sinkhorn result [n, n, N] of tokens-last logits z (contiguous; `usable(z)`)."""
    n, N = z.shape[0], z.shape[2]
    out = torch.empty_like(z)
    fn = getattr(library("sinkhorn"), f"sinkhorn_forward_{_SUFFIX[z.dtype]}")
    if fn(z.data_ptr(), out.data_ptr(), N, n, t_max, first, torch.finfo(z.dtype).tiny):
        raise MemoryError("Sinkhorn CPU kernel: out of memory")
    return out


def sinkhorn_backward(z: torch.Tensor, grad: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """The gradient of the logits z [n, n, N] from the result's gradient `grad` (same layout)."""
    n, N = z.shape[0], z.shape[2]
    out = torch.empty_like(z)
    fn = getattr(library("sinkhorn"), f"sinkhorn_backward_{_SUFFIX[z.dtype]}")
    if fn(z.data_ptr(), grad.data_ptr(), out.data_ptr(), N, n, t_max, first, torch.finfo(z.dtype).tiny):
        raise MemoryError("Sinkhorn CPU kernel: out of memory")
    return out


def _fn(name: str, t: torch.Tensor, lib: str = "connector"):
    """Kernel `name` of library `lib` for `t`'s scalar type."""
    return getattr(library(lib), f"{name}_{_SUFFIX[t.dtype]}")


def hc_connect_forward(H: torch.Tensor, Pt: torch.Tensor, S: torch.Tensor, scale: torch.Tensor, eps: float):
    """The HC connector on streams H [N,n,d] (all contiguous, `connector_usable`):
    (out [N,n+1,d] = [w; R] @ H, depth [N,n], raw [N,n,n+2], inv [N,n], t [N,n,n+2]) for the projection
    Pt = [W_m | W_r | W_b]ᵀ [n+2,d], static S = [S_m | S_r | S_b] [n,n+2] and scale [n+2] (s_a x (n+1), s_b);
    raw = H_s · P_j, inv = 1/rms(H_s), t = tanh(raw · inv), coefficients S + scale ⊙ t."""
    N, n, d = H.shape
    out, depth = H.new_empty(N, n + 1, d), H.new_empty(N, n)
    raw, inv, t = H.new_empty(N, n, n + 2), H.new_empty(N, n), H.new_empty(N, n, n + 2)
    _fn("hc_connect_forward", H)(H.data_ptr(), Pt.data_ptr(), S.data_ptr(), scale.data_ptr(), N, n, d, eps,
                                 out.data_ptr(), depth.data_ptr(), raw.data_ptr(), inv.data_ptr(), t.data_ptr(),
                                 torch.get_num_threads())
    return out, depth, raw, inv, t


def hc_connect_backward(H, Pt, S, scale, raw, inv, t, g_out, g_depth):
    """(dL/dH, dL/dPt, dL/dS, dL/dscale) from the gradients g_out [N,n+1,d], g_depth [N,n] of
    `hc_connect_forward`'s first two outputs (all contiguous); parameter gradients summed in float64."""
    N, n, d = H.shape
    gH, gPt, gS, gscale = torch.empty_like(H), torch.empty_like(Pt), torch.empty_like(S), torch.empty_like(scale)
    if _fn("hc_connect_backward", H)(H.data_ptr(), Pt.data_ptr(), S.data_ptr(), scale.data_ptr(), raw.data_ptr(),
                                     inv.data_ptr(), t.data_ptr(), g_out.data_ptr(), g_depth.data_ptr(), N, n, d,
                                     gH.data_ptr(), gPt.data_ptr(), gS.data_ptr(), gscale.data_ptr(),
                                     torch.get_num_threads()):
        raise MemoryError("HC connector CPU kernel: out of memory")
    return gH, gPt, gS, gscale


def tanh_f32(x: torch.Tensor) -> torch.Tensor:
    """The connector kernels' float32 tanh over a contiguous float32 tensor (for tests)."""
    y = torch.empty_like(x)
    library("connector").tanh_f32_array(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """The connector kernels' float32 exp over a contiguous float32 tensor (for tests)."""
    y = torch.empty_like(x)
    library("connector").exp_f32_array(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def mhc_connect_forward(H: torch.Tensor, PhiT: torch.Tensor, gates: torch.Tensor, b_pre: torch.Tensor,
                        b_post: torch.Tensor, b_res: torch.Tensor, eps: float, t_max: int, first: int):
    """The mHC connector on streams H [N,n,d] (all contiguous, `connector_usable`): (out [N,n+1,d]
    = [H_pre; H_res] @ H, H_post [N,n], raw [N,J], inv [N]) for PhiT = [φ_pre | φ_post | φ_res]ᵀ [J, n·d]
    (J = 2n + n²), gates = (g_pre, g_post, g_res) [3], biases b_pre [n], b_post [n], b_res [n·n] (row o =
    output stream); raw = vec(H) · φ_j, inv = 1/rms(vec H); the Sinkhorn as `sinkhorn_forward`."""
    N, n, d = H.shape
    J = PhiT.shape[0]
    out, depth, raw, inv = H.new_empty(N, n + 1, d), H.new_empty(N, n), H.new_empty(N, J), H.new_empty(N)
    if _fn("mhc_connect_forward", H)(H.data_ptr(), PhiT.data_ptr(), gates.data_ptr(), b_pre.data_ptr(),
                                     b_post.data_ptr(), b_res.data_ptr(), N, n, d, eps, t_max, first,
                                     torch.finfo(H.dtype).tiny, out.data_ptr(), depth.data_ptr(), raw.data_ptr(),
                                     inv.data_ptr(), torch.get_num_threads()):
        raise MemoryError("mHC connector CPU kernel: out of memory")
    return out, depth, raw, inv


def mhc_connect_backward(H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth, t_max: int, first: int):
    """(dL/dH, dL/dPhiT, dL/dgates, dL/db_pre, dL/db_post, dL/db_res) from the gradients g_out [N,n+1,d],
    g_depth [N,n] of `mhc_connect_forward`'s first two outputs; parameter gradients summed in float64."""
    N, n, d = H.shape
    grads = [torch.empty_like(x) for x in (H, PhiT, gates, b_pre, b_post, b_res)]
    if _fn("mhc_connect_backward", H)(H.data_ptr(), PhiT.data_ptr(), gates.data_ptr(), b_pre.data_ptr(),
                                      b_post.data_ptr(), b_res.data_ptr(), raw.data_ptr(), inv.data_ptr(),
                                      g_out.data_ptr(), g_depth.data_ptr(), N, n, d, t_max, first,
                                      torch.finfo(H.dtype).tiny, *(g.data_ptr() for g in grads), torch.get_num_threads()):
        raise MemoryError("mHC connector CPU kernel: out of memory")
    return tuple(grads)


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


def entry(lib: str, name: str, dtype: torch.dtype):
    """The ctypes function `name` of the built library `lib` ("bank" or "moda") for scalar type `dtype`: float32,
    float64, or bfloat16 (moda's slot type: `moda_forward`, `moda_backward`, `moda_store_slot` by their slots'
    dtype). The op modules that call it (depthtools/arch/ops/bank.py, ops/moda.py) check `bank_usable` /
    `moda_usable` first."""
    return getattr(library(lib), f"{name}_{'bf16' if dtype == torch.bfloat16 else _SUFFIX[dtype]}")
