"""Errors: libfmha statuses as Python exceptions with the library's messages,
argument checks on the Python side, and the ctypes structs against the C
header's layout."""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

import fmha
import reference as ref
from conftest import ROOT
from fmha import _lib


@pytest.mark.parametrize("status,cls,builtin", [
    (_lib.STATUS_INVALID_ARGUMENT, fmha.InvalidArgumentError, ValueError),
    (_lib.STATUS_UNSUPPORTED, fmha.UnsupportedError, NotImplementedError),
    (_lib.STATUS_OUT_OF_MEMORY, fmha.OutOfMemoryError, MemoryError),
    (_lib.STATUS_BACKEND_ERROR, fmha.BackendError, RuntimeError),
])
def test_status_mapping(status, cls, builtin):
    _lib.kernel_select(_lib.config_init(8, 8, 64))  # a successful call clears the message
    with pytest.raises(cls) as e:
        _lib.raise_for_status(status)
    assert isinstance(e.value, builtin) and isinstance(e.value, fmha.FmhaError)
    assert e.value.status == status
    assert str(e.value) == _lib.fmha_status_string(status).decode()  # no message: the name
    _lib.raise_for_status(_lib.STATUS_OK)


def test_fp8_kernel_choice_from_the_library():
    cfg = _lib.config_init(8, 8, 64)
    cfg.dtype = _lib.DTYPE_F8_E4M3
    cfg.device = _lib.DEVICE_CPU  # FP8 inputs run on the CPU's f32 kernels
    assert _lib.kernel_select(cfg).name.decode().endswith("_f32")
    # On CUDA only Hopper's FP8 kernel takes them; elsewhere the library says why.
    cfg.device = _lib.DEVICE_CUDA
    try:
        assert _lib.kernel_select(cfg).name.decode() == "cuda_hopper_fp8_sm90"
    except fmha.UnsupportedError as e:
        assert any(m in str(e) for m in ("built without a CUDA backend", "no CUDA device",
                                         "compute capability")), str(e)
    cfg.device = _lib.DEVICE_CPU
    cfg.fp8_compute = _lib.FP8_COMPUTE_PER_TENSOR  # quantizes inputs that are not FP8 yet
    with pytest.raises(fmha.InvalidArgumentError, match="leave fp8_compute off and pass their "
                                                        "descales"):
        _lib.kernel_select(cfg)


def test_python_side_argument_errors(rng):
    q = ref.make(rng, (1, 8, 2, 16), "f32")
    with pytest.raises(TypeError, match="float32, float16, bfloat16 .* or FP8"):
        fmha.attention(q.astype(np.float64), q, q)
    with pytest.raises(TypeError, match="numpy array, a torch tensor or an object"):
        fmha.attention(q.tolist(), q, q)
    with pytest.raises(ValueError, match=r"q must be 4-d \[batch, seqlen, heads, head_dim\]"):
        fmha.attention(q[0], q, q)
    # head_dim not contiguous: the message names the fix
    bad = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    with pytest.raises(ValueError, match=r"k: the last dimension \(head_dim\) must be "
                                         r"contiguous.*np.ascontiguousarray"):
        fmha.attention(q, bad, q)
    with pytest.raises(ValueError, match="negative strides"):
        fmha.attention(q[:, ::-1], q, q)
    with pytest.raises(ValueError, match="k.dtype \\(f16\\) differs from the layer's dtype"):
        fmha.attention(q, q.astype(np.float16), q)
    with pytest.raises(ValueError, match="window_right \\(-5\\) must be >= -1"):
        fmha.attention(q, q, q, window=(0, -5))
    with pytest.raises(ValueError, match="window must be a pair"):
        fmha.attention(q, q, q, window=3)
    with pytest.raises(ValueError, match="softmax_scale must be > 0"):
        fmha.attention(q, q, q, softmax_scale=0.0)
    with pytest.raises(ValueError, match="seed"):
        fmha.attention(q, q, q, dropout_p=0.1, seed=-1)
    with pytest.raises(ValueError, match="batch sizes differ"):
        fmha.attention(q, np.concatenate([q, q]), np.concatenate([q, q]))
    with pytest.raises(ValueError, match="v.seqlen \\(4\\) differs from k.seqlen \\(8\\)"):
        fmha.attention(q, q, q[:, :4])


def test_config_init_through_ctypes():
    cfg = _lib.config_init(32, 8, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim_v) == (32, 8, 128, 128)
    assert cfg.dtype == _lib.DTYPE_BF16 and cfg.device == _lib.DEVICE_CPU
    assert (cfg.window_left, cfg.window_right) == (-1, -1)
    assert cfg.softmax_scale == 0.0 and cfg.softcap == 0.0 and cfg.dropout_p == 0.0
    assert cfg.causal == 0 and cfg.cpu_isa == _lib.CPU_ISA_AUTO and cfg.num_threads == 0


STRUCTS = {"fmha_tensor": _lib.Tensor, "fmha_config": _lib.Config,
           "fmha_forward_args": _lib.ForwardArgs, "fmha_kernel_info": _lib.KernelInfo}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_struct_layout_matches_the_header(tmp_path):
    # sizeof and every offsetof, compiled against include/fmha.h
    header = os.path.join(ROOT, "include", "fmha.h")
    if not os.path.exists(header):
        pytest.skip("include/fmha.h is not beside this package")
    lines = ['#include "fmha.h"', "#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    for cname, py in STRUCTS.items():
        lines.append('printf("%s %%zu\\n", sizeof(%s));' % (cname, cname))
        for field, _ in py._fields_:
            lines.append('printf("%s.%s %%zu\\n", offsetof(%s, %s));'
                         % (cname, field, cname, field))
    lines += ["return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-std=c11", "-I", os.path.dirname(header), str(src), "-o", str(exe)],
                   check=True)
    c = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                     check=True).stdout.splitlines())
    for cname, py in STRUCTS.items():
        assert int(c[cname]) == ctypes.sizeof(py), cname
        for field, _ in py._fields_:
            assert int(c["%s.%s" % (cname, field)]) == getattr(py, field).offset, (cname, field)


def test_info():
    info = fmha.info()
    assert info["cpu_isa"] in ("scalar", "avx2", "avx512", "avx512-bf16")
    assert os.path.exists(info["library"])
    assert isinstance(info["cuda_backend"], bool) and isinstance(info["cuda_devices"], list)


# Python ints beyond int64 used to wrap in ctypes (Attention(2**64 + 4, 2**64 + 8)
# ran as 4 heads of dim 8; 2**63 heads were reported as negative), and any truthy
# object was taken as a flag (causal='yes').
@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((2**64 + 4, 2**64 + 8), {}, ValueError, r"num_heads \(18446744073709551620\) is out of "
                                             r"range: it must be in \[-2\^63, 2\^63 - 1\]"),
    ((2**63, 64), {}, ValueError, r"num_heads \(9223372036854775808\) is out of range"),
    ((8, 2**64 + 64), {}, ValueError, r"head_size \(18446744073709551680\) is out of range"),
    ((8, 64), {"num_kv_heads": -2**63 - 1}, ValueError, r"num_kv_heads .* is out of range"),
    ((8, 64), {"window": (2**63, -1)}, ValueError, r"window\[0\] .* is out of range"),
    ((True, 64), {}, TypeError, r"num_heads must be an integer, got the bool True"),
    ((8.0, 64), {}, TypeError, r"num_heads must be an integer, got 8.0"),
    ((8, 64), {"causal": "yes"}, TypeError, r"causal must be True or False \(or 0/1\), "
                                            r"got 'yes'"),
    ((8, 64), {"causal": 2}, ValueError, r"causal must be True or False \(or 0/1\), got 2"),
    ((8, 64), {"causal": None}, TypeError, r"causal must be True or False"),
    ((8, 64), {"fp8": "per_tensor", "fp8_smooth_k": "no"}, TypeError, r"fp8_smooth_k must be"),
    ((8, 64), {"softmax_scale": "0.125"}, TypeError, r"softmax_scale must be a real number"),
    ((8, 64), {"dropout_p": "0.1"}, TypeError, r"dropout_p must be a real number"),
    ((8, 64), {"softcap": [1.0]}, TypeError, r"softcap must be a real number"),
])
def test_layer_arguments_checked_before_ctypes(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fmha.Attention(*args, **kwargs)


def test_flags_and_sizes_of_calls_checked_before_ctypes(rng):
    q = ref.make(rng, (1, 8, 2, 16), "f32")
    for causal in (True, False, 1, 0, np.bool_(True)):  # the accepted spellings
        fmha.attention(q, q, q, causal=causal)
    layer = fmha.Attention(np.int64(2), np.int32(16), causal=np.bool_(True))
    assert layer.num_heads == 2 and layer.head_size == 16 and layer.causal is True
    with pytest.raises(TypeError, match="causal must be True or False"):
        fmha.attention(q, q, q, causal="yes")
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        fmha.attention(q, q, q, return_lse="no")
    with pytest.raises(ValueError, match=r"window\[1\] \(18446744073709551615\) is out of range"):
        fmha.attention(q, q, q, window=(-1, 2**64 - 1))
    with pytest.raises(TypeError, match="causal must be True or False"):
        fmha.flash_attn_func(q, q, q, causal="false")
    packed = q[0]
    cu = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(18446744073709551624\) is out of range"):
        fmha.varlen_attention(packed, packed, packed, cu, cu, 2**64 + 8, 8)


def test_check_finite_refuses_nan_and_inf(rng):
    q = ref.make(rng, (1, 9, 2, 16), "f32")
    k, v = q.copy(), q.copy()
    k[0, 4, 1, 7] = np.inf
    plain = fmha.Attention(2, 16)
    checked = fmha.Attention(2, 16, check_finite=True)
    assert checked.check_finite is True
    with pytest.raises(ValueError, match=r"k holds 1 NaN or inf value, the first at "
                                         r"\[batch, seq, head, channel\] = \[0, 4, 1, 7\]"):
        checked(q, k, v)
    np.testing.assert_array_equal(checked(q, q, q), plain(q, q, q))
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        fmha.Attention(2, 16, check_finite="yes")
