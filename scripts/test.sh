#!/usr/bin/env bash
# Granule's whole test suite: formatting, lints, rustdoc links, unit + multi-process
# integration tests, doc tests, and a --quick smoke run of every benchmark. Run from
# anywhere.
#
# It starts by installing what the suite needs besides crates (scripts/deps.txt, through
# scripts/deps.sh): without root it names what is missing and how to get it, and stops.
# After that every step runs even when an earlier one failed (and cargo test runs every
# crate's tests), so one failure does not hide the others; the failed steps are listed
# at the end and the exit status is non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }
failed=()
run() { # name command...: run a step, remember it if it fails
    local name=$1
    shift
    if ! "$@"; then
        failed+=("$name")
    fi
}

step "system dependencies (scripts/deps.txt)"
bash scripts/deps.sh || exit 1
# PyPI packages live in the project's venv: tests that need one run $GRANULE_PYTHON.
export GRANULE_VENV=${GRANULE_VENV:-$PWD/target/ray-venv}
if [ -x "$GRANULE_VENV/bin/python" ]; then
    export GRANULE_PYTHON="$GRANULE_VENV/bin/python"
fi

step "rustfmt"
run rustfmt cargo fmt --all -- --check

step "clippy (warnings are errors)"
run clippy cargo clippy --workspace --all-targets -- -D warnings
# The README's first command builds the granule command alone, where granule-report's
# `plot` feature is off (only granule-bench turns it on): lint that build too.
run "clippy (granule-cli alone)" cargo clippy -p granule-cli --bins -- -D warnings

step "rustdoc (broken or private links are errors)"
# The doc bin target `granule` and the lib `granule` share an output name (cargo #6313):
# document the libraries only.
run rustdoc env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --lib

step "tests (unit, multi-process integration, doc)"
# Built first, so the log shows what is compiling; then every test by name as it ends.
run "test build" cargo test --workspace --no-run
run tests cargo test --workspace --no-fail-fast

# Runs as a condition of `run`, where `set -e` does not apply: every failure is explicit.
bench_smoke() {
    local out dir f
    out="$(mktemp -d)" || return 1
    # Expanded now: `out` is gone by the time the script exits.
    trap "rm -rf '$out'" EXIT
    # granule-bench runs the granule binary beside it (fs mount, store, antagonist), so
    # both are built. Shown as it runs (a line per benchmark step when not on a terminal).
    cargo build --release -p granule-cli -p granule-bench || return 1
    if ! "${CARGO_TARGET_DIR:-target}/release/granule-bench" all --quick --out "$out" 2>&1 |
        tee "$out/log.txt"; then
        return 1
    fi
    for dir in "$out"/*/; do
        for f in results.csv results.md plot.png summary.json; do
            [ -s "$dir$f" ] || { echo "missing $dir$f"; return 1; }
        done
    done
    echo "benchmark smoke runs wrote: $(ls "$out" | grep -v log.txt | tr '\n' ' ')"
}
step "benchmark smoke runs (--quick; full runs write docs/results/)"
run "benchmark smoke runs" bench_smoke

if [ ${#failed[@]} -gt 0 ]; then
    step "FAILED: ${failed[*]}"
    exit 1
fi
step "all tests passed"
