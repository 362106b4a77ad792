//! A producer's stores: one per lease, each a TCP server speaking the Redis protocol
//! (RESP2, and RESP3 after `HELLO 3`) over the leased memory, so `redis-cli`,
//! `redis-benchmark` and client libraries (redis-py with its defaults) work against it
//! unmodified.
//!
//! What it owns:
//! - [`Store`]: one store's thread, listener, connections and data. Each store runs on a
//!   thread of its own with a single-threaded tokio runtime (optionally pinned to a vCPU):
//!   one event loop per store, like Redis, so a store's work never migrates and the data's
//!   lock is never contended by its own connections;
//! - the connections: pipelining (every command parsed from one read is answered in one
//!   write), their buffers (small until a client authenticates, given back after a large
//!   command, counted against the store's capacity with the data), the connection bounds;
//! - the bounds (bulk length, argument count, connections), the per-consumer token bucket,
//!   and the capacity: approximate-LRU eviction or, in no-eviction mode, `-OOM` refusals
//!   ([`keyspace`]); [`shrink_in_proportion`] for a harvester taking memory back;
//! - giving freed memory back to the system (after `FLUSHDB`, an eviction or delete wave,
//!   the store's end), through `granule_host::os::release_free_memory`;
//! - the commands and their replies (`commands`: `AUTH`, `HELLO`, `GET`, `SET` with its
//!   options, `DEL`, `EXISTS`, `MGET`, `MSET`, `EXPIRE`, `TTL`, `MULTI`/`EXEC`/`DISCARD`,
//!   `INFO`, `CONFIG GET`, `CLIENT`, ...) and the request decoder ([`resp`]).
//!
//! Security: a client that has not authenticated costs the machine almost nothing. Until
//! `AUTH` (or `HELLO … AUTH`) succeeds a connection gets `-NOAUTH` for everything else, may
//! send commands of at most 10 arguments of at most 16 KiB (Redis's rule; past it, a
//! protocol error and the connection is closed), is closed after
//! `market.store_auth_timeout`, and past `market.store_max_unauthenticated` of them (or
//! when every connection is taken) a new connection closes the oldest that had a tenth of
//! that time to authenticate, so strangers cannot hold the lease holder's room.
//! Secrets are compared as BLAKE3 digests (constant-time equality). A protocol error
//! closes that connection only, after an `-ERR Protocol error: ...` reply.

mod commands;
pub mod keyspace;
pub mod resp;

use bytes::{Buf, BytesMut};
pub use granule_wire::market::EvictionMode;
use keyspace::Keyspace;
use parking_lot::Mutex;
use resp::Limits;
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// One store's settings.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The lease size: the store's capacity (keys + values + per-entry overhead, see
    /// [`keyspace::ENTRY_OVERHEAD`]).
    pub bytes: u64,
    /// The `AUTH` password (must not be empty).
    pub secret: String,
    pub mode: EvictionMode,
    /// Token bucket of this lease's consumer: bytes per second of requests and replies
    /// (burst: one second's worth); 0 = off.
    pub rate_bps: u64,
    /// Who holds the lease (logs, `INFO`).
    pub consumer: String,
    pub max_connections: usize,
    /// Largest bulk string accepted.
    pub max_bulk: usize,
    /// Most arguments in one command.
    pub max_args: usize,
    /// How long a connection may stay unauthenticated before it is closed.
    pub auth_timeout: Duration,
    /// Unauthenticated connections past which (or when all connections are open) a new
    /// one closes the oldest that had `auth_timeout / 10` to authenticate.
    pub max_unauthenticated: usize,
}

impl StoreConfig {
    /// A store of `bytes` with the configuration's defaults for the rest.
    pub fn new(bytes: u64, secret: impl Into<String>, mode: EvictionMode) -> StoreConfig {
        StoreConfig::from_market(&granule_config::Market::default(), bytes, secret, mode)
    }

    /// A store of `bytes` with the bounds and rate of the `[market]` configuration.
    pub fn from_market(
        m: &granule_config::Market,
        bytes: u64,
        secret: impl Into<String>,
        mode: EvictionMode,
    ) -> StoreConfig {
        StoreConfig {
            bytes,
            secret: secret.into(),
            mode,
            rate_bps: m.store_rate,
            consumer: String::new(),
            max_connections: usize::try_from(m.store_max_connections).unwrap_or(usize::MAX),
            max_bulk: usize::try_from(m.store_max_bulk).unwrap_or(usize::MAX),
            max_args: usize::try_from(m.store_max_args).unwrap_or(usize::MAX),
            auth_timeout: m.store_auth_timeout,
            max_unauthenticated: usize::try_from(m.store_max_unauthenticated).unwrap_or(usize::MAX),
        }
    }
}

/// One store's counters.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StoreStats {
    /// Bytes counted against the capacity now.
    pub used_bytes: u64,
    pub capacity: u64,
    pub keys: u64,
    pub hits: u64,
    pub misses: u64,
    /// Bytes evicted (LRU at the capacity, and by [`Store::resize`]).
    pub evicted_bytes: u64,
    /// Writes refused with `-OOM` (no-eviction store full).
    pub rejected_writes: u64,
    /// Requests refused by the token bucket.
    pub rate_limited: u64,
    /// Connections open now.
    pub connections: u64,
    /// Of those, connections that have not authenticated.
    pub unauthenticated: u64,
    /// Bytes the connections hold in buffers (read buffers, replies, queued
    /// transactions), counted against the capacity with the data.
    pub buffer_bytes: u64,
    pub auth_failures: u64,
    pub commands: u64,
    pub protocol_errors: u64,
    /// Times the store gave freed memory back to the system.
    pub memory_releases: u64,
}

/// Why a store could not start.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("store: a lease's secret must not be empty")]
    EmptySecret,
    #[error("store: cannot start its thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Reply texts clients recognise (kept as Redis words them where Redis has the case).
const NOAUTH: &[u8] = b"-NOAUTH Authentication required.\r\n";
const OOM: &[u8] = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n";
const MAX_CLIENTS: &[u8] = b"-ERR max number of clients reached\r\n";
const SYNTAX: &[u8] = b"-ERR syntax error\r\n";
const NOT_INT: &[u8] = b"-ERR value is not an integer or out of range\r\n";

/// How often the active expiry cycle runs.
const EXPIRE_PERIOD: Duration = Duration::from_millis(100);

/// A connection's read buffer grows by at least this much once it authenticated.
const READ_CHUNK: usize = 16 << 10;

/// ... and by this much before: a stranger's connection holds little.
const PRE_AUTH_CHUNK: usize = 1 << 10;

/// Buffers past this size are given back after the command that needed them (one large
/// value or reply must not pin its buffer for the life of the connection); below it they
/// are kept, so pipelined traffic does not reallocate per batch.
const SHRINK_ABOVE: usize = 1 << 20;

/// What a connection may send before it authenticates (Redis's rule: a multibulk of at
/// most 10 arguments, bulk strings of at most 16 KiB; past them, a protocol error and the
/// connection is closed). Enough for `AUTH`, `HELLO 3 AUTH user pass SETNAME name` and
/// the commands clients send first.
const PRE_AUTH: Limits = Limits {
    max_bulk: 16 << 10,
    max_args: 10,
    max_inline: 16 << 10,
};

/// The state every connection of a store shares, behind one lock taken once per read.
struct Inner {
    ks: Keyspace,
    /// Milliseconds since `epoch`, refreshed once per batch.
    now_ms: u64,
    bucket: Bucket,
    hits: u64,
    misses: u64,
    rejected_writes: u64,
    rate_limited: u64,
    auth_failures: u64,
    commands: u64,
    protocol_errors: u64,
    connections_total: u64,
    /// Times freed memory was given back to the system.
    memory_releases: u64,
    /// The most the data held (as seen by the expiry cycle) since the last time.
    peak_since_release: u64,
}

impl Inner {
    /// Give the memory the allocator holds but no longer uses back to the system (after
    /// FLUSHDB, an eviction wave, the lease's end): the machine's owner gets back what
    /// the store no longer holds, not just what it never took.
    fn release_memory(&mut self) {
        granule_host::os::release_free_memory();
        self.memory_releases += 1;
        self.peak_since_release = self.ks.used();
    }

    /// [`Inner::release_memory`] once the data shrank by an eighth of the capacity (at
    /// least [`RELEASE_WAVE_MIN`]) from its peak since the last time: after a wave of
    /// deletes, expiries or evictions, not while a full LRU store replaces what it evicts
    /// (its memory is about to be used again).
    fn release_after_wave(&mut self) {
        let used = self.ks.used();
        self.peak_since_release = self.peak_since_release.max(used);
        if self.peak_since_release - used >= (self.ks.capacity() / 8).max(RELEASE_WAVE_MIN) {
            self.release_memory();
        }
    }
}

/// The smallest wave of dropped entries worth giving memory back for (a trim walks the
/// allocator's free lists: not for every few deletes).
const RELEASE_WAVE_MIN: u64 = 1 << 20;

/// A token bucket: `rate` bytes per second, bursts of one second's worth. A request is
/// refused while the bucket is empty; its cost (request and reply bytes) is charged
/// after it ran, so the bucket may go into debt by one request.
struct Bucket {
    rate: u64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate: u64) -> Bucket {
        Bucket {
            rate,
            tokens: rate as f64,
            last: Instant::now(),
        }
    }

    fn refill(&mut self, now: Instant) {
        if self.rate == 0 {
            return;
        }
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate as f64).min(self.rate as f64);
    }

    fn allows(&self) -> bool {
        self.rate == 0 || self.tokens > 0.0
    }

    fn charge(&mut self, bytes: usize) {
        if self.rate != 0 {
            self.tokens -= bytes as f64;
        }
    }
}

struct Shared {
    inner: Mutex<Inner>,
    secret: blake3::Hash,
    limits: Limits,
    max_connections: u64,
    connections: AtomicU64,
    auth_timeout: Duration,
    max_unauthenticated: usize,
    /// Connections not yet authenticated, oldest first (by connection number), each with
    /// the signal that closes it when a newer connection needs its place, and when it
    /// was accepted.
    unauthed: Mutex<BTreeMap<u64, (Arc<Notify>, Instant)>>,
    /// Connections numbered so far.
    conn_ids: AtomicU64,
    /// Bytes every connection's buffers hold now (see [`Counted`]).
    buffers: AtomicU64,
    epoch: Instant,
    port: u16,
    consumer: String,
    stop: tokio::sync::watch::Sender<bool>,
}

/// A producer store: one lease's Redis-protocol server. `Send + Sync`; stops on
/// [`Store::shutdown`] or when dropped.
pub struct Store {
    shared: Arc<Shared>,
    addr: SocketAddr,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("addr", &self.addr).finish()
    }
}

impl Store {
    /// Bind `listen` (e.g. `127.0.0.1:0`) and serve. The store runs on a thread of its
    /// own with its own single-threaded tokio runtime, so this works from inside a tokio
    /// runtime (a producer's) and outside one (a benchmark); it returns once the listener
    /// is bound.
    pub fn start(listen: &str, cfg: StoreConfig) -> Result<Store, StoreError> {
        Store::start_pinned(listen, cfg, None)
    }

    /// [`Store::start`], with the store's thread pinned to vCPU `cpu` when given (a
    /// failure to pin is logged and ignored).
    pub fn start_pinned(
        listen: &str,
        cfg: StoreConfig,
        cpu: Option<usize>,
    ) -> Result<Store, StoreError> {
        if cfg.secret.is_empty() {
            return Err(StoreError::EmptySecret);
        }
        let bind_err = |source| StoreError::Bind {
            addr: listen.to_string(),
            source,
        };
        let std_listener = std::net::TcpListener::bind(listen).map_err(bind_err)?;
        std_listener.set_nonblocking(true).map_err(bind_err)?;
        let addr = std_listener.local_addr().map_err(bind_err)?;
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                ks: Keyspace::new(cfg.bytes, cfg.mode),
                now_ms: 0,
                bucket: Bucket::new(cfg.rate_bps),
                hits: 0,
                misses: 0,
                rejected_writes: 0,
                rate_limited: 0,
                auth_failures: 0,
                commands: 0,
                protocol_errors: 0,
                connections_total: 0,
                memory_releases: 0,
                peak_since_release: 0,
            }),
            secret: blake3::hash(cfg.secret.as_bytes()),
            limits: Limits {
                max_bulk: cfg.max_bulk,
                max_args: cfg.max_args.max(3),
                max_inline: Limits::default().max_inline,
            },
            max_connections: cfg.max_connections as u64,
            connections: AtomicU64::new(0),
            auth_timeout: cfg.auth_timeout,
            max_unauthenticated: cfg.max_unauthenticated.max(1),
            unauthed: Mutex::new(BTreeMap::new()),
            conn_ids: AtomicU64::new(0),
            buffers: AtomicU64::new(0),
            epoch: Instant::now(),
            port: addr.port(),
            consumer: cfg.consumer.clone(),
            stop,
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(StoreError::Thread)?;
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("store-{}", addr.port()))
            .spawn(move || {
                if let Some(cpu) = cpu {
                    if let Err(e) = granule_host::os::set_affinity(0, &[cpu]) {
                        tracing::warn!("store {addr}: cannot pin to vCPU {cpu}: {e}");
                    }
                }
                runtime.block_on(serve(sh, std_listener, stop_rx));
                // Dropping the runtime drops every connection's task and socket.
                drop(runtime);
            })
            .map_err(StoreError::Thread)?;
        tracing::debug!(
            "store {addr} for '{}': {} bytes, {:?}, rate {} B/s",
            cfg.consumer,
            cfg.bytes,
            cfg.mode,
            cfg.rate_bps
        );
        Ok(Store {
            shared,
            addr,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Where the store listens (with the port the system chose for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> StoreStats {
        let g = self.shared.inner.lock();
        StoreStats {
            used_bytes: g.ks.used(),
            capacity: g.ks.capacity(),
            keys: g.ks.len() as u64,
            hits: g.hits,
            misses: g.misses,
            evicted_bytes: g.ks.evicted_bytes,
            rejected_writes: g.rejected_writes,
            rate_limited: g.rate_limited,
            connections: self.shared.connections.load(Ordering::Relaxed),
            unauthenticated: self.shared.unauthed.lock().len() as u64,
            buffer_bytes: self.shared.buffers.load(Ordering::Relaxed),
            auth_failures: g.auth_failures,
            commands: g.commands,
            protocol_errors: g.protocol_errors,
            memory_releases: g.memory_releases,
        }
    }

    /// Change the capacity. LRU: evict (approximate LRU) down to `bytes` and return the
    /// bytes evicted. No-eviction: evict nothing and return 0; writes that would go past
    /// the new size are refused from now on (the holder is to be sent a revocation notice).
    pub fn resize(&self, bytes: u64) -> u64 {
        let mut g = self.shared.inner.lock();
        let evicted = g.ks.set_capacity(bytes);
        if evicted > 0 {
            g.release_memory();
        }
        evicted
    }

    /// The store's eviction mode.
    pub fn mode(&self) -> EvictionMode {
        self.shared.inner.lock().ks.mode()
    }

    /// Stop: close the listener and every connection, free the data. Idempotent; also
    /// done on drop.
    pub fn shutdown(&self) {
        self.shared.stop.send_replace(true);
        let thread = self.thread.lock().take();
        let first = thread.is_some();
        if let Some(t) = thread {
            // The store's own thread cannot join itself (nothing of the store calls this
            // from there, but a caller's callback could).
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        let mut g = self.shared.inner.lock();
        g.ks.clear();
        // The connections' buffers and the runtime went with the thread.
        g.ks.set_buffers(0);
        if first {
            g.release_memory();
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Shrink LRU stores in proportion to their capacities so that, together, they give back
/// about `bytes` (a harvester taking memory back). Returns each store's evicted bytes, in
/// the order given (no-eviction stores give nothing here; they are revoked instead).
pub fn shrink_in_proportion(stores: &[&Store], bytes: u64) -> Vec<u64> {
    let caps: Vec<u64> = stores
        .iter()
        .map(|s| {
            let g = s.shared.inner.lock();
            if g.ks.mode() == EvictionMode::Lru {
                g.ks.capacity()
            } else {
                0
            }
        })
        .collect();
    let total: u128 = caps.iter().map(|&c| u128::from(c)).sum();
    stores
        .iter()
        .zip(&caps)
        .map(|(s, &cap)| {
            if total == 0 || cap == 0 {
                return 0;
            }
            let share = (u128::from(bytes) * u128::from(cap)).div_ceil(total) as u64;
            s.resize(cap.saturating_sub(share))
        })
        .collect()
}

/// The store's event loop: accept until told to stop, one task per connection, and the
/// active expiry cycle.
async fn serve(
    shared: Arc<Shared>,
    listener: std::net::TcpListener,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("store on port {}: cannot serve: {e}", shared.port);
            return;
        }
    };
    let expiry = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(EXPIRE_PERIOD);
            loop {
                tick.tick().await;
                let now_ms = shared.epoch.elapsed().as_millis() as u64;
                let mut g = shared.inner.lock();
                g.ks.set_buffers(shared.buffers.load(Ordering::Relaxed));
                // Like Redis: repeat while a quarter or more of a round had expired,
                // within a bound so one cycle stays short.
                for _ in 0..16 {
                    let (sampled, dropped) = g.ks.expire_round(now_ms);
                    if sampled == 0 || dropped * 4 < sampled {
                        break;
                    }
                }
                // After deletes, expiries or evictions since the last tick.
                g.release_after_wave();
            }
        })
    };
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            r = listener.accept() => match r {
                Ok((sock, _peer)) => {
                    let full = shared.connections.load(Ordering::Relaxed) >= shared.max_connections;
                    let id = shared.conn_ids.fetch_add(1, Ordering::Relaxed);
                    let kick = Arc::new(Notify::new());
                    let victim = {
                        let mut strangers = shared.unauthed.lock();
                        // A new connection takes the place of the oldest that has not
                        // authenticated when strangers hold their share, or every place:
                        // silent sockets cannot lock the lease holder out. Only one that
                        // had time to authenticate, though: a client opening many
                        // connections at once (redis-benchmark -c 500) sends its AUTHs
                        // after it opened them all.
                        let now = Instant::now();
                        let grace = shared.auth_timeout / 10;
                        let old = strangers
                            .first_key_value()
                            .is_some_and(|(_, (_, since))| now.duration_since(*since) >= grace);
                        let victim = if old
                            && (strangers.len() >= shared.max_unauthenticated || full)
                        {
                            strangers.pop_first()
                        } else {
                            None
                        };
                        if full && victim.is_none() {
                            None
                        } else {
                            strangers.insert(id, (kick.clone(), now));
                            Some(victim)
                        }
                    };
                    let Some(victim) = victim else {
                        // A fresh socket has room for one short line: no need to wait.
                        let _ = sock.try_write(MAX_CLIENTS);
                        continue;
                    };
                    if let Some((_, (k, _))) = victim {
                        k.notify_one();
                    }
                    shared.connections.fetch_add(1, Ordering::Relaxed);
                    shared.inner.lock().connections_total += 1;
                    let sh = shared.clone();
                    tokio::spawn(async move {
                        let _open = OpenConn(sh.clone(), id);
                        serve_conn(&sh, sock, id, kick).await;
                    });
                }
                Err(e) => {
                    // Out of descriptors and the like: wait a little rather than spin.
                    tracing::warn!("store on port {}: accept: {e}", shared.port);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
    expiry.abort();
}

/// Counts a connection as open (and, until it authenticates, as a stranger) while it
/// lives, also when its task is dropped at shutdown.
struct OpenConn(Arc<Shared>, u64);

impl Drop for OpenConn {
    fn drop(&mut self) {
        self.0.unauthed.lock().remove(&self.1);
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection's buffers as counted in [`Shared::buffers`]: updated when their size
/// changes (a comparison per read otherwise), uncounted when the connection ends.
struct Counted<'a> {
    shared: &'a Shared,
    bytes: u64,
}

impl Counted<'_> {
    fn set(&mut self, bytes: usize) {
        let bytes = bytes as u64;
        if bytes != self.bytes {
            if bytes > self.bytes {
                self.shared
                    .buffers
                    .fetch_add(bytes - self.bytes, Ordering::Relaxed);
            } else {
                self.shared
                    .buffers
                    .fetch_sub(self.bytes - bytes, Ordering::Relaxed);
            }
            self.bytes = bytes;
        }
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// A connection's own state.
struct Conn {
    /// The connection's number (`CLIENT ID`, `HELLO`), from 1.
    id: u64,
    authed: bool,
    /// Whether it chose RESP3 (`HELLO 3`): its nulls and maps are written as RESP3's.
    resp3: bool,
    /// Its `CLIENT SETNAME`.
    name: Option<Box<[u8]>>,
    /// The commands queued since `MULTI`, while in one.
    multi: Option<commands::Queued>,
    /// The decoder, which resumes a partly received command where it stopped.
    parser: resp::Parser,
}

async fn serve_conn(shared: &Shared, mut sock: TcpStream, id: u64, kick: Arc<Notify>) {
    let _ = sock.set_nodelay(true);
    let mut counted = Counted { shared, bytes: 0 };
    // Small until the connection authenticates: a stranger costs (almost) nothing.
    let mut rbuf = BytesMut::with_capacity(PRE_AUTH_CHUNK);
    let mut out: Vec<u8> = Vec::new();
    let mut args: Vec<(usize, usize)> = Vec::with_capacity(8);
    let mut conn = Conn {
        id: id + 1,
        authed: false,
        resp3: false,
        name: None,
        multi: None,
        parser: resp::Parser::default(),
    };
    let deadline = tokio::time::Instant::now() + shared.auth_timeout;
    loop {
        let chunk = if conn.authed {
            READ_CHUNK
        } else {
            PRE_AUTH_CHUNK
        };
        if rbuf.capacity() - rbuf.len() < chunk / 4 {
            rbuf.reserve(chunk);
        }
        counted.set(buffer_bytes(&rbuf, &out, &args, &conn));
        let read = if conn.authed {
            sock.read_buf(&mut rbuf).await
        } else {
            tokio::select! {
                r = sock.read_buf(&mut rbuf) => r,
                () = kick.notified() => {
                    let _ = sock.try_write(b"-ERR too many unauthenticated connections: closing the oldest\r\n");
                    return;
                }
                () = tokio::time::sleep_until(deadline) => {
                    let _ = sock.try_write(b"-ERR not authenticated in time: closing\r\n");
                    return;
                }
            }
        };
        match read {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        counted.set(buffer_bytes(&rbuf, &out, &args, &conn));
        let was_authed = conn.authed;
        let (used, close) = shared.process(&rbuf, &mut args, &mut out, &mut conn);
        if conn.authed && !was_authed {
            shared.unauthed.lock().remove(&id);
        }
        rbuf.advance(used);
        if !out.is_empty() {
            counted.set(buffer_bytes(&rbuf, &out, &args, &conn));
            if sock.write_all(&out).await.is_err() {
                return;
            }
            out.clear();
            if out.capacity() > SHRINK_ABOVE {
                // One large reply (MGET of big values) should not pin its buffer forever.
                out = Vec::new();
            }
        }
        if close {
            let _ = sock.shutdown().await;
            return;
        }
        // The same for a large command once it ran (what is left is a partial command:
        // its bytes move along, and the parser's offsets, relative to its start, hold).
        if rbuf.capacity() > SHRINK_ABOVE && rbuf.len() <= READ_CHUNK / 2 {
            let mut small = BytesMut::with_capacity(READ_CHUNK);
            small.extend_from_slice(&rbuf);
            rbuf = small;
        }
        if args.capacity() > 1024 && !conn.parser.in_progress() {
            args = Vec::with_capacity(8);
        }
    }
}

/// Bytes a connection's buffers take.
fn buffer_bytes(rbuf: &BytesMut, out: &Vec<u8>, args: &Vec<(usize, usize)>, conn: &Conn) -> usize {
    rbuf.capacity()
        + out.capacity()
        + args.capacity() * std::mem::size_of::<(usize, usize)>()
        + conn.multi.as_ref().map_or(0, |q| q.footprint())
}

/// One parsed command: its arguments as ranges of the read buffer.
struct Cmd<'a> {
    buf: &'a [u8],
    args: &'a [(usize, usize)],
}

impl<'a> Cmd<'a> {
    fn len(&self) -> usize {
        self.args.len()
    }

    fn arg(&self, i: usize) -> &'a [u8] {
        let (s, e) = self.args[i];
        &self.buf[s..e]
    }
}

/// What a connection does after a command.
#[derive(PartialEq, Eq)]
enum After {
    Continue,
    Close,
}

impl Shared {
    /// Run every complete command in `buf`, appending replies to `out`. Returns the bytes
    /// consumed and whether to close the connection.
    fn process(
        &self,
        buf: &[u8],
        args: &mut Vec<(usize, usize)>,
        out: &mut Vec<u8>,
        conn: &mut Conn,
    ) -> (usize, bool) {
        let mut pos = 0;
        let mut guard: Option<parking_lot::MutexGuard<'_, Inner>> = None;
        loop {
            let limits = if conn.authed { &self.limits } else { &PRE_AUTH };
            match conn.parser.parse(&buf[pos..], limits, args) {
                Ok(None) => return (pos, false),
                Ok(Some(n)) => {
                    if args.is_empty() {
                        pos += n;
                        continue;
                    }
                    let g = guard.get_or_insert_with(|| {
                        let mut g = self.inner.lock();
                        g.now_ms = self.epoch.elapsed().as_millis() as u64;
                        g.ks.set_buffers(self.buffers.load(Ordering::Relaxed));
                        if g.bucket.rate != 0 {
                            g.bucket.refill(Instant::now());
                        }
                        g
                    });
                    let cmd = Cmd {
                        buf: &buf[pos..],
                        args,
                    };
                    let before = out.len();
                    // A refused request costs nothing (it was not served), so a flood
                    // of them does not push the bucket ever deeper into debt.
                    let charged = g.bucket.allows();
                    let after = g.run(self, &cmd, out, conn);
                    if charged {
                        g.bucket.charge(n + out.len() - before);
                    }
                    pos += n;
                    if after == After::Close {
                        return (pos, true);
                    }
                }
                Err(e) => {
                    let g = guard.get_or_insert_with(|| self.inner.lock());
                    g.protocol_errors += 1;
                    // Worded as Redis words them before authentication.
                    let text = match e {
                        resp::ProtocolError::TooManyArgs { .. } if !conn.authed => {
                            "unauthenticated multibulk length".to_string()
                        }
                        resp::ProtocolError::BulkTooLong { .. } if !conn.authed => {
                            "unauthenticated bulk length".to_string()
                        }
                        e => e.to_string(),
                    };
                    out.extend_from_slice(format!("-ERR Protocol error: {text}\r\n").as_bytes());
                    return (pos, true);
                }
            }
        }
    }
}

// ---- replies ---------------------------------------------------------------------------

fn ok(out: &mut Vec<u8>) {
    out.extend_from_slice(b"+OK\r\n");
}

fn int(out: &mut Vec<u8>, n: i64) {
    out.push(b':');
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn bulk(out: &mut Vec<u8>, v: &[u8]) {
    out.push(b'$');
    out.extend_from_slice(itoa::Buffer::new().format(v.len()).as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(v);
    out.extend_from_slice(b"\r\n");
}

fn array(out: &mut Vec<u8>, n: usize) {
    out.push(b'*');
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn err(out: &mut Vec<u8>, msg: &str) {
    out.extend_from_slice(b"-ERR ");
    out.extend_from_slice(msg.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// A client's bytes made safe for an error line: printable ASCII, at most 64 characters.
fn printable(b: &[u8]) -> String {
    b.iter()
        .take(64)
        .map(|&c| {
            if (0x20..0x7f).contains(&c) && c != b'\'' {
                char::from(c)
            } else {
                '?'
            }
        })
        .collect()
}

fn wrong_args(out: &mut Vec<u8>, name: &str) {
    err(
        out,
        &format!("wrong number of arguments for '{name}' command"),
    );
}

fn parse_i64(b: &[u8]) -> Option<i64> {
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// Whether `a` equals the ASCII word `upper` (given in upper case) in any case.
fn is(a: &[u8], upper: &[u8]) -> bool {
    a.eq_ignore_ascii_case(upper)
}

#[cfg(test)]
mod tests;
