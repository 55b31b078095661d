#!/bin/sh
# test_cli.sh — the `fmha` command end to end: run on presets and files
# (padded and packed), --check, safetensors output, FP8 runs and the accuracy
# report, config checks, bench JSON,
# and the errors a user meets. Usage: test_cli.sh PATH/TO/fmha SOURCE_DIR
# (FMHA_TEST_QUICK=1 skips the one full-size run).
FMHA=${1:?usage: test_cli.sh FMHA SOURCE_DIR}
SRC=${2:-.}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
passed=0
failed=0

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# expect CODE PATTERN -- command...: exit status CODE and PATTERN in its output
expect() {
    code=$1 pattern=$2
    shift 3
    out=$("$@" 2>&1)
    rc=$?
    if [ "$rc" -ne "$code" ]; then
        bad "'$*' exited $rc, expected $code: $out"
    elif ! printf '%s' "$out" | grep -q -- "$pattern"; then
        bad "'$*' output lacks '$pattern': $out"
    else
        ok
    fi
}

# ---- info and help
expect 0 "backends: cpu" -- "$FMHA" info
expect 0 "flux-1024" -- "$FMHA" --help
expect 2 "unknown command" -- "$FMHA" frobnicate

# ---- presets on random data, checked against the reference
expect 0 "check (last 16 rows.*: ok" -- "$FMHA" run --model flux-1024 --seqlen 300 -o "$T/flux.safetensors"
[ -f "$T/flux.safetensors" ] && ok || bad "run --model -o wrote no file"
expect 0 "causal, kernel" -- "$FMHA" run --model llama3-8b --seqlen 200
expect 0 ": ok" -- "$FMHA" run --model lumina2 --seqlen 150 --dtype f32
expect 0 ": ok" -- "$FMHA" run --model wan-cross --seqlen 130 --dtype f16 --softcap 20
expect 0 ": ok" -- "$FMHA" run --model z-image-1024 --seqlen 100 --window-left 16 --window-right 4
expect 0 "check: skipped" -- "$FMHA" run --model flux-1024 --seqlen 64 --dropout 0.1 --seed 3
expect 2 "unknown preset" -- "$FMHA" run --model no-such-model
expect 0 "FMHA_STATUS_OK\|: ok" -- env FMHA_CPU_ISA=scalar "$FMHA" run --model flux-1024 --seqlen 40

# ---- on a terminal, a long run shows a progress bar (stderr). The run is the
# full Flux shape (the bar needs > 2e11 FLOP), minutes in a sanitizer build:
# FMHA_TEST_QUICK=1 (make asan-test, make tsan-test) leaves it out.
if [ -z "${FMHA_TEST_QUICK:-}" ] && command -v script >/dev/null 2>&1; then
    script -qec "$FMHA run --model flux-1024 --threads 2" /dev/null > "$T/tty.txt" 2>&1
    grep -q "\[####.*100%" "$T/tty.txt" && ok || bad "no progress bar on a terminal: $(cat "$T/tty.txt")"
fi
"$FMHA" run --model flux-1024 --seqlen 2048 2> "$T/notty.txt" >/dev/null
[ ! -s "$T/notty.txt" ] && ok || bad "progress output without a terminal: $(cat "$T/notty.txt")"

# ---- a file written by run runs again, whole, against the reference
expect 0 "all rows against the float64 reference.*: ok" -- "$FMHA" run "$T/flux.safetensors" --check -o "$T/again.safetensors"
[ -f "$T/again.safetensors" ] && ok || bad "run FILE -o wrote no file"
expect 0 ": ok" -- "$FMHA" run "$T/flux.safetensors" --check --causal --threads 1

# ---- a file records its run's options: a causal preset re-runs causal
expect 0 "wrote" -- "$FMHA" run --model llama3-8b --seqlen 100 -o "$T/llama.safetensors"
expect 0 "options from .*llama.safetensors's metadata: causal 1, window_left -1" -- "$FMHA" run "$T/llama.safetensors" --check -o "$T/llama_again.safetensors"
expect 0 "metadata: window_left -1" -- "$FMHA" run "$T/llama.safetensors" --no-causal --check
expect 0 "metadata: causal 0" -- "$FMHA" run "$T/flux.safetensors" --check
if command -v python3 >/dev/null 2>&1; then
    python3 - "$T/llama.safetensors" "$T/llama_again.safetensors" <<'EOF2' && ok || bad "re-run of a causal preset's file differs from its output"
import json, struct, sys
def tensor(path, name):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    b, e = h[name]["data_offsets"]
    return h["__metadata__"], raw[8 + n + b:8 + n + e]
meta, out1 = tensor(sys.argv[1], "out")
_, out2 = tensor(sys.argv[2], "out")
assert meta["fmha.causal"] == "1", meta
assert out1 == out2, "outputs differ"
EOF2
fi
python3 - "$T/llama.safetensors" "$T/badmeta.safetensors" <<'EOF2' 2>/dev/null
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
h["__metadata__"]["fmha.causal"] = "yes"
hb = json.dumps(h).encode()
hb += b" " * ((8 - len(hb) % 8) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
EOF2
[ -f "$T/badmeta.safetensors" ] && expect 1 "metadata fmha.causal = 'yes' is not a valid value" -- "$FMHA" run "$T/badmeta.safetensors" --check

# ---- non-finite inputs: reported by --check (which fails), refused by --check-finite
python3 - "$T/flux.safetensors" "$T/nan.safetensors" <<'EOF2' 2>/dev/null
import json, struct, sys
raw = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
b = h["k"]["data_offsets"][0]
raw[8 + n + b + 2 * 7:8 + n + b + 2 * 7 + 2] = b"\xc0\x7f"  # bf16 NaN at k[0, 0, 0, 7]
open(sys.argv[2], "wb").write(bytes(raw))
EOF2
if [ -f "$T/nan.safetensors" ]; then
    expect 1 "non-finite input: k holds 1 NaN/inf value (first k\[0, 0, 0, 7\] = nan)" -- "$FMHA" run "$T/nan.safetensors" --check
    expect 1 "check: FAILED: the inputs hold 1 non-finite values" -- env FMHA_CPU_ISA=avx2 "$FMHA" run "$T/nan.safetensors" --check
    expect 1 "non-finite outputs" -- env FMHA_CPU_ISA=scalar "$FMHA" run "$T/nan.safetensors" --check
    expect 1 "--check-finite: .*nan.safetensors holds 1 non-finite input values; nothing was run" -- "$FMHA" run "$T/nan.safetensors" --check-finite -o "$T/nan_out.safetensors"
    [ ! -e "$T/nan_out.safetensors" ] && ok || bad "--check-finite wrote an output"
    expect 0 "check-finite: q, k, v hold no NaN or inf" -- "$FMHA" run "$T/flux.safetensors" --check-finite
fi

# ---- packed (varlen) input made by hand: three sequences, one empty
if command -v python3 >/dev/null 2>&1; then
    python3 "$SRC/tests/make_packed.py" "$T/packed.safetensors" && ok || bad "make_packed.py failed"
    expect 0 "3 packed sequences" -- "$FMHA" run "$T/packed.safetensors" --check --causal -o "$T/packed_out.safetensors"
    python3 - "$T/packed_out.safetensors" <<'EOF' && ok || bad "packed output layout"
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
assert h["out"]["shape"] == [45, 4, 32], h["out"]
assert h["out"]["dtype"] == "F32"
assert h["lse"]["shape"] == [4, 45], h["lse"]
EOF
else
    echo "python3 missing: packed-input checks skipped"
fi

# ---- bad input: clear errors, no output file
expect 1 "cannot read" -- "$FMHA" run "$T/missing.safetensors" -o "$T/x.safetensors"
head -c 100 "$T/flux.safetensors" > "$T/truncated.safetensors"
expect 1 "cannot read" -- "$FMHA" run "$T/truncated.safetensors" -o "$T/x.safetensors"
[ ! -e "$T/x.safetensors" ] && ok || bad "an output file appeared after a failed run"
expect 2 "needs -o" -- "$FMHA" run "$T/flux.safetensors"

# ---- an output that would destroy something is refused before the run
cp "$T/flux.safetensors" "$T/keep.safetensors"
expect 2 "is the same file as input.*give another output path" -- "$FMHA" run "$T/keep.safetensors" -o "$T/keep.safetensors"
ln -s "$T/keep.safetensors" "$T/keep_link.safetensors"
ln "$T/keep.safetensors" "$T/keep_hard.safetensors"
expect 2 "same file as input" -- "$FMHA" run "$T/keep.safetensors" -o "$T/keep_link.safetensors"
expect 2 "same file as input" -- "$FMHA" run "$T/keep_link.safetensors" -o "$T/keep_hard.safetensors"
cmp -s "$T/flux.safetensors" "$T/keep.safetensors" && ok || bad "run FILE -o FILE changed its input"
# (a FIFO stands for /dev/null, which a broken build run as root would replace)
mkfifo "$T/fifo"
expect 2 "fifo exists and is a FIFO, not a regular file" -- "$FMHA" run --model flux-1024 --seqlen 32 -o "$T/fifo"
[ -p "$T/fifo" ] && ok || bad "the FIFO was replaced by a file"
mkdir "$T/outdir"
expect 2 "is a directory, not a regular file" -- "$FMHA" run --model flux-1024 --seqlen 32 -o "$T/outdir"
if "$FMHA" info | grep -q "^gpu 0"; then
    expect 0 ": ok" -- "$FMHA" run --model flux-1024 --seqlen 300 --device cuda
else
    expect 1 "CUDA" -- "$FMHA" run --model flux-1024 --seqlen 32 --device cuda
    expect 1 "use device cpu" -- "$FMHA" run --model flux-1024 --seqlen 32 --dtype fp8 --device cuda
fi
expect 1 "dropout_p (1.5) must be in \[0, 1)" -- "$FMHA" run --model flux-1024 --seqlen 32 --dropout 1.5
expect 2 "not an integer" -- "$FMHA" run --model flux-1024 --seqlen abc

# ---- every numeric flag: range-checked, the flag, value and range named
expect 2 "--iters 2147483648 is out of range: allowed 1 to 1000000" -- "$FMHA" bench --seqlen 64 --heads 1 --head-dim 32 --iters 2147483648
expect 2 "--iters -1 is out of range" -- "$FMHA" bench --seqlen 64 --iters -1
expect 2 "--threads 4294967297 is out of range: allowed 0 to 4096" -- "$FMHA" run --model flux-1024 --seqlen 32 --threads 4294967297
expect 2 "--seqlen 99999999999999999999 is out of range: allowed 1 to 2147483647" -- "$FMHA" run --model flux-1024 --seqlen 99999999999999999999
expect 2 "--seqlen-k 2147483648 is out of range" -- "$FMHA" bench --seqlen 64 --seqlen-k 2147483648
expect 2 "--batch 0 is out of range: allowed 1 to" -- "$FMHA" run --model flux-1024 --batch 0
expect 2 "--heads 65537 is out of range: allowed 1 to 65536" -- "$FMHA" bench --heads 65537
expect 2 "--kv-heads 0 is out of range" -- "$FMHA" bench --kv-heads 0
expect 2 "--head-dim 9223372036854775807 is out of range" -- "$FMHA" bench --head-dim 9223372036854775807
expect 2 "--window-left -2 is out of range: allowed -1 to" -- "$FMHA" run --model flux-1024 --window-left -2
expect 2 "--window-right '1e3' is not an integer (allowed: -1 to" -- "$FMHA" run --model flux-1024 --window-right 1e3
expect 2 "--seed '-1' is not an unsigned integer" -- "$FMHA" run --model flux-1024 --seed -1
expect 2 "--seed 18446744073709551616 is out of range" -- "$FMHA" run --model flux-1024 --seed 18446744073709551616
expect 0 ": ok" -- "$FMHA" run --model flux-1024 --seqlen 32 --seed 18446744073709551615
expect 2 "--scale 'inf' is not a finite number" -- "$FMHA" run --model flux-1024 --scale inf
expect 1 "q \[2147483647, 2147483647, 16, 128\] has more than 2^60 elements" -- "$FMHA" bench --batch 2147483647 --seqlen 2147483647
expect 1 "has more than 2^60 elements" -- "$FMHA" run --model llama3-8b --batch 2147483647 --seqlen 2147483647
expect 0 "GFLOP/s" -- "$FMHA" bench --seqlen 64 --heads 1 --head-dim 32 --iters 300
expect 0 "bf16  cpu_[a-z0-9]*_f32_bwd .* the forward" -- "$FMHA" bench --seqlen 70 --heads 3 --kv-heads 1 --head-dim 40 --iters 2 --backward --causal
expect 0 "fwd+bwd" -- "$FMHA" bench --seqlen 33 --heads 2 --head-dim 16 --iters 2 --backward --dtype f16
expect 2 "FP8 attention has no backward" -- "$FMHA" bench --seqlen 33 --iters 2 --backward --dtype fp8
expect 1 "FMHA_CPU_ISA=sse9" -- env FMHA_CPU_ISA=sse9 "$FMHA" run --model flux-1024 --seqlen 32

# ---- FP8: a bf16 source quantized per tensor, checked on the dequantized inputs
expect 0 "on the dequantized inputs.*: ok" -- "$FMHA" run --model flux-1024 --seqlen 130 --dtype fp8 -o "$T/fp8.safetensors"
expect 0 "quantization included): relative L2" -- "$FMHA" run --model llama3-8b --seqlen 100 --dtype fp8
expect 0 "fp8 path: fp8_compute: q, k, v (bf16) quantized" -- "$FMHA" run "$T/fp8.safetensors" --dtype fp8 --check
expect 0 "dequantized inputs.*: ok" -- "$FMHA" run "$T/fp8.safetensors" --dtype fp8 --check
expect 0 "fp8 path: FP8 attention is unavailable.*FMHA_FP8_ATTN=0" -- env FMHA_FP8_ATTN=0 "$FMHA" run "$T/fp8.safetensors" --dtype fp8 --check
expect 0 "fp8q  cpu_" -- "$FMHA" bench --seqlen 70 --heads 2 --head-dim 64 --iters 2 --dtype fp8
expect 0 "K outliers (4 ch. x20-x100)  per 128-token block" -- "$FMHA" accuracy --seqlen 70 --heads 2 --kv-heads 1 --head-dim 32
expect 0 "K offsets (4 ch. +20-+100)   per tensor, K smoothed" -- "$FMHA" accuracy --seqlen 70 --heads 2 --kv-heads 1 --head-dim 32
expect 2 "accuracy takes no input file" -- "$FMHA" accuracy "$T/fp8.safetensors"

# ---- model configs
cat > "$T/llama.json" <<'EOF'
{"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
EOF
cat > "$T/bad_gqa.json" <<'EOF'
{"num_attention_heads": 28, "num_key_value_heads": 6, "head_dim": 128}
EOF
cat > "$T/wan.json" <<'EOF'
{"_class_name": "WanTransformer3DModel", "num_attention_heads": 40, "attention_head_dim": 128}
EOF
cat > "$T/more_kv.json" <<'EOF'
{"num_attention_heads": 8, "num_key_value_heads": 16, "head_dim": 64}
EOF
cat > "$T/hidden.json" <<'EOF'
{"num_attention_heads": 16, "head_dim": 64, "hidden_size": 2000}
EOF
expect 0 "num_kv_heads 8 (GQA), head_dim 128" -- "$FMHA" check "$T/llama.json"
expect 0 "num_heads 40, num_kv_heads 40 (MHA), head_dim 128" -- "$FMHA" check "$T/wan.json"
expect 1 "num_heads (28) must be a multiple of num_kv_heads (6): each KV head serves an equal group of query heads" -- "$FMHA" check "$T/bad_gqa.json"
expect 1 "16" -- "$FMHA" check "$T/more_kv.json"
expect 1 "2000" -- "$FMHA" check "$T/hidden.json"
expect 1 "" -- "$FMHA" check "$T/missing.json"
cat > "$T/huge.json" <<'EOF2'
{"num_attention_heads": 9007199254740992, "head_dim": 128}
EOF2
expect 1 "num_attention_heads is 9007199254740992, too large: at most 2147483647" -- "$FMHA" check "$T/huge.json"

# ---- bench: one JSON object per case with the agreed keys
if command -v python3 >/dev/null 2>&1; then
    "$FMHA" bench --seqlen 130 --heads 2 --head-dim 64 --iters 2 --json > "$T/bench.json" 2>&1
    python3 - "$T/bench.json" <<'EOF' && ok || bad "bench --json output: $(cat "$T/bench.json")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert len(rows) == 2, rows
for r in rows:
    for key in ("shape", "device", "dtype", "ms", "tflops"):
        assert key in r, key
    assert r["device"] == "cpu" and r["ms"] > 0 and r["tflops"] > 0
assert {r["dtype"] for r in rows} == {"f32", "bf16"}
EOF
    "$FMHA" bench --seqlen 70 --heads 2 --head-dim 64 --iters 2 --dtype fp8 --json > "$T/bench8.json" 2>&1
    python3 - "$T/bench8.json" <<'EOF' && ok || bad "bench --dtype fp8 --json: $(cat "$T/bench8.json")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
got = [(r["dtype"], r.get("fp8_compute")) for r in rows]
assert got == [("f8_e4m3", None), ("bf16", "per_tensor")], got
assert all(r["kernel"].endswith("_f32") and r["ms"] > 0 for r in rows)
EOF
fi
expect 0 "GFLOP/s" -- "$FMHA" bench --model lumina2 --seqlen 96 --dtype bf16 --causal --iters 2

# ---- sequence parallelism: communicators in info, the cost model, the
# options that need mpirun (tests/test_cli_mpi.sh runs them there)
expect 0 "sequence parallelism: mpi" -- "$FMHA" info
expect 0 "mpirun -np N fmha run ... --sp-ulysses U --sp-ring R" -- "$FMHA" --help
expect 2 "sp-ring 2.*\(not started by mpirun\|built without\)" -- "$FMHA" run --model flux-1024 --seqlen 32 --sp-ring 2
expect 0 ": ok" -- "$FMHA" run --model flux-1024 --seqlen 32 --sp-ulysses 1 --sp-ring 1
expect 2 "--sp-ring 0 is out of range: allowed 1 to 65536" -- "$FMHA" bench --sp-ring 0
expect 2 "options of run and bench" -- "$FMHA" accuracy --sp-ulysses 2
expect 0 "best: ulysses 8 x ring 1, .* 95.4% efficiency" -- "$FMHA" sp-plan --model wan2.1-14b-720p
expect 0 "16 .*8 x 2 .*heads do not split" -- "$FMHA" sp-plan --model wan2.1-14b-720p --devices 8,16
expect 0 "heads 24 / kv heads 24 do not split over ulysses 16" -- "$FMHA" sp-plan --model hunyuanvideo-720p --devices 32
expect 2 "expected an integer in \\[1, 65536\\]" -- "$FMHA" sp-plan --heads 0 --seqlen 10
expect 2 "give --model PRESET or --heads and --seqlen" -- "$FMHA" sp-plan
expect 2 "fractions of a bandwidth" -- "$FMHA" sp-plan --model flux-1024 --a2a-eff 1.5
expect 2 "fractions of a bandwidth" -- "$FMHA" sp-plan --model flux-1024 --merge-eff 1.2

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
