"""bench_decode.py — fmha's CPU decode (fmha.kvcache_attention) on decode
shapes, as achieved bandwidth: bytes of K and V read (plus q and out) per
second, beside this machine's read bandwidth measured in the same run by a
STREAM-like probe (a sum over an array far larger than the caches, on the
same number of threads as fmha), so that the figure is a fraction of what
the memory gives here.

    python3 bench/bench_decode.py [--quick] [--lib build/libfmha.so] [--threads N] [--fp8]

Shapes: Llama-3 8B (32 query heads, 8 KV heads, head dim 128) at batch 1
and 16 with 1k and 8k caches, contiguous and in pages of 16; MQA; head dims
64 and 256. bf16 caches (ml_dtypes). --fp8: the Llama shapes again with the
caches also as FP8 (e4m3, a descale per KV head from its largest magnitude):
both times, and each output's relative L2 error against float64 attention
over the bf16 caches (the first four sequences)."""
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


def f64_rel_l2(out, q, kc, vc, rows):
    """Relative L2 of out against float64 attention of q over the caches;
    rows(b) indexes sequence b's keys in them (first four sequences)."""
    num = den = 0.0
    for b in range(min(q.shape[0], 4)):
        k = np.asarray(kc[rows(b)], dtype=np.float64)       # [S, Hkv, D]
        v = np.asarray(vc[rows(b)], dtype=np.float64)
        qb = np.asarray(q[b, 0], dtype=np.float64)            # [H, D]
        g = qb.shape[0] // k.shape[1]
        s = np.einsum("hd,shd->hs", qb, np.repeat(k, g, axis=1)) / np.sqrt(qb.shape[1])
        w = np.exp(s - s.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        want = np.einsum("hs,shd->hd", w, np.repeat(v, g, axis=1))
        num += float(((np.asarray(out[b, 0], dtype=np.float64) - want) ** 2).sum())
        den += float((want ** 2).sum())
    return (num / den) ** 0.5


def run_fp8(fmha, bf16, f8, batch, heads, kv_heads, d, cache, page, iters):
    """(bf16 ms, fp8 ms, bf16 error, fp8 error) on one shape's caches."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, 1, heads, d)).astype(bf16)
    shape = (batch * cache // page, page, kv_heads, d) if page else (batch, cache, kv_heads, d)
    kc = rng.standard_normal(shape).astype(bf16)
    vc = rng.standard_normal(shape).astype(bf16)
    kd = (np.abs(kc.astype(np.float32)).max(axis=(0, 1, 3)) / 448).astype(np.float32)
    vd = (np.abs(vc.astype(np.float32)).max(axis=(0, 1, 3)) / 448).astype(np.float32)
    k8 = np.clip(kc.astype(np.float32) / kd[:, None], -448, 448).astype(f8)
    v8 = np.clip(vc.astype(np.float32) / vd[:, None], -448, 448).astype(f8)
    table = None
    if page:
        table = rng.permutation(shape[0]).reshape(batch, cache // page).astype(np.int32)

        def rows(b):
            t = np.arange(cache)
            return table[b, t // page], t % page
    else:
        def rows(b):
            return b, np.arange(cache)
    lens = np.full(batch, cache, dtype=np.int32)
    layer = fmha.Attention(heads, d, num_kv_heads=kv_heads)
    out = []
    times = []
    for k, v, desc in ((kc, vc, {}), (k8, v8, {"k_descale": kd, "v_descale": vd})):
        o = layer.decode(q, k, v, cache_seqlens=lens, block_table=table, **desc)
        t = []
        for _ in range(iters):
            t0 = time.perf_counter()
            layer.decode(q, k, v, cache_seqlens=lens, block_table=table, **desc)
            t.append(time.perf_counter() - t0)
        times.append(float(np.median(t)))
        out.append(o)
    return (times[0], times[1], f64_rel_l2(out[0], q, kc, vc, rows),
            f64_rel_l2(out[1], q, kc, vc, rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="libfmha.so to load (default: the package's)")
    ap.add_argument("--quick", action="store_true", help="the 1k caches only")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads for fmha (OMP_NUM_THREADS) and the probe")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fp8", action="store_true", help="FP8 caches beside bf16 (time, error)")
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
    if args.fp8:
        print("| shape | batch | cache | page | bf16 ms | fp8 ms | bf16 / fp8 | bf16 rel-L2 | "
              "fp8 rel-L2 |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, b, h, hk, d, cache, page in shapes:
            if name != "llama3-8b":
                continue
            t16, t8, e16, e8 = run_fp8(fmha, bf16, ml_dtypes.float8_e4m3fn, b, h, hk, d, cache,
                                       page, args.iters)
            print("| %s | %d | %d | %s | %.3f | %.3f | %.2f | %.2e | %.2e |"
                  % (name, b, cache, page or "-", t16 * 1e3, t8 * 1e3, t16 / t8, e16, e8))
        return
    print("| shape | batch | heads | d | cache | page | ms | GB/s | of probe |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, b, h, hk, d, cache, page in shapes:
        t, gbs = run(fmha, bf16, b, h, hk, d, cache, page, args.iters)
        print("| %s | %d | %d/%d | %d | %d | %s | %.3f | %.1f | %.0f%% |"
              % (name, b, h, hk, d, cache, page or "-", t * 1e3, gbs, 100 * gbs / probe))


if __name__ == "__main__":
    main()
