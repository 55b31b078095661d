/* tokens.h — which tokens of a sequence-parallel problem each rank holds,
 * and the validated problem (validate.c fills it, sp.c runs it). Types and
 * inline arithmetic only, shared by the two. */
#ifndef FMHA_SP_TOKENS_H
#define FMHA_SP_TOKENS_H

#include "fmha.h"

/* Up to two runs of consecutive tokens, in the order a rank holds them:
 * token i of run k is sequence position start[k] + i. */
typedef struct fmha_sp_tokmap {
    int n;
    int64_t start[2], len[2];
    int64_t total;
} fmha_sp_tokmap;

/* The cut of n things into k parts: part j begins at n * j / k. */
static inline int64_t fmha_sp_cut(int64_t n, int64_t k, int64_t j)
{
    return n * j / k;
}

static inline void fmha_sp_tokmap_add(fmha_sp_tokmap *t, int64_t start, int64_t len)
{
    if (len <= 0)
        return;
    if (t->n > 0 && t->start[t->n - 1] + t->len[t->n - 1] == start) {
        t->len[t->n - 1] += len; /* adjacent runs are one */
    } else {
        t->start[t->n] = start;
        t->len[t->n] = len;
        t->n++;
    }
    t->total += len;
}

/* Ring slot `slot` of `ring`'s tokens of a sequence of s tokens. */
static inline fmha_sp_tokmap fmha_sp_slot_tokens(int64_t s, int ring, fmha_sp_layout layout,
                                                 int slot)
{
    fmha_sp_tokmap t = {0, {0, 0}, {0, 0}, 0};
    if (layout == FMHA_SP_LAYOUT_ZIGZAG) {
        const int64_t chunks = 2 * (int64_t)ring, a = slot, b = chunks - 1 - slot;
        fmha_sp_tokmap_add(&t, fmha_sp_cut(s, chunks, a),
                           fmha_sp_cut(s, chunks, a + 1) - fmha_sp_cut(s, chunks, a));
        fmha_sp_tokmap_add(&t, fmha_sp_cut(s, chunks, b),
                           fmha_sp_cut(s, chunks, b + 1) - fmha_sp_cut(s, chunks, b));
    } else {
        fmha_sp_tokmap_add(&t, fmha_sp_cut(s, ring, slot),
                           fmha_sp_cut(s, ring, slot + 1) - fmha_sp_cut(s, ring, slot));
    }
    return t;
}

/* Positions [p0, p1) of t's tokens, in t's order. */
static inline fmha_sp_tokmap fmha_sp_tokmap_range(const fmha_sp_tokmap *t, int64_t p0, int64_t p1)
{
    fmha_sp_tokmap r = {0, {0, 0}, {0, 0}, 0};
    int64_t at = 0;
    for (int k = 0; k < t->n; k++) {
        const int64_t lo = p0 > at ? p0 : at;
        const int64_t hi = p1 < at + t->len[k] ? p1 : at + t->len[k];
        if (hi > lo)
            fmha_sp_tokmap_add(&r, t->start[k] + (lo - at), hi - lo);
        at += t->len[k];
    }
    return r;
}

/* The offset of Ulysses member j's tokens among its slot's L tokens. */
static inline int64_t fmha_sp_member_offset(int64_t slot_len, int ulysses, int j)
{
    return fmha_sp_cut(slot_len, ulysses, j);
}

/* Rank `rank`'s tokens: ring slot rank / u, member rank % u. */
static inline fmha_sp_tokmap fmha_sp_rank_tokens(const fmha_sp_config *sp, int64_t s, int rank)
{
    const int slot = rank / sp->ulysses, j = rank % sp->ulysses;
    const fmha_sp_tokmap t = fmha_sp_slot_tokens(s, sp->ring, sp->layout, slot);
    return fmha_sp_tokmap_range(&t, fmha_sp_member_offset(t.total, sp->ulysses, j),
                                fmha_sp_member_offset(t.total, sp->ulysses, j + 1));
}

/* Of a sequence of s tokens, Ulysses member j's tokens of ring slot `slot`:
 * how many. (fmha_sp_rank_tokens(...).total, for any rank of that slot and
 * member.) */
static inline int64_t fmha_sp_member_count(const fmha_sp_config *sp, int64_t s, int slot, int j)
{
    const int64_t l = fmha_sp_slot_tokens(s, sp->ring, sp->layout, slot).total;
    return fmha_sp_member_offset(l, sp->ulysses, j + 1) - fmha_sp_member_offset(l, sp->ulysses, j);
}

/* How many tokens Ulysses member j of ring slot `slot` holds: of a sequence
 * of s tokens (nseq 0), or of the nseq packed sequences at offsets cu. */
static inline int64_t fmha_sp_member_tokens(const fmha_sp_config *sp, int64_t s, const int32_t *cu,
                                            int64_t nseq, int slot, int j)
{
    if (nseq == 0)
        return fmha_sp_member_count(sp, s, slot, j);
    int64_t n = 0;
    for (int64_t b = 0; b < nseq; b++)
        n += fmha_sp_member_count(sp, cu[b + 1] - cu[b], slot, j);
    return n;
}

/* A validated sequence-parallel call, as this rank runs it. */
typedef struct fmha_sp_problem {
    int u, r;                /* degrees */
    int slot, member;        /* this rank: ring slot, Ulysses member */
    int64_t batch;           /* B */
    int64_t heads, kv_heads; /* H, KV of the whole problem */
    int64_t lheads, lkv;     /* per rank after the all-to-all: H / u, and KV / u or 1 */
    int64_t d, dv;           /* head dims */
    int64_t seqlen, text;    /* S distributed tokens, T joint tokens (0: none) */
    int64_t img0, text0;     /* sequence position of distributed token 0 and text token 0 */
    int64_t local;           /* this rank's tokens */
    /* Packed sequences (nseq > 0): the whole sequences' offsets, nseq + 1
     * (the caller's host array). The buffers then have batch 1 and hold the
     * tokens sequence by sequence; see sp.c's runs. */
    const int32_t *cu;
    int64_t nseq;
} fmha_sp_problem;

/* The first KV head that Ulysses member j's query heads read (it takes
 * pb->lkv of them): KV / u per member where u divides KV, else the one head
 * its query heads share. */
static inline int64_t fmha_sp_kv_head0(const fmha_sp_problem *pb, int j)
{
    if (pb->kv_heads % pb->u == 0)
        return j * pb->lkv;
    return j * pb->lheads / (pb->heads / pb->kv_heads);
}

#endif /* FMHA_SP_TOKENS_H */
