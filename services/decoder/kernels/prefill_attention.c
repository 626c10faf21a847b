/* Prefill attention over the paged, head-major KV cache, for CPUs (float32 or bfloat16).
 *
 * Built and loaded with the other kernels by services/decoder/kernels/native.py; called by the cpu
 * attention backend (attention/cpu_backend.py `paged_prefill_attention`) for every prefill span of
 * a step: a whole prompt, a chunk of one (chunked prefill), or the rest of one after a prefix-cache hit.
 *
 * The flash-attention recurrence (Dao et al., "FlashAttention", NeurIPS 2022; the online softmax of
 * Milakov & Gimelshein, 2018) over tiles of queries and blocks of KB = 16 positions, each K and V row
 * read straight from its cache slot (nothing gathered, nothing padded to a batch shape):
 *
 *     query row i of span s sits at position p = num_computed[s] + i and sees the positions t with
 *     lo(p) <= t <= p (lo(p) = p - window + 1 with a sliding window, else 0: transformers' causal
 *     mask, and its sliding-window mask kv > q - window); position t's K and V rows are
 *     plane[h][slots[slot_offsets[s] + t]].
 *
 *     for each block of positions:   S = (scale Q) . K^T         (-inf where not seen; C tanh(S / C)
 *                                                                  first with a soft cap C)
 *                                     m' = max(m, max_t S)
 *                                     P = exp(S - m'),  l = l exp(m - m') + sum_t P
 *                                     O = O exp(m - m') + P . V
 *     at the end:                     out = O / l
 *
 * One work item is (span, kv head, tile of QT query rows): its M = QT * rep query vectors (the rep
 * = heads / kv_heads query heads sharing the kv head, grouped-query attention as transformers'
 * repeat_kv) share every K and V row read. QT = ceil(48 / rep), M padded to a multiple of 16: the
 * tile's queries (scaled, transposed [head_dim, M]), its output accumulators [M, head_dim] and a
 * block's scores [16, M] stay in L1/L2 while the span's blocks stream past. Items run longest first
 * (the last tiles of a causal span see the most positions) under a dynamic schedule; each item is
 * one thread's from start to end, so a row's result depends on neither the thread count nor the
 * other spans of the call.
 *
 * Scores are kept transposed, S^T [16 positions, M queries], so the softmax runs across queries in
 * vector lanes (max, exp, sums), and a block every query sees whole skips the mask. The two products
 * are register tiles: with AVX-512, S^T as 8 positions x 48 queries (24 zmm accumulators; per k,
 * 3 loads of the transposed queries and 8 broadcasts of K feed 24 FMAs) and P . V as 12 queries x
 * 32 columns (head_dim a multiple of 32); with AVX2 + FMA, 4 positions x 24 queries and 6 queries x
 * 16 columns (head_dim a multiple of 8); scalar loops elsewhere.
 * SDPA's CPU flash kernel on the same spans, this 2-core AMD EPYC (bench/results/prefill_attention.md):
 * 1.3-3.0x at SmolLM2's shape, 1.1-2.1x at Llama-3-8B's, the most for short spans; the AVX2 tiles
 * alone (AVX-512 compiled out) 1.3-1.9x up to 1024 positions and 0.95x at one 2048-token span.
 * bfloat16 caches are widened (exactly) a block at a time into float32 buffers; scores, softmax and
 * sums are float32 for both dtypes (as SDPA computes half precision on the CPU), a bf16 output
 * rounded once. An exponent below -87 is taken as -87 (paged_attention.c's item_softmax says why);
 * NaN or +inf scores give a NaN row, as in torch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define PREFILL_AVX2 1
#else
#define PREFILL_AVX2 0
#endif
#if defined(__AVX512F__) && !defined(TESSERA_PORTABLE)
#define PREFILL_AVX512 1
#else
#define PREFILL_AVX512 0
#endif

/* glibc's vector expf (libmvec) for the softmax loops; math.h declares it only under -ffast-math */
#pragma omp declare simd notinbranch
extern float expf(float);

#define KB 16         /* positions per block of keys */
#define TARGET_M 48   /* query vectors per tile, about: QT = ceil(48 / rep) query rows */

typedef struct {
    int64_t span, kv_head, first, rows;  /* rows [first, first + rows) of the span */
} item_t;

/* the thread's buffers for one tile of m_pad (a multiple of 8) query vectors */
typedef struct {
    float *qt;      /* [head_dim, m_pad] queries, transposed (zero past m) */
    float *o;       /* [m_pad, head_dim] output accumulators */
    float *s;       /* [KB, m_pad] scores, then weights, of a block */
    float *k, *v;   /* [KB, head_dim] a block's rows widened (bfloat16 caches), zero past the span */
    float *max, *sum, *alpha, *block_max;  /* [m_pad] each */
    int64_t *pos, *lo;                     /* [m_pad] each: a query's position and first position seen */
} tile_t;

/* a block's rows [count] from the cache (float32: pointers into it; bfloat16: widened into buf);
   rows past count are zero in buf and point at it */
static inline __attribute__((always_inline)) void block_rows(
    const void *plane, const int64_t *slots, int64_t t0, int64_t count, int64_t head_dim, float *buf,
    const float **rows, const int kv_bf16)
{
    for (int64_t j = 0; j < KB; j++) {
        if (j >= count) {
            memset(buf + j * head_dim, 0, sizeof(float) * (size_t)head_dim);
            rows[j] = buf + j * head_dim;
        } else if (kv_bf16) {
            const bf16_t *src = (const bf16_t *)plane + slots[t0 + j] * head_dim;
            float *dst = buf + j * head_dim;
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                dst[d] = bf16_to_f32(src[d]);
            rows[j] = dst;
        } else {
            rows[j] = (const float *)plane + slots[t0 + j] * head_dim;
        }
    }
}

#if PREFILL_AVX2
/* S^T[j0 + j][m0 + 8 c + lane] for 4 positions x n (<= 3) vectors of 8 queries: 4 n accumulators */
static inline __attribute__((always_inline)) void score_tile(
    const float *qt, int64_t m_pad, const float *const *k_rows, int64_t head_dim, float *s, const int n)
{
    __m256 acc[4][3];
    #pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        #pragma GCC unroll 3
        for (int c = 0; c < n; c++)
            acc[j][c] = _mm256_setzero_ps();
    const float *k0 = k_rows[0], *k1 = k_rows[1], *k2 = k_rows[2], *k3 = k_rows[3];
    for (int64_t d = 0; d < head_dim; d++) {
        __m256 qv[3];
        #pragma GCC unroll 3
        for (int c = 0; c < n; c++)
            qv[c] = _mm256_loadu_ps(qt + d * m_pad + 8 * c);
        const __m256 b0 = _mm256_broadcast_ss(k0 + d), b1 = _mm256_broadcast_ss(k1 + d);
        const __m256 b2 = _mm256_broadcast_ss(k2 + d), b3 = _mm256_broadcast_ss(k3 + d);
        #pragma GCC unroll 3
        for (int c = 0; c < n; c++) {
            acc[0][c] = _mm256_fmadd_ps(b0, qv[c], acc[0][c]);
            acc[1][c] = _mm256_fmadd_ps(b1, qv[c], acc[1][c]);
            acc[2][c] = _mm256_fmadd_ps(b2, qv[c], acc[2][c]);
            acc[3][c] = _mm256_fmadd_ps(b3, qv[c], acc[3][c]);
        }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        #pragma GCC unroll 3
        for (int c = 0; c < n; c++)
            _mm256_storeu_ps(s + j * m_pad + 8 * c, acc[j][c]);
}

/* O[m0 + r][d0, d0 + 8 w) = O alpha + sum_j P^T[j][m0 + r] v_j[...] for r < n (<= 6) queries, w (1 or 2) vectors */
static inline __attribute__((always_inline)) void value_tile(
    const float *p, int64_t m_pad, const float *const *v_rows, int64_t d0, const float *alpha, float *o,
    int64_t head_dim, const int n, const int w)
{
    __m256 acc[6][2];
    #pragma GCC unroll 6
    for (int r = 0; r < n; r++)
        #pragma GCC unroll 2
        for (int c = 0; c < w; c++)
            acc[r][c] = _mm256_setzero_ps();
    #pragma GCC unroll 2
    for (int64_t j = 0; j < KB; j++) {
        __m256 v[2];
        #pragma GCC unroll 2
        for (int c = 0; c < w; c++)
            v[c] = _mm256_loadu_ps(v_rows[j] + d0 + 8 * c);
        #pragma GCC unroll 6
        for (int r = 0; r < n; r++) {
            const __m256 weight = _mm256_broadcast_ss(p + j * m_pad + r);
            #pragma GCC unroll 2
            for (int c = 0; c < w; c++)
                acc[r][c] = _mm256_fmadd_ps(weight, v[c], acc[r][c]);
        }
    }
    #pragma GCC unroll 6
    for (int r = 0; r < n; r++) {
        const __m256 a = _mm256_broadcast_ss(alpha + r);
        #pragma GCC unroll 2
        for (int c = 0; c < w; c++) {
            float *out = o + r * head_dim + d0 + 8 * c;
            _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_loadu_ps(out), a, acc[r][c]));
        }
    }
}
#endif

#if PREFILL_AVX512
/* score_tile in zmm: 8 positions x n (<= 3) vectors of 16 queries (32 registers: 24 accumulators) */
static inline __attribute__((always_inline)) void score_tile16(
    const float *qt, int64_t m_pad, const float *const *k_rows, int64_t head_dim, float *s, const int n)
{
    __m512 acc[8][3];
    #pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        #pragma GCC unroll 3
        for (int c = 0; c < n; c++)
            acc[j][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d++) {
        __m512 qv[3];
        #pragma GCC unroll 3
        for (int c = 0; c < n; c++)
            qv[c] = _mm512_loadu_ps(qt + d * m_pad + 16 * c);
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m512 b = _mm512_set1_ps(k_rows[j][d]);
            #pragma GCC unroll 3
            for (int c = 0; c < n; c++)
                acc[j][c] = _mm512_fmadd_ps(b, qv[c], acc[j][c]);
        }
    }
    #pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        #pragma GCC unroll 3
        for (int c = 0; c < n; c++)
            _mm512_storeu_ps(s + j * m_pad + 16 * c, acc[j][c]);
}

/* value_tile in zmm: n (<= 12) queries x 2 vectors of 16 columns */
static inline __attribute__((always_inline)) void value_tile16(
    const float *p, int64_t m_pad, const float *const *v_rows, int64_t d0, const float *alpha, float *o,
    int64_t head_dim, const int n)
{
    __m512 acc[12][2];
    #pragma GCC unroll 12
    for (int r = 0; r < n; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    #pragma GCC unroll 2
    for (int64_t j = 0; j < KB; j++) {
        const __m512 v0 = _mm512_loadu_ps(v_rows[j] + d0), v1 = _mm512_loadu_ps(v_rows[j] + d0 + 16);
        #pragma GCC unroll 12
        for (int r = 0; r < n; r++) {
            const __m512 weight = _mm512_set1_ps(p[j * m_pad + r]);
            acc[r][0] = _mm512_fmadd_ps(weight, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(weight, v1, acc[r][1]);
        }
    }
    #pragma GCC unroll 12
    for (int r = 0; r < n; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        float *out = o + r * head_dim + d0;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), a, acc[r][0]));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_loadu_ps(out + 16), a, acc[r][1]));
    }
}
#endif

/* S^T[j][m] = k_j . q_m for the block's KB rows and m < m_pad (8 | m_pad) */
static inline void block_scores(const tile_t *tile, const float *const *k_rows, int64_t m_pad, int64_t head_dim)
{
#if PREFILL_AVX512
    if (m_pad % 16 == 0) {
        for (int64_t m0 = 0; m0 < m_pad; m0 += 48)
            for (int64_t j0 = 0; j0 < KB; j0 += 8) {
                const float *qt = tile->qt + m0;
                float *s = tile->s + j0 * m_pad + m0;
                switch (m_pad - m0 >= 48 ? 3 : (m_pad - m0) / 16) {
                case 1: score_tile16(qt, m_pad, k_rows + j0, head_dim, s, 1); break;
                case 2: score_tile16(qt, m_pad, k_rows + j0, head_dim, s, 2); break;
                default: score_tile16(qt, m_pad, k_rows + j0, head_dim, s, 3); break;
                }
            }
        return;
    }
#endif
#if PREFILL_AVX2
    for (int64_t m0 = 0; m0 < m_pad; m0 += 24)
        for (int64_t j0 = 0; j0 < KB; j0 += 4) {
            const float *qt = tile->qt + m0;
            float *s = tile->s + j0 * m_pad + m0;
            switch (m_pad - m0 >= 24 ? 3 : (m_pad - m0) / 8) {  /* a constant count: only live accumulators */
            case 1: score_tile(qt, m_pad, k_rows + j0, head_dim, s, 1); break;
            case 2: score_tile(qt, m_pad, k_rows + j0, head_dim, s, 2); break;
            default: score_tile(qt, m_pad, k_rows + j0, head_dim, s, 3); break;
            }
        }
#else
    for (int64_t j = 0; j < KB; j++) {
        float *s = tile->s + j * m_pad;
        for (int64_t m = 0; m < m_pad; m++)
            s[m] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            const float kd = k_rows[j][d], *q = tile->qt + d * m_pad;
            #pragma omp simd
            for (int64_t m = 0; m < m_pad; m++)
                s[m] += kd * q[m];
        }
    }
#endif
}

/* O[m] = O[m] alpha[m] + sum_j P^T[j][m] v_j for m < m (the tile's live query vectors) */
static inline void block_values(const tile_t *tile, const float *const *v_rows, int64_t m, int64_t m_pad,
                                int64_t head_dim)
{
#if PREFILL_AVX512
    if (head_dim % 32 == 0) {
        for (int64_t m0 = 0; m0 < m; m0 += 12)
            for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
                const float *p = tile->s + m0, *alpha = tile->alpha + m0;
                float *o = tile->o + m0 * head_dim;
                switch (m - m0 < 12 ? m - m0 : 12) {
                case 1: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 1); break;
                case 2: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 2); break;
                case 3: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 3); break;
                case 4: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 4); break;
                case 5: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 5); break;
                case 6: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 6); break;
                case 7: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 7); break;
                case 8: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 8); break;
                case 9: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 9); break;
                case 10: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 10); break;
                case 11: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 11); break;
                default: value_tile16(p, m_pad, v_rows, d0, alpha, o, head_dim, 12); break;
                }
            }
        return;
    }
#endif
#if PREFILL_AVX2
    if (head_dim % 8 == 0) {
        for (int64_t m0 = 0; m0 < m; m0 += 6)
            for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
                const float *p = tile->s + m0, *alpha = tile->alpha + m0;
                float *o = tile->o + m0 * head_dim;
#define VALUE_TILE(n)                                                                                        \
                if (head_dim - d0 >= 16)                                                                     \
                    value_tile(p, m_pad, v_rows, d0, alpha, o, head_dim, n, 2);                              \
                else                                                                                         \
                    value_tile(p, m_pad, v_rows, d0, alpha, o, head_dim, n, 1);
                switch (m - m0 < 6 ? m - m0 : 6) {
                case 1: VALUE_TILE(1); break;
                case 2: VALUE_TILE(2); break;
                case 3: VALUE_TILE(3); break;
                case 4: VALUE_TILE(4); break;
                case 5: VALUE_TILE(5); break;
                default: VALUE_TILE(6); break;
                }
#undef VALUE_TILE
            }
        return;
    }
#endif
    for (int64_t r = 0; r < m; r++) {
        float *o = tile->o + r * head_dim;
        const float a = tile->alpha[r];
        for (int64_t d = 0; d < head_dim; d++)
            o[d] *= a;
        for (int64_t j = 0; j < KB; j++) {
            const float w = tile->s[j * m_pad + r], *v = v_rows[j];
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                o[d] += w * v[d];
        }
    }
}

/* one block's scores -> weights in place, the running max and sum updated, alpha = exp(old max - new).
   The queries were scaled when transposed; with a soft cap C a score s becomes C tanh(s / C). A block
   every query sees whole (all but the causal diagonal and the window's edge) skips the mask. */
static inline void block_softmax(const tile_t *tile, int64_t t0, int64_t m_pad, float soft_cap, int64_t pos_min,
                                 int64_t lo_max)
{
    float *bmax = tile->block_max;
    for (int64_t m = 0; m < m_pad; m++)
        bmax[m] = -INFINITY;
    const int whole = t0 + KB - 1 <= pos_min && t0 >= lo_max;
    for (int64_t j = 0; j < KB; j++) {
        float *s = tile->s + j * m_pad;
        const int64_t t = t0 + j;
        if (soft_cap > 0.f)  /* scalar tanhf: libmvec's vector tanhf is not in every glibc */
            for (int64_t m = 0; m < m_pad; m++)
                s[m] = soft_cap * tanhf(s[m] / soft_cap);
        if (whole) {
            #pragma omp simd
            for (int64_t m = 0; m < m_pad; m++)
                bmax[m] = s[m] > bmax[m] ? s[m] : bmax[m];  /* a NaN score is passed over here, and poisons the sum */
        } else {
            #pragma omp simd
            for (int64_t m = 0; m < m_pad; m++) {
                const float x = (t <= tile->pos[m] && t >= tile->lo[m]) ? s[m] : -INFINITY;
                s[m] = x;
                bmax[m] = x > bmax[m] ? x : bmax[m];
            }
        }
    }
    #pragma omp simd
    for (int64_t m = 0; m < m_pad; m++) {
        const float old = tile->max[m], next = old > bmax[m] ? old : bmax[m];
        const float alpha = expf(old - next);
        tile->alpha[m] = next == -INFINITY ? 1.f : alpha;  /* nothing seen yet: O and l are 0 */
        tile->max[m] = next;
        tile->sum[m] *= tile->alpha[m];
    }
    for (int64_t j = 0; j < KB; j++) {
        float *s = tile->s + j * m_pad;
        #pragma omp simd
        for (int64_t m = 0; m < m_pad; m++) {
            const float x = s[m] - tile->max[m];
            const float w = expf(x < -87.f ? -87.f : x);  /* NaN stays NaN */
            s[m] = s[m] == -INFINITY ? 0.f : w;
            tile->sum[m] += s[m];
        }
    }
}

static inline __attribute__((always_inline)) int paged_prefill_attention(
    const void *query, const void *k_cache, const void *v_cache, const int64_t *spans, int64_t num_spans,
    const int64_t *slots, void *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t num_slots, float scale, int64_t window, float soft_cap, int num_threads, const int q_bf16,
    const int kv_bf16)
{
    const int64_t rep = num_heads / num_kv_heads;
    const int64_t qt = (TARGET_M + rep - 1) / rep, m_max = qt * rep, m_pad = (m_max + 15) / 16 * 16;
    const size_t kv_element = kv_bf16 ? sizeof(bf16_t) : sizeof(float);
    int64_t num_items = 0;
    for (int64_t s = 0; s < num_spans; s++)
        num_items += num_kv_heads * ((spans[4 * s + 1] + qt - 1) / qt);
    item_t *items = (item_t *)malloc(sizeof(item_t) * (size_t)(num_items > 0 ? num_items : 1));
    if (items == NULL)
        return -1;
    /* each span's tiles last to first (the last see the most positions), its kv heads side by side */
    int64_t n = 0;
    for (int64_t s = 0; s < num_spans; s++)
        for (int64_t first = (spans[4 * s + 1] - 1) / qt * qt; first >= 0; first -= qt)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t rows = spans[4 * s + 1] - first < qt ? spans[4 * s + 1] - first : qt;
                items[n++] = (item_t){s, h, first, rows};
            }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        const size_t floats = (size_t)(2 * head_dim * m_pad + KB * m_pad + 2 * KB * head_dim + 4 * m_pad);
        float *buffer = (float *)malloc(sizeof(float) * floats);
        int64_t *positions = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * m_pad));
        if (buffer == NULL || positions == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        tile_t tile = {0};
        if (buffer != NULL && positions != NULL) {
            tile.qt = buffer, tile.o = tile.qt + head_dim * m_pad, tile.s = tile.o + head_dim * m_pad;
            tile.k = tile.s + KB * m_pad, tile.v = tile.k + KB * head_dim, tile.max = tile.v + KB * head_dim;
            tile.sum = tile.max + m_pad, tile.alpha = tile.sum + m_pad, tile.block_max = tile.alpha + m_pad;
            tile.pos = positions, tile.lo = positions + m_pad;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; it++) {
            if (buffer == NULL || positions == NULL)
                continue;
            const item_t item = items[it];
            const int64_t *span = spans + 4 * item.span;  /* token_start, q_len, num_computed, slot offset */
            const int64_t m = item.rows * rep, base = span[2] + item.first;
            const int64_t *span_slots = slots + span[3];
            for (int64_t x = 0; x < m_pad; x++) {  /* vector x: row first + x / rep, head kv_head * rep + x % rep */
                const int64_t p = base + (x < m ? x / rep : 0);
                tile.pos[x] = x < m ? p : -1;  /* padding sees nothing */
                tile.lo[x] = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
                tile.max[x] = -INFINITY, tile.sum[x] = 0.f;
            }
            memset(tile.qt, 0, sizeof(float) * (size_t)(m_pad * head_dim));  /* zero past m */
            for (int64_t x = 0; x < m; x++) {  /* transposed: qt[d][x] */
                const int64_t at = ((span[0] + item.first + x / rep) * num_heads + item.kv_head * rep + x % rep) * head_dim;
                for (int64_t d = 0; d < head_dim; d++)
                    tile.qt[d * m_pad + x] = (q_bf16 ? bf16_to_f32(((const bf16_t *)query)[at + d])
                                                     : ((const float *)query)[at + d]) * scale;
            }
            memset(tile.o, 0, sizeof(float) * (size_t)(m_pad * head_dim));
            const char *k_plane = (const char *)k_cache + (size_t)(item.kv_head * num_slots * head_dim) * kv_element;
            const char *v_plane = (const char *)v_cache + (size_t)(item.kv_head * num_slots * head_dim) * kv_element;
            const int64_t first_seen = tile.lo[0], last = base + item.rows - 1;
            for (int64_t t0 = first_seen; t0 <= last; t0 += KB) {
                const int64_t count = last + 1 - t0 < KB ? last + 1 - t0 : KB;
                const float *k_rows[KB], *v_rows[KB];
                if (kv_bf16) {
                    block_rows(k_plane, span_slots, t0, count, head_dim, tile.k, k_rows, 1);
                    block_rows(v_plane, span_slots, t0, count, head_dim, tile.v, v_rows, 1);
                } else {
                    block_rows(k_plane, span_slots, t0, count, head_dim, tile.k, k_rows, 0);
                    block_rows(v_plane, span_slots, t0, count, head_dim, tile.v, v_rows, 0);
                }
                block_scores(&tile, k_rows, m_pad, head_dim);
                block_softmax(&tile, t0, m_pad, soft_cap, base, tile.lo[m - 1]);
                block_values(&tile, v_rows, m, m_pad, head_dim);
            }
            for (int64_t x = 0; x < m; x++) {
                const float inv = 1.f / tile.sum[x];
                const int64_t at = ((span[0] + item.first + x / rep) * num_heads + item.kv_head * rep + x % rep) * head_dim;
                const float *o = tile.o + x * head_dim;
                if (q_bf16)
                    for (int64_t d = 0; d < head_dim; d++)
                        ((bf16_t *)out)[at + d] = f32_to_bf16(o[d] * inv);
                else
                    for (int64_t d = 0; d < head_dim; d++)
                        ((float *)out)[at + d] = o[d] * inv;
            }
        }
        free(buffer);
        free(positions);
    }
    free(items);
    return failed ? -1 : 0;
}

/* query/out [num_tokens, num_heads, head_dim] (only the spans' rows of out are written); caches
   [num_kv_heads, num_slots, head_dim]; spans [num_spans, 4]: (first flat-batch row, query rows,
   position of the first query row = num_computed, offset of the span's context in slots); slots:
   each span's cache slots of positions 0 .. num_computed + query rows - 1, concatenated (trusted:
   the block manager's); window: the sliding window (0: none); soft_cap: the logit soft cap (0: none).
   Returns 0, or -1 when a buffer could not be allocated. */
int tessera_paged_prefill_attention_f32(
    const float *query, const float *k_cache, const float *v_cache, const int64_t *spans, int64_t num_spans,
    const int64_t *slots, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
    float scale, int64_t window, float soft_cap, int num_threads)
{
    return paged_prefill_attention(query, k_cache, v_cache, spans, num_spans, slots, out, num_heads, num_kv_heads,
                                   head_dim, num_slots, scale, window, soft_cap, num_threads, 0, 0);
}

/* the same over bfloat16 query, caches and output (raw bits, uint16) */
int tessera_paged_prefill_attention_bf16(
    const bf16_t *query, const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *spans, int64_t num_spans,
    const int64_t *slots, bf16_t *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
    float scale, int64_t window, float soft_cap, int num_threads)
{
    return paged_prefill_attention(query, k_cache, v_cache, spans, num_spans, slots, out, num_heads, num_kv_heads,
                                   head_dim, num_slots, scale, window, soft_cap, num_threads, 1, 1);
}

/* a float32 query and output over bfloat16 caches (--kv-cache-dtype bfloat16) */
int tessera_paged_prefill_attention_f32_bf16kv(
    const float *query, const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *spans, int64_t num_spans,
    const int64_t *slots, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
    float scale, int64_t window, float soft_cap, int num_threads)
{
    return paged_prefill_attention(query, k_cache, v_cache, spans, num_spans, slots, out, num_heads, num_kv_heads,
                                   head_dim, num_slots, scale, window, soft_cap, num_threads, 0, 1);
}
