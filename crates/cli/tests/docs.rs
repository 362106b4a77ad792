//! Documentation that cannot drift: every error or log line the docs quote, and every
//! default they state, is checked here against the code.
//!
//! The documents: `README.md`, every chapter of `docs/guide/`, and the `//!` front page
//! of `crates/granule/src/lib.rs`.
//!
//! - **Quoted messages.** Every line of a code block that begins with `granule: error:`
//!   or is a `WARN` log line must be reproduced by one of [`scenarios`]: a real run of the
//!   `granule` binary (arguments, environment, a port the test holds, a cluster this test
//!   drives, run as an unprivileged user where the message needs one) whose stderr
//!   contains the quoted line. In a quote, `...` matches anything; the parts that vary
//!   (ports, paths, the euid) are named per scenario as substitutions; failures inside
//!   node processes are provoked with failpoints armed from the configuration. A quote
//!   that no scenario reproduces fails, saying what to add.
//! - **Messages quoted in running text** (an inline code span of five words or more that
//!   is not code or a command) must each have an entry of [`inline_messages`] that makes
//!   the message with the code itself (its `Display`, a configuration error, a real run)
//!   and contains the quote (`N`, `MESSAGE`, `ADDR` and `...` match anything).
//! - **Stated defaults.** Every mention of "default" next to a value (a number, a size,
//!   a duration, a backticked value), and every flag default in the guide's command
//!   table, must be covered by an entry of [`claims`]: the phrase as written and a check
//!   against the code (`Config::default()`, a flag's `[default: ..]` in `--help`, an
//!   exported constant, or a literal in the source). The settings tables of
//!   `docs/guide/configuration.md` are checked row by row against `Config::default()`.
//!   A phrase no longer in its file fails too, so the tables stay true.
//!
//! Run: `cargo test -p granule-cli --test docs`.

mod common;

use common::{Reaped, GRANULE};
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

// ---- the documents ---------------------------------------------------------------------

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One document: its path from the repository root and its lines (for `lib.rs`, the
/// text of its `//!` lines).
struct Doc {
    name: String,
    lines: Vec<String>,
}

fn docs() -> Vec<Doc> {
    let root = repo();
    let mut names = vec!["README.md".to_string()];
    let mut guide: Vec<String> = std::fs::read_dir(root.join("docs/guide"))
        .expect("docs/guide")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/guide/{n}"))
        .collect();
    guide.sort();
    assert!(guide.len() >= 7, "guide chapters: {guide:?}");
    names.extend(guide);
    let mut out: Vec<Doc> = names
        .into_iter()
        .map(|name| {
            let text = std::fs::read_to_string(root.join(&name)).expect("document");
            Doc {
                lines: text.lines().map(str::to_owned).collect(),
                name,
            }
        })
        .collect();
    let lib = std::fs::read_to_string(root.join("crates/granule/src/lib.rs")).expect("lib.rs");
    out.push(Doc {
        name: "crates/granule/src/lib.rs".into(),
        lines: lib
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("//!"))
            .map(|l| l.strip_prefix(' ').unwrap_or(l).to_owned())
            .collect(),
    });
    out
}

/// A line of a document, whether it sits in a fenced code block.
struct Line<'a> {
    doc: &'a str,
    no: usize,
    text: &'a str,
    in_code: bool,
}

fn lines(docs: &[Doc]) -> Vec<Line<'_>> {
    let mut out = Vec::new();
    for d in docs {
        let mut in_code = false;
        for (i, l) in d.lines.iter().enumerate() {
            if l.trim_start().starts_with("```") {
                in_code = !in_code;
                continue;
            }
            out.push(Line {
                doc: &d.name,
                no: i + 1,
                text: l,
                in_code,
            });
        }
    }
    out
}

// ---- matching ------------------------------------------------------------------------

/// `quote` (with `...` matching anything) occurs in `text`, within one line.
fn matches(quote: &str, text: &str) -> bool {
    let quote = quote.replace('…', "...");
    let pieces: Vec<&str> = quote.split("...").collect();
    text.lines().any(|line| {
        let mut at = 0;
        pieces.iter().all(|p| match line[at..].find(p) {
            Some(i) => {
                at += i + p.len();
                true
            }
            None => false,
        })
    })
}

/// Remove terminal colour codes (the log's formatter writes them even to a pipe).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Spaces and backticks do not count when a claim's value is looked for in its phrase.
fn squash(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_whitespace() && *c != '`')
        .collect()
}

// ---- quoted messages: the scenarios -----------------------------------------------------

/// How a scenario gets the text the quotes are matched against.
enum How {
    /// Run `granule ARGS` with `env` (on top of an environment without `GRANULE_*`
    /// variables). In arguments and values, `{held}` is a 127.0.0.1 port this test holds
    /// open, `{cluster}` the controller of a cluster this test process drives (so the
    /// `granule` binary is a foreign executable to it). `nobody`: run as uid/gid 65534
    /// when the test runs as root (the messages of an unprivileged user).
    Run {
        args: &'static [&'static str],
        env: &'static [(&'static str, &'static str)],
        nobody: bool,
    },
}

struct Scenario {
    name: &'static str,
    how: How,
    /// Parts of a quote that vary: (as the docs write it, what stands there in this run).
    /// Values may use `{held}`, `{cluster}`, `{euid}`, `{granule}` (this build's
    /// `granule` binary) and `{driver}` (this test binary, the driver of `{cluster}`).
    subst: &'static [(&'static str, &'static str)],
}

/// Every scenario a quoted message can come from. To cover a new quote, add one here
/// (or a substitution to an existing one).
fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "a bad rate in the environment",
            how: How::Run {
                args: &["demo", "--seconds", "0.01", "--exit"],
                env: &[("GRANULE_MIGRATION_THROTTLE", "fast")],
                nobody: false,
            },
            subst: &[],
        },
        Scenario {
            name: "a bad node spec in the environment",
            how: How::Run {
                args: &["demo", "--seconds", "0.01", "--exit"],
                env: &[("GRANULE_NODES", "cpu=1,mem=lots")],
                nobody: false,
            },
            subst: &[],
        },
        Scenario {
            name: "a bad --mem",
            how: How::Run {
                args: &["node", "--controller", "127.0.0.1:1", "--mem", "lots"],
                env: &[],
                nobody: false,
            },
            subst: &[],
        },
        Scenario {
            name: "--cpu 0",
            how: How::Run {
                args: &["node", "--controller", "127.0.0.1:1", "--cpu", "0"],
                env: &[],
                nobody: false,
            },
            subst: &[],
        },
        Scenario {
            name: "the controller's port in use",
            how: How::Run {
                args: &["controller", "--listen", "{held}"],
                env: &[],
                nobody: false,
            },
            subst: &[("127.0.0.1:7070", "{held}")],
        },
        Scenario {
            name: "the dashboard's port in use",
            how: How::Run {
                args: &["demo", "--seconds", "0.01", "--exit"],
                env: &[("GRANULE_DASHBOARD", "{held}")],
                nobody: false,
            },
            subst: &[("127.0.0.1:8080", "{held}")],
        },
        Scenario {
            // 192.0.2.0/24 is reserved for documentation: never this machine's.
            name: "a --listen-host of another machine",
            how: How::Run {
                args: &[
                    "node",
                    "--controller",
                    "127.0.0.1:1",
                    "--listen-host",
                    "192.0.2.1",
                ],
                env: &[],
                nobody: false,
            },
            subst: &[],
        },
        Scenario {
            name: "--listen that is not IP:PORT",
            how: How::Run {
                args: &["controller", "--listen", "nonsense"],
                env: &[],
                nobody: false,
            },
            subst: &[],
        },
        Scenario {
            name: "no controller at the address",
            how: How::Run {
                args: &["status", "--controller", "127.0.0.1:1"],
                env: &[],
                nobody: false,
            },
            subst: &[],
        },
        Scenario {
            name: "a node from another binary",
            how: How::Run {
                args: &["node", "--controller", "{cluster}", "--mem", "128MiB"],
                env: &[],
                nobody: false,
            },
            subst: &[
                ("/home/me/.cargo/bin/granule", "{granule}"),
                ("/path/to/my-app", "{driver}"),
            ],
        },
        Scenario {
            // The warning comes when the driver starts its node processes; a 1 ms
            // start-up timeout then ends the run at once.
            name: "an embedded cluster without cgroups (not root)",
            how: How::Run {
                args: &["demo", "--seconds", "0.01", "--exit"],
                env: &[("GRANULE_START_TIMEOUT", "1ms")],
                nobody: true,
            },
            subst: &[("(euid 1000)", "(euid {euid})")],
        },
        Scenario {
            name: "an antagonist without cgroups (not root)",
            how: How::Run {
                args: &[
                    "antagonist",
                    "cpu",
                    "--node",
                    "n1",
                    "--controller",
                    "127.0.0.1:1",
                ],
                env: &[],
                nobody: true,
            },
            subst: &[("(euid 65534)", "(euid {euid})")],
        },
        Scenario {
            // The `node.start` failpoint (armed from the configuration; spawned nodes
            // get the driver's) fails a node process's start-up, never the driver's.
            name: "a node process that exits during start-up",
            how: How::Run {
                args: &["demo", "--seconds", "0.01", "--exit"],
                env: &[
                    ("GRANULE_NODES", "cpu=1,mem=256MiB"),
                    ("GRANULE_FAULTS", "on"),
                    ("GRANULE_FAILPOINTS", "node.start=error"),
                ],
                nobody: false,
            },
            subst: &[],
        },
    ]
}

/// The values of the scenarios' placeholders, and what keeps them valid.
struct Setup {
    vars: BTreeMap<&'static str, String>,
    _held: std::net::TcpListener,
    _cluster: Option<granule::Cluster>,
}

fn setup(needs_cluster: bool) -> Setup {
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("hold a port");
    let mut vars = BTreeMap::new();
    vars.insert("{held}", held.local_addr().expect("addr").to_string());
    vars.insert("{granule}", GRANULE.to_string());
    vars.insert(
        "{driver}",
        std::env::current_exe()
            .expect("current_exe")
            .display()
            .to_string(),
    );
    vars.insert("{euid}", effective_uid(true).to_string());
    let cluster = needs_cluster.then(|| {
        granule::Cluster::builder()
            .nodes("cpu=1,mem=128MiB")
            .expect("spec")
            .start()
            .expect("a cluster driven by this test")
    });
    if let Some(c) = &cluster {
        vars.insert("{cluster}", c.controller_addr().to_string());
    }
    Setup {
        vars,
        _held: held,
        _cluster: cluster,
    }
}

/// The euid a scenario runs with: 65534 when this test is root and the scenario drops
/// privileges (`nobody`), else this process's own (read from a file it creates).
fn effective_uid(nobody: bool) -> u32 {
    if nobody && granule_host::proc::is_root() {
        return 65534;
    }
    use std::os::unix::fs::MetadataExt;
    let f = tempfile::NamedTempFile::new().expect("temp file");
    f.as_file().metadata().expect("metadata").uid()
}

fn fill(s: &str, vars: &BTreeMap<&'static str, String>) -> String {
    let mut s = s.to_string();
    for (k, v) in vars {
        s = s.replace(k, v);
    }
    s
}

/// Run `granule args` with `env`, bounded; the child is killed on the way out. Returns
/// its stderr, colour codes removed.
fn run_scenario(
    args: &[&str],
    env: &[(&str, &str)],
    nobody: bool,
    vars: &BTreeMap<&'static str, String>,
) -> String {
    let mut cmd = Command::new(GRANULE);
    cmd.args(args.iter().map(|a| fill(a, vars)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .current_dir(std::env::temp_dir());
    for (k, _) in std::env::vars() {
        if k.starts_with("GRANULE_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, fill(v, vars));
    }
    if nobody && granule_host::proc::is_root() {
        cmd.uid(65534).gid(65534);
    }
    let child = cmd.spawn().expect("start granule");
    let mut child = Reaped(child);
    let mut stderr = child.0.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.0.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(child); // kills it if it is still running
    strip_ansi(&reader.join().unwrap_or_default())
}

/// A quoted message: a code-block line that begins with `granule: error:`, or a
/// `WARN` log line.
fn is_quoted_message(line: &Line<'_>) -> bool {
    let t = line.text.trim_start();
    let t = t.strip_prefix("$ ").unwrap_or(t);
    line.in_code && (t.starts_with("granule: error:") || t.starts_with("WARN "))
}

#[test]
fn every_quoted_message_is_what_the_code_prints() {
    let started = Instant::now();
    let docs = docs();
    let quotes: Vec<(String, String)> = lines(&docs)
        .iter()
        .filter(|l| is_quoted_message(l))
        .map(|l| {
            let t = l.text.trim_start();
            (
                format!("{}:{}", l.doc, l.no),
                t.strip_prefix("$ ").unwrap_or(t).trim_end().to_string(),
            )
        })
        .collect();
    assert!(
        quotes.len() >= 14,
        "expected the docs to quote the troubleshooting messages: {quotes:#?}"
    );

    let scenarios = scenarios();
    let needs_cluster = scenarios.iter().any(
        |s| matches!(&s.how, How::Run { args, .. } if args.iter().any(|a| a.contains("{cluster}"))),
    );
    let setup = setup(needs_cluster);
    // Every scenario once, in parallel (each is a short run).
    let outputs: Vec<Result<String, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = scenarios
            .iter()
            .map(|s| {
                let vars = &setup.vars;
                scope.spawn(move || match &s.how {
                    How::Run { args, env, nobody } => {
                        Ok::<String, String>(run_scenario(args, env, *nobody, vars))
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("scenario thread"))
            .collect()
    });
    let mut failures = Vec::new();
    for (s, out) in scenarios.iter().zip(&outputs) {
        if let Err(e) = out {
            failures.push(format!("scenario \"{}\": {e}", s.name));
        }
    }
    let mut used = vec![false; scenarios.len()];
    let mut unreproduced = false;
    for (at, quote) in &quotes {
        let mut found = false;
        for (i, (s, out)) in scenarios.iter().zip(&outputs).enumerate() {
            let Ok(out) = out else { continue };
            let mut q = quote.clone();
            for (written, actual) in s.subst {
                let nobody = matches!(s.how, How::Run { nobody: true, .. });
                let mut vars = setup.vars.clone();
                vars.insert("{euid}", effective_uid(nobody).to_string());
                q = q.replace(written, &fill(actual, &vars));
            }
            if matches(&q, out) {
                found = true;
                used[i] = true;
            }
        }
        if !found {
            unreproduced = true;
            failures.push(format!(
                "{at} quotes a message no scenario reproduces:\n    {quote}\n\
                 Fix the quote to what the code prints (`...` matches anything), or add a \
                 scenario to `scenarios()` in crates/cli/tests/docs.rs (command, environment, \
                 substitutions for the parts that vary) whose stderr contains it."
            ));
        }
    }
    for (s, used) in scenarios.iter().zip(&used) {
        if !used {
            failures.push(format!(
                "scenario \"{}\" reproduces no quoted line of the docs: remove it, or fix it",
                s.name
            ));
        }
    }
    if unreproduced {
        let outs: Vec<String> = scenarios
            .iter()
            .zip(&outputs)
            .map(|(s, o)| match o {
                Ok(o) => format!("  [{}]\n{}", s.name, indent(o)),
                Err(e) => format!("  [{}] failed: {e}", s.name),
            })
            .collect();
        failures.push(format!("What the scenarios printed:\n{}", outs.join("\n")));
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
    eprintln!(
        "{} quoted messages checked against {} scenarios in {:.1} s",
        quotes.len(),
        scenarios.len(),
        started.elapsed().as_secs_f64()
    );
}

fn indent(s: &str) -> String {
    s.lines()
        .take(20)
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

// ---- stated defaults: the claims ----------------------------------------------------

/// How a claim is checked against the code.
enum Check {
    /// `granule_config::Config::default().get(key)` prints this.
    Setting(&'static str, &'static str),
    /// `granule SUBCOMMAND.. --help` shows `[default: VALUE]` for the flag.
    Flag(&'static [&'static str], &'static str, &'static str),
    /// A value the code exports, printed, equals the expected text.
    Value(fn() -> String, &'static str),
    /// A file of the repository contains this literal (for values that are not
    /// exported).
    Source(&'static str, &'static str),
    /// The phrase mentions a default but states none of Granule's (say why).
    NotAClaim(&'static str),
}

struct Claim {
    /// The document, from the repository root.
    file: &'static str,
    /// The phrase, exactly as written on one line of the file.
    phrase: &'static str,
    /// The value as the phrase writes it (spaces and backticks aside); must be in it.
    says: &'static str,
    check: Check,
}

fn setting(file: &'static str, phrase: &'static str, key: &'static str, v: &'static str) -> Claim {
    Claim {
        file,
        phrase,
        says: v,
        check: Check::Setting(key, v),
    }
}

fn claim(file: &'static str, phrase: &'static str, says: &'static str, check: Check) -> Claim {
    Claim {
        file,
        phrase,
        says,
        check,
    }
}

fn not_a_claim(file: &'static str, phrase: &'static str, why: &'static str) -> Claim {
    Claim {
        file,
        phrase,
        says: "",
        check: Check::NotAClaim(why),
    }
}

const CONCEPTS: &str = "docs/guide/concepts.md";
const PROGRAMMING: &str = "docs/guide/programming.md";
const TESTING: &str = "docs/guide/testing.md";
const CONFIGURATION: &str = "docs/guide/configuration.md";
const MULTI: &str = "docs/guide/multi-machine.md";
const OPERATIONS: &str = "docs/guide/operations.md";
const TROUBLESHOOTING: &str = "docs/guide/troubleshooting.md";
const TUTORIAL: &str = "docs/guide/tutorial.md";
const PUSHDOWN: &str = "docs/guide/pushdown.md";
const LIB: &str = "crates/granule/src/lib.rs";

fn two_default_nodes() -> String {
    let c = granule::Config::default();
    let specs: Vec<String> = c
        .cluster
        .nodes
        .iter()
        .map(|s| format!("cpu={},mem={}GiB", s.cores, s.mem_bytes >> 30))
        .collect();
    format!("{} of {}", specs.len(), specs.join(" and "))
}

const MEM_FREE_MIN_AUTO: &str =
    "default auto: a size such as 64MiB, or auto (10% of the limit, within 32MiB..=256MiB)";

fn mem_free_min_accepts() -> String {
    let key = "pressure.mem_free_min";
    let s = granule::config::setting(key).expect("pressure.mem_free_min");
    let default = granule::Config::default().get(key).unwrap_or_default();
    format!("default {default}: {}", s.accepts)
}

/// Every default the docs state, with its check. A new mention of a default (the word
/// next to a value) fails the test until it is added here.
fn claims() -> Vec<Claim> {
    const DEMO_NODES: Check = Check::Source(
        "crates/cli/src/demo.rs",
        "\"cpu=1,mem=512MiB;cpu=1,mem=512MiB;cpu=1,mem=512MiB\"",
    );
    vec![
        setting(
            "docs/guide/fs.md",
            "Files are cut into stripes (`fs.stripe`, 1 MiB by default). Each stripe is placed by",
            "fs.stripe",
            "1MiB",
        ),
        // moved from the README: docs/guide/programming.md, testing.md, operations.md
        claim(
            PROGRAMMING,
            "starts, by default, a controller inside the",
            "a controller inside the",
            Check::Setting("cluster.controller", "off"),
        ),
        claim(
            PROGRAMMING,
            "failure-detection timeout, default 1 s",
            "1 s",
            Check::Setting("cluster.failure_timeout", "1s"),
        ),
        claim(
            PROGRAMMING,
            "`ArgmaxPolicy` the default",
            "ArgmaxPolicy",
            Check::Source(
                "crates/runtime/src/node/monitor.rs",
                "policy: Box::new(ArgmaxPolicy::default())",
            ),
        ),
        claim(
            PROGRAMMING,
            "low-latency default: at most 2 MiB",
            "2 MiB",
            Check::Value(
                || format!("{} MiB", granule::sharded::Bounds::LOW_LATENCY.upper >> 20),
                "2 MiB",
            ),
        ),
        claim(
            PROGRAMMING,
            "`Greedy` (the default)",
            "Greedy",
            Check::Source(
                "crates/batch/src/lib.rs",
                "policy: Box::new(Greedy::default())",
            ),
        ),
        claim(
            PROGRAMMING,
            "(`short`, default 64)",
            "64",
            Check::Source("crates/batch/src/policy.rs", "short: 64,"),
        ),
        setting(
            TESTING,
            "`faults.enabled` is off by default",
            "faults.enabled",
            "off",
        ),
        claim(
            OPERATIONS,
            "throttled node stalls at most 20 ms, not the kernel default's 100)",
            "20 ms",
            Check::Setting("cluster.cfs_period", "20ms"),
        ),
        not_a_claim(
            OPERATIONS,
            "with the default weight",
            "the kernel's default cpu.shares; the value given next to it is an example flag",
        ),
        claim(
            PROGRAMMING,
            "in 512 KiB chunks",
            "512 KiB",
            Check::Setting("migration.chunk", "512KiB"),
        ),
        setting(PROGRAMMING, "chunks, 8 in flight", "migration.window", "8"),
        claim(
            PUSHDOWN,
            "1 GiB by default, set from the cluster's configuration",
            "1 GiB",
            Check::Setting("pushdown.caller_build_memory", "1GiB"),
        ),
        claim(
            PROGRAMMING,
            "averaged with a 1 s time constant",
            "1 s",
            Check::Setting("pressure.cpu_window", "1s"),
        ),
        claim(
            PROGRAMMING,
            "samples its memory every 5 ms",
            "5 ms",
            Check::Setting("pressure.mem_interval", "5ms"),
        ),
        claim(
            PROGRAMMING,
            "10 % of the limit, at least 32 MiB and at most 256 MiB",
            "32 MiB",
            Check::Value(mem_free_min_accepts, MEM_FREE_MIN_AUTO),
        ),
        claim(
            PROGRAMMING,
            "less than 2 s at the rate",
            "2 s",
            Check::Setting("pressure.mem_horizon", "2s"),
        ),
        claim(
            PROGRAMMING,
            "throttled in more than 20 % of its",
            "20 %",
            Check::Setting("pressure.cpu_throttled_max", "0.2"),
        ),
        claim(
            PROGRAMMING,
            "decided every 2 ms",
            "2 ms",
            Check::Value(
                || format!("{:?}", granule::batch::policy::DEFAULT_INTERVAL),
                "2ms",
            ),
        ),
        claim(
            PROGRAMMING,
            "(`new()`, shards ≤ 2 MiB",
            "2 MiB",
            Check::Value(
                || format!("{} MiB", granule::sharded::Bounds::LOW_LATENCY.upper >> 20),
                "2 MiB",
            ),
        ),
        claim(
            PROGRAMMING,
            "(`batching()`, shards ≤ 32 MiB",
            "32 MiB",
            Check::Value(
                || format!("{} MiB", granule::sharded::Bounds::BATCHING.upper >> 20),
                "32 MiB",
            ),
        ),
        claim(
            OPERATIONS,
            "heartbeats (every 100 ms)",
            "100 ms",
            Check::Setting("cluster.heartbeat", "100ms"),
        ),
        claim(
            OPERATIONS,
            "it keeps the last 2000",
            "2000",
            Check::Source(
                "crates/controller/src/state.rs",
                "pub const EVENT_LOG: usize = 2000;",
            ),
        ),
        claim(
            PROGRAMMING,
            "grows onto nodes with ≥ 0.6 idle cores",
            "0.6",
            Check::Value(
                || granule::batch::Greedy::default().min_spare.to_string(),
                "0.6",
            ),
        ),
        // docs/guide/concepts.md
        claim(
            CONCEPTS,
            "samples its memory every 5 ms",
            "5 ms",
            Check::Setting("pressure.mem_interval", "5ms"),
        ),
        claim(
            CONCEPTS,
            "CPU every 20 ms",
            "20 ms",
            Check::Setting("pressure.cpu_interval", "20ms"),
        ),
        claim(
            CONCEPTS,
            "below 10 % of its limit",
            "10 %",
            Check::Value(mem_free_min_accepts, MEM_FREE_MIN_AUTO),
        ),
        claim(
            CONCEPTS,
            "out within 2 s at the current growth rate",
            "2 s",
            Check::Setting("pressure.mem_horizon", "2s"),
        ),
        claim(
            CONCEPTS,
            "`Greedy` (the default: every",
            "Greedy",
            Check::Source(
                "crates/batch/src/lib.rs",
                "policy: Box::new(Greedy::default())",
            ),
        ),
        // docs/guide/configuration.md (its settings tables are checked row by row)
        claim(
            CONFIGURATION,
            "`ClusterBuilder::defaults` (that is how `granule demo` starts three nodes);",
            "three nodes",
            DEMO_NODES,
        ),
        claim(
            CONFIGURATION,
            "`--seconds S` (each call-rate measurement, default 0.5)",
            "0.5",
            Check::Flag(&["demo", "--exit"], "--seconds", "0.5"),
        ),
        claim(
            CONFIGURATION,
            "three `cpu=1,mem=512MiB` nodes unless `cluster.nodes` says otherwise",
            "cpu=1,mem=512MiB",
            DEMO_NODES,
        ),
        claim(
            CONFIGURATION,
            "`--out DIR` (default `docs/results`)",
            "docs/results",
            Check::Source(
                "crates/bench/src/main.rs",
                "default_value = \"docs/results\"",
            ),
        ),
        claim(
            CONFIGURATION,
            "`--listen ADDR` (default `0.0.0.0:7070`)",
            "0.0.0.0:7070",
            Check::Flag(&["controller"], "--listen", "0.0.0.0:7070"),
        ),
        claim(
            CONFIGURATION,
            "`--cpu N` (1)",
            "1",
            Check::Flag(&["node"], "--cpu", "1"),
        ),
        claim(
            CONFIGURATION,
            "`--mem SIZE` (`1GiB`)",
            "1GiB",
            Check::Flag(&["node"], "--mem", "1GiB"),
        ),
        claim(
            CONFIGURATION,
            "`--interval D` (`1s`)",
            "1s",
            Check::Flag(&["top"], "--interval", "1s"),
        ),
        // docs/guide/multi-machine.md
        claim(
            MULTI,
            "The dashboard binds to 127.0.0.1 by default",
            "127.0.0.1",
            Check::Setting("cluster.dashboard", "127.0.0.1:0"),
        ),
        setting(
            MULTI,
            "`GRANULE_DASHBOARD` (default `127.0.0.1:0`)",
            "cluster.dashboard",
            "127.0.0.1:0",
        ),
        setting(
            MULTI,
            "`127.0.0.1`, the default,",
            "cluster.listen_host",
            "127.0.0.1",
        ),
        claim(
            MULTI,
            "Nodes send heartbeats every 100 ms",
            "100 ms",
            Check::Setting("cluster.heartbeat", "100ms"),
        ),
        claim(
            MULTI,
            "a node silent for 1 s",
            "1 s",
            Check::Setting("cluster.failure_timeout", "1s"),
        ),
        // docs/guide/operations.md
        setting(
            OPERATIONS,
            "(default `127.0.0.1:0`, a free local port;",
            "cluster.dashboard",
            "127.0.0.1:0",
        ),
        claim(
            OPERATIONS,
            "`?after=SEQ` (default 0)",
            "0",
            Check::Source(
                "crates/controller/src/http.rs",
                "let after = query_u64(&q, \"after\").unwrap_or(0);",
            ),
        ),
        claim(
            OPERATIONS,
            "at most `?limit=N` (default 500)",
            "500",
            Check::Source("crates/controller/src/http.rs", ".unwrap_or(500)"),
        ),
        claim(
            OPERATIONS,
            "the controller keeps its last 2000",
            "2000",
            Check::Source(
                "crates/controller/src/state.rs",
                "pub const EVENT_LOG: usize = 2000;",
            ),
        ),
        claim(
            OPERATIONS,
            "every `--interval` (default `1s`)",
            "1s",
            Check::Flag(&["top"], "--interval", "1s"),
        ),
        setting(
            OPERATIONS,
            "(default `warn`; `info` shows",
            "cluster.log",
            "warn",
        ),
        // docs/guide/troubleshooting.md
        setting(
            TROUBLESHOOTING,
            "(`GRANULE_SHED` on, the default)",
            "pressure.shed",
            "on",
        ),
        // docs/guide/tutorial.md
        claim(
            TUTORIAL,
            "default two nodes of cpu=1,mem=1GiB",
            "two",
            Check::Value(two_default_nodes, "2 of cpu=1,mem=1GiB and cpu=1,mem=1GiB"),
        ),
        // crates/granule/src/lib.rs
        claim(
            LIB,
            "two of cpu=1,mem=1GiB by default",
            "two of cpu=1,mem=1GiB",
            Check::Value(two_default_nodes, "2 of cpu=1,mem=1GiB and cpu=1,mem=1GiB"),
        ),
    ]
}

/// `granule PATH --help`.
fn help(path: &[&str]) -> String {
    let out = Command::new(GRANULE)
        .args(path)
        .arg("--help")
        .output()
        .expect("granule --help");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `[default: ..]` clap prints for `flag` in `help`, if any.
fn flag_default(help: &str, flag: &str) -> Option<String> {
    let lines: Vec<&str> = help.lines().collect();
    let start = lines.iter().position(|l| {
        l.split(|c: char| c.is_whitespace() || c == ',' || c == '=')
            .any(|w| w == flag)
    })?;
    let mut text = String::new();
    for (i, l) in lines[start..].iter().enumerate() {
        if i > 0 && l.trim_start().starts_with('-') {
            break;
        }
        text.push_str(l);
        text.push(' ');
    }
    let at = text.find("[default: ")? + "[default: ".len();
    let end = text[at..].find(']')? + at;
    Some(text[at..end].to_string())
}

fn run_check(check: &Check) -> Result<(), String> {
    match check {
        Check::Setting(key, want) => match granule::Config::default().get(key) {
            Some(got) if got == *want => Ok(()),
            Some(got) => Err(format!(
                "the code's default of {key} is `{got}`, not `{want}`"
            )),
            None => Err(format!("no setting {key}")),
        },
        Check::Flag(path, flag, want) => {
            let help = help(path);
            match flag_default(&help, flag) {
                Some(got) if got == *want => Ok(()),
                got => Err(format!(
                    "`granule {} --help` gives {flag} the default {got:?}, not `{want}`:\n{help}",
                    path.join(" ")
                )),
            }
        }
        Check::Value(f, want) => match f() {
            got if got == *want => Ok(()),
            got => Err(format!("the code gives `{got}`, not `{want}`")),
        },
        Check::Source(file, literal) => {
            let text = std::fs::read_to_string(repo().join(file))
                .map_err(|e| format!("cannot read {file}: {e}"))?;
            if text.contains(literal) {
                Ok(())
            } else {
                Err(format!("{file} no longer contains `{literal}`"))
            }
        }
        Check::NotAClaim(why) if why.trim().is_empty() => {
            Err("a phrase that states no default needs the reason".into())
        }
        Check::NotAClaim(_) => Ok(()),
    }
}

/// The byte offsets in `line` where a stated default must be covered by a claim: the
/// word "default" (or "defaults") next to a value, outside backticks (there it names
/// code: `Config::default()`), and in code blocks only inside comments; and in the
/// guide's table of `granule` commands, a flag followed by its value in parentheses.
fn default_mentions(line: &Line<'_>) -> Vec<usize> {
    let text = line.text;
    let mut out = Vec::new();
    let from = if line.in_code {
        match text.find("//").or_else(|| text.find("# ")) {
            Some(i) => i,
            None => return out,
        }
    } else {
        // A numbered list's marker ("1. ") is not a value.
        let t = text.trim_start();
        let digits = t.chars().take_while(char::is_ascii_digit).count();
        if digits > 0 && t[digits..].starts_with(". ") {
            text.len() - t.len() + digits + 2
        } else {
            0
        }
    };
    // A value near the word: a digit or a backtick within 25 bytes before it or 45 after.
    let near_value = |i: usize| {
        let (mut lo, mut hi) = (i.saturating_sub(25).max(from), (i + 45).min(text.len()));
        while !text.is_char_boundary(lo) {
            lo += 1;
        }
        while !text.is_char_boundary(hi) {
            hi -= 1;
        }
        text[lo..hi].chars().any(|c| c.is_ascii_digit() || c == '`')
    };
    let lower = text.to_ascii_lowercase();
    let mut in_ticks = false;
    let bytes = text.as_bytes();
    for i in 0..text.len() {
        if bytes[i] == b'`' {
            in_ticks = !in_ticks;
        }
        if i < from || (in_ticks && !line.in_code) || !text.is_char_boundary(i) {
            continue;
        }
        if lower[i..].starts_with("default") {
            let before = if i == 0 { b' ' } else { bytes[i - 1] };
            let names_code = before.is_ascii_alphanumeric() || matches!(before, b'_' | b':' | b'.');
            if !names_code && near_value(i) {
                out.push(i);
            }
        }
    }
    if !line.in_code && text.starts_with("| `granule ") {
        // `--flag X` (VALUE): a value, not a setting's key or variable.
        let mut at = 0;
        while let Some(i) = text[at..].find("` (") {
            let open = at + i + 2;
            let close = text[open..]
                .find(')')
                .map(|j| open + j)
                .unwrap_or(text.len());
            let inner = text[open + 1..close].trim_matches('`');
            let names_a_setting = inner.starts_with("GRANULE_")
                || granule::config::SETTINGS.iter().any(|s| s.key == inner);
            if !inner.contains(' ') && !inner.is_empty() && !names_a_setting {
                out.push(open);
            }
            at = open;
        }
    }
    out
}

/// A settings-table row of the configuration chapter: (key, default cell).
fn settings_row(text: &str) -> Option<(String, String)> {
    let cells: Vec<&str> = text.split('|').map(str::trim).collect();
    if cells.len() < 6 || !cells[2].starts_with("`GRANULE_") {
        return None;
    }
    Some((cells[1].trim_matches('`').to_string(), cells[3].to_string()))
}

#[test]
fn every_stated_default_is_the_codes() {
    let docs = docs();
    let all = lines(&docs);
    let claims = claims();
    let mut failures = Vec::new();

    // The settings tables: every row's default is Config::default()'s.
    let defaults = granule::Config::default();
    let mut rows = 0;
    for l in all.iter().filter(|l| l.doc == CONFIGURATION && !l.in_code) {
        let Some((key, cell)) = settings_row(l.text) else {
            continue;
        };
        rows += 1;
        let want = match defaults.get(&key) {
            Some(v) if v.is_empty() => "(empty)".to_string(),
            Some(v) => format!("`{v}`"),
            None => {
                failures.push(format!("{CONFIGURATION}:{}: no setting {key}", l.no));
                continue;
            }
        };
        if cell != want {
            failures.push(format!(
                "{CONFIGURATION}:{}: {key} defaults to {want}, the table says {cell} \
                 (`cargo run -p granule-config --example settings_table` prints the tables)",
                l.no
            ));
        }
    }
    assert_eq!(
        rows,
        granule::config::SETTINGS.len(),
        "one settings-table row per setting in {CONFIGURATION}"
    );

    // Every claim: its phrase is still in its file, says its value, and the code agrees.
    let mut covered: Vec<(String, usize, usize, usize)> = Vec::new(); // doc, line, from, to
    for c in &claims {
        let hits: Vec<&Line<'_>> = all
            .iter()
            .filter(|l| l.doc == c.file && l.text.contains(c.phrase))
            .collect();
        if hits.is_empty() {
            failures.push(format!(
                "claim \"{}\" is no longer in {}: update or remove it in `claims()` of crates/cli/tests/docs.rs",
                c.phrase, c.file
            ));
            continue;
        }
        for l in hits {
            let from = l.text.find(c.phrase).expect("found above");
            covered.push((c.file.to_string(), l.no, from, from + c.phrase.len()));
        }
        if !matches!(c.check, Check::NotAClaim(_)) && !squash(c.phrase).contains(&squash(c.says)) {
            failures.push(format!(
                "claim \"{}\" ({}): its phrase does not say `{}`",
                c.phrase, c.file, c.says
            ));
        }
        if let Err(e) = run_check(&c.check) {
            failures.push(format!("{}: \"{}\": {e}", c.file, c.phrase));
        }
    }

    // Every mention of a default is covered by a claim.
    for l in &all {
        if l.doc == CONFIGURATION && settings_row(l.text).is_some() {
            continue;
        }
        for at in default_mentions(l) {
            let ok = covered
                .iter()
                .any(|(d, no, from, to)| d == l.doc && *no == l.no && (*from..*to).contains(&at));
            if !ok {
                failures.push(format!(
                    "{}:{} states a default no test checks:\n    {}\n\
                     Add a claim to `claims()` in crates/cli/tests/docs.rs: the phrase as \
                     written (it must contain the position marked: `{}`), the value it \
                     says, and a check (Check::Setting for a configuration setting, \
                     Check::Flag for a flag, Check::Value for an exported constant, \
                     Check::Source for a literal, Check::NotAClaim with the reason if it \
                     states no default of Granule's).",
                    l.doc,
                    l.no,
                    l.text.trim(),
                    &l.text[at..(at + 24).min(l.text.len())]
                ));
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}

/// The detector of stated defaults itself: what it must flag and what it must not.
#[test]
fn the_default_detector_flags_values_and_skips_code_names() {
    let line = |text: &'static str, in_code: bool| Line {
        doc: "x",
        no: 1,
        text,
        in_code,
    };
    assert_eq!(
        default_mentions(&line("a timeout (default 1 s)", false)).len(),
        1
    );
    assert_eq!(
        default_mentions(&line("binds to `127.0.0.1` by default", false)).len(),
        1
    );
    assert!(default_mentions(&line("never replaced by a default:", false)).is_empty());
    assert!(default_mentions(&line("1. the defaults: the built-in ones, or a", false)).is_empty());
    assert!(default_mentions(&line(
        "`Cluster::builder()` follows the precedence: the defaults, then",
        false
    ))
    .is_empty());
    assert_eq!(
        default_mentions(&line("`plot.png` (DIR defaults to `docs/results`)", false)).len(),
        1
    );
    assert!(default_mentions(&line("`Config::default()` and `or_default` 1", false)).is_empty());
    assert!(default_mentions(&line("let c = Config::default(); // 1", true)).is_empty());
    assert_eq!(
        default_mentions(&line("x(); // two of cpu=1 by default", true)).len(),
        1
    );
    assert_eq!(
        default_mentions(&line(
            "| `granule top` | `--controller ADDR` (`GRANULE_CONTROLLER`), `--interval D` (`1s`) | x |",
            false
        ))
        .len(),
        1
    );
    assert!(matches(
        "WARN a: b ... (euid 7)",
        &strip_ansi("2024 \u{1b}[33m WARN\u{1b}[0m a: b c (euid 7). For")
    ));
    assert!(!matches(
        "granule: error: a ... c",
        "granule: error: c ... a"
    ));
    assert_eq!(
        flag_default("  --cpu <CPU>\n          Cores [default: 1]\n  --mem <MEM>\n          [default: 1GiB]\n", "--mem"),
        Some("1GiB".into())
    );
}

// ---- quoted messages in running text ---------------------------------------------------

/// Inline code spans of five words or more outside code blocks: messages quoted in running
/// text, unless they are code or commands (which the guide test and the doc tests check).
fn inline_spans(docs: &[Doc]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for d in docs {
        let mut in_code = false;
        let mut prose = String::new();
        for l in &d.lines {
            if l.trim_start().starts_with("```") {
                in_code = !in_code;
                prose.push('\n');
                continue;
            }
            if !in_code {
                prose.push_str(l);
                prose.push('\n');
            }
        }
        let mut parts = prose.split('`');
        parts.next(); // text before the first span
        while let (Some(span), Some(_after)) = (parts.next(), parts.next()) {
            let span = span.split_whitespace().collect::<Vec<_>>().join(" ");
            let code = span.contains("::")
                || span.contains("(&")
                || span.contains('|')
                || ["cargo ", "granule-bench", "granule controller --"]
                    .iter()
                    .any(|p| span.starts_with(p));
            if span.split(' ').count() >= 5 && !code {
                out.push((d.name.clone(), span));
            }
        }
    }
    out
}

/// Quote placeholders (`N`, `MESSAGE`, `ADDR`) match anything, as `...` does.
fn placeholders_as_wildcards(quote: &str) -> String {
    quote
        .split(' ')
        .map(|w| {
            let w = w.replace("nN", "n...").replace("pN", "p...");
            match w.as_str() {
                "N" | "MESSAGE" | "ADDR" => "...".to_string(),
                _ => w.replace("ADDR:", "...:"),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Makes the text a quoted message must occur in.
type MakeText = Box<dyn Fn() -> String>;

/// Every message quoted in running text, with how the code makes it: the quote (spaces
/// squashed to one) and the text it must occur in.
fn inline_messages() -> Vec<(&'static str, MakeText)> {
    use granule::{CallError, Config, NodeId, ProcletId};
    let env_error = |var: &'static str, value: &'static str| {
        Config::load_over(Config::default(), move |k: &str| {
            (k == var).then(|| value.to_string())
        })
        .expect_err("the value is refused")
        .to_string()
    };
    vec![
        (
            "cluster.cgroups (GRANULE_CGROUPS=yes): 'yes' is not a cgroups mode (accepts auto or off)",
            Box::new(move || env_error("GRANULE_CGROUPS", "yes")),
        ),
        (
            "cluster.heartbeat (2s) must be shorter than cluster.failure_timeout (1s)",
            Box::new(|| {
                let mut c = Config::default();
                c.set("cluster.heartbeat", "2s").expect("a duration");
                c.set("cluster.failure_timeout", "1s").expect("a duration");
                c.validate().expect_err("refused").to_string()
            }),
        ),
        (
            "unknown setting 'migration.throtle' (in granule.toml: '1GB/s') (did you mean migration.throttle?)",
            Box::new(|| {
                let dir = tempfile::tempdir().expect("tempdir");
                std::fs::write(dir.path().join("granule.toml"), "[migration]\nthrotle = \"1GB/s\"\n")
                    .expect("write");
                // Relative, as a user names it.
                let cwd = std::env::current_dir().expect("cwd");
                let file = dir.path().join("granule.toml");
                let shown = file.strip_prefix(&cwd).unwrap_or(&file).display().to_string();
                let e = Config::default()
                    .apply_toml_file(&file)
                    .expect_err("refused")
                    .to_string();
                e.replace(&shown, "granule.toml")
                    .replace(&file.display().to_string(), "granule.toml")
            }),
        ),
        (
            "no capacity: no node has room for a memory proclet of N bytes (every node is out of memory budget)",
            Box::new(|| {
                let cluster = granule::Cluster::builder()
                    .nodes("cpu=1,mem=64MiB")
                    .expect("spec")
                    .driver(granule::config::parse_spec("cpu=1,mem=64MiB").expect("spec"))
                    .start()
                    .expect("a small cluster");
                let e = granule::Proclet::builder(granule::Kind::Memory)
                    .mem_hint(1 << 40)
                    .create((), |()| 0u64)
                    .expect_err("a TiB fits nowhere")
                    .to_string();
                cluster.shutdown();
                e
            }),
        ),
        (
            "node nN is unreachable: ...",
            Box::new(|| {
                CallError::NodeUnreachable {
                    node: NodeId(3),
                    reason: "the controller declared it dead".into(),
                }
                .to_string()
            }),
        ),
        (
            "closure on proclet pN panicked: MESSAGE",
            Box::new(|| {
                CallError::RemotePanic {
                    proclet: ProcletId(7),
                    message: "index out of bounds".into(),
                }
                .to_string()
            }),
        ),
        (
            "granule node 0: cannot start: ...",
            Box::new(|| {
                run_scenario(
                    &["demo", "--seconds", "0.01", "--exit"],
                    &[
                        ("GRANULE_NODES", "cpu=1,mem=256MiB"),
                        ("GRANULE_FAULTS", "on"),
                        ("GRANULE_FAILPOINTS", "node.start=error"),
                    ],
                    false,
                    &BTreeMap::new(),
                )
            }),
        ),
        (
            "granule controller listening on ...",
            Box::new(|| {
                use std::io::BufRead;
                let mut ctl = Reaped(
                    Command::new(GRANULE)
                        .args(["controller", "--listen", "127.0.0.1:0", "--dashboard", "off"])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::null())
                        .spawn()
                        .expect("start a controller"),
                );
                let out = ctl.0.stdout.take().expect("stdout");
                std::io::BufReader::new(out)
                    .lines()
                    .next()
                    .and_then(Result::ok)
                    .unwrap_or_default()
            }),
        ),
        (
            // The HTTP doors' warnings under a flood (crates/granule/tests/http_doors.rs
            // floods them; here the literal is checked where the code formats it).
            "front door on ADDR: refusing connections: ...",
            Box::new(|| {
                let http = std::fs::read_to_string(repo().join("crates/http/src/lib.rs"))
                    .expect("http");
                let service = std::fs::read_to_string(repo().join("crates/service/src/http.rs"))
                    .expect("service http");
                let door = if service.contains("format!(\"front door on {addr}\")") {
                    "front door on 127.0.0.1:80"
                } else {
                    "(the service crate no longer names its door 'front door on {addr}')"
                };
                if http.contains("\"{door}: refusing connections: ") {
                    format!("{door}: refusing connections: 256 open (http.max_connections)")
                } else {
                    "(crates/http no longer formats '{door}: refusing connections: ')".into()
                }
            }),
        ),
        (
            "accepting a connection failed: Too many open files",
            Box::new(|| {
                let http = std::fs::read_to_string(repo().join("crates/http/src/lib.rs"))
                    .expect("http");
                let e = std::io::Error::from_raw_os_error(24); // EMFILE
                if http.contains("\"{door}: accepting a connection failed: {e}\"") {
                    format!("door: accepting a connection failed: {e}")
                } else {
                    "(crates/http no longer formats '{door}: accepting a connection failed: {e}')"
                        .into()
                }
            }),
        ),
    ]
}

#[test]
fn every_message_quoted_in_running_text_is_what_the_code_says() {
    let docs = docs();
    let spans = inline_spans(&docs);
    let known = inline_messages();
    let mut failures = Vec::new();
    for (doc, span) in &spans {
        if !known.iter().any(|(q, _)| q == span) {
            failures.push(format!(
                "{doc} quotes `{span}` in running text, and no entry of inline_messages() in \
                 crates/cli/tests/docs.rs makes it: add one (the quote and a closure that \
                 produces the code's text), or put the message in a code block a scenario \
                 reproduces"
            ));
        }
    }
    for (quote, make) in &known {
        if !spans.iter().any(|(_, s)| s == quote) {
            failures.push(format!(
                "inline_messages() checks `{quote}`, which no document quotes any more: \
                 remove the entry"
            ));
            continue;
        }
        let text = strip_ansi(&make());
        if !matches(&placeholders_as_wildcards(quote), &text) {
            failures.push(format!(
                "`{quote}` is not what the code says:\n{}",
                indent(&text)
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}
