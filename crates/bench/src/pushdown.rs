//! `granule-bench pushdown`: TPC-H-style queries over tables spread on memory-rich nodes
//! whose pushed-work CPU is capped at 100 %, 50 % and 20 % of a core, each run pulled,
//! pushed and by the cost rule, next to a raw loopback TCP stream of the pulled bytes and
//! the same queries in DuckDB with all data in one process (EVALUATION.md, pushdown).
//!
//! - **Cluster** (one per cap): two data nodes `cpu=1,mem=8GiB`, whose pushdown pools
//!   (one thread each) are capped by `pushdown.cpu_cap`; the driver, with 256 MiB in its
//!   spec, is the caller and holds no table shard (any the placement put there is moved
//!   to a data node). Pulled columns stream to the driver, which computes on one thread
//!   as row groups arrive, 4 fetches in flight.
//! - **Data**: `lineitem`, `orders`, `part` and `docs` generated deterministically
//!   (seed 42) at the scale factor below, 64 Ki rows per row group, in shards of 16–64
//!   MiB split evenly over the two data nodes.
//! - **Runs**: per cap and query, pull, push and the rule interleaved, in 12 rounds that
//!   take the six orders of the three in turn; a run repeats the query back to back
//!   until the fastest mode's run lasts 150 ms, at most 32 times (the rule's
//!   executor keeps what it measured across runs, as a long-lived application's would;
//!   it is new per cap, so each cap starts with a calibration). Every result is checked
//!   against the in-process reference executor's; the DuckDB run checks that the
//!   reference equals DuckDB's.
//! - **Figures**: medians; `pull_vs_raw_tcp` = the rate at which pulling moves Q6's four
//!   columns with no compute ÷ one raw loopback TCP stream of the same bytes;
//!   `q6_push_vs_pull_100` = pull time ÷ push time at 100 %; `rule_vs_best_min` = the
//!   lowest, over queries and caps, of min(pull, push) ÷ rule; `rule_wrong_choices` =
//!   settings where pull and push differ by more than 15 % and the rule's time lies nearer
//!   the slower one's; `join_push_vs_pull_50` = Q14's pull ÷ push time at
//!   50 %; `granule_vs_duckdb_q6` = DuckDB's Q6 time ÷ the rule's at 100 %.

use crate::BenchOpts;
use anyhow::{anyhow, bail, Context};
use granule::sharded::Bounds;
use granule::{Cluster, NodeSpec};
use granule_pushdown::dist::{load_spread, Executor, Tables};
use granule_pushdown::explain::Explain;
use granule_pushdown::rule::{Choice, Mode};
use granule_pushdown::{queries, row_groups, run_local, Query, QueryResult, Table, TableName};
use granule_report::{Cell, Meta, Plot, Report, Summary, Table as RTable};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

struct Params {
    sf: f64,
    caps: Vec<f64>,
    reps: usize,
    rows_per_group: u32,
}

impl Params {
    fn new(quick: bool) -> Params {
        if quick {
            Params {
                sf: 0.02,
                caps: vec![1.0, 0.2],
                reps: 1,
                rows_per_group: 16 << 10,
            }
        } else {
            Params {
                sf: 0.5,
                caps: vec![1.0, 0.5, 0.2],
                reps: 12,
                rows_per_group: granule_pushdown::DEFAULT_ROWS_PER_GROUP,
            }
        }
    }
}

const SEED: u64 = 42;
/// A timed run lasts at least this long for the fastest mode (seconds)...
const RUN_AT_LEAST: f64 = 0.15;
/// ...repeating the query at most this many times.
const MAX_TIMES: usize = 32;
/// The orders of the three modes within a round: every permutation, so over six rounds
/// each mode runs first, second and third twice and follows each other mode twice.
const ORDERS: [[usize; 3]; 6] = [
    [0, 1, 2],
    [1, 2, 0],
    [2, 0, 1],
    [2, 1, 0],
    [0, 2, 1],
    [1, 0, 2],
];
const MODES: [(&str, Choice); 3] = [
    ("pull", Choice::Force(Mode::Pull)),
    ("push", Choice::Force(Mode::Push)),
    ("rule", Choice::Auto),
];

/// The times of one (cap, query): seconds per mode, and the rule's explains.
struct Setting {
    cap: f64,
    query: String,
    secs: BTreeMap<&'static str, Vec<f64>>,
    explains: Vec<Explain>,
    /// Executions of the query per timed run.
    times: usize,
}

impl Setting {
    fn median(&self, mode: &str) -> f64 {
        self.secs
            .get(mode)
            .and_then(|v| Summary::of(v))
            .map_or(f64::NAN, |s| s.median)
    }
}

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let p = Params::new(opts.quick);
    let progress = granule_report::Progress::new(p.caps.len() as u64 + 3, "pushdown");
    let local = generate(&p)?;
    let queries = queries::all()?;
    let reference: BTreeMap<String, QueryResult> = queries
        .iter()
        .map(|q| Ok((q.name.clone(), run_local(q, &local)?)))
        .collect::<anyhow::Result<_>>()?;
    progress.step(format!(
        "generated SF {} ({} lineitem rows); DuckDB with all data in one process",
        p.sf,
        local[&TableName::Lineitem]
            .groups
            .iter()
            .map(|g| g.rows as u64)
            .sum::<u64>()
    ));
    let duck = duckdb(&local, &reference, p.reps)?;
    let mut settings = Vec::new();
    let mut stream = None;
    for &cap in &p.caps {
        progress.step(format!(
            "cap {:.0} %: starting a cluster and loading",
            cap * 100.0
        ));
        let (mut s, st) = measure_cap(&p, cap, &local, &queries, &reference, stream.is_none())?;
        if st.is_some() {
            stream = st;
        }
        settings.append(&mut s);
    }
    progress.step("writing the report");
    report(opts, &p, &settings, stream, &duck)
}

/// The four tables, generated once and loaded into each cap's cluster.
fn generate(p: &Params) -> anyhow::Result<BTreeMap<TableName, Table>> {
    let mut out = BTreeMap::new();
    for t in TableName::ALL {
        let g = row_groups(t, p.sf, SEED, p.rows_per_group)?;
        let schema = g.schema().clone();
        out.insert(
            t,
            Table {
                schema,
                groups: g.collect(),
            },
        );
    }
    Ok(out)
}

/// Pull-only streaming of Q6's columns and raw TCP of the same bytes: (GB/s, GB/s).
type Stream = (Vec<f64>, Vec<f64>);

fn measure_cap(
    p: &Params,
    cap: f64,
    local: &BTreeMap<TableName, Table>,
    queries: &[Query],
    reference: &BTreeMap<String, QueryResult>,
    measure_stream: bool,
) -> anyhow::Result<(Vec<Setting>, Option<Stream>)> {
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=8GiB;cpu=1,mem=8GiB")?
        .driver(NodeSpec {
            cores: 1.0,
            mem_bytes: 256 << 20,
        })
        .set("pushdown.cpu_cap", &format!("{cap}"))?
        .shed(false)
        .start()
        .context("starting the cluster")?;
    let out = (|| {
        let data = cluster.worker_nodes()?;
        if data.len() < 2 {
            bail!(
                "expected two data nodes, the controller knows {}",
                data.len()
            );
        }
        // The shards spread evenly over the data nodes, none on the caller.
        let mut tables = load_spread(&cluster, local, Bounds::new(16 << 20, 64 << 20)?, &data)?;
        let stream = if measure_stream {
            Some(stream_vs_tcp(&tables, p.reps)?)
        } else {
            None
        };
        let mut exec = Executor::configured(cluster.config());
        // The caller and both data nodes share this machine's vCPUs: the rule counts that.
        exec.shared_cores = Some(vcpus());
        let mut settings = Vec::new();
        for q in queries {
            let want = &reference[&q.name];
            let mut s = Setting {
                cap,
                query: q.name.clone(),
                secs: BTreeMap::new(),
                explains: Vec::new(),
                times: 1,
            };
            // One untimed run of each warms connections (and calibrates the rule), and
            // sizes the timed runs: a run repeats the query `times` times back to back,
            // enough for the fastest mode's run to last `RUN_AT_LEAST`, so a millisecond
            // of jitter does not decide a ratio.
            let mut fastest = f64::INFINITY;
            for (_, choice) in MODES {
                let t = Instant::now();
                exec.run(q, &tables, choice)?;
                fastest = fastest.min(t.elapsed().as_secs_f64());
            }
            let times = ((RUN_AT_LEAST / fastest).ceil() as usize).clamp(1, MAX_TIMES);
            s.times = times;
            for rep in 0..p.reps {
                // Each round takes the next of the six orders: a run can slow the one
                // after it (a capped pool that used its quota, caches, the allocator),
                // so every mode follows every other equally often.
                for k in ORDERS[rep % ORDERS.len()] {
                    let (name, choice) = MODES[k];
                    let t = Instant::now();
                    let mut last = None;
                    for _ in 0..times {
                        let (got, explain) = exec.run(q, &tables, choice)?;
                        if &got != want {
                            bail!(
                                "{} ({name}, cap {cap}) disagrees with the reference executor",
                                q.name
                            );
                        }
                        last = Some(explain);
                    }
                    let secs = t.elapsed().as_secs_f64() / times as f64;
                    s.secs.entry(name).or_default().push(secs);
                    if let (Some(explain), "rule") = (last, name) {
                        s.explains.push(explain);
                    }
                }
            }
            let runs = |m: &str| {
                s.secs
                    .get(m)
                    .map(|v| {
                        v.iter()
                            .map(|x| format!("{:.0}", x * 1e3))
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .unwrap_or_default()
            };
            let mut choices: BTreeMap<String, usize> = BTreeMap::new();
            for e in &s.explains {
                *choices.entry(e.summary()).or_default() += 1;
            }
            let choices: Vec<String> = choices.iter().map(|(c, n)| format!("{c} x{n}")).collect();
            eprintln!(
                "pushdown: cap {:.0} %, {}: pull {:.1} ms, push {:.1} ms, rule {:.1} ms ({}); rule's choices: {}; runs (ms): pull {}; push {}; rule {}",
                cap * 100.0,
                q.name,
                s.median("pull") * 1e3,
                s.median("push") * 1e3,
                s.median("rule") * 1e3,
                s.explains.last().map_or(String::new(), Explain::summary),
                choices.join(", "),
                runs("pull"),
                runs("push"),
                runs("rule"),
            );
            settings.push(s);
        }
        for (_, t) in std::mem::take(&mut tables) {
            t.destroy()?;
        }
        Ok((settings, stream))
    })();
    cluster.shutdown();
    out
}

/// Pulling Q6's columns with no compute, against one raw loopback TCP stream of the same
/// bytes, interleaved: per run, GB/s of each.
fn stream_vs_tcp(tables: &Tables, reps: usize) -> anyhow::Result<Stream> {
    let li = tables
        .get(&TableName::Lineitem)
        .ok_or_else(|| anyhow!("no lineitem"))?;
    let cols = queries::q6()?.stage.columns();
    let (mut pull, mut tcp) = (Vec::new(), Vec::new());
    li.stream(&cols, 4)?;
    for _ in 0..reps.max(3) {
        let (bytes, took) = li.stream(&cols, 4)?;
        pull.push(bytes as f64 / took.as_secs_f64() / 1e9);
        tcp.push(crate::fs::raw_tcp(bytes)?);
    }
    Ok((pull, tcp))
}

/// DuckDB's run of every query over CSVs of the same data: median seconds per query,
/// after checking its results equal the reference executor's.
fn duckdb(
    local: &BTreeMap<TableName, Table>,
    reference: &BTreeMap<String, QueryResult>,
    reps: usize,
) -> anyhow::Result<BTreeMap<String, f64>> {
    let dir = tempfile::tempdir().context("a temporary directory for the CSVs")?;
    for (t, table) in local {
        granule_pushdown::write_csv(
            &table.schema,
            &table.groups,
            &dir.path().join(format!("{}.csv", t.name())),
        )?;
    }
    let py = python()?;
    let script = workspace().join("crates/pushdown/py/reference.py");
    let out = std::process::Command::new(&py)
        .arg(&script)
        .arg(dir.path())
        .arg("--time")
        .arg(reps.max(1).to_string())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut times = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut f = line.split('\t');
        let (Some(name), Some(json), Some(secs)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let want = reference
            .get(name)
            .ok_or_else(|| anyhow!("DuckDB ran an unknown query {name}"))?;
        if want.to_json() != json {
            bail!("DuckDB's {name} differs from Granule's reference executor");
        }
        times.insert(name.to_string(), secs.parse::<f64>()?);
    }
    if times.len() != reference.len() {
        bail!(
            "DuckDB answered {} of {} queries",
            times.len(),
            reference.len()
        );
    }
    Ok(times)
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The venv's python (made by `bash scripts/deps.sh`).
fn python() -> anyhow::Result<PathBuf> {
    let py = workspace().join("target/ray-venv/bin/python");
    if !py.exists() {
        bail!(
            "{} is missing: run `bash scripts/deps.sh` (it installs DuckDB into that venv)",
            py.display()
        );
    }
    Ok(py)
}

fn report(
    opts: &BenchOpts,
    p: &Params,
    settings: &[Setting],
    stream: Option<Stream>,
    duck: &BTreeMap<String, f64>,
) -> anyhow::Result<PathBuf> {
    let mut table = RTable::new(&[
        "cap",
        "query",
        "pull_ms",
        "push_ms",
        "rule_ms",
        "duckdb_ms",
        "push_vs_pull",
        "best_vs_rule",
        "rule_choice",
        "executions_per_run",
    ]);
    let mut rule_vs_best_min = f64::INFINITY;
    let mut wrong = 0;
    let mut labels = Vec::new();
    let mut series: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for s in settings {
        let (pull, push, rule) = (s.median("pull"), s.median("push"), s.median("rule"));
        let best = pull.min(push);
        rule_vs_best_min = rule_vs_best_min.min(best / rule);
        // Wrong: pull and push differ by more than 15 % and the rule's time lies nearer the
        // slower one's (for a plan that splits an operator, "picked" is judged by outcome).
        let slower = pull.max(push);
        if (pull - push).abs() / best > 0.15 && rule > (best + slower) / 2.0 {
            wrong += 1;
        }
        labels.push(format!("{} @{:.0}%", s.query, s.cap * 100.0));
        for (m, v) in [("pull", pull), ("push", push), ("rule", rule)] {
            series.entry(m).or_default().push(v * 1e3);
        }
        table.row(vec![
            Cell::from(s.cap),
            Cell::from(s.query.as_str()),
            Cell::from(pull * 1e3),
            Cell::from(push * 1e3),
            Cell::from(rule * 1e3),
            Cell::from(duck.get(&s.query).map_or(f64::NAN, |d| d * 1e3)),
            Cell::from(pull / push),
            Cell::from(best / rule),
            Cell::from(
                s.explains
                    .last()
                    .map_or("-".to_string(), Explain::summary)
                    .as_str(),
            ),
            Cell::from(s.times),
        ]);
    }
    let mut plot = Plot::bars("Query time by cap: pull, push, the cost rule")
        .y_label("median time (ms)")
        .categories(labels);
    for (m, v) in series {
        plot.push_bar_series(m, v);
    }
    let find = |q: &str, cap: f64| {
        settings
            .iter()
            .find(|s| s.query == q && (s.cap - cap).abs() < 1e-9)
    };
    let mut meta = Meta::collect(
        "nothing pinned: the driver (caller), the two data nodes' runtimes and their capped pushdown \
         pool threads, and DuckDB's process float over every vCPU"
            .to_string(),
        opts.quick,
    );
    meta.note(format!(
        "data: SF {} (lineitem {} rows), seed {SEED}, {} rows per row group; two data nodes cpu=1,mem=8GiB, \
         one pool thread each capped at the stated share of a core (pushdown.cpu_cap); the driver (256 MiB) \
         pulls with 4 fetches in flight and computes on one thread; {} interleaved rounds of pull, push and the \
         rule per setting (each round one of the six orders of the three), medians; a timed run executes the query \
         back to back as often as makes the fastest mode's run last 150 ms (at most 32; executions_per_run) and \
         counts the time per execution; the rule's executor keeps its figures across \
         runs and is new per cap; a CPU scheduler period of 20 ms (cluster.cfs_period). DuckDB: one process, all data loaded from CSV before timing, median of the \
         same number of runs.",
        p.sf,
        (p.sf * 6e6) as u64,
        p.rows_per_group,
        p.reps
    ));
    let mut rep = Report::new("pushdown", meta);
    rep.title("Benchmark: pushdown — pull vs push vs the cost rule, by the data nodes' CPU cap");
    rep.table(table);
    rep.plot(plot);
    if let Some((pull, tcp)) = &stream {
        let (a, b) = (med(pull), med(tcp));
        rep.summary("pull_vs_raw_tcp", a / b);
        rep.summary("pull_stream_gbps", a);
        rep.summary("raw_tcp_gbps", b);
    }
    if let Some(s) = find("q6", 1.0) {
        rep.summary("q6_push_vs_pull_100", s.median("pull") / s.median("push"));
        if let Some(d) = duck.get("q6") {
            rep.summary("granule_vs_duckdb_q6", d / s.median("rule"));
        }
    }
    if let Some(s) = find("q14", 0.5) {
        rep.summary("join_push_vs_pull_50", s.median("pull") / s.median("push"));
    }
    rep.summary("rule_vs_best_min", rule_vs_best_min);
    rep.summary("rule_wrong_choices", wrong as f64);
    rep.summary("scale_factor", p.sf);
    // The explain of the rule's last run of every query at every cap, as printed.
    let explains: String = settings
        .iter()
        .filter_map(|s| {
            s.explains
                .last()
                .map(|e| format!("cap {:.0} %\n{e}\n", s.cap * 100.0))
        })
        .collect();
    rep.note("explain output of the rule's last run per setting: explain.txt");
    let dir = rep.write(&opts.out)?;
    std::fs::write(dir.join("explain.txt"), explains)?;
    Ok(dir)
}

fn vcpus() -> f64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

fn med(v: &[f64]) -> f64 {
    Summary::of(v).map_or(f64::NAN, |s| s.median)
}
