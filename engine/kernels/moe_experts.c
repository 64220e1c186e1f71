/* The routed experts of an MoE layer (float32, CPU); see moe_experts.py.
 *
 * out[t] = sum_s w[t, s] * Expert_{ids[t, s]}(x[t]), Expert_e(v) = W2_e swiglu_oai(W13_e v), each expert's
 * weights read for its own tokens only. The (token, choice) pairs are grouped by expert (a counting sort);
 * a work item is one expert and up to GROUP of its pairs. A matrix product takes the weights LANES rows at
 * a time (16 KB at H = 256 with AVX-512: they stay in L1 while every pair of the item reads them), LANES dot
 * products in LANES vector accumulators, summed across lanes at the end by a shuffle tree. Each item writes
 * its pairs' weighted outputs to their own rows of `pairs` [T * k, H]; a last pass sums a token's k rows. Nothing is
 * shared between items, so no atomics. The hidden and intermediate sizes are multiples of 16 (moe_experts.py
 * checks).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define GROUP 16 /* pairs per work item */
/* LANES (simd.h) weight rows a pass, as many as a vector has lanes: the accumulators fill the register file
 * without spilling; `lane_sums` (simd.h) adds each one's lanes. */
/* out[p, j] = w[j, :] . in[p, :] for p < m, j < rows (w [rows, cols] row-major; in [m, cols], out [m, rows]). */
static void mat_pairs(const float *w, const float *in, float *out, int64_t m, int64_t rows, int64_t cols) {
    for (int64_t j = 0; j < rows; j += LANES) {
        const float *wj = w + j * cols;
        /* NOTE: the next LANES rows asked for (a cache line each 16 floats) while these are multiplied: 1.15-1.18x
         * at 32 and 64 tokens on an AVX2 machine, the weights of 6 layers cycled (out of cache), 2 threads; 2 or 4
         * blocks ahead no better. Into L2, not L1 (locality 2): the kernel 1.10-1.15x at 8-64 tokens on an AVX-512
         * AMD, weights cycled, the same at 256 (likely: the block in use, the next one and the pairs' inputs
         * overflow its 32 KB L1); a whole eager step moves by less than that machine's noise (+-3%). */
        if (j + LANES < rows)
            for (int64_t c = 0; c < LANES * cols; c += 16) __builtin_prefetch(wj + LANES * cols + c, 0, 2);
        for (int64_t p = 0; p < m; p++) {
            const float *x = in + p * cols;
            vec acc[LANES] = {{0}};
            for (int64_t c = 0; c < cols; c += LANES) {
                vec xv = load(x + c);
                for (int r = 0; r < LANES; r++) acc[r] += load(wj + r * cols + c) * xv;
            }
            vec s = lane_sums(acc);
            memcpy(out + p * rows + j, &s, sizeof s);
        }
    }
}

void moe_experts(const float *x, const int64_t *ids, const float *weights, const float *w13, const float *w2,
                 float *pairs, float *out, int64_t tokens, int64_t topk, int64_t experts, int64_t hidden,
                 int64_t inter, float alpha, float limit) {
    const int64_t n = tokens * topk;
    int64_t *order = malloc(sizeof(int64_t) * (n + 2 * experts + 1)), *start = order + n, *fill = start + experts + 1;
    memset(start, 0, sizeof(int64_t) * (experts + 1));
    for (int64_t p = 0; p < n; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < experts; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int64_t) * experts);
    for (int64_t p = 0; p < n; p++) order[fill[ids[p]]++] = p;  /* pairs grouped by expert, in token order */
    int64_t items = 0;
    for (int64_t e = 0; e < experts; e++) items += (start[e + 1] - start[e] + GROUP - 1) / GROUP;

#pragma omp parallel
    {
        float *xs = malloc(sizeof(float) * GROUP * (2 * hidden + 2 * inter)), *hs = xs + GROUP * hidden,
              *ys = hs + GROUP * 2 * inter;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t e = 0, first = item;  /* the item-th (expert, group of GROUP pairs) */
            for (int64_t g; first >= (g = (start[e + 1] - start[e] + GROUP - 1) / GROUP); e++) first -= g;
            const int64_t *p = order + start[e] + first * GROUP;
            int64_t m = start[e + 1] - start[e] - first * GROUP;
            m = m < GROUP ? m : GROUP;
            for (int64_t l = 0; l < m; l++) memcpy(xs + l * hidden, x + (p[l] / topk) * hidden, sizeof(float) * hidden);
            mat_pairs(w13 + e * 2 * inter * hidden, xs, hs, m, 2 * inter, hidden);
            for (int64_t l = 0; l < m; l++) {  /* swiglu_oai, the gate half first, clamped as in model.md §2 */
                float *gate = hs + l * 2 * inter, *up = gate + inter, *act = hs + l * inter;
                for (int64_t i = 0; i < inter; i++) {  /* (in place: act row l lies over rows < l, done, or row 0's gates already read) */
                    float g = gate[i] < limit ? gate[i] : limit, u = up[i] < -limit ? -limit : (up[i] > limit ? limit : up[i]);
                    act[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
                }
            }
            mat_pairs(w2 + e * hidden * inter, hs, ys, m, hidden, inter);
            for (int64_t l = 0; l < m; l++) {
                float *row = pairs + p[l] * hidden, wt = weights[p[l]];
                for (int64_t h = 0; h < hidden; h++) row[h] = ys[l * hidden + h] * wt;
            }
        }
        free(xs);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            float *o = out + t * hidden;
            memcpy(o, pairs + t * topk * hidden, sizeof(float) * hidden);
            for (int64_t s = 1; s < topk; s++)
                for (int64_t h = 0; h < hidden; h++) o[h] += pairs[(t * topk + s) * hidden + h];
        }
    }
    free(order);
}
