/* test_cuda_fp8.c — fmha_quantize_fp8_cuda against the CPU quantizer, bit for
 * bit: every scale and every byte of y's allocation (its gaps too, all poisoned
 * first) over random shapes, layouts, alignments, dtypes and scalings; values
 * at rounding ties, in E4M3's subnormal range, huge and tiny (scales beyond
 * the fast division), NaN, all-zero and all-NaN groups; the infinity policy;
 * argument errors. Exits 77 (ctest: skipped) where there is no CUDA device. */
#include "internal.h"
#include "testutil.h"

#include <cuda_runtime_api.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

enum { POISON = 0xA5 };

static cudaStream_t stream;

static void cuda_ok(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

static int64_t n_groups(const fmha_tensor *t, fmha_fp8_scaling sc, int64_t br)
{
    if (sc == FMHA_FP8_PER_TENSOR)
        return 1;
    return t->batch * t->heads * (sc == FMHA_FP8_PER_BLOCK ? (t->seqlen + br - 1) / br : 1);
}

static void set_x(tu_tensor *x, int64_t b, int64_t s, int64_t h, int64_t c, float v)
{
    fmha_store_f32(fmha_row(&x->t, b, s, h), x->t.dtype, c, v);
}

/* One quantization on the GPU: x's whole allocation is copied to the device
 * `xoff` elements past a 256-byte aligned start, y's (poisoned) `yoff` bytes
 * past one, so that odd offsets take the element-wise path. y and scales
 * come back into the host buffers. */
static fmha_status run_gpu(const tu_tensor *x, int64_t xoff, tu_tensor *y, int64_t yoff,
                           float *scales, int64_t nscales, fmha_fp8_scaling sc, int64_t br)
{
    const size_t es = fmha_dtype_size(x->t.dtype), sbytes = (size_t)nscales * sizeof(float);
    char *dx, *dy;
    float *ds;
    cuda_ok(cudaMalloc((void **)&dx, x->alloc_bytes + 64), "cudaMalloc x");
    cuda_ok(cudaMalloc((void **)&dy, y->alloc_bytes + 64), "cudaMalloc y");
    cuda_ok(cudaMalloc((void **)&ds, sbytes), "cudaMalloc scales");
    cuda_ok(cudaMemcpy(dx + xoff * es, x->alloc, x->alloc_bytes, cudaMemcpyHostToDevice), "copy x");
    cuda_ok(cudaMemcpy(dy + yoff, y->alloc, y->alloc_bytes, cudaMemcpyHostToDevice), "copy y");
    cuda_ok(cudaMemcpy(ds, scales, sbytes, cudaMemcpyHostToDevice), "copy scales");
    fmha_tensor xt = x->t, yt = y->t;
    xt.data = dx + xoff * es;
    yt.data = dy + yoff;
    fmha_status st = fmha_quantize_fp8_cuda(&xt, &yt, ds, sc, br, stream);
    cuda_ok(cudaStreamSynchronize(stream), "the quantizer kernel");
    cuda_ok(cudaMemcpy(y->alloc, dy + yoff, y->alloc_bytes, cudaMemcpyDeviceToHost), "copy y back");
    cuda_ok(cudaMemcpy(scales, ds, sbytes, cudaMemcpyDeviceToHost), "copy scales back");
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(ds);
    return st;
}

/* GPU against CPU on x; returns 1 if everything matched. */
static int check_case(const tu_tensor *x, int64_t xoff, int ylayout, int64_t yoff,
                      fmha_fp8_scaling sc, int64_t br, const char *what)
{
    const fmha_tensor *t = &x->t;
    const int64_t ng = n_groups(t, sc, br);
    tu_tensor ycpu, ygpu;
    tu_tensor_init(&ycpu, FMHA_DTYPE_F8_E4M3, t->batch, t->seqlen, t->heads, t->head_dim, ylayout,
                   POISON);
    tu_tensor_init(&ygpu, FMHA_DTYPE_F8_E4M3, t->batch, t->seqlen, t->heads, t->head_dim, ylayout,
                   POISON);
    float *scpu = malloc((size_t)(ng + 1) * sizeof(float)),
          *sgpu = malloc((size_t)(ng + 1) * sizeof(float));
    memset(scpu, POISON, (size_t)(ng + 1) * sizeof(float));
    memset(sgpu, POISON, (size_t)(ng + 1) * sizeof(float));

    fmha_status st = fmha_quantize_fp8(t, &ycpu.t, scpu, sc, br);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: CPU quantizer: %s", what, fmha_last_error());
    st = run_gpu(x, xoff, &ygpu, yoff, sgpu, ng + 1, sc, br);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: %s (%s)", what, fmha_status_string(st), fmha_last_error());
    TU_CHECK(st != FMHA_STATUS_OK || fmha_last_error()[0] == '\0', "%s: last error not cleared",
             what);

    int64_t bad_scales = 0, bad_codes = 0;
    for (int64_t g = 0; g < ng; g++)
        if (fmha_f32_to_bits(scpu[g]) != fmha_f32_to_bits(sgpu[g]) && bad_scales++ == 0)
            fprintf(stderr, "  %s: scale[%lld] = %a (0x%08x), CPU %a\n", what, (long long)g,
                    (double)sgpu[g], (unsigned)fmha_f32_to_bits(sgpu[g]), (double)scpu[g]);
    /* The first differing code with its coordinates and x, then every byte of
     * the allocation (gaps included). */
    for (int64_t b = 0; b < t->batch && bad_codes == 0; b++)
        for (int64_t s = 0; s < t->seqlen && bad_codes == 0; s++)
            for (int64_t h = 0; h < t->heads && bad_codes == 0; h++)
                for (int64_t c = 0; c < t->head_dim && bad_codes == 0; c++) {
                    const uint8_t gc = ((const uint8_t *)fmha_row(&ygpu.t, b, s, h))[c];
                    const uint8_t cc = ((const uint8_t *)fmha_row(&ycpu.t, b, s, h))[c];
                    const float xv = fmha_load_f32(fmha_row(t, b, s, h), t->dtype, c);
                    if (gc != cc && ++bad_codes)
                        fprintf(stderr,
                                "  %s: y[%lld, %lld, %lld, %lld] = 0x%02x, CPU 0x%02x, x = %a\n",
                                what, (long long)b, (long long)s, (long long)h, (long long)c, gc,
                                cc, (double)xv);
                }
    bad_codes = 0;
    const unsigned char *ga = ygpu.alloc, *ca = ycpu.alloc;
    for (size_t i = 0; i < ycpu.alloc_bytes; i++)
        bad_codes += ga[i] != ca[i];
    TU_CHECK(bad_scales == 0 && bad_codes == 0,
             "%s: %lld scales and %lld bytes of y differ from the CPU's", what,
             (long long)bad_scales, (long long)bad_codes);
    TU_CHECK(memcmp(&sgpu[ng], &scpu[ng], sizeof(float)) == 0, "%s: scales written past the end",
             what);
    free(scpu);
    free(sgpu);
    tu_tensor_free(&ycpu);
    tu_tensor_free(&ygpu);
    return bad_scales == 0 && bad_codes == 0;
}

/* ------------------------------------------------------------ inputs */

/* |value| of E4M3 codes 0x00..0x7E, ascending. */
static double e4m3_value(int c)
{
    int e = c >> 3, m = c & 7;
    return e == 0 ? m / 512.0 : ldexp(1.0 + m / 8.0, e - 7);
}

enum { FILL_NORMAL, FILL_SPECIAL, FILL_TIES, FILL_HUGE, FILL_TINY, FILL_KINDS };

static double x_max(fmha_dtype dt)
{
    return dt == FMHA_DTYPE_F16 ? 65504.0 : dt == FMHA_DTYPE_BF16 ? 3.3895313892515355e38 : FLT_MAX;
}

static double x_min(fmha_dtype dt) /* smallest positive subnormal */
{
    return dt == FMHA_DTYPE_F16 ? 0x1p-24 : dt == FMHA_DTYPE_BF16 ? 0x1p-133 : 0x1p-149;
}

/* Fills x with one of the value mixes:
 *   NORMAL  Gaussian, sigma 1e-3 .. 1e3;
 *   SPECIAL Gaussian plus NaN of both signs, +-0, a few all-zero and all-NaN
 *           rows, and values far below amax (E4M3 subnormal codes);
 *   TIES    every row starts with +-448 (scale 1 for every group) and holds
 *           exact midpoints between neighbouring E4M3 values and the values;
 *   HUGE    magnitudes near the dtype's maximum (scale beyond 2^64: the IEEE
 *           division path; f16 tops out at 65504);
 *   TINY    magnitudes near the dtype's smallest subnormals (scale subnormal or
 *           amax / 448 == 0, so scale 1). */
static void fill(tu_tensor *x, tu_rng *r, int kind)
{
    const fmha_tensor *t = &x->t;
    const double sigma = pow(10.0, (double)tu_range(r, 7) - 3.0);
    const double hi = x_max(t->dtype), lo = x_min(t->dtype);
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++) {
                const int64_t row_kind = tu_range(r, 40);
                for (int64_t c = 0; c < t->head_dim; c++) {
                    const double sign = tu_range(r, 2) ? -1.0 : 1.0;
                    double v = sigma * tu_normal(r);
                    switch (kind) {
                    case FILL_SPECIAL: {
                        const int64_t u = tu_range(r, 20);
                        if (row_kind == 0)
                            v = sign * 0.0;
                        else if (row_kind == 1)
                            v = sign * NAN;
                        else if (u == 0)
                            v = sign * NAN;
                        else if (u == 1)
                            v = sign * 0.0;
                        else if (u < 5)
                            v = sign * sigma * 1e-5 * tu_uniform(r);
                        break;
                    }
                    case FILL_TIES: {
                        const int code = (int)tu_range(r, 126);
                        v = c == 0 ? sign * 448.0
                                   : sign * (tu_range(r, 2)
                                                 ? e4m3_value(code)
                                                 : (e4m3_value(code) + e4m3_value(code + 1)) / 2);
                        break;
                    }
                    case FILL_HUGE: v = sign * hi * (0.5 + 0.5 * tu_uniform(r)); break;
                    case FILL_TINY: v = sign * lo * (double)tu_range(r, 1 + row_kind); break;
                    default: break;
                    }
                    set_x(x, b, s, h, c, (float)v);
                }
            }
}

/* ------------------------------------------------------------- cases */

static const int64_t SEQS[] = {1, 2, 7, 64, 113, 239, 1023};
static const int64_t HEADS[] = {1, 3, 5, 8};
static const int64_t DIMS[] = {1, 3, 7, 8, 16, 24, 64, 96, 128, 136, 200, 256, 300};
static const int64_t BLOCKS[] = {1, 3, 16, 64, 100, 128, 200, 300, 5000};
static const fmha_dtype DTYPES[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};

#define PICK(a) (a)[tu_range(&rng, (int64_t)(sizeof(a) / sizeof((a)[0])))]

static void test_random(int ncases)
{
    tu_rng rng = {20261202};
    int failed = 0;
    for (int i = 0; i < ncases && failed < 5; i++) {
        const int64_t B = 1 + tu_range(&rng, 3), S = PICK(SEQS), H = PICK(HEADS), D = PICK(DIMS);
        if (B * S * H * D > (1 << 21)) {
            i--;
            continue;
        }
        const fmha_dtype dt = PICK(DTYPES);
        const int xl = (int)tu_range(&rng, 3), yl = (int)tu_range(&rng, 3),
                  kind = (int)tu_range(&rng, FILL_KINDS);
        const fmha_fp8_scaling sc = (fmha_fp8_scaling)tu_range(&rng, 3);
        const int64_t br = PICK(BLOCKS);
        /* Mostly aligned (vector path when the layout allows), sometimes off by an element. */
        const int64_t xoff = tu_range(&rng, 4) == 0 ? 1 + tu_range(&rng, 7) : 0;
        const int64_t yoff = tu_range(&rng, 4) == 0 ? 1 + tu_range(&rng, 7) : 0;
        tu_tensor x;
        tu_tensor_init(&x, dt, B, S, H, D, xl, POISON);
        fill(&x, &rng, kind);
        char what[160];
        snprintf(
            what, sizeof what,
            "case %d: [%lld, %lld, %lld, %lld] %s layout %d+%lld -> layout %d+%lld, scaling %d "
            "block_rows %lld, fill %d",
            i, (long long)B, (long long)S, (long long)H, (long long)D, fmha_dtype_name(dt), xl,
            (long long)xoff, yl, (long long)yoff, (int)sc, (long long)br, kind);
        failed += !check_case(&x, xoff, yl, yoff, sc, br, what);
        tu_tensor_free(&x);
    }
}

/* Each path of the kernel by construction (cuda_fp8.cu): local groups kept in
 * registers, local groups read twice, the grid with one group, with many,
 * with rows wider than a block's threads, and views with stride_batch 0. */
static void test_paths(void)
{
    static const struct {
        int64_t b, s, h, d;
        fmha_dtype dt;
        fmha_fp8_scaling sc;
        int64_t br;
        const char *what;
    } cases[] = {
        {2, 300, 4, 128, FMHA_DTYPE_BF16, FMHA_FP8_PER_BLOCK, 64, "local, registers"},
        {1, 1, 1, 128, FMHA_DTYPE_BF16, FMHA_FP8_PER_TENSOR, 0, "one row, per tensor"},
        {1, 500, 1, 64, FMHA_DTYPE_F16, FMHA_FP8_PER_TENSOR, 0, "per tensor of one head: local"},
        {2, 600, 3, 128, FMHA_DTYPE_BF16, FMHA_FP8_PER_BLOCK, 200, "local, read twice"},
        {2, 700, 3, 128, FMHA_DTYPE_F32, FMHA_FP8_PER_BLOCK, 100, "local f32"},
        {2, 1000, 5, 128, FMHA_DTYPE_BF16, FMHA_FP8_PER_TENSOR, 0, "grid, one group"},
        {2, 1000, 5, 128, FMHA_DTYPE_F16, FMHA_FP8_PER_HEAD, 0, "grid, a group per head"},
        {2, 1000, 5, 96, FMHA_DTYPE_BF16, FMHA_FP8_PER_BLOCK, 300, "grid, many groups"},
        {1, 40, 2, 4096, FMHA_DTYPE_BF16, FMHA_FP8_PER_HEAD, 0, "grid, 512 vectors a row"},
        {1, 40, 2, 1000, FMHA_DTYPE_F32, FMHA_FP8_PER_BLOCK, 7, "local, 1000 elements a row"},
    };
    tu_rng rng = {7};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int layout = 0; layout < 3; layout++) {
            tu_tensor x;
            tu_tensor_init(&x, cases[i].dt, cases[i].b, cases[i].s, cases[i].h, cases[i].d, layout,
                           POISON);
            fill(&x, &rng, i % 2 ? FILL_SPECIAL : FILL_TIES);
            char what[128];
            snprintf(what, sizeof what, "%s, layout %d", cases[i].what, layout);
            check_case(&x, 0, layout, 0, cases[i].sc, cases[i].br, what);
            tu_tensor_free(&x);
        }

    tu_tensor x; /* stride_batch 0: both batches read the same memory */
    tu_tensor_init(&x, FMHA_DTYPE_BF16, 1, 77, 3, 64, 0, POISON);
    fill(&x, &rng, FILL_NORMAL);
    x.t.batch = 2;
    x.t.stride_batch = 0;
    check_case(&x, 0, 0, 0, FMHA_FP8_PER_BLOCK, 16, "stride_batch 0, per block");
    check_case(&x, 0, 2, 0, FMHA_FP8_PER_TENSOR, 0, "stride_batch 0, per tensor");
    tu_tensor_free(&x);
}

/* Larger than L2, so that the grid path streams most tiles and keeps the
 * last ones (FMHA_TEST_LONG=0 skips it). */
static void test_large(void)
{
    tu_rng rng = {11};
    tu_tensor x;
    tu_tensor_init(&x, FMHA_DTYPE_BF16, 1, 16384, 16, 128, 0, POISON);
    fill(&x, &rng, FILL_SPECIAL);
    check_case(&x, 0, 0, 0, FMHA_FP8_PER_TENSOR, 0, "64 MiB bf16, per tensor");
    check_case(&x, 0, 0, 0, FMHA_FP8_PER_BLOCK, 128, "64 MiB bf16, per block of 128");
    tu_tensor_free(&x);
}

/* The CPU refuses an infinite x; the GPU marks the infinity's group: scale
 * NaN, every code NaN with x's sign. The other groups are as the CPU
 * quantizes x with that element made finite. */
static void test_infinity(fmha_dtype dt, fmha_fp8_scaling sc, int64_t br)
{
    const int64_t B = 2, S = 50, H = 3, D = 64, ib = 1, is = 37, ih = 2, ic = 5;
    tu_rng rng = {3};
    tu_tensor x, ycpu, ygpu;
    tu_tensor_init(&x, dt, B, S, H, D, 0, POISON);
    fill(&x, &rng, FILL_NORMAL);
    const int64_t ng = n_groups(&x.t, sc, br);
    float *scpu = malloc((size_t)(ng + 1) * sizeof(float)),
          *sgpu = malloc((size_t)(ng + 1) * sizeof(float));
    memset(sgpu, POISON, (size_t)(ng + 1) * sizeof(float));
    tu_tensor_init(&ycpu, FMHA_DTYPE_F8_E4M3, B, S, H, D, 0, POISON);
    tu_tensor_init(&ygpu, FMHA_DTYPE_F8_E4M3, B, S, H, D, 0, POISON);
    set_x(&x, ib, is, ih, ic, 0.0f);
    fmha_status st = fmha_quantize_fp8(&x.t, &ycpu.t, scpu, sc, br);
    TU_CHECK(st == FMHA_STATUS_OK, "infinity: CPU %s", fmha_last_error());
    set_x(&x, ib, is, ih, ic, -INFINITY);
    st = run_gpu(&x, 0, &ygpu, 0, sgpu, ng + 1, sc, br);
    TU_CHECK(st == FMHA_STATUS_OK, "infinity: %s", fmha_last_error());

    const int64_t nblk = sc == FMHA_FP8_PER_BLOCK ? (S + br - 1) / br : 1;
#define GROUP_OF(b, s, h)          \
    (sc == FMHA_FP8_PER_TENSOR ? 0 \
                               : ((b)*H + (h)) * nblk + (sc == FMHA_FP8_PER_BLOCK ? (s) / br : 0))
    const int64_t bad_group = GROUP_OF(ib, is, ih);
    int bad = 0;
    for (int64_t g = 0; g < ng; g++)
        bad += g == bad_group ? !isnan(sgpu[g])
                              : fmha_f32_to_bits(sgpu[g]) != fmha_f32_to_bits(scpu[g]);
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t g = GROUP_OF(b, s, h);
                const uint8_t *gy = (const uint8_t *)fmha_row(&ygpu.t, b, s, h);
                const uint8_t *cy = (const uint8_t *)fmha_row(&ycpu.t, b, s, h);
                for (int64_t c = 0; c < D; c++) {
                    const uint8_t want =
                        g != bad_group ? cy[c] : (signbit(tu_get(&x, b, s, h, c)) ? 0xFF : 0x7F);
                    bad += gy[c] != want;
                }
            }
#undef GROUP_OF
    TU_CHECK(bad == 0,
             "infinity in %s, scaling %d: %d scales/codes wrong (group %lld must be NaN, "
             "the others as on the CPU)",
             fmha_dtype_name(dt), (int)sc, bad, (long long)bad_group);
    free(scpu);
    free(sgpu);
    tu_tensor_free(&x);
    tu_tensor_free(&ycpu);
    tu_tensor_free(&ygpu);
}

static void test_errors(void)
{
    tu_tensor x, y;
    tu_tensor_init(&x, FMHA_DTYPE_BF16, 1, 16, 2, 64, 0, 0);
    tu_tensor_init(&y, FMHA_DTYPE_F8_E4M3, 1, 16, 2, 64, 0, POISON);
    float scales[2] = {0};
    void *dx, *dy, *ds;
    cuda_ok(cudaMalloc(&dx, x.alloc_bytes), "cudaMalloc");
    cuda_ok(cudaMalloc(&dy, y.alloc_bytes), "cudaMalloc");
    cuda_ok(cudaMalloc(&ds, sizeof scales), "cudaMalloc");
    cuda_ok(cudaMemcpy(dy, y.alloc, y.alloc_bytes, cudaMemcpyHostToDevice), "copy y");
    cuda_ok(cudaMemset(ds, POISON, sizeof scales), "memset scales");
    fmha_tensor xt = x.t, yt = y.t;
    yt.data = dy;

    /* Host x: refused, nothing written. */
    fmha_status st = fmha_quantize_fp8_cuda(&xt, &yt, ds, FMHA_FP8_PER_TENSOR, 0, stream);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "x.data is host memory"),
             "host x: %s / %s", fmha_status_string(st), fmha_last_error());
    xt.data = dx;
    st = fmha_quantize_fp8_cuda(&xt, &yt, scales, FMHA_FP8_PER_TENSOR, 0, stream);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "scales is host memory"),
             "host scales: %s / %s", fmha_status_string(st), fmha_last_error());
    /* The CPU quantizer's checks, word for word. */
    st = fmha_quantize_fp8_cuda(&xt, &yt, ds, FMHA_FP8_PER_BLOCK, 0, stream);
    TU_CHECK(
        st == FMHA_STATUS_INVALID_ARGUMENT &&
            strstr(fmha_last_error(), "block_rows (0) must be positive for FMHA_FP8_PER_BLOCK"),
        "block_rows 0: %s / %s", fmha_status_string(st), fmha_last_error());
    yt.dtype = FMHA_DTYPE_BF16;
    st = fmha_quantize_fp8_cuda(&xt, &yt, ds, FMHA_FP8_PER_TENSOR, 0, stream);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "y.dtype (bf16) must be f8_e4m3"),
             "y bf16: %s / %s", fmha_status_string(st), fmha_last_error());
    st = fmha_quantize_fp8_cuda(&xt, NULL, ds, FMHA_FP8_PER_TENSOR, 0, stream);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), "y is NULL"),
             "y NULL: %s / %s", fmha_status_string(st), fmha_last_error());

    cuda_ok(cudaStreamSynchronize(stream), "sync");
    unsigned char *back = malloc(y.alloc_bytes), sback[sizeof scales];
    cuda_ok(cudaMemcpy(back, dy, y.alloc_bytes, cudaMemcpyDeviceToHost), "copy y back");
    cuda_ok(cudaMemcpy(sback, ds, sizeof scales, cudaMemcpyDeviceToHost), "copy scales back");
    int untouched = 1;
    for (size_t i = 0; i < y.alloc_bytes; i++)
        untouched &= back[i] == POISON;
    for (size_t i = 0; i < sizeof scales; i++)
        untouched &= sback[i] == POISON;
    TU_CHECK(untouched, "y or scales written by a refused call");

    /* The default stream (NULL) works too. */
    yt.dtype = FMHA_DTYPE_F8_E4M3;
    cuda_ok(cudaMemcpy(dx, x.alloc, x.alloc_bytes, cudaMemcpyHostToDevice), "copy x");
    st = fmha_quantize_fp8_cuda(&xt, &yt, ds, FMHA_FP8_PER_TENSOR, 0, NULL);
    cuda_ok(cudaDeviceSynchronize(), "default stream");
    float s = 0;
    cuda_ok(cudaMemcpy(&s, ds, sizeof s, cudaMemcpyDeviceToHost), "copy scale");
    TU_CHECK(st == FMHA_STATUS_OK && s == 1.0f, "all-zero x on the default stream: %s, scale %g",
             fmha_last_error(), (double)s);
    free(back);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(ds);
    tu_tensor_free(&x);
    tu_tensor_free(&y);
}

int main(int argc, char **argv)
{
    if (!tu_cuda_begin())
        return 77; /* ctest: skipped */
    cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
    const char *env = getenv("FMHA_TEST_CASES"), *lenv = getenv("FMHA_TEST_LONG");
    test_paths();
    test_random(argc > 1 ? atoi(argv[1]) : env ? atoi(env) : 300);
    if (!(lenv && !strcmp(lenv, "0")))
        test_large();
    static const fmha_dtype dts[3] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    for (int i = 0; i < 3; i++) {
        test_infinity(dts[i], FMHA_FP8_PER_TENSOR, 0);
        test_infinity(dts[i], FMHA_FP8_PER_HEAD, 0);
        test_infinity(dts[i], FMHA_FP8_PER_BLOCK, 8);
    }
    test_errors();
    cudaStreamDestroy(stream);
    return tu_summary();
}
