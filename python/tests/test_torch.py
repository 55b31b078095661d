"""torch tensors: on the CPU against the numpy reference, on CUDA (marked
`gpu`) against torch's scaled_dot_product_attention and fmha's CPU backend.
Skipped without torch; the GPU tests also without CUDA."""
import numpy as np
import pytest

import fmha
import reference as ref

torch = pytest.importorskip("torch")
F = torch.nn.functional

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def rand(shape, dtype, device="cpu", layout="bshd", seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "bhsd":  # [B, H, S, D] memory seen as [B, S, H, D]
        b, s, h, d = shape
        return torch.randn((b, h, s, d), generator=g).to(device, TORCH_DTYPES[dtype]) \
            .transpose(1, 2)
    return torch.randn(shape, generator=g).to(device, TORCH_DTYPES[dtype])


def f64(t):
    return t.detach().cpu().to(torch.float64).numpy()


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_cpu_tensors(dtype, layout):
    q = rand((2, 19, 4, 32), dtype, layout=layout, seed=1)
    k = rand((2, 23, 2, 32), dtype, layout=layout, seed=2)
    v = rand((2, 23, 2, 32), dtype, layout=layout, seed=3)
    out, lse = fmha.attention(q, k, v, causal=True, window=(9, -1), return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.device == q.device
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (2, 4, 19)
    want, want_lse = ref.attention(f64(q), f64(k), f64(v), causal=True, window=(9, -1))
    ref.assert_close(f64(out), want, dtype)
    ref.assert_lse(f64(lse), want_lse)


def test_cpu_varlen_and_flash_attn():
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k, v = (rand((1, 12, 2, 16), "bf16", seed=s)[0] for s in range(3))
    out, lse, none = fmha.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True,
                                                 return_attn_probs=True)
    assert none is None and isinstance(out, torch.Tensor) and tuple(lse.shape) == (2, 12)
    want, want_lse = ref.varlen_attention(f64(q), f64(k), f64(v), cu.numpy(), cu.numpy(),
                                          causal=True)
    ref.assert_close(f64(out), want, "bf16")
    ref.assert_lse(f64(lse), want_lse)


def test_repeated_calls_table(monkeypatch):
    """A repeated call takes the repeat table (fmha/_api.py): same answer as
    the first call, bit for bit, on new data in the same layout; a call that
    differs in strides, options, return_lse or an environment knob is not
    mistaken for it, nor is a lazily negated view (refused); a call the table took still
    validates in libfmha. (The Python path's table: fmha.torch_ext's compiled
    path, which takes such calls where it is built, is off here.)"""
    from fmha import _api
    monkeypatch.setattr(_api, "_repeat", __import__("threading").local())
    monkeypatch.setattr(_api, "_fast", None)
    q, k, v = (rand((2, 19, 4, 32), "f32", seed=s) for s in range(3))
    first, lse1 = fmha.attention(q, k, v, causal=True, return_lse=True)
    table = _api._repeat.calls
    assert len(table) == 1
    q2, k2, v2 = (rand((2, 19, 4, 32), "f32", seed=s + 10) for s in range(3))
    again, lse2 = fmha.attention(q2, k2, v2, causal=True, return_lse=True)
    assert len(table) == 1  # a hit
    want, want_lse = ref.attention(f64(q2), f64(k2), f64(v2), causal=True)
    ref.assert_close(f64(again), want, "f32")
    ref.assert_lse(f64(lse2), want_lse)
    assert torch.equal(fmha.attention(q, k, v, causal=True, return_lse=True)[0], first)
    # Each of these differs from the first call in one thing the table keys on.
    qt = rand((2, 19, 4, 32), "f32", layout="bhsd", seed=1)  # same shape, other strides
    others = [
        (lambda: fmha.attention(qt, k, v, causal=True, return_lse=True)[0],
         lambda: ref.attention(f64(qt), f64(k), f64(v), causal=True)[0]),
        (lambda: fmha.attention(q, k, v, causal=False, return_lse=True)[0],
         lambda: ref.attention(f64(q), f64(k), f64(v), causal=False)[0]),
        (lambda: fmha.attention(q, k, v, causal=True),
         lambda: ref.attention(f64(q), f64(k), f64(v), causal=True)[0]),
    ]
    for i, (got, exact) in enumerate(others):
        n = len(table)
        ref.assert_close(f64(got()), exact(), "f32")
        assert len(table) == n + 1, i
    # Attention layers: each its own entries (their options differ, their keys too)
    for causal in (False, True):
        layer = fmha.Attention(4, 32, causal=causal)
        n = len(table)
        for x in (q, q2):
            got = layer.forward(x, k, v)
            ref.assert_close(f64(got), ref.attention(f64(x), f64(k), f64(v), causal=causal)[0],
                             "f32")
        assert len(table) == n + 1 and layer.kernel
    with pytest.raises(ValueError, match="negated"):  # refused, not taken for q
        fmha.attention(q._neg_view(), k, v, causal=True, return_lse=True)
    monkeypatch.setenv("FMHA_CPU_ISA", "scalar")
    n = len(table)
    fmha.attention(q, k, v, causal=True, return_lse=True)
    assert len(table) == n + 1
    # libfmha still validates a call the table takes: an out-of-range window
    bad = fmha.attention(q, k, v, window=(3, 3))
    with pytest.raises(ValueError, match="window"):
        fmha.attention(q, k, v, window=(3, -5))
    ref.assert_close(f64(bad), ref.attention(f64(q), f64(k), f64(v), window=(3, 3))[0], "f32")


def test_repeated_packed_calls_table(monkeypatch):
    """Packed calls take the repeat table when their offsets are int32 tensors
    in q's memory: a hit with other offsets (same count, same bounds) reads
    the new ones; int64 offsets are converted and not taken; other bounds
    make another entry. (The Python path's table: the compiled path is off.)"""
    from fmha import _api
    monkeypatch.setattr(_api, "_repeat", __import__("threading").local())
    monkeypatch.setattr(_api, "_fast", None)
    q, k, v = (rand((1, 40, 4, 32), "f32", seed=s)[0] for s in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA 4/2, strided views
    runs = [([0, 10, 10, 40], 30), ([0, 25, 33, 40], 30), ([0, 1, 2, 3], 30), ([0, 5, 9, 12], 7)]
    sizes = []
    for offsets, bound in runs:
        cu = torch.tensor(offsets, dtype=torch.int32)
        out, lse = fmha.varlen_attention(q, k, v, cu, cu, bound, bound, causal=True,
                                         return_lse=True)
        want, want_lse = ref.varlen_attention(f64(q), f64(k), f64(v), cu.numpy(), cu.numpy(),
                                              causal=True)
        n = offsets[-1]  # tokens past the last sequence are not written
        ref.assert_close(f64(out)[:n], want[:n], "f32")
        ref.assert_lse(f64(lse)[:, :n], want_lse[:, :n])
        sizes.append(len(_api._repeat.calls))
    assert sizes == [1, 1, 1, 2], sizes
    cu64 = torch.tensor([0, 25, 33, 40])
    out = fmha.varlen_attention(q, k, v, cu64, cu64, 30, 30, causal=True)
    want = ref.varlen_attention(f64(q), f64(k), f64(v), cu64.numpy(), cu64.numpy(),
                                causal=True)[0]
    ref.assert_close(f64(out), want, "f32")
    assert len(_api._repeat.calls) == 2


def test_cpu_errors():
    q = rand((1, 8, 2, 16), "f32")
    with pytest.raises(ValueError, match="contiguous.*\\.contiguous\\(\\)"):
        fmha.attention(q, q.transpose(2, 3), q)
    with pytest.raises(TypeError, match="torch.float32, torch.float16, torch.bfloat16 or FP8"):
        fmha.attention(q.double(), q, q)
    with pytest.raises(ValueError, match="out= cannot be written in place"):
        fmha.attention(q.clone().requires_grad_(), q, q, out=torch.empty_like(q))
    with torch.no_grad():  # no graph without autograd
        assert not fmha.attention(q.clone().requires_grad_(), q, q).requires_grad


def test_numpy_and_torch_agree():
    q, k, v = (rand((1, 16, 2, 32), "f16", seed=s) for s in range(3))
    np.testing.assert_array_equal(fmha.attention(q, k, v).numpy(),
                                  fmha.attention(q.numpy(), k.numpy(), v.numpy()))


# ------------------------------------------------------------------ CUDA

gpu = pytest.mark.gpu


def torch_reference(q, k, v, causal=False, window=(-1, -1), scale=None, softcap=0.0):
    """float32 attention in torch: SDPA with a bottom-right boolean mask, or
    explicit math when softcap is on (SDPA has no softcap)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(H // Hkv, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(H // Hkv, dim=2).transpose(1, 2)
    mask = torch.from_numpy(ref.visible(Sq, Sk, causal, window)).to(q.device)
    scale = scale or D ** -0.5
    if softcap:
        s = qf @ kf.transpose(-1, -2) * scale
        s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = torch.softmax(s, dim=-1) @ vf
    else:
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
        s = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
    return torch.nan_to_num(out.transpose(1, 2), nan=0.0), lse


@gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("case", [
    dict(), dict(causal=True), dict(causal=True, sq=77, sk=200), dict(window=(32, 16)),
    dict(softcap=30.0, causal=True), dict(scale=0.05, h=8, hkv=2), dict(h=6, hkv=1, d=64),
    dict(d=256, sq=65, sk=65), dict(d=96, causal=True), dict(d=512, causal=True, sq=77, sk=150),
    dict(d=384, h=8, hkv=2, window=(40, 8))])
def test_cuda_against_sdpa(dtype, layout, case):
    B, sq, sk = 2, case.get("sq", 130), case.get("sk", 130)
    h, hkv, d = case.get("h", 4), case.get("hkv", 4), case.get("d", 128)
    q = rand((B, sq, h, d), dtype, "cuda", layout, seed=1)
    k = rand((B, sk, hkv, d), dtype, "cuda", layout, seed=2)
    v = rand((B, sk, hkv, d), dtype, "cuda", layout, seed=3)
    kw = dict(causal=case.get("causal", False), window=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0))
    out, lse = fmha.attention(q, k, v, softmax_scale=case.get("scale"), return_lse=True, **kw)
    assert out.is_cuda and out.dtype == q.dtype and lse.is_cuda
    want, want_lse = torch_reference(q, k, v, scale=case.get("scale"), **kw)
    ref.assert_close(f64(out), f64(want), dtype)
    ref.assert_lse(f64(lse), f64(want_lse), tol=1e-4)


@gpu
def test_cuda_matches_cpu_backend_with_dropout():
    # both backends draw the same Philox stream: the same elements are dropped
    q, k, v = (rand((2, 96, 4, 64), "bf16", "cuda", seed=s) for s in range(3))
    g = fmha.attention(q, k, v, causal=True, dropout_p=0.2, seed=99)
    c = fmha.attention(q.cpu(), k.cpu(), v.cpu(), causal=True, dropout_p=0.2, seed=99)
    ref.assert_close(f64(g), f64(c), "bf16")
    again = fmha.attention(q, k, v, causal=True, dropout_p=0.2, seed=99)
    assert torch.equal(g, again)
    other = fmha.attention(q, k, v, causal=True, dropout_p=0.2, seed=100)
    assert ref.rel_l2(f64(other), f64(g)) > 0.05


@gpu
def test_cuda_varlen():
    cu = torch.tensor([0, 100, 100, 357, 400], dtype=torch.int32, device="cuda")
    q = rand((1, 400, 8, 128), "bf16", "cuda", seed=1)[0]
    k, v = (rand((1, 400, 2, 128), "bf16", "cuda", seed=s)[0] for s in (2, 3))
    out, lse = fmha.varlen_attention(q, k, v, cu, cu, 257, 257, causal=True, return_lse=True)
    c_out, c_lse = fmha.varlen_attention(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), cu.cpu(), 257, 257,
                                         causal=True, return_lse=True)
    ref.assert_close(f64(out), f64(c_out), "bf16")
    ref.assert_lse(f64(lse), f64(c_lse), tol=1e-4)
    # cu_seqlens given on the host are moved to q's device
    out2 = fmha.varlen_attention(q, k, v, cu.cpu(), cu.cpu(), 257, 257, causal=True)
    assert torch.equal(out, out2)


@gpu
def test_cuda_stream_and_layer():
    layer = fmha.Attention(8, 128, causal=True, num_kv_heads=8)
    q, k, v = (rand((1, 512, 8, 128), "f16", "cuda", seed=s) for s in range(3))
    want = layer.forward(q, k, v)
    # the chooser's kernel for this GPU (Hopper's on sm_90, the portable one elsewhere)
    assert layer.kernel == layer.kernel_for("f16", "cuda") and layer.kernel.startswith("cuda_")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # runs on the caller's current stream
        q2, k2, v2 = q * 1, k * 1, v * 1
        got = layer.forward(q2, k2, v2)
    s.synchronize()
    assert torch.equal(got, want)
    assert fmha.Attention(8, 128, dtype=torch.bfloat16, device="cuda").kernel.startswith("cuda_")


@gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_autograd_score_mods(varlen):
    """loss.backward() on CUDA with a mask, ALiBi slopes and sinks: the CUDA
    backward's gradients (sinks' too) against the CPU's on the same bf16
    inputs, each within bf16's tolerance of the other's float64 values."""
    torch.manual_seed(7)
    B, S, H, HKV, D = 2, 150, 6, 2, 64
    q, k, v = (rand((B, S, n, D), "bf16", "cuda", seed=s)
               for s, n in ((1, H), (2, HKV), (3, HKV)))
    mask = None if varlen else (torch.rand(B, 1, S, S, device="cuda") < 0.8)
    slopes = torch.rand(H, device="cuda") * 0.1
    sinks = torch.randn(H, device="cuda")
    dout = torch.randn(B, S, H, D, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, 40, 2 * S], dtype=torch.int32, device="cuda")

    def grads(dev):
        ts = [t.detach().to(dev).requires_grad_(True) for t in (q, k, v, sinks)]
        if varlen:
            flat = [t.reshape(-1, *t.shape[2:]) for t in ts[:3]]
            out = fmha.varlen_attention(*flat, cu.to(dev), cu.to(dev), 2 * S, 2 * S, causal=True,
                                        alibi_slopes=slopes.to(dev), sinks=ts[3])
            out = out.view(B, S, H, D)
        else:
            out = fmha.attention(*ts[:3], causal=True, attn_mask=mask.to(dev),
                                 alibi_slopes=slopes.to(dev), sinks=ts[3])
        (out.float() * dout.to(dev).float()).sum().backward()
        return [t.grad for t in ts]

    for g, c, name in zip(grads("cuda"), grads("cpu"), ("dq", "dk", "dv", "dsinks")):
        assert g.is_cuda
        ref.assert_close(f64(g), f64(c), "bf16", name)


@gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_decode_alibi_sinks(splits):
    """Decode on CUDA with ALiBi slopes per sequence and sinks (one -inf), a
    paged bf16 cache, split keys or not: the CPU's answer on the same values."""
    B, H, HKV, D, page = 3, 8, 2, 128, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 2, H, D, generator=g).to(torch.bfloat16)
    kc = torch.randn(40, page, HKV, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(40, page, HKV, D, generator=g).to(torch.bfloat16)
    table = torch.randperm(40, generator=g)[:36].view(B, 12).to(torch.int32)
    lens = torch.tensor([150, 7, 190], dtype=torch.int32)
    slopes = torch.rand(B, H, generator=g) * 0.2
    sinks = torch.randn(H, generator=g)
    sinks[3] = float("-inf")

    def run(dev):
        return fmha.kvcache_attention(q.to(dev), kc.to(dev), vc.to(dev),
                                      cache_seqlens=lens.to(dev), block_table=table.to(dev),
                                      causal=True, alibi_slopes=slopes.to(dev),
                                      sinks=sinks.to(dev), num_splits=splits, return_lse=True)

    (out, lse), (c_out, c_lse) = run("cuda"), run("cpu")
    ref.assert_close(f64(out), f64(c_out), "bf16")
    ref.assert_lse(f64(lse), f64(c_lse), tol=1e-3)


@gpu
def test_cuda_errors():
    q = rand((1, 16, 2, 64), "f32", "cuda")
    with pytest.raises(NotImplementedError, match="f16 or bf16"):
        fmha.attention(q, q, q)
    q16 = q.half()
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        fmha.attention(q16, q16.cpu(), q16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_flash_attn_combine_torch(device):
    """fmha.flash_attn_interface.flash_attn_combine on torch tensors: the
    same answer as on numpy arrays, on the tensors' device."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from fmha import flash_attn_interface as fa3
    g = torch.Generator().manual_seed(5)
    op = torch.randn((3, 2, 5, 4, 8), generator=g)
    lp = torch.randn((3, 2, 5, 4), generator=g)
    lp[:, 0, 0, 0] = -float("inf")
    want, want_lse = fa3.flash_attn_combine(op.numpy(), lp.numpy())
    out, lse = fa3.flash_attn_combine(op.to(device), lp.to(device))
    assert out.device.type == device and out.dtype == torch.float32
    np.testing.assert_allclose(f64(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f64(lse), want_lse, rtol=1e-5, atol=1e-6)
