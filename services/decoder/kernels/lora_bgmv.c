/* BGMV for CPUs: the LoRA corrections of decode rows, grouped by adapter slot (float32).
 *
 * Built and loaded with paged_attention.c by services/decoder/kernels/native.py; called by the
 * "cpu" LoRA backend (kernels/backend.py) for decode rows, one call per projection.
 *
 * Rows rows[group_starts[g]:group_starts[g + 1]] use slot group_slots[g]. Each slot's factors are
 * read once per call, whatever its number of rows:
 *
 *     shrink   s[i][k] = x[row_i] . a[slot][k]                     k < rank      (a: [rank, in])
 *     expand   y[row_i][o] += sum_k s[i][k] * bt[slot][k][o]                     (bt: [rank, out], B^T)
 *
 * The expand sums its rank terms in a zeroed accumulator and adds it to y once, as the torch
 * backend adds its delta. Work is split over (group, rank) for the shrink and over (group, 64
 * outputs) for the expand; each item is computed by one thread, so results do not depend on the
 * thread count.
 */
#include <stdint.h>

#define EXPAND_TILE 64

void tessera_lora_bgmv_f32(
    const float *x, int64_t x_stride,      /* [num_tokens, in], row stride in elements */
    float *y, int64_t y_stride,            /* [num_tokens, out] */
    const float *a,                        /* [num_slots, rank, in] contiguous */
    const float *bt,                       /* [num_slots, rank, out] contiguous */
    const int64_t *rows,                   /* [num_rows] grouped by slot */
    const int64_t *group_starts,           /* [num_groups + 1] */
    const int64_t *group_slots,            /* [num_groups] */
    int64_t num_groups, int64_t in_features, int64_t out_features, int64_t rank,
    float *shrunk,                         /* [num_rows, rank] scratch */
    int num_threads)
{
    const int64_t tiles = (out_features + EXPAND_TILE - 1) / EXPAND_TILE;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_groups * rank; item++) {
            const int64_t g = item / rank, k = item % rank;
            const float *ak = a + (group_slots[g] * rank + k) * in_features;
            for (int64_t i = group_starts[g]; i < group_starts[g + 1]; i++) {
                const float *xi = x + rows[i] * x_stride;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < in_features; d++)
                    dot += xi[d] * ak[d];
                shrunk[i * rank + k] = dot;
            }
        }
        /* implicit barrier: every shrunk row is complete */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_groups * tiles; item++) {
            const int64_t g = item / tiles, start = (item % tiles) * EXPAND_TILE;
            const int64_t width = out_features - start < EXPAND_TILE ? out_features - start : EXPAND_TILE;
            const float *b_slot = bt + group_slots[g] * rank * out_features + start;
            for (int64_t i = group_starts[g]; i < group_starts[g + 1]; i++) {
                float acc[EXPAND_TILE] = {0};
                const float *si = shrunk + i * rank;
                for (int64_t k = 0; k < rank; k++) {
                    const float s = si[k];
                    const float *bk = b_slot + k * out_features;
                    #pragma omp simd
                    for (int64_t o = 0; o < width; o++)
                        acc[o] += s * bk[o];
                }
                float *yi = y + rows[i] * y_stride + start;
                #pragma omp simd
                for (int64_t o = 0; o < width; o++)
                    yi[o] += acc[o];
            }
        }
    }
}
