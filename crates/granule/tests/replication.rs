//! Replicated proclets on real clusters: copies on distinct nodes, every mutating call
//! applied on each, a primary killed (with SIGKILL, and by a failpoint right after its
//! backups applied a call but before it answered) and its backup taking over with no
//! acknowledged call lost and none applied twice, and a closure that is not
//! deterministic reported.

mod common;

use common::{bounded, cluster, http_get};
use granule::{CallError, Kind, NodeId, Proclet};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Serialize, Deserialize, Default, Debug)]
struct Log {
    /// Every value added, in order: a call applied twice or lost shows here.
    seen: Vec<u64>,
}

const LIMIT: Duration = Duration::from_secs(90);

fn append(p: &Proclet<Log>, x: u64) -> Result<usize, CallError> {
    p.run(x, |l: &mut Log, x: u64| {
        l.seen.push(x);
        l.seen.len()
    })
}

fn seen(p: &Proclet<Log>) -> Vec<u64> {
    p.run_ref((), |l: &Log, ()| l.seen.clone())
        .expect("read the log")
}

/// End node `node`'s process with SIGKILL, as a machine failure would.
fn kill_node(cluster: &granule::Cluster, node: NodeId) {
    kill(Pid::from_raw(pid_of(cluster, node) as i32), Signal::SIGKILL).unwrap();
}

fn pid_of(cluster: &granule::Cluster, node: NodeId) -> u32 {
    cluster
        .spawned_nodes()
        .into_iter()
        .find(|(n, _)| *n == node)
        .map(|(_, pid)| pid)
        .expect("the node's process")
}

#[test]
fn a_killed_primarys_backup_takes_over_with_every_acknowledged_call() {
    bounded(LIMIT, || {
        let (cluster, _nodes) = cluster(3, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .replicas(2)
            .create((), |()| Log::default())
            .expect("a replicated proclet");
        for x in 0..50 {
            assert_eq!(append(&p, x).unwrap(), x as usize + 1);
        }
        let primary = p.location().unwrap();
        kill_node(&cluster, primary);
        // The next calls find the backup, now the primary, with all 50 calls.
        for x in 50..100 {
            assert_eq!(append(&p, x).unwrap(), x as usize + 1, "call {x}");
        }
        let now = p.location().unwrap();
        assert_ne!(now, primary, "the primary did not move to the backup");
        assert_eq!(seen(&p), (0..100).collect::<Vec<u64>>());
    });
}

#[test]
fn a_call_applied_by_the_backups_is_not_run_again_when_the_primary_dies_before_answering() {
    bounded(LIMIT, || {
        let (cluster, _nodes) = cluster(3, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .replicas(2)
            .create((), |()| Log::default())
            .expect("a replicated proclet");
        assert_eq!(append(&p, 1).unwrap(), 1);
        let primary = p.location().unwrap();
        // The primary dies right after its backup applied the next call, before it
        // answers: the caller asks the new primary, which answers from its record.
        cluster
            .faults()
            .failpoints(primary, "replicate.before_reply=crash")
            .unwrap();
        assert_eq!(append(&p, 2).unwrap(), 2);
        assert_ne!(p.location().unwrap(), primary);
        assert_eq!(append(&p, 3).unwrap(), 3);
        assert_eq!(seen(&p), vec![1, 2, 3]);
    });
}

#[test]
fn copies_go_to_distinct_nodes_and_too_few_nodes_is_refused() {
    bounded(LIMIT, || {
        let (_cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        let r = Proclet::builder(Kind::Memory)
            .replicas(3)
            .create((), |()| Log::default());
        match r {
            Err(CallError::NoCapacity(m)) => assert!(m.contains("3 copies"), "{m}"),
            other => panic!("three copies on two nodes: {other:?}"),
        }
        // Two copies fit; a primary named by the caller keeps its backup elsewhere.
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[1])
            .replicas(2)
            .create((), |()| Log::default())
            .unwrap();
        assert_eq!(append(&p, 7).unwrap(), 1);
        assert_eq!(p.location().unwrap(), nodes[1]);
        assert_eq!(seen(&p), vec![7]);
        p.destroy().unwrap();
    });
}

#[test]
fn a_closure_that_is_not_deterministic_is_reported() {
    bounded(LIMIT, || {
        let (cluster, _nodes) = cluster(2, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .replicas(2)
            .create((), |()| Log::default())
            .unwrap();
        // Each copy reads its own clock: the results differ.
        p.run((), |l: &mut Log, ()| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
            l.seen.push(t);
            t
        })
        .unwrap();
        let line = divergences(&cluster, p.location().unwrap());
        assert!(line.ends_with(" 1"), "{line}");
    });
}

/// Node `node`'s divergence counter: its line in the node's `/metrics`.
fn divergences(cluster: &granule::Cluster, node: NodeId) -> String {
    let info = cluster
        .nodes()
        .unwrap()
        .into_iter()
        .find(|n| n.id == node)
        .unwrap();
    let metrics = http_get(info.metrics_addr.as_deref().unwrap(), "/metrics");
    metrics
        .lines()
        .find(|l| l.starts_with("granule_replica_divergences_total"))
        .unwrap_or_else(|| panic!("no divergence counter in\n{metrics}"))
        .to_string()
}

/// The copies kept as backups by each live node (from its `/metrics`).
fn backup_copies(cluster: &granule::Cluster) -> Vec<(NodeId, u64)> {
    cluster
        .nodes()
        .unwrap()
        .into_iter()
        .filter(|n| n.state == granule::NodeState::Alive)
        .filter_map(|n| {
            let m = http_get(n.metrics_addr.as_deref()?, "/metrics");
            let v = m
                .lines()
                .find(|l| l.starts_with("granule_backup_copies"))?
                .rsplit(' ')
                .next()?
                .parse::<f64>()
                .ok()?;
            Some((n.id, v as u64))
        })
        .collect()
}

#[test]
fn a_lost_backup_is_replaced_and_the_new_one_can_take_over() {
    bounded(LIMIT, || {
        let (cluster, _nodes) = cluster(3, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .replicas(2)
            .create((), |()| Log::default())
            .unwrap();
        for x in 0..10 {
            append(&p, x).unwrap();
        }
        let primary = p.location().unwrap();
        let backup = backup_copies(&cluster)
            .into_iter()
            .find(|(_, n)| *n == 1)
            .map(|(id, _)| id)
            .expect("one node keeps the backup");
        assert_ne!(backup, primary);
        kill_node(&cluster, backup);
        // Calls go on: the primary holds them until the controller drops the backup.
        for x in 10..20 {
            assert_eq!(append(&p, x).unwrap(), x as usize + 1);
        }
        // A new backup on another live node, with the state and the calls since.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let replacement = loop {
            let kept: Vec<_> = backup_copies(&cluster)
                .into_iter()
                .filter(|(id, n)| *n == 1 && *id != backup && *id != primary)
                .collect();
            if let Some((id, _)) = kept.first() {
                break *id;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no new backup: {:?}",
                backup_copies(&cluster)
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        for x in 20..30 {
            append(&p, x).unwrap();
        }
        // The new backup takes over from the primary, with every call.
        kill_node(&cluster, primary);
        assert_eq!(append(&p, 30).unwrap(), 31);
        assert_eq!(p.location().unwrap(), replacement);
        assert_eq!(seen(&p), (0..31).collect::<Vec<u64>>());
    });
}

#[test]
fn a_frozen_primary_is_replaced_after_the_failure_timeout() {
    bounded(LIMIT, || {
        let (cluster, _nodes) = cluster(2, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .replicas(2)
            .create((), |()| Log::default())
            .unwrap();
        append(&p, 0).unwrap();
        let primary = p.location().unwrap();
        let pid = Pid::from_raw(pid_of(&cluster, primary) as i32);
        kill(pid, Signal::SIGSTOP).unwrap();
        // kill(2) returns before every thread has stopped: a call sent at once could
        // still be served by the primary (seen once in CI, under load).
        wait_until_stopped(pid.as_raw() as u32);
        // Sent to the frozen primary, the call waits until the controller declares it
        // dead (the failure timeout, 1 s here) and is then served by the backup.
        let started = std::time::Instant::now();
        let r = append(&p, 1);
        let waited = started.elapsed();
        let _ = kill(pid, Signal::SIGCONT);
        assert_eq!(r.unwrap(), 2);
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        assert_ne!(p.location().unwrap(), primary);
        assert_eq!(seen(&p), vec![0, 1]);
    });
}

/// Wait until every thread of process `pid` is stopped.
fn wait_until_stopped(pid: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !granule_host::proc::process_stopped(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} did not stop"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What the seeded test does to one copy.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// A failpoint that ends the process: the primary after its backups applied its
    /// `k`-th call from now (before it answers), or a backup as its `k`-th call arrives.
    Crash { k: u64 },
    /// SIGKILL between two calls, after `k` more calls.
    Kill { k: u64 },
    /// The primary moved to another node while `k` + 3 calls are made, and ended by a
    /// failpoint in the middle of the move: after the state streamed there (before the
    /// controller hands it over), or after the hand-over (before it lets go).
    MoveCrash { k: u64, handed_over: bool },
}

/// One seed: a proclet with three copies on a cluster of four nodes takes 40 calls while
/// its primary, and then one of its backups, are ended — by a failpoint at a seeded
/// step, or by SIGKILL between calls. Every answered call is applied exactly once, a
/// failed one at most once, and nothing else is in the log.
fn run_seed(seed: u64) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let pick = |rng: &mut rand::rngs::StdRng| {
        let k = rng.random_range(0..8u64);
        if rng.random_bool(0.5) {
            Fault::Crash { k }
        } else {
            Fault::Kill { k }
        }
    };
    let first = if rng.random_bool(1.0 / 3.0) {
        Fault::MoveCrash {
            k: rng.random_range(0..8u64),
            handed_over: rng.random_bool(0.5),
        }
    } else {
        pick(&mut rng)
    };
    let schedule = [first, pick(&mut rng)];
    let (cluster, nodes) = cluster(4, "cpu=1,mem=256MiB");
    let p = Proclet::builder(Kind::Memory)
        .replicas(3)
        .create((), |()| Log::default())
        .unwrap();
    let mut answered = Vec::new();
    let mut failed = Vec::new();
    let next = std::cell::Cell::new(0u64);
    let call = |answered: &mut Vec<u64>, failed: &mut Vec<u64>| {
        let x = next.get() + 1;
        next.set(x);
        match append(&p, x) {
            Ok(_) => answered.push(x),
            Err(_) => failed.push(x),
        }
    };
    for _ in 0..5 {
        call(&mut answered, &mut failed);
    }
    for (i, fault) in schedule.iter().enumerate() {
        // The first fault ends the primary, the second a backup.
        let primary = p.location().unwrap();
        let target = if i == 0 {
            primary
        } else {
            backup_copies(&cluster)
                .into_iter()
                .find(|(n, c)| *c == 1 && *n != primary)
                .map(|(n, _)| n)
                .unwrap_or_else(|| panic!("seed {seed}: no backup to end ({schedule:?})"))
        };
        match *fault {
            Fault::Crash { k } => {
                let fp = if i == 0 {
                    "replicate.before_reply"
                } else {
                    "replicate.before_apply"
                };
                let spec = format!("{fp}={k}*off->crash");
                cluster
                    .faults()
                    .failpoints(target, &spec)
                    .unwrap_or_else(|e| panic!("seed {seed}: arming {spec}: {e}"));
                for _ in 0..k + 3 {
                    call(&mut answered, &mut failed);
                }
            }
            Fault::MoveCrash { k, handed_over } => {
                let fp = if handed_over {
                    "replicate.move.handed_over"
                } else {
                    "replicate.move.streamed"
                };
                cluster
                    .faults()
                    .failpoints(target, &format!("{fp}=crash"))
                    .unwrap_or_else(|e| panic!("seed {seed}: arming {fp}: {e}"));
                // Before the hand-over the state streams only to a node with no copy:
                // the one node of the four that keeps none.
                let copies = backup_copies(&cluster);
                let keeps_none =
                    |n: &NodeId| *n != target && copies.iter().any(|(id, c)| id == n && *c == 0);
                let to = match nodes.iter().find(|n| keeps_none(n)) {
                    Some(n) if !handed_over => *n,
                    _ => *nodes.iter().find(|n| **n != target).unwrap(),
                };
                std::thread::scope(|s| {
                    s.spawn(|| {
                        // Fails when the crash comes before the hand-over: either way
                        // the calls must go on.
                        let _ = cluster.move_proclet(p.id(), to);
                    });
                    for _ in 0..k + 3 {
                        call(&mut answered, &mut failed);
                    }
                });
            }
            Fault::Kill { k } => {
                for _ in 0..k {
                    call(&mut answered, &mut failed);
                }
                kill_node(&cluster, target);
                for _ in 0..3 {
                    call(&mut answered, &mut failed);
                }
            }
        }
    }
    while next.get() < 40 {
        call(&mut answered, &mut failed);
    }
    let x = next.get();
    let log = seen(&p);
    let mut count = std::collections::HashMap::new();
    for v in &log {
        *count.entry(*v).or_insert(0u32) += 1;
    }
    let context = || format!("seed {seed}, schedule {schedule:?}, log {log:?}, failed {failed:?}");
    for v in &answered {
        assert_eq!(
            count.get(v),
            Some(&1),
            "answered call {v} not applied once: {}",
            context()
        );
    }
    for v in &failed {
        assert!(
            count.get(v).is_none_or(|c| *c <= 1),
            "failed call {v} applied twice: {}",
            context()
        );
    }
    assert!(log.iter().all(|v| *v >= 1 && *v <= x), "{}", context());
    // Calls are answered in order on one proclet: the log is in call order.
    assert!(log.windows(2).all(|w| w[0] < w[1]), "{}", context());
}

/// The seeded failure test (`GRANULE_REPLICATION_SEED=N` runs seed N,
/// `GRANULE_REPLICATION_RUNS=K` runs K seeds from it, for soak runs).
#[test]
fn ending_copies_at_seeded_steps_loses_and_repeats_no_call() {
    let first: u64 = std::env::var("GRANULE_REPLICATION_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261129);
    let runs: u64 = std::env::var("GRANULE_REPLICATION_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    for seed in first..first + runs {
        eprintln!("replication seed {seed}");
        bounded(LIMIT, move || run_seed(seed));
    }
}

/// A primary dies after one backup applied a call and before the other got it (the
/// other's transport drops `Apply` frames meanwhile). Whichever backup takes over, the
/// one that is behind — it lacks the call, or it applied it under the old epoch while
/// the new primary had not — is sent the whole state, and every copy agrees again.
#[test]
fn a_primary_that_dies_between_its_backups_leaves_them_consistent() {
    use granule::faults::{FaultAction, FaultRule, FaultRules};
    bounded(LIMIT, || {
        let (cluster, _nodes) = cluster(4, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .replicas(3)
            .create((), |()| Log::default())
            .unwrap();
        for x in 1..=3 {
            append(&p, x).unwrap();
        }
        let primary = p.location().unwrap();
        // The backup with the higher id: the controller promotes the first backup it
        // placed, which with equal room is the lower id, so the copy that takes over has
        // the call and the lagging one is brought up to it (if the lagging one takes
        // over instead, it runs the call and the other answers from its record).
        let lagging = backup_copies(&cluster)
            .into_iter()
            .filter(|(n, c)| *c == 1 && *n != primary)
            .map(|(n, _)| n)
            .max()
            .expect("a backup");
        let drop_applies =
            FaultRules::seeded(1).rule(FaultRule::new(FaultAction::Drop).incoming().kind("Apply"));
        cluster.faults().filter(lagging, &drop_applies).unwrap();
        // Call 4 reaches the other backup and is held by the primary, waiting for the
        // lagging one; then the primary dies.
        let caller = {
            let p = p.clone();
            std::thread::spawn(move || append(&p, 4))
        };
        std::thread::sleep(Duration::from_millis(300));
        kill_node(&cluster, primary);
        let r = caller.join().unwrap();
        cluster
            .faults()
            .filter(lagging, &FaultRules::seeded(1))
            .unwrap();
        for x in 5..=10 {
            append(&p, x).unwrap();
        }
        let want: Vec<u64> = (1..=10).filter(|x| *x != 4 || r.is_ok()).collect();
        assert_eq!(seen(&p), want, "the call caught in the failure: {r:?}");
        // Every copy has the same calls: end the new primary, and the last copy serves
        // them all.
        let second = p.location().unwrap();
        assert_ne!(second, primary);
        kill_node(&cluster, second);
        append(&p, 11).unwrap();
        let mut want = want;
        want.push(11);
        assert_eq!(seen(&p), want);
    });
}

/// The state of a replicated proclet whose calls reach outside it.
#[derive(Serialize, Deserialize)]
struct Front {
    /// An unreplicated proclet every call appends to: a call repeated by a backup would
    /// show here twice.
    sink: Proclet<Log>,
    /// Proclets the calls created (a backup must keep the primary's, not make its own),
    /// on the sink's node, which no test kills.
    made: Vec<Proclet<u64>>,
    /// What each call saw of the runtime.
    saw: Vec<(u64, usize, Option<NodeId>)>,
}

/// Append `x` to the sink, create a proclet holding `x`, hit a failpoint, ask where
/// this runs: everything a backup must replay, not repeat.
fn reach_out(p: &Proclet<Front>, x: u64) -> Result<(usize, Option<NodeId>), CallError> {
    p.run(x, |f: &mut Front, x: u64| {
        let n = append(&f.sink, x).expect("the sink");
        let home = f.sink.location().expect("the sink's node");
        let made = Proclet::builder(Kind::Memory)
            .on(home)
            .create(x, |x: u64| x)
            .expect("a new proclet");
        f.made.push(made);
        granule::faults::hit_blocking("user.in_closure").expect("the failpoint");
        let here = granule::here();
        f.saw.push((x, n, here));
        (n, here)
    })
}

#[test]
fn what_a_replicated_call_does_outside_its_state_happens_once_and_survives_a_failover() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(3, "cpu=1,mem=256MiB");
        // The sink lives on the node that neither copy of the front uses.
        let sink = Proclet::builder(Kind::Memory)
            .on(nodes[2])
            .create((), |()| Log::default())
            .unwrap();
        let front = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .replicas(2)
            .create(sink.clone(), |sink: Proclet<Log>| Front {
                sink,
                made: Vec::new(),
                saw: Vec::new(),
            })
            .unwrap();
        for x in 0..10 {
            assert_eq!(
                reach_out(&front, x).unwrap(),
                (x as usize + 1, Some(nodes[0]))
            );
        }
        // Each call reached the sink once: the backup replayed, it did not call again.
        assert_eq!(seen(&sink), (0..10).collect::<Vec<u64>>());
        let line = divergences(&cluster, nodes[0]);
        assert!(line.ends_with(" 0"), "{line}");

        // The primary dies in the middle of the next call, after it reached the sink and
        // before its backup heard of the call. The caller's retry runs it on the new
        // primary, whose call to the sink carries the same id as the dead one's...
        cluster
            .faults()
            .failpoints(nodes[0], "user.in_closure=crash")
            .unwrap();
        let (n, here) = reach_out(&front, 10).unwrap();
        assert_ne!(here, Some(nodes[0]));
        // ...but the sink is not replicated, so it has no record of answered calls:
        // it ran the call again (documented: effects are exactly once toward replicated
        // callees).
        assert_eq!(n, 12);
        // The promoted backup kept the primary's proclets and answers, not its own.
        let (made, saw) = front
            .run_ref((), |f: &Front, ()| (f.made.clone(), f.saw.clone()))
            .unwrap();
        assert_eq!(made.len(), 11);
        for (x, m) in made.iter().enumerate() {
            assert_eq!(m.run_ref((), |v: &u64, ()| *v).unwrap(), x as u64);
        }
        let want: Vec<(u64, usize, Option<NodeId>)> = (0..10)
            .map(|x| (x, x as usize + 1, Some(nodes[0])))
            .chain(std::iter::once((10, 12, here)))
            .collect();
        assert_eq!(saw, want);
    });
}

#[test]
fn a_retried_call_does_not_repeat_its_call_to_a_replicated_proclet() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(3, "cpu=1,mem=256MiB");
        // A replicated sink whose primary is not on the front's primary's node.
        let sink = Proclet::builder(Kind::Memory)
            .on(nodes[1])
            .replicas(2)
            .create((), |()| Log::default())
            .unwrap();
        let front = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .replicas(2)
            .create(sink.clone(), |sink: Proclet<Log>| Front {
                sink,
                made: Vec::new(),
                saw: Vec::new(),
            })
            .unwrap();
        reach_out(&front, 0).unwrap();
        // The front's primary dies after its call reached the sink, before its backup
        // heard of it; the retry's call to the sink carries the same id, and the sink
        // answers it from its record instead of appending again.
        cluster
            .faults()
            .failpoints(nodes[0], "user.in_closure=crash")
            .unwrap();
        let (n, _) = reach_out(&front, 1).unwrap();
        assert_eq!(n, 2);
        assert_eq!(seen(&sink), vec![0, 1]);
        assert_eq!(reach_out(&front, 2).unwrap().0, 3);
        assert_eq!(seen(&sink), vec![0, 1, 2]);
    });
}

/// The node holding the one backup copy of a proclet with two copies (from `/metrics`),
/// if exactly one node other than `primary` reports one.
fn backup_node_now(cluster: &granule::Cluster, primary: NodeId) -> Option<NodeId> {
    let kept: Vec<NodeId> = backup_copies(cluster)
        .into_iter()
        .filter(|(id, n)| *n == 1 && *id != primary)
        .map(|(id, _)| id)
        .collect();
    (kept.len() == 1).then(|| kept[0])
}

/// The node holding the one backup copy of a proclet with two copies (from `/metrics`),
/// once exactly one node other than `primary` reports one.
fn backup_node(cluster: &granule::Cluster, primary: NodeId) -> NodeId {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let kept: Vec<NodeId> = backup_copies(cluster)
            .into_iter()
            .filter(|(id, n)| *n == 1 && *id != primary)
            .map(|(id, _)| id)
            .collect();
        if kept.len() == 1 {
            return kept[0];
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no single backup: {:?}",
            backup_copies(cluster)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// On a cluster of three or more nodes: a proclet with two copies, its primary on the
/// first node, that took calls 0..10; the node keeping its backup, and another node.
fn two_copies_with_ten_calls(
    cluster: &granule::Cluster,
    nodes: &[NodeId],
) -> (Proclet<Log>, NodeId, NodeId) {
    let p = Proclet::builder(Kind::Memory)
        .on(nodes[0])
        .replicas(2)
        .create((), |()| Log::default())
        .unwrap();
    for x in 0..10 {
        append(&p, x).unwrap();
    }
    let backup = backup_node(cluster, nodes[0]);
    let other = *nodes
        .iter()
        .find(|n| **n != nodes[0] && **n != backup)
        .unwrap();
    (p, backup, other)
}

#[test]
fn a_replicated_proclet_moves_with_its_copies_while_it_is_called() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(3, "cpu=1,mem=256MiB");
        let (p, backup, other) = two_copies_with_ten_calls(&cluster, &nodes);
        // To a node with no copy: the state streams there, the old primary lets go.
        cluster.move_proclet(p.id(), other).unwrap();
        assert_eq!(p.location().unwrap(), other);
        assert_eq!(backup_node(&cluster, other), backup);
        // To the backup's node: the two swap roles, nothing streams.
        let stats = cluster.move_proclet(p.id(), backup).unwrap();
        assert_eq!(stats.bytes, 0);
        assert_eq!(p.location().unwrap(), backup);
        assert_eq!(backup_node(&cluster, backup), other);
        // Moves while a thread calls: every call applied once, in order.
        let caller = {
            let p = p.clone();
            std::thread::spawn(move || {
                for x in 10..400 {
                    assert_eq!(append(&p, x).unwrap(), x as usize + 1, "call {x}");
                }
            })
        };
        for to in [nodes[0], other, backup, nodes[0]] {
            cluster.move_proclet(p.id(), to).unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        caller.join().unwrap();
        assert_eq!(seen(&p), (0..400).collect::<Vec<u64>>());
        // Still two copies: killing the primary's node loses nothing.
        let primary = p.location().unwrap();
        let backup = backup_node(&cluster, primary);
        kill_node(&cluster, primary);
        assert_eq!(append(&p, 400).unwrap(), 401);
        assert_eq!(p.location().unwrap(), backup);
        assert_eq!(seen(&p), (0..401).collect::<Vec<u64>>());
    });
}

#[test]
fn a_primary_killed_in_the_middle_of_a_move_loses_no_call() {
    for point in ["replicate.move.streamed", "replicate.move.handed_over"] {
        bounded(LIMIT, move || {
            let (cluster, nodes) = cluster(3, "cpu=1,mem=256MiB");
            let (p, _, other) = two_copies_with_ten_calls(&cluster, &nodes);
            cluster
                .faults()
                .failpoints(nodes[0], &format!("{point}=crash"))
                .unwrap();
            // The move fails or succeeds, but the proclet goes on with every call.
            let moved = cluster.move_proclet(p.id(), other);
            for x in 10..20 {
                assert_eq!(
                    append(&p, x).unwrap(),
                    x as usize + 1,
                    "{point}: call {x} ({moved:?})"
                );
            }
            let now = p.location().unwrap();
            assert_ne!(now, nodes[0], "{point}");
            if point == "replicate.move.handed_over" {
                assert_eq!(now, other, "{point}");
            }
            assert_eq!(seen(&p), (0..20).collect::<Vec<u64>>(), "{point}");
        });
    }
}

#[test]
fn a_backup_moves_on_request_and_off_a_node_under_memory_pressure() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(3, "cpu=1,mem=256MiB");
        let (p, backup, other) = two_copies_with_ten_calls(&cluster, &nodes);
        // On request: the backup goes to the third node, the old copy is dropped.
        cluster.move_backup(p.id(), backup, other).unwrap();
        assert_eq!(backup_node(&cluster, nodes[0]), other);
        for x in 10..20 {
            append(&p, x).unwrap();
        }
        // A node that keeps a copy already is not taken: the controller picks one.
        cluster.move_backup(p.id(), other, nodes[0]).unwrap();
        assert_eq!(backup_node(&cluster, nodes[0]), backup);
        // The new backup has every call: it takes over when the primary dies.
        kill_node(&cluster, nodes[0]);
        assert_eq!(append(&p, 20).unwrap(), 21);
        assert_eq!(p.location().unwrap(), backup);
        assert_eq!(seen(&p), (0..21).collect::<Vec<u64>>());
        cluster.shutdown();
    });
    bounded(LIMIT, || {
        // Under memory pressure the node's policy moves the backup it keeps.
        let c = granule::Cluster::builder()
            .nodes("cpu=1,mem=256MiB;cpu=1,mem=256MiB;cpu=1,mem=256MiB")
            .expect("node specs")
            .shed(true)
            .failure_timeout(Duration::from_millis(1000))
            .start()
            .expect("cluster starts");
        let nodes = c.worker_nodes().unwrap();
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .replicas(2)
            .create(8192usize, |n: usize| Log {
                seen: (0..n as u64).collect(),
            })
            .unwrap();
        let backup = backup_node(&c, nodes[0]);
        // Ballast that cannot move fills the backup's node.
        let _ballast = Proclet::builder(Kind::Memory)
            .on(backup)
            .pinned()
            .create(210usize << 20, |n: usize| vec![1u8; n])
            .unwrap();
        // The node sheds the backup it keeps: its primary streams a new one to the third
        // node (the only one keeping no copy), and stays where it is.
        let third = *nodes
            .iter()
            .find(|n| **n != nodes[0] && **n != backup)
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while backup_node_now(&c, nodes[0]) != Some(third) {
            assert!(
                std::time::Instant::now() < deadline,
                "the backup did not leave node {backup}: {:?}",
                backup_copies(&c)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(p.location().unwrap(), nodes[0]);
        assert_eq!(append(&p, 1).unwrap(), 8193);
        c.shutdown();
    });
}

#[test]
fn a_node_that_dies_while_it_receives_a_new_copy_is_replaced_by_another() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(4, "cpu=1,mem=256MiB");
        let (p, backup, _) = two_copies_with_ten_calls(&cluster, &nodes);
        // Every other node dies as the first chunk of a copy reaches it: the primary's
        // first attempts to restore its backup fail, and it tries again until a node
        // that lives (a replacement the cluster starts) takes the copy.
        for n in &nodes[1..] {
            if *n != backup {
                cluster
                    .faults()
                    .failpoints(*n, "stream.chunk_received=crash")
                    .unwrap();
            }
        }
        kill_node(&cluster, backup);
        // Calls go on at one copy meanwhile.
        for x in 10..20 {
            assert_eq!(append(&p, x).unwrap(), x as usize + 1);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(40);
        let replacement = loop {
            if let Some(b) = backup_node_now(&cluster, nodes[0]) {
                break b;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no new backup: {:?}",
                backup_copies(&cluster)
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(
            !nodes.contains(&replacement),
            "{replacement} was armed to crash"
        );
        for x in 20..30 {
            append(&p, x).unwrap();
        }
        kill_node(&cluster, nodes[0]);
        assert_eq!(append(&p, 30).unwrap(), 31);
        assert_eq!(p.location().unwrap(), replacement);
        assert_eq!(seen(&p), (0..31).collect::<Vec<u64>>());
    });
}
