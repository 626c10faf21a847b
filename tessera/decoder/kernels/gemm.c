/* Decode GEMM for CPUs: y[M][N] = x[M][K] . w[N][K]^T (+ bias[N]), for the few rows of a decode step.
 *
 * Built and loaded with the other kernels by tessera/decoder/kernels/native.py; called by
 * tessera/decoder/linear.py for every dense projection (and the lm_head) of a step of up to
 * `linear.KERNEL_ROWS` rows on the CPU.
 *
 * A decode step multiplies a few dozen rows by weights far larger than the caches, so it is bound
 * by streaming the weights from memory more than by arithmetic. The kernel reads each weight row
 * once per call: a tile of NB weight rows stays in L1 while it meets every row of x (x, a few
 * hundred KB at most, stays in L2), MB rows at a time, in NB x MB float32 vector accumulators
 * (AVX2 + FMA: 12 of the 16 ymm registers). Threads split the weight rows (OpenMP, static).
 *
 * Weights and bias are float32 or bfloat16 (widened exactly, a 16-bit shift, in registers, so a
 * bf16 model streams half the bytes); x is float32 (a bf16 model's activations are widened by the
 * caller, exactly); y is float32 or bfloat16, rounded once to nearest even from the float32 sum.
 *
 * Every y[m][n] is summed in the same order whatever M, the row's place in the batch, the tile
 * it falls in or the thread count: 8 lane partial sums over k (k = lane mod 8), added pairwise,
 * then the k tail in order, then the bias. A request's numbers do not depend on its batch.
 */
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define GEMM_AVX2 1
#else
#define GEMM_AVX2 0
#endif

#ifndef NB  /* -DNB=, -DMB= for tuning; the AVX2 tile holds NB x MB accumulators, NB + 1 operands */
#define NB 3  /* weight rows (outputs) per tile */
#endif
#ifndef MB
#define MB 4  /* rows of x per tile */
#endif
#define LANES 8
_Static_assert(NB >= 1 && NB <= 3 && MB >= 1 && MB <= 4, "the tail switches below cover NB <= 3, MB <= 4");

/* element k of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as float32 */
#define LOAD(p, k) (bf16 ? bf16_to_f32(((const bf16_t *)(p))[k]) : ((const float *)(p))[k])

#if GEMM_AVX2
static inline __attribute__((always_inline)) __m256 load8(const void *p, int64_t k, const int bf16)
{
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const bf16_t *)p + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + k);
}

/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
static inline __attribute__((always_inline)) float sum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* the same lane order as sum8 over a float[8] */
static inline __attribute__((always_inline)) float sum_lanes(const float *l)
{
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* out[i][j] = x[i] . w[j] for i < mb, j < nb (mb <= MB, nb <= NB constant after inlining) */
static inline __attribute__((always_inline)) void tile(
    const float *const *xr, const void *const *wr, int64_t k_features, float out[MB][NB],
    const char *prefetch, const int mb, const int nb, const int bf16)
{
    const int64_t k_vec = k_features / LANES * LANES;
#if GEMM_AVX2
    __m256 acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++)
            acc[i][j] = _mm256_setzero_ps();
    const int64_t line = bf16 ? 4 * LANES : 2 * LANES;  /* elements of a 64-byte cache line */
    for (int64_t k = 0; k < k_vec; k += LANES) {
        if (prefetch && k % line == 0)  /* the next tile's weights, while this one computes */
            for (int j = 0; j < NB; j++)
                _mm_prefetch(prefetch + (size_t)(j * k_features + k) * (bf16 ? 2 : 4), _MM_HINT_T0);
        __m256 wv[NB];
        for (int j = 0; j < NB; j++)
            if (j < nb)
                wv[j] = load8(wr[j], k, bf16);
        for (int i = 0; i < MB; i++) {
            if (i >= mb)
                continue;
            const __m256 xv = _mm256_loadu_ps(xr[i] + k);
            for (int j = 0; j < NB; j++)
                if (j < nb)
                    acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++)
            out[i][j] = sum8(acc[i][j]);
#else
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            float lanes[LANES] = {0};
            for (int64_t k = 0; k < k_vec; k += LANES)
                for (int l = 0; l < LANES; l++)
                    lanes[l] = __builtin_fmaf(xr[i][k + l], LOAD(wr[j], k + l), lanes[l]);
            out[i][j] = sum_lanes(lanes);
        }
#endif
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++)
            for (int64_t k = k_vec; k < k_features; k++)
                out[i][j] = __builtin_fmaf(xr[i][k], LOAD(wr[j], k), out[i][j]);
}

/* one tile of nb weight rows from n0 against every row of x */
static inline __attribute__((always_inline)) void weight_tile(
    const float *x, int64_t m_rows, int64_t k_features, const void *w, const void *bias, void *y,
    int64_t n_features, int64_t n0, const int nb, const int bf16)
{
    const size_t element = bf16 ? sizeof(bf16_t) : sizeof(float);
    const void *wr[NB];
    for (int j = 0; j < NB; j++)
        wr[j] = (const char *)w + (size_t)((n0 + (j < nb ? j : 0)) * k_features) * element;
    /* the next tile's first row, prefetched during the first pass over x (none after the last tile) */
    const char *prefetch = n0 + 2 * NB <= n_features ? (const char *)w + (size_t)((n0 + NB) * k_features) * element : 0;
    float b[NB] = {0};
    if (bias)
        for (int j = 0; j < nb; j++)
            b[j] = LOAD(bias, n0 + j);
    for (int64_t m0 = 0; m0 < m_rows; m0 += MB) {
        const float *xr[MB];
        for (int i = 0; i < MB; i++)
            xr[i] = x + (m0 + i < m_rows ? m0 + i : m0) * k_features;
        float out[MB][NB];
        switch (m_rows - m0 < MB ? m_rows - m0 : MB) {  /* constant mb: the tile's loops unroll */
        case 1: tile(xr, wr, k_features, out, m0 ? 0 : prefetch, 1, nb, bf16); break;
        case 2: tile(xr, wr, k_features, out, m0 ? 0 : prefetch, 2, nb, bf16); break;
        case 3: tile(xr, wr, k_features, out, m0 ? 0 : prefetch, 3, nb, bf16); break;
        default: tile(xr, wr, k_features, out, m0 ? 0 : prefetch, MB, nb, bf16); break;
        }
        const int64_t mb = m_rows - m0 < MB ? m_rows - m0 : MB;
        for (int64_t i = 0; i < mb; i++)
            for (int j = 0; j < nb; j++) {
                const float v = bias ? out[i][j] + b[j] : out[i][j];
                const size_t at = (size_t)((m0 + i) * n_features + n0 + j);
                if (bf16)
                    ((bf16_t *)y)[at] = f32_to_bf16(v);
                else
                    ((float *)y)[at] = v;
            }
    }
}

static inline __attribute__((always_inline)) void gemm(
    const float *x, int64_t m_rows, int64_t k_features, const void *w, const void *bias, void *y,
    int64_t n_features, int num_threads, const int bf16)
{
    const int64_t tiles = (n_features + NB - 1) / NB;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NB;
        switch (n_features - n0 < NB ? n_features - n0 : NB) {
        case 1: weight_tile(x, m_rows, k_features, w, bias, y, n_features, n0, 1, bf16); break;
        case 2: weight_tile(x, m_rows, k_features, w, bias, y, n_features, n0, 2, bf16); break;
        default: weight_tile(x, m_rows, k_features, w, bias, y, n_features, n0, NB, bf16); break;
        }
    }
}

/* x [m_rows, k] float32, w [n, k] float32, bias [n] float32 or NULL, y [m_rows, n] float32; all contiguous */
void tessera_gemm_f32(const float *x, int64_t m_rows, int64_t k_features, const float *w, const float *bias,
                      float *y, int64_t n_features, int num_threads)
{
    gemm(x, m_rows, k_features, w, bias, y, n_features, num_threads, 0);
}

/* the same with bfloat16 w, bias and y (raw bits, uint16); x float32 */
void tessera_gemm_bf16(const float *x, int64_t m_rows, int64_t k_features, const bf16_t *w, const bf16_t *bias,
                       bf16_t *y, int64_t n_features, int num_threads)
{
    gemm(x, m_rows, k_features, w, bias, y, n_features, num_threads, 1);
}

/* "avx2" where the AVX2 + FMA tile was compiled (the compiler targets such a CPU and TESSERA_PORTABLE
   is not defined), else "portable" (scalar FMAs: slower than MKL; linear.py's auto keeps torch then) */
const char *tessera_gemm_variant(void)
{
    return GEMM_AVX2 ? "avx2" : "portable";
}
