#!/usr/bin/env sh
# check_format.sh — fails when a C or CUDA file of the tree differs from what
# clang-format (with the repository's .clang-format) makes of it; with --fix,
# rewrites them. Generated files (src/cuda/**/wgmma.inc) are left alone.
set -eu
cd "$(dirname "$0")/.."
CF=${CLANG_FORMAT:-clang-format}
command -v "$CF" >/dev/null || { echo "check_format: $CF not found (Debian: clang-format)" >&2; exit 2; }
files=$(git ls-files 'src/*.c' 'src/*.h' 'src/*.cu' 'src/*.cuh' 'include/*.h' 'tests/*.c' 'tests/*.h' \
    'tests/*.cu' 'tools/*.c' 'tools/*.h' 'examples/*.c' 'examples/*.cpp' \
    'python/fmha/csrc/*.cpp')
if [ "${1:-}" = "--fix" ]; then
    $CF -i $files
    exit 0
fi
bad=0
for f in $files; do
    if ! $CF "$f" | cmp -s - "$f"; then
        echo "check_format: $f differs from clang-format's layout (tools/check_format.sh --fix)"
        bad=1
    fi
done
[ $bad = 0 ] && echo "check_format: $(echo $files | wc -w) files as clang-format lays them out"
exit $bad
