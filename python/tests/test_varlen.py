"""fmha.varlen_attention on packed batches against the numpy float64
reference, empty sequences included, and its argument checks."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fmha
import reference as ref


def packed(rng, total, heads, d, dtype, strided=False):
    if strided:  # every other token of a padded buffer: a strided packed view
        buf = ref.make(rng, (1, 2 * total, heads, d + 4), dtype)[0]
        return buf[::2, :, 1:1 + d]
    return ref.make(rng, (1, total, heads, d), dtype)[0]


@st.composite
def varlen_problems(draw):
    n = draw(st.integers(1, 5))
    lens_q = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    lens_k = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    hkv = draw(st.sampled_from([1, 2]))
    return dict(
        lens_q=lens_q, lens_k=lens_k, Hkv=hkv, H=hkv * draw(st.sampled_from([1, 2, 4])),
        D=draw(st.sampled_from([8, 32, 64])),
        dtype=draw(st.sampled_from(["f32", "f16", "bf16"] if ref.BF16 else ["f32", "f16"])),
        strided=draw(st.booleans()), causal=draw(st.booleans()),
        window=draw(st.one_of(st.just((-1, -1)),
                              st.tuples(st.integers(-1, 10), st.integers(-1, 10)))),
        softcap=draw(st.sampled_from([0.0, 0.0, 10.0])),
        dropout_p=draw(st.sampled_from([0.0, 0.0, 0.2])),
        seed=draw(st.integers(0, 2**64 - 1)), data_seed=draw(st.integers(0, 2**32 - 1)))


@given(varlen_problems())
def test_matches_reference(p):
    rng = np.random.default_rng(p["data_seed"])
    cu_q = np.concatenate([[0], np.cumsum(p["lens_q"])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(p["lens_k"])]).astype(np.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = packed(rng, tq, p["H"], p["D"], p["dtype"], p["strided"])
    k = packed(rng, tk, p["Hkv"], p["D"], p["dtype"], p["strided"])
    v = packed(rng, tk, p["Hkv"], p["D"], p["dtype"], p["strided"])
    kw = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"],
              dropout_p=p["dropout_p"], seed=p["seed"])
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(p["lens_q"]), max(p["lens_k"]),
                                     return_lse=True, **kw)
    kw["scale"] = None
    want, want_lse = ref.varlen_attention(q, k, v, cu_q, cu_k, **kw)
    assert out.shape == (tq, p["H"], p["D"]) and lse.shape == (p["H"], tq)
    ref.assert_close(out, want, p["dtype"])
    ref.assert_lse(lse, want_lse)


def test_empty_sequences(rng):
    # sequence 1 has no tokens at all, sequence 2 queries but no keys
    cu_q = np.array([0, 4, 4, 9, 12], dtype=np.int32)
    cu_k = np.array([0, 6, 6, 6, 13], dtype=np.int32)
    q = packed(rng, 12, 4, 32, "f32")
    k, v = (packed(rng, 13, 2, 32, "f32") for _ in range(2))
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, 5, 7, causal=True, return_lse=True)
    want, want_lse = ref.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    ref.assert_close(out, want, "f32")
    ref.assert_lse(lse, want_lse)
    assert np.all(out[4:9] == 0) and np.all(np.isneginf(lse[:, 4:9]))


def test_matches_padded_per_sequence(rng):
    # every sequence of a packed batch equals a padded call on it alone
    lens = [5, 9, 1]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (packed(rng, 15, 2, 16, "f32") for _ in range(3))
    out = fmha.varlen_attention(q, k, v, cu, cu, 9, 9, causal=True, softcap=5.0)
    for b in range(3):
        s = slice(cu[b], cu[b + 1])
        one = fmha.attention(q[None, s], k[None, s], v[None, s], causal=True, softcap=5.0)
        np.testing.assert_allclose(out[s], one[0], rtol=1e-6, atol=1e-6)


def test_cu_seqlens_forms(rng):
    q, k, v = (packed(rng, 10, 2, 16, "f32") for _ in range(3))
    want = fmha.varlen_attention(q, k, v, np.array([0, 3, 10], np.int32),
                                 np.array([0, 3, 10], np.int32), 7, 7)
    # lists and int64 arrays are converted (they are small index arrays);
    # max_seqlen 0 / None lets fmha compute the maxima
    got = fmha.varlen_attention(q, k, v, [0, 3, 10], np.array([0, 3, 10], np.int64), 0, None)
    np.testing.assert_array_equal(got, want)


def test_cu_seqlens_errors(rng):
    q, k, v = (packed(rng, 10, 2, 16, "f32") for _ in range(3))
    with pytest.raises(ValueError, match="cu_seqlens_q decreases at entry 2"):
        fmha.varlen_attention(q, k, v, [0, 6, 4], [0, 5, 10], 6, 5)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[2\] \(11\) is past the tensor's 10"):
        fmha.varlen_attention(q, k, v, [0, 5, 10], [0, 5, 11], 5, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q\\[0\\] \\(1\\) must be 0"):
        fmha.varlen_attention(q, k, v, [1, 5, 10], [0, 5, 10], 5, 5)
    with pytest.raises(ValueError, match="max_seqlen_q \\(3\\) is below the longest"):
        fmha.varlen_attention(q, k, v, [0, 5, 10], [0, 5, 10], 3, 5)
    with pytest.raises(ValueError, match="batch \\+ 1 >= 2 entries"):
        fmha.varlen_attention(q, k, v, [0, 5, 10], [0, 10], 5, 10)
    with pytest.raises(TypeError, match="integers"):
        fmha.varlen_attention(q, k, v, [0.0, 10.0], [0, 10], 10, 10)
    with pytest.raises(ValueError, match="3-d"):
        fmha.varlen_attention(q[None], k, v, [0, 10], [0, 10], 10, 10)
