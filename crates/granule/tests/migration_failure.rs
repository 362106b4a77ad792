//! A destination that dies in the middle of a move: the proclet stays usable at its
//! source, with its state intact, and calls held during the move are served there.
//!
//! Its own test binary: it slows migration down through the environment
//! (`GRANULE_MIGRATION_THROTTLE`), which the node processes inherit.

mod common;

use common::{bounded, checksum};
use granule::NodeId;
use granule::{CallError, Cluster, Kind, Proclet};
use std::time::{Duration, Instant};

/// Two nodes whose moves are paced at 32 MB/s (so a test can act in the middle of one),
/// with shedding off: only the test moves proclets.
fn throttled_pair() -> (Cluster, NodeId, NodeId) {
    std::env::set_var("GRANULE_MIGRATION_THROTTLE", "32MB/s");
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=512MiB;cpu=1,mem=512MiB")
        .unwrap()
        .shed(false)
        .failure_timeout(Duration::from_millis(1000))
        .start()
        .unwrap();
    let nodes = cluster.worker_nodes().unwrap();
    let (src, dst) = (nodes[0], nodes[1]);
    (cluster, src, dst)
}

#[test]
fn destination_dying_mid_transfer_leaves_the_proclet_at_its_source() {
    bounded(Duration::from_secs(90), || {
        // 8 MiB at 32 MB/s: the transfer takes about 260 ms.
        let (cluster, src, dst) = throttled_pair();
        let p = Proclet::builder(Kind::Memory)
            .on(src)
            .create(8usize << 20, |n: usize| {
                (0..n).map(|i| (i % 251) as u8).collect::<Vec<u8>>()
            })
            .unwrap();
        let before = p.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap();

        // A caller keeps calling throughout; every call must succeed.
        let p2 = p.clone();
        let stop_at = Instant::now() + Duration::from_millis(900);
        let caller = std::thread::spawn(move || {
            let mut n = 0u32;
            while Instant::now() < stop_at {
                p2.run((), |v: &mut Vec<u8>, ()| v[0] = v[0].wrapping_add(0))
                    .map_err(|e| format!("call {n}: {e}"))?;
                n += 1;
            }
            Ok::<u32, String>(n)
        });

        let id = p.id();
        let mover = {
            let started = Instant::now();
            let c = &cluster;
            std::thread::scope(|s| {
                let h = s.spawn(move || c.move_proclet(id, dst));
                std::thread::sleep(Duration::from_millis(90));
                c.kill_node(dst).unwrap();
                (h.join().unwrap(), started.elapsed())
            })
        };
        let (outcome, took) = mover;
        match outcome {
            Err(CallError::Internal(m)) | Err(CallError::Refused(m)) => {
                assert!(
                    m.contains("destination") || m.contains("unreachable"),
                    "{m}"
                )
            }
            other => panic!("the move should fail when its destination dies: {other:?}"),
        }
        assert!(
            took < Duration::from_secs(5),
            "the failed move ended in {took:?}"
        );
        assert_eq!(
            p.location().unwrap(),
            src,
            "the proclet stayed at its source"
        );
        assert_eq!(
            p.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap(),
            before,
            "state intact"
        );
        let calls = caller.join().unwrap().expect("no call failed");
        assert!(calls > 0);
        // And it can still move elsewhere later (to the driver).
        let home = cluster.node_id();
        cluster.move_proclet(id, home).unwrap();
        assert_eq!(
            p.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap(),
            before
        );
    });
}

/// The source dying while a structured state streams to the destination: the
/// destination drops what arrived, keeps serving, and takes later moves.
#[test]
fn source_dying_mid_transfer_leaves_the_destination_serving() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = throttled_pair();
        // ~4 MiB encoded: about 130 ms at 32 MB/s.
        let doomed = Proclet::builder(Kind::Memory)
            .on(src)
            .create(4000u64, |n: u64| {
                (0..n)
                    .map(|i| (i, vec![(i % 251) as u8; 1000]))
                    .collect::<std::collections::HashMap<u64, Vec<u8>>>()
            })
            .unwrap();
        let survivor = Proclet::builder(Kind::Memory)
            .on(dst)
            .create(5u64, |n: u64| n)
            .unwrap();
        let id = doomed.id();
        let c = &cluster;
        let outcome = std::thread::scope(|s| {
            let h = s.spawn(move || c.move_proclet(id, dst));
            std::thread::sleep(Duration::from_millis(50));
            c.kill_node(src).unwrap();
            h.join().unwrap()
        });
        assert!(outcome.is_err(), "the move cannot finish: {outcome:?}");
        // The destination serves on, and never installed the half-arrived proclet.
        for k in 1..=20u64 {
            let n = survivor
                .run((), |n: &mut u64, ()| {
                    *n += 1;
                    *n
                })
                .unwrap();
            assert_eq!(n, 5 + k);
        }
        let r = doomed.run_ref((), |m: &std::collections::HashMap<u64, Vec<u8>>, ()| {
            m.len()
        });
        assert!(r.is_err(), "the proclet died with its source: {r:?}");
        // And the destination still takes a whole move of a structured state.
        let again = Proclet::builder(Kind::Memory)
            .on(cluster.node_id())
            .create(2000u64, |n: u64| {
                (0..n)
                    .map(|i| (i, vec![1u8; 1000]))
                    .collect::<std::collections::HashMap<u64, Vec<u8>>>()
            })
            .unwrap();
        cluster.move_proclet(again.id(), dst).unwrap();
        assert_eq!(
            again
                .run_ref((), |m: &std::collections::HashMap<u64, Vec<u8>>, ()| m
                    .len())
                .unwrap(),
            2000
        );
    });
}

/// While an encoded state streams (slowly here), read-only calls keep being answered at
/// the source; a write waits and lands at the new home, once.
#[test]
fn reads_are_served_during_a_move_and_writes_land_at_the_new_home() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = throttled_pair();
        // ~4 MiB encoded: about 130 ms at 32 MB/s.
        let p = Proclet::builder(Kind::Memory)
            .on(src)
            .create(4000u64, |n: u64| {
                (0..n)
                    .map(|i| (i, vec![(i % 251) as u8; 1000]))
                    .collect::<std::collections::HashMap<u64, Vec<u8>>>()
            })
            .unwrap();
        let id = p.id();
        std::thread::scope(|s| {
            let c = &cluster;
            let mover = s.spawn(move || c.move_proclet(id, dst));
            std::thread::sleep(Duration::from_millis(30));
            // Mid-transfer: reads answer quickly (from the source).
            let mut slowest = Duration::ZERO;
            for _ in 0..10 {
                let t = Instant::now();
                let n = p
                    .run_ref((), |m: &std::collections::HashMap<u64, Vec<u8>>, ()| {
                        m.len()
                    })
                    .unwrap();
                assert_eq!(n, 4000);
                slowest = slowest.max(t.elapsed());
            }
            // A write during the transfer waits for it and runs once, at the new home.
            let w = p
                .run((), |m: &mut std::collections::HashMap<u64, Vec<u8>>, ()| {
                    m.insert(99_999, vec![1]);
                    (m.len(), granule::here())
                })
                .unwrap();
            let stats = mover.join().unwrap().unwrap();
            assert!(
                stats.micros > 60_000,
                "the transfer was slow enough to overlap: {stats:?}"
            );
            assert!(
                slowest < Duration::from_millis(40),
                "reads during the move took up to {slowest:?}"
            );
            assert_eq!(w, (4001, Some(dst)));
        });
        assert_eq!(p.location().unwrap(), dst);
        assert_eq!(
            p.run_ref((), |m: &std::collections::HashMap<u64, Vec<u8>>, ()| m
                .len())
                .unwrap(),
            4001
        );
    });
}
