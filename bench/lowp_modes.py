"""lowp_modes.py — the error of each low-precision attention scheme, emulated in float64 numpy
(ml_dtypes for E4M3; independent of libfmha), on Gaussian and on DiT-like inputs
(dit_inputs.py).

Each scheme quantizes q, k, v as the kernel would, rounds P as the kernel's second GEMM sees it
(E4M3 times 2^8, or unsigned 8-bit integers of P / rowmax * 255), and computes everything else
in float64 against float64 attention on the unquantized inputs:

  e4m3            q, k, v E4M3, one scale per tensor; P E4M3 (fmha's fp8_compute=per_tensor)
  e4m3 smooth-k   the same with K's per-channel mean subtracted first (fp8_smooth_k)
  int8_qk         fmha's fp8_compute=int8_qk: K smoothed, q and k rotated by the orthonormal
                  Hadamard matrix, then INT8, q one scale per token, k one per head; v E4M3 one
                  scale per head; P E4M3
  int8_qk, no rotation   the same without the rotation (head dims that are no power of two)
  sage2-like      q INT8 per token, K smoothed INT8 per 128 keys, no rotation; P and V E4M3 (V
                  one scale per channel): SageAttention2's granularity
  int8 P V        q, k as sage2-like, P UINT8 (of rowmax * 255), V INT8 per channel: both GEMMs
                  on integer tensor cores with exact sums (considered for fmha and not taken:
                  on peaked attention UINT8 P loses the small weights that E4M3 keeps)

--captured also measures q, k, v that diffusers' Flux and Wan transformers computed (small
configs at head dim 128, random weights: captured_inputs.py; needs torch and diffusers).

usage: python3 bench/lowp_modes.py [--seqlen S] [--heads H] [--head-dim D] [--captured]
                                   [--out FILE.md]
"""
import argparse
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dit_inputs  # noqa: E402
import results_md  # noqa: E402

BLOCK = 128


def e4m3(x, scale):
    return np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


def e4m3_tensor(x):
    return e4m3(x, np.abs(x).max() / 448.0)


def int8(x, amax):
    scale = np.where(amax > 0, amax / 127.0, 1.0)
    return np.clip(np.rint(x / scale), -127, 127) * scale


def int8_per_token(x):  # [s, h, d]: one scale per (token, head)
    return int8(x, np.abs(x).max(axis=2, keepdims=True))


def int8_per_block(x):  # one scale per (BLOCK tokens, head)
    out = np.empty_like(x)
    for b in range(0, x.shape[0], BLOCK):
        blk = x[b:b + BLOCK]
        out[b:b + BLOCK] = int8(blk, np.abs(blk).max(axis=(0, 2), keepdims=True))
    return out


def int8_per_channel(x):  # one scale per (head, channel) over the tokens
    return int8(x, np.abs(x).max(axis=0, keepdims=True))


def e4m3_per_channel(x):
    amax = np.abs(x).max(axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / 448.0, 1.0)
    return e4m3(x, scale)


def int8_per_head(x):  # one scale per head over the tokens
    return int8(x, np.abs(x).max(axis=(0, 2), keepdims=True))


def e4m3_per_head(x):
    amax = np.abs(x).max(axis=(0, 2), keepdims=True)
    return e4m3(x, np.where(amax > 0, amax / 448.0, 1.0))


def smooth(k):
    return k - k.mean(axis=0, keepdims=True)


def hadamard(n):
    """Orthonormal Sylvester Hadamard matrix of order n (a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def attention(q, k, v, p_round=None):
    s = np.einsum("shd,thd->hst", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    l = p.sum(-1, keepdims=True)  # the kernel sums P before rounding it
    if p_round == "e4m3":
        p = e4m3(p * 256.0, 1.0) / 256.0
    elif p_round == "u8":
        p = np.rint(p * 255.0) / 255.0
    return np.einsum("hst,thd->shd", p / l, v)


def schemes(q, k, v):
    q, k, v = (t.astype(np.float64) for t in (q, k, v))
    bf = lambda t: t.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    rot = hadamard(q.shape[-1])
    return {
        "bf16": attention(bf(q), bf(k), bf(v)),
        "e4m3": attention(e4m3_tensor(q), e4m3_tensor(k), e4m3_tensor(v), "e4m3"),
        "e4m3 smooth-k": attention(e4m3_tensor(q), e4m3_tensor(smooth(k)), e4m3_tensor(v), "e4m3"),
        "int8_qk": attention(int8_per_token(q @ rot), int8_per_head(smooth(k) @ rot),
                             e4m3_per_head(v), "e4m3"),
        "int8_qk, no rotation": attention(int8_per_token(q), int8_per_head(smooth(k)),
                                          e4m3_per_head(v), "e4m3"),
        "sage2-like": attention(int8_per_token(q), int8_per_block(smooth(k)), e4m3_per_channel(v),
                                "e4m3"),
        "int8 P V": attention(int8_per_token(q), int8_per_block(smooth(k)), int8_per_channel(v),
                              "u8"),
    }


def metrics(x, ref):
    d = x - ref
    rel = np.linalg.norm(d) / np.linalg.norm(ref)
    cos = np.sum(x * ref) / (np.linalg.norm(x) * np.linalg.norm(ref))
    return rel, cos, np.abs(d).max()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128, help="a power of two (the rotation)")
    ap.add_argument("--captured", action="store_true",
                    help="also q, k, v of diffusers' Flux and Wan (captured_inputs.py)")
    results_md.add_arguments(ap, {"lowp-modes": "Low-precision schemes emulated (float64 numpy)"})
    opt = ap.parse_args()
    rows = []
    print("%-9s %-21s %10s %12s %10s" % ("inputs", "scheme", "rel. L2", "1 - cosine", "max err"))
    kinds = list(dit_inputs.KINDS)
    if opt.captured:
        import captured_inputs
        kinds += list(captured_inputs.MODELS)
    for kind in kinds:
        if kind in dit_inputs.KINDS:
            q, k, v = dit_inputs.make(opt.seqlen, opt.heads, opt.head_dim, seed=0, kind=kind)
        else:
            q, k, v = captured_inputs.capture(kind)
        ref = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
        for name, out in schemes(q, k, v).items():
            rel, cos, mx = metrics(out, ref)
            print("%-9s %-21s %10.3e %12.3e %10.3e" % (kind, name, rel, 1 - cos, mx))
            rows.append([kind, name, "%.3e" % rel, "%.3e" % (1 - cos), "%.3e" % mx])
    table = results_md.table(["inputs", "scheme", "rel. L2", "1 − cosine", "max abs error"], rows,
                             "llrrr")
    software = f"numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}; no libfmha"
    captured = ""
    if opt.captured:
        import diffusers
        import torch
        software += f"; torch {torch.__version__}, diffusers {diffusers.__version__}"
        captured = ("; `flux`, `wan`: the q, k, v of the first self-attention of diffusers' Flux "
                    "([1088, 2, 128]: 64 text + 1024 image tokens) and Wan ([1024, 2, 128]) "
                    "transformers, small configs with random weights (`bench/captured_inputs.py`)")
    results_md.write(opt, [
        ("Machine", results_md.cpu_machine()),
        ("Software", software),
        ("Method", "float64 attention of [%d, %d, %d] inputs from `bench/dit_inputs.py` (seed 0)%s, "
                   "with q, k, v and P rounded as each scheme's kernel rounds them (module "
                   "docstring); errors against float64 attention on the unquantized inputs" %
                   (opt.seqlen, opt.heads, opt.head_dim, captured)),
        ("Peers", "float64 attention on the unquantized inputs; bf16 inputs for scale")], table)


if __name__ == "__main__":
    main()
