/* test_reference.c — the float64 reference (fmha_reference_forward) against a
 * brute force written here from the documented rules alone: full score matrix
 * in double, explicit mask, softcap, dropout from fmha_dropout_keep, LSE,
 * varlen with empty sequences, GQA, separate value head dim, every layout.
 * Then hand-worked cases whose answers are known exactly. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ brute force */

typedef struct rcase {
    int64_t batch;   /* sequences */
    int64_t sq, sk;  /* padded lengths (varlen: longest allowed) */
    int varlen;      /* per-sequence lengths drawn in [0, sq] / [0, sk] */
    int64_t extra_q; /* varlen: tokens past the last sequence */
    int64_t heads, kv, d, dv;
    int causal;
    int64_t wl, wr;
    double scale, softcap, dropout;
    int lq, lkv, lo; /* layouts: 0 BSHD, 1 BHSD, 2 padded strides */
    fmha_dtype dt, odt;
    int lse;
    uint64_t seed, offset;
} rcase;

static void describe(const rcase *c, char *buf, size_t n)
{
    snprintf(buf, n,
             "b=%lld sq=%lld sk=%lld varlen=%d h=%lld kv=%lld d=%lld dv=%lld causal=%d "
             "win=(%lld,%lld) scale=%g softcap=%g drop=%g layouts=%d%d%d dt=%s out=%s lse=%d",
             (long long)c->batch, (long long)c->sq, (long long)c->sk, c->varlen,
             (long long)c->heads, (long long)c->kv, (long long)c->d, (long long)c->dv, c->causal,
             (long long)c->wl, (long long)c->wr, c->scale, c->softcap, c->dropout, c->lq, c->lkv,
             c->lo, fmha_dtype_name(c->dt), fmha_dtype_name(c->odt), c->lse);
}

/* The documented mask: key j is visible to query i iff
 * i + sk - sq - left <= j <= i + sk - sq + right, -1 = unlimited on that
 * side, causal = right 0. */
static int visible(const rcase *c, int64_t i, int64_t j, int64_t sq, int64_t sk)
{
    int64_t diag = i + sk - sq;
    int64_t right = c->causal ? 0 : c->wr;
    if (right >= 0 && j > diag + right)
        return 0;
    if (c->wl >= 0 && j < diag - c->wl)
        return 0;
    return 1;
}

/* Attention of one (sequence, head) in double, the whole matrix at once.
 * out_bf[i * dv + c], lse_bf[i]. */
static void brute_head(const rcase *c, const tu_tensor *q, const tu_tensor *k, const tu_tensor *v,
                       int64_t tb, int64_t q0, int64_t sq, int64_t k0, int64_t sk, int64_t seq,
                       int64_t h, double *out_bf, double *lse_bf)
{
    const int64_t hk = h / (c->heads / c->kv);
    const double scale = c->scale > 0 ? c->scale : 1.0 / sqrt((double)c->d);
    double *S = malloc(sizeof(double) * (size_t)(sq * sk + 1));
    double *P = malloc(sizeof(double) * (size_t)(sq * sk + 1));
    unsigned char *M = malloc((size_t)(sq * sk + 1));

    for (int64_t i = 0; i < sq; i++)
        for (int64_t j = 0; j < sk; j++) {
            double s = 0;
            for (int64_t e = 0; e < c->d; e++)
                s += tu_get(q, tb, q0 + i, h, e) * tu_get(k, tb, k0 + j, hk, e);
            s *= scale;
            if (c->softcap > 0)
                s = c->softcap * tanh(s / c->softcap);
            S[i * sk + j] = s;
            M[i * sk + j] = (unsigned char)visible(c, i, j, sq, sk);
        }

    for (int64_t i = 0; i < sq; i++) {
        double m = -INFINITY;
        for (int64_t j = 0; j < sk; j++)
            if (M[i * sk + j] && S[i * sk + j] > m)
                m = S[i * sk + j];
        if (m == -INFINITY) { /* no visible key */
            for (int64_t e = 0; e < c->dv; e++)
                out_bf[i * c->dv + e] = 0.0;
            lse_bf[i] = -INFINITY;
            continue;
        }
        double l = 0;
        for (int64_t j = 0; j < sk; j++) {
            P[i * sk + j] = M[i * sk + j] ? exp(S[i * sk + j] - m) : 0.0;
            l += P[i * sk + j]; /* before dropout: the normaliser counts dropped elements */
        }
        lse_bf[i] = m + log(l);
        for (int64_t j = 0; j < sk; j++) {
            P[i * sk + j] /= l;
            if (c->dropout > 0)
                P[i * sk + j] *=
                    fmha_dropout_keep(c->seed, c->offset, seq, c->heads, h, i, j, c->dropout)
                        ? 1.0 / (1.0 - c->dropout)
                        : 0.0;
        }
        for (int64_t e = 0; e < c->dv; e++) {
            double o = 0;
            for (int64_t j = 0; j < sk; j++)
                o += P[i * sk + j] * tu_get(v, tb, k0 + j, hk, e);
            out_bf[i * c->dv + e] = o;
        }
    }
    free(S);
    free(P);
    free(M);
}

static double out_tol(fmha_dtype odt, double want)
{
    switch (odt) {
    case FMHA_DTYPE_BF16: return 0x1p-8 * fabs(want) + 1e-30;
    case FMHA_DTYPE_F16: return 0x1p-10 * fabs(want) + 0x1p-24;
    default: return 1e-6 * fabs(want) + 1e-9;
    }
}

static int64_t n_cases, n_masked_rows, n_dropout_cases, n_empty_seqs;

/* Runs one case through the reference and the brute force; 1 if they agree. */
static int run_case(const rcase *c, tu_rng *rng)
{
    char desc[512];
    describe(c, desc, sizeof desc);
    n_cases++;

    /* sequence layout */
    int32_t *cuq = calloc((size_t)c->batch + 1, sizeof(int32_t));
    int32_t *cuk = calloc((size_t)c->batch + 1, sizeof(int32_t));
    int64_t tb = c->batch, tq = c->sq, tk = c->sk;
    if (c->varlen) {
        for (int64_t b = 0; b < c->batch; b++) {
            cuq[b + 1] = cuq[b] + (int32_t)tu_range(rng, c->sq + 1);
            cuk[b + 1] = cuk[b] + (int32_t)tu_range(rng, c->sk + 1);
            if (cuq[b + 1] == cuq[b] || cuk[b + 1] == cuk[b])
                n_empty_seqs++;
        }
        tb = 1;
        tq = cuq[c->batch] + c->extra_q;
        tk = cuk[c->batch];
        if (tq == 0)
            tq = 1; /* a tensor holds one token at least; it belongs to no sequence */
        if (tk == 0)
            tk = 1;
    }

    tu_tensor q, k, v, out;
    tu_tensor_init(&q, c->dt, tb, tq, c->heads, c->d, c->lq, 0xA5);
    tu_tensor_init(&k, c->dt, tb, tk, c->kv, c->d, c->lkv, 0xA5);
    tu_tensor_init(&v, c->dt, tb, tk, c->kv, c->dv, c->lkv, 0xA5);
    tu_tensor_init(&out, c->odt, tb, tq, c->heads, c->dv, c->lo, 0xFF); /* NaN poison */
    tu_fill_normal(&q, rng, 1.0);
    tu_fill_normal(&k, rng, 1.0);
    tu_fill_normal(&v, rng, 1.0);

    const int64_t nl = c->heads * tq * tb, tail = 4;
    float *lse = malloc(sizeof(float) * (size_t)(nl + tail));
    memset(lse, 0xFF, sizeof(float) * (size_t)(nl + tail));

    fmha_config cfg;
    fmha_config_init(&cfg, c->heads, c->kv, c->d);
    cfg.head_dim_v = c->dv;
    cfg.dtype = c->dt;
    cfg.causal = c->causal;
    cfg.window_left = c->wl;
    cfg.window_right = c->wr;
    cfg.softmax_scale = c->scale;
    cfg.softcap = c->softcap;
    cfg.dropout_p = c->dropout;

    fmha_forward_args a;
    memset(&a, 0, sizeof a);
    a.q = q.t, a.k = k.t, a.v = v.t, a.out = out.t;
    a.lse = c->lse ? lse : NULL;
    if (c->varlen) {
        a.cu_seqlens_q = cuq;
        a.cu_seqlens_k = cuk;
        a.varlen_batch = c->batch;
    }
    a.seed = c->seed;
    a.offset = c->offset;

    int ok = 1;
    fmha_status st = fmha_reference_forward(&cfg, &a);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: reference failed: %s", desc, fmha_last_error());
    if (st != FMHA_STATUS_OK)
        ok = 0;

    double max_err = 0, max_lse_err = 0;
    int64_t bad_out = 0, bad_lse = 0;
    unsigned char *row_owned = calloc((size_t)tq, 1);
    double *obf = malloc(sizeof(double) * (size_t)(c->sq * c->dv + 1));
    double *lbf = malloc(sizeof(double) * (size_t)(c->sq + 1));
    for (int64_t b = 0; ok && b < c->batch; b++) {
        int64_t q0 = c->varlen ? cuq[b] : 0, sq = c->varlen ? cuq[b + 1] - cuq[b] : c->sq;
        int64_t k0 = c->varlen ? cuk[b] : 0, sk = c->varlen ? cuk[b + 1] - cuk[b] : c->sk;
        int64_t bt = c->varlen ? 0 : b;
        for (int64_t i = 0; i < sq; i++)
            row_owned[q0 + i] = 1;
        for (int64_t h = 0; h < c->heads; h++) {
            brute_head(c, &q, &k, &v, bt, q0, sq, k0, sk, b, h, obf, lbf);
            for (int64_t i = 0; i < sq; i++) {
                if (h == 0 && lbf[i] == -INFINITY)
                    n_masked_rows++;
                for (int64_t e = 0; e < c->dv; e++) {
                    double got = tu_get(&out, bt, q0 + i, h, e), want = obf[i * c->dv + e];
                    double err = fabs(got - want);
                    if (!(err <= out_tol(c->odt, want))) {
                        if (bad_out++ == 0)
                            fprintf(stderr,
                                    "  %s: out[b%lld i%lld h%lld c%lld] = %.9g, want %.9g\n", desc,
                                    (long long)b, (long long)i, (long long)h, (long long)e, got,
                                    want);
                    }
                    if (err > max_err || isnan(err))
                        max_err = err;
                }
                if (c->lse) {
                    int64_t idx = c->varlen ? h * tq + q0 + i : (b * c->heads + h) * sq + i;
                    double got = lse[idx], want = lbf[i];
                    int good = want == -INFINITY ? got == -INFINITY
                                                 : fabs(got - want) <= 1e-6 * fmax(1.0, fabs(want));
                    if (!good && bad_lse++ == 0)
                        fprintf(stderr, "  %s: lse[b%lld i%lld h%lld] = %.9g, want %.9g\n", desc,
                                (long long)b, (long long)i, (long long)h, got, want);
                    if (want != -INFINITY && fabs(got - want) > max_lse_err)
                        max_lse_err = fabs(got - want);
                }
            }
        }
    }
    if (ok) {
        TU_CHECK(bad_out == 0, "%s: %lld output elements off (max err %.3g)", desc,
                 (long long)bad_out, max_err);
        TU_CHECK(tu_gaps_untouched(&out, 0xFF), "%s: wrote outside the output view", desc);
        if (c->lse)
            TU_CHECK(bad_lse == 0, "%s: %lld lse entries off (max err %.3g)", desc,
                     (long long)bad_lse, max_lse_err);
        /* lse has no writes past its end; unowned varlen tokens stay poisoned */
        unsigned char poison[sizeof(float)];
        memset(poison, 0xFF, sizeof poison);
        int tail_ok = 1, unowned_ok = 1;
        for (int64_t i = 0; i < tail; i++)
            tail_ok &= !memcmp(&lse[nl + i], poison, sizeof poison);
        for (int64_t s = 0; s < tq; s++) {
            if (row_owned[s] || !c->varlen)
                continue;
            for (int64_t h = 0; h < c->heads; h++) {
                if (c->lse)
                    unowned_ok &= !memcmp(&lse[h * tq + s], poison, sizeof poison);
                for (int64_t e = 0; e < c->dv; e++)
                    unowned_ok &= isnan(tu_get(&out, 0, s, h, e));
            }
        }
        TU_CHECK(tail_ok, "%s: lse written past its end", desc);
        TU_CHECK(unowned_ok, "%s: tokens of no sequence were written", desc);
        if (bad_out || bad_lse)
            ok = 0;
    }

    free(row_owned);
    free(obf);
    free(lbf);
    free(lse);
    free(cuq);
    free(cuk);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    return ok;
}

static rcase base_case(int64_t batch, int64_t sq, int64_t sk, int64_t heads, int64_t kv, int64_t d,
                       int64_t dv)
{
    rcase c;
    memset(&c, 0, sizeof c);
    c.batch = batch, c.sq = sq, c.sk = sk, c.heads = heads, c.kv = kv, c.d = d, c.dv = dv;
    c.wl = c.wr = -1;
    c.dt = c.odt = FMHA_DTYPE_F32;
    c.lse = 1;
    c.seed = 0x1234567890abcdefull;
    c.offset = 0xfeed00000007ull; /* high word non-zero: exercises the key xor */
    return c;
}

/* One named feature at a time, then everything at random. */
static void test_against_brute_force(void)
{
    tu_rng rng = {2024};
    rcase c;

    c = base_case(1, 1, 1, 1, 1, 1, 1);
    run_case(&c, &rng);
    c = base_case(2, 5, 9, 4, 2, 7, 7); /* sq < sk */
    run_case(&c, &rng);
    c = base_case(2, 9, 4, 4, 1, 3, 3); /* sq > sk, MQA */
    run_case(&c, &rng);
    c.causal = 1;
    run_case(&c, &rng);
    c = base_case(1, 4, 8, 3, 1, 5, 2); /* causal sq < sk, dv < d */
    c.causal = 1;
    run_case(&c, &rng);
    c = base_case(1, 7, 7, 2, 2, 9, 9);
    c.wl = 2, c.wr = 1;
    run_case(&c, &rng);
    c.wl = 0, c.wr = 0;
    run_case(&c, &rng);
    c.wl = 3, c.wr = -1;
    run_case(&c, &rng);
    c.wl = -1, c.wr = 0; /* = causal */
    run_case(&c, &rng);
    c = base_case(1, 8, 3, 2, 1, 4, 6); /* sk < sq with a band: whole rows masked */
    c.wl = 0, c.wr = 0;
    run_case(&c, &rng);
    c.causal = 1, c.wl = 1, c.wr = 5; /* causal overrides window_right */
    run_case(&c, &rng);
    c = base_case(2, 6, 6, 4, 2, 8, 8);
    c.softcap = 0.7;
    run_case(&c, &rng);
    c.scale = 1.9, c.softcap = 5;
    run_case(&c, &rng);
    c.scale = 0.05, c.softcap = 0;
    run_case(&c, &rng);
    const double drops[3] = {0.1, 0.5, 0.9};
    for (int i = 0; i < 3; i++) {
        c = base_case(2, 9, 8, 4, 2, 6, 5);
        c.dropout = drops[i];
        c.causal = i == 1;
        run_case(&c, &rng);
    }
    c = base_case(3, 6, 7, 4, 2, 5, 3); /* varlen, possibly with empty sequences */
    c.varlen = 1, c.extra_q = 2;
    for (int i = 0; i < 6; i++) {
        c.causal = i & 1;
        c.dropout = i >= 4 ? 0.3 : 0;
        run_case(&c, &rng);
    }
    for (int l = 0; l < 3; l++) { /* layouts */
        c = base_case(2, 5, 6, 4, 2, 7, 4);
        c.lq = l, c.lkv = (l + 1) % 3, c.lo = (l + 2) % 3;
        run_case(&c, &rng);
        c.lq = c.lkv = c.lo = l;
        c.varlen = 1;
        run_case(&c, &rng);
    }
    c = base_case(1, 4, 4, 2, 2, 3, 3);
    c.lse = 0;
    run_case(&c, &rng);
    const fmha_dtype dts[3] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    for (int i = 0; i < 3; i++)
        for (int o = 0; o < 3; o++) {
            c = base_case(1, 6, 5, 2, 1, 8, 8);
            c.dt = dts[i], c.odt = dts[o];
            c.causal = 1;
            run_case(&c, &rng);
        }

    /* random small cases */
    const int64_t windows[5] = {-1, 0, 1, 2, 5};
    const double caps[3] = {0.5, 2.0, 30.0};
    for (int n = 0; n < 3000; n++) {
        int64_t kv = 1 + tu_range(&rng, 2);
        int64_t group = 1 + tu_range(&rng, kv == 1 ? 4 : 2);
        int64_t d = 1 + tu_range(&rng, 9);
        c = base_case(1 + tu_range(&rng, 2), 1 + tu_range(&rng, 9), 1 + tu_range(&rng, 9),
                      kv * group, kv, d, tu_range(&rng, 2) ? d : 1 + tu_range(&rng, 9));
        c.causal = tu_range(&rng, 10) < 3;
        if (tu_range(&rng, 2)) {
            c.wl = windows[tu_range(&rng, 5)];
            c.wr = windows[tu_range(&rng, 5)];
        }
        if (tu_range(&rng, 4) == 0)
            c.softcap = caps[tu_range(&rng, 3)];
        if (tu_range(&rng, 4) == 0) {
            c.dropout = drops[tu_range(&rng, 3)];
            n_dropout_cases++;
        }
        if (tu_range(&rng, 2))
            c.scale = 0.05 + 2.0 * tu_uniform(&rng);
        c.lq = (int)tu_range(&rng, 3);
        c.lkv = (int)tu_range(&rng, 3);
        c.lo = (int)tu_range(&rng, 3);
        if (tu_range(&rng, 10) < 3) {
            c.varlen = 1;
            c.batch = 1 + tu_range(&rng, 4);
            c.extra_q = tu_range(&rng, 3);
        }
        c.lse = tu_range(&rng, 5) != 0;
        if (tu_range(&rng, 10) == 0)
            c.dt = dts[1 + tu_range(&rng, 2)];
        if (tu_range(&rng, 10) == 0)
            c.odt = dts[1 + tu_range(&rng, 2)];
        c.seed = tu_next(&rng);
        c.offset = tu_next(&rng);
        run_case(&c, &rng);
    }
    /* the sweep must have reached the corners it is meant to cover */
    TU_CHECK(n_masked_rows > 20, "only %lld fully masked rows were exercised",
             (long long)n_masked_rows);
    TU_CHECK(n_empty_seqs > 10, "only %lld empty varlen sequences were exercised",
             (long long)n_empty_seqs);
}

/* ------------------------------------------------------ hand-worked cases */

/* BSHD f32, batch 1; returns the reference status. */
static fmha_status run_small(const fmha_config *cfg, int64_t sq, int64_t sk, float *q, float *k,
                             float *v, float *out, float *lse, uint64_t seed, uint64_t offset)
{
    fmha_forward_args a;
    memset(&a, 0, sizeof a);
    a.q = fmha_tensor_bshd(q, FMHA_DTYPE_F32, 1, sq, cfg->num_heads, cfg->head_dim);
    a.k = fmha_tensor_bshd(k, FMHA_DTYPE_F32, 1, sk, cfg->num_kv_heads, cfg->head_dim);
    a.v = fmha_tensor_bshd(v, FMHA_DTYPE_F32, 1, sk, cfg->num_kv_heads, cfg->head_dim_v);
    a.out = fmha_tensor_bshd(out, FMHA_DTYPE_F32, 1, sq, cfg->num_heads, cfg->head_dim_v);
    a.lse = lse;
    a.seed = seed;
    a.offset = offset;
    return fmha_reference_forward(cfg, &a);
}

static int near(double got, double want, double rel)
{
    if (isinf(want))
        return got == want;
    return fabs(got - want) <= rel * fmax(1.0, fabs(want));
}

static void test_hand_cases(void)
{
    fmha_config cfg;
    float out[64], lse[16];

    /* A single key: every query sees it alone, so out = v exactly and lse is
     * the (scaled) score itself. Two heads share the one KV head. */
    {
        fmha_config_init(&cfg, 2, 1, 2);
        cfg.head_dim_v = 3;
        cfg.dtype = FMHA_DTYPE_F32;
        float q[3 * 2 * 2] = {1.5f, 2, -1, 0.5f, 0, 0, 4, -4, 2, 2, 0.25f, 1};
        float k[2] = {0.5f, 0.25f};
        float v[3] = {3.25f, -7.5f, 0.125f};
        TU_CHECK(run_small(&cfg, 3, 1, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        for (int r = 0; r < 6; r++) { /* (row, head) pairs */
            for (int e = 0; e < 3; e++)
                TU_CHECK(out[r * 3 + e] == v[e], "single key: out[%d][%d] = %g, want %g", r, e,
                         out[r * 3 + e], v[e]);
            double score = (q[r * 2] * 0.5 + q[r * 2 + 1] * 0.25) / sqrt(2.0);
            int i = r / 2, h = r % 2;
            TU_CHECK(near(lse[h * 3 + i], score, 1e-7),
                     "single key: lse[h%d][%d] = %.9g, want %.9g", h, i, lse[h * 3 + i], score);
        }
        /* with softcap the lse is the capped score */
        cfg.softcap = 0.5;
        cfg.softmax_scale = 1.0;
        TU_CHECK(run_small(&cfg, 3, 1, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        for (int r = 0; r < 6; r++) {
            double score = q[r * 2] * 0.5 + q[r * 2 + 1] * 0.25;
            double capped = 0.5 * tanh(score / 0.5);
            int i = r / 2, h = r % 2;
            TU_CHECK(near(lse[h * 3 + i], capped, 1e-7) && out[r * 3] == v[0],
                     "single key softcap: lse %.9g, want %.9g", lse[h * 3 + i], capped);
        }
        /* causal with sq 3 > sk 1: bottom-right aligned, only the last query
         * sees the key; the others get 0 and -inf */
        cfg.softcap = 0;
        cfg.causal = 1;
        TU_CHECK(run_small(&cfg, 3, 1, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        for (int r = 0; r < 6; r++) {
            int i = r / 2, h = r % 2;
            int seen = i == 2;
            for (int e = 0; e < 3; e++)
                TU_CHECK(out[r * 3 + e] == (seen ? v[e] : 0.0f),
                         "causal sq3 sk1: out[i%d h%d][%d] = %g", i, h, e, out[r * 3 + e]);
            double score = q[r * 2] * 0.5 + q[r * 2 + 1] * 0.25;
            TU_CHECK(near(lse[h * 3 + i], seen ? score : -INFINITY, 1e-7),
                     "causal sq3 sk1: lse[h%d][%d] = %g", h, i, lse[h * 3 + i]);
        }
    }

    /* Two equal keys: the plain average of their values, lse = score + log 2. */
    {
        fmha_config_init(&cfg, 1, 1, 2);
        cfg.dtype = FMHA_DTYPE_F32;
        cfg.softmax_scale = 1.0;
        float q[2] = {1, -2}, k[4] = {0.5f, 1, 0.5f, 1}, v[4] = {1, 10, 2, -4};
        TU_CHECK(run_small(&cfg, 1, 2, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        TU_CHECK(out[0] == 1.5f && out[1] == 3.0f, "two equal keys: out (%g, %g), want (1.5, 3)",
                 out[0], out[1]);
        TU_CHECK(near(lse[0], -1.5 + log(2.0), 1e-7), "two equal keys: lse %.9g, want %.9g", lse[0],
                 -1.5 + log(2.0));
    }

    /* Two keys of different scores: softmax weights by hand. */
    {
        fmha_config_init(&cfg, 1, 1, 1);
        cfg.dtype = FMHA_DTYPE_F32;
        cfg.softmax_scale = 0.5;
        float q[1] = {2}, k[2] = {1, -1}, v[2] = {4, -2};
        TU_CHECK(run_small(&cfg, 1, 2, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        double w0 = exp(1.0) / (exp(1.0) + exp(-1.0)); /* scores +1, -1 */
        TU_CHECK(near(out[0], 4 * w0 - 2 * (1 - w0), 1e-6), "two keys: out %.9g, want %.9g", out[0],
                 4 * w0 - 2 * (1 - w0));
        TU_CHECK(near(lse[0], log(exp(1.0) + exp(-1.0)), 1e-7), "two keys: lse %.9g", lse[0]);
    }

    /* Band window_left = window_right = 0 with sq 4 > sk 2: query i sees only
     * key i + sk - sq = i - 2, so rows 0 and 1 see nothing (0, -inf) and rows
     * 2 and 3 copy v0 and v1. With sq 2 < sk 5 row i sees key i + 3. */
    {
        fmha_config_init(&cfg, 1, 1, 2);
        cfg.dtype = FMHA_DTYPE_F32;
        cfg.window_left = cfg.window_right = 0;
        float q[8] = {1, 2, 3, 4, 5, 6, 0.5f, 0.25f}, k[10] = {1, 1, -1, 2, 3, 0, 0, 3, 1, -1};
        float v[10] = {7, 8, -9, 10, 11, 12, 13, 14, 15, 16};
        TU_CHECK(run_small(&cfg, 4, 2, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        for (int i = 0; i < 4; i++) {
            float w0 = i < 2 ? 0.0f : v[(i - 2) * 2], w1 = i < 2 ? 0.0f : v[(i - 2) * 2 + 1];
            TU_CHECK(out[i * 2] == w0 && out[i * 2 + 1] == w1,
                     "band sq4 sk2: row %d out (%g, %g), want (%g, %g)", i, out[i * 2],
                     out[i * 2 + 1], w0, w1);
            double want =
                i < 2 ? -INFINITY
                      : (q[i * 2] * k[(i - 2) * 2] + q[i * 2 + 1] * k[(i - 2) * 2 + 1]) / sqrt(2.0);
            TU_CHECK(near(lse[i], want, 1e-7), "band sq4 sk2: row %d lse %g, want %g", i, lse[i],
                     want);
        }
        TU_CHECK(run_small(&cfg, 2, 5, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        for (int i = 0; i < 2; i++)
            TU_CHECK(out[i * 2] == v[(i + 3) * 2] && out[i * 2 + 1] == v[(i + 3) * 2 + 1] &&
                         isfinite(lse[i]),
                     "band sq2 sk5: row %d out (%g, %g), want key %d", i, out[i * 2],
                     out[i * 2 + 1], i + 3);
    }

    /* Zero queries make every visible key weigh the same: out is the mean of
     * the visible values and lse = log(count). Causal sq 1 sk 4 sees all four
     * keys (bottom-right), causal 3x3 is lower triangular, and a window
     * left 1 / right 0 with sq 4 sk 6 sees keys i+1 and i+2. */
    {
        float q[12] = {0}, k[18], v[6] = {1, 2, 4, 8, 16, 32};
        for (int i = 0; i < 18; i++)
            k[i] = (float)(i % 7) - 3;
        fmha_config_init(&cfg, 1, 1, 3);
        cfg.head_dim_v = 1;
        cfg.dtype = FMHA_DTYPE_F32;
        cfg.causal = 1;
        TU_CHECK(run_small(&cfg, 1, 4, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        TU_CHECK(out[0] == 15.0f / 4 && near(lse[0], log(4.0), 1e-7),
                 "causal sq1 sk4: out %g lse %g, want 3.75 and log 4", out[0], lse[0]);
        TU_CHECK(run_small(&cfg, 3, 3, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        const float tri[3] = {1.0f, 1.5f, 7.0f / 3};
        for (int i = 0; i < 3; i++)
            TU_CHECK(near(out[i], tri[i], 1e-7) && near(lse[i], log(i + 1.0), 1e-7),
                     "causal 3x3: row %d out %g lse %g", i, out[i], lse[i]);
        cfg.causal = 0;
        cfg.window_left = 1;
        cfg.window_right = 0;
        TU_CHECK(run_small(&cfg, 4, 6, q, k, v, out, lse, 0, 0) == FMHA_STATUS_OK, "%s",
                 fmha_last_error());
        for (int i = 0; i < 4; i++)
            TU_CHECK(out[i] == (v[i + 1] + v[i + 2]) / 2 && near(lse[i], log(2.0), 1e-7),
                     "window (1, 0) sq4 sk6: row %d out %g, want %g", i, out[i],
                     (v[i + 1] + v[i + 2]) / 2);

        /* Dropout on uniform weights: kept values scaled by 1 / (1 - p) over
         * the count of all visible keys, dropped or not; lse ignores dropout. */
        cfg.window_left = cfg.window_right = -1;
        cfg.dropout_p = 0.5;
        int any_dropped = 0, any_kept = 0;
        for (uint64_t seed = 1; seed <= 8; seed++) {
            TU_CHECK(run_small(&cfg, 1, 6, q, k, v, out, lse, seed, 3) == FMHA_STATUS_OK, "%s",
                     fmha_last_error());
            double want = 0;
            for (int j = 0; j < 6; j++) {
                int keep = fmha_dropout_keep(seed, 3, 0, 1, 0, 0, j, 0.5);
                any_kept |= keep, any_dropped |= !keep;
                want += keep ? v[j] * 2.0 / 6 : 0.0;
            }
            TU_CHECK(near(out[0], want, 1e-7) && near(lse[0], log(6.0), 1e-7),
                     "dropout seed %llu: out %.9g, want %.9g; lse %g", (unsigned long long)seed,
                     out[0], want, lse[0]);
        }
        TU_CHECK(any_dropped && any_kept, "dropout 0.5 over 48 draws kept all or none");
    }

    /* Dropout's keep rate is about 1 - p and p = 0 keeps everything. */
    {
        int kept = 0, n = 0;
        for (int64_t i = 0; i < 64; i++)
            for (int64_t j = 0; j < 64; j++, n++)
                kept += fmha_dropout_keep(99, 5, 1, 4, 2, i, j, 0.25);
        TU_CHECK(fabs((double)kept / n - 0.75) < 0.03, "keep rate %g for p 0.25", (double)kept / n);
        TU_CHECK(fmha_dropout_keep(99, 5, 1, 4, 2, 3, 7, 0.0) == 1, "p = 0 must keep");
    }

    /* A packed batch of an empty, a one-token and a two-token sequence: the
     * empty one owns no rows; the lone key copies v; GQA 2 heads / 1 kv. */
    {
        fmha_config_init(&cfg, 2, 1, 1);
        cfg.dtype = FMHA_DTYPE_F32;
        cfg.softmax_scale = 1.0;
        float q[3 * 2] = {1, 2, 3, 4, 0, 0}, k[3] = {1, 0, 0}, v[3] = {5, 6, 8};
        int32_t cuq[4] = {0, 0, 1, 3}, cuk[4] = {0, 0, 1, 3};
        float o[6], l[6];
        fmha_forward_args a;
        memset(&a, 0, sizeof a);
        a.q = fmha_tensor_packed(q, FMHA_DTYPE_F32, 3, 2, 1);
        a.k = fmha_tensor_packed(k, FMHA_DTYPE_F32, 3, 1, 1);
        a.v = fmha_tensor_packed(v, FMHA_DTYPE_F32, 3, 1, 1);
        a.out = fmha_tensor_packed(o, FMHA_DTYPE_F32, 3, 2, 1);
        a.lse = l;
        a.cu_seqlens_q = cuq;
        a.cu_seqlens_k = cuk;
        a.varlen_batch = 3;
        TU_CHECK(fmha_reference_forward(&cfg, &a) == FMHA_STATUS_OK, "%s", fmha_last_error());
        /* token 0 (seq 1): key 1 alone; tokens 1, 2 (seq 2): keys 1, 2 of score 0 */
        TU_CHECK(o[0] == 5 && o[1] == 5 && o[2] == 7 && o[3] == 7 && o[4] == 7 && o[5] == 7,
                 "varlen: out %g %g %g %g %g %g", o[0], o[1], o[2], o[3], o[4], o[5]);
        /* lse is [heads, total_q] */
        TU_CHECK(l[0] == 1 && near(l[1], log(2.0), 1e-7) && near(l[2], log(2.0), 1e-7) &&
                     l[3] == 2 && near(l[4], log(2.0), 1e-7) && near(l[5], log(2.0), 1e-7),
                 "varlen: lse %g %g %g | %g %g %g", l[0], l[1], l[2], l[3], l[4], l[5]);
    }
}

/* Windows of INT64_MAX keys reach every key, as -1 does, in the reference
 * and the CPU kernel alike, with sq above and below sk. The mask's arithmetic
 * overflowed int64 on them (diag + right + 1, diag - left): UB that in
 * practice emptied every row (found by fuzz_forward under UBSan). */
static void test_huge_windows(void)
{
    enum { H = 2, D = 8 };
    float q[6 * H * D], k[6 * H * D], v[6 * H * D], out[6 * H * D], want[6 * H * D];
    tu_rng rng = {7};
    for (int i = 0; i < 6 * H * D; i++) {
        q[i] = (float)tu_normal(&rng);
        k[i] = (float)tu_normal(&rng);
        v[i] = (float)tu_normal(&rng);
    }
    const int64_t shapes[3][2] = {{4, 2}, {2, 6}, {3, 3}};
    const int64_t wins[3][2] = {{INT64_MAX, -1}, {-1, INT64_MAX}, {INT64_MAX, INT64_MAX}};
    for (int sh = 0; sh < 3; sh++)
        for (int causal = 0; causal < 2; causal++)
            for (int w = 0; w < 3; w++) {
                const int64_t sq = shapes[sh][0], sk = shapes[sh][1];
                fmha_config cfg;
                fmha_config_init(&cfg, H, H, D);
                cfg.dtype = FMHA_DTYPE_F32;
                cfg.causal = causal;
                TU_CHECK(run_small(&cfg, sq, sk, q, k, v, want, NULL, 0, 0) == FMHA_STATUS_OK, "%s",
                         fmha_last_error());
                cfg.window_left = wins[w][0];
                cfg.window_right = wins[w][1];
                for (int kernel = 0; kernel < 2; kernel++) {
                    memset(out, 0xFF, sizeof out);
                    fmha_status st;
                    if (kernel) {
                        fmha_forward_args a;
                        memset(&a, 0, sizeof a);
                        a.q = fmha_tensor_bshd(q, FMHA_DTYPE_F32, 1, sq, H, D);
                        a.k = fmha_tensor_bshd(k, FMHA_DTYPE_F32, 1, sk, H, D);
                        a.v = fmha_tensor_bshd(v, FMHA_DTYPE_F32, 1, sk, H, D);
                        a.out = fmha_tensor_bshd(out, FMHA_DTYPE_F32, 1, sq, H, D);
                        st = fmha_forward(&cfg, &a);
                    } else {
                        st = run_small(&cfg, sq, sk, q, k, v, out, NULL, 0, 0);
                    }
                    int same = st == FMHA_STATUS_OK;
                    for (int i = 0; same && i < sq * H * D; i++)
                        same = near(out[i], want[i], 1e-5);
                    TU_CHECK(same,
                             "%s: sq %lld sk %lld causal %d windows (%lld, %lld) differ from no "
                             "window (%s)",
                             kernel ? "fmha_forward" : "reference", (long long)sq, (long long)sk,
                             causal, (long long)cfg.window_left, (long long)cfg.window_right,
                             fmha_last_error());
                }
            }
    fmha_config cfg; /* FLOPs count the same pairs as without a window */
    fmha_config_init(&cfg, H, H, D);
    const double full = fmha_flops(&cfg, 1, 4, 2);
    cfg.window_left = cfg.window_right = INT64_MAX;
    TU_CHECK(fmha_flops(&cfg, 1, 4, 2) == full, "fmha_flops with INT64_MAX windows: %g, want %g",
             fmha_flops(&cfg, 1, 4, 2), full);
}

int main(void)
{
    test_hand_cases();
    test_huge_windows();
    test_against_brute_force();
    printf("%lld cases against the brute force (%lld with random dropout, %lld fully masked "
           "rows, %lld empty sequences)\n",
           (long long)n_cases, (long long)n_dropout_cases, (long long)n_masked_rows,
           (long long)n_empty_seqs);
    return tu_summary();
}
