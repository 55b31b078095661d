"""bench_call_overhead.py — the host time of one fmha call from Python on a
tiny shape, where the kernel's work is negligible, beside torch SDPA's on
the same tensors in the same process: fmha.attention and flash_attn_func
on the compiled path (fmha.torch_ext, built here when --ext is given)
and on the Python path (fmha.attention also with its repeat table
emptied before each call, as a first call runs), Attention.forward (a kept
layer), inputs that require grad (what autograd records: the compiled
path's autograd Function, or the fmha::fwd op), a packed varlen call, and
numpy arrays. Median of --repeat rounds of --calls calls.

    python3 bench/bench_call_overhead.py [--lib build/libfmha.so] [--device cpu|cuda] [--ext]
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results_md  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default="build/libfmha.so")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--shape", default="1,16,2,32", help="B,S,H,D")
    ap.add_argument("--ext", action="store_true",
                    help="build fmha.torch_ext (about 30 s the first time) and time it too")
    results_md.add_arguments(ap, {"call-overhead": "Per-call host time from Python"})
    opt = ap.parse_args()
    os.environ["FMHA_LIBRARY"] = os.path.abspath(opt.lib)
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import torch
    import torch.nn.functional as F
    import fmha

    B, S, H, D = (int(x) for x in opt.shape.split(","))
    dt = torch.float32 if opt.device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(opt.device, dt) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=opt.device)
    qp, kp, vp = (x.reshape(B * S, H, D) for x in (q, k, v))
    layer = fmha.Attention(H, D)
    sync = torch.cuda.synchronize if opt.device == "cuda" else (lambda: None)

    def us(fn):
        for _ in range(50):
            fn()
        sync()
        rounds = []
        for _ in range(opt.repeat):
            t0 = time.perf_counter()
            for _ in range(opt.calls):
                fn()
            sync()
            rounds.append((time.perf_counter() - t0) / opt.calls * 1e6)
        return sorted(rounds)[len(rounds) // 2]

    from fmha import _api
    fmha.attention(q, k, v)  # loads the torch ops (and a built fmha.torch_ext)
    ext = None
    if opt.ext:
        import fmha.torch_ext
        ext = fmha.torch_ext.build()

    def path(fn, compiled):
        def call():
            _api._fast = ext if compiled else None
            return fn()
        return call

    def first_call_path():  # the repeat table emptied: every call derives its arguments anew
        _api._repeat.calls.clear()
        return fmha.attention(q, k, v)

    def attn():
        return fmha.attention(q, k, v)

    def fa2():
        return fmha.flash_attn_func(q, k, v)

    def varlen():
        return fmha.varlen_attention(qp, kp, vp, cu, cu, S, S)

    def kept_layer():
        return layer.forward(q, k, v)

    def with_grad():
        return fmha.attention(qg, kg, vg)

    calls = [("torch SDPA [B, H, S, D] views", lambda: F.scaled_dot_product_attention(qt, kt, vt))]
    if ext is not None:
        calls += [("fmha.attention, compiled path (fmha.torch_ext)", path(attn, True)),
                  ("fmha.flash_attn_func, compiled path", path(fa2, True)),
                  ("fmha.varlen_attention (max_seqlen given), compiled path",
                   path(varlen, True)),
                  ("fmha.Attention.forward, compiled path", path(kept_layer, True)),
                  ("fmha.attention, inputs require grad, compiled path (autograd Function)",
                   path(with_grad, True))]
    calls += [("fmha.attention, Python path", path(attn, False)),
              ("fmha.attention, Python path, repeat table emptied before each call",
               path(first_call_path, False)),
              ("fmha.flash_attn_func, Python path", path(fa2, False)),
              ("fmha.Attention.forward, Python path", path(kept_layer, False)),
              ("fmha.attention, inputs require grad (fmha::fwd op)", path(with_grad, False)),
              ("fmha.varlen_attention (max_seqlen given), Python path", path(varlen, False))]
    if opt.device == "cpu":
        qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
        calls.append(("fmha.attention on numpy arrays", lambda: fmha.attention(qn, kn, vn)))
    rows = []
    with torch.no_grad():
        base = None
        for name, fn in calls:
            if "require grad" in name:
                with torch.enable_grad():
                    t = us(fn)
            else:
                t = us(fn)
            base = base or t
            rows.append([name, "%.1f" % t, "%.1f" % (t / base)])
            print("%-52s %8.1f us  %5.1fx SDPA" % (name, t, t / base), flush=True)
    body = results_md.table(["call (%s, %s [%d, %d, %d, %d])" % (opt.device,
                                                                 str(dt).replace("torch.", ""),
                                                                 B, S, H, D),
                             "µs per call", "/ SDPA"], rows, "lrr")
    if opt.out:
        machine = (results_md.gpu_machine(torch) if opt.device == "cuda"
                   else results_md.cpu_machine())
        results_md.write(opt, [("Machine", machine), ("torch", torch.__version__),
                               ("Peers", "torch SDPA on the same tensors, same process")],
                         body + "\n")


if __name__ == "__main__":
    main()
