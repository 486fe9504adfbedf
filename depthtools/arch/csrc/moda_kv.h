/* MoDA slot storage: streaming stores, and loads/stores of float32, float64 and bfloat16 slots. */
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
