/* BGMV for CPUs: the LoRA corrections of decode rows, grouped by adapter slot (float32 or bfloat16).
 *
 * Built and loaded with paged_attention.c by services/decoder/kernels/native.py; called by the
 * "cpu" LoRA backend (services/decoder/lora/cpu_backend.py) for decode rows, one call per projection.
 *
 * Rows rows[group_starts[g]:group_starts[g + 1]] use slot group_slots[g]. Each slot's factors are
 * read once per call, whatever its number of rows:
 *
 *     shrink   s[i][k] = x[row_i] . a[slot][k]                     k < rank      (a: [rank, in])
 *     expand   y[row_i][o] += sum_k s[i][k] * bt[slot][k][o]                     (bt: [rank, out], B^T)
 *
 * bt is [rank, out] rows, or tiled (bgmv_part_t.tiled, AdapterSlots' layout for the cpu backend: see
 * bt_run), one part per projection of a `_parts` call.
 *
 * The expand sums its rank terms in a zeroed accumulator and adds it to y once, as the torch
 * backend adds its delta. Work is split over groups for the shrink and over groups for the expand
 * (with fewer groups than twice the threads, each group's rank rows of A and its outputs in pieces),
 * so factors are read in long contiguous runs (the kernel is bound by reading them); each shrunk value
 * and each output is computed by one thread, so results do not depend on the thread count. Each
 * slot's factors are a short stream that starts cold, so both loops prefetch ahead in software (the
 * shrink two rows of A, the expand the next chunk of every B^T row): SmolLM2's 210 projections at
 * 8 slots rank 16, 4 rows a slot, 156 MB of float32 factors, 8.4-10.2 -> 6.7-8.1 ms (0.7 -> 0.9 of
 * the read bandwidth).
 *
 * bfloat16 (x, y, a and bt in bf16): s and the expand accumulators are float32, as the torch
 * backend computes (bf16.h widens exactly); y[row][o] is widened, added to and rounded to bf16
 * once. With AVX512-BF16 the shrink's products run in VDPBF16PS.
 *
 * The fused decode step calls the `_parts` functions: q, k and v (and gate and up) read the same x,
 * so one call takes all of them, one parallel region and two barriers where a call per projection
 * took three each (SmolLM2's 30 layers at batch 1 make 120 calls a token instead of 210).
 *
 * A row computed alone (an adapter's one decode row at batch 1, or a group's fifth) skips the three
 * padding rows of the ROWS-wide loops: its shrink sums four A rows at a time (bf16: four VDPBF16PS
 * chains, each dot_bf16's operations), its expand holds 64 outputs in four AVX-512 registers across
 * the rank rows, the block two ahead asked for (expand_one_row; elsewhere sums in L1 over B^T's rows,
 * STREAM_OUTS outputs at a time). Each value comes from the same operations in the same order, so a
 * row gets the same bits alone or in a group (tests/decoder/test_lora_kernels.py). Both loops split
 * one adapter's items round-robin (schedule(static, 1)): the dynamic schedule's calls into libgomp
 * cost more than the imbalance they saved at these sizes. The fused decode step runs the `_parts_team` body in
 * the parallel region of the projection's own GEMV (decode_step.c), one region where there were two.
 * SmolLM2-135M bf16, one adapter row, rank 16, the 120 calls of a token on a 2-core AMD EPYC (Zen 5)
 * VM, five interleaved runs of 30 tokens, medians, factors cold (256 MB read before each token): 859
 * -> 584 us (dynamic schedule and the four-row loops -> the above); with the factors in L3, 510 -> 250
 * us. One thread for a one-row call (no fork, no barriers) ran 1.29x slower cold: one core reads the
 * factors at half the rate. Prefetching a call's factors at the start of its GEMV's region measured
 * 0.9% slower in the engine.
 *
 * A group's four rows (the 32-row steps of many adapters, and prefill) sum two A rows at a time against
 * the four x rows (eight VDPBF16PS chains, each dot_bf16's operations) and hold their 64 outputs' sums in
 * 16 AVX-512 registers across the rank rows, each chunk's B^T runs asked for two chunks ahead: 8 adapters'
 * 32-row step (SmolLM2's 120 calls, bf16, rank 16, 78 MB of factors from memory, five interleaved runs)
 * 4.4 -> 3.4 ms; in the engine the prompt's LoRA calls at 32 requests of 32 tokens 82 -> 51 ms. Asking
 * for a unit's B^T during its shrink (two streams in flight) measured 8% slower; so did asking for a
 * projection's factors during its GEMV's tiles at 32 rows (decode_step.c), 1.5-2.4%.
 *
 * Each exported function holds its own parallel region around the always-inlined team body, called
 * with a literal dtype: GCC outlines a parallel region before it inlines, so one region shared by
 * both dtypes read the dtype at run time inside every loop, and the loops ran 1.5-4.5x slower
 * (SmolLM2 projections, 19 decode rows in 4 adapter groups, rank 16, A/B medians: 1536 -> 576
 * 171-181 -> 46-51 us float32, 277-295 -> 61-65 us bfloat16; 576 -> 3072 137-149 -> 94-99 us
 * float32; the vectorized sums are also closer to float64: 2-4e-7 instead of 5-9e-7 relative).
 */
#include <stdint.h>

#include "bf16.h"

#define ROWS 4    /* rows of one slot computed together: each factor value loaded once feeds 4 FMAs */
#define CHUNK 64  /* expand outputs held in registers per row (4 AVX-512 vectors) */
#define SHRINK_AHEAD 4  /* A rows between the one a row group's shrink sums and the one it asks for */

/* element e of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as float32; WLOAD: of a factor
   (A or B^T), bfloat16 where wbf16 = 1 */
#define LOAD(p, e) (bf16 ? bf16_to_f32(((const bf16_t *)(p))[e]) : ((const float *)(p))[e])
#define WLOAD(p, e) (wbf16 ? bf16_to_f32(((const bf16_t *)(p))[e]) : ((const float *)(p))[e])

#if TESSERA_DPBF16
/* out[j] = dot_bf16(x, a + j * n, n) for j < 4, the four chains interleaved (one chain's VDPBF16PS
   latency, not the loads, set the pace of one row's shrink): the same operations per sum, the same bits */
static inline __attribute__((always_inline)) void dot4_bf16(const bf16_t *x, const bf16_t *a, int64_t n, float *out)
{
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t d = 0;
    for (; d + 32 <= n; d += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + d);
        for (int j = 0; j < 4; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(a + j * n + d));
    }
    if (d < n) {
        const __mmask32 mask = (__mmask32)((1u << (n - d)) - 1u);
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + d);
        for (int j = 0; j < 4; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, a + j * n + d));
    }
    for (int j = 0; j < 4; j++)
        out[j] = _mm512_reduce_add_ps(acc[j]);
}

/* out[2 r + j] = dot_bf16(x[r], a + j * n, n) for r < 4, j < 2: eight chains interleaved (four x rows
   against two A rows; a group's shrink waited on one chain per dot's VDPBF16PS latency), each the
   operations of dot_bf16 in its order: the same bits */
static inline __attribute__((always_inline)) void dot4x2_bf16(const bf16_t *const *x, const bf16_t *a, int64_t n,
                                                             float *out)
{
    __m512 acc[8];
    for (int i = 0; i < 8; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= n; d += 32) {
        const __m512bh a0 = (__m512bh)_mm512_loadu_si512(a + d), a1 = (__m512bh)_mm512_loadu_si512(a + n + d);
        for (int r = 0; r < 4; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[r] + d);
            acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], xv, a0);
            acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], xv, a1);
        }
    }
    if (d < n) {
        const __mmask32 mask = (__mmask32)((1u << (n - d)) - 1u);
        const __m512bh a0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + d),
                       a1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + n + d);
        for (int r = 0; r < 4; r++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[r] + d);
            acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], xv, a0);
            acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], xv, a1);
        }
    }
    for (int i = 0; i < 8; i++)
        out[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif

/* s[r][k] = x[rows[r]] . a_slot[k] for r < nr <= ROWS and k0 <= k < k1 (x: row stride x_stride elements);
   with nr = 1 on the VDPBF16PS path only s[0][k] is written (elsewhere every row, the missing ones row 0's) */
static inline __attribute__((always_inline)) void shrink_rows(
    const void *x, int64_t x_stride, const int64_t *rows, int64_t nr, const void *a_slot, int64_t in_features,
    int64_t rank, int64_t k0, int64_t k1, float *s, const int bf16, const int wbf16)
{
    const size_t element = bf16 ? sizeof(bf16_t) : sizeof(float), welement = wbf16 ? sizeof(bf16_t) : sizeof(float);
    const char *x0 = (const char *)x + (size_t)(rows[0] * x_stride) * element;
    const char *x1 = (const char *)x + (size_t)(rows[nr > 1 ? 1 : 0] * x_stride) * element;  /* missing rows */
    const char *x2 = (const char *)x + (size_t)(rows[nr > 2 ? 2 : 0] * x_stride) * element;  /* repeat row 0, */
    const char *x3 = (const char *)x + (size_t)(rows[nr > 3 ? 3 : 0] * x_stride) * element;  /* unused */
    const size_t row_bytes = (size_t)in_features * welement;
    const char *first = (const char *)a_slot + (size_t)k0 * row_bytes;
    for (size_t at = 0; at < SHRINK_AHEAD * row_bytes && at < (size_t)(k1 - k0) * row_bytes; at += 64)
        __builtin_prefetch(first + at, 0, 1);  /* the first SHRINK_AHEAD rows */
#if TESSERA_DPBF16
    if (bf16 && wbf16 && nr == 1) {  /* one row: four A rows at a time, each dot_bf16's own chain and sum */
        int64_t k = k0;
        for (; k + 4 <= k1; k += 4) {
            const char *ak = (const char *)a_slot + (size_t)(k * in_features) * welement;
            const size_t ahead = (size_t)(k1 - k - 4 < 4 ? k1 - k - 4 : 4) * row_bytes;  /* the next rows, */
            for (size_t at = 0; at < ahead; at += 64)                                    /* up to four */
                __builtin_prefetch(ak + 4 * row_bytes + at, 0, 1);
            dot4_bf16((const bf16_t *)x0, (const bf16_t *)ak, in_features, s + k);
        }
        for (; k < k1; k++)
            s[k] = dot_bf16((const bf16_t *)x0, (const bf16_t *)((const char *)a_slot + (size_t)(k * in_features) * welement),
                            in_features);
        return;
    }
    if (bf16 && wbf16) {  /* rows: two A rows at a time against the four x rows */
        const bf16_t *xs[4] = {(const bf16_t *)x0, (const bf16_t *)x1, (const bf16_t *)x2, (const bf16_t *)x3};
        for (; k0 + 2 <= k1; k0 += 2) {
            const char *ak = (const char *)a_slot + (size_t)(k0 * in_features) * welement;
            const int64_t next = k0 + SHRINK_AHEAD, count = k1 - next < 2 ? k1 - next : 2;
            for (size_t at = 0; count > 0 && at < (size_t)count * row_bytes; at += 64)  /* two rows, SHRINK_AHEAD on */
                __builtin_prefetch(ak + SHRINK_AHEAD * row_bytes + at, 0, 1);
            float out[8];
            dot4x2_bf16(xs, (const bf16_t *)ak, in_features, out);
            for (int r = 0; r < 4; r++)
                s[r * rank + k0] = out[2 * r], s[r * rank + k0 + 1] = out[2 * r + 1];
        }
    }
#endif
    for (int64_t k = k0; k < k1; k++) {
        const char *ak = (const char *)a_slot + (size_t)(k * in_features) * welement;
        /* the factor stream is short (one slot's rank rows) and each starts cold: row k + 2 is
           fetched while row k is summed (the hardware prefetcher alone left the loop waiting on it) */
        if (k + 2 < k1)
            for (size_t at = 0; at < row_bytes; at += 64)
                __builtin_prefetch(ak + 2 * row_bytes + at, 0, 1);
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        if (bf16 && wbf16 && TESSERA_DPBF16) {
            s0 = dot_bf16((const bf16_t *)x0, (const bf16_t *)ak, in_features);
            s1 = dot_bf16((const bf16_t *)x1, (const bf16_t *)ak, in_features);
            s2 = dot_bf16((const bf16_t *)x2, (const bf16_t *)ak, in_features);
            s3 = dot_bf16((const bf16_t *)x3, (const bf16_t *)ak, in_features);
        } else {
            #pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int64_t d = 0; d < in_features; d++) {
                const float av = WLOAD(ak, d);
                s0 += LOAD(x0, d) * av;
                s1 += LOAD(x1, d) * av;
                s2 += LOAD(x2, d) * av;
                s3 += LOAD(x3, d) * av;
            }
        }
        s[0 * rank + k] = s0;
        s[1 * rank + k] = s1;
        s[2 * rank + k] = s2;
        s[3 * rank + k] = s3;
    }
}

#if defined(__AVX512F__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define EXPAND_AVX512 1
#else
#define EXPAND_AVX512 0
#endif
#if EXPAND_AVX512
/* 16 factor values at p (bfloat16 where wbf16 = 1), widened exactly to float32 */
#define W16(p) (wbf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(                     \
                            _mm256_loadu_si256((const __m256i *)(p))), 16))                            \
                      : _mm512_loadu_ps((const float *)(p)))
#endif
#if EXPAND_AVX512 && TESSERA_DPBF16 && defined(__AVX512DQ__)
#define ADD_BF16_VECTOR 1
/* yr[0:16] = bf16(yr[0:16] + sum), each as f32_to_bf16 rounds (to nearest even, NaN kept quiet): one
   VCVTNEPS2BF16, which flushes denormal sums to zero where f32_to_bf16 rounds them, so a vector with a
   denormal takes the scalar rounding. The compiler's vectorized f32_to_bf16 took a dozen operations a
   vector: a quarter of the prompt step's expand (32 prompts of 32 tokens, 8 adapters). */
static inline __attribute__((always_inline)) void add_bf16_vector(bf16_t *yr, __m512 sum)
{
    sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(
                            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)yr)), 16)), sum);
    if (_mm512_fpclass_ps_mask(sum, 0x20) == 0) {  /* 0x20: denormal */
        _mm256_storeu_si256((__m256i *)yr, (__m256i)_mm512_cvtneps_pbh(sum));
        return;
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, sum);
    for (int o = 0; o < 16; o++)
        yr[o] = f32_to_bf16(lanes[o]);
}
#else
#define ADD_BF16_VECTOR 0
#endif

/* y[row][o0 + CHUNK: o0 + 2 CHUNK] asked for (for writing) while the chunk at o0 is summed: the rows of a
   group are far apart in y, and the write-back of a chunk waited on its lines (the prompt step's y is
   megabytes, out of L2); 32 prompts of 32 tokens, 8 adapters, 120 calls: 37.4 -> 35.0 ms */
static inline __attribute__((always_inline)) void ask_y(void *y, int64_t y_stride, const int64_t *rows, int64_t nr,
                                                       int64_t o0, int64_t width, int64_t out_features,
                                                       const int bf16)
{
    const size_t element = bf16 ? sizeof(bf16_t) : sizeof(float);
    if (o0 + width + width > out_features)
        return;
    for (int64_t r = 0; r < nr; r++) {
        const char *next = (const char *)y + (size_t)(rows[r] * y_stride + o0 + width) * element;
        for (size_t at = 0; at < (size_t)width * element; at += 64)
            __builtin_prefetch(next + at, 1, 3);
    }
}

/* Where the expand reads B^T's outputs o0, o0 + 1, ... of rank row k: at + k * k_stride bytes, and the
   same outputs one CHUNK on at + tile_stride. Two layouts of a slot's B^T (bgmv_part_t.tiled):
     0  [rank, out] rows (the torch backend's view of AdapterSlots' buffer);
     1  tiled: out's whole CHUNK-output tiles, each [rank, CHUNK], then the last out % CHUNK outputs as
        [rank, out % CHUNK] (AdapterSlots' buffer for the cpu backend), so a group's expand reads its
        factors front to back, one stream, where [rank, out] rows are rank streams of CHUNK outputs
        each; SmolLM2's 32-row step, 8 adapters, bf16: 34.75 -> 34.07 ms, the same bits.
   The run is within one tile (or the tail): o0 + width <= the tile's end. */
typedef struct {
    const char *at;
    size_t k_stride, tile_stride;
} bt_run_t;

static inline __attribute__((always_inline)) bt_run_t bt_run(const void *b_slot, int64_t rank, int64_t out_features,
                                                             int64_t o0, int tiled, size_t welement)
{
    const char *b = (const char *)b_slot;
    if (!tiled)
        return (bt_run_t){b + (size_t)o0 * welement, (size_t)out_features * welement, CHUNK * welement};
    const int64_t whole = out_features / CHUNK * CHUNK;
    if (o0 < whole)
        return (bt_run_t){b + (size_t)((o0 / CHUNK) * rank * CHUNK + o0 % CHUNK) * welement, CHUNK * welement,
                          (size_t)(rank * CHUNK) * welement};
    return (bt_run_t){b + (size_t)(whole * rank + o0 - whole) * welement, (size_t)(out_features - whole) * welement,
                      0};
}

/* chunks between the one a row group's expand sums and the one whose B^T rows it asks for: a chunk
   is rank short runs (128 or 256 bytes each), too short for the hardware prefetcher. SmolLM2's 120
   calls of a 32-row step in 8 groups of 4, bf16, rank 16 (78 MB of factors), 2-core AMD EPYC (Zen 5)
   VM, medians, ms, 1 / 2 / 3 / 4 ahead: 3.95 / 3.51 / 3.48 / 3.48 (built for AVX2: 5.9 / 5.3 / 5.4) */
#define EXPAND_AHEAD 2

/* B^T row k's part EXPAND_AHEAD chunks past the chunk at o0 (bk: row k at o0, tile_stride: bt_run's)
   asked for, where there is one */
static inline __attribute__((always_inline)) void ask_ahead(const char *bk, size_t tile_stride, int64_t o0,
                                                             int64_t out_features, size_t welement)
{
    if (o0 + (EXPAND_AHEAD + 1) * CHUNK <= out_features)
        for (size_t at = 0; at < CHUNK * welement; at += 64)
            __builtin_prefetch(bk + EXPAND_AHEAD * tile_stride + at, 0, 1);
}

/* y[rows[r]][o0:o0+width] += sum_k s[r][k] * b_slot[k][o0:o0+width], r < ROWS (s rows past nr are 0);
   b_slot in layout `tiled`, the outputs within one of its tiles or its tail (bt_run) */
static inline __attribute__((always_inline)) void expand_rows(
    void *y, int64_t y_stride, const int64_t *rows, int64_t nr, const float *s, const void *b_slot,
    int64_t out_features, int64_t rank, int tiled, int64_t o0, int64_t width, const int bf16, const int wbf16)
{
    const size_t welement = wbf16 ? sizeof(bf16_t) : sizeof(float);
    const bt_run_t run = bt_run(b_slot, rank, out_features, o0, tiled, welement);
    float acc[ROWS][CHUNK];
    ask_y(y, y_stride, rows, nr, o0, CHUNK, out_features, bf16);
    if (width == CHUNK) {  /* the four rows' 64 sums in registers across the rank rows */
#if EXPAND_AVX512
        __m512 a[ROWS][4];
        for (int r = 0; r < ROWS; r++)
            for (int v = 0; v < 4; v++)
                a[r][v] = _mm512_setzero_ps();
        for (int64_t k = 0; k < rank; k++) {
            const char *bk = run.at + k * run.k_stride;
            ask_ahead(bk, run.tile_stride, o0, out_features, welement);
            __m512 c[ROWS];
            for (int r = 0; r < ROWS; r++)
                c[r] = _mm512_set1_ps(s[r * rank + k]);
            for (int v = 0; v < 4; v++) {
                const __m512 bv = W16(bk + 16 * v * welement);
                for (int r = 0; r < ROWS; r++)
                    a[r][v] = _mm512_fmadd_ps(c[r], bv, a[r][v]);
            }
        }
#if ADD_BF16_VECTOR
        if (bf16) {
            for (int64_t r = 0; r < nr; r++)
                for (int v = 0; v < 4; v++)
                    add_bf16_vector((bf16_t *)y + rows[r] * y_stride + o0 + 16 * v, a[r][v]);
            return;
        }
#endif
        for (int r = 0; r < ROWS; r++)
            for (int v = 0; v < 4; v++)
                _mm512_storeu_ps(acc[r] + 16 * v, a[r][v]);
#else
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t o = 0; o < CHUNK; o++)
                acc[r][o] = 0.f;
        for (int64_t k = 0; k < rank; k++) {
            const char *bk = run.at + k * run.k_stride;
            const float c0 = s[0 * rank + k], c1 = s[1 * rank + k], c2 = s[2 * rank + k], c3 = s[3 * rank + k];
            ask_ahead(bk, run.tile_stride, o0, out_features, welement);
            #pragma omp simd
            for (int64_t o = 0; o < CHUNK; o++) {
                const float bv = WLOAD(bk, o);
                acc[0][o] += c0 * bv;
                acc[1][o] += c1 * bv;
                acc[2][o] += c2 * bv;
                acc[3][o] += c3 * bv;
            }
        }
#endif
    } else {
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t o = 0; o < width; o++)
                acc[r][o] = 0.f;
        for (int64_t k = 0; k < rank; k++) {
            const char *bk = run.at + k * run.k_stride;
            for (int64_t r = 0; r < ROWS; r++) {
                const float c = s[r * rank + k];
                #pragma omp simd
                for (int64_t o = 0; o < width; o++)
                    acc[r][o] += c * WLOAD(bk, o);
            }
        }
    }
    for (int64_t r = 0; r < nr; r++) {
        const size_t first = (size_t)(rows[r] * y_stride + o0);
        if (bf16) {
            bf16_t *yr = (bf16_t *)y + first;
            #pragma omp simd
            for (int64_t o = 0; o < width; o++)
                yr[o] = f32_to_bf16(bf16_to_f32(yr[o]) + acc[r][o]);
        } else {
            float *yr = (float *)y + first;
            #pragma omp simd
            for (int64_t o = 0; o < width; o++)
                yr[o] += acc[r][o];
        }
    }
}

#if EXPAND_AVX512
#define ROWS8 8      /* rows of one slot expanded together where a group has that many left (prompts) */
#define CHUNK8 32    /* their outputs held in registers: 8 rows x 2 AVX-512 vectors */
/* expand_rows for ROWS8 rows and the CHUNK8 outputs at o0 (o0 + CHUNK8 <= out_features): each factor
   vector loaded and widened once feeds eight FMAs where expand_rows' feeds four (the widening took
   as many vector operations as a third of the FMAs); each output's sum the same FMAs in the same
   order, so the bits of expand_rows. 32 prompts of 32 tokens, 8 adapters (groups of 128 rows), the
   120 calls: 32.0 -> 30.6 ms */
static inline __attribute__((always_inline)) void expand_rows8(
    void *y, int64_t y_stride, const int64_t *rows, const float *s, const void *b_slot, int64_t out_features,
    int64_t rank, int tiled, int64_t o0, const int bf16, const int wbf16)
{
    const size_t welement = wbf16 ? sizeof(bf16_t) : sizeof(float);
    const bt_run_t run = bt_run(b_slot, rank, out_features, o0, tiled, welement);
    ask_y(y, y_stride, rows, ROWS8, o0, CHUNK8, out_features, bf16);
    __m512 a[ROWS8][2];
    for (int r = 0; r < ROWS8; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < rank; k++) {
        const char *bk = run.at + k * run.k_stride;
        if (o0 % CHUNK == 0)
            ask_ahead(bk, run.tile_stride, o0, out_features, welement);
        const __m512 b0 = W16(bk), b1 = W16(bk + 16 * welement);
        for (int r = 0; r < ROWS8; r++) {
            const __m512 c = _mm512_set1_ps(s[r * rank + k]);
            a[r][0] = _mm512_fmadd_ps(c, b0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(c, b1, a[r][1]);
        }
    }
    for (int r = 0; r < ROWS8; r++) {
        const size_t first = (size_t)(rows[r] * y_stride + o0);
        if (bf16) {
            bf16_t *yr = (bf16_t *)y + first;
#if ADD_BF16_VECTOR
            add_bf16_vector(yr, a[r][0]), add_bf16_vector(yr + 16, a[r][1]);
#else
            float acc[CHUNK8];
            _mm512_storeu_ps(acc, a[r][0]), _mm512_storeu_ps(acc + 16, a[r][1]);
            for (int o = 0; o < CHUNK8; o++)
                yr[o] = f32_to_bf16(bf16_to_f32(yr[o]) + acc[o]);
#endif
        } else {
            float *yr = (float *)y + first;
            _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), a[r][0]));
            _mm512_storeu_ps(yr + 16, _mm512_add_ps(_mm512_loadu_ps(yr + 16), a[r][1]));
        }
    }
}
#endif

/* expand_rows for one row over outputs [first, last): with AVX-512, 64 outputs at a time held in
   registers; elsewhere (and past the last 64) sums in L1 over B^T's rows read STREAM_OUTS outputs at a
   time (long runs the hardware prefetcher follows); each output's sum the same FMAs in the same order
   (zero, then k = 0 .. rank - 1), so the bits of the padded 4-row loop */
#define STREAM_OUTS 2048
static inline __attribute__((always_inline)) void expand_one_row(
    void *y, int64_t y_stride, int64_t row, const float *s, const void *b_slot, int64_t out_features, int64_t rank,
    int tiled, int64_t first, int64_t last, const int bf16, const int wbf16)
{
    const size_t welement = wbf16 ? sizeof(bf16_t) : sizeof(float);
    float acc[STREAM_OUTS];
#if EXPAND_AVX512
    /* 64 outputs at a time in four registers across the rank rows (no sums through memory), the
       block two ahead asked for meanwhile; the last < 64 outputs by the loop below */
    for (; first + 64 <= last; first += 64) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        const bt_run_t run = bt_run(b_slot, rank, out_features, first, tiled, welement);
        for (int64_t k = 0; k < rank; k++) {
            const char *bk = run.at + k * run.k_stride;
            if (first + 192 <= last)
                for (size_t at = 0; at < 64 * welement; at += 64)
                    __builtin_prefetch(bk + 2 * run.tile_stride + at, 0, 1);
            const __m512 c = _mm512_set1_ps(s[k]);
            a0 = _mm512_fmadd_ps(c, W16(bk), a0);
            a1 = _mm512_fmadd_ps(c, W16(bk + 16 * welement), a1);
            a2 = _mm512_fmadd_ps(c, W16(bk + 32 * welement), a2);
            a3 = _mm512_fmadd_ps(c, W16(bk + 48 * welement), a3);
        }
        const size_t at = (size_t)(row * y_stride + first);
#if ADD_BF16_VECTOR
        if (bf16) {
            bf16_t *yr = (bf16_t *)y + at;
            add_bf16_vector(yr, a0), add_bf16_vector(yr + 16, a1);
            add_bf16_vector(yr + 32, a2), add_bf16_vector(yr + 48, a3);
            continue;
        }
#endif
        _mm512_storeu_ps(acc, a0), _mm512_storeu_ps(acc + 16, a1);
        _mm512_storeu_ps(acc + 32, a2), _mm512_storeu_ps(acc + 48, a3);
        if (bf16) {
            bf16_t *yr = (bf16_t *)y + at;
            #pragma omp simd
            for (int64_t o = 0; o < 64; o++)
                yr[o] = f32_to_bf16(bf16_to_f32(yr[o]) + acc[o]);
        } else {
            float *yr = (float *)y + at;
            #pragma omp simd
            for (int64_t o = 0; o < 64; o++)
                yr[o] += acc[o];
        }
    }
#endif
    const int64_t runs = tiled ? CHUNK : STREAM_OUTS;  /* tiled: a tile's rows at a time */
    for (int64_t o0 = first; o0 < last; o0 += runs) {
        const int64_t width = last - o0 < runs ? last - o0 : runs;
        const bt_run_t run = bt_run(b_slot, rank, out_features, o0, tiled, welement);
        for (int64_t o = 0; o < width; o++)
            acc[o] = 0.f;
        for (int64_t k = 0; k < rank; k++) {
            const char *bk = run.at + k * run.k_stride;
            const float c = s[k];
            #pragma omp simd
            for (int64_t o = 0; o < width; o++)
                acc[o] += c * WLOAD(bk, o);
        }
        const size_t at = (size_t)(row * y_stride + o0);
        if (bf16) {
            bf16_t *yr = (bf16_t *)y + at;
            #pragma omp simd
            for (int64_t o = 0; o < width; o++)
                yr[o] = f32_to_bf16(bf16_to_f32(yr[o]) + acc[o]);
        } else {
            float *yr = (float *)y + at;
            #pragma omp simd
            for (int64_t o = 0; o < width; o++)
                yr[o] += acc[o];
        }
    }
}

/* One projection of a call over the projections that read the same x (q, k and v; gate and up):
   a [num_slots, rank, in] and bt [num_slots, rank, out] (B^T) contiguous; y its first output column
   of a [num_tokens, y_stride] output. Mirrored by decode_step.c. */
typedef struct {
    const void *a, *bt;
    void *y;
    int64_t y_stride, out_features, rank, tiled;
} bgmv_part_t;

/* the shrink of work item `item` (one unit's piece of rank rows) of lora_bgmv_team */
static inline __attribute__((always_inline)) void shrink_item(
    int64_t item, int64_t pieces, const void *x, int64_t x_stride, const bgmv_part_t *parts, const int64_t *rows,
    const int64_t *group_starts, const int64_t *group_slots, int64_t num_groups, int64_t in_features,
    float *shrunk, int64_t max_rank, const int bf16, const int wbf16)
{
    const size_t welement = wbf16 ? sizeof(bf16_t) : sizeof(float);
    const int64_t unit = item / pieces, piece = item % pieces, g = unit % num_groups, num_rows = group_starts[num_groups];
    const bgmv_part_t *part = &parts[unit / num_groups];
    const int64_t rank = part->rank, k0 = rank * piece / pieces, k1 = rank * (piece + 1) / pieces;
    if (k0 == k1)
        return;
    float *out = shrunk + (size_t)((unit / num_groups) * num_rows * max_rank);
    const char *a_slot = (const char *)part->a + (size_t)(group_slots[g] * rank * in_features) * welement;
    for (int64_t i = group_starts[g]; i < group_starts[g + 1]; i += ROWS) {
        const int64_t nr = group_starts[g + 1] - i < ROWS ? group_starts[g + 1] - i : ROWS;
        float local[ROWS * rank];  /* all ROWS rows are computed; only nr are this group's */
        shrink_rows(x, x_stride, rows + i, nr, a_slot, in_features, rank, k0, k1, local, bf16, wbf16);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t k = k0; k < k1; k++)
                out[(i + r) * rank + k] = local[r * rank + k];
    }
}

/* the expand of work item `item` (one unit's piece of outputs) of lora_bgmv_team */
static inline __attribute__((always_inline)) void expand_item(
    int64_t item, int64_t pieces, const bgmv_part_t *parts, const int64_t *rows, const int64_t *group_starts,
    const int64_t *group_slots, int64_t num_groups, const float *shrunk, int64_t max_rank, const int bf16,
    const int wbf16)
{
    const size_t welement = wbf16 ? sizeof(bf16_t) : sizeof(float);
    const int64_t unit = item / pieces, piece = item % pieces, g = unit % num_groups, num_rows = group_starts[num_groups];
    const bgmv_part_t *part = &parts[unit / num_groups];
    const int64_t rank = part->rank, out_features = part->out_features;
    const int64_t chunks = (out_features + CHUNK - 1) / CHUNK, cuts = pieces < chunks ? pieces : chunks;
    const int64_t span = (chunks + cuts - 1) / cuts * CHUNK, first = piece * span;
    if (piece >= cuts || first >= out_features)
        return;
    const int64_t last = first + span < out_features ? first + span : out_features;
    const float *in = shrunk + (size_t)((unit / num_groups) * num_rows * max_rank);
    const char *b_slot = (const char *)part->bt + (size_t)(group_slots[g] * rank * out_features) * welement;
    const int tiled = part->tiled != 0;
    int64_t i = group_starts[g];
#if EXPAND_AVX512
    for (; i + ROWS8 <= group_starts[g + 1]; i += ROWS8) {  /* eight rows at a time while there are */
        const float *s = in + i * rank;
        int64_t o0 = first;
        for (; o0 + CHUNK8 <= last; o0 += CHUNK8)
            expand_rows8(part->y, part->y_stride, rows + i, s, b_slot, out_features, rank, tiled, o0, bf16, wbf16);
        for (int64_t h = 0; h < ROWS8 && o0 < last; h += ROWS)  /* the outputs past the last CHUNK8 */
            expand_rows(part->y, part->y_stride, rows + i + h, ROWS, s + h * rank, b_slot, out_features, rank, tiled,
                        o0, last - o0, bf16, wbf16);
    }
#endif
    for (; i < group_starts[g + 1]; i += ROWS) {
        const int64_t nr = group_starts[g + 1] - i < ROWS ? group_starts[g + 1] - i : ROWS;
        float s[ROWS * rank];
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t k = 0; k < rank; k++)
                s[r * rank + k] = r < nr ? in[(i + r) * rank + k] : 0.f;
        if (nr == 1) {
            expand_one_row(part->y, part->y_stride, rows[i], s, b_slot, out_features, rank, tiled, first, last, bf16,
                           wbf16);
            continue;
        }
        for (int64_t o0 = first; o0 < last; o0 += CHUNK)
            expand_rows(part->y, part->y_stride, rows + i, nr, s, b_slot, out_features, rank, tiled, o0,
                        last - o0 < CHUNK ? last - o0 : CHUNK, bf16, wbf16);
    }
}

/* one thread's share of the kernel, called inside the exported functions' parallel regions (its
   worksharing loops bind to them), for float32 (bf16 = 0) or bfloat16 (bf16 = 1) x and y, and
   float32 (wbf16 = 0) or bfloat16 (wbf16 = 1) factors. A unit is one (part, group): its shrink reads
   the slot's A once, its expand the slot's B^T once. With fewer units than twice the threads (one
   adapter at batch 1), each unit's rank rows of A and its outputs are cut into pieces, so no thread
   idles while another streams a whole slot alone; shrunk holds [num_parts, rows, max_rank]. One
   group's items are alike and go round-robin (schedule(static, 1)); several groups' (rows per slot
   differ) are handed out as threads come free. */
static inline __attribute__((always_inline)) void lora_bgmv_team(
    const void *x, int64_t x_stride, const bgmv_part_t *parts, int64_t num_parts, const int64_t *rows,
    const int64_t *group_starts, const int64_t *group_slots, int64_t num_groups, int64_t in_features,
    float *shrunk, int64_t max_rank, int num_threads, const int bf16, const int wbf16)
{
    const int64_t units = num_parts * num_groups;
    const int64_t pieces = units >= 2 * num_threads ? 1 : (2 * num_threads + units - 1) / units;
    /* the shrink, its loop's implicit barrier (every shrunk row complete), the expand */
#define TEAM_LOOPS(omp_for)                                                                                   \
    _Pragma(omp_for) for (int64_t item = 0; item < units * pieces; item++)                                    \
        shrink_item(item, pieces, x, x_stride, parts, rows, group_starts, group_slots, num_groups, in_features, \
                    shrunk, max_rank, bf16, wbf16);                                                           \
    _Pragma(omp_for) for (int64_t item = 0; item < units * pieces; item++)                                    \
        expand_item(item, pieces, parts, rows, group_starts, group_slots, num_groups, shrunk, max_rank, bf16, wbf16);
    if (num_groups == 1) {
        TEAM_LOOPS("omp for schedule(static, 1)")
    } else {
        TEAM_LOOPS("omp for schedule(dynamic, 1)")
    }
#undef TEAM_LOOPS
}

/* the largest rank of `parts` (the stride of each part's block of shrunk) */
static int64_t max_rank_of(const bgmv_part_t *parts, int64_t num_parts)
{
    int64_t rank = 0;
    for (int64_t p = 0; p < num_parts; p++)
        rank = parts[p].rank > rank ? parts[p].rank : rank;
    return rank;
}

/* x [num_tokens, in] (row stride x_stride elements); each part's y [num_tokens, out] (row stride
   y_stride), a [num_slots, rank, in] and bt [num_slots, rank, out] (tiled or not) contiguous; rows
   [num_rows] grouped by slot, group_starts [num_groups + 1], group_slots [num_groups]. Several
   projections reading the same x in one parallel region (the fused decode step's q, k, v and
   gate, up: one fork and two barriers where one call per projection took three each); each part's
   results are those of its own single-part call. shrunk: [num_parts, num_rows, max rank] float32.
   float32 x, y and factors; _bf16: bfloat16 x, y, a and bt (raw bits, uint16), shrunk float32;
   _f32_bf16w: float32 x and y with bfloat16 factors (--lora-dtype bfloat16 on a float32 model), each
   factor value widened exactly. */
void tessera_lora_bgmv_parts_f32(
    const float *x, int64_t x_stride, const bgmv_part_t *parts, int64_t num_parts, const int64_t *rows,
    const int64_t *group_starts, const int64_t *group_slots, int64_t num_groups, int64_t in_features, float *shrunk,
    int num_threads)
{
    const int64_t max_rank = max_rank_of(parts, num_parts);
    #pragma omp parallel num_threads(num_threads)
    lora_bgmv_team(x, x_stride, parts, num_parts, rows, group_starts, group_slots, num_groups, in_features, shrunk,
                   max_rank, num_threads, 0, 0);
}

void tessera_lora_bgmv_parts_bf16(
    const bf16_t *x, int64_t x_stride, const bgmv_part_t *parts, int64_t num_parts, const int64_t *rows,
    const int64_t *group_starts, const int64_t *group_slots, int64_t num_groups, int64_t in_features, float *shrunk,
    int num_threads)
{
    const int64_t max_rank = max_rank_of(parts, num_parts);
    #pragma omp parallel num_threads(num_threads)
    lora_bgmv_team(x, x_stride, parts, num_parts, rows, group_starts, group_slots, num_groups, in_features, shrunk,
                   max_rank, num_threads, 1, 1);
}

void tessera_lora_bgmv_parts_f32_bf16w(
    const float *x, int64_t x_stride, const bgmv_part_t *parts, int64_t num_parts, const int64_t *rows,
    const int64_t *group_starts, const int64_t *group_slots, int64_t num_groups, int64_t in_features, float *shrunk,
    int num_threads)
{
    const int64_t max_rank = max_rank_of(parts, num_parts);
    #pragma omp parallel num_threads(num_threads)
    lora_bgmv_team(x, x_stride, parts, num_parts, rows, group_starts, group_slots, num_groups, in_features, shrunk,
                   max_rank, num_threads, 0, 1);
}

/* The `_parts` functions' work for a thread of a parallel region the caller opened (the fused decode
   step's GEMV of the same x: one region for the projection and its LoRA): every thread of the region
   calls it; its loops bind to that region and end with a barrier, so it returns once every part is
   added; `num_threads` is the region's. The same work and results as the `_parts` call. */
#define PARTS_TEAM(suffix, x_type, bf16, wbf16)                                                              \
    void tessera_lora_bgmv_parts_team_##suffix(                                                              \
        const x_type *x, int64_t x_stride, const bgmv_part_t *parts, int64_t num_parts, const int64_t *rows,  \
        const int64_t *group_starts, const int64_t *group_slots, int64_t num_groups, int64_t in_features,     \
        float *shrunk, int num_threads)                                                                       \
    {                                                                                                         \
        lora_bgmv_team(x, x_stride, parts, num_parts, rows, group_starts, group_slots, num_groups, in_features, \
                       shrunk, max_rank_of(parts, num_parts), num_threads, bf16, wbf16);                      \
    }
PARTS_TEAM(f32, float, 0, 0)
PARTS_TEAM(bf16, bf16_t, 1, 1)
PARTS_TEAM(f32_bf16w, float, 0, 1)
#undef PARTS_TEAM
