/* test_forward.c — every CPU kernel against the float64 reference over
 * hundreds of random cases of awkward sizes: head dims 32..256, seqlens
 * 1/7/113/239/1023 with seqlen_q != seqlen_k both ways, GQA and MQA, every
 * layout, mask, softcap, dropout, varlen, LSE and dtype, FP8 inputs with every
 * descale layout included. Outputs are poisoned first; the tolerance is a
 * multiple of a naive same-precision implementation's error on the same case. */
#include "cases.h"
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* Large but finite scores: the row maximum of scale * q k must give its own
 * key exactly 2^0 (a product rounded one way for the maximum and fused into
 * the subtraction the other way once left 2^(positive remainder), which
 * overflowed, and zeroed 68 of 128 rows at softmax_scale 1e10). Unit inputs
 * at scales 1e6..1e30, and f32 inputs of size 3e4 with k = q (each query's
 * score with its own key is the largest, ~6e10). */
static void test_large_scores(tu_rng *r, fmha_cpu_isa isa)
{
    const int64_t s = 128, d = 64;
    for (int variant = 0; variant < 5; variant++) {
        fmha_config cfg;
        fmha_config_init(&cfg, 1, 1, d);
        cfg.dtype = FMHA_DTYPE_F32;
        cfg.cpu_isa = isa;
        const double scales[] = {1e6, 1e10, 1e20, 1e30};
        const int big = variant == 4;
        cfg.softmax_scale = big ? 0.0 : scales[variant];
        tu_tensor q, k, v, o, ref;
        tu_tensor_init(&q, cfg.dtype, 1, s, 1, d, 0, 0);
        tu_tensor_init(&k, cfg.dtype, 1, s, 1, d, 0, 0);
        tu_tensor_init(&v, cfg.dtype, 1, s, 1, d, 0, 0);
        tu_tensor_init(&o, cfg.dtype, 1, s, 1, d, 0, 0xFF);
        tu_tensor_init(&ref, FMHA_DTYPE_F32, 1, s, 1, d, 0, 0);
        tu_fill_normal(&q, r, big ? 3e4 : 1);
        tu_fill_normal(&k, r, 1);
        tu_fill_normal(&v, r, 1);
        if (big)
            memcpy(k.alloc, q.alloc, q.alloc_bytes);
        fmha_forward_args a = {.q = q.t, .k = k.t, .v = v.t, .out = o.t};
        TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "large scores: %s", fmha_last_error());
        a.out = ref.t;
        TU_CHECK(fmha_reference_forward(&cfg, &a) == FMHA_STATUS_OK, "reference: %s",
                 fmha_last_error());
        int64_t zero_rows = 0;
        for (int64_t i = 0; i < s; i++) {
            double n2 = 0;
            for (int64_t c = 0; c < d; c++)
                n2 += tu_get(&o, 0, i, 0, c) * tu_get(&o, 0, i, 0, c);
            zero_rows += n2 == 0;
        }
        const double err = tu_rel_l2(&o, &ref);
        TU_CHECK(err < 1e-5 && zero_rows == 0,
                 "isa %s, %s %g: relative L2 %.3g against the reference, %lld of %lld rows zero",
                 fmha_cpu_isa_name(isa), big ? "inputs 3e4, k = q, scale" : "unit inputs, scale",
                 big ? 1 / sqrt((double)d) : cfg.softmax_scale, err, (long long)zero_rows,
                 (long long)s);
        tu_tensor_free(&q);
        tu_tensor_free(&k);
        tu_tensor_free(&v);
        tu_tensor_free(&o);
        tu_tensor_free(&ref);
    }
}

int main(int argc, char **argv)
{
    /* FMHA_TEST_CASES trims the run for slow builds (sanitizers). */
    const char *env = getenv("FMHA_TEST_CASES");
    int ncases = argc > 1 ? atoi(argv[1]) : env ? atoi(env) : 300;
    tu_rng rng = {20261202};
    fmha_cpu_isa isas[FMHA_CPU_ISA_LAST]; /* every ISA but AUTO */
    int nisa = 0;
    fmha_cpu_isa best = fmha_cpu_isa_detect();
    for (int i = FMHA_CPU_ISA_SCALAR; i <= (int)best; i++)
        isas[nisa++] = (fmha_cpu_isa)i;
    printf("testing ISAs up to %s over %d random cases\n", fmha_cpu_isa_name(best), ncases);

    const tcase_space space = {FMHA_DEVICE_CPU, isas, nisa, 0};
    for (int i = 0; i < ncases; i++) {
        tcase c = tcase_random(&rng, i, &space);
        tcase_run(&c, &rng, fmha_forward);
    }
    /* Long sequences, once per ISA: 1023 queries against 1023 and 2000 keys. */
    for (int i = 0; i < nisa; i++) {
        tcase c = {.batch = 1,
                   .sq = 1023,
                   .sk = i == 1 ? 2000 : 1023,
                   .heads = 2,
                   .kv = 1,
                   .d = 128,
                   .dv = 128,
                   .dt = FMHA_DTYPE_BF16,
                   .odt = FMHA_DTYPE_BF16,
                   .causal = i == 0,
                   .wl = -1,
                   .wr = -1,
                   .lse = 1,
                   .isa = isas[i]};
        tcase_run(&c, &rng, fmha_forward);
        c.dt = c.odt = FMHA_DTYPE_F32;
        c.sk = 1023;
        c.sq = 7;
        tcase_run(&c, &rng, fmha_forward);
    }
    for (int i = 0; i < nisa; i++)
        test_thread_independence(&rng, isas[i]);
    for (int i = 0; i < nisa; i++) {
        test_large_scores(&rng, isas[i]);
        for (int f = 0; f < 2; f++) { /* the non-finite policy (docs/reliability.md) */
            fmha_config base;
            fmha_config_init(&base, 2, 1, 32);
            base.cpu_isa = isas[i];
            base.dtype = f ? FMHA_DTYPE_BF16 : FMHA_DTYPE_F32;
            tcase_non_finite(&rng, &base, 100, 64, fmha_forward);
        }
    }
    test_dropout_statistics(&rng);
    return tu_summary();
}
