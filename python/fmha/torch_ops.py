"""torch_ops.py — fmha as torch operators: fmha::fwd and fmha::bwd (padded
[B, S, H, D]) and fmha::varlen_fwd and fmha::varlen_bwd (packed [T, H, D]),
registered with torch.library.custom_op, each with a fake implementation
(shapes and dtypes for torch.compile's tracing) and the forwards' autograd
formula through torch.library.register_autograd. Every torch call of
fmha.attention, varlen_attention, Attention and the flash_attn_* functions
runs through them (except out= and FP8 descales, which run directly and
cannot be differentiated), with grad or without, eagerly or compiled.

When the ops are registered. `import fmha` never imports torch. It
registers them at once when torch is already imported, else the first
torch tensor that reaches fmha does. Code that imports fmha before torch
and compiles before any eager call should `import fmha.torch_ops` (which
imports torch and registers) first: torch 2.15's Dynamo also traces the
registration when it happens inside a trace, but nothing promises that of
other versions. With the ops registered the Python layers above them are
plain code that Dynamo traces, and `torch.compile(fn, fullgraph=True)` over
fmha.flash_attn_func is one graph holding one fmha::fwd node. This order was
chosen over registration only on `import fmha.torch_ops` so that code which
imports torch first (most code) needs no fmha-specific line to compile.

The ops' arguments are numbers and tensors: the options of fmha's config,
the dropout seed (None draws one from fmha's generator, fmha.manual_seed,
inside the op, so a compiled graph draws a fresh seed per call too), and a
layer key (0, or the Attention object whose libfmha layer runs the call).
The forwards return (out, lse, rng_state): lse float32 [B, H, Sq] (padded)
or [H, total_q] (packed), and rng_state int64 [2] on the CPU, the seed (its
64 bits as a signed integer) and the offset (0) that the backward reads to
draw the same dropout mask. cu_seqlens are tensors read where q lives: on
CUDA the Python layer does not copy them to the host. Nor does libfmha when
max_seqlen_q and max_seqlen_k are given (bf16/f16, no FP8): the device
checks the offsets (include/fmha.h), so such a varlen forward can be
captured in a CUDA graph; without the bounds libfmha copies the offsets to
the host to validate them and to find the longest sequences.
"""
from typing import Optional

import numpy as np
import torch

from . import _api

if not hasattr(torch.library, "custom_op") or not hasattr(torch.library, "register_autograd"):
    raise ImportError("fmha.torch_ops needs torch >= 2.4 (torch.library.custom_op), found %s"
                      % torch.__version__)

Tensor = torch.Tensor

__all__ = ["fwd", "bwd", "varlen_fwd", "varlen_bwd"]

_U64 = 2**64 - 1


def _signed(seed):
    """A 64-bit seed as the int64 an op argument or tensor holds."""
    return seed - 2**64 if seed >= 2**63 else seed


def _options(layer, softmax_scale, causal, window_left, window_right, softcap, dropout_p):
    """(_Options, layer_for) of one op call: the Attention layer's own for a
    layer key (its options made the arguments), else built from them."""
    if layer:
        attn = _api._op_layers.get(layer)
        if attn is None:
            raise ValueError("fmha: layer key %d names no live fmha.Attention" % layer)
        return attn._opts, attn._layer_for
    opts = _api._Options(causal, softmax_scale or None, (window_left, window_right), softcap,
                         dropout_p)
    return opts, None


def _rng_state(seed):
    return torch.tensor([_signed(seed), 0], dtype=torch.int64)


def _seed_of(rng_state):
    return int(rng_state[0]) & _U64


def _out_dtype(q):
    # FP8 inputs write bfloat16 (FlashAttention-3's convention), as _tensors.empty.
    return torch.bfloat16 if q.dtype == getattr(torch, "float8_e4m3fn", None) else q.dtype


def _check_dims(name, ndim, *tensors):
    for n, t in zip(("q", "k", "v"), tensors):
        if t.dim() != ndim:
            raise ValueError("%s must be %d-d, got shape %s (%s)" % (n, ndim, list(t.shape), name))


def _dsinks_like(q, sinks):
    """The backward ops' fourth output: [H] in sinks' dtype and device, or an
    empty float32 tensor on q's device when the call has no sinks."""
    if sinks is None:
        return q.new_empty((0,), dtype=torch.float32)
    return sinks.new_empty(sinks.shape)


def _with_dsinks(grads, q, sinks):
    if sinks is None:
        return tuple(grads) + (_dsinks_like(q, None),)
    dq, dk, dv, dsinks = grads
    return dq, dk, dv, torch.as_tensor(dsinks).to(dtype=sinks.dtype, device=sinks.device)


# ------------------------------------------------------------------ padded


@torch.library.custom_op("fmha::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, dropout_p: float, seed: Optional[int],
        layer: int, attn_mask: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> out
    [B, Sq, H, Dv], lse [B, H, Sq] float32, rng_state [2] int64.
    softmax_scale 0 = 1/sqrt(D); window -1 = unlimited; seed None = drawn;
    attn_mask, alibi_slopes, sinks as fmha.attention's."""
    opts, layer_for = _options(layer, softmax_scale, causal, window_left, window_right, softcap,
                               dropout_p)
    s = _api._dropout_seed(None if seed is None else seed & _U64, opts.dropout_p)
    out, lse = _api._padded_direct(q, k, v, opts, None, True, s, layer_for,
                                   mods=_api._Mods(attn_mask, alibi_slopes, sinks))
    return out, lse, _rng_state(s)


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
              seed, layer, attn_mask=None, alibi_slopes=None, sinks=None):
    _check_dims("fmha::fwd", 4, q, k, v)
    B, Sq, H, _ = q.shape
    out = q.new_empty((B, Sq, H, v.shape[3]), dtype=_out_dtype(q))
    lse = q.new_empty((B, H, Sq), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("fmha::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        rng_state: Tensor, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, dropout_p: float, layer: int,
        attn_mask: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients (dq, dk, dv, dsinks) of fmha::fwd for dout [B, Sq, H, Dv]:
    out, lse and rng_state are the forward's, the options and modifiers its
    own. dsinks is [H] in sinks' dtype, or empty [0] float32 without sinks."""
    opts, layer_for = _options(layer, softmax_scale, causal, window_left, window_right, softcap,
                               dropout_p)
    grads = _api._padded_backward(dout, q, k, v, out, lse, opts, _seed_of(rng_state),
                                  layer_for=layer_for,
                                  mods=_api._Mods(attn_mask, alibi_slopes, sinks))
    return _with_dsinks(grads, q, sinks)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, rng_state, softmax_scale, causal, window_left,
              window_right, softcap, dropout_p, layer, attn_mask=None, alibi_slopes=None,
              sinks=None):
    _check_dims("fmha::bwd", 4, q, k, v)
    return tuple(x.new_empty(x.shape) for x in (q, k, v)) + (_dsinks_like(q, sinks),)


# ------------------------------------------------------------------ packed


@torch.library.custom_op("fmha::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
               window_left: int, window_right: int, softcap: float, dropout_p: float,
               seed: Optional[int], layer: int, alibi_slopes: Optional[Tensor] = None,
               sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Packed q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], cu_seqlens
    [batch + 1] (int32; others are converted) -> out [Tq, H, Dv], lse
    [H, Tq] float32, rng_state [2] int64. max_seqlen 0 = computed by fmha."""
    opts, layer_for = _options(layer, softmax_scale, causal, window_left, window_right, softcap,
                               dropout_p)
    s = _api._dropout_seed(None if seed is None else seed & _U64, opts.dropout_p)
    out, lse = _api._packed_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, opts, None, True, s, layer_for,
                                   mods=_api._Mods(None, alibi_slopes, sinks))
    return out, lse, _rng_state(s)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed,
                     layer, alibi_slopes=None, sinks=None):
    _check_dims("fmha::varlen_fwd", 3, q, k, v)
    Tq, H, _ = q.shape
    out = q.new_empty((Tq, H, v.shape[2]), dtype=_out_dtype(q))
    lse = q.new_empty((H, Tq), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("fmha::varlen_bwd", mutates_args=())
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
               rng_state: Tensor, softmax_scale: float, causal: bool, window_left: int,
               window_right: int, softcap: float, dropout_p: float, layer: int,
               alibi_slopes: Optional[Tensor] = None,
               sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients (dq, dk, dv, dsinks) of fmha::varlen_fwd; tokens in no
    sequence get 0; dsinks as fmha::bwd's."""
    opts, layer_for = _options(layer, softmax_scale, causal, window_left, window_right, softcap,
                               dropout_p)
    grads = _api._packed_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, opts, _seed_of(rng_state),
                                  layer_for=layer_for, mods=_api._Mods(None, alibi_slopes, sinks))
    return _with_dsinks(grads, q, sinks)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, rng_state, softmax_scale, causal, window_left, window_right,
                     softcap, dropout_p, layer, alibi_slopes=None, sinks=None):
    _check_dims("fmha::varlen_bwd", 3, q, k, v)
    return tuple(x.new_empty(x.shape) for x in (q, k, v)) + (_dsinks_like(q, sinks),)


# ------------------------------------------------------------------ autograd

# The forwards' arguments after q, k, v (padded) or after q, k, v, cu_seqlens_q,
# cu_seqlens_k, max_seqlen_q, max_seqlen_k (packed): the options, seed, layer
# and the score modifiers. The backward takes them without the seed, which
# rng_state carries. Of the modifiers only sinks get a gradient: a mask or
# slopes that require one are refused before the op (_api._refuse_mod_grads).


def _grad_out(dout):
    # libfmha reads head_dim contiguously; .sum()'s gradient is an expanded one.
    return dout if dout.stride(-1) == 1 else dout.contiguous()


def _setup_fwd(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state)
    ctx.options = inputs[3:9] + inputs[10:]  # without seed
    ctx.mark_non_differentiable(lse, rng_state)


def _sinks_grad(dsinks, sinks):
    return dsinks if sinks is not None and sinks.requires_grad else None


def _backward_fwd(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.fmha.bwd(_grad_out(dout), q, k, v, out, lse, rng_state,
                                            *ctx.options)
    return (dq, dk, dv) + (None,) * 10 + (_sinks_grad(dsinks, ctx.options[-1]),)


def _setup_varlen_fwd(ctx, inputs, output):
    q, k, v, cu_q, cu_k = inputs[:5]
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state)
    ctx.max_seqlens = inputs[5:7]
    ctx.options = inputs[7:13] + inputs[14:]  # without seed
    ctx.mark_non_differentiable(lse, rng_state)


def _backward_varlen_fwd(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.fmha.varlen_bwd(_grad_out(dout), q, k, v, out, lse, cu_q,
                                                   cu_k, *ctx.max_seqlens, rng_state,
                                                   *ctx.options)
    return (dq, dk, dv) + (None,) * 13 + (_sinks_grad(dsinks, ctx.options[-1]),)


torch.library.register_autograd("fmha::fwd", _backward_fwd, setup_context=_setup_fwd)
torch.library.register_autograd("fmha::varlen_fwd", _backward_varlen_fwd,
                                setup_context=_setup_varlen_fwd)


# ------------------------------------------------------------------ the Python layer's calls

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)


def eager(*tensors):
    """True when a call on these tensors (None among them allowed) may skip
    the op and run its body directly: plain tensors that autograd would not
    record, no torch.compile trace, no dispatch or function mode active. The
    op's dispatch costs about as much host time as the body itself on a
    small call; everything that could see it (autograd, compile, fake and
    meta tensors, modes) keeps it."""
    if _is_compiling():
        return False
    if _dispatch_depth is None or _dispatch_depth() or (_function_modes and _function_modes()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or (grad and t.requires_grad) or t.device.type not in ("cpu",
                                                                                          "cuda"):
            return False
    return True



def _op_args(opts, seed):
    """The options and seed as op arguments (seed checked here as
    attention() checks it; not read without dropout)."""
    if opts.dropout_p and seed is not None:
        seed = _signed(_api._dropout_seed(seed, opts.dropout_p))
    elif not opts.dropout_p:
        seed = None
    return (opts.softmax_scale, opts.causal, opts.window[0], opts.window[1], opts.softcap,
            opts.dropout_p, seed)


def _index_tensor(cu):
    """cu_seqlens as a tensor for the op: a tensor as it is (the op converts
    its dtype and device where needed), anything else through numpy."""
    if isinstance(cu, Tensor):
        return cu
    return torch.as_tensor(np.asarray(cu))


def _mod_tensors(mods, q):
    """The score modifiers as op arguments: tensors as they are (the op
    reads them where they live), anything else through numpy."""
    return tuple(x if x is None or isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
                 for x in mods.given)


def padded(q, k, v, opts, seed, layer, mods=_api._NO_MODS):
    """fmha.attention() on torch tensors: (out, lse)."""
    out, lse, _ = torch.ops.fmha.fwd(q, k, v, *_op_args(opts, seed), layer,
                                     *_mod_tensors(mods, q))
    return out, lse


def packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, seed, layer,
           mods=_api._NO_MODS):
    """fmha.varlen_attention() on torch tensors: (out, lse)."""
    from ._tensors import int64
    max_q = 0 if max_seqlen_q is None else int64(max_seqlen_q, "max_seqlen_q")
    max_k = 0 if max_seqlen_k is None else int64(max_seqlen_k, "max_seqlen_k")
    out, lse, _ = torch.ops.fmha.varlen_fwd(q, k, v, _index_tensor(cu_seqlens_q),
                                            _index_tensor(cu_seqlens_k), max_q, max_k,
                                            *_op_args(opts, seed), layer,
                                            *_mod_tensors(mods, q)[1:])
    return out, lse
