/* The per-row sums behind a head's metrics, in two passes over each row of float32 logits (library "rowmetrics":
   depthtools/analysis/headmetrics.py, `fused_metrics`).

   Why (issues 45 and 47; figures in benchmarks/RESULTS.md, "Fused row metrics"): at a 49k vocabulary the lens and
   every sweep plan spend ~75% of a head evaluation in elementwise torch passes over [rows, V] (log-softmax, exp,
   the KL products and differences, top-k, the rank comparison), each a full read and write of 200 MB. Here each
   row is read twice while it sits in L2: pass 1 finds its maximum m, the block maxima (for the top ids), how many
   logits exceed the target's and the nearest logit above it; pass 2 sums, with e = exp(z - m):

       S0 = sum e      S1 = sum e (z - m)      S2 = sum e log p_ref      S3 = sum p_ref (z - m)
       S4 = sum p_ref log p_ref      S5 = sum p_ref   (the reference's own sums, on the arrays read)

   in float32 within blocks of 256 columns (vectorised; a fixed order) and in float64 across blocks. From them
   (headmetrics): lse = m + log S0, entropy = log S0 - S1/S0, KL(p_ref || p) = sum p_ref log p_ref - S3 +
   log S0 sum p_ref (= S4 - S3 + S5 log S0), KL(p || p_ref) = S1/S0 - log S0 - S2/S0.

   The top k+1 logits (k <= TOPMAX - 1) come from the k+1 blocks of 128 with the largest maxima (each of the k+1
   largest lies in one of them), in ascending id order within equal values. The caller re-derives, with torch's
   own log-softmax, every row where the float32 log-softmax could order or count otherwise (near ties) and every
   row with a non-finite logit: those rows' numbers are then the torch path's. Built with -ffinite-math-only (so
   that the max and min reductions vectorise): no NaN test here; a NaN or infinite logit makes S1 (e (z - m) with
   e > 0) or the maximum non-finite, which is what the caller tests. exp is common.h's branch-free exp_f32. Rows
   are split over `threads` OpenMP threads; each row's sums are independent of that. */
#include "common.h"
#include <float.h>
#include <stdlib.h>

#define SUM_BLOCK 256
#define TOP_BLOCK 128
#define TOPMAX 9

/* The k largest of z[lo..hi) merged into vals/ids (sorted, largest first; equal values keep the smaller id first). */
static void top_insert(const float *z, long lo, long hi, long k, float *vals, long *ids) {
    for (long v = lo; v < hi; ++v) {
        float x = z[v];
        if (!(x > vals[k - 1]) && !(x == vals[k - 1] && v < ids[k - 1]))
            continue;
        long j = k - 1;
        while (j > 0 && (x > vals[j - 1] || (x == vals[j - 1] && v < ids[j - 1]))) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            --j;
        }
        vals[j] = x;
        ids[j] = v;
    }
}

/* Pass 1 over one row: the maximum (returned), the block maxima, #{z > zt} and min (z - zt) over z > zt (FLT_MAX
   when none). Equal logits share a log-prob and count as neither, so only z > zt can tie with the target. */
static float scan_row(const float *z, long V, long t, float *block_max, long *above, float *gap) {
    float zt = z[t], m = -FLT_MAX, g = FLT_MAX;
    long n_above = 0;
    for (long b = 0; b < V; b += TOP_BLOCK) {
        long hi = b + TOP_BLOCK < V ? b + TOP_BLOCK : V;
        float bm = -FLT_MAX, bg = FLT_MAX;
        int na = 0;
        for (long v = b; v < hi; ++v) {
            float x = z[v], d = x - zt;
            bm = x > bm ? x : bm;
            na += x > zt;
            d = d > 0.0f ? d : FLT_MAX;
            bg = d < bg ? d : bg;
        }
        block_max[b / TOP_BLOCK] = bm;
        m = bm > m ? bm : m;
        g = bg < g ? bg : g;
        n_above += na;
    }
    *above = n_above;
    *gap = g;
    return m;
}

/* The k largest logits of the row (ids ascending among equal values), from the k best blocks. */
static void top_of_row(const float *z, long V, const float *block_max, long k, float *vals, long *ids) {
    long nb = (V + TOP_BLOCK - 1) / TOP_BLOCK, best[TOPMAX];
    float best_v[TOPMAX];
    for (long j = 0; j < k; ++j) {
        best[j] = -1;
        best_v[j] = -INFINITY;
        vals[j] = -INFINITY;
        ids[j] = V;
    }
    for (long b = 0; b < nb; ++b) {  /* the k blocks with the largest maxima (the first block among equal maxima) */
        float x = block_max[b];
        if (!(x > best_v[k - 1]) && best[k - 1] >= 0)
            continue;
        long j = k - 1;
        while (j > 0 && (x > best_v[j - 1] || best[j - 1] < 0)) {
            best_v[j] = best_v[j - 1];
            best[j] = best[j - 1];
            --j;
        }
        best_v[j] = x;
        best[j] = b;
    }
    for (long j = 0; j < k; ++j) {
        if (best[j] < 0)
            continue;
        long lo = best[j] * TOP_BLOCK, hi = lo + TOP_BLOCK < V ? lo + TOP_BLOCK : V;
        top_insert(z, lo, hi, k, vals, ids);
    }
}

/* Pass 2 over one row: S0, S1, and S2..S5 with a reference (ref_p and ref_logp). */
static void sum_row(const float *z, long V, float m, const float *ref_logp, const float *ref_p, double *sums) {
    double S[6] = {0, 0, 0, 0, 0, 0};
    for (long b = 0; b < V; b += SUM_BLOCK) {
        long hi = b + SUM_BLOCK < V ? b + SUM_BLOCK : V;
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0;
        if (ref_logp) {
            for (long v = b; v < hi; ++v) {
                float d = z[v] - m, e = exp_f32(d), pr = ref_p[v], lr = ref_logp[v];
                s0 += e;
                s1 += e * d;
                s2 += e * lr;
                s3 += pr * d;
                s4 += pr * lr;
                s5 += pr;
            }
        } else {
            for (long v = b; v < hi; ++v) {
                float d = z[v] - m, e = exp_f32(d);
                s0 += e;
                s1 += e * d;
            }
        }
        S[0] += s0;
        S[1] += s1;
        S[2] += s2;
        S[3] += s3;
        S[4] += s4;
        S[5] += s5;
    }
    for (int j = 0; j < 6; ++j)
        sums[j] = S[j];
}

/* Rows r = g * rows_per_group + i (i < rows_per_group) at z + g * group_stride + i * row_stride, each V logits;
   targets, ref_p and ref_logp (both NULL: no reference) -- rows of V, contiguous -- and the
   outputs are indexed by r. Outputs: row_max [n], target_z [n], sums [n, 6] (S0..S5), top_vals / top_ids [n, k],
   above [n], gap [n].
   Returns 0, or 1 when k is out of range or memory runs out. */
int row_metrics(const float *z, long n_rows, long rows_per_group, long group_stride, long row_stride, long V,
                const long *targets, const float *ref_logp, const float *ref_p, long k, int threads,
                float *row_max, float *target_z, double *sums, float *top_vals, long *top_ids, long *above, float *gap) {
    if (k < 1 || k > TOPMAX)
        return 1;
    long nb = (V + TOP_BLOCK - 1) / TOP_BLOCK;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *block_max = malloc(sizeof(float) * nb);
        if (!block_max) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long r = 0; r < n_rows; ++r) {
            if (!block_max)
                continue;
            const float *row = z + (r / rows_per_group) * group_stride + (r % rows_per_group) * row_stride;
            float m = scan_row(row, V, targets[r], block_max, above + r, gap + r);
            row_max[r] = m;
            target_z[r] = row[targets[r]];
            top_of_row(row, V, block_max, k, top_vals + r * k, top_ids + r * k);
            sum_row(row, V, m, ref_logp && ref_p ? ref_logp + r * V : NULL, ref_logp && ref_p ? ref_p + r * V : NULL,
                    sums + 6 * r);
        }
        free(block_max);
    }
    return failed;
}

/* out[r] = #{v : lp[r, v] > lp[r, targets[r]]} over rows of V contiguous log-probs: the rank count of the rows
   whose log-probs the caller took from torch's own log-softmax (near ties), without a [rows, V] boolean. */
void count_greater(const float *lp, long n_rows, long V, const long *targets, int threads, long *out) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < n_rows; ++r) {
        const float *row = lp + r * V;
        float t = row[targets[r]];
        long count = 0;
        for (long v = 0; v < V; ++v)
            count += row[v] > t;
        out[r] = count;
    }
}
