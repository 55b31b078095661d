"""fmha.sglang — fmha as an attention backend of sglang's diffusion runtime
(sglang.multimodal_gen), the role its AITer backend plays on ROCm.

    import fmha.sglang
    fmha.sglang.register()      # in the process that builds the pipeline, before it does

FmhaAttentionImpl(num_heads, head_size, softmax_scale, causal=False,
num_kv_heads=None, prefix="", dropout_p=0.0, fp8=None, **extra_impl_args)
builds an fmha.Attention, so a bad GQA shape fails there with fmha's message.
forward(query, key, value, attn_metadata=None, *, return_softmax_lse=False)
takes [batch, seq, heads, head_dim] torch tensors (CPU or CUDA; numpy too)
and honours causal (bottom-right aligned where Sq != Sk, as flash-attention),
softmax_scale, num_kv_heads (K/V never repeated) and dropout_p; with
return_softmax_lse it returns (out, lse [batch, heads, Sq]), as sglang's ring
attention asks. forward_varlen(query, key, value, *, cu_seqlens, max_seqlen)
runs packed [tokens, heads, head_dim] self-attention. Sequence-parallel ranks
see fewer heads than num_heads: each head count gets its own fmha layer.

FP8 as AITer: SGLANG_DIFFUSION_AITER_FP8_ATTN=1 (read when an impl is built)
quantizes q, k, v to E4M3 with one scale per tensor on every call (fmha's
fp8="per_tensor"), out in q's dtype; float8_e4m3fn inputs run as they are
(out bfloat16); where no FP8 kernel fits, fmha runs q's dtype and warns once.
fp8= on the impl or on register() overrides the variable: "per_tensor",
"per_block", "int8_qk", or False for off.

register(replace=None, fp8=None) wraps sglang's selector function
selector._cached_get_attn_backend (sglang.multimodal_gen.runtime.layers.
attention.selector), through which every attention layer gets its backend:
where it returns a backend named in `replace` (default DENSE_BACKENDS: FA,
FA2, TORCH_SDPA, AITER) the layer gets FmhaAttentionBackend_<name> instead.
sglang's backend enum is closed and its selector and layers branch on it, so
fmha answers get_enum() with the enum of the backend it replaces: the
selector's checks and the layers' FA-only paths see what they would have
seen. unregister() undoes it.

Limits: register() changes only the calling process, and only layers built
after it; sglang builds the model in worker processes, where it must run
too (docs/sglang.md: a plugin of the entry-point group
sglang.multimodal_gen.plugins). Sparse and quantized backends (sliding tile,
VSA, VMoBA, Sage, ...) are never replaced. Layers given an attention mask
compute it with sglang's own code (SDPA, or FA's varlen path where fmha
stands in for FA).

With sglang installed this module subclasses its base classes (importing
sglang and torch); without, it defines minimal ones and imports neither.
`import fmha` never imports this module.
"""
import dataclasses
import functools
import importlib
import os

from ._api import Attention

try:
    from sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend import (
        AttentionBackend, AttentionImpl, AttentionMetadata)
    HAVE_SGLANG = True
except ImportError:  # standalone: sglang's interface, the parts fmha uses
    HAVE_SGLANG = False

    class AttentionBackend:
        accept_output_buffer = False

    @dataclasses.dataclass
    class AttentionMetadata:
        current_timestep: int = 0

    class AttentionImpl:
        def preprocess_qkv(self, qkv, attn_metadata):
            return qkv

        def postprocess_output(self, output, attn_metadata):
            return output

__all__ = ["FmhaAttentionBackend", "FmhaAttentionImpl", "register", "unregister",
           "FP8_ENV", "DENSE_BACKENDS"]

FP8_ENV = "SGLANG_DIFFUSION_AITER_FP8_ATTN"
# sglang's exact dense backends: the same attention as fmha's, so register() replaces them.
DENSE_BACKENDS = ("FA", "FA2", "TORCH_SDPA", "AITER")
_SELECTOR = "sglang.multimodal_gen.runtime.layers.attention.selector"
_PLATFORMS = "sglang.multimodal_gen.runtime.platforms"
_FP8_MODES = ("per_tensor", "per_block", "int8_qk")


def _fp8_mode(fp8):
    """fmha's fp8 option for an impl: `fp8` given, else register()'s, else
    the AITer variable ("1" = per-tensor scales, as AITer's FP8 path)."""
    if fp8 is None:
        fp8 = FmhaAttentionImpl.default_fp8
    if fp8 is None:
        return "per_tensor" if os.environ.get(FP8_ENV, "0") == "1" else None
    if fp8 is not False and fp8 not in _FP8_MODES:
        raise ValueError("fp8 must be None (follow %s), False (off) or one of %s, got %r"
                         % (FP8_ENV, ", ".join(map(repr, _FP8_MODES)), fp8))
    return fp8 or None


def _is_fp8(x):
    return str(x.dtype).endswith("float8_e4m3fn")  # torch and ml_dtypes both


class FmhaAttentionImpl(AttentionImpl):
    """sglang's AttentionImpl on fmha (the module docstring tells what it runs)."""

    default_fp8 = None  # register(fp8=...) sets it for the impls sglang builds

    def __init__(self, num_heads, head_size, softmax_scale=None, causal=False, num_kv_heads=None,
                 prefix="", dropout_p=0.0, fp8=None, **extra_impl_args):
        # extra_impl_args: other backends' options (allow_cudnn_sdp, ...), not fmha's.
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.softmax_scale, self.causal, self.dropout_p = softmax_scale, causal, dropout_p
        self.prefix = prefix
        self.fp8 = _fp8_mode(fp8)
        self.layer = self._new_layer(self.num_heads, self.num_kv_heads, self.fp8)
        self._layers = {(self.num_heads, self.num_kv_heads, self.fp8): self.layer}

    def _new_layer(self, num_heads, num_kv_heads, fp8):
        return Attention(num_heads, self.head_size, self.softmax_scale, self.causal, num_kv_heads,
                         self.dropout_p, fp8=fp8)

    def _layer_for(self, query, key):
        """The fmha layer of these tensors' head counts; FP8 inputs take no
        quantizing layer (they are quantized already)."""
        fp8 = None if self.fp8 and _is_fp8(query) else self.fp8
        heads = (query.shape[-2], key.shape[-2], fp8)
        layer = self._layers.get(heads)
        if layer is None:
            layer = self._layers[heads] = self._new_layer(*heads)
        return layer

    def forward(self, query, key, value, attn_metadata=None, *, return_softmax_lse=False):
        """query [B, Sq, H, D], key/value [B, Sk, Hkv, D] -> out [B, Sq, H, D]
        in query's dtype (bfloat16 for FP8 inputs), or (out, lse [B, H, Sq]
        float32) with return_softmax_lse. attn_metadata is not read."""
        return self._layer_for(query, key).forward(query, key, value,
                                                   return_lse=return_softmax_lse)

    def forward_varlen(self, query, key, value, *, cu_seqlens, max_seqlen, cu_seqlens_host=None):
        """Packed self-attention: query [T, H, D], key/value [T, Hkv, D],
        sequence b its tokens cu_seqlens[b]:cu_seqlens[b + 1] -> out [T, H, D].
        cu_seqlens_host (a host copy some callers pass) is not needed."""
        return self._layer_for(query, key).forward_varlen(query, key, value, cu_seqlens,
                                                          cu_seqlens, max_seqlen, max_seqlen)

    def __repr__(self):
        return "FmhaAttentionImpl(%r, prefix=%r)" % (self.layer, self.prefix)


class FmhaAttentionBackend(AttentionBackend):
    """sglang's AttentionBackend for fmha. `stands_in_for` is the name of
    the sglang backend whose place it takes (register() makes one subclass
    per replaced backend); get_enum() and get_name() answer with it."""

    stands_in_for = "TORCH_SDPA"

    @classmethod
    def get_enum(cls):
        return importlib.import_module(_PLATFORMS).AttentionBackendEnum[cls.stands_in_for]

    @classmethod
    def get_name(cls):
        return cls.stands_in_for

    @staticmethod
    def get_impl_cls():
        return FmhaAttentionImpl

    @staticmethod
    def get_metadata_cls():
        return AttentionMetadata  # fmha reads none

    @staticmethod
    def get_builder_cls():
        return None  # no per-step metadata to build

    @classmethod
    def unsupported_requirements(cls, requirements):
        return ()  # padded and packed varlen attention both run on fmha


@functools.cache
def _stand_in(name):
    """FmhaAttentionBackend under sglang backend `name`, at module level so
    that it resolves by its qualified name (fmha.sglang.FmhaAttentionBackend_FA)."""
    cls_name = "FmhaAttentionBackend_" + name
    cls = type(cls_name, (FmhaAttentionBackend,), {"stands_in_for": name, "__module__": __name__,
                                                   "__qualname__": cls_name})
    globals()[cls_name] = cls
    return cls


def _enum_of(backend, enum):
    if hasattr(backend, "get_enum"):
        return backend.get_enum()
    return enum.__members__.get(backend.get_name())  # sglang before get_enum()


def register(replace=None, fp8=None):
    """Make sglang's diffusion runtime run fmha wherever it would pick one of
    the backends named in `replace` (names of sglang's AttentionBackendEnum;
    None: DENSE_BACKENDS, those this sglang has). fp8 sets the FP8 mode of
    the impls sglang builds (None: follow SGLANG_DIFFUSION_AITER_FP8_ATTN).
    Calling it again replaces the previous call's choice. Returns the names
    replaced."""
    selector = importlib.import_module(_SELECTOR)
    enum = importlib.import_module(_PLATFORMS).AttentionBackendEnum
    if replace is None:
        names = [n for n in DENSE_BACKENDS if n in enum.__members__]
    else:
        names = [str(n).upper() for n in ([replace] if isinstance(replace, str) else replace)]
        unknown = [n for n in names if n not in enum.__members__]
        if unknown:
            raise ValueError("sglang has no attention backend %s; its backends are %s"
                             % (", ".join(unknown), ", ".join(enum.__members__)))
    if fp8 is not None:
        _fp8_mode(fp8)  # checked here, not at the first layer sglang builds
    members = frozenset(enum[n] for n in names)
    original = _unwrapped(selector._cached_get_attn_backend)

    @functools.wraps(original)
    def pick(*args, **kwargs):
        backend = original(*args, **kwargs)
        member = _enum_of(backend, enum)
        return _stand_in(member.name) if member in members else backend

    pick.fmha_original = original
    if hasattr(original, "cache_clear"):
        pick.cache_clear = original.cache_clear
    FmhaAttentionImpl.default_fp8 = fp8
    selector._cached_get_attn_backend = pick
    return sorted(names)


def unregister():
    """Undo register(): sglang picks its own backends again (for layers built
    from now on)."""
    selector = importlib.import_module(_SELECTOR)
    selector._cached_get_attn_backend = _unwrapped(selector._cached_get_attn_backend)
    FmhaAttentionImpl.default_fp8 = None


def _unwrapped(fn):
    return getattr(fn, "fmha_original", fn)
