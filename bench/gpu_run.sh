#!/usr/bin/env bash
# gpu_run.sh — what a GPU machine runs for fmha: build with the CUDA backend,
# the GPU test suite, compute-sanitizer on a small subset, the CLI on CUDA, and
# the benchmark against torch's SDPA backends. Logs go to $OUT (or ./gpu-out).
# usage: bench/gpu_run.sh [smoke] [test] [bwd] [sanitize] [sass] [ncu] [bench|bench-quick] [ab] [sched] [sched-ncu] [fp8|fp8-quick] [lowp] [decode] [sp] [cli] [variants] [debug] [quant] [quant-ncu]
# ab: AB_BASE=DIR, a source tree of another commit (git archive COMMIT CMakeLists.txt src include
# tools tests | tar -x -C DIR), is built into build-base and timed beside this tree's library in one
# process (bench_cuda.py --ab-lib); AB_BASE is built in the background while the other steps run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
# cJSON for the CLI: the GPU image lacks it, so the Debian packages travel in .deps/.
if [ -d .deps ] && [ ! -f /usr/include/cjson/cJSON.h ]; then
    for f in .deps/*.deb; do dpkg -x "$f" /tmp/deps; done
    export CMAKE_PREFIX_PATH=/tmp/deps/usr LD_LIBRARY_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
# PREBUILT=DIR (and PREBUILT_BASE=DIR for ab): build trees made on another machine and carried here
# (bench/NOTES.md says how), used in place of building: the device's time goes to the runs.
if [ -n "${PREBUILT:-}" ]; then
    rm -rf build-gpu && ln -s "$PREBUILT" build-gpu
    export LD_LIBRARY_PATH=$PWD/build-gpu:${LD_LIBRARY_PATH:-}
    if ldd build-gpu/test_cuda build-gpu/fmha | grep "not found"; then echo "prebuilt binaries miss libraries"; exit 1; fi
elif [ "$*" != variants ]; then # tuning runs build only their variants
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release ${CMAKE_EXTRA:-} > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    cmake --build build-gpu -j 16 > "$OUT/build.log" 2>&1 || { grep -E "error" -A3 "$OUT/build.log" | head -40; exit 1; }
    grep -E "spill|stack" "$OUT/build.log" | sort | uniq -c | head
fi
if [ -n "${PREBUILT_BASE:-}" ]; then
    rm -rf build-base && ln -s "$PREBUILT_BASE" build-base && echo 0 > "$OUT/base.rc"
    base_pid=$$ # nothing to wait for
elif [ -n "${AB_BASE:-}" ]; then
    ( cmake -S "$AB_BASE" -B build-base -DCMAKE_BUILD_TYPE=Release > "$OUT/base.cmake.log" 2>&1 &&
      cmake --build build-base -j 16 --target fmha > "$OUT/base.build.log" 2>&1; echo $? > "$OUT/base.rc" ) &
    base_pid=$!
fi
summary=()
IFS=';' read -r -a VARIANTS <<< "${VARIANT_FLAGS:-}"
for step in "$@"; do
    case $step in
    test)
        FMHA_TEST_CASES=${CASES:-300} timeout 400 build-gpu/test_cuda > "$OUT/test_cuda.log" 2>&1
        summary+=("test_cuda rc=$? $(tail -1 "$OUT/test_cuda.log")")
        grep FAIL "$OUT/test_cuda.log" | head -20 ;;
    bwd) # the CUDA backward: its test suite, compute-sanitizer on a few cases, the benchmark (BWD_BENCH: its flags)
        FMHA_TEST_CASES=${CASES:-200} timeout 400 build-gpu/test_cuda_backward > "$OUT/test_cuda_backward.log" 2>&1
        summary+=("test_cuda_backward rc=$? $(tail -1 "$OUT/test_cuda_backward.log")")
        grep FAIL "$OUT/test_cuda_backward.log" | head -20
        FMHA_TEST_CASES=6 timeout 300 compute-sanitizer --tool memcheck build-gpu/test_cuda_backward > "$OUT/memcheck_bwd.log" 2>&1
        summary+=("memcheck bwd rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_bwd.log" | tail -1)")
        FMHA_TEST_CASES=3 timeout 300 compute-sanitizer --tool racecheck build-gpu/test_cuda_backward > "$OUT/racecheck_bwd.log" 2>&1
        summary+=("racecheck bwd rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck_bwd.log" | tail -1)")
        timeout 400 python3 bench/bench_backward.py --lib build-gpu/libfmha.so ${BWD_BENCH:---quick} > "$OUT/bench_backward.log" 2>&1
        summary+=("bench_backward rc=$?"); tail -12 "$OUT/bench_backward.log" ;;
    sass) # the Hopper kernel must issue HGMMA and keep its registers out of local memory
        cuobjdump --dump-sass build-gpu/CMakeFiles/fmha.dir/src/cuda/hopper/launch.cu.o > "$OUT/hopper.sass" 2>&1
        summary+=("sass: $(grep -c HGMMA "$OUT/hopper.sass") HGMMA, $(grep -c QGMMA "$OUT/hopper.sass") QGMMA, $(grep -cE 'LDL|STL' "$OUT/hopper.sass") LDL/STL, $(grep -c 'UTMALDG' "$OUT/hopper.sass") UTMALDG")
        grep -E "hopper.*(spill|stack)" "$OUT/build.log" | head -4 ;;
    ncu) # one Hopper launch of the flux shape per dtype under Nsight Compute (clocks left alone; NCU_DTYPE: "bf16 fp8")
        for dt in ${NCU_DTYPE:-bf16}; do
            timeout 300 ncu --clock-control none --kernel-name regex:hopper_fwd --launch-skip 3 --launch-count 1 \
                --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
                --section MemoryWorkloadAnalysis \
                --metrics sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,lts__throughput.avg.pct_of_peak_sustained_elapsed \
                build-gpu/fmha bench --model flux-1024 --device cuda --dtype $dt > "$OUT/ncu-$dt.txt" 2>&1
            summary+=("ncu $dt rc=$?")
            echo "== ncu $dt"
            grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc A|No Eligible|Eligible Warps|Warp Cycles Per Issued|Shared Memory|L1/TEX Hit|Mem Pipes Busy|pipe_xu|gmma|lts__" "$OUT/ncu-$dt.txt" | head -26
        done ;;
    debug)
        FMHA_TEST_LONG=0 timeout 300 cuda-gdb -batch -ex run -ex bt -ex quit --args build-gpu/test_cuda 3 > "$OUT/debug.log" 2>&1
        tail -40 "$OUT/debug.log" ;;
    sanitize)
        FMHA_TEST_CASES=6 FMHA_TEST_LONG=0 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/test_cuda > "$OUT/memcheck.log" 2>&1
        summary+=("memcheck rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
        FMHA_TEST_CASES=3 FMHA_TEST_LONG=0 timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 build-gpu/test_cuda > "$OUT/racecheck.log" 2>&1
        summary+=("racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | tail -1)")
        for tool in initcheck synccheck; do
            FMHA_TEST_CASES=3 FMHA_TEST_LONG=0 timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/test_cuda > "$OUT/$tool.log" 2>&1
            summary+=("$tool rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/$tool.log" | tail -1)")
        done ;;
    decode) # CUDA decode: its test suite (test_decode on the GPU), memcheck and racecheck on a few cases, the bench
        FMHA_TEST_CASES=${CASES:-60} timeout 300 build-gpu/test_cuda_decode > "$OUT/test_cuda_decode.log" 2>&1
        summary+=("test_cuda_decode rc=$? $(tail -1 "$OUT/test_cuda_decode.log")")
        grep -B2 FAIL "$OUT/test_cuda_decode.log" | head -30
        for tool in memcheck racecheck; do
            # line-buffered: an abort (racecheck's on 2026-12-07, NOTES.md) keeps what ran before it
            FMHA_TEST_CASES=4 timeout 240 stdbuf -oL -eL compute-sanitizer --tool $tool --error-exitcode 9 \
                build-gpu/test_cuda_decode > "$OUT/${tool}_decode.log" 2>&1
            summary+=("$tool decode rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/${tool}_decode.log" | tail -1)")
        done
        timeout 400 python3 bench/bench_decode_cuda.py --lib build-gpu/libfmha.so ${DECODE_BENCH:---quick} \
            > "$OUT/bench_decode_cuda.log" 2>&1
        summary+=("bench_decode_cuda rc=$?"); grep -v "^|" "$OUT/bench_decode_cuda.log" | tail -40 ;;
    sp) # sequence parallelism on one GPU: NCCL at world size 1, the CUDA merge, a ring step timed (piece and merge)
        NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
        for t in test_sp_nccl test_cuda_merge; do
            LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}${LD_LIBRARY_PATH:-} timeout 200 build-gpu/$t > "$OUT/$t.log" 2>&1
            summary+=("$t rc=$? $(tail -1 "$OUT/$t.log")")
            LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}${LD_LIBRARY_PATH:-} timeout 240 compute-sanitizer --tool memcheck \
                --report-api-errors no build-gpu/$t > "$OUT/memcheck_$t.log" 2>&1
            summary+=("memcheck $t rc=$? $(grep 'ERROR SUMMARY' "$OUT/memcheck_$t.log" | tail -1)")
        done
        timeout 200 build-gpu/sp_step_cuda ${HBM_TBS:-3.35} > "$OUT/sp_step_cuda.log" 2>&1
        summary+=("sp_step_cuda rc=$?"); cat "$OUT/sp_step_cuda.log" ;;
    cli)
        { build-gpu/fmha info && build-gpu/fmha run --model flux-1024 --device cuda \
          && build-gpu/fmha run --model llama3-8b --seqlen 2048 --device cuda \
          && build-gpu/fmha bench --model flux-1024 --device cuda --dtype bf16 \
          && build-gpu/fmha run --model flux-1024 --device cuda --dtype fp8 \
          && build-gpu/fmha bench --model flux-1024 --device cuda --dtype fp8; } > "$OUT/cli.log" 2>&1
        summary+=("cli rc=$?"); tail -14 "$OUT/cli.log" ;;
    variants) # tuning builds, sm_90 only, fmha timed alone on the quick shapes (VARIANT_BENCH: which benches)
        i=0
        for flags in "${VARIANTS[@]}"; do
            i=$((i + 1))
            ( cmake -S . -B build-v$i -DCMAKE_BUILD_TYPE=Release -DFMHA_CUDA_GENCODE="-gencode=arch=compute_90,code=sm_90" \
                -DFMHA_CUDA_FLAGS="${flags// /;}" > "$OUT/v$i.cmake.log" 2>&1 && cmake --build build-v$i -j 4 --target fmha > "$OUT/v$i.build.log" 2>&1 ) &
        done
        wait
        i=0
        for flags in "${VARIANTS[@]}"; do
            i=$((i + 1))
            echo "== variant $i: $flags $(grep -c 'spill' "$OUT/v$i.build.log") spill lines"
            for bench in ${VARIANT_BENCH:-bench/bench_cuda.py}; do
                python3 $bench --lib build-v$i/libfmha.so --quick --no-peers 2>&1 | grep -v "^|" | grep -v "^#"
            done
        done ;;
    quant) # the FP8 quantizer: bit for bit against the CPU's, memcheck on a few cases, the bench
        timeout 300 build-gpu/test_cuda_fp8 > "$OUT/test_cuda_fp8.log" 2>&1
        summary+=("test_cuda_fp8 rc=$? $(tail -1 "$OUT/test_cuda_fp8.log")")
        grep -B1 FAIL "$OUT/test_cuda_fp8.log" | head -20
        FMHA_TEST_CASES=20 FMHA_TEST_LONG=0 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
            build-gpu/test_cuda_fp8 > "$OUT/memcheck_fp8.log" 2>&1
        summary+=("memcheck fp8 rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_fp8.log" | tail -1)")
        python3 bench/bench_quant.py --lib build-gpu/libfmha.so > "$OUT/bench_quant.log" 2>&1
        summary+=("bench_quant rc=$?"); cat "$OUT/bench_quant.log" ;;
    quant-ncu) # the per-block quantizer's launch on bench_quant's tensor under Nsight Compute (clocks left alone)
        timeout 240 ncu --clock-control none --kernel-name regex:quant_local --launch-count 1 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
            --section LaunchStats --metrics dram__bytes_read.sum.per_second,dram__bytes_write.sum.per_second \
            python3 bench/bench_quant.py --lib build-gpu/libfmha.so --iters 1 > "$OUT/quant-ncu.txt" 2>&1
        summary+=("quant-ncu rc=$?")
        grep -E "Duration|DRAM Throughput|Memory Throughput|dram__|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|No Eligible|L2 Hit|Waves" "$OUT/quant-ncu.txt" | head -30 ;;
    lowp) # fp8_compute = int8_qk: its GPU tests (test_cuda's int8_qk cases, a few of the rest), memcheck,
        # then every layer mode's accuracy and speed beside E4M3, bf16 and cuDNN (bench_lowp.py)
        FMHA_TEST_CASES=5 FMHA_TEST_LONG=0 timeout 200 build-gpu/test_cuda > "$OUT/test_cuda_lowp.log" 2>&1
        summary+=("test_cuda rc=$? $(tail -1 "$OUT/test_cuda_lowp.log")")
        grep -E "FAIL|int8_qk on" "$OUT/test_cuda_lowp.log" | head -20
        FMHA_TEST_CASES=2 FMHA_TEST_LONG=0 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
            build-gpu/test_cuda > "$OUT/memcheck_lowp.log" 2>&1
        summary+=("memcheck rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_lowp.log" | tail -1)")
        python3 bench/bench_lowp.py --lib build-gpu/libfmha.so > "$OUT/bench_lowp.log" 2>&1
        summary+=("bench_lowp rc=$?"); grep -v "^|" "$OUT/bench_lowp.log" ;;
    fp8|fp8-quick) # FP8 attention against fmha bf16 and cuDNN, both accumulation modes, accuracy
        q=""; [ "$step" = fp8-quick ] && q=--quick
        python3 bench/bench_fp8.py --lib build-gpu/libfmha.so $q > "$OUT/bench_fp8.log" 2>&1
        summary+=("bench_fp8 rc=$?"); cat "$OUT/bench_fp8.log" | grep -v "^|" ;;
    smoke) # one Hopper launch under a short timeout, before anything long
        timeout 60 build-gpu/fmha run --model flux-1024 --device cuda > "$OUT/smoke.log" 2>&1
        rc=$?; summary+=("smoke rc=$rc"); tail -3 "$OUT/smoke.log"; [ $rc = 0 ] || break ;;
    sched) # the Hopper kernel's schedules side by side (FMHA_CUDA_SCHEDULE), fmha alone on the quick shapes
        for m in tiles persistent split; do
            echo "== FMHA_CUDA_SCHEDULE=$m"
            FMHA_CUDA_SCHEDULE=$m timeout 200 python3 bench/bench_cuda.py --lib build-gpu/libfmha.so --quick --no-peers 2>&1 | grep -v "^#"
        done | tee "$OUT/sched.log" ;;
    sched-ncu) # kernel durations and L2 traffic, Flux and FA3 d128, under each setting of NCU_ENVS (clocks and caches left alone)
        for shape in "--model flux-1024" "--batch 1 --seqlen 16384 --heads 16 --kv-heads 16 --head-dim 128"; do
            for e in ${NCU_ENVS:-FMHA_CUDA_SCHEDULE=persistent FMHA_CUDA_SCHEDULE=split}; do
                echo "== $shape $e"
                env "$e" timeout 120 ncu --clock-control none --cache-control none \
                    --kernel-name regex:"hopper_fwd|combine" --launch-skip 4 --launch-count 4 \
                    --metrics gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.avg,lts__t_bytes.sum.per_second \
                    build-gpu/fmha bench $shape --device cuda --dtype bf16 --iters 10 2>&1 |
                    grep -E "hopper_fwd|combine_kernel|gpu__time|sm__cycles|lts__" | sed -E 's/\(hopper_params\).*|_ZN.*hopper_fwd/hopper_fwd/'
            done
        done 2>&1 | tee "$OUT/sched-ncu.log" ;;
    ab) # this tree's library against AB_BASE's, same process and rounds: the full table, REPEATS rounds (default 3)
        [ "$base_pid" = $$ ] || wait "$base_pid"; [ "$(cat "$OUT/base.rc")" = 0 ] || { tail -20 "$OUT/base.build.log"; break; }
        python3 bench/bench_cuda.py --lib build-gpu/libfmha.so --ab-lib build-base/libfmha.so ${SHAPES:+--shapes "$SHAPES"} \
            --repeats "${REPEATS:-3}" --out "$OUT/ab_table.md" > "$OUT/ab.log" 2>&1
        summary+=("ab rc=$?"); grep -v "^|" "$OUT/ab.log" ;;
    bench|bench-quick) # REPEATS=3: each backend timed three times in turn, medians kept; AB=VAR=V1,V2: fmha also under each value; SHAPES=a,b: those shapes only
        q=""; [ "$step" = bench-quick ] && q=--quick
        python3 bench/bench_cuda.py --lib build-gpu/libfmha.so $q ${SHAPES:+--shapes "$SHAPES"} --repeats "${REPEATS:-1}" ${AB:+--ab "$AB"} \
            --out "$OUT/bench_table.md" > "$OUT/bench.log" 2>&1
        summary+=("bench rc=$?"); cat "$OUT/bench.log" | grep -v "^|" ;;
    esac
done
printf '%s\n' "${summary[@]}"
