/* internal.h — what every part of the library shares: the validated problem
 * description handed to backends, row addressing, element conversions, and
 * (through semantics.h) the masks and the Philox dropout stream. Types and
 * inline functions only. */
#ifndef FMHA_INTERNAL_H
#define FMHA_INTERNAL_H

#include "error.h"
#include "fmha.h"
#include "semantics.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* A forward or backward call after validation: every number checked, every
 * default resolved. Backends receive only this. */
typedef struct fmha_problem {
    const fmha_config *cfg;
    const fmha_forward_args *args;  /* a backward's: its q, k, v, out, lse, lengths and seed */
    const fmha_backward_args *bwd;  /* a backward's own arguments; NULL for a forward */
    int64_t batch;                  /* sequences (padded batch or varlen_batch) */
    int64_t heads, kv_heads, group; /* group = heads / kv_heads */
    int64_t d, dv;                  /* head dims */
    int64_t max_sq, max_sk;         /* longest sequences */
    int varlen;
    double scale;            /* resolved softmax scale */
    uint32_t drop_threshold; /* keep iff philox word >= threshold; 0 = no dropout */
    double drop_rescale;     /* 1 / (1 - p) */

    /* A decode call (fmha_layer_decode): k and v are KV caches, read
     * through these; a forward call leaves them 0 / NULL. */
    int kv_cache;
    const int32_t *cache_seqlens; /* [batch] keys cached before the call; NULL: capacity */
    int64_t capacity;             /* keys a sequence's cache holds */
    int64_t seqlen_new;           /* keys the call appended after the cached ones */
    const int32_t *kv_batch;      /* contiguous caches: [batch] the cache row of each sequence */
    const int32_t *page_table;    /* paged caches: [batch][page_stride] */
    int64_t page_stride, page_size;
    fmha_kv_descale_layout kv_descale_layout; /* FP8 caches' descales (args.descale_k/v) */
    /* The index arrays are read by the kernels alone: a device decode given
     * max_seqlen_k, a device packed forward given both bounds (validate.h) */
    int device_checked;
    int64_t num_splits; /* key splits asked for (0: the backend chooses) */
    /* The call's own arguments, whose arrays (cache_seqlens, cache_batch_idx,
     * block_table, rotary tables) live in the backend's memory; the
     * pointers above are host copies of them where the device is not the
     * host (fmha_backend.host_kvcache), valid during the call. */
    const fmha_kvcache_args *kv;

    /* Where this call's rows, keys and heads sit in a larger problem that it
     * is a piece of (sequence parallelism, src/sp/): the dropout stream is
     * drawn at (seq * pos_heads + pos_head0 + head, pos_row0 + row, pos_col0 +
     * key), so that every piece draws the single-device mask. Validation sets
     * the identity: 0, 0, 0 and heads. */
    int64_t pos_row0, pos_col0, pos_head0, pos_heads;

    /* fp8_compute = int8_qk (layer_fp8.c): q's INT8 scales, one per query
     * row and head, in the LSE's layout; NULL otherwise. */
    const float *q_row_scale;
} fmha_problem;

/* Keys of sequence b in a decode call: cached plus appended. */
static inline int64_t fmha_cache_keys(const fmha_problem *pb, int64_t b)
{
    return (pb->cache_seqlens ? pb->cache_seqlens[b] : pb->capacity) + pb->seqlen_new;
}

/* Per-sequence geometry: where sequence b starts and how long it is. */
static inline void fmha_seq_bounds(const fmha_problem *pb, int64_t b, int64_t *q0, int64_t *sq,
                                   int64_t *k0, int64_t *sk)
{
    if (pb->varlen) {
        *q0 = pb->args->cu_seqlens_q[b];
        *sq = pb->args->cu_seqlens_q[b + 1] - *q0;
        *k0 = pb->args->cu_seqlens_k[b];
        *sk = pb->args->cu_seqlens_k[b + 1] - *k0;
    } else {
        *q0 = 0;
        *sq = pb->args->q.seqlen;
        *k0 = 0;
        *sk = pb->kv_cache ? fmha_cache_keys(pb, b) : pb->args->k.seqlen;
    }
}

/* Whether a call has score modifiers (fmha_forward_args: mask, ALiBi, sinks). */
static inline int fmha_has_score_mods(const fmha_forward_args *a)
{
    return a->mask.data || a->alibi_slopes || a->sinks;
}

/* The dtype of an additive mask's values (FMHA_MASK_ADD_*). */
static inline fmha_dtype fmha_mask_dtype(fmha_mask_type t)
{
    return t == FMHA_MASK_ADD_F16    ? FMHA_DTYPE_F16
           : t == FMHA_MASK_ADD_BF16 ? FMHA_DTYPE_BF16
                                     : FMHA_DTYPE_F32;
}

/* Keys visible to query row i: one interval [lo, hi) (semantics.h). */
static inline void fmha_visible_range(const fmha_config *cfg, int64_t i, int64_t sq, int64_t sk,
                                      int64_t *lo, int64_t *hi)
{
    fmha_mask_range(cfg->causal, cfg->window_left, cfg->window_right, i, sq, sk, lo, hi);
}

/* The descale of one row of q (which = 0), k (1) or v (2): sequence b,
 * token s of the tensor (packed position for packed batches), head h (a
 * query head for q, a KV head for k and v). 1 for inputs without descales.
 * The layouts are fmha_descale_layout's. */
static inline float fmha_row_descale(const fmha_problem *pb, int which, int64_t b, int64_t s,
                                     int64_t h)
{
    const fmha_forward_args *a = pb->args;
    const float *d = which == 0 ? a->descale_q : which == 1 ? a->descale_k : a->descale_v;
    if (!d)
        return 1.0f;
    if (pb->kv_cache) /* an FP8 cache's (fmha_kv_descale_layout); s is the key's index */
        switch (pb->kv_descale_layout) {
        case FMHA_KV_DESCALE_PER_HEAD: return d[h];
        case FMHA_KV_DESCALE_PER_PAGE: {
            const int64_t row = pb->page_table
                                    ? pb->page_table[b * pb->page_stride + s / pb->page_size]
                                : pb->kv_batch ? pb->kv_batch[b]
                                               : b;
            return d[row * pb->kv_heads + h];
        }
        default: return d[0];
        }
    switch (a->descale_layout) {
    case FMHA_DESCALE_PER_KV_HEAD: return d[b * pb->kv_heads + (which == 0 ? h / pb->group : h)];
    case FMHA_DESCALE_PER_BLOCK: {
        const fmha_tensor *t = which == 0 ? &a->q : &a->k;
        const int64_t heads = which == 0 ? pb->heads : pb->kv_heads;
        const int64_t r = a->descale_block_rows, nblk = (t->seqlen + r - 1) / r;
        return d[((pb->varlen ? 0 : b) * heads + h) * nblk + s / r];
    }
    default: return d[0];
    }
}

/* Offset of element (b, s, h, 0) of a tensor, in elements. */
static inline int64_t fmha_tensor_offset(const fmha_tensor *t, int64_t b, int64_t s, int64_t h)
{
    return b * t->stride_batch + s * t->stride_seq + h * t->stride_head;
}

/* Address of row (b, s, h) of a validated tensor (inline: backends call it
 * for every row they touch). */
static inline char *fmha_row(const fmha_tensor *t, int64_t b, int64_t s, int64_t h)
{
    const int64_t bytes = t->dtype == FMHA_DTYPE_F32 ? 4 : t->dtype == FMHA_DTYPE_F8_E4M3 ? 1 : 2;
    return (char *)t->data + fmha_tensor_offset(t, b, s, h) * bytes;
}

/* Address of key (or value) j of sequence b, KV head h, in `t` (the
 * problem's k or v): through the page table or the cache rows of a decode
 * call, else at the sequence's own tokens. */
static inline char *fmha_kv_row(const fmha_problem *pb, const fmha_tensor *t, int64_t b, int64_t j,
                                int64_t h)
{
    if (pb->page_table) {
        const int64_t page = pb->page_table[b * pb->page_stride + j / pb->page_size];
        return fmha_row(t, page, j % pb->page_size, h);
    }
    if (pb->varlen)
        return fmha_row(t, 0, pb->args->cu_seqlens_k[b] + j, h);
    return fmha_row(t, pb->kv_batch ? pb->kv_batch[b] : b, j, h);
}

/* fmha_kv_row of keys [j0, j0 + n) into rows[0 .. n): one division for a
 * paged cache's first page, then page by page. */
static inline void fmha_kv_rows(const fmha_problem *pb, const fmha_tensor *t, int64_t b, int64_t j0,
                                int n, int64_t h, const char **rows)
{
    if (n <= 0)
        return;
    if (!pb->page_table) { /* the rows of a sequence are stride_seq apart */
        const char *r = fmha_kv_row(pb, t, b, j0, h);
        const int64_t step = (int64_t)(fmha_row(t, 0, 1, 0) - fmha_row(t, 0, 0, 0));
        for (int j = 0; j < n; j++)
            rows[j] = r + j * step;
        return;
    }
    const int32_t *pages = pb->page_table + b * pb->page_stride;
    int64_t pi = j0 / pb->page_size, in = j0 - pi * pb->page_size;
    for (int j = 0; j < n; j++, in++) {
        if (in == pb->page_size) {
            pi++;
            in = 0;
        }
        rows[j] = fmha_row(t, pages[pi], in, h);
    }
}

/* Whether a decode call's new queries rotate at positions of their own
 * (the layer's masks), and the position of new query i of a sequence whose
 * cache held `cached` keys (semantics.h's fmha_rotary_position). */
static inline int fmha_rotary_per_query(const fmha_config *cfg)
{
    return cfg->causal || cfg->window_left >= 0 || cfg->window_right >= 0;
}

static inline int64_t fmha_rotary_q_pos(const fmha_config *cfg, int64_t cached, int64_t i)
{
    return fmha_rotary_position(fmha_rotary_per_query(cfg), cached, i);
}

/* ---------------------------------------------------------- conversions */

static inline float fmha_bits_to_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t fmha_f32_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float fmha_bf16_to_f32_inline(uint16_t x)
{
    return fmha_bits_to_f32((uint32_t)x << 16);
}

static inline uint16_t fmha_f32_to_bf16_inline(float f)
{
    uint32_t u = fmha_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet, keep the sign */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* FP8 E4M3 decoding (fmha_e4m3_to_f32), inline for the reference's loops. */
static inline float fmha_e4m3_to_f32_inline(uint8_t x)
{
    uint32_t sign = (uint32_t)(x & 0x80u) << 24;
    uint32_t e = (x >> 3) & 0xfu, m = x & 7u;
    if ((x & 0x7fu) == 0x7fu)
        return fmha_bits_to_f32(sign | 0x7fc00000u);
    if (e == 0) { /* zero or subnormal: exact as a float */
        float f = (float)m * 0x1p-9f;
        return sign ? -f : f;
    }
    return fmha_bits_to_f32(sign | ((e + 120u) << 23) | (m << 20));
}

static inline float fmha_f16_to_f32_inline(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) /* inf / NaN */
        return fmha_bits_to_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) { /* zero or subnormal: exact as a float */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    return fmha_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t fmha_f32_to_f16_inline(float f)
{
    uint32_t u = fmha_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return sign | 0x7e00u;
    if (a >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return sign | 0x7c00u;
    if (a < 0x38800000u) { /* below 2^-14: subnormal or zero, rounded by the FPU */
        float mag = fmha_bits_to_f32(a);
        return sign | (uint16_t)lrintf(mag * 0x1p24f);
    }
    uint32_t r = a + 0x0fffu + ((a >> 13) & 1u); /* round to nearest even */
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

/* Loads element `i` of a row of `dtype` as float. */
static inline float fmha_load_f32(const void *row, fmha_dtype dtype, int64_t i)
{
    switch (dtype) {
    case FMHA_DTYPE_F32: return ((const float *)row)[i];
    case FMHA_DTYPE_BF16: return fmha_bf16_to_f32_inline(((const uint16_t *)row)[i]);
    case FMHA_DTYPE_F16: return fmha_f16_to_f32_inline(((const uint16_t *)row)[i]);
    case FMHA_DTYPE_F8_E4M3: /* the code's value, not descaled */
        return fmha_e4m3_to_f32_inline(((const uint8_t *)row)[i]);
    default: return 0.0f;
    }
}

static inline void fmha_store_f32(void *row, fmha_dtype dtype, int64_t i, float x)
{
    switch (dtype) {
    case FMHA_DTYPE_F32: ((float *)row)[i] = x; break;
    case FMHA_DTYPE_BF16: ((uint16_t *)row)[i] = fmha_f32_to_bf16_inline(x); break;
    case FMHA_DTYPE_F16: ((uint16_t *)row)[i] = fmha_f32_to_f16_inline(x); break;
    default: break;
    }
}

#endif /* FMHA_INTERNAL_H */
