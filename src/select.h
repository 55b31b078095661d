/* select.h — the kernel chooser (select.c): makes a layer's plan once and
 * refines it for each call. The only place a kernel is chosen. */
#ifndef FMHA_SELECT_H
#define FMHA_SELECT_H

#include "plan.h"

/* Reads the environment variables that matter to cfg (every one for cfg
 * NULL); INVALID_ARGUMENT names a bad value and the allowed ones. */
fmha_status fmha_knobs_read(const fmha_config *cfg, fmha_knobs *k);

/* Whether FP8 attention over max_sk keys accumulates in two levels. */
int fmha_fp8_two_level(fmha_fp8_accum accum, int64_t max_sk);

/* Validates cfg and makes its plan: the one function that says whether a
 * configuration is supported and which kernel runs it (fmha_kernel_select
 * and fmha_layer_init both call it). */
fmha_status fmha_plan_make(const fmha_config *cfg, fmha_plan *plan);

/* The backward plan of a layer's (forward) plan: its backward kernel from
 * kernels.def's backward rows, chosen by the same rules, or UNSUPPORTED and
 * why (fp8_compute, f8_e4m3 inputs, a backend without a backward). */
fmha_status fmha_plan_backward(const fmha_plan *fwd, fmha_plan *bwd);

/* The plan for one validated call: `call` = *plan, refined by the call's
 * facts — a TMA kernel's fallback where the views' rows are not 16-byte
 * aligned (or UNSUPPORTED where it has none), descale layouts the kernel does
 * not take, clusters and two-level accumulation from the lengths. */
fmha_status fmha_plan_for_call(const fmha_plan *plan, const fmha_problem *pb, fmha_plan *call);

/* UNSUPPORTED where the call has score modifiers (mask, ALiBi, sinks) and
 * the plan's kernel is not a CPU kernel (the CPU kernels run them); part of
 * fmha_plan_for_call, and what a backward call checks. */
fmha_status fmha_plan_check_mods(const fmha_plan *plan, const fmha_problem *pb);

/* The plan of a layer's decode calls (fmha_layer_decode): the layer's own
 * where its kernel reads KV caches, else the device's decode kernel of
 * kernels.def (FMHA_CUDA_DEC_KERNEL) chosen by the same rules, or
 * UNSUPPORTED with the reason. */
fmha_status fmha_plan_decode(const fmha_plan *fwd, fmha_plan *dec);

/* One line describing a plan, e.g. "cuda_hopper_sm90 (wgmma): bf16, head dim
 * 128 variant, tile 128x176, schedule split, clusters auto". */
void fmha_plan_describe(const fmha_plan *plan, char *buf, size_t len);

#endif /* FMHA_SELECT_H */
