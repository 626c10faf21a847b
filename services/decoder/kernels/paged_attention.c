/* Decode attention over the paged, head-major KV cache, for CPUs (float32 or bfloat16).
 *
 * Built and loaded by services/decoder/kernels/native.py (the C compiler at decoder start, OpenMP
 * from the libgomp torch already loaded, so torch's ops and this kernel share one thread team).
 *
 * One work item per (decode row, kv head): its `rep` = heads / kv_heads query heads share the kv
 * head (grouped-query attention, transformers' `repeat_kv`), so each K and V row is read from the
 * cache once, straight from its block; nothing is gathered or padded.
 *
 *     position p of row i  ->  cache row  h * num_slots + block_tables[i][p / block_size] * block_size
 *                                          + p % block_size          (the slot, in kv head h's plane)
 *     scores[r][p] = (scale * q[r]) . k[p]      lo <= p < context_lens[i], never outside
 *     out[r]       = sum_p softmax(scores[r])[p] * v[p]
 *
 * lo = max(0, context_len - window) with a sliding window (transformers' kv > q - window for the
 * query at position context_len - 1), else 0: positions before it are never read, so their blocks
 * may be freed. With a soft cap C the scores become C * tanh(scores / C) before the softmax (Gemma
 * 2's eager attention); tanh is increasing, so the row max is capped the same way.
 *
 * The softmax subtracts the row max (kept while the scores are computed), exponentiates, sums,
 * and the V pass weighs each position by its exponential times 1 / sum: torch.softmax's weights,
 * the scaling done as they are read rather than in a pass of its own (an exponent below -87 is
 * taken as -87, see item_softmax). Each item is computed by one thread from start to end, so a row's
 * result does not depend on the thread count or on which other rows share the step.
 *
 * bfloat16 (query, caches and output in bf16): scores, softmax and the V sums are float32, as the
 * torch backend computes half precision (bf16.h widens exactly); the output is rounded to bf16
 * once. With AVX512-BF16 the scores are (q . k) * scale, q . k in VDPBF16PS; otherwise (scale * q) . k
 * with q widened first, as in float32. A float32 query over bfloat16 caches (--kv-cache-dtype
 * bfloat16 on a float32 model) runs the float32 loops on the cache rows widened exactly and writes
 * a float32 output: only the cache's rounding differs from float32.
 *
 * With AVX2 + FMA (and head_dim a multiple of 8) the loops are written out in intrinsics: scores
 * for 8 positions at a time in 8 independent accumulators and one transpose-sum (a single dot
 * product per position is a chain of dependent FMAs and a horizontal sum: latency, not bandwidth,
 * set the pace), V sums with the accumulators held in registers across a block, a bf16 block
 * widened once into a float32 buffer for all `rep` query heads, and blocks prefetched into L2
 * ahead of each pass (blocks are scattered, so the hardware prefetchers restart at each one): K two
 * blocks ahead in the scores pass, a part per 8 positions, V one block ahead in the values pass, a
 * part per query head (asked for whole, 64 lines at once, it ran slower, likely the misses queued
 * past what the core tracks: A/B, each run on an untouched cache, 3.1-3.5 -> 2.9-3.2 ms float32,
 * 2.2-2.4 -> 2.0 ms bfloat16; the engine's P1 decode-attention calls replayed with both builds
 * alternately 11.2 -> 9.6 s float32, 10.0 -> 9.7 s bfloat16 on a busy machine). 32 rows x 150-700
 * positions, one SmolLM2-135M layer, caches not in cache, this 2-core VM (A/B, medians): 3.5-3.8
 * -> 2.2-2.8 ms float32, 2.8-3.2 -> 1.6-1.8 ms bfloat16 for the loops with one block of K and V
 * prefetched into L1 during the scores pass (measured with each build reading the cache the previous
 * one had just read, which favours the later ones); then, each run on a cache no run before it
 * touched and the order alternated, 3.4-3.6 -> 3.2-3.5 ms float32 and 2.2-2.6 -> 2.1-2.5 ms bfloat16
 * for this prefetch, and the engine's P1 decode-attention calls replayed with both builds
 * alternately 8.5 -> 8.0 s float32, 5.1 -> 5.0 s bfloat16. Only the order of the
 * float32 additions differs from the scalar loops. Finding the max while scoring and scaling while
 * summing V took two passes over the scores out of the softmax: every decode-attention call of the
 * P1 workload in the engine, run by the old and new builds alternately, 7.1 -> 6.5 s float32,
 * 4.6 -> 3.7 s bfloat16, the outputs identical.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "reduce16.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define ATTENTION_AVX2 1
#else
#define ATTENTION_AVX2 0
#endif

/* glibc's vector expf (libmvec) for the softmax loop; math.h declares it only under -ffast-math */
#pragma omp declare simd notinbranch
extern float expf(float);

const char *tessera_kernels_variant(void) { return TESSERA_VARIANT; }

/* scores[r * max_context + t] for positions [lo, len) of one item; q is the float32 scaled query
   (unused on the VDPBF16PS path, which reads q_raw) */
static inline __attribute__((always_inline)) void item_scores(
    const float *q, const void *q_raw, const void *k_plane, const int32_t *table, int64_t lo, int64_t len,
    int64_t rep, int64_t head_dim, int64_t block_size, int64_t max_context, float scale, float *scores,
    float *maxes, const int bf16, const int dp)
{
    for (int64_t r = 0; r < rep; r++)
        maxes[r] = -INFINITY;
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t first = (int64_t)table[start / block_size] * block_size * head_dim;
        for (int64_t t = start < lo ? lo - start : 0; t < count; t++) {
            for (int64_t r = 0; r < rep; r++) {
                float dot = 0.f;
                if (dp) {
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
                maxes[r] = dot > maxes[r] ? dot : maxes[r];
            }
        }
    }
}

/* scores rows -> exponentials in place, given each row's max (capped first with soft_cap > 0);
   inv[r] = 1 / their sum. The V passes
   weigh position t by s[t] * inv[r]: torch.softmax's division by the sum, applied as the weights are
   read. An exponent below -87 is taken as -87: exp's result is then at or near its subnormal range
   (below -87.34), or zero below -103.9, and such a weight is under 2^-125 of the largest (which is
   1); glibc's vector expf leaves its fast path for any lane that underflows, which real attention
   rows (a sink token far above the rest) do often */
static inline void item_softmax(float *scores, int64_t len, int64_t rep, int64_t max_context, const float *maxes,
                                float *inv, float soft_cap)
{
    for (int64_t r = 0; r < rep; r++) {
        float *s = scores + r * max_context;
        float max = maxes[r];
        if (soft_cap > 0.f) {  /* scalar tanhf: libmvec's vector tanhf is not in every glibc */
            for (int64_t t = 0; t < len; t++)
                s[t] = soft_cap * tanhf(s[t] / soft_cap);
            max = soft_cap * tanhf(max / soft_cap);
        }
        float sum = 0.f;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; t++) {
            const float x = s[t] - max;
            s[t] = expf(x < -87.f ? -87.f : x);  /* NaN stays NaN (a NaN or inf score poisons the row, as in torch) */
            sum += s[t];
        }
        inv[r] = 1.f / sum;
    }
}

/* acc[r] = sum_t (scores[r][t] * inv[r]) * v[t] over positions [lo, len), float32 accumulators [rep, head_dim] */
static inline __attribute__((always_inline)) void item_values(
    const float *scores, const float *inv, const void *v_plane, const int32_t *table, int64_t lo, int64_t len,
    int64_t rep, int64_t head_dim, int64_t block_size, int64_t max_context, float *acc, const int bf16)
{
    for (int64_t x = 0; x < rep * head_dim; x++)
        acc[x] = 0.f;
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t first = (int64_t)table[start / block_size] * block_size * head_dim;
        for (int64_t t = start < lo ? lo - start : 0; t < count; t++) {
            for (int64_t r = 0; r < rep; r++) {
                const float p = scores[r * max_context + start + t] * inv[r];
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

#if ATTENTION_AVX2
/* AVX2 + FMA, for head_dim a multiple of 8. A bf16 block is first widened (exactly) into the
   thread's float32 buffer `wide` [block_size, head_dim], so both dtypes run the float32 loops. */

/* a block's rows as float32: the cache rows themselves, or `wide` holding them widened */
static inline __attribute__((always_inline)) const float *block_rows(
    const void *plane, int64_t first, int64_t count, int64_t head_dim, float *wide, const int bf16)
{
    if (!bf16)
        return (const float *)plane + first;
    const bf16_t *src = (const bf16_t *)plane + first;
    for (int64_t x = 0; x < count * head_dim; x += 8) {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + x)));
        _mm256_storeu_ps(wide + x, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
    return wide;
}

/* ask for part `part` of `parts` of block `b`'s rows of an item (positions [b * block_size, len) cut
   at the block's end; its cache lines split evenly) into L2, ahead of their use: blocks are
   scattered, and the hardware prefetchers start over at each one. A block past the item's end is
   not asked for. A block is asked for a part at a time, between the loops that compute: a whole
   block at once (64 lines of float32) was slower, likely queueing more misses than the core
   tracks (the A/B in the header). */
static inline __attribute__((always_inline)) void prefetch_block(
    const void *plane, const int32_t *table, int64_t b, int64_t len, int64_t head_dim, int64_t block_size,
    int64_t part, int64_t parts, const int bf16)
{
    const int64_t start = b * block_size;
    if (start >= len)
        return;
    const int64_t count = len - start < block_size ? len - start : block_size;
    const size_t element = bf16 ? sizeof(bf16_t) : sizeof(float);
    const char *p = (const char *)plane + (size_t)table[b] * block_size * head_dim * element;
    const int64_t lines = (count * head_dim * (int64_t)element + 63) / 64;
    for (int64_t at = lines * part / parts; at < lines * (part + 1) / parts; at++)
        _mm_prefetch(p + at * 64, _MM_HINT_T1);
}

/* lane j = sum of the 8 lanes of a[j] */
static inline __m256 sum_lanes8(const __m256 a[8])
{
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* item_scores for 8 positions at a time: eight independent accumulators (one per position) and
   one transpose-sum, instead of one dependent chain and a horizontal sum per dot product */
static inline __attribute__((always_inline)) void item_scores_avx2(
    const float *q, const void *k_plane, const int32_t *table, int64_t lo, int64_t len, int64_t rep,
    int64_t head_dim, int64_t block_size, int64_t max_context, float *scores, float *wide, float *lane_max,
    float *maxes, const int bf16)
{
    for (int64_t r = 0; r < rep; r++)
        _mm256_storeu_ps(lane_max + 8 * r, _mm256_set1_ps(-INFINITY));
    const int64_t lo_block = lo - lo % block_size;
    for (int64_t start = lo_block; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t begin = start < lo ? lo - start : 0;  /* the window's first position in this block */
        /* K two blocks ahead, a part per 8 positions (and the second block with the first) */
        if (start == lo_block)
            prefetch_block(k_plane, table, start / block_size + 1, len, head_dim, block_size, 0, 1, bf16);
        const int64_t groups = (count - begin + 7) / 8;
        const float *k = block_rows(k_plane, (int64_t)table[start / block_size] * block_size * head_dim, count,
                                    head_dim, wide, bf16);
        for (int64_t t0 = begin; t0 < count; t0 += 8) {
            const int64_t n = count - t0 < 8 ? count - t0 : 8;
            const float *rows[8];
            for (int j = 0; j < 8; j++)  /* lanes past the block repeat its first row; never stored */
                rows[j] = k + (t0 + (j < n ? j : 0)) * head_dim;
            prefetch_block(k_plane, table, start / block_size + 2, len, head_dim, block_size, (t0 - begin) / 8, groups,
                           bf16);
            for (int64_t r = 0; r < rep; r++) {
                const float *qr = q + r * head_dim;
                __m256 acc[8];
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qr + d);
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[j] + d), acc[j]);
                }
                float *s = scores + r * max_context + start + t0;
                const __m256 dots = sum_lanes8(acc);  /* lanes past n: position t0's score again */
                /* max_ps returns its second operand when either is NaN: a NaN score is passed over
                   for the max, as the scalar compare passes it over */
                _mm256_storeu_ps(lane_max + 8 * r, _mm256_max_ps(dots, _mm256_loadu_ps(lane_max + 8 * r)));
                if (n == 8) {
                    _mm256_storeu_ps(s, dots);
                } else {
                    float sums[8];
                    _mm256_storeu_ps(sums, dots);
                    for (int64_t j = 0; j < n; j++)
                        s[j] = sums[j];
                }
            }
        }
    }
    for (int64_t r = 0; r < rep; r++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_loadu_ps(lane_max + 8 * r));
        maxes[r] = lanes[0];
        for (int j = 1; j < 8; j++)
            maxes[r] = lanes[j] > maxes[r] ? lanes[j] : maxes[r];
    }
}

/* item_values with the accumulators in registers across a block's positions: 32 (then 8) columns
   of one query head at a time, four (one) independent fused multiply-add chains */
static inline __attribute__((always_inline)) void item_values_avx2(
    const float *scores, const float *inv, const void *v_plane, const int32_t *table, int64_t lo, int64_t len,
    int64_t rep, int64_t head_dim, int64_t block_size, int64_t max_context, float *acc, float *wide, const int bf16)
{
    for (int64_t x = 0; x < rep * head_dim; x++)
        acc[x] = 0.f;
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t begin = start < lo ? lo - start : 0;
        const float *v = block_rows(v_plane, (int64_t)table[start / block_size] * block_size * head_dim, count,
                                    head_dim, wide, bf16);
        for (int64_t r = 0; r < rep; r++) {
            /* V one block ahead, a part per query head */
            prefetch_block(v_plane, table, start / block_size + 1, len, head_dim, block_size, r, rep, bf16);
            const float *p = scores + r * max_context + start, ir = inv[r];
            float *a = acc + r * head_dim;
            int64_t d = 0;
            for (; d + 32 <= head_dim; d += 32) {
                __m256 a0 = _mm256_loadu_ps(a + d), a1 = _mm256_loadu_ps(a + d + 8);
                __m256 a2 = _mm256_loadu_ps(a + d + 16), a3 = _mm256_loadu_ps(a + d + 24);
                for (int64_t t = begin; t < count; t++) {
                    const __m256 w = _mm256_set1_ps(p[t] * ir);
                    const float *vt = v + t * head_dim + d;
                    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt), a0);
                    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8), a1);
                    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 16), a2);
                    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 24), a3);
                }
                _mm256_storeu_ps(a + d, a0), _mm256_storeu_ps(a + d + 8, a1);
                _mm256_storeu_ps(a + d + 16, a2), _mm256_storeu_ps(a + d + 24, a3);
            }
            for (; d < head_dim; d += 8) {
                __m256 a0 = _mm256_loadu_ps(a + d);
                for (int64_t t = begin; t < count; t++)
                    a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t] * ir), _mm256_loadu_ps(v + t * head_dim + d), a0);
                _mm256_storeu_ps(a + d, a0);
            }
        }
    }
}
#endif

#if TESSERA_DPBF16 && ATTENTION_AVX2
/* item_scores on the VDPBF16PS path for 16 positions at a time: sixteen independent accumulators (one
   per position) and one transposed reduction (reduce16, _mm512_reduce_add_ps's tree), where a dot
   product at a time was a chain of dependent VDPBF16PS and a horizontal sum per position: each score
   has the bits of dot_bf16(q, k) * scale. Lanes past the block repeat its first position (computed,
   never stored); K is prefetched two blocks ahead as in item_scores_avx2. With item_values_dp, one
   SmolLM2-135M layer at one decode row (9 heads, 3 kv heads, head_dim 64, 2 threads, 2-core AMD EPYC
   Zen 5 VM), microseconds a call from Python, caches hot: 64 positions 5.6 -> 4.3, 192 10.3 -> 6.7,
   512 21.7 -> 12.2; in the engine's fused step (cycles counted around the call, 30 layers, caches
   cold): 0.42 -> 0.33 ms a token at 128-256 positions, 2.3 -> 1.3 ms at 1536-1664. Outputs identical
   to the dot-at-a-time loops (300 random shapes, windows and caps). */
static inline __attribute__((always_inline)) void item_scores_dp(
    const bf16_t *q, const bf16_t *k_plane, const int32_t *table, int64_t lo, int64_t len, int64_t rep,
    int64_t head_dim, int64_t block_size, int64_t max_context, float scale, float *scores, float *maxes)
{
    for (int64_t r = 0; r < rep; r++)
        maxes[r] = -INFINITY;
    const __m512 scale_v = _mm512_set1_ps(scale);
    const int64_t lo_block = lo - lo % block_size;
    for (int64_t start = lo_block; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t begin = start < lo ? lo - start : 0, groups = (count - begin + 15) / 16;
        const bf16_t *k = k_plane + (int64_t)table[start / block_size] * block_size * head_dim;
        /* K two blocks ahead, a part per 16 positions (and the second block with the first), as item_scores_avx2 */
        if (start == lo_block)
            prefetch_block(k_plane, table, start / block_size + 1, len, head_dim, block_size, 0, 1, 1);
        for (int64_t t0 = begin; t0 < count; t0 += 16) {
            const int64_t n = count - t0 < 16 ? count - t0 : 16;
            prefetch_block(k_plane, table, start / block_size + 2, len, head_dim, block_size, (t0 - begin) / 16, groups,
                           1);
            const bf16_t *rows[16];  /* position j's K row in accumulator 4 (j % 4) + j / 4: reduce16's lane j */
            for (int j = 0; j < 16; j++)
                rows[4 * (j % 4) + j / 4] = k + (t0 + (j < n ? j : 0)) * head_dim;
            for (int64_t r = 0; r < rep; r++) {
                const bf16_t *qr = q + r * head_dim;
                __m512 acc[16];
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_setzero_ps();
                int64_t d = 0;
                for (; d + 32 <= head_dim; d += 32) {
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr + d);
                    for (int j = 0; j < 16; j++)
                        acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(rows[j] + d));
                }
                if (d < head_dim) {  /* masked-off lanes load zeros and add nothing */
                    const __mmask32 mask = (__mmask32)((1u << (head_dim - d)) - 1u);
                    const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(mask, qr + d);
                    for (int j = 0; j < 16; j++)
                        acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[j] + d));
                }
                float *s = scores + r * max_context + start + t0;
                _mm512_mask_storeu_ps(s, (__mmask16)((1u << n) - 1u), _mm512_mul_ps(reduce16(acc), scale_v));
                for (int64_t j = 0; j < n; j++)  /* a NaN score is passed over for the max, as in item_scores */
                    maxes[r] = s[j] > maxes[r] ? s[j] : maxes[r];
            }
        }
    }
}

/* item_values for bf16 V blocks and head_dim a multiple of 16, in AVX-512: 64 (then 16) columns of
   one query head at a time held in registers across a block's positions, each V row widened in
   registers (no `wide` copy). Each accumulator lane is the same chain of fused multiply-adds, in the
   same order, as item_values_avx2's: the same bits. */
static inline __attribute__((always_inline)) void item_values_dp(
    const float *scores, const float *inv, const bf16_t *v_plane, const int32_t *table, int64_t lo, int64_t len,
    int64_t rep, int64_t head_dim, int64_t block_size, int64_t max_context, float *acc)
{
    for (int64_t x = 0; x < rep * head_dim; x++)
        acc[x] = 0.f;
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t begin = start < lo ? lo - start : 0;
        const bf16_t *v = v_plane + (int64_t)table[start / block_size] * block_size * head_dim;
        for (int64_t r = 0; r < rep; r++) {
            /* V one block ahead, a part per query head */
            prefetch_block(v_plane, table, start / block_size + 1, len, head_dim, block_size, r, rep, 1);
            const float *p = scores + r * max_context + start, ir = inv[r];
            float *a = acc + r * head_dim;
#define WIDEN16(at) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(at))), 16))
            int64_t d = 0;
            for (; d + 64 <= head_dim; d += 64) {
                __m512 a0 = _mm512_loadu_ps(a + d), a1 = _mm512_loadu_ps(a + d + 16);
                __m512 a2 = _mm512_loadu_ps(a + d + 32), a3 = _mm512_loadu_ps(a + d + 48);
                for (int64_t t = begin; t < count; t++) {
                    const __m512 w = _mm512_set1_ps(p[t] * ir);
                    const bf16_t *vt = v + t * head_dim + d;
                    a0 = _mm512_fmadd_ps(w, WIDEN16(vt), a0);
                    a1 = _mm512_fmadd_ps(w, WIDEN16(vt + 16), a1);
                    a2 = _mm512_fmadd_ps(w, WIDEN16(vt + 32), a2);
                    a3 = _mm512_fmadd_ps(w, WIDEN16(vt + 48), a3);
                }
                _mm512_storeu_ps(a + d, a0), _mm512_storeu_ps(a + d + 16, a1);
                _mm512_storeu_ps(a + d + 32, a2), _mm512_storeu_ps(a + d + 48, a3);
            }
            for (; d < head_dim; d += 16) {
                __m512 a0 = _mm512_loadu_ps(a + d);
                for (int64_t t = begin; t < count; t++)
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t] * ir), WIDEN16(v + t * head_dim + d), a0);
                _mm512_storeu_ps(a + d, a0);
            }
#undef WIDEN16
        }
    }
}
#endif

/* the kernel, for a float32 (q_bf16 = 0) or bfloat16 (q_bf16 = 1) query and output over a float32 (kv_bf16 = 0)
   or bfloat16 (kv_bf16 = 1) cache; see the exported functions */
static inline __attribute__((always_inline)) int paged_decode_attention(
    const void *query, const void *k_cache, const void *v_cache, const int64_t *rows, const int32_t *block_tables,
    int64_t table_width, const int32_t *context_lens, void *out, int64_t num_rows, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t block_size, int64_t max_context,
    float scale, int64_t window, float soft_cap, int num_threads, const int q_bf16, const int kv_bf16)
{
    const int64_t rep = num_heads / num_kv_heads;
    const size_t element = q_bf16 ? sizeof(bf16_t) : sizeof(float), kv_element = kv_bf16 ? sizeof(bf16_t) : sizeof(float);
    const int dp = q_bf16 && kv_bf16 && TESSERA_DPBF16;  /* bf16 x bf16 dot products in VDPBF16PS */
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        /* this thread's scores [rep, max_context], output accumulators [rep, head_dim], scaled
           queries [rep, head_dim] and a widened bf16 block [block_size, head_dim] */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(rep * (max_context + 2 * head_dim + 10)
                                                                 + block_size * head_dim));
        if (scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        float *acc = scores == NULL ? NULL : scores + rep * max_context;
        float *q = scores == NULL ? NULL : acc + rep * head_dim;
        float *wide = scores == NULL ? NULL : q + rep * head_dim;
        float *lane_max = scores == NULL ? NULL : wide + block_size * head_dim;
        float *maxes = scores == NULL ? NULL : lane_max + 8 * rep, *inv = scores == NULL ? NULL : maxes + rep;
        (void)wide, (void)lane_max;  /* the AVX2 loops' only */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * num_kv_heads; item++) {
            if (scores == NULL)
                continue;
            const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
            const int64_t len = context_lens[i];
            const int64_t lo = window > 0 && len > window ? len - window : 0;
            const int32_t *table = block_tables + i * table_width;
            const int64_t q_first = (rows[i] * num_heads + h * rep) * head_dim;
            const char *q_raw = (const char *)query + q_first * element;
            for (int64_t x = 0; x < rep * head_dim && !dp; x++)  /* scaled first, as the torch path: (q * scale) . k */
                q[x] = (q_bf16 ? bf16_to_f32(((const bf16_t *)q_raw)[x]) : ((const float *)q_raw)[x]) * scale;
            const char *k_plane = (const char *)k_cache + (size_t)(h * num_slots * head_dim) * kv_element;
            const char *v_plane = (const char *)v_cache + (size_t)(h * num_slots * head_dim) * kv_element;
#if TESSERA_DPBF16 && ATTENTION_AVX2
            if (dp) {
                item_scores_dp(q_raw, k_plane, table, lo, len, rep, head_dim, block_size, max_context, scale,
                               scores, maxes);
                item_softmax(scores + lo, len - lo, rep, max_context, maxes, inv, soft_cap);
                if (head_dim % 16 == 0)
                    item_values_dp(scores, inv, (const bf16_t *)v_plane, table, lo, len, rep, head_dim, block_size,
                                   max_context, acc);
                else if (head_dim % 8 == 0)
                    item_values_avx2(scores, inv, v_plane, table, lo, len, rep, head_dim, block_size, max_context,
                                     acc, wide, 1);
                else
                    item_values(scores, inv, v_plane, table, lo, len, rep, head_dim, block_size, max_context, acc, 1);
            } else
#endif
#if ATTENTION_AVX2
            if (head_dim % 8 == 0 && !dp) {
                item_scores_avx2(q, k_plane, table, lo, len, rep, head_dim, block_size, max_context, scores, wide,
                                 lane_max, maxes, kv_bf16);
                item_softmax(scores + lo, len - lo, rep, max_context, maxes, inv, soft_cap);
                item_values_avx2(scores, inv, v_plane, table, lo, len, rep, head_dim, block_size, max_context, acc,
                                 wide, kv_bf16);
            } else
#endif
            {
                item_scores(q, q_raw, k_plane, table, lo, len, rep, head_dim, block_size, max_context, scale, scores,
                            maxes, kv_bf16, dp);
                item_softmax(scores + lo, len - lo, rep, max_context, maxes, inv, soft_cap);
                item_values(scores, inv, v_plane, table, lo, len, rep, head_dim, block_size, max_context, acc, kv_bf16);
            }
            if (q_bf16) {
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
   context_lens [num_rows], each in [1, min(max_context, table_width * block_size)]; window: the
   sliding window (0: none), soft_cap: the logit soft cap (0: none).
   Returns 0, or -1 when a thread could not allocate its score buffer. */
int tessera_paged_decode_attention_f32(
    const float *query, const float *k_cache, const float *v_cache, const int64_t *rows,
    const int32_t *block_tables, int64_t table_width, const int32_t *context_lens, float *out, int64_t num_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t block_size,
    int64_t max_context, float scale, int64_t window, float soft_cap, int num_threads)
{
    return paged_decode_attention(query, k_cache, v_cache, rows, block_tables, table_width, context_lens, out,
                                  num_rows, num_heads, num_kv_heads, head_dim, num_slots, block_size, max_context,
                                  scale, window, soft_cap, num_threads, 0, 0);
}

/* the same over bfloat16 query, caches and output (raw bits, uint16) */
int tessera_paged_decode_attention_bf16(
    const bf16_t *query, const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *rows,
    const int32_t *block_tables, int64_t table_width, const int32_t *context_lens, bf16_t *out, int64_t num_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t block_size,
    int64_t max_context, float scale, int64_t window, float soft_cap, int num_threads)
{
    return paged_decode_attention(query, k_cache, v_cache, rows, block_tables, table_width, context_lens, out,
                                  num_rows, num_heads, num_kv_heads, head_dim, num_slots, block_size, max_context,
                                  scale, window, soft_cap, num_threads, 1, 1);
}

/* float32 query and output over bfloat16 caches (--kv-cache-dtype bfloat16 on a float32 model): each
   cache row widened exactly, then the float32 loops; only the cache's rounding differs from float32 */
int tessera_paged_decode_attention_f32_bf16kv(
    const float *query, const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *rows,
    const int32_t *block_tables, int64_t table_width, const int32_t *context_lens, float *out, int64_t num_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t block_size,
    int64_t max_context, float scale, int64_t window, float soft_cap, int num_threads)
{
    return paged_decode_attention(query, k_cache, v_cache, rows, block_tables, table_width, context_lens, out,
                                  num_rows, num_heads, num_kv_heads, head_dim, num_slots, block_size, max_context,
                                  scale, window, soft_cap, num_threads, 0, 1);
}

/* This step's K/V rows into the caches (vLLM's reshape_and_cache for this layout): token t, kv head h
   -> cache row h * num_slots + slots[t]. key/value rows at key + t * key_stride + h * head_dim (column
   views of the fused q/k/v projection allowed). A float32 row written into a bfloat16 cache
   (--kv-cache-dtype bfloat16) is rounded to nearest even, as torch's `.to(torch.bfloat16)`. V values
   not finite as stored (a float32 value past bf16's range rounds to inf) are stored as 0, as
   KVCache.write stores them (a stale NaN or inf in a reused block would turn probability 0 into NaN
   for another request); K is stored as it is (masked positions are never read). slots[t] in
   [0, num_slots). */
static inline __attribute__((always_inline)) void write_kv_row(
    const void *key, int64_t key_stride, const void *value, int64_t value_stride, const int64_t *slots, int64_t t,
    int64_t kv_heads, int64_t head_dim, int64_t num_slots, void *k_cache, void *v_cache, const int src_bf16,
    const int kv_bf16)
{
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t row = (h * num_slots + slots[t]) * head_dim;
        const int64_t k_at = t * key_stride + h * head_dim, v_at = t * value_stride + h * head_dim;
        if (src_bf16) {
            const bf16_t *k = (const bf16_t *)key + k_at, *v = (const bf16_t *)value + v_at;
            bf16_t *kc = (bf16_t *)k_cache + row, *vc = (bf16_t *)v_cache + row;
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                kc[d] = k[d];
                vc[d] = (v[d] & 0x7f80u) == 0x7f80u ? 0 : v[d];  /* exponent all ones: inf or NaN */
            }
        } else if (kv_bf16) {
            const float *k = (const float *)key + k_at, *v = (const float *)value + v_at;
            bf16_t *kc = (bf16_t *)k_cache + row, *vc = (bf16_t *)v_cache + row;
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                const bf16_t vb = f32_to_bf16(v[d]);
                kc[d] = f32_to_bf16(k[d]);
                vc[d] = (vb & 0x7f80u) == 0x7f80u ? 0 : vb;
            }
        } else {
            const float *k = (const float *)key + k_at, *v = (const float *)value + v_at;
            float *kc = (float *)k_cache + row, *vc = (float *)v_cache + row;
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                kc[d] = k[d];
                vc[d] = isfinite(v[d]) ? v[d] : 0.f;
            }
        }
    }
}

/* key, value: [tokens, kv_heads, head_dim] rows (strides in elements); slots int64 [tokens]; caches
   [kv_heads, num_slots, head_dim] contiguous; all float32. One thread: a step writes a few KB to
   a few hundred KB. */
void tessera_write_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                          const int64_t *slots, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                          float *k_cache, float *v_cache)
{
    for (int64_t t = 0; t < tokens; t++)
        write_kv_row(key, key_stride, value, value_stride, slots, t, kv_heads, head_dim, num_slots, k_cache, v_cache,
                     0, 0);
}

/* the same over bfloat16 (raw bits, uint16) */
void tessera_write_kv_bf16(const bf16_t *key, int64_t key_stride, const bf16_t *value, int64_t value_stride,
                           const int64_t *slots, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                           bf16_t *k_cache, bf16_t *v_cache)
{
    for (int64_t t = 0; t < tokens; t++)
        write_kv_row(key, key_stride, value, value_stride, slots, t, kv_heads, head_dim, num_slots, k_cache, v_cache,
                     1, 1);
}

/* float32 key/value rounded into bfloat16 caches */
void tessera_write_kv_f32_bf16kv(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                                 const int64_t *slots, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                                 int64_t num_slots, bf16_t *k_cache, bf16_t *v_cache)
{
    for (int64_t t = 0; t < tokens; t++)
        write_kv_row(key, key_stride, value, value_stride, slots, t, kv_heads, head_dim, num_slots, k_cache, v_cache,
                     0, 1);
}
