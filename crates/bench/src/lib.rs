//! Granule's benchmarks, run by the `granule-bench` binary
//! (`granule-bench NAME [--quick] [--out DIR]`, `src/main.rs`).
//!
//! This crate owns the measurement code: workloads, the baselines measured beside
//! Granule in the same run (plain function calls, raw TCP), repetitions and medians, and
//! the reports (`DIR/NAME/results.csv`, `results.md`, `plot.png`, `summary.json`, written
//! with `granule-report`). It changes nothing in the system it measures. `--quick` runs the
//! same code for a few seconds, as a smoke test (CI runs those).
//!
//! The benchmarks are a binary of their own so that the shipped `granule` command does
//! not carry them. Like every Granule application, `granule-bench` is also a node: a
//! benchmark that starts a cluster spawns node processes of this executable. The
//! subcommands of the `granule` command that some benchmarks start as child processes
//! (`fs mount`, `fs status`, `store`, `antagonist memory`) run from the `granule` binary
//! beside it ([`granule_exe`]); the benchmarks' own child modes (the `consumer`
//! application, the `scavenge` tenant) run this executable again.
#![forbid(unsafe_code)]

pub mod affinity;
pub mod batch;
pub mod consumer;
pub mod controller;
pub mod fs;
pub mod harvest;
pub mod interrupt;
pub mod invoke;
pub mod kv;
pub mod kv_secure;
pub mod market;
pub mod migrate;
pub mod pressure;
pub mod pushdown;
pub mod remote_iter;
pub mod replication;
pub mod scavenge;
pub mod service;
pub mod sharded;
pub mod work;
pub(crate) mod zipf;

use std::path::{Path, PathBuf};

/// Options every benchmark takes.
#[derive(Clone, Debug, Default)]
pub struct BenchOpts {
    /// Seconds-long smoke run instead of the full measurement.
    pub quick: bool,
    /// Reports go to `out/NAME/`.
    pub out: PathBuf,
    /// Repetitions instead of the benchmark's default (benchmarks that repeat runs:
    /// `pressure`), for experiments.
    pub reps: Option<usize>,
    /// Write every request and the cluster's events of each run here, for lining a run's
    /// tail up with a scheduler trace (`pressure`).
    pub dump: Option<PathBuf>,
}

/// Names `granule-bench` accepts, with a one-line description.
pub const BENCHMARKS: &[(&str, &str)] = &[
    ("invoke", "proclet call throughput and latency vs work per call: local, remote, plain function, raw TCP"),
    ("controller", "location resolutions/s and registrations/s one controller sustains"),
    ("migrate", "migration time of a proclet with 64 KiB to 16 MiB of state, next to raw TCP of the same bytes"),
    ("sharded", "ops/s of ShardedVec and ShardedMap across 3 nodes, low-latency and batching modes, vs std containers in one process"),
    ("remote-iter", "a compute loop iterating a sealed remote ShardedVec (100 B to 10 KiB elements, 0-100 µs of work each) vs the same loop over a local Vec"),
    ("batch", "for_all and a word count on 2 cores vs a plain loop, rayon and Ray; compute proclets shrinking from and growing back onto a vCPU an antagonist takes"),
    ("service", "a stateless service under an HTTP load that triples and falls back: compute proclets splitting and merging, vs plain axum"),
    ("kv", "a producer store vs redis-server under redis-benchmark: GET and SET, 100 B and 4 KiB, unpipelined and -P 16"),
    ("kv-secure", "market consumer latency with no protection, integrity-only and encrypted values"),
    ("harvest", "a real redis-server under Zipfian load with and without the harvester: memory harvested vs idle, p99 and throughput"),
    ("market", "the broker over 48 simulated hours: 1000 consumers, 100 producers, diurnal supply and demand"),
    ("consumer", "a YCSB-like application whose misses go to disk or a 1 ms service, with and without leased memory"),
    ("fs", "the scavenging file system's mount vs tmpfs and bindfs over tmpfs: sequential write, cold read (also vs raw TCP), fio random 4 KiB, small files"),
    ("scavenge", "a bag of dd writers and a small-file DAG on the scavenging mount (own nodes + CPU-capped victim stores) beside a tenant: its slowdown, victim CPU, node-seconds vs a reservation"),
    ("pushdown", "TPC-H-style Q6, Q1, Q14, Q12 and a word count over tables on two memory-rich nodes whose pushed-work CPU is capped at 100/50/20 %: pull vs push vs the cost rule, vs raw TCP and DuckDB"),
    ("pressure", "KV shards under open-loop load while a memory antagonist fills one node: p99 timeline, moves, vs throttled migration"),
    ("replication", "proclets with 2 copies vs 1: pipelined calls/s at 0.1-30 µs of work (Nu's Figure 14), failover after SIGKILL and SIGSTOP, re-replication of 2 and 64 MiB vs raw TCP"),
];

/// The benchmarks that start subcommands of the `granule` binary ([`granule_exe`]).
pub const NEEDS_GRANULE: &[&str] = &["fs", "scavenge", "pressure"];

/// Run the benchmark `name`; returns the directory the report was written to.
pub fn run(name: &str, opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    match name {
        "invoke" => invoke::run(opts),
        "controller" => controller::run(opts),
        "migrate" => migrate::run(opts),
        "pressure" => pressure::run(opts),
        "remote-iter" => remote_iter::run(opts),
        "sharded" => sharded::run(opts),
        "batch" => batch::run(opts),
        "service" => service::run(opts),
        "kv" => kv::run(opts),
        "kv-secure" => kv_secure::run(opts),
        "harvest" => harvest::run(opts),
        "market" => market::run(opts),
        "consumer" => consumer::run(opts),
        "fs" => fs::run(opts),
        "scavenge" => scavenge::run(opts),
        "pushdown" => pushdown::run(opts),
        "replication" => replication::run(opts),
        other => anyhow::bail!(
            "unknown benchmark '{other}'; known: {}",
            BENCHMARKS
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The `granule` binary in the same directory as this executable (`target/release/` for
/// `target/release/granule-bench`), for the subcommands a benchmark starts as a child
/// process: `fs mount`, `fs status`, `store`, `antagonist memory`. Cargo builds the two
/// binaries from different packages, so the error says how to build the missing one.
pub fn granule_exe() -> anyhow::Result<PathBuf> {
    use anyhow::Context;
    let me = std::env::current_exe().context("the path of this executable")?;
    let exe = me.with_file_name("granule");
    if exe.is_file() {
        return Ok(exe);
    }
    let release = if me.parent().is_some_and(|d| d.ends_with("debug")) {
        ""
    } else {
        " --release"
    };
    anyhow::bail!(
        "granule-bench needs the granule binary beside it ({}): run cargo build{release} -p granule-cli",
        exe.display()
    )
}

/// `out/name`, for benchmarks that want to mention it.
pub fn report_dir(out: &Path, name: &str) -> PathBuf {
    out.join(name)
}

/// Print the cluster's resource use as the controller reports it (per node: CPU, memory
/// against budget and cgroup limit, pressure, moves; per proclet: footprint and cores), so
/// every benchmark run shows what it ran on.
pub fn print_cluster_usage(cluster: &granule::Cluster) {
    match cluster.nodes() {
        Ok(nodes) => {
            println!("\ncluster resources at the end of the run:");
            print!("{}", granule_report::usage::node_table(&nodes));
            print!("{}", granule_report::usage::proclet_table(&nodes));
            print!("{}", kind_ratios(&nodes));
        }
        Err(e) => println!("(cannot read the cluster's resource use: {e})"),
    }
}

/// CPU per memory of the proclets each node reports (its largest 16), by kind: compute
/// proclets should use ≥ 0.1 core per MiB they hold, memory proclets ≤ 0.001 (the
/// thresholds the nodes warn at; see `GRANULE_COMPUTE_MIN_CORES_PER_MIB`).
pub fn kind_ratios(nodes: &[granule::NodeInfo]) -> String {
    use granule::Kind;
    let mut out =
        String::from("measured CPU/memory ratio by proclet kind (largest proclets per node):\n");
    for kind in [Kind::Compute, Kind::Memory, Kind::Hybrid] {
        let (mut n, mut cores, mut bytes) = (0usize, 0.0f64, 0u64);
        for p in nodes
            .iter()
            .flat_map(|n| &n.usage.top)
            .filter(|p| p.kind == kind)
        {
            n += 1;
            cores += p.cores;
            bytes += p.mem_bytes;
        }
        if n == 0 {
            out.push_str(&format!("  {kind:<8} none\n"));
            continue;
        }
        let mib = bytes as f64 / (1u64 << 20) as f64;
        out.push_str(&format!(
            "  {kind:<8} {n} proclets, {cores:.3} cores over {mib:.2} MiB = {:.4} cores/MiB\n",
            cores / mib.max(1e-9)
        ));
    }
    out
}
