/* reference.c — the float64 reference every fast path is tested against,
 * forward and backward. Plain loops over (sequence, head, query row), one key
 * row at a time (the backward: over (sequence, KV head), then its group's
 * query rows), float64 accumulation, every feature. Never fast on purpose: it
 * must stay obvious. FP8 inputs are their codes' values times their
 * descales, exactly. */
#include "alloc.h"
#include "validate.h"

#include <omp.h>
#include <stdlib.h>

/* Query row i of sequence b, head h, as float64 into qd: descaled, and for
 * a decode call with rotary rotated (fmha.h) in float64. */
static void load_q(const fmha_problem *pb, const fmha_kvcache_args *kv, int64_t b, int64_t i,
                   int64_t h, double *qd)
{
    const fmha_forward_args *a = pb->args;
    int64_t q0, sq, k0, sk;
    fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
    const char *qrow = fmha_row(&a->q, pb->varlen ? 0 : b, q0 + i, h);
    const double dq = fmha_row_descale(pb, 0, b, q0 + i, h); /* 1 unless FP8 */
    for (int64_t c = 0; c < pb->d; c++)
        qd[c] = (double)fmha_load_f32(qrow, a->q.dtype, c) * dq;
    if (!kv || kv->rotary_dim == 0)
        return;
    const int64_t half = kv->rotary_dim / 2;
    const int64_t pos = fmha_rotary_q_pos(pb->cfg, sk - pb->seqlen_new, i);
    for (int64_t c = 0; c < half; c++) {
        int64_t c1, c2;
        fmha_rotary_pair(kv->rotary_dim, kv->rotary_interleaved, c, &c1, &c2);
        const double x1 = qd[c1], x2 = qd[c2];
        const double cs = kv->rotary_cos[pos * half + c], sn = kv->rotary_sin[pos * half + c];
        qd[c1] = x1 * cs - x2 * sn;
        qd[c2] = x1 * sn + x2 * cs;
    }
}

/* What the score modifiers (fmha_forward_args) add to the score of query i
 * and key j of sequence b, head h: the additive mask's value minus ALiBi's
 * slope times the distance from the query's diagonal, or -inf where a
 * boolean mask hides the key. */
static double score_bias(const fmha_forward_args *a, int64_t b, int64_t h, int64_t i, int64_t j,
                         int64_t sq, int64_t sk)
{
    const fmha_attn_mask *m = &a->mask;
    double x = 0.0;
    if (m->data) {
        const int64_t e =
            b * m->stride_batch + h * m->stride_head + i * m->stride_q + j * m->stride_k;
        if (m->type == FMHA_MASK_BOOL && ((const uint8_t *)m->data)[e] == 0)
            return -INFINITY;
        if (m->type != FMHA_MASK_BOOL)
            x = fmha_load_f32(m->data, fmha_mask_dtype(m->type), e);
    }
    if (a->alibi_slopes)
        x -= (double)a->alibi_slopes[b * a->alibi_stride_batch + h] *
             fabs((double)(i + sk - sq - j));
    return x;
}

/* The sink logit of head h: -inf without sinks. */
static double sink_of(const fmha_forward_args *a, int64_t h)
{
    return a->sinks ? (double)a->sinks[h] : -INFINITY;
}

/* Each thread's scratch of attention(), allocated before anything is
 * written: the scores of a row, its accumulator and its query. */
static int64_t scratch_per_thread(const fmha_problem *pb)
{
    return (pb->max_sk > 0 ? pb->max_sk : 1) + pb->dv + pb->d;
}

static double *scratch_alloc(const fmha_config *cfg, const fmha_problem *pb, int *threads)
{
    *threads = cfg->num_threads > 0 ? cfg->num_threads : omp_get_max_threads();
    double *s = fmha_malloc(sizeof(double) * (size_t)(scratch_per_thread(pb) * *threads));
    if (!s)
        fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory in the reference");
    return s;
}

/* Attention of a validated problem on `threads` threads (scratch_alloc's),
 * freeing `scratch`; kv: the decode call's arguments, or NULL. */
static fmha_status attention(const fmha_config *cfg, const fmha_problem *ppb,
                             const fmha_kvcache_args *kv, double *scratch, int threads)
{
    const fmha_problem pb = *ppb;
    const fmha_forward_args *a = pb.args;
    const int64_t d = pb.d, dv = pb.dv;
    /* (sequence, head) pairs are independent: one thread each, so that the
     * tests' large cases stay quick; every row's sums run in the same order. */
    const int64_t per_thread = scratch_per_thread(&pb);

#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads)
    for (int64_t b = 0; b < pb.batch; b++) {
        for (int64_t h = 0; h < pb.heads; h++) {
            double *scores = scratch + per_thread * omp_get_thread_num();
            double *acc = scores + (per_thread - dv - d), *qd = acc + dv;
            int64_t q0, sq, k0, sk;
            fmha_seq_bounds(&pb, b, &q0, &sq, &k0, &sk);
            /* padded batches index tensor batch b; packed ones token offsets */
            const int64_t tb = pb.varlen ? 0 : b;
            const int64_t hk = h / pb.group; /* the KV head serving this query head */
            for (int64_t i = 0; i < sq; i++) {
                load_q(&pb, kv, b, i, h, qd);
                int64_t lo, hi;
                fmha_visible_range(cfg, i, sq, sk, &lo, &hi);

                double m = -INFINITY;
                for (int64_t j = lo; j < hi; j++) {
                    const char *krow = fmha_kv_row(&pb, &a->k, b, j, hk);
                    double s = 0.0;
                    for (int64_t c = 0; c < d; c++)
                        s += qd[c] * (double)fmha_load_f32(krow, a->k.dtype, c);
                    s *= fmha_row_descale(&pb, 1, b, k0 + j, hk); /* 1 unless FP8 */
                    s *= pb.scale;
                    if (cfg->softcap > 0.0)
                        s = cfg->softcap * tanh(s / cfg->softcap);
                    s += score_bias(a, b, h, i, j, sq, sk);
                    scores[j - lo] = s;
                    if (s > m)
                        m = s;
                }
                /* A sink is one more logit in the softmax, of a key whose value is 0. */
                const double sink = sink_of(a, h);
                if (sink > m && !isnan(m))
                    m = sink;

                for (int64_t c = 0; c < dv; c++)
                    acc[c] = 0.0;
                double l = sink > -INFINITY ? exp(sink - m) : 0.0;
                /* The non-finite policy (docs/reliability.md): a NaN or +inf score
                 * makes the row NaN (exp(NaN), exp(inf - inf)); -inf scores weigh 0,
                 * and a row of nothing else is a row that sees no key. */
                for (int64_t j = lo; j < hi; j++) {
                    const double sj = scores[j - lo];
                    double p = m == -INFINITY && !isnan(sj) ? 0.0 : exp(sj - m);
                    l += p; /* the normaliser counts dropped elements too */
                    if (pb.drop_threshold) {
                        fmha_u32x4 w =
                            fmha_dropout_words(a->seed, a->offset, b * pb.heads + h, i, j);
                        if (w.v[j & 3] < pb.drop_threshold)
                            continue;
                        p *= pb.drop_rescale;
                    }
                    const char *vrow = fmha_kv_row(&pb, &a->v, b, j, hk);
                    p *= fmha_row_descale(&pb, 2, b, k0 + j, hk);
                    for (int64_t c = 0; c < dv; c++)
                        acc[c] += p * (double)fmha_load_f32(vrow, a->v.dtype, c);
                }

                char *orow = fmha_row(&a->out, tb, q0 + i, h);
                for (int64_t c = 0; c < dv; c++)
                    fmha_store_f32(orow, a->out.dtype, c,
                                   l > 0.0 || isnan(l) ? (float)(acc[c] / l) : 0.0f);
                if (a->lse) {
                    int64_t idx =
                        pb.varlen ? h * a->q.seqlen + q0 + i : (b * pb.heads + h) * sq + i;
                    a->lse[idx] = l > 0.0 || isnan(l) ? (float)(m + log(l)) : -INFINITY;
                }
            }
        }
    }
    fmha_free(scratch);
    return FMHA_STATUS_OK;
}

fmha_status fmha_reference_forward(const fmha_config *cfg, const fmha_forward_args *a)
{
    fmha_clear_error();
    fmha_problem pb;
    fmha_status st = fmha_validate_forward(cfg, a, &pb);
    if (st != FMHA_STATUS_OK)
        return st;
    int threads;
    double *scratch = scratch_alloc(cfg, &pb, &threads);
    return scratch ? attention(cfg, &pb, NULL, scratch, threads) : FMHA_STATUS_OUT_OF_MEMORY;
}

/* Value x (a float) as element c of a cache row: rounded to the cache's
 * dtype, or for an FP8 cache the code of x / descale (a float division). */
static void store_cache(char *row, fmha_dtype dtype, int64_t c, float x, float descale)
{
    if (dtype == FMHA_DTYPE_F8_E4M3)
        ((uint8_t *)row)[c] = fmha_f32_to_e4m3(x / descale);
    else
        fmha_store_f32(row, dtype, c, x);
}

/* The new keys and values into the caches: rotated in float64, rounded once
 * to float, then stored as the cache keeps them (store_cache). */
static void append(const fmha_problem *pb, const fmha_kvcache_args *kv)
{
    const int64_t half = kv->rotary_dim / 2;
    const fmha_tensor *kc = &pb->args->k, *vc = &pb->args->v;
    for (int64_t b = 0; b < pb->batch; b++)
        for (int64_t i = 0; i < pb->seqlen_new; i++) {
            const int64_t pos = fmha_cache_keys(pb, b) - pb->seqlen_new + i;
            for (int64_t h = 0; h < pb->kv_heads; h++) {
                const char *kn = fmha_row(&kv->k_new, b, i, h);
                char *kd = fmha_kv_row(pb, kc, b, pos, h);
                const float kds = fmha_row_descale(pb, 1, b, pos, h);
                for (int64_t c = half ? kv->rotary_dim : 0; c < pb->d; c++)
                    store_cache(kd, kc->dtype, c, fmha_load_f32(kn, kv->k_new.dtype, c), kds);
                for (int64_t c = 0; c < half; c++) {
                    int64_t c1, c2;
                    fmha_rotary_pair(kv->rotary_dim, kv->rotary_interleaved, c, &c1, &c2);
                    const double x1 = fmha_load_f32(kn, kv->k_new.dtype, c1);
                    const double x2 = fmha_load_f32(kn, kv->k_new.dtype, c2);
                    const double cs = kv->rotary_cos[pos * half + c];
                    const double sn = kv->rotary_sin[pos * half + c];
                    store_cache(kd, kc->dtype, c1, (float)(x1 * cs - x2 * sn), kds);
                    store_cache(kd, kc->dtype, c2, (float)(x1 * sn + x2 * cs), kds);
                }
                const char *vn = fmha_row(&kv->v_new, b, i, h);
                char *vd = fmha_kv_row(pb, vc, b, pos, h);
                const float vds = fmha_row_descale(pb, 2, b, pos, h);
                for (int64_t c = 0; c < pb->dv; c++)
                    store_cache(vd, vc->dtype, c, fmha_load_f32(vn, kv->v_new.dtype, c), vds);
            }
        }
}

fmha_status fmha_reference_decode(const fmha_config *cfg, const fmha_kvcache_args *kv)
{
    fmha_clear_error();
    fmha_forward_args fwd;
    fmha_problem pb;
    fmha_status st = fmha_validate_config(cfg);
    if (st != FMHA_STATUS_OK || (st = fmha_validate_decode(cfg, kv, &fwd, &pb)) != FMHA_STATUS_OK)
        return st;
    int threads;
    double *scratch = scratch_alloc(cfg, &pb, &threads);
    if (!scratch)
        return FMHA_STATUS_OUT_OF_MEMORY;
    append(&pb, kv);
    return attention(cfg, &pb, kv, scratch, threads);
}

/* Zeroes rows [s0, s1) of every head of batch entry tb of a wanted gradient
 * (data NULL: not wanted). */
static void zero_rows(const fmha_tensor *g, int64_t tb, int64_t s0, int64_t s1)
{
    for (int64_t s = s0; g->data && s < s1; s++)
        for (int64_t h = 0; h < g->heads; h++)
            for (int64_t c = 0; c < g->head_dim; c++)
                fmha_store_f32(fmha_row(g, tb, s, h), g->dtype, c, 0.0f);
}

/* Writes n float64 values as a gradient row (if the gradient is wanted). */
static void store_row(const fmha_tensor *g, int64_t tb, int64_t s, int64_t h, const double *x,
                      int64_t n)
{
    if (!g->data)
        return;
    char *row = fmha_row(g, tb, s, h);
    for (int64_t c = 0; c < n; c++)
        fmha_store_f32(row, g->dtype, c, (float)x[c]);
}

fmha_status fmha_reference_backward(const fmha_config *cfg, const fmha_backward_args *a)
{
    fmha_clear_error();
    fmha_forward_args fwd;
    fmha_problem pb;
    fmha_status st = fmha_validate_backward(cfg, a, &fwd, &pb);
    if (st != FMHA_STATUS_OK)
        return st;

    const int64_t d = pb.d, dv = pb.dv, sk_max = pb.max_sk;
    /* One (sequence, KV head) per thread: it owns the dk and dv rows of its
     * keys and the dq rows of its group's query heads, so nothing is shared.
     * Per thread: a query row's scores s, probabilities p, dropout factors
     * keep and dP over the keys; its dq; dk and dv of every key. */
    const int threads = cfg->num_threads > 0 ? cfg->num_threads : omp_get_max_threads();
    const int64_t per_thread = 4 * sk_max + d + sk_max * (d + dv);
    double *scratch = fmha_malloc(sizeof(double) * (size_t)(per_thread * threads));
    /* d sinks of each (sequence, head), summed over the sequences at the end */
    double *dsink = fmha_calloc((size_t)(pb.batch * pb.heads), sizeof(double));
    if (!scratch || !dsink) {
        fmha_free(scratch);
        fmha_free(dsink);
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory in the reference");
    }

    /* Tokens of a packed batch that belong to no sequence get zero gradients. */
    if (pb.varlen) {
        const int32_t *cq = a->cu_seqlens_q, *ck = a->cu_seqlens_k;
        zero_rows(&a->dq, 0, cq[pb.batch], a->q.seqlen);
        zero_rows(&a->dk, 0, ck[pb.batch], a->k.seqlen);
        zero_rows(&a->dv, 0, ck[pb.batch], a->v.seqlen);
    }

#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads)
    for (int64_t b = 0; b < pb.batch; b++) {
        for (int64_t hk = 0; hk < pb.kv_heads; hk++) {
            double *s = scratch + per_thread * omp_get_thread_num();
            double *p = s + sk_max, *keep = p + sk_max, *dp = keep + sk_max;
            double *dq = dp + sk_max, *dk = dq + d, *dvv = dk + sk_max * d;
            int64_t q0, sq, k0, sk;
            fmha_seq_bounds(&pb, b, &q0, &sq, &k0, &sk);
            const int64_t tb = pb.varlen ? 0 : b;
            for (int64_t e = 0; e < sk * d; e++)
                dk[e] = 0.0;
            for (int64_t e = 0; e < sk * dv; e++)
                dvv[e] = 0.0;
            for (int64_t h = hk * pb.group; h < (hk + 1) * pb.group; h++) {
                for (int64_t i = 0; i < sq; i++) {
                    const char *qrow = fmha_row(&a->q, tb, q0 + i, h);
                    const char *dorow = fmha_row(&a->dout, tb, q0 + i, h);
                    int64_t lo, hi;
                    fmha_visible_range(cfg, i, sq, sk, &lo, &hi);
                    /* The forward's scores and softmax, as fmha_reference_forward. */
                    double m = -INFINITY;
                    for (int64_t j = lo; j < hi; j++) {
                        const char *krow = fmha_row(&a->k, tb, k0 + j, hk);
                        double x = 0.0;
                        for (int64_t c = 0; c < d; c++)
                            x += (double)fmha_load_f32(qrow, a->q.dtype, c) *
                                 (double)fmha_load_f32(krow, a->k.dtype, c);
                        x *= pb.scale;
                        /* s: softcap's output (its derivative below); p: the logit */
                        s[j] = cfg->softcap > 0.0 ? cfg->softcap * tanh(x / cfg->softcap) : x;
                        p[j] = s[j] + score_bias(&fwd, b, h, i, j, sq, sk);
                        if (p[j] > m)
                            m = p[j];
                    }
                    const double sink = sink_of(&fwd, h);
                    if (sink > m && !isnan(m))
                        m = sink;
                    double l = sink > -INFINITY ? exp(sink - m) : 0.0;
                    for (int64_t j = lo; j < hi; j++) {
                        p[j] = m == -INFINITY && !isnan(p[j]) ? 0.0 : exp(p[j] - m);
                        l += p[j];
                    }
                    /* out = sum_j p_j keep_j v_j with keep_j = 0 or 1 / (1 - dropout_p);
                     * dP_j = keep_j (dout . v_j); D = sum_j p_j dP_j = dout . out. */
                    double D = 0.0;
                    for (int64_t j = lo; j < hi; j++) {
                        p[j] = l > 0.0 || isnan(l) ? p[j] / l : 0.0;
                        keep[j] = 1.0;
                        if (pb.drop_threshold) {
                            fmha_u32x4 w =
                                fmha_dropout_words(a->seed, a->offset, b * pb.heads + h, i, j);
                            keep[j] = w.v[j & 3] < pb.drop_threshold ? 0.0 : pb.drop_rescale;
                        }
                        const char *vrow = fmha_row(&a->v, tb, k0 + j, hk);
                        double dov = 0.0;
                        for (int64_t c = 0; c < dv; c++)
                            dov += (double)fmha_load_f32(dorow, a->dout.dtype, c) *
                                   (double)fmha_load_f32(vrow, a->v.dtype, c);
                        dp[j] = keep[j] * dov;
                        D += p[j] * dp[j];
                    }
                    /* d sink = P_sink (dP_sink - D), dP_sink = 0 (its value is 0) */
                    if (a->dsinks && sink > -INFINITY)
                        dsink[b * pb.heads + h] -=
                            (l > 0.0 || isnan(l) ? exp(sink - m) / l : 0.0) * D;
                    for (int64_t c = 0; c < d; c++)
                        dq[c] = 0.0;
                    for (int64_t j = lo; j < hi; j++) {
                        /* dS = P (dP - D); through softcap, ds/dx = 1 - tanh^2. */
                        double ds = p[j] * (dp[j] - D);
                        if (cfg->softcap > 0.0)
                            ds *= 1.0 - (s[j] / cfg->softcap) * (s[j] / cfg->softcap);
                        ds *= pb.scale;
                        const char *krow = fmha_row(&a->k, tb, k0 + j, hk);
                        for (int64_t c = 0; c < d; c++) {
                            dq[c] += ds * (double)fmha_load_f32(krow, a->k.dtype, c);
                            dk[j * d + c] += ds * (double)fmha_load_f32(qrow, a->q.dtype, c);
                        }
                        const double pd = p[j] * keep[j];
                        for (int64_t c = 0; c < dv; c++)
                            dvv[j * dv + c] += pd * (double)fmha_load_f32(dorow, a->dout.dtype, c);
                    }
                    store_row(&a->dq, tb, q0 + i, h, dq, d);
                }
            }
            for (int64_t j = 0; j < sk; j++) {
                store_row(&a->dk, tb, k0 + j, hk, dk + j * d, d);
                store_row(&a->dv, tb, k0 + j, hk, dvv + j * dv, dv);
            }
        }
    }
    for (int64_t h = 0; a->dsinks && h < pb.heads; h++) {
        double sum = 0.0;
        for (int64_t b = 0; b < pb.batch; b++)
            sum += dsink[b * pb.heads + h];
        a->dsinks[h] = (float)sum;
    }
    fmha_free(scratch);
    fmha_free(dsink);
    return FMHA_STATUS_OK;
}
