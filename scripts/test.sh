#!/usr/bin/env bash
# The whole test suite. On a fresh machine this also creates the cached Python
# environment (first run: a few minutes, ~5 GB for torch) and the test fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== Rust format and lints"
cargo fmt --check
cargo clippy --release --all-targets --quiet -- -D warnings
cargo build --release --all-targets
./target/release/chunkforge setup
VENV_PY="$(./target/release/chunkforge doctor --venv-python)"
"$VENV_PY" -m pip install --quiet --disable-pip-version-check -r python/requirements-test.txt

echo "== Python lint and format (ruff)"
"$VENV_PY" -m ruff check python/
"$VENV_PY" -m ruff format --check python/
echo "== Python tests"
"$VENV_PY" -m pytest -q python/tests
echo "== Rust tests"
bash scripts/setup-signing.sh  # model-signing 1.1.1 for the release cross-checks (tests/release.rs)
cargo test --release -- --test-threads="${CHUNKFORGE_TEST_THREADS:-2}"
