//! The HTTP doors of a node under thousands of idle connections, with real processes:
//! its peers keep calling it meanwhile, a new proclet and a new peer connection on it
//! still work, the doors refuse what is over their cap (503) or would eat into the
//! node's reserve of file descriptors, and the idle connections are closed after the
//! header and idle timeouts.

mod common;

use common::bounded;
use granule::service::StatelessService;
use granule::{Cluster, Kind, NodeId, Proclet};
use granule_transport::{Connection, Handler, Identity, Responder, TransportConfig};
use granule_wire::{Frame, RemoteError, Role};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Idle connections opened against the node, over its two doors.
const FLOOD: usize = 3000;

/// New peer connections the flooded node must still take, all open at once (cluster
/// traffic that needs descriptors: without the reserve, the node has about one free).
const PEERS: usize = 32;

#[derive(Serialize, Deserialize, Default, Debug)]
struct Counter {
    n: u64,
}

fn echo(x: u64) -> u64 {
    x
}

fn counter_on(node: NodeId) -> Proclet<Counter> {
    Proclet::builder(Kind::Memory)
        .on(node)
        .create(0u64, |n: u64| Counter { n })
        .expect("a proclet on the node")
}

/// One round of the calls the test keeps making: the driver calls the target's proclet,
/// and the peer's proclet calls it too (a call between two node processes).
fn call_round(target: &Proclet<Counter>, peer: &Proclet<Counter>) -> Result<(), String> {
    target
        .run(1u64, |c: &mut Counter, x: u64| {
            c.n += x;
            c.n
        })
        .map_err(|e| format!("driver -> target: {e}"))?;
    peer.run(target.clone(), |_p: &mut Counter, t: Proclet<Counter>| {
        t.run(1u64, |c: &mut Counter, x: u64| {
            c.n += x;
            c.n
        })
        .map_err(|e| e.to_string())
    })
    .map_err(|e| format!("driver -> peer: {e}"))?
    .map_err(|e| format!("peer -> target: {e}"))?;
    Ok(())
}

/// What a flooding connection turned out to be.
#[derive(Debug, PartialEq)]
enum Fate {
    /// Still open, the server waiting for its request.
    Held,
    /// Answered 503 (over the cap or the reserve) and closed.
    Refused,
    /// Closed without a word (a reset may eat the 503).
    Closed,
}

fn fate(s: &mut TcpStream) -> Fate {
    s.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 256];
    let f = match s.read(&mut buf) {
        Ok(0) => Fate::Closed,
        Ok(n) if buf[..n].starts_with(b"HTTP/1.1 503") => Fate::Refused,
        Ok(n) => panic!(
            "unexpected answer to no request: {:?}",
            String::from_utf8_lossy(&buf[..n])
        ),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Fate::Held,
        Err(_) => Fate::Closed,
    };
    s.set_nonblocking(false).expect("blocking");
    f
}

/// Open `n` connections round-robin over `doors` and keep them, on a thread of their own
/// (it needs no cluster). Connections that cannot even connect count as refused.
fn flood(doors: Vec<SocketAddr>, n: usize) -> std::thread::JoinHandle<Vec<(usize, TcpStream)>> {
    std::thread::spawn(move || {
        let mut held = Vec::with_capacity(n);
        for i in 0..n {
            let d = i % doors.len();
            if let Ok(s) = TcpStream::connect_timeout(&doors[d], Duration::from_secs(2)) {
                held.push((d, s));
            }
        }
        held
    })
}

/// Keep calling until `flood` is done; every call must succeed. Returns the rounds made
/// and the slowest round.
fn call_while<T>(
    target: &Proclet<Counter>,
    peer: &Proclet<Counter>,
    flood: &std::thread::JoinHandle<T>,
) -> (u64, Duration) {
    let mut rounds = 0;
    let mut slowest = Duration::ZERO;
    while rounds < 20 || !flood.is_finished() {
        let t = Instant::now();
        if let Err(e) = call_round(target, peer) {
            panic!("a call failed during the flood (round {rounds}): {e}");
        }
        slowest = slowest.max(t.elapsed());
        rounds += 1;
    }
    (rounds, slowest)
}

/// A request on a fresh connection (`connection: close`): the status line and the whole
/// answer.
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (String, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // A refused connection may be closed before the request is written, or reset after
    // its 503: keep what arrived.
    let _ = write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer).to_string();
    (answer.lines().next().unwrap_or("").to_string(), answer)
}

struct NoRequests;
impl Handler for NoRequests {
    fn on_request(&self, _c: &Arc<Connection>, _f: Frame, r: Responder) {
        r.error(RemoteError::Protocol("no".into()));
    }
}

/// `n` brand-new peer connections to the node's cluster port, all open at once (each
/// takes a descriptor on the node): connect and exchange hellos.
fn new_peer_connections(addr: &str, n: usize) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let cfg = Arc::new(TransportConfig::default());
        let mut open = Vec::new();
        for i in 0..n {
            let tool = Arc::new(Identity::tool(Role::Tool, "http-doors-test"));
            let c = Connection::connect(addr, tool, cfg.clone(), Arc::new(NoRequests))
                .await
                .map_err(|e| format!("peer connection {i} of {n}: {e}"))?;
            open.push(c);
        }
        for c in open {
            c.close("done");
        }
        Ok(())
    })
}

/// The target's cluster address, its `/metrics` address and its front door.
fn doors_of(
    c: &Cluster,
    svc: &StatelessService<u64, u64>,
    node: NodeId,
) -> (String, SocketAddr, SocketAddr) {
    let info = c
        .nodes()
        .expect("nodes")
        .into_iter()
        .find(|n| n.id == node)
        .expect("the target node");
    let metrics: SocketAddr = info
        .metrics_addr
        .expect("a metrics address")
        .parse()
        .expect("an address");
    let front = svc
        .http_addrs()
        .into_iter()
        .find(|(n, _)| *n == node)
        .expect("a front door on the target")
        .1;
    (info.addr, metrics, front)
}

fn start_cluster(settings: &[(&str, &str)]) -> (Cluster, NodeId, NodeId) {
    // The flood's sockets are this process's descriptors (and its nodes inherit its
    // hard limit).
    let soft = granule_host::os::raise_nofile_limit().expect("raise this process's limit");
    assert!(
        soft >= (FLOOD + 1024) as u64,
        "these tests need a hard limit on open files of at least {} (ulimit -Hn), not {soft}",
        FLOOD + 1024
    );
    let mut b = Cluster::builder()
        .nodes("cpu=1,mem=512MiB;cpu=1,mem=512MiB")
        .expect("node specs")
        .shed(false)
        .failure_timeout(Duration::from_secs(5));
    for (k, v) in settings {
        b = b.set(k, v).expect("a setting");
    }
    let c = b.start().expect("cluster starts");
    let nodes = c.worker_nodes().expect("nodes");
    (c, nodes[0], nodes[1])
}

/// Over the cap, connections are refused with a 503 at once; the ones held are closed
/// after the header timeout; a keep-alive connection is closed after the idle timeout;
/// the node's peers never notice.
#[test]
fn thousands_of_idle_connections_are_capped_and_timed_out_while_peers_keep_calling() {
    bounded(Duration::from_secs(120), || {
        let (c, target, peer) = start_cluster(&[
            ("http.max_connections", "64"),
            ("http.header_timeout", "3s"),
            ("http.idle_timeout", "3s"),
        ]);
        let svc: StatelessService<u64, u64> =
            StatelessService::start("echo", echo).expect("a service");
        let (cluster_addr, metrics, front) = doors_of(&c, &svc, target);
        let a = counter_on(target);
        let b = counter_on(peer);
        call_round(&a, &b).expect("calls before the flood");

        let started = Instant::now();
        let flooder = flood(vec![metrics, front], FLOOD);
        let (rounds, slowest) = call_while(&a, &b, &flooder);
        let mut conns = flooder.join().expect("the flood");
        let flood_took = started.elapsed();
        eprintln!(
            "{} connections opened in {flood_took:?}; {rounds} call rounds meanwhile, the \
             slowest {slowest:?}",
            conns.len()
        );
        // Give refusals a moment to arrive, then look at every connection.
        std::thread::sleep(Duration::from_millis(300));
        let mut held = [0usize; 2];
        let mut refused = 0;
        let mut closed = 0;
        let mut kept = Vec::new();
        for (d, mut s) in conns.drain(..) {
            match fate(&mut s) {
                Fate::Held => {
                    held[d] += 1;
                    kept.push(s);
                }
                Fate::Refused => refused += 1,
                Fate::Closed => closed += 1,
            }
        }
        eprintln!("held per door {held:?}, refused with 503: {refused}, closed: {closed}");
        assert!(held.iter().all(|h| *h <= 64), "over the cap: {held:?}");
        assert!(held.iter().all(|h| *h > 0), "a door held nothing: {held:?}");
        assert!(
            refused >= FLOOD / 2,
            "too few 503s: {refused} (closed {closed})"
        );
        // While the doors are full (nothing held has timed out yet if the flood was
        // quick): a new request is refused too.
        if started.elapsed() < Duration::from_millis(2500) && held[0] == 64 {
            let (status, all) = request(metrics, "GET", "/metrics", "");
            assert!(status.contains("503") || status.is_empty(), "{all}");
        }
        // Still reachable for the cluster: a new proclet, a new peer connection.
        let fresh = counter_on(target);
        call_round(&fresh, &b).expect("a new proclet on the target");
        new_peer_connections(&cluster_addr, PEERS).expect("new peer connections to the target");

        // Every held connection is closed by the header timeout (3 s after it opened).
        let deadline = started + flood_took + Duration::from_secs(6);
        for s in &mut kept {
            s.set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(10)),
            ))
            .unwrap();
            let mut buf = [0u8; 64];
            match s.read(&mut buf) {
                Ok(0) => {}
                Err(e)
                    if e.kind() != std::io::ErrorKind::WouldBlock
                        && e.kind() != std::io::ErrorKind::TimedOut => {}
                other => panic!("a held connection outlived the header timeout: {other:?}"),
            }
        }
        drop(kept);
        call_round(&a, &b).expect("calls after the flood");

        // The doors serve again.
        let (status, all) = request(metrics, "GET", "/metrics", "");
        assert!(status.contains("200"), "{all}");
        let (status, all) = request(front, "POST", "/v1/services/echo", "7");
        assert!(status.contains("200") && all.ends_with('7'), "{all}");

        // A keep-alive connection is closed once idle for the idle timeout.
        let mut s = TcpStream::connect(metrics).expect("connect");
        write!(s, "GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 16 << 10];
        let answered = Instant::now();
        let idle_closed = loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break answered.elapsed(),
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        };
        assert!(
            got.starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
        assert!(
            idle_closed >= Duration::from_millis(2500) && idle_closed < Duration::from_secs(8),
            "closed after {idle_closed:?} (idle timeout 3 s)"
        );

        svc.destroy().expect("destroy");
        c.shutdown();
    });
}

/// A node whose descriptor limit is small: thousands of connections to its doors (no
/// cap to speak of) stop at its reserve, and the cluster still reaches it.
#[test]
fn the_descriptor_reserve_keeps_a_flooded_node_in_its_cluster() {
    bounded(Duration::from_secs(120), || {
        /// The target's soft limit on open files, and the reserve kept below it.
        const LIMIT: u64 = 1024;
        const RESERVE: u64 = 256;
        let (c, target, peer) = start_cluster(&[
            ("http.max_connections", "100000"),
            ("http.header_timeout", "60s"),
            ("http.idle_timeout", "60s"),
            ("node.fd_reserve", &RESERVE.to_string()),
        ]);
        let svc: StatelessService<u64, u64> =
            StatelessService::start("echo", echo).expect("a service");
        let (cluster_addr, metrics, front) = doors_of(&c, &svc, target);
        let pid = c
            .spawned_nodes()
            .into_iter()
            .find(|(n, _)| *n == target)
            .expect("the target's process")
            .1;
        granule_host::os::set_nofile_soft_limit_of(pid, LIMIT).expect("lower the target's limit");
        let a = counter_on(target);
        let b = counter_on(peer);
        call_round(&a, &b).expect("calls before the flood");
        let before = granule_host::proc::open_fds_of(pid).expect("the target's descriptors");

        let flooder = flood(vec![metrics, front], FLOOD);
        let (rounds, slowest) = call_while(&a, &b, &flooder);
        let mut conns = flooder.join().expect("the flood");
        std::thread::sleep(Duration::from_millis(300));
        let open = granule_host::proc::open_fds_of(pid).expect("the target's descriptors");
        let mut held = 0u64;
        let mut refused = 0;
        for (_, s) in &mut conns {
            match fate(s) {
                Fate::Held => held += 1,
                Fate::Refused => refused += 1,
                Fate::Closed => {}
            }
        }
        eprintln!(
            "target: {before} descriptors before, {open} during the flood (limit {LIMIT}, \
             reserve {RESERVE}); held {held}, refused with 503 {refused}; {rounds} call \
             rounds meanwhile, the slowest {slowest:?}"
        );
        // The doors stopped at the reserve (a few descriptors of slack: the count of
        // non-HTTP descriptors is refreshed once a second)...
        assert!(
            open + RESERVE <= LIMIT + 8,
            "the doors ate into the reserve: {open} open"
        );
        // ...and not at a cap: they took everything else they could.
        assert!(
            held + before + RESERVE + 64 >= LIMIT,
            "held only {held} connections"
        );
        assert!(refused > 0, "nothing refused");
        // Still in its cluster: calls, a new proclet, a new peer connection, its doors'
        // own answers to the flood.
        let fresh = counter_on(target);
        call_round(&fresh, &b).expect("a new proclet on the target");
        new_peer_connections(&cluster_addr, PEERS).expect("new peer connections to the target");
        let (status, all) = request(metrics, "GET", "/metrics", "");
        assert!(status.contains("503") || status.is_empty(), "{all}");
        // Closing the flood frees the doors.
        drop(conns);
        let t = Instant::now();
        loop {
            let (status, all) = request(front, "POST", "/v1/services/echo", "7");
            if status.contains("200") {
                assert!(all.ends_with('7'), "{all}");
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the door never came back: {all}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        svc.destroy().expect("destroy");
        c.shutdown();
    });
}
