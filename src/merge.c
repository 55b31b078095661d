/* merge.c — the public merge of partial attention outputs: arguments
 * checked in the one validation place, then the CPU's merge or the CUDA
 * backend's (cpu/cpu_merge.c, cuda/cuda_merge.cu). */
#include "backends.h"
#include "validate.h"

fmha_status fmha_merge_partials(int num_parts, const fmha_tensor *parts, const float *const *lses,
                                fmha_tensor *out, float *lse)
{
    fmha_clear_error();
    fmha_merge_problem mp;
    fmha_lse_view views[FMHA_MERGE_MAX_PARTS];
    fmha_status st = fmha_validate_merge(num_parts, parts, lses, out, lse, &mp, views);
    if (st != FMHA_STATUS_OK || out->batch == 0 || out->seqlen == 0)
        return st;
    return fmha_backend_of(FMHA_DEVICE_CPU)->merge(&mp, NULL);
}

fmha_status fmha_merge_partials_cuda(int num_parts, const fmha_tensor *parts,
                                     const float *const *lses, fmha_tensor *out, float *lse,
                                     void *stream)
{
    fmha_clear_error();
    fmha_merge_problem mp;
    fmha_lse_view views[FMHA_MERGE_MAX_PARTS];
    fmha_status st = fmha_validate_merge(num_parts, parts, lses, out, lse, &mp, views);
    if (st != FMHA_STATUS_OK)
        return st;
    const fmha_backend *cuda = fmha_backend_of(FMHA_DEVICE_CUDA);
    if (!cuda)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "fmha_merge_partials_cuda: this fmha was built without a CUDA "
                              "backend (fmha_merge_partials merges host memory)");
    if (out->batch == 0 || out->seqlen == 0)
        return FMHA_STATUS_OK;
    return cuda->merge(&mp, stream);
}
