/* test_validation.c — every argument check of fmha, through every entry point
 * (fmha_forward, fmha_layer_init/forward, fmha_kernel_select, the reference):
 * the status, a key phrase of fmha_last_error(), and out/lse left untouched.
 * Also the small public utilities: status/dtype/ISA names, tensor views,
 * config defaults, bf16/f16 conversions, kernel choice and layer reuse. */
#define _GNU_SOURCE /* setenv, fork */

#include "cpu/cpu.h"
#include "select.h"
#include "testutil.h"

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* --------------------------------------------------------------- fixture */

/* A valid call: f32, GQA 4/2, head dim 8 and value head dim 6 (so mixing up
 * the two shows), seqlen_q != seqlen_k. The packed variant uses the same
 * buffers as two sequences of 2+4 queries and 4+6 keys. */
enum { B = 2, SQ = 3, SK = 5, H = 4, KV = 2, D = 8, DV = 6 };
enum { POISON = 0xA5 };

typedef struct fixture {
    fmha_config cfg;
    fmha_forward_args a;
    float q[B * SQ * H * D], k[B * SK * KV * D], v[B * SK * KV * DV];
    float out[B * SQ * H * DV], lse[B * H * SQ];
    int32_t cuq[B + 1], cuk[B + 1];
} fixture;

static float dummy[64]; /* non-NULL data for views validation must reject unread */

static void fx_fill(fixture *f)
{
    tu_rng r = {42};
    for (size_t i = 0; i < sizeof f->q / sizeof f->q[0]; i++)
        f->q[i] = (float)tu_normal(&r);
    for (size_t i = 0; i < sizeof f->k / sizeof f->k[0]; i++)
        f->k[i] = (float)tu_normal(&r);
    for (size_t i = 0; i < sizeof f->v / sizeof f->v[0]; i++)
        f->v[i] = (float)tu_normal(&r);
    fmha_config_init(&f->cfg, H, KV, D);
    f->cfg.head_dim_v = DV;
    f->cfg.dtype = FMHA_DTYPE_F32;
    f->cfg.num_threads = 1; /* keeps OpenMP out of the forked probe below */
    memset(&f->a, 0, sizeof f->a);
    f->a.lse = f->lse;
}

static void fx_init(fixture *f)
{
    fx_fill(f);
    f->a.q = fmha_tensor_bshd(f->q, FMHA_DTYPE_F32, B, SQ, H, D);
    f->a.k = fmha_tensor_bshd(f->k, FMHA_DTYPE_F32, B, SK, KV, D);
    f->a.v = fmha_tensor_bshd(f->v, FMHA_DTYPE_F32, B, SK, KV, DV);
    f->a.out = fmha_tensor_bshd(f->out, FMHA_DTYPE_F32, B, SQ, H, DV);
}

static void fx_init_varlen(fixture *f)
{
    fx_fill(f);
    f->a.q = fmha_tensor_packed(f->q, FMHA_DTYPE_F32, B * SQ, H, D);
    f->a.k = fmha_tensor_packed(f->k, FMHA_DTYPE_F32, B * SK, KV, D);
    f->a.v = fmha_tensor_packed(f->v, FMHA_DTYPE_F32, B * SK, KV, DV);
    f->a.out = fmha_tensor_packed(f->out, FMHA_DTYPE_F32, B * SQ, H, DV);
    f->cuq[0] = 0, f->cuq[1] = 2, f->cuq[2] = 6;
    f->cuk[0] = 0, f->cuk[1] = 4, f->cuk[2] = 10;
    f->a.cu_seqlens_q = f->cuq;
    f->a.cu_seqlens_k = f->cuk;
    f->a.varlen_batch = B;
}

static void poison(fixture *f)
{
    memset(f->out, POISON, sizeof f->out);
    memset(f->lse, POISON, sizeof f->lse);
}

static int untouched(const fixture *f)
{
    unsigned char ref[sizeof f->out];
    memset(ref, POISON, sizeof ref);
    return !memcmp(f->out, ref, sizeof f->out) && !memcmp(f->lse, ref, sizeof f->lse);
}

/* ------------------------------------------------------------ expectations */

static const char *sname(fmha_status s)
{
    return fmha_status_string(s);
}

/* One returned status + message against the expectation. */
static void check_result(const char *what, const char *entry, fmha_status got, fmha_status want,
                         const char *phrase)
{
    const char *msg = fmha_last_error();
    TU_CHECK(got == want, "%s [%s]: status %s, want %s (message \"%s\")", what, entry, sname(got),
             sname(want), msg);
    TU_CHECK(strstr(msg, phrase) != NULL, "%s [%s]: message \"%s\" lacks \"%s\"", what, entry, msg,
             phrase);
}

enum { AT_INIT, AT_FORWARD }; /* where the layer path must fail */
enum { REF_CHECK, REF_SKIP }; /* whether the reference shares the check */

/* Runs a failing call through every entry point; out and lse must stay
 * poisoned each time. A config error fails at fmha_layer_init (and in
 * fmha_kernel_select); an argument error at fmha_layer_forward. */
static void expect(const char *what, fixture *f, fmha_status want, const char *phrase, int at,
                   int ref)
{
    poison(f);
    check_result(what, "fmha_forward", fmha_forward(&f->cfg, &f->a), want, phrase);
    TU_CHECK(untouched(f), "%s [fmha_forward]: out/lse written on error", what);

    poison(f);
    fmha_layer *layer = (fmha_layer *)&dummy; /* must become NULL on failure */
    fmha_status st = fmha_layer_init(&layer, &f->cfg);
    if (at == AT_INIT) {
        check_result(what, "fmha_layer_init", st, want, phrase);
        TU_CHECK(layer == NULL, "%s [fmha_layer_init]: *layer not NULL after failure", what);
        fmha_kernel_info info;
        check_result(what, "fmha_kernel_select", fmha_kernel_select(&f->cfg, &info), want, phrase);
    } else {
        TU_CHECK(st == FMHA_STATUS_OK && layer != NULL, "%s: fmha_layer_init failed: %s", what,
                 fmha_last_error());
        if (st == FMHA_STATUS_OK) {
            check_result(what, "fmha_layer_forward", fmha_layer_forward(layer, &f->a), want,
                         phrase);
            fmha_layer_free(layer);
        }
    }
    TU_CHECK(untouched(f), "%s [layer]: out/lse written on error", what);

    if (ref == REF_CHECK) {
        poison(f);
        check_result(what, "fmha_reference_forward", fmha_reference_forward(&f->cfg, &f->a), want,
                     phrase);
        TU_CHECK(untouched(f), "%s [reference]: out/lse written on error", what);
    }
}

#define INVALID     FMHA_STATUS_INVALID_ARGUMENT
#define UNSUPPORTED FMHA_STATUS_UNSUPPORTED

/* --------------------------------------------------------- NULL pointers */

static void test_null_pointers(void)
{
    fixture f;
    fx_init(&f);

    poison(&f);
    check_result("NULL config", "fmha_forward", fmha_forward(NULL, &f.a), INVALID,
                 "config is NULL");
    fmha_layer *layer = (fmha_layer *)&dummy;
    check_result("NULL config", "fmha_layer_init", fmha_layer_init(&layer, NULL), INVALID,
                 "config is NULL");
    TU_CHECK(layer == NULL, "NULL config: *layer not reset to NULL");
    fmha_kernel_info info;
    check_result("NULL config", "fmha_kernel_select", fmha_kernel_select(NULL, &info), INVALID,
                 "config is NULL");
    check_result("NULL config", "fmha_reference_forward", fmha_reference_forward(NULL, &f.a),
                 INVALID, "config is NULL");
    TU_CHECK(untouched(&f), "NULL config: out/lse written");

    check_result("NULL args", "fmha_forward", fmha_forward(&f.cfg, NULL), INVALID,
                 "forward args are NULL");
    check_result("NULL args", "fmha_reference_forward", fmha_reference_forward(&f.cfg, NULL),
                 INVALID, "forward args are NULL");
    TU_CHECK(fmha_layer_init(&layer, &f.cfg) == FMHA_STATUS_OK, "layer_init: %s",
             fmha_last_error());
    check_result("NULL args", "fmha_layer_forward", fmha_layer_forward(layer, NULL), INVALID,
                 "forward args are NULL");
    fmha_layer_free(layer);

    check_result("NULL layer", "fmha_layer_forward", fmha_layer_forward(NULL, &f.a), INVALID,
                 "layer is NULL");
    check_result("NULL layer out-pointer", "fmha_layer_init", fmha_layer_init(NULL, &f.cfg),
                 INVALID, "layer out-pointer is NULL");
    check_result("NULL info", "fmha_kernel_select", fmha_kernel_select(&f.cfg, NULL), INVALID,
                 "kernel info out-pointer is NULL");
    TU_CHECK(untouched(&f), "NULL pointers: out/lse written");
    fmha_layer_free(NULL); /* must be a no-op */
    TU_CHECK(fmha_layer_config(NULL) == NULL && fmha_layer_kernel(NULL) == NULL,
             "layer accessors of NULL must return NULL");

    const char *names[4] = {"q", "k", "v", "out"};
    for (int t = 0; t < 4; t++) {
        fx_init(&f);
        fmha_tensor *ts[4] = {&f.a.q, &f.a.k, &f.a.v, &f.a.out};
        ts[t]->data = NULL;
        char what[64], phrase[64];
        snprintf(what, sizeof what, "%s.data NULL", names[t]);
        snprintf(phrase, sizeof phrase, "%s.data is NULL", names[t]);
        expect(what, &f, INVALID, phrase, AT_FORWARD, REF_CHECK);
    }
}

/* ---------------------------------------------------------- tensor shapes */

static void test_tensor_dims(void)
{
    const char *names[4] = {"q", "k", "v", "out"};
    const char *dims[4] = {"batch", "seqlen", "heads", "head_dim"};
    const int64_t bad[3] = {0, -1, INT64_MIN};
    for (int t = 0; t < 4; t++)
        for (int d = 0; d < 4; d++)
            for (int i = 0; i < 3; i++) {
                fixture f;
                fx_init(&f);
                fmha_tensor *ts[4] = {&f.a.q, &f.a.k, &f.a.v, &f.a.out};
                int64_t *field[4] = {&ts[t]->batch, &ts[t]->seqlen, &ts[t]->heads,
                                     &ts[t]->head_dim};
                *field[d] = bad[i];
                char what[64], phrase[96];
                snprintf(what, sizeof what, "%s.%s = %lld", names[t], dims[d], (long long)bad[i]);
                /* batch and seqlen may be 0 (an empty problem, test_faults); a 0 of one
                 * view alone is then a mismatch with the others */
                if (d < 2 && bad[i] == 0)
                    snprintf(phrase, sizeof phrase, d == 0 ? "batch sizes differ" : "seqlen");
                else
                    snprintf(phrase, sizeof phrase, "%s.%s (%lld) must be %s", names[t], dims[d],
                             (long long)bad[i], d < 2 ? "non-negative" : "positive");
                expect(what, &f, INVALID, phrase, AT_FORWARD, REF_CHECK);
            }

    /* stride_dim must be 1; the other strides must not be negative */
    for (int t = 0; t < 4; t++) {
        const int64_t sd[3] = {0, 2, -1};
        for (int i = 0; i < 3; i++) {
            fixture f;
            fx_init(&f);
            fmha_tensor *ts[4] = {&f.a.q, &f.a.k, &f.a.v, &f.a.out};
            ts[t]->stride_dim = sd[i];
            char what[64], phrase[96];
            snprintf(what, sizeof what, "%s.stride_dim = %lld", names[t], (long long)sd[i]);
            snprintf(phrase, sizeof phrase, "%s.stride_dim (%lld) must be 1", names[t],
                     (long long)sd[i]);
            expect(what, &f, INVALID, phrase, AT_FORWARD, REF_CHECK);
            TU_CHECK(strstr(fmha_last_error(), "contiguous") != NULL,
                     "stride_dim message should say contiguous: %s", fmha_last_error());
        }
        const char *snames[3] = {"stride_batch", "stride_seq", "stride_head"};
        for (int s = 0; s < 3; s++) {
            fixture f;
            fx_init(&f);
            fmha_tensor *ts[4] = {&f.a.q, &f.a.k, &f.a.v, &f.a.out};
            int64_t *field[3] = {&ts[t]->stride_batch, &ts[t]->stride_seq, &ts[t]->stride_head};
            *field[s] = -8;
            char what[64], phrase[96];
            snprintf(what, sizeof what, "%s.%s = -8", names[t], snames[s]);
            snprintf(phrase, sizeof phrase, "%s.%s (-8) must be >= 0", names[t], snames[s]);
            expect(what, &f, INVALID, phrase, AT_FORWARD, REF_CHECK);
        }
    }

    /* Extents that overflow int64. Validation only computes them, so the
     * data pointer is a small dummy that must never be read. */
    fixture f;
    fx_init(&f);
    f.a.q.data = dummy;
    f.a.q.seqlen = INT64_MAX / 4; /* (seqlen - 1) * stride_seq (32) overflows */
    expect("q.seqlen huge", &f, INVALID, "q spans more than 2^63 elements", AT_FORWARD, REF_CHECK);

    fx_init(&f);
    f.a.k.data = dummy;
    f.a.k.batch = (int64_t)1 << 40; /* (2^40 - 1) x 2^30 overflows */
    f.a.k.stride_batch = (int64_t)1 << 30;
    expect("k.batch x stride_batch", &f, INVALID, "k spans more than 2^63 elements", AT_FORWARD,
           REF_CHECK);

    fx_init(&f);
    f.a.v.data = dummy;
    f.a.v.stride_batch = INT64_MAX; /* 1 x INT64_MAX fits, + head_dim does not */
    expect("v.stride_batch INT64_MAX", &f, INVALID, "v spans more than 2^63 elements", AT_FORWARD,
           REF_CHECK);

    fx_init(&f);
    f.a.out.data = dummy;
    f.a.out.heads = INT64_MAX; /* matches nothing, but the extent is checked first */
    expect("out.heads INT64_MAX", &f, INVALID, "out spans more than 2^63 elements", AT_FORWARD,
           REF_CHECK);

    fx_init(&f); /* each span fits, their sum does not: 2^62 + 2 x 2^61 */
    f.a.q.data = dummy;
    f.a.q.stride_batch = (int64_t)1 << 62;
    f.a.q.stride_seq = (int64_t)1 << 61;
    expect("q spans summed", &f, INVALID, "q spans more than 2^63 elements", AT_FORWARD, REF_CHECK);

    fx_init(&f); /* 2^61 + 8 elements fit in int64, x 4 bytes does not */
    f.a.k.data = dummy;
    f.a.k.stride_batch = (int64_t)1 << 61;
    expect("k byte size", &f, INVALID, "byte size overflows int64", AT_FORWARD, REF_CHECK);

    fx_init(&f); /* batch 2^20 x heads 2^12 > 2^31, inputs with all-zero strides so the extent
                    is tiny; out's rows may not overlap (its extent is only computed) */
    fmha_config_init(&f.cfg, (int64_t)1 << 12, 1, D);
    f.cfg.dtype = FMHA_DTYPE_F32;
    fmha_tensor *ts[4] = {&f.a.q, &f.a.k, &f.a.v, &f.a.out};
    for (int t = 0; t < 4; t++) {
        ts[t]->data = dummy;
        ts[t]->batch = (int64_t)1 << 20;
        ts[t]->seqlen = 1;
        ts[t]->heads = t == 1 || t == 2 ? 1 : (int64_t)1 << 12;
        ts[t]->head_dim = D;
        ts[t]->stride_batch = ts[t]->stride_seq = ts[t]->stride_head = 0;
    }
    f.a.out = fmha_tensor_bshd(dummy, FMHA_DTYPE_F32, (int64_t)1 << 20, 1, (int64_t)1 << 12, D);
    expect("batch x heads > 2^31", &f, INVALID, "batch x heads", AT_FORWARD, REF_CHECK);
}

/* Rows of out that overlap along one dim (a stride below head_dim_v, 0
 * included) are refused: which row's write would land there depends on the
 * thread schedule (fuzz_forward found out.stride_seq = 0 taken, the answer
 * then differing from the reference's). Inputs may broadcast with stride 0,
 * and a dim of size 1 may have any stride. */
static void test_out_overlap(void)
{
    const char *snames[3] = {"stride_batch", "stride_seq", "stride_head"};
    const int64_t bad[2] = {0, DV - 1};
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < 2; i++) {
            fixture f;
            fx_init(&f);
            int64_t *field[3] = {&f.a.out.stride_batch, &f.a.out.stride_seq, &f.a.out.stride_head};
            *field[s] = bad[i];
            char what[64], phrase[96];
            snprintf(what, sizeof what, "out.%s = %lld", snames[s], (long long)bad[i]);
            snprintf(phrase, sizeof phrase, "out.%s (%lld) is below out.head_dim (%d)", snames[s],
                     (long long)bad[i], DV);
            expect(what, &f, INVALID, phrase, AT_FORWARD, REF_CHECK);
            TU_CHECK(strstr(fmha_last_error(), "rows of out would overlap") != NULL,
                     "%s: the message says why: %s", what, fmha_last_error());
        }

    fixture f; /* k and v broadcast over the batch (stride 0): fine */
    fx_init(&f);
    f.a.k.stride_batch = f.a.v.stride_batch = 0;
    poison(&f);
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "k, v with stride_batch 0: %s",
             fmha_last_error());
    fx_init(&f); /* out with one batch entry: its stride_batch is never used */
    f.a.q.batch = f.a.k.batch = f.a.v.batch = f.a.out.batch = 1;
    f.a.out.stride_batch = 0;
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "out.batch 1, stride_batch 0: %s",
             fmha_last_error());
}

/* batch 2^33 x heads 2^31 = 2^64 wraps to 0 in int64: the "batch x heads"
 * check must not be fooled by the wrap. Run in a child with an alarm, since
 * a library that accepts this loops for ages over 2^64 rows. */
static void test_batch_heads_wrap(void)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(1);
        fixture f;
        fx_init(&f);
        fmha_config_init(&f.cfg, (int64_t)1 << 31, 1, D);
        f.cfg.dtype = FMHA_DTYPE_F32;
        f.a.lse = NULL;
        fmha_tensor *ts[4] = {&f.a.q, &f.a.k, &f.a.v, &f.a.out};
        for (int t = 0; t < 4; t++) {
            ts[t]->data = f.out; /* stride 0 everywhere: every input element is f.out[0..D) */
            ts[t]->batch = (int64_t)1 << 33;
            ts[t]->seqlen = 1;
            ts[t]->heads = t == 1 || t == 2 ? 1 : (int64_t)1 << 31;
            ts[t]->head_dim = t >= 2 ? DV : D;
            ts[t]->stride_batch = ts[t]->stride_seq = ts[t]->stride_head = 0;
        }
        /* out's rows may not overlap along one dim; (b, h) and (b + 1, h - 1)
         * share a row here, an overlap across two dims that is not looked for. */
        f.a.out.stride_batch = f.a.out.stride_head = DV;
        f.cfg.head_dim_v = DV;
        fmha_status st = fmha_reference_forward(&f.cfg, &f.a);
        _exit(st == INVALID && strstr(fmha_last_error(), "batch x heads") ? 0 : 1);
    }
    int ws = 0;
    TU_CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid, "fork/waitpid failed");
    TU_CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0,
             "batch 2^33 x heads 2^31 (wraps int64 to 0) was not rejected with \"batch x heads\" "
             "(child %s %d)",
             WIFEXITED(ws) ? "exit" : "signal", WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws));
}

static void test_mismatches(void)
{
    struct {
        const char *what, *phrase;
        int tensor; /* 0..3 = q, k, v, out */
        int field;  /* 0 batch, 1 seqlen, 2 heads, 3 head_dim */
        int64_t value;
    } cases[] = {
        {"k.batch", "batch sizes differ: q 2, k 1, v 2, out 2", 1, 0, 1},
        {"v.batch", "batch sizes differ: q 2, k 2, v 3, out 2", 2, 0, 3},
        {"out.batch", "batch sizes differ: q 2, k 2, v 2, out 1", 3, 0, 1},
        {"q.batch", "batch sizes differ: q 1, k 2, v 2, out 2", 0, 0, 1},
        {"q.heads", "q.heads (3) differs from num_heads (4)", 0, 2, 3},
        {"out.heads", "out.heads (2) differs from num_heads (4)", 3, 2, 2},
        {"k.heads", "k.heads (1) and v.heads (2) must equal num_kv_heads (2)", 1, 2, 1},
        {"v.heads", "k.heads (2) and v.heads (4) must equal num_kv_heads (2)", 2, 2, 4},
        {"q.head_dim", "q.head_dim (7) and k.head_dim (8) must equal head_dim (8)", 0, 3, 7},
        {"k.head_dim", "q.head_dim (8) and k.head_dim (6) must equal head_dim (8)", 1, 3, 6},
        {"v.head_dim = head_dim", "v.head_dim (8) and out.head_dim (6) must equal head_dim_v (6)",
         2, 3, 8},
        {"out.head_dim", "v.head_dim (6) and out.head_dim (5) must equal head_dim_v (6)", 3, 3, 5},
        {"out.seqlen", "out.seqlen (2) differs from q.seqlen (3)", 3, 1, 2},
        {"v.seqlen", "v.seqlen (4) differs from k.seqlen (5)", 2, 1, 4},
        {"k.seqlen", "v.seqlen (5) differs from k.seqlen (6)", 1, 1, 6},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fixture f;
        fx_init(&f);
        fmha_tensor *ts[4] = {&f.a.q, &f.a.k, &f.a.v, &f.a.out};
        fmha_tensor *t = ts[cases[i].tensor];
        int64_t *field[4] = {&t->batch, &t->seqlen, &t->heads, &t->head_dim};
        /* a grown view may pass its buffer's end: it is rejected before any read */
        *field[cases[i].field] = cases[i].value;
        expect(cases[i].what, &f, INVALID, cases[i].phrase, AT_FORWARD, REF_CHECK);
    }

    /* head_dim_v in the config differing from the v/out tensors */
    fixture f;
    fx_init(&f);
    f.cfg.head_dim_v = D;
    expect("cfg.head_dim_v", &f, INVALID,
           "v.head_dim (6) and out.head_dim (6) must equal head_dim_v (8)", AT_FORWARD, REF_CHECK);

    /* dtypes */
    const char *names[3] = {"q", "k", "v"};
    for (int t = 0; t < 3; t++) {
        fx_init(&f);
        fmha_tensor *ts[3] = {&f.a.q, &f.a.k, &f.a.v};
        ts[t]->dtype = FMHA_DTYPE_BF16; /* smaller elements: the view stays inside the buffer */
        char what[64], phrase[128];
        snprintf(what, sizeof what, "%s.dtype bf16 vs f32", names[t]);
        snprintf(phrase, sizeof phrase, "%s.dtype (bf16) differs from the layer's dtype (f32)",
                 names[t]);
        expect(what, &f, INVALID, phrase, AT_FORWARD, REF_CHECK);
    }
    fx_init(&f);
    f.a.out.dtype = FMHA_DTYPE_F8_E4M3;
    expect("out.dtype f8", &f, INVALID, "out.dtype f8_e4m3 is not an output dtype", AT_FORWARD,
           REF_CHECK);
    const int bad_dtypes[2] = {4, -1};
    for (int i = 0; i < 2; i++) {
        fx_init(&f);
        f.a.v.dtype = (fmha_dtype)bad_dtypes[i];
        char phrase[64];
        snprintf(phrase, sizeof phrase, "v.dtype (%d) is not a fmha_dtype value", bad_dtypes[i]);
        expect("v.dtype out of range", &f, INVALID, phrase, AT_FORWARD, REF_CHECK);
    }
}

/* ----------------------------------------------------------------- config */

static void test_config(void)
{
    fixture f;
    struct {
        const char *what, *phrase;
        int64_t heads, kv, d, dv;
    } shapes[] = {
        {"num_heads 0", "num_heads (0) must be positive", 0, 2, D, DV},
        {"num_heads -4", "num_heads (-4) must be positive", -4, 2, D, DV},
        {"num_kv_heads 0", "num_kv_heads (0) must be positive", H, 0, D, DV},
        {"num_kv_heads -2", "num_kv_heads (-2) must be positive", H, -2, D, DV},
        {"kv heads > heads", "num_kv_heads (8) exceeds num_heads (4)", H, 8, D, DV},
        {"heads not multiple", "num_heads (4) must be a multiple of num_kv_heads (3)", H, 3, D, DV},
        {"head_dim 0", "head_dim (0) must be positive", H, KV, 0, DV},
        {"head_dim -8", "head_dim (-8) must be positive", H, KV, -8, DV},
        {"head_dim_v 0", "head_dim_v (0) must be positive", H, KV, D, 0},
        {"head_dim_v -1", "head_dim_v (-1) must be positive", H, KV, D, -1},
        {"head_dim huge", "above 65536", H, KV, 65537, DV},
        {"head_dim_v huge", "above 65536", H, KV, D, (int64_t)1 << 40},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        fx_init(&f);
        f.cfg.num_heads = shapes[i].heads;
        f.cfg.num_kv_heads = shapes[i].kv;
        f.cfg.head_dim = shapes[i].d;
        f.cfg.head_dim_v = shapes[i].dv;
        expect(shapes[i].what, &f, INVALID, shapes[i].phrase, AT_INIT, REF_CHECK);
    }

    /* The GQA message, exactly, from layer init and from the kernel chooser. */
    static const char gqa[] =
        "num_heads (28) must be a multiple of num_kv_heads (6): each KV head serves an equal "
        "group of query heads; check num_attention_heads / num_key_value_heads in the model "
        "config";
    fx_init(&f);
    fmha_config_init(&f.cfg, 28, 6, 128);
    expect("GQA 28/6", &f, INVALID, gqa, AT_INIT, REF_CHECK);
    fmha_layer *layer = NULL;
    TU_CHECK(fmha_layer_init(&layer, &f.cfg) == INVALID && !strcmp(fmha_last_error(), gqa),
             "GQA 28/6 layer_init message \"%s\"", fmha_last_error());
    fmha_kernel_info info;
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == INVALID && !strcmp(fmha_last_error(), gqa),
             "GQA 28/6 kernel_select message \"%s\"", fmha_last_error());
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == INVALID && !strcmp(fmha_last_error(), gqa),
             "GQA 28/6 fmha_forward message \"%s\"", fmha_last_error());
    fmha_config_init(&f.cfg, 28, 7, 128); /* 28/7 and 28/4 are fine */
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK, "GQA 28/7: %s",
             fmha_last_error());
    fmha_config_init(&f.cfg, 28, 1, 128);
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK, "MQA 28/1: %s",
             fmha_last_error());

    struct {
        const char *what, *phrase;
        double scale, softcap, dropout;
    } reals[] = {
        {"softmax_scale NaN", "softmax_scale (nan) must be finite and >= 0", NAN, 0, 0},
        {"softmax_scale inf", "softmax_scale (inf) must be finite", INFINITY, 0, 0},
        {"softmax_scale -inf", "softmax_scale (-inf) must be finite", -INFINITY, 0, 0},
        {"softmax_scale < 0", "softmax_scale (-0.5) must be finite and >= 0", -0.5, 0, 0},
        {"softcap < 0", "softcap (-1) must be finite and >= 0", 0, -1.0, 0},
        {"softcap inf", "softcap (inf) must be finite", 0, INFINITY, 0},
        {"softcap NaN", "softcap (nan) must be finite", 0, NAN, 0},
        {"dropout_p < 0", "dropout_p (-0.1) must be in [0, 1)", 0, 0, -0.1},
        {"dropout_p == 1", "dropout_p (1) must be in [0, 1)", 0, 0, 1.0},
        {"dropout_p > 1", "dropout_p (1.5) must be in [0, 1)", 0, 0, 1.5},
        {"dropout_p NaN", "dropout_p (nan) must be in [0, 1)", 0, 0, NAN},
        {"dropout_p inf", "dropout_p (inf) must be in [0, 1)", 0, 0, INFINITY},
    };
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++) {
        fx_init(&f);
        f.cfg.softmax_scale = reals[i].scale;
        f.cfg.softcap = reals[i].softcap;
        f.cfg.dropout_p = reals[i].dropout;
        expect(reals[i].what, &f, INVALID, reals[i].phrase, AT_INIT, REF_CHECK);
    }

    fx_init(&f);
    f.cfg.window_left = -2;
    expect("window_left -2", &f, INVALID, "window_left (-2) must be >= -1", AT_INIT, REF_CHECK);
    fx_init(&f);
    f.cfg.window_right = INT64_MIN;
    expect("window_right INT64_MIN", &f, INVALID,
           "window_right (-9223372036854775808) must be >= -1", AT_INIT, REF_CHECK);
    fx_init(&f);
    f.cfg.num_threads = -1;
    expect("num_threads -1", &f, INVALID, "num_threads (-1) must be >= 0", AT_INIT, REF_CHECK);

    /* enum values out of range */
    fx_init(&f);
    f.cfg.dtype = (fmha_dtype)4;
    expect("cfg.dtype 4", &f, INVALID, "dtype (4) is not a fmha_dtype value", AT_INIT, REF_CHECK);
    fx_init(&f);
    f.cfg.dtype = (fmha_dtype)-1;
    expect("cfg.dtype -1", &f, INVALID, "dtype (-1) is not a fmha_dtype value", AT_INIT, REF_CHECK);
    fx_init(&f);
    f.cfg.device = (fmha_device)2;
    expect("cfg.device 2", &f, INVALID, "device (2) is not a fmha_device value", AT_INIT,
           REF_CHECK);
    fx_init(&f);
    f.cfg.device = (fmha_device)-1;
    expect("cfg.device -1", &f, INVALID, "device (-1) is not a fmha_device value", AT_INIT,
           REF_CHECK);
    fx_init(&f);
    f.cfg.cpu_isa = (fmha_cpu_isa)5;
    expect("cfg.cpu_isa 5", &f, INVALID, "cpu_isa (5) is not a fmha_cpu_isa value", AT_INIT,
           REF_CHECK);
    fx_init(&f);
    f.cfg.cpu_isa = (fmha_cpu_isa)-3;
    expect("cfg.cpu_isa -3", &f, INVALID, "cpu_isa (-3) is not a fmha_cpu_isa value", AT_INIT,
           REF_CHECK);

    /* Valid but unsupported: f8 attention on CUDA, and CUDA in a CPU-only
     * build. The reference has no device, so it is skipped for both. */
    fx_init(&f);
    f.cfg.dtype = FMHA_DTYPE_F8_E4M3;
    f.cfg.device = FMHA_DEVICE_CUDA;
    f.a.q.dtype = f.a.k.dtype = f.a.v.dtype = FMHA_DTYPE_F8_E4M3;
    if (fmha_cuda_device_count() == 0) /* else the GPU may run it (test_cuda) */
        expect("cfg.dtype f8 on CUDA", &f, UNSUPPORTED, "use device cpu", AT_INIT, REF_SKIP);
    fx_init(&f);
    f.cfg.device = FMHA_DEVICE_CUDA;
    if (fmha_cuda_device_count() == 0) /* CPU-only build, or a CUDA build with no GPU */
        expect("device CUDA", &f, UNSUPPORTED, "CUDA", AT_INIT, REF_SKIP);
}

/* -------------------------------------------------------------------- FP8 */

/* The fixture with f8_e4m3 q, k, v over the same buffers (1-byte elements
 * stay inside them), codes of moderate values, per-tensor descales. */
static float fx_descales[3][B * H * SQ];

static void fx_init_f8(fixture *f, fmha_descale_layout layout)
{
    fx_init(f);
    f->cfg.dtype = FMHA_DTYPE_F8_E4M3;
    fmha_tensor *ts[3] = {&f->a.q, &f->a.k, &f->a.v};
    for (int i = 0; i < 3; i++) {
        ts[i]->dtype = FMHA_DTYPE_F8_E4M3;
        uint8_t *codes = ts[i]->data;
        for (int64_t e = 0; e < ts[i]->batch * ts[i]->seqlen * ts[i]->heads * ts[i]->head_dim; e++)
            codes[e] = fmha_f32_to_e4m3(((float *)ts[i]->data)[e]);
        for (size_t e = 0; e < sizeof fx_descales[i] / sizeof fx_descales[i][0]; e++)
            fx_descales[i][e] = 0.5f + 0.25f * (float)(e % 3);
    }
    f->a.descale_q = fx_descales[0];
    f->a.descale_k = fx_descales[1];
    f->a.descale_v = fx_descales[2];
    f->a.descale_layout = layout;
    f->a.descale_block_rows = 2;
}

static void test_fp8_args(void)
{
    fixture f;
    const fmha_descale_layout layouts[3] = {FMHA_DESCALE_PER_TENSOR, FMHA_DESCALE_PER_KV_HEAD,
                                            FMHA_DESCALE_PER_BLOCK};
    for (int i = 0; i < 3; i++) {
        fx_init_f8(&f, layouts[i]);
        poison(&f);
        fmha_status st = fmha_forward(&f.cfg, &f.a);
        TU_CHECK(st == FMHA_STATUS_OK && !untouched(&f), "valid f8, layout %d: %s", i,
                 fmha_last_error());
        TU_CHECK(fmha_reference_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "valid f8 ref: %s",
                 fmha_last_error());
    }
    fx_init_f8(&f, FMHA_DESCALE_PER_TENSOR);
    f.a.descale_q = f.a.descale_k = f.a.descale_v = NULL; /* descales of 1 */
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "f8 without descales: %s",
             fmha_last_error());
    fx_init_f8(&f, FMHA_DESCALE_PER_TENSOR);
    f.cfg.num_threads = 0;
    fmha_kernel_info info;
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK && strstr(info.name, "_f32"),
             "f8 inputs run an f32 kernel (got %s)",
             fmha_last_error()[0] ? fmha_last_error() : info.name);

    fx_init_f8(&f, (fmha_descale_layout)7);
    expect("descale_layout 7", &f, INVALID, "descale_layout (7) is not a fmha_descale_layout value",
           AT_FORWARD, REF_CHECK);
    fx_init_f8(&f, FMHA_DESCALE_PER_BLOCK);
    f.a.descale_block_rows = 0;
    expect("descale_block_rows 0", &f, INVALID,
           "descale_block_rows (0) must be positive for FMHA_DESCALE_PER_BLOCK", AT_FORWARD,
           REF_CHECK);
    /* Bad values, at the last entry each layout has: the counts must be right. */
    const struct {
        fmha_descale_layout layout;
        int which, at;
        float value;
        const char *phrase;
    } bad[] = {
        {FMHA_DESCALE_PER_TENSOR, 0, 0, 0.0f, "descale_q[0] (0) must be finite and > 0"},
        {FMHA_DESCALE_PER_TENSOR, 1, 0, -2.0f, "descale_k[0] (-2) must be finite and > 0"},
        {FMHA_DESCALE_PER_TENSOR, 2, 0, NAN, "descale_v[0] (nan) must be finite and > 0"},
        {FMHA_DESCALE_PER_KV_HEAD, 0, B * KV - 1, INFINITY, "descale_q[3] (inf) must be finite"},
        {FMHA_DESCALE_PER_KV_HEAD, 2, B * KV - 1, 0.0f, "descale_v[3] (0) must be finite"},
        /* q [2, 4, ceil(3/2)] and k, v [2, 2, ceil(5/2)] blocks of 2 tokens */
        {FMHA_DESCALE_PER_BLOCK, 0, B * H * 2 - 1, -1.0f, "descale_q[15] (-1) must be finite"},
        {FMHA_DESCALE_PER_BLOCK, 1, B * KV * 3 - 1, 0.0f, "descale_k[11] (0) must be finite"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fx_init_f8(&f, bad[i].layout);
        fx_descales[bad[i].which][bad[i].at] = bad[i].value;
        expect(bad[i].phrase, &f, INVALID, bad[i].phrase, AT_FORWARD, REF_CHECK);
        fx_init_f8(&f, bad[i].layout); /* one entry further is not read */
        fx_descales[bad[i].which][bad[i].at + 1] = bad[i].value;
        poison(&f);
        TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "%s: entry %d + 1 was read",
                 bad[i].phrase, bad[i].at);
    }

    /* dtypes: mixed inputs, FP8 out, descales on other inputs */
    fx_init_f8(&f, FMHA_DESCALE_PER_TENSOR);
    f.a.k.dtype = FMHA_DTYPE_BF16;
    expect("k bf16 with f8 q", &f, INVALID,
           "k.dtype (bf16) differs from the layer's dtype (f8_e4m3)", AT_FORWARD, REF_CHECK);
    fx_init_f8(&f, FMHA_DESCALE_PER_TENSOR);
    f.a.out.dtype = FMHA_DTYPE_F8_E4M3;
    expect("f8 out", &f, INVALID, "out.dtype f8_e4m3 is not an output dtype: use f32, f16 or bf16",
           AT_FORWARD, REF_CHECK);
    fx_init(&f);
    f.a.descale_v = fx_descales[2];
    expect("descales on f32", &f, INVALID,
           "descale_v is given, but q, k, v are f32: descales belong to f8_e4m3 inputs only",
           AT_FORWARD, REF_CHECK);

    /* fp8_compute */
    fx_init(&f);
    f.cfg.fp8_compute = (fmha_fp8_compute)5;
    expect("fp8_compute 5", &f, INVALID, "fp8_compute (5) is not a fmha_fp8_compute value", AT_INIT,
           REF_CHECK);
    fx_init_f8(&f, FMHA_DESCALE_PER_TENSOR);
    f.cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
    expect("fp8_compute on f8", &f, INVALID,
           "fp8_compute quantizes f32, f16 or bf16 inputs, but dtype is f8_e4m3", AT_INIT,
           REF_CHECK);
    fx_init(&f);
    f.cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_BLOCK;
    f.a.descale_q = fx_descales[0];
    expect("fp8_compute with descales", &f, INVALID,
           "descale_q is given, but this layer quantizes its f32 q, k, v itself (fp8_compute)",
           AT_FORWARD, REF_CHECK);
    fx_init(&f);
    f.cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
    setenv("FMHA_FP8_ATTN", "yes", 1);
    expect("FMHA_FP8_ATTN=yes", &f, INVALID, "FMHA_FP8_ATTN=yes is not 0 (FP8 attention off) or 1",
           AT_INIT, REF_SKIP);
    unsetenv("FMHA_FP8_ATTN");

    /* fp8_smooth_k */
    fx_init(&f);
    f.cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
    f.cfg.fp8_smooth_k = 2;
    expect("fp8_smooth_k 2", &f, INVALID, "fp8_smooth_k (2) must be 0 or 1", AT_INIT, REF_CHECK);
    fx_init(&f);
    f.cfg.fp8_smooth_k = 1; /* no effect without fp8_compute, softcap or not */
    f.cfg.softcap = 30;
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "fp8_smooth_k without fp8_compute: %s",
             fmha_last_error());
    fx_init(&f);
    f.cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_BLOCK;
    f.cfg.fp8_smooth_k = 1;
    f.cfg.softcap = 30;
    expect(
        "fp8_smooth_k with softcap", &f, INVALID,
        "which the softmax ignores but softcap (30) does not: set softcap = 0 or fp8_smooth_k = 0",
        AT_INIT, REF_CHECK);
}

/* -------------------------------------------------------------- cu_seqlens */

static void test_varlen(void)
{
    fixture f;
    fx_init_varlen(&f);
    poison(&f);
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "valid varlen: %s", fmha_last_error());
    TU_CHECK(fmha_reference_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "valid varlen ref: %s",
             fmha_last_error());

    fx_init_varlen(&f);
    f.a.cu_seqlens_k = NULL;
    expect("only cu_seqlens_q", &f, INVALID, "cu_seqlens_q and cu_seqlens_k must both be given",
           AT_FORWARD, REF_CHECK);
    fx_init_varlen(&f);
    f.a.cu_seqlens_q = NULL;
    expect("only cu_seqlens_k", &f, INVALID, "cu_seqlens_q and cu_seqlens_k must both be given",
           AT_FORWARD, REF_CHECK);

    fx_init_varlen(&f);
    f.cuq[0] = 1;
    expect("cu_seqlens_q[0] = 1", &f, INVALID, "cu_seqlens_q[0] (1) must be 0", AT_FORWARD,
           REF_CHECK);
    fx_init_varlen(&f);
    f.cuk[0] = -1;
    expect("cu_seqlens_k[0] = -1", &f, INVALID, "cu_seqlens_k[0] (-1) must be 0", AT_FORWARD,
           REF_CHECK);

    fx_init_varlen(&f);
    f.cuq[1] = 5, f.cuq[2] = 4;
    expect("cu_seqlens_q decreasing", &f, INVALID, "cu_seqlens_q decreases at entry 2 (4 after 5)",
           AT_FORWARD, REF_CHECK);
    fx_init_varlen(&f);
    f.cuk[1] = -3;
    expect("cu_seqlens_k decreasing", &f, INVALID, "cu_seqlens_k decreases at entry 1 (-3 after 0)",
           AT_FORWARD, REF_CHECK);

    fx_init_varlen(&f);
    f.cuq[2] = 7;
    expect("cu_seqlens_q past the tensor", &f, INVALID,
           "cu_seqlens_q[2] (7) is past the tensor's 6 tokens", AT_FORWARD, REF_CHECK);
    fx_init_varlen(&f);
    f.cuk[1] = 11, f.cuk[2] = 11;
    expect("cu_seqlens_k past the tensor", &f, INVALID,
           "cu_seqlens_k[2] (11) is past the tensor's 10 tokens", AT_FORWARD, REF_CHECK);

    fx_init(&f); /* padded batch-2 tensors with cu_seqlens */
    f.cuq[0] = 0, f.cuq[1] = 1, f.cuq[2] = 2;
    f.cuk[0] = 0, f.cuk[1] = 1, f.cuk[2] = 2;
    f.a.cu_seqlens_q = f.cuq;
    f.a.cu_seqlens_k = f.cuk;
    f.a.varlen_batch = 2;
    expect("packed batch 2", &f, INVALID, "packed tensors have batch 1 (got 2)", AT_FORWARD,
           REF_CHECK);

    const int64_t vb[3] = {0, -1, (int64_t)INT32_MAX + 1};
    for (int i = 0; i < 3; i++) {
        fx_init_varlen(&f);
        f.a.varlen_batch = vb[i];
        char phrase[64];
        snprintf(phrase, sizeof phrase, "varlen_batch (%lld) must be in [1, 2^31 - 1)",
                 (long long)vb[i]);
        expect("varlen_batch", &f, INVALID, phrase, AT_FORWARD, REF_CHECK);
    }

    fx_init_varlen(&f);
    f.a.max_seqlen_q = 3; /* real max is 4 */
    expect("max_seqlen_q below max", &f, INVALID,
           "max_seqlen_q (3) is below the longest query sequence (4)", AT_FORWARD, REF_CHECK);
    fx_init_varlen(&f);
    f.a.max_seqlen_q = -1;
    expect("max_seqlen_q negative", &f, INVALID, "max_seqlen_q (-1)", AT_FORWARD, REF_CHECK);
    fx_init_varlen(&f);
    f.a.max_seqlen_k = 5; /* real max is 6 */
    expect("max_seqlen_k below max", &f, INVALID,
           "max_seqlen_k (5) is below the longest key sequence (6)", AT_FORWARD, REF_CHECK);
    fx_init_varlen(&f); /* exact and generous bounds are fine */
    f.a.max_seqlen_q = 4;
    f.a.max_seqlen_k = 100;
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "max_seqlen upper bounds: %s",
             fmha_last_error());

    fx_init_varlen(&f); /* more tokens than int32 cu_seqlens can index (q: stride 0, a tiny
                           extent; out's rows may not overlap, but its extent is only computed) */
    f.a.q.data = f.a.out.data = dummy;
    f.a.q.seqlen = f.a.out.seqlen = (int64_t)INT32_MAX + 1;
    f.a.q.stride_seq = 0;
    expect("packed > 2^31 tokens", &f, INVALID, "more than 2^31 tokens", AT_FORWARD, REF_CHECK);
}

/* ---------------------------------------------------------------- CPU ISA */

static void test_isa(void)
{
    fixture f;
    fmha_kernel_info info;
    const fmha_cpu_isa best = fmha_cpu_isa_detect();
    TU_CHECK(best >= FMHA_CPU_ISA_SCALAR && best <= FMHA_CPU_ISA_LAST,
             "fmha_cpu_isa_detect returned %d", (int)best);
    /* AUTO: the best, but avx512-bf16 only where its kernel is the faster. */
    const fmha_cpu_isa autoisa = fmha_cpu_isa_auto();
    TU_CHECK(autoisa == best ||
                 (best == FMHA_CPU_ISA_AVX512_BF16 && autoisa == FMHA_CPU_ISA_AVX512),
             "AUTO picks %s on a CPU with %s", fmha_cpu_isa_name(autoisa), fmha_cpu_isa_name(best));

    fx_init(&f);
    setenv("FMHA_CPU_ISA", "sse9", 1);
    expect("FMHA_CPU_ISA=sse9", &f, INVALID, "FMHA_CPU_ISA=sse9 is not one of", AT_INIT, REF_SKIP);
    f.cfg.cpu_isa = FMHA_CPU_ISA_SCALAR; /* a forced ISA ignores the variable */
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK &&
                 !strcmp(info.name, "cpu_scalar_f32"),
             "forced scalar with bogus env: %s", fmha_last_error());
    f.cfg.cpu_isa = FMHA_CPU_ISA_AUTO;
    setenv("FMHA_CPU_ISA", "scalar", 1);
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK &&
                 !strcmp(info.name, "cpu_scalar_f32") && info.cpu_isa == FMHA_CPU_ISA_SCALAR,
             "FMHA_CPU_ISA=scalar: %s %s", fmha_last_error(), info.name);
    /* auto chooses as no variable does: for these f32 inputs the f32 kernel of
     * the auto ISA (on a CPU whose auto ISA is avx512-bf16, the avx512 one). */
    unsetenv("FMHA_CPU_ISA");
    fmha_kernel_info unset;
    const fmha_cpu_isa f32isa = autoisa == FMHA_CPU_ISA_AVX512_BF16 ? FMHA_CPU_ISA_AVX512 : autoisa;
    TU_CHECK(fmha_kernel_select(&f.cfg, &unset) == FMHA_STATUS_OK && unset.cpu_isa == f32isa,
             "no FMHA_CPU_ISA: %s %s (auto ISA %s)", fmha_last_error(), unset.name,
             fmha_cpu_isa_name(autoisa));
    setenv("FMHA_CPU_ISA", "auto", 1);
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK && info.cpu_isa == unset.cpu_isa &&
                 !strcmp(info.name, unset.name),
             "FMHA_CPU_ISA=auto: %s %s, unset %s", fmha_last_error(), info.name, unset.name);
    if (best >= FMHA_CPU_ISA_AVX2) {
        setenv("FMHA_CPU_ISA", "avx2", 1);
        TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK &&
                     !strcmp(info.name, "cpu_avx2_f32"),
                 "FMHA_CPU_ISA=avx2: %s", fmha_last_error());
    }
    if (best < FMHA_CPU_ISA_AVX512) {
        setenv("FMHA_CPU_ISA", "avx512", 1);
        expect("FMHA_CPU_ISA=avx512 above detect", &f, UNSUPPORTED,
               "was requested but this CPU/OS supports at most", AT_INIT, REF_SKIP);
    }
    if (best < FMHA_CPU_ISA_AVX512_BF16) {
        setenv("FMHA_CPU_ISA", "avx512-bf16", 1);
        expect("FMHA_CPU_ISA=avx512-bf16 above detect", &f, UNSUPPORTED,
               "CPU ISA avx512-bf16 was requested but this CPU/OS supports at most", AT_INIT,
               REF_SKIP);
    }
    unsetenv("FMHA_CPU_ISA");

    /* Every ISA up to the detected one can be forced and names its kernel:
     * f32 inputs always run f32 arithmetic, bf16 ones vdpbf16ps on avx512-bf16. */
    const char *f32_kernel[5] = {NULL, "cpu_scalar_f32", "cpu_avx2_f32", "cpu_avx512_f32",
                                 "cpu_avx512_f32"};
    for (int isa = FMHA_CPU_ISA_SCALAR; isa <= (int)best; isa++) {
        fx_init(&f);
        f.cfg.cpu_isa = (fmha_cpu_isa)isa;
        const int kisa = isa == FMHA_CPU_ISA_AVX512_BF16 ? FMHA_CPU_ISA_AVX512 : isa; /* kernel's */
        TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK &&
                     !strcmp(info.name, f32_kernel[isa]) && (int)info.cpu_isa == kisa &&
                     info.device == FMHA_DEVICE_CPU,
                 "forced %s: %s", fmha_cpu_isa_name((fmha_cpu_isa)isa), fmha_last_error());
        poison(&f);
        TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "forced %s forward: %s",
                 fmha_cpu_isa_name((fmha_cpu_isa)isa), fmha_last_error());
        fmha_config cb = f.cfg;
        cb.dtype = FMHA_DTYPE_BF16;
        const char *want = isa == FMHA_CPU_ISA_AVX512_BF16 ? "cpu_avx512_bf16dp" : f32_kernel[isa];
        TU_CHECK(fmha_kernel_select(&cb, &info) == FMHA_STATUS_OK && !strcmp(info.name, want),
                 "forced %s, bf16 inputs: %s (want %s)", fmha_cpu_isa_name((fmha_cpu_isa)isa),
                 info.name, want);
    }
    /* A forced ISA the CPU lacks is an error, not a silent downgrade; only
     * testable below the top ISA. */
    if (best < FMHA_CPU_ISA_AVX512_BF16) {
        fx_init(&f);
        f.cfg.cpu_isa = FMHA_CPU_ISA_AVX512_BF16;
        expect("forced avx512-bf16 above detect", &f, UNSUPPORTED,
               "CPU ISA avx512-bf16 was requested but this CPU/OS supports at most", AT_INIT,
               REF_SKIP);
    } else {
        printf("skipped: forcing an ISA above the detected one (this CPU has avx512-bf16)\n");
    }
}

/* ---------------------------------------------------------- positive checks */

static void test_names(void)
{
    const struct {
        fmha_status s;
        const char *name;
    } st[] = {
        {FMHA_STATUS_OK, "FMHA_STATUS_OK"},
        {FMHA_STATUS_INVALID_ARGUMENT, "FMHA_STATUS_INVALID_ARGUMENT"},
        {FMHA_STATUS_UNSUPPORTED, "FMHA_STATUS_UNSUPPORTED"},
        {FMHA_STATUS_OUT_OF_MEMORY, "FMHA_STATUS_OUT_OF_MEMORY"},
        {FMHA_STATUS_BACKEND_ERROR, "FMHA_STATUS_BACKEND_ERROR"},
    };
    for (size_t i = 0; i < sizeof st / sizeof st[0]; i++)
        TU_CHECK(!strcmp(fmha_status_string(st[i].s), st[i].name), "status %d name %s",
                 (int)st[i].s, fmha_status_string(st[i].s));
    const char *unk = fmha_status_string((fmha_status)99);
    TU_CHECK(unk != NULL && strstr(unk, "UNKNOWN") != NULL, "status 99 name %s", unk);

    const struct {
        fmha_dtype d;
        const char *name;
        size_t size;
    } dt[] = {
        {FMHA_DTYPE_F32, "f32", 4},
        {FMHA_DTYPE_F16, "f16", 2},
        {FMHA_DTYPE_BF16, "bf16", 2},
        {FMHA_DTYPE_F8_E4M3, "f8_e4m3", 1},
    };
    for (size_t i = 0; i < sizeof dt / sizeof dt[0]; i++)
        TU_CHECK(
            !strcmp(fmha_dtype_name(dt[i].d), dt[i].name) && fmha_dtype_size(dt[i].d) == dt[i].size,
            "dtype %d: %s %zu", (int)dt[i].d, fmha_dtype_name(dt[i].d), fmha_dtype_size(dt[i].d));
    TU_CHECK(fmha_dtype_size((fmha_dtype)17) == 0 && fmha_dtype_name((fmha_dtype)17) != NULL,
             "unknown dtype must have size 0 and a name");

    const char *isa[5] = {"auto", "scalar", "avx2", "avx512", "avx512-bf16"};
    for (int i = 0; i < 4; i++)
        TU_CHECK(!strcmp(fmha_cpu_isa_name((fmha_cpu_isa)i), isa[i]), "isa %d name %s", i,
                 fmha_cpu_isa_name((fmha_cpu_isa)i));
    TU_CHECK(fmha_cpu_isa_name((fmha_cpu_isa)9) != NULL, "unknown isa must have a name");
    TU_CHECK(fmha_cpu_isa_detect() != FMHA_CPU_ISA_AUTO, "detect returned AUTO");
}

static void test_defaults_and_views(void)
{
    fmha_config cfg;
    memset(&cfg, 0x5A, sizeof cfg); /* init must set every field */
    fmha_config_init(&cfg, 32, 8, 128);
    TU_CHECK(cfg.num_heads == 32 && cfg.num_kv_heads == 8 && cfg.head_dim == 128 &&
                 cfg.head_dim_v == 128,
             "config_init shape");
    TU_CHECK(cfg.dtype == FMHA_DTYPE_BF16, "default dtype %s", fmha_dtype_name(cfg.dtype));
    TU_CHECK(cfg.softmax_scale == 0.0 && cfg.softcap == 0.0 && cfg.dropout_p == 0.0,
             "default scale/softcap/dropout");
    TU_CHECK(cfg.window_left == -1 && cfg.window_right == -1 && cfg.causal == 0,
             "default window (%lld, %lld) causal %d", (long long)cfg.window_left,
             (long long)cfg.window_right, cfg.causal);
    TU_CHECK(cfg.device == FMHA_DEVICE_CPU && cfg.cpu_isa == FMHA_CPU_ISA_AUTO &&
                 cfg.num_threads == 0,
             "default device/isa/threads");
    TU_CHECK(cfg.fp8_compute == FMHA_FP8_COMPUTE_OFF, "default fp8_compute %d",
             (int)cfg.fp8_compute);

    int x;
    fmha_tensor t = fmha_tensor_bshd(&x, FMHA_DTYPE_F16, 2, 3, 4, 5);
    TU_CHECK(t.data == &x && t.dtype == FMHA_DTYPE_F16 && t.batch == 2 && t.seqlen == 3 &&
                 t.heads == 4 && t.head_dim == 5,
             "bshd dims");
    TU_CHECK(t.stride_batch == 60 && t.stride_seq == 20 && t.stride_head == 5 && t.stride_dim == 1,
             "bshd strides %lld %lld %lld %lld", (long long)t.stride_batch, (long long)t.stride_seq,
             (long long)t.stride_head, (long long)t.stride_dim);
    t = fmha_tensor_bhsd(&x, FMHA_DTYPE_BF16, 2, 3, 4, 5);
    TU_CHECK(t.batch == 2 && t.seqlen == 3 && t.heads == 4 && t.head_dim == 5 &&
                 t.stride_batch == 60 && t.stride_seq == 5 && t.stride_head == 15 &&
                 t.stride_dim == 1,
             "bhsd strides %lld %lld %lld %lld", (long long)t.stride_batch, (long long)t.stride_seq,
             (long long)t.stride_head, (long long)t.stride_dim);
    t = fmha_tensor_packed(&x, FMHA_DTYPE_F32, 11, 4, 5);
    TU_CHECK(t.batch == 1 && t.seqlen == 11 && t.heads == 4 && t.head_dim == 5 &&
                 t.stride_seq == 20 && t.stride_head == 5 && t.stride_dim == 1 &&
                 t.stride_batch == 220,
             "packed strides %lld %lld %lld", (long long)t.stride_batch, (long long)t.stride_seq,
             (long long)t.stride_head);
}

/* ------------------------------------------------------------ conversions */

/* The f16 value of bits h, decoded independently of the library. */
static double f16_value(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

static void test_conversions(void)
{
    /* bf16: exhaustive decode and round trip */
    int bad_bf = 0, bad_f16 = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = fmha_bf16_to_f32((uint16_t)h);
        if (fmha_f32_to_bits(f) != h << 16)
            bad_bf++;
        uint16_t back = fmha_f32_to_bf16(f);
        if (isnan(f) ? !isnan(fmha_bf16_to_f32(back)) : back != h)
            bad_bf++;
        double want = f16_value((uint16_t)h);
        float g = fmha_f16_to_f32((uint16_t)h);
        if (isnan(want) ? !isnan(g) : (double)g != want || !!signbit(g) != !!(h & 0x8000))
            bad_f16++;
        uint16_t back16 = fmha_f32_to_f16(g);
        if (isnan(want) ? !isnan(f16_value(back16)) : back16 != h)
            bad_f16++;
    }
    TU_CHECK(bad_bf == 0, "bf16 decode/round trip: %d mismatches", bad_bf);
    TU_CHECK(bad_f16 == 0, "f16 decode/round trip: %d mismatches", bad_f16);

    /* bf16 rounding: to nearest, ties to even, NaN stays NaN (also signalling
     * NaNs whose payload sits in the dropped bits), overflow to inf. */
    const struct {
        uint32_t in;
        uint16_t out;
    } bf[] = {
        {0x3F800000, 0x3F80}, {0x3F808000, 0x3F80}, /* tie, even stays */
        {0x3F818000, 0x3F82},                       /* tie, odd rounds up */
        {0x3F808001, 0x3F81}, {0x3F807FFF, 0x3F80}, {0xBF818000, 0xBF82},
        {0x7F7FFFFF, 0x7F80}, /* FLT_MAX rounds to inf */
        {0x7F7F7FFF, 0x7F7F}, {0x7F800000, 0x7F80}, {0xFF800000, 0xFF80},
        {0x00000000, 0x0000}, {0x80000000, 0x8000}, {0x00010000, 0x0001}, /* subnormal */
        {0x00018000, 0x0002}, {0x00008000, 0x0000}, {0x00008001, 0x0001},
    };
    for (size_t i = 0; i < sizeof bf / sizeof bf[0]; i++) {
        uint16_t got = fmha_f32_to_bf16(fmha_bits_to_f32(bf[i].in));
        TU_CHECK(got == bf[i].out, "bf16(0x%08x) = 0x%04x, want 0x%04x", bf[i].in, got, bf[i].out);
    }
    const uint32_t nans[] = {0x7FC00000, 0x7F800001, 0x7F80FFFF, 0xFF800001, 0x7FFFFFFF};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t g = fmha_f32_to_bf16(fmha_bits_to_f32(nans[i]));
        TU_CHECK(isnan(fmha_bf16_to_f32(g)) && (g >> 15) == (nans[i] >> 31),
                 "bf16(NaN 0x%08x) = 0x%04x is not a NaN of the same sign", nans[i], g);
        uint16_t h = fmha_f32_to_f16(fmha_bits_to_f32(nans[i]));
        TU_CHECK(isnan(f16_value(h)) && (h >> 15) == (nans[i] >> 31),
                 "f16(NaN 0x%08x) = 0x%04x is not a NaN of the same sign", nans[i], h);
    }

    /* f16 rounding */
    const struct {
        float in;
        uint16_t out;
    } hf[] = {
        {1.0f, 0x3C00},
        {1.0f + 0x1p-11f, 0x3C00},     /* tie, even stays */
        {1.0f + 3 * 0x1p-11f, 0x3C02}, /* tie, odd rounds up */
        {1.0f + 0x1p-11f + 0x1p-20f, 0x3C01},
        {-2.0f, 0xC000},
        {65504.0f, 0x7BFF}, /* largest finite */
        {65519.99f, 0x7BFF},
        {65520.0f, 0x7C00}, /* tie above max: rounds to inf */
        {1e6f, 0x7C00},
        {-1e6f, 0xFC00},
        {INFINITY, 0x7C00},
        {-INFINITY, 0xFC00},
        {0x1p-14f, 0x0400}, /* smallest normal */
        {0x1p-24f, 0x0001}, /* smallest subnormal */
        {0x1p-25f, 0x0000}, /* tie between 0 and 2^-24: even */
        {0x1p-25f + 0x1p-40f, 0x0001},
        {3 * 0x1p-25f, 0x0002},       /* tie between 1 and 2 ulps: even */
        {1023 * 0x1p-24f, 0x03FF},    /* largest subnormal */
        {1023.5f * 0x1p-24f, 0x0400}, /* tie into the normals */
        {-0x1p-24f, 0x8001},
        {0x1p-26f, 0x0000},
        {-0.0f, 0x8000},
        {1e-30f, 0x0000},
    };
    for (size_t i = 0; i < sizeof hf / sizeof hf[0]; i++) {
        uint16_t got = fmha_f32_to_f16(hf[i].in);
        TU_CHECK(got == hf[i].out, "f16(%a) = 0x%04x, want 0x%04x", (double)hf[i].in, got,
                 hf[i].out);
    }

    /* f16 and bf16 rounding of many random floats: the result is the nearest
     * representable value, ties to even. */
    tu_rng r = {7};
    int bad_near16 = 0, bad_nearbf = 0;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)tu_next(&r);
        if (i & 1) /* mostly f16's range, exponents 2^-26 .. 2^17 */
            u = (u & 0x807FFFFFu) | ((uint32_t)(101 + tu_range(&r, 43)) << 23);
        float x = fmha_bits_to_f32(u);
        if (isnan(x))
            continue;
        uint16_t h = fmha_f32_to_f16(x);
        double hv = f16_value(h), err = fabs(hv - x);
        if (isinf(hv) || fabs(x) >= 65520.0) {
            if (!isinf(hv) || fabs(x) < 65520.0 || !!signbit(hv) != !!signbit(x))
                bad_near16++;
        } else {
            for (int dlt = -1; dlt <= 1; dlt += 2) {
                uint16_t n = (uint16_t)(h + dlt);
                if ((h & 0x7fff) == 0 && dlt < 0)
                    n = (uint16_t)((h ^ 0x8000) + 1); /* next across zero */
                double nv = f16_value(n);
                if (isnan(nv))
                    continue;
                double ne = fabs(nv - x);
                if (ne < err || (ne == err && (h & 1)))
                    bad_near16++;
            }
        }
        uint16_t b = fmha_f32_to_bf16(x);
        uint32_t rem = u & 0xFFFF, up = (u >> 16) + 1, dn = u >> 16;
        uint16_t want = (uint16_t)(rem > 0x8000 || (rem == 0x8000 && (dn & 1)) ? up : dn);
        if (b != want)
            bad_nearbf++;
    }
    TU_CHECK(bad_near16 == 0, "f16 rounding: %d values not rounded to nearest even", bad_near16);
    TU_CHECK(bad_nearbf == 0, "bf16 rounding: %d values not rounded to nearest even", bad_nearbf);
}

/* ------------------------------------------------- success paths and reuse */

static void test_success(void)
{
    fixture f;
    fx_init(&f);
    fmha_kernel_info info, info2;

    /* After any failure, a successful call clears the message. */
    f.cfg.num_heads = 0;
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == INVALID && fmha_last_error()[0] != '\0',
             "set up a failure");
    f.cfg.num_heads = H;
    poison(&f);
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK && !strcmp(fmha_last_error(), ""),
             "fmha_forward success leaves message \"%s\"", fmha_last_error());
    TU_CHECK(!untouched(&f), "successful forward wrote nothing");

    fmha_forward(NULL, NULL);
    fmha_layer *layer = NULL;
    TU_CHECK(fmha_layer_init(&layer, &f.cfg) == FMHA_STATUS_OK && layer != NULL &&
                 !strcmp(fmha_last_error(), ""),
             "fmha_layer_init success leaves message \"%s\"", fmha_last_error());
    fmha_forward(NULL, NULL);
    TU_CHECK(fmha_layer_forward(layer, &f.a) == FMHA_STATUS_OK && !strcmp(fmha_last_error(), ""),
             "fmha_layer_forward success leaves message \"%s\"", fmha_last_error());
    fmha_forward(NULL, NULL);
    TU_CHECK(fmha_reference_forward(&f.cfg, &f.a) == FMHA_STATUS_OK &&
                 !strcmp(fmha_last_error(), ""),
             "fmha_reference_forward success leaves message \"%s\"", fmha_last_error());
    fmha_forward(NULL, NULL);
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK && !strcmp(fmha_last_error(), ""),
             "fmha_kernel_select success leaves message \"%s\"", fmha_last_error());

    /* The kernel the layer runs is the one the chooser names. */
    TU_CHECK(fmha_kernel_select(&f.cfg, &info) == FMHA_STATUS_OK, "select: %s", fmha_last_error());
    TU_CHECK(info.name != NULL && !strncmp(info.name, "cpu_", 4) &&
                 info.device == FMHA_DEVICE_CPU &&
                 info.cpu_isa == (fmha_cpu_isa_detect() == FMHA_CPU_ISA_AVX512_BF16
                                      ? FMHA_CPU_ISA_AVX512 /* f32 inputs: the f32 kernel */
                                      : fmha_cpu_isa_detect()),
             "kernel %s isa %d", info.name ? info.name : "(null)", (int)info.cpu_isa);
    const fmha_kernel_info *lk = fmha_layer_kernel(layer);
    TU_CHECK(lk && !strcmp(lk->name, info.name) && lk->id == info.id &&
                 lk->cpu_isa == info.cpu_isa && lk->device == info.device,
             "layer kernel %s, chooser %s", lk ? lk->name : "(null)", info.name);
    const fmha_config *lc = fmha_layer_config(layer);
    TU_CHECK(lc && lc != &f.cfg && lc->num_heads == H && lc->num_kv_heads == KV &&
                 lc->head_dim == D && lc->head_dim_v == DV && lc->dtype == FMHA_DTYPE_F32,
             "layer config is not a copy of the config");
    fmha_layer_free(layer);

    /* bf16 picks a kernel too, and layer and chooser still agree */
    f.cfg.dtype = FMHA_DTYPE_BF16;
    TU_CHECK(fmha_kernel_select(&f.cfg, &info2) == FMHA_STATUS_OK &&
                 !strncmp(info2.name, "cpu_", 4),
             "bf16 select: %s", fmha_last_error());
    TU_CHECK(fmha_layer_init(&layer, &f.cfg) == FMHA_STATUS_OK &&
                 !strcmp(fmha_layer_kernel(layer)->name, info2.name),
             "bf16 layer kernel differs from chooser");
    fmha_layer_free(layer);
}

/* One layer, several forward calls of different lengths (bigger, then
 * smaller: the workspace is grown and reused), each against the reference. */
static void test_layer_reuse(void)
{
    fmha_config cfg;
    fmha_config_init(&cfg, H, KV, D);
    cfg.dtype = FMHA_DTYPE_F32;
    cfg.causal = 1;
    fmha_layer *layer;
    TU_CHECK(fmha_layer_init(&layer, &cfg) == FMHA_STATUS_OK, "layer_init: %s", fmha_last_error());
    if (!layer)
        return;
    const int64_t lens[4][2] = {{3, 5}, {70, 9}, {130, 130}, {2, 1}};
    tu_rng r = {99};
    for (int c = 0; c < 4; c++) {
        int64_t sq = lens[c][0], sk = lens[c][1];
        tu_tensor q, k, v, out, ref;
        tu_tensor_init(&q, FMHA_DTYPE_F32, 1, sq, H, D, 0, 0);
        tu_tensor_init(&k, FMHA_DTYPE_F32, 1, sk, KV, D, 0, 0);
        tu_tensor_init(&v, FMHA_DTYPE_F32, 1, sk, KV, D, 0, 0);
        tu_tensor_init(&out, FMHA_DTYPE_F32, 1, sq, H, D, 2, 0xFF);
        tu_tensor_init(&ref, FMHA_DTYPE_F32, 1, sq, H, D, 0, 0xFF);
        tu_fill_normal(&q, &r, 1.0);
        tu_fill_normal(&k, &r, 1.0);
        tu_fill_normal(&v, &r, 1.0);
        fmha_forward_args a;
        memset(&a, 0, sizeof a);
        a.q = q.t, a.k = k.t, a.v = v.t, a.out = out.t;
        TU_CHECK(fmha_layer_forward(layer, &a) == FMHA_STATUS_OK, "reuse %d: %s", c,
                 fmha_last_error());
        a.out = ref.t;
        TU_CHECK(fmha_reference_forward(&cfg, &a) == FMHA_STATUS_OK, "reuse ref %d: %s", c,
                 fmha_last_error());
        double err = 0;
        int nonfinite = 0;
        for (int64_t s = 0; s < sq; s++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t e = 0; e < D; e++) {
                    double x = tu_get(&out, 0, s, h, e), y = tu_get(&ref, 0, s, h, e);
                    if (!isfinite(x))
                        nonfinite++;
                    else if (fabs(x - y) > err)
                        err = fabs(x - y);
                }
        TU_CHECK(nonfinite == 0 && err < 1e-4, "reuse %d (sq %lld sk %lld): err %g, %d non-finite",
                 c, (long long)sq, (long long)sk, err, nonfinite);
        TU_CHECK(tu_gaps_untouched(&out, 0xFF), "reuse %d wrote outside the view", c);
        tu_tensor_free(&q);
        tu_tensor_free(&k);
        tu_tensor_free(&v);
        tu_tensor_free(&out);
        tu_tensor_free(&ref);
    }
    fmha_layer_free(layer);
}

/* The FP8 kernel's accumulation mode (no GPU needed to choose it): auto takes
 * two-level past FMHA_FP8_TWO_LEVEL_KEYS keys, the other values force one. */
static void test_fp8_accum(void)
{
    const struct {
        const char *env;
        int64_t keys;
        int want;
    } cases[] = {{NULL, FMHA_FP8_TWO_LEVEL_KEYS, 0},
                 {NULL, FMHA_FP8_TWO_LEVEL_KEYS + 1, 1},
                 {"", 1, 0},
                 {"auto", 75600, 1},
                 {"AUTO", 4608, 0},
                 {"two_level", 1, 1},
                 {"single", 1 << 20, 0},
                 {"Single", 1 << 20, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].env)
            setenv("FMHA_FP8_ACCUM", cases[i].env, 1);
        else
            unsetenv("FMHA_FP8_ACCUM");
        int two = -1;
        fmha_knobs k;
        const fmha_status st = fmha_knobs_read(NULL, &k);
        if (st == FMHA_STATUS_OK)
            two = fmha_fp8_two_level(k.fp8_accum, cases[i].keys);
        TU_CHECK(st == FMHA_STATUS_OK && two == cases[i].want,
                 "FMHA_FP8_ACCUM=%s, %lld keys: %d (%s)", cases[i].env ? cases[i].env : "(unset)",
                 (long long)cases[i].keys, two, fmha_last_error());
    }
    setenv("FMHA_FP8_ACCUM", "double", 1);
    fmha_knobs k;
    TU_CHECK(fmha_knobs_read(NULL, &k) == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(),
                        "FMHA_FP8_ACCUM=double is not one of auto, two_level, single"),
             "FMHA_FP8_ACCUM=double: %s", fmha_last_error());
    unsetenv("FMHA_FP8_ACCUM");
}

/* The Hopper kernel's switches, each as an int for one table. */
static fmha_status schedule_of_env(int *v)
{
    fmha_knobs k;
    const fmha_status st = fmha_knobs_read(NULL, &k);
    *v = st == FMHA_STATUS_OK ? (int)k.schedule : -1;
    return st;
}

static fmha_status clusters_of_env(int *v)
{
    fmha_knobs k;
    const fmha_status st = fmha_knobs_read(NULL, &k);
    *v = st == FMHA_STATUS_OK ? (int)k.cluster : -1;
    return st;
}

/* FMHA_CUDA_SCHEDULE: split unless it names another; FMHA_CUDA_CLUSTER: auto
 * unless it says 0 or 1. Any other value is refused by name. */
static void test_cuda_switches(void)
{
    const struct {
        const char *var;
        fmha_status (*get)(int *);
        const char *env; /* NULL: unset */
        int want;
    } cases[] = {
        {"FMHA_CUDA_SCHEDULE", schedule_of_env, NULL, FMHA_SCHEDULE_SPLIT},
        {"FMHA_CUDA_SCHEDULE", schedule_of_env, "", FMHA_SCHEDULE_SPLIT},
        {"FMHA_CUDA_SCHEDULE", schedule_of_env, "tiles", FMHA_SCHEDULE_TILES},
        {"FMHA_CUDA_SCHEDULE", schedule_of_env, "Persistent", FMHA_SCHEDULE_PERSISTENT},
        {"FMHA_CUDA_SCHEDULE", schedule_of_env, "split", FMHA_SCHEDULE_SPLIT},
        {"FMHA_CUDA_CLUSTER", clusters_of_env, NULL, FMHA_CLUSTER_AUTO},
        {"FMHA_CUDA_CLUSTER", clusters_of_env, "", FMHA_CLUSTER_AUTO},
        {"FMHA_CUDA_CLUSTER", clusters_of_env, "auto", FMHA_CLUSTER_AUTO},
        {"FMHA_CUDA_CLUSTER", clusters_of_env, "1", FMHA_CLUSTER_ON},
        {"FMHA_CUDA_CLUSTER", clusters_of_env, "0", FMHA_CLUSTER_OFF},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].env)
            setenv(cases[i].var, cases[i].env, 1);
        else
            unsetenv(cases[i].var);
        int got = -1;
        const fmha_status st = cases[i].get(&got);
        TU_CHECK(st == FMHA_STATUS_OK && got == cases[i].want, "%s=%s: %d (%s)", cases[i].var,
                 cases[i].env ? cases[i].env : "(unset)", got, fmha_last_error());
        unsetenv(cases[i].var);
    }
    const struct {
        const char *var;
        fmha_status (*get)(int *);
        const char *env, *message;
    } bad[] = {
        {"FMHA_CUDA_SCHEDULE", schedule_of_env, "stream-k",
         "FMHA_CUDA_SCHEDULE=stream-k is not one of tiles, persistent, split"},
        {"FMHA_CUDA_CLUSTER", clusters_of_env, "yes", "FMHA_CUDA_CLUSTER=yes is not auto, 0 or 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv(bad[i].var, bad[i].env, 1);
        int got;
        TU_CHECK(bad[i].get(&got) == FMHA_STATUS_INVALID_ARGUMENT &&
                     strstr(fmha_last_error(), bad[i].message),
                 "%s=%s: %s", bad[i].var, bad[i].env, fmha_last_error());
        unsetenv(bad[i].var);
    }
}

/* The score modifiers' checks (fmha_forward_args: mask, ALiBi, sinks), and
 * the backward's dsinks without sinks. */
static void test_score_mods(void)
{
    static unsigned char keep[B * H * SQ * SK];
    float slopes[B * H + H], sinks[H] = {0.5f, -INFINITY, 1.0f, 0.0f};
    for (int i = 0; i < B * H + H; i++)
        slopes[i] = 0.25f;
    fixture f;
    struct {
        const char *what, *phrase;
        int field; /* 0 mask type, 1 mask stride, 2 alibi stride, 3 slope, 4 sink NaN, 5 sink
                      +inf, 6 a mask stride that overflows */
    } cases[] = {
        {"mask.type 9", "mask.type (9) is not a fmha_mask_type value", 0},
        {"mask.stride_q -1", "mask strides (0, 0, -1, 1) must be >= 0", 1},
        {"alibi_stride_batch -4", "alibi_stride_batch (-4) must be >= 0", 2},
        {"mask.stride_q huge", "mask spans more than 2^63 elements", 6},
        {"alibi slope inf", "alibi_slopes[6] (inf) must be finite", 3},
        {"sink NaN", "sinks[2] (nan) must be finite or -inf", 4},
        {"sink +inf", "sinks[3] (inf) must be finite or -inf", 5},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fx_init(&f);
        switch (cases[i].field) {
        case 0: f.a.mask = (fmha_attn_mask){keep, (fmha_mask_type)9, 0, 0, SK, 1}; break;
        case 1: f.a.mask = (fmha_attn_mask){keep, FMHA_MASK_BOOL, 0, 0, -1, 1}; break;
        case 2:
            f.a.alibi_slopes = slopes;
            f.a.alibi_stride_batch = -4;
            break;
        case 3:
            slopes[6] = INFINITY; /* the second sequence's third head, stride H + 1 */
            f.a.alibi_slopes = slopes;
            f.a.alibi_stride_batch = H + 1;
            break;
        case 4:
            sinks[2] = NAN;
            f.a.sinks = sinks;
            break;
        case 5:
            sinks[2] = 1.0f;
            sinks[3] = INFINITY;
            f.a.sinks = sinks;
            break;
        case 6: f.a.mask = (fmha_attn_mask){keep, FMHA_MASK_BOOL, 0, 0, INT64_MAX / 2, 1}; break;
        }
        expect(cases[i].what, &f, INVALID, cases[i].phrase, AT_FORWARD, REF_CHECK);
        slopes[6] = 0.25f;
    }
    sinks[3] = 0.0f;

    /* K smoothing moves each row's scores: no sinks beside it */
    fx_init(&f);
    f.a.sinks = sinks;
    f.cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
    f.cfg.fp8_smooth_k = 1;
    expect("sinks with fp8_smooth_k", &f, UNSUPPORTED, "sinks with K smoothing", AT_FORWARD,
           REF_SKIP);

    /* dsinks needs sinks; with them the backward writes it */
    fx_init(&f);
    float dout[B * SQ * H * DV], dq[B * SQ * H * D], dsinks[H];
    for (size_t i = 0; i < sizeof dout / sizeof dout[0]; i++)
        dout[i] = 0.5f;
    f.a.sinks = sinks;
    TU_CHECK(fmha_forward(&f.cfg, &f.a) == FMHA_STATUS_OK, "forward with sinks: %s",
             fmha_last_error());
    fmha_backward_args b = {.q = f.a.q,
                            .k = f.a.k,
                            .v = f.a.v,
                            .out = f.a.out,
                            .dout = fmha_tensor_bshd(dout, FMHA_DTYPE_F32, B, SQ, H, DV),
                            .lse = f.lse,
                            .dq = fmha_tensor_bshd(dq, FMHA_DTYPE_F32, B, SQ, H, D),
                            .dsinks = dsinks};
    memset(dsinks, POISON, sizeof dsinks);
    check_result("dsinks without sinks", "fmha_backward", fmha_backward(&f.cfg, &b), INVALID,
                 "dsinks is given without sinks");
    check_result("dsinks without sinks", "fmha_reference_backward",
                 fmha_reference_backward(&f.cfg, &b), INVALID, "dsinks is given without sinks");
    TU_CHECK(((unsigned char *)dsinks)[0] == POISON, "dsinks written on error");
    b.sinks = sinks;
    TU_CHECK(fmha_backward(&f.cfg, &b) == FMHA_STATUS_OK, "backward with sinks: %s",
             fmha_last_error());
    TU_CHECK(dsinks[1] == 0.0f && isfinite(dsinks[0]) && dsinks[0] != 0.0f,
             "dsinks: %g for a sink of 0.5, %g for -inf (want nonzero, 0)", (double)dsinks[0],
             (double)dsinks[1]);
}

int main(void)
{
    unsetenv("FMHA_CPU_ISA");
    unsetenv("FMHA_FP8_ATTN");
    test_batch_heads_wrap(); /* first: forks before OpenMP has started threads */
    test_names();
    test_defaults_and_views();
    test_conversions();
    test_null_pointers();
    test_tensor_dims();
    test_out_overlap();
    test_mismatches();
    test_config();
    test_varlen();
    test_fp8_args();
    test_fp8_accum();
    test_score_mods();
    test_cuda_switches();
    test_isa();
    test_success();
    test_layer_reuse();
    return tu_summary();
}
