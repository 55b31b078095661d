/* layer_fp8.c — the FP8 path of a layer (fp8_compute): q, k, v quantized
 * into scratch the layer owns, on the layer's device, then FP8 attention with
 * their descales. Every device step goes through the backend's table. */
#include "layer_fp8.h"
#include "select.h"
#include "validate.h"

#include <stdio.h>

/* Elements of a view's [batch, seqlen, heads, head_dim] box (a contiguous
 * copy's size): -1 if the count overflows. */
static int64_t view_elements(const fmha_tensor *t)
{
    int64_t n;
    if (__builtin_mul_overflow(t->batch, t->seqlen, &n) ||
        __builtin_mul_overflow(n, t->heads, &n) || __builtin_mul_overflow(n, t->head_dim, &n))
        return -1;
    return n;
}

/* Grows the scratch to at least `bytes`, in the backend's memory. */
static fmha_status scratch_reserve(const fmha_backend *be, fmha_workspace *s, size_t bytes)
{
    if (s->size >= bytes)
        return FMHA_STATUS_OK;
    void *p = NULL;
    fmha_status st = be->alloc(&p, bytes);
    if (st != FMHA_STATUS_OK)
        return st;
    be->free(s->buf);
    s->buf = p;
    s->size = bytes;
    return FMHA_STATUS_OK;
}

void fmha_fp8_scratch_free(const fmha_backend *be, fmha_workspace *scratch)
{
    be->free(scratch->buf);
    scratch->buf = NULL;
    scratch->size = 0;
}

/* Where each part of the scratch starts, each 256-byte aligned: each
 * tensor's codes (rows padded to 16 bytes, as TMA wants them) and scales;
 * with fp8_smooth_k, K less its means (f32), the means, and the backend's
 * scratch for summing them. */
typedef struct fp8_layout {
    int64_t codes[3], scales[3], dpad[3];
    int64_t ks, mean, acc, amax, total;
} fp8_layout;

static int64_t take(fp8_layout *L, int64_t bytes)
{
    const int64_t at = L->total;
    L->total += (bytes + 255) & ~(int64_t)255;
    return at;
}

/* int8_qk (nseq sequences): q's scales per row, k's and v's per (sequence,
 * KV head), and the quantizer's amax scratch. */
static fmha_status plan_scratch(const fmha_backend *be, const fmha_forward_args *args,
                                int per_block, int smooth, int64_t int8_nseq, fp8_layout *L)
{
    const fmha_tensor *src[3] = {&args->q, &args->k, &args->v};
    const char *names[3] = {"q", "k", "v"};
    memset(L, 0, sizeof *L);
    for (int i = 0; i < 3; i++) {
        const int64_t r = FMHA_FP8_BLOCK_ROWS, nblk = per_block ? (src[i]->seqlen + r - 1) / r : 1;
        fmha_tensor padded = *src[i];
        L->dpad[i] = padded.head_dim = (src[i]->head_dim + 15) & ~(int64_t)15;
        const int64_t codes = view_elements(&padded);
        int64_t scales = per_block ? src[i]->batch * src[i]->heads * nblk : 1; /* <= codes */
        if (int8_nseq) /* <= codes + heads * nseq: a sequence has a token or a padded row */
            scales = i == 0 ? src[i]->batch * src[i]->seqlen * src[i]->heads
                            : (int8_nseq + src[i]->batch) * src[i]->heads;
        if (codes < 0 || L->total > INT64_MAX / 4 - 2 * codes - 1024)
            return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                                  "%s has too many elements to quantize into a copy", names[i]);
        L->codes[i] = take(L, codes);
        L->scales[i] = take(L, scales * 4);
    }
    if (smooth) {
        /* The backend's sum scratch is below nk / 256 + nmean doubles (CUDA's)
         * or a row of them (the CPU's), which the bound covers. */
        const int64_t nk = view_elements(&args->k), d = args->k.head_dim;
        const int64_t nmean = args->k.batch * args->k.heads * d; /* <= nk unless seqlen is 0 */
        if (nk < 0 || nk > INT64_MAX / 16 - 2 * nmean - d - L->total / 4 - 1024)
            return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                                  "k has too many elements to smooth into a copy");
        if (!int8_nseq) /* int8_qk subtracts the means as it quantizes */
            L->ks = take(L, nk * 4);
        L->mean = take(L, nmean * 4);
        L->acc = take(L, (int64_t)be->smooth_k_scratch(&args->k));
    }
    if (int8_nseq)
        L->amax = take(L, (args->k.batch * args->k.heads + args->v.batch * args->v.heads) * 4);
    if ((uint64_t)L->total > SIZE_MAX / 2)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "FP8 scratch of %lld bytes is too large",
                              (long long)L->total);
    return FMHA_STATUS_OK;
}

/* The call on the quantized copies a8 (same shapes and lengths as validated),
 * then the LSE of the unsmoothed scores where K was smoothed. */
static fmha_status run_quantized(const fmha_plan *plan, const fmha_backend *be, fmha_workspace *ws,
                                 const fmha_problem *pb, const fmha_forward_args *a8,
                                 const float *q_row_scale, const float *mean, fmha_kernel_info *ran)
{
    fmha_problem pb8 = *pb;
    pb8.cfg = &plan->cfg;
    pb8.args = a8;
    pb8.q_row_scale = q_row_scale;
    fmha_plan call;
    fmha_status st;
    if ((st = fmha_plan_for_call(plan, &pb8, &call)) != FMHA_STATUS_OK)
        return st;
    *ran = call.kernel->info;
    if ((st = be->forward(&call, &pb8, ws)) != FMHA_STATUS_OK)
        return st;
    return mean && pb->args->lse
               ? be->unsmooth_lse(pb, &pb->args->q, pb->args->lse, mean, pb->args->stream)
               : FMHA_STATUS_OK;
}

/* A quantized copy of x's shape in the scratch at `codes`, rows padded to dp. */
static fmha_tensor code_view(void *codes, const fmha_tensor *x, int64_t dp)
{
    fmha_tensor y =
        fmha_tensor_bshd(codes, FMHA_DTYPE_F8_E4M3, x->batch, x->seqlen, x->heads, x->head_dim);
    y.stride_head = dp;
    y.stride_seq = x->heads * dp;
    y.stride_batch = x->seqlen * x->heads * dp;
    return y;
}

/* fp8_compute = int8_qk: K smoothed (its means first, subtracted as the
 * quantizer reads k); q and k rotated (power-of-two head
 * dims) and coded to INT8, q per row, k per (sequence, KV head); v to e4m3
 * per (sequence, KV head). The codes travel as f8_e4m3 views (bytes); the
 * plan's int8_qk tells the kernel what q's and k's bytes are, and
 * pb->q_row_scale carries q's scales. */
static fmha_status int8_layer_forward(const fmha_plan *plan, const fmha_backend *be,
                                      fmha_workspace *scratch, fmha_workspace *ws,
                                      const fmha_problem *pb, fmha_kernel_info *ran)
{
    const fmha_forward_args *args = pb->args;
    const int64_t nseq = pb->batch;
    const int rotate = fmha_int8_qk_rotates(args->q.head_dim);
    if (!be->quantize_rows)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "fp8_compute = int8_qk: the %s backend has no INT8 quantizer",
                              be->name);
    fp8_layout L;
    fmha_status st = plan_scratch(be, args, 0, 1, nseq, &L);
    if (st != FMHA_STATUS_OK ||
        (st = scratch_reserve(be, scratch, (size_t)L.total)) != FMHA_STATUS_OK)
        return st;
    char *base = scratch->buf;
    float *mean = (float *)(base + L.mean);
    if ((st = be->smooth_k(&args->k, NULL, mean, base + L.acc, args->stream)) != FMHA_STATUS_OK)
        return st;

    fmha_forward_args a8 = *args;
    const fmha_tensor *src[3] = {&args->q, &args->k, &args->v};
    fmha_tensor *dst[3] = {&a8.q, &a8.k, &a8.v};
    float *amax[3] = {NULL, (float *)(base + L.amax),
                      (float *)(base + L.amax) + args->k.batch * args->k.heads};
    fmha_rows_job jobs[3];
    for (int i = 0; i < 3; i++) {
        *dst[i] = code_view(base + L.codes[i], src[i], L.dpad[i]);
        jobs[i] = (fmha_rows_job){.x = src[i],
                                  .mean = i == 1 ? mean : NULL, /* k less its means */
                                  .y = dst[i],
                                  .int8 = i < 2, /* q, k INT8; v e4m3 */
                                  .per_row = i == 0,
                                  .rotate = i < 2 && rotate,
                                  .nseq = nseq,
                                  .scales = (float *)(base + L.scales[i]),
                                  .amax = amax[i]};
    }
    if ((st = be->quantize_rows(jobs, 3, args->stream)) != FMHA_STATUS_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", fmha_last_error());
        return fmha_set_error(st, "quantizing q, k, v (fp8_compute = int8_qk): %s", msg);
    }
    a8.descale_q = NULL; /* per row: q_row_scale */
    a8.descale_k = (const float *)(base + L.scales[1]);
    a8.descale_v = (const float *)(base + L.scales[2]);
    a8.descale_layout = FMHA_DESCALE_PER_KV_HEAD;
    return run_quantized(plan, be, ws, pb, &a8, (const float *)(base + L.scales[0]), mean, ran);
}

fmha_status fmha_fp8_layer_forward(const fmha_plan *plan, const fmha_backend *be,
                                   fmha_workspace *scratch, fmha_workspace *ws,
                                   const fmha_problem *pb, fmha_kernel_info *ran)
{
    if (plan->int8_qk)
        return int8_layer_forward(plan, be, scratch, ws, pb, ran);
    const fmha_forward_args *args = pb->args;
    const fmha_config *cfg = pb->cfg; /* the layer's: its fp8_compute and fp8_smooth_k */
    const int per_block = cfg->fp8_compute == FMHA_FP8_COMPUTE_PER_BLOCK;
    const int smooth = cfg->fp8_smooth_k;
    fp8_layout L;
    fmha_status st = plan_scratch(be, args, per_block, smooth, 0, &L);
    if (st != FMHA_STATUS_OK ||
        (st = scratch_reserve(be, scratch, (size_t)L.total)) != FMHA_STATUS_OK)
        return st;
    char *base = scratch->buf;

    const fmha_tensor *src[3] = {&args->q, &args->k, &args->v};
    const char *names[3] = {"q", "k", "v"};
    fmha_forward_args a8 = *args;
    fmha_tensor *dst[3] = {&a8.q, &a8.k, &a8.v};
    const float **ds[3] = {&a8.descale_q, &a8.descale_k, &a8.descale_v};
    fmha_tensor ks;
    float *mean = (float *)(base + L.mean);
    if (smooth) {
        const fmha_tensor *k = &args->k;
        ks = fmha_tensor_bshd(base + L.ks, FMHA_DTYPE_F32, k->batch, k->seqlen, k->heads,
                              k->head_dim);
        if ((st = be->smooth_k(k, ks.data, mean, base + L.acc, args->stream)) != FMHA_STATUS_OK)
            return st;
        src[1] = &ks;
    }
    const fmha_fp8_scaling sc = per_block ? FMHA_FP8_PER_BLOCK : FMHA_FP8_PER_TENSOR;
    for (int i = 0; i < 3; i++) {
        const fmha_tensor *x = src[i];
        float *scales = (float *)(base + L.scales[i]);
        *dst[i] = code_view(base + L.codes[i], x, L.dpad[i]);
        *ds[i] = scales;
        fmha_fp8_groups g;
        st = fmha_validate_quantize(x, dst[i], scales, sc, FMHA_FP8_BLOCK_ROWS, &g);
        if (st == FMHA_STATUS_OK)
            st = be->quantize_fp8(x, dst[i], scales, &g, args->stream);
        if (st != FMHA_STATUS_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fmha_last_error());
            return fmha_set_error(st, "quantizing %s to FP8 (fp8_compute): %s", names[i], msg);
        }
    }
    a8.descale_layout = per_block ? FMHA_DESCALE_PER_BLOCK : FMHA_DESCALE_PER_TENSOR;
    a8.descale_block_rows = FMHA_FP8_BLOCK_ROWS;
    return run_quantized(plan, be, ws, pb, &a8, NULL, smooth ? mean : NULL, ran);
}
