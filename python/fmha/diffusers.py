"""fmha.diffusers — run a diffusers model's attention on fmha.

    import fmha.diffusers                      # registers the "fmha" backend
    pipe.transformer.set_attention_backend("fmha")
    image = pipe(prompt).images[0]

Importing this module imports torch and diffusers (`import fmha` alone
imports neither) and, where diffusers has its attention dispatcher
(diffusers >= 0.35: `diffusers.models.attention_dispatch`), registers fmha
there as the backend "fmha": `model.set_attention_backend("fmha")`, the
`attention_backend("fmha")` context manager and `DIFFUSERS_ATTN_BACKEND=fmha`
(import fmha.diffusers before diffusers' models for that one: the dispatcher
reads the variable when it is imported) then run every model whose
processors call `dispatch_attention_fn` (Flux, Wan, HunyuanVideo, ...) on
fmha. The backend is torch SDPA's contract on [B, S, H, D] tensors: boolean
(True = attend) or additive attn_mask broadcastable to [B, H, Sq, Sk] (or
[B, Sk]) read in place by fmha, is_causal with SDPA's top-left alignment,
scale, dropout_p, grouped KV heads, return_lse (lse [B, H, Sq], as the
flash backend's); gradients flow through fmha's backward. It has no
context-parallel form (diffusers' ParallelConfig): such calls raise.

For diffusers' older processor-based modules, two processors:

- FmhaAttnProcessor: for diffusers' `Attention` modules (UNet / DiT
  self- and cross-attention), the same steps as diffusers'
  AttnProcessor2_0 (spatial_norm, 4-D inputs, group_norm, norm_cross,
  attention mask preparation, to_q/to_k/to_v, norm_q/norm_k, heads split,
  to_out, residual_connection, rescale_output_factor) with fmha's attention
  in place of torch.nn.functional.scaled_dot_product_attention. Like
  AttnProcessor2_0 it uses the default softmax scale 1/sqrt(head_dim)
  (attn.scale is not read, as in AttnProcessor2_0).
- FmhaFluxAttnProcessor: for Flux's `FluxAttention` (FluxAttnProcessor /
  FluxAttnProcessor2_0): joint text+image tokens (text first) and rotary
  embeddings applied to q and k before attention, fused or separate
  projections.

set_fmha_attention(model) swaps those in. Attention dropout is not used by
these processors (AttnProcessor2_0 uses none either). Other processors
(SD3's JointAttnProcessor2_0, IP-Adapter, LoRA-specific, added-KV, Flux
IP-Adapter, ...) are not replaced by set_fmha_attention.
"""
import os
import sys

import torch

from . import _api

BACKEND_NAME = "fmha"


def _env_wants_fmha():
    return os.environ.get("DIFFUSERS_ATTN_BACKEND") == BACKEND_NAME


if _env_wants_fmha() and "diffusers.models.attention_dispatch" not in sys.modules:
    # The dispatcher makes DIFFUSERS_ATTN_BACKEND its active backend when it
    # is imported, before "fmha" can be registered: it starts on "native"
    # and _register_backend() makes fmha active.
    import diffusers.utils.constants as _constants
    _constants.DIFFUSERS_ATTN_BACKEND = "native"

from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0  # noqa: E402

try:  # diffusers >= 0.35: FluxAttnProcessor in transformer_flux
    from diffusers.models.transformers import transformer_flux as _flux
except ImportError:  # pragma: no cover - very old diffusers
    _flux = None

__all__ = ["FmhaAttnProcessor", "FmhaFluxAttnProcessor", "set_fmha_attention",
           "SUPPORTED_PROCESSORS", "BACKEND_NAME", "sdpa"]


def _flux_processor_classes():
    classes = []
    if _flux is not None:
        for name in ("FluxAttnProcessor", "FluxAttnProcessor2_0"):
            cls = getattr(_flux, name, None)
            if isinstance(cls, type):
                classes.append(cls)
    import diffusers.models.attention_processor as ap
    cls = getattr(ap, "FluxAttnProcessor2_0", None)
    if isinstance(cls, type) and cls not in classes:
        classes.append(cls)
    return tuple(classes)


def _top_left_causal(sq, sk, device):
    """SDPA's is_causal for sq != sk: query i sees keys j <= i."""
    i = torch.arange(sq, device=device)[:, None]
    return torch.arange(sk, device=device)[None, :] <= i


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         return_lse=False):
    """torch SDPA's computation on [B, S, H, D] tensors (no transposes), on
    fmha: attn_mask boolean (True = attend) or additive, broadcastable to
    [B, H, Sq, Sk], or [B, Sk] (a key padding mask, as diffusers' native
    backend reads a 2-d mask of that shape); is_causal
    aligned top-left as SDPA's (fmha's own causal, aligned bottom-right, is
    the same when Sq == Sk); KV heads may be fewer than query heads (each
    serving H / Hkv of them). Returns out [B, Sq, H, Dv], or (out, lse
    [B, H, Sq] float32)."""
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise ValueError(f"fmha needs query, key and value of one dtype, got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}; cast the model to one dtype")
    sq, sk = query.shape[1], key.shape[1]
    if is_causal and attn_mask is not None:
        raise ValueError("attention with both attn_mask and is_causal=True: pass one (torch "
                         "SDPA refuses the pair too); fold the causal mask into attn_mask")
    if attn_mask is not None and attn_mask.dim() == 2 and \
            tuple(attn_mask.shape) == (query.shape[0], sk):
        attn_mask = attn_mask[:, None, None, :]  # [B, Sk]: diffusers' key padding mask
    causal = bool(is_causal)
    if causal and sq != sk:
        attn_mask, causal = _top_left_causal(sq, sk, query.device), False
    return _api.attention(query, key, value, causal=causal, softmax_scale=scale,
                          dropout_p=float(dropout_p), attn_mask=attn_mask, return_lse=return_lse)


def _fmha_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, return_lse=False, _parallel_config=None):
    """diffusers' dispatcher calls this for the "fmha" backend."""
    if _parallel_config is not None:
        raise ValueError("the fmha attention backend has no context-parallel form: run the "
                         "model without a ParallelConfig, or use fmha.distributed for sequence "
                         "parallelism")
    return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, return_lse)


def _register_backend():
    """Adds "fmha" to diffusers' AttentionBackendName and registers
    _fmha_backend with the dispatcher; a no-op where diffusers has no
    dispatcher. Returns the backend's enum member, or None."""
    try:
        from diffusers.models import attention_dispatch as ad
    except ImportError:  # pragma: no cover - diffusers < 0.35
        return None
    names = ad.AttentionBackendName
    member = names._value2member_map_.get(BACKEND_NAME)
    if member is None:
        # diffusers lists its backends in an Enum that has no public way to
        # grow: the member is made as Enum makes its own.
        member = str.__new__(names, BACKEND_NAME)
        member._name_, member._value_ = "FMHA", BACKEND_NAME
        member.__objclass__ = names
        member.__init__(BACKEND_NAME)
        names._member_map_["FMHA"] = member
        names._value2member_map_[BACKEND_NAME] = member
        names._member_names_.append("FMHA")
        type.__setattr__(names, "FMHA", member)
    checks = [c for c in (getattr(ad, "_check_device", None), getattr(ad, "_check_shape", None))
              if c is not None]
    ad._AttentionBackendRegistry.register(member, constraints=checks)(_fmha_backend)
    if _env_wants_fmha():
        ad._AttentionBackendRegistry.set_active_backend(member)
    return member


BACKEND = _register_backend()


class FmhaAttnProcessor:
    """AttnProcessor2_0's computation on fmha, for diffusers' `Attention`."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 temb=None, *args, **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channels, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)
        batch = hidden_states.shape[0]
        if attention_mask is not None:
            # AttnProcessor2_0's steps: [B, Sk] or [B, 1, Sk] -> [B, H, 1 or Sq, Sk]
            n_keys = (hidden_states if encoder_hidden_states is None
                      else encoder_hidden_states).shape[1]
            attention_mask = attn.prepare_attention_mask(attention_mask, n_keys, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            context = hidden_states
        elif attn.norm_cross:
            context = attn.norm_encoder_hidden_states(encoder_hidden_states)
        else:
            context = encoder_hidden_states
        key = attn.to_k(context)
        value = attn.to_v(context)

        head_dim = key.shape[-1] // attn.heads
        # [B, S, H, D]: fmha's layout, no transposes needed
        query = query.view(batch, -1, attn.heads, head_dim)
        key = key.view(batch, -1, attn.heads, head_dim)
        value = value.view(batch, -1, attn.heads, value.shape[-1] // attn.heads)
        # norm_q / norm_k (RMSNorm / LayerNorm over head_dim) act on the last dim
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        hidden_states = sdpa(query, key, value, attention_mask)
        hidden_states = hidden_states.reshape(batch, -1, attn.heads * hidden_states.shape[-1])
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channels, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class FmhaFluxAttnProcessor:
    """FluxAttnProcessor's computation on fmha, for Flux's `FluxAttention`:
    text tokens (encoder_hidden_states, through add_*_proj and
    norm_added_q/k) joined before the image tokens, image_rotary_emb applied
    to the joint q and k, outputs split back (to_out / to_add_out)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        query, key, value, enc_q, enc_k, enc_v = _flux._get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))

        if attn.added_kv_proj_dim is not None and encoder_hidden_states is not None:
            enc_q = attn.norm_added_q(enc_q.unflatten(-1, (-1, attn.head_dim)))
            enc_k = attn.norm_added_k(enc_k.unflatten(-1, (-1, attn.head_dim)))
            enc_v = enc_v.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([enc_q, query], dim=1)
            key = torch.cat([enc_k, key], dim=1)
            value = torch.cat([enc_v, value], dim=1)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        out = sdpa(query, key, value, attention_mask).flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return out
        n_text = encoder_hidden_states.shape[1]
        enc_out, out = out.split_with_sizes([n_text, out.shape[1] - n_text], dim=1)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        enc_out = attn.to_add_out(enc_out.contiguous())
        return out, enc_out


# processor class -> fmha processor class
SUPPORTED_PROCESSORS = {AttnProcessor: FmhaAttnProcessor, AttnProcessor2_0: FmhaAttnProcessor}
for _cls in _flux_processor_classes():
    SUPPORTED_PROCESSORS[_cls] = FmhaFluxAttnProcessor


def _replacement(proc):
    if isinstance(proc, (FmhaAttnProcessor, FmhaFluxAttnProcessor)):
        return proc
    cls = SUPPORTED_PROCESSORS.get(type(proc))  # exact class: subclasses may change semantics
    return cls() if cls is not None else None


def set_fmha_attention(model, strict=False):
    """Switch the attention modules of `model` (a diffusers ModelMixin such
    as a UNet2DConditionModel, FluxTransformer2DModel, or a single Attention
    module) to fmha, in place.

    Supported processors, replaced: AttnProcessor and AttnProcessor2_0
    (-> FmhaAttnProcessor), FluxAttnProcessor / FluxAttnProcessor2_0
    (-> FmhaFluxAttnProcessor). Any other processor (SD3's
    JointAttnProcessor2_0, IP-Adapter, added-KV, custom ones) is left as it
    is, or raises ValueError when strict=True. Returns the names of the
    attention processors switched to fmha."""
    if hasattr(model, "attn_processors") and hasattr(model, "set_attn_processor"):
        current = model.attn_processors
    elif hasattr(model, "set_processor") and hasattr(model, "processor"):
        current = {"processor": model.processor}
    else:
        raise TypeError(f"set_fmha_attention needs a diffusers model with set_attn_processor "
                        f"or an attention module, got {type(model).__name__}")
    new, switched, left = {}, [], []
    for name, proc in current.items():
        repl = _replacement(proc)
        if repl is None:
            left.append(f"{name} ({type(proc).__name__})")
            new[name] = proc
        else:
            switched.append(name)
            new[name] = repl
    if strict and left:
        raise ValueError("fmha has no processor for: " + ", ".join(left) +
                         "; call set_fmha_attention(model, strict=False) to switch the others")
    if "processor" in new and len(new) == 1 and not hasattr(model, "set_attn_processor"):
        model.set_processor(new["processor"])
    else:
        model.set_attn_processor(new)
    return switched
