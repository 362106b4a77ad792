//! Profiling aid: keep a remote proclet busy with pipelined calls of a given work for a
//! while, so a profiler can be attached to the callee node process.
//! `cargo run --release -p granule-bench --example pipeline_probe -- 10 20`
//! (10 µs of work per call, 20 seconds).
use futures::stream::{FuturesUnordered, StreamExt};
use granule::{Cluster, Kind, Proclet};
use std::time::{Duration, Instant};

#[derive(serde::Serialize, serde::Deserialize, Default)]
struct S(u64);

fn work(s: &mut S, it: u64) -> u64 {
    s.0 += 1;
    granule_bench::work::spin(it)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<f64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let work_us = args.first().copied().unwrap_or(10.0);
    let secs = args.get(1).copied().unwrap_or(10.0);
    let per_us = granule_bench::work::calibrate();
    let iters = granule_bench::work::iters_for(work_us, per_us);
    let cluster = Cluster::builder().nodes("cpu=1,mem=512MiB")?.start()?;
    let node = cluster.worker_nodes()?[0];
    println!("callee pid {}", cluster.spawned_nodes()[0].1);
    if std::env::var_os("PIN").is_some() {
        // The same placement as `granule-bench invoke`.
        granule_bench::invoke::pin_process(0)?;
        Proclet::builder(Kind::Compute)
            .on(node)
            .create(1usize, |c: usize| {
                let _ = granule_bench::invoke::pin_process(c);
                S::default()
            })?;
    }
    let p = Proclet::builder(Kind::Compute)
        .on(node)
        .create((), |()| S::default())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let t = Instant::now();
    let n = rt.block_on(async {
        let mut inflight = FuturesUnordered::new();
        for _ in 0..128 {
            inflight.push(p.run_async(iters, work));
        }
        let mut n = 0u64;
        while let Some(r) = inflight.next().await {
            r?;
            n += 1;
            if t.elapsed() < Duration::from_secs_f64(secs) {
                inflight.push(p.run_async(iters, work));
            }
        }
        Ok::<_, granule::CallError>(n)
    })?;
    println!(
        "{:.0} calls/s at {work_us} µs",
        n as f64 / t.elapsed().as_secs_f64()
    );
    Ok(())
}
