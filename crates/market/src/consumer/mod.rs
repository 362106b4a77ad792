//! The market's consumer side: [`KvCache`], a key-value cache over leased producer
//! stores, and the [`LeaseSource`] it gets leases from.
//!
//! What it owns: key substitution (every PUT stores the value under a fresh 64-bit
//! counter, so a store never sees the application's keys and a replayed older value is
//! caught), sealing values ([`Protection`]: AES-256-GCM with the counter as associated
//! data, keyed BLAKE3, or nothing), the local metadata (key → lease, counter, length),
//! placement of keys on leases (weighted rendezvous hashing), and turning everything a
//! store or producer can do wrong (lose the connection, revoke, evict, tamper) into a
//! counted cache miss. Stores are spoken to with the `redis` crate, as any unmodified
//! Redis client would.

mod cache;
mod seal;

pub use cache::KvCache;
pub use granule_wire::market::{LeaseGrant, LeaseId};
pub use seal::{compare_ciphers, SealError, Sealer};

use futures::future::BoxFuture;
use parking_lot::Mutex;

/// How a consumer protects the values it leaves on producers' stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protection {
    /// Values stored as they are (key substitution still hides the keys).
    None,
    /// Keyed BLAKE3 over the substituted key and the value: tampering is detected, the
    /// value is readable by the store.
    Integrity,
    /// AES-256-GCM with a fresh nonce and the substituted key as associated data.
    Encrypt,
}

impl Protection {
    /// `none`, `integrity` or `encrypt` (the setting `market.protection`).
    pub fn parse(s: &str) -> Result<Protection, ConsumerError> {
        match s {
            "none" => Ok(Protection::None),
            "integrity" => Ok(Protection::Integrity),
            "encrypt" => Ok(Protection::Encrypt),
            other => Err(ConsumerError::Protection(other.to_string())),
        }
    }

    /// The setting's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Protection::None => "none",
            Protection::Integrity => "integrity",
            Protection::Encrypt => "encrypt",
        }
    }
}

/// Where leases come from: the broker (the CLI implements this over its client), or
/// [`StaticLeases`] for fixed grants (tests, benchmarks).
pub trait LeaseSource: Send + Sync + 'static {
    /// Ask for `slabs` more slabs; may return fewer (or none: then the cache runs with
    /// what it has).
    fn acquire(&self, slabs: u32) -> BoxFuture<'_, Result<Vec<LeaseGrant>, ConsumerError>>;
    /// Extend a lease; the new expiry, milliseconds since the Unix epoch.
    fn renew(&self, lease: LeaseId) -> BoxFuture<'_, Result<u64, ConsumerError>>;
    /// End a lease.
    fn release(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), ConsumerError>>;
    /// Leases revoked or lost since the last call (the broker's notices).
    fn take_revoked(&self) -> Vec<Revocation>;
    /// A grant this source did not hand out in this process (a saved cache's, loaded
    /// again) that it will be asked to renew or release: the source keeps what it needs
    /// to prove it holds the lease.
    fn hold(&self, _grant: &LeaseGrant) {}
}

/// A revocation notice: the lease, and how long its producer keeps the memory from the
/// moment the notice was taken (what a consumer has to move its data off it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Revocation {
    pub lease: LeaseId,
    pub grace: std::time::Duration,
}

/// Fixed grants handed out in order: what tests and benchmarks lease from.
pub struct StaticLeases {
    free: Mutex<Vec<LeaseGrant>>,
    revoked: Mutex<Vec<Revocation>>,
}

impl StaticLeases {
    pub fn new(grants: Vec<LeaseGrant>) -> StaticLeases {
        StaticLeases {
            free: Mutex::new(grants),
            revoked: Mutex::new(Vec::new()),
        }
    }

    /// Announce `lease` as revoked with `grace` to move off it (what the broker would
    /// forward), for tests.
    pub fn revoke(&self, lease: LeaseId, grace: std::time::Duration) {
        self.revoked.lock().push(Revocation { lease, grace });
    }

    /// Grants not handed out yet.
    pub fn remaining(&self) -> usize {
        self.free.lock().len()
    }
}

impl LeaseSource for StaticLeases {
    fn acquire(&self, slabs: u32) -> BoxFuture<'_, Result<Vec<LeaseGrant>, ConsumerError>> {
        let mut free = self.free.lock();
        let mut out = Vec::new();
        let mut got = 0u32;
        while got < slabs && !free.is_empty() {
            let g = free.remove(0);
            got = got.saturating_add(g.slabs.max(1));
            out.push(g);
        }
        Box::pin(futures::future::ready(Ok(out)))
    }

    fn renew(&self, _lease: LeaseId) -> BoxFuture<'_, Result<u64, ConsumerError>> {
        Box::pin(futures::future::ready(Err(ConsumerError::Broker(
            "static leases cannot be renewed".into(),
        ))))
    }

    fn release(&self, _lease: LeaseId) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(futures::future::ready(Ok(())))
    }

    fn take_revoked(&self) -> Vec<Revocation> {
        std::mem::take(&mut *self.revoked.lock())
    }
}

/// A cache's counters since it started (or was opened).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheStats {
    pub gets: u64,
    pub hits: u64,
    pub misses: u64,
    pub puts: u64,
    pub deletes: u64,
    /// Values a store returned that did not verify: discarded, never returned.
    pub verification_failures: u64,
    /// Leases dropped: revoked, expired, or their store unreachable.
    pub lost_leases: u64,
    /// Store operations that failed (connection, timeout, error reply).
    pub store_errors: u64,
    /// Value bytes the metadata says are stored (before sealing).
    pub bytes_stored: u64,
    /// Live leases.
    pub leases: u64,
}

/// Why a consumer operation failed. Misses are not errors.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error("no live lease to store on")]
    NoLease,
    #[error("broker: {0}")]
    Broker(String),
    #[error("store: {0}")]
    Store(String),
    #[error("consumer metadata: {0}")]
    Metadata(String),
    #[error("unknown protection '{0}' (accepts none, integrity, encrypt)")]
    Protection(String),
}
