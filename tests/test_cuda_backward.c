/* test_cuda_backward.c — the CUDA backward against the float64 reference on
 * the shared random cases (cases.c: odd seqlens, seqlen_q != seqlen_k, GQA,
 * MQA, head dims up to 256, head_dim_v != head_dim, every layout, mask,
 * softcap, dropout, varlen), f16/bf16 inputs, dout and gradients of any
 * dtype, the score modifiers (masks, ALiBi, sinks: dsinks too), gradients
 * poisoned on the device first. The tolerance is set by a
 * naive backward whose dO, P and dS are rounded to the inputs' dtype before
 * their products (tu_naive_backward), as a tensor-core kernel rounds them.
 * out and lse come from the CPU forward on the same inputs. Also: bits equal
 * run to run, a layer's backward after its CUDA forward, host pointers
 * refused with nothing written. Exits 77 (ctest: skipped) without a device.
 * FMHA_TEST_CASES sets the number of random cases. */
#include "cases.h"
#include "devmem.h"
#include "testutil.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static cudaStream_t stream;
static int twice; /* the runner runs the backward again and asks for the same bits */

/* Bytes from a view's first element to one past its last. */
static size_t view_bytes(const fmha_tensor *t)
{
    if (!t->data || t->batch == 0 || t->seqlen == 0 || t->heads == 0)
        return 0;
    const int64_t extent = (t->batch - 1) * t->stride_batch + (t->seqlen - 1) * t->stride_seq +
                           (t->heads - 1) * t->stride_head + t->head_dim;
    return (size_t)extent * fmha_dtype_size(t->dtype);
}

static void *upload(const void *host, size_t bytes)
{
    void *p = NULL;
    if (!host)
        return NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    TU_CHECK(e == cudaSuccess, "cudaMalloc: %s", cudaGetErrorString(e));
    if (bytes)
        cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice);
    return p;
}

/* tbwd_runner on the GPU: every buffer (poisoned gradients too) copied to
 * the device, the backward on a stream of its own, the gradients copied
 * back whatever the call returned. */
static fmha_status cuda_backward(const fmha_config *cfg, const fmha_backward_args *h)
{
    fmha_backward_args d = *h;
    const fmha_tensor *hv[8] = {&h->q, &h->k, &h->v, &h->out, &h->dout, &h->dq, &h->dk, &h->dv};
    fmha_tensor *dvw[8] = {&d.q, &d.k, &d.v, &d.out, &d.dout, &d.dq, &d.dk, &d.dv};
    for (int i = 0; i < 8; i++)
        dvw[i]->data = upload(hv[i]->data, view_bytes(hv[i]));
    const int64_t nlse =
        h->cu_seqlens_q ? h->q.heads * h->q.seqlen : h->q.batch * h->q.heads * h->q.seqlen;
    d.lse = upload(h->lse, sizeof(float) * (size_t)nlse);
    const size_t cu = sizeof(int32_t) * (size_t)(h->varlen_batch + 1);
    d.cu_seqlens_q = upload(h->cu_seqlens_q, cu);
    d.cu_seqlens_k = upload(h->cu_seqlens_k, cu);
    /* the score modifiers' arrays: devmem's copies of a forward's */
    fmha_forward_args mods = {.q = h->q,
                              .k = h->k,
                              .mask = h->mask,
                              .alibi_slopes = h->alibi_slopes,
                              .alibi_stride_batch = h->alibi_stride_batch,
                              .sinks = h->sinks};
    mods.q.data = mods.k.data = NULL;
    mods.cu_seqlens_q = h->cu_seqlens_q, mods.cu_seqlens_k = h->cu_seqlens_k;
    mods.varlen_batch = h->varlen_batch;
    dev_args dm;
    char err[256];
    TU_CHECK(dev_args_upload(&dm, &mods, FMHA_DEVICE_CUDA, err, sizeof err) == 0, "%s", err);
    d.mask.data = dm.a.mask.data;
    d.alibi_slopes = dm.a.alibi_slopes;
    d.sinks = dm.a.sinks;
    const size_t nsinks = sizeof(float) * (size_t)h->q.heads;
    d.dsinks = upload(h->dsinks, nsinks); /* poisoned by the case */
    d.stream = stream;
    fmha_status st = fmha_backward(cfg, &d);
    cudaError_t e = cudaStreamSynchronize(stream);
    TU_CHECK(e == cudaSuccess, "kernel failed: %s", cudaGetErrorString(e));
    for (int i = 5; i < 8; i++)
        if (hv[i]->data)
            cudaMemcpy(hv[i]->data, dvw[i]->data, view_bytes(hv[i]), cudaMemcpyDeviceToHost);
    if (h->dsinks)
        cudaMemcpy(h->dsinks, d.dsinks, nsinks, cudaMemcpyDeviceToHost);
    if (twice && st == FMHA_STATUS_OK) { /* again on re-poisoned gradients: the same bits */
        for (int i = 5; i < 8; i++)
            if (hv[i]->data)
                cudaMemset(dvw[i]->data, 0xFF, view_bytes(hv[i]));
        st = fmha_backward(cfg, &d);
        cudaStreamSynchronize(stream);
        for (int i = 5; i < 8; i++) {
            const size_t n = view_bytes(hv[i]);
            if (!hv[i]->data || !n)
                continue;
            char *again = malloc(n);
            cudaMemcpy(again, dvw[i]->data, n, cudaMemcpyDeviceToHost);
            TU_CHECK(!memcmp(again, hv[i]->data, n), "gradient %d differs between two runs", i - 5);
            free(again);
        }
        if (h->dsinks) {
            float *again = malloc(nsinks);
            cudaMemcpy(again, d.dsinks, nsinks, cudaMemcpyDeviceToHost);
            TU_CHECK(!memcmp(again, h->dsinks, nsinks), "dsinks differs between two runs");
            free(again);
        }
    }
    for (int i = 0; i < 8; i++)
        cudaFree(dvw[i]->data);
    dev_args_free(&dm);
    cudaFree(d.dsinks);
    cudaFree((void *)d.lse);
    cudaFree((void *)d.cu_seqlens_q);
    cudaFree((void *)d.cu_seqlens_k);
    return st;
}

/* Host pointers are refused before anything is written; the chooser names
 * the backward kernel. */
static void test_refusals(tu_rng *r)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 2, 1, 64);
    cfg.device = FMHA_DEVICE_CUDA;
    fmha_kernel_info info;
    TU_CHECK(fmha_kernel_select_backward(&cfg, &info) == FMHA_STATUS_OK &&
                 !strcmp(info.name, "cuda_flash_sm80_bwd"),
             "backward kernel: %s", fmha_last_error());
    tu_tensor q, k, v, out, dout, dq;
    tu_tensor_init(&q, FMHA_DTYPE_BF16, 1, 8, 2, 64, 0, 0);
    tu_tensor_init(&k, FMHA_DTYPE_BF16, 1, 8, 1, 64, 0, 0);
    tu_tensor_init(&v, FMHA_DTYPE_BF16, 1, 8, 1, 64, 0, 0);
    tu_tensor_init(&out, FMHA_DTYPE_BF16, 1, 8, 2, 64, 0, 0);
    tu_tensor_init(&dout, FMHA_DTYPE_BF16, 1, 8, 2, 64, 0, 0);
    tu_tensor_init(&dq, FMHA_DTYPE_BF16, 1, 8, 2, 64, 0, 0xFF);
    tu_fill_normal(&q, r, 1.0);
    float lse[16] = {0};
    fmha_backward_args a = {
        .q = q.t, .k = k.t, .v = v.t, .out = out.t, .dout = dout.t, .lse = lse, .dq = dq.t};
    fmha_status st = fmha_backward(&cfg, &a);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), "host memory") &&
                 tu_gaps_untouched(&dq, 0xFF) && isnan(tu_get(&dq, 0, 0, 0, 0)),
             "host pointers: %s", fmha_last_error());
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&dout);
    tu_tensor_free(&dq);
}

int main(int argc, char **argv)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    cudaStreamCreate(&stream);
    const char *env = getenv("FMHA_TEST_CASES");
    const int ncases = argc > 1 ? atoi(argv[1]) : env ? atoi(env) : 200;
    tu_rng rng = {20261206};
    const tcase_space space = {FMHA_DEVICE_CUDA, NULL, 0, 0};
    double worst = 0;
    for (int i = 0; i < ncases; i++) {
        fmha_dtype gdt;
        int lg, want;
        tcase c = tcase_backward_random(&rng, i, &space, &gdt, &lg, &want);
        twice = i % 16 == 0;
        worst = fmax(worst, tcase_backward_run(&c, gdt, lg, want, 1, cuda_backward, &rng));
    }
    /* Long sequences: several key and query blocks, GQA, causal and not; the
     * second with a mask, ALiBi slopes and sinks. */
    twice = 1;
    for (int i = 0; i < 4; i++) {
        tcase c = {.batch = 1,
                   .sq = i < 2 ? 1000 : 333,
                   .sk = i < 2 ? 1000 : 2100,
                   .heads = 4,
                   .kv = 2,
                   .d = i == 3 ? 256 : 128,
                   .dv = i == 3 ? 256 : 128,
                   .dt = i % 2 ? FMHA_DTYPE_F16 : FMHA_DTYPE_BF16,
                   .odt = FMHA_DTYPE_BF16,
                   .causal = i % 2 == 0,
                   .wl = -1,
                   .wr = -1,
                   .mask = i == 1 ? 2 : 0,
                   .mask_bcast = 3,
                   .alibi = i == 1,
                   .sinks = i == 1,
                   .device = FMHA_DEVICE_CUDA};
        worst = fmax(worst, tcase_backward_run(&c, c.dt, 0, 7, 1, cuda_backward, &rng));
    }
    printf("largest error / tolerance: %.3f\n", worst);
    test_refusals(&rng);
    cudaStreamDestroy(stream);
    return tu_summary();
}
