"""_api.py — fmha's Python API: attention() and varlen_attention() on padded
[B, S, H, D] and packed [T, H, D] tensors, and the Attention layer object.
Every call validates in libfmha (the C library's messages become the
exceptions' text) and runs on the tensors' own memory, strides included."""
import collections
import contextlib
import itertools
import os
import sys
import threading
import warnings
import weakref

import numpy as np

from . import _lib
from . import _tensors as T

# ------------------------------------------------------------------ dropout seeds

# Dropout in fmha is a pure function of (seed, offset). seed=None draws a fresh
# 64-bit seed from this generator (offset is always 0), so repeated calls drop
# different elements; manual_seed() makes that sequence reproducible.
_seed_lock = threading.Lock()
_seed_rng = np.random.default_rng()


def manual_seed(seed):
    """Re-seeds the generator that dropout seeds are drawn from when a call
    passes seed=None (it starts from OS entropy)."""
    global _seed_rng
    with _seed_lock:
        _seed_rng = np.random.default_rng(seed)


def _dropout_seed(seed, dropout_p):
    if not dropout_p:
        return 0  # no dropout: the seed is not read, and no draw is spent
    if seed is None:
        with _seed_lock:
            return int(_seed_rng.integers(0, 2**64 - 1, endpoint=True, dtype=np.uint64))
    seed = T.index(seed, "seed")
    if not 0 <= seed < 2**64:
        raise ValueError("seed (%d) must be in [0, 2^64)" % seed)
    return seed


# ------------------------------------------------------------------ options


_DTYPE_CODES = {"f32": _lib.DTYPE_F32, "float32": _lib.DTYPE_F32, "float": _lib.DTYPE_F32,
                "f16": _lib.DTYPE_F16, "float16": _lib.DTYPE_F16, "half": _lib.DTYPE_F16,
                "bf16": _lib.DTYPE_BF16, "bfloat16": _lib.DTYPE_BF16,
                "f8_e4m3": _lib.DTYPE_F8_E4M3, "float8_e4m3fn": _lib.DTYPE_F8_E4M3}


def _dtype_code(dtype):
    """fmha dtype of "bf16"/"f16"/"f32"/"f8_e4m3", a numpy dtype
    (ml_dtypes.bfloat16 and float8_e4m3fn too) or a torch dtype."""
    if isinstance(dtype, str):
        key = dtype.lower()
    elif type(dtype).__module__.startswith("torch"):
        key = str(dtype).split(".")[-1]
    else:
        try:
            key = np.dtype(dtype).name
        except TypeError:
            key = None
    if key not in _DTYPE_CODES:
        raise TypeError("dtype %r is not one of float32, float16, bfloat16, float8_e4m3fn"
                        % (dtype,))
    return _DTYPE_CODES[key]


def _device(device):
    """(fmha device, CUDA device index or None) of "cpu", "cuda", "cuda:N" or
    a torch.device."""
    if device is None:
        return _lib.DEVICE_CPU, None
    s = str(device)
    kind, _, idx = s.partition(":")
    if kind == "cpu" and not idx:
        return _lib.DEVICE_CPU, None
    if kind == "cuda":
        try:
            return _lib.DEVICE_CUDA, int(idx) if idx else None
        except ValueError:
            pass
    raise ValueError("device %r is not cpu, cuda or cuda:N" % (device,))


_FP8_MODES = {None: _lib.FP8_COMPUTE_OFF, "per_tensor": _lib.FP8_COMPUTE_PER_TENSOR,
              "per_block": _lib.FP8_COMPUTE_PER_BLOCK, "int8_qk": _lib.FP8_COMPUTE_INT8_QK}


class _Options:
    """The per-layer options of fmha_config, checked here for type and for
    fitting their C fields (ctypes would wrap an int beyond int64 and take
    any truthy object as a flag), and for value by libfmha."""

    def __init__(self, causal, softmax_scale, window, softcap, dropout_p, fp8=None,
                 fp8_smooth_k=False, check_finite=False, deterministic=False):
        self.causal = T.flag(causal, "causal")
        self.deterministic = T.flag(deterministic, "deterministic")
        self.check_finite = T.flag(check_finite, "check_finite")
        if fp8 not in _FP8_MODES:
            raise ValueError("fp8 must be None, 'per_tensor', 'per_block' or 'int8_qk', got %r"
                             % (fp8,))
        self.fp8 = fp8
        self.fp8_smooth_k = T.flag(fp8_smooth_k, "fp8_smooth_k")
        if softmax_scale is None:
            self.softmax_scale = 0.0  # libfmha: 0 selects 1 / sqrt(head_dim)
        else:
            self.softmax_scale = T.real(softmax_scale, "softmax_scale")
            if self.softmax_scale == 0.0:
                raise ValueError("softmax_scale must be > 0; None selects 1/sqrt(head_dim)")
        if window is None:
            window = (-1, -1)
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError("window must be a pair (left, right), -1 = unlimited, got %r"
                             % (window,)) from None
        self.window = (T.int64(left, "window[0]"), T.int64(right, "window[1]"))
        self.softcap = 0.0 if softcap is None else T.real(softcap, "softcap")
        self.dropout_p = 0.0 if dropout_p is None else T.real(dropout_p, "dropout_p")

    def config(self, num_heads, num_kv_heads, head_dim, head_dim_v, dtype, device):
        cfg = _lib.config_init(num_heads, num_kv_heads, head_dim)
        cfg.head_dim_v = head_dim_v
        cfg.dtype = dtype
        cfg.softmax_scale = self.softmax_scale
        cfg.causal = int(self.causal)
        cfg.window_left, cfg.window_right = self.window
        cfg.softcap = self.softcap
        cfg.dropout_p = self.dropout_p
        cfg.device = device
        cfg.fp8_compute = _FP8_MODES[self.fp8]
        cfg.fp8_smooth_k = int(self.fp8_smooth_k)
        cfg.check_finite = int(self.check_finite)
        cfg.deterministic = int(self.deterministic)
        return cfg


def _cuda_context(v):
    """Makes v's CUDA device current (libfmha runs on the current device) and
    yields torch's current stream there; yields None for CPU tensors."""
    if v.device != "cuda":
        return contextlib.nullcontext(None)

    @contextlib.contextmanager
    def ctx():
        torch = sys.modules["torch"]
        with torch.cuda.device(v.device_index):
            yield torch.cuda.current_stream().cuda_stream
    return ctx()


def _device_code(v):
    return _lib.DEVICE_CUDA if v.device == "cuda" else _lib.DEVICE_CPU


# ------------------------------------------------------------------ FP8 descales

_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def _check_fp8_dtypes(qv, kv, vv):
    """FP8 q, k and v come together: one FP8 among others is refused here,
    before any descale check could blame the wrong tensor."""
    views = (qv, kv, vv)
    if any(x.dtype == _lib.DTYPE_F8_E4M3 for x in views):
        for x in views[1:]:
            if x.dtype != qv.dtype:
                raise ValueError("%s.dtype (%s) differs from q.dtype (%s): FP8 q, k and v go "
                                 "together, all float8_e4m3fn (with their descales)"
                                 % (x.name, _lib.DTYPE_NAMES[x.dtype],
                                    _lib.DTYPE_NAMES[qv.dtype]))


def _descales(given, qv, batch, num_kv_heads):
    """The descales of FP8 q, k, v (None = 1) as (objects, pointers, layout)
    for ForwardArgs; the objects must live through the call. Each is one
    value (per tensor) or [batch, num_kv_heads] (per KV head, batch = the
    number of sequences of a packed batch), all in one layout."""
    if all(d is None for d in given):
        return None
    if qv.dtype != _lib.DTYPE_F8_E4M3:
        name = next(n for n, d in zip(_DESCALE_NAMES, given) if d is not None)
        raise ValueError("%s is given, but q, k, v are %s: descales belong to FP8 "
                         "(float8_e4m3fn) inputs only; pass None"
                         % (name, _lib.DTYPE_NAMES[qv.dtype]))
    per_kv_head = (batch, num_kv_heads)
    objs, ptrs, kinds = [], [], []
    for name, d in zip(_DESCALE_NAMES, given):
        if d is None:
            objs.append(None)
            ptrs.append(None)
            continue
        obj, shape = T.descale(d, name, qv)
        shape = tuple(int(n) for n in shape)
        if len(shape) <= 2 and all(n == 1 for n in shape):
            layout = _lib.DESCALE_PER_TENSOR
        elif shape == per_kv_head:
            layout = _lib.DESCALE_PER_KV_HEAD
        else:
            raise ValueError("%s has shape %s: a descale is one value for the whole tensor "
                             "(shape (), (1,) or (1, 1)) or one per sequence and KV head, "
                             "[batch, num_kv_heads] = %s"
                             % (name, list(shape), list(per_kv_head)))
        objs.append(obj)
        ptrs.append(T.data_ptr(obj))
        kinds.append((name, shape, layout))
    if len({layout for _, _, layout in kinds}) > 1:
        raise ValueError("descales mix layouts (%s): give all of them one value each (per "
                         "tensor) or all [batch, num_kv_heads] = %s (per KV head)"
                         % (", ".join("%s %s" % (n, list(s)) for n, s, _ in kinds),
                            list(per_kv_head)))
    return objs, ptrs, kinds[0][2]


# fmha_mask_type
MASK_BOOL, MASK_ADD_F32, MASK_ADD_F16, MASK_ADD_BF16 = 0, 1, 2, 3
_MASK_TYPES = {"bool": MASK_BOOL, "float32": MASK_ADD_F32, "float16": MASK_ADD_F16,
               "bfloat16": MASK_ADD_BF16}


def _mask_arg(mask, qv, shape):
    """attn_mask (torch SDPA's: boolean, True = attend, or additive float,
    broadcastable to shape = [B, H, Sq, Sk]) as (object, _lib.AttnMask): made
    4-d, in q's memory, as bool, float32, float16 or bfloat16 (other dtypes
    become float32 copies). Strides are kept (an expanded or broadcast mask
    is read where it is, not copied); size-1 dims broadcast by stride 0."""
    if T.is_torch(mask):
        torch = T._torch()
        t = mask.detach()
        if t.dtype not in (torch.bool, torch.float32, torch.float16, torch.bfloat16):
            t = t.float()
        dev = qv.obj.device if qv.family == "torch" else torch.device("cpu")
        t = t.to(device=dev)
        kind = str(t.dtype).replace("torch.", "")
        dims, strides = tuple(t.shape), tuple(t.stride())
        obj, ptr = t, t.data_ptr()
    else:
        a = np.asarray(mask)
        if a.dtype.name not in _MASK_TYPES:
            a = a.astype(np.float32)
        if any(st < 0 or st % a.dtype.itemsize for st in a.strides):
            a = np.ascontiguousarray(a)  # reversed or unaligned views: a copy
        if qv.device != "cpu":  # into q's device memory
            return _mask_arg(T._torch().from_numpy(np.ascontiguousarray(a)), qv, shape)
        kind = a.dtype.name
        dims, strides = a.shape, tuple(st // a.dtype.itemsize for st in a.strides)
        obj, ptr = a, a.ctypes.data
    if len(dims) > 4 or len(dims) < 2:
        raise ValueError("attn_mask must be 2-d to 4-d, broadcastable to [batch, heads, seqlen_q, "
                         "seqlen_k] = %s; got shape %s" % (list(shape), list(dims)))
    pad = 4 - len(dims)
    dims, strides = (1,) * pad + tuple(dims), (0,) * pad + tuple(strides)
    for n, want, what in zip(dims, shape, ("batch", "heads", "seqlen_q", "seqlen_k")):
        if n != want and n != 1:
            raise ValueError("attn_mask has shape %s, not broadcastable to [batch, heads, "
                             "seqlen_q, seqlen_k] = %s (its %s dim is %d, want %d or 1)"
                             % (list(dims[pad:]), list(shape), what, n, want))
    m = _lib.AttnMask()
    m.data, m.type = ptr, _MASK_TYPES[kind]
    (m.stride_batch, m.stride_head, m.stride_q,
     m.stride_k) = (0 if n == 1 else st for n, st in zip(dims, strides))
    return obj, m


class _Mods:
    """The score modifiers of one call (fmha_forward_args: attn_mask, ALiBi
    slopes, sinks) in q's memory; `keep` holds the converted arrays through
    the call. batch is the number of sequences."""

    def __init__(self, attn_mask, alibi_slopes, sinks):
        self.given = (attn_mask, alibi_slopes, sinks)

    def __bool__(self):
        return any(x is not None for x in self.given)

    def fields(self, qv, batch, heads, seqlen_q, seqlen_k):
        attn_mask, alibi_slopes, sinks = self.given
        self.keep, self.mask, self.slopes, self.stride, self.sinks = [], None, None, 0, None
        if attn_mask is not None:
            if seqlen_q is None:
                raise ValueError("attn_mask is taken by padded calls; a packed batch passes none")
            obj, self.mask = _mask_arg(attn_mask, qv, (batch, heads, seqlen_q, seqlen_k))
            self.keep.append(obj)
        if alibi_slopes is not None:
            obj, self.slopes, shape = _f32_table(alibi_slopes, "alibi_slopes", qv)
            if tuple(shape) == (batch, heads) and batch > 1:
                self.stride = heads
            elif tuple(shape) not in ((heads,), (1, heads)):
                raise ValueError("alibi_slopes has shape %s: give [num_heads] = [%d] or "
                                 "[batch, num_heads] = [%d, %d] (float32)"
                                 % (list(shape), heads, batch, heads))
            self.keep.append(obj)
        if sinks is not None:
            obj, self.sinks, shape = _f32_table(sinks, "sinks", qv)
            if tuple(shape) != (heads,):
                raise ValueError("sinks has shape %s: give one logit per query head, [%d]"
                                 % (list(shape), heads))
            self.keep.append(obj)
        return self

    def apply(self, a):
        if self.mask is not None:
            a.mask = self.mask
        a.alibi_slopes, a.alibi_stride_batch, a.sinks = self.slopes, self.stride, self.sinks


_NO_MODS = _Mods(None, None, None)


# ------------------------------------------------------------------ the forward


def _run(cfg, layer, q, k, v, out, lse, seed, varlen=None, descales=None, mods=None):
    """Fills ForwardArgs from views and runs one forward, on `layer` (an
    _lib.Layer) or one-shot through fmha_forward(cfg). Returns the args."""
    a = _lib.ForwardArgs()
    a.q, a.k, a.v, a.out = q.tensor(), k.tensor(), v.tensor(), out.tensor()
    a.lse = lse
    if varlen is not None:
        (a.cu_seqlens_q, a.cu_seqlens_k, a.varlen_batch, a.max_seqlen_q,
         a.max_seqlen_k) = varlen
    if descales is not None:
        _, (a.descale_q, a.descale_k, a.descale_v), a.descale_layout = descales
    if mods:
        mods.apply(a)
    a.seed = seed
    a.offset = 0
    with _cuda_context(q) as stream:
        a.stream = stream
        if layer is not None:
            layer.forward(a)
        else:
            _lib.raise_for_status(_lib.fmha_forward(cfg, a))
    return a


def _new_layer(cfg, index):
    """A libfmha layer for cfg, made on CUDA device `index` (None: the current one)."""
    torch = T._import_torch() if cfg.device == _lib.DEVICE_CUDA and index is not None else None
    with torch.cuda.device(index) if torch is not None else contextlib.nullcontext():
        return _lib.Layer(cfg)


# The environment variables a libfmha layer reads once, at its making (fmha.h):
# a kept layer is only reused while they are unchanged.
_KNOBS = ("FMHA_CPU_ISA", "FMHA_CUDA_KERNEL", "FMHA_CUDA_SCHEDULE", "FMHA_CUDA_CLUSTER",
          "FMHA_FP8_ACCUM", "FMHA_FP8_ATTN", "FMHA_CUDA_DECODE_L2PF")
_ONESHOT_LAYERS = 32  # per thread, least recently used out first
_oneshot = threading.local()
# CPython's os.environ keeps its values in `_data` under encoded keys: reading
# that dict spares every call seven encodings of a name (about 10 us).
_ENV_DATA = getattr(os.environ, "_data", None)
_KNOB_KEYS = tuple(os.environ.encodekey(n) for n in _KNOBS) if (
    isinstance(_ENV_DATA, dict) and hasattr(os.environ, "encodekey")) else None


def _knob_values():
    if _KNOB_KEYS is not None:
        get = _ENV_DATA.get
        return tuple([get(k) for k in _KNOB_KEYS])
    return tuple(os.environ.get(n) for n in _KNOBS)


def _oneshot_layer(cfg, v):
    """The libfmha layer of a function call (attention(), varlen_attention(),
    the backward and decode functions): making one costs more than a small
    call, so each thread keeps its latest ones, keyed by the configuration,
    the device and the knobs in the environment."""
    cache = getattr(_oneshot, "layers", None)
    if cache is None:
        cache = _oneshot.layers = collections.OrderedDict()
    key = (bytes(cfg), v.device_index, _knob_values())
    layer = cache.get(key)
    if layer is not None:
        cache.move_to_end(key)
        return layer
    layer = _new_layer(cfg, v.device_index)
    cache[key] = layer
    if len(cache) > _ONESHOT_LAYERS:
        cache.popitem(last=False)
    return layer


def _out_view(out, q, shape):
    if out is None:
        obj = T.empty(q, shape)
        return obj, T.view(obj, "out", len(shape), writable=True)
    ov = T.view(out, "out", len(shape), writable=True)
    if ov.shape != tuple(shape):
        raise ValueError("out has shape %s, expected %s" % (list(ov.shape), list(shape)))
    return out, ov


def _answer_empty(cfg, q, out, lse, layer_for, sinks=None):
    """libfmha takes positive sizes only: an empty problem (no batch, no
    queries or no keys) is answered here, after the same configuration check,
    with libfmha's convention for a row that sees no key: out 0, lse -inf, or
    with sinks [H] the row's sink (lse's head axis is -2)."""
    if layer_for:
        layer_for(cfg, q)
    else:
        _lib.kernel_select(cfg)
    T.fill(out.obj, 0)
    if lse is None:
        return
    T.fill(lse, -np.inf)
    if sinks is not None and lse.shape[-1] > 0 and lse.shape[-2] > 0:
        s = np.asarray(sinks.detach().float().cpu() if T.is_torch(sinks) else sinks, np.float32)
        if s.shape != (lse.shape[-2],) or np.isnan(s).any() or (s == np.inf).any():
            raise ValueError("sinks must be [num_heads] = [%d] logits, finite or -inf"
                             % lse.shape[-2])
        if T.is_torch(lse):
            lse.copy_(T._torch().from_numpy(s)[:, None].expand(lse.shape))
        else:
            lse[...] = s[:, None]


# ------------------------------------------------------------------ torch tensors

# fmha.torch_ops once loaded (it registers the fmha::* torch ops), False where
# this torch has no torch.library.custom_op, None until torch tensors come.
_torch_ops = None


# fmha.torch_ext's compiled module where it has been built for this torch
# (attention()'s path for plain torch calls), looked for by the first eager
# torch call after the ops load (_fast_pending; never inside a torch.compile
# trace); and torch.compiler.is_compiling, which keeps it out of graphs.
_fast = None
_fast_grad = _fast_varlen_grad = None
_fast_pending = False
_compiling = None


def load_torch_ops():
    """Loads fmha.torch_ops (registering the ops) and fmha.torch_ext's module
    when built, once torch is imported and new enough; never imports torch
    itself."""
    global _torch_ops, _fast_pending, _compiling
    if _torch_ops is None and "torch" in sys.modules:
        try:
            from . import torch_ops
        except ImportError:  # torch < 2.4: no torch.library.custom_op
            _torch_ops = False
            return _torch_ops
        _torch_ops = torch_ops
        _compiling = torch_ops._is_compiling
        _fast_pending = True
    return _torch_ops


def _load_fast():
    """Sets _fast to fmha.torch_ext's module, or None where it is not built
    or does not load (a warning says why: the Python path runs every call
    then). Not inside a trace: the next eager call looks."""
    global _fast, _fast_grad, _fast_varlen_grad, _fast_pending
    if _compiling():
        return
    _fast_pending = False
    try:
        from . import torch_ext
        _fast = torch_ext.load()
        _fast_grad, _fast_varlen_grad = torch_ext.with_grad, torch_ext.varlen_with_grad
    except (ImportError, OSError) as e:
        warnings.warn("fmha: the compiled path (fmha.torch_ext) is off: %s" % e, RuntimeWarning,
                      stacklevel=4)


def _ops_for(q, out, descales):
    """fmha.torch_ops when this call runs as a torch op: torch q, no out=
    to write in place and no FP8 descales (those run directly, and cannot
    be differentiated). A plain check once the ops are loaded, so that
    torch.compile traces it."""
    ops = _torch_ops
    if ops is None:
        if not T.is_torch(q):
            return None
        ops = load_torch_ops()
    if not ops or not isinstance(q, ops.Tensor):
        return None
    if _fast_pending:
        _load_fast()
    if out is not None or any(d is not None for d in descales):
        return None
    return ops


def _refuse_grad(out, descales, *arrays, mods=_NO_MODS):
    """A call that autograd would record but that cannot run as a torch op."""
    if not T.needs_grad(*arrays, *mods.given):
        return
    if out is not None:
        raise ValueError("out= cannot be written in place by a call that autograd records "
                         "(inputs that require grad): leave out=None")
    if any(d is not None for d in descales):
        raise NotImplementedError("FP8 inputs have no backward: call fmha under "
                                  "torch.no_grad() or pass detached tensors")
    raise NotImplementedError("fmha's backward through torch needs torch >= 2.4 "
                              "(torch.library.custom_op); call fmha under torch.no_grad()")


def _torch_mods(mods):
    """The score modifiers that are torch tensors (what autograd could see)."""
    return [x for x in mods.given if T.is_torch(x)]


def _refuse_mod_grads(mods):
    """Of the score modifiers only sinks have a gradient (dsinks): a mask or
    slopes that autograd would differentiate are refused, not silently
    treated as constants."""
    for name, x in zip(("attn_mask", "alibi_slopes"), mods.given[:2]):
        if T.needs_grad(x):
            raise NotImplementedError("fmha computes no gradient for %s: pass %s.detach() (sinks "
                                      "and q, k, v get gradients)" % (name, name))


# Attention layers that torch ops run on, by the key the ops carry (an op's
# arguments are numbers and tensors, not Python objects).
_op_layers = weakref.WeakValueDictionary()
_op_layer_keys = itertools.count(1)


def _layer_key(layer_for):
    return 0 if layer_for is None else layer_for.__self__._op_key


def _padded(q, k, v, opts, out, return_lse, seed, layer_for=None, descales=(None,) * 3,
            mods=_NO_MODS):
    return_lse = T.flag(return_lse, "return_lse")
    ops = _ops_for(q, out, descales)
    if ops is None:
        _refuse_grad(out, descales, q, k, v, mods=mods)
    elif not ops.eager(q, k, v, *_torch_mods(mods)):  # eager: nothing autograd would record
        _refuse_mod_grads(mods)
        out, lse = ops.padded(q, k, v, opts, seed, _layer_key(layer_for), mods)
        return (out, lse) if return_lse else out
    return _padded_direct(q, k, v, opts, out, return_lse, seed, layer_for, descales, mods)


# Repeated calls. A model calls attention on tensors of the same shapes,
# strides, dtypes and device with the same options layer after layer; every
# such call after the first takes what the first one derived (its layer, its
# ForwardArgs with the pointers still to fill, its output's shape and dtype)
# from a per-thread table instead of checking and converting each argument
# again in Python (libfmha still validates every call). Only torch tensors
# (packed calls: int32 offsets in q's memory, their bounds in the key),
# without out=, FP8 descales or score modifiers; the Attention object (by its
# op key, never reused), lazily negated views (is_neg) and the environment's
# knobs are part of the key. Least recently used out first.
_REPEATS = 64
_repeat = threading.local()


def _repeat_key(q, k, v, opts, return_lse, layer_for):
    """The key of a padded call in the repeat table, or None for a call the
    table does not take."""
    torch = T._torch()
    if torch is None or type(q) is not torch.Tensor or type(k) is not torch.Tensor or \
            type(v) is not torch.Tensor:
        return None
    strided = torch.strided
    if q.layout is not strided or k.layout is not strided or v.layout is not strided:
        return None
    return (q.shape, q.stride(), q.dtype, q.device, q.is_neg(), k.shape, k.stride(), k.dtype,
            k.device, k.is_neg(), v.shape, v.stride(), v.dtype, v.device, v.is_neg(),
            opts.causal, opts.softmax_scale, opts.window, opts.softcap, opts.dropout_p, opts.fp8,
            opts.fp8_smooth_k, opts.check_finite, opts.deterministic, bool(return_lse),
            _layer_key(layer_for), _knob_values())


def _repeat_key_packed(q, k, v, cuq, cuk, max_q, max_k, opts, return_lse, layer_for):
    """_repeat_key of a packed call: its offsets int32 torch tensors, contiguous,
    in q's memory (as libfmha reads them, no conversion), else None."""
    key = _repeat_key(q, k, v, opts, return_lse, layer_for)
    if key is None or type(cuq) is not type(q) or type(cuk) is not type(q):
        return None
    i32 = sys.modules["torch"].int32
    if cuq.dtype is not i32 or cuk.dtype is not i32 or cuq.device != q.device or \
            cuk.device != q.device or not cuq.is_contiguous() or not cuk.is_contiguous():
        return None
    if not all(m is None or type(m) is int for m in (max_q, max_k)):
        return None
    return key + (cuq.shape, cuq.is_neg(), cuk.shape, cuk.is_neg(), max_q, max_k)


def _repeat_run(entry, q, k, v, opts, seed, cu=None):
    """A call of the repeat table: (out, lse or None); cu: a packed call's
    (cu_seqlens_q, cu_seqlens_k)."""
    torch = sys.modules["torch"]
    layer, args, out_shape, out_dtype, lse_shape = entry
    dev = q.device
    out = torch.empty(out_shape, dtype=out_dtype, device=dev)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=dev) if lse_shape else None
    a = _lib.ForwardArgs.from_buffer_copy(args)
    a.q.data, a.k.data, a.v.data = q.data_ptr(), k.data_ptr(), v.data_ptr()
    a.out.data = out.data_ptr()
    a.lse = lse.data_ptr() if lse is not None else None
    a.seed = _dropout_seed(seed, opts.dropout_p)
    if cu is not None:
        a.cu_seqlens_q, a.cu_seqlens_k = cu[0].data_ptr(), cu[1].data_ptr()
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            a.stream = torch.cuda.current_stream().cuda_stream
            layer.forward(a)
    else:
        layer.forward(a)
    return out, lse


def _repeat_entry(key, layer_for):
    """(this thread's repeat table, key's entry or None); a found entry becomes
    the most recent, and an Attention's latest layer, as _layer_for sets it."""
    table = getattr(_repeat, "calls", None)
    if table is None:
        table = _repeat.calls = collections.OrderedDict()
    entry = table.get(key) if key is not None else None
    if entry is not None:
        table.move_to_end(key)
        if layer_for is not None:
            layer_for.__self__._last = entry[0]
    return table, entry


def _repeat_add(table, key, layer, args, out, lse):
    """Enters a call that has run into the repeat table."""
    table[key] = (layer, bytes(args), tuple(out.shape), out.dtype,
                  tuple(lse.shape) if lse is not None else None)
    if len(table) > _REPEATS:
        table.popitem(last=False)


def _padded_direct(q, k, v, opts, out, return_lse, seed, layer_for=None, descales=(None,) * 3,
                   mods=_NO_MODS):
    """attention() on q's own memory through ctypes (the body of fmha::fwd)."""
    key = None
    if out is None and not mods and all(d is None for d in descales):
        key = _repeat_key(q, k, v, opts, return_lse, layer_for)
        table, entry = _repeat_entry(key, layer_for)
        if entry is not None:
            out, lse = _repeat_run(entry, q, k, v, opts, seed)
            return (out, lse) if return_lse else out
    qv, kv, vv = T.view(q, "q", 4), T.view(k, "k", 4), T.view(v, "v", 4)
    T.same_device(qv, kv, vv)
    _check_fp8_dtypes(qv, kv, vv)
    B, Sq, H, D = qv.shape
    Sk, Hkv, Dv = kv.shape[1], kv.shape[2], vv.shape[3]
    descales = _descales(descales, qv, B, Hkv)
    out, ov = _out_view(out, qv, (B, Sq, H, Dv))
    T.same_device(qv, ov)
    lse = T.empty(qv, (B, H, Sq), "f32") if return_lse else None
    cfg = opts.config(H, Hkv, D, Dv, qv.dtype, _device_code(qv))
    seed = _dropout_seed(seed, opts.dropout_p)
    if B == 0 or Sq == 0 or Sk == 0:
        if kv.shape[0] != B or vv.shape[0] != B or vv.shape[1] != Sk:
            raise ValueError("batch or seqlen differ: q %s, k %s, v %s"
                             % (list(qv.shape), list(kv.shape), list(vv.shape)))
        _answer_empty(cfg, qv, ov, lse, layer_for, mods.given[2])
    else:
        if mods:
            mods = mods.fields(qv, B, H, Sq, Sk)
        layer = (layer_for or _oneshot_layer)(cfg, qv)
        a = _run(cfg, layer, qv, kv, vv, ov, T.data_ptr(lse), seed, descales=descales, mods=mods)
        if key is not None:
            _repeat_add(table, key, layer, a, out, lse)
    del descales, mods  # the arrays (maybe converted copies) lived through the call
    return (out, lse) if return_lse else out


def _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, out,
            return_lse, seed, layer_for=None, descales=(None,) * 3, mods=_NO_MODS):
    return_lse = T.flag(return_lse, "return_lse")
    ops = _ops_for(q, out, descales)
    if ops is not None and not ops.eager(q, k, v, *_torch_mods(mods)):
        _refuse_mod_grads(mods)
        out, lse = ops.packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              opts, seed, _layer_key(layer_for), mods)
        return (out, lse) if return_lse else out
    _refuse_grad(out, descales, q, k, v, mods=mods)
    return _packed_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts,
                          out, return_lse, seed, layer_for, descales, mods)


def _packed_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, out,
                   return_lse, seed, layer_for=None, descales=(None,) * 3, mods=_NO_MODS):
    """varlen_attention() through ctypes (the body of fmha::varlen_fwd)."""
    key = None
    if out is None and not mods and all(d is None for d in descales):
        key = _repeat_key_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 opts, return_lse, layer_for)
        table, entry = _repeat_entry(key, layer_for)
        if entry is not None:
            out, lse = _repeat_run(entry, q, k, v, opts, seed, (cu_seqlens_q, cu_seqlens_k))
            return (out, lse) if return_lse else out
    qv, kv, vv = T.view(q, "q", 3), T.view(k, "k", 3), T.view(v, "v", 3)
    T.same_device(qv, kv, vv)
    _check_fp8_dtypes(qv, kv, vv)
    Tq, H, D = qv.shape
    Tk, Hkv, Dv = kv.shape[0], kv.shape[1], vv.shape[2]
    cuq, cuq_ptr, nq = T.cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qv)
    cuk, cuk_ptr, nk = T.cu_seqlens(cu_seqlens_k, "cu_seqlens_k", qv)
    if nq != nk or nq < 2:
        # libfmha reads batch + 1 entries of both: lengths are checked here.
        raise ValueError("cu_seqlens_q (%d entries) and cu_seqlens_k (%d entries) must both "
                         "hold batch + 1 >= 2 entries" % (nq, nk))
    descales = _descales(descales, qv, nq - 1, Hkv)
    max_q = 0 if max_seqlen_q is None else T.int64(max_seqlen_q, "max_seqlen_q")
    max_k = 0 if max_seqlen_k is None else T.int64(max_seqlen_k, "max_seqlen_k")
    out, ov = _out_view(out, qv, (Tq, H, Dv))
    T.same_device(qv, ov)
    lse = T.empty(qv, (H, Tq), "f32") if return_lse else None
    cfg = opts.config(H, Hkv, D, Dv, qv.dtype, _device_code(qv))
    seed = _dropout_seed(seed, opts.dropout_p)
    if Tq == 0 or Tk == 0:
        _answer_empty(cfg, qv, ov, lse, layer_for, mods.given[2])
    else:
        if mods:
            mods = mods.fields(qv, nq - 1, H, None, None)
        layer = (layer_for or _oneshot_layer)(cfg, qv)
        a = _run(cfg, layer, qv, kv, vv, ov, T.data_ptr(lse), seed,
                 varlen=(cuq_ptr, cuk_ptr, nq - 1, max_q, max_k), descales=descales, mods=mods)
        if key is not None:
            _repeat_add(table, key, layer, a, out, lse)
    # the index, descale and modifier arrays (maybe converted copies) lived through the call
    del cuq, cuk, descales, mods
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------ the backward


def _backward_seed(seed, dropout_p):
    """The forward's dropout seed, which the backward needs to draw the same
    mask again: it cannot be drawn here."""
    if not dropout_p:
        return 0
    if seed is None:
        raise ValueError("dropout_p > 0: the backward needs the seed the forward used (pass "
                         "seed=... to both; a forward with seed=None draws one it does not "
                         "return)")
    seed = T.index(seed, "seed")
    if not 0 <= seed < 2**64:
        raise ValueError("seed (%d) must be in [0, 2^64)" % seed)
    return seed


def _grad_views(given, need, refs):
    """(objects, views) of dq, dk, dv: `given` arrays written in place, else
    new ones of q's type and dtype; None where not needed."""
    objs, views = [], []
    for name, g, wanted, ref in zip(("dq", "dk", "dv"), given, need, refs):
        if not wanted:
            objs.append(None)
            views.append(None)
            continue
        if g is None:
            g = T.empty(ref, ref.shape)
        gv = T.view(g, name, len(ref.shape), writable=True)
        if gv.shape != ref.shape:
            raise ValueError("%s has shape %s, expected %s (%s's)"
                             % (name, list(gv.shape), list(ref.shape), ref.name))
        T.same_device(ref, gv)
        objs.append(g)
        views.append(gv)
    return objs, views


def _run_backward(cfg, layer, views, lse_ptr, grads, seed, varlen=None, mods=None,
                  dsinks=None):
    """Fills BackwardArgs and runs one backward, on `layer` or one-shot."""
    qv, kv, vv, ov, gv = views
    a = _lib.BackwardArgs()
    if mods:
        mods.apply(a)
        a.dsinks = dsinks
    a.q, a.k, a.v, a.out, a.dout = qv.tensor(), kv.tensor(), vv.tensor(), ov.tensor(), gv.tensor()
    a.lse = lse_ptr
    a.dq, a.dk, a.dv = (g.tensor() if g is not None else _lib.Tensor() for g in grads)
    if varlen is not None:
        (a.cu_seqlens_q, a.cu_seqlens_k, a.varlen_batch, a.max_seqlen_q,
         a.max_seqlen_k) = varlen
    a.seed = seed
    a.offset = 0
    with _cuda_context(qv) as stream:
        a.stream = stream
        if layer is not None:
            layer.backward(a)
        else:
            _lib.raise_for_status(_lib.fmha_backward(cfg, a))


def _dsinks(mods, qv, heads):
    """(array, pointer) for the sinks' gradient [heads] float32 where the
    call has sinks, else (None, None)."""
    if not mods or mods.given[2] is None:
        return None, None
    d = T.empty(qv, (heads,), "f32")
    return d, T.data_ptr(d)


def _padded_backward(dout, q, k, v, out, lse, opts, seed, given=(None,) * 3, need=(True,) * 3,
                     layer_for=None, mods=_NO_MODS):
    qv, kv, vv = T.view(q, "q", 4), T.view(k, "k", 4), T.view(v, "v", 4)
    ov, gv = T.view(out, "out", 4), T.view(dout, "dout", 4)
    T.same_device(qv, kv, vv, ov, gv)
    B, Sq, H, D = qv.shape
    Sk, Hkv, Dv = kv.shape[1], kv.shape[2], vv.shape[3]
    lse, lse_ptr = T.lse_arg(lse, (B, H, Sq), qv)
    objs, grads = _grad_views(given, need, (qv, kv, vv))
    cfg = opts.config(H, Hkv, D, Dv, qv.dtype, _device_code(qv))
    seed = _backward_seed(seed, opts.dropout_p)
    if mods:
        mods = mods.fields(qv, B, H, Sq, Sk)
    dsinks, dsinks_ptr = _dsinks(mods, qv, H)
    layer = (layer_for or _oneshot_layer)(cfg, qv)
    _run_backward(cfg, layer, (qv, kv, vv, ov, gv), lse_ptr, grads, seed, mods=mods,
                  dsinks=dsinks_ptr)
    del lse, mods  # converted copies lived through the call
    return tuple(objs) + ((dsinks,) if dsinks is not None else ())


def _packed_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, opts, seed, given=(None,) * 3, need=(True,) * 3,
                     layer_for=None, mods=_NO_MODS):
    qv, kv, vv = T.view(q, "q", 3), T.view(k, "k", 3), T.view(v, "v", 3)
    ov, gv = T.view(out, "out", 3), T.view(dout, "dout", 3)
    T.same_device(qv, kv, vv, ov, gv)
    Tq, H, D = qv.shape
    Hkv, Dv = kv.shape[1], vv.shape[2]
    cuq, cuq_ptr, nq = T.cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qv)
    cuk, cuk_ptr, nk = T.cu_seqlens(cu_seqlens_k, "cu_seqlens_k", qv)
    if nq != nk or nq < 2:
        raise ValueError("cu_seqlens_q (%d entries) and cu_seqlens_k (%d entries) must both "
                         "hold batch + 1 >= 2 entries" % (nq, nk))
    max_q = 0 if max_seqlen_q is None else T.int64(max_seqlen_q, "max_seqlen_q")
    max_k = 0 if max_seqlen_k is None else T.int64(max_seqlen_k, "max_seqlen_k")
    lse, lse_ptr = T.lse_arg(lse, (H, Tq), qv)
    objs, grads = _grad_views(given, need, (qv, kv, vv))
    cfg = opts.config(H, Hkv, D, Dv, qv.dtype, _device_code(qv))
    seed = _backward_seed(seed, opts.dropout_p)
    if mods:
        mods = mods.fields(qv, nq - 1, H, None, None)
    dsinks, dsinks_ptr = _dsinks(mods, qv, H)
    layer = (layer_for or _oneshot_layer)(cfg, qv)
    _run_backward(cfg, layer, (qv, kv, vv, ov, gv), lse_ptr, grads, seed,
                  varlen=(cuq_ptr, cuk_ptr, nq - 1, max_q, max_k), mods=mods, dsinks=dsinks_ptr)
    del lse, cuq, cuk, mods  # converted copies lived through the call
    return tuple(objs) + ((dsinks,) if dsinks is not None else ())


@T.returns_like()
def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       window=(-1, -1), softcap=0.0, dropout_p=0.0, seed=None,
                       deterministic=False, dq=None, dk=None, dv=None, attn_mask=None,
                       alibi_slopes=None, sinks=None):
    """The gradients of attention(): (dq, dk, dv) of sum(dout * out).

    q, k, v and the options are the forward's; out and lse [B, H, Sq] float32
    are what it returned (return_lse=True); dout [B, Sq, H, Dv] is the
    gradient of out, in any dtype. With dropout the forward's `seed` is
    required (the mask is drawn again, never stored). dq, dk, dv may be given
    to be written in place (float32, float16 or bfloat16, any strides with
    the last dim contiguous); else they are new arrays of q's type, dtype and
    device. With GQA/MQA dk and dv are summed over each KV head's query
    heads. The CPU computes in float32 and is deterministic; f16/bf16 CUDA
    tensors run the portable CUDA backward; FP8 inputs raise UnsupportedError.
    attn_mask, alibi_slopes and sinks are the forward's; with sinks the
    result is (dq, dk, dv, dsinks), dsinks [H] float32 the sinks' gradient.
    """
    opts = _Options(causal, softmax_scale, window, softcap, dropout_p,
                    deterministic=deterministic)
    return _padded_backward(dout, q, k, v, out, lse, opts, seed, (dq, dk, dv),
                            mods=_Mods(attn_mask, alibi_slopes, sinks))


@T.returns_like()
def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, *, causal=False, softmax_scale=None,
                              window=(-1, -1), softcap=0.0, dropout_p=0.0, seed=None,
                              deterministic=False, dq=None, dk=None, dv=None, alibi_slopes=None,
                              sinks=None):
    """attention_backward() for varlen_attention(): packed q, k, v, out, dout
    [total, H, D], lse [H, total_q]. Tokens in no sequence get zero gradients.
    alibi_slopes and sinks as in attention_backward() (dsinks last)."""
    opts = _Options(causal, softmax_scale, window, softcap, dropout_p,
                    deterministic=deterministic)
    return _packed_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, opts, seed, (dq, dk, dv),
                            mods=_Mods(None, alibi_slopes, sinks))


def attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
              dropout_p=0.0, seed=None, return_lse=False, out=None, q_descale=None,
              k_descale=None, v_descale=None, attn_mask=None, alibi_slopes=None, sinks=None):
    """out = softmax(softmax_scale * q k^T + mask) v for a padded batch.

    q [B, Sq, H, D]; k [B, Sk, Hkv, D]; v [B, Sk, Hkv, Dv]; H a multiple of
    Hkv (GQA/MQA without copies). Any strides, but the last dim contiguous
    (so BSHD tensors and BHSD views such as x.transpose(1, 2) both work).
    numpy arrays (float32, float16, ml_dtypes.bfloat16), torch tensors on
    CPU or CUDA, or anything with __dlpack__.

    causal / window: bottom-right aligned (flash-attn): key j is visible to
    query i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, -1 =
    unlimited, causal means right = 0. softcap > 0 turns scores into
    softcap * tanh(score / softcap). dropout_p drops probabilities with
    Philox keyed by `seed` (None: drawn, see manual_seed).

    FP8 (FlashAttention-3's interface): q, k and v all float8_e4m3fn
    (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn), element x standing for
    x * its descale. q_descale, k_descale, v_descale are None (= 1) or
    float32 in q's memory (numpy arrays or floats for CPU runs, a tensor on
    q's device for CUDA): one value for the tensor (shape (), (1,) or
    (1, 1)), or [B, Hkv], one per sequence and KV head (query head h uses
    its KV head's, h // (H / Hkv)); all given ones in one layout. The CPU
    dequantizes exactly and computes in float32; CUDA needs a Hopper GPU.

    Returns out [B, Sq, H, Dv] (q's dtype, family and device, bfloat16 for
    FP8 q; or `out`, written in place, float32, float16 or bfloat16), or
    (out, lse) with lse [B, H, Sq] float32 (natural log; -inf for rows that
    see no key). Every function here returns arrays of q's family: a
    foreign array with __dlpack__ and __array_namespace__ (CuPy, JAX) gets
    its own type back (that namespace's from_dlpack, sharing memory).

    Score modifiers (CPU, and f16/bf16 CUDA forwards): attn_mask as torch
    SDPA's, broadcastable to [B, H, Sq, Sk] — boolean (True = attend) or
    float added to the scaled scores (after softcap); alibi_slopes [H] or
    [B, H] float32, adding -slope * |i + Sk - Sq - j| (flash-attn's ALiBi);
    sinks [H] float32, one logit per head in every row's softmax for a key
    of value 0 (lse counts it). A row whose every key is hidden gets out 0
    and lse -inf (SDPA gives NaN). Through torch autograd, q, k, v and sinks
    get gradients (dsinks); a mask or slopes that require grad raise
    NotImplementedError (fmha computes no gradient for them).
    """
    fast = _fast
    if fast is not None and out is None and q_descale is None and k_descale is None and \
            v_descale is None and attn_mask is None and alibi_slopes is None and sinks is None \
            and (dropout_p is None or (type(dropout_p) in (float, int) and dropout_p == 0)) \
            and not _compiling():
        res = fast.attention(q, k, v, causal, softmax_scale, window, softcap, return_lse, None)
        if res is False:  # autograd records it
            res = _fast_grad(q, k, v, causal, softmax_scale, window, softcap, return_lse)
        if res is not None:
            return res
    return _attention(q, k, v, causal, softmax_scale, window, softcap, dropout_p, seed,
                      return_lse, out, (q_descale, k_descale, v_descale),
                      _Mods(attn_mask, alibi_slopes, sinks))


@T.returns_like()
def _attention(q, k, v, causal, softmax_scale, window, softcap, dropout_p, seed, return_lse, out,
               descales, mods):
    opts = _Options(causal, softmax_scale, window, softcap, dropout_p)
    return _padded(q, k, v, opts, out, return_lse, seed, descales=descales, mods=mods)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                     dropout_p=0.0, seed=None, return_lse=False, out=None, q_descale=None,
                     k_descale=None, v_descale=None, alibi_slopes=None, sinks=None):
    """attention() for a packed batch of variable-length sequences.

    q [total_q, H, D]; k [total_k, Hkv, D]; v [total_k, Hkv, Dv]; sequence b
    owns q tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]) and k/v tokens
    [cu_seqlens_k[b], cu_seqlens_k[b+1]) (int32, batch + 1 entries, empty
    sequences allowed). max_seqlen_q/k bound the lengths (0 or None: fmha
    computes them). Masks apply per sequence. FP8 inputs and descales as in
    attention(), per-KV-head descales [batch, Hkv] with batch the number of
    sequences. alibi_slopes ([H] or [batch, H]) and sinks ([H]) as in
    attention(), per sequence. Returns out [total_q, H, Dv] or (out, lse)
    with lse [H, total_q] float32.
    """
    fast = _fast
    if fast is not None and out is None and q_descale is None and k_descale is None and \
            v_descale is None and alibi_slopes is None and sinks is None \
            and (dropout_p is None or (type(dropout_p) in (float, int) and dropout_p == 0)) \
            and not _compiling():
        res = fast.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale, window, softcap,
                                    return_lse, None)
        if res is False:  # autograd records it
            res = _fast_varlen_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale, window, softcap,
                                    return_lse)
        if res is not None:
            return res
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             causal, softmax_scale, window, softcap, dropout_p, seed, return_lse,
                             out, (q_descale, k_descale, v_descale),
                             _Mods(None, alibi_slopes, sinks))


@T.returns_like()
def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                      softmax_scale, window, softcap, dropout_p, seed, return_lse, out, descales,
                      mods):
    opts = _Options(causal, softmax_scale, window, softcap, dropout_p)
    return _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, out,
                   return_lse, seed, descales=descales, mods=mods)


# ------------------------------------------------------------------ the layer


def _int32_array(x, name, ref, ndim):
    """An index array (cache_seqlens, cache_batch_idx, block_table) as
    contiguous int32 where libfmha reads it (T.cu_seqlens' rules), with its
    shape; a Python int for a 1-d one is broadcast by the caller."""
    shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
    if len(shape) != ndim:
        raise ValueError("%s must be %d-d, got shape %s" % (name, ndim, list(shape)))
    flat = x.reshape(-1) if hasattr(x, "reshape") else np.asarray(x).reshape(-1)
    obj, ptr, _ = T.cu_seqlens(flat, name, ref)
    return obj, ptr, shape


def _f32_table(x, name, ref):
    """A small float table (rotary cos / sin, descales) as contiguous
    float32 in q's memory (moved there where it is elsewhere)."""
    if ref.device == "cuda":
        torch = T._torch()
        t = x if T.is_torch(x) else torch.from_numpy(np.asarray(x, dtype=np.float32))
        t = t.detach().to(device=ref.obj.device, dtype=torch.float32).contiguous()
        return t, T.data_ptr(t), tuple(t.shape)
    if T.is_torch(x):
        t = x.detach().float().contiguous().cpu().numpy()
        return t, T.data_ptr(t), tuple(t.shape)
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    return a, a.ctypes.data, a.shape


# fmha_kv_descale_layout
KV_DESCALE_PER_TENSOR, KV_DESCALE_PER_HEAD, KV_DESCALE_PER_PAGE = 0, 1, 2


def _cache_descales(k_descale, v_descale, kcv, qv, keep):
    """FP8 caches' descales into args form: (k pointer, v pointer, layout).
    A number or one entry: per tensor; [Hkv]: per KV head; [pages or cache
    rows, Hkv]: per page (per cache row of a contiguous cache)."""
    if k_descale is None and v_descale is None:
        return None, None, 0
    if k_descale is None or v_descale is None:
        raise ValueError("k_descale and v_descale must be given together (FP8 caches)")
    pages, hkv = kcv.shape[0], kcv.shape[2]
    out, layouts = [], []
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if isinstance(x, (int, float)):
            x = [float(x)]
        obj, ptr, shape = _f32_table(x, name, qv)
        if int(np.prod(shape)) == 1:
            layouts.append(KV_DESCALE_PER_TENSOR)
        elif tuple(shape) == (hkv,):
            layouts.append(KV_DESCALE_PER_HEAD)
        elif tuple(shape) == (pages, hkv):
            layouts.append(KV_DESCALE_PER_PAGE)
        else:
            raise ValueError("%s has shape %s: give one descale, [num_kv_heads] = [%d], or "
                             "[pages or cache rows, num_kv_heads] = [%d, %d]"
                             % (name, list(shape), hkv, pages, hkv))
        keep.append(obj)
        out.append(ptr)
    if layouts[0] != layouts[1]:
        raise ValueError("k_descale and v_descale must have one layout (both per tensor, per "
                         "head or per page)")
    return out[0], out[1], layouts[0]


def _decode(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            block_table, opts, rotary_interleaved, num_splits, out, return_lse, layer_for=None,
            k_descale=None, v_descale=None, max_seqlen_k=None, alibi_slopes=None, sinks=None):
    return_lse = T.flag(return_lse, "return_lse")
    if T.needs_grad(q, k_cache, v_cache, k, v):
        raise NotImplementedError("decode has no backward: call it under torch.no_grad() or "
                                  "pass tensors that do not require grad")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    qv = T.view(q, "q", 4)
    kcv = T.view(k_cache, "k_cache", 4, writable=k is not None)
    vcv = T.view(v_cache, "v_cache", 4, writable=k is not None)
    knv = T.view(k, "k", 4) if k is not None else None
    vnv = T.view(v, "v", 4) if v is not None else None
    T.same_device(qv, kcv, vcv, knv, vnv)
    B, Sq, H, D = qv.shape
    Hkv, Dv = kcv.shape[2], vcv.shape[3]
    out, ov = _out_view(out, qv, (B, Sq, H, Dv))
    T.same_device(qv, ov)
    lse = T.empty(qv, (B, H, Sq), "f32") if return_lse else None
    a = _lib.KvcacheArgs()
    a.q, a.k_cache, a.v_cache, a.out = qv.tensor(), kcv.tensor(), vcv.tensor(), ov.tensor()
    if knv is not None:
        a.k_new, a.v_new = knv.tensor(), vnv.tensor()
    a.lse = T.data_ptr(lse)
    keep = []  # converted index arrays and tables: alive through the call
    if cache_seqlens is not None:
        if isinstance(cache_seqlens, (int, np.integer)):
            cache_seqlens = np.full(B, int(cache_seqlens), dtype=np.int64)
        obj, a.cache_seqlens, shape = _int32_array(cache_seqlens, "cache_seqlens", qv, 1)
        if shape[0] != B:
            raise ValueError("cache_seqlens has %d entries for a batch of %d" % (shape[0], B))
        keep.append(obj)
    if cache_batch_idx is not None:
        obj, a.cache_batch_idx, shape = _int32_array(cache_batch_idx, "cache_batch_idx", qv, 1)
        if shape[0] != B:
            raise ValueError("cache_batch_idx has %d entries for a batch of %d" % (shape[0], B))
        keep.append(obj)
    if block_table is not None:
        obj, a.block_table, shape = _int32_array(block_table, "block_table", qv, 2)
        if shape[0] != B:
            raise ValueError("block_table has %d rows for a batch of %d" % (shape[0], B))
        a.block_table_stride = shape[1]
        keep.append(obj)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        cos, a.rotary_cos, cshape = _f32_table(rotary_cos, "rotary_cos", qv)
        sin, a.rotary_sin, sshape = _f32_table(rotary_sin, "rotary_sin", qv)
        if len(cshape) != 2 or cshape != sshape:
            raise ValueError("rotary_cos and rotary_sin must both be [rotary_len, rotary_dim / 2], "
                             "got %s and %s" % (list(cshape), list(sshape)))
        a.rotary_len, a.rotary_dim = cshape[0], 2 * cshape[1]
        a.rotary_interleaved = int(T.flag(rotary_interleaved, "rotary_interleaved"))
        keep += [cos, sin]
    a.num_splits = 0 if num_splits is None else T.int64(num_splits, "num_splits")
    a.k_descale, a.v_descale, a.kv_descale_layout = _cache_descales(k_descale, v_descale, kcv,
                                                                    qv, keep)
    a.max_seqlen_k = 0 if max_seqlen_k is None else T.int64(max_seqlen_k, "max_seqlen_k")
    mods = _Mods(None, alibi_slopes, sinks)
    if mods:
        mods.fields(qv, B, H, None, None).apply(a)
        keep += mods.keep
    cfg = opts.config(H, Hkv, D, Dv, qv.dtype, _device_code(qv))
    with _cuda_context(qv) as stream:
        a.stream = stream
        (layer_for or _oneshot_layer)(cfg, qv).decode(a)
    del keep
    return (out, lse) if return_lse else out


@T.returns_like()
def kvcache_attention(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                      cache_batch_idx=None, block_table=None, rotary_cos=None, rotary_sin=None,
                      rotary_interleaved=True, causal=False, softmax_scale=None,
                      window=(-1, -1), softcap=0.0, num_splits=0, return_lse=False, out=None,
                      k_descale=None, v_descale=None, max_seqlen_k=None, alibi_slopes=None,
                      sinks=None):
    """Decode: new queries q [B, Sq, H, D] against KV caches, as
    flash_attn_with_kvcache (fmha_decode in C).

    k_cache / v_cache: [B_cache, capacity, Hkv, D / Dv] (row cache_batch_idx[b],
    default b, for sequence b), or with block_table [B, max_pages] int32 a
    page pool [num_pages, page_size, Hkv, D / Dv]. cache_seqlens (an int or
    [B] integers; None = every cache full) is the tokens each sequence has
    cached; k / v [B, Snew, Hkv, D / Dv], when given, are written into the
    caches after them (in place) and attended to. rotary_cos / rotary_sin
    [rotary_len, rotary_dim / 2] rotate the new keys at their positions and
    q (at cache_seqlens + i when causal or windowed, else at cache_seqlens);
    rotary_interleaved pairs channels (2i, 2i + 1) instead of (i, i + D/2).
    Masks are aligned bottom-right as in attention(). num_splits: key splits
    per sequence (0: chosen by fmha). CPU arrays and tensors, or CUDA tensors
    (f16/bf16; index arrays and rotary tables are moved to q's device).

    FP8 caches (float8_e4m3fn, q in its own f32/f16/bf16): element x stands
    for x * descale, with k_descale / v_descale one number, [Hkv] (per KV
    head) or [pages or cache rows, Hkv] (per page); new k / v are written as
    codes of value / descale (saturating at 448 x descale).

    max_seqlen_k: a bound on every sequence's keys (cached plus new). On
    CUDA it spares the call its host copy of cache_seqlens and the block
    table (no synchronisation, as CUDA-graph capture needs): the kernels check
    those arrays, and a sequence whose entries are wrong comes out NaN
    (fmha.h says which). On the CPU a sequence past it is refused.

    alibi_slopes ([H] or [B, H] float32) and sinks ([H]) as in attention()
    (CPU), each key at its distance from the query's place in the cache.

    Returns out [B, Sq, H, Dv], or (out, lse [B, H, Sq] float32)."""
    opts = _Options(causal, softmax_scale, window, softcap, 0.0)
    return _decode(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, block_table, opts, rotary_interleaved, num_splits, out,
                   return_lse, k_descale=k_descale, v_descale=v_descale,
                   max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes, sinks=sinks)


class Attention:
    """An attention layer of a model: its head counts, head size and options
    are fixed and validated at construction, so a bad GQA shape fails here:

        Attention(28, 128, num_kv_heads=6)
        ValueError: num_heads (28) must be a multiple of num_kv_heads (6): ...

    libfmha layers (kernel choice and workspace) are built per (dtype,
    device, value head dim) on first use and reused. `dtype`/`device` given
    here build that layer at once (and check that the device can run it).

    fp8="per_tensor" (or "per_block": one scale per 128 tokens of a head)
    quantizes q, k, v to FP8 E4M3 on every call and runs FP8 attention,
    fp8="int8_qk" q and k to INT8 instead (K smoothed, q and k rotated; the
    accurate mode, Hopper GPUs: FMHA_FP8_COMPUTE_INT8_QK in fmha.h),
    writing out in q's dtype; where no FP8 kernel takes the configuration the
    layer runs q's dtype instead and warns once (RuntimeWarning) with
    libfmha's reason. `fp8_path` tells which path the latest layer took.
    Inputs already in FP8 (float8_e4m3fn, with their descales) need no
    `fp8`: forward() takes them as attention() does, out bfloat16.
    fp8_smooth_k=True subtracts K's per-channel mean before quantizing (the
    softmax ignores it; the LSE is corrected), which keeps channels with a
    large common offset from spoiling K's quantization; it needs softcap 0.
    check_finite=True makes every call read q, k and v first and raise
    ValueError on NaN or inf, naming the tensor and the first index.
    """

    def __init__(self, num_heads, head_size, softmax_scale=None, causal=False, num_kv_heads=None,
                 dropout_p=0.0, *, window=(-1, -1), softcap=0.0, dtype=None, device=None,
                 fp8=None, fp8_smooth_k=False, check_finite=False, deterministic=False):
        self.num_heads = T.int64(num_heads, "num_heads")
        self.head_size = T.int64(head_size, "head_size")
        self.num_kv_heads = (self.num_heads if num_kv_heads is None
                             else T.int64(num_kv_heads, "num_kv_heads"))
        self._opts = _Options(causal, softmax_scale, window, softcap, dropout_p, fp8, fp8_smooth_k,
                              check_finite, deterministic)
        self._layers = {}
        self._lock = threading.Lock()
        self._last = None
        # The compiled path (fmha.torch_ext) takes forward() and
        # forward_varlen() where these options let it: their arguments there,
        # the shape the tensors must have, and the latest such call's dtype,
        # device and head_dim_v (for kernel and fp8_path, resolved by _latest).
        o = self._opts
        self._fast_args = ((o.causal, o.softmax_scale or None, o.window, o.softcap)
                           if o.fp8 is None and not o.dropout_p and not o.check_finite else None)
        self._shape = (self.num_heads, self.num_kv_heads, self.head_size)
        self._fast_call = None
        self._op_key = next(_op_layer_keys)
        _op_layers[self._op_key] = self
        # The shape check, on the configuration that runs anywhere (bf16, CPU).
        _lib.kernel_select(self._config(_lib.DTYPE_BF16, _lib.DEVICE_CPU, self.head_size))
        self._default = None
        if dtype is not None or device is not None:
            code = _dtype_code(dtype if dtype is not None else "bf16")
            dev, idx = _device(device)
            self._default = self._layer(code, dev, idx, self.head_size)

    # options, read-only
    causal = property(lambda self: self._opts.causal)
    softmax_scale = property(lambda self: self._opts.softmax_scale or self.head_size ** -0.5)
    window = property(lambda self: self._opts.window)
    softcap = property(lambda self: self._opts.softcap)
    dropout_p = property(lambda self: self._opts.dropout_p)
    fp8 = property(lambda self: self._opts.fp8)
    fp8_smooth_k = property(lambda self: self._opts.fp8_smooth_k)
    check_finite = property(lambda self: self._opts.check_finite)
    deterministic = property(lambda self: self._opts.deterministic)

    @property
    def fp8_path(self):
        """(path, reason) of the latest libfmha layer (fmha_layer_get_path):
        path is "direct", "fp8" or "fp8_fallback"."""
        layer = self._latest() or self._default or self._layer(_lib.DTYPE_BF16, _lib.DEVICE_CPU,
                                                               None, self.head_size)
        return layer.path, layer.path_reason

    def _latest(self):
        """The libfmha layer of the latest forward, else None: after a call
        of the compiled path, this object's layer of that configuration."""
        call = self._fast_call
        if call is not None:
            dtype, device, head_dim_v = call
            self._layer(T._torch_dtype_code(sys.modules["torch"], dtype, "q"),
                        _lib.DEVICE_CUDA if device.type == "cuda" else _lib.DEVICE_CPU,
                        device.index, head_dim_v)
        return self._last

    def _config(self, dtype, device, head_dim_v):
        return self._opts.config(self.num_heads, self.num_kv_heads, self.head_size, head_dim_v,
                                 dtype, device)

    def _layer(self, dtype, device, index, head_dim_v):
        key = (dtype, device, index, head_dim_v)
        with self._lock:
            layer = self._layers.get(key)
            if layer is None:
                layer = _new_layer(self._config(dtype, device, head_dim_v), index)
                self._layers[key] = layer
                if layer.path == "fp8_fallback":  # once per libfmha layer
                    warnings.warn("fmha: " + layer.path_reason, RuntimeWarning, stacklevel=2)
            self._last = layer
            self._fast_call = None
            return layer

    def _layer_for(self, cfg, v):
        return self._layer(cfg.dtype, cfg.device, v.device_index, cfg.head_dim_v)

    @property
    def kernel(self):
        """Name of the kernel libfmha runs for this layer (fmha_layer_kernel):
        the one of the latest forward, else of the dtype/device given at
        construction, else of bf16 on the CPU."""
        layer = self._latest() or self._default
        if layer is not None:
            return layer.kernel_name
        return self.kernel_for()

    def kernel_for(self, dtype="bf16", device="cpu"):
        """Name of the kernel that would run this layer for `dtype` on `device`."""
        dev, idx = _device(device)
        return self._layer(_dtype_code(dtype), dev, idx, self.head_size).kernel_name

    def forward(self, q, k, v, *, out=None, return_lse=False, seed=None, q_descale=None,
                k_descale=None, v_descale=None, attn_mask=None, alibi_slopes=None, sinks=None):
        """q [B, Sq, num_heads, head_size], k/v [B, Sk, num_kv_heads, head_size]
        -> out [B, Sq, num_heads, head_size] (or (out, lse [B, H, Sq])).
        FP8 q, k, v take descales, and attn_mask, alibi_slopes and sinks
        modify the scores, as attention() does."""
        fast = _fast
        if fast is not None and self._fast_args is not None and out is None and \
                q_descale is None and k_descale is None and v_descale is None and \
                attn_mask is None and alibi_slopes is None and sinks is None and not _compiling():
            res = fast.attention(q, k, v, *self._fast_args, return_lse, self._shape)
            if res is not None and res is not False:  # False: autograd records it (the op)
                self._fast_call = (q.dtype, q.device, v.shape[-1])
                return res
        return self._forward(q, k, v, out, return_lse, seed, (q_descale, k_descale, v_descale),
                             _Mods(attn_mask, alibi_slopes, sinks))

    @T.returns_like(1)
    def _forward(self, q, k, v, out, return_lse, seed, descales, mods):
        return _padded(q, k, v, self._opts, out, return_lse, seed, self._layer_for, descales, mods)

    __call__ = forward

    def forward_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                       out=None, return_lse=False, seed=None, q_descale=None, k_descale=None,
                       v_descale=None, alibi_slopes=None, sinks=None):
        """Packed q [total_q, H, D], k/v [total_k, Hkv, D] with int32
        cu_seqlens -> out [total_q, H, D] (or (out, lse [H, total_q])).
        FP8 q, k, v take descales, alibi_slopes and sinks as
        varlen_attention() does."""
        fast = _fast
        if fast is not None and self._fast_args is not None and out is None and \
                q_descale is None and k_descale is None and v_descale is None and \
                alibi_slopes is None and sinks is None and not _compiling():
            res = fast.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, *self._fast_args, return_lse, self._shape)
            if res is not None and res is not False:  # False: autograd records it (the op)
                self._fast_call = (q.dtype, q.device, v.shape[-1])
                return res
        return self._forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, out, return_lse, seed,
                                    (q_descale, k_descale, v_descale),
                                    _Mods(None, alibi_slopes, sinks))

    @T.returns_like(1)
    def _forward_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        out, return_lse, seed, descales, mods):
        return _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       self._opts, out, return_lse, seed, self._layer_for, descales, mods)

    @T.returns_like(1)
    def decode(self, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
               cache_batch_idx=None, block_table=None, rotary_cos=None, rotary_sin=None,
               rotary_interleaved=True, num_splits=0, out=None, return_lse=False,
               k_descale=None, v_descale=None, max_seqlen_k=None, alibi_slopes=None,
               sinks=None):
        """One decode step of this layer against its KV caches: the
        arguments and result of kvcache_attention(), with this layer's heads,
        scale, masks and softcap (its dropout_p must be 0)."""
        return _decode(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                       cache_batch_idx, block_table, self._opts, rotary_interleaved, num_splits,
                       out, return_lse, self._layer_for, k_descale, v_descale, max_seqlen_k,
                       alibi_slopes, sinks)

    @T.returns_like(1)
    def backward(self, dout, q, k, v, out, lse, *, seed=None, dq=None, dk=None, dv=None,
                 attn_mask=None, alibi_slopes=None, sinks=None):
        """The gradients (dq, dk, dv) of forward(q, k, v) for dout, the
        gradient of its out; out and lse are forward()'s (return_lse=True),
        seed its dropout seed (required with dropout), the score modifiers
        its own (dsinks last with sinks). As attention_backward(), on this
        layer's libfmha layer."""
        return _padded_backward(dout, q, k, v, out, lse, self._opts, seed, (dq, dk, dv),
                                layer_for=self._layer_for,
                                mods=_Mods(attn_mask, alibi_slopes, sinks))

    @T.returns_like(1)
    def backward_varlen(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, *, seed=None, dq=None, dk=None, dv=None):
        """backward() for forward_varlen(): packed tensors, lse [H, total_q]."""
        return _packed_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, self._opts, seed, (dq, dk, dv),
                                layer_for=self._layer_for)

    def __repr__(self):
        return ("Attention(num_heads=%d, head_size=%d, num_kv_heads=%d, causal=%s, "
                "window=%s, softcap=%g, dropout_p=%g%s)"
                % (self.num_heads, self.head_size, self.num_kv_heads, self.causal, self.window,
                   self.softcap, self.dropout_p,
                   (", fp8=%r" % self.fp8 if self.fp8 else "")
                   + (", fp8_smooth_k=True" if self.fp8_smooth_k else "")))
