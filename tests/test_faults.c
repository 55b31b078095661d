/* test_faults.c — the library under faults and misuse: each host allocation
 * failed in turn (OUT_OF_MEMORY, nothing leaked, nothing written), a layer
 * called from two threads at once (refused, never a wrong answer), layers
 * on many threads (the same bits as one thread), and empty problems. */
#include "alloc.h"
#include "testutil.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { POISON = 0xA5 };

static int all_poison(const tu_tensor *x)
{
    const unsigned char *p = x->alloc;
    for (size_t i = 0; i < x->alloc_bytes; i++)
        if (p[i] != POISON)
            return 0;
    return 1;
}

/* One problem on fresh inputs: q, k, v, out and lse, a config and args. */
typedef struct problem {
    const char *name;
    fmha_config cfg;
    tu_tensor q, k, v, out;
    float *lse;
    int32_t cu[3];
    fmha_forward_args a;
} problem;

static void problem_init(problem *p, int which, tu_rng *r)
{
    memset(p, 0, sizeof *p);
    const int64_t B = which == 1 ? 1 : 2, S = 77, H = 4, KV = 2, D = 40;
    fmha_config_init(&p->cfg, H, KV, D);
    p->cfg.causal = 1;
    p->cfg.num_threads = 2;
    fmha_dtype dt = FMHA_DTYPE_BF16;
    switch (which) {
    case 0: p->name = "bf16, GQA, causal, LSE"; break;
    case 1:
        p->name = "f32 packed batch";
        dt = FMHA_DTYPE_F32;
        break;
    case 2:
        p->name = "fp8_compute per tensor";
        p->cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
        break;
    case 3:
        p->name = "fp8_compute per block, smoothed K";
        p->cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_BLOCK;
        p->cfg.fp8_smooth_k = 1;
        break;
    default: p->name = "reference"; break;
    }
    p->cfg.dtype = dt;
    const int64_t s = which == 1 ? 2 * S : S;
    tu_tensor_init(&p->q, dt, B, s, H, D, 0, 0);
    tu_tensor_init(&p->k, dt, B, s, KV, D, 0, 0);
    tu_tensor_init(&p->v, dt, B, s, KV, D, 0, 0);
    tu_tensor_init(&p->out, FMHA_DTYPE_F32, B, s, H, D, 0, POISON);
    tu_fill_normal(&p->q, r, 1);
    tu_fill_normal(&p->k, r, 1);
    tu_fill_normal(&p->v, r, 1);
    p->lse = malloc(sizeof(float) * (size_t)(B * H * s));
    p->a =
        (fmha_forward_args){.q = p->q.t, .k = p->k.t, .v = p->v.t, .out = p->out.t, .lse = p->lse};
    if (which == 1) { /* two sequences of 50 and 104 tokens */
        p->cu[1] = 50;
        p->cu[2] = (int32_t)s;
        p->a.cu_seqlens_q = p->a.cu_seqlens_k = p->cu;
        p->a.varlen_batch = 2;
    }
}

static void problem_free(problem *p)
{
    tu_tensor_free(&p->q);
    tu_tensor_free(&p->k);
    tu_tensor_free(&p->v);
    tu_tensor_free(&p->out);
    free(p->lse);
}

/* A layer made, run once and freed (or the reference, for problem 4). */
static fmha_status run_problem(problem *p, int which)
{
    if (which == 4)
        return fmha_reference_forward(&p->cfg, &p->a);
    fmha_layer *layer;
    fmha_status st = fmha_layer_init(&layer, &p->cfg);
    if (st != FMHA_STATUS_OK)
        return st;
    st = fmha_layer_forward(layer, &p->a);
    fmha_layer_free(layer);
    return st;
}

/* Fails the first, second, ... allocation of each problem until one run
 * needs no more than it was allowed: every earlier run must say
 * OUT_OF_MEMORY, free all it took and leave out untouched. */
static void test_allocation_failures(tu_rng *r)
{
    for (int which = 0; which < 5; which++) {
        problem p;
        problem_init(&p, which, r);
        int sites = -1;
        for (long n = 0; n < 64 && sites < 0; n++) {
            memset(p.out.alloc, POISON, p.out.alloc_bytes);
            const long live = fmha_alloc_live();
            fmha_alloc_fail_after(n);
            fmha_status st = run_problem(&p, which);
            fmha_alloc_fail_after(-1);
            TU_CHECK(fmha_alloc_live() == live, "%s, allocation %ld failed: %ld allocations leaked",
                     p.name, n + 1, fmha_alloc_live() - live);
            if (st == FMHA_STATUS_OK) {
                sites = (int)n;
                break;
            }
            TU_CHECK(st == FMHA_STATUS_OUT_OF_MEMORY && fmha_last_error()[0],
                     "%s, allocation %ld failed: status %s (%s), expected OUT_OF_MEMORY", p.name,
                     n + 1, fmha_status_string(st), fmha_last_error());
            TU_CHECK(all_poison(&p.out), "%s, allocation %ld failed: out was written", p.name,
                     n + 1);
        }
        TU_CHECK(sites > 0, "%s: %d allocations (expected some, and fewer than 64)", p.name, sites);
        printf("%s: each of %d allocations failed in turn\n", p.name, sites);
        problem_free(&p);
    }
}

/* ----------------------------------------------------------------- threads */

typedef struct worker {
    fmha_layer *layer;
    fmha_forward_args a;
    tu_tensor out;
    fmha_status st;
    int calls;
    pthread_barrier_t *go;
    char error[256];
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    if (w->go)
        pthread_barrier_wait(w->go);
    for (int i = 0; i < w->calls; i++) {
        w->st = fmha_layer_forward(w->layer, &w->a);
        if (w->st != FMHA_STATUS_OK) {
            snprintf(w->error, sizeof w->error, "%s", fmha_last_error());
            break;
        }
    }
    return NULL;
}

/* Eight threads, each on its own layer: every output has the bits of one
 * thread's run of the same problem. */
static void test_layers_per_thread(tu_rng *r)
{
    enum { T = 8 };
    problem p;
    problem_init(&p, 0, r);
    p.cfg.num_threads = 1;
    TU_CHECK(fmha_forward(&p.cfg, &p.a) == FMHA_STATUS_OK, "one thread: %s", fmha_last_error());
    worker w[T];
    pthread_t th[T];
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, T);
    for (int t = 0; t < T; t++) {
        memset(&w[t], 0, sizeof w[t]);
        TU_CHECK(fmha_layer_init(&w[t].layer, &p.cfg) == FMHA_STATUS_OK, "init");
        tu_tensor_init(&w[t].out, FMHA_DTYPE_F32, p.out.t.batch, p.out.t.seqlen, p.out.t.heads,
                       p.out.t.head_dim, 0, POISON);
        w[t].a = p.a;
        w[t].a.out = w[t].out.t;
        w[t].a.lse = NULL;
        w[t].calls = 20;
        w[t].go = &go;
        pthread_create(&th[t], NULL, work, &w[t]);
    }
    for (int t = 0; t < T; t++) {
        pthread_join(th[t], NULL);
        TU_CHECK(w[t].st == FMHA_STATUS_OK, "thread %d: %s", t, w[t].error);
        TU_CHECK(memcmp(w[t].out.alloc, p.out.alloc, p.out.alloc_bytes) == 0,
                 "thread %d: output differs from the one-thread run", t);
        fmha_layer_free(w[t].layer);
        tu_tensor_free(&w[t].out);
    }
    pthread_barrier_destroy(&go);
    problem_free(&p);
}

/* Two threads on one layer: a call that finds the layer running is refused
 * with nothing written; every call that ran is exact. The calls are long
 * (a 2048-token problem), so that rounds overlap. */
static void test_shared_layer(tu_rng *r)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 2, 2, 64);
    cfg.dtype = FMHA_DTYPE_F32;
    cfg.num_threads = 1;
    const int64_t S = 2048;
    tu_tensor q, k, v, ref;
    tu_tensor_init(&q, cfg.dtype, 1, S, 2, 64, 0, 0);
    tu_tensor_init(&k, cfg.dtype, 1, S, 2, 64, 0, 0);
    tu_tensor_init(&v, cfg.dtype, 1, S, 2, 64, 0, 0);
    tu_tensor_init(&ref, FMHA_DTYPE_F32, 1, S, 2, 64, 0, POISON);
    tu_fill_normal(&q, r, 1);
    tu_fill_normal(&k, r, 1);
    tu_fill_normal(&v, r, 1);
    fmha_forward_args a = {.q = q.t, .k = k.t, .v = v.t, .out = ref.t};
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "one thread: %s", fmha_last_error());
    fmha_layer *layer;
    TU_CHECK(fmha_layer_init(&layer, &cfg) == FMHA_STATUS_OK, "init: %s", fmha_last_error());
    int refused = 0, wrong = 0, odd = 0;
    for (int round = 0; round < 20 && !refused; round++) {
        worker w[2];
        pthread_t th[2];
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, 2);
        for (int t = 0; t < 2; t++) {
            memset(&w[t], 0, sizeof w[t]);
            tu_tensor_init(&w[t].out, FMHA_DTYPE_F32, 1, S, 2, 64, 0, POISON);
            w[t].layer = layer;
            w[t].a = a;
            w[t].a.out = w[t].out.t;
            w[t].calls = 1;
            w[t].go = &go;
            pthread_create(&th[t], NULL, work, &w[t]);
        }
        for (int t = 0; t < 2; t++) {
            pthread_join(th[t], NULL);
            if (w[t].st == FMHA_STATUS_OK) {
                wrong += memcmp(w[t].out.alloc, ref.alloc, ref.alloc_bytes) != 0;
            } else {
                refused++;
                odd += w[t].st != FMHA_STATUS_INVALID_ARGUMENT ||
                       !strstr(w[t].error, "another thread") || !all_poison(&w[t].out);
            }
            tu_tensor_free(&w[t].out);
        }
        pthread_barrier_destroy(&go);
    }
    TU_CHECK(refused > 0, "two threads on one layer, 20 rounds: no call was refused");
    TU_CHECK(wrong == 0, "two threads on one layer: %d calls that ran gave other bits", wrong);
    TU_CHECK(odd == 0,
             "two threads on one layer: %d refusals were not INVALID_ARGUMENT naming the other "
             "thread with out untouched",
             odd);
    /* A refusal leaves the layer usable. */
    TU_CHECK(fmha_layer_forward(layer, &a) == FMHA_STATUS_OK, "after a refusal: %s",
             fmha_last_error());
    fmha_layer_free(layer);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&ref);
}

/* ------------------------------------------------------------ empty problems */

static void test_empty_problems(tu_rng *r)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 4, 2, 32);
    cfg.dtype = FMHA_DTYPE_F32;
    /* batch 0, and seqlen_q 0 with NULL data: OK, nothing read or written */
    for (int which = 0; which < 2; which++) {
        const int64_t B = which == 0 ? 0 : 2, Sq = which == 0 ? 9 : 0;
        tu_tensor k, v;
        tu_tensor_init(&k, cfg.dtype, B, 9, 2, 32, 0, 0);
        tu_tensor_init(&v, cfg.dtype, B, 9, 2, 32, 0, 0);
        fmha_forward_args a = {.q = fmha_tensor_bshd(NULL, cfg.dtype, B, Sq, 4, 32),
                               .k = k.t,
                               .v = v.t,
                               .out = fmha_tensor_bshd(NULL, cfg.dtype, B, Sq, 4, 32)};
        fmha_status st = fmha_forward(&cfg, &a);
        TU_CHECK(st == FMHA_STATUS_OK, "%s: %s", which ? "seqlen_q 0" : "batch 0",
                 fmha_last_error());
        st = fmha_reference_forward(&cfg, &a);
        TU_CHECK(st == FMHA_STATUS_OK, "reference, %s: %s", which ? "seqlen_q 0" : "batch 0",
                 fmha_last_error());
        tu_tensor_free(&k);
        tu_tensor_free(&v);
    }
    /* seqlen_k 0: every row sees no key: out 0, lse -inf, on the kernel, an FP8 layer
     * and the reference */
    for (int ref = 0; ref < 3; ref++) {
        cfg.fp8_compute = ref == 2 ? FMHA_FP8_COMPUTE_PER_TENSOR : FMHA_FP8_COMPUTE_OFF;
        tu_tensor q, o;
        tu_tensor_init(&q, cfg.dtype, 2, 5, 4, 32, 2, 0);
        tu_tensor_init(&o, cfg.dtype, 2, 5, 4, 32, 2, POISON);
        tu_fill_normal(&q, r, 1);
        float lse[2 * 4 * 5];
        memset(lse, POISON, sizeof lse);
        fmha_forward_args a = {.q = q.t,
                               .k = fmha_tensor_bshd(NULL, cfg.dtype, 2, 0, 2, 32),
                               .v = fmha_tensor_bshd(NULL, cfg.dtype, 2, 0, 2, 32),
                               .out = o.t,
                               .lse = lse};
        fmha_status st = ref == 1 ? fmha_reference_forward(&cfg, &a) : fmha_forward(&cfg, &a);
        const char *who = ref == 0 ? "" : ref == 1 ? "reference, " : "fp8_compute, ";
        TU_CHECK(st == FMHA_STATUS_OK, "%sseqlen_k 0: %s", who, fmha_last_error());
        int bad = 0;
        for (int64_t b = 0; b < 2; b++)
            for (int64_t s = 0; s < 5; s++)
                for (int64_t h = 0; h < 4; h++)
                    for (int64_t c = 0; c < 32; c++)
                        bad += tu_get(&o, b, s, h, c) != 0.0;
        for (int i = 0; i < 40; i++)
            bad += lse[i] != -INFINITY;
        TU_CHECK(bad == 0 && tu_gaps_untouched(&o, POISON),
                 "%sseqlen_k 0: %d values are not out 0 / lse -inf", who, bad);
        tu_tensor_free(&q);
        tu_tensor_free(&o);
    }
    cfg.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    /* still refused: NULL data of a non-empty view, a negative batch */
    tu_tensor q;
    tu_tensor_init(&q, cfg.dtype, 1, 3, 4, 32, 0, 0);
    fmha_forward_args a = {.q = q.t,
                           .k = fmha_tensor_bshd(NULL, cfg.dtype, 1, 3, 2, 32),
                           .v = fmha_tensor_bshd(NULL, cfg.dtype, 1, 3, 2, 32),
                           .out = q.t};
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "k.data is NULL"),
             "NULL k of 3 tokens: %s", fmha_last_error());
    a.k = q.t;
    a.k.heads = 2;
    a.v = a.k;
    a.q.batch = -1;
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "q.batch (-1) must be non-negative"),
             "batch -1: %s", fmha_last_error());
    tu_tensor_free(&q);
}

int main(void)
{
    tu_rng rng = {20261205};
    test_allocation_failures(&rng);
    test_layers_per_thread(&rng);
    test_shared_layer(&rng);
    test_empty_problems(&rng);
    return tu_summary();
}
