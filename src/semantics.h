/* semantics.h — the parts of fmha's semantics that every backend computes
 * the same way, in one definition compiled as C for the CPU and as CUDA C for
 * the GPU: which keys a query sees, and the dropout stream (counter-based
 * Philox4x32-10, so the keep mask of element (sequence, head, row, column) is
 * the same wherever it is drawn). */
#ifndef FMHA_SEMANTICS_H
#define FMHA_SEMANTICS_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define FMHA_HD __host__ __device__ __forceinline__
#else
#define FMHA_HD static inline
#endif

/* Keys visible to query row i of a sequence with sq queries and sk keys form
 * one interval [lo, hi) of [0, sk): causal and windows are aligned to the
 * bottom-right (flash-attn semantics), -1 = unlimited, causal is right = 0. */
FMHA_HD void fmha_mask_range(int causal, int64_t window_left, int64_t window_right, int64_t i,
                             int64_t sq, int64_t sk, int64_t *lo, int64_t *hi)
{
    /* Windows may be as large as int64 allows, so each bound is compared
     * before it is formed: diag + right + 1 and diag - left are computed only
     * where they land inside [0, sk), and diag itself within [sk - sq, sk). */
    int64_t diag = sk - (sq - i);
    int64_t l = 0, h = sk;
    int64_t right = causal ? 0 : window_right;
    if (right >= 0 && right < sk - 1 - diag) /* i.e. diag + right + 1 < sk */
        h = diag + right + 1;
    if (window_left >= 0 && window_left < diag) /* i.e. diag - window_left > 0 */
        l = diag - window_left;
    if (h < l)
        h = l;
    *lo = l;
    *hi = h;
}

typedef struct fmha_u32x4 {
    uint32_t v[4];
} fmha_u32x4;

FMHA_HD fmha_u32x4 fmha_philox4x32_10(fmha_u32x4 ctr, uint32_t key0, uint32_t key1)
{
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * ctr.v[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * ctr.v[2];
        fmha_u32x4 n;
        n.v[0] = (uint32_t)(p1 >> 32) ^ ctr.v[1] ^ key0;
        n.v[1] = (uint32_t)p1;
        n.v[2] = (uint32_t)(p0 >> 32) ^ ctr.v[3] ^ key1;
        n.v[3] = (uint32_t)p0;
        ctr = n;
        key0 += 0x9E3779B9u;
        key1 += 0xBB67AE85u;
    }
    return ctr;
}

/* The four dropout words for columns [4*(col/4), 4*(col/4)+4) of one row;
 * word col % 4 keeps its element iff it is >= fmha_dropout_threshold(p). */
FMHA_HD fmha_u32x4 fmha_dropout_words(uint64_t seed, uint64_t offset, int64_t seq_head, int64_t row,
                                      int64_t col)
{
    fmha_u32x4 ctr = {{(uint32_t)(col >> 2), (uint32_t)row, (uint32_t)seq_head, (uint32_t)offset}};
    return fmha_philox4x32_10(ctr, (uint32_t)seed,
                              (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32));
}

/* floor(p * 2^32) for p in [0, 1). */
FMHA_HD uint32_t fmha_dropout_threshold(double p)
{
    double t = floor(p * 4294967296.0);
    return t >= 4294967295.0 ? 0xffffffffu : (uint32_t)t;
}

/* Rotary embedding (fmha_kvcache_args): the channels (c1, c2) rotated as
 * pair c < rotary_dim / 2 (interleaved: GPT-J's pairs, else GPT-NeoX's). */
FMHA_HD void fmha_rotary_pair(int64_t rotary_dim, int interleaved, int64_t c, int64_t *c1,
                              int64_t *c2)
{
    *c1 = interleaved ? 2 * c : c;
    *c2 = interleaved ? 2 * c + 1 : c + rotary_dim / 2;
}

/* The rotary position of new query i of a sequence whose cache held
 * `cached` keys: each query its own where the layer is causal or windowed
 * (`per_query`), else all at `cached`, as FlashAttention places them. */
FMHA_HD int64_t fmha_rotary_position(int per_query, int64_t cached, int64_t i)
{
    return per_query ? cached + i : cached;
}

#endif /* FMHA_SEMANTICS_H */
