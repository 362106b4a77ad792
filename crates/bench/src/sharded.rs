//! `granule-bench sharded`: operations per second of the sharded structures across
//! three node processes, in low-latency mode (one call per operation) and batching mode
//! (client-side buffers, several batches in flight), next to the same std container in
//! this one process.
//!
//! - **Cluster**: three node processes `cpu=1,mem=1GiB`, nothing pinned (the driver and
//!   the nodes share the machine's vCPUs); the structures' shards are placed by the
//!   controller and split onto their parents' nodes. Nodes do not shed (`shed(false)`).
//! - **Elements**: 100-byte `Vec<u8>` values (map keys: `u64`).
//! - **Operations**, all from the driver's main thread, each structure in both modes
//!   (low-latency: one call per operation; batching: a `Pusher` with 64 KiB batches,
//!   4 in flight — 1 for the queue, to keep its order — and block reads):
//!   vector push / get / sealed iteration (256 KiB blocks, 4 ahead) vs `Vec`; map insert /
//!   get / full scan vs `BTreeMap`; queue push / pop (`try_pop(1)`, batching
//!   `try_pop(655)`) vs `VecDeque`; partitions insert / read per partition vs a
//!   `Vec<(K, V)>`.
//! - **Figures**: `batching_vs_lowlatency_push_100b` = vector batching push ops/s ÷
//!   low-latency push ops/s (target ≥ 10), and the same ratio for the map, the queue and
//!   the partitions.

use crate::BenchOpts;
use anyhow::Context;
use granule::sharded::{ShardedMap, ShardedPartitions, ShardedQueue, ShardedVec};
use granule::Cluster;
use granule_report::{Cell, Meta, Plot, Report, Table};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

const VALUE: usize = 100;

struct Counts {
    std: u64,
    low_latency: u64,
    batching: u64,
}

impl Counts {
    fn new(quick: bool) -> Counts {
        if quick {
            Counts {
                std: 200_000,
                low_latency: 500,
                batching: 20_000,
            }
        } else {
            Counts {
                std: 2_000_000,
                low_latency: 5_000,
                batching: 400_000,
            }
        }
    }
}

fn value(i: u64) -> Vec<u8> {
    let mut v = vec![0u8; VALUE];
    v[..8].copy_from_slice(&i.to_le_bytes());
    v
}

/// One measured operation.
struct Row {
    structure: &'static str,
    op: &'static str,
    mode: &'static str,
    ops: u64,
    secs: f64,
}

impl Row {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.secs
    }
}

fn timed(
    structure: &'static str,
    op: &'static str,
    mode: &'static str,
    ops: u64,
    f: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<Row> {
    let t = Instant::now();
    f()?;
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "sharded: {structure} {op} ({mode}): {ops} ops in {secs:.3} s, {:.0}/s",
        ops as f64 / secs
    );
    Ok(Row {
        structure,
        op,
        mode,
        ops,
        secs,
    })
}

/// Where a structure's shards are: "n2=3 n3=1".
fn placement_of<S: granule::sharded::Shard>(
    s: &granule::sharded::AutoSharder<S>,
) -> anyhow::Result<String> {
    let mut by_node = BTreeMap::new();
    for (_, shard) in s.shards()? {
        *by_node.entry(shard.location()?.to_string()).or_insert(0u32) += 1;
    }
    Ok(by_node
        .iter()
        .map(|(n, c)| format!("{n}={c}"))
        .collect::<Vec<_>>()
        .join(" "))
}

fn measure(c: &Counts, placements: &mut Vec<String>) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    // Vector push.
    rows.push(timed("Vec", "push", "std, one process", c.std, || {
        let mut v = Vec::new();
        for i in 0..c.std {
            v.push(value(i));
        }
        black_box(&v);
        Ok(())
    })?);
    let low: ShardedVec<Vec<u8>> = ShardedVec::new()?;
    rows.push(timed(
        "ShardedVec",
        "push",
        "low-latency",
        c.low_latency,
        || {
            for i in 0..c.low_latency {
                low.push(value(i))?;
            }
            Ok(())
        },
    )?);
    let batched: ShardedVec<Vec<u8>> = ShardedVec::batching()?;
    rows.push(timed("ShardedVec", "push", "batching", c.batching, || {
        let mut p = batched.pusher(64 << 10, 4)?;
        for i in 0..c.batching {
            p.push(value(i))?;
        }
        let n = p.flush()?;
        anyhow::ensure!(n == c.batching, "{n} of {} elements applied", c.batching);
        Ok(())
    })?);
    anyhow::ensure!(batched.len()? == c.batching, "batched length");
    placements.push(format!(
        "ShardedVec low-latency: {}; batching: {}",
        placement_of(low.sharder())?,
        placement_of(batched.sharder())?
    ));
    // Vector read.
    let local: Vec<Vec<u8>> = (0..c.std).map(value).collect();
    rows.push(timed("Vec", "read", "std, one process", c.std, || {
        let mut sum = 0u64;
        for x in &local {
            sum = sum.wrapping_add(x[0] as u64);
        }
        black_box(sum);
        Ok(())
    })?);
    rows.push(timed(
        "ShardedVec",
        "get",
        "low-latency",
        c.low_latency,
        || {
            for i in 0..c.low_latency {
                anyhow::ensure!(low.get(i)?.as_deref() == Some(&value(i)[..]), "element {i}");
            }
            Ok(())
        },
    )?);
    batched.seal()?;
    rows.push(timed(
        "ShardedVec",
        "iterate (sealed)",
        "batching",
        c.batching,
        || {
            let mut n = 0u64;
            for x in batched.iter((256 << 10) / VALUE, 4)? {
                black_box(x?);
                n += 1;
            }
            anyhow::ensure!(n == c.batching, "iterated {n}");
            Ok(())
        },
    )?);
    low.destroy()?;
    batched.destroy()?;
    // Map insert and get.
    let mut std_map = BTreeMap::new();
    rows.push(timed(
        "BTreeMap",
        "insert",
        "std, one process",
        c.std,
        || {
            for i in 0..c.std {
                std_map.insert(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), value(i));
            }
            Ok(())
        },
    )?);
    rows.push(timed("BTreeMap", "get", "std, one process", c.std, || {
        for i in 0..c.std {
            black_box(std_map.get(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        }
        Ok(())
    })?);
    let map: ShardedMap<u64, Vec<u8>> = ShardedMap::new()?;
    rows.push(timed(
        "ShardedMap",
        "insert",
        "low-latency",
        c.low_latency,
        || {
            for i in 0..c.low_latency {
                map.insert(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), value(i))?;
            }
            Ok(())
        },
    )?);
    rows.push(timed(
        "ShardedMap",
        "get",
        "low-latency",
        c.low_latency,
        || {
            for i in 0..c.low_latency {
                let got = map.get(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15))?;
                anyhow::ensure!(got == Some(value(i)), "key {i}");
            }
            Ok(())
        },
    )?);
    placements.push(format!(
        "ShardedMap low-latency: {}",
        placement_of(map.sharder())?
    ));
    map.destroy()?;
    let bmap: ShardedMap<u64, Vec<u8>> = ShardedMap::batching()?;
    rows.push(timed(
        "ShardedMap",
        "insert",
        "batching",
        c.batching,
        || {
            let mut ins = bmap.inserter(64 << 10, 4)?;
            for i in 0..c.batching {
                ins.push((i.wrapping_mul(0x9E37_79B9_7F4A_7C15), value(i)))?;
            }
            let n = ins.flush()?;
            anyhow::ensure!(n == c.batching, "{n} of {} entries applied", c.batching);
            Ok(())
        },
    )?);
    anyhow::ensure!(bmap.len()? == c.batching, "batched map length");
    rows.push(timed("ShardedMap", "scan", "batching", c.batching, || {
        let all = bmap.range(None, None, usize::MAX)?;
        anyhow::ensure!(all.len() as u64 == c.batching, "scanned {}", all.len());
        black_box(all);
        Ok(())
    })?);
    placements.push(format!(
        "ShardedMap batching: {}",
        placement_of(bmap.sharder())?
    ));
    bmap.destroy()?;

    // Queue push and pop.
    let mut deque = std::collections::VecDeque::new();
    rows.push(timed(
        "VecDeque",
        "push",
        "std, one process",
        c.std,
        || {
            for i in 0..c.std {
                deque.push_back(value(i));
            }
            Ok(())
        },
    )?);
    rows.push(timed("VecDeque", "pop", "std, one process", c.std, || {
        for i in 0..c.std {
            let v = deque.pop_front();
            anyhow::ensure!(v.as_deref() == Some(&value(i)[..]), "element {i}");
        }
        Ok(())
    })?);
    let q: ShardedQueue<Vec<u8>> = ShardedQueue::new()?;
    rows.push(timed(
        "ShardedQueue",
        "push",
        "low-latency",
        c.low_latency,
        || {
            for i in 0..c.low_latency {
                q.push(value(i))?;
            }
            Ok(())
        },
    )?);
    rows.push(timed(
        "ShardedQueue",
        "pop",
        "low-latency",
        c.low_latency,
        || {
            for i in 0..c.low_latency {
                let v = q.try_pop(1)?;
                anyhow::ensure!(v.first() == Some(&value(i)), "element {i}");
            }
            Ok(())
        },
    )?);
    q.destroy()?;
    let bq: ShardedQueue<Vec<u8>> = ShardedQueue::batching()?;
    rows.push(timed(
        "ShardedQueue",
        "push",
        "batching",
        c.batching,
        || {
            // One batch in flight: the queue keeps this producer's order.
            let mut p = bq.pusher(64 << 10, 1)?;
            for i in 0..c.batching {
                p.push(value(i))?;
            }
            let n = p.flush()?;
            anyhow::ensure!(n == c.batching, "{n} of {} elements applied", c.batching);
            Ok(())
        },
    )?);
    placements.push(format!(
        "ShardedQueue batching: {}",
        placement_of(bq.sharder())?
    ));
    rows.push(timed(
        "ShardedQueue",
        "pop",
        "batching",
        c.batching,
        || {
            let mut next = 0u64;
            while next < c.batching {
                let got = bq.try_pop((64 << 10) / VALUE)?;
                anyhow::ensure!(!got.is_empty(), "queue empty after {next} elements");
                for v in got {
                    anyhow::ensure!(v == value(next), "element {next} out of order");
                    next += 1;
                }
            }
            Ok(())
        },
    )?);
    bq.destroy()?;

    // Partitions: pairs in, then read back one partition at a time.
    let key = |i: u64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % 10_000;
    let mut pairs = Vec::new();
    rows.push(timed(
        "Vec<(K, V)>",
        "insert",
        "std, one process",
        c.std,
        || {
            for i in 0..c.std {
                pairs.push((key(i), value(i)));
            }
            Ok(())
        },
    )?);
    drop(pairs);
    let parts: ShardedPartitions<u64, Vec<u8>> = ShardedPartitions::new()?;
    rows.push(timed(
        "ShardedPartitions",
        "insert",
        "low-latency",
        c.low_latency,
        || {
            for i in 0..c.low_latency {
                parts.insert(key(i), value(i))?;
            }
            Ok(())
        },
    )?);
    parts.destroy()?;
    let bparts: ShardedPartitions<u64, Vec<u8>> = ShardedPartitions::batching()?;
    rows.push(timed(
        "ShardedPartitions",
        "insert",
        "batching",
        c.batching,
        || {
            let mut p = bparts.pusher(64 << 10, 4)?;
            for i in 0..c.batching {
                p.push((key(i), value(i)))?;
            }
            let n = p.flush()?;
            anyhow::ensure!(n == c.batching, "{n} of {} pairs applied", c.batching);
            Ok(())
        },
    )?);
    bparts.seal()?;
    placements.push(format!(
        "ShardedPartitions batching: {}",
        placement_of(bparts.sharder())?
    ));
    rows.push(timed(
        "ShardedPartitions",
        "read partitions",
        "batching",
        c.batching,
        || {
            let mut n = 0u64;
            for part in bparts.partitions()? {
                n += part.pairs()?.len() as u64;
            }
            anyhow::ensure!(n == c.batching, "read {n} pairs");
            Ok(())
        },
    )?);
    bparts.destroy()?;
    Ok(rows)
}

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let counts = Counts::new(opts.quick);
    let affinity = crate::affinity::SavedAffinity::unpin();
    let progress = granule_report::Progress::new(2, "sharded");
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=1GiB;cpu=1,mem=1GiB;cpu=1,mem=1GiB")?
        .shed(false)
        .start()
        .context("starting the cluster")?;
    progress.step("cluster started; measuring every structure in both modes");
    let mut placements = Vec::new();
    let rows = measure(&counts, &mut placements);
    progress.step("measured; writing the report");
    crate::print_cluster_usage(&cluster);
    cluster.shutdown();
    drop(affinity);
    let rows = rows?;

    let rate_of = |s: &str, op: &str, mode: &str| {
        rows.iter()
            .find(|r| r.structure == s && r.op == op && r.mode == mode)
            .map_or(f64::NAN, Row::rate)
    };
    let std_of = |r: &Row| match (r.structure, r.op) {
        ("ShardedVec", "push") => rate_of("Vec", "push", "std, one process"),
        ("ShardedVec", _) => rate_of("Vec", "read", "std, one process"),
        ("ShardedMap", "scan") => rate_of("Vec", "read", "std, one process"),
        ("ShardedMap", op) => rate_of("BTreeMap", op, "std, one process"),
        ("ShardedQueue", op) => rate_of("VecDeque", op, "std, one process"),
        ("ShardedPartitions", "insert") => rate_of("Vec<(K, V)>", "insert", "std, one process"),
        ("ShardedPartitions", _) => rate_of("Vec", "read", "std, one process"),
        _ => r.rate(),
    };
    let mut table = Table::new(&[
        "structure",
        "operation",
        "mode",
        "operations",
        "seconds",
        "ops_per_s",
        "vs_std",
    ]);
    for r in &rows {
        table.row(vec![
            Cell::from(r.structure),
            Cell::from(r.op),
            Cell::from(r.mode),
            Cell::from(r.ops as f64),
            Cell::from(r.secs),
            Cell::from(r.rate()),
            Cell::from(r.rate() / std_of(r)),
        ]);
    }
    let labels: Vec<String> = rows
        .iter()
        .map(|r| format!("{} {} ({})", r.structure, r.op, r.mode))
        .collect();
    let plot = Plot::bars("Sharded structures across 3 nodes vs std containers in one process")
        .y_label("operations per second")
        .log_y(true)
        .categories(labels)
        .bar_series("ops/s", rows.iter().map(Row::rate));
    let ratio =
        rate_of("ShardedVec", "push", "batching") / rate_of("ShardedVec", "push", "low-latency");

    let placement = "the driver process (embedded controller; its main thread runs every operation) and three node \
                     processes (cpu=1, mem=1GiB, the shards) share the machine's vCPUs: nothing is pinned. The std \
                     containers run on the driver's main thread."
        .to_string();
    let mut meta = Meta::collect(placement, opts.quick);
    meta.note(format!(
        "low-latency mode: shards ≤ 2 MiB, one synchronous call per operation ({} operations); batching mode: \
         shards ≤ 32 MiB, a Pusher with 64 KiB batches and 4 in flight (the queue: 1, which keeps its order) ({} \
         elements), sealed vector iteration with 256 KiB blocks 4 ahead, queue pops of 655 elements, map scans and \
         partition reads of whole shards; std: {} operations. Values are 100-byte Vec<u8>; map keys are scrambled \
         u64, partition keys 10 000 distinct u64. Every read is checked against what was written.",
        counts.low_latency, counts.batching, counts.std
    ));
    meta.note(format!(
        "shards by node at the end of each structure's writes: {}",
        placements.join("; ")
    ));
    let mut rep = Report::new("sharded", meta);
    rep.title("Benchmark: sharded — sharded structures vs std containers");
    rep.table(table);
    rep.plot(plot);
    rep.summary("batching_vs_lowlatency_push_100b", ratio);
    let modes = |s: &str, op: &str| rate_of(s, op, "batching") / rate_of(s, op, "low-latency");
    rep.summary(
        "map_batching_vs_lowlatency_insert_100b",
        modes("ShardedMap", "insert"),
    );
    rep.summary(
        "queue_batching_vs_lowlatency_push_100b",
        modes("ShardedQueue", "push"),
    );
    rep.summary(
        "queue_batching_vs_lowlatency_pop_100b",
        modes("ShardedQueue", "pop"),
    );
    rep.summary(
        "partitions_batching_vs_lowlatency_insert_100b",
        modes("ShardedPartitions", "insert"),
    );
    for r in &rows {
        let key = format!(
            "{}_{}_{}_ops_per_s",
            r.structure.to_lowercase(),
            r.op.split_whitespace().next().unwrap_or(r.op),
            r.mode
                .split([',', ' '])
                .next()
                .unwrap_or(r.mode)
                .replace('-', "_")
        );
        rep.summary(key, r.rate());
    }
    Ok(rep.write(&opts.out)?)
}
