
/* MoDA's depth part, included once per slot type (generic.h: REAL, KV_T, FN, EXP, LOG). Slots K, V are tokens last, [S][Hkv][hd][N] (slot stride Hkv*hd*N, N = B*T
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
static inline void FN(to_tokens_last)(REAL *restrict dst, const REAL *restrict src, long st, int hd, int cnt, REAL a) {
    for (int b0 = 0; b0 < cnt; b0 += 64) {
        int e = cnt - b0 < 64 ? cnt : b0 + 64;
        for (int i = 0; i < hd; i++)
            for (int b = b0; b < e; b++) dst[i * DTP + b] = a * src[b * st + i];
    }
}

/* tokens last -> token rows: dst[b*st + i] = a * src[i*sp + b] (add_rows: dst[b*st + i] += src[i*sp + b]) */
static inline void FN(to_rows)(REAL *restrict dst, long st, const REAL *restrict src, int hd, int cnt, REAL a, int sp) {
    for (int b = 0; b < cnt; b++)
        for (int i = 0; i < hd; i++) dst[b * st + i] = a * src[i * sp + b];
}
static inline void FN(add_rows)(REAL *restrict dst, long st, const REAL *restrict src, int hd, int cnt, int sp) {
    for (int b = 0; b < cnt; b++)
        for (int i = 0; i < hd; i++) dst[b * st + i] += src[i * sp + b];
}

/* work item w of (kv head, tile of `tile` tokens) pairs, `tiles` tiles per head: its head h, first token t0 and
   token count */
static inline int FN(work_tile)(long w, long tiles, int tile, long N, int *h, long *t0) {
    *h = (int)(w / tiles);
    *t0 = (w % tiles) * tile;
    return N - *t0 < tile ? (int)(N - *t0) : tile;
}

/* ask for the next slot's rows (hd rows of cnt values, N apart) into L2 while this slot's are computed */
static inline void FN(prefetch_slot)(const KV_T *p, int hd, long N, int cnt) {
    for (int i = 0; i < hd; i++)
        for (int b = 0; b < cnt; b += 64 / (int)sizeof(KV_T)) __builtin_prefetch(p + i * N + b, 0, 2);
}

int FN(moda_forward)(const KV_T *restrict K, const KV_T *restrict V, const REAL *restrict q, long qst, REAL scale,
                     const REAL *restrict o, long ost, const REAL *restrict lse_seq, long lst,
                     const unsigned char *invalid, int S, int Hkv, int g, int hd, long N, REAL *restrict z,
                     REAL *restrict lse, REAL *restrict probs, REAL *restrict qs, int threads) {
    long tiles = (N + DT - 1) / DT, work = tiles * Hkv;
    long kstride = (long)Hkv * hd * N;
    int H = Hkv * g;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        long rows = (long)g * hd * DTP;
        REAL *buf = (REAL *)malloc(sizeof(REAL) * (2 * rows + (long)g * S * DTP + 3L * g * DTP));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        REAL *ql = buf, *zl = ql + rows, *sc = zl + rows, *m = sc + (long)g * S * DTP;
        REAL *tot = m + (long)g * DTP, *ls = tot + (long)g * DTP;
        #pragma omp for schedule(static)
        for (long w = 0; w < work; w++) {
            if (!buf) continue;
            int h;
            long t0;
            int cnt = FN(work_tile)(w, tiles, DT, N, &h, &t0);
            for (int j = 0; j < g; j++) {
                int hh = h * g + j;
                REAL *restrict qj = ql + (long)j * hd * DTP;
                FN(to_tokens_last)(qj, q + t0 * qst + (long)hh * hd, qst, hd, cnt, scale);
                for (int i = 0; i < hd; i++) memcpy(qs + ((long)hh * hd + i) * N + t0, qj + i * DTP, sizeof(REAL) * cnt);
                for (int b = 0; b < cnt; b++) m[j * DTP + b] = ls[j * DTP + b] = lse_seq[(t0 + b) * lst + hh];
            }
            for (int s = 0; s < S; s++) {
                if (invalid && invalid[s]) continue;
                const KV_T *restrict Ks = K + s * kstride + (long)h * hd * N + t0;
                if (s + 1 < S) FN(prefetch_slot)(Ks + kstride, hd, N, cnt);
                for (int j = 0; j < g; j++) {
                    REAL *restrict sr = sc + ((long)j * S + s) * DTP;
                    const REAL *restrict qj = ql + (long)j * hd * DTP;
                    for (int b = 0; b < cnt; b++) sr[b] = 0;
                    for (int i = 0; i < hd; i++)
                        for (int b = 0; b < cnt; b++) sr[b] += FN(ld)(Ks[i * N + b]) * qj[i * DTP + b];
                    REAL *restrict mj = m + j * DTP;
                    for (int b = 0; b < cnt; b++) mj[b] = sr[b] > mj[b] ? sr[b] : mj[b];
                }
            }
            for (int j = 0; j < g; j++) {
                int hh = h * g + j;
                REAL *restrict mj = m + j * DTP, *restrict tj = tot + j * DTP, *restrict lj = ls + j * DTP;
                for (int b = 0; b < cnt; b++) tj[b] = EXP(lj[b] - mj[b]);
                for (int s = 0; s < S; s++) {
                    if (invalid && invalid[s]) continue;
                    REAL *restrict sr = sc + ((long)j * S + s) * DTP;
                    for (int b = 0; b < cnt; b++) { REAL e = EXP(sr[b] - mj[b]); sr[b] = e; tj[b] += e; }
                }
                for (int b = 0; b < cnt; b++) { lse[(t0 + b) * H + hh] = LOG(tj[b]) + mj[b]; tj[b] = 1 / tj[b]; }
                for (int s = 0; s < S; s++) {
                    REAL *restrict pr = probs + ((long)(s * Hkv + h) * g + j) * N + t0;
                    REAL *restrict sr = sc + ((long)j * S + s) * DTP;
                    if (invalid && invalid[s]) {
                        for (int b = 0; b < cnt; b++) sr[b] = 0;
                    } else {
                        for (int b = 0; b < cnt; b++) sr[b] *= tj[b];
                    }
                    memcpy(pr, sr, sizeof(REAL) * cnt);
                }
                /* the sequence part's output times its weight exp(lse_seq - lse) */
                REAL *restrict zj = zl + (long)j * hd * DTP;
                FN(to_tokens_last)(zj, o + t0 * ost + (long)hh * hd, ost, hd, cnt, 1);
                for (int b = 0; b < cnt; b++) mj[b] = EXP(lj[b] - mj[b]) * tj[b];
                for (int i = 0; i < hd; i++)
                    for (int b = 0; b < cnt; b++) zj[i * DTP + b] *= mj[b];
            }
            for (int s = 0; s < S; s++) {
                if (invalid && invalid[s]) continue;
                const KV_T *restrict Vs = V + s * kstride + (long)h * hd * N + t0;
                if (s + 1 < S) FN(prefetch_slot)(Vs + kstride, hd, N, cnt);
                for (int j = 0; j < g; j++) {
                    const REAL *restrict p = sc + ((long)j * S + s) * DTP;
                    for (int i = 0; i < hd; i++) {
                        REAL *restrict zi = zl + ((long)j * hd + i) * DTP;
                        for (int b = 0; b < cnt; b++) zi[b] += p[b] * FN(ld)(Vs[i * N + b]);
                    }
                }
            }
            for (int j = 0; j < g; j++)
                FN(to_rows)(z + t0 * H * hd + (long)(h * g + j) * hd, (long)H * hd, zl + (long)j * hd * DTP, hd, cnt, 1, DTP);
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
int FN(moda_backward)(const KV_T *restrict K, const KV_T *restrict V, const REAL *restrict z, const REAL *restrict dz,
                      const REAL *restrict probs, const unsigned char *invalid, int S, int Hkv, int g, int hd, long N,
                      REAL scale, REAL *restrict dqd, REAL *restrict ds, REAL *restrict dzt, int threads) {
    long tiles = (N + DT - 1) / DT, work = tiles * Hkv;
    long kstride = (long)Hkv * hd * N;
    int H = Hkv * g;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        long rows = (long)g * hd * DTP;
        REAL *buf = (REAL *)malloc(sizeof(REAL) * (2 * rows + 2L * g * DTP));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        REAL *dzl = buf, *dql = dzl + rows, *r = dql + rows, *acc = r + (long)g * DTP;
        #pragma omp for schedule(static)
        for (long w = 0; w < work; w++) {
            if (!buf) continue;
            int h;
            long t0;
            int cnt = FN(work_tile)(w, tiles, DT, N, &h, &t0);
            for (int j = 0; j < g; j++) {
                long col = (long)(h * g + j) * hd;
                REAL *restrict dj = dzl + (long)j * hd * DTP, *restrict rj = r + j * DTP;
                FN(to_tokens_last)(dj, dz + t0 * H * hd + col, (long)H * hd, hd, cnt, 1);
                for (int i = 0; i < hd; i++) memcpy(dzt + (col + i) * N + t0, dj + i * DTP, sizeof(REAL) * cnt);
                for (int b = 0; b < cnt; b++) {
                    const REAL *restrict dr = dz + (t0 + b) * H * hd + col, *restrict zr = z + (t0 + b) * H * hd + col;
                    REAL dot = 0;
                    for (int i = 0; i < hd; i++) dot += dr[i] * zr[i];
                    rj[b] = dot;
                }
            }
            memset(dql, 0, sizeof(REAL) * rows);
            for (int s = 0; s < S; s++) {
                long off = s * kstride + (long)h * hd * N + t0;
                const KV_T *restrict Ks = K + off, *restrict Vs = V + off;
                if (s + 1 < S) {
                    FN(prefetch_slot)(Vs + kstride, hd, N, cnt);
                    FN(prefetch_slot)(Ks + kstride, hd, N, cnt);
                }
                for (int j = 0; j < g; j++) {
                    long prow = ((long)(s * Hkv + h) * g + j) * N + t0;
                    REAL *restrict dsj = ds + prow;
                    if (invalid && invalid[s]) {
                        memset(dsj, 0, sizeof(REAL) * cnt);
                        continue;
                    }
                    const REAL *restrict p = probs + prow;
                    const REAL *restrict dj = dzl + (long)j * hd * DTP, *restrict rj = r + j * DTP;
                    for (int b = 0; b < cnt; b++) acc[b] = 0;
                    for (int i = 0; i < hd; i++)
                        for (int b = 0; b < cnt; b++) acc[b] += dj[i * DTP + b] * FN(ld)(Vs[i * N + b]);
                    for (int b = 0; b < cnt; b++) acc[b] = p[b] * (acc[b] - rj[b]);
                    memcpy(dsj, acc, sizeof(REAL) * cnt);
                    for (int i = 0; i < hd; i++) {
                        REAL *restrict dq = dql + ((long)j * hd + i) * DTP;
                        for (int b = 0; b < cnt; b++) dq[b] += acc[b] * FN(ld)(Ks[i * N + b]);
                    }
                }
            }
            for (int j = 0; j < g; j++)
                FN(to_rows)(dqd + t0 * H * hd + (long)(h * g + j) * hd, (long)H * hd, dql + (long)j * hd * DTP, hd, cnt, scale, DTP);
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
int FN(moda_slot_grads)(int R, const long *ds, const long *probs, const long *qs, const long *dzt, const long *reads,
                        int start, int stop, int Hkv, int g, int hd, long N, REAL *restrict gk, REAL *restrict gv,
                        int add, int threads) {
    long tiles = (N + ST - 1) / ST, work = tiles * Hkv;
    int n = stop - start, C = Hkv * hd;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        REAL *buf = n > 0 ? (REAL *)malloc(sizeof(REAL) * 2L * hd * STP) : 0;
        if (n > 0 && !buf) {
            #pragma omp atomic write
            failed = 1;
        }
        REAL *ak = buf, *av = buf + (long)hd * STP;  /* one slot's [hd][ST] sums: L1 */
        #pragma omp for schedule(static)
        for (long w = 0; w < work; w++) {
            if (!buf) continue;
            int h;
            long t0;
            int cnt = FN(work_tile)(w, tiles, ST, N, &h, &t0);
            for (int s = start; s < stop; s++) {
                memset(buf, 0, sizeof(REAL) * 2L * hd * STP);
                for (int k = 0; k < R; k++) {  /* (the records' tile rows are read again for each slot) */
                    if (reads[k] <= s) continue;
                    for (int j = 0; j < g; j++) {
                        long row = (long)(h * g + j) * hd, prow = ((long)(s * Hkv + h) * g + j) * N + t0;
                        const REAL *restrict qr = (const REAL *)qs[k] + row * N + t0;
                        const REAL *restrict dr = (const REAL *)dzt[k] + row * N + t0;
                        const REAL *restrict dsr = (const REAL *)ds[k] + prow, *restrict pr = (const REAL *)probs[k] + prow;
                        for (int i = 0; i < hd; i++) {
                            REAL *restrict aki = ak + i * STP, *restrict avi = av + i * STP;
                            for (int b = 0; b < cnt; b++) {
                                aki[b] += dsr[b] * qr[i * N + b];
                                avi[b] += pr[b] * dr[i * N + b];
                            }
                        }
                    }
                }
                long o = ((long)(s - start) * N + t0) * C + (long)h * hd;
                if (add) {
                    FN(add_rows)(gk + o, C, ak, hd, cnt, STP);
                    FN(add_rows)(gv + o, C, av, hd, cnt, STP);
                } else {
                    FN(to_rows)(gk + o, C, ak, hd, cnt, 1, STP);
                    FN(to_rows)(gv + o, C, av, hd, cnt, 1, STP);
                }
            }
        }
        free(buf);
    }
    return failed;
}

/* A slot's K or V into the buffer: src token rows of C values at token stride rs -> dst [C][N] (tokens last; stored
   as KV_T), in blocks of 64 tokens (a block's rows are read from L1). The buffer's slot was last touched a step ago,
   so plain stores would first read every line of it from memory; with `stream` set, where rows are whole 64-byte
   lines (dst aligned, N * sizeof(KV_T) a multiple of 64) full blocks are written with streaming stores, which do not
   (figures: RESULTS.md "Sixth pass"). */
int FN(moda_store_slot)(const REAL *restrict src, long rs, int C, long N, KV_T *restrict dst, int stream, int threads) {
    long blocks = (N + 63) / 64;
    int whole_lines = stream && (unsigned long)dst % 64 == 0 && (N * (long)sizeof(KV_T)) % 64 == 0;
    #pragma omp parallel num_threads(threads)
    {
        KV_T row[64] __attribute__((aligned(64)));  /* one channel's 64 tokens */
        #pragma omp for schedule(static) nowait
        for (long blk = 0; blk < blocks; blk++) {
            long t0 = blk * 64;
            int cnt = N - t0 < 64 ? (int)(N - t0) : 64;
            for (int c = 0; c < C; c++) {
                KV_T *restrict out = dst + (long)c * N + t0;
                const REAL *restrict in = src + t0 * rs + c;
                if (whole_lines && cnt == 64) {
                    for (int b = 0; b < 64; b++) row[b] = FN(st)(in[b * rs]);
                    for (int x = 0; x < 64; x += 64 / (int)sizeof(KV_T)) stream_line(out + x, row + x);
                } else {
                    for (int b = 0; b < cnt; b++) out[b] = FN(st)(in[b * rs]);
                }
            }
        }
        store_fence();
    }
    return 0;
}
