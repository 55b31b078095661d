/* cases.c — the shared forward case list (see cases.h). */
#include "cases.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const int64_t seqlens[] = {1, 7, 113, 239, 64, 65, 128, 200};
static const int64_t head_dims[] = {32, 64, 80, 96, 128, 160, 192, 256, 40, 72, 33};

static void describe(const tcase *c, char *buf, size_t n)
{
    snprintf(
        buf, n,
        "%s isa=%s b=%lld sq=%lld sk=%lld h=%lld kv=%lld d=%lld dv=%lld dt=%s out=%s "
        "layouts=%d%d%d "
        "causal=%d win=(%lld,%lld) softcap=%g drop=%g varlen=%d/%d lse=%d descales=%d/%lld ramp=%d "
        "mask=%d/%d alibi=%d sinks=%d",
        c->device == FMHA_DEVICE_CUDA ? "cuda" : "cpu", fmha_cpu_isa_name(c->isa),
        (long long)c->batch, (long long)c->sq, (long long)c->sk, (long long)c->heads,
        (long long)c->kv, (long long)c->d, (long long)c->dv, fmha_dtype_name(c->dt),
        fmha_dtype_name(c->odt), c->lq, c->lkv, c->lo, c->causal, (long long)c->wl,
        (long long)c->wr, c->softcap, c->dropout, c->varlen, c->bounds, c->lse, (int)c->dl,
        (long long)c->dblock, c->ramp, c->mask, c->mask_bcast, c->alibi, c->sinks);
}

/* A case's score modifiers (tcase.mask, alibi, sinks): their buffers. */
typedef struct case_mods {
    void *mask;
    float *slopes, *sinks;
} case_mods;

/* Draws the case's modifiers into *m's buffers and sets them in the
 * arguments' fields: a mask over [batch, heads, sq, sk] (padded rows of
 * sk + 3, strides 0 where broadcast; every sequence of a packed case fits
 * it), whose boolean form keeps 3 keys in 4 and whose additive form is
 * N(0, 1.5) with 1 in 20 -inf; slopes in [-0.1, 0.5); sinks N(0, 2), the
 * last head's -inf one time in three. */
static void mods_draw(const tcase *c, tu_rng *rng, case_mods *m, fmha_attn_mask *mask,
                      const float **slopes, int64_t *slope_stride, const float **sinks)
{
    memset(m, 0, sizeof *m);
    if (c->mask) {
        const int64_t sk_stride = c->sk + 3, q_stride = c->mask_bcast & 4 ? 0 : sk_stride;
        const int64_t h_stride = c->mask_bcast & 2 ? 0 : c->sq * sk_stride;
        const int64_t b_stride = c->mask_bcast & 1 ? 0 : c->heads * c->sq * sk_stride;
        const int64_t n = c->batch * c->heads * c->sq * sk_stride;
        mask->type = (fmha_mask_type)(c->mask - 1);
        const size_t es = mask->type == FMHA_MASK_BOOL      ? 1
                          : mask->type == FMHA_MASK_ADD_F32 ? 4
                                                            : 2;
        m->mask = malloc(es * (size_t)n);
        for (int64_t e = 0; e < n; e++) {
            const int hide = tu_range(rng, mask->type == FMHA_MASK_BOOL ? 4 : 20) == 0;
            const float x = hide ? -INFINITY : (float)(1.5 * tu_normal(rng));
            switch (mask->type) {
            case FMHA_MASK_BOOL: ((unsigned char *)m->mask)[e] = (unsigned char)!hide; break;
            case FMHA_MASK_ADD_F32: ((float *)m->mask)[e] = x; break;
            case FMHA_MASK_ADD_F16: ((uint16_t *)m->mask)[e] = fmha_f32_to_f16(x); break;
            case FMHA_MASK_ADD_BF16: ((uint16_t *)m->mask)[e] = fmha_f32_to_bf16(x); break;
            }
        }
        mask->data = m->mask;
        mask->stride_batch = b_stride;
        mask->stride_head = h_stride;
        mask->stride_q = q_stride;
        mask->stride_k = 1;
    }
    if (c->alibi) {
        *slope_stride = c->alibi == 2 ? c->heads + 1 : 0;
        const int64_t n = c->alibi == 2 ? c->batch * (c->heads + 1) : c->heads;
        m->slopes = malloc(sizeof(float) * (size_t)n);
        for (int64_t e = 0; e < n; e++)
            m->slopes[e] = (float)(0.6 * tu_uniform(rng) - 0.1);
        *slopes = m->slopes;
    }
    if (c->sinks) {
        m->sinks = malloc(sizeof(float) * (size_t)c->heads);
        for (int64_t h = 0; h < c->heads; h++)
            m->sinks[h] = (float)(2.0 * tu_normal(rng));
        if (tu_range(rng, 3) == 0)
            m->sinks[c->heads - 1] = -INFINITY;
        *sinks = m->sinks;
    }
}

static void mods_free(case_mods *m)
{
    free(m->mask);
    free(m->slopes);
    free(m->sinks);
}

/* The largest finite |LSE| of the reference: about its largest score. */
static double lse_absmax(const float *ref, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(ref[i]) && fabs((double)ref[i]) > m)
            m = fabs((double)ref[i]);
    return m;
}

/* ------------------------------------------------------------------- FP8 */

/* The sequence token `tok` of tensor batch tb belongs to (0 for tokens of none). */
static int64_t seq_of(const int32_t *cu, int64_t nseq, int64_t tb, int64_t tok)
{
    if (!cu)
        return tb;
    for (int64_t b = 0; b < nseq; b++)
        if (tok >= cu[b] && tok < cu[b + 1])
            return b;
    return 0;
}

static int64_t n_blocks(const tcase *c, const fmha_tensor *t)
{
    return (t->seqlen + c->dblock - 1) / c->dblock;
}

static int64_t n_descales(const tcase *c, const fmha_tensor *t)
{
    switch (c->dl) {
    case FMHA_DESCALE_PER_KV_HEAD: return c->batch * c->kv;
    case FMHA_DESCALE_PER_BLOCK: return t->batch * t->heads * n_blocks(c, t);
    default: return 1;
    }
}

/* The descale that row (tb, tok, h) of q (which 0), k (1) or v (2) reads,
 * written out from fmha.h's description of the layouts. */
static int64_t descale_at(const tcase *c, int which, const fmha_tensor *t, const int32_t *cu,
                          int64_t tb, int64_t tok, int64_t h)
{
    switch (c->dl) {
    case FMHA_DESCALE_PER_KV_HEAD:
        return seq_of(cu, c->batch, tb, tok) * c->kv + (which == 0 ? h / (c->heads / c->kv) : h);
    case FMHA_DESCALE_PER_BLOCK: return (tb * t->heads + h) * n_blocks(c, t) + tok / c->dblock;
    default: return 0;
    }
}

typedef struct fp8_inputs {
    float *ds[3];     /* descales of q, k, v */
    tu_tensor deq[3]; /* q, k, v dequantized to f32, BSHD */
} fp8_inputs;

/* Ramp inputs (tcase.ramp): channel e < d / 2 of q is 0.5 and of k 0.7 * key
 * / keys, and q's other channels are a tenth of their random values, so every
 * row's scores climb steadily along the keys (by scale * d * 0.175 over all
 * of them) and its running max moves by small steps, tile after tile. x is
 * the random value the element would have held. */
static double ramp_value(const tcase *c, int which, int64_t tok, int64_t keys, int64_t e, double x)
{
    if (!c->ramp || which == 2)
        return x;
    if (e >= c->d / 2)
        return which == 0 ? 0.1 * x : x;
    return which == 0 ? 0.5 : 0.7 * (double)tok / (double)(keys > 1 ? keys - 1 : 1);
}

/* One descale per group, log-uniform within 4x of 3/448 (so that N(0, 1)
 * values fill the format), the codes of N(0, 1) values, and f32 copies of
 * what the codes stand for. */
static void fp8_fill(const tcase *c, tu_rng *rng, tu_tensor *xs[3], const int32_t *cus[3],
                     fp8_inputs *f)
{
    for (int i = 0; i < 3; i++) {
        const fmha_tensor *t = &xs[i]->t;
        const int64_t n = n_descales(c, t);
        f->ds[i] = malloc(sizeof(float) * (size_t)n);
        for (int64_t e = 0; e < n; e++)
            f->ds[i][e] = (float)(3.0 / 448.0 * exp2(4.0 * tu_uniform(rng) - 2.0));
        tu_tensor_init(&f->deq[i], FMHA_DTYPE_F32, t->batch, t->seqlen, t->heads, t->head_dim, 0,
                       0);
        for (int64_t tb = 0; tb < t->batch; tb++)
            for (int64_t tok = 0; tok < t->seqlen; tok++)
                for (int64_t h = 0; h < t->heads; h++) {
                    const float d = f->ds[i][descale_at(c, i, t, cus[i], tb, tok, h)];
                    uint8_t *row = (uint8_t *)xs[i]->alloc + tb * t->stride_batch +
                                   tok * t->stride_seq + h * t->stride_head;
                    float *drow = (float *)f->deq[i].alloc +
                                  ((tb * t->seqlen + tok) * t->heads + h) * t->head_dim;
                    for (int64_t e = 0; e < t->head_dim; e++) {
                        const double x = ramp_value(c, i, tok, t->seqlen, e, tu_normal(rng));
                        row[e] = fmha_f32_to_e4m3((float)x / d);
                        drow[e] = fmha_e4m3_to_f32(row[e]) * d;
                    }
                }
    }
}

static void fp8_free(fp8_inputs *f)
{
    for (int i = 0; i < 3; i++) {
        free(f->ds[i]);
        tu_tensor_free(&f->deq[i]);
    }
}

/* A packed case's cu_seqlens_q/k (malloc'd): per-sequence lengths drawn in
 * [0, sq] and [0, sk], zeros included. */
static void random_lengths(const tcase *c, tu_rng *rng, int32_t **cuq, int32_t **cuk)
{
    int32_t *q = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
    int32_t *k = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
    q[0] = k[0] = 0;
    for (int64_t b = 0; b < c->batch; b++) {
        q[b + 1] = q[b] + (int32_t)tu_range(rng, c->sq + 1);
        k[b + 1] = k[b] + (int32_t)tu_range(rng, c->sk + 1);
    }
    *cuq = q;
    *cuk = k;
}

/* The case's configuration. */
static fmha_config case_config(const tcase *c)
{
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
    cfg.device = c->device;
    return cfg;
}

int tcase_run(const tcase *c, tu_rng *rng, tcase_runner run)
{
    char desc[512];
    describe(c, desc, sizeof desc);

    fmha_config cfg = case_config(c);

    /* Varlen: random per-sequence lengths around sq / sk, zeros included. */
    int32_t *cuq = NULL, *cuk = NULL;
    int64_t tb = c->batch, tq = c->sq, tk = c->sk;
    if (c->varlen) {
        random_lengths(c, rng, &cuq, &cuk);
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
    const int f8 = c->dt == FMHA_DTYPE_F8_E4M3;
    fp8_inputs f8in;
    if (f8) {
        tu_tensor *xs[3] = {&q, &k, &v};
        const int32_t *cus[3] = {cuq, cuk, cuk};
        fp8_fill(c, rng, xs, cus, &f8in);
    } else {
        tu_fill_normal(&q, rng, 1.0);
        tu_fill_normal(&k, rng, 1.0);
        tu_fill_normal(&v, rng, 1.0);
        tu_tensor *qk[2] = {&q, &k};
        for (int i = 0; i < 2 && c->ramp; i++) {
            const fmha_tensor *t = &qk[i]->t;
            for (int64_t b = 0; b < t->batch; b++)
                for (int64_t s = 0; s < t->seqlen; s++)
                    for (int64_t h = 0; h < t->heads; h++)
                        for (int64_t e = 0; e < c->d; e++)
                            tu_set(qk[i], b, s, h, e,
                                   ramp_value(c, i, s, t->seqlen, e, tu_get(qk[i], b, s, h, e)));
        }
    }

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
    if (f8) {
        a.descale_q = f8in.ds[0];
        a.descale_k = f8in.ds[1];
        a.descale_v = f8in.ds[2];
        a.descale_layout = c->dl;
        a.descale_block_rows = c->dblock;
    }
    case_mods mods;
    mods_draw(c, rng, &mods, &a.mask, &a.alibi_slopes, &a.alibi_stride_batch, &a.sinks);
    for (int64_t b = 0; c->varlen && c->bounds && b < c->batch; b++) {
        /* bounds given: a CUDA layer reads no offset on the host (fmha.h) */
        const int64_t slack = c->bounds == 2 && !a.mask.data ? 1 + b : 0;
        if (cuq[b + 1] - cuq[b] + slack > a.max_seqlen_q)
            a.max_seqlen_q = cuq[b + 1] - cuq[b] + slack;
        if (cuk[b + 1] - cuk[b] + slack > a.max_seqlen_k)
            a.max_seqlen_k = cuk[b + 1] - cuk[b] + slack;
    }

    int ok = 1;
    double tol = 0;
    fmha_status st = run(&cfg, &a);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: forward failed: %s", desc, fmha_last_error());
    if (st != FMHA_STATUS_OK)
        ok = 0;

    fmha_forward_args ar = a;
    ar.out = ref.t;
    ar.lse = lse_ref;
    fmha_config cref = cfg;
    cref.num_threads = 0; /* the case's thread count is for the kernel under test */
    st = fmha_reference_forward(&cref, &ar);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: reference failed: %s", desc, fmha_last_error());
    fmha_forward_args an = a;
    an.out = naive.t;
    an.lse = lse_naive;
    tu_naive_forward(&cfg, &an);

    if (ok) {
        int bad = 0, nbad = 0;
        double e = tu_max_err(&out, &ref, &bad), en = tu_max_err(&naive, &ref, &nbad);
        /* With packed tensors of zero total tokens the placeholder token is not
         * part of any sequence: it must stay poisoned. */
        int empty = c->varlen && (cuq[c->batch] == 0);
        if (empty) {
            bad = 0;
            e = en = 0;
        }
        tol = 4.0 * en + 1e-6;
        TU_CHECK(!bad && e <= tol, "%s: out error %.3g > tol %.3g (naive %.3g)%s", desc, e, tol, en,
                 bad ? " non-finite output" : "");
        TU_CHECK(tu_gaps_untouched(&out, 0xFF), "%s: wrote outside the output view", desc);
        if (c->lse && !empty) {
            int lbad = 0, lnbad = 0;
            const int64_t nlse = c->varlen ? c->heads * tq : nl;
            double le = tu_lse_err(lse, lse_ref, nlse, &lbad);
            double len = tu_lse_err(lse_naive, lse_ref, nlse, &lnbad);
            /* FP8 tensor cores add up Q K^T in fewer bits than f32: each of a
             * score's D / 32 wgmma steps keeps ~2^-13 of the running sum
             * (bench/NOTES.md), so a score, and the LSE, can be off by about
             * (D / 32) 2^-13 of the largest score, which no f32 model
             * reproduces: ~1e-4 on N(0, 1) inputs, 0.0245 on ramp inputs whose
             * scores reach 56 (0.9 of that bound). */
            const double lse_floor =
                f8 && c->device == FMHA_DEVICE_CUDA
                    ? 1e-3 + 1.5 * ((double)c->d / 32.0) * 0x1p-13 * lse_absmax(lse_ref, nlse)
                    : 1e-5;
            TU_CHECK(!lbad && le <= 4.0 * len + lse_floor, "%s: lse error %.3g (naive %.3g)%s",
                     desc, le, len, lbad ? " bad -inf/non-finite" : "");
        }
        if (f8 && !empty) {
            /* The same problem on f32 inputs dequantized here: the reference
             * must agree to f32 rounding, the kernel within its tolerance. */
            tu_tensor ref32;
            tu_tensor_init(&ref32, FMHA_DTYPE_F32, tb, tq, c->heads, c->dv, 0, 0xFF);
            fmha_config c32 = cref;
            c32.dtype = FMHA_DTYPE_F32;
            fmha_forward_args a32 = a;
            a32.q = f8in.deq[0].t;
            a32.k = f8in.deq[1].t;
            a32.v = f8in.deq[2].t;
            a32.descale_q = a32.descale_k = a32.descale_v = NULL;
            a32.out = ref32.t;
            a32.lse = NULL;
            st = fmha_reference_forward(&c32, &a32);
            TU_CHECK(st == FMHA_STATUS_OK, "%s: f32 reference failed: %s", desc, fmha_last_error());
            int b32 = 0;
            double er = tu_max_err(&ref, &ref32, &b32), ek = tu_max_err(&out, &ref32, &b32);
            TU_CHECK(er <= 1e-5,
                     "%s: the reference on FP8 differs from the reference on its "
                     "dequantized f32 inputs by %.3g",
                     desc, er);
            TU_CHECK(ek <= tol + er,
                     "%s: out differs from the reference on dequantized inputs by "
                     "%.3g > tol %.3g",
                     desc, ek, tol + er);
            tu_tensor_free(&ref32);
        }
    }
    if (f8)
        fp8_free(&f8in);
    mods_free(&mods);

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

tcase tcase_random(tu_rng *r, int index, const tcase_space *space)
{
    tcase c;
    memset(&c, 0, sizeof c);
    c.device = space->device;
    c.isa = space->nisa ? space->isas[index % space->nisa] : FMHA_CPU_ISA_AUTO;
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
    static const fmha_dtype dts[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16,
                                     FMHA_DTYPE_BF16};
    c.dt = dts[tu_range(r, 4)];
    if (c.device == FMHA_DEVICE_CUDA && c.dt == FMHA_DTYPE_F32) /* CUDA takes 16-bit inputs */
        c.dt = tu_range(r, 2) ? FMHA_DTYPE_BF16 : FMHA_DTYPE_F16;
    static const fmha_dtype odts[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    c.odt = tu_range(r, 3) == 0 ? odts[tu_range(r, 3)] : c.dt;
    c.lq = (int)tu_range(r, 3);
    c.lkv = (int)tu_range(r, 3);
    c.lo = (int)tu_range(r, 3);
    c.wl = c.wr = -1;
    switch (tu_range(r, 6)) {
    case 0: c.causal = 1; break;
    case 1:
        c.wl = tu_range(r, 40);
        c.wr = tu_range(r, 3) - 1;
        break;
    case 2:
        c.causal = 1;
        c.wl = tu_range(r, 130);
        break;
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
        c.bounds = (int)((c.sq + c.sk) % 3); /* no draw: the stream of cases stays as it was */
        c.batch = 1 + tu_range(r, 4);
        c.lq = c.lq == 1 ? 0 : c.lq; /* packed tensors: contiguous or padded strides */
        c.lkv = c.lkv == 1 ? 0 : c.lkv;
        c.lo = c.lo == 1 ? 0 : c.lo;
    }
    c.lse = tu_range(r, 2);
    c.threads = (int)tu_range(r, 3);                          /* 0 = default */
    if (c.device == FMHA_DEVICE_CPU && tu_range(r, 6) == 0) { /* FP8 runs on the CPU */
        static const int64_t blocks[] = {1, 7, 64, 100};
        c.dt = FMHA_DTYPE_F8_E4M3;
        c.odt = odts[tu_range(r, 3)];
        c.dl = (fmha_descale_layout)tu_range(r, 3);
        c.dblock = blocks[tu_range(r, 4)];
    }
    if (c.device == FMHA_DEVICE_CUDA && space->fp8 && tu_range(r, 3) == 0) {
        /* Hopper FP8: TMA reads q and k, so their rows are multiples of 16 bytes
         * (v goes through a transposing copy and may have any layout). */
        static const int64_t dims16[] = {32, 64, 80, 96, 128, 160, 192, 256};
        c.dt = FMHA_DTYPE_F8_E4M3;
        c.odt = odts[tu_range(r, 3)];
        c.d = dims16[tu_range(r, 8)];
        c.lq = c.lq == 2 ? 0 : c.lq;
        c.lkv = c.lkv == 2 ? 0 : c.lkv;
        c.dl = (fmha_descale_layout)tu_range(r, 2);
    }
    /* score modifiers: CPU kernels, and the f16/bf16 CUDA forward */
    if ((c.device == FMHA_DEVICE_CPU || c.dt != FMHA_DTYPE_F8_E4M3) && tu_range(r, 4) == 0) {
        c.mask = (int)tu_range(r, 5);
        c.mask_bcast = (int)tu_range(r, 8);
        c.alibi = (int)tu_range(r, 3);
        c.sinks = c.mask == 0 && c.alibi == 0 ? 1 : (int)tu_range(r, 2);
    }
    return c;
}

void tcase_non_finite(tu_rng *r, const fmha_config *base, int64_t s, int64_t key_block,
                      tcase_runner run)
{
    const int64_t d = base->head_dim, H = 2, J = 70; /* J: a key past the first 64 */
    const fmha_dtype dt = base->dtype;
    for (int kind = 0; kind < 5; kind++) {
        fmha_config cfg = *base;
        cfg.causal = kind > 0 && kind < 4; /* rows < J do not see key J */
        tu_tensor q, k, v, o, ref;
        tu_tensor_init(&q, dt, 1, s, H, d, 0, 0);
        tu_tensor_init(&k, dt, 1, s, 1, d, 0, 0);
        tu_tensor_init(&v, dt, 1, s, 1, d, 0, 0);
        tu_tensor_init(&o, FMHA_DTYPE_F32, 1, s, H, d, 0, 0xFF);
        tu_tensor_init(&ref, FMHA_DTYPE_F32, 1, s, H, d, 0, 0);
        float *lse = malloc(sizeof(float) * (size_t)(2 * H * s)), *lse_ref = lse + H * s;
        tu_fill_normal(&q, r, 1);
        tu_fill_normal(&k, r, 1);
        tu_fill_normal(&v, r, 1);
        const char *what[5] = {"NaN in q[5, head 1]", "NaN in k[70]", "+inf in k[70, 3]",
                               "NaN in v[70, 5]", "-inf in q[5, head 1] against k > 0"};
        if (kind == 0)
            tu_set(&q, 0, 5, 1, 3, NAN);
        else if (kind == 1)
            tu_set(&k, 0, J, 0, 3, NAN);
        else if (kind == 2)
            tu_set(&k, 0, J, 0, 3, INFINITY);
        else if (kind == 3)
            tu_set(&v, 0, J, 0, 5, NAN);
        else {
            tu_set(&q, 0, 5, 1, 3, -INFINITY); /* every score of that row -inf */
            for (int64_t j = 0; j < s; j++)
                tu_set(&k, 0, j, 0, 3, 0.5 + fabs(tu_get(&k, 0, j, 0, 3)));
        }
        fmha_forward_args a = {.q = q.t, .k = k.t, .v = v.t, .out = o.t, .lse = lse};
        TU_CHECK(run(&cfg, &a) == FMHA_STATUS_OK, "%s: %s", what[kind], fmha_last_error());
        a.out = o.t; /* the runner may have pointed it elsewhere */
        a.out = ref.t;
        a.lse = lse_ref;
        TU_CHECK(fmha_reference_forward(&cfg, &a) == FMHA_STATUS_OK, "reference: %s",
                 fmha_last_error());
        const double tol = dt == FMHA_DTYPE_F32 ? 1e-4 : 5e-2;
        int64_t wrong = 0, first_i = -1, first_h = -1;
        for (int64_t i = 0; i < s; i++)
            for (int64_t h = 0; h < H; h++) {
                /* 1: the whole row must be NaN, and its LSE; 2: column 5 non-finite, the
                 * rest exact; 3: a row of weightless keys, 0 with LSE -inf; 0: exact;
                 * 4: column 5 not checked, the rest exact (rows before J whose key
                 * block holds J: their weight 0 times NaN, kind 3) */
                int want = 0;
                if (kind == 0 && i == 5 && h == 1)
                    want = 1;
                if (kind == 1 && i >= J)
                    want = 1;
                if (kind == 2 && i >= J && tu_get(&q, 0, i, h, 3) > 0)
                    want = 1; /* +inf score; q < 0 gives -inf: weight 0 */
                if (kind == 3 && i >= J)
                    want = 2;
                if (kind == 3 && i < J && i / key_block == J / key_block)
                    want = 4;
                if (kind == 4 && i == 5 && h == 1)
                    want = 3;
                int ok = 1;
                for (int64_t c = 0; c < d; c++) {
                    const double x = tu_get(&o, 0, i, h, c), y = tu_get(&ref, 0, i, h, c);
                    if (want == 1)
                        ok &= isnan(x) && isnan(y);
                    else if (want == 2 && c == 5)
                        ok &= !isfinite(x) && !isfinite(y);
                    else if (want == 3)
                        ok &= x == 0 && y == 0;
                    else if (want == 4 && c == 5)
                        continue;
                    else
                        ok &= isfinite(x) && fabs(x - y) <= tol;
                }
                const float l = lse[h * s + i], lr = lse_ref[h * s + i];
                if (want == 1)
                    ok &= isnan(l) && isnan(lr);
                else if (want == 3)
                    ok &= l == -INFINITY && lr == -INFINITY;
                else if (want == 0 || want == 4)
                    ok &= fabs(l - lr) <= 1e-3 * (1 + fabs(lr));
                if (!ok && wrong++ == 0)
                    first_i = i, first_h = h;
            }
        /* check_finite refuses the same inputs, naming the value, and writes nothing */
        const char *expect[5] = {"q holds 1 NaN or inf value, the first at [batch, seq, head, "
                                 "channel] = [0, 5, 1, 3]",
                                 "k holds 1 NaN or inf value, the first at [batch, seq, head, "
                                 "channel] = [0, 70, 0, 3]",
                                 "k holds 1 NaN or inf value, the first at [batch, seq, head, "
                                 "channel] = [0, 70, 0, 3]",
                                 "v holds 1 NaN or inf value, the first at [batch, seq, head, "
                                 "channel] = [0, 70, 0, 5]",
                                 "q holds 1 NaN or inf value, the first at [batch, seq, head, "
                                 "channel] = [0, 5, 1, 3]"};
        tu_tensor o2;
        tu_tensor_init(&o2, FMHA_DTYPE_F32, 1, s, H, d, 0, 0xFF);
        fmha_config checked = cfg;
        checked.check_finite = 1;
        a.out = o2.t;
        fmha_status st = run(&checked, &a);
        TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), expect[kind]) &&
                     tu_gaps_untouched(&o2, 0xFF) && isnan(tu_get(&o2, 0, 0, 0, 0)),
                 "check_finite, %s: %s (%s), expected \"%s\" with out untouched", what[kind],
                 fmha_status_string(st), fmha_last_error(), expect[kind]);
        tu_tensor_free(&o2);
        TU_CHECK(wrong == 0,
                 "%s, isa %s, %s inputs, %s: %lld rows break the policy (first: row %lld "
                 "head %lld)",
                 cfg.device == FMHA_DEVICE_CUDA ? "cuda" : "cpu", fmha_cpu_isa_name(cfg.cpu_isa),
                 fmha_dtype_name(dt), what[kind], (long long)wrong, (long long)first_i,
                 (long long)first_h);
        tu_tensor_free(&q);
        tu_tensor_free(&k);
        tu_tensor_free(&v);
        tu_tensor_free(&o);
        tu_tensor_free(&ref);
        free(lse);
    }
}

/* ------------------------------------------------------------ backward */

static double bwd_max_abs(const tu_tensor *x)
{
    double m = 0;
    const fmha_tensor *t = &x->t;
    for (int64_t b = 0; b < t->batch; b++)
        for (int64_t s = 0; s < t->seqlen; s++)
            for (int64_t h = 0; h < t->heads; h++)
                for (int64_t c = 0; c < t->head_dim; c++)
                    m = fmax(m, fabs(tu_get(x, b, s, h, c)));
    return m;
}

static void bwd_describe(const tcase *c, fmha_dtype gdt, int want, char *buf, size_t n)
{
    snprintf(buf, n,
             "%s b=%lld sq=%lld sk=%lld h=%lld kv=%lld d=%lld dv=%lld dt=%s out=%s grad=%s "
             "layouts=%d%d%d causal=%d win=(%lld,%lld) softcap=%g drop=%g scale=%g varlen=%d "
             "threads=%d want=%d mask=%d/%d alibi=%d sinks=%d",
             c->device == FMHA_DEVICE_CPU ? fmha_cpu_isa_name(c->isa) : "cuda", (long long)c->batch,
             (long long)c->sq, (long long)c->sk, (long long)c->heads, (long long)c->kv,
             (long long)c->d, (long long)c->dv, fmha_dtype_name(c->dt), fmha_dtype_name(c->odt),
             fmha_dtype_name(gdt), c->lq, c->lkv, c->lo, c->causal, (long long)c->wl,
             (long long)c->wr, c->softcap, c->dropout, c->scale, c->varlen, c->threads, want,
             c->mask, c->mask_bcast, c->alibi, c->sinks);
}

/* dsinks against the reference's, within a relative 2^-7 (16-bit out; f32
 * out 1e-5) of the sum of the terms' sizes, sum |e^(sink - lse) (dout . out)|,
 * plus 1e-5. */
static void check_dsinks(const tcase *c, const char *desc, const fmha_backward_args *a,
                         const tu_tensor *out, const tu_tensor *dout, const float *dsinks,
                         const float *ref)
{
    for (int64_t h = 0; h < c->heads; h++) {
        double size = 0;
        const int64_t nseq = a->cu_seqlens_q ? c->batch : a->q.batch;
        for (int64_t b = 0; b < nseq && a->sinks[h] != -INFINITY; b++) {
            const int64_t q0 = a->cu_seqlens_q ? a->cu_seqlens_q[b] : 0;
            const int64_t sq = a->cu_seqlens_q ? a->cu_seqlens_q[b + 1] - q0 : a->q.seqlen;
            const int64_t tb = a->cu_seqlens_q ? 0 : b;
            for (int64_t i = 0; i < sq; i++) {
                const int64_t at =
                    a->cu_seqlens_q ? h * a->q.seqlen + q0 + i : (b * c->heads + h) * sq + i;
                double dot = 0;
                for (int64_t e = 0; e < c->dv; e++)
                    dot += fabs(tu_get(out, tb, q0 + i, h, e) * tu_get(dout, tb, q0 + i, h, e));
                size += exp((double)a->sinks[h] - a->lse[at]) * dot;
            }
        }
        const double rel = c->odt == FMHA_DTYPE_F32 ? 1e-5 : 0x1p-7;
        const double err = fabs((double)dsinks[h] - ref[h]), tol = rel * size + 1e-5;
        TU_CHECK(err <= tol, "%s: dsinks[%lld] = %g, reference %g (error %.3g > tol %.3g)", desc,
                 (long long)h, (double)dsinks[h], (double)ref[h], err, tol);
    }
}

double tcase_backward_run(const tcase *c, fmha_dtype gdt, int lg, int want, int operands16,
                          tbwd_runner run, tu_rng *rng)
{
    char desc[640];
    bwd_describe(c, gdt, want, desc, sizeof desc);
    fmha_config cfg = case_config(c);

    int32_t *cuq = NULL, *cuk = NULL;
    int64_t tb = c->batch, tq = c->sq, tk = c->sk;
    if (c->varlen) { /* random lengths, zeros included, and a tail of tokens in no sequence */
        random_lengths(c, rng, &cuq, &cuk);
        tb = 1;
        tq = cuq[c->batch] + 2;
        tk = cuk[c->batch] + 1;
    }
    tu_tensor q, k, v, out, dout, g[3], ref[3], naive[3];
    tu_tensor_init(&q, c->dt, tb, tq, c->heads, c->d, c->lq, 0xA5);
    tu_tensor_init(&k, c->dt, tb, tk, c->kv, c->d, c->lkv, 0xA5);
    tu_tensor_init(&v, c->dt, tb, tk, c->kv, c->dv, c->lkv, 0xA5);
    tu_tensor_init(&out, c->odt, tb, tq, c->heads, c->dv, c->lo, 0);
    tu_tensor_init(&dout, gdt, tb, tq, c->heads, c->dv, c->lo, 0xA5);
    tu_fill_normal(&q, rng, 1.0);
    tu_fill_normal(&k, rng, 1.0);
    tu_fill_normal(&v, rng, 1.0);
    tu_fill_normal(&dout, rng, 1.0);
    const tu_tensor *in[3] = {&q, &k, &v};
    for (int i = 0; i < 3; i++) {
        const fmha_tensor *t = &in[i]->t;
        tu_tensor_init(&g[i], gdt, t->batch, t->seqlen, t->heads, t->head_dim, lg, 0xFF);
        tu_tensor_init(&ref[i], FMHA_DTYPE_F32, t->batch, t->seqlen, t->heads, t->head_dim, 0,
                       0xFF);
        tu_tensor_init(&naive[i], gdt, t->batch, t->seqlen, t->heads, t->head_dim, 0, 0xFF);
    }
    float *lse = malloc(sizeof(float) * (size_t)(c->heads * tq * tb));

    fmha_forward_args fa = {.q = q.t, .k = k.t, .v = v.t, .out = out.t, .lse = lse};
    fa.cu_seqlens_q = cuq;
    fa.cu_seqlens_k = cuk;
    fa.varlen_batch = c->varlen ? c->batch : 0;
    fa.seed = tu_next(rng);
    fa.offset = tu_next(rng);
    case_mods mods;
    mods_draw(c, rng, &mods, &fa.mask, &fa.alibi_slopes, &fa.alibi_stride_batch, &fa.sinks);
    float *dsinks = malloc(sizeof(float) * (size_t)c->heads);
    float *dsinks_ref = malloc(sizeof(float) * (size_t)c->heads);
    memset(dsinks, 0xFF, sizeof(float) * (size_t)c->heads);
    fmha_config fcfg = cfg; /* out and lse from the CPU forward (the case's ISA) */
    fcfg.device = FMHA_DEVICE_CPU;
    fmha_status st = fmha_forward(&fcfg, &fa);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: forward: %s", desc, fmha_last_error());

    fmha_backward_args ba = {
        .q = q.t, .k = k.t, .v = v.t, .out = out.t, .dout = dout.t, .lse = lse};
    ba.cu_seqlens_q = cuq;
    ba.cu_seqlens_k = cuk;
    ba.varlen_batch = fa.varlen_batch;
    ba.seed = fa.seed;
    ba.offset = fa.offset;
    ba.mask = fa.mask;
    ba.alibi_slopes = fa.alibi_slopes;
    ba.alibi_stride_batch = fa.alibi_stride_batch;
    ba.sinks = fa.sinks;
    ba.dsinks = fa.sinks ? dsinks : NULL;
    fmha_tensor *gt[3] = {&ba.dq, &ba.dk, &ba.dv};
    for (int i = 0; i < 3; i++)
        *gt[i] = want >> i & 1 ? g[i].t : (fmha_tensor){0};
    st = run(&cfg, &ba);
    TU_CHECK(st == FMHA_STATUS_OK, "%s: backward: %s", desc, fmha_last_error());

    fmha_backward_args rb = ba, nb = ba;
    fmha_tensor *rt[3] = {&rb.dq, &rb.dk, &rb.dv}, *nt[3] = {&nb.dq, &nb.dk, &nb.dv};
    for (int i = 0; i < 3; i++) {
        *rt[i] = ref[i].t;
        *nt[i] = naive[i].t;
    }
    rb.dsinks = fa.sinks ? dsinks_ref : NULL;
    nb.dsinks = NULL;
    fmha_config cref = cfg;
    cref.num_threads = 0;
    cref.device = FMHA_DEVICE_CPU;
    TU_CHECK(fmha_reference_backward(&cref, &rb) == FMHA_STATUS_OK, "%s: reference: %s", desc,
             fmha_last_error());
    tu_naive_backward(&cref, &nb, operands16);

    double worst = 0, largest = 0;
    const char *names[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; i++)
        largest = fmax(largest, bwd_max_abs(&ref[i]));
    for (int i = 0; i < 3 && st == FMHA_STATUS_OK; i++) {
        if (!(want >> i & 1)) {
            TU_CHECK(tu_gaps_untouched(&g[i], 0xFF) && isnan(tu_get(&g[i], 0, 0, 0, 0)),
                     "%s: %s was not wanted but written", desc, names[i]);
            continue;
        }
        int bad = 0, nbad = 0;
        const double e = tu_max_err(&g[i], &ref[i], &bad);
        const double en = tu_max_err(&naive[i], &ref[i], &nbad);
        /* 2x the naive error, and a floor: 1e-5, and an f32 rounding or so of the largest
         * gradient of the three (where a gradient is 0 the naive one can be exactly 0 while
         * the kernel's is the rounding of dP - D summed over rows, e.g. dk of one key: P = 1) */
        const double tol = 2.0 * en + 1e-5 + 1e-6 * largest;
        worst = fmax(worst, e / tol);
        if (getenv("FMHA_TEST_VERBOSE"))
            printf("%s: %s error %.3g naive %.3g tol %.3g\n", desc, names[i], e, en, tol);
        TU_CHECK(!bad && !nbad && e <= tol, "%s: %s error %.3g > tol %.3g (naive %.3g)%s", desc,
                 names[i], e, tol, en, bad || nbad ? " non-finite" : "");
        TU_CHECK(tu_gaps_untouched(&g[i], 0xFF), "%s: wrote outside the %s view", desc, names[i]);
    }
    if (fa.sinks && st == FMHA_STATUS_OK)
        check_dsinks(c, desc, &ba, &out, &dout, dsinks, dsinks_ref);
    mods_free(&mods);
    free(dsinks);
    free(dsinks_ref);
    for (int i = 0; i < 3; i++) {
        tu_tensor_free(&g[i]);
        tu_tensor_free(&ref[i]);
        tu_tensor_free(&naive[i]);
    }
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&dout);
    free(lse);
    free(cuq);
    free(cuk);
    return worst;
}

/* tcase_random's forward cases made backward ones: no FP8 (no backward). */
tcase tcase_backward_random(tu_rng *r, int index, const tcase_space *space, fmha_dtype *gdt,
                            int *lg, int *want)
{
    static const fmha_dtype dts[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16};
    tcase c = tcase_random(r, index, space);
    if (c.dt == FMHA_DTYPE_F8_E4M3)
        c.dt = dts[tu_range(r, 3)];
    *gdt = tu_range(r, 2) ? c.dt : dts[tu_range(r, 3)];
    *lg = (int)tu_range(r, 3);
    if (c.varlen && *lg == 1)
        *lg = 0;
    *want = tu_range(r, 5) == 0 ? 1 + (int)tu_range(r, 6) : 7;
    return c;
}
