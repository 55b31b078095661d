/* test_sp_nccl.c — sequence parallelism over NCCL on one GPU (world size
 * 1, so every mode is degenerate: ulysses 1 x ring 1, contiguous and zigzag):
 * fmha_sp_forward on device memory against fmha_forward of the whole
 * sequence on the same GPU, for MHA, GQA, causal, a window, dropout and joint
 * tokens in front and at the rear, packed sequences (cu_seqlens, an empty and
 * a one-token one among them) against packed fmha_forward; out's gaps stay
 * poisoned. What it checks
 * is the NCCL communicator's plumbing (its stream, events and transfers to
 * itself) and the CUDA backend's merge and copies. Exits 77 (ctest:
 * skipped) where there is no CUDA device. */
#include "testutil.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>

static void *to_device(const tu_tensor *x)
{
    void *d = NULL;
    cudaMalloc(&d, x->alloc_bytes);
    cudaMemcpy(d, x->alloc, x->alloc_bytes, cudaMemcpyHostToDevice);
    return d;
}

static fmha_tensor on_device(const tu_tensor *x, void *d)
{
    fmha_tensor t = x->t;
    t.data = (char *)d + ((char *)x->t.data - (char *)x->alloc);
    return t;
}

typedef struct nccl_case {
    int64_t b, s, t, h, kv, d;
    int causal;
    int64_t wl, wr;
    double dropout;
    fmha_sp_joint joint;
    fmha_sp_layout layout;
} nccl_case;

static void run_case(const nccl_case *c, fmha_comm *comm, cudaStream_t stream, tu_rng *r)
{
    const fmha_dtype dt = FMHA_DTYPE_BF16;
    const int64_t T = c->joint ? c->t : 0, n = c->s + T;
    const int64_t img0 = c->joint == FMHA_SP_JOINT_FRONT ? T : 0;
    const int64_t text0 = c->joint == FMHA_SP_JOINT_REAR ? c->s : 0;
    fmha_config cfg;
    fmha_config_init(&cfg, c->h, c->kv, c->d);
    cfg.dtype = dt;
    cfg.device = FMHA_DEVICE_CUDA;
    cfg.causal = c->causal;
    cfg.window_left = c->wl;
    cfg.window_right = c->wr;
    cfg.dropout_p = c->dropout;
    /* The whole sequence, and its two parts as views of separate copies. */
    tu_tensor q, k, v, ow, parts[8];
    tu_tensor_init(&q, dt, c->b, n, c->h, c->d, 0, 0);
    tu_tensor_init(&k, dt, c->b, n, c->kv, c->d, 0, 0);
    tu_tensor_init(&v, dt, c->b, n, c->kv, c->d, 0, 0);
    tu_fill_normal(&q, r, 1.0), tu_fill_normal(&k, r, 1.0), tu_fill_normal(&v, r, 1.0);
    tu_tensor_init(&ow, FMHA_DTYPE_F32, c->b, n, c->h, c->d, 0, 0);
    const int64_t lens[2] = {c->s, T ? T : 1}, pos0[2] = {img0, text0};
    const int64_t heads[4] = {c->h, c->kv, c->kv, c->h};
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < 4; i++) {
            tu_tensor *x = &parts[p * 4 + i];
            tu_tensor_init(x, i == 3 ? FMHA_DTYPE_F32 : dt, c->b, lens[p], heads[i], c->d,
                           i == 3 ? 2 : 0, 0xE7);
            if (i < 3)
                for (int64_t bb = 0; bb < c->b; bb++)
                    for (int64_t s = 0; s < (p ? T : c->s); s++)
                        for (int64_t h = 0; h < heads[i]; h++)
                            for (int64_t e = 0; e < c->d; e++)
                                tu_set(x, bb, s, h, e,
                                       tu_get(i == 0   ? &q
                                              : i == 1 ? &k
                                                       : &v,
                                              bb, pos0[p] + s, h, e));
        }
    void *dq = to_device(&q), *dk = to_device(&k), *dv = to_device(&v), *dw = to_device(&ow);
    void *dp[8];
    for (int i = 0; i < 8; i++)
        dp[i] = to_device(&parts[i]);
    fmha_forward_args a = {0};
    a.q = on_device(&q, dq), a.k = on_device(&k, dk), a.v = on_device(&v, dv);
    a.out = on_device(&ow, dw);
    a.seed = 5, a.offset = 9, a.stream = stream;
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "whole: %s", fmha_last_error());
    fmha_sp_config sp;
    fmha_sp_config_init(&sp, 1, 1);
    sp.layout = c->layout;
    fmha_sp_args s;
    memset(&s, 0, sizeof s);
    s.q = on_device(&parts[0], dp[0]), s.k = on_device(&parts[1], dp[1]);
    s.v = on_device(&parts[2], dp[2]), s.out = on_device(&parts[3], dp[3]);
    s.seqlen = c->s, s.seed = 5, s.offset = 9;
    if (T) {
        s.joint = c->joint;
        s.q_joint = on_device(&parts[4], dp[4]), s.k_joint = on_device(&parts[5], dp[5]);
        s.v_joint = on_device(&parts[6], dp[6]), s.out_joint = on_device(&parts[7], dp[7]);
    }
    fmha_status st = fmha_sp_forward(&cfg, &sp, comm, &s);
    TU_CHECK(st == FMHA_STATUS_OK, "sp: %s", fmha_last_error());
    cudaError_t e = cudaStreamSynchronize(stream);
    TU_CHECK(e == cudaSuccess, "sp kernels: %s", cudaGetErrorString(e));
    cudaMemcpy(ow.alloc, dw, ow.alloc_bytes, cudaMemcpyDeviceToHost);
    double worst = 0;
    for (int p = 0; p < (T ? 2 : 1); p++) {
        tu_tensor *o = &parts[p * 4 + 3];
        cudaMemcpy(o->alloc, dp[p * 4 + 3], o->alloc_bytes, cudaMemcpyDeviceToHost);
        TU_CHECK(tu_gaps_untouched(o, 0xE7), "sp wrote outside out (part %d)", p);
        for (int64_t bb = 0; bb < c->b; bb++)
            for (int64_t i = 0; i < (p ? T : c->s); i++)
                for (int64_t h = 0; h < c->h; h++)
                    for (int64_t e2 = 0; e2 < c->d; e2++) {
                        const double x = tu_get(o, bb, i, h, e2);
                        const double y = tu_get(&ow, bb, pos0[p] + i, h, e2);
                        worst = isfinite(x) ? fmax(worst, fabs(x - y)) : INFINITY;
                    }
    }
    /* bf16 pieces merged in f32 against one bf16 call: the kernels' rounding. */
    TU_CHECK(worst <= 2e-2,
             "s=%lld t=%lld h=%lld kv=%lld causal=%d win=(%lld,%lld) drop=%g: "
             "sp differs from the whole by %.3g",
             (long long)c->s, (long long)T, (long long)c->h, (long long)c->kv, c->causal,
             (long long)c->wl, (long long)c->wr, c->dropout, worst);
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dw);
    for (int i = 0; i < 8; i++) {
        cudaFree(dp[i]);
        tu_tensor_free(&parts[i]);
    }
    tu_tensor_free(&q), tu_tensor_free(&k), tu_tensor_free(&v), tu_tensor_free(&ow);
}

/* Packed sequences: the one rank holds every token, sequence by sequence,
 * as the packed whole does; fmha_sp_forward (host cu_seqlens) against packed
 * fmha_forward (device cu_seqlens), out and LSE. */
static void run_packed(fmha_sp_layout layout, int causal, fmha_comm *comm, cudaStream_t stream,
                       tu_rng *r)
{
    const fmha_dtype dt = FMHA_DTYPE_BF16;
    const int32_t cu[5] = {0, 300, 300, 301, 818};
    const int64_t nseq = 4, n = cu[nseq], h = 8, kv = 2, d = 128;
    fmha_config cfg;
    fmha_config_init(&cfg, h, kv, d);
    cfg.dtype = dt;
    cfg.device = FMHA_DEVICE_CUDA;
    cfg.causal = causal;
    tu_tensor q, k, v, ow, os;
    tu_tensor_init(&q, dt, 1, n, h, d, 0, 0);
    tu_tensor_init(&k, dt, 1, n, kv, d, 0, 0);
    tu_tensor_init(&v, dt, 1, n, kv, d, 0, 0);
    tu_fill_normal(&q, r, 1.0), tu_fill_normal(&k, r, 1.0), tu_fill_normal(&v, r, 1.0);
    tu_tensor_init(&ow, FMHA_DTYPE_F32, 1, n, h, d, 0, 0);
    tu_tensor_init(&os, FMHA_DTYPE_F32, 1, n, h, d, 2, 0xE7);
    void *dq = to_device(&q), *dk = to_device(&k), *dv = to_device(&v), *dw = to_device(&ow);
    void *ds = to_device(&os), *dcu = NULL, *lw = NULL, *ls = NULL;
    const size_t lse_bytes = sizeof(float) * (size_t)(h * n);
    cudaMalloc(&dcu, sizeof cu);
    cudaMemcpy(dcu, cu, sizeof cu, cudaMemcpyHostToDevice);
    cudaMalloc(&lw, lse_bytes);
    cudaMalloc(&ls, lse_bytes);
    fmha_forward_args a = {0};
    a.q = on_device(&q, dq), a.k = on_device(&k, dk), a.v = on_device(&v, dv);
    a.out = on_device(&ow, dw);
    a.lse = lw;
    a.cu_seqlens_q = a.cu_seqlens_k = dcu;
    a.varlen_batch = nseq;
    a.max_seqlen_q = a.max_seqlen_k = 517;
    a.stream = stream;
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "packed whole: %s", fmha_last_error());
    fmha_sp_config sp;
    fmha_sp_config_init(&sp, 1, 1);
    sp.layout = layout;
    fmha_sp_args s;
    memset(&s, 0, sizeof s);
    s.q = a.q, s.k = a.k, s.v = a.v, s.out = on_device(&os, ds);
    s.lse = ls;
    s.seqlen = n;
    s.cu_seqlens = cu;
    s.varlen_batch = nseq;
    fmha_status st = fmha_sp_forward(&cfg, &sp, comm, &s);
    TU_CHECK(st == FMHA_STATUS_OK, "packed sp: %s", fmha_last_error());
    cudaError_t e = cudaStreamSynchronize(stream);
    TU_CHECK(e == cudaSuccess, "packed sp kernels: %s", cudaGetErrorString(e));
    float *lse_w = malloc(lse_bytes), *lse_s = malloc(lse_bytes);
    cudaMemcpy(ow.alloc, dw, ow.alloc_bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(os.alloc, ds, os.alloc_bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(lse_w, lw, lse_bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(lse_s, ls, lse_bytes, cudaMemcpyDeviceToHost);
    TU_CHECK(tu_gaps_untouched(&os, 0xE7), "packed sp wrote outside out");
    double worst = 0, worst_lse = 0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t hh = 0; hh < h; hh++) {
            for (int64_t e2 = 0; e2 < d; e2++) {
                const double x = tu_get(&os, 0, i, hh, e2), y = tu_get(&ow, 0, i, hh, e2);
                worst = isfinite(x) ? fmax(worst, fabs(x - y)) : INFINITY;
            }
            const double x = lse_s[hh * n + i], y = lse_w[hh * n + i];
            worst_lse = isfinite(x) ? fmax(worst_lse, fabs(x - y)) : INFINITY;
        }
    TU_CHECK(worst <= 2e-2 && worst_lse <= 1e-3,
             "packed causal=%d layout=%d: sp differs from the whole by %.3g (lse %.3g)", causal,
             (int)layout, worst, worst_lse);
    free(lse_w), free(lse_s);
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dw), cudaFree(ds), cudaFree(dcu);
    cudaFree(lw), cudaFree(ls);
    tu_tensor_free(&q), tu_tensor_free(&k), tu_tensor_free(&v), tu_tensor_free(&ow);
    tu_tensor_free(&os);
}

int main(void)
{
    if (!tu_cuda_begin())
        return 77;
    if (!fmha_comm_built(FMHA_COMM_NCCL)) {
        printf("this fmha has no NCCL communicator\n");
        return 77;
    }
    ncclComm_t nc;
    int dev = 0;
    if (ncclCommInitAll(&nc, 1, &dev) != ncclSuccess) {
        printf("ncclCommInitAll failed\n");
        return 1;
    }
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    fmha_comm *comm;
    TU_CHECK(fmha_comm_init(&comm, FMHA_COMM_NCCL, &nc, stream) == FMHA_STATUS_OK, "comm: %s",
             fmha_last_error());
    TU_CHECK(fmha_comm_rank(comm) == 0 && fmha_comm_size(comm) == 1, "rank/size");
    const nccl_case cases[] = {
        {1, 1000, 0, 8, 8, 128, 0, -1, -1, 0, FMHA_SP_JOINT_NONE, FMHA_SP_LAYOUT_CONTIGUOUS},
        {2, 777, 0, 8, 2, 64, 1, -1, -1, 0, FMHA_SP_JOINT_NONE, FMHA_SP_LAYOUT_ZIGZAG},
        {1, 513, 0, 4, 4, 128, 0, 100, 30, 0, FMHA_SP_JOINT_NONE, FMHA_SP_LAYOUT_CONTIGUOUS},
        {1, 400, 0, 4, 4, 64, 0, -1, -1, 0.2, FMHA_SP_JOINT_NONE, FMHA_SP_LAYOUT_CONTIGUOUS},
        {1, 1024, 77, 8, 8, 128, 0, -1, -1, 0, FMHA_SP_JOINT_FRONT, FMHA_SP_LAYOUT_CONTIGUOUS},
        {1, 999, 64, 4, 4, 128, 0, -1, -1, 0, FMHA_SP_JOINT_REAR, FMHA_SP_LAYOUT_ZIGZAG},
    };
    tu_rng r = {77};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i], comm, stream, &r);
    run_packed(FMHA_SP_LAYOUT_CONTIGUOUS, 0, comm, stream, &r);
    run_packed(FMHA_SP_LAYOUT_ZIGZAG, 1, comm, stream, &r);
    fmha_comm_free(comm);
    ncclCommDestroy(nc);
    cudaStreamDestroy(stream);
    return tu_summary();
}
