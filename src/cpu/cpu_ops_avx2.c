/* cpu_ops_avx2.c — AVX2 + FMA micro-kernels: cpu_ops_f32.h over 8-lane
 * vectors, cpu_ops_io.h over this file's to_f32, and decode's row products
 * (cpu_ops_rows.h). Compiled with AVX2 flags;
 * called only after cpuid.c found them. */
#include "cpu.h"

#include <immintrin.h>

/* 2^x as in cpu_ops_avx512.c (exactly 0 below -126, NaN for NaN), building
 * 2^round(x) from exponent bits. */
static inline __m256 exp2_avx2(__m256 x)
{
    /* Unordered compare and NaN as max's second operand: NaN stays NaN, as
     * the non-finite policy (docs/reliability.md) needs; it was 0. */
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#define V                   __m256
#define VL                  8
#define VLOAD               _mm256_loadu_ps
#define VSTORE              _mm256_storeu_ps
#define VSET1               _mm256_set1_ps
#define VZERO               _mm256_setzero_ps
#define VFMA                _mm256_fmadd_ps
#define VMUL                _mm256_mul_ps
#define VADD                _mm256_add_ps
#define VSUB                _mm256_sub_ps
#define VMAX                _mm256_max_ps
#define VMIN                _mm256_min_ps
#define VDIV                _mm256_div_ps
#define VEXP2               exp2_avx2
#define VIS_NEG_INF(x)      _mm256_cmp_ps((x), _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ)
#define VIS_NEGATIVE(x)     _mm256_cmp_ps((x), _mm256_setzero_ps(), _CMP_LT_OQ)
#define VSELECT(mask, t, f) _mm256_blendv_ps((f), (t), (mask))
#define QK_MR               6 /* 12 accumulators + 2 query vectors + 1 broadcast of 16 registers */
#define QK_NV               2
#define PV_MR               6
#define PV_NV               2
#include "cpu_ops_f32.h"

/* e4m3 codes (in 32-bit lanes) as f32 times descale, as e4m3_avx512 in
 * cpu_ops_avx512.c: exact values, one rounding, NaN for 0x7F/0xFF. */
static inline __m256 e4m3_avx2(__m256i x, __m256 descale)
{
    const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    const __m256 normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    __m256 f = _mm256_blendv_ps(normal, sub, is_sub);
    f = _mm256_or_ps(f, _mm256_castsi256_ps(sign));
    f = _mm256_mul_ps(f, descale);
    const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    return _mm256_blendv_ps(f, _mm256_set1_ps(__builtin_nanf("")), nan);
}

/* Channels [c, c + 8) of an f32, f16 or bf16 row as f32. */
static inline __m256 loadx_avx2(const char *row, fmha_dtype dt, int64_t c)
{
    const uint16_t *h = (const uint16_t *)row + c;
    switch (dt) {
    case FMHA_DTYPE_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
    case FMHA_DTYPE_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
    case FMHA_DTYPE_F8_E4M3: /* the codes' values; the caller applies the row's descale */
        return e4m3_avx2(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + c))),
                         _mm256_set1_ps(1.0f));
    default: return _mm256_loadu_ps((const float *)row + c);
    }
}

static void to_f32(float *dst, const void *src, fmha_dtype dtype, int64_t n, float descale)
{
    int64_t i = 0;
    switch (dtype) {
    case FMHA_DTYPE_F8_E4M3:
        for (; i + 8 <= n; i += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)src + i));
            _mm256_storeu_ps(dst + i, e4m3_avx2(_mm256_cvtepu8_epi32(b), _mm256_set1_ps(descale)));
        }
        for (; i < n; i++)
            dst[i] = fmha_e4m3_to_f32(((const uint8_t *)src)[i]) * descale;
        return;
    case FMHA_DTYPE_F32: memcpy(dst, src, (size_t)n * 4); return;
    case FMHA_DTYPE_BF16:
    case FMHA_DTYPE_F16:
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, loadx_avx2(src, dtype, i));
        break;
    default: return;
    }
    for (; i < n; i++)
        dst[i] = fmha_load_f32(src, dtype, i);
}

#include "cpu_ops_io.h"

static inline float hsum_avx2(__m256 x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#define VLOADX loadx_avx2
/* out[0..3] = the lane sums of a, b, c, d. */
static inline void hsum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d, float *out)
{
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d); /* pairs, per 128-bit half */
    const __m256 abcd = _mm256_hadd_ps(ab, cd);                        /* a b c d per half */
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

#define VHSUM4 hsum4_avx2
#define VHSUM  hsum_avx2
#include "cpu_ops_rows.h"

const fmha_cpu_ops fmha_ops_cpu_avx2_f32 = {
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
