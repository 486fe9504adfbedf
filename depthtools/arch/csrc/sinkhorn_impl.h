
/* mHC's Sinkhorn, included once per scalar type (generic.h: REAL, FN, EXP). z, out tokens-last [n*n][N]
   (entry k = o*n + i: row o = output stream, column i = input stream). A "group" is one line of the matrix: dim 0 = a column (entries g, n+g, 2n+g, ...: the
   column sums), dim 1 = a row (entries g*n .. g*n+n-1). Softmax over `first`'s lines; half-step
   `step` normalises dim (first + 1 + step) % 2. Work arrays are [entry][BLK] blocks of BLK tokens. */

static inline int FN(base)(int dim, int g, int n) { return dim == 0 ? g : g * n; }
static inline int FN(stride)(int dim, int n) { return dim == 0 ? n : 1; }

/* s = sum over the group's entries (index order), then m /= max(s, tiny) for them; s kept in ss. */
static inline void FN(half_step)(REAL *restrict m, REAL *restrict s, int n, int dim, int g, REAL tiny) {
    int k0 = FN(base)(dim, g, n), st = FN(stride)(dim, n);
    for (int b = 0; b < BLK; b++) s[b] = m[k0 * BLK + b];
    for (int j = 1; j < n; j++) {
        const REAL *restrict row = m + (k0 + j * st) * BLK;
        for (int b = 0; b < BLK; b++) s[b] += row[b];
    }
    REAL r[BLK];
    for (int b = 0; b < BLK; b++) { REAL c = s[b] < tiny ? tiny : s[b]; r[b] = 1 / c; s[b] = r[b]; }
    for (int j = 0; j < n; j++) {
        REAL *restrict row = m + (k0 + j * st) * BLK;
        for (int b = 0; b < BLK; b++) row[b] = row[b] * r[b];
    }
}

static void FN(fwd_block)(REAL *restrict m, REAL *restrict p, REAL *restrict ys, REAL *restrict ss,
                          int n, int t_max, int first, REAL tiny) {
    int nn = n * n, st = FN(stride)(first, n);
    for (int g = 0; g < n; g++) {
        int k0 = FN(base)(first, g, n);
        REAL mx[BLK], s[BLK];
        for (int b = 0; b < BLK; b++) mx[b] = m[k0 * BLK + b];
        for (int j = 1; j < n; j++) {
            const REAL *restrict row = m + (k0 + j * st) * BLK;
            for (int b = 0; b < BLK; b++) mx[b] = row[b] > mx[b] ? row[b] : mx[b];
        }
        for (int j = 0; j < n; j++) {
            REAL *restrict row = m + (k0 + j * st) * BLK;
            for (int b = 0; b < BLK; b++) row[b] = EXP(row[b] - mx[b]);
        }
        FN(half_step)(m, s, n, first, g, 0);  /* then 1/sum: the sum is >= 1 (its max term is exp(0)), no clamp */
    }
    if (p) memcpy(p, m, sizeof(REAL) * nn * BLK);
    int steps = 2 * t_max - 1;
    REAL s[BLK];
    for (int step = 0; step < steps; step++) {
        int dim = (first + 1 + step) % 2;
        for (int g = 0; g < n; g++) {
            FN(half_step)(m, ss ? ss + ((long)step * n + g) * BLK : s, n, dim, g, tiny);
        }
        if (ys) memcpy(ys + (long)step * nn * BLK, m, sizeof(REAL) * nn * BLK);
    }
}

/* g <- (g - sum_group g*y) / s   (or, softmax: g <- y * (g - sum_group g*y) with s == 0) */
static inline void FN(back_group)(REAL *restrict g, const REAL *restrict y, const REAL *restrict s,
                                  int n, int dim, int gr) {
    int k0 = FN(base)(dim, gr, n), st = FN(stride)(dim, n);
    REAL dot[BLK];
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

static void FN(load)(const REAL *restrict z, REAL *restrict m, long N, long t0, int nn) {
    long cnt = N - t0 < BLK ? N - t0 : BLK;
    for (int k = 0; k < nn; k++) {
        for (long b = 0; b < cnt; b++) m[k * BLK + b] = z[k * N + t0 + b];
        for (long b = cnt; b < BLK; b++) m[k * BLK + b] = 0;
    }
}

static void FN(store)(REAL *restrict out, const REAL *restrict m, long N, long t0, int nn) {
    long cnt = N - t0 < BLK ? N - t0 : BLK;
    for (int k = 0; k < nn; k++)
        for (long b = 0; b < cnt; b++) out[k * N + t0 + b] = m[k * BLK + b];
}

int FN(sinkhorn_forward)(const REAL *z, REAL *out, long N, int n, int t_max, int first, REAL tiny) {
    REAL *m = (REAL *)malloc(sizeof(REAL) * n * n * BLK);
    if (!m) return 1;
    for (long t0 = 0; t0 < N; t0 += BLK) {
        FN(load)(z, m, N, t0, n * n);
        FN(fwd_block)(m, 0, 0, 0, n, t_max, first, tiny);
        FN(store)(out, m, N, t0, n * n);
    }
    free(m);
    return 0;
}

int FN(sinkhorn_backward)(const REAL *z, const REAL *grad, REAL *out, long N, int n, int t_max, int first, REAL tiny) {
    int nn = n * n, steps = 2 * t_max - 1;
    REAL *m = (REAL *)malloc(sizeof(REAL) * nn * BLK * 3);
    REAL *ys = (REAL *)malloc(sizeof(REAL) * ((long)steps * nn * BLK));
    REAL *ss = (REAL *)malloc(sizeof(REAL) * ((long)steps * n * BLK));
    if (!m || !ys || !ss) { free(m); free(ys); free(ss); return 1; }
    REAL *p = m + nn * BLK, *g = m + 2 * nn * BLK;
    for (long t0 = 0; t0 < N; t0 += BLK) {
        FN(load)(z, m, N, t0, nn);
        FN(fwd_block)(m, p, ys, ss, n, t_max, first, tiny);
        FN(load)(grad, g, N, t0, nn);
        for (int step = steps - 1; step >= 0; step--) {
            int dim = (first + 1 + step) % 2;
            for (int gr = 0; gr < n; gr++)
                FN(back_group)(g, ys + (long)step * nn * BLK, ss + ((long)step * n + gr) * BLK, n, dim, gr);
        }
        for (int gr = 0; gr < n; gr++) FN(back_group)(g, p, 0, n, first, gr);
        FN(store)(out, g, N, t0, nn);
    }
    free(m); free(ys); free(ss);
    return 0;
}
