//! Nodes that die or are declared dead, on real clusters: the driver reaps their
//! processes at once, kills the ones declared dead that still run, and replaces them
//! (`cluster.replace_dead`), so the cluster returns to its configured size; without a
//! replacing driver, a node declared dead rejoins as a new node when it wakes up
//! (`cluster.rejoin`), or exits. A dead node stays in the node list for
//! `cluster.forget_dead_after`, then the list forgets it while the controller still
//! answers for the proclets it held.

mod common;

use common::bounded;
use granule::{CallError, Cluster, Kind, NodeId, NodeState, Proclet};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(90);
/// As the other multi-process tests: long enough that a node starved of CPU by the
/// suite's other clusters is not declared dead by mistake.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(1);

fn cluster(n: usize, replace: bool, rejoin: bool) -> Cluster {
    let specs = vec!["cpu=1,mem=256MiB"; n].join(";");
    Cluster::builder()
        .nodes(&specs)
        .unwrap()
        .shed(false)
        .failure_timeout(FAILURE_TIMEOUT)
        .set("cluster.replace_dead", if replace { "on" } else { "off" })
        .unwrap()
        .set("cluster.rejoin", if rejoin { "on" } else { "off" })
        .unwrap()
        .start()
        .unwrap()
}

/// The process's state letter, or `None` once it is gone and reaped. A zombie shows as
/// `Some('Z')`: the test below needs to tell "reaped" from "dead but not collected".
fn state(pid: u32) -> Option<char> {
    granule_host::proc::process_state(pid)
}

/// Wait (bounded) until `cond` holds; fail with `what` otherwise.
fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

fn alive(cluster: &Cluster, node: NodeId) -> bool {
    cluster
        .nodes()
        .unwrap()
        .iter()
        .any(|n| n.id == node && n.state == NodeState::Alive)
}

/// A killed node process is collected at once (no zombie), and a replacement of the same
/// spec joins as a new node: the cluster is back to its configured size and new
/// proclets can be placed on the newcomer.
#[test]
fn a_killed_node_is_reaped_and_replaced() {
    bounded(LIMIT, || {
        let cluster = cluster(2, true, true);
        let before = cluster.spawned_nodes();
        let (victim, victim_pid) = before[0];
        cluster.kill_node(victim).unwrap();
        let t = Instant::now();
        let workers = cluster.wait_for_nodes(Duration::from_secs(30)).unwrap();
        let took = t.elapsed();
        assert_eq!(workers.len(), 2, "{workers:?}");
        assert!(!workers.contains(&victim), "{workers:?}");
        assert!(cluster.replacements() >= 1);
        // About one failure timeout to be declared (the kill closes its sockets, so
        // sooner) plus a process start.
        assert!(took < Duration::from_secs(15), "replaced after {took:?}");
        assert_eq!(state(victim_pid), None, "the killed process was not reaped");
        let after = cluster.spawned_nodes();
        let newcomer = after
            .iter()
            .find(|(n, _)| !before.iter().any(|(b, _)| b == n));
        let &(newcomer, pid) = newcomer.expect("a new node among the spawned ones");
        assert_ne!(pid, victim_pid);
        // The newcomer has the slot's spec and takes proclets.
        let info = cluster.nodes().unwrap();
        let spec = info.iter().find(|n| n.id == newcomer).unwrap().spec;
        assert_eq!(spec.mem_bytes, 256 << 20);
        let p = Proclet::builder(Kind::Memory)
            .on(newcomer)
            .create(7u64, |x: u64| x)
            .unwrap();
        assert_eq!(p.run_ref((), |x: &u64, ()| *x).unwrap(), 7);
    });
}

/// A node process frozen (SIGSTOP) for longer than the failure timeout is declared dead;
/// the driver kills it (it would wake up as a node nobody knows) and replaces it. The
/// frozen process is gone and reaped, and the cluster is back to its size.
#[test]
fn a_frozen_node_declared_dead_is_fenced_and_replaced() {
    bounded(LIMIT, || {
        let cluster = cluster(2, true, true);
        let (victim, pid) = cluster.spawned_nodes()[1];
        kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
        wait_until(Duration::from_secs(20), "declared dead", || {
            !alive(&cluster, victim)
        });
        wait_until(Duration::from_secs(20), "the frozen process reaped", || {
            state(pid).is_none()
        });
        let workers = cluster.wait_for_nodes(Duration::from_secs(30)).unwrap();
        assert_eq!(workers.len(), 2);
        assert!(!workers.contains(&victim));
        assert!(cluster.replacements() >= 1);
    });
}

/// Without replacement, a node declared dead while frozen rejoins when it wakes up: the
/// same process, a new node id, no proclets; its old proclets stay lost (calls to them
/// fail), and the cluster has its size again.
#[test]
fn a_node_declared_dead_that_wakes_up_rejoins_as_a_new_node() {
    bounded(LIMIT, || {
        let cluster = cluster(2, false, true);
        let (victim, pid) = cluster.spawned_nodes()[0];
        let lost = Proclet::builder(Kind::Memory)
            .on(victim)
            .create(1u64, |x: u64| x)
            .unwrap();
        kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
        wait_until(Duration::from_secs(20), "declared dead", || {
            !alive(&cluster, victim)
        });
        kill(Pid::from_raw(pid as i32), Signal::SIGCONT).unwrap();
        let workers = cluster.wait_for_nodes(Duration::from_secs(30)).unwrap();
        assert_eq!(workers.len(), 2);
        assert!(!workers.contains(&victim));
        let rejoined = cluster
            .spawned_nodes()
            .into_iter()
            .find(|(_, p)| *p == pid)
            .expect("the woken process registered again");
        assert_ne!(rejoined.0, victim);
        assert_eq!(cluster.replacements(), 0, "rejoined, not replaced");
        let r = lost.run_ref((), |x: &u64, ()| *x);
        assert!(r.is_err(), "a proclet of the dead node came back: {r:?}");
        let p = Proclet::builder(Kind::Memory)
            .on(rejoined.0)
            .create(5u64, |x: u64| x)
            .unwrap();
        assert_eq!(p.run_ref((), |x: &u64, ()| *x).unwrap(), 5);
    });
}

/// With neither replacement nor rejoining, a node declared dead leaves when it wakes up
/// and a killed one stays dead; both processes are reaped at once instead of lingering
/// as zombies until the driver exits.
#[test]
fn dead_node_processes_are_reaped_without_replacement() {
    bounded(LIMIT, || {
        let cluster = cluster(2, false, false);
        let spawned = cluster.spawned_nodes();
        let (frozen, frozen_pid) = spawned[0];
        let (killed, killed_pid) = spawned[1];
        kill(Pid::from_raw(frozen_pid as i32), Signal::SIGSTOP).unwrap();
        // Killed from outside the driver (as the OOM killer would), not by kill_node,
        // which collects its own victim.
        kill(Pid::from_raw(killed_pid as i32), Signal::SIGKILL).unwrap();
        wait_until(Duration::from_secs(20), "both declared dead", || {
            !alive(&cluster, frozen) && !alive(&cluster, killed)
        });
        kill(Pid::from_raw(frozen_pid as i32), Signal::SIGCONT).unwrap();
        for pid in [killed_pid, frozen_pid] {
            wait_until(
                Duration::from_secs(20),
                &format!("process {pid} reaped"),
                || state(pid).is_none(),
            );
        }
        assert!(cluster.spawned_nodes().is_empty());
        assert_eq!(cluster.replacements(), 0);
        assert!(cluster.worker_nodes().unwrap().is_empty());
    });
}

/// A killed node is listed as dead, for `cluster.forget_dead_after` after it was declared
/// dead, and then no more (the list does not keep the dead for ever); calls to the
/// proclet it held still fail as unreachable, naming it — the controller keeps what it
/// needs to answer for it.
#[test]
fn a_dead_node_is_listed_for_a_while_then_forgotten() {
    bounded(LIMIT, || {
        const LISTED: Duration = Duration::from_secs(5);
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=256MiB;cpu=1,mem=256MiB")
            .unwrap()
            .shed(false)
            .failure_timeout(FAILURE_TIMEOUT)
            .set("cluster.replace_dead", "off")
            .unwrap()
            .set("cluster.forget_dead_after", "5s")
            .unwrap()
            .start()
            .unwrap();
        let (victim, _) = cluster.spawned_nodes()[0];
        let lost = Proclet::builder(Kind::Memory)
            .on(victim)
            .create(1u64, |x: u64| x)
            .unwrap();
        let listed_as = |c: &Cluster| {
            c.nodes()
                .unwrap()
                .into_iter()
                .find(|n| n.id == victim)
                .map(|n| n.state)
        };
        let killed = Instant::now();
        cluster.kill_node(victim).unwrap();
        wait_until(Duration::from_secs(20), "declared dead", || {
            !alive(&cluster, victim)
        });
        assert_eq!(listed_as(&cluster), Some(NodeState::Dead), "listed as dead");
        wait_until(Duration::from_secs(30), "forgotten by the list", || {
            listed_as(&cluster).is_none()
        });
        // Declared dead after the kill, and listed for LISTED from then on.
        assert!(
            killed.elapsed() >= LISTED,
            "forgotten {:?} after the kill",
            killed.elapsed()
        );
        let r = lost.run_ref((), |x: &u64, ()| *x);
        assert!(
            matches!(r, Err(CallError::NodeUnreachable { node, .. }) if node == victim),
            "{r:?}"
        );
        assert_eq!(cluster.worker_nodes().unwrap().len(), 1);
    });
}
