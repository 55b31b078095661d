/* test_fp8.c — FP8 E4M3 conversions against an independent nearest-value
 * encoder (every code, random floats, every midpoint and its neighbours);
 * fmha_quantize_fp8 against scales and codes recomputed here: every scaling,
 * input dtype and layout, padded outputs, degenerate groups, and every
 * argument check leaving y and scales untouched (on fmha_quantize_fp8_cuda
 * too, whose GPU results test_cuda_fp8 checks); FP8 attention against the
 * reference on the dequantized inputs over random cases of the shared list
 * (every descale layout, GQA, varlen, masks, dropout, poisoned outputs); and
 * the fp8_compute layer: bit-identical to quantize + FP8 attention, its path
 * and fallback rules, and its errors. */
#include "cases.h"
#include "internal.h"
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { POISON = 0xA5 };

/* ------------------------------------------------------ reference encoder */

/* |value| of codes 0x00..0x7E, ascending, built from the format's definition. */
static double tbl[127];

static void tbl_init(void)
{
    for (int c = 0; c < 127; c++) {
        int e = c >> 3, m = c & 7;
        tbl[c] = e == 0 ? m / 512.0 : ldexp(1.0 + m / 8.0, e - 7);
    }
}

/* The nearest finite E4M3 value by exhaustive search in double, ties to the
 * even code; everything from 448 up saturates. */
static uint8_t ref_encode(float x)
{
    if (isnan(x))
        return signbit(x) ? 0xFF : 0x7F;
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    double a = fabs((double)x);
    if (a >= 448.0)
        return sign | 0x7E;
    int best = 0;
    double bestd = a;
    for (int c = 1; c < 127; c++) {
        double d = fabs(a - tbl[c]);
        if (d < bestd || (d == bestd && (c & 1) == 0)) {
            best = c;
            bestd = d;
        }
    }
    return (uint8_t)(sign | best);
}

/* Compares the encoder with the reference on x and -x; returns mismatches. */
static int enc_mismatches(float x, int verbose)
{
    int bad = 0;
    for (int s = 0; s < 2; s++) {
        float v = s ? -x : x;
        uint8_t got = fmha_f32_to_e4m3(v), want = ref_encode(v);
        if (got != want) {
            if (verbose && bad == 0)
                fprintf(stderr, "  e4m3(%a = 0x%08x) = 0x%02x, want 0x%02x\n", (double)v,
                        (unsigned)fmha_f32_to_bits(v), got, want);
            bad++;
        }
    }
    return bad;
}

/* ------------------------------------------------------------ conversions */

static void test_decode_and_round_trip(void)
{
    int bad_dec = 0, bad_rt = 0;
    for (int c = 0; c < 256; c++) {
        float f = fmha_e4m3_to_f32((uint8_t)c);
        if ((c & 0x7F) == 0x7F) {
            bad_dec += !isnan(f);
            continue;
        }
        double want = (c & 0x80) ? -tbl[c & 0x7F] : tbl[c & 0x7F];
        bad_dec += (double)f != want || !!signbit(f) != !!(c & 0x80);
        bad_rt += fmha_f32_to_e4m3(f) != c;
    }
    TU_CHECK(bad_dec == 0, "%d codes decode wrongly", bad_dec);
    TU_CHECK(bad_rt == 0, "%d codes do not survive decode + encode", bad_rt);
    TU_CHECK(fmha_e4m3_to_f32(0x7E) == 448.0f && fmha_e4m3_to_f32(0xFE) == -448.0f,
             "0x7E/0xFE must be +-448");
    TU_CHECK(fmha_e4m3_to_f32(0x01) == 0x1p-9f && fmha_e4m3_to_f32(0x08) == 0x1p-6f &&
                 fmha_e4m3_to_f32(0x38) == 1.0f,
             "0x01, 0x08, 0x38 must be 2^-9, 2^-6, 1");
    TU_CHECK(isnan(fmha_e4m3_to_f32(0xFF)), "0xFF must decode to NaN");
}

static void test_encode_fixed(void)
{
    static const struct {
        float x;
        uint8_t code;
    } cases[] = {
        {0.0f, 0x00},          {-0.0f, 0x80},
        {1.0f, 0x38},          {0x1p-6f, 0x08},
        {0x1p-9f, 0x01},       {0x1p-10f, 0x00}, /* tie to 0 */
        {-0x1p-10f, 0x80},     {0x1.000002p-10f, 0x01},
        {0x1p-11f, 0x00},      {3 * 0x1p-10f, 0x02}, /* tie between 1 and 2 */
        {15 * 0x1p-10f, 0x08},                       /* tie between 7 * 2^-9 and 2^-6 */
        {FLT_TRUE_MIN, 0x00},  {-FLT_TRUE_MIN, 0x80},
        {FLT_MIN, 0x00},       {1.0625f, 0x38},
        {1.1875f, 0x3A},       {-1.1875f, 0xBA},
        {416.0f, 0x7D},        {432.0f, 0x7E}, /* tie between 416 (0x7D) and 448 */
        {447.99f, 0x7E},       {448.0f, 0x7E},
        {449.0f, 0x7E},        {464.0f, 0x7E},
        {465.0f, 0x7E},        {-465.0f, 0xFE},
        {1e30f, 0x7E},         {FLT_MAX, 0x7E},
        {INFINITY, 0x7E},      {-INFINITY, 0xFE},
        {NAN, 0x7F},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t got = fmha_f32_to_e4m3(cases[i].x);
        TU_CHECK(got == cases[i].code, "e4m3(%a) = 0x%02x, want 0x%02x", (double)cases[i].x, got,
                 cases[i].code);
    }
    float nan_pos = fmha_bits_to_f32(0x7fc00000u), nan_neg = fmha_bits_to_f32(0xffc00000u);
    float snan_neg = fmha_bits_to_f32(0xff800001u);
    TU_CHECK(fmha_f32_to_e4m3(nan_pos) == 0x7F, "+NaN must give 0x7F");
    TU_CHECK(fmha_f32_to_e4m3(nan_neg) == 0xFF, "-NaN must give 0xFF");
    TU_CHECK(fmha_f32_to_e4m3(snan_neg) == 0xFF, "-sNaN must give 0xFF");
}

static void test_encode_vs_reference(void)
{
    /* Every midpoint between neighbouring values, and one float either side. */
    int bad = 0, n = 0;
    for (int c = 0; c < 126; c++) {
        float mid = (float)((tbl[c] + tbl[c + 1]) / 2);
        TU_CHECK((double)mid == (tbl[c] + tbl[c + 1]) / 2, "midpoint %d not exact", c);
        const float xs[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (int i = 0; i < 3; i++, n += 2)
            bad += enc_mismatches(xs[i], bad == 0);
    }
    const float extra[] = {448.0f,
                           464.0f,
                           nextafterf(464.0f, 0.0f),
                           nextafterf(464.0f, INFINITY),
                           480.0f,
                           600.0f,
                           0x1p-10f,
                           nextafterf(0x1p-10f, 0.0f),
                           FLT_TRUE_MIN};
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++, n += 2)
        bad += enc_mismatches(extra[i], bad == 0);
    TU_CHECK(bad == 0, "%d of %d midpoint values differ from the reference", bad, n);

    /* Every value of every code, then random floats: uniform in [-600, 600],
     * log-uniform magnitudes 2^-14 .. 2^10, and raw bit patterns (NaN, inf,
     * huge, float subnormals). */
    tu_rng r = {7};
    bad = 0;
    for (int c = 0; c < 127; c++)
        bad += enc_mismatches((float)tbl[c], bad == 0);
    const int per = 1 << 18;
    for (int i = 0; i < per; i++) {
        bad += enc_mismatches((float)(tu_uniform(&r) * 1200.0 - 600.0), bad == 0);
        bad += enc_mismatches((float)exp2(tu_uniform(&r) * 24.0 - 14.0), bad == 0);
        bad += enc_mismatches(fmha_bits_to_f32((uint32_t)tu_next(&r)), bad == 0);
    }
    TU_CHECK(bad == 0, "%d of %d random values differ from the reference", bad, 6 * per + 254);
}

/* -------------------------------------------------------------- quantizer */

static int64_t n_blocks(const fmha_tensor *t, fmha_fp8_scaling sc, int64_t br)
{
    return sc == FMHA_FP8_PER_BLOCK ? (t->seqlen + br - 1) / br : 1;
}

static int64_t n_groups(const fmha_tensor *t, fmha_fp8_scaling sc, int64_t br)
{
    return sc == FMHA_FP8_PER_TENSOR ? 1 : t->batch * t->heads * n_blocks(t, sc, br);
}

static int64_t group_of(const fmha_tensor *t, fmha_fp8_scaling sc, int64_t br, int64_t b, int64_t s,
                        int64_t h)
{
    if (sc == FMHA_FP8_PER_TENSOR)
        return 0;
    int64_t nblk = n_blocks(t, sc, br);
    return (b * t->heads + h) * nblk + (sc == FMHA_FP8_PER_BLOCK ? s / br : 0);
}

static uint8_t y_code(const tu_tensor *y, int64_t b, int64_t s, int64_t h, int64_t c)
{
    const fmha_tensor *t = &y->t;
    return ((const uint8_t *)
                y->alloc)[b * t->stride_batch + s * t->stride_seq + h * t->stride_head + c];
}

/* Recomputes scales and codes for x and compares them with fmha's, bit for
 * bit; returns the number of mismatches (printing the first). */
static int quant_mismatches(const tu_tensor *x, const tu_tensor *y, const float *scales,
                            fmha_fp8_scaling sc, int64_t br)
{
    const fmha_tensor *t = &x->t;
    int64_t ng = n_groups(t, sc, br);
    double *amax = calloc((size_t)ng, sizeof *amax);
    float *want = malloc((size_t)ng * sizeof *want);
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++) {
                    double v = fabs(tu_get(x, b, s, h, c));
                    int64_t g = group_of(t, sc, br, b, s, h);
                    if (!isnan(v) && v > amax[g])
                        amax[g] = v;
                }
    int bad = 0;
    for (int64_t g = 0; g < ng; g++) {
        want[g] = (float)amax[g] / 448.0f;
        if (want[g] == 0.0f)
            want[g] = 1.0f;
        if (fmha_f32_to_bits(want[g]) != fmha_f32_to_bits(scales[g]) && bad++ == 0)
            fprintf(stderr, "  scale[%lld] = %a, want %a\n", (long long)g, (double)scales[g],
                    (double)want[g]);
    }
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++) {
                    float v = (float)tu_get(x, b, s, h, c);
                    float q = v / want[group_of(t, sc, br, b, s, h)];
                    uint8_t w = ref_encode(isnan(v) ? v : q);
                    uint8_t got = y_code(y, b, s, h, c);
                    if (got != w && bad++ == 0)
                        fprintf(stderr, "  y[%lld, %lld, %lld, %lld] = 0x%02x, want 0x%02x\n",
                                (long long)b, (long long)s, (long long)h, (long long)c, got, w);
                }
    free(amax);
    free(want);
    return bad;
}

static void set_x(tu_tensor *x, int64_t b, int64_t s, int64_t h, int64_t c, float v)
{
    const fmha_tensor *t = &x->t;
    char *row = (char *)x->alloc + (b * t->stride_batch + s * t->stride_seq + h * t->stride_head) *
                                       (int64_t)fmha_dtype_size(t->dtype);
    switch (t->dtype) {
    case FMHA_DTYPE_F32: ((float *)row)[c] = v; break;
    case FMHA_DTYPE_F16: ((uint16_t *)row)[c] = fmha_f32_to_f16(v); break;
    case FMHA_DTYPE_BF16: ((uint16_t *)row)[c] = fmha_f32_to_bf16(v); break;
    default: break;
    }
}

/* Runs one quantization of x into a fresh y of `ylayout` and checks it all. */
static void run_case(tu_tensor *x, int ylayout, fmha_fp8_scaling sc, int64_t br, const char *what)
{
    const fmha_tensor *t = &x->t;
    tu_tensor y;
    tu_tensor_init(&y, FMHA_DTYPE_F8_E4M3, t->batch, t->seqlen, t->heads, t->head_dim, ylayout,
                   POISON);
    int64_t ng = n_groups(t, sc, br);
    float *scales = malloc((size_t)(ng + 1) * sizeof *scales);
    memset(scales, POISON, (size_t)(ng + 1) * sizeof *scales);
    unsigned char sentinel[sizeof(float)];
    memcpy(sentinel, &scales[ng], sizeof sentinel);

    fmha_status st = fmha_quantize_fp8(&x->t, &y.t, scales, sc, br);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: status %s (%s)", what, fmha_status_string(st),
             fmha_last_error());
    if (st == FMHA_STATUS_OK) {
        int bad = quant_mismatches(x, &y, scales, sc, br);
        TU_CHECK(bad == 0, "%s: %d scales/codes differ from the recomputation", what, bad);
        TU_CHECK(fmha_last_error()[0] == '\0', "%s: last error not cleared", what);
    }
    TU_CHECK(tu_gaps_untouched(&y, POISON), "%s: y written outside its view", what);
    TU_CHECK(memcmp(&scales[ng], sentinel, sizeof sentinel) == 0, "%s: scales overrun", what);
    free(scales);
    tu_tensor_free(&y);
}

static void test_quantize_sweep(void)
{
    static const fmha_dtype dtypes[3] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    static const struct {
        fmha_fp8_scaling sc;
        int64_t br;
    } modes[] = {{FMHA_FP8_PER_TENSOR, 0}, {FMHA_FP8_PER_HEAD, 0},   {FMHA_FP8_PER_BLOCK, 4},
                 {FMHA_FP8_PER_BLOCK, 1},  {FMHA_FP8_PER_BLOCK, 13}, {FMHA_FP8_PER_BLOCK, 100}};
    tu_rng r = {2024};
    for (int di = 0; di < 3; di++)
        for (int xl = 0; xl < 3; xl++)
            for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
                tu_tensor x;
                tu_tensor_init(&x, dtypes[di], 2, 13, 3, 7, xl, POISON);
                tu_fill_normal(&x, &r, 3.0);
                /* Heads of very different size, so per-head scales differ. */
                for (int64_t s = 0; s < 13; s++)
                    for (int64_t c = 0; c < 7; c++)
                        set_x(&x, 1, s, 2, c, (float)(tu_get(&x, 1, s, 2, c) * 1e-3));
                char what[96];
                snprintf(what, sizeof what, "%s layout %d scaling %d block_rows %lld",
                         fmha_dtype_name(dtypes[di]), xl, (int)modes[mi].sc,
                         (long long)modes[mi].br);
                run_case(&x, xl == 0 ? 2 : 0, modes[mi].sc, modes[mi].br, what);
                tu_tensor_free(&x);
            }
}

static void test_quantize_degenerate_groups(void)
{
    tu_rng r = {99};
    tu_tensor x;
    tu_tensor_init(&x, FMHA_DTYPE_F32, 2, 6, 4, 5, 2, POISON);
    tu_fill_normal(&x, &r, 1.0);
    for (int64_t s = 0; s < 6; s++)
        for (int64_t c = 0; c < 5; c++) {
            set_x(&x, 0, s, 1, c, (s + c) % 2 ? 0.0f : -0.0f); /* all zero */
            set_x(&x, 0, s, 2, c, (c % 2) ? NAN : -NAN);       /* all NaN */
            set_x(&x, 1, s, 0, c, FLT_TRUE_MIN);               /* amax / 448 underflows */
            set_x(&x, 1, s, 1, c, (float)(c - 2) * 1e-40f);    /* subnormal scale */
        }
    set_x(&x, 1, 3, 2, 4, NAN); /* ignored for amax */
    set_x(&x, 1, 4, 3, 0, -NAN);
    run_case(&x, 2, FMHA_FP8_PER_HEAD, 0, "degenerate groups");
    run_case(&x, 0, FMHA_FP8_PER_BLOCK, 4, "degenerate groups, blocks");

    /* The exact values for the named heads. */
    tu_tensor y;
    tu_tensor_init(&y, FMHA_DTYPE_F8_E4M3, 2, 6, 4, 5, 0, POISON);
    float scales[8];
    fmha_status st = fmha_quantize_fp8(&x.t, &y.t, scales, FMHA_FP8_PER_HEAD, 0);
    TU_CHECK(st == FMHA_STATUS_OK, "degenerate groups: %s", fmha_last_error());
    TU_CHECK(scales[1] == 1.0f && scales[2] == 1.0f && scales[4] == 1.0f,
             "all-zero, all-NaN and underflowing groups must have scale 1 (got %g %g %g)",
             (double)scales[1], (double)scales[2], (double)scales[4]);
    int bad = 0;
    for (int64_t s = 0; s < 6; s++)
        for (int64_t c = 0; c < 5; c++) {
            bad += y_code(&y, 0, s, 1, c) != ((s + c) % 2 ? 0x00 : 0x80);
            bad += y_code(&y, 0, s, 2, c) != ((c % 2) ? 0x7F : 0xFF);
            bad += y_code(&y, 1, s, 0, c) != 0x00;
        }
    TU_CHECK(bad == 0, "%d codes of zero/NaN/tiny groups wrong", bad);
    TU_CHECK(y_code(&y, 1, 3, 2, 4) == 0x7F && y_code(&y, 1, 4, 3, 0) == 0xFF,
             "NaN elements must stay NaN with their sign");
    int amax_codes = 0; /* the element at amax lands on +-448 */
    for (int64_t s = 0; s < 6; s++)
        for (int64_t c = 0; c < 5; c++)
            amax_codes += (y_code(&y, 1, s, 3, c) & 0x7F) == 0x7E;
    TU_CHECK(amax_codes >= 1, "no element of a normal group reached 448");
    tu_tensor_free(&y);
    tu_tensor_free(&x);
}

static void test_quantize_broadcast_view(void)
{
    /* stride_batch 0: both batches read the same memory. */
    tu_rng r = {5};
    tu_tensor x;
    tu_tensor_init(&x, FMHA_DTYPE_BF16, 1, 5, 2, 8, 0, POISON);
    tu_fill_normal(&x, &r, 10.0);
    x.t.batch = 2;
    x.t.stride_batch = 0;
    run_case(&x, 2, FMHA_FP8_PER_BLOCK, 2, "stride_batch 0");
    run_case(&x, 1, FMHA_FP8_PER_TENSOR, 0, "stride_batch 0, per tensor");
    tu_tensor_free(&x);
}

/* Tensors large enough for the quantizer's threads: the same bits, and the
 * first infinity still the one named. */
static void test_quantize_large(void)
{
    tu_rng r = {2718};
    tu_tensor x;
    tu_tensor_init(&x, FMHA_DTYPE_BF16, 2, 300, 4, 64, 2, POISON);
    tu_fill_normal(&x, &r, 2.0);
    run_case(&x, 0, FMHA_FP8_PER_TENSOR, 0, "large, per tensor");
    run_case(&x, 1, FMHA_FP8_PER_BLOCK, 128, "large, per block");
    tu_tensor_free(&x);

    tu_tensor_init(&x, FMHA_DTYPE_F32, 2, 300, 4, 64, 0, POISON);
    tu_fill_normal(&x, &r, 1.0);
    set_x(&x, 1, 250, 3, 10, INFINITY);
    set_x(&x, 0, 299, 2, 1, -INFINITY);
    set_x(&x, 0, 299, 1, 63, INFINITY);
    tu_tensor y;
    tu_tensor_init(&y, FMHA_DTYPE_F8_E4M3, 2, 300, 4, 64, 0, POISON);
    float scale;
    fmha_status st = fmha_quantize_fp8(&x.t, &y.t, &scale, FMHA_FP8_PER_TENSOR, 0);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "x[0, 299, 1, 63] is infinite"),
             "large tensor with infinities: %s", fmha_last_error());
    tu_tensor_free(&y);
    tu_tensor_free(&x);
}

/* ------------------------------------------------------------------ errors */

enum { EB = 2, ES = 5, EH = 3, ED = 4, EBR = 3, ENG = EB * EH * 2 };

typedef struct err_fixture {
    float xd[EB * ES * EH * ED];
    uint8_t yd[EB * ES * EH * ED];
    float scales[ENG];
    fmha_tensor x, y;
} err_fixture;

static void ef_init(err_fixture *f)
{
    tu_rng r = {11};
    for (size_t i = 0; i < sizeof f->xd / sizeof f->xd[0]; i++)
        f->xd[i] = (float)tu_normal(&r);
    memset(f->yd, POISON, sizeof f->yd);
    memset(f->scales, POISON, sizeof f->scales);
    f->x = fmha_tensor_bshd(f->xd, FMHA_DTYPE_F32, EB, ES, EH, ED);
    f->y = fmha_tensor_bshd(f->yd, FMHA_DTYPE_F8_E4M3, EB, ES, EH, ED);
}

/* Calls the quantizer and expects INVALID_ARGUMENT, `phrase` in the message
 * and nothing written. fmha_quantize_fp8_cuda runs the same argument checks
 * before anything else, so it must answer the same on every build, GPU or
 * not (infinities aside: it does not read x on the host). */
static void expect_invalid(err_fixture *f, const fmha_tensor *x, fmha_tensor *y, float *scales,
                           fmha_fp8_scaling sc, int64_t br, const char *phrase)
{
    fmha_status st = fmha_quantize_fp8(x, y, scales, sc, br);
    const char *msg = fmha_last_error();
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT, "[%s]: status %s", phrase, fmha_status_string(st));
    TU_CHECK(strstr(msg, phrase) != NULL, "message \"%s\" lacks \"%s\"", msg, phrase);
    if (!strstr(phrase, "infinite")) {
        st = fmha_quantize_fp8_cuda(x, y, scales, sc, br, NULL);
        msg = fmha_last_error();
        TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(msg, phrase) != NULL,
                 "[%s] on the CUDA entry point: %s, \"%s\"", phrase, fmha_status_string(st), msg);
    }
    int y_ok = 1, s_ok = 1;
    for (size_t i = 0; i < sizeof f->yd; i++)
        y_ok &= f->yd[i] == POISON;
    for (size_t i = 0; i < sizeof f->scales; i++)
        s_ok &= ((const unsigned char *)f->scales)[i] == POISON;
    TU_CHECK(y_ok && s_ok, "[%s]: y or scales written on error", phrase);
}

static void test_errors(void)
{
    err_fixture f;
    ef_init(&f);
    fmha_tensor x, y;
    const fmha_fp8_scaling PB = FMHA_FP8_PER_BLOCK;

    expect_invalid(&f, NULL, &f.y, f.scales, PB, EBR, "x is NULL");
    expect_invalid(&f, &f.x, NULL, f.scales, PB, EBR, "y is NULL");
    expect_invalid(&f, &f.x, &f.y, NULL, PB, EBR, "scales is NULL");
    x = f.x, x.data = NULL;
    expect_invalid(&f, &x, &f.y, f.scales, PB, EBR, "x.data is NULL");
    y = f.y, y.data = NULL;
    expect_invalid(&f, &f.x, &y, f.scales, PB, EBR, "y.data is NULL");
    x = f.x, x.heads = 0;
    expect_invalid(&f, &x, &f.y, f.scales, PB, EBR, "x.heads (0) must be positive");
    y = f.y, y.head_dim = -1;
    expect_invalid(&f, &f.x, &y, f.scales, PB, EBR, "y.head_dim (-1) must be positive");
    x = f.x, x.stride_dim = 2;
    expect_invalid(&f, &x, &f.y, f.scales, PB, EBR, "x.stride_dim (2) must be 1");
    y = f.y, y.stride_seq = -1;
    expect_invalid(&f, &f.x, &y, f.scales, PB, EBR, "y.stride_seq (-1) must be >= 0");
    x = f.x, x.stride_batch = INT64_MAX;
    expect_invalid(&f, &x, &f.y, f.scales, PB, EBR, "x spans more than 2^63 elements");
    x = f.x, x.dtype = FMHA_DTYPE_F8_E4M3;
    expect_invalid(&f, &x, &f.y, f.scales, PB, EBR, "x.dtype (f8_e4m3) must be f32, f16 or bf16");
    x = f.x, x.dtype = (fmha_dtype)9;
    expect_invalid(&f, &x, &f.y, f.scales, PB, EBR, "x.dtype (9) is not a fmha_dtype value");
    y = f.y, y.dtype = FMHA_DTYPE_BF16;
    expect_invalid(&f, &f.x, &y, f.scales, PB, EBR, "y.dtype (bf16) must be f8_e4m3");
    y = f.y, y.seqlen = ES - 1;
    expect_invalid(&f, &f.x, &y, f.scales, PB, EBR, "y's shape [2, 4, 3, 4] differs from x's");
    expect_invalid(&f, &f.x, &f.y, f.scales, PB, 0, "block_rows (0) must be positive");
    expect_invalid(&f, &f.x, &f.y, f.scales, PB, -3, "block_rows (-3) must be positive");
    expect_invalid(&f, &f.x, &f.y, f.scales, (fmha_fp8_scaling)3, EBR,
                   "scaling (3) is not a fmha_fp8_scaling value");
    expect_invalid(&f, &f.x, &f.y, f.scales, (fmha_fp8_scaling)-1, EBR,
                   "scaling (-1) is not a fmha_fp8_scaling value");

    /* An infinity in the last group: no earlier group may have been written. */
    f.xd[((1 * ES + 4) * EH + 2) * ED + 3] = INFINITY;
    expect_invalid(&f, &f.x, &f.y, f.scales, PB, EBR, "x[1, 4, 2, 3] is infinite");
    f.xd[((0 * ES + 2) * EH + 1) * ED + 0] = -INFINITY; /* the first one is named */
    expect_invalid(&f, &f.x, &f.y, f.scales, FMHA_FP8_PER_TENSOR, 0, "x[0, 2, 1, 0] is infinite");
    uint16_t hd[EB * ES * EH * ED] = {0};
    hd[7] = 0xFC00; /* f16 -inf */
    x = fmha_tensor_bshd(hd, FMHA_DTYPE_F16, EB, ES, EH, ED);
    expect_invalid(&f, &x, &f.y, f.scales, FMHA_FP8_PER_HEAD, 0, "x[0, 0, 1, 3] is infinite");

    /* Valid arguments in host memory: the CUDA entry point refuses them (host
     * memory where there is a GPU, UNSUPPORTED where there is none or no CUDA
     * build) and writes nothing. */
    ef_init(&f);
    fmha_status cst = fmha_quantize_fp8_cuda(&f.x, &f.y, f.scales, PB, EBR, NULL);
    TU_CHECK((cst == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), "host memory")) ||
                 cst == FMHA_STATUS_UNSUPPORTED,
             "CUDA entry point on host memory: %s, \"%s\"", fmha_status_string(cst),
             fmha_last_error());
    int untouched = 1;
    for (size_t i = 0; i < sizeof f.yd; i++)
        untouched &= f.yd[i] == POISON;
    for (size_t i = 0; i < sizeof f.scales; i++)
        untouched &= ((const unsigned char *)f.scales)[i] == POISON;
    TU_CHECK(untouched, "the CUDA entry point wrote host memory");

    /* block_rows is ignored outside PER_BLOCK, and a success clears the error. */
    ef_init(&f);
    fmha_status st = fmha_quantize_fp8(&f.x, &f.y, f.scales, FMHA_FP8_PER_HEAD, -5);
    TU_CHECK(st == FMHA_STATUS_OK && fmha_last_error()[0] == '\0',
             "PER_HEAD with block_rows -5: %s (%s)", fmha_status_string(st), fmha_last_error());
}

/* ---------------------------------------------------------- FP8 attention */

/* Random cases of the shared list with f8_e4m3 inputs, the descale layouts
 * and block sizes in turn. */
static void test_attention_cases(int ncases)
{
    fmha_cpu_isa isas[FMHA_CPU_ISA_LAST]; /* every ISA but AUTO */
    int nisa = 0;
    for (int i = FMHA_CPU_ISA_SCALAR; i <= (int)fmha_cpu_isa_detect(); i++)
        isas[nisa++] = (fmha_cpu_isa)i;
    const tcase_space space = {FMHA_DEVICE_CPU, isas, nisa, 0};
    static const int64_t blocks[] = {1, 5, 64, 128, 300};
    static const fmha_dtype odts[] = {FMHA_DTYPE_BF16, FMHA_DTYPE_F16, FMHA_DTYPE_F32};
    tu_rng r = {8080};
    for (int i = 0; i < ncases; i++) {
        tcase c = tcase_random(&r, i, &space);
        c.dt = FMHA_DTYPE_F8_E4M3;
        c.odt = odts[i % 3];
        c.dl = (fmha_descale_layout)(i % 3);
        c.dblock = blocks[(i / 3) % 5];
        tcase_run(&c, &r, fmha_forward);
    }
    /* A longer one: 257 queries against 600 keys (several query tiles and
     * scale blocks), GQA, causal, per-block scales. */
    tcase c = {.batch = 1,
               .sq = 257,
               .sk = 600,
               .heads = 4,
               .kv = 2,
               .d = 128,
               .dv = 128,
               .dt = FMHA_DTYPE_F8_E4M3,
               .odt = FMHA_DTYPE_BF16,
               .causal = 1,
               .wl = -1,
               .wr = -1,
               .lse = 1,
               .dl = FMHA_DESCALE_PER_BLOCK,
               .dblock = 128};
    tcase_run(&c, &r, fmha_forward);
}

/* ------------------------------------------------------------ fp8_compute */

typedef struct conv_case {
    tu_tensor q, k, v;
    int32_t cuq[4], cuk[4];
    fmha_config cfg;
    fmha_forward_args a;
} conv_case;

/* Inputs of `dt` for a fp8_compute layer: GQA 4/2, d = 64, dv = 48, and
 * either a padded batch of 2 or a packed one of 3 sequences. */
static void conv_init(conv_case *cc, fmha_dtype dt, int64_t sq, int64_t sk, int varlen,
                      fmha_fp8_compute mode, tu_rng *r)
{
    memset(cc, 0, sizeof *cc);
    int64_t b = 2, tq = sq, tk = sk;
    if (varlen) {
        const int32_t cq[4] = {0, (int32_t)sq / 3, (int32_t)sq / 3, (int32_t)sq};
        const int32_t ck[4] = {0, (int32_t)sk / 2, (int32_t)sk / 2 + 1, (int32_t)sk};
        memcpy(cc->cuq, cq, sizeof cq);
        memcpy(cc->cuk, ck, sizeof ck);
        b = 1;
    }
    tu_tensor_init(&cc->q, dt, b, tq, 4, 64, varlen ? 0 : 1, POISON);
    tu_tensor_init(&cc->k, dt, b, tk, 2, 64, varlen ? 0 : 2, POISON);
    tu_tensor_init(&cc->v, dt, b, tk, 2, 48, 0, POISON);
    tu_fill_normal(&cc->q, r, 1.0);
    tu_fill_normal(&cc->k, r, 1.0);
    tu_fill_normal(&cc->v, r, 1.0);
    fmha_config_init(&cc->cfg, 4, 2, 64);
    cc->cfg.head_dim_v = 48;
    cc->cfg.dtype = dt;
    cc->cfg.causal = 1;
    cc->cfg.fp8_compute = mode;
    cc->a.q = cc->q.t;
    cc->a.k = cc->k.t;
    cc->a.v = cc->v.t;
    if (varlen) {
        cc->a.cu_seqlens_q = cc->cuq;
        cc->a.cu_seqlens_k = cc->cuk;
        cc->a.varlen_batch = 3;
    }
}

static void conv_free(conv_case *cc)
{
    tu_tensor_free(&cc->q);
    tu_tensor_free(&cc->k);
    tu_tensor_free(&cc->v);
}

/* What the FP8 path must equal bit for bit: fmha_quantize_fp8 on q, k, v,
 * then FP8 attention with their descales on a f8_e4m3 configuration. */
static fmha_status explicit_fp8(const fmha_config *cfg, const fmha_forward_args *a)
{
    const int per_block = cfg->fp8_compute == FMHA_FP8_COMPUTE_PER_BLOCK;
    const int64_t br = FMHA_FP8_BLOCK_ROWS;
    fmha_forward_args a8 = *a;
    const fmha_tensor *src[3] = {&a->q, &a->k, &a->v};
    fmha_tensor *dst[3] = {&a8.q, &a8.k, &a8.v};
    const float **ds[3] = {&a8.descale_q, &a8.descale_k, &a8.descale_v};
    void *mem[3];
    float *scales[3];
    fmha_status st = FMHA_STATUS_OK;
    for (int i = 0; i < 3; i++) {
        const fmha_tensor *x = src[i];
        mem[i] = malloc((size_t)(x->batch * x->seqlen * x->heads * x->head_dim));
        scales[i] = malloc(sizeof(float) * (size_t)(x->batch * x->heads * (x->seqlen / br + 1)));
        *dst[i] = fmha_tensor_bshd(mem[i], FMHA_DTYPE_F8_E4M3, x->batch, x->seqlen, x->heads,
                                   x->head_dim);
        *ds[i] = scales[i];
        if (st == FMHA_STATUS_OK)
            st = fmha_quantize_fp8(x, dst[i], scales[i],
                                   per_block ? FMHA_FP8_PER_BLOCK : FMHA_FP8_PER_TENSOR, br);
    }
    a8.descale_layout = per_block ? FMHA_DESCALE_PER_BLOCK : FMHA_DESCALE_PER_TENSOR;
    a8.descale_block_rows = br;
    fmha_config c8 = *cfg;
    c8.dtype = FMHA_DTYPE_F8_E4M3;
    c8.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    if (st == FMHA_STATUS_OK)
        st = fmha_forward(&c8, &a8);
    for (int i = 0; i < 3; i++) {
        free(mem[i]);
        free(scales[i]);
    }
    return st;
}

/* Output + LSE buffers of a conv_case, poisoned. */
typedef struct conv_out {
    tu_tensor out;
    float *lse;
    size_t nlse;
} conv_out;

static void out_init(conv_out *o, const conv_case *cc, fmha_dtype odt)
{
    tu_tensor_init(&o->out, odt, cc->q.t.batch, cc->q.t.seqlen, 4, 48, 2, 0xFF);
    o->nlse = (size_t)(cc->q.t.batch * 4 * cc->q.t.seqlen);
    o->lse = malloc(sizeof(float) * o->nlse);
    memset(o->lse, 0xFF, sizeof(float) * o->nlse);
}

static void out_free(conv_out *o)
{
    tu_tensor_free(&o->out);
    free(o->lse);
}

static int out_same(const conv_out *x, const conv_out *y)
{
    return memcmp(x->out.alloc, y->out.alloc, x->out.alloc_bytes) == 0 &&
           memcmp(x->lse, y->lse, sizeof(float) * x->nlse) == 0;
}

static int out_poisoned(const conv_out *o)
{
    const unsigned char *p = o->out.alloc, *l = (const unsigned char *)o->lse;
    for (size_t i = 0; i < o->out.alloc_bytes; i++)
        if (p[i] != 0xFF)
            return 0;
    for (size_t i = 0; i < sizeof(float) * o->nlse; i++)
        if (l[i] != 0xFF)
            return 0;
    return 1;
}

/* The FP8 path equals quantize + FP8 attention bit for bit, across input
 * dtypes, scalings, padded and packed batches, and calls of growing and
 * shrinking size on one layer (its scratch is reused). */
static void test_compute_matches_explicit(void)
{
    static const struct {
        fmha_dtype dt, odt;
        fmha_fp8_compute mode;
        int varlen;
    } runs[] = {
        {FMHA_DTYPE_BF16, FMHA_DTYPE_BF16, FMHA_FP8_COMPUTE_PER_TENSOR, 0},
        {FMHA_DTYPE_BF16, FMHA_DTYPE_F32, FMHA_FP8_COMPUTE_PER_BLOCK, 0},
        {FMHA_DTYPE_F16, FMHA_DTYPE_F16, FMHA_FP8_COMPUTE_PER_TENSOR, 1},
        {FMHA_DTYPE_F32, FMHA_DTYPE_BF16, FMHA_FP8_COMPUTE_PER_BLOCK, 1},
    };
    static const int64_t sizes[][2] = {{239, 300}, {7, 1}, {300, 113}};
    tu_rng r = {31337};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        fmha_config cfg;
        fmha_config_init(&cfg, 4, 2, 64);
        cfg.head_dim_v = 48;
        cfg.dtype = runs[i].dt;
        cfg.causal = 1;
        cfg.fp8_compute = runs[i].mode;
        fmha_layer *layer;
        fmha_status st = fmha_layer_init(&layer, &cfg);
        TU_CHECK(st == FMHA_STATUS_OK, "fp8_compute layer %zu: %s", i, fmha_last_error());
        if (st != FMHA_STATUS_OK)
            continue;
        const char *reason;
        TU_CHECK(fmha_layer_get_path(layer, &reason) == FMHA_LAYER_PATH_FP8 &&
                     strstr(reason, "quantized to f8_e4m3 on each call") &&
                     strstr(reason, fmha_layer_kernel(layer)->name),
                 "fp8_compute layer %zu: path %s (%s)", i,
                 fmha_layer_path_name(fmha_layer_get_path(layer, NULL)), reason);
        TU_CHECK(strstr(fmha_layer_kernel(layer)->name, "_f32") != NULL,
                 "the FP8 path runs an f32 kernel, not %s", fmha_layer_kernel(layer)->name);
        fmha_kernel_info info;
        TU_CHECK(fmha_kernel_select(&cfg, &info) == FMHA_STATUS_OK &&
                     info.id == fmha_layer_kernel(layer)->id,
                 "fmha_kernel_select and the layer disagree on fp8_compute");
        for (int z = 0; z < 3; z++) {
            conv_case cc;
            conv_init(&cc, runs[i].dt, sizes[z][0], sizes[z][1], runs[i].varlen, runs[i].mode, &r);
            conv_out got, want, ref;
            out_init(&got, &cc, runs[i].odt);
            out_init(&want, &cc, runs[i].odt);
            out_init(&ref, &cc, FMHA_DTYPE_F32);
            cc.a.out = got.out.t;
            cc.a.lse = got.lse;
            st = fmha_layer_forward(layer, &cc.a);
            TU_CHECK(st == FMHA_STATUS_OK, "fp8_compute %zu size %d: %s", i, z, fmha_last_error());
            cc.a.out = want.out.t;
            cc.a.lse = want.lse;
            st = explicit_fp8(&cfg, &cc.a);
            TU_CHECK(st == FMHA_STATUS_OK, "explicit FP8 %zu: %s", i, fmha_last_error());
            TU_CHECK(out_same(&got, &want),
                     "fp8_compute %zu size %d differs from quantize + FP8 "
                     "attention",
                     i, z);
            /* And it is attention: near the exact answer on the unquantized inputs
             * (the reference ignores fp8_compute). */
            cc.a.out = ref.out.t;
            cc.a.lse = ref.lse;
            TU_CHECK(fmha_reference_forward(&cc.cfg, &cc.a) == FMHA_STATUS_OK, "reference: %s",
                     fmha_last_error());
            double e = tu_rel_l2(&got.out, &ref.out);
            TU_CHECK(e < 0.06, "fp8_compute %zu size %d: relative L2 %.3g from the reference", i, z,
                     e);
            out_free(&got);
            out_free(&want);
            out_free(&ref);
            conv_free(&cc);
        }
        fmha_layer_free(layer);
    }
}

/* The reference ignores fp8_compute: the same bytes with it on and off. */
static void test_reference_ignores_compute(void)
{
    tu_rng r = {4};
    conv_case cc;
    conv_init(&cc, FMHA_DTYPE_BF16, 65, 70, 0, FMHA_FP8_COMPUTE_PER_TENSOR, &r);
    conv_out x, y;
    out_init(&x, &cc, FMHA_DTYPE_F32);
    out_init(&y, &cc, FMHA_DTYPE_F32);
    cc.a.out = x.out.t;
    cc.a.lse = x.lse;
    TU_CHECK(fmha_reference_forward(&cc.cfg, &cc.a) == FMHA_STATUS_OK, "%s", fmha_last_error());
    cc.cfg.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    cc.a.out = y.out.t;
    cc.a.lse = y.lse;
    TU_CHECK(fmha_reference_forward(&cc.cfg, &cc.a) == FMHA_STATUS_OK, "%s", fmha_last_error());
    TU_CHECK(out_same(&x, &y), "the reference depends on fp8_compute");
    out_free(&x);
    out_free(&y);
    conv_free(&cc);
}

/* Fallback rules: the layer asks the chooser for an FP8 kernel; without one
 * (here FMHA_FP8_ATTN=0; on CUDA, until a GPU FP8 path exists) it runs
 * cfg.dtype's kernel, bit for bit what a plain layer computes, and says why.
 * A configuration the fallback cannot run either fails as that one does. */
/* A fallen-back layer gives a plain bf16 layer's bits, out and lse. */
static void check_same_bits(fmha_layer *layer, fmha_layer *plain, conv_case *cc, const char *what)
{
    conv_out x, y;
    out_init(&x, cc, FMHA_DTYPE_BF16);
    out_init(&y, cc, FMHA_DTYPE_BF16);
    cc->a.out = x.out.t;
    cc->a.lse = x.lse;
    TU_CHECK(fmha_layer_forward(layer, &cc->a) == FMHA_STATUS_OK, "%s: %s", what,
             fmha_last_error());
    cc->a.out = y.out.t;
    cc->a.lse = y.lse;
    TU_CHECK(fmha_layer_forward(plain, &cc->a) == FMHA_STATUS_OK, "%s", fmha_last_error());
    TU_CHECK(out_same(&x, &y), "%s differs from a plain bf16 layer", what);
    out_free(&x);
    out_free(&y);
}

static void test_compute_fallback(void)
{
    tu_rng r = {77};
    conv_case cc;
    conv_init(&cc, FMHA_DTYPE_BF16, 113, 200, 0, FMHA_FP8_COMPUTE_PER_TENSOR, &r);
    fmha_config plain = cc.cfg;
    plain.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    fmha_layer *direct, *layer;
    TU_CHECK(fmha_layer_init(&direct, &plain) == FMHA_STATUS_OK, "%s", fmha_last_error());
    const char *reason;
    TU_CHECK(fmha_layer_get_path(direct, &reason) == FMHA_LAYER_PATH_DIRECT &&
                 strstr(reason, "fp8_compute is off"),
             "plain layer: path %d (%s)", (int)fmha_layer_get_path(direct, NULL), reason);

    setenv("FMHA_FP8_ATTN", "0", 1);
    fmha_status st = fmha_layer_init(&layer, &cc.cfg);
    TU_CHECK(st == FMHA_STATUS_OK, "FMHA_FP8_ATTN=0: %s", fmha_last_error());
    if (st == FMHA_STATUS_OK) {
        TU_CHECK(fmha_layer_get_path(layer, &reason) == FMHA_LAYER_PATH_FP8_FALLBACK &&
                     strstr(reason, "FMHA_FP8_ATTN=0") && strstr(reason, "running bf16 on"),
                 "FMHA_FP8_ATTN=0: path %s (%s)",
                 fmha_layer_path_name(fmha_layer_get_path(layer, NULL)), reason);
        TU_CHECK(fmha_layer_kernel(layer)->id == fmha_layer_kernel(direct)->id,
                 "the fallback runs %s, a plain bf16 layer %s", fmha_layer_kernel(layer)->name,
                 fmha_layer_kernel(direct)->name);
        TU_CHECK(fmha_last_error()[0] == '\0', "a fallback is not an error: \"%s\"",
                 fmha_last_error());
        check_same_bits(layer, direct, &cc, "the FMHA_FP8_ATTN=0 fallback");
        fmha_layer_free(layer);
    }
    setenv("FMHA_FP8_ATTN", "1", 1);
    TU_CHECK(fmha_layer_init(&layer, &cc.cfg) == FMHA_STATUS_OK &&
                 fmha_layer_get_path(layer, NULL) == FMHA_LAYER_PATH_FP8,
             "FMHA_FP8_ATTN=1 must leave the FP8 path on: %s", fmha_last_error());
    fmha_layer_free(layer);
    unsetenv("FMHA_FP8_ATTN");
    fmha_layer_free(direct);

    /* CUDA: f8 there is the chooser's to refuse, so fp8_compute falls back to
     * the bf16 kernel when one runs, and fails as bf16 does when none does. */
    fmha_config cu = cc.cfg, cu_bf16 = plain;
    cu.device = cu_bf16.device = FMHA_DEVICE_CUDA;
    fmha_kernel_info info;
    fmha_status want = fmha_kernel_select(&cu_bf16, &info);
    char want_msg[1024];
    snprintf(want_msg, sizeof want_msg, "%s", fmha_last_error());
    layer = NULL;
    st = fmha_layer_init(&layer, &cu);
    TU_CHECK(st == want, "CUDA fp8_compute: %s, bf16 there: %s", fmha_status_string(st),
             fmha_status_string(want));
    if (st == FMHA_STATUS_OK) {
        fmha_layer_path path = fmha_layer_get_path(layer, &reason);
        TU_CHECK(path == FMHA_LAYER_PATH_FP8_FALLBACK ||
                     (path == FMHA_LAYER_PATH_FP8 &&
                      fmha_layer_kernel(layer)->device == FMHA_DEVICE_CPU),
                 "CUDA fp8_compute: path %s (%s)", fmha_layer_path_name(path), reason);
    } else {
        TU_CHECK(!strcmp(fmha_last_error(), want_msg),
                 "CUDA fp8_compute fails with \"%s\", bf16 "
                 "with \"%s\"",
                 fmha_last_error(), want_msg);
    }
    fmha_layer_free(layer);
    conv_free(&cc);
}

/* fp8_compute = int8_qk has no CPU kernel: a CPU layer runs cfg.dtype, says
 * why, and gives a plain bf16 layer's bits; softcap is refused at init with
 * the reason and the fix. */
static void test_int8_qk_cpu(void)
{
    tu_rng r = {31};
    conv_case cc;
    conv_init(&cc, FMHA_DTYPE_BF16, 77, 130, 0, FMHA_FP8_COMPUTE_INT8_QK, &r);
    fmha_config plain = cc.cfg;
    plain.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    fmha_layer *direct, *layer;
    TU_CHECK(fmha_layer_init(&direct, &plain) == FMHA_STATUS_OK, "%s", fmha_last_error());
    TU_CHECK(fmha_layer_init(&layer, &cc.cfg) == FMHA_STATUS_OK, "int8_qk on the CPU: %s",
             fmha_last_error());
    const char *reason = "";
    TU_CHECK(fmha_layer_get_path(layer, &reason) == FMHA_LAYER_PATH_FP8_FALLBACK &&
                 strstr(reason, "has no INT8 Q K^T") && strstr(reason, "running bf16 on"),
             "int8_qk on the CPU: path %s (%s)",
             fmha_layer_path_name(fmha_layer_get_path(layer, NULL)), reason);
    check_same_bits(layer, direct, &cc, "the int8_qk fallback");
    fmha_layer_free(layer);
    fmha_layer_free(direct);

    fmha_config capped = cc.cfg;
    capped.softcap = 30;
    layer = NULL;
    fmha_status st = fmha_layer_init(&layer, &capped);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && !layer && strstr(fmha_last_error(), "int8_qk") &&
                 strstr(fmha_last_error(), "softcap (30)") &&
                 strstr(fmha_last_error(), "Set softcap = 0"),
             "int8_qk with softcap: %s (%s)", fmha_status_string(st), fmha_last_error());
    capped.fp8_compute = (fmha_fp8_compute)(FMHA_FP8_COMPUTE_INT8_QK + 1);
    capped.softcap = 0;
    st = fmha_layer_init(&layer, &capped);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "fp8_compute (4) is not a fmha_fp8_compute value"),
             "fp8_compute 4: %s", fmha_last_error());
    conv_free(&cc);
}

/* Errors on the FP8 path: checked before anything is written. */
static void test_compute_errors(void)
{
    tu_rng r = {12};
    conv_case cc;
    conv_init(&cc, FMHA_DTYPE_BF16, 20, 30, 0, FMHA_FP8_COMPUTE_PER_BLOCK, &r);
    fmha_layer *layer;
    TU_CHECK(fmha_layer_init(&layer, &cc.cfg) == FMHA_STATUS_OK, "%s", fmha_last_error());
    conv_out o;
    out_init(&o, &cc, FMHA_DTYPE_BF16);
    cc.a.out = o.out.t;
    cc.a.lse = o.lse;

    /* An infinity in k: the quantizer's error, named for k. */
    uint16_t *krow = (uint16_t *)fmha_row(&cc.a.k, 1, 17, 1);
    const uint16_t saved = krow[5];
    krow[5] = 0xFF80; /* bf16 -inf */
    fmha_status st = fmha_layer_forward(layer, &cc.a);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "quantizing k to FP8 (fp8_compute): x[1, 17, 1, 5] is "
                                           "infinite"),
             "inf in k: %s (%s)", fmha_status_string(st), fmha_last_error());
    TU_CHECK(out_poisoned(&o), "inf in k: out or lse written");
    krow[5] = saved;

    /* Inputs of another dtype than the layer's, and descales. */
    cc.a.v.dtype = FMHA_DTYPE_F16;
    st = fmha_layer_forward(layer, &cc.a);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "v.dtype (f16) differs from the layer's dtype (bf16)"),
             "f16 v: %s", fmha_last_error());
    cc.a.v.dtype = FMHA_DTYPE_BF16;
    const float one = 1.0f;
    cc.a.descale_k = &one;
    st = fmha_layer_forward(layer, &cc.a);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), "descale_k is given"),
             "descales on fp8_compute: %s", fmha_last_error());
    cc.a.descale_k = NULL;
    TU_CHECK(out_poisoned(&o), "a failed call wrote out or lse");
    st = fmha_layer_forward(layer, &cc.a);
    TU_CHECK(st == FMHA_STATUS_OK && !out_poisoned(&o) && fmha_last_error()[0] == '\0',
             "after the errors: %s", fmha_last_error());
    out_free(&o);
    fmha_layer_free(layer);
    conv_free(&cc);
}

/* fp8_smooth_k: K's per-channel mean out before quantizing. K gets four
 * channels offset by +20 .. +100, times a factor per (batch entry, KV head) so
 * that a mean taken from the wrong one shows. Smoothed, the output is back
 * at the Gaussian inputs' error and far below the unsmoothed run's; the LSE
 * is the exact one within FP8's error (uncorrected, it would be off by
 * scale * q . mean, ~10 here); padded and packed batches, per-tensor and
 * per-block scales, bf16 and f32 inputs, GQA 4/2, causal; the layer's reason
 * says so, and the output buffers outside out/lse stay poisoned. */
static void test_smooth_k(void)
{
    static const float offset[4] = {20, 40, 70, 100};
    tu_rng r = {2024};
    for (int run = 0; run < 4; run++) {
        const int varlen = run % 2;
        const fmha_fp8_compute mode =
            run < 2 ? FMHA_FP8_COMPUTE_PER_TENSOR : FMHA_FP8_COMPUTE_PER_BLOCK;
        conv_case cc;
        conv_init(&cc, run < 2 ? FMHA_DTYPE_BF16 : FMHA_DTYPE_F32, 150, 260, varlen, mode, &r);
        const fmha_tensor *kt = &cc.k.t;
        for (int64_t b = 0; b < kt->batch; b++)
            for (int64_t s = 0; s < kt->seqlen; s++)
                for (int64_t h = 0; h < kt->heads; h++)
                    for (int j = 0; j < 4; j++) {
                        const int64_t c = (j * 37 + 5) % kt->head_dim;
                        const float x = (float)tu_get(&cc.k, b, s, h, c);
                        set_x(&cc.k, b, s, h, c, x + offset[j] * (float)(1 + b + 2 * h) / 3.0f);
                    }
        conv_out ref, plain, smooth;
        out_init(&ref, &cc, FMHA_DTYPE_F32);
        out_init(&plain, &cc, FMHA_DTYPE_F32);
        out_init(&smooth, &cc, FMHA_DTYPE_F32);
        cc.a.out = ref.out.t;
        cc.a.lse = ref.lse;
        TU_CHECK(fmha_reference_forward(&cc.cfg, &cc.a) == FMHA_STATUS_OK, "reference: %s",
                 fmha_last_error());
        cc.a.out = plain.out.t;
        cc.a.lse = plain.lse;
        TU_CHECK(fmha_forward(&cc.cfg, &cc.a) == FMHA_STATUS_OK, "unsmoothed: %s",
                 fmha_last_error());
        fmha_config cs = cc.cfg;
        cs.fp8_smooth_k = 1;
        fmha_layer *layer;
        fmha_status st = fmha_layer_init(&layer, &cs);
        TU_CHECK(st == FMHA_STATUS_OK, "fp8_smooth_k layer: %s", fmha_last_error());
        if (st == FMHA_STATUS_OK) {
            const char *reason;
            TU_CHECK(fmha_layer_get_path(layer, &reason) == FMHA_LAYER_PATH_FP8 &&
                         strstr(reason, "K's per-channel mean subtracted first"),
                     "fp8_smooth_k path: %s", reason);
            cc.a.out = smooth.out.t;
            cc.a.lse = smooth.lse;
            st = fmha_layer_forward(layer, &cc.a);
            TU_CHECK(st == FMHA_STATUS_OK, "fp8_smooth_k forward: %s", fmha_last_error());
            fmha_layer_free(layer);
        }
        const double ep = tu_rel_l2(&plain.out, &ref.out), es = tu_rel_l2(&smooth.out, &ref.out);
        TU_CHECK(es < 0.06 && es < ep / 3,
                 "run %d: smoothed K %.3g, unsmoothed %.3g from the "
                 "reference",
                 run, es, ep);
        TU_CHECK(tu_gaps_untouched(&smooth.out, 0xFF), "run %d: smoothing wrote outside out", run);
        int bad = 0;
        const double worst = tu_lse_err(smooth.lse, ref.lse, (int64_t)smooth.nlse, &bad);
        TU_CHECK(worst < 0.25 && !bad,
                 "run %d: smoothed LSE off by %.3g (rows without keys or "
                 "non-finite values: %d)",
                 run, worst, bad);
        out_free(&ref);
        out_free(&plain);
        out_free(&smooth);
        conv_free(&cc);
    }
}

int main(void)
{
    unsetenv("FMHA_FP8_ATTN");
    tbl_init();
    test_decode_and_round_trip();
    test_encode_fixed();
    test_encode_vs_reference();
    test_quantize_sweep();
    test_quantize_degenerate_groups();
    test_quantize_broadcast_view();
    test_quantize_large();
    test_errors();
    /* FMHA_TEST_CASES trims the random cases for slow builds (sanitizers). */
    const char *env = getenv("FMHA_TEST_CASES");
    test_attention_cases(env ? atoi(env) / 8 + 1 : 30);
    test_compute_matches_explicit();
    test_reference_ignores_compute();
    test_compute_fallback();
    test_int8_qk_cpu();
    test_compute_errors();
    test_smooth_k();
    return tu_summary();
}
