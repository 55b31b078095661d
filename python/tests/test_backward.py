"""The backward pass from Python: attention_backward / varlen_attention_backward
and Attention.backward on numpy arrays against the tests' own float64
gradients (reference.attention_grads, which never calls libfmha), every
feature and dtype; the errors; and, where torch is installed, autograd
through flash_attn_func, the varlen and packed variants and Attention."""
import numpy as np
import pytest

import fmha
import reference as ref

# Relative L2 error of the gradients against float64. f32: sums in f32 over
# up to a few hundred terms. 16-bit: the gradients are rounded to 8 (bf16) or
# 11 bits, and D = rowsum(dout * out) reads out rounded the same way.
TOL = {"f32": 2e-5, "f16": 1e-2, "bf16": 2e-2}


def needs_dtype(dtype):
    if ref.DTYPES[dtype] is None:
        pytest.skip("ml_dtypes is not installed")


def inputs(rng, B, Sq, Sk, H, Hkv, D, Dv, dtype, layout="bshd"):
    q = ref.make(rng, (B, Sq, H, D), dtype, layout)
    k = ref.make(rng, (B, Sk, Hkv, D), dtype, layout)
    v = ref.make(rng, (B, Sk, Hkv, Dv), dtype, layout)
    dout = ref.make(rng, (B, Sq, H, Dv), dtype, "bshd")
    return q, k, v, dout


def check(got, want, dtype, names=("dq", "dk", "dv")):
    for g, w, name in zip(got, want, names):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        err = ref.rel_l2(g, w)
        assert err <= TOL[dtype], "%s: relative L2 %.3g > %.3g (%s)" % (name, err, TOL[dtype],
                                                                          dtype)


CASES = [
    # B, Sq, Sk, H, Hkv, D, Dv, options
    (2, 37, 37, 4, 4, 64, 64, {}),
    (1, 113, 70, 6, 2, 40, 40, {"causal": True}),                       # GQA 3:1, sq > sk
    (2, 33, 129, 3, 1, 72, 40, {"window": (20, 5)}),                    # MQA, hv != hd
    (1, 65, 65, 2, 1, 128, 128, {"softcap": 5.0, "causal": True}),
    (1, 50, 90, 4, 2, 32, 32, {"dropout_p": 0.3, "seed": 1234}),
    (1, 31, 47, 2, 2, 48, 24, {"softmax_scale": 0.3, "window": (10, -1), "causal": True,
                               "dropout_p": 0.1, "seed": 7, "softcap": 8.0}),
]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_attention_backward(dtype, case):
    needs_dtype(dtype)
    B, Sq, Sk, H, Hkv, D, Dv, opts = CASES[case]
    rng = np.random.default_rng(case)
    layout = ("bshd", "bhsd", "strided")[case % 3]
    q, k, v, dout = inputs(rng, B, Sq, Sk, H, Hkv, D, Dv, dtype, layout)
    out, lse = fmha.attention(q, k, v, return_lse=True, **opts)
    dq, dk, dv = fmha.attention_backward(dout, q, k, v, out, lse, **opts)
    assert dq.dtype == q.dtype and dk.dtype == k.dtype and dv.dtype == v.dtype
    kw = {key: val for key, val in opts.items() if key != "softmax_scale"}
    want = ref.attention_grads(q, k, v, dout, scale=opts.get("softmax_scale"), **kw)
    check((dq, dk, dv), want, dtype)


def test_gradients_in_place_and_deterministic():
    needs_dtype("bf16")
    rng = np.random.default_rng(5)
    q, k, v, dout = inputs(rng, 2, 45, 61, 6, 2, 64, 64, "bf16")
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    dq = np.full(q.shape, np.nan, np.float32)
    buf = np.full((2, 61, 2, 70), np.nan, np.float32)
    dk = buf[:, :, :, 3:67]  # a strided f32 view: written in place
    got = fmha.attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk,
                                  deterministic=True)
    assert got[0] is dq and got[1] is dk and got[2].dtype == v.dtype
    assert np.isnan(buf[..., :3]).all() and np.isnan(buf[..., 67:]).all()
    check(got, ref.attention_grads(q, k, v, dout, causal=True), "bf16")
    again = fmha.attention_backward(dout, q, k, v, out, lse, causal=True,
                                    dq=np.empty_like(dq), dk=np.empty_like(dk))
    for a, b in zip(again, got):  # the same bits, deterministic or not on the CPU
        np.testing.assert_array_equal(a, b)


def test_varlen_backward():
    rng = np.random.default_rng(3)
    cu_q = np.array([0, 5, 5, 40], dtype=np.int32)
    cu_k = np.array([0, 9, 30, 31], dtype=np.int32)
    q = rng.standard_normal((42, 4, 32)).astype(np.float32)  # 2 tokens past the last sequence
    k = rng.standard_normal((33, 2, 32)).astype(np.float32)
    v = rng.standard_normal((33, 2, 16)).astype(np.float32)
    dout = rng.standard_normal((42, 4, 16)).astype(np.float32)
    opts = dict(causal=True, dropout_p=0.2, seed=99)
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, 35, 21, return_lse=True, **opts)
    got = fmha.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 35, 21, **opts)
    want = ref.varlen_attention_grads(q, k, v, dout, cu_q, cu_k, **opts)
    check(got, want, "f32")
    assert not got[0][40:].any() and not got[1][31:].any() and not got[2][31:].any()


def test_layer_backward():
    rng = np.random.default_rng(11)
    layer = fmha.Attention(6, 40, num_kv_heads=2, causal=True, window=(30, -1))
    q, k, v, dout = inputs(rng, 1, 77, 77, 6, 2, 40, 40, "f32")
    out, lse = layer.forward(q, k, v, return_lse=True)
    got = layer.backward(dout, q, k, v, out, lse)
    want = fmha.attention_backward(dout, q, k, v, out, lse, causal=True, window=(30, -1))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # packed
    cu = np.array([0, 30, 77], dtype=np.int32)
    out, lse = layer.forward_varlen(q[0], k[0], v[0], cu, cu, 47, 47, return_lse=True)
    got = layer.backward_varlen(dout[0], q[0], k[0], v[0], out, lse, cu, cu, 47, 47)
    check(got, ref.varlen_attention_grads(q[0], k[0], v[0], dout[0], cu, cu, causal=True,
                                          window=(30, -1)), "f32")


def test_empty():
    q = np.zeros((1, 0, 2, 8), np.float32)
    k = np.ones((1, 5, 1, 8), np.float32)
    out = np.zeros((1, 0, 2, 8), np.float32)
    lse = np.zeros((1, 2, 0), np.float32)
    dq, dk, dv = fmha.attention_backward(out, q, k, k, out, lse)
    assert dq.shape == q.shape and not dk.any() and not dv.any()


def test_errors():
    rng = np.random.default_rng(0)
    q, k, v, dout = inputs(rng, 1, 9, 9, 2, 1, 16, 16, "f32")
    out, lse = fmha.attention(q, k, v, return_lse=True, dropout_p=0.5, seed=3)
    with pytest.raises(ValueError, match="needs the seed the forward used"):
        fmha.attention_backward(dout, q, k, v, out, lse, dropout_p=0.5)
    with pytest.raises(ValueError, match="dq has shape"):
        fmha.attention_backward(dout, q, k, v, out, lse, dq=np.zeros_like(k))
    with pytest.raises(ValueError, match="lse has shape"):
        fmha.attention_backward(dout, q, k, v, out, lse[:, :, :5])
    with pytest.raises(TypeError, match="lse must be float32"):
        fmha.attention_backward(dout, q, k, v, out, lse.astype(np.float64))
    with pytest.raises(fmha.InvalidArgumentError, match="dout has shape"):
        fmha.attention_backward(dout[:, :8], q, k, v, out, lse)
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        fmha.attention_backward(dout, q, k, v, out, lse, deterministic=2)
    layer = fmha.Attention(2, 16, num_kv_heads=1, fp8="per_tensor")
    with pytest.raises(fmha.UnsupportedError, match="fp8_compute layers have no backward"):
        layer.backward(dout, q, k, v, out, lse)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q8, k8, v8 = (x.astype(ml_dtypes.float8_e4m3fn) for x in (q, k, v))
    with pytest.raises(fmha.UnsupportedError, match="f8_e4m3 inputs have no backward"):
        fmha.attention_backward(dout, q8, k8, v8, out, lse)


# ------------------------------------------------------------------ torch autograd


def _torch():
    return pytest.importorskip("torch")


def _leaf(torch, x):
    return torch.from_numpy(np.ascontiguousarray(x)).requires_grad_()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_torch_flash_attn_func_grad(dtype):
    torch = _torch()
    rng = np.random.default_rng(21)
    q, k, v, dout = inputs(rng, 2, 30, 41, 6, 2, 32, 32, "f32")
    td = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    tq, tk, tv = (torch.from_numpy(x).to(td).requires_grad_() for x in (q, k, v))
    out = fmha.flash_attn_func(tq, tk, tv, causal=True, softcap=4.0)
    assert out.requires_grad
    out.backward(torch.from_numpy(dout).to(td))
    f64 = lambda t: t.detach().to(torch.float64).numpy()
    want = ref.attention_grads(f64(tq), f64(tk), f64(tv), f64(torch.from_numpy(dout).to(td)),
                               causal=True, softcap=4.0)
    check((f64(tq.grad), f64(tk.grad), f64(tv.grad)), want, dtype)


def test_torch_varlen_and_packed_grads():
    torch = _torch()
    rng = np.random.default_rng(22)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    qkv = torch.from_numpy(rng.standard_normal((20, 3, 2, 16)).astype(np.float32)).requires_grad_()
    out = fmha.flash_attn_varlen_qkvpacked_func(qkv, cu, 13, causal=True)
    out.sum().backward()  # dout: expanded ones (stride 0), made contiguous for libfmha
    x = qkv.detach().numpy().astype(np.float64)
    want = ref.varlen_attention_grads(x[:, 0], x[:, 1], x[:, 2], np.ones((20, 2, 16)),
                                      cu.numpy(), cu.numpy(), causal=True)
    check((qkv.grad[:, 0].numpy(), qkv.grad[:, 1].numpy(), qkv.grad[:, 2].numpy()), want, "f32")
    q = torch.from_numpy(rng.standard_normal((1, 9, 4, 16)).astype(np.float32)).requires_grad_()
    kv = torch.from_numpy(rng.standard_normal((1, 11, 2, 2, 16)).astype(np.float32)) \
        .requires_grad_()
    fmha.flash_attn_kvpacked_func(q, kv).sum().backward()
    want = ref.attention_grads(q.detach().numpy(), kv.detach()[:, :, 0].numpy(),
                               kv.detach()[:, :, 1].numpy(), np.ones((1, 9, 4, 16)))
    check((q.grad.numpy(), kv.grad[:, :, 0].numpy(), kv.grad[:, :, 1].numpy()), want, "f32")


def test_torch_dropout_and_layer_grads():
    torch = _torch()
    rng = np.random.default_rng(23)
    q, k, v, dout = (torch.from_numpy(x) for x in inputs(rng, 1, 24, 24, 4, 4, 16, 16, "f32"))
    fmha.manual_seed(5)
    tq = q.clone().requires_grad_()
    out = fmha.flash_attn_func(tq, k, v, dropout_p=0.4)
    out.backward(dout)
    assert tq.grad is not None and torch.isfinite(tq.grad).all()
    # the same seed sequence again: the same mask, the same gradient
    fmha.manual_seed(5)
    tq2 = q.clone().requires_grad_()
    fmha.flash_attn_func(tq2, k, v, dropout_p=0.4).backward(dout)
    assert torch.equal(tq.grad, tq2.grad)
    layer = fmha.Attention(4, 16, causal=True)
    tq3, tk3, tv3 = (x.clone().requires_grad_() for x in (q, k, v))
    layer(tq3, tk3, tv3).backward(dout)
    want = ref.attention_grads(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), causal=True)
    check((tq3.grad.numpy(), tk3.grad.numpy(), tv3.grad.numpy()), want, "f32")


def test_torch_gradcheck():
    """torch.autograd.gradcheck in float32 (fmha has no float64 kernels), so
    with float32-sized steps and tolerances."""
    torch = _torch()
    rng = np.random.default_rng(24)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 5, 2, 8)).astype(np.float32))
               .requires_grad_() for _ in range(3))
    fn = lambda a, b, c: fmha.flash_attn_func(a, b, c, causal=True, softcap=3.0)
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-2, atol=5e-3, rtol=5e-3,
                                    fast_mode=True)
