/* fp8_cli.c — see fp8_cli.h. Quantized copies go through the library's
 * fmha_quantize_fp8, and every attention through the public API, so that the
 * report measures what a caller gets. */
#include "fp8_cli.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------ quantized copies */

void fp8_args_free(fp8_args *f)
{
    for (int i = 0; i < 3; i++) {
        free(f->codes[i]);
        free(f->scales[i]);
        f->codes[i] = NULL;
        f->scales[i] = NULL;
    }
}

int fp8_args_make(fp8_args *f, const fmha_forward_args *src, int64_t num_kv_heads,
                  fmha_descale_layout layout, int64_t block_rows, char *err, size_t errlen)
{
    memset(f, 0, sizeof *f);
    f->a = *src;
    const fmha_tensor *x[3] = {&src->q, &src->k, &src->v};
    fmha_tensor *y[3] = {&f->a.q, &f->a.k, &f->a.v};
    const float **ds[3] = {&f->a.descale_q, &f->a.descale_k, &f->a.descale_v};
    const char *names[3] = {"q", "k", "v"};
    if (layout == FMHA_DESCALE_PER_KV_HEAD && src->cu_seqlens_q) {
        snprintf(err, errlen,
                 "per-(batch, kv head) descales of a packed batch need one "
                 "quantization per sequence: use per-tensor or per-block ones");
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        fmha_tensor xv = *x[i]; /* the view quantized: q grouped by KV head for PER_KV_HEAD */
        fmha_fp8_scaling sc = FMHA_FP8_PER_TENSOR;
        int64_t nscales = 1;
        if (layout == FMHA_DESCALE_PER_KV_HEAD) {
            if (i == 0) {
                const int64_t group = xv.heads / num_kv_heads;
                if (xv.stride_head != xv.head_dim) {
                    snprintf(err, errlen,
                             "q's heads are not contiguous: per-(batch, kv head) "
                             "scales group them");
                    return -1;
                }
                xv.heads = num_kv_heads;
                xv.head_dim *= group;
                xv.stride_head *= group;
            }
            sc = FMHA_FP8_PER_HEAD;
            nscales = xv.batch * xv.heads;
        } else if (layout == FMHA_DESCALE_PER_BLOCK) {
            sc = FMHA_FP8_PER_BLOCK;
            nscales = xv.batch * xv.heads * ((xv.seqlen + block_rows - 1) / block_rows);
        }
        const int64_t n = xv.batch * xv.seqlen * xv.heads * xv.head_dim;
        f->codes[i] = malloc((size_t)n);
        f->scales[i] = malloc(sizeof(float) * (size_t)nscales);
        if (!f->codes[i] || !f->scales[i]) {
            snprintf(err, errlen, "out of memory for the FP8 copy of %s", names[i]);
            fp8_args_free(f);
            return -1;
        }
        fmha_tensor yv = fmha_tensor_bshd(f->codes[i], FMHA_DTYPE_F8_E4M3, xv.batch, xv.seqlen,
                                          xv.heads, xv.head_dim);
        fmha_status st = fmha_quantize_fp8(&xv, &yv, f->scales[i], sc, block_rows);
        if (st != FMHA_STATUS_OK) {
            snprintf(err, errlen, "quantizing %s: %s", names[i], fmha_last_error());
            fp8_args_free(f);
            return -1;
        }
        /* A grouped view's contiguous codes are the [B, S, H, D] tensor's. */
        *y[i] = fmha_tensor_bshd(f->codes[i], FMHA_DTYPE_F8_E4M3, x[i]->batch, x[i]->seqlen,
                                 x[i]->heads, x[i]->head_dim);
        *ds[i] = f->scales[i];
    }
    f->a.descale_layout = layout;
    f->a.descale_block_rows = block_rows;
    return 0;
}

/* -------------------------------------------------------- accuracy report */

double cli_elem(const fmha_tensor *t, int64_t b, int64_t s, int64_t h, int64_t c)
{
    const char *p =
        (const char *)t->data + (b * t->stride_batch + s * t->stride_seq + h * t->stride_head + c) *
                                    (int64_t)fmha_dtype_size(t->dtype);
    uint16_t u;
    switch (t->dtype) {
    case FMHA_DTYPE_F32: return *(const float *)p;
    case FMHA_DTYPE_BF16: memcpy(&u, p, 2); return fmha_bf16_to_f32(u);
    case FMHA_DTYPE_F16: memcpy(&u, p, 2); return fmha_f16_to_f32(u);
    default: return NAN;
    }
}

/* ||x - ref|| / ||ref|| over rows [xs, xs + n) of x against [rs, rs + n) of ref. */
static double rel_l2(const fmha_tensor *x, int64_t xs, const fmha_tensor *ref, int64_t rs,
                     int64_t n)
{
    double d2 = 0, r2 = 0;
    for (int64_t b = 0; b < x->batch; b++)
        for (int64_t s = 0; s < n; s++)
            for (int64_t h = 0; h < x->heads; h++)
                for (int64_t c = 0; c < x->head_dim; c++) {
                    double a = cli_elem(x, b, xs + s, h, c), r = cli_elem(ref, b, rs + s, h, c);
                    d2 += (a - r) * (a - r);
                    r2 += r * r;
                }
    return r2 > 0 ? sqrt(d2 / r2) : sqrt(d2);
}

static uint16_t *bf16_normal(int64_t n, double (*normal)(void))
{
    uint16_t *p = malloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; p && i < n; i++)
        p[i] = fmha_f32_to_bf16((float)normal());
    return p;
}

/* Outlier channels in K: four head-dim channels of every K row scaled by 20,
 * 40, 70 and 100 (zero-mean), or offset by as much (a per-channel bias, the
 * usual form of trained models' large K channels). */
enum { N_OUTLIERS = 4 };
static const double outlier_gain[N_OUTLIERS] = {20, 40, 70, 100};

static void add_outliers(uint16_t *k, int64_t rows, int64_t d, int offset)
{
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < N_OUTLIERS; j++) {
            uint16_t *x = &k[r * d + (j * 37 + 5) % d];
            const double y = offset ? fmha_bf16_to_f32(*x) + outlier_gain[j]
                                    : fmha_bf16_to_f32(*x) * outlier_gain[j];
            *x = fmha_f32_to_bf16((float)y);
        }
}

/* The float64 reference on the last `rows` query rows of every sequence
 * (masks align bottom-right, so those rows see what they see in the whole
 * problem), into ref [batch, rows, heads, head_dim_v] f32. */
static fmha_status reference_rows(const fmha_config *cfg, const fmha_forward_args *a, int64_t rows,
                                  float *ref)
{
    const fmha_tensor *q = &a->q;
    const int64_t per_b = rows * q->heads * cfg->head_dim_v;
    for (int64_t b = 0; b < q->batch; b++) {
        fmha_forward_args r = *a;
        r.q.batch = r.k.batch = r.v.batch = 1;
        r.q.seqlen = rows;
        r.q.data = (char *)q->data + (b * q->stride_batch + (q->seqlen - rows) * q->stride_seq) *
                                         (int64_t)fmha_dtype_size(q->dtype);
        r.k.data = (char *)a->k.data + b * a->k.stride_batch * (int64_t)fmha_dtype_size(a->k.dtype);
        r.v.data = (char *)a->v.data + b * a->v.stride_batch * (int64_t)fmha_dtype_size(a->v.dtype);
        r.out =
            fmha_tensor_bshd(ref + b * per_b, FMHA_DTYPE_F32, 1, rows, q->heads, cfg->head_dim_v);
        r.lse = NULL;
        fmha_status st = fmha_reference_forward(cfg, &r);
        if (st != FMHA_STATUS_OK)
            return st;
    }
    return FMHA_STATUS_OK;
}

int fp8_accuracy_report(const fmha_config *cfg, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                        int64_t rows, double (*normal)(void), FILE *out)
{
    const int64_t h = cfg->num_heads, hk = cfg->num_kv_heads, d = cfg->head_dim,
                  dv = cfg->head_dim_v;
    if (rows > seqlen_q)
        rows = seqlen_q;
    fmha_config c16 = *cfg, c8 = *cfg;
    c16.dtype = FMHA_DTYPE_BF16;
    c16.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    c8.dtype = FMHA_DTYPE_F8_E4M3;
    c8.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    const int64_t nq = batch * seqlen_q * h * d, nk = batch * seqlen_k * hk * d,
                  nv = batch * seqlen_k * hk * dv, no = batch * seqlen_q * h * dv;
    uint16_t *o16 = malloc(sizeof(uint16_t) * (size_t)no);
    uint16_t *o8 = malloc(sizeof(uint16_t) * (size_t)no);
    float *ref = malloc(sizeof(float) * (size_t)(batch * rows * h * dv));
    if (!o16 || !o8 || !ref) {
        fprintf(stderr, "fmha: out of memory for the accuracy report\n");
        free(o16);
        free(o8);
        free(ref);
        return 1;
    }
    const fmha_tensor tref = fmha_tensor_bshd(ref, FMHA_DTYPE_F32, batch, rows, h, dv);
    const struct {
        fmha_descale_layout layout;
        const char *name;
    } scalings[3] = {{FMHA_DESCALE_PER_TENSOR, "per tensor"},
                     {FMHA_DESCALE_PER_KV_HEAD, "per (batch, kv head)"},
                     {FMHA_DESCALE_PER_BLOCK, "per 128-token block"}};

    fprintf(out,
            "FP8 E4M3 attention accuracy: q [%lld, %lld, %lld, %lld], k/v [%lld, %lld, %lld, %lld]"
            "%s, bf16 inputs and output\n",
            (long long)batch, (long long)seqlen_q, (long long)h, (long long)d, (long long)batch,
            (long long)seqlen_k, (long long)hk, (long long)d, cfg->causal ? ", causal" : "");
    fprintf(out,
            "relative L2 error over the last %lld query rows of every head; ref = float64 "
            "reference on the bf16 inputs, bf16 = fmha's bf16 path\n",
            (long long)rows);
    fprintf(out, "%-28s %-26s %11s %12s %12s\n", "inputs", "fp8 scales", "fp8 vs ref",
            "fp8 vs bf16", "bf16 vs ref");
    static const char *kinds[3] = {"gaussian", "K outliers (4 ch. x20-x100)",
                                   "K offsets (4 ch. +20-+100)"};
    /* The layer's own quantization with K smoothed (fp8_smooth_k), per tensor. */
    fmha_config cs = *cfg;
    cs.dtype = FMHA_DTYPE_BF16;
    cs.device = FMHA_DEVICE_CPU;
    cs.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
    cs.fp8_smooth_k = 1;
    int rc = 0;
    for (int kind = 0; kind < 3 && rc == 0; kind++) {
        uint16_t *q = bf16_normal(nq, normal), *k = bf16_normal(nk, normal),
                 *v = bf16_normal(nv, normal);
        if (!q || !k || !v) {
            fprintf(stderr, "fmha: out of memory for the accuracy report\n");
            rc = 1;
        }
        if (rc == 0 && kind > 0)
            add_outliers(k, batch * seqlen_k * hk, d, kind == 2);
        fmha_forward_args a;
        memset(&a, 0, sizeof a);
        a.q = fmha_tensor_bshd(q, FMHA_DTYPE_BF16, batch, seqlen_q, h, d);
        a.k = fmha_tensor_bshd(k, FMHA_DTYPE_BF16, batch, seqlen_k, hk, d);
        a.v = fmha_tensor_bshd(v, FMHA_DTYPE_BF16, batch, seqlen_k, hk, dv);
        a.out = fmha_tensor_bshd(o16, FMHA_DTYPE_BF16, batch, seqlen_q, h, dv);
        fmha_status st = FMHA_STATUS_OK;
        if (rc == 0 && ((st = fmha_forward(&c16, &a)) != FMHA_STATUS_OK ||
                        (st = reference_rows(&c16, &a, rows, ref)) != FMHA_STATUS_OK)) {
            fprintf(stderr, "fmha: %s (%s)\n", fmha_last_error(), fmha_status_string(st));
            rc = 1;
        }
        const double e16 = rc ? 0 : rel_l2(&a.out, seqlen_q - rows, &tref, 0, rows);
        for (int s = 0; s < 3 && rc == 0; s++) {
            fp8_args f;
            char err[512];
            if (fp8_args_make(&f, &a, hk, scalings[s].layout, 128, err, sizeof err)) {
                fprintf(stderr, "fmha: %s\n", err);
                rc = 1;
                break;
            }
            f.a.out = fmha_tensor_bshd(o8, FMHA_DTYPE_BF16, batch, seqlen_q, h, dv);
            if ((st = fmha_forward(&c8, &f.a)) != FMHA_STATUS_OK) {
                fprintf(stderr, "fmha: FP8 attention: %s (%s)\n", fmha_last_error(),
                        fmha_status_string(st));
                rc = 1;
            } else {
                fprintf(out, "%-28s %-26s %11.3e %12.3e %12.3e\n", kinds[kind], scalings[s].name,
                        rel_l2(&f.a.out, seqlen_q - rows, &tref, 0, rows),
                        rel_l2(&f.a.out, seqlen_q - rows, &a.out, seqlen_q - rows, rows), e16);
            }
            fp8_args_free(&f);
        }
        if (rc == 0 && !cfg->softcap) {
            fmha_forward_args as = a;
            as.out = fmha_tensor_bshd(o8, FMHA_DTYPE_BF16, batch, seqlen_q, h, dv);
            if ((st = fmha_forward(&cs, &as)) != FMHA_STATUS_OK) {
                fprintf(stderr, "fmha: FP8 attention with K smoothed: %s (%s)\n", fmha_last_error(),
                        fmha_status_string(st));
                rc = 1;
            } else {
                fprintf(out, "%-28s %-26s %11.3e %12.3e %12.3e\n", kinds[kind],
                        "per tensor, K smoothed", rel_l2(&as.out, seqlen_q - rows, &tref, 0, rows),
                        rel_l2(&as.out, seqlen_q - rows, &a.out, seqlen_q - rows, rows), e16);
            }
        }
        free(q);
        free(k);
        free(v);
    }
    free(o16);
    free(o8);
    free(ref);
    return rc;
}
