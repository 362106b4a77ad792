//! Granule: one program spread over many machines, in units of state and compute
//! (*proclets*) that run wherever CPU or memory is free and move when it is not.
//!
//! This is the crate applications depend on. It re-exports the proclet API and the
//! cluster entry points from the layers below (`granule-runtime` for proclets and the
//! local cluster, `granule-wire` for the ids and specs they use); it owns no logic itself.
//! [`Footprint`] is both the memory-accounting trait and its derive,
//! `#[derive(granule::Footprint)]`, which user types stored in sharded structures need.
//!
//! ```no_run
//! use granule::{Cluster, Kind, Proclet};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize, Default)]
//! struct Counter { n: u64 }
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // An in-process controller plus node processes of this executable
//!     // (cluster.nodes, or GRANULE_NODES: two of cpu=1,mem=1GiB by default).
//!     let cluster = Cluster::start()?;
//!     let c = Proclet::new(Kind::Memory, Counter::default())?;      // placed by the controller
//!     let n = c.run(5u64, |c: &mut Counter, x: u64| { c.n += x; c.n })?;  // runs where c lives
//!     println!("counter = {n}, on node {}", c.location()?);
//!     c.destroy()?;
//!     cluster.shutdown();
//!     Ok(())
//! }
//! ```
#![forbid(unsafe_code)]

/// Batch computing over sharded inputs: [`batch::for_all`], [`batch::map`],
/// [`batch::filter`], [`batch::reduce`], run by compute proclets that scale with the
/// cluster's idle cores; [`batch::map_into`], [`batch::flat_map_into`] and
/// [`batch::reduce_by_key_into`] write the output straight from the workers into a
/// [`sharded::ShardedVec`] or [`sharded::ShardedMap`], exactly once.
pub use granule_batch as batch;
/// The scavenging file system: a FUSE mount striped over own nodes and victim stores
/// ([`fs::run`] mounts; `granule fs mount` is the command).
pub use granule_fs as fs;
/// The memory market: harvester, producer stores, broker, and [`market::consumer::KvCache`].
pub use granule_market as market;
/// Compute pushdown: columnar tables over sharded vectors, queries run pulled, pushed or by
/// the cost rule ([`pushdown::dist::Executor`]).
pub use granule_pushdown as pushdown;
/// The key-range router sharded structures and services share: [`router::Router`] over
/// a versioned [`router::RangeTable`] kept as a compacted [`router::ChangeLog`], and the
/// split/merge [`router::Trigger`]s ([`router::Bounds`]: bytes held; [`router::CpuLoad`]:
/// CPU used). For libraries of your own that spread keys over proclets.
pub use granule_router as router;
/// Fault injection for tests: the transport's fault filter and failpoints, driven
/// through [`Cluster::faults`].
pub use granule_runtime::faults;
pub use granule_runtime::{
    binary_hash, block_on, cluster_nodes, config, cpu_bound, footprint, here, init_logging, run,
    run_node, set_spin, should_yield, spawn, thread_context, Blob, CallError, Cluster,
    ClusterBuilder, ClusterError, Config, Footprint, Kind, MoveStats, NodeArgs, NodeId, NodeInfo,
    NodeSpec, NodeState, Proclet, ProcletBuilder, ProcletId, ProcletState, ProcletUsage, PushOpts,
    RangeJob, Resource, ThreadContext, Usage, Wire,
};
/// Services: [`service::StatelessService`] and [`service::StatefulService`], request
/// handlers on compute proclets that split and merge with their load, behind an
/// HTTP/JSON front door on every node.
pub use granule_service as service;
/// Sharded data structures: [`sharded::ShardedMap`], [`sharded::ShardedVec`], and the
/// [`sharded::AutoSharder`] they are built on.
///
/// Their elements, keys and values must implement [`Footprint`] (shards count their
/// bytes to know when to split). The standard types do; derive it for your own:
///
/// ```no_run
/// use granule::sharded::ShardedMap;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Clone, Serialize, Deserialize, granule::Footprint)]
/// struct Doc { id: u64, words: Vec<String> }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let cluster = granule::Cluster::start()?;
/// let docs: ShardedMap<u64, Doc> = ShardedMap::new()?;
/// docs.insert(1, Doc { id: 1, words: vec!["hello".into()] })?;
/// # cluster.shutdown();
/// # Ok(()) }
/// ```
pub use granule_sharded as sharded;

/// The README's Rust examples are compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
mod readme {}

/// The user guide (`docs/guide/`): every Rust block in it is compiled and run as a doc
/// test, so the guide stays true. Its shell commands are checked by `tests/guide.rs`.
#[cfg(doctest)]
pub mod guide {
    #[doc = include_str!("../../../docs/guide/README.md")]
    pub mod index {}
    #[doc = include_str!("../../../docs/guide/concepts.md")]
    pub mod concepts {}
    #[doc = include_str!("../../../docs/guide/tutorial.md")]
    pub mod tutorial {}
    #[doc = include_str!("../../../docs/guide/multi-machine.md")]
    pub mod multi_machine {}
    #[doc = include_str!("../../../docs/guide/configuration.md")]
    pub mod configuration {}
    #[doc = include_str!("../../../docs/guide/operations.md")]
    pub mod operations {}
    #[doc = include_str!("../../../docs/guide/troubleshooting.md")]
    pub mod troubleshooting {}
    #[doc = include_str!("../../../docs/guide/market.md")]
    pub mod market {}
    #[doc = include_str!("../../../docs/guide/pushdown.md")]
    pub mod pushdown {}
    #[doc = include_str!("../../../docs/guide/replication.md")]
    pub mod replication {}
    #[doc = include_str!("../../../docs/guide/programming.md")]
    pub mod programming {}
    #[doc = include_str!("../../../docs/guide/testing.md")]
    pub mod testing {}
    #[doc = include_str!("../../../docs/guide/known-limits.md")]
    pub mod known_limits {}
    #[doc = include_str!("../../../docs/guide/migrating.md")]
    pub mod migrating {}
}
