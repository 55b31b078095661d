/* cpu_ops_avx512.c — AVX-512 micro-kernels: the f32 ones (cpu_ops_f32.h over
 * 16-lane vectors, cpu_ops_io.h over this file's to_f32) and, for bf16 inputs
 * on CPUs with AVX512_BF16, the bf16 pair kernels built on vdpbf16ps (two
 * products per lane per instruction), whose loads pair the rows themselves,
 * and decode's row products on those pairs. Compiled with AVX-512 flags;
 * called only after cpuid.c found the ISA. */
#include "cpu.h"

#include <immintrin.h>

/* 2^x by 2^round(x) * p(x - round(x)), p a degree-6 polynomial on [-1/2, 1/2]
 * (relative error ~1e-7). x < -126 gives exactly 0, so a masked score (-inf)
 * adds nothing to a row's sum; NaN gives NaN (an unordered compare, and NaN
 * as max's second operand), as the non-finite policy needs
 * (docs/reliability.md): it was 0, which turned a NaN row into zeros. */
static inline __m512 exp2_avx512(__m512 x)
{
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-127.0f), x);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, p, n);
}

#define V                   __m512
#define VL                  16
#define VLOAD               _mm512_loadu_ps
#define VSTORE              _mm512_storeu_ps
#define VSET1               _mm512_set1_ps
#define VZERO               _mm512_setzero_ps
#define VFMA                _mm512_fmadd_ps
#define VMUL                _mm512_mul_ps
#define VADD                _mm512_add_ps
#define VSUB                _mm512_sub_ps
#define VMAX                _mm512_max_ps
#define VMIN                _mm512_min_ps
#define VDIV                _mm512_div_ps
#define VEXP2               exp2_avx512
#define VIS_NEG_INF(x)      _mm512_cmp_ps_mask((x), _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ)
#define VIS_NEGATIVE(x)     _mm512_cmp_ps_mask((x), _mm512_setzero_ps(), _CMP_LT_OQ)
#define VSELECT(mask, t, f) _mm512_mask_blend_ps((mask), (f), (t))
#define QK_MR               6 /* 24 accumulators + 4 query vectors + 1 broadcast of 32 registers */
#define QK_NV               4
#define PV_MR               6
#define PV_NV               4
#include "cpu_ops_f32.h"

/* e4m3 codes (in 32-bit lanes) as f32 times descale: E > 0 by moving the
 * exponent and mantissa into place (bias 7 -> 127), E = 0 (subnormal) as
 * M * 2^-9, both exact before the one rounding of the descale; 0x7F/0xFF
 * are NaN. Arithmetic on normal floats only, so DAZ/FTZ settings do not
 * change the values. */
static inline __m512 e4m3_avx512(__m512i x, __m512 descale)
{
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    const __m512 normal = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    __m512 f =
        _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
    f = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
    f = _mm512_mul_ps(f, descale);
    return _mm512_mask_mov_ps(f, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                              _mm512_set1_ps(__builtin_nanf("")));
}

static void to_f32(float *dst, const void *src, fmha_dtype dtype, int64_t n, float descale)
{
    int64_t i = 0;
    switch (dtype) {
    case FMHA_DTYPE_F8_E4M3:
        for (; i < n; i += 16) {
            __mmask16 mk = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
            __m128i b = _mm_maskz_loadu_epi8(mk, (const uint8_t *)src + i);
            _mm512_mask_storeu_ps(dst + i, mk,
                                  e4m3_avx512(_mm512_cvtepu8_epi32(b), _mm512_set1_ps(descale)));
        }
        return;
    case FMHA_DTYPE_F32: memcpy(dst, src, (size_t)n * 4); return;
    case FMHA_DTYPE_BF16:
        for (; i < n; i += 16) {
            __mmask16 mk = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
            __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)src + i);
            __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_mask_storeu_ps(dst + i, mk, _mm512_castsi512_ps(w));
        }
        return;
    case FMHA_DTYPE_F16:
        for (; i < n; i += 16) {
            __mmask16 mk = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
            __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)src + i);
            _mm512_mask_storeu_ps(dst + i, mk, _mm512_cvtph_ps(h));
        }
        return;
    default: return;
    }
}

#include "cpu_ops_io.h"

/* Channels [c, c + 16) of an f32, f16 or bf16 row as f32. */
static inline __m512 loadx_avx512(const char *row, fmha_dtype dt, int64_t c)
{
    const uint16_t *h = (const uint16_t *)row + c;
    switch (dt) {
    case FMHA_DTYPE_BF16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
    case FMHA_DTYPE_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
    case FMHA_DTYPE_F8_E4M3: /* the codes' values; the caller applies the row's descale */
        return e4m3_avx512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c))),
                           _mm512_set1_ps(1.0f));
    default: return _mm512_loadu_ps((const float *)row + c);
    }
}

/* out[0..3] = the lane sums of a, b, c, d: their 256-bit halves added,
 * then AVX's pairwise sums. */
static inline void hsum4_avx512(__m512 a, __m512 b, __m512 c, __m512 d, float *out)
{
#define FMHA_HALVES(x) _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1))
    const __m256 ab = _mm256_hadd_ps(FMHA_HALVES(a), FMHA_HALVES(b));
    const __m256 cd = _mm256_hadd_ps(FMHA_HALVES(c), FMHA_HALVES(d));
#undef FMHA_HALVES
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

#define VHSUM4 hsum4_avx512
#define VLOADX loadx_avx512
#define VHSUM  _mm512_reduce_add_ps
#include "cpu_ops_rows.h"

const fmha_cpu_ops fmha_ops_cpu_avx512_f32 = {
    .lanes = VL,
    .elem = 4,
    .pack_q = pack_q,
    .load_k = load_k,
    .load_v = load_v,
    .qk = qk,
    .softcap = softcap,
    .softmax = softmax,
    .pack_p = pack_p,
    .pv = pv,
    .store = store,
    .row_qk = row_qk,
    .row_pv = row_pv,
    .load_rows = load_rows,
    .pack_rows_t = pack_rows_t,
    .exp_cols = exp_cols,
    .exp_rows = exp_rows,
    .ds_cols = ds_cols,
    .ds_rows = ds_rows,
    .softcap_grad = softcap_grad,
};

/* ------------------------------------------------------------ bf16 pairs */

enum { BR = FMHA_CPU_BR };

static inline __m512i bcast_pair(const uint16_t *p)
{
    int32_t w;
    memcpy(&w, p, 4); /* rows may sit at odd element strides */
    return _mm512_set1_epi32(w);
}

__attribute__((target("avx512bf16"))) static inline __m512 dp(__m512 acc, __m512i a, __m512i b)
{
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* st[j][i] = sum over pairs c of k[j][2c..2c+1] . qt[c][i][0..1] */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
qk_bf16_tile(const uint16_t *k, int64_t ks, const uint16_t *qt, int64_t d, float *st, int j0,
             int x0, const int mr, const int nv)
{
    __m512 acc[6][4];
    for (int r = 0; r < mr; r++)
        for (int x = 0; x < nv; x++)
            acc[r][x] = _mm512_setzero_ps();
    const uint16_t *kr = k + (int64_t)j0 * ks;
    for (int64_t c = 0; c < (d + 1) / 2; c++) {
        __m512i q[4];
        for (int x = 0; x < nv; x++)
            q[x] = _mm512_loadu_si512(qt + (c * BR + (x0 + x) * 16) * 2);
        for (int r = 0; r < mr; r++) {
            __m512i kb = bcast_pair(kr + r * ks + 2 * c);
            for (int x = 0; x < nv; x++)
                acc[r][x] = dp(acc[r][x], kb, q[x]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int x = 0; x < nv; x++)
            _mm512_storeu_ps(st + (j0 + r) * BR + (x0 + x) * 16, acc[r][x]);
}

__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
qk_bf16_columns(const uint16_t *k, int64_t ks, int nj, const uint16_t *qt, int64_t d, float *st,
                int x0, const int nv)
{
    int j = 0;
    for (; j + 6 <= nj; j += 6)
        qk_bf16_tile(k, ks, qt, d, st, j, x0, 6, nv);
    for (; j < nj; j++)
        qk_bf16_tile(k, ks, qt, d, st, j, x0, 1, nv);
}

__attribute__((target("avx512bf16"))) static void
qk_bf16(const void *kv, int64_t ks, int nj, int nq, const void *qtv, int64_t d, float *st)
{
    const uint16_t *k = kv, *qt = qtv;
    const int nvq = nq / 16;
    int x0 = 0;
    for (; x0 + 4 <= nvq; x0 += 4)
        qk_bf16_columns(k, ks, nj, qt, d, st, x0, 4);
    for (; x0 < nvq; x0++)
        qk_bf16_columns(k, ks, nj, qt, d, st, x0, 1);
}

/* o[i][c] = alpha[i] o[i][c] + sum over pairs j of p2[j][i][0..1] . v2[j][c][0..1] */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
pv_bf16_tile(const uint16_t *p2, int njp, const uint16_t *v2, int64_t dvp, const float *alpha,
             float *o, int i0, int64_t c0, const int mr, const int nv)
{
    __m512 acc[6][4];
    for (int r = 0; r < mr; r++) {
        __m512 a = _mm512_set1_ps(alpha[i0 + r]);
        for (int x = 0; x < nv; x++)
            acc[r][x] = _mm512_mul_ps(a, _mm512_loadu_ps(o + (i0 + r) * dvp + c0 + x * 16));
    }
    for (int j = 0; j < njp; j++) {
        __m512i vv[4];
        for (int x = 0; x < nv; x++)
            vv[x] = _mm512_loadu_si512(v2 + (j * dvp + c0 + x * 16) * 2);
        for (int r = 0; r < mr; r++) {
            __m512i pb = bcast_pair(p2 + (j * BR + i0 + r) * 2);
            for (int x = 0; x < nv; x++)
                acc[r][x] = dp(acc[r][x], pb, vv[x]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int x = 0; x < nv; x++)
            _mm512_storeu_ps(o + (i0 + r) * dvp + c0 + x * 16, acc[r][x]);
}

__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
pv_bf16_columns(const uint16_t *p2, int njp, int nq, const uint16_t *v2, int64_t dvp,
                const float *alpha, float *o, int64_t c0, const int nv)
{
    int i = 0;
    for (; i + 6 <= nq; i += 6)
        pv_bf16_tile(p2, njp, v2, dvp, alpha, o, i, c0, 6, nv);
    for (; i < nq; i++)
        pv_bf16_tile(p2, njp, v2, dvp, alpha, o, i, c0, 1, nv);
}

__attribute__((target("avx512bf16"))) static void
pv_bf16(const void *pv_, int nj, int nq, const void *vv, int64_t dvp, const float *alpha, float *o)
{
    const uint16_t *p2 = pv_, *v2 = vv;
    const int njp = (nj + 1) / 2;
    int64_t c0 = 0;
    for (; c0 + 64 <= dvp; c0 += 64)
        pv_bf16_columns(p2, njp, nq, v2, dvp, alpha, o, c0, 4);
    for (; c0 < dvp; c0 += 16)
        pv_bf16_columns(p2, njp, nq, v2, dvp, alpha, o, c0, 1);
}

/* Interleaves the bf16 of a (even index) and b (odd index): lanes k of a and
 * k of b become elements 2k and 2k+1. */
static inline __m512i interleave_lo(__m512i a, __m512i b)
{
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                         8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    return _mm512_permutex2var_epi16(a, idx, b);
}

static inline __m512i interleave_hi(__m512i a, __m512i b)
{
    const __m512i idx =
        _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                         22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    return _mm512_permutex2var_epi16(a, idx, b);
}

/* In place: pair row j/2 overwrites st row j/2, which the rows j, j + 1
 * (both >= j/2) read before it have left behind. */
__attribute__((target("avx512bf16"))) static void pack_p_bf16(float *st, int nj, int nq)
{
    uint16_t *p2 = (uint16_t *)st;
    for (int j = 0; j < nj; j += 2) {
        for (int x = 0; x < nq / 16; x++) {
            __m512 a = _mm512_loadu_ps(st + j * BR + x * 16);
            __m512 b =
                j + 1 < nj ? _mm512_loadu_ps(st + (j + 1) * BR + x * 16) : _mm512_setzero_ps();
            /* low half a, high half b, then a/b interleaved */
            __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            _mm512_storeu_si512(p2 + ((j / 2) * BR + x * 16) * 2,
                                interleave_lo(ab, _mm512_shuffle_i64x2(ab, ab, 0xee)));
        }
    }
}

/* Q^T as pairs of channels: rows go 16 at a time through tmp ([16][dp],
 * zero past d) so that each store fills whole cache lines of Q^T. */
static void pack_q_bf16(const fmha_cpu_task *t, void *qtv, void *tmpv)
{
    enum { G = 16 };
    const fmha_tensor *q = &t->pb->args->q;
    const int64_t d = t->pb->d, dp = t->dp;
    uint32_t *qt = qtv; /* [dp/2][BR] bf16 pairs as 32-bit words */
    uint16_t *tmp = tmpv;
    for (int i0 = 0; i0 < t->rows; i0 += G) {
        const int n = t->rows - i0 < G ? t->rows - i0 : G;
        for (int i = 0; i < n; i++) {
            const int64_t tok = t->q0 + t->row_pos[i0 + i], h = t->row_head[i0 + i];
            memcpy(tmp + i * dp, fmha_row(q, t->tb, tok, h), (size_t)d * 2);
            if (d < dp)
                tmp[i * dp + d] = 0;
        }
        for (int64_t cp = 0; cp < dp / 2; cp++)
            for (int i = 0; i < n; i++)
                memcpy(&qt[cp * BR + i0 + i], tmp + i * dp + 2 * cp, 4);
    }
    const int pad = fmha_cpu_vector_rows(t->rows) - t->rows;
    for (int64_t cp = 0; pad && cp < dp / 2; cp++)
        memset(qt + cp * BR + t->rows, 0, (size_t)pad * 4);
}

/* Key rows copied into a dense block, as load_k's in cpu_ops_io.h. */
static void load_k_bf16(const fmha_cpu_task *t, int64_t j0, int nj, void *kbv)
{
    const fmha_tensor *k = &t->pb->args->k;
    const int64_t d = t->pb->d;
    uint16_t *kb = kbv;
    for (int j = 0; j < nj; j++) {
        memcpy(kb + j * t->dp, fmha_kv_row(t->pb, k, t->b, j0 + j, t->hk), (size_t)d * 2);
        if (d < t->dp) /* odd head dim: the pair's second half is 0 */
            kb[j * t->dp + d] = 0;
    }
}

/* Value rows j, j + 1 interleaved into pair row j/2. */
static void load_v_bf16(const fmha_cpu_task *t, int64_t j0, int nj, void *vbv)
{
    const fmha_tensor *v = &t->pb->args->v;
    const int64_t dv = t->pb->dv, dvp = t->dvp;
    for (int j = 0; j < nj; j += 2) {
        const uint16_t *ra = (const uint16_t *)fmha_kv_row(t->pb, v, t->b, j0 + j, t->hk);
        const uint16_t *rb =
            j + 1 < nj ? (const uint16_t *)fmha_kv_row(t->pb, v, t->b, j0 + j + 1, t->hk) : NULL;
        uint16_t *dst = (uint16_t *)vbv + (j / 2) * dvp * 2;
        for (int64_t c = 0; c < dvp; c += 32) {
            int64_t left = dv - c;
            __mmask32 mk = left >= 32 ? 0xffffffffu : left > 0 ? (__mmask32)((1u << left) - 1) : 0;
            __m512i a = _mm512_maskz_loadu_epi16(mk, ra + c);
            __m512i b = rb ? _mm512_maskz_loadu_epi16(mk, rb + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + c * 2, interleave_lo(a, b));
            if (c + 16 < dvp)
                _mm512_storeu_si512(dst + c * 2 + 32, interleave_hi(a, b));
        }
    }
}

/* Decode's row products on bf16 pairs (cpu.h's row_qk, row_pv): lanes over
 * channel pairs, the queries as bf16 rows (exact: q is bf16), each key or
 * value row multiplied as it comes from the cache, no conversion. */

/* out[r] = q row r . key row kr for r < mr (bf16 rows; q rows dp apart). */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
row_qk_bf16_tile(const uint16_t *q, int64_t qs, const uint16_t *kr, int64_t d, float *out,
                 const int mr)
{
    __m512 acc[4];
    for (int r = 0; r < mr; r++)
        acc[r] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= d; c += 32) {
        const __m512i kv = _mm512_loadu_si512(kr + c);
        for (int r = 0; r < mr; r++)
            acc[r] = dp(acc[r], _mm512_loadu_si512(q + r * qs + c), kv);
    }
    if (c < d) { /* the channels past the last 32: masked, so past d adds 0 */
        const __mmask32 mk = (__mmask32)((1ull << (d - c)) - 1);
        const __m512i kv = _mm512_maskz_loadu_epi16(mk, kr + c);
        for (int r = 0; r < mr; r++)
            acc[r] = dp(acc[r], _mm512_maskz_loadu_epi16(mk, q + r * qs + c), kv);
    }
    if (mr == 4) {
        hsum4_avx512(acc[0], acc[1], acc[2], acc[3], out);
        return;
    }
    for (int r = 0; r < mr; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]);
}

__attribute__((target("avx512bf16"))) static void
row_qk_bf16_slot(const void *qv, int64_t qs, const char *kr, int64_t d, int rows, float *out)
{
    const uint16_t *q = qv;
    int i = 0;
    for (; i + 4 <= rows; i += 4)
        row_qk_bf16_tile(q + i * qs, qs, (const uint16_t *)kr, d, out + i, 4);
    for (; i < rows; i++)
        row_qk_bf16_tile(q + i * qs, qs, (const uint16_t *)kr, d, out + i, 1);
}

__attribute__((target("avx512bf16"))) static void row_qk_bf16(const fmha_cpu_task *t,
                                                              const void *qr, int rows, int slots,
                                                              int width, const int64_t *hk,
                                                              int64_t j0, int nj, float *st)
{
    row_qk_walk(t, qr, 2, rows, slots, width, hk, j0, nj, st, row_qk_bf16_slot);
}

/* Channels [c, c + 32 nc) of o's rows [i0, i0 + mr): alpha times the old
 * values plus the probability pairs p2[jp][i] times the value rows' pairs
 * (rows vr[2 jp], vr[2 jp + 1], interleaved as they load). */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
row_pv_bf16_tile(const uint32_t *p2, int nj, const uint16_t *const *vr, const float *alpha,
                 float *o, int64_t dv, int64_t dvp, int i0, int64_t c, const int mr, const int nc)
{
    __mmask32 mk[2];
    int live[4]; /* o's rows hold channels [c + 16 x, c + 16 x + 16) */
    __m512 acc[4][4];
    for (int h = 0; h < nc; h++) {
        const int64_t left = dv - c - 32 * h;
        mk[h] = left >= 32 ? 0xffffffffu : left > 0 ? (__mmask32)((1u << left) - 1) : 0;
    }
    for (int x = 0; x < 2 * nc; x++)
        live[x] = c + 16 * x < dvp;
    for (int r = 0; r < mr; r++) {
        const __m512 a = _mm512_set1_ps(alpha[i0 + r]);
        for (int x = 0; x < 2 * nc; x++)
            acc[r][x] = live[x] ? _mm512_mul_ps(a, _mm512_loadu_ps(o + (i0 + r) * dvp + c + 16 * x))
                                : _mm512_setzero_ps();
    }
    for (int j = 0; j < nj; j += 2) {
        __m512i pair[4];
        for (int h = 0; h < nc; h++) {
            const __m512i a = _mm512_maskz_loadu_epi16(mk[h], vr[j] + c + 32 * h);
            const __m512i b = j + 1 < nj ? _mm512_maskz_loadu_epi16(mk[h], vr[j + 1] + c + 32 * h)
                                         : _mm512_setzero_si512();
            pair[2 * h] = interleave_lo(a, b);
            pair[2 * h + 1] = interleave_hi(a, b);
        }
        for (int r = 0; r < mr; r++) {
            const __m512i pp = _mm512_set1_epi32((int)p2[(j / 2) * 16 + i0 + r]);
            for (int x = 0; x < 2 * nc; x++)
                acc[r][x] = dp(acc[r][x], pp, pair[x]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int x = 0; x < 2 * nc; x++)
            if (live[x])
                _mm512_storeu_ps(o + (i0 + r) * dvp + c + 16 * x, acc[r][x]);
}

__attribute__((target("avx512bf16"))) static void row_pv_bf16(const fmha_cpu_task *t,
                                                              const float *p, int rows, int64_t j0,
                                                              int nj, const float *alpha, float *o)
{
    const fmha_problem *pb = t->pb;
    const fmha_tensor *v = &pb->args->v;
    const uint16_t *vr[FMHA_CPU_BC];
    fmha_kv_rows(pb, v, t->b, j0, nj, t->hk, (const char **)vr);
    /* The probabilities of keys 2 jp and 2 jp + 1 as one bf16 pair per row
     * (rows < 16: one vector of each key's column). */
    uint32_t p2[FMHA_CPU_BC / 2 * 16];
    for (int j = 0; j < nj; j += 2) {
        const __m512 a = _mm512_loadu_ps(p + j * T_BR);
        const __m512 b = j + 1 < nj ? _mm512_loadu_ps(p + (j + 1) * T_BR) : _mm512_setzero_ps();
        const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512(p2 + (j / 2) * 16,
                            interleave_lo(ab, _mm512_shuffle_i64x2(ab, ab, 0xee)));
    }
    int64_t c = 0;
    for (; c + 32 < pb->dv; c += 64) { /* 64 channels at a time, the last 32 or fewer alone */
        int i = 0;
        for (; i + 4 <= rows; i += 4)
            row_pv_bf16_tile(p2, nj, vr, alpha, o, pb->dv, t->dvp, i, c, 4, 2);
        for (; i < rows; i++)
            row_pv_bf16_tile(p2, nj, vr, alpha, o, pb->dv, t->dvp, i, c, 1, 2);
    }
    for (; c < pb->dv; c += 32) {
        int i = 0;
        for (; i + 4 <= rows; i += 4)
            row_pv_bf16_tile(p2, nj, vr, alpha, o, pb->dv, t->dvp, i, c, 4, 1);
        for (; i < rows; i++)
            row_pv_bf16_tile(p2, nj, vr, alpha, o, pb->dv, t->dvp, i, c, 1, 1);
    }
}

const fmha_cpu_ops fmha_ops_cpu_avx512_bf16dp = {
    .lanes = VL,
    .elem = 2,
    .pack_q = pack_q_bf16,
    .load_k = load_k_bf16,
    .load_v = load_v_bf16,
    .qk = qk_bf16,
    .softcap = softcap,
    .softmax = softmax,
    .pack_p = pack_p_bf16,
    .pv = pv_bf16,
    .store = store,
    .row_qk = row_qk_bf16,
    .row_pv = row_pv_bf16,
};
