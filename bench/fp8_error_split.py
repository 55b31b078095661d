"""fp8_error_split.py — where FP8 attention's error comes from: float64 numpy
attention with only some of q, k, v quantized to E4M3 (one scale per tensor,
amax / 448, through ml_dtypes: independent of libfmha), on Gaussian inputs and
on K with the outlier channels `fmha accuracy` uses (x20, x40, x70, x100).

A second table tries two transforms applied before quantizing, each exact in
float64 attention: an orthonormal Hadamard rotation of q and k (q K^T is
unchanged), and K smoothed (each head's per-channel mean over the keys
subtracted: every score of a query row moves by the same q . mean, which the
softmax ignores). Outliers come in two kinds there: channels scaled (as
above, zero-mean) and channels offset (a per-channel bias of +20 .. +100, the
form in which large K channels usually appear in trained models).

usage: python3 bench/fp8_error_split.py [--seqlen S] [--heads H] [--head-dim D] [--out FILE.md]

--out writes both tables into that Markdown file as their own section (bench/results_md.py).
"""
import argparse
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_md  # noqa: E402

GAINS = [20, 40, 70, 100]  # channel (j * 37 + 5) % D gets GAINS[j], as in tools/fp8_cli.c


def quantize(x):
    scale = np.float32(np.abs(x).max()) / np.float32(448.0)
    codes = np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return codes.astype(np.float64) * np.float64(scale)


def attention(q, k, v):
    s = np.einsum("shd,thd->hst", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hst,thd->shd", p / p.sum(-1, keepdims=True), v)


def rel_l2(x, ref):
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def hadamard(n):
    """Orthonormal Sylvester Hadamard matrix of order n (a power of two)."""
    if n & (n - 1):
        raise SystemExit(f"--head-dim {n}: the Hadamard rotation needs a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def remedies(rng, shape):
    """FP8 q, k, v with each transform, on scaled and on offset K channels: printed, and returned
    as a Markdown table."""
    rot = hadamard(shape[-1])
    cols = ["none", "Hadamard q, k", "K smoothed", "both"]
    rows = []
    print()
    print("FP8 q, k, v with a transform before quantizing (relative L2 as above)")
    print("%-18s" % "K channels" + "".join("%15s" % c for c in cols))
    for kind in ("scaled x20-x100", "offset +20-+100"):
        q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        for j, g in enumerate(GAINS):
            c = (j * 37 + 5) % shape[-1]
            if kind.startswith("scaled"):
                k[:, :, c] *= np.float32(g)
            else:
                k[:, :, c] += np.float32(g)
        ref = attention(q, k, v)
        errs = []
        for rotate, smooth in ((0, 0), (1, 0), (0, 1), (1, 1)):
            qq, kk = q.astype(np.float64), k.astype(np.float64)
            if smooth:
                kk = kk - kk.mean(axis=0, keepdims=True)
            if rotate:
                qq, kk = qq @ rot, kk @ rot
            errs.append(rel_l2(attention(quantize(qq), quantize(kk), quantize(v)), ref))
        print("%-18s" % kind + "".join("%15.3e" % e for e in errs))
        rows.append([kind] + ["%.3e" % e for e in errs])
    return results_md.table(["K channels"] + cols, rows, "l" + "r" * len(cols))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    results_md.add_arguments(ap, {"fp8-error-split": "FP8 error split by tensor (float64 numpy)"})
    opt = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (opt.seqlen, opt.heads, opt.head_dim)
    which = ["q, k, v", "q", "k", "v", "q, k"]
    print("relative L2 error against float64 attention on the unquantized inputs, "
          "[%d, %d, %d]" % shape)
    print("%-12s" % "inputs" + "".join("%12s" % ("FP8 " + w) for w in which))
    rows = []
    for kind in ("gaussian", "K outliers"):
        q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        if kind != "gaussian":
            for j, g in enumerate(GAINS):
                k[:, :, (j * 37 + 5) % opt.head_dim] *= np.float32(g)
        ref = attention(q, k, v)
        errs = []
        for w in which:
            args = [quantize(x) if name in w.split(", ") else x.astype(np.float64)
                    for name, x in zip("qkv", (q, k, v))]
            errs.append(rel_l2(attention(*args), ref))
        print("%-12s" % kind + "".join("%12.3e" % e for e in errs))
        rows.append([kind] + ["%.3e" % e for e in errs])
    split = results_md.table(["inputs"] + ["FP8 " + w for w in which], rows, "l" + "r" * len(which))
    transforms = remedies(rng, shape)
    results_md.write(opt, [
        ("Machine", results_md.cpu_machine()),
        ("Software", f"numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}; no libfmha"),
        ("Method", "float64 attention of [%d, %d, %d] N(0, 1) inputs with only the named tensors quantized "
                   "to E4M3 (one scale per tensor, amax / 448); K outliers as `fmha accuracy`'s; relative L2 "
                   "against float64 attention on the unquantized inputs; deterministic (seed 0)" % shape),
        ("Peers", "float64 attention on the unquantized inputs")],
        "Relative L2 error, one tensor at a time:\n\n" + split +
        "\n\nFP8 q, k, v with a transform (exact in float64) before quantizing:\n\n" + transforms)


if __name__ == "__main__":
    main()
