#!/usr/bin/env bash
# The whole test suite. On a fresh machine this also creates the cached Python
# environment (first run: a few minutes, 4 GB; README: Fresh machine) and the test fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== Rust format and lints"
cargo fmt --check
cargo clippy --release --all-targets --quiet -- -D warnings
cargo build --release --all-targets
./target/release/chunkforge setup
VENV_PY="$(./target/release/chunkforge doctor --venv-python)"
# The test tools (pytest, ruff, mypy) live in a folder of their own next to the
# pinned environment ($CACHE/venv/bin/python), named after the SHA-256 of
# their requirements: the pinned environment holds exactly requirements-torch.txt
# and requirements.txt.
CACHE="$(dirname "$(dirname "$(dirname "$VENV_PY")")")"
# sha256sum (GNU) or shasum (macOS)
TOOLS="$CACHE/test-tools-$({ sha256sum python/requirements-test.txt 2>/dev/null || shasum -a 256 python/requirements-test.txt; } | cut -c1-16)"
if [ ! -d "$TOOLS" ]; then
  echo "== Installing the test tools into $TOOLS"
  rm -rf "$TOOLS.partial"
  "$VENV_PY" -m pip install --quiet --disable-pip-version-check --target "$TOOLS.partial" -r python/requirements-test.txt
  mv "$TOOLS.partial" "$TOOLS"
fi
# mypy and pytest run under the pinned interpreter (torch etc. import from
# there) with the tools in front on PYTHONPATH. Only these commands get it;
# of the Rust tests, only the `chunkforge selftest-python` run (tests/palettize.rs)
# puts CHUNKFORGE_TEST_TOOLS on its PYTHONPATH, so every other chunkforge the
# tests start sees the pinned environment alone.
TOOLS_PATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}"

echo "== Python lint and format (ruff)"
"$TOOLS/bin/ruff" check python/
"$TOOLS/bin/ruff" format --check python/
echo "== Python types (mypy)"
PYTHONPATH="$TOOLS_PATH" "$VENV_PY" -m mypy --config-file python/mypy.ini --python-executable "$VENV_PY" --cache-dir "$CACHE/mypy-cache" python/
echo "== Rust tests"
bash scripts/setup-signing.sh  # model-signing 1.1.1 for the release cross-checks (tests/release.rs)
CHUNKFORGE_TEST_TOOLS="$TOOLS" cargo test --release --no-fail-fast -- --test-threads="${CHUNKFORGE_TEST_THREADS:-2}"
# After the Rust tests: the interpreter's tests on real packages read the
# builds they share (target/tmp/builds, tests/common/mod.rs).
echo "== Python tests"
PYTHONPATH="$TOOLS_PATH" "$VENV_PY" -m pytest -q python/tests
