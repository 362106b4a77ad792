//! Granule's controller.
//!
//! The controller owns the cluster-wide facts: which nodes exist, their resource specs and
//! the use they report in heartbeats, whether they are alive, the identical-binary rule
//! at registration, proclet id blocks, placement of new proclets, and the location map
//! (proclet → node, epoch). It never sees proclet state or runs application code, and it
//! is not on the path of proclet calls: nodes cache locations and only ask the controller
//! when a cached location turns out stale.
//!
//! Operators see it through HTTP (module `http`): a live dashboard page, the JSON it
//! polls (`/api/cluster`: nodes, structures, recent events, panels) and Prometheus
//! `/metrics`. It keeps the most recent cluster events (moves, splits, merges, nodes
//! joining and dying) that hosts send with their heartbeats.
//!
//! Layers above it (the file system) show their own figures on the dashboard as
//! *panels* (module `panels`): named sections of facts and small text tables sent with
//! `PublishPanel` ([`ControllerClient::publish_panel`]), kept while refreshed, bounded in
//! size. The controller never interprets them and depends on none of those layers.
//!
//! It runs embedded in a driver ([`ControllerHandle::start`]) or standalone
//! (`granule controller --listen ADDR`, [`run_standalone`]). Nodes and tools talk to it
//! through [`ControllerClient`].
//!
//! Failure detection: a node that misses heartbeats for the failure timeout, or whose
//! connection to the controller closes, is declared dead; every other host is told
//! (`NodeDown`) so callers waiting on it fail fast, and the dead node, should it come
//! back, is told to leave (its proclets are considered lost; calls are at-most-once).
#![forbid(unsafe_code)]

mod client;
mod http;
pub mod panels;
mod server;
mod state;

pub use client::{ControllerClient, Registration};
pub use http::{structures, ClusterView, StructureView};
pub use panels::{check_panel, PanelError, PanelView};
pub use server::{run_standalone, run_standalone_with, ControllerHandle, Extension};
pub use state::{ControllerConfig, PlaceError, RegisterError, State};

use granule_wire::RemoteError;
use thiserror::Error;

/// Errors talking to or running a controller.
#[derive(Debug, Error, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum ControllerError {
    #[error("controller at {addr} is unreachable: {reason} (is it running? check GRANULE_CONTROLLER / --controller)")]
    Unreachable { addr: String, reason: String },
    #[error("{0}")]
    BinaryMismatch(String),
    #[error("controller refused: {0}")]
    Refused(String),
    #[error("controller error: {0}")]
    Remote(RemoteError),
    #[error("controller protocol error: {0}")]
    Protocol(String),
    #[error("{0}")]
    Io(String),
}
