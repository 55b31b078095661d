/* fmha.c — the public API around the backends: errors, tensor views,
 * configuration defaults, the layer object and the forward entry points.
 * Validation lives in validate.c, the kernel choice in select.c. */
#include "internal.h"
#include "cpu/cpu.h"
#ifdef FMHA_HAVE_CUDA
#include "cuda/cuda.h"
#endif

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* ------------------------------------------------------------------ errors */

static _Thread_local char last_error[1024];

fmha_status fmha_set_error(fmha_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

void fmha_clear_error(void)
{
    last_error[0] = '\0';
}

const char *fmha_last_error(void)
{
    return last_error;
}

const char *fmha_status_string(fmha_status status)
{
    switch (status) {
    case FMHA_STATUS_OK: return "FMHA_STATUS_OK";
    case FMHA_STATUS_INVALID_ARGUMENT: return "FMHA_STATUS_INVALID_ARGUMENT";
    case FMHA_STATUS_UNSUPPORTED: return "FMHA_STATUS_UNSUPPORTED";
    case FMHA_STATUS_OUT_OF_MEMORY: return "FMHA_STATUS_OUT_OF_MEMORY";
    case FMHA_STATUS_BACKEND_ERROR: return "FMHA_STATUS_BACKEND_ERROR";
    }
    return "FMHA_STATUS_UNKNOWN";
}

/* ------------------------------------------------------------------ dtypes */

const char *fmha_dtype_name(fmha_dtype dtype)
{
    switch (dtype) {
    case FMHA_DTYPE_F32: return "f32";
    case FMHA_DTYPE_F16: return "f16";
    case FMHA_DTYPE_BF16: return "bf16";
    case FMHA_DTYPE_F8_E4M3: return "f8_e4m3";
    }
    return "unknown";
}

size_t fmha_dtype_size(fmha_dtype dtype)
{
    switch (dtype) {
    case FMHA_DTYPE_F32: return 4;
    case FMHA_DTYPE_F16:
    case FMHA_DTYPE_BF16: return 2;
    case FMHA_DTYPE_F8_E4M3: return 1;
    }
    return 0;
}

float fmha_bf16_to_f32(uint16_t x)
{
    return fmha_bf16_to_f32_inline(x);
}

uint16_t fmha_f32_to_bf16(float x)
{
    return fmha_f32_to_bf16_inline(x);
}

float fmha_f16_to_f32(uint16_t x)
{
    return fmha_f16_to_f32_slow(x);
}

uint16_t fmha_f32_to_f16(float x)
{
    return fmha_f32_to_f16_slow(x);
}

float fmha_f16_to_f32_slow(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) /* inf / NaN */
        return fmha_bits_to_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) { /* zero or subnormal: exact as a float */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    return fmha_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t fmha_f32_to_f16_slow(float f)
{
    uint32_t u = fmha_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return sign | 0x7e00u;
    if (a >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return sign | 0x7c00u;
    if (a < 0x38800000u) { /* below 2^-14: subnormal or zero, rounded by the FPU */
        float mag = fmha_bits_to_f32(a);
        return sign | (uint16_t)lrintf(mag * 0x1p24f);
    }
    uint32_t r = a + 0x0fffu + ((a >> 13) & 1u); /* round to nearest even */
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

/* ----------------------------------------------------------------- tensors */

fmha_tensor fmha_tensor_bshd(void *data, fmha_dtype dtype, int64_t batch, int64_t seqlen,
                             int64_t heads, int64_t head_dim)
{
    fmha_tensor t = {data, dtype, batch, seqlen, heads, head_dim,
                     seqlen * heads * head_dim, heads * head_dim, head_dim, 1};
    return t;
}

fmha_tensor fmha_tensor_bhsd(void *data, fmha_dtype dtype, int64_t batch, int64_t seqlen,
                             int64_t heads, int64_t head_dim)
{
    fmha_tensor t = {data, dtype, batch, seqlen, heads, head_dim,
                     heads * seqlen * head_dim, head_dim, seqlen * head_dim, 1};
    return t;
}

fmha_tensor fmha_tensor_packed(void *data, fmha_dtype dtype, int64_t total_tokens, int64_t heads,
                               int64_t head_dim)
{
    return fmha_tensor_bshd(data, dtype, 1, total_tokens, heads, head_dim);
}

/* ----------------------------------------------------------- configuration */

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

/* ------------------------------------------------------------------- layer */

struct fmha_layer {
    fmha_config cfg;
    fmha_kernel_info kernel;
    fmha_cpu_workspace ws; /* grown on demand, reused across calls */
    fmha_layer_path path;
    char reason[768];      /* why this path (fmha_layer_get_path) */
    fmha_config cfg8;      /* FP8 path: cfg with f8_e4m3 inputs */
    void *fp8_buf;         /* FP8 path: q, k, v codes and scales, on the kernel's device; grown on demand */
    size_t fp8_size;
};

fmha_status fmha_layer_init(fmha_layer **layer, const fmha_config *cfg)
{
    fmha_clear_error();
    if (!layer)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "layer out-pointer is NULL");
    *layer = NULL;
    fmha_kernel_info info;
    fmha_layer_path path = FMHA_LAYER_PATH_DIRECT;
    char reason[sizeof ((fmha_layer *)0)->reason];
    fmha_status st = cfg && cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF
                         ? fmha_kernel_select_fp8(cfg, &info, &path, reason, sizeof reason)
                         : fmha_kernel_select(cfg, &info);
    if (st != FMHA_STATUS_OK)
        return st;
    fmha_layer *l = calloc(1, sizeof *l);
    if (!l)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory allocating a layer");
    l->cfg = *cfg;
    l->kernel = info;
    l->path = path;
    if (path == FMHA_LAYER_PATH_DIRECT)
        snprintf(l->reason, sizeof l->reason, "fp8_compute is off: q, k, v run as %s on %s",
                 fmha_dtype_name(cfg->dtype), info.name);
    else
        memcpy(l->reason, reason, sizeof reason);
    l->cfg8 = *cfg;
    l->cfg8.dtype = FMHA_DTYPE_F8_E4M3;
    l->cfg8.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    l->cfg8.fp8_smooth_k = 0;
    *layer = l;
    return FMHA_STATUS_OK;
}

/* The layer's FP8 scratch lives where its kernel runs: host memory for a CPU
 * layer, device memory for a CUDA one. */
static void fp8_scratch_free(fmha_layer *l)
{
#ifdef FMHA_HAVE_CUDA
    if (l->kernel.device == FMHA_DEVICE_CUDA) {
        fmha_cuda_free(l->fp8_buf);
        return;
    }
#endif
    free(l->fp8_buf);
}

void fmha_layer_free(fmha_layer *layer)
{
    if (!layer)
        return;
    fmha_cpu_workspace_free(&layer->ws);
    fp8_scratch_free(layer);
    free(layer);
}

const fmha_config *fmha_layer_config(const fmha_layer *layer)
{
    return layer ? &layer->cfg : NULL;
}

const fmha_kernel_info *fmha_layer_kernel(const fmha_layer *layer)
{
    return layer ? &layer->kernel : NULL;
}

fmha_layer_path fmha_layer_get_path(const fmha_layer *layer, const char **reason)
{
    if (reason)
        *reason = layer ? layer->reason : "";
    return layer ? layer->path : FMHA_LAYER_PATH_DIRECT;
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

/* Elements of a view's [batch, seqlen, heads, head_dim] box (a contiguous
 * copy's size): -1 if the count overflows. */
static int64_t view_elements(const fmha_tensor *t)
{
    int64_t n;
    if (__builtin_mul_overflow(t->batch, t->seqlen, &n) ||
        __builtin_mul_overflow(n, t->heads, &n) || __builtin_mul_overflow(n, t->head_dim, &n))
        return -1;
    return n;
}

/* Grows the layer's FP8 scratch to at least `bytes`. */
static fmha_status fp8_scratch(fmha_layer *l, size_t bytes)
{
    if (l->fp8_size >= bytes)
        return FMHA_STATUS_OK;
    void *p = NULL;
#ifdef FMHA_HAVE_CUDA
    if (l->kernel.device == FMHA_DEVICE_CUDA) {
        fmha_status st = fmha_cuda_alloc(&p, bytes);
        if (st != FMHA_STATUS_OK)
            return st;
    } else
#endif
    if (!(p = malloc(bytes)))
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                              "out of memory reserving %zu bytes of FP8 scratch", bytes);
    fp8_scratch_free(l);
    l->fp8_buf = p;
    l->fp8_size = bytes;
    return FMHA_STATUS_OK;
}

/* fp8_smooth_k on the CPU: k less its mean over the tokens of each (batch
 * entry, KV head, channel), as contiguous f32 into ks, the means into mean
 * [batch][heads][d]. `acc` holds head_dim doubles. (CUDA layers:
 * fmha_cuda_smooth_k, the same steps.) */
static void smooth_k(const fmha_tensor *k, float *ks, float *mean, double *acc)
{
    const int64_t nb = k->batch, ns = k->seqlen, nh = k->heads, d = k->head_dim;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t h = 0; h < nh; h++) {
            for (int64_t c = 0; c < d; c++)
                acc[c] = 0.0;
            for (int64_t s = 0; s < ns; s++) {
                const char *row = fmha_row(k, b, s, h);
                for (int64_t c = 0; c < d; c++)
                    acc[c] += fmha_load_f32(row, k->dtype, c);
            }
            float *m = mean + (b * nh + h) * d;
            for (int64_t c = 0; c < d; c++)
                m[c] = ns > 0 ? (float)(acc[c] / (double)ns) : 0.0f;
            for (int64_t s = 0; s < ns; s++) {
                const char *row = fmha_row(k, b, s, h);
                float *out = ks + ((b * ns + s) * nh + h) * d;
                for (int64_t c = 0; c < d; c++)
                    out[c] = fmha_load_f32(row, k->dtype, c) - m[c];
            }
        }
}

/* The LSE of the unsmoothed scores: every score of query row q moved by
 * -scale * (q . mean of its KV head), so its LSE did too. */
static void unsmooth_lse(const fmha_problem *pb, const fmha_forward_args *args, const float *mean)
{
    const fmha_tensor *q = &args->q;
    const int64_t nh = pb->heads, d = pb->d, nb = q->batch, ns = q->seqlen;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t h = 0; h < nh; h++) {
            const float *m = mean + (b * pb->kv_heads + h / pb->group) * d;
            float *lse = args->lse + (b * nh + h) * ns; /* packed: b = 0, [heads, total_q] */
            for (int64_t s = 0; s < ns; s++) {
                const char *row = fmha_row(q, b, s, h);
                double dot = 0.0;
                for (int64_t c = 0; c < d; c++)
                    dot += (double)fmha_load_f32(row, q->dtype, c) * m[c];
                lse[s] = (float)(lse[s] + pb->scale * dot);
            }
        }
}

/* The FP8 path of a layer: q, k, v quantized into the layer's scratch (on the
 * layer's device, on args->stream for CUDA), then FP8 attention with their
 * descales. `host` is args with cu_seqlens readable here (validation). Codes
 * rows are padded to 16 bytes, as the GPU's tensor copies want them. With
 * fp8_smooth_k K is smoothed into f32 scratch first and the LSE corrected
 * after, on the layer's device. */
static fmha_status forward_fp8(fmha_layer *l, const fmha_forward_args *args,
                               const fmha_forward_args *host)
{
    const fmha_tensor *src[3] = {&args->q, &args->k, &args->v};
    const char *names[3] = {"q", "k", "v"};
    const int per_block = l->cfg.fp8_compute == FMHA_FP8_COMPUTE_PER_BLOCK;
    const int cuda = l->kernel.device == FMHA_DEVICE_CUDA;
    /* Scratch: each tensor's codes, then its scales, each part 256-byte aligned. */
    int64_t off[3][2], total = 0, dpad[3];
    for (int i = 0; i < 3; i++) {
        const int64_t r = FMHA_FP8_BLOCK_ROWS, nblk = per_block ? (src[i]->seqlen + r - 1) / r : 1;
        fmha_tensor padded = *src[i];
        dpad[i] = (src[i]->head_dim + 15) & ~(int64_t)15;
        padded.head_dim = dpad[i];
        const int64_t codes = view_elements(&padded);
        const int64_t scales = per_block ? src[i]->batch * src[i]->heads * nblk : 1; /* <= codes */
        if (codes < 0 || total > INT64_MAX / 4 - 2 * codes - 1024)
            return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                                  "%s has too many elements to quantize into a copy", names[i]);
        off[i][0] = total;
        total += (codes + 255) & ~(int64_t)255;
        off[i][1] = total;
        total += (scales * 4 + 255) & ~(int64_t)255;
    }
    /* fp8_smooth_k: K less its means (f32), the means, and doubles to sum in
     * (the CPU's: a row; CUDA's: a row per 256 tokens of each head, fewer than
     * nk / 256 + nmean, which the bound below covers). */
    const int smooth = l->cfg.fp8_smooth_k;
    int64_t ks_off = 0, mean_off = 0, acc_off = 0;
    if (smooth) {
        const int64_t nk = view_elements(&args->k), d = args->k.head_dim;
        const int64_t nmean = args->k.batch * args->k.heads * d; /* <= nk unless seqlen is 0 */
        if (nk < 0 || nk > INT64_MAX / 16 - 2 * nmean - d - total / 4 - 1024)
            return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                                  "k has too many elements to smooth into a copy");
        ks_off = total;
        total += (nk * 4 + 255) & ~(int64_t)255;
        mean_off = total;
        total += (nmean * 4 + 255) & ~(int64_t)255;
        acc_off = total;
#ifdef FMHA_HAVE_CUDA
        if (cuda)
            total += (int64_t)fmha_cuda_smooth_k_scratch(&args->k);
        else
#endif
            total += d * 8;
    }
    if ((uint64_t)total > SIZE_MAX / 2)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "FP8 scratch of %lld bytes is too large",
                              (long long)total);
    fmha_status st = fp8_scratch(l, (size_t)total);
    if (st != FMHA_STATUS_OK)
        return st;

    fmha_forward_args a8 = *args;
    fmha_tensor *dst[3] = {&a8.q, &a8.k, &a8.v};
    const float **ds[3] = {&a8.descale_q, &a8.descale_k, &a8.descale_v};
    fmha_tensor ks;
    float *mean = (float *)((char *)l->fp8_buf + mean_off);
    if (smooth) {
        const fmha_tensor *k = &args->k;
        ks = fmha_tensor_bshd((char *)l->fp8_buf + ks_off, FMHA_DTYPE_F32, k->batch, k->seqlen,
                              k->heads, k->head_dim);
        void *acc = (char *)l->fp8_buf + acc_off;
#ifdef FMHA_HAVE_CUDA
        if (cuda) {
            st = fmha_cuda_smooth_k(k, ks.data, mean, acc, args->stream);
            if (st != FMHA_STATUS_OK)
                return st;
        } else
#endif
            smooth_k(k, ks.data, mean, acc);
        src[1] = &ks;
    }
    for (int i = 0; i < 3; i++) {
        const fmha_tensor *x = src[i];
        char *codes = (char *)l->fp8_buf + off[i][0];
        float *scales = (float *)((char *)l->fp8_buf + off[i][1]);
        *dst[i] = fmha_tensor_bshd(codes, FMHA_DTYPE_F8_E4M3, x->batch, x->seqlen, x->heads,
                                   x->head_dim);
        dst[i]->stride_head = dpad[i];
        dst[i]->stride_seq = x->heads * dpad[i];
        dst[i]->stride_batch = x->seqlen * x->heads * dpad[i];
        *ds[i] = scales;
        const fmha_fp8_scaling sc = per_block ? FMHA_FP8_PER_BLOCK : FMHA_FP8_PER_TENSOR;
        st = cuda ? fmha_quantize_fp8_cuda(x, dst[i], scales, sc, FMHA_FP8_BLOCK_ROWS, args->stream)
                  : fmha_quantize_fp8(x, dst[i], scales, sc, FMHA_FP8_BLOCK_ROWS);
        if (st != FMHA_STATUS_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fmha_last_error());
            return fmha_set_error(st, "quantizing %s to FP8 (fp8_compute): %s", names[i], msg);
        }
    }
    a8.descale_layout = per_block ? FMHA_DESCALE_PER_BLOCK : FMHA_DESCALE_PER_TENSOR;
    a8.descale_block_rows = FMHA_FP8_BLOCK_ROWS;
    fmha_forward_args a8h = a8; /* validation reads host cu_seqlens */
    a8h.cu_seqlens_q = host->cu_seqlens_q;
    a8h.cu_seqlens_k = host->cu_seqlens_k;
    fmha_problem pb;
    if ((st = fmha_validate_forward(&l->cfg8, &a8h, &pb)) != FMHA_STATUS_OK)
        return st;
    pb.args = &a8;
#ifdef FMHA_HAVE_CUDA
    if (cuda) {
        st = fmha_cuda_forward(&pb, &l->kernel);
        if (st == FMHA_STATUS_OK && smooth && args->lse)
            st = fmha_cuda_unsmooth_lse(&args->q, args->lse, mean, pb.kv_heads, pb.group, pb.scale,
                                        args->stream);
        return st;
    }
#endif
    st = fmha_cpu_forward(&pb, &l->kernel, &l->ws);
    if (st == FMHA_STATUS_OK && smooth && args->lse)
        unsmooth_lse(&pb, args, mean);
    return st;
}

fmha_status fmha_layer_forward(fmha_layer *layer, const fmha_forward_args *args)
{
    fmha_clear_error();
    if (!layer)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "layer is NULL");
    if (!args)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "forward args are NULL");
    fmha_forward_args host = *args;
    int32_t *cq = NULL, *ck = NULL;
#ifdef FMHA_HAVE_CUDA
    if (layer->kernel.device == FMHA_DEVICE_CUDA && args->cu_seqlens_q) {
        /* Packed batches on the GPU: cu_seqlens are device memory, so
         * validation reads host copies; the kernel still gets the originals. */
        fmha_status st = fmha_cuda_fetch_cu_seqlens(args, &cq, &ck);
        if (st != FMHA_STATUS_OK)
            return st;
        if (cq) {
            host.cu_seqlens_q = cq;
            host.cu_seqlens_k = ck;
        }
    }
#endif
    fmha_problem pb;
    fmha_status st = fmha_validate_forward(&layer->cfg, &host, &pb);
    if (st == FMHA_STATUS_OK) {
        pb.args = args;
        if (layer->path == FMHA_LAYER_PATH_FP8)
            st = forward_fp8(layer, args, &host);
        else if (layer->kernel.device == FMHA_DEVICE_CPU)
            st = fmha_cpu_forward(&pb, &layer->kernel, &layer->ws);
#ifdef FMHA_HAVE_CUDA
        else if (layer->kernel.device == FMHA_DEVICE_CUDA)
            st = fmha_cuda_forward(&pb, &layer->kernel);
#endif
        else
            st = fmha_set_error(FMHA_STATUS_UNSUPPORTED, "kernel %s has no runner",
                                layer->kernel.name);
    }
    free(cq);
    free(ck);
    return st;
}

fmha_status fmha_forward(const fmha_config *cfg, const fmha_forward_args *args)
{
    fmha_layer *layer;
    fmha_status st = fmha_layer_init(&layer, cfg);
    if (st != FMHA_STATUS_OK)
        return st;
    st = fmha_layer_forward(layer, args);
    fmha_layer_free(layer);
    return st;
}

int fmha_cuda_backend_built(void)
{
#ifdef FMHA_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

#ifndef FMHA_HAVE_CUDA
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

int fmha_dropout_keep(uint64_t seed, uint64_t offset, int64_t seq, int64_t num_heads,
                      int64_t head, int64_t row, int64_t col, double p)
{
    if (!(p > 0.0))
        return 1;
    fmha_u32x4 w = fmha_dropout_words(seed, offset, seq * num_heads + head, row, col);
    return w.v[col & 3] >= fmha_dropout_threshold(p);
}

double fmha_flops(const fmha_config *cfg, int64_t batch, int64_t seqlen_q, int64_t seqlen_k)
{
    double pairs = 0;
    for (int64_t i = 0; i < seqlen_q; i++) {
        int64_t lo, hi;
        fmha_visible_range(cfg, i, seqlen_q, seqlen_k, &lo, &hi);
        pairs += (double)(hi - lo);
    }
    return 2.0 * (double)(cfg->head_dim + cfg->head_dim_v) * pairs * (double)cfg->num_heads *
           (double)batch;
}
