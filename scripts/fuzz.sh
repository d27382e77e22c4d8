#!/usr/bin/env bash
# Runs chunkforge's cargo-fuzz targets (fuzz/), one at a time, each for
# SECONDS_PER_TARGET (default 600), and prints per target the executions count
# and the result. Needs the nightly toolchain (`rustup toolchain install
# nightly`); installs cargo-fuzz if missing. Too slow for CI; run it by hand.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]
#   FUZZ_TARGETS="verify_dir" scripts/fuzz.sh 60     # a subset
#
# Corpora grow under fuzz/corpus/<target> (only the seed-* files are in git);
# crashes, timeouts and OOMs land in fuzz/artifacts/<target>; full libFuzzer
# logs in fuzz/logs/<target>.log. Reproduce a finding with
#   cargo +nightly fuzz run -s none -a <target> fuzz/artifacts/<target>/<file>
# and turn it into a test in tests/fuzz_regressions.rs.
set -euo pipefail

secs="${1:-600}"
targets="${FUZZ_TARGETS:-manifest_parse signature_parse verify_dir safetensors_header zip_archive walk_tree manifest_paths}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz.sh: needs the nightly toolchain: rustup toolchain install nightly" >&2
    exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked || cargo +nightly install cargo-fuzz
fi

# chunkforge is safe Rust: no AddressSanitizer (about twice the executions per
# second); debug assertions on, so integer overflow panics.
flags=(-s none -a)
cargo +nightly fuzz build "${flags[@]}"

# Seeds: a real signed release (and its zip) made with the CLI from a small
# synthetic build folder (the shape of tests/release.rs's synthetic_build), and
# a small safetensors file. Made only for the targets (arguments) that have
# none yet, so committed seeds of the others stay as they are.
make_seeds() {
    local t
    t="$(mktemp -d)"
    trap 'rm -rf "$t"' RETURN
    cargo build --release
    local cf="$root/target/release/chunkforge"
    "$cf" keygen --out "$t/k" >/dev/null
    local b="$t/build" n
    for n in chunk1 chunk2 chunk3 chunk4; do
        mkdir -p "$b/$n.mlpackage/Data/com.apple.CoreML/weights"
        printf '{"name": "%s"}\n' "$n" >"$b/$n.mlpackage/Manifest.json"
        printf 'spec of %s\n' "$n" >"$b/$n.mlpackage/Data/com.apple.CoreML/model.mlmodel"
        printf 'weights of %s' "$n" >"$b/$n.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
    done
    # The real plan of the built-in checkpoint, in a build record with the
    # shipped settings (records.rs `BuildRecord`; no per-package records).
    "$cf" plan --mode four --json >"$t/plan.json"
    {
        printf '{"format": "chunkforge-build/1",\n'
        printf ' "tool": {"chunkforge": "0.1.0", "python": {"python": "3.11", "torch": "2.11.0", "coremltools": "9.0", "transformers": "5.5.0"}},\n'
        printf ' "checkpoint": {"dir": "/models/gemma-4-e2b-tiny", "architecture": "Gemma4ForCausalLM", "config_sha256": "00"},\n'
        printf ' "request": {"mode": "four", "ctx": 2048},\n'
        printf ' "settings": {"ctx": 2048, "minimum_deployment_target": "iOS18", "compute_precision": "FLOAT16", "compute_units": "CPU_AND_NE", "quantize": false, "palettization": null},\n'
        printf ' "plan": '
        cat "$t/plan.json"
        printf ',\n "chunks": []}\n'
    } >"$b/build.json"
    "$cf" package "$b" --layout four --key "$t/k.pem" --output "$t/rel" --version 1.0.0 \
        --base-url https://models.example.com/x --zip "$t/rel.zip" >/dev/null
    "$cf" verify "$t/rel" --public-key "$t/k.pub" --archive "$t/rel.zip" >/dev/null

    local target
    for target in "$@"; do
        mkdir -p "fuzz/corpus/$target"
        case "$target" in
        manifest_parse)
            cp "$t/rel/manifest.json" fuzz/corpus/manifest_parse/seed-release
            printf '{"format": "chunkforge-release/1", "files": [{"path": "a", "size": 0, "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}]}' \
                >fuzz/corpus/manifest_parse/seed-minimal
            ;;
        signature_parse)
            # First byte even = model.sig as is, odd = the payload (re-signed
            # with the target's fixed key).
            { printf '\0'; cat "$t/rel/model.sig"; } >fuzz/corpus/signature_parse/seed-bundle
            { printf '\1'; grep -o '"payload": "[^"]*"' "$t/rel/model.sig" | cut -d'"' -f4 | base64 -d; } \
                >fuzz/corpus/signature_parse/seed-statement
            ;;
        safetensors_header) safetensors_seed ;;
        zip_archive)
            # First byte even: the archive as is; odd: bytes decoded into
            # files the target zips itself.
            cp "$t/rel.zip" fuzz/corpus/zip_archive/seed-release
            { printf '\1'; cat "$t/rel/manifest.json"; } >fuzz/corpus/zip_archive/seed-files
            ;;
        esac
    done
}

# A small .safetensors file: two tensors and metadata.
safetensors_seed() {
    local h='{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]},"__metadata__":{"format":"pt"}}'
    local len=${#h}
    {
        printf "$(printf '\\x%02x\\x%02x' $((len & 255)) $((len >> 8)))"
        printf '\0\0\0\0\0\0'
        printf '%s' "$h"
        printf '0123456789ab'
    } >fuzz/corpus/safetensors_header/seed-small
}
need_seeds=()
for target in $targets; do
    case "$target" in
    verify_dir | walk_tree | manifest_paths) ;; # structured input (arbitrary::Arbitrary): starts from nothing
    *) ls fuzz/corpus/"$target"/seed-* >/dev/null 2>&1 || need_seeds+=("$target") ;;
    esac
done
if [ "${#need_seeds[@]}" -gt 0 ]; then
    make_seeds "${need_seeds[@]}"
fi

scratch="$(mktemp -d "${XDG_RUNTIME_DIR:-/tmp}/chunkforge-fuzz.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
mkdir -p fuzz/logs
summary=()
status=0
for target in $targets; do
    mkdir -p "fuzz/corpus/$target" "fuzz/artifacts/$target"
    log="fuzz/logs/$target.log"
    echo "== $target: ${secs}s" >&2
    # One process, in-process fuzzing (no -jobs/-workers: one core). -timeout
    # turns a hang into a finding; -rss_limit_mb an unbounded allocation.
    if TMPDIR="$scratch" cargo +nightly fuzz run "${flags[@]}" "$target" "fuzz/corpus/$target" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$log" 2>&1; then
        result="ok (no crash)"
    else
        result="FAILED: see $log and fuzz/artifacts/$target/"
        status=1
    fi
    execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)"
    if [ -z "$execs" ]; then
        execs="$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')"
    fi
    secs_run="$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | grep -o 'in [0-9]*' | tr -d 'in ' | tail -1)"
    corpus="$(find "fuzz/corpus/$target" -type f | wc -l)"
    line="$target: ${execs:-?} executions in ${secs_run:-?}s, corpus $corpus files: $result"
    echo "$line" >&2
    summary+=("$line")
    rm -rf "${scratch:?}"/*
done
echo
echo "fuzz summary (${secs}s per target):"
printf '  %s\n' "${summary[@]}"
exit "$status"
