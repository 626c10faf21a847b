/* GEMM against GGUF block-quantized weights: y[M][N] = x[M][K] . W[N][K]^T (+ bias[N]), W read as
 * the quantized bytes, never widened to a float32 copy.
 *
 * Built and loaded with the other kernels by services/decoder/kernels/native.py; called by
 * services/decoder/quant.py (`QuantizedWeight`).
 *
 * Formats: ggml's block layouts (llama.cpp ggml-common.h; the `gguf` package's quants.py dequantizes
 * the same bytes), little-endian, f16 = IEEE half:
 *
 *     Q8_0   32 weights /  34 bytes  f16 d | int8 qs[32]                  w = d q
 *     Q4_0   32 weights /  18 bytes  f16 d | u8 qs[16]                    w = d (nibble - 8)
 *     Q4_1   32 weights /  20 bytes  f16 d | f16 m | u8 qs[16]            w = d nibble + m
 *            (weight j < 16: qs[j] & 15; j >= 16: qs[j - 16] >> 4)
 *     Q4_K  256 weights / 144 bytes  f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
 *            8 sub-blocks of 32 with 6-bit (sc, mn) (get_scale_min_k4): w = (d sc) nibble - dmin mn;
 *            64 weights per 32 bytes of qs: low nibbles the even sub-block, high the odd one
 *     Q6_K  256 weights / 210 bytes  u8 ql[128] | u8 qh[64] | int8 scales[16] | f16 d
 *            w = (d scales[j / 16]) (q6 - 32), q6 = 4 bits of ql | 2 bits of qh << 4
 *
 * W is N rows of row_bytes = ceil(K / block) * block_bytes; weights of a row's last block past K are
 * ignored (x is read up to K only).
 *
 * Loop order. Threads (OpenMP) take contiguous ranges of output columns, so each streams its own
 * weight rows front to back, prefetched PF_BYTES ahead (decode_step.c's GEMV measured 8 KB best).
 * Rows of x are taken TILE at a time (a tile of x stays in L2); within a tile, each weight row meets
 * the x rows GROUP at a time, a block decoded in registers and summed into every row's accumulators.
 * The weight row comes from memory for the first group and from L1 for the others.
 *
 * Exact mode (fast = 0): each weight is widened to the float32 value gguf's dequantize gives
 * (Q4_x / Q4_K through a 16-entry table per (sub-)block, _mm512_permutexvar_ps), then fused
 * multiply-adds with float32 x into float32 sums: the result is the float64 product of the
 * dequantized weights up to float32 summation error (tests: within 1e-5 of sum_k |x||w|). Q4_0 / Q4_1
 * under AVX-512 BW + VNNI instead sum n x per block and scale once: d sum(n x) (+ m sum x), the same
 * bound.
 *
 * Fast mode (fast = 1): x is quantized once per call to int8 per 32-element block, as llama.cpp's
 * quantize_row_q8_0 (d_x = max|x| / 127, q = roundf(x / d_x); d_x kept in float32), and each
 * 32-weight (sub-)block is an exact integer dot product (AVX512-VNNI / AVX-VNNI VPDPBUSD, AVX2
 * VPMADDUBSW, portable int loops) scaled by float32 (d_w d_x); the additive term of Q4_1 / Q4_K uses
 * the sum of the quantized x block (as llama.cpp's q8_1). Every format has the fast path, Q4_K and
 * Q6_K included (Q6_K's two scales per 32 weights applied per 16-lane half). Conformance rule:
 *
 *     |y_fast - y_exact| <= sum over x blocks b of (d_x,b / 2) * sum_{k in b} |w_k|  (1 + 1e-5)
 *                           + 1e-5 * sum_k |x_k| |w_k|
 *
 * (each x value moves by at most half a quantization step; the rest is float32 rounding).
 *
 * Variants (tessera_qgemm_variant): exact mode is AVX-512F code where the compiler targets it, else
 * portable (a block decoded to a float buffer, `omp simd` sums); fast mode is "avx512-vnni",
 * "avx-vnni", AVX2 maddubs or portable int loops. TESSERA_PORTABLE forces the portable code of both.
 *
 * Fast mode under AVX-512 BW + VNNI runs every format in register tiles (fast_columns): x quantized
 * once per call into 4-block groups, 4 x rows by 4 weight rows at a time, Q4_K / Q6_K groups being
 * half super-blocks. SmolLM2-135M's 211 projections of one step (bench/quant_gemm.py, 2-core VM,
 * medians) went, at 1 row / 32 rows: Q8_0 11.0 / 111 -> 7.8 / 48 ms, Q4_0 7.8 / 101 -> 5.6 / 43, Q4_1
 * 8.6 / 112 -> 5.9 / 49, Q4_K 16.3 / 221 -> 6.5 / 60, Q6_K 18.5 / 227 -> 9.5 / 70 (torch float32: 20-28
 * / 60-88). A prefill's products run there too (quant.py): 1.4-2.1x decoding the weight for MKL at 64-128
 * rows, about even at 256 for the K-quants.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(TESSERA_PORTABLE) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && !defined(TESSERA_PORTABLE)
#define QX_AVX512 1
#else
#define QX_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(TESSERA_PORTABLE)
#define QF_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define QF_NAME "vnni"
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define QF_NAME "vnni"
#else
#define DPBUSD(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define QF_NAME "avx2"
#endif
#else
#define QF_AVX2 0
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  /* GGML type ids */

#define TILE 32          /* rows of x per tile: the weights are read once per tile */
#define GROUP 4          /* rows of x summed together from one decoded block */
#define PF_BYTES 8192    /* weight stream prefetch distance (decode_step.c) */
#define PF_LOCALITY 2
#define QUANTIZE_PARALLEL 65536  /* x values from which fast mode quantizes x with every thread */

#define BLOCK_SIZE(t) ((t) == Q4_K || (t) == Q6_K ? 256 : 32)
#define BLOCK_BYTES(t) ((t) == Q8_0 ? 34 : (t) == Q4_0 ? 18 : (t) == Q4_1 ? 20 : (t) == Q4_K ? 144 : 210)
#define SUPPORTED(t) ((t) == Q8_0 || (t) == Q4_0 || (t) == Q4_1 || (t) == Q4_K || (t) == Q6_K)

int64_t tessera_qblock_size(int64_t qtype) { return SUPPORTED(qtype) ? BLOCK_SIZE(qtype) : 0; }
int64_t tessera_qblock_bytes(int64_t qtype) { return SUPPORTED(qtype) ? BLOCK_BYTES(qtype) : 0; }

static inline float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__) && !defined(TESSERA_PORTABLE)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact */
        const float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = sign | (exp == 0x1f ? 0x7f800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Q4_K sub-block j's 6-bit scale and min (ggml's get_scale_min_k4) */
static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn)
{
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* weights [32 sub, 32 sub + 32) of a block as w = a[j / 16] * q[j] + bias: the one description of
   every format that the portable code (and dequantization) reads */
static inline void sub_ints(const int qtype, const uint8_t *b, int sub, int8_t q[32], float a[2], float *bias)
{
    *bias = 0.f;
    switch (qtype) {
    case Q8_0:
        a[0] = a[1] = f16_at(b);
        memcpy(q, b + 2, 32);
        break;
    case Q4_0:
    case Q4_1: {
        const uint8_t *qs = b + (qtype == Q4_0 ? 2 : 4);
        a[0] = a[1] = f16_at(b);
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((qs[j] & 0xF) - (qtype == Q4_0 ? 8 : 0));
            q[j + 16] = (int8_t)((qs[j] >> 4) - (qtype == Q4_0 ? 8 : 0));
        }
        if (qtype == Q4_1)
            *bias = f16_at(b + 2);
        break;
    }
    case Q4_K: {
        int sc, mn;
        scale_min_k4(b + 4, sub, &sc, &mn);
        a[0] = a[1] = f16_at(b) * (float)sc;
        *bias = -(f16_at(b + 2) * (float)mn);
        const uint8_t *qs = b + 16 + 32 * (sub / 2);
        for (int j = 0; j < 32; j++)
            q[j] = (int8_t)((qs[j] >> (4 * (sub & 1))) & 0xF);
        break;
    }
    default: {  /* Q6_K */
        const int h = sub / 4, g = sub % 4;
        const uint8_t *ql = b + 64 * h + 32 * (g & 1), *qh = b + 128 + 32 * h;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = f16_at(b + 208);
        a[0] = d * (float)scales[8 * h + 2 * g], a[1] = d * (float)scales[8 * h + 2 * g + 1];
        for (int j = 0; j < 32; j++)
            q[j] = (int8_t)((((ql[j] >> (g >= 2 ? 4 : 0)) & 0xF) | (((qh[j] >> (2 * g)) & 3) << 4)) - 32);
        break;
    }
    }
}

/* a whole block as float32, the values gguf's dequantize gives */
static void decode_block(const int qtype, const uint8_t *b, float *out)
{
    for (int sub = 0; sub < BLOCK_SIZE(qtype) / 32; sub++) {
        int8_t q[32];
        float a[2], bias;
        sub_ints(qtype, b, sub, q, a, &bias);
        for (int j = 0; j < 32; j++)
            out[32 * sub + j] = a[j / 16] * (float)q[j] + bias;  /* the product is exact but for Q6_K */
    }
}

#if QX_AVX512
/* weights [32 sub, 32 sub + 32) of a block as two float32 vectors */
static inline __attribute__((always_inline)) void decode32(const int qtype, const uint8_t *b, int sub,
                                                           __m512 *lo, __m512 *hi)
{
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (qtype == Q8_0) {
        const __m512 d = _mm512_set1_ps(f16_at(b));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))));
    } else if (qtype == Q4_0 || qtype == Q4_1) {  /* a nibble indexes a table of its 16 values */
        const __m512 d = _mm512_set1_ps(f16_at(b));
        const __m512 table = qtype == Q4_0 ? _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)))
                                           : _mm512_fmadd_ps(d, iota, _mm512_set1_ps(f16_at(b + 2)));
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (qtype == Q4_0 ? 2 : 4))));
        *lo = _mm512_permutexvar_ps(v, table);  /* reads the index's low 4 bits only */
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    } else if (qtype == Q4_K) {
        int sc, mn;
        scale_min_k4(b + 4, sub, &sc, &mn);
        const __m512 table = _mm512_fmsub_ps(_mm512_set1_ps(f16_at(b) * (float)sc), iota,
                                             _mm512_set1_ps(f16_at(b + 2) * (float)mn));
        const uint8_t *qs = b + 16 + 32 * (sub / 2);
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
        if (sub & 1)
            v0 = _mm512_srli_epi32(v0, 4), v1 = _mm512_srli_epi32(v1, 4);
        *lo = _mm512_permutexvar_ps(v0, table);
        *hi = _mm512_permutexvar_ps(v1, table);
    } else {  /* Q6_K */
        const int h = sub / 4, g = sub % 4;
        const uint8_t *ql = b + 64 * h + 32 * (g & 1), *qh = b + 128 + 32 * h;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = f16_at(b + 208);
        const __m512i mask4 = _mm512_set1_epi32(0xF), mask2 = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
        __m512 out[2];
        for (int half = 0; half < 2; half++) {
            const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16 * half)));
            const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * half)));
            const __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(l, g >= 2 ? 4 : 0), mask4),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 2 * g), mask2), 4));
            out[half] = _mm512_mul_ps(_mm512_set1_ps(d * (float)scales[8 * h + 2 * g + half]),
                                      _mm512_cvtepi32_ps(_mm512_sub_epi32(q, bias)));
        }
        *lo = out[0], *hi = out[1];
    }
}
#endif

/* sums[r] = sum_k x[r][k] w[k] for r < nr (nr <= GROUP, a constant after inlining) over one weight
   row; `pf`: prefetch the stream ahead (the group that reads the row from memory) */
static inline __attribute__((always_inline)) void exact_dot(
    const int qtype, const int nr, const float *x, int64_t k, const uint8_t *w, float *sums, const int pf)
{
    const int bs = BLOCK_SIZE(qtype), bb = BLOCK_BYTES(qtype);
    const int64_t blocks = (k + bs - 1) / bs;
#if QX_AVX512
    __m512 acc[GROUP][2];
    for (int r = 0; r < GROUP; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w + i * bb;
        if (pf)
            for (int at = 0; at < bb; at += 64)
                __builtin_prefetch(b + PF_BYTES + at, 0, PF_LOCALITY);
        for (int sub = 0; sub < bs / 32; sub++) {
            const int64_t k0 = i * bs + 32 * sub;
            if (k0 >= k)
                break;
            __m512 lo, hi;
            decode32(qtype, b, sub, &lo, &hi);
            if (k0 + 32 <= k) {
                for (int r = 0; r < nr; r++) {
                    acc[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * k + k0), acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * k + k0 + 16), acc[r][1]);
                }
            } else {  /* past K: masked-off lanes load zeros, weights included */
                const int64_t left = k - k0;
                const __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1u);
                const __mmask16 m1 = left > 16 ? (__mmask16)((1u << (left - 16)) - 1u) : 0;
                lo = _mm512_maskz_mov_ps(m0, lo), hi = _mm512_maskz_mov_ps(m1, hi);
                for (int r = 0; r < nr; r++) {
                    acc[r][0] = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(m0, x + r * k + k0), acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(m1, x + r * k + k0 + 16), acc[r][1]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#else
    float s[GROUP] = {0.f};
    float wf[256];
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w + i * bb;
        if (pf)
            for (int at = 0; at < bb; at += 64)
                __builtin_prefetch(b + PF_BYTES + at, 0, PF_LOCALITY);
        decode_block(qtype, b, wf);
        const int64_t k0 = i * bs, len = k - k0 < bs ? k - k0 : bs;
        for (int r = 0; r < nr; r++) {
            const float *xr = x + r * k + k0;
            float part = 0.f;
            #pragma omp simd reduction(+:part)
            for (int64_t j = 0; j < len; j++)
                part += wf[j] * xr[j];
            s[r] += part;
        }
    }
    for (int r = 0; r < nr; r++)
        sums[r] = s[r];
#endif
}

/* x quantized per 32-element block (fast mode): d * q[j] ~ x[j], s = d * sum_j q[j] */
typedef struct {
    float d, s;
    int8_t q[32];
} xblock_t;

/* x's 32-value block xb (len of them exist, the rest read as 0) as llama.cpp's quantize_row_q8_0
   rounds it: *d = max|x| / 127, q[j] = roundf(x[j] / d) (half away from zero); returns sum q */
static inline int quantize_block(const float *xb, int64_t len, int8_t q[32], float *d)
{
#if QX_AVX512
    const __mmask16 m0 = len >= 16 ? 0xFFFF : (__mmask16)((1u << len) - 1u);
    const __mmask16 m1 = len >= 32 ? 0xFFFF : len > 16 ? (__mmask16)((1u << (len - 16)) - 1u) : 0;
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, xb), v1 = _mm512_maskz_loadu_ps(m1, xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    *d = amax / 127.f;
    const __m512 id = _mm512_set1_ps(*d != 0.f ? 1.f / *d : 0.f);
    const __m512 one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(.5f);
    __m512i total = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512 v = _mm512_mul_ps(h ? v1 : v0, id);
        /* roundf: to nearest, ties away from zero (VRNDSCALE's nearest is ties to even) */
        const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __mmask16 tie = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_EQ_OQ);
        __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_mask_add_ps(r, tie, t, _mm512_or_ps(one, _mm512_and_ps(v, _mm512_set1_ps(-0.f))));
        const __m512i qi = _mm512_cvtps_epi32(r);
        total = _mm512_add_epi32(total, qi);
        _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtepi32_epi8(qi));
    }
    return _mm512_reduce_add_epi32(total);
#else
    float amax = 0.f;
    for (int64_t j = 0; j < len; j++)
        amax = fmaxf(amax, fabsf(xb[j]));
    *d = amax / 127.f;
    const float id = *d != 0.f ? 1.f / *d : 0.f;
    int sum = 0;
    for (int64_t j = 0; j < 32; j++)
        q[j] = (int8_t)(j < len ? roundf(xb[j] * id) : 0.f), sum += q[j];
    return sum;
#endif
}

static void quantize_x(const float *x, int64_t m, int64_t k, xblock_t *out, int num_threads)
{
    const int64_t nb = (k + 31) / 32;
    /* a decode step's few rows take a microsecond: less than waking the team for them */
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * k >= QUANTIZE_PARALLEL)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < nb; i++) {
            xblock_t *o = out + r * nb + i;
            const int64_t len = k - 32 * i < 32 ? k - 32 * i : 32;
            const int sum = quantize_block(x + r * k + 32 * i, len, o->q, &o->d);
            o->s = o->d * (float)sum;
        }
    }
}

#if QF_AVX2
/* weights [32 sub, 32 sub + 32) as signed int8 and the per-lane scale of an 8-lane int32 dot product
   (lanes 0-3 sum weights 0-15, lanes 4-7 weights 16-31); *bias as sub_ints */
static inline __attribute__((always_inline)) __m256i fast32(const int qtype, const uint8_t *b, int sub,
                                                             __m256 *scale, float *bias)
{
    const __m256i mask4 = _mm256_set1_epi8(0xF);
    *bias = 0.f;
    if (qtype == Q8_0) {
        *scale = _mm256_set1_ps(f16_at(b));
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
    if (qtype == Q4_0 || qtype == Q4_1) {
        *scale = _mm256_set1_ps(f16_at(b));
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + (qtype == Q4_0 ? 2 : 4)));
        const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), mask4);
        if (qtype == Q4_1)
            *bias = f16_at(b + 2);
        return qtype == Q4_0 ? _mm256_sub_epi8(nib, _mm256_set1_epi8(8)) : nib;
    }
    if (qtype == Q4_K) {
        int sc, mn;
        scale_min_k4(b + 4, sub, &sc, &mn);
        *scale = _mm256_set1_ps(f16_at(b) * (float)sc);
        *bias = -(f16_at(b + 2) * (float)mn);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (sub / 2)));
        return _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(q, 4) : q, mask4);
    }
    const int h = sub / 4, g = sub % 4;  /* Q6_K */
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = f16_at(b + 208);
    *scale = _mm256_set_m128(_mm_set1_ps(d * (float)scales[8 * h + 2 * g + 1]),
                             _mm_set1_ps(d * (float)scales[8 * h + 2 * g]));
    const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (g & 1)));
    const __m256i u = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m256i lo4 = _mm256_and_si256(g >= 2 ? _mm256_srli_epi16(l, 4) : l, mask4);
    const __m256i hi2 = _mm256_and_si256(_mm256_srli_epi16(u, 2 * g), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo4, _mm256_slli_epi16(hi2, 4)), _mm256_set1_epi8(32));
}
#endif

/* sums[r] for r < nr over one weight row, x quantized (xq: the group's first row, nb blocks a row) */
static inline __attribute__((always_inline)) void fast_dot(
    const int qtype, const int nr, const xblock_t *xq, int64_t nb, int64_t k, const uint8_t *w, float *sums,
    const int pf)
{
    const int bs = BLOCK_SIZE(qtype), bb = BLOCK_BYTES(qtype);
    const int64_t blocks = (k + bs - 1) / bs;
    float extra[GROUP] = {0.f};  /* the additive terms: bias * d_x sum q_x */
#if QF_AVX2
    __m256 acc[GROUP];
    for (int r = 0; r < GROUP; r++)
        acc[r] = _mm256_setzero_ps();
#else
    float acc[GROUP] = {0.f};
#endif
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w + i * bb;
        if (pf)
            for (int at = 0; at < bb; at += 64)
                __builtin_prefetch(b + PF_BYTES + at, 0, PF_LOCALITY);
        for (int sub = 0; sub < bs / 32; sub++) {
            const int64_t xi = i * (bs / 32) + sub;  /* the x block: zeros past K */
            if (xi >= nb)
                break;
            float bias;
#if QF_AVX2
            __m256 scale;
            const __m256i wq = fast32(qtype, b, sub, &scale, &bias);
            const __m256i aw = _mm256_sign_epi8(wq, wq);  /* |w| as unsigned, the sign moved onto x */
            for (int r = 0; r < nr; r++) {
                const xblock_t *xb = xq + r * nb + xi;
                const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->q), wq);
                const __m256i dot = DPBUSD(_mm256_setzero_si256(), aw, xv);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(xb->d)), acc[r]);
                if (qtype == Q4_1 || qtype == Q4_K)
                    extra[r] += bias * xb->s;
            }
#else
            int8_t q[32];
            float a[2];
            sub_ints(qtype, b, sub, q, a, &bias);
            for (int r = 0; r < nr; r++) {
                const xblock_t *xb = xq + r * nb + xi;
                int32_t lo = 0, hi = 0;
                for (int j = 0; j < 16; j++)
                    lo += q[j] * xb->q[j], hi += q[j + 16] * xb->q[j + 16];
                acc[r] += xb->d * (a[0] * (float)lo + a[1] * (float)hi);
                extra[r] += bias * xb->s;
            }
#endif
        }
    }
    for (int r = 0; r < nr; r++) {
#if QF_AVX2
        const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        sums[r] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) + extra[r];
#else
        sums[r] = acc[r] + extra[r];
#endif
    }
}

/* ---- 4-block groups (Q8_0, Q4_0, Q4_1 where AVX-512 BW + VNNI are targeted) ----
 * A row's blocks are taken four at a time (128 weights): their 64 bytes of weights gathered into two
 * 512-bit vectors whose 128-bit lane b holds block b's weights (Q4_x: lane b of A the low nibbles =
 * weights 0-15, of B the high ones = 16-31; Q8_0: A weights 0-15, B 16-31), so that int32 (or
 * float32) lane l belongs to block l / 4, and the four f16 scales come as one vector [d0 x4, .. d3 x4]
 * (VPERMW + VCVTPH2PS). x is laid out to match once per call (`fgroup_t` / `egroup_t`, zeros past K):
 * each block's scale is applied to lane sums, once per four blocks; a row's last 1-3 blocks are read
 * with masked loads (the absent ones read as zeros, scale 0). Used by fast mode (Q8_0 weights + 128
 * and Q4_0 nibbles as VPDPBUSD's unsigned operand, the offset taken off by the precomputed per-lane
 * x sums the dot products start from) and by exact mode for Q4_x (a nibble's float32 value from a
 * 16-entry table by VPERMPS, w = d n (+ m) as d sum(n x) (+ m sum x)); exact Q8_0 keeps decode32.
 * (VBMI's two-source byte permutes for the gathers measured slower than 128-bit loads + inserts.) */
#if QX_AVX512 && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q512 1
#else
#define Q512 0
#endif
#define QUAD(t) ((t) == Q8_0 || (t) == Q4_0 || (t) == Q4_1)
#define TILED(t) (QUAD(t) || (t) == Q4_K || (t) == Q6_K)  /* fast mode's register tiles (fast_columns) */

#if Q512
static const uint16_t WORDS_Q4_0[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 9, 9, 9, 9, 18, 18, 18, 18, 27, 27, 27, 27, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
static const uint16_t WORDS_Q4_1_D[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 10, 10, 10, 10, 20, 20, 20, 20, 30, 30, 30, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
static const uint16_t WORDS_Q4_1_M[32] __attribute__((aligned(64))) = {1, 1, 1, 1, 11, 11, 11, 11, 21, 21, 21, 21, 31, 31, 31, 31, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
static const uint16_t WORDS_4[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

/* fast mode's x, one group of 4 blocks of one row: q as the weight vectors (A's x then B's), corr
   -c * (lane's x bytes summed) with c the offset that makes the weights unsigned (Q8_0: 128, Q4_0: 8,
   Q6_K: 32, Q4_1 / Q4_K: 0), dx the x scales [d0 x4, ..], sx (Q4_1 / Q4_K) d sum q at lane 4 b. Q6_K
   scales A's and B's 16 weights apart, so its corr is A's x bytes only and B's are in corr_b, which
   shares sx's place (Q6_K has no additive term) */
typedef struct {
    int8_t q[128];
    int32_t corr[16];
    float dx[16];
    union {
        float sx[16];
        int32_t corr_b[16];
    };
} __attribute__((aligned(64))) fgroup_t;

/* exact mode's x (Q4_x), one group: x[16 t + l] the x value of weight nibble t of lane l's dword
   (block l / 4), xs (Q4_1) the block's sum of x at lane 4 b */
typedef struct {
    float x[128], xs[16];
} __attribute__((aligned(64))) egroup_t;

/* 64 bytes from p + off of which the first av - off exist (fewer: zeros) */
static inline __attribute__((always_inline)) __m512i load_part(const uint8_t *p, int off, int av)
{
    if (av >= off + 64)
        return _mm512_loadu_si512((const void *)(p + off));
    const int n = av - off;
    return _mm512_maskz_loadu_epi8(n <= 0 ? 0 : (__mmask64)((1ULL << n) - 1), p + off);
}

/* 16 bytes at p + off + stride b into lane b, of which the first av - (off + stride b) exist */
static inline __attribute__((always_inline)) __m512i gather4(const uint8_t *p, int off, int stride, int av)
{
    __m128i part[4];
    for (int b = 0; b < 4; b++) {
        const int at = off + stride * b, n = av - at;
        part[b] = n >= 16 ? _mm_loadu_si128((const __m128i *)(p + at))
                          : _mm_maskz_loadu_epi8(n <= 0 ? 0 : (__mmask16)((1u << n) - 1u), p + at);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(part[1], part[0])),
                              _mm256_set_m128i(part[3], part[2]), 1);
}

/* the group at p (av of its bytes exist): weights A, B as described (raw: Q8_0 signed, Q4_x the
   bytes of nibbles, split by the caller), scales dw and (Q4_1) mins mw, lanes by block */
static inline __attribute__((always_inline)) void group_weights(
    const int qtype, const uint8_t *p, const int av, __m512i *a, __m512i *b, __m512 *dw, __m512 *mw)
{
    if (qtype == Q8_0) {  /* the scales 34 bytes apart: four scalar loads */
        uint64_t d = 0;
        for (int b = 0; b < 4; b++) {
            uint16_t h = 0;
            if (34 * b + 2 <= av)
                memcpy(&h, p + 34 * b, 2);
            d |= (uint64_t)h << (16 * b);
        }
        *a = gather4(p, 2, 34, av), *b = gather4(p, 18, 34, av);
        *dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(
            _mm512_load_si512((const void *)WORDS_4), _mm512_castsi128_si512(_mm_cvtsi64_si128((long long)d)))));
    } else {
        const __m512i l0 = load_part(p, 0, av);
        *a = qtype == Q4_0 ? gather4(p, 2, 18, av) : gather4(p, 4, 20, av);
        *b = *a;
        *dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(
            _mm512_load_si512((const void *)(qtype == Q4_0 ? WORDS_Q4_0 : WORDS_Q4_1_D)), l0)));
        if (qtype == Q4_1)
            *mw = _mm512_cvtph_ps(_mm512_castsi512_si256(
                _mm512_permutexvar_epi16(_mm512_load_si512((const void *)WORDS_Q4_1_M), l0)));
    }
}

static void prep_fast(const int qtype, const float *x, int64_t m, int64_t k, fgroup_t *out, int num_threads)
{
    const int64_t nb = (k + 31) / 32, ng = (nb + 3) / 4;
    const int c = qtype == Q8_0 ? 128 : qtype == Q4_0 ? 8 : qtype == Q6_K ? 32 : 0;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * k >= QUANTIZE_PARALLEL)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < ng; g++) {
            fgroup_t *o = out + r * ng + g;
            memset(o, 0, sizeof *o);
            for (int bi = 0; bi < 4 && 4 * g + bi < nb; bi++) {
                const int64_t i = 4 * g + bi;
                const int64_t len = k - 32 * i < 32 ? k - 32 * i : 32;
                int8_t q[32];
                float d;
                const int sum = quantize_block(x + r * k + 32 * i, len, q, &d);
                memcpy(o->q + 16 * bi, q, 16);
                memcpy(o->q + 64 + 16 * bi, q + 16, 16);
                for (int l = 0; l < 4; l++) {
                    int lane_a = 0, lane_b = 0;
                    for (int j = 0; j < 4; j++)
                        lane_a += q[4 * l + j], lane_b += q[16 + 4 * l + j];
                    o->corr[4 * bi + l] = -c * (qtype == Q6_K ? lane_a : lane_a + lane_b);
                    o->dx[4 * bi + l] = d;
                    if (qtype == Q6_K)
                        o->corr_b[4 * bi + l] = -c * lane_b;
                }
                if (qtype != Q6_K)
                    o->sx[4 * bi] = d * (float)sum;
            }
        }
    }
}

static void prep_exact(const float *x, int64_t m, int64_t k, egroup_t *out, int num_threads)
{
    const int64_t nb = (k + 31) / 32, ng = (nb + 3) / 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (m * k >= QUANTIZE_PARALLEL)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < ng; g++) {
            egroup_t *o = out + r * ng + g;
            memset(o->xs, 0, sizeof o->xs);
            for (int t = 0; t < 8; t++) {
                for (int l = 0; l < 16; l++) {
                    const int64_t at = 32 * (4 * g + l / 4) + 4 * (l % 4) + t / 2 + (t & 1 ? 16 : 0);
                    o->x[16 * t + l] = at < k ? x[r * k + at] : 0.f;
                }
            }
            for (int bi = 0; bi < 4; bi++) {
                float s = 0.f;
                for (int64_t j = 32 * (4 * g + bi); j < 32 * (4 * g + bi + 1) && j < k; j++)
                    s += x[r * k + j];
                o->xs[4 * bi] = s;
            }
        }
    }
}

/* one group of exact mode (Q4_x) */
static inline __attribute__((always_inline)) void exact_group(
    const int qtype, const int nr, const egroup_t *xg, int64_t ng, const uint8_t *p, const int av, __m512 *acc,
    __m512 *acc_min)
{
    __m512i a, b;
    __m512 dw, mw = _mm512_setzero_ps();
    group_weights(qtype, p, av, &a, &b, &dw, &mw);
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = qtype == Q4_0 ? _mm512_sub_ps(table, _mm512_set1_ps(8.f)) : table;
    __m512 w[8];  /* nibble t of every dword: permutexvar reads the index's low 4 bits only */
    w[0] = _mm512_permutexvar_ps(a, values);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), values);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 8), values);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 12), values);
    w[4] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 16), values);
    w[5] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 20), values);
    w[6] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 24), values);
    w[7] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 28), values);
    (void)b;
    for (int r = 0; r < nr; r++) {
        const float *xr = xg[r * ng].x;
        __m512 s0 = _mm512_mul_ps(w[0], _mm512_load_ps(xr)), s1 = _mm512_mul_ps(w[1], _mm512_load_ps(xr + 16));
        s0 = _mm512_fmadd_ps(w[2], _mm512_load_ps(xr + 32), s0), s1 = _mm512_fmadd_ps(w[3], _mm512_load_ps(xr + 48), s1);
        s0 = _mm512_fmadd_ps(w[4], _mm512_load_ps(xr + 64), s0), s1 = _mm512_fmadd_ps(w[5], _mm512_load_ps(xr + 80), s1);
        s0 = _mm512_fmadd_ps(w[6], _mm512_load_ps(xr + 96), s0), s1 = _mm512_fmadd_ps(w[7], _mm512_load_ps(xr + 112), s1);
        acc[r] = _mm512_fmadd_ps(_mm512_add_ps(s0, s1), dw, acc[r]);
        if (qtype == Q4_1)
            acc_min[r] = _mm512_fmadd_ps(mw, _mm512_load_ps(xg[r * ng].xs), acc_min[r]);
    }
}

/* exact mode (Q4_x): sums[r] for r < nr over one weight row in groups (xg: row r0's), blocks nb a row */
static inline __attribute__((always_inline)) void quad_dot(
    const int qtype, const int nr, const egroup_t *xg, int64_t nb, const uint8_t *w, float *sums, const int pf)
{
    const int gb = 4 * BLOCK_BYTES(qtype);
    const int64_t full = nb / 4, ng = (nb + 3) / 4;
    const int rem = (int)(nb % 4) * BLOCK_BYTES(qtype);
    __m512 acc0[GROUP], acc1[GROUP], accm[GROUP];
    for (int r = 0; r < GROUP; r++)
        acc0[r] = acc1[r] = accm[r] = _mm512_setzero_ps();
#define QUAD_GROUP(g, av, acc)                                                                               \
    do {                                                                                                     \
        if (pf)                                                                                              \
            for (int at = 0; at < gb; at += 64)                                                              \
                __builtin_prefetch(w + (g) * gb + PF_BYTES + at, 0, PF_LOCALITY);                            \
        exact_group(qtype, nr, xg + (g), ng, w + (g) * gb, av, acc, accm);                                   \
    } while (0)
    int64_t g = 0;
    for (; g + 2 <= full; g += 2) {
        QUAD_GROUP(g, gb, acc0);
        QUAD_GROUP(g + 1, gb, acc1);
    }
    if (g < full) {
        QUAD_GROUP(g, gb, acc0);
        g++;
    }
    if (rem)
        QUAD_GROUP(g, rem, acc1);
#undef QUAD_GROUP
    for (int r = 0; r < nr; r++)
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[r], acc1[r]), accm[r]));
}


/* ---- register tiles (fast mode, 4-block groups) ----
 * FR rows of x by FC weight rows at a time: each group of the FC weight rows is decoded once for FR x
 * rows, and each x group is loaded once for FC weight rows, so an x tile streams from L2 FC times
 * less often than one weight row at a time would read it (quad_dot: the x bytes, 2.5x the Q8_0
 * weights', bounded the GEMM at M >= 4). The FC sums of an x row are reduced together (reduce4). */
#define FR 4
#define FC 4

/* [sum a, sum b, sum c, sum d] */
static inline __attribute__((always_inline)) __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Q4_K as 4-block groups: group g is half h = g % 2 of super-block g / 2 (sub-blocks 4h..4h+3), read
   whole (a row holds whole super-blocks). Its 64 bytes of qs hold sub-blocks 4h, 4h+1 in the low / high
   nibbles of bytes 0-31 and 4h+2, 4h+3 in those of bytes 32-63, so lane b of A (weights 0-15) is bytes
   [0, 16) or [32, 48) and of B (16-31) bytes [16, 32) or [48, 64), low nibbles for even b; the scales
   d sc_b and mins -(dmin mn_b) (get_scale_min_k4) as Q4_1's, lanes by sub-block */
static inline __attribute__((always_inline)) void group_weights_q4k(
    const uint8_t *row, int64_t g, __m512i *a, __m512i *b, __m512 *dw, __m512 *mw)
{
    const uint8_t *sb = row + (g / 2) * 144;
    const int half = (int)(g & 1);
    /* get_scale_min_k4 for sub-blocks 4 half + j, j < 4, four bytes at a time (bytes 0-3, 4-7, 8-11
       of the 12 scale bytes; (x >> 6) << 4 of each byte is (x >> 2) & 0x30) */
    uint32_t s03, s47, s811, sc, mn;
    memcpy(&s03, sb + 4, 4), memcpy(&s47, sb + 8, 4), memcpy(&s811, sb + 12, 4);
    if (half == 0) {
        sc = s03 & 0x3F3F3F3Fu, mn = s47 & 0x3F3F3F3Fu;
    } else {
        sc = (s811 & 0x0F0F0F0Fu) | ((s03 >> 2) & 0x30303030u);
        mn = ((s811 >> 4) & 0x0F0F0F0Fu) | ((s47 >> 2) & 0x30303030u);
    }
    const __m128 scf = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)sc)));
    const __m128 mnf = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)mn)));
    const __m512i by_block = _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i *)WORDS_4));
    *dw = _mm512_permutexvar_ps(by_block, _mm512_castps128_ps512(_mm_mul_ps(_mm_set1_ps(f16_at(sb)), scf)));
    *mw = _mm512_permutexvar_ps(by_block, _mm512_castps128_ps512(_mm_mul_ps(_mm_set1_ps(-f16_at(sb + 2)), mnf)));
    const __m512i v = _mm512_loadu_si512((const void *)(sb + 16 + 64 * half));
    const __m512i mask4 = _mm512_set1_epi8(0xF);
    const __m512i ra = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(2, 2, 0, 0));  /* bytes [0,16) x2, [32,48) x2 */
    const __m512i rb = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 3, 1, 1));  /* [16,32) x2, [48,64) x2 */
    *a = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(ra, mask4), _mm512_and_si512(_mm512_srli_epi16(ra, 4), mask4));
    *b = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(rb, mask4), _mm512_and_si512(_mm512_srli_epi16(rb, 4), mask4));
}

/* Q6_K as 4-block groups: group g is half h = g % 2 of super-block g / 2 (sub-blocks 4h + j, j < 4),
   read whole. Sub-block j's 4 low bits are the low (j < 2) or high nibbles of ql bytes 64h + 32(j & 1)
   + [0, 32), its 2 high bits bits 2j, 2j + 1 of qh bytes 128 + 32h + [0, 32): lane b of A (weights 0-15)
   takes the first 16 of each, of B the last 16; the values q6 in [0, 64) (the -32 in the x sums, c = 32
   in prep_fast); scales d scales[8h + 2j] for A's lanes of block j, d scales[8h + 2j + 1] for B's */
static const uint16_t SHIFTS_Q6[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6};
static const uint32_t SCALES_Q6_A[16] __attribute__((aligned(64))) = {0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6};
static const uint32_t SCALES_Q6_B[16] __attribute__((aligned(64))) = {1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7};

static inline __attribute__((always_inline)) void group_weights_q6k(
    const uint8_t *row, int64_t g, __m512i *a, __m512i *b, __m512 *dw_a, __m512 *dw_b)
{
    const uint8_t *sb = row + (g / 2) * 210;
    const int half = (int)(g & 1);
    const __m512i mask4 = _mm512_set1_epi8(0xF), mask2 = _mm512_set1_epi8(3);
    const __m512i l = _mm512_loadu_si512((const void *)(sb + 64 * half));
    const __m512i la = _mm512_shuffle_i64x2(l, l, _MM_SHUFFLE(2, 0, 2, 0));  /* ql [0,16) [32,48) x2 */
    const __m512i lb = _mm512_shuffle_i64x2(l, l, _MM_SHUFFLE(3, 1, 3, 1));  /* ql [16,32) [48,64) x2 */
    const __m512i na = _mm512_mask_blend_epi64(0xF0, _mm512_and_si512(la, mask4), _mm512_and_si512(_mm512_srli_epi16(la, 4), mask4));
    const __m512i nb = _mm512_mask_blend_epi64(0xF0, _mm512_and_si512(lb, mask4), _mm512_and_si512(_mm512_srli_epi16(lb, 4), mask4));
    const __m512i shifts = _mm512_load_si512((const void *)SHIFTS_Q6);
    const __m512i ha = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(sb + 128 + 32 * half)));
    const __m512i hb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(sb + 144 + 32 * half)));
    *a = _mm512_or_si512(na, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(ha, shifts), mask2), 4));
    *b = _mm512_or_si512(nb, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, shifts), mask2), 4));
    int64_t raw;
    memcpy(&raw, sb + 192 + 8 * half, 8);
    const __m512 scales = _mm512_castps256_ps512(_mm256_mul_ps(
        _mm256_set1_ps(f16_at(sb + 208)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(raw)))));
    *dw_a = _mm512_permutexvar_ps(_mm512_load_si512((const void *)SCALES_Q6_A), scales);
    *dw_b = _mm512_permutexvar_ps(_mm512_load_si512((const void *)SCALES_Q6_B), scales);
}

/* group g (av of its bytes exist) of nc weight rows (row_bytes apart, from w) against nr x rows
   (xg: row r0's groups, rows ng apart), into acc[r][c] */
static inline __attribute__((always_inline)) void tile_group(
    const int qtype, const int nr, const int nc, const fgroup_t *xg, int64_t ng, int64_t g, const uint8_t *w,
    int64_t row_bytes, const int av, __m512 acc[FR][FC], const int pf)
{
    const int gb = 4 * BLOCK_BYTES(qtype);
    __m512i a[FC], b[FC];
    __m512 dw[FC], mw[FC];
    for (int c = 0; c < nc; c++) {
        if (qtype == Q6_K) {  /* 105 bytes of a 210-byte super-block per group; mw: B's scales */
            const uint8_t *row = w + c * row_bytes;
            if (pf)
                for (int at = 0; at < 105; at += 64)
                    __builtin_prefetch(row + g * 105 + PF_BYTES + at, 0, PF_LOCALITY);
            group_weights_q6k(row, g, &a[c], &b[c], &dw[c], &mw[c]);
            continue;
        }
        if (qtype == Q4_K) {  /* 72 bytes of a 144-byte super-block per group */
            const uint8_t *row = w + c * row_bytes;
            if (pf)
                for (int at = 0; at < 72; at += 64)
                    __builtin_prefetch(row + g * 72 + PF_BYTES + at, 0, PF_LOCALITY);
            group_weights_q4k(row, g, &a[c], &b[c], &dw[c], &mw[c]);
            continue;
        }
        const uint8_t *p = w + c * row_bytes + g * gb;
        if (pf)
            for (int at = 0; at < gb; at += 64)
                __builtin_prefetch(p + PF_BYTES + at, 0, PF_LOCALITY);
        mw[c] = _mm512_setzero_ps();
        group_weights(qtype, p, av, &a[c], &b[c], &dw[c], &mw[c]);
        if (qtype == Q8_0) {
            a[c] = _mm512_xor_si512(a[c], _mm512_set1_epi8((char)0x80));
            b[c] = _mm512_xor_si512(b[c], _mm512_set1_epi8((char)0x80));
        } else {
            const __m512i mask4 = _mm512_set1_epi8(0xF);
            b[c] = _mm512_and_si512(_mm512_srli_epi16(a[c], 4), mask4), a[c] = _mm512_and_si512(a[c], mask4);
        }
    }
    for (int r = 0; r < nr; r++) {
        const fgroup_t *xr = xg + r * ng + g;
        const __m512i corr = _mm512_load_si512((const void *)xr->corr);
        const __m512i q0 = _mm512_load_si512((const void *)xr->q), q1 = _mm512_load_si512((const void *)(xr->q + 64));
        const __m512 dx = _mm512_load_ps(xr->dx);
        if (qtype == Q6_K) {
            const __m512i corr_b = _mm512_load_si512((const void *)xr->corr_b);
            for (int c = 0; c < nc; c++) {
                const __m512i dot_a = _mm512_dpbusd_epi32(corr, a[c], q0), dot_b = _mm512_dpbusd_epi32(corr_b, b[c], q1);
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_a), _mm512_mul_ps(dw[c], dx), acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_b), _mm512_mul_ps(mw[c], dx), acc[r][c]);
            }
            continue;
        }
        for (int c = 0; c < nc; c++) {
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(corr, a[c], q0), b[c], q1);
            acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[c], dx), acc[r][c]);
            if (qtype == Q4_1 || qtype == Q4_K)
                acc[r][c] = _mm512_fmadd_ps(mw[c], _mm512_load_ps(xr->sx), acc[r][c]);
        }
    }
}

/* y[r0 + r][c0 + c] for r < nr, c < nc (constants after inlining) */
static inline __attribute__((always_inline)) void fast_tile(
    const int qtype, const int nr, const int nc, const fgroup_t *xg, int64_t nb, const uint8_t *w,
    int64_t row_bytes, const float *bias, float *y, int64_t n, const int pf)
{
    const int gb = 4 * BLOCK_BYTES(qtype);
    const int super = qtype == Q4_K || qtype == Q6_K;  /* whole super-blocks: no partial group */
    const int64_t ng = (nb + 3) / 4, full = super ? ng : nb / 4;
    const int rem = super ? 0 : (int)(nb % 4) * BLOCK_BYTES(qtype);
    __m512 acc[FR][FC];
    for (int r = 0; r < FR; r++)
        for (int c = 0; c < FC; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < full; g++)
        tile_group(qtype, nr, nc, xg, ng, g, w, row_bytes, gb, acc, pf);
    if (rem)
        tile_group(qtype, nr, nc, xg, ng, full, w, row_bytes, rem, acc, pf);
    for (int r = 0; r < nr; r++) {
        float *yr = y + r * n;
        if (nc == FC) {
            const __m128 s = reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            _mm_storeu_ps(yr, bias != NULL ? _mm_add_ps(s, _mm_loadu_ps(bias)) : s);
        } else {
            for (int c = 0; c < nc; c++)
                yr[c] = _mm512_reduce_add_ps(acc[r][c]) + (bias != NULL ? bias[c] : 0.f);
        }
    }
}

/* fast mode, columns [c0, c1) of y for every row: tiles of TILE x rows, FC weight rows by FR x rows */
static inline __attribute__((always_inline)) void fast_columns(
    const int qtype, const fgroup_t *prep, int64_t m, int64_t k, const uint8_t *w, const float *bias, float *y,
    int64_t n, int64_t c0, int64_t c1)
{
    const int64_t nb = (k + 31) / 32, ng = (nb + 3) / 4;
    const int64_t row_bytes = (k + BLOCK_SIZE(qtype) - 1) / BLOCK_SIZE(qtype) * BLOCK_BYTES(qtype);
    for (int64_t t0 = 0; t0 < m; t0 += TILE) {
        const int64_t t1 = t0 + TILE < m ? t0 + TILE : m;
        for (int64_t c = c0; c < c1;) {
            const int nc = c1 - c >= FC ? FC : 1;
            const uint8_t *wc = w + c * row_bytes;
            const float *bc = bias != NULL ? bias + c : NULL;
            for (int64_t r0 = t0; r0 < t1; r0 += FR) {
                const fgroup_t *xg = prep + r0 * ng;
                float *yc = y + r0 * n + c;
                const int pf = r0 == t0;
#define TILE_ROWS(nr)                                                                                        \
    do {                                                                                                     \
        if (nc == FC)                                                                                        \
            fast_tile(qtype, nr, FC, xg, nb, wc, row_bytes, bc, yc, n, pf);                                  \
        else                                                                                                 \
            fast_tile(qtype, nr, 1, xg, nb, wc, row_bytes, bc, yc, n, pf);                                   \
    } while (0)
                switch (t1 - r0 < FR ? t1 - r0 : FR) {
                case 1: TILE_ROWS(1); break;
                case 2: TILE_ROWS(2); break;
                case 3: TILE_ROWS(3); break;
                default: TILE_ROWS(FR); break;
                }
#undef TILE_ROWS
            }
            c += nc;
        }
    }
}
#endif

/* one group's dot products (nr rows from row r0), either mode */
static inline __attribute__((always_inline)) void group_dot(
    const int qtype, const int nr, const int fast, const float *x, const xblock_t *xq, const void *prep, int64_t r0,
    int64_t k, const uint8_t *w, float *sums, const int pf)
{
    const int64_t nb = (k + 31) / 32;
#if Q512
    if (prep != NULL) {  /* exact Q4_x (fast mode with groups runs fast_columns) */
        quad_dot(qtype, nr, (const egroup_t *)prep + r0 * ((nb + 3) / 4), nb, w, sums, pf);
        return;
    }
#endif
    (void)prep;
    if (fast)
        fast_dot(qtype, nr, xq + r0 * nb, nb, k, w, sums, pf);
    else
        exact_dot(qtype, nr, x + r0 * k, k, w, sums, pf);
}

/* columns [c0, c1) of y for every row, in tiles of TILE rows and groups of GROUP */
static inline __attribute__((always_inline)) void columns(
    const int qtype, const int fast, const float *x, const xblock_t *xq, const void *prep, int64_t m, int64_t k,
    const uint8_t *w, const float *bias, float *y, int64_t n, int64_t c0, int64_t c1)
{
    const int64_t row_bytes = (k + BLOCK_SIZE(qtype) - 1) / BLOCK_SIZE(qtype) * BLOCK_BYTES(qtype);
    for (int64_t t0 = 0; t0 < m; t0 += TILE) {
        const int64_t t1 = t0 + TILE < m ? t0 + TILE : m;
        for (int64_t c = c0; c < c1; c++) {
            const uint8_t *wr = w + c * row_bytes;
            const float b = bias != NULL ? bias[c] : 0.f;
            for (int64_t r0 = t0; r0 < t1; r0 += GROUP) {
                float sums[GROUP];
                const int pf = r0 == t0;
                switch (t1 - r0 < GROUP ? t1 - r0 : GROUP) {
                case 1: group_dot(qtype, 1, fast, x, xq, prep, r0, k, wr, sums, pf); break;
                case 2: group_dot(qtype, 2, fast, x, xq, prep, r0, k, wr, sums, pf); break;
                case 3: group_dot(qtype, 3, fast, x, xq, prep, r0, k, wr, sums, pf); break;
                default: group_dot(qtype, GROUP, fast, x, xq, prep, r0, k, wr, sums, pf); break;
                }
                for (int64_t r = r0; r < t1 && r < r0 + GROUP; r++)
                    y[r * n + c] = sums[r - r0] + b;
            }
        }
    }
}

#define COLUMNS_OF(fast)                                                                                  \
    switch (qtype) {                                                                                      \
    case Q8_0: columns(Q8_0, fast, x, xq, prep, m, k, w, bias, y, n, c0, c1); break;                            \
    case Q4_0: columns(Q4_0, fast, x, xq, prep, m, k, w, bias, y, n, c0, c1); break;                            \
    case Q4_1: columns(Q4_1, fast, x, xq, prep, m, k, w, bias, y, n, c0, c1); break;                            \
    case Q4_K: columns(Q4_K, fast, x, xq, prep, m, k, w, bias, y, n, c0, c1); break;                            \
    default: columns(Q6_K, fast, x, xq, prep, m, k, w, bias, y, n, c0, c1); break;                              \
    }

/* x [m, k] float32; w [n, row_bytes] (ggml blocks, qtype a GGML type id); bias [n] float32 or NULL;
   y [m, n] float32; all contiguous. An unsupported qtype leaves y as it is (quant.py checks it). */
void tessera_qgemm(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t qtype, const float *bias,
                   float *y, int64_t n, int64_t fast, int num_threads)
{
    if (!SUPPORTED(qtype) || m <= 0 || n <= 0)
        return;
    xblock_t *xq = NULL;
    void *prep = NULL;
#if Q512
    if (fast ? TILED(qtype) : QUAD(qtype) && qtype != Q8_0) {  /* x as 4-block groups (Q8_0 exact: no) */
        const size_t groups = (size_t)m * (size_t)(((k + 31) / 32 + 3) / 4);
        prep = aligned_alloc(64, groups * (fast ? sizeof(fgroup_t) : sizeof(egroup_t)));
        if (prep != NULL && fast)
            prep_fast((int)qtype, x, m, k, prep, num_threads);
        else if (prep != NULL)
            prep_exact(x, m, k, prep, num_threads);
    }
#endif
    if (fast && prep == NULL) {  /* (no memory for the groups: the per-block code below) */
        xq = malloc((size_t)m * (size_t)((k + 31) / 32) * sizeof *xq);
        if (xq == NULL)
            fast = 0;  /* no memory for the quantized x: the exact path needs none */
        else
            quantize_x(x, m, k, xq, num_threads);
    }
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t c0 = n * t / threads, c1 = n * (t + 1) / threads;
#if Q512
        if (fast && prep != NULL) {
            switch (qtype) {
            case Q8_0: fast_columns(Q8_0, prep, m, k, w, bias, y, n, c0, c1); break;
            case Q4_0: fast_columns(Q4_0, prep, m, k, w, bias, y, n, c0, c1); break;
            case Q4_1: fast_columns(Q4_1, prep, m, k, w, bias, y, n, c0, c1); break;
            case Q4_K: fast_columns(Q4_K, prep, m, k, w, bias, y, n, c0, c1); break;
            default: fast_columns(Q6_K, prep, m, k, w, bias, y, n, c0, c1); break;
            }
        } else
#endif
        if (fast) {
            COLUMNS_OF(1)
        } else {
            COLUMNS_OF(0)
        }
    }
    free(xq);
    free(prep);
}

/* out[i, :k] = row rows[i] of w dequantized (float32, as gguf's dequantize) */
void tessera_qdequant_rows(const uint8_t *w, int64_t qtype, int64_t k, const int64_t *rows, int64_t count,
                           float *out)
{
    if (!SUPPORTED(qtype))
        return;
    const int bs = BLOCK_SIZE(qtype), bb = BLOCK_BYTES(qtype);
    const int64_t blocks = (k + bs - 1) / bs, row_bytes = blocks * bb;
    /* a whole weight (prefill chunks, quant.py): the calling thread's OpenMP team; a few embedding rows: alone */
#pragma omp parallel for schedule(static) if (count * k >= (1 << 16))
    for (int64_t i = 0; i < count; i++) {
#if QX_AVX512
        const int64_t whole = k / bs;  /* blocks wholly inside k: decoded straight into the row */
        for (int64_t j = 0; j < whole; j++) {
            const uint8_t *b = w + rows[i] * row_bytes + j * bb;
            float *o = out + i * k + j * bs;
            for (int sub = 0; sub < bs / 32; sub++) {
                __m512 lo, hi;
                decode32((int)qtype, b, sub, &lo, &hi);
                _mm512_storeu_ps(o + 32 * sub, lo);
                _mm512_storeu_ps(o + 32 * sub + 16, hi);
            }
        }
        for (int64_t j = whole; j < blocks; j++) {
#else
        for (int64_t j = 0; j < blocks; j++) {
#endif
            float buf[256];
            decode_block((int)qtype, w + rows[i] * row_bytes + j * bb, buf);
            const int64_t len = k - j * bs < bs ? k - j * bs : bs;
            memcpy(out + i * k + j * bs, buf, (size_t)len * sizeof(float));
        }
    }
}

/* 1 where fast mode multiplies qtype's blocks in register tiles (AVX-512 BW + VNNI; Q8_0, Q4_0, Q4_1):
   faster than decoding the weight to float32 for MKL at every row count (quant.py asks) */
int64_t tessera_qgemm_tiled(int64_t qtype)
{
#if Q512
    return TILED(qtype);
#else
    (void)qtype;
    return 0;
#endif
}

/* "avx512-vnni" (exact: AVX-512F; fast: VNNI), "avx512" (exact: AVX-512F; fast: AVX2), "avx-vnni" /
   "avx2" (exact: portable; fast: AVX-VNNI / AVX2), "portable" (both portable; also TESSERA_PORTABLE) */
const char *tessera_qgemm_variant(void)
{
#if QX_AVX512 && QF_AVX2
    return strcmp(QF_NAME, "vnni") == 0 ? "avx512-vnni" : "avx512";
#elif QF_AVX2
    return strcmp(QF_NAME, "vnni") == 0 ? "avx-vnni" : "avx2";
#else
    return "portable";
#endif
}
