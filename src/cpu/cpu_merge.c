/* cpu_merge.c — the CPU's operations between attention calls (backend.h):
 * merging partial outputs by their LSEs, copying views across dtypes, and
 * filling LSE arrays. Sequence parallelism (src/sp/) runs on these, and
 * fmha_merge_partials is the first of them. */
#include "cpu_merge.h"
#include "../internal.h"

#include <math.h>

/* One query row of the merge: out = sum_i w_i o_i / sum_i w_i with w_i =
 * exp(lse_i - max lse), in f32. A part of LSE -inf saw no key: it weighs 0
 * and is not read, so a row that no part saw is out 0, LSE -inf. A NaN LSE,
 * or +inf (whose weight is inf - inf), makes the row NaN, and a NaN in a part
 * that weighs something spreads as in the forward (docs/reliability.md). */
static void merge_row(const fmha_merge_problem *mp, int64_t b, int64_t s, int64_t h)
{
    float lse[FMHA_MERGE_MAX_PARTS], w[FMHA_MERGE_MAX_PARTS];
    float m = -INFINITY;
    int nan = 0;
    for (int i = 0; i < mp->n; i++) {
        const fmha_lse_view *v = &mp->lses[i];
        lse[i] = v->data[b * v->stride_batch + h * v->stride_head + s];
        if (isnan(lse[i]) || lse[i] == INFINITY)
            nan = 1;
        else if (lse[i] > m)
            m = lse[i];
    }
    const int64_t dv = mp->out.head_dim;
    char *orow = fmha_row(&mp->out, b, s, h);
    float total;
    if (nan || m == -INFINITY) {
        const float fill = nan ? NAN : 0.0f;
        for (int64_t c = 0; c < dv; c++)
            fmha_store_f32(orow, mp->out.dtype, c, fill);
        total = nan ? NAN : -INFINITY;
    } else {
        float sum = 0.0f;
        for (int i = 0; i < mp->n; i++) {
            w[i] = lse[i] == -INFINITY ? 0.0f : expf(lse[i] - m);
            sum += w[i];
        }
        for (int i = 0; i < mp->n; i++)
            w[i] /= sum;
        /* Each element reads every part before it is written, so out may be
         * one part's own view. */
        for (int64_t c = 0; c < dv; c++) {
            float acc = 0.0f;
            for (int i = 0; i < mp->n; i++)
                if (lse[i] != -INFINITY)
                    acc += w[i] *
                           fmha_load_f32(fmha_row(&mp->parts[i], b, s, h), mp->parts[i].dtype, c);
            fmha_store_f32(orow, mp->out.dtype, c, acc);
        }
        total = m + logf(sum);
    }
    if (mp->lse.data)
        mp->lse.data[b * mp->lse.stride_batch + h * mp->lse.stride_head + s] = total;
}

fmha_status fmha_cpu_merge(const fmha_merge_problem *mp, void *stream)
{
    (void)stream;
    const fmha_tensor *o = &mp->out;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < o->batch; b++)
        for (int64_t s = 0; s < o->seqlen; s++)
            for (int64_t h = 0; h < o->heads; h++)
                merge_row(mp, b, s, h);
    return FMHA_STATUS_OK;
}

fmha_status fmha_cpu_copy(const fmha_tensor *dst, const fmha_tensor *src, void *stream)
{
    (void)stream;
    const int64_t d = dst->head_dim;
    const size_t row_bytes = (size_t)d * fmha_dtype_size(dst->dtype);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < dst->batch; b++)
        for (int64_t s = 0; s < dst->seqlen; s++)
            for (int64_t h = 0; h < dst->heads; h++) {
                char *to = fmha_row(dst, b, s, h);
                const char *from = fmha_row(src, b, s, h);
                if (dst->dtype == src->dtype)
                    memcpy(to, from, row_bytes);
                else
                    for (int64_t c = 0; c < d; c++)
                        fmha_store_f32(to, dst->dtype, c, fmha_load_f32(from, src->dtype, c));
            }
    return FMHA_STATUS_OK;
}

fmha_status fmha_cpu_fill_f32(float *p, int64_t n, float value, void *stream)
{
    (void)stream;
    for (int64_t i = 0; i < n; i++)
        p[i] = value;
    return FMHA_STATUS_OK;
}
