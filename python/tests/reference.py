"""reference.py — the tests' own float64 attention in numpy (it never calls
libfmha, whose C reference it would otherwise share mistakes with), the
Philox4x32-10 dropout stream fmha documents in include/fmha.h, and helpers
to build inputs in each dtype and layout."""
import numpy as np

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bf16 cases skip
    ml_dtypes = None
    BF16 = None

DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16}
# Relative L2 error allowed against float64: f32 accumulates in f32; f16/bf16
# outputs are rounded to 8-11 bits and P is rounded to 16 bits before P V.
TOL = {"f32": 1e-5, "f16": 1e-2, "bf16": 1e-2}

_M32 = 0xFFFFFFFF


# ------------------------------------------------------------------ dropout stream


def philox4x32_10(c, k0, k1):
    """Philox4x32-10 on four uint64 arrays holding 32-bit counter words."""
    c0, c1, c2, c3 = (np.array(x, dtype=np.uint64) for x in np.broadcast_arrays(*c))
    m32 = np.uint64(_M32)
    for _ in range(10):
        p0 = c0 * np.uint64(0xD2511F53)  # both factors < 2^32: no wrap in 64 bits
        p1 = c2 * np.uint64(0xCD9E8D57)
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & m32,
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & m32)
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def dropout_keep(seed, offset, seq_head, row, col, p):
    """Keep mask of elements (seq * num_heads + head, row, col), broadcast:
    counter (col / 4, row, seq_head, offset low word), key (seed low word,
    seed high word ^ offset high word); word col % 4 keeps iff >= floor(p 2^32)."""
    seq_head, row, col = (np.asarray(x, dtype=np.uint64) for x in (seq_head, row, col))
    words = philox4x32_10((col >> np.uint64(2), row, seq_head, np.uint64(offset & _M32)),
                          seed & _M32, ((seed >> 32) ^ (offset >> 32)) & _M32)
    word = np.choose((col & np.uint64(3)).astype(np.intp), words)
    threshold = min(int(np.floor(p * 2.0**32)), _M32)
    return word >= np.uint64(threshold)


# ------------------------------------------------------------------ attention


def visible(sq, sk, causal=False, window=(-1, -1)):
    """[sq, sk] mask of the keys each query sees, bottom-right aligned."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq
    vis = np.ones((sq, sk), dtype=bool)
    right = 0 if causal else window[1]
    if right >= 0:
        vis &= j <= diag + right
    if window[0] >= 0:
        vis &= j >= diag - window[0]
    return vis


def attention(q, k, v, causal=False, scale=None, window=(-1, -1), softcap=0.0, dropout_p=0.0,
              seed=0, offset=0, seq_base=0, bias=None, sinks=None):
    """q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] in any float
    dtype -> (out [B, Sq, H, Dv], lse [B, H, Sq]) in float64. seq_base: the
    sequence index of batch entry 0 in the dropout stream (packed batches).
    bias: added to the scores after softcap (broadcast to [B, H, Sq, Sk];
    -inf hides a key); sinks [H]: one more logit per head, a key of value 0."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    k = np.repeat(k, g, axis=2)  # query head h reads KV head h // g
    v = np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * (scale if scale else 1.0 / np.sqrt(D))
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    s = np.where(visible(Sq, Sk, causal, window), s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if Sk else np.full((B, H, Sq, 1), -np.inf)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
    if sink is not None:
        m = np.maximum(m, sink)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink - np.where(np.isfinite(m), m, 0.0))
    lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    if dropout_p > 0:
        seq_head = (seq_base + np.arange(B))[:, None, None, None] * H + \
            np.arange(H)[None, :, None, None]
        keep = dropout_keep(seed, offset, seq_head, np.arange(Sq)[None, None, :, None],
                            np.arange(Sk)[None, None, None, :], dropout_p)
        p = np.where(keep, p / (1.0 - dropout_p), 0.0)  # l keeps the dropped ones
    out = np.einsum("bhqk,bkhd->bhqd", p, v) / np.where(l > 0, l, 1.0)
    return out.transpose(0, 2, 1, 3), lse


def attention_grads(q, k, v, dout, causal=False, scale=None, window=(-1, -1), softcap=0.0,
                    dropout_p=0.0, seed=0, offset=0, seq_base=0, bias=None, sinks=None):
    """The float64 gradients (dq, dk, dv) of sum(dout * out) for attention()'s
    out, written out from the chain rule: P the softmax, dP = dO V^T (times
    the dropout factors), D = rowsum(P * dP), dS = P (dP - D), through softcap
    times 1 - tanh^2, dQ = scale dS K, dK = scale dS^T Q and dV = P^T dO
    (P dropped), each KV head summing its query heads. bias and sinks as in
    attention(); with sinks the result gains dsinks = -sum P_sink D per head."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = scale if scale else 1.0 / np.sqrt(D)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    t = np.tanh(s / softcap) if softcap > 0 else None
    if softcap > 0:
        s = softcap * t
    vis = visible(Sq, Sk, causal, window)
    z = s + np.asarray(bias, dtype=np.float64) if bias is not None else s
    z = np.where(vis, z, -np.inf)
    m = z.max(axis=-1, keepdims=True) if Sk else np.full((B, H, Sq, 1), -np.inf)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
    if sink is not None:
        m = np.maximum(m, sink)
    p = np.exp(z - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink - np.where(np.isfinite(m), m, 0.0))
    p_sink = None if sink is None else np.exp(sink - np.where(np.isfinite(m), m, 0.0)) / l
    p = p / np.where(l > 0, l, 1.0)
    f = np.ones_like(p)
    if dropout_p > 0:
        seq_head = (seq_base + np.arange(B))[:, None, None, None] * H + \
            np.arange(H)[None, :, None, None]
        keep = dropout_keep(seed, offset, seq_head, np.arange(Sq)[None, None, :, None],
                            np.arange(Sk)[None, None, None, :], dropout_p)
        f = np.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vr) * f
    dd = (p * dp).sum(axis=-1, keepdims=True)
    ds = p * (dp - dd)
    if softcap > 0:
        ds = ds * (1.0 - t * t)
    ds = ds * scale
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q).reshape(B, Sk, Hkv, g, D).sum(axis=3)
    dv = np.einsum("bhqk,bqhd->bkhd", p * f, dout).reshape(B, Sk, Hkv, g, -1).sum(axis=3)
    if sink is not None:
        return dq, dk, dv, -(p_sink * dd).sum(axis=(0, 2, 3))
    return dq, dk, dv


def varlen_attention_grads(q, k, v, dout, cu_q, cu_k, **kw):
    """attention_grads() per sequence of a packed batch; tokens in no sequence get 0."""
    dq, dk, dv = (np.zeros(x.shape) for x in (q, k, v))
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        g = attention_grads(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1],
                            seq_base=b, **kw)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def varlen_attention(q, k, v, cu_q, cu_k, **kw):
    """Packed q [Tq, H, D], k/v [Tk, Hkv, D(v)] -> (out [Tq, H, Dv], lse [H, Tq])."""
    Tq, H = q.shape[0], q.shape[1]
    out = np.zeros((Tq, H, v.shape[2]))
    lse = np.full((H, Tq), -np.inf)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        o, l = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], seq_base=b, **kw)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


# ------------------------------------------------------------------ inputs and checks


def make(rng, shape, dtype, layout="bshd"):
    """A [B, S, H, D] array of standard normals in `dtype` laid out as
    "bshd" (contiguous), "bhsd" (a transposed view of [B, H, S, D] memory)
    or "strided" (every other head of a padded buffer, at an offset)."""
    B, S, H, D = shape
    dt = DTYPES[dtype]
    if layout == "bshd":
        return rng.standard_normal(shape).astype(dt)
    if layout == "bhsd":
        return rng.standard_normal((B, H, S, D)).astype(dt).transpose(0, 2, 1, 3)
    buf = rng.standard_normal((B, S + 1, 2 * H, D + 5)).astype(dt)
    return buf[:, 1:, ::2, 2:2 + D]


def rel_l2(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    num = np.linalg.norm(got - want)
    den = np.linalg.norm(want)
    return num / den if den > 0 else num


def assert_close(got, want, dtype, what="out"):
    err = rel_l2(got, want)
    assert err <= TOL[dtype], "%s: relative L2 %.3g > %.3g (%s)" % (what, err, TOL[dtype], dtype)


def assert_lse(got, want, tol=1e-5):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), "rows with no visible key differ"
    fin = np.isfinite(want)
    # tol: scores and their sums are f32 for every input dtype, so 1e-5 holds
    err = np.abs(got[fin] - want[fin]) / np.maximum(1.0, np.abs(want[fin]))
    assert err.size == 0 or err.max() <= tol, "lse: max error %.3g > %.3g" % (err.max(), tol)
