/* Shared by the connector, bank and moda libraries: limits, OpenMP thread ids, chunking of parameter-gradient
   sums, and branch-free float32 exp and tanh. */
#include <math.h>
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

