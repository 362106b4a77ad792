//! A connection to the broker over Granule's transport, for producers, consumers and
//! tools (`granule status`, `granule kv`), and [`BrokerLeases`], the consumer's
//! [`LeaseSource`] backed by it.
//!
//! Owns: connecting (as a tool: market peers ship no code), typed requests and their
//! errors, and the consumer's side of revocation notices. The broker may run inside the
//! controller (`granule controller --broker`), so the same address serves both.

use crate::consumer::{ConsumerError, LeaseSource, Revocation};
use futures::future::BoxFuture;
use granule_transport::{Connection, Handler, Identity, Responder, TransportConfig};
use granule_wire::market::{EvictionMode, LeaseGrant, LeaseId, MarketMsg, MarketView};
use granule_wire::{Frame, Msg, RemoteError, Role};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Why a request to the broker failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum MarketError {
    #[error("broker at {addr} is unreachable: {reason} (is it running? start one with `granule broker` or `granule controller --broker`, and check market.broker / --broker)")]
    Unreachable { addr: String, reason: String },
    #[error("the connection to the broker at {addr} failed: {reason}")]
    Lost { addr: String, reason: String },
    #[error("the broker refused: {0}")]
    Refused(String),
    #[error("broker protocol error: {0}")]
    Protocol(String),
}

/// A handler for peers that expect nothing unprompted from the broker.
struct Ignore;

impl Handler for Ignore {
    fn on_request(&self, _c: &Arc<Connection>, _f: Frame, r: Responder) {
        r.error(RemoteError::Protocol(
            "this market client serves no requests".into(),
        ));
    }
}

/// A connection to the broker.
#[derive(Clone)]
pub struct BrokerClient {
    conn: Arc<Connection>,
    addr: String,
}

impl BrokerClient {
    /// Connect; `handler` receives what the broker sends unprompted (a producer's store
    /// orders, a consumer's revocation notices).
    pub async fn connect(
        addr: &str,
        program: &str,
        handler: Arc<dyn Handler>,
    ) -> Result<BrokerClient, MarketError> {
        let identity = Arc::new(Identity::tool(Role::Tool, program));
        let conn = Connection::connect(
            addr,
            identity,
            Arc::new(TransportConfig::default()),
            handler,
        )
        .await
        .map_err(|e| MarketError::Unreachable {
            addr: addr.to_string(),
            reason: e.to_string(),
        })?;
        Ok(BrokerClient {
            conn,
            addr: addr.to_string(),
        })
    }

    /// Connect as a tool that only asks (status, top).
    pub async fn connect_tool(addr: &str, program: &str) -> Result<BrokerClient, MarketError> {
        Self::connect(addr, program, Arc::new(Ignore)).await
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn is_closed(&self) -> bool {
        self.conn.is_closed()
    }

    pub fn close(&self, why: &str) {
        self.conn.close(why.to_string());
    }

    /// Send one market request; `None` is a `Done` answer (an error answer becomes
    /// [`MarketError::Refused`]).
    async fn request(&self, msg: MarketMsg) -> Result<Option<MarketMsg>, MarketError> {
        let frame = self
            .conn
            .request(&Msg::Market(msg), &[])
            .await
            .map_err(|e| MarketError::Lost {
                addr: self.addr.clone(),
                reason: e.to_string(),
            })?;
        match frame.msg {
            Msg::Market(m) => Ok(Some(m)),
            Msg::Done => Ok(None),
            Msg::Error(RemoteError::Protocol(m)) if m.contains("does not handle") => {
                Err(MarketError::Refused(format!(
                    "{} has no broker ({m}); start the controller with --broker, or run `granule broker`",
                    self.addr
                )))
            }
            Msg::Error(e) => Err(MarketError::Refused(e.to_string())),
            other => Err(MarketError::Protocol(format!(
                "unexpected answer {}",
                other.name()
            ))),
        }
    }

    /// Send one market request answered with a market message.
    pub async fn call(&self, msg: MarketMsg) -> Result<MarketMsg, MarketError> {
        let name = msg.name();
        self.request(msg)
            .await?
            .ok_or_else(|| MarketError::Protocol(format!("{name} answered with Done")))
    }

    /// Send a request answered with `Done`.
    pub async fn call_done(&self, msg: MarketMsg) -> Result<(), MarketError> {
        self.request(msg).await.map(|_| ())
    }

    /// The whole market, for status views.
    pub async fn status(&self) -> Result<MarketView, MarketError> {
        match self.call(MarketMsg::Status).await? {
            MarketMsg::View(v) => Ok(v),
            other => Err(MarketError::Protocol(format!(
                "Status answered with {}",
                other.name()
            ))),
        }
    }
}

/// The revocation notices a consumer's connection received.
#[derive(Default)]
struct Notices {
    revoked: Mutex<Vec<Revocation>>,
}

impl Handler for Notices {
    fn on_request(&self, _c: &Arc<Connection>, _f: Frame, r: Responder) {
        r.error(RemoteError::Protocol(
            "a consumer serves no requests".into(),
        ));
    }

    fn on_notify(&self, _c: &Arc<Connection>, frame: Frame) {
        if let Msg::Market(MarketMsg::Revoked {
            lease,
            grace_ms,
            reason,
        }) = frame.msg
        {
            tracing::info!(lease, grace_ms, "lease revoked: {reason}");
            self.revoked.lock().push(Revocation {
                lease,
                grace: Duration::from_millis(grace_ms),
            });
        }
    }
}

/// What a consumer asks the broker for with every request.
#[derive(Clone, Debug)]
pub struct LeaseTerms {
    /// The consumer's name (the broker's views show it; revocation notices go to it).
    pub consumer: String,
    pub lease_time: Duration,
    /// The most it pays per slab-hour.
    pub budget: f64,
    pub mode: EvictionMode,
}

/// Leases from the broker, for [`crate::consumer::KvCache`]. Reconnects when the broker
/// restarts (leases keep working meanwhile: the stores do not depend on the broker).
pub struct BrokerLeases {
    addr: String,
    terms: LeaseTerms,
    client: tokio::sync::Mutex<Option<BrokerClient>>,
    notices: Arc<Notices>,
    /// The proof of holding each lease this client may renew or release (from its
    /// secret; see [`crate::broker::holder_proof`]).
    proofs: Mutex<HashMap<LeaseId, String>>,
}

impl BrokerLeases {
    /// Connects at once, so a wrong address is a clear error at start.
    pub async fn connect(addr: &str, terms: LeaseTerms) -> Result<BrokerLeases, MarketError> {
        let notices = Arc::new(Notices::default());
        let client = BrokerClient::connect(addr, "granule-consumer", notices.clone()).await?;
        Ok(BrokerLeases {
            addr: addr.to_string(),
            terms,
            client: tokio::sync::Mutex::new(Some(client)),
            notices,
            proofs: Mutex::new(HashMap::new()),
        })
    }

    fn proof(&self, lease: LeaseId) -> Result<String, ConsumerError> {
        self.proofs.lock().get(&lease).cloned().ok_or_else(|| {
            ConsumerError::Broker(format!(
                "lease {lease} was not granted to this client: without its secret it cannot be renewed or released"
            ))
        })
    }

    async fn call(&self, msg: MarketMsg) -> Result<MarketMsg, MarketError> {
        let mut guard = self.client.lock().await;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            *guard = Some(
                BrokerClient::connect(&self.addr, "granule-consumer", self.notices.clone()).await?,
            );
        }
        let Some(client) = guard.as_ref() else {
            return Err(MarketError::Protocol("no broker connection".into()));
        };
        client.call(msg).await
    }

    async fn acquire_inner(&self, slabs: u32) -> Result<Vec<LeaseGrant>, MarketError> {
        let reply = self
            .call(MarketMsg::LeaseRequest {
                consumer: self.terms.consumer.clone(),
                slabs,
                min_slabs: 1,
                lease_ms: self.terms.lease_time.as_millis() as u64,
                budget: self.terms.budget,
                weights: None,
                mode: self.terms.mode,
                wait_ms: 0,
            })
            .await?;
        match reply {
            MarketMsg::Leases { grants, .. } => {
                for g in &grants {
                    self.hold(g);
                }
                Ok(grants)
            }
            other => Err(MarketError::Protocol(format!(
                "LeaseRequest answered with {}",
                other.name()
            ))),
        }
    }
}

fn broker_err(e: MarketError) -> ConsumerError {
    ConsumerError::Broker(e.to_string())
}

impl LeaseSource for BrokerLeases {
    fn acquire(&self, slabs: u32) -> BoxFuture<'_, Result<Vec<LeaseGrant>, ConsumerError>> {
        Box::pin(async move { self.acquire_inner(slabs).await.map_err(broker_err) })
    }

    fn renew(&self, lease: LeaseId) -> BoxFuture<'_, Result<u64, ConsumerError>> {
        Box::pin(async move {
            let lease_ms = self.terms.lease_time.as_millis() as u64;
            let proof = self.proof(lease)?;
            match self
                .call(MarketMsg::Renew {
                    lease,
                    lease_ms,
                    proof,
                })
                .await
                .map_err(broker_err)?
            {
                MarketMsg::Renewed {
                    expires_unix_ms, ..
                } => Ok(expires_unix_ms),
                other => Err(ConsumerError::Broker(format!(
                    "Renew answered with {}",
                    other.name()
                ))),
            }
        })
    }

    fn release(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async move {
            let proof = self.proof(lease)?;
            let mut guard = self.client.lock().await;
            if guard.as_ref().is_none_or(|c| c.is_closed()) {
                *guard = Some(
                    BrokerClient::connect(&self.addr, "granule-consumer", self.notices.clone())
                        .await
                        .map_err(broker_err)?,
                );
            }
            match guard.as_ref() {
                Some(c) => c
                    .call_done(MarketMsg::Release { lease, proof })
                    .await
                    .map_err(broker_err)
                    .map(|()| {
                        self.proofs.lock().remove(&lease);
                    }),
                None => Err(ConsumerError::Broker("no broker connection".into())),
            }
        })
    }

    fn hold(&self, grant: &LeaseGrant) {
        self.proofs
            .lock()
            .insert(grant.lease, crate::broker::holder_proof(&grant.secret));
    }

    fn take_revoked(&self) -> Vec<Revocation> {
        std::mem::take(&mut *self.notices.revoked.lock())
    }
}
