/* cpu_ops_scalar.c — portable C micro-kernels for the CPU driver: any CPU,
 * plain loops, the same tile contracts as the SIMD versions (cpu.h); loads
 * and store from cpu_ops_io.h over this file's to_f32. */
#include "cpu.h"

#include <math.h>

enum { BR = FMHA_CPU_BR };

static void to_f32(float *dst, const void *src, fmha_dtype dtype, int64_t n, float descale)
{
    if (dtype == FMHA_DTYPE_F8_E4M3) {
        for (int64_t i = 0; i < n; i++)
            dst[i] = fmha_e4m3_to_f32(((const uint8_t *)src)[i]) * descale;
        return;
    }
    for (int64_t i = 0; i < n; i++)
        dst[i] = fmha_load_f32(src, dtype, i);
}

#include "cpu_ops_io.h"

static void qk(const void *kv, int64_t ks, int nj, int nq, const void *qtv, int64_t d, float *st)
{
    const float *k = kv, *qt = qtv;
    for (int j = 0; j < nj; j++) {
        float acc[BR] = {0};
        const float *krow = k + j * ks;
        for (int64_t c = 0; c < d; c++)
            for (int i = 0; i < nq; i++)
                acc[i] += krow[c] * qt[c * BR + i];
        for (int i = 0; i < nq; i++)
            st[j * BR + i] = acc[i];
    }
}

static void softcap(float *st, int nj, int nq, float scale, float cap)
{
    for (int j = 0; j < nj; j++)
        for (int i = 0; i < nq; i++)
            st[j * BR + i] = cap * tanhf(st[j * BR + i] * scale / cap) * 1.4426950408889634f;
}

static void softmax(float *st, int nj, int nq, float scale, float *m, float *l, float *alpha)
{
    for (int i = 0; i < nq; i++) {
        float mx = m[i];
        /* Stored scaled, so that a compiler fusing s * scale - base (FMA
         * targets) cannot leave the maximum 2^(rounding remainder) > 1. */
        for (int j = 0; j < nj; j++) {
            st[j * BR + i] *= scale;
            mx = fmaxf(mx, st[j * BR + i]);
        }
        const float base = mx == -INFINITY ? 0.0f : mx; /* no key yet: all terms are 0 */
        float sum = 0.0f;
        for (int j = 0; j < nj; j++) {
            float p = exp2f(st[j * BR + i] - base);
            st[j * BR + i] = p;
            sum += p;
        }
        alpha[i] = exp2f(m[i] - base);
        l[i] = l[i] * alpha[i] + sum;
        m[i] = mx;
    }
}

static void pv(const void *pv_, int nj, int nq, const void *vv, int64_t dvp, const float *alpha,
               float *o)
{
    const float *p = pv_, *v = vv;
    for (int i = 0; i < nq; i++) {
        float *orow = o + i * dvp;
        for (int64_t c = 0; c < dvp; c++)
            orow[c] *= alpha[i];
        for (int j = 0; j < nj; j++) {
            const float pij = p[j * BR + i];
            const float *vrow = v + j * dvp;
            for (int64_t c = 0; c < dvp; c++)
                orow[c] += pij * vrow[c];
        }
    }
}

/* ---------------------------------------------------------------- backward */

/* 2^min(x, 0), NaN kept: as p_of in cpu_ops_f32.h. */
static float p_of(float x)
{
    return exp2f(x > 0.0f ? 0.0f : x);
}

static void exp_cols(float *st, int nr, int nc, float scale, const float *lse)
{
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nc; i++)
            st[r * BR + i] = p_of(st[r * BR + i] * scale - lse[i]);
}

static void exp_rows(float *st, int nr, int nc, float scale, const float *lse)
{
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nc; i++)
            st[r * BR + i] = p_of(st[r * BR + i] * scale - lse[r]);
}

static void ds_cols(float *p, const float *dp, int nr, int nc, const float *D)
{
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nc; i++)
            p[r * BR + i] *= dp[r * BR + i] - D[i];
}

static void ds_rows(float *p, const float *dp, int nr, int nc, const float *D)
{
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nc; i++)
            p[r * BR + i] *= dp[r * BR + i] - D[r];
}

static void softcap_grad(float *ds, const float *t, int nr, int nc, float k)
{
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nc; i++) {
            const float y = t[r * BR + i] * k;
            ds[r * BR + i] *= 1.0f - y * y;
        }
}

const fmha_cpu_ops fmha_ops_cpu_scalar_f32 = {
    .lanes = 1,
    .elem = 4,
    .pack_q = pack_q,
    .load_k = load_k,
    .load_v = load_v,
    .qk = qk,
    .softcap = softcap,
    .softmax = softmax,
    .pack_p = pack_p,
    .pv = pv,
    .store = store,
    .load_rows = load_rows,
    .pack_rows_t = pack_rows_t,
    .exp_cols = exp_cols,
    .exp_rows = exp_rows,
    .ds_cols = ds_cols,
    .ds_rows = ds_rows,
    .softcap_grad = softcap_grad,
};
