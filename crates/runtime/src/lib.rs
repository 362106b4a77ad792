//! Granule's node runtime.
//!
//! This crate owns everything that happens inside a Granule process that hosts proclets:
//! the proclet API ([`Proclet`]), shipping closures between identical binaries, the
//! per-proclet lock and its synchronization rule, serving and making calls, moving
//! proclets, and the embedded local cluster that a driver starts from its own executable
//! ([`Cluster`]). It does not decide placement or hold the location map (the controller
//! does), define the wire format or sockets (`granule-wire`, `granule-transport`), read
//! `/proc` or `/sys` (`granule-host`), or define settings (`granule-config`).
//!
//! # Layout
//!
//! | module | its job |
//! |---|---|
//! | `proclet` | the proclet API: handles, creation, calls (local fast path or remote), pushed calls, destroy |
//! | [`pushdown`] | pushed calls: the node's pool that runs them next to the data (queue, memory admission, CPU cap, timeouts and cancellation), [`PushOpts`], and `reserve`/`here` for the closures it runs |
//! | `range` | [`RangeJob`]: index ranges computed on compute proclets that yield when moved |
//! | `cluster` | the driver's side: the embedded cluster (controller, node processes, their cgroups), [`ClusterBuilder`] |
//! | `fleet` | the embedded cluster's node processes: starting them, reaping them, fencing and replacing dead ones (`cluster.replace_dead`) |
//! | `boot` | running a process as a node: the boot payload from a driver, the pre-`main` hook, [`run_node`] |
//! | `node` | the per-process runtime, in owned parts: peers, locations, hosting, calls, serving, migration, state streams, the monitor and the pressure policy, fault orders (see its module doc) |
//! | `slot` | a hosted proclet and its lock (the synchronization rule below) |
//! | `shipping` | code shipping under the identical-binary rule: descriptors, the checks before a jump — with `granule-host`'s `os`, the only `unsafe` code |
//! | `codec` | encoding states in chunks, for streams |
//! | `context` | per-thread context: the call chain, the node a thread acts through, `block_on` that never holds a core |
//! | `accounting` | which proclet each thread runs (CPU accounting) and yield requests |
//! | `footprint` | [`Footprint`] (and its derive): a state's memory, exactly or estimated |
//! | `busy` | which workers are inside closures; the watchdog that keeps I/O moving |
//! | `usage` | the process's CPU time as cores busy (for heartbeats) |
//! | `telemetry` | cluster events and the node's `/metrics` |
//! | `faults` | fault injection from the driver ([`Cluster::faults`]), for tests |
//! | `error` | [`CallError`], [`ClusterError`] |
//!
//! Synchronization rule: `run` calls (`&mut S`) are serialized per proclet; `run_ref`
//! calls (`&S`) run concurrently with each other; waiting calls are served in arrival
//! order. A nested call that re-enters a proclet its own call chain holds is granted when
//! both are read-only and fails with [`CallError::Reentrant`] otherwise (it could never be
//! granted), instead of deadlocking.
#![deny(unsafe_code)]

// `#[derive(Footprint)]` names the trait as `::granule_runtime::Footprint`; this makes
// that path work inside this crate too.
extern crate self as granule_runtime;

mod accounting;
mod boot;
mod busy;
mod cluster;
mod codec;
mod context;
mod effects;
mod error;
pub mod faults;
mod fleet;
pub mod footprint;
mod node;
mod proclet;
pub mod pushdown;
mod range;
mod shipping;
mod slot;
pub mod telemetry;
mod usage;

/// The one typed configuration (`granule-config`): every setting, its parsing and its
/// precedence.
pub use granule_config as config;

pub use accounting::should_yield;
pub use boot::{init_logging, run_node, NodeArgs};
pub use cluster::{run, Cluster, ClusterBuilder};
pub use config::Config;
pub use context::{
    block_on_public as block_on, cluster_nodes, cluster_nodes_async, cpu_bound, here, hosted_kind,
    node_config, set_spin, spawn, thread_context, ThreadContext,
};
pub use error::{CallError, ClusterError};
pub use footprint::Footprint;
pub use granule_wire::{
    Blob, Kind, MoveStats, NodeId, NodeInfo, NodeSpec, NodeState, ProcletId, ProcletUsage,
    Resource, Usage,
};
pub use proclet::{Proclet, ProcletBuilder, ProcletState, Wire};
pub use pushdown::PushOpts;
pub use range::{RangeJob, RangePiece};
pub use shipping::binary_hash;
