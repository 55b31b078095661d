/* fp8.h — the CPU FP8 quantizer after validation (fp8.c): the definition of
 * fmha_quantize_fp8's scales and codes that every backend matches. */
#ifndef FMHA_FP8_H
#define FMHA_FP8_H

#include "backend.h"

/* Quantizes x into y with one scale per group of `g` (validated by
 * fmha_validate_quantize). INVALID_ARGUMENT, with nothing written, when x
 * holds an infinity. `stream` is unused (the fmha_backend.quantize_fp8
 * signature). */
fmha_status fmha_fp8_quantize_cpu(const fmha_tensor *x, const fmha_tensor *y, float *scales,
                                  const fmha_fp8_groups *g, void *stream);

#endif /* FMHA_FP8_H */
