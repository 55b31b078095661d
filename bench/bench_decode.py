"""bench_decode.py — fmha's CPU decode (fmha.kvcache_attention) on decode
shapes, as achieved bandwidth: bytes of K and V read (plus q and out) per
second, beside this machine's read bandwidth measured in the same run by a
STREAM-like probe (a sum over an array far larger than the caches, on the
same number of threads as fmha), so that the figure is a fraction of what
the memory gives here.

    python3 bench/bench_decode.py [--quick] [--lib build/libfmha.so] [--threads N]

Shapes: Llama-3 8B (32 query heads, 8 KV heads, head dim 128) at batch 1
and 16 with 1k and 8k caches, contiguous and in pages of 16; MQA; head dims
64 and 256. bf16 caches (ml_dtypes)."""
import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def read_probe(threads, mib=1024, repeats=5):
    """GB/s of summing `mib` MiB of float32 on `threads` threads (each its own
    slice): the best of `repeats` rounds."""
    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))  # numpy releases the GIL in the reduction
            best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def run(fmha, bf16, batch, heads, kv_heads, d, cache, page, iters):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, 1, heads, d)).astype(bf16)
    if page:
        pages = batch * cache // page
        kc = rng.standard_normal((pages, page, kv_heads, d)).astype(bf16)
        vc = rng.standard_normal((pages, page, kv_heads, d)).astype(bf16)
        table = rng.permutation(pages).reshape(batch, cache // page).astype(np.int32)
    else:
        kc = rng.standard_normal((batch, cache, kv_heads, d)).astype(bf16)
        vc = rng.standard_normal((batch, cache, kv_heads, d)).astype(bf16)
        table = None
    lens = np.full(batch, cache, dtype=np.int32)
    layer = fmha.Attention(heads, d, num_kv_heads=kv_heads)
    layer.decode(q, kc, vc, cache_seqlens=lens, block_table=table)  # warm-up, plan
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        layer.decode(q, kc, vc, cache_seqlens=lens, block_table=table)
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    nbytes = 2 * batch * cache * kv_heads * d * 2 + 2 * batch * heads * d * 2
    return t, nbytes / t / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="libfmha.so to load (default: the package's)")
    ap.add_argument("--quick", action="store_true", help="the 1k caches only")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads for fmha (OMP_NUM_THREADS) and the probe")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.lib:
        os.environ["FMHA_LIBRARY"] = os.path.abspath(args.lib)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import fmha
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    probe = read_probe(args.threads)
    print("# %s, %d threads, fmha %s (%s); read probe %.1f GB/s"
          % (time.strftime("%Y-%m-%d"), args.threads, fmha.__version__, fmha.info()["cpu_isa"],
             probe))
    shapes = []
    for cache in (1024,) if args.quick else (1024, 8192):
        for batch in (1, 16):
            for page in (0, 16):
                shapes.append(("llama3-8b", batch, 32, 8, 128, cache, page))
    shapes += [("mqa", 16, 32, 1, 128, 4096, 0), ("hd64", 16, 32, 8, 64, 4096, 0),
               ("hd256", 4, 16, 4, 256, 4096, 0)]
    print("| shape | batch | heads | d | cache | page | ms | GB/s | of probe |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, b, h, hk, d, cache, page in shapes:
        t, gbs = run(fmha, bf16, b, h, hk, d, cache, page, args.iters)
        print("| %s | %d | %d/%d | %d | %d | %s | %.3f | %.1f | %.0f%% |"
              % (name, b, h, hk, d, cache, page or "-", t * 1e3, gbs, 100 * gbs / probe))


if __name__ == "__main__":
    main()
