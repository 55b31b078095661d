"""FP8 q, k, v (float8_e4m3fn) with descales, FlashAttention-3's interface:
per-tensor and per-KV-head descales on padded and packed batches against the
float64 reference on the dequantized inputs, output dtypes, and the errors.
Torch tests skip without torch (or without its float8_e4m3fn)."""
import numpy as np
import pytest

import fmha
import reference as ref

ml_dtypes = pytest.importorskip("ml_dtypes")
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)

try:
    import torch
except ImportError:
    torch = None
TORCH_F8 = getattr(torch, "float8_e4m3fn", None)
needs_torch_f8 = pytest.mark.skipif(TORCH_F8 is None,
                                    reason="torch with float8_e4m3fn is not installed")

# The CPU dequantizes FP8 exactly and computes in f32: a bf16 out carries its
# own rounding (2^-9 relative), a float32 out only f32 accumulation error.
TOL_BF16 = dict(rtol=1e-2, atol=1e-2)
TOL_F32 = dict(rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ quantization


def quantize(x, kv_heads=None):
    """FP8 codes of x [B, S, H, D] and their descales, as fmha_quantize_fp8
    defines them (scale = amax / 448 in float32, 1 for an all-zero group):
    one scale for the tensor ([1]) or, with kv_heads, one per (batch, KV head)
    over the query heads sharing it ([B, kv_heads])."""
    x = np.asarray(x, dtype=np.float32)
    B, S, H, D = x.shape
    if kv_heads is None:
        amax = np.abs(x).max(initial=0.0).reshape(1)
        expand = lambda s: s[0]  # noqa: E731
    else:
        g = H // kv_heads
        amax = np.abs(x.reshape(B, S, kv_heads, g, D)).max(axis=(1, 3, 4), initial=0.0)
        expand = lambda s: np.repeat(s, g, axis=1)[:, None, :, None]  # noqa: E731
    scale = (amax / np.float32(448)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    codes = (x / expand(scale)).astype(E4M3)
    return codes, scale


def dequantize(codes, descale, kv_heads=None):
    """What the codes stand for, in float64."""
    x = codes.astype(np.float64)
    if descale is None:
        return x
    d = np.asarray(descale, dtype=np.float64)
    if d.size == 1:
        return x * d.reshape(())
    return x * np.repeat(d, x.shape[2] // kv_heads, axis=1)[:, None, :, None]


def quantize_packed(x, cu, kv_heads=None):
    """Packed x [T, H, D] per tensor, or per (sequence, KV head) for
    kv_heads: codes [T, H, D] and descales [1] or [len(cu) - 1, kv_heads]."""
    if kv_heads is None:
        codes, scale = quantize(x[None])
        return codes[0], scale
    codes = np.empty(x.shape, dtype=E4M3)
    scales = []
    for b in range(len(cu) - 1):
        c, s = quantize(x[None, cu[b]:cu[b + 1]], kv_heads)
        codes[cu[b]:cu[b + 1]] = c[0]
        scales.append(s[0])
    return codes, np.array(scales, dtype=np.float32).reshape(len(cu) - 1, kv_heads)


def dequantize_packed(codes, descale, cu, kv_heads=None):
    if descale is None or np.size(descale) == 1:
        return dequantize(codes[None], descale)[0]
    x = np.empty(codes.shape)
    for b in range(len(cu) - 1):
        x[cu[b]:cu[b + 1]] = dequantize(codes[None, cu[b]:cu[b + 1]], descale[b:b + 1],
                                        kv_heads)[0]
    return x


def fp8_inputs(rng, B, Sq, Sk, H, Hkv, D, per_kv_head):
    """(codes, descales, dequantized) for q, k, v of N(0, 1) values."""
    groups = Hkv if per_kv_head else None
    res = []
    for shape in ((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D)):
        codes, scale = quantize(rng.standard_normal(shape), groups)
        res.append((codes, scale, dequantize(codes, scale, groups)))
    return [list(t) for t in zip(*res)]


def assert_out(got, want, tol):
    got = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got).any(), "out has unwritten (NaN) elements"
    np.testing.assert_allclose(got, want, **tol)


# ------------------------------------------------------------------ padded batches

CASES = [
    dict(B=1, Sq=1, Sk=1, H=6, Hkv=2, D=40),
    dict(B=2, Sq=7, Sk=113, H=6, Hkv=2, D=64, causal=True),
    dict(B=2, Sq=113, Sk=7, H=6, Hkv=2, D=40, causal=True),  # rows that see no key
    dict(B=3, Sq=113, Sk=113, H=4, Hkv=4, D=64),
    dict(B=1, Sq=7, Sk=1, H=6, Hkv=1, D=40),
    dict(B=2, Sq=1, Sk=113, H=6, Hkv=2, D=64, causal=True),
]


@pytest.mark.parametrize("per_kv_head", [False, True], ids=["per_tensor", "per_kv_head"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B%(B)d_sq%(Sq)d_sk%(Sk)d_h%(H)d_"
                                                     "kv%(Hkv)d_d%(D)d" % c)
def test_padded_matches_reference(rng, case, per_kv_head):
    B, Sq, Sk, H, Hkv, D = (case[n] for n in ("B", "Sq", "Sk", "H", "Hkv", "D"))
    causal = case.get("causal", False)
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = fp8_inputs(rng, B, Sq, Sk, H, Hkv, D, per_kv_head)
    want, want_lse = ref.attention(dq, dk, dv, causal=causal)

    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True, q_descale=sq,
                              k_descale=sk, v_descale=sv)
    assert out.dtype == BF16 and out.shape == (B, Sq, H, D)
    assert lse.dtype == np.float32 and lse.shape == (B, H, Sq)
    assert_out(out, want, TOL_BF16)
    ref.assert_lse(lse, want_lse)

    out32 = np.full((B, Sq, H, D), np.nan, dtype=np.float32)
    res = fmha.attention(q, k, v, causal=causal, out=out32, q_descale=sq, k_descale=sk,
                         v_descale=sv)
    assert res is out32
    assert_out(out32, want, TOL_F32)


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, BF16])
def test_out_dtypes(rng, out_dtype):
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = fp8_inputs(rng, 2, 9, 17, 6, 2, 40, True)
    want, _ = ref.attention(dq, dk, dv)
    out = np.full((2, 9, 6, 40), np.nan, dtype=out_dtype)
    fmha.attention(q, k, v, out=out, q_descale=sq, k_descale=sk, v_descale=sv)
    assert_out(out, want, TOL_F32 if out_dtype == np.float32 else TOL_BF16)


def test_default_out_is_bfloat16(rng):
    (q, k, v), (sq, sk, sv), _ = fp8_inputs(rng, 1, 5, 5, 2, 2, 16, False)
    assert fmha.attention(q, k, v).dtype == BF16
    assert fmha.attention(q, k, v, q_descale=sq, k_descale=sk, v_descale=sv).dtype == BF16
    out, _, _ = fmha.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.dtype == BF16
    # an empty problem too, answered without the library's kernels
    empty = fmha.attention(q[:, :0], k, v, q_descale=sq, k_descale=sk, v_descale=sv)
    assert empty.dtype == BF16 and empty.shape == (1, 0, 2, 16)


def test_none_descales_are_one(rng):
    (q, k, v), (sq, sk, sv), _ = fp8_inputs(rng, 2, 7, 11, 6, 2, 40, False)
    one = np.ones(1, dtype=np.float32)
    plain = fmha.attention(q, k, v, causal=True)
    ones = fmha.attention(q, k, v, causal=True, q_descale=one, k_descale=one, v_descale=one)
    np.testing.assert_array_equal(plain.astype(np.float32), ones.astype(np.float32))
    want, _ = ref.attention(q, k, v, causal=True)  # the codes' own values
    assert_out(plain, want, TOL_BF16)
    # some given, some None (= 1)
    got = fmha.attention(q, k, v, causal=True, k_descale=sk)
    want, _ = ref.attention(q, dequantize(k, sk), v, causal=True)
    assert_out(got, want, TOL_BF16)


def test_descales_are_converted(rng):
    # numpy descales of another dtype, strided, 0-d or plain floats become
    # contiguous float32 for the call
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = fp8_inputs(rng, 3, 7, 13, 6, 2, 64, True)
    want = fmha.attention(q, k, v, q_descale=sq, k_descale=sk, v_descale=sv)
    strided = np.asfortranarray(sk.astype(np.float64))
    assert not strided.flags.c_contiguous
    got = fmha.attention(q, k, v, q_descale=sq.astype(np.float64), k_descale=strided,
                         v_descale=sv.tolist())
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = fp8_inputs(rng, 1, 7, 13, 6, 2, 64, False)
    want, _ = ref.attention(dq, dk, dv)
    for form in (lambda s: float(s[0]), lambda s: s.reshape(()), lambda s: s.reshape(1, 1)):
        got = fmha.attention(q, k, v, q_descale=form(sq), k_descale=form(sk),
                             v_descale=form(sv))
        assert_out(got, want, TOL_BF16)


def test_strided_fp8_views(rng):
    # a BHSD view and every other head of a wider buffer reach libfmha as they are
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = fp8_inputs(rng, 2, 19, 23, 6, 2, 40, False)
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    wide = np.zeros((2, 23, 4, 48), dtype=E4M3)
    wide[:, :, ::2, :40] = k
    kt = wide[:, :, ::2, :40]
    out = fmha.attention(qt, kt, v, causal=True, q_descale=sq, k_descale=sk, v_descale=sv)
    want, _ = ref.attention(dq, dk, dv, causal=True)
    assert_out(out, want, TOL_BF16)


# ------------------------------------------------------------------ packed batches

# Sequence lengths 1, 7, 0 and 113 queries over 7, 113, 1 and 113 keys.
CU_Q = np.array([0, 1, 8, 8, 121], dtype=np.int32)
CU_K = np.array([0, 7, 120, 121, 234], dtype=np.int32)


@pytest.mark.parametrize("per_kv_head", [False, True], ids=["per_tensor", "per_kv_head"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_reference(rng, per_kv_head, causal):
    H, Hkv, D = 6, 2, 40
    groups = Hkv if per_kv_head else None
    xs = [rng.standard_normal((int(cu[-1]), h, D)) for cu, h in ((CU_Q, H), (CU_K, Hkv),
                                                                  (CU_K, Hkv))]
    (q, sq), (k, sk), (v, sv) = (quantize_packed(x, cu, groups)
                                 for x, cu in zip(xs, (CU_Q, CU_K, CU_K)))
    if per_kv_head:
        assert sq.shape == sk.shape == (4, Hkv)  # one row per sequence
    dq = dequantize_packed(q, sq, CU_Q, groups)
    dk, dv = (dequantize_packed(x, s, CU_K, groups) for x, s in ((k, sk), (v, sv)))
    want, want_lse = ref.varlen_attention(dq, dk, dv, CU_Q, CU_K, causal=causal)

    out, lse = fmha.varlen_attention(q, k, v, CU_Q, CU_K, 113, 113, causal=causal,
                                     return_lse=True, q_descale=sq, k_descale=sk, v_descale=sv)
    assert out.dtype == BF16 and out.shape == (121, H, D) and lse.shape == (H, 121)
    assert_out(out, want, TOL_BF16)
    ref.assert_lse(lse, want_lse)

    out32 = np.full((121, H, D), np.nan, dtype=np.float32)
    fmha.varlen_attention(q, k, v, CU_Q, CU_K, 0, 0, causal=causal, out=out32, q_descale=sq,
                          k_descale=sk, v_descale=sv)
    assert_out(out32, want, TOL_F32)

    res = fmha.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 113, 113, causal=causal,
                                      return_attn_probs=True, q_descale=sq, k_descale=sk,
                                      v_descale=sv)
    np.testing.assert_array_equal(res[0].astype(np.float32), out.astype(np.float32))
    assert res[2] is None


# ------------------------------------------------------------------ flash_attn and the layer


@pytest.mark.parametrize("per_kv_head", [False, True], ids=["per_tensor", "per_kv_head"])
def test_flash_attn_func(rng, per_kv_head):
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = fp8_inputs(rng, 2, 113, 7, 6, 2, 64, per_kv_head)
    want, want_lse = ref.attention(dq, dk, dv, causal=True, window=(3, 0))
    out, lse, probs = fmha.flash_attn_func(q, k, v, 0.0, None, True, (3, 0),
                                           return_attn_probs=True, q_descale=sq,
                                           k_descale=sk, v_descale=sv)
    assert probs is None and out.dtype == BF16
    assert_out(out, want, TOL_BF16)
    ref.assert_lse(lse, want_lse)


def test_packed_flash_attn_functions(rng):
    # q, k, v as strided views of one FP8 buffer, per-tensor descales
    x = rng.standard_normal((2, 7, 3, 4, 40))
    codes, scale = quantize(x.reshape(2, 7, 12, 40))
    qkv = codes.reshape(2, 7, 3, 4, 40)
    deq = scale[0] * qkv.astype(np.float64)
    want, _ = ref.attention(deq[:, :, 0], deq[:, :, 1], deq[:, :, 2], causal=True)
    out = fmha.flash_attn_qkvpacked_func(qkv, causal=True, q_descale=scale, k_descale=scale,
                                         v_descale=scale)
    assert_out(out, want, TOL_BF16)
    out = fmha.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True,
                                        q_descale=scale, k_descale=scale, v_descale=scale)
    assert_out(out, want, TOL_BF16)
    cu = np.array([0, 7], dtype=np.int32)
    out = fmha.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 7, causal=True, q_descale=scale,
                                                k_descale=scale, v_descale=scale)
    assert_out(out, want[0], TOL_BF16)


def test_layer(rng):
    layer = fmha.Attention(6, 40, causal=True, num_kv_heads=2)
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = fp8_inputs(rng, 2, 7, 113, 6, 2, 40, True)
    out = layer(q, k, v, q_descale=sq, k_descale=sk, v_descale=sv)
    want = fmha.attention(q, k, v, causal=True, q_descale=sq, k_descale=sk, v_descale=sv)
    np.testing.assert_array_equal(out.astype(np.float32), want.astype(np.float32))
    assert layer.kernel.endswith("_f32")  # FP8 inputs run on the CPU's f32 kernels
    assert fmha.Attention(6, 40, num_kv_heads=2, dtype="float8_e4m3fn").kernel.endswith("_f32")
    cu = np.array([0, 7, 14], dtype=np.int32)
    packed = layer.forward_varlen(q.reshape(14, 6, 40), k[:, :7].reshape(14, 2, 40),
                                  v[:, :7].reshape(14, 2, 40), cu, cu, 7, 7, q_descale=sq,
                                  k_descale=sk, v_descale=sv)
    want = fmha.attention(q, k[:, :7], v[:, :7], causal=True, q_descale=sq, k_descale=sk,
                          v_descale=sv)
    np.testing.assert_array_equal(packed.astype(np.float32),
                                  want.reshape(14, 6, 40).astype(np.float32))


# ------------------------------------------------------------------ errors


def test_descales_need_fp8_inputs(rng):
    q = ref.make(rng, (1, 8, 2, 16), "bf16")
    one = np.ones(1, dtype=np.float32)
    with pytest.raises(ValueError, match=r"k_descale is given, but q, k, v are bf16: descales "
                                         r"belong to FP8 \(float8_e4m3fn\) inputs only"):
        fmha.attention(q, q, q, k_descale=one)
    with pytest.raises(ValueError, match="q_descale is given, but q, k, v are f32"):
        fmha.flash_attn_func(q.astype(np.float32), q.astype(np.float32),
                             q.astype(np.float32), q_descale=one)
    layer = fmha.Attention(2, 16, fp8="per_tensor")  # quantizes itself: no descales
    with pytest.raises(ValueError, match="q_descale is given, but q, k, v are bf16"):
        layer(q, q, q, q_descale=one)


def test_fp8_inputs_go_together(rng):
    (q, k, v), (sq, sk, sv), _ = fp8_inputs(rng, 1, 8, 8, 2, 2, 16, False)
    with pytest.raises(ValueError, match=r"k.dtype \(bf16\) differs from q.dtype \(f8_e4m3\): "
                                         r"FP8 q, k and v go together"):
        fmha.attention(q, k.astype(BF16), v, q_descale=sq)
    with pytest.raises(ValueError, match=r"k.dtype \(f8_e4m3\) differs from q.dtype \(bf16\)"):
        fmha.attention(q.astype(BF16), k, v, k_descale=sk)
    with pytest.raises(ValueError, match=r"v.dtype \(f32\) differs from q.dtype \(f8_e4m3\)"):
        fmha.varlen_attention(q[0], k[0], v[0].astype(np.float32), [0, 8], [0, 8], 8, 8)


def test_descale_layout_errors(rng):
    (q, k, v), (sq, sk, sv), _ = fp8_inputs(rng, 2, 8, 8, 6, 2, 16, True)
    one = np.ones(1, dtype=np.float32)
    with pytest.raises(ValueError, match=r"descales mix layouts \(q_descale \[1\], k_descale "
                                         r"\[2, 2\]\).*\[batch, num_kv_heads\] = \[2, 2\]"):
        fmha.attention(q, k, v, q_descale=one, k_descale=sk)
    with pytest.raises(ValueError, match=r"v_descale has shape \[2, 6\]: .*\[batch, "
                                         r"num_kv_heads\] = \[2, 2\]"):
        fmha.attention(q, k, v, q_descale=sq, k_descale=sk, v_descale=np.ones((2, 6)))
    with pytest.raises(ValueError, match=r"q_descale has shape \[4\]"):
        fmha.attention(q, k, v, q_descale=np.ones(4))
    with pytest.raises(ValueError, match=r"q_descale has shape \[2, 2\]: .*\[batch, "
                                         r"num_kv_heads\] = \[3, 2\]"):
        # packed: one row per sequence, here 3 of them
        fmha.varlen_attention(q.reshape(16, 6, 16), k.reshape(16, 2, 16), v.reshape(16, 2, 16),
                              [0, 3, 8, 16], [0, 3, 8, 16], 8, 8, q_descale=sq)


def test_errors_from_the_library(rng):
    (q, k, v), (sq, sk, sv), _ = fp8_inputs(rng, 1, 8, 8, 2, 2, 16, False)
    with pytest.raises(fmha.InvalidArgumentError, match=r"descale_k\[0\] \(-1\) must be "
                                                        r"finite and > 0"):
        fmha.attention(q, k, v, k_descale=-1.0)
    with pytest.raises(fmha.InvalidArgumentError, match="out.dtype f8_e4m3 is not an output "
                                                        "dtype: use f32, f16 or bf16"):
        fmha.attention(q, k, v, out=np.empty(q.shape, dtype=E4M3))
    with pytest.raises(fmha.InvalidArgumentError, match="leave fp8_compute off and pass their "
                                                        "descales"):
        fmha.Attention(2, 16, fp8="per_tensor")(q, k, v, q_descale=sq)


def test_other_fp8_encodings_are_refused(rng):
    # ml_dtypes' float8_e4m3 (with infinities) is another byte encoding
    x = rng.standard_normal((1, 4, 2, 16)).astype(ml_dtypes.float8_e4m3)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fmha.attention(x, x, x)


# ------------------------------------------------------------------ torch


def to_torch(codes):
    return torch.from_numpy(np.ascontiguousarray(codes).view(np.uint8)).view(TORCH_F8)


@needs_torch_f8
@pytest.mark.parametrize("per_kv_head", [False, True], ids=["per_tensor", "per_kv_head"])
def test_torch_cpu_matches_numpy(rng, per_kv_head):
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = fp8_inputs(rng, 2, 7, 113, 6, 2, 40, per_kv_head)
    want = fmha.attention(q, k, v, causal=True, q_descale=sq, k_descale=sk, v_descale=sv)
    tq, tk, tv = map(to_torch, (q, k, v))
    out = fmha.attention(tq, tk, tv, causal=True, q_descale=torch.from_numpy(sq),
                         k_descale=torch.from_numpy(sk), v_descale=torch.from_numpy(sv))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    np.testing.assert_array_equal(out.float().numpy(), want.astype(np.float32))
    out = fmha.flash_attn_func(tq, tk, tv, causal=True, q_descale=torch.from_numpy(sq),
                               k_descale=torch.from_numpy(sk), v_descale=torch.from_numpy(sv))
    np.testing.assert_array_equal(out.float().numpy(), want.astype(np.float32))


@needs_torch_f8
def test_torch_descale_errors(rng):
    (q, k, v), (sq, sk, sv), _ = fp8_inputs(rng, 2, 8, 8, 6, 2, 16, True)
    tq, tk, tv = map(to_torch, (q, k, v))
    with pytest.raises(TypeError, match=r"k_descale must be a contiguous torch.float32 tensor, "
                                        r"got torch.float64; pass k_descale.float\(\)"
                                        r".contiguous\(\)"):
        fmha.attention(tq, tk, tv, k_descale=torch.from_numpy(sk).double())
    with pytest.raises(TypeError, match=r"\(not contiguous\).*\.contiguous\(\)"):
        fmha.attention(tq, tk, tv, q_descale=torch.from_numpy(sq).t().contiguous().t())
    with pytest.raises(ValueError, match="q_descale is given, but q, k, v are bf16"):
        b = tq.to(torch.bfloat16)
        fmha.attention(b, b[:, :, :2], b[:, :, :2], q_descale=torch.ones(1))


# ------------------------------------------------------------------ CUDA (Hopper)


def _hopper_reason():
    if TORCH_F8 is None or not torch.cuda.is_available():
        return None  # the gpu marker skips it already
    if torch.cuda.get_device_capability() != (9, 0):
        return "FP8 attention on CUDA needs a compute capability 9.0 GPU"
    return None


@pytest.mark.gpu
@needs_torch_f8
@pytest.mark.parametrize("per_kv_head", [False, True], ids=["per_tensor", "per_kv_head"])
def test_cuda_matches_cpu(rng, per_kv_head):
    reason = _hopper_reason()
    if reason:
        pytest.skip(reason)
    (q, k, v), (sq, sk, sv), _ = fp8_inputs(rng, 2, 113, 300, 8, 2, 128, per_kv_head)
    want = fmha.attention(q, k, v, causal=True, q_descale=sq, k_descale=sk, v_descale=sv)
    tq, tk, tv = (to_torch(x).cuda() for x in (q, k, v))
    ds = [torch.from_numpy(s).cuda() for s in (sq, sk, sv)]
    out = fmha.attention(tq, tk, tv, causal=True, q_descale=ds[0], k_descale=ds[1],
                         v_descale=ds[2])
    assert out.is_cuda and out.dtype == torch.bfloat16
    # P is multiplied in e4m3 on the GPU: ~2.6e-2 relative L2 (bench/NOTES.md)
    assert ref.rel_l2(out.float().cpu().numpy(), want) <= 5e-2
    with pytest.raises(ValueError, match="q_descale is in host memory but q is on cuda"):
        fmha.attention(tq, tk, tv, q_descale=sq)
