#!/usr/bin/env bash
# The real-size benchmark: checkpoints of the published E2B and E4B sizes
# (fixture --full-size), then every step a user takes with one, each timed
# with its peak resident memory, and one table at the end.
#
#   flock /tmp/chunkforge-heavy.lock scripts/realsize.sh SCRATCH [e2b e4b]
#
# SCRATCH must not exist or be empty: it holds one shape at a time (E2B:
# checkpoint 8.7 GiB, build 5.4 GB, release; E4B: 14 GiB, 11 GB, ...) and is
# removed as each shape is done. Too big for CI: an E2B pass takes about an
# hour on 2 cores, E4B longer. Options, as environment variables:
#   CHUNKFORGE          the binary            [target/release/chunkforge]
#   LAYOUT              package --layout      [two]
#   AUDIT_FLAGS         extra package flags   [--allow-audit-findings]: the audit
#                       refuses E2B-width packages today (last-axis-1 findings on
#                       the full-width head and per-layer projections), which
#                       `audit` reports in its own row.
#   KEEP                1 keeps SCRATCH/<shape> instead of removing it
set -uo pipefail

if [ $# -lt 1 ]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
scratch=$1
shift
if [ $# -gt 0 ]; then shapes=("$@"); else shapes=(e2b e4b); fi
cf=${CHUNKFORGE:-target/release/chunkforge}
layout=${LAYOUT:-two}
audit_flags=${AUDIT_FLAGS:---allow-audit-findings}
if [ ! -x "$cf" ]; then
    echo "error: $cf is not an executable (cargo build --release, or set CHUNKFORGE)" >&2
    exit 2
fi
cf=$(realpath "$cf")
if [ -e "$scratch" ] && [ -n "$(ls -A "$scratch" 2>/dev/null)" ]; then
    echo "error: $scratch exists and is not empty; give a new scratch folder" >&2
    exit 2
fi
mkdir -p "$scratch" || exit 2
table=$scratch/table.tsv
: >"$table"

# step SHAPE NAME COMMAND...: runs COMMAND (output in SCRATCH/SHAPE-NAME.log)
# and records "SHAPE NAME wall peak-MiB exit" (GNU time: %e seconds, %M kB;
# its last line, after any "Command exited with non-zero status N").
step() {
    local shape=$1 name=$2
    shift 2
    local log=$scratch/$shape-$name.log times=$scratch/$shape-$name.time
    echo "== $shape $name: $*" >&2
    /usr/bin/time -f '%e %M' -o "$times" "$@" >"$log" 2>&1
    local code=$? wall kb
    read -r wall kb < <(tail -n 1 "$times")
    printf '%s\t%s\t%s\t%s\t%s\n' "$shape" "$name" "$wall" "$((kb / 1024))" "$code" >>"$table"
    tail -n 3 "$log" >&2
    echo "-- $shape $name: ${wall}s, peak $((kb / 1024)) MiB, exit $code" >&2
    return $code
}

for shape in "${shapes[@]}"; do
    dir=$scratch/$shape
    mkdir -p "$dir"
    step "$shape" fixture "$cf" fixture --shape "$shape" --full-size --out "$dir/ckpt" || continue
    step "$shape" build "$cf" build --hf-dir "$dir/ckpt" --mode all --output "$dir/build" || continue
    step "$shape" audit "$cf" audit "$dir/build"
    "$cf" keygen --out "$dir/key" >/dev/null 2>&1
    step "$shape" package "$cf" package "$dir/build" --layout "$layout" --key "$dir/key.pem" \
        --output "$dir/release" $audit_flags
    step "$shape" parity "$cf" parity --hf-dir "$dir/ckpt" --mode all --steps 16 --prefill 8 \
        --artifacts "$dir/build" --report "$scratch/$shape-parity.json"
    if [ -d "$dir/release" ]; then
        step "$shape" run "$cf" run "$dir/release" --max-tokens 16
    fi
    du -sh "$dir"/* >&2
    [ "${KEEP:-0}" = 1 ] || rm -rf "$dir"
done

# One table: a row per step, wall time and peak RSS per shape.
echo
printf '| step |'
for shape in "${shapes[@]}"; do printf ' %s wall | %s peak RSS |' "${shape^^}" "${shape^^}"; done
echo
printf '|---|'
for _ in "${shapes[@]}"; do printf -- '---:|---:|'; done
echo
for name in fixture build audit package parity run; do
    printf '| `%s` |' "$name"
    for shape in "${shapes[@]}"; do
        row=$(awk -F'\t' -v s="$shape" -v n="$name" '$1 == s && $2 == n' "$table")
        if [ -z "$row" ]; then
            printf ' – | – |'
        else
            IFS=$'\t' read -r _ _ wall mib code <<<"$row"
            note=""
            [ "$code" != 0 ] && note=" (exit $code)"
            printf ' %s s%s | %s MiB |' "$wall" "$note" "$mib"
        fi
    done
    echo
done
echo
for shape in "${shapes[@]}"; do
    grep -h '^PARITY' "$scratch/$shape-parity.log" 2>/dev/null | sed "s/^/${shape^^} parity: /"
done
