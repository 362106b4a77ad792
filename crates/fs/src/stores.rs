//! The stores stripes live in, and the one interface the data path uses for both kinds:
//!
//! - **own stores**: a memory proclet per own node ([`StripeStore`]), reached through
//!   the runtime's calls; stripes are stored as they are (own nodes are trusted);
//! - **victim stores**: the memory market's producer stores (leased from the broker in
//!   no-eviction mode, or started by hand), spoken to over RESP with the lease's secret
//!   through the `redis` crate, as any Redis client would. Stripes are sealed with the
//!   market consumer's [`Sealer`] under the stripe's version (a fresh 64-bit number per
//!   write, also the store key), so a victim that corrupts a stripe, hands back another
//!   stripe, or replays an older version of it is caught: the copy fails to open.
//!
//! An own store whose node is a process of the mount's machine (embedded nodes, and the
//! mount's own node) keeps its stripes in a shared memory arena ([`granule_host::shm`]):
//! the mount maps it read-only and reads stripes in place, so a read costs one copy, into
//! the kernel's FUSE reply, instead of a trip over loopback TCP. The mount learns where
//! each stripe lies when it stores it; it waits for its in-place readers of a stripe to
//! finish before it deletes it, so a freed (and reused) slot is never read.
//!
//! This module also keeps each store's accounting (capacity, bytes the mount put there,
//! stripes) and state (active, draining, gone), which placement and `statfs` read.

use crate::placement::StoreId;
use bytes::Bytes;
use granule_host::shm::{Arena, ArenaId, PeerArena};
use granule_market::consumer::Sealer;
use granule_runtime::{Footprint, Kind, NodeId, Proclet};
use granule_wire::Blob;
use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a store operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StoreError {
    /// The store is full (a victim's `-OOM`, or our own accounting).
    #[error("store full")]
    Full,
    /// The store cannot be reached (connection refused or dropped, node dead).
    #[error("store unreachable: {0}")]
    Lost(String),
    /// A copy came back that does not open under its version: corrupted, swapped or
    /// replayed by the store.
    #[error("stripe failed verification")]
    Tampered,
    /// Anything else the store said (timeouts, error replies).
    #[error("store error: {0}")]
    Other(String),
}

/// An own node's stripes: the state of a memory proclet.
#[derive(Default, Serialize, Deserialize)]
pub struct StripeStore {
    /// Stripes as shared buffers: a read is answered without copying the stripe first,
    /// and the mount decodes the reply as a view into the frame it arrived in. Those in
    /// the arena are views of their slots.
    stripes: HashMap<u64, Blob>,
    bytes: u64,
    /// Shared memory for the stripes, made on the node that created the store. Not part
    /// of the state a move would carry: the store is pinned, and a copy elsewhere would
    /// keep its stripes on the heap.
    #[serde(skip)]
    arena: Option<Arc<Arena>>,
}

/// Address space an own store's arena reserves (memory is used only by live stripes;
/// a stripe shorter than a slot still takes a slot's addresses).
const ARENA_RESERVE: usize = 64 << 30;

impl StripeStore {
    /// A store whose stripes of up to `stripe` bytes live in a shared memory arena, or
    /// on the heap when no arena can be made. Freed stripes keep their pages, for reuse,
    /// up to half the store's `capacity` (memory given to the file system anyway).
    fn with_arena((stripe, capacity): (u64, u64)) -> StripeStore {
        let keep_warm = usize::try_from(capacity / 2).unwrap_or(usize::MAX);
        let arena = match Arena::create(stripe as usize, ARENA_RESERVE, keep_warm) {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::warn!("no shared stripe arena ({e}): the mount reads this store's stripes over the network");
                None
            }
        };
        StripeStore {
            arena,
            ..StripeStore::default()
        }
    }

    /// Keep `data` as `version`; where it lies in the arena, if it went there.
    fn insert(&mut self, version: u64, data: Blob) -> Option<u64> {
        // A version's bytes never change: a second put of it (a retried call) keeps the
        // first copy, whose slot the mount may be reading in place.
        if self.stripes.contains_key(&version) {
            return None;
        }
        let len = data.0.len() as u64;
        let (blob, at) = match self.arena.as_ref().and_then(|a| a.store(&data.0)) {
            Some(slot) => {
                let at = slot.offset();
                (Blob(Bytes::from_owner(slot)), Some(at))
            }
            None => (data, None),
        };
        self.bytes += len;
        self.stripes.insert(version, blob);
        at
    }

    fn arena_id(&self) -> Option<(u32, i32, u128, u64)> {
        self.arena.as_ref().map(|a| {
            let id = a.id();
            (id.pid, id.fd, id.tag, id.len)
        })
    }
}

/// The mount's in-place view of an own store's arena.
struct InPlace {
    arena: PeerArena,
    /// Where each stripe version lies (offset, length). A reader holds the entry while it
    /// reads; a delete takes it out and waits until no reader holds it.
    at: Mutex<HashMap<u64, Arc<(u64, usize)>>>,
}

/// A stripe read in place: the bytes of its slot, held against deletion while alive.
struct InPlaceStripe {
    view: Arc<InPlace>,
    at: Arc<(u64, usize)>,
}

impl AsRef<[u8]> for InPlaceStripe {
    fn as_ref(&self) -> &[u8] {
        // Checked when the stripe was handed out; the range never changes.
        self.view.arena.slice(self.at.0, self.at.1).unwrap_or(&[])
    }
}

impl Footprint for StripeStore {
    fn footprint(&self) -> u64 {
        // Tracked as stripes come and go: walking a GiB-sized map to measure it would
        // cost as much as the calls themselves. Freed arena slots that kept their pages
        // are memory too.
        let warm = self.arena.as_ref().map_or(0, |a| a.warm_bytes());
        std::mem::size_of::<Self>() as u64 + self.bytes + warm + self.stripes.capacity() as u64 * 48
    }
}

/// Whether a store takes new stripes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreState {
    Active,
    /// Its stripes are moving away; reads still go to it, writes do not.
    Draining,
    /// Drained, released or lost: nothing goes to it any more.
    Gone,
}

impl StoreState {
    fn from_u8(v: u8) -> StoreState {
        match v {
            0 => StoreState::Active,
            1 => StoreState::Draining,
            _ => StoreState::Gone,
        }
    }
    fn as_u8(self) -> u8 {
        match self {
            StoreState::Active => 0,
            StoreState::Draining => 1,
            StoreState::Gone => 2,
        }
    }
}

enum Backend {
    Own(NodeId, Proclet<StripeStore>),
    Victim(Victim),
}

struct Victim {
    addr: String,
    secret: String,
    sealer: Arc<Sealer>,
    conn: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    timeout: Duration,
}

/// One store, own or victim.
pub struct Store {
    pub id: StoreId,
    /// Index of its class in the mount's layout (0: own, 1: victims).
    pub class: usize,
    /// What it is called in status and logs: `own:n3` or the victim's address.
    pub name: String,
    /// The market lease it comes from, if any.
    pub lease: Option<u64>,
    /// Bytes the mount may put there.
    pub capacity: AtomicU64,
    /// Bytes of stripe copies the mount keeps there (sealed size for victims).
    pub used: AtomicU64,
    /// Stripe copies there.
    pub stripes: AtomicU64,
    state: AtomicU8,
    backend: Backend,
    /// Count of failed operations (status, metrics).
    pub errors: AtomicU64,
    /// Copies that failed verification.
    pub tampered: AtomicU64,
    /// An own store on this machine: its arena, read in place.
    in_place: Mutex<Option<Arc<InPlace>>>,
    /// Stripe reads answered in place.
    pub in_place_reads: AtomicU64,
    /// Probes missed in a row (see `watch`); 0 after any answer.
    pub misses: AtomicU32,
    /// Probes missed in all (status, metrics).
    pub probes_missed: AtomicU64,
}

/// The store key of a stripe version: 8 bytes, big-endian (binary-safe in RESP).
fn key_of(version: u64) -> [u8; 8] {
    version.to_be_bytes()
}

/// What the metadata copy keeps of a store: enough to reach it again after the mount
/// that placed stripes there died (an own store's proclet handle; a victim's address
/// and secret).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StoreImage {
    pub id: StoreId,
    pub class: usize,
    pub name: String,
    pub lease: Option<u64>,
    pub capacity: u64,
    pub state: StoreState,
    pub own: Option<(NodeId, Proclet<StripeStore>)>,
    pub victim: Option<(String, String)>,
}

impl Store {
    /// The store again, from its image (the victims' sealer is the mount's, rebuilt from
    /// the same key).
    pub fn from_image(im: &StoreImage, sealer: Arc<Sealer>, timeout: Duration) -> Store {
        let s = match (&im.own, &im.victim) {
            (Some((node, p)), _) => Store::new(
                im.id,
                im.class,
                im.name.clone(),
                im.lease,
                im.capacity,
                Backend::Own(*node, p.clone()),
            ),
            (None, Some((addr, secret))) => {
                Store::victim(im.id, addr, secret, im.capacity, im.lease, sealer, timeout)
            }
            (None, None) => {
                let s = Store::victim(im.id, "-", "", 0, None, sealer, timeout);
                s.set_state(StoreState::Gone);
                s
            }
        };
        s.set_state(im.state);
        s
    }

    /// What the metadata copy keeps of this store.
    pub fn image(&self) -> StoreImage {
        let (own, victim) = match &self.backend {
            Backend::Own(node, p) => (Some((*node, p.clone())), None),
            Backend::Victim(v) => (None, Some((v.addr.clone(), v.secret.clone()))),
        };
        StoreImage {
            id: self.id,
            class: self.class,
            name: self.name.clone(),
            lease: self.lease,
            capacity: self.capacity.load(Ordering::Relaxed),
            state: self.state(),
            own,
            victim,
        }
    }

    /// The own node an own store lives on.
    pub fn node(&self) -> Option<NodeId> {
        match &self.backend {
            Backend::Own(n, _) => Some(*n),
            Backend::Victim(_) => None,
        }
    }

    /// A stripe store proclet on own node `node`, for stripes of up to `stripe` bytes.
    /// When the node is a process of this machine the mount reads its stripes in place.
    pub async fn own(
        id: StoreId,
        node: NodeId,
        capacity: u64,
        stripe: u64,
    ) -> Result<Store, StoreError> {
        // Hybrid: a store holds memory and also spends CPU moving stripes in bursts.
        let p = Proclet::<StripeStore>::builder(Kind::Hybrid)
            .on(node)
            .pinned()
            .footprint()
            .create_async((stripe, capacity), StripeStore::with_arena)
            .await
            .map_err(|e| StoreError::Lost(format!("creating the stripe store on {node}: {e}")))?;
        let arena = p
            .run_ref_async((), |s: &StripeStore, ()| s.arena_id())
            .await
            .map_err(call_error)?;
        let store = Store::new(
            id,
            0,
            format!("own:{node}"),
            None,
            capacity,
            Backend::Own(node, p),
        );
        if let Some((pid, fd, tag, len)) = arena {
            match PeerArena::open(&ArenaId { pid, fd, tag, len }) {
                Ok(arena) => {
                    tracing::debug!(store = %store.name, "stripes are read in place (shared memory)");
                    *store.in_place.lock() = Some(Arc::new(InPlace {
                        arena,
                        at: Mutex::new(HashMap::new()),
                    }));
                }
                // Another machine, or no right to open its descriptors: the network.
                Err(e) => {
                    tracing::debug!(store = %store.name, "stripes are read over the network: {e}")
                }
            }
        }
        Ok(store)
    }

    /// Whether the mount reads this store's stripes in place.
    pub fn reads_in_place(&self) -> bool {
        self.in_place.lock().is_some()
    }

    /// Whether the stripe stored as `version` can be read in place now.
    pub fn holds_in_place(&self, version: u64) -> bool {
        self.state() != StoreState::Gone
            && self
                .in_place
                .lock()
                .as_ref()
                .is_some_and(|v| v.at.lock().contains_key(&version))
    }

    /// The stripe stored as `version`, read in place without a call to the store; `None`
    /// when this store is not read in place or its place is not known (then [`Store::get`]).
    pub fn get_in_place(&self, version: u64) -> Option<Bytes> {
        if self.state() == StoreState::Gone {
            return None;
        }
        let view = self.in_place.lock().clone()?;
        let at = view.at.lock().get(&version).cloned()?;
        view.arena.slice(at.0, at.1)?;
        self.in_place_reads.fetch_add(1, Ordering::Relaxed);
        Some(Bytes::from_owner(InPlaceStripe { view, at }))
    }

    /// A victim store at `addr` (RESP, `AUTH secret`), holding up to `capacity` bytes.
    pub fn victim(
        id: StoreId,
        addr: &str,
        secret: &str,
        capacity: u64,
        lease: Option<u64>,
        sealer: Arc<Sealer>,
        timeout: Duration,
    ) -> Store {
        Store::new(
            id,
            1,
            addr.to_string(),
            lease,
            capacity,
            Backend::Victim(Victim {
                addr: addr.to_string(),
                secret: secret.to_string(),
                sealer,
                conn: tokio::sync::Mutex::new(None),
                timeout,
            }),
        )
    }

    fn new(
        id: StoreId,
        class: usize,
        name: String,
        lease: Option<u64>,
        capacity: u64,
        backend: Backend,
    ) -> Store {
        Store {
            id,
            class,
            name,
            lease,
            capacity: AtomicU64::new(capacity),
            used: AtomicU64::new(0),
            stripes: AtomicU64::new(0),
            state: AtomicU8::new(StoreState::Active.as_u8()),
            backend,
            errors: AtomicU64::new(0),
            tampered: AtomicU64::new(0),
            in_place: Mutex::new(None),
            in_place_reads: AtomicU64::new(0),
            misses: AtomicU32::new(0),
            probes_missed: AtomicU64::new(0),
        }
    }

    pub fn is_victim(&self) -> bool {
        matches!(self.backend, Backend::Victim(_))
    }

    pub fn state(&self) -> StoreState {
        StoreState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Active → draining, or the state it is in instead.
    pub fn begin_drain(&self) -> Result<(), StoreState> {
        self.state
            .compare_exchange(
                StoreState::Active.as_u8(),
                StoreState::Draining.as_u8(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .map(|_| ())
            .map_err(StoreState::from_u8)
    }

    pub fn set_state(&self, s: StoreState) {
        self.state.store(s.as_u8(), Ordering::Release);
        if s == StoreState::Gone {
            // Nothing is read here any more: the mapping goes once its last reader is done.
            self.in_place.lock().take();
        }
    }

    /// Bytes one copy of a `len`-byte stripe takes here.
    pub fn stored_size(&self, len: usize) -> u64 {
        match &self.backend {
            Backend::Own(..) => len as u64,
            Backend::Victim(v) => (len + v.sealer.overhead() + 8) as u64,
        }
    }

    /// Room left for the mount (capacity less what it keeps here).
    pub fn free(&self) -> u64 {
        self.capacity
            .load(Ordering::Relaxed)
            .saturating_sub(self.used.load(Ordering::Relaxed))
    }

    /// Claim room for one copy; false when it does not fit.
    pub fn reserve(&self, bytes: u64) -> bool {
        let cap = self.capacity.load(Ordering::Relaxed);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u + bytes <= cap).then_some(u + bytes)
            })
            .is_ok()
    }

    /// Give back room claimed with [`Store::reserve`].
    pub fn unreserve(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(bytes))
            });
    }

    /// Store `data` as `version` (room must have been reserved).
    pub async fn put(&self, version: u64, data: &Bytes) -> Result<(), StoreError> {
        let r = match &self.backend {
            Backend::Own(_, p) => p
                .run_async(
                    (version, Blob(data.clone())),
                    |s: &mut StripeStore, (k, v): (u64, Blob)| s.insert(k, v),
                )
                .await
                .map(|at| {
                    if let (Some(at), Some(view)) = (at, self.in_place.lock().as_ref()) {
                        view.at.lock().insert(version, Arc::new((at, data.len())));
                    }
                })
                .map_err(call_error),
            Backend::Victim(v) => {
                let sealed = v.sealer.seal(version, data);
                v.set(&key_of(version), sealed).await
            }
        };
        if r.is_ok() {
            self.stripes.fetch_add(1, Ordering::Relaxed);
        } else {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// The stripe stored as `version`, `Ok(None)` when the store does not hold it.
    pub async fn get(&self, version: u64) -> Result<Option<Bytes>, StoreError> {
        let r = match &self.backend {
            Backend::Own(_, p) => p
                .run_ref_async(version, |s: &StripeStore, k: u64| {
                    s.stripes.get(&k).cloned()
                })
                .await
                .map(|o| o.map(|v| v.0))
                .map_err(call_error),
            Backend::Victim(v) => match v.get(&key_of(version)).await {
                Ok(Some(sealed)) => match v.sealer.open(version, sealed) {
                    Ok(data) => Ok(Some(Bytes::from(data))),
                    Err(_) => {
                        self.tampered.fetch_add(1, Ordering::Relaxed);
                        Err(StoreError::Tampered)
                    }
                },
                Ok(None) => Ok(None),
                Err(e) => Err(e),
            },
        };
        if r.is_err() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Bytes `offset..offset+len` of the stripe stored as `version`, from an own store
    /// (a victim's stripes are sealed whole: `None`, read the whole stripe instead).
    pub async fn get_range(
        &self,
        version: u64,
        offset: usize,
        len: usize,
    ) -> Option<Result<Option<Bytes>, StoreError>> {
        let Backend::Own(_, p) = &self.backend else {
            return None;
        };
        let r = p
            .run_ref_async(
                (version, offset as u64, len as u64),
                |s: &StripeStore, (k, o, n): (u64, u64, u64)| {
                    s.stripes.get(&k).map(|v| {
                        let end = (o + n).min(v.0.len() as u64) as usize;
                        let start = (o as usize).min(end);
                        Blob(v.0.slice(start..end))
                    })
                },
            )
            .await
            .map(|o| o.map(|b| b.0))
            .map_err(call_error);
        if r.is_err() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        Some(r)
    }

    /// Forget `version`; `bytes` is the room its copy took.
    pub async fn delete(&self, version: u64, bytes: u64) -> Result<(), StoreError> {
        self.unreserve(bytes);
        let _ = self
            .stripes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(1))
            });
        // In-place readers of the stripe finish before its slot is freed (and reused).
        let view = self.in_place.lock().clone();
        if let Some(at) = view.and_then(|v| v.at.lock().remove(&version)) {
            let waiting = Instant::now();
            let mut warned = false;
            while Arc::strong_count(&at) > 1 {
                if !warned && waiting.elapsed() > Duration::from_secs(5) {
                    warned = true;
                    tracing::warn!(store = %self.name, "a reader has held stripe version {version} for over 5 s; its delete waits");
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
        if self.state() == StoreState::Gone {
            return Ok(());
        }
        match &self.backend {
            Backend::Own(_, p) => p
                .run_async(version, |s: &mut StripeStore, k: u64| {
                    if let Some(old) = s.stripes.remove(&k) {
                        s.bytes -= old.0.len() as u64;
                    }
                })
                .await
                .map_err(call_error),
            Backend::Victim(v) => v.del(&key_of(version)).await,
        }
    }

    /// Ask the store whether it is there, cheaply: a victim answers a `PING` (one
    /// round trip of a few bytes, far inside any rate limit), an own store a call that
    /// reads nothing. `Ok` when it answered in time, whatever it said.
    pub async fn probe(&self, within: Duration) -> Result<(), StoreError> {
        let asked = async {
            match &self.backend {
                Backend::Own(_, p) => p
                    .run_ref_async((), |_: &StripeStore, (): ()| ())
                    .await
                    .map_err(call_error),
                Backend::Victim(v) => v.ping().await,
            }
        };
        match tokio::time::timeout(within, asked).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Other(format!(
                "{}: no answer to a probe within {within:?}",
                self.name
            ))),
        }
    }

    /// Free the store's resources when the mount ends (own proclets are destroyed).
    pub async fn close(&self) {
        self.in_place.lock().take();
        if let Backend::Own(_, p) = &self.backend {
            let _ = p.destroy_async().await;
        }
    }
}

fn call_error(e: granule_runtime::CallError) -> StoreError {
    use granule_runtime::CallError as C;
    match e {
        C::NodeUnreachable { .. } | C::ProcletGone(_) | C::NoCluster => {
            StoreError::Lost(e.to_string())
        }
        other => StoreError::Other(other.to_string()),
    }
}

fn redis_error(e: redis::RedisError) -> StoreError {
    if e.code() == Some("OOM") {
        return StoreError::Full;
    }
    if !e.is_timeout()
        && (e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_unrecoverable_error())
    {
        return StoreError::Lost(e.to_string());
    }
    StoreError::Other(e.to_string())
}

/// How long a rate-limited request keeps retrying before it fails.
const RATE_RETRY_FOR: Duration = Duration::from_secs(30);

impl Victim {
    async fn conn(&self) -> Result<MultiplexedConnection, StoreError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let (host, port) = self
            .addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| StoreError::Other(format!("bad store address '{}'", self.addr)))?;
        let info = redis::ConnectionInfo {
            addr: redis::ConnectionAddr::Tcp(host, port),
            redis: redis::RedisConnectionInfo {
                password: Some(self.secret.clone()),
                ..Default::default()
            },
        };
        let client = redis::Client::open(info).map_err(redis_error)?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(self.timeout)
            .set_response_timeout(self.timeout);
        let c = tokio::time::timeout(
            self.timeout,
            client.get_multiplexed_async_connection_with_config(&cfg),
        )
        .await
        .map_err(|_| StoreError::Lost(format!("{}: connect timed out", self.addr)))?
        .map_err(redis_error)?;
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn drop_conn(&self) {
        *self.conn.lock().await = None;
    }

    /// Run one command, retrying while the store's rate limit refuses it and once after
    /// a dropped connection.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        let start = Instant::now();
        let mut reconnects = 0;
        let mut backoff = Duration::from_millis(2);
        loop {
            let mut c = self.conn().await?;
            match cmd.query_async::<T>(&mut c).await {
                Ok(v) => return Ok(v),
                Err(e) if e.to_string().contains("rate limit") => {
                    if start.elapsed() > RATE_RETRY_FOR {
                        return Err(StoreError::Other(e.to_string()));
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(100));
                }
                Err(e) => {
                    let err = redis_error(e);
                    if matches!(err, StoreError::Lost(_)) && reconnects == 0 {
                        reconnects += 1;
                        self.drop_conn().await;
                        continue;
                    }
                    return Err(err);
                }
            }
        }
    }

    /// One `PING`, not retried: a store that refuses it for its rate limit answered,
    /// so it is there; a dropped connection is dropped here too, so the next probe
    /// connects afresh (and fails at once against a dead process).
    async fn ping(&self) -> Result<(), StoreError> {
        let mut c = self.conn().await?;
        match redis::cmd("PING").query_async::<String>(&mut c).await {
            Ok(_) => Ok(()),
            Err(e) if e.to_string().contains("rate limit") => Ok(()),
            Err(e) => {
                let err = redis_error(e);
                if matches!(err, StoreError::Lost(_)) {
                    self.drop_conn().await;
                }
                Err(err)
            }
        }
    }

    async fn set(&self, key: &[u8], value: Vec<u8>) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key).arg(value);
        self.query::<()>(&cmd).await
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        self.query::<Option<Vec<u8>>>(&cmd).await
    }

    async fn del(&self, key: &[u8]) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(key);
        self.query::<i64>(&cmd).await.map(|_| ())
    }
}

/// Ask a victim store how many bytes it holds at most (`INFO`'s `maxmemory`).
pub async fn victim_capacity(
    addr: &str,
    secret: &str,
    timeout: Duration,
) -> Result<u64, StoreError> {
    let v = Victim {
        addr: addr.to_string(),
        secret: secret.to_string(),
        sealer: Arc::new(Sealer::new(
            granule_market::consumer::Protection::None,
            &[0; 32],
        )),
        conn: tokio::sync::Mutex::new(None),
        timeout,
    };
    let mut cmd = redis::cmd("INFO");
    cmd.arg("memory");
    let info: String = v.query(&cmd).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("maxmemory:"))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| StoreError::Other(format!("{addr}: INFO names no maxmemory")))
}

/// The mount's stores, by id.
#[derive(Default)]
pub struct Stores {
    pub by_id: Mutex<HashMap<StoreId, Arc<Store>>>,
}

impl Stores {
    pub fn get(&self, id: StoreId) -> Option<Arc<Store>> {
        self.by_id.lock().get(&id).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Store>> {
        let mut v: Vec<_> = self.by_id.lock().values().cloned().collect();
        v.sort_by_key(|s| s.id);
        v
    }

    pub fn insert(&self, s: Store) -> Arc<Store> {
        let s = Arc::new(s);
        self.by_id.lock().insert(s.id, s.clone());
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_market::consumer::Protection;

    fn victim() -> Store {
        let sealer = Arc::new(Sealer::new(Protection::Encrypt, &[1; 32]));
        Store::victim(
            3,
            "127.0.0.1:1",
            "s",
            1 << 20,
            Some(9),
            sealer,
            Duration::from_secs(1),
        )
    }

    #[test]
    fn a_store_drains_once() {
        let s = victim();
        assert_eq!(s.begin_drain(), Ok(()));
        // A second drain (a refused renewal after the revocation) finds it draining.
        assert_eq!(s.begin_drain(), Err(StoreState::Draining));
        s.set_state(StoreState::Gone);
        assert_eq!(s.begin_drain(), Err(StoreState::Gone));
    }

    #[test]
    fn an_image_brings_the_store_back() {
        let s = victim();
        s.set_state(StoreState::Draining);
        let im = s.image();
        assert_eq!(im.victim, Some(("127.0.0.1:1".into(), "s".into())));
        let sealer = Arc::new(Sealer::new(Protection::Encrypt, &[1; 32]));
        let back = Store::from_image(&im, sealer, Duration::from_secs(1));
        assert_eq!(
            (back.id, back.lease, back.state(), back.is_victim()),
            (3, Some(9), StoreState::Draining, true)
        );
        assert_eq!(back.capacity.load(Ordering::Relaxed), 1 << 20);
    }
}
