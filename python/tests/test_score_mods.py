"""test_score_mods.py — attention masks, ALiBi slopes and attention sinks
(fmha_forward_args' score modifiers) through the Python API, against the
tests' own float64 reference: every mask dtype and broadcast shape, slopes
per head and per sequence, sinks (one of them -inf), with GQA, causal and
softcap, in padded, packed and decode calls and flash_attn's alibi_slopes;
outputs poisoned first; shape errors; and, with torch, the torch path."""
import re

import numpy as np
import pytest

import fmha
from fmha.flash_attn import flash_attn_func, flash_attn_with_kvcache
from reference import BF16, DTYPES, assert_close, assert_lse, attention, attention_grads

B, SQ, SK, H, HKV, D = 2, 7, 23, 6, 2, 40


def _inputs(rng, dtype="f32", b=B, sq=SQ, sk=SK):
    dt = DTYPES[dtype]
    q = rng.standard_normal((b, sq, H, D)).astype(dt)
    k = rng.standard_normal((b, sk, HKV, D)).astype(dt)
    v = rng.standard_normal((b, sk, HKV, D)).astype(dt)
    return q, k, v


def _alibi_bias(slopes, b, sq, sk):
    """-slope * |i + sk - sq - j| as [b, H, sq, sk] (slopes [H] or [b, H])."""
    s = np.asarray(slopes, np.float64)
    s = np.broadcast_to(s, (b, H))[:, :, None, None]
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return -s * np.abs(i + sk - sq - j)


def _poisoned(shape, dtype):
    out = np.empty(shape, dtype=DTYPES[dtype])
    out.fill(np.nan)
    return out


MASK_SHAPES = [(SQ, SK), (B, 1, SQ, SK), (1, H, SQ, SK), (B, H, SQ, SK), (B, 1, 1, SK),
               (H, 1, SK)]


@pytest.mark.parametrize("shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "f32", "f16", "bf16"])
def test_mask(shape, kind):
    if kind == "bf16" and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    rng = np.random.default_rng(len(shape) * 7 + len(kind))
    q, k, v = _inputs(rng)
    if kind == "bool":
        mask = rng.random(shape) < 0.7
        bias = np.where(mask, 0.0, -np.inf)
    else:
        mask = (1.5 * rng.standard_normal(shape)).astype(DTYPES[kind])
        mask[rng.random(shape) < 0.05] = -np.inf
        bias = mask.astype(np.float64)
    out = _poisoned((B, SQ, H, D), "f32")
    got, lse = fmha.attention(q, k, v, attn_mask=mask, return_lse=True, out=out)
    want, want_lse = attention(q, k, v, bias=bias)
    assert got is out
    # rows whose keys are all hidden: 0 and -inf (the reference's too)
    assert_close(got, want, "f32")
    assert_lse(lse, want_lse)


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(per_sequence, causal):
    rng = np.random.default_rng(3 + per_sequence + 2 * causal)
    q, k, v = _inputs(rng, "bf16" if BF16 is not None else "f16")
    slopes = (0.5 * rng.random((B, H) if per_sequence else (H,))).astype(np.float32)
    got, lse = fmha.attention(q, k, v, alibi_slopes=slopes, causal=causal, return_lse=True)
    want, want_lse = attention(q, k, v, causal=causal, bias=_alibi_bias(slopes, B, SQ, SK))
    assert_close(got, want, "bf16")
    assert_lse(lse, want_lse, 1e-3)
    # flash_attn's name for it: the same numbers
    fa = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
    assert np.array_equal(np.asarray(fa), np.asarray(got))


def test_mask_views():
    """Broadcast, transposed and strided masks are read in place: the same
    answer as their contiguous copies."""
    rng = np.random.default_rng(17)
    q, k, v = _inputs(rng)
    base = rng.random((SK, SQ)) < 0.7
    views = [np.broadcast_to(base.T, (B, H, SQ, SK)),    # stride 0 over batch and heads
             base.T,                                       # transposed: stride_k = SQ
             np.repeat(base.T, 2, axis=1)[:, ::2]]         # a step of 2 along the keys
    want = fmha.attention(q, k, v, attn_mask=np.ascontiguousarray(base.T))
    for m in views:
        assert np.array_equal(np.asarray(fmha.attention(q, k, v, attn_mask=m)), np.asarray(want))
    bias = (1.5 * rng.standard_normal((SQ, SK))).astype(np.float32)
    want = fmha.attention(q, k, v, attn_mask=bias)
    got = fmha.attention(q, k, v, attn_mask=bias[::-1][::-1])  # a view of the same array
    assert np.array_equal(np.asarray(got), np.asarray(want))
    flipped = np.flip(np.flip(bias, 1).copy(), 1)  # bias's values, a negative key stride
    assert flipped.strides[1] < 0
    got = fmha.attention(q, k, v, attn_mask=flipped)  # copied first
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_sinks_softcap_all():
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng)
    sinks = (2.0 * rng.standard_normal(H)).astype(np.float32)
    sinks[-1] = -np.inf  # no sink for that head
    mask = rng.random((SQ, SK)) < 0.5
    mask[2] = False  # a row with no key: out 0, lse = its sink
    slopes = (0.3 * rng.random(H)).astype(np.float32)
    got, lse = fmha.attention(q, k, v, softcap=7.0, attn_mask=mask, alibi_slopes=slopes,
                              sinks=sinks, return_lse=True)
    bias = np.where(mask, 0.0, -np.inf) + _alibi_bias(slopes, B, SQ, SK)
    want, want_lse = attention(q, k, v, softcap=7.0, bias=bias, sinks=sinks)
    assert_close(got, want, "f32")
    assert_lse(lse, want_lse)
    assert np.all(np.asarray(got)[:, 2] == 0)
    assert np.allclose(np.asarray(lse)[:, :-1, 2], sinks[None, :-1])
    assert np.all(np.isneginf(np.asarray(lse)[:, -1, 2]))


def test_no_keys_sinks():
    """Without keys a row's LSE is its sink (-inf for none), out 0: as libfmha."""
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, sk=0)
    sinks = rng.standard_normal(H).astype(np.float32)
    sinks[1] = -np.inf
    out, lse = fmha.attention(q, k, v, sinks=sinks, return_lse=True)
    assert np.all(np.asarray(out) == 0)
    assert np.array_equal(np.asarray(lse), np.broadcast_to(sinks[None, :, None], (B, H, SQ)))
    cu = np.array([0, SQ], np.int32)
    out, lse = fmha.varlen_attention(q[0], k[0], v[0], cu, np.array([0, 0], np.int32), 0, 0,
                                     sinks=sinks, return_lse=True)
    assert np.array_equal(np.asarray(lse), np.broadcast_to(sinks[:, None], (H, SQ)))


def test_varlen_alibi_sinks():
    rng = np.random.default_rng(5)
    lens_q, lens_k = [3, 0, 6], [9, 4, 12]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], H, D)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], HKV, D)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], HKV, D)).astype(np.float32)
    slopes = (0.4 * rng.random((3, H))).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    got = fmha.varlen_attention(q, k, v, cu_q, cu_k, 0, 0, causal=True, alibi_slopes=slopes,
                                sinks=sinks)
    for b in range(3):
        if lens_q[b] == 0:
            continue
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want, _ = attention(q[None, qs], k[None, ks], v[None, ks], causal=True,
                            bias=_alibi_bias(slopes[b], 1, lens_q[b], lens_k[b]), sinks=sinks)
        assert_close(np.asarray(got)[qs], want[0], "f32", "sequence %d" % b)


def test_decode_alibi_sinks():
    rng = np.random.default_rng(8)
    cap, new = 40, 2
    k_cache = rng.standard_normal((B, cap, HKV, D)).astype(np.float32)
    v_cache = rng.standard_normal((B, cap, HKV, D)).astype(np.float32)
    q = rng.standard_normal((B, new, H, D)).astype(np.float32)
    kn = rng.standard_normal((B, new, HKV, D)).astype(np.float32)
    vn = rng.standard_normal((B, new, HKV, D)).astype(np.float32)
    lens = np.array([17, 30], dtype=np.int32)
    slopes = (0.2 * rng.random(H)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    kc, vc = k_cache.copy(), v_cache.copy()
    got = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True,
                                  alibi_slopes=slopes, num_splits=3)
    got2 = fmha.kvcache_attention(q, k_cache, v_cache, kn, vn, cache_seqlens=lens, causal=True,
                                  alibi_slopes=slopes, sinks=sinks)
    for b in range(B):
        n = lens[b] + new
        keys = np.concatenate([k_cache[b, :lens[b]], kn[b]])[None]
        vals = np.concatenate([v_cache[b, :lens[b]], vn[b]])[None]
        bias = _alibi_bias(slopes, 1, new, n)
        want, _ = attention(q[b:b + 1], keys, vals, causal=True, bias=bias)
        assert_close(np.asarray(got)[b:b + 1], want, "f32", "alibi, sequence %d" % b)
        want, _ = attention(q[b:b + 1], keys, vals, causal=True, bias=bias, sinks=sinks)
        assert_close(np.asarray(got2)[b:b + 1], want, "f32", "alibi + sinks, sequence %d" % b)


@pytest.mark.parametrize("causal", [False, True])
def test_backward(causal):
    rng = np.random.default_rng(21 + causal)
    q, k, v = _inputs(rng)
    dout = rng.standard_normal((B, SQ, H, D)).astype(np.float32)
    mask = rng.random((B, 1, SQ, SK)) < 0.7
    slopes = (0.3 * rng.random((B, H))).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    sinks[0] = -np.inf
    kw = dict(causal=causal, attn_mask=mask, alibi_slopes=slopes, sinks=sinks)
    out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv, dsinks = fmha.attention_backward(dout, q, k, v, out, lse, **kw)
    bias = np.where(mask, 0.0, -np.inf) + _alibi_bias(slopes, B, SQ, SK)
    want = attention_grads(q, k, v, dout, causal=causal, bias=bias, sinks=sinks)
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), (dq, dk, dv, dsinks), want):
        assert_close(got, ref, "f32", name)
    assert dsinks[0] == 0.0
    # without sinks: three gradients, as before
    assert len(fmha.attention_backward(dout, q, k, v, out, lse, causal=causal)) == 3
    # the layer's backward: the same numbers
    layer = fmha.Attention(H, D, num_kv_heads=HKV, causal=causal)
    again = layer.backward(dout, q, k, v, out, lse, attn_mask=mask, alibi_slopes=slopes,
                           sinks=sinks)
    for a, b in zip(again, (dq, dk, dv, dsinks)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _packed_inputs(seed):
    """Two packed sequences (4 and 7 queries, 10 and 6 keys): cu_seqlens_q,
    cu_seqlens_k, q, k, v, dout, per-head slopes and sinks (float32)."""
    rng = np.random.default_rng(seed)
    cu_q = np.array([0, 4, 11], np.int32)
    cu_k = np.array([0, 10, 16], np.int32)
    q = rng.standard_normal((11, H, D)).astype(np.float32)
    k = rng.standard_normal((16, HKV, D)).astype(np.float32)
    v = rng.standard_normal((16, HKV, D)).astype(np.float32)
    dout = rng.standard_normal((11, H, D)).astype(np.float32)
    slopes = (0.3 * rng.random(H)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    return cu_q, cu_k, q, k, v, dout, slopes, sinks


def test_varlen_backward():
    lens_q, lens_k = [4, 7], [10, 6]
    cu_q, cu_k, q, k, v, dout, slopes, sinks = _packed_inputs(9)
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, 0, 0, alibi_slopes=slopes, sinks=sinks,
                                     return_lse=True)
    dq, dk, dv, dsinks = fmha.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0, 0,
                                                        alibi_slopes=slopes, sinks=sinks)
    total = np.zeros(H)
    for b in range(2):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want = attention_grads(q[None, qs], k[None, ks], v[None, ks], dout[None, qs],
                               bias=_alibi_bias(slopes, 1, lens_q[b], lens_k[b]), sinks=sinks)
        assert_close(np.asarray(dq)[qs], want[0][0], "f32", "dq %d" % b)
        assert_close(np.asarray(dk)[ks], want[1][0], "f32", "dk %d" % b)
        assert_close(np.asarray(dv)[ks], want[2][0], "f32", "dv %d" % b)
        total += want[3]
    assert_close(dsinks, total, "f32", "dsinks")


def test_layer():
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng)
    layer = fmha.Attention(H, D, num_kv_heads=HKV, causal=True)
    mask = rng.random((B, 1, 1, SK)) < 0.8  # a padding mask
    sinks = rng.standard_normal(H).astype(np.float32)
    got = layer(q, k, v, attn_mask=mask, sinks=sinks)
    want, _ = attention(q, k, v, causal=True, bias=np.where(mask, 0.0, -np.inf), sinks=sinks)
    assert_close(got, want, "f32")


@pytest.mark.parametrize("kw, phrase", [
    (dict(attn_mask=np.ones((3, SQ, SK), bool)), "its heads dim is 3"),
    (dict(attn_mask=np.ones((SQ, SK + 1), bool)), "its seqlen_k dim is 24"),
    (dict(attn_mask=np.ones((2, 2, 2, SQ, SK), bool)), "2-d to 4-d"),
    (dict(alibi_slopes=np.ones(H + 1, np.float32)), "alibi_slopes has shape [7]"),
    (dict(sinks=np.ones((1, H), np.float32)), "sinks has shape [1, 6]"),
    (dict(sinks=np.array([np.nan] * H, np.float32)), "sinks[0] (nan) must be finite"),
    (dict(alibi_slopes=np.array([np.inf] * H, np.float32)), "alibi_slopes[0] (inf)"),
])
def test_errors(kw, phrase):
    q, k, v = _inputs(np.random.default_rng(0))
    out = _poisoned((B, SQ, H, D), "f32")
    with pytest.raises(ValueError, match=re.escape(phrase)):
        fmha.attention(q, k, v, out=out, **kw)
    assert np.all(np.isnan(out)), "out written by a refused call"


def test_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng)
    mask = torch.from_numpy(rng.random((SQ, SK)) < 0.6)
    slopes = torch.rand(H) * 0.3
    sinks = torch.randn(H)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    got = fmha.attention(tq, tk, tv, attn_mask=mask, alibi_slopes=slopes, sinks=sinks)
    assert isinstance(got, torch.Tensor)
    bias = np.where(mask.numpy(), 0.0, -np.inf) + _alibi_bias(slopes.numpy(), B, SQ, SK)
    want, _ = attention(q, k, v, bias=bias, sinks=sinks.numpy())
    assert_close(got.numpy(), want, "f32")
    # a mask or slopes that require grad are refused: fmha has no gradient for them
    with pytest.raises(NotImplementedError, match=r"alibi_slopes\.detach\(\)"):
        fmha.attention(tq, tk, tv, alibi_slopes=slopes.clone().requires_grad_(True))
    with torch.no_grad():
        fmha.attention(tq, tk, tv, alibi_slopes=slopes.clone().requires_grad_(True))


@pytest.mark.parametrize("causal", [False, True])
def test_torch_autograd(causal):
    """loss.backward() through fmha with a mask, slopes per sequence and
    sinks: q, k, v and sinks get the float64 reference's gradients."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31 + causal)
    q, k, v = _inputs(rng)
    dout = rng.standard_normal((B, SQ, H, D)).astype(np.float32)
    mask = (1.5 * rng.standard_normal((B, 1, SQ, SK))).astype(np.float32)
    mask[rng.random(mask.shape) < 0.2] = -np.inf
    slopes = (0.3 * rng.random((B, H))).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    sinks[1] = -np.inf
    tq, tk, tv, ts = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v, sinks))
    # the mask expanded over heads: a stride-0 view the op reads in place
    tmask = torch.from_numpy(mask).expand(B, H, SQ, SK)
    out = fmha.attention(tq, tk, tv, causal=causal, attn_mask=tmask,
                         alibi_slopes=torch.from_numpy(slopes), sinks=ts)
    (out * torch.from_numpy(dout)).sum().backward()
    bias = mask.astype(np.float64) + _alibi_bias(slopes, B, SQ, SK)
    want = attention_grads(q, k, v, dout, causal=causal, bias=bias, sinks=sinks)
    for name, t, ref in zip(("dq", "dk", "dv", "dsinks"), (tq, tk, tv, ts), want):
        assert t.grad is not None, name
        assert_close(t.grad.numpy(), ref, "f32", name)
    # sinks that do not require grad: no dsinks, the rest as before
    tq.grad = None
    fmha.attention(tq, tk.detach(), tv.detach(), causal=causal, attn_mask=tmask,
                   alibi_slopes=slopes, sinks=ts.detach()).sum().backward()
    assert tq.grad is not None and torch.isfinite(tq.grad).all()


def test_torch_autograd_varlen_and_layer():
    torch = pytest.importorskip("torch")
    cu_q, cu_k, q, k, v, dout, slopes, sinks = _packed_inputs(12)
    rng = np.random.default_rng(12)
    want = fmha.varlen_attention_backward(dout, q, k, v, *fmha.varlen_attention(
        q, k, v, cu_q, cu_k, 0, 0, alibi_slopes=slopes, sinks=sinks, return_lse=True),
        cu_q, cu_k, 0, 0, alibi_slopes=slopes, sinks=sinks)
    ts = [torch.from_numpy(x).requires_grad_(True) for x in (q, k, v, sinks)]
    out = fmha.varlen_attention(*ts[:3], torch.from_numpy(cu_q), torch.from_numpy(cu_k), 0, 0,
                                alibi_slopes=torch.from_numpy(slopes), sinks=ts[3])
    (out * torch.from_numpy(dout)).sum().backward()
    for name, t, ref in zip(("dq", "dk", "dv", "dsinks"), ts, want):
        np.testing.assert_allclose(t.grad.numpy(), np.asarray(ref), rtol=0, atol=1e-5,
                                   err_msg=name)
    # the layer object: the same call as fmha.attention
    layer = fmha.Attention(H, D, num_kv_heads=HKV, causal=True)
    xq, xk, xv = _inputs(rng)
    ts = [torch.from_numpy(x).requires_grad_(True) for x in (xq, xk, xv, sinks)]
    layer.forward(*ts[:3], sinks=ts[3]).sum().backward()
    grads = [t.grad.clone() for t in ts]
    for t in ts:
        t.grad = None
    fmha.attention(*ts[:3], causal=True, sinks=ts[3]).sum().backward()
    for g, t in zip(grads, ts):
        assert torch.equal(g, t.grad)
