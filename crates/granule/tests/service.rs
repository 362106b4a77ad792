//! Multi-process tests of the services: real node processes on 127.0.0.1, calls through
//! the Rust API and through every node's HTTP front door while compute proclets split
//! and merge; every request answered exactly once, per-client state exact. Services
//! heal when a node holding their proclets is killed or frozen (every call still
//! answered; a stateful pair's lost clients start again empty, and the metrics say so),
//! and a service started with a context, stateless or stateful, takes plain JSON over
//! HTTP. A handler whose read of a sharded structure failed (its shard's node killed)
//! answers 503 with the error's text through every front door, never an empty 200.

use granule::service::client::HttpClient;
use granule::service::{
    routing_key, Clients, ScaleConfig, ServiceBuilder, ServiceState, StatefulService,
    StatelessService,
};
use granule::sharded::{MapKey, MapValue, ShardedMap};
use granule::{Cluster, Kind, NodeId, Proclet};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
fn assert_pairs<S: ServiceState, Req, Resp, C>(svc: &StatefulService<S, Req, Resp, C>)
where
    Req: granule::Wire + Clone + Sync,
    Resp: granule::Wire,
    C: granule::ProcletState + Clone,
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

// ----- healing -------------------------------------------------------------------------

/// The failure timeout of the healing tests' clusters: a frozen node is declared dead
/// after it.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a call may take while a lost proclet is replaced: the failure timeout (a
/// frozen node's calls hang until it is declared dead), then a scaler window and a
/// compute proclet's creation; the rest is slack for a machine shared with other builds.
const HEAL_BOUND: Duration = Duration::from_secs(6);

/// A cluster whose nodes are declared dead after [`FAILURE_TIMEOUT`].
fn fragile_cluster(n: usize) -> (Cluster, Vec<NodeId>) {
    let specs = vec!["cpu=1,mem=1GiB"; n].join(";");
    let c = Cluster::builder()
        .nodes(&specs)
        .expect("node specs")
        .shed(false)
        .failure_timeout(FAILURE_TIMEOUT)
        .start()
        .expect("cluster starts");
    let workers = c.worker_nodes().expect("nodes");
    assert_eq!(workers.len(), n);
    (c, workers)
}

/// The driver's `/metrics` (the scaler, which heals, runs in the driver).
fn driver_metrics(c: &Cluster) -> String {
    let me = c.node_id();
    let addr = c
        .nodes()
        .expect("nodes")
        .into_iter()
        .find(|n| n.id == me)
        .and_then(|n| n.metrics_addr)
        .expect("the driver serves metrics");
    common::http_get(&addr, "/metrics")
}

/// The value of the sample `name{service="svc"}` in a Prometheus text, if present.
fn service_counter(text: &str, name: &str, svc: &str) -> Option<f64> {
    let series = format!("{name}{{service=\"{svc}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
}

/// The stateless healing tests' handler: the context's prefix and the request.
fn tagged(prefix: &String, x: u64) -> String {
    format!("{prefix}{x}")
}

/// How a node is lost.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// SIGKILL: its sockets close, the controller declares it dead at once.
    Kill,
    /// SIGSTOP: it stops answering and is declared dead after the failure timeout.
    Freeze,
}

/// Thaws a frozen node however the test ends (it is then told to leave).
struct Thaw(Option<u32>);

impl Drop for Thaw {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGCONT);
        }
    }
}

/// A stateless service whose only compute proclet is on node 0 loses that node while
/// callers (Rust API threads and an HTTP client on the driver's front door) keep
/// calling: every call is answered, none waits longer than [`HEAL_BOUND`], the service
/// ends up served from a live node, and the driver's metrics count the replacement.
fn stateless_service_heals(loss: Loss, name: &'static str) {
    bounded(Duration::from_secs(90), move || {
        let (c, nodes) = fragile_cluster(2);
        // With the context: the replacement must get it too.
        let svc: StatelessService<u64, String, String> = ServiceBuilder::new(name)
            .scale(manual())
            .stateless_with_context("v-".to_string(), tagged)
            .expect("service starts");
        let victim = nodes[0];
        let first = svc.proclets()[0].id;
        c.move_proclet(first, victim).expect("move to node 0");
        assert_eq!(svc.proclets()[0].node, Some(victim));
        assert_eq!(svc.call(1).expect("call before"), "v-1");
        let driver_door = svc
            .http_addrs()
            .into_iter()
            .find(|(n, _)| *n == c.node_id())
            .expect("a front door on the driver")
            .1;

        let svc = Arc::new(svc);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ctx = granule::thread_context();
        // (calls, failures, slowest call) per caller.
        let api: Vec<_> = (0..3u64)
            .map(|t| {
                let (svc, stop, ctx) = (svc.clone(), stop.clone(), ctx.clone());
                std::thread::spawn(move || {
                    ctx.enter();
                    let (mut n, mut bad, mut slowest) = (0u64, Vec::new(), Duration::ZERO);
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        let x = t * 1_000_000 + n;
                        let t0 = Instant::now();
                        match svc.call(x) {
                            Ok(r) if r == format!("v-{x}") => {}
                            other => bad.push(format!("{x}: {other:?}")),
                        }
                        slowest = slowest.max(t0.elapsed());
                        n += 1;
                    }
                    (n, bad, slowest)
                })
            })
            .collect();
        let http = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("tokio");
                rt.block_on(async move {
                    let mut cl = HttpClient::connect(driver_door).await.expect("connect");
                    let (mut n, mut bad, mut slowest) = (0u64, Vec::new(), Duration::ZERO);
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        let t0 = Instant::now();
                        let path = format!("/v1/services/{name}");
                        match cl.post(&path, n.to_string().as_bytes()).await {
                            Ok((200, b)) if b == format!("\"v-{n}\"").as_bytes() => {}
                            other => bad.push(format!("{n}: {other:?}")),
                        }
                        slowest = slowest.max(t0.elapsed());
                        n += 1;
                    }
                    (n, bad, slowest)
                })
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        let pid = c
            .spawned_nodes()
            .into_iter()
            .find(|(n, _)| *n == victim)
            .expect("node 0's process")
            .1;
        let lost_at = Instant::now();
        let _thaw = match loss {
            Loss::Kill => {
                c.kill_node(victim).expect("kill node 0");
                Thaw(None)
            }
            Loss::Freeze => {
                kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).expect("SIGSTOP");
                Thaw(Some(pid))
            }
        };
        // Wait for the replacement, then keep calling a while on it.
        // (A lost worker's node is unknown: `None`.)
        let healed = |ws: &[granule::service::WorkerInfo]| {
            ws.iter()
                .all(|w| w.node.is_some() && w.node != Some(victim))
        };
        while !healed(&svc.proclets()) && lost_at.elapsed() < HEAL_BOUND {
            std::thread::sleep(Duration::from_millis(10));
        }
        let healed_after = lost_at.elapsed();
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, std::sync::atomic::Ordering::Release);
        let mut results: Vec<(u64, Vec<String>, Duration)> = api
            .into_iter()
            .map(|h| h.join().expect("api caller"))
            .collect();
        results.push(http.join().expect("http caller"));
        let workers = svc.proclets();
        eprintln!(
            "{loss:?}: replaced after {healed_after:?}; workers now {workers:?}; \
             calls/slowest per caller {:?}",
            results.iter().map(|r| (r.0, r.2)).collect::<Vec<_>>()
        );
        assert!(
            healed(&workers),
            "still served from the lost node after {healed_after:?}: {workers:?}"
        );
        for (n, bad, slowest) in &results {
            assert!(
                bad.is_empty(),
                "failed calls: {:?}",
                &bad[..bad.len().min(5)]
            );
            assert!(*n > 0);
            assert!(*slowest < HEAL_BOUND, "a call took {slowest:?}");
        }
        let text = driver_metrics(&c);
        assert_eq!(
            service_counter(&text, "granule_service_proclets_replaced_total", name),
            Some(1.0),
            "one replacement, however many callers saw the node go"
        );
        assert_eq!(
            service_counter(&text, "granule_service_shards_lost_total", name),
            None,
            "a stateless service loses no state"
        );
        Arc::try_unwrap(svc)
            .expect("last handle")
            .destroy()
            .expect("destroy after the loss");
        c.shutdown();
    });
}

#[test]
fn stateless_service_heals_when_its_node_is_killed() {
    stateless_service_heals(Loss::Kill, "heal-kill");
}

#[test]
fn stateless_service_heals_when_its_node_freezes() {
    stateless_service_heals(Loss::Freeze, "heal-freeze");
}

/// The stateful healing test's handler: add `n` times the service's context (a step).
fn add_steps(step: &u64, total: &mut u64, n: u64) -> u64 {
    *total += step * n;
    *total
}

#[test]
fn stateful_service_recreates_a_lost_shard_empty_and_counts_it() {
    bounded(Duration::from_secs(90), || {
        let (c, nodes) = fragile_cluster(2);
        let name = "lost-shard";
        // With a context (a step of 10): the pair that replaces the lost one gets it too.
        let svc: StatefulService<Clients<u64, u64>, u64, u64, u64> = ServiceBuilder::new(name)
            .scale(manual())
            .stateful_with_context(10, add_steps)
            .expect("service starts");
        // Two pairs: the upper one on node 0 (to be lost), the lower one on node 1.
        assert!(svc.split_now().expect("split"));
        let pairs = svc.pairs().expect("pairs");
        assert_eq!(pairs.len(), 2);
        let (victim, keeper) = (nodes[0], nodes[1]);
        for (i, node) in [(0, keeper), (1, victim)] {
            c.move_proclet(pairs[i].0.id, node).expect("move compute");
            c.move_proclet(pairs[i].1.id, node).expect("move memory");
        }
        assert_pairs(&svc);
        let mid = pairs[1].0.lo;
        const CLIENTS: u64 = 32;
        for client in 0..CLIENTS {
            assert_eq!(svc.call(client, 1).expect("call before"), 10);
        }
        let lost: Vec<u64> = (0..CLIENTS).filter(|c| routing_key(c) >= mid).collect();
        assert!(
            !lost.is_empty() && lost.len() < CLIENTS as usize,
            "clients on both pairs"
        );

        c.kill_node(victim).expect("kill node 0");
        let lost_at = Instant::now();
        // Every client's next call is answered: 20 where the state lived on, 10 where it
        // was lost with node 0 and started again empty (and the context came along).
        let mut slowest = Duration::ZERO;
        for client in 0..CLIENTS {
            let t0 = Instant::now();
            let got = svc.call(client, 1).expect("call after the loss");
            slowest = slowest.max(t0.elapsed());
            let want = if lost.contains(&client) { 10 } else { 20 };
            assert_eq!(got, want, "client {client}");
        }
        eprintln!(
            "all answered {:?} after the kill, slowest {slowest:?}; pairs {:?}",
            lost_at.elapsed(),
            svc.pairs()
        );
        assert!(slowest < HEAL_BOUND, "a call took {slowest:?}");
        for client in 0..CLIENTS {
            let want = if lost.contains(&client) { 10 } else { 20 };
            assert_eq!(svc.client_state(&client).expect("state"), Some(want));
        }
        assert_pairs(&svc);
        let pairs = svc.pairs().expect("pairs");
        assert_eq!(pairs.len(), 2, "the same two ranges");
        assert_eq!(pairs[1].0.lo, mid);
        assert!(pairs
            .iter()
            .all(|(w, m)| w.node != Some(victim) && m.node != Some(victim)));
        let text = driver_metrics(&c);
        assert_eq!(
            service_counter(&text, "granule_service_shards_lost_total", name),
            Some(1.0),
            "the lost shard is counted once"
        );
        assert_eq!(
            service_counter(&text, "granule_service_proclets_replaced_total", name),
            Some(1.0)
        );
        svc.destroy().expect("destroy after the loss");
        c.shutdown();
    });
}

// ----- context -------------------------------------------------------------------------

/// The context test's handler: a word's count in the map the service was started with
/// (0 for a word not in it; a shard that cannot be reached is an error).
fn count_of(map: &ShardedMap<String, u64>, word: String) -> Result<u64, String> {
    map.get(&word)
        .map(|n| n.unwrap_or(0))
        .map_err(|e| e.to_string())
}

/// A service started with a `ShardedMap` handle as its context answers plain JSON (a
/// word, no handle) through every node's front door, before and after its compute
/// proclets split (the new ones get the context too), and sees later writes to the map.
#[test]
fn stateless_service_with_context_takes_plain_json_over_http() {
    bounded(Duration::from_secs(90), || {
        let (c, _nodes) = cluster(2);
        let freq: ShardedMap<String, u64> = ShardedMap::new().expect("map");
        freq.insert("fox".into(), 3).expect("insert");
        freq.insert("dog".into(), 7).expect("insert");
        let svc = StatelessService::start_with_context("wordfreq", freq.clone(), count_of)
            .expect("service starts");
        assert_eq!(svc.call("fox".into()).expect("call"), Ok(3));
        let doors = svc.http_addrs();
        assert_eq!(doors.len(), 3, "a front door on the driver and both nodes");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio");
        let ask = |word: &str| -> Vec<(u16, String)> {
            rt.block_on(async {
                let mut out = Vec::new();
                for (_, addr) in &doors {
                    let mut cl = HttpClient::connect(*addr).await.expect("connect");
                    let body = serde_json::to_vec(word).expect("json");
                    let (st, b) = cl
                        .post("/v1/services/wordfreq", &body)
                        .await
                        .expect("http call");
                    out.push((st, String::from_utf8_lossy(&b).into_owned()));
                }
                out
            })
        };
        for (word, n) in [("fox", "3"), ("dog", "7"), ("cat", "0")] {
            for (st, b) in ask(word) {
                assert_eq!((st, b.as_str()), (200, n), "{word}");
            }
        }
        // Split: calls go to compute proclets created after the start, with the context.
        for _ in 0..3 {
            assert!(svc.split_now().expect("split"));
        }
        assert_eq!(svc.proclets().len(), 4);
        freq.insert("cat".into(), 1).expect("insert");
        for _ in 0..8 {
            for (st, b) in ask("cat") {
                assert_eq!((st, b.as_str()), (200, "1"));
            }
        }
        for i in 0..64 {
            assert_eq!(svc.call("dog".into()).expect("call"), Ok(7), "call {i}");
        }
        svc.destroy().expect("destroy");
        c.shutdown();
    });
}

/// The search handler of the guide's tutorial: the documents that hold a word (none for
/// a word not in the index); a shard that cannot be reached is an error, not "none".
fn search(index: &ShardedMap<String, Vec<u64>>, word: String) -> Result<Vec<u64>, String> {
    index
        .get(&word)
        .map(Option::unwrap_or_default)
        .map_err(|e| e.to_string())
}

/// The nodes holding a map's shards, in key order. Generic over the value type without
/// `V: Clone`: reaching the sharder needs none.
fn shard_nodes<K: MapKey, V: MapValue>(m: &ShardedMap<K, V>) -> Vec<NodeId> {
    m.sharder()
        .shards()
        .expect("shards")
        .into_iter()
        .map(|(_, shard)| shard.location().expect("a shard's node"))
        .collect()
}

/// A handler reads a `ShardedMap` whose only shard is on a node that is then killed: its
/// read fails, and it propagates the error, so every front door left answers 503 with
/// the error's text naming the unreachable node — for a word that was there and for one
/// that never was — and Rust callers get the error; never a 200 with an empty answer.
/// The handler's compute proclet is on the node that stays, so the service itself runs.
#[test]
fn a_handler_whose_shard_was_lost_answers_503_naming_the_node() {
    bounded(Duration::from_secs(90), || {
        let (c, nodes) = fragile_cluster(2);
        let (victim, keeper) = (nodes[0], nodes[1]);
        let index: ShardedMap<String, Vec<u64>> = ShardedMap::new().expect("map");
        index.insert("dog".into(), vec![2, 3]).expect("insert");
        index.insert("fox".into(), vec![1]).expect("insert");
        let shards = index.sharder().shards().expect("shards");
        assert_eq!(shards.len(), 1, "one shard");
        let shard = &shards[0].1;
        if shard.location().expect("located") != victim {
            c.move_proclet(shard.id(), victim).expect("move the shard");
        }
        assert_eq!(shard_nodes(&index), vec![victim]);
        let svc: StatelessService<String, Result<Vec<u64>, String>, _> =
            ServiceBuilder::new("search")
                .scale(manual())
                .stateless_with_context(index.clone(), search)
                .expect("service starts");
        let worker = svc.proclets()[0].id;
        c.move_proclet(worker, keeper)
            .expect("move the compute proclet");
        let doors: Vec<SocketAddr> = svc
            .http_addrs()
            .into_iter()
            .filter(|(n, _)| *n != victim)
            .map(|(_, a)| a)
            .collect();
        assert_eq!(doors.len(), 2, "the driver's and the keeper's front doors");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio");
        // Every door's answer to `word`: the status and the body.
        let ask = |word: &str| -> Vec<(u16, String)> {
            rt.block_on(async {
                let mut out = Vec::new();
                for addr in &doors {
                    let mut cl = HttpClient::connect(*addr).await.expect("connect");
                    let body = serde_json::to_vec(word).expect("json");
                    let (st, b) = cl
                        .post("/v1/services/search", &body)
                        .await
                        .expect("http call");
                    out.push((st, String::from_utf8_lossy(&b).into_owned()));
                }
                out
            })
        };
        // Before: an answer is the result alone.
        for (word, want) in [("dog", "[2,3]"), ("cat", "[]")] {
            for (st, b) in ask(word) {
                assert_eq!((st, b.as_str()), (200, want), "{word}");
            }
        }
        assert_eq!(svc.call("dog".into()).expect("call"), Ok(vec![2, 3]));

        c.kill_node(victim).expect("kill the shard's node");
        let unreachable = format!("node {victim} is unreachable");
        for word in ["dog", "cat"] {
            for (st, b) in ask(word) {
                assert_eq!(st, 503, "{word}: {b}");
                let e: serde_json::Value = serde_json::from_str(&b).expect("a JSON error");
                let text = e["error"].as_str().expect("an error's text");
                assert!(text.contains(&unreachable), "{word}: {text}");
                eprintln!("{word}: {st} {b}");
            }
        }
        match svc
            .call("dog".into())
            .expect("the service runs the handler")
        {
            Err(e) => assert!(e.contains(&unreachable), "{e}"),
            Ok(ids) => panic!("an answer from a lost shard: {ids:?}"),
        }
        svc.destroy().expect("destroy");
        c.shutdown();
    });
}

/// A client's cart in the stateful context test: items and count, and what they cost.
#[derive(serde::Serialize, serde::Deserialize, Default, Clone, Debug, PartialEq)]
struct Cart {
    items: BTreeMap<String, u64>,
    total: u64,
}

/// The stateful context test's handler: put one `item` in the client's cart at its price
/// in the price list the service was started with; the cart's new total, or `None` (the
/// cart unchanged) for an item without a price.
fn add_to_cart(prices: &ShardedMap<String, u64>, cart: &mut Cart, item: String) -> Option<u64> {
    let price = prices.get(&item).ok().flatten()?;
    *cart.items.entry(item).or_default() += 1;
    cart.total += price;
    Some(cart.total)
}

/// A stateful service started with a `ShardedMap` handle (a price list) as its context
/// and a cart per client: calls from Rust and plain JSON through every node's front door
/// (`/clients/{id}`, the body just the item) reach the price list, before and after the
/// pairs split (the new pairs' handlers get the context too, and see later prices);
/// every cart is kept whole across the splits and a merge.
#[test]
fn stateful_service_with_context_takes_plain_json_over_http() {
    bounded(Duration::from_secs(120), || {
        let (c, _nodes) = cluster(2);
        let prices: ShardedMap<String, u64> = ShardedMap::new().expect("map");
        prices.insert("apple".into(), 3).expect("insert");
        prices.insert("pear".into(), 5).expect("insert");
        let svc: StatefulService<Clients<String, Cart>, String, Option<u64>, _> =
            ServiceBuilder::new("cart")
                .scale(manual())
                .stateful_with_context(prices.clone(), add_to_cart)
                .expect("service starts");
        let doors = svc.http_addrs();
        assert_eq!(doors.len(), 3, "a front door on the driver and both nodes");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio");
        // Client `id` adds `item` through door `door`: the status and the body.
        let post = |door: usize, id: &str, item: &str| -> (u16, String) {
            rt.block_on(async {
                let mut cl = HttpClient::connect(doors[door % doors.len()].1)
                    .await
                    .expect("connect");
                let body = serde_json::to_vec(item).expect("json");
                let (st, b) = cl
                    .post(&format!("/v1/services/cart/clients/{id}"), &body)
                    .await
                    .expect("http call");
                (st, String::from_utf8_lossy(&b).into_owned())
            })
        };
        const CLIENTS: usize = 32;
        let ids: Vec<String> = (0..CLIENTS).map(|i| format!("c{i}")).collect();
        // One pair: an apple from Rust, a pear over HTTP, a kiwi (no price) either way.
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(svc.call(id.clone(), "apple".into()).expect("call"), Some(3));
            assert_eq!(post(i, id, "pear"), (200, "8".into()), "client {id}");
            assert_eq!(post(i + 1, id, "kiwi"), (200, "null".into()), "client {id}");
        }
        // Split to four pairs: three of them created after the start, from the first.
        for _ in 0..3 {
            assert!(svc.split_now().expect("split"));
        }
        let pairs = svc.pairs().expect("pairs");
        assert_eq!(pairs.len(), 4);
        assert_pairs(&svc);
        // Every pair serves some of the clients (so the calls below reach every pair).
        for (k, (w, _)) in pairs.iter().enumerate() {
            let hi = pairs
                .get(k + 1)
                .map_or(u64::MAX as u128 + 1, |p| p.0.lo as u128);
            assert!(
                ids.iter().any(|id| {
                    let key = routing_key(id);
                    w.lo <= key && (key as u128) < hi
                }),
                "no client in the pair at {}",
                w.lo
            );
        }
        let two = Cart {
            items: BTreeMap::from([("apple".into(), 1), ("pear".into(), 1)]),
            total: 8,
        };
        for id in &ids {
            assert_eq!(
                svc.client_state(id).expect("state"),
                Some(two.clone()),
                "{id}"
            );
        }
        // A price set after the splits reaches every pair's handlers, both ways.
        prices.insert("fig".into(), 11).expect("insert");
        for (i, id) in ids.iter().enumerate() {
            if i % 2 == 0 {
                assert_eq!(svc.call(id.clone(), "fig".into()).expect("call"), Some(19));
            } else {
                assert_eq!(post(i, id, "fig"), (200, "19".into()), "client {id}");
            }
            assert_eq!(post(i, id, "kiwi"), (200, "null".into()), "client {id}");
        }
        // Merge one pair back in; the carts are whole and the handlers still priced.
        assert!(svc.merge_now().expect("merge"));
        assert_eq!(svc.pairs().expect("pairs").len(), 3);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(post(i, id, "apple"), (200, "22".into()), "client {id}");
            let mut cart = two.clone();
            cart.items.insert("fig".into(), 1);
            cart.items.insert("apple".into(), 2);
            cart.total = 22;
            assert_eq!(svc.client_state(id).expect("state"), Some(cart), "{id}");
        }
        let tl = svc.timeline();
        assert!(tl.splits() >= 3 && tl.merges() >= 1);
        svc.destroy().expect("destroy");
        c.shutdown();
    });
}

/// The sharded context test's handler: record the item's price (0 without one) in the
/// client's history; the history's length.
#[allow(clippy::ptr_arg)]
fn record_price(
    prices: &ShardedMap<String, u64>,
    l: &mut Ledger,
    id: &String,
    item: String,
) -> usize {
    let price = prices.get(&item).ok().flatten().unwrap_or(0);
    record(l, id, price)
}

/// `stateful_sharded_with_context`: the user's own shard state with a context; its pairs
/// split off later price with the same list.
#[test]
fn stateful_sharded_service_with_context_keeps_it_across_splits() {
    bounded(Duration::from_secs(90), || {
        let (c, _nodes) = cluster(2);
        let prices: ShardedMap<String, u64> = ShardedMap::new().expect("map");
        prices.insert("apple".into(), 3).expect("insert");
        // The shorthand, with default options (the scaler on its own).
        let carts = StatefulService::start_with_context("cart-auto", prices.clone(), add_to_cart)
            .expect("service starts");
        assert_eq!(carts.call(7u64, "apple".into()).expect("call"), Some(3));
        assert_eq!(carts.call(7u64, "apple".into()).expect("call"), Some(6));
        assert_eq!(carts.call(7u64, "kiwi".into()).expect("call"), None);
        carts.destroy().expect("destroy");
        let svc = ServiceBuilder::new("ledger-ctx")
            .scale(manual())
            .stateful_sharded_with_context(prices.clone(), record_price)
            .expect("service starts");
        let doors = svc.http_addrs();
        let ids: Vec<String> = (0..16).map(|i| format!("c{i}")).collect();
        for id in &ids {
            assert_eq!(svc.call(id.clone(), "apple".into()).expect("call"), 1);
        }
        for _ in 0..3 {
            assert!(svc.split_now().expect("split"));
        }
        assert_pairs(&svc);
        prices.insert("pear".into(), 5).expect("insert");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio");
        for (i, id) in ids.iter().enumerate() {
            let (st, b) = rt.block_on(async {
                let mut cl = HttpClient::connect(doors[i % doors.len()].1)
                    .await
                    .expect("connect");
                cl.post(
                    &format!("/v1/services/ledger-ctx/clients/{id}"),
                    b"\"pear\"",
                )
                .await
                .expect("http call")
            });
            assert_eq!(
                (st, String::from_utf8_lossy(&b).as_ref()),
                (200, "2"),
                "{id}"
            );
            let h = svc
                .read(id, |l: &Ledger, id: &String| l.history.get(id).cloned())
                .expect("read");
            assert_eq!(h, Some(vec![3, 5]), "client {id}");
        }
        svc.destroy().expect("destroy");
        c.shutdown();
    });
}
