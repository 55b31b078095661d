"""flash_attn.py — drop-in versions of flash_attn 2.x's functions: the same
argument names, order, defaults and return conventions, so
`from fmha.flash_attn import flash_attn_func` can replace
`from flash_attn import flash_attn_func` in inference and training code.
torch tensors run through the fmha::* torch ops (fmha.torch_ops), whose
autograd formula is fmha's backward and which torch.compile traces without
graph breaks: gradients on CPU tensors and on CUDA tensors of f16/bf16
(fmha's portable CUDA backward).

Differences from flash_attn:
- cache_leftpad, and block_table of flash_attn_varlen_func (paged prefill)
  raise NotImplementedError; flash_attn_with_kvcache takes block_table
  (paged KV caches), on the CPU and on CUDA;
- alibi_slopes ([H] or [B, H] float32) is a constant for autograd (slopes
  that require grad raise; CUDA takes them with f16/bf16 inputs, in
  flash_attn_with_kvcache too);
- `deterministic` is accepted and ignored (fmha's forward, and its CPU
  backward, are deterministic anyway);
- dropout draws its seed from fmha's generator (fmha.manual_seed), not
  torch's;
- return_attn_probs=True returns (out, softmax_lse, None): the attention
  probabilities are never materialised;
- numpy arrays, float32 and CPU tensors work too.

FP8 as in FlashAttention-3: q, k, v all float8_e4m3fn with keyword
arguments q_descale, k_descale, v_descale (None = 1; float32, one value per
tensor or [batch, num_kv_heads], batch = number of sequences for varlen;
see fmha.attention); out is bfloat16.
"""
from . import _api
from ._tensors import as_array, returns_like

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def _unsupported(block_table=None):
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not supported by fmha: pass "
                                  "contiguous k/v with cu_seqlens_k and block_table=None")


def _padded(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, return_attn_probs,
            descales, alibi_slopes=None):
    q_descale, k_descale, v_descale = descales
    res = _api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window_size,
                         softcap=softcap, dropout_p=dropout_p, return_lse=return_attn_probs,
                         q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                         alibi_slopes=alibi_slopes)
    return (res[0], res[1], None) if return_attn_probs else res


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, return_attn_probs, descales,
            alibi_slopes=None):
    q_descale, k_descale, v_descale = descales
    res = _api.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal=causal, softmax_scale=softmax_scale, window=window_size,
                                softcap=softcap, dropout_p=dropout_p,
                                return_lse=return_attn_probs, q_descale=q_descale,
                                k_descale=k_descale, v_descale=v_descale,
                                alibi_slopes=alibi_slopes)
    return (res[0], res[1], None) if return_attn_probs else res


@returns_like()
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, q_descale=None, k_descale=None, v_descale=None):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, H, D];
    with return_attn_probs: (out, softmax_lse [B, H, Sq] float32, None).
    FP8 q, k, v: descales None or [1] / [B, Hkv] float32."""
    return _padded(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                   return_attn_probs, (q_descale, k_descale, v_descale), alibi_slopes)


@returns_like()
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, q_descale=None,
                           k_descale=None, v_descale=None):
    """q [total_q, H, D], k/v [total_k, Hkv, D], int32 cu_seqlens [batch + 1]
    -> out [total_q, H, D]; with return_attn_probs: (out, softmax_lse
    [H, total_q] float32, None). FP8 q, k, v: descales None or [1] /
    [batch, Hkv] float32."""
    _unsupported(block_table)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, return_attn_probs,
                   (q_descale, k_descale, v_descale), alibi_slopes)


@returns_like()
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, q_descale=None,
                              k_descale=None, v_descale=None):
    """qkv [B, S, 3, H, D] (q, k, v are strided views of it, not copies)."""
    qkv = as_array(qkv, "qkv")
    _check_packed(qkv, "qkv", 5, 2, 3, "[batch, seqlen, 3, heads, head_dim]")
    return _padded(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                   window_size, softcap, return_attn_probs, (q_descale, k_descale, v_descale),
                   alibi_slopes)


@returns_like()
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, q_descale=None,
                             k_descale=None, v_descale=None):
    """q [B, Sq, H, D], kv [B, Sk, 2, Hkv, D]."""
    kv = as_array(kv, "kv")
    _check_packed(kv, "kv", 5, 2, 2, "[batch, seqlen, 2, kv_heads, head_dim]")
    return _padded(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                   softcap, return_attn_probs, (q_descale, k_descale, v_descale), alibi_slopes)


@returns_like()
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, q_descale=None,
                                     k_descale=None, v_descale=None):
    """qkv [total, 3, H, D] with one cu_seqlens for q and k."""
    qkv = as_array(qkv, "qkv")
    _check_packed(qkv, "qkv", 4, 1, 3, "[total_tokens, 3, heads, head_dim]")
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                   max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                   return_attn_probs, (q_descale, k_descale, v_descale), alibi_slopes)


@returns_like()
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, q_descale=None, k_descale=None,
                                    v_descale=None):
    """q [total_q, H, D], kv [total_k, 2, Hkv, D]."""
    kv = as_array(kv, "kv")
    _check_packed(kv, "kv", 4, 1, 2, "[total_tokens, 2, kv_heads, head_dim]")
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   return_attn_probs, (q_descale, k_descale, v_descale), alibi_slopes)


@returns_like()
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, k_descale=None, v_descale=None,
                            max_seqlen_k=None):
    """q [B, Sq, H, D] against k_cache / v_cache [B_cache, S_cache, Hkv, D]
    (or pages [num_pages, page_size, Hkv, D] with block_table [B, max_pages]),
    appending k / v [B, Snew, Hkv, D] in place at cache_seqlens first (rotated
    by rotary_cos / rotary_sin where given) -> out [B, Sq, H, D]; with
    return_softmax_lse: (out, softmax_lse [B, H, Sq] float32). fmha's
    additions: k_descale / v_descale (FP8 caches' descales), max_seqlen_k (a
    bound on the keys: no host synchronisation on CUDA).
    fmha.kvcache_attention documents each argument."""
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad is not supported by fmha: keep each sequence's "
                                  "cache left-aligned and pass cache_leftpad=None")
    return _api.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                  cache_batch_idx=cache_batch_idx, block_table=block_table,
                                  rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                  rotary_interleaved=rotary_interleaved, causal=causal,
                                  softmax_scale=softmax_scale, window=window_size,
                                  softcap=softcap, num_splits=num_splits,
                                  return_lse=return_softmax_lse, k_descale=k_descale,
                                  v_descale=v_descale, max_seqlen_k=max_seqlen_k,
                                  alibi_slopes=alibi_slopes)


def _check_packed(x, name, ndim, axis, n, layout):
    shape = tuple(x.shape)
    if len(shape) != ndim or shape[axis] != n:
        raise ValueError("%s must be %s, got shape %s" % (name, layout, list(shape)))
