"""fmha — fused multi-head attention (the fmha C library) for numpy arrays,
torch tensors (CPU and CUDA) and anything with __dlpack__.

    import fmha, numpy as np
    q = np.random.randn(1, 128, 8, 64).astype(np.float32)   # [B, S, H, D]
    out = fmha.attention(q, q, q, causal=True)               # [B, S, H, D]

attention / varlen_attention / kvcache_attention (decode) are the functions
(attention_backward / varlen_attention_backward their gradients; torch
tensors run through the fmha::* torch ops of fmha.torch_ops, differentiable
and traceable by torch.compile), Attention the layer object,
fmha.flash_attn holds flash_attn 2.x-compatible functions (also exported
here). libfmha's errors raise InvalidArgumentError (a ValueError),
UnsupportedError (a NotImplementedError), OutOfMemoryError (a MemoryError) or
BackendError (a RuntimeError), all FmhaError, with the library's message.
"""
from . import _lib
from ._api import (Attention, attention, attention_backward, kvcache_attention, manual_seed,
                   varlen_attention, varlen_attention_backward)
from ._lib import (BackendError, FmhaError, InvalidArgumentError, OutOfMemoryError,
                   UnsupportedError)
from .flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                         flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                         flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

# torch already imported: register the fmha::* torch ops now, outside any
# torch.compile trace (fmha.torch_ops says when else they are registered).
_api.load_torch_ops()

try:
    from importlib.metadata import version as _version
    __version__ = _version("fmha")
except Exception:  # used from a source tree, not installed
    __version__ = "0+unknown"

__all__ = ["attention", "varlen_attention", "kvcache_attention", "attention_backward",
           "varlen_attention_backward", "Attention", "manual_seed", "info",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "FmhaError", "InvalidArgumentError",
           "UnsupportedError", "OutOfMemoryError", "BackendError"]


def info():
    """What this libfmha can run: its path, the CPU ISA it detected, whether
    its CUDA backend was built, and the CUDA devices it sees."""
    return {
        "version": __version__,
        "library": _lib.path,
        "cpu_isa": _lib.fmha_cpu_isa_name(_lib.fmha_cpu_isa_detect()).decode(),
        "cuda_backend": bool(_lib.fmha_cuda_backend_built()),
        "cuda_devices": _lib.cuda_devices(),
    }
