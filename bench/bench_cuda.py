"""bench_cuda.py — fmha's CUDA forward against torch's SDPA backends (flash =
FlashAttention-2, cuDNN) in the same process on the same inputs, for the model
shapes of shared/models.md and the FlashAttention-3 grid. fmha is called
through ctypes on build/libfmha.so; torch tensors are [B, H, S, D] contiguous
and fmha reads the same memory as BHSD views. Prints a table of TFLOP/s,
the ratio to each peer, fmha's relative L2 error against torch flash (its
memory-efficient backend above head dim 256, timed there too), and the
median SM clock and board power while fmha and cuDNN were timed (NVML,
gpu_clock.py; nan where the driver's NVML is missing), and the CPU time of one
fmha and one cuDNN call on an idle GPU (host µs: the part of a call that
back-to-back timings hide), and the energy each spends per FLOP (pJ/FLOP: the
board's energy counter over ~2 s of back-to-back calls, gpu_clock.py), which
sets their ratio once the board sits at its power limit.

usage: python3 bench/bench_cuda.py [--lib build/libfmha.so | --package] [--quick | --shapes A,B]
                                  [--repeats N] [--ab VAR=V1,V2,...] [--ab-lib OTHER.so]
                                  [--out FILE.md]
                                  [--precondition none|hot|cool]

--quick runs five shapes (QUICK below); --shapes names the ones to run.

--repeats N times every backend N times in turn (fmha, portable, flash, cuDNN,
fmha, ...) and keeps each one's median: a clock or power drift during the run
then weighs on all of them alike.

--precondition puts every backend in the same state before its timing, so that
what ran before it does not decide its clock: hot runs it back to back for
PRECONDITION_S seconds first (each is timed at its own steady state under the
board's power limit, as a long inference run sees it; the default), cool
leaves the GPU idle that long (each starts on a board that has shed its heat).
none times them in turn as they come: cuDNN is then timed right after the
slower, cooler FlashAttention-2, and fmha right after the previous shape's
two-second energy run at the power limit (on 2026-12-03 Flux read 1.01x cuDNN
that way, at 1800 against 1965 MHz, and 1.03x both hot and cool).

--ab VAR=V1,V2 also times fmha with the environment variable VAR set to each
value in turn (an A/B of a run-time switch such as FMHA_CUDA_SCHEDULE, in the
same rounds as the peers) and prints each one's TFLOP/s and ratio to cuDNN.
Each value gets a layer of its own, made with VAR set: a layer reads the
environment once, at fmha_layer_init.

--ab-lib OTHER.so also times a second build of libfmha, loaded into the same
process beside --lib (an old and a new library on the same inputs, in the same
rounds), and prints its TFLOP/s, its ratio to cuDNN and the new library's ratio
to it.

--package calls fmha through the installed Python package (pip install . from the repository root)
instead of the ctypes shim below: fmha.Attention(...)(q, k, v, out=...) on the
same BSHD views.

--out FILE.md writes the table (and the --ab rows) into that Markdown file as
its own section, with the run's provenance (bench/results_md.py): e.g.
--out bench/RESULTS.md replaces that file's CUDA forward section only.
"""
import argparse
import contextlib
import ctypes as C
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_md  # noqa: E402
from gpu_clock import ClockSampler, energy_per_call  # noqa: E402

# (name, batch, seqlen_q, seqlen_k, heads, kv heads, head dim, causal)
SHAPES = [
    ("wan14b_720p", 1, 75600, 75600, 40, 40, 128, False),
    ("wan14b_480p", 1, 32760, 32760, 40, 40, 128, False),
    ("flux_1024", 1, 4608, 4608, 24, 24, 128, False),
    ("lumina2_gqa_d96", 1, 4096, 4096, 24, 8, 96, False),
    ("llama_gqa_causal", 1, 8192, 8192, 32, 8, 128, True),
    ("cross_attn_wan", 1, 32760, 512, 40, 40, 128, False),
    ("fa3grid_d64", 1, 16384, 16384, 32, 32, 64, False),
    ("fa3grid_d128", 1, 16384, 16384, 16, 16, 128, False),
    ("fa3grid_d128_causal", 1, 16384, 16384, 16, 16, 128, True),
    ("fa3grid_d256", 1, 16384, 16384, 8, 8, 256, False),
    # Head dims above 256 (the portable kernel's 512 variant); FlashAttention-2 and cuDNN
    # refuse them, so torch's memory-efficient backend is timed beside (--shapes names them).
    ("hd512", 1, 8192, 8192, 8, 8, 512, False),
    ("hd512_causal", 1, 8192, 8192, 8, 8, 512, True),
]
QUICK = {"flux_1024", "lumina2_gqa_d96", "llama_gqa_causal", "fa3grid_d128", "fa3grid_d256"}
PRECONDITION_S = 1.0  # seconds each backend runs (hot) or idles (cool) before its timing
HEADINGS = {"cuda": "CUDA forward against torch SDPA (cuDNN, FlashAttention-2)"}
PEERS = ("torch SDPA's flash (FlashAttention-2) and cuDNN backends, same process, same inputs, "
         "timed in the same rounds; the portable fmha kernel beside the chooser's pick")

BF16, CUDA = 2, 1


class Tensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int), ("batch", C.c_int64),
                ("seqlen", C.c_int64), ("heads", C.c_int64), ("head_dim", C.c_int64),
                ("stride_batch", C.c_int64), ("stride_seq", C.c_int64),
                ("stride_head", C.c_int64), ("stride_dim", C.c_int64)]


class Config(C.Structure):
    _fields_ = [("num_heads", C.c_int64), ("num_kv_heads", C.c_int64), ("head_dim", C.c_int64),
                ("head_dim_v", C.c_int64), ("dtype", C.c_int), ("softmax_scale", C.c_double),
                ("causal", C.c_int), ("window_left", C.c_int64), ("window_right", C.c_int64),
                ("softcap", C.c_double), ("dropout_p", C.c_double), ("device", C.c_int),
                ("cpu_isa", C.c_int), ("num_threads", C.c_int), ("fp8_compute", C.c_int),
                ("fp8_smooth_k", C.c_int), ("check_finite", C.c_int), ("deterministic", C.c_int)]


class AttnMask(C.Structure):
    _fields_ = [("data", C.c_void_p), ("type", C.c_int), ("stride_batch", C.c_int64),
                ("stride_head", C.c_int64), ("stride_q", C.c_int64), ("stride_k", C.c_int64)]


class Args(C.Structure):  # the whole of fmha_forward_args: the library reads every field
    _fields_ = [("q", Tensor), ("k", Tensor), ("v", Tensor), ("out", Tensor),
                ("lse", C.c_void_p), ("cu_seqlens_q", C.c_void_p), ("cu_seqlens_k", C.c_void_p),
                ("varlen_batch", C.c_int64), ("max_seqlen_q", C.c_int64),
                ("max_seqlen_k", C.c_int64), ("seed", C.c_uint64), ("offset", C.c_uint64),
                ("stream", C.c_void_p), ("descale_q", C.c_void_p), ("descale_k", C.c_void_p),
                ("descale_v", C.c_void_p), ("descale_layout", C.c_int),
                ("descale_block_rows", C.c_int64), ("mask", AttnMask), ("alibi_slopes", C.c_void_p),
                ("alibi_stride_batch", C.c_int64), ("sinks", C.c_void_p)]


def view(x):
    """A [B, H, S, D] torch tensor as an fmha BSHD view (strides in elements)."""
    b, h, s, d = x.shape
    sb, sh, ss, sd = x.stride()
    return Tensor(x.data_ptr(), BF16, b, s, h, d, sb, ss, sh, sd)


def load_lib(path):
    """libfmha with the signatures the benches call."""
    lib = C.CDLL(path)
    lib.fmha_layer_init.argtypes = [C.POINTER(C.c_void_p), C.POINTER(Config)]
    lib.fmha_layer_forward.argtypes = [C.c_void_p, C.POINTER(Args)]
    lib.fmha_layer_free.argtypes = [C.c_void_p]
    lib.fmha_last_error.restype = C.c_char_p
    lib.fmha_config_init.argtypes = [C.POINTER(Config), C.c_int64, C.c_int64, C.c_int64]
    return lib


def make_inputs(b, sq, sk, h, hkv, d):
    """q [B, H, Sq, D], k and v [B, Hkv, Sk, D]: bf16 N(0, 1) on the GPU, seed 0."""
    torch.manual_seed(0)
    return (torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16),
            torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16),
            torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16))


@contextlib.contextmanager
def env_set(var, val):
    """The environment variable var set to val inside the block (untouched when val is None), restored after."""
    if val is None:
        yield
        return
    saved = os.environ.get(var)
    os.environ[var] = val
    try:
        yield
    finally:
        if saved is None:
            del os.environ[var]
        else:
            os.environ[var] = saved


def host_us(fn, n=20):
    """Median CPU time of one call on an idle GPU: what a call costs before the GPU has work (validation,
    tensor maps, launches), which a timing of back-to-back calls hides and a lone call pays."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def precondition(fn, mode):
    """--precondition: run fn back to back (hot) or leave the GPU idle (cool) for
    PRECONDITION_S seconds; nothing for none."""
    torch.cuda.synchronize()
    if mode == "cool":
        time.sleep(PRECONDITION_S)
    elif mode == "hot":
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < PRECONDITION_S:
            for _ in range(8):
                fn()
            torch.cuda.synchronize()


def time_fn(fn, mode):
    """fn's median time in ms (do_bench) after the --precondition step `mode`,
    and (median SM MHz, watts) while it was timed (gpu_clock.py)."""
    precondition(fn, mode)
    with ClockSampler() as sampler:
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
    return ms, sampler.result()


def pj_per_flop(fn, fl):
    """Energy per FLOP of fn (fl FLOPs a call) in pJ, over ~2 s of back-to-back calls."""
    return energy_per_call(fn, torch.cuda.synchronize) / fl * 1e12


def flops(b, sq, sk, h, d, causal):
    pairs = sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq)) if causal else sq * sk
    return 4.0 * b * h * d * pairs


def markdown(rows, ab_rows):
    """The results table (rows as main collects them), then the --ab / --ab-lib rows (shape,
    setting, its TFLOP/s, cuDNN's, fmha's, SM MHz) where there are any."""
    header = ["shape", "fmha TFLOP/s", "fmha portable", "torch flash (FA2)", "torch cuDNN", "fmha / flash",
              "fmha / cuDNN", "rel. L2 vs flash", "SM MHz fmha / cuDNN", "W fmha / cuDNN",
              "host µs fmha / cuDNN", "pJ/FLOP fmha / cuDNN"]
    cells = [[name, f"{a:.1f}", f"{pt:.1f}", f"{fl2:.1f}", f"{cu:.1f}", f"{a / fl2:.2f}", f"{a / cu:.2f}",
              f"{err:.1e}", f"{mf:.0f} / {mc:.0f}", f"{wf:.0f} / {wc:.0f}", f"{hf:.0f} / {hc:.0f}",
              f"{ef:.3f} / {ec:.3f}"]
             for name, a, pt, fl2, cu, err, mf, mc, wf, wc, hf, hc, ef, ec, _ in rows]
    if any(not math.isnan(row[-1]) for row in rows):  # head dims above 256: the peer that runs them
        header += ["torch mem-efficient", "fmha / mem-efficient"]
        for cell, row in zip(cells, rows):
            cell += [f"{row[-1]:.1f}", f"{row[1] / row[-1]:.2f}"]
    text = results_md.table(header, cells, "l" + "r" * (len(header) - 1))
    if ab_rows:
        text += "\n\n" + results_md.table(
            ["shape", "fmha with", "TFLOP/s", "/ cuDNN", "fmha / it", "SM MHz"],
            [[name, f"`{label}`", f"{t:.1f}", f"{t / cu:.2f}", f"{a / t:.3f}", f"{mhz:.0f}"]
             for name, label, t, cu, a, mhz in ab_rows],
            "llrrrr")
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libfmha.so")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", help="comma-separated shape names (SHAPES) to run")
    ap.add_argument("--no-peers", action="store_true", help="time fmha only (tuning runs)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the backends, median kept")
    ap.add_argument("--package", action="store_true", help="call fmha through the Python package")
    ap.add_argument("--ab", help="VAR=V1,V2: fmha also timed with VAR set to each value")
    ap.add_argument("--ab-lib", help="a second libfmha timed beside --lib in the same rounds")
    ap.add_argument("--precondition", choices=("none", "hot", "cool"), default="hot",
                    help="each backend run hot or left idle for PRECONDITION_S s before its timing")
    results_md.add_arguments(ap, HEADINGS)
    opt = ap.parse_args()
    ab_var, ab_vals = None, []
    if opt.ab:
        ab_var, _, vals = opt.ab.partition("=")
        ab_vals = vals.split(",")
        if not ab_var or not vals:
            sys.exit(f"--ab {opt.ab}: expected VAR=V1,V2")
    names = [sh[0] for sh in SHAPES]
    chosen = set(opt.shapes.split(",")) if opt.shapes else set(QUICK) if opt.quick else set(names)
    if chosen - set(names):
        sys.exit(f"--shapes: no shape {', '.join(sorted(chosen - set(names)))}; "
                 f"the shapes are {', '.join(names)}")

    lib = load_lib(opt.lib)
    other = load_lib(opt.ab_lib) if opt.ab_lib else None
    ab_label = f"lib={os.path.basename(os.path.dirname(os.path.abspath(opt.ab_lib)))}" if opt.ab_lib else None

    dev = torch.cuda.get_device_name()
    print(f"# {time.strftime('%Y-%m-%d')} {dev}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, precondition {opt.precondition}")
    rows, ab_rows = [], []
    for name, b, sq, sk, h, hkv, d, causal in SHAPES:
        if name not in chosen:
            continue
        q, k, v = make_inputs(b, sq, sk, h, hkv, d)
        out = torch.empty_like(q)

        layers = []

        def fmha_runner(the_lib, var=None, val=None, o=None):
            """A layer of the_lib for this shape, made with var=val in the environment,
            writing o (out when None); freed after the shape."""
            cfg = Config()
            the_lib.fmha_config_init(C.byref(cfg), h, hkv, d)
            cfg.dtype, cfg.causal, cfg.device = BF16, int(causal), CUDA
            layer = C.c_void_p()
            with env_set(var, val):
                if the_lib.fmha_layer_init(C.byref(layer), C.byref(cfg)) != 0:
                    sys.exit(f"{name}: {the_lib.fmha_last_error().decode()}")
            layers.append((the_lib, layer))
            args = Args()
            args.q, args.k, args.v = view(q), view(k), view(v)
            args.out = view(out if o is None else o)
            args.stream = torch.cuda.current_stream().cuda_stream

            def run():
                st = the_lib.fmha_layer_forward(layer, C.byref(args))
                if st != 0:
                    raise RuntimeError(the_lib.fmha_last_error().decode())
            return run

        run_fmha = fmha_runner(lib)
        # The portable kernel beside the chooser's pick (the Hopper kernel on an H200).
        run_portable = fmha_runner(lib, "FMHA_CUDA_KERNEL", "portable", torch.empty_like(q))

        if opt.package:
            import fmha as fmha_py
            py_layer = fmha_py.Attention(h, d, causal=causal, num_kv_heads=hkv)
            qv, kv_, vv, ov = (x.transpose(1, 2) for x in (q, k, v, out))

            def run_fmha():
                py_layer(qv, kv_, vv, out=ov)

        def sdpa(backend):
            def fn():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          enable_gqa=hkv != h)
            return fn

        run_fmha()
        torch.cuda.synchronize()
        ref_backend = SDPBackend.FLASH_ATTENTION if d <= 256 else SDPBackend.EFFICIENT_ATTENTION
        ref = sdpa(ref_backend)()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        fl = flops(b, sq, sk, h, d, causal)
        times, clocks = {}, {}
        impls = [("fmha", run_fmha), ("portable", run_portable)]
        impls += [(f"{ab_var}={val}", fmha_runner(lib, ab_var, val, torch.empty_like(q))) for val in ab_vals]
        if other:
            impls.append((ab_label, fmha_runner(other, o=torch.empty_like(q))))
        if not opt.no_peers:
            impls += [("flash", sdpa(SDPBackend.FLASH_ATTENTION)),
                      ("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))]
            if d > 256:  # the others refuse these
                impls.append(("efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION)))
        for _ in range(max(1, opt.repeats)):
            for label, fn in impls:
                if label in times and math.isnan(times[label][0]):
                    continue  # refused this shape before
                try:
                    ms, clock = time_fn(fn, opt.precondition)
                    times.setdefault(label, []).append(ms)
                    clocks.setdefault(label, []).append(clock)
                except Exception as e:  # a backend that refuses a shape
                    times[label] = [math.nan]
                    print(f"{name}: {label}: {str(e).splitlines()[0]}")
        # Host cost and energy of fmha and cuDNN where they ran (missing ones print as nan).
        ran = [(label, fn) for label, fn in impls
               if label in ("fmha", "cudnn") and not math.isnan(times[label][0])]
        host = {label: host_us(fn) for label, fn in ran}
        pj = {label: pj_per_flop(fn, fl) for label, fn in ran}
        t = {label: statistics.median(v) for label, v in times.items()}
        clk = {label: (statistics.median(c[0] for c in v), statistics.median(c[1] for c in v))
               for label, v in clocks.items()}
        for the_lib, layer in layers:
            the_lib.fmha_layer_free(layer)
        t.setdefault("flash", math.nan)
        t.setdefault("cudnn", math.nan)
        t.setdefault("efficient", math.nan)
        tf = {kk: fl / (ms * 1e-3) / 1e12 for kk, ms in t.items()}
        nan2 = (math.nan, math.nan)
        (mf, wf), (mc, wc) = clk.get("fmha", nan2), clk.get("cudnn", nan2)
        hf, hc = host.get("fmha", math.nan), host.get("cudnn", math.nan)
        ef, ec = pj.get("fmha", math.nan), pj.get("cudnn", math.nan)
        rows.append((name, tf["fmha"], tf["portable"], tf["flash"], tf["cudnn"], err, mf, mc, wf, wc, hf, hc,
                     ef, ec, tf["efficient"]))
        print(f"{name:22s} fmha {tf['fmha']:6.1f}  portable {tf['portable']:6.1f}"
              f"  flash {tf['flash']:6.1f}  cudnn {tf['cudnn']:6.1f}"
              f"  x{tf['fmha'] / tf['flash']:.2f} flash  x{tf['fmha'] / tf['cudnn']:.2f} cudnn"
              f"  efficient {tf['efficient']:6.1f}"
              f"  relL2 {err:.1e}  MHz {mf:.0f}/{mc:.0f}  W {wf:.0f}/{wc:.0f}"
              f"  host us {hf:.0f}/{hc:.0f}  pJ/FLOP {ef:.3f}/{ec:.3f}", flush=True)
        for label in [f"{ab_var}={val}" for val in ab_vals] + ([ab_label] if other else []):
            mhz = clk.get(label, nan2)[0]
            print(f"{'':22s} {label:28s} {tf[label]:6.1f}  x{tf[label] / tf['cudnn']:.2f} cudnn"
                  f"  fmha x{tf['fmha'] / tf[label]:.3f} it  MHz {mhz:.0f}", flush=True)
            ab_rows.append((name, label, tf[label], tf["cudnn"], tf["fmha"], mhz))
        del q, k, v, out, ref

    table = markdown(rows, ab_rows)
    print(table)
    results_md.write(opt, [("Machine", results_md.gpu_machine(torch)),
                           ("Library", f"`{opt.lib}`" if not opt.package else "the installed Python package"),
                           ("Peers", PEERS if not opt.no_peers else "none (--no-peers)")], table)


if __name__ == "__main__":
    main()
