//! Granule's node runtime.
//!
//! This crate owns everything that happens inside a Granule process that hosts proclets:
//! the proclet API ([`Proclet`]), shipping closures between identical binaries
//! (`shipping`, the crate's only `unsafe` code), the per-proclet lock and its
//! synchronization rule (`slot`), serving and making calls (`node`), and the embedded
//! local cluster that a driver starts from its own executable ([`Cluster`]). It does not
//! decide placement or hold the location map (the controller does) and it does not
//! define the wire format or sockets (`granule-wire`, `granule-transport`).
//!
//! Synchronization rule: `run` calls (`&mut S`) are serialized per proclet; `run_ref`
//! calls (`&S`) run concurrently with each other; waiting calls are served in arrival
//! order. A nested call that re-enters a proclet its own call chain holds is granted when
//! both are read-only and fails with [`CallError::Reentrant`] otherwise (it could never be
//! granted), instead of deadlocking.
#![deny(unsafe_code)]

mod accounting;
mod boot;
mod busy;
mod cluster;
mod codec;
pub mod config;
mod context;
mod error;
pub mod footprint;
mod node;
mod proclet;
mod range;
mod shipping;
mod slot;
pub mod telemetry;
mod usage;

pub use accounting::should_yield;
pub use boot::{init_logging, run_node, NodeArgs};
pub use cluster::{run, Cluster, ClusterBuilder};
pub use config::ClusterConfig;
pub use context::{
    block_on_public as block_on, cluster_nodes, cluster_nodes_async, cpu_bound, here, hosted_kind,
    set_spin, spawn, thread_context, ThreadContext,
};
pub use error::{CallError, ClusterError};
pub use footprint::Footprint;
pub use granule_wire::{
    Kind, MoveStats, NodeId, NodeInfo, NodeSpec, NodeState, ProcletId, ProcletUsage, Resource,
    Usage,
};

/// The pressure policy: the trait a node's policy implements, the default argmax policy,
/// and the monitor's tunables.
pub mod pressure {
    pub use crate::node::monitor::{
        ArgmaxPolicy, Candidate, Decision, NodeView, PressureConfig, PressurePolicy,
    };
}
pub use proclet::{Proclet, ProcletBuilder, ProcletState, Wire};
pub use range::{RangeJob, RangePiece};
pub use shipping::binary_hash;
