/* cpu_kvcache.c — the CPU side of a decode call before its attention: the
 * new keys and values written into their caches (rows or pages), with the
 * rotary embedding applied to the keys on the way, and q rotated into the
 * layer's copy. Rotation is in f32, each result rounded once to the
 * tensor's dtype; FP8 caches take fmha_f32_to_e4m3(value / descale). */
#include "cpu.h"

/* Channel c of row src (of dtype) as f32, rotated at pos where c is one of
 * the first a->rotary_dim channels. */
static float rotated_at(const fmha_kvcache_args *a, const void *src, fmha_dtype dtype, int64_t c,
                        int64_t pos)
{
    if (c >= a->rotary_dim)
        return fmha_load_f32(src, dtype, c);
    const int64_t half = a->rotary_dim / 2, pc = a->rotary_interleaved ? c / 2 : c % half;
    int64_t c1, c2;
    fmha_rotary_pair(a->rotary_dim, a->rotary_interleaved, pc, &c1, &c2);
    const float x1 = fmha_load_f32(src, dtype, c1), x2 = fmha_load_f32(src, dtype, c2);
    const float cs = a->rotary_cos[pos * half + pc], sn = a->rotary_sin[pos * half + pc];
    return c == c1 ? x1 * cs - x2 * sn : x1 * sn + x2 * cs;
}

/* Row src (n channels of dtype, rotated at pos where a has rotary and
 * `rotate`) into an FP8 cache row as codes of value / descale. */
static void quantize_row(const fmha_kvcache_args *a, uint8_t *dst, const void *src,
                         fmha_dtype dtype, int64_t n, int64_t pos, int rotate, float descale)
{
    for (int64_t c = 0; c < n; c++)
        dst[c] = fmha_f32_to_e4m3(
            (rotate ? rotated_at(a, src, dtype, c, pos) : fmha_load_f32(src, dtype, c)) / descale);
}

/* Row `src` of n channels rotated at `pos` into `dst` (both of `dtype`):
 * pairs of the first a->rotary_dim channels, the rest copied. */
static void rotate_row(const fmha_kvcache_args *a, void *dst, const void *src, fmha_dtype dtype,
                       int64_t n, int64_t pos)
{
    const int64_t half = a->rotary_dim / 2;
    const float *cos_row = a->rotary_cos + pos * half, *sin_row = a->rotary_sin + pos * half;
    float x[2];
    for (int64_t c = 0; c < half; c++) {
        int64_t c1, c2;
        fmha_rotary_pair(a->rotary_dim, a->rotary_interleaved, c, &c1, &c2);
        x[0] = fmha_load_f32(src, dtype, c1);
        x[1] = fmha_load_f32(src, dtype, c2);
        fmha_store_f32(dst, dtype, c1, x[0] * cos_row[c] - x[1] * sin_row[c]);
        fmha_store_f32(dst, dtype, c2, x[0] * sin_row[c] + x[1] * cos_row[c]);
    }
    const size_t elem = fmha_dtype_size(dtype);
    memcpy((char *)dst + a->rotary_dim * elem, (const char *)src + a->rotary_dim * elem,
           (size_t)(n - a->rotary_dim) * elem);
}

fmha_status fmha_cpu_kv_append(const fmha_problem *pb, const fmha_kvcache_args *a,
                               const fmha_tensor *q_rot)
{
    const fmha_tensor *kc = &pb->args->k, *vc = &pb->args->v;
    const size_t kbytes = (size_t)pb->d * fmha_dtype_size(kc->dtype);
    const size_t vbytes = (size_t)pb->dv * fmha_dtype_size(vc->dtype);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < pb->batch; b++) {
        for (int64_t i = 0; i < pb->seqlen_new; i++) {
            const int64_t pos = fmha_cache_keys(pb, b) - pb->seqlen_new + i;
            for (int64_t h = 0; h < pb->kv_heads; h++) {
                const char *kn = fmha_row(&a->k_new, b, i, h);
                char *kd = fmha_kv_row(pb, kc, b, pos, h);
                if (kc->dtype == FMHA_DTYPE_F8_E4M3) {
                    quantize_row(a, (uint8_t *)kd, kn, a->k_new.dtype, pb->d, pos,
                                 a->rotary_dim > 0, fmha_row_descale(pb, 1, b, pos, h));
                    quantize_row(a, (uint8_t *)fmha_kv_row(pb, vc, b, pos, h),
                                 fmha_row(&a->v_new, b, i, h), a->v_new.dtype, pb->dv, pos, 0,
                                 fmha_row_descale(pb, 2, b, pos, h));
                    continue;
                }
                if (a->rotary_dim > 0)
                    rotate_row(a, kd, kn, kc->dtype, pb->d, pos);
                else
                    memcpy(kd, kn, kbytes);
                memcpy(fmha_kv_row(pb, vc, b, pos, h), fmha_row(&a->v_new, b, i, h), vbytes);
            }
        }
    }
    if (a->rotary_dim == 0)
        return FMHA_STATUS_OK;
    for (int64_t b = 0; b < pb->batch; b++) {
        const int64_t cached = fmha_cache_keys(pb, b) - pb->seqlen_new;
        for (int64_t i = 0; i < a->q.seqlen; i++)
            for (int64_t h = 0; h < pb->heads; h++)
                rotate_row(a, fmha_row(q_rot, b, i, h), fmha_row(&a->q, b, i, h), a->q.dtype, pb->d,
                           fmha_rotary_q_pos(pb->cfg, cached, i));
    }
    return FMHA_STATUS_OK;
}
