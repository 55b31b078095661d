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
    orig = fd.sdpa
    try:
        fd.sdpa = lambda q, k, v, mask=None: orig(q, k, v, mask, scale=2.0 * q.shape[-1] ** -0.5)
        x = torch.randn(2, 7, 32)
        want, got = _both(_attention(), x)
        assert not _close(want, got)
    finally:
        fd.sdpa = orig


@pytest.mark.parametrize("kind", ["additive", "bool", "per_query"])
def test_masks(kind):
    """The processor passes AttnProcessor2_0's prepared masks to fmha."""
    x = torch.randn(2, 6, 32)
    if kind == "additive":
        mask = torch.zeros(2, 1, 6)
        mask[0, :, -2:] = float("-inf")
        mask[1, :, 1] = -3.0
    elif kind == "bool":
        mask = torch.tensor([[[True] * 5 + [False]], [[True, False] * 3]])
    else:
        mask = torch.randn(2, 6, 6)
    want, got = _both(_attention(), x, attention_mask=mask)
    assert _close(want, got), (want - got).abs().max().item()


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


# ------------------------------------------------------------------ the dispatcher backend

ad = pytest.importorskip("diffusers.models.attention_dispatch")


def _qkv(sq=7, sk=9, h=4, hkv=4, d=16, dtype=torch.float32, grad=False, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, s, n, d, generator=g, dtype=dtype).requires_grad_(grad)
            for s, n in ((sq, h), (sk, hkv), (sk, hkv))]


def _padding(sk):
    m = torch.ones(2, sk, dtype=torch.bool)
    m[0, -3:] = False
    return m


DISPATCH_CASES = {
    "plain": dict(),
    "scale": dict(scale=0.3),
    "causal_square": dict(is_causal=True, sq=9),
    "causal_fewer_queries": dict(is_causal=True, sq=5),   # SDPA's top-left alignment
    "causal_more_queries": dict(is_causal=True, sq=12),
    "bool_4d": dict(mask=lambda sq, sk: torch.rand(2, 1, sq, sk) < 0.8),
    "additive_4d": dict(mask=lambda sq, sk: torch.randn(2, 4, sq, sk)),
    "padding_2d": dict(mask=lambda sq, sk: _padding(sk)),
    "gqa": dict(hkv=2, enable_gqa=True),
}


@pytest.mark.parametrize("case", sorted(DISPATCH_CASES))
def test_dispatch_matches_native(case):
    kw = dict(DISPATCH_CASES[case])
    sq = kw.pop("sq", 7)
    q, k, v = _qkv(sq=sq, hkv=kw.pop("hkv", 4))
    if "mask" in kw:
        torch.manual_seed(4)
        m = kw.pop("mask")(sq, 9)
        if m.dtype == torch.bool:
            m[..., 0] = True  # no row without keys (SDPA answers those NaN)
        kw["attn_mask"] = m
    want = ad.dispatch_attention_fn(q, k, v, backend=ad.AttentionBackendName.NATIVE, **kw)
    got = ad.dispatch_attention_fn(q, k, v, backend=fd.BACKEND, **kw)
    assert got.shape == want.shape
    assert _close(want, got), (want - got).abs().max().item()


def test_dispatch_gradients_and_lse():
    mask = torch.randn(2, 1, 7, 9)

    def grads(backend):
        q, k, v = _qkv(grad=True, hkv=2)
        out = ad.dispatch_attention_fn(q, k, v, attn_mask=mask, enable_gqa=True, backend=backend)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        return [t.grad for t in (q, k, v)]

    for g, w in zip(grads(fd.BACKEND), grads(ad.AttentionBackendName.NATIVE)):
        assert _close(w, g), (w - g).abs().max().item()
    q, k, v = _qkv()
    out, lse = ad.dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True},
                                        backend=fd.BACKEND)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 4.0
    assert lse.shape == (2, 4, 7)
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() < 1e-5


def test_dispatch_refusals():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        fd.sdpa(q, k, v, attn_mask=torch.ones(7, 9, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="context-parallel"):
        fd._fmha_backend(q, k, v, _parallel_config=object())
    with pytest.raises(ValueError, match="one dtype"):
        fd.sdpa(q, k.half(), v)


def _tiny_wan():
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()


def _wan_inputs():
    torch.manual_seed(5)
    return dict(hidden_states=torch.randn(2, 4, 3, 4, 6), timestep=torch.tensor([10, 500]),
                encoder_hidden_states=torch.randn(2, 11, 16), return_dict=False)


@pytest.mark.parametrize("model,inputs", [(_tiny_flux, _flux_inputs), (_tiny_wan, _wan_inputs)],
                         ids=["flux", "wan"])
def test_models_on_the_backend(model, inputs):
    """Flux and Wan transformers (tiny configs, random weights) give the
    native backend's output with set_attention_backend("fmha") and inside
    attention_backend("fmha"), and their calls do reach fmha."""
    m, x = model(), inputs()
    with torch.no_grad():
        want = m(**x)[0]
    calls = []
    orig = fd._api.attention
    fd._api.attention = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
    try:
        m.set_attention_backend("fmha")
        with torch.no_grad():
            got = m(**x)[0]
        n = len(calls)
        assert n > 0
        m.set_attention_backend("native")
        with ad.attention_backend("fmha"), torch.no_grad():
            again = model()(**x)[0]
        assert len(calls) > n
    finally:
        fd._api.attention = orig
    assert want.shape == got.shape
    assert _close(want, got), (want - got).abs().max().item()
    assert _close(want, again), (want - again).abs().max().item()


def test_environment_variable():
    """DIFFUSERS_ATTN_BACKEND=fmha: with fmha.diffusers imported first, the
    dispatcher's default backend is fmha."""
    import os
    import subprocess
    import sys
    code = ("import fmha.diffusers\n"
            "from diffusers.models import attention_dispatch as ad\n"
            "print(ad._AttentionBackendRegistry.get_active_backend()[0].value)\n")
    env = dict(os.environ, DIFFUSERS_ATTN_BACKEND="fmha")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "fmha"
