//! A destination that dies in the middle of a move: the proclet stays usable at its
//! source, with its state intact, and calls held during the move are served there.
//!
//! Its own test binary: it slows migration down through the environment
//! (`GRANULE_MIGRATION_THROTTLE`), which the node processes inherit.

mod common;

use common::bounded;
use granule::{CallError, Cluster, Kind, Proclet};
use std::time::{Duration, Instant};

fn checksum(v: &[u8]) -> u64 {
    v.iter().enumerate().fold(0u64, |h, (i, b)| {
        h.wrapping_mul(31).wrapping_add(*b as u64 ^ i as u64)
    })
}

#[test]
fn destination_dying_mid_transfer_leaves_the_proclet_at_its_source() {
    // 8 MiB at 32 MB/s: the transfer takes about 260 ms.
    std::env::set_var("GRANULE_MIGRATION_THROTTLE", "32MB/s");
    bounded(Duration::from_secs(90), || {
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=512MiB;cpu=1,mem=512MiB")
            .unwrap()
            .shed(false)
            .failure_timeout(Duration::from_millis(1000))
            .start()
            .unwrap();
        let nodes = cluster.worker_nodes().unwrap();
        let (src, dst) = (nodes[0], nodes[1]);
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
