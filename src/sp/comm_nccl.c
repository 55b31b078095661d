/* comm_nccl.c — fmha_comm over NCCL (device memory). The transfers run on a
 * stream of fmha's own, ordered after the compute stream's work by an event
 * and before the work queued on it after `wait` by another, so that the
 * ring's next block travels while the current one is attended to. A start is
 * one ncclGroupStart / ncclSend, ncclRecv ... / ncclGroupEnd.
 *
 * libfmha does not link NCCL: the first NCCL communicator opens
 * libnccl.so.2 by its soname, which is the copy the process has loaded
 * already where there is one (the one the caller's ncclComm_t belongs to,
 * torch's for instance), so that loading libfmha never puts a second NCCL
 * in front of a framework's. */
#include "comm_nccl.h"
#include "../alloc.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdio.h>
#include <nccl.h>
#include <pthread.h>

/* The NCCL functions fmha calls, from libnccl.so.2. */
#define FMHA_NCCL_FUNCTIONS(X)                                                                 \
    X(ncclGetErrorString, const char *, (ncclResult_t))                                        \
    X(ncclGroupStart, ncclResult_t, (void))                                                    \
    X(ncclGroupEnd, ncclResult_t, (void))                                                      \
    X(ncclSend, ncclResult_t,                                                                  \
      (const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t))                   \
    X(ncclRecv, ncclResult_t, (void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t)) \
    X(ncclCommUserRank, ncclResult_t, (const ncclComm_t, int *))                               \
    X(ncclCommCount, ncclResult_t, (const ncclComm_t, int *))

static struct {
#define FMHA_NCCL_POINTER(name, ret, args) ret(*name) args;
    FMHA_NCCL_FUNCTIONS(FMHA_NCCL_POINTER)
#undef FMHA_NCCL_POINTER
    char error[256]; /* why libnccl.so.2 could not be used; empty when it can */
} nccl;

static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;

static void nccl_load(void)
{
    void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(nccl.error, sizeof nccl.error, "%s", why ? why : "dlopen failed");
        return;
    }
#define FMHA_NCCL_RESOLVE(name, ret, args)                             \
    if (!nccl.error[0] && !(*(void **)&nccl.name = dlsym(lib, #name))) \
        snprintf(nccl.error, sizeof nccl.error,                        \
                 "libnccl.so.2 has no %s (NCCL 2.7 or later "          \
                 "is needed)",                                         \
                 #name);
    FMHA_NCCL_FUNCTIONS(FMHA_NCCL_RESOLVE)
#undef FMHA_NCCL_RESOLVE
    /* lib stays open: the functions are used for the life of the process */
}

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
                          nccl.ncclGetErrorString(r));
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
    ncclResult_t r = nccl.ncclGroupStart();
    for (int i = 0; r == ncclSuccess && i < n; i++) {
        if (x[i].bytes == 0)
            continue;
        r = x[i].send ? nccl.ncclSend(x[i].buf, x[i].bytes, ncclUint8, x[i].peer, s->comm, s->xfer)
                      : nccl.ncclRecv(x[i].buf, x[i].bytes, ncclUint8, x[i].peer, s->comm, s->xfer);
    }
    ncclResult_t r2 = nccl.ncclGroupEnd();
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
    pthread_once(&nccl_once, nccl_load);
    if (nccl.error[0])
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "NCCL could not be loaded (%s): install NCCL 2.7 or later "
                              "(libnccl.so.2, e.g. the nvidia-nccl wheel or libnccl2) on the "
                              "library path",
                              nccl.error);
    nccl_state *s = fmha_calloc(1, sizeof *s);
    if (!s)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory for a NCCL communicator");
    s->comm = *(const ncclComm_t *)handle;
    ncclResult_t r;
    if ((r = nccl.ncclCommUserRank(s->comm, &c->rank)) != ncclSuccess ||
        (r = nccl.ncclCommCount(s->comm, &c->size)) != ncclSuccess) {
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
