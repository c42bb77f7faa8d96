/* The decoder layers of one step in one native call (built and loaded by
 * pagedkv/ops/decoder.py, driven by pagedkv/model/native_step.py).
 *
 * For each layer it runs what DecoderLayer._forward_fused runs, in the same order and with the
 * same kernels: RMSNorm, the fused q/k/v matmul, the per-head q/k RMSNorms (Qwen3; when the layer
 * has them), RoPE + split, the paged K/V write and
 * attention, the o matmul, residual add + RMSNorm, the fused gate/up matmul, activation x up,
 * the down matmul and the residual add; a mixture-of-experts layer runs moe_ffn in place of the
 * gate/up ... down matmuls. The kernels live in the other native libraries
 * (qmm.c, fused_ops.c, cpu_kernel.c); Python hands their addresses in, so this
 * file only sequences them. Driven from Python, a batch-1 step spent ~10 us of interpreter
 * and ctypes work around each of its ~270 kernel calls; here the step costs one call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*qmm_fn)(const void *w, int64_t rows, const float *x, int64_t xs, float *y, int nthreads);
typedef void (*norm_fn)(int64_t T, int64_t H, float *residual, int64_t rs, const void *delta, int64_t ds,
                        int dt_delta, const float *w, float eps, float offset, void *out, int dt_out);
typedef void (*rope_fn)(int64_t T, int nq, int nkv, int d, const void *qkv, int64_t qs, int dt_in,
                        const float *cos_t, const float *sin_t, float *q_out, float *k_out, float *v_out);
typedef void (*act_fn)(int64_t T, int64_t I, const void *gate_up, int64_t gs, int dt_in, int gelu, void *out,
                       int dt_out);
typedef void (*head_norm_fn)(int64_t T, int nh, int d, void *x, int64_t xs, int dt, const float *w, float eps,
                             float offset);
typedef int (*attend_fn)(const void *S, const void *q, const void *k_new, const void *v_new, void *k, void *v,
                         void *out, float scale, int window, float softcap);

/* A mixture-of-experts FFN (pagedkv/model/moe.py, softmax routing only). */
typedef struct {
    const float *router;                      /* [E, H] float32 */
    const void *const *gate_up, *const *down; /* E qweights_t each: [2 I, H] (gate rows, up rows), [H, I] */
    int64_t inter;                            /* I */
    int32_t num_experts, top_k, norm_topk, gelu;
    float scaling;                            /* routed_scaling_factor */
} moe_t;

typedef struct {
    const void *qkv, *o, *gate_up, *down; /* each a qweights_t of qmm.c (gate_up, down: NULL with moe) */
    const float *w_in, *w_post;           /* the two RMSNorm weights [hidden] */
    void *k_cache, *v_cache;              /* this layer's cache buffers */
    float scale, softcap;
    int32_t window;
    const float *q_norm, *k_norm;         /* per-head RMSNorm weights [d] (Qwen3), or both NULL */
    const moe_t *moe;                     /* the layer's MoE FFN in place of gate_up/down, or NULL */
} layer_t;

typedef struct {
    qmm_fn qmm;
    norm_fn norm;
    rope_fn rope;
    act_fn act;
    attend_fn attend;
    int64_t hidden, inter;
    int32_t hq, hkv, d, gelu, num_layers, nthreads;
    float eps, offset;
    const layer_t *layers;
    head_norm_fn head_norm;
} decoder_t;

/* The MoE FFN of x [T, H] into out [T, H] (overwritten), as pagedkv.model.moe.MoE runs it:
 * router logits in fp32 (8 partial sums per dot product), softmax, the top_k largest (the lower
 * id on a tie), renormalised when norm_topk, times scaling; then for each expert with tokens, in
 * increasing id: its tokens' rows (ascending) gathered, the gate_up matmul, act x up, the down
 * matmul, and out[token] += row * weight. Returns 0, -1 (no memory), -3 (a routed expert's
 * weights are NULL: nothing but this layer's scratch touched after the routing), or a qmm code. */
static int moe_ffn(const decoder_t *M, const moe_t *E, int64_t T, const float *x, float *out) {
    const int64_t H = M->hidden, I = E->inter;
    const int NE = E->num_experts, K = E->top_k;
    float *fmem = malloc((size_t)(T * NE + T * K + T * H + 3 * T * I + T * H + T * K) * sizeof(float));
    int32_t *imem = malloc((size_t)(T * K + 2 * NE + 1 + T * K) * sizeof(int32_t));
    if (!fmem || !imem) {
        free(fmem);
        free(imem);
        return -1;
    }
    float *prob = fmem, *wsel = prob + T * NE, *xg = wsel + T * K, *gu = xg + T * H, *h = gu + T * 2 * I;
    float *dn = h + T * I, *wlist = dn + T * H;
    int32_t *ids = imem, *cnt = ids + T * K, *pos = cnt + NE, *tlist = pos + NE + 1;
    int rc = 0;
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        float *p = prob + t * NE, mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < NE; e++) {
            const float *r = E->router + (int64_t)e * H;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t j = 0;
            for (; j + 8 <= H; j += 8)
                for (int l = 0; l < 8; l++) acc[l] += xt[j + l] * r[j + l];
            for (; j < H; j++) acc[0] += xt[j] * r[j];
            p[e] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
            if (p[e] > mx) mx = p[e];
        }
        for (int e = 0; e < NE; e++) sum += (p[e] = expf(p[e] - mx));
        for (int e = 0; e < NE; e++) p[e] /= sum;
        float wsum = 0.0f;
        for (int s = 0; s < K; s++) { /* the s-th largest not yet chosen */
            int best = -1;
            for (int e = 0; e < NE; e++) {
                int taken = 0;
                for (int u = 0; u < s; u++) taken |= ids[t * K + u] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            ids[t * K + s] = best;
            wsum += (wsel[t * K + s] = p[best]);
        }
        for (int s = 0; s < K; s++) {
            if (E->norm_topk) wsel[t * K + s] /= wsum;
            if (E->scaling != 1.0f) wsel[t * K + s] *= E->scaling;
        }
    }
    /* (token, slot) pairs grouped by expert, tokens ascending within one (a counting sort) */
    for (int e = 0; e < NE; e++) cnt[e] = 0;
    for (int64_t j = 0; j < T * K; j++) cnt[ids[j]]++;
    pos[0] = 0;
    for (int e = 0; e < NE; e++) pos[e + 1] = pos[e] + cnt[e];
    for (int e = 0; e < NE; e++) cnt[e] = pos[e];
    for (int64_t j = 0; j < T * K; j++) {
        const int32_t at = cnt[ids[j]]++;
        tlist[at] = (int32_t)(j / K);
        wlist[at] = wsel[j];
    }
    for (int64_t j = 0; j < T * H; j++) out[j] = 0.0f;
    for (int e = 0; e < NE && rc == 0; e++) {
        const int64_t n = pos[e + 1] - pos[e];
        if (n == 0) continue;
        if (!E->gate_up[e] || !E->down[e]) {
            rc = -3;
            break;
        }
        const int32_t *tok = tlist + pos[e];
        const float *w = wlist + pos[e];
        for (int64_t r = 0; r < n; r++) memcpy(xg + r * H, x + (int64_t)tok[r] * H, (size_t)H * sizeof(float));
        if ((rc = M->qmm(E->gate_up[e], n, xg, H, gu, M->nthreads))) break;
        M->act(n, I, gu, 2 * I, 0, E->gelu, h, 0);
        if ((rc = M->qmm(E->down[e], n, h, I, dn, M->nthreads))) break;
        for (int64_t r = 0; r < n; r++) {
            float *o = out + (int64_t)tok[r] * H;
            const float *d = dn + r * H;
            for (int64_t j = 0; j < H; j++) o[j] += d[j] * w[r];
        }
    }
    free(fmem);
    free(imem);
    return rc;
}

/* residual [T, hidden] float32 contiguous, updated in place by every layer; cos/sin float32
 * [T, d/2]; attn_args: the step's layer_args_t (every layer shares the cache geometry).
 * Returns 0; -1 when out of memory (scratch or a matmul's activations), -3 when a routed expert's
 * weights are NULL, another matmul code;
 * or the attention kernel's code minus 100 (-104: a slot past the cache, nothing of that
 * layer written); *failed is the layer index. */
#define ATTN_ERR 100
int pagedkv_decoder_forward(const decoder_t *M, const void *attn_args, int64_t T, float *residual,
                            const float *cos_t, const float *sin_t, int32_t *failed) {
    const int64_t H = M->hidden, I = M->inter, Q = (int64_t)M->hq * M->d, KV = (int64_t)M->hkv * M->d;
    const int64_t per_row = H + (Q + 2 * KV) + Q + KV + KV + Q + H + 2 * I + I + H;
    float *mem = malloc((size_t)(T * per_row) * sizeof(float));
    if (!mem) {
        *failed = 0;
        return -1;
    }
    float *x = mem, *qkv = x + T * H, *q = qkv + T * (Q + 2 * KV), *k = q + T * Q, *v = k + T * KV, *o = v + T * KV;
    float *attn = o + T * Q, *gu = attn + T * H, *h = gu + T * 2 * I, *dn = h + T * I;
    int rc = 0;
    for (int32_t i = 0; i < M->num_layers && rc == 0; i++) {
        const layer_t *L = M->layers + i;
        *failed = i;
        M->norm(T, H, residual, H, NULL, 0, 0, L->w_in, M->eps, M->offset, x, 0);
        if ((rc = M->qmm(L->qkv, T, x, H, qkv, M->nthreads))) break;
        if (L->q_norm) {
            M->head_norm(T, M->hq, M->d, qkv, Q + 2 * KV, 0, L->q_norm, M->eps, M->offset);
            M->head_norm(T, M->hkv, M->d, qkv + Q, Q + 2 * KV, 0, L->k_norm, M->eps, M->offset);
        }
        M->rope(T, M->hq, M->hkv, M->d, qkv, Q + 2 * KV, 0, cos_t, sin_t, q, k, v);
        if ((rc = M->attend(attn_args, q, k, v, L->k_cache, L->v_cache, o, L->scale, L->window, L->softcap))) {
            rc -= ATTN_ERR;
            break;
        }
        if ((rc = M->qmm(L->o, T, o, Q, attn, M->nthreads))) break;
        M->norm(T, H, residual, H, attn, H, 0, L->w_post, M->eps, M->offset, x, 0);
        if (L->moe) {
            if ((rc = moe_ffn(M, L->moe, T, x, dn))) break;
        } else {
            if ((rc = M->qmm(L->gate_up, T, x, H, gu, M->nthreads))) break;
            M->act(T, I, gu, 2 * I, 0, M->gelu, h, 0);
            if ((rc = M->qmm(L->down, T, h, I, dn, M->nthreads))) break;
        }
        for (int64_t j = 0; j < T * H; j++) residual[j] += dn[j];
    }
    free(mem);
    return rc;
}
