//! `granule-bench pressure`: a key-value workload under constant open-loop load while a
//! memory antagonist grows inside one node's memory cgroup, and that node sheds its shards
//! to the other nodes (EVALUATION.md, experiment 3). The same run is then repeated with
//! migration throttled to 600 MB/s after a 200 ms delay per move (a slow-live-migration
//! baseline, `migration.throttle` / `migration.delay` on its cluster's builder).
//!
//! - **Cluster**: three node processes `cpu=1,mem=768MiB` (quick: `mem=512MiB`) next to
//!   the driver (`cpu=1,mem=1GiB`, which hosts no shard: the controller only places on the
//!   driver when no other node is alive). Two vCPUs stand for the rack: the victim node and
//!   the antagonist share vCPU 1 (the victim's machine); the driver — the measuring
//!   instrument, a stand-in for the clients — and the other two nodes share vCPU 0. With
//!   cgroups, each node process runs in its own memory cgroup whose limit is its spec's
//!   memory; without, nodes account against their budget, the antagonist cannot join them
//!   and its phase is skipped (the report says so).
//! - **Data**: 48 memory proclets (quick: 8), each a `HashMap` of 1 KiB values of ~3.5 MiB
//!   (quick: 2 MiB), accounted exactly through [`Footprint`], values encoded as byte
//!   strings (`serde_bytes::ByteBuf`). Keys are hashed to shards; the controller places the
//!   shards (they spread over the nodes).
//! - **Load**: open loop, 2000 requests/s (quick: 500), 90 % GET / 10 % SET, keys uniform.
//!   Request *i* is due at `t0 + i / rate`; a generator thread sleeps until then and hands
//!   the call (`run_ref_async` / `run_async`) to a one-worker tokio runtime, so any number
//!   of requests is in flight. Both threads run in the real-time FIFO class when allowed
//!   (root): on this VM a kernel daemon (DAMON's `kdamond`) or another process can take
//!   the driver's vCPU for ~1 ms at a time, and a late generator is the client's fault,
//!   not the system's (measured: steady p99 ~290 µs without, ~170 µs with; every other
//!   thread, the system's included, stays at normal priority). Latency runs from the
//!   *intended* start to completion
//!   (coordinated-omission-safe: a stall delays every request due during it). SETs write a
//!   value derived from (key, version); GETs check that the value is exactly one that was
//!   written for that key (mismatches are counted and must be 0). Every request ends as
//!   completed, error (lost) or never completed (lost).
//! - **Timeline**: 250 ms windows by intended start time (HDR histograms: p50, p99), the
//!   victim's memory (its cgroup's usage when reported, else its resident memory), the
//!   cumulative moves out of the victim and the shards per node, from `Cluster::nodes`
//!   sampled every 50 ms by a separate thread (nodes heartbeat every 100 ms).
//! - **Antagonist**: after the warm-up and the steady phase, `granule antagonist memory`
//!   (this executable) joins the memory cgroup of the node hosting the most shards and
//!   allocates at 1 GiB/s up to the node's limit + 256 MiB (quick: + 64 MiB): more than the
//!   cgroup holds on its own, so the kernel OOM-kills it in the end (it makes itself the
//!   preferred victim). The node must shed its shards before that without dying. The rate
//!   it reaches is reported from its own progress lines (1.03 GiB/s in the runs here,
//!   faulting 4 KiB pages; see `granule_host::antagonist::allocate_paced` for why not
//!   huge pages). On this VM first touches of memory the balloon handed back exit to the
//!   hypervisor, which freezes the vCPU the antagonist runs on meanwhile.
//! - **Figures**: steady p99 over the steady phase; disruption p99 over [antagonist
//!   start, max(antagonist exit, last move out of the victim) + 1 s]; their ratio (target
//!   ≤ 3); node processes that died (`node_oom_kills`, target 0); lost calls (target 0).
//!   Tail latency on this machine is noisy from run to run, so the pair of runs is repeated
//!   (5 times; quick: once): the ratios in the summary are medians (with min and max), the
//!   counters add up all repetitions, and the timeline shows the median repetition. The
//!   notes split the disruption's slow requests (over 3× the steady p99) into those to
//!   shards that started on the victim and the others.
//! - **Investigating a tail**: `granule-bench pressure --reps N` changes the number of
//!   repetitions and `--dump DIR` writes every request (intended start in
//!   `CLOCK_MONOTONIC` seconds, latency, generator lag, shard) to a CSV per run, and the
//!   cluster's move events (end time, bytes, how long each proclet was unavailable) to a
//!   second CSV, to line up with each other and with
//!   `perf record -k CLOCK_MONOTONIC -e sched:sched_switch -a`. That is how the
//!   remaining slow requests were attributed: the victim's shards while the antagonist
//!   shares their vCPU, and stalls of the idle vCPU 0 of several ms (no guest event there
//!   at all, then every due timer firing at once) while vCPU 1 runs the antagonist, whose
//!   first touches exit to the hypervisor.

use crate::BenchOpts;
use anyhow::{anyhow, bail, Context};
use granule::{Cluster, Footprint, Kind, NodeId, NodeInfo, NodeSpec, NodeState, Proclet};
use granule_report::{Cell, Latency, Meta, Plot, Report, Summary, Table};
use granule_wire::Role;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Width of a timeline window.
const WINDOW: Duration = Duration::from_millis(250);
/// How often the sampler asks the controller for the nodes' usage.
const SAMPLE_EVERY: Duration = Duration::from_millis(50);
/// Bytes per value.
const VALUE_LEN: usize = 1024;
/// Share of GETs, percent.
const GET_PERCENT: u64 = 90;
/// Bytes a map entry holds besides its value (key, vector header, control byte, and the
/// hash table's spare slots at its usual load).
const ENTRY_OVERHEAD: u64 = 40;
/// Judged target: disruption p99 at most this many times the steady p99.
const TARGET_RATIO: f64 = 3.0;
/// The slow-migration baseline.
const BASELINE_THROTTLE: &str = "600MB/s";
const BASELINE_DELAY: &str = "200ms";
/// The disruption window extends this long past the later of the antagonist's exit and
/// the last move out of the victim.
const DISRUPTION_TAIL: Duration = Duration::from_secs(1);

/// Sizes and durations of one configuration (full or quick).
#[derive(Clone, Debug)]
struct Params {
    /// Where `--dump` writes each run's requests and events.
    dump: Option<PathBuf>,
    node_cores: f64,
    node_mem: u64,
    nodes: usize,
    shards: u32,
    shard_bytes: u64,
    rate: f64,
    warmup: Duration,
    steady: Duration,
    after: Duration,
    antagonist_rate: &'static str,
    antagonist_extra: u64,
    hold: Duration,
    drain: Duration,
    /// Repetitions of the pair of runs; the headline ratios are their medians.
    reps: usize,
}

impl Params {
    fn new(quick: bool) -> Params {
        if quick {
            Params {
                dump: None,
                node_cores: 1.0,
                node_mem: 512 << 20,
                nodes: 3,
                shards: 8,
                shard_bytes: 2 << 20,
                rate: 500.0,
                warmup: Duration::from_millis(250),
                steady: Duration::from_secs(1),
                after: Duration::from_millis(1500),
                antagonist_rate: "1GiB/s",
                antagonist_extra: 64 << 20,
                hold: Duration::from_secs(1),
                drain: Duration::from_secs(3),
                reps: 1,
            }
        } else {
            Params {
                dump: None,
                node_cores: 1.0,
                node_mem: 768 << 20,
                nodes: 3,
                shards: 48,
                shard_bytes: 7 << 19,
                rate: 2000.0,
                warmup: Duration::from_millis(500),
                steady: Duration::from_secs(3),
                after: Duration::from_secs(3),
                antagonist_rate: "1GiB/s",
                antagonist_extra: 256 << 20,
                hold: Duration::from_secs(3),
                drain: Duration::from_secs(3),
                reps: 5,
            }
        }
    }

    fn node_spec(&self) -> String {
        format!("cpu={},mem={}MiB", self.node_cores, self.node_mem >> 20)
    }

    fn nodes_spec(&self) -> String {
        vec![self.node_spec(); self.nodes].join(";")
    }

    fn keys_per_shard(&self) -> u64 {
        self.shard_bytes / (VALUE_LEN as u64 + ENTRY_OVERHEAD)
    }

    fn keys(&self) -> u64 {
        self.keys_per_shard() * u64::from(self.shards)
    }
}

// ----- the data ---------------------------------------------------------------------

/// One shard of the store. Values are `serde_bytes::ByteBuf`s, encoded as one byte
/// string each: serde's default for a `Vec<u8>` is a sequence of separate `u8`s, which
/// makes every move of a shard 2–3 times slower to encode and decode.
#[derive(Serialize, Deserialize)]
struct Shard {
    index: u32,
    map: HashMap<u64, ByteBuf>,
}

impl Footprint for Shard {
    /// The table (a slot and a control byte per bucket, as `HashMap` lays it out) plus
    /// every value's buffer.
    fn footprint(&self) -> u64 {
        let table = self.map.capacity() * (std::mem::size_of::<(u64, ByteBuf)>() + 1);
        let values: usize = self.map.values().map(|v| v.capacity()).sum();
        (std::mem::size_of::<Shard>() + table + values) as u64
    }
}

/// What a shard's constructor needs: which keys are its own, and how many to expect.
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
struct ShardSpec {
    index: u32,
    shards: u32,
    keys: u64,
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The shard a key belongs to.
fn shard_of(key: u64, shards: u32) -> u32 {
    let mut x = key ^ 0x5851_F42D_4C95_7F2D;
    (splitmix(&mut x) % u64::from(shards)) as u32
}

/// The value written for `key` at `version` (version 0 is the initial load): the key and
/// version, then bytes of a stream seeded by both. Exactly `VALUE_LEN` bytes of capacity.
fn value(key: u64, version: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(VALUE_LEN);
    v.extend_from_slice(&key.to_le_bytes());
    v.extend_from_slice(&version.to_le_bytes());
    let mut x = key.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ (u64::from(version) << 40);
    while v.len() < VALUE_LEN {
        let w = splitmix(&mut x).to_le_bytes();
        let take = (VALUE_LEN - v.len()).min(8);
        v.extend_from_slice(&w[..take]);
    }
    v
}

/// Whether `got` is a value written for `key` at some version up to `max_version`.
fn check(key: u64, got: Option<&[u8]>, max_version: u32) -> bool {
    let Some(got) = got else {
        return false;
    };
    if got.len() != VALUE_LEN {
        return false;
    }
    let mut k = [0u8; 8];
    k.copy_from_slice(&got[..8]);
    let mut ver = [0u8; 4];
    ver.copy_from_slice(&got[8..12]);
    let version = u32::from_le_bytes(ver);
    u64::from_le_bytes(k) == key && version <= max_version && got == value(key, version).as_slice()
}

fn build_shard(s: ShardSpec) -> Shard {
    let expect = s.keys / u64::from(s.shards.max(1));
    let mut map = HashMap::with_capacity((expect + expect / 20) as usize);
    for k in 0..s.keys {
        if shard_of(k, s.shards) == s.index {
            map.insert(k, ByteBuf::from(value(k, 0)));
        }
    }
    Shard {
        index: s.index,
        map,
    }
}

fn get(s: &Shard, key: u64) -> Option<Vec<u8>> {
    s.map.get(&key).map(|v| v.to_vec())
}

fn set(s: &mut Shard, kv: (u64, Vec<u8>)) -> bool {
    s.map.insert(kv.0, ByteBuf::from(kv.1)).is_some()
}

fn describe(s: &Shard, _: ()) -> (u32, u64, u64) {
    (s.index, s.footprint(), s.map.len() as u64)
}

// ----- the load ---------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Mismatch,
    Error,
}

/// Pause between the two runs (see `run`).
const SETTLE: Duration = Duration::from_secs(4);

/// One finished request.
#[derive(Clone, Copy, Debug)]
struct Rec {
    /// Intended start, ns after `t0`.
    at_ns: u64,
    /// From the intended start to completion.
    lat_ns: u64,
    /// How late the generator handed the request over (part of `lat_ns`).
    lag_ns: u64,
    /// Which shard, and whether a read.
    tag: (u32, bool),
    outcome: Outcome,
}

/// What the requests share with the generator and the runtime.
struct Shared {
    shards: Vec<Proclet<Shard>>,
    nshards: u32,
    keys: u64,
    /// Highest version issued per key.
    versions: Vec<AtomicU32>,
    recs: Mutex<Vec<Rec>>,
    errors: Mutex<Vec<String>>,
    error_count: AtomicU64,
}

impl Shared {
    fn finish(&self, at_ns: u64, lag_ns: u64, tag: (u32, bool), lat: Duration, outcome: Outcome) {
        let rec = Rec {
            at_ns,
            tag,
            lat_ns: u64::try_from(lat.as_nanos()).unwrap_or(u64::MAX),
            lag_ns,
            outcome,
        };
        if let Ok(mut r) = self.recs.lock() {
            r.push(rec);
        }
    }

    fn error(&self, at_ns: u64, e: granule::CallError) {
        self.error_count.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut v) = self.errors.lock() {
            if v.len() < 20 {
                v.push(format!("t={:.3}s: {e}", at_ns as f64 / 1e9));
            }
        }
    }

    fn completed(&self) -> usize {
        self.recs.lock().map(|r| r.len()).unwrap_or(0)
    }
}

/// What the generator did.
#[derive(Debug)]
struct GenStats {
    issued: u64,
    /// Wall time from `t0` to the last request issued.
    wall: Duration,
    /// How late requests were handed over, against their intended start.
    lag: Latency,
}

/// Set when the load generator could not enter SCHED_FIFO (the report says so).
static FIFO_REFUSED: AtomicBool = AtomicBool::new(false);

/// Put the calling thread (the load generator or the runtime that completes its requests)
/// in the real-time FIFO class when allowed (root), so that a kernel daemon or another
/// process on the driver's vCPU never makes the generator late: its lateness is counted in
/// every request's latency (coordinated-omission-safe), and it is the client's, not the
/// system's. The threads sleep between requests (a few % of a core at 2000 req/s), so
/// they cannot starve anything; the kernel's RT throttling bounds them besides. Without
/// the privilege the run goes on at normal priority, and says so once.
fn raise_priority(what: &str) {
    use thread_priority::{
        set_thread_priority_and_policy, thread_native_id, RealtimeThreadSchedulePolicy,
        ThreadPriority, ThreadPriorityValue, ThreadSchedulePolicy,
    };

    let prio = ThreadPriorityValue::try_from(10u8).map(ThreadPriority::Crossplatform);
    let r = prio.map_err(|e| e.to_string()).and_then(|p| {
        set_thread_priority_and_policy(
            thread_native_id(),
            p,
            ThreadSchedulePolicy::Realtime(RealtimeThreadSchedulePolicy::Fifo),
        )
        .map_err(|e| format!("{e:?}"))
    });
    if let Err(e) = r {
        if !FIFO_REFUSED.swap(true, Ordering::Relaxed) {
            eprintln!("pressure: {what} runs at normal priority (cannot enter SCHED_FIFO: {e})");
        }
    }
}

/// Issue requests at `rate` from `t0` until the intended start reaches `stop_ns`.
fn generate(
    shared: &Arc<Shared>,
    rt: &tokio::runtime::Handle,
    t0: Instant,
    rate: f64,
    stop_ns: &AtomicU64,
) -> GenStats {
    raise_priority("the load generator");
    let interval = 1e9 / rate;
    let mut rng = 0x1234_5678_9ABC_DEF0u64;
    let mut lag = Latency::new();
    let mut i = 0u64;
    let mut last = t0;
    loop {
        let at_ns = (i as f64 * interval) as u64;
        if at_ns >= stop_ns.load(Ordering::Acquire) {
            break;
        }
        let due = t0 + Duration::from_nanos(at_ns);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        last = Instant::now();
        let late = last.saturating_duration_since(due);
        lag.record(late);
        let lag_ns = u64::try_from(late.as_nanos()).unwrap_or(u64::MAX);
        let key = splitmix(&mut rng) % shared.keys;
        let is_get = splitmix(&mut rng) % 100 < GET_PERCENT;
        let tag = (shard_of(key, shared.nshards), is_get);
        let shard = &shared.shards[tag.0 as usize];
        let sh = shared.clone();
        if is_get {
            let fut = shard.run_ref_async(key, get);
            rt.spawn(async move {
                let r = fut.await;
                let lat = t0.elapsed().saturating_sub(Duration::from_nanos(at_ns));
                match r {
                    Ok(v) => {
                        let max = sh.versions[key as usize].load(Ordering::Acquire);
                        let ok = check(key, v.as_deref(), max);
                        let outcome = if ok { Outcome::Ok } else { Outcome::Mismatch };
                        sh.finish(at_ns, lag_ns, tag, lat, outcome);
                    }
                    Err(e) => {
                        // Counted before the record, so "completed" never runs ahead.
                        sh.error(at_ns, e);
                        sh.finish(at_ns, lag_ns, tag, lat, Outcome::Error);
                    }
                }
            });
        } else {
            let version = shared.versions[key as usize].fetch_add(1, Ordering::AcqRel) + 1;
            let fut = shard.run_async((key, value(key, version)), set);
            rt.spawn(async move {
                let r = fut.await;
                let lat = t0.elapsed().saturating_sub(Duration::from_nanos(at_ns));
                match r {
                    // The key existed before (every key is loaded at the start).
                    Ok(true) => sh.finish(at_ns, lag_ns, tag, lat, Outcome::Ok),
                    Ok(false) => sh.finish(at_ns, lag_ns, tag, lat, Outcome::Mismatch),
                    Err(e) => {
                        // Counted before the record, so "completed" never runs ahead.
                        sh.error(at_ns, e);
                        sh.finish(at_ns, lag_ns, tag, lat, Outcome::Error);
                    }
                }
            });
        }
        i += 1;
    }
    GenStats {
        issued: i,
        wall: last.saturating_duration_since(t0),
        lag,
    }
}

// ----- sampling the nodes -------------------------------------------------------------

#[derive(Clone, Debug)]
struct NodeSample {
    id: NodeId,
    alive: bool,
    /// The cgroup's usage when reported, else resident memory, bytes.
    mem: u64,
    moves_out: u64,
    shards: u32,
    mem_pressure: bool,
}

#[derive(Clone, Debug)]
struct Sample {
    t_ns: u64,
    nodes: Vec<NodeSample>,
    /// The victim's `memory.usage_in_bytes`, read directly, when readable.
    victim_cgroup: Option<u64>,
}

fn mem_of(n: &NodeInfo) -> u64 {
    if n.usage.cgroup_mem_usage > 0 {
        n.usage.cgroup_mem_usage
    } else {
        n.usage.mem_used
    }
}

fn sample_nodes(
    cluster: &Cluster,
    t0: Instant,
    victim_cgroup: Option<&granule_host::Reader>,
) -> Option<Sample> {
    let nodes = cluster.nodes().ok()?;
    let t_ns = u64::try_from(Instant::now().saturating_duration_since(t0).as_nanos()).ok()?;
    let mut v: Vec<NodeSample> = nodes
        .iter()
        .filter(|n| n.role == Role::Node)
        .map(|n| NodeSample {
            id: n.id,
            alive: n.state == NodeState::Alive,
            mem: mem_of(n),
            moves_out: n.usage.moves_out,
            shards: n.usage.proclets[Kind::Memory.index()],
            mem_pressure: n.usage.mem_pressure,
        })
        .collect();
    v.sort_by_key(|n| n.id);
    let victim_cgroup = victim_cgroup.and_then(|r| r.memory_usage().ok());
    Some(Sample {
        t_ns,
        nodes: v,
        victim_cgroup,
    })
}

// ----- the antagonist -------------------------------------------------------------------

#[derive(Clone, Debug)]
struct AntagonistRun {
    start_ns: u64,
    exit_ns: u64,
    /// "exit code N", "signal N (SIGKILL)", or what went wrong.
    status: String,
    /// Ended by a signal (the OOM killer's SIGKILL, normally).
    killed: bool,
    /// It put its memory into the victim's cgroup: it was SIGKILLed (by the OOM killer),
    /// or it exited 0 after holding. Any other end (it could not start, refused its arguments, could not join
    /// the cgroup) means there was no antagonist, and no disruption figure is computed.
    applied: bool,
    log: String,
}

/// Start `granule antagonist memory` against `victim` and wait for it to end.
fn run_antagonist(
    split: bool,
    victim: NodeId,
    size: u64,
    p: &Params,
    controller: &str,
    t0: Instant,
) -> AntagonistRun {
    use std::os::unix::process::ExitStatusExt;
    let now_ns = || u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let log_path = std::env::temp_dir().join(format!(
        "granule-pressure-antagonist-{}.log",
        std::process::id()
    ));
    let args = vec![
        "antagonist".to_string(),
        "memory".into(),
        "--node".into(),
        victim.to_string(),
        "--rate".into(),
        p.antagonist_rate.into(),
        "--size".into(),
        format!("{}MiB", size >> 20),
        "--hold".into(),
        format!("{}ms", p.hold.as_millis()),
        "--controller".into(),
        controller.into(),
    ];
    let start_ns = now_ns();
    // `run` checked that it is there.
    let exe = match crate::granule_exe() {
        Ok(exe) => exe,
        Err(e) => {
            return AntagonistRun {
                start_ns,
                exit_ns: start_ns,
                status: format!("could not start: {e:#}"),
                killed: false,
                applied: false,
                log: String::new(),
            }
        }
    };
    eprintln!("pressure: starting {} {}", exe.display(), args.join(" "));
    let spawned = std::fs::File::create(&log_path).and_then(|f| {
        let f2 = f.try_clone()?;
        // On the nodes' vCPU (see `run_once`).
        let mut cmd = if split {
            let mut c = std::process::Command::new("taskset");
            c.args(["-c", "1"]).arg(&exe);
            c
        } else {
            std::process::Command::new(&exe)
        };
        cmd.args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(f)
            .stderr(f2)
            .spawn()
    });
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            return AntagonistRun {
                start_ns,
                exit_ns: start_ns,
                status: format!("could not start: {e}"),
                killed: false,
                applied: false,
                log: String::new(),
            }
        }
    };
    // Growing to `size` at the given rate, holding, plus generous slack.
    let rate = granule::config::parse_rate(p.antagonist_rate).unwrap_or(1 << 30);
    let limit =
        Duration::from_secs_f64(size as f64 / rate as f64) + p.hold + Duration::from_secs(20);
    let waited = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if waited.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!(
                    "still running after {limit:?}; killed by the benchmark"
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => break Err(format!("cannot wait for it: {e}")),
        }
    };
    let exit_ns = now_ns();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let _ = std::fs::remove_file(&log_path);
    let (status, killed, applied) = match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(c), _) => (format!("exit code {c}"), false, c == 0),
            (None, Some(sig)) => {
                let name = nix::sys::signal::Signal::try_from(sig)
                    .map(|s| s.as_str().to_string())
                    .unwrap_or_else(|_| "?".into());
                // SIGKILL: the OOM killer (it volunteers); any other signal is a crash.
                let oom = sig == nix::sys::signal::Signal::SIGKILL as i32;
                (format!("signal {sig} ({name})"), true, oom)
            }
            _ => (format!("{s}"), false, false),
        },
        Err(e) => (e, false, false),
    };
    if !applied {
        eprintln!("pressure: the antagonist failed ({status}); its output:\n{log}");
    }
    AntagonistRun {
        start_ns,
        exit_ns,
        status,
        killed,
        applied,
        log,
    }
}

/// Kills inside the victim's memory cgroup so far (`None` if unreadable).
fn cgroup_oom_kills(reader: &granule_host::Reader) -> Option<u64> {
    reader.oom_kills().ok()
}

/// Whether process `pid` is gone or a zombie.
fn process_dead(pid: u32) -> bool {
    granule_host::proc::process_gone(pid)
}

// ----- one run ------------------------------------------------------------------------

/// Pin every thread of this process to one vCPU (threads and processes made later inherit
/// it).
fn pin_to(cpu: usize) {
    let _ = crate::affinity::pin_process(cpu);
}

/// Whether the machine has the two vCPUs the placement below needs.
fn two_vcpus() -> bool {
    std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2
}

/// Everything one run measured.
struct RunResult {
    label: &'static str,
    recs: Vec<Rec>,
    /// The node each shard was placed on at the start.
    shard_home: Vec<NodeId>,
    issued: u64,
    errors: Vec<String>,
    error_count: u64,
    gen: GenStats,
    samples: Vec<Sample>,
    victim: NodeId,
    victim_limit: u64,
    cgroups: bool,
    /// Whether the nodes' heartbeats carry cgroup readings (the monitor sees the cgroup).
    cgroup_reported: bool,
    victim_cgroup_dir: Option<PathBuf>,
    placement: BTreeMap<NodeId, usize>,
    data_bytes: u64,
    shard_bytes_min: u64,
    shard_bytes_max: u64,
    antagonist: Option<AntagonistRun>,
    /// Antagonist start (or when it would have started), ns after t0.
    t_a_ns: u64,
    /// Load end (intended start of the last request), ns after t0.
    end_ns: u64,
    dead_nodes: Vec<NodeId>,
    victim_oom_kills: Option<u64>,
}

impl RunResult {
    fn victim_series(&self) -> impl Iterator<Item = (u64, &NodeSample)> + '_ {
        self.samples.iter().filter_map(|s| {
            s.nodes
                .iter()
                .find(|n| n.id == self.victim)
                .map(|n| (s.t_ns, n))
        })
    }

    /// Moves out of the victim over the run.
    fn moves(&self) -> u64 {
        let mut it = self.victim_series().map(|(_, n)| n.moves_out);
        let first = it.next().unwrap_or(0);
        it.last().unwrap_or(first).saturating_sub(first)
    }

    /// Moves out of the nodes other than the victim over the run (none of them is under
    /// memory pressure: these are moves for CPU pressure).
    fn moves_others(&self) -> u64 {
        let sum = |s: &Sample| {
            s.nodes
                .iter()
                .filter(|n| n.id != self.victim)
                .map(|n| n.moves_out)
                .sum::<u64>()
        };
        match (self.samples.first(), self.samples.last()) {
            (Some(a), Some(b)) => sum(b).saturating_sub(sum(a)),
            _ => 0,
        }
    }

    /// Moves out of any node before the antagonist started (CPU pressure: no node is
    /// short of memory then).
    fn moves_before_antagonist(&self) -> u64 {
        let sum = |s: &Sample| s.nodes.iter().map(|n| n.moves_out).sum::<u64>();
        let before = self.samples.iter().rfind(|s| s.t_ns < self.t_a_ns);
        match (self.samples.first(), before) {
            (Some(a), Some(b)) => sum(b).saturating_sub(sum(a)),
            _ => 0,
        }
    }

    /// Sample times (ns after t0) of the first and the last change of the victim's
    /// moves-out counter.
    fn move_times(&self) -> Option<(u64, u64)> {
        let mut prev: Option<u64> = None;
        let mut first = None;
        let mut last = None;
        for (t, n) in self.victim_series() {
            if let Some(p) = prev {
                if n.moves_out > p {
                    first.get_or_insert(t);
                    last = Some(t);
                }
            }
            prev = Some(n.moves_out);
        }
        Some((first?, last?))
    }

    /// [antagonist start, max(exit, last move) + 1 s], ns after t0.
    fn disruption(&self) -> Option<(u64, u64)> {
        let a = self.antagonist.as_ref().filter(|a| a.applied)?;
        let last_move = self.move_times().map(|m| m.1).unwrap_or(0);
        let end = a.exit_ns.max(last_move) + DISRUPTION_TAIL.as_nanos() as u64;
        Some((a.start_ns, end.min(self.end_ns)))
    }

    fn steady(&self, p: &Params) -> (u64, u64) {
        (p.warmup.as_nanos() as u64, self.t_a_ns)
    }

    fn latency_in(&self, (from, to): (u64, u64)) -> Latency {
        let mut l = Latency::new();
        for r in &self.recs {
            if r.outcome != Outcome::Error && r.at_ns >= from && r.at_ns < to {
                l.record(Duration::from_nanos(r.lat_ns));
            }
        }
        l
    }

    /// p99 of the generator's hand-over delay for requests due in `(from, to)`, µs.
    fn lag_p99_in(&self, (from, to): (u64, u64)) -> f64 {
        let mut l = Latency::new();
        for r in self.recs.iter().filter(|r| r.at_ns >= from && r.at_ns < to) {
            l.record(Duration::from_nanos(r.lag_ns));
        }
        if l.is_empty() {
            f64::NAN
        } else {
            us(l.p(0.99))
        }
    }

    /// Requests in `window` slower than `threshold`: (to shards that started on the
    /// victim, to the others).
    fn slow_by_home(&self, (from, to): (u64, u64), threshold: Duration) -> (usize, usize) {
        let slow = self.recs.iter().filter(|r| {
            r.outcome != Outcome::Error
                && r.at_ns >= from
                && r.at_ns < to
                && r.lat_ns > threshold.as_nanos() as u64
        });
        let victim = self.victim;
        let (mut on_victim, mut others) = (0, 0);
        for r in slow {
            if self.shard_home.get(r.tag.0 as usize) == Some(&victim) {
                on_victim += 1;
            } else {
                others += 1;
            }
        }
        (on_victim, others)
    }

    fn lost(&self) -> u64 {
        self.error_count + self.issued.saturating_sub(self.recs.len() as u64)
    }

    fn mismatches(&self) -> u64 {
        self.recs
            .iter()
            .filter(|r| r.outcome == Outcome::Mismatch)
            .count() as u64
    }

    fn achieved_rate(&self) -> f64 {
        self.issued as f64 / self.gen.wall.as_secs_f64().max(1e-9)
    }

    /// How fast the victim's memory grew under the antagonist, MiB/s: from the last
    /// sample before the antagonist started to the sample with the most memory (the
    /// cgroup file read directly when available, else the reported memory).
    fn antagonist_rate(&self) -> f64 {
        let Some(a) = self.antagonist.as_ref().filter(|a| a.applied) else {
            return f64::NAN;
        };
        let mem = |s: &Sample| {
            s.victim_cgroup
                .or_else(|| s.nodes.iter().find(|n| n.id == self.victim).map(|n| n.mem))
        };
        let start = self
            .samples
            .iter()
            .rfind(|s| s.t_ns <= a.start_ns)
            .and_then(|s| Some((s.t_ns, mem(s)?)));
        let peak = self
            .samples
            .iter()
            .filter(|s| s.t_ns > a.start_ns && s.t_ns <= a.exit_ns + 100_000_000)
            .filter_map(|s| Some((s.t_ns, mem(s)?)))
            .max_by_key(|x| x.1);
        match (start, peak) {
            (Some((t0, m0)), Some((t1, m1))) if t1 > t0 && m1 > m0 => {
                (m1 - m0) as f64 / (1 << 20) as f64 / ((t1 - t0) as f64 / 1e9)
            }
            _ => f64::NAN,
        }
    }

    /// The allocation rate the antagonist itself reports (its last progress line,
    /// "allocated N MiB in T ms"), MiB/s.
    fn antagonist_alloc_rate(&self) -> f64 {
        self.antagonist
            .as_ref()
            .and_then(|a| a.log.lines().rev().find_map(parse_progress))
            .map_or(f64::NAN, |(mib, ms)| mib / (ms / 1e3).max(1e-9))
    }

    fn victim_peak(&self) -> u64 {
        self.victim_series().map(|(_, n)| n.mem).max().unwrap_or(0)
    }
}

/// "allocated N MiB in T ms (...)" → (N, T).
fn parse_progress(line: &str) -> Option<(f64, f64)> {
    let rest = line.strip_prefix("allocated ")?;
    let (mib, rest) = rest.split_once(" MiB in ")?;
    let (ms, _) = rest.split_once(" ms")?;
    Some((mib.trim().parse().ok()?, ms.trim().parse().ok()?))
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One run: start a cluster, load it, set the antagonist on the busiest node, measure.
fn run_once(p: &Params, label: &'static str, baseline: bool) -> anyhow::Result<RunResult> {
    // A node the OOM killer takes is an outcome this benchmark reports, not something
    // to repair mid-run: no replacement processes.
    let mut builder = Cluster::builder()
        .nodes(&p.nodes_spec())?
        .driver(NodeSpec {
            cores: 1.0,
            mem_bytes: 1 << 30,
        })
        .set("cluster.replace_dead", "off")?;
    if baseline {
        // The baseline's slow, late moves (its node processes get the same configuration).
        builder = builder
            .set("migration.throttle", BASELINE_THROTTLE)?
            .set("migration.delay", BASELINE_DELAY)?;
    }
    // GRANULE_CGROUPS=off (cluster.cgroups) runs the nodes without cgroups (budget
    // accounting only; the antagonist phase is then skipped), as for any cluster.
    // Placement (two vCPUs stand for the rack): vCPU 1 is the victim's machine — the
    // victim node and, later, the antagonist; vCPU 0 is the rest — the driver (load
    // generator, client side of every call) and the other nodes, which receive the shed
    // shards. So the antagonist's page faulting and the kernel's OOM kill disturb only the
    // node they share a machine with, as in a real rack, while everything the shedding
    // costs elsewhere (receiving, decoding) is inside the measurement. The nodes start on
    // vCPU 1 (they inherit the driver's affinity when spawned); once the victim is known
    // the others move to vCPU 0.
    // Every run starts from the driver's own affinity (all vCPUs) and gives it back at the
    // end: pinned to vCPU 0, `available_parallelism` would say 1 and the next placement
    // decision would be wrong.
    let _affinity = crate::affinity::SavedAffinity::unpin();
    let split = two_vcpus();
    if split {
        pin_to(1);
    }
    let cluster = builder
        .start()
        .with_context(|| format!("starting the {label} cluster"))?;
    if split {
        pin_to(0);
    }
    let nodes: Vec<NodeId> = cluster.spawned_nodes().iter().map(|(n, _)| *n).collect();
    if nodes.len() != p.nodes {
        bail!(
            "{} node processes registered, {} started",
            nodes.len(),
            p.nodes
        );
    }

    // The data: the controller places each shard; each is built where it lands.
    let t_build = Instant::now();
    let keys = p.keys();
    let mut shards = Vec::with_capacity(p.shards as usize);
    for index in 0..p.shards {
        let spec = ShardSpec {
            index,
            shards: p.shards,
            keys,
        };
        let s = Proclet::builder(Kind::Memory)
            .footprint()
            .mem_hint(p.shard_bytes)
            .create(spec, build_shard)
            .with_context(|| format!("creating shard {index}"))?;
        shards.push(s);
    }
    let mut placement: BTreeMap<NodeId, usize> = nodes.iter().map(|n| (*n, 0)).collect();
    // Where each shard started, to tell the victim's requests from the others'.
    let mut shard_home = Vec::with_capacity(shards.len());
    let (mut data_bytes, mut lo, mut hi) = (0u64, u64::MAX, 0u64);
    for s in &shards {
        *placement.entry(s.location()?).or_default() += 1;
        shard_home.push(s.location()?);
        let (_, bytes, _) = s.run_ref((), describe)?;
        data_bytes += bytes;
        lo = lo.min(bytes);
        hi = hi.max(bytes);
    }
    // Every shard once more, so every connection exists before the load starts.
    for (i, s) in shards.iter().enumerate() {
        let k = (0..keys)
            .find(|k| shard_of(*k, p.shards) == i as u32)
            .unwrap_or(0);
        let v = s.run_ref(k, get)?;
        if !check(k, v.as_deref(), 0) {
            bail!("shard {i} does not hold the value loaded for key {k}");
        }
    }
    let victim = placement
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
        .map(|(n, _)| *n)
        .ok_or_else(|| anyhow!("the cluster has no node"))?;
    if split {
        for (n, pid) in cluster.spawned_nodes() {
            if n != victim {
                crate::affinity::pin_pid(pid, 0)
                    .with_context(|| format!("moving node {n} (pid {pid}) to vCPU 0"))?;
            }
        }
    }
    eprintln!(
        "pressure[{label}]: {} shards, {:.1} MiB of data (shards {:.2}–{:.2} MiB), built in {:.1?}; placement {}; victim {victim}",
        p.shards,
        data_bytes as f64 / (1 << 20) as f64,
        lo as f64 / (1 << 20) as f64,
        hi as f64 / (1 << 20) as f64,
        t_build.elapsed(),
        placement
            .iter()
            .map(|(n, c)| format!("{n}={c}"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    // Can the antagonist join the victim's memory cgroup? (A node in a cgroup reports its
    // limit from its monitor's first reading on: wait a few heartbeats for it.)
    let victim_info = || -> anyhow::Result<NodeInfo> {
        cluster
            .nodes()?
            .into_iter()
            .find(|n| n.id == victim)
            .ok_or_else(|| anyhow!("the controller does not list the victim {victim}"))
    };
    let mut info = victim_info()?;
    let asked = Instant::now();
    while info.cgroups.is_some()
        && info.usage.cgroup_mem_limit == 0
        && asked.elapsed() < Duration::from_secs(1)
    {
        std::thread::sleep(Duration::from_millis(50));
        info = victim_info()?;
    }
    // The victim's memory cgroup, read through the host crate; its files stay open (the
    // sampler reads the usage every few milliseconds).
    let victim_cgroup = info
        .cgroups
        .as_ref()
        .and_then(|c| c.memory.clone())
        .and_then(|rel| {
            let h = granule_host::Hierarchy::default();
            let dir = h.group_dir(granule_host::Controller::Memory, &rel).ok()?;
            let paths = granule_host::CgroupPaths {
                memory: Some(rel),
                cpu: None,
            };
            let reader = granule_host::Reader::for_paths(&h, &paths).ok()?;
            Some((dir, reader))
        });
    let victim_cgroup_dir = victim_cgroup.as_ref().map(|(d, _)| d.clone());
    // The antagonist needs the node's *own* memory cgroup with its spec as the limit; a node
    // of a cluster started without cgroups still reports the (unlimited, shared) cgroup it
    // inherited, and an antagonist there would press on everything but the node.
    // (0: no limit.)
    let file_limit = victim_cgroup
        .as_ref()
        .and_then(|(_, r)| r.memory_limit().ok());
    let limited = file_limit.is_some_and(|l| l > 0 && l <= info.spec.mem_bytes.saturating_mul(2));
    let cgroups = victim_cgroup_dir.is_some() && limited;
    let cgroup_reported = limited && info.usage.cgroup_mem_limit > 0;
    let victim_limit = if cgroup_reported {
        info.usage.cgroup_mem_limit.min(info.spec.mem_bytes)
    } else {
        info.spec.mem_bytes
    };
    if victim_cgroup_dir.is_none() {
        eprintln!(
            "pressure[{label}]: NOTE: node {victim} runs in no memory cgroup (NodeInfo.cgroups = {:?}); \
             the antagonist cannot join it, so the antagonist phase is skipped",
            info.cgroups
        );
    } else if !limited {
        let limit = match file_limit {
            None => "unreadable".to_string(),
            Some(0) => "none".to_string(),
            Some(l) => format!("{l} bytes"),
        };
        eprintln!(
            "pressure[{label}]: NOTE: node {victim} reports the memory cgroup {:?}, whose limit is {limit}, \
             not its spec's {}: not a cgroup of its own (cluster without cgroups), so the antagonist phase is skipped",
            victim_cgroup_dir, info.spec.mem_bytes
        );
    } else if !cgroup_reported {
        eprintln!(
            "pressure[{label}]: NOTE: node {victim} runs in cgroup {:?} but its heartbeats report no \
             cgroup limit: its monitor accounts against its budget and will not see the antagonist",
            victim_cgroup_dir
        );
    }
    // From here on only a cgroup of the node's own counts (a shared one says nothing).
    let victim_cgroup = victim_cgroup.filter(|_| limited);
    let victim_cgroup_dir = victim_cgroup.as_ref().map(|(d, _)| d.clone());
    let victim_reader = victim_cgroup.map(|(_, r)| r);
    let oom_before = victim_reader.as_ref().and_then(cgroup_oom_kills);

    let nshards = p.shards;
    let shared = Arc::new(Shared {
        shards,
        nshards,
        keys,
        versions: (0..keys).map(|_| AtomicU32::new(0)).collect(),
        recs: Mutex::new(Vec::with_capacity((p.rate * 30.0) as usize)),
        errors: Mutex::new(Vec::new()),
        error_count: AtomicU64::new(0),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("pressure-load")
        .on_thread_start(|| raise_priority("the load generator's runtime"))
        .enable_all()
        .build()?;
    let t0 = Instant::now() + Duration::from_millis(20);
    let t_a_ns = (p.warmup + p.steady).as_nanos() as u64;
    let stop_ns = AtomicU64::new(u64::MAX);
    let sampling = AtomicBool::new(true);
    let last_move_ns = AtomicU64::new(0);
    let size = victim_limit + p.antagonist_extra;

    let (gen, samples, antagonist, end_ns) = std::thread::scope(|sc| {
        let sampler = sc.spawn(|| {
            let mut out = Vec::new();
            let mut prev_moves: Option<u64> = None;
            let mut next = t0;
            std::thread::sleep(t0.saturating_duration_since(Instant::now()));
            while sampling.load(Ordering::Acquire) {
                if let Some(s) = sample_nodes(&cluster, t0, victim_reader.as_ref()) {
                    if let Some(v) = s.nodes.iter().find(|n| n.id == victim) {
                        if prev_moves.is_some_and(|m| v.moves_out > m) {
                            last_move_ns.store(s.t_ns, Ordering::Release);
                        }
                        prev_moves = Some(v.moves_out);
                    }
                    out.push(s);
                }
                next += SAMPLE_EVERY;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    next = now;
                }
            }
            out
        });
        let handle = rt.handle().clone();
        let generator = {
            let shared = shared.clone();
            let stop = &stop_ns;
            sc.spawn(move || generate(&shared, &handle, t0, p.rate, stop))
        };
        let sleep_until = |t: Instant| {
            let now = Instant::now();
            if t > now {
                std::thread::sleep(t - now);
            }
        };
        sleep_until(t0 + Duration::from_nanos(t_a_ns));
        let antagonist = cgroups.then(|| {
            let a = run_antagonist(split, victim, size, p, cluster.controller_addr(), t0);
            eprintln!(
                "pressure[{label}]: antagonist ran {:.2} s: {}",
                (a.exit_ns - a.start_ns) as f64 / 1e9,
                a.status
            );
            a
        });
        // Keep the load on until the later of the antagonist's exit and the last move,
        // plus `after` (at least the disruption window's tail).
        let tail = p.after.max(DISRUPTION_TAIL + Duration::from_millis(200));
        let cap = Instant::now() + Duration::from_secs(30);
        loop {
            let exit = antagonist.as_ref().map_or(t_a_ns, |a| a.exit_ns);
            let end = exit.max(last_move_ns.load(Ordering::Acquire)) + tail.as_nanos() as u64;
            let now = Instant::now();
            if now >= t0 + Duration::from_nanos(end) || now >= cap {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let end_ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        stop_ns.store(end_ns, Ordering::Release);
        let gen = generator.join().expect("the load generator panicked");
        // Let requests in flight finish (or be counted lost).
        let deadline = Instant::now() + p.drain;
        while (shared.completed() as u64) < gen.issued && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        sampling.store(false, Ordering::Release);
        let samples = sampler.join().expect("the sampler panicked");
        (gen, samples, antagonist, end_ns)
    });
    rt.shutdown_background();

    // Which node processes died during the run.
    let listed = cluster.nodes().unwrap_or_default();
    let dead_nodes: Vec<NodeId> = cluster
        .spawned_nodes()
        .into_iter()
        .filter(|(id, pid)| {
            process_dead(*pid)
                || listed
                    .iter()
                    .any(|n| n.id == *id && n.state == NodeState::Dead)
        })
        .map(|(id, _)| id)
        .collect();
    let oom_after = victim_reader.as_ref().and_then(cgroup_oom_kills);
    let victim_oom_kills = match (oom_before, oom_after) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let recs = shared.recs.lock().map(|r| r.clone()).unwrap_or_default();
    let errors = shared.errors.lock().map(|e| e.clone()).unwrap_or_default();
    let error_count = shared.error_count.load(Ordering::Relaxed);
    drop(shared);
    dump_requests(p.dump.as_deref(), label, t0, &recs, &shard_home, victim);
    dump_moves(p.dump.as_deref(), label, cluster.controller_addr());
    crate::print_cluster_usage(&cluster);
    cluster.shutdown();
    Ok(RunResult {
        label,
        recs,
        shard_home,
        issued: gen.issued,
        errors,
        error_count,
        gen,
        samples,
        victim,
        victim_limit,
        cgroups,
        cgroup_reported,
        victim_cgroup_dir,
        placement,
        data_bytes,
        shard_bytes_min: lo,
        shard_bytes_max: hi,
        antagonist,
        t_a_ns,
        end_ns,
        dead_nodes,
        victim_oom_kills,
    })
}

// ----- the report -----------------------------------------------------------------------

/// One timeline window of one run.
struct WindowRow {
    t_ms: f64,
    phase: &'static str,
    requests: u64,
    lost: u64,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    /// p99 of how late the generator handed requests over (driver-side delay).
    gen_lag_p99_us: Option<f64>,
    victim_mem_mib: Option<f64>,
    victim_cgroup_mib: Option<f64>,
    moves: Option<u64>,
    /// Cumulative moves out of every node.
    moves_all: Option<u64>,
    /// Whether the victim reported memory pressure in any sample of the window.
    victim_pressure: Option<bool>,
    shards_victim: Option<u32>,
    shards_by_node: String,
}

fn windows(r: &RunResult, p: &Params) -> Vec<WindowRow> {
    let w = WINDOW.as_nanos() as u64;
    // Whole windows only (the load's last partial window is left out of the timeline).
    let n = (r.end_ns / w) as usize;
    let mut lat: Vec<Latency> = (0..n).map(|_| Latency::new()).collect();
    let mut lag: Vec<Latency> = (0..n).map(|_| Latency::new()).collect();
    let mut errors = vec![0u64; n];
    for rec in &r.recs {
        let i = (rec.at_ns / w) as usize;
        if i >= n {
            continue;
        }
        lag[i].record(Duration::from_nanos(rec.lag_ns));
        if rec.outcome == Outcome::Error {
            errors[i] += 1;
        } else {
            lat[i].record(Duration::from_nanos(rec.lat_ns));
        }
    }
    // Requests issued but never completed: count them where they were due.
    let interval = 1e9 / p.rate;
    let mut done = vec![0u64; n];
    for rec in &r.recs {
        let i = (rec.at_ns / w) as usize;
        if i < n {
            done[i] += 1;
        }
    }
    let mut issued = vec![0u64; n];
    for i in 0..r.issued {
        let at = (i as f64 * interval) as u64;
        let k = (at / w) as usize;
        if k < n {
            issued[k] += 1;
        }
    }
    let base_moves = r.victim_series().next().map(|(_, n)| n.moves_out);
    let all_moves = |s: &Sample| s.nodes.iter().map(|n| n.moves_out).sum::<u64>();
    let base_all = r.samples.first().map(all_moves);
    let disruption = r.disruption();
    (0..n)
        .map(|i| {
            let (from, to) = (i as u64 * w, (i as u64 + 1) * w);
            let in_win: Vec<&Sample> = r
                .samples
                .iter()
                .filter(|s| s.t_ns >= from && s.t_ns < to)
                .collect();
            let victim = |s: &Sample| s.nodes.iter().find(|n| n.id == r.victim).cloned();
            let mem = in_win.iter().filter_map(|s| victim(s).map(|n| n.mem)).max();
            let cg = in_win.iter().filter_map(|s| s.victim_cgroup).max();
            let last = in_win.last();
            let moves_all = last
                .zip(base_all)
                .map(|(s, b)| all_moves(s).saturating_sub(b));
            let moves = last
                .and_then(|s| victim(s))
                .zip(base_moves)
                .map(|(n, b)| n.moves_out.saturating_sub(b));
            let shards_victim = last.and_then(|s| victim(s)).map(|n| n.shards);
            let victim_pressure = (!in_win.is_empty()).then(|| {
                in_win
                    .iter()
                    .any(|s| victim(s).is_some_and(|n| n.mem_pressure))
            });
            let shards_by_node = last
                .map(|s| {
                    s.nodes
                        .iter()
                        .map(|n| {
                            let mark = if n.id == r.victim { "*" } else { "" };
                            let dead = if n.alive { "" } else { "(dead)" };
                            format!("{}{mark}={}{dead}", n.id, n.shards)
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            let mid = from + w / 2;
            let phase = if to <= p.warmup.as_nanos() as u64 {
                "warm-up"
            } else if mid < r.t_a_ns {
                "steady"
            } else if disruption.is_some_and(|(a, b)| mid >= a && mid < b) {
                "disruption"
            } else {
                "after"
            };
            let pct = |q: f64| (!lat[i].is_empty()).then(|| us(lat[i].p(q)));
            WindowRow {
                t_ms: from as f64 / 1e6,
                phase,
                requests: issued[i],
                lost: errors[i] + issued[i].saturating_sub(done[i]),
                p50_us: pct(0.5),
                p99_us: pct(0.99),
                gen_lag_p99_us: (!lag[i].is_empty()).then(|| us(lag[i].p(0.99))),
                victim_mem_mib: mem.map(|m| m as f64 / (1 << 20) as f64),
                victim_cgroup_mib: cg.map(|m| m as f64 / (1 << 20) as f64),
                moves,
                moves_all,
                victim_pressure,
                shards_victim,
                shards_by_node,
            }
        })
        .collect()
}

/// Headline figures of one run.
struct Headline {
    steady: Latency,
    disruption: Option<Latency>,
    window: Option<(u64, u64)>,
}

impl Headline {
    fn of(r: &RunResult, p: &Params) -> Headline {
        let window = r.disruption();
        Headline {
            steady: r.latency_in(r.steady(p)),
            disruption: window.map(|w| r.latency_in(w)),
            window,
        }
    }

    fn steady_p99(&self) -> f64 {
        us(self.steady.p(0.99))
    }

    fn disruption_p99(&self) -> f64 {
        self.disruption
            .as_ref()
            .filter(|l| !l.is_empty())
            .map_or(f64::NAN, |l| us(l.p(0.99)))
    }

    fn disruption_p999(&self) -> f64 {
        self.disruption
            .as_ref()
            .filter(|l| !l.is_empty())
            .map_or(f64::NAN, |l| us(l.p(0.999)))
    }

    fn ratio(&self) -> f64 {
        self.disruption_p99() / self.steady_p99()
    }

    /// What counts as a slow request: over 3× the steady p99 (the target's bound).
    fn slow_threshold(&self) -> Option<Duration> {
        (!self.steady.is_empty()).then(|| self.steady.p(0.99) * 3)
    }

    /// Slow requests in the disruption window of `r` (this run's headline): to shards
    /// that started on the victim, to the others.
    fn slow(&self, r: &RunResult) -> Option<(usize, usize)> {
        Some(r.slow_by_home(self.window?, self.slow_threshold()?))
    }
}

fn ms_after_antagonist(r: &RunResult, t_ns: u64) -> f64 {
    (t_ns as f64 - r.t_a_ns as f64) / 1e6
}

fn opt(v: f64) -> Cell {
    Cell::from(v.is_finite().then_some(v))
}

/// For investigating a run's tail: with `--dump DIR`, every request of
/// every run goes to `DIR/<label>-<pid>-<run>.csv` with its intended start in seconds of
/// `CLOCK_MONOTONIC` (the clock `perf record -k CLOCK_MONOTONIC` stamps events with), so
/// slow requests can be lined up with a scheduler trace.
fn dump_requests(
    dir: Option<&std::path::Path>,
    label: &str,
    t0: Instant,
    recs: &[Rec],
    shard_home: &[NodeId],
    victim: NodeId,
) {
    let Some(dir) = dir else {
        return;
    };
    // `Instant` is CLOCK_MONOTONIC on Linux: anchor t0 through the current reading.
    let now_mono = granule_host::proc::monotonic_clock().as_secs_f64();
    let t0_mono = now_mono - t0.elapsed().as_secs_f64();
    use std::fmt::Write as _;
    let mut out = String::from("start_mono_s,latency_us,lag_us,shard,read,on_victim,ok\n");
    for r in recs {
        let _ = writeln!(
            out,
            "{:.6},{:.1},{:.1},{},{},{},{}",
            t0_mono + r.at_ns as f64 * 1e-9,
            r.lat_ns as f64 / 1e3,
            r.lag_ns as f64 / 1e3,
            r.tag.0,
            r.tag.1 as u8,
            (shard_home.get(r.tag.0 as usize) == Some(&victim)) as u8,
            (r.outcome != Outcome::Error) as u8
        );
    }
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let run = RUNS.fetch_add(1, Ordering::Relaxed) + 1;
    let path = std::path::Path::new(&dir).join(format!("{label}-{}-{run}.csv", std::process::id()));
    match std::fs::write(&path, out) {
        Ok(()) => eprintln!("pressure: requests dumped to {}", path.display()),
        Err(e) => eprintln!("pressure: cannot dump requests to {}: {e}", path.display()),
    }
}

/// With `--dump DIR`, the run's cluster events (moves with their bytes and
/// how long the proclet was unavailable) go to `DIR/<label>-<pid>-<run>-moves.csv`, in
/// `CLOCK_REALTIME` milliseconds as nodes stamp them (the request dump's monotonic times
/// are lined up through `mono_minus_real_s`, the two clocks' offset when written).
fn dump_moves(dir: Option<&std::path::Path>, label: &str, controller: &str) {
    let Some(dir) = dir else {
        return;
    };
    let fetched = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|rt| {
            rt.block_on(async {
                let ctl =
                    granule_controller::ControllerClient::connect_tool(controller, "bench").await?;
                Ok::<_, anyhow::Error>(ctl.events(0, 10_000).await?)
            })
        });
    let events = match fetched {
        Ok(e) => e,
        Err(e) => return eprintln!("pressure: cannot fetch the cluster's events: {e:#}"),
    };
    // `SystemTime` is CLOCK_REALTIME.
    let mono = granule_host::proc::monotonic_clock().as_secs_f64();
    let offset = match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(real) => mono - real.as_secs_f64(),
        Err(_) => f64::NAN,
    };
    use std::fmt::Write as _;
    let mut out =
        String::from("at_real_ms,mono_minus_real_s,kind,node,to,subject,bytes,micros,detail\n");
    for e in events {
        let _ = writeln!(
            out,
            "{},{offset:.6},{:?},{},{},{},{},{},\"{}\"",
            e.at_ms,
            e.kind,
            e.node,
            e.to.map(|n| n.to_string()).unwrap_or_default(),
            e.subject,
            e.bytes,
            e.micros,
            e.detail.replace('"', "'")
        );
    }
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let run = RUNS.fetch_add(1, Ordering::Relaxed) + 1;
    let path =
        std::path::Path::new(&dir).join(format!("{label}-{}-{run}-moves.csv", std::process::id()));
    match std::fs::write(&path, out) {
        Ok(()) => eprintln!("pressure: cluster events dumped to {}", path.display()),
        Err(e) => eprintln!(
            "pressure: cannot dump the cluster's events to {}: {e}",
            path.display()
        ),
    }
}

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let mut p = Params::new(opts.quick);
    // For experiments (e.g. tracing one run): fewer or more repetitions than the default.
    if let Some(n) = opts.reps.filter(|n| *n > 0) {
        p.reps = n;
    }
    p.dump = opts.dump.clone();
    let _affinity = crate::affinity::SavedAffinity::unpin();
    eprintln!(
        "pressure: {} × 2 runs (Granule, then migration throttled to {BASELINE_THROTTLE} after {BASELINE_DELAY}); \
         {} nodes {}; {} shards × ~{} MiB; {} req/s",
        p.reps,
        p.nodes,
        p.node_spec(),
        p.shards,
        p.shard_bytes >> 20,
        p.rate
    );
    // This machine's tail latency is noisy from run to run (the steady p99 alone ranged
    // 0.4–1.1 ms across identical runs), so the pair of runs is repeated and the headline
    // ratios are medians; the timeline shows the repetition whose Granule ratio is the
    // median, and the counters (node deaths, lost calls) add up every repetition.
    let mut pairs: Vec<[RunResult; 2]> = Vec::with_capacity(p.reps);
    let progress = granule_report::Progress::new(2 * p.reps as u64, "pressure");
    for i in 0..p.reps {
        if i > 0 {
            std::thread::sleep(SETTLE);
        }
        eprintln!("pressure: repetition {} of {}", i + 1, p.reps);
        let granule = run_once(&p, "granule", false)?;
        progress.step(format!("repetition {}: Granule run done", i + 1));
        // The first cluster's memory (and the antagonist's) was just freed. This VM hands
        // freed memory back to its hypervisor about two seconds later (free page
        // reporting), work that stalled the next run's steady phase by up to 80 ms when it
        // overlapped.
        std::thread::sleep(SETTLE);
        pairs.push([granule, run_once(&p, "baseline", true)?]);
        progress.step(format!("repetition {}: throttled baseline done", i + 1));
    }
    progress.finish();
    let heads_all: Vec<[Headline; 2]> = pairs
        .iter()
        .map(|pair| [0, 1].map(|k| Headline::of(&pair[k], &p)))
        .collect();
    let ratios: Vec<[f64; 2]> = heads_all
        .iter()
        .map(|h| [h[0].ratio(), h[1].ratio()])
        .collect();
    let spread = |k: usize| Summary::of(&ratios.iter().map(|r| r[k]).collect::<Vec<_>>());
    let (g_spread, b_spread) = (spread(0), spread(1));
    let g_median = g_spread.as_ref().map_or(f64::NAN, |s| s.median);
    let b_median = b_spread.as_ref().map_or(f64::NAN, |s| s.median);
    // The representative repetition: the one whose Granule ratio is closest to the median.
    let shown = (0..pairs.len())
        .min_by(|&i, &j| {
            let d = |x: usize| (ratios[x][0] - g_median).abs();
            d(i).total_cmp(&d(j))
        })
        .unwrap_or(0);
    let totals = |k: usize, f: &dyn Fn(&RunResult) -> u64| -> f64 {
        pairs.iter().map(|pair| f(&pair[k])).sum::<u64>() as f64
    };
    let deaths = [0, 1].map(|k| totals(k, &|r| r.dead_nodes.len() as u64));
    let lost = [0, 1].map(|k| totals(k, &|r| r.lost()));
    let mut reps_table = Table::new(&[
        "repetition",
        "run",
        "steady_p99_us",
        "disruption_p99_us",
        "p99_disruption_vs_steady",
        "slow_requests",
        "slow_to_victim_shards",
        "moves",
        "node_deaths",
        "lost_calls",
        "antagonist_alloc_mib_per_s",
    ]);
    for (i, (pair, heads)) in pairs.iter().zip(&heads_all).enumerate() {
        for (r, h) in pair.iter().zip(heads) {
            let slow = h.slow(r);
            reps_table.row(vec![
                Cell::from((i + 1) as f64),
                Cell::from(r.label),
                opt(h.steady_p99()),
                opt(h.disruption_p99()),
                opt(h.ratio()),
                slow.map_or(Cell::from(f64::NAN), |(a, b)| Cell::from((a + b) as f64)),
                slow.map_or(Cell::from(f64::NAN), |(a, _)| Cell::from(a as f64)),
                Cell::from(r.moves() as f64),
                Cell::from(r.dead_nodes.len() as f64),
                Cell::from(r.lost() as f64),
                opt(r.antagonist_alloc_rate()),
            ]);
        }
    }
    let Some((runs, heads)) = pairs.into_iter().zip(heads_all).nth(shown) else {
        bail!("no repetition ran");
    };

    // The timeline table.
    let mut table = Table::new(&[
        "run",
        "phase",
        "t_ms",
        "requests",
        "lost",
        "p50_us",
        "p99_us",
        "gen_lag_p99_us",
        "victim_mem_mib",
        "victim_cgroup_mib",
        "moves",
        "moves_all_nodes",
        "victim_pressure",
        "shards_on_victim",
        "shards_by_node",
    ]);
    let mut rows_by_run = Vec::new();
    for r in &runs {
        let rows = windows(r, &p);
        for w in &rows {
            table.row(vec![
                Cell::from(r.label),
                Cell::from(w.phase),
                w.t_ms.into(),
                w.requests.into(),
                w.lost.into(),
                Cell::from(w.p50_us),
                Cell::from(w.p99_us),
                Cell::from(w.gen_lag_p99_us),
                Cell::from(w.victim_mem_mib),
                Cell::from(w.victim_cgroup_mib),
                Cell::from(w.moves),
                Cell::from(w.moves_all),
                Cell::from(w.victim_pressure.map(u64::from)),
                Cell::from(w.shards_victim),
                Cell::from(w.shards_by_node.as_str()),
            ]);
        }
        rows_by_run.push(rows);
    }

    // The headline table.
    let mut head = Table::new(&[
        "run",
        "steady_p50_us",
        "steady_p99_us",
        "disruption_p99_us",
        "disruption_p999_us",
        "p99_disruption_vs_steady",
        "disruption_window_ms",
        "steady_gen_lag_p99_us",
        "disruption_gen_lag_p99_us",
        "moves_out_of_victim",
        "moves_out_of_others",
        "moves_before_antagonist",
        "first_move_ms",
        "last_move_ms",
        "victim_peak_mib",
        "antagonist_growth_mib_per_s",
        "node_deaths",
        "lost_calls",
        "value_mismatches",
        "target_rate",
        "achieved_rate",
        "antagonist",
    ]);
    for (r, h) in runs.iter().zip(&heads) {
        let mt = r.move_times();
        head.row(vec![
            Cell::from(r.label),
            us(h.steady.p(0.5)).into(),
            h.steady_p99().into(),
            opt(h.disruption_p99()),
            opt(h.disruption_p999()),
            opt(h.ratio()),
            Cell::from(h.window.map(|(a, b)| (b - a) as f64 / 1e6)),
            opt(r.lag_p99_in(r.steady(&p))),
            opt(h.window.map_or(f64::NAN, |w| r.lag_p99_in(w))),
            r.moves().into(),
            r.moves_others().into(),
            r.moves_before_antagonist().into(),
            Cell::from(mt.map(|m| ms_after_antagonist(r, m.0))),
            Cell::from(mt.map(|m| ms_after_antagonist(r, m.1))),
            (r.victim_peak() as f64 / (1 << 20) as f64).into(),
            opt(r.antagonist_rate()),
            (r.dead_nodes.len() as u64).into(),
            r.lost().into(),
            r.mismatches().into(),
            p.rate.into(),
            r.achieved_rate().into(),
            Cell::from(r.antagonist.as_ref().map_or_else(
                || "skipped (no memory cgroup of its own)".to_string(),
                |a| a.status.clone(),
            )),
        ]);
    }

    // The plot: one log axis, units in the series names.
    let secs = |ns: u64| ns as f64 / 1e9;
    let mut plot = Plot::line("Memory antagonist on one node: p99 latency, victim memory, moves")
        .x_label(format!(
            "time since load start (s), 250 ms windows by intended start; the antagonist starts at {:.2} s",
            (p.warmup + p.steady).as_secs_f64()
        ))
        .y_label("p99 (ms) · victim memory (×100 MiB) · moves (count)")
        .log_y(true)
        .size(1024, 800);
    let names = ["Granule", "throttled (600 MB/s after 200 ms)"];
    for (k, rows) in rows_by_run.iter().enumerate() {
        let name = names[k];
        let mid = |w: &WindowRow| (w.t_ms + WINDOW.as_secs_f64() * 500.0) / 1e3;
        plot.push_series(
            format!("{name} p99 (ms)"),
            rows.iter()
                .filter_map(|w| w.p99_us.map(|v| (mid(w), v / 1e3)))
                .collect::<Vec<_>>(),
        );
        plot.push_series(
            format!("{name} victim memory (×100 MiB)"),
            rows.iter()
                .filter_map(|w| w.victim_mem_mib.map(|m| (mid(w), m / 100.0)))
                .collect::<Vec<_>>(),
        );
        plot.push_series(
            format!("{name} moves out of the victim"),
            rows.iter()
                .filter_map(|w| w.moves.map(|m| (mid(w), m as f64)))
                .collect::<Vec<_>>(),
        );
    }
    let steady_ms = heads[0].steady_p99() / 1e3;
    if steady_ms.is_finite() && steady_ms > 0.0 {
        plot = plot.hline(
            TARGET_RATIO * steady_ms,
            format!("target: {TARGET_RATIO}× Granule steady p99 (ms)"),
        );
    }

    // Victim memory in its own units.
    let mut mem_plot =
        Plot::line("Victim node memory (its cgroup's usage, read every 50 ms; else resident)")
            .x_label("time since load start (s)")
            .y_label("MiB");
    for (k, r) in runs.iter().enumerate() {
        // The cgroup file read every 50 ms when there is one, else the heartbeats' figure.
        mem_plot.push_series(
            format!("{}: victim memory", names[k]),
            r.samples
                .iter()
                .filter_map(|s| {
                    let reported = s.nodes.iter().find(|n| n.id == r.victim).map(|n| n.mem);
                    let m = s.victim_cgroup.or(reported)?;
                    Some((secs(s.t_ns), m as f64 / (1 << 20) as f64))
                })
                .collect::<Vec<_>>(),
        );
        mem_plot.push_series(
            format!("{}: shards on the victim (×10)", names[k]),
            r.victim_series()
                .map(|(t, n)| (secs(t), f64::from(n.shards) * 10.0))
                .collect::<Vec<_>>(),
        );
    }
    mem_plot = mem_plot.hline(runs[0].victim_limit as f64 / (1 << 20) as f64, "limit");

    // Provenance.
    let placement = format!(
        "two vCPUs stand for the rack. vCPU 1 is the victim's machine: the victim node process and the antagonist. \
vCPU 0 is the rest: the driver process (embedded controller, the driver node hosting no shard, the load generator \
thread and one tokio worker thread running the calls in flight, both SCHED_FIFO when allowed ({}), a sampler \
thread) and the other {} node processes, \
which receive the shed shards. Nodes are {} (worker threads = ceil(cpu)). So the antagonist's page faulting and \
the kernel's OOM kill disturb only the node they share a machine with, while what shedding costs elsewhere \
(receiving and decoding shards) is inside the measurement. On a machine with fewer vCPUs nothing is pinned.",
        if FIFO_REFUSED.load(Ordering::Relaxed) { "refused here: normal priority" } else { "granted here" },
        p.nodes - 1,
        p.node_spec()
    );
    let mut meta = Meta::collect(placement, opts.quick);
    let r0 = &runs[0];
    meta.note(format!(
        "cluster: {} × `{}` plus the driver `cpu=1,mem=1GiB`; memory accounting: {}",
        p.nodes,
        p.node_spec(),
        if r0.cgroup_reported {
            "each node's own memory cgroup (limit = its spec's memory; the cgroup's usage includes the antagonist)"
        } else if r0.cgroups {
            "nodes run in memory cgroups, but their heartbeats report no cgroup limit (budget accounting)"
        } else {
            "budget (no memory cgroups): the antagonist phase is skipped"
        }
    ));
    let mut rep = Report::new("pressure", meta);
    rep.title("Memory pressure: shedding shards away from a memory antagonist");
    rep.note(format!(
        "data: {} memory proclets (`HashMap<u64, ByteBuf>`, {VALUE_LEN} B values serialized as byte strings, \
         exact `Footprint`), {} keys, \
         {:.1} MiB in all (shards {:.2}–{:.2} MiB); placed by the controller: {}",
        p.shards,
        p.keys(),
        r0.data_bytes as f64 / (1 << 20) as f64,
        r0.shard_bytes_min as f64 / (1 << 20) as f64,
        r0.shard_bytes_max as f64 / (1 << 20) as f64,
        runs.iter()
            .map(|r| format!(
                "{}: {} (victim {})",
                r.label,
                r.placement
                    .iter()
                    .map(|(n, c)| format!("{n}={c}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                r.victim
            ))
            .collect::<Vec<_>>()
            .join("; ")
    ));
    rep.note(format!(
        "load: open loop at {} req/s, {GET_PERCENT} % GET / {} % SET, uniform keys; request i is due at t0 + i/rate and \
         its latency runs from that intended start to completion (coordinated-omission-safe); timeline windows of \
         {} ms by intended start; warm-up {:?}, steady {:?}, then the antagonist, then at least {:?} after the later \
         of its exit and the last move. Steady p99 = p99 over the steady phase; disruption p99 = p99 over \
         [antagonist start, max(antagonist exit, last move out of the victim) + 1 s]. Lost = errors + never \
         completed (drain {:?}). Node memory and moves are sampled every {} ms from the controller (nodes \
         heartbeat every 100 ms), so move times are late by up to ~150 ms.",
        p.rate,
        100 - GET_PERCENT,
        WINDOW.as_millis(),
        p.warmup,
        p.steady,
        p.after,
        p.drain,
        SAMPLE_EVERY.as_millis()
    ));
    rep.note(format!(
        "antagonist: `granule antagonist memory --node <victim> --rate {} --size <victim limit + {} MiB> --hold {:?} \
         --controller <addr>` (it joins the victim's memory cgroup and makes itself the OOM killer's preferred \
         victim). Baseline: the same run with migration.throttle={BASELINE_THROTTLE} and \
         migration.delay={BASELINE_DELAY} set on the second cluster's builder (its nodes get them in their boot payload).",
        p.antagonist_rate,
        p.antagonist_extra >> 20,
        p.hold
    ));
    for (r, h) in runs.iter().zip(&heads) {
        let a = match &r.antagonist {
            Some(a) => format!(
                "antagonist from {:.2} s to {:.2} s, {}{}",
                a.start_ns as f64 / 1e9,
                a.exit_ns as f64 / 1e9,
                a.status,
                if a.applied {
                    ""
                } else {
                    " (FAILED: it applied no pressure, so no disruption figure is computed)"
                }
            ),
            None => "antagonist skipped: the victim runs in no memory cgroup of its own".into(),
        };
        rep.note(format!(
            "{}: {a}; {} requests issued ({:.0}/s achieved of {} targeted; generator lag p99 {:.0} µs, max {:.1} ms), \
             {} errors, {} never completed, {} value mismatches; moves out of the victim {}, out of the other nodes {} (for CPU \
             pressure), before the antagonist {}; node processes dead at the end: {}; OOM kills inside the victim's cgroup ({}): {}",
            r.label,
            r.issued,
            r.achieved_rate(),
            p.rate,
            us(r.gen.lag.p(0.99)),
            r.gen.lag.max().as_secs_f64() * 1e3,
            r.error_count,
            r.issued.saturating_sub(r.recs.len() as u64),
            r.mismatches(),
            r.moves(),
            r.moves_others(),
            r.moves_before_antagonist(),
            if r.dead_nodes.is_empty() {
                "none".to_string()
            } else {
                r.dead_nodes
                    .iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            r.victim_cgroup_dir
                .as_ref()
                .map_or_else(|| "none".to_string(), |d| d.display().to_string()),
            r.victim_oom_kills
                .map_or_else(|| "unknown".to_string(), |k| k.to_string()),
        ));
        if !r.errors.is_empty() {
            rep.note(format!(
                "{}: first errors returned to callers: {}",
                r.label,
                r.errors.join(" | ")
            ));
        }
        if let (Some((on_victim, others)), Some(threshold)) = (h.slow(r), h.slow_threshold()) {
            let n = h.disruption.as_ref().map_or(0, |l| l.count());
            rep.note(format!(
                "{}: requests in the disruption window slower than 3× the steady p99 ({:.0} µs): {} of {} (the target allows 1 %, {}); {} to shards that started on the victim, {} to the others",
                r.label,
                us(threshold),
                on_victim + others,
                n,
                n / 100,
                on_victim,
                others
            ));
        }
        if let Some(a) = &r.antagonist {
            let tail: Vec<&str> = a.log.lines().rev().take(6).collect();
            if !tail.is_empty() {
                rep.note(format!(
                    "{}: antagonist output (last lines): {}",
                    r.label,
                    tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
                ));
            }
        }
    }
    let g = &heads[0];
    let b = &heads[1];
    let applied = runs[0].antagonist.as_ref().is_some_and(|a| a.applied);
    let target_met = applied && deaths[0] == 0.0 && lost[0] == 0.0 && g_median <= TARGET_RATIO;
    rep.note(format!(
        "repetitions: {reps}; Granule ratio per repetition {}, median {g_median:.2}; baseline {}, median {b_median:.2}; \
         the timeline, plots and per-run notes show repetition {} (the median one)",
        ratios.iter().map(|r| format!("{:.2}", r[0])).collect::<Vec<_>>().join(", "),
        ratios.iter().map(|r| format!("{:.2}", r[1])).collect::<Vec<_>>().join(", "),
        shown + 1,
        reps = ratios.len(),
    ));
    rep.note(format!(
        "judged target (Granule runs): under the antagonist no node process dies, no call is lost, disruption p99 ≤ \
         {TARGET_RATIO}× steady p99 (median over the repetitions): {}",
        if !applied {
            "not measured (no antagonist applied pressure)".to_string()
        } else if target_met {
            "met".to_string()
        } else {
            format!(
                "NOT met (node deaths {}, lost calls {}, median ratio {g_median:.2})",
                deaths[0], lost[0]
            )
        }
    ));
    rep.table(table);
    rep.extra_table("headline", head);
    rep.extra_table("repetitions", reps_table);
    rep.plot(plot);
    rep.extra_plot("victim_memory", mem_plot);

    let (r, q) = (&runs[0], &runs[1]);
    rep.summary("p99_disruption_vs_steady", g_median);
    rep.summary("node_oom_kills", deaths[0]);
    rep.summary("lost_calls", lost[0]);
    rep.summary("baseline_p99_disruption_vs_steady", b_median);
    rep.summary("baseline_node_oom_kills", deaths[1]);
    rep.summary("baseline_lost_calls", lost[1]);
    let (min, max) = (
        |s: &Option<Summary>| s.as_ref().map_or(f64::NAN, |s| s.min),
        |s: &Option<Summary>| s.as_ref().map_or(f64::NAN, |s| s.max),
    );
    rep.summary("p99_disruption_vs_steady_min", min(&g_spread));
    rep.summary("p99_disruption_vs_steady_max", max(&g_spread));
    rep.summary("baseline_p99_disruption_vs_steady_min", min(&b_spread));
    rep.summary("baseline_p99_disruption_vs_steady_max", max(&b_spread));
    rep.summary("repetitions", ratios.len() as f64);
    rep.summary("steady_p99_us", g.steady_p99());
    rep.summary("disruption_p99_us", g.disruption_p99());
    rep.summary("disruption_p999_us", g.disruption_p999());
    rep.summary("baseline_steady_p99_us", b.steady_p99());
    rep.summary("baseline_disruption_p99_us", b.disruption_p99());
    rep.summary("baseline_disruption_p999_us", b.disruption_p999());
    rep.summary("moves", r.moves() as f64);
    rep.summary("baseline_moves", q.moves() as f64);
    rep.summary("moves_other_nodes", r.moves_others() as f64);
    rep.summary("baseline_moves_other_nodes", q.moves_others() as f64);
    rep.summary(
        "moves_before_antagonist",
        r.moves_before_antagonist() as f64,
    );
    rep.summary(
        "baseline_moves_before_antagonist",
        q.moves_before_antagonist() as f64,
    );
    rep.summary("value_mismatches", r.mismatches() as f64);
    rep.summary("baseline_value_mismatches", q.mismatches() as f64);
    rep.summary("target_rate", p.rate);
    rep.summary("achieved_rate", r.achieved_rate());
    rep.summary("baseline_achieved_rate", q.achieved_rate());
    rep.summary("cgroups_used", if r.cgroup_reported { 1.0 } else { 0.0 });
    rep.summary("antagonist_ran", if applied { 1.0 } else { 0.0 });
    rep.summary(
        "baseline_antagonist_ran",
        if q.antagonist.as_ref().is_some_and(|a| a.applied) {
            1.0
        } else {
            0.0
        },
    );
    rep.summary(
        "antagonist_killed",
        if r.antagonist.as_ref().is_some_and(|a| a.killed) {
            1.0
        } else {
            0.0
        },
    );
    rep.summary("victim_peak_mib", r.victim_peak() as f64 / (1 << 20) as f64);
    rep.summary("antagonist_alloc_mib_per_s", r.antagonist_alloc_rate());
    rep.summary(
        "baseline_antagonist_alloc_mib_per_s",
        q.antagonist_alloc_rate(),
    );
    rep.summary("antagonist_growth_mib_per_s", r.antagonist_rate());
    rep.summary("baseline_antagonist_growth_mib_per_s", q.antagonist_rate());
    rep.summary("target_met", if target_met { 1.0 } else { 0.0 });
    let dir = rep.write(&opts.out)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn antagonist_progress_lines_parse() {
        assert_eq!(
            parse_progress("allocated 640 MiB in 1250 ms (512 MiB/s)"),
            Some((640.0, 1250.0))
        );
        assert_eq!(parse_progress("allocated 64 MiB"), None);
        assert_eq!(parse_progress("holding 640 MiB for 3.0s"), None);
    }

    #[test]
    fn values_check_against_their_key_and_version() {
        let v = value(42, 3);
        assert_eq!(v.len(), VALUE_LEN);
        assert_eq!(v.capacity(), VALUE_LEN);
        assert!(check(42, Some(&v), 3));
        assert!(check(42, Some(&v), 7));
        assert!(!check(42, Some(&v), 2), "a version never issued");
        assert!(!check(43, Some(&v), 3), "another key's value");
        assert!(!check(42, None, 3));
        let mut bad = v.clone();
        bad[500] ^= 1;
        assert!(!check(42, Some(&bad), 3));
        assert_ne!(value(42, 3), value(42, 4));
    }

    #[test]
    fn keys_spread_over_shards_and_footprints_are_exact_enough() {
        let spec = ShardSpec {
            index: 1,
            shards: 8,
            keys: 8 * 500,
        };
        let s = build_shard(spec);
        assert!(s.map.len() > 400 && s.map.len() < 600, "{}", s.map.len());
        assert!(s.map.keys().all(|k| shard_of(*k, 8) == 1));
        let data = s.map.len() as u64 * VALUE_LEN as u64;
        let f = s.footprint();
        assert!(
            f > data && f < data + data / 5,
            "footprint {f}, values {data}"
        );
    }

    #[test]
    fn params_fit_the_machine() {
        for quick in [false, true] {
            let p = Params::new(quick);
            let per_shard = p.keys_per_shard() * (VALUE_LEN as u64 + ENTRY_OVERHEAD);
            assert!(per_shard <= p.shard_bytes);
            // Each node holds its share of the data with lots of room left.
            let share = p.shard_bytes * u64::from(p.shards) / p.nodes as u64;
            assert!(share * 4 < p.node_mem);
        }
    }
}
