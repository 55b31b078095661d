/* devmem.h — the CLI's bridge to device memory: the same forward arguments,
 * either as they are (CPU) or as device copies (CUDA), and a timer that
 * measures one forward on either. */
#ifndef FMHA_DEVMEM_H
#define FMHA_DEVMEM_H

#include "fmha.h"

#define DEV_OWNED 13 /* q, k, v, out, lse, cu_seqlens_q/k, descale_q/k/v, mask, alibi, sinks */

typedef struct dev_args {
    fmha_forward_args a;    /* what the layer runs on */
    void *owned[DEV_OWNED]; /* device copies to free */
    fmha_device device;
} dev_args;

/* Copies every buffer of `host` to `device` (nothing for CPU). 0 on success,
 * else a message in err. */
int dev_args_upload(dev_args *d, const fmha_forward_args *host, fmha_device device, char *err,
                    size_t errlen);
/* Copies out and lse back into `host`'s buffers. */
int dev_args_download(const dev_args *d, const fmha_forward_args *host, char *err, size_t errlen);
void dev_args_free(dev_args *d);

/* Milliseconds of one fmha_layer_forward, with the device finished. */
fmha_status dev_time_forward(fmha_layer *layer, const dev_args *d, double *ms);

#define DEV_BWD_OWNED 4 /* dout, dq, dk, dv */

/* A backward's arguments on the device of a forward's (dev_args): q, k, v,
 * out and lse are the forward's device buffers, dout a device copy, dq, dk
 * and dv device buffers of the host views' sizes. */
typedef struct dev_bwd {
    fmha_backward_args a;
    void *owned[DEV_BWD_OWNED];
    fmha_device device;
} dev_bwd;

int dev_bwd_upload(dev_bwd *d, const fmha_backward_args *host, const dev_args *fwd, char *err,
                   size_t errlen);
void dev_bwd_free(dev_bwd *d);

/* Milliseconds of one fmha_layer_backward, with the device finished. */
fmha_status dev_time_backward(fmha_layer *layer, const dev_bwd *d, double *ms);

#endif
