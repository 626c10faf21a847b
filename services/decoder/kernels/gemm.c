/* Dense GEMM for CPUs: y[M][N] = x[M][K] . W[N][K]^T (+ bias[N]), on weights packed into panels.
 *
 * Built and loaded with the other kernels by services/decoder/kernels/native.py; called by
 * services/decoder/linear.py (`PackedWeight`) for every dense projection and the lm_head of every
 * step, decode and prefill, when the cpu linear backend runs.
 *
 * Layout. The weight is packed once, at load (linear.CpuGemm.pack), into panels of NR = 16 output columns:
 *
 *     panels[p][k][j] = W[p * NR + j][k]        p < ceil(N / NR), k < K, j < NR (zero past N)
 *
 * (bfloat16 panels store each row's 16 columns in BF16_POS order, see load16),
 * so one panel is K x 16 contiguous values, 64 bytes (fp32) or 32 (bf16) per k. This is the
 * packed B panel of the BLIS/GotoBLAS micro-kernel design (Van Zee & van de Geijn, "BLIS", ACM TOMS
 * 2015): the kernel streams a panel front to back with no stride, and a panel of a K <= 1536
 * projection stays in L1/L2 while it meets every row of x.
 *
 * Micro-kernel (AVX2 + FMA): MR = 6 rows of x against one panel in 6 x 2 ymm accumulators; per k,
 * two panel loads (one for bf16), six broadcasts of x[m][k], twelve fused multiply-adds (8 loads per 12 FMAs, so
 * the FMA units, not the load ports, set the pace). Threads (OpenMP) split a decode step's
 * panels: each streams its own weight columns once. A prefill batch (more than CHUNK = 96 rows) is
 * split by rows instead: each thread takes its rows CHUNK at a time, the chunk held in L2 while
 * every panel streams past it. Split by panels, each thread streamed all of x from L3 once per
 * panel (4.7-12.6 MB per panel at 2048 prefill tokens); split by rows, it streams the weights once
 * per chunk. SmolLM2-135M's four projections x 6 layers, 2048 rows, A/B interleaved: bfloat16
 * 914-1264 -> 816-1170 ms, float32 780-963 -> 766-824 ms (the same bits: only who computes what
 * moves); a whole engine prefill (16 x 512 tokens) moved less than this VM's run-to-run noise.
 *
 * Weights and bias are float32 or bfloat16 (widened exactly in registers, into the top half: a bf16
 * model streams half the bytes); x is float32 (a bf16 model's activations are widened by the
 * caller, exactly); y is float32 or bfloat16, rounded once to nearest even from the float32 sum.
 *
 * Prefetch. A decode step's rows meet each panel in a few micro-tiles, the first streaming it from
 * memory and the rest rereading it from cache: alone, that left memory idle while the FMAs ran and
 * the FMAs idle while the panel came in (the step's time was their sum). So while a thread computes
 * the last row chunk of a panel, each micro-tile also prefetches its share of the next panel (the
 * thread's next work item under the static schedule), spread over its k blocks: SmolLM2-135M's 30
 * layers of projections, weights not in cache, 18 rows: 48 -> 35 ms float32 (8 rows 36 -> 31,
 * 32 rows 78 -> 63, 128 rows 215 -> 192; 1 row and 512 rows as before: bound by memory / FMAs).
 *
 * Summation order: k is cut into blocks of KC = 128; a block's partial sum is one fused multiply-add
 * per k in increasing k from zero, and the partials are added to the output's sum in increasing k
 * (a blocked sum: rounding error grows with KC + K / KC, not K), then the bias is added. Each block
 * end spills the twelve accumulators into the sums: at KC = 32 that cost 12-15% of the kernel (one
 * thread, best of 12 interleaved runs, 96 x 576 x 256 in cache: 73 -> 86 GFLOP/s at 128; 32 x 576 x
 * 3072: 70 -> 77; 512 x 576 x 3072: 69 -> 79; 64: 80, 96: 82, unblocked: 86). The prefetch of the
 * next panel stays spread over slices of PF_K = 32 k: asked for per 128-k block, a decode step of
 * 8 rows over 30 layers' weights from memory ran 15 -> 18 ms. The order
 * is the same whatever M, the row's place, the panel or the thread count, and the portable
 * (scalar) build does the same operations in the same order, so both give the same bits: a row's
 * numbers do not depend on its batch or on the step's size.
 */
#include <omp.h>
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define GEMM_AVX2 1
#else
#define GEMM_AVX2 0
#endif

#define NR 16     /* output columns per panel (two ymm registers); linear.PANEL_WIDTH */
#define MR 6      /* rows of x per micro-tile: MR x 2 accumulators + 2 panel vectors + 1 broadcast */
#define KC 128    /* k per block: each block is summed from zero in registers, then added to the output's sum */
#define PF_K 32   /* k per prefetch slice: a decode tile asks for its share of the next panel a slice at a time */
#define PF_LOCALITY 2  /* __builtin_prefetch's: to L2 and beyond (a panel of K = 576 is 36 KB, more than L1) */
#define CHUNK 96  /* rows of x held in L2 while every panel streams past them (MR multiples) */
_Static_assert(CHUNK % MR == 0, "a chunk holds whole micro-tiles");

/* element at of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as float32 */
#define LOAD(p, at) (bf16 ? bf16_to_f32(((const bf16_t *)(p))[at]) : ((const float *)(p))[at])

#if GEMM_AVX2
/* columns [0, 8) and [8, 16) of a panel row at k (`at` = k * NR) as float32. A bf16 row is stored
   in BF16_POS order, so one 32-byte load and two interleaves with zero (a bf16 is the top half of
   its float32) give both halves in column order. */
static inline __attribute__((always_inline)) void load16(const void *p, int64_t at, const int bf16,
                                                          __m256 *lo, __m256 *hi)
{
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const bf16_t *)p + at));
        *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
        *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), h));
        return;
    }
    *lo = _mm256_loadu_ps((const float *)p + at);
    *hi = _mm256_loadu_ps((const float *)p + at + 8);
}
#endif

/* where column j of a panel row is stored: in order for float32; for bfloat16 the middle two groups
   of four swap (0-3, 8-11, 4-7, 12-15: the order AVX2's per-128-bit-lane interleaves read) */
#define BF16_POS(j) ((j) < 4 || (j) >= 12 ? (j) : (j) < 8 ? (j) + 4 : (j) - 4)
#define POS(j) (bf16 ? BF16_POS(j) : (j))

/* rows [m0, m0 + mb) of y, columns [n0, n0 + NR) cut at N, from one panel; mb <= MR, constant after
   inlining so the loops unroll */
static inline __attribute__((always_inline)) void micro_tile(
    const float *x, int64_t m0, const int mb, int64_t k_features, const void *panel, const void *bias,
    void *y, int64_t n_features, int64_t n0, const char *pf, int64_t pf_bytes, const int bf16)
{
    const int64_t k_slices = (k_features + PF_K - 1) / PF_K;
    const int64_t pf_step = ((pf_bytes + k_slices - 1) / k_slices + 63) / 64 * 64;  /* bytes per k slice */
    const float *xr[MR];
    for (int i = 0; i < MR; i++)
        xr[i] = x + (m0 + (i < mb ? i : 0)) * k_features;
    float sums[MR][NR];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NR; j++)
            sums[i][j] = 0.f;
    for (int64_t k0 = 0; k0 < k_features; k0 += KC) {
        const int64_t k1 = k0 + KC < k_features ? k0 + KC : k_features;
#if GEMM_AVX2
        __m256 acc[MR][2];
        for (int i = 0; i < MR; i++)
            acc[i][0] = acc[i][1] = _mm256_setzero_ps();
#else
        float part[MR][NR] = {{0}};
#endif
        for (int64_t s0 = k0; s0 < k1; s0 += PF_K) {  /* the block's k in slices of PF_K: one prefetch each */
            const int64_t s1 = s0 + PF_K < k1 ? s0 + PF_K : k1;
            if (pf != NULL) {
                const int64_t from = (s0 / PF_K) * pf_step, to = from + pf_step < pf_bytes ? from + pf_step : pf_bytes;
                for (int64_t at = from; at < to; at += 64)
                    __builtin_prefetch(pf + at, 0, PF_LOCALITY);
            }
#if GEMM_AVX2
            for (int64_t k = s0; k < s1; k++) {
                __m256 w0, w1;
                load16(panel, k * NR, bf16, &w0, &w1);
                /* the panel row stays in two registers: otherwise GCC folds the loads into each row's
                   FMAs, 12 panel loads + 6 broadcasts per 12 FMAs instead of 2 + 6 (hot-cache A/B,
                   K = 576 / 1536, 6-96 rows: 1-6% faster, never slower) */
                __asm__("" : "+x"(w0), "+x"(w1));
                for (int i = 0; i < MR; i++) {
                    if (i >= mb)
                        continue;
                    const __m256 xv = _mm256_broadcast_ss(xr[i] + k);
                    acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
                }
            }
#else
            for (int i = 0; i < mb; i++)
                for (int64_t k = s0; k < s1; k++)
                    for (int j = 0; j < NR; j++)
                        part[i][j] = __builtin_fmaf(xr[i][k], LOAD(panel, k * NR + POS(j)), part[i][j]);
#endif
        }
#if GEMM_AVX2
        for (int i = 0; i < mb; i++) {
            _mm256_storeu_ps(sums[i], _mm256_add_ps(_mm256_loadu_ps(sums[i]), acc[i][0]));
            _mm256_storeu_ps(sums[i] + 8, _mm256_add_ps(_mm256_loadu_ps(sums[i] + 8), acc[i][1]));
        }
#else
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < NR; j++)
                sums[i][j] += part[i][j];
#endif
    }
    const int nn = n_features - n0 < NR ? (int)(n_features - n0) : NR;
    for (int i = 0; i < mb; i++) {
        const size_t row = (size_t)((m0 + i) * n_features + n0);
        for (int j = 0; j < nn; j++) {
            const float v = bias ? sums[i][j] + LOAD(bias, n0 + j) : sums[i][j];
            if (bf16)
                ((bf16_t *)y)[row + j] = f32_to_bf16(v);
            else
                ((float *)y)[row + j] = v;
        }
    }
}

/* rows [r0, r1) of y against panel p, in micro-tiles of MR rows; with pf_next, each tile also
   prefetches its share of panel p + 1 (the thread's next work) while it computes */
static inline __attribute__((always_inline)) void panel_rows(
    const float *x, int64_t r0, int64_t r1, int64_t k_features, const void *panels, size_t panel_bytes, int64_t p,
    const int pf_next, const void *bias, void *y, int64_t n_features, const int bf16)
{
    const void *panel = (const char *)panels + p * panel_bytes;
    const int64_t tiles = (r1 - r0 + MR - 1) / MR;
    const int64_t slice = ((int64_t)panel_bytes + tiles - 1) / tiles;
    for (int64_t m0 = r0; m0 < r1; m0 += MR) {
        const int64_t from = (m0 - r0) / MR * slice;
        const char *pf = pf_next ? (const char *)panel + panel_bytes + from : NULL;
        const int64_t pf_bytes = from + slice < (int64_t)panel_bytes ? slice : (int64_t)panel_bytes - from;
        switch (r1 - m0 < MR ? r1 - m0 : MR) {
        case 1: micro_tile(x, m0, 1, k_features, panel, bias, y, n_features, p * NR, pf, pf_bytes, bf16); break;
        case 2: micro_tile(x, m0, 2, k_features, panel, bias, y, n_features, p * NR, pf, pf_bytes, bf16); break;
        case 3: micro_tile(x, m0, 3, k_features, panel, bias, y, n_features, p * NR, pf, pf_bytes, bf16); break;
        case 4: micro_tile(x, m0, 4, k_features, panel, bias, y, n_features, p * NR, pf, pf_bytes, bf16); break;
        case 5: micro_tile(x, m0, 5, k_features, panel, bias, y, n_features, p * NR, pf, pf_bytes, bf16); break;
        default: micro_tile(x, m0, MR, k_features, panel, bias, y, n_features, p * NR, pf, pf_bytes, bf16); break;
        }
    }
}

static inline __attribute__((always_inline)) void gemm(
    const float *x, int64_t m_rows, int64_t k_features, const void *panels, const void *bias, void *y,
    int64_t n_features, int num_threads, const int bf16)
{
    const int64_t n_panels = (n_features + NR - 1) / NR;
    const size_t panel_bytes = (size_t)k_features * NR * (bf16 ? sizeof(bf16_t) : sizeof(float));
    if (m_rows <= CHUNK) {  /* a decode step: the threads split the panels */
        #pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < n_panels; p++)
            panel_rows(x, 0, m_rows, k_features, panels, panel_bytes, p, p + 1 < n_panels, bias, y, n_features, bf16);
        return;
    }
    /* prefill: each thread its own rows (whole micro-tiles, as even as they split), CHUNK at a time
       against every panel */
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num(), tiles = (m_rows + MR - 1) / MR;
        const int64_t r0 = tiles * t / threads * MR, r1 = tiles * (t + 1) / threads * MR;
        const int64_t end = r1 < m_rows ? r1 : m_rows;
        for (int64_t c0 = r0; c0 < end; c0 += CHUNK) {
            const int64_t c1 = c0 + CHUNK < end ? c0 + CHUNK : end;
            for (int64_t p = 0; p < n_panels; p++)
                panel_rows(x, c0, c1, k_features, panels, panel_bytes, p, p + 1 < n_panels, bias, y, n_features,
                           bf16);
        }
    }
}

/* x [m_rows, k] float32; panels [ceil(n / NR), k, NR] float32; bias [n] float32 or NULL;
   y [m_rows, n] float32; all contiguous */
void tessera_gemm_f32(const float *x, int64_t m_rows, int64_t k_features, const float *panels,
                      const float *bias, float *y, int64_t n_features, int num_threads)
{
    gemm(x, m_rows, k_features, panels, bias, y, n_features, num_threads, 0);
}

/* the same with bfloat16 panels, bias and y (raw bits, uint16); x float32 */
void tessera_gemm_bf16(const float *x, int64_t m_rows, int64_t k_features, const bf16_t *panels,
                       const bf16_t *bias, bf16_t *y, int64_t n_features, int num_threads)
{
    gemm(x, m_rows, k_features, panels, bias, y, n_features, num_threads, 1);
}

int64_t tessera_gemm_panel_width(void) { return NR; }

/* "avx2" where the AVX2 + FMA micro-kernel was compiled (the compiler targets such a CPU and
   TESSERA_PORTABLE is not defined), else "portable" (scalar FMAs: slower than MKL; linear.py's
   auto keeps torch then) */
const char *tessera_gemm_variant(void)
{
    return GEMM_AVX2 ? "avx2" : "portable";
}
