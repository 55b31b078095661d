/* semantics.c — the public face of semantics.h: one dropout keep-bit and the
 * FLOP count of a masked forward, both from the same mask and Philox
 * definitions every backend uses. */
#include "fmha.h"
#include "semantics.h"

int fmha_dropout_keep(uint64_t seed, uint64_t offset, int64_t seq, int64_t num_heads, int64_t head,
                      int64_t row, int64_t col, double p)
{
    if (!(p > 0.0))
        return 1;
    fmha_u32x4 w = fmha_dropout_words(seed, offset, seq * num_heads + head, row, col);
    return w.v[col & 3] >= fmha_dropout_threshold(p);
}

double fmha_flops(const fmha_config *cfg, int64_t batch, int64_t seqlen_q, int64_t seqlen_k)
{
    double pairs = 0;
    for (int64_t i = 0; i < seqlen_q; i++) {
        int64_t lo, hi;
        fmha_mask_range(cfg->causal, cfg->window_left, cfg->window_right, i, seqlen_q, seqlen_k,
                        &lo, &hi);
        pairs += (double)(hi - lo);
    }
    return 2.0 * (double)(cfg->head_dim + cfg->head_dim_v) * pairs * (double)cfg->num_heads *
           (double)batch;
}
