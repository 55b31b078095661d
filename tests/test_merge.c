/* test_merge.c — fmha_merge_partials: a forward's keys split into parts
 * (empty ones too), each part run by the CPU kernel, merged and compared with
 * the float64 reference over all keys; the formula against float64 on
 * random LSEs (far apart, -inf, NaN, +inf) in every dtype and layout, in
 * place and with poisoned gaps; every refusal leaving out untouched. */
#include "alloc.h"
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const int64_t sizes[] = {1, 7, 113, 239, 64, 65};

/* A forward over keys [k0, k1) of k and v, f32 out and its LSE. */
static void forward_part(const fmha_config *cfg, const tu_tensor *q, const tu_tensor *k,
                         const tu_tensor *v, int64_t k0, int64_t k1, tu_tensor *out, float *lse)
{
    fmha_forward_args a = {0};
    a.q = q->t;
    a.k = k->t;
    a.v = v->t;
    a.k.seqlen = a.v.seqlen = k1 - k0;
    if (k1 > k0) {
        a.k.data = (char *)k->t.data + k0 * k->t.stride_seq * fmha_dtype_size(k->t.dtype);
        a.v.data = (char *)v->t.data + k0 * v->t.stride_seq * fmha_dtype_size(v->t.dtype);
    }
    a.out = out->t;
    a.lse = lse;
    fmha_status st = fmha_forward(cfg, &a);
    TU_CHECK(st == FMHA_STATUS_OK, "part forward: %s", fmha_last_error());
}

/* Split forward: the merge of the parts against the reference over all keys,
 * within twice the whole kernel's own error (plus f32 rounding). */
static void test_split(tu_rng *r, int index)
{
    const int64_t b = 1 + tu_range(r, 2), sq = sizes[tu_range(r, 6)];
    const int64_t sk = sizes[tu_range(r, 6)] + tu_range(r, 40), kv = 1 + tu_range(r, 2);
    const int64_t h = kv * (1 + tu_range(r, 2)), d = index % 2 ? 64 : 40;
    const fmha_dtype dt = index % 3 == 0 ? FMHA_DTYPE_F32 : FMHA_DTYPE_BF16;
    const int nparts = 1 + (int)tu_range(r, 6);
    fmha_config cfg;
    fmha_config_init(&cfg, h, kv, d);
    cfg.dtype = dt;
    cfg.softcap = index % 4 == 1 ? 20.0 : 0.0;
    tu_tensor q, k, v, whole, ref, out;
    tu_tensor_init(&q, dt, b, sq, h, d, index % 3, 0);
    tu_tensor_init(&k, dt, b, sk, kv, d, 0, 0);
    tu_tensor_init(&v, dt, b, sk, kv, d, 0, 0);
    tu_fill_normal(&q, r, 1.0);
    tu_fill_normal(&k, r, 1.0);
    tu_fill_normal(&v, r, 1.0);
    tu_tensor_init(&whole, FMHA_DTYPE_F32, b, sq, h, d, 0, 0xFF);
    tu_tensor_init(&ref, FMHA_DTYPE_F32, b, sq, h, d, 0, 0xFF);
    const unsigned char poison = 0xA5;
    tu_tensor_init(&out, index % 2 ? FMHA_DTYPE_F32 : FMHA_DTYPE_BF16, b, sq, h, d, 2, poison);
    const int64_t nl = b * h * sq;
    float *lse_ref = malloc(sizeof(float) * nl), *lse_whole = malloc(sizeof(float) * nl);
    float *lse = malloc(sizeof(float) * nl);

    fmha_forward_args a = {0};
    a.q = q.t, a.k = k.t, a.v = v.t, a.out = ref.t, a.lse = lse_ref;
    TU_CHECK(fmha_reference_forward(&cfg, &a) == FMHA_STATUS_OK, "reference: %s",
             fmha_last_error());
    forward_part(&cfg, &q, &k, &v, 0, sk, &whole, lse_whole);

    /* Cut points, repeated ones making empty parts (keys 0: out 0, lse -inf). */
    int64_t cuts[8];
    cuts[0] = 0;
    cuts[nparts] = sk;
    for (int i = 1; i < nparts; i++)
        cuts[i] = tu_range(r, sk + 1);
    for (int i = 1; i < nparts; i++) /* sort */
        for (int j = i + 1; j < nparts; j++)
            if (cuts[j] < cuts[i]) {
                int64_t t = cuts[i];
                cuts[i] = cuts[j], cuts[j] = t;
            }
    tu_tensor parts_t[8];
    fmha_tensor parts[8];
    float *lses[8];
    for (int i = 0; i < nparts; i++) {
        tu_tensor_init(&parts_t[i], FMHA_DTYPE_F32, b, sq, h, d, i % 3, 0xFF);
        lses[i] = malloc(sizeof(float) * nl);
        forward_part(&cfg, &q, &k, &v, cuts[i], cuts[i + 1], &parts_t[i], lses[i]);
        parts[i] = parts_t[i].t;
    }
    fmha_status st = fmha_merge_partials(nparts, parts, (const float *const *)lses, &out.t,
                                         index % 5 ? lse : NULL);
    TU_CHECK(st == FMHA_STATUS_OK, "merge: %s", fmha_last_error());
    int bad = 0;
    const double e_whole = tu_max_err(&whole, &ref, &bad);
    const double e_merge = tu_max_err(&out, &ref, &bad);
    /* bf16 out rounds the result once more. */
    const double tol = 2 * e_whole + (out.t.dtype == FMHA_DTYPE_BF16 ? 8e-3 : 2e-6);
    TU_CHECK(!bad && e_merge <= tol,
             "case %d: b=%lld sq=%lld sk=%lld h=%lld kv=%lld d=%lld parts=%d: merge error %.3g, "
             "whole kernel %.3g",
             index, (long long)b, (long long)sq, (long long)sk, (long long)h, (long long)kv,
             (long long)d, nparts, e_merge, e_whole);
    if (index % 5) {
        double el = tu_lse_err(lse, lse_ref, nl, &bad);
        TU_CHECK(!bad && el <= 2 * tu_lse_err(lse_whole, lse_ref, nl, &bad) + 2e-5,
                 "case %d: merged LSE error %.3g", index, el);
    }
    TU_CHECK(tu_gaps_untouched(&out, poison), "case %d: merge wrote outside out's view", index);
    for (int i = 0; i < nparts; i++) {
        tu_tensor_free(&parts_t[i]);
        free(lses[i]);
    }
    tu_tensor_free(&q), tu_tensor_free(&k), tu_tensor_free(&v);
    tu_tensor_free(&whole), tu_tensor_free(&ref), tu_tensor_free(&out);
    free(lse_ref), free(lse_whole), free(lse);
}

/* The formula in float64 on LSEs far apart (|lse| up to 1e4 and spreads of
 * hundreds), -inf parts holding NaN (never read), in every dtype. */
static void test_formula(tu_rng *r, int index, int in_place)
{
    const int64_t b = 1 + tu_range(r, 2), s = sizes[tu_range(r, 6)], h = 1 + tu_range(r, 3);
    const int64_t d = 1 + tu_range(r, 70);
    const int n = 1 + (int)tu_range(r, 32);
    const fmha_dtype dts[3] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    const fmha_dtype in = in_place ? FMHA_DTYPE_F32 : dts[tu_range(r, 3)];
    const fmha_dtype odt = in_place ? in : dts[tu_range(r, 3)];
    const int64_t nl = b * h * s;
    tu_tensor *pt = calloc((size_t)n, sizeof *pt);
    fmha_tensor *parts = calloc((size_t)n, sizeof *parts);
    float **lses = calloc((size_t)n, sizeof *lses);
    const double base = 1e4 * (2 * tu_uniform(r) - 1);
    for (int i = 0; i < n; i++) {
        tu_tensor_init(&pt[i], in, b, s, h, d, (int)tu_range(r, 3), 0);
        tu_fill_normal(&pt[i], r, 1.0);
        parts[i] = pt[i].t;
        lses[i] = malloc(sizeof(float) * nl);
        for (int64_t e = 0; e < nl; e++) {
            const double u = tu_uniform(r);
            lses[i][e] = u < 0.2 ? -INFINITY : (float)(base + 300 * (u - 0.5) * (index % 3));
        }
    }
    /* The -inf parts' elements are NaN: a merge that read them would show it. */
    for (int i = 0; i < n; i++)
        for (int64_t bb = 0; bb < b; bb++)
            for (int64_t hh = 0; hh < h; hh++)
                for (int64_t ss = 0; ss < s; ss++)
                    if (lses[i][(bb * h + hh) * s + ss] == -INFINITY)
                        for (int64_t c = 0; c < d; c++)
                            tu_set(&pt[i], bb, ss, hh, c, NAN);
    /* Expected values, before an in-place merge overwrites part 0. */
    double *want = malloc(sizeof(double) * nl * d), *want_lse = malloc(sizeof(double) * nl);
    for (int64_t bb = 0; bb < b; bb++)
        for (int64_t hh = 0; hh < h; hh++)
            for (int64_t ss = 0; ss < s; ss++) {
                const int64_t e = (bb * h + hh) * s + ss;
                double m = -INFINITY, sum = 0;
                for (int i = 0; i < n; i++)
                    m = fmax(m, lses[i][e]);
                for (int i = 0; i < n; i++)
                    sum += lses[i][e] == -INFINITY ? 0 : exp(lses[i][e] - m);
                want_lse[e] = m == -INFINITY ? -INFINITY : m + log(sum);
                for (int64_t c = 0; c < d; c++) {
                    double acc = 0;
                    for (int i = 0; i < n; i++)
                        if (lses[i][e] != -INFINITY)
                            acc += exp(lses[i][e] - m) / sum * tu_get(&pt[i], bb, ss, hh, c);
                    want[e * d + c] = acc;
                }
            }
    tu_tensor out_t;
    const unsigned char poison = 0x7B;
    if (!in_place)
        tu_tensor_init(&out_t, odt, b, s, h, d, 2, poison);
    fmha_tensor *out = in_place ? &parts[0] : &out_t.t;
    float *lse = in_place && index % 2 ? lses[0] : malloc(sizeof(float) * nl);
    fmha_status st = fmha_merge_partials(n, parts, (const float *const *)lses, out, lse);
    TU_CHECK(st == FMHA_STATUS_OK, "merge: %s", fmha_last_error());
    const tu_tensor *ot = in_place ? &pt[0] : &out_t;
    const double tol = odt == FMHA_DTYPE_F32 ? 2e-6 : odt == FMHA_DTYPE_F16 ? 2e-3 : 1.6e-2;
    double worst = 0, worst_lse = 0;
    int bad = 0;
    for (int64_t bb = 0; bb < b; bb++)
        for (int64_t hh = 0; hh < h; hh++)
            for (int64_t ss = 0; ss < s; ss++) {
                const int64_t e = (bb * h + hh) * s + ss;
                if (want_lse[e] == -INFINITY)
                    bad |= lse[e] != -INFINITY;
                else
                    worst_lse =
                        fmax(worst_lse, fabs(lse[e] - want_lse[e]) / fmax(1.0, fabs(want_lse[e])));
                for (int64_t c = 0; c < d; c++) {
                    const double x = tu_get(ot, bb, ss, hh, c);
                    if (!isfinite(x))
                        bad = 1;
                    else
                        worst = fmax(worst,
                                     fabs(x - want[e * d + c]) / fmax(1.0, fabs(want[e * d + c])));
                }
            }
    TU_CHECK(!bad && worst <= tol && worst_lse <= 1e-6,
             "formula case %d (%s): parts=%d %s->%s d=%lld: error %.3g (tol %.3g), lse %.3g%s",
             index, in_place ? "in place" : "out", n, fmha_dtype_name(in), fmha_dtype_name(odt),
             (long long)d, worst, tol, worst_lse, bad ? ", non-finite or wrong -inf" : "");
    if (!in_place) {
        TU_CHECK(tu_gaps_untouched(&out_t, poison), "formula case %d wrote outside out", index);
        tu_tensor_free(&out_t);
    }
    if (lse != lses[0])
        free(lse);
    for (int i = 0; i < n; i++) {
        tu_tensor_free(&pt[i]);
        free(lses[i]);
    }
    free(pt), free(parts), free(lses), free(want), free(want_lse);
}

/* Rows whose LSEs carry NaN or +inf are NaN; a row no part saw is 0, -inf;
 * a NaN element of a weighed part reaches out's same element only. */
static void test_non_finite(void)
{
    const int64_t s = 4, d = 3;
    tu_tensor p0, p1, out;
    tu_tensor_init(&p0, FMHA_DTYPE_F32, 1, s, 1, d, 0, 0);
    tu_tensor_init(&p1, FMHA_DTYPE_F32, 1, s, 1, d, 0, 0);
    tu_tensor_init(&out, FMHA_DTYPE_F32, 1, s, 1, d, 0, 0xFF);
    for (int64_t i = 0; i < s; i++)
        for (int64_t c = 0; c < d; c++) {
            tu_set(&p0, 0, i, 0, c, 1.0);
            tu_set(&p1, 0, i, 0, c, 3.0);
        }
    tu_set(&p1, 0, 3, 0, 1, NAN);
    float l0[4] = {NAN, -INFINITY, INFINITY, 0.0f}, l1[4] = {0.0f, -INFINITY, 0.0f, 0.0f};
    const float *lses[2] = {l0, l1};
    fmha_tensor parts[2] = {p0.t, p1.t};
    float lse[4];
    TU_CHECK(fmha_merge_partials(2, parts, lses, &out.t, lse) == FMHA_STATUS_OK, "%s",
             fmha_last_error());
    TU_CHECK(isnan(tu_get(&out, 0, 0, 0, 0)) && isnan(lse[0]), "NaN LSE: row NaN");
    TU_CHECK(tu_get(&out, 0, 1, 0, 2) == 0.0 && lse[1] == -INFINITY, "no key: 0, -inf");
    TU_CHECK(isnan(tu_get(&out, 0, 2, 0, 1)) && isnan(lse[2]), "+inf LSE: row NaN");
    TU_CHECK(tu_get(&out, 0, 3, 0, 0) == 2.0 && isnan(tu_get(&out, 0, 3, 0, 1)) &&
                 tu_get(&out, 0, 3, 0, 2) == 2.0 && fabsf(lse[3] - logf(2.0f)) < 1e-7f,
             "NaN element of a weighed part: its element alone (got %g %g %g, lse %g)",
             tu_get(&out, 0, 3, 0, 0), tu_get(&out, 0, 3, 0, 1), tu_get(&out, 0, 3, 0, 2),
             (double)lse[3]);
    tu_tensor_free(&p0), tu_tensor_free(&p1), tu_tensor_free(&out);
}

static void expect_refused(int n, const fmha_tensor *parts, const float *const *lses,
                           fmha_tensor *out, const tu_tensor *ot, const char *want)
{
    void *before = malloc(ot->alloc_bytes);
    memcpy(before, ot->alloc, ot->alloc_bytes);
    fmha_status st = fmha_merge_partials(n, parts, lses, out, NULL);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), want),
             "expected INVALID_ARGUMENT with \"%s\", got %s: %s", want, fmha_status_string(st),
             fmha_last_error());
    TU_CHECK(!memcmp(before, ot->alloc, ot->alloc_bytes), "refused merge wrote out (%s)", want);
    free(before);
}

static void test_refusals(void)
{
    tu_tensor p0, p1, out;
    tu_tensor_init(&p0, FMHA_DTYPE_F32, 1, 5, 2, 8, 0, 0);
    tu_tensor_init(&p1, FMHA_DTYPE_F32, 1, 5, 2, 8, 0, 0);
    tu_tensor_init(&out, FMHA_DTYPE_BF16, 1, 5, 2, 8, 0, 0x3C);
    float l[10] = {0};
    const float *lses[2] = {l, l};
    fmha_tensor parts[2] = {p0.t, p1.t};
    expect_refused(0, parts, lses, &out.t, &out, "num_parts (0) must be in [1, 32]");
    expect_refused(33, parts, lses, &out.t, &out, "num_parts (33) must be in [1, 32]");
    expect_refused(2, NULL, lses, &out.t, &out, "parts is NULL");
    expect_refused(2, parts, NULL, &out.t, &out, "lses is NULL");
    const float *one_null[2] = {l, NULL};
    expect_refused(2, parts, one_null, &out.t, &out, "lses[1] is NULL");
    fmha_tensor bad[2] = {p0.t, p1.t};
    bad[1].seqlen = 4;
    expect_refused(2, bad, lses, &out.t, &out, "parts[1]'s shape [1, 4, 2, 8] differs from out's");
    bad[1] = p1.t;
    bad[1].dtype = FMHA_DTYPE_F16;
    expect_refused(2, bad, lses, &out.t, &out, "parts[1].dtype (f16) differs from parts[0].dtype");
    bad[1] = p1.t;
    bad[1].stride_dim = 2;
    expect_refused(2, bad, lses, &out.t, &out, "parts[1].stride_dim (2) must be 1");
    fmha_tensor o = out.t;
    o.dtype = FMHA_DTYPE_F8_E4M3;
    expect_refused(2, parts, lses, &o, &out, "out.dtype (f8_e4m3) must be f32, f16 or bf16");
    o = out.t;
    o.stride_seq = 4;
    expect_refused(2, parts, lses, &o, &out, "out.stride_seq (4) is below out.head_dim (8)");
    /* Empty: nothing read or written, NULL data allowed. */
    fmha_tensor e0 = p0.t, eo = out.t;
    e0.seqlen = eo.seqlen = 0;
    e0.data = eo.data = NULL;
    const float *nolse[1] = {NULL};
    TU_CHECK(fmha_merge_partials(1, &e0, nolse, &eo, NULL) == FMHA_STATUS_OK, "empty: %s",
             fmha_last_error());
    /* The merge allocates nothing. */
    const long live = fmha_alloc_live();
    fmha_alloc_fail_after(0);
    TU_CHECK(fmha_merge_partials(2, parts, lses, &out.t, NULL) == FMHA_STATUS_OK,
             "merge with every allocation failing: %s", fmha_last_error());
    fmha_alloc_fail_after(-1);
    TU_CHECK(fmha_alloc_live() == live, "merge left allocations");
    tu_tensor_free(&p0), tu_tensor_free(&p1), tu_tensor_free(&out);
}

int main(void)
{
    tu_rng r = {26};
    const char *env = getenv("FMHA_TEST_CASES");
    const int cases = env ? atoi(env) : 60;
    for (int i = 0; i < cases; i++)
        test_split(&r, i);
    for (int i = 0; i < cases; i++)
        test_formula(&r, i, i % 4 == 3);
    test_non_finite();
    test_refusals();
    return tu_summary();
}
