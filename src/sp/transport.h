/* transport.h — the communicator inside fmha_comm: point-to-point transfers
 * started together and waited for together, which is all that Ulysses'
 * all-to-alls and the ring's rotation need. One implementation per library
 * (comm_mpi.c, comm_nccl.c), none of them written here: fmha sends only
 * through the caller's MPI or NCCL. Types only. */
#ifndef FMHA_SP_TRANSPORT_H
#define FMHA_SP_TRANSPORT_H

#include "../internal.h"

#include <stddef.h>

/* One send or receive of `bytes` bytes at `buf` (the backend's memory) with
 * rank `peer`, which may be this rank. Between two ranks, the sends of one
 * start meet the receives of the other's matching start in order. */
typedef struct fmha_comm_xfer {
    int peer;
    int send; /* 1 send, 0 receive */
    void *buf;
    size_t bytes;
} fmha_comm_xfer;

typedef struct fmha_comm fmha_comm;

typedef struct fmha_comm_ops {
    /* Starts n transfers after the work queued so far on the compute stream
     * and returns at once; *pending is what `wait` takes. */
    fmha_status (*start)(fmha_comm *c, const fmha_comm_xfer *x, int n, void **pending);
    /* Until the transfers of `pending` are done (MPI: on return; NCCL: for
     * the work queued after it on the compute stream); frees `pending`. */
    fmha_status (*wait)(fmha_comm *c, void *pending);
    /* Lets the transfers of `pending` move on while the caller computes (MPI
     * moves large messages only inside its calls); NULL where they move by
     * themselves. */
    void (*progress)(fmha_comm *c, void *pending);
    void (*destroy)(fmha_comm *c);
} fmha_comm_ops;

struct fmha_comm {
    const fmha_comm_ops *ops;
    fmha_comm_kind kind;
    fmha_device device; /* where the transferred memory lives */
    int rank, size;
    void *stream;       /* NCCL: the caller's cudaStream_t, where attention runs */
    void *impl;         /* the implementation's own state */
    int64_t bytes_sent; /* through start's sends, for fmha_comm_bytes_sent */
    /* The layer of the latest fmha_sp_forward (its local heads), kept for the
     * next call of the same configuration with its workspace; freed with
     * the comm. */
    fmha_layer *layer;
    fmha_config layer_cfg;
};

#endif /* FMHA_SP_TRANSPORT_H */
