/* layer.c — the layer object and the one-shot call: a plan made once at
 * fmha_layer_init (plan.c), then each forward validated once (validate.c),
 * refined for its views (fmha_plan_for_call) and run on the plan's backend. */
#include "alloc.h"
#include "backends.h"
#include "layer.h"
#include "layer_fp8.h"
#include "select.h"
#include "validate.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

void fmha_config_init(fmha_config *cfg, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->num_heads = num_heads;
    cfg->num_kv_heads = num_kv_heads;
    cfg->head_dim = head_dim;
    cfg->head_dim_v = head_dim;
    cfg->dtype = FMHA_DTYPE_BF16;
    cfg->window_left = -1;
    cfg->window_right = -1;
    cfg->device = FMHA_DEVICE_CPU;
    cfg->cpu_isa = FMHA_CPU_ISA_AUTO;
}

struct fmha_layer {
    fmha_config cfg; /* as the caller gave it */
    fmha_plan plan;  /* made once, at init */
    fmha_plan last;  /* the plan of the latest call (plan before the first) */
    const fmha_backend *be;
    fmha_workspace ws;  /* the backend's scratch, in its memory */
    fmha_workspace fp8; /* FP8 path: q, k, v codes and scales, in the backend's memory */
    atomic_int busy;    /* a call is running: a second thread's call is refused */
};

fmha_status fmha_layer_init(fmha_layer **layer, const fmha_config *cfg)
{
    fmha_clear_error();
    if (!layer)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "layer out-pointer is NULL");
    *layer = NULL;
    fmha_layer *l = fmha_calloc(1, sizeof *l);
    if (!l)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory allocating a layer");
    fmha_status st = fmha_plan_make(cfg, &l->plan);
    if (st != FMHA_STATUS_OK) {
        fmha_free(l);
        return st;
    }
    l->cfg = *cfg;
    l->last = l->plan;
    l->be = fmha_backend_of(l->plan.cfg.device);
    *layer = l;
    return FMHA_STATUS_OK;
}

void fmha_layer_free(fmha_layer *layer)
{
    if (!layer)
        return;
    if (layer->ws.buf)
        layer->be->free(layer->ws.buf);
    fmha_fp8_scratch_free(layer->be, &layer->fp8);
    fmha_free(layer);
}

const fmha_config *fmha_layer_config(const fmha_layer *layer)
{
    return layer ? &layer->cfg : NULL;
}

const fmha_kernel_info *fmha_layer_kernel(const fmha_layer *layer)
{
    return layer ? &layer->last.kernel->info : NULL;
}

void fmha_layer_describe(const fmha_layer *layer, char *buf, size_t len)
{
    if (!buf || !len)
        return;
    if (!layer) {
        buf[0] = '\0';
        return;
    }
    fmha_plan_describe(&layer->last, buf, len);
}

fmha_layer_path fmha_layer_get_path(const fmha_layer *layer, const char **reason)
{
    if (reason)
        *reason = layer ? layer->plan.reason : "";
    return layer ? layer->plan.path : FMHA_LAYER_PATH_DIRECT;
}

const char *fmha_layer_path_name(fmha_layer_path path)
{
    switch (path) {
    case FMHA_LAYER_PATH_DIRECT: return "direct";
    case FMHA_LAYER_PATH_FP8: return "fp8";
    case FMHA_LAYER_PATH_FP8_FALLBACK: return "fp8_fallback";
    }
    return "unknown";
}

/* A validated call on the layer's path, with `plan` (the layer's, or a
 * piece's: the same but its mask). */
static fmha_status run(fmha_layer *l, const fmha_plan *plan, fmha_problem *pb)
{
    fmha_kernel_info ran;
    /* Without keys there is nothing to quantize: the direct path answers
     * (every row 0, lse -inf). */
    if (plan->path == FMHA_LAYER_PATH_FP8 && pb->max_sk > 0) {
        fmha_status st = fmha_fp8_layer_forward(plan, l->be, &l->fp8, &l->ws, pb, &ran);
        if (st == FMHA_STATUS_OK)
            l->last.kernel = &fmha_kernels[ran.id];
        return st;
    }
    pb->cfg = &plan->cfg;
    fmha_plan call;
    fmha_status st = fmha_plan_for_call(plan, pb, &call);
    if (st != FMHA_STATUS_OK)
        return st;
    l->last = call;
    return l->be->forward(&call, pb, &l->ws);
}

/* cfg.check_finite: q, k and v hold no NaN or inf. */
static fmha_status check_finite(const fmha_layer *l, const fmha_forward_args *a)
{
    if (!l->cfg.check_finite)
        return FMHA_STATUS_OK;
    const fmha_tensor *ts[3] = {&a->q, &a->k, &a->v};
    const char *names[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++) {
        int64_t n = 0, at[4] = {0, 0, 0, 0};
        fmha_status st = l->be->count_non_finite(ts[i], &n, at, a->stream);
        if (st != FMHA_STATUS_OK)
            return st;
        if (n > 0)
            return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                                  "%s holds %lld NaN or inf value%s, the first at [batch, seq, "
                                  "head, channel] = [%lld, %lld, %lld, %lld]; check_finite "
                                  "refuses them (docs/reliability.md says what they would give)",
                                  names[i], (long long)n, n == 1 ? "" : "s", (long long)at[0],
                                  (long long)at[1], (long long)at[2], (long long)at[3]);
    }
    return FMHA_STATUS_OK;
}

/* A call on a layer that no other thread is using; `piece` (NULL: none)
 * replaces the mask and places the call in a larger problem. */
static fmha_status forward(fmha_layer *layer, const fmha_forward_args *args,
                           const fmha_piece *piece)
{
    /* Validation reads cu_seqlens on the host: a device backend copies them,
     * unless the bounds are given and the kernels check them. */
    fmha_forward_args host = *args;
    int32_t *cq = NULL, *ck = NULL;
    fmha_status st = FMHA_STATUS_OK;
    if (layer->be->host_cu_seqlens && args->cu_seqlens_q &&
        !fmha_cu_seqlens_device_checked(&layer->cfg, args) &&
        (st = layer->be->host_cu_seqlens(args, &cq, &ck)) != FMHA_STATUS_OK)
        return st;
    if (cq) {
        host.cu_seqlens_q = cq;
        host.cu_seqlens_k = ck;
    }
    fmha_plan piece_plan;
    const fmha_plan *plan = &layer->plan;
    fmha_config cfg = layer->cfg;
    if (piece) {
        piece_plan = layer->plan;
        fmha_config *c[2] = {&cfg, &piece_plan.cfg};
        for (int i = 0; i < 2; i++) {
            c[i]->causal = piece->causal;
            c[i]->window_left = piece->window_left;
            c[i]->window_right = piece->window_right;
        }
        plan = &piece_plan;
    }
    fmha_problem pb;
    /* No query row: nothing to compute or write (torch's empty result). */
    if ((st = fmha_validate_args(&cfg, &host, &pb)) == FMHA_STATUS_OK && pb.batch > 0 &&
        pb.max_sq > 0 && (st = check_finite(layer, args)) == FMHA_STATUS_OK) {
        pb.args = args;
        if (piece) {
            pb.pos_row0 = piece->row0;
            pb.pos_col0 = piece->col0;
            pb.pos_head0 = piece->head0;
            pb.pos_heads = piece->heads;
        }
        st = run(layer, plan, &pb);
    }
    fmha_free(cq);
    fmha_free(ck);
    return st;
}

/* decode() after the copies: validation reads `copies` in place of the
 * caller's arrays where it has them; the backend gets both. */
static fmha_status decode_validated(fmha_layer *layer, const fmha_kvcache_args *args,
                                    const fmha_kvcache_host *copies)
{
    fmha_kvcache_args host = *args;
    if (copies->cache_seqlens)
        host.cache_seqlens = copies->cache_seqlens;
    if (copies->cache_batch_idx)
        host.cache_batch_idx = copies->cache_batch_idx;
    if (copies->block_table)
        host.block_table = copies->block_table;
    fmha_forward_args fwd;
    fmha_problem pb;
    fmha_plan dec, call;
    fmha_status st = fmha_validate_decode(&layer->cfg, &host, &fwd, &pb);
    if (st != FMHA_STATUS_OK || (st = fmha_plan_decode(&layer->plan, &dec)) != FMHA_STATUS_OK)
        return st;
    pb.cfg = &dec.cfg;
    pb.kv = args;
    if ((st = fmha_plan_for_call(&dec, &pb, &call)) != FMHA_STATUS_OK)
        return st;
    void *q_rot = NULL;
    if (args->rotary_dim > 0 && pb.batch > 0 && pb.max_sq > 0) {
        const size_t bytes =
            (size_t)(pb.batch * pb.max_sq * pb.heads * pb.d) * fmha_dtype_size(args->q.dtype);
        if ((st = layer->be->scratch(&q_rot, bytes, args->stream)) != FMHA_STATUS_OK)
            return st;
        fwd.q = fmha_tensor_bshd(q_rot, args->q.dtype, pb.batch, pb.max_sq, pb.heads, pb.d);
    }
    if ((st = layer->be->kv_append(&pb, args, &fwd.q)) == FMHA_STATUS_OK && pb.batch > 0 &&
        pb.max_sq > 0) {
        layer->last = call;
        st = layer->be->forward(&call, &pb, &layer->ws);
    }
    if (q_rot)
        layer->be->scratch_free(q_rot, args->stream);
    return st;
}

/* A decode call on a layer that no other thread is using: validated (on
 * host copies of its index arrays where the backend's memory is not the
 * host's), the decode plan made, the cache appended to, then attention. */
static fmha_status decode(fmha_layer *layer, const fmha_kvcache_args *args)
{
    if (!args) /* validation's message */
        return fmha_validate_decode(&layer->cfg, NULL, NULL, NULL);
    fmha_kvcache_host copies = {NULL, NULL, NULL};
    /* max_seqlen_k lets a device's kernels check the arrays themselves (fmha.h) */
    fmha_status st = layer->be->host_kvcache && args->max_seqlen_k <= 0
                         ? layer->be->host_kvcache(args, &copies)
                         : FMHA_STATUS_OK;
    if (st == FMHA_STATUS_OK)
        st = decode_validated(layer, args, &copies);
    fmha_free(copies.cache_seqlens);
    fmha_free(copies.cache_batch_idx);
    fmha_free(copies.block_table);
    return st;
}

/* A backward call on a layer that no other thread is using: the backward
 * plan, then every argument, then the backend. */
static fmha_status backward(fmha_layer *layer, const fmha_backward_args *args)
{
    fmha_plan bwd;
    fmha_status st = fmha_plan_backward(&layer->plan, &bwd);
    if (st != FMHA_STATUS_OK)
        return st;
    /* Validation reads cu_seqlens on the host: a device backend copies them;
     * the backend reads the caller's (pb.bwd). */
    fmha_backward_args host = *args;
    int32_t *cq = NULL, *ck = NULL;
    if (layer->be->host_cu_seqlens && args->cu_seqlens_q) {
        fmha_forward_args lens = {.cu_seqlens_q = args->cu_seqlens_q,
                                  .cu_seqlens_k = args->cu_seqlens_k,
                                  .varlen_batch = args->varlen_batch,
                                  .stream = args->stream};
        if ((st = layer->be->host_cu_seqlens(&lens, &cq, &ck)) != FMHA_STATUS_OK)
            return st;
        if (cq) {
            host.cu_seqlens_q = cq;
            host.cu_seqlens_k = ck;
        }
    }
    fmha_forward_args fwd;
    fmha_problem pb;
    /* batch 0: no row of any gradient. Otherwise seqlen_q 0 still has dk and
     * dv rows to zero, and seqlen_k 0 dq rows: the backend writes them. */
    if ((st = fmha_validate_backward_args(&layer->cfg, &host, &fwd, &pb)) == FMHA_STATUS_OK &&
        pb.batch > 0 && (st = fmha_plan_check_mods(&bwd, &pb)) == FMHA_STATUS_OK &&
        (st = check_finite(layer, &fwd)) == FMHA_STATUS_OK) {
        pb.cfg = &bwd.cfg;
        pb.bwd = args;
        layer->last = bwd;
        st = layer->be->backward(&bwd, &pb, &layer->ws);
    }
    fmha_free(cq);
    fmha_free(ck);
    return st;
}

typedef enum { CALL_FORWARD, CALL_DECODE, CALL_BACKWARD } call_kind;

/* Runs one call while no other thread uses the layer: its scratch and its
 * latest plan belong to one call at a time. `piece`: forward calls only. */
static fmha_status exclusive(fmha_layer *layer, const void *args, call_kind kind,
                             const fmha_piece *piece)
{
    static const char *const names[3] = {"forward", "decode", "backward"};
    fmha_clear_error();
    if (!layer)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "layer is NULL");
    if (!args)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "%s args are NULL", names[kind]);
    if (atomic_exchange(&layer->busy, 1))
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "the layer is running a call on another thread: a layer runs one "
                              "call at a time (it owns that call's scratch); give each thread "
                              "its own layer (fmha_layer_init)");
    fmha_status st = kind == CALL_FORWARD  ? forward(layer, args, piece)
                     : kind == CALL_DECODE ? decode(layer, args)
                                           : backward(layer, args);
    atomic_store(&layer->busy, 0);
    return st;
}

/* The one-shot calls: a layer made, used once and freed. */
static fmha_status one_shot(const fmha_config *cfg, const void *args, call_kind kind)
{
    fmha_layer *layer;
    fmha_status st = fmha_layer_init(&layer, cfg);
    if (st != FMHA_STATUS_OK)
        return st;
    st = exclusive(layer, args, kind, NULL);
    fmha_layer_free(layer);
    return st;
}

fmha_status fmha_layer_forward(fmha_layer *layer, const fmha_forward_args *args)
{
    return exclusive(layer, args, CALL_FORWARD, NULL);
}

fmha_status fmha_layer_forward_piece(fmha_layer *layer, const fmha_forward_args *args,
                                     const fmha_piece *piece)
{
    return exclusive(layer, args, CALL_FORWARD, piece);
}

fmha_status fmha_layer_decode(fmha_layer *layer, const fmha_kvcache_args *args)
{
    return exclusive(layer, args, CALL_DECODE, NULL);
}

fmha_status fmha_layer_backward(fmha_layer *layer, const fmha_backward_args *args)
{
    return exclusive(layer, args, CALL_BACKWARD, NULL);
}

fmha_status fmha_forward(const fmha_config *cfg, const fmha_forward_args *args)
{
    return one_shot(cfg, args, CALL_FORWARD);
}

fmha_status fmha_decode(const fmha_config *cfg, const fmha_kvcache_args *args)
{
    return one_shot(cfg, args, CALL_DECODE);
}

fmha_status fmha_backward(const fmha_config *cfg, const fmha_backward_args *args)
{
    return one_shot(cfg, args, CALL_BACKWARD);
}
