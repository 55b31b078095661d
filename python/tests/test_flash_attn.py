"""The flash_attn 2.x-compatible functions: signatures, return conventions,
packed layouts and the features fmha refuses."""
import inspect

import numpy as np
import pytest

import fmha
import reference as ref
from fmha import flash_attn as fa

COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
          ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
          ("deterministic", False), ("return_attn_probs", False)]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v"] + COMMON,
    "flash_attn_qkvpacked_func": ["qkv"] + COMMON,
    "flash_attn_kvpacked_func": ["q", "kv"] + COMMON,
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                               "max_seqlen_k"] + COMMON + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + COMMON,
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                        "max_seqlen_q", "max_seqlen_k"] + COMMON,
}


# FlashAttention-3's FP8 descales, after flash_attn 2.x's arguments and keyword-only, so
# that every 2.x positional call means what it did.
DESCALES = [("q_descale", None), ("k_descale", None), ("v_descale", None)]


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature(name):
    params = list(inspect.signature(getattr(fa, name)).parameters.values())
    got = [p.name if p.default is inspect.Parameter.empty else (p.name, p.default)
           for p in params]
    assert got == SIGNATURES[name] + DESCALES
    n = len(SIGNATURES[name])
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:n])
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in params[n:])
    assert getattr(fmha, name) is getattr(fa, name)


def test_flash_attn_func(rng):
    q = ref.make(rng, (2, 9, 4, 32), "f16")
    k, v = (ref.make(rng, (2, 14, 2, 32), "f16") for _ in range(2))
    out = fa.flash_attn_func(q, k, v, causal=True, window_size=(5, 0), softcap=3.0)
    want, want_lse = ref.attention(q, k, v, causal=True, window=(5, 0), softcap=3.0)
    assert isinstance(out, np.ndarray)
    ref.assert_close(out, want, "f16")
    res = fa.flash_attn_func(q, k, v, 0.0, None, True, (5, 0), 3.0,
                             return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
    np.testing.assert_array_equal(res[0], out)
    assert res[1].shape == (2, 4, 9) and res[1].dtype == np.float32
    ref.assert_lse(res[1], want_lse)


def test_positional_arguments_in_flash_attn_order(rng):
    q, k, v = (ref.make(rng, (1, 8, 2, 16), "f32") for _ in range(3))
    got = fa.flash_attn_func(q, k, v, 0.0, 0.3, True, (2, 1), 4.0)
    want = fmha.attention(q, k, v, softmax_scale=0.3, causal=True, window=(2, 1), softcap=4.0)
    np.testing.assert_array_equal(got, want)


def test_packed_variants(rng):
    qkv = ref.make(rng, (2, 10, 3 * 4, 16), "f32").reshape(2, 10, 3, 4, 16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    want = fa.flash_attn_func(q, k, v, causal=True)
    np.testing.assert_array_equal(fa.flash_attn_qkvpacked_func(qkv, causal=True), want)
    kv = np.ascontiguousarray(np.stack([k, v], axis=2))
    np.testing.assert_array_equal(fa.flash_attn_kvpacked_func(q, kv, causal=True), want)
    with pytest.raises(ValueError, match="qkv must be"):
        fa.flash_attn_qkvpacked_func(kv)


def test_varlen_variants(rng):
    cu = np.array([0, 4, 4, 11], dtype=np.int32)
    qkv = ref.make(rng, (1, 11, 3 * 2, 16), "f32")[0].reshape(11, 3, 2, 16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out, lse, s = fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True,
                                            return_attn_probs=True)
    want, want_lse = ref.varlen_attention(q, k, v, cu, cu, causal=True)
    assert s is None and lse.shape == (2, 11)
    ref.assert_close(out, want, "f32")
    ref.assert_lse(lse, want_lse)
    np.testing.assert_array_equal(fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True),
                                  out)
    kv = qkv[:, 1:]
    np.testing.assert_array_equal(
        fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 7, 7, causal=True), out)


def test_refused_features(rng):
    q = ref.make(rng, (1, 4, 2, 16), "f16")
    slopes = np.ones(2, np.float32)
    # alibi_slopes runs (test_score_mods.py checks its numbers), packed or not
    np.testing.assert_array_equal(fa.flash_attn_func(q, q, q, alibi_slopes=slopes),
                                  fa.flash_attn_qkvpacked_func(np.stack([q, q, q], 2),
                                                               alibi_slopes=slopes))
    cu = np.array([0, 4], np.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        fa.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4,
                                  block_table=np.zeros((1, 1), np.int32))
    # deterministic is accepted and changes nothing
    np.testing.assert_array_equal(fa.flash_attn_func(q, q, q, deterministic=True),
                                  fa.flash_attn_func(q, q, q))
