/* mHC's connector, included once per scalar type after sinkhorn_impl.h (generic.h: REAL, FN, SQRT, EXP). */
/* mHC connector, forward, in blocks of BLK tokens (x_t = vec H_t, K = n*d; J = 2n + n*n coefficient columns;
   Phi transposed PhiT [J][K]; gates = (g_pre, g_post, g_res)):
     inv = 1/sqrt(mean x^2 + eps), a_j = (x . Phi_j) inv
     H_pre = sigmoid(g_pre a_pre + b_pre), H_post = 2 sigmoid(g_post a_post + b_post),
     H_res = Sinkhorn(g_res a_res + b_res) (fwd_block: softmax over `first`, 2 t_max - 1 half-steps; entry o*n + i)
     out[0] = sum_s H_pre[s] H_s, out[1 + o] = sum_i H_res[o][i] H_i, depth = H_post.
   raw = x . Phi_j and inv are kept for the backward, which recomputes the rest. 1 = out of memory. */
int FN(mhc_connect_forward)(const REAL *restrict H, const REAL *restrict PhiT, const REAL *restrict gates,
                            const REAL *restrict b_pre, const REAL *restrict b_post, const REAL *restrict b_res,
                            long N, int n, int d, REAL eps, int t_max, int first, REAL tiny,
                            REAL *restrict out, REAL *restrict depth, REAL *restrict raw, REAL *restrict inv,
                            int threads) {
    int K = n * d, J = 2 * n + n * n, nn = n * n, q = n + 1;
    long per_thread = (long)(J + nn) * BLK, nblk = (N + BLK - 1) / BLK;
    REAL *bufs = (REAL *)malloc(sizeof(REAL) * per_thread * threads);
    if (!bufs) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long blk = 0; blk < nblk; blk++) {
        REAL *restrict a = bufs + (long)THREAD_ID * per_thread, *restrict m = a + (long)J * BLK;
        long t0 = blk * BLK;
        long cnt = N - t0 < BLK ? N - t0 : BLK;
        for (long b = 0; b < cnt; b++) {
            const REAL *restrict x = H + (t0 + b) * K;
            REAL ss = 0;
            for (int i = 0; i < K; i++) ss += x[i] * x[i];
            REAL iv = 1 / SQRT(ss / K + eps);
            inv[t0 + b] = iv;
            REAL *restrict rt = raw + (t0 + b) * J;
            FN(dots)(x, PhiT, K, J, rt);
            for (int j = 0; j < J; j++) a[j * BLK + b] = rt[j] * iv;
        }
        for (int j = 0; j < J; j++) for (long b = cnt; b < BLK; b++) a[j * BLK + b] = 0;
        for (int k = 0; k < nn; k++)
            for (int b = 0; b < BLK; b++) m[k * BLK + b] = gates[2] * a[(2 * n + k) * BLK + b] + b_res[k];
        FN(fwd_block)(m, 0, 0, 0, n, t_max, first, tiny);
        for (long b = 0; b < cnt; b++) {
            long t = t0 + b;
            const REAL *restrict Ht = H + t * K;
            REAL pre[NMAX];
            for (int s = 0; s < n; s++) {
                pre[s] = 1 / (1 + EXP(-(gates[0] * a[s * BLK + b] + b_pre[s])));
                depth[t * n + s] = 2 / (1 + EXP(-(gates[1] * a[(n + s) * BLK + b] + b_post[s])));
            }
            for (int r = 0; r < q; r++) {
                REAL *restrict o = out + (t * q + r) * d;
                for (int i = 0; i < d; i++) o[i] = 0;
                for (int s = 0; s < n; s++) {
                    REAL c = r == 0 ? pre[s] : m[((r - 1) * n + s) * BLK + b];
                    const REAL *restrict h = Ht + s * d;
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
static void FN(mhc_backward_block)(const REAL *restrict H, const REAL *restrict PhiT, const REAL *restrict gates,
                                   const REAL *restrict b_pre, const REAL *restrict b_post, const REAL *restrict b_res,
                                   const REAL *restrict raw, const REAL *restrict inv, const REAL *restrict g_out,
                                   const REAL *restrict g_depth, long t0, long cnt, int n, int d, int t_max,
                                   int first, REAL tiny, REAL *restrict a, REAL *restrict m, REAL *restrict p,
                                   REAL *restrict gm, REAL *restrict pre, REAL *restrict post, REAL *restrict gpre,
                                   REAL *restrict gpost, REAL *restrict ys, REAL *restrict ssv, REAL *restrict gH,
                                   REAL *restrict gPf, double *restrict gg, double *restrict gb) {
    int K = n * d, J = 2 * n + n * n, nn = n * n, q = n + 1, steps = 2 * t_max - 1;
    for (int j = 0; j < J; j++) {
        for (long b = 0; b < cnt; b++) a[j * BLK + b] = raw[(t0 + b) * J + j] * inv[t0 + b];
        for (long b = cnt; b < BLK; b++) a[j * BLK + b] = 0;
    }
    for (int s = 0; s < n; s++)
        for (int b = 0; b < BLK; b++) {
            pre[s * BLK + b] = 1 / (1 + EXP(-(gates[0] * a[s * BLK + b] + b_pre[s])));
            post[s * BLK + b] = 2 / (1 + EXP(-(gates[1] * a[(n + s) * BLK + b] + b_post[s])));
        }
    for (int k = 0; k < nn; k++)
        for (int b = 0; b < BLK; b++) m[k * BLK + b] = gates[2] * a[(2 * n + k) * BLK + b] + b_res[k];
    FN(fwd_block)(m, p, ys, ssv, n, t_max, first, tiny);
    for (int k = 0; k < nn * BLK; k++) gm[k] = 0;
    for (int k = 0; k < n * BLK; k++) gpre[k] = gpost[k] = 0;
    for (long b = 0; b < cnt; b++) {
        long t = t0 + b;
        const REAL *restrict Ht = H + t * K;
        const REAL *restrict gt = g_out + t * q * d;
        for (int s = 0; s < n; s++) {
            const REAL *restrict h = Ht + s * d;
            REAL *restrict gh = gH + t * K + s * d;
            for (int r = 0; r < q; r++) {
                const REAL *restrict gr = gt + r * d;
                REAL c = r == 0 ? pre[s * BLK + b] : m[((r - 1) * n + s) * BLK + b], dot = 0;
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
            FN(back_group)(gm, ys + (long)step * nn * BLK, ssv + ((long)step * n + gr) * BLK, n, dim, gr);
    }
    for (int gr = 0; gr < n; gr++) FN(back_group)(gm, p, 0, n, first, gr);
    /* dz into a's place as da = dz * gate, with the gate and bias sums */
    for (int s = 0; s < n; s++) {
        double sg0 = 0, sb0 = 0, sg1 = 0, sb1 = 0;
        for (long b = 0; b < cnt; b++) {
            REAL hp = pre[s * BLK + b], hq = post[s * BLK + b];
            REAL dz0 = gpre[s * BLK + b] * hp * (1 - hp), dz1 = gpost[s * BLK + b] * hq * (1 - hq * (REAL)0.5);
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
            REAL dz = gm[k * BLK + b];
            sg += (double)dz * a[(2 * n + k) * BLK + b]; sb += dz;
            a[(2 * n + k) * BLK + b] = dz * gates[2];
        }
        gg[2] += sg; gb[2 * n + k] += sb;
    }
    for (long b = 0; b < cnt; b++) {
        long t = t0 + b;
        const REAL *restrict x = H + t * K;
        REAL *restrict gx = gH + t * K;
        REAL iv = inv[t], gi = 0;
        for (int j = 0; j < J; j++) gi += a[j * BLK + b] * raw[t * J + j];
        REAL coef = -gi * iv * iv * iv / K;
        for (int i = 0; i < K; i++) gx[i] += coef * x[i];
        for (int j = 0; j < J; j++) {
            REAL g = a[j * BLK + b] * iv;
            const REAL *restrict ph = PhiT + (long)j * K;
            REAL *restrict gp = gPf + (long)j * K;
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
int FN(mhc_connect_backward)(const REAL *restrict H, const REAL *restrict PhiT, const REAL *restrict gates,
                             const REAL *restrict b_pre, const REAL *restrict b_post, const REAL *restrict b_res,
                             const REAL *restrict raw, const REAL *restrict inv, const REAL *restrict g_out,
                             const REAL *restrict g_depth, long N, int n, int d, int t_max, int first, REAL tiny,
                             REAL *restrict gH, REAL *restrict gPhiT, REAL *restrict g_gates, REAL *restrict g_b_pre,
                             REAL *restrict g_b_post, REAL *restrict g_b_res, int threads) {
    int K = n * d, J = 2 * n + n * n, nn = n * n, steps = 2 * t_max - 1;
    long per_thread = (long)(J + 3 * nn + 4 * n) * BLK + (long)steps * (nn + n) * BLK;
    long nw = (long)J * K + 3 + J, ch = chunk_tokens(N), nch = (N + ch - 1) / ch;
    REAL *bufs = (REAL *)malloc(sizeof(REAL) * per_thread * threads);
    REAL *gPfs = (REAL *)malloc(sizeof(REAL) * (long)J * K * threads);  /* per thread: float partials of gPhiT */
    double *part = (double *)calloc(nch * nw, sizeof(double));  /* per chunk: gPhiT, g_gates, g_b */
    if (!bufs || !gPfs || !part) { free(bufs); free(gPfs); free(part); return 1; }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < nch; c++) {
        REAL *restrict a = bufs + (long)THREAD_ID * per_thread, *restrict m = a + (long)J * BLK;
        REAL *restrict p = m + (long)nn * BLK, *restrict gm = p + (long)nn * BLK;
        REAL *restrict pre = gm + (long)nn * BLK, *restrict post = pre + (long)n * BLK;
        REAL *restrict gpre = post + (long)n * BLK, *restrict gpost = gpre + (long)n * BLK;
        REAL *restrict ys = gpost + (long)n * BLK, *restrict ssv = ys + (long)steps * nn * BLK;
        REAL *restrict gPf = gPfs + (long)THREAD_ID * J * K;
        double *restrict gPd = part + c * nw, *restrict gg = gPd + (long)J * K, *restrict gb = gg + 3;
        long c_end = (c + 1) * ch < N ? (c + 1) * ch : N;
        for (long i = 0; i < (long)J * K; i++) gPf[i] = 0;
        for (long t0 = c * ch; t0 < c_end; t0 += BLK) {
            long cnt = c_end - t0 < BLK ? c_end - t0 : BLK;
            FN(mhc_backward_block)(H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth, t0, cnt, n, d,
                                   t_max, first, tiny, a, m, p, gm, pre, post, gpre, gpost, ys, ssv, gH, gPf, gg, gb);
            for (long i = 0; i < (long)J * K; i++) { gPd[i] += gPf[i]; gPf[i] = 0; }
        }
    }
    for (long c = 1; c < nch; c++)
        for (long i = 0; i < nw; i++) part[i] += part[c * nw + i];
    double *restrict gPd = part, *restrict gg = part + (long)J * K, *restrict gb = gg + 3;
    for (long i = 0; i < (long)J * K; i++) gPhiT[i] = (REAL)gPd[i];
    for (int i = 0; i < 3; i++) g_gates[i] = (REAL)gg[i];
    for (int s = 0; s < n; s++) { g_b_pre[s] = (REAL)gb[s]; g_b_post[s] = (REAL)gb[n + s]; }
    for (int k = 0; k < nn; k++) g_b_res[k] = (REAL)gb[2 * n + k];
    free(bufs); free(gPfs); free(part);
    return 0;
}
