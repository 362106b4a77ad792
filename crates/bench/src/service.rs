//! `granule-bench service`: a stateless service under an open-loop HTTP load that
//! triples and falls back, its compute proclets splitting and merging, next to the same
//! handler in a plain axum server in this process.
//!
//! - **Cluster**: two node processes `cpu=2,mem=1GiB` and the driver (which also runs
//!   the load generator), nothing pinned, no shedding: they share the machine's vCPUs.
//! - **Service**: a stateless handler that burns `WORK_US` µs of CPU (calibrated spin;
//!   the iteration count travels in the JSON request), default scaler (5 ms windows, split
//!   above 1 core, merge two neighbours under 0.6 core averaged over 40 windows).
//! - **Load**: open loop over keep-alive HTTP/1.1 connections spread over every node's
//!   front door; request `k` of a connection is sent at its scheduled time (or as soon as
//!   the connection is free) and its latency counts from the scheduled time (no
//!   coordinated omission). Rate: base → 3 × base → base, base = 0.45 core of handler
//!   work (so the peak, 1.35 cores, exceeds one core and the fall-back leaves two
//!   proclets under 0.6 core together).
//! - **Record** per 50 ms: offered and completed rate, failures, compute proclets, p50 and
//!   p99 latency. Plot: rates and proclet count against time.
//! - **Baseline**: the peak closed-loop throughput of the service (after the timeline,
//!   `SAT_CONNS` connections sending back to back) ÷ the same against a plain axum server
//!   in this process calling the handler directly: `throughput_vs_plain_axum`.

use crate::work::{calibrate, iters_for, spin};
use crate::BenchOpts;
use anyhow::Context;
use granule::service::client::HttpClient;
use granule::service::{ServiceBuilder, StatelessService, Timeline};
use granule::Cluster;
use granule_report::stats::percentile;
use granule_report::{Cell, Meta, Plot, Report, Table};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// CPU per request.
const WORK_US: f64 = 500.0;
/// Handler load at the base rate, in cores.
const BASE_CORES: f64 = 0.45;
/// Connections of the open-loop generator.
const CONNS: usize = 48;
/// Connections of the closed-loop saturation runs.
const SAT_CONNS: usize = 16;
/// Bucket of the timeline.
const BUCKET: f64 = 0.05;

/// The service's handler: `iters` rounds of calibrated spin.
fn handler(iters: u64) -> u64 {
    spin(iters)
}

/// One request of the open loop.
struct Outcome {
    /// Scheduled send time, seconds since the load started.
    sched: f64,
    /// When its answer came (or it failed).
    done: f64,
    ok: bool,
}

/// (phase name, seconds, rate in requests/s)
type Phase = (&'static str, f64, f64);

fn schedule(phases: &[Phase]) -> Vec<f64> {
    let mut out = Vec::new();
    let mut t0 = 0.0;
    for &(_, secs, rate) in phases {
        let n = (secs * rate) as u64;
        for k in 0..n {
            out.push(t0 + k as f64 / rate);
        }
        t0 += secs;
    }
    out
}

/// Run the open loop: request `k` goes on connection `k % CONNS`.
fn open_loop(doors: &[SocketAddr], times: Vec<f64>, iters: u64) -> anyhow::Result<Vec<Outcome>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let doors = doors.to_vec();
    let body = iters.to_string().into_bytes();
    rt.block_on(async move {
        let start = Instant::now();
        let tasks = (0..CONNS).map(|c| {
            let addr = doors[c % doors.len()];
            let mine: Vec<f64> = times.iter().skip(c).step_by(CONNS).copied().collect();
            let body = body.clone();
            tokio::spawn(async move {
                let mut out = Vec::with_capacity(mine.len());
                let mut cl = HttpClient::connect(addr).await.ok();
                for sched in mine {
                    let at = start + Duration::from_secs_f64(sched);
                    tokio::time::sleep_until(at.into()).await;
                    let ok = match cl.as_mut() {
                        Some(cl) => {
                            matches!(cl.post("/v1/services/spin", &body).await, Ok((200, _)))
                        }
                        None => false,
                    };
                    if !ok {
                        // Reconnect for the next one (a failure may have closed it).
                        cl = HttpClient::connect(addr).await.ok();
                    }
                    out.push(Outcome {
                        sched,
                        done: start.elapsed().as_secs_f64(),
                        ok,
                    });
                }
                out
            })
        });
        let mut all = Vec::new();
        for r in futures::future::join_all(tasks).await {
            all.extend(r?);
        }
        Ok(all)
    })
}

/// Closed loop for `secs`: completed requests per second and failures.
fn saturate(
    doors: &[SocketAddr],
    path: &'static str,
    secs: f64,
    iters: u64,
) -> anyhow::Result<(f64, u64)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let doors = doors.to_vec();
    let body = iters.to_string().into_bytes();
    rt.block_on(async move {
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let start = Instant::now();
        let tasks = (0..SAT_CONNS).map(|c| {
            let addr = doors[c % doors.len()];
            let body = body.clone();
            tokio::spawn(async move {
                let (mut ok, mut bad) = (0u64, 0u64);
                let mut cl = HttpClient::connect(addr).await.ok();
                while Instant::now() < end {
                    let r = match cl.as_mut() {
                        Some(cl) => cl.post(path, &body).await.ok(),
                        None => None,
                    };
                    match r {
                        Some((200, _)) => ok += 1,
                        _ => {
                            bad += 1;
                            cl = HttpClient::connect(addr).await.ok();
                        }
                    }
                }
                (ok, bad)
            })
        });
        let (mut ok, mut bad) = (0, 0);
        for r in futures::future::join_all(tasks).await {
            let (o, b) = r?;
            ok += o;
            bad += b;
        }
        Ok((ok as f64 / start.elapsed().as_secs_f64(), bad))
    })
}

/// The same handler in a plain axum server on a runtime of its own (2 threads).
fn plain_axum() -> anyhow::Result<(tokio::runtime::Runtime, SocketAddr)> {
    use axum::body::Bytes;
    use axum::http::StatusCode;
    use axum::routing::post;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/v1/services/spin",
        post(|body: Bytes| async move {
            match serde_json::from_slice::<u64>(&body) {
                Ok(iters) => (StatusCode::OK, handler(iters).to_string()),
                Err(e) => (StatusCode::BAD_REQUEST, e.to_string()),
            }
        }),
    );
    rt.spawn(async move {
        if let Ok(l) = tokio::net::TcpListener::from_std(listener) {
            let _ = axum::serve(l, app).await;
        }
    });
    Ok((rt, addr))
}

/// Proclet count at time `t` of the load (the timeline's clock is offset by `off`).
fn proclets_at(tl: &Timeline, t: f64, off: f64) -> usize {
    let i = tl.samples.partition_point(|s| s.t <= t + off);
    tl.samples
        .get(i.saturating_sub(1))
        .map_or(1, |s| s.proclets)
}

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let affinity = crate::affinity::SavedAffinity::unpin();
    let per_us = calibrate();
    let iters = iters_for(WORK_US, per_us);
    let base = BASE_CORES * 1e6 / WORK_US;
    let phases: Vec<Phase> = if opts.quick {
        vec![
            ("base", 1.0, base),
            ("peak", 2.0, 3.0 * base),
            ("base again", 3.0, base),
        ]
    } else {
        vec![
            ("base", 6.0, base),
            ("peak", 8.0, 3.0 * base),
            ("base again", 12.0, base),
        ]
    };
    let sat_secs = if opts.quick { 1.0 } else { 4.0 };

    let progress = granule_report::Progress::new(6, "service");
    let cluster = Cluster::builder()
        .nodes("cpu=2,mem=1GiB;cpu=2,mem=1GiB")?
        .shed(false)
        .start()
        .context("starting the cluster")?;
    let svc: StatelessService<u64, u64> = ServiceBuilder::new("spin")
        .stateless(handler)
        .context("starting the service")?;
    let doors: Vec<SocketAddr> = svc.http_addrs().into_iter().map(|(_, a)| a).collect();
    println!("front doors: {doors:?}");
    progress.step("service started; warming up");
    // Warm up (connections, caches), then align the clocks.
    let _ = saturate(&doors, "/v1/services/spin", 0.2, iters / 10)?;
    let off = svc.timeline().samples.last().map_or(0.0, |s| s.t);
    let times = schedule(&phases);
    let offered_total = times.len();
    progress.step("open-loop load: base, peak ×3, base again");
    let outcomes = open_loop(&doors, times, iters)?;
    progress.step("saturating the service");
    let tl = svc.timeline();
    let (granule_sat, granule_sat_failed) = saturate(&doors, "/v1/services/spin", sat_secs, iters)?;
    let peak_proclets = svc.proclets();
    crate::print_cluster_usage(&cluster);
    svc.destroy()?;
    cluster.shutdown();
    progress.step("saturating a plain axum server (baseline)");
    let (plain_rt, plain_addr) = plain_axum()?;
    let (plain_sat, _) = saturate(&[plain_addr], "/v1/services/spin", sat_secs, iters)?;
    plain_rt.shutdown_background();
    drop(affinity);
    progress.step("measured; writing the report");
    progress.finish();

    // The timeline, per bucket.
    let total_secs: f64 = phases.iter().map(|p| p.1).sum();
    let end = outcomes.iter().map(|o| o.done).fold(total_secs, f64::max);
    let nb = (end / BUCKET).ceil() as usize + 1;
    let mut offered = vec![0u64; nb];
    let mut completed = vec![0u64; nb];
    let mut failed = vec![0u64; nb];
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); nb];
    for o in &outcomes {
        offered[((o.sched / BUCKET) as usize).min(nb - 1)] += 1;
        let b = ((o.done / BUCKET) as usize).min(nb - 1);
        if o.ok {
            completed[b] += 1;
            lat[b].push((o.done - o.sched) * 1e3);
        } else {
            failed[b] += 1;
        }
    }
    let mut table = Table::new(&[
        "t_s",
        "phase",
        "offered_per_s",
        "completed_per_s",
        "failed",
        "proclets",
        "p50_ms",
        "p99_ms",
    ]);
    let phase_of = |t: f64| {
        let mut acc = 0.0;
        for p in &phases {
            acc += p.1;
            if t < acc {
                return p.0;
            }
        }
        "drain"
    };
    let mut s_off = Vec::new();
    let mut s_done = Vec::new();
    let mut s_procs = Vec::new();
    for b in 0..nb {
        let t = b as f64 * BUCKET;
        let procs = proclets_at(&tl, t + BUCKET, off);
        table.row(vec![
            Cell::from(t),
            Cell::from(phase_of(t)),
            Cell::from(offered[b] as f64 / BUCKET),
            Cell::from(completed[b] as f64 / BUCKET),
            Cell::from(failed[b] as f64),
            Cell::from(procs as f64),
            Cell::from(percentile(&lat[b], 0.5).unwrap_or(f64::NAN)),
            Cell::from(percentile(&lat[b], 0.99).unwrap_or(f64::NAN)),
        ]);
        s_off.push((t, offered[b] as f64 / BUCKET));
        s_done.push((t, completed[b] as f64 / BUCKET));
        s_procs.push((t, procs as f64 * 1000.0));
    }
    let plot = Plot::line(format!(
        "Stateless service, {WORK_US} µs of CPU per request: HTTP load ×3 and back"
    ))
    .x_label("seconds")
    .y_label("requests/s  (proclets × 1000)")
    .series("offered req/s", s_off)
    .series("completed req/s", s_done)
    .series("compute proclets × 1000", s_procs);

    // Headline figures.
    let failed_requests = outcomes.iter().filter(|o| !o.ok).count();
    let in_phase = |name: &str| -> Vec<f64> {
        let mut acc = 0.0;
        let mut range = (0.0, 0.0);
        for p in &phases {
            if p.0 == name {
                range = (acc, acc + p.1);
            }
            acc += p.1;
        }
        outcomes
            .iter()
            .filter(|o| o.ok && o.sched >= range.0 && o.sched < range.1)
            .map(|o| (o.done - o.sched) * 1e3)
            .collect()
    };
    let p99_base = percentile(&in_phase("base"), 0.99).unwrap_or(f64::NAN);
    let p99_peak = percentile(&in_phase("peak"), 0.99).unwrap_or(f64::NAN);
    let p99_after = percentile(&in_phase("base again"), 0.99).unwrap_or(f64::NAN);
    let drop_at = phases[0].1 + phases[1].1;
    let max_proclets = tl.samples.iter().map(|s| s.proclets).max().unwrap_or(1);
    let min_after_drop = tl
        .samples
        .iter()
        .filter(|s| s.t >= drop_at + off)
        .map(|s| s.proclets)
        .min()
        .unwrap_or(max_proclets);
    let in_load = |e: &&granule::service::ScaleEvent| e.t >= off && e.t <= off + total_secs;
    let splits = tl.events.iter().filter(|e| e.split).filter(in_load).count();
    let merges = tl
        .events
        .iter()
        .filter(|e| !e.split)
        .filter(in_load)
        .count();
    let events: Vec<String> = tl
        .events
        .iter()
        .map(|e| {
            format!(
                "{} at {:.2} s → {} (load {:.2})",
                if e.split { "split" } else { "merge" },
                e.t - off,
                e.proclets,
                e.load
            )
        })
        .collect();
    println!("scaling events: {}", events.join("; "));
    println!(
        "requests {offered_total}, failed {failed_requests}; proclets max {max_proclets}, after the drop min {min_after_drop}; \
         saturation: granule {granule_sat:.0} req/s ({granule_sat_failed} failed), plain axum {plain_sat:.0} req/s"
    );

    let placement = "the driver process (embedded controller, a front door, the load generator on one tokio \
                     thread, later the plain axum server on two) and two node processes (cpu=2, mem=1GiB) share \
                     the machine's vCPUs: nothing is pinned."
        .to_string();
    let mut meta = Meta::collect(placement, opts.quick);
    meta.note(format!(
        "handler: {WORK_US} µs of calibrated spin per request ({iters} iterations); open loop over {CONNS} keep-alive \
         HTTP/1.1 connections spread over the {} front doors, latency from the scheduled send time; phases: {}; \
         scaler: 5 ms windows, split above 1.0 core, merge two neighbours under 0.6 core averaged over 40 windows.",
        doors.len(),
        phases
            .iter()
            .map(|p| format!("{} {:.0} s at {:.0} req/s", p.0, p.1, p.2))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    meta.note(format!("scaling events: {}", events.join("; ")));
    meta.note(format!(
        "saturation ({SAT_CONNS} closed-loop connections, {sat_secs} s each): the service {granule_sat:.0} req/s \
         ({} compute proclets at the end, on nodes {:?}; {granule_sat_failed} failed), plain axum in the driver \
         process calling the handler directly {plain_sat:.0} req/s",
        peak_proclets.len(),
        peak_proclets.iter().map(|w| w.node).collect::<Vec<_>>()
    ));
    let mut rep = Report::new("service", meta);
    rep.title("Benchmark: service — a stateless service splitting and merging under HTTP load");
    rep.table(table);
    rep.plot(plot);
    rep.summary("failed_requests", failed_requests as f64);
    rep.summary("requests", offered_total as f64);
    rep.summary("max_proclets", max_proclets as f64);
    rep.summary("min_proclets_after_drop", min_after_drop as f64);
    rep.summary("splits", splits as f64);
    rep.summary("merges", merges as f64);
    rep.summary("p99_ms_base", p99_base);
    rep.summary("p99_ms_peak", p99_peak);
    rep.summary("p99_ms_base_again", p99_after);
    rep.summary("saturation_req_per_s", granule_sat);
    rep.summary("plain_axum_req_per_s", plain_sat);
    rep.summary("throughput_vs_plain_axum", granule_sat / plain_sat);
    Ok(rep.write(&opts.out)?)
}
