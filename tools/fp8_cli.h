/* fp8_cli.h — the CLI's FP8 helpers: forward arguments whose q, k, v are
 * quantized copies (fmha_quantize_fp8) with descales in any layout, and the
 * accuracy report of `fmha accuracy`. */
#ifndef FMHA_FP8_CLI_H
#define FMHA_FP8_CLI_H

#include "fmha.h"

#include <stdio.h>

typedef struct fp8_args {
    fmha_forward_args a; /* the source's arguments with f8_e4m3 q, k, v and their descales */
    void *codes[3];      /* owned: contiguous [batch, seqlen, heads, head_dim] codes */
    float *scales[3];    /* owned */
} fp8_args;

/* Quantizes src's q, k, v (f32/f16/bf16, padded batch) into owned copies:
 *   FMHA_DESCALE_PER_TENSOR  one scale per tensor
 *   FMHA_DESCALE_PER_KV_HEAD one per (batch, KV head); q's group of heads shares
 *                            one (q must have contiguous heads: stride_head = head_dim)
 *   FMHA_DESCALE_PER_BLOCK   one per (batch, head, block_rows tokens)
 * 0 on success; else a message in err and nothing to free. */
int fp8_args_make(fp8_args *f, const fmha_forward_args *src, int64_t num_kv_heads,
                  fmha_descale_layout layout, int64_t block_rows, char *err, size_t errlen);
void fp8_args_free(fp8_args *f);

/* Element (b, s, h, c) of an f32/f16/bf16 host tensor as a double (NaN for
 * other dtypes): what the CLI's checks compare. */
double cli_elem(const fmha_tensor *t, int64_t b, int64_t s, int64_t h, int64_t c);

/* The accuracy report: for Gaussian inputs and inputs whose K has outlier
 * channels, the relative L2 error of FP8 attention (each descale layout)
 * against the float64 reference and against the bf16 path, on a bf16
 * configuration `cfg` (shape, mask, threads) and `batch` x `seqlen_q` x
 * `seqlen_k`. Errors are taken over the last `rows` query rows of each
 * sequence; `normal` draws the inputs. Prints a table to `out`; 0 on success. */
int fp8_accuracy_report(const fmha_config *cfg, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                        int64_t rows, double (*normal)(void), FILE *out);

#endif
