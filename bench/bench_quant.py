"""bench_quant.py — fmha_quantize_fp8_cuda on [1, 90000, 40, 128] bf16 (Wan 2.1 14B's
720p q/k/v), per tensor and per block of 128 tokens, against its memory-traffic floor:
bytes read + written over the bandwidth of a device-to-device cudaMemcpy of as many bytes,
measured in the same process. Per tensor must read x twice (its amax comes before the
first code), so that line also gives the ratio to the two-read floor. torch's per-tensor
quantization (abs().amax(), divide, cast to float8_e4m3fn) runs on the same tensor as the
rival, and its codes and scale must equal fmha's bit for bit.

usage: python3 bench/bench_quant.py [--lib build/libfmha.so] [--shape 1,90000,40,128] [--iters 20]
                                    [--out FILE.md]

--out FILE.md writes the table into that Markdown file as its own section with the run's
provenance (bench/results_md.py), e.g. --out bench/RESULTS.md.
"""
import argparse
import ctypes as C
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_md  # noqa: E402
from bench_cuda import Tensor  # noqa: E402  (the ctypes fmha_tensor)

BF16, F8_E4M3 = 2, 3
PER_TENSOR, PER_BLOCK = 0, 2
BLOCK_ROWS = 128  # FMHA_FP8_BLOCK_ROWS
HEADINGS = {"quant": "FP8 quantizer on the GPU (`fmha_quantize_fp8_cuda`)"}


def cudart():
    """The CUDA runtime libfmha loaded (shared), for a plain cudaMemcpyAsync."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "libcudart.so" in path:
                return C.CDLL(path)
    sys.exit("libcudart is not loaded: was libfmha built with the CUDA backend?")


def time_ms(fn, iters):
    """Median of `iters` timed runs, each after a 256 MiB read that evicts L2 (a read,
    so that no dirty lines are left for the timed run to write back)."""
    flush = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(iters + 3):
        flush.max()
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libfmha.so")
    ap.add_argument("--quick", action="store_true", help="accepted for gpu_run.sh variants; no effect")
    ap.add_argument("--no-peers", action="store_true", help="accepted for gpu_run.sh variants; no effect")
    ap.add_argument("--shape", default="1,90000,40,128")
    ap.add_argument("--iters", type=int, default=20)
    results_md.add_arguments(ap, HEADINGS)
    opt = ap.parse_args()
    b, s, h, d = (int(v) for v in opt.shape.split(","))

    lib = C.CDLL(opt.lib)
    lib.fmha_quantize_fp8_cuda.argtypes = [C.POINTER(Tensor), C.POINTER(Tensor), C.c_void_p,
                                           C.c_int, C.c_int64, C.c_void_p]
    lib.fmha_last_error.restype = C.c_char_p
    rt = cudart()
    rt.cudaMemcpyAsync.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t, C.c_int, C.c_void_p]
    stream = torch.cuda.current_stream().cuda_stream

    torch.manual_seed(0)
    x = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(b, s, h, d, device="cuda", dtype=torch.uint8)
    nblk = (s + BLOCK_ROWS - 1) // BLOCK_ROWS
    scales = torch.empty(b * h * nblk, device="cuda", dtype=torch.float32)
    xt = Tensor(x.data_ptr(), BF16, b, s, h, d, *x.stride())
    yt = Tensor(y.data_ptr(), F8_E4M3, b, s, h, d, *y.stride())
    x_bytes, y_bytes = x.numel() * 2, y.numel()

    def quantize(scaling, block_rows):
        def fn():
            st = lib.fmha_quantize_fp8_cuda(C.byref(xt), C.byref(yt), scales.data_ptr(), scaling,
                                            block_rows, stream)
            if st != 0:
                raise RuntimeError(lib.fmha_last_error().decode())
        return fn

    # The ceiling: a D2D copy moving the same bytes (read + written) as the quantizer.
    n = (x_bytes + y_bytes) // 2
    src = torch.empty(n, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    src.fill_(1)

    def copy():
        if rt.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), n, 3, stream) != 0:
            raise RuntimeError("cudaMemcpyAsync failed")

    t_copy = time_ms(copy, opt.iters)
    bw = 2 * n / (t_copy * 1e-3)
    floor_ms = (x_bytes + y_bytes) / bw * 1e3
    floor2_ms = (2 * x_bytes + y_bytes) / bw * 1e3
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"x [{b}, {s}, {h}, {d}] bf16 = {x_bytes / 1e6:.1f} MB, y {y_bytes / 1e6:.1f} MB")
    print(f"copy ceiling: cudaMemcpy D2D of {n / 1e6:.1f} MB in {t_copy * 1e3:.1f} us = "
          f"{bw / 1e12:.2f} TB/s read + written; floor (x once + y) {floor_ms * 1e3:.1f} us, "
          f"two-read floor (x twice + y) {floor2_ms * 1e3:.1f} us")

    t_pt = time_ms(quantize(PER_TENSOR, 0), opt.iters)
    print(f"fmha per tensor:     {t_pt * 1e3:7.1f} us  {t_pt / floor_ms:.2f}x floor  "
          f"{t_pt / floor2_ms:.2f}x two-read floor  ({(2 * x_bytes + y_bytes) / t_pt / 1e9:.2f} TB/s "
          f"with x counted twice)")
    torch.cuda.synchronize()
    scale_pt = scales[0].clone()
    y_pt = y.clone()

    t_pb = time_ms(quantize(PER_BLOCK, BLOCK_ROWS), opt.iters)
    print(f"fmha per block {BLOCK_ROWS}: {t_pb * 1e3:7.1f} us  {t_pb / floor_ms:.2f}x floor  "
          f"({(x_bytes + y_bytes) / t_pb / 1e9:.2f} TB/s)")

    c448 = torch.tensor(448.0, device="cuda")  # a device divisor: torch multiplies by the
                                               # reciprocal of a host scalar instead

    def torch_per_tensor():
        sc = x.abs().amax().float() / c448
        return (x.float() / sc).to(torch.float8_e4m3fn), sc

    t_torch = time_ms(torch_per_tensor, max(5, opt.iters // 4))
    y_torch, s_torch = torch_per_tensor()
    diff = (y_torch.view(torch.uint8) != y_pt).sum().item()
    same_scale = s_torch.view(torch.int32).item() == scale_pt.view(torch.int32).item()
    print(f"torch per tensor:    {t_torch * 1e3:7.1f} us  ({t_torch / t_pt:.1f}x fmha's time); "
          f"scale {'equal' if same_scale else 'DIFFERENT'}, {diff} codes differ from fmha's")
    results_md.write(opt, [("Machine", results_md.gpu_machine(torch)), ("Library", f"`{opt.lib}`"),
                           ("Peers", "a device-to-device `cudaMemcpyAsync` of as many bytes (the ceiling) and "
                                     "torch's per-tensor quantization, same process, same tensor")],
                     markdown((b, s, h, d), x_bytes, y_bytes, t_copy, bw, floor_ms, floor2_ms, t_pt, t_pb,
                              t_torch, same_scale, diff))
    if diff or not same_scale:
        sys.exit(1)


def markdown(shape, x_bytes, y_bytes, t_copy, bw, floor_ms, floor2_ms, t_pt, t_pb, t_torch, same_scale, diff):
    """The input and ceiling line, then the table (times in ms, bandwidth in bytes/s, as main has them)."""
    us = 1e3
    return (f"Input: x {list(shape)} bf16 ({x_bytes / 1e6:.1f} MB), y e4m3 ({y_bytes / 1e6:.1f} MB). Copy "
            f"ceiling {t_copy * us:.1f} µs ({bw / 1e12:.2f} TB/s read + written); floor = (x + y) / that = "
            f"{floor_ms * us:.1f} µs, two-read floor (x twice + y) {floor2_ms * us:.1f} µs.\n\n" +
            results_md.table(
                ["scaling", "time", "/ floor (x read once)", "/ two-read floor", "peer"],
                [["per tensor (one launch, grid-wide amax)", f"{t_pt * us:.1f} µs", f"{t_pt / floor_ms:.2f}",
                  f"{t_pt / floor2_ms:.2f}", f"torch per tensor {t_torch * us:.1f} µs, "
                  f"{'same' if same_scale else 'DIFFERENT'} scale, {diff} codes differ"],
                 [f"per block of {BLOCK_ROWS} tokens (single pass)", f"{t_pb * us:.1f} µs", f"{t_pb / floor_ms:.2f}",
                  "—", ""]], "lrrrl"))


if __name__ == "__main__":
    main()
