/* cuda.h — the CUDA backend's entry points, callable from C. Built only when
 * CMake finds nvcc (FMHA_HAVE_CUDA); cuda_flash.cu holds the kernel. */
#ifndef FMHA_CUDA_H
#define FMHA_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif

#include "../internal.h"

/* OK when a device of compute capability >= 8.0 is current; else UNSUPPORTED
 * with the reason. */
fmha_status fmha_cuda_check_device(void);

/* Runs a validated problem on the current device and args->stream. Checks
 * that every pointer is device memory before anything runs. */
fmha_status fmha_cuda_forward(const fmha_problem *pb, const fmha_kernel_info *kernel);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_CUDA_H */
