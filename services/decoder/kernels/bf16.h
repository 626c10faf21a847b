/* bfloat16 helpers shared by the CPU kernels: conversions and the bf16 dot product.
 *
 * bfloat16 is the top half of an IEEE float32, so widening is exact (a 16-bit shift) and every
 * product of two bf16 values is exact in float32. The kernels keep bf16 in memory (weights, KV
 * cache, activations) and accumulate in float32; a result is rounded to bf16 once, to nearest
 * even, as torch's `.to(torch.bfloat16)` rounds (NaN stays NaN).
 *
 * The variant is fixed when the library is compiled (kernels/native.py):
 *   avx512_bf16  the compiler targets a CPU with AVX512-BF16 (-march=native there): bf16 x bf16
 *                dot products use VDPBF16PS (_mm512_dpbf16_ps, 32 products per instruction);
 *   portable     anywhere else, or with TESSERA_PORTABLE defined: widened to float32, then
 *                vectorized fused multiply-adds.
 * Both sum in float32; only the order of the additions differs.
 */
#ifndef TESSERA_BF16_H
#define TESSERA_BF16_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(TESSERA_PORTABLE)
#define TESSERA_DPBF16 1
#include <immintrin.h>
#define TESSERA_VARIANT "avx512_bf16"
#else
#define TESSERA_DPBF16 0
#define TESSERA_VARIANT "portable"
#endif

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet = (bits >> 16) | 0x0040u;  /* NaN: keep it quiet, never round it to inf */
    return (bf16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);  /* a select: loops vectorize */
}

/* sum_d a[d] * b[d] over n bf16 values, in float32 */
static inline float dot_bf16(const bf16_t *a, const bf16_t *b, int64_t n)
{
#if TESSERA_DPBF16
    __m512 acc = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= n; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
    if (d < n) {  /* the tail: masked-off lanes load zeros and add nothing */
        const __mmask32 mask = (__mmask32)((1u << (n - d)) - 1u);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, a + d),
                               (__m512bh)_mm512_maskz_loadu_epi16(mask, b + d));
    }
    return _mm512_reduce_add_ps(acc);
#else
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t d = 0; d < n; d++)
        sum += bf16_to_f32(a[d]) * bf16_to_f32(b[d]);
    return sum;
#endif
}

#endif
