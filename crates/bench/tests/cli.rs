//! The `granule-bench` command: its listing, its errors, the `granule` binary it needs
//! beside it, and the documents' `granule-bench` command lines against its flags and
//! benchmark names. (Every benchmark's `--quick` run is `scripts/test.sh`'s smoke step.)
//!
//! Run: `cargo test -p granule-bench --test cli`.

use std::path::{Path, PathBuf};
use std::process::Command;

const BENCH: &str = env!("CARGO_BIN_EXE_granule-bench");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn without_a_name_it_lists_every_benchmark() {
    let out = Command::new(BENCH).output().expect("run granule-bench");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for (name, _) in granule_bench::BENCHMARKS.iter().chain(&[("all", "")]) {
        assert!(
            text.lines()
                .any(|l| l.split_whitespace().next() == Some(name)),
            "{name} is not listed:\n{text}"
        );
    }
}

#[test]
fn an_unknown_benchmark_is_a_clear_error() {
    let out = Command::new(BENCH)
        .args(["nosuch", "--quick"])
        .output()
        .expect("run granule-bench");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("granule-bench: error: unknown benchmark 'nosuch'; known: invoke,"),
        "{err}"
    );
}

/// A benchmark that starts `granule` subcommands, run from a directory without the
/// `granule` binary, stops at once and says how to build it.
#[test]
fn a_missing_granule_binary_is_named_with_its_build_command() {
    let dir = tempfile::tempdir().expect("temp dir");
    let copy = dir.path().join("granule-bench");
    // A hard link keeps the test cheap; another file system needs a copy.
    if std::fs::hard_link(BENCH, &copy).is_err() {
        std::fs::copy(BENCH, &copy).expect("copy granule-bench");
    }
    for name in ["fs", "all"] {
        let out = Command::new(&copy)
            .args([name, "--quick", "--out"])
            .arg(dir.path().join("out"))
            .output()
            .expect("run granule-bench");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        let want = format!(
            "granule-bench: error: granule-bench needs the granule binary beside it ({}): run cargo build --release -p granule-cli",
            dir.path().join("granule").display()
        );
        assert!(err.contains(&want), "{name}: {err}");
        assert!(!dir.path().join("out").exists(), "{name} ran anyway");
    }
}

/// The command lines of the README, the guide and the benchmarks page that run
/// `granule-bench` (alone or as `target/release/granule-bench`): (file, words after it).
fn documented_commands() -> Vec<(String, Vec<String>)> {
    let root = repo();
    let mut files = vec![root.join("README.md"), root.join("docs/results/README.md")];
    let mut guide: Vec<PathBuf> = std::fs::read_dir(root.join("docs/guide"))
        .expect("docs/guide")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    guide.sort();
    files.extend(guide);
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("document");
        let name = f
            .strip_prefix(&root)
            .unwrap_or(&f)
            .to_string_lossy()
            .into_owned();
        // Code blocks and code spans alike.
        for line in text.lines() {
            let line = line.split(" #").next().unwrap_or("");
            for part in line.split('`') {
                let words: Vec<&str> = part.split_whitespace().collect();
                let Some(at) = words.iter().position(|w| {
                    Path::new(w)
                        .file_name()
                        .is_some_and(|n| n == "granule-bench")
                }) else {
                    continue;
                };
                let rest: Vec<String> = words[at + 1..]
                    .iter()
                    .take_while(|w| !matches!(**w, "|" | "&&" | ";" | ">" | "2>&1" | "\\"))
                    .map(|w| w.to_string())
                    .collect();
                out.push((name.clone(), rest));
            }
        }
    }
    out
}

#[test]
fn the_documents_run_granule_bench_with_its_flags_and_benchmarks() {
    let help = Command::new(BENCH)
        .arg("--help")
        .output()
        .expect("granule-bench --help");
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let commands = documented_commands();
    assert!(
        commands.len() >= 5,
        "expected the documents to show granule-bench: {commands:?}"
    );
    let names: Vec<&str> = granule_bench::BENCHMARKS.iter().map(|(n, _)| *n).collect();
    let mut failures = Vec::new();
    for (file, words) in &commands {
        for w in words {
            if w.starts_with("--") {
                let flag = w.split('=').next().unwrap_or(w);
                if !help.contains(flag) {
                    failures.push(format!("{file}: granule-bench has no {flag}"));
                }
            }
        }
        // The benchmark: the first word, when it is a plain name (not a placeholder).
        if let Some(first) = words.first() {
            let plain = first.chars().all(|c| c.is_ascii_lowercase() || c == '-')
                && !first.starts_with('-');
            if plain && first != "all" && !names.contains(&first.as_str()) {
                failures.push(format!("{file}: granule-bench has no benchmark {first}"));
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}
