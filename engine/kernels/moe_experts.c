/* The routed experts of an MoE layer (float32, CPU); see moe_experts.py.
 *
 * out[t] = sum_s w[t, s] * Expert_{ids[t, s]}(x[t]), Expert_e(v) = W2_e swiglu_oai(W13_e v), each expert's
 * weights read for its own tokens only. The (token, choice) pairs are grouped by expert (a counting sort);
 * a work item is one expert and up to GROUP of its pairs, multiplied by the expert's weights with `mat_rows`
 * (mat_rows.h: the weights LANES rows at a time, which stay in L1 while every pair of the item reads them). Each item writes
 * its pairs' weighted outputs to their own rows of `pairs` [T * k, H]; a last pass sums a token's k rows. Nothing is
 * shared between items, so no atomics. The hidden and intermediate sizes are multiples of 16 (moe_experts.py
 * checks). Returns 0, or 1 (an expert id outside [0, experts), nothing computed), or 2 (out of memory).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mat_rows.h"

#define GROUP 16 /* pairs per work item */

int64_t moe_experts(const float *x, const int64_t *ids, const float *weights, const float *w13, const float *w2,
                    float *pairs, float *out, int64_t tokens, int64_t topk, int64_t experts, int64_t hidden,
                    int64_t inter, float alpha, float limit) {
    const int64_t n = tokens * topk;
    int64_t *order = malloc(sizeof(int64_t) * (n + 2 * experts + 1)), *start = order + n, *fill = start + experts + 1;
    int64_t status = 0;
    if (!order) return 2;
    memset(start, 0, sizeof(int64_t) * (experts + 1));
    for (int64_t p = 0; p < n; p++) {
        if ((uint64_t)ids[p] >= (uint64_t)experts) {
            free(order);
            return 1;
        }
        start[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < experts; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int64_t) * experts);
    for (int64_t p = 0; p < n; p++) order[fill[ids[p]]++] = p;  /* pairs grouped by expert, in token order */
    int64_t items = 0;
    for (int64_t e = 0; e < experts; e++) items += (start[e + 1] - start[e] + GROUP - 1) / GROUP;

#pragma omp parallel
    {
        float *xs = malloc(sizeof(float) * GROUP * (2 * hidden + 2 * inter)), *hs = xs + GROUP * hidden,
              *ys = hs + GROUP * 2 * inter;
        if (!xs) {  /* NOTE: critical, not atomic: a 1-token call 27 vs 31.5 us (likely code layout, 1 thread) */
#pragma omp critical
            status = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!xs) continue;  /* (this thread's items are lost: the call fails) */
            int64_t e = 0, first = item;  /* the item-th (expert, group of GROUP pairs) */
            for (int64_t g; first >= (g = (start[e + 1] - start[e] + GROUP - 1) / GROUP); e++) first -= g;
            const int64_t *p = order + start[e] + first * GROUP;
            int64_t m = start[e + 1] - start[e] - first * GROUP;
            m = m < GROUP ? m : GROUP;
            for (int64_t l = 0; l < m; l++) memcpy(xs + l * hidden, x + (p[l] / topk) * hidden, sizeof(float) * hidden);
            mat_rows(w13 + e * 2 * inter * hidden, xs, hs, m, hidden, 2 * inter, 0, 2 * inter);
            for (int64_t l = 0; l < m; l++) {  /* swiglu_oai, the gate half first, clamped as in model.md §2 */
                float *gate = hs + l * 2 * inter, *up = gate + inter, *act = hs + l * inter;
                for (int64_t i = 0; i < inter; i++) {  /* (in place: act row l lies over rows < l, done, or row 0's gates already read) */
                    float g = gate[i] < limit ? gate[i] : limit, u = up[i] < -limit ? -limit : (up[i] > limit ? limit : up[i]);
                    act[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
                }
            }
            mat_rows(w2 + e * hidden * inter, hs, ys, m, inter, hidden, 0, hidden);
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
    return status;
}
