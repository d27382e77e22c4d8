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
#   LAYOUT              package --layout      [none: package's default, app,
#                       every layout within the 20-layer ceiling; E4B's
#                       merged_chunk1 holds 24 layers, so two is refused there]
#   AUDIT_FLAGS         extra package flags   [none: the audit finds nothing in
#                       E2B-size packages, so package must pass it as it stands]
#   FP16                0 skips the FP16 pass [1]: build --no-quantize of the
#                       four-chunk layout and its prefill and verify functions
#                       (what run needs; every layout's packages would not fit
#                       the disk at E4B size: 44 GB of FP16 build, 28 GB of
#                       release), package, run --prompt PROMPT --max-tokens 16,
#                       and transformers' greedy ids of the same prompt
#                       (scripts/oracle_greedy.py, layer by layer); the run's
#                       ids must equal them
#   PROMPT              the prompt [The quick brown fox]; the INT4 run takes
#                       its ids repeated to 64 tokens, then generates 64
#   BENCH               shapes that also run `bench run` (run, run before the
#                       kernels and transformers' generate, 16 tokens) [e2b]
#   KEEP                1 keeps SCRATCH/<shape> instead of removing it
# Each shape starts only if SCRATCH's disk has the room its pass needs
# (E2B about 27 GiB, E4B about 49 with FP16, 23 and 33 without); the exit
# status is 1 when a step failed, a shape was skipped or the ids differ.
set -uo pipefail

if [ $# -lt 1 ]; then
    sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
scratch=$1
shift
if [ $# -gt 0 ]; then shapes=("$@"); else shapes=(e2b e4b); fi
cf=${CHUNKFORGE:-target/release/chunkforge}
layout_flags=()
if [ -n "${LAYOUT:-}" ]; then layout_flags=(--layout "$LAYOUT"); fi
audit_flags=${AUDIT_FLAGS:-}
prompt=${PROMPT:-The quick brown fox}
if [ ! -x "$cf" ]; then
    echo "error: $cf is not an executable (cargo build --release, or set CHUNKFORGE)" >&2
    exit 2
fi
cf=$(realpath "$cf")
venv_py=$("$cf" doctor --venv-python)
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

# speeds SHAPE LOG: run's prefill and decode rates, from its --json in LOG.
speeds() {
    python3 - "$1" "$2" <<'PY' 2>/dev/null
import json, re, sys
text = open(sys.argv[2]).read()
start = re.search(r"^\{", text, re.M)
r = json.JSONDecoder().raw_decode(text[start.start():])[0]
print(f"{sys.argv[1].upper()} INT4 run: {r['prefill_tokens']}-token prompt through {r['prefill_function']} in "
      f"{r['prefill_seconds']:.2f} s, decode {r['decode_tokens_per_second']:.2f} tokens/s "
      f"({len(r['generated_ids'])} tokens, layout {r['layout']})")
PY
}

# ids_in LOG KEY: the id list under KEY of the JSON object in LOG (the
# command's output, among its notes).
ids_in() {
    python3 - "$1" "$2" <<'PY' 2>/dev/null
import json, re, sys
text = open(sys.argv[1]).read()
start = re.search(r"^\{", text, re.M)
print(json.JSONDecoder().raw_decode(text[start.start():])[0][sys.argv[2]] if start else "")
PY
}

# need_gib SHAPE: the scratch space a shape's pass needs at its fullest
# (measured with du: E2B's INT4 pass holds checkpoint, build and release,
# 8.7 + 5.4 + 6.2 GiB; E4B's 14 + 11 + 5.6 GiB. The FP16 pass holds the
# checkpoint, the FP16 four-chunk build (decode, verify and prefill
# packages) and its release, E2B 8.7 + 8.8 + 7.1 GiB, E4B 14 + 18 + 13 GiB
# estimated from E2B's), with 2 GiB to spare.
need_gib() {
    case "$1:${FP16:-1}" in
    e2b:1) echo 27 ;;
    e2b:*) echo 23 ;;
    e4b:1) echo 49 ;;
    *) echo 33 ;;
    esac
}

failed=0
for shape in "${shapes[@]}"; do
    dir=$scratch/$shape
    need=$(need_gib "$shape")
    free=$(df --output=avail -BG "$scratch" | tail -n 1 | tr -dc 0-9)
    if [ "$free" -lt "$need" ]; then
        echo "error: $scratch has ${free} GiB free; the $shape pass needs about ${need} GiB$([ "${FP16:-1}" = 1 ] && echo " (FP16=0 needs less)"): skipping $shape" >&2
        printf '%s\tfixture\t0\t0\tdisk\n' "$shape" >>"$table"
        continue
    fi
    mkdir -p "$dir"
    step "$shape" fixture "$cf" fixture --shape "$shape" --full-size --out "$dir/ckpt" || continue
    step "$shape" build "$cf" build --hf-dir "$dir/ckpt" --mode all --output "$dir/build" || continue
    step "$shape" audit "$cf" audit "$dir/build"
    "$cf" keygen --out "$dir/key" >/dev/null 2>&1
    step "$shape" package "$cf" package "$dir/build" "${layout_flags[@]}" --key "$dir/key.pem" \
        --output "$dir/release" $audit_flags
    step "$shape" parity "$cf" parity --hf-dir "$dir/ckpt" --mode all --steps 16 --prefill 8 \
        --artifacts "$dir/build" --report "$scratch/$shape-parity.json"
    if [ -d "$dir/release" ]; then
        # A 64-token prompt (PROMPT's ids repeated) through prefill, then 64 tokens.
        ids=$("$venv_py" -c 'import sys
from tokenizers import Tokenizer
ids = Tokenizer.from_file(sys.argv[1]).encode(sys.argv[2]).ids
print(",".join(str(t) for t in (ids * 64)[:64]))' "$dir/release/hf_model/tokenizer.json" "$prompt")
        step "$shape" run "$cf" run "$dir/release" --prompt-ids "$ids" --max-tokens 64 --json
        speeds "$shape" "$scratch/$shape-run.log" >>"$scratch/speeds.txt"
        if [[ " ${BENCH:-e2b} " == *" $shape "* ]]; then
            step "$shape" bench-run "$cf" bench run "$dir/release" --hf-dir "$dir/ckpt" \
                --prompt "$prompt" --prompt-tokens 64 --max-tokens 16
        fi
    fi
    if [ "${FP16:-1}" = 1 ]; then
        # The INT4 build and release make room for the FP16 ones: the
        # four-chunk layout (what run picks without the others) with its
        # verify and prefill functions.
        rm -rf "$dir/build" "$dir/release"
        step "$shape" build-fp16 "$cf" build --hf-dir "$dir/ckpt" --mode four --verify-k 3 \
            --prefill-len 512 --no-quantize --output "$dir/build-fp16" &&
            step "$shape" package-fp16 "$cf" package "$dir/build-fp16" "${layout_flags[@]}" \
                --key "$dir/key.pem" --output "$dir/release-fp16" $audit_flags &&
            step "$shape" run-fp16 "$cf" run "$dir/release-fp16" --prompt "$prompt" --max-tokens 16 --json &&
            step "$shape" oracle "$("$cf" doctor --venv-python)" "$(dirname "$0")/oracle_greedy.py" \
                "$dir/ckpt" "$prompt" 16
        got=$(ids_in "$scratch/$shape-run-fp16.log" generated_ids)
        want=$(ids_in "$scratch/$shape-oracle.log" generated)
        if [ -z "$got" ] || [ -z "$want" ]; then
            verdict="not compared: a step before it failed (its log is in $scratch)"
        elif [ "$got" = "$want" ]; then
            verdict="equal"
        else
            verdict="differ"
        fi
        [ "$verdict" = equal ] || failed=1
        printf '%s FP16 run: %s\n%s transformers: %s\n%s FP16 run vs transformers greedy ids: %s\n' \
            "${shape^^}" "$got" "${shape^^}" "$want" "${shape^^}" "$verdict" >>"$scratch/ids.txt"
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
for name in fixture build audit package parity run bench-run build-fp16 package-fp16 run-fp16 oracle; do
    printf '| `%s` |' "$name"
    for shape in "${shapes[@]}"; do
        row=$(awk -F'\t' -v s="$shape" -v n="$name" '$1 == s && $2 == n' "$table")
        if [ -z "$row" ]; then
            printf ' – | – |'
        else
            IFS=$'\t' read -r _ _ wall mib code <<<"$row"
            if [ "$code" = disk ]; then
                printf ' not run: too little disk | – |'
                continue
            fi
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
cat "$scratch/speeds.txt" 2>/dev/null
for shape in "${shapes[@]}"; do
    grep -h -A12 '^a [0-9]*-token prompt' "$scratch/$shape-bench-run.log" 2>/dev/null | sed "s/^/${shape^^} bench run: /"
done
cat "$scratch/ids.txt" 2>/dev/null
# Non-zero when a step failed, a shape was not run, or the FP16 ids differ.
awk -F'\t' '$5 != 0 { bad = 1 } END { exit bad }' "$table" || failed=1
exit "$failed"
