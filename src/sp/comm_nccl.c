/* comm_nccl.c — fmha_comm over NCCL (device memory). The transfers run on a
 * stream of fmha's own, ordered after the compute stream's work by an event
 * and before the work queued on it after `wait` by another, so that the
 * ring's next block travels while the current one is attended to. A start is
 * one ncclGroupStart / ncclSend, ncclRecv ... / ncclGroupEnd. */
#include "comm_nccl.h"
#include "../alloc.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

typedef struct nccl_state {
    ncclComm_t comm;
    cudaStream_t xfer; /* the transfers' stream */
} nccl_state;

static fmha_status cuda_fail(cudaError_t e, const char *what)
{
    return fmha_set_error(FMHA_STATUS_BACKEND_ERROR, "CUDA error in %s: %s", what,
                          cudaGetErrorString(e));
}

static fmha_status nccl_fail(ncclResult_t r, const char *what)
{
    return fmha_set_error(FMHA_STATUS_BACKEND_ERROR, "NCCL error in %s: %s", what,
                          ncclGetErrorString(r));
}

static fmha_status nccl_start(fmha_comm *c, const fmha_comm_xfer *x, int n, void **pending)
{
    nccl_state *s = c->impl;
    cudaEvent_t ready, done;
    cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaEventCreateWithFlags");
    if ((e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming)) != cudaSuccess) {
        cudaEventDestroy(ready);
        return cuda_fail(e, "cudaEventCreateWithFlags");
    }
    /* The buffers are written by work queued on the compute stream. */
    cudaEventRecord(ready, (cudaStream_t)c->stream);
    cudaStreamWaitEvent(s->xfer, ready, 0);
    cudaEventDestroy(ready); /* released once recorded */
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; r == ncclSuccess && i < n; i++) {
        if (x[i].bytes == 0)
            continue;
        r = x[i].send ? ncclSend(x[i].buf, x[i].bytes, ncclUint8, x[i].peer, s->comm, s->xfer)
                      : ncclRecv(x[i].buf, x[i].bytes, ncclUint8, x[i].peer, s->comm, s->xfer);
    }
    ncclResult_t r2 = ncclGroupEnd();
    if (r != ncclSuccess || r2 != ncclSuccess) {
        cudaEventDestroy(done);
        return nccl_fail(r != ncclSuccess ? r : r2, "ncclSend/ncclRecv");
    }
    cudaEventRecord(done, s->xfer);
    *pending = done;
    return FMHA_STATUS_OK;
}

static fmha_status nccl_wait(fmha_comm *c, void *pending)
{
    cudaEvent_t done = pending;
    cudaError_t e = cudaStreamWaitEvent((cudaStream_t)c->stream, done, 0);
    cudaEventDestroy(done);
    return e == cudaSuccess ? FMHA_STATUS_OK : cuda_fail(e, "cudaStreamWaitEvent");
}

static void nccl_destroy(fmha_comm *c)
{
    nccl_state *s = c->impl;
    cudaStreamSynchronize(s->xfer);
    cudaStreamDestroy(s->xfer);
    fmha_free(s);
}

static const fmha_comm_ops nccl_ops = {nccl_start, nccl_wait, NULL, nccl_destroy};

fmha_status fmha_comm_nccl_init(fmha_comm *c, const void *handle, void *stream)
{
    nccl_state *s = fmha_calloc(1, sizeof *s);
    if (!s)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory for a NCCL communicator");
    s->comm = *(const ncclComm_t *)handle;
    ncclResult_t r;
    if ((r = ncclCommUserRank(s->comm, &c->rank)) != ncclSuccess ||
        (r = ncclCommCount(s->comm, &c->size)) != ncclSuccess) {
        fmha_free(s);
        return nccl_fail(r, "ncclCommUserRank/ncclCommCount");
    }
    cudaError_t e = cudaStreamCreateWithFlags(&s->xfer, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        fmha_free(s);
        return cuda_fail(e, "cudaStreamCreateWithFlags");
    }
    c->ops = &nccl_ops;
    c->device = FMHA_DEVICE_CUDA;
    c->stream = stream;
    c->impl = s;
    return FMHA_STATUS_OK;
}
