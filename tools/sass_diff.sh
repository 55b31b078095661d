#!/bin/sh
# sass_diff.sh OLD.o NEW.o — the machine code of two builds of a CUDA object, kernel by kernel:
# instruction counts side by side, whether the instructions (addresses stripped) are the same,
# and registers and stack bytes (spills live there). Kernels are matched by demangled name, so
# an anonymous namespace's per-file hash does not matter. Needs cuobjdump (with nvdisasm), c++filt.
set -eu
[ $# -eq 2 ] || { echo "usage: $0 OLD.o NEW.o" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

short='s/(anonymous namespace):://g; s/^void //' # names, shorter

# split OBJ DIR: DIR/names, the kernels' demangled names in order; DIR/N, kernel N's instructions;
# DIR/res, "name<TAB>REG<TAB>STACK" a kernel.
split() {
    mkdir -p "$2"
    cuobjdump -sass "$1" | awk -v d="$2" '
        /Function : / { if (f) close(f); f = d "/" ++n; print $3 > (d "/names.raw"); printf "" > f; next }
        f && /^[ \t]+\/\*[0-9a-f]+\*\// {
            sub(/^[ \t]+\/\*[0-9a-f]+\*\/[ \t]*/, ""); sub(/[ \t]*\/\*.*$/, ""); print > f }'
    c++filt < "$2/names.raw" | sed "$short" > "$2/names"
    cuobjdump -res-usage "$1" | awk '
        /^ Function / { sub(/^ Function /, ""); sub(/:$/, ""); name = $0; next }
        name != "" && /REG:/ { reg = $1; stack = $2; sub(/REG:/, "", reg); sub(/STACK:/, "", stack);
                               print name "\t" reg "\t" stack; name = "" }' |
        c++filt | sed "$short" > "$2/res"
}
split "$1" "$tmp/a"
split "$2" "$tmp/b"

res() { awk -F'\t' -v k="$2" '$1 == k { print $2 "\t" $3; exit }' "$1/res"; }

printf '%7s %7s %5s %7s %7s  %s\n' old new same reg stack kernel
both=$(cat "$tmp/a/names" "$tmp/b/names" | awk '!seen[$0]++')
printf '%s\n' "$both" | while IFS= read -r name; do
    i=$(grep -nxF -- "$name" "$tmp/a/names" | head -1 | cut -d: -f1 || true)
    j=$(grep -nxF -- "$name" "$tmp/b/names" | head -1 | cut -d: -f1 || true)
    ca=-; cb=-; same=-
    [ -n "$i" ] && ca=$(wc -l < "$tmp/a/$i")
    [ -n "$j" ] && cb=$(wc -l < "$tmp/b/$j")
    if [ -n "$i" ] && [ -n "$j" ]; then
        if cmp -s "$tmp/a/$i" "$tmp/b/$j"; then same=yes; else same=NO; fi
    fi
    ra=$(res "$tmp/a" "$name"); rb=$(res "$tmp/b" "$name")
    reg="${ra%%	*}/${rb%%	*}"; stack="${ra##*	}/${rb##*	}"
    printf '%7s %7s %5s %7s %7s  %s\n' "$ca" "$cb" "$same" "$reg" "$stack" "$name"
done
