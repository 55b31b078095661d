/* validate.c — the one place where a configuration and a forward call are
 * checked. Backends run only on what passed here, so they trust every number
 * and never repeat a check. */
#include "validate.h"

#include <math.h>

#define INVALID(...) fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, __VA_ARGS__)

fmha_status fmha_validate_config(const fmha_config *cfg)
{
    if (!cfg)
        return INVALID("config is NULL: pass a fmha_config filled by fmha_config_init");
    if (cfg->num_heads <= 0)
        return INVALID("num_heads (%lld) must be positive", (long long)cfg->num_heads);
    if (cfg->num_kv_heads <= 0)
        return INVALID("num_kv_heads (%lld) must be positive (equal to num_heads for plain "
                       "multi-head attention)",
                       (long long)cfg->num_kv_heads);
    if (cfg->num_kv_heads > cfg->num_heads)
        return INVALID("num_kv_heads (%lld) exceeds num_heads (%lld): key/value heads are shared "
                       "by query heads, never the reverse; check num_attention_heads / "
                       "num_key_value_heads in the model config",
                       (long long)cfg->num_kv_heads, (long long)cfg->num_heads);
    if (cfg->num_heads % cfg->num_kv_heads != 0)
        return INVALID("num_heads (%lld) must be a multiple of num_kv_heads (%lld): each KV head "
                       "serves an equal group of query heads; check num_attention_heads / "
                       "num_key_value_heads in the model config",
                       (long long)cfg->num_heads, (long long)cfg->num_kv_heads);
    if (cfg->head_dim <= 0)
        return INVALID("head_dim (%lld) must be positive", (long long)cfg->head_dim);
    if (cfg->head_dim_v <= 0)
        return INVALID("head_dim_v (%lld) must be positive (fmha_config_init sets it to head_dim)",
                       (long long)cfg->head_dim_v);
    if (cfg->head_dim > 65536 || cfg->head_dim_v > 65536)
        return INVALID("head dims (%lld, %lld) above 65536 are not attention head dims",
                       (long long)cfg->head_dim, (long long)cfg->head_dim_v);
    if ((unsigned)cfg->dtype > FMHA_DTYPE_F8_E4M3)
        return INVALID("dtype (%d) is not a fmha_dtype value", (int)cfg->dtype);
    if (!isfinite(cfg->softmax_scale) || cfg->softmax_scale < 0)
        return INVALID("softmax_scale (%g) must be finite and >= 0; 0 selects 1/sqrt(head_dim)",
                       cfg->softmax_scale);
    if (!isfinite(cfg->softcap) || cfg->softcap < 0)
        return INVALID("softcap (%g) must be finite and >= 0 (0 turns it off)", cfg->softcap);
    if (!(cfg->dropout_p >= 0.0 && cfg->dropout_p < 1.0))
        return INVALID("dropout_p (%g) must be in [0, 1)", cfg->dropout_p);
    if (cfg->window_left < -1)
        return INVALID("window_left (%lld) must be >= -1 (-1 = unlimited)",
                       (long long)cfg->window_left);
    if (cfg->window_right < -1)
        return INVALID("window_right (%lld) must be >= -1 (-1 = unlimited)",
                       (long long)cfg->window_right);
    if (cfg->device != FMHA_DEVICE_CPU && cfg->device != FMHA_DEVICE_CUDA)
        return INVALID("device (%d) is not a fmha_device value", (int)cfg->device);
    if ((unsigned)cfg->cpu_isa > FMHA_CPU_ISA_LAST)
        return INVALID("cpu_isa (%d) is not a fmha_cpu_isa value", (int)cfg->cpu_isa);
    if (cfg->num_threads < 0)
        return INVALID("num_threads (%d) must be >= 0 (0 = OpenMP's default)", cfg->num_threads);
    if ((unsigned)cfg->fp8_compute > FMHA_FP8_COMPUTE_PER_BLOCK)
        return INVALID("fp8_compute (%d) is not a fmha_fp8_compute value", (int)cfg->fp8_compute);
    if (cfg->check_finite != 0 && cfg->check_finite != 1)
        return INVALID("check_finite (%d) must be 0 or 1", cfg->check_finite);
    if (cfg->deterministic != 0 && cfg->deterministic != 1)
        return INVALID("deterministic (%d) must be 0 or 1", cfg->deterministic);
    if (cfg->fp8_smooth_k != 0 && cfg->fp8_smooth_k != 1)
        return INVALID("fp8_smooth_k (%d) must be 0 or 1", cfg->fp8_smooth_k);
    if (cfg->fp8_smooth_k && cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF && cfg->softcap != 0)
        return INVALID(
            "fp8_smooth_k moves every score of a query by q . mean(K), which the softmax "
            "ignores but softcap (%g) does not: set softcap = 0 or fp8_smooth_k = 0",
            cfg->softcap);
    if (cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF && cfg->dtype == FMHA_DTYPE_F8_E4M3)
        return INVALID("fp8_compute quantizes f32, f16 or bf16 inputs, but dtype is f8_e4m3: for "
                       "inputs already in FP8, leave fp8_compute off and pass their descales");
    return FMHA_STATUS_OK;
}

static int mul_overflows(int64_t a, int64_t b, int64_t *r)
{
    return __builtin_mul_overflow(a, b, r);
}

static int add_overflows(int64_t a, int64_t b, int64_t *r)
{
    return __builtin_add_overflow(a, b, r);
}

/* A view's own consistency; `may_be_empty`: batch and seqlen may be 0 (a
 * forward call's views, which then hold no element and may have no data). */
static fmha_status check_tensor(const fmha_tensor *t, const char *name, int may_be_empty)
{
    if ((unsigned)t->dtype > FMHA_DTYPE_F8_E4M3)
        return INVALID("%s.dtype (%d) is not a fmha_dtype value", name, (int)t->dtype);
    const int64_t dims[4] = {t->batch, t->seqlen, t->heads, t->head_dim};
    const char *dim_names[4] = {"batch", "seqlen", "heads", "head_dim"};
    for (int i = 0; i < 4; i++) {
        if (may_be_empty && i < 2 && dims[i] == 0)
            continue;
        if (dims[i] <= 0)
            return INVALID("%s.%s (%lld) must be %s", name, dim_names[i], (long long)dims[i],
                           may_be_empty && i < 2 ? "non-negative" : "positive");
    }
    const int empty = t->batch == 0 || t->seqlen == 0;
    if (!t->data && !empty)
        return INVALID("%s.data is NULL", name);
    if (t->stride_dim != 1)
        return INVALID("%s.stride_dim (%lld) must be 1: the head_dim axis must be contiguous; "
                       "make the tensor contiguous in its last dimension first",
                       name, (long long)t->stride_dim);
    const int64_t strides[3] = {t->stride_batch, t->stride_seq, t->stride_head};
    const char *stride_names[3] = {"stride_batch", "stride_seq", "stride_head"};
    int64_t extent = t->head_dim;
    for (int i = 0; i < 3; i++) {
        int64_t span;
        if (strides[i] < 0)
            return INVALID("%s.%s (%lld) must be >= 0", name, stride_names[i],
                           (long long)strides[i]);
        if (mul_overflows(dims[i] - 1, strides[i], &span) || add_overflows(extent, span, &extent))
            return INVALID("%s spans more than 2^63 elements (%s %lld x %s %lld overflows)", name,
                           dim_names[i], (long long)dims[i], stride_names[i],
                           (long long)strides[i]);
    }
    int64_t bytes;
    if (mul_overflows(extent, (int64_t)fmha_dtype_size(t->dtype), &bytes))
        return INVALID("%s spans %lld elements: the byte size overflows int64", name,
                       (long long)extent);
    return FMHA_STATUS_OK;
}

/* Rows of an output that share memory would each be written by whichever
 * task comes last, so the result would depend on the thread schedule. Along
 * one dim the overlap is certain when the stride is below the row's length
 * (0: a broadcast view, which suits inputs only); overlaps across two dims
 * are not looked for (fmha.h). */
static fmha_status check_rows_disjoint(const fmha_tensor *t, const char *name)
{
    const int64_t dims[3] = {t->batch, t->seqlen, t->heads};
    const int64_t strides[3] = {t->stride_batch, t->stride_seq, t->stride_head};
    const char *dim_names[3] = {"batch", "seqlen", "heads"};
    const char *stride_names[3] = {"stride_batch", "stride_seq", "stride_head"};
    if (t->batch == 0 || t->seqlen == 0) /* no row at all */
        return FMHA_STATUS_OK;
    for (int i = 0; i < 3; i++)
        if (dims[i] > 1 && strides[i] < t->head_dim)
            return INVALID("%s.%s (%lld) is below %s.head_dim (%lld) with %s.%s %lld: rows of "
                           "%s would overlap, and what they hold would depend on the order of "
                           "the writes; give each row of %s its own memory",
                           name, stride_names[i], (long long)strides[i], name,
                           (long long)t->head_dim, name, dim_names[i], (long long)dims[i], name,
                           name);
    return FMHA_STATUS_OK;
}

fmha_status fmha_validate_tensor(const fmha_tensor *t, const char *name)
{
    return check_tensor(t, name, 0);
}

static fmha_status check_cu_seqlens(const int32_t *cu, int64_t n, int64_t total, const char *name,
                                    int64_t *max_len)
{
    if (cu[0] != 0)
        return INVALID("%s[0] (%d) must be 0", name, (int)cu[0]);
    *max_len = 0;
    for (int64_t b = 0; b < n; b++) {
        if (cu[b + 1] < cu[b])
            return INVALID("%s decreases at entry %lld (%d after %d): it must be the running "
                           "sum of sequence lengths",
                           name, (long long)(b + 1), (int)cu[b + 1], (int)cu[b]);
        if (cu[b + 1] - cu[b] > *max_len)
            *max_len = cu[b + 1] - cu[b];
    }
    if (cu[n] > total)
        return INVALID("%s[%lld] (%d) is past the tensor's %lld tokens", name, (long long)n,
                       (int)cu[n], (long long)total);
    return FMHA_STATUS_OK;
}

/* The descales of FP8 inputs: present only for f8_e4m3, a known layout, and
 * on the CPU (host memory) every entry finite and > 0. */
static fmha_status validate_descales(const fmha_config *cfg, const fmha_forward_args *a,
                                     const fmha_problem *pb)
{
    const float *ds[3] = {a->descale_q, a->descale_k, a->descale_v};
    const char *names[3] = {"descale_q", "descale_k", "descale_v"};
    if (cfg->dtype != FMHA_DTYPE_F8_E4M3) {
        for (int i = 0; i < 3; i++)
            if (ds[i]) {
                if (cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF)
                    return INVALID("%s is given, but this layer quantizes its %s q, k, v itself "
                                   "(fp8_compute) and makes its own descales: pass NULL",
                                   names[i], fmha_dtype_name(cfg->dtype));
                return INVALID("%s is given, but q, k, v are %s: descales belong to f8_e4m3 "
                               "inputs only (pass NULL)",
                               names[i], fmha_dtype_name(cfg->dtype));
            }
        return FMHA_STATUS_OK;
    }
    int64_t counts[3];
    switch (a->descale_layout) {
    case FMHA_DESCALE_PER_TENSOR: counts[0] = counts[1] = counts[2] = 1; break;
    case FMHA_DESCALE_PER_KV_HEAD: /* batch x heads < 2^31: checked above */
        counts[0] = counts[1] = counts[2] = pb->batch * pb->kv_heads;
        break;
    case FMHA_DESCALE_PER_BLOCK: {
        const int64_t r = a->descale_block_rows;
        if (r <= 0)
            return INVALID("descale_block_rows (%lld) must be positive for FMHA_DESCALE_PER_BLOCK",
                           (long long)r);
        const fmha_tensor *ts[3] = {&a->q, &a->k, &a->v};
        for (int i = 0; i < 3; i++) {
            const int64_t nblk = ts[i]->seqlen / r + (ts[i]->seqlen % r != 0);
            if (mul_overflows(ts[i]->batch, ts[i]->heads, &counts[i]) ||
                mul_overflows(counts[i], nblk, &counts[i]))
                return INVALID("%s would hold %lld x %lld x %lld entries: more than int64 counts",
                               names[i], (long long)ts[i]->batch, (long long)ts[i]->heads,
                               (long long)nblk);
        }
        break;
    }
    default:
        return INVALID("descale_layout (%d) is not a fmha_descale_layout value",
                       (int)a->descale_layout);
    }
    if (cfg->device != FMHA_DEVICE_CPU) /* device memory: the kernel reads the values */
        return FMHA_STATUS_OK;
    for (int i = 0; i < 3; i++)
        for (int64_t e = 0; ds[i] && e < counts[i]; e++)
            if (!(isfinite(ds[i][e]) && ds[i][e] > 0.0f))
                return INVALID("%s[%lld] (%g) must be finite and > 0: a descale multiplies the "
                               "FP8 codes back to their values (the quantizer's scale)",
                               names[i], (long long)e, (double)ds[i][e]);
    return FMHA_STATUS_OK;
}

fmha_status fmha_validate_forward(const fmha_config *cfg, const fmha_forward_args *a,
                                  fmha_problem *pb)
{
    fmha_status st = fmha_validate_config(cfg);
    return st != FMHA_STATUS_OK ? st : fmha_validate_args(cfg, a, pb);
}

fmha_status fmha_validate_args(const fmha_config *cfg, const fmha_forward_args *a, fmha_problem *pb)
{
    fmha_status st;
    if (!a)
        return INVALID("forward args are NULL");

    const fmha_tensor *ts[4] = {&a->q, &a->k, &a->v, &a->out};
    const char *names[4] = {"q", "k", "v", "out"};
    for (int i = 0; i < 4; i++)
        if ((st = check_tensor(ts[i], names[i], 1)) != FMHA_STATUS_OK)
            return st;

    for (int i = 0; i < 3; i++)
        if (ts[i]->dtype != cfg->dtype)
            return INVALID("%s.dtype (%s) differs from the layer's dtype (%s): q, k and v must "
                           "all be %s",
                           names[i], fmha_dtype_name(ts[i]->dtype), fmha_dtype_name(cfg->dtype),
                           fmha_dtype_name(cfg->dtype));
    if (a->out.dtype == FMHA_DTYPE_F8_E4M3)
        return INVALID("out.dtype f8_e4m3 is not an output dtype: use f32, f16 or bf16");

    if (a->q.heads != cfg->num_heads)
        return INVALID("q.heads (%lld) differs from num_heads (%lld)", (long long)a->q.heads,
                       (long long)cfg->num_heads);
    if (a->out.heads != cfg->num_heads)
        return INVALID("out.heads (%lld) differs from num_heads (%lld)", (long long)a->out.heads,
                       (long long)cfg->num_heads);
    if (a->k.heads != cfg->num_kv_heads || a->v.heads != cfg->num_kv_heads)
        return INVALID("k.heads (%lld) and v.heads (%lld) must equal num_kv_heads (%lld)",
                       (long long)a->k.heads, (long long)a->v.heads, (long long)cfg->num_kv_heads);
    if (a->q.head_dim != cfg->head_dim || a->k.head_dim != cfg->head_dim)
        return INVALID("q.head_dim (%lld) and k.head_dim (%lld) must equal head_dim (%lld)",
                       (long long)a->q.head_dim, (long long)a->k.head_dim,
                       (long long)cfg->head_dim);
    if (a->v.head_dim != cfg->head_dim_v || a->out.head_dim != cfg->head_dim_v)
        return INVALID("v.head_dim (%lld) and out.head_dim (%lld) must equal head_dim_v (%lld)",
                       (long long)a->v.head_dim, (long long)a->out.head_dim,
                       (long long)cfg->head_dim_v);
    if ((st = check_rows_disjoint(&a->out, "out")) != FMHA_STATUS_OK)
        return st;
    if (a->q.batch != a->k.batch || a->q.batch != a->v.batch || a->q.batch != a->out.batch)
        return INVALID("batch sizes differ: q %lld, k %lld, v %lld, out %lld",
                       (long long)a->q.batch, (long long)a->k.batch, (long long)a->v.batch,
                       (long long)a->out.batch);
    if (a->q.seqlen != a->out.seqlen)
        return INVALID("out.seqlen (%lld) differs from q.seqlen (%lld)", (long long)a->out.seqlen,
                       (long long)a->q.seqlen);
    if (a->k.seqlen != a->v.seqlen)
        return INVALID("v.seqlen (%lld) differs from k.seqlen (%lld)", (long long)a->v.seqlen,
                       (long long)a->k.seqlen);

    memset(pb, 0, sizeof *pb);
    pb->cfg = cfg;
    pb->args = a;
    pb->heads = cfg->num_heads;
    pb->kv_heads = cfg->num_kv_heads;
    pb->group = cfg->num_heads / cfg->num_kv_heads;
    pb->d = cfg->head_dim;
    pb->dv = cfg->head_dim_v;

    if ((a->cu_seqlens_q == NULL) != (a->cu_seqlens_k == NULL))
        return INVALID("cu_seqlens_q and cu_seqlens_k must both be given (packed batch) or both "
                       "be NULL (padded batch)");
    if (a->cu_seqlens_q) {
        if (a->q.batch != 1)
            return INVALID("packed tensors have batch 1 (got %lld): use fmha_tensor_packed for "
                           "[total_tokens, heads, head_dim]",
                           (long long)a->q.batch);
        if (a->varlen_batch <= 0 || a->varlen_batch >= INT32_MAX)
            return INVALID("varlen_batch (%lld) must be in [1, 2^31 - 1) (cu_seqlens hold "
                           "varlen_batch + 1 entries)",
                           (long long)a->varlen_batch);
        if (a->q.seqlen > INT32_MAX || a->k.seqlen > INT32_MAX)
            return INVALID("packed tensors hold more than 2^31 tokens; int32 cu_seqlens cannot "
                           "index them");
        int64_t mq, mk;
        if ((st = check_cu_seqlens(a->cu_seqlens_q, a->varlen_batch, a->q.seqlen, "cu_seqlens_q",
                                   &mq)) != FMHA_STATUS_OK ||
            (st = check_cu_seqlens(a->cu_seqlens_k, a->varlen_batch, a->k.seqlen, "cu_seqlens_k",
                                   &mk)) != FMHA_STATUS_OK)
            return st;
        if (a->max_seqlen_q < 0 || (a->max_seqlen_q > 0 && a->max_seqlen_q < mq))
            return INVALID("max_seqlen_q (%lld) is below the longest query sequence (%lld); "
                           "pass 0 to let fmha compute it",
                           (long long)a->max_seqlen_q, (long long)mq);
        if (a->max_seqlen_k < 0 || (a->max_seqlen_k > 0 && a->max_seqlen_k < mk))
            return INVALID("max_seqlen_k (%lld) is below the longest key sequence (%lld); "
                           "pass 0 to let fmha compute it",
                           (long long)a->max_seqlen_k, (long long)mk);
        pb->varlen = 1;
        pb->batch = a->varlen_batch;
        pb->max_sq = mq;
        pb->max_sk = mk;
    } else {
        pb->batch = a->q.batch;
        pb->max_sq = a->q.seqlen;
        pb->max_sk = a->k.seqlen;
    }
    /* Dropout counters and task indices hold sequence x head in 32 bits. */
    if (pb->batch > INT32_MAX / pb->heads)
        return INVALID("batch x heads (%lld x %lld) exceeds 2^31", (long long)pb->batch,
                       (long long)pb->heads);

    if ((st = validate_descales(cfg, a, pb)) != FMHA_STATUS_OK)
        return st;

    pb->scale = cfg->softmax_scale != 0.0 ? cfg->softmax_scale : 1.0 / sqrt((double)cfg->head_dim);
    if (cfg->dropout_p > 0.0) {
        pb->drop_threshold = fmha_dropout_threshold(cfg->dropout_p);
        pb->drop_rescale = 1.0 / (1.0 - cfg->dropout_p);
    } else {
        pb->drop_rescale = 1.0;
    }
    return FMHA_STATUS_OK;
}

fmha_status fmha_validate_quantize(const fmha_tensor *x, const fmha_tensor *y, const float *scales,
                                   fmha_fp8_scaling scaling, int64_t block_rows, fmha_fp8_groups *g)
{
    if (!x)
        return INVALID("x is NULL");
    if (!y)
        return INVALID("y is NULL");
    if (!scales)
        return INVALID("scales is NULL");
    fmha_status st;
    if ((st = fmha_validate_tensor(x, "x")) != FMHA_STATUS_OK ||
        (st = fmha_validate_tensor(y, "y")) != FMHA_STATUS_OK)
        return st;
    if (x->dtype != FMHA_DTYPE_F32 && x->dtype != FMHA_DTYPE_F16 && x->dtype != FMHA_DTYPE_BF16)
        return INVALID("x.dtype (%s) must be f32, f16 or bf16", fmha_dtype_name(x->dtype));
    if (y->dtype != FMHA_DTYPE_F8_E4M3)
        return INVALID("y.dtype (%s) must be f8_e4m3", fmha_dtype_name(y->dtype));
    if (x->batch != y->batch || x->seqlen != y->seqlen || x->heads != y->heads ||
        x->head_dim != y->head_dim)
        return INVALID("y's shape [%lld, %lld, %lld, %lld] differs from x's [%lld, %lld, %lld, "
                       "%lld]: y holds one code per element of x",
                       (long long)y->batch, (long long)y->seqlen, (long long)y->heads,
                       (long long)y->head_dim, (long long)x->batch, (long long)x->seqlen,
                       (long long)x->heads, (long long)x->head_dim);

    fmha_fp8_groups r = {x->batch, x->heads, 1, 1, 1, x->seqlen, 0};
    switch (scaling) {
    case FMHA_FP8_PER_TENSOR:
        r.n_batch = r.n_head = 1;
        r.batch_span = x->batch;
        r.head_span = x->heads;
        break;
    case FMHA_FP8_PER_HEAD: break;
    case FMHA_FP8_PER_BLOCK:
        if (block_rows <= 0)
            return INVALID("block_rows (%lld) must be positive for FMHA_FP8_PER_BLOCK",
                           (long long)block_rows);
        r.rows = block_rows;
        r.n_block = x->seqlen / block_rows + (x->seqlen % block_rows != 0);
        break;
    default: return INVALID("scaling (%d) is not a fmha_fp8_scaling value", (int)scaling);
    }
    if (mul_overflows(r.n_batch, r.n_head, &r.count) ||
        mul_overflows(r.count, r.n_block, &r.count) || r.count > INT64_MAX / (int64_t)sizeof(float))
        return INVALID("%lld x %lld x %lld scales: the byte size overflows int64",
                       (long long)r.n_batch, (long long)r.n_head, (long long)r.n_block);
    *g = r;
    return FMHA_STATUS_OK;
}

/* A gradient's view, or dout's: f32, f16 or bf16, the shape of the tensor it
 * belongs to (`like`, named `of`). */
static fmha_status check_grad(const fmha_tensor *g, const char *name, const fmha_tensor *like,
                              const char *of)
{
    fmha_status st = check_tensor(g, name, 1);
    if (st != FMHA_STATUS_OK)
        return st;
    if (g->dtype == FMHA_DTYPE_F8_E4M3)
        return INVALID("%s.dtype f8_e4m3 is not a gradient dtype: use f32, f16 or bf16", name);
    if (g->batch != like->batch || g->seqlen != like->seqlen || g->heads != like->heads ||
        g->head_dim != like->head_dim)
        return INVALID("%s has shape [%lld, %lld, %lld, %lld], but %s's is [%lld, %lld, %lld, "
                       "%lld]: %s must have %s's shape",
                       name, (long long)g->batch, (long long)g->seqlen, (long long)g->heads,
                       (long long)g->head_dim, of, (long long)like->batch, (long long)like->seqlen,
                       (long long)like->heads, (long long)like->head_dim, name, of);
    return FMHA_STATUS_OK;
}

fmha_status fmha_validate_backward_args(const fmha_config *cfg, const fmha_backward_args *b,
                                        fmha_forward_args *fwd, fmha_problem *pb)
{
    if (!b)
        return INVALID("backward args are NULL");
    memset(fwd, 0, sizeof *fwd);
    fwd->q = b->q;
    fwd->k = b->k;
    fwd->v = b->v;
    fwd->out = b->out;
    fwd->lse = (float *)b->lse; /* read, never written, by a backward */
    fwd->cu_seqlens_q = b->cu_seqlens_q;
    fwd->cu_seqlens_k = b->cu_seqlens_k;
    fwd->varlen_batch = b->varlen_batch;
    fwd->max_seqlen_q = b->max_seqlen_q;
    fwd->max_seqlen_k = b->max_seqlen_k;
    fwd->seed = b->seed;
    fwd->offset = b->offset;
    fwd->stream = b->stream;
    fmha_status st = fmha_validate_args(cfg, fwd, pb);
    if (st != FMHA_STATUS_OK)
        return st;
    if (!b->lse)
        return INVALID("lse is NULL: the backward needs the LSE the forward wrote (pass an lse "
                       "buffer to the forward and the same one here)");
    if ((st = check_grad(&b->dout, "dout", &b->out, "out")) != FMHA_STATUS_OK)
        return st;
    const fmha_tensor *gs[3] = {&b->dq, &b->dk, &b->dv}, *of[3] = {&b->q, &b->k, &b->v};
    const char *names[3] = {"dq", "dk", "dv"}, *of_names[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++) {
        if (!gs[i]->data) /* not wanted */
            continue;
        if ((st = check_grad(gs[i], names[i], of[i], of_names[i])) != FMHA_STATUS_OK ||
            (st = check_rows_disjoint(gs[i], names[i])) != FMHA_STATUS_OK)
            return st;
    }
    pb->bwd = b;
    return FMHA_STATUS_OK;
}

fmha_status fmha_validate_backward(const fmha_config *cfg, const fmha_backward_args *b,
                                   fmha_forward_args *fwd, fmha_problem *pb)
{
    fmha_status st = fmha_validate_config(cfg);
    if (st != FMHA_STATUS_OK)
        return st;
    /* Backward args carry no descales: codes alone are not the inputs' values. */
    if (cfg->dtype == FMHA_DTYPE_F8_E4M3)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "f8_e4m3 inputs have no backward: train on f32, f16 or bf16 q, k, v");
    return fmha_validate_backward_args(cfg, b, fwd, pb);
}
