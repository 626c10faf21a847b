/* reduce16: sixteen float32 vectors' horizontal sums in one vector, AVX-512 (decode_step.c's GEMV tiles,
 * paged_attention.c's bf16 scores).
 *
 * Each vector's lanes are added in the tree _mm512_reduce_add_ps uses (GCC's and Clang's: lane i +
 * lane i + 8, then i + 4, i + 2, i + 1), so a sum has the bits a reduction of that vector alone gives.
 */
#ifndef TESSERA_REDUCE16_H
#define TESSERA_REDUCE16_H

#if defined(__AVX512F__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>

/* the sums of 16 vectors acc[4 r + c] in one: lane 4 c + r. Each vector's lanes are added in the tree
   of _mm512_reduce_add_ps (lane i + lane i + 8, then i + 4, then i + 2, then i + 1), transposed: 15
   additions and 30 shuffles serve all 16, where 16 reductions took 64 additions and 64 extracts or
   shuffles. Lanes of different vectors never meet, so a vector's sum is the same whichever others
   share the call. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 acc[16])
{
    __m512 pair[8], quad[4], oct[2];
    for (int i = 0; i < 8; i++)  /* [a lanes 0-7 + 8-15 | b's]: quarters 0,1 of each + quarters 2,3 */
        pair[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                                _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quarter j: vector 4 i + j's lanes 0-3 + 4-7 */
        quad[i] = _mm512_add_ps(_mm512_shuffle_f32x4(pair[2 * i], pair[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(pair[2 * i], pair[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* quarter j: [vector 8 i + j's 0 + 2, 1 + 3, vector 8 i + 4 + j's 0 + 2, 1 + 3] */
        oct[i] = _mm512_add_ps(_mm512_shuffle_ps(quad[2 * i], quad[2 * i + 1], 0x44),
                               _mm512_shuffle_ps(quad[2 * i], quad[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(oct[0], oct[1], 0x88), _mm512_shuffle_ps(oct[0], oct[1], 0xDD));
}
#endif

#endif
