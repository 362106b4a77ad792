#!/usr/bin/env bash
# Granule's whole test suite: formatting, lints, unit + multi-process integration tests,
# doc tests, and a --quick smoke run of every benchmark. Run from anywhere.
#
# It starts by installing what the suite needs besides crates (scripts/deps.txt, through
# scripts/deps.sh): without root it names what is missing and how to get it, and stops.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "system dependencies (scripts/deps.txt)"
bash scripts/deps.sh || exit 1
# PyPI packages live in the project's venv: tests that need one run $GRANULE_PYTHON.
export GRANULE_VENV=${GRANULE_VENV:-$PWD/target/ray-venv}
if [ -x "$GRANULE_VENV/bin/python" ]; then
    export GRANULE_PYTHON="$GRANULE_VENV/bin/python"
fi

step "rustfmt"
cargo fmt --all -- --check

step "clippy (warnings are errors)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "tests (unit, multi-process integration, doc)"
cargo test --workspace --quiet

step "benchmark smoke runs (--quick; full runs write docs/results/)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
cargo run --release --quiet -p granule-cli -- bench all --quick --out "$out" > "$out/log.txt" 2>&1 || {
    cat "$out/log.txt"; exit 1; }
for dir in "$out"/*/; do
    for f in results.csv results.md plot.png summary.json; do
        [ -s "$dir$f" ] || { echo "missing $dir$f"; exit 1; }
    done
done
echo "benchmark smoke runs wrote: $(ls "$out" | grep -v log.txt | tr '\n' ' ')"

step "all tests passed"
