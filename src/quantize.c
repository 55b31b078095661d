/* quantize.c — the public FP8 quantizers: arguments checked in the one
 * validation place, then the CPU quantizer (fp8.c, the definition) or the
 * CUDA backend's. */
#include "backends.h"
#include "fp8.h"
#include "validate.h"

fmha_status fmha_quantize_fp8(const fmha_tensor *x, fmha_tensor *y, float *scales,
                              fmha_fp8_scaling scaling, int64_t block_rows)
{
    fmha_clear_error();
    fmha_fp8_groups g;
    fmha_status st = fmha_validate_quantize(x, y, scales, scaling, block_rows, &g);
    return st != FMHA_STATUS_OK ? st : fmha_fp8_quantize_cpu(x, y, scales, &g, NULL);
}

fmha_status fmha_quantize_fp8_cuda(const fmha_tensor *x, fmha_tensor *y, float *scales,
                                   fmha_fp8_scaling scaling, int64_t block_rows, void *stream)
{
    fmha_clear_error();
    fmha_fp8_groups g;
    fmha_status st = fmha_validate_quantize(x, y, scales, scaling, block_rows, &g);
    if (st != FMHA_STATUS_OK)
        return st;
    const fmha_backend *cuda = fmha_backend_of(FMHA_DEVICE_CUDA);
    if (!cuda)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "fmha_quantize_fp8_cuda: this fmha was built without a CUDA backend "
                              "(fmha_quantize_fp8 quantizes host memory)");
    return cuda->quantize_fp8(x, y, scales, &g, stream);
}
