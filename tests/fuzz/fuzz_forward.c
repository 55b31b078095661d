/* fuzz_forward.c — libFuzzer harness of the C API's forward call on the CPU
 * (include/fmha.h). The input's bytes choose a configuration (heads, KV
 * heads, head dims, dtype, causal, windows, softcap, scale, dropout, ISA,
 * threads, FP8 compute) and the call's views (batch, lengths, strides
 * including zero, negative, huge and overflowing ones, NULL data, packed
 * batches with cu_seqlens, descales, LSE, out in place of q), all small so
 * that an execution takes milliseconds.
 *
 * Views the harness believes in bounds get an allocation of exactly their
 * extent (so ASan catches a read or write one byte past it), their gaps
 * filled with NaN bytes (a kernel that reads one shows it in its output).
 * Views it knows to be invalid get a small dummy buffer, views too large to
 * allocate NULL: the library must refuse the call then. out and lse are
 * poisoned with the NaN pattern 0x7fc0dead. Then fmha_forward:
 *
 *   - on an error: fmha_last_error() says something, and out, lse and the
 *     inputs are byte for byte what they were;
 *   - on success: the reference (fmha_reference_forward) accepts the call
 *     too; out and lse agree with it within 4x the error of a naive
 *     same-precision implementation (tu_naive_forward, as tests/cases.c
 *     does); every byte of out and lse outside the written rows is as it
 *     was; the inputs are unchanged; the call again on another thread count
 *     gives the same bits; with fp8_compute, the bits are those of
 *     fmha_quantize_fp8 followed by FP8 attention (fmha.h's promise).
 *
 * A broken promise calls __builtin_trap(), which libFuzzer reports. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The case being run, printed with a failure (and with each input when
 * FUZZ_FORWARD_VERBOSE is set, which also prints the call's outcome). */
static char g_desc[1024];
static int g_verbose;

/* What the executions did, printed at exit: whether the fuzzer reaches the
 * kernels at all, and each kind of check. */
static struct {
    long inputs, too_big, refused, ran, empty, compared, fp8_bits, in_place, overlapping, packed,
        mods;
} g_count;

static void print_counts(void)
{
    fprintf(stderr,
            "fuzz_forward: %ld inputs: %ld too big to run, %ld refused, %ld ran (%ld without a "
            "query row, %ld compared with the reference, %ld fp8_compute bit checks, %ld in "
            "place, %ld packed, %ld with overlapping out rows, %ld with score modifiers)\n",
            g_count.inputs, g_count.too_big, g_count.refused, g_count.ran, g_count.empty,
            g_count.compared, g_count.fp8_bits, g_count.in_place, g_count.packed,
            g_count.overlapping, g_count.mods);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    g_verbose = getenv("FUZZ_FORWARD_VERBOSE") != NULL;
    atexit(print_counts);
    return 0;
}

#define REQUIRE(cond)                                                                             \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fprintf(stderr, "fuzz_forward: %s:%d: %s (last error: \"%s\")\ncase: %s\n", __FILE__, \
                    __LINE__, #cond, fmha_last_error(), g_desc);                                  \
            __builtin_trap();                                                                     \
        }                                                                                         \
    } while (0)

/* Small problems only, so that each execution is fast under the sanitizers. */
#define MAX_VIEW_BYTES ((int64_t)1 << 19) /* one view's allocation */
#define MAX_ELEMS      ((int64_t)1 << 13) /* one view's elements */
#define MAX_WORK       ((int64_t)1 << 20) /* query x key x channel products of a call */
#define MAX_SEQS       8                  /* packed sequences with real cu_seqlens */

static const unsigned char SENTINEL[4] = {0xad, 0xde, 0xc0, 0x7f}; /* 0x7fc0dead, a NaN */

/* -------------------------------------------------------------- the input */

typedef struct reader {
    const uint8_t *p;
    size_t n;
} reader;

/* The next byte; 0 once the input is used up, so short inputs mean defaults. */
static unsigned next_byte(reader *r)
{
    if (r->n == 0)
        return 0;
    r->n--;
    return *r->p++;
}

static unsigned pick(reader *r, unsigned n)
{
    return next_byte(r) % n;
}

#define CHOOSE(r, table) ((table)[pick((r), sizeof(table) / sizeof((table)[0]))])

/* ---------------------------------------------------------------- views */

typedef struct view {
    fmha_tensor t;
    unsigned char *alloc; /* the view's bytes, exactly; NULL when not allocated */
    size_t bytes;
    int ok; /* 0: the library must refuse a call with this view */
} view;

static unsigned char g_dummy[64]; /* data of views that must be refused unread */

/* Bytes the view spans (fmha.h: strides >= 0, stride_dim 1; batch and
 * seqlen may be 0, an empty view), or -1 when it is invalid or its size
 * overflows. The extent of an empty view is computed as the library does
 * (a dim of 0 takes one stride off), and then it spans 0 bytes. */
static int64_t view_extent_bytes(const fmha_tensor *t)
{
    const int64_t dims[3] = {t->batch, t->seqlen, t->heads};
    const int64_t strides[3] = {t->stride_batch, t->stride_seq, t->stride_head};
    const int64_t es = (int64_t)fmha_dtype_size(t->dtype);
    if (es == 0 || t->batch < 0 || t->seqlen < 0 || t->heads <= 0 || t->head_dim <= 0 ||
        t->stride_dim != 1)
        return -1;
    int64_t extent = t->head_dim, span;
    for (int i = 0; i < 3; i++)
        if (strides[i] < 0 || __builtin_mul_overflow(dims[i] - 1, strides[i], &span) ||
            __builtin_add_overflow(extent, span, &extent))
            return -1;
    if (__builtin_mul_overflow(extent, es, &extent))
        return -1;
    return t->batch == 0 || t->seqlen == 0 ? 0 : extent;
}

static void view_make(reader *r, view *v, fmha_dtype dt, int64_t b, int64_t s, int64_t h, int64_t d)
{
    memset(v, 0, sizeof *v);
    fmha_tensor t = fmha_tensor_bshd(NULL, dt, b, s, h, d);
    static const int layouts[] = {0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 8};
    const int layout = CHOOSE(r, layouts);
    int64_t *strides[3] = {&t.stride_batch, &t.stride_seq, &t.stride_head};
    int64_t *st = strides[pick(r, 3)];
    switch (layout) {
    case 1: t = fmha_tensor_bhsd(NULL, dt, b, s, h, d); break;
    case 2: /* gaps after each row, token and batch entry */
        t.stride_head = d + pick(r, 5);
        t.stride_seq = h * t.stride_head + pick(r, 9);
        t.stride_batch = s * t.stride_seq + pick(r, 17);
        break;
    case 3: *st = 0; break; /* broadcast */
    case 4: *st = -(int64_t)(1 + pick(r, 64)); break;
    case 5: *st = (int64_t)1 << (28 + pick(r, 30)); break;
    case 6: *st = INT64_MAX / (1 + pick(r, 3)); break;
    case 7: t.stride_dim = pick(r, 2) ? 0 : 2; break;
    case 8: *st = pick(r, 5); break; /* rows that overlap */
    }
    v->t = t;
    const int64_t bytes = view_extent_bytes(&t);
    if (bytes < 0) {
        v->t.data = g_dummy; /* invalid: refused before any read */
        return;
    }
    v->ok = 1;
    if (t.batch == 0 || t.seqlen == 0) { /* empty: fmha.h lets its data be NULL */
        if (pick(r, 2)) {
            v->bytes = 16;
            v->alloc = malloc(v->bytes);
            REQUIRE(v->alloc != NULL);
            memset(v->alloc, 0xFF, v->bytes);
            v->t.data = v->alloc;
        }
        return;
    }
    if (bytes > MAX_VIEW_BYTES || pick(r, 32) == 0) {
        v->ok = 0;
        return; /* NULL data: refused */
    }
    v->alloc = malloc((size_t)bytes);
    REQUIRE(v->alloc != NULL);
    v->bytes = (size_t)bytes;
    memset(v->alloc, 0xFF, v->bytes); /* NaN in every dtype: gaps that are read show */
    v->t.data = v->alloc;
}

static void view_free(view *v)
{
    free(v->alloc);
    v->alloc = NULL;
}

static tu_tensor as_tu(const fmha_tensor *t, size_t bytes)
{
    tu_tensor x = {*t, t->data, bytes};
    return x;
}

static int64_t elements(const fmha_tensor *t)
{
    int64_t n = 1;
    const int64_t dims[4] = {t->batch, t->seqlen, t->heads, t->head_dim};
    for (int i = 0; i < 4; i++)
        if (dims[i] <= 0 || __builtin_mul_overflow(n, dims[i], &n))
            return -1;
    return n;
}

static unsigned char *elem_at(const fmha_tensor *t, int64_t b, int64_t s, int64_t h, int64_t c)
{
    return (unsigned char *)t->data +
           (b * t->stride_batch + s * t->stride_seq + h * t->stride_head + c) *
               (int64_t)fmha_dtype_size(t->dtype);
}

/* Random values of N(0, sigma^2) in every element of the view (FP8: codes of
 * such values, never NaN). */
static void view_fill(view *v, tu_rng *rng, double sigma)
{
    if (!v->ok)
        return;
    const fmha_tensor *t = &v->t;
    tu_tensor x = as_tu(t, v->bytes);
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++) {
                    const double x0 = sigma * tu_normal(rng);
                    if (t->dtype == FMHA_DTYPE_F8_E4M3)
                        *elem_at(t, b, s, h, c) = fmha_f32_to_e4m3((float)x0);
                    else
                        tu_set(&x, b, s, h, c, x0);
                }
}

static void poison(unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = SENTINEL[i % 4];
}

static unsigned char *copy_of(const void *p, size_t n)
{
    unsigned char *c = malloc(n ? n : 1);
    REQUIRE(c != NULL);
    if (n)
        memcpy(c, p, n);
    return c;
}

/* ------------------------------------------------------------- the case */

typedef struct fcase {
    fmha_config cfg;
    fmha_forward_args a;
    view q, k, v, out;
    int alias;     /* out is q's view */
    int overlap;   /* rows of out share memory: what lands there is undefined (fmha.h) */
    int must_fail; /* the harness knows the call is invalid */
    int32_t *cuq, *cuk;
    int64_t nseq; /* packed: sequences with real cu_seqlens (0: padded batch) */
    float *lse;   /* allocation of a.lse */
    size_t lse_n; /* its floats */
    float *ds[3]; /* descales */
    int64_t ds_n[3];
    void *mask; /* score modifiers' arrays */
    float *slopes, *sinks;
} fcase;

/* Descales that fmha.h's layout reads for view t (q, k or v); -1 for a
 * layout the library must refuse before reading any. */
static int64_t descale_count(const fcase *c, const fmha_tensor *t)
{
    int64_t n = 1;
    switch (c->a.descale_layout) {
    case FMHA_DESCALE_PER_TENSOR: return 1;
    case FMHA_DESCALE_PER_KV_HEAD: {
        const int64_t batch = c->a.cu_seqlens_q ? c->a.varlen_batch : t->batch;
        if (batch < 0 || c->cfg.num_kv_heads <= 0 ||
            __builtin_mul_overflow(batch, c->cfg.num_kv_heads, &n))
            return -1;
        return n;
    }
    case FMHA_DESCALE_PER_BLOCK: {
        const int64_t r = c->a.descale_block_rows;
        if (r <= 0 || view_extent_bytes(t) < 0)
            return -1;                                          /* (an empty view's count is 0) */
        return t->batch * t->heads * ((t->seqlen + r - 1) / r); /* a small view: no overflow */
    }
    default: return -1;
    }
}

static void case_free(fcase *c)
{
    view_free(&c->q);
    view_free(&c->k);
    view_free(&c->v);
    if (!c->alias)
        view_free(&c->out);
    free(c->cuq);
    free(c->cuk);
    free(c->lse);
    for (int i = 0; i < 3; i++)
        free(c->ds[i]);
    free(c->mask);
    free(c->slopes);
    free(c->sinks);
}

/* The score modifiers (fmha_forward_args): a mask over [sequences, heads,
 * seqlen_q, seqlen_k] of the views (enough for a packed batch's sequences
 * too) of any type, its strides full or 0 (broadcast), now and then a
 * negative one or a type that does not exist; ALiBi slopes per head or per
 * sequence, sinks (some -inf), now and then a value the library must
 * refuse. Values are finite or -inf. */
static void mods_make(reader *r, fcase *c, tu_rng *rng)
{
    fmha_forward_args *a = &c->a;
    const int64_t H = c->cfg.num_heads > 0 ? c->cfg.num_heads : 1;
    const int64_t seqs = a->cu_seqlens_q  ? (c->nseq > 0 ? c->nseq : 1)
                         : a->q.batch > 0 ? a->q.batch
                                          : 1;
    const int64_t sq = a->q.seqlen > 0 ? a->q.seqlen : 1, sk = a->k.seqlen > 0 ? a->k.seqlen : 1;
    if (pick(r, 2) == 0 && seqs * H * sq * sk <= 4 * MAX_ELEMS) {
        static const fmha_mask_type type_t[] = {FMHA_MASK_BOOL,     FMHA_MASK_BOOL,
                                                FMHA_MASK_ADD_F32,  FMHA_MASK_ADD_F16,
                                                FMHA_MASK_ADD_BF16, (fmha_mask_type)9};
        fmha_attn_mask *m = &a->mask;
        m->type = CHOOSE(r, type_t);
        const int64_t n = seqs * H * sq * sk;
        const size_t es = m->type == FMHA_MASK_ADD_F32 ? 4 : m->type == FMHA_MASK_BOOL ? 1 : 2;
        c->mask = malloc(es * (size_t)n);
        REQUIRE(c->mask != NULL);
        for (int64_t e = 0; e < n; e++) {
            const int hide = pick(r, 8) == 0 || tu_range(rng, 6) == 0;
            const float x = hide ? -INFINITY : (float)(2.0 * tu_normal(rng));
            if (es == 1)
                ((unsigned char *)c->mask)[e] = (unsigned char)!hide;
            else if (es == 4)
                ((float *)c->mask)[e] = x;
            else
                ((uint16_t *)c->mask)[e] =
                    m->type == FMHA_MASK_ADD_F16 ? fmha_f32_to_f16(x) : fmha_f32_to_bf16(x);
        }
        m->data = c->mask;
        const int64_t full[4] = {H * sq * sk, sq * sk, sk, 1};
        int64_t *strides[4] = {&m->stride_batch, &m->stride_head, &m->stride_q, &m->stride_k};
        for (int i = 0; i < 4; i++)
            *strides[i] = pick(r, 3) == 0 ? 0 : full[i];
        if (pick(r, 16) == 0)
            *strides[pick(r, 4)] = -1;
        c->must_fail |= (unsigned)m->type > FMHA_MASK_ADD_BF16 || m->stride_batch < 0 ||
                        m->stride_head < 0 || m->stride_q < 0 || m->stride_k < 0;
    }
    if (pick(r, 2) == 0) {
        static const int64_t stride_t[] = {0, 0, 1, 2, -1}; /* x H (1, 2), or -1 */
        const int64_t k = CHOOSE(r, stride_t);
        a->alibi_stride_batch = k < 0 ? -1 : k * H;
        const int64_t n = (seqs - 1) * (k > 0 ? k * H : 0) + H;
        c->slopes = malloc(sizeof(float) * (size_t)n);
        REQUIRE(c->slopes != NULL);
        for (int64_t e = 0; e < n; e++)
            c->slopes[e] = (float)(1.5 * tu_uniform(rng) - 0.5);
        if (pick(r, 16) == 0) {
            static const float bad[] = {NAN, INFINITY, -INFINITY};
            const int64_t e = pick(r, (unsigned)(n < 256 ? n : 256));
            c->slopes[e] = CHOOSE(r, bad);
            /* The call reads the slopes of its sequences only: of none (batch 0)
             * with a batch stride, none. */
            const int64_t read = a->cu_seqlens_q || a->q.batch > 0 || k == 0 ? n : 0;
            c->must_fail |= e < read;
        }
        c->must_fail |= k < 0;
        a->alibi_slopes = c->slopes;
    }
    if (pick(r, 2) == 0) {
        c->sinks = malloc(sizeof(float) * (size_t)H);
        REQUIRE(c->sinks != NULL);
        for (int64_t h = 0; h < H; h++)
            c->sinks[h] = pick(r, 8) == 0 ? -INFINITY : (float)(2.0 * tu_normal(rng));
        if (pick(r, 16) == 0) {
            c->sinks[pick(r, (unsigned)(H < 256 ? H : 256))] = pick(r, 2) ? NAN : INFINITY;
            c->must_fail = 1;
        }
        a->sinks = c->sinks;
    }
}

/* Builds the case from the input. Returns 0 when it is too big to run. */
static int case_make(reader *r, fcase *c, tu_rng *rng)
{
    static const int64_t heads_t[] = {1, 1, 2, 2, 3, 4, 4, 6, 8, 0, -1, 5};
    static const int64_t dims_t[] = {1,  2,  3,  4,  7,   8,   16,  31,  32,  33, 40, 64,
                                     65, 72, 80, 96, 128, 160, 192, 256, 257, 0,  -3, 70000};
    static const fmha_dtype dtypes_t[] = {FMHA_DTYPE_F32,     FMHA_DTYPE_F32,  FMHA_DTYPE_F16,
                                          FMHA_DTYPE_BF16,    FMHA_DTYPE_BF16, FMHA_DTYPE_F8_E4M3,
                                          FMHA_DTYPE_F8_E4M3, (fmha_dtype)9};
    static const fmha_dtype out_t[] = {FMHA_DTYPE_F32,  FMHA_DTYPE_F32,     FMHA_DTYPE_F16,
                                       FMHA_DTYPE_BF16, FMHA_DTYPE_F8_E4M3, (fmha_dtype)-1};
    static const int64_t windows_t[] = {-1, -1, -1, -1, 0, 1, 2, 5, 17, 64, 200, -2, INT64_MAX};
    static const double softcap_t[] = {0, 0, 0, 0.5, 5, 30, -1, NAN, INFINITY};
    static const double scale_t[] = {0, 0, 0, 0.05, 0.125, 0.5, 1, 2, 10, -1, NAN, INFINITY};
    static const double dropout_t[] = {0, 0, 0, 0.1, 0.5, 0.9, -0.1, 1.0, NAN};
    static const fmha_cpu_isa isa_t[] = {
        FMHA_CPU_ISA_AUTO,   FMHA_CPU_ISA_AUTO,        FMHA_CPU_ISA_SCALAR, FMHA_CPU_ISA_AVX2,
        FMHA_CPU_ISA_AVX512, FMHA_CPU_ISA_AVX512_BF16, (fmha_cpu_isa)9};
    static const int threads_t[] = {1, 1, 2, 2, 3, 0, -1};
    static const fmha_device device_t[] = {FMHA_DEVICE_CPU, FMHA_DEVICE_CPU,  FMHA_DEVICE_CPU,
                                           FMHA_DEVICE_CPU, FMHA_DEVICE_CPU,  FMHA_DEVICE_CPU,
                                           FMHA_DEVICE_CPU, FMHA_DEVICE_CUDA, (fmha_device)5};
    static const fmha_fp8_compute fp8c_t[] = {
        FMHA_FP8_COMPUTE_OFF,        FMHA_FP8_COMPUTE_OFF,       FMHA_FP8_COMPUTE_OFF,
        FMHA_FP8_COMPUTE_OFF,        FMHA_FP8_COMPUTE_OFF,       FMHA_FP8_COMPUTE_OFF,
        FMHA_FP8_COMPUTE_PER_TENSOR, FMHA_FP8_COMPUTE_PER_BLOCK, (fmha_fp8_compute)7};
    static const int64_t batch_t[] = {1, 1, 1, 2, 3, 0, -1};
    static const int64_t seq_t[] = {1,  1,   2,   3,   5,   8,   16, 31, 64,
                                    65, 100, 128, 129, 200, 300, 0,  -1};
    static const int64_t nseq_t[] = {1, 1, 2, 2, 3, 4, MAX_SEQS, 0, -1, INT32_MAX, INT64_MAX};
    static const int64_t maxlen_t[] = {0, 0, 0, 0, 1, 1000, -1};
    static const fmha_descale_layout dl_t[] = {FMHA_DESCALE_PER_TENSOR, FMHA_DESCALE_PER_TENSOR,
                                               FMHA_DESCALE_PER_KV_HEAD, FMHA_DESCALE_PER_BLOCK,
                                               (fmha_descale_layout)9};
    static const int64_t rows_t[] = {128, 128, 1, 3, 64, 0, -2};
    static const double sigma_t[] = {1, 1, 0.25, 4};

    memset(c, 0, sizeof *c);
    const int64_t H = CHOOSE(r, heads_t);
    int64_t KV;
    switch (pick(r, 8)) {
    case 0: KV = 1; break;
    case 1: KV = H % 2 == 0 ? H / 2 : H; break;
    case 2: KV = 2; break;
    case 3: KV = H + 1; break;
    case 4: KV = 0; break;
    default: KV = H; break;
    }
    const int64_t D = CHOOSE(r, dims_t);
    fmha_config *cfg = &c->cfg;
    fmha_config_init(cfg, H, KV, D);
    cfg->head_dim_v = pick(r, 4) == 0 ? CHOOSE(r, dims_t) : D;
    cfg->dtype = CHOOSE(r, dtypes_t);
    cfg->causal = pick(r, 8) == 0 ? 2 : (int)pick(r, 2);
    cfg->window_left = CHOOSE(r, windows_t);
    cfg->window_right = CHOOSE(r, windows_t);
    cfg->softcap = CHOOSE(r, softcap_t);
    cfg->softmax_scale = CHOOSE(r, scale_t);
    cfg->dropout_p = CHOOSE(r, dropout_t);
    cfg->cpu_isa = CHOOSE(r, isa_t);
    cfg->num_threads = CHOOSE(r, threads_t);
    cfg->device = CHOOSE(r, device_t);
    cfg->fp8_compute = CHOOSE(r, fp8c_t);
    cfg->fp8_smooth_k = pick(r, 6) == 0 ? (int)pick(r, 3) : 0;
    const int64_t DV = cfg->head_dim_v;
    const fmha_dtype odt = CHOOSE(r, out_t);

    /* Lengths: one padded batch, or packed sequences with cu_seqlens. */
    fmha_forward_args *a = &c->a;
    int64_t B = CHOOSE(r, batch_t), SQ = CHOOSE(r, seq_t), SK = CHOOSE(r, seq_t);
    int64_t pairs = B > 0 && SQ > 0 && SK > 0 ? B * SQ * SK : 0; /* (query, key) pairs */
    if (pick(r, 4) == 0) {
        const int64_t nseq = CHOOSE(r, nseq_t);
        const int real = nseq >= 1 && nseq <= MAX_SEQS;
        const size_t n = real ? (size_t)nseq + 1 : 1;
        c->cuq = calloc(n, sizeof(int32_t));
        c->cuk = calloc(n, sizeof(int32_t));
        REQUIRE(c->cuq && c->cuk);
        pairs = 0;
        for (size_t i = 1; i < n; i++) {
            c->cuq[i] = c->cuq[i - 1] + (int32_t)pick(r, SQ > 0 ? (unsigned)SQ + 1 : 1);
            c->cuk[i] = c->cuk[i - 1] + (int32_t)pick(r, SK > 0 ? (unsigned)SK + 1 : 1);
            pairs += (int64_t)(c->cuq[i] - c->cuq[i - 1]) * (c->cuk[i] - c->cuk[i - 1]);
        }
        c->nseq = real ? nseq : 0;
        c->must_fail |= !real;
        a->cu_seqlens_q = c->cuq;
        a->cu_seqlens_k = c->cuk;
        a->varlen_batch = nseq;
        /* Tokens after the last sequence belong to none: they stay untouched. */
        SQ = c->cuq[n - 1] + pick(r, 3);
        SK = c->cuk[n - 1] + pick(r, 3);
        SQ = SQ > 0 ? SQ : 1;
        SK = SK > 0 ? SK : 1;
        B = pick(r, 16) == 0 ? 2 : 1;
        c->must_fail |= B != 1;
        switch (pick(r, 16)) { /* cu_seqlens fmha.h forbids */
        case 0: c->cuq[0] = 1, c->must_fail = 1; break;
        case 1: c->cuk[n - 1] = (int32_t)SK + 1, c->must_fail = 1; break;
        case 2:
            if (n > 2 && c->cuq[1] > 0)
                c->cuq[2] = c->cuq[1] - 1, c->must_fail = 1;
            break;
        case 3: a->cu_seqlens_k = NULL, c->must_fail = 1; break;
        }
        a->max_seqlen_q = CHOOSE(r, maxlen_t);
        a->max_seqlen_k = CHOOSE(r, maxlen_t);
        c->must_fail |= a->max_seqlen_q < 0 || a->max_seqlen_k < 0;
    }

    /* Every view of the call the configuration describes; sometimes one dim off. */
    int64_t dims[4][4] = {{B, SQ, H, D}, {B, SK, KV, D}, {B, SK, KV, DV}, {B, SQ, H, DV}};
    if (pick(r, 16) == 0) {
        dims[pick(r, 4)][pick(r, 4)] += pick(r, 2) ? 1 : -1;
        c->must_fail = 1;
    }
    for (int i = 0; i < 4; i++) {
        fmha_tensor t =
            fmha_tensor_bshd(NULL, FMHA_DTYPE_F32, dims[i][0], dims[i][1], dims[i][2], dims[i][3]);
        if (elements(&t) > MAX_ELEMS)
            return 0;
    }
    if (H > 0 && D > 0 && DV > 0 && pairs * H * (D + DV) > MAX_WORK)
        return 0; /* dims up to 70000, pairs below 2^22: no overflow */

    view_make(r, &c->q, cfg->dtype, dims[0][0], dims[0][1], dims[0][2], dims[0][3]);
    view_make(r, &c->k, cfg->dtype, dims[1][0], dims[1][1], dims[1][2], dims[1][3]);
    view_make(r, &c->v, cfg->dtype, dims[2][0], dims[2][1], dims[2][2], dims[2][3]);
    /* out in place of q (same view, same dtype): each row is read before it is written. */
    c->alias = pick(r, 8) == 0 && c->q.ok && odt == cfg->dtype &&
               cfg->dtype != FMHA_DTYPE_F8_E4M3 && memcmp(dims[0], dims[3], sizeof dims[0]) == 0;
    if (c->alias)
        c->out = c->q;
    else
        view_make(r, &c->out, odt, dims[3][0], dims[3][1], dims[3][2], dims[3][3]);
    c->must_fail |= !c->q.ok || !c->k.ok || !c->v.ok || !c->out.ok;
    /* fmha.h: out's consecutive rows along a dim of size > 1 must not overlap
     * (an empty out has no rows). */
    const fmha_tensor *o = &c->out.t;
    const int64_t osizes[3] = {o->batch, o->seqlen, o->heads};
    const int64_t ostrides[3] = {o->stride_batch, o->stride_seq, o->stride_head};
    for (int i = 0; i < 3 && o->batch != 0 && o->seqlen != 0; i++)
        c->must_fail |= osizes[i] > 1 && ostrides[i] < o->head_dim;
    const double sigma = CHOOSE(r, sigma_t);
    rng->s = next_byte(r) | (uint64_t)next_byte(r) << 8 | (uint64_t)next_byte(r) << 16;
    view_fill(&c->q, rng, sigma);
    view_fill(&c->k, rng, sigma);
    view_fill(&c->v, rng, 1.0);
    if (!c->alias && c->out.alloc)
        poison(c->out.alloc, c->out.bytes);
    a->q = c->q.t;
    a->k = c->k.t;
    a->v = c->v.t;
    a->out = c->out.t;

    /* LSE: [batch, heads, seqlen_q], or [heads, total_q] for packed batches. */
    if (pick(r, 2)) {
        int64_t n = 1;
        if (c->q.ok && H > 0)
            n = (a->cu_seqlens_q ? 1 : c->q.t.batch) * H * c->q.t.seqlen;
        n = n > 0 ? n : 1; /* an empty problem has no LSE entry: one to see untouched */
        c->lse_n = (size_t)n;
        c->lse = malloc(sizeof(float) * c->lse_n);
        REQUIRE(c->lse != NULL);
        poison((unsigned char *)c->lse, sizeof(float) * c->lse_n);
        a->lse = c->lse;
    }

    a->seed = tu_next(rng);
    a->offset = pick(r, 4) == 0 ? UINT64_MAX - pick(r, 3) : tu_next(rng);

    /* Descales: for FP8 inputs in some layout, some NULL (= 1), now and then
     * an impossible value; for other inputs now and then one that must be
     * refused. */
    if (cfg->dtype == FMHA_DTYPE_F8_E4M3) {
        a->descale_layout = CHOOSE(r, dl_t);
        a->descale_block_rows = CHOOSE(r, rows_t);
        const fmha_tensor *ts[3] = {&c->q.t, &c->k.t, &c->v.t};
        const float **dst[3] = {&a->descale_q, &a->descale_k, &a->descale_v};
        for (int i = 0; i < 3; i++) {
            if (pick(r, 4) == 0)
                continue; /* NULL: descales of 1 */
            int64_t n = descale_count(c, ts[i]);
            if (n < 0 || n > MAX_ELEMS) {
                n = 1; /* a layout the library refuses before reading */
                c->must_fail = 1;
            }
            c->ds_n[i] = n;
            c->ds[i] = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
            REQUIRE(c->ds[i] != NULL);
            for (int64_t e = 0; e < n; e++)
                c->ds[i][e] = (float)(3.0 / 448.0 * exp2(4.0 * tu_uniform(rng) - 2.0));
            if (n > 0 && pick(r, 16) == 0) {
                static const float bad[] = {0.0f, -1.0f, NAN, INFINITY};
                c->ds[i][pick(r, (unsigned)(n < 256 ? n : 256))] = CHOOSE(r, bad);
                c->must_fail = 1;
            }
            *dst[i] = c->ds[i];
        }
    } else if (pick(r, 32) == 0) {
        c->ds[0] = malloc(sizeof(float));
        REQUIRE(c->ds[0] != NULL);
        c->ds[0][0] = 1.0f;
        a->descale_k = c->ds[0];
        c->must_fail = 1;
    }
    /* Read last, so that inputs written before it decode as they did. */
    static const int finite_t[] = {0, 0, 0, 1, 2};
    cfg->check_finite = CHOOSE(r, finite_t);
    /* Later still, so that inputs written before the score modifiers existed
     * decode as they did (and, running out, take none). */
    if (pick(r, 3) == 1)
        mods_make(r, c, rng);
    return 1;
}

/* ------------------------------------------------------------- checks */

/* Query tokens that belong to a sequence: all of them, or those before
 * cu_seqlens_q[nseq] of a packed batch. */
static int64_t covered_tokens(const fcase *c)
{
    return c->a.cu_seqlens_q ? c->cuq[c->nseq] : c->a.q.seqlen;
}

/* Whether rows of out that the call writes share bytes: then their values
 * depend on the order of the writes, and only "no write outside them" is
 * promised. */
static int out_rows_overlap(const fcase *c)
{
    const fmha_tensor *o = &c->a.out;
    const size_t es = fmha_dtype_size(o->dtype);
    unsigned char *seen = calloc(c->out.bytes, 1);
    REQUIRE(seen != NULL);
    int overlap = 0;
    const int64_t tokens = covered_tokens(c);
    for (int64_t b = 0; b < o->batch && !overlap; b++)
        for (int64_t s = 0; s < tokens && !overlap; s++)
            for (int64_t h = 0; h < o->heads && !overlap; h++) {
                unsigned char *m = seen + (elem_at(o, b, s, h, 0) - (unsigned char *)o->data);
                for (size_t i = 0; i < (size_t)o->head_dim * es; i++)
                    overlap |= m[i]++;
            }
    free(seen);
    return overlap;
}

/* Every byte of out's allocation outside the rows written, and every entry
 * of lse outside them, is what it was before the call. */
static void check_untouched_outside(const fcase *c, const unsigned char *out_before,
                                    const unsigned char *lse_before)
{
    const fmha_tensor *o = &c->a.out;
    const size_t es = fmha_dtype_size(o->dtype);
    unsigned char *mark = calloc(c->out.bytes, 1);
    REQUIRE(mark != NULL);
    const int64_t tokens = covered_tokens(c);
    for (int64_t b = 0; b < o->batch; b++)
        for (int64_t s = 0; s < tokens; s++)
            for (int64_t h = 0; h < o->heads; h++)
                memset(elem_at(o, b, s, h, 0) - (unsigned char *)o->data + mark, 1,
                       (size_t)o->head_dim * es);
    for (size_t i = 0; i < c->out.bytes; i++)
        REQUIRE(mark[i] || c->out.alloc[i] == out_before[i]);
    free(mark);
    if (c->lse && c->a.cu_seqlens_q) {
        const unsigned char *now = (const unsigned char *)c->lse;
        for (int64_t h = 0; h < o->heads; h++)
            for (int64_t s = tokens; s < o->seqlen; s++) {
                const size_t at = sizeof(float) * (size_t)(h * o->seqlen + s);
                REQUIRE(memcmp(now + at, lse_before + at, sizeof(float)) == 0);
            }
    }
}

/* The covered rows of a view as a view of their own (packed: tokens [0, n)). */
static fmha_tensor covered(const fcase *c, fmha_tensor t)
{
    t.seqlen = covered_tokens(c);
    return t;
}

/* The largest |v| the call sees: the values of v's view times the largest
 * descale of v. */
static double v_absmax(const fcase *c)
{
    const fmha_tensor *t = &c->a.v;
    tu_tensor x = as_tu(t, c->v.bytes);
    double m = 0, dmax = 1;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t e = 0; e < t->head_dim; e++)
                    m = fmax(m, fabs(tu_get(&x, b, s, h, e)));
    if (c->a.descale_v) {
        dmax = 0;
        for (int64_t e = 0; e < c->ds_n[2]; e++)
            dmax = fmax(dmax, c->ds[2][e]);
    }
    return m * dmax;
}

/* The unit roundoff of a 16-bit dtype (0 for the others). */
static double unit16(fmha_dtype dt)
{
    return dt == FMHA_DTYPE_BF16 ? 0x1p-8 : dt == FMHA_DTYPE_F16 ? 0x1p-11 : 0.0;
}

/* out and lse against the float64 reference: within 4x the error of the
 * naive same-precision computation, as tests/cases.c has it, plus a floor.
 * The floor matters where the naive computation happens to be exact or
 * nearly so while the kernel, adding in another order, is not, which with
 * the fuzzer's tiny outputs (a row or two) happens by chance:
 * - a few f32 roundings of the largest score (FP8 codes make exact products
 *   and often exact sums): of an LSE of 385, 3e-5; scores are about the
 *   LSE's size, and a score off by d moves an output by up to 2 d max|v|;
 * - with 16-bit inputs, P rounded to 16 bits before P V: each p is off by up
 *   to the unit roundoff u relative, which moves an output by up to
 *   u max|v|. The kernel rounds p relative to its running maximum and the
 *   naive one relative to the row's, so their roundings differ; a bf16 row
 *   of 200 keys showed the kernel 2e-4 off where the naive was 3e-6;
 * - a 16-bit output rounded to the other neighbour: up to u max|v|. */
static void check_against_reference(const fcase *c, const fmha_tensor *q_orig)
{
    const fmha_tensor *o = &c->a.out;
    const int64_t tokens = covered_tokens(c);
    if (tokens == 0)
        return;
    const int64_t H = c->cfg.num_heads;
    /* LSE rows: [batch, heads] of seqlen_q entries, or [heads] of total_q. */
    const int64_t lse_rows = c->a.cu_seqlens_q ? H : o->batch * H;
    const size_t lse_n = (size_t)(lse_rows * o->seqlen);
    fmha_forward_args ar = c->a, an = c->a;
    ar.q = an.q = *q_orig;
    fmha_tensor ref = fmha_tensor_bshd(NULL, FMHA_DTYPE_F32, o->batch, o->seqlen, H, o->head_dim);
    fmha_tensor naive = fmha_tensor_bshd(NULL, o->dtype, o->batch, o->seqlen, H, o->head_dim);
    const size_t nelem = (size_t)elements(&ref);
    ref.data = malloc(nelem * 4);
    naive.data = malloc(nelem * fmha_dtype_size(o->dtype));
    float *lse_ref = malloc(sizeof(float) * lse_n), *lse_naive = malloc(sizeof(float) * lse_n);
    REQUIRE(ref.data && naive.data && lse_ref && lse_naive);
    ar.out = ref;
    ar.lse = lse_ref;
    an.out = naive;
    an.lse = lse_naive;

    fmha_config cref = c->cfg;
    cref.num_threads = 1;
    fmha_status st = fmha_reference_forward(&cref, &ar);
    REQUIRE(st == FMHA_STATUS_OK);
    REQUIRE(tu_naive_forward(&c->cfg, &an) == 0);

    double lmax = 0;
    for (int64_t i = 0; i < lse_rows; i++)
        for (int64_t s = 0; s < tokens; s++) {
            const double x = lse_ref[i * o->seqlen + s];
            lmax = isfinite(x) ? fmax(lmax, fabs(x)) : lmax;
        }
    const double rescale = c->cfg.dropout_p > 0 ? 1.0 / (1.0 - c->cfg.dropout_p) : 1.0;
    const double vmax = v_absmax(c) * rescale;
    const double out_floor =
        1e-6 + (0x1p-21 * lmax + unit16(c->cfg.dtype) + unit16(o->dtype)) * vmax;
    const double lse_floor = 1e-5 + 0x1p-21 * lmax;

    tu_tensor xo = as_tu(&c->a.out, c->out.bytes), xr = as_tu(&ref, nelem * 4),
              xn = as_tu(&naive, nelem * fmha_dtype_size(o->dtype));
    xo.t = covered(c, xo.t);
    xr.t = covered(c, xr.t);
    xn.t = covered(c, xn.t);
    int bad = 0, nbad = 0;
    const double e = tu_max_err(&xo, &xr, &bad), en = tu_max_err(&xn, &xr, &nbad);
    if (bad || e > 4.0 * en + out_floor)
        fprintf(stderr, "fuzz_forward: out error %.3g, naive %.3g, floor %.3g%s\n", e, en,
                out_floor, bad ? ", non-finite output" : "");
    REQUIRE(!bad && e <= 4.0 * en + out_floor);

    if (c->lse) {
        int lbad = 0, lnbad = 0;
        double le = 0, len = 0;
        for (int64_t i = 0; i < lse_rows; i++) {
            const int64_t at = i * o->seqlen;
            le = fmax(le, tu_lse_err(c->lse + at, lse_ref + at, tokens, &lbad));
            len = fmax(len, tu_lse_err(lse_naive + at, lse_ref + at, tokens, &lnbad));
        }
        if (lbad || le > 4.0 * len + lse_floor)
            fprintf(stderr, "fuzz_forward: lse error %.3g, naive %.3g, floor %.3g%s\n", le, len,
                    lse_floor, lbad ? ", bad -inf or non-finite" : "");
        REQUIRE(!lbad && le <= 4.0 * len + lse_floor);
    }
    free(ref.data);
    free(naive.data);
    free(lse_ref);
    free(lse_naive);
}

/* fp8_compute is fmha_quantize_fp8 (per tensor, or per block of
 * FMHA_FP8_BLOCK_ROWS tokens) followed by FP8 attention, bit for bit. */
static void check_fp8_compute(const fcase *c, const fmha_tensor *q_orig,
                              const unsigned char *out_bits, const float *lse_bits)
{
    const int per_block = c->cfg.fp8_compute == FMHA_FP8_COMPUTE_PER_BLOCK;
    const fmha_tensor *src[3] = {q_orig, &c->a.k, &c->a.v};
    fmha_tensor codes[3];
    float *scales[3];
    fmha_forward_args a8 = c->a;
    fmha_tensor *dst[3] = {&a8.q, &a8.k, &a8.v};
    for (int i = 0; i < 3; i++) {
        const fmha_tensor *x = src[i];
        codes[i] =
            fmha_tensor_bshd(NULL, FMHA_DTYPE_F8_E4M3, x->batch, x->seqlen, x->heads, x->head_dim);
        codes[i].data = malloc((size_t)elements(x));
        const int64_t nblk = (x->seqlen + FMHA_FP8_BLOCK_ROWS - 1) / FMHA_FP8_BLOCK_ROWS;
        scales[i] = malloc(sizeof(float) * (size_t)(per_block ? x->batch * x->heads * nblk : 1));
        REQUIRE(codes[i].data && scales[i]);
        REQUIRE(fmha_quantize_fp8(x, &codes[i], scales[i],
                                  per_block ? FMHA_FP8_PER_BLOCK : FMHA_FP8_PER_TENSOR,
                                  FMHA_FP8_BLOCK_ROWS) == FMHA_STATUS_OK);
        *dst[i] = codes[i];
    }
    a8.descale_q = scales[0];
    a8.descale_k = scales[1];
    a8.descale_v = scales[2];
    a8.descale_layout = per_block ? FMHA_DESCALE_PER_BLOCK : FMHA_DESCALE_PER_TENSOR;
    a8.descale_block_rows = FMHA_FP8_BLOCK_ROWS;
    fmha_config c8 = c->cfg;
    c8.dtype = FMHA_DTYPE_F8_E4M3;
    c8.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    unsigned char *out8 = malloc(c->out.bytes);
    float *lse8 = c->lse ? malloc(sizeof(float) * c->lse_n) : NULL;
    REQUIRE(out8 && (!c->lse || lse8));
    memcpy(out8, out_bits, c->out.bytes);
    a8.out.data = out8;
    a8.lse = lse8;
    REQUIRE(fmha_forward(&c8, &a8) == FMHA_STATUS_OK);
    /* Rows outside the covered tokens hold the first call's bytes here too. */
    const int64_t tokens = covered_tokens(c);
    const fmha_tensor *o = &c->a.out;
    const size_t row = (size_t)o->head_dim * fmha_dtype_size(o->dtype);
    for (int64_t b = 0; b < o->batch; b++)
        for (int64_t s = 0; s < tokens; s++)
            for (int64_t h = 0; h < o->heads; h++) {
                const size_t at = (size_t)(elem_at(o, b, s, h, 0) - (unsigned char *)o->data);
                REQUIRE(memcmp(out8 + at, out_bits + at, row) == 0);
            }
    if (c->lse) {
        const int64_t rows = c->a.cu_seqlens_q ? o->heads : o->batch * o->heads;
        for (int64_t i = 0; i < rows; i++)
            REQUIRE(memcmp(lse8 + i * o->seqlen, lse_bits + i * o->seqlen,
                           sizeof(float) * (size_t)tokens) == 0);
    }
    for (int i = 0; i < 3; i++) {
        free(codes[i].data);
        free(scales[i]);
    }
    free(out8);
    free(lse8);
}

static size_t describe_view(char *buf, size_t n, const char *name, const fmha_tensor *t)
{
    return (size_t)snprintf(buf, n, " %s=%s[%lld,%lld,%lld,%lld]/[%lld,%lld,%lld,%lld]%s", name,
                            fmha_dtype_name(t->dtype) ? fmha_dtype_name(t->dtype) : "?",
                            (long long)t->batch, (long long)t->seqlen, (long long)t->heads,
                            (long long)t->head_dim, (long long)t->stride_batch,
                            (long long)t->stride_seq, (long long)t->stride_head,
                            (long long)t->stride_dim, t->data ? "" : "(NULL)");
}

static void describe(const fcase *c)
{
    const fmha_config *f = &c->cfg;
    size_t n = (size_t)snprintf(
        g_desc, sizeof g_desc,
        "h=%lld kv=%lld d=%lld dv=%lld dt=%d causal=%d win=(%lld,%lld) softcap=%g scale=%g "
        "drop=%g isa=%d threads=%d dev=%d fp8c=%d smooth=%d alias=%d must_fail=%d nseq=%lld",
        (long long)f->num_heads, (long long)f->num_kv_heads, (long long)f->head_dim,
        (long long)f->head_dim_v, (int)f->dtype, f->causal, (long long)f->window_left,
        (long long)f->window_right, f->softcap, f->softmax_scale, f->dropout_p, (int)f->cpu_isa,
        f->num_threads, (int)f->device, (int)f->fp8_compute, f->fp8_smooth_k, c->alias,
        c->must_fail, (long long)c->a.varlen_batch);
    const fmha_tensor *ts[4] = {&c->a.q, &c->a.k, &c->a.v, &c->a.out};
    const char *names[4] = {"q", "k", "v", "out"};
    for (int i = 0; i < 4 && n < sizeof g_desc; i++)
        n += describe_view(g_desc + n, sizeof g_desc - n, names[i], ts[i]);
    for (int64_t i = 0; c->a.cu_seqlens_q && i <= c->nseq && n < sizeof g_desc; i++)
        n += (size_t)snprintf(g_desc + n, sizeof g_desc - n, "%s%d/%d", i ? "," : " cu=", c->cuq[i],
                              c->a.cu_seqlens_k ? c->cuk[i] : -1);
    if (n < sizeof g_desc)
        snprintf(g_desc + n, sizeof g_desc - n,
                 " lse=%d descales=%d/%lld mask=%d/%lld,%lld,%lld,%lld alibi=%d/%lld sinks=%d",
                 c->lse != NULL, (int)c->a.descale_layout, (long long)c->a.descale_block_rows,
                 c->a.mask.data ? (int)c->a.mask.type : -1, (long long)c->a.mask.stride_batch,
                 (long long)c->a.mask.stride_head, (long long)c->a.mask.stride_q,
                 (long long)c->a.mask.stride_k, c->a.alibi_slopes != NULL,
                 (long long)c->a.alibi_stride_batch, c->a.sinks != NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size};
    tu_rng rng = {0};
    fcase c;
    g_count.inputs++;
    if (!case_make(&r, &c, &rng)) {
        g_count.too_big++;
        case_free(&c);
        return 0;
    }
    describe(&c);
    /* What every buffer held before the call. */
    unsigned char *before[3], *out_before = NULL, *lse_before = NULL;
    const view *in[3] = {&c.q, &c.k, &c.v};
    for (int i = 0; i < 3; i++)
        before[i] = in[i]->alloc ? copy_of(in[i]->alloc, in[i]->bytes) : NULL;
    if (c.out.alloc)
        out_before = copy_of(c.out.alloc, c.out.bytes);
    if (c.lse)
        lse_before = copy_of(c.lse, sizeof(float) * c.lse_n);
    /* q as it was, for the reference when out overwrites it. */
    fmha_tensor q_orig = c.a.q;
    if (c.alias)
        q_orig.data = before[0];

    fmha_status st = fmha_forward(&c.cfg, &c.a);
    if (g_verbose)
        fprintf(stderr, "case: %s\n  -> %s %s\n", g_desc, fmha_status_string(st),
                fmha_last_error());
    if (st != FMHA_STATUS_OK) {
        g_count.refused++;
        const char *msg = fmha_last_error();
        REQUIRE(msg != NULL && msg[0] != '\0');
        REQUIRE(strcmp(fmha_status_string(st), "FMHA_STATUS_OK") != 0);
        for (int i = 0; i < 3; i++)
            REQUIRE(!before[i] || memcmp(in[i]->alloc, before[i], in[i]->bytes) == 0);
        REQUIRE(!out_before || memcmp(c.out.alloc, out_before, c.out.bytes) == 0);
        REQUIRE(!lse_before || memcmp(c.lse, lse_before, sizeof(float) * c.lse_n) == 0);
        for (size_t i = 0; i < sizeof g_dummy; i++)
            REQUIRE(g_dummy[i] == 0);
        goto done;
    }
    REQUIRE(!c.must_fail);
    for (int i = 0; i < 3; i++)
        REQUIRE((c.alias && i == 0) || !before[i] ||
                memcmp(in[i]->alloc, before[i], in[i]->bytes) == 0);
    g_count.ran++;
    if (c.a.out.batch == 0 || c.a.out.seqlen == 0) {
        /* No query row (fmha.h: torch's empty result): nothing written at all. */
        g_count.empty++;
        REQUIRE(!out_before || memcmp(c.out.alloc, out_before, c.out.bytes) == 0);
        REQUIRE(!lse_before || memcmp(c.lse, lse_before, sizeof(float) * c.lse_n) == 0);
        goto done;
    }
    REQUIRE(c.out.alloc != NULL);
    check_untouched_outside(&c, out_before, lse_before);
    g_count.in_place += c.alias;
    g_count.packed += c.a.cu_seqlens_q != NULL;
    g_count.mods += c.a.mask.data || c.a.alibi_slopes || c.a.sinks;
    c.overlap = out_rows_overlap(&c);
    g_count.overlapping += c.overlap;
    if (c.overlap)
        goto done;
    unsigned char *out_bits = copy_of(c.out.alloc, c.out.bytes);
    float *lse_bits = c.lse ? (float *)copy_of(c.lse, sizeof(float) * c.lse_n) : NULL;

    /* Without keys (k.seqlen 0) there is nothing to quantize, and fmha.h's
     * answer, out 0 and lse -inf, is exact whatever the path. */
    const int no_key = c.a.k.seqlen == 0;
    if (c.cfg.fp8_compute == FMHA_FP8_COMPUTE_OFF || no_key) {
        check_against_reference(&c, &q_orig);
        g_count.compared++;
    } else if (!c.cfg.fp8_smooth_k) {
        check_fp8_compute(&c, &q_orig, out_bits, lse_bits);
        g_count.fp8_bits++;
    }

    /* Another thread count: the same bits (results never depend on it). */
    memcpy(c.out.alloc, out_before, c.out.bytes);
    if (c.lse)
        memcpy(c.lse, lse_before, sizeof(float) * c.lse_n);
    fmha_config again = c.cfg;
    again.num_threads = c.cfg.num_threads == 1 ? 2 : 1;
    REQUIRE(fmha_forward(&again, &c.a) == FMHA_STATUS_OK);
    REQUIRE(memcmp(c.out.alloc, out_bits, c.out.bytes) == 0);
    REQUIRE(!c.lse || memcmp(c.lse, lse_bits, sizeof(float) * c.lse_n) == 0);
    free(out_bits);
    free(lse_bits);

done:
    for (int i = 0; i < 3; i++)
        free(before[i]);
    free(out_before);
    free(lse_before);
    case_free(&c);
    return 0;
}
