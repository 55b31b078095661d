"""test_distributed.py — fmha.distributed: the token shards against the C
library's fmha_sp_tokens and each piece's window against the whole
sequence's mask (no torch needed), then every mode on spawned gloo CPU
processes (2 and 4) against single-process fmha.attention: MHA, GQA (split
and replicated), causal contiguous and zigzag, a window, joint tokens in
front and at the rear, packed sequences (cu_seqlens, empty and one-token
ones among them) against fmha.varlen_attention. The torch part is skipped
where torch is missing."""
import ctypes
import os
import random
import socket

import numpy as np
import pytest

import fmha
from fmha import _lib
from fmha import distributed as fd


def _c_tokens(seqlen, u, r, rank, layout):
    class SpConfig(ctypes.Structure):
        _fields_ = [("ulysses", ctypes.c_int), ("ring", ctypes.c_int), ("layout", ctypes.c_int)]
    fn = _lib.lib.fmha_sp_tokens
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(SpConfig), ctypes.c_int64, ctypes.c_int,
                   ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
                   ctypes.POINTER(ctypes.c_int)]
    sp = SpConfig(u, r, 1 if layout == "zigzag" else 0)
    start, length, n = (ctypes.c_int64 * 2)(), (ctypes.c_int64 * 2)(), ctypes.c_int()
    assert fn(ctypes.byref(sp), seqlen, rank, start, length, ctypes.byref(n)) == 0
    return [(start[i], length[i]) for i in range(n.value)]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shards_match_the_c_library(layout):
    for seqlen in (0, 1, 7, 113, 239, 75600):
        for u in (1, 2, 4, 8):
            for r in (1, 2, 3, 5):
                got = [fd.shard_tokens(seqlen, u, r, p, layout) for p in range(u * r)]
                assert got == [_c_tokens(seqlen, u, r, p, layout) for p in range(u * r)]
                idx = sorted(i for p in range(u * r) for i in fd.shard_indices(seqlen, u, r, p,
                                                                                layout))
                assert idx == list(range(seqlen))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_packed_shards_are_each_sequences_own(layout):
    for cu in ([0, 0], [0, 1], [0, 13, 13, 14, 77], [0, 5, 100, 100, 239]):
        for u in (1, 2, 3):
            for r in (1, 2, 4):
                seen = []
                for p in range(u * r):
                    runs = fd.shard_tokens(cu[-1], u, r, p, layout, cu_seqlens=cu)
                    want = []
                    for b in range(len(cu) - 1):
                        want += [cu[b] + i for i in fd.shard_indices(cu[b + 1] - cu[b], u, r, p,
                                                                     layout)]
                    got = fd.shard_indices(cu[-1], u, r, p, layout, cu_seqlens=cu)
                    assert got == want == [s + i for s, n in runs for i in range(n)]
                    seen += got
                assert sorted(seen) == list(range(cu[-1]))


def test_packed_offsets_are_checked():
    with pytest.raises(ValueError, match=r"cu_seqlens\[2\] \(10\) differs from seqlen \(11\)"):
        fd.shard_tokens(11, 1, 2, 0, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="must start at 0 and not decrease"):
        fd.shard_tokens(4, 1, 2, 0, cu_seqlens=[0, 5, 4])


def _mask_range(causal, wl, wr, i, sq, sk):
    """semantics.h's fmha_mask_range: keys [lo, hi) visible to row i."""
    diag = sk - (sq - i)
    lo, hi = 0, sk
    right = 0 if causal else wr
    if right >= 0 and right < sk - 1 - diag:
        hi = diag + right + 1
    if wl >= 0 and wl < diag:
        lo = diag - wl
    return lo, max(hi, lo)


def test_pieces_keep_the_whole_mask():
    rnd = random.Random(26)
    for _ in range(3000):
        n = rnd.randint(1, 60)
        qpos, kpos = rnd.randint(0, n), rnd.randint(0, n)
        nq, nk = rnd.randint(1, 20), rnd.randint(1, 20)
        causal = rnd.random() < 0.4
        window = (rnd.choice([-1, 0, 1, 3, 10]), rnd.choice([-1, 0, 2, 7]))
        wl, wr = window[0], 0 if causal else window[1]
        want = {(i, j) for i in range(qpos, qpos + nq) for j in range(kpos, kpos + nk)
                if (wl < 0 or j >= i - wl) and (wr < 0 or j <= i + wr)}
        pc = fd._piece(qpos, nq, kpos, nk, causal, window)
        got = set()
        if pc is not None:
            a, b, c, e, pl, pr = pc
            assert pl >= -1 and pr >= -1
            for i in range(b - a):
                lo, hi = _mask_range(False, pl, pr, i, b - a, e - c)
                got |= {(a + i, c + j) for j in range(lo, hi)}
        assert got == want, (qpos, nq, kpos, nk, causal, window, pc)


# ---------------------------------------------------------------- torch part

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = [
    # B, S, T, H, KV, D, causal, window, joint, layout
    (1, 113, 0, 4, 4, 32, False, (-1, -1), "front", "contiguous"),
    (2, 239, 0, 4, 2, 40, True, (-1, -1), "front", "zigzag"),
    (1, 200, 0, 4, 1, 32, True, (-1, -1), "front", "contiguous"),
    (1, 150, 0, 4, 4, 32, False, (17, 5), "front", "zigzag"),
    (1, 101, 19, 4, 4, 32, False, (-1, -1), "front", "contiguous"),
    (1, 90, 13, 4, 2, 32, False, (-1, -1), "rear", "zigzag"),
]


PACKED = [
    # sequence lengths, H, KV, D, causal, window, layout
    ([13, 0, 1, 60, 31], 4, 2, 32, True, (-1, -1), "zigzag"),
    ([40, 7, 0], 4, 4, 16, False, (9, 3), "contiguous"),
    ([2, 90, 3], 4, 1, 32, False, (-1, -1), "zigzag"),
]


def _packed_cases(rank, world, failures):
    import torch
    import torch.distributed as dist
    for (lens, H, KV, D, causal, window, layout) in PACKED:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        S = cu[-1]
        g = torch.Generator().manual_seed(S)
        q = torch.randn(S, H, D, generator=g)
        k = torch.randn(S, KV, D, generator=g)
        v = torch.randn(S, KV, D, generator=g)
        cut = torch.tensor(cu, dtype=torch.int32)
        ref, ref_lse = fmha.varlen_attention(q, k, v, cut, cut, max(lens), max(lens),
                                             causal=causal, window=window, return_lse=True)
        for u in [d for d in range(1, world + 1) if world % d == 0]:
            if H % u or (KV % u and u % KV):
                continue
            ug, rg = fd.new_groups(u, world // u)
            idx = fd.shard_indices(S, u, world // u, rank, layout, cu_seqlens=cu)
            out, lse = fd.usp_attention(q[idx], k[idx], v[idx], seqlen=S, ulysses_group=ug,
                                        ring_group=rg, causal=causal, window=window,
                                        layout=layout, cu_seqlens=cut, return_lse=True)
            err = (out - ref[idx]).abs().max().item() if idx else 0.0
            lerr = (lse - ref_lse[:, idx]).abs().max().item() if idx else 0.0
            if out.shape != (len(idx), H, D) or lse.shape != (H, len(idx)) or \
                    not err < 1e-4 or not lerr < 1e-4:
                failures.append("rank %d u=%d packed %r: shapes %s %s, error %g, lse %g" % (
                    rank, u, (lens, H, KV, D, causal, window, layout), tuple(out.shape),
                    tuple(lse.shape), err, lerr))
    dist.barrier()


def _worker(rank, world, port, failures):
    import torch
    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for (B, S, T, H, KV, D, causal, window, joint, layout) in CASES:
            g = torch.Generator().manual_seed(S)
            n = S + T
            q = torch.randn(B, n, H, D, generator=g)
            k = torch.randn(B, n, KV, D, generator=g)
            v = torch.randn(B, n, KV, D, generator=g)
            ref = fmha.attention(q, k, v, causal=causal, window=window)
            img = list(range(T, T + S)) if joint == "front" else list(range(S))
            txt = list(range(T)) if joint == "front" else list(range(S, S + T))
            for u in [d for d in range(1, world + 1) if world % d == 0]:
                if H % u or (KV % u and u % KV):
                    continue
                ug, rg = fd.new_groups(u, world // u)
                idx = [img[i] for i in fd.shard_indices(S, u, world // u, rank, layout)]
                kw = dict(seqlen=S, ulysses_group=ug, ring_group=rg, causal=causal,
                          window=window, layout=layout)
                if T:
                    kw.update(joint_q=q[:, txt], joint_k=k[:, txt], joint_v=v[:, txt],
                              joint=joint)
                res = fd.usp_attention(q[:, idx], k[:, idx], v[:, idx], **kw)
                out, jout = res if T else (res, None)
                err = (out - ref[:, idx]).abs().max().item()
                if T:
                    err = max(err, (jout - ref[:, txt]).abs().max().item())
                if not err < 1e-4:
                    failures.append("rank %d u=%d case %r: error %g" % (
                        rank, u, (B, S, T, H, KV, D, causal, window, joint, layout), err))
        _packed_cases(rank, world, failures)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_modes_on_gloo(world):
    torch = pytest.importorskip("torch")
    import torch.multiprocessing as mp
    with mp.Manager() as m:
        failures = m.list()
        mp.spawn(_worker, args=(world, _free_port(), failures), nprocs=world, join=True)
        assert not list(failures), "\n".join(failures)
    del torch


def _nccl_worker(rank, world, port, failures):
    import torch
    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        ug, rg = fd.new_groups(1, 1)
        for (B, S, T, H, KV, D, causal, window, joint, layout) in CASES:
            g = torch.Generator().manual_seed(S)
            n = S + T
            q, k, v = (torch.randn(B, n, h, D, generator=g).to("cuda", torch.bfloat16)
                       for h in (H, KV, KV))
            ref = fmha.attention(q, k, v, causal=causal, window=window).float()
            img = list(range(T, T + S)) if joint == "front" else list(range(S))
            txt = list(range(T)) if joint == "front" else list(range(S, S + T))
            kw = dict(seqlen=S, ulysses_group=ug, ring_group=rg, causal=causal, window=window,
                      layout=layout)
            if T:
                kw.update(joint_q=q[:, txt], joint_k=k[:, txt], joint_v=v[:, txt], joint=joint)
            res = fd.usp_attention(q[:, img], k[:, img], v[:, img], **kw)
            out, jout = res if T else (res, None)
            err = (out.float() - ref[:, img]).abs().max().item()
            if T:
                err = max(err, (jout.float() - ref[:, txt]).abs().max().item())
            if not err < 2e-2:  # bf16 pieces merged in f32 against one bf16 call
                failures.append("nccl case %r: error %g" % (
                    (B, S, T, H, KV, D, causal, window, joint, layout), err))
    finally:
        dist.destroy_process_group()


def test_nccl_world_of_one():
    """On one GPU: NCCL process groups of one rank, every mode degenerate."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("no CUDA device or no NCCL in torch")
    import torch.multiprocessing as mp
    with mp.Manager() as m:
        failures = m.list()
        mp.spawn(_nccl_worker, args=(1, _free_port(), failures), nprocs=1, join=True)
        assert not list(failures), "\n".join(failures)


def test_packed_joint_tokens_are_refused():
    torch = pytest.importorskip("torch")
    x = torch.zeros(4, 1, 8)
    with pytest.raises(NotImplementedError, match="joint tokens with packed sequences"):
        fd.usp_attention(x, x, x, seqlen=4, cu_seqlens=[0, 4], joint_q=x[None], joint_k=x[None],
                         joint_v=x[None])
    with pytest.raises(ValueError, match=r"q.seqlen \(3\) differs from the 4 tokens rank 0 holds "
                                         r"of 2 packed sequences"):
        fd.usp_attention(x[:3], x[:3], x[:3], seqlen=4, cu_seqlens=[0, 1, 4])


def test_dropout_is_refused_without_torch_work():
    with pytest.raises(NotImplementedError, match="dropout over torch.distributed"):
        fd.usp_attention(np.zeros((1, 1, 1, 8), np.float32), None, None, seqlen=1,
                         dropout_p=0.1)
