/* backends.c — which backends this build has: the one place that knows
 * whether the CUDA backend was compiled in. */
#include "backends.h"

const fmha_backend *fmha_backend_of(fmha_device device)
{
    switch (device) {
    case FMHA_DEVICE_CPU: return &fmha_cpu_backend;
#ifdef FMHA_HAVE_CUDA
    case FMHA_DEVICE_CUDA: return &fmha_cuda_backend;
#endif
    default: return NULL;
    }
}

int fmha_cuda_backend_built(void)
{
    return fmha_backend_of(FMHA_DEVICE_CUDA) != NULL;
}

#ifndef FMHA_HAVE_CUDA
/* The public CUDA queries of a build without the backend. */
int fmha_cuda_device_count(void)
{
    return 0;
}

fmha_status fmha_cuda_device_describe(int dev, char *buf, size_t len)
{
    if (len)
        buf[0] = '\0';
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                          "CUDA device %d: this fmha was built without a CUDA backend", dev);
}
#endif
