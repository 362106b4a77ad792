//! `granule-bench controller`: how many control messages per second ONE Granule
//! controller sustains.
//!
//! Measured, each as min/median/max over repetitions (5 × ~1 s; `--quick`: 1 × ~0.1 s),
//! interleaved so that slow drifts of this shared machine hit every measurement alike:
//!
//! * **location resolutions/s** — `Msg::Locate` of random proclets among a pre-populated
//!   location map (100k proclets; `--quick`: 20k), via [`ControllerClient::locate`];
//! * **location registrations/s** — [`ControllerClient::set_location`] of fresh proclet
//!   ids (taken from id blocks of 1024 the lanes allocate with `alloc_ids` as they go);
//! * **heartbeats/s** — [`ControllerClient::heartbeat`] of the client's own node;
//! * **node registrations/s** — a fresh TCP connection, the hello handshake and
//!   [`ControllerClient::register`], after which the connection is closed (so the
//!   controller also processes the node's departure: a join + leave cycle);
//! * **synchronous resolutions** — one connection, one `Locate` at a time: its rate and
//!   p50/p99 latency.
//!
//! Placement: the controller runs as embedded in a driver ([`ControllerHandle::start`]),
//! on its own thread with a current-thread tokio runtime. The load generator is a tokio
//! multi-thread runtime with exactly 1 worker thread created here; every request is
//! issued from tasks spawned on that worker (the calling thread only waits). Pipelined
//! load is [`CONNECTIONS`] client connections × [`DEPTH`] requests in flight each. Neither
//! thread is pinned: both float over the machine's 2 vCPUs, so messages cross cores and
//! pay the wake-up cost that EVALUATION.md measured (~50–100 µs per hop when a side
//! sleeps).
//!
//! The load clients register as proclet-hosting nodes (`Role::Node`, all with the same
//! fake binary hash, which the first registration fixes as the cluster's), since
//! `SetLocation`, `AllocIds` and `Heartbeat` are only accepted from registered hosts.
//! The controller's failure timeout is raised to 60 s so clients that do not heartbeat
//! stay alive during the run.

use crate::BenchOpts;
use anyhow::{bail, Context, Result};
use granule_controller::{ControllerClient, ControllerConfig, ControllerHandle};
use granule_report::{Cell, Latency, Meta, Plot, Report, Summary, Table};
use granule_transport::{Connection, Handler, Identity, Responder};
use granule_wire::{Frame, Kind, Location, NodeId, NodeSpec, ProcletId, RemoteError, Role, Usage};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Client connections of the pipelined load.
pub const CONNECTIONS: usize = 4;
/// Requests each pipelined connection keeps in flight.
pub const DEPTH: usize = 64;
/// Concurrent connect + hello + register loops in the node-registration measurement.
pub const REGISTER_LANES: usize = 8;
/// Proclet ids a set_location lane takes from the controller at once.
const ID_BLOCK: u32 = 1024;
/// The fake executable hash every load client presents (the first fixes the cluster's).
const BINARY: [u8; 32] = [7; 32];
const PROGRAM: &str = "granule-bench-controller";
/// The controller thread's name as the kernel shows it (`comm`: cut to 15 bytes).
const CONTROLLER_THREAD: &str = "granule-control";
const SPEC: NodeSpec = NodeSpec {
    cores: 1.0,
    mem_bytes: 1 << 30,
};

/// Sizes of a run.
#[derive(Clone, Copy, Debug)]
struct Params {
    reps: usize,
    window: Duration,
    warmup: Duration,
    prepopulate: usize,
}

impl Params {
    fn new(quick: bool) -> Params {
        if quick {
            Params {
                reps: 1,
                window: Duration::from_millis(100),
                warmup: Duration::from_millis(20),
                prepopulate: 20_000,
            }
        } else {
            Params {
                reps: 5,
                window: Duration::from_secs(1),
                warmup: Duration::from_millis(300),
                prepopulate: 100_000,
            }
        }
    }
}

/// One kind of measured request stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Locate,
    SetLocation,
    Heartbeat,
    RegisterNode,
    SyncLocate,
}

impl Op {
    const ALL: [Op; 5] = [
        Op::Locate,
        Op::SetLocation,
        Op::Heartbeat,
        Op::RegisterNode,
        Op::SyncLocate,
    ];

    fn label(self) -> &'static str {
        match self {
            Op::Locate => "location resolution (Locate)",
            Op::SetLocation => "location registration (SetLocation)",
            Op::Heartbeat => "heartbeat",
            Op::RegisterNode => "node registration (connect+hello+Register)",
            Op::SyncLocate => "location resolution, synchronous",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Op::Locate => "Locate",
            Op::SetLocation => "SetLocation",
            Op::Heartbeat => "Heartbeat",
            Op::RegisterNode => "node join",
            Op::SyncLocate => "Locate (sync)",
        }
    }

    /// (connections, in flight per connection).
    fn load(self) -> (usize, usize) {
        match self {
            Op::Locate | Op::SetLocation | Op::Heartbeat => (CONNECTIONS, DEPTH),
            Op::RegisterNode => (REGISTER_LANES, 1),
            Op::SyncLocate => (1, 1),
        }
    }

    fn mode(self) -> &'static str {
        match self {
            Op::Locate | Op::SetLocation | Op::Heartbeat => "pipelined",
            Op::RegisterNode => "concurrent, new connection each",
            Op::SyncLocate => "synchronous",
        }
    }
}

/// A tiny handler for the load clients: they serve no requests, and ignore what the
/// controller sends unprompted (node-down notices).
struct Reject;

impl Handler for Reject {
    fn on_request(&self, _conn: &Arc<Connection>, _frame: Frame, reply: Responder) {
        reply.error(RemoteError::Refused(
            "a benchmark load client serves no requests".into(),
        ));
    }
}

/// A registered load client.
struct Client {
    ctl: ControllerClient,
    node: NodeId,
    addr: String,
}

/// What one lane (one sequence of back-to-back requests) did.
struct LaneResult {
    ops: u64,
    lat: Latency,
}

/// One timed window of one measurement.
struct Sample {
    ops: u64,
    secs: f64,
    lat: Latency,
    /// CPU time the controller thread and the load thread used in the window, if known.
    controller_cpu: Option<Duration>,
    load_cpu: Option<Duration>,
}

/// CPU time thread `tid` of this process has used so far (its schedstat: nanoseconds on
/// a CPU).
fn thread_cpu(tid: i32) -> Option<Duration> {
    granule_host::proc::thread_schedstat(tid).map(|s| Duration::from_nanos(s.cpu_ns))
}

/// The ids of this process's threads whose name (`comm`) is `comm`.
fn threads_named(comm: &str) -> Vec<i32> {
    granule_host::proc::thread_ids()
        .into_iter()
        .filter(|&tid| granule_host::proc::thread_name(tid).is_some_and(|n| n == comm))
        .collect()
}

/// The calling thread's id.
fn this_thread() -> Option<i32> {
    Some(granule_host::proc::current_tid())
}

fn cpu_delta(tid: &Option<i32>, before: Option<Duration>) -> Option<Duration> {
    let now = thread_cpu((*tid)?)?;
    Some(now.saturating_sub(before?))
}

/// xorshift64*: enough randomness to pick proclets, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        // Multiply-shift keeps the bias negligible for n far below 2^32.
        (((r >> 32) * n as u64) >> 32) as usize
    }
}

fn identity() -> Arc<Identity> {
    Arc::new(Identity {
        role: Role::Node,
        node: None,
        binary: Some(BINARY),
        program: PROGRAM.into(),
    })
}

/// Connect, hello and register as a node; returns the client and its node id.
async fn join(addr: &str, fake_addr: String) -> Result<(ControllerClient, NodeId)> {
    let ctl = ControllerClient::connect(addr, identity(), Arc::new(Reject))
        .await
        .with_context(|| format!("cannot connect a load client to the controller at {addr}"))?;
    let reg = ctl
        .register(
            Role::Node,
            SPEC,
            fake_addr,
            BINARY,
            PROGRAM.to_string(),
            None,
            None,
        )
        .await
        .context("the controller refused a load client's registration")?;
    Ok((ctl, reg.node))
}

/// Back-to-back requests of `op` on one client until `deadline`.
async fn lane(
    op: Op,
    client: Arc<Client>,
    ids: Arc<Vec<ProcletId>>,
    seed: u64,
    deadline: Instant,
) -> Result<LaneResult> {
    let mut rng = Rng::new(seed);
    let mut lat = Latency::new();
    let mut ops = 0u64;
    let mut fresh = 0u64..0u64;
    while Instant::now() < deadline {
        match op {
            Op::Locate | Op::SyncLocate => {
                let id = ids[rng.below(ids.len())];
                let t = Instant::now();
                let found = client
                    .ctl
                    .locate(id)
                    .await
                    .with_context(|| format!("Locate {id} failed"))?;
                lat.record(t.elapsed());
                match found {
                    Some((_, true)) => {}
                    Some((loc, false)) => {
                        bail!("the controller says {id}'s node {} is dead", loc.node)
                    }
                    None => bail!("the controller lost the location of {id}"),
                }
            }
            Op::SetLocation => {
                let id = match fresh.next() {
                    Some(id) => id,
                    None => {
                        fresh = client
                            .ctl
                            .alloc_ids(ID_BLOCK)
                            .await
                            .context("AllocIds failed")?;
                        match fresh.next() {
                            Some(id) => id,
                            None => bail!("the controller handed out an empty id block"),
                        }
                    }
                };
                let loc = Location {
                    node: client.node,
                    addr: client.addr.clone(),
                    epoch: 1,
                };
                let t = Instant::now();
                client
                    .ctl
                    .set_location(ProcletId(id), loc, Kind::Memory)
                    .await
                    .with_context(|| format!("SetLocation p{id} failed"))?;
                lat.record(t.elapsed());
            }
            Op::Heartbeat => {
                let t = Instant::now();
                client
                    .ctl
                    .heartbeat(client.node, Usage::default(), Vec::new())
                    .await
                    .context("Heartbeat failed")?;
                lat.record(t.elapsed());
            }
            Op::RegisterNode => bail!("node registrations run in register_lane"),
        }
        ops += 1;
    }
    Ok(LaneResult { ops, lat })
}

/// Node joins until `deadline`: connect + hello + register, then close the connection.
async fn register_lane(addr: String, lane: usize, deadline: Instant) -> Result<LaneResult> {
    let mut lat = Latency::new();
    let mut ops = 0u64;
    while Instant::now() < deadline {
        let t = Instant::now();
        let (ctl, _node) = join(&addr, format!("127.0.0.1:{}", 20_000 + lane)).await?;
        lat.record(t.elapsed());
        ops += 1;
        // Leave again, or sockets and file descriptors pile up. The controller declares
        // the node dead and tells the live nodes: that work is part of this measurement.
        ctl.connection()
            .close("benchmark: node leaves after registering");
    }
    Ok(LaneResult { ops, lat })
}

/// Everything the load generator holds.
struct Load {
    addr: String,
    clients: Vec<Arc<Client>>,
    sync_client: Arc<Client>,
    ids: Arc<Vec<ProcletId>>,
    seed: u64,
    /// Thread ids (in this process) of the controller's thread and of this load thread.
    controller_thread: Option<i32>,
    load_thread: Option<i32>,
}

impl Load {
    async fn setup(
        addr: String,
        prepopulate: usize,
        controller_thread: Option<i32>,
    ) -> Result<Load> {
        let mut clients = Vec::new();
        for i in 0..=CONNECTIONS {
            let fake_addr = format!("127.0.0.1:{}", 10_000 + i);
            let (ctl, node) = join(&addr, fake_addr.clone()).await?;
            clients.push(Arc::new(Client {
                ctl,
                node,
                addr: fake_addr,
            }));
        }
        let sync_client = clients.pop().context("no load clients")?;
        // Proclet ids from the controller, as a node would get them.
        let mut ids = Vec::with_capacity(prepopulate);
        while ids.len() < prepopulate {
            let want = u32::try_from(prepopulate - ids.len()).unwrap_or(u32::MAX);
            let block = clients[0]
                .ctl
                .alloc_ids(want)
                .await
                .context("AllocIds failed")?;
            if block.is_empty() {
                bail!("the controller handed out an empty id block");
            }
            ids.extend(block.map(ProcletId));
        }
        ids.truncate(prepopulate);
        // Register their locations, spread over the load clients' nodes, pipelined.
        let lanes = CONNECTIONS * DEPTH;
        let chunk = prepopulate.div_ceil(lanes).max(1);
        let mut tasks = Vec::new();
        for (i, part) in ids.chunks(chunk).enumerate() {
            let client = clients[i % clients.len()].clone();
            let part = part.to_vec();
            tasks.push(tokio::spawn(async move {
                for id in part {
                    let loc = Location {
                        node: client.node,
                        addr: client.addr.clone(),
                        epoch: 1,
                    };
                    client
                        .ctl
                        .set_location(id, loc, Kind::Memory)
                        .await
                        .with_context(|| format!("pre-populating: SetLocation {id} failed"))?;
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await.context("a pre-population task panicked")??;
        }
        Ok(Load {
            addr,
            clients,
            sync_client,
            ids: Arc::new(ids),
            seed: 1,
            controller_thread,
            load_thread: this_thread(),
        })
    }

    /// One timed window of `op`.
    async fn measure(&mut self, op: Op, window: Duration) -> Result<Sample> {
        let ctl0 = self.controller_thread.and_then(thread_cpu);
        let load0 = self.load_thread.and_then(thread_cpu);
        let start = Instant::now();
        let deadline = start + window;
        let mut tasks = Vec::new();
        match op {
            Op::RegisterNode => {
                for lane in 0..REGISTER_LANES {
                    tasks.push(tokio::spawn(register_lane(
                        self.addr.clone(),
                        lane,
                        deadline,
                    )));
                }
            }
            Op::SyncLocate => {
                self.seed += 1;
                tasks.push(tokio::spawn(lane(
                    op,
                    self.sync_client.clone(),
                    self.ids.clone(),
                    self.seed,
                    deadline,
                )));
            }
            Op::Locate | Op::SetLocation | Op::Heartbeat => {
                for client in &self.clients {
                    for _ in 0..DEPTH {
                        self.seed += 1;
                        tasks.push(tokio::spawn(lane(
                            op,
                            client.clone(),
                            self.ids.clone(),
                            self.seed,
                            deadline,
                        )));
                    }
                }
            }
        }
        let mut ops = 0u64;
        let mut lat = Latency::new();
        for t in tasks {
            let r = t
                .await
                .with_context(|| format!("a {} lane panicked", op.short()))??;
            ops += r.ops;
            lat.merge(&r.lat);
        }
        // Requests still in flight at the deadline complete after it: count their time.
        let secs = start.elapsed().as_secs_f64();
        Ok(Sample {
            ops,
            secs,
            lat,
            controller_cpu: cpu_delta(&self.controller_thread, ctl0),
            load_cpu: cpu_delta(&self.load_thread, load0),
        })
    }
}

/// Per measurement: the rate of every repetition and the latencies of all of them.
struct Measured {
    op: Op,
    rates: Vec<f64>,
    lat: Latency,
    ops: u64,
    secs: f64,
    /// Summed over the repetitions; `None` if a thread's CPU time could not be read.
    controller_cpu: Option<Duration>,
    load_cpu: Option<Duration>,
}

impl Measured {
    /// Share of the measured time the controller's thread was on a CPU.
    fn controller_busy(&self) -> f64 {
        self.controller_cpu
            .map_or(f64::NAN, |c| c.as_secs_f64() / self.secs)
    }

    fn load_busy(&self) -> f64 {
        self.load_cpu
            .map_or(f64::NAN, |c| c.as_secs_f64() / self.secs)
    }

    /// Requests per second of controller CPU time: what the controller could answer
    /// with one core to itself, if nothing else limited it.
    fn per_controller_cpu_s(&self) -> f64 {
        self.controller_cpu
            .map_or(f64::NAN, |c| self.ops as f64 / c.as_secs_f64())
    }
}

/// Runs on the load runtime's worker thread.
async fn drive(addr: String, p: Params, controller_thread: Option<i32>) -> Result<Vec<Measured>> {
    let mut load = Load::setup(addr, p.prepopulate, controller_thread).await?;
    for op in Op::ALL {
        load.measure(op, p.warmup).await?;
    }
    let mut out: Vec<Measured> = Op::ALL
        .iter()
        .map(|&op| Measured {
            op,
            rates: Vec::new(),
            lat: Latency::new(),
            ops: 0,
            secs: 0.0,
            controller_cpu: Some(Duration::ZERO),
            load_cpu: Some(Duration::ZERO),
        })
        .collect();
    for _ in 0..p.reps {
        for m in out.iter_mut() {
            let s = load.measure(m.op, p.window).await?;
            m.rates.push(s.ops as f64 / s.secs);
            m.lat.merge(&s.lat);
            m.ops += s.ops;
            m.secs += s.secs;
            m.controller_cpu = m.controller_cpu.zip(s.controller_cpu).map(|(a, b)| a + b);
            m.load_cpu = m.load_cpu.zip(s.load_cpu).map(|(a, b)| a + b);
        }
    }
    Ok(out)
}

/// A number cell, or an empty one for an unknown (NaN) value.
fn num_or_blank(v: f64) -> Cell {
    if v.is_finite() {
        Cell::from(v)
    } else {
        Cell::empty()
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn placement() -> String {
    format!(
        "controller: 1 thread (current-thread runtime); load generator: 1 tokio worker \
         thread, {CONNECTIONS} connections × {DEPTH} in flight (node joins: \
         {REGISTER_LANES} concurrent, synchronous: 1 × 1); both unpinned on the 2 vCPUs"
    )
}

/// Run the benchmark and write its report to `opts.out/controller/`.
pub fn run(opts: &BenchOpts) -> Result<PathBuf> {
    let p = Params::new(opts.quick);
    let meta = Meta::collect(placement(), opts.quick);
    let config = ControllerConfig {
        failure_timeout: Duration::from_secs(60),
        ..ControllerConfig::default()
    };
    // The controller's thread is the one named like it that appears with it.
    let progress = granule_report::Progress::new(3, "controller");
    let before = threads_named(CONTROLLER_THREAD);
    let mut controller =
        ControllerHandle::start("127.0.0.1:0", config).context("cannot start the controller")?;
    // A new thread names itself once it runs: give it a moment.
    let mut controller_thread = None;
    for _ in 0..100 {
        let new: Vec<i32> = threads_named(CONTROLLER_THREAD)
            .into_iter()
            .filter(|t| !before.contains(t))
            .collect();
        if new.len() == 1 {
            controller_thread = new.into_iter().next();
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // The node-join measurement makes thousands of nodes leave on purpose: have the
    // controller log those departures at debug level instead of as failures. (This only
    // changes the log level.)
    controller.quiesce();
    let addr = controller.addr().to_string();
    progress.step("controller started; measuring resolutions and registrations");
    let measured = (|| -> Result<Vec<Measured>> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("granule-bench-load")
            .enable_all()
            .build()
            .context("cannot start the load generator's runtime")?;
        // Spawned, so the requests run on the one worker, not on this thread.
        let r = rt.block_on(async move { tokio::spawn(drive(addr, p, controller_thread)).await });
        // Closes the load clients' connections.
        drop(rt);
        r.context("the load generator panicked")?
    })();
    let located = controller.proclet_count();
    // On every path, errors included: stop the controller thread.
    controller.shutdown();
    let measured = measured?;
    progress.step("measured; writing the report");
    let dir = report(opts, p, meta, &measured, located);
    progress.step("done");
    progress.finish();
    dir
}

fn report(
    opts: &BenchOpts,
    p: Params,
    meta: Meta,
    measured: &[Measured],
    located: usize,
) -> Result<PathBuf> {
    let mut table = Table::new(&[
        "measurement",
        "mode",
        "connections",
        "in_flight_per_connection",
        "repetitions",
        "min_per_s",
        "median_per_s",
        "max_per_s",
        "p50_us",
        "p99_us",
        "controller_cpu_busy",
        "load_thread_cpu_busy",
        "per_controller_cpu_s",
    ]);
    let mut rep = Report::new("controller", meta);
    rep.title("Benchmark: controller — control messages per second one controller sustains");
    let mut medians = Vec::new();
    let mut per_cpu = Vec::new();
    for m in measured {
        let s = Summary::of(&m.rates)
            .with_context(|| format!("no repetition of {} was measured", m.op.short()))?;
        let (conns, depth) = m.op.load();
        table.row(vec![
            Cell::from(m.op.label()),
            Cell::from(m.op.mode()),
            Cell::from(conns as f64),
            Cell::from(depth as f64),
            Cell::from(s.n as f64),
            Cell::from(s.min.round()),
            Cell::from(s.median.round()),
            Cell::from(s.max.round()),
            Cell::from((us(m.lat.p(0.5)) * 10.0).round() / 10.0),
            Cell::from((us(m.lat.p(0.99)) * 10.0).round() / 10.0),
            num_or_blank((m.controller_busy() * 100.0).round() / 100.0),
            num_or_blank((m.load_busy() * 100.0).round() / 100.0),
            num_or_blank(m.per_controller_cpu_s().round()),
        ]);
        medians.push(s.median.round());
        per_cpu.push(m.per_controller_cpu_s().round());
        eprintln!(
            "controller: {:<45} median {:>7.0}/s (min {:.0}, max {:.0}; {} reps), \
             p50 {:.1} µs, p99 {:.1} µs; controller thread {:.0}% busy, load thread {:.0}%",
            m.op.label(),
            s.median,
            s.min,
            s.max,
            s.n,
            us(m.lat.p(0.5)),
            us(m.lat.p(0.99)),
            m.controller_busy() * 100.0,
            m.load_busy() * 100.0,
        );
        match m.op {
            Op::Locate => {
                rep.summary("resolutions_per_s", s.median)
                    .summary("resolutions_per_s_min", s.min)
                    .summary("resolutions_per_s_max", s.max)
                    .summary("pipelined_locate_p50_us", us(m.lat.p(0.5)))
                    .summary("pipelined_locate_p99_us", us(m.lat.p(0.99)))
                    .summary("locate_controller_cpu_busy", m.controller_busy())
                    .summary("resolutions_per_controller_cpu_s", m.per_controller_cpu_s());
            }
            Op::SetLocation => {
                rep.summary("location_registrations_per_s", s.median);
            }
            Op::Heartbeat => {
                rep.summary("heartbeats_per_s", s.median);
            }
            Op::RegisterNode => {
                rep.summary("node_registrations_per_s", s.median)
                    .summary("node_registration_p50_us", us(m.lat.p(0.5)));
            }
            Op::SyncLocate => {
                rep.summary("sync_locates_per_s", s.median)
                    .summary("sync_locate_p50_us", us(m.lat.p(0.5)))
                    .summary("sync_locate_p99_us", us(m.lat.p(0.99)));
            }
        }
    }
    rep.summary("prepopulated_locations", p.prepopulate as f64)
        .summary("locations_at_end", located as f64)
        .summary("repetitions", p.reps as f64)
        .summary("window_s", p.window.as_secs_f64());
    let plot = Plot::bars(format!(
        "one controller: requests/s (median of {} × {:.1} s)",
        p.reps,
        p.window.as_secs_f64()
    ))
    .y_label("requests/s")
    .log_y(true)
    .categories(measured.iter().map(|m| m.op.short()))
    .bar_series("median requests/s", medians)
    .bar_series("requests per second of controller CPU", per_cpu);
    rep.table(table).plot(plot);
    rep.note(format!(
        "Each repetition runs every measurement for {:.1} s, in turn (after one {:.1} s \
         warm-up of each); min/median/max are over {} repetition(s). Rates count requests \
         answered, divided by the time until the last in-flight one returned. Latencies \
         (p50/p99) are from every request of every repetition, measured at the client.",
        p.window.as_secs_f64(),
        p.warmup.as_secs_f64(),
        p.reps
    ))
    .note(format!(
        "Resolutions look up random proclets among {} pre-populated locations (ids from \
         AllocIds, registered with SetLocation, spread over {CONNECTIONS} nodes). \
         Location registrations use fresh ids, which the lanes allocate in blocks of \
         {ID_BLOCK} with AllocIds (those AllocIds requests are not counted).",
        p.prepopulate
    ))
    .note(
        "CPU columns: the share of the measured time the controller's thread and the load \
         generator's thread were on a CPU (from /proc/self/task/TID/schedstat; blank if \
         unreadable), and requests answered per second of controller CPU time, i.e. what \
         the controller could answer with a core to itself. The load generator runs the \
         same transport code as the controller and shares the 2 vCPUs with it, so the \
         rates above are a lower bound of the controller's capacity whenever its thread \
         is less than fully busy.",
    )
    .note(
        "Node registration = TCP connect + hello handshake + Register from a new connection, \
         which then closes: the controller also declares the node gone and tells the live \
         nodes, so this is a join + leave cycle. The controller was quiesced, so those \
         departures are logged at debug level instead of as failures.",
    )
    .note(
        "Normal proclet calls do not touch the controller: nodes cache proclet locations \
         and ask the controller only when a cached location turns out stale (after a \
         migration), plus one heartbeat per node per interval (100 ms by default). The load \
         a cluster puts on the controller is therefore tiny compared with this capacity.",
    )
    .note(
        "No baseline is measured in the same run (EVALUATION.md lists none for this \
         benchmark): compare these rates with the controller load observed in the \
         end-to-end runs.",
    );
    let dir = rep
        .write(&opts.out)
        .with_context(|| format!("cannot write the report under {}", opts.out.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn number_after(json: &str, key: &str) -> Option<f64> {
        let at = json.find(&format!("\"{key}\":"))? + key.len() + 3;
        let rest = json[at..].trim_start();
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    }

    #[test]
    fn rng_stays_in_range() {
        let mut r = Rng::new(3);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let x = r.below(10);
            assert!(x < 10);
            seen[x] = true;
        }
        assert!(seen.iter().all(|s| *s), "{seen:?}");
    }

    #[test]
    fn controller_quick_run_writes_the_report() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let out = std::env::temp_dir().join(format!(
            "granule-bench-controller-{}-{nanos}",
            std::process::id()
        ));
        let opts = BenchOpts {
            quick: true,
            out: out.clone(),
            ..BenchOpts::default()
        };
        let t = Instant::now();
        let dir = run(&opts).expect("the quick controller benchmark runs");
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
        assert_eq!(dir, out.join("controller"));
        for f in ["results.csv", "results.md", "plot.png", "summary.json"] {
            assert!(dir.join(f).is_file(), "{f} is missing in {}", dir.display());
        }
        let json = std::fs::read_to_string(dir.join("summary.json")).expect("summary.json");
        let r = number_after(&json, "resolutions_per_s").expect("resolutions_per_s");
        assert!(r > 0.0, "{json}");
        for key in [
            "location_registrations_per_s",
            "node_registrations_per_s",
            "sync_locate_p50_us",
        ] {
            let v = number_after(&json, key).unwrap_or(0.0);
            assert!(v > 0.0, "{key} missing or zero in {json}");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}
