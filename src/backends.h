/* backends.h — the backends this build has (backends.c). */
#ifndef FMHA_BACKENDS_H
#define FMHA_BACKENDS_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend of a device, or NULL when this build has none. */
const fmha_backend *fmha_backend_of(fmha_device device);

extern const fmha_backend fmha_cpu_backend;  /* cpu/cpu_backend.c */
extern const fmha_backend fmha_cuda_backend; /* cuda/cuda_backend.cu */

#ifdef __cplusplus
}
#endif
#endif /* FMHA_BACKENDS_H */
