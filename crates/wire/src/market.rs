//! The memory market's messages: producers, consumers and the broker talk over Granule's
//! own transport, wrapped in [`crate::Msg::Market`]. Lease secrets travel only in these
//! messages (between broker, producer and the lease's consumer), never on a store's port.
//!
//! Flow:
//! - a producer opens a connection to the broker and sends [`MarketMsg::ProducerHello`]
//!   (also after a broker restart, listing the leases its stores still serve, so the
//!   broker rebuilds its state), then a [`MarketMsg::ProducerReport`] every report period;
//! - a consumer sends [`MarketMsg::LeaseRequest`]; the broker places slabs on producers,
//!   asks each chosen producer to open a store ([`MarketMsg::OpenStore`], a request from
//!   broker to producer on the producer's connection) and answers with the grants; what
//!   it cannot place now waits in a FIFO queue, and the consumer collects later grants
//!   with [`MarketMsg::LeaseCollect`];
//! - [`MarketMsg::Renew`] extends a lease at the current price, [`MarketMsg::Release`]
//!   ends it; the broker tells the producer to drop an ended or expired lease's store
//!   ([`MarketMsg::CloseStore`]);
//! - a producer that needs memory back shrinks its stores and says so in its report; a
//!   no-eviction lease it must drop is announced with [`MarketMsg::Revoking`], which the
//!   broker forwards to the consumer ([`MarketMsg::Revoked`], a notification on the
//!   consumer's connection) with the grace period left.

use serde::{Deserialize, Serialize};

/// A lease, numbered by the broker (unique over the broker's life and its restarts:
/// the high bits are the broker's start time).
pub type LeaseId = u64;

/// A producer as the broker knows it (assigned at hello; a producer keeps its name
/// across reconnects, the broker maps the name back to the same id).
pub type ProducerId = u64;

/// How a lease's store treats a full store.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Debug)]
pub enum EvictionMode {
    /// Approximate LRU at the lease size (a cache).
    Lru,
    /// Refuse writes past the size; when memory must go back, revoke with a grace period.
    NoEviction,
}

/// What the broker weighs when it places a request (the placement cost is a weighted
/// sum of these terms; larger weight, more influence).
#[derive(Clone, Copy, PartialEq, Serialize, Deserialize, Debug)]
pub struct PlacementWeights {
    pub free_slabs: f64,
    pub availability: f64,
    pub bandwidth: f64,
    pub cpu: f64,
    pub latency: f64,
    pub reputation: f64,
}

impl Default for PlacementWeights {
    fn default() -> Self {
        PlacementWeights {
            free_slabs: 1.0,
            availability: 2.0,
            bandwidth: 0.5,
            cpu: 0.5,
            latency: 0.5,
            reputation: 2.0,
        }
    }
}

/// One granted lease, as the consumer receives it.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub struct LeaseGrant {
    pub lease: LeaseId,
    pub producer: ProducerId,
    pub producer_name: String,
    /// The store's Redis-protocol address, `host:port`.
    pub store_addr: String,
    /// The store's AUTH password for this lease.
    pub secret: String,
    pub slabs: u32,
    pub slab_bytes: u64,
    /// Milliseconds since the Unix epoch.
    pub expires_unix_ms: u64,
    /// Price per slab-hour, in the market's unit.
    pub price: f64,
    pub mode: EvictionMode,
}

/// A lease a producer's store still serves (sent in its hello after a reconnect).
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub struct HeldLease {
    pub lease: LeaseId,
    pub consumer: String,
    pub slabs: u32,
    pub store_addr: String,
    pub expires_unix_ms: u64,
    pub price: f64,
    pub mode: EvictionMode,
    /// The hash of the lease's secret, so that a restarted broker knows again who may
    /// renew or release the lease.
    pub proof: String,
}

/// A producer's state as reported to the broker.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug, Default)]
pub struct ProducerState {
    /// Slabs it can lease now (harvested, not leased).
    pub free_slabs: u32,
    /// Slabs leased out and served.
    pub leased_slabs: u32,
    /// The workload's current memory limit, bytes (0: none).
    pub limit_bytes: u64,
    /// The limit the workload had before harvesting.
    pub original_limit_bytes: u64,
    /// Bytes harvested (limit reduction minus zswap pool growth).
    pub harvested_bytes: u64,
    /// The harvester's policy and its state, for people (`baseline: probing`, ...).
    pub policy_state: String,
    /// Idle CPU on the producer's machine, cores.
    pub cpu_idle_cores: f64,
    /// Network bandwidth the producer offers, bytes per second (its configuration).
    pub bandwidth_bps: u64,
    /// The producer process's resident memory, bytes (its stores' data and buffers and
    /// its own; 0: not measured): shown beside its leases, so an owner sees what the
    /// producer costs the machine against what it leases.
    pub resident_bytes: u64,
}

/// One lease as the status views show it.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub struct LeaseView {
    pub lease: LeaseId,
    pub consumer: String,
    pub producer: ProducerId,
    pub producer_name: String,
    pub slabs: u32,
    pub expires_unix_ms: u64,
    pub price: f64,
    pub mode: EvictionMode,
}

/// One producer as the status views show it.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub struct ProducerView {
    pub producer: ProducerId,
    pub name: String,
    pub addr: String,
    pub connected: bool,
    pub state: ProducerState,
    /// Predicted free slabs over the next prediction horizon.
    pub predicted_free_slabs: f64,
    /// In 0..=1: 1 for a producer that never revoked early.
    pub reputation: f64,
}

/// The whole market, for `granule status`, `granule top` and the dashboard.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug, Default)]
pub struct MarketView {
    pub producers: Vec<ProducerView>,
    pub leases: Vec<LeaseView>,
    /// (milliseconds since the Unix epoch, price per slab-hour), oldest first.
    pub prices: Vec<(u64, f64)>,
    pub price: f64,
    /// Requests waiting in the FIFO queue, and their slabs.
    pub queued_requests: u32,
    pub queued_slabs: u32,
}

/// A broker's, producer's or consumer's message.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub enum MarketMsg {
    // ---- producer → broker ----------------------------------------------------------
    /// Register (or re-register after a reconnect or a broker restart). Answered with
    /// `ProducerOk`.
    ProducerHello {
        /// Stable name (defaults to host name and workload).
        name: String,
        /// Where its stores listen (the host part; each store has its own port).
        host: String,
        slab_bytes: u64,
        state: ProducerState,
        /// Leases its stores still serve.
        held: Vec<HeldLease>,
    },
    ProducerOk {
        producer: ProducerId,
        report_interval_ms: u64,
    },
    /// Periodic availability report. Answered with `Done`.
    ProducerReport {
        producer: ProducerId,
        state: ProducerState,
        /// Bytes the stores evicted since the last report because the harvester took
        /// memory back, per lease.
        shrunk: Vec<(LeaseId, u64)>,
    },
    /// A no-eviction lease's store will be dropped after `grace_ms` (the producer needs
    /// the memory back). Answered with `Done`.
    Revoking {
        producer: ProducerId,
        lease: LeaseId,
        grace_ms: u64,
    },

    // ---- broker → producer (requests on the producer's connection) --------------------
    /// Open a store for a lease. Answered with `StoreOpened`.
    OpenStore {
        lease: LeaseId,
        consumer: String,
        secret: String,
        bytes: u64,
        mode: EvictionMode,
        expires_unix_ms: u64,
        price: f64,
        /// Token-bucket rate limit for this consumer, bytes per second (0: unlimited).
        rate_bps: u64,
    },
    StoreOpened {
        store_addr: String,
    },
    /// Extend a store's lease. Answered with `Done`.
    ExtendStore {
        lease: LeaseId,
        expires_unix_ms: u64,
        price: f64,
    },
    /// Drop a store (lease released or expired). Answered with `Done`.
    CloseStore {
        lease: LeaseId,
    },

    // ---- consumer → broker ----------------------------------------------------------
    /// Ask for slabs. Answered with `Leases` at once: what could be placed now (at least
    /// `min_slabs`, else nothing), and a ticket for the rest, which waits in the queue
    /// for at most `wait_ms`.
    LeaseRequest {
        consumer: String,
        slabs: u32,
        min_slabs: u32,
        lease_ms: u64,
        /// The most it pays per slab-hour.
        budget: f64,
        weights: Option<PlacementWeights>,
        mode: EvictionMode,
        wait_ms: u64,
    },
    Leases {
        grants: Vec<LeaseGrant>,
        /// Slabs still wanted, waiting in the queue under this ticket.
        pending: Option<(u64, u32)>,
    },
    /// Collect grants made since for a queued request. Answered with `Leases`.
    LeaseCollect {
        ticket: u64,
    },
    /// Extend a lease by `lease_ms` at the current price. Answered with `Renewed`.
    /// `proof` shows the sender holds the lease: the hex BLAKE3 hash of its secret.
    Renew {
        lease: LeaseId,
        lease_ms: u64,
        proof: String,
    },
    Renewed {
        expires_unix_ms: u64,
        price: f64,
    },
    /// End a lease (with the same `proof` as `Renew`). Answered with `Done`.
    Release {
        lease: LeaseId,
        proof: String,
    },

    // ---- broker → consumer (notification) ---------------------------------------------
    /// A lease is being revoked (its producer needs the memory or left): its data goes
    /// after `grace_ms`.
    Revoked {
        lease: LeaseId,
        grace_ms: u64,
        reason: String,
    },

    // ---- anyone → broker ------------------------------------------------------------
    /// Answered with `View`.
    Status,
    View(MarketView),
}

impl MarketMsg {
    /// Short name for logs and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            MarketMsg::ProducerHello { .. } => "ProducerHello",
            MarketMsg::ProducerOk { .. } => "ProducerOk",
            MarketMsg::ProducerReport { .. } => "ProducerReport",
            MarketMsg::Revoking { .. } => "Revoking",
            MarketMsg::OpenStore { .. } => "OpenStore",
            MarketMsg::StoreOpened { .. } => "StoreOpened",
            MarketMsg::ExtendStore { .. } => "ExtendStore",
            MarketMsg::CloseStore { .. } => "CloseStore",
            MarketMsg::LeaseRequest { .. } => "LeaseRequest",
            MarketMsg::Leases { .. } => "Leases",
            MarketMsg::LeaseCollect { .. } => "LeaseCollect",
            MarketMsg::Renew { .. } => "Renew",
            MarketMsg::Renewed { .. } => "Renewed",
            MarketMsg::Release { .. } => "Release",
            MarketMsg::Revoked { .. } => "Revoked",
            MarketMsg::Status => "Status",
            MarketMsg::View(_) => "View",
        }
    }
}
