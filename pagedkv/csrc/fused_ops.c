/* Fused element-wise ops of the decoder layer (pagedkv.ops.fused_ops), for a float32 model on the
 * CPU. Each replaces several torch calls (and their dtype conversions) by one pass over the
 * rows; the matmuls and attention stay where they are. No Python or torch headers: built with
 * the system C compiler through pagedkv.ops.build.compile_c.
 *
 * Activations are float32 (dt 0) or bfloat16 (dt 1, stored as uint16, rounded to nearest even
 * as torch rounds): a weight format whose kernels take and return bfloat16 (int4, int8, bf16)
 * gets bfloat16 inputs and hands back bfloat16 outputs, so no separate conversions are needed.
 * Row-parallel with OpenMP (the same libgomp torch uses) when there are enough rows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float ld(const void *p, int64_t i, int dt) {
    return dt ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void st(void *p, int64_t i, float v, int dt) {
    if (dt) ((uint16_t *)p)[i] = f2bf(v); else ((float *)p)[i] = v;
}

#define PAR_ROWS 8 /* below this many rows one thread is faster than waking the pool */

/* residual [T, H] float32 (row stride rs); when delta is given (dt_delta, row stride ds):
 * residual += delta first. Then out[t] = residual[t] / sqrt(mean(residual[t]^2) + eps) * (w + offset),
 * w float32 [H]; out [T, H] contiguous in dt_out. The mean of squares is summed in double. */
void pagedkv_add_rms_norm(int64_t T, int64_t H, float *residual, int64_t rs, const void *delta, int64_t ds,
                          int dt_delta, const float *w, float eps, float offset, void *out, int dt_out) {
    #pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *r = residual + t * rs;
        if (delta) {
            for (int64_t i = 0; i < H; i++) r[i] += ld(delta, t * ds + i, dt_delta);
        }
        double ss = 0.0;
        for (int64_t i = 0; i < H; i++) ss += (double)r[i] * r[i];
        const float inv = 1.0f / sqrtf((float)(ss / (double)H) + eps);
        for (int64_t i = 0; i < H; i++) st(out, t * H + i, r[i] * inv * (w[i] + offset), dt_out);
    }
}

/* Per-head RMSNorm in place (Qwen3's q/k norms, before RoPE): x holds T rows (row stride xs, in
 * dt) of which columns [0, nh d) are nh heads of d values; each head is replaced by
 * head / sqrt(mean(head^2) + eps) * (w + offset), w float32 [d]. Mean of squares in double. */
void pagedkv_head_rms_norm(int64_t T, int nh, int d, void *x, int64_t xs, int dt, const float *w, float eps,
                           float offset) {
    #pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int h = 0; h < nh; h++) {
            const int64_t base = t * xs + (int64_t)h * d;
            double ss = 0.0;
            for (int j = 0; j < d; j++) {
                const float v = ld(x, base + j, dt);
                ss += (double)v * v;
            }
            const float inv = 1.0f / sqrtf((float)(ss / (double)d) + eps);
            for (int j = 0; j < d; j++) st(x, base + j, ld(x, base + j, dt) * inv * (w[j] + offset), dt);
        }
    }
}

/* qkv [T, (nq + 2 nkv) d] in dt_in (row stride qs): rows of q heads, k heads, v heads.
 * cos/sin float32 [T, d/2] (contiguous). Rotate-half RoPE of q and k into q_out [T, nq, d] and
 * k_out [T, nkv, d]; v copied into v_out [T, nkv, d]; outputs float32 contiguous:
 * out[j] = x[j] cos[j] - x[j + d/2] sin[j], out[j + d/2] = x[j + d/2] cos[j] + x[j] sin[j]. */
void pagedkv_rope_split(int64_t T, int nq, int nkv, int d, const void *qkv, int64_t qs, int dt_in,
                        const float *cos_t, const float *sin_t, float *q_out, float *k_out, float *v_out) {
    const int half = d / 2;
    #pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int h = 0; h < nq + nkv; h++) {
            const int64_t base = t * qs + (int64_t)h * d;
            float *o = h < nq ? q_out + (t * nq + h) * (int64_t)d : k_out + (t * nkv + (h - nq)) * (int64_t)d;
            for (int j = 0; j < half; j++) {
                const float x1 = ld(qkv, base + j, dt_in), x2 = ld(qkv, base + j + half, dt_in);
                o[j] = x1 * c[j] - x2 * s[j];
                o[j + half] = x2 * c[j] + x1 * s[j];
            }
        }
        for (int h = 0; h < nkv; h++) {
            const int64_t base = t * qs + (int64_t)(nq + nkv + h) * d;
            float *o = v_out + (t * nkv + h) * (int64_t)d;
            for (int j = 0; j < d; j++) o[j] = ld(qkv, base + j, dt_in);
        }
    }
}

#ifdef __AVX2__
#include <immintrin.h>
/* e^x for 8 floats: x clamped to [-87.3, 88.3] (no denormals), n = round(x log2 e),
 * r = x - n ln 2 in two parts, e^r by the degree-7 Taylor-fitted polynomial of Cephes' expf
 * (about 1 ulp), times 2^n built in the exponent bits; x above 88.3 gives +inf as expf does, so
 * act_mul's sigmoid of a huge negative z is 0, not 1 / e^88.3 (g * that is not 0 for |g| ~ 1e38). */
static inline __m256 exp8(__m256 x) {
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.3f), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY), over);
}
static inline __m256 ld8(const void *p, int64_t i, int dt) {
    if (!dt) return _mm256_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
#endif

/* gate_up [T, 2 I] in dt_in (row stride gs): gate columns then up columns.
 * out [T, I] contiguous in dt_out = act(gate) * up, act = SiLU (gelu 0) or tanh-GELU (gelu 1).
 * Both are g * sigmoid(z): z = g for SiLU; z = 2 sqrt(2/pi) (g + 0.044715 g^3) for tanh-GELU
 * (0.5 (1 + tanh(y)) = sigmoid(2 y)). With AVX2, 8 columns at a time through exp8. */
void pagedkv_act_mul(int64_t T, int64_t I, const void *gate_up, int64_t gs, int dt_in, int gelu,
                     void *out, int dt_out) {
    const float k2 = 2.0f * 0.7978845608028654f; /* 2 sqrt(2 / pi) */
    #pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int64_t i = 0;
#ifdef __AVX2__
        for (; i + 8 <= I; i += 8) {
            const __m256 g = ld8(gate_up, t * gs + i, dt_in), u = ld8(gate_up, t * gs + I + i, dt_in);
            __m256 z = g;
            if (gelu)
                z = _mm256_mul_ps(_mm256_set1_ps(k2),
                                  _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
            const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                             _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
            const __m256 a = _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
            if (!dt_out) {
                _mm256_storeu_ps((float *)out + t * I + i, a);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, a);
                for (int j = 0; j < 8; j++) st(out, t * I + i + j, tmp[j], dt_out);
            }
        }
#endif
        for (; i < I; i++) {
            const float g = ld(gate_up, t * gs + i, dt_in), u = ld(gate_up, t * gs + I + i, dt_in);
            const float z = gelu ? k2 * (g + 0.044715f * g * g * g) : g;
            st(out, t * I + i, g / (1.0f + expf(-z)) * u, dt_out);
        }
    }
}
