/* cuda_fp8.cu — fmha_quantize_fp8 on CUDA, equal bit for bit to the CPU
 * quantizer (fp8.c), in one kernel launch per call. A group of up to 64 KiB
 * is one block's work: amax, scale and codes from one read of x (quant_local).
 * Bigger groups, and per tensor always, run on a persistent cooperative grid:
 * the amax of every tile, a grid-wide barrier, then the codes, tiles in
 * reverse so that the last ones read are still in L2 (quant_grid). */
#include "cuda_common.cuh"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>

namespace cg = cooperative_groups;

namespace
{

/* A thread works on vectors of VEC consecutive elements of a row (16 bytes of
 * bf16/f16, 32 of f32, 8 bytes of codes) when rows are aligned, else on single
 * elements (VEC = 1 below). GRID_SLOTS vectors per thread make a grid tile
 * (16K elements at head dim 128: 32 KiB of bf16 in flight per block);
 * LOCAL_SLOTS vectors per thread are what a local block keeps in registers
 * between its amax and its codes. */
constexpr int NT = 256;
constexpr int VEC = 8;
constexpr int GRID_SLOTS = 8;
constexpr int LOCAL_SLOTS = 8;
/* Groups up to this size take the local path. A group bigger than the
 * registers is read twice there, the second time from L2, which holds every
 * resident block's group only while they are this small (132 SMs x 3 blocks x
 * 64 KiB = 25 MiB of the H200's 60 MiB). */
constexpr int64_t LOCAL_MAX_BYTES = 64 << 10;

/* Load policies: x that is read once streams through L2 (evict first); x
 * that the grid path reads again stays (ld.cg, L2 only); a local group too
 * big for the registers is read with the default policy, to be hit again. */
enum { LD_STREAM, LD_KEEP, LD_DEFAULT };

/* n / d for 0 <= n, d < 2^31 with a multiply and a shift (d fixed per launch):
 * every tile splits its index into (batch, head, segment, tile) and four
 * 32-bit divisions there would cost more than the tile's own arithmetic. */
struct fastdiv {
    uint32_t d, mul, shr;
};

fastdiv make_fastdiv(uint32_t d)
{
    fastdiv f = {d, 0, 0};
    if (d > 1) {
        uint32_t l = 0; /* ceil(log2 d) */
        while ((1ull << l) < d)
            l++;
        f.mul = (uint32_t)(((1ull << (31 + l)) + d - 1) / d);
        f.shr = l - 1;
    }
    return f;
}

__device__ __forceinline__ uint32_t divide(const fastdiv &f, uint32_t n)
{
    return f.d == 1 ? n : __umulhi(n, f.mul) >> f.shr;
}

/* The launch: tiles of tile_rows tokens of one (batch, head) and one
 * segment, a segment being the tokens of one scaling group in that (batch,
 * head): block_rows for per block, the whole sequence otherwise. */
struct quant_params {
    const char *x;
    uint8_t *y;
    float *scales;
    int64_t xs_b, xs_s, xs_h; /* x strides in bytes */
    int64_t ys_b, ys_s, ys_h; /* y strides in bytes */
    int64_t seqlen, seg_rows, tile_rows;
    int64_t group_b, group_h; /* group of a tile = b * group_b + h * group_h + segment */
    int64_t ngroups;
    uint32_t ntiles;
    uint32_t keep_from;       /* grid path: tiles from here on are kept in L2 for the codes */
    fastdiv heads, tps, nseg; /* tiles per segment, segments per (batch, head) */
    int h_fastest;            /* tile order: heads fastest (BSHD-like x) or tokens fastest */
    int cols;                 /* vectors per row */
    int row_step, col_step; /* a thread's next vector: NT on, so row_step rows, col_step columns */
};

struct tile {
    const char *x;
    uint8_t *y;
    int rows;
    int64_t group;
};

__device__ __forceinline__ tile tile_at(const quant_params &p, uint32_t t)
{
    uint32_t b, h, seg, j, r, r2;
    if (p.h_fastest) { /* t = ((b * nseg + seg) * tps + j) * heads + h */
        r = divide(p.heads, t), h = t - r * p.heads.d;
        r2 = divide(p.tps, r), j = r - r2 * p.tps.d;
        b = divide(p.nseg, r2), seg = r2 - b * p.nseg.d;
    } else { /* t = ((b * heads + h) * nseg + seg) * tps + j */
        r = divide(p.tps, t), j = t - r * p.tps.d;
        r2 = divide(p.nseg, r), seg = r - r2 * p.nseg.d;
        b = divide(p.heads, r2), h = r2 - b * p.heads.d;
    }
    const int64_t s0 = (int64_t)seg * p.seg_rows + (int64_t)j * p.tile_rows;
    const int64_t s1 = min(min(s0 + p.tile_rows, ((int64_t)seg + 1) * p.seg_rows), p.seqlen);
    tile tl;
    tl.rows = s1 > s0 ? (int)(s1 - s0) : 0;
    tl.x = p.x + (int64_t)b * p.xs_b + s0 * p.xs_s + (int64_t)h * p.xs_h;
    tl.y = p.y + (int64_t)b * p.ys_b + s0 * p.ys_s + (int64_t)h * p.ys_h;
    tl.group = (int64_t)b * p.group_b + (int64_t)h * p.group_h + seg;
    return tl;
}

/* Thread `tid`'s vectors of a tile are tid, tid + NT, tid + 2 NT, ... in
 * row-major order; (row, col) steps along them without dividing. */
__device__ __forceinline__ void first_slot(const quant_params &p, int &row, int &col)
{
    row = (int)threadIdx.x / p.cols;
    col = (int)threadIdx.x - row * p.cols;
}

__device__ __forceinline__ void next_slot(const quant_params &p, int &row, int &col)
{
    row += p.row_step;
    col += p.col_step;
    if (col >= p.cols) {
        col -= p.cols;
        row++;
    }
}

/* ------------------------------------------------------------- elements */

template <fmha_dtype DT> struct elem_size {
    static constexpr int value = DT == FMHA_DTYPE_F32 ? 4 : 2;
};

/* W elements of x as raw bits: f32 one per word, f16/bf16 two per word (one
 * in the low half when W = 1). */
template <fmha_dtype DT, int W> struct vec {
    static constexpr int WORDS = W * elem_size<DT>::value / 4 > 0 ? W *elem_size<DT>::value / 4 : 1;
    uint32_t w[WORDS];
};

template <fmha_dtype DT, int W, int POLICY>
__device__ __forceinline__ vec<DT, W> load(const char *ptr)
{
    vec<DT, W> v;
    if (W == 1) {
        if (DT == FMHA_DTYPE_F32) {
            const unsigned *q = (const unsigned *)ptr;
            v.w[0] = POLICY == LD_STREAM ? __ldcs(q) : POLICY == LD_KEEP ? __ldcg(q) : *q;
        } else {
            const unsigned short *q = (const unsigned short *)ptr;
            v.w[0] = POLICY == LD_STREAM ? __ldcs(q) : POLICY == LD_KEEP ? __ldcg(q) : *q;
        }
    } else {
#pragma unroll
        for (int i = 0; i < vec<DT, W>::WORDS / 4; i++) {
            const uint4 *q = (const uint4 *)ptr + i;
            const uint4 u = POLICY == LD_STREAM ? __ldcs(q) : POLICY == LD_KEEP ? __ldcg(q) : *q;
            v.w[4 * i] = u.x, v.w[4 * i + 1] = u.y, v.w[4 * i + 2] = u.z, v.w[4 * i + 3] = u.w;
        }
    }
    return v;
}

/* Element i as float, exactly, sign included (NaN stays NaN, f16 subnormals
 * are kept). */
template <fmha_dtype DT, int W> __device__ __forceinline__ float elem_at(const vec<DT, W> &v, int i)
{
    if (DT == FMHA_DTYPE_F32)
        return __uint_as_float(v.w[i]);
    const uint32_t word = v.w[i / 2];
    if (DT == FMHA_DTYPE_BF16)
        return __uint_as_float(i & 1 ? word & 0xffff0000u : word << 16);
    return __half2float(__ushort_as_half((unsigned short)(i & 1 ? word >> 16 : word)));
}

/* A thread's running max of |x|: a float, or for vectors of f16/bf16 one max
 * per 16-bit lane of a word (PACKED), folded into a float by amax_value. */
template <fmha_dtype DT, int W> struct amax_of {
    static constexpr bool PACKED = DT != FMHA_DTYPE_F32 && W > 1;
    typedef typename std::conditional<PACKED, uint32_t, float>::type type;
};

/* max per 16-bit lane (max.bf16x2 / max.f16x2): like fmaxf, a NaN lane gives
 * the other operand's, so NaN is ignored. */
template <fmha_dtype DT> __device__ __forceinline__ uint32_t hmax2(uint32_t a, uint32_t b)
{
    typedef typename std::conditional<DT == FMHA_DTYPE_BF16, __nv_bfloat162, __half2>::type pair;
    pair x, y;
    memcpy(&x, &a, 4), memcpy(&y, &b, 4);
    const pair r = __hmax2(x, y);
    uint32_t m;
    memcpy(&m, &r, 4);
    return m;
}

/* Packed, two elements take one sign mask and one max instead of two
 * conversions and two float maxima. */
template <fmha_dtype DT, int W>
__device__ __forceinline__ typename amax_of<DT, W>::type vec_amax(const vec<DT, W> &v,
                                                                  typename amax_of<DT, W>::type m)
{
    if constexpr (amax_of<DT, W>::PACKED) {
#pragma unroll
        for (int i = 0; i < vec<DT, W>::WORDS; i++)
            m = hmax2<DT>(m, v.w[i] & 0x7fff7fffu);
    } else {
#pragma unroll
        for (int i = 0; i < W; i++)
            m = fmaxf(m,
                      fabsf(elem_at(v, i))); /* fmaxf returns the other operand for NaN: ignored */
    }
    return m;
}

/* m as one float; a packed m starts at 0 and so holds no NaN. */
template <fmha_dtype DT, int W>
__device__ __forceinline__ float amax_value(typename amax_of<DT, W>::type m)
{
    if constexpr (amax_of<DT, W>::PACKED) {
        const vec<DT, 2> pair = {{m}};
        return fmaxf(elem_at(pair, 0), elem_at(pair, 1));
    } else {
        return m;
    }
}

/* Bytes whose bit 7 is the sign of elements 4k .. 4k + 3 (the other bits are
 * not defined): the sign of each code is x's own (a NaN keeps its sign too). */
template <fmha_dtype DT, int W>
__device__ __forceinline__ uint32_t signs4(const vec<DT, W> &v, int k)
{
    if (DT == FMHA_DTYPE_F32) {
        const uint32_t lo = __byte_perm(v.w[4 * k], v.w[4 * k + 1], 0x0073);
        const uint32_t hi = __byte_perm(v.w[4 * k + 2], v.w[4 * k + 3], 0x7300);
        return __byte_perm(lo, hi, 0x7610);
    }
    return __byte_perm(v.w[2 * k], v.w[2 * k + 1], 0x7531);
}

/* --------------------------------------------------------------- E4M3 */

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 890
/* fmha_f32_to_e4m3 of a non-negative float or NaN, as fp8.c spells it: NaN
 * 0x7F, saturation at 448, nearest even; a subnormal code m stands for
 * m * 2^-9, so it is q * 2^9 rounded to an integer, ties to even (exact: a
 * power-of-two product, then cvt.rni). */
__device__ __forceinline__ uint32_t e4m3_soft(float q)
{
    const uint32_t a = __float_as_uint(q);
    if (a > 0x7f800000u)
        return 0x7fu;
    if (a >= 0x43e00000u)
        return 0x7eu;
    if (a >= 0x3c800000u)
        return ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    return __float2uint_rn(q * 512.0f);
}
#endif

/* Codes of lo (low byte) and hi, sign bits not defined. sm_89 and later
 * convert in one instruction, which rounds to nearest even, keeps subnormals
 * and with .satfinite maps everything above 448 to 448 and NaN to a NaN
 * code: on |q|, the same function. */
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi)
{
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return e4m3_soft(fabsf(lo)) | e4m3_soft(fabsf(hi)) << 8;
#endif
}

/* Codes of a (low byte), b, c, d, like e4m3x2; the two halves go straight
 * into one register (no zero extension of each, then a permute). */
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d)
{
#if __CUDA_ARCH__ >= 890
    uint32_t r;
    asm("{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
        "mov.b32 %0, {lo, hi};\n\t}"
        : "=r"(r)
        : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
#else
    return e4m3x2(a, b) | e4m3x2(c, d) << 16;
#endif
}

/* scale = amax / 448 in float, 1 if that is 0; NaN for a group holding an
 * infinity (the CPU refuses such x; here it marks the group instead). */
__device__ __forceinline__ float scale_of(float amax)
{
    if (amax == INFINITY)
        return __uint_as_float(0x7fc00000u);
    const float s = __fdiv_rn(amax, 448.0f);
    return s == 0.0f ? 1.0f : s;
}

/* Scales where a / s can be had as a * (1 / s) with two FMA corrections
 * (Markstein): every intermediate stays normal for the quotients that matter
 * (>= 2^-10; smaller ones are code 0 anyway). The correctly rounded quotient
 * it gives was checked against float division on every f32 significand for
 * 3000 scale significands (25e9 quotients, no difference, and none with one
 * correction). Other scales (subnormal groups, amax above 448 * 2^64, NaN)
 * take the IEEE division. */
__device__ __forceinline__ bool fast_scale(float s)
{
    return s >= 0x1p-64f && s <= 0x1p64f;
}

template <bool FAST> __device__ __forceinline__ float quotient(float a, float s, float r)
{
    if (!FAST)
        return __fdiv_rn(a, s);
    float q = __fmul_rn(a, r);
    float e = __fmaf_rn(-s, q, a);
    q = __fmaf_rn(e, r, q);
    e = __fmaf_rn(-s, q, a);
    return __fmaf_rn(e, r, q);
}

/* Bits of a where mask is set, of b elsewhere: one LOP3 (ptxas spends two
 * on the same function written in C). */
__device__ __forceinline__ uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b)
{
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xe2;" : "=r"(r) : "r"(a), "r"(mask), "r"(b));
    return r;
}

/* Codes of one vector (bytes of .x, then .y): |x| / s to E4M3, x's sign on
 * top. The quotient is of x itself, not |x| (one instruction less per
 * element): each of its steps rounds to nearest, which commutes with
 * negation, so x and -x give quotients of one magnitude (a zero's sign
 * aside), and so codes that differ in the sign bit alone; that bit becomes
 * x's, which also gives -0 and NaN theirs whatever sign the arithmetic gives
 * them. */
template <fmha_dtype DT, int W, bool FAST>
__device__ __forceinline__ uint2 encode(const vec<DT, W> &v, float s, float r)
{
    if constexpr (W == 1) {
        const uint32_t sign = (v.w[0] >> (8 * elem_size<DT>::value - 8)) & 0x80u;
        return make_uint2((e4m3x2(quotient<FAST>(elem_at(v, 0), s, r), 0.0f) & 0x7fu) | sign, 0u);
    } else {
        uint32_t out[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            float q[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                q[i] = quotient<FAST>(elem_at(v, 4 * k + i), s, r);
            out[k] = select_bits(0x80808080u, signs4(v, k), e4m3x4(q[0], q[1], q[2], q[3]));
        }
        return make_uint2(out[0], out[1]);
    }
}

/* Stores the codes of a vector if `store`: a predicated store, where a
 * branch around it would cost three instructions more (the codes are then
 * computed in any case). */
template <int W> __device__ __forceinline__ void store_codes(uint8_t *y, uint2 c, bool store)
{
    if constexpr (W == 1) {
        if (store)
            __stcs((unsigned char *)y, (unsigned char)c.x);
    } else {
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "setp.ne.u32 p, %0, 0;\n\t"
                     "@p st.global.cs.v2.u32 [%1], {%2, %3};\n\t}"
                     :
                     : "r"((uint32_t)store), "l"(y), "r"(c.x), "r"(c.y)
                     : "memory");
    }
}

/* ---------------------------------------------------------------- tiles */

/* The addresses of vector (row, col) in x and y. row and col are never
 * negative; as unsigned they save two multiply-adds per address. */
template <fmha_dtype DT, int W>
__device__ __forceinline__ const char *x_at(const quant_params &p, const tile &tl, int row, int col)
{
    return tl.x + (uint32_t)row * p.xs_s + (uint32_t)col * (uint32_t)(W * elem_size<DT>::value);
}

template <int W>
__device__ __forceinline__ uint8_t *y_at(const quant_params &p, const tile &tl, int row, int col)
{
    return tl.y + (uint32_t)row * p.ys_s + (uint32_t)col * (uint32_t)W;
}

/* The largest |x| among this thread's vectors of the tile (NaN ignored). */
template <fmha_dtype DT, int W, int POLICY>
__device__ __forceinline__ float tile_amax(const quant_params &p, const tile &tl, float m)
{
    typename amax_of<DT, W>::type a = 0;
    int row, col;
    first_slot(p, row, col);
    while (row < tl.rows) {
        vec<DT, W> v[GRID_SLOTS];
#pragma unroll
        for (int k = 0; k < GRID_SLOTS; k++) { /* every load in flight before the first use */
            if (row < tl.rows)
                v[k] = load<DT, W, POLICY>(x_at<DT, W>(p, tl, row, col));
            else
                v[k] = vec<DT, W>{};
            next_slot(p, row, col);
        }
#pragma unroll
        for (int k = 0; k < GRID_SLOTS; k++)
            a = vec_amax(v[k], a);
    }
    return fmaxf(m, amax_value<DT, W>(a));
}

template <fmha_dtype DT, int W, int POLICY, bool FAST>
__device__ __forceinline__ void tile_encode(const quant_params &p, const tile &tl, float s, float r)
{
    int row, col;
    first_slot(p, row, col);
    while (row < tl.rows) {
        vec<DT, W> v[GRID_SLOTS];
        int r0 = row, c0 = col;
#pragma unroll
        for (int k = 0; k < GRID_SLOTS; k++) {
            if (row < tl.rows)
                v[k] = load<DT, W, POLICY>(x_at<DT, W>(p, tl, row, col));
            next_slot(p, row, col);
        }
#pragma unroll
        for (int k = 0; k < GRID_SLOTS; k++) { /* the same slots again, cheaper than keeping them */
            if (r0 < tl.rows)
                store_codes<W>(y_at<W>(p, tl, r0, c0), encode<DT, W, FAST>(v[k], s, r), true);
            next_slot(p, r0, c0);
        }
    }
}

__device__ __forceinline__ float warp_max(float m) /* m >= 0, not NaN: its bits order as integers */
{
    return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(m)));
}

/* ------------------------------------------------------------ grid path */

/* Three resident blocks per SM (two for f32 vectors, whose registers hold
 * twice the bytes): 96 KiB of bf16 loads in flight per SM. */
template <fmha_dtype DT, int W>
constexpr int GRID_BLOCKS_PER_SM = (DT == FMHA_DTYPE_F32 && W > 1) ? 2 : 3;

/* Every tile's amax goes into scales[group] (as integer bits, which order
 * like the floats for amax >= 0) by atomicMax; after a grid-wide barrier each
 * entry becomes its scale, and after another every block encodes its tiles,
 * the last read first. Three barriers in all: scales must be zeroed before the
 * first atomic, and fully converted before the first code. */
template <fmha_dtype DT, int W>
__global__ void __launch_bounds__(NT, GRID_BLOCKS_PER_SM<DT, W>) quant_grid(const quant_params p)
{
    cg::grid_group grid = cg::this_grid();
    unsigned *amax = (unsigned *)p.scales;
    const int64_t gtid = (int64_t)blockIdx.x * NT + threadIdx.x, gthreads = (int64_t)gridDim.x * NT;
    for (int64_t g = gtid; g < p.ngroups; g += gthreads)
        amax[g] = 0u;
    grid.sync();

    /* Amax: a thread's running max is flushed (warp max, one atomic) when
     * the block's tile moves to another group; per tensor once at the end. */
    int64_t group = -1;
    float m = 0.0f;
    for (uint32_t t = blockIdx.x; t < p.ntiles; t += gridDim.x) {
        const tile tl = tile_at(p, t);
        if (tl.group != group) {
            m = warp_max(m);
            if (group >= 0 && m > 0.0f && threadIdx.x % 32 == 0)
                atomicMax(&amax[group], __float_as_uint(m));
            group = tl.group;
            m = 0.0f;
        }
        m = t >= p.keep_from ? tile_amax<DT, W, LD_KEEP>(p, tl, m)
                             : tile_amax<DT, W, LD_STREAM>(p, tl, m);
    }
    m = warp_max(m);
    if (group >= 0 && m > 0.0f && threadIdx.x % 32 == 0)
        atomicMax(&amax[group], __float_as_uint(m));
    grid.sync();

    for (int64_t g = gtid; g < p.ngroups; g += gthreads)
        p.scales[g] = scale_of(__uint_as_float(__ldcg(&amax[g])));
    grid.sync();

    /* Codes, this block's tiles in reverse (the grid has at most ntiles
     * blocks): the tiles read last above are the first here, while they are
     * still in L2. */
    group = -1;
    float s = 1.0f, r = 1.0f;
    for (int64_t t = blockIdx.x + (int64_t)((p.ntiles - 1 - blockIdx.x) / gridDim.x) * gridDim.x;
         t >= 0; t -= gridDim.x) {
        const tile tl = tile_at(p, (uint32_t)t);
        if (tl.group != group) {
            group = tl.group;
            s = __ldcg(&p.scales[group]);
            r = __frcp_rn(s);
        }
        if (fast_scale(s))
            tile_encode<DT, W, LD_STREAM, true>(p, tl, s, r);
        else
            tile_encode<DT, W, LD_STREAM, false>(p, tl, s, r);
    }
}

/* ----------------------------------------------------------- local path */

/* Encodes this thread's LOCAL_SLOTS vectors of a tile, held in v. */
template <fmha_dtype DT, int W, bool FAST>
__device__ __forceinline__ void slots_encode(const quant_params &p, const tile &tl,
                                             const vec<DT, W> v[LOCAL_SLOTS], float s, float r)
{
    int row, col;
    first_slot(p, row, col);
#pragma unroll
    for (int k = 0; k < LOCAL_SLOTS; k++) {
        /* an empty slot (zeros) is encoded too, and its store skipped */
        store_codes<W>(y_at<W>(p, tl, row, col), encode<DT, W, FAST>(v[k], s, r), row < tl.rows);
        next_slot(p, row, col);
    }
}

/* One group per tile, one tile per block at a time: the block's amax, the
 * scale, then the codes — from registers when this thread's vectors of the
 * group fit LOCAL_SLOTS (CACHED), else read again (hits L1 or L2). */
template <fmha_dtype DT, int W, bool CACHED>
__global__ void __launch_bounds__(NT) quant_local(const quant_params p)
{
    __shared__ float part[2][NT / 32]; /* two, so one barrier per group suffices */
    int parity = 0;
    for (uint32_t t = blockIdx.x; t < p.ntiles; t += gridDim.x, parity ^= 1) {
        const tile tl = tile_at(p, t);
        vec<DT, W> v[CACHED ? LOCAL_SLOTS : 1];
        float m = 0.0f;
        if constexpr (CACHED) {
            int row, col;
            first_slot(p, row, col);
#pragma unroll
            for (int k = 0; k < LOCAL_SLOTS; k++) {
                v[k] = row < tl.rows ? load<DT, W, LD_STREAM>(x_at<DT, W>(p, tl, row, col))
                                     : vec<DT, W>{};
                next_slot(p, row, col);
            }
            typename amax_of<DT, W>::type a = 0;
#pragma unroll
            for (int k = 0; k < LOCAL_SLOTS; k++)
                a = vec_amax(v[k], a);
            m = amax_value<DT, W>(a);
        } else {
            m = tile_amax<DT, W, LD_DEFAULT>(p, tl, m);
        }
        m = warp_max(m);
        if (threadIdx.x % 32 == 0)
            part[parity][threadIdx.x / 32] = m;
        __syncthreads();
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < NT / 32; i++)
            amax = fmaxf(amax, part[parity][i]);
        const float s = scale_of(amax), r = __frcp_rn(s);
        if (threadIdx.x == 0)
            p.scales[tl.group] = s;
        if constexpr (CACHED) {
            if (fast_scale(s))
                slots_encode<DT, W, true>(p, tl, v, s, r);
            else
                slots_encode<DT, W, false>(p, tl, v, s, r);
        } else {
            if (fast_scale(s))
                tile_encode<DT, W, LD_DEFAULT, true>(p, tl, s, r);
            else
                tile_encode<DT, W, LD_DEFAULT, false>(p, tl, s, r);
        }
    }
}

/* ----------------------------------------------------------------- host */

typedef void (*quant_kernel)(quant_params);
enum { PATH_GRID, PATH_LOCAL_CACHED, PATH_LOCAL };

template <fmha_dtype DT, int W> quant_kernel kernel_of(int path)
{
    switch (path) {
    case PATH_GRID: return quant_grid<DT, W>;
    case PATH_LOCAL_CACHED: return quant_local<DT, W, true>;
    default: return quant_local<DT, W, false>;
    }
}

quant_kernel pick_kernel(fmha_dtype dt, bool vectors, int path)
{
    switch (dt) {
    case FMHA_DTYPE_F32:
        return vectors ? kernel_of<FMHA_DTYPE_F32, VEC>(path) : kernel_of<FMHA_DTYPE_F32, 1>(path);
    case FMHA_DTYPE_F16:
        return vectors ? kernel_of<FMHA_DTYPE_F16, VEC>(path) : kernel_of<FMHA_DTYPE_F16, 1>(path);
    default:
        return vectors ? kernel_of<FMHA_DTYPE_BF16, VEC>(path)
                       : kernel_of<FMHA_DTYPE_BF16, 1>(path);
    }
}

using fmha_cuda::cuda_error;

fmha_status check_device_memory(const void *ptr, const char *name)
{
    return fmha_cuda::check_device_pointer(
        ptr, name,
        ": fmha_quantize_fp8_cuda takes device memory (fmha_quantize_fp8 quantizes host memory)");
}

/* Every row of t starts `align`-byte aligned (dims of size 1 have no stride
 * that matters). */
bool rows_aligned(const fmha_tensor &t, int64_t es, int64_t align)
{
    return (uintptr_t)t.data % align == 0 && (t.batch == 1 || t.stride_batch * es % align == 0) &&
           (t.seqlen == 1 || t.stride_seq * es % align == 0) &&
           (t.heads == 1 || t.stride_head * es % align == 0);
}

} // namespace

extern "C" fmha_status fmha_cuda_quantize_fp8(const fmha_tensor *x, const fmha_tensor *y,
                                              float *scales, const fmha_fp8_groups *g, void *stream)
{
    fmha_status st = fmha_cuda::check_device();
    if (st != FMHA_STATUS_OK || (st = check_device_memory(x->data, "x.data")) != FMHA_STATUS_OK ||
        (st = check_device_memory(y->data, "y.data")) != FMHA_STATUS_OK ||
        (st = check_device_memory(scales, "scales")) != FMHA_STATUS_OK)
        return st;

    const int64_t es = (int64_t)fmha_dtype_size(x->dtype), dim = x->head_dim;
    const bool vectors = dim % VEC == 0 && rows_aligned(*x, es, 16) && rows_aligned(*y, 1, VEC);
    const int64_t W = vectors ? VEC : 1, cols = dim / W;
    if (cols > INT32_MAX / NT)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "head_dim %lld is too large for the CUDA quantizer", (long long)dim);

    /* Groups within one (batch, head) of at most LOCAL_MAX_BYTES go local. */
    const int64_t seg_rows = g->rows < x->seqlen ? g->rows : x->seqlen;
    const bool local =
        g->batch_span == 1 && g->head_span == 1 && seg_rows <= LOCAL_MAX_BYTES / (dim * es);
    const int64_t slots = (seg_rows * cols + NT - 1) / NT;
    const int path = !local ? PATH_GRID : slots <= LOCAL_SLOTS ? PATH_LOCAL_CACHED : PATH_LOCAL;
    int64_t tile_rows = seg_rows;
    if (!local) {
        tile_rows = NT * GRID_SLOTS / cols;
        tile_rows = tile_rows < 1 ? 1 : tile_rows > seg_rows ? seg_rows : tile_rows;
    }
    const int64_t tps = (seg_rows + tile_rows - 1) / tile_rows;
    const int64_t nseg = g->n_block;
    int64_t ntiles; /* a stride-0 view can have more elements than int64 counts */
    if (__builtin_mul_overflow(x->batch, x->heads, &ntiles) ||
        __builtin_mul_overflow(ntiles, nseg, &ntiles) ||
        __builtin_mul_overflow(ntiles, tps, &ntiles) || ntiles >= INT32_MAX)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "x splits into 2^31 or more tiles of %lld tokens: too many for the "
                              "CUDA quantizer",
                              (long long)tile_rows);

    quant_params p;
    p.x = (const char *)x->data;
    p.y = (uint8_t *)y->data;
    p.scales = scales;
    p.xs_b = x->stride_batch * es, p.xs_s = x->stride_seq * es, p.xs_h = x->stride_head * es;
    p.ys_b = y->stride_batch, p.ys_s = y->stride_seq, p.ys_h = y->stride_head;
    p.seqlen = x->seqlen;
    p.seg_rows = seg_rows;
    p.tile_rows = tile_rows;
    p.group_b = g->batch_span == 1 ? g->n_head * g->n_block : 0;
    p.group_h = g->head_span == 1 ? g->n_block : 0;
    p.ngroups = g->count;
    p.ntiles = (uint32_t)ntiles;
    p.keep_from = 0;
    p.heads = make_fastdiv((uint32_t)x->heads);
    p.tps = make_fastdiv((uint32_t)tps);
    p.nseg = make_fastdiv((uint32_t)nseg);
    p.h_fastest = x->stride_head < x->stride_seq;
    p.cols = (int)cols;
    p.row_step = (int)(NT / cols);
    p.col_step = (int)(NT % cols);

    cudaStream_t s = (cudaStream_t)stream;
    quant_kernel kernel = pick_kernel(x->dtype, vectors, path);
    void *args[] = {&p};
    cudaError_t err;
    if (path == PATH_GRID) {
        /* As many blocks as can be resident at once (the barrier needs them
         * all), and the last 3/4 of L2's worth of tiles kept there. */
        int dev = 0, sms = 0, per_sm = 0, l2 = 0;
        err = cudaGetDevice(&dev);
        if (err == cudaSuccess)
            err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (err == cudaSuccess)
            err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
        if (err == cudaSuccess)
            err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, NT, 0);
        if (err != cudaSuccess)
            return cuda_error(err, "sizing the quantizer's grid");
        const int64_t tile_bytes = tile_rows * dim * es, keep = (int64_t)l2 * 3 / 4 / tile_bytes;
        p.keep_from = keep >= ntiles ? 0 : (uint32_t)(ntiles - keep);
        const int64_t blocks = (int64_t)sms * per_sm < ntiles ? (int64_t)sms * per_sm : ntiles;
        err = cudaLaunchCooperativeKernel((const void *)kernel, dim3((unsigned)blocks), dim3(NT),
                                          args, 0, s);
    } else {
        err = cudaLaunchKernel((const void *)kernel, dim3((unsigned)ntiles), dim3(NT), args, 0, s);
    }
    if (err != cudaSuccess)
        return cuda_error(err, "the FP8 quantizer launch");
    return FMHA_STATUS_OK;
}

/* ---------------------------------------------------------- fp8_smooth_k */

/* fp8_smooth_k on the GPU (layer_fp8.c's FP8 path): K less its mean over the
 * tokens of each (batch entry, KV head, channel), as contiguous f32 that the
 * quantizer then takes as its x; the same steps as the CPU's smooth_k, in
 * three launches and without atomics, so a call's means do not depend on the
 * order in which blocks finish. Each block sums SMOOTH_CHUNK tokens of one
 * (batch, head) in double; the means add those sums in chunk order. */
namespace
{

using fmha_cuda::min64;

constexpr int SMOOTH_NT = 256;
constexpr int64_t SMOOTH_CHUNK = 256;

struct smooth_params {
    const char *k;
    fmha_dtype dtype;
    int64_t s_b, s_s, s_h; /* k's strides in bytes */
    int64_t batch, seqlen, heads, d, chunks;
    double *partial; /* [batch][heads][chunks][d] */
    float *mean;     /* [batch][heads][d] */
    float *ks;       /* [batch][seqlen][heads][d] */
};

__device__ __forceinline__ float load_elem(const char *row, fmha_dtype dt, int64_t c)
{
    if (dt == FMHA_DTYPE_F32)
        return ((const float *)row)[c];
    const unsigned short u = ((const unsigned short *)row)[c];
    return dt == FMHA_DTYPE_BF16 ? __uint_as_float((uint32_t)u << 16)
                                 : __half2float(__ushort_as_half(u));
}

/* A block's threads cover min(d, SMOOTH_NT) channels of SMOOTH_NT / that many
 * rows at a time (channels fastest, so a warp reads consecutive elements). */
struct smooth_lanes {
    int64_t width, lanes, lane, col;
    __device__ explicit smooth_lanes(int64_t d)
    {
        width = d < SMOOTH_NT ? d : SMOOTH_NT;
        lanes = SMOOTH_NT / width;
        lane = threadIdx.x / width;
        col = threadIdx.x % width;
    }
};

/* A block's chunk: SMOOTH_CHUNK tokens of one (batch, head). */
struct smooth_chunk {
    int64_t bh, chunk, b, h, s0, s1;
    __device__ smooth_chunk(const smooth_params &p)
    {
        bh = blockIdx.x / p.chunks;
        chunk = blockIdx.x % p.chunks;
        b = bh / p.heads;
        h = bh % p.heads;
        s0 = chunk * SMOOTH_CHUNK;
        s1 = min64(s0 + SMOOTH_CHUNK, p.seqlen);
    }
};

/* Channel c of rows s, s + step, s + 2 step, s + 3 step of a (batch, head)
 * whose row 0 is at base (0 past row end - 1): four loads in flight. */
__device__ __forceinline__ void load_rows4(const smooth_params &p, const char *base, int64_t s,
                                           int64_t step, int64_t end, int64_t c, float *x)
{
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int64_t su = s + u * step;
        x[u] = su < end ? load_elem(base + su * p.s_s, p.dtype, c) : 0.0f;
    }
}

/* Column sums of a chunk, four rows a thread at a time (four sums, added in
 * a fixed order), then the lanes' sums in lane order. */
__global__ void __launch_bounds__(SMOOTH_NT) smooth_sums(const smooth_params p)
{
    __shared__ double part[SMOOTH_NT];
    const smooth_lanes L(p.d);
    const smooth_chunk k(p);
    const char *base = p.k + k.b * p.s_b + k.h * p.s_h;
    for (int64_t c0 = 0; c0 < p.d; c0 += L.width) {
        const int64_t c = c0 + L.col;
        double acc[4] = {0.0, 0.0, 0.0, 0.0};
        if (L.lane < L.lanes && c < p.d)
            for (int64_t s = k.s0 + L.lane; s < k.s1; s += 4 * L.lanes) {
                float x[4];
                load_rows4(p, base, s, L.lanes, k.s1, c, x);
#pragma unroll
                for (int u = 0; u < 4; u++)
                    acc[u] += x[u];
            }
        part[threadIdx.x] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        __syncthreads();
        if (L.lane == 0 && c < p.d) {
            double sum = 0.0;
            for (int64_t l = 0; l < L.lanes; l++)
                sum += part[l * L.width + L.col];
            p.partial[(k.bh * p.chunks + k.chunk) * p.d + c] = sum;
        }
        __syncthreads();
    }
}

__global__ void __launch_bounds__(SMOOTH_NT) smooth_means(const smooth_params p)
{
    const int64_t i = (int64_t)blockIdx.x * SMOOTH_NT + threadIdx.x; /* (b * heads + h) * d + c */
    if (i >= p.batch * p.heads * p.d)
        return;
    const int64_t bh = i / p.d, c = i % p.d;
    double sum = 0.0;
    for (int64_t j = 0; j < p.chunks; j++)
        sum += p.partial[(bh * p.chunks + j) * p.d + c];
    p.mean[i] = p.seqlen > 0 ? (float)(sum / (double)p.seqlen) : 0.0f;
}

/* The same chunks: K less the means, into ks, four rows a thread at a time. */
__global__ void __launch_bounds__(SMOOTH_NT) smooth_subtract(const smooth_params p)
{
    const smooth_lanes L(p.d);
    const smooth_chunk k(p);
    if (L.lane >= L.lanes)
        return;
    const char *base = p.k + k.b * p.s_b + k.h * p.s_h;
    const float *m = p.mean + k.bh * p.d;
    const int64_t ks_row = p.heads * p.d; /* ks's stride between tokens */
    for (int64_t c = L.col; c < p.d; c += L.width) {
        const float mc = m[c];
        float *out = p.ks + (k.b * p.seqlen * p.heads + k.h) * p.d + c;
        for (int64_t s = k.s0 + L.lane; s < k.s1; s += 4 * L.lanes) {
            float x[4];
            load_rows4(p, base, s, L.lanes, k.s1, c, x);
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (s + u * L.lanes < k.s1)
                    out[(s + u * L.lanes) * ks_row] = x[u] - mc;
        }
    }
}

struct unsmooth_params {
    const char *q;
    fmha_dtype dtype;
    int64_t s_b, s_s, s_h; /* q's strides in bytes */
    int64_t batch, seqlen, heads, d, kv_heads, group;
    double scale;
    const float *mean;
    float *lse; /* [batch][heads][seqlen] */
};

/* One thread a query row: lse += scale * (q . its KV head's mean). */
__global__ void __launch_bounds__(SMOOTH_NT) unsmooth_lse(const unsmooth_params p)
{
    const int64_t i =
        (int64_t)blockIdx.x * SMOOTH_NT + threadIdx.x; /* (b * heads + h) * seqlen + s */
    if (i >= p.batch * p.heads * p.seqlen)
        return;
    const int64_t s = i % p.seqlen, bh = i / p.seqlen, h = bh % p.heads, b = bh / p.heads;
    const char *row = p.q + b * p.s_b + s * p.s_s + h * p.s_h;
    const float *m = p.mean + (b * p.kv_heads + h / p.group) * p.d;
    double dot = 0.0;
    for (int64_t c = 0; c < p.d; c++)
        dot += (double)load_elem(row, p.dtype, c) * m[c];
    p.lse[i] = (float)((double)p.lse[i] + p.scale * dot);
}

int64_t smooth_chunks(const fmha_tensor *k)
{
    return (k->seqlen + SMOOTH_CHUNK - 1) / SMOOTH_CHUNK;
}

unsigned blocks_for(int64_t n)
{
    return (unsigned)((n + SMOOTH_NT - 1) / SMOOTH_NT);
}

} // namespace

extern "C" size_t fmha_cuda_smooth_k_scratch(const fmha_tensor *k)
{
    return (size_t)(k->batch * k->heads * smooth_chunks(k) * k->head_dim) * sizeof(double);
}

extern "C" fmha_status fmha_cuda_smooth_k(const fmha_tensor *k, float *ks, float *mean,
                                          void *partial, void *stream)
{
    fmha_status st = fmha_cuda::check_device_pointer(k->data, "k.data",
                                                     ": a CUDA layer's k must be device memory");
    if (st != FMHA_STATUS_OK)
        return st;
    const int64_t es = (int64_t)fmha_dtype_size(k->dtype);
    smooth_params p = {(const char *)k->data,
                       k->dtype,
                       k->stride_batch * es,
                       k->stride_seq * es,
                       k->stride_head * es,
                       k->batch,
                       k->seqlen,
                       k->heads,
                       k->head_dim,
                       smooth_chunks(k),
                       (double *)partial,
                       mean,
                       ks};
    const int64_t sum_blocks = p.batch * p.heads * p.chunks, means = p.batch * p.heads * p.d;
    if (sum_blocks >= INT32_MAX || blocks_for(means) >= INT32_MAX)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "k of %lld x %lld x %lld tokens, heads and channels is too large for "
                              "fp8_smooth_k on CUDA",
                              (long long)(p.batch * p.seqlen), (long long)p.heads, (long long)p.d);
    cudaStream_t s = (cudaStream_t)stream;
    if (sum_blocks > 0)
        smooth_sums<<<(unsigned)sum_blocks, SMOOTH_NT, 0, s>>>(p);
    if (means > 0)
        smooth_means<<<blocks_for(means), SMOOTH_NT, 0, s>>>(p);
    if (sum_blocks > 0 && ks) /* ks NULL: the means alone */
        smooth_subtract<<<(unsigned)sum_blocks, SMOOTH_NT, 0, s>>>(p);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK
                              : fmha_cuda::cuda_error(err, "the fp8_smooth_k launches");
}

extern "C" fmha_status fmha_cuda_unsmooth_lse(const fmha_tensor *q, float *lse, const float *mean,
                                              int64_t kv_heads, int64_t group, double scale,
                                              void *stream)
{
    const int64_t es = (int64_t)fmha_dtype_size(q->dtype);
    unsmooth_params p = {(const char *)q->data,
                         q->dtype,
                         q->stride_batch * es,
                         q->stride_seq * es,
                         q->stride_head * es,
                         q->batch,
                         q->seqlen,
                         q->heads,
                         q->head_dim,
                         kv_heads,
                         group,
                         scale,
                         mean,
                         lse};
    const int64_t rows = p.batch * p.heads * p.seqlen;
    if (rows == 0)
        return FMHA_STATUS_OK;
    if (blocks_for(rows) >= INT32_MAX)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "%lld query rows are too many for fp8_smooth_k's LSE on CUDA",
                              (long long)rows);
    unsmooth_lse<<<blocks_for(rows), SMOOTH_NT, 0, (cudaStream_t)stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK
                              : fmha_cuda::cuda_error(err, "the fp8_smooth_k LSE launch");
}
