/* Decode attention over the paged, head-major KV cache, for CPUs (float32 or bfloat16).
 *
 * Built and loaded by tessera/decoder/kernels/native.py (the C compiler at decoder start, OpenMP
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
 *
 * bfloat16 (query, caches and output in bf16): scores, softmax and the V sums are float32, as the
 * torch backend computes half precision (bf16.h widens exactly); the output is rounded to bf16
 * once. With AVX512-BF16 the scores are (q . k) * scale, q . k in VDPBF16PS; otherwise
 * (scale * q) . k with q widened first, as in float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* glibc's vector expf (libmvec) for the softmax loop; math.h declares it only under -ffast-math */
#pragma omp declare simd notinbranch
extern float expf(float);

const char *tessera_kernels_variant(void) { return TESSERA_VARIANT; }

/* scores[r * max_context + t] for positions [0, len) of one item; q is the float32 scaled query
   (unused on the VDPBF16PS path, which reads q_raw) */
static inline __attribute__((always_inline)) void item_scores(
    const float *q, const void *q_raw, const void *k_plane, const int32_t *table, int64_t len, int64_t rep,
    int64_t head_dim, int64_t block_size, int64_t max_context, float scale, float *scores, const int bf16)
{
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t first = (int64_t)table[start / block_size] * block_size * head_dim;
        for (int64_t t = 0; t < count; t++) {
            for (int64_t r = 0; r < rep; r++) {
                float dot = 0.f;
                if (bf16 && TESSERA_DPBF16) {
                    dot = dot_bf16((const bf16_t *)q_raw + r * head_dim,
                                   (const bf16_t *)k_plane + first + t * head_dim, head_dim) * scale;
                } else if (bf16) {
                    const float *qr = q + r * head_dim;
                    const bf16_t *k = (const bf16_t *)k_plane + first + t * head_dim;
                    #pragma omp simd reduction(+:dot)
                    for (int64_t d = 0; d < head_dim; d++)
                        dot += qr[d] * bf16_to_f32(k[d]);
                } else {
                    const float *qr = q + r * head_dim;
                    const float *k = (const float *)k_plane + first + t * head_dim;
                    #pragma omp simd reduction(+:dot)
                    for (int64_t d = 0; d < head_dim; d++)
                        dot += qr[d] * k[d];
                }
                scores[r * max_context + start + t] = dot;
            }
        }
    }
}

/* scores rows -> softmax weights in place */
static inline void item_softmax(float *scores, int64_t len, int64_t rep, int64_t max_context)
{
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
    }
}

/* acc[r] = sum_t weights[r][t] * v[t], float32 accumulators [rep, head_dim] */
static inline __attribute__((always_inline)) void item_values(
    const float *scores, const void *v_plane, const int32_t *table, int64_t len, int64_t rep, int64_t head_dim,
    int64_t block_size, int64_t max_context, float *acc, const int bf16)
{
    for (int64_t x = 0; x < rep * head_dim; x++)
        acc[x] = 0.f;
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t first = (int64_t)table[start / block_size] * block_size * head_dim;
        for (int64_t t = 0; t < count; t++) {
            for (int64_t r = 0; r < rep; r++) {
                const float p = scores[r * max_context + start + t];
                float *a = acc + r * head_dim;
                if (bf16) {
                    const bf16_t *v = (const bf16_t *)v_plane + first + t * head_dim;
                    #pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++)
                        a[d] += p * bf16_to_f32(v[d]);
                } else {
                    const float *v = (const float *)v_plane + first + t * head_dim;
                    #pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++)
                        a[d] += p * v[d];
                }
            }
        }
    }
}

/* the kernel, for float32 (bf16 = 0) or bfloat16 (bf16 = 1) tensors; see the exported functions */
static inline __attribute__((always_inline)) int paged_decode_attention(
    const void *query, const void *k_cache, const void *v_cache, const int64_t *rows, const int32_t *block_tables,
    int64_t table_width, const int32_t *context_lens, void *out, int64_t num_rows, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t block_size, int64_t max_context,
    float scale, int num_threads, const int bf16)
{
    const int64_t rep = num_heads / num_kv_heads;
    const size_t element = bf16 ? sizeof(bf16_t) : sizeof(float);
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
            const int64_t q_first = (rows[i] * num_heads + h * rep) * head_dim;
            const char *q_raw = (const char *)query + q_first * element;
            for (int64_t x = 0; x < rep * head_dim; x++)  /* scaled first, as the torch path: (q * scale) . k */
                q[x] = (bf16 ? bf16_to_f32(((const bf16_t *)q_raw)[x]) : ((const float *)q_raw)[x]) * scale;
            const char *k_plane = (const char *)k_cache + (size_t)(h * num_slots * head_dim) * element;
            const char *v_plane = (const char *)v_cache + (size_t)(h * num_slots * head_dim) * element;
            item_scores(q, q_raw, k_plane, table, len, rep, head_dim, block_size, max_context, scale, scores, bf16);
            item_softmax(scores, len, rep, max_context);
            item_values(scores, v_plane, table, len, rep, head_dim, block_size, max_context, acc, bf16);
            if (bf16) {
                bf16_t *o = (bf16_t *)out + q_first;
                for (int64_t x = 0; x < rep * head_dim; x++)
                    o[x] = f32_to_bf16(acc[x]);
            } else {
                float *o = (float *)out + q_first;
                for (int64_t x = 0; x < rep * head_dim; x++)
                    o[x] = acc[x];
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* query/out [num_tokens, num_heads, head_dim] (only `rows` of out are written); caches
   [num_kv_heads, num_slots, head_dim]; rows [num_rows]; block_tables [num_rows, table_width];
   context_lens [num_rows], each in [1, min(max_context, table_width * block_size)].
   Returns 0, or -1 when a thread could not allocate its score buffer. */
int tessera_paged_decode_attention_f32(
    const float *query, const float *k_cache, const float *v_cache, const int64_t *rows,
    const int32_t *block_tables, int64_t table_width, const int32_t *context_lens, float *out, int64_t num_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t block_size,
    int64_t max_context, float scale, int num_threads)
{
    return paged_decode_attention(query, k_cache, v_cache, rows, block_tables, table_width, context_lens, out,
                                  num_rows, num_heads, num_kv_heads, head_dim, num_slots, block_size, max_context,
                                  scale, num_threads, 0);
}

/* the same over bfloat16 query, caches and output (raw bits, uint16) */
int tessera_paged_decode_attention_bf16(
    const bf16_t *query, const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *rows,
    const int32_t *block_tables, int64_t table_width, const int32_t *context_lens, bf16_t *out, int64_t num_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t block_size,
    int64_t max_context, float scale, int num_threads)
{
    return paged_decode_attention(query, k_cache, v_cache, rows, block_tables, table_width, context_lens, out,
                                  num_rows, num_heads, num_kv_heads, head_dim, num_slots, block_size, max_context,
                                  scale, num_threads, 1);
}
