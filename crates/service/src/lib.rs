//! Granule's services (the Quicksand layer): request handlers run by compute proclets
//! that split when one gets busier than a core and merge when idle, reached from Rust or
//! over HTTP/JSON on every node.
//!
//! - [`StatelessService`]: a handler `Fn(Req) -> Resp` registered once; every call is
//!   routed by a random 64-bit key to the compute proclet serving that key's range. With
//!   a *context* ([`ServiceBuilder::stateless_with_context`],
//!   [`StatelessService::start_with_context`]) the handler is `Fn(&C, Req) -> Resp`:
//!   every compute proclet holds a copy of the serializable `C` (handles to the
//!   structures the service reads, settings), so requests — and HTTP bodies — carry only
//!   the user's own fields.
//! - [`StatefulService`]: a handler `Fn(&mut State, Req) -> Resp` with per-client state
//!   ([`Clients`]), or `Fn(&mut S, &Id, Req) -> Resp` over your own [`ServiceState`]
//!   with its `split` and `merge`; calls are routed by a hash of the client id (sticky)
//!   to compute+memory proclet pairs, one per key range, split and merged together.
//!   With a context ([`ServiceBuilder::stateful_with_context`],
//!   [`ServiceBuilder::stateful_sharded_with_context`],
//!   [`StatefulService::start_with_context`]) the handler is
//!   `Fn(&C, &mut State, Req) -> Resp` (or `Fn(&C, &mut S, &Id, Req) -> Resp`): every
//!   pair holds a copy of `C` — the pairs that splits and healing create get theirs from
//!   an existing one — so calls, and the bodies of
//!   `POST /v1/services/{name}/clients/{id}`, carry only the user's own fields.
//! - **Handlers that can fail** — one that reads a sharded structure, whose shard may be
//!   lost with its node — return a `Result<T, E>` (`E` serializable: the error's text
//!   will do) and propagate the error with `?` instead of turning it into an empty answer
//!   (`.ok()`, `unwrap_or_default()`), which no caller could tell from a real one. Rust
//!   callers get the `Result` inside the call's own; the front door answers `Ok(v)` as
//!   `v` (200) and `Err(e)` as 503 with `e`'s text, as it answers a call that failed.
//!
//! What this crate owns:
//! - `pool`: the compute proclets of a service, their key ranges (a table of
//!   `granule-router`, the key-range router sharded structures use too), routing with a
//!   cached copy of it, and the **scaler**: every window (5 ms by default,
//!   [`ScaleConfig::window`]) it reads each compute proclet's load (CPU its handlers
//!   used per wall second, over all threads that ran them at once); a proclet over one
//!   core is split (its key range halved, the upper half to a new compute proclet the
//!   controller places; a stateful pair splits when its state was busy more than 90 %
//!   of a window, [`ScaleConfig::split_busy`]), two neighbours whose summed load
//!   averaged over 40 windows is under 0.6 core are merged. Requests are never dropped
//!   or run twice while nodes live: a call is re-sent only when it provably did not run.
//!   It also **heals**: a compute proclet whose node the controller declared dead is
//!   replaced, for the same key range, on a live node the controller picks (once,
//!   however many callers saw it fail), and calls that failed with the node wait and
//!   are sent again, for at most 30 s ([`ServiceError::Lost`]): so under node loss a
//!   stateless call is *at least once*. A stateful pair whose memory proclet was lost
//!   starts again with an empty state (no replication), with a warning naming the service
//!   and key range and the counter `granule_service_shards_lost_total{service}`.
//! - `service`: the two services, their builder, the stateful pairs and how their
//!   state splits and merges.
//! - `http`: the front door, an axum server per node process on the node's own worker
//!   runtime: `POST /v1/services/{name}`, `POST /v1/services/{name}/clients/{id}`,
//!   `GET /v1/services`; 503 with the error's text for a call that failed or a handler's
//!   `Err`, never a 200 that hides it.
//! - `client`: a minimal keep-alive HTTP/1.1 client for tests and benchmarks.
//!
//! It does not touch placement, migration, failure detection or transport: its proclets
//! are ordinary proclets of `granule-runtime`, placed by the controller, and a node is
//! lost when the controller says so.
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
    routing_key, ByClient, ByClientWithContext, ByShard, ByShardWithContext, ClientId, Clients,
    Door, FrontDoor, Handler, Pair, PairState, ServiceBuilder, ServiceState, StatefulService,
    StatelessService,
};

use granule_runtime::CallError;

/// What can go wrong with a service.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A call to one of the service's proclets failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The routing table has no compute proclet for a key (the service was destroyed).
    #[error("no compute proclet serves this key (was the service destroyed?)")]
    Unmapped,
    /// A call kept being turned away by merged compute proclets.
    #[error("could not route the call to a compute proclet in time")]
    Stuck,
    /// The compute proclet serving the call (or a stateful pair's state) was lost with its
    /// node, and no replacement served the call in time (no live node could host one?).
    #[error("the service's proclet was lost with its node and no replacement served the call in time: {0}")]
    Lost(CallError),
    /// A stateful service's state could not be reached, split or merged.
    #[error("client state: {0}")]
    State(String),
    /// The front door could not be set up.
    #[error("front door: {0}")]
    Http(String),
    /// A service name that cannot be a URL path segment.
    #[error("bad service name '{0}': use letters, digits, '-' and '_'")]
    BadName(String),
}
