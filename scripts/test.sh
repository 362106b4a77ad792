#!/usr/bin/env bash
# Granule's whole test suite: formatting, lints, unit + multi-process integration tests,
# doc tests, and a --quick smoke run of every benchmark. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

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
