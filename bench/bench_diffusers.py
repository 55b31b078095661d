"""bench_diffusers.py — diffusers transformers on the "fmha" attention backend
(fmha.diffusers) beside diffusers' native backends (torch SDPA: its default
choice, and its flash, cuDNN and memory-efficient kernels), in one process
on a CUDA GPU, at real widths and token counts with random bf16 weights:

- Flux.1: one double-stream and one single-stream block (24 heads x 128),
  1024x1024 (4096 image + 512 text tokens);
- Wan 2.1 14B: one block (40 heads x 128), 480p x 81 frames (32760 video
  tokens) with 512 text tokens (cross-attention).

Per backend: the model's forward (median of --repeat, after a warm-up), its
attention calls alone through dispatch_attention_fn on the model's shapes,
and the output's relative L2 distance to the native backend's.

    python3 bench/bench_diffusers.py [--lib build/libfmha.so] [--out bench/RESULTS.md]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results_md  # noqa: E402

BACKENDS = ["native", "_native_flash", "_native_cudnn", "_native_efficient", "fmha"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default="build/libfmha.so")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--models", default="flux,wan")
    results_md.add_arguments(ap, {"diffusers-cuda": "diffusers models on fmha (GPU)"})
    opt = ap.parse_args()
    os.environ["FMHA_LIBRARY"] = os.path.abspath(opt.lib)
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import torch
    import fmha.diffusers  # noqa: F401  (registers the backend)
    from diffusers.models import attention_dispatch as ad

    dev, dt = "cuda", torch.bfloat16

    def timed(fn):
        for _ in range(2):
            fn()
        ts = []
        for _ in range(opt.repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return sorted(ts)[len(ts) // 2]

    def rel_l2(x, y):
        x, y = x.double(), y.double()
        return ((x - y).norm() / y.norm()).item()

    def flux():
        from diffusers import FluxTransformer2DModel
        torch.manual_seed(0)
        m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                   attention_head_dim=128, num_attention_heads=24,
                                   joint_attention_dim=4096, pooled_projection_dim=768,
                                   axes_dims_rope=(16, 56, 56))
        h = w = 64
        ids = torch.zeros(h, w, 3)
        ids[..., 1] = torch.arange(h)[:, None]
        ids[..., 2] = torch.arange(w)[None, :]
        x = dict(hidden_states=torch.randn(1, h * w, 64), encoder_hidden_states=torch.randn(
            1, 512, 4096), pooled_projections=torch.randn(1, 768), timestep=torch.tensor([0.5]),
            img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(512, 3), return_dict=False)
        return m, x, [("joint self", (1, 4608, 24, 128), (1, 4608, 24, 128))]

    def wan():
        from diffusers import WanTransformer3DModel
        torch.manual_seed(0)
        m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=40,
                                  attention_head_dim=128, in_channels=16, out_channels=16,
                                  text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=1,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                  rope_max_seq_len=1024)
        x = dict(hidden_states=torch.randn(1, 16, 21, 60, 104), timestep=torch.tensor([500]),
                 encoder_hidden_states=torch.randn(1, 512, 4096), return_dict=False)
        return m, x, [("self", (1, 32760, 40, 128), (1, 32760, 40, 128)),
                      ("cross", (1, 32760, 40, 128), (1, 512, 40, 128))]

    rows = []
    for name in opt.models.split(","):
        model, inputs, attn_shapes = {"flux": flux, "wan": wan}[name]()
        model = model.to(dev, dt).eval()
        inputs = {k: (v.to(device=dev, dtype=dt) if v.is_floating_point() and k != "timestep"
                      else v.to(device=dev)) if torch.is_tensor(v) else v
                  for k, v in inputs.items()}
        qkv = []
        for what, qs, ks in attn_shapes:
            g = torch.Generator(device=dev).manual_seed(1)
            qkv.append((what, torch.randn(qs, generator=g, device=dev, dtype=dt),
                        torch.randn(ks, generator=g, device=dev, dtype=dt),
                        torch.randn(ks, generator=g, device=dev, dtype=dt)))
        want = None
        for backend in BACKENDS:
            try:
                model.set_attention_backend(backend)
                with torch.no_grad():
                    out = model(**inputs)[0]
                    ms = timed(lambda: model(**inputs))
                    attn_ms = sum(timed(lambda: ad.dispatch_attention_fn(
                        q, k, v, backend=ad.AttentionBackendName(backend)))
                        for _, q, k, v in qkv)
            except (RuntimeError, ValueError) as e:  # a kernel SDPA cannot run on this GPU
                print(f"{name} {backend}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            if want is None:
                want = out
            rows.append([name, backend, "%.2f" % ms, "%.2f" % attn_ms,
                         "%.1e" % rel_l2(out, want)])
            print(" ".join(rows[-1]), flush=True)
        del model
        torch.cuda.empty_cache()
    body = results_md.table(["model", "backend", "model ms", "attention ms", "rel-L2 vs native"],
                            rows, "llrrr")
    base = {r[0]: float(r[2]) for r in rows if r[1] == "native"}
    ratios = [f"{r[0]}: native / fmha {base[r[0]] / float(r[2]):.2f}x (model)" for r in rows
              if r[1] == "fmha" and r[0] in base]
    print(body)
    print("\n".join(ratios))
    if opt.out:
        import diffusers
        results_md.write(opt, [("Machine", results_md.gpu_machine(torch)),
                               ("Library", f"`{opt.lib}`"),
                               ("Peers", f"diffusers {diffusers.__version__}'s native backends "
                                         "(torch SDPA), same process, same inputs")],
                         body + "\n\n" + "; ".join(ratios) + "\n")


if __name__ == "__main__":
    main()
