#!/usr/bin/env bash
# Everything the README's two commands (`cargo run --release -- build ...` and
# `bash scripts/test.sh`) need from the system, checked; what Debian packages
# provide is installed (as root, with apt-get), rustfmt and clippy are added
# with rustup, and anything else is named with how to get it. Idempotent and
# quick when everything is present. Python packages are not system ones:
# chunkforge installs them itself into its cached virtual environment.
#
#   bash scripts/setup-system.sh           # check, and install what is missing
#   bash scripts/setup-system.sh --check   # only report; exit 1 if anything is missing
set -euo pipefail
check_only=0
case "${1:-}" in
    "") ;;
    --check) check_only=1 ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
RUST_MIN=89   # rustc 1.89 or newer (Cargo.toml's rust-version)

missing=()  # what is missing and how to get it, one line each
apt=()      # Debian packages that would provide some of it
found=()    # what is there, for the closing line
components=() # rustup components to add

# The interpreter pyo3 builds against, found the way pyo3-build-config finds
# it: $PYO3_PYTHON, else the active virtualenv or conda environment, else the
# first of `python`, `python3` on PATH that is a Python 3.
pyo3_python() {
    if [ -n "${PYO3_PYTHON:-}" ]; then echo "$PYO3_PYTHON"; return; fi
    if [ -n "${VIRTUAL_ENV:-}" ]; then echo "$VIRTUAL_ENV/bin/python"; return; fi
    if [ -n "${CONDA_PREFIX:-}" ]; then echo "$CONDA_PREFIX/bin/python"; return; fi
    local c
    for c in python python3; do
        if "$c" --version 2>&1 | grep -q '^Python 3'; then command -v "$c"; return; fi
    done
}

check() {
    missing=(); apt=(); found=(); components=()
    # Rust: cargo and rustc from rustup (Debian's are too old), with rustfmt and
    # clippy, which the test command runs.
    if command -v cargo >/dev/null && command -v rustc >/dev/null; then
        local v
        v="$(rustc --version 2>/dev/null | awk '{print $2}')"
        if [[ "$v" =~ ^1\.([0-9]+)\. ]] && (( BASH_REMATCH[1] >= RUST_MIN )); then
            found+=("rustc $v")
        else
            missing+=("rustc 1.$RUST_MIN or newer (found '${v:-none}'): rustup update stable")
        fi
        local tool component
        for tool in rustfmt cargo-clippy; do
            component="${tool#cargo-}"
            if "$tool" --version >/dev/null 2>&1; then
                found+=("$component")
            elif command -v rustup >/dev/null; then
                components+=("$component")
                missing+=("$component (the test command runs it): rustup component add $component")
            else
                missing+=("$component (the test command runs it): install it with your Rust toolchain")
            fi
        done
    else
        missing+=("cargo and rustc 1.$RUST_MIN or newer: install rustup (https://rustup.rs), then open a new shell")
    fi

    # A C compiler and linker (build scripts, linking), openssl and strace (tests).
    command -v cc >/dev/null && found+=("cc") || { missing+=("cc (C compiler and linker)"); apt+=(gcc libc6-dev); }
    command -v openssl >/dev/null && found+=("openssl") || { missing+=("openssl (the signing tests)"); apt+=(openssl); }
    command -v strace >/dev/null && found+=("strace") || { missing+=("strace (the fsync test)"); apt+=(strace); }

    # CPython 3.11 with its shared libpython (chunkforge embeds it) and venv
    # with pip (chunkforge makes its environment with `python3.11 -m venv`).
    local py
    py="$(pyo3_python || true)"
    if [ -z "$py" ]; then
        missing+=("CPython 3.11 (python3 on PATH, or PYO3_PYTHON)")
        apt+=(python3.11 python3.11-venv libpython3.11-dev)
        return
    fi
    local facts
    if ! facts="$("$py" - <<'EOF' 2>/dev/null
import os, sys, sysconfig
lib = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("LDLIBRARY") or "")
try:
    import ensurepip, venv  # noqa: F401
    has_venv = 1
except ImportError:
    has_venv = 0
shared = int(bool(sysconfig.get_config_var("Py_ENABLE_SHARED")) and lib.endswith(".so") and os.path.exists(lib))
print("%d.%d" % sys.version_info[:2], sys.version.split()[0], shared, lib, has_venv, os.path.realpath(sys.executable))
EOF
)"; then
        missing+=("$py: does not run as a Python interpreter")
        return
    fi
    local minor version shared lib has_venv exe
    read -r minor version shared lib has_venv exe <<<"$facts"
    # Debian's own python3.11 (/usr/bin): its missing parts are Debian packages.
    local debian=0
    [[ "$exe" == /usr/bin/python3* ]] && debian=1
    if [ "$minor" != 3.11 ]; then
        local hint="install Python 3.11 (built with --enable-shared) and set PYO3_PYTHON to it"
        if [ -x /usr/bin/python3.11 ]; then
            hint="export PYO3_PYTHON=/usr/bin/python3.11"
        elif command -v apt-cache >/dev/null && apt-cache show python3.11 >/dev/null 2>&1; then
            apt+=(python3.11 python3.11-venv libpython3.11-dev)
            hint="after installing it: export PYO3_PYTHON=/usr/bin/python3.11"
        fi
        missing+=("CPython 3.11: pyo3 would build against $py, which is Python $version; $hint")
        return
    fi
    if [ "$shared" = 1 ]; then
        found+=("Python $version at $exe with $lib")
    elif (( debian )); then
        missing+=("the shared libpython3.11 of $exe ($lib)"); apt+=(libpython3.11-dev)
    else
        missing+=("the shared libpython3.11 of $exe: use a Python 3.11 built with --enable-shared (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install 3.11)")
    fi
    if [ "$has_venv" = 1 ]; then
        found+=("venv")
    elif (( debian )); then
        missing+=("the venv module with pip for $exe"); apt+=(python3.11-venv)
    else
        missing+=("the venv and ensurepip modules of $exe")
    fi
}

check
if (( ${#missing[@]} )) && (( ! check_only )); then
    installed=0
    if (( ${#apt[@]} )); then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "installing Debian packages: ${apt[*]}" >&2
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt[@]}"
            installed=1
        fi
    fi
    if (( ${#components[@]} )); then
        echo "adding rustup components: ${components[*]}" >&2
        rustup component add "${components[@]}"
        installed=1
    fi
    (( installed )) && check
fi
if (( ${#missing[@]} )); then
    for m in "${missing[@]}"; do echo "missing: $m" >&2; done
    if (( ${#apt[@]} )); then
        echo "Debian/Ubuntu packages for these: sudo apt-get install ${apt[*]}" >&2
    fi
    exit 1
fi
ok="$(printf '%s, ' "${found[@]}")"
echo "ok: ${ok%, }" >&2
