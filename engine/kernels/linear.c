/* out = x @ w.T for a few rows x [m, k] and a weight w [n, k] (float32, CPU); see linear.py. Each thread takes
 * an equal run of LANES-row blocks of w and multiplies it by every row of x (`mat_rows`, mat_rows.h): each weight
 * is read once, by one thread, and the few rows of x stay in cache. n and k are multiples of LANES (checked by
 * linear.py). */
#include <omp.h>
#include <stdint.h>

#include "mat_rows.h"

void linear(const float *x, const float *w, float *out, int64_t m, int64_t n, int64_t k) {
#pragma omp parallel
    {
        const int64_t blocks = n / LANES, t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t first = blocks * t / nt, last = blocks * (t + 1) / nt;
        mat_rows(w, x, out, m, k, n, first * LANES, last * LANES);
    }
}
