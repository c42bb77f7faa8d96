/* The decoder layers of one step in one native call (built and loaded by
 * pagedkv/ops/decoder.py, driven by pagedkv/model/native_step.py).
 *
 * For each layer it runs what DecoderLayer._forward_fused runs, in the same order and with the
 * same kernels: RMSNorm, the fused q/k/v matmul, the per-head q/k RMSNorms (Qwen3, Gemma-3; when
 * the layer has them), RoPE + split (a local-RoPE layer, Gemma-3's sliding ones, with the local
 * table), the paged K/V write and attention (over its KV layer group's block tables and slots),
 * the o matmul, [sandwich norms: RMSNorm of the attention output,] residual add + RMSNorm, the
 * fused gate/up matmul, activation x up, the down matmul, [sandwich norms: RMSNorm of the MLP
 * output,] and the residual add; a mixture-of-experts layer runs moe_ffn in place of the
 * gate/up ... down matmuls. The kernels live in the other native libraries
 * (qmm.c, fused_ops.c, cpu_kernel.c); Python hands their addresses in, so this
 * file only sequences them. Driven from Python, a batch-1 step spent ~10 us of interpreter
 * and ctypes work around each of its ~270 kernel calls; here the step costs one call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* MoE layers of at most this many tokens run their experts side by side (moe_ffn) */
#ifndef EXPERT_PAR_T
#define EXPERT_PAR_T 64
#endif

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
    /* sandwich norms (Gemma-2/3): the attention output's and the MLP output's RMSNorm weights
     * [hidden], applied before each joins the residual (w_post is then the pre-MLP norm); NULL */
    const float *w_attn_out, *w_mlp_out;
    int32_t local_rope;                   /* RoPE from the local table (Gemma-3's sliding layers) */
    int32_t group;                        /* its KV layer group: which attention arguments it takes */
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

/* 8 float32 lanes (GCC/Clang generic vectors: one AVX register, or a NEON pair) */
typedef float f8_t __attribute__((vector_size(32)));
static inline f8_t ld8(const float *p) { f8_t v; memcpy(&v, p, sizeof v); return v; }
static inline float tree8(f8_t a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

/* The router logits of n consecutive experts e0 .. e0+n-1 (n <= 4) for one token x [H]: each a
 * dot product of 8 lanes (element j into lane j % 8, in order of j; a tail past the last 8
 * into lane 0), then summed by tree8. The experts share each load of x, and their router rows
 * are adjacent, so the weights stream as one run. */
static void router_dots(const float *x, const float *r, int64_t H, int n, float *out) {
    const float *r0 = r, *r1 = r + (n > 1 ? H : 0), *r2 = r + (n > 2 ? 2 * H : 0), *r3 = r + (n > 3 ? 3 * H : 0);
    f8_t a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t j = 0;
    for (; j + 8 <= H; j += 8) {
        const f8_t xv = ld8(x + j);
        a0 += xv * ld8(r0 + j);
        a1 += xv * ld8(r1 + j);
        a2 += xv * ld8(r2 + j);
        a3 += xv * ld8(r3 + j);
    }
    for (; j < H; j++) {
        a0[0] += x[j] * r0[j];
        a1[0] += x[j] * r1[j];
        a2[0] += x[j] * r2[j];
        a3[0] += x[j] * r3[j];
    }
    const float s[4] = {tree8(a0), tree8(a1), tree8(a2), tree8(a3)};
    for (int u = 0; u < n; u++) out[u] = s[u];
}

/* The MoE FFN of x [T, H] into out [T, H] (overwritten), as pagedkv.model.moe.MoE runs it:
 * router logits in fp32 (router_dots), softmax, the top_k largest (the lower
 * id on a tie), renormalised when norm_topk, times scaling; then for each expert with tokens, in
 * increasing id: its tokens' rows (ascending) gathered, the gate_up matmul, act x up, the down
 * matmul, and out[token] += row * weight. With at most EXPERT_PAR_T tokens the experts' matmuls
 * run side by side, one expert per thread (a batch-1 step's 8 routed experts: 2 x 8 small
 * matmuls that would each open a parallel region), and the rows are added afterwards in that
 * same order: the same bits on any thread count. Returns 0, -1 (no memory), -3 (a routed
 * expert's weights are NULL: nothing but this layer's scratch touched after the routing), or a
 * qmm code. */
/* moe_ffn's buffers: the layer input x [T, H], the per-expert rows (gathered input xg, gate_up
 * gu, act h, down dn), the output, and the (token, slot) pairs grouped by expert */
typedef struct {
    const float *x;
    float *xg, *gu, *h, *dn, *out;
    const int32_t *pos, *tlist;
    const float *wlist;
} expert_scratch_t;

/* Expert e's tokens through its gate_up, act and down matmuls: by_expert, on one thread into
 * its own rows of the scratch (moe_ffn adds them afterwards); else on all threads into the
 * scratch's first rows, then added to out at once. Returns the qmm code. */
static int expert_rows(const decoder_t *M, const moe_t *E, const expert_scratch_t *S, int e, int by_expert) {
    const int64_t H = M->hidden, I = E->inter, n = S->pos[e + 1] - S->pos[e], r0 = by_expert ? S->pos[e] : 0;
    const int32_t *tok = S->tlist + S->pos[e];
    float *xe = S->xg + r0 * H, *ge = S->gu + r0 * 2 * I, *he = S->h + r0 * I, *de = S->dn + r0 * H;
    for (int64_t r = 0; r < n; r++) memcpy(xe + r * H, S->x + (int64_t)tok[r] * H, (size_t)H * sizeof(float));
    const int nt = by_expert ? 1 : M->nthreads;
    int c = M->qmm(E->gate_up[e], n, xe, H, ge, nt);
    if (c == 0) {
        M->act(n, I, ge, 2 * I, 0, E->gelu, he, 0);
        c = M->qmm(E->down[e], n, he, I, de, nt);
    }
    if (!by_expert && c == 0) { /* the shared scratch: add this expert's rows now */
        const float *w = S->wlist + S->pos[e];
        for (int64_t r = 0; r < n; r++) {
            float *o = S->out + (int64_t)tok[r] * H;
            const float *d = de + r * H;
            for (int64_t j = 0; j < H; j++) o[j] += d[j] * w[r];
        }
    }
    return c;
}

static int moe_ffn(const decoder_t *M, const moe_t *E, int64_t T, const float *x, float *out) {
    const int64_t H = M->hidden, I = E->inter;
    const int NE = E->num_experts, K = E->top_k;
    /* few tokens: the routed experts' matmuls side by side on the threads (each one thread),
     * every (token, slot) pair with its own rows; else one expert at a time, each matmul on all */
    const int by_expert = T <= EXPERT_PAR_T && M->nthreads > 1;
    const int64_t R = by_expert ? T * K : T; /* rows of the per-expert scratch */
    float *fmem = malloc((size_t)(T * NE + T * K + R * H + 3 * R * I + R * H + T * K) * sizeof(float));
    int32_t *imem = malloc((size_t)(T * K + 5 * NE + 2 + T * K) * sizeof(int32_t));
    if (!fmem || !imem) {
        free(fmem);
        free(imem);
        return -1;
    }
    float *prob = fmem, *wsel = prob + T * NE, *xg = wsel + T * K, *gu = xg + R * H, *h = gu + R * 2 * I;
    float *dn = h + R * I, *wlist = dn + R * H;
    int32_t *ids = imem, *cnt = ids + T * K, *pos = cnt + NE, *tlist = pos + NE + 1, *used = tlist + T * K;
    int32_t *taken = used + 2 * NE + 1; /* used: [NE] experts then [NE] codes (errs) */
    int rc = 0;
    /* the router logits: (token, 4 experts) items on the threads (each the same sums) */
    const int64_t G = (NE + 3) / 4;
    #pragma omp parallel for schedule(static) num_threads(M->nthreads) if (T * NE * H >= 65536)
    for (int64_t tg = 0; tg < T * G; tg++) {
        const int64_t t = tg / G;
        const int e0 = (int)(tg % G) * 4;
        router_dots(x + t * H, E->router + (int64_t)e0 * H, H, NE - e0 < 4 ? NE - e0 : 4, prob + t * NE + e0);
    }
    for (int64_t t = 0; t < T; t++) {
        float *p = prob + t * NE, mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < NE; e++)
            if (p[e] > mx) mx = p[e];
        for (int e = 0; e < NE; e++) sum += (p[e] = expf(p[e] - mx));
        for (int e = 0; e < NE; e++) p[e] /= sum;
        float wsum = 0.0f;
        for (int e = 0; e < NE; e++) taken[e] = 0;
        for (int s = 0; s < K; s++) { /* the s-th largest not yet chosen */
            int best = -1;
            for (int e = 0; e < NE; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
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
    /* the experts with tokens, in increasing id; a routed expert without weights fails the
     * layer before any matmul (nothing but this scratch touched) */
    int nused = 0;
    for (int e = 0; e < NE; e++)
        if (pos[e + 1] > pos[e]) {
            if (!E->gate_up[e] || !E->down[e]) rc = -3;
            used[nused++] = e;
        }
    if (rc == 0) {
        int32_t *errs = used + NE; /* each expert's matmul code */
        const expert_scratch_t S = {x, xg, gu, h, dn, out, pos, tlist, wlist};
        if (by_expert) {
            #pragma omp parallel for schedule(static, 1) num_threads(M->nthreads) if (nused > 1)
            for (int a = 0; a < nused; a++) errs[a] = expert_rows(M, E, &S, used[a], 1);
        } else { /* not inside a parallel region: each matmul's team is the pool's, where a
                  * nested one would start new threads per call (0.7x a MoE prefill) */
            for (int a = 0; a < nused; a++) errs[a] = expert_rows(M, E, &S, used[a], 0);
        }
        for (int a = 0; a < nused && rc == 0; a++) rc = errs[a];
    }
    /* by expert: the rows added in increasing expert id, tokens ascending (the order the
     * one-expert-at-a-time loop adds them), so the sums do not depend on the threads */
    if (rc == 0 && by_expert)
        for (int a = 0; a < nused; a++) {
            const int e = used[a];
            const int32_t *tok = tlist + pos[e];
            const float *w = wlist + pos[e];
            for (int64_t r = 0; r < pos[e + 1] - pos[e]; r++) {
                float *o = out + (int64_t)tok[r] * H;
                const float *d = dn + (pos[e] + r) * H;
                for (int64_t j = 0; j < H; j++) o[j] += d[j] * w[r];
            }
        }
    free(fmem);
    free(imem);
    return rc;
}

/* residual [T, hidden] float32 contiguous, updated in place by every layer; cos/sin float32
 * [T, d/2] (cos_l/sin_l: the local table's rows, for local_rope layers; else NULL); attn_args:
 * the step's n_args layer_args_t, one per KV layer group (layer i takes
 * attn_args[layers[i].group]; the layers of one group share its block tables, slots and cache
 * geometry).
 * Returns 0; -1 when out of memory (scratch or a matmul's activations), -3 when a routed expert's
 * weights are NULL, -6 when a layer's group has no attention arguments or a local-RoPE layer no
 * local table (checked before anything is written), another matmul code;
 * or the attention kernel's code minus 100 (-104: a slot past the cache, nothing of that
 * layer written); *failed is the layer index. */
#define ATTN_ERR 100
int pagedkv_decoder_forward(const decoder_t *M, const void *const *attn_args, int32_t n_args, int64_t T,
                            float *residual, const float *cos_t, const float *sin_t, const float *cos_l,
                            const float *sin_l, int32_t *failed) {
    for (int32_t i = 0; i < M->num_layers; i++) {
        const layer_t *L = M->layers + i;
        if (L->group < 0 || L->group >= n_args || !attn_args[L->group] || (L->local_rope && (!cos_l || !sin_l))) {
            *failed = i;
            return -6;
        }
    }
    const int64_t H = M->hidden, I = M->inter, Q = (int64_t)M->hq * M->d, KV = (int64_t)M->hkv * M->d;
    const int64_t per_row = H + (Q + 2 * KV) + Q + KV + KV + Q + H + 2 * I + I + H + H;
    float *mem = malloc((size_t)(T * per_row) * sizeof(float));
    if (!mem) {
        *failed = 0;
        return -1;
    }
    float *x = mem, *qkv = x + T * H, *q = qkv + T * (Q + 2 * KV), *k = q + T * Q, *v = k + T * KV, *o = v + T * KV;
    float *attn = o + T * Q, *gu = attn + T * H, *h = gu + T * 2 * I, *dn = h + T * I, *nb = dn + T * H;
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
        M->rope(T, M->hq, M->hkv, M->d, qkv, Q + 2 * KV, 0, L->local_rope ? cos_l : cos_t,
                L->local_rope ? sin_l : sin_t, q, k, v);
        if ((rc = M->attend(attn_args[L->group], q, k, v, L->k_cache, L->v_cache, o, L->scale, L->window,
                            L->softcap))) {
            rc -= ATTN_ERR;
            break;
        }
        if ((rc = M->qmm(L->o, T, o, Q, attn, M->nthreads))) break;
        const float *delta = attn;
        if (L->w_attn_out) { /* sandwich: the attention output normed before it joins */
            M->norm(T, H, attn, H, NULL, 0, 0, L->w_attn_out, M->eps, M->offset, nb, 0);
            delta = nb;
        }
        M->norm(T, H, residual, H, delta, H, 0, L->w_post, M->eps, M->offset, x, 0);
        if (L->moe) {
            if ((rc = moe_ffn(M, L->moe, T, x, dn))) break;
        } else {
            if ((rc = M->qmm(L->gate_up, T, x, H, gu, M->nthreads))) break;
            M->act(T, I, gu, 2 * I, 0, M->gelu, h, 0);
            if ((rc = M->qmm(L->down, T, h, I, dn, M->nthreads))) break;
        }
        const float *mlp_out = dn;
        if (L->w_mlp_out) { /* sandwich: the MLP output normed before it joins */
            M->norm(T, H, dn, H, NULL, 0, 0, L->w_mlp_out, M->eps, M->offset, nb, 0);
            mlp_out = nb;
        }
        for (int64_t j = 0; j < T * H; j++) residual[j] += mlp_out[j];
    }
    free(mem);
    return rc;
}
