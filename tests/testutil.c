/* testutil.c — shared helpers of the C tests (see testutil.h). */
#include "testutil.h"
#include "validate.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

int tu_passed, tu_failed;

uint64_t tu_next(tu_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull); /* splitmix64 */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double tu_uniform(tu_rng *r)
{
    return (double)(tu_next(r) >> 11) * 0x1p-53;
}

double tu_normal(tu_rng *r)
{
    double u = tu_uniform(r), v = tu_uniform(r);
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

int64_t tu_range(tu_rng *r, int64_t n)
{
    return (int64_t)(tu_next(r) % (uint64_t)n);
}

void tu_tensor_init(tu_tensor *x, fmha_dtype dtype, int64_t b, int64_t s, int64_t h, int64_t d,
                    int layout, unsigned char poison)
{
    size_t es = fmha_dtype_size(dtype);
    fmha_tensor t;
    if (layout == 1) {
        t = fmha_tensor_bhsd(NULL, dtype, b, s, h, d);
    } else if (layout == 2) {
        int64_t dpad = d + 3, hpad = h * dpad + 5; /* gaps after each head and each token */
        t = fmha_tensor_bshd(NULL, dtype, b, s, h, d);
        t.stride_head = dpad;
        t.stride_seq = hpad;
        t.stride_batch = s * hpad + 7;
    } else {
        t = fmha_tensor_bshd(NULL, dtype, b, s, h, d);
    }
    int64_t extent =
        (b - 1) * t.stride_batch + (s - 1) * t.stride_seq + (h - 1) * t.stride_head + d;
    x->alloc_bytes = (size_t)extent * es;
    x->alloc = malloc(x->alloc_bytes);
    memset(x->alloc, poison, x->alloc_bytes);
    t.data = x->alloc;
    x->t = t;
}

void tu_tensor_free(tu_tensor *x)
{
    free(x->alloc);
    x->alloc = NULL;
}

static size_t elem_offset(const tu_tensor *x, int64_t b, int64_t s, int64_t h, int64_t c)
{
    return (size_t)(b * x->t.stride_batch + s * x->t.stride_seq + h * x->t.stride_head + c);
}

void tu_fill_normal(tu_tensor *x, tu_rng *r, double sigma)
{
    const fmha_tensor *t = &x->t;
    size_t es = fmha_dtype_size(t->dtype);
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++)
                    fmha_store_f32((char *)x->alloc + elem_offset(x, b, s, h, 0) * es, t->dtype, c,
                                   (float)(sigma * tu_normal(r)));
}

double tu_get(const tu_tensor *x, int64_t b, int64_t s, int64_t h, int64_t c)
{
    size_t es = fmha_dtype_size(x->t.dtype);
    return fmha_load_f32((const char *)x->alloc + elem_offset(x, b, s, h, 0) * es, x->t.dtype, c);
}

void tu_set(tu_tensor *x, int64_t b, int64_t s, int64_t h, int64_t c, double v)
{
    size_t es = fmha_dtype_size(x->t.dtype);
    fmha_store_f32((char *)x->alloc + elem_offset(x, b, s, h, 0) * es, x->t.dtype, c, (float)v);
}

int tu_gaps_untouched(const tu_tensor *x, unsigned char poison)
{
    const fmha_tensor *t = &x->t;
    size_t es = fmha_dtype_size(t->dtype);
    unsigned char *mark = calloc(x->alloc_bytes, 1);
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                memset(mark + elem_offset(x, b, s, h, 0) * es, 1, (size_t)t->head_dim * es);
    int ok = 1;
    const unsigned char *p = x->alloc;
    for (size_t i = 0; i < x->alloc_bytes && ok; i++)
        if (!mark[i] && p[i] != poison)
            ok = 0;
    free(mark);
    return ok;
}

double tu_lse_err(const float *x, const float *ref, int64_t n, int *bad)
{
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isinf(ref[i]) && ref[i] < 0) {
            if (!(isinf(x[i]) && x[i] < 0))
                *bad = 1;
            continue;
        }
        if (!isfinite(x[i]))
            *bad = 1;
        if (fabs((double)x[i] - ref[i]) > e)
            e = fabs((double)x[i] - ref[i]);
    }
    return e;
}

double tu_max_err(const tu_tensor *x, const tu_tensor *ref, int *bad)
{
    double e = 0;
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++) {
                    double a = tu_get(x, b, s, h, c), r = tu_get(ref, b, s, h, c);
                    if (!isfinite(a))
                        *bad = 1;
                    if (fabs(a - r) > e)
                        e = fabs(a - r);
                }
    return e;
}

double tu_rel_l2(const tu_tensor *x, const tu_tensor *ref)
{
    double d2 = 0, r2 = 0;
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++) {
                    const double a = tu_get(x, b, s, h, c), r = tu_get(ref, b, s, h, c);
                    d2 += (a - r) * (a - r);
                    r2 += r * r;
                }
    return sqrt(d2 / (r2 > 0 ? r2 : 1));
}

float tu_score_bias(const fmha_forward_args *a, int64_t b, int64_t h, int64_t i, int64_t j,
                    int64_t sq, int64_t sk)
{
    const fmha_attn_mask *m = &a->mask;
    float x = 0.0f;
    if (m->data) {
        const int64_t e =
            b * m->stride_batch + h * m->stride_head + i * m->stride_q + j * m->stride_k;
        switch (m->type) {
        case FMHA_MASK_BOOL:
            if (!((const unsigned char *)m->data)[e])
                return -INFINITY;
            break;
        case FMHA_MASK_ADD_F32: x = ((const float *)m->data)[e]; break;
        case FMHA_MASK_ADD_F16: x = fmha_f16_to_f32(((const uint16_t *)m->data)[e]); break;
        case FMHA_MASK_ADD_BF16: x = fmha_bf16_to_f32(((const uint16_t *)m->data)[e]); break;
        }
    }
    if (a->alibi_slopes)
        x -= a->alibi_slopes[b * a->alibi_stride_batch + h] * fabsf((float)(i + sk - sq - j));
    return x;
}

int tu_naive_forward(const fmha_config *cfg, const fmha_forward_args *a)
{
    fmha_problem pb;
    if (fmha_validate_forward(cfg, a, &pb) != FMHA_STATUS_OK)
        return -1;
    const fmha_dtype p_dtype = cfg->dtype; /* 16-bit attention multiplies P in 16 bits */
    /* FP8 on CUDA multiplies P in e4m3, times 2^shift (cuda/hopper/launch.cu); the
     * CPU's FP8 kernels keep P in f32. */
    const int p_e4m3 = p_dtype == FMHA_DTYPE_F8_E4M3 && cfg->device == FMHA_DEVICE_CUDA;
    const int64_t per_thread = pb.max_sk + 1 + pb.dv; /* scores, then the accumulator */
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * omp_get_max_threads()));
    if (!scratch)
        return -1;
    const float scale = (float)pb.scale;
    const double pmax = pb.drop_threshold ? pb.drop_rescale : 1.0;
    const float p_up = (float)exp2(fmin(8.0, floor(log2(448.0 / pmax))));
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < pb.batch; b++) {
        for (int64_t h = 0; h < pb.heads; h++) {
            float *sc = scratch + per_thread * omp_get_thread_num();
            float *acc = sc + (per_thread - pb.dv);
            int64_t q0, sq, k0, sk;
            fmha_seq_bounds(&pb, b, &q0, &sq, &k0, &sk);
            const int64_t tb = pb.varlen ? 0 : b;
            const int64_t hk = h / pb.group;
            for (int64_t i = 0; i < sq; i++) {
                const char *qr = fmha_row(&a->q, tb, q0 + i, h);
                const float dq = fmha_row_descale(&pb, 0, b, q0 + i, h);
                int64_t lo, hi;
                fmha_visible_range(cfg, i, sq, sk, &lo, &hi);
                float m = -INFINITY;
                for (int64_t j = lo; j < hi; j++) {
                    const char *kr = fmha_row(&a->k, tb, k0 + j, hk);
                    const float dk = fmha_row_descale(&pb, 1, b, k0 + j, hk);
                    float s = 0;
                    for (int64_t c = 0; c < pb.d; c++) /* FP8: dequantized as a kernel does */
                        s += (fmha_load_f32(qr, a->q.dtype, c) * dq) *
                             (fmha_load_f32(kr, a->k.dtype, c) * dk);
                    s *= scale;
                    if (cfg->softcap > 0)
                        s = (float)cfg->softcap * tanhf(s / (float)cfg->softcap);
                    s += tu_score_bias(a, b, h, i, j, sq, sk);
                    sc[j - lo] = s;
                    m = fmaxf(m, s);
                }
                const float sink = a->sinks ? a->sinks[h] : -INFINITY;
                m = fmaxf(m, sink);
                float l = sink > -INFINITY ? expf(sink - m) : 0.0f;
                for (int64_t c = 0; c < pb.dv; c++)
                    acc[c] = 0;
                for (int64_t j = lo; j < hi; j++) {
                    float p = m == -INFINITY && !isnan(sc[j - lo]) ? 0.0f : expf(sc[j - lo] - m);
                    l += p;
                    if (pb.drop_threshold) {
                        fmha_u32x4 w =
                            fmha_dropout_words(a->seed, a->offset, b * pb.heads + h, i, j);
                        if (w.v[j & 3] < pb.drop_threshold)
                            continue;
                        p *= (float)pb.drop_rescale;
                    }
                    if (p_dtype == FMHA_DTYPE_BF16)
                        p = fmha_bf16_to_f32(fmha_f32_to_bf16(p));
                    else if (p_dtype == FMHA_DTYPE_F16)
                        p = fmha_f16_to_f32(fmha_f32_to_f16(p));
                    else if (p_e4m3)
                        p = fmha_e4m3_to_f32(fmha_f32_to_e4m3(p * p_up)) / p_up;
                    const char *vr = fmha_row(&a->v, tb, k0 + j, hk);
                    const float dvs = fmha_row_descale(&pb, 2, b, k0 + j, hk);
                    for (int64_t c = 0; c < pb.dv; c++)
                        acc[c] += p * (fmha_load_f32(vr, a->v.dtype, c) * dvs);
                }
                char *orow = fmha_row(&a->out, tb, q0 + i, h);
                for (int64_t c = 0; c < pb.dv; c++)
                    fmha_store_f32(orow, a->out.dtype, c, l > 0 ? acc[c] / l : 0.0f);
                if (a->lse) {
                    int64_t idx =
                        pb.varlen ? h * a->q.seqlen + q0 + i : (b * pb.heads + h) * sq + i;
                    a->lse[idx] = l > 0 ? m + logf(l) : -INFINITY;
                }
            }
        }
    }
    free(scratch);
    return 0;
}

int tu_summary(void)
{
    printf("%d passed, %d failed\n", tu_passed, tu_failed);
    return tu_failed ? 1 : 0;
}

int tu_cuda_begin(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (fmha_cuda_device_count() == 0) {
        printf("skipped: no CUDA device (%s)\n",
               fmha_cuda_backend_built() ? "none found" : "built without CUDA");
        return 0;
    }
    char desc[256];
    fmha_cuda_device_describe(0, desc, sizeof desc);
    printf("device 0: %s\n", desc);
    return 1;
}

/* x rounded to a 16-bit dtype's nearest value. */
static float round16(float x, fmha_dtype dt)
{
    return dt == FMHA_DTYPE_BF16 ? fmha_bf16_to_f32(fmha_f32_to_bf16(x))
                                 : fmha_f16_to_f32(fmha_f32_to_f16(x));
}

void tu_naive_backward(const fmha_config *cfg, const fmha_backward_args *a, int operands16)
{
    const int r16 = operands16 && (cfg->dtype == FMHA_DTYPE_BF16 || cfg->dtype == FMHA_DTYPE_F16);
    fmha_forward_args fwd;
    fmha_problem pb;
    if (fmha_validate_backward(cfg, a, &fwd, &pb) != FMHA_STATUS_OK) {
        fprintf(stderr, "naive backward: %s\n", fmha_last_error());
        exit(1);
    }
    const int64_t d = pb.d, dv = pb.dv, per = pb.max_sk * (2 + d + dv) + d + dv;
    float *scratch = malloc(sizeof(float) * (size_t)(per * omp_get_max_threads() + 1));
    const float scale = (float)pb.scale, cap = (float)cfg->softcap;
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < pb.batch; b++) {
        for (int64_t hk = 0; hk < pb.kv_heads; hk++) {
            float *s = scratch + per * omp_get_thread_num(), *keep = s + pb.max_sk;
            float *dq = keep + pb.max_sk, *dk = dq + d, *dvv = dk + pb.max_sk * d;
            int64_t q0, sq, k0, sk;
            fmha_seq_bounds(&pb, b, &q0, &sq, &k0, &sk);
            const int64_t tb = pb.varlen ? 0 : b;
            memset(dk, 0, sizeof(float) * (size_t)(sk * d));
            memset(dvv, 0, sizeof(float) * (size_t)(sk * dv));
            for (int64_t h = hk * pb.group; h < (hk + 1) * pb.group; h++)
                for (int64_t i = 0; i < sq; i++) {
                    const char *qr = fmha_row(&a->q, tb, q0 + i, h);
                    const char *gr = fmha_row(&a->dout, tb, q0 + i, h);
                    const char *orow = fmha_row(&a->out, tb, q0 + i, h);
                    const float lse =
                        a->lse[pb.varlen ? h * a->q.seqlen + q0 + i : (b * pb.heads + h) * sq + i];
                    int64_t lo, hi;
                    fmha_visible_range(cfg, i, sq, sk, &lo, &hi);
                    float D = 0;
                    for (int64_t c = 0; c < dv; c++)
                        D += fmha_load_f32(gr, a->dout.dtype, c) *
                             fmha_load_f32(orow, a->out.dtype, c);
                    float *go = dvv + pb.max_sk * dv; /* dO as the products read it */
                    for (int64_t c = 0; c < dv; c++) {
                        const float x = fmha_load_f32(gr, a->dout.dtype, c);
                        go[c] = r16 ? round16(x, cfg->dtype) : x;
                    }
                    memset(dq, 0, sizeof(float) * (size_t)d);
                    for (int64_t j = lo; j < hi; j++) {
                        const char *kr = fmha_row(&a->k, tb, k0 + j, hk);
                        const char *vr = fmha_row(&a->v, tb, k0 + j, hk);
                        float x = 0, dp = 0;
                        for (int64_t c = 0; c < d; c++)
                            x +=
                                fmha_load_f32(qr, a->q.dtype, c) * fmha_load_f32(kr, a->k.dtype, c);
                        x *= scale;
                        const float sc = cap > 0 ? cap * tanhf(x / cap) : x;
                        const float z = sc + tu_score_bias(&fwd, b, h, i, j, sq, sk);
                        const float p = lse == -INFINITY ? 0.0f : expf(z - lse);
                        for (int64_t c = 0; c < dv; c++)
                            dp += go[c] * fmha_load_f32(vr, a->v.dtype, c);
                        float f = 1;
                        if (pb.drop_threshold)
                            f = fmha_dropout_keep(a->seed, a->offset, b, pb.heads, h, i, j,
                                                  cfg->dropout_p)
                                    ? (float)pb.drop_rescale
                                    : 0.0f;
                        float ds = p * (dp * f - D);
                        if (cap > 0)
                            ds *= 1 - (sc / cap) * (sc / cap);
                        if (r16)
                            ds = round16(ds, cfg->dtype);
                        ds *= scale;
                        const float pf = r16 ? round16(p * f, cfg->dtype) : p * f;
                        for (int64_t c = 0; c < d; c++) {
                            dq[c] += ds * fmha_load_f32(kr, a->k.dtype, c);
                            dk[j * d + c] += ds * fmha_load_f32(qr, a->q.dtype, c);
                        }
                        for (int64_t c = 0; c < dv; c++)
                            dvv[j * dv + c] += pf * go[c];
                    }
                    if (a->dq.data)
                        for (int64_t c = 0; c < d; c++)
                            fmha_store_f32(fmha_row(&a->dq, tb, q0 + i, h), a->dq.dtype, c, dq[c]);
                }
            for (int64_t j = 0; j < sk; j++) {
                for (int64_t c = 0; a->dk.data && c < d; c++)
                    fmha_store_f32(fmha_row(&a->dk, tb, k0 + j, hk), a->dk.dtype, c, dk[j * d + c]);
                for (int64_t c = 0; a->dv.data && c < dv; c++)
                    fmha_store_f32(fmha_row(&a->dv, tb, k0 + j, hk), a->dv.dtype, c,
                                   dvv[j * dv + c]);
            }
        }
    }
    /* Tokens of a packed batch in no sequence: zero gradients. */
    const fmha_tensor *gs[3] = {&a->dq, &a->dk, &a->dv};
    for (int i = 0; i < 3 && pb.varlen; i++) {
        const int64_t from = (i == 0 ? a->cu_seqlens_q : a->cu_seqlens_k)[pb.batch];
        for (int64_t s = from; gs[i]->data && s < gs[i]->seqlen; s++)
            for (int64_t h = 0; h < gs[i]->heads; h++)
                for (int64_t c = 0; c < gs[i]->head_dim; c++)
                    fmha_store_f32(fmha_row(gs[i], 0, s, h), gs[i]->dtype, c, 0.0f);
    }
    free(scratch);
}
