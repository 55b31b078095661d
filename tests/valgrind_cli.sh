#!/bin/sh
# valgrind_cli.sh — the `fmha` command under valgrind's memcheck: invalid
# reads and writes, uses of uninitialized values and definite leaks, on the
# normal (Release) build, in a few commands that between them go through the
# CLI's parsers and writers, the library's layer and CPU kernels on 1 and 2
# threads, and the error paths that free half-built state.
# Usage: valgrind_cli.sh PATH/TO/fmha SOURCE_DIR
FMHA=${1:?usage: valgrind_cli.sh FMHA SOURCE_DIR}
SRC=${2:-.}
command -v valgrind >/dev/null 2>&1 || {
    echo "valgrind not found (Debian: valgrind)"
    exit 1
}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
passed=0
failed=0

# Exit status 99 is memcheck's (any error, or a definite leak), apart from the
# command's own 0, 1 or 2. "Possibly lost" blocks (reached only through a
# pointer into their middle) are reported but do not fail; tests/valgrind.supp
# hides the one such report that is not fmha's (libgomp's pool threads).
VG="valgrind --quiet --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite
    --track-origins=yes --suppressions=$SRC/tests/valgrind.supp"

# vg CODE -- command...: the command, under memcheck, exits CODE; on failure
# its output and memcheck's report are printed.
vg() {
    code=$1
    shift 2
    # shellcheck disable=SC2086 # VG is a list of words
    $VG "$@" > "$T/log" 2>&1
    rc=$?
    if [ "$rc" -eq "$code" ]; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        echo "FAIL: '$*' exited $rc under valgrind, expected $code (99: memcheck found errors):"
        cat "$T/log"
    fi
}

vg 0 -- "$FMHA" info
vg 2 -- "$FMHA" run --frobnicate
vg 2 -- "$FMHA" run --model flux-1024 --seqlen abc
# Presets, small: one thread, then two (GQA, causal, batch 2); the scalar kernel.
vg 0 -- "$FMHA" run --model flux-1024 --seqlen 64 --threads 1 -o "$T/flux.safetensors"
vg 0 -- "$FMHA" run --model llama3-8b --batch 2 --seqlen 48 --threads 2
vg 0 -- env FMHA_CPU_ISA=scalar "$FMHA" run --model lumina2 --seqlen 40 --dtype f32 --softcap 20 --threads 2
# The safetensors round trip: the file written above, read, run and written again.
vg 0 -- "$FMHA" run "$T/flux.safetensors" --check --threads 2 -o "$T/again.safetensors"
vg 0 -- "$FMHA" run "$T/flux.safetensors" --check --causal --threads 1
# FP8 on a file: the layer quantizes q, k, v into scratch it owns.
vg 0 -- "$FMHA" run "$T/flux.safetensors" --dtype fp8 --check --threads 2
# Every FP8 scale layout and fp8_smooth_k. (Not bench: it times itself for
# seconds of wall clock per case and measures the peak, minutes under memcheck.)
vg 0 -- "$FMHA" accuracy --seqlen 70 --heads 2 --kv-heads 1 --head-dim 32 --threads 2
if command -v python3 >/dev/null 2>&1; then
    python3 "$SRC/tests/make_packed.py" "$T/packed.safetensors"
    vg 0 -- "$FMHA" run "$T/packed.safetensors" --check --causal -o "$T/packed_out.safetensors"
fi
# Errors after a file or a config has been read in part.
vg 1 -- "$FMHA" run "$T/missing.safetensors" -o "$T/x.safetensors"
head -c 100 "$T/flux.safetensors" > "$T/truncated.safetensors"
vg 1 -- "$FMHA" run "$T/truncated.safetensors" -o "$T/x.safetensors"
vg 2 -- "$FMHA" run "$T/flux.safetensors" -o "$T/flux.safetensors"
cat > "$T/llama.json" <<'EOF'
{"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
EOF
cat > "$T/bad_gqa.json" <<'EOF'
{"num_attention_heads": 28, "num_key_value_heads": 6, "head_dim": 128}
EOF
vg 0 -- "$FMHA" check "$T/llama.json"
vg 1 -- "$FMHA" check "$T/bad_gqa.json"
vg 1 -- "$FMHA" check "$T/missing.json"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
