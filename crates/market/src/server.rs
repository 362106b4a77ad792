//! The broker on the network: [`BrokerService`] answers producers' and consumers'
//! [`MarketMsg`]s over Granule's transport, carries out what the broker's logic
//! ([`crate::broker::Broker`]) decides (opening, extending and closing stores on
//! producers, revocation notices to consumers) and runs its clock.
//!
//! It runs inside the controller (`granule controller --broker`: the controller hands it
//! the market's messages through [`granule_controller::Extension`]) or on its own
//! (`granule broker`, [`run_standalone`]). Its state lives in memory only: after a
//! restart, producers re-register with the leases their stores still serve, and those
//! leases keep working meanwhile, because consumers talk to stores directly.
//!
//! Lease secrets are made here (random, 256 bits) and travel only on market
//! connections: to the producer that opens the store and to the consumer in its grant.
//! A store's AUTH then travels in clear on the store's own port, as with Redis, until the
//! transport gains authentication.

use crate::broker::{Action, Broker, BrokerConfig, Placement, Request};
use granule_controller::Extension;
use granule_transport::{
    serve, Connection, Handler, Identity, Listener, Responder, TransportConfig,
};
use granule_wire::market::{LeaseGrant, LeaseId, MarketMsg, MarketView, ProducerId};
use granule_wire::{Frame, Msg, RemoteError, Role};
use parking_lot::Mutex;
use rand::RngCore;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How often the broker's clock ticks (expiry, queue, price, predictors).
const TICK: Duration = Duration::from_millis(100);

/// A fresh lease secret: 32 random bytes, hex.
fn new_secret() -> String {
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Send a market answer (`None`: `Done`) or an error.
fn respond(reply: Responder, r: Result<Option<MarketMsg>, RemoteError>) {
    match r {
        Ok(Some(m)) => {
            let _ = reply.send(&Msg::Market(m), &[]);
        }
        Ok(None) => {
            let _ = reply.send(&Msg::Done, &[]);
        }
        Err(e) => reply.error(e),
    }
}

/// A revocation notice kept for a consumer with no connection: (lease, grace ends at
/// (Unix ms), reason).
type KeptNotice = (LeaseId, u64, String);

/// The broker service. Cheap to share.
pub struct BrokerService {
    broker: Mutex<Broker>,
    /// Producers' connections, by producer.
    producers: Mutex<HashMap<ProducerId, Arc<Connection>>>,
    /// Which producer a connection registered as (by connection id).
    producer_of: Mutex<HashMap<u64, ProducerId>>,
    /// Consumers' connections, by consumer name (their latest), for revocation notices.
    consumers: Mutex<HashMap<String, Weak<Connection>>>,
    /// Revocation notices for consumers with no live connection (a consumer that lost
    /// its connection reconnects on its next call): (lease, grace ends at, reason).
    undelivered: Mutex<HashMap<String, Vec<KeptNotice>>>,
    report_interval: Duration,
}

impl BrokerService {
    /// A broker with the market's configuration; call [`BrokerService::run_clock`] (or
    /// use [`BrokerService::start`]) to make it tick.
    pub fn new(market: &granule_config::Market) -> Arc<BrokerService> {
        // Lease ids above the start time keep ids unique over broker restarts.
        let base = now_ms() << 20;
        Arc::new(BrokerService {
            broker: Mutex::new(Broker::new(BrokerConfig::from_market(market), base)),
            producers: Mutex::new(HashMap::new()),
            producer_of: Mutex::new(HashMap::new()),
            consumers: Mutex::new(HashMap::new()),
            undelivered: Mutex::new(HashMap::new()),
            report_interval: market.report_interval,
        })
    }

    /// A broker whose clock runs on the current tokio runtime until the service is dropped.
    pub fn start(market: &granule_config::Market) -> Arc<BrokerService> {
        let svc = Self::new(market);
        tokio::spawn(Self::run_clock(Arc::downgrade(&svc)));
        svc
    }

    /// Tick until the service is gone.
    pub async fn run_clock(svc: Weak<BrokerService>) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(s) = svc.upgrade() else { return };
            let now = now_ms();
            let actions = s.broker.lock().tick(now);
            s.carry_out(actions);
            s.forget_expired_notices(now);
        }
    }

    /// Kept notices whose grace ended can no longer be acted on: drop them, so a consumer
    /// that never comes back leaves nothing behind.
    fn forget_expired_notices(&self, now: u64) {
        self.undelivered.lock().retain(|_, kept| {
            kept.retain(|(_, until, _)| *until > now);
            !kept.is_empty()
        });
    }

    /// Consumers with notices kept for them (for tests and views).
    pub fn consumers_with_kept_notices(&self) -> usize {
        self.undelivered.lock().len()
    }

    /// The market as the status views show it.
    pub fn view(&self) -> MarketView {
        self.broker.lock().view(now_ms())
    }

    fn producer_conn(&self, p: ProducerId) -> Option<Arc<Connection>> {
        self.producers.lock().get(&p).cloned()
    }

    /// Carry out the broker's decisions. Each runs on a task of its own: a slow producer
    /// never holds up the others or the broker's lock.
    fn carry_out(self: &Arc<Self>, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Open(p) => {
                    let svc = self.clone();
                    tokio::spawn(async move {
                        // Queued requests' grants are collected with LeaseCollect.
                        let _ = svc.open(p).await;
                    });
                }
                Action::Close { producer, lease } => {
                    if let Some(c) = self.producer_conn(producer) {
                        tokio::spawn(async move {
                            let m = Msg::Market(MarketMsg::CloseStore { lease });
                            if let Err(e) = c.request(&m, &[]).await {
                                tracing::debug!(lease, "closing a store failed: {e}");
                            }
                        });
                    }
                }
                Action::Extend {
                    producer,
                    lease,
                    expires_unix_ms,
                    price,
                } => {
                    if let Some(c) = self.producer_conn(producer) {
                        tokio::spawn(async move {
                            let m = Msg::Market(MarketMsg::ExtendStore {
                                lease,
                                expires_unix_ms,
                                price,
                            });
                            if let Err(e) = c.request(&m, &[]).await {
                                tracing::debug!(lease, "extending a store failed: {e}");
                            }
                        });
                    }
                }
                Action::Notify {
                    consumer,
                    lease,
                    grace_ms,
                    reason,
                } => {
                    let conn = self.consumers.lock().get(&consumer).and_then(Weak::upgrade);
                    let sent = conn.is_some_and(|c| {
                        c.notify(
                            &Msg::Market(MarketMsg::Revoked {
                                lease,
                                grace_ms,
                                reason: reason.clone(),
                            }),
                            &[],
                        )
                        .is_ok()
                    });
                    if !sent {
                        // Kept until the consumer is heard from again (within the grace).
                        tracing::info!(lease, %consumer, "revocation notice kept until the consumer reconnects");
                        self.undelivered
                            .lock()
                            .entry(consumer.clone())
                            .or_default()
                            .push((lease, now_ms() + grace_ms, reason));
                        // A consumer heard from since the look-up above took the kept
                        // notices before this one was added: hand it over now.
                        let now = self.consumers.lock().get(&consumer).and_then(Weak::upgrade);
                        if let Some(c) = now.filter(|c| !c.is_closed()) {
                            self.deliver_kept(&consumer, &c);
                        }
                    }
                }
            }
        }
    }

    /// `conn` speaks for `consumer` now: revocation notices go to it, starting with any
    /// that found no connection while the grace they give still runs.
    fn consumer_heard(&self, consumer: &str, conn: &Arc<Connection>) {
        self.consumers
            .lock()
            .insert(consumer.to_string(), Arc::downgrade(conn));
        self.deliver_kept(consumer, conn);
    }

    /// Send `consumer`'s kept notices whose grace still runs to `conn`, each once.
    fn deliver_kept(&self, consumer: &str, conn: &Arc<Connection>) {
        let kept = self.undelivered.lock().remove(consumer).unwrap_or_default();
        let now = now_ms();
        for (lease, until, reason) in kept {
            if until <= now {
                continue;
            }
            let _ = conn.notify(
                &Msg::Market(MarketMsg::Revoked {
                    lease,
                    grace_ms: until - now,
                    reason,
                }),
                &[],
            );
        }
    }

    /// Ask a placement's producer to open its store; the grant, or `None` when the
    /// producer could not (its slabs go back to the broker).
    async fn open(self: &Arc<Self>, p: Placement) -> Option<LeaseGrant> {
        let lease = p.lease;
        let Some(conn) = self.producer_conn(p.producer) else {
            self.broker.lock().open_failed(now_ms(), lease);
            return None;
        };
        let secret = new_secret();
        let msg = Msg::Market(MarketMsg::OpenStore {
            lease,
            consumer: p.consumer.clone(),
            secret: secret.clone(),
            bytes: p.bytes,
            mode: p.mode,
            expires_unix_ms: p.expires_unix_ms,
            price: p.price,
            rate_bps: 0,
        });
        let answer = tokio::time::timeout(Duration::from_secs(10), conn.request(&msg, &[])).await;
        match answer {
            Ok(Ok(Frame {
                msg: Msg::Market(MarketMsg::StoreOpened { store_addr }),
                ..
            })) => self
                .broker
                .lock()
                .opened(now_ms(), lease, store_addr, secret),
            other => {
                let why = match other {
                    Ok(Ok(f)) => match f.msg {
                        Msg::Error(e) => e.to_string(),
                        m => format!("answered {}", m.name()),
                    },
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no answer within 10 s".into(),
                };
                tracing::warn!(
                    lease,
                    producer = p.producer,
                    "opening a store failed: {why}"
                );
                self.broker.lock().open_failed(now_ms(), lease);
                None
            }
        }
    }

    /// Answer one market request. Requests that wait on producers run on a task.
    fn on_market(self: &Arc<Self>, conn: &Arc<Connection>, msg: MarketMsg, reply: Responder) {
        let now = now_ms();
        let refuse = |e: crate::broker::BrokerError| RemoteError::Refused(e.to_string());
        match msg {
            MarketMsg::ProducerHello {
                name,
                host,
                slab_bytes,
                state,
                held,
            } => {
                if name.trim().is_empty() {
                    return respond(
                        reply,
                        Err(RemoteError::Refused("a producer needs a name".into())),
                    );
                }
                let leases = held.len();
                let id = self
                    .broker
                    .lock()
                    .producer_hello(now, &name, &host, slab_bytes, state, held);
                // A reconnecting producer's old connection is replaced.
                self.producers.lock().insert(id, conn.clone());
                self.producer_of.lock().insert(conn.id(), id);
                tracing::info!(producer = id, %name, %host, leases, "producer registered");
                respond(
                    reply,
                    Ok(Some(MarketMsg::ProducerOk {
                        producer: id,
                        report_interval_ms: self.report_interval.as_millis() as u64,
                    })),
                )
            }
            MarketMsg::ProducerReport {
                producer,
                state,
                shrunk,
            } => {
                if self.producer_of.lock().get(&conn.id()) != Some(&producer) {
                    return respond(
                        reply,
                        Err(RemoteError::Unauthorized(
                            "report for a producer this connection did not register".into(),
                        )),
                    );
                }
                let r = self
                    .broker
                    .lock()
                    .producer_report(now, producer, state, &shrunk);
                respond(reply, r.map(|_| None).map_err(refuse))
            }
            MarketMsg::Revoking {
                producer,
                lease,
                grace_ms,
            } => {
                if self.producer_of.lock().get(&conn.id()) != Some(&producer) {
                    return respond(
                        reply,
                        Err(RemoteError::Unauthorized(
                            "revocation for a producer this connection did not register".into(),
                        )),
                    );
                }
                let r = self.broker.lock().revoking(now, producer, lease, grace_ms);
                match r {
                    Ok(actions) => {
                        self.carry_out(actions);
                        respond(reply, Ok(None))
                    }
                    Err(e) => respond(reply, Err(refuse(e))),
                }
            }
            MarketMsg::LeaseRequest {
                consumer,
                slabs,
                min_slabs,
                lease_ms,
                budget,
                weights,
                mode,
                wait_ms,
            } => {
                if consumer.trim().is_empty() || slabs == 0 || min_slabs > slabs {
                    return respond(reply, Err(RemoteError::Refused(format!(
                        "a lease request needs a consumer name and 1 <= min_slabs <= slabs (got slabs {slabs}, min_slabs {min_slabs})"
                    ))));
                }
                self.consumer_heard(&consumer, conn);
                let outcome = self.broker.lock().request(
                    now,
                    Request {
                        consumer,
                        slabs,
                        min_slabs,
                        lease_ms,
                        budget,
                        weights,
                        mode,
                        wait_ms,
                    },
                );
                let svc = self.clone();
                tokio::spawn(async move {
                    let opens = outcome.placements.into_iter().map(|p| svc.open(p));
                    let grants: Vec<LeaseGrant> = futures::future::join_all(opens)
                        .await
                        .into_iter()
                        .flatten()
                        .collect();
                    let _ = reply.send(
                        &Msg::Market(MarketMsg::Leases {
                            grants,
                            pending: outcome.pending,
                        }),
                        &[],
                    );
                });
            }
            MarketMsg::LeaseCollect { ticket } => {
                let r = self.broker.lock().collect(ticket);
                respond(
                    reply,
                    r.map(|(grants, pending)| Some(MarketMsg::Leases { grants, pending }))
                        .map_err(refuse),
                )
            }
            MarketMsg::Renew {
                lease,
                lease_ms,
                proof,
            } => {
                // Only the lease's holder renews it, and only the holder's connection
                // takes the consumer's notices (lease ids are not secret).
                let r = {
                    let mut b = self.broker.lock();
                    b.check_holder(lease, &proof)
                        .and_then(|()| b.renew(now, lease, lease_ms))
                };
                match r {
                    Ok((expires_unix_ms, price)) => {
                        // The store keeps the lease's expiry too (for its own views and
                        // clean-up): tell it.
                        let found = self
                            .view()
                            .leases
                            .iter()
                            .find(|l| l.lease == lease)
                            .map(|l| (l.producer, l.consumer.clone()));
                        // A consumer that reconnected (after a dropped connection or a
                        // broker restart) is heard from first by a renewal.
                        if let Some((_, consumer)) = &found {
                            self.consumer_heard(consumer, conn);
                        }
                        if let Some((producer, _)) = found {
                            self.carry_out(vec![Action::Extend {
                                producer,
                                lease,
                                expires_unix_ms,
                                price,
                            }]);
                        }
                        respond(
                            reply,
                            Ok(Some(MarketMsg::Renewed {
                                expires_unix_ms,
                                price,
                            })),
                        )
                    }
                    Err(e) => respond(reply, Err(refuse(e))),
                }
            }
            MarketMsg::Release { lease, proof } => {
                let r = {
                    let mut b = self.broker.lock();
                    b.check_holder(lease, &proof)
                        .and_then(|()| b.release(now, lease))
                };
                match r {
                    Ok(action) => {
                        self.carry_out(vec![action]);
                        respond(reply, Ok(None))
                    }
                    Err(e) => respond(reply, Err(refuse(e))),
                }
            }
            MarketMsg::Status => respond(reply, Ok(Some(MarketMsg::View(self.view())))),
            other => respond(
                reply,
                Err(RemoteError::Protocol(format!(
                    "the broker does not handle {}",
                    other.name()
                ))),
            ),
        }
    }

    fn closed(self: &Arc<Self>, conn: &Arc<Connection>) {
        let gone = self.producer_of.lock().remove(&conn.id());
        if let Some(p) = gone {
            let same = {
                let mut ps = self.producers.lock();
                let same = ps.get(&p).is_some_and(|c| c.id() == conn.id());
                if same {
                    ps.remove(&p);
                }
                same
            };
            // A producer that reconnected already has a new connection: not gone.
            if same {
                tracing::warn!(producer = p, "producer disconnected; its leases are lost");
                let actions = self.broker.lock().producer_gone(now_ms(), p);
                self.carry_out(actions);
            }
        }
        self.consumers
            .lock()
            .retain(|_, c| c.upgrade().is_some_and(|c| c.id() != conn.id()));
    }

    /// Bring the market's Prometheus gauges up to date.
    pub fn record_metrics(&self) {
        let v = self.view();
        metrics::gauge!("granule_market_price").set(v.price);
        metrics::gauge!("granule_market_producers").set(v.producers.len() as f64);
        metrics::gauge!("granule_market_leases").set(v.leases.len() as f64);
        metrics::gauge!("granule_market_leased_slabs")
            .set(v.leases.iter().map(|l| l.slabs as f64).sum::<f64>());
        metrics::gauge!("granule_market_queued_requests").set(v.queued_requests as f64);
        metrics::gauge!("granule_market_queued_slabs").set(v.queued_slabs as f64);
        for p in &v.producers {
            let name = p.name.clone();
            metrics::gauge!("granule_market_producer_free_slabs", "producer" => name.clone())
                .set(p.state.free_slabs as f64);
            metrics::gauge!("granule_market_producer_leased_slabs", "producer" => name.clone())
                .set(p.state.leased_slabs as f64);
            metrics::gauge!("granule_market_producer_harvested_bytes", "producer" => name.clone())
                .set(p.state.harvested_bytes as f64);
            metrics::gauge!("granule_market_producer_limit_bytes", "producer" => name.clone())
                .set(p.state.limit_bytes as f64);
            metrics::gauge!("granule_market_producer_resident_bytes", "producer" => name.clone())
                .set(p.state.resident_bytes as f64);
            metrics::gauge!("granule_market_producer_reputation", "producer" => name)
                .set(p.reputation);
        }
    }
}

/// The broker as a transport handler (standalone `granule broker`).
pub struct BrokerHandler(pub Arc<BrokerService>);

impl Handler for BrokerHandler {
    fn on_request(&self, conn: &Arc<Connection>, frame: Frame, reply: Responder) {
        match frame.msg {
            Msg::Market(m) => self.0.on_market(conn, m, reply),
            other => reply.error(RemoteError::Protocol(format!(
                "the broker does not handle {}",
                other.name()
            ))),
        }
    }

    fn on_close(&self, conn: &Arc<Connection>) {
        self.0.closed(conn);
    }
}

/// The broker inside the controller.
impl Extension for BrokerHandler {
    fn name(&self) -> &'static str {
        "market"
    }

    fn accepts(&self, msg: &Msg) -> bool {
        matches!(msg, Msg::Market(_))
    }

    fn on_request(&self, conn: &Arc<Connection>, frame: Frame, reply: Responder) {
        Handler::on_request(self, conn, frame, reply)
    }

    fn on_close(&self, conn: &Arc<Connection>) {
        self.0.closed(conn);
    }

    fn view(&self) -> serde_json::Value {
        serde_json::to_value(self.0.view()).unwrap_or(serde_json::Value::Null)
    }

    fn refresh_metrics(&self) {
        self.0.record_metrics();
    }
}

/// Run a broker on its own (`granule broker`) on the current tokio runtime until the
/// process ends. Prints the address it listens on.
pub async fn run_standalone(
    listen: &str,
    config: &granule_config::Config,
    http: Option<&str>,
) -> Result<(), crate::client::MarketError> {
    let market = &config.market;
    let listener =
        Listener::bind(listen)
            .await
            .map_err(|e| crate::client::MarketError::Unreachable {
                addr: listen.to_string(),
                reason: e.to_string(),
            })?;
    println!("granule broker listening on {}", listener.local_addr());
    let svc = BrokerService::start(market);
    if let Some(h) = http {
        let l = tokio::net::TcpListener::bind(h).await.map_err(|e| {
            crate::client::MarketError::Unreachable {
                addr: h.to_string(),
                reason: format!("cannot serve HTTP there: {e}"),
            }
        })?;
        if let Ok(a) = l.local_addr() {
            println!("granule broker metrics: http://{a}/metrics (the market as JSON: http://{a}/api/market)");
        }
        tokio::spawn(serve_http(
            l,
            svc.clone(),
            granule_http::Limits::from_config(config),
        ));
    }
    let identity = Arc::new(Identity::tool(Role::Controller, "granule-broker"));
    serve(
        listener,
        identity,
        Arc::new(TransportConfig::default()),
        Arc::new(BrokerHandler(svc)),
    )
    .await;
    Ok(())
}

/// Serve the standalone broker's `/metrics` (Prometheus) and `/api/market` (the
/// [`MarketView`] as JSON) on `listener` within the HTTP bounds of `limits`, until the
/// future is dropped. (Inside the controller the dashboard serves both.)
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    svc: Arc<BrokerService>,
    limits: granule_http::Limits,
) {
    use axum::http::header;
    use axum::response::IntoResponse;
    let metrics_svc = svc.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let svc = metrics_svc.clone();
                async move {
                    granule_telemetry::install();
                    svc.record_metrics();
                    (
                        [(header::CONTENT_TYPE, granule_telemetry::CONTENT_TYPE)],
                        granule_telemetry::render(),
                    )
                        .into_response()
                }
            }),
        )
        .route(
            "/api/market",
            axum::routing::get(move || {
                let svc = svc.clone();
                async move { axum::Json(svc.view()).into_response() }
            }),
        );
    granule_http::serve(listener, app, limits, "the broker's /metrics").await;
}
