//! `granule-bench remote-iter`: a compute loop iterating a sealed [`ShardedVec`] whose
//! shards live on another node, against the same loop over a local `Vec` with the same
//! core (EVALUATION.md, remote-iter).
//!
//! - **Cluster**: one node process `cpu=1` holds the vector's shards (low-latency bounds,
//!   at most 2 MiB each; every shard moved there and the node pinned to vCPU 1). The loop
//!   runs in the driver — itself a node — pinned to vCPU 0: the driver's thread does the
//!   work per element, the driver node's runtime thread receives the prefetched blocks,
//!   both on that one vCPU. The local baseline runs on the same thread over a `Vec` of
//!   the same elements built in the driver.
//! - **Elements**: fixed records of 100 B, 1 KiB and 10 KiB (`[u8; N]` as serde bytes,
//!   inline in the vectors: no allocation per element on either side); work per element 0, 1, 3, 10 and
//!   100 µs of calibrated spinning ([`crate::work::spin`]); each pass reads
//!   `max(1000, min(0.25 s of work, the whole vector))` elements and checksums them (the
//!   remote and local checksums must agree).
//! - **Prefetch**: blocks of 128 KiB worth of elements, 8 blocks ahead
//!   ([`ShardedVec::iter_range`]); the fetching thread does not spin for replies
//!   ([`granule::set_spin`]), which would take the loop's vCPU.
//! - **Figures**: efficiency = remote elements/s ÷ local elements/s, the median of 5
//!   interleaved passes each (quick: 1); `efficiency_3us_100b` is the judged one (target
//!   ≥ 0.95).

use crate::affinity::{pin_process, SavedAffinity};
use crate::work::{calibrate, iters_for, spin};
use crate::BenchOpts;
use anyhow::{anyhow, bail, Context};
use granule::sharded::{ShardedVec, VecIter};
use granule::{Cluster, Footprint, Kind, NodeId, Proclet};
use granule_report::{Cell, Meta, Plot, Report, Summary, Table};
use serde::{Deserialize, Serialize};
use serde_bytes::ByteArray;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Bytes of elements per prefetched block...
const BLOCK_BYTES: usize = 128 << 10;
/// ...and blocks ahead: 1 MiB, enough that the fetching thread, which shares the loop's
/// vCPU, only runs when the loop is preempted anyway (4 × 256 KiB measured 0.93–0.95 at
/// 3 µs per 100 B element, 8 × 128 KiB 0.97).
const DEPTH: usize = 8;
/// Target time of one pass.
const PASS: Duration = Duration::from_millis(250);
/// The judged efficiency.
const TARGET: f64 = 0.95;

struct Params {
    sizes: Vec<usize>,
    works_us: Vec<f64>,
    reps: usize,
    /// Bytes of elements per vector (one vector per element size).
    vec_bytes: usize,
}

impl Params {
    fn new(quick: bool) -> Params {
        if quick {
            Params {
                sizes: vec![100],
                works_us: vec![0.0, 3.0],
                reps: 1,
                vec_bytes: 4 << 20,
            }
        } else {
            Params {
                sizes: vec![100, 1024, 10 << 10],
                works_us: vec![0.0, 1.0, 3.0, 10.0, 100.0],
                reps: 5,
                vec_bytes: 48 << 20,
            }
        }
    }
}

/// A fixed-size record of `N` bytes: the element type, inline in its vector (a `Vec<u8>`
/// would add an allocation per element to both loops, and measure the allocator).
#[derive(Clone, Serialize, Deserialize)]
struct Record<const N: usize>(ByteArray<N>);

impl<const N: usize> Footprint for Record<N> {
    fn footprint(&self) -> u64 {
        N as u64
    }
}

/// Element `i`: its bytes depend on `i`, so a misplaced one is caught.
fn element<const N: usize>(i: u64) -> Record<N> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut b = [0u8; N];
    for byte in b.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *byte = x as u8;
    }
    Record(ByteArray::new(b))
}

/// Work on one element: `iters` of spinning, plus a checksum of its bytes.
fn consume(x: &[u8], iters: u64, sum: &mut u64) {
    if iters > 0 {
        spin(iters);
    }
    *sum = sum
        .wrapping_mul(31)
        .wrapping_add(x.first().copied().unwrap_or(0) as u64)
        .wrapping_add(x.len() as u64)
        .wrapping_add(x.last().copied().unwrap_or(0) as u64);
}

/// One pass over elements `0..n`: (seconds, checksum).
fn remote_pass<const N: usize>(
    v: &ShardedVec<Record<N>>,
    n: u64,
    iters: u64,
) -> anyhow::Result<(f64, u64)> {
    let block = (BLOCK_BYTES / N).max(1);
    let t = Instant::now();
    let it: VecIter<Record<N>> = v.iter_range(0..n, block, DEPTH)?;
    let mut sum = 0u64;
    let mut count = 0u64;
    for x in it {
        consume(&x?.0[..], iters, &mut sum);
        count += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    if count != n {
        bail!("the iterator yielded {count} elements, expected {n}");
    }
    Ok((secs, sum))
}

fn local_pass<const N: usize>(v: &[Record<N>], n: u64, iters: u64) -> (f64, u64) {
    let t = Instant::now();
    let mut sum = 0u64;
    for x in &v[..n as usize] {
        consume(&x.0[..], iters, &mut sum);
    }
    (t.elapsed().as_secs_f64(), sum)
}

/// Pin every thread of `node`'s process to `cpu`, through a proclet call there.
fn pin_node(node: NodeId, cpu: usize) -> anyhow::Result<()> {
    let p = Proclet::builder(Kind::Compute)
        .on(node)
        .pinned()
        .create(cpu, |cpu: usize| {
            pin_process(cpu).map_err(|e| e.to_string())
        })?;
    let r = p.run_ref((), |r: &Result<(), String>, ()| r.clone())?;
    p.destroy()?;
    r.map_err(|e| anyhow!("pinning node {node} to vCPU {cpu}: {e}"))
}

struct Point {
    size: usize,
    work_us: f64,
    n: u64,
    local: Vec<f64>,
    remote: Vec<f64>,
}

impl Point {
    fn rate(&self, secs: &[f64]) -> Option<Summary> {
        let rates: Vec<f64> = secs.iter().map(|s| self.n as f64 / s).collect();
        Summary::of(&rates)
    }

    /// Median remote rate ÷ median local rate, and the per-pass ratios' spread.
    fn efficiency(&self) -> (f64, Option<Summary>) {
        let med = |s: &[f64]| self.rate(s).map_or(f64::NAN, |s| s.median);
        let per_pass: Vec<f64> = self
            .local
            .iter()
            .zip(&self.remote)
            .map(|(l, r)| l / r)
            .collect();
        (med(&self.remote) / med(&self.local), Summary::of(&per_pass))
    }
}

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let p = Params::new(opts.quick);
    let affinity = SavedAffinity::unpin();
    let vcpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let progress = granule_report::Progress::new(2, "remote-iter");
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=1GiB")?
        .shed(false)
        .start()
        .context("starting the cluster")?;
    progress.step("cluster started; iterating the remote vector");
    let out = measure(&cluster, &p, vcpus >= 2);
    progress.step("measured; writing the report");
    crate::print_cluster_usage(&cluster);
    cluster.shutdown();
    // Provenance below describes the machine, not the pinning of this run.
    drop(affinity);
    let (points, data_node, per_us) = out?;

    let mut table = Table::new(&[
        "element_bytes",
        "work_us",
        "elements_per_pass",
        "local_elements_per_s",
        "remote_elements_per_s",
        "efficiency",
        "efficiency_min",
        "efficiency_max",
    ]);
    let mut plot = Plot::line("Remote iteration efficiency vs work per element")
        .x_label("work per element (µs; 0 shown at 0.1)")
        .y_label("remote elements/s ÷ local elements/s")
        .log_x(true)
        .hline(TARGET, "target at 3 µs, 100 B");
    let mut rep_summary = Vec::new();
    for size in &p.sizes {
        let mut series = Vec::new();
        for pt in points.iter().filter(|pt| pt.size == *size) {
            let (eff, spread) = pt.efficiency();
            let med = |s: &[f64]| pt.rate(s).map_or(f64::NAN, |s| s.median);
            table.row(vec![
                Cell::from(pt.size as f64),
                Cell::from(pt.work_us),
                Cell::from(pt.n as f64),
                Cell::from(med(&pt.local)),
                Cell::from(med(&pt.remote)),
                Cell::from(eff),
                Cell::from(spread.as_ref().map_or(f64::NAN, |s| s.min)),
                Cell::from(spread.as_ref().map_or(f64::NAN, |s| s.max)),
            ]);
            series.push((pt.work_us.max(0.1), eff));
            let size_name = match pt.size {
                s if s >= 1024 => format!("{}kib", s >> 10),
                s => format!("{s}b"),
            };
            rep_summary.push((format!("efficiency_{}us_{size_name}", pt.work_us), eff));
        }
        let label = if *size >= 1024 {
            format!("{} KiB elements", size >> 10)
        } else {
            format!("{size} B elements")
        };
        plot.push_series(label, series);
    }

    let placement = if vcpus >= 2 {
        format!(
            "the driver process (embedded controller; its main thread runs the loop, its node's runtime thread \
             receives the blocks) pinned to vCPU 0; the data node {data_node} (cpu=1, every shard of the vectors) \
             pinned to vCPU 1. The local baseline runs on the same driver thread."
        )
    } else {
        format!("nothing pinned ({vcpus} usable vCPU); data node {data_node}")
    };
    let mut meta = Meta::collect(placement, opts.quick);
    meta.note(format!(
        "work: calibrated spinning, {per_us:.0} iterations per µs measured on the driver's vCPU; each pass also \
         checksums every element (remote and local checksums agree in every pass). Prefetch: {} KiB blocks, {DEPTH} \
         in flight; vectors in low-latency mode (shards ≤ 2 MiB), sealed, {} MiB each. Efficiency = median remote \
         rate ÷ median local rate over {} interleaved passes (min/max of the per-pass ratios in the table).",
        BLOCK_BYTES >> 10,
        p.vec_bytes >> 20,
        p.reps
    ));
    let mut rep = Report::new("remote-iter", meta);
    rep.title("Benchmark: remote-iter — iterating a remote sealed ShardedVec vs a local Vec");
    rep.table(table);
    rep.plot(plot);
    for (k, v) in rep_summary {
        rep.summary(k, v);
    }
    rep.summary("target_efficiency_3us_100b", TARGET);
    Ok(rep.write(&opts.out)?)
}

/// Build the vectors, then measure every point.
fn measure(cluster: &Cluster, p: &Params, pin: bool) -> anyhow::Result<(Vec<Point>, NodeId, f64)> {
    let data_node = *cluster
        .worker_nodes()?
        .first()
        .ok_or_else(|| anyhow!("no node process registered"))?;
    if pin {
        pin_node(data_node, 1)?;
        pin_process(0)?;
    }
    let per_us = calibrate();
    let mut points = Vec::new();
    for &size in &p.sizes {
        let mut pts = match size {
            100 => measure_size::<100>(cluster, p, data_node, per_us)?,
            1024 => measure_size::<1024>(cluster, p, data_node, per_us)?,
            10240 => measure_size::<10240>(cluster, p, data_node, per_us)?,
            other => bail!("no record type for {other} B elements"),
        };
        points.append(&mut pts);
    }
    Ok((points, data_node, per_us))
}

/// Build a sealed vector of `N`-byte records on the data node, then measure every work
/// point over it.
fn measure_size<const N: usize>(
    cluster: &Cluster,
    p: &Params,
    data_node: NodeId,
    per_us: f64,
) -> anyhow::Result<Vec<Point>> {
    let total = (p.vec_bytes / N) as u64;
    let v: ShardedVec<Record<N>> = ShardedVec::new()?;
    let batch = ((1 << 20) / N).max(1) as u64;
    let mut i = 0;
    while i < total {
        let end = (i + batch).min(total);
        v.extend((i..end).map(element::<N>).collect())?;
        i = end;
    }
    v.seal()?;
    for (_, s) in v.sharder().shards()? {
        if s.location()? != data_node {
            cluster.move_proclet(s.id(), data_node)?;
        }
    }
    let local: Vec<Record<N>> = (0..total).map(element::<N>).collect();
    let mut points = Vec::new();
    for &work_us in &p.works_us {
        let iters = if work_us > 0.0 {
            iters_for(work_us, per_us)
        } else {
            0
        };
        let n = ((PASS.as_secs_f64() / ((work_us + 0.2) * 1e-6)) as u64).clamp(1000, total);
        let mut pt = Point {
            size: N,
            work_us,
            n,
            local: Vec::new(),
            remote: Vec::new(),
        };
        // One untimed pass of each warms caches and connections.
        let _ = local_pass(&local, n.min(1000), iters);
        remote_pass(&v, n.min(1000), iters)?;
        for _ in 0..p.reps {
            let (lt, ls) = local_pass(&local, n, iters);
            let (rt, rs) = remote_pass(&v, n, iters)?;
            if ls != rs {
                bail!("{N} B, {work_us} µs: remote checksum {rs:#x} ≠ local {ls:#x}");
            }
            pt.local.push(lt);
            pt.remote.push(rt);
        }
        let (eff, _) = pt.efficiency();
        eprintln!("remote-iter: {N} B, {work_us} µs of work: {n} elements, efficiency {eff:.3}");
        points.push(pt);
    }
    v.destroy()?;
    Ok(points)
}
