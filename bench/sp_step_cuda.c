/* sp_step_cuda.c — one ring step of sequence parallelism on one GPU, in its
 * two parts: the piece (fmha_forward of a rank's n query tokens against one
 * K/V block of n tokens, f32 out and LSE, as fmha_sp_forward runs it) and the
 * merge of that partial into the running result (fmha_merge_partials_cuda of
 * two f32 parts, in place), timed apart with CUDA events. The merge's share
 * is what fusing it into the kernel could save; the cost model
 * (docs/sequence_parallel.md) predicts it as m = 3 x n x H x D x 4 bytes over
 * the HBM bandwidth, printed beside for a bandwidth of `hbm` TB/s.
 *
 *     build/sp_step_cuda [hbm_tb_s [iters]]        (default 3.35 20)
 *
 * Rows: the Wan 2.1 14B 720p (75,600 tokens, 40 heads) and HunyuanVideo 720p
 * (118,800 + 256 tokens, 24 heads) ring steps at r = 2, 4 and 8, bf16, d 128. */
#include "fmha.h"

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int fail(const char *what, fmha_status st)
{
    fprintf(stderr, "sp_step_cuda: %s: %s (%s)\n", what, fmha_last_error(),
            fmha_status_string(st));
    return 1;
}

int main(int argc, char **argv)
{
    const double hbm = argc > 1 ? atof(argv[1]) : 3.35;
    const int iters = argc > 2 ? atoi(argv[2]) : 20;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "sp_step_cuda: no CUDA device\n");
        return 1;
    }
    struct {
        const char *name;
        int64_t s, h;
    } shapes[] = {{"wan2.1-14b-720p", 75600, 40}, {"hunyuanvideo-720p", 119056, 24}};
    const int64_t D = 128;
    printf("| shape | ring r | tokens per rank n | piece ms | merge ms | merge / piece | model m ms "
           "(%.2f TB/s) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
           hbm);
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    cudaEvent_t e0, e1, e2;
    cudaEventCreate(&e0), cudaEventCreate(&e1), cudaEventCreate(&e2);
    for (int si = 0; si < 2; si++)
        for (int r = 2; r <= 8; r *= 2) {
            const int64_t n = shapes[si].s / r, H = shapes[si].h;
            const size_t el = (size_t)(n * H * D);
            void *q, *k, *v, *acc, *tmp;
            float *acc_lse, *tmp_lse;
            if (cudaMalloc(&q, el * 2) || cudaMalloc(&k, el * 2) || cudaMalloc(&v, el * 2) ||
                cudaMalloc(&acc, el * 4) || cudaMalloc(&tmp, el * 4) ||
                cudaMalloc((void **)&acc_lse, (size_t)(H * n) * 4) ||
                cudaMalloc((void **)&tmp_lse, (size_t)(H * n) * 4)) {
                fprintf(stderr, "sp_step_cuda: out of device memory\n");
                return 1;
            }
            /* Every element bf16 0x3c3c (0.0115): finite scores; values do not change the time. */
            cudaMemset(q, 0x3c, el * 2), cudaMemset(k, 0x3c, el * 2), cudaMemset(v, 0x3c, el * 2);
            cudaMemset(acc, 0, el * 4), cudaMemset(acc_lse, 0, (size_t)(H * n) * 4);
            fmha_config cfg;
            fmha_config_init(&cfg, H, H, D);
            cfg.dtype = FMHA_DTYPE_BF16;
            cfg.device = FMHA_DEVICE_CUDA;
            fmha_layer *layer;
            fmha_status st = fmha_layer_init(&layer, &cfg);
            if (st != FMHA_STATUS_OK)
                return fail("layer", st);
            fmha_forward_args a = {0};
            a.q = fmha_tensor_bshd(q, FMHA_DTYPE_BF16, 1, n, H, D);
            a.k = fmha_tensor_bshd(k, FMHA_DTYPE_BF16, 1, n, H, D);
            a.v = fmha_tensor_bshd(v, FMHA_DTYPE_BF16, 1, n, H, D);
            a.out = fmha_tensor_bshd(tmp, FMHA_DTYPE_F32, 1, n, H, D);
            a.lse = tmp_lse;
            a.stream = stream;
            fmha_tensor parts[2] = {fmha_tensor_bshd(acc, FMHA_DTYPE_F32, 1, n, H, D), a.out};
            const float *lses[2] = {acc_lse, tmp_lse};
            double tp[64], tm[64];
            const int runs = iters < 64 ? iters : 64;
            for (int it = -2; it < runs; it++) { /* two warm-up rounds */
                cudaEventRecord(e0, stream);
                if ((st = fmha_layer_forward(layer, &a)) != FMHA_STATUS_OK)
                    return fail("piece", st);
                cudaEventRecord(e1, stream);
                st = fmha_merge_partials_cuda(2, parts, lses, &parts[0], acc_lse, stream);
                if (st != FMHA_STATUS_OK)
                    return fail("merge", st);
                cudaEventRecord(e2, stream);
                cudaEventSynchronize(e2);
                float p_ms, m_ms;
                cudaEventElapsedTime(&p_ms, e0, e1);
                cudaEventElapsedTime(&m_ms, e1, e2);
                if (it >= 0)
                    tp[it] = p_ms, tm[it] = m_ms;
            }
            qsort(tp, (size_t)runs, sizeof tp[0], cmp);
            qsort(tm, (size_t)runs, sizeof tm[0], cmp);
            const double p = tp[runs / 2], m = tm[runs / 2];
            const double model = 3.0 * (double)el * 4.0 / (hbm * 1e12) * 1e3;
            printf("| %s | %d | %lld | %.3f | %.3f | %.1f%% | %.3f |\n", shapes[si].name, r,
                   (long long)n, p, m, 100.0 * m / p, model);
            fmha_layer_free(layer);
            cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(acc), cudaFree(tmp);
            cudaFree(acc_lse), cudaFree(tmp_lse);
        }
    cudaStreamDestroy(stream);
    return 0;
}
