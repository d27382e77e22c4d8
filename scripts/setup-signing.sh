#!/usr/bin/env bash
# The independent OpenSSF model signing tool (PyPI `model-signing`) in its own
# virtual environment, for the cross-checks in tests/release.rs and for
# `chunkforge bench hash`. Idempotent: a stamp file records the pins, so a
# second run with the same pins returns at once. Prints nothing on success
# unless it had to install.
set -euo pipefail
die() { echo "error: $*" >&2; exit 1; }
how="set CHUNKFORGE_CACHE to an absolute path of a folder only you can write"
# The cache folder and its safety rules, exactly as src/cache_dir.rs decides
# them: CHUNKFORGE_CACHE (absolute), else an absolute XDG_CACHE_HOME, else an
# absolute HOME; a new folder is private; one that another user owns or can
# write to (or could replace, through a world-writable non-sticky parent) is
# refused, since this venv's Python is run by the tests and `bench hash`.
if [ -n "${CHUNKFORGE_CACHE+set}" ]; then
    [[ "$CHUNKFORGE_CACHE" == /* ]] || die "cannot place the cache folder: CHUNKFORGE_CACHE is \`$CHUNKFORGE_CACHE\`, not an absolute path; $how"
    cache="$CHUNKFORGE_CACHE"
elif [[ "${XDG_CACHE_HOME:-}" == /* ]]; then
    cache="$XDG_CACHE_HOME/chunkforge"
elif [[ "${HOME:-}" == /* ]]; then
    cache="$HOME/.cache/chunkforge"
else
    if [ -z "${HOME+set}" ]; then home="unset"
    elif [ -z "$HOME" ]; then home="empty"
    else home="\`$HOME\`, not an absolute path"; fi
    die "cannot place the cache folder: CHUNKFORGE_CACHE and XDG_CACHE_HOME are unset (or not absolute) and HOME is $home; $how"
fi
refuse() { die "$cache: refusing to use this cache folder: $*; $how"; }
me="$(id -u)"
# $1 and every folder above it (resolved) belong to this user or root and are
# not writable by everyone unless sticky: else someone could replace the cache.
check_from() {
    local dir owner mode
    dir="$(cd "$1" && pwd -P)"
    while :; do
        read -r owner mode < <(stat -Lc '%u %a' "$dir")
        mode=$((8#$mode))
        [ "$owner" = "$me" ] || [ "$owner" = 0 ] || refuse "the folder above it, $dir, belongs to uid $owner, who could replace the cache folder"
        (( (mode & 8#002) == 0 || (mode & 8#1000) != 0 )) || refuse "the folder above it, $dir, is writable by everyone (mode $(printf %04o "$mode")) and not sticky, so anyone could replace the cache folder"
        [ "$dir" = / ] && break
        dir="$(dirname "$dir")"
    done
}
if [ ! -e "$cache" ]; then
    # The folders it would be made in first: a refused cache folder is not
    # created, nor are its parents.
    existing="$(dirname "$cache")"
    while [ ! -e "$existing" ]; do existing="$(dirname "$existing")"; done
    check_from "$existing"
    mkdir -p "$(dirname "$cache")"
    mkdir -m 700 "$cache" 2>/dev/null || [ -d "$cache" ] || die "$cache: cannot create the cache folder"
fi
[ -d "$cache" ] || refuse "it is not a folder"
read -r owner mode < <(stat -Lc '%u %a' "$cache")
mode=$((8#$mode))
[ "$owner" = "$me" ] || refuse "it belongs to uid $owner, not to you (uid $me)"
if (( mode & 8#022 )); then
    if (( mode & 8#002 )); then who="others"; else who="its group"; fi
    die "$cache: refusing to use this cache folder: it is writable by $who (mode $(printf %04o "$mode")); run \`chmod go-w $cache\` or $how"
fi
check_from "$(dirname "$(cd "$cache" && pwd -P)")"
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
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
echo "$want" > "$stamp"
