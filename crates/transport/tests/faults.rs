//! The fault filter over real loopback sockets: each action, partitions and healing,
//! determinism of the seeded decisions, cutting a connection mid-frame, and the inert
//! default. Every test is bounded in time.

use granule_transport::{
    serve, Connection, Endpoint, FaultAction, FaultFilter, FaultRule, FaultRules, Handler,
    Identity, Listener, Partition, Responder, TraceAction, TransportConfig, TransportError,
};
use granule_wire::{Frame, Msg, NodeId, Role};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Fails the test instead of hanging it.
async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("test did not finish within 30 s")
}

/// Polls `cond` until it holds (or panics after 5 s).
async fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "timed out: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Records notifications (a u32 in the tail) and closes; echoes requests, except
/// `ListNodes` (parked: never answered while the connection lives) and `Value` (answered,
/// and the handler sends a `ListNodes` request back to the caller, kept in `back`).
#[derive(Default)]
struct Probe {
    notes: Mutex<Vec<u32>>,
    parked: Mutex<Vec<Responder>>,
    closes: Mutex<Vec<String>>,
    back: Mutex<Vec<tokio::task::JoinHandle<Result<Frame, TransportError>>>>,
}

impl Handler for Probe {
    fn on_request(&self, c: &Arc<Connection>, frame: Frame, reply: Responder) {
        match frame.msg {
            Msg::ListNodes => self.parked.lock().unwrap().push(reply),
            Msg::Value => {
                let c = c.clone();
                self.back.lock().unwrap().push(tokio::spawn(async move {
                    c.request(&Msg::ListNodes, &[]).await
                }));
                let _ = reply.send(&Msg::Done, &[]);
            }
            _ => {
                let _ = reply.send(&Msg::Value, &frame.tail);
            }
        }
    }

    fn on_notify(&self, _c: &Arc<Connection>, frame: Frame) {
        let n = u32::from_le_bytes(frame.tail[..4].try_into().unwrap());
        self.notes.lock().unwrap().push(n);
    }

    fn on_close(&self, c: &Arc<Connection>) {
        self.closes
            .lock()
            .unwrap()
            .push(c.close_reason().unwrap_or_default());
    }
}

impl Probe {
    fn notes(&self) -> Vec<u32> {
        self.notes.lock().unwrap().clone()
    }
}

fn node(n: Option<u32>) -> Arc<Identity> {
    Arc::new(Identity {
        role: Role::Node,
        node: n.map(NodeId),
        binary: Some([1; 32]),
        program: "faults-test".into(),
    })
}

fn config(f: &Arc<FaultFilter>) -> Arc<TransportConfig> {
    Arc::new(TransportConfig::default().with_faults(f.clone()))
}

/// A server for node `n` with its own filter and probe.
async fn server(n: u32) -> (String, Arc<FaultFilter>, Arc<Probe>) {
    let l = Listener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().to_string();
    let filter = Arc::new(FaultFilter::new());
    let probe = Arc::new(Probe::default());
    tokio::spawn(serve(l, node(Some(n)), config(&filter), probe.clone()));
    (addr, filter, probe)
}

async fn connect(
    addr: &str,
    n: Option<u32>,
    filter: &Arc<FaultFilter>,
    probe: &Arc<Probe>,
) -> Result<Arc<Connection>, TransportError> {
    Connection::connect(addr, node(n), config(filter), probe.clone()).await
}

fn note(c: &Arc<Connection>, i: u32) {
    c.notify(&Msg::Value, &i.to_le_bytes()).unwrap();
}

/// A request that completes only after every frame sent before it was handled.
async fn sync(c: &Arc<Connection>) {
    let f = c.request(&Msg::Done, b"sync").await.unwrap();
    assert_eq!(&f.tail[..], b"sync");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_rules_no_trace() {
    bounded(async {
        let (addr, sfilter, sprobe) = server(2).await;
        let filter = Arc::new(FaultFilter::new());
        let c = connect(&addr, Some(1), &filter, &Arc::default())
            .await
            .unwrap();
        for i in 0..100 {
            note(&c, i);
        }
        sync(&c).await;
        assert_eq!(sprobe.notes(), (0..100).collect::<Vec<_>>());
        assert!(!filter.is_active() && !sfilter.is_active());
        assert!(filter.trace().is_empty());
        assert!(sfilter.trace().is_empty());
        // Rules that never fire leave no trace either.
        filter
            .set_rules(FaultRules::seeded(1).rule(FaultRule::new(FaultAction::Drop).kind("Nope")))
            .unwrap();
        note(&c, 100);
        sync(&c).await;
        assert!(filter.trace().is_empty());
        assert_eq!(sprobe.notes().len(), 101);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_discards_selected_frames_both_ways() {
    bounded(async {
        let (addr, sfilter, sprobe) = server(2).await;
        let filter = Arc::new(FaultFilter::new());
        let c = connect(&addr, Some(1), &filter, &Arc::default())
            .await
            .unwrap();
        // The client drops its first two notifications to n2; the server drops the third
        // one it receives.
        filter
            .set_rules(
                FaultRules::seeded(1).rule(
                    FaultRule::new(FaultAction::Drop)
                        .outgoing()
                        .node(NodeId(2))
                        .kind("Value")
                        .first(2),
                ),
            )
            .unwrap();
        sfilter
            .set_rules(
                FaultRules::seeded(1).rule(
                    FaultRule::new(FaultAction::Drop)
                        .incoming()
                        .peer(Endpoint::Node(NodeId(1)))
                        .kind("Value")
                        .nth(3),
                ),
            )
            .unwrap();
        for i in 0..10 {
            note(&c, i);
        }
        sync(&c).await;
        assert_eq!(sprobe.notes(), vec![2, 3, 5, 6, 7, 8, 9]);
        let t = filter.trace();
        assert_eq!(t.len(), 2, "{}", filter.report());
        assert!(t.iter().all(|e| e.decision.action == TraceAction::Drop));
        assert_eq!(t[1].decision.frame, 2);
        let t = sfilter.trace();
        assert_eq!(t.len(), 1, "{}", sfilter.report());
        assert_eq!(t[0].decision.frame, 3);
        assert_eq!(t[0].decision.peer, Some(Endpoint::Node(NodeId(1))));
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_holds_one_frame_without_stalling_others() {
    bounded(async {
        let (addr2, _, _) = server(2).await;
        let (addr3, _, _) = server(3).await;
        let filter = Arc::new(FaultFilter::new());
        let probe = Arc::new(Probe::default());
        let c2 = connect(&addr2, Some(1), &filter, &probe).await.unwrap();
        let c3 = connect(&addr3, Some(1), &filter, &probe).await.unwrap();
        let delay = Duration::from_millis(1000);
        filter
            .set_rules(
                FaultRules::seeded(1).rule(
                    FaultRule::new(FaultAction::Delay(delay))
                        .outgoing()
                        .node(NodeId(2))
                        .kind("Done"),
                ),
            )
            .unwrap();
        let start = Instant::now();
        let slow = {
            let c2 = c2.clone();
            tokio::spawn(async move {
                c2.request(&Msg::Done, b"slow").await.unwrap();
                start.elapsed()
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Another connection, and other kinds on the same connection, go on.
        c3.request(&Msg::Done, b"other").await.unwrap();
        let f = c2.request(&Msg::Ping, &[]).await.unwrap();
        assert_eq!(f.msg, Msg::Pong);
        let fast = start.elapsed();
        assert!(fast < delay / 2, "other traffic took {fast:?}");
        assert!(!slow.is_finished());
        let slow = slow.await.unwrap();
        assert!(slow >= delay, "the delayed request took only {slow:?}");
        let t = filter.trace();
        assert_eq!(t.len(), 1, "{}", filter.report());
        assert_eq!(t[0].decision.action, TraceAction::Delay(delay));
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reorder_sends_a_frame_after_the_next_ones() {
    bounded(async {
        let (addr, sfilter, sprobe) = server(2).await;
        let filter = Arc::new(FaultFilter::new());
        let c = connect(&addr, Some(1), &filter, &Arc::default())
            .await
            .unwrap();
        // Outgoing: the first notification leaves after the next two frames.
        filter
            .set_rules(
                FaultRules::seeded(1).rule(
                    FaultRule::new(FaultAction::Reorder { after: 2 })
                        .outgoing()
                        .kind("Value")
                        .nth(1),
                ),
            )
            .unwrap();
        for i in 0..5 {
            note(&c, i);
        }
        wait_until("5 notifications", || sprobe.notes().len() == 5).await;
        assert_eq!(sprobe.notes(), vec![1, 2, 0, 3, 4]);
        filter.clear();

        // Incoming: the server handles the first one it receives after the next one.
        sfilter
            .set_rules(
                FaultRules::seeded(1).rule(
                    FaultRule::new(FaultAction::Reorder { after: 1 })
                        .incoming()
                        .kind("Value")
                        .nth(1),
                ),
            )
            .unwrap();
        for i in 10..14 {
            note(&c, i);
        }
        wait_until("9 notifications", || sprobe.notes().len() == 9).await;
        assert_eq!(sprobe.notes()[5..], [11, 10, 12, 13]);
        sfilter.clear();

        // A held frame on a connection that goes quiet still leaves, after the maximum hold.
        filter
            .set_rules(
                FaultRules::seeded(1)
                    .rule(FaultRule::new(FaultAction::Reorder { after: 5 }).kind("Value")),
            )
            .unwrap();
        let start = Instant::now();
        note(&c, 20);
        wait_until("the held notification", || sprobe.notes().len() == 10).await;
        assert!(start.elapsed() >= Duration::from_millis(900));
        assert_eq!(sprobe.notes()[9], 20);
        assert!(filter
            .trace()
            .iter()
            .all(|e| matches!(e.decision.action, TraceAction::Reorder { .. })));
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_frame_fails_both_sides_then_reconnecting_works() {
    bounded(async {
        let (addr, _sfilter, sprobe) = server(2).await;
        let filter = Arc::new(FaultFilter::new());
        let probe = Arc::new(Probe::default());
        let c = connect(&addr, Some(1), &filter, &probe).await.unwrap();
        // The server gets a request of its own pending on this connection...
        let f = c.request(&Msg::Value, &[]).await.unwrap();
        assert_eq!(f.msg, Msg::Done);
        wait_until("the server's request", || {
            probe.parked.lock().unwrap().len() == 1
        })
        .await;
        // ...and the client three.
        let pending: Vec<_> = (0..3)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move { c.request(&Msg::ListNodes, &[]).await })
            })
            .collect();
        wait_until("three parked requests", || {
            sprobe.parked.lock().unwrap().len() == 3
        })
        .await;

        filter
            .set_rules(
                FaultRules::seeded(5).rule(
                    FaultRule::new(FaultAction::Cut)
                        .outgoing()
                        .kind("Done")
                        .nth(1),
                ),
            )
            .unwrap();
        let r = c.request(&Msg::Done, &[7u8; 1000]).await;
        match r {
            Err(TransportError::Closed { reason, .. }) => {
                assert!(reason.contains("cut by the fault filter"), "{reason}")
            }
            other => panic!("expected the cut request to fail, got {other:?}"),
        }
        for p in pending {
            let r = p.await.unwrap();
            assert!(matches!(r, Err(TransportError::Closed { .. })), "{r:?}");
        }
        assert!(c.is_closed());
        // The server read a truncated frame and closed; its own request failed.
        wait_until("the server to close", || {
            !sprobe.closes.lock().unwrap().is_empty()
        })
        .await;
        let reason = sprobe.closes.lock().unwrap()[0].clone();
        assert!(
            reason.contains("mid-frame") || reason.contains("reset"),
            "server's close reason: {reason}"
        );
        let back = sprobe.back.lock().unwrap().pop().unwrap();
        let r = back.await.unwrap();
        assert!(matches!(r, Err(TransportError::Closed { .. })), "{r:?}");
        // Parked responders answer into a closed connection without panicking.
        for reply in sprobe.parked.lock().unwrap().drain(..) {
            assert!(reply.send(&Msg::Done, &[]).is_err());
        }

        let t = filter.trace();
        assert_eq!(t.len(), 1, "{}", filter.report());
        match t[0].decision.action {
            TraceAction::Cut { written, len } => assert!(written > 0 && written < len),
            other => panic!("expected a cut, got {other:?}"),
        }

        // A new connection works: the rule's one frame (the stream's first `Done`) is
        // spent, and streams survive reconnection.
        let c = connect(&addr, Some(1), &filter, &probe).await.unwrap();
        sync(&c).await;
        assert_eq!(filter.trace().len(), 1);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incoming_cut_closes_the_connection() {
    bounded(async {
        let (addr, sfilter, _sprobe) = server(2).await;
        let filter = Arc::new(FaultFilter::new());
        let c = connect(&addr, Some(1), &filter, &Arc::default())
            .await
            .unwrap();
        sfilter
            .set_rules(
                FaultRules::seeded(0)
                    .rule(FaultRule::new(FaultAction::Cut).incoming().kind("Done")),
            )
            .unwrap();
        let r = c.request(&Msg::Done, &[]).await;
        assert!(matches!(r, Err(TransportError::Closed { .. })), "{r:?}");
        assert_eq!(sfilter.trace()[0].decision.action, TraceAction::CutIncoming);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_refuses_drops_and_heals() {
    bounded(async {
        let (addr, sfilter, sprobe) = server(2).await;
        // Later connections' identities have no node id (as before registering): the
        // client's filter knows it is n1 from set_local.
        let filter = Arc::new(FaultFilter::new());
        filter.set_local(NodeId(1));
        let probe = Arc::new(Probe::default());
        let old = connect(&addr, Some(1), &filter, &probe).await.unwrap();
        sync(&old).await;

        let split = Partition::nodes([vec![NodeId(1)], vec![NodeId(2), NodeId(3)]]);
        // Only the server knows: its side refuses the hello and drops frames.
        sfilter
            .set_rules(FaultRules::seeded(0).partition(split.clone()))
            .unwrap();
        // The server knows its peer by what its hello says.
        let named = connect(&addr, Some(1), &filter, &probe).await;
        match named {
            Err(TransportError::Refused(m)) => {
                assert!(m.contains("partitioned by the fault filter"), "{m}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        // An open connection stays open, silent: the server drops what it receives.
        note(&old, 1);
        let r = tokio::time::timeout(Duration::from_millis(300), old.request(&Msg::Done, b"lost"))
            .await;
        assert!(r.is_err(), "a request crossed the partition: {r:?}");
        assert!(sprobe.notes().is_empty());
        let actions: Vec<TraceAction> = sfilter.trace().iter().map(|e| e.decision.action).collect();
        assert!(actions.contains(&TraceAction::Refused), "{actions:?}");
        assert!(actions.contains(&TraceAction::Partitioned), "{actions:?}");

        sfilter.heal();
        assert!(!sfilter.is_active());
        sync(&old).await;
        connect(&addr, Some(1), &filter, &probe).await.unwrap();

        // Only the client knows (it is n1 by set_local): it refuses the server's answer.
        filter
            .set_rules(FaultRules::seeded(0).partition(split.clone()))
            .unwrap();
        let r = connect(&addr, None, &filter, &probe).await;
        match r {
            Err(TransportError::Refused(m)) => {
                assert!(m.contains("partitioned by the fault filter"), "{m}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert!(!old.is_closed());

        // close_open: the open connection closes at once and its pending request fails.
        filter.clear();
        let parked = {
            let old = old.clone();
            tokio::spawn(async move { old.request(&Msg::ListNodes, &[]).await })
        };
        wait_until("a parked request", || {
            sprobe.parked.lock().unwrap().len() == 1
        })
        .await;
        filter
            .set_rules(FaultRules::seeded(0).partition(split.closing_open()))
            .unwrap();
        let r = parked.await.unwrap();
        match r {
            Err(TransportError::Closed { reason, .. }) => {
                assert!(
                    reason.contains("partitioned by the fault filter"),
                    "{reason}"
                )
            }
            other => panic!("expected the pending request to fail, got {other:?}"),
        }
        assert!(filter
            .trace()
            .iter()
            .any(|e| e.decision.action == TraceAction::Closed));
        filter.heal();
        let c = connect(&addr, None, &filter, &probe).await.unwrap();
        sync(&c).await;
    })
    .await
}

/// One run: `n` notifications through a client whose filter drops with probability 0.5
/// and cuts nothing; returns the filter's decisions and what the server received.
async fn seeded_run(seed: u64, n: u32) -> (Vec<granule_transport::Decision>, Vec<u32>, String) {
    let (addr, _, sprobe) = server(2).await;
    let filter = Arc::new(FaultFilter::new());
    let c = connect(&addr, Some(1), &filter, &Arc::default())
        .await
        .unwrap();
    filter
        .set_rules(
            FaultRules::seeded(seed)
                .rule(
                    FaultRule::new(FaultAction::Drop)
                        .outgoing()
                        .kind("Value")
                        .probability(0.5),
                )
                .rule(
                    FaultRule::new(FaultAction::Reorder { after: 1 })
                        .outgoing()
                        .kind("Value")
                        .probability(0.2),
                ),
        )
        .unwrap();
    for i in 0..n {
        note(&c, i);
    }
    // Releases any frame still held back, then waits for everything to be handled.
    filter.clear();
    sync(&c).await;
    (filter.decisions(), sprobe.notes(), filter.report())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_seed_same_decisions() {
    bounded(async {
        let (a, got_a, report) = seeded_run(99, 300).await;
        let (b, got_b, _) = seeded_run(99, 300).await;
        assert!(a.len() > 100, "{report}");
        assert_eq!(a, b, "same seed, different decisions:\n{report}");
        assert_eq!(got_a, got_b);
        let (c, _, _) = seeded_run(100, 300).await;
        assert_ne!(a, c, "another seed gave the same decisions");
        // The printed trace names the seed and each decision.
        assert!(report.contains("seed 99"), "{report}");
        assert!(report.contains("n1 -> n2 out Value #"), "{report}");
    })
    .await
}
