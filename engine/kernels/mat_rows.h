/* `mat_rows`: rows of a weight matrix against a few input rows (out[p, j] = w[j, :] . x[p, :]), the matrix
 * product the MoE kernel multiplies by its experts' weights with (moe_experts.c). float32; the column count and
 * the rows taken are multiples of LANES (simd.h), which the callers check. */
#ifndef MINIMAX_MAT_ROWS_H
#define MINIMAX_MAT_ROWS_H
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* Columns a pass: LANES rows of KC floats are 16 KB with AVX-512 and stay in L1 while every input row reads them. */
#define KC 256

/* out[p * ldo + j] = w[j, :] . x[p, :] for p < m and rows j0 <= j < j1 of w [*, cols] (x [m, cols]).
 * LANES weight rows a pass, as many as a vector has lanes: LANES dot products in LANES vector accumulators
 * (they fill the register file without spilling), their lanes added at the end by `lane_sums`. */
static void mat_rows(const float *w, const float *x, float *out, int64_t m, int64_t cols, int64_t ldo, int64_t j0,
                     int64_t j1) {
    float tile[LANES * KC];
    for (int64_t j = j0; j < j1; j += LANES) {
        /* NOTE: the next LANES rows asked for (a cache line each 16 floats) while these are multiplied: 1.15-1.18x
         * at 32 and 64 tokens in the MoE kernel on an AVX2 machine, the weights of 6 layers cycled (out of cache), 2
         * threads; 2 or 4 blocks ahead no better. Into L2, not L1 (locality 2): the MoE kernel 1.10-1.15x at 8-64
         * tokens on an AVX-512 AMD, weights cycled, the same at 256 (likely: the block in use, the next one and the
         * inputs overflow its 32 KB L1). */
        if (j + LANES < j1)
            for (int64_t r = 0; r < LANES; r++)
                for (int64_t c = 0; c < cols; c += 16) __builtin_prefetch(w + (j + LANES + r) * cols + c, 0, 2);
        for (int64_t c0 = 0; c0 < cols; c0 += KC) {
            const int64_t width = cols - c0 < KC ? cols - c0 : KC;
            const float *wj = w + j * cols + c0;
            int64_t ld = cols;
            if (cols > KC) {  /* NOTE: rows a multiple of 4 KB apart share L1 sets: copied side by side first
                               * ([8, 1024] x [1024, 256]: 2.2x faster than read in place, AVX-512 AMD) */
                for (int64_t r = 0; r < LANES; r++) memcpy(tile + r * KC, wj + r * cols, sizeof(float) * width);
                wj = tile, ld = KC;
            }
            for (int64_t p = 0; p < m; p++) {
                const float *xp = x + p * cols + c0;
                vec acc[LANES] = {{0}};
                for (int64_t c = 0; c < width; c += LANES) {
                    vec xv = load(xp + c);
                    for (int r = 0; r < LANES; r++) acc[r] += load(wj + r * ld + c) * xv;
                }
                vec s = lane_sums(acc);
                if (c0) s += load(out + p * ldo + j);
                memcpy(out + p * ldo + j, &s, sizeof s);
            }
        }
    }
}
#endif
