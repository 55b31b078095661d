"""flash_attn_interface.py — FlashAttention-3's functions (its Hopper
package's `flash_attn_interface`): the same argument names,
order, defaults and return conventions, so that FA3 code can import from
`fmha.flash_attn_interface` and FA2 code from `fmha.flash_attn` without
either being misread. The two orders differ: FA3 has no dropout, so its
fourth positional argument is softmax_scale (FA2's is dropout_p):
`flash_attn_func(q, k, v, 0.125, True)` is scale 0.125, causal, here.

Differences from FlashAttention-3:
- inputs that require grad get fmha's backward through torch.autograd (as
  fmha.flash_attn), on CPU tensors for now;
- qv, seqused_q, seqused_k and attention_chunk != 0 raise
  NotImplementedError (fmha has no such feature yet), and so do
  flash_attn_with_kvcache's cache_leftpad, cu_seqlens_q, cu_seqlens_k_new,
  rotary_seqlens, FP8 descales and scheduler_metadata; its page_table is
  FA2's block_table (CPU caches); num_splits, pack_gqa,
  sm_margin and deterministic are scheduling hints that fmha's chooser makes
  itself: accepted and ignored, as the output does not depend on them;
- return_attn_probs=True returns (out, softmax_lse), as FA3 does;
- numpy arrays, float32 and CPU tensors work too.
"""
import sys

import numpy as np

from . import flash_attn as _fa2

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_with_kvcache", "flash_attn_combine"]


def _refuse(qv=None, seqused_q=None, seqused_k=None, attention_chunk=0):
    for name, value in (("qv", qv), ("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if value is not None:
            raise NotImplementedError("%s is not supported by fmha: pass %s=None" % (name, name))
    if attention_chunk not in (0, None):
        raise NotImplementedError("attention_chunk (%r) is not supported by fmha: pass 0"
                                  % (attention_chunk,))


def _fa3_return(res, return_attn_probs):
    # fmha.flash_attn returns FA2's (out, softmax_lse, None); FA3 drops the third.
    return (res[0], res[1]) if return_attn_probs else res


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, H, Dv]; with
    return_attn_probs: (out, softmax_lse [B, H, Sq] float32). FP8 q, k, v:
    descales None or [1] / [B, Hkv] float32, out bfloat16."""
    _refuse(qv, attention_chunk=attention_chunk)
    res = _fa2.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap,
                               return_attn_probs=return_attn_probs, q_descale=q_descale,
                               k_descale=k_descale, v_descale=v_descale)
    return _fa3_return(res, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False):
    """q [total_q, H, D], k/v [total_k, Hkv, D], int32 cu_seqlens [batch + 1]
    -> out [total_q, H, Dv]; with return_attn_probs: (out, softmax_lse
    [H, total_q] float32)."""
    _refuse(qv, seqused_q, seqused_k, attention_chunk)
    res = _fa2.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, 0.0, softmax_scale, causal, window_size,
                                      softcap, return_attn_probs=return_attn_probs,
                                      q_descale=q_descale, k_descale=k_descale,
                                      v_descale=v_descale)
    return _fa3_return(res, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None,
                              k_descale=None, v_descale=None, window_size=(-1, -1),
                              attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """qkv [B, S, 3, H, D], or [B, S, H + 2 * Hkv, D] with num_heads_q = H
    (q's heads, then k's, then v's); q, k and v are views of it."""
    _refuse(attention_chunk=attention_chunk)
    if num_heads_q is None:
        res = _fa2.flash_attn_qkvpacked_func(qkv, 0.0, softmax_scale, causal, window_size,
                                             softcap, return_attn_probs=return_attn_probs,
                                             q_descale=q_descale, k_descale=k_descale,
                                             v_descale=v_descale)
        return _fa3_return(res, return_attn_probs)
    shape = tuple(qkv.shape)
    if len(shape) != 4 or (shape[2] - num_heads_q) <= 0 or (shape[2] - num_heads_q) % 2:
        raise ValueError("with num_heads_q (%r), qkv must be [batch, seqlen, num_heads_q + "
                         "2 * kv_heads, head_dim], got shape %s" % (num_heads_q, list(shape)))
    hk = (shape[2] - num_heads_q) // 2
    q = qkv[:, :, :num_heads_q]
    k = qkv[:, :, num_heads_q:num_heads_q + hk]
    v = qkv[:, :, num_heads_q + hk:]
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale,
                           v_descale, window_size, 0, softcap,
                           return_attn_probs=return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                            pack_gqa=None, sm_margin=0, return_softmax_lse=False):
    """Decode against KV caches (fmha.kvcache_attention), FA3's argument
    order: page_table [B, max_pages] is the paged caches' table. FP8
    (float8_e4m3fn) caches take k_descale / v_descale: FA3's [B, Hkv] (per
    sequence) for contiguous caches, or fmha's one number / [Hkv]; q stays in
    its own dtype (q_descale is refused)."""
    _refuse(qv, attention_chunk=attention_chunk)
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new),
                        ("rotary_seqlens", rotary_seqlens), ("q_descale", q_descale),
                        ("scheduler_metadata", scheduler_metadata)):
        if value is not None:
            raise NotImplementedError("%s is not supported by fmha's decode: pass %s=None"
                                      % (name, name))
    per_sequence = any(d is not None and len(getattr(d, "shape", ())) == 2
                       for d in (k_descale, v_descale))
    if per_sequence and (page_table is not None or cache_batch_idx is not None):
        raise NotImplementedError("per-sequence descales [B, Hkv] with a page_table or "
                                  "cache_batch_idx: fmha's FP8 caches scale per page (or cache "
                                  "row); pass [num_pages, Hkv], [Hkv] or one descale")
    return _fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                        cache_seqlens, cache_batch_idx, cache_leftpad,
                                        page_table, softmax_scale, causal, window_size, softcap,
                                        rotary_interleaved, None, num_splits,
                                        return_softmax_lse, k_descale, v_descale)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges attention computed over splits of the keys: out_partial
    [splits, B, S, H, D] and lse_partial [splits, B, S, H], float32, each
    split normalised over its own keys with its LSE, -> (out [B, S, H, D],
    lse [B, S, H]): out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i
    lse_i. A row whose every split has no key (all -inf) gives 0 and -inf;
    a NaN split makes its row NaN (docs/reliability.md). out, if given,
    receives the result; out_dtype defaults to out_partial's dtype."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(out_partial, torch.Tensor):
        lse = torch.logsumexp(lse_partial, dim=0)
        empty = torch.isneginf(lse)
        w = torch.where(empty, torch.zeros_like(lse_partial), torch.exp(lse_partial - lse))
        res = (w.unsqueeze(-1) * out_partial).sum(dim=0)
        res = res.to(out_dtype if out_dtype is not None else out_partial.dtype)
        if out is not None:
            out.copy_(res)
            res = out
        return res, lse
    op = np.asarray(out_partial)
    lp = np.asarray(lse_partial)
    if op.ndim != 5 or lp.shape != op.shape[:4]:
        raise ValueError("out_partial must be [splits, batch, seqlen, heads, head_dim] and "
                         "lse_partial [splits, batch, seqlen, heads], got %s and %s"
                         % (list(op.shape), list(lp.shape)))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        top = np.max(lp, axis=0)
        safe = np.where(np.isneginf(top), 0.0, top)
        lse = safe + np.log(np.sum(np.exp(lp - safe), axis=0))
        lse = np.where(np.isneginf(top), -np.inf, lse).astype(np.float32)
        w = np.where(np.isneginf(lse), 0.0, np.exp(lp - lse))
    res = np.sum(w[..., None] * op, axis=0).astype(out_dtype or op.dtype)
    if out is not None:
        out[...] = res
        res = out
    return res, lse
