/* cpu.h — the CPU backend: the flash-attention drivers (cpu_flash.c forward,
 * cpu_backward.c backward) and the per-ISA micro-kernels it calls through one table of function pointers
 * (cpu_ops_scalar.c, cpu_ops_avx2.c, cpu_ops_avx512.c; the SIMD files share
 * cpu_ops_f32.h's products and softmax, every file cpu_ops_io.h's loads and
 * store). */
#ifndef FMHA_CPU_H
#define FMHA_CPU_H

#include "../plan.h"

#include <stddef.h>
#include <stdint.h>

/* Query rows per task, keys per block, queries per vector step. 256 rows
 * share each packed key and value block (4x fewer copies than 64; 1.5x the
 * throughput of 64 on a Zen 5 core at head dim 128), and the 64 queries the
 * AVX-512 qk sweeps at a time (32 KiB of Q^T at head dim 128) stay in L1 with
 * a 64-key block. Short tasks, and blocks on a mask's edge, compute only
 * their live rows rounded out to multiples of NQ. */
enum { FMHA_CPU_BR = 256, FMHA_CPU_BC = 64, FMHA_CPU_NQ = 16 };

/* A task's query rows as the mainloop reads them: whole vectors of NQ. The
 * cells of the rows past `rows` up to that are zero (pack_q, O); the rest
 * of a tile is never read, so it is never cleared. */
static inline int fmha_cpu_vector_rows(int rows)
{
    return (rows + FMHA_CPU_NQ - 1) / FMHA_CPU_NQ * FMHA_CPU_NQ;
}

/* AUTO's ISA: the best detected, except that avx512-bf16 (bf16 inputs on the
 * vdpbf16ps kernel) is taken over avx512 (the f32 one) only where vdpbf16ps
 * has twice the FMA's rate: on AMD, where the bf16 kernel is the faster; on
 * Intel, whose vdpbf16ps runs at the FMA's FLOP rate at best, the f32 kernel
 * is (bench/RESULTS.md, "CPU forward" and "bf16 inputs on an Intel CPU",
 * hold the measured rates). */
fmha_cpu_isa fmha_cpu_isa_auto(void);

/* Scratch owned by a layer: one slice per thread, grown on demand. */
typedef struct fmha_cpu_workspace {
    void *buf;
    size_t size;
} fmha_cpu_workspace;

void fmha_cpu_workspace_free(fmha_cpu_workspace *ws);
fmha_status fmha_cpu_forward(const fmha_problem *pb, const fmha_kernel_info *kernel,
                             fmha_cpu_workspace *ws);
/* A validated backward call (pb->bwd) on backward kernel `kernel` (cpu_backward.c). */
fmha_status fmha_cpu_backward(const fmha_problem *pb, const fmha_kernel_info *kernel,
                              fmha_cpu_workspace *ws);
/* Grows *ws to `size` bytes (64-byte aligned), keeping nothing of it. */
fmha_status fmha_cpu_workspace_reserve(fmha_cpu_workspace *ws, size_t size);

/* Decode: the new keys and values into the caches, and q rotated
 * (backend.h's kv_append; cpu_kvcache.c). */
fmha_status fmha_cpu_kv_append(const fmha_problem *pb, const fmha_kvcache_args *a,
                               const fmha_tensor *q_rot);

/* One task as the micro-kernels that read and write tensors see it: `rows`
 * rows of sequence b, row r being query position row_pos[r] (within the
 * sequence) of query head row_head[r]; every row reads KV head hk. */
typedef struct fmha_cpu_task {
    const fmha_problem *pb;
    int64_t b, tb;      /* the sequence; its batch index in the tensors (0 when packed) */
    int64_t q0, sq, k0; /* its first token in q and out, its length there, its first in k, v */
    int64_t sk;         /* its keys */
    int64_t hk;
    int64_t dp, dvp; /* row lengths of the K and V tiles: d rounded up to a pair, dv to lanes */
    int rows;        /* rows of the tiles (pack_q's), or of one slot (the store's) */
    int slot_rows;   /* rows of each of the task's head-group slots (cpu_flash.c) */
    const int64_t *row_pos, *row_head; /* [rows] */
} fmha_cpu_task;

/* The score modifiers' bias (fmha_forward_args: mask, ALiBi) of a tile's
 * rows [ia, ib) at keys [j0, j0 + nj): row i is query pos[i] of head
 * head[i] of sequence b (sq queries, sk keys), and its score for key j0 + c
 * sits at st[i * row_step + c * key_step], in the tile's units: `unit` per
 * unit of score (fmha_cpu_bias_unit; 0: no bias). Added there, or -inf where
 * a boolean mask hides the key. Forward and backward tiles alike. */
float fmha_cpu_bias_unit(const fmha_problem *pb);
void fmha_cpu_add_bias(const fmha_problem *pb, int64_t b, int64_t sq, int64_t sk,
                       const int64_t *head, const int64_t *pos, int ia, int ib, int64_t j0, int nj,
                       float unit, float *st, int64_t row_step, int64_t key_step);

/* Micro-kernels of one ISA. A task calls pack_q once; then for each block of
 * nj <= FMHA_CPU_BC keys load_k, qk, softcap (if on), softmax, load_v,
 * pack_p and pv; then store. What differs between f32 and bf16 tiles (the
 * bf16dp table's pairs for vdpbf16ps) stays inside the table.
 *
 * Tiles are transposed so that SIMD lanes run over the task's queries:
 * st[j][i] is the score of query i against key j, the row statistics m, l,
 * alpha are per query, and softmax needs no horizontal reductions. Tiles over
 * queries (Q^T, st, P) have rows of BR = FMHA_CPU_BR cells of 4 bytes: an
 * f32, or in bf16dp tiles a pair of bf16 (two channels of Q, two keys of P).
 * The mainloop kernels get those tiles, m, l and alpha advanced to the
 * block's first live query (a multiple of FMHA_CPU_NQ: one cell offset for
 * every layout) and nq, the live queries from there (a multiple of
 * FMHA_CPU_NQ, <= BR). */
typedef struct fmha_cpu_ops {
    int lanes; /* f32 lanes per vector: V and O rows are padded to a multiple */
    int elem;  /* bytes per element of the Q^T, K and V tiles: 4 (f32) or 2 (bf16) */

    /* Producer: tensor rows into tiles. qt = Q^T of the task's rows, zero
     * past t->rows and past d: f32 [d][BR], bf16dp [dp/2][BR][2] (pairs of
     * channels). tmp: room for 16 rows of dp elements. */
    void (*pack_q)(const fmha_cpu_task *t, void *qt, void *tmp);
    /* kb = keys [j0, j0 + nj) of the sequence, [nj][dp]: converted to f32 and
     * descaled, or for bf16dp copied, zero past d. */
    void (*load_k)(const fmha_cpu_task *t, int64_t j0, int nj, void *kb);
    /* vb = values [j0, j0 + nj), zero past dv: f32 [nj][dvp], bf16dp
     * [ceil(nj/2)][dvp][2] pairs of keys, zero past nj. */
    void (*load_v)(const fmha_cpu_task *t, int64_t j0, int nj, void *vb);

    /* Mainloop: the two products and the softmax between them.
     * st[j][i] = sum_c kb[j][c] * qt[c][i] for j < nj, i < nq; kb rows are ks
     * elements apart, d is the head dim (bf16dp: ceil(d/2) pairs). */
    void (*qk)(const void *kb, int64_t ks, int nj, int nq, const void *qt, int64_t d, float *st);

    /* st = cap * tanh(st * scale / cap) * log2(e): softcap, in the log2 domain. */
    void (*softcap)(float *st, int nj, int nq, float scale, float cap);

    /* Online softmax over one block, x = st * scale (log2 domain):
     * m_new = max(m, max_j x), alpha = 2^(m - m_new), st = 2^(x - m_new),
     * l = l * alpha + sum_j st, m = m_new. Rows still without a visible key
     * keep m = -inf, l = 0, and get st = 0. */
    void (*softmax)(float *st, int nj, int nq, float scale, float *m, float *l, float *alpha);

    /* Makes st pv's P, in place: f32 leaves it as it is; bf16dp rounds it to
     * bf16 pairs of keys, [ceil(nj/2)][BR][2] over st's first rows, zero past nj. */
    void (*pack_p)(float *st, int nj, int nq);

    /* o[i][c] = alpha[i] * o[i][c] + sum_j p[j][i] * vb[j][c] for i < nq,
     * c < dvp (a multiple of lanes); o rows are dvp apart. */
    void (*pv)(const void *p, int nj, int nq, const void *vb, int64_t dvp, const float *alpha,
               float *o);

    /* Epilogue: out = o / l for the task's rows (o [rows][dvp]) and lse =
     * (m + log2 l) ln 2; rows that saw no key (l = 0) get 0 and -inf. */
    void (*store)(const fmha_cpu_task *t, const float *o, const float *m, const float *l);

    /* Decode (NULL where the ISA has none, and then decode runs on the
     * tiles above): a slot of `rows` queries of one KV head, fewer than
     * FMHA_CPU_NQ, against keys [j0, j0 + nj) read straight from the
     * tensors, with lanes over channels. qr: the queries as rows dp apart,
     * f32 (elem 4) or bf16 (elem 2). row_qk, for `slots` such slots side by
     * side (slot k's queries from row k * width on, its keys those of KV
     * head hk[k]): st[j][k * width + i] = q_i . k_j for i < rows, 0 on to
     * the slot's width (one slot: to the next multiple of FMHA_CPU_NQ).
     * row_pv, one slot (KV head t->hk): o[i][c] = alpha[i] o[i][c] +
     * sum_j st[j][i] v_j[c] for i < rows, c < dv (o rows dvp apart). */
    void (*row_qk)(const fmha_cpu_task *t, const void *qr, int rows, int slots, int width,
                   const int64_t *hk, int64_t j0, int nj, float *st);
    void (*row_pv)(const fmha_cpu_task *t, const float *p, int rows, int64_t j0, int nj,
                   const float *alpha, float *o);

    /* Backward (cpu_backward.c; the f32 tables only, NULL in bf16dp's): rows
     * of any tensor into tiles, and the elementwise steps between the
     * backward's products, which are qk and pv above on other operands.
     * Tiles are [rows][BR] like st, of which the first nr rows and nc lanes
     * (a multiple of FMHA_CPU_NQ) are live. */
    /* dst[r][c] = row (tb, tok + r, h) of t as f32 for r < n, c < cols; 0 for
     * cols <= c < stride. */
    void (*load_rows)(const fmha_tensor *t, int64_t tb, int64_t tok, int64_t h, int n, int64_t cols,
                      int64_t stride, float *dst);
    /* dst[c][r] (rows of BR) = the same rows transposed, 0 for n <= r < BR;
     * tmp: room for 16 x cols floats. */
    void (*pack_rows_t)(const fmha_tensor *t, int64_t tb, int64_t tok, int64_t h, int n,
                        int64_t cols, float *dst, float *tmp);
    /* st = 2^(st * scale - lse): the softmax again from the forward's LSE
     * (log2 domain), one per lane (exp_cols) or per row (exp_rows); an LSE of
     * +inf gives 0. */
    void (*exp_cols)(float *st, int nr, int nc, float scale, const float *lse);
    void (*exp_rows)(float *st, int nr, int nc, float scale, const float *lse);
    /* p = p * (dp - D), D per lane or per row: dS from P, dP and D = rowsum(dO * O). */
    void (*ds_cols)(float *p, const float *dp, int nr, int nc, const float *D);
    void (*ds_rows)(float *p, const float *dp, int nr, int nc, const float *D);
    /* ds *= 1 - (t k)^2, the derivative of softcap: t its output, k = 1 / (cap log2 e). */
    void (*softcap_grad)(float *ds, const float *t, int nr, int nc, float k);
} fmha_cpu_ops;

#define FMHA_CPU_KERNEL(name, ...) extern const fmha_cpu_ops fmha_ops_##name;
#include "../kernels.def"

#endif /* FMHA_CPU_H */
