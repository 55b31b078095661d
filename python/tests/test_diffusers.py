"""fmha.diffusers: diffusers' Attention and Flux attention modules give the
same outputs with fmha's processors as with diffusers' default (torch SDPA)
ones. Tiny randomly initialised float32 modules on the CPU; skipped without
torch or diffusers."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import fmha.diffusers as fd  # noqa: E402
from diffusers.models.attention_processor import Attention, AttnProcessor2_0  # noqa: E402

# float32 on both sides; SDPA's CPU kernel and fmha's differ only in summation
# order and the online softmax, ~1e-6 on these O(1) outputs.
ATOL = 1e-4


def _close(a, b):
    return (a - b).abs().max().item() < ATOL


def _attention(**kw):
    torch.manual_seed(0)
    args = dict(query_dim=32, heads=4, dim_head=8)
    args.update(kw)
    return Attention(**args).eval()


def _both(module, *args, **kwargs):
    module.set_processor(AttnProcessor2_0())
    with torch.no_grad():
        want = module(*args, **kwargs)
    fd.set_fmha_attention(module)
    assert isinstance(module.processor, fd.FmhaAttnProcessor)
    with torch.no_grad():
        got = module(*args, **kwargs)
    return want, got


@pytest.mark.parametrize("case", ["self", "cross", "qk_norm", "4d_residual", "norm_cross"])
def test_attention_matches_sdpa(case):
    torch.manual_seed(1)
    x = torch.randn(2, 7, 32)
    if case == "self":
        want, got = _both(_attention(), x)
    elif case == "cross":
        ctx = torch.randn(2, 5, 24)
        want, got = _both(_attention(cross_attention_dim=24), x, encoder_hidden_states=ctx)
    elif case == "qk_norm":
        want, got = _both(_attention(qk_norm="rms_norm", bias=True), x)
    elif case == "4d_residual":
        img = torch.randn(2, 32, 3, 5)
        mod = _attention(norm_num_groups=4, residual_connection=True, rescale_output_factor=2.0)
        want, got = _both(mod, img)
    else:
        ctx = torch.randn(2, 5, 24)
        mod = _attention(cross_attention_dim=24, cross_attention_norm="layer_norm")
        want, got = _both(mod, x, encoder_hidden_states=ctx)
    assert want.shape == got.shape
    assert _close(want, got), (want - got).abs().max().item()


def test_wrong_scale_is_caught():
    """The comparison can fail: a processor attending with a doubled scale."""
    orig = fd._attend
    try:
        fd._attend = lambda q, k, v: fmha_scaled(q, k, v, 2.0)
        x = torch.randn(2, 7, 32)
        want, got = _both(_attention(), x)
        assert not _close(want, got)
    finally:
        fd._attend = orig


def fmha_scaled(q, k, v, factor):
    return fd.flash_attn_func(q, k, v, softmax_scale=factor * q.shape[-1] ** -0.5)


def test_masks():
    mod = _attention()
    fd.set_fmha_attention(mod)
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        ref = mod(x)
        # masks that hide nothing are dropped
        assert torch.equal(mod(x, attention_mask=torch.ones(1, 1, 6, dtype=torch.bool)), ref)
        assert torch.equal(mod(x, attention_mask=torch.zeros(1, 1, 6)), ref)
        mask = torch.zeros(1, 1, 6)
        mask[..., -2:] = float("-inf")
        with pytest.raises(ValueError, match="attention_mask=None"):
            mod(x, attention_mask=mask)
        with pytest.raises(ValueError, match="attention_mask"):
            mod(x, attention_mask=torch.tensor([[[True] * 5 + [False]]]))


def test_unsupported_processor_left_alone():
    from diffusers.models.attention_processor import AttnAddedKVProcessor
    mod = _attention()
    mod.set_processor(AttnAddedKVProcessor())
    assert fd.set_fmha_attention(mod) == []
    assert isinstance(mod.processor, AttnAddedKVProcessor)
    with pytest.raises(ValueError, match="AttnAddedKVProcessor"):
        fd.set_fmha_attention(mod, strict=True)


def _tiny_flux():
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=10,
        axes_dims_rope=(4, 6, 6)).eval()


def _flux_inputs():
    torch.manual_seed(2)
    h, w, n_txt = 3, 4, 5
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(2, h * w, 8),
                encoder_hidden_states=torch.randn(2, n_txt, 12),
                pooled_projections=torch.randn(2, 10), timestep=torch.tensor([0.3, 0.7]),
                img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(n_txt, 3),
                return_dict=False)


def test_flux_transformer_matches_default():
    model = _tiny_flux()
    inputs = _flux_inputs()
    with torch.no_grad():
        want = model(**inputs)[0]
    switched = fd.set_fmha_attention(model)
    assert len(switched) == 2  # one double-stream, one single-stream block
    assert all(isinstance(p, fd.FmhaFluxAttnProcessor) for p in model.attn_processors.values())
    with torch.no_grad():
        got = model(**inputs)[0]
    assert want.shape == got.shape
    assert _close(want, got), (want - got).abs().max().item()


def test_flux_fused_projections():
    model = _tiny_flux()
    inputs = _flux_inputs()
    with torch.no_grad():
        want = model(**inputs)[0]
    model.fuse_qkv_projections()
    assert len(fd.set_fmha_attention(model)) == 2
    assert all(isinstance(p, fd.FmhaFluxAttnProcessor) for p in model.attn_processors.values())
    assert all(m.fused_projections for m in model.modules() if hasattr(m, "fused_projections"))
    with torch.no_grad():
        got = model(**inputs)[0]
    assert _close(want, got), (want - got).abs().max().item()
