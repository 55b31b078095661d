/* devmem.c — see devmem.h. CUDA calls are compiled in only with the CUDA
 * backend (FMHA_HAVE_CUDA). */
#define _POSIX_C_SOURCE 200809L
#include "devmem.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#ifdef FMHA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static inline size_t tensor_bytes(const fmha_tensor *t)
{
    int64_t extent = (t->batch - 1) * t->stride_batch + (t->seqlen - 1) * t->stride_seq +
                     (t->heads - 1) * t->stride_head + t->head_dim;
    return (size_t)extent * fmha_dtype_size(t->dtype);
}

/* The bytes of one FP8 descale array, as fmha.h lays them out. */
static inline size_t descale_bytes(const fmha_forward_args *a, const fmha_tensor *t)
{
    int64_t n = 1;
    const int64_t seqs = a->cu_seqlens_q ? a->varlen_batch : a->q.batch;
    if (a->descale_layout == FMHA_DESCALE_PER_KV_HEAD)
        n = seqs * a->k.heads;
    else if (a->descale_layout == FMHA_DESCALE_PER_BLOCK && a->descale_block_rows > 0)
        n = t->batch * t->heads * ((t->seqlen + a->descale_block_rows - 1) / a->descale_block_rows);
    return (size_t)n * sizeof(float);
}

/* The bytes of the score modifiers' arrays (fmha_forward_args): the mask's
 * extent over [sequences, heads, longest query run, longest key run], the
 * slopes, the sinks. */
static void mods_bytes(const fmha_forward_args *a, size_t *mask, size_t *alibi, size_t *sinks)
{
    const int64_t seqs = a->cu_seqlens_q ? a->varlen_batch : a->q.batch;
    int64_t sq = a->q.seqlen, sk = a->k.seqlen;
    if (a->cu_seqlens_q) {
        sq = sk = 0;
        for (int64_t b = 0; b < seqs; b++) {
            const int64_t lq = a->cu_seqlens_q[b + 1] - a->cu_seqlens_q[b];
            const int64_t lk = a->cu_seqlens_k[b + 1] - a->cu_seqlens_k[b];
            sq = lq > sq ? lq : sq;
            sk = lk > sk ? lk : sk;
        }
    }
    const fmha_attn_mask *m = &a->mask;
    const size_t es = m->type == FMHA_MASK_BOOL ? 1 : m->type == FMHA_MASK_ADD_F32 ? 4 : 2;
    *mask = !m->data || sq == 0 || sk == 0
                ? 0
                : (size_t)((seqs - 1) * m->stride_batch + (a->q.heads - 1) * m->stride_head +
                           (sq - 1) * m->stride_q + (sk - 1) * m->stride_k + 1) *
                      es;
    *alibi = a->alibi_slopes ? (size_t)((seqs - 1) * a->alibi_stride_batch + a->q.heads) * 4 : 0;
    *sinks = a->sinks ? (size_t)a->q.heads * 4 : 0;
}

int dev_args_upload(dev_args *d, const fmha_forward_args *host, fmha_device device, char *err,
                    size_t errlen)
{
    memset(d, 0, sizeof *d);
    d->a = *host;
    d->device = device;
    if (device == FMHA_DEVICE_CPU)
        return 0;
#ifdef FMHA_HAVE_CUDA
    const int64_t nlse = host->cu_seqlens_q ? host->q.heads * host->q.seqlen
                                            : host->q.batch * host->q.heads * host->q.seqlen;
    const int64_t ncu = host->cu_seqlens_q ? host->varlen_batch + 1 : 0;
    const void *src[DEV_OWNED] = {
        host->q.data,       host->k.data,       host->v.data,    host->out.data,  host->lse,
        host->cu_seqlens_q, host->cu_seqlens_k, host->descale_q, host->descale_k, host->descale_v,
        host->mask.data,    host->alibi_slopes, host->sinks};
    size_t mask_b, alibi_b, sinks_b;
    mods_bytes(host, &mask_b, &alibi_b, &sinks_b);
    size_t bytes[DEV_OWNED] = {tensor_bytes(&host->q),
                               tensor_bytes(&host->k),
                               tensor_bytes(&host->v),
                               tensor_bytes(&host->out),
                               (size_t)nlse * 4,
                               (size_t)ncu * 4,
                               (size_t)ncu * 4,
                               descale_bytes(host, &host->q),
                               descale_bytes(host, &host->k),
                               descale_bytes(host, &host->v),
                               mask_b,
                               alibi_b,
                               sinks_b};
    for (int i = 0; i < DEV_OWNED; i++) {
        if (!src[i] || bytes[i] == 0)
            continue;
        cudaError_t e = cudaMalloc(&d->owned[i], bytes[i]);
        if (e == cudaSuccess)
            e = cudaMemcpy(d->owned[i], src[i], bytes[i], cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            snprintf(err, errlen, "copying %zu bytes to the GPU: %s", bytes[i],
                     cudaGetErrorString(e));
            dev_args_free(d);
            return -1;
        }
    }
    d->a.q.data = d->owned[0];
    d->a.k.data = d->owned[1];
    d->a.v.data = d->owned[2];
    d->a.out.data = d->owned[3];
    d->a.lse = d->owned[4];
    d->a.cu_seqlens_q = d->owned[5];
    d->a.cu_seqlens_k = d->owned[6];
    d->a.descale_q = d->owned[7];
    d->a.descale_k = d->owned[8];
    d->a.descale_v = d->owned[9];
    d->a.mask.data = d->owned[10];
    d->a.alibi_slopes = d->owned[11];
    d->a.sinks = d->owned[12];
    return 0;
#else
    snprintf(err, errlen, "this fmha was built without a CUDA backend");
    return -1;
#endif
}

int dev_args_download(const dev_args *d, const fmha_forward_args *host, char *err, size_t errlen)
{
    if (d->device == FMHA_DEVICE_CPU)
        return 0;
#ifdef FMHA_HAVE_CUDA
    const int64_t nlse = host->cu_seqlens_q ? host->q.heads * host->q.seqlen
                                            : host->q.batch * host->q.heads * host->q.seqlen;
    cudaError_t e =
        cudaMemcpy(host->out.data, d->a.out.data, tensor_bytes(&host->out), cudaMemcpyDeviceToHost);
    if (e == cudaSuccess && host->lse)
        e = cudaMemcpy(host->lse, d->a.lse, (size_t)nlse * 4, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "copying the output back from the GPU: %s", cudaGetErrorString(e));
        return -1;
    }
    return 0;
#else
    (void)host;
    snprintf(err, errlen, "this fmha was built without a CUDA backend");
    return -1;
#endif
}

void dev_args_free(dev_args *d)
{
#ifdef FMHA_HAVE_CUDA
    for (int i = 0; i < DEV_OWNED; i++)
        if (d->owned[i])
            cudaFree(d->owned[i]);
#endif
    memset(d->owned, 0, sizeof d->owned);
}

/* Milliseconds of fn(layer, args), timed by events on `stream` (CUDA) or
 * the host clock (CPU). */
static fmha_status time_call(fmha_device device, void *stream,
                             fmha_status (*fn)(fmha_layer *, const void *), fmha_layer *layer,
                             const void *args, double *ms)
{
#ifdef FMHA_HAVE_CUDA
    if (device == FMHA_DEVICE_CUDA) {
        cudaEvent_t start, stop;
        cudaEventCreate(&start);
        cudaEventCreate(&stop);
        cudaEventRecord(start, stream);
        fmha_status st = fn(layer, args);
        cudaEventRecord(stop, stream);
        cudaError_t e = cudaEventSynchronize(stop);
        float t = 0;
        cudaEventElapsedTime(&t, start, stop);
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        *ms = t;
        if (st == FMHA_STATUS_OK && e != cudaSuccess) {
            fprintf(stderr, "fmha: the GPU failed: %s\n", cudaGetErrorString(e));
            return FMHA_STATUS_BACKEND_ERROR;
        }
        return st;
    }
#else
    (void)device;
    (void)stream;
#endif
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fmha_status st = fn(layer, args);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6;
    return st;
}

static fmha_status call_forward(fmha_layer *layer, const void *args)
{
    return fmha_layer_forward(layer, args);
}

static fmha_status call_backward(fmha_layer *layer, const void *args)
{
    return fmha_layer_backward(layer, args);
}

fmha_status dev_time_forward(fmha_layer *layer, const dev_args *d, double *ms)
{
    return time_call(d->device, d->a.stream, call_forward, layer, &d->a, ms);
}

fmha_status dev_time_backward(fmha_layer *layer, const dev_bwd *d, double *ms)
{
    return time_call(d->device, d->a.stream, call_backward, layer, &d->a, ms);
}

int dev_bwd_upload(dev_bwd *d, const fmha_backward_args *host, const dev_args *fwd, char *err,
                   size_t errlen)
{
    memset(d, 0, sizeof *d);
    d->a = *host;
    d->device = fwd->device;
    if (fwd->device == FMHA_DEVICE_CPU)
        return 0;
#ifdef FMHA_HAVE_CUDA
    d->a.q = fwd->a.q;
    d->a.k = fwd->a.k;
    d->a.v = fwd->a.v;
    d->a.out = fwd->a.out;
    d->a.lse = fwd->a.lse;
    d->a.cu_seqlens_q = fwd->a.cu_seqlens_q;
    d->a.cu_seqlens_k = fwd->a.cu_seqlens_k;
    d->a.stream = fwd->a.stream;
    fmha_tensor *views[DEV_BWD_OWNED] = {&d->a.dout, &d->a.dq, &d->a.dk, &d->a.dv};
    for (int i = 0; i < DEV_BWD_OWNED; i++) {
        if (!views[i]->data)
            continue;
        const size_t bytes = tensor_bytes(views[i]);
        cudaError_t e = cudaMalloc(&d->owned[i], bytes);
        if (e == cudaSuccess && i == 0)
            e = cudaMemcpy(d->owned[i], views[i]->data, bytes, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            snprintf(err, errlen, "copying %zu bytes to the GPU: %s", bytes, cudaGetErrorString(e));
            dev_bwd_free(d);
            return -1;
        }
        views[i]->data = d->owned[i];
    }
    return 0;
#else
    snprintf(err, errlen, "this fmha was built without a CUDA backend");
    return -1;
#endif
}

void dev_bwd_free(dev_bwd *d)
{
#ifdef FMHA_HAVE_CUDA
    for (int i = 0; i < DEV_BWD_OWNED; i++)
        if (d->owned[i])
            cudaFree(d->owned[i]);
#endif
    memset(d->owned, 0, sizeof d->owned);
}
