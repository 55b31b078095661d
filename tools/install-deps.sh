#!/bin/sh
# install-deps.sh — installs what fmha's build and tests need (C and C++
# compilers, CMake, cJSON, OpenMP runtime; the C++ compiler and pkg-config
# serve the install test) from Debian's packages, only when something is
# missing. `install-deps.sh tsan` adds clang with LLVM's libomp and its Archer
# tool (make tsan-test); `install-deps.sh valgrind` adds valgrind (make valgrind-test);
# `install-deps.sh mpi` adds Open MPI (the MPI communicator of sequence
# parallelism and its tests under mpirun; CMake finds it when present);
# `install-deps.sh fuzz` adds clang with libFuzzer and LLVM's libomp (make fuzz).
need=""
command -v cc >/dev/null 2>&1 || need="$need gcc"
command -v cmake >/dev/null 2>&1 || need="$need cmake"
command -v make >/dev/null 2>&1 || need="$need make"
command -v c++ >/dev/null 2>&1 || need="$need g++"
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
[ -f /usr/include/cjson/cJSON.h ] || need="$need libcjson-dev"
for extra in "$@"; do
    case $extra in
    tsan)
        command -v clang >/dev/null 2>&1 || need="$need clang"
        ls /usr/lib/llvm-*/lib/libarcher.so >/dev/null 2>&1 || need="$need libomp-dev"
        ;;
    valgrind) command -v valgrind >/dev/null 2>&1 || need="$need valgrind" ;;
    mpi)
        command -v mpirun >/dev/null 2>&1 || need="$need openmpi-bin"
        [ -f /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || [ -f /usr/include/mpi.h ] ||
            need="$need libopenmpi-dev"
        ;;
    fuzz)
        # clang, libFuzzer and the sanitizers' runtimes (libclang-rt, only
        # recommended by clang), and the OpenMP runtime clang's -fopenmp links:
        # one test link says whether they are all there.
        printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }\n' |
            clang -x c - -fsanitize=fuzzer,address,undefined -fopenmp -o /dev/null >/dev/null 2>&1 ||
            need="$need clang libclang-rt-dev libomp-dev"
        ;;
    *)
        echo "install-deps.sh: unknown extra '$extra' (tsan, valgrind, mpi, fuzz)" >&2
        exit 2
        ;;
    esac
done
[ -n "$need" ] || exit 0
echo "installing:$need"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
