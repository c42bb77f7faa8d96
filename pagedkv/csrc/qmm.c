/* Quantised matmuls of the linear layers on the CPU: 4-bit or 8-bit weights times 8-bit
 * activations, with integer dot products (built and called by pagedkv/ops/qmm.py).
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
 *  - GGUF Q8_0, Q4_K, Q5_K, Q6_K blocks as the file stores them, only reordered per 8 columns
 *    (section "GGUF blocks as stored"; pagedkv_pack_gguf builds them, and puts Q4_0 / Q4_1
 *    into the int4 layout); sub-block scales decoded in the kernel. MXFP4 likewise (section
 *    "MXFP4 as stored": 4-bit codes looked up as int8 values, e8m0 scales).
 *  - concat (fmt 1): parts of the above side by side, the activations quantised once.
 * The integer block sums are exact: u8 x s8 products added in pairs in int16 (AVX2's
 * vpmaddubsw) stay below 2^15 for these ranges (15 * 127 * 2 for int4; for int8 the sign is
 * moved onto q and |c| <= 127, 127 * 127 * 2), then added in int32 (vpmaddwd); VNNI's
 * vpdpbusd where the compiler targets it. Without AVX2 the same sums run in plain C.
 *
 * Parallel over output columns with OpenMP (the libgomp torch loaded), one thread for small
 * products. Tested against the formats' dequantised weights in tests/model/test_qmm.py.
 */
#if defined(__linux__) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE /* madvise */
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <sys/mman.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32
/* PIN(v): an empty asm on an int16 accumulator chain (x86 vector registers), so GCC adds the
 * steps in order: it otherwise reassociates a tile's adds into a tree over all its products,
 * which keeps them all live and spills (measured on Zen 3: 1.1-1.3x at 4-15 rows). One row
 * has registers to spare, and keeps the compiler's order. */
#if defined(__AVX2__) && !defined(QMM_NO_PIN)
#define PIN(v) do { if (NR > 1) __asm__("" : "+x"(v)); } while (0)
#else
#define PIN(v) (void)0
#endif

/* IEEE half -> float (the int4 scales are stored as fp16, like GGUF's Q4_1) */
static inline float half_to_float(uint16_t h) {
#if defined(__AVX2__) && defined(__F16C__) /* immintrin.h is included with AVX2 */
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
#define TILE_NR 8  /* rows per register tile of the column-tile kernels (run_tiles) */
#else
#define TILE_NR 4
#define ROW_TILE 5 /* 16 registers: 5 rows' accumulators still fit (4: a 5-row verify step decoded
                    * its weights twice; 5 measured 1.10-1.25x there, docs/performance.md) */
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
        s[b] = _mm_cvtss_f32(s4);
        d[b] = s[b] == s[b] && mx <= FLT_MAX ? dd : NAN; /* a NaN or inf in the block: the outputs it feeds are NaN */
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
        d[b] = sum == sum && mx <= FLT_MAX ? dd : NAN; /* as above: a NaN or inf makes the outputs it feeds NaN */
        s[b] = sum;
#endif
    }
}

typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *q16; /* the sums of each 16 codes [rows, k / 16] (NULL unless a kernel takes them: see pagedkv_qmm) */
    int32_t *o8;  /* 8 x the sums of each 32 codes [rows, k / 32] (with q16): the column tiles' Q4_0 offset */
    uint8_t *xu;  /* the codes + 128 as u8 [rows, k] (NULL unless asked: AVX2's Q6_K column tiles) */
    uint16_t *xb; /* the values rounded to bf16 [rows, k] (NULL unless bf16 weights take them) */
    const float *xf; /* the activations as given (row r at xf + r * xs): what f16 weights take */
    int64_t xs;
    void *mem;
} qrows_t;

static inline uint16_t to_bf16(float f);

/* want: 1 the int8 blocks (and what sums16 / want_xu ask), 2 the bf16 values, 3 both */
static int quantize_rows(const float *x, int64_t xs, int64_t rows, int64_t k, qrows_t *out, int nt, int sums16,
                         int want_xu, int want) {
    int64_t nb = k / QK;
    const int64_t qbytes = rows * k + 2 * rows * nb * (int64_t)sizeof(float) +
                           (sums16 ? rows * (k / 16 + k / 32) * (int64_t)sizeof(int32_t) : 0) + (want_xu ? rows * k : 0);
    out->mem = malloc((size_t)((want & 1 ? qbytes : 0) + (want & 2 ? 2 * rows * k + 64 : 0) + 64));
    if (!out->mem) return -1;
    out->xf = x;
    out->xs = xs;
    out->xb = NULL;
    if (want & 2) { /* after the int8 blocks, 64-byte aligned */
        uintptr_t at = (uintptr_t)out->mem + (want & 1 ? (uintptr_t)qbytes : 0);
        out->xb = (uint16_t *)((at + 63) & ~(uintptr_t)63);
        #pragma omp parallel for if (rows * k >= 65536) num_threads(nt) schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t e = 0; e < k; e++) out->xb[r * k + e] = to_bf16(x[r * xs + e]);
    }
    if (!(want & 1)) {
        out->d = out->s = NULL;
        out->q = NULL;
        out->q16 = out->o8 = NULL;
        out->xu = NULL;
        return 0;
    }
    out->d = (float *)out->mem;
    out->s = out->d + rows * nb;
    out->q = (int8_t *)(out->s + rows * nb);
    out->q16 = sums16 ? (int32_t *)(out->q + rows * k) : NULL; /* rows * k is a multiple of 32 */
    out->o8 = sums16 ? out->q16 + rows * (k / 16) : NULL;
    out->xu = !want_xu ? NULL : sums16 ? (uint8_t *)(out->o8 + rows * nb) : (uint8_t *)(out->q + rows * k);
    #pragma omp parallel for if (rows * k >= 65536) num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        quantize_row(x + r * xs, k, out->q + r * k, out->d + r * nb, out->s + r * nb);
        if (sums16)
            for (int64_t h = 0; h < k / 16; h++) {
                int32_t sum = 0;
                for (int e = 0; e < 16; e++) sum += out->q[r * k + 16 * h + e];
                out->q16[r * (k / 16) + h] = sum;
            }
        if (sums16)
            for (int64_t b = 0; b < nb; b++)
                out->o8[r * nb + b] = 8 * (out->q16[r * (k / 16) + 2 * b] + out->q16[r * (k / 16) + 2 * b + 1]);
        if (want_xu)
            for (int64_t e = 0; e < k; e++) out->xu[r * k + e] = (uint8_t)(out->q[r * k + e] ^ 0x80);
    }
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
/* Software prefetch distances, in blocks of each layout: 8-14 KB ahead of the read, into L2
 * (T1: a prefetch into L1 holds one of its few miss buffers; L2 has more, so more lines are in
 * flight). Measured (one thread, CPU time per 2048 x 8192 call over 16 weights, AMD EPYC Zen 4,
 * against 0.5-1 KB ahead into L1): Q4_1 1.38x, Q5_1 1.24x, Q4_K/Q5_K 1.41x, Q6_K 1.15x, Q4_0/Q5_0
 * 1.04-1.07x (they are compute-bound at ~43 G weights/s a core). Q8_0 keeps 4 KB into L1
 * (1.02x; into L2 it measured 0.85-0.94x). */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifndef PF_Q4
#define PF_Q4 64
#endif
#define Q4_PREFETCH (PF_Q4 * Q4_BLOCK)

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

/* rows r0 .. r0 + NR - 1 of y, 8 columns: the tile's accumulators plus the bias (or none) */
static inline __attribute__((always_inline)) void store_tile(const int NR, const __m256 *acc, float *y, int64_t r0,
                                                             int64_t ys, const float *bias) {
    __m256 bv = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    for (int j = 0; j < NR; j++) _mm256_storeu_ps(y + (r0 + j) * ys, _mm256_add_ps(acc[j], bv));
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
        _mm_prefetch((const char *)(w + Q4_PREFETCH), PF_HINT);
        _mm_prefetch((const char *)(w + Q4_PREFETCH + 64), PF_HINT);
        _mm_prefetch((const char *)(w + Q4_PREFETCH + 128), PF_HINT);
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
                PIN(isum[j]);
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
    store_tile(NR, acc, y, r0, ys, bias);
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

/* ---- GGUF blocks as stored: Q8_0, Q4_K, Q5_K, Q6_K ------------------------------------------
 * Packed per group g of 8 columns and stored block b (32 values for Q8_0, a 256-value
 * super-block for the K-quants): the 8 columns' file blocks, their bytes moved but none added,
 * dropped or widened (so 8 x the file's block size; pagedkv_pack_gguf builds them):
 *  - Q8_0, Q80_BLOCK = 8 x 34 bytes: the 8 columns' codes in the int8 layout (8 steps t of 32
 *    bytes, byte 4i + j of step t = column i's element 4t + j), then their fp16 d. w = d c,
 *    c in -128..127 (-128 too: the sign trick's |c| = 128 is its unsigned byte).
 *  - Q4_K, Q4K_BLOCK = 8 x 144: for each of the 8 sub-blocks s of 32 values, 128 bytes of
 *    4-bit codes in the int4 layout (step t, byte 4i + j: element 32s + 8t + j low nibble,
 *    32s + 8t + 4 + j high); then the 12 packed 6-bit scale/min bytes of each column
 *    "transposed" (byte 8q + i = column i's scale byte q, so each of the 12 byte positions
 *    of the file is one 8-column vector and the 6-bit values decode 8 columns at once); then
 *    the 8 fp16 d, then the 8 fp16 dmin. w = d sc_s c - dmin m_s, c in 0..15.
 *  - Q5_K, Q5K_BLOCK = 8 x 176: Q4_K's low nibbles, then per sub-block s 32 bytes of high bits
 *    (byte 4i + j: bit 2t = element 32s + 8t + j, bit 2t + 1 = 32s + 8t + 4 + j), then the
 *    transposed scale bytes, d, dmin. c in 0..31.
 *  - Q6_K, Q6K_BLOCK = 8 x 210: the low nibbles as Q4_K; then per sub-block s 64 bytes of
 *    the codes' upper 2 bits (32 bytes for steps 0-1, 32 for steps 2-3; byte 4i + j, bits
 *    4(t % 2) .. +1 = element 32s + 8t + j, bits 4(t % 2) + 2 .. +3 = element 32s + 8t + 4 + j);
 *    then the 16 int8 scales per column transposed (byte 8q + i = column i's scale q, one per
 *    16 values); then the 8 fp16 d. w = d sc_q (c - 32), c - 32 in -32..31.
 * The scales are decoded from these bytes inside the kernel, per super-block and 8 columns
 * at once; per 32 activation values (one block of the activations' own scale d_x) a row adds
 *   Q8_0: d_w d_x sum(c q);  Q4_K/Q5_K: d sc_s d_x sum(c q) - dmin m_s sum(x);
 *   Q6_K: d d_x (sc_2s sum_lo16((c-32) q) + sc_2s+1 sum_hi16((c-32) q))
 * with the integer sums exact: AVX2 pairwise int16 sums stay below 2^15 (Q4_K 16 x 15 x 127
 * per sub-block as int4; Q5_K 8 x 31 x 127, widened every 2 steps; Q8_0 and Q6_K signed codes
 * with the sign moved onto q, 2 x 128 x 127 per pair and 8 x 32 x 127 per 16 values), VNNI's
 * vpdpbusd (int32) where built; there Q6_K multiplies its unsigned codes c (0..63, no sign
 * work per row) and takes 32 x the activation codes' sum of each 16 (computed once per call)
 * off: the same integer. */

#define QK_K 256
#ifndef PF_Q80
#define PF_Q80 16
#endif
#ifndef PF_K
#define PF_K 8
#endif
#ifndef PF_Q6K
#define PF_Q6K 6
#endif
#define Q80_BLOCK 272
#define Q4K_BLOCK 1152
#define Q5K_BLOCK 1408
#define Q6K_BLOCK 1680
#define Q4K_SC 1024 /* offsets inside a group-block */
#define Q5K_QH 1024
#define Q5K_SC 1280
#define Q6K_QH 1024
#define Q6K_SC 1536
#define Q6K_D 1664

#if defined(__AVX2__) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define QMM_VNNI 1
#else
#define QMM_VNNI 0
#endif
/* the column tiles (run_tiles): every AVX2 build; -DQMM_NO_TILES keeps the group kernels (A/B runs) */
#if defined(__AVX2__) && !defined(QMM_NO_TILES)
#define QMM_TILES 1
#else
#define QMM_TILES 0
#endif

/* sc[s] and m[s] (s < 8) of one column from its 12 transposed scale bytes (stride 8), as
 * ggml's get_scale_min_k4 */
static inline void k4_scale_min(const uint8_t *q, int i, int s, int *sc, int *m) {
#define QB(j) q[8 * (j) + i]
    if (s < 4) {
        *sc = QB(s) & 63;
        *m = QB(s + 4) & 63;
    } else {
        *sc = (QB(s + 4) & 0x0F) | ((QB(s - 4) >> 6) << 4);
        *m = (QB(s + 4) >> 4) | ((QB(s) >> 6) << 4);
    }
#undef QB
}

#ifdef __AVX2__
static inline __m256i shift16(__m256i v, int n) { /* v << n (n >= 0) or v >> -n, per 16-bit lane */
    return n >= 0 ? _mm256_slli_epi16(v, n) : _mm256_srli_epi16(v, -n);
}
/* 8 bytes as 8 float lanes (unsigned or signed) */
/* the 6-bit scales and mins of 8 columns x 8 sub-blocks from the transposed scale bytes q
 * (Q4_K / Q5_K): sc[8s + i], mn[8s + i] = column i's sub-block s */
static inline void k4_scales(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    const __m256i low = _mm256_set1_epi8(0x0F), m63 = _mm256_set1_epi8(0x3F), m30 = _mm256_set1_epi8(0x30);
    const __m256i A = _mm256_loadu_si256((const __m256i *)q), B = _mm256_loadu_si256((const __m256i *)(q + 32)),
                  C = _mm256_loadu_si256((const __m256i *)(q + 64));
    _mm256_store_si256((__m256i *)sc, _mm256_and_si256(A, m63));
    _mm256_store_si256((__m256i *)(sc + 32), _mm256_or_si256(_mm256_and_si256(C, low),
                                                             _mm256_and_si256(_mm256_srli_epi16(A, 2), m30)));
    _mm256_store_si256((__m256i *)mn, _mm256_and_si256(B, m63));
    _mm256_store_si256((__m256i *)(mn + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(C, 4), low),
                                                             _mm256_and_si256(_mm256_srli_epi16(B, 2), m30)));
}
static inline __m256 u8x8_ps(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline __m256i i8x8_epi32(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#endif

INLINE void q80_group(const int NR, int64_t nb, const uint8_t *wc, const qrows_t *a, int64_t r0, float *y, int64_t ys,
                      const float *bias) {
    const int8_t *xq = a->q + r0 * nb * QK;
    const float *xd = a->d + r0 * nb;
#ifdef __AVX2__
    __m256 acc[ROW_TILE];
    for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[ROW_TILE], isum2[ROW_TILE]; /* isum2: odd steps' chain when NR <= 4 */
        for (int j = 0; j < NR; j++) isum[j] = isum2[j] = _mm256_setzero_si256();
        const uint8_t *w = wc + b * Q80_BLOCK;
        _mm_prefetch((const char *)(w + PF_Q80 * Q80_BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PF_Q80 * Q80_BLOCK + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PF_Q80 * Q80_BLOCK + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PF_Q80 * Q80_BLOCK + 192), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PF_Q80 * Q80_BLOCK + 256), _MM_HINT_T0);
        for (int t = 0; t < 8; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * t));
            __m256i av = _mm256_sign_epi8(v, v); /* |c| as u8 (-128 -> 128); c's sign moves onto q */
            for (int j = 0; j < NR; j++) {
                __m256i xv = _mm256_sign_epi8(bcast4(xq + j * nb * QK + b * QK + 4 * t), v);
                if (NR <= 4 && (t & 1)) /* few rows: two shorter dependency chains */
                    isum2[j] = madd_u8s8(isum2[j], av, xv);
                else
                    isum[j] = madd_u8s8(isum[j], av, xv);
            }
        }
        if (NR <= 4)
            for (int j = 0; j < NR; j++) isum[j] = _mm256_add_epi32(isum[j], isum2[j]);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 256)));
        for (int j = 0; j < NR; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(xd + j * nb + b)), _mm256_cvtepi32_ps(isum[j]),
                                     acc[j]);
    }
    store_tile(NR, acc, y, r0, ys, bias);
#else
    for (int j = 0; j < NR; j++) {
        float acc[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = wc + b * Q80_BLOCK;
            int32_t isum[8] = {0};
            for (int t = 0; t < 8; t++)
                for (int i = 0; i < 8; i++)
                    for (int e = 0; e < 4; e++)
                        isum[i] += (int8_t)w[32 * t + 4 * i + e] * xq[j * nb * QK + b * QK + 4 * t + e];
            for (int i = 0; i < 8; i++) {
                uint16_t h;
                memcpy(&h, w + 256 + 2 * i, 2);
                acc[i] += half_to_float(h) * xd[j * nb + b] * (float)isum[i];
            }
        }
        for (int i = 0; i < 8; i++) y[(r0 + j) * ys + i] = acc[i] + (bias ? bias[i] : 0.0f);
    }
#endif
}

/* Q4_K (FIVE 0) and Q5_K (FIVE 1): nsb super-blocks per column */
INLINE void q45k_group(const int NR, const int FIVE, int64_t nsb, const uint8_t *wc, const qrows_t *a, int64_t r0,
                       float *y, int64_t ys, const float *bias) {
    const int64_t nb = nsb * (QK_K / QK);
    const int BLK = FIVE ? Q5K_BLOCK : Q4K_BLOCK, SC = FIVE ? Q5K_SC : Q4K_SC;
    const int8_t *xq = a->q + r0 * nb * QK;
    const float *xd = a->d + r0 * nb, *xs = a->s + r0 * nb;
#ifdef __AVX2__
    __m256 acc[ROW_TILE];
    for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *w = wc + sb * BLK;
        uint8_t sc[64] __attribute__((aligned(32))), mn[64] __attribute__((aligned(32)));
        k4_scales(w + SC, sc, mn);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + SC + 96)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + SC + 112)));
        for (int s = 0; s < QK_K / QK; s++) {
            const uint8_t *c = w + 128 * s;
            /* the next super-block, BLK / 8 bytes per sub-block */
            for (int p = 0; p < BLK / 8; p += 64) _mm_prefetch((const char *)(w + PF_K * BLK + BLK / 8 * s + p), PF_HINT);
            const int64_t xb = sb * (QK_K / QK) + s;
            __m256i isum[ROW_TILE];
            for (int j = 0; j < NR; j++) isum[j] = _mm256_setzero_si256();
#if QMM_VNNI
            __m256i isum2[ROW_TILE]; /* the high nibbles' chain: two short dependency chains */
            for (int j = 0; j < NR; j++) isum2[j] = _mm256_setzero_si256();
#else
            __m256i i16[ROW_TILE];
            for (int j = 0; j < NR; j++) i16[j] = _mm256_setzero_si256();
#endif
            __m256i H = FIVE ? _mm256_loadu_si256((const __m256i *)(w + Q5K_QH + 32 * s)) : _mm256_setzero_si256();
            #pragma GCC unroll 4 /* constant shift counts */
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * t));
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (FIVE) {
                    lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(H, 4 - 2 * t), bit4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(H, 3 - 2 * t), bit4));
                }
                for (int j = 0; j < NR; j++) {
                    const int8_t *x = xq + j * nb * QK + xb * QK + 8 * t;
#if QMM_VNNI
                    if (NR <= 4) { /* few rows: two chains of 4 vpdpbusd (latency); more rows have enough */
                        isum[j] = madd_u8s8(isum[j], lo, bcast4(x));
                        isum2[j] = madd_u8s8(isum2[j], hi, bcast4(x + 4));
                    } else {
                        isum[j] = madd_u8s8(madd_u8s8(isum[j], lo, bcast4(x)), hi, bcast4(x + 4));
                    }
#else
                    i16[j] = _mm256_add_epi16(i16[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x)),
                                                                       _mm256_maddubs_epi16(hi, bcast4(x + 4))));
                    PIN(i16[j]);
                    if (!FIVE ? t == 3 : (t & 1)) { /* 5-bit codes: widen every 2 steps (8 x 31 x 127 < 2^15) */
                        isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(i16[j], _mm256_set1_epi16(1)));
                        i16[j] = _mm256_setzero_si256();
                    }
#endif
                }
            }
            const __m256 dsc = _mm256_mul_ps(d, u8x8_ps(sc + 8 * s)), dmn = _mm256_mul_ps(dmin, u8x8_ps(mn + 8 * s));
#if QMM_VNNI
            if (NR <= 4)
                for (int j = 0; j < NR; j++) isum[j] = _mm256_add_epi32(isum[j], isum2[j]);
#endif
            for (int j = 0; j < NR; j++) {
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dsc, _mm256_broadcast_ss(xd + j * nb + xb)),
                                         _mm256_cvtepi32_ps(isum[j]), acc[j]);
                acc[j] = _mm256_fnmadd_ps(dmn, _mm256_broadcast_ss(xs + j * nb + xb), acc[j]);
            }
        }
    }
    store_tile(NR, acc, y, r0, ys, bias);
#else
    for (int j = 0; j < NR; j++) {
        float acc[8] = {0};
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *w = wc + sb * BLK;
            for (int s = 0; s < QK_K / QK; s++) {
                const int64_t xb = sb * (QK_K / QK) + s;
                const int8_t *x = xq + j * nb * QK + xb * QK;
                int32_t isum[8] = {0};
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 8; i++)
                        for (int e = 0; e < 4; e++) {
                            int p = 32 * t + 4 * i + e;
                            int cl = w[128 * s + p] & 15, ch = w[128 * s + p] >> 4;
                            if (FIVE) {
                                uint8_t hb = w[Q5K_QH + 32 * s + 4 * i + e];
                                cl |= ((hb >> (2 * t)) & 1) << 4;
                                ch |= ((hb >> (2 * t + 1)) & 1) << 4;
                            }
                            isum[i] += cl * x[8 * t + e] + ch * x[8 * t + 4 + e];
                        }
                for (int i = 0; i < 8; i++) {
                    int sc, m;
                    uint16_t hd, hm;
                    k4_scale_min(w + SC, i, s, &sc, &m);
                    memcpy(&hd, w + SC + 96 + 2 * i, 2);
                    memcpy(&hm, w + SC + 112 + 2 * i, 2);
                    acc[i] += half_to_float(hd) * (float)sc * xd[j * nb + xb] * (float)isum[i] -
                              half_to_float(hm) * (float)m * xs[j * nb + xb];
                }
            }
        }
        for (int i = 0; i < 8; i++) y[(r0 + j) * ys + i] = acc[i] + (bias ? bias[i] : 0.0f);
    }
#endif
}

INLINE void q6k_group(const int NR, int64_t nsb, const uint8_t *wc, const qrows_t *a, int64_t r0, float *y, int64_t ys,
                      const float *bias) {
    const int64_t nb = nsb * (QK_K / QK);
    const int8_t *xq = a->q + r0 * nb * QK;
    const float *xd = a->d + r0 * nb;
#ifdef __AVX2__
    __m256 acc[ROW_TILE];
    for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *w = wc + sb * Q6K_BLOCK;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + Q6K_D)));
        for (int s = 0; s < QK_K / QK; s++) {
            const uint8_t *c = w + 128 * s;
            for (int p = 0; p < Q6K_BLOCK / 8; p += 64)
                _mm_prefetch((const char *)(w + PF_Q6K * Q6K_BLOCK + Q6K_BLOCK / 8 * s + p), PF_HINT);
            const int64_t xb = sb * (QK_K / QK) + s;
            __m256i isum[ROW_TILE], part[ROW_TILE]; /* the block's scaled sum; a 16-value half's sum */
            for (int j = 0; j < NR; j++) isum[j] = part[j] = _mm256_setzero_si256();
            #pragma GCC unroll 4 /* constant shift counts */
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * t));
                __m256i H = _mm256_loadu_si256((const __m256i *)(w + Q6K_QH + 64 * s + 32 * (t >> 1)));
                const int u = 4 * (t & 1);
                __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(shift16(H, 4 - u), m30));
                __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                             _mm256_and_si256(shift16(H, 2 - u), m30));
#if QMM_VNNI
                (void)k32; /* unsigned codes c in 0..63 (int32 sums) from -32 x the 16 codes' sum: sum (c - 32) q */
                if (!(t & 1))
                    for (int j = 0; j < NR; j++) part[j] = _mm256_set1_epi32(-32 * a->q16[(r0 + j) * 2 * nb + 2 * xb + (t >> 1)]);
                for (int j = 0; j < NR; j++) {
                    const int8_t *x = xq + j * nb * QK + xb * QK + 8 * t;
                    part[j] = madd_u8s8(madd_u8s8(part[j], lo, bcast4(x)), hi, bcast4(x + 4));
                }
#else
                lo = _mm256_sub_epi8(lo, k32); /* c - 32 in -32..31; |c - 32| as u8, its sign onto q */
                hi = _mm256_sub_epi8(hi, k32);
                __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
                for (int j = 0; j < NR; j++) {
                    const int8_t *x = xq + j * nb * QK + xb * QK + 8 * t;
                    __m256i xl = _mm256_sign_epi8(bcast4(x), lo), xh = _mm256_sign_epi8(bcast4(x + 4), hi);
                    part[j] = _mm256_add_epi16(part[j], _mm256_add_epi16(_mm256_maddubs_epi16(alo, xl),
                                                                         _mm256_maddubs_epi16(ahi, xh)));
                    PIN(part[j]);
                }
#endif
                if (t & 1) { /* a 16-value half done: times its int8 scale, exact in int32 */
                    __m256i sc = i8x8_epi32(w + Q6K_SC + 8 * (2 * s + (t >> 1)));
#if QMM_VNNI
                    for (int j = 0; j < NR; j++) isum[j] = _mm256_add_epi32(isum[j], _mm256_mullo_epi32(part[j], sc));
#else
                    sc = _mm256_blend_epi16(sc, _mm256_slli_epi32(sc, 16), 0xAA); /* sc in both int16 halves */
                    for (int j = 0; j < NR; j++) isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(part[j], sc));
#endif
                    for (int j = 0; j < NR; j++) part[j] = _mm256_setzero_si256();
                }
            }
            for (int j = 0; j < NR; j++)
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(xd + j * nb + xb)),
                                         _mm256_cvtepi32_ps(isum[j]), acc[j]);
        }
    }
    store_tile(NR, acc, y, r0, ys, bias);
#else
    for (int j = 0; j < NR; j++) {
        float acc[8] = {0};
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *w = wc + sb * Q6K_BLOCK;
            for (int s = 0; s < QK_K / QK; s++) {
                const int64_t xb = sb * (QK_K / QK) + s;
                const int8_t *x = xq + j * nb * QK + xb * QK;
                int32_t isum[8] = {0};
                for (int t = 0; t < 4; t++) {
                    int32_t part[8] = {0};
                    for (int i = 0; i < 8; i++)
                        for (int e = 0; e < 4; e++) {
                            int p = 32 * t + 4 * i + e;
                            uint8_t h = w[Q6K_QH + 64 * s + 32 * (t >> 1) + 4 * i + e] >> (4 * (t & 1));
                            int cl = (w[128 * s + p] & 15) | ((h & 3) << 4), ch = (w[128 * s + p] >> 4) | (((h >> 2) & 3) << 4);
                            part[i] += (cl - 32) * x[8 * t + e] + (ch - 32) * x[8 * t + 4 + e];
                        }
                    for (int i = 0; i < 8; i++) isum[i] += part[i] * (int8_t)w[Q6K_SC + 8 * (2 * s + (t >> 1)) + i];
                }
                for (int i = 0; i < 8; i++) {
                    uint16_t hd;
                    memcpy(&hd, w + Q6K_D + 2 * i, 2);
                    acc[i] += half_to_float(hd) * xd[j * nb + xb] * (float)isum[i];
                }
            }
        }
        for (int i = 0; i < 8; i++) y[(r0 + j) * ys + i] = acc[i] + (bias ? bias[i] : 0.0f);
    }
#endif
}

/* calls F(NR, ...) with NR the constant min(nr, MAX) (BY_TILE: MAX = ROW_TILE) */
#define BY_TILE_MAX(MAX, nr, F, ...) do { switch (nr) { \
    case 1: F(1, __VA_ARGS__); break; case 2: F(2, __VA_ARGS__); break; \
    case 3: F(3, __VA_ARGS__); break; case 4: F(4 < MAX ? 4 : MAX, __VA_ARGS__); break; \
    case 5: F(5 < MAX ? 5 : MAX, __VA_ARGS__); break; case 6: F(6 < MAX ? 6 : MAX, __VA_ARGS__); break; \
    case 7: F(7 < MAX ? 7 : MAX, __VA_ARGS__); break; default: F(MAX, __VA_ARGS__); } } while (0)
#define BY_TILE(nr, F, ...) BY_TILE_MAX(ROW_TILE, nr, F, __VA_ARGS__)

/* ---- entry points --------------------------------------------------------------------------- */

/* ---- Q4_0 / Q5_0 / Q5_1 as stored -----------------------------------------------------------
 * Per group of 8 columns and block of 32 values (the file's block, 8 times):
 *  - Q4_0, Q40_BLOCK = 8 x 18: the codes in the int4 layout (128 bytes), then the 8 fp16 d.
 *    w = d (c - 8), c in 0..15.
 *  - Q5_0, Q50_BLOCK = 8 x 22: the low nibbles in the int4 layout, then 32 bytes of high bits
 *    (byte 4i + j: bit 2t = element 8t + j, bit 2t + 1 = element 8t + 4 + j), then the 8 d.
 *    w = d (c - 16), c in 0..31.
 *  - Q5_1, Q51_BLOCK = 8 x 24: as Q5_0, then the 8 fp16 m after the d. w = d c + m.
 * Sums: Q4_0 / Q5_0 signed codes c - 8 / c - 16 with the sign moved onto q (|c'| <= 16), so
 * a block's 8 pair sums stay below 2^15 in int16 (8 x 2 x 16 x 127 = 32512) and the block adds
 * one FMA (no m term, no offset error: llama.cpp's Q4_0 x Q8_0 arithmetic); Q5_1 unsigned
 * codes (31 x 127 x 2 per pair) widened to int32 every step; VNNI vpdpbusd where built, which
 * multiplies Q4_0 / Q5_0's unsigned codes and takes off 8 / 16 x the activation codes' sum
 * (from their sums of 16): the same integer, without the per-row sign work (1.14-1.31x). */
#ifndef PFD
#define PFD 96
#endif
#define Q40_BLOCK 144
#define Q50_BLOCK 176
#define Q51_BLOCK 192

/* KIND 0: Q4_0, 1: Q5_0, 2: Q5_1 */
INLINE void q4x_group(const int NR, const int KIND, int64_t nb, const uint8_t *wc, const qrows_t *a, int64_t r0,
                      float *y, int64_t ys, const float *bias) {
    const int BLK = KIND == 0 ? Q40_BLOCK : KIND == 1 ? Q50_BLOCK : Q51_BLOCK;
    const int DOFF = KIND == 0 ? 128 : 160, MOFF = 176;
    const int8_t *xq = a->q + r0 * nb * QK;
    const float *xd = a->d + r0 * nb, *xs = a->s + r0 * nb;
#ifdef __AVX2__
    /* unsigned codes and the offset taken off in int32: Q4_0 everywhere, Q5_0 with VNNI (its
     * 31 x 127 x 2 pair sums would overflow maddubs' int16 accumulation) */
    const int UNSIGNED = KIND == 0 || (QMM_VNNI && KIND == 1);
    __m256 acc[ROW_TILE];
    for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), off = _mm256_set1_epi8(KIND ? 16 : 8),
                  ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[ROW_TILE];
        for (int j = 0; j < NR; j++) isum[j] = _mm256_setzero_si256();
        const uint8_t *w = wc + b * BLK;
        _mm_prefetch((const char *)(w + PFD * BLK), PF_HINT);
        _mm_prefetch((const char *)(w + PFD * BLK + 64), PF_HINT);
        _mm_prefetch((const char *)(w + PFD * BLK + 128), PF_HINT);
        if (KIND) _mm_prefetch((const char *)(w + PFD * BLK + 176), PF_HINT);
        const __m256i H = KIND ? _mm256_loadu_si256((const __m256i *)(w + 128)) : _mm256_setzero_si256();
        #pragma GCC unroll 4 /* constant shift counts */
        for (int t = 0; t < 4; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * t));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (KIND) {
                lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(H, 4 - 2 * t), bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(H, 3 - 2 * t), bit4));
            }
            if (UNSIGNED) { /* unsigned codes c times q (no sign work per row); 8 or 16 x sum(q) comes off below */
                for (int j = 0; j < NR; j++) {
                    const int8_t *x = xq + j * nb * QK + b * QK + 8 * t;
#if QMM_VNNI
                    isum[j] = madd_u8s8(madd_u8s8(isum[j], lo, bcast4(x)), hi, bcast4(x + 4));
#else /* Q4_0: 8 pair sums of 15 x 127 x 2 stay below 2^15 in int16 */
                    isum[j] = _mm256_add_epi16(isum[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x)),
                                                                         _mm256_maddubs_epi16(hi, bcast4(x + 4))));
                    PIN(isum[j]);
#endif
                }
            } else if (KIND != 2) { /* signed codes: |c'| as u8, the sign onto q */
                lo = _mm256_sub_epi8(lo, off);
                hi = _mm256_sub_epi8(hi, off);
                const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
                for (int j = 0; j < NR; j++) {
                    const int8_t *x = xq + j * nb * QK + b * QK + 8 * t;
                    const __m256i xl = _mm256_sign_epi8(bcast4(x), lo), xh = _mm256_sign_epi8(bcast4(x + 4), hi);
#if QMM_VNNI
                    isum[j] = madd_u8s8(madd_u8s8(isum[j], alo, xl), ahi, xh);
#else
                    isum[j] = _mm256_add_epi16(isum[j], _mm256_add_epi16(_mm256_maddubs_epi16(alo, xl),
                                                                         _mm256_maddubs_epi16(ahi, xh)));
#endif
                }
            } else {
                for (int j = 0; j < NR; j++) {
                    const int8_t *x = xq + j * nb * QK + b * QK + 8 * t;
#if QMM_VNNI
                    isum[j] = madd_u8s8(madd_u8s8(isum[j], lo, bcast4(x)), hi, bcast4(x + 4));
#else
                    isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(_mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, bcast4(x)), _mm256_maddubs_epi16(hi, bcast4(x + 4))), ones));
#endif
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + DOFF)));
        const __m256 m = KIND == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + MOFF))) : _mm256_setzero_ps();
        for (int j = 0; j < NR; j++) {
            __m256i s32 = (QMM_VNNI || KIND == 2) ? isum[j] : _mm256_madd_epi16(isum[j], ones);
            if (UNSIGNED) { /* sum (c - off) q = sum c q - off sum q, in int32: the same integer */
                const int32_t *q16 = a->q16 + (r0 + j) * 2 * nb + 2 * b;
                s32 = _mm256_sub_epi32(s32, _mm256_set1_epi32((KIND ? 16 : 8) * (q16[0] + q16[1])));
            }
            const __m256 p = _mm256_cvtepi32_ps(s32);
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(xd + j * nb + b)), p, acc[j]);
            if (KIND == 2) acc[j] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + j * nb + b), acc[j]);
        }
    }
    store_tile(NR, acc, y, r0, ys, bias);
#else
    for (int j = 0; j < NR; j++) {
        float acc[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = wc + b * BLK;
            const int8_t *x = xq + j * nb * QK + b * QK;
            int32_t isum[8] = {0};
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < 8; i++)
                    for (int e = 0; e < 4; e++) {
                        const uint8_t c = w[32 * t + 4 * i + e];
                        int lo = c & 15, hi = c >> 4;
                        if (KIND) {
                            const uint8_t hb = w[128 + 4 * i + e];
                            lo |= ((hb >> (2 * t)) & 1) << 4;
                            hi |= ((hb >> (2 * t + 1)) & 1) << 4;
                        }
                        if (KIND != 2) {
                            lo -= KIND ? 16 : 8;
                            hi -= KIND ? 16 : 8;
                        }
                        isum[i] += lo * x[8 * t + e] + hi * x[8 * t + 4 + e];
                    }
            for (int i = 0; i < 8; i++) {
                uint16_t h;
                memcpy(&h, w + DOFF + 2 * i, 2);
                acc[i] += half_to_float(h) * xd[j * nb + b] * (float)isum[i];
                if (KIND == 2) {
                    memcpy(&h, w + MOFF + 2 * i, 2);
                    acc[i] += half_to_float(h) * xs[j * nb + b];
                }
            }
        }
        for (int i = 0; i < 8; i++) y[(r0 + j) * ys + i] = acc[i] + (bias ? bias[i] : 0.0f);
    }
#endif
}


/* ---- MXFP4 as stored ----------------------------------------------------------------------
 * Per group of 8 columns and block of 32 values (the file's block_mxfp4, 8 times), MX4_BLOCK =
 * 8 x 17: the 4-bit codes in the int4 layout (128 bytes, as Q4_0's: the file holds element j
 * in the low nibble of qs[j], j + 16 in the high), then the 8 columns' e8m0 scale bytes e.
 * w = kv[c] 2^(e - 128), kv = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12} (ggml's kvalues_mxfp4,
 * twice the e2m1 values) and 2^(e - 128) ggml's GGML_E8M0_TO_FP32_HALF (its e < 2 case, the
 * subnormals 0x00200000 << e, is the same power of two), so every weight is exact in float32
 * (but 2^126 x |kv| >= 4 at e = 254, 255, which overflows to inf there as in gguf's own
 * dequantize; the kernels keep 2^(e - 128) x d_x, finite). The codes become kv + 16 (4..28,
 * unsigned) by a pshufb lookup, multiplied with no sign work per row; 16 x the activation
 * codes' sum (from their sums of 16) comes off in int32 (Q4_0's way): the same integer as
 * sum kv q. AVX2's maddubs adds two steps' pair sums in int16 (4 x 2 x 28 x 127 = 28448 <
 * 2^15) before widening (one row, Zen 4: 1.2x the sign trick on signed kv, 1.08x at 5 rows);
 * VNNI's vpdpbusd adds in int32. The column tiles take the same u8 codes with offset 16
 * (tile_kind 1: 1.2-1.35x the group kernels at 16-64 rows, AVX2 and VNNI, Zen 4). */
#define MX4_BLOCK 136
#define MX4_OFF 16 /* kv + MX4_OFF: the unsigned codes of the group kernels and the column tiles */

static const int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) as ggml's GGML_E8M0_TO_FP32_HALF builds it */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef __AVX2__
/* the 8 scale bytes at p as 8 floats 2^(e - 128) */
static inline __m256 e8m0_half8(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i nrm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e); /* e < 2 (0 from 32 on: unused) */
    return _mm256_castsi256_ps(_mm256_blendv_epi8(nrm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
/* the pshufb table nibble -> kv + off, in both 128-bit lanes */
static inline __m256i mxfp4_lut(int off) {
    int8_t t[16];
    for (int i = 0; i < 16; i++) t[i] = (int8_t)(KV_MXFP4[i] + off);
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
}
#endif

INLINE void mxfp4_group(const int NR, int64_t nb, const uint8_t *wc, const qrows_t *a, int64_t r0, float *y,
                        int64_t ys, const float *bias) {
    const int8_t *xq = a->q + r0 * nb * QK;
    const float *xd = a->d + r0 * nb;
#ifdef __AVX2__
    __m256 acc[ROW_TILE];
    for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), lut = mxfp4_lut(MX4_OFF);
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[ROW_TILE];
        for (int j = 0; j < NR; j++) isum[j] = _mm256_setzero_si256();
#if QMM_VNNI
        __m256i isum2[ROW_TILE]; /* few rows: the high nibbles' chain, two short dependency chains (1.09x at 1 row) */
        for (int j = 0; j < NR; j++) isum2[j] = _mm256_setzero_si256();
#endif
        const uint8_t *w = wc + b * MX4_BLOCK;
        _mm_prefetch((const char *)(w + PFD * MX4_BLOCK), PF_HINT);
        _mm_prefetch((const char *)(w + PFD * MX4_BLOCK + 64), PF_HINT);
        _mm_prefetch((const char *)(w + PFD * MX4_BLOCK + 128), PF_HINT);
        #pragma GCC unroll 2
        for (int t = 0; t < 4; t += 2) { /* two steps at a time: kv + 16 of elements 8t .. 8t + 15 */
            __m256i lo[2], hi[2];
            for (int u = 0; u < 2; u++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * (t + u)));
                lo[u] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low));
                hi[u] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
            for (int j = 0; j < NR; j++) {
                const int8_t *x = xq + j * nb * QK + b * QK + 8 * t;
#if QMM_VNNI
                if (NR <= 4) {
                    isum[j] = madd_u8s8(madd_u8s8(isum[j], lo[0], bcast4(x)), lo[1], bcast4(x + 8));
                    isum2[j] = madd_u8s8(madd_u8s8(isum2[j], hi[0], bcast4(x + 4)), hi[1], bcast4(x + 12));
                } else {
                    isum[j] = madd_u8s8(madd_u8s8(isum[j], lo[0], bcast4(x)), hi[0], bcast4(x + 4));
                    isum[j] = madd_u8s8(madd_u8s8(isum[j], lo[1], bcast4(x + 8)), hi[1], bcast4(x + 12));
                }
#else /* 4 pair sums per int16 lane (<= 4 x 2 x 28 x 127 = 28448), then int32 */
                const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast4(x)),
                                                    _mm256_maddubs_epi16(hi[0], bcast4(x + 4)));
                const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[1], bcast4(x + 8)),
                                                    _mm256_maddubs_epi16(hi[1], bcast4(x + 12)));
                isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1)));
#endif
            }
        }
        const __m256 d = e8m0_half8(w + 128);
        for (int j = 0; j < NR; j++) {
            /* sum kv q = sum (kv + 16) q - 16 sum q, in int32: the same integer */
            const int32_t *q16 = a->q16 + (r0 + j) * 2 * nb + 2 * b;
#if QMM_VNNI
            const __m256i s = NR <= 4 ? _mm256_add_epi32(isum[j], isum2[j]) : isum[j];
#else
            const __m256i s = isum[j];
#endif
            const __m256i s32 = _mm256_sub_epi32(s, _mm256_set1_epi32(MX4_OFF * (q16[0] + q16[1])));
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(xd + j * nb + b)), _mm256_cvtepi32_ps(s32),
                                     acc[j]);
        }
    }
    store_tile(NR, acc, y, r0, ys, bias);
#else
    for (int j = 0; j < NR; j++) {
        float acc[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = wc + b * MX4_BLOCK;
            const int8_t *x = xq + j * nb * QK + b * QK;
            int32_t isum[8] = {0};
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < 8; i++)
                    for (int e = 0; e < 4; e++) {
                        const uint8_t c = w[32 * t + 4 * i + e];
                        isum[i] += KV_MXFP4[c & 15] * x[8 * t + e] + KV_MXFP4[c >> 4] * x[8 * t + 4 + e];
                    }
            for (int i = 0; i < 8; i++) acc[i] += e8m0_half(w[128 + i]) * xd[j * nb + b] * (float)isum[i];
        }
        for (int i = 0; i < 8; i++) y[(r0 + j) * ys + i] = acc[i] + (bias ? bias[i] : 0.0f);
    }
#endif
}

#define FMT_CONCAT 1
#define FMT_Q4 4
#define FMT_Q8 8
#define FMT_Q4_0 102 /* 100 + the GGML type id */
#define FMT_Q5_0 106
#define FMT_Q5_1 107
#define FMT_Q8_0 108
#define FMT_Q4_K 112
#define FMT_Q5_K 113
#define FMT_Q6_K 114
#define FMT_MXFP4 139
#define FMT_BF16 130 /* 100 + GGML's BF16 type id: bf16 weights row-major [n, k], no packing */
#define FMT_F16 101  /* 100 + GGML's F16 type id: IEEE half weights row-major [n, k], no packing */

/* One layer's packed weights (built once by qmm.py): fmt 4 = int4 (n / 8 * k / 32 blocks of
 * Q4_BLOCK bytes, codes then fp16 d and m), fmt 8 = int8 (codes n * k bytes in the int8
 * layout, scale float32 [n]), fmt 108 / 112 / 113 / 114 / 139 = GGUF Q8_0 / Q4_K / Q5_K / Q6_K /
 * MXFP4 (n / 8 * k / 32 blocks of Q80_BLOCK or MX4_BLOCK, or n / 8 * k / 256 of
 * Q4K_/Q5K_/Q6K_BLOCK bytes);
 * fmt 1 = concat: nparts parts (each a qweights_t of another format, the same k, n the sum of
 * theirs), part p writing its columns at its offset of y; bias float32 [n] or NULL (a concat's
 * bias, when set, covers all its columns and the parts' own are not used). k a multiple of 32
 * (256 for the K-quants), n of 8. The fields before parts are the original struct's. */
typedef struct qweights {
    int64_t n, k;
    int32_t fmt;
    const void *codes;
    const float *scale, *bias;
    const struct qweights *const *parts;
    int64_t nparts;
} qweights_t;

static int simple_fmt(int32_t fmt) {
    return fmt == FMT_Q4 || fmt == FMT_Q8 || fmt == FMT_Q4_0 || fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_Q8_0 ||
           fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K || fmt == FMT_MXFP4 || fmt == FMT_BF16 ||
           fmt == FMT_F16;
}

/* bytes of one group of 8 columns (the cost a thread's share is measured in) */
static int64_t group_bytes(const qweights_t *w) {
    switch (w->fmt) {
    case FMT_Q4: return w->k / QK * Q4_BLOCK;
    case FMT_Q8: return w->k * 8;
    case FMT_Q4_0: return w->k / QK * Q40_BLOCK;
    case FMT_Q5_0: return w->k / QK * Q50_BLOCK;
    case FMT_Q5_1: return w->k / QK * Q51_BLOCK;
    case FMT_Q8_0: return w->k / QK * Q80_BLOCK;
    case FMT_MXFP4: return w->k / QK * MX4_BLOCK;
    case FMT_Q4_K: return w->k / QK_K * Q4K_BLOCK;
    case FMT_Q5_K: return w->k / QK_K * Q5K_BLOCK;
    case FMT_BF16: case FMT_F16: return w->k * 16;
    default: return w->k / QK_K * Q6K_BLOCK;
    }
}

/* ---- bf16 weights -----------------------------------------------------------------------
 * bf16 weights [n, k] row-major as the checkpoint stores them (no packing, no copy) times the
 * activations rounded to bf16 (round to nearest even), products added in float32 the way
 * AVX512-BF16's vdpbf16ps adds them: 16 lanes, lane i of each 32 values taking element 2i + 1
 * then 2i (each product exact in float32, each add rounded), the lanes summed at the end in a
 * fixed tree (8, 4, 2, 1 apart). The AVX-512 F, AVX2 and plain C builds split each 32-bit pair
 * into its two bf16 halves and add them in that same order, so every build gives the same
 * float32 sums (vdpbf16ps flushes denormal inputs and results to zero; the others keep them).
 * A group of 8 output rows is 8 k-long rows one after another; BF16_XR input rows share each
 * load of the weights. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define BF16_XR 3 /* 8 x 3 accumulators of 32 registers */
#else
#define BF16_XR 1
#endif

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

#ifndef PF_BF16
#define PF_BF16 8192 /* software prefetch distance, elements (16 KB) ahead of each load, into L2 */
#endif

/* the 16 lanes' sum in the fixed tree: l[i] + l[i + 8], then 4, 2 and 1 apart */
static inline float lanes_sum(const float *l) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) t[i] += t[i + 4];
    for (int i = 0; i < 2; i++) t[i] += t[i + 2];
    return t[0] + t[1];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline float zsum(__m512 v) { /* lanes_sum in registers, the same adds */
    __m256 t = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    u = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}
#elif defined(__AVX2__)
static inline float ysum(__m256 lo, __m256 hi8) { /* lanes 0-7 and 8-15: lanes_sum's adds */
    __m256 t = _mm256_add_ps(lo, hi8);
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    u = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}
#endif

/* out[r * 8 + j] = the sum of w row j times x row r (r < nr <= BF16_XR), k a multiple of 32; nr a
 * constant where bf16_dots calls it (the loops over rows unrolled, no work for absent rows) */
static inline __attribute__((always_inline)) void bf16_dots_nr(const uint16_t *w, int64_t k, const uint16_t *x,
                                                               int64_t xk, const int nr, float *out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 acc[8][BF16_XR];
    for (int j = 0; j < 8; j++)
        for (int r = 0; r < nr; r++) acc[j][r] = _mm512_setzero_ps();
#ifndef __AVX512BF16__
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
#endif
    for (int64_t c = 0; c < k; c += 32) {
#ifdef __AVX512BF16__
        __m512i xv[BF16_XR];
        for (int r = 0; r < nr; r++) xv[r] = _mm512_loadu_si512(x + r * xk + c);
        for (int j = 0; j < 8; j++) {
            _mm_prefetch((const char *)(w + j * k + c + PF_BF16), _MM_HINT_T1);
            const __m512i wv = _mm512_loadu_si512(w + j * k + c);
            for (int r = 0; r < nr; r++)
                acc[j][r] = _mm512_dpbf16_ps(acc[j][r], (__m512bh)xv[r], (__m512bh)wv);
        }
#else
        __m512 xo[BF16_XR], xe[BF16_XR];
        for (int r = 0; r < nr; r++) {
            const __m512i v = _mm512_loadu_si512(x + r * xk + c);
            xo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            xe[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        }
        for (int j = 0; j < 8; j++) {
            _mm_prefetch((const char *)(w + j * k + c + PF_BF16), _MM_HINT_T1);
            const __m512i wv = _mm512_loadu_si512(w + j * k + c);
            const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wv, hi)), we = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
            for (int r = 0; r < nr; r++) acc[j][r] = _mm512_fmadd_ps(xe[r], we, _mm512_fmadd_ps(xo[r], wo, acc[j][r]));
        }
#endif
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 8; j++) out[r * 8 + j] = zsum(acc[j][r]);
#elif defined(__AVX2__)
    (void)xk;
    (void)nr;
    for (int h = 0; h < 2; h++) { /* the w rows 4h .. 4h + 3, both halves of the 16 lanes */
        __m256 acc[4][2];
        for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
        for (int64_t c = 0; c < k; c += 32) {
            for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(w + (4 * h + j) * k + c + PF_BF16), _MM_HINT_T1);
            for (int q = 0; q < 2; q++) { /* lanes 8q .. 8q + 7: elements c + 16q .. c + 16q + 15 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(x + c + 16 * q));
                const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(v, hi)), xe = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                for (int j = 0; j < 4; j++) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (4 * h + j) * k + c + 16 * q));
                    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, hi));
                    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
                    acc[j][q] = _mm256_fmadd_ps(xe, we, _mm256_fmadd_ps(xo, wo, acc[j][q]));
                }
            }
        }
        for (int j = 0; j < 4; j++) out[4 * h + j] = ysum(acc[j][0], acc[j][1]);
    }
#else
    (void)xk;
    (void)nr;
    for (int j = 0; j < 8; j++) {
        float l[16] = {0};
        for (int64_t c = 0; c < k; c += 32)
            for (int i = 0; i < 16; i++) {
                const uint32_t xo = (uint32_t)x[c + 2 * i + 1] << 16, xe = (uint32_t)x[c + 2 * i] << 16;
                const uint32_t wo = (uint32_t)w[j * k + c + 2 * i + 1] << 16, we = (uint32_t)w[j * k + c + 2 * i] << 16;
                float fxo, fxe, fwo, fwe;
                memcpy(&fxo, &xo, 4);
                memcpy(&fxe, &xe, 4);
                memcpy(&fwo, &wo, 4);
                memcpy(&fwe, &we, 4);
                l[i] = fmaf(fxe, fwe, fmaf(fxo, fwo, l[i]));
            }
        out[j] = lanes_sum(l);
    }
#endif
}

static void bf16_dots(const uint16_t *w, int64_t k, const uint16_t *x, int64_t xk, int nr, float *out) {
#if BF16_XR == 3
    if (nr == 3) bf16_dots_nr(w, k, x, xk, 3, out);
    else if (nr == 2) bf16_dots_nr(w, k, x, xk, 2, out);
    else
#endif
        bf16_dots_nr(w, k, x, xk, 1, out);
}

/* columns 8g .. 8g + 7 of bf16 weights w for all rows of xb (bf16 [rows, k]) */
static void bf16_group(const qweights_t *w, int64_t g, const uint16_t *xb, int64_t rows, float *y, int64_t ys,
                       const float *bias) {
    const int64_t k = w->k;
    const uint16_t *wg = (const uint16_t *)w->codes + g * 8 * k;
    float out[BF16_XR * 8];
    for (int64_t r0 = 0; r0 < rows; r0 += BF16_XR) {
        const int nr = rows - r0 < BF16_XR ? (int)(rows - r0) : BF16_XR;
        bf16_dots(wg, k, xb + r0 * k, k, nr, out);
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 8; j++) y[(r0 + r) * ys + 8 * g + j] = out[r * 8 + j] + (bias ? bias[8 * g + j] : 0.0f);
    }
}

/* ---- f16 weights -----------------------------------------------------------------------
 * IEEE half weights [n, k] row-major as the file stores them (no packing, no copy) times the
 * float32 activations as given: each weight widened to float32 (exact), one fused multiply-add
 * per element into 16 lanes (lane i takes elements c + i of each 16, in order of c), the lanes
 * summed by lanes_sum's tree. The AVX-512 (vcvtph2ps), AVX2 + F16C and plain C builds give the
 * same float32 sums. With more input rows than one pass takes (F16_XR), a group's 8 weight rows
 * are widened once into a float32 scratch and every pass reads that: the same values, so the
 * same sums whatever the row count (and without the scratch, where it cannot be allocated). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define F16_XR 3 /* 8 x 3 accumulators of 32 registers */
#else
#define F16_XR 1
#endif
#ifndef PF_F16
#define PF_F16 8192 /* software prefetch distance, elements (16 KB) ahead of each load, into L2 */
#endif

/* out[r * 8 + j] = the sum of w row j times x row r (r < nr <= F16_XR), k a multiple of 16; the
 * weights are half (wh, WIDE 0) or their float32 widening (wf, WIDE 1: the same values, each 16
 * of a row's elements beside the other 7 rows' same 16: wf[(c / 16) * 128 + j * 16 + i] =
 * w[j][c + i], one stream) */
#define WAT(j, c) (((c) >> 4) * 128 + (j) * 16 + ((c) & 15))
static inline __attribute__((always_inline)) void f16_dots_nr(const uint16_t *wh, const float *wf, int64_t k,
                                                              const float *x, int64_t xs, const int nr, float *out,
                                                              const int WIDE) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 acc[8][F16_XR];
    for (int j = 0; j < 8; j++)
        for (int r = 0; r < nr; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 16) {
        __m512 xv[F16_XR];
        for (int r = 0; r < nr; r++) xv[r] = _mm512_loadu_ps(x + r * xs + c);
        for (int j = 0; j < 8; j++) {
            __m512 wv;
            if (WIDE) {
                wv = _mm512_loadu_ps(wf + WAT(j, c));
                __asm__("" : "+v"(wv)); /* one load for the nr FMAs (not a memory operand in each) */
            } else {
                _mm_prefetch((const char *)(wh + j * k + c + PF_F16), _MM_HINT_T1);
                wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wh + j * k + c)));
            }
            for (int r = 0; r < nr; r++) acc[j][r] = _mm512_fmadd_ps(xv[r], wv, acc[j][r]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 8; j++) out[r * 8 + j] = zsum(acc[j][r]);
#elif defined(__AVX2__) && defined(__F16C__)
    (void)xs;
    (void)nr;
    for (int h = 0; h < 2; h++) { /* the w rows 4h .. 4h + 3, both halves of the 16 lanes */
        __m256 acc[4][2];
        for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t c = 0; c < k; c += 16) {
            if (!WIDE)
                for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(wh + (4 * h + j) * k + c + PF_F16), _MM_HINT_T1);
            for (int q = 0; q < 2; q++) { /* lanes 8q .. 8q + 7: elements c + 8q .. c + 8q + 7 */
                const __m256 xv = _mm256_loadu_ps(x + c + 8 * q);
                for (int j = 0; j < 4; j++) {
                    const __m256 wv = WIDE ? _mm256_loadu_ps(wf + WAT(4 * h + j, c + 8 * q))
                                           : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wh + (4 * h + j) * k + c + 8 * q)));
                    acc[j][q] = _mm256_fmadd_ps(xv, wv, acc[j][q]);
                }
            }
        }
        for (int j = 0; j < 4; j++) out[4 * h + j] = ysum(acc[j][0], acc[j][1]);
    }
#else
    (void)xs;
    (void)nr;
    for (int j = 0; j < 8; j++) {
        float l[16] = {0};
        for (int64_t c = 0; c < k; c += 16)
            for (int i = 0; i < 16; i++)
                l[i] = fmaf(x[c + i], WIDE ? wf[WAT(j, c + i)] : half_to_float(wh[j * k + c + i]), l[i]);
        out[j] = lanes_sum(l);
    }
#endif
}

static void f16_dots(const uint16_t *wh, const float *wf, int64_t k, const float *x, int64_t xs, int nr, float *out) {
#if F16_XR == 3
    if (nr == 3 && wf) f16_dots_nr(wh, wf, k, x, xs, 3, out, 1);
    else if (nr == 3) f16_dots_nr(wh, wf, k, x, xs, 3, out, 0);
    else if (nr == 2 && wf) f16_dots_nr(wh, wf, k, x, xs, 2, out, 1);
    else if (nr == 2) f16_dots_nr(wh, wf, k, x, xs, 2, out, 0);
    else
#endif
    if (wf) f16_dots_nr(wh, wf, k, x, xs, 1, out, 1);
    else f16_dots_nr(wh, wf, k, x, xs, 1, out, 0);
}

/* columns 8g .. 8g + 7 of f16 weights w for all rows of x (float32, row stride xs) */
static void f16_group(const qweights_t *w, int64_t g, const float *x, int64_t xs, int64_t rows, float *y, int64_t ys,
                     const float *bias) {
    const int64_t k = w->k;
    const uint16_t *wg = (const uint16_t *)w->codes + g * 8 * k;
    float *wf = NULL;
    if (rows > F16_XR && (wf = malloc((size_t)(8 * k) * sizeof(float))) != NULL) { /* several passes: widen once */
        for (int64_t j = 0; j < 8; j++)
            for (int64_t c = 0; c < k; c += 8) {
#if defined(__AVX2__) && defined(__F16C__) /* immintrin.h is included with AVX2 */
                _mm256_storeu_ps(wf + WAT(j, c), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + j * k + c))));
#else
                for (int i = 0; i < 8; i++) wf[WAT(j, c + i)] = half_to_float(wg[j * k + c + i]);
#endif
            }
    }
    float out[F16_XR * 8];
    for (int64_t r0 = 0; r0 < rows; r0 += F16_XR) {
        const int nr = rows - r0 < F16_XR ? (int)(rows - r0) : F16_XR;
        f16_dots(wg, wf, k, x + r0 * xs, xs, nr, out);
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 8; j++) y[(r0 + r) * ys + 8 * g + j] = out[r * 8 + j] + (bias ? bias[8 * g + j] : 0.0f);
    }
    free(wf);
}

/* columns 8g .. 8g + 7 of w for all rows: y, bias at w's column 0 (row stride ys) */
static void run_group(const qweights_t *w, int64_t g, const qrows_t *a, int64_t rows, float *y, int64_t ys,
                      const float *bias) {
    const int64_t nb = w->k / QK, nsb = w->k / QK_K;
    const uint8_t *wc = (const uint8_t *)w->codes + g * group_bytes(w);
    const float *bg = bias ? bias + 8 * g : NULL;
    float *yg = y + 8 * g;
    /* as few passes over the weights as ROW_TILE allows, their rows as even as possible (7 rows:
     * 4 + 3, not 5 + 2); a row's arithmetic does not depend on the rows beside it */
    if (w->fmt == FMT_BF16) {
        bf16_group(w, g, a->xb, rows, y, ys, bias);
        return;
    }
    if (w->fmt == FMT_F16) {
        f16_group(w, g, a->xf, a->xs, rows, y, ys, bias);
        return;
    }
    const int64_t passes = (rows + ROW_TILE - 1) / ROW_TILE;
    for (int64_t p = 0, r0 = 0, nr; p < passes; p++, r0 += nr) {
        nr = (rows - r0 + passes - p - 1) / (passes - p);
        switch (w->fmt) {
        case FMT_Q4: BY_TILE(nr, q4_group, nb, wc, a, r0, yg, ys, bg); break;
        case FMT_Q8: BY_TILE(nr, q8_group, nb, (const int8_t *)wc, w->scale + 8 * g, a, r0, yg, ys, bg); break;
        case FMT_Q4_0: BY_TILE(nr, q4x_group, 0, nb, wc, a, r0, yg, ys, bg); break;
        case FMT_Q5_0: BY_TILE(nr, q4x_group, 1, nb, wc, a, r0, yg, ys, bg); break;
        case FMT_Q5_1: BY_TILE(nr, q4x_group, 2, nb, wc, a, r0, yg, ys, bg); break;
        case FMT_Q8_0: BY_TILE(nr, q80_group, nb, wc, a, r0, yg, ys, bg); break;
        case FMT_Q4_K: BY_TILE(nr, q45k_group, 0, nsb, wc, a, r0, yg, ys, bg); break;
        case FMT_Q5_K: BY_TILE(nr, q45k_group, 1, nsb, wc, a, r0, yg, ys, bg); break;
        case FMT_Q6_K: BY_TILE(nr, q6k_group, nsb, wc, a, r0, yg, ys, bg); break;
        case FMT_MXFP4: BY_TILE(nr, mxfp4_group, nb, wc, a, r0, yg, ys, bg); break;
        }
    }
}

/* ---- batches: each column tile decoded once per call ----------------------------------------
 * From TILE_ROWS input rows on (AVX2 builds), a thread decodes each tile of its columns (two
 * groups, 16 columns, where AVX-512 VNNI is built; one group, 8 columns, with AVX-VNNI or plain
 * AVX2, which multiplies by maddubs and adds G steps' pair sums in int16 before widening; not
 * Q8_0 there: 255 x 127 x 2 would saturate) once per call into a scratch tile of plain u8 codes and float scales per 32-value block, then runs
 * one kernel over all the rows: the group kernels decode the weights again for every ROW_TILE
 * rows, and a 16-column tile halves the activation broadcasts per multiply-add. Per block of
 * the scratch tile (TB bytes): 8 steps of 4 TW bytes (byte 4i + j of step u: column i's code
 * of element 4u + j, as u8), then TW floats fd, TW floats fm, 2 TW int32 sc.
 * Each output's arithmetic is its group kernel's to the bit: the same exact integer block sum
 * (unsigned codes, the offset taken off in int32: Q4_0 8, Q5_0 16, MXFP4 16 (kv + 16), Q8_0
 * 128 (the code + 128), Q6_K 32 per 16 values times its int8 scale), then the same float
 * operations in the same order (p = float(sum); acc += (fd x d_x) p; acc += fm s_x for a
 * format with minimums, fm the negated dmin x m of the K-quants). So a row's result does not depend on how many rows
 * share the call (tested bit for bit). */
#if QMM_TILES
#ifndef TILE_ROWS /* from this many rows (formats with minimums: 3 times as many); measured in */
#define TILE_ROWS 16  /* docs/performance.md ("Integer matmuls on batches") */
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && !defined(QMM_TILE_YMM) /* tests build -DQMM_TILE_YMM: the
                                                                           AVX-VNNI width on an AVX-512 host */
#define TW 16
typedef __m512i vti_t;
typedef __m512 vtf_t;
#define T_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define T_DP(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)
#define T_SET1I(v) _mm512_set1_epi32(v)
#define T_ZEROI() _mm512_setzero_si512()
#define T_SUBI(a, b) _mm512_sub_epi32(a, b)
#define T_ADDI(a, b) _mm512_add_epi32(a, b)
#define T_MULLO(a, b) _mm512_mullo_epi32(a, b)
#define T_CVT(a) _mm512_cvtepi32_ps(a)
#define T_LOADF(p) _mm512_loadu_ps(p)
#define T_SET1F(v) _mm512_set1_ps(v)
#define T_ZEROF() _mm512_setzero_ps()
#define T_MUL(a, b) _mm512_mul_ps(a, b)
#define T_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define T_ADD(a, b) _mm512_add_ps(a, b)
#define T_STOREF(p, v) _mm512_storeu_ps(p, v)
#else
#define TW 8
typedef __m256i vti_t;
typedef __m256 vtf_t;
#define T_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define T_DP(acc, a, b) madd_u8s8(acc, a, b)
#define T_SET1I(v) _mm256_set1_epi32(v)
#define T_ZEROI() _mm256_setzero_si256()
#define T_SUBI(a, b) _mm256_sub_epi32(a, b)
#define T_ADDI(a, b) _mm256_add_epi32(a, b)
#define T_MULLO(a, b) _mm256_mullo_epi32(a, b)
#define T_CVT(a) _mm256_cvtepi32_ps(a)
#define T_LOADF(p) _mm256_loadu_ps(p)
#define T_SET1F(v) _mm256_set1_ps(v)
#define T_ZEROF() _mm256_setzero_ps()
#define T_MUL(a, b) _mm256_mul_ps(a, b)
#define T_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define T_ADD(a, b) _mm256_add_ps(a, b)
#define T_STOREF(p, v) _mm256_storeu_ps(p, v)
#endif
#define TB (48 * TW)        /* scratch bytes per 32-value block */
#define T_FD (32 * TW)      /* offsets inside a scratch block */
#define T_FM (36 * TW)
#define T_SC (40 * TW)

/* the tile kind of a format: 0 none (the group kernels), 1 offset, 2 minimums, 3 Q6_K; *off */
static int tile_kind(int32_t fmt, int *off) {
    *off = 0;
    switch (fmt) {
    case FMT_Q4_0: *off = 8; return 1;
    case FMT_Q5_0: *off = 16; return 1;
    case FMT_MXFP4: *off = MX4_OFF; return 1; /* kv + 16 in 4..28: maddubs' G = 4 as Q5_0's */
    case FMT_Q8_0: *off = 128; return QMM_VNNI; /* AVX2's maddubs would saturate: 2 x 255 x 127 > 2^15 */
    case FMT_Q4: case FMT_Q5_1: case FMT_Q4_K: case FMT_Q5_K: return 2;
    case FMT_Q6_K: return 3;
    default: return 0;
    }
}

/* block b's step u of half h (8 columns) in the scratch tile */
static inline void t_put(uint8_t *tile, int64_t b, int u, int h, __m256i v) {
    _mm256_storeu_si256((__m256i *)(tile + b * TB + u * 4 * TW + 32 * h), v);
}
static inline void t_putf(uint8_t *tile, int64_t b, int off, int h, __m256 v) {
    _mm256_storeu_ps((float *)(tile + b * TB + off) + 8 * h, v);
}

/* one packed group of 8 columns (wg, nb blocks of 32 values) into half h of the scratch tile */
static void unpack_group(int32_t fmt, int64_t nb, const uint8_t *wg, uint8_t *tile, int h) {
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), m30 = _mm256_set1_epi8(0x30),
                  sign = _mm256_set1_epi8((char)0x80);
    if (fmt == FMT_Q4 || fmt == FMT_Q4_0 || fmt == FMT_Q5_0 || fmt == FMT_Q5_1) {
        const int KIND = fmt == FMT_Q5_0 ? 1 : fmt == FMT_Q5_1 ? 2 : 0;
        const int BLK = fmt == FMT_Q4 ? Q4_BLOCK : KIND == 0 ? Q40_BLOCK : KIND == 1 ? Q50_BLOCK : Q51_BLOCK;
        const int DOFF = fmt == FMT_Q4 || KIND == 0 ? 128 : 160, MOFF = fmt == FMT_Q4 ? 144 : 176;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = wg + b * BLK;
            const __m256i H = KIND ? _mm256_loadu_si256((const __m256i *)(w + 128)) : _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * t));
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (KIND) {
                    lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(H, 4 - 2 * t), bit4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(H, 3 - 2 * t), bit4));
                }
                t_put(tile, b, 2 * t, h, lo);
                t_put(tile, b, 2 * t + 1, h, hi);
            }
            t_putf(tile, b, T_FD, h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + DOFF))));
            if (fmt == FMT_Q4 || KIND == 2)
                t_putf(tile, b, T_FM, h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + MOFF))));
        }
    } else if (fmt == FMT_MXFP4) {
        const __m256i lut = mxfp4_lut(MX4_OFF);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = wg + b * MX4_BLOCK;
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * t));
                t_put(tile, b, 2 * t, h, _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low)));
                t_put(tile, b, 2 * t + 1, h, _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low)));
            }
            t_putf(tile, b, T_FD, h, e8m0_half8(w + 128));
        }
    } else if (fmt == FMT_Q8_0) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = wg + b * Q80_BLOCK;
            for (int t = 0; t < 8; t++) /* c + 128 as u8 */
                t_put(tile, b, t, h, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 32 * t)), sign));
            t_putf(tile, b, T_FD, h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 256))));
        }
    } else if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) {
        const int FIVE = fmt == FMT_Q5_K, BLK = FIVE ? Q5K_BLOCK : Q4K_BLOCK, SC = FIVE ? Q5K_SC : Q4K_SC;
        for (int64_t sb = 0; sb < nb / 8; sb++) {
            const uint8_t *w = wg + sb * BLK;
            uint8_t sc[64] __attribute__((aligned(32))), mn[64] __attribute__((aligned(32)));
            k4_scales(w + SC, sc, mn);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + SC + 96)));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + SC + 112)));
            for (int s = 0; s < 8; s++) {
                const int64_t b = sb * 8 + s;
                const uint8_t *c = w + 128 * s;
                const __m256i H = FIVE ? _mm256_loadu_si256((const __m256i *)(w + Q5K_QH + 32 * s)) : _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * t));
                    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (FIVE) {
                        lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(H, 4 - 2 * t), bit4));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(H, 3 - 2 * t), bit4));
                    }
                    t_put(tile, b, 2 * t, h, lo);
                    t_put(tile, b, 2 * t + 1, h, hi);
                }
                t_putf(tile, b, T_FD, h, _mm256_mul_ps(d, u8x8_ps(sc + 8 * s)));
                /* -(dmin m): fnmadd(dmin m, s, acc) == fmadd(-(dmin m), s, acc) bit for bit */
                t_putf(tile, b, T_FM, h, _mm256_xor_ps(_mm256_mul_ps(dmin, u8x8_ps(mn + 8 * s)), _mm256_set1_ps(-0.0f)));
            }
        }
    } else { /* FMT_Q6_K */
        for (int64_t sb = 0; sb < nb / 8; sb++) {
            const uint8_t *w = wg + sb * Q6K_BLOCK;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + Q6K_D)));
            for (int s = 0; s < 8; s++) {
                const int64_t b = sb * 8 + s;
                const uint8_t *c = w + 128 * s;
                for (int t = 0; t < 4; t++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * t));
                    __m256i H = _mm256_loadu_si256((const __m256i *)(w + Q6K_QH + 64 * s + 32 * (t >> 1)));
                    const int u = 4 * (t & 1);
                    t_put(tile, b, 2 * t, h, _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(shift16(H, 4 - u), m30)));
                    t_put(tile, b, 2 * t + 1, h, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                                 _mm256_and_si256(shift16(H, 2 - u), m30)));
                }
                t_putf(tile, b, T_FD, h, d);
#if QMM_VNNI
                for (int half = 0; half < 2; half++)
                    _mm256_storeu_si256((__m256i *)((int32_t *)(tile + b * TB + T_SC) + TW * half + 8 * h),
                                        i8x8_epi32(w + Q6K_SC + 8 * (2 * s + half)));
#else
                /* maddubs takes the activations as u8 (q + 128) and these codes as s8 (c - 32): each
                 * half's int16 pair sums times its scale by one vpmaddwd (scales as int16 pairs,
                 * [s0 s0 s1 s1 ...]), and the -128 x sum_h sc_h sum (c - 32) it adds, a constant
                 * per column and block, kept at T_FM as int32 */
                __m256i corr = _mm256_setzero_si256();
                for (int half = 0; half < 2; half++) {
                    __m256i cs = _mm256_setzero_si256();
                    for (int u = 4 * half; u < 4 * half + 4; u++) {
                        __m256i *p = (__m256i *)(tile + b * TB + u * 4 * TW + 32 * h);
                        const __m256i sc = _mm256_sub_epi8(_mm256_loadu_si256(p), _mm256_set1_epi8(32));
                        _mm256_storeu_si256(p, sc);
                        cs = _mm256_add_epi32(cs, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), sc),
                                                                    _mm256_set1_epi16(1)));
                    }
                    const __m128i s16 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + Q6K_SC + 8 * (2 * s + half))));
                    _mm256_storeu_si256((__m256i *)(tile + b * TB + T_SC + 32 * half),
                                        _mm256_set_m128i(_mm_unpackhi_epi16(s16, s16), _mm_unpacklo_epi16(s16, s16)));
                    corr = _mm256_add_epi32(corr, _mm256_mullo_epi32(cs, i8x8_epi32(w + Q6K_SC + 8 * (2 * s + half))));
                }
                _mm256_storeu_si256((__m256i *)(tile + b * TB + T_FM), _mm256_mullo_epi32(corr, _mm256_set1_epi32(-128)));
#endif
            }
        }
    }
}

/* rows r0 .. r0 + NR - 1 of y, the tile's TW columns; KIND and OFF as tile_kind gives them */
INLINE void tile_rows(const int NR, const int KIND, const int OFF, const int G, int64_t nb, const uint8_t *tile,
                      const qrows_t *a, int64_t r0, float *y, int64_t ys, const float *bias) {
    /* AVX2's Q6_K: the activations as u8 (see unpack_group) */
    const int8_t *xq = !QMM_VNNI && KIND == 3 ? (const int8_t *)a->xu + r0 * nb * QK : a->q + r0 * nb * QK;
    const float *xd = a->d + r0 * nb, *xs = a->s + r0 * nb;
    const int32_t *q16 = a->q16 ? a->q16 + r0 * 2 * nb : NULL, *o8 = a->o8 ? a->o8 + r0 * nb : NULL;
    vtf_t acc[ROW_TILE];
    for (int j = 0; j < NR; j++) acc[j] = T_ZEROF();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = tile + b * TB;
        vti_t is[ROW_TILE], sum[ROW_TILE];
#if QMM_VNNI
        for (int j = 0; j < NR; j++) {
            is[j] = KIND == 3 ? T_SET1I(-32 * q16[j * 2 * nb + 2 * b]) : T_ZEROI();
            sum[j] = T_ZEROI();
        }
#else
        const __m256i corr = KIND == 3 ? T_LOADI(o + T_FM) : T_ZEROI();
        for (int j = 0; j < NR; j++) is[j] = corr;
        (void)sum;
#endif
#if !QMM_VNNI /* maddubs: G steps' pair sums added in int16 (G x 2 x code max x 127 < 2^15), then widened */
        __m256i p16[ROW_TILE];
#endif
        #pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            const vti_t v = T_LOADI(o + u * 4 * TW);
            for (int j = 0; j < NR; j++) {
                int32_t xv;
                memcpy(&xv, xq + j * nb * QK + b * QK + 4 * u, 4);
#if QMM_VNNI
                is[j] = T_DP(is[j], v, T_SET1I(xv));
#else
                const __m256i pr = KIND == 3 ? _mm256_maddubs_epi16(_mm256_set1_epi32(xv), v)
                                             : _mm256_maddubs_epi16(v, _mm256_set1_epi32(xv));
                p16[j] = u % G == 0 ? pr : _mm256_add_epi16(p16[j], pr);
                PIN(p16[j]); /* 1.2-1.3x on Zen 3 at 512 rows */
                if (u % G == G - 1)
                    is[j] = _mm256_add_epi32(is[j], _mm256_madd_epi16(p16[j], KIND == 3 ? T_LOADI(o + T_SC + 32 * (u >> 2))
                                                                                     : _mm256_set1_epi16(1)));
#endif
            }
            if (QMM_VNNI && KIND == 3 && (u & 3) == 3) { /* a 16-value half done: times its int8 scale, in int32 */
                const vti_t sc = T_LOADI(o + T_SC + 4 * TW * (u >> 2));
                for (int j = 0; j < NR; j++) {
                    sum[j] = T_ADDI(sum[j], T_MULLO(is[j], sc));
                    if (u == 3) is[j] = T_SET1I(-32 * q16[j * 2 * nb + 2 * b + 1]);
                }
            }
        }
        const vtf_t fd = T_LOADF((const float *)(o + T_FD));
        const vtf_t fm = KIND == 2 ? T_LOADF((const float *)(o + T_FM)) : T_ZEROF();
        for (int j = 0; j < NR; j++) {
            vti_t s32 = QMM_VNNI && KIND == 3 ? sum[j] : is[j];
            if (KIND == 1) s32 = T_SUBI(s32, T_SET1I(OFF / 8 * o8[j * nb + b])); /* OFF x the block's code sum */
            acc[j] = T_FMA(T_MUL(fd, T_SET1F(xd[j * nb + b])), T_CVT(s32), acc[j]);
            if (KIND == 2) acc[j] = T_FMA(fm, T_SET1F(xs[j * nb + b]), acc[j]);
        }
    }
    const vtf_t bv = bias ? T_LOADF(bias) : T_ZEROF();
    for (int j = 0; j < NR; j++) T_STOREF(y + (r0 + j) * ys, T_ADD(acc[j], bv));
}

/* groups g0 .. g1 - 1 of w (one format) for all rows, TW / 8 groups at a time through the
 * scratch tile (nb * TB bytes), a last odd group by the group kernel */
static void run_tiles(const qweights_t *w, int64_t g0, int64_t g1, const qrows_t *a, int64_t rows, float *y,
                      int64_t ys, const float *bias, uint8_t *tile) {
    int off;
    const int kind = tile_kind(w->fmt, &off);
    const int64_t nb = w->k / QK, gb = group_bytes(w), per = TW / 8;
    const int five = w->fmt == FMT_Q5_1 || w->fmt == FMT_Q5_K;
    int64_t g = g0;
    for (; g + per <= g1; g += per) {
        for (int h = 0; h < per; h++) unpack_group(w->fmt, nb, (const uint8_t *)w->codes + (g + h) * gb, tile, h);
        const float *bg = bias ? bias + 8 * g : NULL;
        float *yg = y + 8 * g;
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_NR) {
            switch (kind) { /* G: int16 steps for 4-bit (8), 5-bit (4) and 6-bit (2) codes, maddubs only */
            case 1:
                if (off == 8) BY_TILE_MAX(TILE_NR, rows - r0, tile_rows, 1, 8, 8, nb, tile, a, r0, yg, ys, bg);
                else if (off == 16) BY_TILE_MAX(TILE_NR, rows - r0, tile_rows, 1, 16, 4, nb, tile, a, r0, yg, ys, bg);
                else BY_TILE_MAX(TILE_NR, rows - r0, tile_rows, 1, 128, 1, nb, tile, a, r0, yg, ys, bg);
                break;
            case 2:
                if (five) BY_TILE_MAX(TILE_NR, rows - r0, tile_rows, 2, 0, 4, nb, tile, a, r0, yg, ys, bg);
                else BY_TILE_MAX(TILE_NR, rows - r0, tile_rows, 2, 0, 8, nb, tile, a, r0, yg, ys, bg);
                break;
            default: BY_TILE_MAX(TILE_NR, rows - r0, tile_rows, 3, 0, 2, nb, tile, a, r0, yg, ys, bg); break;
            }
        }
    }
    for (; g < g1; g++) run_group(w, g, a, rows, y, ys, bias);
}
#endif

/* y [rows, n] (row stride n) = x [rows, k] (row stride xs, float32) times w, + bias, on
 * nthreads OpenMP threads (torch's count, passed in: a thread that never set it would get
 * OMP_NUM_THREADS or every core). Returns 0, -1 when out of memory, -2 for an unknown format
 * (or a concat part that is not one of the others, or of another k). */
int pagedkv_qmm(const qweights_t *w, int64_t rows, const float *x, int64_t xs, float *y, int nthreads) {
    if (w->fmt == FMT_CONCAT) {
        if (w->nparts < 1 || !w->parts) return -2;
        int64_t cols = 0;
        for (int64_t p = 0; p < w->nparts; p++) {
            if (!simple_fmt(w->parts[p]->fmt) || w->parts[p]->k != w->k) return -2;
            cols += w->parts[p]->n;
        }
        if (cols != w->n) return -2;
    } else if (!simple_fmt(w->fmt)) {
        return -2;
    }
    const int nt = nthreads > 0 ? nthreads : 1;
    /* the kernels that take the activations' sums of 16: Q4_0 and MXFP4 (AVX2 and VNNI), Q6_K and Q5_0 (VNNI) */
#define SUMS16(f) ((f) == FMT_Q4_0 || (f) == FMT_MXFP4 || (QMM_VNNI && ((f) == FMT_Q6_K || (f) == FMT_Q5_0)))
    int sums16 = SUMS16(w->fmt);
    for (int64_t p = 0; w->fmt == FMT_CONCAT && p < w->nparts; p++) sums16 |= SUMS16(w->parts[p]->fmt);
#undef SUMS16
#if QMM_TILES
    /* the column tiles' path (every part of a format it takes) */
    int tiles = rows >= TILE_ROWS, toff;
    for (int64_t p = 0; tiles && p < (w->fmt == FMT_CONCAT ? w->nparts : 1); p++) {
        const int32_t f = w->fmt == FMT_CONCAT ? w->parts[p]->fmt : w->fmt;
        const int kind = tile_kind(f, &toff);
        /* formats with minimums: the decode costs more, tiles from 3 x TILE_ROWS; but AVX2's
         * Q4_K / Q5_K group kernels are slower than their tiles from TILE_ROWS (Zen 3, 1 thread,
         * 16-47 rows: Q4_K 1.05-1.11x, Q5_K 1.06-1.19x; Q4_1 0.94-0.97x, so it keeps 48) */
        const int kq = !QMM_VNNI && (f == FMT_Q4_K || f == FMT_Q5_K);
        tiles = kind != 0 && (kind != 2 || kq || rows >= 3 * TILE_ROWS);
    }
    sums16 |= tiles;
    int want_xu = 0; /* AVX2's Q6_K tiles take the activations as u8 */
    for (int64_t p = 0; tiles && !QMM_VNNI && p < (w->fmt == FMT_CONCAT ? w->nparts : 1); p++)
        want_xu |= (w->fmt == FMT_CONCAT ? w->parts[p]->fmt : w->fmt) == FMT_Q6_K;
#else
    const int tiles = 0, want_xu = 0;
#endif
    /* which activations the parts take: int8 blocks, bf16 values, both, or neither (f16) */
    int want = 0;
    for (int64_t p = 0; p < (w->fmt == FMT_CONCAT ? w->nparts : 1); p++) {
        const int32_t f = w->fmt == FMT_CONCAT ? w->parts[p]->fmt : w->fmt;
        want |= f == FMT_BF16 ? 2 : f == FMT_F16 ? 0 : 1; /* f16 takes the float32 rows as given */
    }
    qrows_t a;
    if (quantize_rows(x, xs, rows, w->k, &a, nt, want & 1 ? sums16 : 0, want & 1 ? want_xu : 0, want)) return -1;
    const int64_t n = w->n;
    if (tiles) {
#if QMM_TILES
        /* the parts' (or the one matrix's) groups cut into one contiguous range per thread of
         * about equal weight bytes, each thread with its own scratch tile */
        const qweights_t *const one[1] = {w};
        const qweights_t *const *parts = w->fmt == FMT_CONCAT ? w->parts : one;
        const int64_t nparts = w->fmt == FMT_CONCAT ? w->nparts : 1;
        int64_t total = 0;
        for (int64_t p = 0; p < nparts; p++) total += parts[p]->n / 8 * group_bytes(parts[p]);
        int failed = 0;
        #pragma omp parallel num_threads(nt) reduction(|| : failed)
        {
            int64_t tid = 0, cnt = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            cnt = omp_get_num_threads();
#endif
            uint8_t *tile = aligned_alloc(64, (size_t)(w->k / QK * TB));
            if (!tile) {
                failed = 1;
            } else {
                const int64_t lo = total * tid / cnt, hi = total * (tid + 1) / cnt;
                int64_t before = 0, col = 0;
                for (int64_t p = 0; p < nparts; p++) {
                    const qweights_t *q = parts[p];
                    const int64_t gb = group_bytes(q), ng = q->n / 8;
                    int64_t g0 = lo > before ? (lo - before + gb - 1) / gb : 0, g1 = hi > before ? (hi - before + gb - 1) / gb : 0;
                    g0 = g0 < ng ? g0 : ng;
                    g1 = g1 < ng ? g1 : ng;
                    const float *bias = w->fmt == FMT_CONCAT && w->bias ? w->bias + col : q->bias;
                    if (g0 < g1) run_tiles(q, g0, g1, &a, rows, y + col, n, bias, tile);
                    before += ng * gb;
                    col += q->n;
                }
                free(tile);
            }
        }
        if (failed) {
            free(a.mem);
            return -1;
        }
#endif
    } else if (w->fmt != FMT_CONCAT) {
        #pragma omp parallel for if (rows * n * w->k >= PAR_MACS) num_threads(nt) schedule(static)
        for (int64_t g = 0; g < n / 8; g++) run_group(w, g, &a, rows, y, n, w->bias);
    } else {
        /* the activations quantised once; the parts' groups as one sequence, cut into one
         * contiguous range per thread of about equal weight bytes (parts of different formats
         * cost different bytes per group) */
        int64_t total = 0;
        for (int64_t p = 0; p < w->nparts; p++) total += w->parts[p]->n / 8 * group_bytes(w->parts[p]);
        const int use = rows * n * w->k >= PAR_MACS ? nt : 1;
        #pragma omp parallel num_threads(use)
        {
            int64_t tid = 0, cnt = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            cnt = omp_get_num_threads();
#endif
            const int64_t lo = total * tid / cnt, hi = total * (tid + 1) / cnt;
            int64_t before = 0, col = 0; /* bytes and columns of the earlier parts */
            for (int64_t p = 0; p < w->nparts; p++) {
                const qweights_t *q = w->parts[p];
                const int64_t gb = group_bytes(q), ng = q->n / 8;
                /* this thread's groups of q: those whose first byte lies in [lo, hi) */
                int64_t g0 = lo > before ? (lo - before + gb - 1) / gb : 0, g1 = hi > before ? (hi - before + gb - 1) / gb : 0;
                g0 = g0 < ng ? g0 : ng;
                g1 = g1 < ng ? g1 : ng;
                const float *bias = w->bias ? w->bias + col : q->bias;
                for (int64_t g = g0; g < g1; g++) run_group(q, g, &a, rows, y + col, n, bias);
                before += ng * gb;
                col += q->n;
            }
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

/* ---- GGUF blocks -> the layouts above (at model load) ------------------------------------- */

#define GGML_F16 1
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define GGML_MXFP4 39

static inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline uint64_t ld64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static inline void st32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

#define NIB 0x0F0F0F0Fu
/* Little-endian words throughout (x86). 32 code bytes q of a K-quant holding two sub-blocks of
 * 32 (low nibbles: sub-block "even", high: "odd") -> column i's int4-layout bytes of both
 * (step t: byte e = element 8t + e low, 8t + 4 + e high). */
static inline void put_nibble_pair(const uint8_t *q, int i, uint8_t *even, uint8_t *odd) {
    for (int t = 0; t < 4; t++) {
        uint32_t a = ld32(q + 8 * t), b = ld32(q + 8 * t + 4);
        st32(even + 32 * t + 4 * i, (a & NIB) | ((b & NIB) << 4));
        st32(odd + 32 * t + 4 * i, ((a >> 4) & NIB) | (b & ~NIB));
    }
}

/* Q4_1 -> the int4 group-block at out (the same bytes: codes, d, m). Codes: elements 0..15 in
 * the low nibbles of the 16 code bytes, 16..31 in the high. */
static void pack_q41_block(const uint8_t *const *rows, int64_t b, uint8_t *out) {
    for (int i = 0; i < 8; i++) {
        const uint8_t *blk = rows[i] + b * 20, *qs = blk + 4;
        for (int t = 0; t < 2; t++) {
            uint32_t a = ld32(qs + 8 * t), c = ld32(qs + 8 * t + 4);
            st32(out + 32 * t + 4 * i, (a & NIB) | ((c & NIB) << 4));
            st32(out + 32 * (t + 2) + 4 * i, ((a >> 4) & NIB) | (c & ~NIB));
        }
        memcpy(out + 128 + 2 * i, blk, 2);
        memcpy(out + 144 + 2 * i, blk + 2, 2);
    }
}

/* Q4_0 (bs 18) / Q5_0 (22) / Q5_1 (24) block b of the 8 rows -> one Q40/Q50/Q51 group-block:
 * the codes' low nibbles in the int4 layout, Q5's high bits (qh bit j = element j) as
 * byte 4i + e bit 2t = element 8t + e, bit 2t + 1 = 8t + 4 + e, then d (and Q5_1's m). */
static void pack_q4x_block(const uint8_t *const *rows, int64_t b, int bs, uint8_t *out) {
    const int five = bs != 18, qs_off = bs == 18 ? 2 : bs == 22 ? 6 : 8, d_off = five ? 160 : 128;
    for (int i = 0; i < 8; i++) {
        const uint8_t *blk = rows[i] + b * bs, *qs = blk + qs_off;
        for (int t = 0; t < 2; t++) {
            uint32_t a = ld32(qs + 8 * t), c = ld32(qs + 8 * t + 4);
            st32(out + 32 * t + 4 * i, (a & NIB) | ((c & NIB) << 4));
            st32(out + 32 * (t + 2) + 4 * i, ((a >> 4) & NIB) | (c & ~NIB));
        }
        if (five) {
            const uint32_t qh = ld32(blk + (bs == 22 ? 2 : 4));
            for (int e = 0; e < 4; e++) {
                uint8_t hb = 0;
                for (int t = 0; t < 4; t++)
                    hb |= (uint8_t)((((qh >> (8 * t + e)) & 1) << (2 * t)) | (((qh >> (8 * t + 4 + e)) & 1) << (2 * t + 1)));
                out[128 + 4 * i + e] = hb;
            }
        }
        memcpy(out + d_off + 2 * i, blk, 2);
        if (bs == 24) memcpy(out + 176 + 2 * i, blk + 2, 2);
    }
}

/* MXFP4 (bs 17: e, then qs with element j in the low nibble of qs[j], j + 16 in the high, as
 * Q4_0's) block b of the 8 rows -> one MX4 group-block: the codes in the int4 layout, then e. */
static void pack_mxfp4_block(const uint8_t *const *rows, int64_t b, uint8_t *out) {
    for (int i = 0; i < 8; i++) {
        const uint8_t *blk = rows[i] + b * 17, *qs = blk + 1;
        for (int t = 0; t < 2; t++) {
            uint32_t a = ld32(qs + 8 * t), c = ld32(qs + 8 * t + 4);
            st32(out + 32 * t + 4 * i, (a & NIB) | ((c & NIB) << 4));
            st32(out + 32 * (t + 2) + 4 * i, ((a >> 4) & NIB) | (c & ~NIB));
        }
        out[128 + i] = blk[0];
    }
}

static void pack_q8_0_block(const uint8_t *const *rows, int64_t b, uint8_t *out) {
    for (int i = 0; i < 8; i++) {
        const uint8_t *blk = rows[i] + b * 34;
        for (int t = 0; t < 8; t++) memcpy(out + 32 * t + 4 * i, blk + 2 + 4 * t, 4);
        memcpy(out + 256 + 2 * i, blk, 2);
    }
}

/* Q5_K's high bits of one column (qh[e] bit s = sub-block s, element e) -> its 4 bytes per
 * sub-block s at out + 32 s (byte j bit m = element j + 4m: bit 2t = 8t + j, 2t + 1 = 8t + 4 + j).
 * A transpose of the bit indices m (bits 32m + 8j + s of qh) and s: three delta swaps. */
static inline void put_q5_high(const uint8_t *qh, uint8_t *out) {
    uint64_t w[4];
    for (int q = 0; q < 4; q++) {
        uint64_t x = ld64(qh + 8 * q), t = (x ^ (x >> 31)) & 0x00000000AAAAAAAAull; /* m0 <-> s0 */
        w[q] = x ^ t ^ (t << 31);
    }
    for (int q = 0; q < 4; q += 2) { /* m1 <-> s1 */
        uint64_t t = ((w[q] >> 2) ^ w[q + 1]) & 0x3333333333333333ull;
        w[q + 1] ^= t;
        w[q] ^= t << 2;
    }
    for (int q = 0; q < 2; q++) { /* m2 <-> s2 */
        uint64_t t = ((w[q] >> 4) ^ w[q + 2]) & 0x0F0F0F0F0F0F0F0Full;
        w[q + 2] ^= t;
        w[q] ^= t << 4;
    }
    for (int s = 0; s < 8; s++) st32(out + 32 * s, (uint32_t)(w[s >> 1] >> (32 * (s & 1))));
}

/* Q4_K (five 0) / Q5_K super-block b of the 8 rows -> one group-block */
static void pack_q45k_block(const uint8_t *const *rows, int64_t b, int five, uint8_t *out) {
    const int bs = five ? 176 : 144, SC = five ? Q5K_SC : Q4K_SC;
    for (int i = 0; i < 8; i++) {
        const uint8_t *blk = rows[i] + b * bs, *qs = blk + (five ? 48 : 16);
        for (int p = 0; p < 4; p++) /* sub-blocks 2p (low nibbles) and 2p + 1 (high) share 32 bytes */
            put_nibble_pair(qs + 32 * p, i, out + 128 * (2 * p), out + 128 * (2 * p + 1));
        if (five) put_q5_high(blk + 16, out + Q5K_QH + 4 * i);
        for (int q = 0; q < 12; q++) out[SC + 8 * q + i] = blk[4 + q];
        memcpy(out + SC + 96 + 2 * i, blk, 2);
        memcpy(out + SC + 112 + 2 * i, blk + 2, 2);
    }
}

/* Q6_K: element 128h + 32c + e has the low nibble of ql[64h + 32(c & 1) + e] (c < 2) or its
 * high nibble (c >= 2), and upper bits (qh[32h + e] >> 2c) & 3. */
static void pack_q6k_block(const uint8_t *const *rows, int64_t b, uint8_t *out) {
    for (int i = 0; i < 8; i++) {
        const uint8_t *blk = rows[i] + b * 210, *ql = blk, *qh = blk + 128;
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 2; c++) /* sub-blocks 4h + c (low nibbles) and 4h + c + 2 (high) */
                put_nibble_pair(ql + 64 * h + 32 * c, i, out + 128 * (4 * h + c), out + 128 * (4 * h + c + 2));
        /* upper bits: for 16 elements 16f + j + 4m (m, j < 4) of half h, qh bytes hold the 2-bit
         * fields [m][j][c] (bits 32m + 8j + 2c); the layout wants [c][j][m] (out byte j of
         * sub-block 4h + c, step half f: field m = element 16f + j + 4m): swap m and c. */
        for (int h = 0; h < 2; h++)
            for (int f = 0; f < 2; f++) {
                uint64_t A = ld64(qh + 32 * h + 16 * f), B = ld64(qh + 32 * h + 16 * f + 8), t;
                t = (A ^ (A >> 30)) & 0x00000000CCCCCCCCull; /* m0 <-> c0 */
                A ^= t ^ (t << 30);
                t = (B ^ (B >> 30)) & 0x00000000CCCCCCCCull;
                B ^= t ^ (t << 30);
                t = ((A >> 4) ^ B) & 0x0F0F0F0F0F0F0F0Full; /* m1 <-> c1 */
                B ^= t;
                A ^= t << 4;
                uint8_t *o = out + Q6K_QH + 64 * (4 * h) + 32 * f + 4 * i;
                st32(o, (uint32_t)A);
                st32(o + 64, (uint32_t)(A >> 32));
                st32(o + 128, (uint32_t)B);
                st32(o + 192, (uint32_t)(B >> 32));
            }
        for (int q = 0; q < 16; q++) out[Q6K_SC + 8 * q + i] = blk[192 + q];
        memcpy(out + Q6K_D + 2 * i, blk + 208, 2);
    }
}

/* n rows (n a multiple of 8) of k values in GGML type ggml_type as stored (row r's blocks at
 * raw + r * raw_row_stride) -> out in the layout of its format, the file's bytes moved: Q4_1 ->
 * fmt 4 (the int4 layout), Q4_0 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 -> fmt
 * 100 + type.
 * OpenMP over groups of 8 rows. Returns 0; -2 for another type or a k that is not a whole
 * number of its blocks. */
int pagedkv_pack_gguf(int ggml_type, int64_t n, int64_t k, const uint8_t *raw, int64_t raw_row_stride, uint8_t *out) {
    int64_t per, out_bytes, bs;
    switch (ggml_type) {
    case GGML_Q4_0: per = QK; bs = 18; out_bytes = Q40_BLOCK; break;
    case GGML_Q4_1: per = QK; bs = 20; out_bytes = Q4_BLOCK; break;
    case GGML_Q5_0: per = QK; bs = 22; out_bytes = Q50_BLOCK; break;
    case GGML_Q5_1: per = QK; bs = 24; out_bytes = Q51_BLOCK; break;
    case GGML_Q8_0: per = QK; bs = 34; out_bytes = Q80_BLOCK; break;
    case GGML_MXFP4: per = QK; bs = 17; out_bytes = MX4_BLOCK; break;
    case GGML_Q4_K: per = QK_K; bs = 144; out_bytes = Q4K_BLOCK; break;
    case GGML_Q5_K: per = QK_K; bs = 176; out_bytes = Q5K_BLOCK; break;
    case GGML_Q6_K: per = QK_K; bs = 210; out_bytes = Q6K_BLOCK; break;
    case GGML_F16: per = QK; bs = 64; out_bytes = 64; break; /* rows kept as they are (FMT_F16) */
    default: return -2;
    }
    (void)bs;
    if (k % per || k <= 0 || n % 8) return -2;
    if (ggml_type == GGML_F16) { /* row-major, no reordering: each row's 2 k bytes in turn */
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < n; r++) memcpy(out + r * 2 * k, raw + r * raw_row_stride, (size_t)(2 * k));
        return 0;
    }
    const int64_t nb = k / per;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    {   /* out is fresh memory written once here: 2 MiB pages (where the kernel's transparent huge
         * pages are on "madvise") take ~500x fewer first-touch faults, which cost more than the
         * packing, and fewer TLB misses when the kernels stream the weights. Advice only. */
        const uintptr_t page = 4096, lo = ((uintptr_t)out + page - 1) & ~(page - 1);
        const uintptr_t hi = ((uintptr_t)out + (uintptr_t)(n / 8 * nb * out_bytes)) & ~(page - 1);
        if (hi > lo && hi - lo >= ((uintptr_t)4 << 20)) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
    }
#endif
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / 8; g++) {
        const uint8_t *rows[8];
        for (int i = 0; i < 8; i++) rows[i] = raw + (8 * g + i) * raw_row_stride;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * out_bytes;
            switch (ggml_type) {
            case GGML_Q4_0: pack_q4x_block(rows, b, 18, o); break;
            case GGML_Q5_0: pack_q4x_block(rows, b, 22, o); break;
            case GGML_Q5_1: pack_q4x_block(rows, b, 24, o); break;
            case GGML_Q4_1: pack_q41_block(rows, b, o); break;
            case GGML_Q8_0: pack_q8_0_block(rows, b, o); break;
            case GGML_MXFP4: pack_mxfp4_block(rows, b, o); break;
            case GGML_Q4_K: pack_q45k_block(rows, b, 0, o); break;
            case GGML_Q5_K: pack_q45k_block(rows, b, 1, o); break;
            default: pack_q6k_block(rows, b, o); break;
            }
        }
    }
    return 0;
}

/* Packed GGUF weights (fmt 102, 106, 107, 108, 112, 113, 114, 139; 4 as pagedkv_q4_dequant)
 * as float32 out [n, k], with GGUF's own float formulas (gguf-py's dequantize: (d sc) c -
 * (dmin m), (d sc) (c - 32), d c, 2^(e - 128) kv[c]), so equal to it: what tests compare the
 * packing with. Returns 0, -2 for another fmt. */
int pagedkv_gguf_dequant(int fmt, int64_t n, int64_t k, const uint8_t *codes, float *out) {
    if (fmt == FMT_F16) {
        const uint16_t *h = (const uint16_t *)codes;
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < n; r++)
            for (int64_t e = 0; e < k; e++) out[r * k + e] = half_to_float(h[r * k + e]);
        return 0;
    }
    if (fmt == FMT_Q4) {
        pagedkv_q4_dequant(k, n, codes, out);
        return 0;
    }
    if (fmt == FMT_Q4_0 || fmt == FMT_Q5_0 || fmt == FMT_Q5_1) {
        const int64_t nb = k / QK, bytes = fmt == FMT_Q4_0 ? Q40_BLOCK : fmt == FMT_Q5_0 ? Q50_BLOCK : Q51_BLOCK;
        const int five = fmt != FMT_Q4_0, doff = five ? 160 : 128;
        #pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < n / 8; g++)
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *w = codes + (g * nb + b) * bytes;
                for (int i = 0; i < 8; i++) {
                    uint16_t h;
                    memcpy(&h, w + doff + 2 * i, 2);
                    const float d = half_to_float(h);
                    float m = 0.0f;
                    if (fmt == FMT_Q5_1) {
                        memcpy(&h, w + 176 + 2 * i, 2);
                        m = half_to_float(h);
                    }
                    float *o = out + (8 * g + i) * k + b * QK;
                    for (int t = 0; t < 4; t++)
                        for (int e = 0; e < 8; e++) {
                            const int hi = e >= 4, ee = e & 3;
                            int c = (w[32 * t + 4 * i + ee] >> (4 * hi)) & 15;
                            if (five) c |= ((w[128 + 4 * i + ee] >> (2 * t + hi)) & 1) << 4;
                            o[8 * t + e] = fmt == FMT_Q5_1 ? d * (float)c + m : d * (float)(c - (five ? 16 : 8));
                        }
                }
            }
        return 0;
    }
    if (fmt == FMT_MXFP4) { /* kv[c] x 2^(e - 128): exact (inf where it overflows), as gguf's */
        const int64_t nb = k / QK;
        #pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < n / 8; g++)
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *w = codes + (g * nb + b) * MX4_BLOCK;
                for (int i = 0; i < 8; i++) {
                    const float d = e8m0_half(w[128 + i]);
                    float *o = out + (8 * g + i) * k + b * QK;
                    for (int t = 0; t < 4; t++)
                        for (int e = 0; e < 8; e++)
                            o[8 * t + e] = d * (float)KV_MXFP4[(w[32 * t + 4 * i + (e & 3)] >> (4 * (e >= 4))) & 15];
                }
            }
        return 0;
    }
    if (fmt != FMT_Q8_0 && fmt != FMT_Q4_K && fmt != FMT_Q5_K && fmt != FMT_Q6_K) return -2;
    const int64_t per = fmt == FMT_Q8_0 ? QK : QK_K, nb = k / per;
    const int64_t bytes = fmt == FMT_Q8_0 ? Q80_BLOCK : fmt == FMT_Q4_K ? Q4K_BLOCK : fmt == FMT_Q5_K ? Q5K_BLOCK : Q6K_BLOCK;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = codes + (g * nb + b) * bytes;
            for (int i = 0; i < 8; i++) {
                float *o = out + (8 * g + i) * k + b * per;
                uint16_t h;
                if (fmt == FMT_Q8_0) {
                    memcpy(&h, w + 256 + 2 * i, 2);
                    float d = half_to_float(h);
                    for (int t = 0; t < 8; t++)
                        for (int e = 0; e < 4; e++) o[4 * t + e] = d * (float)(int8_t)w[32 * t + 4 * i + e];
                } else if (fmt == FMT_Q6_K) {
                    memcpy(&h, w + Q6K_D + 2 * i, 2);
                    float d = half_to_float(h);
                    for (int s = 0; s < 8; s++)
                        for (int t = 0; t < 4; t++)
                            for (int e = 0; e < 8; e++) {
                                int hi = e >= 4, ee = e & 3;
                                uint8_t nib = w[128 * s + 32 * t + 4 * i + ee] >> (4 * hi);
                                uint8_t up = w[Q6K_QH + 64 * s + 32 * (t >> 1) + 4 * i + ee] >> (4 * (t & 1) + 2 * hi);
                                int c = ((nib & 15) | ((up & 3) << 4)) - 32;
                                float dsc = d * (float)(int8_t)w[Q6K_SC + 8 * (2 * s + (t >> 1)) + i];
                                o[32 * s + 8 * t + e] = dsc * (float)c;
                            }
                } else {
                    const int five = fmt == FMT_Q5_K, SC = five ? Q5K_SC : Q4K_SC;
                    uint16_t hm;
                    memcpy(&h, w + SC + 96 + 2 * i, 2);
                    memcpy(&hm, w + SC + 112 + 2 * i, 2);
                    float d = half_to_float(h), dmin = half_to_float(hm);
                    for (int s = 0; s < 8; s++) {
                        int sc, m;
                        k4_scale_min(w + SC, i, s, &sc, &m);
                        float dsc = d * (float)sc, dm = dmin * (float)m;
                        for (int t = 0; t < 4; t++)
                            for (int e = 0; e < 8; e++) {
                                int hi = e >= 4, ee = e & 3;
                                int c = (w[128 * s + 32 * t + 4 * i + ee] >> (4 * hi)) & 15;
                                if (five) c |= ((w[Q5K_QH + 32 * s + 4 * i + ee] >> (2 * t + hi)) & 1) << 4;
                                o[32 * s + 8 * t + e] = dsc * (float)c - dm;
                            }
                    }
                }
            }
        }
    return 0;
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
