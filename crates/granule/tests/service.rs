//! Multi-process tests of the services: real node processes on 127.0.0.1, calls through
//! the Rust API and through every node's HTTP front door while compute proclets split
//! and merge; every request answered exactly once, per-client state exact.

use granule::service::client::HttpClient;
use granule::service::{
    Clients, ScaleConfig, ServiceBuilder, ServiceState, StatefulService, StatelessService,
};
use granule::{Cluster, Kind, NodeId, Proclet};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;
use common::bounded;

fn cluster(n: usize) -> (Cluster, Vec<NodeId>) {
    let specs = vec!["cpu=1,mem=1GiB"; n].join(";");
    let c = Cluster::builder()
        .nodes(&specs)
        .expect("node specs")
        .shed(false)
        .failure_timeout(Duration::from_secs(5))
        .start()
        .expect("cluster starts");
    let workers = c.worker_nodes().expect("nodes");
    assert_eq!(workers.len(), n);
    (c, workers)
}

/// Splits and merges only by hand (the tests drive them while calls go on).
fn manual() -> ScaleConfig {
    ScaleConfig {
        auto: false,
        ..ScaleConfig::default()
    }
}

/// Request ids each node's handlers saw, by test (several tests share the driver
/// process).
static SEEN: Mutex<Vec<(u8, u64)>> = Mutex::new(Vec::new());

/// The echo handler of the stateless test: records the id where it ran.
fn echo(id: u64) -> u64 {
    SEEN.lock().unwrap().push((1, id));
    // A little work, so calls overlap splits and merges.
    let mut x = id;
    for _ in 0..2_000 {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
    id
}

/// Every id the handlers of test `tag` saw, over all nodes (the driver included).
fn seen_everywhere(nodes: &[NodeId], tag: u8) -> Vec<u64> {
    let mut all: Vec<u64> = SEEN
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| *t == tag)
        .map(|(_, id)| *id)
        .collect();
    for &n in nodes {
        let p = Proclet::builder(Kind::Compute)
            .on(n)
            .create((), |()| ())
            .expect("probe proclet");
        let ids = p
            .run_ref(tag, |_: &(), tag: u8| {
                SEEN.lock()
                    .unwrap()
                    .iter()
                    .filter(|(t, _)| *t == tag)
                    .map(|(_, id)| *id)
                    .collect::<Vec<u64>>()
            })
            .expect("read seen ids");
        all.extend(ids);
        p.destroy().expect("destroy probe");
    }
    all.sort_unstable();
    all
}

/// HTTP clients: `conns` keep-alive connections over the given front doors, each sending
/// `per` requests `make(i)` to `path(i)`; returns (i, status, body) for every request.
fn http_load(
    doors: Vec<SocketAddr>,
    conns: usize,
    per: u64,
    base: u64,
    path: fn(u64) -> String,
    body: fn(u64) -> String,
) -> std::thread::JoinHandle<Vec<(u64, u16, Vec<u8>)>> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio");
        rt.block_on(async move {
            let tasks = (0..conns).map(|c| {
                let addr = doors[c % doors.len()];
                async move {
                    let mut cl = HttpClient::connect(addr).await.expect("connect");
                    let mut out = Vec::new();
                    for k in 0..per {
                        let i = base + c as u64 * per + k;
                        let (st, b) = cl
                            .post(&path(i), body(i).as_bytes())
                            .await
                            .expect("http call");
                        out.push((i, st, b));
                    }
                    out
                }
            });
            futures::future::join_all(tasks)
                .await
                .into_iter()
                .flatten()
                .collect()
        })
    })
}

#[test]
fn stateless_calls_exactly_once_across_splits_and_merges() {
    bounded(Duration::from_secs(120), || {
        let (c, nodes) = cluster(2);
        let svc: StatelessService<u64, u64> = ServiceBuilder::new("echo-test")
            .scale(manual())
            .stateless(echo)
            .expect("service starts");
        let doors: Vec<SocketAddr> = svc.http_addrs().into_iter().map(|(_, a)| a).collect();
        assert_eq!(doors.len(), 3, "a front door on the driver and both nodes");
        let svc = Arc::new(svc);

        // Rust API callers: ids 0..4000.
        let ctx = granule::thread_context();
        let api: Vec<_> = (0..4u64)
            .map(|t| {
                let svc = svc.clone();
                let ctx = ctx.clone();
                std::thread::spawn(move || {
                    ctx.enter();
                    let mut bad = Vec::new();
                    for k in 0..1000 {
                        let id = t * 1000 + k;
                        match svc.call(id) {
                            Ok(r) if r == id => {}
                            other => bad.push((id, format!("{other:?}"))),
                        }
                    }
                    bad
                })
            })
            .collect();
        // HTTP callers on every front door: ids 1_000_000.. (6 connections × 500).
        let http = http_load(
            doors.clone(),
            6,
            500,
            1_000_000,
            |_| "/v1/services/echo-test".into(),
            |i| i.to_string(),
        );

        // Splits and merges while the calls go on.
        let mut max = 1;
        let mut round = 0;
        while round < 4 || !api.iter().all(|h| h.is_finished()) || !http.is_finished() {
            if round % 2 == 0 {
                for _ in 0..3 {
                    svc.split_now().expect("split");
                }
            } else {
                while svc.merge_now().expect("merge") {}
            }
            max = max.max(svc.proclets().len());
            round += 1;
            std::thread::sleep(Duration::from_millis(30));
        }
        for h in api {
            let bad = h.join().expect("api thread");
            assert!(
                bad.is_empty(),
                "wrong answers: {:?}",
                &bad[..bad.len().min(5)]
            );
        }
        let answers = http.join().expect("http thread");
        assert_eq!(answers.len(), 3000);
        for (i, st, b) in &answers {
            assert_eq!(*st, 200, "request {i}: {}", String::from_utf8_lossy(b));
            assert_eq!(String::from_utf8_lossy(b), i.to_string());
        }
        let tl = svc.timeline();
        eprintln!(
            "rounds {round}, max proclets {max}, splits {}, merges {}, proclets now {:?}",
            tl.splits(),
            tl.merges(),
            svc.proclets()
        );
        assert!(round >= 2, "the calls ended before a split and a merge");
        assert!(tl.splits() >= 3 && tl.merges() >= 1);
        let workers_nodes: std::collections::BTreeSet<_> =
            svc.proclets().iter().filter_map(|w| w.node).collect();
        eprintln!("workers on nodes {workers_nodes:?}");

        // Exactly once: the handlers saw every id once.
        let seen = seen_everywhere(&nodes, 1);
        let mut want: Vec<u64> = (0..4000).chain(1_000_000..1_003_000).collect();
        want.sort_unstable();
        assert_eq!(seen.len(), want.len(), "handler runs vs requests");
        assert_eq!(seen, want);

        Arc::try_unwrap(svc)
            .expect("last handle")
            .destroy()
            .expect("destroy");
        c.shutdown();
    });
}

/// A client's counter: the handler adds and answers the new total.
fn add(total: &mut u64, n: u64) -> u64 {
    *total += n;
    *total
}

#[test]
fn stateful_counters_exact_across_splits_and_merges() {
    bounded(Duration::from_secs(120), || {
        let (c, _nodes) = cluster(2);
        let svc: StatefulService<Clients<u64, u64>, u64, u64> = ServiceBuilder::new("counters")
            .scale(manual())
            .stateful(add)
            .expect("service starts");
        let doors: Vec<SocketAddr> = svc.http_addrs().into_iter().map(|(_, a)| a).collect();
        let svc = Arc::new(svc);
        const CLIENTS: u64 = 24;

        // API callers: thread t adds 1 to client (t * 7 + k) % CLIENTS, 600 times.
        let ctx = granule::thread_context();
        let api: Vec<_> = (0..3u64)
            .map(|t| {
                let svc = svc.clone();
                let ctx = ctx.clone();
                std::thread::spawn(move || {
                    ctx.enter();
                    let mut got: Vec<(u64, u64)> = Vec::new();
                    for k in 0..600u64 {
                        let client = (t * 7 + k) % CLIENTS;
                        let total = svc.call(client, 1).expect("stateful call");
                        got.push((client, total));
                    }
                    got
                })
            })
            .collect();
        // HTTP callers: request i adds 1 to client i % CLIENTS.
        let http = http_load(
            doors,
            4,
            300,
            0,
            |i| format!("/v1/services/counters/clients/{}", i % CLIENTS),
            |_| "1".into(),
        );
        let mut round = 0;
        while round < 4 || !api.iter().all(|h| h.is_finished()) || !http.is_finished() {
            if round % 2 == 0 {
                for _ in 0..3 {
                    svc.split_now().expect("split");
                }
            } else {
                while svc.merge_now().expect("merge") {}
            }
            round += 1;
            std::thread::sleep(Duration::from_millis(30));
        }
        // Every answer is a running total: per client, the answers are exactly 1..=n.
        let mut per: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for h in api {
            for (client, total) in h.join().expect("api thread") {
                per.entry(client).or_default().push(total);
            }
        }
        for (i, st, b) in http.join().expect("http thread") {
            assert_eq!(st, 200, "request {i}: {}", String::from_utf8_lossy(&b));
            let total: u64 = serde_json::from_slice(&b).expect("a number");
            per.entry(i % CLIENTS).or_default().push(total);
        }
        let mut calls = 0;
        for (client, mut totals) in per {
            totals.sort_unstable();
            let n = totals.len() as u64;
            calls += n;
            assert_eq!(
                totals,
                (1..=n).collect::<Vec<_>>(),
                "client {client}: each call applied exactly once"
            );
            assert_eq!(
                svc.client_state(&client).expect("state"),
                Some(n),
                "client {client}: final counter"
            );
        }
        assert_eq!(calls, 3 * 600 + 4 * 300);
        let tl = svc.timeline();
        eprintln!(
            "rounds {round}, splits {}, merges {}",
            tl.splits(),
            tl.merges()
        );
        assert!(round >= 2 && tl.splits() >= 3 && tl.merges() >= 1);
        assert_pairs(&svc);
        Arc::try_unwrap(svc)
            .expect("last handle")
            .destroy()
            .expect("destroy");
        c.shutdown();
    });
}

/// Every compute proclet has its own memory proclet, on the same node.
fn assert_pairs<S: ServiceState, Req, Resp>(svc: &StatefulService<S, Req, Resp>)
where
    Req: granule::Wire + Clone + Sync,
    Resp: granule::Wire,
{
    let pairs = svc.pairs().expect("pairs");
    assert!(!pairs.is_empty());
    let mut ids = std::collections::BTreeSet::new();
    for (c, m) in &pairs {
        assert_eq!(c.lo, m.lo);
        assert_eq!(c.node, m.node, "pair at {} split across nodes", c.lo);
        assert!(ids.insert(m.id), "memory proclet shared by two pairs");
    }
}

/// A user-defined shard state: each client's history of calls, plus how many clients
/// left or joined the shard through splits and merges (its own split and merge).
#[derive(serde::Serialize, serde::Deserialize, Default)]
struct Ledger {
    history: BTreeMap<String, Vec<u64>>,
    moved_in: u64,
}

impl ServiceState for Ledger {
    type Id = String;
    fn split(&mut self, upper: &dyn Fn(&String) -> bool) -> Self {
        let ids: Vec<String> = self
            .history
            .keys()
            .filter(|id| upper(id))
            .cloned()
            .collect();
        let mut out = Ledger::default();
        for id in ids {
            let h = self.history.remove(&id).expect("listed");
            out.history.insert(id, h);
            out.moved_in += 1;
        }
        out
    }
    fn merge(&mut self, other: Self) {
        self.moved_in += other.history.len() as u64;
        self.history.extend(other.history);
    }
}

// The handler's signature is the service's: `&S::Id` is `&String` here.
#[allow(clippy::ptr_arg)]
fn record(l: &mut Ledger, id: &String, k: u64) -> usize {
    let h = l.history.entry(id.clone()).or_default();
    h.push(k);
    h.len()
}

#[test]
fn stateful_sharded_user_state_splits_and_merges_with_its_pairs() {
    bounded(Duration::from_secs(120), || {
        let (c, _nodes) = cluster(2);
        let svc: StatefulService<Ledger, u64, usize> = ServiceBuilder::new("ledger")
            .scale(manual())
            .http(false)
            .stateful_sharded(record)
            .expect("service starts");
        let svc = Arc::new(svc);
        const CLIENTS: u64 = 16;
        // Thread t owns clients t, t + 4, ...: each client's calls come in order.
        let ctx = granule::thread_context();
        let callers: Vec<_> = (0..4u64)
            .map(|t| {
                let svc = svc.clone();
                let ctx = ctx.clone();
                std::thread::spawn(move || {
                    ctx.enter();
                    for k in 0..400u64 {
                        let client = t + 4 * (k % (CLIENTS / 4));
                        let n = svc.call(format!("c{client}"), k).expect("call");
                        assert_eq!(n as u64, k / (CLIENTS / 4) + 1, "client c{client}");
                    }
                })
            })
            .collect();
        let mut round = 0;
        while round < 6 || !callers.iter().all(|h| h.is_finished()) {
            if round % 2 == 0 {
                for _ in 0..3 {
                    svc.split_now().expect("split");
                }
                assert_pairs(&svc);
            } else {
                while svc.merge_now().expect("merge") {}
            }
            round += 1;
            std::thread::sleep(Duration::from_millis(20));
        }
        for h in callers {
            h.join().expect("caller");
        }
        // Every client's history is exactly its calls, in order, wherever it went.
        let mut moved = 0;
        for client in 0..CLIENTS {
            let id = format!("c{client}");
            let (h, m) = svc
                .read(&id, |l: &Ledger, id: &String| {
                    (l.history.get(id).cloned(), l.moved_in)
                })
                .expect("read");
            let want: Vec<u64> = (0..400u64)
                .filter(|k| client % 4 + 4 * (k % (CLIENTS / 4)) == client)
                .collect();
            assert_eq!(h, Some(want), "client {id}");
            moved += m;
        }
        let tl = svc.timeline();
        eprintln!(
            "rounds {round}, splits {}, merges {}",
            tl.splits(),
            tl.merges()
        );
        assert!(tl.splits() >= 3 && tl.merges() >= 1);
        assert!(moved > 0, "the user's split and merge moved clients");
        assert_pairs(&svc);
        Arc::try_unwrap(svc)
            .expect("last handle")
            .destroy()
            .expect("destroy");
        c.shutdown();
    });
}

fn bad_input_handler(x: (u32, String)) -> String {
    format!("{}:{}", x.0, x.1)
}

fn visits(n: &mut u32, (): ()) -> u32 {
    *n += 1;
    *n
}

#[test]
fn front_door_rejects_bad_input_and_keeps_serving() {
    bounded(Duration::from_secs(90), || {
        let (c, _nodes) = cluster(1);
        let svc: StatelessService<(u32, String), String> =
            StatelessService::start("pair", bad_input_handler).expect("stateless");
        let st: StatefulService<Clients<String, u32>, (), u32> =
            StatefulService::start("visits", visits).expect("stateful");
        let doors = svc.http_addrs();
        assert_eq!(doors.len(), 2);
        for (node, addr) in doors {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio");
            rt.block_on(async {
                let mut cl = HttpClient::connect(addr).await.expect("connect");
                let (s, b) = cl.post("/v1/services/pair", b"[7, \"x\"]").await.unwrap();
                assert_eq!((s, b.as_slice()), (200, &b"\"7:x\""[..]), "node {node}");
                // Malformed JSON.
                let (s, b) = cl.post("/v1/services/pair", b"[7, ").await.unwrap();
                let msg = String::from_utf8_lossy(&b).to_string();
                assert_eq!(s, 400, "{msg}");
                assert!(msg.contains("malformed request body"), "{msg}");
                // Well-formed JSON of the wrong shape.
                let (s, b) = cl.post("/v1/services/pair", b"{\"a\": 1}").await.unwrap();
                assert_eq!(s, 400, "{}", String::from_utf8_lossy(&b));
                // Unknown service.
                let (s, b) = cl.post("/v1/services/nope", b"1").await.unwrap();
                let msg = String::from_utf8_lossy(&b).to_string();
                assert_eq!(s, 404, "{msg}");
                assert!(msg.contains("no service named 'nope'"), "{msg}");
                // A stateful service called without a client, and the other way round.
                let (s, _) = cl.post("/v1/services/visits", b"null").await.unwrap();
                assert_eq!(s, 404);
                let (s, _) = cl
                    .post("/v1/services/pair/clients/1", b"[1,\"a\"]")
                    .await
                    .unwrap();
                assert_eq!(s, 404);
                // Wrong method, unknown path.
                let (s, _) = cl.get("/v1/services/pair").await.unwrap();
                assert_eq!(s, 405);
                let (s, _) = cl.get("/elsewhere").await.unwrap();
                assert_eq!(s, 404);
                // Stateful: bare-string and JSON-string client ids are the same client.
                let (s, b) = cl
                    .post("/v1/services/visits/clients/bob", b"null")
                    .await
                    .unwrap();
                assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
                let first: u32 = serde_json::from_slice(&b).unwrap();
                let (s, b) = cl
                    .post("/v1/services/visits/clients/%22bob%22", b"null")
                    .await
                    .unwrap();
                assert_eq!(s, 200);
                assert_eq!(serde_json::from_slice::<u32>(&b).unwrap(), first + 1);
                let (s, b) = cl
                    .post("/v1/services/visits/clients/bob", b"{{")
                    .await
                    .unwrap();
                assert_eq!(s, 400, "{}", String::from_utf8_lossy(&b));
                // The listing.
                let (s, b) = cl.get("/v1/services").await.unwrap();
                assert_eq!(s, 200);
                let list = String::from_utf8_lossy(&b).to_string();
                assert!(
                    list.contains("\"pair\"") && list.contains("\"visits\""),
                    "{list}"
                );
                // Still serving, on the same connection.
                let (s, b) = cl.post("/v1/services/pair", b"[8, \"y\"]").await.unwrap();
                assert_eq!((s, b.as_slice()), (200, &b"\"8:y\""[..]));
            });
        }
        // A fresh connection after a garbage request line.
        let addr = svc.http_addrs()[0].1;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio");
        rt.block_on(async {
            let mut cl = HttpClient::connect(addr).await.expect("connect");
            let r = cl.raw(b"BLAH\r\n\r\n").await;
            if let Ok((s, _)) = r {
                assert!((400..500).contains(&s), "{s}");
            }
            let mut cl = HttpClient::connect(addr).await.expect("connect");
            let (s, _) = cl.post("/v1/services/pair", b"[9, \"z\"]").await.unwrap();
            assert_eq!(s, 200);
        });
        // Two calls for bob through each of the two front doors.
        assert_eq!(st.client_state(&"bob".to_string()).unwrap(), Some(4));
        svc.destroy().expect("destroy");
        st.destroy().expect("destroy");
        // Gone from the front door.
        rt.block_on(async {
            let mut cl = HttpClient::connect(addr).await.expect("connect");
            let (s, _) = cl.post("/v1/services/pair", b"[9, \"z\"]").await.unwrap();
            assert_eq!(s, 404);
        });
        c.shutdown();
    });
}

/// 1 ms of CPU.
fn burn(x: u64) -> u64 {
    let t = std::time::Instant::now();
    let mut v = x;
    while t.elapsed() < Duration::from_millis(1) {
        v = std::hint::black_box(v.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
    x
}

#[test]
fn scaler_splits_under_load_and_merges_when_idle() {
    bounded(Duration::from_secs(120), || {
        let (c, _nodes) = cluster(2);
        // A low split threshold: the test is about the mechanism, on a machine whose two
        // vCPUs other tests share; the defaults are exercised by the benchmark.
        let svc: StatelessService<u64, u64> = ServiceBuilder::new("burn")
            .scale(ScaleConfig {
                split_above: 0.4,
                merge_below: 0.2,
                merge_after: 20,
                ..ScaleConfig::default()
            })
            .stateless(burn)
            .expect("service starts");
        let svc = Arc::new(svc);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ctx = granule::thread_context();
        let callers: Vec<_> = (0..6u64)
            .map(|t| {
                let (svc, stop, ctx) = (svc.clone(), stop.clone(), ctx.clone());
                std::thread::spawn(move || {
                    ctx.enter();
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        assert_eq!(
                            svc.call(t * 1_000_000 + n).expect("call"),
                            t * 1_000_000 + n
                        );
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while svc.proclets().len() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let under_load = svc.proclets().len();
        stop.store(true, std::sync::atomic::Ordering::Release);
        let calls: u64 = callers.into_iter().map(|h| h.join().expect("caller")).sum();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while svc.proclets().len() > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let tl = svc.timeline();
        eprintln!(
            "{calls} calls; proclets under load {under_load}, idle {}; splits {}, merges {}; peak loads {:?}",
            svc.proclets().len(),
            tl.splits(),
            tl.merges(),
            tl.samples
                .iter()
                .map(|s| s.loads.iter().sum::<f64>())
                .fold(0.0f64, f64::max)
        );
        assert!(under_load >= 2, "no split under load");
        assert_eq!(svc.proclets().len(), 1, "merged back when idle");
        assert!(tl.merges() >= 1);
        Arc::try_unwrap(svc)
            .expect("last handle")
            .destroy()
            .expect("destroy");
        c.shutdown();
    });
}

/// A client's counter that costs ~1 ms of CPU per call.
fn burn_count(n: &mut u64, x: u64) -> u64 {
    burn(x);
    *n += 1;
    *n
}

#[test]
fn stateful_pairs_split_under_load_and_merge_when_idle() {
    bounded(Duration::from_secs(120), || {
        let (c, _nodes) = cluster(2);
        // The default split threshold (one core of load: handler CPU plus the time calls
        // waited for their pair's state); merging sooner than the default, for time.
        let svc: StatefulService<Clients<u64, u64>, u64, u64> = ServiceBuilder::new("burn-count")
            .scale(ScaleConfig {
                merge_after: 20,
                ..ScaleConfig::default()
            })
            .http(false)
            .stateful(burn_count)
            .expect("service starts");
        let svc = Arc::new(svc);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ctx = granule::thread_context();
        let callers: Vec<_> = (0..6u64)
            .map(|t| {
                let (svc, stop, ctx) = (svc.clone(), stop.clone(), ctx.clone());
                std::thread::spawn(move || {
                    ctx.enter();
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        n += 1;
                        assert_eq!(svc.call(t, 0).expect("call"), n, "client {t}");
                    }
                    n
                })
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while svc.proclets().len() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let under_load = svc.proclets().len();
        // Keep calling across the split for a while: every answer is checked.
        std::thread::sleep(Duration::from_millis(300));
        assert_pairs(&svc);
        stop.store(true, std::sync::atomic::Ordering::Release);
        let calls: Vec<u64> = callers
            .into_iter()
            .map(|h| h.join().expect("caller"))
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while svc.proclets().len() > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let tl = svc.timeline();
        eprintln!(
            "{calls:?} calls; pairs under load {under_load}, idle {}; splits {}, merges {}",
            svc.proclets().len(),
            tl.splits(),
            tl.merges(),
        );
        assert!(under_load >= 2, "no split under load");
        assert_eq!(svc.proclets().len(), 1, "merged back when idle");
        for (t, n) in calls.iter().enumerate() {
            assert_eq!(svc.client_state(&(t as u64)).expect("state"), Some(*n));
        }
        assert_pairs(&svc);
        Arc::try_unwrap(svc)
            .expect("last handle")
            .destroy()
            .expect("destroy");
        c.shutdown();
    });
}
