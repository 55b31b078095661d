"""_lib.py — libfmha through ctypes: the C structs of include/fmha.h mirrored
field by field, the function prototypes, and fmha statuses turned into Python
exceptions; loading libfmha finds its CUDA runtime first when it needs one.
Nothing here knows about numpy or torch."""
import ctypes
import importlib.util
import os
import re
from ctypes import (POINTER, Structure, c_char_p, c_double, c_int, c_int64, c_size_t,
                    c_uint16, c_uint64, c_void_p, c_float)

# ------------------------------------------------------------------ enums (C ints)

STATUS_OK = 0
STATUS_INVALID_ARGUMENT = 1
STATUS_UNSUPPORTED = 2
STATUS_OUT_OF_MEMORY = 3
STATUS_BACKEND_ERROR = 4

DTYPE_F32 = 0
DTYPE_F16 = 1
DTYPE_BF16 = 2
DTYPE_F8_E4M3 = 3

DEVICE_CPU = 0
DEVICE_CUDA = 1

CPU_ISA_AUTO = 0
CPU_ISA_SCALAR = 1
CPU_ISA_AVX2 = 2
CPU_ISA_AVX512 = 3
CPU_ISA_AVX512_BF16 = 4

FP8_COMPUTE_OFF = 0
FP8_COMPUTE_PER_TENSOR = 1
FP8_COMPUTE_PER_BLOCK = 2
FP8_COMPUTE_INT8_QK = 3

DESCALE_PER_TENSOR = 0
DESCALE_PER_KV_HEAD = 1
DESCALE_PER_BLOCK = 2

LAYER_PATH_DIRECT = 0
LAYER_PATH_FP8 = 1
LAYER_PATH_FP8_FALLBACK = 2

DTYPE_NAMES = {DTYPE_F32: "f32", DTYPE_F16: "f16", DTYPE_BF16: "bf16", DTYPE_F8_E4M3: "f8_e4m3"}
DEVICE_NAMES = {DEVICE_CPU: "cpu", DEVICE_CUDA: "cuda"}


# ------------------------------------------------------------------ structs


class Tensor(Structure):
    """fmha_tensor: a [batch, seqlen, heads, head_dim] view, strides in elements."""
    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_int),
        ("batch", c_int64),
        ("seqlen", c_int64),
        ("heads", c_int64),
        ("head_dim", c_int64),
        ("stride_batch", c_int64),
        ("stride_seq", c_int64),
        ("stride_head", c_int64),
        ("stride_dim", c_int64),
    ]


class Config(Structure):
    """fmha_config: a layer's attention shape and options."""
    _fields_ = [
        ("num_heads", c_int64),
        ("num_kv_heads", c_int64),
        ("head_dim", c_int64),
        ("head_dim_v", c_int64),
        ("dtype", c_int),
        ("softmax_scale", c_double),
        ("causal", c_int),
        ("window_left", c_int64),
        ("window_right", c_int64),
        ("softcap", c_double),
        ("dropout_p", c_double),
        ("device", c_int),
        ("cpu_isa", c_int),
        ("num_threads", c_int),
        ("fp8_compute", c_int),
        ("fp8_smooth_k", c_int),
        ("check_finite", c_int),
        ("deterministic", c_int),
    ]


class AttnMask(Structure):
    """fmha_attn_mask: a boolean mask or additive bias over (sequence, head,
    query, key), strides in elements (0 broadcasts)."""
    _fields_ = [
        ("data", c_void_p),
        ("type", c_int),
        ("stride_batch", c_int64),
        ("stride_head", c_int64),
        ("stride_q", c_int64),
        ("stride_k", c_int64),
    ]


class ForwardArgs(Structure):
    """fmha_forward_args: the tensors and per-call values of one forward."""
    _fields_ = [
        ("q", Tensor),
        ("k", Tensor),
        ("v", Tensor),
        ("out", Tensor),
        ("lse", c_void_p),            # float *
        ("cu_seqlens_q", c_void_p),   # const int32_t *
        ("cu_seqlens_k", c_void_p),
        ("varlen_batch", c_int64),
        ("max_seqlen_q", c_int64),
        ("max_seqlen_k", c_int64),
        ("seed", c_uint64),
        ("offset", c_uint64),
        ("stream", c_void_p),         # cudaStream_t
        ("descale_q", c_void_p),      # const float *: f8_e4m3 inputs only
        ("descale_k", c_void_p),
        ("descale_v", c_void_p),
        ("descale_layout", c_int),
        ("descale_block_rows", c_int64),
        ("mask", AttnMask),           # score modifiers (CPU layers)
        ("alibi_slopes", c_void_p),   # const float *
        ("alibi_stride_batch", c_int64),
        ("sinks", c_void_p),          # const float *
    ]


class KvcacheArgs(Structure):
    """fmha_kvcache_args: one decode call against KV caches."""
    _fields_ = [
        ("q", Tensor),
        ("k_cache", Tensor),
        ("v_cache", Tensor),
        ("k_new", Tensor),
        ("v_new", Tensor),
        ("out", Tensor),
        ("lse", c_void_p),              # float *
        ("cache_seqlens", c_void_p),    # const int32_t *
        ("cache_batch_idx", c_void_p),
        ("block_table", c_void_p),
        ("block_table_stride", c_int64),
        ("rotary_cos", c_void_p),       # const float *
        ("rotary_sin", c_void_p),
        ("rotary_dim", c_int64),
        ("rotary_len", c_int64),
        ("rotary_interleaved", c_int),
        ("num_splits", c_int64),
        ("stream", c_void_p),
        ("k_descale", c_void_p),        # const float *: FP8 caches
        ("v_descale", c_void_p),
        ("kv_descale_layout", c_int),
        ("max_seqlen_k", c_int64),      # 0, or a bound on every sequence's keys
        ("alibi_slopes", c_void_p),     # const float *
        ("alibi_stride_batch", c_int64),
        ("sinks", c_void_p),
    ]


class BackwardArgs(Structure):
    """fmha_backward_args: one backward's inputs (the forward's, its out and
    lse, dout) and gradient views (data None: not wanted)."""
    _fields_ = [
        ("q", Tensor),
        ("k", Tensor),
        ("v", Tensor),
        ("out", Tensor),
        ("dout", Tensor),
        ("lse", c_void_p),            # const float *
        ("dq", Tensor),
        ("dk", Tensor),
        ("dv", Tensor),
        ("cu_seqlens_q", c_void_p),   # const int32_t *
        ("cu_seqlens_k", c_void_p),
        ("varlen_batch", c_int64),
        ("max_seqlen_q", c_int64),
        ("max_seqlen_k", c_int64),
        ("seed", c_uint64),
        ("offset", c_uint64),
        ("stream", c_void_p),         # cudaStream_t
        ("mask", AttnMask),           # the forward's score modifiers
        ("alibi_slopes", c_void_p),
        ("alibi_stride_batch", c_int64),
        ("sinks", c_void_p),
        ("dsinks", c_void_p),         # float *: written (None: not wanted)
    ]


class KernelInfo(Structure):
    """fmha_kernel_info: which kernel runs a configuration."""
    _fields_ = [
        ("id", c_int),
        ("device", c_int),
        ("cpu_isa", c_int),
        ("name", c_char_p),
    ]


# ------------------------------------------------------------------ exceptions


class FmhaError(Exception):
    """Base of the errors libfmha reports; `status` holds the fmha_status value
    and `status_name` its name (e.g. "FMHA_STATUS_UNSUPPORTED")."""

    def __init__(self, message, status=None, status_name=None):
        super().__init__(message)
        self.status = status
        self.status_name = status_name


class InvalidArgumentError(FmhaError, ValueError):
    """FMHA_STATUS_INVALID_ARGUMENT: the caller passed something impossible."""


class UnsupportedError(FmhaError, NotImplementedError):
    """FMHA_STATUS_UNSUPPORTED: valid, but no backend here can run it."""


class OutOfMemoryError(FmhaError, MemoryError):
    """FMHA_STATUS_OUT_OF_MEMORY."""


class BackendError(FmhaError, RuntimeError):
    """FMHA_STATUS_BACKEND_ERROR: a device runtime failed."""


for _cls in (FmhaError, InvalidArgumentError, UnsupportedError, OutOfMemoryError, BackendError):
    _cls.__module__ = "fmha"  # shown as fmha.InvalidArgumentError in tracebacks

_STATUS_ERRORS = {
    STATUS_INVALID_ARGUMENT: InvalidArgumentError,
    STATUS_UNSUPPORTED: UnsupportedError,
    STATUS_OUT_OF_MEMORY: OutOfMemoryError,
    STATUS_BACKEND_ERROR: BackendError,
}


# ------------------------------------------------------------------ loading


def _candidates():
    here = os.path.dirname(os.path.abspath(__file__))
    env = os.environ.get("FMHA_LIBRARY")
    if env:
        return [env]  # an explicit choice is never second-guessed
    # The installed package holds libfmha.so beside this file; a source tree
    # (python/fmha used in place) falls back to the repository's build/.
    return [os.path.join(here, "libfmha.so"),
            os.path.join(here, os.pardir, os.pardir, "build", "libfmha.so")]


def _nvidia_roots():
    """The folders of the `nvidia` namespace package (NVIDIA's CUDA wheels on
    PyPI) on sys.path, without importing it; [] when none is installed."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


def _find_cudart(soname, roots):
    """The path of CUDA runtime `soname` (libcudart.so.<major>) in a pip
    package under one of `roots`, or None. nvidia-cuda-runtime 13.x installs
    it as nvidia/cu13/lib/libcudart.so.13, nvidia-cuda-runtime-cu12 as
    nvidia/cuda_runtime/lib/libcudart.so.12."""
    major = soname.rsplit(".", 1)[-1]
    for root in roots:
        for sub in ("cu" + major, "cuda_runtime"):
            path = os.path.join(root, sub, "lib", soname)
            if os.path.isfile(path):
                return path
    return None


_CUDART = re.compile(r"libcudart\.so\.\d+")


def _open(path):
    """ctypes.CDLL(path). Where the dynamic loader finds no CUDA runtime for
    it (a CUDA build's libfmha, whose RPATH names the build machine's CUDA),
    loads libcudart.so.N from NVIDIA's pip package (`fmha[cuda13]`) and tries
    again; a process that has a runtime already (torch's) shares it."""
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        missing = _CUDART.search(str(e))
        if not missing:
            raise
        runtime = _find_cudart(missing.group(0), _nvidia_roots())
        if runtime is None:
            raise ImportError("fmha: %s was built with CUDA and needs its runtime %s, found "
                              "neither in a pip package nor on the system: `pip install "
                              "\"fmha[cuda13]\"` installs CUDA 13's, or put CUDA's lib64 on "
                              "LD_LIBRARY_PATH (%s)" % (path, missing.group(0), e)) from e
        ctypes.CDLL(runtime, mode=ctypes.RTLD_GLOBAL)
        return ctypes.CDLL(path)


def _load():
    tried = []
    for path in _candidates():
        if not os.path.exists(path):
            tried.append(os.path.abspath(path))
            continue
        path = os.path.abspath(path)
        return _open(path), path
    raise ImportError("fmha: libfmha.so not found (looked at %s); install the package with "
                      "`pip install .` from the repository root, or point FMHA_LIBRARY "
                      "at a built libfmha.so" % ", ".join(tried))


lib, path = _load()


def _proto(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


fmha_status_string = _proto("fmha_status_string", c_char_p, c_int)
fmha_last_error = _proto("fmha_last_error", c_char_p)
fmha_dtype_name = _proto("fmha_dtype_name", c_char_p, c_int)
fmha_dtype_size = _proto("fmha_dtype_size", c_size_t, c_int)
fmha_cpu_isa_name = _proto("fmha_cpu_isa_name", c_char_p, c_int)
fmha_cpu_isa_detect = _proto("fmha_cpu_isa_detect", c_int)
fmha_config_init = _proto("fmha_config_init", None, POINTER(Config), c_int64, c_int64, c_int64)
fmha_kernel_select = _proto("fmha_kernel_select", c_int, POINTER(Config), POINTER(KernelInfo))
fmha_layer_init = _proto("fmha_layer_init", c_int, POINTER(c_void_p), POINTER(Config))
fmha_layer_free = _proto("fmha_layer_free", None, c_void_p)
fmha_layer_config = _proto("fmha_layer_config", POINTER(Config), c_void_p)
fmha_layer_kernel = _proto("fmha_layer_kernel", POINTER(KernelInfo), c_void_p)
fmha_layer_forward = _proto("fmha_layer_forward", c_int, c_void_p, POINTER(ForwardArgs))
fmha_layer_get_path = _proto("fmha_layer_get_path", c_int, c_void_p, POINTER(c_char_p))
fmha_layer_path_name = _proto("fmha_layer_path_name", c_char_p, c_int)
fmha_forward = _proto("fmha_forward", c_int, POINTER(Config), POINTER(ForwardArgs))
fmha_kernel_select_backward = _proto("fmha_kernel_select_backward", c_int, POINTER(Config),
                                     POINTER(KernelInfo))
fmha_layer_backward = _proto("fmha_layer_backward", c_int, c_void_p, POINTER(BackwardArgs))
fmha_backward = _proto("fmha_backward", c_int, POINTER(Config), POINTER(BackwardArgs))
fmha_reference_backward = _proto("fmha_reference_backward", c_int, POINTER(Config),
                                 POINTER(BackwardArgs))
fmha_reference_forward = _proto("fmha_reference_forward", c_int, POINTER(Config),
                                POINTER(ForwardArgs))
fmha_layer_decode = _proto("fmha_layer_decode", c_int, c_void_p, POINTER(KvcacheArgs))
fmha_decode = _proto("fmha_decode", c_int, POINTER(Config), POINTER(KvcacheArgs))
fmha_reference_decode = _proto("fmha_reference_decode", c_int, POINTER(Config),
                               POINTER(KvcacheArgs))
fmha_cuda_backend_built = _proto("fmha_cuda_backend_built", c_int)
fmha_cuda_device_count = _proto("fmha_cuda_device_count", c_int)
fmha_cuda_device_describe = _proto("fmha_cuda_device_describe", c_int, c_int, c_char_p, c_size_t)
fmha_bf16_to_f32 = _proto("fmha_bf16_to_f32", c_float, c_uint16)
fmha_f32_to_bf16 = _proto("fmha_f32_to_bf16", c_uint16, c_float)
fmha_flops = _proto("fmha_flops", c_double, POINTER(Config), c_int64, c_int64, c_int64)
fmha_dropout_keep = _proto("fmha_dropout_keep", c_int, c_uint64, c_uint64, c_int64, c_int64,
                           c_int64, c_int64, c_int64, c_double)


# ------------------------------------------------------------------ helpers


def raise_for_status(status):
    """Raises the exception of a failed fmha call (status != OK), with the
    message fmha_last_error() holds for this thread. Call it right after the
    failed call, on the same thread: the message lives until the next call."""
    if status == STATUS_OK:
        return
    message = (fmha_last_error() or b"").decode("utf-8", "replace")
    name = (fmha_status_string(status) or b"FMHA_STATUS_UNKNOWN").decode()
    cls = _STATUS_ERRORS.get(status, FmhaError)
    raise cls(message or name, status, name)


def config_init(num_heads, num_kv_heads, head_dim):
    cfg = Config()
    fmha_config_init(ctypes.byref(cfg), int(num_heads), int(num_kv_heads), int(head_dim))
    return cfg


def kernel_select(cfg):
    """The kernel libfmha would run `cfg` with, as a KernelInfo; raises the
    library's error when the configuration is invalid or unsupported."""
    info = KernelInfo()
    raise_for_status(fmha_kernel_select(ctypes.byref(cfg), ctypes.byref(info)))
    return info


def kernel_select_backward(cfg):
    """The backward kernel libfmha would run `cfg` with, or its error."""
    info = KernelInfo()
    raise_for_status(fmha_kernel_select_backward(ctypes.byref(cfg), ctypes.byref(info)))
    return info


def cuda_devices():
    """Descriptions of the CUDA devices this build can use (empty without any)."""
    out = []
    for dev in range(fmha_cuda_device_count()):
        buf = ctypes.create_string_buffer(256)
        if fmha_cuda_device_describe(dev, buf, len(buf)) == STATUS_OK:
            out.append(buf.value.decode("utf-8", "replace"))
    return out


class Layer:
    """An fmha_layer: a validated configuration with its kernel and workspace.
    libfmha lets one thread at a time use a layer; the lock keeps it so."""

    def __init__(self, cfg):
        import threading
        import weakref
        handle = c_void_p()
        raise_for_status(fmha_layer_init(ctypes.byref(handle), ctypes.byref(cfg)))
        self.handle = handle.value
        self.lock = threading.Lock()
        info = fmha_layer_kernel(self.handle).contents
        self.kernel_name = info.name.decode()
        self.kernel_device = DEVICE_NAMES.get(info.device, str(info.device))
        reason = c_char_p()
        path = fmha_layer_get_path(self.handle, ctypes.byref(reason))
        self.path = fmha_layer_path_name(path).decode()
        self.path_reason = (reason.value or b"").decode("utf-8", "replace")
        self._finalizer = weakref.finalize(self, fmha_layer_free, self.handle)

    def forward(self, args):
        with self.lock:
            raise_for_status(fmha_layer_forward(self.handle, ctypes.byref(args)))

    def decode(self, args):
        with self.lock:
            raise_for_status(fmha_layer_decode(self.handle, ctypes.byref(args)))

    def backward(self, args):
        with self.lock:
            raise_for_status(fmha_layer_backward(self.handle, ctypes.byref(args)))

    def close(self):
        self._finalizer()
