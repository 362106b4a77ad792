//! A revocation notice reaches a consumer whose connection to the broker dropped: the
//! broker keeps it while the grace it gives runs, and delivers it when the consumer is
//! heard from again (its next renewal, which reconnects). A notice whose grace ended
//! before that is not delivered.
//!
//! Real components in one process: the broker ([`BrokerService`] served on the transport,
//! port 0), a consumer ([`BrokerLeases`]), and a producer that speaks the market protocol
//! over its own broker connection (registers, opens real [`Store`]s when told, and
//! announces a revocation with `Revoking`, as `granule producer` does when its harvester
//! takes memory back). The consumer's connection is cut by the transport's fault filter
//! on the broker's side: the broker drops the consumer's first `Renew` and closes the
//! connection, as a network blip would.

use granule_market::broker::holder_proof;
use granule_market::client::{BrokerClient, BrokerLeases, LeaseTerms};
use granule_market::consumer::{LeaseId, LeaseSource, Revocation};
use granule_market::server::{BrokerHandler, BrokerService};
use granule_market::store::{Store, StoreConfig};
use granule_transport::{
    serve, Connection, FaultAction, FaultFilter, FaultRule, FaultRules, Handler, Identity,
    Listener, Responder, TransportConfig,
};
use granule_wire::market::{EvictionMode, MarketMsg, ProducerId, ProducerState};
use granule_wire::{Frame, Msg, RemoteError, Role};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The whole scenario must end within this (a hang is a failure, not a stuck run).
const BOUND: Duration = Duration::from_secs(30);

/// A broker on 127.0.0.1, any free port, whose connections go through `faults`.
struct TestBroker {
    addr: String,
    faults: Arc<FaultFilter>,
    svc: Arc<BrokerService>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn start_broker() -> TestBroker {
    let mut market = granule_config::Market {
        slab: 1 << 20,
        ..Default::default()
    };
    // The test's producer does not report: it must not time out during the test.
    market.producer_timeout = Duration::from_secs(600);
    let svc = BrokerService::start(&market);
    let listener = Listener::bind("127.0.0.1:0")
        .await
        .expect("bind the broker");
    let addr = listener.local_addr().to_string();
    let faults = Arc::new(FaultFilter::new());
    let config = Arc::new(TransportConfig::default().with_faults(faults.clone()));
    let server = tokio::spawn(serve(
        listener,
        Arc::new(Identity::tool(Role::Controller, "test-broker")),
        config,
        Arc::new(BrokerHandler(svc.clone())),
    ));
    TestBroker {
        addr,
        faults,
        svc,
        server,
    }
}

/// The producer's side of its broker connection: real stores, opened and closed when
/// the broker says.
#[derive(Default)]
struct Stores(Mutex<HashMap<LeaseId, Store>>);

struct Orders(Arc<Stores>);

impl Handler for Orders {
    fn on_request(&self, _conn: &Arc<Connection>, frame: Frame, reply: Responder) {
        match frame.msg {
            Msg::Market(MarketMsg::OpenStore {
                lease,
                secret,
                bytes,
                mode,
                ..
            }) => match Store::start("127.0.0.1:0", StoreConfig::new(bytes, secret, mode)) {
                Ok(store) => {
                    let store_addr = format!("127.0.0.1:{}", store.addr().port());
                    (self.0).0.lock().insert(lease, store);
                    let _ = reply.send(&Msg::Market(MarketMsg::StoreOpened { store_addr }), &[]);
                }
                Err(e) => reply.error(RemoteError::Internal(e.to_string())),
            },
            Msg::Market(MarketMsg::ExtendStore { .. }) => {
                let _ = reply.send(&Msg::Done, &[]);
            }
            Msg::Market(MarketMsg::CloseStore { lease }) => {
                let gone = (self.0).0.lock().remove(&lease);
                drop(gone);
                let _ = reply.send(&Msg::Done, &[]);
            }
            other => reply.error(RemoteError::Protocol(format!(
                "the test producer does not handle {}",
                other.name()
            ))),
        }
    }
}

struct TestProducer {
    client: BrokerClient,
    id: ProducerId,
    stores: Arc<Stores>,
}

impl TestProducer {
    async fn register(broker: &str) -> TestProducer {
        let stores = Arc::new(Stores::default());
        let client =
            BrokerClient::connect(broker, "test-producer", Arc::new(Orders(stores.clone())))
                .await
                .expect("the producer connects");
        let hello = MarketMsg::ProducerHello {
            name: "donor".into(),
            host: "127.0.0.1".into(),
            slab_bytes: 1 << 20,
            state: ProducerState {
                free_slabs: 8,
                policy_state: "offer only".into(),
                ..Default::default()
            },
            held: Vec::new(),
        };
        let id = match client.call(hello).await.expect("the producer registers") {
            MarketMsg::ProducerOk { producer, .. } => producer,
            other => panic!("ProducerHello answered with {}", other.name()),
        };
        TestProducer { client, id, stores }
    }

    /// Take a lease back early, as a producer whose workload needs its memory does.
    async fn revoke(&self, lease: LeaseId, grace: Duration) {
        self.client
            .call_done(MarketMsg::Revoking {
                producer: self.id,
                lease,
                grace_ms: grace.as_millis() as u64,
            })
            .await
            .expect("the broker accepts the revocation");
    }

    fn stop(self) {
        self.client.close("test over");
        for (_, s) in self.stores.0.lock().drain() {
            s.shutdown();
        }
    }
}

/// A consumer holding two no-eviction leases from the producer.
async fn consumer_with_two_leases(broker: &str, name: &str) -> (BrokerLeases, LeaseId, LeaseId) {
    let leases = BrokerLeases::connect(
        broker,
        LeaseTerms {
            consumer: name.into(),
            lease_time: Duration::from_secs(600),
            budget: f64::MAX,
            mode: EvictionMode::NoEviction,
        },
    )
    .await
    .expect("the consumer connects");
    let mut got = Vec::new();
    for _ in 0..2 {
        let g = leases.acquire(1).await.expect("a lease");
        assert_eq!(g.len(), 1, "one grant per request: {g:?}");
        assert_eq!(g[0].mode, EvictionMode::NoEviction);
        got.push(g[0].lease);
    }
    assert_ne!(got[0], got[1]);
    (leases, got[0], got[1])
}

/// Cut the consumer's connection: the broker drops its next `Renew` and closes the
/// connection. Returns once the consumer has seen the failure (it now has no connection;
/// it reconnects on its next call).
async fn cut_consumer(broker: &TestBroker, consumer: &BrokerLeases, lease: LeaseId) {
    broker
        .faults
        .set_rules(
            FaultRules::seeded(7).rule(
                FaultRule::new(FaultAction::Cut)
                    .incoming()
                    .kind("Renew")
                    .nth(1),
            ),
        )
        .expect("valid fault rules");
    let r = consumer.renew(lease).await;
    assert!(r.is_err(), "the renewal should have been cut: {r:?}");
    broker.faults.clear();
}

/// Poll `take_revoked` until it returns something or `within` passes.
async fn revoked_within(consumer: &BrokerLeases, within: Duration) -> Vec<Revocation> {
    let deadline = Instant::now() + within;
    loop {
        let got = consumer.take_revoked();
        if !got.is_empty() || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn kept_notice_is_delivered_on_reconnect() {
    let broker = start_broker().await;
    let producer = TestProducer::register(&broker.addr).await;
    let (consumer, revoked, kept) = consumer_with_two_leases(&broker.addr, "reader").await;
    assert_eq!(producer.stores.0.lock().len(), 2, "both stores are open");

    cut_consumer(&broker, &consumer, kept).await;
    // The producer needs its memory back while the consumer has no connection.
    producer.revoke(revoked, Duration::from_secs(60)).await;
    assert!(
        !broker.svc.view().leases.iter().any(|l| l.lease == revoked),
        "the broker ended the revoked lease"
    );
    // Nothing can reach the consumer now: the broker keeps the notice.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(consumer.take_revoked().is_empty());
    assert_eq!(broker.svc.consumers_with_kept_notices(), 1);

    // The consumer renews its other lease: that reconnects, and the kept notice follows.
    consumer
        .renew(kept)
        .await
        .expect("renewing the other lease reconnects");
    let got = revoked_within(&consumer, Duration::from_secs(5)).await;
    assert_eq!(
        got.iter().map(|r| r.lease).collect::<Vec<_>>(),
        vec![revoked],
        "the kept revocation notice, once"
    );
    // With what is left of its grace: the broker kept the notice for a while.
    let grace = got[0].grace;
    assert!(
        grace <= Duration::from_secs(60) && grace > Duration::from_secs(50),
        "the grace left: {grace:?}"
    );
    // Delivered once only: later calls bring nothing more.
    consumer.renew(kept).await.expect("renew again");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(consumer.take_revoked().is_empty());
    // The revoked lease is gone at the broker; the other one lives on.
    assert!(consumer.renew(revoked).await.is_err());
    assert!(broker.svc.view().leases.iter().any(|l| l.lease == kept));

    consumer.release(kept).await.expect("release");
    producer.stop();
}

async fn notice_past_its_grace_is_not_delivered() {
    let broker = start_broker().await;
    let producer = TestProducer::register(&broker.addr).await;
    let (consumer, revoked, kept) = consumer_with_two_leases(&broker.addr, "late").await;

    cut_consumer(&broker, &consumer, kept).await;
    let grace = Duration::from_millis(300);
    producer.revoke(revoked, grace).await;
    // The consumer comes back only after the grace ended: the store is gone, and so is
    // the notice.
    tokio::time::sleep(grace + Duration::from_millis(300)).await;
    // Nor is it kept any longer: the broker's clock dropped it, though its consumer has
    // not come back (one that never does leaves nothing behind).
    assert_eq!(broker.svc.consumers_with_kept_notices(), 0);
    consumer
        .renew(kept)
        .await
        .expect("renewing the other lease reconnects");
    let got = revoked_within(&consumer, Duration::from_millis(500)).await;
    assert!(
        got.is_empty(),
        "a notice past its grace was delivered: {got:?}"
    );

    consumer.release(kept).await.expect("release");
    producer.stop();
}

async fn stranger_cannot_renew_release_or_take_notices() {
    let broker = start_broker().await;
    let producer = TestProducer::register(&broker.addr).await;
    let (consumer, lease, other) = consumer_with_two_leases(&broker.addr, "owner").await;
    // Lease ids are not secret: a stranger knows them, but not the leases' secrets.
    let stranger = BrokerClient::connect_tool(&broker.addr, "stranger")
        .await
        .expect("the stranger connects");
    let renew = stranger
        .call(MarketMsg::Renew {
            lease,
            lease_ms: 1000,
            proof: holder_proof("a guess"),
        })
        .await;
    let e = renew.expect_err("a stranger's renewal is refused");
    assert!(e.to_string().contains("does not hold"), "{e}");
    let release = stranger
        .call(MarketMsg::Release {
            lease,
            proof: holder_proof("a guess"),
        })
        .await;
    assert!(
        release.is_err(),
        "a stranger's release is refused: {release:?}"
    );
    assert!(
        broker.svc.view().leases.iter().any(|l| l.lease == lease),
        "the lease lives on"
    );
    // The notices still reach the holder, not the stranger's connection.
    producer.revoke(lease, Duration::from_secs(60)).await;
    let got = revoked_within(&consumer, Duration::from_secs(5)).await;
    assert_eq!(got.iter().map(|r| r.lease).collect::<Vec<_>>(), vec![lease]);
    // The holder renews and releases with its proof.
    consumer.renew(other).await.expect("the holder renews");
    consumer.release(other).await.expect("the holder releases");
    stranger.close("done");
    producer.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_leases_holder_renews_releases_or_gets_its_notices() {
    tokio::time::timeout(BOUND, stranger_cannot_renew_release_or_take_notices())
        .await
        .expect("the scenario ends in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_notice_reaches_a_consumer_that_reconnects() {
    tokio::time::timeout(BOUND, kept_notice_is_delivered_on_reconnect())
        .await
        .expect("the scenario ends in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_notice_past_its_grace_is_dropped() {
    tokio::time::timeout(BOUND, notice_past_its_grace_is_not_delivered())
        .await
        .expect("the scenario ends in time");
}
