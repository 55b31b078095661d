/* fp8.c — FP8 E4M3 (OCP E4M3FN) element conversions and the CPU quantizer:
 * f32/f16/bf16 tensors to E4M3 codes plus one float scale per group. This
 * file is the definition; every other backend's quantizer must match it bit
 * for bit (the CUDA one is src/cuda/cuda_fp8.cu). The public entry points,
 * which validate and pick the backend, are in quantize.c. */
#include "fp8.h"

#include <math.h>

#define INVALID(...) fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, __VA_ARGS__)

/* ------------------------------------------------------------ conversions */

uint8_t fmha_f32_to_e4m3(float x)
{
    uint32_t u = fmha_f32_to_bits(x);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return (uint8_t)(sign | 0x7fu);
    if (a >= 0x43e00000u) /* >= 448 (inf too): E4M3FN has no infinity, so saturate */
        return (uint8_t)(sign | 0x7eu);
    if (a >= 0x3c800000u) { /* >= 2^-6, normal: keep 3 of 23 mantissa bits, ties to even */
        uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
        return (uint8_t)(sign | ((r >> 20) - (120u << 3))); /* rebias 127 -> 7 */
    }
    /* Subnormal code m is m * 2^-9, so round |x| * 2^9 = man * 2^(e - 141) to
     * an integer, ties to even (m = 8 carries into the smallest normal, 0x08).
     * Integer arithmetic keeps this independent of the FPU rounding mode. */
    uint32_t e = a >> 23;
    uint32_t man = e ? (a & 0x7fffffu) | 0x800000u : a;
    uint32_t shift = 141u - (e ? e : 1u); /* >= 21 here */
    if (shift > 24)                       /* man < 2^24 <= half: below 2^-10 */
        return sign;
    uint32_t q = man >> shift, rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
    q += rem > half || (rem == half && (q & 1u));
    return (uint8_t)(sign | q);
}

float fmha_e4m3_to_f32(uint8_t x)
{
    return fmha_e4m3_to_f32_inline(x);
}

/* --------------------------------------------------------------- quantizer */

/* The rows (b, s, h) of one scaling group: [b0, b1) x [s0, s1) x [h0, h1). */
typedef struct fp8_group {
    int64_t b0, b1, s0, s1, h0, h1;
} fp8_group;

static const char *row_of(const fmha_tensor *t, int64_t b, int64_t s, int64_t h)
{
    const int64_t es = (int64_t)fmha_dtype_size(t->dtype);
    return (const char *)t->data + fmha_tensor_offset(t, b, s, h) * es;
}

/* The first infinite element in (batch, token, head, dim) order, if any. */
/* Groups this large spread over OpenMP threads (both passes give the same
 * bits on any thread count: max is exact and elements are independent). */
static int parallel_worth(const fmha_tensor *x, const fp8_group *g)
{
    return (double)(g->b1 - g->b0) * (double)(g->s1 - g->s0) * (double)(g->h1 - g->h0) *
               (double)x->head_dim >=
           65536.0;
}

static int find_inf(const fmha_tensor *x, int64_t at[4])
{
    /* The first infinite element by (batch, token) row, found in parallel. */
    int64_t first = INT64_MAX;
    const fp8_group all = {0, x->batch, 0, x->seqlen, 0, x->heads};
#pragma omp parallel for collapse(2) reduction(min : first) if (parallel_worth(x, &all))
    for (int64_t b = 0; b < x->batch; b++)
        for (int64_t s = 0; s < x->seqlen; s++)
            for (int64_t h = 0; h < x->heads && b * x->seqlen + s < first; h++) {
                const char *row = row_of(x, b, s, h);
                for (int64_t c = 0; c < x->head_dim; c++)
                    if (isinf(fmha_load_f32(row, x->dtype, c))) {
                        first = b * x->seqlen + s;
                        break;
                    }
            }
    if (first == INT64_MAX)
        return 0;
    at[0] = first / x->seqlen, at[1] = first % x->seqlen;
    for (int64_t h = 0; h < x->heads; h++) {
        const char *row = row_of(x, at[0], at[1], h);
        for (int64_t c = 0; c < x->head_dim; c++)
            if (isinf(fmha_load_f32(row, x->dtype, c))) {
                at[2] = h, at[3] = c;
                return 1;
            }
    }
    return 0; /* not reached */
}

static float group_amax(const fmha_tensor *x, const fp8_group *g)
{
    float amax = 0.0f;
#pragma omp parallel for collapse(2) reduction(max : amax) if (parallel_worth(x, g))
    for (int64_t b = g->b0; b < g->b1; b++)
        for (int64_t s = g->s0; s < g->s1; s++)
            for (int64_t h = g->h0; h < g->h1; h++) {
                const char *row = row_of(x, b, s, h);
                for (int64_t c = 0; c < x->head_dim; c++) {
                    float v = fabsf(fmha_load_f32(row, x->dtype, c));
                    if (v > amax) /* NaN compares false: ignored */
                        amax = v;
                }
            }
    return amax;
}

static void group_quantize(const fmha_tensor *x, const fmha_tensor *y, const fp8_group *g,
                           float scale)
{
#pragma omp parallel for collapse(2) if (parallel_worth(x, g))
    for (int64_t b = g->b0; b < g->b1; b++)
        for (int64_t s = g->s0; s < g->s1; s++)
            for (int64_t h = g->h0; h < g->h1; h++) {
                const char *xrow = row_of(x, b, s, h);
                uint8_t *yrow = (uint8_t *)y->data + fmha_tensor_offset(y, b, s, h);
                for (int64_t c = 0; c < x->head_dim; c++) {
                    float v = fmha_load_f32(xrow, x->dtype, c);
                    yrow[c] = fmha_f32_to_e4m3(isnan(v) ? v : v / scale);
                }
            }
}

/* The definition every backend reproduces bit for bit:
 *   amax  = max |x| over the group in float, NaN elements ignored;
 *   scale = amax / 448.0f, an IEEE float division; 1 when that is 0 (an
 *           all-zero or all-NaN group, or amax so small the quotient underflows);
 *   y     = fmha_f32_to_e4m3(x / scale), again a correctly rounded float
 *           division: no reciprocal multiply, no fast-math, subnormals kept
 *           (CUDA: no -ftz / --use_fast_math, plain '/' or __fdiv_rn);
 *           a NaN x skips the division and keeps its own sign (0x7F / 0xFF),
 *           since GPUs return a canonical positive NaN from NaN / scale. */
fmha_status fmha_fp8_quantize_cpu(const fmha_tensor *x, const fmha_tensor *y, float *scales,
                                  const fmha_fp8_groups *g_, void *stream)
{
    (void)stream;
    const fmha_fp8_groups gr = *g_;
    /* An infinity would make amax, and so every code of its group, meaningless. */
    int64_t at[4];
    if (find_inf(x, at))
        return INVALID("x[%lld, %lld, %lld, %lld] is infinite: FP8 scaling needs finite inputs "
                       "(NaN is allowed and stays NaN)",
                       (long long)at[0], (long long)at[1], (long long)at[2], (long long)at[3]);

    const int64_t bw = gr.batch_span, hw = gr.head_span, rows = gr.rows;
    for (int64_t gb = 0; gb < gr.n_batch; gb++)
        for (int64_t gh = 0; gh < gr.n_head; gh++)
            for (int64_t k = 0; k < gr.n_block; k++) {
                int64_t s0 = k * rows;
                fp8_group g = {gb * bw, gb * bw + bw,
                               s0,      rows >= x->seqlen - s0 ? x->seqlen : s0 + rows,
                               gh * hw, gh * hw + hw};
                float scale = group_amax(x, &g) / 448.0f;
                if (scale == 0.0f)
                    scale = 1.0f;
                scales[(gb * gr.n_head + gh) * gr.n_block + k] = scale;
                group_quantize(x, y, &g, scale);
            }
    return FMHA_STATUS_OK;
}
