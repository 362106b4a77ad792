//! Failures on real clusters: nodes killed or frozen mid-call, garbage at the ports,
//! unverified peers trying to ship code, an unreachable controller, bad specs.

mod common;

use common::{bounded, cluster, process_gone};
use granule::{CallError, Cluster, ClusterError, Kind, NodeState, Proclet};
use granule_transport::{Connection, Handler, Identity, Responder, TransportConfig};
use granule_wire::{CallMode, CodeRef, Frame, Msg, ProcletId, RemoteError, Role};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Serialize, Deserialize, Default, Debug)]
struct Counter {
    n: u64,
}

const LIMIT: Duration = Duration::from_secs(60);

fn sleeper(p: &Proclet<Counter>, ms: u64) -> Result<(), CallError> {
    p.run(ms, |_c: &mut Counter, ms: u64| {
        std::thread::sleep(Duration::from_millis(ms))
    })
}

fn add(c: &Proclet<Counter>, x: u64) -> Result<u64, CallError> {
    c.run(x, |c: &mut Counter, x: u64| {
        c.n += x;
        c.n
    })
}

/// A node that crashes in the middle of a call — its closure ran, its answer never
/// left (the `call.before_reply` failpoint, not a kill timed to land mid-call): the
/// caller gets `NodeUnreachable` at once, later calls to the dead node's proclets fail
/// fast, and the rest of the cluster carries on.
#[test]
fn node_killed_mid_call_returns_unreachable() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Compute)
            .on(nodes[0])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let q = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let survivor = Proclet::builder(Kind::Memory)
            .on(nodes[1])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let victim = nodes[0];
        cluster
            .faults()
            .failpoints(victim, "call.before_reply=crash")
            .unwrap();
        let started = Instant::now();
        let r = sleeper(&p, 50);
        assert!(
            matches!(r, Err(CallError::NodeUnreachable { node, .. }) if node == victim),
            "{r:?}"
        );
        // The crash closes the node's sockets: no waiting for the failure timeout.
        let waited = started.elapsed();
        assert!(
            waited <= Duration::from_secs(2),
            "answered after {waited:?}"
        );
        // Later calls to the dead node's proclets fail the same way, fast.
        let t = Instant::now();
        assert!(matches!(add(&q, 1), Err(CallError::NodeUnreachable { .. })));
        assert!(t.elapsed() < Duration::from_secs(2));
        // The rest of the cluster carries on; new proclets avoid the dead node (they may
        // land on its replacement, a new node).
        assert_eq!(add(&survivor, 2).unwrap(), 2);
        std::thread::sleep(Duration::from_millis(200));
        let fresh = Proclet::create(Kind::Memory, 1u64, |s: u64| Counter { n: s }).unwrap();
        assert_ne!(fresh.location().unwrap(), victim);
        let states: Vec<_> = cluster
            .nodes()
            .unwrap()
            .into_iter()
            .map(|n| (n.id, n.state))
            .collect();
        assert!(states.contains(&(victim, NodeState::Dead)), "{states:?}");
    });
}

/// A node that stops answering without closing its sockets (frozen with SIGSTOP) is
/// declared dead after the failure timeout; its callers get `NodeUnreachable`, and when
/// it thaws it is told to leave.
#[test]
fn frozen_node_is_declared_dead_within_the_failure_timeout() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(1, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Compute)
            .on(nodes[0])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        assert_eq!(add(&p, 1).unwrap(), 1);
        let pid = cluster.spawned_nodes()[0].1;
        let p2 = p.clone();
        // Whether the call reaches the node before it freezes or waits in its socket
        // meanwhile, the caller's answer is the same: no timing window to hit.
        let caller = std::thread::spawn(move || sleeper(&p2, 5_000));
        let frozen_at = Instant::now();
        kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
        let r = caller.join().unwrap();
        let waited = frozen_at.elapsed();
        assert!(matches!(r, Err(CallError::NodeUnreachable { .. })), "{r:?}");
        // Failure timeout 1 s, heartbeats every 100 ms: declared within ~1.1 s.
        assert!(waited < Duration::from_millis(2000), "took {waited:?}");
        kill(Pid::from_raw(pid as i32), Signal::SIGCONT).unwrap();
        let t = Instant::now();
        while !process_gone(pid) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            process_gone(pid),
            "a node declared dead must leave when it wakes up"
        );
    });
}

/// Random bytes thrown at every port of a cluster close those connections only; the
/// nodes and the controller keep serving.
#[test]
fn random_bytes_at_the_ports_do_not_hurt() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        let ps: Vec<_> = nodes
            .iter()
            .map(|n| {
                Proclet::builder(Kind::Memory)
                    .on(*n)
                    .create(0u64, |s: u64| Counter { n: s })
                    .unwrap()
            })
            .collect();
        let mut addrs: Vec<String> = cluster
            .nodes()
            .unwrap()
            .into_iter()
            .map(|n| n.addr)
            .collect();
        addrs.push(cluster.controller_addr().to_string());
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for addr in &addrs {
            for round in 0..40 {
                let Ok(mut s) = std::net::TcpStream::connect(addr) else {
                    continue;
                };
                let len = rng.random_range(0..4096);
                let mut junk: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                match round % 4 {
                    // A plausible header (version 1, request) with a random body.
                    1 if junk.len() > 14 => {
                        let body = (junk.len() - 4) as u32;
                        junk[..4].copy_from_slice(&body.to_le_bytes());
                        junk[4] = 1;
                        junk[5] = 1;
                    }
                    // A huge declared length.
                    2 => junk = u32::MAX.to_le_bytes().to_vec(),
                    // A wrong protocol version.
                    3 if junk.len() > 14 => {
                        junk[..4].copy_from_slice(&10u32.to_le_bytes());
                        junk[4] = 99;
                    }
                    _ => {}
                }
                let _ = s.write_all(&junk);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
        for p in &ps {
            assert_eq!(add(p, 1).unwrap(), 1);
        }
        assert!(cluster
            .nodes()
            .unwrap()
            .iter()
            .all(|n| n.state == NodeState::Alive));
    });
}

struct NoRequests;
impl Handler for NoRequests {
    fn on_request(&self, _c: &Arc<Connection>, _f: Frame, r: Responder) {
        r.error(RemoteError::Protocol("no".into()));
    }
}

/// Code-carrying frames are only accepted from peers that passed the identical-binary
/// handshake: a tool connection (no hash) and a connection claiming another binary are
/// refused, and a frame before any hello closes the connection.
#[test]
fn code_is_refused_from_unverified_peers() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(1, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(5u64, |s: u64| Counter { n: s })
            .unwrap();
        let addr = cluster
            .nodes()
            .unwrap()
            .into_iter()
            .find(|n| n.id == nodes[0])
            .unwrap()
            .addr;
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let cfg = Arc::new(TransportConfig::default());
            // A tool may connect, but not ship code.
            let tool = Arc::new(Identity::tool(Role::Tool, "intruder"));
            let c = Connection::connect(&addr, tool, cfg.clone(), Arc::new(NoRequests))
                .await
                .unwrap();
            let call = Msg::Call {
                proclet: p.id(),
                code: CodeRef {
                    offset: 0,
                    fingerprint: 0,
                },
                mode: CallMode::Exclusive,
                chain: 1,
                call: 0,
            };
            let f = c.request(&call, &[]).await.unwrap();
            assert!(
                matches!(f.msg, Msg::Error(RemoteError::Unauthorized(_))),
                "{:?}",
                f.msg
            );
            let f = c
                .request(
                    &Msg::Destroy {
                        proclet: ProcletId(p.id().0),
                    },
                    &[],
                )
                .await
                .unwrap();
            assert!(
                matches!(f.msg, Msg::Error(RemoteError::Unauthorized(_))),
                "{:?}",
                f.msg
            );
            // A host claiming another binary is refused at the hello.
            let other = Arc::new(Identity {
                role: Role::Node,
                node: None,
                binary: Some([9; 32]),
                program: "other".into(),
            });
            let e = Connection::connect(&addr, other, cfg.clone(), Arc::new(NoRequests))
                .await
                .unwrap_err();
            assert!(e.to_string().contains("binary mismatch"), "{e}");
        });
        // A call frame with no hello first: the node closes the connection.
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let frame = granule_wire::encode_frame(
            granule_wire::FrameKind::Request,
            1,
            &Msg::Call {
                proclet: p.id(),
                code: CodeRef {
                    offset: 0,
                    fingerprint: 0,
                },
                mode: CallMode::Exclusive,
                chain: 1,
                call: 0,
            },
            &[],
        )
        .unwrap();
        s.write_all(&frame).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut buf);
        // The answer (if any) is an error, then EOF; the proclet was not touched.
        assert_eq!(p.run_ref((), |c: &Counter, ()| c.n).unwrap(), 5);
    });
}

#[test]
fn unreachable_controller_and_bad_specs_are_clear_errors() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = free.local_addr().unwrap().to_string();
    drop(free);
    let e = Cluster::builder()
        .controller(addr.clone())
        .start()
        .err()
        .expect("must fail");
    let msg = e.to_string();
    assert!(msg.contains(&addr) && msg.contains("unreachable"), "{msg}");
    let e = Cluster::builder().nodes("cpu=two").expect_err("must fail");
    assert!(
        matches!(e, ClusterError::Config(ref m) if m.contains("cpu must be a number")),
        "{e}"
    );
    let e = Cluster::builder()
        .nodes("cpu=1,mem=1GiB,gpus=2")
        .expect_err("must fail");
    assert!(e.to_string().contains("unknown key 'gpus'"), "{e}");
}
