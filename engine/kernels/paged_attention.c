/* Attention read in place from a paged KV pool (float32, CPU); see paged_attention.py.
 *
 * For every (row b, KV head h): the G query heads q[b, h] attend to its keys, each a row of the k and v
 * buffers (D floats): the rows listed in rows[b, h] whose keep flag is set (paged_decode_attention), or the
 * keys of the selected blocks up to the query's position (paged_block_attention). Keys are taken in tiles of
 * TILE: scores of the kept ones, then an online-softmax update (running max and sum per query head), so no
 * gathered copy of K or V is ever made and any key count fits. A query head with no kept key gets zeros.
 * Every index is checked before any key is read: a row listed or a slot read outside the buffers returns 1, a
 * query position outside its slots 2 (the Python wrappers raise), never a read out of bounds. Built with -ffast-math (vectorized exp): no infinity is used, masked keys are skipped instead.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define TILE 64
#define LOWEST (-3.0e38f)
/* One (row b, KV head h); 1 if a row listed or a slot read (blocks) is not below `limit`. `dim` is a constant
 * where the caller's switch inlines it: the dot products and the accumulations then unroll (measured: 1.2-1.6x
 * faster than a run-time loop bound at D = 32). */
static inline __attribute__((always_inline)) int64_t attend_one(
    const float *q, const float *k, const float *v, const int64_t *rows, const uint8_t *keep, const int64_t *blocks,
    const int64_t *slots, int64_t q_pos, int64_t block_size, float *out, int64_t b, int64_t h, int64_t heads,
    int64_t group, const int64_t dim, int64_t keys, int64_t keep_heads, float scale, uint64_t limit) {
    const int64_t *r = rows ? rows + (b * heads + h) * keys : 0;
    const uint8_t *m = keep ? keep + (b * keep_heads + (keep_heads == 1 ? 0 : h)) * keys : 0;
    const float *qh = q + (b * heads + h) * group * dim;
    float *o = out + (b * heads + h) * group * dim;
    float mx[group], sum[group], acc[group * dim], s[group * TILE];
    int64_t idx[TILE], sel = 0, off = 0, bad = 0, last_blk = q_pos / block_size;
    for (int64_t g = 0; g < group; g++) {
        mx[g] = LOWEST;
        sum[g] = 0.0f;
    }
    for (int64_t i = 0; i < group * dim; i++) acc[i] = 0.0f;
    for (int64_t n0 = 0; n0 < keys; n0 += TILE) {
        int64_t cnt = 0;
        if (blocks == 0) {
            for (int64_t n = n0; n < n0 + TILE && n < keys; n++) {
                bad |= (uint64_t)r[n] >= limit;  /* (every row listed, kept or not, as the gather checks them) */
                if (m[n]) idx[cnt++] = r[n];
            }
        } else {  /* key n: offset `off` of selected block `sel` (n = sel * B + off), a run of positions a block
                   * (NOTE: against a test per key, the kernel alone 1.3x at 64 rows x 192 keys, keys in cache) */
            for (int64_t n = n0, end = n0 + TILE < keys ? n0 + TILE : keys; n < end;) {
                int64_t run = block_size - off < end - n ? block_size - off : end - n, blk = blocks[sel];
                if (blk >= 0 && blk <= last_blk) {  /* (a later block holds no position up to q_pos) */
                    int64_t first = blk * block_size + off, last = first + run - 1 < q_pos ? first + run - 1 : q_pos;
                    for (int64_t pos = first; pos <= last; pos++)
                        bad |= (uint64_t)slots[pos] >= limit, idx[cnt++] = slots[pos] * heads + h;
                }
                n += run, off += run;
                if (off == block_size) off = 0, sel++;
            }
        }
        if (bad) return 1;
        if (cnt == 0) continue;
        /* NOTE: every line of the tile's keys and values asked for before its dot products (they are read
         * cold, from rows scattered over the pool), against each key's first line 4 keys ahead: a decode step
         * at 32 / 64 rows 1.09x / 1.13x captured, 1.06x eager (A/B in one engine, AVX-512); a 4k prefill and
         * 1-16 rows over 1-2k keys unchanged (0.99-1.02x). The next tile's lines asked for a tile ahead instead:
         * no faster with the keys cold (0.93-0.98x, the kernel alone, 64 rows x 256 keys, 8 layers cycled). */
        for (int64_t j = 0; j < cnt; j++)
            for (int64_t c = 0; c < dim; c += 16) {
                __builtin_prefetch(k + idx[j] * dim + c);
                __builtin_prefetch(v + idx[j] * dim + c);
            }
        /* LANES keys at a time: their dot products end in one vector (`lane_sums`, simd.h). NOTE: with the two
         * changes below (runs of positions, several accumulator sets), the kernel alone 1.3-1.5x faster than with a
         * dot product a key at 64 rows x 192 keys, 1.25-1.4x at 8-64 rows x 1,024 keys (AVX-512 AMD, 2 threads);
         * but with its keys cold (8 layers' pools cycled, each row's decode keys R slots apart, as in a batch) the
         * kernel is bound by memory (~10 GB/s of scattered 128-byte rows) and no faster: a whole step 1.02x at
         * 32 and 64 rows, captured. */
        if (dim % LANES == 0 && dim <= 8 * LANES) {
            for (int64_t j = cnt; j % LANES; j++) idx[j] = idx[0];  /* (a partial last group reads a kept key again) */
            for (int64_t g = 0; g < group; g++) {
                vec qv[8];
                for (int64_t d = 0; d < dim / LANES; d++) qv[d] = load(qh + g * dim + LANES * d) * scale;
                for (int64_t j0 = 0; j0 < cnt; j0 += LANES) {
                    vec part[LANES];
                    for (int j = 0; j < LANES; j++) {
                        const float *kr = k + idx[j0 + j] * dim;
                        part[j] = qv[0] * load(kr);
                        for (int64_t d = 1; d < dim / LANES; d++) part[j] += qv[d] * load(kr + LANES * d);
                    }
                    vec dots = lane_sums(part);
                    memcpy(s + g * TILE + j0, &dots, sizeof dots);
                }
            }
        } else {
            for (int64_t j = 0; j < cnt; j++) {
                const float *kr = k + idx[j] * dim;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * dim;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < dim; d++) dot += qg[d] * kr[d];
                    s[g * TILE + j] = dot * scale;
                }
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float top = LOWEST;
            for (int64_t j = 0; j < cnt; j++) top = s[g * TILE + j] > top ? s[g * TILE + j] : top;
            float new_max = top > mx[g] ? top : mx[g];
            float c = expf(mx[g] - new_max);  /* 0 on the first tile (LOWEST - max underflows) */
            sum[g] *= c;
            for (int64_t d = 0; d < dim; d++) acc[g * dim + d] *= c;
            mx[g] = new_max;
            for (int64_t j = 0; j < cnt; j++) {
                float p = expf(s[g * TILE + j] - new_max);
                s[g * TILE + j] = p;
                sum[g] += p;
            }
        }
        /* NOTE: query head outer, its accumulator in registers over the tile, against key outer (interleaved
         * A/B, 2 threads): listed keys 1.06-1.14x (8 and 64 rows x 2 KV heads x 150 keys); selected blocks
         * 1.29x (64 rows, 150 keys) and 1.50x (an extend chunk: 256 queries x 4 blocks of 64 keys) */
        if (dim % LANES == 0 && dim <= 8 * LANES) {  /* (at most 8 accumulators: they stay in registers) */
            /* u keys a pass into u accumulator sets, up to 8 vectors in all (with one set at D = 32 and 16 lanes,
             * two chains of dependent adds: their latency bound the loop, perf showed) */
            const int64_t nd = dim / LANES, u = nd <= 2 ? 4 : (nd <= 4 ? 2 : 1);
            for (int64_t g = 0; g < group; g++) {
                vec a[8] = {{0}};
                for (int64_t d = 0; d < nd; d++) a[d] = load(acc + g * dim + LANES * d);
                int64_t j = 0;
                for (; j + u <= cnt; j += u)
                    for (int64_t x = 0; x < u; x++) {
                        const float *vr = v + idx[j + x] * dim;
                        float p = s[g * TILE + j + x];
                        for (int64_t d = 0; d < nd; d++) a[x * nd + d] += p * load(vr + LANES * d);
                    }
                for (; j < cnt; j++) {
                    const float *vr = v + idx[j] * dim;
                    float p = s[g * TILE + j];
                    for (int64_t d = 0; d < nd; d++) a[d] += p * load(vr + LANES * d);
                }
                for (int64_t x = 1; x < u; x++)
                    for (int64_t d = 0; d < nd; d++) a[d] += a[x * nd + d];
                memcpy(acc + g * dim, a, sizeof(float) * dim);
            }
        } else {
            for (int64_t j = 0; j < cnt; j++) {
                const float *vr = v + idx[j] * dim;
                for (int64_t g = 0; g < group; g++) {
                    float p = s[g * TILE + j];
                    float *a = acc + g * dim;
                    for (int64_t d = 0; d < dim; d++) a[d] += p * vr[d];
                }
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
        for (int64_t d = 0; d < dim; d++) o[g * dim + d] = acc[g * dim + d] * inv;
    }
    return 0;
}

#define ATTEND(D) attend_one(q, k, v, rows, keep, blk, srow, qp, block_size, out, b, h, heads, group, D, keys, \
                            keep_heads, scale, limit)
/* `body` sets what a row reads, and st = 2 if its query position is out of range; the first nonzero status is
 * returned (the row and head it came from are left unwritten). */
#define FOR_EACH_ROW_AND_HEAD(body)                                                                           \
    int64_t status = 0;                                                                                       \
    _Pragma("omp parallel for collapse(2) schedule(static)")                                                  \
    for (int64_t b = 0; b < batch; b++) {                                                                     \
        for (int64_t h = 0; h < heads; h++) {                                                                 \
            int64_t st = 0;                                                                                   \
            body;                                                                                             \
            if (st == 0) switch (dim) {                                                                       \
            case 32: st = ATTEND(32); break;                                                                  \
            case 64: st = ATTEND(64); break;                                                                  \
            case 128: st = ATTEND(128); break;                                                                \
            default: st = ATTEND(dim);                                                                        \
            }                                                                                                 \
            if (st) {                                                                                         \
                _Pragma("omp atomic write")                                                                   \
                status = st;                                                                                  \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    return status;

/* Row b, KV head h: the kept keys n, rows[b, h, n] (keep[b, h or 0, n]); every row below `buf_rows`. */
int64_t paged_decode_attention(const float *q, const float *k, const float *v, const int64_t *rows,
                               const uint8_t *keep, float *out, int64_t batch, int64_t heads, int64_t group,
                               int64_t dim, int64_t keys, int64_t keep_heads, float scale, uint64_t buf_rows) {
    const int64_t block_size = 1, limit = buf_rows;
    FOR_EACH_ROW_AND_HEAD(const int64_t *blk = 0; const int64_t *srow = 0; int64_t qp = 0)
}

/* Row b, KV head h: the keys of the selected blocks blocks[b, h, :topk] (-1: unused) up to position
 * q_pos[b] < slot_len, key j being slot slots[b * slot_stride + j] < buf_slots (a stride of 0: every row reads
 * one sequence). */
int64_t paged_block_attention(const float *q, const float *k, const float *v, const int64_t *slots,
                              int64_t slot_stride, const int64_t *blocks, const int64_t *q_pos, float *out,
                              int64_t batch, int64_t heads, int64_t group, int64_t dim, int64_t topk,
                              int64_t block_size, float scale, uint64_t buf_slots, uint64_t slot_len) {
    const int64_t *rows = 0, keys = topk * block_size, keep_heads = 1, limit = buf_slots;
    const uint8_t *keep = 0;
    FOR_EACH_ROW_AND_HEAD(const int64_t *blk = blocks + (b * heads + h) * topk;
                          const int64_t *srow = slots + b * slot_stride; int64_t qp = q_pos[b];
                          st = (uint64_t)qp >= slot_len ? 2 : 0)
}
