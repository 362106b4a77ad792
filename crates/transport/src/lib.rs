//! Granule's transport: TCP connections that carry framed requests, responses and
//! notifications between Granule processes.
//!
//! This crate owns sockets and their life cycle: connecting and accepting, the hello
//! handshake (including the identical-binary check between proclet hosts), request ids
//! and matching responses to requests, coalescing small frames into larger writes,
//! per-connection flow control (a limit on requests in flight in each direction) and
//! closing. It does not interpret messages beyond the handshake: incoming requests are
//! handed to a [`Handler`] supplied by the runtime or the controller.
//!
//! Threading: every connection has a reader task and a writer task on the tokio runtime it
//! was created on. A frame is written straight from the sending thread when nothing is
//! queued (no hand-off to another thread on the common path); while a write is in
//! progress, later frames queue up and go out together in one write; answers produced
//! while other requests on the connection are still being served are held back briefly
//! (up to 64 frames or 500 µs) so they leave together too. A thread that blocks on a
//! request (inside [`caller_reads`]) reads its own response from the socket instead of
//! waiting for the reader task to be woken, and sleeps in `poll(2)` on the socket
//! ([`wait_for_reply`]): no thread hand-off on a synchronous call's reply path.
//!
//! Fault injection: a [`FaultFilter`] attached through [`TransportConfig::faults`] drops,
//! delays, reorders or cuts frames and partitions nodes, by rules a test sets and
//! replaces while connections are open (see the `faults` module). Without rules it costs
//! one relaxed atomic load per frame.
#![forbid(unsafe_code)]

mod conn;
mod error;
pub mod faults;
mod handshake;
mod server;

pub use conn::{caller_reads, wait_for_reply, CallerReads, Connection, PeerInfo, Responder};
pub use error::TransportError;
pub use faults::{
    Decision, Direction, Endpoint, FaultAction, FaultError, FaultFilter, FaultRule, FaultRules,
    Frames, Partition, TraceAction, TraceEntry,
};
pub use handshake::{judge_hello, Identity};
pub use server::{serve, Listener};

use std::sync::Arc;
use std::time::Duration;

/// Tunables of a connection.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// Largest frame accepted after the handshake.
    pub max_frame: usize,
    /// Largest frame accepted before the handshake completes (a hello is small; this
    /// keeps a stranger from making us buffer a large claimed frame).
    pub max_hello_frame: usize,
    /// Outgoing requests that may await a response at once on one connection; further
    /// requests wait for a slot.
    pub max_in_flight: usize,
    /// Incoming requests being served at once on one connection; beyond it the reader
    /// stops reading, which pushes back on the sender through TCP.
    pub max_incoming: usize,
    /// Time allowed for connecting and for the hello exchange.
    pub handshake_timeout: Duration,
    /// Fault injection for tests. The default filter has no rules and does nothing;
    /// share one `Arc` between the configs of a process to steer all its connections.
    pub faults: Arc<FaultFilter>,
}

impl TransportConfig {
    /// This configuration with `faults` attached.
    pub fn with_faults(mut self, faults: Arc<FaultFilter>) -> Self {
        self.faults = faults;
        self
    }
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            max_frame: granule_wire::DEFAULT_MAX_FRAME,
            max_hello_frame: 64 << 10,
            max_in_flight: 4096,
            max_incoming: 4096,
            handshake_timeout: Duration::from_secs(5),
            faults: Arc::new(FaultFilter::new()),
        }
    }
}

/// Receives what a connection's peer sends that is not a response.
///
/// Called on the connection's reader task: implementations must not block. Work that can
/// block (running a proclet's closure, calling other nodes) belongs in a spawned task that
/// owns the [`Responder`].
pub trait Handler: Send + Sync + 'static {
    /// A request arrived; answer it through `reply` (dropping `reply` unanswered sends an
    /// internal error to the caller, so a request never hangs).
    fn on_request(&self, conn: &Arc<Connection>, frame: granule_wire::Frame, reply: Responder);

    /// A one-way notification arrived.
    fn on_notify(&self, conn: &Arc<Connection>, frame: granule_wire::Frame) {
        let _ = (conn, frame);
    }

    /// The connection closed (either side, any reason). Pending requests have already
    /// been failed.
    fn on_close(&self, conn: &Arc<Connection>) {
        let _ = conn;
    }
}
