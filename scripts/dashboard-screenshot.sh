#!/usr/bin/env bash
# Take docs/dashboard.png: the controller's dashboard during `granule-bench pressure
# --quick`, once the memory antagonist has made the victim node shed (migrations on the
# timeline). Needs chromium (Debian's package). Run from anywhere; takes ~1 minute.
set -euo pipefail
cd "$(dirname "$0")/.."

port="${PORT:-18265}"
url="http://127.0.0.1:$port/"
out="${1:-docs/dashboard.png}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
[ -n "$browser" ] || { echo "needs chromium (apt-get install chromium)" >&2; exit 1; }

# granule-bench starts the memory antagonist from the granule binary beside it.
cargo build --release --quiet -p granule-cli -p granule-bench
tmp="$(mktemp -d)"
GRANULE_DASHBOARD="127.0.0.1:$port" "${CARGO_TARGET_DIR:-target}/release/granule-bench" pressure --quick --out "$tmp" \
    > "$tmp/bench.log" 2>&1 &
bench=$!
trap 'kill $bench 2>/dev/null || true; rm -rf "$tmp"' EXIT

# Wait for the first migrations (the victim shedding), then let a few more land.
for _ in $(seq 1 600); do
    if curl -fs "${url}api/cluster" 2>/dev/null | grep -q '"kind":"migration"'; then
        sleep 0.4
        "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
            --user-data-dir="$tmp/profile" --window-size=1400,1000 \
            --virtual-time-budget=1500 --screenshot="$out" "$url" 2>/dev/null
        echo "wrote $out"
        wait $bench || true
        exit 0
    fi
    kill -0 $bench 2>/dev/null || break
    sleep 0.1
done
echo "no migration appeared on the dashboard; bench log:" >&2
cat "$tmp/bench.log" >&2
exit 1
