"""fmha.Attention, the layer object: validation at construction (the GQA
message), kernel reporting, forward / forward_varlen against the functional
API and the reference, and the fp8 option (its path, its fallback warning)."""
import warnings

import numpy as np
import pytest

import fmha
import reference as ref

CPU_KERNELS = {"cpu_scalar_f32", "cpu_avx2_f32", "cpu_avx512_f32", "cpu_avx512_bf16dp"}


def test_gqa_message_at_construction():
    with pytest.raises(ValueError) as e:
        fmha.Attention(28, 128, num_kv_heads=6)
    assert str(e.value) == (
        "num_heads (28) must be a multiple of num_kv_heads (6): each KV head serves an equal "
        "group of query heads; check num_attention_heads / num_key_value_heads in the model "
        "config")
    assert isinstance(e.value, fmha.InvalidArgumentError)
    assert e.value.status_name == "FMHA_STATUS_INVALID_ARGUMENT"


@pytest.mark.parametrize("args,message", [
    ((8, 64, None, False, 16), "num_kv_heads \\(16\\) exceeds num_heads \\(8\\)"),
    ((0, 64), "num_heads \\(0\\) must be positive"),
    ((8, 0), "head_dim \\(0\\) must be positive"),
    ((8, 64, -1.0), "softmax_scale \\(-1\\) must be finite and >= 0"),
    ((8, 64, None, False, None, 1.0), "dropout_p \\(1\\) must be in \\[0, 1\\)"),
])
def test_invalid_configurations(args, message):
    with pytest.raises(ValueError, match=message):
        fmha.Attention(*args)


def test_invalid_keyword_options():
    with pytest.raises(ValueError, match="window_left \\(-2\\) must be >= -1"):
        fmha.Attention(8, 64, window=(-2, 0))
    with pytest.raises(ValueError, match="softcap \\(-1\\) must be finite"):
        fmha.Attention(8, 64, softcap=-1.0)
    with pytest.raises(TypeError, match="dtype"):
        fmha.Attention(8, 64, dtype="int8")
    with pytest.raises(ValueError, match="device"):
        fmha.Attention(8, 64, device="tpu")


def test_kernel_reporting(rng):
    layer = fmha.Attention(4, 32, num_kv_heads=2)
    assert layer.kernel in CPU_KERNELS  # before any forward: bf16 on the CPU
    assert layer.kernel_for("f32") in CPU_KERNELS - {"cpu_avx512_bf16dp"}
    q = ref.make(rng, (1, 8, 4, 32), "f32")
    k = ref.make(rng, (1, 8, 2, 32), "f32")
    layer.forward(q, k, k)
    assert layer.kernel == layer.kernel_for(np.float32)
    assert fmha.Attention(4, 32, dtype="f16").kernel in CPU_KERNELS


def test_forward_matches_attention(rng):
    layer = fmha.Attention(6, 32, softmax_scale=0.2, causal=True, num_kv_heads=2,
                           window=(7, -1), softcap=8.0)
    q = ref.make(rng, (2, 15, 6, 32), "f16", "bhsd")
    k, v = (ref.make(rng, (2, 19, 2, 32), "f16", "bhsd") for _ in range(2))
    out, lse = layer.forward(q, k, v, return_lse=True)
    again = layer(q, k, v)  # __call__ is forward; the cached C layer runs again
    direct = fmha.attention(q, k, v, causal=True, softmax_scale=0.2, window=(7, -1),
                            softcap=8.0)
    np.testing.assert_array_equal(out, again)
    np.testing.assert_array_equal(out, direct)
    want, want_lse = ref.attention(q, k, v, causal=True, scale=0.2, window=(7, -1),
                                   softcap=8.0)
    ref.assert_close(out, want, "f16")
    ref.assert_lse(lse, want_lse)


def test_forward_dropout(rng):
    layer = fmha.Attention(2, 16, dropout_p=0.25)
    q, k, v = (ref.make(rng, (1, 12, 2, 16), "f32") for _ in range(3))
    a = layer.forward(q, k, v, seed=5)
    np.testing.assert_array_equal(a, layer.forward(q, k, v, seed=5))
    ref.assert_close(a, ref.attention(q, k, v, dropout_p=0.25, seed=5)[0], "f32")


def test_forward_varlen(rng):
    layer = fmha.Attention(4, 16, causal=True, num_kv_heads=1)
    cu_q = np.array([0, 3, 3, 11], dtype=np.int32)
    cu_k = np.array([0, 5, 7, 9], dtype=np.int32)
    q = ref.make(rng, (1, 11, 4, 16), "f32")[0]
    k, v = (ref.make(rng, (1, 9, 1, 16), "f32")[0] for _ in range(2))
    out, lse = layer.forward_varlen(q, k, v, cu_q, cu_k, 8, 5, return_lse=True)
    want, want_lse = ref.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    ref.assert_close(out, want, "f32")
    ref.assert_lse(lse, want_lse)


def test_forward_shape_errors(rng):
    layer = fmha.Attention(8, 64)
    q = ref.make(rng, (1, 4, 4, 64), "f32")
    with pytest.raises(ValueError, match="q.heads \\(4\\) differs from num_heads \\(8\\)"):
        layer.forward(q, q, q)
    q = ref.make(rng, (1, 4, 8, 32), "f32")
    with pytest.raises(ValueError, match="must equal head_dim \\(64\\)"):
        layer.forward(q, q, q)


def test_cuda_layer_without_a_gpu():
    if fmha.info()["cuda_devices"]:
        pytest.skip("a CUDA device is present")
    with pytest.raises(NotImplementedError) as e:
        fmha.Attention(8, 64, device="cuda")
    assert isinstance(e.value, fmha.UnsupportedError)
    assert "use device cpu" in str(e.value)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512-bf16"])
def test_every_cpu_isa(rng, monkeypatch, isa):
    order = ["scalar", "avx2", "avx512", "avx512-bf16"]
    if order.index(isa) > order.index(fmha.info()["cpu_isa"]):
        pytest.skip("this CPU lacks " + isa)
    monkeypatch.setenv("FMHA_CPU_ISA", isa)  # libfmha reads it at each kernel choice
    layer = fmha.Attention(4, 48, causal=True, num_kv_heads=2, softcap=10.0)
    for dtype in ["f32", "f16"] + (["bf16"] if ref.BF16 else []):
        q = ref.make(rng, (2, 21, 4, 48), dtype, "bhsd")
        k, v = (ref.make(rng, (2, 30, 2, 48), dtype) for _ in range(2))
        out = layer.forward(q, k, v)
        assert layer.kernel.startswith("cpu_%s_" % isa.split("-")[0])  # avx512-bf16: cpu_avx512_*
        if isa == "avx512-bf16":
            assert layer.kernel == ("cpu_avx512_bf16dp" if dtype == "bf16" else "cpu_avx512_f32")
        ref.assert_close(out, ref.attention(q, k, v, causal=True, softcap=10.0)[0], dtype)


# ------------------------------------------------------------------ fp8


def _quantize_per_tensor(x):
    """x's values after E4M3 quantization with one scale amax / 448, done with
    ml_dtypes: an implementation of the format independent of libfmha's."""
    x = np.asarray(x, dtype=np.float32)
    scale = np.float32(np.abs(x).max()) / np.float32(448.0)
    codes = np.clip(x / scale, -448, 448).astype(ref.ml_dtypes.float8_e4m3fn)
    return codes.astype(np.float64) * np.float64(scale)


@pytest.mark.skipif(ref.BF16 is None, reason="ml_dtypes is not installed")
def test_fp8_layer_computes_on_quantized_inputs(rng):
    layer = fmha.Attention(4, 64, causal=True, num_kv_heads=2, fp8="per_tensor")
    q = ref.make(rng, (2, 70, 4, 64), "f32", "bhsd")
    k, v = (ref.make(rng, (2, 90, 2, 64), "f32") for _ in range(2))
    out = layer.forward(q, k, v)
    path, reason = layer.fp8_path
    assert path == "fp8" and "quantized to f8_e4m3 on each call" in reason, reason
    assert layer.kernel.endswith("_f32")
    want = ref.attention(*(_quantize_per_tensor(x) for x in (q, k, v)), causal=True)[0]
    ref.assert_close(out, want, "f32", "fp8 against the reference on quantized inputs")
    exact = ref.attention(q, k, v, causal=True)[0]
    assert 1e-3 < ref.rel_l2(out, exact) < 0.08  # E4M3: 3 mantissa bits
    assert "fp8='per_tensor'" in repr(layer)


@pytest.mark.skipif(ref.BF16 is None, reason="ml_dtypes is not installed")
def test_fp8_layer_per_block(rng):
    layer = fmha.Attention(2, 32, fp8="per_block")
    q, k, v = (ref.make(rng, (1, 300, 2, 32), "bf16") for _ in range(3))
    out = layer.forward(q, k, v)
    assert out.dtype == ref.BF16 and layer.fp8_path[0] == "fp8"
    assert ref.rel_l2(out, ref.attention(q, k, v)[0]) < 0.08


def test_fp8_smooth_k(rng):
    """K with four offset channels (+20 .. +100): smoothed, the FP8 layer is
    back at Gaussian-input accuracy; the LSE is the exact one within FP8's
    error (uncorrected it would be off by scale * q . mean)."""
    q = ref.make(rng, (1, 96, 4, 32), "f32")
    k, v = (ref.make(rng, (1, 120, 2, 32), "f32") for _ in range(2))
    for j, g in enumerate((20, 40, 70, 100)):
        k[:, :, :, (j * 37 + 5) % 32] += g
    exact, lse = ref.attention(q, k, v, causal=True)
    plain = fmha.Attention(4, 32, causal=True, num_kv_heads=2, fp8="per_tensor")
    smooth = fmha.Attention(4, 32, causal=True, num_kv_heads=2, fp8="per_tensor",
                            fp8_smooth_k=True)
    assert "fp8_smooth_k=True" in repr(smooth) and smooth.fp8_smooth_k
    out_s, lse_s = smooth.forward(q, k, v, return_lse=True)
    assert "mean subtracted first" in smooth.fp8_path[1]
    e_smooth, e_plain = ref.rel_l2(out_s, exact), ref.rel_l2(plain.forward(q, k, v), exact)
    assert e_smooth < 0.08 and e_smooth < e_plain / 3, (e_smooth, e_plain)
    assert np.max(np.abs(np.asarray(lse_s, np.float64) - lse)) < 0.25
    with pytest.raises(fmha.InvalidArgumentError, match="set softcap = 0 or fp8_smooth_k = 0"):
        fmha.Attention(4, 32, softcap=30.0, fp8="per_tensor", fp8_smooth_k=True)


def test_fp8_int8_qk_runs_q_dtype_on_the_cpu(rng):
    """fp8='int8_qk' has no CPU kernel: the layer runs q's dtype, warns with
    libfmha's reason, and gives the plain layer's bits; softcap is refused."""
    layer = fmha.Attention(4, 64, causal=True, num_kv_heads=2, fp8="int8_qk")
    plain = fmha.Attention(4, 64, causal=True, num_kv_heads=2)
    q = ref.make(rng, (1, 50, 4, 64), "f16")
    k, v = (ref.make(rng, (1, 70, 2, 64), "f16") for _ in range(2))
    with pytest.warns(RuntimeWarning, match="has no INT8 Q K"):
        out = layer.forward(q, k, v)
    assert layer.fp8_path[0] == "fp8_fallback" and "fp8='int8_qk'" in repr(layer)
    np.testing.assert_array_equal(out, plain.forward(q, k, v))
    with pytest.raises(fmha.InvalidArgumentError, match="int8_qk subtracts K's mean.*softcap"):
        fmha.Attention(4, 32, softcap=30.0, fp8="int8_qk")


def test_fp8_fallback_warns_once(rng, monkeypatch):
    monkeypatch.setenv("FMHA_FP8_ATTN", "0")  # libfmha reads it at each layer's choice
    layer = fmha.Attention(4, 32, fp8="per_tensor")
    plain = fmha.Attention(4, 32)
    q, k, v = (ref.make(rng, (1, 20, 4, 32), "f16") for _ in range(3))
    with pytest.warns(RuntimeWarning, match="FP8 attention is unavailable.*FMHA_FP8_ATTN=0"):
        out = layer.forward(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call on the same layer stays quiet
        out = layer.forward(q, k, v)
    assert layer.fp8_path[0] == "fp8_fallback"
    assert np.array_equal(out, plain.forward(q, k, v))


def test_fp8_option_errors():
    with pytest.raises(ValueError, match="fp8 must be None, 'per_tensor', 'per_block' or 'int8_qk'"):
        fmha.Attention(4, 32, fp8="e5m2")
