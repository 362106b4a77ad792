//! [`KvCache`]: the consumer's cache over leased stores — metadata, placement, the
//! store connections and the lease life cycle (acquire, renew, drop on loss or revocation,
//! replace).

use super::seal::{store_key, Sealer};
use super::{CacheStats, ConsumerError, LeaseGrant, LeaseId, LeaseSource, Protection};
use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long one store operation (or connecting) may take before it counts as a miss.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// Where a key's current value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    lease: LeaseId,
    counter: u64,
    len: u64,
}

/// A live lease and its connection.
struct Live {
    grant: LeaseGrant,
    conn: MultiplexedConnection,
}

struct State {
    leases: HashMap<LeaseId, Live>,
    entries: HashMap<Vec<u8>, Entry>,
    next_counter: u64,
    bytes_stored: u64,
    /// Leases dropped because their store failed: released at the next `maintain`.
    to_release: Vec<LeaseId>,
}

#[derive(Default)]
struct Counters {
    gets: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    puts: AtomicU64,
    deletes: AtomicU64,
    verification_failures: AtomicU64,
    lost_leases: AtomicU64,
    store_errors: AtomicU64,
}

/// The metadata file of an [`KvCache::open`]ed cache.
#[derive(Serialize, Deserialize)]
struct Saved {
    protection: String,
    /// The master key, hex.
    key: String,
    next_counter: u64,
    grants: Vec<LeaseGrant>,
    /// (application key in hex, entry).
    entries: Vec<(String, Entry)>,
}

/// A key-value cache over leased producer stores.
///
/// Values are stored under a fresh counter per PUT and sealed (see [`Protection`]); the
/// local metadata maps each key to (lease, counter, length). A GET whose value is gone,
/// fails verification, or whose lease or store is lost is a miss (`Ok(None)`): a store
/// can make the cache miss, never return wrong data. Keys go to leases by weighted
/// rendezvous hashing (weight: the lease's slabs).
pub struct KvCache {
    source: Arc<dyn LeaseSource>,
    sealer: Sealer,
    master: [u8; 32],
    target_slabs: u32,
    path: Option<PathBuf>,
    timeout_ms: AtomicU64,
    state: Mutex<State>,
    n: Counters,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// splitmix64's finaliser: a cheap, well-mixed 64-bit hash of a 64-bit value.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn key_hash(key: &[u8]) -> u64 {
    // Fixed SipHash keys: placement must be the same in every process sharing a file.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

/// Weighted rendezvous score of `lease` for a key hash: -w / ln(u), u in (0, 1).
fn score(kh: u64, lease: LeaseId, weight: u32) -> f64 {
    let u = ((mix(kh ^ mix(lease)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -(weight.max(1) as f64) / u.ln()
}

/// A failure that means the store is gone (not just slow or refusing one command).
fn is_lost(e: &redis::RedisError) -> bool {
    // A slow answer is a miss, not a lost store: the lease stays.
    !e.is_timeout()
        && (e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_unrecoverable_error())
}

async fn connect(
    grant: &LeaseGrant,
    timeout: Duration,
) -> Result<MultiplexedConnection, ConsumerError> {
    let (host, port) = grant
        .store_addr
        .rsplit_once(':')
        .ok_or_else(|| ConsumerError::Store(format!("bad store address '{}'", grant.store_addr)))?;
    let port: u16 = port
        .parse()
        .map_err(|_| ConsumerError::Store(format!("bad store address '{}'", grant.store_addr)))?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let info = redis::ConnectionInfo {
        addr: redis::ConnectionAddr::Tcp(host, port),
        redis: redis::RedisConnectionInfo {
            password: Some(grant.secret.clone()),
            ..Default::default()
        },
    };
    let client = redis::Client::open(info).map_err(|e| ConsumerError::Store(e.to_string()))?;
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout);
    let conn = tokio::time::timeout(
        timeout,
        client.get_multiplexed_async_connection_with_config(&cfg),
    )
    .await
    .map_err(|_| ConsumerError::Store(format!("store {}: connect timed out", grant.store_addr)))?
    .map_err(|e| ConsumerError::Store(format!("store {}: {e}", grant.store_addr)))?;
    Ok(conn)
}

impl KvCache {
    /// Start with `slabs` slabs from `source` (fewer is fine; zero means every GET
    /// misses until leases arrive).
    pub async fn new(
        source: Arc<dyn LeaseSource>,
        protection: Protection,
        slabs: u32,
    ) -> Result<KvCache, ConsumerError> {
        let master: [u8; 32] = rand::random();
        let cache = KvCache::build(source, protection, slabs, master, None, 0);
        cache.top_up().await?;
        Ok(cache)
    }

    /// Same, with metadata and key material loaded from / saved to `path` (JSON, mode
    /// 0600) so separate processes share a cache; the grants it holds are in the file
    /// too. A file made with another protection keeps its key but not its entries.
    pub async fn open(
        path: &Path,
        source: Arc<dyn LeaseSource>,
        protection: Protection,
        slabs: u32,
    ) -> Result<KvCache, ConsumerError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(ConsumerError::Metadata(format!("{}: {e}", path.display()))),
        };
        let Some(text) = text else {
            let master: [u8; 32] = rand::random();
            let cache = KvCache::build(source, protection, slabs, master, Some(path.into()), 0);
            cache.top_up().await?;
            cache.save().await?;
            return Ok(cache);
        };
        let bad = |why: String| ConsumerError::Metadata(format!("{}: {why}", path.display()));
        let saved: Saved = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let key = hex::decode(&saved.key).map_err(|e| bad(e.to_string()))?;
        let master: [u8; 32] = key
            .try_into()
            .map_err(|_| bad("key is not 32 bytes".into()))?;
        let cache = KvCache::build(
            source,
            protection,
            slabs,
            master,
            Some(path.into()),
            saved.next_counter,
        );
        let now = now_ms();
        for g in saved.grants {
            if g.expires_unix_ms <= now {
                continue;
            }
            cache.source.hold(&g);
            cache.attach(g).await;
        }
        if Protection::parse(&saved.protection).ok() == Some(protection) {
            let mut st = cache.state.lock();
            for (k, e) in saved.entries {
                let Ok(k) = hex::decode(&k) else { continue };
                if st.leases.contains_key(&e.lease) {
                    st.bytes_stored += e.len;
                    st.entries.insert(k, e);
                }
            }
        }
        cache.top_up().await?;
        Ok(cache)
    }

    fn build(
        source: Arc<dyn LeaseSource>,
        protection: Protection,
        slabs: u32,
        master: [u8; 32],
        path: Option<PathBuf>,
        next_counter: u64,
    ) -> KvCache {
        KvCache {
            source,
            sealer: Sealer::new(protection, &master),
            master,
            target_slabs: slabs,
            path,
            timeout_ms: AtomicU64::new(DEFAULT_STORE_TIMEOUT.as_millis() as u64),
            state: Mutex::new(State {
                leases: HashMap::new(),
                entries: HashMap::new(),
                next_counter,
                bytes_stored: 0,
                to_release: Vec::new(),
            }),
            n: Counters::default(),
        }
    }

    /// How long one store operation may take before it counts as a miss (or a failed
    /// PUT); default `DEFAULT_STORE_TIMEOUT` (1 s).
    pub fn set_store_timeout(&self, timeout: Duration) {
        self.timeout_ms
            .store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    pub fn protection(&self) -> Protection {
        self.sealer.protection()
    }

    /// Connect to a grant's store; a store that cannot be reached is a lost lease.
    async fn attach(&self, grant: LeaseGrant) -> bool {
        match connect(&grant, self.timeout()).await {
            Ok(conn) => {
                self.state
                    .lock()
                    .leases
                    .insert(grant.lease, Live { grant, conn });
                true
            }
            Err(e) => {
                tracing::warn!("lease {}: {e}; dropped", grant.lease);
                self.n.store_errors.fetch_add(1, Ordering::Relaxed);
                self.n.lost_leases.fetch_add(1, Ordering::Relaxed);
                self.state.lock().to_release.push(grant.lease);
                false
            }
        }
    }

    /// Ask the source for what is missing up to the target.
    async fn top_up(&self) -> Result<(), ConsumerError> {
        let held: u32 = {
            let st = self.state.lock();
            st.leases.values().map(|l| l.grant.slabs).sum()
        };
        if held >= self.target_slabs {
            return Ok(());
        }
        let grants = self.source.acquire(self.target_slabs - held).await?;
        let attached = futures::future::join_all(grants.into_iter().map(|g| self.attach(g))).await;
        tracing::debug!(
            "attached {} of {} new leases",
            attached.iter().filter(|a| **a).count(),
            attached.len()
        );
        Ok(())
    }

    /// Forget a lease: its keys become misses.
    fn drop_lease(&self, lease: LeaseId, release: bool) {
        let mut st = self.state.lock();
        if st.leases.remove(&lease).is_none() {
            return;
        }
        self.n.lost_leases.fetch_add(1, Ordering::Relaxed);
        let mut freed = 0;
        st.entries.retain(|_, e| {
            let keep = e.lease != lease;
            if !keep {
                freed += e.len;
            }
            keep
        });
        st.bytes_stored -= freed;
        if release {
            st.to_release.push(lease);
        }
    }

    /// Remove `key`'s entry if it is still the one with `counter`.
    fn forget(&self, key: &[u8], counter: u64) {
        let mut st = self.state.lock();
        if st.entries.get(key).map(|e| e.counter) == Some(counter) {
            if let Some(e) = st.entries.remove(key) {
                st.bytes_stored -= e.len;
            }
        }
    }

    fn store_failed(&self, lease: LeaseId, e: &redis::RedisError) {
        self.n.store_errors.fetch_add(1, Ordering::Relaxed);
        if is_lost(e) {
            tracing::warn!("lease {lease}: store lost ({e}); its keys are misses now");
            self.drop_lease(lease, true);
        }
    }

    fn miss(&self) -> Result<Option<Vec<u8>>, ConsumerError> {
        self.n.misses.fetch_add(1, Ordering::Relaxed);
        Ok(None)
    }

    /// The value of `key`, or `None` on a miss (never stored, evicted, deleted, its lease
    /// lost, its store failing, or a value that did not verify).
    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ConsumerError> {
        self.n.gets.fetch_add(1, Ordering::Relaxed);
        let (entry, mut conn) = {
            let st = self.state.lock();
            let Some(e) = st.entries.get(key).copied() else {
                drop(st);
                return self.miss();
            };
            match st.leases.get(&e.lease) {
                Some(l) => (e, l.conn.clone()),
                None => {
                    drop(st);
                    return self.miss();
                }
            }
        };
        let sk = store_key(entry.counter);
        let res = tokio::time::timeout(
            self.timeout(),
            redis::cmd("GET")
                .arg(&sk[..])
                .query_async::<Option<Vec<u8>>>(&mut conn),
        )
        .await;
        let bytes = match res {
            Err(_) => {
                self.n.store_errors.fetch_add(1, Ordering::Relaxed);
                return self.miss();
            }
            Ok(Err(e)) => {
                self.store_failed(entry.lease, &e);
                return self.miss();
            }
            Ok(Ok(None)) => {
                // Evicted by the store (LRU) or dropped with its memory.
                self.forget(key, entry.counter);
                return self.miss();
            }
            Ok(Ok(Some(b))) => b,
        };
        match self.sealer.open(entry.counter, bytes) {
            Ok(v) if v.len() as u64 == entry.len => {
                self.n.hits.fetch_add(1, Ordering::Relaxed);
                Ok(Some(v))
            }
            _ => {
                self.n.verification_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "lease {}: a value failed verification; discarded",
                    entry.lease
                );
                self.forget(key, entry.counter);
                self.miss()
            }
        }
    }

    /// Store `value` under `key` (a fresh counter, sealed). `Err(NoLease)` when no lease
    /// is live; a store that is lost on the way is dropped and the next lease tried.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), ConsumerError> {
        self.n.puts.fetch_add(1, Ordering::Relaxed);
        let kh = key_hash(key);
        loop {
            let (lease, mut conn, counter, old) = {
                let mut st = self.state.lock();
                let Some((lease, conn)) = st
                    .leases
                    .iter()
                    .map(|(id, l)| (score(kh, *id, l.grant.slabs), id, l))
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map(|(_, id, l)| (*id, l.conn.clone()))
                else {
                    return Err(ConsumerError::NoLease);
                };
                let counter = st.next_counter;
                st.next_counter += 1;
                // The old value stops being readable now: a failed PUT must not leave the
                // previous value to be read back as if it were current.
                let old = st.entries.remove(key);
                if let Some(o) = &old {
                    st.bytes_stored -= o.len;
                }
                (lease, conn, counter, old)
            };
            let sealed = self.sealer.seal(counter, value);
            let sk = store_key(counter);
            let mut pipe = redis::pipe();
            pipe.cmd("SET").arg(&sk[..]).arg(sealed).ignore();
            if let Some(o) = old.filter(|o| o.lease == lease) {
                pipe.cmd("DEL").arg(&store_key(o.counter)[..]).ignore();
            } else if let Some(o) = old {
                self.spawn_del(o);
            }
            let res = tokio::time::timeout(self.timeout(), pipe.query_async::<()>(&mut conn)).await;
            match res {
                Ok(Ok(())) => {
                    let mut st = self.state.lock();
                    if !st.leases.contains_key(&lease) {
                        continue; // lost meanwhile: store elsewhere
                    }
                    let e = Entry {
                        lease,
                        counter,
                        len: value.len() as u64,
                    };
                    // A concurrent PUT of the same key with a later counter wins.
                    let newer = st.entries.get(key).filter(|x| x.counter > counter).copied();
                    match newer {
                        Some(_) => {
                            drop(st);
                            self.spawn_del(e);
                        }
                        None => {
                            st.bytes_stored += e.len;
                            if let Some(prev) = st.entries.insert(key.to_vec(), e) {
                                st.bytes_stored -= prev.len;
                                drop(st);
                                self.spawn_del(prev);
                            }
                        }
                    }
                    return Ok(());
                }
                Ok(Err(e)) if is_lost(&e) => self.store_failed(lease, &e),
                Ok(Err(e)) => {
                    self.n.store_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(ConsumerError::Store(e.to_string()));
                }
                Err(_) => {
                    self.n.store_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(ConsumerError::Store("store timed out".into()));
                }
            }
        }
    }

    /// Delete a stale stored value in the background (best effort: an unreachable value
    /// only costs the store's memory until LRU or the lease's end).
    fn spawn_del(&self, e: Entry) {
        let conn = self
            .state
            .lock()
            .leases
            .get(&e.lease)
            .map(|l| l.conn.clone());
        if let Some(mut conn) = conn {
            let t = self.timeout();
            tokio::spawn(async move {
                let sk = store_key(e.counter);
                let _ = tokio::time::timeout(
                    t,
                    redis::cmd("DEL").arg(&sk[..]).query_async::<()>(&mut conn),
                )
                .await;
            });
        }
    }

    /// Delete `key`; whether it was cached.
    pub async fn delete(&self, key: &[u8]) -> Result<bool, ConsumerError> {
        self.n.deletes.fetch_add(1, Ordering::Relaxed);
        let (e, conn) = {
            let mut st = self.state.lock();
            let Some(e) = st.entries.remove(key) else {
                return Ok(false);
            };
            st.bytes_stored -= e.len;
            (e, st.leases.get(&e.lease).map(|l| l.conn.clone()))
        };
        if let Some(mut conn) = conn {
            let sk = store_key(e.counter);
            match tokio::time::timeout(
                self.timeout(),
                redis::cmd("DEL").arg(&sk[..]).query_async::<()>(&mut conn),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(err)) => self.store_failed(e.lease, &err),
                Err(_) => {
                    self.n.store_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(true)
    }

    pub fn stats(&self) -> CacheStats {
        let (bytes_stored, leases) = {
            let st = self.state.lock();
            (st.bytes_stored, st.leases.len() as u64)
        };
        let n = &self.n;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStats {
            gets: ld(&n.gets),
            hits: ld(&n.hits),
            misses: ld(&n.misses),
            puts: ld(&n.puts),
            deletes: ld(&n.deletes),
            verification_failures: ld(&n.verification_failures),
            lost_leases: ld(&n.lost_leases),
            store_errors: ld(&n.store_errors),
            bytes_stored,
            leases,
        }
    }

    /// The live leases' grants.
    pub fn leases(&self) -> Vec<LeaseGrant> {
        let st = self.state.lock();
        let mut v: Vec<LeaseGrant> = st.leases.values().map(|l| l.grant.clone()).collect();
        v.sort_by_key(|g| g.lease);
        v
    }

    /// Renew leases that expire within `within`; drop revoked, expired and failed ones
    /// (their keys become misses), release failed ones, and ask for replacements.
    pub async fn maintain(&self, within: Duration) -> Result<(), ConsumerError> {
        for r in self.source.take_revoked() {
            self.drop_lease(r.lease, false);
        }
        let now = now_ms();
        let expiring: Vec<(LeaseId, u64)> = {
            let st = self.state.lock();
            st.leases
                .values()
                .filter(|l| l.grant.expires_unix_ms <= now + within.as_millis() as u64)
                .map(|l| (l.grant.lease, l.grant.expires_unix_ms))
                .collect()
        };
        for (lease, expires) in expiring {
            match self.source.renew(lease).await {
                Ok(t) => {
                    if let Some(l) = self.state.lock().leases.get_mut(&lease) {
                        l.grant.expires_unix_ms = t;
                    }
                }
                Err(e) if expires <= now => {
                    tracing::warn!("lease {lease} expired ({e}); its keys are misses now");
                    self.drop_lease(lease, false);
                }
                Err(e) => tracing::debug!("lease {lease}: renewal failed ({e}); retried later"),
            }
        }
        let failed = std::mem::take(&mut self.state.lock().to_release);
        for lease in failed {
            if let Err(e) = self.source.release(lease).await {
                tracing::debug!("lease {lease}: release failed: {e}");
            }
        }
        self.top_up().await
    }

    /// Write the metadata file (for [`KvCache::open`]ed caches; a no-op otherwise).
    pub async fn save(&self) -> Result<(), ConsumerError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let saved = {
            let st = self.state.lock();
            Saved {
                protection: self.sealer.protection().as_str().into(),
                key: hex::encode(self.master),
                next_counter: st.next_counter,
                grants: st.leases.values().map(|l| l.grant.clone()).collect(),
                entries: st
                    .entries
                    .iter()
                    .map(|(k, e)| (hex::encode(k), *e))
                    .collect(),
            }
        };
        let text =
            serde_json::to_string(&saved).map_err(|e| ConsumerError::Metadata(e.to_string()))?;
        write_private(path, text.as_bytes())
            .map_err(|e| ConsumerError::Metadata(format!("{}: {e}", path.display())))
    }
}

/// Write `bytes` to `path` through a temporary file with mode 0600 and a rename, so a
/// reader never sees half a file and nobody else can read the key material.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}
