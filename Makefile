# Makefile — a thin wrapper over CMake so that `make` and `make test` work at
# the repository root. Build output lands in build/ (the CLI is build/fmha).
BUILD ?= build
ASAN_BUILD ?= build-asan
JOBS ?= $(shell nproc)
# More CMake options for $(BUILD), e.g. make test CMAKE_ARGS=-DFMHA_BUILD_STATIC=ON
CMAKE_ARGS ?=

.PHONY: all test asan-test deps clean

all: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

# Installs the Debian packages the build needs when one is missing.
deps:
	@sh tools/install-deps.sh

test: all
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer (the
# sanitizers cover host code; the CUDA kernels have compute-sanitizer).
asan-test: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFMHA_SANITIZE=ON -DFMHA_CUDA=OFF >/dev/null
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && FMHA_TEST_CASES=120 ctest --output-on-failure -L cpu -j $(JOBS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
