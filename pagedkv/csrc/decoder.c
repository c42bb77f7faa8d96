/* The decoder layers of one step in one native call (built and called by
 * pagedkv/model/native_step.py).
 *
 * For each layer it runs what DecoderLayer._forward_fused runs, in the same order and with the
 * same kernels: RMSNorm, the fused q/k/v matmul, the per-head q/k RMSNorms (Qwen3; when the layer
 * has them), RoPE + split, the paged K/V write and
 * attention, the o matmul, residual add + RMSNorm, the fused gate/up matmul, activation x up,
 * the down matmul and the residual add. The kernels live in the other native libraries
 * (qmm.c, fused_ops.c, cpu_kernel.c); Python hands their addresses in, so this
 * file only sequences them. Driven from Python, a batch-1 step spent ~10 us of interpreter
 * and ctypes work around each of its ~270 kernel calls; here the step costs one call.
 */
#include <stdint.h>
#include <stdlib.h>

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

typedef struct {
    const void *qkv, *o, *gate_up, *down; /* each a qweights_t of qmm.c */
    const float *w_in, *w_post;           /* the two RMSNorm weights [hidden] */
    void *k_cache, *v_cache;              /* this layer's cache buffers */
    float scale, softcap;
    int32_t window;
    const float *q_norm, *k_norm;         /* per-head RMSNorm weights [d] (Qwen3), or both NULL */
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

/* residual [T, hidden] float32 contiguous, updated in place by every layer; cos/sin float32
 * [T, d/2]; attn_args: the step's layer_args_t (every layer shares the cache geometry).
 * Returns 0; -1 when out of memory (scratch or a matmul's activations), another matmul code;
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
        if ((rc = M->qmm(L->gate_up, T, x, H, gu, M->nthreads))) break;
        M->act(T, I, gu, 2 * I, 0, M->gelu, h, 0);
        if ((rc = M->qmm(L->down, T, h, I, dn, M->nthreads))) break;
        for (int64_t j = 0; j < T * H; j++) residual[j] += dn[j];
    }
    free(mem);
    return rc;
}
