/* cpu_backend.c — the CPU backend's table of operations (backend.h): the
 * flash-attention drivers (cpu_flash.c, cpu_backward.c), the FP8 quantizer (fp8.c) and the
 * fp8_smooth_k steps, all on host memory. */
#include "../alloc.h"
#include "cpu.h"
#include "cpu_merge.h"
#include "../backend.h"
#include "../fp8.h"

#include <stdlib.h>

static fmha_status cpu_check_device(void)
{
    return FMHA_STATUS_OK;
}

static int cpu_level(void)
{
    return (int)fmha_cpu_isa_detect();
}

static int cpu_preferred_level(void)
{
    return (int)fmha_cpu_isa_auto();
}

static int cpu_runs_sm90a(void)
{
    return 0;
}

static fmha_status cpu_plan_variant(fmha_plan *plan)
{
    plan->head_dim_variant = 0;
    plan->tile_m = FMHA_CPU_BR;
    plan->tile_n = FMHA_CPU_BC;
    plan->max_cluster = 1;
    return FMHA_STATUS_OK;
}

static fmha_status cpu_forward(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws)
{
    fmha_cpu_workspace w = {ws->buf, ws->size};
    fmha_status st = fmha_cpu_forward(pb, &plan->kernel->info, &w);
    ws->buf = w.buf;
    ws->size = w.size;
    return st;
}

static fmha_status cpu_backward(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws)
{
    fmha_cpu_workspace w = {ws->buf, ws->size};
    fmha_status st = fmha_cpu_backward(pb, &plan->kernel->info, &w);
    ws->buf = w.buf;
    ws->size = w.size;
    return st;
}

static fmha_status cpu_alloc(void **ptr, size_t bytes)
{
    if (!(*ptr = fmha_malloc(bytes)))
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                              "out of memory reserving %zu bytes of scratch", bytes);
    return FMHA_STATUS_OK;
}

/* The heap has no stream to order by: the same as cpu_alloc. */
static fmha_status cpu_scratch(void **ptr, size_t bytes, void *stream)
{
    (void)stream;
    return cpu_alloc(ptr, bytes);
}

static void cpu_scratch_free(void *ptr, void *stream)
{
    (void)stream;
    fmha_free(ptr);
}

static size_t cpu_smooth_k_scratch(const fmha_tensor *k)
{
    return (size_t)k->head_dim * sizeof(double);
}

/* fp8_smooth_k: k less its mean over the tokens of each (batch entry, KV
 * head, channel), as contiguous f32 into ks (NULL: the means alone), the means into mean
 * [batch][heads][d]; `acc` holds head_dim doubles. (CUDA: cuda_fp8.cu, the
 * same steps.) */
static fmha_status cpu_smooth_k(const fmha_tensor *k, float *ks, float *mean, void *scratch,
                                void *stream)
{
    double *acc = scratch;
    const int64_t nb = k->batch, ns = k->seqlen, nh = k->heads, d = k->head_dim;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t h = 0; h < nh; h++) {
            for (int64_t c = 0; c < d; c++)
                acc[c] = 0.0;
            for (int64_t s = 0; s < ns; s++) {
                const char *row = fmha_row(k, b, s, h);
                for (int64_t c = 0; c < d; c++)
                    acc[c] += fmha_load_f32(row, k->dtype, c);
            }
            float *m = mean + (b * nh + h) * d;
            for (int64_t c = 0; c < d; c++)
                m[c] = ns > 0 ? (float)(acc[c] / (double)ns) : 0.0f;
            for (int64_t s = 0; ks && s < ns; s++) {
                const char *row = fmha_row(k, b, s, h);
                float *out = ks + ((b * ns + s) * nh + h) * d;
                for (int64_t c = 0; c < d; c++)
                    out[c] = fmha_load_f32(row, k->dtype, c) - m[c];
            }
        }
    return FMHA_STATUS_OK;
}

/* The LSE of the unsmoothed scores: every score of query row q moved by
 * -scale * (q . mean of its KV head), so its LSE did too. */
static fmha_status cpu_unsmooth_lse(const fmha_problem *pb, const fmha_tensor *q, float *lse_all,
                                    const float *mean, void *stream)
{
    const int64_t nh = pb->heads, d = pb->d, nb = q->batch, ns = q->seqlen;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t h = 0; h < nh; h++) {
            const float *m = mean + (b * pb->kv_heads + h / pb->group) * d;
            float *lse = lse_all + (b * nh + h) * ns; /* packed: b = 0, [heads, total_q] */
            for (int64_t s = 0; s < ns; s++) {
                const char *row = fmha_row(q, b, s, h);
                double dot = 0.0;
                for (int64_t c = 0; c < d; c++)
                    dot += (double)fmha_load_f32(row, q->dtype, c) * m[c];
                lse[s] = (float)(lse[s] + pb->scale * dot);
            }
        }
    return FMHA_STATUS_OK;
}

static fmha_status cpu_count_non_finite(const fmha_tensor *t, int64_t *count, int64_t first[4],
                                        void *stream)
{
    (void)stream;
    *count = 0;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++) {
                const char *row = fmha_row(t, b, s, h);
                for (int64_t c = 0; c < t->head_dim; c++) {
                    if (isfinite(fmha_load_f32(row, t->dtype, c)))
                        continue;
                    if ((*count)++ == 0) {
                        first[0] = b, first[1] = s, first[2] = h, first[3] = c;
                    }
                }
            }
    return FMHA_STATUS_OK;
}

const fmha_backend fmha_cpu_backend = {
    .device = FMHA_DEVICE_CPU,
    .name = "cpu",
    .check_device = cpu_check_device,
    .level = cpu_level,
    .preferred_level = cpu_preferred_level,
    .runs_sm90a = cpu_runs_sm90a,
    .plan_variant = cpu_plan_variant,
    .host_cu_seqlens = NULL,
    .forward = cpu_forward,
    .count_non_finite = cpu_count_non_finite,
    .alloc = cpu_alloc,
    .free = fmha_free,
    .scratch = cpu_scratch,
    .scratch_free = cpu_scratch_free,
    .quantize_fp8 = fmha_fp8_quantize_cpu,
    .smooth_k_scratch = cpu_smooth_k_scratch,
    .smooth_k = cpu_smooth_k,
    .unsmooth_lse = cpu_unsmooth_lse,
    .host_kvcache = NULL,
    .kv_append = fmha_cpu_kv_append,
    .merge = fmha_cpu_merge,
    .copy = fmha_cpu_copy,
    .fill_f32 = fmha_cpu_fill_f32,
    .backward = cpu_backward,
};
