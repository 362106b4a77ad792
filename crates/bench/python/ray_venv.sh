#!/usr/bin/env bash
# Create (once) a virtualenv holding Ray, for the Ray baseline of `granule-bench batch`.
#
#   bash crates/bench/python/ray_venv.sh VENV_DIR
#
# On success the only thing on stdout is the venv's python path (last line), so the
# Rust caller can take it verbatim.  On failure: exit non-zero with one line on stderr.
# Set PYTHON to choose the interpreter that creates the venv (default: python3).
set -u

# Pinned so that every run of the benchmark measures the same Ray; 2.60.0 is the
# newest release with CPython 3.11 wheels for x86_64 Linux when this was written.
RAY_VERSION="2.60.0"

die() { echo "ray_venv.sh: $*" >&2; exit 1; }

[ $# -eq 1 ] && [ -n "$1" ] || die "usage: ray_venv.sh VENV_DIR"
venv=$1
py=${PYTHON:-python3}
venv_py="$venv/bin/python"

# Idempotent: an existing venv that already imports the pinned ray is left alone
# (a venv from an older pin falls through and is upgraded in place below).
if [ -x "$venv_py" ] && "$venv_py" -c "import ray, sys; sys.exit(ray.__version__ != '$RAY_VERSION')" >/dev/null 2>&1; then
    echo "$venv_py"
    exit 0
fi

command -v "$py" >/dev/null 2>&1 || die "$py not found on PATH (Python 3 is needed to build the Ray venv)"

# Debian/Ubuntu split venv+ensurepip into python3-venv; without it `-m venv` fails
# half-way, so detect it up front and name the package.
if ! "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    die "'$py -m venv' is unavailable (no venv/ensurepip module); on Debian/Ubuntu: apt-get install python3-venv"
fi

log=$(mktemp "${TMPDIR:-/tmp}/ray_venv.XXXXXX") || die "cannot create a temporary log file"
trap 'rm -f "$log"' EXIT

# Last meaningful line of the captured output, for the one-line error message.
last_error() {
    grep -E 'ERROR|Error|error' "$log" | tail -n 1 | grep . || grep -v '^[[:space:]]*$' "$log" | tail -n 1
}

if [ ! -x "$venv_py" ]; then
    if ! "$py" -m venv "$venv" >"$log" 2>&1; then
        die "'$py -m venv $venv' failed: $(last_error)"
    fi
fi

# pip's own output (progress, warnings, "new pip available") goes to the log, never stdout.
if ! "$venv_py" -m pip install --quiet --disable-pip-version-check --no-input \
        "ray==$RAY_VERSION" >"$log" 2>&1; then
    die "pip could not install ray==$RAY_VERSION: $(last_error)"
fi

if ! "$venv_py" -c 'import ray' >"$log" 2>&1; then
    die "ray==$RAY_VERSION installed but 'import ray' fails: $(last_error)"
fi

echo "$venv_py"
