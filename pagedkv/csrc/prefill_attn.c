/* pagedkv causal prefill attention on the CPU: one sequence's chunk of query rows against its
 * gathered context (pagedkv.attention.prefill_kernel), float32.
 *
 * Built at first use with the system C compiler and called through ctypes; no Python or torch
 * headers. GCC vector extensions (8 floats) instead of intrinsics, so one source gives AVX2,
 * AVX-512 or SSE code, whatever -march allows.
 *
 * Why not the decode kernel: that one dots one query row with one K row at a time (a horizontal
 * sum per score) and re-reads the context for every row. Here a work item is RB query rows of
 * one query head; the item walks the visible keys in tiles of KT and computes the RB x KT score
 * tile as outer products over the head dimension against K stored transposed tile by tile
 * (written once per call): 2 K vectors and RB broadcasts feed 2 RB FMAs, no horizontal sums.
 * Then an online softmax per row (running max m, running sum l, float32) and P V accumulated
 * 8 dimensions at a time. Causal: query row j (0-based in the chunk of ql rows) sits at
 * position n - ql + j of the n context tokens and sees keys 0 .. n - ql + j; tiles past an
 * item's last visible key are never read, keys past a row's own position get weight 0.
 *
 * Layout (strides in floats): q[j * q_tok + h * q_head + e], k/v[t * kv_tok + h * kv_head + e],
 * out[j * o_tok + h * o_head + e]; head_dim d a multiple of 8, at most MAXD; hq a multiple of
 * hkv (query head h reads KV head h / (hq / hkv)).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RB 4      /* query rows per work item */
#define KT 16     /* keys per tile */
#define MAXD 256  /* head dim */

typedef float v8f __attribute__((vector_size(32)));
static inline v8f ld8(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
static inline void st8(float *p, v8f v) { memcpy(p, &v, 32); }
static inline v8f bc8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* exp(x) for x <= 0 (scores minus their running max): Cody-Waite reduction + degree-6
 * polynomial, a few ulp; written so the tile loop vectorises (libm's expf does not). */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float sc;
    memcpy(&sc, &e, 4);
    return p * sc;
}

int pagedkv_prefill_max_head_dim(void) { return MAXD; }

/* Returns 0; -1 for shapes it does not take (d not a multiple of 8 or over MAXD, hq not a
 * multiple of hkv, ql > n, a count below 1); -2 when the transposed-K buffer cannot be
 * allocated. Runs on nthreads OpenMP threads. */
int pagedkv_prefill_attention(int ql, int n, int hq, int hkv, int d, float scale,
                              const float *q, int64_t q_tok, int64_t q_head,
                              const float *k, const float *v, int64_t kv_tok, int64_t kv_head,
                              float *out, int64_t o_tok, int64_t o_head, int nthreads) {
    if (ql < 1 || n < ql || hq < 1 || hkv < 1 || hq % hkv || d < 8 || d % 8 || d > MAXD) return -1;
    const int g = hq / hkv, nt = nthreads > 0 ? nthreads : 1;
    const int64_t npad = ((int64_t)n + KT - 1) / KT * KT;
    float *kt = malloc(sizeof(float) * (size_t)hkv * (size_t)d * (size_t)npad);
    if (!kt) return -2;

    /* K transposed tile by tile, kt[h][t / KT][e][t % KT] = k[t][h][e] (zeros past n): a tile's
     * d x KT floats are contiguous (a plain [e][t] layout strides the L1 sets and thrashes) */
    const int64_t ntile = npad / KT;
    #pragma omp parallel for num_threads(nt) schedule(static) if (hkv * ntile >= 8)
    for (int64_t w = 0; w < hkv * ntile; w++) {
        const int h = (int)(w / ntile);
        const int64_t t0 = (w % ntile) * KT;
        float *dst = kt + (int64_t)h * d * npad + t0 * d;  /* this tile's d x KT floats */
        for (int64_t t = t0; t < t0 + KT; t++) {
            const float *src = k + t * kv_tok + (int64_t)h * kv_head;
            for (int e = 0; e < d; e++) dst[e * KT + (t - t0)] = t < n ? src[e] : 0.0f;
        }
    }

    const int nrb = (ql + RB - 1) / RB;
    const int64_t items = (int64_t)hq * nrb;
    /* the longest items (last rows: most keys) first, so the dynamic schedule ends level */
    #pragma omp parallel for num_threads(nt) schedule(dynamic, 2) if (items >= 2)
    for (int64_t it = 0; it < items; it++) {
        const int qh = (int)(it % hq), rb = nrb - 1 - (int)(it / hq);
        const int h = qh / g, r0 = rb * RB, nr = ql - r0 < RB ? ql - r0 : RB;
        const float *kth = kt + (int64_t)h * d * npad;
        const float *vh = v + (int64_t)h * kv_head;
        float qs[RB][MAXD] __attribute__((aligned(32)));
        float acc[RB][MAXD] __attribute__((aligned(32)));
        float m[RB], l[RB];
        int vis[RB];  /* last key each row sees */
        for (int r = 0; r < RB; r++) {
            const float *qr = q + (int64_t)(r0 + (r < nr ? r : 0)) * q_tok + (int64_t)qh * q_head;
            for (int e = 0; e < d; e++) qs[r][e] = r < nr ? qr[e] * scale : 0.0f;
            memset(acc[r], 0, sizeof(float) * (size_t)d);
            m[r] = -INFINITY;
            l[r] = 0.0f;
            vis[r] = n - ql + r0 + (r < nr ? r : nr - 1);
        }
        const int last = vis[nr - 1];
        for (int t0 = 0; t0 <= last; t0 += KT) {
            v8f s[RB][2];
            const float *kt0 = kth + (int64_t)t0 * d;
            for (int r = 0; r < RB; r++) s[r][0] = s[r][1] = bc8(0.0f);
            for (int e = 0; e < d; e++) {
                const v8f k0 = ld8(kt0 + e * KT), k1 = ld8(kt0 + e * KT + 8);
                for (int r = 0; r < RB; r++) {
                    const v8f b = bc8(qs[r][e]);
                    s[r][0] += b * k0;
                    s[r][1] += b * k1;
                }
            }
            for (int r = 0; r < nr; r++) {
                float sc[KT] __attribute__((aligned(32))), p[KT] __attribute__((aligned(32)));
                st8(sc, s[r][0]);
                st8(sc + 8, s[r][1]);
                const int nv = vis[r] - t0 + 1 < KT ? vis[r] - t0 + 1 : KT;  /* visible keys here */
                if (nv <= 0) continue;
                for (int j = 0; j < KT; j++) sc[j] = j < nv ? sc[j] : -INFINITY;
                float mx = m[r];
                for (int j = 0; j < KT; j++) mx = sc[j] > mx ? sc[j] : mx;
                for (int j = 0; j < KT; j++) p[j] = j < nv ? exp_neg(sc[j] - mx) : 0.0f;
                const float corr = m[r] == -INFINITY ? 0.0f : exp_neg(m[r] - mx);
                float sum = 0.0f;
                for (int j = 0; j < KT; j++) sum += p[j];
                l[r] = l[r] * corr + sum;
                m[r] = mx;
                /* acc += P V: 64 dimensions (8 independent accumulators) at a time, so the FMA
                 * chains overlap; the rest 8 at a time */
                float *ar = acc[r];
                const float *vt = vh + (int64_t)t0 * kv_tok;
                const v8f cv = bc8(corr);
                int e = 0;
                for (; e + 64 <= d; e += 64) {
                    v8f a0 = ld8(ar + e) * cv, a1 = ld8(ar + e + 8) * cv, a2 = ld8(ar + e + 16) * cv,
                        a3 = ld8(ar + e + 24) * cv, a4 = ld8(ar + e + 32) * cv, a5 = ld8(ar + e + 40) * cv,
                        a6 = ld8(ar + e + 48) * cv, a7 = ld8(ar + e + 56) * cv;
                    for (int j = 0; j < nv; j++) {
                        const float *vr = vt + (int64_t)j * kv_tok + e;
                        const v8f b = bc8(p[j]);
                        a0 += b * ld8(vr); a1 += b * ld8(vr + 8); a2 += b * ld8(vr + 16); a3 += b * ld8(vr + 24);
                        a4 += b * ld8(vr + 32); a5 += b * ld8(vr + 40); a6 += b * ld8(vr + 48); a7 += b * ld8(vr + 56);
                    }
                    st8(ar + e, a0); st8(ar + e + 8, a1); st8(ar + e + 16, a2); st8(ar + e + 24, a3);
                    st8(ar + e + 32, a4); st8(ar + e + 40, a5); st8(ar + e + 48, a6); st8(ar + e + 56, a7);
                }
                for (; e < d; e += 8) {
                    v8f a = ld8(ar + e) * cv;
                    for (int j = 0; j < nv; j++) a += bc8(p[j]) * ld8(vt + (int64_t)j * kv_tok + e);
                    st8(ar + e, a);
                }
            }
        }
        for (int r = 0; r < nr; r++) {
            const float inv = 1.0f / l[r];
            float *o = out + (int64_t)(r0 + r) * o_tok + (int64_t)qh * o_head;
            for (int e = 0; e < d; e += 8) st8(o + e, ld8(acc[r] + e) * bc8(inv));
        }
    }
    free(kt);
    return 0;
}
