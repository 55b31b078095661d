"""The fmha::* torch ops (fmha.torch_ops): torch.library.opcheck on each op
(schema, fake implementation, autograd registration, AOT dispatch), and
torch.compile(fullgraph=True) over fmha.flash_attn_func and its kin with the
eager and aot_eager backends, forward and backward, against the eager result
and the tests' float64 reference. Skipped without torch (>= 2.4)."""
import subprocess
import sys

import numpy as np
import pytest

import fmha
import reference as ref

torch = pytest.importorskip("torch")
pytest.importorskip("fmha.torch_ops", exc_type=ImportError)

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# Relative L2 error of gradients against float64 (test_backward.py's).
GRAD_TOL = {"f32": 2e-5, "bf16": 2e-2}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (no cache hits from another test's
    graphs, no recompile limit shared between tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rand(shape, dtype="f32", seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(TORCH_DTYPES[dtype])
    return t.requires_grad_() if grad else t


def f64(t):
    return t.detach().to(torch.float64).numpy()


def check_grads(got, want, dtype):
    for g, w, name in zip(got, want, ("dq", "dk", "dv")):
        assert tuple(g.shape) == w.shape, (name, tuple(g.shape), w.shape)
        err = ref.rel_l2(f64(g), w)
        assert err <= GRAD_TOL[dtype], "%s: relative L2 %.3g > %.3g" % (name, err,
                                                                        GRAD_TOL[dtype])


# ------------------------------------------------------------------ opcheck

# B, Sq, Sk, H, Hkv, D, Dv, options (the ops' own argument names)
PADDED = [
    (2, 17, 17, 4, 4, 32, 32, {}),
    (1, 23, 31, 6, 2, 16, 16, {"causal": True}),                          # GQA 3:1
    (2, 9, 40, 4, 1, 32, 24, {"window_left": 8, "window_right": 3,        # MQA, Dv != D
                              "softcap": 5.0, "softmax_scale": 0.2}),
    (1, 12, 12, 2, 2, 16, 16, {"dropout_p": 0.25, "seed": 2**63 + 5}),    # seed >= 2^63
]


def op_options(o):
    return (o.get("softmax_scale", 0.0), o.get("causal", False), o.get("window_left", -1),
            o.get("window_right", -1), o.get("softcap", 0.0), o.get("dropout_p", 0.0))


def signed(seed):
    return None if seed is None else (seed - 2**64 if seed >= 2**63 else seed)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(PADDED)))
def test_opcheck_padded(dtype, case):
    B, Sq, Sk, H, Hkv, D, Dv, o = PADDED[case]
    q = rand((B, Sq, H, D), dtype, 1, grad=True)
    k = rand((B, Sk, Hkv, D), dtype, 2, grad=True)
    v = rand((B, Sk, Hkv, Dv), dtype, 3, grad=True)
    seed = signed(o.get("seed"))
    args = (q, k, v) + op_options(o) + (seed, 0)
    torch.library.opcheck(torch.ops.fmha.fwd.default, args)
    out, lse, rng_state = torch.ops.fmha.fwd(*args)
    assert out.shape == (B, Sq, H, Dv) and out.dtype == q.dtype
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    assert rng_state.tolist() == [seed or 0, 0]
    # the op's numbers are the float64 reference's
    kw = dict(causal=o.get("causal", False), scale=o.get("softmax_scale"),
              window=(o.get("window_left", -1), o.get("window_right", -1)),
              softcap=o.get("softcap", 0.0), dropout_p=o.get("dropout_p", 0.0),
              seed=o.get("seed", 0))
    want, want_lse = ref.attention(f64(q), f64(k), f64(v), **kw)
    ref.assert_close(f64(out), want, dtype)
    ref.assert_lse(f64(lse), want_lse)
    dout = rand((B, Sq, H, Dv), dtype, 4)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, rng_state) \
        + op_options(o) + (0,)
    torch.library.opcheck(torch.ops.fmha.bwd.default, bwd_args)
    *grads, dsinks = torch.ops.fmha.bwd(*bwd_args)
    assert dsinks.shape == (0,)
    check_grads(grads, ref.attention_grads(f64(q), f64(k), f64(v), f64(dout), **kw), dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_varlen(dtype, causal):
    cu_q = torch.tensor([0, 5, 5, 18], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12, 30], dtype=torch.int32)
    q = rand((18, 4, 16), dtype, 1, grad=True)
    k = rand((30, 2, 16), dtype, 2, grad=True)
    v = rand((30, 2, 16), dtype, 3, grad=True)
    o = {"causal": causal}
    args = (q, k, v, cu_q, cu_k, 13, 18) + op_options(o) + (None, 0)
    torch.library.opcheck(torch.ops.fmha.varlen_fwd.default, args)
    out, lse, rng_state = torch.ops.fmha.varlen_fwd(*args)
    assert out.shape == (18, 4, 16) and lse.shape == (4, 18) and lse.dtype == torch.float32
    want, want_lse = ref.varlen_attention(f64(q), f64(k), f64(v), cu_q.numpy(), cu_k.numpy(),
                                          causal=causal)
    ref.assert_close(f64(out), want, dtype)
    ref.assert_lse(f64(lse), want_lse)
    dout = rand((18, 4, 16), dtype, 4)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q, cu_k, 13, 18,
                rng_state) + op_options(o) + (0,)
    torch.library.opcheck(torch.ops.fmha.varlen_bwd.default, bwd_args)
    *grads, dsinks = torch.ops.fmha.varlen_bwd(*bwd_args)
    assert dsinks.shape == (0,)
    check_grads(grads, ref.varlen_attention_grads(f64(q), f64(k), f64(v), f64(dout),
                                                  cu_q.numpy(), cu_k.numpy(), causal=causal),
                dtype)


def test_fake_shapes():
    """Under FakeTensorMode the ops give the shapes, dtypes and devices the
    real ones do, without running libfmha."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(3, 7, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(3, 11, 2, 64, dtype=torch.bfloat16)
        v = torch.empty(3, 11, 2, 48, dtype=torch.bfloat16)
        out, lse, rng = torch.ops.fmha.fwd(q, k, v, 0.0, True, -1, -1, 0.0, 0.0, None, 0)
        assert out.shape == (3, 7, 8, 48) and out.dtype == torch.bfloat16
        assert lse.shape == (3, 8, 7) and lse.dtype == torch.float32
        assert rng.shape == (2,) and rng.dtype == torch.int64
        dq, dk, dv, ds = torch.ops.fmha.bwd(out, q, k, v, out, lse, rng, 0.0, True, -1, -1,
                                            0.0, 0.0, 0)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        cu = torch.empty(4, dtype=torch.int32)
        out, lse, _ = torch.ops.fmha.varlen_fwd(q[0], k[0], v[0], cu, cu, 0, 0, 0.0, False, -1,
                                                -1, 0.0, 0.0, None, 0)
        assert out.shape == (7, 8, 48) and lse.shape == (8, 7)


def test_eager_calls_skip_the_op(monkeypatch):
    """Calls autograd would not record run the op's body directly (its
    dispatch costs as much host time as the body on small calls); inputs
    that require grad, fake and meta tensors still go through the op. (The
    Python path's choice: the compiled path, which takes plain calls with
    grad too where it is built, is off here.)"""
    import fmha.torch_ops as tops
    from fmha import _api
    monkeypatch.setattr(_api, "_fast", None)
    q, k, v = rand((1, 9, 2, 16), seed=1), rand((1, 9, 2, 16), seed=2), rand((1, 9, 2, 16), seed=3)
    want = fmha.attention(q, k, v, causal=True)
    seen = []
    orig = tops.padded
    monkeypatch.setattr(tops, "padded", lambda *a, **kw: seen.append(1) or orig(*a, **kw))
    with torch.no_grad():
        assert torch.equal(fmha.attention(q, k, v, causal=True), want)
    assert torch.equal(fmha.flash_attn_func(q, k, v, causal=True), want)  # no input requires grad
    assert seen == []
    qg = q.clone().requires_grad_(True)
    assert torch.equal(fmha.attention(qg, k, v, causal=True).detach(), want)
    assert seen == [1]
    out = fmha.attention(q.to("meta"), k.to("meta"), v.to("meta"))
    assert out.device.type == "meta" and out.shape == q.shape
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fq = torch.empty(1, 9, 2, 16)
        assert fmha.attention(fq, fq, fq).shape == (1, 9, 2, 16)
    assert len(seen) == 3


# ------------------------------------------------------------------ torch.compile


def graph_ops(fn, *args):
    """Compiles fn with fullgraph=True through a backend that records the
    FX graph, runs it, and returns (result, the call_function targets)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    res = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return res, seen


def test_compile_traces_one_op():
    """flash_attn_func is one fmha::fwd node in the graph: the Python layers
    above it are traced, libfmha is not."""
    q, k, v = rand((1, 8, 2, 16), seed=1), rand((1, 8, 2, 16), seed=2), rand((1, 8, 2, 16), seed=3)
    out, seen = graph_ops(lambda a, b, c: fmha.flash_attn_func(a, b, c, causal=True) * 2, q, k, v)
    fwd = (torch.ops.fmha.fwd, torch.ops.fmha.fwd.default)  # Dynamo records the packet
    assert sum(t in fwd for t in seen) == 1
    assert torch.equal(out, fmha.flash_attn_func(q, k, v, causal=True) * 2)


FORWARD_CASES = [
    ("f32", dict(causal=True)),
    ("f32", dict(window_size=(5, 2), softcap=3.0, softmax_scale=0.3)),
    ("bf16", dict(causal=True)),
    ("bf16", dict()),
]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dtype,opts", FORWARD_CASES)
def test_compile_forward(backend, dtype, opts):
    q = rand((2, 19, 6, 32), dtype, 1)
    k = rand((2, 25, 2, 32), dtype, 2)       # GQA 3:1
    v = rand((2, 25, 2, 32), dtype, 3)

    def fn(q, k, v):
        out, lse, _ = fmha.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
        return out, lse

    out, lse = torch.compile(fn, fullgraph=True, backend=backend)(q, k, v)
    want_out, want_lse = fn(q, k, v)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    w = opts.get("window_size", (-1, -1))
    ref_out, ref_lse = ref.attention(f64(q), f64(k), f64(v), causal=opts.get("causal", False),
                                     window=w, softcap=opts.get("softcap", 0.0),
                                     scale=opts.get("softmax_scale"))
    ref.assert_close(f64(out), ref_out, dtype)
    ref.assert_lse(f64(lse), ref_lse)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dtype,opts", FORWARD_CASES)
def test_compile_backward(backend, dtype, opts):
    shapes = ((2, 19, 6, 32), (2, 25, 2, 32), (2, 25, 2, 32))
    dout = rand((2, 19, 6, 32), dtype, 4)

    def run(fn):
        q, k, v = (rand(s, dtype, i + 1, grad=True) for i, s in enumerate(shapes))
        out = fn(q, k, v)
        out.backward(dout)
        return out, (q.grad, k.grad, v.grad), (q, k, v)

    def fn(q, k, v):
        return fmha.flash_attn_func(q, k, v, **opts) * 1.5

    out, grads, (q, k, v) = run(torch.compile(fn, fullgraph=True, backend=backend))
    want_out, want_grads, _ = run(fn)
    assert torch.equal(out, want_out)
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w)
    want = ref.attention_grads(f64(q), f64(k), f64(v), 1.5 * f64(dout),
                               causal=opts.get("causal", False),
                               window=opts.get("window_size", (-1, -1)),
                               softcap=opts.get("softcap", 0.0), scale=opts.get("softmax_scale"))
    check_grads(grads, want, dtype)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_varlen_backward(backend):
    cu_q = torch.tensor([0, 7, 7, 20], dtype=torch.int32)   # sequence 1 has no queries
    cu_k = torch.tensor([0, 9, 15, 22], dtype=torch.int32)
    dout = rand((20, 4, 16), "f32", 4)

    def fn(q, k, v, cu_q, cu_k):
        return fmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 9, causal=True)

    def run(f):
        q, k, v = (rand(s, "f32", i + 1, grad=True)
                   for i, s in enumerate(((20, 4, 16), (22, 2, 16), (22, 2, 16))))
        f(q, k, v, cu_q, cu_k).backward(dout)
        return (q.grad, k.grad, v.grad), (q, k, v)

    grads, (q, k, v) = run(torch.compile(fn, fullgraph=True, backend=backend))
    want_grads, _ = run(fn)
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w)
    check_grads(grads, ref.varlen_attention_grads(f64(q), f64(k), f64(v), f64(dout),
                                                  cu_q.numpy(), cu_k.numpy(), causal=True),
                "f32")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_score_mods(backend):
    """A mask, ALiBi slopes and sinks compile into the graph's one fmha::fwd
    node; the compiled gradients (sinks' too) are the eager ones."""
    mask = torch.rand(19, 25, generator=torch.Generator().manual_seed(5)) < 0.8
    slopes = torch.linspace(0.05, 0.4, 6)

    def run(f):
        q, k, v = (rand(s, "f32", i + 1, grad=True)
                   for i, s in enumerate(((2, 19, 6, 32), (2, 25, 2, 32), (2, 25, 2, 32))))
        sinks = torch.linspace(-1.0, 1.0, 6).requires_grad_(True)
        f(q, k, v, sinks).sum().backward()
        return [t.grad for t in (q, k, v, sinks)]

    def fn(q, k, v, sinks):
        return fmha.attention(q, k, v, causal=True, attn_mask=mask, alibi_slopes=slopes,
                              sinks=sinks)

    got = run(torch.compile(fn, fullgraph=True, backend=backend))
    want = run(fn)
    for g, w in zip(got, want):
        assert g is not None and torch.equal(g, w)
    _, seen = graph_ops(fn, *(rand(s, "f32", 7) for s in ((2, 19, 6, 32), (2, 25, 2, 32),
                                                          (2, 25, 2, 32))), torch.zeros(6))
    assert sum(t in (torch.ops.fmha.fwd, torch.ops.fmha.fwd.default) for t in seen) == 1


def test_compile_packed_and_layer():
    """qkv-packed inputs (strided views) and an Attention layer compile
    whole as well, gradients included."""
    qkv = rand((2, 11, 3, 4, 16), "f32", 1, grad=True)
    out = torch.compile(lambda x: fmha.flash_attn_qkvpacked_func(x, causal=True),
                        fullgraph=True, backend="aot_eager")(qkv)
    out.sum().backward()
    x = f64(qkv)
    want = ref.attention_grads(x[:, :, 0], x[:, :, 1], x[:, :, 2], np.ones((2, 11, 4, 16)),
                               causal=True)
    check_grads((qkv.grad[:, :, 0], qkv.grad[:, :, 1], qkv.grad[:, :, 2]), want, "f32")

    layer = fmha.Attention(4, 16, causal=True, num_kv_heads=2)
    q, k, v = rand((1, 9, 4, 16), seed=2), rand((1, 9, 2, 16), seed=3), rand((1, 9, 2, 16), seed=4)
    got = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(got, layer(q, k, v))
    assert layer.kernel.startswith("cpu")


def test_compile_dropout_seed():
    """A compiled call draws a fresh dropout seed each run (the op draws it,
    not the trace), and a given seed gives the eager call's output."""
    q, k, v = (rand((1, 16, 2, 16), seed=s) for s in range(3))
    fn = torch.compile(lambda a, b, c: fmha.flash_attn_func(a, b, c, dropout_p=0.5),
                       fullgraph=True, backend="aot_eager")
    first, second = fn(q, k, v), fn(q, k, v)
    assert not torch.equal(first, second)
    fmha.manual_seed(11)
    a = fn(q, k, v)
    fmha.manual_seed(11)
    assert torch.equal(a, fmha.flash_attn_func(q, k, v, dropout_p=0.5))
    seeded = torch.compile(lambda a, b, c: fmha.attention(a, b, c, dropout_p=0.5, seed=42),
                           fullgraph=True, backend="eager")
    assert torch.equal(seeded(q, k, v), fmha.attention(q, k, v, dropout_p=0.5, seed=42))


def test_lse_is_not_differentiable():
    q = rand((1, 8, 2, 16), grad=True)
    out, lse, _ = fmha.flash_attn_func(q, q.detach(), q.detach(), return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad


# ------------------------------------------------------------------ registration


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_import_fmha_does_not_import_torch():
    r = run_python("import sys, fmha, numpy as np\n"
                   "fmha.attention(*(np.ones((1, 4, 1, 8), np.float32),) * 3)\n"
                   "assert 'torch' not in sys.modules, 'fmha imported torch'\n")
    assert r.returncode == 0, r.stderr


def test_registration_orders():
    """torch first: the ops exist right after import fmha. fmha first: they
    exist after import fmha.torch_ops, and a compiled first call traces."""
    r = run_python("import torch, fmha\n"
                   "assert hasattr(torch.ops.fmha, 'fwd')\n")
    assert r.returncode == 0, r.stderr
    r = run_python("import fmha, torch\n"
                   "import fmha.torch_ops\n"
                   "q = torch.randn(1, 8, 2, 16)\n"
                   "f = torch.compile(lambda q: fmha.flash_attn_func(q, q, q), fullgraph=True,\n"
                   "                  backend='eager')\n"
                   "assert torch.equal(f(q), fmha.flash_attn_func(q, q, q))\n")
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("b,s,h,hk,d,causal,dtype,tol", [
    (2, 300, 8, 2, 64, True, "bfloat16", 1e-2),    # GQA 4:1
    (1, 257, 4, 4, 128, False, "float16", 2e-3),
    (1, 130, 2, 1, 96, True, "bfloat16", 1e-2),    # MQA, a head dim without its own kernel
])
def test_cuda_autograd(b, s, h, hk, d, causal, dtype, tol):
    """flash_attn_func's gradients on CUDA tensors (fmha's CUDA backward) against
    float64 torch SDPA's on the same inputs."""
    import torch.nn.functional as F
    from fmha.flash_attn import flash_attn_func
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=dt, requires_grad=True)
               for n in (h, hk, hk))
    out = flash_attn_func(q, k, v, causal=causal)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    x64 = [x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    o = F.scaled_dot_product_attention(*x64, is_causal=causal, enable_gqa=hk != h)
    want = torch.autograd.grad(o, x64, g.double().transpose(1, 2))
    for a, r, name in zip(got, want, ("dq", "dk", "dv")):
        err = ((a.double() - r.transpose(1, 2)).norm() / r.norm()).item()
        assert err <= tol, "%s: relative L2 %.3g > %.3g" % (name, err, tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_graph_capture(packed):
    """A padded call, and a packed one given max_seqlen_q and max_seqlen_k
    (libfmha then reads no offset on the host), can be captured in a CUDA
    graph: replays after new q, k, v (and new offsets within the bounds) are
    written into the captured buffers give what an eager call gives."""
    from fmha.flash_attn import flash_attn_func, flash_attn_varlen_func
    torch.manual_seed(0)
    h, hk, d, total = 8, 2, 128, 300
    shape = (lambda n: (total, n, d)) if packed else (lambda n: (2, total // 2, n, d))
    q = torch.randn(*shape(h), device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(*shape(hk), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32, device="cuda")

    def call():
        if packed:
            return flash_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True)
        return flash_attn_func(q, k, v, causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: kernels loaded, scratch pooled
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for offsets in ([0, 100, 101, 300], [0, 57, 256, 290]):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        cu.copy_(torch.tensor(offsets, dtype=torch.int32))
        graph.replay()
        want = call()
        torch.cuda.synchronize()
        n = offsets[-1] if packed else total // 2  # tokens past the last sequence: unwritten
        assert torch.equal(out[:n], want[:n]), offsets
        if packed:  # and the host-checked call (bounds computed from the offsets)
            host = fmha.varlen_attention(q, k, v, cu, cu, None, None, causal=True)[:n]
            err = ((out[:n].float() - host.float()).norm() / host.float().norm()).item()
            assert err < 1e-2, (offsets, err)
