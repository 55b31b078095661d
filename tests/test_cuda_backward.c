/* test_cuda_backward.c — the CUDA backward against the float64 reference on
 * the shared random cases (cases.c: odd seqlens, seqlen_q != seqlen_k, GQA,
 * MQA, head dims up to 256, head_dim_v != head_dim, every layout, mask,
 * softcap, dropout, varlen), f16/bf16 inputs, dout and gradients of any
 * dtype, gradients poisoned on the device first. The tolerance is set by a
 * naive backward whose dO, P and dS are rounded to the inputs' dtype before
 * their products (tu_naive_backward), as a tensor-core kernel rounds them.
 * out and lse come from the CPU forward on the same inputs. Also: bits equal
 * run to run, a layer's backward after its CUDA forward, host pointers
 * refused with nothing written. Exits 77 (ctest: skipped) without a device.
 * FMHA_TEST_CASES sets the number of random cases. */
#include "cases.h"
#include "testutil.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static cudaStream_t stream;

/* A device copy of a host tensor's whole allocation (gaps and poison too). */
typedef struct dev_tensor {
    void *mem;
    fmha_tensor t;
} dev_tensor;

static dev_tensor dev_copy(const tu_tensor *x)
{
    dev_tensor d = {NULL, x->t};
    cudaError_t e = cudaMalloc(&d.mem, x->alloc_bytes ? x->alloc_bytes : 1);
    TU_CHECK(e == cudaSuccess, "cudaMalloc: %s", cudaGetErrorString(e));
    if (x->alloc_bytes)
        cudaMemcpy(d.mem, x->alloc, x->alloc_bytes, cudaMemcpyHostToDevice);
    d.t.data = (char *)d.mem + ((char *)x->t.data - (char *)x->alloc);
    return d;
}

static void dev_back(const dev_tensor *d, tu_tensor *x)
{
    if (x->alloc_bytes)
        cudaMemcpy(x->alloc, d->mem, x->alloc_bytes, cudaMemcpyDeviceToHost);
}

static void *dev_bytes(const void *host, size_t n)
{
    void *p = NULL;
    if (!host)
        return NULL;
    cudaMalloc(&p, n ? n : 1);
    cudaMemcpy(p, host, n, cudaMemcpyHostToDevice);
    return p;
}

static double max_abs(const tu_tensor *x)
{
    double m = 0;
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++)
                    m = fmax(m, fabs(tu_get(x, b, s, h, c)));
    return m;
}

static fmha_config case_config(const tcase *c, fmha_device dev)
{
    fmha_config cfg;
    fmha_config_init(&cfg, c->heads, c->kv, c->d);
    cfg.head_dim_v = c->dv;
    cfg.dtype = c->dt;
    cfg.causal = c->causal;
    cfg.window_left = c->wl;
    cfg.window_right = c->wr;
    cfg.softcap = c->softcap;
    cfg.dropout_p = c->dropout;
    cfg.softmax_scale = c->scale;
    cfg.device = dev;
    return cfg;
}

/* One case: want bit 0 dq, 1 dk, 2 dv; `twice` runs the backward again and
 * asks for the same bits. Returns the largest ratio error / tolerance. */
static double run_case(const tcase *c, fmha_dtype gdt, int lg, int want, int twice, tu_rng *rng)
{
    char desc[512];
    snprintf(desc, sizeof desc,
             "b=%lld sq=%lld sk=%lld h=%lld kv=%lld d=%lld dv=%lld dt=%s out=%s grad=%s "
             "layouts=%d%d%d%d causal=%d win=(%lld,%lld) softcap=%g drop=%g varlen=%d want=%d",
             (long long)c->batch, (long long)c->sq, (long long)c->sk, (long long)c->heads,
             (long long)c->kv, (long long)c->d, (long long)c->dv, fmha_dtype_name(c->dt),
             fmha_dtype_name(c->odt), fmha_dtype_name(gdt), c->lq, c->lkv, c->lo, lg, c->causal,
             (long long)c->wl, (long long)c->wr, c->softcap, c->dropout, c->varlen, want);
    int32_t *cuq = NULL, *cuk = NULL;
    int64_t tb = c->batch, tq = c->sq, tk = c->sk;
    if (c->varlen) { /* random lengths, zeros included, and a tail of tokens in no sequence */
        cuq = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
        cuk = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
        cuq[0] = cuk[0] = 0;
        for (int64_t b = 0; b < c->batch; b++) {
            cuq[b + 1] = cuq[b] + (int32_t)tu_range(rng, c->sq + 1);
            cuk[b + 1] = cuk[b] + (int32_t)tu_range(rng, c->sk + 1);
        }
        tb = 1;
        tq = cuq[c->batch] + 2;
        tk = cuk[c->batch] + 1;
    }
    tu_tensor q, k, v, out, dout, g[3], ref[3], naive[3];
    tu_tensor_init(&q, c->dt, tb, tq, c->heads, c->d, c->lq, 0xA5);
    tu_tensor_init(&k, c->dt, tb, tk, c->kv, c->d, c->lkv, 0xA5);
    tu_tensor_init(&v, c->dt, tb, tk, c->kv, c->dv, c->lkv, 0xA5);
    tu_tensor_init(&out, c->odt, tb, tq, c->heads, c->dv, c->lo, 0);
    tu_tensor_init(&dout, gdt, tb, tq, c->heads, c->dv, c->lo, 0xA5);
    tu_fill_normal(&q, rng, 1.0);
    tu_fill_normal(&k, rng, 1.0);
    tu_fill_normal(&v, rng, 1.0);
    tu_fill_normal(&dout, rng, 1.0);
    const tu_tensor *in[3] = {&q, &k, &v};
    for (int i = 0; i < 3; i++) {
        const fmha_tensor *t = &in[i]->t;
        tu_tensor_init(&g[i], gdt, t->batch, t->seqlen, t->heads, t->head_dim, lg, 0xFF);
        tu_tensor_init(&ref[i], FMHA_DTYPE_F32, t->batch, t->seqlen, t->heads, t->head_dim, 0,
                       0xFF);
        tu_tensor_init(&naive[i], gdt, t->batch, t->seqlen, t->heads, t->head_dim, 0, 0xFF);
    }
    const size_t nlse = (size_t)(c->heads * tq * tb);
    float *lse = malloc(sizeof(float) * nlse);

    fmha_config cpu = case_config(c, FMHA_DEVICE_CPU), cfg = case_config(c, FMHA_DEVICE_CUDA);
    fmha_forward_args fa = {.q = q.t, .k = k.t, .v = v.t, .out = out.t, .lse = lse};
    fa.cu_seqlens_q = cuq;
    fa.cu_seqlens_k = cuk;
    fa.varlen_batch = c->varlen ? c->batch : 0;
    fa.seed = tu_next(rng);
    fa.offset = tu_next(rng);
    fmha_status st = fmha_forward(&cpu, &fa);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: CPU forward: %s", desc, fmha_last_error());

    fmha_backward_args ba = {
        .q = q.t, .k = k.t, .v = v.t, .out = out.t, .dout = dout.t, .lse = lse};
    ba.cu_seqlens_q = cuq;
    ba.cu_seqlens_k = cuk;
    ba.varlen_batch = fa.varlen_batch;
    ba.seed = fa.seed;
    ba.offset = fa.offset;

    /* The same call on device copies. */
    dev_tensor dq_ = dev_copy(&q), dk_ = dev_copy(&k), dv_ = dev_copy(&v), dout_ = dev_copy(&out),
               ddo = dev_copy(&dout), dg[3];
    fmha_backward_args da = ba;
    da.q = dq_.t, da.k = dk_.t, da.v = dv_.t, da.out = dout_.t, da.dout = ddo.t;
    da.lse = dev_bytes(lse, sizeof(float) * nlse);
    const size_t cu_bytes = sizeof(int32_t) * (size_t)(c->batch + 1);
    da.cu_seqlens_q = dev_bytes(cuq, cu_bytes);
    da.cu_seqlens_k = dev_bytes(cuk, cu_bytes);
    da.stream = stream;
    fmha_tensor *gt[3] = {&da.dq, &da.dk, &da.dv};
    for (int i = 0; i < 3; i++) {
        dg[i] = dev_copy(&g[i]);
        *gt[i] = want >> i & 1 ? dg[i].t : (fmha_tensor){0};
    }
    st = fmha_backward(&cfg, &da);
    cudaError_t e = cudaStreamSynchronize(stream);
    TU_CHECK(e == cudaSuccess, "%s: kernel failed: %s", desc, cudaGetErrorString(e));
    TU_CHECK(st == FMHA_STATUS_OK, "%s: CUDA backward: %s", desc, fmha_last_error());
    for (int i = 0; i < 3; i++)
        dev_back(&dg[i], &g[i]);
    if (twice && st == FMHA_STATUS_OK) { /* the same bits again */
        tu_tensor again[3];
        for (int i = 0; i < 3; i++) {
            const fmha_tensor *t = &g[i].t;
            tu_tensor_init(&again[i], gdt, t->batch, t->seqlen, t->heads, t->head_dim, lg, 0xFF);
            cudaMemcpy(dg[i].mem, again[i].alloc, again[i].alloc_bytes, cudaMemcpyHostToDevice);
        }
        st = fmha_backward(&cfg, &da);
        cudaStreamSynchronize(stream);
        for (int i = 0; i < 3; i++) {
            dev_back(&dg[i], &again[i]);
            TU_CHECK(!memcmp(again[i].alloc, g[i].alloc, g[i].alloc_bytes),
                     "%s: gradient %d differs between two runs", desc, i);
            tu_tensor_free(&again[i]);
        }
    }

    fmha_backward_args rb = ba, nb = ba;
    fmha_tensor *rt[3] = {&rb.dq, &rb.dk, &rb.dv}, *nt[3] = {&nb.dq, &nb.dk, &nb.dv};
    for (int i = 0; i < 3; i++) {
        *rt[i] = ref[i].t;
        *nt[i] = naive[i].t;
    }
    cpu.num_threads = 0;
    TU_CHECK(fmha_reference_backward(&cpu, &rb) == FMHA_STATUS_OK, "%s: reference: %s", desc,
             fmha_last_error());
    tu_naive_backward(&cpu, &nb, 1);

    double worst = 0;
    const char *names[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3 && st == FMHA_STATUS_OK; i++) {
        if (!(want >> i & 1)) {
            TU_CHECK(tu_gaps_untouched(&g[i], 0xFF) && isnan(tu_get(&g[i], 0, 0, 0, 0)),
                     "%s: %s was not wanted but written", desc, names[i]);
            continue;
        }
        int bad = 0, nbad = 0;
        const double err = tu_max_err(&g[i], &ref[i], &bad);
        const double en = tu_max_err(&naive[i], &ref[i], &nbad);
        const double tol = 2.0 * en + 1e-5 + 1e-6 * max_abs(&ref[i]);
        worst = fmax(worst, err / tol);
        if (getenv("FMHA_TEST_VERBOSE"))
            printf("%s: %s error %.3g naive %.3g tol %.3g\n", desc, names[i], err, en, tol);
        TU_CHECK(!bad && !nbad && err <= tol, "%s: %s error %.3g > tol %.3g (naive %.3g)%s", desc,
                 names[i], err, tol, en, bad || nbad ? " non-finite" : "");
        TU_CHECK(tu_gaps_untouched(&g[i], 0xFF), "%s: wrote outside the %s view", desc, names[i]);
    }
    dev_tensor *all[] = {&dq_, &dk_, &dv_, &dout_, &ddo, &dg[0], &dg[1], &dg[2]};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        cudaFree(all[i]->mem);
    cudaFree((void *)da.lse);
    cudaFree((void *)da.cu_seqlens_q);
    cudaFree((void *)da.cu_seqlens_k);
    for (int i = 0; i < 3; i++) {
        tu_tensor_free(&g[i]);
        tu_tensor_free(&ref[i]);
        tu_tensor_free(&naive[i]);
    }
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&dout);
    free(lse);
    free(cuq);
    free(cuk);
    return worst;
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
    static const fmha_dtype dts[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    double worst = 0;
    for (int i = 0; i < ncases; i++) {
        tcase c = tcase_random(&rng, i, &space);
        const fmha_dtype gdt = tu_range(&rng, 2) ? c.dt : dts[tu_range(&rng, 3)];
        int lg = (int)tu_range(&rng, 3);
        if (c.varlen && lg == 1)
            lg = 0;
        const int want = tu_range(&rng, 5) == 0 ? 1 + (int)tu_range(&rng, 6) : 7;
        worst = fmax(worst, run_case(&c, gdt, lg, want, i % 16 == 0, &rng));
    }
    /* Long sequences: several key and query blocks, GQA, causal and not. */
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
                   .device = FMHA_DEVICE_CUDA};
        worst = fmax(worst, run_case(&c, c.dt, 0, 7, 1, &rng));
    }
    printf("largest error / tolerance: %.3f\n", worst);
    test_refusals(&rng);
    cudaStreamDestroy(stream);
    return tu_summary();
}
