"""fmha.diffusers — run a diffusers model's attention on fmha.

    import fmha.diffusers
    fmha.diffusers.set_fmha_attention(pipe.unet)         # or pipe.transformer
    image = pipe(prompt).images[0]

Importing this module imports torch and diffusers (`import fmha` alone
imports neither). Two processors:

- FmhaAttnProcessor: for diffusers' `Attention` modules (UNet / DiT
  self- and cross-attention), the same steps as diffusers'
  AttnProcessor2_0 (spatial_norm, 4-D inputs, group_norm, norm_cross,
  to_q/to_k/to_v, norm_q/norm_k, heads split, to_out, residual_connection,
  rescale_output_factor) with fmha's attention in place of
  torch.nn.functional.scaled_dot_product_attention. Like AttnProcessor2_0
  it uses the default softmax scale 1/sqrt(head_dim) (attn.scale is not
  read, as in AttnProcessor2_0).
- FmhaFluxAttnProcessor: for Flux's `FluxAttention` (FluxAttnProcessor /
  FluxAttnProcessor2_0): joint text+image tokens (text first) and rotary
  embeddings applied to q and k before attention, fused or separate
  projections.

Limits: attention masks that mask nothing (bool all True, or additive all
zero) are accepted and dropped; any other attention_mask raises ValueError
(fmha has no arbitrary additive/boolean masks). Attention dropout is not
used by these processors (AttnProcessor2_0 uses none either). Other
processors (SD3's JointAttnProcessor2_0, IP-Adapter, LoRA-specific, added-KV,
Flux IP-Adapter, ...) are not replaced by set_fmha_attention.
"""
import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from .flash_attn import flash_attn_func

try:  # diffusers >= 0.35: FluxAttnProcessor in transformer_flux
    from diffusers.models.transformers import transformer_flux as _flux
except ImportError:  # pragma: no cover - very old diffusers
    _flux = None

__all__ = ["FmhaAttnProcessor", "FmhaFluxAttnProcessor", "set_fmha_attention",
           "SUPPORTED_PROCESSORS"]


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


def _check_mask(attention_mask):
    """None for masks that hide nothing; ValueError for any other mask."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        hides_nothing = bool(attention_mask.all())
    else:  # additive mask
        hides_nothing = attention_mask.is_floating_point() and not bool(attention_mask.any())
    if hides_nothing:
        return None
    raise ValueError(
        "fmha's diffusers processor got an attention_mask that masks some keys; fmha supports "
        "no arbitrary attention masks. Call the model with attention_mask=None (e.g. "
        "no padding mask for the text encoder states), or keep the default processor "
        "(attn.set_processor(AttnProcessor2_0())) for this module.")


def _attend(query, key, value):
    """[B, S, H, D] query/key/value -> [B, Sq, H, D], fmha, default scale."""
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise ValueError(f"fmha needs query, key and value of one dtype, got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}; cast the model to one dtype")
    return flash_attn_func(query, key, value, dropout_p=0.0, causal=False)


class FmhaAttnProcessor:
    """AttnProcessor2_0's computation on fmha, for diffusers' `Attention`."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 temb=None, *args, **kwargs):
        attention_mask = _check_mask(attention_mask)
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channels, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)
        batch = hidden_states.shape[0]

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

        hidden_states = _attend(query, key, value)
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

        attention_mask = _check_mask(attention_mask)
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

        out = _attend(query, key, value).flatten(2, 3).to(query.dtype)

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
