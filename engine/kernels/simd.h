/* The vector type both kernels compute in: one register, 16 floats with AVX-512, else 8 (AVX2). NOTE: a 16-float
 * vector on AVX2 is lowered through the stack: on an AVX2 machine an MoE layer at 32 tokens took 3.99 ms against
 * 0.44 ms with 8 floats (2 threads), and attention at 32 rows x 2 KV heads x 192 keys 2.44 ms against 0.37 ms (1
 * thread). build.py hashes this header with each kernel's source. */
#ifndef MINIMAX_SIMD_H
#define MINIMAX_SIMD_H
#include <string.h>

#ifndef LANES /* (a test builds the other width too) */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
#endif
