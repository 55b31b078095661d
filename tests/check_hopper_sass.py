#!/usr/bin/env python3
"""Checks the Hopper kernel's machine code (cuobjdump of the object compiled
from src/cuda/hopper/launch.cu, the kernel's one translation unit).

usage: check_hopper_sass.py OBJECT [OBJECT ...]   (the library's objects; the
       one compiled from hopper/launch.cu is used)

For every hopper_fwd variant:
  - the GEMMs are wgmma (HGMMA for 16-bit inputs, QGMMA for FP8; int8_qk's
    S = Q K^T IGMMA and its P V QGMMA);
  - where the kernel anchors the wait for P V behind the softmax (pv_anchor:
    16-bit inputs, and FP8 with two-level accumulation), that wait
    (WARPGROUP.DEPBAR.LE gsb0, 0x0) comes after the tile's last exp2 in the
    main loop. ptxas otherwise hoists it above the softmax, and each tile's
    softmax then waits for its own P V GEMM.

cuobjdump (which needs nvdisasm beside it) is looked for on PATH, beside nvcc,
and in pip's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm packages; without
a working one the check is skipped (exit 77).
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

IN_NAMES = {0: "f16", 1: "bf16", 2: "e4m3", 3: "int8_qk"}
# the GEMMs each input kind must issue: S = Q K^T and O += P V
GEMMS = {0: ("HGMMA",), 1: ("HGMMA",), 2: ("QGMMA",), 3: ("IGMMA", "QGMMA")}


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    dirs = [os.path.dirname(os.path.realpath(nvcc))] if nvcc else []
    dirs.append("/usr/local/cuda/bin")
    for sp in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        dirs += glob.glob(os.path.join(sp, "nvidia", "*", "bin"))
    for d in dirs:
        path = os.path.join(d, "cuobjdump")
        if os.access(path, os.X_OK):
            return path
    return None


def functions(sass):
    """(name, [instruction text]) per function in cuobjdump -sass output."""
    out = []
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", chunk)
        out.append((name, ins))
    return out


def check_variant(d, inp, dropout, two_level, cl, ins):
    """The list of problems of one hopper_fwd<D, IN, DROPOUT, TWO_LEVEL, CL>."""
    what = f"hopper_fwd<{d}, {IN_NAMES.get(inp, inp)}, dropout {dropout}, two-level {two_level}, cluster {cl}>"
    for gemm in GEMMS[inp]:
        if not any(gemm in t for t in ins):
            return [f"{what}: no {gemm}"]
    anchored = inp < 2 or two_level
    if not anchored:
        return []
    # The main loop's span: from the wait for S (DEPBAR 0x1, only in the
    # loop) to the next tile's first GEMM.
    s_wait = [i for i, t in enumerate(ins) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t]
    if len(s_wait) != 1:
        return [f"{what}: {len(s_wait)} waits for S (DEPBAR 0x1), expected 1"]
    start = s_wait[0]
    end = next((i for i in range(start + 1, len(ins)) if "GMMA" in ins[i]), None)
    if end is None:
        return [f"{what}: no GEMM after the loop's wait for S"]
    span = ins[start:end]
    pv_wait = [i for i, t in enumerate(span) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t]
    exps = [i for i, t in enumerate(span) if "MUFU.EX2" in t]
    if not pv_wait or not exps:
        return [f"{what}: loop without a wait for P V ({len(pv_wait)}) or exp2s ({len(exps)})"]
    if pv_wait[0] < exps[-1]:
        before = sum(1 for i in exps if i > pv_wait[0])
        return [f"{what}: the wait for P V sits before {before} of the loop's {len(exps)} exp2s "
                f"(pv_anchor no longer holds it behind the softmax)"]
    return []


def main(argv):
    objs = [a for a in argv[1:]
            if os.path.basename(os.path.dirname(a)) == "hopper" and os.path.basename(a).startswith("launch.")]
    if len(objs) != 1:
        print(f"expected one hopper/launch object among the arguments, got {len(objs)}")
        return 2
    tool = find_cuobjdump()
    if not tool:
        print("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): skipped")
        return 77
    run = subprocess.run([tool, "-sass", objs[0]], capture_output=True, text=True)
    if run.returncode != 0:
        print(f"{tool} -sass failed ({run.stderr.strip()[:200]}; nvdisasm missing?): skipped")
        return 77
    sass = run.stdout
    seen, problems = 0, []
    for name, ins in functions(sass):
        m = re.search(r"hopper_fwdILi(\d+)ELi(\d)ELb([01])ELb([01])ELi(\d)E", name)
        if not m:
            continue
        seen += 1
        d, inp, dropout, two_level, cl = (int(x) for x in m.groups())
        problems += check_variant(d, inp, dropout, two_level, cl, ins)
    if seen == 0:
        print("no hopper_fwd variant in the object's machine code")
        return 1
    for p in problems:
        print("FAIL", p)
    print(f"{seen} hopper_fwd variants checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
