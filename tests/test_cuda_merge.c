/* test_cuda_merge.c — fmha_merge_partials_cuda against the CPU's
 * fmha_merge_partials on the same parts: every dtype and layout, -inf parts
 * holding NaN (never read), NaN and +inf LSEs, in place, out's gaps
 * untouched; host memory refused. Exits 77 (ctest: skipped) where there is
 * no CUDA device. */
#include "testutil.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void *upload(const void *host, size_t bytes)
{
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes);
        exit(1);
    }
    cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice);
    return d;
}

static void run_case(tu_rng *r, int index, cudaStream_t stream)
{
    const int64_t sizes[] = {1, 7, 113, 239, 65};
    const int64_t b = 1 + tu_range(r, 2), s = sizes[tu_range(r, 5)], h = 1 + tu_range(r, 3);
    const int64_t d = index % 3 == 0 ? 128 : 1 + tu_range(r, 100);
    const int n = 1 + (int)tu_range(r, 32), in_place = index % 4 == 3;
    const fmha_dtype dts[3] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    const fmha_dtype in = in_place ? FMHA_DTYPE_F32 : dts[tu_range(r, 3)];
    const fmha_dtype odt = in_place ? in : dts[tu_range(r, 3)];
    const int64_t nl = b * h * s;
    tu_tensor *pt = calloc((size_t)n, sizeof *pt);
    fmha_tensor *hp = calloc((size_t)n, sizeof *hp), *dp = calloc((size_t)n, sizeof *dp);
    float **hl = calloc((size_t)n, sizeof *hl), **dl = calloc((size_t)n, sizeof *dl);
    for (int i = 0; i < n; i++) {
        tu_tensor_init(&pt[i], in, b, s, h, d, (int)tu_range(r, 3), 0);
        tu_fill_normal(&pt[i], r, 1.0);
        hl[i] = malloc(sizeof(float) * nl);
        for (int64_t e = 0; e < nl; e++) {
            const double u = tu_uniform(r);
            hl[i][e] = u < 0.2 ? -INFINITY : u > 0.999 ? NAN : (float)(50 * (u - 0.5));
            if (hl[i][e] == -INFINITY) /* never read */
                for (int64_t c = 0; c < d; c++)
                    tu_set(&pt[i], e / (h * s), e % s, e / s % h, c, NAN);
        }
    }
    for (int i = 0; i < n; i++) {
        hp[i] = pt[i].t;
        dp[i] = pt[i].t;
        dp[i].data = upload(pt[i].alloc, pt[i].alloc_bytes);
        dl[i] = upload(hl[i], sizeof(float) * nl);
    }
    const unsigned char poison = 0x5A;
    tu_tensor want, got;
    tu_tensor_init(&want, odt, b, s, h, d, 2, poison);
    tu_tensor_init(&got, odt, b, s, h, d, 2, poison);
    float *want_lse = malloc(sizeof(float) * nl), *got_lse = malloc(sizeof(float) * nl);
    fmha_tensor *hout = in_place ? &hp[0] : &want.t;
    TU_CHECK(fmha_merge_partials(n, hp, (const float *const *)hl, hout, want_lse) == FMHA_STATUS_OK,
             "cpu merge: %s", fmha_last_error());
    fmha_tensor dout = got.t;
    if (!in_place)
        dout.data = upload(got.alloc, got.alloc_bytes);
    float *dlse = upload(got_lse, sizeof(float) * nl);
    fmha_status st = fmha_merge_partials_cuda(n, dp, (const float *const *)dl,
                                              in_place ? &dp[0] : &dout, dlse, stream);
    TU_CHECK(st == FMHA_STATUS_OK, "cuda merge: %s", fmha_last_error());
    cudaError_t e = cudaStreamSynchronize(stream);
    TU_CHECK(e == cudaSuccess, "merge kernel failed: %s", cudaGetErrorString(e));
    tu_tensor *gt = in_place ? &pt[0] : &got; /* the host copy of what the GPU wrote */
    cudaMemcpy(in_place ? pt[0].alloc : got.alloc, in_place ? dp[0].data : dout.data,
               in_place ? pt[0].alloc_bytes : got.alloc_bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(got_lse, dlse, sizeof(float) * nl, cudaMemcpyDeviceToHost);
    /* In place, the CPU merged the host parts: hp[0] holds the CPU's answer. */
    const tu_tensor *wt = in_place ? NULL : &want;
    double worst = 0;
    int mismatch = 0;
    for (int64_t bb = 0; bb < b; bb++)
        for (int64_t ss = 0; ss < s; ss++)
            for (int64_t hh = 0; hh < h; hh++) {
                const int64_t le = (bb * h + hh) * s + ss;
                const float wl = want_lse[le], gl = got_lse[le];
                if (isnan(wl) != isnan(gl) || (isinf(wl) && wl != gl) ||
                    (isfinite(wl) && fabsf(wl - gl) > 1e-5f * fmaxf(1.0f, fabsf(wl))))
                    mismatch = 1;
                for (int64_t c = 0; c < d; c++) {
                    const double x = tu_get(gt, bb, ss, hh, c);
                    const double y = wt ? tu_get(wt, bb, ss, hh, c) : x;
                    if (isnan(x) != isnan(y))
                        mismatch = 1;
                    else if (!isnan(x))
                        worst = fmax(worst, fabs(x - y) / fmax(1.0, fabs(y)));
                }
            }
    const double tol = odt == FMHA_DTYPE_F32 ? 4e-6 : odt == FMHA_DTYPE_F16 ? 1e-3 : 8e-3;
    TU_CHECK(!mismatch && worst <= tol,
             "case %d: parts=%d %s->%s d=%lld%s: GPU differs from CPU by %.3g%s", index, n,
             fmha_dtype_name(in), fmha_dtype_name(odt), (long long)d, in_place ? " in place" : "",
             worst, mismatch ? " (NaN or LSE mismatch)" : "");
    if (!in_place)
        TU_CHECK(tu_gaps_untouched(&got, poison), "case %d: GPU merge wrote outside out", index);
    for (int i = 0; i < n; i++) {
        cudaFree(dp[i].data);
        cudaFree(dl[i]);
        tu_tensor_free(&pt[i]);
        free(hl[i]);
    }
    if (!in_place)
        cudaFree(dout.data);
    cudaFree(dlse);
    tu_tensor_free(&want), tu_tensor_free(&got);
    free(pt), free(hp), free(dp), free(hl), free(dl), free(want_lse), free(got_lse);
}

static void test_host_memory_refused(void)
{
    tu_tensor p, o;
    tu_tensor_init(&p, FMHA_DTYPE_F32, 1, 4, 1, 8, 0, 0);
    tu_tensor_init(&o, FMHA_DTYPE_F32, 1, 4, 1, 8, 0, 0);
    float l[4] = {0};
    const float *lses[1] = {l};
    fmha_status st = fmha_merge_partials_cuda(1, &p.t, lses, &o.t, NULL, NULL);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), "host memory"),
             "host memory: %s %s", fmha_status_string(st), fmha_last_error());
    tu_tensor_free(&p), tu_tensor_free(&o);
}

int main(void)
{
    if (!tu_cuda_begin())
        return 77;
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    tu_rng r = {2626};
    const char *env = getenv("FMHA_TEST_CASES");
    const int cases = env ? atoi(env) : 80;
    for (int i = 0; i < cases; i++)
        run_case(&r, i, stream);
    test_host_memory_refused();
    cudaStreamDestroy(stream);
    return tu_summary();
}
