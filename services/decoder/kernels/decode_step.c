/* The decode step of a Llama-family model in one call: every decoder layer for a few decode rows.
 *
 * Built and loaded with the other kernels by services/decoder/kernels/native.py; called by
 * services/decoder/decode_step.py for a step whose rows all decode (one token each, at most
 * MAX_ROWS of them) on the cpu attention backend. It runs the layers that the torch path
 * (model_llama.py) runs module by module, in the same order and with the same roundings, calling
 * the kernels that path calls on the cpu backends (norm_rope.c, gemm.c, paged_attention.c,
 * lora_bgmv.c) and `gemv` below for weights kept row-major; what it removes is the Python between
 * them. At one row a SmolLM2-135M step is ~120 kernels of a few microseconds of arithmetic each:
 * the module path spent as much time dispatching them (tensors, views, ctypes, the LoRA hooks) as
 * computing, measured on a 2-core AVX-512 host (fp32: 37.7 ms per step, 26 of them reading weights).
 *
 * Per layer, `x` the residual stream [rows, hidden] (updated in place):
 *     h = rms_norm(x, input_norm)
 *     qkv = h W_qkv^T (+ b) (+ LoRA q | k | v on their columns)
 *     q, k = rotary(q_norm(q), k_norm(k))      q/k norms per head where the family has them (Qwen3)
 *     K/V cache rows at slot_mapping <- k, v   (non-finite V stored as 0, as KVCache.write; rounded to
 *                                              bf16 under --kv-cache-dtype bfloat16)
 *     a = paged attention(q; window, soft cap)
 *     x = x + (a W_o^T (+ b) (+ LoRA o))
 *     h = rms_norm(x, post_norm)
 *     g = h W_gate_up^T (+ b) (+ LoRA gate | up)
 *     x = x + (silu(gate) * up) W_down^T (+ b) (+ LoRA down)
 * A bfloat16 model keeps bf16 activations between the kernels, each result rounded once, as the
 * torch path rounds each module's output; the residual add widens both sides and rounds the sum.
 *
 * gemv: y[m][o] = sum_k x[m][k] W[o][k] (+ b[o]) over a row-major W [N, K], threads splitting the
 * outputs. Each weight row is read from memory once per step, and its dot products with every x row
 * (<= MAX_ROWS, in L1/L2) are summed from it in registers: decode at small batch is bound by
 * reading the weights. float32: AVX-512 (16 lanes, one accumulator per row, rows four at a time)
 * or `omp simd` elsewhere; bfloat16 x and W: VDPBF16PS where the CPU has AVX512-BF16 (tiles of
 * four W rows x four x rows, so past a few rows the VDPBF16PS, not the loads, set the pace; up to 8
 * x rows, tiles of eight W rows read one after another, front to back: one stream), widened
 * float32 FMAs elsewhere; sums in float32, rounded once. The order of the sum depends on neither the
 * row's place in the batch nor the thread count.
 *
 * A projection an adapter targets adds its LoRA parts (lora_bgmv.c's team body) in the GEMV's own
 * parallel region: the GEMV's tiles without a barrier, the shrink (which reads only x), its barrier,
 * then the expand into y: one fork and two barriers where the GEMV and a BGMV call of its own took
 * two forks and three, 120 times a token at batch 1 for SmolLM2 (the same operations: the same bits).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "reduce16.h"

#if defined(__AVX512F__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define GEMV_AVX512 1
#else
#define GEMV_AVX512 0
#endif

#define MAX_ROWS 32   /* decode_step.MAX_ROWS: the scratch buffers hold this many rows */
#define GEMV_ROWS 4   /* x rows per tile: each weight vector loaded once feeds four FMAs */
/* W rows (outputs) per tile: bfloat16 4 (each x vector loaded once feeds four VDPBF16PS), float32 1.
   SmolLM2-135M's 30 layers of projections + lm_head, 2-core AMD EPYC with AVX512-BF16, interleaved
   medians, ms one column / 2 / 3 / 4 per tile: bfloat16 8 rows 12.8 / 12.9 / 12.0 / 12.3, 16: 22.6 /
   20.8 / 19.2 / 19.2, 24: 33.8 / 30.3 / 27.0 / 26.7, 32: 47.8 / 39.9 / 35.9 / 32.7 (1 row: 9.5 / 9.3 with
   4); float32 4 rows 20.1 / 22.0 / - / 21.4, 8: 26.4 / 32.7 / - / 32.0, 16: 60.4 / 62.1 / - / 60.8 (the
   weights stream at twice the bytes, and the float32 path here is gemm.c's panels anyway). */
#define GEMV_COLS 4
#define TILE_COLS(bf16) ((bf16) ? GEMV_COLS : 1)
/* The bfloat16 GEMV for up to STREAM_MAX_ROWS x rows (VDPBF16PS; gemv_stream_tile): tiles of STREAM_COLS
   W rows, each W row read front to back, eight sums per transposed reduction. SmolLM2-135M's 30
   layers of projections, 2-core AMD EPYC (Zen 5) VM, interleaved rounds in one process, share of
   torch's sum of the same bytes (per-round medians; the VM's bandwidth moves between ~45 and ~60
   GB/s phases): at one row the 4 x 4 tile of gemv_tile 0.76-0.88; tiles of 4 / 8 / 12 / 16 W rows
   interleaved over k 0.93 / 0.97-1.03 / 1.01 / 0.93; 8 W rows one after another 0.98-1.17 (+15-17%
   on the interleaved 8; 16 the same; two W rows interleaved 10% behind one; all prefetching 8 KB
   ahead, see STREAM_PF_BYTES). By x rows, the 4 x 4 tile -> this one: 2 rows 0.72 -> 1.07, 3 0.57 -> 0.91, 4 0.70 -> 1.06, 8 0.73 ->
   0.80; at 16 and 32 rows the 4 x 4 tile is 7-10% ahead (its W vector feeds four rows' VDPBF16PS for
   one load, and past 8 rows the VDPBF16PS, not the stream, set the pace). */
#define STREAM_COLS 8
#define STREAM_MAX_ROWS 8
/* how far ahead gemv_stream_tile prefetches its one stream: at one row, 3 interleaved runs of 24
   rounds, GB/s 8 / 16 / 24 / 32 KB ahead: 57.7 / 64.0 / 66.7 / 68.5 (the VM's fast phase), 45.3 /
   47.6 / 48.8 / 49.1, 42.0 / 44.4 / 45.1 / 45.1; into L1 (locality 3) 32 / 64 KB: 1-5% behind L2 */
#define STREAM_PF_BYTES 32768
/* The weight stream is prefetched PF_BYTES ahead, a cache line per vector step: SmolLM2-135M's 30
   layers of projections at one row, 2-core AVX-512 host, interleaved medians, GB/s float32 / bf16:
   a row's lines asked for at once 2 rows ahead 17.8 / 17.2; a line at a time 4 KB ahead 20.9 / 19.1,
   8 KB 21.1 / 19.7, 16 KB 20.9 / 20.5, 32 KB 20.3 / 20.7 (torch's sum of 1 GiB: 22.2; the packed GEMM:
   19.9 / 15.7). Locality 0 (non-temporal) halved the bandwidth reached. */
#ifndef PF_BYTES
#define PF_BYTES 8192
#endif
#define PF_LOCALITY 2
/* whether gemv_output's loop for the dtype is the intrinsics one (which prefetches as it streams) */
#define STREAMS(bf16) ((bf16) ? TESSERA_DPBF16 : GEMV_AVX512)
#define NUM_LORA 7    /* q, k, v, o, gate, up, down */

/* kernels of the same library (norm_rope.c, gemm.c, paged_attention.c, lora_bgmv.c) */
void tessera_rms_norm_f32(const float *, const float *, float *, int64_t, int64_t, float, int);
void tessera_rms_norm_bf16(const bf16_t *, const bf16_t *, bf16_t *, int64_t, int64_t, float, int);
void tessera_rotary_f32(const float *, int64_t, float *, const float *, const float *, int64_t, int64_t, int64_t, int);
void tessera_rotary_bf16(const bf16_t *, int64_t, bf16_t *, const bf16_t *, const bf16_t *, int64_t, int64_t,
                         int64_t, int);
void tessera_silu_mul_f32(const float *, int64_t, float *, int64_t, int64_t, int);
void tessera_silu_mul_bf16(const bf16_t *, int64_t, bf16_t *, int64_t, int64_t, int);
void tessera_gemm_f32(const float *, int64_t, int64_t, const float *, const float *, float *, int64_t, int);
void tessera_gemm_bf16(const float *, int64_t, int64_t, const bf16_t *, const bf16_t *, bf16_t *, int64_t, int);
int tessera_paged_decode_attention_f32(const float *, const float *, const float *, const int64_t *, const int32_t *,
                                       int64_t, const int32_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                       int64_t, int64_t, float, int64_t, float, int);
int tessera_paged_decode_attention_bf16(const bf16_t *, const bf16_t *, const bf16_t *, const int64_t *,
                                        const int32_t *, int64_t, const int32_t *, bf16_t *, int64_t, int64_t,
                                        int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float, int);
int tessera_paged_decode_attention_f32_bf16kv(const float *, const bf16_t *, const bf16_t *, const int64_t *,
                                              const int32_t *, int64_t, const int32_t *, float *, int64_t, int64_t,
                                              int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float, int);
void tessera_write_kv_f32(const float *, int64_t, const float *, int64_t, const int64_t *, int64_t, int64_t, int64_t,
                          int64_t, float *, float *);
void tessera_write_kv_f32_bf16kv(const float *, int64_t, const float *, int64_t, const int64_t *, int64_t, int64_t,
                                 int64_t, int64_t, bf16_t *, bf16_t *);
void tessera_write_kv_bf16(const bf16_t *, int64_t, const bf16_t *, int64_t, const int64_t *, int64_t, int64_t,
                           int64_t, int64_t, bf16_t *, bf16_t *);
void tessera_qgemm(const float *, int64_t, int64_t, const uint8_t *, int64_t, const float *, float *, int64_t, int64_t,
                   int);
/* lora_bgmv.c's bgmv_part_t: one projection of a call over several that read the same x */
typedef struct {
    const void *a, *bt;
    void *y;
    int64_t y_stride, out_features, rank, tiled;
} bgmv_part_t;
void tessera_lora_bgmv_parts_team_f32(const float *, int64_t, const bgmv_part_t *, int64_t, const int64_t *,
                                      const int64_t *, const int64_t *, int64_t, int64_t, float *, int);
void tessera_lora_bgmv_parts_team_bf16(const bf16_t *, int64_t, const bgmv_part_t *, int64_t, const int64_t *,
                                       const int64_t *, const int64_t *, int64_t, int64_t, float *, int);
void tessera_lora_bgmv_parts_team_f32_bf16w(const float *, int64_t, const bgmv_part_t *, int64_t, const int64_t *,
                                            const int64_t *, const int64_t *, int64_t, int64_t, float *, int);

/* One projection: W [out, in] row-major (packed = 0), gemm.c's panels (packed = 1), or GGUF blocks
   (qtype != 0: the GGML type id, quant_gemm.c; float32 models only; fast: its int8-activation mode);
   bias [out] or NULL. Layout mirrored by decode_step.py's Projection. */
typedef struct {
    const void *weight;
    const void *bias;
    int64_t packed, in_features, out_features, qtype, fast;
} projection_t;

/* One LoRA target of a projection: its columns [start, start + out) of the projection's output;
   a [slots, rank, in], bt [slots, rank, out] (B^T; tiled = 1: in lora_bgmv.c's tiles) contiguous, or
   a = NULL (no adapter targets it). */
typedef struct {
    const void *a;
    const void *bt;
    int64_t start, out_features, rank, tiled;
} lora_part_t;

/* One decoder layer's weights and cache (decode_step.py's Layer). */
typedef struct {
    const void *input_norm, *post_norm;    /* [hidden] */
    const void *q_norm, *k_norm;           /* [head_dim] or NULL */
    projection_t qkv, o, gate_up, down;
    void *k_cache, *v_cache;               /* [kv_heads, num_slots, head_dim] */
    int64_t window;                        /* sliding window in keys, 0: none */
    float soft_cap;                        /* attention logit soft cap, 0: none */
    lora_part_t lora[NUM_LORA];            /* q, k, v, o, gate, up, down */
} layer_t;

/* The step (decode_step.py's Step): shapes, this step's rows and metadata, and scratch buffers. */
typedef struct {
    int64_t rows, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_slots, block_size, max_context, table_width;
    float eps, scale;
    void *x;                               /* [rows, hidden] residual stream, in and out */
    void *cos, *sin;                       /* [rows, head_dim]: given, or gathered (ids) */
    const int64_t *slot_mapping;           /* [rows] */
    const int64_t *attention_rows;         /* [rows]: 0..rows-1 */
    const int32_t *block_tables;           /* [rows, table_width] */
    const int32_t *context_lens;           /* [rows] */
    int64_t lora_groups;                   /* 0: no adapter row */
    const int64_t *lora_rows, *lora_starts, *lora_slots;
    int64_t lora_bf16;                     /* the factors are bfloat16 (a float32 model: --lora-dtype) */
    int64_t kv_bf16;                       /* the caches are bfloat16 (a float32 model: --kv-cache-dtype) */
    /* scratch, each MAX_ROWS rows of the model's dtype unless said: */
    void *h;                               /* [hidden] */
    void *qkv;                             /* [(heads + 2 kv_heads) head_dim] */
    void *qk;                              /* [(heads + kv_heads) head_dim]: q/k normed per head */
    void *q, *k;                           /* [heads head_dim], [kv_heads head_dim] rotated */
    void *attention;                       /* [heads head_dim] */
    void *out;                             /* [hidden] */
    void *gate_up;                         /* [2 intermediate] */
    void *act;                             /* [intermediate] */
    float *widened;                        /* float32 [max(hidden, heads head_dim, intermediate)] */
    float *shrunk;                         /* float32 [3, MAX_ROWS, max rank]: q, k, v at once */
    int num_threads;
    /* ids != NULL: the step gathers its inputs first (`gather_inputs`) */
    const int64_t *ids, *positions;        /* [rows] token ids and RoPE positions */
    const void *embedding;                 /* [vocab, hidden] */
    const void *cos_table, *sin_table;     /* [table_positions, head_dim] */
    int64_t vocab, table_positions;
} step_t;

/* A projection's LoRA parts (project_lora's), for its GEMV to add inside its own parallel region */
typedef struct {
    const step_t *s;
    const bgmv_part_t *parts;
    int64_t num_parts, in_features;
} lora_call_t;

/* lora's parts added to y by every thread of the caller's parallel region, x [rows, in_features]: the
   BGMV's team body (lora_bgmv.c), whose loops bind to that region and end with a barrier */
static inline __attribute__((always_inline)) void lora_in_region(const lora_call_t *lora, const void *x, const int bf16)
{
    const step_t *s = lora->s;
    const int threads = omp_get_num_threads();
    if (bf16)
        tessera_lora_bgmv_parts_team_bf16(x, lora->in_features, lora->parts, lora->num_parts, s->lora_rows,
                                          s->lora_starts, s->lora_slots, s->lora_groups, lora->in_features, s->shrunk,
                                          threads);
    else if (s->lora_bf16)
        tessera_lora_bgmv_parts_team_f32_bf16w(x, lora->in_features, lora->parts, lora->num_parts, s->lora_rows,
                                               s->lora_starts, s->lora_slots, s->lora_groups, lora->in_features,
                                               s->shrunk, threads);
    else
        tessera_lora_bgmv_parts_team_f32(x, lora->in_features, lora->parts, lora->num_parts, s->lora_rows,
                                         s->lora_starts, s->lora_slots, s->lora_groups, lora->in_features, s->shrunk,
                                         threads);
}

#define ELEMENT(bf16) ((bf16) ? sizeof(bf16_t) : sizeof(float))
#define AT(p, e, bf16) ((void *)((char *)(p) + (size_t)(e) * ELEMENT(bf16)))

/* outputs [o0, o0 + nc) of rows [m0, m0 + nr), nc, nr <= 4: sums[4 c + r] = W row o0 + c . x row m0 + r.
   In the vector loops a tile of nc W rows and nr x rows takes nc + nr loads per k step for nc * nr
   FMAs (one W row at a time took 1 + nr for nr: at 24 rows the loads, not the FMAs, set the pace),
   and one transposed reduction (reduce16) for its sums. Each sum's order (lane-wise in increasing k,
   then the lanes' tree) depends on neither nc nor nr. */
static inline __attribute__((always_inline)) void gemv_tile(
    const void *x, int64_t m0, const int nr, int64_t k_features, const void *weight, int64_t o0, const int nc,
    float *sums, const int bf16)
{
#if GEMV_AVX512
    if (STREAMS(bf16)) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_setzero_ps();
        if (!bf16) {
            const float *w[4], *xr[4];
            for (int c = 0; c < nc; c++)
                w[c] = (const float *)weight + (o0 + c) * k_features;
            for (int r = 0; r < nr; r++)
                xr[r] = (const float *)x + (m0 + r) * k_features;
            int64_t k = 0;
            for (; k + 16 <= k_features; k += 16) {
                __m512 wv[4];
                for (int c = 0; c < nc; c++) {
                    __builtin_prefetch((const char *)(w[c] + k) + PF_BYTES, 0, PF_LOCALITY);
                    wv[c] = _mm512_loadu_ps(w[c] + k);
                }
                for (int r = 0; r < nr; r++) {
                    const __m512 xv = _mm512_loadu_ps(xr[r] + k);
                    for (int c = 0; c < nc; c++)
                        acc[4 * r + c] = _mm512_fmadd_ps(wv[c], xv, acc[4 * r + c]);
                }
            }
            if (k < k_features) {  /* masked-off lanes load zeros and add nothing */
                const __mmask16 mask = (__mmask16)((1u << (k_features - k)) - 1u);
                __m512 wv[4];
                for (int c = 0; c < nc; c++)
                    wv[c] = _mm512_maskz_loadu_ps(mask, w[c] + k);
                for (int r = 0; r < nr; r++) {
                    const __m512 xv = _mm512_maskz_loadu_ps(mask, xr[r] + k);
                    for (int c = 0; c < nc; c++)
                        acc[4 * r + c] = _mm512_fmadd_ps(wv[c], xv, acc[4 * r + c]);
                }
            }
        }
#if TESSERA_DPBF16
        else {
            const bf16_t *w[4], *xr[4];
            for (int c = 0; c < nc; c++)
                w[c] = (const bf16_t *)weight + (o0 + c) * k_features;
            for (int r = 0; r < nr; r++)
                xr[r] = (const bf16_t *)x + (m0 + r) * k_features;
            int64_t k = 0;
            for (; k + 32 <= k_features; k += 32) {
                __m512bh wv[4];
                for (int c = 0; c < nc; c++) {
                    __builtin_prefetch((const char *)(w[c] + k) + PF_BYTES, 0, PF_LOCALITY);
                    wv[c] = (__m512bh)_mm512_loadu_si512(w[c] + k);
                }
                for (int r = 0; r < nr; r++) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[r] + k);
                    for (int c = 0; c < nc; c++)
                        acc[4 * r + c] = _mm512_dpbf16_ps(acc[4 * r + c], wv[c], xv);
                }
            }
            if (k < k_features) {
                const __mmask32 mask = (__mmask32)((1u << (k_features - k)) - 1u);
                __m512bh wv[4];
                for (int c = 0; c < nc; c++)
                    wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[c] + k);
                for (int r = 0; r < nr; r++) {
                    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[r] + k);
                    for (int c = 0; c < nc; c++)
                        acc[4 * r + c] = _mm512_dpbf16_ps(acc[4 * r + c], wv[c], xv);
                }
            }
        }
#endif
        _mm512_storeu_ps(sums, reduce16(acc));
        return;
    }
#endif
    for (int c = 0; c < nc; c++) {  /* `omp simd`, one W row at a time against four x rows */
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        const int64_t x1 = m0 + (nr > 1 ? 1 : 0), x2 = m0 + (nr > 2 ? 2 : 0), x3 = m0 + (nr > 3 ? 3 : 0);
        if (bf16) {  /* missing rows repeat the first (computed, never stored) */
            const bf16_t *w = (const bf16_t *)weight + (o0 + c) * k_features, *xb = x;
            const bf16_t *r0 = xb + m0 * k_features, *r1 = xb + x1 * k_features, *r2 = xb + x2 * k_features,
                         *r3 = xb + x3 * k_features;
            #pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int64_t k = 0; k < k_features; k++) {
                const float wv = bf16_to_f32(w[k]);
                s0 += wv * bf16_to_f32(r0[k]);
                s1 += wv * bf16_to_f32(r1[k]);
                s2 += wv * bf16_to_f32(r2[k]);
                s3 += wv * bf16_to_f32(r3[k]);
            }
        } else {
            const float *w = (const float *)weight + (o0 + c) * k_features, *xf = x;
            const float *r0 = xf + m0 * k_features, *r1 = xf + x1 * k_features, *r2 = xf + x2 * k_features,
                        *r3 = xf + x3 * k_features;
            #pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int64_t k = 0; k < k_features; k++) {
                s0 += w[k] * r0[k];
                s1 += w[k] * r1[k];
                s2 += w[k] * r2[k];
                s3 += w[k] * r3[k];
            }
        }
        sums[4 * c] = s0, sums[4 * c + 1] = s1, sums[4 * c + 2] = s2, sums[4 * c + 3] = s3;
    }
}

#if GEMV_AVX512 && TESSERA_DPBF16
/* bfloat16 x rows [m0, m0 + nr) against W rows [o0, o0 + nc), nr <= GEMV_ROWS, nc <= STREAM_COLS:
   sums[STREAM_COLS r + c] = W row o0 + c . x row m0 + r. The W rows are read one after another, front
   to back (the tile's bytes in address order: the hardware prefetcher sees one stream, where the
   k-interleaved loop of gemv_tile showed it nc), each W vector feeding the nr rows' VDPBF16PS; a W
   row's chains are short (K / 32 steps) against its time from memory. Each sum is summed as in
   gemv_tile (lane-wise in increasing k, then reduce16's tree of its lanes), so a row's outputs are
   the same bits whether it decodes alone or in a batch. */
static inline __attribute__((always_inline)) void gemv_stream_tile(
    const bf16_t *x, int64_t m0, const int nr, int64_t k_features, const bf16_t *weight, int64_t o0, const int nc,
    float *sums)
{
    __m512 acc[GEMV_ROWS][16];
    const bf16_t *xr[GEMV_ROWS];
    for (int r = 0; r < nr; r++) {
        xr[r] = x + (m0 + r) * k_features;
        for (int c = nc; c < 16; c++)
            acc[r][c] = _mm512_setzero_ps();
    }
    for (int c = 0; c < nc; c++) {
        const bf16_t *w = weight + (o0 + c) * k_features;
        __m512 a[GEMV_ROWS];
        for (int r = 0; r < nr; r++)
            a[r] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= k_features; k += 32) {
            __builtin_prefetch((const char *)(w + k) + STREAM_PF_BYTES, 0, PF_LOCALITY);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
            for (int r = 0; r < nr; r++)
                a[r] = _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_loadu_si512(xr[r] + k));
        }
        if (k < k_features) {  /* masked-off lanes load zeros and add nothing */
            const __mmask32 mask = (__mmask32)((1u << (k_features - k)) - 1u);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
            for (int r = 0; r < nr; r++)
                a[r] = _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[r] + k));
        }
        for (int r = 0; r < nr; r++)
            acc[r][c] = a[r];
    }
    for (int r = 0; r < nr; r++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, reduce16(acc[r]));  /* acc[r][i]'s sum is lane 4 (i % 4) + i / 4 */
        for (int c = 0; c < nc; c++)
            sums[STREAM_COLS * r + c] = lanes[4 * (c % 4) + c / 4];
    }
}

/* gemv's bfloat16 case for a few rows (m_rows <= STREAM_MAX_ROWS): tiles of STREAM_COLS outputs,
   threads splitting them, rows GEMV_ROWS at a time (a tile's W rows read again from L1 past four) */
static void gemv_stream_bf16(const bf16_t *x, int64_t m_rows, int64_t k_features, const bf16_t *weight,
                             const bf16_t *bias, bf16_t *y, int64_t n_features, int num_threads,
                             const lora_call_t *lora)
{
    const int64_t tiles = (n_features + STREAM_COLS - 1) / STREAM_COLS;
    #pragma omp parallel num_threads(num_threads)
    {
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t o0 = t * STREAM_COLS, nc = n_features - o0 < STREAM_COLS ? n_features - o0 : STREAM_COLS;
        for (int64_t m0 = 0; m0 < m_rows; m0 += GEMV_ROWS) {
            const int nr = m_rows - m0 < GEMV_ROWS ? (int)(m_rows - m0) : GEMV_ROWS;
            float sums[GEMV_ROWS * STREAM_COLS];
            if (nc == STREAM_COLS && nr == 1)  /* batch 1: the loops unrolled */
                gemv_stream_tile(x, m0, 1, k_features, weight, o0, STREAM_COLS, sums);
            else if (nc == STREAM_COLS && nr == GEMV_ROWS)
                gemv_stream_tile(x, m0, GEMV_ROWS, k_features, weight, o0, STREAM_COLS, sums);
            else
                gemv_stream_tile(x, m0, nr, k_features, weight, o0, (int)nc, sums);
            for (int r = 0; r < nr; r++)
                for (int64_t c = 0; c < nc; c++)
                    y[(m0 + r) * n_features + o0 + c] =
                        f32_to_bf16(sums[STREAM_COLS * r + c] + (bias != NULL ? bf16_to_f32(bias[o0 + c]) : 0.f));
        }
    }
    if (lora != NULL)  /* its expand adds to y after the shrink's barrier, so after every tile */
        lora_in_region(lora, x, 1);
    }
}
#endif

/* a tile with constant nc and nr (the vector loops compute only the rows and columns there are) */
#define GEMV_TILE_NR(nc, nr) gemv_tile(x, m0, nr, k_features, weight, o0, nc, sums, bf16)
#define GEMV_TILE_NC(nc)                                         \
    switch (nr) {                                                \
    case 1: GEMV_TILE_NR(nc, 1); break;                          \
    case 2: GEMV_TILE_NR(nc, 2); break;                          \
    case 3: GEMV_TILE_NR(nc, 3); break;                          \
    default: GEMV_TILE_NR(nc, 4); break;                         \
    }

static inline __attribute__((always_inline)) void gemv(
    const void *x, int64_t m_rows, int64_t k_features, const void *weight, const void *bias, void *y,
    int64_t n_features, int num_threads, const lora_call_t *lora, const int bf16)
{
#if GEMV_AVX512 && TESSERA_DPBF16
    if (bf16 && m_rows <= STREAM_MAX_ROWS) {
        gemv_stream_bf16(x, m_rows, k_features, weight, bias, y, n_features, num_threads, lora);
        return;
    }
#endif
    const int64_t row_bytes = k_features * (int64_t)ELEMENT(bf16), cols = TILE_COLS(bf16),
                  tiles = (n_features + cols - 1) / cols;
    #pragma omp parallel num_threads(num_threads)
    {
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t o0 = t * cols, nc = n_features - o0 < cols ? n_features - o0 : cols;
        if (!STREAMS(bf16))  /* the omp simd loop: the tile's lines PF_BYTES ahead, asked for now */
            for (int64_t c = 0; c < nc * row_bytes; c += 64)
                __builtin_prefetch((const char *)AT(weight, o0 * k_features, bf16) + PF_BYTES + c, 0, PF_LOCALITY);
        float b[GEMV_COLS] = {0.f};
        for (int64_t c = 0; bias != NULL && c < nc; c++)
            b[c] = bf16 ? bf16_to_f32(((const bf16_t *)bias)[o0 + c]) : ((const float *)bias)[o0 + c];
        for (int64_t m0 = 0; m0 < m_rows; m0 += GEMV_ROWS) {
            const int64_t nr = m_rows - m0 < GEMV_ROWS ? m_rows - m0 : GEMV_ROWS;
            float sums[16];
            switch (nc) {
            case 1: GEMV_TILE_NC(1); break;
            case 2: GEMV_TILE_NC(2); break;
            case 3: GEMV_TILE_NC(3); break;
            default: GEMV_TILE_NC(4); break;
            }
            for (int64_t c = 0; c < nc; c++)
                for (int64_t r = 0; r < nr; r++) {
                    const int64_t at = (m0 + r) * n_features + o0 + c;
                    if (bf16)
                        ((bf16_t *)y)[at] = f32_to_bf16(sums[4 * c + r] + b[c]);
                    else
                        ((float *)y)[at] = sums[4 * c + r] + b[c];
                }
        }
    }
    if (lora != NULL)
        lora_in_region(lora, x, bf16);
    }
}
#undef GEMV_TILE_NC
#undef GEMV_TILE_NR

/* panel_gemv: y [rows, N] = x [rows, K] W^T (+ b) over gemm.c's float32 panels ([ceil(N / 16), K, 16]) for
   rows <= GEMV_ROWS, on AVX-512: a panel row is one zmm, so each k is one load, one line prefetched
   PF_BYTES ahead (the GEMV's stream) and a fused multiply-add per row, where gemm.c's AVX2 tile reads
   the row in two halves and prefetches the next panel in slices (a float32 decoder on the cpu linear
   backend ran batch 1 at 0.94x the row-major one: bench/results/linear_backend.md). SmolLM2-135M's 30
   layers of projections from memory, 2-core AMD EPYC with AVX-512, interleaved medians, 1 / 2 / 4 rows:
   16.1 / 16.4 / 15.1 -> 15.4 / 15.5 / 14.4 ms (the row-major GEMV at 1 row: 14.5). The operations are
   gemm.c's, in its order (per output, FMAs from zero over each block of PANEL_KC k in increasing k,
   the blocks added in order, then the bias), so the bits are its bits:
   a row's numbers still do not depend on the step's size (tests/decoder/test_decode_step.py). */
#define PANEL_NR 16   /* gemm.c NR: output columns per panel */
#define PANEL_KC 128  /* gemm.c KC: k per block of its blocked sum */
#if GEMV_AVX512
static inline __attribute__((always_inline)) void panel_gemv_tile(
    const float *x, const int nr, int64_t k_features, const float *panel, const float *bias, float *y,
    int64_t n_features, int64_t n0)
{
    __m512 sums[GEMV_ROWS], acc[GEMV_ROWS];
    for (int r = 0; r < nr; r++)
        sums[r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < k_features; k0 += PANEL_KC) {
        const int64_t k1 = k0 + PANEL_KC < k_features ? k0 + PANEL_KC : k_features;
        for (int r = 0; r < nr; r++)
            acc[r] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            __builtin_prefetch((const char *)(panel + k * PANEL_NR) + PF_BYTES, 0, PF_LOCALITY);
            const __m512 w = _mm512_loadu_ps(panel + k * PANEL_NR);
            for (int r = 0; r < nr; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k_features + k]), w, acc[r]);
        }
        for (int r = 0; r < nr; r++)
            sums[r] = _mm512_add_ps(sums[r], acc[r]);
    }
    const int64_t width = n_features - n0 < PANEL_NR ? n_features - n0 : PANEL_NR;
    const __mmask16 mask = (__mmask16)((1u << width) - 1u);
    for (int r = 0; r < nr; r++) {
        const __m512 v = bias == NULL ? sums[r] : _mm512_add_ps(sums[r], _mm512_maskz_loadu_ps(mask, bias + n0));
        _mm512_mask_storeu_ps(y + r * n_features + n0, mask, v);
    }
}
#endif

/* panel_gemv where it is built (AVX-512, rows <= GEMV_ROWS), else gemm.c's GEMM: the same bits either way */
static void panel_gemv(const float *x, int64_t m_rows, int64_t k_features, const float *panels, const float *bias,
                       float *y, int64_t n_features, int num_threads)
{
#if GEMV_AVX512
    if (m_rows >= 1 && m_rows <= GEMV_ROWS) {
        const int64_t n_panels = (n_features + PANEL_NR - 1) / PANEL_NR;
        #pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < n_panels; p++) {
            const float *panel = panels + (size_t)(p * k_features * PANEL_NR);
            switch (m_rows) {  /* a constant row count: the accumulators stay in registers */
            case 1: panel_gemv_tile(x, 1, k_features, panel, bias, y, n_features, p * PANEL_NR); break;
            case 2: panel_gemv_tile(x, 2, k_features, panel, bias, y, n_features, p * PANEL_NR); break;
            case 3: panel_gemv_tile(x, 3, k_features, panel, bias, y, n_features, p * PANEL_NR); break;
            default: panel_gemv_tile(x, 4, k_features, panel, bias, y, n_features, p * PANEL_NR); break;
            }
        }
        return;
    }
#endif
    tessera_gemm_f32(x, m_rows, k_features, panels, bias, y, n_features, num_threads);
}

/* y [rows, out] = x [rows, in] W^T (+ b): the packed GEMM (x widened to float32 for a bf16 model) or gemv */
static inline __attribute__((always_inline)) void project(
    const step_t *s, const projection_t *p, const void *x, void *y, const lora_call_t *lora, const int bf16)
{
    if (p->qtype && !bf16) {
        tessera_qgemm(x, s->rows, p->in_features, p->weight, p->qtype, p->bias, y, p->out_features, p->fast,
                      s->num_threads);
    } else if (!p->packed) {
        gemv(x, s->rows, p->in_features, p->weight, p->bias, y, p->out_features, s->num_threads, lora, bf16);
        return;  /* lora's parts added in gemv's region */
    } else if (!bf16) {
        panel_gemv(x, s->rows, p->in_features, p->weight, p->bias, y, p->out_features, s->num_threads);
    } else {
        const int64_t n = s->rows * p->in_features;
        for (int64_t i = 0; i < n; i++)
            s->widened[i] = bf16_to_f32(((const bf16_t *)x)[i]);
        tessera_gemm_bf16(s->widened, s->rows, p->in_features, p->weight, p->bias, y, p->out_features,
                          s->num_threads);
    }
    if (lora != NULL)  /* the other paths: the parts in a region of their own */
        #pragma omp parallel num_threads(s->num_threads)
        lora_in_region(lora, x, bf16);
}

/* y[:, part columns] = x W^T (+ b) + LoRA(x) for each adapter group and each of the `count` LoRA parts
   from `first` (x [rows, in], y [rows, y_stride = the projection's out]): the projection, and the
   parts an adapter targets in the same parallel region where project's gemv runs it */
static inline __attribute__((always_inline)) void project_lora(
    const step_t *s, const layer_t *l, const projection_t *p, int first, int count, const void *x, void *y,
    const int bf16)
{
    bgmv_part_t parts[3];
    int64_t n = 0;
    for (int i = first; s->lora_groups != 0 && i < first + count; i++)
        if (l->lora[i].a != NULL)
            parts[n++] = (bgmv_part_t){l->lora[i].a, l->lora[i].bt, AT(y, l->lora[i].start, bf16), p->out_features,
                                       l->lora[i].out_features, l->lora[i].rank, l->lora[i].tiled};
    const lora_call_t lora = {s, parts, n, p->in_features};
    project(s, p, x, y, n == 0 ? NULL : &lora, bf16);
}

/* x += y over n values, each sum rounded to the dtype once */
static inline __attribute__((always_inline)) void residual_add(void *x, const void *y, int64_t n, const int bf16)
{
    if (bf16) {
        bf16_t *xb = x;
        const bf16_t *yb = y;
        for (int64_t i = 0; i < n; i++)
            xb[i] = f32_to_bf16(bf16_to_f32(xb[i]) + bf16_to_f32(yb[i]));
    } else {
        float *xf = x;
        const float *yf = y;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++)
            xf[i] += yf[i];
    }
}

static inline __attribute__((always_inline)) void rms_norm(const step_t *s, const void *x, const void *w, void *y,
                                                           int64_t rows, int64_t size, const int bf16)
{
    if (bf16)
        tessera_rms_norm_bf16(x, w, y, rows, size, s->eps, s->num_threads);
    else
        tessera_rms_norm_f32(x, w, y, rows, size, s->eps, s->num_threads);
}

static inline __attribute__((always_inline)) void rotary(const step_t *s, const void *x, int64_t row_stride, void *y,
                                                         int64_t heads, const int bf16)
{
    if (bf16)
        tessera_rotary_bf16(x, row_stride, y, s->cos, s->sin, s->rows, heads, s->head_dim, s->num_threads);
    else
        tessera_rotary_f32(x, row_stride, y, s->cos, s->sin, s->rows, heads, s->head_dim, s->num_threads);
}

static inline __attribute__((always_inline)) int decode_layer(const step_t *s, const layer_t *l, const int bf16)
{
    const int64_t rows = s->rows, hidden = s->hidden, d = s->head_dim, inter = s->intermediate;
    const int64_t q_width = s->num_heads * d, kv_width = s->num_kv_heads * d, qkv_width = q_width + 2 * kv_width;

    rms_norm(s, s->x, l->input_norm, s->h, rows, hidden, bf16);
    project_lora(s, l, &l->qkv, 0, 3, s->h, s->qkv, bf16);  /* LoRA: q, k, v */
    const void *q = s->qkv, *k = AT(s->qkv, q_width, bf16);
    int64_t q_stride = qkv_width, k_stride = qkv_width;
    if (l->q_norm != NULL) {  /* per head, over head_dim: each token's heads are contiguous rows */
        for (int64_t m = 0; m < rows; m++) {
            rms_norm(s, AT(s->qkv, m * qkv_width, bf16), l->q_norm, AT(s->qk, m * (q_width + kv_width), bf16),
                     s->num_heads, d, bf16);
            rms_norm(s, AT(s->qkv, m * qkv_width + q_width, bf16), l->k_norm,
                     AT(s->qk, m * (q_width + kv_width) + q_width, bf16), s->num_kv_heads, d, bf16);
        }
        q = s->qk, k = AT(s->qk, q_width, bf16);
        q_stride = k_stride = q_width + kv_width;
    }
    rotary(s, q, q_stride, s->q, s->num_heads, bf16);
    rotary(s, k, k_stride, s->k, s->num_kv_heads, bf16);
    const void *v = AT(s->qkv, q_width + kv_width, bf16);
    int rc;
    if (bf16) {
        tessera_write_kv_bf16(s->k, kv_width, v, qkv_width, s->slot_mapping, rows, s->num_kv_heads, d, s->num_slots,
                              l->k_cache, l->v_cache);
        rc = tessera_paged_decode_attention_bf16(
            s->q, l->k_cache, l->v_cache, s->attention_rows, s->block_tables, s->table_width, s->context_lens,
            s->attention, rows, s->num_heads, s->num_kv_heads, d, s->num_slots, s->block_size, s->max_context,
            s->scale, l->window, l->soft_cap, s->num_threads);
    } else if (s->kv_bf16) {
        tessera_write_kv_f32_bf16kv(s->k, kv_width, v, qkv_width, s->slot_mapping, rows, s->num_kv_heads, d,
                                    s->num_slots, l->k_cache, l->v_cache);
        rc = tessera_paged_decode_attention_f32_bf16kv(
            s->q, l->k_cache, l->v_cache, s->attention_rows, s->block_tables, s->table_width, s->context_lens,
            s->attention, rows, s->num_heads, s->num_kv_heads, d, s->num_slots, s->block_size, s->max_context,
            s->scale, l->window, l->soft_cap, s->num_threads);
    } else {
        tessera_write_kv_f32(s->k, kv_width, v, qkv_width, s->slot_mapping, rows, s->num_kv_heads, d, s->num_slots,
                             l->k_cache, l->v_cache);
        rc = tessera_paged_decode_attention_f32(
            s->q, l->k_cache, l->v_cache, s->attention_rows, s->block_tables, s->table_width, s->context_lens,
            s->attention, rows, s->num_heads, s->num_kv_heads, d, s->num_slots, s->block_size, s->max_context,
            s->scale, l->window, l->soft_cap, s->num_threads);
    }
    if (rc != 0)
        return rc;
    project_lora(s, l, &l->o, 3, 1, s->attention, s->out, bf16);
    residual_add(s->x, s->out, rows * hidden, bf16);

    rms_norm(s, s->x, l->post_norm, s->h, rows, hidden, bf16);
    project_lora(s, l, &l->gate_up, 4, 2, s->h, s->gate_up, bf16);  /* LoRA: gate, up */
    if (bf16)
        tessera_silu_mul_bf16(s->gate_up, 2 * inter, s->act, rows, inter, s->num_threads);
    else
        tessera_silu_mul_f32(s->gate_up, 2 * inter, s->act, rows, inter, s->num_threads);
    project_lora(s, l, &l->down, 6, 1, s->act, s->out, bf16);
    residual_add(s->x, s->out, rows * hidden, bf16);
    return 0;
}

/* A step's inputs from its token ids and positions (decode_step.py FusedDecode.run_ids): x[r] =
   embedding[ids[r]] (the embedding lookup), cos/sin[r] = cos_table/sin_table[positions[r]] (rotary.py's
   table rows, its cos_sin values). Copies, so the bits are the torch path's. At batch 1 the torch ops
   this replaces ran cold after the weights streamed through the caches (~60-120 us a token on a 2-core
   AMD EPYC). Returns 0, or -3 for an id outside [0, vocab) or a position outside [0, table_positions). */
static int gather_inputs(const step_t *s, const int bf16)
{
    const size_t element = bf16 ? sizeof(bf16_t) : sizeof(float);
    const size_t row = (size_t)s->hidden * element, angles = (size_t)s->head_dim * element;
    for (int64_t r = 0; r < s->rows; r++) {
        const int64_t id = s->ids[r], position = s->positions[r];
        if (id < 0 || id >= s->vocab || position < 0 || position >= s->table_positions)
            return -3;
        memcpy((char *)s->x + r * row, (const char *)s->embedding + id * row, row);
        memcpy((char *)s->cos + r * angles, (const char *)s->cos_table + position * angles, angles);
        memcpy((char *)s->sin + r * angles, (const char *)s->sin_table + position * angles, angles);
    }
    return 0;
}

static inline __attribute__((always_inline)) int decode_step(const layer_t *layers, int64_t num_layers,
                                                              const step_t *step, const int bf16)
{
    if (step->rows > MAX_ROWS)
        return -2;
    if (step->ids != NULL) {
        const int rc = gather_inputs(step, bf16);
        if (rc != 0)
            return rc;
    }
    for (int64_t i = 0; i < num_layers; i++) {
        const int rc = decode_layer(step, &layers[i], bf16);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* Every layer of `layers` in order over step->x (gathered first where step->ids is set). Returns 0, -1
   when the attention kernel could not allocate its score buffers, -2 for more than MAX_ROWS rows (the
   caller checks both first), -3 for an id or position outside the tables (`gather_inputs`). */
int tessera_decode_step_f32(const layer_t *layers, int64_t num_layers, const step_t *step)
{
    return decode_step(layers, num_layers, step, 0);
}

/* the same for a bfloat16 model (activations, weights, caches and factors bf16) */
int tessera_decode_step_bf16(const layer_t *layers, int64_t num_layers, const step_t *step)
{
    return decode_step(layers, num_layers, step, 1);
}

/* y [rows, out] = x [rows, in] W^T (+ b) over a row-major W [out, in]: the gemv above, for tests and
   benchmarks (rows <= MAX_ROWS not required here) */
void tessera_gemv_f32(const float *x, int64_t m_rows, int64_t k_features, const float *weight, const float *bias,
                      float *y, int64_t n_features, int num_threads)
{
    gemv(x, m_rows, k_features, weight, bias, y, n_features, num_threads, NULL, 0);
}

void tessera_gemv_bf16(const bf16_t *x, int64_t m_rows, int64_t k_features, const bf16_t *weight,
                       const bf16_t *bias, bf16_t *y, int64_t n_features, int num_threads)
{
    gemv(x, m_rows, k_features, weight, bias, y, n_features, num_threads, NULL, 1);
}

/* the fused step's float32 projection over packed panels (panel_gemv): for tests and benchmarks */
void tessera_panel_gemv_f32(const float *x, int64_t m_rows, int64_t k_features, const float *panels,
                            const float *bias, float *y, int64_t n_features, int num_threads)
{
    panel_gemv(x, m_rows, k_features, panels, bias, y, n_features, num_threads);
}

/* The float32 logits of a decode step's sampled rows, the model's last steps in one call
   (decode_step.py FusedDecode.logits; model_runner.py's logits path for other steps):
       normed = rms_norm(x, norm_weight)             the layers' RMSNorm
       y = normed head^T                             `project`: the GEMV, panel_gemv or the GGUF blocks'
                                                     GEMM, as the module path; y of the model's dtype
       logits = float32(y)                           widened, as `.float()`
   then per row: NaN over the whole row where the residual's float32 statistic sum(x^2) / hidden is not
   finite (RMSNorm would scale such a row to zeros and give flat, finite logits: model_runner.logits),
   and finite[r] = 1 where every logit of the row is finite, else 0; greedy[r] the index of the row's
   largest logit, the first of equal ones (torch.max(dim=-1)'s index; -1 for a row not finite). x [rows,
   hidden], rows <= MAX_ROWS; normed [rows, hidden] and y [rows, vocab] (bf16 only) scratch of the model's
   dtype, widened float32 [rows, hidden] (a packed bf16 head), logits float32 [rows, vocab], finite uint8
   [rows], greedy int64 [rows]. After the weights stream through the caches, the ten torch ops this
   replaces ran cold: ~0.3 ms a token at batch 1 on a 2-core AMD EPYC (an op 10-80 us where it takes 1-10
   us warm); the sampler's max over the logits another 30-50 us. */
static int64_t first_argmax(const float *row, int64_t n)
{
    int64_t v = 0, best_index = 0;
    float best = row[0];
#if GEMV_AVX512
    if (n >= 16) {  /* per lane: its largest value and the first index holding it; then the first lane's */
        __m512 lane_best = _mm512_loadu_ps(row);
        __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i index = lane_index;
        const __m512i step = _mm512_set1_epi32(16);
        for (v = 16; v + 16 <= n && v <= INT32_MAX - 16; v += 16) {
            index = _mm512_add_epi32(index, step);
            const __m512 values = _mm512_loadu_ps(row + v);
            const __mmask16 larger = _mm512_cmp_ps_mask(values, lane_best, _CMP_GT_OQ);
            lane_best = _mm512_mask_mov_ps(lane_best, larger, values);
            lane_index = _mm512_mask_mov_epi32(lane_index, larger, index);
        }
        best = _mm512_reduce_max_ps(lane_best);
        const __mmask16 holding = _mm512_cmp_ps_mask(lane_best, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_index = _mm512_mask_reduce_min_epi32(holding, lane_index);
    }
#endif
    for (; v < n; v++)
        if (row[v] > best) {
            best = row[v];
            best_index = v;
        }
    return best_index;
}

static inline __attribute__((always_inline)) void decode_logits(
    const projection_t *head, const void *x, int64_t rows, const void *norm_weight, float eps, void *normed,
    void *y, float *logits, uint8_t *finite, int64_t *greedy, float *widened, int num_threads, const int bf16)
{
    const int64_t hidden = head->in_features, vocab = head->out_features;
    if (bf16)
        tessera_rms_norm_bf16(x, norm_weight, normed, rows, hidden, eps, 1);
    else
        tessera_rms_norm_f32(x, norm_weight, normed, rows, hidden, eps, 1);
    const step_t s = {.rows = rows, .widened = widened, .num_threads = num_threads};
    project(&s, head, normed, bf16 ? y : (void *)logits, NULL, bf16);
    for (int64_t r = 0; r < rows; r++) {
        float sum = 0.f;
        for (int64_t d = 0; d < hidden; d++) {
            const float v = bf16 ? bf16_to_f32(((const bf16_t *)x)[r * hidden + d]) : ((const float *)x)[r * hidden + d];
            sum += v * v;
        }
        float *row = logits + r * vocab;
        if (!isfinite(sum / (float)hidden)) {
            for (int64_t v = 0; v < vocab; v++)
                row[v] = NAN;
            finite[r] = 0;
            greedy[r] = -1;
            continue;
        }
        int all = 1;
        if (bf16) {
            const bf16_t *yr = (const bf16_t *)y + r * vocab;
            for (int64_t v = 0; v < vocab; v++) {
                row[v] = bf16_to_f32(yr[v]);
                all &= isfinite(row[v]) != 0;
            }
        } else {
            for (int64_t v = 0; v < vocab; v++)
                all &= isfinite(row[v]) != 0;
        }
        finite[r] = (uint8_t)all;
        greedy[r] = all ? first_argmax(row, vocab) : -1;
    }
}

void tessera_decode_logits_f32(const projection_t *head, const float *x, int64_t rows, const float *norm_weight,
                               float eps, float *normed, float *logits, uint8_t *finite, int64_t *greedy,
                               int num_threads)
{
    decode_logits(head, x, rows, norm_weight, eps, normed, NULL, logits, finite, greedy, NULL, num_threads, 0);
}

void tessera_decode_logits_bf16(const projection_t *head, const bf16_t *x, int64_t rows, const bf16_t *norm_weight,
                                float eps, bf16_t *normed, bf16_t *y, float *logits, uint8_t *finite, int64_t *greedy,
                                float *widened, int num_threads)
{
    decode_logits(head, x, rows, norm_weight, eps, normed, y, logits, finite, greedy, widened, num_threads, 1);
}

int64_t tessera_decode_max_rows(void) { return MAX_ROWS; }

/* "avx512" where gemv's float32 loop is AVX-512 code, else "portable" (omp simd) */
const char *tessera_gemv_variant(void) { return GEMV_AVX512 ? "avx512" : "portable"; }
