/* cpu.h — the CPU backend: the flash-attention driver (cpu_flash.c) and the
 * per-ISA micro-kernels it calls through one table of function pointers
 * (cpu_ops_scalar.c, cpu_ops_avx2.c, cpu_ops_avx512.c). */
#ifndef FMHA_CPU_H
#define FMHA_CPU_H

#include "../plan.h"

#include <stddef.h>
#include <stdint.h>

/* Queries per task and keys per block. 256 queries share each packed key and
 * value block (4x fewer copies than 64; 1.5x the throughput of 64 on a Zen 5
 * core at head dim 128), and a 64-query slice of Q^T (32 KiB) with a 64-key
 * block stays in L1 while a register tile sweeps it. Short tasks compute only
 * their NQ-rounded queries. */
enum { FMHA_CPU_BR = 256, FMHA_CPU_BC = 64, FMHA_CPU_NQ = 16 };

/* AUTO's ISA: the best detected, except that avx512-bf16 (bf16 inputs on the
 * vdpbf16ps kernel) is taken over avx512 (the f32 one) only where vdpbf16ps
 * has twice the FMA's rate. Measured on 2 threads
 * (bench/RESULTS.md): AMD Zen 5, vdpbf16ps 878-897 GFLOP/s against f32 FMA
 * 472-481, bf16 kernel 1.76x the f32 one; an Intel Xeon VM, vdpbf16ps
 * 117-156 against 230-314, the f32 kernel ~1.4x faster on bf16 inputs. Intel
 * documents vdpbf16ps at the FMA's FLOP rate at best, so AVX512_BF16 on AMD
 * only. */
fmha_cpu_isa fmha_cpu_isa_auto(void);

/* Scratch owned by a layer: one slice per thread, grown on demand. */
typedef struct fmha_cpu_workspace {
    void *buf;
    size_t size;
} fmha_cpu_workspace;

void fmha_cpu_workspace_free(fmha_cpu_workspace *ws);
fmha_status fmha_cpu_forward(const fmha_problem *pb, const fmha_kernel_info *kernel,
                             fmha_cpu_workspace *ws);

/* Micro-kernels of one ISA. Tiles are transposed so that SIMD lanes run over
 * the 64 queries of a task: st[j][i] is the score of query i against key j,
 * the row statistics m, l, alpha are per query, and softmax needs no
 * horizontal reductions. BR = FMHA_CPU_BR is the row stride of every tile;
 * nq (a multiple of FMHA_CPU_NQ, <= BR) is how many queries are live. */
typedef struct fmha_cpu_ops {
    int lanes;  /* f32 lanes per vector: V rows are padded to a multiple */
    int bf16dp; /* tiles hold bf16 pairs for vdpbf16ps instead of f32 */

    /* dst[0..n) = src[0..n) as f32 (src of dtype f32, f16 or bf16), or for
     * f8_e4m3 codes their exact value times descale (one rounding, as
     * fmha_e4m3_to_f32(code) * descale). */
    void (*to_f32)(float *dst, const void *src, fmha_dtype dtype, int64_t n, float descale);

    /* st[j][i] = sum_c k[j][c] * qt[c][i] for j < nj, i < nq.
     * f32:    k rows of f32 (row stride ks elements), qt [d][BR] f32.
     * bf16dp: k rows of bf16 (d even), qt [d/2][BR][2] bf16 pairs. */
    void (*qk)(const void *k, int64_t ks, int nj, int nq, const void *qt, int64_t d, float *st);

    /* st = cap * tanh(st * scale / cap) * log2(e): softcap, in the log2 domain. */
    void (*softcap)(float *st, int nj, int nq, float scale, float cap);

    /* Online softmax over one block, x = st * scale (log2 domain):
     * m_new = max(m, max_j x), alpha = 2^(m - m_new), st = 2^(x - m_new),
     * l = l * alpha + sum_j st, m = m_new. Rows still without a visible key
     * keep m = -inf, l = 0, and get st = 0. */
    void (*softmax)(float *st, int nj, int nq, float scale, float *m, float *l, float *alpha);

    /* o[i][c] = alpha[i] * o[i][c] + sum_j p[j][i] * v[j][c], i < nq, c < dvp.
     * f32:    p = st [nj][BR], v rows of f32 (row stride vs), dvp % lanes == 0.
     * bf16dp: p [ceil(nj/2)][BR][2] and v [ceil(nj/2)][dvp][2] bf16 pairs. */
    void (*pv)(const void *p, int nj, int nq, const void *v, int64_t vs, int64_t dvp,
               const float *alpha, float *o);

    /* bf16dp only: p2[j/2][i][j%2] = bf16(st[j][i]), zero past nj. */
    void (*pack_p)(const float *st, int nj, int nq, uint16_t *p2);
    /* bf16dp only: v2[j/2][c][j%2] = v[j][c] (bf16 rows, stride vs), zero past nj and dv. */
    void (*pack_v)(const uint16_t *v, int64_t vs, int nj, int64_t dv, int64_t dvp, uint16_t *v2);
} fmha_cpu_ops;

#define FMHA_CPU_KERNEL(name, ...) extern const fmha_cpu_ops fmha_ops_##name;
#define FMHA_CUDA_KERNEL(name, ...)
#include "../kernels.def"
#undef FMHA_CPU_KERNEL
#undef FMHA_CUDA_KERNEL

#endif /* FMHA_CPU_H */
