//! Granule's memory market (after Memtrade): producer machines harvest memory their own
//! applications do not use, without hurting them, and lease it through a broker to
//! consumers that use it as a cache.
//!
//! What it owns, by module:
//! - [`harvester`]: the control loop that lowers a producer workload's memory limit while
//!   its performance holds and gives memory back when it does not (two policies:
//!   baseline p99 and PSI), the machine's swap and zswap set-up and its undoing;
//! - [`store`]: the producer's stores, one per lease, speaking the Redis protocol (AUTH
//!   with the lease's secret, LRU eviction or no-eviction, a per-consumer token bucket);
//! - [`broker`]: the broker's logic, free of I/O: producers and their availability
//!   predictors, placement, the FIFO queue, leases, reputation, pricing;
//! - [`server`]: the broker on Granule's transport (in `granule controller --broker` or
//!   `granule broker`);
//! - [`producer`]: a producer process: the harvester, its stores and its broker connection;
//! - [`client`]: a connection to the broker, for producers, consumers and tools;
//! - [`consumer`]: [`consumer::KvCache`], a key-value cache over leased stores with key
//!   substitution and sealed values.
//!
//! It must not touch `/proc` or `/sys` (the host crate does, for the harvester), nor the
//! runtime's proclets: the market is a layer beside the runtime, sharing its transport,
//! wire format and configuration.
#![forbid(unsafe_code)]

pub mod broker;
pub mod client;
pub mod consumer;
pub mod harvester;
pub mod producer;
pub mod server;
pub mod store;

/// The market's wire types (leases, grants, views), re-exported for callers.
pub use granule_wire::market as wire;
