/* cases.h — the one list of forward cases every backend is tested on:
 * random cases of awkward sizes, run by a backend-specific runner and
 * compared with the float64 reference at a tolerance set by a naive
 * same-precision implementation's error on the same case. */
#ifndef FMHA_TEST_CASES_H
#define FMHA_TEST_CASES_H

#include "testutil.h"

typedef struct tcase {
    int64_t batch, sq, sk, heads, kv, d, dv;
    fmha_dtype dt, odt;
    int lq, lkv, lo; /* layouts (tu_tensor_init) */
    int causal;
    int64_t wl, wr;
    double softcap, dropout, scale;
    int varlen, lse, threads;
    int bounds; /* varlen: max_seqlen_q/k 0 (none), 1 the longest, 2 above it (no mask) */
    fmha_cpu_isa isa;
    fmha_device device;
    fmha_descale_layout dl; /* dt f8_e4m3: where the descales sit */
    int64_t dblock;         /* tokens per block for FMHA_DESCALE_PER_BLOCK */
    int ramp; /* q and k's first d / 2 channels make scores that rise along the keys */
    /* score modifiers (not FP8 on CUDA): mask 0 none, else FMHA_MASK_* + 1; mask_bcast bits
       1, 2, 4: stride 0 over sequences, heads, queries; alibi 0 none, 1 per
       head, 2 per sequence and head; sinks 0/1 */
    int mask, mask_bcast, alibi, sinks;
} tcase;

/* Runs the forward so that out and lse land in the host buffers of `a`. */
typedef fmha_status (*tcase_runner)(const fmha_config *cfg, const fmha_forward_args *a);

/* What random cases may use: the CPU takes every dtype (f8_e4m3 with random
 * descales in every layout too) and head dim, CUDA f16/bf16 inputs and head
 * dims up to 256, and on Hopper f8_e4m3 with per-tensor or per-KV-head
 * descales, q and k rows 16-byte aligned. */
typedef struct tcase_space {
    fmha_device device;
    const fmha_cpu_isa *isas; /* rotated over the cases (CPU) */
    int nisa;
    int fp8; /* CUDA: the device runs f8_e4m3 (Hopper), on views TMA can read */
} tcase_space;

tcase tcase_random(tu_rng *r, int index, const tcase_space *space);
/* Runs one case; counts its checks with TU_CHECK. Returns 1 if the forward ran.
 * FP8 cases draw their codes and per-group descales here; their output is
 * also checked against the reference run on f32 copies dequantized here,
 * independently of the library's descale indexing. */
int tcase_run(const tcase *c, tu_rng *rng, tcase_runner run);

/* The non-finite policy (docs/reliability.md) on `run`'s backend with the
 * configuration `base` (its device, ISA, dtype and head dim; 2 query heads
 * on 1 KV head) over s > 70 tokens, and the float64 reference keeping the same one: a NaN or
 * +inf score makes its row and LSE NaN in both, a row of -inf scores is 0
 * with LSE -inf, a NaN in v makes its column non-finite in the rows that
 * see its key (and may in rows before it whose `key_block`-key block holds
 * it), and every other row matches the reference. */
void tcase_non_finite(tu_rng *r, const fmha_config *base, int64_t s, int64_t key_block,
                      tcase_runner run);

/* Backward cases: tcase_random's forward cases made backward ones (no FP8),
 * with a gradient dtype, a gradient layout and the gradients wanted (bit 0
 * dq, 1 dk, 2 dv). */
tcase tcase_backward_random(tu_rng *r, int index, const tcase_space *space, fmha_dtype *gdt,
                            int *lg, int *want);
/* Computes the gradients into a's dq, dk, dv (host views, poisoned first). */
typedef fmha_status (*tbwd_runner)(const fmha_config *cfg, const fmha_backward_args *a);
/* One backward case: out and lse from the CPU forward, then `run`'s
 * gradients against the float64 reference at 2x the error of
 * tu_naive_backward (operands16: its 16-bit operands rounded, the
 * yardstick of a tensor-core kernel) plus a floor; wanted gradients written
 * inside their views only, the others untouched. Returns the largest ratio
 * error / tolerance. */
double tcase_backward_run(const tcase *c, fmha_dtype gdt, int lg, int want, int operands16,
                          tbwd_runner run, tu_rng *rng);

#endif
