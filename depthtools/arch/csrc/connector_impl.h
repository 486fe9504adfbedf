/* HC's connector, included once per scalar type (generic.h: REAL, FN, SQRT, EXP). */
/* out[j] = x . P_j for the m rows of P [m][k], four at a time: four independent sums per pass over
   x (a single vectorised sum is bound by the latency of its multiply-add chain) */
static inline void FN(dots)(const REAL *restrict x, const REAL *restrict P, int k, int m, REAL *restrict out) {
    int j = 0;
    for (; j + 4 <= m; j += 4) {
        const REAL *restrict p0 = P + (long)j * k, *restrict p1 = p0 + k, *restrict p2 = p1 + k, *restrict p3 = p2 + k;
        REAL a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        for (int i = 0; i < k; i++) { a0 += x[i] * p0[i]; a1 += x[i] * p1[i]; a2 += x[i] * p2[i]; a3 += x[i] * p3[i]; }
        out[j] = a0; out[j + 1] = a1; out[j + 2] = a2; out[j + 3] = a3;
    }
    for (; j < m; j++) {
        const REAL *restrict p = P + (long)j * k;
        REAL acc = 0;
        for (int i = 0; i < k; i++) acc += x[i] * p[i];
        out[j] = acc;
    }
}

/* HC connector, forward, per token t (streams H_t [n][d]; m = n + 2 coefficient columns):
     inv_s = 1/sqrt(mean H_s^2 + eps), raw[s][j] = H_s . P_j, tt = tanh(raw * inv), coef = S + scale * tt
     out[0] = sum_s coef[s][0] H_s (branch input u), out[1 + o] = sum_s coef[s][1 + o] H_s (R H), depth[s] = coef[s][n + 1]
   raw, inv and tt are kept for the backward. */
void FN(hc_connect_forward)(const REAL *restrict H, const REAL *restrict Pt, const REAL *restrict S,
                            const REAL *restrict scale, long N, int n, int d, REAL eps,
                            REAL *restrict out, REAL *restrict depth, REAL *restrict raw, REAL *restrict inv,
                            REAL *restrict tt, int threads) {
    int m = n + 2, q = n + 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < N; t++) {
        REAL a[NMAX * MMAX], coef[NMAX * MMAX];
        const REAL *restrict Ht = H + t * n * d;
        REAL *restrict rawt = raw + t * n * m, *restrict tt_t = tt + t * n * m;
        for (int s = 0; s < n; s++) {
            const REAL *restrict h = Ht + s * d;
            REAL ss = 0;
            for (int i = 0; i < d; i++) ss += h[i] * h[i];
            REAL iv = 1 / SQRT(ss / d + eps);
            inv[t * n + s] = iv;
            FN(dots)(h, Pt, d, m, rawt + s * m);
            for (int j = 0; j < m; j++) a[s * m + j] = rawt[s * m + j] * iv;
        }
        for (int k = 0; k < n * m; k++) tt_t[k] = FN(tanh)(a[k]);
        for (int s = 0; s < n; s++)
            for (int j = 0; j < m; j++) coef[s * m + j] = S[s * m + j] + scale[j] * tt_t[s * m + j];
        for (int s = 0; s < n; s++) depth[t * n + s] = coef[s * m + n + 1];
        for (int r = 0; r < q; r++) {
            REAL *restrict o = out + (t * q + r) * d;
            REAL c = coef[r];
            for (int i = 0; i < d; i++) o[i] = c * Ht[i];
            for (int s = 1; s < n; s++) {
                const REAL *restrict h = Ht + s * d;
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
int FN(hc_connect_backward)(const REAL *restrict H, const REAL *restrict Pt, const REAL *restrict S,
                            const REAL *restrict scale, const REAL *restrict raw, const REAL *restrict inv,
                            const REAL *restrict tt, const REAL *restrict g_out, const REAL *restrict g_depth,
                            long N, int n, int d, REAL *restrict gH, REAL *restrict gPt, REAL *restrict gS,
                            REAL *restrict gscale, int threads) {
    int m = n + 2, q = n + 1;
    long nw = (long)m * d + n * m + m, ch = chunk_tokens(N), nch = (N + ch - 1) / ch;
    double *part = (double *)calloc(nch * nw, sizeof(double));  /* per chunk: gPt, gS, gscale */
    REAL *gPfs = (REAL *)calloc((long)threads * m * d, sizeof(REAL));  /* per thread: float partials of gPt */
    if (!part || !gPfs) { free(part); free(gPfs); return 1; }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < nch; c++) {
        REAL coef[NMAX * MMAX], graw[NMAX * MMAX];
        REAL *restrict gPf = gPfs + (long)THREAD_ID * m * d;
        double *restrict gPd = part + c * nw, *restrict gSd = gPd + (long)m * d, *restrict gscd = gSd + n * m;
        long t_end = (c + 1) * ch < N ? (c + 1) * ch : N;
        for (long t = c * ch; t < t_end; t++) {
            const REAL *restrict Ht = H + t * n * d;
            const REAL *restrict gt = g_out + t * q * d;
            const REAL *restrict rawt = raw + t * n * m, *restrict tt_t = tt + t * n * m;
            for (int k = 0; k < n * m; k++) coef[k] = S[k] + scale[k % m] * tt_t[k];
            for (int s = 0; s < n; s++) {
                const REAL *restrict h = Ht + s * d;
                REAL *restrict gh = gH + (t * n + s) * d;
                REAL iv = inv[t * n + s];
                REAL gi = 0;
                for (int j = 0; j < m; j++) {
                    REAL gc;
                    if (j < q) {
                        const REAL *restrict gj = gt + j * d;
                        gc = 0;
                        for (int i = 0; i < d; i++) gc += gj[i] * h[i];
                    } else {
                        gc = g_depth[t * n + s];
                    }
                    REAL tj = tt_t[s * m + j];
                    gSd[s * m + j] += gc;
                    gscd[j] += (double)gc * tj;
                    REAL ga = gc * scale[j] * (1 - tj * tj);
                    graw[s * m + j] = ga * iv;
                    gi += ga * rawt[s * m + j];
                }

                REAL c = coef[s * m];
                for (int i = 0; i < d; i++) gh[i] = c * gt[i];
                for (int r = 1; r < q; r++) {
                    const REAL *restrict gr = gt + r * d;
                    c = coef[s * m + r];
                    for (int i = 0; i < d; i++) gh[i] += c * gr[i];
                }
                REAL k_inv = -gi * iv * iv * iv / d;
                for (int i = 0; i < d; i++) gh[i] += k_inv * h[i];
                for (int j = 0; j < m; j++) {
                    REAL g = graw[s * m + j];
                    const REAL *restrict p = Pt + (long)j * d;
                    REAL *restrict gp = gPf + (long)j * d;
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
    for (long i = 0; i < (long)m * d; i++) gPt[i] = (REAL)gPd[i];
    for (int k = 0; k < n * m; k++) gS[k] = (REAL)gSd[k];
    for (int j = 0; j < m; j++) gscale[j] = (REAL)gscd[j];
    free(part); free(gPfs);
    return 0;
}
