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
            Err(e) => {
                // Typically out of file descriptors: back off instead of spinning.
                tracing::warn!("accept failed on {}: {e}", listener.addr);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}
