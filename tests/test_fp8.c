/* test_fp8.c — FP8 E4M3 conversions against an independent nearest-value
 * encoder (every code, random floats, every midpoint and its neighbours), and
 * fmha_quantize_fp8 against scales and codes recomputed here: every scaling,
 * input dtype and layout, padded outputs, degenerate groups, and every
 * argument check leaving y and scales untouched. */
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
        {0.0f, 0x00},           {-0.0f, 0x80},          {1.0f, 0x38},
        {0x1p-6f, 0x08},        {0x1p-9f, 0x01},        {0x1p-10f, 0x00}, /* tie to 0 */
        {-0x1p-10f, 0x80},      {0x1.000002p-10f, 0x01}, {0x1p-11f, 0x00},
        {3 * 0x1p-10f, 0x02},   /* tie between 1 and 2 */
        {15 * 0x1p-10f, 0x08},  /* tie between 7 * 2^-9 and 2^-6 */
        {FLT_TRUE_MIN, 0x00},   {-FLT_TRUE_MIN, 0x80},  {FLT_MIN, 0x00},
        {1.0625f, 0x38},        {1.1875f, 0x3A},        {-1.1875f, 0xBA},
        {416.0f, 0x7D},         {432.0f, 0x7E}, /* tie between 416 (0x7D) and 448 */
        {447.99f, 0x7E},        {448.0f, 0x7E},         {449.0f, 0x7E},
        {464.0f, 0x7E},         {465.0f, 0x7E},         {-465.0f, 0xFE},
        {1e30f, 0x7E},          {FLT_MAX, 0x7E},        {INFINITY, 0x7E},
        {-INFINITY, 0xFE},      {NAN, 0x7F},
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
    const float extra[] = {448.0f, 464.0f, nextafterf(464.0f, 0.0f), nextafterf(464.0f, INFINITY),
                           480.0f, 600.0f, 0x1p-10f, nextafterf(0x1p-10f, 0.0f), FLT_TRUE_MIN};
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

static int64_t group_of(const fmha_tensor *t, fmha_fp8_scaling sc, int64_t br, int64_t b,
                        int64_t s, int64_t h)
{
    if (sc == FMHA_FP8_PER_TENSOR)
        return 0;
    int64_t nblk = n_blocks(t, sc, br);
    return (b * t->heads + h) * nblk + (sc == FMHA_FP8_PER_BLOCK ? s / br : 0);
}

static uint8_t y_code(const tu_tensor *y, int64_t b, int64_t s, int64_t h, int64_t c)
{
    const fmha_tensor *t = &y->t;
    return ((const uint8_t *)y->alloc)[b * t->stride_batch + s * t->stride_seq +
                                        h * t->stride_head + c];
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
    } modes[] = {{FMHA_FP8_PER_TENSOR, 0}, {FMHA_FP8_PER_HEAD, 0}, {FMHA_FP8_PER_BLOCK, 4},
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
            set_x(&x, 0, s, 2, c, (c % 2) ? NAN : -NAN);        /* all NaN */
            set_x(&x, 1, s, 0, c, FLT_TRUE_MIN);                /* amax / 448 underflows */
            set_x(&x, 1, s, 1, c, (float)(c - 2) * 1e-40f);     /* subnormal scale */
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
 * and nothing written. */
static void expect_invalid(err_fixture *f, const fmha_tensor *x, fmha_tensor *y, float *scales,
                           fmha_fp8_scaling sc, int64_t br, const char *phrase)
{
    fmha_status st = fmha_quantize_fp8(x, y, scales, sc, br);
    const char *msg = fmha_last_error();
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT, "[%s]: status %s", phrase,
             fmha_status_string(st));
    TU_CHECK(strstr(msg, phrase) != NULL, "message \"%s\" lacks \"%s\"", msg, phrase);
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

    /* block_rows is ignored outside PER_BLOCK, and a success clears the error. */
    ef_init(&f);
    fmha_status st = fmha_quantize_fp8(&f.x, &f.y, f.scales, FMHA_FP8_PER_HEAD, -5);
    TU_CHECK(st == FMHA_STATUS_OK && fmha_last_error()[0] == '\0',
             "PER_HEAD with block_rows -5: %s (%s)", fmha_status_string(st), fmha_last_error());
}

int main(void)
{
    tbl_init();
    test_decode_and_round_trip();
    test_encode_fixed();
    test_encode_vs_reference();
    test_quantize_sweep();
    test_quantize_degenerate_groups();
    test_quantize_broadcast_view();
    test_errors();
    return tu_summary();
}
