#!/usr/bin/env bash
# Regenerates every generated, checked-in file (docs/contributing.md): the
# JSON schemas of the published records (manifests/*.schema.json,
# parity/report.schema.json, eval/*.schema.json), the seam's schemas
# (python/tests/seam.json) and the run books of manifests/runbooks/. Each is
# written by the unit test that otherwise fails when it is stale
# (crates/model/src/generated.rs); this runs every library's unit tests with
# the switch set, then lists what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
CHUNKFORGE_BLESS=1 cargo test --release --workspace --lib --quiet
git status --short -- manifests parity eval python/tests/seam.json
