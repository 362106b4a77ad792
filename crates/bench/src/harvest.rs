//! `granule-bench harvest`: the market's harvester on a real `redis-server` (Debian's),
//! measured against the same server left alone.
//!
//! **The producer.** `redis-server` in a memory cgroup of its own (a
//! [`WorkloadGroup`]), holding `keys` values of `VALUE_BYTES` (4000 B: jemalloc's
//! 4 KiB size class, so one value is one page), loaded in a shuffled order. Values are
//! half random printable bytes and half repeated text (about 2:1 under zswap's lzo; the
//! achieved ratio is reported).
//!
//! **The load.** `clients` closed-loop connections (each sends `GET`, waits for the
//! reply, sends the next) from threads of this process pinned to vCPU `LOAD_CPU`;
//! `redis-server` pinned to vCPU `SERVER_CPU`; the harvester's thread and the driver
//! float. Keys are drawn from YCSB's scrambled Zipfian (θ = 0.99) over a *hot set* of
//! `hot_keys` keys (a fifth of the dataset): the dataset is well above its hot set, and
//! the other four fifths are never asked for. The generator keeps one latency histogram
//! per second (p99 and throughput per second) and one per phase.
//!
//! **A run.** A fresh `redis-server`, loaded; `warm` of load; then the measured phase of
//! `measure`. In a run *without* the harvester the pages' referenced bits are cleared at
//! the start of the measured phase and read back at its end (`clear_refs` and
//! `smaps_rollup`): memory not referenced during the phase is *idle*, at page
//! granularity. In a run *with* it, a [`Harvester`] (the producer's own code, configured
//! as below) adopts the group at the start of the measured phase; *harvested* memory is
//! its limit reduction minus the growth of the zswap pool, at the end of the phase.
//!
//! **The runs.** `rounds` rounds of three runs — without, with the baseline policy,
//! with the PSI policy — in an order that rotates each round (interleaved pairs); one
//! more run without the harvester in the first round, paired with that round's run
//! without it, is the noise floor. Then three burst runs: harvesting (baseline policy)
//! for `burst_harvest`, then the load shifts to uniform over *all* keys for
//! `burst_uniform` — with prefetch, without prefetch, and without the harvester (the
//! reference). Recovery is the time from the shift until the per-second p99 stays within
//! `RECOVERED_WITHIN` of the reference's uniform-load p99 for `RECOVERED_FOR` seconds.
//!
//! Needs root, cgroup v1's memory controller and `redis-server`; says which is missing
//! otherwise. Ctrl-C (or SIGTERM) ends the current run the normal way (redis stopped,
//! limit, swap and zswap restored); after a SIGKILL the next run undoes what the last
//! one left, from the records in `/var/tmp/granule-bench-harvest`.

use crate::interrupt::{catch_signals, check_interrupted, interrupted, Active};
use crate::kv_secure::Rng;
use crate::zipf::Zipf;
use crate::BenchOpts;
use anyhow::{bail, Context};
use granule_config::{HarvestPolicy, Market};
use granule_host::workload::WorkloadGroup;
use granule_host::{Controller, ForeignGroup, Hierarchy};
use granule_market::harvester::{HarvestStatus, Harvester, MetricSource, Workload};
use granule_report::{Cell, Meta, Plot, Report, Table};
use hdrhistogram::Histogram;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One value: jemalloc's 4096-byte size class holds it (with Redis's string header), so
/// each value sits in a page of its own and page-level idleness is value-level idleness.
const VALUE_BYTES: usize = 4000;
const ZIPF_THETA: f64 = 0.99;
const SERVER_CPU: usize = 0;
const LOAD_CPU: usize = 1;
/// The seed of the load order and of every client's key sequence.
const SEED: u64 = 0x6a09_e667_f3bc_c908;
/// Recovered: the per-second p99 within this factor of the reference's ...
const RECOVERED_WITHIN: f64 = 1.25;
/// ... for this many seconds in a row.
const RECOVERED_FOR: usize = 3;
/// The zswap pool's ceiling while producing, percent of RAM: a victim cache of recently
/// harvested pages in front of the swap file (Memtrade's Silo), not a second home for
/// the whole harvest.
const ZSWAP_POOL_PERCENT: u32 = 1;

/// The run's size.
#[derive(Clone, Debug)]
struct Params {
    keys: u64,
    hot_keys: u64,
    clients: usize,
    warm: Duration,
    measure: Duration,
    burst_harvest: Duration,
    burst_uniform: Duration,
    rounds: usize,
    /// The harvester's configuration (state directory and swap file filled in later).
    market: Market,
}

impl Params {
    fn new(quick: bool, reps: Option<usize>) -> Params {
        let base = Market {
            zswap: true,
            zswap_pool_percent: ZSWAP_POOL_PERCENT,
            metric: "swapin".into(),
            prefetch: true,
            ..Market::default()
        };
        if quick {
            Params {
                keys: 16_000,
                hot_keys: 3_200,
                clients: 4,
                warm: Duration::from_secs(1),
                measure: Duration::from_secs(5),
                burst_harvest: Duration::from_secs(4),
                burst_uniform: Duration::from_secs(4),
                rounds: reps.unwrap_or(1),
                market: Market {
                    chunk: 4 << 20,
                    cooling_period: Duration::from_millis(500),
                    observe: Duration::from_secs(1),
                    headroom: 8 << 20,
                    swap_size: 256 << 20,
                    ..base
                },
            }
        } else {
            Params {
                keys: 400_000,
                hot_keys: 80_000,
                clients: 4,
                warm: Duration::from_secs(10),
                measure: Duration::from_secs(150),
                burst_harvest: Duration::from_secs(90),
                burst_uniform: Duration::from_secs(60),
                rounds: reps.unwrap_or(5),
                market: Market {
                    chunk: 64 << 20,
                    cooling_period: Duration::from_secs(2),
                    swap_size: 3 << 30,
                    ..base
                },
            }
        }
    }
}

/// Whether and how a run harvests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Without,
    Baseline,
    Psi,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Without => "without",
            Kind::Baseline => "baseline",
            Kind::Psi => "psi",
        }
    }

    fn policy(self) -> Option<HarvestPolicy> {
        match self {
            Kind::Without => None,
            Kind::Baseline => Some(HarvestPolicy::Baseline),
            Kind::Psi => Some(HarvestPolicy::Psi),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Spec {
    kind: Kind,
    /// The load shifts to uniform after the harvesting phase.
    burst: bool,
    prefetch: bool,
}

impl Spec {
    fn label(&self) -> String {
        match (self.burst, self.kind) {
            (false, k) => k.name().to_string(),
            (true, Kind::Without) => "burst, without".into(),
            (true, _) if self.prefetch => "burst, prefetch".into(),
            (true, _) => "burst, no prefetch".into(),
        }
    }
}

// ---- the load generator ------------------------------------------------------------

/// Phases the generator files its samples under.
const WARM: u8 = 0;
const MEASURE: u8 = 1;
const UNIFORM: u8 = 2;

/// A latency histogram in microseconds (1 µs to 60 s).
fn hist(sigfig: u8) -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, sigfig).expect("static histogram bounds are valid")
}

/// What one client thread saw.
struct ClientStats {
    /// Per second since the load started: requests and their latencies (µs).
    per_sec: Vec<Histogram<u64>>,
    /// Per phase (3 significant figures, for the run's p99).
    per_phase: [Histogram<u64>; 3],
    misses: u64,
}

impl ClientStats {
    fn new() -> ClientStats {
        ClientStats {
            per_sec: Vec::new(),
            per_phase: [hist(3), hist(3), hist(3)],
            misses: 0,
        }
    }

    fn record(&mut self, sec: usize, phase: u8, us: u64) {
        while self.per_sec.len() <= sec {
            self.per_sec.push(hist(2));
        }
        self.per_sec[sec].saturating_record(us.max(1));
        self.per_phase[usize::from(phase.min(UNIFORM))].saturating_record(us.max(1));
    }
}

/// What the load gathered: per-second histograms, per-phase histograms, misses.
type Gathered = (Vec<Histogram<u64>>, [Histogram<u64>; 3], u64);

/// The running load (see the module doc).
struct Load {
    start: Instant,
    phase: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<anyhow::Result<Vec<ClientStats>>>,
}

impl Load {
    /// Connect `clients` connections and drive them from one thread (a current-thread
    /// tokio runtime): several blocking client threads on one vCPU would wait for each
    /// other's time slices, and the generator's own scheduling would show in the p99.
    fn start(port: u16, p: &Params, pin: bool) -> anyhow::Result<Load> {
        let start = Instant::now();
        let phase = Arc::new(AtomicU8::new(WARM));
        let stop = Arc::new(AtomicBool::new(false));
        let zipf = Arc::new(Zipf::new(p.hot_keys, ZIPF_THETA));
        let mut streams = Vec::new();
        for _ in 0..p.clients {
            let stream = TcpStream::connect(("127.0.0.1", port))
                .with_context(|| format!("connecting to redis-server on port {port}"))?;
            stream.set_nodelay(true)?;
            stream.set_nonblocking(true)?;
            streams.push(stream);
        }
        let (ph, st) = (phase.clone(), stop.clone());
        let keys = p.keys;
        let thread = std::thread::Builder::new()
            .name("harvest-load".into())
            .spawn(move || -> anyhow::Result<Vec<ClientStats>> {
                if pin {
                    crate::affinity::pin_current_thread(LOAD_CPU)?;
                }
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let mut tasks = Vec::new();
                    for (c, stream) in streams.into_iter().enumerate() {
                        let stream = tokio::net::TcpStream::from_std(stream)?;
                        let (ph, st, zipf) = (ph.clone(), st.clone(), zipf.clone());
                        tasks.push(tokio::spawn(client(
                            stream,
                            start,
                            ph,
                            st,
                            zipf,
                            keys,
                            SEED ^ (c as u64 + 1),
                        )));
                    }
                    let mut out = Vec::new();
                    for t in tasks {
                        out.push(t.await.context("a load task panicked")??);
                    }
                    Ok(out)
                })
            })?;
        Ok(Load {
            start,
            phase,
            stop,
            thread,
        })
    }

    fn set_phase(&self, phase: u8) -> f64 {
        self.phase.store(phase, Ordering::Relaxed);
        self.start.elapsed().as_secs_f64()
    }

    /// Stop and gather: per-second histograms, per-phase histograms, misses.
    fn finish(self) -> anyhow::Result<Gathered> {
        self.stop.store(true, Ordering::Relaxed);
        let mut per_sec: Vec<Histogram<u64>> = Vec::new();
        let mut per_phase = [hist(3), hist(3), hist(3)];
        let mut misses = 0;
        let stats = match self.thread.join() {
            Ok(r) => r?,
            Err(_) => bail!("the load thread panicked"),
        };
        for s in stats {
            for (i, h) in s.per_sec.iter().enumerate() {
                while per_sec.len() <= i {
                    per_sec.push(hist(2));
                }
                per_sec[i].add(h).context("merging histograms")?;
            }
            for (a, b) in per_phase.iter_mut().zip(s.per_phase.iter()) {
                a.add(b).context("merging histograms")?;
            }
            misses += s.misses;
        }
        Ok((per_sec, per_phase, misses))
    }
}

fn key_of(id: u64) -> String {
    format!("k:{id:07}")
}

/// One closed-loop client: GET, wait, record, repeat, until told to stop.
async fn client(
    stream: tokio::net::TcpStream,
    start: Instant,
    phase: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    zipf: Arc<Zipf>,
    keys: u64,
    seed: u64,
) -> anyhow::Result<ClientStats> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let mut stats = ClientStats::new();
    let mut rng = Rng(seed | 1);
    let (rd, mut wr) = stream.into_split();
    let mut reader = tokio::io::BufReader::with_capacity(64 << 10, rd);
    let (mut cmd, mut line, mut body) = (Vec::new(), Vec::new(), Vec::new());
    let timeout = Duration::from_secs(30);
    while !stop.load(Ordering::Relaxed) {
        let ph = phase.load(Ordering::Relaxed);
        let id = if ph == UNIFORM {
            rng.next() % keys
        } else {
            // The hot set is ids 0..hot_keys; the load order scattered them in memory.
            zipf.next(&mut rng)
        };
        let key = key_of(id);
        cmd.clear();
        write!(cmd, "*2\r\n$3\r\nGET\r\n${}\r\n{}\r\n", key.len(), key)?;
        let sent = Instant::now();
        wr.write_all(&cmd)
            .await
            .context("sending GET to redis-server")?;
        let reply = async {
            line.clear();
            if reader.read_until(b'\n', &mut line).await? == 0 {
                bail!("redis-server closed the connection");
            }
            match bulk_len(&line)? {
                None => Ok(false),
                Some(len) => {
                    body.resize(len + 2, 0);
                    reader.read_exact(&mut body).await?;
                    Ok(true)
                }
            }
        };
        let found = tokio::time::timeout(timeout, reply)
            .await
            .map_err(|_| anyhow::anyhow!("redis-server did not answer a GET within 30 s"))?
            .context("reading redis-server's reply")?;
        let us = sent.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
        if !found {
            stats.misses += 1;
        }
        let sec = sent.duration_since(start).as_secs() as usize;
        stats.record(sec, ph, us);
    }
    Ok(stats)
}

/// The length of a bulk-string reply from its header line (`$4000\r\n`); `None` for a
/// nil (a missing key); an error for anything else.
fn bulk_len(line: &[u8]) -> anyhow::Result<Option<usize>> {
    let text = std::str::from_utf8(line).unwrap_or("?").trim_end();
    let Some(len) = text.strip_prefix('$') else {
        bail!("unexpected reply {text:?}");
    };
    let len: i64 = len
        .parse()
        .with_context(|| format!("bad bulk length {text:?}"))?;
    Ok(usize::try_from(len).ok())
}

// ---- redis ---------------------------------------------------------------------------

/// A `redis-server` child in its memory group, stopped on drop.
struct Redis {
    child: Child,
    port: u16,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn start_redis(group: &WorkloadGroup, dir: &Path, pin: bool) -> anyhow::Result<Redis> {
    let port = free_port()?;
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no", "--protected-mode", "no"])
        .args(["--dir", &dir.to_string_lossy()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting redis-server (Debian package redis-server)")?;
    let redis = Redis { child, port };
    group
        .join(redis.child.id())
        .context("moving redis-server into its memory group")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("redis-server did not listen on port {port} within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if pin {
        crate::affinity::pin_pid(redis.child.id(), SERVER_CPU)?;
    }
    Ok(redis)
}

/// The value of key `id`: half random printable bytes, half repeated text.
fn value_of(id: u64, out: &mut Vec<u8>) {
    out.clear();
    let mut rng = Rng(id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    while out.len() < VALUE_BYTES / 2 {
        let r = rng.next();
        for b in r.to_le_bytes() {
            out.push(b' ' + b % 95);
        }
    }
    out.truncate(VALUE_BYTES / 2);
    let text = format!("value of {id}: granule harvest benchmark; ");
    while out.len() < VALUE_BYTES {
        let n = (VALUE_BYTES - out.len()).min(text.len());
        out.extend_from_slice(&text.as_bytes()[..n]);
    }
}

/// A shuffled order of `0..n` (Fisher–Yates with the benchmark's seed).
fn shuffled(n: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut rng = Rng(SEED);
    for i in (1..v.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// SET every key (pipelined, batches of 256), in the shuffled order.
fn load_dataset(port: u16, keys: u64) -> anyhow::Result<()> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let order = shuffled(keys);
    let (mut cmd, mut value, mut line) = (Vec::new(), Vec::new(), Vec::new());
    for batch in order.chunks(256) {
        cmd.clear();
        for &id in batch {
            let key = key_of(id);
            value_of(id, &mut value);
            write!(
                cmd,
                "*3\r\n$3\r\nSET\r\n${}\r\n{}\r\n${}\r\n",
                key.len(),
                key,
                value.len()
            )?;
            cmd.extend_from_slice(&value);
            cmd.extend_from_slice(b"\r\n");
        }
        out.write_all(&cmd)?;
        for _ in batch {
            line.clear();
            reader.read_until(b'\n', &mut line)?;
            if !line.starts_with(b"+OK") {
                bail!(
                    "loading the dataset: redis-server answered {:?}",
                    String::from_utf8_lossy(&line)
                );
            }
        }
    }
    Ok(())
}

// ---- one run -------------------------------------------------------------------------

/// The harvester's state once a second.
#[derive(Clone, Debug)]
struct Tick {
    at_s: f64,
    status: HarvestStatus,
}

/// What one run measured.
struct RunOut {
    spec: Spec,
    round: usize,
    /// Per second since the load started: (requests, p99 µs).
    per_sec: Vec<(u64, f64)>,
    /// When the measured phase started and ended, and when the uniform load began.
    measure_from_s: f64,
    measure_to_s: f64,
    uniform_from_s: Option<f64>,
    /// The measured phase: requests per second, p50 and p99 (µs).
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    /// The uniform phase of a burst run: p99 (µs).
    uniform_p99_us: Option<f64>,
    misses: u64,
    /// Without the harvester: resident and referenced bytes over the measured phase.
    rss: Option<u64>,
    referenced: Option<u64>,
    /// With it: the status at the end of the measured (or harvesting) phase, and the
    /// zswap pool when it started.
    end: Option<HarvestStatus>,
    zswap_at_start: u64,
    timeline: Vec<Tick>,
    /// OOM kills in the group over the whole run.
    oom_kills: u64,
    /// What the harvester said it changed and undid.
    changes: Vec<String>,
}

impl RunOut {
    fn idle(&self) -> Option<u64> {
        Some(self.rss?.saturating_sub(self.referenced?))
    }

    fn harvested(&self) -> Option<u64> {
        self.end.as_ref().map(|s| s.harvested_bytes)
    }

    fn zswap_growth(&self) -> Option<u64> {
        self.end
            .as_ref()
            .map(|s| s.zswap_pool_bytes.saturating_sub(self.zswap_at_start))
    }
}

fn harvester_cfg(p: &Params, dir: &Path, spec: Spec) -> Market {
    Market {
        policy: spec.kind.policy().unwrap_or(HarvestPolicy::Baseline),
        prefetch: spec.prefetch,
        state_dir: dir.join("state").display().to_string(),
        swap_file: Some(dir.join("harvest.swap").display().to_string()),
        ..p.market.clone()
    }
}

/// Sleep for `d`, recording the harvester's status once a second.
fn watch(d: Duration, load: &Load, h: Option<&Harvester>, timeline: &mut Vec<Tick>) {
    let end = Instant::now() + d;
    loop {
        let now = Instant::now();
        if now >= end || interrupted() {
            break;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(250)));
        if timeline
            .last()
            .is_some_and(|t| load.start.elapsed().as_secs_f64() - t.at_s < 0.95)
        {
            continue;
        }
        if let Some(h) = h {
            timeline.push(Tick {
                at_s: load.start.elapsed().as_secs_f64(),
                status: h.status(),
            });
        }
    }
}

fn one_run(p: &Params, dir: &Path, spec: Spec, round: usize, pin: bool) -> anyhow::Result<RunOut> {
    let group = WorkloadGroup::create(
        &Hierarchy::default(),
        &format!("bench-harvest-{}", std::process::id()),
    )
    .context("creating redis-server's memory group")?;
    let watcher = ForeignGroup::adopt_dir(group.dir())?;
    let oom_before = watcher.oom_kills().unwrap_or(0);
    let redis = start_redis(&group, dir, pin)?;
    load_dataset(redis.port, p.keys)?;
    let pid = redis.child.id();

    let load = Load::start(redis.port, p, pin)?;
    watch(p.warm, &load, None, &mut Vec::new());
    let measure_from_s = load.set_phase(MEASURE);
    let mut harvester = None;
    let zswap_at_start = granule_host::mem::meminfo().map(|m| m.zswap).unwrap_or(0);
    if spec.kind == Kind::Without && !spec.burst {
        granule_host::workload::clear_referenced(pid)?;
    }
    let mut changes = Vec::new();
    if spec.kind != Kind::Without {
        let h = Harvester::start(
            &harvester_cfg(p, dir, spec),
            Workload::Cgroup(group.dir().to_path_buf()),
            MetricSource::SwapIn,
        )
        .context("starting the harvester")?;
        changes.extend(h.changes());
        harvester = Some(h);
    }
    let mut timeline = Vec::new();
    let phase = if spec.burst {
        p.burst_harvest
    } else {
        p.measure
    };
    watch(phase, &load, harvester.as_ref(), &mut timeline);
    let (mut rss, mut referenced) = (None, None);
    if spec.kind == Kind::Without && !spec.burst {
        let r = granule_host::workload::rollup(pid)?;
        rss = Some(r.rss);
        referenced = Some(r.referenced);
    }
    let end = harvester.as_ref().map(|h| h.status());
    let mut measure_to_s = load.start.elapsed().as_secs_f64();
    let mut uniform_from_s = None;
    if spec.burst {
        measure_to_s = load.set_phase(UNIFORM);
        uniform_from_s = Some(measure_to_s);
        watch(p.burst_uniform, &load, harvester.as_ref(), &mut timeline);
    }
    let run_end_s = load.start.elapsed().as_secs_f64();
    let finished = load.finish();
    let oom_kills = watcher.oom_kills().unwrap_or(0).saturating_sub(oom_before);
    // Stop redis before the harvester: turning the swap file off then has nothing to
    // read back.
    drop(redis);
    if let Some(h) = harvester {
        changes.extend(h.stop().context("stopping the harvester")?);
    }
    drop(watcher);
    group
        .remove()
        .context("removing redis-server's memory group")?;
    check_interrupted()?;
    let (per_sec_h, per_phase, misses) = finished.context("the load generator")?;

    let per_sec: Vec<(u64, f64)> = per_sec_h
        .iter()
        .map(|h| (h.len(), h.value_at_quantile(0.99) as f64))
        .collect();
    let measured = &per_phase[usize::from(MEASURE)];
    let span = (measure_to_s - measure_from_s).max(1e-3);
    let uniform = &per_phase[usize::from(UNIFORM)];
    let _ = run_end_s;
    Ok(RunOut {
        spec,
        round,
        per_sec,
        measure_from_s,
        measure_to_s,
        uniform_from_s,
        ops_per_s: measured.len() as f64 / span,
        p50_us: measured.value_at_quantile(0.5) as f64,
        p99_us: measured.value_at_quantile(0.99) as f64,
        uniform_p99_us: (!uniform.is_empty()).then(|| uniform.value_at_quantile(0.99) as f64),
        misses,
        rss,
        referenced,
        end,
        zswap_at_start,
        timeline,
        oom_kills,
        changes,
    })
}

/// Seconds from the shift to uniform until the per-second p99 stays at or below
/// `threshold_us` for `RECOVERED_FOR` seconds (`None`: not within the phase).
fn recovery_s(per_sec: &[(u64, f64)], from_s: f64, threshold_us: f64) -> Option<f64> {
    let first = from_s.ceil() as usize;
    let secs: Vec<f64> = per_sec
        .iter()
        .skip(first)
        .take_while(|(n, _)| *n > 0)
        .map(|(_, p)| *p)
        .collect();
    // The last second is partial (the load stopped in it): not judged.
    let whole = secs.len().saturating_sub(1);
    (0..whole.saturating_sub(RECOVERED_FOR - 1))
        .find(|&i| {
            secs[i..i + RECOVERED_FOR]
                .iter()
                .all(|p| *p <= threshold_us)
        })
        .map(|i| (first + i) as f64 - from_s)
}

fn median(v: &mut Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// What is missing on this machine to run the benchmark.
fn check_machine() -> anyhow::Result<()> {
    if !granule_host::proc::is_root() {
        bail!("the harvest benchmark needs root (it sets memory limits, swap and zswap)");
    }
    if !Hierarchy::default().has(Controller::Memory) {
        bail!("the harvest benchmark needs cgroup v1's memory controller under /sys/fs/cgroup");
    }
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        bail!("redis-server not found (Debian package redis-server; scripts/deps.sh installs it)");
    }
    Ok(())
}

/// Where the benchmark keeps its swap file and the harvester's records.
const STATE_DIR: &str = "/var/tmp/granule-bench-harvest";

/// Undo what an earlier run killed with SIGKILL left: `redis-server`s still in the
/// benchmark's memory groups (stopped, groups removed), then the harvester's records
/// (limits, swap file, zswap). Returns what it did.
fn recover_leftovers(p: &Params, dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let root = Hierarchy::default()
        .controller_dir(Controller::Memory)
        .join(granule_host::workload::WORKLOAD_DIR);
    if let Ok(entries) = std::fs::read_dir(&root) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !name.starts_with("bench-harvest-") || !e.path().is_dir() {
                continue;
            }
            // A group of a benchmark that still runs is not ours to touch.
            let owner = name
                .trim_start_matches("bench-harvest-")
                .parse::<u32>()
                .ok();
            if owner.is_some_and(|pid| !granule_host::proc::process_gone(pid)) {
                continue;
            }
            let group = WorkloadGroup::create(&Hierarchy::default(), &name)?;
            for pid in group.pids()? {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                out.push(format!("stopped redis-server (pid {pid}) left in {name}"));
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while !group.pids()?.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            group
                .remove()
                .with_context(|| format!("removing the leftover group {name}"))?;
            out.push(format!("removed the leftover memory group {name}"));
        }
    }
    if dir.exists() {
        let cfg = harvester_cfg(
            p,
            dir,
            Spec {
                kind: Kind::Baseline,
                burst: false,
                prefetch: true,
            },
        );
        out.extend(Harvester::recover(&cfg).context("undoing an earlier run's changes")?);
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(out)
}

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    check_machine()?;
    let p = Params::new(opts.quick, opts.reps);
    let cpus = granule_host::os::affinity(0).map(|c| c.len()).unwrap_or(1);
    let pin = cpus >= 2;
    let _saved = crate::affinity::SavedAffinity::save();
    catch_signals().map_err(|e| anyhow::anyhow!("cannot catch Ctrl-C: {e}"))?;
    let _active =
        Active::begin("harvest: interrupted; undoing this run's changes (again to quit at once)");
    // One fixed directory (the swap file needs a disk-backed file system, not a tmpfs
    // /tmp): a benchmark killed with SIGKILL leaves its records there, and the next one
    // undoes what they name before starting.
    let dir = PathBuf::from(STATE_DIR);
    for line in recover_leftovers(&p, &dir)? {
        println!("harvest: {line}");
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    struct RemoveDir(PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = RemoveDir(dir.clone());

    // The plan: rounds of (without, baseline, psi), rotated; a noise-floor run in round
    // 0; then the burst runs.
    let mut plan: Vec<(usize, Spec)> = Vec::new();
    let steady = |kind| Spec {
        kind,
        burst: false,
        prefetch: true,
    };
    for r in 0..p.rounds {
        let mut kinds = vec![Kind::Without, Kind::Baseline, Kind::Psi];
        kinds.rotate_left(r % 3);
        if r == 0 {
            kinds.push(Kind::Without);
        }
        plan.extend(kinds.into_iter().map(|k| (r, steady(k))));
    }
    for (kind, prefetch) in [
        (Kind::Baseline, true),
        (Kind::Baseline, false),
        (Kind::Without, false),
    ] {
        plan.push((
            0,
            Spec {
                kind,
                burst: true,
                prefetch,
            },
        ));
    }

    let progress = granule_report::Progress::new(plan.len() as u64, "harvest");
    let mut runs: Vec<RunOut> = Vec::new();
    for (round, spec) in plan {
        check_interrupted()?;
        let out = one_run(&p, &dir, spec, round, pin)
            .with_context(|| format!("run '{}' of round {round}", spec.label()))?;
        progress.step(format!(
            "round {round} {}: {:.0} ops/s, p99 {:.0} µs{}{}",
            spec.label(),
            out.ops_per_s,
            out.p99_us,
            out.idle()
                .map(|b| format!(", idle {:.0} MiB", mib(b)))
                .unwrap_or_default(),
            out.harvested()
                .map(|b| format!(", harvested {:.0} MiB", mib(b)))
                .unwrap_or_default(),
        ));
        runs.push(out);
    }
    progress.finish();
    report(opts, &p, &runs, pin)
}

fn report(opts: &BenchOpts, p: &Params, runs: &[RunOut], pin: bool) -> anyhow::Result<PathBuf> {
    let steady: Vec<&RunOut> = runs.iter().filter(|r| !r.spec.burst).collect();
    let without_of = |round: usize| {
        steady
            .iter()
            .find(|r| r.round == round && r.spec.kind == Kind::Without)
            .copied()
    };

    // Per-round pairs: (with, without).
    struct PairFig {
        harvested_of_idle: f64,
        p99_slowdown: f64,
        tput_loss: f64,
    }
    let pairs = |kind: Kind| -> Vec<PairFig> {
        steady
            .iter()
            .filter(|r| r.spec.kind == kind)
            .filter_map(|w| {
                let wo = without_of(w.round)?;
                Some(PairFig {
                    harvested_of_idle: w.harvested()? as f64 / wo.idle()?.max(1) as f64,
                    p99_slowdown: w.p99_us / wo.p99_us - 1.0,
                    tput_loss: 1.0 - w.ops_per_s / wo.ops_per_s,
                })
            })
            .collect()
    };
    let fig = |v: &[PairFig], f: fn(&PairFig) -> f64| {
        let mut x: Vec<f64> = v.iter().map(f).collect();
        median(&mut x)
    };
    let base = pairs(Kind::Baseline);
    let psi = pairs(Kind::Psi);
    let withouts: Vec<&RunOut> = steady
        .iter()
        .filter(|r| r.round == 0 && r.spec.kind == Kind::Without)
        .copied()
        .collect();
    let noise_floor = match withouts.as_slice() {
        [a, b, ..] => (b.p99_us / a.p99_us - 1.0).abs(),
        _ => f64::NAN,
    };
    let noise_tput = match withouts.as_slice() {
        [a, b, ..] => (1.0 - b.ops_per_s / a.ops_per_s).abs(),
        _ => f64::NAN,
    };
    // The group's own count over each whole run (the harvester's status counts the same
    // kills, over its part of the run only).
    let oom_kills: u64 = runs.iter().map(|r| r.oom_kills).sum();

    // Bursts.
    let burst = |kind: Kind, prefetch: bool| {
        runs.iter().find(|r| {
            r.spec.burst
                && r.spec.kind == kind
                && (kind == Kind::Without || r.spec.prefetch == prefetch)
        })
    };
    let reference = burst(Kind::Without, false);
    let ref_p99 = reference.and_then(|r| {
        let from = r.uniform_from_s?.ceil() as usize;
        let mut v: Vec<f64> = r
            .per_sec
            .iter()
            .skip(from)
            .take_while(|(n, _)| *n > 0)
            .map(|(_, p)| *p)
            .collect();
        v.pop(); // the partial last second
        Some(median(&mut v))
    });
    let recovery = |prefetch: bool| -> (f64, bool) {
        let Some(r) = burst(Kind::Baseline, prefetch) else {
            return (f64::NAN, false);
        };
        let (Some(from), Some(refp)) = (r.uniform_from_s, ref_p99) else {
            return (f64::NAN, false);
        };
        match recovery_s(&r.per_sec, from, refp * RECOVERED_WITHIN) {
            Some(s) => (s, true),
            None => (p.burst_uniform.as_secs_f64(), false),
        }
    };
    let (rec_pf, rec_pf_ok) = recovery(true);
    let (rec_no, rec_no_ok) = recovery(false);

    // Tables.
    let mut table = Table::new(&[
        "round",
        "run",
        "ops/s",
        "p50 µs",
        "p99 µs",
        "idle MiB",
        "resident MiB",
        "harvested MiB",
        "limit reduction MiB",
        "zswap growth MiB",
        "limit at end MiB",
        "recoveries",
        "prefetches",
        "harvester CPU s",
        "OOM kills",
        "uniform p99 µs",
        "recovery s",
    ]);
    for r in runs {
        let opt = |v: Option<f64>| v.map(Cell::from).unwrap_or_else(|| Cell::from("-"));
        let red = r
            .end
            .as_ref()
            .map(|s| mib(s.harvested_bytes + r.zswap_growth().unwrap_or(0)));
        let rec = if r.spec.burst && r.spec.kind != Kind::Without {
            let (v, ok) = recovery(r.spec.prefetch);
            Cell::from(if ok {
                format!("{v:.0}")
            } else {
                format!("> {v:.0}")
            })
        } else {
            Cell::from("-")
        };
        table.row(vec![
            Cell::from(r.round),
            Cell::from(r.spec.label()),
            Cell::from(r.ops_per_s),
            Cell::from(r.p50_us),
            Cell::from(r.p99_us),
            opt(r.idle().map(mib)),
            opt(r.rss.map(mib)),
            opt(r.harvested().map(mib)),
            opt(red),
            opt(r.zswap_growth().map(mib)),
            opt(r
                .end
                .as_ref()
                .map(|s| mib(s.limit_bytes.min(u64::MAX >> 1)))),
            opt(r.end.as_ref().map(|s| s.recoveries as f64)),
            opt(r.end.as_ref().map(|s| s.prefetches as f64)),
            opt(r.end.as_ref().map(|s| s.cpu_seconds)),
            Cell::from(r.oom_kills),
            opt(r.uniform_p99_us),
            rec,
        ]);
    }

    let mut pair_table = Table::new(&[
        "policy",
        "pairs",
        "harvested ÷ idle (median)",
        "p99 slowdown (median)",
        "throughput loss (median)",
        "per pair: harvested ÷ idle",
        "per pair: p99 slowdown",
        "per pair: throughput loss",
    ]);
    for (name, v) in [("baseline", &base), ("psi", &psi)] {
        let list = |f: fn(&PairFig) -> f64| {
            v.iter()
                .map(|x| format!("{:.3}", f(x)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        pair_table.row(vec![
            Cell::from(name),
            Cell::from(v.len()),
            Cell::from(fig(v, |x| x.harvested_of_idle)),
            Cell::from(fig(v, |x| x.p99_slowdown)),
            Cell::from(fig(v, |x| x.tput_loss)),
            Cell::from(list(|x| x.harvested_of_idle)),
            Cell::from(list(|x| x.p99_slowdown)),
            Cell::from(list(|x| x.tput_loss)),
        ]);
    }

    // Plots: harvested memory over time (main), per-second p99 of round 0 and of the
    // bursts (extra).
    let mut plot =
        Plot::line("harvested memory over the measured phase (limit reduction minus zswap growth)")
            .x_label("seconds since the harvester started")
            .y_label("MiB");
    for r in steady.iter().filter(|r| r.spec.kind != Kind::Without) {
        plot.push_series(
            format!("{} (round {})", r.spec.label(), r.round),
            r.timeline
                .iter()
                .map(|t| (t.at_s - r.measure_from_s, mib(t.status.harvested_bytes))),
        );
    }
    if let Some(idle) = {
        let mut v: Vec<f64> = steady.iter().filter_map(|r| r.idle()).map(mib).collect();
        let m = median(&mut v);
        m.is_finite().then_some(m)
    } {
        plot = plot.hline(idle, "idle memory without the harvester (median)");
    }

    let mut p99_plot = Plot::line("per-second p99 latency, round 0")
        .x_label("seconds since the measured phase started")
        .y_label("p99 µs");
    for r in steady.iter().filter(|r| r.round == 0) {
        let from = r.measure_from_s.ceil() as usize;
        p99_plot.push_series(
            r.spec.label(),
            r.per_sec
                .iter()
                .enumerate()
                .skip(from)
                .filter(|(i, (n, _))| *n > 0 && (*i as f64) + 1.0 <= r.measure_to_s)
                .map(|(i, (_, p))| (i as f64 - r.measure_from_s, *p)),
        );
    }
    let mut burst_plot = Plot::line("burst: per-second p99 after the load turns uniform")
        .x_label("seconds since the shift")
        .y_label("p99 µs")
        .log_y(true);
    for r in runs.iter().filter(|r| r.spec.burst) {
        let Some(from) = r.uniform_from_s else {
            continue;
        };
        burst_plot.push_series(
            r.spec.label(),
            r.per_sec
                .iter()
                .enumerate()
                .skip(from.floor() as usize)
                .filter(|(_, (n, _))| *n > 0)
                .map(|(i, (_, p))| (i as f64 - from, *p)),
        );
    }
    if let Some(refp) = ref_p99 {
        burst_plot = burst_plot.hline(refp * RECOVERED_WITHIN, "recovered: 1.25 × reference p99");
    }

    let placement = if pin {
        format!(
            "redis-server (every thread) pinned to vCPU {SERVER_CPU}; the {} load threads pinned to vCPU \
             {LOAD_CPU}; the harvester's thread and the benchmark's driver float over both",
            p.clients
        )
    } else {
        "fewer than two vCPUs available: nothing pinned".to_string()
    };
    let mut meta = Meta::collect(placement, opts.quick);
    let zswap_ratio = runs
        .iter()
        .filter_map(|r| r.end.as_ref())
        .map(|s| s.zswap_pool_bytes)
        .max()
        .unwrap_or(0);
    meta.note(format!(
        "producer: {} ({}), a dataset of {} keys × {VALUE_BYTES} B values ({:.0} MiB of values, loaded in a \
         shuffled order; half random printable bytes, half repeated text), no persistence (save \"\", appendonly no)",
        crate::kv_secure::redis_version(),
        "Debian's redis-server",
        p.keys,
        (p.keys as f64 * 4096.0) / (1u64 << 20) as f64,
    ));
    meta.note(format!(
        "load: {} closed-loop GET clients, YCSB scrambled Zipfian θ = {ZIPF_THETA} over a hot set of {} keys \
         ({:.0} % of the dataset; the rest is never asked for); {} s warm-up, then a measured phase of {} s; \
         burst runs: {} s harvesting, then the load turns uniform over all keys for {} s",
        p.clients,
        p.hot_keys,
        100.0 * p.hot_keys as f64 / p.keys as f64,
        p.warm.as_secs_f64(),
        p.measure.as_secs_f64(),
        p.burst_harvest.as_secs_f64(),
        p.burst_uniform.as_secs_f64()
    ));
    meta.note(format!(
        "harvester (the producer's own code, granule_market::harvester): observes {} s (the workload's referenced \
         bits cleared) before its first step, then chunk {} MiB, cooling period {} s, headroom {} MiB, slowdown threshold {} %, severe after {} epochs, metric = swap-in (anonymous refault) \
         rate with a tolerance of {} pages/s, burst above {} pages/s; PSI policy target {} stall s/s; a {} MiB \
         swap file created per run and zswap on with its pool capped at {ZSWAP_POOL_PERCENT} % of RAM (a \
         victim cache; pages beyond it are written to the swap file), all undone after each run",
        p.market.observe.as_secs_f64(),
        p.market.chunk >> 20,
        p.market.cooling_period.as_secs_f64(),
        p.market.headroom >> 20,
        p.market.slowdown_threshold * 100.0,
        p.market.severe_epochs,
        p.market.swapin_tolerance,
        p.market.burst_swapin,
        p.market.psi_target,
        p.market.swap_size >> 20,
    ));
    meta.note(format!(
        "{} rounds, each: without the harvester, with the baseline policy, with the PSI policy (order rotated \
         each round; a fresh redis-server per run); round 0 adds a second run without the harvester, paired with \
         the first for the noise floor. Idle memory: resident bytes minus bytes referenced during the measured \
         phase (clear_refs, then smaps_rollup), runs without the harvester. Harvested: the limit reduction \
         minus the growth of the zswap pool, at the end of the measured phase. p99 and throughput: over the whole \
         measured phase (the harvester's ramp included). Largest zswap pool seen: {:.0} MiB.",
        p.rounds,
        mib(zswap_ratio)
    ));
    meta.note(format!(
        "burst recovery: seconds from the shift to uniform until the per-second p99 stays ≤ {RECOVERED_WITHIN} × \
         the reference run's (no harvester, same uniform load) median per-second p99{} for {RECOVERED_FOR} s; \
         prefetch = the harvester reads redis-server's swapped pages from /proc/PID/pagemap, takes the most \
         recently swapped out (largest swap slot) that fit under the raised limit, and advises them with \
         process_madvise(MADV_WILLNEED), when it sees the burst; a burst row's harvester columns are at the end \
         of its harvesting phase (the prefetch comes after: timeline.csv)",
        ref_p99.map(|v| format!(" ({v:.0} µs)")).unwrap_or_default()
    ));
    let misses: u64 = runs.iter().map(|r| r.misses).sum();
    if misses > 0 {
        meta.note(format!(
            "WARNING: {misses} GETs found no value (the dataset should hold every key)"
        ));
    }
    let target_p99 = 0.05f64.max(noise_floor);
    let hf = fig(&base, |x| x.harvested_of_idle);
    let sd = fig(&base, |x| x.p99_slowdown);
    let tl = fig(&base, |x| x.tput_loss);
    let mut missed = Vec::new();
    // (NaN figures miss too.)
    if hf.is_nan() || hf < 0.5 {
        missed.push(format!("harvested_fraction_of_idle = {hf:.3} < 0.5"));
    }
    if sd.is_nan() || sd > target_p99 {
        missed.push(format!(
            "producer_p99_slowdown = {sd:.3} > max(0.05, noise floor {noise_floor:.3})"
        ));
    }
    if tl.is_nan() || tl > 0.02 {
        missed.push(format!(
            "producer_throughput_loss = {tl:.3} > 0.02 (the pair without the harvester on both sides \
             differed by {noise_tput:.3})"
        ));
    }
    if oom_kills > 0 {
        missed.push(format!("{oom_kills} OOM kills"));
    }
    if rec_pf.is_nan() || rec_no.is_nan() || rec_pf >= rec_no {
        missed.push(format!(
            "prefetch did not shorten recovery ({rec_pf:.1} s with, {rec_no:.1} s without)"
        ));
    }
    if !rec_pf_ok || !rec_no_ok {
        meta.note(format!(
            "a burst run did not recover within its {} s uniform phase: its recovery is reported as that length \
             (a lower bound)",
            p.burst_uniform.as_secs_f64()
        ));
    }
    if !missed.is_empty() {
        meta.note(format!("TARGET MISSED: {}", missed.join("; ")));
    }
    if let Some(r) = runs.iter().find(|r| !r.changes.is_empty()) {
        meta.note(format!(
            "what the harvester changed and undid (one run): {}",
            r.changes.join("; ")
        ));
    }

    let mut rep = Report::new("harvest", meta);
    rep.title("Benchmark: harvest — the harvester on a real redis-server under Zipfian load");
    rep.table(table);
    rep.extra_table("pairs", pair_table);
    rep.plot(plot);
    rep.extra_plot("p99_round0", p99_plot);
    rep.extra_plot("burst", burst_plot);
    rep.summary("harvested_fraction_of_idle", hf);
    rep.summary("producer_p99_slowdown", sd);
    rep.summary("noise_floor_p99", noise_floor);
    rep.summary("producer_throughput_loss", tl);
    rep.summary("producer_oom_kills", oom_kills as f64);
    rep.summary("burst_recovery_s_prefetch", rec_pf);
    rep.summary("burst_recovery_s_no_prefetch", rec_no);
    rep.summary("noise_floor_throughput", noise_tput);
    rep.summary(
        "psi_harvested_fraction_of_idle",
        fig(&psi, |x| x.harvested_of_idle),
    );
    rep.summary("psi_producer_p99_slowdown", fig(&psi, |x| x.p99_slowdown));
    rep.summary("psi_producer_throughput_loss", fig(&psi, |x| x.tput_loss));
    let out = rep.write(&opts.out)?;
    write_timeline(&out.join("timeline.csv"), runs)?;
    write_per_second(&out.join("per_second.csv"), runs)?;
    Ok(out)
}

/// Every run's requests and p99 per second of its load (`t_s` from the start of the
/// measured phase; negative: the warm-up), for looking at a run's course.
fn write_per_second(path: &Path, runs: &[RunOut]) -> anyhow::Result<()> {
    let mut t = String::from("round,run,t_s,phase,requests,p99_us\n");
    for r in runs {
        for (i, (n, p99)) in r.per_sec.iter().enumerate() {
            let at = i as f64;
            let phase = if at + 1.0 <= r.measure_from_s {
                "warm-up"
            } else if r.uniform_from_s.is_some_and(|u| at >= u) {
                "uniform"
            } else {
                "measured"
            };
            t += &format!(
                "{},\"{}\",{:.2},{phase},{n},{p99}\n",
                r.round,
                r.spec.label(),
                at - r.measure_from_s
            );
        }
    }
    std::fs::write(path, t).with_context(|| format!("writing {}", path.display()))
}

/// Every harvesting run's harvester status, once a second, to `path` (too long for the
/// Markdown report; `results.md` links it).
fn write_timeline(path: &Path, runs: &[RunOut]) -> anyhow::Result<()> {
    let mut t = String::from(
        "round,run,t_s,state,steps,recoveries,prefetches,limit_mib,usage_mib,harvested_mib,zswap_mib,\
         swapin_per_s,stall_per_s,p99_recent,p99_baseline\n",
    );
    for r in runs {
        for k in &r.timeline {
            let s = &k.status;
            let opt = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_default();
            t += &format!(
                "{},\"{}\",{:.2},{},{},{},{},{:.1},{:.1},{:.1},{:.1},{:.1},{:.5},{},{}\n",
                r.round,
                r.spec.label(),
                k.at_s - r.measure_from_s,
                s.state,
                s.steps,
                s.recoveries,
                s.prefetches,
                mib(s.limit_bytes.min(u64::MAX >> 1)),
                mib(s.usage_bytes),
                mib(s.harvested_bytes),
                mib(s.zswap_pool_bytes),
                s.swapin_per_s,
                s.stall_per_s,
                opt(s.p99_recent),
                opt(s.p99_baseline),
            );
        }
    }
    std::fs::write(path, t).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_have_their_size_and_differ_by_key() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        value_of(1, &mut a);
        value_of(2, &mut b);
        assert_eq!(a.len(), VALUE_BYTES);
        assert_eq!(b.len(), VALUE_BYTES);
        assert_ne!(a, b);
        assert!(a.iter().all(|c| (b' '..=b'~').contains(c)));
    }

    #[test]
    fn the_load_order_is_a_permutation() {
        let mut v = shuffled(1000);
        assert_ne!(v, (0..1000).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn recovery_waits_for_a_stretch_under_the_threshold() {
        // Seconds 0..10: the shift at 3.4 s; p99 under 100 from second 7 on, except a
        // spike at 8 that breaks the first stretch.
        let p = [
            50.0, 50.0, 50.0, 50.0, 900.0, 500.0, 300.0, 90.0, 200.0, 80.0, 70.0, 60.0, 60.0,
        ];
        let per_sec: Vec<(u64, f64)> = p.iter().map(|&v| (10, v)).collect();
        let r = recovery_s(&per_sec, 3.4, 100.0).unwrap();
        assert!((r - (9.0 - 3.4)).abs() < 1e-9, "{r}");
        // Never under: none.
        assert_eq!(recovery_s(&per_sec, 3.4, 10.0), None);
        // The partial last second does not count towards a stretch.
        let short: Vec<(u64, f64)> = [900.0, 50.0, 50.0, 50.0].iter().map(|&v| (10, v)).collect();
        assert_eq!(recovery_s(&short, 0.0, 100.0), None);
    }

    #[test]
    fn bulk_headers_are_parsed() {
        assert_eq!(bulk_len(b"$4000\r\n").unwrap(), Some(4000));
        assert_eq!(bulk_len(b"$-1\r\n").unwrap(), None);
        assert!(bulk_len(b"-ERR no\r\n").is_err());
        assert!(bulk_len(b"$x\r\n").is_err());
    }
}
