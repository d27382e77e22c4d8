#!/usr/bin/env bash
# Debian packages chunkforge needs beyond the base image (idempotent; quick
# when everything is present). Python packages are installed by chunkforge
# itself into its cached virtual environment.
set -euo pipefail
need=()
command -v cargo >/dev/null || { echo "error: cargo (Rust toolchain) is required: https://rustup.rs" >&2; exit 1; }
command -v cc >/dev/null || need+=(gcc)
command -v openssl >/dev/null || need+=(openssl)
if ((${#need[@]})); then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq "${need[@]}"
    else
        echo "error: please install: ${need[*]}" >&2; exit 1
    fi
fi
