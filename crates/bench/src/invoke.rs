//! `granule-bench invoke`: proclet call throughput and latency against the cost of the
//! work done per call (0.1, 1, 10, 50 µs of calibrated busy work), next to baselines
//! measured in the same run with the same work and payload:
//!
//! - **function**: a plain (non-inlined) function call on the driver's thread;
//! - **local**: a proclet hosted by the driver, called from the driver's thread (the
//!   local fast path: the argument is moved, not encoded);
//! - **remote sync / pipelined**: a proclet on a node process with `cpu=1`, one call at a
//!   time, or 128 calls in flight from a current-thread tokio runtime on the driver's
//!   thread;
//! - **raw TCP sync / pipelined**: the same request (length prefix, iterations, 64-byte
//!   payload) over a plain blocking socket to a single-threaded server inside the same
//!   node process, one at a time or in batches of 128.
//!
//! Thread placement (stated in every report): caller = the driver's main thread plus the
//! driver's single I/O worker thread; callee = the node's single worker thread (it reads,
//! runs and answers calls); the raw TCP server is one blocking thread in the node process
//! and the raw client is the driver's main thread. On a machine with 2+ vCPUs the driver
//! process is pinned to vCPU 0 and the callee node process to vCPU 1, so Granule and raw
//! TCP pay the same cross-vCPU wake-ups. Synchronous raw TCP is measured twice: with a
//! client that blocks at once, and with one that waits the way Granule's blocked callers
//! do (spin `transport.spin`, then sleep) — the latter is the baseline of the headline
//! ratio (same blocking mode).

use crate::work::{calibrate, iters_for, spin};
use crate::BenchOpts;
use anyhow::{anyhow, Context};
use futures::stream::{FuturesUnordered, StreamExt};
use granule::{Cluster, Kind, NodeSpec, Proclet};
use granule_report::{Cell, Latency, Meta, Plot, Report, Summary, Table};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const WORK_US: [f64; 4] = [0.1, 1.0, 10.0, 50.0];
const PAYLOAD: usize = 64;
const WINDOW: usize = 128;

/// State of the benchmark proclets.
#[derive(Serialize, Deserialize, Default)]
struct Bench {
    calls: u64,
}

/// One request: how much work, plus a payload to carry.
#[derive(Serialize, Deserialize, Clone)]
struct Req {
    iters: u64,
    payload: Vec<u8>,
}

#[inline(never)]
fn plain(b: &mut Bench, r: Req) -> u64 {
    b.calls += 1;
    spin(r.iters) ^ r.payload.len() as u64
}

fn on_proclet(b: &mut Bench, r: Req) -> u64 {
    b.calls += 1;
    spin(r.iters) ^ r.payload.len() as u64
}

/// A raw TCP server thread living in a node process (so it shares the callee's
/// process and machine, like the remote proclet).
#[derive(Serialize, Deserialize)]
struct RawServer {
    addr: String,
}

impl RawServer {
    fn start() -> RawServer {
        let listener = match TcpListener::bind("127.0.0.1:0") {
            Ok(l) => l,
            Err(e) => {
                return RawServer {
                    addr: format!("error: {e}"),
                }
            }
        };
        let addr = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|e| format!("error: {e}"));
        std::thread::Builder::new()
            .name("raw-tcp-server".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    // A thread per client; the benchmark drives one client at a time,
                    // so one server thread is active at any moment.
                    let _ = std::thread::Builder::new()
                        .name("raw-tcp-conn".into())
                        .spawn(move || serve_raw(conn));
                }
            })
            .ok();
        RawServer { addr }
    }
}

/// Answer every complete request in what was read with one write (so pipelined batches
/// cost one system call per batch, as they do for Granule's transport).
fn serve_raw(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut buf = vec![0u8; 1 << 16];
    let mut have = 0usize;
    let mut out = Vec::with_capacity(1 << 16);
    loop {
        let n = s.read(&mut buf[have..])?;
        if n == 0 {
            return Ok(());
        }
        have += n;
        let mut at = 0;
        out.clear();
        while have - at >= 4 {
            let len = u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]) as usize;
            if have - at < 4 + len {
                break;
            }
            let body = &buf[at + 4..at + 4 + len];
            let mut it = [0u8; 8];
            it.copy_from_slice(&body[..8]);
            let r = spin(u64::from_le_bytes(it)) ^ (len as u64 - 8);
            out.extend_from_slice(&8u32.to_le_bytes());
            out.extend_from_slice(&r.to_le_bytes());
            at += 4 + len;
        }
        buf.copy_within(at..have, 0);
        have -= at;
        if have == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        s.write_all(&out)?;
    }
}

pub use crate::affinity::pin_process;

fn write_all_nonblocking(s: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn raw_request(iters: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + 8 + PAYLOAD);
    v.extend_from_slice(&((8 + PAYLOAD) as u32).to_le_bytes());
    v.extend_from_slice(&iters.to_le_bytes());
    v.extend_from_slice(&[7u8; PAYLOAD]);
    v
}

/// Calls per second of `f` over `dur` (the clock is read every 32 calls).
fn rate(dur: Duration, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let t = Instant::now();
    let mut n = 0u64;
    loop {
        for _ in 0..32 {
            f()?;
        }
        n += 32;
        let e = t.elapsed();
        if e >= dur {
            return Ok(n as f64 / e.as_secs_f64());
        }
    }
}

/// Calls per second of `f` over `dur`, recording each call's latency.
fn timed_rate(
    dur: Duration,
    lat: &mut Latency,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < dur {
        let c = Instant::now();
        f()?;
        lat.record(c.elapsed());
        n += 1;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

struct Setup {
    cluster: Cluster,
    local: Proclet<Bench>,
    remote: Proclet<Bench>,
    raw: TcpStream,
    /// A second raw connection, non-blocking, for the spin-then-block client.
    raw_spin: TcpStream,
    spin: Duration,
    pinned: bool,
    rt: tokio::runtime::Runtime,
    per_us: f64,
}

impl Setup {
    fn new() -> anyhow::Result<Setup> {
        let per_us = calibrate();
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=512MiB")?
            .driver(NodeSpec {
                cores: 1.0,
                mem_bytes: 512 << 20,
            })
            .start()
            .context("starting the benchmark cluster")?;
        let callee = *cluster
            .worker_nodes()?
            .first()
            .ok_or_else(|| anyhow!("the cluster has no node"))?;
        // Every proclet here is pinned: the measurement is about calls at a fixed
        // placement, and the caller's own spinning would otherwise look like CPU pressure
        // to the driver's monitor, which would move the "local" proclet away.
        let local = Proclet::builder(Kind::Compute)
            .on(cluster.node_id())
            .pinned()
            .create((), |()| Bench::default())?;
        // Thread placement: the driver (caller) on vCPU 0, the callee node process on
        // vCPU 1 — the same for Granule and for raw TCP, so both pay the same cross-core
        // wake-ups. Done before the raw server thread starts, which inherits it.
        let pinned = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            >= 2;
        if pinned {
            pin_process(0)?;
            let node_pin = Proclet::builder(Kind::Compute)
                .on(callee)
                .pinned()
                .create(1usize, |cpu: usize| {
                    pin_process(cpu).map_err(|e| e.to_string())
                })?;
            node_pin
                .run_ref((), |r: &Result<(), String>, ()| r.clone())?
                .map_err(|e| anyhow!("pinning the callee: {e}"))?;
        }
        let remote = Proclet::builder(Kind::Compute)
            .on(callee)
            .pinned()
            .create((), |()| Bench::default())?;
        let raw_server = Proclet::builder(Kind::Compute)
            .on(callee)
            .pinned()
            .create((), |()| RawServer::start())?;
        let addr = raw_server.run_ref((), |s: &RawServer, ()| s.addr.clone())?;
        if addr.starts_with("error") {
            anyhow::bail!("the raw TCP server could not start: {addr}");
        }
        let raw = TcpStream::connect(&addr).with_context(|| format!("connecting to {addr}"))?;
        raw.set_nodelay(true)?;
        let raw_spin =
            TcpStream::connect(&addr).with_context(|| format!("connecting to {addr}"))?;
        raw_spin.set_nodelay(true)?;
        raw_spin.set_nonblocking(true)?;
        // The same policy Granule's blocked callers use (`transport.spin`).
        let spin = cluster.config().transport.spin;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Setup {
            cluster,
            local,
            remote,
            raw,
            raw_spin,
            spin,
            pinned,
            rt,
            per_us,
        })
    }

    fn req(&self, work_us: f64) -> Req {
        Req {
            iters: iters_for(work_us, self.per_us),
            payload: vec![7u8; PAYLOAD],
        }
    }

    fn function(&self, w: f64, dur: Duration) -> anyhow::Result<f64> {
        let req = self.req(w);
        let mut st = Bench::default();
        let f: fn(&mut Bench, Req) -> u64 = black_box(plain);
        rate(dur, || {
            black_box(f(&mut st, req.clone()));
            Ok(())
        })
    }

    fn local(&self, w: f64, dur: Duration) -> anyhow::Result<f64> {
        let req = self.req(w);
        rate(dur, || {
            black_box(self.local.run(req.clone(), on_proclet)?);
            Ok(())
        })
    }

    fn remote_sync(&self, w: f64, dur: Duration, lat: &mut Latency) -> anyhow::Result<f64> {
        let req = self.req(w);
        timed_rate(dur, lat, || {
            black_box(self.remote.run(req.clone(), on_proclet)?);
            Ok(())
        })
    }

    fn remote_pipelined(&self, w: f64, dur: Duration) -> anyhow::Result<f64> {
        let req = self.req(w);
        let remote = &self.remote;
        self.rt.block_on(async {
            let t = Instant::now();
            let mut inflight = FuturesUnordered::new();
            for _ in 0..WINDOW {
                inflight.push(remote.run_async(req.clone(), on_proclet));
            }
            let mut done = 0u64;
            while let Some(r) = inflight.next().await {
                r?;
                done += 1;
                if t.elapsed() < dur {
                    inflight.push(remote.run_async(req.clone(), on_proclet));
                }
            }
            Ok(done as f64 / t.elapsed().as_secs_f64())
        })
    }

    fn raw_sync(&mut self, w: f64, dur: Duration, lat: &mut Latency) -> anyhow::Result<f64> {
        let req = raw_request(iters_for(w, self.per_us));
        let mut reply = [0u8; 12];
        let raw = &mut self.raw;
        timed_rate(dur, lat, || {
            raw.write_all(&req)?;
            raw.read_exact(&mut reply)?;
            Ok(())
        })
    }

    /// Raw ping-pong whose client waits like Granule's blocked callers: it polls the
    /// socket for up to `spin`, then sleeps in `poll(2)` until the reply arrives.
    fn raw_sync_spin(&mut self, w: f64, dur: Duration, lat: &mut Latency) -> anyhow::Result<f64> {
        use std::os::fd::AsFd;
        let req = raw_request(iters_for(w, self.per_us));
        let spin = self.spin;
        let raw = &mut self.raw_spin;
        timed_rate(dur, lat, || {
            write_all_nonblocking(raw, &req)?;
            let mut got = 0usize;
            let mut reply = [0u8; 12];
            let start = Instant::now();
            while got < reply.len() {
                match raw.read(&mut reply[got..]) {
                    Ok(0) => anyhow::bail!("the raw server closed the connection"),
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if start.elapsed() >= spin {
                            let mut fds = [nix::poll::PollFd::new(
                                raw.as_fd(),
                                nix::poll::PollFlags::POLLIN,
                            )];
                            nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE)?;
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(())
        })
    }

    fn raw_pipelined(&mut self, w: f64, dur: Duration) -> anyhow::Result<f64> {
        let one = raw_request(iters_for(w, self.per_us));
        let batch: Vec<u8> = one
            .iter()
            .copied()
            .cycle()
            .take(one.len() * WINDOW)
            .collect();
        let mut replies = vec![0u8; 12 * WINDOW];
        let t = Instant::now();
        let mut n = 0u64;
        while t.elapsed() < dur {
            self.raw.write_all(&batch)?;
            self.raw.read_exact(&mut replies)?;
            n += WINDOW as u64;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    }

    /// Cores the callee node reported busy in its last heartbeat.
    fn callee_busy(&self) -> f64 {
        let callee = self.remote.location().ok();
        self.cluster
            .nodes()
            .ok()
            .and_then(|ns| ns.into_iter().find(|n| Some(n.id) == callee))
            .map(|n| n.usage.cores_busy)
            .unwrap_or(f64::NAN)
    }
}

const MODES: [&str; 7] = [
    "function",
    "local",
    "remote sync",
    "remote pipelined",
    "raw TCP sync (blocking)",
    "raw TCP pipelined",
    "raw TCP sync (spin, then block)",
];

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let _restore = crate::affinity::SavedAffinity::save();
    let reps = if opts.quick { 1 } else { 5 };
    let dur = if opts.quick {
        Duration::from_millis(30)
    } else {
        Duration::from_millis(400)
    };
    let progress = granule_report::Progress::new(reps as u64 + 2, "invoke");
    let mut s = Setup::new()?;
    progress.step("warming up every call path");
    eprintln!(
        "invoke: {reps} repetition(s) × {} work levels × {} modes, {dur:?} each (calibrated {:.0} spin iterations/µs)",
        WORK_US.len(),
        MODES.len(),
        s.per_us
    );
    // Warm up every path once.
    {
        let w = 1.0;
        let mut l = Latency::new();
        s.function(w, Duration::from_millis(20))?;
        s.local(w, Duration::from_millis(20))?;
        s.remote_sync(w, Duration::from_millis(50), &mut l)?;
        s.remote_pipelined(w, Duration::from_millis(50))?;
        s.raw_sync(w, Duration::from_millis(50), &mut l)?;
        s.raw_sync_spin(w, Duration::from_millis(50), &mut l)?;
        s.raw_pipelined(w, Duration::from_millis(50))?;
    }
    // rates[(mode, work)] = calls/s per repetition
    let mut rates: BTreeMap<(usize, usize), Vec<f64>> = BTreeMap::new();
    let mut lat_remote: Vec<Latency> = WORK_US.iter().map(|_| Latency::new()).collect();
    let mut lat_raw: Vec<Latency> = WORK_US.iter().map(|_| Latency::new()).collect();
    let mut lat_raw_spin: Vec<Latency> = WORK_US.iter().map(|_| Latency::new()).collect();
    let mut busy_10us = Vec::new();
    for rep in 0..reps {
        for (wi, &w) in WORK_US.iter().enumerate() {
            // Modes interleaved within a repetition, so drift hits all alike.
            let r = [
                s.function(w, dur)?,
                s.local(w, dur)?,
                s.remote_sync(w, dur, &mut lat_remote[wi])?,
                s.remote_pipelined(w, dur)?,
                s.raw_sync(w, dur, &mut lat_raw[wi])?,
                s.raw_pipelined(w, dur)?,
                s.raw_sync_spin(w, dur, &mut lat_raw_spin[wi])?,
            ];
            if w == 10.0 && !opts.quick {
                // The callee's heartbeat (every 100 ms) covers the end of the run above.
                s.remote_pipelined(w, Duration::from_millis(250))?;
                busy_10us.push(s.callee_busy());
            }
            for (mi, v) in r.into_iter().enumerate() {
                rates.entry((mi, wi)).or_default().push(v);
            }
        }
        progress.step(format!("repetition {}/{reps} done", rep + 1));
    }
    progress.finish();

    let med = |mi: usize, wi: usize| -> f64 {
        rates
            .get(&(mi, wi))
            .and_then(|v| Summary::of(v))
            .map(|s| s.median)
            .unwrap_or(f64::NAN)
    };
    let mut table = Table::new(&[
        "mode",
        "work_us",
        "calls_per_s_median",
        "calls_per_s_min",
        "calls_per_s_max",
        "vs_function",
        "p50_us",
        "p99_us",
    ]);
    for (mi, mode) in MODES.iter().enumerate() {
        for (wi, &w) in WORK_US.iter().enumerate() {
            let sm = rates.get(&(mi, wi)).and_then(|v| Summary::of(v));
            let (lo, md, hi) =
                sm.map(|s| (s.min, s.median, s.max))
                    .unwrap_or((f64::NAN, f64::NAN, f64::NAN));
            let lat = match mi {
                2 => Some(&lat_remote[wi]),
                4 => Some(&lat_raw[wi]),
                6 => Some(&lat_raw_spin[wi]),
                _ => None,
            };
            let (p50, p99) = lat
                .map(|l| (l.p(0.5).as_secs_f64() * 1e6, l.p(0.99).as_secs_f64() * 1e6))
                .unwrap_or((f64::NAN, f64::NAN));
            table.row(vec![
                Cell::from(*mode),
                w.into(),
                md.into(),
                lo.into(),
                hi.into(),
                (md / med(0, wi)).into(),
                Cell::from(if p50.is_nan() { None } else { Some(p50) }),
                Cell::from(if p99.is_nan() { None } else { Some(p99) }),
            ]);
        }
    }

    let wi = |w: f64| WORK_US.iter().position(|x| *x == w).unwrap_or(0);
    let local_eff_1us = med(1, wi(1.0)) / med(0, wi(1.0));
    // The callee has one worker core; the local caller uses one core.
    let remote_vs_local_10us = med(3, wi(10.0)) / 1.0 / med(1, wi(10.0));
    let sync_p50 = lat_remote[0].p(0.5).as_secs_f64() * 1e6;
    let tcp_blocking_p50 = lat_raw[0].p(0.5).as_secs_f64() * 1e6;
    // Same blocking mode as Granule's caller (spin, then sleep): the headline baseline.
    let tcp_p50 = lat_raw_spin[0].p(0.5).as_secs_f64() * 1e6;

    let mut plot = Plot::line("Calls per second vs work per call")
        .x_label("work per call (µs)")
        .y_label("calls per second")
        .log_x(true)
        .log_y(true);
    for (mi, mode) in MODES.iter().enumerate() {
        plot = plot.series(
            *mode,
            WORK_US
                .iter()
                .enumerate()
                .map(|(wi, &w)| (w, med(mi, wi)))
                .collect::<Vec<_>>(),
        );
    }

    let pin_text = if s.pinned {
        "Pinned: every thread of the driver process (the caller) on vCPU 0, every thread of the callee node \
process on vCPU 1, so each call crosses vCPUs both ways, for Granule and raw TCP alike."
    } else {
        "Nothing pinned (fewer than 2 vCPUs): the kernel places the threads."
    };
    let placement = format!(
        "caller: the driver's main thread (sync calls; pipelined calls from a current-thread tokio runtime on it; \
a blocked caller spins {:?}, reading its reply from the socket itself, then sleeps) plus the driver's single I/O \
worker thread; callee: a node process with cpu=1 whose one worker thread reads, runs and answers calls. Raw TCP: \
the same caller thread (blocking socket, or spinning {:?} then sleeping in poll(2)) and a single blocking server \
thread inside the callee node process. {pin_text}",
        s.spin, s.spin
    );
    let mut meta = Meta::collect(placement, opts.quick);
    meta.note(format!(
        "work = calibrated integer spin ({:.0} iterations/µs); payload {PAYLOAD} B; pipelined window {WINDOW}; \
         {reps} repetition(s) of {dur:?} per mode and work level, modes interleaved; figures are medians",
        s.per_us
    ));
    let mut rep = Report::new("invoke", meta);
    rep.table(table);
    rep.plot(plot);
    rep.summary("local_efficiency_1us", local_eff_1us);
    rep.summary("remote_pipelined_10us_vs_local", remote_vs_local_10us);
    rep.summary("sync_rtt_vs_tcp_pingpong", sync_p50 / tcp_p50);
    rep.summary("remote_sync_p50_us", sync_p50);
    rep.summary("tcp_pingpong_p50_us", tcp_p50);
    rep.summary("tcp_pingpong_blocking_p50_us", tcp_blocking_p50);
    rep.summary(
        "sync_rtt_vs_tcp_pingpong_blocking",
        sync_p50 / tcp_blocking_p50,
    );
    for (wi, w) in WORK_US.iter().enumerate() {
        let ours = lat_remote[wi].p(0.5).as_secs_f64();
        let raw = lat_raw_spin[wi].p(0.5).as_secs_f64();
        rep.summary(format!("sync_rtt_vs_tcp_pingpong_{w}us"), ours / raw);
    }
    rep.summary("remote_pipelined_10us_calls_per_s", med(3, wi(10.0)));
    rep.summary("local_1us_calls_per_s", med(1, wi(1.0)));
    rep.summary("function_1us_calls_per_s", med(0, wi(1.0)));
    rep.summary(
        "remote_pipelined_vs_raw_tcp_pipelined_10us",
        med(3, wi(10.0)) / med(5, wi(10.0)),
    );
    if let Some(b) = Summary::of(&busy_10us) {
        rep.summary("callee_cores_busy_10us_pipelined", b.median);
    }
    rep.note(format!(
        "local_efficiency_1us = local calls/s ÷ plain function calls/s at 1 µs of work; \
         remote_pipelined_10us_vs_local = remote pipelined calls/s per callee worker core ÷ local calls/s per core at 10 µs \
         ({:.0} calls/s means the callee's one core spends {:.0} % of its time in the 10 µs of work); \
         sync_rtt_vs_tcp_pingpong = p50 of a synchronous remote call ÷ p50 of a raw TCP ping-pong at 0.1 µs of work, \
         with the same blocking mode: both callers spin for {:?} and then sleep until the reply (Granule's \
         transport.spin policy); the raw client that blocks at once is reported too (…_blocking), and the ratio at \
         every work level (sync_rtt_vs_tcp_pingpong_Nus).",
        med(3, wi(10.0)),
        med(3, wi(10.0)) * 10e-6 * 100.0,
        s.spin
    ));
    rep.note("For reference (EVALUATION.md, same machine class): a Ray no-op actor call has p50 ~1.25 ms and 3-4k calls/s pipelined.");
    let dir = rep.write(&opts.out)?;
    crate::print_cluster_usage(&s.cluster);
    s.cluster.shutdown();
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_server_answers_batches() {
        let s = RawServer::start();
        let mut c = TcpStream::connect(&s.addr).unwrap();
        let one = raw_request(10);
        let batch: Vec<u8> = one.iter().copied().cycle().take(one.len() * 5).collect();
        c.write_all(&batch).unwrap();
        let mut replies = vec![0u8; 12 * 5];
        c.read_exact(&mut replies).unwrap();
        assert_eq!(&replies[..4], &8u32.to_le_bytes());
    }
}
