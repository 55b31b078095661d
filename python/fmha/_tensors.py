"""_tensors.py — numpy arrays, torch tensors and __dlpack__ objects seen as
fmha_tensor views: data pointer, fmha dtype, shape and element strides, taken
as they are (never copied). Also allocates outputs of the same family and
device as q. torch is used only when the caller's objects are torch tensors
(it is never imported just to check a type)."""
import functools
import numbers
import operator
import sys

import numpy as np

from . import _lib

# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _torch():
    """torch if the process has imported it, else None (no import here: a
    torch tensor cannot exist before torch is imported)."""
    return sys.modules.get("torch")


def _import_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def is_torch(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


class View:
    """One tensor argument as libfmha sees it. `obj` is the numpy array or
    torch tensor that owns the memory (kept alive while the view is)."""

    __slots__ = ("obj", "family", "name", "ptr", "dtype", "shape", "strides", "device",
                 "device_index")

    def tensor(self):
        """The fmha_tensor: 4-d [B, S, H, D] as is; 3-d packed [T, H, D] as
        batch 1 (fmha_tensor_packed's convention)."""
        s = self.strides
        if len(self.shape) == 4:
            b, sq, h, d = self.shape
            return _lib.Tensor(self.ptr, self.dtype, b, sq, h, d, s[0], s[1], s[2], 1)
        t, h, d = self.shape
        return _lib.Tensor(self.ptr, self.dtype, 1, t, h, d, 0, s[0], s[1], 1)


def _numpy_dtype_code(dt, name):
    if dt.isnative:
        if dt == np.float32:
            return _lib.DTYPE_F32
        if dt == np.float16:
            return _lib.DTYPE_F16
        if dt.name == "bfloat16" and dt.itemsize == 2:
            return _lib.DTYPE_BF16
        # OCP E4M3FN only: ml_dtypes' float8_e4m3 (with infinities) and the
        # *fnuz variants encode other values in the same byte.
        if dt.name == "float8_e4m3fn" and dt.itemsize == 1:
            return _lib.DTYPE_F8_E4M3
    raise TypeError("%s: dtype %s is not supported: fmha takes float32, float16, bfloat16 "
                    "(ml_dtypes.bfloat16) or FP8 ml_dtypes.float8_e4m3fn (with descales); "
                    "convert with .astype(np.float32) (or float16 / ml_dtypes.bfloat16)"
                    % (name, dt))


_torch_codes = {}


def _torch_dtype_code(torch, dt, name):
    codes = _torch_codes
    if not codes:
        codes.update({torch.float32: _lib.DTYPE_F32, torch.float16: _lib.DTYPE_F16,
                      torch.bfloat16: _lib.DTYPE_BF16})
        f8 = getattr(torch, "float8_e4m3fn", None)  # torch >= 2.1
        if f8 is not None:
            codes[f8] = _lib.DTYPE_F8_E4M3
    code = codes.get(dt)
    if code is None:
        raise TypeError("%s: dtype %s is not supported: fmha takes torch.float32, "
                        "torch.float16, torch.bfloat16 or FP8 torch.float8_e4m3fn (with "
                        "descales); convert with .to(torch.bfloat16)" % (name, dt))
    return code


def _from_dlpack(x, name):
    """A numpy array or torch tensor sharing x's memory."""
    try:
        dev_type, _ = x.__dlpack_device__()
    except AttributeError:
        dev_type = _DL_CPU
    if dev_type in (_DL_CPU, _DL_CUDA_HOST):
        try:
            return np.from_dlpack(x)
        except (TypeError, ValueError, BufferError, RuntimeError) as e:
            torch = _import_torch()
            if torch is None:
                raise TypeError("%s: numpy cannot import this DLPack tensor (%s); pass a numpy "
                                "array, or install torch so that torch.from_dlpack can" % (name, e))
            return torch.from_dlpack(x)
    if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        torch = _import_torch()
        if torch is None:
            raise TypeError("%s: a CUDA DLPack tensor needs torch (torch.from_dlpack) to be "
                            "used with fmha; install torch or pass a torch tensor" % name)
        return torch.from_dlpack(x)
    raise ValueError("%s: DLPack device type %d is not supported: fmha runs on CPU memory and "
                     "CUDA device memory" % (name, dev_type))


def as_array(x, name):
    """x itself when it is a numpy array or torch tensor; an object with
    __dlpack__ becomes one (sharing memory)."""
    if isinstance(x, np.ndarray) or is_torch(x):
        return x
    if hasattr(x, "__dlpack__"):
        return _from_dlpack(x, name)
    raise TypeError("%s: expected a numpy array, a torch tensor or an object with __dlpack__, "
                    "got %s" % (name, type(x).__name__))


def _namespace_of(x):
    """The array API namespace of a foreign array (neither numpy nor torch)
    that offers one and __dlpack__; else None."""
    if isinstance(x, np.ndarray) or is_torch(x) or not hasattr(x, "__dlpack__"):
        return None
    ns = getattr(x, "__array_namespace__", None)
    return ns() if ns is not None else None


def returns_like(index=0):
    """Decorator: the function's arrays come back in the family of its
    positional argument `index`: a foreign array with __dlpack__ and
    __array_namespace__ (CuPy, JAX, ...) gets them through that namespace's
    from_dlpack, sharing memory; numpy and torch inputs, and DLPack objects
    without a namespace, get numpy arrays or torch tensors as before."""
    def deco(f):
        @functools.wraps(f)
        def g(*args, **kwargs):
            result = f(*args, **kwargs)
            xp = _namespace_of(args[index]) if len(args) > index else None
            if xp is None:
                return result

            def back(a):
                return a if a is None or _namespace_of(a) is xp else xp.from_dlpack(a)
            return tuple(back(a) for a in result) if isinstance(result, tuple) else back(result)
        return g
    return deco


_LAYOUTS = {4: "[batch, seqlen, heads, head_dim]", 3: "[total_tokens, heads, head_dim]"}


def view(x, name, ndim, writable=False):
    """The View of x, which must have `ndim` dims, a supported dtype, a
    contiguous last dimension and non-negative strides."""
    torch = _torch()
    if torch is None or type(x) is not torch.Tensor:
        x = as_array(x, name)
    v = View()
    v.obj, v.name = x, name
    if isinstance(x, np.ndarray):
        v.family = "numpy"
        v.dtype = _numpy_dtype_code(x.dtype, name)
        shape = tuple(x.shape)
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise ValueError("%s: strides %s (bytes) are not multiples of the element size %d; "
                             "copy it with np.ascontiguousarray first" % (name, x.strides, item))
        strides = tuple(s // item for s in x.strides)
        if writable and not x.flags.writeable:
            raise ValueError("%s is read-only" % name)
        v.ptr = x.ctypes.data
        v.device, v.device_index = "cpu", None
    else:  # torch tensors have no negative strides
        if x.layout != torch.strided:
            raise TypeError("%s: %s tensors are not supported; pass a dense (strided) tensor, "
                            "e.g. .to_dense()" % (name, x.layout))
        v.family = "torch"
        v.dtype = _torch_dtype_code(torch, x.dtype, name)
        if getattr(x, "is_neg", None) is not None and x.is_neg():
            raise ValueError("%s is a lazily negated view; call .resolve_neg() first" % name)
        shape = tuple(x.shape)
        strides = x.stride()
        v.ptr = x.data_ptr()
        if x.is_cuda:
            v.device, v.device_index = "cuda", x.get_device()
        elif x.is_cpu:
            v.device, v.device_index = "cpu", None
        else:
            raise ValueError("%s is on device %s: fmha runs on cpu and cuda" % (name, x.device))
    if len(shape) != ndim:
        raise ValueError("%s must be %d-d %s, got shape %s"
                         % (name, ndim, _LAYOUTS.get(ndim, ""), list(shape)))
    # A dim of size 1 is never stepped over: its stride is whatever the
    # producer chose (numpy and torch both leave odd values there), so it is
    # normalised rather than rejected.
    if 1 in shape:
        strides = tuple(0 if n == 1 else s for n, s in zip(shape, strides))
    if 0 in shape:  # nothing is read or written: any strides do
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    if shape[-1] > 1 and strides[-1] != 1:
        fix = ".contiguous()" if v.family == "torch" else "np.ascontiguousarray(...)"
        raise ValueError("%s: the last dimension (head_dim) must be contiguous (stride 1, got "
                         "%d): fmha takes any strides for the other dimensions but this one; "
                         "call %s on it first" % (name, strides[-1], fix))
    if v.family == "numpy" and any(s < 0 for s in strides):
        raise ValueError("%s has negative strides %s (a reversed view); copy it with "
                         "np.ascontiguousarray first" % (name, list(strides)))
    v.shape = shape
    v.strides = strides[:-1] + (1,)
    return v


def same_device(*views):
    first = views[0]
    for v in views[1:]:
        if v is not None and (v.device, v.device_index) != (first.device, first.device_index):
            raise ValueError("%s is on %s but %s is on %s: all tensors must be on one device"
                             % (v.name, device_str(v), first.name, device_str(first)))


def device_str(v):
    return v.device if v.device_index is None else "%s:%d" % (v.device, v.device_index)


def empty(ref, shape, dtype=None):
    """An uninitialised array of ref's family and device: ref's dtype
    (bfloat16 for FP8 ref, as FlashAttention-3: FP8 is never an output
    dtype), or float32 when dtype == "f32"."""
    if ref.family == "numpy":
        if dtype == "f32":
            dt = np.float32
        elif ref.dtype == _lib.DTYPE_F8_E4M3:
            import ml_dtypes  # there: it made ref's dtype
            dt = ml_dtypes.bfloat16
        else:
            dt = ref.obj.dtype
        return np.empty(shape, dtype=dt)
    torch = _torch()
    if dtype == "f32":
        dt = torch.float32
    elif ref.dtype == _lib.DTYPE_F8_E4M3:
        dt = torch.bfloat16
    else:
        dt = ref.obj.dtype
    return torch.empty(shape, dtype=dt, device=ref.obj.device)


def data_ptr(x):
    """Address of a numpy array's or torch tensor's first element (None for None)."""
    if x is None:
        return None
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()


def fill(x, value):
    if isinstance(x, np.ndarray):
        x[...] = value
    else:
        x.fill_(value)


def cu_seqlens(cu, name, ref):
    """cu_seqlens as an int32 contiguous 1-d array where the kernel can read
    it: host memory for CPU runs, ref's device for CUDA runs. These are small
    index arrays, so converting or moving them is cheap (unlike K/V, which are
    never copied)."""
    if not is_torch(cu) and not isinstance(cu, np.ndarray):
        cu = as_array(cu, name) if hasattr(cu, "__dlpack__") else np.asarray(cu)
    if ref.device == "cuda":
        torch = _torch()
        t = cu if is_torch(cu) else torch.from_numpy(np.ascontiguousarray(cu))
        if t.dim() != 1:
            raise ValueError("%s must be 1-d (batch + 1 entries), got shape %s"
                             % (name, list(t.shape)))
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError("%s must hold integers (int32), got %s" % (name, t.dtype))
        t = t.to(device=ref.obj.device, dtype=torch.int32).contiguous()
        return t, t.data_ptr(), int(t.shape[0])
    if is_torch(cu):
        cu = cu.detach().cpu().numpy()
    a = np.asarray(cu)
    if a.ndim != 1:
        raise ValueError("%s must be 1-d (batch + 1 entries), got shape %s" % (name, list(a.shape)))
    if a.dtype.kind not in "iu":
        raise TypeError("%s must hold integers (int32), got %s" % (name, a.dtype))
    if a.dtype != np.int32:
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise ValueError("%s has entries outside int32" % name)
        a = a.astype(np.int32)
    a = np.ascontiguousarray(a)
    return a, a.ctypes.data, int(a.shape[0])


def descale(x, name, ref):
    """An FP8 descale as (object, its shape): contiguous float32 where the
    kernel reads it, in q's memory (ref: q's View). numpy arrays, floats and
    host __dlpack__ objects are converted (they are a few floats); a torch
    tensor must already be float32, contiguous and on q's device, since a
    copy or a host-device transfer there would hide a cost in every call."""
    if not is_torch(x) and not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        x = as_array(x, name)
    if is_torch(x):
        torch = _torch()
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise TypeError("%s must be a contiguous torch.float32 tensor, got %s%s; pass "
                            "%s.float().contiguous()"
                            % (name, x.dtype, "" if x.is_contiguous() else " (not contiguous)",
                               name))
        where = (x.device.type, x.device.index if x.is_cuda else None)
        if where != (ref.device, ref.device_index):
            raise ValueError("%s is on %s but q is on %s: descales must be in q's memory "
                             "(.to(q.device))" % (name, x.device, device_str(ref)))
        return x, tuple(x.shape)
    if ref.device == "cuda":
        raise ValueError("%s is in host memory but q is on %s: pass a float32 tensor on q's "
                         "device (torch.tensor(..., device=q.device))" % (name, device_str(ref)))
    return np.ascontiguousarray(x, dtype=np.float32), np.shape(x)  # 0-d becomes [1]


def needs_grad(*arrays):
    """True when autograd would track a call on these inputs: torch tensors
    that require grad, with grad enabled. Such calls go through the fmha::*
    torch ops (torch_ops.py), whose autograd formula is fmha's backward."""
    torch = _torch()
    if torch is None or not torch.is_grad_enabled():
        return False
    return any(is_torch(a) and a.requires_grad for a in arrays)


def lse_arg(lse, shape, ref):
    """The forward's lse as contiguous float32 in ref's memory (a numpy
    array or torch tensor), and its address. Contiguous float32 of another
    layout is not guessed at: the shape must be `shape`."""
    x = as_array(lse, "lse")
    if is_torch(x):
        torch = _torch()
        if x.dtype != torch.float32:
            raise TypeError("lse must be float32 (as the forward returns it), got %s" % x.dtype)
        where = (x.device.type, x.device.index if x.is_cuda else None)
        if where != (ref.device, ref.device_index):
            raise ValueError("lse is on %s but q is on %s" % (x.device, device_str(ref)))
        x = x.detach().contiguous()
    else:
        if x.dtype != np.float32:
            raise TypeError("lse must be float32 (as the forward returns it), got %s" % x.dtype)
        x = np.ascontiguousarray(x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError("lse has shape %s, expected %s (the forward's return_lse=True output)"
                         % (list(x.shape), list(shape)))
    return x, data_ptr(x)


def index(value, name):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError("%s must be an integer, got %r" % (name, value)) from None


INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def _bound(n):
    return {INT64_MAX: "2^63 - 1", INT64_MIN: "-2^63"}.get(n, str(n))


def int64(value, name, lo=INT64_MIN, hi=INT64_MAX):
    """value as an int in [lo, hi] (within int64): ctypes would silently wrap
    a larger Python int (2**64 + 4 becomes 4), so it is refused here. A bool
    is not an integer count."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("%s must be an integer, got the bool %r" % (name, value))
    v = index(value, name)
    if not lo <= v <= hi:
        raise ValueError("%s (%d) is out of range: it must be in [%s, %s]"
                         % (name, v, _bound(lo), _bound(hi)))
    return v


def flag(value, name):
    """A boolean option: True/False (numpy's too) or the integers 0 and 1;
    anything else (such as the string 'yes', which is truthy) is refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        if value in (0, 1):
            return bool(value)
        raise ValueError("%s must be True or False (or 0/1), got %r" % (name, value))
    raise TypeError("%s must be True or False (or 0/1), got %r" % (name, value))


def real(value, name):
    """A float option from a number; strings (float('0.5') would take them)
    and other objects are refused. Range checks are libfmha's."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (numbers.Real, np.generic)):
        torch = _torch()
        if not (torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1):
            raise TypeError("%s must be a real number, got %r" % (name, value))
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError("%s must be a real number, got %r" % (name, value)) from None
