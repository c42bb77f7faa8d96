/* Fused element-wise ops of the decoder layer (pagedkv.model.fused), for a float32 model on the
 * CPU. Each replaces several torch calls (and their dtype conversions) by one pass over the
 * rows; the matmuls and attention stay where they are. No Python or torch headers: built with
 * the system C compiler through pagedkv.csrc.compile_c.
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

/* gate_up [T, 2 I] in dt_in (row stride gs): gate columns then up columns.
 * out [T, I] contiguous in dt_out = act(gate) * up, act = SiLU (gelu 0) or tanh-GELU (gelu 1). */
void pagedkv_act_mul(int64_t T, int64_t I, const void *gate_up, int64_t gs, int dt_in, int gelu,
                     void *out, int dt_out) {
    #pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < I; i++) {
            const float g = ld(gate_up, t * gs + i, dt_in), u = ld(gate_up, t * gs + I + i, dt_in);
            float a;
            if (gelu) {
                const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
                a = 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g)));
            } else {
                a = g / (1.0f + expf(-g));
            }
            st(out, t * I + i, a * u, dt_out);
        }
    }
}
