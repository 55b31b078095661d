"""FlashAttention-3's interface (fmha.flash_attn_interface): its argument
order, so that FA3 calls are not read in FA2's order, its return convention,
the features fmha refuses, and flash_attn_combine against one whole call."""
import inspect

import numpy as np
import pytest

import fmha
import reference as ref
from fmha import flash_attn_interface as fa3

DESCALES = [("q_descale", None), ("k_descale", None), ("v_descale", None)]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", ("softmax_scale", None), ("causal", False), ("qv", None)]
    + DESCALES + [("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
                  ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
                  ("sm_margin", 0), ("return_attn_probs", False)],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                               "max_seqlen_k", ("seqused_q", None), ("seqused_k", None),
                               ("softmax_scale", None), ("causal", False), ("qv", None)]
    + DESCALES + [("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
                  ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
                  ("sm_margin", 0), ("return_attn_probs", False)],
    "flash_attn_qkvpacked_func": ["qkv", ("softmax_scale", None), ("causal", False)] + DESCALES
    + [("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
       ("deterministic", False), ("num_heads_q", None), ("sm_margin", 0),
       ("return_attn_probs", False)],
    "flash_attn_combine": ["out_partial", "lse_partial", ("out", None), ("out_dtype", None)],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature(name):
    params = inspect.signature(getattr(fa3, name)).parameters.values()
    got = [p.name if p.default is inspect.Parameter.empty else (p.name, p.default)
           for p in params]
    assert got == SIGNATURES[name]


def test_positional_arguments_in_fa3_order(rng):
    q, k, v = (ref.make(rng, (1, 8, 2, 16), "f32") for _ in range(3))
    # FA2 would read 0.125 as dropout_p and True as softmax_scale.
    got = fa3.flash_attn_func(q, k, v, 0.125, True)
    want = fmha.attention(q, k, v, softmax_scale=0.125, causal=True)
    np.testing.assert_array_equal(got, want)
    out, lse = fa3.flash_attn_func(q, k, v, 0.125, True, return_attn_probs=True)
    np.testing.assert_array_equal(out, want)
    assert lse.shape == (1, 2, 8) and lse.dtype == np.float32
    _, want_lse = ref.attention(q, k, v, causal=True, scale=0.125)
    ref.assert_lse(lse, want_lse)


def test_varlen_and_packed(rng):
    cu = np.array([0, 5, 5, 12], dtype=np.int32)
    q, k, v = (ref.make(rng, (1, 12, 4, 16), "f32")[0] for _ in range(3))
    got = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, None, None, 0.2, True)
    want = fmha.varlen_attention(q, k, v, cu, cu, 7, 7, softmax_scale=0.2, causal=True)
    np.testing.assert_array_equal(got, want)
    qkv = ref.make(rng, (2, 9, 4 + 2 * 2, 16), "f32")
    got = fa3.flash_attn_qkvpacked_func(qkv, None, True, num_heads_q=4)
    want = fmha.attention(qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:], causal=True)
    np.testing.assert_array_equal(got, want)
    stacked = np.ascontiguousarray(qkv[:, :, :6].reshape(2, 9, 3, 2, 16))
    want = fmha.attention(stacked[:, :, 0], stacked[:, :, 1], stacked[:, :, 2])
    np.testing.assert_array_equal(fa3.flash_attn_qkvpacked_func(stacked), want)
    with pytest.raises(ValueError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(qkv, num_heads_q=3)


@pytest.mark.parametrize("kw", [{"qv": np.zeros(1)}, {"attention_chunk": 128}])
def test_refused_features(rng, kw):
    q = ref.make(rng, (1, 4, 2, 16), "f32")
    with pytest.raises(NotImplementedError, match="not supported by fmha"):
        fa3.flash_attn_func(q, q, q, **kw)


def test_seqused_refused(rng):
    q = ref.make(rng, (1, 6, 2, 16), "f32")[0]
    cu = np.array([0, 6], dtype=np.int32)
    with pytest.raises(NotImplementedError, match="seqused_k is not supported"):
        fa3.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, seqused_k=np.array([3], np.int32))


def test_combine_equals_one_call(rng):
    """Keys in three splits (one of them masked out for some rows by
    causality) combine to the whole call's out and LSE."""
    q = ref.make(rng, (2, 7, 3, 16), "f32")
    k, v = (ref.make(rng, (2, 30, 3, 16), "f32") for _ in range(2))
    whole, whole_lse = fmha.attention(q, k, v, return_lse=True)
    parts, lses = [], []
    for a, b in ((0, 10), (10, 18), (18, 30)):
        o, l = fmha.attention(q, k[:, a:b], v[:, a:b], return_lse=True, softmax_scale=0.25)
        parts.append(o)
        lses.append(np.transpose(l, (0, 2, 1)))  # [B, H, S] -> [B, S, H]
    out, lse = fa3.flash_attn_combine(np.stack(parts), np.stack(lses))
    np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, np.transpose(whole_lse, (0, 2, 1)), rtol=1e-5, atol=1e-5)
    # no keys anywhere: 0 and -inf; a NaN split: a NaN row
    lp = np.stack(lses).copy()
    lp[:, 0, 0, 0] = -np.inf
    lp[1, 1, 2, 1] = np.nan
    out, lse = fa3.flash_attn_combine(np.stack(parts), lp)
    assert (out[0, 0, 0] == 0).all() and lse[0, 0, 0] == -np.inf
    assert np.isnan(out[1, 2, 1]).all() and np.isnan(lse[1, 2, 1])
