/* validate.c — the one place where a configuration and a forward call are
 * checked. Backends run only on what passed here, so they trust every number
 * and never repeat a check. */
#include "validate.h"

#include <math.h>
#include <stdio.h>

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
    if ((unsigned)cfg->fp8_compute > FMHA_FP8_COMPUTE_INT8_QK)
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
    if (cfg->fp8_compute == FMHA_FP8_COMPUTE_INT8_QK && cfg->softcap != 0)
        return INVALID("fp8_compute = int8_qk subtracts K's mean, which moves every score of a "
                       "query by q . mean(K): the softmax ignores that but softcap (%g) does not. "
                       "Set softcap = 0, or use fp8_compute = per_tensor",
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

/* Adds (dims[i] - 1) x strides[i] for i < n to *extent; returns the first
 * i where that overflows int64, or -1. */
static int span_overflows(const int64_t *dims, const int64_t *strides, int n, int64_t *extent)
{
    for (int i = 0; i < n; i++) {
        int64_t span;
        if (mul_overflows(dims[i] - 1, strides[i], &span) || add_overflows(*extent, span, extent))
            return i;
    }
    return -1;
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
    for (int i = 0; i < 3; i++)
        if (strides[i] < 0)
            return INVALID("%s.%s (%lld) must be >= 0", name, stride_names[i],
                           (long long)strides[i]);
    int64_t extent = t->head_dim;
    const int i = span_overflows(dims, strides, 3, &extent);
    if (i >= 0)
        return INVALID("%s spans more than 2^63 elements (%s %lld x %s %lld overflows)", name,
                       dim_names[i], (long long)dims[i], stride_names[i], (long long)strides[i]);
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

/* On the CPU (host memory), every one of the counts[i] entries of the n
 * descale arrays ds finite and > 0; on a device they stay in device memory,
 * where the kernel reads them. */
static fmha_status check_descale_values(const fmha_config *cfg, int n, const float *const *ds,
                                        const char *const *names, const int64_t *counts)
{
    if (cfg->device != FMHA_DEVICE_CPU)
        return FMHA_STATUS_OK;
    for (int i = 0; i < n; i++)
        for (int64_t e = 0; ds[i] && e < counts[i]; e++)
            if (!(isfinite(ds[i][e]) && ds[i][e] > 0.0f))
                return INVALID("%s[%lld] (%g) must be finite and > 0: a descale multiplies the "
                               "FP8 codes back to their values (the quantizer's scale)",
                               names[i], (long long)e, (double)ds[i][e]);
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
    return check_descale_values(cfg, 3, ds, names, counts);
}

/* The score modifiers of a call (fmha_forward_args): a known mask type with
 * strides >= 0, ALiBi's batch stride >= 0, and on the CPU (host memory)
 * every slope finite and no sink NaN. */
static fmha_status check_score_mods(const fmha_config *cfg, const fmha_forward_args *a,
                                    const fmha_problem *pb)
{
    const fmha_attn_mask *m = &a->mask;
    if (m->data) {
        if ((unsigned)m->type > FMHA_MASK_ADD_BF16)
            return INVALID("mask.type (%d) is not a fmha_mask_type value", (int)m->type);
        if (m->stride_batch < 0 || m->stride_head < 0 || m->stride_q < 0 || m->stride_k < 0)
            return INVALID("mask strides (%lld, %lld, %lld, %lld) must be >= 0 (0 broadcasts)",
                           (long long)m->stride_batch, (long long)m->stride_head,
                           (long long)m->stride_q, (long long)m->stride_k);
        /* the last element's index, and its byte, must be int64 */
        const int64_t dims[4] = {pb->batch, pb->heads, pb->max_sq, pb->max_sk};
        const int64_t strides[4] = {m->stride_batch, m->stride_head, m->stride_q, m->stride_k};
        int64_t extent = 0, span;
        if (span_overflows(dims, strides, 4, &extent) >= 0)
            return INVALID("mask spans more than 2^63 elements (strides %lld, %lld, %lld, "
                           "%lld): its strides are too large for its [%lld, %lld, %lld, %lld]",
                           (long long)m->stride_batch, (long long)m->stride_head,
                           (long long)m->stride_q, (long long)m->stride_k, (long long)dims[0],
                           (long long)dims[1], (long long)dims[2], (long long)dims[3]);
        if (mul_overflows(extent + 1, 4, &span))
            return INVALID("mask's byte size overflows int64 (strides too large)");
    }
    if (a->sinks && cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF &&
        (cfg->fp8_smooth_k || cfg->fp8_compute == FMHA_FP8_COMPUTE_INT8_QK))
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "sinks with K smoothing (fp8_smooth_k, or fp8_compute int8_qk): "
                              "smoothing moves each row's scores by its own amount, which a "
                              "sink's fixed logit would not follow; turn smoothing off");
    if (a->alibi_slopes && a->alibi_stride_batch < 0)
        return INVALID("alibi_stride_batch (%lld) must be >= 0 (0: one slope per head for every "
                       "sequence, num_heads: [batch, num_heads] slopes)",
                       (long long)a->alibi_stride_batch);
    if (cfg->device != FMHA_DEVICE_CPU)
        return FMHA_STATUS_OK;
    int64_t nslopes = 0;
    if (a->alibi_slopes && mul_overflows(a->alibi_stride_batch, pb->batch - 1, &nslopes))
        return INVALID("alibi_stride_batch (%lld) x %lld sequences overflows int64",
                       (long long)a->alibi_stride_batch, (long long)pb->batch);
    nslopes += pb->heads;
    for (int64_t e = 0; a->alibi_slopes && e < nslopes; e++)
        if (!isfinite(a->alibi_slopes[e]))
            return INVALID("alibi_slopes[%lld] (%g) must be finite", (long long)e,
                           (double)a->alibi_slopes[e]);
    for (int64_t h = 0; a->sinks && h < pb->heads; h++)
        if (isnan(a->sinks[h]) || a->sinks[h] == INFINITY)
            return INVALID("sinks[%lld] (%g) must be finite or -inf (no sink for that head): a "
                           "sink is a logit",
                           (long long)h, (double)a->sinks[h]);
    return FMHA_STATUS_OK;
}

int fmha_cu_seqlens_device_checked(const fmha_config *cfg, const fmha_forward_args *a)
{
    return cfg->device != FMHA_DEVICE_CPU && cfg->dtype != FMHA_DTYPE_F8_E4M3 &&
           cfg->fp8_compute == FMHA_FP8_COMPUTE_OFF && a && a->cu_seqlens_q &&
           a->max_seqlen_q > 0 && a->max_seqlen_k > 0;
}

/* fmha_validate_args; device_checked: cu_seqlens unread here (above). */
static fmha_status validate_args(const fmha_config *cfg, const fmha_forward_args *a,
                                 fmha_problem *pb, int device_checked)
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
    pb->pos_heads = cfg->num_heads;

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
        if (device_checked) { /* the bounds stand for the offsets, which the kernels check */
            mq = a->max_seqlen_q < a->q.seqlen ? a->max_seqlen_q : a->q.seqlen;
            mk = a->max_seqlen_k < a->k.seqlen ? a->max_seqlen_k : a->k.seqlen;
            pb->device_checked = 1;
        } else if ((st = check_cu_seqlens(a->cu_seqlens_q, a->varlen_batch, a->q.seqlen,
                                          "cu_seqlens_q", &mq)) != FMHA_STATUS_OK ||
                   (st = check_cu_seqlens(a->cu_seqlens_k, a->varlen_batch, a->k.seqlen,
                                          "cu_seqlens_k", &mk)) != FMHA_STATUS_OK) {
            return st;
        }
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

    if ((st = validate_descales(cfg, a, pb)) != FMHA_STATUS_OK ||
        (st = check_score_mods(cfg, a, pb)) != FMHA_STATUS_OK)
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

fmha_status fmha_validate_args(const fmha_config *cfg, const fmha_forward_args *a, fmha_problem *pb)
{
    return validate_args(cfg, a, pb, fmha_cu_seqlens_device_checked(cfg, a));
}

fmha_status fmha_validate_forward(const fmha_config *cfg, const fmha_forward_args *a,
                                  fmha_problem *pb)
{
    fmha_status st = fmha_validate_config(cfg);
    return st != FMHA_STATUS_OK ? st : fmha_validate_args(cfg, a, pb);
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

/* ------------------------------------------------------------------ decode */

/* The rotary table covers every position the call rotates (fmha.h). */
static fmha_status check_rotary(const fmha_config *cfg, const fmha_kvcache_args *a,
                                const fmha_problem *pb)
{
    if (a->rotary_dim == 0) {
        if (a->rotary_cos || a->rotary_sin)
            return INVALID("rotary_cos / rotary_sin are given but rotary_dim is 0: set rotary_dim "
                           "to the rotated channels, or pass NULL");
        return FMHA_STATUS_OK;
    }
    if (a->rotary_dim < 0 || a->rotary_dim % 2 || a->rotary_dim > cfg->head_dim)
        return INVALID("rotary_dim (%lld) must be even and in [2, head_dim = %lld] (0: no rotary)",
                       (long long)a->rotary_dim, (long long)cfg->head_dim);
    if (!a->rotary_cos || !a->rotary_sin)
        return INVALID("rotary_dim is %lld but rotary_cos or rotary_sin is NULL: pass both "
                       "tables, f32 [rotary_len, rotary_dim / 2]",
                       (long long)a->rotary_dim);
    if (a->rotary_len <= 0)
        return INVALID("rotary_len (%lld) must be positive: the rows of rotary_cos and rotary_sin",
                       (long long)a->rotary_len);
    if (!a->k_new.data)
        return INVALID("rotary embedding rotates the new keys as they enter the cache: pass k_new "
                       "and v_new with rotary_cos / rotary_sin");
    /* Arrays checked on the device: every sequence at the bound, the worst case. */
    for (int64_t b = 0; b < (pb->device_checked ? 1 : pb->batch); b++) {
        const int64_t cached = pb->device_checked ? pb->max_sk - pb->seqlen_new
                                                  : fmha_cache_keys(pb, b) - pb->seqlen_new;
        const int64_t last_q = fmha_rotary_q_pos(cfg, cached, a->q.seqlen - 1);
        const int64_t last =
            cached + pb->seqlen_new - 1 > last_q ? cached + pb->seqlen_new - 1 : last_q;
        if (last >= a->rotary_len)
            return INVALID("sequence %lld rotates position %lld, past rotary_len (%lld): the "
                           "rotary tables need a row per position up to the longest sequence",
                           (long long)b, (long long)last, (long long)a->rotary_len);
    }
    return FMHA_STATUS_OK;
}

/* Where the caches are and how many keys each sequence has: cache rows or
 * pages, lengths within the capacity, every page a page of the cache. */
static fmha_status check_cache_layout(const fmha_kvcache_args *a, fmha_problem *pb)
{
    const fmha_tensor *kc = &a->k_cache;
    if (a->block_table) {
        if (a->cache_batch_idx)
            return INVALID("cache_batch_idx picks rows of a contiguous cache; with a block_table "
                           "the pages say where each sequence lives: pass NULL");
        if (a->block_table_stride <= 0)
            return INVALID("block_table_stride (%lld) must be positive: the entries of each "
                           "sequence's row of block_table",
                           (long long)a->block_table_stride);
        pb->page_table = a->block_table;
        pb->page_stride = a->block_table_stride;
        pb->page_size = kc->seqlen;
        if (mul_overflows(pb->page_stride, pb->page_size, &pb->capacity))
            return INVALID("block_table_stride x page_size (%lld x %lld) overflows int64",
                           (long long)pb->page_stride, (long long)pb->page_size);
    } else {
        pb->capacity = kc->seqlen;
        pb->kv_batch = a->cache_batch_idx;
        for (int64_t b = 0; a->cache_batch_idx && !pb->device_checked && b < pb->batch; b++)
            if (a->cache_batch_idx[b] < 0 || a->cache_batch_idx[b] >= kc->batch)
                return INVALID(
                    "cache_batch_idx[%lld] (%d) is not a row of the cache (k_cache.batch "
                    "= %lld)",
                    (long long)b, (int)a->cache_batch_idx[b], (long long)kc->batch);
        if (!a->cache_batch_idx && kc->batch < pb->batch)
            return INVALID("k_cache.batch (%lld) is below q.batch (%lld): give every sequence a "
                           "row of the cache, or pass cache_batch_idx",
                           (long long)kc->batch, (long long)pb->batch);
    }
    if (!a->cache_seqlens && pb->seqlen_new > 0)
        return INVALID("cache_seqlens is NULL (every cache full) but k_new brings %lld tokens: "
                       "pass cache_seqlens, the tokens each cache holds before the call",
                       (long long)pb->seqlen_new);
    pb->cache_seqlens = a->cache_seqlens;
    pb->max_sk = 0;
    if (a->max_seqlen_k < 0)
        return INVALID("max_seqlen_k (%lld) must be >= 0 (0: no bound given)",
                       (long long)a->max_seqlen_k);
    if (a->max_seqlen_k > pb->capacity)
        return INVALID("max_seqlen_k (%lld) is past the cache's capacity of %lld%s: no "
                       "sequence can hold that many keys; pass at most the capacity",
                       (long long)a->max_seqlen_k, (long long)pb->capacity,
                       a->block_table ? " (block_table_stride x page_size)" : "");
    if (pb->device_checked) { /* the bound stands for the arrays, which the kernels check */
        if (a->max_seqlen_k < pb->seqlen_new ||
            (!a->cache_seqlens && a->max_seqlen_k < pb->capacity))
            return INVALID("max_seqlen_k (%lld) is below the keys every sequence has (%lld): "
                           "pass a bound on cached plus new tokens",
                           (long long)a->max_seqlen_k,
                           (long long)(a->cache_seqlens ? pb->seqlen_new : pb->capacity));
        pb->max_sk = a->max_seqlen_k;
        return FMHA_STATUS_OK;
    }
    for (int64_t b = 0; b < pb->batch; b++) {
        const int64_t cached = a->cache_seqlens ? a->cache_seqlens[b] : pb->capacity;
        if (cached < 0)
            return INVALID("cache_seqlens[%lld] (%lld) must be non-negative", (long long)b,
                           (long long)cached);
        if (cached > pb->capacity - pb->seqlen_new)
            return INVALID("sequence %lld needs %lld keys (cache_seqlens %lld + %lld new), past "
                           "the cache's capacity of %lld%s: grow the cache%s",
                           (long long)b, (long long)(cached + pb->seqlen_new), (long long)cached,
                           (long long)pb->seqlen_new, (long long)pb->capacity,
                           a->block_table ? " (block_table_stride x page_size)" : "",
                           a->block_table ? " or the block table" : "");
        const int64_t keys = cached + pb->seqlen_new;
        if (a->max_seqlen_k > 0 && keys > a->max_seqlen_k)
            return INVALID("sequence %lld has %lld keys (cache_seqlens %lld + %lld new), past "
                           "max_seqlen_k (%lld): raise the bound, or pass 0 for none",
                           (long long)b, (long long)keys, (long long)cached,
                           (long long)pb->seqlen_new, (long long)a->max_seqlen_k);
        if (keys > pb->max_sk)
            pb->max_sk = keys;
        if (!a->block_table)
            continue;
        for (int64_t p = 0; p < (keys + pb->page_size - 1) / pb->page_size; p++) {
            const int32_t page = a->block_table[b * pb->page_stride + p];
            if (page < 0 || page >= kc->batch)
                return INVALID("block_table[%lld][%lld] (%d) is not a page of the cache: pages are "
                               "[0, %lld) (k_cache.batch)",
                               (long long)b, (long long)p, (int)page, (long long)kc->batch);
        }
    }
    return FMHA_STATUS_OK;
}

/* The descales of FP8 caches: both given for f8_e4m3 caches and none for
 * others, a known layout, and on the CPU (host memory) every entry finite
 * and > 0. */
static fmha_status check_cache_descales(const fmha_config *cfg, const fmha_kvcache_args *a,
                                        const fmha_problem *pb)
{
    const float *ds[2] = {a->k_descale, a->v_descale};
    const char *names[2] = {"k_descale", "v_descale"};
    if (a->k_cache.dtype != FMHA_DTYPE_F8_E4M3) {
        for (int i = 0; i < 2; i++)
            if (ds[i])
                return INVALID("%s is given, but the caches are %s: descales belong to f8_e4m3 "
                               "caches only (pass NULL)",
                               names[i], fmha_dtype_name(a->k_cache.dtype));
        return FMHA_STATUS_OK;
    }
    for (int i = 0; i < 2; i++)
        if (!ds[i])
            return INVALID("%s is NULL, but the caches are f8_e4m3: pass the descales their codes "
                           "were written with (fmha_kv_descale_layout)",
                           names[i]);
    int64_t count;
    switch (a->kv_descale_layout) {
    case FMHA_KV_DESCALE_PER_TENSOR: count = 1; break;
    case FMHA_KV_DESCALE_PER_HEAD: count = pb->kv_heads; break;
    case FMHA_KV_DESCALE_PER_PAGE:
        if (mul_overflows(a->k_cache.batch, pb->kv_heads, &count))
            return INVALID("k_cache.batch x num_kv_heads (%lld x %lld) overflows int64",
                           (long long)a->k_cache.batch, (long long)pb->kv_heads);
        break;
    default:
        return INVALID("kv_descale_layout (%d) is not a fmha_kv_descale_layout value",
                       (int)a->kv_descale_layout);
    }
    const int64_t counts[2] = {count, count};
    return check_descale_values(cfg, 2, ds, names, counts);
}

fmha_status fmha_validate_decode(const fmha_config *cfg, const fmha_kvcache_args *a,
                                 fmha_forward_args *fwd, fmha_problem *pb)
{
    fmha_status st;
    if (!a)
        return INVALID("decode args are NULL");
    if (cfg->dtype == FMHA_DTYPE_F8_E4M3)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "decode takes f32, f16 or bf16 queries (the layer's dtype is "
                              "f8_e4m3): build the decode layer in q's dtype; its caches may be "
                              "f8_e4m3 (k_descale, v_descale)");
    if (cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "this layer quantizes q, k and v to FP8 on every call (fp8_compute), "
                              "which a cache of past keys does not suit: decode on a layer with "
                              "fp8_compute off");
    if (cfg->dropout_p != 0.0)
        return INVALID("dropout_p (%g) must be 0 for decoding: build the decode layer without "
                       "dropout",
                       cfg->dropout_p);
    const int has_new = a->k_new.data || a->v_new.data;
    const fmha_tensor *ts[6] = {&a->q, &a->out, &a->k_cache, &a->v_cache, &a->k_new, &a->v_new};
    const char *names[6] = {"q", "out", "k_cache", "v_cache", "k_new", "v_new"};
    for (int i = 0; i < (has_new ? 6 : 4); i++)
        if ((st = check_tensor(ts[i], names[i], i != 2 && i != 3)) != FMHA_STATUS_OK)
            return st;
    const int f8 = a->k_cache.dtype == FMHA_DTYPE_F8_E4M3;
    for (int i = 0; i < (has_new ? 6 : 4); i++)
        if (i != 1 && ts[i]->dtype != cfg->dtype && !(f8 && (i == 2 || i == 3)))
            return INVALID("%s.dtype (%s) differs from the layer's dtype (%s)%s", names[i],
                           fmha_dtype_name(ts[i]->dtype), fmha_dtype_name(cfg->dtype),
                           i == 2 || i == 3 ? " (caches may also be f8_e4m3, both of them)" : "");
    if (a->v_cache.dtype != a->k_cache.dtype)
        return INVALID("v_cache.dtype (%s) differs from k_cache.dtype (%s): the caches share "
                       "their dtype",
                       fmha_dtype_name(a->v_cache.dtype), fmha_dtype_name(a->k_cache.dtype));
    if (a->out.dtype == FMHA_DTYPE_F8_E4M3)
        return INVALID("out.dtype f8_e4m3 is not an output dtype: use f32, f16 or bf16");
    if ((st = check_rows_disjoint(&a->out, "out")) != FMHA_STATUS_OK)
        return st;
    const int64_t want_heads[6] = {cfg->num_heads,    cfg->num_heads,    cfg->num_kv_heads,
                                   cfg->num_kv_heads, cfg->num_kv_heads, cfg->num_kv_heads};
    const int64_t want_dim[6] = {cfg->head_dim,   cfg->head_dim_v, cfg->head_dim,
                                 cfg->head_dim_v, cfg->head_dim,   cfg->head_dim_v};
    for (int i = 0; i < (has_new ? 6 : 4); i++)
        if (ts[i]->heads != want_heads[i] || ts[i]->head_dim != want_dim[i])
            return INVALID("%s has %lld heads of dim %lld; this layer needs %lld of dim %lld",
                           names[i], (long long)ts[i]->heads, (long long)ts[i]->head_dim,
                           (long long)want_heads[i], (long long)want_dim[i]);
    if (a->out.batch != a->q.batch || a->out.seqlen != a->q.seqlen)
        return INVALID("out [%lld, %lld] differs from q [%lld, %lld] in batch or seqlen",
                       (long long)a->out.batch, (long long)a->out.seqlen, (long long)a->q.batch,
                       (long long)a->q.seqlen);
    if (a->v_cache.batch != a->k_cache.batch || a->v_cache.seqlen != a->k_cache.seqlen)
        return INVALID("v_cache [%lld, %lld] differs from k_cache [%lld, %lld] in its first two "
                       "dims: keys and values share their cache layout",
                       (long long)a->v_cache.batch, (long long)a->v_cache.seqlen,
                       (long long)a->k_cache.batch, (long long)a->k_cache.seqlen);
    if (has_new && (!a->k_new.data || !a->v_new.data || a->k_new.batch != a->q.batch ||
                    a->v_new.batch != a->q.batch || a->k_new.seqlen != a->v_new.seqlen))
        return INVALID("k_new [%lld, %lld] and v_new [%lld, %lld] must both be given, with "
                       "q's batch (%lld) and one seqlen: the tokens appended to each sequence",
                       (long long)a->k_new.batch, (long long)a->k_new.seqlen,
                       (long long)a->v_new.batch, (long long)a->v_new.seqlen,
                       (long long)a->q.batch);
    if (a->num_splits < 0)
        return INVALID("num_splits (%lld) must be >= 0 (0: fmha chooses)",
                       (long long)a->num_splits);

    memset(pb, 0, sizeof *pb);
    memset(fwd, 0, sizeof *fwd);
    fwd->q = a->q;
    fwd->k = a->k_cache;
    fwd->v = a->v_cache;
    fwd->out = a->out;
    fwd->lse = a->lse;
    fwd->stream = a->stream;
    pb->cfg = cfg;
    pb->args = fwd;
    pb->kv_cache = 1;
    pb->batch = a->q.batch;
    pb->heads = cfg->num_heads;
    pb->kv_heads = cfg->num_kv_heads;
    pb->group = cfg->num_heads / cfg->num_kv_heads;
    pb->d = cfg->head_dim;
    pb->dv = cfg->head_dim_v;
    pb->max_sq = a->q.seqlen;
    pb->seqlen_new = has_new ? a->k_new.seqlen : 0;
    pb->num_splits = a->num_splits;
    pb->pos_heads = pb->heads; /* the dropout stream's identity (no dropout here) */
    /* Device memory without host copies of the arrays: the kernels check them. */
    pb->device_checked = cfg->device != FMHA_DEVICE_CPU && a->max_seqlen_k > 0;
    pb->scale = cfg->softmax_scale != 0.0 ? cfg->softmax_scale : 1.0 / sqrt((double)cfg->head_dim);
    pb->drop_rescale = 1.0;
    if (pb->batch > INT32_MAX / pb->heads)
        return INVALID("batch x heads (%lld x %lld) exceeds 2^31", (long long)pb->batch,
                       (long long)pb->heads);
    if ((st = check_cache_layout(a, pb)) != FMHA_STATUS_OK ||
        (st = check_cache_descales(cfg, a, pb)) != FMHA_STATUS_OK)
        return st;
    fwd->descale_k = a->k_descale;
    fwd->descale_v = a->v_descale;
    pb->kv_descale_layout = a->kv_descale_layout;
    fwd->alibi_slopes = a->alibi_slopes;
    fwd->alibi_stride_batch = a->alibi_stride_batch;
    fwd->sinks = a->sinks;
    if ((st = check_score_mods(cfg, fwd, pb)) != FMHA_STATUS_OK)
        return st;
    return check_rotary(cfg, a, pb);
}

static int is_float_dtype(fmha_dtype t)
{
    return t == FMHA_DTYPE_F32 || t == FMHA_DTYPE_F16 || t == FMHA_DTYPE_BF16;
}

fmha_status fmha_validate_merge(int num_parts, const fmha_tensor *parts, const float *const *lses,
                                const fmha_tensor *out, float *lse, fmha_merge_problem *mp,
                                fmha_lse_view views[FMHA_MERGE_MAX_PARTS])
{
    fmha_status st;
    if (num_parts < 1 || num_parts > FMHA_MERGE_MAX_PARTS)
        return INVALID("num_parts (%d) must be in [1, %d]; merge more in steps (a merge of "
                       "merges is the merge)",
                       num_parts, FMHA_MERGE_MAX_PARTS);
    if (!parts)
        return INVALID("parts is NULL: pass num_parts partial outputs");
    if (!lses)
        return INVALID("lses is NULL: each part needs its LSE (the forward's lse output)");
    if (!out)
        return INVALID("out is NULL");
    if ((st = check_tensor(out, "out", 1)) != FMHA_STATUS_OK)
        return st;
    if (!is_float_dtype(out->dtype))
        return INVALID("out.dtype (%s) must be f32, f16 or bf16", fmha_dtype_name(out->dtype));
    if ((st = check_rows_disjoint(out, "out")) != FMHA_STATUS_OK)
        return st;
    const int empty = out->batch == 0 || out->seqlen == 0;
    int64_t rows;
    if (mul_overflows(out->batch, out->seqlen, &rows) || mul_overflows(rows, out->heads, &rows) ||
        rows > INT64_MAX / (int64_t)sizeof(float))
        return INVALID("out has %lld x %lld x %lld rows: the LSE's byte size overflows int64",
                       (long long)out->batch, (long long)out->seqlen, (long long)out->heads);
    for (int i = 0; i < num_parts; i++) {
        char name[32];
        snprintf(name, sizeof name, "parts[%d]", i);
        if ((st = check_tensor(&parts[i], name, 1)) != FMHA_STATUS_OK)
            return st;
        if (!is_float_dtype(parts[i].dtype))
            return INVALID("%s.dtype (%s) must be f32, f16 or bf16", name,
                           fmha_dtype_name(parts[i].dtype));
        if (parts[i].dtype != parts[0].dtype)
            return INVALID("%s.dtype (%s) differs from parts[0].dtype (%s): the parts share one "
                           "dtype (f32 keeps a ring's partial results exact)",
                           name, fmha_dtype_name(parts[i].dtype), fmha_dtype_name(parts[0].dtype));
        if (parts[i].batch != out->batch || parts[i].seqlen != out->seqlen ||
            parts[i].heads != out->heads || parts[i].head_dim != out->head_dim)
            return INVALID("%s's shape [%lld, %lld, %lld, %lld] differs from out's [%lld, %lld, "
                           "%lld, %lld]: every part holds the same query rows",
                           name, (long long)parts[i].batch, (long long)parts[i].seqlen,
                           (long long)parts[i].heads, (long long)parts[i].head_dim,
                           (long long)out->batch, (long long)out->seqlen, (long long)out->heads,
                           (long long)out->head_dim);
        if (!lses[i] && !empty)
            return INVALID("lses[%d] is NULL: each part needs its LSE [batch, heads, seqlen]", i);
        views[i].data = (float *)lses[i];
        views[i].stride_head = out->seqlen;
        views[i].stride_batch = out->heads * out->seqlen;
    }
    mp->n = num_parts;
    mp->parts = parts;
    mp->lses = views;
    mp->out = *out;
    mp->lse.data = lse;
    mp->lse.stride_head = out->seqlen;
    mp->lse.stride_batch = out->heads * out->seqlen;
    return FMHA_STATUS_OK;
}

fmha_status fmha_validate_sp_config(const fmha_sp_config *sp, int ranks)
{
    if (!sp)
        return INVALID("sp config is NULL: fill one with fmha_sp_config_init");
    if (sp->ulysses < 1 || sp->ulysses > 65536)
        return INVALID("ulysses (%d) must be in [1, 65536] (1: no Ulysses)", sp->ulysses);
    if (sp->ring < 1 || sp->ring > 65536)
        return INVALID("ring (%d) must be in [1, 65536] (1: no ring)", sp->ring);
    if ((unsigned)sp->layout > FMHA_SP_LAYOUT_ZIGZAG)
        return INVALID("layout (%d) is not a fmha_sp_layout value", (int)sp->layout);
    if ((int64_t)sp->ulysses * sp->ring != ranks)
        return INVALID("ulysses (%d) x ring (%d) = %lld ranks, but there are %d: sequence "
                       "parallelism of degree %d needs ulysses x ring = %d",
                       sp->ulysses, sp->ring, (long long)sp->ulysses * sp->ring, ranks, ranks,
                       ranks);
    return FMHA_STATUS_OK;
}

/* A group of sequence-parallel tensors checked as a forward call's: shapes
 * against cfg, dtypes, strides, out's rows. */
static fmha_status check_sp_tensors(const fmha_config *cfg, const fmha_tensor *q,
                                    const fmha_tensor *k, const fmha_tensor *v,
                                    const fmha_tensor *out, float *lse)
{
    fmha_forward_args f;
    memset(&f, 0, sizeof f);
    f.q = *q, f.k = *k, f.v = *v, f.out = *out, f.lse = lse;
    fmha_problem pb;
    return fmha_validate_args(cfg, &f, &pb);
}

fmha_status fmha_validate_sp(const fmha_config *cfg, const fmha_sp_config *sp, int rank, int ranks,
                             fmha_device device, const char *comm_name, const fmha_sp_args *a,
                             fmha_sp_problem *pb)
{
    fmha_status st;
    if ((st = fmha_validate_config(cfg)) != FMHA_STATUS_OK ||
        (st = fmha_validate_sp_config(sp, ranks)) != FMHA_STATUS_OK)
        return st;
    if (!a)
        return INVALID("sp args are NULL");
    if (cfg->device != device)
        return INVALID("cfg.device is %s, but the %s communicator moves %s memory: %s",
                       cfg->device == FMHA_DEVICE_CUDA ? "cuda" : "cpu", comm_name,
                       device == FMHA_DEVICE_CUDA ? "device" : "host",
                       device == FMHA_DEVICE_CUDA ? "use NCCL with device cuda"
                                                  : "use MPI with device cpu, NCCL for CUDA");
    if (cfg->dtype == FMHA_DTYPE_F8_E4M3 || cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "sequence parallelism runs f32, f16 and bf16 attention; FP8 "
                              "(f8_e4m3 inputs or fp8_compute) is not supported yet");
    const int64_t h = cfg->num_heads, kv = cfg->num_kv_heads, u = sp->ulysses;
    if (h % u != 0)
        return INVALID("num_heads (%lld) is not divisible by ulysses (%lld): each Ulysses rank "
                       "takes num_heads / ulysses query heads; choose a ulysses degree that "
                       "divides %lld and give the rest of the degree to ring",
                       (long long)h, (long long)u, (long long)h);
    if (kv % u != 0 && u % kv != 0)
        return INVALID("num_kv_heads (%lld) and ulysses (%lld): neither divides the other, so "
                       "the KV heads can be neither split (num_kv_heads / ulysses per rank) nor "
                       "replicated (ulysses / num_kv_heads ranks per KV head); choose a ulysses "
                       "degree that divides %lld or is a multiple of it",
                       (long long)kv, (long long)u, (long long)kv);
    if (a->seqlen < 0 || a->seqlen > ((int64_t)1 << 40))
        return INVALID("seqlen (%lld) must be in [0, 2^40]: the tokens of the whole sequence",
                       (long long)a->seqlen);
    if ((unsigned)a->joint > FMHA_SP_JOINT_REAR)
        return INVALID("joint (%d) is not a fmha_sp_joint value", (int)a->joint);
    if ((st = check_sp_tensors(cfg, &a->q, &a->k, &a->v, &a->out, a->lse)) != FMHA_STATUS_OK)
        return st;
    if ((a->cu_seqlens == NULL) != (a->varlen_batch == 0))
        return INVALID("cu_seqlens (%s) and varlen_batch (%lld): give both (packed sequences) "
                       "or neither (a padded batch)",
                       a->cu_seqlens ? "given" : "NULL", (long long)a->varlen_batch);
    if (a->cu_seqlens) {
        if (a->varlen_batch < 0 || a->varlen_batch >= INT32_MAX)
            return INVALID("varlen_batch (%lld) must be in [1, 2^31 - 1) (cu_seqlens hold "
                           "varlen_batch + 1 entries)",
                           (long long)a->varlen_batch);
        if (a->q.batch != 1)
            return INVALID("packed sequences have batch 1 (q.batch is %lld): a rank's tokens "
                           "of every sequence, one after another",
                           (long long)a->q.batch);
        if (a->joint != FMHA_SP_JOINT_NONE)
            return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                  "joint tokens with packed sequences (cu_seqlens) are not "
                                  "supported: give each sequence's text as part of it");
        int64_t longest;
        if ((st = check_cu_seqlens(a->cu_seqlens, a->varlen_batch, a->seqlen, "cu_seqlens",
                                   &longest)) != FMHA_STATUS_OK)
            return st;
        if (a->cu_seqlens[a->varlen_batch] != a->seqlen)
            return INVALID("cu_seqlens[%lld] (%d) differs from seqlen (%lld): seqlen is the "
                           "tokens of all the packed sequences",
                           (long long)a->varlen_batch, (int)a->cu_seqlens[a->varlen_batch],
                           (long long)a->seqlen);
    }
    const int64_t held =
        fmha_sp_member_tokens(sp, a->seqlen, a->cu_seqlens, a->cu_seqlens ? a->varlen_batch : 0,
                              rank / sp->ulysses, rank % sp->ulysses);
    if (a->cu_seqlens && a->q.seqlen != held)
        return INVALID("q.seqlen (%lld) differs from the %lld tokens rank %d holds of %lld "
                       "packed sequences over ulysses %d x ring %d (%s layout): shard each "
                       "sequence with fmha_sp_tokens",
                       (long long)a->q.seqlen, (long long)held, rank, (long long)a->varlen_batch,
                       sp->ulysses, sp->ring,
                       sp->layout == FMHA_SP_LAYOUT_ZIGZAG ? "zigzag" : "contiguous");
    if (a->q.seqlen != held)
        return INVALID("q.seqlen (%lld) differs from the %lld tokens rank %d holds of a sequence "
                       "of %lld over ulysses %d x ring %d (%s layout): shard with fmha_sp_tokens",
                       (long long)a->q.seqlen, (long long)held, rank, (long long)a->seqlen,
                       sp->ulysses, sp->ring,
                       sp->layout == FMHA_SP_LAYOUT_ZIGZAG ? "zigzag" : "contiguous");
    if (a->k.seqlen != a->q.seqlen)
        return INVALID("k.seqlen (%lld) differs from q.seqlen (%lld): a rank holds the same "
                       "tokens of q, k and v",
                       (long long)a->k.seqlen, (long long)a->q.seqlen);
    int64_t text = 0;
    if (a->joint != FMHA_SP_JOINT_NONE) {
        if ((st = check_sp_tensors(cfg, &a->q_joint, &a->k_joint, &a->v_joint, &a->out_joint,
                                   a->lse_joint)) != FMHA_STATUS_OK)
            return st;
        text = a->q_joint.seqlen;
        if (a->k_joint.seqlen != text)
            return INVALID("k_joint.seqlen (%lld) differs from q_joint.seqlen (%lld): joint "
                           "tokens are the same tokens in q, k and v",
                           (long long)a->k_joint.seqlen, (long long)text);
        if (a->q_joint.batch != a->q.batch)
            return INVALID("q_joint.batch (%lld) differs from q.batch (%lld)",
                           (long long)a->q_joint.batch, (long long)a->q.batch);
    }
    memset(pb, 0, sizeof *pb);
    pb->u = sp->ulysses;
    pb->r = sp->ring;
    pb->slot = rank / sp->ulysses;
    pb->member = rank % sp->ulysses;
    pb->batch = a->q.batch;
    pb->heads = h;
    pb->kv_heads = kv;
    pb->lheads = h / u;
    pb->lkv = kv % u == 0 ? kv / u : 1;
    pb->d = cfg->head_dim;
    pb->dv = cfg->head_dim_v;
    pb->seqlen = a->seqlen;
    pb->text = text;
    pb->img0 = a->joint == FMHA_SP_JOINT_FRONT ? text : 0;
    pb->text0 = a->joint == FMHA_SP_JOINT_REAR ? a->seqlen : 0;
    pb->local = held;
    pb->cu = a->cu_seqlens;
    pb->nseq = a->cu_seqlens ? a->varlen_batch : 0;
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
    fwd->mask = b->mask;
    fwd->alibi_slopes = b->alibi_slopes;
    fwd->alibi_stride_batch = b->alibi_stride_batch;
    fwd->sinks = b->sinks;
    /* The backward's host copies of cu_seqlens are checked here. */
    fmha_status st = validate_args(cfg, fwd, pb, 0);
    if (st != FMHA_STATUS_OK)
        return st;
    if (b->dsinks && !b->sinks)
        return INVALID("dsinks is given without sinks: the gradient of the sinks needs the "
                       "forward's sinks");
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
