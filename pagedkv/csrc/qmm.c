/* Quantised matmuls of the linear layers on the CPU: 4-bit or 8-bit weights times 8-bit
 * activations, with integer dot products (built and called by pagedkv/model/qmm.py).
 *
 * Activations: each row of x (float32) is cut into blocks of 32 values; a block becomes 32
 * int8 codes q = round(x / d), d = max|x| / 127, with d and the exact float sum of the block
 * kept beside them (the Q8 block of GGUF's q8_1, with the float32 sum of the values instead
 * of the codes').
 *
 * Weights (the layouts below, "interleaved"):
 *  - int4 (Q4_1 blocks): w = d_w * c + m, codes c in 0..15, d_w and m fp16 per block of 32.
 *    Per block: sum_k w x ~= d_w d_x sum(c q) + m sum(x).
 *  - int8 (per output channel): w = s_w[o] * c, c in -127..127. Per block: d_x sum(c q); the
 *    column times s_w.
 * The integer block sums are exact: u8 x s8 products added in pairs in int16 (AVX2's
 * vpmaddubsw) stay below 2^15 for these ranges (15 * 127 * 2 for int4; for int8 the sign is
 * moved onto q and |c| <= 127, 127 * 127 * 2), then added in int32 (vpmaddwd); VNNI's
 * vpdpbusd where the compiler targets it. Without AVX2 the same sums run in plain C.
 *
 * Parallel over output columns with OpenMP (the libgomp torch loaded), one thread for small
 * products. Tested against the formats' dequantised weights in tests/model/test_qmm.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32

/* IEEE half -> float (the int4 scales are stored as fp16, like GGUF's Q4_1) */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}
#if defined(__AVX512VL__)
#define ROW_TILE 8 /* 32 vector registers: 8 rows' accumulators */
#else
#define ROW_TILE 4
#endif
/* products below this many multiply-adds run on one thread (a thread start costs ~5-10 us) */
#define PAR_MACS 200000

/* ---- activations ------------------------------------------------------------------------ */

/* One row of k floats (k a multiple of 32) -> q [k] int8, d [k/32], s [k/32]. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
#ifdef __AVX2__
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            sum = _mm256_add_ps(sum, v[j]);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float mx = _mm_cvtss_f32(m4);
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        /* a block of zeros, subnormals or NaN: codes 0 (127 / mx would overflow or be NaN) */
        float dd = mx / 127.0f, id = mx > 1e-30f ? 127.0f / mx : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        __m256i i[4];
        for (int j = 0; j < 4; j++)
            i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT |
                                                                                _MM_FROUND_NO_EXC));
        /* int32 -> int16 -> int8 packs work per 128-bit lane; the permute restores the order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), p);
        d[b] = dd;
        s[b] = _mm_cvtss_f32(s4);
#else
        float mx = 0.0f, sum = 0.0f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(xb[j]);
            mx = a > mx ? a : mx;
            sum += xb[j];
        }
        /* a block of zeros, subnormals or NaN: codes 0 (127 / mx would overflow or be NaN) */
        float dd = mx / 127.0f, id = mx > 1e-30f ? 127.0f / mx : 0.0f;
        for (int j = 0; j < QK; j++) {
            float r = nearbyintf(xb[j] * id);
            q[b * QK + j] = (int8_t)(r >= -127.0f && r <= 127.0f ? r : 0.0f);
        }
        d[b] = dd;
        s[b] = sum;
#endif
    }
}

typedef struct {
    int8_t *q;
    float *d, *s;
    void *mem;
} qrows_t;

static int quantize_rows(const float *x, int64_t xs, int64_t rows, int64_t k, qrows_t *out, int nt) {
    int64_t nb = k / QK;
    out->mem = malloc((size_t)(rows * k + 2 * rows * nb * (int64_t)sizeof(float) + 64));
    if (!out->mem) return -1;
    out->d = (float *)out->mem;
    out->s = out->d + rows * nb;
    out->q = (int8_t *)(out->s + rows * nb);
    #pragma omp parallel for if (rows * k >= 65536) num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) quantize_row(x + r * xs, k, out->q + r * k, out->d + r * nb, out->s + r * nb);
    return 0;
}

/* ---- weights, 8 output columns interleaved ------------------------------------------------
 * int4: per group g of 8 columns and block b, Q4_BLOCK = 160 bytes: 4 steps t of 32 bytes,
 * byte 4i + j of step t holding column 8g + i's element 32b + 8t + j (low nibble) and
 * 32b + 8t + 4 + j (high nibble); then the 8 columns' d, then their m, fp16 (GGUF Q4_1
 * stores them so). One stream a thread reads front to back.
 * int8: per group g and block b, 8 steps t of 32 bytes; byte 4i + j of step t is column
 * 8g + i's element 32b + 4t + j. Scales float32 [N].
 * So one u8 x s8 multiply-add of a weight vector with 4 activation bytes repeated 8 times
 * gives 8 columns' partial sums side by side: no horizontal sums, one scale FMA per block
 * for 8 columns. The int4 pairwise int16 sums of a whole block stay exact (8 x 15 x 127 x 2
 * = 30480 < 2^15). */

#define INLINE static inline __attribute__((always_inline))
#define Q4_BLOCK 160
/* bytes ahead of the block in use that the int4 loop prefetches (4 blocks) */
#define Q4_PREFETCH (4 * Q4_BLOCK)

/* the fp16 d (which 0) or m (which 1) of column i of an int4 group-block */
static inline uint16_t q4_scale(const uint8_t *blk, int which, int i) {
    uint16_t v;
    memcpy(&v, blk + 128 + 16 * which + 2 * i, 2);
    return v;
}

#ifdef __AVX2__
static inline __m256i madd_u8s8(__m256i acc, __m256i a, __m256i b) { /* acc + 4-byte dot sums, int32 */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i bcast4(const int8_t *p) { /* 4 bytes repeated 8 times */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#endif

/* y[r0 + j, 8g .. 8g + 7] for j < NR (a constant at each call: accumulators in registers) */
INLINE void q4_group(const int NR, int64_t nb, const uint8_t *wc, const qrows_t *a, int64_t r0, float *y, int64_t ys,
                     const float *bias) {
    const int8_t *xq = a->q + r0 * nb * QK;
    const float *xd = a->d + r0 * nb, *xs = a->s + r0 * nb;
#ifdef __AVX2__
    __m256 acc[ROW_TILE];
    for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[ROW_TILE];
        for (int j = 0; j < NR; j++) isum[j] = _mm256_setzero_si256();
        const uint8_t *w = wc + b * Q4_BLOCK;
        _mm_prefetch((const char *)(w + Q4_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + Q4_PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + Q4_PREFETCH + 128), _MM_HINT_T0);
        for (int t = 0; t < 4; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * t));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int j = 0; j < NR; j++) {
                const int8_t *x = xq + j * nb * QK + b * QK + 8 * t;
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
                isum[j] = madd_u8s8(madd_u8s8(isum[j], lo, bcast4(x)), hi, bcast4(x + 4));
#else
                isum[j] = _mm256_add_epi16(isum[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x)),
                                                                     _mm256_maddubs_epi16(hi, bcast4(x + 4))));
#endif
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 128)));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 144)));
        for (int j = 0; j < NR; j++) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
            __m256 p = _mm256_cvtepi32_ps(isum[j]);
#else
            __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[j], _mm256_set1_epi16(1)));
#endif
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(xd + j * nb + b)), p, acc[j]);
            acc[j] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + j * nb + b), acc[j]);
        }
    }
    __m256 bv = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    for (int j = 0; j < NR; j++) _mm256_storeu_ps(y + (r0 + j) * ys, _mm256_add_ps(acc[j], bv));
#else
    for (int j = 0; j < NR; j++) {
        float acc[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int32_t isum[8] = {0};
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < 8; i++)
                    for (int e = 0; e < 4; e++) {
                        uint8_t c = wc[b * Q4_BLOCK + 32 * t + 4 * i + e];
                        const int8_t *x = xq + j * nb * QK + b * QK + 8 * t;
                        isum[i] += (c & 15) * x[e] + (c >> 4) * x[4 + e];
                    }
            for (int i = 0; i < 8; i++)
                acc[i] += half_to_float(q4_scale(wc + b * Q4_BLOCK, 0, i)) * xd[j * nb + b] * (float)isum[i] +
                          half_to_float(q4_scale(wc + b * Q4_BLOCK, 1, i)) * xs[j * nb + b];
        }
        for (int i = 0; i < 8; i++) y[(r0 + j) * ys + i] = acc[i] + (bias ? bias[i] : 0.0f);
    }
#endif
}

INLINE void q8_group(const int NR, int64_t nb, const int8_t *wc, const float *scale, const qrows_t *a, int64_t r0,
                     float *y, int64_t ys, const float *bias) {
    const int8_t *xq = a->q + r0 * nb * QK;
    const float *xd = a->d + r0 * nb;
#ifdef __AVX2__
    __m256 acc[ROW_TILE];
    for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[ROW_TILE];
        for (int j = 0; j < NR; j++) isum[j] = _mm256_setzero_si256();
        const int8_t *w = wc + b * 256;
        for (int t = 0; t < 8; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * t));
            __m256i av = _mm256_sign_epi8(v, v); /* |w| as u8; w's sign moves onto x */
            for (int j = 0; j < NR; j++)
                isum[j] = madd_u8s8(isum[j], av, _mm256_sign_epi8(bcast4(xq + j * nb * QK + b * QK + 4 * t), v));
        }
        for (int j = 0; j < NR; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xd + j * nb + b), _mm256_cvtepi32_ps(isum[j]), acc[j]);
    }
    __m256 sv = _mm256_loadu_ps(scale), bv = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    for (int j = 0; j < NR; j++) _mm256_storeu_ps(y + (r0 + j) * ys, _mm256_fmadd_ps(acc[j], sv, bv));
#else
    for (int j = 0; j < NR; j++) {
        float acc[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int32_t isum[8] = {0};
            for (int t = 0; t < 8; t++)
                for (int i = 0; i < 8; i++)
                    for (int e = 0; e < 4; e++)
                        isum[i] += wc[b * 256 + 32 * t + 4 * i + e] * xq[j * nb * QK + b * QK + 4 * t + e];
            for (int i = 0; i < 8; i++) acc[i] += xd[j * nb + b] * (float)isum[i];
        }
        for (int i = 0; i < 8; i++) y[(r0 + j) * ys + i] = acc[i] * scale[i] + (bias ? bias[i] : 0.0f);
    }
#endif
}

/* calls F(NR, ...) with NR the constant min(nr, ROW_TILE) */
#define BY_TILE(nr, F, ...) do { switch (nr) { \
    case 1: F(1, __VA_ARGS__); break; case 2: F(2, __VA_ARGS__); break; \
    case 3: F(3, __VA_ARGS__); break; case 4: F(4, __VA_ARGS__); break; \
    case 5: F(5 < ROW_TILE ? 5 : ROW_TILE, __VA_ARGS__); break; case 6: F(6 < ROW_TILE ? 6 : ROW_TILE, __VA_ARGS__); break; \
    case 7: F(7 < ROW_TILE ? 7 : ROW_TILE, __VA_ARGS__); break; default: F(ROW_TILE, __VA_ARGS__); } } while (0)

/* ---- entry points --------------------------------------------------------------------------- */

/* One layer's packed weights (built once by qmm.py): fmt 4 = int4 (n / 8 * k / 32 blocks of
 * Q4_BLOCK bytes, codes then fp16 d and m), fmt 8 = int8 (codes n * k bytes in the int8
 * layout, scale float32 [n]); bias float32 [n] or NULL. k a multiple of 32, n of 8. */
typedef struct {
    int64_t n, k;
    int32_t fmt;
    const void *codes;
    const float *scale, *bias;
} qweights_t;

/* y [rows, n] (row stride n) = x [rows, k] (row stride xs, float32) times w, + bias, on
 * nthreads OpenMP threads (torch's count, passed in: a thread that never set it would get
 * OMP_NUM_THREADS or every core). Returns 0, -1 when out of memory, -2 for an unknown format. */
int pagedkv_qmm(const qweights_t *w, int64_t rows, const float *x, int64_t xs, float *y, int nthreads) {
    if (w->fmt != 4 && w->fmt != 8) return -2;
    const int nt = nthreads > 0 ? nthreads : 1;
    qrows_t a;
    if (quantize_rows(x, xs, rows, w->k, &a, nt)) return -1;
    int64_t nb = w->k / QK, n = w->n;
    #pragma omp parallel for if (rows * n * w->k >= PAR_MACS) num_threads(nt) schedule(static)
    for (int64_t g = 0; g < n / 8; g++) {
        const float *bias = w->bias ? w->bias + 8 * g : NULL;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            if (w->fmt == 4)
                BY_TILE(rows - r0, q4_group, nb, (const uint8_t *)w->codes + g * nb * Q4_BLOCK, &a, r0, y + 8 * g,
                        n, bias);
            else
                BY_TILE(rows - r0, q8_group, nb, (const int8_t *)w->codes + g * nb * 256, w->scale + 8 * g, &a, r0,
                        y + 8 * g, n, bias);
        }
    }
    free(a.mem);
    return 0;
}

/* The interleaved int4 weights as float32 out [n, k] (w = d c + m): what tests compare the
 * packing with. */
void pagedkv_q4_dequant(int64_t k, int64_t n, const uint8_t *codes, float *out) {
    int64_t nb = k / QK;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *c = codes + (g * nb + b) * Q4_BLOCK;
            float dd[8], mm[8];
            for (int i = 0; i < 8; i++) {
                dd[i] = half_to_float(q4_scale(c, 0, i));
                mm[i] = half_to_float(q4_scale(c, 1, i));
            }
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < 8; i++)
                    for (int e = 0; e < 4; e++) {
                        uint8_t v = c[32 * t + 4 * i + e];
                        float *w = out + (8 * g + i) * k + b * QK + 8 * t + e;
                        w[0] = dd[i] * (float)(v & 15) + mm[i];
                        w[4] = dd[i] * (float)(v >> 4) + mm[i];
                    }
        }
}

/* The interleaved int8 weights as float32 out [n, k] = c * scale[column]. */
void pagedkv_q8_dequant(int64_t k, int64_t n, const int8_t *codes, const float *scale, float *out) {
    int64_t nb = k / QK;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / 8; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int t = 0; t < 8; t++)
                for (int i = 0; i < 8; i++)
                    for (int e = 0; e < 4; e++)
                        out[(8 * g + i) * k + b * QK + 4 * t + e] =
                            scale[8 * g + i] * (float)codes[(g * nb + b) * 256 + 32 * t + 4 * i + e];
}

/* Which integer dot product this build uses (for logs and benchmark records). */
const char *pagedkv_qmm_isa(void) {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
    return "avx-vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}
