/* cpu_merge.h — the CPU backend's operations between attention calls
 * (cpu_merge.c): the merge of partial outputs, view copies, LSE fills. */
#ifndef FMHA_CPU_MERGE_H
#define FMHA_CPU_MERGE_H

#include "../backend.h"

fmha_status fmha_cpu_merge(const fmha_merge_problem *mp, void *stream);
fmha_status fmha_cpu_copy(const fmha_tensor *dst, const fmha_tensor *src, void *stream);
fmha_status fmha_cpu_fill_f32(float *p, int64_t n, float value, void *stream);

#endif /* FMHA_CPU_MERGE_H */
