/* The vector type both kernels compute in: one register, 16 floats with AVX-512, else 8 (AVX2). NOTE: a 16-float
 * vector on AVX2 is lowered through the stack: on an AVX2 machine an MoE layer at 32 tokens took 3.99 ms against
 * 0.44 ms with 8 floats (2 threads), and attention at 32 rows x 2 KV heads x 192 keys 2.44 ms against 0.37 ms (1
 * thread). build.py hashes this header with each kernel's source. */
#ifndef MINIMAX_SIMD_H
#define MINIMAX_SIMD_H
#include <stdint.h>
#include <string.h>

#ifndef LANES /* (a test builds the other width too) */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));

typedef int32_t ivec __attribute__((vector_size(4 * LANES)));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vec add_halves(vec a, vec b, ivec lo, ivec hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

/* Lane i of the result: the sum of the lanes of a[i], for LANES vectors a (a is overwritten): LANES dot products
 * finished at once. Each level halves the vectors and doubles how many of them a vector holds partial sums of
 * (with 16 lanes: 8 lanes each of 2, 4 of 4, 2 of 8, 1 of 16); level s pairs lane i with i + s of the same
 * partial sum. */
static inline vec lane_sums(vec *a) {
#if LANES == 16
    const ivec l8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const ivec l4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const ivec l2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const ivec l1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    for (int i = 0; i < 8; i++) a[i] = add_halves(a[2 * i], a[2 * i + 1], l8, l8 + 8);
#else
    const ivec l4 = {0, 1, 2, 3, 8, 9, 10, 11};
    const ivec l2 = {0, 1, 4, 5, 8, 9, 12, 13};
    const ivec l1 = {0, 2, 4, 6, 8, 10, 12, 14};
#endif
    for (int i = 0; i < 4; i++) a[i] = add_halves(a[2 * i], a[2 * i + 1], l4, l4 + 4);
    for (int i = 0; i < 2; i++) a[i] = add_halves(a[2 * i], a[2 * i + 1], l2, l2 + 2);
    return add_halves(a[0], a[1], l1, l1 + 1);
}
#endif
