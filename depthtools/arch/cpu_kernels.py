"""Small C kernels for HC/mHC, AttnRes and MoDA training on CPU: sources in `depthtools/arch/csrc/`, built by
torch.utils.cpp_extension (JIT, with ninja) on the first real CPU call that needs them (one log line), cached, and
called through ctypes.

Four libraries, one source file each (`csrc/<name>.c`, which says what its kernels do and why, with the figures'
places in benchmarks/RESULTS.md): "sinkhorn" (mHC's Sinkhorn), "connector" (HC's and mHC's whole connectors,
forward and backward), "bank" (AttnRes' depth bank: a mix, a two-phase prefix, a backward flush) and "moda"
(MoDA's depth attention: forward, backward, slot gradients, slot stores). The kernels are written once per
scalar type and instantiated per type by including `*_impl.h` with `REAL`/`FN` defined (`csrc/generic.h`).

The Sinkhorn and connector kernels are called (ctypes wrappers included) by their torch custom ops,
`ops/sinkhorn.py` (`depthtools::sinkhorn_tokens_last`) and `ops/connector.py` (`depthtools::hc_connect`,
`depthtools::mhc_connect`), which the eager and the compiled HC/mHC paths both call; this module keeps their build,
load and `usable` / `connector_usable` checks. The bank kernels serve `bankops.DepthBank` (eager and compiled steps alike);
the moda kernels serve `moda._DepthAttention` and `_AppendSlots` (MoDA runs eagerly).
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


def function(lib: str, name: str, dtype: torch.dtype):
    """Kernel `name` of the built library `lib` for scalar type `dtype` (float32/float64): the ctypes function the
    ops in `depthtools.arch.ops` call (check `usable` / `connector_usable` first)."""
    return getattr(library(lib), f"{name}_{_SUFFIX[dtype]}")


def _fn(name: str, t: torch.Tensor, lib: str = "connector"):
    """Kernel `name` of library `lib` for `t`'s scalar type."""
    return getattr(library(lib), f"{name}_{_SUFFIX[t.dtype]}")


def bank_usable(values: torch.Tensor) -> bool:
    """Whether the depth-bank kernels take a bank whose buffers have `values`' dtype and device: float32/
    float64 on CPU, and the library built."""
    return _cpu_float((values,)) and library("bank") is not None


def bank_mix_forward(values, inv_rms, dots, n: int, col: int, partial=None, partial_logit=None, prefix=None):
    """(h [N,d], alpha [n(+1), N]) of one depth mix over the first n sources of a bank (values [cap,N,d],
    inv_rms [cap,N], dots [cap,M,N]; contiguous) with logits dots[i, col] * inv_rms[i], plus an optional
    partial source [N,d] with its logit [N] (alpha's last row). prefix = (n0, mu [N], P [N,d] rows, may be
    strided): the two-phase mix, sources below n0 entering through P (bankops.DepthBank.prefix_mix)."""
    N, d, M = values.shape[1], values.shape[2], dots.shape[1]
    h = values.new_empty(N, d)
    alpha = values.new_empty(n + (partial is not None), N)
    n0, mu, P = prefix if prefix is not None else (0, None, None)
    if P is not None:
        assert P.stride(1) == 1 and mu.is_contiguous()
    ptr = (lambda x: None if x is None else x.data_ptr())
    if _fn("bank_mix_forward", values, "bank")(values.data_ptr(), inv_rms.data_ptr(), dots.data_ptr(), N, d, M, n, col,
                                         ptr(partial_logit), ptr(partial), n0, ptr(mu), ptr(P),
                                         0 if P is None else P.stride(0), h.data_ptr(), alpha.data_ptr(),
                                         torch.get_num_threads()):
        raise MemoryError("AttnRes bank CPU kernel: out of memory")
    return h, alpha


def bank_prefix(values, inv_rms, dots, n0: int, cols: list[int]):
    """(mu [G,N], P [N,G,d]): the two-phase prefix of the G mixers `cols` over the first n0 sources of a bank
    (bankops.DepthBank.prefix_mix): mu = max_i logit, P = Σ_i exp(logit_i - mu) v_i."""
    N, d, M = values.shape[1], values.shape[2], dots.shape[1]
    G = len(cols)
    mu, P = values.new_empty(G, N), values.new_empty(N, G, d)
    table = torch.tensor(cols, dtype=torch.long)
    if _fn("bank_prefix", values, "bank")(values.data_ptr(), inv_rms.data_ptr(), dots.data_ptr(), N, d, M, n0, G,
                                       table.data_ptr(), mu.data_ptr(), P.data_ptr(), torch.get_num_threads()):
        raise MemoryError("AttnRes bank CPU kernel: out of memory")
    return mu, P


def bank_flush(values, inv_rms, dots, lo: int, hi: int, grads, weights, rhos, cols, gv, gdots, ginv) -> None:
    """Add the contributions of K recorded mixes (output gradients grads k x [N,d], rho = g·h k x [N],
    softmax weights k x [n_k, N] with n_k >= hi, mixer columns) to the gradients of sources lo..hi-1:
    gv [cap,N,d], gdots [cap,M,N], ginv [cap,N] (in place; all contiguous, the bank's dtype)."""
    N, d, M = values.shape[1], values.shape[2], dots.shape[1]
    table = torch.tensor([[x.data_ptr() for x in xs] for xs in (grads, weights, rhos)] + [list(cols)], dtype=torch.long)
    K = len(cols)
    _fn("bank_flush", values, "bank")(values.data_ptr(), inv_rms.data_ptr(), dots.data_ptr(), N, d, M, lo, hi, K,
                                   table[0].data_ptr(), table[1].data_ptr(), table[2].data_ptr(), table[3].data_ptr(),
                                   gv.data_ptr(), gdots.data_ptr(), ginv.data_ptr(), torch.get_num_threads())


def moda_usable(t: torch.Tensor, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the MoDA depth-attention kernels take tensors like `t` with slots stored as `kv_dtype` (default:
    t's dtype): float32/float64 on CPU (slots of the same dtype, or bfloat16 slots with float32), and the
    library built."""
    kv_dtype = t.dtype if kv_dtype is None else kv_dtype
    return (_cpu_float((t,)) and (kv_dtype == t.dtype or (kv_dtype, t.dtype) == (torch.bfloat16, torch.float32))
            and library("moda") is not None)


def _moda_fn(name: str, kv: torch.Tensor):
    """Kernel `name` of the moda library for slots stored like `kv` (float32, float64 or bfloat16)."""
    return getattr(library("moda"), f"{name}_{'bf16' if kv.dtype == torch.bfloat16 else _SUFFIX[kv.dtype]}")


def _mask(invalid: torch.Tensor | None) -> torch.Tensor | None:
    return None if invalid is None else invalid.to(torch.uint8).contiguous()


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, token stride) for x [B,T,...] whose B*T tokens are equally spaced rows of contiguous values (the
    model's [B,T,H,hd] projections and the flash kernel's outputs are), else (a contiguous copy, its stride)."""
    inner = x[0, 0]
    if not inner.is_contiguous() or x.shape[0] > 1 and x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x, x.stride(1)


def moda_forward(K, V, q, o, lse_seq, invalid, scale: float):
    """The depth part of one MoDA attention joined with its sequence part: (z [B,T,H,hd], lse [B,T,H], probs
    [S,Hkv,g,N], qs [Hkv,g,hd,N] = the scaled depth query tokens last, for the slot gradients) from slots K, V
    [S,Hkv,hd,N] (contiguous), the depth query q [B,T,H,hd] (unscaled), the sequence part's output o [B,T,H,hd]
    and log-sum-exp lse_seq [B,T,H], invalid [S] bool (masked slots)."""
    S, Hkv, hd, N = K.shape
    B, T, H, _ = q.shape
    (q, qst), (o, ost), (lse_seq, lst) = _rows(q), _rows(o), _rows(lse_seq)
    z, lse, probs, qs = q.new_empty(B, T, H, hd), q.new_empty(B, T, H), q.new_empty(S, Hkv, H // Hkv, N), q.new_empty(Hkv, H // Hkv, hd, N)
    mask = _mask(invalid)
    if _moda_fn("moda_forward", K)(K.data_ptr(), V.data_ptr(), q.data_ptr(), qst, scale, o.data_ptr(), ost,
                                      lse_seq.data_ptr(), lst, None if mask is None else mask.data_ptr(), S, Hkv,
                                      H // Hkv, hd, N, z.data_ptr(), lse.data_ptr(), probs.data_ptr(), qs.data_ptr(),
                                      torch.get_num_threads()):
        raise MemoryError("MoDA depth-attention CPU kernel: out of memory")
    return z, lse, probs, qs


def moda_backward(K, V, z, dz, probs, invalid, scale: float):
    """(dqd [B,T,H,hd], ds [S,Hkv,g,N], dzt [Hkv,g,hd,N]) of `moda_forward`: the gradient of the unscaled depth
    query, the slots' score gradients and dz tokens last, from the output z and its gradient dz [B,T,H,hd]
    (contiguous)."""
    S, Hkv, hd, N = K.shape
    H = z.shape[2]
    dqd, ds, dzt = torch.empty_like(z), torch.empty_like(probs), z.new_empty(Hkv, H // Hkv, hd, N)
    mask = _mask(invalid)
    if _moda_fn("moda_backward", K)(K.data_ptr(), V.data_ptr(), z.data_ptr(), dz.data_ptr(), probs.data_ptr(),
                                       None if mask is None else mask.data_ptr(), S, Hkv, H // Hkv, hd, N, scale,
                                       dqd.data_ptr(), ds.data_ptr(), dzt.data_ptr(), torch.get_num_threads()):
        raise MemoryError("MoDA depth-attention CPU kernel: out of memory")
    return dqd, ds, dzt


def moda_slot_grads(records, start: int, stop: int, tokens: tuple[int, int], out=None):
    """(gK, gV) [stop-start,B,T,Hkv,hd] (tokens = (B, T)) of slots start..stop-1 from reader records (ds, probs, qs,
    dzt, S_r) (see `moda._SlotStore`): gK_s = Σ_r Σ_j ds_r[s,:,j] qs_r[:,j], gV_s = Σ_r Σ_j probs_r[s,:,j]
    dzt_r[:,j] over readers with S_r > s (as `moda_forward` and `moda_backward` return them, contiguous).
    out = (gK, gV) (contiguous): add to these instead (returned)."""
    ds0 = records[0][0]
    Hkv, g, hd, N = records[0][2].shape
    if out is None:
        gk, gv = ds0.new_empty(stop - start, *tokens, Hkv, hd), ds0.new_empty(stop - start, *tokens, Hkv, hd)
    else:
        gk, gv = out
    table = torch.tensor([[r[k].data_ptr() for r in records] for k in range(4)] + [[r[4] for r in records]],
                         dtype=torch.long)
    if _fn("moda_slot_grads", ds0, "moda")(len(records), *(row.data_ptr() for row in table), start, stop, Hkv, g,
                                            hd, N, gk.data_ptr(), gv.data_ptr(), int(out is not None),
                                            torch.get_num_threads()):
        raise MemoryError("MoDA slot-gradient CPU kernel: out of memory")
    return gk, gv


MODA_STREAM_STORES = True  # False: plain stores only (for the same-run A/B in benchmarks/bench_speedups.py)


def moda_store_slot(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst [Hkv,hd,B,T] (a contiguous slot of the buffer; src's dtype, or bfloat16 for float32 src: rounded to
    nearest even) = src [B,T,Hkv,hd] (token rows), tokens last; whole 64-byte rows written with streaming stores
    (`MODA_STREAM_STORES`)."""
    src, rs = _rows(src)
    B, T, Hkv, hd = src.shape
    _moda_fn("moda_store_slot", dst)(src.data_ptr(), rs, Hkv * hd, B * T, dst.data_ptr(), int(MODA_STREAM_STORES),
                                     torch.get_num_threads())
