/* reference.c — the float64 reference every fast path is tested against.
 * Plain loops over (sequence, head, query row), one key row at a time, float64
 * accumulation, every feature. Never fast on purpose: it must stay obvious.
 * FP8 inputs are their codes' values times their descales, exactly. */
#include "alloc.h"
#include "validate.h"

#include <omp.h>
#include <stdlib.h>

fmha_status fmha_reference_forward(const fmha_config *cfg, const fmha_forward_args *a)
{
    fmha_clear_error();
    fmha_problem pb;
    fmha_status st = fmha_validate_forward(cfg, a, &pb);
    if (st != FMHA_STATUS_OK)
        return st;

    const int64_t d = pb.d, dv = pb.dv;
    /* (sequence, head) pairs are independent: one thread each, so that the
     * tests' large cases stay quick; every row's sums run in the same order.
     * Each thread's scratch is allocated before anything is written. */
    const int threads = cfg->num_threads > 0 ? cfg->num_threads : omp_get_max_threads();
    const int64_t per_thread = (pb.max_sk > 0 ? pb.max_sk : 1) + dv;
    double *scratch = fmha_malloc(sizeof(double) * (size_t)(per_thread * threads));
    if (!scratch)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory in the reference");

#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads)
    for (int64_t b = 0; b < pb.batch; b++) {
        for (int64_t h = 0; h < pb.heads; h++) {
            double *scores = scratch + per_thread * omp_get_thread_num();
            double *acc = scores + (per_thread - dv);
            int64_t q0, sq, k0, sk;
            fmha_seq_bounds(&pb, b, &q0, &sq, &k0, &sk);
            /* padded batches index tensor batch b; packed ones token offsets */
            const int64_t tb = pb.varlen ? 0 : b;
            const int64_t hk = h / pb.group; /* the KV head serving this query head */
            for (int64_t i = 0; i < sq; i++) {
                const char *qrow = fmha_row(&a->q, tb, q0 + i, h);
                const double dq = fmha_row_descale(&pb, 0, b, q0 + i, h);
                int64_t lo, hi;
                fmha_visible_range(cfg, i, sq, sk, &lo, &hi);

                double m = -INFINITY;
                for (int64_t j = lo; j < hi; j++) {
                    const char *krow = fmha_row(&a->k, tb, k0 + j, hk);
                    double s = 0.0;
                    for (int64_t c = 0; c < d; c++)
                        s += (double)fmha_load_f32(qrow, a->q.dtype, c) *
                             (double)fmha_load_f32(krow, a->k.dtype, c);
                    s *= dq * fmha_row_descale(&pb, 1, b, k0 + j, hk); /* 1 unless FP8 */
                    s *= pb.scale;
                    if (cfg->softcap > 0.0)
                        s = cfg->softcap * tanh(s / cfg->softcap);
                    scores[j - lo] = s;
                    if (s > m)
                        m = s;
                }

                for (int64_t c = 0; c < dv; c++)
                    acc[c] = 0.0;
                double l = 0.0;
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
                    const char *vrow = fmha_row(&a->v, tb, k0 + j, hk);
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
