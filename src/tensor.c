/* tensor.c — dtypes, element conversions and tensor views: the vocabulary
 * every other part of the library speaks. Calls nothing but libm. */
#include "internal.h"

#include <math.h>

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
    return fmha_f16_to_f32_inline(x);
}

uint16_t fmha_f32_to_f16(float x)
{
    return fmha_f32_to_f16_inline(x);
}

/* ----------------------------------------------------------------- tensors */

fmha_tensor fmha_tensor_bshd(void *data, fmha_dtype dtype, int64_t batch, int64_t seqlen,
                             int64_t heads, int64_t head_dim)
{
    fmha_tensor t = {data,
                     dtype,
                     batch,
                     seqlen,
                     heads,
                     head_dim,
                     seqlen * heads * head_dim,
                     heads * head_dim,
                     head_dim,
                     1};
    return t;
}

fmha_tensor fmha_tensor_bhsd(void *data, fmha_dtype dtype, int64_t batch, int64_t seqlen,
                             int64_t heads, int64_t head_dim)
{
    fmha_tensor t = {data,
                     dtype,
                     batch,
                     seqlen,
                     heads,
                     head_dim,
                     heads * seqlen * head_dim,
                     head_dim,
                     seqlen * head_dim,
                     1};
    return t;
}

fmha_tensor fmha_tensor_packed(void *data, fmha_dtype dtype, int64_t total_tokens, int64_t heads,
                               int64_t head_dim)
{
    return fmha_tensor_bshd(data, dtype, 1, total_tokens, heads, head_dim);
}
