/* AttnRes' depth-bank kernels, included once per scalar type (generic.h: REAL, FN, EXP). */

/* y += a x and x . y over rows of d, in fixed chunks of 16 (whole vectors; no alias checks or loop set-up
   per call in the inner loops below), then the rest */
static inline void FN(axpy)(REAL *restrict y, REAL a, const REAL *restrict x, int d) {
    int c = 0;
    for (; c + 16 <= d; c += 16) for (int e = 0; e < 16; e++) y[c + e] += a * x[c + e];
    for (; c < d; c++) y[c] += a * x[c];
}
/* y += a0 x0 + a1 x1 + a2 x2 + a3 x3: one read-modify-write of y for four rows */
static inline void FN(axpy4)(REAL *restrict y, const REAL *a, const REAL *restrict x0, const REAL *restrict x1,
                             const REAL *restrict x2, const REAL *restrict x3, int d) {
    int c = 0;
    for (; c + 16 <= d; c += 16)
        for (int e = 0; e < 16; e++) y[c + e] += (a[0] * x0[c + e] + a[1] * x1[c + e]) + (a[2] * x2[c + e] + a[3] * x3[c + e]);
    for (; c < d; c++) y[c] += (a[0] * x0[c] + a[1] * x1[c]) + (a[2] * x2[c] + a[3] * x3[c]);
}
static inline REAL FN(dot)(const REAL *restrict x, const REAL *restrict y, int d) {
    REAL acc[16] = {0};
    int c = 0;
    for (; c + 16 <= d; c += 16) for (int e = 0; e < 16; e++) acc[e] += x[c + e] * y[c + e];
    REAL s = 0;
    for (int e = 0; e < 16; e++) s += acc[e];
    for (; c < d; c++) s += x[c] * y[c];
    return s;
}
/* h [N,d] and alpha [n(+1), N] of one mix over sources 0..n-1 of values [cap,N,d] (slot-major), logits
   dots[i, col, t] * inv_rms[i, t] (dots [cap,M,N]), plus an optional partial source pf [N,d] with logit
   plogit [N] (alpha's last row). Two-phase (P != NULL): the sources below n0 enter as P [N, p_stride] rows,
   their softmax numerator sum taken at the max mu [N] of their logits: h = exp(mu - max)/sum * P + ... */
int FN(bank_mix_forward)(const REAL *restrict values, const REAL *restrict inv_rms, const REAL *restrict dots,
                         long N, int d, int M, int n, int col, const REAL *restrict plogit,
                         const REAL *restrict pf, int n0, const REAL *restrict mu, const REAL *restrict P,
                         long p_stride, REAL *restrict h, REAL *restrict alpha, int threads) {
    int na = n + (pf != 0), failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        /* each thread a contiguous token range: the softmax runs row by row over it (long sequential
           reads of the dots, 1/rms and alpha rows), the weighted sum in tiles of BT tokens */
        long per = ((N + NUM_THREADS - 1) / NUM_THREADS + 15) / 16 * 16;
        long ta = THREAD_ID * per, tb = ta + per < N ? ta + per : N, len = tb - ta;
        REAL *mx = len > 0 ? (REAL *)malloc(sizeof(REAL) * 2 * len) : 0;
        if (len > 0 && !mx) {
            #pragma omp atomic write
            failed = 1;
        }
        if (mx) {
            REAL *s = mx + len;
            for (long t = 0; t < len; t++) { mx[t] = -INFINITY; s[t] = 0; }
            for (int i = 0; i < na; i++) {
                REAL *restrict ar = alpha + (long)i * N + ta;
                if (i < n) {
                    const REAL *restrict dr = dots + ((long)i * M + col) * N + ta;
                    const REAL *restrict rr = inv_rms + (long)i * N + ta;
                    for (long t = 0; t < len; t++) { REAL l = dr[t] * rr[t]; ar[t] = l; mx[t] = l > mx[t] ? l : mx[t]; }
                } else {
                    for (long t = 0; t < len; t++) { REAL l = plogit[ta + t]; ar[t] = l; mx[t] = l > mx[t] ? l : mx[t]; }
                }
            }
            for (int i = 0; i < na; i++) {
                REAL *restrict ar = alpha + (long)i * N + ta;
                for (long t = 0; t < len; t++) { REAL e = EXP(ar[t] - mx[t]); ar[t] = e; s[t] += e; }
            }
            for (long t = 0; t < len; t++) s[t] = 1 / s[t];
            for (int i = 0; i < na; i++) {
                REAL *restrict ar = alpha + (long)i * N + ta;
                for (long t = 0; t < len; t++) ar[t] *= s[t];
            }
            for (long t0 = ta; t0 < tb; t0 += BT) {
                int cnt = tb - t0 < BT ? (int)(tb - t0) : BT;
                REAL *restrict ht = h + t0 * d;
                if (P) {
                    for (int b = 0; b < cnt; b++) {
                        long t = t0 + b;
                        REAL c = EXP(mu[t] - mx[t - ta]) * s[t - ta];
                        const REAL *restrict pr = P + t * p_stride;
                        for (int k = 0; k < d; k++) ht[b * d + k] = c * pr[k];
                    }
                } else {
                    memset(ht, 0, sizeof(REAL) * cnt * d);
                }
                int i = n0;
                for (; i + 4 <= n; i += 4) {  /* four sources per read-modify-write of h */
                    const REAL *restrict vr = values + ((long)i * N + t0) * d;
                    const REAL *restrict ar = alpha + (long)i * N + t0;
                    for (int b = 0; b < cnt; b++) {
                        REAL a[4] = {ar[b], ar[N + b], ar[2 * N + b], ar[3 * N + b]};
                        long o = (long)b * d;
                        FN(axpy4)(ht + o, a, vr + o, vr + N * d + o, vr + 2 * N * d + o, vr + 3 * N * d + o, d);
                    }
                }
                for (; i < na; i++) {
                    const REAL *restrict vr = i < n ? values + ((long)i * N + t0) * d : pf + t0 * d;
                    const REAL *restrict ar = alpha + (long)i * N + t0;
                    for (int b = 0; b < cnt; b++) FN(axpy)(ht + b * d, ar[b], vr + b * d, d);
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
int FN(bank_prefix)(const REAL *restrict values, const REAL *restrict inv_rms, const REAL *restrict dots,
                    long N, int d, int M, int n0, int G, const long *cols, REAL *restrict mu, REAL *restrict P,
                    int threads) {
    long tiles = (N + PT - 1) / PT;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        REAL *w = (REAL *)malloc(sizeof(REAL) * (long)n0 * G * PT);  /* [i][g][b] */
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
                REAL *restrict mg = mu + (long)g * N + t0;
                for (int b = 0; b < cnt; b++) mg[b] = -INFINITY;
                for (int i = 0; i < n0; i++) {
                    const REAL *restrict dr = dots + ((long)i * M + cols[g]) * N + t0;
                    const REAL *restrict rr = inv_rms + (long)i * N + t0;
                    for (int b = 0; b < cnt; b++) { REAL l = dr[b] * rr[b]; mg[b] = l > mg[b] ? l : mg[b]; }
                }
            }
            for (int i = 0; i < n0; i++) {
                const REAL *restrict rr = inv_rms + (long)i * N + t0;
                for (int g = 0; g < G; g++) {
                    const REAL *restrict dr = dots + ((long)i * M + cols[g]) * N + t0;
                    const REAL *restrict mg = mu + (long)g * N + t0;
                    REAL *restrict wr = w + ((long)i * G + g) * PT;
                    for (int b = 0; b < cnt; b++) wr[b] = EXP(dr[b] * rr[b] - mg[b]);
                }
            }
            for (int b = 0; b < cnt; b++) {
                REAL *restrict pt = P + (t0 + b) * G * d;
                const REAL *restrict vb = values + (t0 + b) * d;  /* source i's row: vb + i N d */
                memset(pt, 0, sizeof(REAL) * G * d);
                int i = 0;
                for (; i + 4 <= n0; i += 4) {
                    const REAL *restrict wi = w + (long)i * G * PT + b;
                    for (int g = 0; g < G; g++) {
                        REAL a[4] = {wi[g * PT], wi[(G + g) * PT], wi[(2 * G + g) * PT], wi[(3 * G + g) * PT]};
                        FN(axpy4)(pt + g * d, a, vb + i * N * d, vb + (i + 1) * N * d, vb + (i + 2) * N * d,
                                  vb + (i + 3) * N * d, d);
                    }
                }
                for (; i < n0; i++)
                    for (int g = 0; g < G; g++) FN(axpy)(pt + g * d, w[((long)i * G + g) * PT + b], vb + i * N * d, d);
            }
        }
        free(w);
    }
    return failed;
}

/* Add K recorded mixes' contributions to sources lo..hi-1: mix k (output gradient grads[k] [N,d], rho[k] [N]
   = g . h, weights alpha[k] [n_k, N], column cols[k]) gives dalpha = g . v_i, dlogit = alpha (dalpha - rho),
   gv[i] += alpha g, gdots[i, col] += dlogit * inv_rms[i], ginv[i] += dlogit * dots[i, col]; mixes in order. */
int FN(bank_flush)(const REAL *restrict values, const REAL *restrict inv_rms, const REAL *restrict dots,
                   long N, int d, int M, int lo, int hi, int K, const long *grads, const long *weights,
                   const long *rhos, const long *cols, REAL *restrict gv, REAL *restrict gdots,
                   REAL *restrict ginv, int threads) {
    long tiles = (N + BT - 1) / BT;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long tile = 0; tile < tiles; tile++) {
        long t0 = tile * BT;
        int cnt = N - t0 < BT ? (int)(N - t0) : BT;
        for (int i = lo; i < hi; i++) {
            const REAL *restrict vr = values + ((long)i * N + t0) * d;
            REAL *restrict gvr = gv + ((long)i * N + t0) * d;
            for (int b = 0; b < cnt; b++) {
                long t = t0 + b, it = (long)i * N + t;
                const REAL *restrict v = vr + b * d;
                REAL *restrict gvt = gvr + b * d;
                REAL r = inv_rms[it], gi = 0;
                int k = 0;
                for (; k + 4 <= K; k += 4) {  /* four mixes per pass over v and gv: independent sums */
                    const REAL *restrict g0 = (const REAL *)grads[k] + t * d, *restrict g1 = (const REAL *)grads[k + 1] + t * d;
                    const REAL *restrict g2 = (const REAL *)grads[k + 2] + t * d, *restrict g3 = (const REAL *)grads[k + 3] + t * d;
                    REAL a[4], da[4] = {0, 0, 0, 0};
                    for (int q = 0; q < 4; q++) a[q] = ((const REAL *)weights[k + q])[it];
                    for (int c = 0; c < d; c++) {
                        REAL x = v[c];
                        da[0] += g0[c] * x; da[1] += g1[c] * x; da[2] += g2[c] * x; da[3] += g3[c] * x;
                    }
                    FN(axpy4)(gvt, a, g0, g1, g2, g3, d);
                    for (int q = 0; q < 4; q++) {
                        REAL dl = a[q] * (da[q] - ((const REAL *)rhos[k + q])[t]);
                        long o = ((long)i * M + cols[k + q]) * N + t;
                        gdots[o] += dl * r;
                        gi += dl * dots[o];
                    }
                }
                for (; k < K; k++) {
                    const REAL *restrict g = (const REAL *)grads[k] + t * d;
                    REAL a = ((const REAL *)weights[k])[it];
                    REAL dl = a * (FN(dot)(g, v, d) - ((const REAL *)rhos[k])[t]);
                    FN(axpy)(gvt, a, g, d);
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
