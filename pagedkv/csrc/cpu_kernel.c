/* pagedkv CPU paged-attention kernel: every query row (prefill chunks, decode rows, verify rows).
 *
 * Built at first use by pagedkv/ops/cpu_kernel.py with the system C compiler and called
 * through ctypes; no Python or torch headers.
 *
 * One work item = (sequence, up to RB consecutive query rows of it, context segment, range of
 * KV heads). It walks the sequence's block table in tiles of CHUNK tokens; for each token it
 * reads the K rows of its KV heads once (all heads of a token are adjacent in NHD, so a block is
 * read front to back), dots each with the rows' g = Hq/Hkv query vectors of that KV head, then
 * updates an online softmax (running max m, running sum l, accumulator acc, all float32) and
 * accumulates P V. Nothing past a row's own position or before its window (and no padding
 * block-table entry) is read.
 *
 * Batch invariance (docs/determinism.md): a row's output depends only on its query, its
 * visible keys and values, and nothing else: not on the other rows of its item, the batch, the
 * chunk it came in, or the thread count. Its arithmetic is fixed by absolute key positions:
 * tiles are the aligned spans [16i, 16i + 16), every score is the same 8-lane dot product
 * summed by the same tree (hsum8x8v), the softmax of a tile runs over the row's own keys in
 * order, and a long context is cut into segments at absolute multiples of split_len (a
 * row's segments are merged in order) whatever else runs. So prefill chunks, decode rows,
 * speculative verify rows and recomputes all take this one path.
 *
 * Cache addressing (any layout whose head_dim is contiguous; strides in elements):
 *   row(t, h) = base + block_table[s][t / bs] * s_blk + (t % bs) * s_tok + h * s_head
 * NHD [nb, bs, H, d]: s_blk = bs*H*d, s_tok = H*d, s_head = d.
 * HND [nb, H, bs, d]: s_blk = H*bs*d, s_tok = d,   s_head = bs*d.
 * Ascend [nb, bs, H*d]: as NHD.
 *
 * Cache formats (kdt): 0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3 (fn), 4 fp8 e5m2. The last
 * three are quantised: one byte per element plus a bf16 scale per group of `grp` elements of
 * each head vector, at the same (block, offset, head) addresses with their own strides
 * (ss_blk, ss_tok, ss_head; the group index is the last, contiguous axis). A K row is
 * dequantised in registers as it is loaded, a V chunk into the float32 buffer the bf16 path
 * already widens into: the context is never expanded beyond one CHUNK. The query and output
 * are float32 or bfloat16 (qdt), independent of the cache format. fp8 codes are decoded with
 * integer operations (no AVX-512 FP8/FP16 instructions assumed, no reliance on denormals).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define CHUNK 16  /* keys per tile (a multiple of 8) */
#define RB 4      /* query rows per work item */
#define MAXHQ 256 /* query heads */
#define MAXD 256  /* head dim (multiple of 8) */

typedef struct {
    int32_t seq, row, nrow; /* sequence index, first query row inside its chunk, rows (<= RB) */
    int32_t end0;         /* first row's context end (its position + 1); row r ends at end0 + r */
    int32_t h0, h1;       /* KV heads [h0, h1) */
    int32_t split;        /* -1: the only segment (write out); else its index */
    int32_t t0, t1;       /* the segment's key positions [t0, t1) (absolute; rows clip to theirs) */
    int64_t scratch;      /* offset (floats) of this item's partial results */
} item_t;

typedef struct {
    int qdt, kdt, hq, hkv, d, bs, prefetch;
    float scale;
    float softcap;      /* > 0: scores become softcap * tanh(score / softcap) */
    int window;         /* > 0: a row at position p sees p - window + 1 .. p */
    const char *q; int64_t q_s0, q_s1;
    const char *k, *v; int64_t s_blk, s_tok, s_head;
    const uint16_t *ks, *vs; int64_t ss_blk, ss_tok, ss_head; int grp; /* quantised: bf16 scales */
    const int32_t *bt; int64_t bt_s0;
    const int32_t *seq_lens, *q_start;
    char *out; int64_t o_s0, o_s1;
    float *scratch;     /* split partials */
    float *work;        /* per-thread workspace */
    int64_t work_per_thread;
    const float *sinks; /* [hq] float32 logits with no value in each softmax's denominator, or NULL */
} args_t;

/* ---- 8-wide float vectors (GCC/Clang generic vectors: AVX2 on x86, NEON pairs on ARM) ---- */
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f ld_f32(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
static inline void st_f32(float *p, v8f v) { memcpy(p, &v, 32); }
static inline v8f ld_bf16(const uint16_t *p) {
    v8u16 h; memcpy(&h, p, 16);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;
    v8f f; memcpy(&f, &w, 32); return f;
}
static inline v8f ld_any(const void *p, int x, int dtype) {
    return dtype == 0 ? ld_f32((const float *)p + x) : ld_bf16((const uint16_t *)p + x);
}
/* The value of one quantised code (KDT 2: int8; 3: fp8 e4m3fn; 4: fp8 e5m2), unscaled. fp8:
 * normal codes rebias the exponent, subnormal codes (exponent 0) are mantissa * 2^(1-bias-MB);
 * integer operations only (no FP8/FP16 instructions, no reliance on denormals). */
static inline float code_value(uint8_t b, const int KDT) {
    if (KDT == 2) return (float)(int8_t)b;
    const int EB = KDT == 3 ? 4 : 5, MB = 7 - EB, bias = (1 << (EB - 1)) - 1;
    const uint32_t em = b & 0x7fu, sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t normal = (em << (23 - MB)) + ((uint32_t)(127 - bias) << 23);
    const float sub = (float)em * (1.0f / (float)(1 << (bias - 1 + MB)));
    uint32_t sb;
    memcpy(&sb, &sub, 4);
    const uint32_t u = (em < (1u << MB) ? sb : normal) | sign;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* bf16 -> float32 (a scale; one per group, so scalar) */
static inline float bf16_to_f32(uint16_t h) { const uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* Dequantise one row of d codes into out (float32): each group of grp codes times its bf16
 * scale. Plain loops, which GCC and Clang vectorise (GCC 12 scalarises the same widening
 * written with vector-extension types). */
static inline void deq_row(const uint8_t *restrict p, const uint16_t *restrict sr, int d, int grp,
                           float *restrict out, const int KDT) {
    for (int x = 0; x < d; x++) out[x] = code_value(p[x], KDT); /* d is a constant per instantiation */
    for (int g0 = 0; g0 < d; g0 += grp) {
        const float sc = bf16_to_f32(sr[g0 / grp]);
        for (int x = g0; x < g0 + grp; x++) out[x] *= sc;
    }
}
static inline float hsum8(v8f v) { /* the tree of hsum8x8v's lanes */
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* r[t] = sum of the 8 lanes of a[t] (t = 0..7) as one vector: a transpose-and-add, much
 * cheaper than 8 separate horizontal sums. */
static inline v8f hsum8x8v(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
    const v8f u01 = SHUF(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8f u23 = SHUF(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8f u45 = SHUF(a4, a5, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a4, a5, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8f u67 = SHUF(a6, a7, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a6, a7, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8f w0 = SHUF(u01, u23, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(u01, u23, 2, 3, 10, 11, 6, 7, 14, 15);
    const v8f w1 = SHUF(u45, u67, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(u45, u67, 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(w0, w1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(w0, w1, 4, 5, 6, 7, 12, 13, 14, 15);
#undef SHUF
#else
    return (v8f){hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3), hsum8(a4), hsum8(a5), hsum8(a6), hsum8(a7)};
#endif
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (scores minus their running max): Cody-Waite reduction + degree-6
 * polynomial, a few ulp; vectorisable, unlike libm's expf. */
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
    float sc; memcpy(&sc, &e, 4);
    return p * sc;
}

/* Row pointers (head h0, K and V) of tokens t .. t+n-1: one division per call, then the
 * (block, offset) pair is advanced incrementally (an integer division per token is not free). */
static inline void token_rows(const args_t *A, const int32_t *table, int t, int n, int64_t hoff, int esz,
                              const char **kp, const char **vp) {
    int lb = t / A->bs, o = t - lb * A->bs;
    int64_t base = (int64_t)table[lb] * A->s_blk;
    for (int i = 0; i < n; i++) {
        const int64_t off = (base + (int64_t)o * A->s_tok + hoff) * esz;
        kp[i] = A->k + off;
        vp[i] = A->v + off;
        if (++o == A->bs && i + 1 < n) { o = 0; base = (int64_t)table[++lb] * A->s_blk; }
    }
}

/* Scale rows (head h0's first group, K and V) of tokens t .. t+n-1 of a quantised cache. */
static inline void scale_rows(const args_t *A, const int32_t *table, int t, int n, int h0,
                              const uint16_t **ksp, const uint16_t **vsp) {
    for (int i = 0; i < n; i++) {
        const int lb = (t + i) / A->bs, o = (t + i) - lb * A->bs;
        const int64_t off = (int64_t)table[lb] * A->ss_blk + (int64_t)o * A->ss_tok + (int64_t)h0 * A->ss_head;
        ksp[i] = A->ks + off;
        vsp[i] = A->vs + off;
    }
}

/* prefetch (into L1) the nkv head rows of one token: row h at p + h * head_stride bytes */
static inline void prefetch_rows(const char *p, int nkv, int64_t head_stride, int row_bytes) {
    if (head_stride == row_bytes) { /* heads adjacent (NHD / Ascend): one span */
        for (int b = 0; b < nkv * row_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
    } else {
        for (int h = 0; h < nkv; h++)
            for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + h * head_stride + b, 0, 3);
    }
}

/* 1 / the softmax denominator of a row with running max m and sum l (l * exp(m)), with query
 * head h's sink joining it when there are sinks: acc * (the returned factor) is the output.
 * With a sink, acc (held relative to m) is rescaled to the common max max(m, sink) first. */
static inline float row_inv(const args_t *A, int h, float m, float l) {
    if (!A->sinks) return l > 0.f ? 1.f / l : 0.f;
    const float s = A->sinks[h], mx = m > s ? m : s;
    const float a = m == -INFINITY ? 0.f : exp_neg(m - mx);
    return a / (l * a + exp_neg(s - mx));
}

static inline void store_row(char *o, const float *acc, float inv, int d, int dtype) {
    if (dtype == 0) { float *of = (float *)o; for (int x = 0; x < d; x++) of[x] = acc[x] * inv; }
    else { uint16_t *ob = (uint16_t *)o; for (int x = 0; x < d; x++) ob[x] = f32_to_bf16(acc[x] * inv); }
}

/* A row's visible keys in an item: [max(t0, window start), min(t1, end)). */
static inline void row_range(const args_t *A, const item_t *it, int r, int *a, int *b) {
    const int end = it->end0 + r, lo = A->window > 0 && end > A->window ? end - A->window : 0;
    *a = lo > it->t0 ? lo : it->t0;
    *b = end < it->t1 ? end : it->t1;
}

/* One work item; NV = head_dim / 8, DT = cache format (kdt above). always_inline so each
 * (NV, DT) instantiation below gets constant trip counts. Query vector q = r * nh + j (row r of
 * the item, head h0 * g + j). Per-tile arrays are indexed by the key's offset in its aligned
 * tile, so a row runs the same loops over the same indices whatever rows share its item. */
static inline __attribute__((always_inline)) void item_body(const args_t *A, const item_t *it, float *work,
                                                            const int NV, const int DT) {
    const int d = NV * 8, g = A->hq / A->hkv, esz = DT == 0 ? 4 : DT == 1 ? 2 : 1;
    const int qsz = A->qdt == 0 ? 4 : 2, QUANT = DT >= 2;
    const uint16_t *ksp[CHUNK], *vsp[CHUNK]; /* quantised: scale rows of this tile */
    const int s = it->seq, h0 = it->h0, nkv = it->h1 - it->h0, nh = nkv * g, nr = it->nrow, nq = nr * nh;
    /* workspace: qf [nq*d] | acc [nq*d] | vbuf [CHUNK*nkv*d] | kbuf [CHUNK*nkv*d] | sc [nq*CHUNK]
     *            | m [nq] | l [nq] */
    float *qf = work, *acc = qf + (int64_t)nq * d, *vbuf = acc + (int64_t)nq * d;
    float *kbuf = vbuf + (int64_t)CHUNK * nkv * d, *sc = kbuf + (int64_t)CHUNK * nkv * d;
    float *m = sc + nq * CHUNK, *l = m + nq;
    const char *kp[CHUNK], *vp[CHUNK];
    const char *kn[CHUNK], *vn[CHUNK]; /* next tile's rows, for software prefetch */
    int ra[RB], rb[RB];
    const int64_t qrow0 = (int64_t)A->q_start[s] + it->row;
    for (int r = 0; r < nr; r++) {
        row_range(A, it, r, &ra[r], &rb[r]);
        for (int j = 0; j < nh; j++) {
            const char *qs = A->q + ((qrow0 + r) * A->q_s0 + (int64_t)(h0 * g + j) * A->q_s1) * qsz;
            float *qd = qf + (int64_t)(r * nh + j) * d;
            for (int c = 0; c < NV; c++) st_f32(qd + 8 * c, ld_any(qs, 8 * c, A->qdt) * A->scale);
            m[r * nh + j] = -INFINITY;
            l[r * nh + j] = 0.f;
        }
    }
    memset(acc, 0, sizeof(float) * (size_t)nq * d);
    const int lo_all = ra[0], hi_all = rb[nr - 1]; /* rows are consecutive: both nondecreasing */
    const int32_t *table = A->bt + (int64_t)s * A->bt_s0;
    const int64_t hoff = (int64_t)h0 * A->s_head;
    for (int t = lo_all / CHUNK * CHUNK; t < hi_all; t += CHUNK) {
        const int kl = t > lo_all ? t : lo_all, kh = t + CHUNK < hi_all ? t + CHUNK : hi_all;
        const int i_lo = kl - t, i_hi = kh - t;
        token_rows(A, table, kl, kh - kl, hoff, esz, kp + i_lo, vp + i_lo);
        if (QUANT) scale_rows(A, table, kl, kh - kl, h0, ksp + i_lo, vsp + i_lo);
        /* Software prefetch of the next tile: blocks are scattered, so the hardware stream
         * prefetchers restart at every block boundary. The prefetches are spread over this
         * tile's loops (one token's rows per iteration) rather than issued in one burst,
         * which would fill the line-fill buffers ahead of this tile's own loads. */
        int nn = 0;
        if (A->prefetch) {
            const int t2 = t + A->prefetch * CHUNK; /* prefetch distance, in tiles */
            nn = hi_all - t2 < CHUNK ? hi_all - t2 : CHUNK;
            if (nn > 0) token_rows(A, table, t2, nn, hoff, esz, kn, vn);
        }
        if (DT != 0) /* widen (dequantise) the K tile once into kbuf; the score passes read it from L1 */
            for (int i = i_lo; i < i_hi; i++)
                for (int hh = 0; hh < nkv; hh++) {
                    const char *kr = kp[i] + (int64_t)hh * A->s_head * esz;
                    float *dst = kbuf + ((int64_t)i * nkv + hh) * d;
                    if (QUANT) deq_row((const uint8_t *)kr, ksp[i] + (int64_t)hh * A->ss_head, d, A->grp, dst, DT);
                    else for (int c = 0; c < NV; c++) st_f32(dst + 8 * c, ld_bf16((const uint16_t *)kr + 8 * c));
                }
        for (int i = 0; i < nn; i++) prefetch_rows(kn[i], nkv, A->s_head * esz, d * esz);
        /* scores: per query vector (held in registers), 8 aligned keys at a time: each an 8-lane
         * dot product (two FMA chains), the 8 reduced by one transpose-and-add */
        for (int q = 0; q < nq; q++) {
            const int r = q / nh, hh = (q % nh) / g;
            const int i0 = ra[r] - t > i_lo ? ra[r] - t : i_lo, i1 = rb[r] - t < i_hi ? rb[r] - t : i_hi;
            if (i0 >= i1) continue;
            v8f qv[MAXD / 8];
            for (int c = 0; c < NV; c++) qv[c] = ld_f32(qf + (int64_t)q * d + 8 * c);
            for (int g8 = i0 / 8 * 8; g8 < i1; g8 += 8) {
                v8f pt[8];
                /* all 8 lanes computed (a key outside the row's is clamped to one of its keys:
                 * its lane is never used), so the loop unrolls and pt stays in registers */
#pragma GCC unroll 8
                for (int u = 0; u < 8; u++) {
                    const int i = g8 + u < i0 ? i0 : g8 + u >= i1 ? i1 - 1 : g8 + u;
                    const float *kr = DT == 0 ? (const float *)(kp[i] + (int64_t)hh * A->s_head * esz)
                                              : kbuf + ((int64_t)i * nkv + hh) * d;
                    v8f a0 = qv[0] * ld_f32(kr);
                    v8f a1 = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
                    int c = 1;
                    for (; c + 1 < NV; c += 2) {
                        a1 += qv[c] * ld_f32(kr + 8 * c);
                        a0 += qv[c + 1] * ld_f32(kr + 8 * c + 8);
                    }
                    for (; c < NV; c++) a1 += qv[c] * ld_f32(kr + 8 * c);
                    pt[u] = a0 + a1;
                }
                st_f32(sc + q * CHUNK + g8, hsum8x8v(pt[0], pt[1], pt[2], pt[3], pt[4], pt[5], pt[6], pt[7]));
            }
            if (A->softcap > 0.f) {
                const float cap = A->softcap, inv_cap = 1.f / A->softcap;
                for (int i = i0; i < i1; i++) sc[q * CHUNK + i] = cap * tanhf(sc[q * CHUNK + i] * inv_cap);
            }
        }
        if (DT != 0) /* widen (dequantise) the V tile once; the passes below read float32 from L1 */
            for (int i = i_lo; i < i_hi; i++)
                for (int hh = 0; hh < nkv; hh++) {
                    const char *vr = vp[i] + (int64_t)hh * A->s_head * esz;
                    float *dst = vbuf + ((int64_t)i * nkv + hh) * d;
                    if (QUANT) {
                        deq_row((const uint8_t *)vr, vsp[i] + (int64_t)hh * A->ss_head, d, A->grp, dst, DT);
                    } else {
                        for (int c = 0; c < NV; c++) st_f32(dst + 8 * c, ld_bf16((const uint16_t *)vr + 8 * c));
                    }
                }
        /* online softmax + P V over each row's own keys of the tile, one query vector at a time
         * (its accumulator stays in registers) */
        for (int q = 0; q < nq; q++) {
            const int r = q / nh, hh = (q % nh) / g;
            const int i0 = ra[r] - t > i_lo ? ra[r] - t : i_lo, i1 = rb[r] - t < i_hi ? rb[r] - t : i_hi;
            if (i0 >= i1) continue;
            /* over the whole tile with the row's keys selected (fixed trip counts, so these
             * vectorise; a row's selection is the same in any item) */
            float *sj = sc + q * CHUNK;
            float cm = -INFINITY;
            for (int i = 0; i < CHUNK; i++) { const float x = i >= i0 && i < i1 ? sj[i] : -INFINITY; cm = x > cm ? x : cm; }
            const float mn = cm > m[q] ? cm : m[q];
            const float alpha = m[q] == -INFINITY ? 0.f : exp_neg(m[q] - mn);
            float sum = 0.f;
            for (int i = 0; i < CHUNK; i++) {
                const float e = exp_neg((i >= i0 && i < i1 ? sj[i] : mn) - mn);
                sj[i] = i >= i0 && i < i1 ? e : 0.f;
                sum += sj[i];
            }
            l[q] = l[q] * alpha + sum;
            m[q] = mn;
            float *aj = acc + (int64_t)q * d;
            for (int c0 = 0; c0 < NV; c0 += 8) { /* at most 8 accumulator vectors live */
                const int nc = NV - c0 < 8 ? NV - c0 : 8;
                v8f av[8];
                for (int c = 0; c < nc; c++) av[c] = ld_f32(aj + 8 * (c0 + c)) * alpha;
                for (int i = i0; i < i1; i++) {
                    if (q == 0 && c0 == 0 && i - i0 < nn) prefetch_rows(vn[i - i0], nkv, A->s_head * esz, d * esz);
                    const float p = sj[i];
                    const float *vr = DT == 0
                        ? (const float *)(vp[i] + (int64_t)hh * A->s_head * esz) + 8 * c0
                        : vbuf + ((int64_t)i * nkv + hh) * d + 8 * c0;
                    for (int c = 0; c < nc; c++) av[c] += p * ld_f32(vr + 8 * c);
                }
                for (int c = 0; c < nc; c++) st_f32(aj + 8 * (c0 + c), av[c]);
            }
        }
    }
    if (it->split >= 0) { /* partial results: [nq] m, [nq] l, [nq*d] acc */
        float *p = A->scratch + it->scratch;
        memcpy(p, m, sizeof(float) * nq);
        memcpy(p + nq, l, sizeof(float) * nq);
        memcpy(p + 2 * nq, acc, sizeof(float) * (size_t)nq * d);
        return;
    }
    for (int q = 0; q < nq; q++) {
        const int r = q / nh, j = q % nh;
        const float inv = row_inv(A, h0 * g + j, m[q], l[q]);
        store_row(A->out + ((qrow0 + r) * A->o_s0 + (int64_t)(h0 * g + j) * A->o_s1) * qsz, acc + (int64_t)q * d, inv, d, A->qdt);
    }
}

typedef void (*item_fn)(const args_t *, const item_t *, float *);
#define INST(NV, DT) \
    static void item_##NV##_##DT(const args_t *A, const item_t *it, float *w) { item_body(A, it, w, NV, DT); }
#define INST_ALL(NV) INST(NV, 0) INST(NV, 1) INST(NV, 2) INST(NV, 3) INST(NV, 4)
INST_ALL(4) INST_ALL(8) INST_ALL(16)
#define GENERIC(DT) \
    static void item_g_##DT(const args_t *A, const item_t *it, float *w) { item_body(A, it, w, A->d / 8, DT); }
GENERIC(0) GENERIC(1) GENERIC(2) GENERIC(3) GENERIC(4)
#define ROW(NV) {item_##NV##_0, item_##NV##_1, item_##NV##_2, item_##NV##_3, item_##NV##_4}
static const item_fn ITEMS[4][5] = {ROW(4), ROW(8), ROW(16), {item_g_0, item_g_1, item_g_2, item_g_3, item_g_4}};

static void run_item(const args_t *A, const item_t *it, float *w) {
    const int nv = A->d / 8;
    ITEMS[nv == 4 ? 0 : nv == 8 ? 1 : nv == 16 ? 2 : 3][A->kdt](A, it, w);
}

/* Merge the partials of items [first, first + nsplit) (same seq/rows/heads; segments in order). */
static void merge_splits(const args_t *A, const item_t *first, int nsplit) {
    const int d = A->d, g = A->hq / A->hkv, esz = A->qdt == 0 ? 4 : 2;
    const int nh = (first->h1 - first->h0) * g, nq = first->nrow * nh;
    float acc[MAXD];
    for (int q = 0; q < nq; q++) {
        const int r = q / nh, j = q % nh;
        const int64_t qrow = (int64_t)A->q_start[first->seq] + first->row + r;
        float M = -INFINITY, Lsum = 0.f;
        for (int c = 0; c < nsplit; c++) {
            const float mj = A->scratch[first[c].scratch + q];
            if (mj > M) M = mj;
        }
        memset(acc, 0, sizeof(float) * d);
        for (int c = 0; c < nsplit; c++) {
            const float *p = A->scratch + first[c].scratch;
            if (p[q] == -INFINITY) continue;
            const float w = exp_neg(p[q] - M);
            Lsum += w * p[nq + q];
            const float *pa = p + 2 * nq + (int64_t)q * d;
            for (int x = 0; x < d; x++) acc[x] += w * pa[x];
        }
        const float inv = row_inv(A, first->h0 * g + j, M, Lsum); /* (a sink joins at M) */
        store_row(A->out + (qrow * A->o_s0 + (int64_t)(first->h0 * g + j) * A->o_s1) * esz, acc, inv, d, A->qdt);
    }
}

int pagedkv_max_heads(void) { return MAXHQ; }
int pagedkv_max_head_dim(void) { return MAXD; }

/* Paged attention of n_seqs sequences. seq_ids[i] indexes seq_lens / q_start / block_tables
 * rows; q_lens[i] is its number of new tokens (query rows), which sit at positions
 * seq_len - q_len .. seq_len - 1 and attend causally. Strides are in elements.
 * window > 0: the row at position p sees only positions p - window + 1 .. p (its work items
 * start there: no K/V before it, nor its block-table entry, is read). softcap > 0: scores
 * (scale included) become softcap * tanh(score / softcap) before the softmax. sinks: NULL, or
 * float32 [hq]: query head h's softmax denominator gains exp(sinks[h]) (a logit in the scaled,
 * capped scores' units with no value: gpt-oss), joined where a row's output is stored (its
 * running max and sum, or its segments' merged ones, rescaled to max(m, sink)).
 * min_split_len: split_len, tokens (rounded up to a multiple of 16): a row's keys are cut into
 * segments at absolute multiples of it, each segment one work item, merged in order (0: one
 * segment); a function of the row alone, so results do not depend on the batch. qdt: query/output
 * format (0 f32, 1 bf16); kdt: cache format (see the top); ks/vs: bf16 scales (kdt >= 2).
 * Returns 0, or -1 bad shape, -2 bad dtype, -3 out of memory. */
int pagedkv_paged_attention(
    int qdt, int kdt, int hq, int hkv, int d, int bs, float scale,
    const void *q, int64_t q_s0, int64_t q_s1,
    const void *k, const void *v, int64_t s_blk, int64_t s_tok, int64_t s_head,
    const void *ks, const void *vs, int64_t ss_blk, int64_t ss_tok, int64_t ss_head, int grp,
    const int32_t *bt, int64_t bt_s0,
    const int32_t *seq_lens, const int32_t *q_start,
    const int32_t *seq_ids, const int32_t *q_lens, int n_seqs,
    void *out, int64_t o_s0, int64_t o_s1,
    int nthreads, int min_split_len, int prefetch, int window, float softcap, const float *sinks)
{
    if (hkv <= 0 || hq % hkv || hq > MAXHQ || d > MAXD || d <= 0 || d % 8 || bs <= 0) return -1;
    if ((qdt != 0 && qdt != 1) || kdt < 0 || kdt > 4) return -2;
    if (kdt >= 2 && (grp <= 0 || grp % 8 || d % grp || !ks || !vs)) return -1;
    if (nthreads < 1) nthreads = 1;
    if (window < 0 || softcap < 0.f) return -1;
    const int g = hq / hkv;
    /* split_len: segments at absolute multiples of it (a multiple of CHUNK; 0 = one segment) */
    /* (a value within a tile of INT_MAX means "never split": rounding it up would overflow) */
    const int S = min_split_len > 0 && min_split_len <= INT32_MAX - CHUNK ? (min_split_len + CHUNK - 1) / CHUNK * CHUNK : 0;
    /* Work items: each sequence's rows in blocks of up to RB consecutive rows with the same
     * first and last segment, times those segments, times KV-head groups. Everything that
     * decides a row's arithmetic (its segments, its tiles) depends on that row alone. */
    int64_t blocks = 0; /* (row block, segment) pairs */
    for (int i = 0; i < n_seqs; i++) {
        const int sl = seq_lens[seq_ids[i]];
        int cur = 0, f0 = -1, l0 = -1;
        for (int r = 0; r < q_lens[i]; r++) {
            const int end = sl - q_lens[i] + r + 1, lo = window > 0 && end > window ? end - window : 0;
            const int f = S ? lo / S : 0, la = S ? (end - 1) / S : 0;
            if (cur == 0 || cur == RB || f != f0 || la != l0) { blocks += la - f + 1; cur = 0; f0 = f; l0 = la; }
            cur++;
        }
    }
    if (blocks == 0) return 0;
    /* parallelism: blocks and segments first, then KV-head groups (no arithmetic changes) */
    const int64_t want = 2 * (int64_t)nthreads;
    int hgroups = 1;
    if (blocks < want) { hgroups = (int)((want + blocks - 1) / blocks); if (hgroups > hkv) hgroups = hkv; }
    const int64_t total = blocks * hgroups;
    item_t *items = (item_t *)malloc(sizeof(item_t) * (size_t)total);
    if (!items) return -3;
    int64_t n_items = 0, scratch_floats = 0;
    for (int i = 0; i < n_seqs; i++) {
        const int s = seq_ids[i], sl = seq_lens[s], ql = q_lens[i];
        for (int r = 0; r < ql;) {
            const int end = sl - ql + r + 1, lo = window > 0 && end > window ? end - window : 0;
            const int f = S ? lo / S : 0, la = S ? (end - 1) / S : 0;
            int nr = 1;
            while (nr < RB && r + nr < ql) {
                const int e2 = end + nr, lo2 = window > 0 && e2 > window ? e2 - window : 0;
                if ((S ? lo2 / S : 0) != f || (S ? (e2 - 1) / S : 0) != la) break;
                nr++;
            }
            const int ns = la - f + 1;
            for (int hg = 0; hg < hgroups; hg++) {
                const int h0 = (int)((int64_t)hkv * hg / hgroups), h1 = (int)((int64_t)hkv * (hg + 1) / hgroups);
                const int64_t per_partial = (int64_t)nr * (h1 - h0) * g * (2 + d);
                for (int c = 0; c < ns; c++) {
                    item_t *it = &items[n_items++];
                    it->seq = s; it->row = r; it->nrow = nr; it->end0 = end; it->h0 = h0; it->h1 = h1;
                    it->split = ns > 1 ? c : -1;
                    it->t0 = S ? (f + c) * S : 0;
                    it->t1 = S ? (f + c + 1) * S : INT32_MAX;
                    it->scratch = ns > 1 ? scratch_floats : 0;
                    if (ns > 1) scratch_floats += per_partial;
                }
            }
            r += nr;
        }
    }
    const int64_t wpt = RB * (2 * (int64_t)hq * d + (int64_t)hq * CHUNK + 2 * hq) + 2 * (int64_t)CHUNK * hkv * d + 16;
    float *work = (float *)malloc(sizeof(float) * (size_t)(wpt * nthreads));
    float *scratch = scratch_floats ? (float *)malloc(sizeof(float) * (size_t)scratch_floats) : NULL;
    if (!work || (scratch_floats && !scratch)) { free(items); free(work); free(scratch); return -3; }
    args_t A = {qdt, kdt, hq, hkv, d, bs, prefetch, scale, softcap, window, (const char *)q, q_s0, q_s1, (const char *)k,
                (const char *)v, s_blk, s_tok, s_head, (const uint16_t *)ks, (const uint16_t *)vs,
                ss_blk, ss_tok, ss_head, grp, bt, bt_s0, seq_lens, q_start,
                (char *)out, o_s0, o_s1, scratch, work, wpt, sinks};
    if (n_items == 1 || nthreads == 1) {
        for (int64_t i = 0; i < n_items; i++) run_item(&A, &items[i], work);
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t i = 0; i < n_items; i++) {
#ifdef _OPENMP
            float *w = work + wpt * omp_get_thread_num();
#else
            float *w = work;
#endif
            run_item(&A, &items[i], w);
        }
    }
    if (scratch_floats) { /* splits of one (seq, row, heads) are consecutive: merge each group */
        for (int64_t i = 0; i < n_items; i++) {
            if (items[i].split != 0) continue;
            int ns = 1;
            while (i + ns < n_items && items[i + ns].split > 0) ns++;
            merge_splits(&A, &items[i], ns);
        }
    }
    free(scratch);
    free(work);
    free(items);
    return 0;
}

/* ---- fused decode-layer entry: write the step's new K/V rows, then attend ----------------
 * The engine calls this once per layer of a step whose rows all go to the kernel; everything
 * that is the same for every layer of the step (lengths, block tables, slot_mapping, cache
 * geometry) sits in one layer_args_t built once per step, so a layer costs one short call. */
typedef struct {
    int32_t qdt, kdt, hq, hkv, d, bs;       /* kdt: 0 float32 / 1 bfloat16 caches only */
    int64_t s_blk, s_tok, s_head;           /* cache strides (elements), as in the main entry */
    int64_t num_slots;                      /* num_blocks * bs: slots must be below it */
    const int32_t *bt; int64_t bt_s0;
    const int32_t *seq_lens, *q_start, *seq_ids, *q_lens; int32_t n_seqs;
    const int64_t *slots; int32_t n_tokens; /* slot_mapping [n_tokens] (-1 or below: skip) */
    int32_t n_real;                         /* rows >= n_real are padding: output zeros */
    int32_t nthreads, min_split_len, prefetch;
} layer_args_t;

/* Copy n_tokens rows [hkv, d] (contiguous, format qdt) to their slots of a float32/bf16 cache;
 * every slot is checked before anything is written (-4: one is >= num_slots). */
static int write_rows(const layer_args_t *S, const char *src, char *dst) {
    for (int i = 0; i < S->n_tokens; i++) if (S->slots[i] >= S->num_slots) return -4;
    const int d = S->d, se = S->qdt ? 2 : 4, de = S->kdt ? 2 : 4;
    for (int i = 0; i < S->n_tokens; i++) {
        const int64_t slot = S->slots[i];
        if (slot < 0) continue;
        const int64_t base = (slot / S->bs) * S->s_blk + (slot % S->bs) * S->s_tok;
        for (int h = 0; h < S->hkv; h++) {
            const char *s = src + ((int64_t)i * S->hkv + h) * d * se;
            char *o = dst + (base + h * S->s_head) * de;
            if (S->qdt == S->kdt) { memcpy(o, s, (size_t)d * se); continue; }
            if (S->kdt == 1) { /* float32 -> bf16, round to nearest even (torch's .to) */
                const float *sf = (const float *)s; uint16_t *ob = (uint16_t *)o;
                for (int x = 0; x < d; x++) ob[x] = f32_to_bf16(sf[x]);
            } else {           /* bf16 -> float32, exact */
                const uint16_t *sb = (const uint16_t *)s; float *of = (float *)o;
                for (int x = 0; x < d; x++) of[x] = bf16_to_f32(sb[x]);
            }
        }
    }
    return 0;
}

/* One layer: k_new / v_new [n_tokens, hkv, d] and q / out [n_tokens, hq, d], all contiguous in
 * format qdt; sinks: NULL or float32 [hq] (pagedkv_paged_attention). Returns 0, -4 (a slot out
 * of range; nothing written), or the attention's code. */
int pagedkv_write_attend_sinks(const layer_args_t *S, const void *q, const void *k_new, const void *v_new,
                               void *k, void *v, void *out, float scale, int window, float softcap,
                               const float *sinks)
{
    if ((S->kdt != 0 && S->kdt != 1) || (S->qdt != 0 && S->qdt != 1)) return -2;
    if (S->hkv <= 0 || S->d <= 0 || S->bs <= 0) return -1;
    int rc = write_rows(S, (const char *)k_new, (char *)k);
    if (rc) return rc;
    write_rows(S, (const char *)v_new, (char *)v);
    const int64_t row = (int64_t)S->hq * S->d;
    if (S->n_real < S->n_tokens)
        memset((char *)out + S->n_real * row * (S->qdt ? 2 : 4), 0, (size_t)((S->n_tokens - S->n_real) * row * (S->qdt ? 2 : 4)));
    return pagedkv_paged_attention(S->qdt, S->kdt, S->hq, S->hkv, S->d, S->bs, scale, q, row, S->d,
                                   k, v, S->s_blk, S->s_tok, S->s_head, NULL, NULL, 0, 0, 0, 0,
                                   S->bt, S->bt_s0, S->seq_lens, S->q_start, S->seq_ids, S->q_lens, S->n_seqs,
                                   out, row, S->d, S->nthreads, S->min_split_len, S->prefetch, window, softcap,
                                   sinks);
}

/* pagedkv_write_attend_sinks without sinks (the entry step_op.cpp calls by address) */
int pagedkv_write_attend(const layer_args_t *S, const void *q, const void *k_new, const void *v_new,
                         void *k, void *v, void *out, float scale, int window, float softcap)
{
    return pagedkv_write_attend_sinks(S, q, k_new, v_new, k, v, out, scale, window, softcap, NULL);
}
