/* The sampler's two picks in C (pagedkv.ops.sample_ops), one row per thread (OpenMP from
 * PAR_ROWS rows on; below that one thread is faster than waking the pool): at
 * batch 1 a torch reduction over the 49,152-token vocabulary costs 0.1-0.5 ms in op and
 * thread-pool overhead, ten times the work itself. The results of the torch code they replace
 * (pagedkv.engine.sampler): the first maximum of a row, and the inverse-CDF pick with the same
 * two-level fp64 search. The pick's fp64 block sums add in another order than torch's sum, so
 * where a target falls within an fp64 rounding (~1e-16 of the row's mass) of a token boundary
 * the two may pick neighbouring tokens: about one draw in 2^52, never a zero-probability token. No Python or torch headers: built with the system C compiler through
 * pagedkv.ops.build.compile_c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define PAR_ROWS 4
#define LANES 16 /* independent partial results per loop: the compiler vectorises them */

/* The largest value of row[lo, hi), lanes first, then combined (no NaN: order does not matter). */
static float block_max(const float *row, int64_t lo, int64_t hi) {
    float m[LANES];
    for (int k = 0; k < LANES; k++) m[k] = row[lo];
    int64_t i = lo;
    for (; i + LANES <= hi; i += LANES)
        for (int k = 0; k < LANES; k++) m[k] = row[i + k] > m[k] ? row[i + k] : m[k];
    float best = m[0];
    for (int k = 1; k < LANES; k++) best = m[k] > best ? m[k] : best;
    for (; i < hi; i++) best = row[i] > best ? row[i] : best;
    return best;
}

/* x [R, V] float32 (row stride xs, no NaN: the sampler checks first) -> out[r] = the first index
 * of the largest value of row r (torch's max(dim).indices and argmax agree on it): block maxima
 * of B tokens, the first block holding the row's maximum, the first index there that holds it. */
void pagedkv_argmax_rows(int64_t R, int64_t V, const float *x, int64_t xs, int64_t B, int64_t *out) {
    #pragma omp parallel for if (R >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * xs;
        float best = row[0];
        int64_t blk = 0;
        for (int64_t lo = 0; lo < V; lo += B) {
            const float m = block_max(row, lo, lo + B < V ? lo + B : V);
            if (m > best) { best = m; blk = lo; }
        }
        int64_t i = blk;
        while (i < V - 1 && !(row[i] == best)) i++; /* bounded: a NaN row (unchecked) ends at V - 1 */
        out[r] = i;
    }
}

/* The fp64 sum of row[lo, hi) in lanes, combined in a fixed order. */
static double block_sum(const float *row, int64_t lo, int64_t hi) {
    double s[LANES] = {0};
    int64_t i = lo;
    for (; i + LANES <= hi; i += LANES)
        for (int k = 0; k < LANES; k++) s[k] += (double)row[i + k];
    double t = 0.0;
    for (int k = 0; k < LANES; k++) t += s[k];
    for (; i < hi; i++) t += (double)row[i];
    return t;
}

/* p [R, V] float32 (row stride ps; non-negative, each row with a positive entry, rows need not
 * sum to 1), u [R] double in [0, 1) -> out[r] = the first index whose fp64 cumulative sum exceeds
 * u[r] * total, searched in two levels as _inverse_cdf_pick: block sums of B tokens (the last
 * block padded with zeros) and their cumulative sum find the block; the cumulative sum of that
 * block, plus the sums before it, finds the token; the target stays below the total; a block
 * whose own sum rounds below the target gives its last positive token. R x nb doubles of
 * scratch (malloc); returns -1 if that fails, else 0. */
int pagedkv_inverse_cdf_pick(int64_t R, int64_t V, const float *p, int64_t ps, const double *u, int64_t B,
                             int64_t *out) {
    const int64_t nb = (V + B - 1) / B;
    double *scratch = malloc((size_t)(R * nb) * sizeof(double));
    if (!scratch) return -1;
    #pragma omp parallel for if (R >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const float *row = p + r * ps;
        double *bcum = scratch + r * nb, acc = 0.0;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t lo = b * B, hi = lo + B < V ? lo + B : V;
            acc += block_sum(row, lo, hi);
            bcum[b] = acc;
        }
        const double total = bcum[nb - 1];
        double target = u[r] * total;
        if (!(target < total)) target = nextafter(total, 0.0);
        int64_t blk = 0;
        while (blk < nb - 1 && !(bcum[blk] > target)) blk++;
        const double before = blk > 0 ? bcum[blk - 1] : 0.0;
        const int64_t lo = blk * B, hi = lo + B < V ? lo + B : V;
        int64_t tok = -1;
        double s = 0.0;
        for (int64_t i = lo; i < hi; i++) {
            s += (double)row[i];
            if (s + before > target) { tok = i; break; }
        }
        if (tok < 0) { /* the block's sum rounded below the target: its last positive token */
            tok = lo + B - 1 < V - 1 ? lo + B - 1 : V - 1;
            for (int64_t i = hi - 1; i >= lo; i--) {
                if (row[i] > 0.0f) { tok = i; break; }
            }
        }
        out[r] = tok;
    }
    free(scratch);
    return 0;
}
