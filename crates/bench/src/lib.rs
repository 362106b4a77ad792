//! Granule's benchmarks, run by `granule bench NAME [--quick] [--out DIR]`.
//!
//! This crate owns the measurement code: workloads, the baselines measured beside
//! Granule in the same run (plain function calls, raw TCP), repetitions and medians, and
//! the reports (`DIR/NAME/results.csv`, `results.md`, `plot.png`, `summary.json`, written
//! with `granule-report`). It changes nothing in the system it measures. `--quick` runs the
//! same code for a few seconds, as a smoke test (CI runs those).
#![forbid(unsafe_code)]

pub mod affinity;
pub mod batch;
pub mod controller;
pub mod invoke;
pub mod migrate;
pub mod pressure;
pub mod remote_iter;
pub mod sharded;
pub mod work;

use std::path::{Path, PathBuf};

/// Options every benchmark takes.
#[derive(Clone, Debug)]
pub struct BenchOpts {
    /// Seconds-long smoke run instead of the full measurement.
    pub quick: bool,
    /// Reports go to `out/NAME/`.
    pub out: PathBuf,
}

/// Names `granule bench` accepts, with a one-line description.
pub const BENCHMARKS: &[(&str, &str)] = &[
    ("invoke", "proclet call throughput and latency vs work per call: local, remote, plain function, raw TCP"),
    ("controller", "location resolutions/s and registrations/s one controller sustains"),
    ("migrate", "migration time of a proclet with 64 KiB to 16 MiB of state, next to raw TCP of the same bytes"),
    ("sharded", "ops/s of ShardedVec and ShardedMap across 3 nodes, low-latency and batching modes, vs std containers in one process"),
    ("remote-iter", "a compute loop iterating a sealed remote ShardedVec (100 B to 10 KiB elements, 0-100 µs of work each) vs the same loop over a local Vec"),
    ("batch", "for_all and a word count on 2 cores vs a plain loop, rayon and Ray; compute proclets shrinking from and growing back onto a vCPU an antagonist takes"),
    ("pressure", "KV shards under open-loop load while a memory antagonist fills one node: p99 timeline, moves, vs throttled migration"),
];

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
        }
        Err(e) => println!("(cannot read the cluster's resource use: {e})"),
    }
}
