//! Identifiers and small value types shared by every Granule message.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A node of the cluster (the driver is a node too). Assigned by the controller at
/// registration; never reused within one controller's lifetime.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Debug)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// A proclet. Ids come from blocks the controller hands out; 0 is never a valid id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Debug)]
pub struct ProcletId(pub u64);

impl fmt::Display for ProcletId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

/// Version of a proclet's location: bumped every time the proclet changes node, so a
/// cached location can be compared with a newer one.
pub type Epoch = u64;

/// Identifies one logical chain of nested calls (a top-level call and every call made,
/// directly or transitively, from inside its closure). Used to detect re-entry.
pub type ChainId = u64;

/// blake3 hash of a program's executable file.
pub type BinaryHash = [u8; 32];

/// What a proclet mostly consumes; placement uses it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Debug)]
pub enum Kind {
    /// Mostly CPU: placed on the node with the most idle cores.
    Compute,
    /// Mostly memory: placed on the node with the most free memory.
    Memory,
    /// Both: placed on the node with the best combined headroom.
    Hybrid,
}

impl Kind {
    /// Index usable for per-kind counters (`[u32; 3]`).
    pub fn index(self) -> usize {
        match self {
            Kind::Compute => 0,
            Kind::Memory => 1,
            Kind::Hybrid => 2,
        }
    }

    /// The kind of an index from [`Kind::index`] (out of range: `Hybrid`).
    pub fn from_index(i: usize) -> Kind {
        match i {
            0 => Kind::Compute,
            1 => Kind::Memory,
            _ => Kind::Hybrid,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Compute => "compute",
            Kind::Memory => "memory",
            Kind::Hybrid => "hybrid",
        })
    }
}

/// Whether a call needs exclusive (`&mut S`) or shared (`&S`) access to the state.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Debug)]
pub enum CallMode {
    Exclusive,
    Shared,
}

/// Who is on the other end of a connection, as declared in its hello.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Debug)]
pub enum Role {
    /// The application's driver process (hosts proclets).
    Driver,
    /// A node process (hosts proclets).
    Node,
    /// The controller.
    Controller,
    /// A program that hosts no proclets (`granule status`, benchmarks' load generators).
    /// Exempt from the identical-binary rule and never allowed to ship code.
    Tool,
}

impl Role {
    /// Roles that host proclets and therefore must run the cluster's binary.
    pub fn hosts_proclets(self) -> bool {
        matches!(self, Role::Driver | Role::Node)
    }
}

/// A node's resource spec: how many cores it may use (worker threads, CPU quota) and how
/// much memory (budget, cgroup limit).
#[derive(Clone, Copy, PartialEq, Serialize, Deserialize, Debug)]
pub struct NodeSpec {
    pub cores: f64,
    pub mem_bytes: u64,
}

/// Resource use a node reports in its heartbeats (and the controller reports in
/// `ListNodes`).
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug, Default)]
pub struct Usage {
    /// Cores busy over the last heartbeat interval (process CPU time / wall time).
    pub cores_busy: f64,
    /// Resident memory of the node process, bytes.
    pub mem_used: u64,
    /// Proclets hosted, by kind (index with [`Kind::index`]).
    pub proclets: [u32; 3],
    /// Calls served since the node started (local and remote).
    pub calls_served: u64,
    /// The node's memory budget (its spec), bytes.
    pub mem_budget: u64,
    /// Sum of the footprints of the proclets the node hosts, bytes.
    pub proclet_bytes: u64,
    /// `memory.limit_in_bytes` of the node's cgroup; 0 when it runs in none (or an
    /// unlimited one).
    pub cgroup_mem_limit: u64,
    /// `memory.usage_in_bytes` of the node's cgroup (everything charged to it, including
    /// other processes in the same cgroup); 0 when it runs in none (or an unlimited one).
    pub cgroup_mem_usage: u64,
    /// Fraction of CFS periods in which the node's cpu cgroup was throttled, over the last
    /// interval (0 without a cgroup quota).
    pub cpu_throttled: f64,
    /// Run-queue delay: seconds the node's threads spent runnable but not running, per
    /// second of wall time, over the last interval (from /proc schedstat).
    pub runq_delay: f64,
    /// The pressure monitor's verdicts at the last sample.
    pub mem_pressure: bool,
    pub cpu_pressure: bool,
    /// Proclets this node has moved away since it started.
    pub moves_out: u64,
    /// The largest hosted proclets (by memory, then CPU), at most 16.
    pub top: Vec<ProcletUsage>,
    /// Hosted proclets by the structure or service they belong to (every such proclet,
    /// not only the largest): the dashboard's per-structure shard counts and sizes.
    pub groups: Vec<GroupUsage>,
}

/// The proclets a node hosts for one structure or service (e.g. the shards of one
/// `ShardedVec`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Debug, Default)]
pub struct GroupUsage {
    /// Which structure: its kind and the id of the proclet that names it, e.g.
    /// `"ShardedVec p12"`, or `"service visits"`.
    pub group: String,
    /// Proclets of the group on this node.
    pub proclets: u32,
    /// Their summed footprint, bytes.
    pub bytes: u64,
}

/// What kind of thing happened (see [`ClusterEvent`]). In JSON, snake case
/// (`"migration"`, `"migration_failed"`, ...), as [`EventKind::as_str`] spells it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Debug)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A proclet moved from `node` to `to`.
    Migration,
    /// A move from `node` to `to` failed; the proclet stayed at `node`.
    MigrationFailed,
    /// A structure or service split a proclet on `node` (the new one on `to`).
    Split,
    /// A structure or service merged two proclets into one on `node`.
    Merge,
    /// A node joined the cluster (recorded by the controller).
    NodeJoined,
    /// A node was declared dead (recorded by the controller).
    NodeDown,
    /// A node left the cluster on purpose (recorded by the controller).
    NodeLeft,
    /// A replicated proclet's backup on `to` became its primary, the primary's node
    /// `node` having died (recorded by the controller).
    Failover,
    /// The primary on `node` streamed a replicated proclet's state to a new backup on
    /// `to` (`bytes`; `micros`: how long calls on it were held meanwhile).
    BackupMade,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Migration => "migration",
            EventKind::MigrationFailed => "migration_failed",
            EventKind::Split => "split",
            EventKind::Merge => "merge",
            EventKind::NodeJoined => "node_joined",
            EventKind::NodeDown => "node_down",
            EventKind::NodeLeft => "node_left",
            EventKind::Failover => "failover",
            EventKind::BackupMade => "backup_made",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Something an operator wants to see happen: a move, a split, a merge, a node coming or
/// going. Nodes send theirs with their heartbeats; the controller numbers them and keeps
/// the most recent ones for the dashboard and `granule top`.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub struct ClusterEvent {
    /// The controller's sequence number (1, 2, ...; 0 until it has received the event).
    pub seq: u64,
    /// When it happened, milliseconds since the UNIX epoch (the reporting host's clock).
    pub at_ms: u64,
    pub kind: EventKind,
    /// Where it happened (a migration's source).
    pub node: NodeId,
    /// A migration's destination, a split's new proclet's node.
    pub to: Option<NodeId>,
    /// What it concerns: a proclet (`"p12"`), a structure (`"ShardedVec p5"`), a
    /// service (`"service visits"`).
    pub subject: String,
    /// Bytes moved (migrations), 0 otherwise.
    pub bytes: u64,
    /// How long it took, microseconds (0 when not measured).
    pub micros: u64,
    /// Free text: why it happened, or why it failed.
    pub detail: String,
}

impl ClusterEvent {
    /// An event happening now on `node` (sequence number and the rest left empty).
    pub fn now(kind: EventKind, node: NodeId, subject: impl Into<String>) -> ClusterEvent {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        ClusterEvent {
            seq: 0,
            at_ms,
            kind,
            node,
            to: None,
            subject: subject.into(),
            bytes: 0,
            micros: 0,
            detail: String::new(),
        }
    }
}

/// Resource use of one proclet.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub struct ProcletUsage {
    pub id: ProcletId,
    pub kind: Kind,
    /// Its footprint (exact for library types, an estimate otherwise), bytes.
    pub mem_bytes: u64,
    /// Cores its calls used over the accounting window.
    pub cores: f64,
    pub pinned: bool,
}

/// A resource the pressure policy sheds.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Debug)]
pub enum Resource {
    Memory,
    Cpu,
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resource::Memory => "memory",
            Resource::Cpu => "cpu",
        })
    }
}

/// The cgroup v1 directories a node process runs in, as `/proc/<pid>/cgroup` names them
/// (relative to each controller's mount, e.g. `/granule/c1234/node0` under
/// `/sys/fs/cgroup/memory`). Antagonists use them to join a node's cgroups.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Debug, Default)]
pub struct CgroupPaths {
    pub memory: Option<String>,
    pub cpu: Option<String>,
}

/// What one move cost, as the source node measured it.
#[derive(Clone, Copy, PartialEq, Serialize, Deserialize, Debug, Default)]
pub struct MoveStats {
    /// Encoded state bytes sent.
    pub bytes: u64,
    /// From the start of the move (asking for the proclet's lock) until the destination
    /// hosts it and held calls are released to it, microseconds: how long the proclet was
    /// unavailable. (The controller's record is updated right after.)
    pub micros: u64,
    /// Of which waiting for calls in flight to finish, microseconds.
    pub drain_micros: u64,
}

/// A shipped piece of code: the offset of a descriptor from the binary's anchor plus the
/// fingerprint of the types it was instantiated with.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Debug)]
pub struct CodeRef {
    pub offset: i64,
    pub fingerprint: u64,
}

/// Where a proclet lives.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Debug)]
pub struct Location {
    pub node: NodeId,
    pub addr: String,
    pub epoch: Epoch,
}

/// Liveness of a node as the controller sees it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Debug)]
pub enum NodeState {
    Alive,
    /// Missed heartbeats for longer than the failure timeout, or its connection broke.
    Dead,
    /// Left the cluster on purpose (its program ended, or it was stopped with a signal);
    /// its proclets are gone with it.
    Left,
}

/// A node as the controller reports it.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub struct NodeInfo {
    pub id: NodeId,
    pub role: Role,
    pub addr: String,
    pub pid: u32,
    pub spec: NodeSpec,
    pub usage: Usage,
    pub state: NodeState,
    /// Milliseconds since the controller last heard from the node.
    pub last_seen_ms: u64,
    /// The cgroups the node runs in, when it runs in a cgroup v1 hierarchy.
    pub cgroups: Option<CgroupPaths>,
    /// Where the node serves its Prometheus metrics (`http://ADDR/metrics`), if it does.
    pub metrics_addr: Option<String>,
}

impl NodeInfo {
    /// Memory (used, limit) as its last heartbeat tells: the limit is the tighter of its
    /// spec and its cgroup's limit; used is the larger of its resident memory and what
    /// its cgroup is charged (which includes other processes in the cgroup).
    pub fn memory(&self) -> (u64, u64) {
        let u = &self.usage;
        let mut limit = self.spec.mem_bytes;
        if u.cgroup_mem_limit > 0 {
            limit = limit.min(u.cgroup_mem_limit);
        }
        (u.mem_used.max(u.cgroup_mem_usage), limit)
    }
}

/// A named section of the controller's dashboard that a layer above the controller (the
/// file system, a service) publishes and keeps fresh: a few key–value facts and small
/// tables of text. The controller knows nothing of what it shows; it keeps the panel
/// until `ttl_ms` passes without a new copy or the publishing connection closes, and
/// refuses panels over its size bounds.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Debug, Default)]
pub struct Panel {
    /// Its key among the panels of one publisher (a new copy replaces the old one).
    pub name: String,
    /// The heading the dashboard shows.
    pub title: String,
    /// Drop it this long after the last copy arrived (0: the controller's default).
    pub ttl_ms: u64,
    /// Key–value lines, in order.
    pub facts: Vec<(String, String)>,
    pub tables: Vec<PanelTable>,
}

/// One table of a [`Panel`]: every cell is text, rows have at most one cell per column.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Debug, Default)]
pub struct PanelTable {
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}
