#!/usr/bin/env python3
"""gen_wgmma.py — writes src/cuda/hopper/wgmma.inc: one inline-PTX wrapper per wgmma
shape the Hopper kernel issues. Each wrapper is a single asm statement whose
operand list names every accumulator register, which C++ cannot spell as a
loop; generating them keeps the list in one place (NS below).

usage: python3 tools/gen_wgmma.py > src/cuda/hopper/wgmma.inc
"""
# every N the kernel may use: BN for S = QK^T (htile's choices and tuning
# candidates), D for O += PV; a wrapper is compiled only where it is used
NS = (64, 80, 96, 112, 128, 160, 176, 192, 256)
# (PTX type, the kernel's input kind, k of one instruction, the N it takes)
TYPES = (("f16", "IN_F16", 16, NS), ("bf16", "IN_BF16", 16, NS), ("e4m3", "IN_E4M3", 32, (64, 128, 256)))
# INT8 S = Q K^T (IN_S8Q: q and k INT8, v e4m3): the key tile's N only, s32 accumulators
S8_NS = (128,)


def regs(first, count):
    return ", ".join(f"%{first + i}" for i in range(count))


def accum_operands(n):
    return ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))


def emit(n, ty, kind, k):
    acc = n // 2
    # 16-bit types name both operands' majorness; 8-bit ones are K-major only
    trans_ss = ", 0, 0" if k == 16 else ""
    trans_rs = ", 1" if k == 16 else ""
    print(f"template <> struct wgmma<{n}, {kind}> {{")
    # S = Q K^T: A and B from shared memory, both K-major.
    print("    static __device__ __forceinline__ void ss(float *d, uint64_t a, uint64_t b, int accumulate)")
    print("    {")
    print('        asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(acc + 2) + ', 0;\\n"')
    print(f'                     "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ty}.{ty} "')
    print(f'                     "{{{regs(0, acc)}}}, "')
    print(f'                     "%{acc}, %{acc + 1}, p, 1, 1{trans_ss};\\n}}\\n"')
    print(f"                     : {accum_operands(n)}")
    print('                     : "l"(a), "l"(b), "r"(accumulate));')
    print("    }")
    # O += P V: A (P) from registers, B from shared memory: V MN-major (16-bit),
    # V^T K-major (8-bit).
    print("    static __device__ __forceinline__ void rs(float *d, const uint32_t *a, uint64_t b, int accumulate)")
    print("    {")
    print('        asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(acc + 5) + ', 0;\\n"')
    print(f'                     "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ty}.{ty} "')
    print(f'                     "{{{regs(0, acc)}}}, "')
    print(f'                     "{{{regs(acc, 4)}}}, %{acc + 4}, p, 1, 1{trans_rs};\\n}}\\n"')
    print(f"                     : {accum_operands(n)}")
    print('                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));')
    print("    }")
    # S = Q K^T with Q in registers: B (K) K-major.
    trans_rsk = ", 0" if k == 16 else ""
    print("    static __device__ __forceinline__ void rsk(float *d, const uint32_t *a, uint64_t b, int accumulate)")
    print("    {")
    print('        asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(acc + 5) + ', 0;\\n"')
    print(f'                     "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ty}.{ty} "')
    print(f'                     "{{{regs(0, acc)}}}, "')
    print(f'                     "{{{regs(acc, 4)}}}, %{acc + 4}, p, 1, 1{trans_rsk};\\n}}\\n"')
    print(f"                     : {accum_operands(n)}")
    print('                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));')
    print("    }")
    print("};")


def emit_s8(n):
    """S = Q K^T on INT8: ss and rsk, s32 accumulators (integer wgmma has no scale or
    transpose immediates)."""
    acc = n // 2
    ops = ", ".join(f'"+r"(d[{i}])' for i in range(acc))
    print(f"template <> struct wgmma<{n}, IN_S8Q> {{")
    print("    static __device__ __forceinline__ void ss(uint32_t *d, uint64_t a, uint64_t b, int accumulate)")
    print("    {")
    print('        asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(acc + 2) + ', 0;\\n"')
    print(f'                     "wgmma.mma_async.sync.aligned.m64n{n}k32.s32.s8.s8 "')
    print(f'                     "{{{regs(0, acc)}}}, "')
    print(f'                     "%{acc}, %{acc + 1}, p;\\n}}\\n"')
    print(f"                     : {ops}")
    print('                     : "l"(a), "l"(b), "r"(accumulate));')
    print("    }")
    print("    static __device__ __forceinline__ void rsk(uint32_t *d, const uint32_t *a, uint64_t b, int accumulate)")
    print("    {")
    print('        asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(acc + 5) + ', 0;\\n"')
    print(f'                     "wgmma.mma_async.sync.aligned.m64n{n}k32.s32.s8.s8 "')
    print(f'                     "{{{regs(0, acc)}}}, "')
    print(f'                     "{{{regs(acc, 4)}}}, %{acc + 4}, p;\\n}}\\n"')
    print(f"                     : {ops}")
    print('                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));')
    print("    }")
    print("};")


print("/* wgmma.inc — generated by tools/gen_wgmma.py; do not edit. Included by")
print(" * mainloop.cuh: wgmma<N, IN>::ss (both operands in shared memory,")
print(" * K-major), ::rs (A in registers, B in shared memory: MN-major for f16 and")
print(" * bf16, K-major for e4m3) and ::rsk (A in registers, B K-major) for m64nNk16")
print(" * (f16, bf16) and m64nNk32 (e4m3) with f32 accumulators d[N / 2].")
print(" * The s8 wrappers (IN_S8Q's S = Q K^T) take s32 accumulators d[N / 2]")
print(" * as raw bits, exact integer sums. */")
print("template <int N, int IN> struct wgmma;")
for ty, kind, k, ns in TYPES:
    for n in ns:
        emit(n, ty, kind, k)
for n in S8_NS:
    emit_s8(n)
