"""Small C kernels for HC/mHC, AttnRes and MoDA training on CPU, built with the system C compiler on first use
(or ahead, in the background, when a model that uses them is constructed: `prebuild`): four libraries,
"sinkhorn" (mHC's Sinkhorn, below), "connector" (HC's and mHC's whole connectors, forward and backward: see
the comment above _CONNECTOR_HEAD, `hc_connect_forward` and `mhc_connect_forward`), "bank" (AttnRes' depth
bank: a mix, a two-phase prefix, a backward flush; see the comment above _BANK_TEMPLATE) and "moda" (MoDA's
depth attention: forward, backward, slot gradients, slot stores; see the comment above _MODA_TEMPLATE).

mHC's Sinkhorn:

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

The Sinkhorn kernel serves the compiled path's opaque op (`compiled.sinkhorn_op`); the connector kernels
serve both the compiled step's opaque ops (`compiled.hc_connect_op`, `mhc_connect_op`) and the eager
`hyper._HCConnect` / `_MHCConnect`; the bank kernels serve `bankops.DepthBank` (eager and compiled steps alike);
the moda kernels serve `moda._DepthAttention` and `_AppendSlots` (MoDA runs eagerly).
Only float32/float64 CPU tensors take them (`usable`, `connector_usable`, `bank_usable`, `moda_usable`; MoDA's
may read bfloat16 slots); anything else (CUDA, other dtypes, no C compiler, a failed build) takes torch ops. Each shared object is cached next to inductor's cache
(`compiled.cache_dir()`), keyed by its source, the compiler, its flags and this CPU's flags (-march=native).
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

# HC's (and, below, mHC's) connector as one C kernel per direction (issue 20, second library; figures in
# RESULTS.md, "Third pass"). At d = 64 a connector's cost is passes over the [N, n, d] stream state, which on
# CPU streams from memory (~8 GB/s per core here); inductor's code for an HC block is 7 kernels forward and 9
# backward, most of them passing over it. These kernels make one: per token, the n rows' 1/rms and thin
# projection, the tanh coefficients and the mix [w; R] @ H (forward); the coefficient gradients, dL/dH and
# the parameter gradients (backward), all from that token's 1 KB of streams in L1. Rows of d are dot
# products and multiply-adds, which the compiler vectorises only if it may reassociate a sum
# (-fassociative-math: a fixed, compile-time order -- deterministic, not the index order of a plain loop)
# and contract multiply-adds; NaN and Inf still propagate (no -ffinite-math-only). Tokens are split over
# torch's intra-op threads (OpenMP); parameter gradients are summed per fixed chunk of tokens, so results
# do not depend on the thread count.
_CONNECTOR_HEAD = r"""#include <math.h>
#include <string.h>
#include <stdlib.h>
#define NMAX 16
#define MMAX (NMAX + 2)
#define FLUSH 64
#define MAX_CHUNKS 256
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID omp_get_thread_num()
#define NUM_THREADS omp_get_num_threads()
#else
#define THREAD_ID 0
#define NUM_THREADS 1
#endif

/* Tokens per chunk of a backward's parameter-gradient sums: a multiple of 64 giving at most MAX_CHUNKS
   chunks. Chunks, not threads, fix the summation order, so results do not depend on the thread count. */
static inline long chunk_tokens(long N) {
    long blocks = (N + 64 * MAX_CHUNKS - 1) / (64 * MAX_CHUNKS);
    return 64 * (blocks > 0 ? blocks : 1);
}

/* exp for float32, branch-free so the compiler vectorises its loops (libm's expf is a call per element):
   x clamped to [-87.3, 88.3] (below, exp is under FLT_MIN and returns ~FLT_MIN: it only ever enters a
   sum with a term >= 1 or a 1/(1 + .) here), exp(x) = 2^k exp(r), k = rint(x / ln 2), Cody-Waite r,
   degree-7 Taylor polynomial (relative error < 1e-7), 2^k from its exponent bits. NaN propagates. */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    float kf = rintf(x * 1.44269504088896341f);
    float r = fmaf(-kf, -2.12194440e-4f, fmaf(-kf, 0.693359375f, x));  /* fmaf: -fassociative-math may not merge ln 2's two parts */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r * (1.0f / 5040)))))));
    int bits = ((int)kf + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

/* tanh for float32, branch-free: tanh |x| = (1 - e)/(1 + e), e = exp(-2|x|), for |x| >= 0.3, and the
   Taylor series to x^9 below (relative error < 1e-7); |x| clamped at 9, where tanh rounds to 1 in
   float32. NaN propagates. */
static inline float tanh_f32(float x) {
    float y = fabsf(x);
    y = y > 9.0f ? 9.0f : y;
    float e = exp_f32(-2.0f * y);
    float big = (1.0f - e) / (1.0f + e);
    float y2 = y * y;
    float small = y * (1.0f + y2 * (-1.0f / 3 + y2 * (2.0f / 15 + y2 * (-17.0f / 315 + y2 * (62.0f / 2835)))));
    float res = y < 0.3f ? small : big;
    return copysignf(res, x);
}
static inline double tanh_f64(double x) { return tanh(x); }

/* for tests: tanh_f32 / exp_f32 over x [n] */
void tanh_f32_array(const float *restrict x, float *restrict y, long n) {
    for (long i = 0; i < n; i++) y[i] = tanh_f32(x[i]);
}
void exp_f32_array(const float *restrict x, float *restrict y, long n) {
    for (long i = 0; i < n; i++) y[i] = exp_f32(x[i]);
}

"""
_CONNECTOR_TEMPLATE = r"""/* out[j] = x . P_j for the m rows of P [m][k], four at a time: four independent sums per pass over
   x (a single vectorised sum is bound by the latency of its multiply-add chain) */
static inline void dots_@S@(const @T@ *restrict x, const @T@ *restrict P, int k, int m, @T@ *restrict out) {
    int j = 0;
    for (; j + 4 <= m; j += 4) {
        const @T@ *restrict p0 = P + (long)j * k, *restrict p1 = p0 + k, *restrict p2 = p1 + k, *restrict p3 = p2 + k;
        @T@ a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        for (int i = 0; i < k; i++) { a0 += x[i] * p0[i]; a1 += x[i] * p1[i]; a2 += x[i] * p2[i]; a3 += x[i] * p3[i]; }
        out[j] = a0; out[j + 1] = a1; out[j + 2] = a2; out[j + 3] = a3;
    }
    for (; j < m; j++) {
        const @T@ *restrict p = P + (long)j * k;
        @T@ acc = 0;
        for (int i = 0; i < k; i++) acc += x[i] * p[i];
        out[j] = acc;
    }
}

/* HC connector, forward, per token t (streams H_t [n][d]; m = n + 2 coefficient columns):
     inv_s = 1/sqrt(mean H_s^2 + eps), raw[s][j] = H_s . P_j, tt = tanh(raw * inv), coef = S + scale * tt
     out[0] = sum_s coef[s][0] H_s (branch input u), out[1 + o] = sum_s coef[s][1 + o] H_s (R H), depth[s] = coef[s][n + 1]
   raw, inv and tt are kept for the backward. */
void hc_connect_forward_@S@(const @T@ *restrict H, const @T@ *restrict Pt, const @T@ *restrict S,
                            const @T@ *restrict scale, long N, int n, int d, @T@ eps,
                            @T@ *restrict out, @T@ *restrict depth, @T@ *restrict raw, @T@ *restrict inv,
                            @T@ *restrict tt, int threads) {
    int m = n + 2, q = n + 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < N; t++) {
        @T@ a[NMAX * MMAX], coef[NMAX * MMAX];
        const @T@ *restrict Ht = H + t * n * d;
        @T@ *restrict rawt = raw + t * n * m, *restrict tt_t = tt + t * n * m;
        for (int s = 0; s < n; s++) {
            const @T@ *restrict h = Ht + s * d;
            @T@ ss = 0;
            for (int i = 0; i < d; i++) ss += h[i] * h[i];
            @T@ iv = 1 / @SQRT@(ss / d + eps);
            inv[t * n + s] = iv;
            dots_@S@(h, Pt, d, m, rawt + s * m);
            for (int j = 0; j < m; j++) a[s * m + j] = rawt[s * m + j] * iv;
        }
        for (int k = 0; k < n * m; k++) tt_t[k] = tanh_@S@(a[k]);
        for (int s = 0; s < n; s++)
            for (int j = 0; j < m; j++) coef[s * m + j] = S[s * m + j] + scale[j] * tt_t[s * m + j];
        for (int s = 0; s < n; s++) depth[t * n + s] = coef[s * m + n + 1];
        for (int r = 0; r < q; r++) {
            @T@ *restrict o = out + (t * q + r) * d;
            @T@ c = coef[r];
            for (int i = 0; i < d; i++) o[i] = c * Ht[i];
            for (int s = 1; s < n; s++) {
                const @T@ *restrict h = Ht + s * d;
                c = coef[s * m + r];
                for (int i = 0; i < d; i++) o[i] += c * h[i];
            }
        }
    }
}

/* Its backward, from g_out [N][n+1][d] and g_depth [N][n]:
     gc[s][r] = g_out[r] . H_s (r <= n), gc[s][n+1] = g_depth[s];  gH_s = sum_r coef[s][r] g_out[r]
     ga = gc * scale * (1 - tt^2), graw = ga * inv_s, ginv_s = sum_j ga[s][j] raw[s][j]
     gH_s += sum_j graw[s][j] P_j - ginv_s inv_s^3 / d H_s
   and the parameter gradients summed over tokens: gPt[j] = sum graw[s][j] H_s, gS = sum gc,
   gscale[j] = sum_s gc[s][j] tt[s][j] -- per chunk of tokens (in double; gPt from float partials of
   FLUSH tokens), then over the chunks in order, so the result does not depend on the thread count. */
int hc_connect_backward_@S@(const @T@ *restrict H, const @T@ *restrict Pt, const @T@ *restrict S,
                            const @T@ *restrict scale, const @T@ *restrict raw, const @T@ *restrict inv,
                            const @T@ *restrict tt, const @T@ *restrict g_out, const @T@ *restrict g_depth,
                            long N, int n, int d, @T@ *restrict gH, @T@ *restrict gPt, @T@ *restrict gS,
                            @T@ *restrict gscale, int threads) {
    int m = n + 2, q = n + 1;
    long nw = (long)m * d + n * m + m, ch = chunk_tokens(N), nch = (N + ch - 1) / ch;
    double *part = (double *)calloc(nch * nw, sizeof(double));  /* per chunk: gPt, gS, gscale */
    @T@ *gPfs = (@T@ *)calloc((long)threads * m * d, sizeof(@T@));  /* per thread: float partials of gPt */
    if (!part || !gPfs) { free(part); free(gPfs); return 1; }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < nch; c++) {
        @T@ coef[NMAX * MMAX], graw[NMAX * MMAX];
        @T@ *restrict gPf = gPfs + (long)THREAD_ID * m * d;
        double *restrict gPd = part + c * nw, *restrict gSd = gPd + (long)m * d, *restrict gscd = gSd + n * m;
        long t_end = (c + 1) * ch < N ? (c + 1) * ch : N;
        for (long t = c * ch; t < t_end; t++) {
            const @T@ *restrict Ht = H + t * n * d;
            const @T@ *restrict gt = g_out + t * q * d;
            const @T@ *restrict rawt = raw + t * n * m, *restrict tt_t = tt + t * n * m;
            for (int k = 0; k < n * m; k++) coef[k] = S[k] + scale[k % m] * tt_t[k];
            for (int s = 0; s < n; s++) {
                const @T@ *restrict h = Ht + s * d;
                @T@ *restrict gh = gH + (t * n + s) * d;
                @T@ iv = inv[t * n + s];
                @T@ gi = 0;
                for (int j = 0; j < m; j++) {
                    @T@ gc;
                    if (j < q) {
                        const @T@ *restrict gj = gt + j * d;
                        gc = 0;
                        for (int i = 0; i < d; i++) gc += gj[i] * h[i];
                    } else {
                        gc = g_depth[t * n + s];
                    }
                    @T@ tj = tt_t[s * m + j];
                    gSd[s * m + j] += gc;
                    gscd[j] += (double)gc * tj;
                    @T@ ga = gc * scale[j] * (1 - tj * tj);
                    graw[s * m + j] = ga * iv;
                    gi += ga * rawt[s * m + j];
                }

                @T@ c = coef[s * m];
                for (int i = 0; i < d; i++) gh[i] = c * gt[i];
                for (int r = 1; r < q; r++) {
                    const @T@ *restrict gr = gt + r * d;
                    c = coef[s * m + r];
                    for (int i = 0; i < d; i++) gh[i] += c * gr[i];
                }
                @T@ k_inv = -gi * iv * iv * iv / d;
                for (int i = 0; i < d; i++) gh[i] += k_inv * h[i];
                for (int j = 0; j < m; j++) {
                    @T@ g = graw[s * m + j];
                    const @T@ *restrict p = Pt + (long)j * d;
                    @T@ *restrict gp = gPf + (long)j * d;
                    for (int i = 0; i < d; i++) { gh[i] += g * p[i]; gp[i] += g * h[i]; }
                }
            }
            if ((t + 1 - c * ch) % FLUSH == 0 || t == t_end - 1)
                for (long i = 0; i < (long)m * d; i++) { gPd[i] += gPf[i]; gPf[i] = 0; }
        }
    }
    for (long c = 1; c < nch; c++)
        for (long i = 0; i < nw; i++) part[i] += part[c * nw + i];
    double *restrict gPd = part, *restrict gSd = part + (long)m * d, *restrict gscd = gSd + n * m;
    for (long i = 0; i < (long)m * d; i++) gPt[i] = (@T@)gPd[i];
    for (int k = 0; k < n * m; k++) gS[k] = (@T@)gSd[k];
    for (int j = 0; j < m; j++) gscale[j] = (@T@)gscd[j];
    free(part); free(gPfs);
    return 0;
}
"""
# mHC's connector: the same single pass, in blocks of BLK tokens so the sigmoids and the Sinkhorn
# (the Sinkhorn library's block routines, compiled again here) run tokens-last and vectorised.
_MHC_TEMPLATE = r"""
/* mHC connector, forward, in blocks of BLK tokens (x_t = vec H_t, K = n*d; J = 2n + n*n coefficient columns;
   Phi transposed PhiT [J][K]; gates = (g_pre, g_post, g_res)):
     inv = 1/sqrt(mean x^2 + eps), a_j = (x . Phi_j) inv
     H_pre = sigmoid(g_pre a_pre + b_pre), H_post = 2 sigmoid(g_post a_post + b_post),
     H_res = Sinkhorn(g_res a_res + b_res) (fwd_block: softmax over `first`, 2 t_max - 1 half-steps; entry o*n + i)
     out[0] = sum_s H_pre[s] H_s, out[1 + o] = sum_i H_res[o][i] H_i, depth = H_post.
   raw = x . Phi_j and inv are kept for the backward, which recomputes the rest. 1 = out of memory. */
int mhc_connect_forward_@S@(const @T@ *restrict H, const @T@ *restrict PhiT, const @T@ *restrict gates,
                            const @T@ *restrict b_pre, const @T@ *restrict b_post, const @T@ *restrict b_res,
                            long N, int n, int d, @T@ eps, int t_max, int first, @T@ tiny,
                            @T@ *restrict out, @T@ *restrict depth, @T@ *restrict raw, @T@ *restrict inv,
                            int threads) {
    int K = n * d, J = 2 * n + n * n, nn = n * n, q = n + 1;
    long per_thread = (long)(J + nn) * BLK, nblk = (N + BLK - 1) / BLK;
    @T@ *bufs = (@T@ *)malloc(sizeof(@T@) * per_thread * threads);
    if (!bufs) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long blk = 0; blk < nblk; blk++) {
        @T@ *restrict a = bufs + (long)THREAD_ID * per_thread, *restrict m = a + (long)J * BLK;
        long t0 = blk * BLK;
        long cnt = N - t0 < BLK ? N - t0 : BLK;
        for (long b = 0; b < cnt; b++) {
            const @T@ *restrict x = H + (t0 + b) * K;
            @T@ ss = 0;
            for (int i = 0; i < K; i++) ss += x[i] * x[i];
            @T@ iv = 1 / @SQRT@(ss / K + eps);
            inv[t0 + b] = iv;
            @T@ *restrict rt = raw + (t0 + b) * J;
            dots_@S@(x, PhiT, K, J, rt);
            for (int j = 0; j < J; j++) a[j * BLK + b] = rt[j] * iv;
        }
        for (int j = 0; j < J; j++) for (long b = cnt; b < BLK; b++) a[j * BLK + b] = 0;
        for (int k = 0; k < nn; k++)
            for (int b = 0; b < BLK; b++) m[k * BLK + b] = gates[2] * a[(2 * n + k) * BLK + b] + b_res[k];
        fwd_block_@S@(m, 0, 0, 0, n, t_max, first, tiny);
        for (long b = 0; b < cnt; b++) {
            long t = t0 + b;
            const @T@ *restrict Ht = H + t * K;
            @T@ pre[NMAX];
            for (int s = 0; s < n; s++) {
                pre[s] = 1 / (1 + @EXP@(-(gates[0] * a[s * BLK + b] + b_pre[s])));
                depth[t * n + s] = 2 / (1 + @EXP@(-(gates[1] * a[(n + s) * BLK + b] + b_post[s])));
            }
            for (int r = 0; r < q; r++) {
                @T@ *restrict o = out + (t * q + r) * d;
                for (int i = 0; i < d; i++) o[i] = 0;
                for (int s = 0; s < n; s++) {
                    @T@ c = r == 0 ? pre[s] : m[((r - 1) * n + s) * BLK + b];
                    const @T@ *restrict h = Ht + s * d;
                    for (int i = 0; i < d; i++) o[i] += c * h[i];
                }
            }
        }
    }
    free(bufs);
    return 0;
}

/* One block of mHC's backward (tokens t0 .. t0 + cnt - 1, cnt <= BLK): gH for its tokens, float partial
   sums of gPhiT into gPf, double sums of the gate and bias gradients into gg, gb (see below). A function
   of its own so every buffer is a restrict parameter (the vectoriser then knows they do not overlap). */
static void mhc_backward_block_@S@(const @T@ *restrict H, const @T@ *restrict PhiT, const @T@ *restrict gates,
                                   const @T@ *restrict b_pre, const @T@ *restrict b_post, const @T@ *restrict b_res,
                                   const @T@ *restrict raw, const @T@ *restrict inv, const @T@ *restrict g_out,
                                   const @T@ *restrict g_depth, long t0, long cnt, int n, int d, int t_max,
                                   int first, @T@ tiny, @T@ *restrict a, @T@ *restrict m, @T@ *restrict p,
                                   @T@ *restrict gm, @T@ *restrict pre, @T@ *restrict post, @T@ *restrict gpre,
                                   @T@ *restrict gpost, @T@ *restrict ys, @T@ *restrict ssv, @T@ *restrict gH,
                                   @T@ *restrict gPf, double *restrict gg, double *restrict gb) {
    int K = n * d, J = 2 * n + n * n, nn = n * n, q = n + 1, steps = 2 * t_max - 1;
    for (int j = 0; j < J; j++) {
        for (long b = 0; b < cnt; b++) a[j * BLK + b] = raw[(t0 + b) * J + j] * inv[t0 + b];
        for (long b = cnt; b < BLK; b++) a[j * BLK + b] = 0;
    }
    for (int s = 0; s < n; s++)
        for (int b = 0; b < BLK; b++) {
            pre[s * BLK + b] = 1 / (1 + @EXP@(-(gates[0] * a[s * BLK + b] + b_pre[s])));
            post[s * BLK + b] = 2 / (1 + @EXP@(-(gates[1] * a[(n + s) * BLK + b] + b_post[s])));
        }
    for (int k = 0; k < nn; k++)
        for (int b = 0; b < BLK; b++) m[k * BLK + b] = gates[2] * a[(2 * n + k) * BLK + b] + b_res[k];
    fwd_block_@S@(m, p, ys, ssv, n, t_max, first, tiny);
    for (int k = 0; k < nn * BLK; k++) gm[k] = 0;
    for (int k = 0; k < n * BLK; k++) gpre[k] = gpost[k] = 0;
    for (long b = 0; b < cnt; b++) {
        long t = t0 + b;
        const @T@ *restrict Ht = H + t * K;
        const @T@ *restrict gt = g_out + t * q * d;
        for (int s = 0; s < n; s++) {
            const @T@ *restrict h = Ht + s * d;
            @T@ *restrict gh = gH + t * K + s * d;
            for (int r = 0; r < q; r++) {
                const @T@ *restrict gr = gt + r * d;
                @T@ c = r == 0 ? pre[s * BLK + b] : m[((r - 1) * n + s) * BLK + b], dot = 0;
                if (r == 0) for (int i = 0; i < d; i++) { gh[i] = c * gr[i]; dot += gr[i] * h[i]; }
                else for (int i = 0; i < d; i++) { gh[i] += c * gr[i]; dot += gr[i] * h[i]; }
                if (r == 0) gpre[s * BLK + b] = dot; else gm[((r - 1) * n + s) * BLK + b] = dot;
            }
            gpost[s * BLK + b] = g_depth[t * n + s];
        }
    }
    for (int step = steps - 1; step >= 0; step--) {  /* Sinkhorn backward: gm <- d loss / d logits */
        int dim = (first + 1 + step) % 2;
        for (int gr = 0; gr < n; gr++)
            back_group_@S@(gm, ys + (long)step * nn * BLK, ssv + ((long)step * n + gr) * BLK, n, dim, gr);
    }
    for (int gr = 0; gr < n; gr++) back_group_@S@(gm, p, 0, n, first, gr);
    /* dz into a's place as da = dz * gate, with the gate and bias sums */
    for (int s = 0; s < n; s++) {
        double sg0 = 0, sb0 = 0, sg1 = 0, sb1 = 0;
        for (long b = 0; b < cnt; b++) {
            @T@ hp = pre[s * BLK + b], hq = post[s * BLK + b];
            @T@ dz0 = gpre[s * BLK + b] * hp * (1 - hp), dz1 = gpost[s * BLK + b] * hq * (1 - hq * (@T@)0.5);
            sg0 += (double)dz0 * a[s * BLK + b]; sb0 += dz0;
            sg1 += (double)dz1 * a[(n + s) * BLK + b]; sb1 += dz1;
            a[s * BLK + b] = dz0 * gates[0];
            a[(n + s) * BLK + b] = dz1 * gates[1];
        }
        gg[0] += sg0; gb[s] += sb0; gg[1] += sg1; gb[n + s] += sb1;
    }
    for (int k = 0; k < nn; k++) {
        double sg = 0, sb = 0;
        for (long b = 0; b < cnt; b++) {
            @T@ dz = gm[k * BLK + b];
            sg += (double)dz * a[(2 * n + k) * BLK + b]; sb += dz;
            a[(2 * n + k) * BLK + b] = dz * gates[2];
        }
        gg[2] += sg; gb[2 * n + k] += sb;
    }
    for (long b = 0; b < cnt; b++) {
        long t = t0 + b;
        const @T@ *restrict x = H + t * K;
        @T@ *restrict gx = gH + t * K;
        @T@ iv = inv[t], gi = 0;
        for (int j = 0; j < J; j++) gi += a[j * BLK + b] * raw[t * J + j];
        @T@ coef = -gi * iv * iv * iv / K;
        for (int i = 0; i < K; i++) gx[i] += coef * x[i];
        for (int j = 0; j < J; j++) {
            @T@ g = a[j * BLK + b] * iv;
            const @T@ *restrict ph = PhiT + (long)j * K;
            @T@ *restrict gp = gPf + (long)j * K;
            for (int i = 0; i < K; i++) { gx[i] += g * ph[i]; gp[i] += g * x[i]; }
        }
    }
}

/* Its backward from g_out [N][n+1][d] and g_depth [N][n]: per block, the forward's coefficients are
   recomputed (the Sinkhorn with its iterates), then
     g_pre[s] = g_out[0] . H_s, g_res[o][i] = g_out[1 + o] . H_i, gH_s = H_pre[s] g_out[0] + sum_o H_res[o][s] g_out[1 + o]
     dz_pre = g_pre H_pre (1 - H_pre), dz_post = g_depth H_post (1 - H_post / 2), dz_res = Sinkhorn backward of g_res
     da = dz * gate, g_raw = da inv, g_inv = sum_j da_j raw_j, gx += sum_j g_raw_j Phi_j - g_inv inv^3 / K x
   and, summed over tokens in double per chunk of blocks, then over the chunks in order (independent of
   the thread count): gPhiT_j = sum g_raw_j x, g_gates = sum dz . a per section, g_b = sum dz. */
int mhc_connect_backward_@S@(const @T@ *restrict H, const @T@ *restrict PhiT, const @T@ *restrict gates,
                             const @T@ *restrict b_pre, const @T@ *restrict b_post, const @T@ *restrict b_res,
                             const @T@ *restrict raw, const @T@ *restrict inv, const @T@ *restrict g_out,
                             const @T@ *restrict g_depth, long N, int n, int d, int t_max, int first, @T@ tiny,
                             @T@ *restrict gH, @T@ *restrict gPhiT, @T@ *restrict g_gates, @T@ *restrict g_b_pre,
                             @T@ *restrict g_b_post, @T@ *restrict g_b_res, int threads) {
    int K = n * d, J = 2 * n + n * n, nn = n * n, steps = 2 * t_max - 1;
    long per_thread = (long)(J + 3 * nn + 4 * n) * BLK + (long)steps * (nn + n) * BLK;
    long nw = (long)J * K + 3 + J, ch = chunk_tokens(N), nch = (N + ch - 1) / ch;
    @T@ *bufs = (@T@ *)malloc(sizeof(@T@) * per_thread * threads);
    @T@ *gPfs = (@T@ *)malloc(sizeof(@T@) * (long)J * K * threads);  /* per thread: float partials of gPhiT */
    double *part = (double *)calloc(nch * nw, sizeof(double));  /* per chunk: gPhiT, g_gates, g_b */
    if (!bufs || !gPfs || !part) { free(bufs); free(gPfs); free(part); return 1; }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < nch; c++) {
        @T@ *restrict a = bufs + (long)THREAD_ID * per_thread, *restrict m = a + (long)J * BLK;
        @T@ *restrict p = m + (long)nn * BLK, *restrict gm = p + (long)nn * BLK;
        @T@ *restrict pre = gm + (long)nn * BLK, *restrict post = pre + (long)n * BLK;
        @T@ *restrict gpre = post + (long)n * BLK, *restrict gpost = gpre + (long)n * BLK;
        @T@ *restrict ys = gpost + (long)n * BLK, *restrict ssv = ys + (long)steps * nn * BLK;
        @T@ *restrict gPf = gPfs + (long)THREAD_ID * J * K;
        double *restrict gPd = part + c * nw, *restrict gg = gPd + (long)J * K, *restrict gb = gg + 3;
        long c_end = (c + 1) * ch < N ? (c + 1) * ch : N;
        for (long i = 0; i < (long)J * K; i++) gPf[i] = 0;
        for (long t0 = c * ch; t0 < c_end; t0 += BLK) {
            long cnt = c_end - t0 < BLK ? c_end - t0 : BLK;
            mhc_backward_block_@S@(H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth, t0, cnt, n, d,
                                   t_max, first, tiny, a, m, p, gm, pre, post, gpre, gpost, ys, ssv, gH, gPf, gg, gb);
            for (long i = 0; i < (long)J * K; i++) { gPd[i] += gPf[i]; gPf[i] = 0; }
        }
    }
    for (long c = 1; c < nch; c++)
        for (long i = 0; i < nw; i++) part[i] += part[c * nw + i];
    double *restrict gPd = part, *restrict gg = part + (long)J * K, *restrict gb = gg + 3;
    for (long i = 0; i < (long)J * K; i++) gPhiT[i] = (@T@)gPd[i];
    for (int i = 0; i < 3; i++) g_gates[i] = (@T@)gg[i];
    for (int s = 0; s < n; s++) { g_b_pre[s] = (@T@)gb[s]; g_b_post[s] = (@T@)gb[n + s]; }
    for (int k = 0; k < nn; k++) g_b_res[k] = (@T@)gb[2 * n + k];
    free(bufs); free(gPfs); free(part);
    return 0;
}
"""
_CONNECTOR_SOURCE = _CONNECTOR_HEAD + "#define BLK 64\n" + "".join(
    (_TEMPLATE + _CONNECTOR_TEMPLATE + _MHC_TEMPLATE).replace("@T@", t).replace("@S@", s).replace("@SQRT@", q)
    .replace("@EXP@", e)
    for t, s, q, e in (("float", "f32", "sqrtf", "exp_f32"), ("double", "f64", "sqrt", "exp")))
_CONNECTOR_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fassociative-math",
                    "-fno-signed-zeros", "-fno-trapping-math", "-shared", "-fPIC"]
CONNECTOR_MAX_STREAMS = 16  # NMAX in the C source: the kernels' per-token arrays


# AttnRes' depth bank (bankops.DepthBank; issue 20, third library; figures in RESULTS.md, "Fourth pass"). A mix at
# sublayer l reads all l earlier sources: O(L²) passes over [N,d] sources per step, which with torch ops were
# several kernels per mix (logits, softmax or logsumexp, exp, a weighted-sum loop of addcmul_, each a pass)
# and, in backward, batched matmuls of tiny per-token matrices plus their temporaries. These kernels work on
# tiles of BT tokens: a mix reads its logits (the stored key dots times 1/rms), takes the softmax and forms
# the weighted sum with each source tile read once; a flush adds pending mixes' contributions to a range of
# sources' gradients (dL/dv, dL/d dots, dL/d inv_rms) with each source tile and gradient tile read once.
# Tokens are independent: tiles are split over torch's intra-op threads, results do not depend on the count.
_BANK_TEMPLATE = r"""
/* y += a x and x . y over rows of d, in fixed chunks of 16 (whole vectors; no alias checks or loop set-up
   per call in the inner loops below), then the rest */
static inline void axpy_@S@(@T@ *restrict y, @T@ a, const @T@ *restrict x, int d) {
    int c = 0;
    for (; c + 16 <= d; c += 16) for (int e = 0; e < 16; e++) y[c + e] += a * x[c + e];
    for (; c < d; c++) y[c] += a * x[c];
}
/* y += a0 x0 + a1 x1 + a2 x2 + a3 x3: one read-modify-write of y for four rows */
static inline void axpy4_@S@(@T@ *restrict y, const @T@ *a, const @T@ *restrict x0, const @T@ *restrict x1,
                             const @T@ *restrict x2, const @T@ *restrict x3, int d) {
    int c = 0;
    for (; c + 16 <= d; c += 16)
        for (int e = 0; e < 16; e++) y[c + e] += (a[0] * x0[c + e] + a[1] * x1[c + e]) + (a[2] * x2[c + e] + a[3] * x3[c + e]);
    for (; c < d; c++) y[c] += (a[0] * x0[c] + a[1] * x1[c]) + (a[2] * x2[c] + a[3] * x3[c]);
}
static inline @T@ dot_@S@(const @T@ *restrict x, const @T@ *restrict y, int d) {
    @T@ acc[16] = {0};
    int c = 0;
    for (; c + 16 <= d; c += 16) for (int e = 0; e < 16; e++) acc[e] += x[c + e] * y[c + e];
    @T@ s = 0;
    for (int e = 0; e < 16; e++) s += acc[e];
    for (; c < d; c++) s += x[c] * y[c];
    return s;
}
/* h [N,d] and alpha [n(+1), N] of one mix over sources 0..n-1 of values [cap,N,d] (slot-major), logits
   dots[i, col, t] * inv_rms[i, t] (dots [cap,M,N]), plus an optional partial source pf [N,d] with logit
   plogit [N] (alpha's last row). Two-phase (P != NULL): the sources below n0 enter as P [N, p_stride] rows,
   their softmax numerator sum taken at the max mu [N] of their logits: h = exp(mu - max)/sum * P + ... */
int bank_mix_forward_@S@(const @T@ *restrict values, const @T@ *restrict inv_rms, const @T@ *restrict dots,
                         long N, int d, int M, int n, int col, const @T@ *restrict plogit,
                         const @T@ *restrict pf, int n0, const @T@ *restrict mu, const @T@ *restrict P,
                         long p_stride, @T@ *restrict h, @T@ *restrict alpha, int threads) {
    int na = n + (pf != 0), failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        /* each thread a contiguous token range: the softmax runs row by row over it (long sequential
           reads of the dots, 1/rms and alpha rows), the weighted sum in tiles of BT tokens */
        long per = ((N + NUM_THREADS - 1) / NUM_THREADS + 15) / 16 * 16;
        long ta = THREAD_ID * per, tb = ta + per < N ? ta + per : N, len = tb - ta;
        @T@ *mx = len > 0 ? malloc(sizeof(@T@) * 2 * len) : 0;
        if (len > 0 && !mx) {
            #pragma omp atomic write
            failed = 1;
        }
        if (mx) {
            @T@ *s = mx + len;
            for (long t = 0; t < len; t++) { mx[t] = -INFINITY; s[t] = 0; }
            for (int i = 0; i < na; i++) {
                @T@ *restrict ar = alpha + (long)i * N + ta;
                if (i < n) {
                    const @T@ *restrict dr = dots + ((long)i * M + col) * N + ta;
                    const @T@ *restrict rr = inv_rms + (long)i * N + ta;
                    for (long t = 0; t < len; t++) { @T@ l = dr[t] * rr[t]; ar[t] = l; mx[t] = l > mx[t] ? l : mx[t]; }
                } else {
                    for (long t = 0; t < len; t++) { @T@ l = plogit[ta + t]; ar[t] = l; mx[t] = l > mx[t] ? l : mx[t]; }
                }
            }
            for (int i = 0; i < na; i++) {
                @T@ *restrict ar = alpha + (long)i * N + ta;
                for (long t = 0; t < len; t++) { @T@ e = @EXP@(ar[t] - mx[t]); ar[t] = e; s[t] += e; }
            }
            for (long t = 0; t < len; t++) s[t] = 1 / s[t];
            for (int i = 0; i < na; i++) {
                @T@ *restrict ar = alpha + (long)i * N + ta;
                for (long t = 0; t < len; t++) ar[t] *= s[t];
            }
            for (long t0 = ta; t0 < tb; t0 += BT) {
                int cnt = tb - t0 < BT ? (int)(tb - t0) : BT;
                @T@ *restrict ht = h + t0 * d;
                if (P) {
                    for (int b = 0; b < cnt; b++) {
                        long t = t0 + b;
                        @T@ c = @EXP@(mu[t] - mx[t - ta]) * s[t - ta];
                        const @T@ *restrict pr = P + t * p_stride;
                        for (int k = 0; k < d; k++) ht[b * d + k] = c * pr[k];
                    }
                } else {
                    memset(ht, 0, sizeof(@T@) * cnt * d);
                }
                int i = n0;
                for (; i + 4 <= n; i += 4) {  /* four sources per read-modify-write of h */
                    const @T@ *restrict vr = values + ((long)i * N + t0) * d;
                    const @T@ *restrict ar = alpha + (long)i * N + t0;
                    for (int b = 0; b < cnt; b++) {
                        @T@ a[4] = {ar[b], ar[N + b], ar[2 * N + b], ar[3 * N + b]};
                        long o = (long)b * d;
                        axpy4_@S@(ht + o, a, vr + o, vr + N * d + o, vr + 2 * N * d + o, vr + 3 * N * d + o, d);
                    }
                }
                for (; i < na; i++) {
                    const @T@ *restrict vr = i < n ? values + ((long)i * N + t0) * d : pf + t0 * d;
                    const @T@ *restrict ar = alpha + (long)i * N + t0;
                    for (int b = 0; b < cnt; b++) axpy_@S@(ht + b * d, ar[b], vr + b * d, d);
                }
            }
            free(mx);
        }
    }
    return failed;
}

/* The two-phase prefix of a group of G mixers (columns cols) over sources 0..n0-1: mu [G,N] = the max over i
   of logit_gi = dots[i, col_g] * inv_rms[i], P [N,G,d] = sum_i exp(logit_gi - mu_g) v_i. Tiles of PT tokens:
   the weights of the whole tile first, then token by token (its G rows of P stay in L1) the sources, four per
   read-modify-write of P (the tile's sources, weights and P fit in L2). 1 on failure. */
#define PT 64
int bank_prefix_@S@(const @T@ *restrict values, const @T@ *restrict inv_rms, const @T@ *restrict dots,
                    long N, int d, int M, int n0, int G, const long *cols, @T@ *restrict mu, @T@ *restrict P,
                    int threads) {
    long tiles = (N + PT - 1) / PT;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        @T@ *w = malloc(sizeof(@T@) * (long)n0 * G * PT);  /* [i][g][b] */
        if (!w) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long tile = 0; tile < tiles; tile++) {
            if (!w) continue;
            long t0 = tile * PT;
            int cnt = N - t0 < PT ? (int)(N - t0) : PT;
            for (int g = 0; g < G; g++) {
                @T@ *restrict mg = mu + (long)g * N + t0;
                for (int b = 0; b < cnt; b++) mg[b] = -INFINITY;
                for (int i = 0; i < n0; i++) {
                    const @T@ *restrict dr = dots + ((long)i * M + cols[g]) * N + t0;
                    const @T@ *restrict rr = inv_rms + (long)i * N + t0;
                    for (int b = 0; b < cnt; b++) { @T@ l = dr[b] * rr[b]; mg[b] = l > mg[b] ? l : mg[b]; }
                }
            }
            for (int i = 0; i < n0; i++) {
                const @T@ *restrict rr = inv_rms + (long)i * N + t0;
                for (int g = 0; g < G; g++) {
                    const @T@ *restrict dr = dots + ((long)i * M + cols[g]) * N + t0;
                    const @T@ *restrict mg = mu + (long)g * N + t0;
                    @T@ *restrict wr = w + ((long)i * G + g) * PT;
                    for (int b = 0; b < cnt; b++) wr[b] = @EXP@(dr[b] * rr[b] - mg[b]);
                }
            }
            for (int b = 0; b < cnt; b++) {
                @T@ *restrict pt = P + (t0 + b) * G * d;
                const @T@ *restrict vb = values + (t0 + b) * d;  /* source i's row: vb + i N d */
                memset(pt, 0, sizeof(@T@) * G * d);
                int i = 0;
                for (; i + 4 <= n0; i += 4) {
                    const @T@ *restrict wi = w + (long)i * G * PT + b;
                    for (int g = 0; g < G; g++) {
                        @T@ a[4] = {wi[g * PT], wi[(G + g) * PT], wi[(2 * G + g) * PT], wi[(3 * G + g) * PT]};
                        axpy4_@S@(pt + g * d, a, vb + i * N * d, vb + (i + 1) * N * d, vb + (i + 2) * N * d,
                                  vb + (i + 3) * N * d, d);
                    }
                }
                for (; i < n0; i++)
                    for (int g = 0; g < G; g++) axpy_@S@(pt + g * d, w[((long)i * G + g) * PT + b], vb + i * N * d, d);
            }
        }
        free(w);
    }
    return failed;
}

/* Add K recorded mixes' contributions to sources lo..hi-1: mix k (output gradient grads[k] [N,d], rho[k] [N]
   = g . h, weights alpha[k] [n_k, N], column cols[k]) gives dalpha = g . v_i, dlogit = alpha (dalpha - rho),
   gv[i] += alpha g, gdots[i, col] += dlogit * inv_rms[i], ginv[i] += dlogit * dots[i, col]; mixes in order. */
int bank_flush_@S@(const @T@ *restrict values, const @T@ *restrict inv_rms, const @T@ *restrict dots,
                   long N, int d, int M, int lo, int hi, int K, const long *grads, const long *weights,
                   const long *rhos, const long *cols, @T@ *restrict gv, @T@ *restrict gdots,
                   @T@ *restrict ginv, int threads) {
    long tiles = (N + BT - 1) / BT;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long tile = 0; tile < tiles; tile++) {
        long t0 = tile * BT;
        int cnt = N - t0 < BT ? (int)(N - t0) : BT;
        for (int i = lo; i < hi; i++) {
            const @T@ *restrict vr = values + ((long)i * N + t0) * d;
            @T@ *restrict gvr = gv + ((long)i * N + t0) * d;
            for (int b = 0; b < cnt; b++) {
                long t = t0 + b, it = (long)i * N + t;
                const @T@ *restrict v = vr + b * d;
                @T@ *restrict gvt = gvr + b * d;
                @T@ r = inv_rms[it], gi = 0;
                int k = 0;
                for (; k + 4 <= K; k += 4) {  /* four mixes per pass over v and gv: independent sums */
                    const @T@ *restrict g0 = (const @T@ *)grads[k] + t * d, *restrict g1 = (const @T@ *)grads[k + 1] + t * d;
                    const @T@ *restrict g2 = (const @T@ *)grads[k + 2] + t * d, *restrict g3 = (const @T@ *)grads[k + 3] + t * d;
                    @T@ a[4], da[4] = {0, 0, 0, 0};
                    for (int q = 0; q < 4; q++) a[q] = ((const @T@ *)weights[k + q])[it];
                    for (int c = 0; c < d; c++) {
                        @T@ x = v[c];
                        da[0] += g0[c] * x; da[1] += g1[c] * x; da[2] += g2[c] * x; da[3] += g3[c] * x;
                    }
                    axpy4_@S@(gvt, a, g0, g1, g2, g3, d);
                    for (int q = 0; q < 4; q++) {
                        @T@ dl = a[q] * (da[q] - ((const @T@ *)rhos[k + q])[t]);
                        long o = ((long)i * M + cols[k + q]) * N + t;
                        gdots[o] += dl * r;
                        gi += dl * dots[o];
                    }
                }
                for (; k < K; k++) {
                    const @T@ *restrict g = (const @T@ *)grads[k] + t * d;
                    @T@ a = ((const @T@ *)weights[k])[it];
                    @T@ dl = a * (dot_@S@(g, v, d) - ((const @T@ *)rhos[k])[t]);
                    axpy_@S@(gvt, a, g, d);
                    long o = ((long)i * M + cols[k]) * N + t;
                    gdots[o] += dl * r;
                    gi += dl * dots[o];
                }
                ginv[it] += gi;
            }
        }
    }
    return 0;
}
"""
_BANK_SOURCE = _CONNECTOR_HEAD + "#define BT 128\n" + "".join(
    _BANK_TEMPLATE.replace("@T@", t).replace("@S@", s).replace("@EXP@", e)
    for t, s, e in (("float", "f32", "exp_f32"), ("double", "f64", "exp")))


# MoDA's depth attention (moda._DepthAttention; issue 20, fourth library; figures in RESULTS.md, "Fifth pass"). The
# depth part of block l reads the same-position K/V of its S = 2l earlier slots: with torch ops a loop of hd
# multiply-adds per score and S per output, each a pass over [S, Hkv, N] scores or [Hkv, hd, N] outputs, ~1,700
# small ops per forward; and a backward that added every reader's slot gradients into the buffers of all the
# slots it read (a read-modify-write of S slots per reader). These kernels read each slot's K and V rows once per
# tile of DT tokens (forward: scores, softmax joined with the sequence part's log-sum-exp, the weighted sum;
# backward: score gradients and the depth query's gradient) and form a slot's gradients once, when its writer's
# backward needs them, from the records its readers left (moda_slot_grads): O(readers) reads, one write.
_MODA_TEMPLATE = r"""
/* MoDA's depth part, T = @T@. Slots K, V are tokens last, [S][Hkv][hd][N] (slot stride Hkv*hd*N, N = B*T
   tokens); probs and score gradients ds are [S][Hkv][g][N]; qs and dzt (the records slot gradients are formed
   from) [Hkv][g][hd][N]. Per-head tensors are token rows as the model holds them ([B,T,H,hd], H = Hkv*g heads;
   query head hh = h*g + j reads kv head h): q, o, z, dz rows of H*hd at a token stride, log-sum-exps rows of
   H. Work: (kv head, tile of DT tokens) pairs split over the threads; a tile's per-head rows are transposed
   into per-thread tokens-last buffers (rows DTP apart: padded, so that rows 4 KB apart do not alias in L1),
   the vectorised loops run along tokens, and each slot's K and V rows are read once per tile in runs of DT
   tokens (long sequential runs keep the hardware prefetcher ahead; 64-token runs over S*hd rows 4 KB apart
   did not). invalid [S] (or NULL): masked slots get probability exactly 0. */

/* token rows -> tokens last: dst[i*DTP + b] = a * src[b*st + i] (b < cnt, i < hd), in blocks of 64 tokens
   whose source rows stay in L1 while each i writes a contiguous run */
static inline void to_tokens_last_@S@(@T@ *restrict dst, const @T@ *restrict src, long st, int hd, int cnt, @T@ a) {
    for (int b0 = 0; b0 < cnt; b0 += 64) {
        int e = cnt - b0 < 64 ? cnt : b0 + 64;
        for (int i = 0; i < hd; i++)
            for (int b = b0; b < e; b++) dst[i * DTP + b] = a * src[b * st + i];
    }
}

/* tokens last -> token rows: dst[b*st + i] = a * src[i*sp + b] (add_rows: dst[b*st + i] += src[i*sp + b]) */
static inline void to_rows_@S@(@T@ *restrict dst, long st, const @T@ *restrict src, int hd, int cnt, @T@ a, int sp) {
    for (int b = 0; b < cnt; b++)
        for (int i = 0; i < hd; i++) dst[b * st + i] = a * src[i * sp + b];
}
static inline void add_rows_@S@(@T@ *restrict dst, long st, const @T@ *restrict src, int hd, int cnt, int sp) {
    for (int b = 0; b < cnt; b++)
        for (int i = 0; i < hd; i++) dst[b * st + i] += src[i * sp + b];
}

/* work item w of (kv head, tile of `tile` tokens) pairs, `tiles` tiles per head: its head h, first token t0 and
   token count */
static inline int work_tile_@S@(long w, long tiles, int tile, long N, int *h, long *t0) {
    *h = (int)(w / tiles);
    *t0 = (w % tiles) * tile;
    return N - *t0 < tile ? (int)(N - *t0) : tile;
}

/* ask for the next slot's rows (hd rows of cnt values, N apart) into L2 while this slot's are computed */
static inline void prefetch_slot_@S@(const @KT@ *p, int hd, long N, int cnt) {
    for (int i = 0; i < hd; i++)
        for (int b = 0; b < cnt; b += 64 / (int)sizeof(@KT@)) __builtin_prefetch(p + i * N + b, 0, 2);
}

int moda_forward_@S@(const @KT@ *restrict K, const @KT@ *restrict V, const @T@ *restrict q, long qst, @T@ scale,
                     const @T@ *restrict o, long ost, const @T@ *restrict lse_seq, long lst,
                     const unsigned char *invalid, int S, int Hkv, int g, int hd, long N, @T@ *restrict z,
                     @T@ *restrict lse, @T@ *restrict probs, @T@ *restrict qs, int threads) {
    long tiles = (N + DT - 1) / DT, work = tiles * Hkv;
    long kstride = (long)Hkv * hd * N;
    int H = Hkv * g;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        long rows = (long)g * hd * DTP;
        @T@ *buf = malloc(sizeof(@T@) * (2 * rows + (long)g * S * DTP + 3L * g * DTP));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        @T@ *ql = buf, *zl = ql + rows, *sc = zl + rows, *m = sc + (long)g * S * DTP;
        @T@ *tot = m + (long)g * DTP, *ls = tot + (long)g * DTP;
        #pragma omp for schedule(static)
        for (long w = 0; w < work; w++) {
            if (!buf) continue;
            int h;
            long t0;
            int cnt = work_tile_@S@(w, tiles, DT, N, &h, &t0);
            for (int j = 0; j < g; j++) {
                int hh = h * g + j;
                @T@ *restrict qj = ql + (long)j * hd * DTP;
                to_tokens_last_@S@(qj, q + t0 * qst + (long)hh * hd, qst, hd, cnt, scale);
                for (int i = 0; i < hd; i++) memcpy(qs + ((long)hh * hd + i) * N + t0, qj + i * DTP, sizeof(@T@) * cnt);
                for (int b = 0; b < cnt; b++) m[j * DTP + b] = ls[j * DTP + b] = lse_seq[(t0 + b) * lst + hh];
            }
            for (int s = 0; s < S; s++) {
                if (invalid && invalid[s]) continue;
                const @KT@ *restrict Ks = K + s * kstride + (long)h * hd * N + t0;
                if (s + 1 < S) prefetch_slot_@S@(Ks + kstride, hd, N, cnt);
                for (int j = 0; j < g; j++) {
                    @T@ *restrict sr = sc + ((long)j * S + s) * DTP;
                    const @T@ *restrict qj = ql + (long)j * hd * DTP;
                    for (int b = 0; b < cnt; b++) sr[b] = 0;
                    for (int i = 0; i < hd; i++)
                        for (int b = 0; b < cnt; b++) sr[b] += ld_@S@(Ks[i * N + b]) * qj[i * DTP + b];
                    @T@ *restrict mj = m + j * DTP;
                    for (int b = 0; b < cnt; b++) mj[b] = sr[b] > mj[b] ? sr[b] : mj[b];
                }
            }
            for (int j = 0; j < g; j++) {
                int hh = h * g + j;
                @T@ *restrict mj = m + j * DTP, *restrict tj = tot + j * DTP, *restrict lj = ls + j * DTP;
                for (int b = 0; b < cnt; b++) tj[b] = @EXP@(lj[b] - mj[b]);
                for (int s = 0; s < S; s++) {
                    if (invalid && invalid[s]) continue;
                    @T@ *restrict sr = sc + ((long)j * S + s) * DTP;
                    for (int b = 0; b < cnt; b++) { @T@ e = @EXP@(sr[b] - mj[b]); sr[b] = e; tj[b] += e; }
                }
                for (int b = 0; b < cnt; b++) { lse[(t0 + b) * H + hh] = @LOG@(tj[b]) + mj[b]; tj[b] = 1 / tj[b]; }
                for (int s = 0; s < S; s++) {
                    @T@ *restrict pr = probs + ((long)(s * Hkv + h) * g + j) * N + t0;
                    @T@ *restrict sr = sc + ((long)j * S + s) * DTP;
                    if (invalid && invalid[s]) {
                        for (int b = 0; b < cnt; b++) sr[b] = 0;
                    } else {
                        for (int b = 0; b < cnt; b++) sr[b] *= tj[b];
                    }
                    memcpy(pr, sr, sizeof(@T@) * cnt);
                }
                /* the sequence part's output times its weight exp(lse_seq - lse) */
                @T@ *restrict zj = zl + (long)j * hd * DTP;
                to_tokens_last_@S@(zj, o + t0 * ost + (long)hh * hd, ost, hd, cnt, 1);
                for (int b = 0; b < cnt; b++) mj[b] = @EXP@(lj[b] - mj[b]) * tj[b];
                for (int i = 0; i < hd; i++)
                    for (int b = 0; b < cnt; b++) zj[i * DTP + b] *= mj[b];
            }
            for (int s = 0; s < S; s++) {
                if (invalid && invalid[s]) continue;
                const @KT@ *restrict Vs = V + s * kstride + (long)h * hd * N + t0;
                if (s + 1 < S) prefetch_slot_@S@(Vs + kstride, hd, N, cnt);
                for (int j = 0; j < g; j++) {
                    const @T@ *restrict p = sc + ((long)j * S + s) * DTP;
                    for (int i = 0; i < hd; i++) {
                        @T@ *restrict zi = zl + ((long)j * hd + i) * DTP;
                        for (int b = 0; b < cnt; b++) zi[b] += p[b] * ld_@S@(Vs[i * N + b]);
                    }
                }
            }
            for (int j = 0; j < g; j++)
                to_rows_@S@(z + t0 * H * hd + (long)(h * g + j) * hd, (long)H * hd, zl + (long)j * hd * DTP, hd, cnt, 1, DTP);
        }
        free(buf);
    }
    return failed;
}

/* Backward of moda_forward (the depth part): with dz the output gradient and r = sum_i dz z per query row, slot
   s's score gradient is ds = p (dz . V_s - r) [S][Hkv][g][N] (masked slots: 0), and dqd (rows of H*hd,
   contiguous) = scale * sum_s ds K_s, the gradient of the UNSCALED depth query; dzt = dz tokens last. Slot
   gradients are left to moda_slot_grads, which forms them from (ds, probs, qs, dzt) of all of a slot's readers
   at once. z, dz: rows of H*hd, contiguous. */
int moda_backward_@S@(const @KT@ *restrict K, const @KT@ *restrict V, const @T@ *restrict z, const @T@ *restrict dz,
                      const @T@ *restrict probs, const unsigned char *invalid, int S, int Hkv, int g, int hd, long N,
                      @T@ scale, @T@ *restrict dqd, @T@ *restrict ds, @T@ *restrict dzt, int threads) {
    long tiles = (N + DT - 1) / DT, work = tiles * Hkv;
    long kstride = (long)Hkv * hd * N;
    int H = Hkv * g;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        long rows = (long)g * hd * DTP;
        @T@ *buf = malloc(sizeof(@T@) * (2 * rows + 2L * g * DTP));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        @T@ *dzl = buf, *dql = dzl + rows, *r = dql + rows, *acc = r + (long)g * DTP;
        #pragma omp for schedule(static)
        for (long w = 0; w < work; w++) {
            if (!buf) continue;
            int h;
            long t0;
            int cnt = work_tile_@S@(w, tiles, DT, N, &h, &t0);
            for (int j = 0; j < g; j++) {
                long col = (long)(h * g + j) * hd;
                @T@ *restrict dj = dzl + (long)j * hd * DTP, *restrict rj = r + j * DTP;
                to_tokens_last_@S@(dj, dz + t0 * H * hd + col, (long)H * hd, hd, cnt, 1);
                for (int i = 0; i < hd; i++) memcpy(dzt + (col + i) * N + t0, dj + i * DTP, sizeof(@T@) * cnt);
                for (int b = 0; b < cnt; b++) {
                    const @T@ *restrict dr = dz + (t0 + b) * H * hd + col, *restrict zr = z + (t0 + b) * H * hd + col;
                    @T@ dot = 0;
                    for (int i = 0; i < hd; i++) dot += dr[i] * zr[i];
                    rj[b] = dot;
                }
            }
            memset(dql, 0, sizeof(@T@) * rows);
            for (int s = 0; s < S; s++) {
                long off = s * kstride + (long)h * hd * N + t0;
                const @KT@ *restrict Ks = K + off, *restrict Vs = V + off;
                if (s + 1 < S) {
                    prefetch_slot_@S@(Vs + kstride, hd, N, cnt);
                    prefetch_slot_@S@(Ks + kstride, hd, N, cnt);
                }
                for (int j = 0; j < g; j++) {
                    long prow = ((long)(s * Hkv + h) * g + j) * N + t0;
                    @T@ *restrict dsj = ds + prow;
                    if (invalid && invalid[s]) {
                        memset(dsj, 0, sizeof(@T@) * cnt);
                        continue;
                    }
                    const @T@ *restrict p = probs + prow;
                    const @T@ *restrict dj = dzl + (long)j * hd * DTP, *restrict rj = r + j * DTP;
                    for (int b = 0; b < cnt; b++) acc[b] = 0;
                    for (int i = 0; i < hd; i++)
                        for (int b = 0; b < cnt; b++) acc[b] += dj[i * DTP + b] * ld_@S@(Vs[i * N + b]);
                    for (int b = 0; b < cnt; b++) acc[b] = p[b] * (acc[b] - rj[b]);
                    memcpy(dsj, acc, sizeof(@T@) * cnt);
                    for (int i = 0; i < hd; i++) {
                        @T@ *restrict dq = dql + ((long)j * hd + i) * DTP;
                        for (int b = 0; b < cnt; b++) dq[b] += acc[b] * ld_@S@(Ks[i * N + b]);
                    }
                }
            }
            for (int j = 0; j < g; j++)
                to_rows_@S@(dqd + t0 * H * hd + (long)(h * g + j) * hd, (long)H * hd, dql + (long)j * hd * DTP, hd, cnt, scale, DTP);
        }
        free(buf);
    }
    return failed;
}

/* Gradients of slots start..stop-1 as token rows [stop-start][N][Hkv*hd] from R reader records k (moda_backward's
   ds and the forward's probs [S_k][Hkv][g][N], the scaled depth query qs and the output gradient dzt [Hkv][g][hd][N];
   S_k = slots the reader read): gK_s = sum_k sum_j ds_k[s,h,j] qs_k[h,j], gV_s = sum_k sum_j probs_k[s,h,j]
   dzt_k[h,j] (add: added to what gk, gv hold). A reader with S_k <= s did not read slot s. Readers are summed in
   the order given (results do not depend on the threads). */
int moda_slot_grads_@S@(int R, const long *ds, const long *probs, const long *qs, const long *dzt, const long *reads,
                        int start, int stop, int Hkv, int g, int hd, long N, @T@ *restrict gk, @T@ *restrict gv,
                        int add, int threads) {
    long tiles = (N + ST - 1) / ST, work = tiles * Hkv;
    int n = stop - start, C = Hkv * hd;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        @T@ *buf = n > 0 ? malloc(sizeof(@T@) * 2L * hd * STP) : 0;
        if (n > 0 && !buf) {
            #pragma omp atomic write
            failed = 1;
        }
        @T@ *ak = buf, *av = buf + (long)hd * STP;  /* one slot's [hd][ST] sums: L1 */
        #pragma omp for schedule(static)
        for (long w = 0; w < work; w++) {
            if (!buf) continue;
            int h;
            long t0;
            int cnt = work_tile_@S@(w, tiles, ST, N, &h, &t0);
            for (int s = start; s < stop; s++) {
                memset(buf, 0, sizeof(@T@) * 2L * hd * STP);
                for (int k = 0; k < R; k++) {  /* (the records' tile rows are read again for each slot) */
                    if (reads[k] <= s) continue;
                    for (int j = 0; j < g; j++) {
                        long row = (long)(h * g + j) * hd, prow = ((long)(s * Hkv + h) * g + j) * N + t0;
                        const @T@ *restrict qr = (const @T@ *)qs[k] + row * N + t0;
                        const @T@ *restrict dr = (const @T@ *)dzt[k] + row * N + t0;
                        const @T@ *restrict dsr = (const @T@ *)ds[k] + prow, *restrict pr = (const @T@ *)probs[k] + prow;
                        for (int i = 0; i < hd; i++) {
                            @T@ *restrict aki = ak + i * STP, *restrict avi = av + i * STP;
                            for (int b = 0; b < cnt; b++) {
                                aki[b] += dsr[b] * qr[i * N + b];
                                avi[b] += pr[b] * dr[i * N + b];
                            }
                        }
                    }
                }
                long o = ((long)(s - start) * N + t0) * C + (long)h * hd;
                if (add) {
                    add_rows_@S@(gk + o, C, ak, hd, cnt, STP);
                    add_rows_@S@(gv + o, C, av, hd, cnt, STP);
                } else {
                    to_rows_@S@(gk + o, C, ak, hd, cnt, 1, STP);
                    to_rows_@S@(gv + o, C, av, hd, cnt, 1, STP);
                }
            }
        }
        free(buf);
    }
    return failed;
}

/* A slot's K or V into the buffer: src token rows of C values at token stride rs -> dst [C][N] (tokens last; stored
   as @KT@), in blocks of 64 tokens (a block's rows are read from L1). The buffer's slot was last touched a step ago,
   so plain stores would first read every line of it from memory; with `stream` set, where rows are whole 64-byte
   lines (dst aligned, N * sizeof(@KT@) a multiple of 64) full blocks are written with streaming stores, which do not
   (figures: RESULTS.md "Sixth pass"). */
int moda_store_slot_@S@(const @T@ *restrict src, long rs, int C, long N, @KT@ *restrict dst, int stream, int threads) {
    long blocks = (N + 63) / 64;
    int whole_lines = stream && (unsigned long)dst % 64 == 0 && (N * (long)sizeof(@KT@)) % 64 == 0;
    #pragma omp parallel num_threads(threads)
    {
        @KT@ row[64] __attribute__((aligned(64)));  /* one channel's 64 tokens */
        #pragma omp for schedule(static) nowait
        for (long blk = 0; blk < blocks; blk++) {
            long t0 = blk * 64;
            int cnt = N - t0 < 64 ? (int)(N - t0) : 64;
            for (int c = 0; c < C; c++) {
                @KT@ *restrict out = dst + (long)c * N + t0;
                const @T@ *restrict in = src + t0 * rs + c;
                if (whole_lines && cnt == 64) {
                    for (int b = 0; b < 64; b++) row[b] = st_@S@(in[b * rs]);
                    for (int x = 0; x < 64; x += 64 / (int)sizeof(@KT@)) stream_line(out + x, row + x);
                } else {
                    for (int b = 0; b < cnt; b++) out[b] = st_@S@(in[b * rs]);
                }
            }
        }
        store_fence();
    }
    return 0;
}
"""
# Slots stored as the model's dtype (f32, f64) or, with option moda_kv_dtype="bfloat16", as bfloat16 bits (bf16:
# float32 arithmetic; a slot is rounded to nearest even once, when stored, as torch's .to(torch.bfloat16) rounds).
_MODA_KV = r"""
#ifdef __AVX512F__
#include <immintrin.h>
#endif
/* 64 bytes from an aligned buffer to aligned dst, past the caches where AVX-512 has streaming stores (else a copy);
   store_fence orders them before anything that reads dst */
static inline void stream_line(void *dst, const void *line) {
#ifdef __AVX512F__
    _mm512_stream_si512((__m512i *)dst, _mm512_load_si512(line));
#else
    memcpy(dst, line, 64);
#endif
}
static inline void store_fence(void) {
#ifdef __AVX512F__
    _mm_sfence();
#endif
}
static inline float ld_f32(float x) { return x; }
static inline float st_f32(float x) { return x; }
static inline double ld_f64(double x) { return x; }
static inline double st_f64(double x) { return x; }
static inline float ld_bf16(unsigned short x) {
    unsigned int u = (unsigned int)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline unsigned short st_bf16(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN */
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
"""
_MODA_SOURCE = _CONNECTOR_HEAD + "#define DT 1024\n#define DTP (DT + 16)\n#define ST 256\n#define STP (ST + 16)\n" + _MODA_KV + "".join(
    _MODA_TEMPLATE.replace("@T@", t).replace("@KT@", kt).replace("@S@", s).replace("@EXP@", e).replace("@LOG@", lg)
    for t, kt, s, e, lg in (("float", "float", "f32", "exp_f32", "logf"), ("double", "double", "f64", "exp", "log"),
                            ("float", "unsigned short", "bf16", "exp_f32", "logf")))

_LIBRARIES = {  # name: (source, flag sets in order of preference: the first that builds is used)
    "sinkhorn": (_SOURCE, [_FLAGS]),
    # the connector kernels split their token loops over torch's intra-op threads with OpenMP (the
    # libgomp torch itself loads); without it they build and run on one thread; a compiler that lacks
    # the x86 / vectorising flags gets plain -O3 (same results up to rounding, slower)
    "connector": (_CONNECTOR_SOURCE, [_CONNECTOR_FLAGS + ["-fopenmp"], _CONNECTOR_FLAGS, ["-O3", "-shared", "-fPIC"]]),
    "bank": (_BANK_SOURCE, [_CONNECTOR_FLAGS + ["-fopenmp"], _CONNECTOR_FLAGS, ["-O3", "-shared", "-fPIC"]]),
    "moda": (_MODA_SOURCE, [_CONNECTOR_FLAGS + ["-fopenmp"], _CONNECTOR_FLAGS, ["-O3", "-shared", "-fPIC"]]),
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


def _kernel_folder() -> Path:
    """Where built libraries are cached: next to inductor's cache (`compiled.cache_dir`)."""
    from depthtools.arch.compiled import cache_dir

    return cache_dir() / "depthtools_kernels"


def _compile(name: str, source: str, cc: str, flags: list[str], folder: Path | None = None) -> Path:
    """The shared object of `source` built with `flags` (cached by source, compiler, flags and CPU) in
    `folder` (default `_kernel_folder()`)."""
    key = hashlib.sha256("\0".join([source, cc, *flags, _cpu_key()]).encode()).hexdigest()[:20]
    folder = _kernel_folder() if folder is None else folder
    target = folder / f"{name}-{key}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            subprocess.run([cc, *flags, "-o", str(out), str(src), "-lm"], check=True, capture_output=True, text=True)
            os.replace(out, target)  # atomic: concurrent builders agree
    return target


def _build(name: str, folder: Path | None = None) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        return None
    source, flag_sets = _LIBRARIES[name]
    for i, flags in enumerate(flag_sets):
        try:
            lib = ctypes.CDLL(str(_compile(name, source, cc, flags, folder)))
            break
        except (OSError, subprocess.CalledProcessError):
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
    build failed: logged once); built in `folder` (default `_kernel_folder()`)."""
    if name in _libs:
        return _libs[name]
    with _lock:
        if name not in _libs:
            lib = None
            try:
                lib = _build(name, folder)
            except (OSError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
                logger.warning("%s CPU kernels unavailable (%s); using torch ops", name, str(detail)[:500])
            _libs[name] = lib
    return _libs[name]


def prebuild(*names: str) -> None:
    """Start building these libraries in the background (a model that uses them is being built): the C
    compiler then runs beside the model's first steps or inductor's compilation instead of before the
    first kernel call, which waits for it (`library` builds under a lock). Cached builds load at once."""
    todo = [name for name in names if name not in _libs and name not in _prebuilding]
    if not todo:
        return
    folder = _kernel_folder()  # its imports (inductor's config) here: importing in two threads at once can fail
    for name in todo:
        _prebuilding.add(name)
        threading.Thread(target=library, args=(name, folder), daemon=True, name=f"depthtools-build-{name}").start()


_prebuilding: set[str] = set()
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
