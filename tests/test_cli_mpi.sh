#!/bin/sh
# test_cli_mpi.sh — `mpirun -np N fmha run|bench --sp-ulysses U --sp-ring R`
# end to end on 2 and 4 CPU ranks: Ulysses, ring and both, MHA and GQA,
# causal (zigzag tokens too), dropout, joint text tokens front and rear, a
# file in and out, packed sequences,
# the gathered output checked by the command against one process's forward
# (and the float64 reference), bench's bytes per rank; and the refusals (U x
# R not the ranks, no mpirun, heads that U does not divide, cross-attention
# padded or packed, packed offsets past the tensors, joint tokens that are
# the whole sequence, packed, without mpirun or misspelt, a rank that fails
# alone), each printed once, by rank 0, with every rank exiting non-zero.
# Usage: test_cli_mpi.sh FMHA MPIEXEC NUMPROC_FLAG [MPIEXEC FLAGS...]
FMHA=${1:?usage: test_cli_mpi.sh FMHA MPIEXEC NUMPROC_FLAG [FLAGS...]}
MPIEXEC=${2:?}
NP=${3:?}
shift 3
FLAGS="$*"
SRC=$(cd "$(dirname "$0")/.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
passed=0
failed=0
# A hang fails the test instead of stalling it.
TIMEOUT=
command -v timeout >/dev/null 2>&1 && TIMEOUT="timeout 120"

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# mpi N ARGS...: fmha ARGS on N ranks, one OpenMP thread each.
mpi() {
    n=$1
    shift
    # shellcheck disable=SC2086 # FLAGS and TIMEOUT are word lists
    $TIMEOUT "$MPIEXEC" $NP "$n" $FLAGS -x OMP_NUM_THREADS=1 "$FMHA" "$@"
}

# ranks CODE -- command...: the command exits CODE (mpirun's status is the
# first failed rank's); its output is kept for `has`.
ranks() {
    code=$1
    shift 2
    what="$*"
    out=$("$@" 2>&1)
    rc=$?
    [ "$rc" -eq "$code" ] && ok || bad "'$what' exited $rc, expected $code: $out"
}

# has PATTERN: the last command's output holds PATTERN on exactly one line
# (printed by rank 0 alone).
has() {
    n=$(printf '%s\n' "$out" | grep -c -- "$1")
    [ "$n" -eq 1 ] && ok || bad "'$what': '$1' on $n lines, not 1: $out"
}

SP_OK="all rows against one process's forward).*: ok"
LSE_OK="check (lse, all rows against one process's).*: ok"

# ---- 2 ranks: Ulysses, ring, GQA + causal, dropout, a file in and out
ranks 0 -- mpi 2 run --model flux-1024 --seqlen 100 --sp-ulysses 2
has "ulysses 2 x ring 1 on 2 CPU ranks"
has "$SP_OK"
has "$LSE_OK"
ranks 0 -- mpi 2 run --model llama3-8b --seqlen 77 --sp-ring 2 --dtype f32
has "$SP_OK"
has "$LSE_OK"
ranks 0 -- mpi 2 run --model flux-1024 --seqlen 63 --sp-ring 2 --dropout 0.1 --seed 3
has "$SP_OK"
ranks 0 -- mpi 2 run --model llama3-8b --seqlen 83 --sp-ring 2 --sp-layout zigzag --dtype f32
has "ulysses 1 x ring 2 on 2 CPU ranks, zigzag tokens"
has "$SP_OK"
has "$LSE_OK"
# Joint text tokens (--sp-joint): every rank holds them, front or rear; the
# whole output, text rows included, against one process's forward.
ranks 0 -- mpi 2 run --model flux-1024 --seqlen 100 --sp-ulysses 2 --sp-joint front:13
has "ulysses 2 x ring 1 on 2 CPU ranks, 13 text tokens at the front"
has "$SP_OK"
has "$LSE_OK"
ranks 0 -- mpi 2 run --model llama3-8b --seqlen 83 --sp-ring 2 --sp-layout zigzag --sp-joint rear:9 --dtype f32
has "zigzag tokens, 9 text tokens at the rear"
has "$SP_OK"
has "$LSE_OK"
"$FMHA" run --model lumina2 --seqlen 90 --causal -o "$T/in.safetensors" >/dev/null 2>&1
ranks 0 -- mpi 2 run "$T/in.safetensors" --check --sp-ring 2 -o "$T/out.safetensors"
has "all rows against the float64 reference.*: ok"
has "$SP_OK"
[ -f "$T/out.safetensors" ] && ok || bad "mpirun run IN -o OUT wrote no OUT"

# ---- packed sequences (20, 0, 1 and 37 tokens; GQA 4/2): each sequence
# sharded on its own, zigzag and causal, and with the heads split too
if command -v python3 >/dev/null 2>&1; then
    python3 "$SRC/tests/make_packed.py" "$T/packed.safetensors" self && ok || bad "make_packed.py self"
    ranks 0 -- mpi 2 run "$T/packed.safetensors" --check --causal --sp-ring 2 --sp-layout zigzag -o "$T/packed_out.safetensors"
    has "4 packed sequences, q \[58, 4, 32\]"
    has "all rows against the float64 reference.*: ok"
    has "$SP_OK"
    has "$LSE_OK"
    [ -f "$T/packed_out.safetensors" ] && ok || bad "packed run -o OUT wrote no OUT"
    python3 "$SRC/tests/make_packed.py" "$T/cross.safetensors" && ok || bad "make_packed.py"
    ranks 1 -- mpi 2 run "$T/cross.safetensors" --sp-ring 2 -o "$T/cross_out.safetensors"
    has "cu_seqlens_q\[1\] = 20 and cu_seqlens_k\[1\] = 25 differ (cross-attention)"
    [ ! -e "$T/cross_out.safetensors" ] && ok || bad "a refused packed run wrote its OUT"
    ranks 1 -- mpi 2 run "$T/packed.safetensors" --sp-ring 2 --sp-joint front:4 -o "$T/pj.safetensors"
    has "fmha: --sp-joint: packed sequences take no joint tokens"
    [ ! -e "$T/pj.safetensors" ] && ok || bad "a refused joint run wrote its OUT"
    python3 "$SRC/tests/make_packed.py" "$T/past.safetensors" past && ok || bad "make_packed.py past"
    ranks 1 -- mpi 2 run "$T/past.safetensors" --sp-ring 2 -o "$T/past_out.safetensors"
    has "cu_seqlens_q\\[4\\] = 60: packed offsets start at 0, never decrease and end at the 58 tokens of q"
    [ ! -e "$T/past_out.safetensors" ] && ok || bad "a refused packed run wrote its OUT"
fi

# ---- bench: the slowest rank's time, the bytes each rank sent (the ring's
# one K/V block: 65 tokens x 2 heads x 64 x 2 tensors, in f32 and bf16)
if command -v python3 >/dev/null 2>&1; then
    mpi 2 bench --seqlen 130 --heads 2 --head-dim 64 --iters 2 --sp-ring 2 --json > "$T/bench.json" 2>&1
    python3 - "$T/bench.json" <<'EOF2' && ok || bad "mpirun bench --json: $(cat "$T/bench.json")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert [r["dtype"] for r in rows] == ["f32", "bf16"], rows
for r, block in zip(rows, (66560, 33280)):
    assert (r["ranks"], r["ulysses"], r["ring"]) == (2, 1, 2), r
    assert r["bytes_sent_per_rank"] == [block, block] and r["bytes_sent_max"] == block, r
    assert r["ms"] > 0 and r["tflops"] > 0
EOF2
fi

# ---- 4 ranks: both at once, GQA with the KV heads split
ranks 0 -- mpi 4 run --model flux-1024 --seqlen 90 --sp-ulysses 2 --sp-ring 2
has "^flux-1024 (Flux.1, 1024x1024): q \[1, 90, 24, 128\]"
has "ulysses 2 x ring 2 on 4 CPU ranks"
has "$SP_OK"
has "$LSE_OK"
ranks 0 -- mpi 4 run --model lumina2 --seqlen 70 --causal --sp-ulysses 4
has "$SP_OK"
ranks 0 -- mpi 4 run --model llama3-8b --seqlen 50 --sp-ulysses 2 --sp-ring 2 --dtype f16
has "$SP_OK"
ranks 0 -- mpi 4 run --model llama3-8b --seqlen 61 --sp-ring 4 --sp-layout zigzag
has "$SP_OK"
ranks 0 -- mpi 4 run --model flux-1024 --seqlen 61 --sp-ulysses 2 --sp-ring 2 --sp-joint front:5 --dropout 0.1 --seed 4
has "$SP_OK"
has "$LSE_OK"
if [ -f "$T/packed.safetensors" ]; then
    ranks 0 -- mpi 4 run "$T/packed.safetensors" --causal --sp-ulysses 2 --sp-ring 2 -o "$T/p4.safetensors"
    has "$SP_OK"
    has "$LSE_OK"
    ranks 0 -- mpi 4 run "$T/packed.safetensors" --sp-ulysses 4 -o "$T/p4.safetensors"
    has "$SP_OK"
fi

# ---- refusals, printed once. On 4 ranks: Open MPI's mpirun takes a second
# or two more to end 2 ranks that exit non-zero.
ranks 2 -- "$FMHA" run --model flux-1024 --seqlen 64 --sp-ring 2
has "fmha: --sp-ulysses 1 x --sp-ring 2 = 2 ranks, but this is a single process (not started by mpirun): run .mpirun -np 2 fmha run"
ranks 2 -- mpi 4 run --model flux-1024 --seqlen 64 --sp-ulysses 2
has "fmha: --sp-ulysses 2 x --sp-ring 1 = 2, but mpirun started 4 ranks: give --sp-ulysses U --sp-ring R with U x R = 4"
ranks 2 -- mpi 4 bench --seqlen 64
has "(the defaults) = 1, but mpirun started 4 ranks"
ranks 1 -- mpi 4 run --model z-image-1024 --seqlen 64 --sp-ulysses 4
has "num_heads (30) is not divisible by ulysses (4)"
ranks 1 -- mpi 4 run --model wan-cross --seqlen 64 --sp-ring 4
has "but q has 64 tokens and k, v 512 (cross-attention)"
ranks 1 -- mpi 2 run --model flux-1024 --seqlen 64 --sp-ring 2 --sp-joint rear:64
has "fmha: --sp-joint rear:64: the text tokens must be fewer than the sequence's 64"
ranks 2 -- "$FMHA" run --model flux-1024 --seqlen 64 --sp-joint front:8
has "fmha: --sp-joint splits the tokens of a sequence-parallel run"
ranks 2 -- "$FMHA" run --model flux-1024 --seqlen 64 --sp-joint middle:8
has "sp-joint 'middle:8' is neither front:N nor rear:N"
# A rank that fails alone (its input file is missing): rank 0 says which.
# shellcheck disable=SC2086
ranks 1 -- $TIMEOUT "$MPIEXEC" $FLAGS -x OMP_NUM_THREADS=1 \
    $NP 3 "$FMHA" run "$T/in.safetensors" --check --sp-ring 4 : \
    $NP 1 "$FMHA" run "$T/missing.safetensors" --check --sp-ring 4
has "fmha: rank 3 of 4: cannot read .*missing.safetensors"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
