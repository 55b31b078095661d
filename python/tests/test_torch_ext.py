"""fmha.torch_ext, the compiled path: built here (skipped without torch, a
C++ compiler or ninja, unless FMHA_TEST_TORCH_EXT=1 says it must build, as
CI does), then against the float64 reference and the Python path bit for
bit, on awkward shapes, strides, GQA and every option it takes (padded,
packed, Attention layers, random calls); calls that autograd records (its
autograd Functions' gradients against the ops'); the calls it hands back to
the Python path (numpy, dropout, out=, modifiers, negated views, refused
shapes with the Python path's errors); the environment's knobs; threads;
torch.compile; a new process finding it; FMHA_TORCH_EXT=0; CUDA (GPU tests)."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fmha
import reference as ref
from fmha import _api

torch = pytest.importorskip("torch")

REQUIRED = os.environ.get("FMHA_TEST_TORCH_EXT") == "1"
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def ext():
    """The built module, loaded as fmha loads it at a torch call."""
    import fmha.torch_ext as te
    try:
        mod = te.build()
    except Exception as e:
        if REQUIRED:
            raise
        pytest.skip("fmha.torch_ext does not build here (%s: %s)" % (type(e).__name__, e))
    fmha.attention(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
    saved = _api._fast
    _api._fast = mod
    yield mod
    _api._fast = saved


@pytest.fixture
def python_only(monkeypatch):
    """Makes the Python path raise, so a call that returns took the compiled one."""
    def refuse(*a, **kw):
        raise AssertionError("the call took the Python path")
    monkeypatch.setattr(_api, "_attention", refuse)


def rand(shape, dtype, seed, layout="bshd"):
    g = torch.Generator().manual_seed(seed)
    if layout == "bhsd":
        b, s, h, d = shape
        return torch.randn((b, h, s, d), generator=g).to(DTYPES[dtype]).transpose(1, 2)
    if layout == "padded":  # rows further apart than the head dim, a batch stride of its own
        b, s, h, d = shape
        return torch.randn((b, s + 3, h, d + 5), generator=g).to(DTYPES[dtype])[:, 2:2 + s, :, :d]
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


def f64(t):
    return t.detach().to(torch.float64).numpy()


PYTHON_PATH = _api._attention


def python_path(fn):
    """fn() with the compiled path off (and the Python path on where
    python_only took it away)."""
    saved = _api._fast, _api._attention
    _api._fast, _api._attention = None, PYTHON_PATH
    try:
        return fn()
    finally:
        _api._fast, _api._attention = saved


CASES = [  # B, Sq, Sk, H, Hkv, D, Dv, causal, window, softcap, scale
    (1, 1, 1, 1, 1, 8, 8, False, (-1, -1), 0.0, None),
    (2, 19, 23, 4, 2, 32, 32, True, (9, -1), 0.0, None),
    (3, 37, 5, 6, 1, 40, 24, False, (-1, -1), 0.0, 0.3),
    (1, 70, 70, 3, 3, 64, 64, True, (-1, -1), 30.0, None),
    (2, 17, 130, 8, 4, 96, 80, False, (20, 3), 0.0, 0.07),
    (1, 129, 66, 2, 2, 128, 128, True, (-1, 7), 5.0, 1),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "padded"])
def test_against_reference_and_python_path(ext, python_only, case, dtype, layout):
    B, Sq, Sk, H, Hkv, D, Dv, causal, window, softcap, scale = case
    q = rand((B, Sq, H, D), dtype, 1, layout)
    k = rand((B, Sk, Hkv, D), dtype, 2, layout)
    v = rand((B, Sk, Hkv, Dv), dtype, 3, layout)
    kw = dict(causal=causal, window=window, softcap=softcap, softmax_scale=scale)
    out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype and tuple(out.shape) == (B, Sq, H, Dv) and out.is_contiguous()
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (B, H, Sq)
    want, want_lse = ref.attention(f64(q), f64(k), f64(v), causal=causal, window=window,
                                   softcap=softcap, scale=scale)
    ref.assert_close(f64(out), want, dtype)
    ref.assert_lse(f64(lse), want_lse)
    alone = fmha.attention(q, k, v, **kw)
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, out)
    p_out, p_lse = python_path(lambda: fmha.attention(q, k, v, return_lse=True, **kw))
    assert torch.equal(out, p_out) and torch.equal(lse, p_lse)


VARLEN = [  # offsets q, offsets k, H, Hkv, D, Dv, causal, window, softcap
    ([0, 5, 5, 12], [0, 5, 5, 12], 2, 2, 16, 16, True, (-1, -1), 0.0),
    ([0, 1, 40, 41], [0, 30, 31, 90], 6, 2, 64, 48, False, (7, 2), 0.0),
    ([0, 33], [0, 17], 4, 1, 128, 128, True, (-1, -1), 20.0),
    ([0, 3, 9, 9, 20, 57], [0, 8, 8, 16, 50, 51], 3, 3, 24, 40, True, (5, -1), 0.0),
]


@pytest.mark.parametrize("case", VARLEN)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("bounds", [False, True])
def test_varlen(ext, case, dtype, bounds, monkeypatch):
    cq, ck, H, Hkv, D, Dv, causal, window, softcap = case
    monkeypatch.setattr(_api, "_varlen_attention", lambda *a: pytest.fail("Python path"))
    q = rand((1, cq[-1] + 2, H, D), dtype, 1)[0]  # two tokens past the last sequence
    k = rand((1, ck[-1], Hkv, D), dtype, 2, "bhsd")[0]
    v = rand((1, ck[-1], Hkv, Dv), dtype, 3)[0]
    cuq, cuk = torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)
    mq = max(b - a for a, b in zip(cq, cq[1:])) if bounds else None
    mk = max(b - a for a, b in zip(ck, ck[1:])) if bounds else None
    kw = dict(causal=causal, window=window, softcap=softcap)
    out, lse = fmha.varlen_attention(q, k, v, cuq, cuk, mq, mk, return_lse=True, **kw)
    assert tuple(out.shape) == (q.shape[0], H, Dv) and tuple(lse.shape) == (H, q.shape[0])
    want, want_lse = ref.varlen_attention(f64(q), f64(k), f64(v), np.array(cq), np.array(ck),
                                          **kw)
    n = cq[-1]  # tokens past the last sequence are not written
    ref.assert_close(f64(out)[:n], want[:n], dtype)
    ref.assert_lse(f64(lse)[:, :n], want_lse[:, :n])
    monkeypatch.undo()
    p_out, p_lse = python_path(lambda: fmha.varlen_attention(q, k, v, cuq, cuk, mq, mk,
                                                             return_lse=True, **kw))
    assert torch.equal(out[:n], p_out[:n]) and torch.equal(lse[:, :n], p_lse[:, :n])
    fa = fmha.flash_attn_varlen_func(q, k, v, cuq, cuk, mq or 64, mk or 128, causal=causal,
                                     window_size=window, softcap=softcap)
    assert torch.equal(fa[:n], out[:n])


def test_varlen_handed_back(ext):
    """int64 or host-list offsets, offsets of different lengths: the Python
    path (which converts, or raises its error)."""
    q, k, v = (rand((1, 12, 2, 16), "f32", s)[0] for s in range(3))
    c3 = torch.tensor([0, 5, 12], dtype=torch.int32)
    c4 = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    want = python_path(lambda: fmha.varlen_attention(q, k, v, c3, c3, None, None))
    for cu in (torch.tensor([0, 5, 12]), [0, 5, 12]):
        assert torch.equal(fmha.varlen_attention(q, k, v, cu, cu, None, None), want)
    with pytest.raises(ValueError, match="entries"):
        fmha.varlen_attention(q, k, v, c3, c4, None, None)
    with pytest.raises(ValueError):
        fmha.varlen_attention(q, k, v, c3, c3, 2, 7)  # a sequence longer than its bound


def test_attention_layer(ext, monkeypatch):
    """fmha.Attention's forward and forward_varlen take the compiled path:
    the Python path's bits, its kernel reported, a tensor of another shape
    refused with the layer's message; layers whose options the compiled
    path does not take (dropout, FP8, check_finite) keep the Python path."""
    layer = fmha.Attention(6, 40, 0.2, True, 2, window=(11, -1), softcap=9.0)
    q = rand((2, 23, 6, 40), "bf16", 1)
    k = rand((2, 31, 2, 40), "bf16", 2, "bhsd")
    v = rand((2, 31, 2, 24), "bf16", 3)
    monkeypatch.setattr(fmha.Attention, "_forward", lambda *a: pytest.fail("Python path"))
    out, lse = layer.forward(q, k, v, return_lse=True)
    assert torch.equal(layer(q, k, v), out)
    kernel = layer.kernel
    monkeypatch.undo()
    want, want_lse = ref.attention(f64(q), f64(k), f64(v), causal=True, window=(11, -1),
                                   softcap=9.0, scale=0.2)
    ref.assert_close(f64(out), want, "bf16")
    ref.assert_lse(f64(lse), want_lse)
    p_out, p_lse = python_path(lambda: layer.forward(q, k, v, return_lse=True))
    assert torch.equal(out, p_out) and torch.equal(lse, p_lse)
    assert kernel == layer.kernel == layer.kernel_for("bf16", "cpu")
    with pytest.raises(Exception) as fast:
        layer.forward(q[:, :, :4], k, v)
    with pytest.raises(Exception) as slow:
        python_path(lambda: layer.forward(q[:, :, :4], k, v))
    assert str(fast.value) == str(slow.value)
    # packed
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)
    cuk = torch.tensor([0, 20, 31], dtype=torch.int32)
    qp, kp, vp = q[0], k[0], v[0]
    monkeypatch.setattr(fmha.Attention, "_forward_varlen", lambda *a: pytest.fail("Python path"))
    got = layer.forward_varlen(qp, kp, vp, cu, cuk, 14, 20)
    monkeypatch.undo()
    assert torch.equal(got, python_path(lambda: layer.forward_varlen(qp, kp, vp, cu, cuk, 14, 20)))
    # options the compiled path leaves to the Python path
    seen = []
    mod = ext
    _api._fast = type("Spy", (), {"attention": lambda self, *a: seen.append(a) or
                                  mod.attention(*a)})()
    try:
        for other in (fmha.Attention(6, 40, num_kv_heads=2, dropout_p=0.3),
                      fmha.Attention(6, 40, num_kv_heads=2, check_finite=True),
                      fmha.Attention(6, 40, num_kv_heads=2, fp8="per_tensor")):
            other.forward(q, k, v, seed=1) if other.dropout_p else other.forward(q, k, v)
        assert seen == []
    finally:
        _api._fast = mod


def test_flash_attn_func_takes_it(ext, python_only):
    q, k, v = (rand((2, 11, 4, 16), "bf16", s) for s in range(3))
    out = fmha.flash_attn_func(q, k, v, causal=True)
    want, _ = ref.attention(f64(q), f64(k), f64(v), causal=True)
    ref.assert_close(f64(out), want, "bf16")


def outcome(fn):
    """fn()'s result with NaN made comparable, or its error's type and message."""
    try:
        res = fn()
    except Exception as e:
        return type(e), str(e)
    return tuple(r.nan_to_num(7.0) for r in (res if isinstance(res, tuple) else (res,)))


@settings(max_examples=150)
@given(st.data())
def test_random_calls_are_the_python_paths(ext, data):
    """Random shapes, strides (broadcast batches, row offsets), options and
    bad values (NaN inputs, a scale of -1 or inf, windows past the
    sequence): the compiled path gives the Python path's bits or its error."""
    d = data.draw
    B, S, Sk = d(st.integers(1, 3)), d(st.integers(1, 20)), d(st.integers(1, 20))
    H = d(st.sampled_from([1, 2, 4, 6]))
    Hkv = d(st.sampled_from([h for h in (1, 2, 3, 4) if H % h == 0]))
    D = d(st.sampled_from([8, 16, 33, 64]))
    dt = DTYPES[d(st.sampled_from(["f32", "f16", "bf16"]))]
    g = torch.Generator().manual_seed(d(st.integers(0, 2**31)))
    q = torch.randn(B, S, H, D, generator=g).to(dt)
    if d(st.booleans()):
        k = torch.randn(1, Sk, Hkv, D, generator=g).to(dt).expand(B, Sk, Hkv, D)
    else:
        k = torch.randn(B, Sk, Hkv, D, generator=g).to(dt)
    v = torch.randn(B, Sk + 3, Hkv, D, generator=g).to(dt)[:, 3:]
    if d(st.integers(0, 9)) == 0:
        q[0, 0, 0, 0] = float("nan")
    kw = dict(causal=d(st.booleans()), window=(d(st.sampled_from([-1, 0, 3, 50])),
                                               d(st.sampled_from([-1, 0, 2]))),
              softcap=d(st.sampled_from([0.0, 5.0])), return_lse=d(st.booleans()),
              softmax_scale=d(st.sampled_from([None, 0.3, -1.0, float("inf")])))
    fast = outcome(lambda: fmha.attention(q, k, v, **kw))
    slow = outcome(lambda: python_path(lambda: fmha.attention(q, k, v, **kw)))
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (a, b)


def test_handed_back_calls(ext):
    """Calls the compiled path does not take still run, on the Python path."""
    q, k, v = (rand((1, 9, 2, 16), "f32", s) for s in range(3))
    want, _ = ref.attention(f64(q), f64(k), f64(v))
    mod = ext
    seen = []
    _api._fast = type("Spy", (), {"attention": lambda self, *a: seen.append(a) or
                                  mod.attention(*a)})()
    try:
        # Each of these is decided before the module is asked...
        out = torch.empty(1, 9, 2, 16)
        fmha.attention(q, k, v, out=out)
        fmha.attention(q, k, v, dropout_p=0.5, seed=3)
        fmha.attention(q, k, v, sinks=torch.zeros(2))
        fmha.attention(q, k, v, attn_mask=torch.ones(9, 9, dtype=torch.bool))
        assert seen == []
        # ...these by it (None back), and the Python path answers.
        for args in [(q.numpy(), k.numpy(), v.numpy()), (torch._neg_view(q), k, v),
                     (q.double(), k.double(), v.double()), (q, k.half(), v),
                     (q[:, :0], k, v), (q, k, v.unsqueeze(0))]:
            before = len(seen)
            try:
                fmha.attention(*args)
            except Exception:
                pass
            assert len(seen) == before + 1
        with pytest.raises(ValueError, match="negated view"):
            fmha.attention(torch._neg_view(q), k, v)
        for kw in [dict(causal=2), dict(softmax_scale=0.0), dict(window=(1, 2, 3)),
                   dict(softcap="1"), dict(window=(2**70, -1)), dict(return_lse="yes")]:
            with pytest.raises((ValueError, TypeError)):
                python_path(lambda: fmha.attention(q, k, v, **kw))
            with pytest.raises((ValueError, TypeError)):
                fmha.attention(q, k, v, **kw)
        # Options of other types that the Python path takes (0/1 flags, bool
        # numbers, lists) get its answer.
        ref.assert_close(f64(fmha.attention(q, k, v, window=[3, 0], causal=1, softcap=True)),
                         ref.attention(f64(q), f64(k), f64(v), window=(3, 0), causal=True,
                                       softcap=1.0)[0], "f32")
    finally:
        _api._fast = mod


def test_refusals_are_the_python_paths(ext):
    q = rand((1, 8, 3, 16), "f32", 1)
    k = rand((1, 8, 2, 16), "f32", 2)
    k3 = rand((2, 8, 3, 16), "f32", 3)
    for args in [(q, k, k), (q, q[..., :8], q), (q, k3, k3), (q, q, q[:, :5])]:
        with pytest.raises(Exception) as fast:
            fmha.attention(*args)
        with pytest.raises(Exception) as slow:
            python_path(lambda: fmha.attention(*args))
        assert type(fast.value) is type(slow.value) and str(fast.value) == str(slow.value)


@pytest.mark.parametrize("bounds", [False, True])
def test_varlen_autograd(ext, bounds, monkeypatch):
    """Packed calls that autograd records: the compiled forward's Function,
    gradients against float64 and bit for bit the fmha::varlen_fwd op's;
    tokens past the last sequence get zero gradients."""
    cq, ck = [0, 7, 7, 30], [0, 12, 20, 41]
    base = [rand((1, 32, 4, 32), "f32", 1)[0], rand((1, 41, 2, 32), "f32", 2)[0],
            rand((1, 41, 2, 16), "f32", 3)[0]]
    cuq, cuk = (torch.tensor(c, dtype=torch.int32) for c in (cq, ck))
    mq, mk = (23, 21) if bounds else (None, None)
    dout = rand((1, 32, 4, 16), "f32", 4)[0]

    def run():
        x = [t.detach().clone().requires_grad_() for t in base]
        out = fmha.varlen_attention(*x, cuq, cuk, mq, mk, causal=True)
        (out[:30] * dout[:30]).sum().backward()
        return out, [t.grad for t in x], out.grad_fn
    ops = __import__("fmha.torch_ops").torch_ops
    monkeypatch.setattr(ops, "packed", lambda *a, **k: pytest.fail("the fmha::varlen_fwd op ran"))
    out, grads, fn = run()
    monkeypatch.undo()
    assert type(fn).__name__.startswith("_VarlenAttention")
    d = dout.clone()
    d[30:] = 0
    wg = ref.varlen_attention_grads(*(f64(t) for t in base), f64(d), np.array(cq), np.array(ck),
                                    causal=True)
    p_out, p_grads, p_fn = python_path(run)
    assert type(p_fn).__name__ != type(fn).__name__
    assert torch.equal(out[:30], p_out[:30])
    for g, pg, w, name in zip(grads, p_grads, wg, ("dq", "dk", "dv")):
        ref.assert_close(f64(g), w, "f32", name)
        assert torch.equal(g, pg), name
    assert not grads[0][30:].any()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("which", ["qkv", "q", "kv"])
def test_autograd(ext, dtype, which, monkeypatch):
    """Calls that autograd records take the compiled forward (its autograd
    Function, not the fmha::fwd op): out, lse and the gradients against the
    float64 reference and, bit for bit, the op's; only the inputs that
    require grad get one."""
    import fmha.torch_ext as te
    base = [rand((2, 13, 4, 32), dtype, 1), rand((2, 21, 2, 32), dtype, 2, "bhsd"),
            rand((2, 21, 2, 24), dtype, 3)]
    grad = {"qkv": (1, 1, 1), "q": (1, 0, 0), "kv": (0, 1, 1)}[which]
    kw = dict(causal=True, window=(9, -1), softcap=6.0, softmax_scale=0.2)
    dout = rand((2, 13, 4, 24), "f32", 4)

    def run():
        x = [t.detach().clone().requires_grad_(bool(g)) for t, g in zip(base, grad)]
        out, lse = fmha.attention(*x, return_lse=True, **kw)
        (out.float() * dout).sum().backward()
        return out, lse, [t.grad for t in x], out.grad_fn
    ops = __import__("fmha.torch_ops").torch_ops
    monkeypatch.setattr(ops, "padded", lambda *a, **k: pytest.fail("the fmha::fwd op ran"))
    out, lse, grads, fn = run()
    monkeypatch.undo()
    assert type(fn).__name__.startswith("_Attention") and not lse.requires_grad
    want, want_lse = ref.attention(*(f64(t) for t in base), causal=True, window=(9, -1),
                                   softcap=6.0, scale=0.2)
    ref.assert_close(f64(out), want, dtype)
    ref.assert_lse(f64(lse), want_lse)
    wg = ref.attention_grads(*(f64(t) for t in base), f64(dout), causal=True, window=(9, -1),
                             softcap=6.0, scale=0.2)
    p_out, p_lse, p_grads, p_fn = python_path(run)
    assert type(p_fn).__name__ != type(fn).__name__
    assert torch.equal(out, p_out) and torch.equal(lse, p_lse)
    for g, pg, w, need, name in zip(grads, p_grads, wg, grad, ("dq", "dk", "dv")):
        if not need:
            assert g is None and pg is None, name
            continue
        ref.assert_close(f64(g), w, dtype, name)
        assert torch.equal(g, pg), name
    with torch.no_grad():
        assert fmha.attention(*base).grad_fn is None
    # Turned down inside the Function (a call the module refuses there): the Python path.
    monkeypatch.setattr(te._Attention, "forward", staticmethod(
        lambda ctx, *a: (_ for _ in ()).throw(te._HandBack())))
    out2, _, grads2, fn2 = run()
    assert type(fn2).__name__ == type(p_fn).__name__ and torch.equal(out2, p_out)


def test_knobs_make_new_layers(ext, monkeypatch):
    """A knob set in the environment reaches the next call, as on the Python path."""
    q, k, v = (rand((1, 40, 2, 64), "bf16", s) for s in range(3))
    for isa in ("scalar", "auto"):
        monkeypatch.setenv("FMHA_CPU_ISA", isa)
        got = fmha.attention(q, k, v)
        assert torch.equal(got, python_path(lambda: fmha.attention(q, k, v)))
    monkeypatch.setenv("FMHA_CPU_ISA", "no-such-isa")
    with pytest.raises(ValueError, match="FMHA_CPU_ISA"):
        fmha.attention(q, k, v)


def test_threads(ext):
    q, k, v = (rand((2, 33, 4, 32), "f32", s) for s in range(3))
    want = python_path(lambda: fmha.attention(q, k, v, causal=True))
    bad = []

    def work():
        for _ in range(50):
            if not torch.equal(fmha.attention(q, k, v, causal=True), want):
                bad.append(1)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_compile_fullgraph(ext):
    q, k, v = (rand((1, 12, 2, 16), "f32", s) for s in range(3))
    fn = torch.compile(lambda a, b, c: fmha.attention(a, b, c, causal=True), fullgraph=True,
                       backend="eager")
    ref.assert_close(f64(fn(q, k, v)), ref.attention(f64(q), f64(k), f64(v), causal=True)[0],
                     "f32")


def test_found_by_a_new_process(ext):
    """A process that imports fmha finds the built module at its first eager
    torch call, not inside a compiled one."""
    code = ("import torch, fmha\n"
            "from fmha import _api\n"
            "q = torch.randn(1, 8, 2, 16)\n"
            "f = torch.compile(lambda q: fmha.attention(q, q, q), fullgraph=True, "
            "backend='eager')\n"
            "f(q)\n"
            "assert _api._fast is None\n"
            "fmha.attention(q, q, q)\n"
            "assert _api._fast is not None and _api._fast.__file__ == %r\n"
            "assert torch.equal(fmha.attention(q, q, q), f(q))\n" % ext.__file__)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_switched_off(ext, monkeypatch):
    import fmha.torch_ext as te
    assert te.load() is not None
    monkeypatch.setenv("FMHA_TORCH_EXT", "0")
    assert te.load() is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cuda(ext, python_only, dtype):
    if not ext.cuda:
        pytest.skip("fmha.torch_ext was built without CUDA (no CUDA_HOME at build time)")
    q = rand((2, 77, 8, 128), dtype, 1).cuda()
    k = rand((2, 300, 2, 128), dtype, 2).cuda().transpose(1, 2).contiguous().transpose(1, 2)
    v = rand((2, 300, 2, 128), dtype, 3).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    s.synchronize()
    want, want_lse = ref.attention(f64(q.cpu()), f64(k.cpu()), f64(v.cpu()), causal=True)
    ref.assert_close(f64(out.cpu()), want, dtype)
    ref.assert_lse(f64(lse.cpu()), want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("bounds", [False, True])
def test_cuda_varlen(ext, bounds, monkeypatch):
    """Packed CUDA calls on a side stream, with the bounds (no host copy of
    the offsets) and without, against the reference and the Python path."""
    if not ext.cuda:
        pytest.skip("fmha.torch_ext was built without CUDA (no CUDA_HOME at build time)")
    cq, ck = [0, 70, 70, 211], [0, 33, 190, 260]
    q = rand((1, 215, 8, 64), "bf16", 1)[0].cuda()
    k = rand((1, 260, 4, 64), "bf16", 2)[0].cuda()
    v = rand((1, 260, 4, 64), "bf16", 3)[0].cuda()
    cuq, cuk = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cq, ck))
    mq, mk = (141, 157) if bounds else (None, None)
    monkeypatch.setattr(_api, "_varlen_attention", lambda *a: pytest.fail("Python path"))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out, lse = fmha.varlen_attention(q, k, v, cuq, cuk, mq, mk, causal=True, return_lse=True)
    s.synchronize()
    monkeypatch.undo()
    n = cq[-1]
    want, want_lse = ref.varlen_attention(f64(q.cpu()), f64(k.cpu()), f64(v.cpu()),
                                          np.array(cq), np.array(ck), causal=True)
    ref.assert_close(f64(out.cpu())[:n], want[:n], "bf16")
    ref.assert_lse(f64(lse.cpu())[:, :n], want_lse[:, :n])
    p_out = python_path(lambda: fmha.varlen_attention(q, k, v, cuq, cuk, mq, mk, causal=True))
    assert torch.equal(out[:n], p_out[:n])


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_autograd(ext, packed):
    """Calls that autograd records on CUDA: the compiled forward's Function,
    gradients bit for bit the ops' and against float64."""
    if not ext.cuda:
        pytest.skip("fmha.torch_ext was built without CUDA (no CUDA_HOME at build time)")
    cq = [0, 50, 50, 173]
    base = [rand((1, 173, 8, 64), "bf16", 1)[0], rand((1, 173, 2, 64), "bf16", 2)[0],
            rand((1, 173, 2, 64), "bf16", 3)[0]]
    if not packed:
        base = [t[None] for t in base]
    base = [t.cuda() for t in base]
    cu = torch.tensor(cq, dtype=torch.int32, device="cuda")
    dout = rand(tuple(base[0].shape), "bf16", 4).cuda()

    def run():
        x = [t.detach().clone().requires_grad_() for t in base]
        if packed:
            out = fmha.varlen_attention(*x, cu, cu, 123, 123, causal=True)
        else:
            out = fmha.attention(*x, causal=True)
        (out.float() * dout.float()).sum().backward()
        return out, [t.grad for t in x], type(out.grad_fn).__name__
    out, grads, fn = run()
    p_out, p_grads, p_fn = python_path(run)
    assert fn.startswith("_VarlenAttention" if packed else "_Attention") and fn != p_fn
    assert torch.equal(out, p_out)
    if packed:
        wg = ref.varlen_attention_grads(*(f64(t.cpu()) for t in base), f64(dout.cpu()),
                                        np.array(cq), np.array(cq), causal=True)
    else:
        wg = ref.attention_grads(*(f64(t.cpu()) for t in base), f64(dout.cpu()), causal=True)
    for g, pg, w, name in zip(grads, p_grads, wg, ("dq", "dk", "dv")):
        assert torch.equal(g, pg), name
        ref.assert_close(f64(g.cpu()), w, "bf16", name)
