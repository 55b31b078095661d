"""bench_decode_cuda.py — fmha's CUDA decode (fmha.Attention.decode on torch CUDA tensors) on
decode shapes, as achieved bandwidth: bytes of K and V read (plus q and out) per second, beside
the device's copy bandwidth measured in the same run (a torch copy of 4 GiB: bytes read plus
bytes written per second) and torch SDPA (its default choice, GQA by enable_gqa) on the same
caches, in one process.

Each cache is one tensor in torch's [B, Hkv, S, D] layout; fmha reads it through a
[B, S, Hkv, D] view (the same bytes), and its paged runs read a pool of 16-token pages in a
shuffled order through a block table. A page holds its tokens' rows of every KV head
([pages, page, Hkv, D], vLLM's and FlashAttention's layout: a head's rows of a page are 256-byte
pieces 2 KB apart at d 128), or with --page-layout hnd each head's rows together ([pages, Hkv, page,
D], passed as a strided [pages, page, Hkv, D] view); `both` times each paged shape both ways. Every cache is full (cache_seqlens = S).

Times: `kernel`, the device time of fmha's kernels per call (torch.profiler, CUPTI); `call`,
per call from CUDA events over back-to-back calls, which includes the synchronous copy of
cache_seqlens and the block table that validation reads on the host, and the same with
max_seqlen_k given (no host copy: the kernels check the arrays); SDPA from CUDA events.
Bandwidth and "of copy" use the kernel time. fmha's output is checked against SDPA's (largest
absolute difference printed).

    python3 bench/bench_decode_cuda.py [--lib build/libfmha.so] [--quick] [--page-layout nhd|hnd|both]
                                       [--out FILE.md]
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_md  # noqa: E402

HEADINGS = {"decode-cuda": "Decode on the GPU (KV caches, bf16)",
            "decode-cuda-fp8": "Decode on the GPU, FP8 KV caches against bf16"}
# shapes whose caches exceed these are left out (80 GB cards; a paged run holds the caches twice)
KV_BYTES_MAX, PAGED_KV_BYTES_MAX = 36 << 30, 16 << 30
KERNELS = ("decode_kernel", "merge_splits")


def copy_bandwidth():
    """Bytes read plus written per second of a 4 GiB device copy, the best of five."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = max(best, 2 * src.numel() / (a.elapsed_time(b) * 1e-3))
    del src, dst
    return best


def event_ms(fn, iters):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def kernel_us(fn, iters):
    """Device time per call of fmha's decode kernels (and the split merge)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if any(k in e.key for k in KERNELS):
            total += getattr(e, "self_device_time_total", None) or e.self_cuda_time_total
    return total / iters


def run(fmha, name, batch, heads, kv_heads, d, cache, page, iters, sweep=None, hnd=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=bf, generator=g)
    k = torch.randn(batch, kv_heads, cache, d, device="cuda", dtype=bf, generator=g)
    v = torch.randn(batch, kv_heads, cache, d, device="cuda", dtype=bf, generator=g)
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    layer = fmha.Attention(heads, d, num_kv_heads=kv_heads)
    if page:
        table = torch.randperm(batch * cache // page, device="cuda",
                               generator=g).to(torch.int32).reshape(batch, cache // page)
        # token t of sequence b sits in page table[b, t // page], slot t % page
        kc, vc = paged_pool(k, table, page, hnd), paged_pool(v, table, page, hnd)
    else:
        table = None
        kc, vc = k.transpose(1, 2), v.transpose(1, 2)
    out = torch.empty(batch, 1, heads, d, device="cuda", dtype=bf)

    def fmha_call(splits=0, bound=None):
        layer.decode(q, kc, vc, cache_seqlens=lens, block_table=table, out=out, num_splits=splits,
                     max_seqlen_k=bound)

    if sweep:  # fmha's kernel time for each (environment setting, num_splits) of the sweep
        times = []
        for env in sweep[0]:
            var, _, val = env.partition("=")
            if var:
                os.environ[var] = val
            layer = fmha.Attention(heads, d, num_kv_heads=kv_heads)  # knobs are read at init
            times.append([kernel_us(lambda: fmha_call(n), iters) for n in sweep[1]])
            if var:
                del os.environ[var]
        del k, v, kc, vc, q, out
        return times

    qt = q.transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(qt, k, v, enable_gqa=kv_heads != heads)

    fmha_call()
    ref = sdpa().transpose(1, 2)
    diff = (out.float() - ref.float()).abs().max().item()
    kus = kernel_us(fmha_call, iters)
    call_ms = event_ms(fmha_call, iters)
    bound_ms = event_ms(lambda: fmha_call(bound=cache), iters)
    sdpa_ms = event_ms(sdpa, iters)
    nbytes = 2 * batch * cache * kv_heads * d * 2 + 2 * batch * heads * d * 2
    del k, v, kc, vc, q, out
    return kus, call_ms, bound_ms, sdpa_ms, nbytes, diff


def paged_pool(x, table, page, hnd=False):
    """[B, Hkv, S, D] caches as a pool of pages in table's order, viewed as
    [pages, page, Hkv, D]: each page's rows of every head together, or with
    hnd each head's rows of a page together (a strided view). Copied as
    bytes so that FP8 tensors copy too."""
    B, Hkv, S, D = x.shape
    pages = table.numel()
    if hnd:
        flat = x.reshape(B, Hkv, S // page, page, D).permute(0, 2, 1, 3, 4).reshape(
            pages, Hkv, page, D)
    else:
        flat = x.transpose(1, 2).reshape(pages, page, Hkv, D)
    u = flat.view(torch.uint8) if x.element_size() == 1 else flat.view(torch.int16)
    pool = torch.empty_like(u)
    pool[table.reshape(-1).long()] = u
    pool = pool.view(x.dtype)
    return pool.transpose(1, 2) if hnd else pool


def rel_l2_f64(out, q, k, v, batches):
    """Relative L2 of out against float64 attention over k, v, on the first
    `batches` sequences."""
    num = den = 0.0
    g = q.shape[2] // k.shape[1]
    for b in range(batches):
        qb = q[b].double().transpose(0, 1)                    # [H, 1, D]
        kb = k[b].double().repeat_interleave(g, dim=0)        # [H, S, D]
        vb = v[b].double().repeat_interleave(g, dim=0)
        w = torch.softmax(qb @ kb.transpose(1, 2) / qb.shape[-1] ** 0.5, dim=-1)
        want = (w @ vb).transpose(0, 1)                        # [1, H, D]
        num += (out[b].double() - want).pow(2).sum().item()
        den += want.pow(2).sum().item()
    return (num / den) ** 0.5


def run_fp8(fmha, name, batch, heads, kv_heads, d, cache, page, iters):
    """fmha's decode on the same caches in bf16 and as FP8 (e4m3, one
    descale per KV head from its largest magnitude): kernel times, and each
    output's error against float64 attention over the bf16 caches."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=bf, generator=g)
    k = torch.randn(batch, kv_heads, cache, d, device="cuda", dtype=bf, generator=g)
    v = torch.randn(batch, kv_heads, cache, d, device="cuda", dtype=bf, generator=g)
    kd = (k.float().abs().amax(dim=(0, 2, 3)) / 448).clamp(min=1e-12)
    vd = (v.float().abs().amax(dim=(0, 2, 3)) / 448).clamp(min=1e-12)
    k8 = (k.float() / kd[None, :, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (v.float() / vd[None, :, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    layer = fmha.Attention(heads, d, num_kv_heads=kv_heads)
    table = None
    if page:
        table = torch.randperm(batch * cache // page, device="cuda",
                               generator=g).to(torch.int32).reshape(batch, cache // page)
        caches = (paged_pool(k, table, page), paged_pool(v, table, page),
                  paged_pool(k8, table, page), paged_pool(v8, table, page))
    else:
        caches = (k.transpose(1, 2), v.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2))
    out16 = torch.empty(batch, 1, heads, d, device="cuda", dtype=bf)
    out8 = torch.empty_like(out16)

    def bf16_call():
        layer.decode(q, caches[0], caches[1], cache_seqlens=lens, block_table=table, out=out16)

    def fp8_call():
        layer.decode(q, caches[2], caches[3], cache_seqlens=lens, block_table=table, out=out8,
                     k_descale=kd, v_descale=vd)

    us16, us8 = kernel_us(bf16_call, iters), kernel_us(fp8_call, iters)
    nb = min(batch, 4)
    err16 = rel_l2_f64(out16, q, k, v, nb)
    err8 = rel_l2_f64(out8, q, k, v, nb)
    bytes8 = 2 * batch * cache * kv_heads * d + 2 * batch * heads * d * 2
    return us16, us8, bytes8, err16, err8


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="libfmha.so to load (default: the package's)")
    ap.add_argument("--quick", action="store_true", help="a few shapes")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", metavar="SPLITS",
                    help="tuning: fmha's kernel time alone for each num_splits in the comma list "
                         "(0: the plan's choice), under each --sweep-env setting")
    ap.add_argument("--sweep-env", default="", metavar="VAR=V,...",
                    help="with --sweep: environment settings to time under, ';'-separated "
                         "('' : as set)")
    ap.add_argument("--page-layout", choices=("nhd", "hnd", "both"), default="nhd",
                    help="the page pool: a page's rows of every head together (nhd, the default), "
                         "each head's rows of a page together (hnd), or each paged shape both ways")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 caches against bf16 on the same shapes (speed and accuracy)")
    results_md.add_arguments(ap, HEADINGS)
    opt = ap.parse_args()
    if opt.lib:
        os.environ["FMHA_LIBRARY"] = os.path.abspath(opt.lib)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import fmha
    copy = copy_bandwidth()
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"copy {copy / 1e12:.2f} TB/s")
    shapes = []
    if opt.quick:
        shapes = [("llama3-8b", 16, 32, 8, 128, 8192, 0), ("llama3-8b", 16, 32, 8, 128, 8192, 16),
                  ("llama3-8b", 1, 32, 8, 128, 131072, 0), ("llama3-8b", 1, 32, 8, 128, 131072, 16),
                  ("llama3-8b", 64, 32, 8, 128, 8192, 16)]
    else:
        for cache in (1024, 8192, 32768, 131072):
            for batch in (1, 16, 64, 256):
                for page in (0, 16):
                    shapes.append(("llama3-8b", batch, 32, 8, 128, cache, page))
    shapes += [("mqa", 16, 32, 1, 128, 8192, 0), ("hd64", 16, 32, 8, 64, 8192, 0),
               ("hd256", 16, 16, 4, 256, 8192, 0)]
    if opt.sweep:
        splits = [int(x) for x in opt.sweep.split(",")]
        envs = opt.sweep_env.split(";")
        print("# kernel µs; columns: num_splits " + " ".join(map(str, splits)) + "; rows: " +
              " | ".join(e or "(as set)" for e in envs))
        for name, b, h, hk, d, cache, page in shapes:
            if 2 * b * cache * hk * d * 2 > (PAGED_KV_BYTES_MAX if page else KV_BYTES_MAX):
                continue
            for env, times in zip(envs, run(fmha, name, b, h, hk, d, cache, page, opt.iters,
                                             (envs, splits))):
                print(f"{name} b{b} {h}/{hk} d{d} {cache} p{page or '-'} {env or '-'}: " +
                      " ".join(f"{x:.1f}" for x in times), flush=True)
        return
    if opt.fp8:
        rows = []
        for name, b, h, hk, d, cache, page in shapes:
            if 3 * b * cache * hk * d * 2 > (PAGED_KV_BYTES_MAX if page else KV_BYTES_MAX):
                continue
            us16, us8, nb8, e16, e8 = run_fp8(fmha, name, b, h, hk, d, cache, page, opt.iters)
            row = [name, str(b), f"{h}/{hk}", str(d), str(cache), str(page or "-"), f"{us16:.1f}",
                   f"{us8:.1f}", f"{us16 / us8:.2f}", f"{nb8 / (us8 * 1e-6) / 1e12:.2f}",
                   f"{100 * nb8 / (us8 * 1e-6) / copy:.0f}%", f"{e16:.2e}", f"{e8:.2e}"]
            print(" ".join(row), flush=True)
            rows.append(row)
        body = results_md.table(["shape", "batch", "heads", "d", "cache", "page", "bf16 µs",
                                 "fp8 µs", "bf16 / fp8", "fp8 TB/s", "of copy",
                                 "bf16 rel-L2", "fp8 rel-L2"], rows, "lrlrrrrrrrrrr")
        print(body)
        opt.section = opt.section or "decode-cuda-fp8"
        results_md.write(opt, [("Machine", results_md.gpu_machine(torch)), ("Library", f"`{opt.lib}`"),
                               ("Peers", "fmha's bf16 decode on the same caches, same process; "
                                f"device copy bandwidth {copy / 1e12:.2f} TB/s (same run)")],
                         "fmha decode on bf16 caches and on the same caches as FP8 e4m3 (one "
                         "descale per KV head, amax / 448), kernel times (torch profiler); "
                         "rel-L2 of each output against float64 attention over the bf16 caches "
                         "(first four sequences):\n\n" + body)
        return
    rows = []
    layouts = {"nhd": (False,), "hnd": (True,), "both": (False, True)}[opt.page_layout]
    runs = [(shape, hnd) for shape in shapes for hnd in (layouts if shape[6] else (False,))]
    for (name, b, h, hk, d, cache, page), hnd in runs:
        if 2 * b * cache * hk * d * 2 > (PAGED_KV_BYTES_MAX if page else KV_BYTES_MAX):
            continue
        kus, call_ms, bound_ms, sdpa_ms, nbytes, diff = run(fmha, name, b, h, hk, d, cache, page,
                                                            opt.iters, hnd=hnd)
        bw = nbytes / (kus * 1e-6)
        sdpa_bw = nbytes / (sdpa_ms * 1e-3)
        where = (f"{page} hnd" if hnd else str(page)) if page else "-"
        row = [name, str(b), f"{h}/{hk}", str(d), str(cache), where, f"{kus:.1f}",
               f"{bw / 1e12:.2f}", f"{100 * bw / copy:.0f}%", f"{call_ms * 1e3:.1f}",
               f"{bound_ms * 1e3:.1f}",
               f"{sdpa_ms * 1e3:.1f}", f"{sdpa_bw / 1e12:.2f}", f"{sdpa_ms * 1e3 / kus:.2f}",
               f"{diff:.1e}"]
        print(" ".join(row), flush=True)
        rows.append(row)
    body = results_md.table(["shape", "batch", "heads", "d", "cache", "page", "fmha kernel µs",
                             "TB/s", "of copy", "fmha call µs", "call µs, max_seqlen_k",
                             "SDPA µs", "SDPA TB/s", "SDPA / fmha kernel", "max |fmha − SDPA|"],
                            rows, "lrlrrrrrrrrrrrr")
    print(body)
    results_md.write(opt, [("Machine", results_md.gpu_machine(torch)), ("Library", f"`{opt.lib}`"),
                           ("Peers", "torch SDPA (default backend choice, enable_gqa), same caches, "
                            f"same process; device copy bandwidth {copy / 1e12:.2f} TB/s (read + "
                            "write, same run)")],
                     "bf16 caches, one new query per sequence, every cache full; bandwidth = bytes "
                     "of K, V, q and out over fmha's kernel time:\n\n" + body)


if __name__ == "__main__":
    main()
