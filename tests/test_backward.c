/* test_backward.c — the backward pass: the float64 reference gradients
 * against central finite differences of the float64 reference forward, then
 * every CPU backward kernel against the reference over random cases of
 * awkward sizes (odd seqlens, seqlen_q != seqlen_k, GQA 3:1, MQA, head dims
 * 33..256, head_dim_v != head_dim, every layout, mask, softcap, dropout,
 * varlen, input and gradient dtype), gradients poisoned first, with the
 * tolerance set by a naive f32 backward's error on the same case; then the
 * error messages, determinism, empty problems and allocation failures.
 * FMHA_TEST_CASES sets the number of random cases, FMHA_TEST_QUICK=1 leaves
 * out the long sequences. */
#include "alloc.h"
#include "cases.h"
#include "testutil.h"
#include "validate.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ----------------------------------------------- the reference, by FD */

static double dot_out(const tu_tensor *dout, const tu_tensor *out)
{
    double sum = 0;
    const fmha_tensor *t = &out->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++)
                    sum += tu_get(dout, b, s, h, c) * tu_get(out, b, s, h, c);
    return sum;
}

/* Random values on a grid of 2^-10, so that x +- 2h stays exact in f32. */
static void fill_grid(tu_tensor *x, tu_rng *r, double sigma)
{
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++)
                    tu_set(x, b, s, h, c, round(sigma * tu_normal(r) * 1024.0) / 1024.0);
}

/* fmha_reference_backward's gradients against fourth-order central
 * differences of L = sum(dout * out) over fmha_reference_forward, for every
 * element of q, k and v of a small problem. */
static void test_reference_fd(tu_rng *r, const char *what, fmha_config cfg, int64_t sq, int64_t sk,
                              int varlen)
{
    const int64_t H = cfg.num_heads, KV = cfg.num_kv_heads, d = cfg.head_dim, dv = cfg.head_dim_v;
    const double h = 1.0 / 32;
    cfg.dtype = FMHA_DTYPE_F32;
    cfg.num_threads = 1;
    int32_t cuq[3] = {0, 3, (int32_t)sq}, cuk[3] = {0, (int32_t)(sk - 4), (int32_t)sk};
    tu_tensor q, k, v, out, dout, g[3];
    tu_tensor_init(&q, cfg.dtype, varlen ? 1 : 2, sq, H, d, 0, 0);
    tu_tensor_init(&k, cfg.dtype, varlen ? 1 : 2, sk, KV, d, 1, 0);
    tu_tensor_init(&v, cfg.dtype, varlen ? 1 : 2, sk, KV, dv, 2, 0);
    tu_tensor_init(&out, cfg.dtype, varlen ? 1 : 2, sq, H, dv, 0, 0);
    tu_tensor_init(&dout, cfg.dtype, varlen ? 1 : 2, sq, H, dv, 0, 0);
    fill_grid(&q, r, 0.7);
    fill_grid(&k, r, 0.7);
    fill_grid(&v, r, 1.0);
    fill_grid(&dout, r, 1.0);
    tu_tensor *in[3] = {&q, &k, &v};
    for (int i = 0; i < 3; i++)
        tu_tensor_init(&g[i], FMHA_DTYPE_F32, in[i]->t.batch, in[i]->t.seqlen, in[i]->t.heads,
                       in[i]->t.head_dim, 0, 0xFF);
    float *lse = malloc(sizeof(float) * (size_t)(2 * H * sq));
    fmha_forward_args fa = {.q = q.t, .k = k.t, .v = v.t, .out = out.t, .lse = lse, .seed = 99};
    fmha_backward_args ba = {.q = q.t,
                             .k = k.t,
                             .v = v.t,
                             .out = out.t,
                             .dout = dout.t,
                             .lse = lse,
                             .dq = g[0].t,
                             .dk = g[1].t,
                             .dv = g[2].t,
                             .seed = 99};
    if (varlen) {
        fa.cu_seqlens_q = ba.cu_seqlens_q = cuq;
        fa.cu_seqlens_k = ba.cu_seqlens_k = cuk;
        fa.varlen_batch = ba.varlen_batch = 2;
    }
    TU_CHECK(fmha_reference_forward(&cfg, &fa) == FMHA_STATUS_OK, "%s: %s", what,
             fmha_last_error());
    TU_CHECK(fmha_reference_backward(&cfg, &ba) == FMHA_STATUS_OK, "%s: %s", what,
             fmha_last_error());
    const char *names[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; i++) {
        const fmha_tensor *t = &in[i]->t;
        double err = 0, gmax = 0;
        for (int64_t b = 0; b < t->batch; b++)
            for (int64_t s = 0; s < t->seqlen; s++)
                for (int64_t hh = 0; hh < t->heads; hh++)
                    for (int64_t c = 0; c < t->head_dim; c++) {
                        const double x0 = tu_get(in[i], b, s, hh, c);
                        double f[4];
                        const int steps[4] = {-2, -1, 1, 2};
                        for (int e = 0; e < 4; e++) {
                            tu_set(in[i], b, s, hh, c, x0 + steps[e] * h);
                            fmha_reference_forward(&cfg, &fa);
                            f[e] = dot_out(&dout, &out);
                        }
                        tu_set(in[i], b, s, hh, c, x0);
                        const double fd = (f[0] - 8 * f[1] + 8 * f[2] - f[3]) / (12 * h);
                        const double an = tu_get(&g[i], b, s, hh, c);
                        err = fmax(err, fabs(fd - an));
                        gmax = fmax(gmax, fabs(an));
                    }
        if (getenv("FMHA_TEST_VERBOSE"))
            printf("reference %s, %s: fd error %.3g, largest %.3g\n", what, names[i], err, gmax);
        TU_CHECK(gmax > 0 && err <= 1e-4 * gmax + 1e-5,
                 "reference %s, %s: finite differences differ by %.3g (largest |%s| %.3g)", what,
                 names[i], err, names[i], gmax);
    }
    for (int i = 0; i < 3; i++)
        tu_tensor_free(&g[i]);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&dout);
    free(lse);
}

static void test_reference_by_fd(tu_rng *r)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 3, 1, 5); /* GQA 3:1 */
    cfg.head_dim_v = 3;
    test_reference_fd(r, "GQA 3:1, hv != hd, sq 5 != sk 7", cfg, 5, 7, 0);
    cfg.causal = 1;
    test_reference_fd(r, "causal, sq 7 > sk 5 (rows without keys)", cfg, 7, 5, 0);
    cfg.causal = 0;
    cfg.window_left = 2;
    cfg.window_right = 1;
    cfg.softcap = 1.5;
    cfg.softmax_scale = 0.9;
    test_reference_fd(r, "window (2, 1), softcap 1.5", cfg, 6, 6, 0);
    fmha_config_init(&cfg, 2, 2, 4);
    cfg.dropout_p = 0.3;
    cfg.causal = 1;
    test_reference_fd(r, "dropout 0.3, causal", cfg, 6, 8, 0);
    fmha_config_init(&cfg, 2, 1, 4);
    cfg.head_dim_v = 6;
    cfg.softcap = 3;
    test_reference_fd(r, "varlen (3 + 4 queries, 5 + 4 keys), MQA, softcap", cfg, 7, 9, 1);
}

/* -------------------------------------------------------- random cases */

static fmha_status cpu_backward(const fmha_config *cfg, const fmha_backward_args *a)
{
    return fmha_backward(cfg, a);
}

/* --------------------------------------------------------- other checks */

/* A small GQA problem's tensors, for the checks below. */
typedef struct small {
    fmha_config cfg;
    tu_tensor q, k, v, out, dout, dq, dk, dv;
    float lse[3 * 2 * 37];
    fmha_backward_args a;
} small;

static void small_init(small *s, tu_rng *r, fmha_cpu_isa isa)
{
    fmha_config_init(&s->cfg, 3, 1, 40);
    s->cfg.dtype = FMHA_DTYPE_BF16;
    s->cfg.causal = 1;
    s->cfg.dropout_p = 0.2;
    s->cfg.cpu_isa = isa;
    tu_tensor_init(&s->q, s->cfg.dtype, 2, 37, 3, 40, 0, 0);
    tu_tensor_init(&s->k, s->cfg.dtype, 2, 300, 1, 40, 0, 0);
    tu_tensor_init(&s->v, s->cfg.dtype, 2, 300, 1, 40, 0, 0);
    tu_tensor_init(&s->out, s->cfg.dtype, 2, 37, 3, 40, 0, 0);
    tu_tensor_init(&s->dout, s->cfg.dtype, 2, 37, 3, 40, 0, 0);
    tu_tensor_init(&s->dq, FMHA_DTYPE_F32, 2, 37, 3, 40, 0, 0xFF);
    tu_tensor_init(&s->dk, FMHA_DTYPE_BF16, 2, 300, 1, 40, 1, 0xFF);
    tu_tensor_init(&s->dv, FMHA_DTYPE_F16, 2, 300, 1, 40, 2, 0xFF);
    tu_fill_normal(&s->q, r, 1);
    tu_fill_normal(&s->k, r, 1);
    tu_fill_normal(&s->v, r, 1);
    tu_fill_normal(&s->dout, r, 1);
    fmha_forward_args fa = {
        .q = s->q.t, .k = s->k.t, .v = s->v.t, .out = s->out.t, .lse = s->lse, .seed = 5};
    TU_CHECK(fmha_forward(&s->cfg, &fa) == FMHA_STATUS_OK, "small forward: %s", fmha_last_error());
    s->a = (fmha_backward_args){.q = s->q.t,
                                .k = s->k.t,
                                .v = s->v.t,
                                .out = s->out.t,
                                .dout = s->dout.t,
                                .lse = s->lse,
                                .dq = s->dq.t,
                                .dk = s->dk.t,
                                .dv = s->dv.t,
                                .seed = 5};
}

static int small_untouched(const small *s)
{
    return tu_gaps_untouched(&s->dq, 0xFF) && tu_gaps_untouched(&s->dk, 0xFF) &&
           tu_gaps_untouched(&s->dv, 0xFF) && isnan(tu_get(&s->dq, 0, 0, 0, 0)) &&
           isnan(tu_get(&s->dk, 0, 0, 0, 0)) && isnan(tu_get(&s->dv, 0, 0, 0, 0));
}

static void small_poison(small *s)
{
    memset(s->dq.alloc, 0xFF, s->dq.alloc_bytes);
    memset(s->dk.alloc, 0xFF, s->dk.alloc_bytes);
    memset(s->dv.alloc, 0xFF, s->dv.alloc_bytes);
}

static void small_free(small *s)
{
    tu_tensor *ts[8] = {&s->q, &s->k, &s->v, &s->out, &s->dout, &s->dq, &s->dk, &s->dv};
    for (int i = 0; i < 8; i++)
        tu_tensor_free(ts[i]);
}

/* Each refused call names the value and the fix, and writes nothing. */
static void test_errors(tu_rng *r)
{
    small s;
    small_init(&s, r, FMHA_CPU_ISA_AUTO);
    struct {
        const char *what, *expect;
        fmha_status status;
    } cases[] = {
        {"dq of k's shape", "dq has shape [2, 300, 1, 40], but q's is [2, 37, 3, 40]",
         FMHA_STATUS_INVALID_ARGUMENT},
        {"dk with 2 heads", "dk has shape [2, 300, 2, 40], but k's is [2, 300, 1, 40]",
         FMHA_STATUS_INVALID_ARGUMENT},
        {"dout of seqlen 36", "dout has shape [2, 36, 3, 40], but out's is [2, 37, 3, 40]",
         FMHA_STATUS_INVALID_ARGUMENT},
        {"lse NULL", "lse is NULL: the backward needs the LSE the forward wrote",
         FMHA_STATUS_INVALID_ARGUMENT},
        {"dv in f8_e4m3", "dv.dtype f8_e4m3 is not a gradient dtype", FMHA_STATUS_INVALID_ARGUMENT},
        {"dq rows overlapping", "dq.stride_seq (0) is below dq.head_dim (40)",
         FMHA_STATUS_INVALID_ARGUMENT},
        {"q of the wrong head dim", "q.head_dim (39) and k.head_dim (40) must equal head_dim (40)",
         FMHA_STATUS_INVALID_ARGUMENT},
        {"deterministic 2", "deterministic (2) must be 0 or 1", FMHA_STATUS_INVALID_ARGUMENT},
        {"f8_e4m3 inputs", "f8_e4m3 inputs have no backward", FMHA_STATUS_UNSUPPORTED},
        {"fp8_compute", "fp8_compute layers have no backward", FMHA_STATUS_UNSUPPORTED},
        {"cuda", "", FMHA_STATUS_UNSUPPORTED},
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) {
        fmha_config cfg = s.cfg;
        fmha_backward_args a = s.a;
        switch (i) {
        case 0: a.dq = s.dk.t; break;
        case 1: a.dk.heads = 2; break;
        case 2: a.dout.seqlen = 36; break;
        case 3: a.lse = NULL; break;
        case 4: a.dv.dtype = FMHA_DTYPE_F8_E4M3; break;
        case 5: a.dq.stride_seq = 0; break;
        case 6: a.q.head_dim = 39; break;
        case 7: cfg.deterministic = 2; break;
        case 8: cfg.dtype = FMHA_DTYPE_F8_E4M3; break;
        case 9: cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR; break;
        case 10: cfg.device = FMHA_DEVICE_CUDA; break;
        }
        fmha_status st = fmha_backward(&cfg, &a);
        const char *msg = fmha_last_error();
        /* No CUDA backend or no GPU: refused each way; with a GPU, the host
         * tensors are refused (test_cuda_backward runs the kernel). */
        const int gpu = fmha_cuda_backend_built() && fmha_cuda_device_count() > 0;
        if (i == 10) {
            cases[i].expect = !fmha_cuda_backend_built() ? "built without a CUDA backend"
                              : !gpu                     ? "no CUDA device found"
                                                         : "q is host memory";
            if (gpu)
                cases[i].status = FMHA_STATUS_INVALID_ARGUMENT;
        }
        TU_CHECK(st == cases[i].status && strstr(msg, cases[i].expect) && small_untouched(&s),
                 "%s: %s (%s), expected %s \"%s\" with nothing written", cases[i].what,
                 fmha_status_string(st), msg, fmha_status_string(cases[i].status), cases[i].expect);
        if (i >= 8 && !(i == 10 && gpu)) { /* the chooser answers the same without a call */
            fmha_kernel_info info;
            fmha_status st2 = fmha_kernel_select_backward(&cfg, &info);
            TU_CHECK(st2 == cases[i].status && strstr(fmha_last_error(), cases[i].expect),
                     "fmha_kernel_select_backward, %s: %s (%s)", cases[i].what,
                     fmha_status_string(st2), fmha_last_error());
        }
    }
    /* check_finite reads q, k and v first, as in the forward. */
    fmha_config checked = s.cfg;
    checked.check_finite = 1;
    tu_set(&s.k, 1, 250, 0, 7, NAN);
    fmha_status stf = fmha_backward(&checked, &s.a);
    TU_CHECK(stf == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "k holds 1 NaN or inf value, the first at [batch, seq, "
                                           "head, channel] = [1, 250, 0, 7]") &&
                 small_untouched(&s),
             "check_finite: %s (%s)", fmha_status_string(stf), fmha_last_error());
    tu_set(&s.k, 1, 250, 0, 7, 0.5);
    /* The reference refuses the same way. */
    fmha_config f8 = s.cfg;
    f8.dtype = FMHA_DTYPE_F8_E4M3;
    fmha_status st = fmha_reference_backward(&f8, &s.a);
    TU_CHECK(st == FMHA_STATUS_UNSUPPORTED && strstr(fmha_last_error(), "no backward") &&
                 small_untouched(&s),
             "reference, f8_e4m3: %s (%s)", fmha_status_string(st), fmha_last_error());
    fmha_backward_args a = s.a;
    a.dq = s.dk.t;
    st = fmha_reference_backward(&s.cfg, &a);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), "dq has shape") &&
                 small_untouched(&s),
             "reference, dq of k's shape: %s (%s)", fmha_status_string(st), fmha_last_error());
    small_free(&s);
}

/* The kernel the chooser names for each ISA; FMHA_CPU_ISA steers AUTO. */
static void test_choice(const fmha_cpu_isa *isas, int nisa)
{
    static const char *names[] = {"", "cpu_scalar_f32_bwd", "cpu_avx2_f32_bwd",
                                  "cpu_avx512_f32_bwd", "cpu_avx512_f32_bwd"};
    fmha_config cfg;
    fmha_config_init(&cfg, 4, 2, 64);
    for (int i = 0; i < nisa; i++) {
        cfg.cpu_isa = isas[i];
        fmha_kernel_info info;
        fmha_status st = fmha_kernel_select_backward(&cfg, &info);
        TU_CHECK(st == FMHA_STATUS_OK && !strcmp(info.name, names[isas[i]]),
                 "backward kernel for %s: %s (%s)", fmha_cpu_isa_name(isas[i]),
                 st == FMHA_STATUS_OK ? info.name : "none", fmha_last_error());
    }
    cfg.cpu_isa = FMHA_CPU_ISA_AUTO;
    setenv("FMHA_CPU_ISA", "scalar", 1);
    fmha_kernel_info info;
    fmha_status st = fmha_kernel_select_backward(&cfg, &info);
    unsetenv("FMHA_CPU_ISA");
    TU_CHECK(st == FMHA_STATUS_OK && !strcmp(info.name, "cpu_scalar_f32_bwd"),
             "FMHA_CPU_ISA=scalar: %s", st == FMHA_STATUS_OK ? info.name : fmha_last_error());
    /* A layer reports the backward kernel after a backward call. */
}

/* Scores far beyond f32's reach of the LSE (scales 1e6..1e30 on unit inputs;
 * the forward is exact there, docs/reliability.md): the softmax is one-hot
 * up to the LSE's rounding, so the gradients are noise of that rounding, but
 * they must stay finite (P recomputed from an LSE off by more than 128 once
 * overflowed 2^x's exponent). */
static void test_large_scores(tu_rng *r, fmha_cpu_isa isa)
{
    const double scales[] = {1e6, 1e10, 1e30};
    for (int i = 0; i < 3; i++) {
        fmha_config cfg;
        fmha_config_init(&cfg, 2, 1, 32);
        cfg.dtype = FMHA_DTYPE_F32;
        cfg.cpu_isa = isa;
        cfg.softmax_scale = scales[i];
        tu_tensor q, k, v, o, g, dq, dk, dv;
        tu_tensor_init(&q, cfg.dtype, 1, 70, 2, 32, 0, 0);
        tu_tensor_init(&k, cfg.dtype, 1, 90, 1, 32, 0, 0);
        tu_tensor_init(&v, cfg.dtype, 1, 90, 1, 32, 0, 0);
        tu_tensor_init(&o, cfg.dtype, 1, 70, 2, 32, 0, 0);
        tu_tensor_init(&g, cfg.dtype, 1, 70, 2, 32, 0, 0);
        tu_tensor_init(&dq, cfg.dtype, 1, 70, 2, 32, 0, 0xFF);
        tu_tensor_init(&dk, cfg.dtype, 1, 90, 1, 32, 0, 0xFF);
        tu_tensor_init(&dv, cfg.dtype, 1, 90, 1, 32, 0, 0xFF);
        tu_tensor *in[4] = {&q, &k, &v, &g};
        for (int t = 0; t < 4; t++)
            tu_fill_normal(in[t], r, 1);
        float lse[140];
        fmha_forward_args fa = {.q = q.t, .k = k.t, .v = v.t, .out = o.t, .lse = lse};
        fmha_backward_args ba = {.q = q.t,
                                 .k = k.t,
                                 .v = v.t,
                                 .out = o.t,
                                 .dout = g.t,
                                 .lse = lse,
                                 .dq = dq.t,
                                 .dk = dk.t,
                                 .dv = dv.t};
        fmha_status st = fmha_forward(&cfg, &fa);
        if (st == FMHA_STATUS_OK)
            st = fmha_backward(&cfg, &ba);
        int bad = 0;
        tu_max_err(&dq, &dq, &bad);
        tu_max_err(&dk, &dk, &bad);
        tu_max_err(&dv, &dv, &bad);
        TU_CHECK(st == FMHA_STATUS_OK && !bad, "isa %s, scale %g: %s, gradients %s",
                 fmha_cpu_isa_name(isa), scales[i], fmha_status_string(st),
                 bad ? "not finite" : "finite");
        tu_tensor *all[8] = {&q, &k, &v, &o, &g, &dq, &dk, &dv};
        for (int t = 0; t < 8; t++)
            tu_tensor_free(all[t]);
    }
}

/* The non-finite policy (docs/reliability.md) through the backward: one NaN
 * in q, k, v or dout of a causal GQA problem, the forward's out and lse as
 * the kernel wrote them, and every gradient element non-finite exactly where
 * the float64 reference's is, the others within a plain tolerance of it,
 * but for the documented spread of a NaN channel of q (into dk) or dout (into
 * dv) over its key tile. k's and v's NaN sit at key 64, the start of a key
 * block, so that the forward is exact on every row and no row before 64
 * meets the block (the block caveat, docs/reliability.md). */
static void test_non_finite(tu_rng *r, fmha_cpu_isa isa)
{
    const int64_t S = 100, J = 64;
    const char *what[4] = {"NaN in q[5, head 1, 3]", "NaN in k[64, 3]", "NaN in v[64, 5]",
                           "NaN in dout[70, head 0, 2]"};
    for (int kind = 0; kind < 4; kind++) {
        fmha_config cfg;
        fmha_config_init(&cfg, 2, 1, 32);
        cfg.dtype = FMHA_DTYPE_F32;
        cfg.causal = 1;
        cfg.cpu_isa = isa;
        tu_tensor q, k, v, o, g, gr[3], rf[3];
        tu_tensor_init(&q, cfg.dtype, 1, S, 2, 32, 0, 0);
        tu_tensor_init(&k, cfg.dtype, 1, S, 1, 32, 0, 0);
        tu_tensor_init(&v, cfg.dtype, 1, S, 1, 32, 0, 0);
        tu_tensor_init(&o, cfg.dtype, 1, S, 2, 32, 0, 0);
        tu_tensor_init(&g, cfg.dtype, 1, S, 2, 32, 0, 0);
        tu_tensor *in[4] = {&q, &k, &v, &g};
        for (int t = 0; t < 4; t++)
            tu_fill_normal(in[t], r, 1);
        for (int i = 0; i < 3; i++) {
            const fmha_tensor *t = &in[i]->t;
            tu_tensor_init(&gr[i], cfg.dtype, 1, S, t->heads, 32, 0, 0xFF);
            tu_tensor_init(&rf[i], cfg.dtype, 1, S, t->heads, 32, 0, 0xFF);
        }
        if (kind == 0)
            tu_set(&q, 0, 5, 1, 3, NAN);
        else if (kind == 1)
            tu_set(&k, 0, J, 0, 3, NAN);
        else if (kind == 2)
            tu_set(&v, 0, J, 0, 5, NAN);
        else
            tu_set(&g, 0, 70, 0, 2, NAN);
        float lse[2 * 100];
        fmha_forward_args fa = {.q = q.t, .k = k.t, .v = v.t, .out = o.t, .lse = lse};
        fmha_backward_args ba = {.q = q.t,
                                 .k = k.t,
                                 .v = v.t,
                                 .out = o.t,
                                 .dout = g.t,
                                 .lse = lse,
                                 .dq = gr[0].t,
                                 .dk = gr[1].t,
                                 .dv = gr[2].t};
        fmha_backward_args br = ba;
        br.dq = rf[0].t;
        br.dk = rf[1].t;
        br.dv = rf[2].t;
        TU_CHECK(fmha_forward(&cfg, &fa) == FMHA_STATUS_OK &&
                     fmha_backward(&cfg, &ba) == FMHA_STATUS_OK &&
                     fmha_reference_backward(&cfg, &br) == FMHA_STATUS_OK,
                 "%s: %s", what[kind], fmha_last_error());
        int64_t wrong = 0, nonfinite = 0;
        const char *first = "";
        for (int i = 0; i < 3; i++)
            for (int64_t s = 0; s < S; s++)
                for (int64_t h = 0; h < gr[i].t.heads; h++)
                    for (int64_t c = 0; c < 32; c++) {
                        const double x = tu_get(&gr[i], 0, s, h, c), y = tu_get(&rf[i], 0, s, h, c);
                        nonfinite += !isfinite(y);
                        /* weight 0 times NaN: q's NaN channel reaches dk, dout's dv, at
                         * every key of the tile (all 100 here), as products over tiles do */
                        const int spread =
                            (kind == 0 && i == 1 && c == 3) || (kind == 3 && i == 2 && c == 2);
                        const int close = isfinite(x) && fabs(x - y) <= 1e-4 * (1 + fabs(y));
                        const int ok = isfinite(y) ? spread || close : !isfinite(x);
                        if (!ok && wrong++ == 0)
                            first = i == 0 ? "dq" : i == 1 ? "dk" : "dv";
                    }
        TU_CHECK(wrong == 0 && nonfinite > 0,
                 "isa %s, %s: %lld gradient elements break the policy (first in %s), %lld "
                 "non-finite in the reference",
                 fmha_cpu_isa_name(isa), what[kind], (long long)wrong, first, (long long)nonfinite);
        tu_tensor *all[5] = {&q, &k, &v, &o, &g};
        for (int t = 0; t < 5; t++)
            tu_tensor_free(all[t]);
        for (int i = 0; i < 3; i++) {
            tu_tensor_free(&gr[i]);
            tu_tensor_free(&rf[i]);
        }
    }
}

/* The same call twice, and on 1 and 2 threads: the same bits. */
static void test_determinism(tu_rng *r, fmha_cpu_isa isa)
{
    small s;
    small_init(&s, r, isa);
    size_t n[3] = {s.dq.alloc_bytes, s.dk.alloc_bytes, s.dv.alloc_bytes};
    void *first[3] = {NULL, NULL, NULL};
    for (int run = 0; run < 3; run++) {
        small_poison(&s);
        fmha_config cfg = s.cfg;
        cfg.num_threads = run == 2 ? 1 : 2;
        cfg.deterministic = run == 1;
        TU_CHECK(fmha_backward(&cfg, &s.a) == FMHA_STATUS_OK, "determinism: %s", fmha_last_error());
        void *now[3] = {s.dq.alloc, s.dk.alloc, s.dv.alloc};
        for (int i = 0; i < 3; i++) {
            if (run == 0) {
                first[i] = malloc(n[i]);
                memcpy(first[i], now[i], n[i]);
            } else {
                TU_CHECK(!memcmp(first[i], now[i], n[i]),
                         "isa %s: gradient %d differs between runs (run %d)",
                         fmha_cpu_isa_name(isa), i, run);
            }
        }
    }
    for (int i = 0; i < 3; i++)
        free(first[i]);
    small_free(&s);
}

/* batch 0: OK, nothing written; seqlen_q 0: dk = dv = 0; seqlen_k 0: dq = 0. */
static void test_empty(tu_rng *r)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 2, 1, 16);
    cfg.dtype = FMHA_DTYPE_F32;
    for (int which = 0; which < 3; which++) {
        const int64_t B = which == 0 ? 0 : 1, sq = which == 1 ? 0 : 5, sk = which == 2 ? 0 : 6;
        tu_tensor q, k, v, o, g, dq, dk, dv;
        tu_tensor_init(&q, cfg.dtype, 1, 5, 2, 16, 0, 0);
        tu_tensor_init(&k, cfg.dtype, 1, 6, 1, 16, 0, 0);
        tu_tensor_init(&v, cfg.dtype, 1, 6, 1, 16, 0, 0);
        tu_tensor_init(&o, cfg.dtype, 1, 5, 2, 16, 0, 0);
        tu_tensor_init(&g, cfg.dtype, 1, 5, 2, 16, 0, 0);
        tu_tensor_init(&dq, cfg.dtype, 1, 5, 2, 16, 0, 0xFF);
        tu_tensor_init(&dk, cfg.dtype, 1, 6, 1, 16, 0, 0xFF);
        tu_tensor_init(&dv, cfg.dtype, 1, 6, 1, 16, 0, 0xFF);
        tu_fill_normal(&q, r, 1);
        tu_fill_normal(&k, r, 1);
        tu_fill_normal(&g, r, 1);
        float lse[10];
        for (int i = 0; i < 10; i++)
            lse[i] = -INFINITY;
        tu_tensor *ts[8] = {&q, &k, &v, &o, &g, &dq, &dk, &dv};
        for (int i = 0; i < 8; i++) {
            ts[i]->t.batch = B;
            ts[i]->t.seqlen = i == 1 || i == 2 || i == 6 || i == 7 ? sk : sq;
        }
        fmha_backward_args a = {.q = q.t,
                                .k = k.t,
                                .v = v.t,
                                .out = o.t,
                                .dout = g.t,
                                .lse = lse,
                                .dq = dq.t,
                                .dk = dk.t,
                                .dv = dv.t};
        fmha_status st = fmha_backward(&cfg, &a);
        int ok = st == FMHA_STATUS_OK;
        for (int64_t s = 0; s < 6 && ok; s++)
            for (int64_t c = 0; c < 16; c++) {
                if (s < 5)
                    ok &=
                        which == 2 ? tu_get(&dq, 0, s, 1, c) == 0 : isnan(tu_get(&dq, 0, s, 1, c));
                ok &= which == 1 ? tu_get(&dk, 0, s, 0, c) == 0 && tu_get(&dv, 0, s, 0, c) == 0
                                 : isnan(tu_get(&dk, 0, s, 0, c));
            }
        TU_CHECK(ok, "empty problem %s: %s (%s)",
                 which == 0   ? "batch 0"
                 : which == 1 ? "seqlen_q 0"
                              : "seqlen_k 0",
                 fmha_status_string(st), fmha_last_error());
        for (int i = 0; i < 8; i++)
            tu_tensor_free(ts[i]);
    }
}

/* Every allocation of a backward call failing in turn: OUT_OF_MEMORY, the
 * gradients untouched, nothing leaked. */
static void test_alloc_failures(tu_rng *r)
{
    small s;
    small_init(&s, r, FMHA_CPU_ISA_AUTO);
    int calls = 0;
    for (long n = 0; n < 20; n++) {
        small_poison(&s);
        const long live = fmha_alloc_live();
        fmha_alloc_fail_after(n);
        fmha_status st = fmha_backward(&s.cfg, &s.a);
        fmha_alloc_fail_after(-1);
        TU_CHECK(fmha_alloc_live() == live, "backward, allocation %ld failed: %ld leaked", n + 1,
                 fmha_alloc_live() - live);
        if (st == FMHA_STATUS_OK) {
            calls = (int)n;
            break;
        }
        TU_CHECK(st == FMHA_STATUS_OUT_OF_MEMORY && small_untouched(&s),
                 "backward, allocation %ld failed: %s (%s), gradients %s", n + 1,
                 fmha_status_string(st), fmha_last_error(),
                 small_untouched(&s) ? "untouched" : "written");
    }
    TU_CHECK(calls > 0, "a backward call makes %d allocations", calls);
    printf("a one-shot backward makes %d allocations, each failed in turn\n", calls);
    /* the reference's one */
    small_poison(&s);
    fmha_alloc_fail_after(0);
    fmha_status st = fmha_reference_backward(&s.cfg, &s.a);
    fmha_alloc_fail_after(-1);
    TU_CHECK(st == FMHA_STATUS_OUT_OF_MEMORY && small_untouched(&s), "reference OOM: %s",
             fmha_status_string(st));
    small_free(&s);
}

/* A layer's backward after its forward: the layer reports the backward's kernel. */
static void test_layer(tu_rng *r)
{
    small s;
    small_init(&s, r, FMHA_CPU_ISA_SCALAR);
    fmha_layer *layer;
    TU_CHECK(fmha_layer_init(&layer, &s.cfg) == FMHA_STATUS_OK, "layer: %s", fmha_last_error());
    fmha_forward_args fa = {
        .q = s.q.t, .k = s.k.t, .v = s.v.t, .out = s.out.t, .lse = s.lse, .seed = 5};
    TU_CHECK(fmha_layer_forward(layer, &fa) == FMHA_STATUS_OK, "layer forward: %s",
             fmha_last_error());
    TU_CHECK(!strcmp(fmha_layer_kernel(layer)->name, "cpu_scalar_f32"), "after forward: %s",
             fmha_layer_kernel(layer)->name);
    TU_CHECK(fmha_layer_backward(layer, &s.a) == FMHA_STATUS_OK, "layer backward: %s",
             fmha_last_error());
    TU_CHECK(!strcmp(fmha_layer_kernel(layer)->name, "cpu_scalar_f32_bwd"), "after backward: %s",
             fmha_layer_kernel(layer)->name);
    fmha_layer_free(layer);
    small_free(&s);
}

int main(int argc, char **argv)
{
    const char *env = getenv("FMHA_TEST_CASES");
    const int quick = getenv("FMHA_TEST_QUICK") && *getenv("FMHA_TEST_QUICK");
    int ncases = argc > 1 ? atoi(argv[1]) : env ? atoi(env) : 60;
    tu_rng rng = {20261205};
    fmha_cpu_isa isas[FMHA_CPU_ISA_LAST];
    int nisa = 0;
    const fmha_cpu_isa best = fmha_cpu_isa_detect();
    for (int i = FMHA_CPU_ISA_SCALAR; i <= (int)best && i <= FMHA_CPU_ISA_AVX512; i++)
        isas[nisa++] = (fmha_cpu_isa)i;
    printf("testing backward ISAs up to %s over %d random cases\n",
           fmha_cpu_isa_name(isas[nisa - 1]), ncases);

    test_reference_by_fd(&rng);
    const tcase_space space = {FMHA_DEVICE_CPU, isas, nisa, 0};
    double worst = 0;
    for (int i = 0; i < ncases; i++) {
        fmha_dtype gdt;
        int lg, want;
        tcase c = tcase_backward_random(&rng, i, &space, &gdt, &lg, &want);
        worst = fmax(worst, tcase_backward_run(&c, gdt, lg, want, 0, cpu_backward, &rng));
    }
    /* Long sequences, once per ISA (not with FMHA_TEST_QUICK). */
    for (int i = 0; i < nisa && !quick; i++) {
        tcase c = {.batch = 1,
                   .sq = 600,
                   .sk = i == 0 ? 1023 : 520,
                   .heads = 2,
                   .kv = 1,
                   .d = 64,
                   .dv = 64,
                   .dt = FMHA_DTYPE_BF16,
                   .odt = FMHA_DTYPE_BF16,
                   .causal = i == 0,
                   .wl = -1,
                   .wr = -1,
                   .isa = isas[i]};
        worst = fmax(worst, tcase_backward_run(&c, FMHA_DTYPE_BF16, 0, 7, 0, cpu_backward, &rng));
    }
    printf("largest error / tolerance: %.3f\n", worst);
    test_errors(&rng);
    test_choice(isas, nisa);
    for (int i = 0; i < nisa; i++) {
        test_determinism(&rng, isas[i]);
        test_large_scores(&rng, isas[i]);
        test_non_finite(&rng, isas[i]);
    }
    test_empty(&rng);
    test_alloc_failures(&rng);
    test_layer(&rng);
    return tu_summary();
}
