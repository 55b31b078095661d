"""dit_inputs.py — attention inputs shaped like a diffusion transformer's, for accuracy
measurements of the low-precision modes (no downloads, deterministic).

Gaussian noise is the easy case for quantized attention: every channel has the same scale and
the softmax is nearly flat. Published analyses of DiT and LLM activations describe three things
that Gaussian inputs lack, and `make(..., kind="dit")` puts each one in:

1. Structure. Tokens are patches of an image or video; neighbouring patches look alike, so a
   query scores its neighbours far above the rest and the softmax is peaked. Here each token's
   hidden state is a smooth function of its position on a grid (random Fourier features) plus
   noise, and q, k, v are random linear maps of it (one set per head), scaled so that the scores'
   standard deviation is about `score_std` (default 3: peaked, not one-hot).
2. Channel outliers in K (and milder ones in Q): a few head-dim channels with a large common
   offset shared by every token (the "bias" form, which K smoothing removes exactly), and a few
   with a large gain (the "scaled" form, which it cannot remove); V has mild channel offsets.
3. Massive-value tokens: a handful of tokens whose residual stream holds huge values in a few
   fixed channels (the "massive activations" of large transformers). The norm before attention
   turns them into one shared direction, and they become attention sinks: keys that draw weight
   from most queries, with small values. The models' QK-norm (RMS norm of each head's q and k
   times learned per-channel gains) is applied, which is where the scaled channels come from.

kind="gaussian" gives N(0, 1) q, k, v for comparison. Arrays are float32, [seqlen, heads, dim].

usage: from dit_inputs import make; q, k, v = make(4096, 8, 128, seed=0)
       python3 bench/dit_inputs.py   (prints each tensor's statistics)
"""
import numpy as np

KINDS = ("gaussian", "dit")


def _hidden(rng, seqlen, width):
    """[seqlen, width] hidden states: smooth in the token's grid position, plus noise."""
    side = int(np.ceil(np.sqrt(seqlen)))
    pos = np.stack(np.divmod(np.arange(seqlen), side), axis=1).astype(np.float64) / side
    freqs = rng.standard_normal((2, width)) * 6.0
    phase = rng.uniform(0, 2 * np.pi, width)
    smooth = np.sqrt(2.0) * np.cos(pos @ freqs + phase)
    return smooth + 0.5 * rng.standard_normal((seqlen, width))


def _rmsnorm(t):
    return t / np.sqrt((t * t).mean(axis=-1, keepdims=True) + 1e-6)


def make(seqlen, heads, dim, seed=0, kind="dit", score_std=3.0, n_massive=4, sink_gain=2.0):
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return tuple(rng.standard_normal((seqlen, heads, dim)).astype(np.float32) for _ in range(3))
    if kind != "dit":
        raise ValueError(f"kind {kind!r}: use one of {KINDS}")
    width = 2 * dim
    x = _hidden(rng, seqlen, width)
    # Massive tokens: a huge value in a few fixed channels of the residual stream, which the
    # pre-attention norm turns into one shared direction.
    massive = rng.choice(seqlen, size=min(n_massive, seqlen), replace=False)
    u = np.zeros(width)
    u[rng.choice(width, size=2, replace=False)] = 100.0
    x[massive] += u
    x = _rmsnorm(x)
    q, k, v = (np.einsum("sw,hwd->shd", x, rng.standard_normal((heads, width, dim)) / np.sqrt(width))
               for _ in range(3))
    # QK-norm (Flux, SD3, Wan): each head's q and k RMS-normalized, times learned per-channel
    # gains, a few of them large: the "scaled" channel outliers.
    for t, big in ((q, (3, 8)), (k, (5, 15))):
        t[:] = _rmsnorm(t)
        gain = np.exp(0.3 * rng.standard_normal((heads, dim)))
        for h in range(heads):
            gain[h, rng.choice(dim, size=2, replace=False)] *= rng.uniform(*big, 2)
        t *= gain
    # Scale q and k alike so that the scores' standard deviation is about score_std.
    s = np.einsum("shd,thd->hst", q[:256], k[:256]) / np.sqrt(dim)
    g = np.sqrt(score_std / max(s.std(), 1e-9))
    q *= g
    k *= g
    # The sinks: each massive token's key points along its head's mean query, with sink_gain
    # times an ordinary key's norm, so most queries give it weight; its value is small.
    qm = q.mean(axis=0)
    kn = np.linalg.norm(k, axis=2).mean(axis=0)
    k[massive] = sink_gain * (kn / np.linalg.norm(qm, axis=1))[:, None] * qm
    v[massive] *= 0.1
    # K's channel offsets, shared by every token (the bias form, which K smoothing removes),
    # and a mild offset on two V channels.
    for h in range(heads):
        k[:, h, rng.choice(dim, size=4, replace=False)] += (
            rng.uniform(10, 40, 4) * np.sign(rng.standard_normal(4)))
        v[:, h, rng.choice(dim, size=2, replace=False)] += rng.uniform(1, 3, 2)
    return tuple(t.astype(np.float32) for t in (q, k, v))


def describe(q, k, v):
    for name, t in zip("qkv", (q, k, v)):
        ch = np.abs(t).max(axis=(0, 1))
        tok = np.linalg.norm(t, axis=2).max(axis=1)
        print(f"{name}: std {t.std():7.3f}  amax {np.abs(t).max():8.2f}  "
              f"channel amax max/median {ch.max() / np.median(ch):6.1f}  "
              f"token norm max/median {tok.max() / np.median(tok):6.1f}")


if __name__ == "__main__":
    for kind in KINDS:
        print(kind)
        describe(*make(4096, 4, 128, kind=kind))
