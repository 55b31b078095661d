"""captured_inputs.py — q, k, v as diffusers' own transformers hand them to attention, for the
accuracy measurements of the low-precision modes (lowp_modes.py --captured).

Builds a Flux.1 and a Wan 2.1 transformer from small configs (two heads of head dim 128, the
real models' head dim; one or two blocks) with random weights from a fixed seed, runs one forward
on random latents on the CPU with diffusers' native backend, and keeps the q, k, v of the first
self-attention call: what the model computed through its own projections, QK RMS norm and
rotary embedding (Flux: 1024 image tokens after 64 text tokens, joint attention; Wan: 1024 video
tokens, 4 frames of 16 x 16 patches). No downloads: the weights are not trained ones, so the
channel outliers and attention sinks of trained models (dit_inputs.py's `dit` kind imitates
those) are not in them; what is in them is the real models' normalisation and rotary structure.

usage: from captured_inputs import capture; q, k, v = capture("flux")   # [S, H, D] float32
needs torch and diffusers (pip install torch diffusers).
"""
import contextlib

import numpy as np

MODELS = ("flux", "wan")


@contextlib.contextmanager
def _first_sdpa_call(store):
    """Records the q, k, v of the first torch SDPA call made inside (the native backend's)."""
    import torch.nn.functional as F
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if not store:  # diffusers passes query, key, value by name
            qkv = args[:3] + tuple(kwargs[n] for n in ("query", "key", "value")[len(args):])
            store.extend(t.detach().clone() for t in qkv)
        return real(*args, **kwargs)
    F.scaled_dot_product_attention = spy
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def _flux(torch):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32,
        axes_dims_rope=(16, 56, 56)).eval()
    side, n_txt = 32, 64
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    inputs = dict(hidden_states=torch.randn(1, side * side, 16),
                  encoder_hidden_states=torch.randn(1, n_txt, 64),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                  img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(n_txt, 3), return_dict=False)
    return model, inputs


def _wan(torch):
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=64, freq_dim=32, ffn_dim=512, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024).eval()
    inputs = dict(hidden_states=torch.randn(1, 16, 4, 32, 32), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 64, 64), return_dict=False)
    return model, inputs


def capture(name, seed=0):
    """q, k, v [S, H, D] float32 of model `name`'s first self-attention (MODELS)."""
    import torch
    from diffusers.models import attention_dispatch as ad
    model, inputs = {"flux": _flux, "wan": _wan}[name](torch)
    torch.manual_seed(seed)
    store = []
    with torch.no_grad(), _first_sdpa_call(store), ad.attention_backend("native"):
        model(**inputs)
    if len(store) != 3:
        raise RuntimeError("%s: no attention call reached torch SDPA" % name)
    # SDPA's [B, H, S, D] -> [S, H, D] of the first sequence
    return tuple(t[0].transpose(0, 1).float().numpy().astype(np.float32) for t in store)


if __name__ == "__main__":
    for name in MODELS:
        for label, t in zip("qkv", capture(name)):
            ch = np.abs(t).mean(axis=(0, 1))
            print("%s %s %s: std %.3f, |max| %.2f, channel |mean| max/median %.1f"
                  % (name, label, list(t.shape), t.std(), np.abs(t).max(), ch.max() / np.median(ch)))
