//! Listening for and accepting connections.

use crate::conn::Connection;
use crate::handshake::Identity;
use crate::{Handler, TransportConfig, TransportError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// A bound listening socket.
pub struct Listener {
    inner: TcpListener,
    addr: SocketAddr,
}

impl Listener {
    /// Bind `addr` (use port 0 for a free port). The error names the address and says what
    /// to do when the port is taken.
    pub async fn bind(addr: &str) -> Result<Listener, TransportError> {
        let inner = TcpListener::bind(addr).await.map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                " (the port is in use: pick another port, or port 0 for any free one)"
            } else {
                ""
            };
            TransportError::Connect {
                addr: addr.to_string(),
                reason: format!("cannot listen: {e}{hint}"),
            }
        })?;
        let addr = inner.local_addr().map_err(|e| TransportError::Connect {
            addr: addr.to_string(),
            reason: e.to_string(),
        })?;
        Ok(Listener { inner, addr })
    }

    /// The address actually bound (with the chosen port).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Accept connections forever, each served by `handler` after a successful hello.
/// Runs on the current tokio runtime; connections' tasks are spawned onto it.
pub async fn serve(
    listener: Listener,
    identity: Arc<Identity>,
    config: Arc<TransportConfig>,
    handler: Arc<dyn Handler>,
) {
    // Accept trouble is logged at most once a second (out of file descriptors, accept
    // fails at every try: a line per try would flood the log).
    let mut last_warned: Option<std::time::Instant> = None;
    let mut held = 0u64;
    loop {
        match listener.inner.accept().await {
            Ok((stream, peer)) => {
                Connection::accepted(
                    stream,
                    peer,
                    identity.clone(),
                    config.clone(),
                    handler.clone(),
                );
            }
            // One connection reset before it was accepted: take the next.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => {
                // Typically out of file descriptors: back off instead of spinning.
                if last_warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    let more = std::mem::take(&mut held);
                    tracing::warn!(
                        "accept failed on {}: {e} ({more} more failures since the last report)",
                        listener.addr
                    );
                    last_warned = Some(std::time::Instant::now());
                } else {
                    held += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}
