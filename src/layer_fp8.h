/* layer_fp8.h — a layer's FP8 path (layer_fp8.c): quantize on every call,
 * then FP8 attention, all on the layer's backend. */
#ifndef FMHA_LAYER_FP8_H
#define FMHA_LAYER_FP8_H

#include "backend.h"

/* Runs a call validated against the layer's configuration (pb->cfg, with
 * fp8_compute on) through FP8 attention on plan's kernel: q, k, v quantized
 * into `scratch` (the backend's memory, grown on demand), K smoothed first and
 * the LSE corrected after under fp8_smooth_k. *ran gets the kernel that ran. */
fmha_status fmha_fp8_layer_forward(const fmha_plan *plan, const fmha_backend *be,
                                   fmha_workspace *scratch, fmha_workspace *ws,
                                   const fmha_problem *pb, fmha_kernel_info *ran);

/* Releases the scratch. */
void fmha_fp8_scratch_free(const fmha_backend *be, fmha_workspace *scratch);

#endif /* FMHA_LAYER_FP8_H */
