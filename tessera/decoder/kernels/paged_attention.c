/* Decode attention over the paged, head-major KV cache, for CPUs (float32).
 *
 * Built and loaded by tessera/decoder/cpu_attention.py (the C compiler at decoder start, OpenMP
 * from the libgomp torch already loaded, so torch's ops and this kernel share one thread team).
 *
 * One work item per (decode row, kv head): its `rep` = heads / kv_heads query heads share the kv
 * head (grouped-query attention, transformers' `repeat_kv`), so each K and V row is read from the
 * cache once, straight from its block; nothing is gathered or padded.
 *
 *     position p of row i  ->  cache row  h * num_slots + block_tables[i][p / block_size] * block_size
 *                                          + p % block_size          (the slot, in kv head h's plane)
 *     scores[r][p] = (scale * q[r]) . k[p]      p < context_lens[i], never past it
 *     out[r]       = sum_p softmax(scores[r])[p] * v[p]
 *
 * The softmax subtracts the row max, exponentiates, sums, and scales by 1 / sum before the V
 * pass, as torch.softmax does. Each item is computed by one thread from start to end, so a row's
 * result does not depend on the thread count or on which other rows share the step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* glibc's vector expf (libmvec) for the softmax loop; math.h declares it only under -ffast-math */
#pragma omp declare simd notinbranch
extern float expf(float);

int tessera_paged_decode_attention_f32(
    const float *query,          /* [num_tokens, num_heads, head_dim] */
    const float *k_cache,        /* [num_kv_heads, num_slots, head_dim] */
    const float *v_cache,        /* [num_kv_heads, num_slots, head_dim] */
    const int64_t *rows,         /* [num_rows] flat-batch rows of the decode queries */
    const int32_t *block_tables, /* [num_rows, table_width] */
    int64_t table_width,
    const int32_t *context_lens, /* [num_rows], each in [1, table_width * block_size] */
    float *out,                  /* [num_tokens, num_heads, head_dim]; only `rows` are written */
    int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
    int64_t block_size, int64_t max_context, float scale, int num_threads)
{
    const int64_t rep = num_heads / num_kv_heads;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        /* this thread's scores [rep, max_context], output accumulators [rep, head_dim] and scaled
           queries [rep, head_dim] */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(rep * (max_context + 2 * head_dim)));
        if (scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        float *acc = scores == NULL ? NULL : scores + rep * max_context;
        float *q = scores == NULL ? NULL : acc + rep * head_dim;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * num_kv_heads; item++) {
            if (scores == NULL)
                continue;
            const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
            const int64_t len = context_lens[i];
            const int32_t *table = block_tables + i * table_width;
            const float *q_in = query + (rows[i] * num_heads + h * rep) * head_dim;
            for (int64_t x = 0; x < rep * head_dim; x++)  /* scaled first, as the torch path: (q * scale) . k */
                q[x] = q_in[x] * scale;
            const float *k_plane = k_cache + h * num_slots * head_dim;
            const float *v_plane = v_cache + h * num_slots * head_dim;

            for (int64_t start = 0; start < len; start += block_size) {
                const int64_t count = len - start < block_size ? len - start : block_size;
                const float *k_block = k_plane + (int64_t)table[start / block_size] * block_size * head_dim;
                for (int64_t t = 0; t < count; t++) {
                    const float *k = k_block + t * head_dim;
                    for (int64_t r = 0; r < rep; r++) {
                        const float *qr = q + r * head_dim;
                        float dot = 0.f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < head_dim; d++)
                            dot += qr[d] * k[d];
                        scores[r * max_context + start + t] = dot;
                    }
                }
            }
            for (int64_t r = 0; r < rep; r++) {
                float *s = scores + r * max_context;
                float max = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < len; t++)
                    max = s[t] > max ? s[t] : max;
                #pragma omp simd reduction(+:sum)
                for (int64_t t = 0; t < len; t++) {
                    s[t] = expf(s[t] - max);
                    sum += s[t];
                }
                const float inv = 1.f / sum;
                #pragma omp simd
                for (int64_t t = 0; t < len; t++)
                    s[t] *= inv;
                for (int64_t d = 0; d < head_dim; d++)
                    acc[r * head_dim + d] = 0.f;
            }
            for (int64_t start = 0; start < len; start += block_size) {
                const int64_t count = len - start < block_size ? len - start : block_size;
                const float *v_block = v_plane + (int64_t)table[start / block_size] * block_size * head_dim;
                for (int64_t t = 0; t < count; t++) {
                    const float *v = v_block + t * head_dim;
                    for (int64_t r = 0; r < rep; r++) {
                        const float p = scores[r * max_context + start + t];
                        float *a = acc + r * head_dim;
                        #pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++)
                            a[d] += p * v[d];
                    }
                }
            }
            float *o = out + (rows[i] * num_heads + h * rep) * head_dim;
            for (int64_t x = 0; x < rep * head_dim; x++)
                o[x] = acc[x];
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
