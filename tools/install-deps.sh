#!/bin/sh
# install-deps.sh — installs what fmha's build and tests need (C and C++
# compilers, CMake, cJSON, OpenMP runtime; the C++ compiler and pkg-config
# serve the install test) from Debian's packages, only when something is
# missing.
need=""
command -v cc >/dev/null 2>&1 || need="$need gcc"
command -v cmake >/dev/null 2>&1 || need="$need cmake"
command -v make >/dev/null 2>&1 || need="$need make"
command -v c++ >/dev/null 2>&1 || need="$need g++"
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
[ -f /usr/include/cjson/cJSON.h ] || need="$need libcjson-dev"
[ -n "$need" ] || exit 0
echo "installing:$need"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
