"""example.py — the fmha Python package on numpy arrays: a causal GQA layer
(8 query heads sharing 2 KV heads) on random float32 inputs, checked against
attention written out in numpy. Exits 0 when they agree, 1 otherwise.

    pip install . && python3 examples/python/example.py
    # or, with a built tree: FMHA_LIBRARY=build/libfmha.so PYTHONPATH=python python3 examples/python/example.py
"""
import sys

import numpy as np

import fmha

B, S, H, HKV, D = 2, 128, 8, 2, 64
rng = np.random.default_rng(0)
q = rng.standard_normal((B, S, H, D), dtype=np.float32)      # [batch, seq, heads, head_dim]
k = rng.standard_normal((B, S, HKV, D), dtype=np.float32)
v = rng.standard_normal((B, S, HKV, D), dtype=np.float32)

layer = fmha.Attention(H, D, num_kv_heads=HKV, causal=True)  # validated here, once
out, lse = layer.forward(q, k, v, return_lse=True)           # out [B, S, H, D], lse [B, H, S]

# The same in numpy: each query head reads its group's KV head; key j is
# visible to query i iff j <= i (causal, equal lengths).
kk = np.repeat(k, H // HKV, axis=2).astype(np.float64)
vv = np.repeat(v, H // HKV, axis=2).astype(np.float64)
scores = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) / np.sqrt(D)
scores = np.where(np.tril(np.ones((S, S), dtype=bool)), scores, -np.inf)
lse_ref = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
ref = np.einsum("bhqk,bkhd->bqhd", np.exp(scores - lse_ref[..., None]), vv)

err = np.abs(out - ref).max()
lse_err = np.abs(lse - lse_ref).max()
ok = err < 1e-4 and lse_err < 1e-4
print("fmha %s on %s: max |out - ref| = %.2g, max |lse - ref| = %.2g: %s"
      % (fmha.__version__, layer.kernel, err, lse_err, "ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
