"""_autograd.py — torch.autograd for fmha: one torch.autograd.Function whose
forward is fmha's forward (keeping out and the LSE) and whose backward is
fmha's backward, taken by attention(), varlen_attention(), Attention and the
flash_attn_* functions whenever torch inputs require grad (with grad
enabled). torch is only used here once such inputs have come, so it is
never imported by fmha itself."""
import sys


_function = None


def _fmha_function():
    """The Function class, made on first use (it subclasses a torch class)."""
    global _function
    if _function is None:
        torch = sys.modules["torch"]

        class FmhaAttentionFunction(torch.autograd.Function):
            """out, lse = attention(q, k, v); lse is not differentiable."""

            @staticmethod
            def forward(ctx, q, k, v, call):
                out, lse = call.forward(q, k, v)
                ctx.save_for_backward(q, k, v, out, lse)
                ctx.call = call
                ctx.mark_non_differentiable(lse)
                return out, lse

            @staticmethod
            def backward(ctx, dout, _dlse):
                q, k, v, out, lse = ctx.saved_tensors
                if dout.dim() and dout.stride(-1) != 1:  # e.g. the expanded ones of .sum()
                    dout = dout.contiguous()
                dq, dk, dv = ctx.call.backward(dout, q, k, v, out, lse, ctx.needs_input_grad[:3])
                return dq, dk, dv, None

        _function = FmhaAttentionFunction
    return _function


class _Call:
    """One differentiable call's options, dropout seed and layer: forward
    runs fmha's forward, backward fmha's backward with the same ones."""

    def __init__(self, opts, seed, layer_for, varlen=None):
        self.opts, self.seed, self.layer_for, self.varlen = opts, seed, layer_for, varlen

    def forward(self, q, k, v):
        from . import _api
        if self.varlen is None:
            return _api._padded(q, k, v, self.opts, None, True, self.seed, self.layer_for)
        return _api._packed(q, k, v, *self.varlen, self.opts, None, True, self.seed,
                            self.layer_for)

    def backward(self, dout, q, k, v, out, lse, need):
        from . import _api
        if self.varlen is None:
            return _api._padded_backward(dout, q, k, v, out, lse, self.opts, self.seed,
                                         need=need, layer_for=self.layer_for)
        return _api._packed_backward(dout, q, k, v, out, lse, *self.varlen, self.opts, self.seed,
                                     need=need, layer_for=self.layer_for)


def _check(out, descales):
    if out is not None:
        raise ValueError("out= cannot be written in place by a call that autograd records "
                         "(inputs that require grad): leave out=None")
    if any(d is not None for d in descales):
        raise NotImplementedError("FP8 inputs have no backward: call fmha under "
                                  "torch.no_grad() or pass detached tensors")


def _apply(q, k, v, call, return_lse):
    from . import _api
    call.seed = _api._dropout_seed(call.seed, call.opts.dropout_p)  # one seed for both passes
    out, lse = _fmha_function().apply(q, k, v, call)
    return (out, lse) if return_lse else out


def padded(q, k, v, opts, out, return_lse, seed, layer_for, descales):
    """attention() on inputs that require grad."""
    _check(out, descales)
    return _apply(q, k, v, _Call(opts, seed, layer_for), return_lse)


def packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, out,
           return_lse, seed, layer_for, descales):
    """varlen_attention() on inputs that require grad."""
    _check(out, descales)
    call = _Call(opts, seed, layer_for, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return _apply(q, k, v, call, return_lse)


__all__ = ["padded", "packed"]
