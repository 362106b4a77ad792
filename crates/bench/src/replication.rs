//! `granule-bench replication`: what primary–backup replication of proclets costs and
//! how fast it recovers, in three parts.
//!
//! 1. **Throughput** (Nu's Figure 14, here): calls pipelined (128 in flight) from the
//!    driver to 32 proclets on one node, each with 2 copies (its backup on a second
//!    node), against the same calls to 32 proclets with one copy, at 0.1, 1, 10 and 30 µs
//!    of calibrated work per call. Placement: the caller (driver process) and the backup
//!    node on vCPU 0, the primary node on vCPU 1 (on a machine with 2+ vCPUs). Each
//!    vCPU's busy fraction is read from `/proc/stat` over each run, and the primary
//!    node's CPU time from its threads' schedstat. A sync call's latency (p50) is
//!    measured both ways at 0.1 µs.
//! 2. **Failover** (four node processes): a replicated proclet called in a loop from the driver while its
//!    primary's node is SIGKILLed (its connections close) or frozen with SIGSTOP (only
//!    the failure timeout finds it). The outage is the longest gap between two answered
//!    calls around the failure, split into detection (until the controller declared the
//!    node dead, from its event log) and the rest (promotion, the caller finding the new
//!    primary). Every answered call is then checked in the proclet's log: lost (answered,
//!    not in the log) and duplicated (in the log twice).
//! 3. **Re-replication**: a proclet of 2 MiB and of 64 MiB whose backup's node is killed;
//!    the primary streams the state to a new backup (the time calls were held, from the
//!    `backup_made` event), against a raw TCP transfer of the same bytes between the same
//!    two node processes.

use crate::migrate::{pattern, pin_node, RawClient, RawSink};
use crate::work::{calibrate, iters_for, spin};
use crate::BenchOpts;
use anyhow::{anyhow, Context};
use futures::stream::{FuturesUnordered, StreamExt};
use granule::{Cluster, Kind, NodeId, NodeSpec, NodeState, Proclet};
use granule_report::{Cell, Latency, Meta, Plot, Report, Summary, Table};
use granule_wire::EventKind;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const WORK_US: [f64; 4] = [0.1, 1.0, 10.0, 30.0];
const PROCLETS: usize = 32;
const WINDOW: usize = 128;
/// Node processes of the failover cluster: each lives through several trials, so the
/// fleet's replacements are not throttled as a crash loop.
const NODES: usize = 4;

/// A benchmark proclet's state.
#[derive(Serialize, Deserialize, Default)]
struct Counter {
    calls: u64,
}

fn work(c: &mut Counter, iters: u64) -> u64 {
    c.calls += 1;
    spin(iters)
}

/// A failover trial's proclet: every value added, in order.
#[derive(Serialize, Deserialize, Default)]
struct Log {
    seen: Vec<u64>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The process of node `node` (a replacement the controller already knows may not be
/// in the fleet's list for a moment).
fn pid_of(cluster: &Cluster, node: NodeId) -> anyhow::Result<u32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = cluster
            .spawned_nodes()
            .into_iter()
            .find(|(n, _)| *n == node)
            .map(|(_, pid)| pid);
        match found {
            Some(pid) => return Ok(pid),
            None if Instant::now() > deadline => anyhow::bail!("no process for node {node}"),
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) -> anyhow::Result<()> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig)
        .with_context(|| format!("sending {sig} to {pid}"))
}

/// The cluster's events (the controller's log), for the failure and backup times.
fn events(cluster: &Cluster) -> anyhow::Result<Vec<granule_wire::ClusterEvent>> {
    let addr = cluster.controller_addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let ctl = granule_controller::ControllerClient::connect_tool(&addr, "bench").await?;
        Ok::<_, anyhow::Error>(ctl.events(0, 10_000).await?)
    })
}

// ---- 1. throughput -------------------------------------------------------------------

/// One pipelined run: calls/s, the primary node's CPU ns per call, each vCPU's busy
/// fraction.
struct Run {
    rate: f64,
    primary_ns_per_call: f64,
    busy: Vec<f64>,
}

struct Throughput {
    cluster: Cluster,
    replicated: Vec<Proclet<Counter>>,
    single: Vec<Proclet<Counter>>,
    primary_pid: u32,
    rt: tokio::runtime::Runtime,
    per_us: f64,
    pinned: bool,
}

impl Throughput {
    fn new() -> anyhow::Result<Throughput> {
        let per_us = calibrate();
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=1GiB;cpu=1,mem=1GiB")?
            .driver(NodeSpec {
                cores: 1.0,
                mem_bytes: 512 << 20,
            })
            .shed(false)
            .start()
            .context("starting the throughput cluster")?;
        let nodes = cluster.worker_nodes()?;
        let (primary, backup) = match nodes.as_slice() {
            [a, b, ..] => (*a, *b),
            _ => anyhow::bail!("the cluster needs two nodes"),
        };
        let pinned = std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2;
        if pinned {
            crate::affinity::pin_process(0)?;
            pin_node(primary, 1)?;
            pin_node(backup, 0)?;
        }
        let mut replicated = Vec::new();
        let mut single = Vec::new();
        for _ in 0..PROCLETS {
            // The backup goes to the only other node that hosts proclets.
            replicated.push(
                Proclet::builder(Kind::Compute)
                    .on(primary)
                    .replicas(2)
                    .create((), |()| Counter::default())?,
            );
            single.push(
                Proclet::builder(Kind::Compute)
                    .on(primary)
                    .pinned()
                    .create((), |()| Counter::default())?,
            );
        }
        let primary_pid = pid_of(&cluster, primary)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Throughput {
            cluster,
            replicated,
            single,
            primary_pid,
            rt,
            per_us,
            pinned,
        })
    }

    fn pipelined(&self, replicated: bool, w: f64, dur: Duration) -> anyhow::Result<Run> {
        let iters = iters_for(w, self.per_us);
        let ps = if replicated {
            &self.replicated
        } else {
            &self.single
        };
        let cpu0 = granule_host::proc::threads_cpu_ns(self.primary_pid);
        let ticks0 = granule_host::proc::cpu_ticks();
        let done = self.rt.block_on(async {
            let t = Instant::now();
            let mut inflight = FuturesUnordered::new();
            let mut next = 0usize;
            for _ in 0..WINDOW {
                inflight.push(ps[next % ps.len()].run_async(iters, work));
                next += 1;
            }
            let mut done = 0u64;
            while let Some(r) = inflight.next().await {
                r?;
                done += 1;
                if t.elapsed() < dur {
                    inflight.push(ps[next % ps.len()].run_async(iters, work));
                    next += 1;
                }
            }
            Ok::<_, anyhow::Error>((done, t.elapsed()))
        })?;
        let cpu = granule_host::proc::threads_cpu_ns(self.primary_pid).saturating_sub(cpu0);
        let ticks1 = granule_host::proc::cpu_ticks();
        let busy = ticks1
            .iter()
            .zip(ticks0.iter().chain(std::iter::repeat(&(0, 0))))
            .map(|((b1, t1), (b0, t0))| {
                let total = t1.saturating_sub(*t0);
                if total == 0 {
                    f64::NAN
                } else {
                    b1.saturating_sub(*b0) as f64 / total as f64
                }
            })
            .collect();
        Ok(Run {
            rate: done.0 as f64 / done.1.as_secs_f64(),
            primary_ns_per_call: cpu as f64 / done.0.max(1) as f64,
            busy,
        })
    }

    fn sync_p50_us(&self, replicated: bool, dur: Duration) -> anyhow::Result<f64> {
        let p = if replicated {
            &self.replicated[0]
        } else {
            &self.single[0]
        };
        let iters = iters_for(0.1, self.per_us);
        let mut lat = Latency::new();
        let t = Instant::now();
        while t.elapsed() < dur {
            let c = Instant::now();
            p.run(iters, work)?;
            lat.record(c.elapsed());
        }
        Ok(lat.p(0.5).as_secs_f64() * 1e6)
    }
}

// ---- 2. failover ---------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Debug)]
enum Failure {
    Kill,
    Freeze,
}

struct Trial {
    outage_ms: f64,
    detection_ms: f64,
    lost: usize,
    duplicated: usize,
    failed_calls: usize,
}

/// Wait until the cluster has `n` live worker nodes (a killed one's replacement joined).
fn wait_for_nodes(cluster: &Cluster, n: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let live = cluster
            .nodes()?
            .into_iter()
            .filter(|i| i.state == NodeState::Alive && i.role == granule_wire::Role::Node)
            .count();
        if live >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!("only {live} of {n} nodes alive after 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The live node that joined first: the primary of a trial goes there. A replacement
/// that is killed again soon after it started makes the fleet wait longer and longer
/// before the next one (its back-off for crash loops); the oldest node has lived the
/// longest.
fn oldest_node(cluster: &Cluster) -> anyhow::Result<NodeId> {
    cluster
        .nodes()?
        .into_iter()
        .filter(|i| i.state == NodeState::Alive && i.role == granule_wire::Role::Node)
        .map(|i| i.id)
        .min()
        .ok_or_else(|| anyhow!("no live node"))
}

fn failover_trial(cluster: &Cluster, how: Failure) -> anyhow::Result<Trial> {
    wait_for_nodes(cluster, NODES)?;
    let p = Proclet::builder(Kind::Memory)
        .on(oldest_node(cluster)?)
        .replicas(2)
        .create((), |()| Log::default())?;
    let primary = p.location()?;
    let pid = pid_of(cluster, primary)?;
    // The load: one call after another, each answered call's value and time kept.
    let stop = Arc::new(AtomicBool::new(false));
    let answered: Arc<Mutex<Vec<(u64, Instant)>>> = Arc::default();
    let failed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let load = {
        let (p, stop, answered, failed) =
            (p.clone(), stop.clone(), answered.clone(), failed.clone());
        std::thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x += 1;
                match p.run(x, |l: &mut Log, x: u64| l.seen.push(x)) {
                    Ok(()) => answered.lock().unwrap().push((x, Instant::now())),
                    Err(_) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(150));
    let killed_at = Instant::now();
    let killed_ms = now_ms();
    match how {
        Failure::Kill => signal(pid, nix::sys::signal::Signal::SIGKILL)?,
        Failure::Freeze => signal(pid, nix::sys::signal::Signal::SIGSTOP)?,
    }
    // Calls answered again, then a little more load on the new primary.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let recovered = answered
            .lock()
            .unwrap()
            .last()
            .is_some_and(|(_, t)| *t > killed_at + Duration::from_millis(1));
        if recovered || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(150));
    stop.store(true, Ordering::Relaxed);
    let _ = load.join();
    if how == Failure::Freeze {
        // Told it is dead once it wakes: it leaves; make sure it is gone.
        let _ = signal(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = signal(pid, nix::sys::signal::Signal::SIGCONT);
    }
    let answered = std::mem::take(&mut *answered.lock().unwrap());
    // The outage: the longest gap between answers from just before the failure on.
    let mut outage = Duration::ZERO;
    let mut prev: Option<Instant> = None;
    for (_, t) in &answered {
        if let Some(p0) = prev {
            if *t >= killed_at {
                outage = outage.max(t.saturating_duration_since(p0.max(killed_at)));
            }
        }
        prev = Some(*t);
    }
    if answered.last().is_none_or(|(_, t)| *t < killed_at) {
        anyhow::bail!("no call was answered after the primary's node failed ({how:?})");
    }
    let seen = p.run_ref((), |l: &Log, ()| l.seen.clone())?;
    let mut counts = std::collections::HashMap::new();
    for v in &seen {
        *counts.entry(*v).or_insert(0usize) += 1;
    }
    let lost = answered
        .iter()
        .filter(|(x, _)| !counts.contains_key(x))
        .count();
    let duplicated = counts.values().filter(|c| **c > 1).count();
    let down_ms = events(cluster)?
        .into_iter()
        .filter(|e| e.kind == EventKind::NodeDown && e.node == primary)
        .map(|e| e.at_ms)
        .next_back()
        .unwrap_or(killed_ms);
    let _ = p.destroy();
    Ok(Trial {
        outage_ms: outage.as_secs_f64() * 1e3,
        detection_ms: down_ms.saturating_sub(killed_ms) as f64,
        lost,
        duplicated,
        failed_calls: failed.load(Ordering::Relaxed),
    })
}

// ---- 3. re-replication ---------------------------------------------------------------

/// One re-replication of a `size`-byte state: (µs calls were held while it streamed,
/// µs of a raw TCP transfer of the same bytes between the same two nodes).
fn rereplicate(cluster: &Cluster, size: usize) -> anyhow::Result<(f64, f64)> {
    wait_for_nodes(cluster, NODES)?;
    let p = Proclet::builder(Kind::Memory)
        .on(oldest_node(cluster)?)
        .mem_hint(size as u64)
        .replicas(2)
        .create(size, |n: usize| pattern(n))?;
    let primary = p.location()?;
    let subject = p.id().to_string();
    // The backup: the node whose `backup_made` names it (nodes report their events with
    // their heartbeats, so it comes a moment after the creation).
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = loop {
        let found = events(cluster)?
            .into_iter()
            .rfind(|e| e.kind == EventKind::BackupMade && e.subject == subject);
        if let Some(e) = found {
            break e;
        }
        if Instant::now() > deadline {
            anyhow::bail!("no backup_made event for {subject} within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let before = first.seq;
    let backup = first
        .to
        .ok_or_else(|| anyhow!("backup_made without a node"))?;
    signal(pid_of(cluster, backup)?, nix::sys::signal::Signal::SIGKILL)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let made = loop {
        let found = events(cluster)?
            .into_iter()
            .find(|e| e.seq > before && e.kind == EventKind::BackupMade && e.subject == subject);
        if let Some(e) = found {
            break e;
        }
        if Instant::now() > deadline {
            anyhow::bail!("no new backup of {} within 60 s", p.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let to = made
        .to
        .ok_or_else(|| anyhow!("backup_made without a node"))?;
    // The raw baseline between the same two processes: primary → new backup's node.
    let sink = Proclet::builder(Kind::Compute)
        .on(to)
        .pinned()
        .create((), |()| RawSink::start())?;
    let port = sink
        .run_ref((), |s: &RawSink, ()| s.port.clone())?
        .map_err(|e| anyhow!("raw sink: {e}"))?;
    let client = Proclet::builder(Kind::Compute)
        .on(primary)
        .pinned()
        .create(port, RawClient::new)?;
    client
        .run(size as u64, |c: &mut RawClient, n: u64| c.set_size(n))?
        .map_err(|e| anyhow!("raw client: {e}"))?;
    let mut raw = Vec::new();
    for _ in 0..3 {
        let ns = client
            .run((), |c: &mut RawClient, ()| c.send())?
            .map_err(|e| anyhow!("raw transfer: {e}"))?;
        raw.push(ns as f64 / 1e3);
    }
    let _ = client.destroy();
    let _ = sink.destroy();
    let _ = p.destroy();
    let raw_us = Summary::of(&raw).map_or(f64::NAN, |s| s.median);
    Ok((made.micros as f64, raw_us))
}

// ---- the report ----------------------------------------------------------------------

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let _restore = crate::affinity::SavedAffinity::save();
    let reps = if opts.quick { 1 } else { 5 };
    let dur = if opts.quick {
        Duration::from_millis(100)
    } else {
        Duration::from_millis(600)
    };
    let trials = if opts.quick { 1 } else { 10 };
    let sizes: &[usize] = if opts.quick {
        &[2 << 20]
    } else {
        &[2 << 20, 64 << 20]
    };
    let rerep_reps = if opts.quick { 1 } else { 3 };
    let progress = granule_report::Progress::new(
        (reps + 2 * trials + sizes.len() * rerep_reps) as u64,
        "replication",
    );

    // 1. Throughput.
    let t = Throughput::new()?;
    // Warm both paths.
    t.pipelined(true, 1.0, Duration::from_millis(100))?;
    t.pipelined(false, 1.0, Duration::from_millis(100))?;
    let mut runs: Vec<[Vec<Run>; 2]> = WORK_US.iter().map(|_| [Vec::new(), Vec::new()]).collect();
    for rep in 0..reps {
        for (wi, &w) in WORK_US.iter().enumerate() {
            runs[wi][0].push(t.pipelined(false, w, dur)?);
            runs[wi][1].push(t.pipelined(true, w, dur)?);
        }
        progress.step(format!("throughput repetition {}/{reps}", rep + 1));
    }
    let sync_single = t.sync_p50_us(false, dur)?;
    let sync_repl = t.sync_p50_us(true, dur)?;
    let pinned = t.pinned;
    crate::print_cluster_usage(&t.cluster);
    t.cluster.shutdown();
    let med = |v: &[Run], f: &dyn Fn(&Run) -> f64| {
        Summary::of(&v.iter().map(f).collect::<Vec<_>>()).map_or(f64::NAN, |s| s.median)
    };

    // 2. Failover, and 3. re-replication, on a cluster whose dead nodes are replaced.
    let _ = crate::affinity::set_process_affinity(
        &(0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect::<Vec<_>>(),
    );
    let cluster = Cluster::builder()
        .nodes(&["cpu=1,mem=1GiB"; NODES].join(";"))?
        .shed(false)
        .start()
        .context("starting the failover cluster")?;
    let failure_timeout_ms = cluster.config().cluster.failure_timeout.as_secs_f64() * 1e3;
    let mut kills = Vec::new();
    let mut freezes = Vec::new();
    for i in 0..trials {
        kills.push(failover_trial(&cluster, Failure::Kill)?);
        progress.step(format!("failover (SIGKILL) {}/{trials}", i + 1));
        freezes.push(failover_trial(&cluster, Failure::Freeze)?);
        progress.step(format!("failover (SIGSTOP) {}/{trials}", i + 1));
    }
    let mut rerep: Vec<(usize, Vec<(f64, f64)>)> = Vec::new();
    for &size in sizes {
        let mut v = Vec::new();
        for i in 0..rerep_reps {
            v.push(rereplicate(&cluster, size)?);
            progress.step(format!(
                "re-replication of {} MiB {}/{rerep_reps}",
                size >> 20,
                i + 1
            ));
        }
        rerep.push((size, v));
    }
    cluster.shutdown();
    progress.finish();

    // Tables.
    let mut table = Table::new(&[
        "part",
        "case",
        "work_us",
        "calls_per_s_median",
        "vs_unreplicated",
        "primary_cpu_ns_per_call",
        "vcpu0_busy",
        "vcpu1_busy",
    ]);
    let mut ratio = Vec::new();
    for (wi, &w) in WORK_US.iter().enumerate() {
        let single = med(&runs[wi][0], &|r| r.rate);
        for (k, name) in [(0usize, "unreplicated"), (1, "2 copies")] {
            let rate = med(&runs[wi][k], &|r| r.rate);
            table.row(vec![
                Cell::from("throughput"),
                Cell::from(name),
                w.into(),
                rate.into(),
                (rate / single).into(),
                med(&runs[wi][k], &|r| r.primary_ns_per_call).into(),
                med(&runs[wi][k], &|r| {
                    r.busy.first().copied().unwrap_or(f64::NAN)
                })
                .into(),
                med(&runs[wi][k], &|r| {
                    r.busy.get(1).copied().unwrap_or(f64::NAN)
                })
                .into(),
            ]);
        }
        ratio.push(med(&runs[wi][1], &|r| r.rate) / single);
    }
    let mut fo = Table::new(&[
        "failure",
        "trial",
        "outage_ms",
        "detection_ms",
        "after_detection_ms",
        "lost_calls",
        "duplicated_calls",
        "failed_calls",
    ]);
    for (name, v) in [("SIGKILL", &kills), ("SIGSTOP", &freezes)] {
        for (i, tr) in v.iter().enumerate() {
            fo.row(vec![
                Cell::from(name),
                (i as u64 + 1).into(),
                tr.outage_ms.into(),
                tr.detection_ms.into(),
                (tr.outage_ms - tr.detection_ms).into(),
                (tr.lost as u64).into(),
                (tr.duplicated as u64).into(),
                (tr.failed_calls as u64).into(),
            ]);
        }
    }
    let mut rr = Table::new(&["state_mib", "rep", "held_us", "raw_tcp_us", "vs_raw"]);
    for (size, v) in &rerep {
        for (i, (held, raw)) in v.iter().enumerate() {
            rr.row(vec![
                ((size >> 20) as u64).into(),
                (i as u64 + 1).into(),
                (*held).into(),
                (*raw).into(),
                (held / raw).into(),
            ]);
        }
    }

    let p50 = |v: &[Trial], f: &dyn Fn(&Trial) -> f64| {
        Summary::of(&v.iter().map(f).collect::<Vec<_>>()).map_or(f64::NAN, |s| s.median)
    };
    let max = |v: &[Trial], f: &dyn Fn(&Trial) -> f64| v.iter().map(f).fold(f64::NAN, f64::max);
    let wi = |w: f64| WORK_US.iter().position(|x| *x == w).unwrap_or(0);
    // The primary's CPU per replicated call beyond the unreplicated callee's, over the
    // unreplicated callee's own cost beyond the work (at 1 µs).
    let w1 = wi(1.0);
    let work_ns = 1_000.0;
    let single_ns = med(&runs[w1][0], &|r| r.primary_ns_per_call);
    let repl_ns = med(&runs[w1][1], &|r| r.primary_ns_per_call);
    let cpu_ratio = (repl_ns - single_ns) / (single_ns - work_ns);

    let placement = if pinned {
        "Throughput: the driver process (caller: a current-thread tokio runtime on its main thread, 128 calls in flight over 32 proclets) and the backup node process on vCPU 0; the primary node process on vCPU 1 (every thread of each process pinned). Failover and re-replication: four node processes (cpu=1 each) and the driver, unpinned; each trial's primary on the node that joined first."
    } else {
        "Nothing pinned (fewer than 2 vCPUs): the kernel places the threads."
    };
    let mut meta = Meta::collect(placement, opts.quick);
    meta.note(format!(
        "work = calibrated integer spin; {reps} repetition(s) of {dur:?} per case and work level, interleaved; {trials} failover trial(s) per kind; {rerep_reps} re-replication(s) per size; failure timeout {failure_timeout_ms:.0} ms"
    ));
    let mut rep = Report::new("replication", meta);
    rep.table(table);
    rep.extra_table("failover", fo);
    rep.extra_table("rereplication", rr);
    let mut plot = Plot::line("Replicated (2 copies) vs unreplicated calls/s, pipelined")
        .x_label("work per call (µs)")
        .y_label("replicated ÷ unreplicated calls/s")
        .log_x(true)
        .hline(0.82, "Nu at 30 µs (0.82)");
    plot = plot.series(
        "2 copies ÷ 1",
        WORK_US
            .iter()
            .zip(&ratio)
            .map(|(w, r)| (*w, *r))
            .collect::<Vec<_>>(),
    );
    rep.plot(plot);
    rep.summary("replicated_vs_unreplicated_0_1us", ratio[wi(0.1)]);
    rep.summary("replicated_vs_unreplicated_1us", ratio[wi(1.0)]);
    rep.summary("replicated_vs_unreplicated_10us", ratio[wi(10.0)]);
    rep.summary("replicated_vs_unreplicated_30us", ratio[wi(30.0)]);
    rep.summary(
        "vcpu0_busy_30us",
        med(&runs[wi(30.0)][1], &|r| {
            r.busy.first().copied().unwrap_or(f64::NAN)
        }),
    );
    rep.summary(
        "vcpu1_busy_30us",
        med(&runs[wi(30.0)][1], &|r| {
            r.busy.get(1).copied().unwrap_or(f64::NAN)
        }),
    );
    rep.summary("primary_cpu_per_call_vs_remote_callee", cpu_ratio);
    rep.summary("sync_added_latency_us", sync_repl - sync_single);
    rep.summary("sync_replicated_p50_us", sync_repl);
    rep.summary("sync_unreplicated_p50_us", sync_single);
    rep.summary("failover_kill_ms_p50", p50(&kills, &|t| t.outage_ms));
    rep.summary("failover_kill_ms_max", max(&kills, &|t| t.outage_ms));
    rep.summary(
        "failover_kill_detection_ms_p50",
        p50(&kills, &|t| t.detection_ms),
    );
    rep.summary("failover_silent_ms_p50", p50(&freezes, &|t| t.outage_ms));
    rep.summary("failover_silent_ms_max", max(&freezes, &|t| t.outage_ms));
    rep.summary(
        "failover_silent_detection_ms_p50",
        p50(&freezes, &|t| t.detection_ms),
    );
    rep.summary("failure_timeout_ms", failure_timeout_ms);
    let all = kills.iter().chain(&freezes);
    rep.summary(
        "lost_calls",
        all.clone().map(|t| t.lost as f64).sum::<f64>(),
    );
    rep.summary(
        "duplicated_calls",
        all.clone().map(|t| t.duplicated as f64).sum::<f64>(),
    );
    rep.summary(
        "failed_calls",
        all.map(|t| t.failed_calls as f64).sum::<f64>(),
    );
    for (size, v) in &rerep {
        let held =
            Summary::of(&v.iter().map(|x| x.0).collect::<Vec<_>>()).map_or(f64::NAN, |s| s.median);
        let raw =
            Summary::of(&v.iter().map(|x| x.1).collect::<Vec<_>>()).map_or(f64::NAN, |s| s.median);
        rep.summary(format!("rereplicate_{}mib_vs_raw", size >> 20), held / raw);
        rep.summary(format!("rereplicate_{}mib_held_ms", size >> 20), held / 1e3);
    }
    rep.note(
        "replicated_vs_unreplicated_N = pipelined calls/s to 32 proclets with 2 copies ÷ the same to 32 with one copy, \
         at N µs of work per call; primary_cpu_per_call_vs_remote_callee = (the primary node's CPU per replicated call − \
         the unreplicated callee's) ÷ (the unreplicated callee's CPU per call − the 1 µs of work), at 1 µs; \
         sync_added_latency_us = p50 of a replicated sync call − p50 of an unreplicated one (0.1 µs of work). \
         Failover outage = the longest gap between answered calls from the failure on; detection = until the controller \
         declared the node dead (its event log); lost = answered but not in the proclet's log; duplicated = in the log twice. \
         Re-replication held = how long the primary held calls while streaming the state to the new backup (the \
         backup_made event), vs a raw TCP transfer of the same bytes between the same two node processes.",
    );
    rep.note("Nu (NSDI '23, Figure 14) reports 0.63 of unreplicated throughput at 0.1 µs and 0.82 at 30 µs, with a machine per role and kernel-bypass networking.");
    Ok(rep.write(&opts.out)?)
}
