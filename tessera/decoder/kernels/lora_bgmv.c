/* BGMV for CPUs: the LoRA corrections of decode rows, grouped by adapter slot (float32).
 *
 * Built and loaded with paged_attention.c by tessera/decoder/kernels/native.py; called by the
 * "cpu" LoRA backend (tessera/decoder/lora/cpu_backend.py) for decode rows, one call per projection.
 *
 * Rows rows[group_starts[g]:group_starts[g + 1]] use slot group_slots[g]. Each slot's factors are
 * read once per call, whatever its number of rows:
 *
 *     shrink   s[i][k] = x[row_i] . a[slot][k]                     k < rank      (a: [rank, in])
 *     expand   y[row_i][o] += sum_k s[i][k] * bt[slot][k][o]                     (bt: [rank, out], B^T)
 *
 * The expand sums its rank terms in a zeroed accumulator and adds it to y once, as the torch
 * backend adds its delta. Work is split over groups for the shrink and over (group, 1024 outputs)
 * for the expand, so factors are read in long contiguous runs (the kernel is bound by reading
 * them); each item is computed by one thread, so results do not depend on the thread count.
 */
#include <stdint.h>

#define ROWS 4    /* rows of one slot computed together: each factor value loaded once feeds 4 FMAs */
#define CHUNK 64  /* expand outputs held in registers per row (4 AVX-512 vectors) */

/* s[r][k] = x[rows[r]] . a_slot[k] for r < nr <= ROWS */
static void shrink_rows(const float *x, int64_t x_stride, const int64_t *rows, int64_t nr, const float *a_slot,
                        int64_t in_features, int64_t rank, float *s)
{
    const float *x0 = x + rows[0] * x_stride;
    const float *x1 = x + rows[nr > 1 ? 1 : 0] * x_stride;  /* missing rows repeat row 0, unused */
    const float *x2 = x + rows[nr > 2 ? 2 : 0] * x_stride;
    const float *x3 = x + rows[nr > 3 ? 3 : 0] * x_stride;
    for (int64_t k = 0; k < rank; k++) {
        const float *ak = a_slot + k * in_features;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        #pragma omp simd reduction(+:s0, s1, s2, s3)
        for (int64_t d = 0; d < in_features; d++) {
            s0 += x0[d] * ak[d];
            s1 += x1[d] * ak[d];
            s2 += x2[d] * ak[d];
            s3 += x3[d] * ak[d];
        }
        s[0 * rank + k] = s0;
        s[1 * rank + k] = s1;
        s[2 * rank + k] = s2;
        s[3 * rank + k] = s3;
    }
}

/* y[rows[r]][o0:o0+width] += sum_k s[r][k] * b_slot[k][o0:o0+width], r < ROWS (s rows past nr are 0) */
static void expand_rows(float *y, int64_t y_stride, const int64_t *rows, int64_t nr, const float *s,
                        const float *b_slot, int64_t out_features, int64_t rank, int64_t o0, int64_t width)
{
    float acc[ROWS][CHUNK] = {{0}};
    if (width == CHUNK) {  /* constant bounds: the accumulators stay in registers */
        for (int64_t k = 0; k < rank; k++) {
            const float *bk = b_slot + k * out_features + o0;
            const float c0 = s[0 * rank + k], c1 = s[1 * rank + k], c2 = s[2 * rank + k], c3 = s[3 * rank + k];
            #pragma omp simd
            for (int64_t o = 0; o < CHUNK; o++) {
                acc[0][o] += c0 * bk[o];
                acc[1][o] += c1 * bk[o];
                acc[2][o] += c2 * bk[o];
                acc[3][o] += c3 * bk[o];
            }
        }
    } else {
        for (int64_t k = 0; k < rank; k++) {
            const float *bk = b_slot + k * out_features + o0;
            for (int64_t r = 0; r < ROWS; r++) {
                const float c = s[r * rank + k];
                #pragma omp simd
                for (int64_t o = 0; o < width; o++)
                    acc[r][o] += c * bk[o];
            }
        }
    }
    for (int64_t r = 0; r < nr; r++) {
        float *yr = y + rows[r] * y_stride + o0;
        #pragma omp simd
        for (int64_t o = 0; o < width; o++)
            yr[o] += acc[r][o];
    }
}

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
    /* the expand splits out_features in two when one group would leave a thread idle */
    const int64_t halves = num_groups < num_threads && out_features >= 2 * CHUNK ? 2 : 1;
    const int64_t span = (out_features / CHUNK + halves - 1) / halves * CHUNK;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < num_groups; g++) {
            const float *a_slot = a + group_slots[g] * rank * in_features;
            for (int64_t i = group_starts[g]; i < group_starts[g + 1]; i += ROWS) {
                const int64_t nr = group_starts[g + 1] - i < ROWS ? group_starts[g + 1] - i : ROWS;
                float local[ROWS * rank];  /* all ROWS rows are computed; only nr are this group's */
                shrink_rows(x, x_stride, rows + i, nr, a_slot, in_features, rank, local);
                for (int64_t v = 0; v < nr * rank; v++)
                    shrunk[i * rank + v] = local[v];
            }
        }
        /* implicit barrier: every shrunk row is complete */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_groups * halves; item++) {
            const int64_t g = item / halves;
            const int64_t first = (item % halves) * span;
            const int64_t last = item % halves == halves - 1 ? out_features : first + span;
            const float *b_slot = bt + group_slots[g] * rank * out_features;
            for (int64_t i = group_starts[g]; i < group_starts[g + 1]; i += ROWS) {
                const int64_t nr = group_starts[g + 1] - i < ROWS ? group_starts[g + 1] - i : ROWS;
                float s[ROWS * rank];
                for (int64_t r = 0; r < ROWS; r++)
                    for (int64_t k = 0; k < rank; k++)
                        s[r * rank + k] = r < nr ? shrunk[(i + r) * rank + k] : 0.f;
                for (int64_t o0 = first; o0 < last; o0 += CHUNK)
                    expand_rows(y, y_stride, rows + i, nr, s, b_slot, out_features, rank, o0,
                                last - o0 < CHUNK ? last - o0 : CHUNK);
            }
        }
    }
}
