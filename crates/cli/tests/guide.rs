//! The user guide's shell commands against the real `granule` command, so the guide
//! cannot rot: every `granule ...` line in a `sh`/`console`/`bash` block names a real
//! subcommand and only flags that subcommand has, and the read-only ones (`status`,
//! `top`) are run, as written, against a live cluster (the guide's example controller
//! address replaced by the real one). The guide's Rust blocks are doc tests of the
//! `granule` crate (`cargo test --doc -p granule`).

mod common;

use common::GRANULE;
use std::path::PathBuf;
use std::process::Command;

fn guide_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/guide")
}

/// Every command line of the guide's shell blocks: (chapter, line as written).
fn shell_lines() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(guide_dir())
        .expect("docs/guide")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    chapters.sort();
    assert!(chapters.len() >= 7, "guide chapters: {chapters:?}");
    for path in chapters {
        let text = std::fs::read_to_string(&path).expect("chapter");
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut in_shell = false;
        let mut in_other = false;
        for line in text.lines() {
            let t = line.trim_start();
            if let Some(info) = t.strip_prefix("```") {
                if in_shell || in_other {
                    in_shell = false;
                    in_other = false;
                } else if matches!(info.trim(), "sh" | "console" | "bash" | "shell") {
                    in_shell = true;
                } else {
                    in_other = true;
                }
                continue;
            }
            if in_shell {
                let cmd = t.strip_prefix("$ ").unwrap_or(t);
                // Drop trailing comments (the guide annotates commands with `# ...`).
                let cmd = cmd.split(" #").next().unwrap_or("").trim();
                if !cmd.is_empty() {
                    out.push((name.clone(), cmd.to_string()));
                }
            }
        }
    }
    out
}

/// The words of a `granule ...` command, without leading `VAR=value` assignments and
/// without a trailing redirection or what follows a bare `--`; `None` when the line runs something else.
fn granule_words(line: &str) -> Option<Vec<String>> {
    let mut words: Vec<&str> = line.split_whitespace().collect();
    while words
        .first()
        .is_some_and(|w| w.contains('=') && !w.starts_with('-'))
    {
        words.remove(0);
    }
    if words.first() != Some(&"granule") {
        return None;
    }
    if let Some(i) = words.iter().position(|w| w.starts_with('>')) {
        words.truncate(i);
    }
    // After a bare `--` come another program's arguments (a producer's workload).
    if let Some(i) = words.iter().position(|w| *w == "--") {
        words.truncate(i);
    }
    Some(words[1..].iter().map(|w| w.to_string()).collect())
}

fn help_of(path: &[String]) -> (bool, String) {
    let out = Command::new(GRANULE)
        .args(path)
        .arg("--help")
        .output()
        .expect("run granule");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn every_granule_command_in_the_guide_has_those_subcommands_and_flags() {
    let lines = shell_lines();
    let commands: Vec<(String, Vec<String>)> = lines
        .iter()
        .filter_map(|(ch, l)| granule_words(l).map(|w| (ch.clone(), w)))
        .collect();
    assert!(
        commands.len() >= 10,
        "expected the guide to show the granule command: {commands:?}"
    );
    for (chapter, words) in &commands {
        // The subcommand path: leading words that are not flags and that `--help`
        // accepts as subcommands (`fs mount DIR` takes a positional after its subcommands).
        let mut path: Vec<String> = Vec::new();
        for w in words.iter().take_while(|w| !w.starts_with('-')) {
            let mut p = path.clone();
            p.push(w.clone());
            let (ok, text) = help_of(&p);
            if !ok || !text.contains("Usage:") {
                break;
            }
            path = p;
            if !text.contains("Commands:") {
                break;
            }
        }
        assert!(
            !path.is_empty(),
            "{chapter}: `granule {}` has no such subcommand",
            words.join(" ")
        );
        let (_, help) = help_of(&path);
        for flag in words.iter().filter(|w| w.starts_with("--")) {
            let flag = flag.split('=').next().unwrap_or(flag);
            assert!(
                help.contains(flag),
                "{chapter}: `granule {}` uses {flag}, which `granule {} --help` does not list:\n{help}",
                words.join(" "),
                path.join(" ")
            );
        }
    }
}

/// The read-only commands the guide shows, run as written against a live cluster.
#[test]
fn the_guides_status_and_top_commands_run_against_a_cluster() {
    let cluster = granule::Cluster::builder()
        .nodes("cpu=1,mem=128MiB")
        .unwrap()
        .start()
        .unwrap();
    let addr = cluster.controller_addr().to_string();
    let bin_dir = PathBuf::from(GRANULE).parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let work = tempfile::tempdir().unwrap();
    let mut ran = 0;
    for (chapter, line) in shell_lines() {
        let Some(words) = granule_words(&line) else {
            continue;
        };
        if !matches!(words.first().map(String::as_str), Some("status" | "top")) {
            continue;
        }
        // The guide's example addresses stand for the cluster's controller.
        let mut cmd = line.clone();
        for example in ["127.0.0.1:7070", "A:7070", "10.0.0.1:7070"] {
            cmd = cmd.replace(example, &addr);
        }
        if words[0] == "top" && !words.iter().any(|w| w == "--iterations") {
            // Interactive in the guide (it runs until Ctrl-C): one refresh here.
            cmd = cmd.replacen("granule top", "granule top --iterations 1", 1);
        }
        let out = Command::new("sh")
            .args(["-c", &cmd])
            .env("PATH", &path)
            .env_remove("GRANULE_CONTROLLER")
            .current_dir(work.path())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{chapter}: `{cmd}` failed:\n{stdout}\n{stderr}"
        );
        ran += 1;
    }
    assert!(
        ran >= 4,
        "ran only {ran} status/top commands from the guide"
    );
    // The redirected `top` of the operations chapter wrote plain snapshots.
    let log = std::fs::read_to_string(work.path().join("top.log")).unwrap();
    assert_eq!(log.matches("granule top — controller").count(), 4, "{log}");
    assert!(log.contains("node_joined"), "{log}");
}
