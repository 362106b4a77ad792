//! Transport errors.

use granule_wire::WireError;
use thiserror::Error;

/// Why a connection or a request on it failed.
#[derive(Debug, Error, Clone)]
pub enum TransportError {
    /// Could not open a TCP connection.
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    /// The connection is closed (peer went away, protocol error, or closed locally).
    /// Requests that were in flight may or may not have run on the peer.
    #[error("connection to {peer} closed: {reason}")]
    Closed { peer: String, reason: String },
    /// The peer refused the handshake.
    #[error("{0}")]
    Refused(String),
    /// The peer runs a different executable than this process; code cannot be shipped.
    #[error("{0}")]
    BinaryMismatch(String),
    /// The hello exchange did not finish in time.
    #[error("handshake with {0} timed out")]
    HandshakeTimeout(String),
    /// A frame could not be encoded or decoded.
    #[error(transparent)]
    Wire(#[from] WireError),
}

impl TransportError {
    /// True when the request certainly did not reach the peer's handler (so retrying
    /// elsewhere cannot execute it twice).
    pub fn never_sent(&self) -> bool {
        matches!(
            self,
            TransportError::Connect { .. }
                | TransportError::Refused(_)
                | TransportError::BinaryMismatch(_)
                | TransportError::HandshakeTimeout(_)
        )
    }
}
