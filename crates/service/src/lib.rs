//! Granule's services (the Quicksand layer): request handlers run by compute proclets
//! that split when one gets busier than a core and merge when idle, reached from Rust or
//! over HTTP/JSON on every node.
//!
//! - [`StatelessService`]: a handler `Fn(Req) -> Resp` registered once; every call is
//!   routed by a random 64-bit key to the compute proclet serving that key's range.
//! - [`StatefulService`]: a handler `Fn(&mut State, Req) -> Resp` with per-client state;
//!   calls are routed by a hash of the client id (sticky), the state lives in a sharded
//!   store of memory proclets and is checked out for the duration of a call.
//!
//! What this crate owns:
//! - `pool`: the compute proclets of a service, the table of their key ranges, routing
//!   with a cached table, and the **scaler**: every window (5 ms by default,
//!   [`ScaleConfig::window`]) it reads each compute proclet's load (CPU its handlers
//!   used per wall second, over all threads that ran them at once); a proclet over one
//!   core is split (its key range halved, the upper half to a new compute proclet the
//!   controller places), two neighbours whose summed load averaged over 40 windows is
//!   under 0.6 core are merged. Requests are never dropped or run twice: a call is
//!   re-sent only when it provably did not run.
//! - `service`: the two services, their builder, per-client state check-out.
//! - `http`: the front door, an axum server per node process on the node's own worker
//!   runtime: `POST /v1/services/{name}`, `POST /v1/services/{name}/clients/{id}`,
//!   `GET /v1/services`.
//! - `client`: a minimal keep-alive HTTP/1.1 client for tests and benchmarks.
//!
//! It does not touch placement, migration or transport: its proclets are ordinary
//! proclets of `granule-runtime`, its store an `AutoSharder` of `granule-sharded`.
//!
//! ```no_run
//! use granule_service::StatelessService;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let _cluster = granule_runtime::Cluster::start()?;
//! let svc = StatelessService::start("double", |x: u64| x * 2)?;
//! assert_eq!(svc.call(21)?, 42);
//! for (node, addr) in svc.http_addrs() {
//!     println!("node {node}: curl -d 21 http://{addr}/v1/services/double");
//! }
//! svc.destroy()?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod client;
mod http;
mod pool;
mod service;

pub use http::ServiceListing;
pub use pool::{Sample, ScaleConfig, ScaleEvent, Timeline, WorkerInfo};
pub use service::{
    routing_key, ClientId, ClientShard, Door, FrontDoor, ServiceBuilder, StatefulService,
    StatelessService,
};

use granule_runtime::CallError;
use granule_sharded::ShardError;

/// What can go wrong with a service.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A call to one of the service's proclets failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The client-state store of a stateful service failed.
    #[error(transparent)]
    Store(#[from] ShardError),
    /// The routing table has no compute proclet for a key (the service was destroyed).
    #[error("no compute proclet serves this key (was the service destroyed?)")]
    Unmapped,
    /// A call kept being turned away by merged compute proclets.
    #[error("could not route the call to a compute proclet in time")]
    Stuck,
    /// A stateful call could not get or return its client's state.
    #[error("client state: {0}")]
    State(String),
    /// The front door could not be set up.
    #[error("front door: {0}")]
    Http(String),
    /// A service name that cannot be a URL path segment.
    #[error("bad service name '{0}': use letters, digits, '-' and '_'")]
    BadName(String),
}
