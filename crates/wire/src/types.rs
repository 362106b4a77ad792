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

/// Resource use a node reports in its heartbeats.
#[derive(Clone, Copy, PartialEq, Serialize, Deserialize, Debug, Default)]
pub struct Usage {
    /// Cores busy over the last heartbeat interval (process CPU time / wall time).
    pub cores_busy: f64,
    /// Resident memory of the node process, bytes.
    pub mem_used: u64,
    /// Proclets hosted, by kind (index with [`Kind::index`]).
    pub proclets: [u32; 3],
    /// Calls served since the node started (local and remote).
    pub calls_served: u64,
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
}
