/* cpu_ops_f32.h — the f32 mainloop micro-kernels (qk, pv, softmax, softcap, and
 * the backward's exp_cols/rows, ds_cols/rows, softcap_grad),
 * written once over a small vector vocabulary and included by each SIMD ISA
 * file (cpu_ops_avx2.c, cpu_ops_avx512.c), which defines the vocabulary first:
 *   V, VL, VLOAD, VSTORE, VSET1, VZERO, VFMA(a, b, c) = a * b + c, VMUL, VADD,
 *   VSUB, VMAX, VMIN (x86's: the second operand where either is NaN), VDIV,
 *   VEXP2 (2^x, exactly 0 for x < -126),
 *   VIS_NEG_INF(x), VIS_NEGATIVE(x) -> masks for VSELECT(mask, if_true, if_false),
 *   QK_MR/QK_NV (keys x query-vectors per qk register tile),
 *   PV_MR/PV_NV (queries x value-vectors per pv register tile).
 * Tile contracts are in cpu.h. */

#define INLINE static inline __attribute__((always_inline))

enum { T_BR = FMHA_CPU_BR };

/* An mr x nv register tile of st: keys j0.., query vectors x0... */
INLINE void qk_tile(const float *k, int64_t ks, const float *qt, int64_t d, float *st, int j0,
                    int x0, const int mr, const int nv)
{
    V acc[QK_MR][QK_NV];
    for (int r = 0; r < mr; r++)
        for (int x = 0; x < nv; x++)
            acc[r][x] = VZERO();
    const float *kr = k + (int64_t)j0 * ks;
    for (int64_t c = 0; c < d; c++) {
        V q[QK_NV];
        for (int x = 0; x < nv; x++)
            q[x] = VLOAD(qt + c * T_BR + (x0 + x) * VL);
        for (int r = 0; r < mr; r++) {
            V kb = VSET1(kr[r * ks + c]);
            for (int x = 0; x < nv; x++)
                acc[r][x] = VFMA(kb, q[x], acc[r][x]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int x = 0; x < nv; x++)
            VSTORE(st + (j0 + r) * T_BR + (x0 + x) * VL, acc[r][x]);
}

/* All keys against query vectors [x0, x0 + nv); nv is a compile-time count. */
INLINE void qk_columns(const float *k, int64_t ks, int nj, const float *qt, int64_t d, float *st,
                       int x0, const int nv)
{
    int j = 0;
    for (; j + QK_MR <= nj; j += QK_MR)
        qk_tile(k, ks, qt, d, st, j, x0, QK_MR, nv);
    for (; j < nj; j++)
        qk_tile(k, ks, qt, d, st, j, x0, 1, nv);
}

static void qk(const void *kv, int64_t ks, int nj, int nq, const void *qtv, int64_t d, float *st)
{
    const float *k = kv, *qt = qtv;
    const int nvq = nq / VL;
    int x0 = 0;
    for (; x0 + QK_NV <= nvq; x0 += QK_NV)
        qk_columns(k, ks, nj, qt, d, st, x0, QK_NV);
    for (; x0 < nvq; x0++) /* short tasks: one query vector at a time */
        qk_columns(k, ks, nj, qt, d, st, x0, 1);
}

/* An mr x nv register tile of o: queries i0.., value columns c0... */
INLINE void pv_tile(const float *p, int nj, const float *v, int64_t dvp, const float *alpha,
                    float *o, int i0, int64_t c0, const int mr, const int nv)
{
    V acc[PV_MR][PV_NV];
    for (int r = 0; r < mr; r++) {
        V a = VSET1(alpha[i0 + r]);
        for (int x = 0; x < nv; x++)
            acc[r][x] = VMUL(a, VLOAD(o + (i0 + r) * dvp + c0 + x * VL));
    }
    for (int j = 0; j < nj; j++) {
        V vv[PV_NV];
        for (int x = 0; x < nv; x++)
            vv[x] = VLOAD(v + j * dvp + c0 + x * VL);
        for (int r = 0; r < mr; r++) {
            V pb = VSET1(p[j * T_BR + i0 + r]);
            for (int x = 0; x < nv; x++)
                acc[r][x] = VFMA(pb, vv[x], acc[r][x]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int x = 0; x < nv; x++)
            VSTORE(o + (i0 + r) * dvp + c0 + x * VL, acc[r][x]);
}

/* Rows in blocks of PV_MR, then one at a time; nv is a compile-time count. */
INLINE void pv_columns(const float *p, int nj, int nq, const float *v, int64_t dvp,
                       const float *alpha, float *o, int64_t c0, const int nv)
{
    int i = 0;
    for (; i + PV_MR <= nq; i += PV_MR)
        pv_tile(p, nj, v, dvp, alpha, o, i, c0, PV_MR, nv);
    for (; i < nq; i++)
        pv_tile(p, nj, v, dvp, alpha, o, i, c0, 1, nv);
}

static void pv(const void *pv_, int nj, int nq, const void *vv, int64_t dvp, const float *alpha,
               float *o)
{
    const float *p = pv_, *v = vv;
    int64_t c0 = 0;
    for (; c0 + PV_NV * VL <= dvp; c0 += PV_NV * VL)
        pv_columns(p, nj, nq, v, dvp, alpha, o, c0, PV_NV);
    for (; c0 < dvp; c0 += VL)
        pv_columns(p, nj, nq, v, dvp, alpha, o, c0, 1);
}

/* s * scale, rounded on its own: the maximum and the subtraction must see the
 * same values, so that x - max <= 0 exactly. Fused into the subtraction (the
 * compiler contracts mul + sub into an FMA), the product's rounding remainder
 * left the maximum 2^remainder, which overflows once scores pass ~2^30 and
 * zeroed rows. The empty asm hides the product from that contraction at no
 * cost; storing the scaled scores instead cost 6% on bf16 inputs. */
INLINE V scaled(V s, V scale)
{
    V x = VMUL(s, scale);
    __asm__("" : "+v"(x));
    return x;
}

static void softmax(float *st, int nj, int nq, float scale, float *m, float *l, float *alpha)
{
    const V vscale = VSET1(scale);
    for (int x = 0; x < nq / VL; x++) {
        float *col = st + x * VL;
        const V m_old = VLOAD(m + x * VL);
        V mx = m_old;
        for (int j = 0; j < nj; j++)
            mx = VMAX(mx, scaled(VLOAD(col + j * T_BR), vscale));
        /* A query with no visible key yet keeps m = -inf; use base 0 so every
         * term is 2^-inf = 0 instead of NaN. */
        const V base = VSELECT(VIS_NEG_INF(mx), VZERO(), mx);
        V sum = VZERO();
        for (int j = 0; j < nj; j++) {
            V pj = VEXP2(VSUB(scaled(VLOAD(col + j * T_BR), vscale), base));
            VSTORE(col + j * T_BR, pj);
            sum = VADD(sum, pj);
        }
        const V a = VEXP2(VSUB(m_old, base));
        VSTORE(alpha + x * VL, a);
        VSTORE(l + x * VL, VFMA(VLOAD(l + x * VL), a, sum));
        VSTORE(m + x * VL, mx);
    }
}

/* cap * tanh(s * scale / cap) * log2(e), with tanh(y) = sign(y) (1 - e) / (1 + e),
 * e = 2^(-2 |y| log2(e)) in (0, 1], which neither overflows nor loses sign. */
static void softcap(float *st, int nj, int nq, float scale, float cap)
{
    const V to_y = VSET1(scale / cap), out = VSET1(cap * 1.4426950408889634f);
    const V m2log2e = VSET1(-2.0f * 1.4426950408889634f), one = VSET1(1.0f);
    const V zero = VZERO();
    for (int64_t e = 0; e < (int64_t)nj * T_BR; e += VL) {
        if (e % T_BR >= nq)
            continue;
        V y = VMUL(VLOAD(st + e), to_y);
        V ay = VMAX(y, VSUB(zero, y));
        V ex = VEXP2(VMUL(ay, m2log2e));
        V t = VDIV(VSUB(one, ex), VADD(one, ex));
        t = VSELECT(VIS_NEGATIVE(y), VSUB(zero, t), t);
        VSTORE(st + e, VMUL(t, out));
    }
}

/* ---------------------------------------------------------------- backward */

/* 2^min(x * scale - lse, 0): x * scale <= lse up to the LSE's own rounding,
 * and past it (scores near 2^30 and beyond, whose f32 LSE is off by more
 * than 128) VEXP2's exponent would overflow into garbage; P <= 1 keeps such
 * rows finite. NaN stays NaN (VMIN's second operand). */
INLINE V p_of(V x, V scale, V lse)
{
    return VEXP2(VMIN(VZERO(), VSUB(VMUL(x, scale), lse)));
}

static void exp_cols(float *st, int nr, int nc, float scale, const float *lse)
{
    const V vs = VSET1(scale);
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nc / VL; x++) {
            float *e = st + r * T_BR + x * VL;
            VSTORE(e, p_of(VLOAD(e), vs, VLOAD(lse + x * VL)));
        }
}

static void exp_rows(float *st, int nr, int nc, float scale, const float *lse)
{
    const V vs = VSET1(scale);
    for (int r = 0; r < nr; r++) {
        const V b = VSET1(lse[r]);
        for (int x = 0; x < nc / VL; x++) {
            float *e = st + r * T_BR + x * VL;
            VSTORE(e, p_of(VLOAD(e), vs, b));
        }
    }
}

static void ds_cols(float *p, const float *dp, int nr, int nc, const float *D)
{
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nc / VL; x++) {
            float *e = p + r * T_BR + x * VL;
            const V g = VSUB(VLOAD(dp + r * T_BR + x * VL), VLOAD(D + x * VL));
            VSTORE(e, VMUL(VLOAD(e), g));
        }
}

static void ds_rows(float *p, const float *dp, int nr, int nc, const float *D)
{
    for (int r = 0; r < nr; r++) {
        const V b = VSET1(D[r]);
        for (int x = 0; x < nc / VL; x++) {
            float *e = p + r * T_BR + x * VL;
            VSTORE(e, VMUL(VLOAD(e), VSUB(VLOAD(dp + r * T_BR + x * VL), b)));
        }
    }
}

static void softcap_grad(float *ds, const float *t, int nr, int nc, float k)
{
    const V vk = VSET1(k), one = VSET1(1.0f);
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nc / VL; x++) {
            float *e = ds + r * T_BR + x * VL;
            const V y = VMUL(VLOAD(t + r * T_BR + x * VL), vk);
            VSTORE(e, VMUL(VLOAD(e), VSUB(one, VMUL(y, y))));
        }
}

#undef INLINE
