//! Granule's one typed configuration.
//!
//! Every setting of a Granule process lives in [`Config`], in sections named by what
//! they tune: [`Cluster`] (nodes, the controller, membership timing, cgroups, the
//! dashboard, logging), [`Node`] (its threads, its file descriptors), [`Transport`]
//! (connections, waiting for replies), [`Http`] (the bounds of every HTTP listener), [`Migration`] (moving and streaming state), [`Pressure`] (the monitor and
//! the shedding policy), [`Faults`] (fault injection, for tests), [`Market`] (the memory
//! market), [`Fs`] (the scavenging file system) and [`Pushdown`] (the pool that runs
//! pushed calls next to their data). The table
//! [`SETTINGS`] names each one once: its key (`migration.throttle`), its environment
//! variable (`GRANULE_MIGRATION_THROTTLE`), what it accepts and what it does. Loading,
//! the TOML file, the environment, `Config::set`, error messages, `granule config` and
//! the test that keeps `docs/guide/configuration.md` complete all work from that table.
//!
//! **Precedence** (lowest first): the defaults; the TOML file named by `GRANULE_CONFIG`
//! (or given in code); the `GRANULE_*` environment variables; what the program sets in
//! code (`ClusterBuilder`) or a command's flags. A bad value is an error naming the
//! setting, where the value came from, and what it accepts — never ignored, never
//! silently replaced by a default.
//!
//! A driver hands its whole configuration to the node processes it starts (inside their
//! boot payload), so a node never reads scattered environment variables of its own.
//!
//! This crate parses and validates; it reads the environment and the configuration file
//! when asked to ([`Config::load`]), and nothing else: it starts nothing and knows nothing
//! of proclets.
#![forbid(unsafe_code)]

mod parse;
mod settings;

pub use parse::{
    check_listen_host, format_duration, format_size, format_spec, parse_duration, parse_rate,
    parse_size, parse_spec, parse_specs, parse_switch,
};
pub use settings::{setting, Setting, SETTINGS};

use granule_wire::NodeSpec;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

/// The environment variable that names a TOML configuration file.
pub const CONFIG_FILE_ENV: &str = "GRANULE_CONFIG";

/// Every setting of a Granule process.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub cluster: Cluster,
    pub node: Node,
    pub transport: Transport,
    pub http: Http,
    pub migration: Migration,
    pub pressure: Pressure,
    pub faults: Faults,
    pub market: Market,
    pub fs: Fs,
    pub pushdown: Pushdown,
}

/// The cluster: its nodes, its controller, membership timing, cgroups, the dashboard,
/// logging.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Node processes an embedded cluster starts (ignored when joining a controller).
    pub nodes: Vec<NodeSpec>,
    /// The driver's own node spec.
    pub driver: NodeSpec,
    /// Join the cluster of this controller (`host:port`) instead of starting one.
    pub controller: Option<String>,
    /// The address nodes listen on.
    pub listen_host: String,
    /// Silence after which the controller declares a node dead.
    pub failure_timeout: Duration,
    /// How often nodes send heartbeats.
    pub heartbeat: Duration,
    /// How long a driver waits for the node processes it started to register.
    pub start_timeout: Duration,
    /// Whether the driver of an embedded cluster replaces its node processes that end
    /// (killed, crashed, or declared dead by the controller, which the driver then
    /// kills): a new process with the same spec joins as a new node, so the cluster
    /// keeps its configured size.
    pub replace_dead: bool,
    /// Whether a node process the controller declared dead while it still ran (it was
    /// stopped, or cut off) rejoins as a new node, with a new id and no proclets, when
    /// it finds out; off: it exits. Applies to nodes no driver replaces: hand-started
    /// ones, and embedded ones when `replace_dead` is off.
    pub rejoin: bool,
    /// How long a dead or departed node stays in the node list (`Cluster::nodes`,
    /// `granule status`, the dashboard) after it died or left; then the list forgets it.
    /// The controller keeps what it needs longer: calls to the proclets the node held
    /// still fail as unreachable rather than unknown, and its id is never given again.
    pub forget_dead_after: Duration,
    /// Whether node processes run in cgroup v1 groups limited to their spec.
    pub cgroups: CgroupsMode,
    /// The CFS period of the node groups Granule creates: a group that used its quota
    /// early in a period is frozen until the period ends, so the period bounds the stall
    /// a throttled node's calls see.
    pub cfs_period: Duration,
    /// Where an embedded or standalone controller serves its dashboard, `/api/cluster`
    /// and `/metrics` (`IP:PORT`, port 0 = a free one); `None`: not at all.
    pub dashboard: Option<String>,
    /// The log filter (`warn`, `info`, `granule_runtime=debug`, ...).
    pub log: String,
}

impl Default for Cluster {
    fn default() -> Self {
        let one = NodeSpec {
            cores: 1.0,
            mem_bytes: 1 << 30,
        };
        Cluster {
            nodes: vec![one; 2],
            driver: one,
            controller: None,
            listen_host: "127.0.0.1".into(),
            failure_timeout: Duration::from_secs(1),
            heartbeat: Duration::from_millis(100),
            start_timeout: Duration::from_secs(30),
            replace_dead: true,
            rejoin: true,
            forget_dead_after: Duration::from_secs(60),
            cgroups: CgroupsMode::Auto,
            cfs_period: Duration::from_millis(20),
            dashboard: Some("127.0.0.1:0".into()),
            log: "warn".into(),
        }
    }
}

/// Whether node processes get real limits (cgroup v1 groups with their spec's memory
/// limit and CPU quota).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CgroupsMode {
    /// Never: budgets are only accounted (reported in heartbeats, used by the monitor).
    Off,
    /// When cgroup v1 is usable here (root, memory and cpu controllers mounted);
    /// otherwise warn once and go on without.
    #[default]
    Auto,
}

/// A node's own threads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The scheduler slice a node's threads ask for; `None`: the kernel's default.
    ///
    /// Why: a node's worker sleeps until a call arrives. On a core it shares with a
    /// CPU-bound process (a co-located tenant, a memory antagonist faulting in pages),
    /// Linux's EEVDF scheduler may let that process finish its slice first (1.4 ms here,
    /// ended at a 4 ms tick, HZ=250, in a kernel without preemption): calls waited up to
    /// ~4 ms. A thread that asks for a shorter slice gets an earlier deadline and preempts
    /// on wake-up (Linux 6.12+; older kernels accept and ignore the request). Its CPU share
    /// is unchanged: it is only cut into shorter pieces. Long computations (`cpu_bound`)
    /// go back to the default slice while they run. Measured in `granule-bench pressure`.
    pub worker_slice: Option<Duration>,
    /// File descriptors kept free for cluster traffic (connections to and from peers, the
    /// controller, state streams): a process's HTTP listeners refuse a connection that
    /// would leave fewer free below its limit (`RLIMIT_NOFILE`, which a node raises to
    /// the hard limit at start), so no HTTP client can cut a node off from its cluster.
    pub fd_reserve: u64,
}

impl Default for Node {
    fn default() -> Self {
        Node {
            worker_slice: Some(Duration::from_micros(100)),
            fd_reserve: 256,
        }
    }
}

/// The bounds of every HTTP listener of a Granule process (a node's `/metrics`, a
/// service front door, the controller's dashboard), each on its own.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Http {
    /// Connections one listener serves at once; a connection beyond is answered 503 and
    /// closed at once (never queued).
    pub max_connections: u64,
    /// A connection must send a request's complete headers within this time of opening,
    /// or of the first byte of its next request (a slow client holds no slot for long).
    pub header_timeout: Duration,
    /// A connection with no request running and no bytes moving for this long is closed
    /// (idle keep-alive connections, clients that stop reading their answer).
    pub idle_timeout: Duration,
}

impl Default for Http {
    fn default() -> Self {
        Http {
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Connections between Granule processes, and waiting for replies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Transport {
    /// Largest frame accepted after the handshake, bytes.
    pub max_frame: u64,
    /// Requests that may await a response at once on one connection.
    pub max_in_flight: u64,
    /// Incoming requests served at once on one connection (beyond, the reader stops
    /// reading: TCP pushes back on the sender).
    pub max_incoming: u64,
    /// Time allowed for connecting and for the hello exchange.
    pub handshake_timeout: Duration,
    /// How long a thread waiting for a reply polls before it sleeps: about the cost of
    /// waking a sleeping thread on another vCPU of this class of VM (spinning longer
    /// cannot pay off, spinning less wastes most replies about to arrive).
    pub spin: Duration,
}

impl Default for Transport {
    fn default() -> Self {
        Transport {
            max_frame: granule_wire::DEFAULT_MAX_FRAME as u64,
            max_in_flight: 4096,
            max_incoming: 4096,
            handshake_timeout: Duration::from_secs(5),
            spin: Duration::from_micros(50),
        }
    }
}

/// Moving proclets, and streaming their state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Migration {
    /// Pace transfers to this many bytes per second (a slow-migration baseline); `None`:
    /// as fast as the network allows.
    pub throttle: Option<u64>,
    /// Wait this long before starting each move (a slow-to-react baseline).
    pub delay: Duration,
    /// The share of the time a *shedding* move may keep the node's CPU busy encoding and
    /// sending; its encoder rests in proportion to its work after every chunk (1 = no
    /// pacing).
    ///
    /// Why: a node sheds because something else on its machine is taking memory, and that
    /// something usually takes CPU too. The scheduler (EEVDF) shares a core by recent
    /// use: after a millisecond-long burst of encoding, the node's group has had more than
    /// its share, and a call arriving then waits while the other process runs its whole
    /// slice (traced: waits of 1–2 ms). Resting keeps the node under its share, so its
    /// workers keep preempting on wake-up. Moves the program or an operator asks for are
    /// not paced; nor are byte-vector states, which are not encoded. Measured in `granule
    /// bench pressure`: disruption p99 ÷ steady p99 1.96 and 2.44 with 0.5, 3.52 and 2.89
    /// without; each shedding move takes about twice as long to encode.
    pub duty: f64,
    /// Nice value of the threads that decode arriving states: below the node's workers,
    /// so a worker woken by a call preempts a decoder at once, yet heavy enough (weight
    /// 335 against 1024) that a CPU-bound neighbour cannot starve a move.
    pub nice: i32,
    /// Size of one chunk of a state stream, bytes.
    pub chunk: u64,
    /// Chunks in flight at once (bounds the memory a stream holds besides the state).
    pub window: u64,
    /// A stream whose receiver has not acknowledged a chunk for this long is abandoned
    /// (a destination that hangs, or is cut off, must not hold a proclet's calls for
    /// ever). The last chunk is acknowledged once the state is decoded and installed, so
    /// this also bounds decoding: a move abandoned that way is safe (the late copy is
    /// withdrawn) but wasted.
    pub stall_timeout: Duration,
}

impl Default for Migration {
    fn default() -> Self {
        Migration {
            throttle: None,
            delay: Duration::ZERO,
            duty: 0.5,
            nice: 5,
            chunk: 512 << 10,
            window: 8,
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// The resource monitor and the pressure policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pressure {
    /// Whether nodes move proclets away on their own under pressure.
    pub shed: bool,
    /// Memory sampling interval.
    pub mem_interval: Duration,
    /// CPU sampling interval.
    pub cpu_interval: Duration,
    /// Memory pressure below this much free memory; `None`: 10 % of the node's limit, at
    /// least 32 MiB and at most 256 MiB (at 1 GiB/s of growth that leaves 30–250 ms to
    /// react, several moves' worth on this machine).
    pub mem_free_min: Option<u64>,
    /// Memory pressure also when free memory would last less than this at the current
    /// growth rate (shedding then starts while memory is still plentiful, so moves run at
    /// full speed instead of against a cgroup that is reclaiming at its limit).
    pub mem_horizon: Duration,
    /// CPU pressure above this fraction of throttled CFS periods.
    pub cpu_throttled_max: f64,
    /// CPU pressure above this run-queue delay per core (seconds the node's threads spent
    /// runnable but waiting, per second and per core of its spec; 1.0: on average a whole
    /// thread per core kept waiting).
    pub runq_delay_max: f64,
    /// Time constant of the per-proclet CPU average.
    pub cpu_window: Duration,
    /// A compute proclet holding at least 1 MiB should use at least this many cores per
    /// MiB, or the node warns that it looks like a memory or hybrid proclet.
    pub compute_min_cores_per_mib: f64,
    /// A memory proclet should use at most this many cores per MiB, or the node warns
    /// that it looks like a compute or hybrid proclet.
    pub memory_max_cores_per_mib: f64,
}

impl Default for Pressure {
    fn default() -> Self {
        Pressure {
            shed: true,
            mem_interval: Duration::from_millis(5),
            cpu_interval: Duration::from_millis(20),
            mem_free_min: None,
            mem_horizon: Duration::from_secs(2),
            cpu_throttled_max: 0.2,
            runq_delay_max: 1.0,
            cpu_window: Duration::from_secs(1),
            compute_min_cores_per_mib: 0.1,
            memory_max_cores_per_mib: 0.001,
        }
    }
}

impl Pressure {
    /// The free-memory threshold for a node whose limit is `limit` bytes.
    pub fn free_min_for(&self, limit: u64) -> u64 {
        self.mem_free_min
            .unwrap_or_else(|| (limit / 10).clamp(32 << 20, 256 << 20))
    }
}

/// Fault injection, for tests: off in production.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Faults {
    /// Whether a node accepts fault-injection orders (transport filter rules, failpoints)
    /// from its cluster's driver. Off, they are refused.
    pub enabled: bool,
    /// Failpoints armed from the start: `name=action;name=action` (see the runtime's
    /// `failpoint` module for names and actions).
    pub failpoints: String,
}

/// How the harvester chooses when to take memory and when to give it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HarvestPolicy {
    /// Memtrade's: compare the workload's recent p99 (an application metric, or the
    /// anonymous swap-in rate) with a baseline from swap-free periods.
    Baseline,
    /// Senpai/TMO's: probe the limit down while memory stall time (PSI) stays under a
    /// target, back off in proportion to stall.
    Psi,
}

impl HarvestPolicy {
    pub fn name(self) -> &'static str {
        match self {
            HarvestPolicy::Baseline => "baseline",
            HarvestPolicy::Psi => "psi",
        }
    }
}

/// The memory market: the producer's harvester and stores, the broker, the consumer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Market {
    // ---- harvester ----
    /// Which control law harvests.
    pub policy: HarvestPolicy,
    /// How much one step lowers the workload's memory limit.
    pub chunk: u64,
    /// Time between two steps (the effect of one step shows before the next).
    pub cooling_period: Duration,
    /// How long the harvester watches before its first step: the workload's referenced
    /// bits are cleared when it starts, so the first steps evict pages unused for this
    /// long rather than pages merely unused since the last moment.
    pub observe: Duration,
    /// A drop: the recent p99 worse than the baseline's p99 by more than this fraction.
    pub slowdown_threshold: f64,
    /// How long a baseline sample is kept.
    pub baseline_window: Duration,
    /// Where a producer stores the record of what it changed on the machine (limits,
    /// swap, zswap), so the next start undoes it after a SIGKILL.
    pub state_dir: String,
    /// A severe drop: worse than every baseline sample for this many epochs in a row.
    pub severe_epochs: u32,
    /// Prefetch swapped-out memory on a severe drop or a burst.
    pub prefetch: bool,
    /// The psi policy's memory stall target (stall seconds per second).
    pub psi_target: f64,
    /// Free swap and memory that must remain after a harvesting step.
    pub headroom: u64,
    /// Without an application metric: the refault rate (pages/s) that counts as a drop.
    pub swapin_tolerance: f64,
    /// A burst: a refault rate (pages/s) over a quarter second above this.
    pub burst_swapin: f64,
    /// The swap file to create when the machine has none (`None`: never create one).
    pub swap_file: Option<String>,
    /// Its size.
    pub swap_size: u64,
    /// Turn zswap on while producing.
    pub zswap: bool,
    /// zswap's largest pool, percent of RAM, while producing.
    pub zswap_pool_percent: u32,
    /// The performance signal: `swapin`, `socket:PATH` or `http:URL`.
    pub metric: String,
    // ---- harvester: more settings go here ----

    // ---- stores ----
    /// The unit of leasing.
    pub slab: u64,
    /// Connections one store serves at once.
    pub store_max_connections: u64,
    /// The largest bulk string (key or value) a store accepts.
    pub store_max_bulk: u64,
    /// The most arguments in one command a store accepts.
    pub store_max_args: u64,
    /// Default per-lease token-bucket rate, bytes per second (0: unlimited).
    pub store_rate: u64,
    /// How long a no-eviction lease's holder has to move its data after a revocation
    /// notice, before its store is dropped.
    pub revoke_grace: Duration,
    /// How long a store's connection may stay without authenticating before it is closed.
    pub store_auth_timeout: Duration,
    /// Connections of one store not yet authenticated: past this many (or when all of
    /// `store_max_connections` are open), a new connection closes the oldest of them that
    /// had a tenth of `store_auth_timeout` to authenticate. Strangers cannot hold the
    /// lease holder's room; a client opening many connections at once is not cut off.
    pub store_max_unauthenticated: u64,
    // ---- stores: more settings go here ----

    // ---- broker ----
    /// The broker to reach (`host:port`); empty: the cluster's controller.
    pub broker: Option<String>,
    /// How often producers report availability.
    pub report_interval: Duration,
    /// Lease length when a consumer does not say.
    pub lease_time: Duration,
    /// Reference price of memory, per GiB-hour (e.g. a spot instance's price divided by
    /// its memory); the broker's price starts at a quarter of it.
    pub spot_price: f64,
    /// How often the broker moves its price.
    pub price_period: Duration,
    /// How far one price move goes, as a fraction of the current price.
    pub price_step: f64,
    /// How often the broker refits each producer's availability predictor.
    pub refit_period: Duration,
    /// The order p of the availability predictor, ARIMA(p,1,0).
    pub ar_order: u64,
    /// How far ahead the broker predicts a producer's availability (the longest lease
    /// term it checks against the prediction).
    pub prediction_horizon: Duration,
    /// Silence after which the broker treats a producer as gone (its leases lost).
    pub producer_timeout: Duration,
    /// Requests the broker's FIFO queue holds at most.
    pub max_queue: u64,
    // ---- broker: more settings go here ----

    // ---- consumer ----
    /// How a consumer protects values: `encrypt` (AEAD), `integrity` (keyed BLAKE3) or
    /// `none`.
    pub protection: String,
    /// How long a consumer waits for one leased store's answer before counting a miss.
    pub store_timeout: Duration,
    /// Slabs a consumer's cache leases.
    pub consumer_slabs: u32,
    // ---- consumer: more settings go here ----
}

impl Default for Market {
    fn default() -> Self {
        Market {
            policy: HarvestPolicy::Baseline,
            chunk: 64 << 20,
            cooling_period: Duration::from_secs(5),
            observe: Duration::from_secs(30),
            slowdown_threshold: 0.01,
            baseline_window: Duration::from_secs(300),
            state_dir: "/var/lib/granule".into(),
            severe_epochs: 3,
            prefetch: true,
            psi_target: 0.002,
            headroom: 256 << 20,
            swapin_tolerance: 100.0,
            burst_swapin: 5000.0,
            swap_file: Some("/var/lib/granule/harvest.swap".into()),
            swap_size: 4 << 30,
            zswap: true,
            zswap_pool_percent: 20,
            metric: "swapin".into(),
            slab: 64 << 20,
            store_max_connections: 1024,
            store_max_bulk: 16 << 20,
            store_max_args: 1 << 20,
            store_rate: 0,
            revoke_grace: Duration::from_secs(10),
            store_auth_timeout: Duration::from_secs(10),
            store_max_unauthenticated: 256,
            broker: None,
            report_interval: Duration::from_secs(1),
            lease_time: Duration::from_secs(600),
            spot_price: 0.0025,
            price_period: Duration::from_secs(60),
            price_step: 0.05,
            refit_period: Duration::from_secs(300),
            ar_order: 4,
            prediction_horizon: Duration::from_secs(600),
            producer_timeout: Duration::from_secs(10),
            max_queue: 10_000,
            protection: "encrypt".into(),
            store_timeout: Duration::from_secs(1),
            consumer_slabs: 1,
        }
    }
}

/// The scavenging file system (`granule fs mount`): striping, placement over own and
/// victim stores, the mount's caches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fs {
    /// Bytes per stripe: files are cut into stripes of this size, each placed on a store.
    pub stripe: u64,
    /// Copies of each stripe (2: a replica on the second store of the stripe's order).
    pub replicas: u32,
    /// Weight of the victim class in placement (the own class weighs 1).
    pub victim_weight: f64,
    /// Share of each own node's memory its stripe store may fill.
    pub own_share: f64,
    /// Whether the mount's own process (the cluster's driver, an own node) keeps a
    /// stripe store too, when its nodes are embedded ones that end with it.
    pub driver_store: bool,
    /// The mount's cache of stripes read (bytes).
    pub cache: u64,
    /// Stripes read ahead of a sequential reader.
    pub readahead: u32,
    /// Stripe writes in flight at once (write-behind).
    pub write_behind: u32,
    /// Bytes of partly written stripes the mount may keep buffered before it sends a
    /// file's buffers: a writer rewriting a buffered stripe costs no stripe round trip.
    pub dirty: u64,
    /// How often the mount probes each store it keeps stripes on (a victim with a
    /// `PING`, an own store with a no-op call), so a dead store is noticed without I/O
    /// to it.
    pub probe_every: Duration,
    /// Probes in a row a store may miss before it counts as lost (its stripes are then
    /// re-replicated from the copies that remain).
    pub probe_misses: u32,
    /// Where mounts record their status address (`granule fs status` reads it).
    pub state_dir: String,
}

impl Default for Fs {
    fn default() -> Self {
        Fs {
            stripe: 1 << 20,
            replicas: 1,
            victim_weight: 1.0,
            own_share: 0.75,
            driver_store: true,
            cache: 64 << 20,
            readahead: 8,
            write_behind: 8,
            dirty: 256 << 20,
            probe_every: Duration::from_secs(1),
            probe_misses: 3,
            state_dir: "/run/granule/fs".into(),
        }
    }
}

/// The pushdown pool of each node: the threads that run *pushed calls*
/// (`Proclet::push`), read-only closures shipped next to a proclet's data and run there
/// apart from the node's transport and ordinary calls, bounded in threads, queue, memory
/// and CPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pushdown {
    /// Threads of the pool; `None`: as many as the node's cores in its spec (rounded
    /// up), at least 1. Calls beyond them wait in the queue, in arrival order.
    pub threads: Option<u32>,
    /// Calls that may wait for a thread (or for memory) at once; one more is refused.
    pub queue: u64,
    /// The memory all running pushed calls of a node may reserve together (the sum of
    /// their budgets); `None`: a quarter of the node's memory in its spec. A call whose
    /// budget is larger can never run and is refused at once; one that does not fit now
    /// waits.
    pub memory: Option<u64>,
    /// The budget of a call that does not ask for one (`PushOpts::memory`): what its
    /// closure may reserve (`pushdown::reserve`). Never more than the pool's `memory`.
    pub call_memory: u64,
    /// A CPU cap on the pool, in cores (0.5: half of one core), enforced by a cpu cgroup
    /// of the pool's threads with a CFS quota; `None`: uncapped. The node's transport
    /// and ordinary calls are never capped by it.
    pub cpu_cap: Option<f64>,
    /// The memory a query's caller may take for a hash join's table it builds itself,
    /// for the shards it pulls (the pushed calls' tables come out of their own budgets).
    /// A build that needs more is refused with an error naming both budgets, and the
    /// cost rule pushes instead where it can.
    pub caller_build_memory: u64,
}

impl Default for Pushdown {
    fn default() -> Self {
        Pushdown {
            threads: None,
            queue: 256,
            memory: None,
            call_memory: 64 << 20,
            cpu_cap: None,
            caller_build_memory: 1 << 30,
        }
    }
}

impl Pushdown {
    /// The pool's threads on a node with `cores` cores in its spec.
    pub fn threads_for(&self, cores: f64) -> usize {
        match self.threads {
            Some(n) => (n as usize).max(1),
            None if cores.is_finite() && cores > 0.0 => (cores.ceil() as usize).max(1),
            None => 1,
        }
    }

    /// The pool's memory on a node with `mem_bytes` of memory in its spec.
    pub fn memory_for(&self, mem_bytes: u64) -> u64 {
        self.memory.unwrap_or(mem_bytes / 4)
    }

    /// The budget of a call that asks for none, on a node with `mem_bytes` of memory:
    /// `call_memory`, but no more than the pool's memory (so that, by default, every call
    /// can run).
    pub fn default_call_memory_for(&self, mem_bytes: u64) -> u64 {
        self.call_memory.min(self.memory_for(mem_bytes))
    }
}

/// Why a configuration was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A value the setting does not accept.
    #[error("{key}{from}: {why} (accepts {accepts})")]
    Value {
        /// The setting's key, e.g. `migration.throttle`.
        key: &'static str,
        /// Where the value came from, e.g. ` (GRANULE_MIGRATION_THROTTLE=fast)`.
        from: String,
        why: String,
        accepts: &'static str,
    },
    /// No setting has this name.
    #[error("unknown setting '{key}'{from}{hint}")]
    Unknown {
        key: String,
        from: String,
        /// ` (did you mean ...?)`, or empty.
        hint: String,
    },
    /// The configuration file could not be read or is not TOML.
    #[error("configuration file {path}: {why}")]
    File { path: String, why: String },
    /// Settings that cannot work together (or with this machine).
    #[error("{0}")]
    Invalid(String),
}

/// Where a value comes from, for error messages.
#[derive(Clone, Debug)]
pub enum Origin<'a> {
    /// A program's code (`Config::set`, `ClusterBuilder::set`).
    Code,
    /// An environment variable.
    Env(&'a str),
    /// A TOML file (its path, or `TOML` for text given in code).
    File(&'a str),
    /// A command-line flag.
    Flag(&'a str),
}

impl Origin<'_> {
    fn describe(&self, value: &str) -> String {
        match self {
            Origin::Code => format!(" (set in code to '{value}')"),
            Origin::Env(var) => format!(" ({var}={value})"),
            Origin::File(path) => format!(" (in {path}: '{value}')"),
            Origin::Flag(flag) => format!(" ({flag} {value})"),
        }
    }
}

/// Environment variables of earlier versions, refused with what replaced them (a value
/// that would otherwise be silently ignored).
const RENAMED: &[(&str, &str)] = &[
    ("GRANULE_SPIN_US", "GRANULE_SPIN (a duration, e.g. 50us)"),
    (
        "GRANULE_CFS_PERIOD_US",
        "GRANULE_CFS_PERIOD (a duration, e.g. 20ms)",
    ),
];

impl Config {
    /// The defaults, then the TOML file named by `GRANULE_CONFIG`, then the `GRANULE_*`
    /// environment variables; validated.
    pub fn load() -> Result<Config, ConfigError> {
        Config::load_from(|k| std::env::var(k).ok())
    }

    /// [`Config::load`] with the environment given as a function (for tests).
    pub fn load_from(var: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        Config::load_over(Config::default(), var)
    }

    /// [`Config::load_from`] over other defaults than the built-in ones (a program with
    /// defaults of its own, such as `granule demo`'s three nodes).
    pub fn load_over(
        mut base: Config,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        if let Some(path) = var(CONFIG_FILE_ENV).filter(|p| !p.trim().is_empty()) {
            base.apply_toml_file(Path::new(path.trim()))?;
        }
        base.apply_env(&var)?;
        base.validate()?;
        Ok(base)
    }

    /// Apply every `GRANULE_*` variable `var` knows (unset or empty ones are skipped).
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        for (old, new) in RENAMED {
            if let Some(v) = var(old) {
                return Err(ConfigError::Unknown {
                    key: (*old).into(),
                    from: format!(" (set to '{v}' in the environment)"),
                    hint: format!(": it was renamed {new}"),
                });
            }
        }
        for s in SETTINGS {
            if let Some(v) = var(s.env).filter(|v| !v.trim().is_empty()) {
                self.set_from(s, &v, Origin::Env(s.env))?;
            }
        }
        Ok(())
    }

    /// Set one setting by key (`migration.throttle`) from its text form.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        self.set_with_origin(key, value, Origin::Code)
    }

    /// [`Config::set`], naming where the value came from in errors.
    pub fn set_with_origin(
        &mut self,
        key: &str,
        value: &str,
        origin: Origin<'_>,
    ) -> Result<(), ConfigError> {
        let s = setting(key).ok_or_else(|| unknown(key, &origin, value))?;
        self.set_from(s, value, origin)
    }

    fn set_from(
        &mut self,
        s: &Setting,
        value: &str,
        origin: Origin<'_>,
    ) -> Result<(), ConfigError> {
        (s.set)(self, value).map_err(|why| ConfigError::Value {
            key: s.key,
            from: origin.describe(value),
            why,
            accepts: s.accepts,
        })
    }

    /// A setting's current value in its text form (what [`Config::set`] takes).
    pub fn get(&self, key: &str) -> Option<String> {
        setting(key).map(|s| (s.get)(self))
    }

    /// Apply a TOML file (see [`Config::apply_toml`]).
    pub fn apply_toml_file(&mut self, path: &Path) -> Result<(), ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            path: shown.clone(),
            why: e.to_string(),
        })?;
        self.apply_toml_named(&text, &shown)
    }

    /// Apply settings from a TOML document: one table per section, keys as in
    /// [`SETTINGS`]. Keys of the `cluster` section may also stand at the top, outside
    /// any table (the file's older form). Unknown keys are errors.
    ///
    /// ```toml
    /// [cluster]
    /// nodes = ["cpu=1,mem=512MiB", "cpu=1,mem=2GiB"]
    /// failure_timeout = "1s"
    ///
    /// [migration]
    /// throttle = "600MB/s"
    /// ```
    pub fn apply_toml(&mut self, text: &str) -> Result<(), ConfigError> {
        self.apply_toml_named(text, "TOML")
    }

    fn apply_toml_named(&mut self, text: &str, name: &str) -> Result<(), ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::File {
            path: name.into(),
            why: e.to_string(),
        })?;
        for (k, v) in &table {
            match v {
                toml::Value::Table(section) => {
                    for (k2, v2) in section {
                        self.apply_toml_value(&format!("{k}.{k2}"), v2, name)?;
                    }
                }
                other => self.apply_toml_value(&format!("cluster.{k}"), other, name)?,
            }
        }
        Ok(())
    }

    fn apply_toml_value(
        &mut self,
        key: &str,
        v: &toml::Value,
        file: &str,
    ) -> Result<(), ConfigError> {
        let text = match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => if *b { "on" } else { "off" }.to_string(),
            toml::Value::Array(items) => {
                let mut parts = Vec::new();
                for i in items {
                    match i {
                        toml::Value::String(s) => parts.push(s.clone()),
                        other => {
                            return Err(ConfigError::File {
                                path: file.into(),
                                why: format!("{key}: a list may hold only strings, not {other}"),
                            })
                        }
                    }
                }
                parts.join(";")
            }
            other => {
                return Err(ConfigError::File {
                    path: file.into(),
                    why: format!("{key}: unexpected value {other}"),
                })
            }
        };
        self.set_with_origin(key, &text, Origin::File(file))
    }

    /// Reject settings that cannot work together, or on this machine, saying why.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let c = &self.cluster;
        if c.heartbeat.is_zero() || c.heartbeat >= c.failure_timeout {
            return Err(ConfigError::Invalid(format!(
                "cluster.heartbeat ({}) must be shorter than cluster.failure_timeout ({})",
                format_duration(c.heartbeat),
                format_duration(c.failure_timeout)
            )));
        }
        if c.nodes.len() > 64 {
            return Err(ConfigError::Invalid(format!(
                "cluster.nodes: {} embedded nodes requested; at most 64 are supported on one machine",
                c.nodes.len()
            )));
        }
        if self.transport.max_frame < (64 << 10) {
            return Err(ConfigError::Invalid(
                "transport.max_frame must be at least 64KiB (a hello must fit)".into(),
            ));
        }
        if self.migration.chunk + (64 << 10) > self.transport.max_frame {
            return Err(ConfigError::Invalid(format!(
                "migration.chunk ({}) must leave room for a frame's header within \
                 transport.max_frame ({})",
                format_size(self.migration.chunk),
                format_size(self.transport.max_frame)
            )));
        }
        Ok(())
    }

    /// Every setting with its current value, in [`SETTINGS`] order.
    pub fn describe(&self) -> Vec<(&'static Setting, String)> {
        SETTINGS.iter().map(|s| (s, (s.get)(self))).collect()
    }
}

fn unknown(key: &str, origin: &Origin<'_>, value: &str) -> ConfigError {
    // The closest known key, as a hint for typos and for keys put in the wrong section.
    let closest = SETTINGS
        .iter()
        .map(|s| (strsim::levenshtein(s.key, key), s.key))
        .min();
    let hint = match closest {
        Some((d, k)) if d <= 3 || k.rsplit('.').next() == key.rsplit('.').next() => {
            format!(" (did you mean {k}?)")
        }
        _ => {
            let mut sections: Vec<&str> = SETTINGS
                .iter()
                .filter_map(|s| s.key.split('.').next())
                .collect();
            sections.dedup();
            format!(
                " (sections: {}; see docs/guide/configuration.md)",
                sections.join(", ")
            )
        }
    };
    ConfigError::Unknown {
        key: key.into(),
        from: origin.describe(value),
        hint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn defaults_are_valid_and_round_trip_through_text() {
        let c = Config::default();
        c.validate().unwrap();
        let mut d = Config::default();
        for (s, v) in c.describe() {
            d.set(s.key, &v)
                .unwrap_or_else(|e| panic!("{}: its own text '{v}' is refused: {e}", s.key));
        }
        assert_eq!(c, d);
    }

    #[test]
    fn every_setting_has_a_unique_key_and_variable_and_a_section() {
        let mut keys = std::collections::HashSet::new();
        let mut vars = std::collections::HashSet::new();
        for s in SETTINGS {
            assert!(keys.insert(s.key), "duplicate key {}", s.key);
            assert!(vars.insert(s.env), "duplicate variable {}", s.env);
            assert!(s.env.starts_with("GRANULE_"), "{}", s.env);
            assert!(s.key.contains('.'), "{} has no section", s.key);
            assert!(!s.accepts.is_empty() && !s.doc.is_empty(), "{}", s.key);
        }
    }

    #[test]
    fn precedence_is_file_then_environment() {
        let dir = std::env::temp_dir().join(format!("granule-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("g.toml");
        std::fs::write(
            &file,
            "failure_timeout = \"3s\"\n[migration]\nthrottle = \"600MB/s\"\nnice = 7\n",
        )
        .unwrap();
        let path = file.display().to_string();
        let c = Config::load_from(env(&[
            ("GRANULE_CONFIG", &path),
            ("GRANULE_MIGRATION_NICE", "9"),
        ]))
        .unwrap();
        assert_eq!(c.cluster.failure_timeout, Duration::from_secs(3));
        assert_eq!(c.migration.throttle, Some(600_000_000));
        assert_eq!(c.migration.nice, 9, "the environment wins over the file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_values_name_the_setting_its_source_and_what_it_accepts() {
        let e = Config::load_from(env(&[("GRANULE_MIGRATION_THROTTLE", "fast")])).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("migration.throttle"), "{m}");
        assert!(m.contains("GRANULE_MIGRATION_THROTTLE=fast"), "{m}");
        assert!(m.contains("accepts"), "{m}");

        let e = Config::load_from(env(&[("GRANULE_SPIN", "a while")])).unwrap_err();
        assert!(e.to_string().contains("transport.spin"), "{e}");

        let e = Config::load_from(env(&[("GRANULE_WORKER_SLICE", "1us")])).unwrap_err();
        assert!(e.to_string().contains("node.worker_slice"), "{e}");

        let e = Config::load_from(env(&[("GRANULE_SPIN_US", "20")])).unwrap_err();
        assert!(e.to_string().contains("renamed GRANULE_SPIN"), "{e}");

        let e = Config::load_from(env(&[("GRANULE_CONFIG", "/nonexistent/g.toml")])).unwrap_err();
        assert!(matches!(e, ConfigError::File { .. }), "{e}");

        let e = Config::load_from(env(&[("GRANULE_LOG", "granule=[bad")])).unwrap_err();
        assert!(e.to_string().contains("cluster.log"), "{e}");
    }

    #[test]
    fn toml_errors_name_the_key() {
        let mut c = Config::default();
        let e = c
            .apply_toml("[migration]\nthrotle = \"1GB/s\"\n")
            .unwrap_err();
        assert!(
            e.to_string().contains("did you mean migration.throttle"),
            "{e}"
        );
        let e = c.apply_toml("bogus = 1").unwrap_err();
        assert!(e.to_string().contains("cluster.bogus"), "{e}");
        let e = c
            .apply_toml("[pressure]\nshed = \"sometimes\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("pressure.shed"), "{e}");
        let e = c.apply_toml("nodes = [1, 2]").unwrap_err();
        assert!(e.to_string().contains("only strings"), "{e}");
        c.apply_toml(
            "nodes = [\"cpu=1,mem=512MiB\"]\n[pressure]\nshed = false\ncpu_throttled_max = 0.5\n",
        )
        .unwrap();
        assert_eq!(c.cluster.nodes.len(), 1);
        assert!(!c.pressure.shed);
        assert_eq!(c.pressure.cpu_throttled_max, 0.5);
    }

    #[test]
    fn cross_field_checks() {
        let mut c = Config::default();
        c.cluster.heartbeat = Duration::from_secs(2);
        assert!(matches!(c.validate(), Err(ConfigError::Invalid(_))));
        let mut c = Config::default();
        c.set("transport.max_frame", "64KiB").unwrap();
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains("migration.chunk"), "{e}");
    }

    #[test]
    fn pushdown_defaults_follow_the_node_spec() {
        let p = Pushdown::default();
        assert_eq!(p.threads_for(1.0), 1);
        assert_eq!(p.threads_for(2.5), 3);
        assert_eq!(p.threads_for(0.2), 1);
        assert_eq!(p.memory_for(1 << 30), 256 << 20);
        assert_eq!(p.default_call_memory_for(1 << 30), 64 << 20);
        // A small node: the default budget shrinks to the pool so calls can still run.
        assert_eq!(p.default_call_memory_for(128 << 20), 32 << 20);
        let mut c = Config::default();
        c.set("pushdown.threads", "3").unwrap();
        c.set("pushdown.memory", "1GiB").unwrap();
        c.set("pushdown.cpu_cap", "0.5").unwrap();
        assert_eq!(c.pushdown.threads_for(1.0), 3);
        assert_eq!(c.pushdown.memory_for(1 << 30), 1 << 30);
        assert_eq!(c.pushdown.cpu_cap, Some(0.5));
        for off in ["off", "0", "none"] {
            c.set("pushdown.cpu_cap", off).unwrap();
            assert_eq!(c.pushdown.cpu_cap, None, "{off}");
        }
        c.set("pushdown.threads", "auto").unwrap();
        assert_eq!(c.pushdown.threads, None);
        assert_eq!(p.caller_build_memory, 1 << 30);
        c.set("pushdown.caller_build_memory", "256MiB").unwrap();
        assert_eq!(c.pushdown.caller_build_memory, 256 << 20);
        for (key, bad) in [
            ("pushdown.caller_build_memory", "0"),
            ("pushdown.caller_build_memory", "2TiB"),
            ("pushdown.cpu_cap", "-1"),
            ("pushdown.cpu_cap", "lots"),
            ("pushdown.threads", "0"),
            ("pushdown.queue", "0"),
            ("pushdown.memory", "0"),
        ] {
            let e = c.set(key, bad).unwrap_err();
            assert!(e.to_string().contains(key), "{key}={bad}: {e}");
        }
        let e = Config::load_from(env(&[("GRANULE_PUSHDOWN_CPU_CAP", "half")])).unwrap_err();
        assert!(
            e.to_string().contains("GRANULE_PUSHDOWN_CPU_CAP=half"),
            "{e}"
        );
    }

    #[test]
    fn the_whole_config_survives_a_boot_payload() {
        let mut c = Config::default();
        c.set("pushdown.cpu_cap", "0.5").unwrap();
        c.set("migration.throttle", "32MB/s").unwrap();
        c.set("pressure.mem_free_min", "64MiB").unwrap();
        c.set("node.worker_slice", "off").unwrap();
        let text = serde_json::to_string(&c).unwrap();
        let back: Config = serde_json::from_str(&text).unwrap();
        assert_eq!(back, c);
    }

    /// Every setting is documented in the guide's configuration page, by key and by
    /// environment variable.
    #[test]
    fn every_setting_is_in_the_configuration_guide() {
        let guide = include_str!("../../../docs/guide/configuration.md");
        let missing: Vec<String> = SETTINGS
            .iter()
            .filter(|s| {
                !guide.contains(&format!("`{}`", s.key)) || !guide.contains(&format!("`{}`", s.env))
            })
            .map(|s| format!("{} ({})", s.key, s.env))
            .collect();
        assert!(
            missing.is_empty(),
            "docs/guide/configuration.md does not document: {}",
            missing.join(", ")
        );
    }
}
