/* validate.h — the one place where configurations, calls and quantizations
 * are checked (validate.c). Backends run only on what passed here. */
#ifndef FMHA_VALIDATE_H
#define FMHA_VALIDATE_H

#include "backend.h"
#include "sp/tokens.h"

/* Checks one tensor view's own consistency: data, dtype, dims, strides and
 * the extent it spans; `name` labels the messages. */
fmha_status fmha_validate_tensor(const fmha_tensor *t, const char *name);

/* Checks a configuration. */
fmha_status fmha_validate_config(const fmha_config *cfg);

/* Checks a call's arguments against a configuration that passed
 * fmha_validate_config, and fills `pb`. */
fmha_status fmha_validate_args(const fmha_config *cfg, const fmha_forward_args *args,
                               fmha_problem *pb);

/* Whether a packed forward's cu_seqlens stay in device memory, unread by the
 * host: an f16/bf16 forward on a device (no FP8 compute) given both
 * max_seqlen_q and max_seqlen_k. Validation then takes the bounds for the
 * longest sequences and the kernels check the offsets (fmha.h). */
int fmha_cu_seqlens_device_checked(const fmha_config *cfg, const fmha_forward_args *args);

/* Checks a backward call: its q, k, v, out, lse and lengths as a forward's
 * (fwd is filled with them and must outlive pb, which points to it), then
 * lse (required), dout and each wanted gradient's dtype and shape. Fills pb,
 * pb->bwd = b. */
fmha_status fmha_validate_backward_args(const fmha_config *cfg, const fmha_backward_args *b,
                                        fmha_forward_args *fwd, fmha_problem *pb);

/* Both of the above, for callers that hold no plan (the reference). */
fmha_status fmha_validate_forward(const fmha_config *cfg, const fmha_forward_args *args,
                                  fmha_problem *pb);

/* Checks a decode call's arguments against a configuration that passed
 * fmha_validate_config, and fills `pb`, whose args become `fwd`: q, the
 * caches as k and v, out and lse. Nothing is written. */
fmha_status fmha_validate_decode(const fmha_config *cfg, const fmha_kvcache_args *a,
                                 fmha_forward_args *fwd, fmha_problem *pb);

/* Config and backward args, for the reference, which holds no plan (and so
 * refuses f8_e4m3 inputs here, as the chooser does for the layers). */
fmha_status fmha_validate_backward(const fmha_config *cfg, const fmha_backward_args *b,
                                   fmha_forward_args *fwd, fmha_problem *pb);

/* Checks the arguments of an FP8 quantization, for every backend, and fills
 * `g`. The values of x are not read here: the CPU quantizer refuses
 * infinities itself. */
fmha_status fmha_validate_quantize(const fmha_tensor *x, const fmha_tensor *y, const float *scales,
                                   fmha_fp8_scaling scaling, int64_t block_rows,
                                   fmha_fp8_groups *g);

/* Checks the arguments of fmha_merge_partials and fills `mp`, whose LSE
 * views live in `views`. */
fmha_status fmha_validate_merge(int num_parts, const fmha_tensor *parts, const float *const *lses,
                                const fmha_tensor *out, float *lse, fmha_merge_problem *mp,
                                fmha_lse_view views[FMHA_MERGE_MAX_PARTS]);

/* Checks a sequence-parallel configuration (ulysses x ring = `ranks`). */
fmha_status fmha_validate_sp_config(const fmha_sp_config *sp, int ranks);

/* Checks a sequence-parallel call on rank `rank` of `ranks` whose
 * communicator moves memory of `device`, and fills `pb`. */
fmha_status fmha_validate_sp(const fmha_config *cfg, const fmha_sp_config *sp, int rank, int ranks,
                             fmha_device device, const char *comm_name, const fmha_sp_args *a,
                             fmha_sp_problem *pb);

#endif /* FMHA_VALIDATE_H */
