"""torch_ext.py — the compiled path of fmha's torch calls.

A call from Python through ctypes costs two to three times torch SDPA's
host time on a small shape (bench/RESULTS.md, per-call host time): the
options, the tensors' shapes and pointers and the output's allocation all go
through Python. fmha_torch_ext (csrc/torch_ext.cpp) does that work in C++
for the common call of fmha.attention, fmha.varlen_attention (int32 offsets
on q's device) and fmha.Attention's forward and forward_varlen (layers
without dropout, FP8 or check_finite) — plain CPU or CUDA tensors,
f32/f16/bf16, no dropout, out=, FP8 descales or score modifiers, no
torch.compile trace, dispatch or function mode — and hands every other call
back to the Python path, which also raises every error. Calls of the two
functions that autograd records run through the autograd Functions below
(the compiled forward, fmha's backward); Attention's keep the ops.

It is compiled against the torch it runs with, once, by

    python -m fmha.torch_ext          (or fmha.torch_ext.build())

which needs a C++ compiler and ninja (`pip install ninja`) and takes about
half a minute; CUDA tensors take the path where torch has CUDA and its toolkit's
headers are found (CUDA_HOME), else they keep the Python path. The module
lands in $FMHA_TORCH_EXT_DIR, else ~/.cache/fmha/torch_ext, under a name
made from its source, fmha.h, the torch version and the CUDA switch, so that
a new torch or a new fmha never loads a stale one. Afterwards fmha picks it
up by itself at the first torch call; FMHA_TORCH_EXT=0 in the environment
keeps it off. Outputs are the Python path's to the bit: both run the same
libfmha call.
"""
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys

import torch

from . import _api, _lib

__all__ = ["build", "load", "module_path", "varlen_with_grad", "with_grad"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "csrc", "torch_ext.cpp")


def _header_dir():
    """The folder of fmha.h: the installed package's, else the repository's
    (python/fmha used in place)."""
    for d in (os.path.join(_HERE, "include"), os.path.join(_HERE, os.pardir, os.pardir, "include")):
        if os.path.isfile(os.path.join(d, "fmha.h")):
            return os.path.abspath(d)
    raise FileNotFoundError("fmha.torch_ext: fmha.h is in neither %s nor the repository's "
                            "include/ (a package installed without its header)"
                            % os.path.join(_HERE, "include"))


def _with_cuda():
    if not torch.version.cuda:
        return False
    from torch.utils import cpp_extension
    home = cpp_extension.CUDA_HOME
    return bool(home) and os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h"))


def _name(cuda):
    h = hashlib.sha256()
    for path in (_SOURCE, os.path.join(_header_dir(), "fmha.h")):
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(("%s %s %s" % (torch.__version__, cuda, sys.version_info[:2])).encode())
    return "fmha_torch_ext_" + h.hexdigest()[:16]


def _directory(name):
    root = os.environ.get("FMHA_TORCH_EXT_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "fmha", "torch_ext")
    return os.path.join(root, name)


def module_path(cuda=None):
    """Where the module for this torch and this fmha is (or would be) built."""
    cuda = _with_cuda() if cuda is None else cuda
    name = _name(cuda)
    return os.path.join(_directory(name), name + ".so")


def _bind(mod):
    """Gives the module libfmha's functions (the library fmha._lib loaded)."""
    addr = [ctypes.cast(getattr(_lib.lib, n), ctypes.c_void_p).value
            for n in ("fmha_config_init", "fmha_layer_init", "fmha_layer_free",
                      "fmha_layer_forward")]
    if mod.sizes() != (ctypes.sizeof(_lib.Config), ctypes.sizeof(_lib.ForwardArgs)):
        raise ImportError("fmha.torch_ext: %s was compiled against an fmha.h whose structures "
                          "differ from %s's (sizes %s against %s): rebuild it"
                          % (mod.__file__, _lib.path, mod.sizes(),
                             (ctypes.sizeof(_lib.Config), ctypes.sizeof(_lib.ForwardArgs))))
    mod.bind(*addr, list(_api._KNOBS))
    return mod


def _import(path):
    name = os.path.basename(path)[:-3]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


class _HandBack(Exception):
    """The compiled forward turned the call down: the Python path runs it."""


class _Attention(torch.autograd.Function):
    """A padded call that autograd records: the compiled forward, and fmha's
    backward (through the Python path, as the fmha::bwd op runs it)."""

    @staticmethod
    def forward(ctx, q, k, v, mod, options):
        res = mod.attention(q, k, v, *options, True, None)
        if not isinstance(res, tuple):
            raise _HandBack()
        out, lse = res
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        opts, dout = _backward_inputs(ctx, dout)
        grads = _api._padded_backward(dout, q, k, v, out, lse, opts, None,
                                      need=ctx.needs_input_grad[:3])
        return tuple(grads) + (None, None)


def _backward_inputs(ctx, dout):
    """The forward's options, and dout as libfmha reads it (head_dim
    contiguous: .sum()'s gradient is an expanded one)."""
    causal, scale, window, softcap = ctx.options
    return (_api._Options(causal, scale, window, softcap, 0.0),
            dout if dout.stride(-1) == 1 else dout.contiguous())


class _VarlenAttention(torch.autograd.Function):
    """_Attention for packed calls: offsets and bounds ride along."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, bounds, mod, options):
        res = mod.varlen_attention(q, k, v, cu_q, cu_k, *bounds, *options, True, None)
        if not isinstance(res, tuple):
            raise _HandBack()
        out, lse = res
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.bounds, ctx.options = bounds, options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        opts, dout = _backward_inputs(ctx, dout)
        grads = _api._packed_backward(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.bounds, opts,
                                      None, need=ctx.needs_input_grad[:3])
        return tuple(grads) + (None,) * 5


def with_grad(q, k, v, causal, softmax_scale, window, softcap, return_lse):
    """fmha.attention's compiled path for a call that autograd records (the
    module answered False): out, or (out, lse); None where the module then
    turns it down (the Python path runs it)."""
    mod = _api._fast
    try:
        out, lse = _Attention.apply(q, k, v, mod, (causal, softmax_scale, window, softcap))
    except _HandBack:
        return None
    return (out, lse) if return_lse else out


def varlen_with_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, window, softcap, return_lse):
    """with_grad for fmha.varlen_attention."""
    mod = _api._fast
    try:
        out, lse = _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          (max_seqlen_q, max_seqlen_k), mod,
                                          (causal, softmax_scale, window, softcap))
    except _HandBack:
        return None
    return (out, lse) if return_lse else out


def _find_ninja():
    """torch runs `ninja` from PATH: where it is not there, the ninja
    package's (pip install ninja, in a virtual environment not activated)
    is put first on this process's PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        raise RuntimeError("fmha.torch_ext needs ninja to build: pip install ninja") from None
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build(verbose=False):
    """Compiles the module for this torch (about a minute; nothing when it
    is there already), loads it and returns it."""
    from torch.utils import cpp_extension
    cuda = _with_cuda()
    name = _name(cuda)
    path = module_path(cuda)
    if os.path.isfile(path):
        return _bind(_import(path))
    os.makedirs(_directory(name), exist_ok=True)
    _find_ninja()
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if cuda and not arch:
        # No CUDA source is compiled, but torch asks a GPU for the list
        # whenever with_cuda is on, and a build machine may have none.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        mod = cpp_extension.load(name, [_SOURCE], extra_include_paths=[_header_dir()],
                                 extra_cflags=["-O2"] + (["-DFMHA_EXT_CUDA"] if cuda else []),
                                 build_directory=_directory(name), with_cuda=cuda,
                                 verbose=verbose)
    finally:
        if cuda and not arch:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
    return _bind(mod)


def load():
    """The module when it has been built for this torch and fmha (bound to
    libfmha), else None; FMHA_TORCH_EXT=0 gives None too. Looks for the
    CUDA build first where torch has CUDA, without asking where CUDA_HOME
    is (torch.utils.cpp_extension is slow to import)."""
    if os.environ.get("FMHA_TORCH_EXT", "1") == "0":
        return None
    for cuda in ((True, False) if torch.version.cuda else (False,)):
        path = module_path(cuda)
        if os.path.isfile(path):
            return _bind(_import(path))
    return None


def _main(argv):
    mod = build(verbose="-v" in argv)
    print("%s (CUDA tensors: %s)" % (mod.__file__, "yes" if mod.cuda else "no, Python path"))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
