#!/bin/sh
# test_install.sh — a built fmha installed and used the ways another project
# would: `cmake --install` into a temporary prefix, then
#   - the files: libfmha.so -> libfmha.so.0 -> libfmha.so.VERSION with SONAME
#     libfmha.so.0, the header, the CMake package, fmha.pc, the CLI (when
#     built, run from the prefix: its RPATH finds the library);
#   - the installed library exports fmha.h's functions alone;
#   - examples/c built with pkg-config, examples/cmake and examples/cpp
#     through find_package(fmha), all run against the reference;
#   - where libfmha.a was installed (FMHA_BUILD_STATIC), the same through it;
#   - find_package(fmha 0.2) refused (0.x: a minor release may break the API);
#   - examples/subdirectory: fmha built by add_subdirectory (CPU backend only,
#     to stay quick), which must build the library and neither CLI nor tests.
# Usage: test_install.sh BUILD_DIR SOURCE_DIR [CMAKE]
set -eu
build=$(cd "${1:?usage: test_install.sh BUILD_DIR SOURCE_DIR [CMAKE]}" && pwd)
src=$(cd "${2:?usage: test_install.sh BUILD_DIR SOURCE_DIR [CMAKE]}" && pwd)
cmake=${3:-cmake}
CC=${CC:-cc}
CXX=${CXX:-c++}
jobs=$(nproc 2>/dev/null || echo 2)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/fmha-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# What runs must find libfmha through its RPATH or pkg-config, not an
# environment that happens to point at the build.
unset LD_LIBRARY_PATH PKG_CONFIG_PATH CMAKE_PREFIX_PATH

fail() {
    echo "FAIL: $*" >&2
    exit 1
}
step() { echo "test_install: $*"; }
for tool in pkg-config readelf "$cmake" "$CC" "$CXX"; do
    command -v "$tool" >/dev/null || fail "$tool not found (Debian: pkg-config, binutils, cmake, gcc, g++)"
done

version=$(sed -n 's/^#define FMHA_VERSION_STRING "\(.*\)"$/\1/p' "$src/include/fmha.h")
[ -n "$version" ] || fail "no FMHA_VERSION_STRING in $src/include/fmha.h"

# --------------------------------------------------------------- the files
prefix=$tmp/prefix
"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" || {
    cat "$tmp/install.log"
    fail "cmake --install $build"
}
so=$(find "$prefix" -name libfmha.so)
[ -n "$so" ] || fail "no libfmha.so under $prefix"
libdir=$(dirname "$so")
step "installed into $prefix (libdir ${libdir#"$prefix"/})"

[ -L "$libdir/libfmha.so" ] && [ "$(readlink "$libdir/libfmha.so")" = libfmha.so.0 ] ||
    fail "libfmha.so is not a link to libfmha.so.0"
[ -L "$libdir/libfmha.so.0" ] && [ "$(readlink "$libdir/libfmha.so.0")" = "libfmha.so.$version" ] ||
    fail "libfmha.so.0 is not a link to libfmha.so.$version"
[ -f "$libdir/libfmha.so.$version" ] && [ ! -L "$libdir/libfmha.so.$version" ] ||
    fail "libfmha.so.$version is not a file"
soname=$(readelf -d "$libdir/libfmha.so.$version" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
[ "$soname" = libfmha.so.0 ] || fail "SONAME is '$soname', not libfmha.so.0"
cmp -s "$src/include/fmha.h" "$prefix/include/fmha.h" || fail "include/fmha.h not installed"
for f in fmhaConfig.cmake fmhaConfigVersion.cmake fmhaTargets.cmake; do
    [ -f "$libdir/cmake/fmha/$f" ] || fail "$libdir/cmake/fmha/$f missing"
done
[ -f "$libdir/pkgconfig/fmha.pc" ] || fail "$libdir/pkgconfig/fmha.pc missing"
if command -v python3 >/dev/null; then
    python3 "$src/tests/check_exports.py" "$prefix/include/fmha.h" "$libdir/libfmha.so" ||
        fail "the installed library's exports"
fi
if [ -x "$build/fmha" ]; then
    [ -x "$prefix/bin/fmha" ] || fail "the CLI was built but not installed"
    "$prefix/bin/fmha" info >"$tmp/info.txt" 2>&1 || {
        cat "$tmp/info.txt"
        fail "the installed fmha info"
    }
    grep -q "^fmha $version" "$tmp/info.txt" || fail "fmha info does not say fmha $version"
    step "bin/fmha runs from the prefix"
fi
static=0
[ -f "$libdir/libfmha.a" ] && static=1

# links libfmha.so.0 (by its soname), or not libfmha at all (static)
needs() {
    if readelf -d "$2" | grep -q "NEEDED.*\[libfmha\.so"; then
        [ "$1" = shared ] && readelf -d "$2" | grep -q "NEEDED.*\[libfmha\.so\.0\]" ||
            fail "$2 does not link libfmha.so.0 by its soname"
    else
        [ "$1" = static ] || fail "$2 does not link libfmha.so"
    fi
}
run() {
    "$@" >"$tmp/run.txt" 2>&1 || {
        cat "$tmp/run.txt"
        fail "$*"
    }
    sed 's/^/    /' "$tmp/run.txt"
}

# ------------------------------------------------------------- pkg-config
export PKG_CONFIG_PATH="$libdir/pkgconfig"
[ "$(pkg-config --modversion fmha)" = "$version" ] || fail "pkg-config --modversion fmha"
pc_libdir=$(pkg-config --variable=libdir fmha)
[ "$pc_libdir" = "$libdir" ] || fail "fmha.pc's libdir is $pc_libdir, not $libdir"
# shellcheck disable=SC2046 # pkg-config's flags are words
"$CC" -std=c99 -Wall -Wextra -pedantic -Werror -o "$tmp/example_pc" "$src/examples/c/example.c" \
    $(pkg-config --cflags --libs fmha) -Wl,-rpath,"$pc_libdir" || fail "examples/c with pkg-config"
needs shared "$tmp/example_pc"
step "examples/c through pkg-config"
run "$tmp/example_pc"
if [ $static = 1 ]; then
    # --static adds Libs.private, what libfmha.a leaves to the program's
    # link; -lfmha becomes the archive itself (the linker prefers the .so).
    libs=""
    for w in $(pkg-config --static --libs fmha); do
        [ "$w" = -lfmha ] && w=$libdir/libfmha.a
        libs="$libs $w"
    done
    # shellcheck disable=SC2046,SC2086
    "$CC" -std=c99 -o "$tmp/example_pc_static" "$src/examples/c/example.c" $(pkg-config --cflags fmha) \
        $libs || fail "examples/c with pkg-config --static"
    needs static "$tmp/example_pc_static"
    step "examples/c through pkg-config --static (libfmha.a)"
    run "$tmp/example_pc_static"
fi

# ------------------------------------------------------------ find_package
# configure_build NAME SOURCE_DIR [CMAKE ARGS...]: configures and builds $tmp/NAME
configure_build() {
    name=$1 dir=$2
    shift 2
    "$cmake" -S "$dir" -B "$tmp/$name" -DCMAKE_BUILD_TYPE=Release "$@" >"$tmp/$name.log" 2>&1 &&
        "$cmake" --build "$tmp/$name" -j "$jobs" >>"$tmp/$name.log" 2>&1 || {
        cat "$tmp/$name.log"
        fail "$name ($dir)"
    }
}
configure_build cmake "$src/examples/cmake" -DCMAKE_PREFIX_PATH="$prefix"
needs shared "$tmp/cmake/fmha_example"
step "examples/cmake through find_package(fmha)"
run "$tmp/cmake/fmha_example"
configure_build cpp "$src/examples/cpp" -DCMAKE_PREFIX_PATH="$prefix"
needs shared "$tmp/cpp/fmha_example_cpp"
step "examples/cpp through find_package(fmha)"
run "$tmp/cpp/fmha_example_cpp"
if [ $static = 1 ]; then
    configure_build cmake_static "$src/examples/cmake" -DCMAKE_PREFIX_PATH="$prefix" -DFMHA_EXAMPLE_STATIC=ON
    needs static "$tmp/cmake_static/fmha_example"
    step "examples/cmake through find_package(fmha COMPONENTS static) (libfmha.a)"
    run "$tmp/cmake_static/fmha_example"
fi

# The package's version rule, without compilers (LANGUAGES NONE).
mkdir -p "$tmp/version"
cat >"$tmp/version/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.18)
project(fmha_version LANGUAGES NONE)
find_package(fmha 0.1 REQUIRED)
if(NOT TARGET fmha::fmha OR NOT fmha_VERSION STREQUAL "$version")
  message(FATAL_ERROR "find_package(fmha 0.1): no fmha::fmha, or version \${fmha_VERSION}")
endif()
find_package(fmha 0.2 QUIET)
if(fmha_FOUND)
  message(FATAL_ERROR "find_package(fmha 0.2) accepted fmha \${fmha_VERSION}")
endif()
EOF
"$cmake" -S "$tmp/version" -B "$tmp/version/build" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/version.log" 2>&1 || {
    cat "$tmp/version.log"
    fail "find_package(fmha)'s version check"
}
step "find_package(fmha 0.1) finds $version, find_package(fmha 0.2) does not"

# ---------------------------------------------------------- add_subdirectory
configure_build subdirectory "$src/examples/subdirectory" -DFMHA_CUDA=OFF
targets=$("$cmake" --build "$tmp/subdirectory" --target help)
for t in fmha_cli test_forward fmha_internal; do
    ! echo "$targets" | grep -q "\.\.\. $t\$" || fail "add_subdirectory(fmha) defines $t"
done
needs shared "$tmp/subdirectory/fmha_example"
step "examples/subdirectory: fmha::fmha built by add_subdirectory, no CLI, no tests"
run "$tmp/subdirectory/fmha_example"
step "ok"
