#!/usr/bin/env bash
# Install what the test suite needs besides crates: the packages listed in
# scripts/deps.txt (Debian packages, PyPI packages in the project's venv, rustup
# components). scripts/test.sh and .ci/run both run it first.
#
#   bash scripts/deps.sh            install what is missing
#   bash scripts/deps.sh --check    only say what is missing
#
# Only what is missing is installed, and `apt-get update` runs only when a Debian
# package must be installed: a second run installs nothing. Exit 0 when everything is
# there (afterwards). Otherwise one line per missing package on stderr saying how to get
# it, and exit 1: Debian packages need root and apt-get, PyPI packages python3 with its
# venv module (Debian's python3-venv, installed like a listed package when missing).
#
# Environment: GRANULE_DEPS (the list, default scripts/deps.txt), GRANULE_VENV (the
# venv for PyPI packages, default target/ray-venv: the one the Ray benchmark uses),
# PYTHON (the interpreter that creates the venv, default python3).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
list=${GRANULE_DEPS:-$root/scripts/deps.txt}
venv=${GRANULE_VENV:-$root/target/ray-venv}
py=${PYTHON:-python3}

check_only=0
case "${1:-}" in
    "") ;;
    --check) check_only=1 ;;
    *)
        echo "usage: bash scripts/deps.sh [--check]" >&2
        exit 2
        ;;
esac
[ -r "$list" ] || { echo "deps.sh: cannot read $list" >&2; exit 2; }

# ---- what is there -------------------------------------------------------------------

has_command() { # "a|b|c": any of them on PATH
    local c
    local IFS='|'
    for c in $1; do
        command -v "$c" >/dev/null 2>&1 && return 0
    done
    return 1
}

present() { # kind check
    case $1 in
        apt) has_command "$2" ;;
        pypi) [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import $2" >/dev/null 2>&1 ;;
        rustup) cargo "$2" --version >/dev/null 2>&1 ;;
    esac
}

# ---- the list ------------------------------------------------------------------------

entries=() # "kind package check skip-with|-"
skipped=()
lineno=0
bad() { echo "deps.sh: $list:$lineno: $*" >&2; exit 2; }
while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    line=${line%%#*}
    read -r kind pkg check skip extra <<<"$line"
    [ -n "$kind" ] || continue
    case $kind in apt | pypi | rustup) ;; *) bad "unknown kind '$kind' (apt, pypi or rustup)" ;; esac
    [ -n "$check" ] && [ -z "$extra" ] || bad "expected: kind package check [skip-with]"
    if [ -n "$skip" ]; then
        [[ $skip =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || bad "'$skip' is not a variable name"
        if [ -n "${!skip:-}" ]; then
            skipped+=("$pkg ($skip is set)")
            continue
        fi
    fi
    entries+=("$kind $pkg $check ${skip:--}")
done <"$list"

missing() { # the entries not present, one per line
    local e k p c s
    for e in "${entries[@]}"; do
        read -r k p c s <<<"$e"
        present "$k" "$c" || echo "$e"
    done
}

names() { # the package names of the entries given as arguments
    local e k p rest out=()
    for e in "$@"; do
        read -r k p rest <<<"$e"
        out+=("$p")
    done
    echo "${out[*]}"
}

# ---- install what is missing ---------------------------------------------------------

mapfile -t todo < <(missing)
if [ ${#todo[@]} -eq 0 ]; then
    note=""
    [ ${#skipped[@]} -eq 0 ] || note="; not needed: ${skipped[*]}"
    echo "deps: all present ($(names "${entries[@]}"))$note"
    exit 0
fi

declare -A why # package -> why it could not be installed
log=$(mktemp "${TMPDIR:-/tmp}/granule-deps.XXXXXX") || { echo "deps.sh: cannot create a temporary file" >&2; exit 2; }
trap 'rm -f "$log"' EXIT
last_error() { # the most telling line of the last command's output
    grep -E '^E:|ERROR|Error|error' "$log" | tail -n 1 | grep . || grep -v '^[[:space:]]*$' "$log" | tail -n 1
}

apt_pkgs=()
pypi_pkgs=()
rustup_pkgs=()
for e in "${todo[@]}"; do
    read -r k p c s <<<"$e"
    case $k in
        apt) apt_pkgs+=("$p") ;;
        pypi) pypi_pkgs+=("$p") ;;
        rustup) rustup_pkgs+=("$p") ;;
    esac
done
# A venv needs python3's venv and ensurepip modules (Debian: python3-venv).
needs_venv=0
if [ ${#pypi_pkgs[@]} -gt 0 ] && [ ! -x "$venv/bin/python" ]; then
    needs_venv=1
    if ! "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then
        apt_pkgs+=(python3-venv)
    fi
fi

if [ $check_only = 1 ]; then
    for p in "${apt_pkgs[@]}" "${pypi_pkgs[@]}" "${rustup_pkgs[@]}"; do why[$p]="not installed"; done
else
    if [ ${#rustup_pkgs[@]} -gt 0 ]; then
        if ! command -v rustup >/dev/null 2>&1; then
            for p in "${rustup_pkgs[@]}"; do why[$p]="no rustup"; done
        else
            echo "deps: rustup component add ${rustup_pkgs[*]}"
            if ! rustup component add "${rustup_pkgs[@]}" >"$log" 2>&1; then
                for p in "${rustup_pkgs[@]}"; do why[$p]="rustup failed: $(last_error)"; done
            fi
        fi
    fi

    if [ ${#apt_pkgs[@]} -gt 0 ]; then
        reason=""
        if ! command -v apt-get >/dev/null 2>&1; then
            reason="no apt-get here"
        elif [ "$(id -u)" != 0 ]; then
            reason="not root"
        else
            echo "deps: apt-get install ${apt_pkgs[*]}"
            export DEBIAN_FRONTEND=noninteractive
            if ! apt-get update -q >"$log" 2>&1; then
                reason="apt-get update failed: $(last_error)"
            elif ! apt-get install -y -q --no-install-recommends "${apt_pkgs[@]}" >"$log" 2>&1; then
                reason="apt-get install failed: $(last_error)"
            fi
        fi
        if [ -n "$reason" ]; then
            for p in "${apt_pkgs[@]}"; do why[$p]=$reason; done
        fi
    fi

    if [ ${#pypi_pkgs[@]} -gt 0 ]; then
        reason=""
        if [ $needs_venv = 1 ]; then
            if ! command -v "$py" >/dev/null 2>&1; then
                reason="no $py"
            elif ! "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then
                reason="$py has no venv module (Debian: python3-venv${why[python3-venv]:+, ${why[python3-venv]}})"
            else
                echo "deps: $py -m venv $venv"
                "$py" -m venv "$venv" >"$log" 2>&1 || reason="cannot create the venv: $(last_error)"
            fi
        fi
        if [ -z "$reason" ]; then
            echo "deps: pip install ${pypi_pkgs[*]} (into $venv)"
            "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
                "${pypi_pkgs[@]}" >"$log" 2>&1 || reason="pip failed: $(last_error)"
        fi
        if [ -n "$reason" ]; then
            for p in "${pypi_pkgs[@]}"; do why[$p]=$reason; done
        fi
    fi
fi

# ---- what is still missing, and how to get it ----------------------------------------

mapfile -t still < <(missing)
if [ ${#still[@]} -eq 0 ]; then
    echo "deps: installed $(names "${todo[@]}")"
    exit 0
fi
for e in "${still[@]}"; do
    read -r k p c s <<<"$e"
    r=${why[$p]:-installed, but still not found}
    case $k in
        apt) how="as root: apt-get update && apt-get install -y $p" ;;
        pypi) how="$py -m venv $venv && $venv/bin/python -m pip install '$p'" ;;
        rustup) how="rustup component add $p" ;;
    esac
    [ "$s" = - ] || how="$how (or set $s=1 to skip the tests that need it)"
    echo "deps: missing $p ($k; for '$c') [$r]: $how" >&2
done
exit 1
