"""bench_fp8.py — fmha's FP8 attention on the GPU (f8_e4m3 q, k, v with
per-tensor descales, bf16 out) against fmha's bf16 Hopper kernel and torch's
cuDNN SDPA (bf16) in the same process, with the accuracy of both FP8
accumulation modes. Each mode is timed forced (FMHA_FP8_ACCUM=two_level and
single) and as a caller gets it (auto, the default: two-level past 16384
keys); the ratios to bf16 and cuDNN are the default's. Beside each of the
default FP8 mode, fmha bf16 and cuDNN: the median SM clock and board power
while it was timed, and its energy per FLOP (gpu_clock.py: NVML's energy
counter over ~2 s of back-to-back calls). At the board's power limit speed is
power over energy per FLOP, so these say how far a kernel is from that bound.
--anchor first times dense GEMMs (torch.matmul in bf16, torch._scaled_mm in
e4m3, 8192^3, bf16 out) the same way: what the tensor cores reach on this
board at its power limit. --layer also times the layer path a caller with
bf16 q, k, v takes (fp8_compute per tensor: quantize all three, then FP8
attention), with and without fp8_smooth_k, and that path's error.

Inputs: N(0, 1) bf16 q, k, v, quantized per tensor by torch (scale = amax /
448, round to nearest, saturate) outside the timed region; the FP8 time
includes fmha's V transpose. Accuracy is measured on the first 128 query rows
of each head against a float64 reference: "kernel" on the dequantized FP8
inputs (what the FP8 kernel adds: e4m3 P, accumulation), "total" on the
original bf16 inputs (quantization included).

--precondition (hot by default) runs each timed function back to back, or
leaves the GPU idle, for bench_cuda.PRECONDITION_S seconds before its timing,
as bench_cuda.py does, so that no mode is timed on a board that the mode
before it heated or left cool.

usage: python3 bench/bench_fp8.py [--lib build/libfmha.so] [--quick] [--no-peers]
                                  [--precondition none|hot|cool] [--anchor] [--layer]
                                  [--out FILE.md [--section NAME]]

--out FILE.md writes the run's tables into that Markdown file as one section with
the run's provenance (bench/results_md.py): fp8-energy with --anchor, fp8-layer
with --layer, else fp8-gpu, so that --out bench/RESULTS.md replaces only that one.
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
import results_md  # noqa: E402
from bench_cuda import SHAPES as BF16_SHAPES  # noqa: E402
from bench_cuda import (Args, Config, Tensor, env_set, flops, load_lib,  # noqa: E402  (the one ctypes mirror)
                        make_inputs, pj_per_flop, time_fn)

# bench_cuda's non-causal d128 shapes, the head-dim grid and Llama's causal GQA, plus FA3's d128 at 8k
# (name, batch, seqlen_q, seqlen_k, heads, kv heads, head dim, causal)
FP8_NAMES = ("wan14b_720p", "wan14b_480p", "flux_1024", "fa3grid_d128", "fa3grid_d64", "fa3grid_d256",
             "llama_gqa_causal")
SHAPES = [s for s in BF16_SHAPES if s[0] in FP8_NAMES] + [
    ("fa3grid_d128_8k", 2, 8192, 8192, 16, 16, 128, False)]
QUICK = {"flux_1024", "fa3grid_d128", "wan14b_480p"}
F8, BF16, CUDA = 3, 2, 1
PER_TENSOR = 1  # fmha_fp8_compute
ROWS = 128  # query rows per head checked against float64
HEADINGS = {"fp8-gpu": "FP8 attention on the GPU (Hopper)",
            "fp8-energy": "Energy per FLOP at the power limit",
            "fp8-layer": "FP8 layer path on the GPU, with fp8_smooth_k"}
PEERS = ("fmha's bf16 Hopper kernel and torch SDPA's cuDNN backend (bf16) on the same inputs in the same "
         "process; no FP8 attention is reachable from torch")


def view(x, dtype):
    """A [B, H, S, D] torch tensor as an fmha BSHD view (strides in elements)."""
    b, h, s, d = x.shape
    sb, sh, ss, sd = x.stride()
    return Tensor(x.data_ptr(), dtype, b, s, h, d, sb, ss, sh, sd)


def quantize(x):
    amax = x.abs().amax().float()
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    codes = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scale.reshape(1).contiguous()


def reference(xs, causal, sq, scale):
    """float64 attention of q's first ROWS rows over all keys, [B, H, ROWS, D];
    causal masks are bottom-right aligned (row i sees keys <= i + sk - sq)."""
    q, k, v = xs
    q = q[:, :, :ROWS].double()
    h = q.shape[1]
    k, v = k.double(), v.double()
    if k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        sk = k.shape[2]
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def rel_l2(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libfmha.so")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-peers", action="store_true", help="time the FP8 kernel alone (tuning runs)")
    ap.add_argument("--precondition", choices=("none", "hot", "cool"), default="hot",
                    help="each timed function run hot or left idle before its timing (bench_cuda.py)")
    ap.add_argument("--anchor", action="store_true", help="time bf16 and e4m3 GEMMs first")
    ap.add_argument("--layer", action="store_true",
                    help="time the quantizing layer path, with and without fp8_smooth_k")
    results_md.add_arguments(ap, HEADINGS)
    opt = ap.parse_args()

    def timed(fn):
        """fn's median time in ms and (SM MHz, watts) while it ran (bench_cuda.time_fn)."""
        return time_fn(fn, opt.precondition)

    lib = load_lib(opt.lib)

    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, precondition {opt.precondition}")
    gemms = gemm_anchor(timed) if opt.anchor else []
    rows, tuning = [], []
    for name, b, sq, sk, h, hkv, d, causal in SHAPES:
        if opt.quick and name not in QUICK:
            continue
        q, k, v = make_inputs(b, sq, sk, h, hkv, d)
        q8, k8, v8 = (quantize(x) for x in (q, k, v))
        out8 = torch.empty_like(q)
        out16 = torch.empty_like(q)
        stream = torch.cuda.current_stream().cuda_stream

        def make(dtype, xs, out, descales, smooth=None, accum=None):
            cfg = Config()
            lib.fmha_config_init(C.byref(cfg), h, hkv, d)
            cfg.dtype, cfg.causal, cfg.device = dtype, int(causal), CUDA
            if smooth is not None:  # bf16 in, quantized per tensor by the layer
                cfg.fp8_compute, cfg.fp8_smooth_k = PER_TENSOR, int(smooth)
            a = Args()
            a.q, a.k, a.v = (view(x, dtype) for x in xs)
            a.out = view(out, BF16)
            a.stream = stream
            if descales:
                a.descale_q, a.descale_k, a.descale_v = (s.data_ptr() for s in descales)
            # one layer per configuration, kept (as bench_cuda.py does): the timed call is the
            # forward; FMHA_FP8_ACCUM=accum while it is made (a layer reads it at init)
            layer = C.c_void_p()
            with env_set("FMHA_FP8_ACCUM", accum):
                if lib.fmha_layer_init(C.byref(layer), C.byref(cfg)) != 0:
                    sys.exit(f"{name}: {lib.fmha_last_error().decode()}")
            return layer, a

        l8 = {mode: make(F8, (q8[0], k8[0], v8[0]), out8, (q8[1], k8[1], v8[1]), accum=mode)
              for mode in ("auto", "two_level", "single")}
        layer16, a16 = make(BF16, (q, k, v), out16, None)

        def run(layer, a):
            def fn():
                if lib.fmha_layer_forward(layer, C.byref(a)) != 0:
                    raise RuntimeError(lib.fmha_last_error().decode())
            return fn

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != h)

        if opt.no_peers:
            fl = flops(b, sq, sk, h, d, causal)
            line, cells = f"{name:18s}", [name]
            for mode in ("auto", "two_level", "single"):
                ms, (mhz, _) = timed(run(*l8[mode]))
                if mode == "auto":
                    pj = pj_per_flop(run(*l8[mode]), fl)
                line += f"  fp8 {mode} {fl / (ms * 1e-3) / 1e12:6.1f} ({mhz:.0f} MHz)"
                cells.append(f"{fl / (ms * 1e-3) / 1e12:.1f} ({mhz:.0f})")
            print(f"{line}  auto {pj:.3f} pJ/FLOP", flush=True)
            tuning.append(cells + [f"{pj:.3f}"])
            for layer8, _ in l8.values():
                lib.fmha_layer_free(layer8)
            lib.fmha_layer_free(layer16)
            continue
        scale = 1.0 / math.sqrt(d)
        deq = [x8.float() * s for x8, s in (q8, k8, v8)]
        ref_deq = reference(deq, causal, sq, scale)
        ref_bf16 = reference((q, k, v), causal, sq, scale)
        err = {}
        t = {}
        outs = {}
        for mode in ("two_level", "single"):
            run(*l8[mode])()
            torch.cuda.synchronize()
            outs[mode] = out8[:, :, :ROWS].float().clone()
            err[mode] = (rel_l2(out8[:, :, :ROWS], ref_deq), rel_l2(out8[:, :, :ROWS], ref_bf16))
            t[mode], _ = timed(run(*l8[mode]))
        fl = flops(b, sq, sk, h, d, causal)
        pj, clk = {}, {}  # the default FP8 mode, fmha bf16 and cuDNN: energy per FLOP, (MHz, W)
        t["auto"], clk["auto"] = timed(run(*l8["auto"]))
        pj["auto"] = pj_per_flop(run(*l8["auto"]), fl)
        # what the accumulation mode alone changes (the same e4m3 P in both)
        acc = rel_l2(outs["single"], outs["two_level"].double())
        if opt.layer:
            for smooth in (False, True):
                lay, al = make(BF16, (q, k, v), out16, None, smooth)
                run(lay, al)()
                torch.cuda.synchronize()
                err[f"layer{int(smooth)}"] = rel_l2(out16[:, :, :ROWS], ref_bf16)
                t[f"layer{int(smooth)}"], _ = timed(run(lay, al))
                lib.fmha_layer_free(lay)
        run(layer16, a16)()
        torch.cuda.synchronize()
        err16 = rel_l2(out16[:, :, :ROWS], ref_bf16)
        t["bf16"], clk["bf16"] = timed(run(layer16, a16))
        pj["bf16"] = pj_per_flop(run(layer16, a16), fl)
        try:
            t["cudnn"], clk["cudnn"] = timed(cudnn)
            pj["cudnn"] = pj_per_flop(cudnn, fl)
        except Exception as e:  # noqa: BLE001  (a backend that refuses a shape)
            t["cudnn"] = pj["cudnn"] = math.nan
            clk["cudnn"] = (math.nan, math.nan)
            print(f"{name}: cudnn: {str(e).splitlines()[0]}")
        tf = {kk: fl / (ms * 1e-3) / 1e12 for kk, ms in t.items()}
        rows.append((name, tf, err, err16, acc, clk, pj))
        print(f"{name:18s} fp8 {tf['auto']:6.1f} (two-level {tf['two_level']:6.1f}, single {tf['single']:6.1f})"
              f"  bf16 {tf['bf16']:6.1f}  cudnn {tf['cudnn']:6.1f}  x{tf['auto'] / tf['bf16']:.2f} bf16"
              f"  x{tf['auto'] / tf['cudnn']:.2f} cudnn  relL2 kernel {err['two_level'][0]:.2e}"
              f" (single {err['single'][0]:.2e})  total {err['two_level'][1]:.2e}  bf16 {err16:.2e}"
              f"  single vs two-level {acc:.1e}  MHz/W " +
              " ".join(f"{clk[kk][0]:.0f}/{clk[kk][1]:.0f}" for kk in clk) +
              "  pJ/FLOP " + " ".join(f"{pj[kk]:.3f}" for kk in clk) +
              (f"  layer {tf['layer0']:6.1f} (relL2 {err['layer0']:.2e}), smoothed {tf['layer1']:6.1f} "
               f"(relL2 {err['layer1']:.2e})" if opt.layer else ""),
              flush=True)
        for layer8, _ in l8.values():
            lib.fmha_layer_free(layer8)
        lib.fmha_layer_free(layer16)
        del q, k, v, q8, k8, v8, out8, out16, deq

    tables = markdown(gemms, rows, tuning, opt.layer)
    print(tables)
    name = results_md.section(opt, "fp8-energy" if opt.anchor else "fp8-layer" if opt.layer else None)
    results_md.write(opt, [("Machine", results_md.gpu_machine(torch)), ("Library", f"`{opt.lib}`"),
                           ("Peers", PEERS if not opt.no_peers else "none (--no-peers)")], tables, name=name)


def markdown(gemms, rows, tuning, layer):
    """The run's tables: the dense GEMMs (--anchor), then the shapes with peers, or the FP8 kernel
    alone (--no-peers), then the layer path (--layer). rows and tuning as main collects them."""
    out = []
    if gemms:
        out.append(results_md.table(["GEMM, 8192³, bf16 out", "TFLOP/s", "SM MHz", "W", "pJ/FLOP"],
                                    [[label, f"{tf:.1f}", f"{mhz:.0f}", f"{w:.0f}", f"{pj:.3f}"]
                                     for label, tf, mhz, w, pj in gemms], "lrrrr"))
    if tuning:
        out.append(results_md.table(["shape", "FP8 default (SM MHz)", "FP8 two-level (SM MHz)",
                                     "FP8 single-level (SM MHz)", "pJ/FLOP, default"], tuning, "lrrrr"))
    if rows:
        header = ["shape", "FP8 (default)", "FP8 two-level", "FP8 single-level", "fmha bf16", "cuDNN bf16",
                  "FP8 / bf16", "FP8 / cuDNN", "rel. L2 kernel (two-level / single)", "single vs two-level",
                  "rel. L2 total", "bf16 rel. L2", "MHz / W: FP8, bf16, cuDNN", "pJ/FLOP: FP8, bf16, cuDNN"]
        cells = [[name, f"{tf['auto']:.1f}", f"{tf['two_level']:.1f}", f"{tf['single']:.1f}", f"{tf['bf16']:.1f}",
                  f"{tf['cudnn']:.1f}", f"{tf['auto'] / tf['bf16']:.2f}", f"{tf['auto'] / tf['cudnn']:.2f}",
                  f"{err['two_level'][0]:.2e} / {err['single'][0]:.2e}", f"{acc:.1e}", f"{err['two_level'][1]:.2e}",
                  f"{err16:.2e}", ", ".join(f"{clk[kk][0]:.0f} / {clk[kk][1]:.0f}" for kk in clk),
                  ", ".join(f"{pj[kk]:.3f}" for kk in clk)]
                 for name, tf, err, err16, acc, clk, pj in rows]
        out.append(results_md.table(header, cells, "lrrrrrrrlrrrll"))
    if rows and layer:
        out.append(results_md.table(
            ["shape", "FP8 kernel (inputs quantized before)", "layer: quantize + FP8", "+ fp8_smooth_k",
             "smoothing's cost", "rel. L2 layer / smoothed"],
            [[name, f"{tf['auto']:.1f}", f"{tf['layer0']:.1f}", f"{tf['layer1']:.1f}",
              f"{tf['layer0'] / tf['layer1'] - 1:+.1%}", f"{err['layer0']:.2e} / {err['layer1']:.2e}"]
             for name, tf, err, _, _, _, _ in rows], "lrrrrl"))
    return "\n\n".join(out)


def gemm_anchor(timed, n=8192):
    """Dense n^3 GEMMs, bf16 (torch.matmul) and e4m3 with per-tensor scales
    (torch._scaled_mm), bf16 out: TFLOP/s, clock, power and energy per FLOP,
    printed and returned as (label, TFLOP/s, MHz, W, pJ/FLOP) rows."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # B column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    fns = {"gemm bf16": lambda: torch.matmul(a, b),
           "gemm e4m3": lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)}
    fl = 2.0 * n ** 3
    rows = []
    for label, fn in fns.items():
        ms, (mhz, w) = timed(fn)
        rows.append((label.replace("gemm ", "") + (" (`torch.matmul`)" if "bf16" in label else
                                                   ", per-tensor scales (`torch._scaled_mm`)"),
                     fl / (ms * 1e-3) / 1e12, mhz, w, pj_per_flop(fn, fl)))
        print(f"{label} {n}^3: {rows[-1][1]:7.1f} TFLOP/s  {mhz:.0f} MHz  {w:.0f} W  "
              f"{rows[-1][4]:.3f} pJ/FLOP", flush=True)
    return rows


if __name__ == "__main__":
    main()
