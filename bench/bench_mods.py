"""bench_mods.py — the CPU cost of the score modifiers (attention masks, ALiBi
slopes, sinks: fmha_forward_args) beside the same forward without them, in
one process: a bf16 [1, 2048, 16, 128] forward (non-causal), the median of
5 calls each, the plain forward timed first and last.

    python3 bench/bench_mods.py [--lib build/libfmha.so] [--threads 2] [--seqlen 2048]
"""
import argparse
import os
import sys
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default="build/libfmha.so")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (0: as set)")
    ap.add_argument("--seqlen", type=int, default=2048)
    opt = ap.parse_args()
    if opt.threads:
        os.environ["OMP_NUM_THREADS"] = str(opt.threads)
    os.environ["FMHA_LIBRARY"] = os.path.abspath(opt.lib)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import fmha
    import ml_dtypes

    rng = np.random.default_rng(0)
    B, S, H, D = 1, opt.seqlen, 16, 128
    q, k, v = (rng.standard_normal((B, S, H, D)).astype(ml_dtypes.bfloat16) for _ in range(3))
    mods = [("none", {}),
            ("sinks [H]", dict(sinks=rng.standard_normal(H).astype(np.float32))),
            ("alibi_slopes [H]", dict(alibi_slopes=(0.1 * rng.random(H)).astype(np.float32))),
            ("bool mask [S, S]", dict(attn_mask=rng.random((S, S)) < 0.9)),
            ("f32 mask [S, S]", dict(attn_mask=rng.standard_normal((S, S)).astype(np.float32))),
            ("bool mask [B, 1, 1, S]", dict(attn_mask=rng.random((B, 1, 1, S)) < 0.9)),
            ("none", {})]

    def ms(kw):
        fmha.attention(q, k, v, **kw)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fmha.attention(q, k, v, **kw)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[2] * 1e3

    print("kernel %s, q/k/v [%d, %d, %d, %d] bf16" % (fmha.Attention(H, D).kernel, B, S, H, D))
    rows = [(name, ms(kw)) for name, kw in mods]
    base = (rows[0][1] + rows[-1][1]) / 2
    print("| modifiers | ms | / none |\n|---|---:|---:|")
    for name, t in rows:
        print("| %s | %.1f | %.2f |" % (name, t, t / base))


if __name__ == "__main__":
    main()
