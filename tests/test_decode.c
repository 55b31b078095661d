/* test_decode.c — decode calls against KV caches (fmha_decode) on every CPU
 * kernel the machine runs, against the float64 reference
 * (fmha_reference_decode) over random cases of awkward sizes: contiguous
 * caches (with and without cache_batch_idx) and paged ones (page sizes 1 to
 * 64, pages shuffled, last pages partly filled), new tokens appended with
 * and without rotary embedding (both pairings), causal, windows, softcap,
 * GQA and MQA, LSE, f32/f16/bf16. Outputs are poisoned first; the tolerance
 * is 4x the error of a naive same-precision attention over the same keys
 * gathered into a packed batch. Then: decode equals fmha_forward bit for bit
 * where the problems are the same, paged equals contiguous, num_splits does
 * not change the answer beyond rounding, and every bad argument is refused
 * with the cache and out untouched.
 *
 * Built with FMHA_TEST_CUDA (test_cuda_decode), the same cases run on a
 * CUDA layer (f16 and bf16; head dims to 256, longer caches), every array
 * copied to the GPU and the caches, out and lse copied back; exits 77
 * (skipped) where there is no CUDA device. */
#include "alloc.h"
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef FMHA_TEST_CUDA
#include <cuda_runtime_api.h>

static cudaStream_t stream;

/* Bytes from t.data to the end of its last element (0 when empty). */
static size_t span(const fmha_tensor *t)
{
    if (!t->data || t->batch <= 0 || t->seqlen <= 0 || t->heads <= 0 || t->head_dim <= 0)
        return 0;
    const int64_t last = (t->batch - 1) * t->stride_batch + (t->seqlen - 1) * t->stride_seq +
                         (t->heads - 1) * t->stride_head + t->head_dim;
    return (size_t)last * fmha_dtype_size(t->dtype);
}

/* A device copy of n bytes at h (NULL where h is NULL or n is 0). */
static void *upload(const void *h, size_t n)
{
    void *d = NULL;
    if (!h || n == 0)
        return NULL;
    if (cudaMalloc(&d, n) != cudaSuccess || cudaMemcpy(d, h, n, cudaMemcpyHostToDevice)) {
        fprintf(stderr, "upload of %zu bytes failed\n", n);
        exit(1);
    }
    return d;
}

static void download(void *h, const void *d, size_t n)
{
    if (d && n && cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost) != cudaSuccess) {
        fprintf(stderr, "download of %zu bytes failed\n", n);
        exit(1);
    }
}

/* fmha_decode on a CUDA layer: every tensor and array of the call copied to
 * the GPU (out poisoned as it is), the call run there on a stream of its
 * own, then the caches, out and lse copied back whatever it returned. The
 * sizes copied are the ones the arguments imply. */
static fmha_status run_decode(const fmha_config *cfg, const fmha_kvcache_args *h)
{
    fmha_config c = *cfg;
    c.device = FMHA_DEVICE_CUDA;
    c.cpu_isa = FMHA_CPU_ISA_AUTO;
    fmha_kvcache_args d = *h;
    d.stream = stream;
    fmha_tensor *ts[6] = {&d.q, &d.k_cache, &d.v_cache, &d.k_new, &d.v_new, &d.out};
    for (int i = 0; i < 6; i++)
        ts[i]->data = upload(ts[i]->data, span(ts[i]));
    const int64_t B = h->q.batch > 0 ? h->q.batch : 0;
    const int64_t nl =
        B * (h->q.seqlen > 0 ? h->q.seqlen : 0) * (h->out.heads > 0 ? h->out.heads : 0);
    const int64_t half = h->rotary_dim > 0 ? h->rotary_dim / 2 : 0;
    const int64_t rl = h->rotary_len > 0 ? h->rotary_len : 0;
    d.lse = upload(h->lse, sizeof(float) * (size_t)nl);
    d.cache_seqlens = upload(h->cache_seqlens, sizeof(int32_t) * (size_t)B);
    d.cache_batch_idx = upload(h->cache_batch_idx, sizeof(int32_t) * (size_t)B);
    d.block_table =
        upload(h->block_table, sizeof(int32_t) * (size_t)B *
                                   (size_t)(h->block_table_stride > 0 ? h->block_table_stride : 0));
    d.rotary_cos = upload(h->rotary_cos, sizeof(float) * (size_t)(rl * half));
    d.rotary_sin = upload(h->rotary_sin, sizeof(float) * (size_t)(rl * half));
    const int64_t nd = h->kv_descale_layout == FMHA_KV_DESCALE_PER_HEAD ? h->k_cache.heads
                       : h->kv_descale_layout == FMHA_KV_DESCALE_PER_PAGE
                           ? h->k_cache.batch * h->k_cache.heads
                           : 1;
    d.k_descale = upload(h->k_descale, sizeof(float) * (size_t)(nd > 0 ? nd : 1));
    d.v_descale = upload(h->v_descale, sizeof(float) * (size_t)(nd > 0 ? nd : 1));
    const int64_t H = h->q.heads > 0 ? h->q.heads : 0;
    const int64_t nslopes =
        h->alibi_stride_batch > 0 && B > 0 ? (B - 1) * h->alibi_stride_batch + H : H;
    d.alibi_slopes = upload(h->alibi_slopes, sizeof(float) * (size_t)nslopes);
    d.sinks = upload(h->sinks, sizeof(float) * (size_t)H);
    fmha_status st = fmha_decode(&c, &d);
    cudaError_t e = cudaStreamSynchronize(stream);
    TU_CHECK(e == cudaSuccess, "decode kernels failed: %s", cudaGetErrorString(e));
    download(h->k_cache.data, d.k_cache.data, span(&h->k_cache));
    download(h->v_cache.data, d.v_cache.data, span(&h->v_cache));
    download(h->out.data, d.out.data, span(&h->out));
    download(h->lse, d.lse, sizeof(float) * (size_t)nl);
    for (int i = 0; i < 6; i++)
        cudaFree(ts[i]->data);
    const void *arrays[10] = {d.lse,          d.cache_seqlens, d.cache_batch_idx, d.block_table,
                              d.rotary_cos,   d.rotary_sin,    d.k_descale,       d.v_descale,
                              d.alibi_slopes, d.sinks};
    for (int i = 0; i < 10; i++)
        cudaFree((void *)arrays[i]);
    return st;
}
#define DECODE_DTYPE FMHA_DTYPE_BF16 /* the fixed tests' dtype: CUDA reads 16-bit caches */
#else
#define run_decode   fmha_decode
#define DECODE_DTYPE FMHA_DTYPE_F32
#endif

typedef struct dcase {
    fmha_config cfg;
    int64_t batch, sq, snew, heads, kvh, d, dv;
    int paged;
    int64_t page_size, num_pages, stride; /* paged */
    int64_t cache_rows, capacity;         /* contiguous */
    int use_batch_idx;
    int64_t rotary_dim, rotary_len;
    int interleaved, lse;
    int64_t splits;
    fmha_dtype odt;
    int f8; /* FP8 caches, with descales laid out as kvl says */
    fmha_kv_descale_layout kvl;
    int bound; /* pass max_seqlen_k (on CUDA: the arrays checked there) */
    int64_t max_keys;
    int alibi, sinks; /* ALiBi slopes (1 per head, 2 per sequence and head), sinks */
} dcase;

/* The inputs of one case, the caches twice (reference, fast path). */
typedef struct dinputs {
    tu_tensor q, knew, vnew, kc[2], vc[2], out[2];
    int32_t *cache_seqlens, *batch_idx, *table;
    float *cos, *sin, *lse[2];
    float *kd, *vd;        /* FP8 caches' descales */
    float *slopes, *sinks; /* dcase.alibi, dcase.sinks */
} dinputs;

static int64_t pick(tu_rng *r, const int64_t *v, int n)
{
    return v[tu_range(r, n)];
}

static dcase random_case(tu_rng *r, fmha_cpu_isa isa)
{
#ifdef FMHA_TEST_CUDA
    static const fmha_dtype dts[3] = {FMHA_DTYPE_BF16, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    /* every compiled head dim, and dims the chunked loads cannot take (36, 50) */
    static const int64_t dims[10] = {40, 64, 72, 128, 96, 36, 50, 256, 192, 80};
    const int ndims = 10;
#else
    static const fmha_dtype dts[3] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    /* 36 and 50: a last part of a vector for the row products */
    static const int64_t dims[7] = {40, 64, 72, 128, 96, 36, 50};
    const int ndims = 7;
#endif
    static const int64_t groups[4] = {1, 3, 4, 8};
    static const int64_t sqs[5] = {1, 1, 1, 2, 5};
    static const int64_t pages[6] = {1, 3, 16, 64, 7, 32};
    dcase c;
    memset(&c, 0, sizeof c);
    c.kvh = 1 + tu_range(r, 3);
    c.heads = c.kvh * pick(r, groups, 4);
    c.d = pick(r, dims, ndims);
    c.dv = tu_range(r, 4) == 0 ? 48 : tu_range(r, 4) == 0 ? 33 : c.d;
    fmha_config_init(&c.cfg, c.heads, c.kvh, c.d);
    c.cfg.head_dim_v = c.dv;
    c.cfg.dtype = dts[tu_range(r, 3)];
    c.cfg.cpu_isa = isa;
    c.cfg.causal = tu_range(r, 2);
    if (tu_range(r, 4) == 0)
        c.cfg.window_left = tu_range(r, 80);
    if (tu_range(r, 5) == 0)
        c.cfg.softcap = 5.0;
    c.odt = tu_range(r, 2) ? c.cfg.dtype : FMHA_DTYPE_F32;
    c.batch = 1 + tu_range(r, 4);
    c.sq = pick(r, sqs, 5);
    c.snew = tu_range(r, 3) == 0 ? 0 : c.sq;
    c.paged = tu_range(r, 2);
    c.lse = tu_range(r, 2);
    c.splits = tu_range(r, 3) == 0 ? 1 + tu_range(r, 5) : 0;
    if (c.snew > 0 && tu_range(r, 2)) {
        c.rotary_dim = tu_range(r, 2) ? c.d : (c.d / 2) & ~1;
        c.interleaved = tu_range(r, 2);
    }
    c.page_size = pick(r, pages, 6);
    c.f8 = tu_range(r, 3) == 0;
    c.kvl = (fmha_kv_descale_layout)tu_range(r, 3);
    c.bound = tu_range(r, 3) == 0;
    if (tu_range(r, 4) == 0) {
        c.alibi = (int)tu_range(r, 3);
        c.sinks = c.alibi == 0 ? 1 : (int)tu_range(r, 2);
    }
    return c;
}

/* The case's ALiBi slopes (in [-0.1, 0.5); per sequence: heads + 1 apart)
 * and sinks (N(0, 2), the last head's -inf one time in three). */
static void draw_mods(const dcase *c, dinputs *in, tu_rng *r)
{
    const int64_t n = c->alibi == 2 ? c->batch * (c->heads + 1) : c->heads;
    in->slopes = c->alibi ? malloc(sizeof(float) * (size_t)n) : NULL;
    for (int64_t e = 0; c->alibi && e < n; e++)
        in->slopes[e] = (float)(0.6 * tu_uniform(r) - 0.1);
    in->sinks = c->sinks ? malloc(sizeof(float) * (size_t)c->heads) : NULL;
    for (int64_t h = 0; c->sinks && h < c->heads; h++)
        in->sinks[h] = (float)(2.0 * tu_normal(r));
    if (c->sinks && tu_range(r, 3) == 0)
        in->sinks[c->heads - 1] = -INFINITY;
}

/* The descale of cache row (or page) `row`, KV head h, in an array laid out
 * as c->kvl says. */
static float descale_at(const dcase *c, const float *d, int64_t row, int64_t h)
{
    return c->kvl == FMHA_KV_DESCALE_PER_TENSOR ? d[0]
           : c->kvl == FMHA_KV_DESCALE_PER_HEAD ? d[h]
                                                : d[row * c->kvh + h];
}

/* An FP8 cache of normal values: each element the code of x / its descale. */
static void fill_f8(const dcase *c, tu_tensor *x, const float *d, tu_rng *r)
{
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++) {
                uint8_t *row = (uint8_t *)t->data + b * t->stride_batch + s * t->stride_seq +
                               h * t->stride_head;
                for (int64_t e = 0; e < t->head_dim; e++)
                    row[e] = fmha_f32_to_e4m3((float)tu_normal(r) / descale_at(c, d, b, h));
            }
}

/* Cache lengths, then the caches' geometry: capacity for the longest plus
 * slack; pages handed out in a shuffled order. */
static void make_inputs(dcase *c, dinputs *in, tu_rng *r)
{
    memset(in, 0, sizeof *in);
    in->cache_seqlens = malloc(sizeof(int32_t) * (size_t)c->batch);
    int64_t longest = 0;
    for (int64_t b = 0; b < c->batch; b++) {
        in->cache_seqlens[b] = (int32_t)(tu_range(r, 5) == 0 ? 0 : tu_range(r, 400));
#ifdef FMHA_TEST_CUDA
        if (tu_range(r, 5) == 0) /* many tiles, and splits */
            in->cache_seqlens[b] = (int32_t)(1000 + tu_range(r, 3000));
#endif
        if (in->cache_seqlens[b] + c->snew > longest)
            longest = in->cache_seqlens[b] + c->snew;
    }
    if (longest == 0) /* keep one key somewhere: caches have at least one row */
        longest = 1;
    c->max_keys = longest; /* raised below by a little slack within the capacity */
    const fmha_dtype dt = c->cfg.dtype, cdt = c->f8 ? FMHA_DTYPE_F8_E4M3 : dt;
    if (c->paged) {
        c->stride = (longest + c->page_size - 1) / c->page_size + tu_range(r, 3);
        c->num_pages = c->stride * c->batch + tu_range(r, 5);
        int64_t *perm = malloc(sizeof(int64_t) * (size_t)c->num_pages);
        for (int64_t p = 0; p < c->num_pages; p++)
            perm[p] = p;
        for (int64_t p = c->num_pages - 1; p > 0; p--) {
            int64_t j = tu_range(r, p + 1), t = perm[p];
            perm[p] = perm[j];
            perm[j] = t;
        }
        if (c->bound)
            c->max_keys = longest + tu_range(r, c->stride * c->page_size - longest + 1);
        in->table = malloc(sizeof(int32_t) * (size_t)(c->stride * c->batch));
        for (int64_t i = 0; i < c->stride * c->batch; i++)
            in->table[i] = (int32_t)perm[i];
        free(perm);
        for (int k = 0; k < 2; k++) {
            tu_tensor_init(&in->kc[k], cdt, c->num_pages, c->page_size, c->kvh, c->d, 0, 0);
            tu_tensor_init(&in->vc[k], cdt, c->num_pages, c->page_size, c->kvh, c->dv, 0, 0);
        }
    } else {
        c->capacity = longest + tu_range(r, 9);
        if (c->bound)
            c->max_keys = longest + tu_range(r, c->capacity - longest + 1);
        c->use_batch_idx = tu_range(r, 2);
        c->cache_rows = c->batch + (c->use_batch_idx ? tu_range(r, 3) : 0);
        if (c->use_batch_idx) {
            in->batch_idx = malloc(sizeof(int32_t) * (size_t)c->batch);
            for (int64_t b = 0; b < c->batch; b++)
                in->batch_idx[b] = (int32_t)(c->cache_rows - 1 - b); /* reversed rows */
        }
        for (int k = 0; k < 2; k++) {
            tu_tensor_init(&in->kc[k], cdt, c->cache_rows, c->capacity, c->kvh, c->d, 0, 0);
            tu_tensor_init(&in->vc[k], cdt, c->cache_rows, c->capacity, c->kvh, c->dv, 0, 0);
        }
    }
    if (c->f8) { /* descales around 1/64: normal values well inside e4m3's range */
        const int64_t n = c->kvl == FMHA_KV_DESCALE_PER_TENSOR ? 1
                          : c->kvl == FMHA_KV_DESCALE_PER_HEAD ? c->kvh
                                                               : in->kc[0].t.batch * c->kvh;
        in->kd = malloc(sizeof(float) * (size_t)n);
        in->vd = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n; i++) {
            in->kd[i] = (float)((0.5 + tu_uniform(r)) / 64.0);
            in->vd[i] = (float)((0.5 + tu_uniform(r)) / 64.0);
        }
        fill_f8(c, &in->kc[0], in->kd, r);
        fill_f8(c, &in->vc[0], in->vd, r);
    } else {
        tu_fill_normal(&in->kc[0], r, 1.0);
        tu_fill_normal(&in->vc[0], r, 1.0);
    }
    memcpy(in->kc[1].alloc, in->kc[0].alloc, in->kc[0].alloc_bytes);
    memcpy(in->vc[1].alloc, in->vc[0].alloc, in->vc[0].alloc_bytes);
    tu_tensor_init(&in->q, dt, c->batch, c->sq, c->heads, c->d, (int)tu_range(r, 3), 0);
    tu_fill_normal(&in->q, r, 1.0);
    if (c->snew > 0) {
        tu_tensor_init(&in->knew, dt, c->batch, c->snew, c->kvh, c->d, (int)tu_range(r, 3), 0);
        tu_tensor_init(&in->vnew, dt, c->batch, c->snew, c->kvh, c->dv, 0, 0);
        tu_fill_normal(&in->knew, r, 1.0);
        tu_fill_normal(&in->vnew, r, 1.0);
    }
    for (int k = 0; k < 2; k++) {
        tu_tensor_init(&in->out[k], c->odt, c->batch, c->sq, c->heads, c->dv, 0, 0xFF);
        in->lse[k] = malloc(sizeof(float) * (size_t)(c->batch * c->heads * c->sq));
        memset(in->lse[k], 0xFF, sizeof(float) * (size_t)(c->batch * c->heads * c->sq));
    }
    if (c->rotary_dim > 0) {
        /* A bound (max_seqlen_k) stands for every sequence's length on CUDA:
         * the table must reach it (fmha.h). */
        c->rotary_len = (c->bound ? c->max_keys : longest) + c->sq + tu_range(r, 5);
        const int64_t half = c->rotary_dim / 2;
        /* room for head_dim + 2 channels: the refused rotary_dim's extent */
        const size_t room = sizeof(float) * (size_t)(c->rotary_len * (c->d / 2 + 1));
        in->cos = malloc(room);
        in->sin = malloc(room);
        for (int64_t p = 0; p < c->rotary_len; p++)
            for (int64_t i = 0; i < half; i++) {
                const double theta = (double)p * pow(10000.0, -2.0 * (double)i / c->rotary_dim);
                in->cos[p * half + i] = (float)cos(theta);
                in->sin[p * half + i] = (float)sin(theta);
            }
    }
}

static void free_inputs(dinputs *in)
{
    tu_tensor *ts[] = {&in->q,     &in->knew,  &in->vnew,   &in->kc[0], &in->kc[1],
                       &in->vc[0], &in->vc[1], &in->out[0], &in->out[1]};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        if (ts[i]->alloc)
            tu_tensor_free(ts[i]);
    free(in->cache_seqlens);
    free(in->batch_idx);
    free(in->table);
    free(in->cos);
    free(in->sin);
    free(in->lse[0]);
    free(in->lse[1]);
    free(in->kd);
    free(in->vd);
    free(in->slopes);
    free(in->sinks);
}

/* The arguments of copy k (0: the reference's, 1: the fast path's). */
static fmha_kvcache_args args_of(const dcase *c, dinputs *in, int k)
{
    fmha_kvcache_args a = {.q = in->q.t,
                           .k_cache = in->kc[k].t,
                           .v_cache = in->vc[k].t,
                           .out = in->out[k].t,
                           .lse = c->lse ? in->lse[k] : NULL,
                           .cache_seqlens = in->cache_seqlens,
                           .cache_batch_idx = in->batch_idx,
                           .block_table = in->table,
                           .block_table_stride = c->stride,
                           .rotary_cos = in->cos,
                           .rotary_sin = in->sin,
                           .rotary_dim = c->rotary_dim,
                           .rotary_len = c->rotary_len,
                           .rotary_interleaved = c->interleaved,
                           .num_splits = c->splits,
                           .k_descale = in->kd,
                           .v_descale = in->vd,
                           .kv_descale_layout = c->kvl,
                           .max_seqlen_k = c->bound ? c->max_keys : 0,
                           .alibi_slopes = in->slopes,
                           .alibi_stride_batch = c->alibi == 2 ? c->heads + 1 : 0,
                           .sinks = in->sinks};
    if (c->snew > 0) {
        a.k_new = in->knew.t;
        a.v_new = in->vnew.t;
    }
    return a;
}

/* Element (b, t, h, c) of a cache: its own implementation of the layout. */
static double cache_get(const dcase *c, const dinputs *in, const tu_tensor *x, int64_t b, int64_t t,
                        int64_t h, int64_t ch)
{
    const int64_t row = c->paged        ? in->table[b * c->stride + t / c->page_size]
                        : in->batch_idx ? in->batch_idx[b]
                                        : b;
    const double v = tu_get(x, row, c->paged ? t % c->page_size : t, h, ch);
    if (!c->f8)
        return v;
    return v * descale_at(c, x == &in->kc[0] || x == &in->kc[1] ? in->kd : in->vd, row, h);
}

/* q rotated in f32 and rounded to its dtype, as the fast path sees it. */
static double q_rotated(const dcase *c, const dinputs *in, int64_t b, int64_t i, int64_t h,
                        int64_t ch)
{
    const int64_t half = c->rotary_dim / 2;
    if (ch >= c->rotary_dim)
        return tu_get(&in->q, b, i, h, ch);
    const int local = c->cfg.window_left >= 0 || c->cfg.window_right >= 0;
    const int64_t pos = in->cache_seqlens[b] + (c->cfg.causal || local ? i : 0);
    const int64_t p = c->interleaved ? ch / 2 : ch % half;
    const int64_t c1 = c->interleaved ? 2 * p : p, c2 = c->interleaved ? 2 * p + 1 : p + half;
    const float x1 = (float)tu_get(&in->q, b, i, h, c1), x2 = (float)tu_get(&in->q, b, i, h, c2);
    const float cs = in->cos[pos * half + p], sn = in->sin[pos * half + p];
    const float y = ch == c1 ? x1 * cs - x2 * sn : x1 * sn + x2 * cs;
    if (c->cfg.dtype == FMHA_DTYPE_BF16)
        return fmha_bf16_to_f32(fmha_f32_to_bf16(y));
    if (c->cfg.dtype == FMHA_DTYPE_F16)
        return fmha_f16_to_f32(fmha_f32_to_f16(y));
    return y;
}

/* The naive same-precision attention over the reference's updated cache,
 * gathered into a packed batch: its largest error against out_ref, and in
 * *lse_err its LSE's. */
static double naive_error(const dcase *c, const dinputs *in, double *lse_err)
{
    int32_t *cuq = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
    int32_t *cuk = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
    cuq[0] = cuk[0] = 0;
    for (int64_t b = 0; b < c->batch; b++) {
        cuq[b + 1] = cuq[b] + (int32_t)c->sq;
        cuk[b + 1] = cuk[b] + in->cache_seqlens[b] + (int32_t)c->snew;
    }
    const int64_t tk = cuk[c->batch] > 0 ? cuk[c->batch] : 1;
    tu_tensor q, k, v, o;
    tu_tensor_init(&q, c->cfg.dtype, 1, c->batch * c->sq, c->heads, c->d, 0, 0);
    tu_tensor_init(&k, c->cfg.dtype, 1, tk, c->kvh, c->d, 0, 0);
    tu_tensor_init(&v, c->cfg.dtype, 1, tk, c->kvh, c->dv, 0, 0);
    tu_tensor_init(&o, FMHA_DTYPE_F32, 1, c->batch * c->sq, c->heads, c->dv, 0, 0);
    float *lse = malloc(sizeof(float) * (size_t)(c->heads * c->batch * c->sq));
    for (int64_t b = 0; b < c->batch; b++) {
        for (int64_t i = 0; i < c->sq; i++)
            for (int64_t h = 0; h < c->heads; h++)
                for (int64_t ch = 0; ch < c->d; ch++)
                    tu_set(&q, 0, cuq[b] + i, h, ch,
                           c->rotary_dim ? q_rotated(c, in, b, i, h, ch)
                                         : tu_get(&in->q, b, i, h, ch));
        for (int64_t t = 0; t < cuk[b + 1] - cuk[b]; t++)
            for (int64_t h = 0; h < c->kvh; h++) {
                for (int64_t ch = 0; ch < c->d; ch++)
                    tu_set(&k, 0, cuk[b] + t, h, ch, cache_get(c, in, &in->kc[0], b, t, h, ch));
                for (int64_t ch = 0; ch < c->dv; ch++)
                    tu_set(&v, 0, cuk[b] + t, h, ch, cache_get(c, in, &in->vc[0], b, t, h, ch));
            }
    }
    fmha_forward_args a = {.q = q.t,
                           .k = k.t,
                           .v = v.t,
                           .out = o.t,
                           .lse = lse,
                           .cu_seqlens_q = cuq,
                           .cu_seqlens_k = cuk,
                           .varlen_batch = c->batch,
                           .alibi_slopes = in->slopes,
                           .alibi_stride_batch = c->alibi == 2 ? c->heads + 1 : 0,
                           .sinks = in->sinks};
    tu_naive_forward(&c->cfg, &a);
    double err = 0;
    if (c->rotary_dim == 0 && !c->f8) {
        /* The reference's decode reads its caches as its forward reads the
         * gathered keys: the same numbers. */
        tu_tensor o2;
        tu_tensor_init(&o2, c->odt, 1, c->batch * c->sq, c->heads, c->dv, 0, 0);
        fmha_forward_args a2 = a;
        a2.out = o2.t;
        a2.lse = NULL;
        TU_CHECK(fmha_reference_forward(&c->cfg, &a2) == FMHA_STATUS_OK, "reference: %s",
                 fmha_last_error());
        double e2 = 0;
        for (int64_t b = 0; b < c->batch; b++)
            for (int64_t i = 0; i < c->sq; i++)
                for (int64_t h = 0; h < c->heads; h++)
                    for (int64_t ch = 0; ch < c->dv; ch++) {
                        const double x = tu_get(&o2, 0, cuq[b] + i, h, ch);
                        const double y = tu_get(&in->out[0], b, i, h, ch);
                        e2 = fabs(x - y) > e2 || isnan(x - y) ? fabs(x - y) : e2;
                    }
        TU_CHECK(e2 == 0,
                 "the reference's decode differs from its forward over the gathered keys by %.3g",
                 e2);
        tu_tensor_free(&o2);
    }
    *lse_err = 0;
    for (int64_t b = 0; b < c->batch; b++)
        for (int64_t i = 0; i < c->sq; i++)
            for (int64_t h = 0; h < c->heads; h++) {
                /* packed [heads, total_q] against [batch, heads, seqlen_q] */
                const double l = lse[h * c->batch * c->sq + cuq[b] + i];
                const double lr = in->lse[0][(b * c->heads + h) * c->sq + i];
                if (c->lse && isfinite(lr) && fabs(l - lr) > *lse_err)
                    *lse_err = fabs(l - lr);
                for (int64_t ch = 0; ch < c->dv; ch++) {
                    double e =
                        fabs(tu_get(&o, 0, cuq[b] + i, h, ch) - tu_get(&in->out[0], b, i, h, ch));
                    if (e > err || isnan(e))
                        err = e;
                }
            }
    free(lse);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&o);
    free(cuq);
    free(cuk);
    return err;
}

/* Largest difference between the two copies of a cache (0 where nothing
 * was rotated: the appended rows are copies). */
static double cache_diff(const tu_tensor *x, const tu_tensor *y)
{
    double err = 0;
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++) {
                    double e = fabs(tu_get(x, b, s, h, c) - tu_get(y, b, s, h, c));
                    if (e > err || isnan(e))
                        err = e;
                }
    return err;
}

/* Largest distance, in steps of the code, between the elements of two FP8
 * caches (codes of one sign are ordered by magnitude; a sign flip is a step
 * only between zeros). */
static int code_steps(const tu_tensor *x, const tu_tensor *y)
{
    int most = 0;
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++) {
                const int64_t off = b * t->stride_batch + s * t->stride_seq + h * t->stride_head;
                const uint8_t *p = (const uint8_t *)t->data + off;
                const uint8_t *q = (const uint8_t *)y->t.data + off;
                for (int64_t c = 0; c < t->head_dim; c++) {
                    const int a = p[c] & 0x7F, e = q[c] & 0x7F;
                    const int n = (p[c] ^ q[c]) & 0x80 ? a + e : abs(a - e);
                    most = n > most ? n : most;
                }
            }
    return most;
}

static void describe(const dcase *c, char *buf, size_t n)
{
    snprintf(buf, n,
             "%s %s b%lld sq%lld new%lld h%lld/%lld d%lld/%lld %s%s%s causal%d win%lld cap%g "
             "rot%lld%s splits%lld",
             fmha_cpu_isa_name(c->cfg.cpu_isa), fmha_dtype_name(c->cfg.dtype), (long long)c->batch,
             (long long)c->sq, (long long)c->snew, (long long)c->heads, (long long)c->kvh,
             (long long)c->d, (long long)c->dv, c->paged ? "paged " : "contig",
             c->paged ? "" : (c->use_batch_idx ? "+idx" : ""), c->lse ? " lse" : "", c->cfg.causal,
             (long long)c->cfg.window_left, c->cfg.softcap, (long long)c->rotary_dim,
             c->interleaved ? "i" : "", (long long)c->splits);
    if (c->paged) {
        size_t l = strlen(buf);
        snprintf(buf + l, n - l, " page%lld", (long long)c->page_size);
    }
    if (c->bound) {
        size_t l = strlen(buf);
        snprintf(buf + l, n - l, " max_seqlen_k %lld", (long long)c->max_keys);
    }
    if (c->alibi || c->sinks) {
        size_t l = strlen(buf);
        snprintf(buf + l, n - l, " alibi%d sinks%d", c->alibi, c->sinks);
    }
    if (c->f8) {
        static const char *const layouts[3] = {"tensor", "head", "page"};
        size_t l = strlen(buf);
        snprintf(buf + l, n - l, " f8 caches (descale per %s)", layouts[c->kvl]);
    }
}

static void run_case(tu_rng *r, fmha_cpu_isa isa)
{
    dcase c = random_case(r, isa);
    dinputs in;
    make_inputs(&c, &in, r);
    draw_mods(&c, &in, r);
    char desc[256];
    describe(&c, desc, sizeof desc);
    fmha_kvcache_args ar = args_of(&c, &in, 0), af = args_of(&c, &in, 1);
    fmha_status st = fmha_reference_decode(&c.cfg, &ar);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: reference: %s", desc, fmha_last_error());
    st = run_decode(&c.cfg, &af);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: decode: %s", desc, fmha_last_error());
    if (st != FMHA_STATUS_OK) {
        free_inputs(&in);
        return;
    }
    int bad = 0;
    double len;
    const double e = tu_max_err(&in.out[1], &in.out[0], &bad), en = naive_error(&c, &in, &len);
    const double tol = 4.0 * en + 1e-6;
    TU_CHECK(!bad && e <= tol, "%s: out error %.3g > tol %.3g (naive %.3g)%s", desc, e, tol, en,
             bad ? " non-finite output" : "");
    /* FP8 caches: the reference reads them through the library's descale
     * lookup, so the naive run (this file's own lookup, cache_get) bounds it. */
    const double nbound = c.cfg.dtype == FMHA_DTYPE_F32 ? 1e-4 : 0.05;
    TU_CHECK(!c.f8 || en <= nbound, "%s: the reference is %.3g from the naive run", desc, en);
    TU_CHECK(tu_gaps_untouched(&in.out[1], 0xFF), "%s: wrote outside out", desc);
    if (c.lse) {
        const double le = tu_lse_err(in.lse[1], in.lse[0], c.batch * c.heads * c.sq, &bad);
        TU_CHECK(!bad && le <= 4.0 * len + 1e-5, "%s: lse error %.3g (naive %.3g)", desc, le, len);
    }
    /* Rotation rounds in f32 here and in float64 there: one unit of the
     * cache's last place at most (|k| < 8). */
    const double ctol = c.rotary_dim == 0                ? 0
                        : c.cfg.dtype == FMHA_DTYPE_F32  ? 1e-5
                        : c.cfg.dtype == FMHA_DTYPE_BF16 ? 8.0 * 0x1p-8
                                                         : 8.0 * 0x1p-11;
    if (c.f8) { /* the same codes, but a rotated key may round one code apart */
        const int sk = code_steps(&in.kc[1], &in.kc[0]), sv = code_steps(&in.vc[1], &in.vc[0]);
        TU_CHECK(sk <= (c.rotary_dim > 0) && sv == 0,
                 "%s: FP8 caches differ from the reference's: k %d, v %d codes apart", desc, sk,
                 sv);
    } else {
        const double ek = cache_diff(&in.kc[1], &in.kc[0]), ev = cache_diff(&in.vc[1], &in.vc[0]);
        TU_CHECK(ek <= ctol && ev == 0, "%s: caches differ from the reference's: k %.3g, v %.3g",
                 desc, ek, ev);
    }
    free_inputs(&in);
}

/* A full contiguous cache without new tokens is fmha_forward's problem: the
 * same bytes where decode runs the forward's tiles (S = 4 positions of a
 * 4-head group: 16 rows, a whole vector step); with S = 1 (4 rows) decode
 * takes the row products where the ISA has them, checked by the random
 * cases. Its pages scattered over a pool give the contiguous cache's bytes
 * either way. */
static void test_same_as_forward(tu_rng *r, fmha_cpu_isa isa, int64_t S)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 8, 2, 64);
    cfg.cpu_isa = isa;
    cfg.causal = 1;
    cfg.dtype = DECODE_DTYPE;
    const int64_t B = 3, K = 200, P = 16, np = (K + P - 1) / P;
    tu_tensor q, k, v, o1, o2, o3, kp, vp;
    tu_tensor_init(&q, cfg.dtype, B, S, 8, 64, 0, 0);
    tu_tensor_init(&k, cfg.dtype, B, K, 2, 64, 0, 0);
    tu_tensor_init(&v, cfg.dtype, B, K, 2, 64, 0, 0);
    tu_tensor_init(&kp, cfg.dtype, B * np + 1, P, 2, 64, 0, 0);
    tu_tensor_init(&vp, cfg.dtype, B * np + 1, P, 2, 64, 0, 0);
    tu_tensor *outs[3] = {&o1, &o2, &o3};
    for (int i = 0; i < 3; i++)
        tu_tensor_init(outs[i], FMHA_DTYPE_F32, B, S, 8, 64, 0, 0xFF);
    tu_fill_normal(&q, r, 1);
    tu_fill_normal(&k, r, 1);
    tu_fill_normal(&v, r, 1);
    int32_t table[3 * 13], lens[3] = {K, K, K};
    for (int64_t b = 0; b < B; b++)
        for (int64_t p = 0; p < np; p++) {
            table[b * np + p] =
                (int32_t)((p * B + (B - 1 - b)) + 1); /* interleaved, page 0 unused */
            for (int64_t t = p * P; t < K && t < (p + 1) * P; t++)
                for (int64_t h = 0; h < 2; h++)
                    for (int64_t c = 0; c < 64; c++) {
                        tu_set(&kp, table[b * np + p], t - p * P, h, c, tu_get(&k, b, t, h, c));
                        tu_set(&vp, table[b * np + p], t - p * P, h, c, tu_get(&v, b, t, h, c));
                    }
        }
    fmha_forward_args f = {.q = q.t, .k = k.t, .v = v.t, .out = o1.t};
    TU_CHECK(fmha_forward(&cfg, &f) == FMHA_STATUS_OK, "forward: %s", fmha_last_error());
    fmha_kvcache_args a = {.q = q.t, .k_cache = k.t, .v_cache = v.t, .out = o2.t, .num_splits = 1};
    TU_CHECK(run_decode(&cfg, &a) == FMHA_STATUS_OK, "decode: %s", fmha_last_error());
#ifndef FMHA_TEST_CUDA /* the CUDA decode kernel is not the CPU forward */
    TU_CHECK(S * 4 < 16 || memcmp(o1.alloc, o2.alloc, o1.alloc_bytes) == 0,
             "%s: decode over a full cache differs from fmha_forward", fmha_cpu_isa_name(isa));
#endif
    fmha_kvcache_args pa = {.q = q.t,
                            .k_cache = kp.t,
                            .v_cache = vp.t,
                            .out = o3.t,
                            .cache_seqlens = lens,
                            .block_table = table,
                            .block_table_stride = np,
                            .num_splits = 1};
    TU_CHECK(run_decode(&cfg, &pa) == FMHA_STATUS_OK, "paged decode: %s", fmha_last_error());
    TU_CHECK(memcmp(o2.alloc, o3.alloc, o2.alloc_bytes) == 0,
             "%s: the paged cache's answer differs from the contiguous one's",
             fmha_cpu_isa_name(isa));
    tu_tensor *all[8] = {&q, &k, &v, &o1, &o2, &o3, &kp, &vp};
    for (int i = 0; i < 8; i++)
        tu_tensor_free(all[i]);
}

/* One sequence with a long cache: the automatic split (several tasks per
 * KV head), one split and an odd count agree with the reference, and the
 * automatic one gives the same bytes on 1 and 2 threads. */
static void test_splits(tu_rng *r, fmha_cpu_isa isa)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 8, 2, 128);
    cfg.cpu_isa = isa;
    cfg.dtype = DECODE_DTYPE;
    const int64_t K = 3001;
    tu_tensor q, k, v, ref, o[4];
    tu_tensor_init(&q, cfg.dtype, 1, 1, 8, 128, 0, 0);
    tu_tensor_init(&k, cfg.dtype, 1, K + 7, 2, 128, 0, 0);
    tu_tensor_init(&v, cfg.dtype, 1, K + 7, 2, 128, 0, 0);
    tu_tensor_init(&ref, FMHA_DTYPE_F32, 1, 1, 8, 128, 0, 0xFF);
    tu_fill_normal(&q, r, 1);
    tu_fill_normal(&k, r, 1);
    tu_fill_normal(&v, r, 1);
    int32_t len = (int32_t)K;
    float lse_ref[8], lse[4][8];
    fmha_kvcache_args a = {.q = q.t,
                           .k_cache = k.t,
                           .v_cache = v.t,
                           .out = ref.t,
                           .lse = lse_ref,
                           .cache_seqlens = &len};
    TU_CHECK(fmha_reference_decode(&cfg, &a) == FMHA_STATUS_OK, "reference: %s", fmha_last_error());
    const int64_t splits[4] = {0, 1, 7, 0};
    for (int i = 0; i < 4; i++) {
        tu_tensor_init(&o[i], FMHA_DTYPE_F32, 1, 1, 8, 128, 0, 0xFF);
        a.out = o[i].t;
        a.lse = lse[i];
        a.num_splits = splits[i];
        cfg.num_threads = i == 3 ? 1 : 2;
        TU_CHECK(run_decode(&cfg, &a) == FMHA_STATUS_OK, "splits %lld: %s", (long long)splits[i],
                 fmha_last_error());
        int bad = 0;
        const double e = tu_max_err(&o[i], &ref, &bad), le = tu_lse_err(lse[i], lse_ref, 8, &bad);
        TU_CHECK(!bad && e < 2e-3 && le < 1e-4, "%s, %lld splits: out error %.3g, lse %.3g",
                 fmha_cpu_isa_name(isa), (long long)splits[i], e, le);
    }
    TU_CHECK(
        !memcmp(o[0].alloc, o[3].alloc, o[0].alloc_bytes) && !memcmp(lse[0], lse[3], sizeof lse[0]),
        "%s: the automatic split's answer depends on the thread count", fmha_cpu_isa_name(isa));
    TU_CHECK(memcmp(o[0].alloc, o[1].alloc, o[0].alloc_bytes) != 0,
             "%s: the automatic choice did not split 3001 keys of 2 KV heads",
             fmha_cpu_isa_name(isa));
    tu_tensor *all[5] = {&q, &k, &v, &ref, &o[0]};
    for (int i = 0; i < 5; i++)
        tu_tensor_free(all[i]);
    for (int i = 1; i < 4; i++)
        tu_tensor_free(&o[i]);
}

/* A bad argument: the expected status and words in the message, and neither
 * the cache nor out written. */
static void expect_refused(const fmha_config *cfg, const fmha_kvcache_args *a, dinputs *in,
                           fmha_status want, const char *words, const char *what)
{
    void *k0 = malloc(in->kc[1].alloc_bytes), *o0 = malloc(in->out[1].alloc_bytes);
    memcpy(k0, in->kc[1].alloc, in->kc[1].alloc_bytes);
    memcpy(o0, in->out[1].alloc, in->out[1].alloc_bytes);
    fmha_status st = run_decode(cfg, a);
    TU_CHECK(st == want && strstr(fmha_last_error(), words), "%s: got %s \"%s\"", what,
             fmha_status_string(st), fmha_last_error());
    TU_CHECK(!memcmp(k0, in->kc[1].alloc, in->kc[1].alloc_bytes) &&
                 !memcmp(o0, in->out[1].alloc, in->out[1].alloc_bytes),
             "%s: refused, yet wrote into the cache or out", what);
    free(k0);
    free(o0);
}

static void test_errors(tu_rng *r)
{
    dcase c;
    dinputs in;
    do { /* a paged case with new tokens and rotary */
        c = random_case(r, FMHA_CPU_ISA_AUTO);
    } while (!c.paged || c.rotary_dim == 0 || c.cfg.window_left >= 0);
    c.bound = 0; /* the refusals below are of other arguments than the bound */
    make_inputs(&c, &in, r);
    fmha_kvcache_args good = args_of(&c, &in, 1), a;

    a = good;
    in.table[0] = (int32_t)c.num_pages;
    in.cache_seqlens[0] = (int32_t)(c.page_size > 1 ? c.page_size - 1 : 1);
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "is not a page of the cache",
                   "page index past the pool");
    in.table[0] = -1;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "block_table[0][0] (-1)",
                   "negative page index");
    in.table[0] = 0;

    in.cache_seqlens[c.batch - 1] = (int32_t)(c.stride * c.page_size - c.snew + 1);
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "past the cache's capacity",
                   "cache_seqlens above the capacity");
    a.block_table_stride = 1; /* a table too short for the sequence */
    in.cache_seqlens[c.batch - 1] = (int32_t)c.page_size;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT,
                   "grow the cache or the block table", "block table too short");
    a = good;
    in.cache_seqlens[c.batch - 1] = -3;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "must be non-negative",
                   "negative cache_seqlens");
    in.cache_seqlens[c.batch - 1] = 0;

    a = good;
    a.rotary_len = 1 + (c.snew > 1 ? 0 : 0);
    in.cache_seqlens[0] = 5;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "past rotary_len",
                   "positions past the rotary table");
    a = good;
    a.rotary_dim = c.d + 2;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "rotary_dim", "rotary_dim > d");
    a = good;
    a.k_new.data = NULL;
    a.v_new = (fmha_tensor){0};
    a.k_new = (fmha_tensor){0};
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "pass k_new",
                   "rotary without new keys");
    a = good;
    a.v_new.data = NULL;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "v_new.data is NULL",
                   "k_new without v_new");
    a = good;
    a.cache_batch_idx = in.cache_seqlens;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "cache_batch_idx",
                   "cache_batch_idx with a block table");
    a = good;
    a.cache_seqlens = NULL;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "cache_seqlens is NULL",
                   "no cache_seqlens with new tokens");
    a = good;
    a.num_splits = -1;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "num_splits", "num_splits < 0");
    a = good;
    a.max_seqlen_k = c.stride * c.page_size + 1;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "past the cache's capacity",
                   "max_seqlen_k above the capacity");
#ifndef FMHA_TEST_CUDA /* on CUDA the bound stands for the arrays: test_device_checked */
    in.cache_seqlens[0] = 3;
    a.max_seqlen_k = 3 + c.snew - 1 > 0 ? 3 + c.snew - 1 : 1;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "past max_seqlen_k",
                   "a sequence past max_seqlen_k");
    in.cache_seqlens[0] = 0;
#endif
    fmha_config cfg = c.cfg;
    cfg.dropout_p = 0.1;
    expect_refused(&cfg, &good, &in, FMHA_STATUS_INVALID_ARGUMENT, "dropout_p", "dropout");
    cfg = c.cfg;
    cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
    cfg.dtype = FMHA_DTYPE_BF16;
    expect_refused(&cfg, &good, &in, FMHA_STATUS_UNSUPPORTED, "fp8_compute", "fp8_compute layer");
    cfg = c.cfg;
    cfg.num_kv_heads = c.kvh * (c.heads / c.kvh > 1 ? 1 : 1);
    cfg.head_dim_v = c.dv + 1;
    expect_refused(&cfg, &good, &in, FMHA_STATUS_INVALID_ARGUMENT, "this layer needs",
                   "v_cache's head dim");
    free_inputs(&in);

    /* Contiguous: a cache row out of range, and too few rows. */
    do {
        c = random_case(r, FMHA_CPU_ISA_AUTO);
    } while (c.paged);
    c.bound = 0;
    make_inputs(&c, &in, r);
    good = args_of(&c, &in, 1);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)c.batch);
    for (int64_t b = 0; b < c.batch; b++)
        idx[b] = 0;
    idx[c.batch - 1] = (int32_t)c.cache_rows;
    a = good;
    a.cache_batch_idx = idx;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "is not a row of the cache",
                   "cache_batch_idx out of range");
    float one = 1.0f;
    a = good;
    a.k_descale = c.f8 ? NULL : &one;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT,
                   c.f8 ? "k_descale is NULL" : "descales belong to f8_e4m3 caches",
                   "a descale that does not fit the caches' dtype");
    a = good;
    a.cache_batch_idx = NULL;
    a.k_cache.batch = a.v_cache.batch = c.batch - 1;
    if (c.batch > 1)
        expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "below q.batch",
                       "fewer cache rows than sequences");
    free(idx);
    free_inputs(&in);

    /* FP8 caches: their descales, their dtypes. */
    c = random_case(r, FMHA_CPU_ISA_AUTO);
    c.f8 = 1;
    c.bound = 0;
    make_inputs(&c, &in, r);
    good = args_of(&c, &in, 1);
    a = good;
    a.v_descale = NULL;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "v_descale is NULL",
                   "FP8 caches without v_descale");
    a = good;
    a.kv_descale_layout = (fmha_kv_descale_layout)7;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "kv_descale_layout (7)",
                   "an unknown descale layout");
    a = good;
    a.v_cache.dtype = c.cfg.dtype;
    expect_refused(&c.cfg, &a, &in, FMHA_STATUS_INVALID_ARGUMENT, "the caches share their dtype",
                   "an FP8 k_cache beside a v_cache of the layer's dtype");
    fmha_config f8cfg = c.cfg;
    f8cfg.dtype = FMHA_DTYPE_F8_E4M3;
    expect_refused(&f8cfg, &good, &in, FMHA_STATUS_UNSUPPORTED, "build the decode layer in q's",
                   "an f8_e4m3 decode layer");
#ifndef FMHA_TEST_CUDA /* on CUDA the descales stay in device memory, unread by the host */
    in.kd[0] = 0.0f;
    expect_refused(&c.cfg, &good, &in, FMHA_STATUS_INVALID_ARGUMENT, "k_descale[0] (0)",
                   "a zero descale");
#endif
    free_inputs(&in);
}

#ifdef FMHA_TEST_CUDA
/* max_seqlen_k on CUDA: the index arrays are checked by the kernels. In a
 * paged batch of at least 3, sequence 0's block table names a page past the
 * pool and sequence 1's length is past the bound: both come out NaN (out
 * and LSE); sequence 1 appends nothing, sequence 0 nothing into the page it
 * lacks; the others as the reference says, and their new tokens in the
 * cache. */
static void test_device_checked(tu_rng *r)
{
    dcase c;
    dinputs in;
    do {
        c = random_case(r, FMHA_CPU_ISA_AUTO);
    } while (!c.paged || c.batch < 3 || c.snew == 0);
    c.rotary_dim = 0; /* appended rows are then exact copies */
    c.bound = 1;
    c.lse = 1;
    make_inputs(&c, &in, r);
    in.cache_seqlens[0] = in.cache_seqlens[0] > 0 ? in.cache_seqlens[0] : 1;
    if (in.cache_seqlens[0] + c.snew > c.max_keys)
        in.cache_seqlens[0] = (int32_t)(c.max_keys - c.snew);
    char desc[256];
    describe(&c, desc, sizeof desc);
    const size_t nt = (size_t)(c.batch * c.stride);
    int32_t *table = malloc(sizeof(int32_t) * nt), *lens = malloc(sizeof(int32_t) * c.batch);
    memcpy(table, in.table, sizeof(int32_t) * nt);
    memcpy(lens, in.cache_seqlens, sizeof(int32_t) * c.batch);
    table[0] = (int32_t)c.num_pages;              /* sequence 0: no such page */
    lens[1] = (int32_t)(c.max_keys - c.snew + 1); /* sequence 1: past the bound */
    const size_t kb = in.kc[1].alloc_bytes, vb = in.vc[1].alloc_bytes;
    unsigned char *k0 = malloc(kb), *v0 = malloc(vb);
    memcpy(k0, in.kc[1].alloc, kb);
    memcpy(v0, in.vc[1].alloc, vb);
    fmha_kvcache_args ar = args_of(&c, &in, 0), af = args_of(&c, &in, 1);
    TU_CHECK(fmha_reference_decode(&c.cfg, &ar) == FMHA_STATUS_OK, "%s: reference: %s", desc,
             fmha_last_error());
    af.block_table = table;
    af.cache_seqlens = lens;
    const fmha_status st = run_decode(&c.cfg, &af);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: device-checked decode: %s", desc, fmha_last_error());
    double err = 0;
    int nan_ok = 1, good_finite = 1;
    for (int64_t b = 0; b < c.batch; b++)
        for (int64_t i = 0; i < c.sq; i++)
            for (int64_t h = 0; h < c.heads; h++) {
                const float l = in.lse[1][(b * c.heads + h) * c.sq + i];
                if (b < 2)
                    nan_ok &= isnan(l);
                for (int64_t ch = 0; ch < c.dv; ch++) {
                    const double x = tu_get(&in.out[1], b, i, h, ch);
                    if (b < 2) {
                        nan_ok &= isnan(x);
                        continue;
                    }
                    good_finite &= isfinite(x);
                    const double e = fabs(x - tu_get(&in.out[0], b, i, h, ch));
                    err = e > err ? e : err;
                }
            }
    TU_CHECK(nan_ok, "%s: the sequences of bad arrays are not all NaN", desc);
    TU_CHECK(good_finite && err <= 0.05, "%s: the other sequences differ by %.3g", desc, err);
    /* The caches: the bad sequences' new rows untouched, the others' written. */
    int cache_ok = 1;
    for (int64_t b = 0; b < c.batch; b++)
        for (int64_t t = in.cache_seqlens[b]; t < in.cache_seqlens[b] + c.snew; t++) {
            const int64_t pg = in.table[b * c.stride + t / c.page_size], sl = t % c.page_size;
            for (int64_t h = 0; h < c.kvh; h++) {
                const fmha_tensor *kt = &in.kc[1].t;
                const size_t off =
                    (size_t)(pg * kt->stride_batch + sl * kt->stride_seq + h * kt->stride_head) *
                    fmha_dtype_size(kt->dtype);
                const size_t n = (size_t)c.d * fmha_dtype_size(kt->dtype);
                const unsigned char *got = (const unsigned char *)kt->data + off;
                const int untouched = b == 1 || (b == 0 && t / c.page_size == 0);
                const unsigned char *want = untouched
                                                ? k0 + ((const unsigned char *)kt->data + off -
                                                        (const unsigned char *)in.kc[1].alloc)
                                                : (const unsigned char *)in.kc[0].t.data + off;
                cache_ok &= !memcmp(got, want, n);
            }
        }
    TU_CHECK(cache_ok, "%s: the keys appended differ from the expected (bad sequences: none)",
             desc);
    free(table);
    free(lens);
    free(k0);
    free(v0);
    free_inputs(&in);
}
#endif

/* Each allocation of a decode call (rotated q, the layer, its workspace,
 * the splits' partials) failed in turn: OUT_OF_MEMORY with a message, out
 * untouched, nothing leaked; until the call runs through. Allocations after
 * the append may leave the new tokens in the cache (docs/reliability.md). */
static void test_allocation_failures(tu_rng *r)
{
    dcase c;
    dinputs in;
    do {
        c = random_case(r, FMHA_CPU_ISA_AUTO);
    } while (!c.paged || c.rotary_dim == 0);
    c.splits = 3;
    make_inputs(&c, &in, r);
    const fmha_kvcache_args a = args_of(&c, &in, 1);
    void *o0 = malloc(in.out[1].alloc_bytes);
    memcpy(o0, in.out[1].alloc, in.out[1].alloc_bytes);
    fmha_status st = FMHA_STATUS_OUT_OF_MEMORY;
    long n = 0;
    for (; st == FMHA_STATUS_OUT_OF_MEMORY && n < 20; n++) {
        const long live = fmha_alloc_live();
        fmha_alloc_fail_after(n);
        st = run_decode(&c.cfg, &a);
        fmha_alloc_fail_after(-1);
        TU_CHECK(fmha_alloc_live() == live, "allocation %ld failed: %ld leaked", n + 1,
                 fmha_alloc_live() - live);
        if (st == FMHA_STATUS_OUT_OF_MEMORY)
            TU_CHECK(*fmha_last_error() && !memcmp(o0, in.out[1].alloc, in.out[1].alloc_bytes),
                     "allocation %ld failed: no message, or out written", n + 1);
    }
    printf("decode allocations: %ld\n", n - 1);
    TU_CHECK(st == FMHA_STATUS_OK && n >= 4, "the call ran after %ld failed allocations: %s", n - 1,
             fmha_last_error());
    free(o0);
    free_inputs(&in);
}

int main(int argc, char **argv)
{
    tu_rng r = {argc > 1 ? strtoull(argv[1], NULL, 0) : 0xdec0de};
    const char *env = getenv("FMHA_TEST_CASES");
    const int n = env ? atoi(env) / 4 + 1 : 60;
    int first = FMHA_CPU_ISA_SCALAR, last = FMHA_CPU_ISA_LAST;
#ifdef FMHA_TEST_CUDA
    if (!tu_cuda_begin())
        return 77;
    cudaStreamCreate(&stream);
    first = last = FMHA_CPU_ISA_AUTO; /* one pass: the CUDA layer */
#endif
    for (int isa = first; isa <= last; isa++) {
        if (isa > (int)fmha_cpu_isa_detect())
            break;
        for (int i = 0; i < n; i++)
            run_case(&r, (fmha_cpu_isa)isa);
        test_same_as_forward(&r, (fmha_cpu_isa)isa, 4);
        test_same_as_forward(&r, (fmha_cpu_isa)isa, 1);
        test_splits(&r, (fmha_cpu_isa)isa);
    }
    test_errors(&r);
#ifdef FMHA_TEST_CUDA
    for (int i = 0; i < 6; i++)
        test_device_checked(&r);
#endif
    test_allocation_failures(&r);
    return tu_summary();
}
