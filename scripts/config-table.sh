#!/usr/bin/env bash
# Regenerates the settings tables in docs/guide/configuration.md from the settings table
# in crates/config (everything from "### `[cluster]`" up to the next "## " heading).
set -euo pipefail
cd "$(dirname "$0")/.."
table="$(mktemp)"
trap 'rm -f "$table"' EXIT
cargo run -q -p granule-config --example settings_table >"$table"
python3 - "$table" docs/guide/configuration.md <<'PY'
import sys
table = open(sys.argv[1]).read().strip("\n") + "\n\n"
path = sys.argv[2]
doc = open(path).read()
start = doc.index("### `[cluster]`")
end = doc.index("\n## ", start) + 1
open(path, "w").write(doc[:start] + table[table.index("### `[cluster]`"):] + doc[end:])
PY
