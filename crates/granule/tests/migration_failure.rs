//! Moves that fail part-way, made to fail at an exact step by failpoints and the
//! transport's fault filter (no timing windows): the proclet stays usable at its source
//! with its state intact, calls made meanwhile are neither lost nor run twice, and the
//! nodes involved keep serving and take later moves.

mod common;

use common::{bounded, checksum};
use granule::faults::{FaultAction, FaultRule, FaultRules, Partition};
use granule::{CallError, Cluster, Kind, NodeId, Proclet};
use std::collections::HashMap;
use std::time::{Duration, Instant};

type Map = HashMap<u64, Vec<u8>>;

/// Two nodes that take fault orders, with shedding off (only the test moves proclets)
/// and a shorter stall timeout (a stream that hears nothing for 5 s is abandoned: long
/// enough for a loaded machine to decode a state, short enough for the partition test).
fn pair() -> (Cluster, NodeId, NodeId) {
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=512MiB;cpu=1,mem=512MiB")
        .unwrap()
        .shed(false)
        .faults(true)
        .set("migration.stall_timeout", "5s")
        .unwrap()
        // Nothing here waits for a node to be declared dead (a crash closes its
        // connections): a roomy timeout keeps a loaded machine from declaring one.
        .failure_timeout(Duration::from_secs(3))
        .start()
        .unwrap();
    let nodes = cluster.worker_nodes().unwrap();
    (cluster, nodes[0], nodes[1])
}

/// A byte-vector proclet of 8 MiB (16 chunks of 512 KiB) on `on`.
fn bytes_on(on: NodeId) -> Proclet<Vec<u8>> {
    Proclet::builder(Kind::Memory)
        .on(on)
        .create(8usize << 20, |n: usize| {
            (0..n).map(|i| (i % 251) as u8).collect::<Vec<u8>>()
        })
        .unwrap()
}

/// A structured proclet (~4 MiB encoded: 8 chunks) on `on`.
fn map_on(on: NodeId) -> Proclet<Map> {
    Proclet::builder(Kind::Memory)
        .on(on)
        .create(4000u64, |n: u64| {
            (0..n).map(|i| (i, vec![(i % 251) as u8; 1000])).collect()
        })
        .unwrap()
}

/// Keep incrementing byte 0 of `p` until `stop` says so; returns how many calls ran.
/// Every call must succeed.
fn steady_caller(
    p: &Proclet<Vec<u8>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Result<u32, String>> {
    let p = p.clone();
    std::thread::spawn(move || {
        let mut n = 0u32;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) || n == 0 {
            p.run((), |v: &mut Vec<u8>, ()| v[0] = v[0].wrapping_add(1))
                .map_err(|e| format!("call {n}: {e}"))?;
            n += 1;
        }
        Ok(n)
    })
}

fn assert_move_failed(outcome: Result<granule::MoveStats, CallError>, why: &str) {
    match outcome {
        Err(CallError::Internal(m)) | Err(CallError::Refused(m)) => {
            assert!(
                m.contains("destination")
                    || m.contains("unreachable")
                    || m.contains("receiver")
                    || m.contains("failpoint"),
                "{why}: {m}"
            )
        }
        other => panic!("{why}: the move should fail, got {other:?}"),
    }
}

/// The destination crashes when the third chunk of the state arrives: the move fails,
/// the proclet stays where it was with every byte, calls made throughout all succeed
/// (each exactly once), and it moves elsewhere later.
#[test]
fn destination_crashing_mid_transfer_leaves_the_proclet_at_its_source() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = pair();
        let p = bytes_on(src);
        let before = p.run_ref((), |v: &Vec<u8>, ()| checksum(&v[1..])).unwrap();
        cluster
            .faults()
            .failpoints(dst, "stream.chunk_received=2*off->crash")
            .unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let caller = steady_caller(&p, stop.clone());
        let t = Instant::now();
        let outcome = cluster.move_proclet(p.id(), dst);
        assert_move_failed(outcome, "destination crashed");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "failed in {:?}",
            t.elapsed()
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let calls = caller.join().unwrap().expect("no call failed");
        assert_eq!(
            p.location().unwrap(),
            src,
            "the proclet stayed at its source"
        );
        let (sum, first) = p
            .run_ref((), |v: &Vec<u8>, ()| (checksum(&v[1..]), v[0]))
            .unwrap();
        assert_eq!(sum, before, "state intact");
        assert_eq!(first as u32, calls % 256, "every call ran exactly once");
        // And it can still move elsewhere later (to the driver).
        cluster.move_proclet(p.id(), cluster.node_id()).unwrap();
        assert_eq!(
            p.run_ref((), |v: &Vec<u8>, ()| checksum(&v[1..])).unwrap(),
            before
        );
    });
}

/// The source crashes after handing its third chunk to the connection: the destination
/// drops what arrived, keeps serving, never hosts the half-arrived proclet, and takes a
/// whole move later.
#[test]
fn source_crashing_mid_transfer_leaves_the_destination_serving() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = pair();
        let doomed = map_on(src);
        let survivor = Proclet::builder(Kind::Memory)
            .on(dst)
            .create(5u64, |n: u64| n)
            .unwrap();
        cluster
            .faults()
            .failpoints(src, "stream.chunk_sent=2*off->crash")
            .unwrap();
        let outcome = cluster.move_proclet(doomed.id(), dst);
        assert!(outcome.is_err(), "the move cannot finish: {outcome:?}");
        for k in 1..=20u64 {
            let n = survivor
                .run((), |n: &mut u64, ()| {
                    *n += 1;
                    *n
                })
                .unwrap();
            assert_eq!(n, 5 + k);
        }
        let r = doomed.run_ref((), |m: &Map, ()| m.len());
        assert!(r.is_err(), "the proclet died with its source: {r:?}");
        let again = map_on(cluster.node_id());
        cluster.move_proclet(again.id(), dst).unwrap();
        assert_eq!(again.run_ref((), |m: &Map, ()| m.len()).unwrap(), 4000);
    });
}

/// Paused with the proclet's lock held mid-move: read-only calls are answered at the
/// source meanwhile (they would hang otherwise), a write waits, and when the move goes
/// on it runs once, at the new home.
#[test]
fn reads_are_served_during_a_move_and_writes_land_at_the_new_home() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = pair();
        let p = map_on(src);
        cluster
            .faults()
            .failpoints(src, "migrate.locked=1*pause")
            .unwrap();
        std::thread::scope(|s| {
            let c = &cluster;
            let id = p.id();
            let mover = s.spawn(move || c.move_proclet(id, dst));
            // Wait until the move holds the lock (its failpoint fired), not for a time.
            let t = Instant::now();
            while !c.faults().report(src).unwrap().contains("migrate.locked") {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "the move never paused"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            for _ in 0..10 {
                assert_eq!(p.run_ref((), |m: &Map, ()| m.len()).unwrap(), 4000);
            }
            let p2 = p.clone();
            let writer = s.spawn(move || {
                p2.run((), |m: &mut Map, ()| {
                    m.insert(99_999, vec![1]);
                    (m.len(), granule::here())
                })
            });
            // Let the move go on (the write is held until it ends, wherever it started).
            c.faults().failpoints(src, "").unwrap();
            mover.join().unwrap().unwrap();
            assert_eq!(writer.join().unwrap().unwrap(), (4001, Some(dst)));
        });
        assert_eq!(p.location().unwrap(), dst);
        assert_eq!(p.run_ref((), |m: &Map, ()| m.len()).unwrap(), 4001);
    });
}

/// A state whose read-only calls change it (a counter behind an atomic), as a batch
/// job's worker is.
#[derive(serde::Serialize, serde::Deserialize, Default)]
struct Ticks {
    #[serde(with = "atomic_u64")]
    n: std::sync::atomic::AtomicU64,
}

mod atomic_u64 {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::sync::atomic::{AtomicU64, Ordering};
    pub fn serialize<S: Serializer>(v: &AtomicU64, s: S) -> Result<S::Ok, S::Error> {
        v.load(Ordering::SeqCst).serialize(s)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<AtomicU64, D::Error> {
        u64::deserialize(d).map(AtomicU64::new)
    }
}

fn tick(t: &Ticks, (): ()) -> (u64, Option<NodeId>) {
    let n = t.n.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    (n, granule::here())
}

/// Paused with the lock held mid-move, a proclet declared with `mutating_reads` holds
/// its read-only calls too (served at the source, their changes would be lost with the
/// source's copy: a batch worker's cursor went back that way), and each runs once, at
/// the new home.
#[test]
fn reads_that_change_the_state_are_held_during_a_move_and_lose_nothing() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = pair();
        let p: Proclet<Ticks> = Proclet::builder(Kind::Compute)
            .on(src)
            .mutating_reads()
            .create((), |()| Ticks::default())
            .unwrap();
        assert_eq!(p.run_ref((), tick).unwrap(), (1, Some(src)));
        cluster
            .faults()
            .failpoints(src, "migrate.locked=1*pause")
            .unwrap();
        std::thread::scope(|s| {
            let c = &cluster;
            let id = p.id();
            let mover = s.spawn(move || c.move_proclet(id, dst));
            let t = Instant::now();
            while !c.faults().report(src).unwrap().contains("migrate.locked") {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "the move never paused"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let p2 = p.clone();
            let reader = s.spawn(move || {
                let r = p2.run_ref((), tick);
                let _ = tx.send(());
                r
            });
            // Held while the move is paused: an answer now could only come from the
            // source's copy, which the move is about to drop.
            let served_mid_move = rx.recv_timeout(Duration::from_millis(300)).is_ok();
            c.faults().failpoints(src, "").unwrap();
            mover.join().unwrap().unwrap();
            let read = reader.join().unwrap().unwrap();
            assert!(
                !served_mid_move,
                "a read that changes the state was served at the source mid-move: {read:?}"
            );
            assert_eq!(read, (2, Some(dst)));
        });
        assert_eq!(p.location().unwrap(), dst);
        assert_eq!(p.run_ref((), tick).unwrap(), (3, Some(dst)), "no tick lost");
    });
}

/// A proclet moved off a node that died afterwards is still reached through handles and
/// caches that name the dead node (its creation hint, a location learned before the
/// move): the caller asks the controller where it went instead of failing with "node
/// unreachable" (a batch job's target map once failed so after its worker-only node
/// was killed).
#[test]
fn a_proclet_that_left_a_node_before_it_died_is_still_reached() {
    bounded(Duration::from_secs(90), || {
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=512MiB;cpu=1,mem=512MiB;cpu=1,mem=512MiB")
            .unwrap()
            .shed(false)
            .set("cluster.replace_dead", "off")
            .unwrap()
            .failure_timeout(Duration::from_secs(3))
            .start()
            .unwrap();
        let nodes = cluster.worker_nodes().unwrap();
        let (first, then, caller) = (nodes[0], nodes[1], nodes[2]);
        let p = map_on(first);
        // A client on another node learns where it lives (and caches it) before it moves.
        #[derive(serde::Serialize, serde::Deserialize)]
        struct Client;
        let client = Proclet::builder(Kind::Compute)
            .on(caller)
            .create((), |()| Client)
            .unwrap();
        let size = |c: &Proclet<Client>, p: &Proclet<Map>| {
            c.run_ref(p.clone(), |_: &Client, p: Proclet<Map>| {
                p.run_ref((), |m: &Map, ()| m.len())
                    .map_err(|e| e.to_string())
            })
            .unwrap()
        };
        assert_eq!(size(&client, &p), Ok(4000));
        cluster.move_proclet(p.id(), then).unwrap();
        cluster.kill_node(first).unwrap();
        let t = Instant::now();
        while cluster
            .nodes()
            .unwrap()
            .iter()
            .any(|n| n.id == first && n.state == granule::NodeState::Alive)
        {
            assert!(t.elapsed() < Duration::from_secs(20), "never declared dead");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The handle's hint names the dead node; the client's cache does too.
        assert_eq!(
            size(&client, &p),
            Ok(4000),
            "from a node that cached the old place"
        );
        let fresh: Proclet<Map> =
            serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(
            fresh.run_ref((), |m: &Map, ()| m.len()).unwrap(),
            4000,
            "from the driver"
        );
    });
}

/// The destination refuses the state once it has it all (before installing), or drops
/// its copy at the last moment (installed, before confirming): either way the move
/// fails, nothing is hosted twice, and the proclet serves on at its source.
#[test]
fn a_destination_refusing_at_the_last_steps_leaves_one_copy() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = pair();
        let p = map_on(src);
        for point in ["migrate.before_install", "migrate.installed"] {
            cluster
                .faults()
                .failpoints(dst, &format!("{point}=1*error"))
                .unwrap();
            let outcome = cluster.move_proclet(p.id(), dst);
            assert_move_failed(outcome, point);
            assert_eq!(p.location().unwrap(), src, "{point}");
            let w = p
                .run((), |m: &mut Map, ()| {
                    m.insert(1, vec![7]);
                    granule::here()
                })
                .unwrap();
            assert_eq!(w, Some(src), "{point}: writes run at the source");
            // No copy is left at the destination: the next move there works and the
            // write above is in it.
        }
        cluster.faults().clear().unwrap();
        cluster.move_proclet(p.id(), dst).unwrap();
        assert_eq!(
            p.run_ref((), |m: &Map, ()| (m[&1].clone(), granule::here()))
                .unwrap(),
            (vec![7], Some(dst))
        );
    });
}

/// The destination crashes after installing, before its confirmation leaves: the
/// source never hears it, abandons the move after the stall timeout and serves on.
#[test]
fn destination_crashing_after_install_leaves_the_proclet_at_its_source() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = pair();
        let p = map_on(src);
        cluster
            .faults()
            .failpoints(dst, "migrate.installed=crash")
            .unwrap();
        assert_move_failed(cluster.move_proclet(p.id(), dst), "destination crashed");
        assert_eq!(p.location().unwrap(), src);
        assert_eq!(p.run_ref((), |m: &Map, ()| m.len()).unwrap(), 4000);
    });
}

/// The source and the destination are cut off from each other mid-move (a partition:
/// frames dropped both ways, nothing closed): the source gives up after the stall
/// timeout (5 s) and keeps the proclet; the destination withdraws any copy it had; after the
/// partition heals, the move succeeds.
#[test]
fn a_partition_during_a_move_is_survived_and_healed() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = pair();
        let p = bytes_on(src);
        let before = p.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap();
        // Partition only once the stream has begun: on the third chunk the source sends.
        cluster
            .faults()
            .failpoints(src, "stream.chunk_sent=2*off->1*pause")
            .unwrap();
        std::thread::scope(|s| {
            let c = &cluster;
            let id = p.id();
            let mover = s.spawn(move || c.move_proclet(id, dst));
            let t = Instant::now();
            while !c
                .faults()
                .report(src)
                .unwrap()
                .contains("stream.chunk_sent")
            {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "the stream never began"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let cut = FaultRules::seeded(1).partition(Partition::nodes([vec![src], vec![dst]]));
            c.faults().filter(src, &cut).unwrap();
            c.faults().filter(dst, &cut).unwrap();
            c.faults().failpoints(src, "").unwrap();
            assert_move_failed(mover.join().unwrap(), "partitioned");
        });
        assert_eq!(p.location().unwrap(), src);
        assert_eq!(
            p.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap(),
            before
        );
        cluster.faults().clear().unwrap();
        cluster.move_proclet(p.id(), dst).unwrap();
        assert_eq!(p.location().unwrap(), dst);
        assert_eq!(
            p.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap(),
            before
        );
    });
}

/// The connection between source and destination is cut in the middle of the second
/// chunk (the destination sees a truncated frame): the move fails cleanly and a retry
/// over a new connection succeeds.
#[test]
fn a_connection_cut_mid_frame_fails_the_move_and_a_retry_succeeds() {
    bounded(Duration::from_secs(90), || {
        let (cluster, src, dst) = pair();
        let p = bytes_on(src);
        let before = p.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap();
        let cut = FaultRules::seeded(2).rule(
            FaultRule::new(FaultAction::Cut)
                .outgoing()
                .node(dst)
                .kind("Transfer")
                .nth(2),
        );
        cluster.faults().filter(src, &cut).unwrap();
        assert_move_failed(cluster.move_proclet(p.id(), dst), "cut");
        assert!(
            cluster.faults().report(src).unwrap().contains("cut after"),
            "the filter cut a frame"
        );
        assert_eq!(p.location().unwrap(), src);
        cluster.move_proclet(p.id(), dst).unwrap();
        assert_eq!(
            p.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap(),
            before
        );
    });
}

/// A move whose confirmation and abort are both lost leaves an uncommitted copy at its
/// destination D (the source gave up; D never heard). The source then moves the
/// proclet to E. D must withdraw its copy, never commit it: the proclet lives in one
/// place, E, with every write.
#[test]
fn a_stale_uncommitted_copy_is_withdrawn_when_the_proclet_went_elsewhere() {
    bounded(Duration::from_secs(90), || {
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=256MiB;cpu=1,mem=256MiB;cpu=1,mem=256MiB")
            .unwrap()
            .shed(false)
            .faults(true)
            .set("migration.stall_timeout", "1s")
            .unwrap()
            .failure_timeout(Duration::from_secs(3))
            .start()
            .unwrap();
        let n = cluster.worker_nodes().unwrap();
        let (src, d, e) = (n[0], n[1], n[2]);
        let p = Proclet::builder(Kind::Memory)
            .on(src)
            .create(0u64, |x: u64| x)
            .unwrap();
        // D confirms nothing to the source, ignores its abort, and cannot ask it what
        // became of the move (until the proclet has gone to E).
        let deaf = FaultRules::seeded(3)
            .rule(
                FaultRule::new(FaultAction::Drop)
                    .outgoing()
                    .node(src)
                    .kind("Done"),
            )
            .rule(
                FaultRule::new(FaultAction::Drop)
                    .incoming()
                    .node(src)
                    .kind("TransferAbort"),
            )
            .rule(
                FaultRule::new(FaultAction::Drop)
                    .outgoing()
                    .node(src)
                    .kind("Resolve"),
            );
        cluster.faults().filter(d, &deaf).unwrap();
        assert_move_failed(cluster.move_proclet(p.id(), d), "no confirmation");
        let lists = |node: NodeId| {
            cluster
                .nodes()
                .unwrap()
                .into_iter()
                .find(|i| i.id == node)
                .is_some_and(|i| i.usage.top.iter().any(|u| u.id == p.id()))
        };
        assert!(lists(d), "D holds an uncommitted copy");
        assert_eq!(
            p.run((), |x: &mut u64, ()| {
                *x += 1;
                *x
            })
            .unwrap(),
            1
        );
        cluster.move_proclet(p.id(), e).unwrap();
        assert_eq!(
            p.run((), |x: &mut u64, ()| {
                *x += 1;
                *x
            })
            .unwrap(),
            2
        );
        // Now D may ask: the source says the proclet left for E at a later epoch, so
        // D's attempt was abandoned and its copy is withdrawn (D stops listing it).
        cluster.faults().clear().unwrap();
        let t = Instant::now();
        while lists(d) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "D kept its stale copy"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(cluster.locate(p.id()).unwrap(), e);
        assert_eq!(
            p.run((), |x: &mut u64, ()| {
                *x += 1;
                (*x, granule::here())
            })
            .unwrap(),
            (3, Some(e))
        );
    });
}

/// A production node refuses fault orders.
#[test]
fn fault_orders_are_refused_unless_enabled() {
    bounded(Duration::from_secs(60), || {
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=256MiB")
            .unwrap()
            .start()
            .unwrap();
        let n = cluster.worker_nodes().unwrap()[0];
        let e = cluster
            .faults()
            .failpoints(n, "migrate.locked=crash")
            .unwrap_err();
        assert!(e.to_string().contains("faults.enabled"), "{e}");
    });
}
