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

mod boot;
mod busy;
mod cluster;
pub mod config;
mod context;
mod error;
mod node;
mod proclet;
mod shipping;
mod slot;
mod usage;

pub use boot::{init_logging, run_node, NodeArgs};
pub use cluster::{run, Cluster, ClusterBuilder};
pub use config::ClusterConfig;
pub use context::{block_on_public as block_on, here};
pub use error::{CallError, ClusterError};
pub use granule_wire::{Kind, NodeId, NodeInfo, NodeSpec, NodeState, ProcletId};
pub use proclet::{Proclet, ProcletBuilder, ProcletState, Wire};
pub use shipping::binary_hash;
