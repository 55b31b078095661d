#!/bin/sh
# run.sh — `make fuzz`: builds the libFuzzer harnesses (tests/fuzz/*.c) with
# clang in build-fuzz/ and runs each for FUZZ_SECONDS (default 60) on a copy
# of its seed corpus: tests/fuzz/corpus/TARGET/ is copied into
# build-fuzz/corpus/TARGET/, where the inputs the fuzzer finds go (kept for
# the next run; the repository's seeds are never written). Fails when any
# fuzzer reports a crash or a broken property; the input that did it is in
# build-fuzz/artifacts/TARGET/ and its log in build-fuzz/fuzz_TARGET.log
# (replay: build-fuzz/fuzz_TARGET FILE).
#
#     sh tests/fuzz/run.sh [TARGET...]     # safetensors hfconfig cli_options forward
set -eu
cd "$(dirname "$0")/../.."
SECS=${FUZZ_SECONDS:-60}
BUILD=${FUZZ_BUILD:-build-fuzz}
JOBS=${JOBS:-$(nproc)}
TARGETS=${*:-safetensors hfconfig cli_options forward}

mkdir -p "$BUILD"
if ! { cmake -S . -B "$BUILD" -DCMAKE_C_COMPILER=clang -DFMHA_FUZZ=ON -DFMHA_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo && cmake --build "$BUILD" -j "$JOBS" --target fuzzers; } \
    >"$BUILD/build.log" 2>&1; then
    tail -30 "$BUILD/build.log"
    echo "fuzz: the build failed (whole log: $BUILD/build.log)" >&2
    exit 1
fi

failed=""
for t in $TARGETS; do
    [ -d "tests/fuzz/corpus/$t" ] || { echo "fuzz: no target '$t' (tests/fuzz/corpus/$t)" >&2; exit 2; }
    corpus=$BUILD/corpus/$t
    mkdir -p "$corpus" "$BUILD/artifacts/$t"
    cp tests/fuzz/corpus/"$t"/* "$corpus"/
    set -- -max_total_time="$SECS" -print_final_stats=1 -timeout=30 -rss_limit_mb=2048 \
        -artifact_prefix="$BUILD/artifacts/$t/"
    [ -f "tests/fuzz/$t.dict" ] && set -- "$@" -dict="tests/fuzz/$t.dict"
    # The forward harness reads about a hundred bytes; longer inputs only slow the mutations.
    [ "$t" = forward ] && set -- "$@" -max_len=256
    log=$BUILD/fuzz_$t.log
    start=$(date +%s)
    if "$BUILD/fuzz_$t" "$@" "$corpus" >"$log" 2>&1; then
        status=ok
    else
        status=FAILED
        failed="$failed $t"
    fi
    secs=$(($(date +%s) - start))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    echo "fuzz_$t: ${execs:-?} executions in ${secs} s, corpus $(ls "$corpus" | wc -l) inputs: $status"
    grep -E "^fuzz_$t: [0-9]+ inputs" "$log" | sed 's/^/  /' || true
    if [ $status = FAILED ]; then
        grep -E "^fuzz_$t: |^case: |ERROR: |SUMMARY: |Test unit written" "$log" | head -20
        echo "  (whole log: $log)"
    fi
done
if [ -n "$failed" ]; then
    echo "fuzz: failed:$failed" >&2
    exit 1
fi
