"""bench_cpu.py — fmha's CPU forward on the shapes bench/RESULTS.md reports, each row beside the
ceiling that the same `fmha bench` invocation measured (tools/peak.c: independent register-only
chains of f32 FMA or vdpbf16ps on every thread, best of nine), through the CLI's public path
(`build/fmha bench ... --json`). [1, 2048, 16, 128] runs in f32 and bf16 under every ISA this CPU
runs (FMHA_CPU_ISA; scalar at 512 tokens, where 2048 takes seconds a call), the other cases
under the automatic choice. FLOPs count visible (query, key) pairs only, 4 · head dim a pair
and head.

--accuracy instead runs `fmha accuracy` (FP8 E4M3 attention's relative L2 error against the
float64 reference and against fmha's bf16 path, on Gaussian inputs and on K with outlier
channels) on [1, 2048, 8, 128] and on the Llama-3 8B and Lumina2 shapes at 2048 tokens. Those
numbers are deterministic: load does not move them.

usage: python3 bench/bench_cpu.py [--fmha build/fmha] [--iters N] [--threads N] [--quick]
                                  [--accuracy] [--out FILE.md [--section NAME] [--note TEXT]]

--quick runs only the [1, 2048, 16, 128] rows. With --out the table goes into that Markdown
file as its own section (bench/results_md.py), e.g. `--out bench/RESULTS.md`.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_md  # noqa: E402

ISAS = ("scalar", "avx2", "avx512", "avx512-bf16")  # FMHA_CPU_ISA, weakest first
# cpu-intel: the same bench on an Intel CPU (--section cpu-intel), where bf16 runs on the f32 kernel
HEADINGS = {"cpu": "CPU forward", "cpu-intel": "bf16 inputs on an Intel CPU", "fp8-accuracy": "FP8 accuracy (CPU)"}
# (`fmha bench` options, dtypes, ISAs: "each" = every one that runs here, None = the automatic
#  choice; timed calls as a multiple of --iters). No options: [1, 2048, 16, 128], non-causal.
CASES = [
    ([], ("f32", "bf16"), "each", 1),
    ([], ("f16", "fp8"), None, 1),
    (["--causal"], ("f32", "bf16"), None, 1),
    (["--seqlen", "1", "--seqlen-k", "8192", "--heads", "32", "--kv-heads", "8"], ("bf16",), None, 20),  # decode
    (["--model", "flux-1024"], ("bf16",), None, 1),
    (["--model", "lumina2"], ("bf16",), None, 1),
    (["--model", "llama3-8b", "--seqlen", "4096"], ("bf16",), None, 1),
    (["--model", "z-image-1024", "--window-left", "256", "--window-right", "256"], ("bf16",), None, 1),
]
ACCURACY = [[], ["--model", "llama3-8b", "--seqlen", "2048"], ["--model", "lumina2", "--seqlen", "2048"]]


def fmha_info(fmha):
    """(the ISAs that run here, {dtype: kernel the automatic choice runs}) from `fmha info`."""
    out = subprocess.run([fmha, "info"], capture_output=True, text=True, check=True).stdout
    best = re.search(r"best ISA ([\w-]+)", out).group(1)
    auto = dict(re.findall(r"^\s+(\S+)\s+inputs run (\S+)", out, re.M))
    return ISAS[:ISAS.index(best) + 1], auto


def shape_text(j):
    """[B, S, H, D] of q, then the KV heads and keys where they differ, and causal."""
    text = f"[{j['batch']}, {j['seqlen_q']}, {j['heads']}, {j['head_dim']}]"
    if j["kv_heads"] != j["heads"]:
        text += f", {j['kv_heads']} KV heads"
    if j["seqlen_k"] != j["seqlen_q"]:
        text += f", {j['seqlen_k']} keys"
    return text + (", causal" if j["causal"] else "")


def bench_rows(fmha, args, dtype, isa, iters, threads):
    """The JSON lines of one `fmha bench` invocation (fp8 gives two: fp8 and fp8q); [] if it failed."""
    cmd = [fmha, "bench", *args, "--dtype", dtype, "--iters", str(iters), "--json"]
    if threads:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ)
    env.pop("FMHA_CPU_ISA", None)
    if isa:
        env["FMHA_CPU_ISA"] = isa
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(f"{' '.join(cmd)} (FMHA_CPU_ISA={isa}): {r.stderr.strip()}", file=sys.stderr)
        return []
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def speed(opt):
    isas, auto = fmha_info(opt.fmha)
    load0 = os.getloadavg()[0]
    header = ["`fmha bench` options", "shape", "dtype", "FMHA_CPU_ISA", "kernel", "ms, median (calls)",
              "GFLOP/s", "measured peak, GFLOP/s", "% of peak"]
    rows, peaks = [], {}
    for args, dtypes, isa_set, mult in CASES:
        if opt.quick and args:
            continue
        for dtype in dtypes:
            if isa_set == "each":  # avx512-bf16 differs from avx512 for bf16 inputs only
                runs = [(i, ["--seqlen", "512"] if i == "scalar" else [])
                        for i in isas if i != "avx512-bf16" or dtype == "bf16"]
            else:
                runs = [(None, [])]
            for isa, extra in runs:
                for j in bench_rows(opt.fmha, args + extra, dtype, isa, opt.iters * mult, opt.threads):
                    label = "fp8q" if "fp8_compute" in j else "fp8" if j["dtype"] == "f8_e4m3" else j["dtype"]
                    peak = j["peak_tflops"] * 1e3
                    peaks.setdefault(j["peak"], []).append(peak)
                    mark = " (auto)" if isa and not extra and auto.get(j["dtype"]) == j["kernel"] else ""
                    case = f"`{' '.join(args + extra)}`" if args + extra else "*(none)*"
                    rows.append([case, shape_text(j), label,
                                 (isa + mark) if isa else "auto", j["kernel"],
                                 f"{j['ms']:.2f} ({j['iters']})", f"{j['tflops'] * 1e3:.1f}",
                                 f"{peak:.1f} {j['peak']}", f"{100 * j['peak_fraction']:.1f}%"])
                    print(" | ".join(rows[-1]), flush=True)
    load1 = os.getloadavg()[0]
    body = results_md.table(header, rows, "lllllrrrr")
    ceilings = "; ".join(f"{name} {min(v):.1f}–{max(v):.1f} GFLOP/s" for name, v in peaks.items())
    fields = [("Machine", results_md.cpu_machine()),
              ("Build", results_md.cmake_build(os.path.dirname(opt.fmha) or ".")),
              ("Threads", str(opt.threads or os.cpu_count())),
              ("Load", f"1-minute load average {load0:.2f} at the start, {load1:.2f} at the end"),
              ("Peers", "none measured; each row's ceiling is measured by the same invocation "
                        f"(over this run: {ceilings}); the peak of an AVX2 or scalar row is still the "
                        "widest FMA's"),
              ]
    results_md.write(opt, fields, body)


def accuracy(opt):
    """`fmha accuracy` per shape: its table as printed, the default shape in full and the others'
    fp8 vs ref and bf16 vs ref beside it."""
    tables = []
    for args in ACCURACY:
        cmd = [opt.fmha, "accuracy", *args] + (["--threads", str(opt.threads)] if opt.threads else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        lines = out.splitlines()
        title = lines[0].split(": ", 1)[1].replace(", bf16 inputs and output", "")
        rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines[3:] if ln.strip()]
        tables.append((" ".join(args), title, rows))
        print(out, flush=True)
    (_, title0, rows0), rest = tables[0], tables[1:]
    body = [f"`{' '.join(['fmha accuracy'] + ACCURACY[0])}`: {title0}", "",
            results_md.table(["inputs", "fp8 scales", "fp8 vs ref", "fp8 vs bf16", "bf16 vs ref"], rows0, "llrrr")]
    if rest:
        header = ["inputs", "fp8 scales"] + [f"`{a}`: fp8 vs ref / bf16 vs ref" for a, _, _ in rest]
        rows = [r[:2] + [f"{t[2][i][2]} / {t[2][i][4]}" for t in rest] for i, r in enumerate(rows0)]
        body += ["", "; ".join(f"`{a}`: {t}" for a, t, _ in rest) + ":", "",
                 results_md.table(header, rows, "ll" + "r" * len(rest))]
    fields = [("Machine", results_md.cpu_machine()),
              ("Build", results_md.cmake_build(os.path.dirname(opt.fmha) or ".")),
              ("Method", "bf16 q, k, v ~ N(0, 1) (seed 20261202); \"K outliers\" scales four head-dim channels "
                         "of every K row by 20, 40, 70 and 100, \"K offsets\" adds 20 … 100 to them; relative L2 "
                         "‖out − ref‖ / ‖ref‖ over the last 256 query rows of every head; ref = the float64 "
                         "reference on the bf16 inputs, bf16 = fmha's bf16 path; deterministic"),
              ("Peers", "the float64 reference and fmha's bf16 path on the same inputs")]
    results_md.write(opt, fields, "\n".join(body), name=results_md.section(opt, "fp8-accuracy"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmha", default="build/fmha", help="the CLI (make, or a -DFMHA_CUDA=OFF CMake build)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per row (decode: 20 times as many)")
    ap.add_argument("--threads", type=int, default=0, help="threads (default: all)")
    ap.add_argument("--quick", action="store_true", help="only the [1, 2048, 16, 128] rows")
    ap.add_argument("--accuracy", action="store_true", help="FP8's error (fmha accuracy) instead of speed")
    results_md.add_arguments(ap, HEADINGS)
    opt = ap.parse_args()
    if not os.access(opt.fmha, os.X_OK):
        sys.exit(f"{opt.fmha}: not built (make, or cmake -S . -B build -DFMHA_CUDA=OFF && "
                 "cmake --build build)")
    t0 = time.time()
    if opt.accuracy:
        accuracy(opt)
    else:
        speed(opt)
    print(f"{time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
