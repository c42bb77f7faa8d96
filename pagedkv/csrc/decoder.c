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
#include <omp.h>
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
                         void *out, float scale, int window, float softcap, const float *sinks);

/* moe_t.routing: pagedkv.model.moe.route's kinds */
enum { ROUTE_SOFTMAX = 0, ROUTE_SIGMOID = 1, ROUTE_TOPK_SOFTMAX = 2 };

/* A mixture-of-experts FFN (pagedkv/model/moe.py: softmax, sigmoid or topk_softmax routing
 * without expert groups). */
typedef struct {
    const float *router;                      /* [E, H] float32 */
    const void *const *gate_up, *const *down; /* E qweights_t each: [2 I, H] (gate rows, up rows), [H, I] */
    int64_t inter;                            /* I */
    int32_t num_experts, top_k, norm_topk, gelu;
    float scaling;                            /* routed_scaling_factor */
    /* DeepSeek's shared experts, one gated MLP every token runs (qweights_t [2 S, H], [H, S]),
     * added after the routed experts; NULL when none */
    const void *shared_gate_up, *shared_down;
    int64_t shared_inter;                     /* S */
    /* ROUTE_SIGMOID: DeepSeek-V3's routing: s = sigmoid(logit), the top_k of s + bias[e] chosen
     * (bias: e_score_correction_bias [E] float32), weighted by s, renormalised by sum + 1e-20;
     * ROUTE_SOFTMAX: top_k of softmax(logits); ROUTE_TOPK_SOFTMAX (gpt-oss): the top_k logits,
     * weighted by the softmax over those k (norm_topk not applied) */
    int32_t routing;
    const float *bias;
    const float *router_bias; /* [E] float32 added to the router logits (gpt-oss), or NULL */
    /* limit > 0: the experts' activation is gpt-oss's clamped SwiGLU, g = min(gate, limit),
     * u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g); 0: act (SiLU or GELU) x up */
    float limit, alpha;
} moe_t;

/* Multi-head latent attention (pagedkv/model/mla.py), n heads, latent rank r, per head nope +
 * rope query/key elements and v value elements; the cache holds [c_kv (r), k_pe (rope)] per token */
typedef struct {
    const void *q, *q_a, *q_b, *kv_a;  /* qweights_t: q [n (nope + rope), H], or q_a [ql, H] and
                                        * q_b [n (nope + rope), ql] (q NULL); kv_a [r + rope, H] */
    const float *q_a_norm, *kv_a_norm; /* float32 [ql] (with q_a), [r] */
    const float *kv_b;                 /* float32 [n (nope + v), r]: per head W_UK [nope, r], W_UV [v, r] */
    int32_t n, nope, rope, v, r, ql, interleave;
    float eps;                         /* the two inner RMSNorms' eps */
    /* per head h, W_UK^T [r, nope] and W_UV [v, r] as qweights_t (a GGUF's attn_k_b / attn_v_b as
     * stored), multiplied in place of kv_b (int8 activations, as every qmm matmul); or NULL */
    const void *const *k_b, *const *v_b;
} mla_t;

/* cpu_kernel.c's layer_args_t (the same fields in the same order): one step's block tables,
 * lengths, slots and cache geometry for one KV layer group */
typedef struct {
    int32_t qdt, kdt, hq, hkv, d, bs;
    int64_t s_blk, s_tok, s_head;
    int64_t num_slots;
    const int32_t *bt; int64_t bt_s0;
    const int32_t *seq_lens, *q_start, *seq_ids, *q_lens; int32_t n_seqs;
    const int64_t *slots; int32_t n_tokens;
    int32_t n_real;
    int32_t nthreads, min_split_len, prefetch;
} layer_args_t;

/* A latent (MLA) cache's step arguments (pagedkv.ops.cpu_kernel.LatentArgs): layer_args_t, then
 * for an int8 cache (a.kdt 2) its bf16 scales' strides (elements) and scales per latent */
typedef struct {
    layer_args_t a;
    int64_t sc_blk, sc_tok;
    int32_t groups;
} latent_args_t;

typedef struct {
    const void *qkv, *o, *gate_up, *down; /* each a qweights_t of qmm.c (gate_up, down: NULL with moe) */
    const float *w_in, *w_post;           /* the two RMSNorm weights [hidden] */
    void *k_cache, *v_cache;              /* this layer's cache buffers (an MLA layer over an int8
                                           * cache: its codes and its bf16 scales) */
    float scale, softcap;
    int32_t window;
    const float *q_norm, *k_norm;         /* per-head RMSNorm weights [d] (Qwen3), or both NULL */
    const moe_t *moe;                     /* the layer's MoE FFN in place of gate_up/down, or NULL */
    /* sandwich norms (Gemma-2/3): the attention output's and the MLP output's RMSNorm weights
     * [hidden], applied before each joins the residual (w_post is then the pre-MLP norm); NULL */
    const float *w_attn_out, *w_mlp_out;
    int32_t local_rope;                   /* RoPE from the local table (Gemma-3's sliding layers) */
    int32_t group;                        /* its KV layer group: which attention arguments it takes */
    const mla_t *mla;                     /* latent attention in place of qkv ... attention (qkv NULL), or NULL */
    float residual_scale;                 /* both branches times it before they join (MiniCPM3); 1: none */
    const float *sinks;                   /* attention sinks float32 [hq] (gpt-oss), or NULL */
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
 * router logits in fp32 (router_dots, + router_bias), the routing's scores (softmax, sigmoid, or
 * the logits for topk_softmax), the top_k largest (the lower id on a tie), weighted as the routing
 * says (moe_t), times scaling; then for each expert with tokens, in increasing id: its tokens'
 * rows (ascending) gathered, the gate_up matmul (its bias in the packed weights), act x up (or the
 * clamped SwiGLU), the down matmul, and out[token] += row * weight. With at most EXPERT_PAR_T
 * tokens the experts' matmuls run side by side, one expert per thread (a batch-1 step's 8 routed
 * experts: 2 x 8 small matmuls that would each open a parallel region), and the rows are added
 * afterwards in that same order: the same bits on any thread count. Returns 0, -1 (no memory), -3 (a routed
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

/* gpt-oss's clamped SwiGLU of n rows of gu [n, 2 I] (gate columns, then up) into h [n, I],
 * in the order of pagedkv.model.moe.Expert's torch ops: (u + 1) * (g * sigmoid(g * alpha)) */
static void swiglu_clamped(int64_t n, int64_t I, const float *gu, float *h, float limit, float alpha) {
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *o = h + r * I;
        for (int64_t j = 0; j < I; j++) {
            const float gj = g[j] > limit ? limit : g[j];
            const float uj = u[j] > limit ? limit : u[j] < -limit ? -limit : u[j];
            o[j] = (uj + 1.0f) * (gj * (1.0f / (1.0f + expf(-(gj * alpha)))));
        }
    }
}

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
        if (E->limit > 0.0f)
            swiglu_clamped(n, I, ge, he, E->limit, E->alpha);
        else
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
    const int sigmoid = E->routing == ROUTE_SIGMOID, topk_softmax = E->routing == ROUTE_TOPK_SOFTMAX;
    for (int64_t t = 0; t < T; t++) {
        float *p = prob + t * NE, mx = -INFINITY, sum = 0.0f;
        if (E->router_bias)
            for (int e = 0; e < NE; e++) p[e] += E->router_bias[e];
        if (sigmoid) { /* scores s = sigmoid(logit); the choice on s + bias */
            for (int e = 0; e < NE; e++) p[e] = 1.0f / (1.0f + expf(-p[e]));
        } else if (!topk_softmax) { /* (topk_softmax: the choice on the logits themselves) */
            for (int e = 0; e < NE; e++)
                if (p[e] > mx) mx = p[e];
            for (int e = 0; e < NE; e++) sum += (p[e] = expf(p[e] - mx));
            for (int e = 0; e < NE; e++) p[e] /= sum;
        }
        float wsum = 0.0f;
        for (int e = 0; e < NE; e++) taken[e] = 0;
        for (int s = 0; s < K; s++) { /* the s-th largest not yet chosen */
            int best = -1;
            float bv = 0.0f;
            for (int e = 0; e < NE; e++) {
                const float v = sigmoid && E->bias ? p[e] + E->bias[e] : p[e];
                if (!taken[e] && (best < 0 || v > bv)) best = e, bv = v;
            }
            taken[best] = 1;
            ids[t * K + s] = best;
            wsum += (wsel[t * K + s] = p[best]);
        }
        float *w = wsel + t * K;
        if (topk_softmax) { /* the softmax over the k chosen logits (w[0] is their max) */
            float ksum = 0.0f;
            for (int s = 0; s < K; s++) ksum += (w[s] = expf(w[s] - p[ids[t * K]]));
            for (int s = 0; s < K; s++) w[s] /= ksum;
        } else if (E->norm_topk) {
            if (sigmoid) wsum += 1e-20f;
            for (int s = 0; s < K; s++) w[s] /= wsum;
        }
        if (E->scaling != 1.0f)
            for (int s = 0; s < K; s++) w[s] *= E->scaling;
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
    if (rc == 0 && E->shared_gate_up) { /* shared experts: every token, added after the routed sum */
        const int64_t SI = E->shared_inter;
        float *sm = malloc((size_t)(T * (3 * SI + H)) * sizeof(float));
        if (!sm) return -1;
        float *sgu = sm, *sh = sgu + T * 2 * SI, *sd = sh + T * SI;
        rc = M->qmm(E->shared_gate_up, T, x, H, sgu, M->nthreads);
        if (rc == 0) {
            M->act(T, SI, sgu, 2 * SI, 0, E->gelu, sh, 0);
            rc = M->qmm(E->shared_down, T, sh, SI, sd, M->nthreads);
        }
        if (rc == 0)
            for (int64_t j = 0; j < T * H; j++) out[j] += sd[j];
        free(sm);
    }
    return rc;
}

/* RoPE of one rope-wide vector x in place (pagedkv.model.mla.rope): adjacent pairs
 * (interleave) or halves, the result in rotate-half order; c/s the token's [rope / 2] row */
static void mla_rope(float *x, int rp, int interleave, const float *c, const float *s) {
    float t[512];
    const int half = rp / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = interleave ? x[2 * i] : x[i], x2 = interleave ? x[2 * i + 1] : x[i + half];
        t[i] = x1 * c[i] - x2 * s[i];
        t[i + half] = x2 * c[i] + x1 * s[i];
    }
    memcpy(x, t, (size_t)rp * sizeof(float));
}

static inline float dot8(const float *a, const float *b, int64_t n) {
    f8_t acc = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) acc += ld8(a + j) * ld8(b + j);
    float s = tree8(acc);
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

static inline void axpy8(float *y, float a, const float *x, int64_t n) {
    int64_t j = 0;
    const f8_t av = {a, a, a, a, a, a, a, a};
    for (; j + 8 <= n; j += 8) {
        f8_t v = ld8(y + j) + av * ld8(x + j);
        memcpy(y + j, &v, sizeof v);
    }
    for (; j < n; j++) y[j] += a * x[j];
}

static inline float bf16_f(uint16_t h) {
    const uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* pagedkv.attention.quant.round_up_bf16 of v (>= 0 or NaN): the nearest bf16 (ties to even, as
 * torch converts), one ulp up when that fell below v; NaN gives bf16's NaN */
static inline uint16_t bf16_up(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    if (v != v) return 0x7FC0;
    uint16_t h = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    if (bf16_f(h) < v) h++;
    return h;
}

/* One latent x [D] into int8 codes [D] and `groups` bf16 scales, as pagedkv.attention.quant.quantize
 * does it bit for bit: per group of G = D / groups, scale = round_up_bf16(max|x| / 127) (at least
 * 2^-126; 0 for an all-zero group; NaN with a NaN), code = round-half-even(x / scale) clamped to
 * +-127 (x / 1 where the scale is not > 0) */
static void quantize_int8(const float *x, int D, int groups, int8_t *codes, uint16_t *scales) {
    const int G = D / groups;
    for (int g = 0; g < groups; g++) {
        const float *xg = x + g * G;
        float amax = 0.0f;
        for (int j = 0; j < G; j++) {
            const float a = fabsf(xg[j]);
            if (a > amax || a != a) amax = a;
            if (a != a) break;
        }
        uint16_t sh = 0;
        if (amax != 0.0f) {
            sh = bf16_up(amax / 127.0f);
            if (sh != 0x7FC0 && bf16_f(sh) < 0x1p-126f) sh = 0x0080; /* 2^-126 */
        }
        scales[g] = sh;
        const float sf = bf16_f(sh), div = sf > 0.0f ? sf : 1.0f;
        for (int j = 0; j < G; j++) {
            float y = xg[j] / div;
            y = y > 127.0f ? 127.0f : y < -127.0f ? -127.0f : y;
            codes[g * G + j] = y == y ? (int8_t)nearbyintf(y) : 0;
        }
    }
}

/* For the tests: n latents x [n, D] quantised as mla_attention writes them (codes [n, D], scales
 * [n, groups], contiguous); returns 0, or -2 when groups does not divide D */
int pagedkv_quantize_latent(const float *x, int64_t n, int32_t D, int32_t groups, int8_t *codes,
                            uint16_t *scales) {
    if (groups <= 0 || D % groups) return -2;
    for (int64_t i = 0; i < n; i++) quantize_int8(x + i * D, D, groups, codes + i * D, scales + i * groups);
    return 0;
}

/* Context token s's latent [D] of the row whose block table is bt: the float32 cache's row itself,
 * or an int8 cache's codes times their token's scales into buf */
static inline const float *latent_row(const latent_args_t *LA, const void *cache, const uint16_t *scales,
                                      const int32_t *bt, int32_t s, int D, float *buf) {
    const layer_args_t *S = &LA->a;
    const int64_t blk = bt[s / S->bs], tok = s % S->bs;
    if (S->kdt == 0) return (const float *)cache + blk * S->s_blk + tok * S->s_tok;
    const int8_t *c = (const int8_t *)cache + blk * S->s_blk + tok * S->s_tok;
    const uint16_t *sc = scales + blk * LA->sc_blk + tok * LA->sc_tok;
    const int G = D / LA->groups;
    for (int g = 0; g < LA->groups; g++) {
        const float f = bf16_f(sc[g]);
        for (int j = g * G; j < (g + 1) * G; j++) buf[j] = (float)c[j] * f;
    }
    return buf;
}

/* One MLA layer's attention for the T rows of x [T, H] (normed), into o [T, n v]: the q and
 * latent projections, the latent's RMSNorm and RoPE (with q's rope part), the latents written
 * at the step's slots of the float32 cache, or quantised into an int8 one (quantize_int8: codes at
 * the slot, scales at the slot of `scales`; every slot checked first: -4, nothing written),
 * then per row the absorbed form (pagedkv.model.mla module doc): q_lat = W_UK^T q_nope [n, r],
 * scores q_lat . c_kv + q_pe . k_pe over the row's causal context, softmax, o_lat = p . c_kv,
 * out = W_UV o_lat, an int8 cache's latents dequantised as they are read (latent_row). Rows are split among the threads, or with fewer rows than threads each
 * row's heads are: each item streams its context's latents twice (scores, then o_lat) for all
 * its heads at once. Returns 0, -1 (no memory), -2 (arguments of another geometry), -4, or a
 * qmm code (as code - 1000, told apart from the attention codes). */
static int mla_attention(const decoder_t *M, const mla_t *A, const latent_args_t *LA, int64_t T, const float *x,
                         void *cache, uint16_t *scales, const float *cos_t, const float *sin_t, float scale,
                         float *o) {
    const int64_t H = M->hidden;
    const layer_args_t *S = &LA->a;
    const int n = A->n, nope = A->nope, rp = A->rope, V = A->v, R = A->r, D = R + rp, QK = nope + rp;
    if ((S->kdt != 0 && S->kdt != 2) || S->d != D || S->hkv != 1 || rp > 512 || rp % 2 || S->n_tokens != T) return -2;
    if (S->kdt == 2 && (LA->groups <= 0 || D % LA->groups || !scales)) return -2;
    for (int i = 0; i < S->n_tokens; i++)
        if (S->slots[i] >= S->num_slots) return -4;
    const int64_t QL = A->q ? 0 : A->ql;
    float *mem = malloc((size_t)(T * (n * QK + D + QL)) * sizeof(float));
    int32_t *rowinfo = malloc((size_t)(3 * T + 1) * sizeof(int32_t));
    if (!mem || !rowinfo) {
        free(mem);
        free(rowinfo);
        return -1;
    }
    float *q = mem, *ckv = q + T * n * QK, *qa = ckv + T * D;
    int rc = 0;
    if (A->q) {
        rc = M->qmm(A->q, T, x, H, q, M->nthreads);
    } else if ((rc = M->qmm(A->q_a, T, x, H, qa, M->nthreads)) == 0) {
        M->head_norm(T, 1, (int)QL, qa, QL, 0, A->q_a_norm, A->eps, 0.0f);
        rc = M->qmm(A->q_b, T, qa, QL, q, M->nthreads);
    }
    if (rc == 0) rc = M->qmm(A->kv_a, T, x, H, ckv, M->nthreads);
    if (rc) {
        free(mem);
        free(rowinfo);
        return rc - 1000;
    }
    M->head_norm(T, 1, R, ckv, D, 0, A->kv_a_norm, A->eps, 0.0f);
    int32_t *rseq = rowinfo, *rctx = rseq + T, *rid = rctx + T; /* per row: live sequence, context, id */
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * (rp / 2), *s = sin_t + t * (rp / 2);
        mla_rope(ckv + t * D + R, rp, A->interleave, c, s);
        for (int h = 0; h < n; h++) mla_rope(q + (t * n + h) * QK + nope, rp, A->interleave, c, s);
        rseq[t] = -1;
    }
    for (int i = 0; i < S->n_tokens; i++) {
        const int64_t slot = S->slots[i];
        if (slot >= 0 && S->kdt == 0)
            memcpy((float *)cache + (slot / S->bs) * S->s_blk + (slot % S->bs) * S->s_tok, ckv + (int64_t)i * D,
                   (size_t)D * sizeof(float));
        else if (slot >= 0)
            quantize_int8(ckv + (int64_t)i * D, D, LA->groups,
                          (int8_t *)cache + (slot / S->bs) * S->s_blk + (slot % S->bs) * S->s_tok,
                          scales + (slot / S->bs) * LA->sc_blk + (slot % S->bs) * LA->sc_tok);
    }
    int32_t maxctx = 1;
    for (int k = 0; k < S->n_seqs; k++) {
        const int32_t id = S->seq_ids[k], q0 = S->q_start[id], ql = S->q_lens[k], sl = S->seq_lens[id];
        for (int32_t j = 0; j < ql && q0 + j < T; j++) {
            rseq[q0 + j] = k;
            rid[q0 + j] = id;
            rctx[q0 + j] = sl - ql + j + 1;
            if (rctx[q0 + j] > maxctx) maxctx = rctx[q0 + j];
        }
    }
    /* items: (row, block of heads) */
    const int nt = M->nthreads > 0 ? M->nthreads : 1;
    const int hb = T >= nt ? 1 : (nt < n ? nt : n), per = (n + hb - 1) / hb;
    const int64_t ws = (int64_t)per * (2 * R + maxctx) + D; /* + an int8 latent's dequantised row */
    float *work = malloc((size_t)(nt * ws) * sizeof(float));
    int *errs = calloc((size_t)(T * hb), sizeof(int));
    if (!work || !errs) {
        free(work);
        free(errs);
        free(mem);
        free(rowinfo);
        return -1;
    }
    #pragma omp parallel for schedule(static) num_threads(nt) if (T * hb > 1)
    for (int64_t it = 0; it < T * hb; it++) {
        const int64_t t = it / hb;
        const int h0 = (int)(it % hb) * per, h1 = h0 + per < n ? h0 + per : n;
        float *out_t = o + t * n * V;
        if (h0 >= h1) continue;
        if (rseq[t] < 0) { /* a padding row */
            memset(out_t + (int64_t)h0 * V, 0, (size_t)(h1 - h0) * V * sizeof(float));
            continue;
        }
        float *w = work + (int64_t)omp_get_thread_num() * ws;
        float *qlat = w, *olat = qlat + (int64_t)per * R, *sc = olat + (int64_t)per * R, *row = sc + (int64_t)per * maxctx;
        const int32_t ctx = rctx[t];
        const int32_t *bt = S->bt + (int64_t)rid[t] * S->bt_s0;
        for (int h = h0; h < h1; h++) { /* q_lat = W_UK^T q_nope */
            float *ql = qlat + (int64_t)(h - h0) * R;
            const float *qn = q + (t * n + h) * QK, *wuk = A->kv_b + (int64_t)h * (nope + V) * R;
            if (A->k_b) {
                if ((errs[it] = M->qmm(A->k_b[h], 1, qn, QK, ql, 1))) break;
                continue;
            }
            memset(ql, 0, (size_t)R * sizeof(float));
            for (int d = 0; d < nope; d++) axpy8(ql, qn[d], wuk + (int64_t)d * R, R);
        }
        if (errs[it]) continue;
        for (int32_t s = 0; s < ctx; s++) {
            const float *c = latent_row(LA, cache, scales, bt, s, D, row);
            for (int h = h0; h < h1; h++)
                sc[(int64_t)(h - h0) * maxctx + s] =
                    (dot8(qlat + (int64_t)(h - h0) * R, c, R) + dot8(q + (t * n + h) * QK + nope, c + R, rp)) * scale;
        }
        for (int h = h0; h < h1; h++) {
            float *p = sc + (int64_t)(h - h0) * maxctx, mx = -INFINITY, sum = 0.0f;
            for (int32_t s = 0; s < ctx; s++)
                if (p[s] > mx) mx = p[s];
            for (int32_t s = 0; s < ctx; s++) sum += (p[s] = expf(p[s] - mx));
            for (int32_t s = 0; s < ctx; s++) p[s] /= sum;
        }
        memset(olat, 0, (size_t)(h1 - h0) * R * sizeof(float));
        for (int32_t s = 0; s < ctx; s++) {
            const float *c = latent_row(LA, cache, scales, bt, s, D, row);
            for (int h = h0; h < h1; h++)
                axpy8(olat + (int64_t)(h - h0) * R, sc[(int64_t)(h - h0) * maxctx + s], c, R);
        }
        for (int h = h0; h < h1; h++) { /* out = W_UV o_lat */
            const float *wuv = A->kv_b + ((int64_t)h * (nope + V) + nope) * R, *ol = olat + (int64_t)(h - h0) * R;
            if (A->v_b) {
                if ((errs[it] = M->qmm(A->v_b[h], 1, ol, R, out_t + (int64_t)h * V, 1))) break;
                continue;
            }
            for (int vv = 0; vv < V; vv++) out_t[(int64_t)h * V + vv] = dot8(wuv + (int64_t)vv * R, ol, R);
        }
    }
    int err = 0;
    for (int64_t it = 0; it < T * hb && !err; it++) err = errs[it];
    free(errs);
    free(work);
    if (err) {
        free(mem);
        free(rowinfo);
        return err - 1000;
    }
    free(mem);
    free(rowinfo);
    return 0;
}

/* residual [T, hidden] float32 contiguous, updated in place by every layer; cos/sin float32
 * [T, d/2] (cos_l/sin_l: the local table's rows, for local_rope layers; else NULL); attn_args:
 * the step's n_args layer_args_t (an MLA model's: latent_args_t), one per KV layer group (layer i takes
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
    int64_t Q = (int64_t)M->hq * M->d, KV = (int64_t)M->hkv * M->d;
    for (int32_t i = 0; i < M->num_layers; i++) /* an MLA layer's attention output [T, n v] goes in o */
        if (M->layers[i].mla && (int64_t)M->layers[i].mla->n * M->layers[i].mla->v > Q)
            Q = (int64_t)M->layers[i].mla->n * M->layers[i].mla->v;
    const int64_t H = M->hidden, I = M->inter;
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
        int64_t o_width = (int64_t)M->hq * M->d;
        if (L->mla) {
            o_width = (int64_t)L->mla->n * L->mla->v;
            rc = mla_attention(M, L->mla, (const latent_args_t *)attn_args[L->group], T, x, L->k_cache,
                               (uint16_t *)L->v_cache, cos_t, sin_t, L->scale, o);
            if (rc <= -1000) { /* a matmul's code */
                rc += 1000;
                break;
            }
            if (rc) { /* -1: no memory (as the loop's own); -2, -4: the attention codes */
                if (rc != -1) rc -= ATTN_ERR;
                break;
            }
        } else {
            const int64_t QH = (int64_t)M->hq * M->d;
            if ((rc = M->qmm(L->qkv, T, x, H, qkv, M->nthreads))) break;
            if (L->q_norm) {
                M->head_norm(T, M->hq, M->d, qkv, QH + 2 * KV, 0, L->q_norm, M->eps, M->offset);
                M->head_norm(T, M->hkv, M->d, qkv + QH, QH + 2 * KV, 0, L->k_norm, M->eps, M->offset);
            }
            M->rope(T, M->hq, M->hkv, M->d, qkv, QH + 2 * KV, 0, L->local_rope ? cos_l : cos_t,
                    L->local_rope ? sin_l : sin_t, q, k, v);
            if ((rc = M->attend(attn_args[L->group], q, k, v, L->k_cache, L->v_cache, o, L->scale, L->window,
                                L->softcap, L->sinks))) {
                rc -= ATTN_ERR;
                break;
            }
        }
        if ((rc = M->qmm(L->o, T, o, o_width, attn, M->nthreads))) break;
        if (L->residual_scale != 1.0f)
            for (int64_t j = 0; j < T * H; j++) attn[j] *= L->residual_scale;
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
        if (L->residual_scale != 1.0f)
            for (int64_t j = 0; j < T * H; j++) residual[j] += mlp_out[j] * L->residual_scale;
        else
            for (int64_t j = 0; j < T * H; j++) residual[j] += mlp_out[j];
    }
    free(mem);
    return rc;
}
