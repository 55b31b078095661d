# Makefile — a thin wrapper over CMake so that `make` and `make test` work at
# the repository root. Build output lands in build/ (the CLI is build/fmha).
BUILD ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc)
# More CMake options for $(BUILD), e.g. make test CMAKE_ARGS=-DFMHA_BUILD_STATIC=ON
CMAKE_ARGS ?=
FUZZ_SECONDS ?= 60

.PHONY: all test asan-test tsan-test valgrind-test fuzz deps clean

all: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

# Installs the Debian packages the build needs when one is missing.
deps:
	@sh tools/install-deps.sh

test: all
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer (the
# sanitizers cover host code; the CUDA kernels have compute-sanitizer). The
# CLI's full-size run (FMHA_TEST_QUICK) is left to make test: under ASan it
# took 7.5 of 11 minutes, for one more path (the progress bar) of the CLI.
asan-test: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFMHA_SANITIZE=ON -DFMHA_CUDA=OFF >/dev/null
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && FMHA_TEST_CASES=120 FMHA_TEST_QUICK=1 ctest --output-on-failure -L cpu -j $(JOBS)

# The CPU tests under ThreadSanitizer: clang, LLVM's libomp and its Archer
# tool (CMakeLists.txt loads it and makes a race fail the test), on 2 threads
# so that the OpenMP regions run in parallel. Fewer cases than asan-test and
# no full-size CLI run (FMHA_TEST_QUICK), since TSan slows every access.
tsan-test:
	@sh tools/install-deps.sh tsan
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFMHA_SANITIZE=thread -DFMHA_CUDA=OFF >/dev/null
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	cd $(TSAN_BUILD) && OMP_NUM_THREADS=2 FMHA_TEST_CASES=40 FMHA_TEST_QUICK=1 ctest --output-on-failure -L cpu -j $(JOBS)

# A few CLI commands of the Release build under valgrind's memcheck
# (tests/valgrind_cli.sh): memory errors and definite leaks fail.
valgrind-test: all
	@sh tools/install-deps.sh valgrind
	sh tests/valgrind_cli.sh $(BUILD)/fmha .

# The libFuzzer harnesses (tests/fuzz/), built with clang in build-fuzz/, each
# run for FUZZ_SECONDS on a copy of its seed corpus; fails on any crash.
fuzz:
	@sh tools/install-deps.sh fuzz
	FUZZ_SECONDS=$(FUZZ_SECONDS) JOBS=$(JOBS) sh tests/fuzz/run.sh

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) build-fuzz
