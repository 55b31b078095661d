/* fmha.h — fused multi-head attention: one C API for every backend.
 *
 * fmha computes out = softmax(scale * q k^T + mask) v for batched, multi-head
 * inputs, with flash-attention semantics (causal alignment, sliding windows,
 * softcap, dropout, LSE, packed variable-length batches, GQA/MQA).
 *
 * Usage (one-shot):
 *
 *     fmha_config cfg;
 *     fmha_config_init(&cfg, 32, 8, 128);          // heads, kv heads, head dim
 *     cfg.causal = 1;
 *     fmha_forward_args a = {0};
 *     a.q   = fmha_tensor_bshd(q, FMHA_DTYPE_BF16, B, Sq, 32, 128);
 *     a.k   = fmha_tensor_bshd(k, FMHA_DTYPE_BF16, B, Sk,  8, 128);
 *     a.v   = fmha_tensor_bshd(v, FMHA_DTYPE_BF16, B, Sk,  8, 128);
 *     a.out = fmha_tensor_bshd(o, FMHA_DTYPE_BF16, B, Sq, 32, 128);
 *     if (fmha_forward(&cfg, &a) != FMHA_STATUS_OK)
 *         fprintf(stderr, "%s\n", fmha_last_error());
 *
 * Usage (a layer built once, run many times):
 *
 *     fmha_layer *layer;
 *     if (fmha_layer_init(&layer, &cfg) != FMHA_STATUS_OK) ...;   // GQA shape checked here
 *     fmha_layer_forward(layer, &a);   // as often as needed
 *     fmha_layer_free(layer);
 *
 * Usage (FP8 E4M3 on the CPU): either quantize yourself and pass the scales,
 *
 *     fmha_quantize_fp8(&q16, &a.q, &sq, FMHA_FP8_PER_TENSOR, 0);   // and k, v
 *     cfg.dtype = FMHA_DTYPE_F8_E4M3;                               // out stays bf16
 *     a.descale_q = &sq; a.descale_k = &sk; a.descale_v = &sv;
 *
 * or let a bf16 layer do it on every call (and ask it which path it took):
 *
 *     cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
 *     fmha_layer_init(&layer, &cfg);
 *     fmha_layer_get_path(layer, &reason);   // FP8, or a fallback to bf16 and why
 *
 * Rules the library keeps: it never prints and never exits. Its mutable global
 * state is a thread-local last-error message and, in the CUDA backend, two
 * process-wide caches guarded for concurrent use: a stream-ordered memory
 * pool per device (scratch of split and FP8 calls, kept between calls) and the
 * occupancy of each Hopper kernel variant per device. On any error nothing
 * is written to `out` or `lse` (nor, in a backward, to dq, dk or dv).
 */
#ifndef FMHA_H
#define FMHA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* FMHA_API marks the functions libfmha.so exports: the library compiles with
 * hidden visibility, so that nothing but this header's functions reaches its
 * dynamic symbol table. Declaring them visible is harmless where the library
 * is linked statically. Define FMHA_API before including this header to
 * override it. */
#ifndef FMHA_API
#if defined(__GNUC__) || defined(__clang__)
#define FMHA_API __attribute__((visibility("default")))
#else
#define FMHA_API
#endif
#endif

#define FMHA_VERSION_MAJOR  0
#define FMHA_VERSION_MINOR  1
#define FMHA_VERSION_PATCH  0
#define FMHA_VERSION_STRING "0.1.0"

/* ------------------------------------------------------------------ status */

typedef enum fmha_status {
    FMHA_STATUS_OK = 0,
    FMHA_STATUS_INVALID_ARGUMENT, /* the caller passed something impossible */
    FMHA_STATUS_UNSUPPORTED,      /* valid, but no backend here can run it */
    FMHA_STATUS_OUT_OF_MEMORY,
    FMHA_STATUS_BACKEND_ERROR /* a device runtime failed; message has its text */
} fmha_status;

/* A fixed name for a status ("FMHA_STATUS_INVALID_ARGUMENT"). */
FMHA_API const char *fmha_status_string(fmha_status status);

/* The specific message of the last failed call on this thread ("" if none).
 * Valid until the next fmha call on the same thread. */
FMHA_API const char *fmha_last_error(void);

/* ------------------------------------------------------------------ dtypes */

typedef enum fmha_dtype {
    FMHA_DTYPE_F32 = 0,
    FMHA_DTYPE_F16,
    FMHA_DTYPE_BF16,
    FMHA_DTYPE_F8_E4M3 /* FP8 E4M3 q/k/v with descales (CPU, and Hopper GPUs; see
                          fmha_forward_args), written by fmha_quantize_fp8; never an output dtype */
} fmha_dtype;

FMHA_API const char *fmha_dtype_name(fmha_dtype dtype); /* "f32", "f16", "bf16", "f8_e4m3" */
FMHA_API size_t fmha_dtype_size(fmha_dtype dtype);      /* bytes per element, 0 if unknown */

/* ----------------------------------------------------------------- tensors */

/* A 4-d view [batch, seqlen, heads, head_dim] with strides in elements.
 * stride_dim must be 1 (the last dimension is contiguous); the other strides
 * are free (>= 0), so BSHD tensors and BHSD views (torch's transpose(1, 2)) are
 * both taken without copies, and a stride of 0 broadcasts an input.
 *
 * The rows of `out` must not overlap: along each dim of size > 1 its stride
 * is at least head_dim (else INVALID_ARGUMENT), since overlapping rows would
 * hold whichever write came last. Overlaps that only two dims make together,
 * and out sharing memory with q, k, v or lse, are not detected and leave the
 * output undefined; the one exception is out being q's very view (same data,
 * strides and dtype, head_dim_v = head_dim), which the CPU computes in place.
 *
 * A packed variable-length tensor [total_tokens, heads, head_dim] is a view
 * with batch = 1 and seqlen = total_tokens (fmha_tensor_packed builds one). */
typedef struct fmha_tensor {
    void *data;
    fmha_dtype dtype;
    int64_t batch, seqlen, heads, head_dim;
    int64_t stride_batch, stride_seq, stride_head, stride_dim;
} fmha_tensor;

/* Contiguous [batch, seqlen, heads, head_dim]. */
FMHA_API fmha_tensor fmha_tensor_bshd(void *data, fmha_dtype dtype, int64_t batch, int64_t seqlen,
                                      int64_t heads, int64_t head_dim);
/* Contiguous [batch, heads, seqlen, head_dim] memory, seen as BSHD. */
FMHA_API fmha_tensor fmha_tensor_bhsd(void *data, fmha_dtype dtype, int64_t batch, int64_t seqlen,
                                      int64_t heads, int64_t head_dim);
/* Contiguous packed [total_tokens, heads, head_dim]. */
FMHA_API fmha_tensor fmha_tensor_packed(void *data, fmha_dtype dtype, int64_t total_tokens,
                                        int64_t heads, int64_t head_dim);

/* ------------------------------------------------------------ configuration */

typedef enum fmha_device { FMHA_DEVICE_CPU = 0, FMHA_DEVICE_CUDA } fmha_device;

/* Instruction set for the CPU backend. AUTO picks the best the CPU and OS
 * support, except that avx512-bf16 is taken only where vdpbf16ps runs at twice
 * the FMA's rate (AMD; on Intel CPUs the f32 kernels are faster on bf16 inputs,
 * see bench/RESULTS.md). The environment variable
 * FMHA_CPU_ISA=scalar|avx2|avx512|avx512-bf16 overrides AUTO (a forced ISA the
 * machine lacks is an error, not a silent downgrade). */
typedef enum fmha_cpu_isa {
    FMHA_CPU_ISA_AUTO = 0,
    FMHA_CPU_ISA_SCALAR,      /* portable C, any CPU */
    FMHA_CPU_ISA_AVX2,        /* AVX2 + FMA + F16C */
    FMHA_CPU_ISA_AVX512,      /* AVX-512 F/BW/VL/DQ, f32 arithmetic for every input dtype */
    FMHA_CPU_ISA_AVX512_BF16, /* as AVX512, with bf16 inputs on vdpbf16ps (AVX512_BF16) */
    FMHA_CPU_ISA_LAST = FMHA_CPU_ISA_AVX512_BF16
} fmha_cpu_isa;

FMHA_API const char *fmha_cpu_isa_name(fmha_cpu_isa isa);
/* The best ISA this CPU and OS support (never AUTO). */
FMHA_API fmha_cpu_isa fmha_cpu_isa_detect(void);

/* FP8 compute for f32/f16/bf16 inputs (fmha_config.fp8_compute), SGLang's
 * SGLANG_DIFFUSION_AITER_FP8_ATTN=1: on each call the layer quantizes q, k
 * and v to FP8 E4M3 into scratch it owns (fmha_quantize_fp8, or on a CUDA
 * layer fmha_quantize_fp8_cuda on args.stream into device memory), runs FP8
 * attention with their descales and writes `out` in out's dtype. On CUDA the
 * FP8 kernel needs a Hopper GPU and takes per-tensor scales; per-block ones
 * fall back. The layer
 * decides at init whether an FP8 kernel takes its configuration; if none
 * does, it runs cfg.dtype instead and says why (fmha_layer_get_path). The
 * environment variable FMHA_FP8_ATTN=0 sends every such layer to that
 * fallback: a switch for operators, like FMHA_CPU_ISA.
 *
 * fmha_config.fp8_smooth_k = 1 also subtracts, before quantizing, the mean of
 * K over its tokens, per KV head and channel (one mean per batch entry, or
 * over all tokens of a packed batch). Each query's scores then all move by
 * the same q . mean, which the softmax ignores, so the answer is unchanged
 * while channels with a large common offset (K's outliers in trained models)
 * no longer dominate the quantization (bench/RESULTS.md, FP8 accuracy, has
 * the measured error with and without it). The LSE is corrected by
 * scale * (q . mean). It needs softcap 0 (tanh is not shift-invariant).
 * CPU and CUDA layers alike (on CUDA: three launches before the quantizer,
 * and K's f32 copy in the layer's device scratch). */
typedef enum fmha_fp8_compute {
    FMHA_FP8_COMPUTE_OFF = 0,    /* q, k, v run in cfg.dtype (default) */
    FMHA_FP8_COMPUTE_PER_TENSOR, /* one scale per tensor, amax / 448 */
    FMHA_FP8_COMPUTE_PER_BLOCK,  /* one scale per (batch, head, FMHA_FP8_BLOCK_ROWS tokens):
                                    outliers spoil only their own block */
    FMHA_FP8_COMPUTE_INT8_QK     /* Q K^T on INT8, P V on FP8 (below); Hopper GPUs */
} fmha_fp8_compute;

/* FMHA_FP8_COMPUTE_INT8_QK, the accurate mode: K's per-channel mean is
 * subtracted (as fp8_smooth_k does; always on here), q and k are rotated by
 * the orthonormal Hadamard matrix where head_dim is a power of two from 32 to
 * 256 (q . k unchanged; channel outliers spread over every channel), then
 * coded to INT8: q with one scale per (token, head), k one per (sequence, KV
 * head). S = Q K^T runs on INT8 tensor cores with exact integer sums; v is
 * e4m3 with one scale per (sequence, KV head), and P V runs as for the other
 * modes. Measured against per-tensor e4m3 (bench/RESULTS.md, low-precision
 * modes): a quarter of its error on DiT-like inputs, three quarters on
 * Gaussian noise, where the 8-bit P and V dominate. Needs softcap 0 and a
 * Hopper GPU (other devices run cfg.dtype and say why). */

#define FMHA_FP8_BLOCK_ROWS 128

/* A layer's configuration: the attention shape of one model layer plus its
 * options. Fill it with fmha_config_init, then change fields. */
typedef struct fmha_config {
    int64_t num_heads;    /* query heads */
    int64_t num_kv_heads; /* key/value heads; must divide num_heads (GQA/MQA) */
    int64_t head_dim;     /* query/key head dim */
    int64_t head_dim_v;   /* value/output head dim (fmha_config_init: = head_dim) */
    fmha_dtype dtype;     /* dtype of q, k and v (out may differ); default bf16 */
    double softmax_scale; /* > 0; 0 means 1/sqrt(head_dim) */
    int causal;           /* bottom-right aligned: key j visible to query i iff j <= i + sk - sq */
    int64_t window_left;  /* sliding window; -1 = unlimited (default). Key j is visible   */
    int64_t window_right; /* to query i iff i+sk-sq-left <= j <= i+sk-sq+right           */
    double softcap;       /* 0 = off; else scores become softcap * tanh(score * scale / softcap) */
    double dropout_p;     /* in [0, 1); kept probabilities are scaled by 1 / (1 - p) */
    fmha_device device;   /* default CPU */
    fmha_cpu_isa cpu_isa; /* default AUTO */
    int num_threads;      /* CPU threads; 0 = OpenMP's default */
    fmha_fp8_compute fp8_compute; /* default OFF; needs f32, f16 or bf16 cfg.dtype */
    int fp8_smooth_k;             /* 0 or 1: with fp8_compute, K's mean out first (above);
                                     no effect while fp8_compute is off */
    int check_finite;             /* 0 or 1: each call first reads q, k and v and refuses NaN or inf
                         (INVALID_ARGUMENT naming the tensor, the count and the first
                         index; docs/reliability.md says what they would give) */
    int deterministic;            /* 0 or 1: the backward gives the same bits on every run. The CPU
                          backward is deterministic whatever this says (no atomics: dq is
                          summed per query tile, dk and dv per key tile, each by one
                          thread in a fixed order, so the thread count does not change
                          the bits either); the flag is for backends whose fast backward
                          adds with atomics. The forward is deterministic everywhere. */
} fmha_config;

/* Sets the shape and defaults: head_dim_v = head_dim, bf16, scale 0 (= 1/sqrt(d)),
 * no mask, no softcap, no dropout, CPU, AUTO ISA, default threads, no FP8 compute,
 * no finite check, deterministic 0. */
FMHA_API void fmha_config_init(fmha_config *cfg, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim);

/* -------------------------------------------------------------- forward args */

/* Where the descales of f8_e4m3 q, k and v sit (fmha_forward_args): element
 * x of an FP8 tensor stands for fmha_e4m3_to_f32(x) * descale. Each array is
 * contiguous f32. */
typedef enum fmha_descale_layout {
    FMHA_DESCALE_PER_TENSOR = 0, /* descale_q[1], descale_k[1], descale_v[1] */
    FMHA_DESCALE_PER_KV_HEAD,    /* FlashAttention-3's: each [batch, num_kv_heads]; query head h
                                    reads q's entry of its KV head, h / (num_heads / num_kv_heads).
                                    Packed batches: batch = varlen_batch, one row per sequence */
    FMHA_DESCALE_PER_BLOCK       /* as fmha_quantize_fp8's FMHA_FP8_PER_BLOCK writes them, tensor
                                    by tensor, with R = descale_block_rows tokens per block:
                                    q    [q.batch, num_heads,    ceil(q.seqlen / R)]
                                    k, v [k.batch, num_kv_heads, ceil(k.seqlen / R)]
                                    (packed tensors: batch 1, blocks over the packed tokens) */
} fmha_descale_layout;

/* An attention mask or additive bias of a forward call (fmha_forward_args.mask):
 * element (b, h, i, j) — sequence b, query head h, query i and key j, i and j
 * positions inside their own sequence — at
 *     data + b * stride_batch + h * stride_head + i * stride_q + j * stride_k
 * elements. A stride of 0 broadcasts (torch's [1, 1, sq, sk] masks, or
 * [batch, 1, 1, sk] padding masks, expanded). FMHA_MASK_BOOL: one byte per
 * element, 0 hides key j from query i (torch's False), any other value keeps
 * it. FMHA_MASK_ADD_*: a value added to the scaled score (after softcap),
 * -inf hiding the key; +inf or NaN make the row NaN. A row every key of
 * which is hidden gets out = 0 and lse = -inf, as rows that causal or window
 * masks leave without keys. Packed batches index b by sequence, i and j
 * inside it: the mask of a padded batch of the same sequences. */
typedef enum fmha_mask_type {
    FMHA_MASK_BOOL = 0, /* uint8 / torch.bool */
    FMHA_MASK_ADD_F32,
    FMHA_MASK_ADD_F16,
    FMHA_MASK_ADD_BF16
} fmha_mask_type;

typedef struct fmha_attn_mask {
    const void *data; /* NULL = no mask */
    fmha_mask_type type;
    int64_t stride_batch, stride_head, stride_q, stride_k; /* elements, >= 0 */
} fmha_attn_mask;

/* Arguments of one forward call.
 *
 * Padded batch (cu_seqlens_q == NULL):
 *   q   [batch, seqlen_q, num_heads,    head_dim]
 *   k   [batch, seqlen_k, num_kv_heads, head_dim]
 *   v   [batch, seqlen_k, num_kv_heads, head_dim_v]
 *   out [batch, seqlen_q, num_heads,    head_dim_v]
 *   lse [batch, num_heads, seqlen_q] contiguous f32 (optional, may be NULL)
 *
 * Packed variable-length batch (cu_seqlens_q != NULL): q, k, v and out are
 * packed tensors (batch = 1) of total_q / total_k tokens; sequence b owns
 * q tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]) and k/v tokens
 * [cu_seqlens_k[b], cu_seqlens_k[b+1]). Both arrays have varlen_batch + 1
 * int32 entries, start at 0, never decrease, and end within the tensor.
 *   lse [num_heads, total_q] contiguous f32 (optional)
 * max_seqlen_q / max_seqlen_k are upper bounds of the per-sequence lengths
 * (0 = let fmha compute them).
 *
 * Rows with no visible key get out = 0 and lse = -inf.
 *
 * Dropout draws from Philox4x32-10 keyed by `seed`, counter (key column / 4,
 * query row, sequence * num_heads + head, low 32 bits of `offset`), with the
 * high 32 bits of `offset` xor-ed into the key's high word; word (column % 4)
 * of the output keeps the element iff word >= floor(p * 2^32). Rows and
 * columns are positions inside their own sequence, so every backend draws the
 * same mask.
 *
 * FP8 inputs: q, k and v all f8_e4m3 (cfg.dtype), out f32, f16 or bf16. The
 * descales are f32 arrays laid out as descale_layout says, in the same memory
 * as q (host memory for the CPU, device memory for CUDA); NULL stands for
 * descales of 1. Every descale must be finite and > 0: the CPU checks them;
 * on CUDA they stay in device memory unread by the host, and a descale <= 0
 * gives undefined output there.
 * Inputs of other dtypes take no descales: the pointers must be NULL.
 * On CUDA, FP8 runs on Hopper (compute capability 9.0) only, with per-tensor
 * or per-KV-head descales; q and k rows must start 16-byte aligned (strides
 * multiples of 16 elements). P (the softmax) is multiplied in e4m3 there, and
 * each call transposes v into pooled device scratch first. Past 16384 keys
 * each key tile's P V is added to O in f32 (two-level accumulation, against
 * the error of FP8 accumulation over long key ranges); FMHA_FP8_ACCUM=
 * two_level or single forces one mode for every length, auto is the default.
 *
 * Score modifiers, in this order, on s = scale * q . k (after softcap):
 *   s + mask(b, h, i, j) (FMHA_MASK_ADD_*; fmha_attn_mask above)
 *     - alibi_slopes[b * alibi_stride_batch + h] * |i + sk - sq - j|
 * (ALiBi aligned as causal masks are, bottom-right; alibi_stride_batch 0:
 * one slope per head for every sequence, num_heads: flash-attn's [batch,
 * num_heads] slopes); a FMHA_MASK_BOOL mask, causal and windows hide keys.
 * sinks[num_heads] add one logit per head to every row's softmax as a key of
 * value 0 (attention sinks): out = sum_j e^(s_j) v_j / (e^sink + sum_j
 * e^(s_j)), lse = log(e^sink + sum_j e^(s_j)); a row with no visible key gets
 * out 0 and lse = sink. Slopes must be finite and sinks not NaN (-inf: no
 * sink). Mask, slopes and sinks sit in q's memory. CPU layers run them, and
 * the forward, backward and decode of f16/bf16 CUDA layers (the forward on
 * the portable kernel: Hopper calls with them take it instead); FP8 on CUDA
 * answers UNSUPPORTED. fmha_sp_args has none of them.
 *
 * On a CUDA layer every pointer (tensors, lse, cu_seqlens, descales) is device
 * memory (host memory is refused), q/k/v are f16 or bf16 (or f8_e4m3, above),
 * head dims are at most 256 (the f16/bf16 forward: 512, those above 256 on
 * the portable kernel; the backward, decode and FP8 stop at 256), and the
 * call returns once the kernel is queued on
 * `stream`. A packed batch
 * copies cu_seqlens to the host first, so that they can be validated: one
 * small copy per call on `stream`, after the work queued there (which may
 * write them), waited for, unless the call gives both max_seqlen_q
 * and max_seqlen_k (f16/bf16 inputs, fp8_compute off). Then the host reads
 * no offset and the call can be captured in a CUDA graph: the bounds stand
 * for the longest sequences, and the device checks the offsets against the
 * rules above and the bounds. Where one breaks them (there is no host to
 * refuse the call), nothing is computed and every row of out and of lse is
 * NaN. */
typedef struct fmha_forward_args {
    fmha_tensor q, k, v, out;
    float *lse;
    const int32_t *cu_seqlens_q; /* NULL = padded batch */
    const int32_t *cu_seqlens_k;
    int64_t varlen_batch;
    int64_t max_seqlen_q, max_seqlen_k;
    uint64_t seed, offset; /* dropout stream */
    void *stream;          /* cudaStream_t for the CUDA backend; NULL = default stream */
    const float *descale_q, *descale_k, *descale_v; /* f8_e4m3 inputs only; NULL = 1 */
    fmha_descale_layout descale_layout;
    int64_t descale_block_rows; /* tokens per block for FMHA_DESCALE_PER_BLOCK */
    /* Score modifiers (above); each NULL = none */
    fmha_attn_mask mask;
    const float *alibi_slopes; /* [num_heads], or [batch, alibi_stride_batch >= num_heads] */
    int64_t alibi_stride_batch;
    const float *sinks; /* [num_heads] */
} fmha_forward_args;

/* ------------------------------------------------------- merging partials */

/* Merges attention outputs of the same queries computed over disjoint sets
 * of keys (a split of the keys, a ring's steps, cached and new keys) into the
 * output over all of them, by their LSEs:
 *
 *     lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) * parts[i]
 *
 * in f32 (weights exp(lse_i - max) once per row), so the result is the
 * attention over the union to f32 rounding.
 *   parts[i] [batch, seqlen, heads, head_dim_v] f32, f16 or bf16, one dtype for
 *            all (f32 keeps partial results exact), any strides as in
 *            fmha_forward_args.out
 *   lses[i]  [batch, heads, seqlen] contiguous f32, the forward's lse of part i
 *            (packed batches: batch 1, [heads, total_q], as the forward writes it)
 *   out      same shape, f32, f16 or bf16, its own strides; may be exactly one
 *            part's view (same data and strides), merged in place
 *   lse      [batch, heads, seqlen] f32, the merged LSE (optional, may be NULL;
 *            may be one part's lse array)
 * A part whose LSE is -inf saw no key: it weighs 0 and its output is not read
 * (it may hold anything); a row that no part saw is out 0, lse -inf, as in
 * the forward. A NaN (or +inf) LSE makes its row NaN, out and lse, and a NaN
 * or inf element of a part that weighs something spreads to the same
 * element of out (docs/reliability.md). 1 to 32 parts per call; more merge in
 * steps. Every argument is validated before anything is written; batch 0 or
 * seqlen 0 writes nothing. The CPU runs on OpenMP's threads. */
FMHA_API fmha_status fmha_merge_partials(int num_parts, const fmha_tensor *parts,
                                         const float *const *lses, fmha_tensor *out, float *lse);

/* fmha_merge_partials on the current CUDA device: the same arguments and
 * semantics with every pointer (tensor data, lses, lse) in device memory and
 * the work queued on `stream` (a cudaStream_t; NULL = the default stream),
 * one launch. UNSUPPORTED when fmha was built without CUDA or finds no
 * device of compute capability 8.0 or later. */
FMHA_API fmha_status fmha_merge_partials_cuda(int num_parts, const fmha_tensor *parts,
                                              const float *const *lses, fmha_tensor *out,
                                              float *lse, void *stream);

/* --------------------------------------------------- sequence parallelism */

/* Attention over a sequence spread across ranks (docs/sequence_parallel.md):
 * every rank holds some tokens of q, k and v, and fmha_sp_forward gives each
 * its tokens' output, equal to a single-device forward over the whole
 * sequence (dropout included: every piece draws the single-device mask).
 *
 *   Ulysses (degree u): an all-to-all turns each rank's [B, S/u, H, D] into
 *     [B, S, H/u, D], attention runs on whole sequences of H/u heads, and a
 *     second all-to-all turns the output back.
 *   Ring (degree r): K/V blocks travel around the ring, the next one in
 *     flight while the current one is attended to (two buffers), and the
 *     partial outputs are merged by their LSEs (fmha_merge_partials).
 *   Both: ranks = u x r; the u ranks of a ring slot do Ulysses, the r slots a
 *     ring. Rank p is ring slot p / u, Ulysses member p % u (put the Ulysses
 *     ranks on one node: its all-to-all is the heavier traffic).
 *
 * Communication goes through the caller's own communicator (fmha_comm, made
 * from an MPI_Comm or an ncclComm_t); fmha never starts processes or opens
 * connections of its own.
 *
 * Usage (MPI, CPU ranks; fmha_sp.h gives typed helpers):
 *
 *     fmha_comm *comm;
 *     fmha_comm_init(&comm, FMHA_COMM_MPI, &mpi_comm, NULL);   // collective
 *     fmha_sp_config sp;
 *     fmha_sp_config_init(&sp, 2, 2);                          // u = 2, r = 2
 *     int64_t start[2], len[2]; int nseg;
 *     fmha_sp_tokens(&sp, S, fmha_comm_rank(comm), start, len, &nseg);   // my tokens
 *     fmha_sp_args a = {0};
 *     a.seqlen = S;
 *     a.q = fmha_tensor_bshd(q, FMHA_DTYPE_BF16, B, len[0] + (nseg > 1 ? len[1] : 0), H, D);
 *     ...
 *     fmha_sp_forward(&cfg, &sp, comm, &a);                    // collective
 *     fmha_comm_free(comm);
 */

/* Which communication library a fmha_comm wraps. */
typedef enum fmha_comm_kind {
    FMHA_COMM_MPI = 1, /* an MPI_Comm; host memory, cfg.device CPU */
    FMHA_COMM_NCCL     /* an ncclComm_t and a cudaStream_t; device memory, cfg.device CUDA */
} fmha_comm_kind;

typedef struct fmha_comm fmha_comm;

/* 1 if this build has the communicator of `kind` (CMake's FMHA_MPI /
 * FMHA_NCCL found the library), else 0. */
FMHA_API int fmha_comm_built(fmha_comm_kind kind);
/* "mpi", "nccl". */
FMHA_API const char *fmha_comm_kind_name(fmha_comm_kind kind);

/* Wraps the caller's communicator; the caller keeps it and frees it after
 * fmha_comm_free.
 *   MPI:  `handle` points to an MPI_Comm of the MPI this fmha was built
 *         with (fmha_comm_built), initialized; `stream` must be NULL.
 *         Collective: fmha duplicates the communicator (MPI_Comm_dup), so
 *         that its messages never meet the caller's, and sets its errors to
 *         return rather than abort.
 *   NCCL: `handle` points to an ncclComm_t, `stream` is the cudaStream_t
 *         fmha_sp_forward queues its work on (NULL: the default stream). fmha
 *         adds a stream of its own on the current device for the transfers,
 *         so that they overlap attention.
 * UNSUPPORTED where this build lacks the kind (the message says how to build
 * it in). One call at a time on a comm (as on the communicator it wraps).
 * A comm keeps the local layer of its latest fmha_sp_forward (its plan and
 * workspace) for the next call with the same configuration: the
 * environment's knobs (FMHA_CPU_ISA, ...) are read when it is made. */
FMHA_API fmha_status fmha_comm_init(fmha_comm **comm, fmha_comm_kind kind, const void *handle,
                                    void *stream);
FMHA_API void fmha_comm_free(fmha_comm *comm);
/* This process's rank and the number of ranks (-1 for a NULL comm). */
FMHA_API int fmha_comm_rank(const fmha_comm *comm);
FMHA_API int fmha_comm_size(const fmha_comm *comm);
/* Bytes this rank has sent through `comm` so far (-1 for a NULL comm): what
 * a benchmark compares with the cost model's traffic. */
FMHA_API int64_t fmha_comm_bytes_sent(const fmha_comm *comm);

/* Which tokens of the sequence a rank holds. */
typedef enum fmha_sp_layout {
    FMHA_SP_LAYOUT_CONTIGUOUS = 0, /* ring slot i: tokens [i S / r, (i + 1) S / r) */
    FMHA_SP_LAYOUT_ZIGZAG          /* the sequence cut in 2r chunks; ring slot i holds chunks
                                      i and 2r - 1 - i, so that under a causal mask every
                                      slot has the same work (no rank idles) */
} fmha_sp_layout;

/* Text tokens that every rank holds whole (joint attention: Flux, SD3,
 * HunyuanVideo), joined to the distributed tokens in front or at the rear. */
typedef enum fmha_sp_joint {
    FMHA_SP_JOINT_NONE = 0,
    FMHA_SP_JOINT_FRONT, /* the sequence is [text, distributed tokens] */
    FMHA_SP_JOINT_REAR   /* the sequence is [distributed tokens, text] */
} fmha_sp_joint;

typedef struct fmha_sp_config {
    int ulysses, ring;     /* degrees: ulysses x ring = the communicator's size */
    fmha_sp_layout layout; /* default CONTIGUOUS */
} fmha_sp_config;

FMHA_API void fmha_sp_config_init(fmha_sp_config *sp, int ulysses, int ring);

/* The tokens rank `rank` holds of a sequence of `seqlen` tokens, in the
 * order it holds them: *nseg (1 or 2) runs of len[i] tokens from start[i].
 * Ring slot i's tokens (fmha_sp_layout) are cut into u consecutive pieces,
 * one per Ulysses member; a cut of n into k is at n * j / k, so sizes that
 * do not divide give pieces that differ by one token. */
FMHA_API fmha_status fmha_sp_tokens(const fmha_sp_config *sp, int64_t seqlen, int rank,
                                    int64_t start[2], int64_t len[2], int *nseg);

/* Arguments of one sequence-parallel forward, on every rank:
 *   q, k, v, out  this rank's tokens (fmha_sp_tokens), [batch, n, heads,
 *                 head_dim] as in fmha_forward_args (any strides)
 *   lse           [batch, num_heads, n] f32 (optional)
 *   seqlen        the distributed tokens of the whole sequence
 *   joint         text tokens: q_joint, k_joint, v_joint [batch, T, heads,
 *                 head_dim], the same on every rank; out_joint (and lse_joint
 *                 [batch, num_heads, T], optional) is written on every rank
 *   seed, offset  the dropout stream, the same on every rank
 *   cu_seqlens, varlen_batch
 *                 packed sequences (0 and NULL: a padded batch): the whole
 *                 sequences' offsets, varlen_batch + 1 int32 in host memory,
 *                 the same on every rank, seqlen = cu_seqlens[varlen_batch].
 *                 Each sequence is sharded as fmha_sp_tokens shards a
 *                 sequence of its length, and a rank's q, k, v and out hold
 *                 its tokens of sequence 0, then those of sequence 1, and so
 *                 on: batch 1, lse [num_heads, n] (fmha_forward's packed
 *                 layout). No joint tokens.
 * Masks (causal, windows) apply to positions in the whole sequence (text
 * included; of packed sequences, each sequence's own). */
typedef struct fmha_sp_args {
    fmha_tensor q, k, v, out;
    float *lse;
    int64_t seqlen;
    fmha_sp_joint joint;
    fmha_tensor q_joint, k_joint, v_joint, out_joint;
    float *lse_joint;
    uint64_t seed, offset;
    const int32_t *cu_seqlens;
    int64_t varlen_batch;
} fmha_sp_args;

/* Collective over `comm`: every rank calls it with the same configuration
 * and its own tokens. GQA: num_kv_heads must divide by ulysses (each rank
 * gets num_kv_heads / u of them), or ulysses by num_kv_heads, in which case
 * each KV head is sent to the u / num_kv_heads ranks whose query heads use
 * it (replicated, as xDiT and sglang do); anything else is
 * INVALID_ARGUMENT naming both numbers. On the MPI communicator the call
 * returns with the results written; on NCCL, once the work is queued on the
 * communicator's stream. Every argument is validated on each rank before any
 * message is sent, so a refused call sends nothing (if ranks disagree — one
 * refuses, another does not — the others wait: check on every rank). */
FMHA_API fmha_status fmha_sp_forward(const fmha_config *cfg, const fmha_sp_config *sp,
                                     fmha_comm *comm, const fmha_sp_args *args);

/* ------------------------------------------------------------- backward args */

/* Arguments of one backward call: the gradients of a forward call's inputs
 * given the gradient of its output. q, k, v, cu_seqlens, max_seqlen, seed and
 * offset are exactly the forward's (the dropout mask is drawn again from the
 * same Philox stream, never stored); out and lse are what the forward wrote.
 *
 * Padded batch (cu_seqlens_q == NULL):
 *   q, dq    [batch, seqlen_q, num_heads,    head_dim]
 *   k, dk    [batch, seqlen_k, num_kv_heads, head_dim]
 *   v, dv    [batch, seqlen_k, num_kv_heads, head_dim_v]
 *   out, dout [batch, seqlen_q, num_heads,   head_dim_v]
 *   lse      [batch, num_heads, seqlen_q] contiguous f32 (required)
 * Packed batch: as fmha_forward_args, every tensor packed, lse [num_heads, total_q].
 *
 * dout may be f32, f16 or bf16 whatever out's dtype is. dq, dk and dv are
 * written in their own views' dtypes (f32, f16 or bf16) and layouts; a view
 * whose data is NULL is not wanted and not computed (its other fields are
 * not read). With GQA/MQA, dk and dv of a KV head are the sums over the
 * query heads it serves. Rows of packed dq, dk and dv outside every sequence
 * are written 0. Gradient rows must not overlap (as out's, fmha_tensor) and
 * must not share memory with the inputs. f8_e4m3 inputs (and fp8_compute
 * layers) have no backward: UNSUPPORTED. Score modifiers (CPU and f16/bf16
 * CUDA layers) are the forward's; no gradient flows into the mask or the
 * slopes, and dsinks[h] =
 * -sum over the rows of head h of e^(sink_h - lse) (dout . out). */
typedef struct fmha_backward_args {
    fmha_tensor q, k, v, out, dout;
    const float *lse;
    fmha_tensor dq, dk, dv;      /* data NULL: not wanted */
    const int32_t *cu_seqlens_q; /* NULL = padded batch */
    const int32_t *cu_seqlens_k;
    int64_t varlen_batch;
    int64_t max_seqlen_q, max_seqlen_k;
    uint64_t seed, offset; /* the forward's dropout stream */
    void *stream;          /* cudaStream_t for the CUDA backend; NULL = default stream */
    /* The forward's score modifiers (fmha_forward_args), and the gradient of
       the sinks: dsinks[num_heads] f32, written (NULL: not wanted; needs sinks) */
    fmha_attn_mask mask;
    const float *alibi_slopes;
    int64_t alibi_stride_batch;
    const float *sinks;
    float *dsinks;
} fmha_backward_args;

/* ------------------------------------------------------------ kernel choice */

typedef struct fmha_kernel_info {
    int id; /* index in fmha's kernel table (src/kernels.def) */
    fmha_device device;
    fmha_cpu_isa cpu_isa; /* for CPU kernels */
    const char *name;     /* e.g. "cpu_avx512_bf16dp": static storage */
} fmha_kernel_info;

/* The one place that decides which kernel runs a configuration — and so
 * whether it is supported at all. Returns OK and fills `info`, or
 * INVALID_ARGUMENT / UNSUPPORTED with the reason in fmha_last_error().
 * fmha_layer_init and fmha_forward call exactly this. */
FMHA_API fmha_status fmha_kernel_select(const fmha_config *cfg, fmha_kernel_info *info);

/* The same for the backward: which kernel fmha_layer_backward and
 * fmha_backward would run for cfg, or UNSUPPORTED and why (no backward for
 * f8_e4m3 inputs or fp8_compute; on CUDA f16/bf16 inputs and head dims up
 * to 256). */
FMHA_API fmha_status fmha_kernel_select_backward(const fmha_config *cfg, fmha_kernel_info *info);

/* -------------------------------------------------------------------- layer */

typedef struct fmha_layer fmha_layer;

/* Validates the configuration (e.g. "num_heads (28) must be a multiple of
 * num_kv_heads (6) ..."), makes the layer's plan once — its kernel, the
 * kernel's variant and its workspace — and owns the workspace. The
 * environment variables fmha reads (FMHA_CPU_ISA, FMHA_CUDA_KERNEL,
 * FMHA_CUDA_SCHEDULE, FMHA_CUDA_CLUSTER, FMHA_FP8_ACCUM, FMHA_FP8_ATTN, and
 * the tuning knob FMHA_CUDA_DECODE_L2PF: 0, 128 or 256, default 256) are
 * read here, once: a layer keeps what they said at its init, and a bad value
 * is INVALID_ARGUMENT here. */
FMHA_API fmha_status fmha_layer_init(fmha_layer **layer, const fmha_config *cfg);
FMHA_API void fmha_layer_free(fmha_layer *layer);

/* The configuration, and the kernel the layer's latest call ran — before the
 * first call, the kernel its plan names. (A call can run another kernel than
 * the plan's: on CUDA, views whose rows the Hopper kernel's tensor copies
 * cannot address run on the portable kernel.) */
FMHA_API const fmha_config *fmha_layer_config(const fmha_layer *layer);
FMHA_API const fmha_kernel_info *fmha_layer_kernel(const fmha_layer *layer);

/* One line about what the latest call ran (before the first, the plan): the
 * kernel, its variant (head dim, tile) and its switches, e.g.
 * "cuda_hopper_sm90 (WGMMA): bf16 inputs, head dim 128 variant, tile 128x176,
 * schedule split, clusters auto". Writes "" for a NULL layer. */
FMHA_API void fmha_layer_describe(const fmha_layer *layer, char *buf, size_t len);

/* How a layer computes, decided once at fmha_layer_init. */
typedef enum fmha_layer_path {
    FMHA_LAYER_PATH_DIRECT = 0,  /* fp8_compute off: q, k, v run as they come */
    FMHA_LAYER_PATH_FP8,         /* fp8_compute: quantized on each call, FP8 attention */
    FMHA_LAYER_PATH_FP8_FALLBACK /* fp8_compute asked, but no FP8 kernel takes this
                                    configuration: q, k, v run in cfg.dtype instead */
} fmha_layer_path;

/* The layer's path and, in *reason (if not NULL), one line saying why, e.g.
 * "FP8 attention is unavailable for this configuration (...): running bf16 on
 * cuda_flash_sm80 instead". The string lives as long as the layer. The
 * library never prints; a caller that wants a fallback logged once prints the
 * reason after fmha_layer_init. */
FMHA_API fmha_layer_path fmha_layer_get_path(const fmha_layer *layer, const char **reason);
/* The path's name: "direct", "fp8", "fp8_fallback". */
FMHA_API const char *fmha_layer_path_name(fmha_layer_path path);

/* Runs attention. Every argument is validated before anything is written.
 * A layer runs one call at a time: a call made while another thread's call
 * on the same layer is running is refused (INVALID_ARGUMENT, nothing
 * written); give each thread its own layer. Empty problems are answered as
 * torch does: batch 0 or seqlen_q 0 (views of batch or seqlen 0 may have NULL
 * data) write nothing and return OK; seqlen_k 0 gives every query row no
 * key, so out is 0 and lse -inf there (on the CPU; UNSUPPORTED on CUDA). On the FP8 path, q, k and v
 * must be finite (an infinity is INVALID_ARGUMENT, as in fmha_quantize_fp8)
 * and must not carry descales. */
FMHA_API fmha_status fmha_layer_forward(fmha_layer *layer, const fmha_forward_args *args);

/* One-shot convenience: init, forward, free. */
FMHA_API fmha_status fmha_forward(const fmha_config *cfg, const fmha_forward_args *args);

/* The gradients of the forward (fmha_backward_args): dq, dk and dv of the
 * loss sum(dout * out). Validated as the forward is, then on the plan's
 * backward kernel (fmha_kernel_select_backward); every argument is checked
 * before anything is written. The CPU computes in f32 (f16 and bf16 inputs
 * converted), with D = rowsum(dout * out) from the out given and the
 * softmax from the lse given, and is deterministic (fmha_config).
 * cfg.check_finite reads q, k and v first, as in the forward. Empty
 * problems: batch 0 is OK with nothing written; seqlen_q 0 gives dk = dv = 0,
 * seqlen_k 0 dq = 0. Runs on the layer's device, one call at a time as
 * fmha_layer_forward. */
FMHA_API fmha_status fmha_layer_backward(fmha_layer *layer, const fmha_backward_args *args);

/* One-shot convenience: init, backward, free. */
FMHA_API fmha_status fmha_backward(const fmha_config *cfg, const fmha_backward_args *args);

/* The float64 reference: plain loops, every feature, never fast; its
 * (sequence, head) pairs run on cfg->num_threads OpenMP threads (0: OpenMP's
 * default). Same validation and semantics as fmha_forward; CPU memory only. FP8 inputs are
 * dequantized with their descales exactly; fp8_compute is ignored (the
 * reference is the exact answer for the inputs it is given). */
FMHA_API fmha_status fmha_reference_forward(const fmha_config *cfg, const fmha_forward_args *args);

/* ------------------------------------------------------- decode: KV caches */

/* Arguments of one decode call: new queries against each sequence's cached
 * keys and values, FlashAttention's flash_attn_with_kvcache. Sequence b has
 * cache_seqlens[b] tokens in the cache; when k_new / v_new are given, their
 * seqlen_new tokens are first written into the cache after those (rotated
 * where rotary is on), and the queries then see cache_seqlens[b] + seqlen_new
 * keys. Masks are aligned as in fmha_forward_args: the last query sits at the
 * last key (causal: query i sees keys j <= i + keys - seqlen_q).
 *
 *   q        [batch, seqlen_q, num_heads, head_dim]
 *   k_cache  contiguous: [cache_batch, capacity, num_kv_heads, head_dim]
 *            paged:      [num_pages, page_size, num_kv_heads, head_dim]
 *   v_cache  as k_cache, with head_dim_v
 *   k_new, v_new  [batch, seqlen_new, num_kv_heads, head_dim / head_dim_v],
 *            or both with data NULL (and all dims 0): nothing appended
 *   out      [batch, seqlen_q, num_heads, head_dim_v]; lse [batch, num_heads,
 *            seqlen_q] contiguous f32 (optional)
 *
 * Paged caches (block_table != NULL): token t of sequence b lives in page
 * block_table[b * block_table_stride + t / page_size], slot t % page_size;
 * pages may come in any order, and the last one may be partly filled. Any
 * page size >= 1. Sequences must not share a page they append to.
 * Contiguous caches: sequence b uses row cache_batch_idx[b] of the cache
 * (NULL: row b); capacity is k_cache.seqlen.
 *
 * Rotary embedding (rotary_dim > 0; the first rotary_dim channels of q and of
 * the new keys, rotary_dim even and <= head_dim): rotary_cos and rotary_sin
 * are contiguous f32 [rotary_len, rotary_dim / 2]. Channel pairs are (c,
 * c + rotary_dim / 2) (GPT-NeoX) or, with rotary_interleaved, (2c, 2c + 1)
 * (GPT-J). New key i of sequence b is at position cache_seqlens[b] + i; with
 * causal or a window, query i is at cache_seqlens[b] + i too, else every query
 * is at cache_seqlens[b], as FlashAttention places them. The rotated keys are
 * what the cache keeps; q itself is not modified.
 *
 * Every argument is validated, on the host, before anything is written: a
 * cache length past the capacity, a page index outside [0, num_pages), a
 * block table too short for a sequence's tokens, a position past the rotary
 * table — each INVALID_ARGUMENT naming the sequence and the value, the cache
 * and out untouched. Dropout is not part of decoding: the layer's dropout_p
 * must be 0. CPU layers: f32, f16 and bf16 caches in host memory. CUDA
 * layers: f16 and bf16, every tensor and array in device memory, head dims
 * up to 256; validation reads cache_seqlens, cache_batch_idx and the block
 * table on the host, through one synchronous copy on `stream` per call (so
 * a decode call waits for the stream's earlier work before it queues its
 * own) — unless max_seqlen_k is given.
 *
 * max_seqlen_k > 0 bounds every sequence's keys (cached plus new). On the
 * CPU a sequence past it is INVALID_ARGUMENT. On CUDA it lets the call run
 * without that host copy (no synchronisation, as CUDA graph capture
 * needs): the host checks max_seqlen_k against the capacity and the
 * rotary table (which then needs rows for max_seqlen_k keys, as though
 * every sequence had them), and the kernels check each sequence's own
 * entries: a cache_seqlens entry negative or past max_seqlen_k (with the new
 * tokens) or a cache_batch_idx outside the cache, and that sequence gets
 * nothing appended; a block table entry of its keys outside the pool, and
 * nothing is written into the page it names. Either way the sequence's out rows and LSE are
 * NaN; the other sequences run as usual. The split of long caches is
 * planned for max_seqlen_k keys.
 *
 * FP8 caches: k_cache and v_cache may both be f8_e4m3 while q, k_new, v_new
 * are the layer's f16/bf16/f32 (cfg.dtype): cache element x stands for
 * fmha_e4m3_to_f32(x) * descale, the descales (k_descale, v_descale, both
 * required) laid out as kv_descale_layout says. New keys and values enter
 * such a cache as fmha_f32_to_e4m3(value / descale) (rotated first; above
 * ±448 x descale they saturate), with the descale of the row they land in:
 * a caller that wants fresh pages scaled afresh writes their descales before
 * the call. On the CPU every descale must be finite and > 0 (checked); on
 * CUDA they stay in device memory, unread by the host. */
typedef enum fmha_kv_descale_layout {
    FMHA_KV_DESCALE_PER_TENSOR = 0, /* k_descale[1], v_descale[1] */
    FMHA_KV_DESCALE_PER_HEAD,       /* [num_kv_heads] */
    FMHA_KV_DESCALE_PER_PAGE        /* [k_cache.batch, num_kv_heads]: per page of a paged cache,
                                       per cache row of a contiguous one, and KV head */
} fmha_kv_descale_layout;

typedef struct fmha_kvcache_args {
    fmha_tensor q;
    fmha_tensor k_cache, v_cache;
    fmha_tensor k_new, v_new;
    fmha_tensor out;
    float *lse;
    const int32_t *cache_seqlens;   /* [batch]; NULL = every sequence's cache is full */
    const int32_t *cache_batch_idx; /* contiguous caches: [batch]; NULL = sequence b, row b */
    const int32_t *block_table;     /* paged: [batch, block_table_stride]; NULL = contiguous */
    int64_t block_table_stride;     /* entries per sequence of block_table */
    const float *rotary_cos, *rotary_sin; /* [rotary_len, rotary_dim / 2]; NULL = no rotary */
    int64_t rotary_dim, rotary_len;
    int rotary_interleaved;
    int64_t num_splits; /* keys of a sequence split over up to this many parallel
                           tasks whose results merge by their LSEs; 0 = chosen by
                           fmha from the shape and the threads (CPU) or the
                           multiprocessors (CUDA), 1 = no split */
    void *stream;
    const float *k_descale, *v_descale; /* f8_e4m3 caches only (both required); NULL otherwise */
    fmha_kv_descale_layout kv_descale_layout;
    int64_t max_seqlen_k; /* 0, or a bound on every sequence's keys (above) */
    /* ALiBi and attention sinks as in fmha_forward_args (CPU layers), each key
       at its distance from the query's diagonal in the cache; NULL = none */
    const float *alibi_slopes;
    int64_t alibi_stride_batch;
    const float *sinks;
} fmha_kvcache_args;

/* Runs one decode call on a layer (its heads, head dims, dtype, scale, masks
 * and softcap). The layer's one-call-at-a-time rule holds (fmha_layer_forward). */
FMHA_API fmha_status fmha_layer_decode(fmha_layer *layer, const fmha_kvcache_args *args);

/* One-shot convenience: init, decode, free. */
FMHA_API fmha_status fmha_decode(const fmha_config *cfg, const fmha_kvcache_args *args);

/* The float64 reference of fmha_decode: the same validation and the same
 * writes into the cache (new keys rotated in float64, then rounded to the
 * cache's dtype), attention in float64 with q rotated in float64. */
FMHA_API fmha_status fmha_reference_decode(const fmha_config *cfg, const fmha_kvcache_args *args);

/* The float64 reference gradients: the exact dq, dk, dv of sum(dout * out)
 * for fmha_reference_forward's function, softmax and D = rowsum(dP * P)
 * recomputed in float64 from q, k, v (out and lse are validated as for
 * fmha_backward but not read). Plain loops over (sequence, KV head), on
 * cfg->num_threads threads; CPU memory only; f8_e4m3 inputs UNSUPPORTED as in
 * fmha_backward. */
FMHA_API fmha_status fmha_reference_backward(const fmha_config *cfg,
                                             const fmha_backward_args *args);

/* -------------------------------------------------------------------- CUDA */

/* 1 if this build has the CUDA backend (nvcc was found at build time). */
FMHA_API int fmha_cuda_backend_built(void);

/* Number of CUDA devices usable by this build: 0 when it was built without
 * the CUDA backend, or when no driver or GPU is present. */
FMHA_API int fmha_cuda_device_count(void);

/* One line about device `dev`, e.g. "NVIDIA H200, sm_90, 132 SMs, 139.8 GiB". */
FMHA_API fmha_status fmha_cuda_device_describe(int dev, char *buf, size_t len);

/* ---------------------------------------------------------------- utilities */

/* Element conversions (round to nearest even, NaN kept). */
FMHA_API float fmha_bf16_to_f32(uint16_t x);
FMHA_API uint16_t fmha_f32_to_bf16(float x);
FMHA_API float fmha_f16_to_f32(uint16_t x);
FMHA_API uint16_t fmha_f32_to_f16(float x);

/* FLOPs of one padded-batch forward: 2 * (head_dim + head_dim_v) per visible
 * (query, key) pair and head, so causal and window masks count only what is
 * visible (a causal square counts S(S+1)/2 pairs). */
FMHA_API double fmha_flops(const fmha_config *cfg, int64_t batch, int64_t seqlen_q,
                           int64_t seqlen_k);

/* Keep-mask bit of the dropout stream for one element (see fmha_forward_args):
 * returns 1 if element (seq, head, row, col) is kept with probability 1 - p. */
FMHA_API int fmha_dropout_keep(uint64_t seed, uint64_t offset, int64_t seq, int64_t num_heads,
                               int64_t head, int64_t row, int64_t col, double p);

/* -------------------------------------------------------------------- FP8 */

/* How fmha_quantize_fp8 groups elements under one scale. */
typedef enum fmha_fp8_scaling {
    FMHA_FP8_PER_TENSOR = 0, /* one scale for the whole tensor: scales[1] */
    FMHA_FP8_PER_HEAD,       /* one per (batch, head): scales [batch, heads] */
    FMHA_FP8_PER_BLOCK       /* one per (batch, head, block of block_rows tokens):
                                scales [batch, heads, ceil(seqlen / block_rows)] */
} fmha_fp8_scaling;

/* FP8 E4M3 (OCP E4M3FN: bias 7, 3 mantissa bits, no infinities, max finite
 * ±448 = 0x7E/0xFE, NaN = 0x7F/0xFF). Encoding rounds to nearest even, into
 * the subnormals too (smallest 2^-9); magnitudes above 448, infinities
 * included, saturate to ±448; NaN gives 0x7F or 0xFF by its sign; -0 gives
 * 0x80. Decoding is exact (0x7F/0xFF decode to NaN). */
FMHA_API uint8_t fmha_f32_to_e4m3(float x);
FMHA_API float fmha_e4m3_to_f32(uint8_t x);

/* Quantizes x to FP8 E4M3 codes with one float scale per group, on the CPU.
 *   x      [batch, seqlen, heads, head_dim] f32, f16 or bf16 (any strides, stride_dim 1)
 *   y      [batch, seqlen, heads, head_dim] f8_e4m3, same shape, its own strides
 *   scales contiguous f32, laid out as `scaling` says (fmha_fp8_scaling)
 *   block_rows tokens per block for FMHA_FP8_PER_BLOCK (the last block may be
 *          shorter); ignored otherwise.
 * Per group: amax = max |x| (NaN elements ignored), scale = amax / 448.0f in
 * float (1 if that is 0, e.g. an all-zero group), y = fmha_f32_to_e4m3(x / scale)
 * with a float division; x ≈ fmha_e4m3_to_f32(y) * scale. This is the
 * definition: other backends' quantizers match it bit for bit.
 * Infinite elements of x are INVALID_ARGUMENT (the message names the first,
 * in (batch, token, head, dim) order); NaN elements stay NaN. Every argument
 * is validated before anything is written. */
FMHA_API fmha_status fmha_quantize_fp8(const fmha_tensor *x, fmha_tensor *y, float *scales,
                                       fmha_fp8_scaling scaling, int64_t block_rows);

/* fmha_quantize_fp8 on the current CUDA device: the same arguments and the
 * same scales and codes, bit for bit, with x, y and scales in device memory
 * (host memory is refused) and the work queued on `stream` (a cudaStream_t;
 * NULL = the default stream); the call returns before the results are there.
 * One kernel launch per call. Groups of up to 64 KiB of x are read once;
 * bigger ones, and FMHA_FP8_PER_TENSOR always, twice (the whole group's amax
 * comes before its first code), the second time partly from L2. `scales`
 * serves as the kernel's scratch until the launch completes.
 * One difference: the CPU refuses an infinite x, which the GPU cannot do
 * without waiting for the kernel. Instead a group holding an infinity gets
 * scale NaN and NaN codes (0x7F / 0xFF by the sign of x); check the scales
 * if x may hold one. UNSUPPORTED when fmha was built without CUDA or finds no
 * device of compute capability 8.0 or later. */
FMHA_API fmha_status fmha_quantize_fp8_cuda(const fmha_tensor *x, fmha_tensor *y, float *scales,
                                            fmha_fp8_scaling scaling, int64_t block_rows,
                                            void *stream);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_H */
