/* RMSNorm, rotary position embedding and the SiLU gate for CPUs (float32 or bfloat16), in
 * transformers' order of operations, one pass over the rows each.
 *
 * Built and loaded with the other kernels by services/decoder/kernels/native.py; called by
 * services/decoder/kernels/pointwise.py when the cpu linear backend runs. torch computes both as a
 * chain of elementwise ops, each a pass over memory with its own dispatch (RMSNorm: square, mean,
 * add, rsqrt, two products; bf16 adds two casts; rotary: two products, a negation, a concatenation,
 * a sum), and its float32 rms_norm went slower than the GEMMs around it at prefill sizes here.
 *
 * RMSNorm (transformers' LlamaRMSNorm), per row of `hidden` values:
 *     r = 1 / sqrt(sum(x^2) / hidden + eps)       float32 statistics whatever the dtype
 *     float32:   y = (x * r) * w
 *     bfloat16:  y = bf16(w * bf16(x * r))        normalized, rounded to bf16, then scaled in bf16
 * Only the order of the sum of squares differs from torch's.
 *
 * Rotary (split-half pairing, transformers' `x * cos + rotate_half(x) * sin`), per head, h = head_dim / 2:
 *     y[i]     = x[i] * cos[i]         - x[i + h] * sin[i]
 *     y[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h]
 * each product and the sum rounded as torch rounds them (to float32, or to bf16 for bf16 tensors;
 * no fused multiply-add): the same bits as the torch expression.
 *
 * SiLU gate (the MLP's act_fn(gate) * up, transformers' LlamaMLP), per row of the fused gate/up
 * projection [gate (inter) | up (inter)]:
 *     y[j] = round(g / (1 + exp(-g))) * u[j]      g = gate[j]; round: to the tensor's precision
 * torch's silu formula, rounded where torch rounds it (a bf16 silu result is rounded before the
 * product); exp is glibc's vector expf where torch uses its own vectorized exp, so a float32 result
 * may differ from torch's by a few units in the last place (within 3.1e-7 of exact, torch's within
 * 2.2e-7, over 3M values per gate range up to +-120; bf16 results matched torch's in all 15M
 * tested). It writes a contiguous [rows, inter] for the down projection: torch's in-place
 * silu and product on the gate's column view left one for the GEMM to copy, three passes in all
 * (the P1 workload's MLP gates in the engine, both ways on the same inputs alternately: 1.52 s
 * torch, 1.07 s here, float32).
 */
/* a * b + c stays two roundings, as torch computes it: no fused multiply-add (GCC, then clang and
   other C99 compilers; each ignores the other's pragma) */
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define LOAD(p, at) (bf16 ? bf16_to_f32(((const bf16_t *)(p))[at]) : ((const float *)(p))[at])
#define ROUND(v) (bf16 ? bf16_to_f32(f32_to_bf16(v)) : (v))  /* to the tensor's precision */
#define PARALLEL_MIN 32768  /* elements below which one thread does it all (a team costs more) */
#define SILU_PARALLEL_MIN 16384  /* the same for the SiLU gate (an exp per element: ~1-2 ns) */

/* glibc's vector expf (libmvec) for the SiLU loop; math.h declares it only under -ffast-math */
#pragma omp declare simd notinbranch
extern float expf(float);

/* Each exported function has its own parallel loop around an always-inlined row function called
   with a literal dtype: GCC outlines a parallel region before it inlines, so a dtype passed into one
   would be read at run time in the loop and the loop would not vectorize. */

static inline __attribute__((always_inline)) void store(void *p, int64_t at, float v, const int bf16)
{
    if (bf16)
        ((bf16_t *)p)[at] = f32_to_bf16(v);
    else
        ((float *)p)[at] = v;
}

/* row i of RMSNorm */
static inline __attribute__((always_inline)) void norm_row(
    const void *x, const void *weight, void *y, int64_t i, int64_t hidden, float eps, const int bf16)
{
    const int64_t row = i * hidden;
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t d = 0; d < hidden; d++) {
        const float v = LOAD(x, row + d);
        sum += v * v;
    }
    const float r = 1.f / sqrtf(sum / (float)hidden + eps);
    #pragma omp simd
    for (int64_t d = 0; d < hidden; d++)
        store(y, row + d, LOAD(weight, d) * ROUND(LOAD(x, row + d) * r), bf16);
}

/* head `item` (token item / heads, head item % heads) of the rotary embedding, h = head_dim / 2 */
static inline __attribute__((always_inline)) void rotate_head(
    const void *x, int64_t row_stride, void *y, const void *cos, const void *sin, int64_t item, int64_t heads,
    int64_t head_dim, const int bf16)
{
    const int64_t t = item / heads, h = item % heads, half = head_dim / 2;
    const int64_t in = t * row_stride + h * head_dim, out = item * head_dim, table = t * head_dim;
    #pragma omp simd
    for (int64_t i = 0; i < half; i++)
        store(y, out + i, ROUND(LOAD(x, in + i) * LOAD(cos, table + i)) - ROUND(LOAD(x, in + i + half) * LOAD(sin, table + i)),
              bf16);
    #pragma omp simd
    for (int64_t i = half; i < head_dim; i++)
        store(y, out + i, ROUND(LOAD(x, in + i) * LOAD(cos, table + i)) + ROUND(LOAD(x, in + i - half) * LOAD(sin, table + i)),
              bf16);
}

/* row i of the SiLU gate: gate then up, `inter` values each, from gate_up + i * row_stride */
static inline __attribute__((always_inline)) void silu_mul_row(
    const void *gate_up, int64_t row_stride, void *y, int64_t i, int64_t inter, const int bf16)
{
    const int64_t in = i * row_stride, out = i * inter;
    #pragma omp simd
    for (int64_t j = 0; j < inter; j++) {
        const float g = LOAD(gate_up, in + j);
        store(y, out + j, ROUND(g / (1.f + expf(-g))) * LOAD(gate_up, in + inter + j), bf16);
    }
}

/* x, y [rows, hidden] contiguous; weight [hidden]; all float32 */
void tessera_rms_norm_f32(const float *x, const float *weight, float *y, int64_t rows, int64_t hidden, float eps,
                          int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN)
    for (int64_t i = 0; i < rows; i++)
        norm_row(x, weight, y, i, hidden, eps, 0);
}

/* the same over bfloat16 (raw bits, uint16) */
void tessera_rms_norm_bf16(const bf16_t *x, const bf16_t *weight, bf16_t *y, int64_t rows, int64_t hidden, float eps,
                           int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN)
    for (int64_t i = 0; i < rows; i++)
        norm_row(x, weight, y, i, hidden, eps, 1);
}

/* x: token t, head h at x + t * row_stride + h * head_dim (head_dim values contiguous; a column view
   of the fused q/k/v projection); y [tokens, heads, head_dim] contiguous; cos, sin [tokens, head_dim]
   contiguous; head_dim even; all float32 */
void tessera_rotary_f32(const float *x, int64_t row_stride, float *y, const float *cos, const float *sin,
                        int64_t tokens, int64_t heads, int64_t head_dim, int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN)
    for (int64_t item = 0; item < tokens * heads; item++)
        rotate_head(x, row_stride, y, cos, sin, item, heads, head_dim, 0);
}

/* the same over bfloat16 (raw bits, uint16) */
void tessera_rotary_bf16(const bf16_t *x, int64_t row_stride, bf16_t *y, const bf16_t *cos, const bf16_t *sin,
                         int64_t tokens, int64_t heads, int64_t head_dim, int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN)
    for (int64_t item = 0; item < tokens * heads; item++)
        rotate_head(x, row_stride, y, cos, sin, item, heads, head_dim, 1);
}

/* gate_up: row i's 2 * inter values (gate, then up) contiguous at gate_up + i * row_stride; y [rows,
   inter] contiguous; all float32 */
void tessera_silu_mul_f32(const float *gate_up, int64_t row_stride, float *y, int64_t rows, int64_t inter,
                          int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= SILU_PARALLEL_MIN)
    for (int64_t i = 0; i < rows; i++)
        silu_mul_row(gate_up, row_stride, y, i, inter, 0);
}

/* the same over bfloat16 (raw bits, uint16) */
void tessera_silu_mul_bf16(const bf16_t *gate_up, int64_t row_stride, bf16_t *y, int64_t rows, int64_t inter,
                           int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= SILU_PARALLEL_MIN)
    for (int64_t i = 0; i < rows; i++)
        silu_mul_row(gate_up, row_stride, y, i, inter, 1);
}
