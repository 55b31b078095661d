"""fmha.sglang, the sglang diffusion attention backend: imports without
sglang or torch, validates at construction, runs numpy and torch CPU
tensors as sglang passes them against the float64 reference (GQA, causal,
awkward sizes, head-split shards, the LSE ring attention asks for, packed
varlen, dropout, FP8), and register() swaps backends in a stand-in of
sglang's selector. Torch tests skip without torch; no test needs sglang."""
import importlib.util
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import fmha
import fmha.sglang as fs
import reference as ref

PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(fmha.__file__)))


@pytest.fixture(autouse=True)
def _no_fp8_env(monkeypatch):
    monkeypatch.delenv(fs.FP8_ENV, raising=False)


def _qkv(rng, b, sq, sk, h, hkv, d, dtype="f32"):
    return (ref.make(rng, (b, sq, h, d), dtype), ref.make(rng, (b, sk, hkv, d), dtype),
            ref.make(rng, (b, sk, hkv, d), dtype))


# ------------------------------------------------------------------ without torch


def test_imports_neither_torch_nor_sglang():
    code = "\n".join([
        "import sys",
        "heavy = lambda: [m for m in ('torch', 'sglang') if m in sys.modules]",
        "import fmha",
        "assert heavy() == [] and 'fmha.sglang' not in sys.modules, heavy()",
        "import fmha.sglang",
        "assert fmha.sglang.HAVE_SGLANG or heavy() == [], heavy()",
        "print('ok')"])
    env = dict(os.environ, PYTHONPATH=PKG_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_gqa_shape_refused_at_construction():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads "
                                         r"\(4\).*num_key_value_heads"):
        fs.FmhaAttentionImpl(6, 64, 0.125, num_kv_heads=4)


def test_construction_as_sglang_calls_it():
    impl = fs.FmhaAttentionImpl(num_heads=8, head_size=64, causal=True, softmax_scale=0.1,
                                num_kv_heads=2, prefix="blocks.0.attn.impl",
                                allow_cudnn_sdp=True)  # another backend's option: ignored
    assert (impl.layer.num_heads, impl.layer.num_kv_heads, impl.layer.causal) == (8, 2, True)
    assert impl.layer.softmax_scale == pytest.approx(0.1) and impl.fp8 is None
    assert "blocks.0.attn.impl" in repr(impl)
    assert impl.preprocess_qkv("qkv", None) == "qkv"  # the base class's, unchanged
    with pytest.raises(ValueError, match="fp8 must be None"):
        fs.FmhaAttentionImpl(8, 64, fp8="e5m2")


def test_backend_class():
    b = fs.FmhaAttentionBackend
    assert b.get_impl_cls() is fs.FmhaAttentionImpl and b.get_builder_cls() is None
    assert b.get_metadata_cls() is fs.AttentionMetadata and b.get_name() == "TORCH_SDPA"
    assert b.unsupported_requirements(types.SimpleNamespace(packed_varlen=True)) == ()


@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal", [
    (2, 113, 113, 8, 2, 64, False),   # GQA, self-attention
    (1, 7, 239, 6, 1, 32, True),      # MQA, causal bottom-right with Sq != Sk
    (3, 1, 17, 4, 4, 128, True),      # one query
])
def test_forward_matches_reference(rng, b, sq, sk, h, hkv, d, causal):
    impl = fs.FmhaAttentionImpl(h, d, 0.3, causal=causal, num_kv_heads=hkv)
    q, k, v = _qkv(rng, b, sq, sk, h, hkv, d)
    out, lse = impl.forward(q, k, v, None, return_softmax_lse=True)
    want, want_lse = ref.attention(q, k, v, causal=causal, scale=0.3)
    ref.assert_close(out, want, "f32")
    ref.assert_lse(lse, want_lse)
    ref.assert_close(impl.forward(q, k, v, attn_metadata=None), want, "f32")


def test_wrong_scale_is_caught(rng):
    """The comparison can fail: the default scale is not the one given."""
    impl = fs.FmhaAttentionImpl(4, 32, None)
    q, k, v = _qkv(rng, 1, 40, 40, 4, 4, 32)
    assert ref.rel_l2(impl.forward(q, k, v), ref.attention(q, k, v, scale=0.3)[0]) > 1e-2


def test_head_shards_get_their_own_layer(rng):
    """Ulysses sequence parallelism hands each rank H / world heads."""
    impl = fs.FmhaAttentionImpl(8, 32, causal=True, num_kv_heads=4)
    q, k, v = _qkv(rng, 1, 50, 50, 2, 1, 32, "f16")
    ref.assert_close(impl.forward(q, k, v), ref.attention(q, k, v, causal=True)[0], "f16")
    assert (2, 1, None) in impl._layers and len(impl._layers) == 2
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple"):
        impl.forward(*_qkv(rng, 1, 5, 5, 3, 2, 32))


def test_forward_varlen(rng):
    impl = fs.FmhaAttentionImpl(4, 32, causal=True, num_kv_heads=2)
    cu = np.array([0, 9, 9, 40], dtype=np.int64)  # an empty sequence, int64 as torch makes them
    q, k, v = (x[0] for x in _qkv(rng, 1, 40, 40, 4, 2, 32))
    out = impl.forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=31, cu_seqlens_host=None)
    ref.assert_close(out, ref.varlen_attention(q, k, v, cu, cu, causal=True)[0], "f32")


def test_dropout(rng):
    impl = fs.FmhaAttentionImpl(4, 32, causal=True, num_kv_heads=2, dropout_p=0.25)
    q, k, v = _qkv(rng, 2, 30, 30, 4, 2, 32)
    fmha.manual_seed(11)
    out = impl.forward(q, k, v)
    fmha.manual_seed(11)  # the same seed drawn: fmha.attention's dropout, bit for bit
    np.testing.assert_array_equal(out, fmha.attention(q, k, v, causal=True, dropout_p=0.25))
    assert ref.rel_l2(out, ref.attention(q, k, v, causal=True)[0]) > 0.05


@pytest.mark.skipif(ref.BF16 is None, reason="ml_dtypes is not installed")
def test_fp8_from_the_aiter_variable(rng, monkeypatch):
    q, k, v = _qkv(rng, 1, 70, 90, 4, 2, 64, "bf16")
    exact = ref.attention(q, k, v)[0]
    monkeypatch.setenv(fs.FP8_ENV, "1")
    impl = fs.FmhaAttentionImpl(4, 64, num_kv_heads=2)
    out = impl.forward(q, k, v)
    assert impl.fp8 == "per_tensor" and impl.layer.fp8_path[0] == "fp8"
    assert out.dtype == ref.BF16 and 1e-3 < ref.rel_l2(out, exact) < 0.08
    # an explicit choice wins over the variable
    assert fs.FmhaAttentionImpl(4, 64, fp8="per_block").fp8 == "per_block"
    assert fs.FmhaAttentionImpl(4, 64, fp8=False).fp8 is None
    # inputs already in FP8 run as they are (descale 1), out bfloat16
    q8, k8, v8 = (x.astype(ref.ml_dtypes.float8_e4m3fn) for x in (q, k, v))
    out8 = impl.forward(q8, k8, v8)
    assert out8.dtype == ref.BF16
    ref.assert_close(out8, ref.attention(q8, k8, v8)[0], "bf16")
    monkeypatch.setenv(fs.FP8_ENV, "0")
    assert fs.FmhaAttentionImpl(4, 64).fp8 is None


# ------------------------------------------------------------------ register()


@pytest.fixture
def fake_sglang(monkeypatch):
    """Just enough of sglang.multimodal_gen for register(): the backend enum
    and a selector whose cached function turns an enum into a backend class."""
    import enum
    import functools

    names = ["FA", "TORCH_SDPA", "AITER", "VIDEO_SPARSE_ATTN"]
    Enum = enum.Enum("AttentionBackendEnum", names)
    backends = {m: type(m.name + "Backend", (), {"get_enum": staticmethod(lambda m=m: m)})
                for m in Enum}
    platforms = types.ModuleType(fs._PLATFORMS)
    platforms.AttentionBackendEnum = Enum
    selector = types.ModuleType(fs._SELECTOR)

    @functools.cache
    def cached(head_size, dtype, supported, selected):
        return backends[selected]

    selector._cached_get_attn_backend = cached
    selector.get_attn_backend = lambda selected: selector._cached_get_attn_backend(
        128, "bf16", (), selected)
    monkeypatch.setitem(sys.modules, fs._PLATFORMS, platforms)
    monkeypatch.setitem(sys.modules, fs._SELECTOR, selector)
    yield types.SimpleNamespace(enum=Enum, selector=selector, backends=backends)
    fs.FmhaAttentionImpl.default_fp8 = None


def test_register_replaces_dense_backends(fake_sglang):
    E, sel = fake_sglang.enum, fake_sglang.selector
    assert fs.register() == ["AITER", "FA", "TORCH_SDPA"]  # FA2 is not in this sglang
    for m in (E.FA, E.TORCH_SDPA, E.AITER):
        b = sel.get_attn_backend(m)
        assert issubclass(b, fs.FmhaAttentionBackend) and b.get_enum() is m
        assert b.get_impl_cls() is fs.FmhaAttentionImpl
        assert getattr(fs, b.__name__) is b  # resolvable by its qualified name
    assert sel.get_attn_backend(E.VIDEO_SPARSE_ATTN) is fake_sglang.backends[E.VIDEO_SPARSE_ATTN]
    sel._cached_get_attn_backend.cache_clear()  # sglang's own calls still work

    assert fs.register(["fa"], fp8="per_block") == ["FA"]  # again: replaces, never stacks
    assert sel.get_attn_backend(E.TORCH_SDPA) is fake_sglang.backends[E.TORCH_SDPA]
    assert fs.FmhaAttentionImpl(4, 32).fp8 == "per_block"

    fs.unregister()
    assert sel.get_attn_backend(E.FA) is fake_sglang.backends[E.FA]
    assert fs.FmhaAttentionImpl(4, 32).fp8 is None


def test_register_errors(fake_sglang):
    with pytest.raises(ValueError, match="no attention backend FLASHINFER; its backends are FA"):
        fs.register(["FA", "flashinfer"])
    with pytest.raises(ValueError, match="fp8 must be None"):
        fs.register(fp8="fp4")
    assert fs.FmhaAttentionImpl.default_fp8 is None


def test_subclasses_sglangs_bases(monkeypatch):
    """With sglang importable the module builds on its abstract classes;
    a stand-in of attention_backend.py with sglang's abstract methods."""
    import abc
    import dataclasses

    base = types.ModuleType("attention_backend")
    exec(  # noqa: S102 - a fixed stand-in module
        "class AttentionBackend(abc.ABC):\n"
        "    @staticmethod\n    @abc.abstractmethod\n    def get_impl_cls(): ...\n"
        "class AttentionImpl(abc.ABC):\n"
        "    @abc.abstractmethod\n    def __init__(self, num_heads, head_size, softmax_scale,"
        " causal=False, num_kv_heads=None, prefix='', **extra_impl_args): ...\n"
        "    @abc.abstractmethod\n    def forward(self, query, key, value, attn_metadata): ...\n"
        "@dataclasses.dataclass\nclass AttentionMetadata:\n    current_timestep: int\n",
        {"abc": abc, "dataclasses": dataclasses}, base.__dict__)
    parts = ("sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend"
             .split("."))
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, ".".join(parts), base)
    spec = importlib.util.spec_from_file_location("fmha._sglang_on_stand_in", fs.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.HAVE_SGLANG and mod.AttentionMetadata is base.AttentionMetadata
    assert issubclass(mod.FmhaAttentionImpl, base.AttentionImpl)
    assert issubclass(mod.FmhaAttentionBackend, base.AttentionBackend)
    mod.FmhaAttentionImpl(4, 32, 0.2)  # every abstract method is implemented


# ------------------------------------------------------------------ torch


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _f64(t):
    return t.detach().cpu().double().numpy()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_torch_cpu_as_sglang_passes_them(torch, dtype):
    """q, k, v as chunks of one [3B, S, H, D] tensor (sglang's Ulysses path
    concatenates and chunks them), GQA through K/V of fewer heads, causal."""
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(3)
    impl = fs.FmhaAttentionImpl(6, 80, 80 ** -0.5, causal=True, num_kv_heads=6)
    qkv = torch.randn(3, 239, 6, 80, generator=g).to(tdt)
    q, k, v = qkv.chunk(3, dim=0)
    with torch.no_grad():
        out, lse = impl.forward(q, k, v, None, return_softmax_lse=True)
    assert out.dtype == tdt and tuple(out.shape) == (1, 239, 6, 80)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (1, 6, 239)
    want, want_lse = ref.attention(_f64(q), _f64(k), _f64(v), causal=True)
    ref.assert_close(_f64(out), want, dtype)
    ref.assert_lse(_f64(lse), want_lse)

    gqa = fs.FmhaAttentionImpl(8, 32, 0.2, num_kv_heads=2)
    q = torch.randn(2, 37, 8, 32, generator=g).to(tdt)
    k, v = (torch.randn(2, 113, 2, 32, generator=g).to(tdt) for _ in range(2))
    with torch.no_grad():
        out = gqa.forward(q, k, v, None)
    ref.assert_close(_f64(out), ref.attention(_f64(q), _f64(k), _f64(v), scale=0.2)[0], dtype)


def test_torch_varlen_and_fp8(torch, monkeypatch):
    g = torch.Generator().manual_seed(4)
    impl = fs.FmhaAttentionImpl(4, 32, num_kv_heads=1)
    q = torch.randn(45, 4, 32, generator=g).bfloat16()
    k, v = (torch.randn(45, 1, 32, generator=g).bfloat16() for _ in range(2))
    cu = torch.tensor([0, 20, 45])  # int64: converted as sglang's AITer backend does
    out = impl.forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=25)
    want = ref.varlen_attention(_f64(q), _f64(k), _f64(v), cu.numpy(), cu.numpy())[0]
    ref.assert_close(_f64(out), want, "bf16")

    monkeypatch.setenv(fs.FP8_ENV, "1")
    fp8 = fs.FmhaAttentionImpl(4, 32, num_kv_heads=1)
    q, k, v = (x.reshape(1, 45, -1, 32) for x in (q, k, v))
    out = fp8.forward(q, k, v)
    assert out.dtype == torch.bfloat16 and fp8.layer.fp8_path[0] == "fp8"
    assert ref.rel_l2(_f64(out), ref.attention(_f64(q), _f64(k), _f64(v))[0]) < 0.08
    out8 = fp8.forward(*(x.to(torch.float8_e4m3fn) for x in (q, k, v)))
    assert out8.dtype == torch.bfloat16


@pytest.mark.gpu
def test_torch_cuda(torch):
    g = torch.Generator().manual_seed(5)
    impl = fs.FmhaAttentionImpl(8, 128, 128 ** -0.5, causal=True, num_kv_heads=2)
    q = torch.randn(2, 1023, 8, 128, generator=g).bfloat16().cuda()
    k, v = (torch.randn(2, 1023, 2, 128, generator=g).bfloat16().cuda() for _ in range(2))
    out, lse = impl.forward(q, k, v, None, return_softmax_lse=True)
    assert out.is_cuda and lse.is_cuda
    want, want_lse = ref.attention(_f64(q), _f64(k), _f64(v), causal=True)
    ref.assert_close(_f64(out), want, "bf16")
    ref.assert_lse(_f64(lse), want_lse)
