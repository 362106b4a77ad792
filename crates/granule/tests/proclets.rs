//! Proclets on real multi-process clusters on 127.0.0.1: calls, chains, nesting,
//! panics, destroy, moves, the synchronization rule, timeouts.

mod common;

use common::{bounded, cluster};
use granule::{here, CallError, Kind, NodeId, Proclet};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(Serialize, Deserialize, Default, Debug, Clone)]
struct Counter {
    n: u64,
}

fn add(c: &Proclet<Counter>, x: u64) -> Result<u64, CallError> {
    c.run(x, |c: &mut Counter, x: u64| {
        c.n += x;
        c.n
    })
}

const LIMIT: Duration = Duration::from_secs(60);

/// Nu's accumulator chain: A calls B calls C, each on its own node, handles passed as
/// arguments; each link reports where it ran.
#[test]
fn chained_calls_across_three_nodes() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(3, "cpu=1,mem=256MiB");
        let make = |n: NodeId, start: u64| {
            Proclet::builder(Kind::Memory)
                .on(n)
                .create(start, |s: u64| Counter { n: s })
                .unwrap()
        };
        let a = make(nodes[0], 1);
        let b = make(nodes[1], 10);
        let c = make(nodes[2], 100);

        type Chain = (Proclet<Counter>, Proclet<Counter>, u64);
        let (total, path) = a
            .run(
                (b.clone(), c.clone(), 5u64),
                |a: &mut Counter, (b, c, x): Chain| {
                    a.n += x;
                    let mine = here().unwrap();
                    let (rest, mut path) = b
                        .run(
                            (c, x),
                            |b: &mut Counter, (c, x): (Proclet<Counter>, u64)| {
                                b.n += x;
                                let mine = here().unwrap();
                                let (cn, cwhere) = c
                                    .run(x, |c: &mut Counter, x: u64| {
                                        c.n += x;
                                        (c.n, here().unwrap())
                                    })
                                    .unwrap();
                                (b.n + cn, vec![mine, cwhere])
                            },
                        )
                        .unwrap();
                    path.insert(0, mine);
                    (a.n + rest, path)
                },
            )
            .unwrap();
        assert_eq!(total, 6 + 15 + 105);
        assert_eq!(path, nodes, "each link ran on its own node");

        // The same chain with asynchronous calls fanned out from inside a closure.
        let sum = a
            .run(
                (b.clone(), c.clone()),
                |_a: &mut Counter, (b, c): (Proclet<Counter>, Proclet<Counter>)| {
                    let fb = b.run_ref_async((), |b: &Counter, ()| b.n);
                    let fc = c.run_ref_async((), |c: &Counter, ()| c.n);
                    let (x, y) = granule::block_on(async { futures::join!(fb, fc) });
                    x.unwrap() + y.unwrap()
                },
            )
            .unwrap();
        assert_eq!(sum, 15 + 105);
        drop(cluster);
    });
}

/// A→B→A with every node at cpu=1: the worker blocked in the outer call hands its core
/// over, so the re-entrant call is served. Same node and across nodes.
#[test]
fn nested_a_b_a_does_not_deadlock_with_one_core() {
    bounded(LIMIT, || {
        let (_cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        for (na, nb) in [(nodes[0], nodes[0]), (nodes[0], nodes[1])] {
            let a = Proclet::builder(Kind::Memory)
                .on(na)
                .create(7u64, |s: u64| Counter { n: s })
                .unwrap();
            let b = Proclet::builder(Kind::Memory)
                .on(nb)
                .create(0u64, |s: u64| Counter { n: s })
                .unwrap();
            // Outer read-only call on A → exclusive call on B → read-only call on A.
            let got = a
                .with_timeout(Duration::from_secs(20))
                .run_ref(
                    (a.clone(), b.clone()),
                    |a_state: &Counter, (a, b): (Proclet<Counter>, Proclet<Counter>)| {
                        let seen = b
                            .run(a, |b: &mut Counter, a: Proclet<Counter>| {
                                b.n += 1;
                                a.run_ref((), |a: &Counter, ()| a.n)
                            })
                            .unwrap()
                            .unwrap();
                        seen + a_state.n
                    },
                )
                .unwrap();
            assert_eq!(got, 14, "A on {na}, B on {nb}");

            // An exclusive re-entry can never be granted: it fails fast, no deadlock.
            let inner = a
                .with_timeout(Duration::from_secs(20))
                .run(
                    (a.clone(), b.clone()),
                    |_s: &mut Counter, (a, b): (Proclet<Counter>, Proclet<Counter>)| {
                        b.run(a, |_b: &mut Counter, a: Proclet<Counter>| {
                            a.run(1u64, |a: &mut Counter, x: u64| {
                                a.n += x;
                                a.n
                            })
                        })
                        .unwrap()
                    },
                )
                .unwrap();
            assert!(
                matches!(inner, Err(CallError::Reentrant(p)) if p == a.id()),
                "{inner:?}"
            );
        }
    });
}

/// Nested calls back into the driver (which is a node too) and out again.
#[test]
fn nested_calls_through_the_driver() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(1, "cpu=1,mem=256MiB");
        let m = Proclet::builder(Kind::Memory)
            .on(cluster.node_id())
            .create(1000u64, |s: u64| Counter { n: s })
            .unwrap();
        let a = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(1u64, |s: u64| Counter { n: s })
            .unwrap();
        let r = a
            .run_ref(
                (a.clone(), m.clone()),
                |a_state: &Counter, (a, m): (Proclet<Counter>, Proclet<Counter>)| {
                    let from_m = m
                        .run(a, |m: &mut Counter, a: Proclet<Counter>| {
                            m.n += 1;
                            (
                                here().unwrap(),
                                m.n + a.run_ref((), |a: &Counter, ()| a.n).unwrap(),
                            )
                        })
                        .unwrap();
                    (from_m.0, from_m.1 + a_state.n)
                },
            )
            .unwrap();
        assert_eq!(r, (cluster.node_id(), 1001 + 1 + 1));
    });
}

/// A panicking closure becomes an error; the proclet keeps the state the closure left;
/// the node keeps serving.
#[test]
fn remote_panic_is_an_error_and_the_node_keeps_serving() {
    bounded(LIMIT, || {
        let (_cluster, nodes) = cluster(1, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(1u64, |s: u64| Counter { n: s })
            .unwrap();
        let q = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(5u64, |s: u64| Counter { n: s })
            .unwrap();
        let r = p.run(99u64, |c: &mut Counter, x: u64| -> u64 {
            c.n = x;
            panic!("deliberate failure at {}", x)
        });
        match r {
            Err(CallError::RemotePanic { proclet, message }) => {
                assert_eq!(proclet, p.id());
                assert!(message.contains("deliberate failure at 99"), "{message}");
            }
            other => panic!("expected a remote panic, got {other:?}"),
        }
        assert_eq!(
            p.run_ref((), |c: &Counter, ()| c.n).unwrap(),
            99,
            "state as the closure left it"
        );
        assert_eq!(add(&q, 1).unwrap(), 6);
        assert_eq!(add(&p, 1).unwrap(), 100);
        // Local panics behave the same.
        let l = Proclet::builder(Kind::Memory)
            .on(granule::here().unwrap())
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        assert!(matches!(
            l.run((), |_c: &mut Counter, ()| -> u64 { panic!("local") }),
            Err(CallError::RemotePanic { .. })
        ));
        assert_eq!(add(&l, 2).unwrap(), 2);
    });
}

#[test]
fn destroy_frees_the_proclet_everywhere() {
    bounded(LIMIT, || {
        let (_cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(1u64, |s: u64| Counter { n: s })
            .unwrap();
        let watcher = Proclet::builder(Kind::Memory)
            .on(nodes[1])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let probe = |w: &Proclet<Counter>, p: &Proclet<Counter>| {
            w.run(p.clone(), |_w: &mut Counter, p: Proclet<Counter>| {
                p.run_ref((), |c: &Counter, ()| c.n)
            })
            .unwrap()
        };
        assert_eq!(probe(&watcher, &p), Ok(1));
        p.destroy().unwrap();
        assert_eq!(add(&p, 1), Err(CallError::ProcletGone(p.id())));
        assert_eq!(
            probe(&watcher, &p),
            Err(CallError::ProcletGone(p.id())),
            "seen from another node"
        );
        assert_eq!(p.destroy(), Err(CallError::ProcletGone(p.id())));
        // Local proclets too.
        let l = Proclet::new(Kind::Memory, Counter { n: 3 }).unwrap();
        let l2 = Proclet::builder(Kind::Memory)
            .on(granule::here().unwrap())
            .create(3u64, |s: u64| Counter { n: s })
            .unwrap();
        l.destroy().unwrap();
        l2.destroy().unwrap();
        assert_eq!(add(&l2, 1), Err(CallError::ProcletGone(l2.id())));
    });
}

/// A proclet moved through the controller API: callers with stale cached locations
/// (the driver and another node) are redirected transparently and the state survives.
#[test]
fn stale_locations_are_refreshed_after_a_move() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(3, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(10u64, |s: u64| Counter { n: s })
            .unwrap();
        let q = Proclet::builder(Kind::Memory)
            .on(nodes[1])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let via_q = |q: &Proclet<Counter>, p: &Proclet<Counter>, x: u64| {
            q.run(
                (p.clone(), x),
                |_q: &mut Counter, (p, x): (Proclet<Counter>, u64)| {
                    p.run(x, |c: &mut Counter, x: u64| {
                        c.n += x;
                        (c.n, here().unwrap())
                    })
                },
            )
            .unwrap()
            .unwrap()
        };
        assert_eq!(add(&p, 1).unwrap(), 11);
        assert_eq!(via_q(&q, &p, 1), (12, nodes[0]));
        cluster.move_proclet(p.id(), nodes[2]).unwrap();
        assert_eq!(
            add(&p, 1).unwrap(),
            13,
            "driver's cached location was stale"
        );
        assert_eq!(p.location().unwrap(), nodes[2]);
        assert_eq!(
            via_q(&q, &p, 1),
            (14, nodes[2]),
            "the other node's cache was stale"
        );
        // Move it onto the driver: calls become local.
        cluster.move_proclet(p.id(), cluster.node_id()).unwrap();
        assert_eq!(add(&p, 1).unwrap(), 15);
        assert_eq!(p.location().unwrap(), cluster.node_id());
        assert_eq!(via_q(&q, &p, 1), (16, cluster.node_id()));
        // And away again.
        cluster.move_proclet(p.id(), nodes[0]).unwrap();
        assert_eq!(via_q(&q, &p, 1), (17, nodes[0]));
        assert_eq!(add(&p, 1).unwrap(), 18);
    });
}

/// Calls that arrive during a move wait and then complete at the new home.
#[test]
fn calls_during_a_move_are_not_lost_or_doubled() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut callers = Vec::new();
        for _ in 0..3 {
            let p = p.clone();
            let stop = stop.clone();
            callers.push(std::thread::spawn(move || {
                let mut done = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    add(&p, 1).unwrap();
                    done += 1;
                }
                done
            }));
        }
        for i in 0..6 {
            std::thread::sleep(Duration::from_millis(30));
            cluster.move_proclet(p.id(), nodes[(i + 1) % 2]).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let calls: u64 = callers.into_iter().map(|h| h.join().unwrap()).sum();
        assert!(calls > 0);
        assert_eq!(p.run_ref((), |c: &Counter, ()| c.n).unwrap(), calls);
    });
}

/// `run` calls are serialized per proclet; `run_ref` calls run concurrently.
#[test]
fn synchronization_rule() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(1, "cpu=2,mem=256MiB");
        let remote = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let local = Proclet::builder(Kind::Memory)
            .on(cluster.node_id())
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        for p in [&remote, &local] {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    let p = p.clone();
                    std::thread::spawn(move || {
                        for _ in 0..300 {
                            // Read-modify-write with a pause in between: lost updates
                            // would show if two ran at once.
                            p.run((), |c: &mut Counter, ()| {
                                let v = c.n;
                                std::hint::black_box(&v);
                                c.n = v + 1;
                            })
                            .unwrap();
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            assert_eq!(p.run_ref((), |c: &Counter, ()| c.n).unwrap(), 1200);
        }
        let sleep_ref = |p: &Proclet<Counter>| {
            p.run_ref(150u64, |_c: &Counter, ms: u64| {
                std::thread::sleep(Duration::from_millis(ms))
            })
            .unwrap()
        };
        let sleep_mut = |p: &Proclet<Counter>| {
            p.run(150u64, |_c: &mut Counter, ms: u64| {
                std::thread::sleep(Duration::from_millis(ms))
            })
            .unwrap()
        };
        for p in [&remote, &local] {
            let t = Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| sleep_ref(p));
                s.spawn(|| sleep_ref(p));
            });
            let shared = t.elapsed();
            let t = Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| sleep_mut(p));
                s.spawn(|| sleep_mut(p));
            });
            let exclusive = t.elapsed();
            assert!(
                shared < Duration::from_millis(280),
                "run_ref calls overlapped on {p:?}: {shared:?}"
            );
            assert!(
                exclusive >= Duration::from_millis(300),
                "run calls serialized: {exclusive:?}"
            );
        }
    });
}

/// Arguments to a local proclet are moved, not encoded.
#[test]
fn local_calls_do_not_encode_arguments() {
    static ENCODED: AtomicUsize = AtomicUsize::new(0);
    #[derive(Deserialize, Debug)]
    struct Tracked(u64);
    impl Serialize for Tracked {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            ENCODED.fetch_add(1, Ordering::SeqCst);
            self.0.serialize(s)
        }
    }
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(1, "cpu=1,mem=256MiB");
        let local = Proclet::builder(Kind::Memory)
            .on(cluster.node_id())
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let remote = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let before = ENCODED.load(Ordering::SeqCst);
        for _ in 0..10 {
            local
                .run(Tracked(2), |c: &mut Counter, t: Tracked| c.n += t.0)
                .unwrap();
        }
        assert_eq!(
            ENCODED.load(Ordering::SeqCst),
            before,
            "local calls encoded their argument"
        );
        remote
            .run(Tracked(2), |c: &mut Counter, t: Tracked| c.n += t.0)
            .unwrap();
        assert_eq!(
            ENCODED.load(Ordering::SeqCst),
            before + 1,
            "a remote call encodes once"
        );
        assert_eq!(local.run_ref((), |c: &Counter, ()| c.n).unwrap(), 20);
    });
}

#[test]
fn timeouts_and_bad_requests_are_typed_errors() {
    bounded(LIMIT, || {
        let (_cluster, nodes) = cluster(1, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Compute)
            .on(nodes[0])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let t = Instant::now();
        let r = p
            .with_timeout(Duration::from_millis(100))
            .run(600u64, |_c: &mut Counter, ms: u64| {
                std::thread::sleep(Duration::from_millis(ms))
            });
        assert_eq!(r, Err(CallError::Timeout(Duration::from_millis(100))));
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        // The async form times out too.
        let r = granule::block_on(
            p.with_timeout(Duration::from_millis(100))
                .run_async(600u64, |_c: &mut Counter, ms: u64| {
                    std::thread::sleep(Duration::from_millis(ms))
                }),
        );
        assert!(matches!(r, Err(CallError::Timeout(_))), "{r:?}");
        // Naming a node that does not exist.
        let r = Proclet::builder(Kind::Memory)
            .on(NodeId(999))
            .create(0u64, |s: u64| Counter { n: s });
        assert!(matches!(r, Err(CallError::Refused(m)) if m.contains("no node n999")));
        // A handle to a proclet that never existed.
        let bogus: Proclet<Counter> =
            serde_json::from_str("{\"id\":123456789,\"hint\":null}").unwrap();
        assert_eq!(add(&bogus, 1), Err(CallError::ProcletGone(bogus.id())));
        // A constructor that panics.
        let r = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(0u64, |_s: u64| -> Counter { panic!("no") });
        assert!(r.is_err());
    });
}

/// Handles are values: a list of them travels to a proclet that calls each.
#[test]
fn handles_travel_in_arguments_and_results() {
    bounded(LIMIT, || {
        let (_cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        // On both nodes by hand: where the placement policy puts them depends on each
        // node's reported memory pressure, which a loaded machine can flag on one node.
        let ps: Vec<Proclet<Counter>> = (0..6)
            .map(|i| {
                Proclet::builder(Kind::Memory)
                    .on(nodes[i % 2])
                    .create(i as u64, |s: u64| Counter { n: s })
                    .unwrap()
            })
            .collect();
        let hub = Proclet::builder(Kind::Compute)
            .on(nodes[1])
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        let sum = hub
            .run(ps.clone(), |_h: &mut Counter, ps: Vec<Proclet<Counter>>| {
                ps.iter()
                    .map(|p| p.run_ref((), |c: &Counter, ()| c.n).unwrap())
                    .sum::<u64>()
            })
            .unwrap();
        assert_eq!(sum, 15);
        // A proclet creates another one and hands it back.
        let made: Proclet<Counter> = hub
            .run(41u64, |_h: &mut Counter, x: u64| {
                Proclet::create(Kind::Memory, x, |s: u64| Counter { n: s }).unwrap()
            })
            .unwrap();
        assert_eq!(add(&made, 1).unwrap(), 42);
        let spread: std::collections::HashSet<NodeId> =
            ps.iter().map(|p| p.location().unwrap()).collect();
        assert_eq!(
            spread.len(),
            2,
            "the proclets stay on both nodes: {spread:?}"
        );
    });
}

/// Several clusters in one process, at once, on free ports, isolated from each other.
#[test]
fn two_clusters_in_one_process() {
    bounded(LIMIT, || {
        let (c1, n1) = cluster(1, "cpu=1,mem=256MiB");
        let p1 = Proclet::builder(Kind::Memory)
            .on(n1[0])
            .create(1u64, |s: u64| Counter { n: s })
            .unwrap();
        let h = std::thread::spawn(|| {
            let (c2, n2) = cluster(1, "cpu=1,mem=256MiB");
            let p2 = Proclet::builder(Kind::Memory)
                .on(n2[0])
                .create(2u64, |s: u64| Counter { n: s })
                .unwrap();
            assert_eq!(add(&p2, 0).unwrap(), 2);
            (c2.controller_addr().to_string(), p2)
        });
        let (addr2, p2) = h.join().unwrap();
        assert_ne!(addr2, c1.controller_addr());
        assert_eq!(add(&p1, 0).unwrap(), 1);
        // The other cluster is gone now; its handle fails with a typed error, not a hang.
        assert!(add(&p2, 0).is_err());
    });
}

/// A local call's future that is waiting for the proclet's lock, and is granted it while
/// nobody polls the future, must not hold the lock until it is polled again: a thread
/// that keeps such a future pending and makes a synchronous call to the same proclet
/// would wait forever for a lock its own future holds.
#[test]
fn an_unpolled_local_call_does_not_keep_the_lock() {
    bounded(LIMIT, || {
        let (cluster, _nodes) = cluster(1, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .on(cluster.node_id())
            .create(0u64, |s: u64| Counter { n: s })
            .unwrap();
        // Hold the lock for a while on another thread.
        let holder = {
            let p = p.clone();
            std::thread::spawn(move || {
                p.run(200u64, |c: &mut Counter, ms: u64| {
                    std::thread::sleep(Duration::from_millis(ms));
                    c.n += 1;
                })
                .unwrap()
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        // Queue an async call behind it, polled once and then left alone.
        let mut pending = Box::pin(p.run_async(10u64, |c: &mut Counter, x: u64| {
            c.n += x;
            c.n
        }));
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(pending.as_mut().poll(&mut cx).is_pending());
        // A synchronous call from this same thread, while the future stays pending.
        let t = Instant::now();
        let n = p.run_ref((), |c: &Counter, ()| c.n).unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        holder.join().unwrap();
        // The queued call ran (in its turn, before the synchronous one) and its result
        // waits for the future.
        assert_eq!(n, 11);
        let out = futures::executor::block_on(pending).unwrap();
        assert_eq!(out, 11);
    });
}

/// Large byte buffers ([`granule::Blob`]) in a remote call's answer leave the serving
/// node without being copied into the frame (a vectored write of the frame's parts) and
/// arrive as views of the reply frame: the bytes must be exactly right, alone, several
/// in one answer next to small fields, and with many answers in flight on one
/// connection at once.
#[test]
fn large_blobs_in_answers_arrive_whole() {
    use granule::Blob;
    bounded(LIMIT, || {
        let (_cluster, nodes) = cluster(1, "cpu=1,mem=512MiB");
        let blob = |seed: u8, len: usize| -> Vec<u8> {
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                .collect()
        };
        let sizes = [0usize, 10, 64 << 10, (64 << 10) + 1, 1 << 20, 3 << 20];
        let state: Vec<Blob> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| Blob::from(blob(i as u8, n)))
            .collect();
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(state, |s: Vec<Blob>| s)
            .unwrap();
        for (i, &n) in sizes.iter().enumerate() {
            let got: Blob = p
                .run_ref(i, |s: &Vec<Blob>, i: usize| s[i].clone())
                .unwrap();
            assert_eq!(&got[..], &blob(i as u8, n)[..], "blob {i} of {n} bytes");
        }
        type Mixed = (u64, Vec<Blob>, String, Option<Blob>);
        let (n, all, tail, last): Mixed = p
            .run_ref((), |s: &Vec<Blob>, ()| {
                (7u64, s.clone(), "after".to_string(), s.last().cloned())
            })
            .unwrap();
        assert_eq!((n, tail.as_str()), (7, "after"));
        for (i, (b, &len)) in all.iter().zip(&sizes).enumerate() {
            assert_eq!(
                &b[..],
                &blob(i as u8, len)[..],
                "blob {i} in a mixed answer"
            );
        }
        assert_eq!(&last.unwrap()[..], &blob(5, 3 << 20)[..]);
        // Many answers in flight: they queue on the node's connection and leave
        // together.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let calls = (0..48).map(|k| {
                let p = p.clone();
                async move {
                    let i = 2 + k % 4;
                    let got: Blob = p
                        .run_ref_async(i, |s: &Vec<Blob>, i: usize| s[i].clone())
                        .await
                        .unwrap();
                    (i, got)
                }
            });
            for (i, got) in futures::future::join_all(calls).await {
                assert_eq!(
                    &got[..],
                    &blob(i as u8, sizes[i])[..],
                    "concurrent blob {i}"
                );
            }
        });
    });
}
