//! Bounded HTTP/1 serving for Granule's doors (owned here). Every HTTP listener of a
//! Granule process — a node's `/metrics`, a service front door, the controller's
//! dashboard — serves through [`serve`], which:
//!
//! - caps the connections one listener serves at once (`http.max_connections`): a
//!   connection beyond is answered `503` and closed at once, never queued;
//! - closes a connection that has not sent a request's complete headers within
//!   `http.header_timeout` of opening, or of the first byte of its next request;
//! - closes a connection with no request running and no byte moving for
//!   `http.idle_timeout` (idle keep-alive connections, clients that stop reading);
//! - refuses a connection that would leave fewer than `node.fd_reserve` file descriptors
//!   free below the process's limit, counting the connections of every door of the
//!   process together, so that no HTTP client can starve cluster traffic (peer
//!   connections, the controller) of descriptors;
//! - backs off when accepting fails (out of descriptors) instead of spinning, and logs
//!   such trouble at most once a second.
//!
//! Dropping the future [`serve`] returns closes the listener and every connection it
//! serves. HTTP itself is hyper's; this crate only decides which connections live. It
//! serves the router it is given and knows nothing of nodes, proclets or services; it
//! counts the process's descriptors through `granule-host` (the one reader of `/proc`).
#![forbid(unsafe_code)]

mod fds;

pub use fds::open_connections;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// The bounds of one listener (from the configuration: [`Limits::from_config`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (`http.max_connections`).
    pub max_connections: usize,
    /// Time for a request's complete headers (`http.header_timeout`).
    pub header_timeout: Duration,
    /// Time a connection may sit with no request running and no byte moving
    /// (`http.idle_timeout`).
    pub idle_timeout: Duration,
    /// File descriptors the process keeps free for cluster traffic (`node.fd_reserve`).
    pub fd_reserve: u64,
}

impl Limits {
    /// The bounds a configuration sets.
    pub fn from_config(c: &granule_config::Config) -> Limits {
        Limits {
            max_connections: usize::try_from(c.http.max_connections).unwrap_or(usize::MAX),
            header_timeout: c.http.header_timeout,
            idle_timeout: c.http.idle_timeout,
            fd_reserve: c.node.fd_reserve,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::from_config(&granule_config::Config::default())
    }
}

/// What a refused connection is told before it is closed (without waiting: a client
/// that does not read it just sees the connection close).
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 44\r\nconnection: close\r\n\r\nbusy: too many connections, try again later\n";

/// Accept errors that concern one connection only (it was reset before it was
/// accepted): try the next at once.
fn per_connection(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted
    )
}

/// How long to wait after accepting failed for lack of resources (out of file
/// descriptors, of memory): long enough not to spin, short enough that a door comes back
/// soon after descriptors are freed.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// A warning logged at most once a second, saying how many were held back meanwhile.
#[derive(Default)]
struct Throttled {
    last: Option<Instant>,
    held: u64,
}

impl Throttled {
    fn warn(&mut self, message: impl FnOnce() -> String) {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            self.held += 1;
            return;
        }
        let held = std::mem::take(&mut self.held);
        self.last = Some(now);
        if held > 0 {
            tracing::warn!("{} ({held} more since the last report)", message());
        } else {
            tracing::warn!("{}", message());
        }
    }
}

/// Serve `app` on `listener` within `limits` until the returned future is dropped (it
/// never ends on its own). `door` names the listener in logs ("the dashboard").
pub async fn serve(listener: TcpListener, app: Router, limits: Limits, door: impl Into<String>) {
    let door: String = door.into();
    let slots = Arc::new(Semaphore::new(
        limits.max_connections.min(Semaphore::MAX_PERMITS),
    ));
    let mut conns = JoinSet::new();
    let mut accept_trouble = Throttled::default();
    let mut refusals = Throttled::default();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            // Reap finished connections (the set would otherwise keep their results).
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) if per_connection(&e) => continue,
            Err(e) => {
                accept_trouble.warn(|| format!("{door}: accepting a connection failed: {e}"));
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            refusals.warn(|| {
                format!(
                    "{door}: refusing connections: {} open (http.max_connections)",
                    limits.max_connections
                )
            });
            refuse(stream);
            continue;
        };
        let Some(slot) = fds::admit(limits.fd_reserve) else {
            refusals.warn(|| {
                format!(
                    "{door}: refusing connections: they would leave fewer than {} file \
                     descriptors for cluster traffic (node.fd_reserve)",
                    limits.fd_reserve
                )
            });
            refuse(stream);
            continue;
        };
        let app = app.clone();
        conns.spawn(async move {
            // Held until the connection is closed (declared first: dropped last).
            let _held = (permit, slot);
            connection(stream, app, limits).await;
        });
    }
}

/// Answer 503 if the socket takes it at once, and close.
fn refuse(stream: TcpStream) {
    let _ = stream.try_write(BUSY);
}

/// Why a connection was closed by its bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expired {
    Header,
    Idle,
}

/// What a connection's watch does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    /// Look again after this long.
    Wait(Duration),
    Close(Expired),
}

/// No time recorded.
const NONE: u64 = u64::MAX;

/// A connection's activity, in milliseconds since it was accepted: written by its I/O
/// and its requests, read by its watch.
struct Activity {
    start: Instant,
    /// Requests being handled (hyper's HTTP/1 handles one at a time).
    running: AtomicU64,
    /// The last time a byte was read or written, or a request began or ended.
    last_io: AtomicU64,
    /// When the headers being waited for began (the connection's opening for its first
    /// request, then the first byte after a request); `NONE` when none are awaited.
    headers_since: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            running: AtomicU64::new(0),
            last_io: AtomicU64::new(0),
            headers_since: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn read(&self) {
        let now = self.now();
        self.last_io.store(now, Ordering::Relaxed);
        // A byte while no request runs starts the next request's headers.
        if self.running.load(Ordering::Relaxed) == 0 {
            let _ = self.headers_since.compare_exchange(
                NONE,
                now,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    fn wrote(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
    }

    fn begin(self: &Arc<Self>) -> Running {
        self.running.fetch_add(1, Ordering::Relaxed);
        self.headers_since.store(NONE, Ordering::Relaxed);
        self.wrote();
        Running(self.clone())
    }

    /// The watch's decision at `now` (milliseconds since the start).
    fn next(&self, now: u64, limits: &Limits) -> Next {
        let header = limits.header_timeout.as_millis() as u64;
        let idle = limits.idle_timeout.as_millis() as u64;
        if self.running.load(Ordering::Relaxed) > 0 {
            // A running request is its handler's to bound; look again later.
            return Next::Wait(Duration::from_millis(header.min(idle).max(1)));
        }
        let mut due = u64::MAX;
        let since = self.headers_since.load(Ordering::Relaxed);
        if since != NONE {
            let at = since.saturating_add(header);
            if now >= at {
                return Next::Close(Expired::Header);
            }
            due = at;
        }
        let at = self.last_io.load(Ordering::Relaxed).saturating_add(idle);
        if now >= at {
            return Next::Close(Expired::Idle);
        }
        due = due.min(at);
        Next::Wait(Duration::from_millis(due - now))
    }
}

/// A request being handled; its end is activity too.
struct Running(Arc<Activity>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.wrote();
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection's socket, noting its activity.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serve one connection until it ends or outlives its bounds (then it is dropped, which
/// closes it: no graceful shutdown, which would wait on a client that does not read).
async fn connection(stream: TcpStream, app: Router, limits: Limits) {
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let requests = activity.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let running = requests.begin();
        let mut app = app.clone();
        async move {
            let response = tower_service::Service::call(&mut app, req).await;
            drop(running);
            response
        }
    });
    // The timeouts are this crate's (hyper's header timer also runs between requests,
    // which would make the idle timeout the header timeout).
    let conn = hyper::server::conn::http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    loop {
        let wait = match activity.next(activity.now(), &limits) {
            Next::Wait(d) => d,
            Next::Close(why) => {
                tracing::debug!("closing an HTTP connection: {why:?} timeout");
                return;
            }
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("HTTP connection ended: {e}");
                }
                return;
            }
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests;
