"""fmha.attention on padded batches against the numpy float64 reference:
every argument, dtype and layout, GQA/MQA, LSE, dropout, out=, empty sizes."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fmha
import reference as ref
from fmha import _tensors

needs_bf16 = pytest.mark.skipif(ref.BF16 is None, reason="ml_dtypes is not installed")
DTYPES = ["f32", "f16", pytest.param("bf16", marks=needs_bf16)]


@st.composite
def problems(draw):
    hkv = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([4, 7, 16, 64, 80, 128]))
    return dict(
        B=draw(st.integers(1, 2)), Sq=draw(st.integers(1, 40)), Sk=draw(st.integers(1, 40)),
        H=hkv * draw(st.sampled_from([1, 2, 3])), Hkv=hkv, D=d,
        Dv=draw(st.sampled_from([d, d, 32])),
        dtype=draw(st.sampled_from(["f32", "f16", "bf16"] if ref.BF16 else ["f32", "f16"])),
        layout=draw(st.sampled_from(["bshd", "bhsd", "strided"])),
        causal=draw(st.booleans()),
        window=draw(st.one_of(st.just((-1, -1)),
                              st.tuples(st.integers(-1, 24), st.integers(-1, 24)))),
        softcap=draw(st.sampled_from([0.0, 0.0, 5.0, 30.0])),
        scale=draw(st.sampled_from([None, None, 0.05, 0.3])),
        dropout_p=draw(st.sampled_from([0.0, 0.0, 0.0, 0.25])),
        seed=draw(st.integers(0, 2**64 - 1)),
        data_seed=draw(st.integers(0, 2**32 - 1)),
    )


def inputs(p, rng=None):
    rng = rng or np.random.default_rng(p["data_seed"])
    q = ref.make(rng, (p["B"], p["Sq"], p["H"], p["D"]), p["dtype"], p["layout"])
    k = ref.make(rng, (p["B"], p["Sk"], p["Hkv"], p["D"]), p["dtype"], p["layout"])
    v = ref.make(rng, (p["B"], p["Sk"], p["Hkv"], p["Dv"]), p["dtype"], p["layout"])
    return q, k, v


@given(problems())
def test_matches_reference(p):
    q, k, v = inputs(p)
    out, lse = fmha.attention(q, k, v, causal=p["causal"], softmax_scale=p["scale"],
                              window=p["window"], softcap=p["softcap"],
                              dropout_p=p["dropout_p"], seed=p["seed"], return_lse=True)
    want, want_lse = ref.attention(q, k, v, causal=p["causal"], scale=p["scale"],
                                   window=p["window"], softcap=p["softcap"],
                                   dropout_p=p["dropout_p"], seed=p["seed"])
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype
    assert out.shape == (p["B"], p["Sq"], p["H"], p["Dv"])
    assert lse.dtype == np.float32 and lse.shape == (p["B"], p["H"], p["Sq"])
    ref.assert_close(out, want, p["dtype"])
    ref.assert_lse(lse, want_lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "strided"])
def test_dtypes_and_layouts(rng, dtype, layout):
    shape = (2, 37, 4, 64)
    q, k, v = (ref.make(rng, shape, dtype, layout) for _ in range(3))
    out = fmha.attention(q, k, v)
    want, _ = ref.attention(q, k, v)
    assert out.dtype == ref.DTYPES[dtype] and out.flags.c_contiguous
    ref.assert_close(out, want, dtype)


def test_views_are_not_copied(rng):
    # A BHSD view and a strided slice reach libfmha as their own memory.
    base = rng.standard_normal((2, 4, 9, 16)).astype(np.float32)
    bhsd = base.transpose(0, 2, 1, 3)
    v = _tensors.view(bhsd, "k", 4)
    assert v.ptr == base.ctypes.data
    assert v.strides == (4 * 9 * 16, 16, 9 * 16, 1)
    buf = rng.standard_normal((1, 5, 6, 20)).astype(np.float32)
    s = buf[:, 1:, ::2, 3:19]
    sv = _tensors.view(s, "v", 4)
    assert sv.ptr == buf.ctypes.data + (1 * 6 * 20 + 3) * 4
    assert sv.strides == (0, 6 * 20, 2 * 20, 1)  # batch of 1: its stride is never used


@pytest.mark.parametrize("sq,sk", [(3, 7), (7, 3), (1, 9), (5, 5)])
def test_causal_is_bottom_right(rng, sq, sk):
    q, k, v = (ref.make(rng, (1, s, 2, 16), "f32") for s in (sq, sk, sk))
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = ref.attention(q, k, v, causal=True)
    ref.assert_close(out, want, "f32")
    ref.assert_lse(lse, want_lse)
    # Directly: query i sees keys j <= i + sk - sq, so the last key changes
    # only the last query row; rows with i + sk - sq < 0 see nothing.
    v2 = v.copy()
    v2[:, -1] += 10.0
    out2 = fmha.attention(q, k, v2, causal=True)
    changed = np.abs(out2 - out).max(axis=(0, 2, 3)) > 0
    assert changed.tolist() == [i == sq - 1 for i in range(sq)]
    for i in range(sq):
        if i + sk - sq < 0:
            assert np.all(out[:, i] == 0) and np.all(np.isneginf(lse[:, :, i]))


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (2, 5), (-1, 2), (4, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(rng, window, causal):
    q = ref.make(rng, (1, 19, 2, 32), "f32")
    k, v = (ref.make(rng, (1, 23, 1, 32), "f32") for _ in range(2))
    out, lse = fmha.attention(q, k, v, window=window, causal=causal, return_lse=True)
    want, want_lse = ref.attention(q, k, v, window=window, causal=causal)
    ref.assert_close(out, want, "f32")
    ref.assert_lse(lse, want_lse)


@pytest.mark.parametrize("softcap", [1.0, 20.0])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_softcap_and_scale(rng, softcap, scale):
    q, k, v = (3 * ref.make(rng, (2, 17, 3, 32), "f32") for _ in range(3))
    out, lse = fmha.attention(q, k, v, softcap=softcap, softmax_scale=scale, return_lse=True)
    want, want_lse = ref.attention(q, k, v, softcap=softcap, scale=scale)
    ref.assert_close(out, want, "f32")
    ref.assert_lse(lse, want_lse)
    # the options matter: without softcap the result is another one
    plain = fmha.attention(q, k, v, softmax_scale=scale)
    assert ref.rel_l2(plain, out) > 1e-3


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = (ref.make(rng, (1, 11, 2, 64), "f32") for _ in range(3))
    np.testing.assert_array_equal(fmha.attention(q, k, v),
                                  fmha.attention(q, k, v, softmax_scale=0.125))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout(rng, dtype):
    q, k, v = (ref.make(rng, (2, 24, 4, 32), dtype) for _ in range(3))
    a = fmha.attention(q, k, v, dropout_p=0.3, seed=1234)
    b = fmha.attention(q, k, v, dropout_p=0.3, seed=1234)
    c = fmha.attention(q, k, v, dropout_p=0.3, seed=1235)
    np.testing.assert_array_equal(a, b)  # the same seed drops the same elements
    assert ref.rel_l2(c, a) > 0.05       # another seed, others
    want, _ = ref.attention(q, k, v, dropout_p=0.3, seed=1234)
    ref.assert_close(a, want, dtype)


def test_dropout_seed_policy(rng):
    q, k, v = (ref.make(rng, (1, 16, 2, 16), "f32") for _ in range(3))
    fmha.manual_seed(7)
    a = fmha.attention(q, k, v, dropout_p=0.5)
    b = fmha.attention(q, k, v, dropout_p=0.5)
    fmha.manual_seed(7)
    a2 = fmha.attention(q, k, v, dropout_p=0.5)
    np.testing.assert_array_equal(a, a2)   # manual_seed replays the drawn seeds
    assert ref.rel_l2(b, a) > 0.05         # each call draws a new seed
    # dropout_p = 0 reads no seed and draws none
    fmha.manual_seed(7)
    fmha.attention(q, k, v)
    np.testing.assert_array_equal(fmha.attention(q, k, v, dropout_p=0.5), a)


def test_reference_dropout_stream_matches_libfmha():
    # The numpy Philox above against the library's documented stream.
    from fmha import _lib
    g = np.random.default_rng(3)
    for _ in range(50):
        seed, offset = (int(x) for x in g.integers(0, 2**64 - 1, size=2, dtype=np.uint64))
        seq, head, row, col = (int(x) for x in g.integers(0, 1000, size=4))
        p = float(g.uniform(0.05, 0.95))
        want = bool(_lib.fmha_dropout_keep(seed, offset, seq, 8, head, row, col, p))
        got = bool(ref.dropout_keep(seed, offset, seq * 8 + head, row, col, p))
        assert got == want


@pytest.mark.parametrize("h,hkv", [(8, 8), (8, 2), (6, 1)])
def test_gqa_and_mqa(rng, h, hkv):
    q = ref.make(rng, (2, 21, h, 32), "f32", "bhsd")
    k, v = (ref.make(rng, (2, 26, hkv, 32), "f32", "bhsd") for _ in range(2))
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = ref.attention(q, k, v, causal=True)
    ref.assert_close(out, want, "f32")
    ref.assert_lse(lse, want_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_argument(rng, dtype):
    q, k, v = (ref.make(rng, (1, 13, 2, 16), dtype) for _ in range(3))
    want, _ = ref.attention(q, k, v)
    # an f32 output for low-precision inputs, written through a BHSD view
    buf = np.full((1, 2, 13, 16), np.nan, dtype=np.float32)
    out = buf.transpose(0, 2, 1, 3)
    res = fmha.attention(q, k, v, out=out)
    assert res is out
    assert not np.isnan(buf).any()
    ref.assert_close(buf.transpose(0, 2, 1, 3), want, dtype)
    with pytest.raises(ValueError, match="out has shape"):
        fmha.attention(q, k, v, out=np.empty((1, 13, 2, 8), np.float32))
    ro = np.empty((1, 13, 2, 16), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fmha.attention(q, k, v, out=ro)


def test_head_dim_v_differs(rng):
    q, k = (ref.make(rng, (1, 9, 2, 32), "f32") for _ in range(2))
    v = ref.make(rng, (1, 9, 2, 48), "f32")
    out = fmha.attention(q, k, v)
    assert out.shape == (1, 9, 2, 48)
    ref.assert_close(out, ref.attention(q, k, v)[0], "f32")


def test_empty_sizes(rng):
    q = ref.make(rng, (2, 0, 2, 16), "f32")
    k = ref.make(rng, (2, 5, 2, 16), "f32")
    out, lse = fmha.attention(q, k, k, return_lse=True)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)
    q = ref.make(rng, (2, 3, 2, 16), "f32")
    k = ref.make(rng, (2, 0, 2, 16), "f32")
    out, lse = fmha.attention(q, k, k, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))  # no visible key
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        fmha.attention(ref.make(rng, (1, 0, 3, 16), "f32"), k[:1, :, :2], k[:1, :, :2])


class DLPackOnly:
    """An array known only through the DLPack protocol."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_inputs(rng):
    q, k, v = (ref.make(rng, (1, 12, 2, 16), "f16", "bhsd") for _ in range(3))
    out = fmha.attention(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), causal=True)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, fmha.attention(q, k, v, causal=True))


class ForeignArray(DLPackOnly):
    """A foreign array library's array: DLPack and an array API namespace
    whose from_dlpack makes more of them (as CuPy's and JAX's do)."""

    class namespace:
        @staticmethod
        def from_dlpack(x):
            return ForeignArray(np.from_dlpack(x))

    def __array_namespace__(self, api_version=None):
        return ForeignArray.namespace


def test_foreign_arrays_come_back_in_their_family(rng):
    q, k, v = (ref.make(rng, (2, 12, 2, 16), "f16") for _ in range(3))
    fq, fk, fv = (ForeignArray(x) for x in (q, k, v))
    out, lse = fmha.attention(fq, fk, fv, causal=True, return_lse=True)
    want, want_lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, ForeignArray) and isinstance(lse, ForeignArray)
    np.testing.assert_array_equal(out._a, want)
    np.testing.assert_array_equal(lse._a, want_lse)
    # the layer, the FlashAttention names and the backward too
    layer = fmha.Attention(2, 16, causal=True)
    assert isinstance(layer(fq, fk, fv), ForeignArray)
    assert isinstance(fmha.flash_attn_func(fq, fk, fv, causal=True), ForeignArray)
    grads = fmha.attention_backward(ForeignArray(np.ones_like(want)), fq, fk, fv,
                                    ForeignArray(want), ForeignArray(want_lse), causal=True)
    assert len(grads) == 3 and all(isinstance(g, ForeignArray) for g in grads)
    # out= given: the same memory comes back, as a foreign array
    buf = np.full_like(want, np.nan)
    res = fmha.attention(fq, fk, fv, causal=True, out=ForeignArray(buf))
    assert isinstance(res, ForeignArray) and np.shares_memory(res._a, buf)
    np.testing.assert_array_equal(buf, want)


def test_function_calls_keep_layers_but_follow_the_environment(rng, monkeypatch):
    """attention() keeps the libfmha layer of its configuration between calls
    (per thread), and makes a new one when a knob a layer reads at its making
    changes: a bad FMHA_CPU_ISA fails the next call, as it would a new layer."""
    q, k, v = (ref.make(rng, (1, 9, 2, 16), "f32") for _ in range(3))
    first = fmha.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(fmha.attention(q, k, v, causal=True), first)
    monkeypatch.setenv("FMHA_CPU_ISA", "bogus")
    with pytest.raises(fmha.InvalidArgumentError, match="FMHA_CPU_ISA=bogus"):
        fmha.attention(q, k, v, causal=True)
    monkeypatch.setenv("FMHA_CPU_ISA", "scalar")
    ref.assert_close(fmha.attention(q, k, v, causal=True), first, "f32", "scalar kernel")
    monkeypatch.delenv("FMHA_CPU_ISA")
    np.testing.assert_array_equal(fmha.attention(q, k, v, causal=True), first)


def test_threads_do_not_change_results(rng):
    # Results are documented not to depend on the thread count; calls from
    # several Python threads at once must not mix their errors or outputs.
    import concurrent.futures
    q, k, v = (ref.make(rng, (1, 64, 4, 32), "bf16" if ref.BF16 else "f16") for _ in range(3))
    want = fmha.attention(q, k, v, causal=True)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda _: fmha.attention(q, k, v, causal=True), range(8)))
    for o in outs:
        np.testing.assert_array_equal(o, want)
