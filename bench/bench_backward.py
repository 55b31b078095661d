"""bench_backward.py — fmha's CUDA backward against torch SDPA's backward (cuDNN, flash =
FlashAttention-2) in the same process on the same inputs: bf16 q, k, v [B, H, S, D], dout
N(0, 1). fmha is called through ctypes on libfmha (the forward once for out and lse, then
fmha_layer_backward timed); torch's backward is torch.autograd.grad of its own forward's output,
timed alone (retain_graph). Also forward + backward together for each. FLOPs: the backward counts
2.5 forwards (FlashAttention's convention), causal halves both. Prints a Markdown table of TFLOP/s
and ratios, and the relative L2 difference of fmha's dq, dk, dv from torch flash's (cuDNN's where
flash cannot run).

usage: python3 bench/bench_backward.py [--lib build/libfmha.so] [--quick] [--repeats N]
"""
import argparse
import ctypes as C
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda import Args, AttnMask, Config, Tensor, flops, load_lib, view  # noqa: E402  (the one ctypes mirror)

# (name, batch, seqlen, heads, kv heads, head dim, causal)
SHAPES = [
    ("flux_1024", 1, 4608, 24, 24, 128, False),
    ("wan14b_480p", 1, 32760, 40, 40, 128, False),
    ("llama_gqa_causal", 1, 8192, 32, 8, 128, True),
    ("fa3grid_d64", 1, 16384, 32, 32, 64, False),
    ("fa3grid_d128", 1, 16384, 16, 16, 128, False),
    ("fa3grid_d128_causal", 1, 16384, 16, 16, 128, True),
    ("fa3grid_d256", 1, 16384, 8, 8, 256, False),
]
QUICK = {"flux_1024", "llama_gqa_causal", "fa3grid_d128", "fa3grid_d256"}
BF16, CUDA = 2, 1


class BwdArgs(C.Structure):
    _fields_ = [("q", Tensor), ("k", Tensor), ("v", Tensor), ("out", Tensor), ("dout", Tensor),
                ("lse", C.c_void_p), ("dq", Tensor), ("dk", Tensor), ("dv", Tensor),
                ("cu_seqlens_q", C.c_void_p), ("cu_seqlens_k", C.c_void_p),
                ("varlen_batch", C.c_int64), ("max_seqlen_q", C.c_int64),
                ("max_seqlen_k", C.c_int64), ("seed", C.c_uint64), ("offset", C.c_uint64),
                ("stream", C.c_void_p), ("mask", AttnMask), ("alibi_slopes", C.c_void_p),
                ("alibi_stride_batch", C.c_int64), ("sinks", C.c_void_p), ("dsinks", C.c_void_p)]


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libfmha.so")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    lib = load_lib(args.lib)
    lib.fmha_layer_backward.argtypes = [C.c_void_p, C.POINTER(BwdArgs)]
    rows = []
    for name, b, s, h, hkv, d, causal in SHAPES:
        if args.quick and name not in QUICK:
            continue
        torch.manual_seed(0)
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(dout)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        cfg = Config()
        lib.fmha_config_init(C.byref(cfg), h, hkv, d)
        cfg.dtype, cfg.device, cfg.causal = BF16, CUDA, int(causal)
        layer = C.c_void_p()
        if lib.fmha_layer_init(C.byref(layer), C.byref(cfg)) != 0:
            sys.exit("fmha_layer_init: " + lib.fmha_last_error().decode())
        stream = C.c_void_p(torch.cuda.current_stream().cuda_stream)
        fa = Args()
        fa.q, fa.k, fa.v, fa.out = view(q), view(k), view(v), view(out)
        fa.lse, fa.stream = lse.data_ptr(), stream
        ba = BwdArgs()
        ba.q, ba.k, ba.v, ba.out, ba.dout = view(q), view(k), view(v), view(out), view(dout)
        ba.lse, ba.stream = lse.data_ptr(), stream
        ba.dq, ba.dk, ba.dv = view(dq), view(dk), view(dv)

        def fmha_fwd():
            lib.fmha_layer_forward(layer, C.byref(fa))

        def fmha_bwd():
            lib.fmha_layer_backward(layer, C.byref(ba))

        def fmha_both():
            fmha_fwd()
            fmha_bwd()

        fmha_fwd()
        if lib.fmha_layer_backward(layer, C.byref(ba)) != 0:
            sys.exit("fmha_layer_backward: " + lib.fmha_last_error().decode())
        torch.cuda.synchronize()
        fl = flops(b, s, s, h, d, causal)
        row = {"shape": f"{name} [{b}, {s}, {h}/{hkv}, {d}]{' causal' if causal else ''}"}
        timings = {"fmha": [], "fmha_fb": []}
        peers = {}
        for backend, label in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "fa2")):
            try:
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel([backend]):
                    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=hkv != h)
                    torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True)

                    def bwd(o=o, qq=qq, kk=kk, vv=vv):
                        torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True)

                    def both(qq=qq, kk=kk, vv=vv):
                        oo = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                            enable_gqa=hkv != h)
                        torch.autograd.grad(oo, (qq, kk, vv), dout)

                    grads = torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True)
                    peers[label] = (bwd, both, grads)
                    timings[label], timings[label + "_fb"] = [], []
            except Exception as e:  # a backend that refuses the shape
                print(f"{name}: {label} unavailable: {str(e).splitlines()[0][:100]}")
        for _ in range(args.repeats):
            timings["fmha"].append(do_bench(fmha_bwd, warmup=10, rep=100, return_mode="median"))
            timings["fmha_fb"].append(do_bench(fmha_both, warmup=10, rep=100, return_mode="median"))
            for label, (bwd, both, _) in peers.items():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION if label == "cudnn" else SDPBackend.FLASH_ATTENTION]):
                    timings[label].append(do_bench(bwd, warmup=10, rep=100, return_mode="median"))
                    timings[label + "_fb"].append(do_bench(both, warmup=10, rep=100, return_mode="median"))
        for key, ts in timings.items():
            ms = statistics.median(ts)
            row[key] = (2.5 if not key.endswith("_fb") else 3.5) * fl / ms / 1e9
        ref = peers.get("fa2", peers.get("cudnn"))
        if ref:
            row["err"] = max(rel_l2(x, y) for x, y in zip((dq, dk, dv), ref[2]))
        rows.append(row)
        lib.fmha_layer_free(layer)
        del q, k, v, dout, out, dq, dk, dv, peers
        torch.cuda.empty_cache()

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| shape | fmha bwd | cuDNN bwd | FA2 bwd | fmha/cuDNN | fmha/FA2 | fmha fwd+bwd | cuDNN fwd+bwd "
          "| FA2 fwd+bwd | rel L2 vs torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for r in rows:
        c, f2 = r.get("cudnn", nan), r.get("fa2", nan)
        print(f"| {r['shape']} | {r['fmha']:.1f} | {c:.1f} | {f2:.1f} | {r['fmha'] / c:.3f} | "
              f"{r['fmha'] / f2:.3f} | {r['fmha_fb']:.1f} | {r.get('cudnn_fb', nan):.1f} | "
              f"{r.get('fa2_fb', nan):.1f} | {r.get('err', nan):.4f} |")


if __name__ == "__main__":
    main()
