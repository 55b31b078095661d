/* fp8_vt.cuh — V^T for the FP8 Hopper kernel: FP8 wgmma's B operand is K-major, so each call
 * first transposes v into scratch, its keys in the order P's fragments take them (vt_key). */
#pragma once

#include "tiles.cuh"

namespace
{

/* V^T for the FP8 kernel: vt[tb][hk][c][col] = v[key][hk][c] with key =
 * 16 (col / 16) + vt_key(col % 16) of the sequence whose columns hold col
 * (vt_start), 0 past its keys. A block covers 64 columns of one (sequence,
 * KV head): it reads their keys' rows, then writes 4 columns per thread. */
constexpr int VT_COLS = 64;

__global__ void __launch_bounds__(256)
    vt_kernel(const flash_params p, uint8_t *vt, int64_t cols, int vec4)
{
    __shared__ uint8_t tile[VT_COLS][256 + 4]; /* [key][channel]; the pad spreads banks */
    const int b = blockIdx.z, hk = blockIdx.y;
    int64_t k0 = 0, len = p.sk, c0 = 0, own = cols, tb = b;
    if (p.varlen) {
        k0 = p.cu_k[b];
        len = p.cu_k[b + 1] - k0;
        c0 = vt_start(k0, b);
        own = vt_start(p.cu_k[b + 1], b + 1) - c0;
        tb = 0;
    }
    const int64_t x0 = (int64_t)blockIdx.x * VT_COLS;
    if (x0 >= own)
        return;
    const uint8_t *v = (const uint8_t *)p.v + tb * p.v_sb + hk * p.v_sh;
    const int dv = p.dv;
    if (vec4) {
        const int words = dv / 4;
        for (int i = threadIdx.x; i < VT_COLS * words; i += blockDim.x) {
            const int r = i / words, w = i % words;
            const int64_t key = x0 + r;
            const uint32_t x =
                key < len ? *(const uint32_t *)(v + (k0 + key) * p.v_ss + 4 * w) : 0u;
            *(uint32_t *)&tile[r][4 * w] = x;
        }
    } else {
        for (int i = threadIdx.x; i < VT_COLS * dv; i += blockDim.x) {
            const int r = i / dv, c = i % dv;
            const int64_t key = x0 + r;
            tile[r][c] = key < len ? v[(k0 + key) * p.v_ss + c] : 0;
        }
    }
    __syncthreads();
    const int groups = VT_COLS / 4;
    uint8_t *out = vt + ((tb * p.kv_heads + hk) * (int64_t)dv) * cols + c0 + x0;
    for (int i = threadIdx.x; i < dv * groups; i += blockDim.x) {
        const int c = i / groups, g = i % groups;
        if (x0 + 4 * g >= own) /* own is a multiple of 16 */
            continue;
        uint32_t w = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int q = 4 * g + e;
            w |= (uint32_t)tile[(q & ~15) + vt_key(q & 15)][c] << (8 * e);
        }
        *(uint32_t *)(out + (int64_t)c * cols + 4 * g) = w;
    }
}

} // namespace
