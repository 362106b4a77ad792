//! One TCP connection: handshake, request/response matching, coalesced writes, flow
//! control and closing; and carrying out the fault filter's verdicts on its frames.

use crate::faults::{Direction, Endpoint, FrameInfo, Verdict, REORDER_MAX_HOLD};
use crate::handshake::{judge_hello, Identity};
use crate::{Handler, TransportConfig, TransportError};
use bytes::{Bytes, BytesMut};
use granule_wire::{
    decode_frame, encode_frame, peek_frame_len, Frame, FrameKind, Msg, NodeId, RemoteError, Role,
    WireError, HEADER_LEN,
};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};

static NEXT_CONN_ID: AtomicU64 = AtomicU64::new(1);

/// Id of the hello request on client connections (ids start at 1).
const HELLO_ID: u64 = 1;
/// Frames at least this big are written on their own instead of being copied into the
/// coalescing buffer.
const LARGE_FRAME: usize = 32 << 10;
/// A deferred frame is written at once when this many are queued already...
const DEFER_MAX_FRAMES: usize = 64;
/// ...or when the oldest queued one has waited this long.
const DEFER_MAX_AGE: std::time::Duration = std::time::Duration::from_micros(500);
/// Upper bound of one coalesced write.
const COALESCE_LIMIT: usize = 256 << 10;
/// Most buffers one vectored write hands the kernel (Linux takes 1024).
const MAX_IOVECS: usize = 512;

/// The other end of a connection, as established by the handshake.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub role: Role,
    pub node: Option<NodeId>,
    /// Both ends host proclets and run the identical binary: the peer may ship code.
    pub verified: bool,
    pub program: String,
    pub addr: SocketAddr,
}

type Reply = oneshot::Sender<Result<Frame, TransportError>>;

struct Pending {
    map: HashMap<u64, Reply>,
    closed: bool,
}

struct Outbox {
    queue: VecDeque<Bytes>,
    /// The writer task is writing a batch it took from the queue: nobody else may write.
    writing: bool,
    /// The writer task has been woken and will drain the queue soon.
    scheduled: bool,
    /// When the oldest frame now queued was queued.
    queued_since: Option<std::time::Instant>,
    /// Close the connection once the queue is written (used after a refusal).
    close_after: bool,
    /// No more frames may be queued: the queue ends with a frame the fault filter cut,
    /// and anything after it would be read by the peer as the rest of that frame.
    sealed: bool,
    /// Outgoing frames the fault filter holds back (`Reorder`).
    held: Vec<HeldOut>,
    closed: bool,
}

/// An outgoing frame held back by the fault filter: sent after `after` more frames.
struct HeldOut {
    token: u64,
    after: u32,
    parts: Vec<Bytes>,
}

/// An incoming frame held back by the fault filter: handled after `after` more frames.
struct HeldIn {
    token: u64,
    after: u32,
    frame: Frame,
}

/// How a frame that passed the fault filter is written.
#[derive(Clone, Copy)]
enum Via {
    /// As `send_frame_with` does: from this thread unless deferred or a write is on.
    Direct { defer: bool },
    /// Always by the writer task (large multi-part frames).
    Writer,
}

/// A connection to another Granule process. Cheap to share (`Arc`); every method takes
/// `&self` and may be called from any thread.
pub struct Connection {
    stream: TcpStream,
    peer_addr: SocketAddr,
    is_client: bool,
    identity: Arc<Identity>,
    config: Arc<TransportConfig>,
    handler: Arc<dyn Handler>,
    peer: OnceLock<PeerInfo>,
    outbox: Mutex<Outbox>,
    write_wake: Notify,
    pending: Mutex<Pending>,
    next_id: AtomicU64,
    in_flight: Arc<Semaphore>,
    incoming: Arc<Semaphore>,
    closed: AtomicBool,
    /// Process-unique id (never reused, unlike the connection's address in memory).
    id: u64,
    /// The reader is dispatching the frames of one read: answers given meanwhile are
    /// queued and leave together when it is done.
    in_batch: AtomicBool,
    /// Frames handed to `send_frame*` and write system calls made (coalescing shows as
    /// fewer writes than frames).
    frames_sent: AtomicU64,
    writes: AtomicU64,
    close_reason: Mutex<Option<String>>,
    /// Set on client connections when the server refuses the hello.
    refusal: Mutex<Option<TransportError>>,
    /// Bytes read but not yet turned into frames. Shared by the reader task and callers
    /// that read their own responses (see `read_responses_here`).
    read_state: Mutex<ReadState>,
    /// Wakes the reader task when a caller left frames in the buffer.
    read_kick: Notify,
    /// The runtime the connection's tasks run on: delayed and held-back frames are
    /// released by timer tasks spawned here (senders may be threads outside it).
    rt: tokio::runtime::Handle,
    /// Incoming frames the fault filter holds back (`Reorder`).
    held_in: Mutex<Vec<HeldIn>>,
    /// Names held-back frames, so a timer releases the one it was started for.
    next_hold: AtomicU64,
}

struct ReadState {
    buf: BytesMut,
}

thread_local! {
    static CALLER_READS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The connection whose response a caller on this thread is waiting for (set while
    /// such a request is pending with caller reads on).
    static WAITING_ON: std::cell::RefCell<std::sync::Weak<Connection>> =
        const { std::cell::RefCell::new(std::sync::Weak::new()) };
}

/// Sleep until the socket this thread awaits a response on is readable, `extra` is
/// readable (the thread's wake-up descriptor), or `timeout` passes — so a blocked caller
/// is woken by the kernel when its reply arrives, like a plain blocking client, rather
/// than by the reader thread. Returns false (without waiting) when the thread awaits no
/// response.
pub fn wait_for_reply(
    extra: std::os::fd::BorrowedFd<'_>,
    timeout: Option<std::time::Duration>,
) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let Some(conn) = WAITING_ON.with(|w| w.borrow().upgrade()) else {
        return false;
    };
    if conn.is_closed() {
        return false;
    }
    let mut fds = [
        PollFd::new(conn.stream.as_fd(), PollFlags::POLLIN),
        PollFd::new(extra, PollFlags::POLLIN),
    ];
    let t = match timeout {
        None => PollTimeout::NONE,
        Some(d) => PollTimeout::try_from(d.max(std::time::Duration::from_millis(1)))
            .unwrap_or(PollTimeout::MAX),
    };
    let _ = poll(&mut fds, t);
    true
}

/// While the returned guard lives, requests awaited on this thread read their responses
/// from the socket themselves when polled (a thread that is spinning while it waits for
/// a reply uses this to avoid waiting for the reader thread to be woken).
pub fn caller_reads() -> CallerReads {
    CallerReads {
        prev: CALLER_READS.with(|c| c.replace(true)),
    }
}

/// See [`caller_reads`].
pub struct CallerReads {
    prev: bool,
}

impl Drop for CallerReads {
    fn drop(&mut self) {
        CALLER_READS.with(|c| c.set(self.prev));
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer_addr", &self.peer_addr)
            .field("peer", &self.peer.get())
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl Connection {
    fn new(
        stream: TcpStream,
        peer_addr: SocketAddr,
        is_client: bool,
        identity: Arc<Identity>,
        config: Arc<TransportConfig>,
        handler: Arc<dyn Handler>,
    ) -> Arc<Self> {
        let _ = stream.set_nodelay(true);
        let faults = config.faults.clone();
        let conn = Arc::new(Connection {
            stream,
            peer_addr,
            is_client,
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            incoming: Arc::new(Semaphore::new(config.max_incoming)),
            identity,
            config,
            handler,
            peer: OnceLock::new(),
            outbox: Mutex::new(Outbox {
                queue: VecDeque::new(),
                writing: false,
                scheduled: false,
                queued_since: None,
                close_after: false,
                sealed: false,
                held: Vec::new(),
                closed: false,
            }),
            write_wake: Notify::new(),
            pending: Mutex::new(Pending {
                map: HashMap::new(),
                closed: false,
            }),
            next_id: AtomicU64::new(HELLO_ID),
            closed: AtomicBool::new(false),
            id: NEXT_CONN_ID.fetch_add(1, Ordering::Relaxed),
            in_batch: AtomicBool::new(false),
            frames_sent: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            close_reason: Mutex::new(None),
            refusal: Mutex::new(None),
            read_state: Mutex::new(ReadState {
                buf: BytesMut::with_capacity(64 << 10),
            }),
            read_kick: Notify::new(),
            rt: tokio::runtime::Handle::current(),
            held_in: Mutex::new(Vec::new()),
            next_hold: AtomicU64::new(1),
        });
        faults.register(Arc::downgrade(&conn));
        conn
    }

    fn start(self: &Arc<Self>) {
        tokio::spawn(self.clone().read_loop());
        tokio::spawn(self.clone().write_loop());
    }

    /// Accept side: wrap an accepted socket; the peer must send a hello first.
    pub(crate) fn accepted(
        stream: TcpStream,
        peer_addr: SocketAddr,
        identity: Arc<Identity>,
        config: Arc<TransportConfig>,
        handler: Arc<dyn Handler>,
    ) -> Arc<Self> {
        let conn = Connection::new(stream, peer_addr, false, identity, config, handler);
        conn.start();
        let timeout = conn.config.handshake_timeout;
        // Weak: a connection that closes early must not be kept (with its socket) alive
        // until the timeout fires.
        let watch = Arc::downgrade(&conn);
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            if let Some(c) = watch.upgrade() {
                if c.peer.get().is_none() {
                    c.close("no hello within the handshake timeout");
                }
            }
        });
        conn
    }

    /// Connect to `addr`, exchange hellos and return the ready connection.
    pub async fn connect(
        addr: &str,
        identity: Arc<Identity>,
        config: Arc<TransportConfig>,
        handler: Arc<dyn Handler>,
    ) -> Result<Arc<Connection>, TransportError> {
        let timeout = config.handshake_timeout;
        let connect_err = |reason: String| TransportError::Connect {
            addr: addr.to_string(),
            reason,
        };
        let stream = match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(connect_err(e.to_string())),
            Err(_) => return Err(connect_err(format!("no answer within {timeout:?}"))),
        };
        let peer_addr = stream.peer_addr().map_err(|e| connect_err(e.to_string()))?;
        let conn = Connection::new(stream, peer_addr, true, identity.clone(), config, handler);
        conn.start();
        let hello = Msg::Hello {
            role: identity.role,
            node: identity.node,
            binary: identity.binary,
            program: identity.program.clone(),
        };
        let result = tokio::time::timeout(timeout, conn.request(&hello, &[])).await;
        match result {
            Err(_) => {
                conn.close("handshake timed out");
                Err(TransportError::HandshakeTimeout(addr.to_string()))
            }
            Ok(Err(e)) => {
                conn.close("handshake failed");
                Err(conn.refusal.lock().take().unwrap_or(e))
            }
            Ok(Ok(frame)) => {
                if conn.peer.get().is_some() {
                    return Ok(conn);
                }
                conn.close("handshake refused");
                if let Some(e) = conn.refusal.lock().take() {
                    return Err(e);
                }
                Err(match frame.msg {
                    Msg::Error(RemoteError::Refused(m)) => {
                        if m.contains("binary mismatch") {
                            TransportError::BinaryMismatch(m)
                        } else {
                            TransportError::Refused(m)
                        }
                    }
                    other => TransportError::Refused(format!(
                        "{addr} answered the hello with {}",
                        other.name()
                    )),
                })
            }
        }
    }

    /// A process-unique id for this connection.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// (frames sent, write system calls made) on this connection so far.
    pub fn write_stats(&self) -> (u64, u64) {
        (
            self.frames_sent.load(Ordering::Relaxed),
            self.writes.load(Ordering::Relaxed),
        )
    }

    /// The peer, once the handshake completed.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.peer.get()
    }

    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub fn close_reason(&self) -> Option<String> {
        self.close_reason.lock().clone()
    }

    fn closed_error(&self) -> TransportError {
        TransportError::Closed {
            peer: self.peer_addr.to_string(),
            reason: self.close_reason().unwrap_or_else(|| "closed".to_string()),
        }
    }

    /// Send a request and wait for its response.
    pub async fn request(
        self: &Arc<Self>,
        msg: &Msg,
        tail: &[u8],
    ) -> Result<Frame, TransportError> {
        self.request_with(|id| encode_frame(FrameKind::Request, id, msg, tail))
            .await
    }

    /// Send a request whose frame `build` encodes for the given request id (so a caller
    /// can serialize its payload straight into the frame), and wait for its response.
    pub async fn request_with<F>(self: &Arc<Self>, build: F) -> Result<Frame, TransportError>
    where
        F: FnOnce(u64) -> Result<Vec<u8>, WireError>,
    {
        let _permit = match self.in_flight.acquire().await {
            Ok(p) => p,
            Err(_) => return Err(self.closed_error()),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut p = self.pending.lock();
            if p.closed {
                return Err(self.closed_error());
            }
            p.map.insert(id, tx);
        }
        let guard = PendingGuard { conn: self, id };
        let bytes = build(id)?;
        let defer = self.outgoing_in_flight() > 1;
        self.send_frame_with(bytes, defer)?;
        let mut rx = rx;
        let out = std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = Pin::new(&mut rx).poll(cx) {
                return Poll::Ready(r);
            }
            if CALLER_READS.with(|c| c.get()) {
                if self.read_responses_here() {
                    if let Poll::Ready(r) = Pin::new(&mut rx).poll(cx) {
                        return Poll::Ready(r);
                    }
                }
                WAITING_ON.with(|w| *w.borrow_mut() = Arc::downgrade(self));
            }
            Poll::Pending
        })
        .await;
        drop(guard);
        match out {
            Ok(r) => r,
            Err(_) => Err(self.closed_error()),
        }
    }

    /// Send a request whose tail is written as is, never copied into a frame buffer (for
    /// large payloads such as a migrating proclet's state), and return a future for its
    /// answer. The request is queued in call order when this returns, whether or not the
    /// future is polled, so a sender can keep several in flight in order. Such requests do
    /// not count against the in-flight limit: their sender bounds them itself.
    pub fn start_request_bytes(
        self: &Arc<Self>,
        msg: &Msg,
        tail: Bytes,
    ) -> Result<impl Future<Output = Result<Frame, TransportError>> + Send + 'static, TransportError>
    {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut head = granule_wire::begin_frame(FrameKind::Request, id, msg, 0)?;
        let body = head.len() - 4 + tail.len();
        let body = u32::try_from(body).map_err(|_| WireError::TooLarge {
            len: body + 4,
            max: u32::MAX as usize,
        })?;
        head[..4].copy_from_slice(&body.to_le_bytes());
        let (tx, rx) = oneshot::channel();
        // The only request awaiting an answer here: nothing is about to follow it, so it
        // leaves now rather than when the writer task next runs (on a node's one worker
        // thread, that is only after the sender's task yields, which may be after it has
        // run a whole closure).
        let alone = {
            let mut p = self.pending.lock();
            if p.closed {
                return Err(self.closed_error());
            }
            p.map.insert(id, tx);
            p.map.len() == 1
        };
        let guard = OwnedPending {
            conn: self.clone(),
            id,
        };
        if self.faults_apply() {
            self.send_filtered(vec![Bytes::from(head), tail], Some(msg.name()), Via::Writer)?;
        } else {
            let mut ob = self.outbox.lock();
            if ob.closed || ob.sealed {
                drop(ob);
                return Err(self.closed_error());
            }
            if ob.queue.is_empty() {
                ob.queued_since = Some(std::time::Instant::now());
            }
            // Both parts go in together, so no other frame can come between them.
            ob.queue.push_back(Bytes::from(head));
            ob.queue.push_back(tail);
            if !ob.writing && !ob.scheduled {
                if alone {
                    self.write_queue_now(ob)?;
                } else {
                    ob.scheduled = true;
                    drop(ob);
                    self.write_wake.notify_one();
                }
            }
        }
        self.frames_sent.fetch_add(1, Ordering::Relaxed);
        Ok(async move {
            let out = rx.await;
            // The error is built only when there is one: it formats the close reason.
            let out = out.map_err(|_| guard.conn.closed_error());
            drop(guard);
            out.and_then(|r| r)
        })
    }

    /// Send a one-way notification.
    pub fn notify(self: &Arc<Self>, msg: &Msg, tail: &[u8]) -> Result<(), TransportError> {
        let bytes = encode_frame(FrameKind::Notify, 0, msg, tail)?;
        self.send_frame(bytes)
    }

    /// Send an encoded frame now: written straight from this thread when the writer task
    /// is not in the middle of a write (together with anything queued before it, in
    /// order); otherwise queued for the writer.
    pub fn send_frame(self: &Arc<Self>, frame: Vec<u8>) -> Result<(), TransportError> {
        self.send_frame_with(frame, false)
    }

    /// Send an encoded frame; with `defer`, queue it for the writer task even if the
    /// socket is idle. Senders defer when more frames are about to follow on this
    /// connection (other requests in flight, other incoming requests still being served),
    /// so those frames leave together in one write instead of one system call each.
    pub fn send_frame_with(
        self: &Arc<Self>,
        frame: Vec<u8>,
        defer: bool,
    ) -> Result<(), TransportError> {
        if self.faults_apply() {
            self.frames_sent.fetch_add(1, Ordering::Relaxed);
            return self.send_filtered(vec![Bytes::from(frame)], None, Via::Direct { defer });
        }
        self.send_unfiltered(frame, defer)
    }

    /// Send one frame given in parts (their concatenation is the frame): the parts go
    /// out back to back, never copied into one buffer. `defer` as for
    /// [`Connection::send_frame_with`].
    pub fn send_frame_parts(
        self: &Arc<Self>,
        parts: Vec<Bytes>,
        defer: bool,
    ) -> Result<(), TransportError> {
        self.frames_sent.fetch_add(1, Ordering::Relaxed);
        if self.faults_apply() {
            return self.send_filtered(parts, None, Via::Direct { defer });
        }
        self.queue_parts(parts, Via::Direct { defer }, false)
    }

    /// `send_frame_with` without the fault filter.
    fn send_unfiltered(
        self: &Arc<Self>,
        frame: Vec<u8>,
        defer: bool,
    ) -> Result<(), TransportError> {
        self.frames_sent.fetch_add(1, Ordering::Relaxed);
        let mut ob = self.outbox.lock();
        if ob.closed || ob.sealed {
            drop(ob);
            return Err(self.closed_error());
        }
        // Deferring trades latency for fewer writes; it stops paying once enough is
        // queued or the oldest queued frame has waited a while. Then this frame flushes
        // the queue, so answers keep flowing back while a peer's batch is still being
        // served (the peer then keeps its pipeline full).
        let defer = defer
            && ob.queue.len() < DEFER_MAX_FRAMES
            && ob.queued_since.is_none_or(|t| t.elapsed() < DEFER_MAX_AGE);
        if defer || ob.writing {
            if ob.queue.is_empty() {
                ob.queued_since = Some(std::time::Instant::now());
            }
            ob.queue.push_back(Bytes::from(frame));
            if !ob.writing && !ob.scheduled {
                ob.scheduled = true;
                drop(ob);
                self.write_wake.notify_one();
            }
            return Ok(());
        }
        // Direct write: whatever is queued first, then this frame, in one buffer.
        ob.queue.push_back(Bytes::from(frame));
        self.write_queue_now(ob)
    }

    /// Write whatever is queued now, from this thread, unless the writer task is in the
    /// middle of a write (then it will pick the queue up).
    fn flush_queued(self: &Arc<Self>) {
        let ob = self.outbox.lock();
        if ob.closed || ob.writing || ob.queue.is_empty() {
            return;
        }
        let _ = self.write_queue_now(ob);
    }

    /// Write the whole queue in one non-blocking write from this thread; what the socket
    /// does not take goes back to the front of the queue for the writer task. The caller
    /// checked that the writer task is not writing.
    fn write_queue_now(
        self: &Arc<Self>,
        mut ob: parking_lot::MutexGuard<'_, Outbox>,
    ) -> Result<(), TransportError> {
        ob.queued_since = None;
        self.writes.fetch_add(1, Ordering::Relaxed);
        // One vectored write of everything queued: frames (and the parts of a frame
        // whose bulk bytes were left out of its buffer) leave without being copied
        // together first.
        let written = if ob.queue.len() == 1 {
            self.stream.try_write(&ob.queue[0])
        } else {
            let slices: Vec<io::IoSlice<'_>> = ob
                .queue
                .iter()
                .take(MAX_IOVECS)
                .map(|b| io::IoSlice::new(b))
                .collect();
            self.stream.try_write_vectored(&slices)
        };
        match written {
            Ok(mut n) => {
                while n > 0 {
                    let Some(front) = ob.queue.front_mut() else {
                        break;
                    };
                    if n >= front.len() {
                        n -= front.len();
                        ob.queue.pop_front();
                    } else {
                        *front = front.slice(n..);
                        n = 0;
                    }
                }
                if ob.queue.is_empty() {
                    return Ok(());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                drop(ob);
                self.close(format!("write failed: {e}"));
                return Err(self.closed_error());
            }
        }
        // What the socket did not take stays queued, in order, for the writer task.
        if !ob.scheduled {
            ob.scheduled = true;
            drop(ob);
            self.write_wake.notify_one();
        }
        Ok(())
    }

    /// Whether an answer sent now should wait for others: more requests on this
    /// connection are being served, or the reader is still dispatching a batch.
    fn defer_answer(&self) -> bool {
        self.in_batch.load(Ordering::Relaxed) || self.incoming_in_service() > 1
    }

    /// Requests of ours awaiting a response on this connection.
    fn outgoing_in_flight(&self) -> usize {
        self.config
            .max_in_flight
            .saturating_sub(self.in_flight.available_permits())
    }

    /// Incoming requests being served on this connection.
    fn incoming_in_service(&self) -> usize {
        self.config
            .max_incoming
            .saturating_sub(self.incoming.available_permits())
    }

    /// Queue a last frame and close the connection once it is written.
    fn send_then_close(self: &Arc<Self>, frame: Vec<u8>, reason: &str) {
        *self.close_reason.lock() = Some(reason.to_string());
        {
            let mut ob = self.outbox.lock();
            ob.close_after = true;
        }
        if self.send_frame(frame).is_err() {
            return;
        }
        let mut ob = self.outbox.lock();
        if !ob.scheduled && !ob.writing {
            // Nothing left for the writer but the close itself.
            ob.scheduled = true;
            drop(ob);
            self.write_wake.notify_one();
        }
    }

    /// Close the connection: fail every pending request, stop both tasks, shut the socket.
    pub fn close(self: &Arc<Self>, reason: impl Into<String>) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let mut r = self.close_reason.lock();
            if r.is_none() {
                *r = Some(reason.into());
            }
        }
        let err = self.closed_error();
        let waiters: Vec<Reply> = {
            let mut p = self.pending.lock();
            p.closed = true;
            p.map.drain().map(|(_, tx)| tx).collect()
        };
        for tx in waiters {
            let _ = tx.send(Err(err.clone()));
        }
        self.outbox.lock().closed = true;
        self.in_flight.close();
        let _ = socket2::SockRef::from(&self.stream).shutdown(std::net::Shutdown::Both);
        self.write_wake.notify_one();
        tracing::debug!(peer = %self.peer_addr, reason = ?self.close_reason(), "connection closed");
        self.handler.on_close(self);
    }

    async fn write_loop(self: Arc<Self>) {
        let mut scratch: Vec<u8> = Vec::with_capacity(COALESCE_LIMIT);
        loop {
            self.write_wake.notified().await;
            // Let the tasks that are ready right now (typically the other calls of the
            // batch just read) add their frames first: they then leave in one write.
            tokio::task::yield_now().await;
            loop {
                let batch: Vec<Bytes> = {
                    let mut ob = self.outbox.lock();
                    ob.writing = false;
                    if ob.closed {
                        return;
                    }
                    if ob.queue.is_empty() {
                        ob.scheduled = false;
                        if ob.close_after {
                            drop(ob);
                            let reason = self.close_reason().unwrap_or_default();
                            self.close(reason);
                            return;
                        }
                        break;
                    }
                    ob.writing = true;
                    ob.scheduled = false;
                    ob.queued_since = None;
                    ob.queue.drain(..).collect()
                };
                if let Err(e) = self.write_batch(&batch, &mut scratch).await {
                    self.close(format!("write failed: {e}"));
                    return;
                }
            }
        }
    }

    async fn write_batch(&self, batch: &[Bytes], scratch: &mut Vec<u8>) -> io::Result<()> {
        scratch.clear();
        for frame in batch {
            if frame.len() >= LARGE_FRAME {
                if !scratch.is_empty() {
                    self.write_all(scratch).await?;
                    scratch.clear();
                }
                self.write_all(frame).await?;
            } else {
                if scratch.len() + frame.len() > COALESCE_LIMIT {
                    self.write_all(scratch).await?;
                    scratch.clear();
                }
                scratch.extend_from_slice(frame);
            }
        }
        if !scratch.is_empty() {
            self.write_all(scratch).await?;
        }
        Ok(())
    }

    async fn write_all(&self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            self.stream.writable().await?;
            self.writes.fetch_add(1, Ordering::Relaxed);
            match self.stream.try_write(buf) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Take the complete frames out of the read buffer (only one before the handshake
    /// completes, since the handshake changes what is accepted next).
    fn take_frames(&self) -> Result<Vec<Frame>, WireError> {
        let mut rs = self.read_state.lock();
        let mut out = Vec::new();
        loop {
            let handshaken = self.peer.get().is_some();
            let max = if handshaken {
                self.config.max_frame
            } else {
                self.config.max_hello_frame
            };
            let Some(total) = peek_frame_len(&rs.buf, max)? else {
                break;
            };
            if rs.buf.len() < total {
                let more = total - rs.buf.len();
                rs.buf.reserve(more);
                break;
            }
            let bytes = rs.buf.split_to(total).freeze();
            out.push(decode_frame(bytes, max)?);
            if !handshaken {
                break;
            }
        }
        Ok(out)
    }

    /// Read from the socket into the buffer. `Ok(false)`: nothing to read right now.
    fn read_some(&self, rs: &mut ReadState) -> io::Result<bool> {
        if rs.buf.capacity() - rs.buf.len() < 4096 {
            rs.buf.reserve(64 << 10);
        }
        match self.stream.try_read_buf(&mut rs.buf) {
            Ok(0) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection",
            )),
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Like `read_some`, but a plain `recv` on the (non-blocking) socket rather than
    /// tokio's `try_read`, which trusts readiness that only the runtime's I/O thread
    /// updates — and that thread may be waiting for this very core.
    fn read_some_direct(&self, rs: &mut ReadState) -> io::Result<bool> {
        use std::io::Read;
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; 64 << 10]);
        }
        let sock = socket2::SockRef::from(&self.stream);
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            match (&*sock).read(&mut scratch[..]) {
                Ok(0) => Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the connection",
                )),
                Ok(n) => {
                    rs.buf.extend_from_slice(&scratch[..n]);
                    Ok(true)
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
                Err(e) => Err(e),
            }
        })
    }

    async fn read_loop(self: Arc<Self>) {
        loop {
            // Dispatch every complete frame in the buffer; answers produced meanwhile
            // (by handlers that answer at once) leave in one write at the end.
            loop {
                let frames = match self.take_frames() {
                    Ok(f) => f,
                    Err(e) => {
                        self.close(format!("bad frame from peer: {e}"));
                        return;
                    }
                };
                if frames.is_empty() {
                    break;
                }
                self.in_batch.store(true, Ordering::Relaxed);
                for frame in frames {
                    let go_on = if self.faults_apply() {
                        self.dispatch_filtered(frame).await
                    } else {
                        self.dispatch(frame).await
                    };
                    if !go_on {
                        self.in_batch.store(false, Ordering::Relaxed);
                        return;
                    }
                }
                self.in_batch.store(false, Ordering::Relaxed);
                self.flush_queued();
            }
            if self.is_closed() {
                return;
            }
            // Wait for data, or for a caller that read for itself and left frames it
            // does not handle in the buffer.
            tokio::select! {
                r = self.stream.readable() => {
                    if let Err(e) = r {
                        self.close(format!("read failed: {e}"));
                        return;
                    }
                }
                _ = self.read_kick.notified() => {}
            }
            let r = {
                let mut rs = self.read_state.lock();
                self.read_some(&mut rs)
            };
            if let Err(e) = r {
                if e.kind() == io::ErrorKind::UnexpectedEof {
                    let unread = self.read_state.lock().buf.len();
                    if unread > 0 {
                        self.close(format!(
                            "peer closed the connection mid-frame ({unread} bytes of an \
                             incomplete frame were discarded)"
                        ));
                    } else {
                        self.close("peer closed the connection");
                    }
                } else {
                    self.close(format!("read failed: {e}"));
                }
                return;
            }
        }
    }

    /// A blocked caller reads the socket itself instead of waiting for the reader task
    /// to be woken (a thread wake-up costs ~50–100 µs on a small VM; the caller is
    /// awake anyway while it spins). Only responses are handled here; anything else is
    /// left, in order, for the reader task, which is kicked. Returns whether it read.
    fn read_responses_here(self: &Arc<Self>) -> bool {
        if self.peer.get().is_none() || self.is_closed() {
            return false;
        }
        let Some(mut rs) = self.read_state.try_lock() else {
            return false;
        };
        match self.read_some_direct(&mut rs) {
            Ok(true) if self.config.faults.is_active() => {
                // Frames must pass the fault filter, which the reader task applies:
                // leave what was read to it.
                drop(rs);
                self.read_kick.notify_one();
                return true;
            }
            Ok(true) => {}
            Ok(false) => return false,
            Err(_) => {
                // Let the reader task notice and close with the right reason.
                drop(rs);
                self.read_kick.notify_one();
                return false;
            }
        }
        let mut done = Vec::new();
        let max = self.config.max_frame;
        loop {
            // A frame that is not a response (byte 5 is the kind) stays for the reader.
            if rs.buf.len() >= HEADER_LEN && rs.buf[5] != FrameKind::Response as u8 {
                break;
            }
            let total = match peek_frame_len(&rs.buf, max) {
                Ok(Some(t)) if rs.buf.len() >= t => t,
                _ => break,
            };
            let bytes = rs.buf.split_to(total).freeze();
            match decode_frame(bytes, max) {
                Ok(f) => done.push(f),
                Err(_) => break,
            }
        }
        let leftover = !rs.buf.is_empty();
        drop(rs);
        for frame in done {
            let tx = self.pending.lock().map.remove(&frame.id);
            if let Some(tx) = tx {
                let _ = tx.send(Ok(frame));
            }
        }
        if leftover {
            self.read_kick.notify_one();
        }
        true
    }

    /// Handle one frame; false means stop reading.
    async fn dispatch(self: &Arc<Self>, frame: Frame) -> bool {
        if self.peer.get().is_none() {
            return self.handshake_frame(frame);
        }
        match frame.kind {
            FrameKind::Response => {
                let tx = self.pending.lock().map.remove(&frame.id);
                if let Some(tx) = tx {
                    let _ = tx.send(Ok(frame));
                }
                true
            }
            FrameKind::Request => {
                if let Msg::Ping = frame.msg {
                    if let Ok(bytes) = encode_frame(FrameKind::Response, frame.id, &Msg::Pong, &[])
                    {
                        let _ = self.send_frame_with(bytes, true);
                    }
                    return true;
                }
                let permit = match self.incoming.clone().acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => return false,
                };
                let reply = Responder {
                    conn: self.clone(),
                    id: frame.id,
                    done: false,
                    _permit: permit,
                };
                self.handler.on_request(self, frame, reply);
                true
            }
            FrameKind::Notify => {
                self.handler.on_notify(self, frame);
                true
            }
        }
    }

    // ---- the fault filter's verdicts ----------------------------------------------------

    /// Whether frames go through the fault filter now: rules are set and the handshake
    /// is done (hellos are never filtered; partitions act on them separately).
    fn faults_apply(&self) -> bool {
        self.config.faults.is_active() && self.peer.get().is_some()
    }

    /// This process as its identity names it (the filter may know better: `set_local`).
    fn local_hint(&self) -> Option<Endpoint> {
        Endpoint::from_hello(self.identity.role, self.identity.node)
    }

    fn peer_endpoint(&self) -> Option<Endpoint> {
        self.peer
            .get()
            .and_then(|p| Endpoint::from_hello(p.role, p.node))
    }

    fn judge(&self, direction: Direction, kind: &str, len: usize) -> Verdict {
        self.config.faults.judge(&FrameInfo {
            conn: self.id,
            local_hint: self.local_hint(),
            peer: self.peer_endpoint(),
            dialed: self.is_client,
            direction,
            kind,
            len,
        })
    }

    /// Send one frame (given as consecutive parts) as the fault filter decides.
    fn send_filtered(
        self: &Arc<Self>,
        parts: Vec<Bytes>,
        kind: Option<&'static str>,
        via: Via,
    ) -> Result<(), TransportError> {
        let len = parts.iter().map(Bytes::len).sum();
        let kind = kind.unwrap_or_else(|| frame_kind_name(&parts));
        match self.judge(Direction::Outgoing, kind, len) {
            Verdict::Pass => self.queue_parts(parts, via, true),
            Verdict::Drop => Ok(()),
            Verdict::Delay(d) => {
                // A timer task, so neither this sender nor other connections wait.
                let conn = self.clone();
                self.rt.spawn(async move {
                    tokio::time::sleep(d).await;
                    let _ = conn.queue_parts(parts, Via::Direct { defer: false }, true);
                });
                Ok(())
            }
            Verdict::Reorder { after } => self.hold_out(parts, after),
            Verdict::Cut { keep } => {
                self.cut(parts, keep, kind, len);
                // The sender cannot tell: its request fails when the connection closes.
                Ok(())
            }
            // Only produced for incoming frames.
            Verdict::CutIncoming => Ok(()),
        }
    }

    /// Queue a frame that passed the filter (or that it released) and write it as `via`
    /// says. With `counts`, it counts for the frames held back by `Reorder`: those whose
    /// count runs out follow it at once.
    fn queue_parts(
        self: &Arc<Self>,
        parts: Vec<Bytes>,
        via: Via,
        counts: bool,
    ) -> Result<(), TransportError> {
        let mut ob = self.outbox.lock();
        if ob.closed || ob.sealed {
            drop(ob);
            return Err(self.closed_error());
        }
        let defer = match via {
            Via::Direct { defer } => {
                defer
                    && ob.queue.len() < DEFER_MAX_FRAMES
                    && ob.queued_since.is_none_or(|t| t.elapsed() < DEFER_MAX_AGE)
            }
            Via::Writer => true,
        };
        if ob.queue.is_empty() {
            ob.queued_since = Some(std::time::Instant::now());
        }
        ob.queue.extend(parts);
        if counts && !ob.held.is_empty() {
            let mut due = Vec::new();
            ob.held.retain_mut(|h| {
                h.after -= 1;
                if h.after == 0 {
                    due.push(std::mem::take(&mut h.parts));
                }
                h.after > 0
            });
            for parts in due {
                ob.queue.extend(parts);
            }
        }
        if defer || ob.writing {
            if !ob.writing && !ob.scheduled {
                ob.scheduled = true;
                drop(ob);
                self.write_wake.notify_one();
            }
            return Ok(());
        }
        self.write_queue_now(ob)
    }

    /// Hold an outgoing frame back until `after` more frames went out (or
    /// `REORDER_MAX_HOLD` passed).
    fn hold_out(self: &Arc<Self>, parts: Vec<Bytes>, after: u32) -> Result<(), TransportError> {
        let token = self.next_hold.fetch_add(1, Ordering::Relaxed);
        {
            let mut ob = self.outbox.lock();
            if ob.closed || ob.sealed {
                drop(ob);
                return Err(self.closed_error());
            }
            ob.held.push(HeldOut {
                token,
                after,
                parts,
            });
        }
        let conn = Arc::downgrade(self);
        self.rt.spawn(async move {
            tokio::time::sleep(REORDER_MAX_HOLD).await;
            if let Some(c) = conn.upgrade() {
                c.release_held_out(Some(token));
            }
        });
        Ok(())
    }

    /// Send held-back outgoing frames now: the one named `token`, or all of them.
    fn release_held_out(self: &Arc<Self>, token: Option<u64>) {
        let mut ob = self.outbox.lock();
        if ob.closed || ob.sealed || ob.held.is_empty() {
            return;
        }
        let mut due = Vec::new();
        ob.held.retain_mut(|h| {
            let go = token.is_none_or(|t| t == h.token);
            if go {
                due.push(std::mem::take(&mut h.parts));
            }
            !go
        });
        if due.is_empty() {
            return;
        }
        if ob.queue.is_empty() {
            ob.queued_since = Some(std::time::Instant::now());
        }
        for parts in due {
            ob.queue.extend(parts);
        }
        if !ob.writing && !ob.scheduled {
            ob.scheduled = true;
            drop(ob);
            self.write_wake.notify_one();
        }
    }

    /// Write the first `keep` bytes of a frame, then close: the peer reads a truncated
    /// frame followed by the end of the stream. Nothing may be queued after the prefix
    /// (the peer would read it as the rest of the frame), so the outbox is sealed.
    fn cut(self: &Arc<Self>, parts: Vec<Bytes>, keep: usize, kind: &str, len: usize) {
        let mut prefix = Vec::new();
        let mut left = keep;
        for p in parts {
            if left == 0 {
                break;
            }
            let n = left.min(p.len());
            prefix.push(p.slice(..n));
            left -= n;
        }
        {
            let mut r = self.close_reason.lock();
            if r.is_none() {
                *r = Some(format!(
                    "cut by the fault filter: a {kind} frame was cut after {keep} of {len} bytes"
                ));
            }
        }
        let mut ob = self.outbox.lock();
        if ob.closed || ob.sealed {
            return;
        }
        ob.sealed = true;
        ob.close_after = true;
        if ob.queue.is_empty() {
            ob.queued_since = Some(std::time::Instant::now());
        }
        ob.queue.extend(prefix);
        if !ob.writing && !ob.scheduled {
            ob.scheduled = true;
            drop(ob);
            self.write_wake.notify_one();
        }
    }

    /// Handle one incoming frame as the fault filter decides; false means stop reading.
    async fn dispatch_filtered(self: &Arc<Self>, frame: Frame) -> bool {
        let kind = frame.msg.name();
        match self.judge(Direction::Incoming, kind, 0) {
            Verdict::Pass => {
                if !self.dispatch(frame).await {
                    return false;
                }
                let due: Vec<Frame> = {
                    let mut held = self.held_in.lock();
                    let mut due = Vec::new();
                    let mut i = 0;
                    while i < held.len() {
                        held[i].after -= 1;
                        if held[i].after == 0 {
                            due.push(held.remove(i).frame);
                        } else {
                            i += 1;
                        }
                    }
                    due
                };
                for f in due {
                    if !self.dispatch(f).await {
                        return false;
                    }
                }
                true
            }
            Verdict::Drop => true,
            Verdict::Delay(d) => {
                let conn = self.clone();
                self.rt.spawn(async move {
                    tokio::time::sleep(d).await;
                    if !conn.is_closed() {
                        let _ = conn.dispatch(frame).await;
                    }
                });
                true
            }
            Verdict::Reorder { after } => {
                let token = self.next_hold.fetch_add(1, Ordering::Relaxed);
                self.held_in.lock().push(HeldIn {
                    token,
                    after,
                    frame,
                });
                let conn = Arc::downgrade(self);
                self.rt.spawn(async move {
                    tokio::time::sleep(REORDER_MAX_HOLD).await;
                    if let Some(c) = conn.upgrade() {
                        c.release_held_in(Some(token));
                    }
                });
                true
            }
            Verdict::Cut { .. } | Verdict::CutIncoming => {
                self.close(format!(
                    "cut by the fault filter: an incoming {kind} frame was discarded and the \
                     connection closed"
                ));
                false
            }
        }
    }

    /// Handle held-back incoming frames now (on a task): the one named `token`, or all.
    fn release_held_in(self: &Arc<Self>, token: Option<u64>) {
        let due: Vec<Frame> = {
            let mut held = self.held_in.lock();
            let mut due = Vec::new();
            let mut i = 0;
            while i < held.len() {
                if token.is_none_or(|t| t == held[i].token) {
                    due.push(held.remove(i).frame);
                } else {
                    i += 1;
                }
            }
            due
        };
        if due.is_empty() {
            return;
        }
        let conn = self.clone();
        self.rt.spawn(async move {
            for f in due {
                if conn.is_closed() || !conn.dispatch(f).await {
                    break;
                }
            }
        });
    }

    /// The filter's rules changed: release what earlier rules held back, and close this
    /// connection if a new `close_open` partition separates its ends.
    pub(crate) fn fault_rules_changed(self: &Arc<Self>) {
        self.release_held_out(None);
        self.release_held_in(None);
        if self.is_closed() || self.peer.get().is_none() {
            return;
        }
        let reason = self.config.faults.close_reason(
            self.id,
            self.local_hint(),
            self.peer_endpoint(),
            self.is_client,
        );
        if let Some(reason) = reason {
            self.close(reason);
        }
    }

    /// Frames before the handshake completes.
    fn handshake_frame(self: &Arc<Self>, frame: Frame) -> bool {
        if self.is_client {
            // The only thing a client expects before the handshake is the hello's answer.
            if frame.kind == FrameKind::Response && frame.id == HELLO_ID {
                if let Msg::HelloOk {
                    role,
                    node,
                    binary,
                    program,
                    verified,
                } = &frame.msg
                {
                    let partitioned = if self.config.faults.is_active() {
                        self.config.faults.refusal(
                            self.id,
                            self.local_hint(),
                            Endpoint::from_hello(*role, *node),
                            true,
                            frame.msg.name(),
                        )
                    } else {
                        None
                    };
                    match judge_hello(&self.identity, *role, binary, program) {
                        Ok(_) if partitioned.is_some() => {
                            *self.refusal.lock() = partitioned.map(TransportError::Refused);
                        }
                        Ok(v) => {
                            let _ = self.peer.set(PeerInfo {
                                role: *role,
                                node: *node,
                                verified: v && *verified,
                                program: program.clone(),
                                addr: self.peer_addr,
                            });
                        }
                        Err(m) => {
                            *self.refusal.lock() = Some(TransportError::BinaryMismatch(m));
                        }
                    }
                }
                let tx = self.pending.lock().map.remove(&frame.id);
                if let Some(tx) = tx {
                    let _ = tx.send(Ok(frame));
                }
                return true;
            }
            self.close(format!(
                "peer sent {} before answering the hello",
                frame.msg.name()
            ));
            return false;
        }
        let Msg::Hello {
            role,
            node,
            binary,
            program,
        } = &frame.msg
        else {
            let msg = Msg::Error(RemoteError::Unauthorized(
                "the first frame on a connection must be a hello".into(),
            ));
            if let Ok(bytes) = encode_frame(FrameKind::Response, frame.id, &msg, &[]) {
                self.send_then_close(bytes, "no hello");
            } else {
                self.close("no hello");
            }
            return false;
        };
        if frame.kind != FrameKind::Request {
            self.close("hello must be a request");
            return false;
        }
        if self.config.faults.is_active() {
            let partitioned = self.config.faults.refusal(
                self.id,
                self.local_hint(),
                Endpoint::from_hello(*role, *node),
                false,
                frame.msg.name(),
            );
            if let Some(reason) = partitioned {
                tracing::info!(peer = %self.peer_addr, "{reason}");
                let msg = Msg::Error(RemoteError::Refused(reason.clone()));
                match encode_frame(FrameKind::Response, frame.id, &msg, &[]) {
                    Ok(bytes) => self.send_then_close(bytes, &reason),
                    Err(_) => self.close(reason),
                }
                return false;
            }
        }
        match judge_hello(&self.identity, *role, binary, program) {
            Ok(verified) => {
                let _ = self.peer.set(PeerInfo {
                    role: *role,
                    node: *node,
                    verified,
                    program: program.clone(),
                    addr: self.peer_addr,
                });
                let ok = Msg::HelloOk {
                    role: self.identity.role,
                    node: self.identity.node,
                    binary: self.identity.binary,
                    program: self.identity.program.clone(),
                    verified,
                };
                // Never filtered: the handshake is not subject to frame rules.
                match encode_frame(FrameKind::Response, frame.id, &ok, &[]) {
                    Ok(bytes) => self.send_unfiltered(bytes, false).is_ok(),
                    Err(_) => false,
                }
            }
            Err(explanation) => {
                tracing::warn!(peer = %self.peer_addr, "{explanation}");
                let msg = Msg::Error(RemoteError::Refused(explanation));
                if let Ok(bytes) = encode_frame(FrameKind::Response, frame.id, &msg, &[]) {
                    self.send_then_close(bytes, "binary mismatch");
                } else {
                    self.close("binary mismatch");
                }
                false
            }
        }
    }
}

/// Removes a request's pending entry if its future is dropped before the response.
struct PendingGuard<'a> {
    conn: &'a Connection,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        WAITING_ON.with(|w| {
            let mut w = w.borrow_mut();
            if std::ptr::eq(w.as_ptr(), self.conn) {
                *w = std::sync::Weak::new();
            }
        });
        self.conn.pending.lock().map.remove(&self.id);
    }
}

/// Removes a request's pending entry when its answer is no longer awaited.
struct OwnedPending {
    conn: Arc<Connection>,
    id: u64,
}

impl Drop for OwnedPending {
    fn drop(&mut self) {
        self.conn.pending.lock().map.remove(&self.id);
    }
}

/// The right (and duty) to answer one incoming request. Dropping it unanswered sends an
/// internal error, so the caller never waits forever.
pub struct Responder {
    conn: Arc<Connection>,
    id: u64,
    done: bool,
    _permit: OwnedSemaphorePermit,
}

impl Responder {
    /// The connection the request came on.
    pub fn connection(&self) -> &Arc<Connection> {
        &self.conn
    }

    /// The peer that sent the request.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.conn.peer()
    }

    /// Id of the request (needed to encode a response frame by hand).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Answer with a complete, already encoded response frame (built with
    /// `granule_wire::begin_frame(FrameKind::Response, self.id(), ..)`).
    pub fn send_raw(mut self, frame: Vec<u8>) -> Result<(), TransportError> {
        self.done = true;
        let defer = self.conn.defer_answer();
        self.conn.send_frame_with(frame, defer)
    }

    /// Answer with a complete response frame given in parts (see
    /// [`Connection::send_frame_parts`]).
    pub fn send_raw_parts(mut self, parts: Vec<Bytes>) -> Result<(), TransportError> {
        self.done = true;
        let defer = self.conn.defer_answer();
        self.conn.send_frame_parts(parts, defer)
    }

    /// Answer with a message and a raw tail.
    pub fn send(mut self, msg: &Msg, tail: &[u8]) -> Result<(), TransportError> {
        self.done = true;
        let bytes = encode_frame(FrameKind::Response, self.id, msg, tail)?;
        let defer = self.conn.defer_answer();
        self.conn.send_frame_with(bytes, defer)
    }

    /// Answer with an error.
    pub fn error(self, e: RemoteError) {
        let _ = self.send(&Msg::Error(e), &[]);
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if !self.done {
            let msg = Msg::Error(RemoteError::Internal(
                "the request was dropped without an answer".into(),
            ));
            if let Ok(bytes) = encode_frame(FrameKind::Response, self.id, &msg, &[]) {
                let _ = self.conn.send_frame(bytes);
            }
        }
    }
}

/// The message kind of an encoded frame, for the fault filter (which only looks while
/// rules are set, so the decoding costs nothing otherwise).
fn frame_kind_name(parts: &[Bytes]) -> &'static str {
    match parts {
        [one] => decode_frame(one.clone(), usize::MAX)
            .map(|f| f.msg.name())
            .unwrap_or("?"),
        _ => "?",
    }
}
