"""flash_attn_with_kvcache / kvcache_attention / Attention.decode against the
tests' own numpy reference: contiguous and paged caches (shuffled pages,
partly filled last pages), new tokens appended in place with and without
rotary embedding (both channel pairings), GQA, causal and windows, LSE; and
bad arguments refused with the caches untouched."""
import numpy as np
import pytest

import fmha
from fmha.flash_attn import flash_attn_with_kvcache
from reference import DTYPES, assert_close, attention

FA_TOL_LSE = 1e-4


def rotate(x, cos, sin, pos, interleaved):
    """x [..., S, H, D] rotated at positions pos [S] (float64)."""
    x = np.asarray(x, dtype=np.float64).copy()
    rd = 2 * cos.shape[1]
    c = cos[pos][:, None, :].astype(np.float64)
    s = sin[pos][:, None, :].astype(np.float64)
    if interleaved:
        x1, x2 = x[..., 0:rd:2].copy(), x[..., 1:rd:2].copy()
        x[..., 0:rd:2], x[..., 1:rd:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :rd // 2].copy(), x[..., rd // 2:rd].copy()
        x[..., :rd // 2], x[..., rd // 2:rd] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def tables(length, rotary_dim):
    pos = np.arange(length)[:, None]
    inv = 10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    return np.cos(pos * inv).astype(np.float32), np.sin(pos * inv).astype(np.float32)


def expected(q, k_cache, v_cache, knew, vnew, lens, causal, window, rot, rows):
    """The answer and the updated caches, gathered per sequence: rows(b)
    gives sequence b's cache positions as (index arrays into the caches)."""
    B, Sq = q.shape[0], q.shape[1]
    outs, lses = [], []
    for b in range(B):
        n = lens[b]
        keys = np.asarray(k_cache, dtype=np.float64)[rows(b, n)]
        vals = np.asarray(v_cache, dtype=np.float64)[rows(b, n)]
        qb = np.asarray(q[b], dtype=np.float64)
        if knew is not None:
            kn = np.asarray(knew[b], dtype=np.float64)
            if rot is not None:
                cos, sin, inter = rot
                kn = rotate(kn, cos, sin, n + np.arange(kn.shape[0]), inter)
                local = causal or window != (-1, -1)
                qpos = n + (np.arange(Sq) if local else np.zeros(Sq, dtype=int))
                qb = rotate(qb, cos, sin, qpos, inter)
            keys = np.concatenate([keys, kn])
            vals = np.concatenate([vals, np.asarray(vnew[b], dtype=np.float64)])
        o, l = attention(qb[None], keys[None], vals[None], causal=causal, window=window)
        outs.append(o[0])
        lses.append(l[0])
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rot", [None, "half", "interleaved"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_kvcache(rng, paged, rot, dtype):
    if DTYPES[dtype] is None:
        pytest.skip("ml_dtypes missing")
    dt = DTYPES[dtype]
    B, Sq, H, Hkv, D = 3, 2, 8, 2, 64
    lens = np.array([0, 37, 130], dtype=np.int32)
    page = 16
    capacity = 160
    if paged:
        pages_per = capacity // page
        order = rng.permutation(B * pages_per + 3)
        table = order[:B * pages_per].reshape(B, pages_per).astype(np.int32)
        k_cache = rng.standard_normal((B * pages_per + 3, page, Hkv, D)).astype(dt)
        v_cache = rng.standard_normal((B * pages_per + 3, page, Hkv, D)).astype(dt)

        def rows(b, n):
            t = np.arange(n)
            return table[b, t // page], t % page
    else:
        table = None
        k_cache = rng.standard_normal((B, capacity, Hkv, D)).astype(dt)
        v_cache = rng.standard_normal((B, capacity, Hkv, D)).astype(dt)

        def rows(b, n):
            return b, np.arange(n)
    q = rng.standard_normal((B, Sq, H, D)).astype(dt)
    knew = rng.standard_normal((B, Sq, Hkv, D)).astype(dt)
    vnew = rng.standard_normal((B, Sq, Hkv, D)).astype(dt)
    cos = sin = None
    rot_args = None
    if rot:
        cos, sin = tables(capacity + 4, D if rot == "half" else D // 2)
        rot_args = (cos, sin, rot == "interleaved")
    k0, v0 = k_cache.copy(), v_cache.copy()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, knew, vnew, rotary_cos=cos,
                                       rotary_sin=sin, cache_seqlens=lens, block_table=table,
                                       causal=True, rotary_interleaved=rot == "interleaved",
                                       return_softmax_lse=True)
    want, want_lse = expected(q, k0, v0, knew, vnew, lens, True, (-1, -1), rot_args, rows)
    assert_close(out, want, dtype)
    np.testing.assert_allclose(lse, want_lse, atol=2e-2 if dtype == "bf16" else FA_TOL_LSE)
    # the caches now hold the new tokens (rotated), the rest untouched
    for b in range(B):
        r = rows(b, lens[b] + Sq)
        got_k = np.asarray(k_cache[r], dtype=np.float64)[lens[b]:]
        want_k = np.asarray(knew[b], dtype=np.float64)
        if rot:
            want_k = rotate(want_k, cos, sin, lens[b] + np.arange(Sq), rot == "interleaved")
        np.testing.assert_allclose(got_k, want_k, rtol=1e-2 if dtype == "bf16" else 1e-5,
                                   atol=1e-2 if dtype == "bf16" else 1e-5)
        np.testing.assert_array_equal(np.asarray(v_cache[r], dtype=np.float64)[lens[b]:],
                                      np.asarray(vnew[b], dtype=np.float64))
        np.testing.assert_array_equal(k_cache[rows(b, lens[b])], k0[rows(b, lens[b])])


def test_layer_decode_and_splits(rng):
    """Attention.decode: GQA, a window, an int cache_seqlens, splits."""
    B, H, Hkv, D, S = 2, 6, 2, 32, 700
    layer = fmha.Attention(H, D, num_kv_heads=Hkv, window=(100, 0))
    q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    kc = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
    vc = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
    want, _ = attention(q, kc[:, :650], vc[:, :650], window=(100, 0))
    for splits in (0, 1, 5):
        out = layer.decode(q, kc, vc, cache_seqlens=650, num_splits=splits)
        assert_close(out, want, "f32")


def test_errors_leave_caches(rng):
    B, H, D, page = 2, 2, 16, 4
    kc = rng.standard_normal((6, page, H, D)).astype(np.float32)
    vc = rng.standard_normal((6, page, H, D)).astype(np.float32)
    q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    kn = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    k0 = kc.copy()
    table = np.array([[0, 1], [2, 6]], dtype=np.int32)  # page 6 is past the pool
    with pytest.raises(fmha.InvalidArgumentError, match=r"block_table\[1\]\[1\] \(6\)"):
        flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=[3, 4], block_table=table)
    np.testing.assert_array_equal(kc, k0)
    with pytest.raises(fmha.InvalidArgumentError, match="past the cache's capacity"):
        flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=[3, 8],
                                block_table=np.array([[0, 1], [2, 3]], dtype=np.int32))
    np.testing.assert_array_equal(kc, k0)
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, kc, vc, cache_leftpad=np.zeros(B, dtype=np.int32))
    with pytest.raises(fmha.InvalidArgumentError, match="dropout_p"):
        fmha.Attention(H, D, dropout_p=0.1).decode(q, kc[:2], vc[:2])


def test_fa3_interface(rng):
    """FA3's flash_attn_with_kvcache: page_table by keyword, the same answer
    as FA2's block_table; FA3-only inputs refused."""
    from fmha import flash_attn_interface as fa3
    B, H, D, page = 2, 4, 32, 8
    kc = rng.standard_normal((6, page, 2, D)).astype(np.float32)
    vc = rng.standard_normal((6, page, 2, D)).astype(np.float32)
    q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    table = np.array([[5, 0, 2], [1, 3, 4]], dtype=np.int32)
    got = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[20, 13], page_table=table,
                                      causal=True)
    want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[20, 13], block_table=table,
                                   causal=True)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(NotImplementedError, match="rotary_seqlens"):
        fa3.flash_attn_with_kvcache(q, kc, vc, rotary_seqlens=np.zeros(B, dtype=np.int32))


@pytest.mark.parametrize("layout", ["tensor", "head", "page"])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_caches(rng, layout, paged):
    """float8_e4m3fn caches with their descales (one, per KV head, per page):
    the answer is attention over the dequantized caches, and new tokens go in
    as codes of value / descale."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    f8 = ml_dtypes.float8_e4m3fn
    B, Sq, H, Hkv, D, page = 2, 1, 8, 2, 64, 16
    lens = np.array([45, 100], dtype=np.int32)
    rows_n = B * 8 + 1 if paged else B
    per = 8 * page if paged else 128
    shape = (rows_n, page if paged else per, Hkv, D)
    ds = {"tensor": (1,), "head": (Hkv,), "page": (rows_n, Hkv)}[layout]
    kd = (rng.uniform(0.5, 1.5, ds) / 64).astype(np.float32)
    vd = (rng.uniform(0.5, 1.5, ds) / 64).astype(np.float32)

    def scale_of(d):  # the descale of every (row or page, KV head) of the cache
        return np.broadcast_to(d if layout == "page" else d.reshape(1, -1), (rows_n, Hkv))

    ks, vs = scale_of(kd), scale_of(vd)
    def codes(x):  # saturating at 448 as fmha does (ml_dtypes' cast gives NaN there)
        return np.clip(x, -448, 448).astype(f8)

    k_cache = codes(rng.standard_normal(shape) / ks[:, None, :, None])
    v_cache = codes(rng.standard_normal(shape) / vs[:, None, :, None])
    if paged:
        table = rng.permutation(rows_n)[:B * 8].reshape(B, 8).astype(np.int32)

        def rows(b, n):
            t = np.arange(n)
            return table[b, t // page], t % page
    else:
        table = None

        def rows(b, n):
            return b, np.arange(n)
    q = rng.standard_normal((B, Sq, H, D)).astype(np.float32)
    knew = rng.standard_normal((B, Sq, Hkv, D)).astype(np.float32)
    vnew = rng.standard_normal((B, Sq, Hkv, D)).astype(np.float32)
    kval = k_cache.astype(np.float64) * ks[:, None, :, None]  # the caches' values
    vval = v_cache.astype(np.float64) * vs[:, None, :, None]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, knew, vnew, cache_seqlens=lens,
                                  block_table=table, causal=True, k_descale=kd, v_descale=vd)
    # the new tokens, as the caches now hold them
    for b in range(B):
        r = rows(b, lens[b] + Sq)
        rr = tuple(np.asarray(x)[lens[b]:] for x in r) if paged else (b, r[1][lens[b]:])
        row = rr[0] if paged else np.full(Sq, b)
        want_k = codes(knew[b] / ks[row][:, :, None])
        want_v = codes(vnew[b] / vs[row][:, :, None])
        np.testing.assert_array_equal(k_cache[rr].view(np.uint8), want_k.view(np.uint8))
        np.testing.assert_array_equal(v_cache[rr].view(np.uint8), want_v.view(np.uint8))
        kval[rr] = k_cache[rr].astype(np.float64) * ks[row][:, :, None]
        vval[rr] = v_cache[rr].astype(np.float64) * vs[row][:, :, None]
    want, _ = expected(q, kval, vval, None, None, lens + Sq, True, (-1, -1), None, rows)
    assert_close(out, want, "f32")
    with pytest.raises(ValueError, match="together"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                k_descale=kd)
    with pytest.raises(fmha.InvalidArgumentError, match="v_descale is NULL|k_descale is NULL"):
        fmha.kvcache_attention(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)


def test_max_seqlen_k(rng):
    """max_seqlen_k bounds the keys: the same answer under a bound that
    holds, a clear refusal (caches untouched) under one that does not."""
    B, H, D = 2, 4, 32
    kc = rng.standard_normal((B, 64, 2, D)).astype(np.float32)
    vc = rng.standard_normal((B, 64, 2, D)).astype(np.float32)
    q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    kn = rng.standard_normal((B, 1, 2, D)).astype(np.float32)
    want = fmha.kvcache_attention(q, kc.copy(), vc.copy(), kn, kn, cache_seqlens=[10, 40])
    got = fmha.kvcache_attention(q, kc, vc, kn, kn, cache_seqlens=[10, 40], max_seqlen_k=41)
    np.testing.assert_array_equal(got, want)
    k0 = kc.copy()
    with pytest.raises(fmha.InvalidArgumentError, match=r"past max_seqlen_k \(40\)"):
        fmha.kvcache_attention(q, kc, vc, kn, kn, cache_seqlens=[10, 40], max_seqlen_k=40)
    with pytest.raises(fmha.InvalidArgumentError, match="past the cache's capacity"):
        fmha.kvcache_attention(q, kc, vc, kn, kn, cache_seqlens=[10, 40], max_seqlen_k=65)
    np.testing.assert_array_equal(kc, k0)
