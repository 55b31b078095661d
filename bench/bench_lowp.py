"""bench_lowp.py — fmha's low-precision layer modes on the GPU: bf16 q, k, v in, bf16 out,
quantization included (the path a model's bf16 attention layer takes), against fmha bf16 and
torch SDPA cuDNN bf16 in the same process, and the accuracy of each mode on Gaussian and on
DiT-like inputs (dit_inputs.py).

Modes (fmha_config.fp8_compute): per_tensor (e4m3, one scale per tensor), per_tensor with
fp8_smooth_k, int8_qk (INT8 Q K^T with K smoothed and q, k rotated; FP8 P V), int8_qk with
single-level P V accumulation forced (FMHA_FP8_ACCUM=single). Speed on the shapes of
bench_cuda.py (N(0, 1) inputs); accuracy on [1, ACC_TOKENS, 8, 128] inputs against a float64
reference over the first ACC_ROWS query rows of each head: relative L2, 1 - cosine similarity and
the largest absolute error.

usage: python3 bench/bench_lowp.py [--lib build/libfmha.so] [--quick] [--shape NAME ...] [--out FILE.md]

--quick: bench_cuda.py's quick shapes; --shape (repeatable): only these (with --quick: both).
"""
import argparse
import ctypes as C
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dit_inputs  # noqa: E402
import results_md  # noqa: E402
from bench_cuda import (BF16, CUDA, QUICK, SHAPES, Args, Config, env_set, flops, load_lib,  # noqa: E402
                        make_inputs, time_fn, view)

PER_TENSOR, INT8_QK = 1, 3  # fmha_fp8_compute
MODES = [("e4m3", PER_TENSOR, 0, None), ("e4m3 smooth-k", PER_TENSOR, 1, None),
         ("int8_qk", INT8_QK, 0, None), ("int8_qk single", INT8_QK, 0, "single")]
ACC_TOKENS, ACC_ROWS = 4096, 512
HEADINGS = {"lowp": "Low-precision layer modes on the GPU (bf16 in, quantization included)"}


def make_layer(lib, b, h, hkv, d, causal, fp8, smooth, accum, xs, out, stream):
    cfg = Config()
    lib.fmha_config_init(C.byref(cfg), h, hkv, d)
    cfg.dtype, cfg.causal, cfg.device = BF16, int(causal), CUDA
    cfg.fp8_compute, cfg.fp8_smooth_k = fp8, smooth
    a = Args()
    a.q, a.k, a.v = (view(x) for x in xs)
    a.out = view(out)
    a.stream = stream
    layer = C.c_void_p()
    with env_set("FMHA_FP8_ACCUM", accum):
        if lib.fmha_layer_init(C.byref(layer), C.byref(cfg)) != 0:
            sys.exit(f"layer: {lib.fmha_last_error().decode()}")

    def fn():
        if lib.fmha_layer_forward(layer, C.byref(a)) != 0:
            raise RuntimeError(lib.fmha_last_error().decode())
    return layer, fn


def reference(q, k, v, rows):
    """float64 attention of the first `rows` queries, [B, H, rows, D]."""
    q, k, v = (x.double() for x in (q, k, v))
    s = torch.einsum("bhsd,bhtd->bhst", q[:, :, :rows], k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhst,bhtd->bhsd", torch.softmax(s, -1), v)


def metrics(x, ref):
    x = x.double()
    d = x - ref
    rel = (d.norm() / ref.norm()).item()
    cos = (x * ref).sum() / (x.norm() * ref.norm())
    return rel, 1.0 - cos.item(), d.abs().max().item()


def accuracy(lib, stream):
    rows = []
    for kind in dit_inputs.KINDS:
        arrays = dit_inputs.make(ACC_TOKENS, 8, 128, seed=0, kind=kind)  # [S, H, D]
        q, k, v = (torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous().cuda().to(torch.bfloat16)
                   for a in arrays)
        ref = reference(q, k, v, ACC_ROWS)
        out = torch.empty_like(q)
        cases = [("bf16", 0, 0, None)] + MODES
        for label, fp8, smooth, accum in cases:
            layer, fn = make_layer(lib, 1, 8, 8, 128, False, fp8, smooth, accum, (q, k, v), out, stream)
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            rel, cos, mx = metrics(out[:, :, :ACC_ROWS], ref)
            print(f"accuracy {kind:9s} {label:15s} rel. L2 {rel:.3e}  1-cos {cos:.3e}  max {mx:.3e}",
                  flush=True)
            rows.append([kind, label, f"{rel:.3e}", f"{cos:.3e}", f"{mx:.3e}"])
            lib.fmha_layer_free(layer)
    return results_md.table(["inputs", "fmha mode", "rel. L2", "1 − cosine", "max abs error"], rows,
                            "llrrr")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libfmha.so")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", action="append", help="only these shapes of bench_cuda.py (repeatable)")
    results_md.add_arguments(ap, HEADINGS)
    opt = ap.parse_args()
    lib = load_lib(opt.lib)
    stream = torch.cuda.current_stream().cuda_stream
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    acc = accuracy(lib, stream)
    rows = []
    for name, b, sq, sk, h, hkv, d, causal in SHAPES:
        if (opt.quick and name not in QUICK) or (opt.shape and name not in opt.shape):
            continue
        q, k, v = make_inputs(b, sq, sk, h, hkv, d)
        out = torch.empty_like(q)
        fl = flops(b, sq, sk, h, d, causal)
        tf = {}
        for label, fp8, smooth, accum in [("bf16", 0, 0, None)] + MODES:
            layer, fn = make_layer(lib, b, h, hkv, d, causal, fp8, smooth, accum, (q, k, v), out,
                                   stream)
            ms, _ = time_fn(fn, "hot")
            tf[label] = fl / (ms * 1e-3) / 1e12
            lib.fmha_layer_free(layer)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != h)
        try:
            ms, _ = time_fn(cudnn, "hot")
            tf["cudnn"] = fl / (ms * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001
            tf["cudnn"] = math.nan
            print(f"{name}: cudnn: {str(e).splitlines()[0]}")
        print(f"{name:20s} " + "  ".join(f"{kk} {vv:6.1f}" for kk, vv in tf.items()) +
              f"  int8_qk / e4m3 {tf['int8_qk'] / tf['e4m3']:.2f}", flush=True)
        rows.append([name] + [f"{tf[kk]:.1f}" for kk in ["e4m3", "e4m3 smooth-k", "int8_qk",
                                                          "int8_qk single", "bf16", "cudnn"]] +
                    [f"{tf['int8_qk'] / tf['e4m3']:.2f}", f"{tf['int8_qk'] / tf['cudnn']:.2f}"])
        del q, k, v, out
    speed = results_md.table(["shape", "e4m3", "e4m3 smooth-k", "int8_qk", "int8_qk single-level",
                              "fmha bf16", "cuDNN bf16", "int8_qk / e4m3", "int8_qk / cuDNN bf16"],
                             rows, "lrrrrrrrr")
    print(acc)
    print(speed)
    results_md.write(opt, [("Machine", results_md.gpu_machine(torch)), ("Library", f"`{opt.lib}`"),
                           ("Peers", "fmha bf16 and torch SDPA cuDNN bf16, same process, same inputs")],
                     f"Accuracy on [1, {ACC_TOKENS}, 8, 128] inputs, the first {ACC_ROWS} query rows of each "
                     "head against float64 (`dit`: `bench/dit_inputs.py`); then TFLOP/s, bf16 in and out, "
                     "quantization in the timed call:\n\n" +
                     acc + "\n\n" + speed)


if __name__ == "__main__":
    main()
