"""mHC's Sinkhorn as one small C kernel for CPU tensors, built on first use with the system C compiler.

Why (issue 20; figures in benchmarks/RESULTS.md, "Compiled training (issue 20)"): the Sinkhorn of
n = 4 streams is 2·t_max - 1 = 39 alternating half-steps over [4, 4, N] logits. With torch ops each
half-step is three dispatches of tiny kernels (~15k per training step at L32), and inductor does no
better: written as a reduction it compiles to slower code than the eager tokens-last kernel, and
written as 16 elementwise [N] streams it fuses into one loop per direction but materialises hundreds
of [N] buffers and takes about a minute to compile. Here each token's n x n matrix is iterated in
L1 (tokens in blocks of 64, the vectorised inner loop), forward and backward (the backward recomputes
the iterates per block, so nothing is saved between them): about 3x faster than the torch kernel.

The same iteration as `hyper._sinkhorn_forward` / `_sinkhorn_backward` (softmax over dim `first` --
max-subtracted exp, then 1/sum --, half-steps m · 1/max(Σ m, tiny), sums in index order); it multiplies
by reciprocals where the torch kernel divides (4 divisions per half-step instead of 16; not timed
separately), so results differ by an ulp or so per half-step; no -ffast-math, no FMA contraction.
tests/test_compile.py compares it with the reference in float64 and float32, values and gradients.

Used only by the compiled training path (`compiled.sinkhorn_op`, opaque to torch.compile) for
contiguous float32/float64 CPU tensors; anything else (CUDA, other dtypes, no C compiler, a failed
build) takes the torch-op kernel. The shared object is cached next to inductor's cache
(`compiled.cache_dir()`), keyed by the source, the compiler and this CPU's flags (-march=native).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_TEMPLATE = r"""
/* T = @T@: z, out tokens-last [n*n][N] (entry k = o*n + i: row o = output stream, column i = input
   stream). A "group" is one line of the matrix: dim 0 = a column (entries g, n+g, 2n+g, ...: the
   column sums), dim 1 = a row (entries g*n .. g*n+n-1). Softmax over `first`'s lines; half-step
   `step` normalises dim (first + 1 + step) % 2. Work arrays are [entry][BLK] blocks of BLK tokens. */

static inline int base_@S@(int dim, int g, int n) { return dim == 0 ? g : g * n; }
static inline int stride_@S@(int dim, int n) { return dim == 0 ? n : 1; }

/* s = sum over the group's entries (index order), then m /= max(s, tiny) for them; s kept in ss. */
static inline void half_step_@S@(@T@ *restrict m, @T@ *restrict s, int n, int dim, int g, @T@ tiny) {
    int k0 = base_@S@(dim, g, n), st = stride_@S@(dim, n);
    for (int b = 0; b < BLK; b++) s[b] = m[k0 * BLK + b];
    for (int j = 1; j < n; j++) {
        const @T@ *restrict row = m + (k0 + j * st) * BLK;
        for (int b = 0; b < BLK; b++) s[b] += row[b];
    }
    @T@ r[BLK];
    for (int b = 0; b < BLK; b++) { @T@ c = s[b] < tiny ? tiny : s[b]; r[b] = 1 / c; s[b] = r[b]; }
    for (int j = 0; j < n; j++) {
        @T@ *restrict row = m + (k0 + j * st) * BLK;
        for (int b = 0; b < BLK; b++) row[b] = row[b] * r[b];
    }
}

static void fwd_block_@S@(@T@ *restrict m, @T@ *restrict p, @T@ *restrict ys, @T@ *restrict ss,
                          int n, int t_max, int first, @T@ tiny) {
    int nn = n * n, st = stride_@S@(first, n);
    for (int g = 0; g < n; g++) {
        int k0 = base_@S@(first, g, n);
        @T@ mx[BLK], s[BLK];
        for (int b = 0; b < BLK; b++) mx[b] = m[k0 * BLK + b];
        for (int j = 1; j < n; j++) {
            const @T@ *restrict row = m + (k0 + j * st) * BLK;
            for (int b = 0; b < BLK; b++) mx[b] = row[b] > mx[b] ? row[b] : mx[b];
        }
        for (int j = 0; j < n; j++) {
            @T@ *restrict row = m + (k0 + j * st) * BLK;
            for (int b = 0; b < BLK; b++) row[b] = @EXP@(row[b] - mx[b]);
        }
        half_step_@S@(m, s, n, first, g, 0);  /* then 1/sum: the sum is >= 1 (its max term is exp(0)), no clamp */
    }
    if (p) memcpy(p, m, sizeof(@T@) * nn * BLK);
    int steps = 2 * t_max - 1;
    @T@ s[BLK];
    for (int step = 0; step < steps; step++) {
        int dim = (first + 1 + step) % 2;
        for (int g = 0; g < n; g++) {
            half_step_@S@(m, ss ? ss + ((long)step * n + g) * BLK : s, n, dim, g, tiny);
        }
        if (ys) memcpy(ys + (long)step * nn * BLK, m, sizeof(@T@) * nn * BLK);
    }
}

/* g <- (g - sum_group g*y) / s   (or, softmax: g <- y * (g - sum_group g*y) with s == 0) */
static inline void back_group_@S@(@T@ *restrict g, const @T@ *restrict y, const @T@ *restrict s,
                                  int n, int dim, int gr) {
    int k0 = base_@S@(dim, gr, n), st = stride_@S@(dim, n);
    @T@ dot[BLK];
    for (int b = 0; b < BLK; b++) dot[b] = g[k0 * BLK + b] * y[k0 * BLK + b];
    for (int j = 1; j < n; j++) {
        int k = k0 + j * st;
        for (int b = 0; b < BLK; b++) dot[b] += g[k * BLK + b] * y[k * BLK + b];
    }
    for (int j = 0; j < n; j++) {
        int k = k0 + j * st;
        if (s) { for (int b = 0; b < BLK; b++) g[k * BLK + b] = (g[k * BLK + b] - dot[b]) * s[b]; }
        else { for (int b = 0; b < BLK; b++) g[k * BLK + b] = y[k * BLK + b] * (g[k * BLK + b] - dot[b]); }
    }
}

static void load_@S@(const @T@ *restrict z, @T@ *restrict m, long N, long t0, int nn) {
    long cnt = N - t0 < BLK ? N - t0 : BLK;
    for (int k = 0; k < nn; k++) {
        for (long b = 0; b < cnt; b++) m[k * BLK + b] = z[k * N + t0 + b];
        for (long b = cnt; b < BLK; b++) m[k * BLK + b] = 0;
    }
}

static void store_@S@(@T@ *restrict out, const @T@ *restrict m, long N, long t0, int nn) {
    long cnt = N - t0 < BLK ? N - t0 : BLK;
    for (int k = 0; k < nn; k++)
        for (long b = 0; b < cnt; b++) out[k * N + t0 + b] = m[k * BLK + b];
}

int sinkhorn_forward_@S@(const @T@ *z, @T@ *out, long N, int n, int t_max, int first, @T@ tiny) {
    @T@ *m = (@T@ *)malloc(sizeof(@T@) * n * n * BLK);
    if (!m) return 1;
    for (long t0 = 0; t0 < N; t0 += BLK) {
        load_@S@(z, m, N, t0, n * n);
        fwd_block_@S@(m, 0, 0, 0, n, t_max, first, tiny);
        store_@S@(out, m, N, t0, n * n);
    }
    free(m);
    return 0;
}

int sinkhorn_backward_@S@(const @T@ *z, const @T@ *grad, @T@ *out, long N, int n, int t_max, int first, @T@ tiny) {
    int nn = n * n, steps = 2 * t_max - 1;
    @T@ *m = (@T@ *)malloc(sizeof(@T@) * nn * BLK * 3);
    @T@ *ys = (@T@ *)malloc(sizeof(@T@) * ((long)steps * nn * BLK));
    @T@ *ss = (@T@ *)malloc(sizeof(@T@) * ((long)steps * n * BLK));
    if (!m || !ys || !ss) { free(m); free(ys); free(ss); return 1; }
    @T@ *p = m + nn * BLK, *g = m + 2 * nn * BLK;
    for (long t0 = 0; t0 < N; t0 += BLK) {
        load_@S@(z, m, N, t0, nn);
        fwd_block_@S@(m, p, ys, ss, n, t_max, first, tiny);
        load_@S@(grad, g, N, t0, nn);
        for (int step = steps - 1; step >= 0; step--) {
            int dim = (first + 1 + step) % 2;
            for (int gr = 0; gr < n; gr++)
                back_group_@S@(g, ys + (long)step * nn * BLK, ss + ((long)step * n + gr) * BLK, n, dim, gr);
        }
        for (int gr = 0; gr < n; gr++) back_group_@S@(g, p, 0, n, first, gr);
        store_@S@(out, g, N, t0, nn);
    }
    free(m); free(ys); free(ss);
    return 0;
}
"""
_SOURCE = "#include <math.h>\n#include <stdlib.h>\n#include <string.h>\n#define BLK 64\n" + "".join(
    _TEMPLATE.replace("@T@", t).replace("@S@", s).replace("@EXP@", e)
    for t, s, e in (("float", "f32", "expf"), ("double", "f64", "exp")))

# -O3 vectorises the blocks' inner loops; no -ffast-math (it would reorder the sums and drop the
# NaN/Inf semantics the torch kernel has); -ffp-contract=off: no fused multiply-adds either.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


def _compiler() -> str | None:
    for cc in (os.environ.get("CC", "cc"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> ctypes.CDLL | None:
    from depthtools.arch.compiled import cache_dir

    cc = _compiler()
    if cc is None:
        return None
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, _cpu_key()]).encode()).hexdigest()[:20]
    folder = cache_dir() / "depthtools_kernels"
    target = folder / f"sinkhorn-{key}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src, out = Path(tmp) / "sinkhorn.c", Path(tmp) / "sinkhorn.so"
            src.write_text(_SOURCE)
            subprocess.run([cc, *_FLAGS, "-o", str(out), str(src), "-lm"], check=True, capture_output=True, text=True)
            os.replace(out, target)  # atomic: concurrent builders agree
    lib = ctypes.CDLL(str(target))
    for suffix, ctype in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        fwd, bwd = getattr(lib, f"sinkhorn_forward_{suffix}"), getattr(lib, f"sinkhorn_backward_{suffix}")
        fwd.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctype]
        bwd.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctype]
        fwd.restype = bwd.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (no compiler, or the build failed: logged once)."""
    global _lib, _failed
    if _lib is not None or _failed:
        return _lib
    with _lock:
        if _lib is None and not _failed:
            try:
                _lib = _build()
            except (OSError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
                logger.warning("Sinkhorn CPU kernel unavailable (%s); using the torch-op kernel", str(detail)[:500])
            _failed = _lib is None
    return _lib


_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the C kernel takes these tensors: CPU, float32/float64, contiguous, same dtype, built."""
    t = tensors[0]
    return (all(x.device.type == "cpu" and x.dtype == t.dtype and x.is_contiguous() for x in tensors)
            and t.dtype in _SUFFIX and library() is not None)


def sinkhorn_forward(z: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """The Sinkhorn result [n, n, N] of tokens-last logits z (contiguous; `usable(z)`)."""
    n, N = z.shape[0], z.shape[2]
    out = torch.empty_like(z)
    fn = getattr(library(), f"sinkhorn_forward_{_SUFFIX[z.dtype]}")
    if fn(z.data_ptr(), out.data_ptr(), N, n, t_max, first, torch.finfo(z.dtype).tiny):
        raise MemoryError("Sinkhorn CPU kernel: out of memory")
    return out


def sinkhorn_backward(z: torch.Tensor, grad: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """The gradient of the logits z [n, n, N] from the result's gradient `grad` (same layout)."""
    n, N = z.shape[0], z.shape[2]
    out = torch.empty_like(z)
    fn = getattr(library(), f"sinkhorn_backward_{_SUFFIX[z.dtype]}")
    if fn(z.data_ptr(), grad.data_ptr(), out.data_ptr(), N, n, t_max, first, torch.finfo(z.dtype).tiny):
        raise MemoryError("Sinkhorn CPU kernel: out of memory")
    return out
