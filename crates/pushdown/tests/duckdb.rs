//! The five queries, run by [`run_local`], give exactly what DuckDB computes from the
//! same data written as CSV (`py/reference.py`), at two seeds.
//!
//! Needs the project's Python venv with DuckDB (`target/ray-venv`, listed in
//! scripts/deps.txt): without it the test fails and says to run `bash scripts/deps.sh`.

use granule_pushdown::{generate, queries, run_local, write_csv, Table, TableName};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The venv's python, checked to import duckdb.
fn python() -> PathBuf {
    let py = workspace().join("target/ray-venv/bin/python");
    let ok = Command::new(&py)
        .args(["-c", "import duckdb"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{} cannot import duckdb: run `bash scripts/deps.sh` (it installs the packages in scripts/deps.txt)",
        py.display()
    );
    py
}

fn check(sf: f64, seed: u64, rows_per_group: u32) {
    let py = python();
    let dir = tempfile::tempdir().unwrap();
    let mut tables = BTreeMap::new();
    for t in TableName::ALL {
        let (schema, groups) = generate(t, sf, seed, rows_per_group).unwrap();
        write_csv(
            &schema,
            &groups,
            &dir.path().join(format!("{}.csv", t.name())),
        )
        .unwrap();
        tables.insert(t, Table { schema, groups });
    }
    let out = Command::new(&py)
        .arg(workspace().join("crates/pushdown/py/reference.py"))
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "reference.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let want: BTreeMap<&str, &str> = stdout
        .lines()
        .map(|l| l.split_once('\t').expect("name<TAB>json"))
        .collect();
    let all = queries::all().unwrap();
    assert_eq!(
        want.len(),
        all.len(),
        "one reference line per query: {stdout}"
    );
    for q in &all {
        let got = run_local(q, &tables).unwrap();
        assert!(!got.rows.is_empty(), "{}: no rows", q.name);
        let reference = want.get(q.name.as_str()).expect("a reference result");
        assert_eq!(
            &got.to_json(),
            reference,
            "{} at SF {sf}, seed {seed} differs from DuckDB",
            q.name
        );
    }
}

#[test]
fn queries_match_duckdb_at_sf_0_01() {
    check(0.01, 1, 8192);
}

#[test]
fn queries_match_duckdb_at_another_seed_and_chunking() {
    check(0.005, 42, 1000);
}
