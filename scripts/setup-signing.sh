#!/usr/bin/env bash
# The independent OpenSSF model signing tool (PyPI `model-signing`) in its own
# virtual environment, for the cross-checks in tests/release.rs and for
# `chunkforge bench hash`. Idempotent: a stamp file records the pins, so a
# second run with the same pins returns at once. Prints nothing on success
# unless it had to install.
set -euo pipefail
cache="${CHUNKFORGE_CACHE:-$HOME/.cache/chunkforge}"
venv="$cache/signing-venv"
# model-signing 1.1.1 imports OpenSSL (pyopenssl) for certificate handling even
# when signing with a plain key; it does not declare it, so it is pinned here.
pins=("model-signing==1.1.1" "pyopenssl==25.3.0" "jsonschema==4.25.1")
stamp="$venv/.chunkforge-pins"
want="${pins[*]}"
if [ -x "$venv/bin/model_signing" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
py="${PYO3_PYTHON:-}"
if [ -z "$py" ]; then
    for c in python3.11 python3; do
        if command -v "$c" >/dev/null; then py="$c"; break; fi
    done
fi
[ -n "$py" ] || { echo "error: no python3 found for $venv" >&2; exit 1; }
echo "setting up $venv (${pins[*]})" >&2
mkdir -p "$cache"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
echo "$want" > "$stamp"
