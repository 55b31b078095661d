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

/* Row src (n channels of sdt) into row dst of ddt, rotated at pos where
 * `rotate` (channels past a->rotary_dim as they are): each value rounded
 * once to ddt, or for an FP8 row the code of value / descale; a row that
 * neither rotates nor converts is copied. */
static void put_row(const fmha_kvcache_args *a, void *dst, fmha_dtype ddt, const void *src,
                    fmha_dtype sdt, int64_t n, int64_t pos, int rotate, float descale)
{
    if (!rotate && ddt == sdt) {
        memcpy(dst, src, (size_t)n * fmha_dtype_size(sdt));
        return;
    }
    for (int64_t c = 0; c < n; c++) {
        const float x = rotate ? rotated_at(a, src, sdt, c, pos) : fmha_load_f32(src, sdt, c);
        if (ddt == FMHA_DTYPE_F8_E4M3)
            ((uint8_t *)dst)[c] = fmha_f32_to_e4m3(x / descale);
        else
            fmha_store_f32(dst, ddt, c, x);
    }
}

fmha_status fmha_cpu_kv_append(const fmha_problem *pb, const fmha_kvcache_args *a,
                               const fmha_tensor *q_rot)
{
    const fmha_tensor *kc = &pb->args->k, *vc = &pb->args->v;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < pb->batch; b++) {
        for (int64_t i = 0; i < pb->seqlen_new; i++) {
            const int64_t pos = fmha_cache_keys(pb, b) - pb->seqlen_new + i;
            for (int64_t h = 0; h < pb->kv_heads; h++) {
                put_row(a, fmha_kv_row(pb, kc, b, pos, h), kc->dtype, fmha_row(&a->k_new, b, i, h),
                        a->k_new.dtype, pb->d, pos, a->rotary_dim > 0,
                        fmha_row_descale(pb, 1, b, pos, h));
                put_row(a, fmha_kv_row(pb, vc, b, pos, h), vc->dtype, fmha_row(&a->v_new, b, i, h),
                        a->v_new.dtype, pb->dv, pos, 0, fmha_row_descale(pb, 2, b, pos, h));
            }
        }
    }
    if (a->rotary_dim == 0)
        return FMHA_STATUS_OK;
    for (int64_t b = 0; b < pb->batch; b++) {
        const int64_t cached = fmha_cache_keys(pb, b) - pb->seqlen_new;
        for (int64_t i = 0; i < a->q.seqlen; i++)
            for (int64_t h = 0; h < pb->heads; h++)
                put_row(a, fmha_row(q_rot, b, i, h), a->q.dtype, fmha_row(&a->q, b, i, h),
                        a->q.dtype, pb->d, fmha_rotary_q_pos(pb->cfg, cached, i), 1, 1.0f);
    }
    return FMHA_STATUS_OK;
}
