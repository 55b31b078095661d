"""fmha.distributed — sequence-parallel attention on torch.distributed
process groups (NCCL on GPUs, gloo on CPUs), with fmha as the local kernel:
the three modes of the C API's fmha_sp_forward (docs/sequence_parallel.md).

    import torch.distributed as dist, fmha.distributed as fd
    dist.init_process_group("nccl")
    ug, rg = fd.new_groups(ulysses=4, ring=2)      # every rank calls it
    idx = fd.shard_indices(S, 4, 2, dist.get_rank(), layout="zigzag")
    out = fd.usp_attention(q[:, idx], k[:, idx], v[:, idx], seqlen=S,
                           ulysses_group=ug, ring_group=rg, layout="zigzag",
                           causal=True)                # this rank's tokens' output

- Ulysses (ulysses_attention): one all_to_all_single turns [B, S/u, H, D]
  (q, k and v together) into [B, S, H/u, D]; attention runs on whole
  sequences of H/u heads; a second one turns the output back.
- Ring (ring_attention): K/V rotate around the group, the next block in
  flight (batch_isend_irecv) while the current one is attended to; partial
  outputs merge by their LSEs in float32.
- Both (usp_attention): rank = ring slot x u + Ulysses member, as
  new_groups makes them.

Tokens: rank p holds the tokens shard_tokens / shard_indices name (the C
library's fmha_sp_tokens): ring slot i holds [i S / r, (i + 1) S / r)
("contiguous") or chunks i and 2r - 1 - i of 2r ("zigzag", which gives every
slot the same work under a causal mask); its u members split those in order.
Masks (causal, window) apply to positions in the whole sequence, the joint
(text) tokens included, which every rank holds whole and which sit in front
of the distributed tokens (joint="front") or after them ("rear").

Packed sequences (cu_seqlens, the whole sequences' offsets, the same on
every rank): q [n, H, D], k, v [n, Hkv, D] as flash_attn_varlen_func takes
them; each sequence is sharded on its own as above and a rank holds its
tokens of every sequence one after another (shard_indices(..., cu_seqlens=)
names them in the packed tensors); masks are each sequence's own; out is
[n, H, Dv] and the LSE [H, n]. Joint tokens with packed sequences are not
supported (give each sequence's text as part of it).

GQA: kv heads must divide by u (each member takes Hkv / u), or u by kv heads
(each KV head goes to the u / Hkv members that use it); else ValueError
naming both numbers, as in C. Dropout is not supported here (the C API keeps
the single-device mask; this module would need the kernel's positions).
"""
import sys

from . import _api

__all__ = ["shard_tokens", "shard_indices", "new_groups", "ulysses_attention", "ring_attention",
           "usp_attention"]


def _torch():
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # noqa: F811 — fmha.distributed needs torch
    return torch


def _cut(n, k, j):
    return n * j // k


def _add(runs, start, length):
    if length <= 0:
        return
    if runs and runs[-1][0] + runs[-1][1] == start:
        runs[-1] = (runs[-1][0], runs[-1][1] + length)
    else:
        runs.append((start, length))


def _slot_tokens(seqlen, ring, slot, layout):
    runs = []
    if layout == "zigzag":
        c = 2 * ring
        for chunk in (slot, c - 1 - slot):
            _add(runs, _cut(seqlen, c, chunk), _cut(seqlen, c, chunk + 1) - _cut(seqlen, c, chunk))
    elif layout == "contiguous":
        _add(runs, _cut(seqlen, ring, slot), _cut(seqlen, ring, slot + 1) - _cut(seqlen, ring, slot))
    else:
        raise ValueError("layout (%r) must be 'contiguous' or 'zigzag'" % (layout,))
    return runs


def _range(runs, p0, p1):
    out, at = [], 0
    for start, length in runs:
        lo, hi = max(p0, at), min(p1, at + length)
        if hi > lo:
            _add(out, start + lo - at, hi - lo)
        at += length
    return out


def _member_runs(seqlen, ring, ulysses, slot, j, layout):
    """Ulysses member j of ring slot `slot`'s tokens of a sequence of seqlen."""
    t = _slot_tokens(seqlen, ring, slot, layout)
    total = sum(n for _, n in t)
    return _range(t, _cut(total, ulysses, j), _cut(total, ulysses, j + 1))


def _offsets(cu_seqlens, seqlen):
    """cu_seqlens (a sequence or tensor of ints, B + 1) as a checked list."""
    cu = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist")
                           else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens (%r) must start at 0 and not decrease: the offsets of "
                         "B >= 1 packed sequences" % (cu[:8],))
    if cu[-1] != seqlen:
        raise ValueError("cu_seqlens[%d] (%d) differs from seqlen (%d): seqlen is the tokens of "
                         "all the packed sequences" % (len(cu) - 1, cu[-1], seqlen))
    return cu


def shard_tokens(seqlen, ulysses, ring, rank, layout="contiguous", cu_seqlens=None):
    """The tokens rank `rank` holds, as [(start, length), ...] runs in the
    order it holds them (fmha_sp_tokens). With cu_seqlens, of each packed
    sequence in turn, as positions in the packed tokens."""
    if ulysses < 1 or ring < 1 or not 0 <= rank < ulysses * ring:
        raise ValueError("rank (%d) must be in [0, %d): ulysses %d x ring %d"
                         % (rank, ulysses * ring, ulysses, ring))
    slot, j = rank // ulysses, rank % ulysses
    if cu_seqlens is None:
        return _member_runs(seqlen, ring, ulysses, slot, j, layout)
    cu, runs = _offsets(cu_seqlens, seqlen), []
    for b in range(len(cu) - 1):
        for start, n in _member_runs(cu[b + 1] - cu[b], ring, ulysses, slot, j, layout):
            _add(runs, cu[b] + start, n)
    return runs


def shard_indices(seqlen, ulysses, ring, rank, layout="contiguous", cu_seqlens=None):
    """shard_tokens as a list of token indices: x[:, shard_indices(...)]
    (packed: x[shard_indices(..., cu_seqlens=cu)])."""
    return [s + i for s, n in shard_tokens(seqlen, ulysses, ring, rank, layout, cu_seqlens)
            for i in range(n)]


def new_groups(ulysses, ring):
    """The Ulysses and ring groups of this rank, for ulysses x ring = the
    world's size: rank p is ring slot p // ulysses, Ulysses member p %
    ulysses (consecutive ranks share a node: put Ulysses there). Every rank
    must call it (torch.distributed.new_group is collective)."""
    dist = _torch().distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    if ulysses * ring != world:
        raise ValueError("ulysses (%d) x ring (%d) = %d ranks, but there are %d"
                         % (ulysses, ring, ulysses * ring, world))
    ug = rg = None
    for s in range(ring):
        g = dist.new_group([s * ulysses + j for j in range(ulysses)])
        if rank // ulysses == s:
            ug = g
    for j in range(ulysses):
        g = dist.new_group([s * ulysses + j for s in range(ring)])
        if rank % ulysses == j:
            rg = g
    return ug, rg


def _piece(qpos, nq, kpos, nk, causal, window):
    """Rows [a, b) and keys [c, e) (sequence positions) of a block that see
    each other under the whole sequence's mask, and the bottom-right-aligned
    window that gives the piece that mask; None if nothing is visible."""
    wl, wr = window
    if causal:
        wr = 0
    a, b, c, e = qpos, qpos + nq, kpos, kpos + nk
    if wr >= 0:
        e = min(e, b + wr)
        a = max(a, c - wr)
    if wl >= 0:
        b = min(b, e + wl)
        c = max(c, a - wl)
    if e <= c or b <= a:
        return None
    return a, b, c, e, (-1 if wl < 0 else wl + (e - b)), (-1 if wr < 0 else wr - (e - b))


class _Run:
    """One call: the shapes, the groups and the running results."""

    def __init__(self, q, k, v, seqlen, ug, rg, opts, cu):
        torch = _torch()
        dist = torch.distributed
        self.torch, self.dist, self.opts = torch, dist, opts
        self.ug, self.rg = ug, rg
        self.u = dist.get_world_size(ug) if ug is not None else 1
        self.r = dist.get_world_size(rg) if rg is not None else 1
        self.member = dist.get_rank(ug) if ug is not None else 0
        self.slot = dist.get_rank(rg) if rg is not None else 0
        B, n, H, D = q.shape
        KV = k.shape[2]
        u = self.u
        if H % u:
            raise ValueError("num_heads (%d) is not divisible by ulysses (%d): each Ulysses rank "
                             "takes num_heads / ulysses query heads" % (H, u))
        if KV % u and u % KV:
            raise ValueError("num_kv_heads (%d) and ulysses (%d): neither divides the other, so "
                             "the KV heads can be neither split nor replicated" % (KV, u))
        self.seqlen, self.cu = seqlen, cu
        rank = self.slot * u + self.member
        want = self.member_count(self.slot, self.member)
        if n != want or k.shape[1] != n or v.shape[1] != n:
            of = ("a sequence of %d" % seqlen if cu is None else
                  "%d packed sequences" % (len(cu) - 1))
            raise ValueError("q.seqlen (%d) differs from the %d tokens rank %d holds of %s "
                             "(shard_tokens)" % (n, want, rank, of))
        self.B, self.H, self.KV, self.D, self.Dv = B, H, KV, D, v.shape[3]
        self.Hl = H // u
        self.KVl = KV // u if KV % u == 0 else 1
        self.n = n

    def sequences(self, img0):
        """(sequence, tokens, position of its token 0) of every sequence: one
        (-1, seqlen, img0) for a padded batch."""
        if self.cu is None:
            return [(-1, self.seqlen, img0)]
        return [(b, self.cu[b + 1] - self.cu[b], 0) for b in range(len(self.cu) - 1)]

    def member_count(self, slot, j):
        """How many tokens Ulysses member j of ring slot `slot` holds."""
        return sum(m for _, s, _ in self.sequences(0)
                   for _, m in _member_runs(s, self.r, self.u, slot, j, self.opts["layout"]))

    def kv_head0(self, j):
        if self.KV % self.u == 0:
            return j * self.KVl
        return j * self.Hl // (self.H // self.KV)

    def runs(self, slot, img0):
        """(local row, sequence, position, length) of a slot's tokens, listed
        sequence by sequence. Its buffers hold them member by member (one
        all-to-all block each), each member's sequence by sequence."""
        at, j0 = [], 0
        for j in range(self.u):
            at.append(j0)
            j0 += self.member_count(slot, j)
        out = []
        for b, s, pos0 in self.sequences(img0):
            for j in range(self.u):
                for start, m in _member_runs(s, self.r, self.u, slot, j, self.opts["layout"]):
                    x = (at[j], b, pos0 + start, m)
                    at[j] += m
                    if out and out[-1][1] == b and out[-1][0] + out[-1][3] == x[0] and \
                            out[-1][2] + out[-1][3] == x[2]:
                        x = (out[-1][0], b, out[-1][2], out[-1][3] + m)  # one run
                        out.pop()
                    out.append(x)
        return out

    def attend(self, q, qruns, acc, acc_lse, k, v, kruns):
        """acc [B, L, Hl, Dv] f32, acc_lse [B, Hl, L]: merged with the pieces
        of q's rows against k, v's keys of the same sequence."""
        torch, o = self.torch, self.opts
        for qr, qseq, qp, qn in qruns:
            for kr, kseq, kp, kn in kruns:
                if kseq != qseq:
                    continue
                pc = _piece(qp, qn, kp, kn, o["causal"], o["window"])
                if pc is None:
                    continue
                a, b, c, e, wl, wr = pc
                r0, r1 = qr + a - qp, qr + b - qp
                k0, k1 = kr + c - kp, kr + e - kp
                tmp = torch.empty((self.B, r1 - r0, self.Hl, self.Dv), dtype=torch.float32,
                                  device=q.device)
                _, lse = _api.attention(q[:, r0:r1], k[:, k0:k1], v[:, k0:k1], causal=False,
                                        softmax_scale=o["softmax_scale"], window=(wl, wr),
                                        softcap=o["softcap"], return_lse=True, out=tmp)
                _merge_into(torch, acc[:, r0:r1], acc_lse[:, :, r0:r1], tmp, lse)


def _merge_into(torch, acc, acc_lse, part, part_lse):
    """acc, acc_lse (views, updated in place) merged with part, part_lse by
    their LSEs in float32: -inf (no key) weighs 0, all -inf gives 0, -inf."""
    lse = torch.logaddexp(acc_lse, part_lse)
    none = torch.isneginf(lse)
    safe = torch.where(none, torch.zeros_like(lse), lse)
    w1 = torch.where(torch.isneginf(acc_lse), torch.zeros_like(lse), torch.exp(acc_lse - safe))
    w2 = torch.where(torch.isneginf(part_lse), torch.zeros_like(lse), torch.exp(part_lse - safe))
    w1 = w1.transpose(1, 2).unsqueeze(-1)
    w2 = w2.transpose(1, 2).unsqueeze(-1)
    # A part without keys holds zeros (fmha's answer), so 0 * it is 0; NaN
    # LSEs and elements spread as in the C merge.
    acc.copy_(w1 * acc + w2 * part)
    acc_lse.copy_(lse)


def _flat(x):
    """[B, n, h, d] -> token-major flat ([n, B, h, d] contiguous, 1-d)."""
    return x.permute(1, 0, 2, 3).reshape(-1)


def _unflat(flat, n, B, h, d):
    """Token-major flat -> [B, n, h, d] (a view)."""
    return flat.view(n, B, h, d).permute(1, 0, 2, 3)


def _usp(q, k, v, seqlen, ug, rg, opts, joint, cu):
    R = _Run(q, k, v, seqlen, ug, rg, opts, cu)
    torch, dist = R.torch, R.dist
    B, Hl, KVl, D, Dv, u, r = R.B, R.Hl, R.KVl, R.D, R.Dv, R.u, R.r
    jq, jk, jv = joint["q"], joint["k"], joint["v"]
    T = 0 if jq is None else jq.shape[1]
    img0 = T if joint["where"] == "front" else 0
    text0 = seqlen if joint["where"] == "rear" else 0
    mine = R.runs(R.slot, img0)
    L = sum(m for _, _, _, m in mine)
    offs = [0]
    for j in range(u):
        offs.append(offs[-1] + R.member_count(R.slot, j))

    # Ulysses in: q, k, v of every member's heads, in one all_to_all_single.
    if u > 1:
        per = (Hl * D + KVl * D + KVl * Dv) * B
        send = torch.cat([torch.cat((_flat(q[:, :, j * Hl:(j + 1) * Hl]),
                                     _flat(k[:, :, R.kv_head0(j):R.kv_head0(j) + KVl]),
                                     _flat(v[:, :, R.kv_head0(j):R.kv_head0(j) + KVl])))
                          for j in range(u)])
        lens = [offs[j + 1] - offs[j] for j in range(u)]
        recv = torch.empty(L * per, dtype=q.dtype, device=q.device)
        dist.all_to_all_single(recv, send, [m * per for m in lens], [R.n * per] * u, group=ug)
        qs, ks, vs, at = [], [], [], 0
        for m in lens:
            for parts, width, hh in ((qs, D, Hl), (ks, D, KVl), (vs, Dv, KVl)):
                parts.append(recv[at:at + m * B * hh * width].view(m, B, hh, width))
                at += m * B * hh * width
        Q = torch.cat(qs).permute(1, 0, 2, 3)
        K = torch.cat(ks).permute(1, 0, 2, 3).contiguous()
        V = torch.cat(vs).permute(1, 0, 2, 3).contiguous()
    else:
        Q, K, V = q, k.contiguous(), v.contiguous()

    acc = torch.zeros((B, L, Hl, Dv), dtype=torch.float32, device=q.device)
    acc_lse = torch.full((B, Hl, L), float("-inf"), dtype=torch.float32, device=q.device)
    if T:
        kv0 = R.kv_head0(R.member)
        tq = jq[:, :, R.member * Hl:(R.member + 1) * Hl]
        tk, tv = jk[:, :, kv0:kv0 + KVl], jv[:, :, kv0:kv0 + KVl]
        text = [(0, -1, text0, T)]
        tacc = torch.zeros((B, T, Hl, Dv), dtype=torch.float32, device=q.device)
        tacc_lse = torch.full((B, Hl, T), float("-inf"), dtype=torch.float32, device=q.device)

    # Ring: the keys of slot (slot - t) here while the previous slot's travel.
    if r > 1:
        g = dist.get_global_rank if hasattr(dist, "get_global_rank") else \
            dist.distributed_c10d._get_global_rank
        nxt, prv = g(rg, (R.slot + 1) % r), g(rg, (R.slot - 1) % r)
    for t in range(r):
        src = (R.slot - t) % r
        keys = R.runs(src, img0)
        reqs = []
        if t < r - 1:
            m = sum(R.member_count((src - 1) % r, j) for j in range(u))
            K2 = torch.empty((B, m, KVl, D), dtype=K.dtype, device=K.device)
            V2 = torch.empty((B, m, KVl, Dv), dtype=V.dtype, device=V.device)
            ops = [dist.P2POp(dist.isend, K, nxt, group=rg), dist.P2POp(dist.isend, V, nxt, group=rg),
                   dist.P2POp(dist.irecv, K2, prv, group=rg),
                   dist.P2POp(dist.irecv, V2, prv, group=rg)]
            reqs = dist.batch_isend_irecv(ops)
        R.attend(Q, mine, acc, acc_lse, K, V, keys)
        if T and t == 0:
            R.attend(Q, mine, acc, acc_lse, tk, tv, text)
            R.attend(tq, text, tacc, tacc_lse, K, V, keys)
            if R.slot == 0:
                R.attend(tq, text, tacc, tacc_lse, tk, tv, text)
        for req in reqs:
            req.wait()
        if reqs:
            K, V = K2, V2

    # Ulysses out: the slot's rows of H / u heads back to their owners.
    out_dtype = q.dtype
    if u > 1:
        obuf = acc.to(out_dtype)
        send = torch.cat([_flat(obuf[:, offs[j]:offs[j + 1]]) for j in range(u)])
        recv = torch.empty(R.n * B * Hl * Dv * u, dtype=out_dtype, device=q.device)
        dist.all_to_all_single(recv, send, [R.n * B * Hl * Dv] * u,
                               [(offs[j + 1] - offs[j]) * B * Hl * Dv for j in range(u)], group=ug)
        out = torch.cat([_unflat(c, R.n, B, Hl, Dv) for c in recv.chunk(u)], dim=2)
        lsend = torch.cat([acc_lse[:, :, offs[j]:offs[j + 1]].reshape(-1) for j in range(u)])
        lrecv = torch.empty(R.n * B * Hl * u, dtype=torch.float32, device=q.device)
        dist.all_to_all_single(lrecv, lsend, [R.n * B * Hl] * u,
                               [(offs[j + 1] - offs[j]) * B * Hl for j in range(u)], group=ug)
        lse = torch.cat([c.view(B, Hl, R.n) for c in lrecv.chunk(u)], dim=1)
    else:
        out, lse = acc.to(out_dtype), acc_lse

    if not T:
        return out, lse, None, None
    # Joint tokens: the ring slots' partials merged, then the heads gathered.
    if r > 1:
        outs = [torch.empty_like(tacc) for _ in range(r)]
        lses = [torch.empty_like(tacc_lse) for _ in range(r)]
        dist.all_gather(outs, tacc.contiguous(), group=rg)
        dist.all_gather(lses, tacc_lse.contiguous(), group=rg)
        tacc, tacc_lse = outs[0].clone(), lses[0].clone()
        for i in range(1, r):
            _merge_into(torch, tacc, tacc_lse, outs[i], lses[i])
    if u > 1:
        outs = [torch.empty_like(tacc) for _ in range(u)]
        lses = [torch.empty_like(tacc_lse) for _ in range(u)]
        dist.all_gather(outs, tacc.contiguous(), group=ug)
        dist.all_gather(lses, tacc_lse.contiguous(), group=ug)
        tacc, tacc_lse = torch.cat(outs, dim=2), torch.cat(lses, dim=1)
    return out, lse, tacc.to(out_dtype), tacc_lse


def usp_attention(q, k, v, *, seqlen, ulysses_group=None, ring_group=None, causal=False,
                  softmax_scale=None, window=(-1, -1), softcap=0.0, dropout_p=0.0,
                  layout="contiguous", joint_q=None, joint_k=None, joint_v=None,
                  joint="front", return_lse=False, cu_seqlens=None):
    """Attention over a sequence of `seqlen` tokens spread over ulysses_group
    x ring_group (either None: degree 1). q [B, n, H, D], k, v [B, n, Hkv,
    D] hold this rank's n tokens (shard_indices); joint_q/k/v [B, T, H(kv),
    D], the same on every rank, are text tokens joined in front of or after
    the sequence. Returns out [B, n, H, Dv] in q's dtype; with joint tokens
    (out, joint_out [B, T, H, Dv]); with return_lse the LSEs ([B, H, n] and
    [B, H, T], float32) follow each output.

    cu_seqlens (B + 1 offsets of packed sequences, seqlen in all): q [n, H,
    D], k, v [n, Hkv, D] hold this rank's tokens of every sequence
    (shard_indices(..., cu_seqlens=)); out is [n, H, Dv], the LSE [H, n]."""
    if dropout_p:
        raise NotImplementedError("dropout over torch.distributed is not supported: the C API "
                                  "(fmha_sp_forward) keeps the single-device mask")
    if joint not in ("front", "rear"):
        raise ValueError("joint (%r) must be 'front' or 'rear'" % (joint,))
    if (joint_q is None) != (joint_k is None) or (joint_q is None) != (joint_v is None):
        raise ValueError("joint_q, joint_k and joint_v go together")
    opts = {"causal": bool(causal), "softmax_scale": softmax_scale, "window": tuple(window),
            "softcap": softcap, "layout": layout}
    cu = None
    if cu_seqlens is not None:
        cu = _offsets(cu_seqlens, seqlen)
        if joint_q is not None:
            raise NotImplementedError("joint tokens with packed sequences (cu_seqlens) are not "
                                      "supported: give each sequence's text as part of it")
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError("with cu_seqlens, q, k and v are packed [tokens, heads, head_dim] "
                             "(got %d, %d and %d dims)" % (q.dim(), k.dim(), v.dim()))
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    out, lse, jout, jlse = _usp(q, k, v, seqlen, ulysses_group, ring_group, opts,
                                {"q": joint_q, "k": joint_k, "v": joint_v, "where": joint}, cu)
    if cu is not None:
        out, lse = out[0], lse[0]
    res = (out, lse) if return_lse else (out,)
    if joint_q is not None:
        res += (jout, jlse) if return_lse else (jout,)
    return res[0] if len(res) == 1 else res


def ulysses_attention(q, k, v, *, seqlen, group=None, **kw):
    """usp_attention with Ulysses alone over `group`."""
    return usp_attention(q, k, v, seqlen=seqlen, ulysses_group=group, **kw)


def ring_attention(q, k, v, *, seqlen, group=None, **kw):
    """usp_attention with the ring alone over `group`."""
    return usp_attention(q, k, v, seqlen=seqlen, ring_group=group, **kw)
