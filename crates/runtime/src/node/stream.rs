//! State streams: a proclet's state sent to another node in chunks over their
//! connection, and put together again on arrival. A move uses them (`migrate.rs`); they
//! know nothing of moves — what the chunks are for is in the message each one carries —
//! so other users (replication to backups) can stream states the same way.
//!
//! Sending: a bounded window of chunks in flight ([`Settings::window`]), each confirmed
//! by the receiver; an optional rate (a slow-migration baseline); a stream whose receiver
//! confirms nothing for [`Settings::stall_timeout`] fails. A plain byte-vector state is
//! sent as is, sliced without copying ([`send_bytes`]). Any other state is encoded chunk
//! by chunk ([`send_encoded`]): inline when small, else on a blocking thread while earlier
//! chunks are on the wire, so the sender never holds a second full copy; that encoder
//! may be paced (rest after each chunk in proportion to its work).
//!
//! Receiving ([`Inbound`]): chunks arrive in order on the connection's reader and are
//! appended; the last one hands the whole buffer back; a stream whose sender gave up or
//! whose connection closed is dropped. Decoding a large state happens off the node's
//! workers ([`in_background`]).

use crate::shipping::StateOps;
use crate::slot::{Guard, Slot};
use bytes::Bytes;
use dashmap::DashMap;
use granule_transport::{Connection, TransportError};
use granule_wire::{Frame, Msg, ProcletId, RemoteError};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// States whose last measured footprint is below this are encoded inline on the sending
/// task; larger ones on a blocking thread, so sending overlaps with encoding.
const INLINE_ENCODE: u64 = 256 << 10;

/// How a stream is sent.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// Bytes per chunk.
    pub chunk: usize,
    /// Chunks in flight at once.
    pub window: usize,
    /// Bytes per second, if paced.
    pub throttle: Option<u64>,
    /// Give up when the receiver confirms nothing for this long.
    pub stall_timeout: Duration,
    /// The share of the time the encoder may keep a core busy (`None`: no pacing).
    pub duty: Option<f64>,
}

impl Settings {
    /// The stream settings of a node's migration configuration.
    pub(crate) fn of(c: &granule_config::Migration, duty: Option<f64>) -> Settings {
        Settings {
            chunk: c.chunk as usize,
            window: c.window.max(1) as usize,
            throttle: c.throttle,
            stall_timeout: c.stall_timeout,
            duty,
        }
    }
}

/// Where a chunk sits in its stream (what the caller's message for it must say).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkPos {
    pub offset: u64,
    /// The whole stream's length when known (raw), else an estimate (the footprint).
    pub total: u64,
    pub last: bool,
    /// The chunk is raw bytes of a byte-vector state, not an encoding.
    pub raw: bool,
}

type Reply = Pin<Box<dyn Future<Output = Result<Frame, TransportError>> + Send>>;

/// Chunks sent and not yet confirmed, in order.
struct Window {
    conn: Arc<Connection>,
    replies: VecDeque<Reply>,
    sent: u64,
    started: Instant,
    settings: Settings,
}

impl Window {
    fn new(conn: &Arc<Connection>, settings: Settings) -> Window {
        Window {
            conn: conn.clone(),
            replies: VecDeque::new(),
            sent: 0,
            started: Instant::now(),
            settings,
        }
    }

    async fn wait_one(&mut self) -> Result<(), RemoteError> {
        let Some(r) = self.replies.pop_front() else {
            return Ok(());
        };
        let stall = self.settings.stall_timeout;
        match tokio::time::timeout(stall, r).await {
            Err(_) => Err(RemoteError::Internal(format!(
                "the receiver confirmed nothing for {stall:?}"
            ))),
            Ok(Ok(Frame { msg: Msg::Done, .. })) => Ok(()),
            Ok(Ok(Frame {
                msg: Msg::Error(e), ..
            })) => Err(e),
            Ok(Ok(f)) => Err(RemoteError::Protocol(format!(
                "unexpected answer {} to a state chunk",
                f.msg.name()
            ))),
            Ok(Err(e)) => Err(RemoteError::Internal(format!(
                "the receiver is unreachable: {e}"
            ))),
        }
    }

    async fn send(&mut self, msg: Msg, chunk: Bytes) -> Result<(), RemoteError> {
        while self.replies.len() >= self.settings.window {
            self.wait_one().await?;
        }
        if let Some(rate) = self.settings.throttle {
            let due = Duration::from_secs_f64(self.sent as f64 / rate as f64);
            let at = self.started + due;
            if at > Instant::now() {
                tokio::time::sleep_until(at.into()).await;
            }
        }
        self.sent += chunk.len() as u64;
        let fut = self
            .conn
            .start_request_bytes(&msg, chunk)
            .map_err(|e| RemoteError::Internal(format!("the receiver is unreachable: {e}")))?;
        self.replies.push_back(Box::pin(fut));
        granule_failpoints::hit("stream.chunk_sent")
            .await
            .map_err(|f| RemoteError::Internal(f.to_string()))
    }

    async fn finish(&mut self) -> Result<(), RemoteError> {
        while !self.replies.is_empty() {
            self.wait_one().await?;
        }
        Ok(())
    }
}

/// Send a byte-vector state as is, in slices of `bytes` (no copy). Returns the bytes
/// sent once the receiver confirmed every chunk. The caller keeps `bytes` (a cheap
/// clone): on failure it is whole and, once this returns, its only holder.
pub(crate) async fn send_bytes(
    conn: &Arc<Connection>,
    bytes: &Bytes,
    header: &(dyn Fn(ChunkPos) -> Msg + Sync),
    settings: Settings,
) -> Result<u64, RemoteError> {
    let mut window = Window::new(conn, settings);
    let total = bytes.len() as u64;
    let mut off = 0usize;
    loop {
        let end = (off + settings.chunk).min(bytes.len());
        let last = end == bytes.len();
        let pos = ChunkPos {
            offset: off as u64,
            total,
            last,
            raw: true,
        };
        window.send(header(pos), bytes.slice(off..end)).await?;
        off = end;
        if last {
            break;
        }
    }
    window.finish().await?;
    Ok(total)
}

/// Send any other state, encoded, while `guard` (shared or exclusive) keeps it from
/// changing. Returns the bytes sent once the receiver confirmed every chunk.
pub(crate) async fn send_encoded(
    conn: &Arc<Connection>,
    slot: &Arc<Slot>,
    guard: &Guard,
    ops: StateOps,
    header: &(dyn Fn(ChunkPos) -> Msg + Sync),
    settings: Settings,
) -> Result<u64, RemoteError> {
    let mut window = Window::new(conn, settings);
    // The length is known only at the end; the footprint tells the receiver roughly
    // what to reserve (and whether it has room).
    let hint = slot.stats.footprint.load(Ordering::Relaxed);
    let pos = |offset: u64, last: bool| ChunkPos {
        offset,
        total: hint,
        last,
        raw: false,
    };
    // Small states: encode inline, into one chunk or a few.
    if hint < INLINE_ENCODE {
        let mut chunks: Vec<Vec<u8>> = Vec::new();
        guard.inspect(|s| {
            (ops.encode)(s, settings.chunk, &mut |c| {
                chunks.push(c);
                Ok(())
            })
        })?;
        let n = chunks.len();
        let mut off = 0u64;
        for (i, c) in chunks.into_iter().enumerate() {
            let len = c.len() as u64;
            window
                .send(header(pos(off, i + 1 == n)), Bytes::from(c))
                .await?;
            off += len;
        }
        if n == 0 {
            window.send(header(pos(0, true)), Bytes::new()).await?;
        }
        window.finish().await?;
        return Ok(off);
    }
    // Large states: encode on a blocking thread, chunk by chunk, while sending. At the
    // sending worker's own priority, unlike decoding: a node that moves a state out is
    // usually the one under pressure, and the sooner the state is out, the sooner it has
    // relief — unless the stream is paced (see `migration.duty`).
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(settings.window);
    let enc_slot = slot.clone();
    let rest = settings.duty.filter(|d| *d < 1.0).map(|d| 1.0 / d - 1.0);
    let chunk = settings.chunk;
    let encoder = tokio::task::spawn_blocking(move || {
        let d = enc_slot.state_reader();
        let mut since = Instant::now();
        (ops.encode)(&**d, chunk, &mut |c| {
            if let Some(rest) = rest {
                // Rest in proportion to the time since the last rest: encoding, and
                // waiting for the sender to take the last chunk (it sends meanwhile), so
                // the rests cover the sending too. Microsecond resolution.
                std::thread::sleep(since.elapsed().mul_f64(rest));
                since = Instant::now();
            }
            tx.blocking_send(c)
                .map_err(|_| RemoteError::Internal("the stream stopped".into()))
        })
    });
    let mut off = 0u64;
    let mut pending: Option<Vec<u8>> = None;
    let sent: Result<(), RemoteError> = async {
        loop {
            let next = rx.recv().await;
            if let Some(c) = pending.take() {
                let len = c.len() as u64;
                window
                    .send(header(pos(off, next.is_none())), Bytes::from(c))
                    .await?;
                off += len;
            }
            match next {
                Some(c) => pending = Some(c),
                None => break,
            }
        }
        window.finish().await
    }
    .await;
    drop(rx);
    let encoded = encoder
        .await
        .map_err(|e| RemoteError::Internal(format!("the encoder failed: {e}")))?;
    encoded?;
    sent?;
    if off == 0 {
        return Err(RemoteError::Internal("the state encoded to nothing".into()));
    }
    Ok(off)
}

/// Streams arriving at this node, by (connection, proclet), each with what its first
/// chunk said (`M`).
pub(crate) struct Inbound<M> {
    arriving: DashMap<(u64, ProcletId), Arriving<M>>,
}

struct Arriving<M> {
    buf: Vec<u8>,
    meta: M,
}

impl<M> Default for Inbound<M> {
    fn default() -> Self {
        Inbound {
            arriving: DashMap::new(),
        }
    }
}

/// One chunk, as it arrived.
pub(crate) struct Chunk<'a> {
    pub conn: &'a Arc<Connection>,
    pub proclet: ProcletId,
    pub offset: u64,
    pub last: bool,
    pub bytes: &'a [u8],
}

impl<M> Inbound<M> {
    /// Take a chunk (called in arrival order). The first chunk of a stream (offset 0)
    /// opens it with `open(capacity)`, which checks what the stream is and may refuse
    /// it. Returns the whole buffer and the metadata with the last chunk.
    pub(crate) fn take(
        &self,
        c: Chunk<'_>,
        capacity: usize,
        open: impl FnOnce() -> Result<M, RemoteError>,
    ) -> Result<Option<(Vec<u8>, M)>, RemoteError> {
        let key = (c.conn.id(), c.proclet);
        if c.offset == 0 {
            let meta = open()?;
            self.arriving.insert(
                key,
                Arriving {
                    buf: Vec::with_capacity(capacity.max(c.bytes.len())),
                    meta,
                },
            );
        }
        let Some(mut entry) = self.arriving.get_mut(&key) else {
            return Err(RemoteError::Protocol(format!(
                "state chunk at offset {} for proclet {} without its start",
                c.offset, c.proclet
            )));
        };
        if entry.buf.len() as u64 != c.offset {
            let have = entry.buf.len();
            drop(entry);
            self.arriving.remove(&key);
            return Err(RemoteError::Protocol(format!(
                "state chunk at offset {}, expected {have}",
                c.offset
            )));
        }
        entry.buf.extend_from_slice(c.bytes);
        drop(entry);
        if !c.last {
            return Ok(None);
        }
        Ok(self.arriving.remove(&key).map(|(_, a)| (a.buf, a.meta)))
    }

    /// Drop what arrived of a stream its sender gave up.
    pub(crate) fn abort(&self, conn: &Arc<Connection>, proclet: ProcletId) {
        self.arriving.remove(&(conn.id(), proclet));
    }

    /// A connection closed: streams arriving on it will never finish.
    pub(crate) fn drop_connection(&self, conn: &Arc<Connection>) {
        let id = conn.id();
        self.arriving.retain(|(c, _), _| *c != id);
    }
}

/// Run `f` on a blocking thread at nice value `nice`, restoring the thread's own
/// priority afterwards (blocking threads are pooled): decoding an arriving state, below
/// the node's workers, which keep serving calls meanwhile.
pub(crate) fn in_background<T: Send + 'static>(
    nice: i32,
    f: impl FnOnce() -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    tokio::task::spawn_blocking(move || {
        let old = granule_host::os::swap_thread_nice(nice);
        let out = f();
        if let Some(old) = old {
            granule_host::os::swap_thread_nice(old);
        }
        out
    })
}
