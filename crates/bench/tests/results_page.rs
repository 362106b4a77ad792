//! The benchmarks page against the benchmarks and their committed runs:
//! `docs/results/README.md` has a section (`## NAME`) for every benchmark `granule-bench`
//! runs ([`granule_bench::BENCHMARKS`]) and for every report directory under
//! `docs/results/`, and every row of its `key | value` tables (and of its overview table)
//! quotes the benchmark's `summary.json`: strings exactly, numbers rounded to the places
//! written.
//!
//! Run: `cargo test -p granule-bench --test results_page`.

use std::collections::BTreeMap;
use std::path::PathBuf;

fn repo() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    p.canonicalize().expect("the repository root")
}

// ---- the benchmarks page --------------------------------------------------------------

const RESULTS: &str = "docs/results/README.md";

/// A value as the page writes it against the value in summary.json: strings exactly,
/// numbers within half a unit of the last place written.
fn same_value(written: &str, actual: &serde_json::Value) -> Result<(), String> {
    let w = written.trim().trim_matches('`').trim();
    match actual {
        serde_json::Value::String(s) if s == w => Ok(()),
        serde_json::Value::String(s) => Err(format!("summary.json says `{s}`")),
        serde_json::Value::Number(n) => {
            let a = n.as_f64().expect("a number");
            let normal = w.replace('−', "-");
            let v: f64 = normal
                .parse()
                .map_err(|_| format!("`{w}` is not a number (summary.json: {a})"))?;
            let places = normal.split_once('.').map_or(0, |(_, f)| f.len());
            let tolerance = 0.5 * 10f64.powi(-(places as i32)) * (1.0 + 1e-9);
            if (v - a).abs() <= tolerance {
                Ok(())
            } else {
                Err(format!("summary.json says {a}"))
            }
        }
        other => Err(format!(
            "summary.json holds {other}, not a string or number"
        )),
    }
}

fn cells(line: &str) -> Vec<String> {
    let t = line.trim();
    let t = t.strip_prefix('|').unwrap_or(t);
    let t = t.strip_suffix('|').unwrap_or(t);
    t.split('|').map(|c| c.trim().to_string()).collect()
}

/// The benchmark a cell names: the text of a `[name](#name)` link, or the plain text.
fn link_text(cell: &str) -> String {
    match (cell.find('['), cell.find(']')) {
        (Some(a), Some(b)) if a < b => cell[a + 1..b].to_string(),
        _ => cell.to_string(),
    }
}

#[test]
fn the_benchmarks_page_quotes_every_benchmark_as_its_summary_says() {
    let root = repo();
    let page = std::fs::read_to_string(root.join(RESULTS)).expect(RESULTS);
    let mut failures = Vec::new();

    // The benchmarks: what `granule-bench` runs, and what has a report directory.
    let mut names: Vec<String> = granule_bench::BENCHMARKS
        .iter()
        .map(|(n, _)| n.to_string())
        .collect();
    let mut summaries: BTreeMap<String, serde_json::Map<String, serde_json::Value>> =
        BTreeMap::new();
    for e in std::fs::read_dir(root.join("docs/results")).expect("docs/results") {
        let p = e.expect("entry").path();
        if !p.is_dir() {
            continue;
        }
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let text = match std::fs::read_to_string(p.join("summary.json")) {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("docs/results/{name}/summary.json: {e}"));
                continue;
            }
        };
        let json: serde_json::Value = serde_json::from_str(&text).expect("summary.json");
        let map = json.as_object().cloned().expect("an object");
        if map.get("quick") != Some(&serde_json::Value::Bool(false)) {
            failures.push(format!(
                "docs/results/{name}/summary.json is not a full run (`quick` is not false)"
            ));
        }
        summaries.insert(name.clone(), map);
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let sections: Vec<String> = page
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|s| s.trim().to_string())
        .collect();
    for n in &names {
        if !sections.contains(n) {
            failures.push(format!("{RESULTS} has no section `## {n}`"));
        }
        if !summaries.contains_key(n) {
            failures.push(format!("docs/results/{n}/ has no committed run"));
        }
    }

    // Every table row that quotes a key: (benchmark, key, value as written).
    let mut section: Option<String> = None;
    let mut header: Option<Vec<String>> = None;
    let mut quoted: BTreeMap<String, usize> = BTreeMap::new();
    let mut in_code = false;
    for (i, line) in page.lines().enumerate() {
        let at = format!("{RESULTS}:{}", i + 1);
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        if let Some(s) = line.strip_prefix("## ") {
            section = Some(s.trim().to_string());
            header = None;
            continue;
        }
        if !line.trim_start().starts_with('|') {
            header = None;
            continue;
        }
        let row = cells(line);
        let Some(h) = &header else {
            header = Some(row);
            continue;
        };
        if row
            .iter()
            .all(|c| c.chars().all(|c| matches!(c, '-' | ':')))
        {
            continue; // the delimiter row
        }
        let col = |name: &str| h.iter().position(|c| c == name);
        let Some(value_col) = col("value") else {
            continue;
        };
        let Some(key_col) = col("key").or_else(|| col("headline")) else {
            continue;
        };
        let bench = match col("benchmark") {
            Some(b) => link_text(&row[b]),
            None => match &section {
                Some(s) => s.clone(),
                None => {
                    failures.push(format!("{at}: a table of keys outside any section"));
                    continue;
                }
            },
        };
        let key = row[key_col].trim_matches('`').to_string();
        let written = row.get(value_col).cloned().unwrap_or_default();
        let Some(summary) = summaries.get(&bench) else {
            failures.push(format!("{at}: no docs/results/{bench}/summary.json"));
            continue;
        };
        match summary.get(&key) {
            None => failures.push(format!(
                "{at}: docs/results/{bench}/summary.json has no `{key}`"
            )),
            Some(actual) => {
                if let Err(why) = same_value(&written, actual) {
                    failures.push(format!("{at}: {bench} `{key}` is written {written}: {why}"));
                }
            }
        }
        *quoted.entry(bench).or_default() += 1;
        let _ = key;
    }
    // Each section says where its run came from.
    for n in &names {
        let Some(summary) = summaries.get(n) else {
            continue;
        };
        for k in ["commit", "timestamp", "machine"] {
            let in_page = page.lines().any(|l| {
                let c = cells(l);
                l.trim_start().starts_with('|')
                    && c.first().is_some_and(|c| c.trim_matches('`') == k)
                    && summary
                        .get(k)
                        .and_then(|v| v.as_str())
                        .is_some_and(|v| c.get(1).is_some_and(|w| w.trim_matches('`') == v))
            });
            if !in_page {
                failures.push(format!(
                    "{RESULTS}: the section of {n} does not give its `{k}`"
                ));
            }
        }
        if quoted.get(n).copied().unwrap_or(0) < 4 {
            failures.push(format!("{RESULTS}: the section of {n} quotes no figure"));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn values_compare_by_the_places_written() {
    let n = |x: f64| serde_json::json!(x);
    assert!(same_value("0.921", &n(0.9206247)).is_ok());
    assert!(same_value("0.92", &n(0.9206247)).is_ok());
    assert!(same_value("0.93", &n(0.9206247)).is_err());
    assert!(same_value("28114", &n(28114.97)).is_err());
    assert!(same_value("28115", &n(28114.97)).is_ok());
    assert!(same_value("-0.044", &n(-0.0438596)).is_ok());
    assert!(same_value("−0.044", &n(-0.0438596)).is_ok());
    assert!(same_value("0", &n(0.0)).is_ok());
    assert!(same_value("`955ce1a1cdc1`", &serde_json::json!("955ce1a1cdc1")).is_ok());
    assert!(same_value("955ce1a", &serde_json::json!("955ce1a1cdc1")).is_err());
}
