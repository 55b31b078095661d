/* test_forward.c — every CPU kernel against the float64 reference over
 * hundreds of random cases of awkward sizes: head dims 32..256, seqlens
 * 1/7/113/239/1023 with seqlen_q != seqlen_k both ways, GQA and MQA, every
 * layout, mask, softcap, dropout, varlen, LSE and dtype. Outputs are poisoned
 * first; the tolerance is a multiple of a naive same-precision
 * implementation's error on the same case. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct tcase {
    int64_t batch, sq, sk, heads, kv, d, dv;
    fmha_dtype dt, odt;
    int lq, lkv, lo; /* layouts */
    int causal;
    int64_t wl, wr;
    double softcap, dropout, scale;
    int varlen, lse, threads;
    fmha_cpu_isa isa;
} tcase;

static const int64_t seqlens[] = {1, 7, 113, 239, 64, 65, 128, 200};
static const int64_t head_dims[] = {32, 64, 80, 96, 128, 160, 192, 256, 40, 72, 33};

static void describe(const tcase *c, char *buf, size_t n)
{
    snprintf(buf, n,
             "isa=%s b=%lld sq=%lld sk=%lld h=%lld kv=%lld d=%lld dv=%lld dt=%s out=%s layouts=%d%d%d "
             "causal=%d win=(%lld,%lld) softcap=%g drop=%g varlen=%d lse=%d",
             fmha_cpu_isa_name(c->isa), (long long)c->batch, (long long)c->sq, (long long)c->sk,
             (long long)c->heads, (long long)c->kv, (long long)c->d, (long long)c->dv,
             fmha_dtype_name(c->dt), fmha_dtype_name(c->odt), c->lq, c->lkv, c->lo, c->causal,
             (long long)c->wl, (long long)c->wr, c->softcap, c->dropout, c->varlen, c->lse);
}

/* Max |x - ref| over the output view, with -inf LSE handled. */
static double out_err(const tu_tensor *x, const tu_tensor *ref, int *bad)
{
    double e = 0;
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++) {
                    double a = tu_get(x, b, s, h, c), r = tu_get(ref, b, s, h, c);
                    if (!isfinite(a))
                        *bad = 1;
                    if (fabs(a - r) > e)
                        e = fabs(a - r);
                }
    return e;
}

static double lse_err(const float *x, const float *ref, int64_t n, int *bad)
{
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isinf(ref[i]) && ref[i] < 0) {
            if (!(isinf(x[i]) && x[i] < 0))
                *bad = 1;
            continue;
        }
        if (!isfinite(x[i]))
            *bad = 1;
        if (fabs((double)x[i] - ref[i]) > e)
            e = fabs((double)x[i] - ref[i]);
    }
    return e;
}

static int run_case(const tcase *c, tu_rng *rng)
{
    char desc[512];
    describe(c, desc, sizeof desc);

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
    cfg.cpu_isa = c->isa;
    cfg.num_threads = c->threads;

    /* Varlen: random per-sequence lengths around sq / sk, zeros included. */
    int32_t *cuq = NULL, *cuk = NULL;
    int64_t tb = c->batch, tq = c->sq, tk = c->sk;
    if (c->varlen) {
        cuq = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
        cuk = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
        cuq[0] = cuk[0] = 0;
        for (int64_t b = 0; b < c->batch; b++) {
            cuq[b + 1] = cuq[b] + (int32_t)tu_range(rng, c->sq + 1);
            cuk[b + 1] = cuk[b] + (int32_t)tu_range(rng, c->sk + 1);
        }
        tb = 1;
        tq = cuq[c->batch] > 0 ? cuq[c->batch] : 1; /* tensors need one token at least */
        tk = cuk[c->batch] > 0 ? cuk[c->batch] : 1;
    }

    tu_tensor q, k, v, out, ref, naive;
    tu_tensor_init(&q, c->dt, tb, tq, c->heads, c->d, c->lq, 0xA5);
    tu_tensor_init(&k, c->dt, tb, tk, c->kv, c->d, c->lkv, 0xA5);
    tu_tensor_init(&v, c->dt, tb, tk, c->kv, c->dv, c->lkv, 0xA5);
    tu_tensor_init(&out, c->odt, tb, tq, c->heads, c->dv, c->lo, 0xFF); /* NaN poison */
    tu_tensor_init(&ref, FMHA_DTYPE_F32, tb, tq, c->heads, c->dv, 0, 0xFF);
    tu_tensor_init(&naive, c->odt, tb, tq, c->heads, c->dv, 0, 0xFF);
    tu_fill_normal(&q, rng, 1.0);
    tu_fill_normal(&k, rng, 1.0);
    tu_fill_normal(&v, rng, 1.0);

    int64_t nl = c->heads * tq * tb;
    float *lse = malloc(sizeof(float) * (size_t)nl), *lse_ref = malloc(sizeof(float) * (size_t)nl);
    float *lse_naive = malloc(sizeof(float) * (size_t)nl);
    memset(lse, 0xFF, sizeof(float) * (size_t)nl);

    fmha_forward_args a;
    memset(&a, 0, sizeof a);
    a.q = q.t;
    a.k = k.t;
    a.v = v.t;
    a.out = out.t;
    a.lse = c->lse ? lse : NULL;
    a.cu_seqlens_q = cuq;
    a.cu_seqlens_k = cuk;
    a.varlen_batch = c->varlen ? c->batch : 0;
    a.seed = tu_next(rng);
    a.offset = tu_next(rng);

    int ok = 1;
    fmha_status st = fmha_forward(&cfg, &a);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: forward failed: %s", desc, fmha_last_error());
    if (st != FMHA_STATUS_OK)
        ok = 0;

    fmha_forward_args ar = a;
    ar.out = ref.t;
    ar.lse = lse_ref;
    st = fmha_reference_forward(&cfg, &ar);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: reference failed: %s", desc, fmha_last_error());
    fmha_forward_args an = a;
    an.out = naive.t;
    an.lse = lse_naive;
    tu_naive_forward(&cfg, &an);

    if (ok) {
        int bad = 0, nbad = 0;
        double e = out_err(&out, &ref, &bad), en = out_err(&naive, &ref, &nbad);
        /* With packed tensors of zero total tokens the placeholder token is not
         * part of any sequence: it must stay poisoned. */
        int empty = c->varlen && (cuq[c->batch] == 0);
        if (empty) {
            bad = 0;
            e = en = 0;
        }
        double tol = 4.0 * en + 1e-6;
        TU_CHECK(!bad && e <= tol, "%s: out error %.3g > tol %.3g (naive %.3g)%s", desc, e, tol,
                 en, bad ? " non-finite output" : "");
        TU_CHECK(tu_gaps_untouched(&out, 0xFF), "%s: wrote outside the output view", desc);
        if (c->lse && !empty) {
            int lbad = 0, lnbad = 0;
            double le = lse_err(lse, lse_ref, c->varlen ? c->heads * tq : nl, &lbad);
            double len = lse_err(lse_naive, lse_ref, c->varlen ? c->heads * tq : nl, &lnbad);
            TU_CHECK(!lbad && le <= 4.0 * len + 1e-5, "%s: lse error %.3g (naive %.3g)%s", desc,
                     le, len, lbad ? " bad -inf/non-finite" : "");
        }
    }

    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&ref);
    tu_tensor_free(&naive);
    free(lse);
    free(lse_ref);
    free(lse_naive);
    free(cuq);
    free(cuk);
    return ok;
}

static tcase random_case(tu_rng *r, int index, const fmha_cpu_isa *isas, int nisa)
{
    tcase c;
    memset(&c, 0, sizeof c);
    c.isa = isas[index % nisa];
    c.batch = 1 + tu_range(r, 2);
    c.sq = seqlens[tu_range(r, 8)];
    c.sk = tu_range(r, 3) == 0 ? c.sq : seqlens[tu_range(r, 8)];
    static const int groups[] = {1, 1, 2, 3, 4, 8};
    c.kv = 1 + tu_range(r, 2);
    c.heads = c.kv * groups[tu_range(r, 6)];
    if (tu_range(r, 8) == 0) { /* MQA */
        c.kv = 1;
        c.heads = 1 + tu_range(r, 6);
    }
    c.d = head_dims[tu_range(r, 11)];
    c.dv = tu_range(r, 6) == 0 ? head_dims[tu_range(r, 11)] : c.d;
    static const fmha_dtype dts[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16, FMHA_DTYPE_BF16};
    c.dt = dts[tu_range(r, 4)];
    static const fmha_dtype odts[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    c.odt = tu_range(r, 3) == 0 ? odts[tu_range(r, 3)] : c.dt;
    c.lq = (int)tu_range(r, 3);
    c.lkv = (int)tu_range(r, 3);
    c.lo = (int)tu_range(r, 3);
    c.wl = c.wr = -1;
    switch (tu_range(r, 6)) {
    case 0: c.causal = 1; break;
    case 1: c.wl = tu_range(r, 40); c.wr = tu_range(r, 3) - 1; break;
    case 2: c.causal = 1; c.wl = tu_range(r, 130); break;
    default: break;
    }
    if (tu_range(r, 6) == 0)
        c.softcap = 5.0 + 30.0 * tu_uniform(r);
    if (tu_range(r, 8) == 0)
        c.dropout = 0.1 + 0.4 * tu_uniform(r);
    if (tu_range(r, 4) == 0)
        c.scale = 0.05 + 0.2 * tu_uniform(r);
    c.varlen = tu_range(r, 5) == 0;
    if (c.varlen) {
        c.batch = 1 + tu_range(r, 4);
        c.lq = c.lq == 1 ? 0 : c.lq; /* packed tensors: contiguous or padded strides */
        c.lkv = c.lkv == 1 ? 0 : c.lkv;
        c.lo = c.lo == 1 ? 0 : c.lo;
    }
    c.lse = tu_range(r, 2);
    c.threads = (int)tu_range(r, 3); /* 0 = default */
    return c;
}

/* The same problem on 1 and 2 threads must give the same bytes. */
static void test_thread_independence(tu_rng *r, fmha_cpu_isa isa)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 4, 2, 64);
    cfg.dtype = FMHA_DTYPE_BF16;
    cfg.causal = 1;
    cfg.cpu_isa = isa;
    tu_tensor q, k, v, o1, o2;
    tu_tensor_init(&q, cfg.dtype, 2, 239, 4, 64, 0, 0);
    tu_tensor_init(&k, cfg.dtype, 2, 300, 2, 64, 0, 0);
    tu_tensor_init(&v, cfg.dtype, 2, 300, 2, 64, 0, 0);
    tu_tensor_init(&o1, FMHA_DTYPE_F32, 2, 239, 4, 64, 0, 0xFF);
    tu_tensor_init(&o2, FMHA_DTYPE_F32, 2, 239, 4, 64, 0, 0xFF);
    tu_fill_normal(&q, r, 1);
    tu_fill_normal(&k, r, 1);
    tu_fill_normal(&v, r, 1);
    fmha_forward_args a = {.q = q.t, .k = k.t, .v = v.t, .out = o1.t};
    cfg.num_threads = 1;
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "threads=1: %s", fmha_last_error());
    a.out = o2.t;
    cfg.num_threads = 2;
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "threads=2: %s", fmha_last_error());
    TU_CHECK(memcmp(o1.alloc, o2.alloc, o1.alloc_bytes) == 0,
             "isa %s: results differ between 1 and 2 threads", fmha_cpu_isa_name(isa));
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&o1);
    tu_tensor_free(&o2);
}

/* Dropout: the kept fraction matches 1 - p, the same seed gives the same
 * output, another seed another one. V = 1 makes out = (kept mass) / l. */
static void test_dropout_statistics(tu_rng *r)
{
    const double p = 0.3;
    fmha_config cfg;
    fmha_config_init(&cfg, 2, 2, 32);
    cfg.dtype = FMHA_DTYPE_F32;
    cfg.dropout_p = p;
    int64_t kept = 0, total = 0;
    for (int64_t row = 0; row < 64; row++)
        for (int64_t col = 0; col < 1024; col++, total++)
            kept += fmha_dropout_keep(42, 7, 0, 2, 1, row, col, p);
    double frac = (double)kept / (double)total;
    TU_CHECK(fabs(frac - (1 - p)) < 0.01, "dropout kept fraction %.4f, expected %.2f", frac, 1 - p);

    tu_tensor q, k, v, o1, o2, o3;
    tu_tensor_init(&q, cfg.dtype, 1, 113, 2, 32, 0, 0);
    tu_tensor_init(&k, cfg.dtype, 1, 239, 2, 32, 0, 0);
    tu_tensor_init(&v, cfg.dtype, 1, 239, 2, 32, 0, 0);
    tu_tensor_init(&o1, cfg.dtype, 1, 113, 2, 32, 0, 0xFF);
    tu_tensor_init(&o2, cfg.dtype, 1, 113, 2, 32, 0, 0xFF);
    tu_tensor_init(&o3, cfg.dtype, 1, 113, 2, 32, 0, 0xFF);
    tu_fill_normal(&q, r, 0.1);
    tu_fill_normal(&k, r, 0.1);
    for (size_t i = 0; i < v.alloc_bytes / 4; i++)
        ((float *)v.alloc)[i] = 1.0f;
    fmha_forward_args a = {.q = q.t, .k = k.t, .v = v.t, .out = o1.t, .seed = 1234, .offset = 5};
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "dropout run 1: %s", fmha_last_error());
    a.out = o2.t;
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "dropout run 2: %s", fmha_last_error());
    a.out = o3.t;
    a.seed = 1235;
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "dropout run 3: %s", fmha_last_error());
    TU_CHECK(memcmp(o1.alloc, o2.alloc, o1.alloc_bytes) == 0, "same seed, different dropout");
    TU_CHECK(memcmp(o1.alloc, o3.alloc, o1.alloc_bytes) != 0, "different seed, same dropout");
    /* Near-uniform attention with V = 1: each output is the kept fraction / (1 - p). */
    double mean = 0;
    for (size_t i = 0; i < o1.alloc_bytes / 4; i++)
        mean += ((float *)o1.alloc)[i];
    mean /= (double)(o1.alloc_bytes / 4);
    TU_CHECK(fabs(mean - 1.0) < 0.02, "dropout keeps the expectation: mean %.4f, want 1", mean);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&o1);
    tu_tensor_free(&o2);
    tu_tensor_free(&o3);
}

int main(int argc, char **argv)
{
    /* FMHA_TEST_CASES trims the run for slow builds (sanitizers). */
    const char *env = getenv("FMHA_TEST_CASES");
    int ncases = argc > 1 ? atoi(argv[1]) : env ? atoi(env) : 300;
    tu_rng rng = {20261202};
    fmha_cpu_isa isas[3];
    int nisa = 0;
    fmha_cpu_isa best = fmha_cpu_isa_detect();
    for (int i = FMHA_CPU_ISA_SCALAR; i <= (int)best; i++)
        isas[nisa++] = (fmha_cpu_isa)i;
    printf("testing ISAs up to %s over %d random cases\n", fmha_cpu_isa_name(best), ncases);

    for (int i = 0; i < ncases; i++) {
        tcase c = random_case(&rng, i, isas, nisa);
        run_case(&c, &rng);
    }
    /* Long sequences, once per ISA: 1023 queries against 1023 and 2000 keys. */
    for (int i = 0; i < nisa; i++) {
        tcase c = {.batch = 1, .sq = 1023, .sk = i == 1 ? 2000 : 1023, .heads = 2, .kv = 1,
                   .d = 128, .dv = 128, .dt = FMHA_DTYPE_BF16, .odt = FMHA_DTYPE_BF16,
                   .causal = i == 0, .wl = -1, .wr = -1, .lse = 1, .isa = isas[i]};
        run_case(&c, &rng);
        c.dt = c.odt = FMHA_DTYPE_F32;
        c.sk = 1023;
        c.sq = 7;
        run_case(&c, &rng);
    }
    for (int i = 0; i < nisa; i++)
        test_thread_independence(&rng, isas[i]);
    test_dropout_statistics(&rng);
    return tu_summary();
}
