//! Embedded node processes under real cgroup v1 limits: each node runs in its own memory
//! and cpu group with its spec as the limits, the controller knows the groups, and the
//! groups go away with the cluster — also those of a driver that was killed.
//!
//! Every test here passes with a printed note when cgroup v1 is not usable (not root, no
//! v1 controllers), which is also what a cluster then does: it runs without limits.

mod common;

use common::{bounded, cgroups_usable, process_gone};
use granule::config::CgroupsMode;
use granule::{Cluster, NodeId};
use granule_host::{paths_of, CgroupPaths, ClusterGroups, Controller, Hierarchy, Reader};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(60);

/// The cluster directories (in both controllers) a node's group lives in.
fn cluster_dirs(h: &Hierarchy, paths: &CgroupPaths) -> Vec<PathBuf> {
    [
        (Controller::Memory, &paths.memory),
        (Controller::Cpu, &paths.cpu),
    ]
    .into_iter()
    .map(|(c, rel)| {
        let rel = rel.as_deref().expect("a group for both controllers");
        let parent = rel.rsplit_once('/').expect("a nested group").0;
        h.group_dir(c, parent).expect("a valid path")
    })
    .collect()
}

#[test]
fn nodes_run_in_their_groups_with_their_specs_as_limits() {
    let Some(h) = cgroups_usable() else { return };
    // A group left by an earlier driver: this test's pid, but another start time. Made
    // with the API a driver uses, then forgotten as a driver killed with SIGKILL would
    // forget it (its drop would remove it).
    let me = std::process::id();
    let stale = ClusterGroups::named(&h, format!("c{me}-1-0")).unwrap();
    stale.node("node0", 1.0, 64 << 20).unwrap();
    let planted: Vec<PathBuf> = Controller::ALL.iter().map(|&c| stale.dir(c)).collect();
    std::mem::forget(stale);
    let h2 = h.clone();
    bounded(LIMIT, move || {
        let h = h2;
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=256MiB;cpu=0.5,mem=128MiB")
            .unwrap()
            .start()
            .unwrap();
        assert!(cluster.cgroups_active());
        for d in &planted {
            assert!(!d.exists(), "stale {} was not removed", d.display());
        }
        let specs = [(1.0, 256u64 << 20), (0.5, 128u64 << 20)];
        let spawned = cluster.spawned_nodes();
        assert_eq!(spawned.len(), 2);
        let listed = cluster.nodes().unwrap();
        let mut dirs = Vec::new();
        for ((node, pid), (cores, mem)) in spawned.iter().zip(specs) {
            let paths = paths_of(*pid).expect("the node runs in cgroups");
            for rel in [&paths.memory, &paths.cpu] {
                let rel = rel.as_deref().unwrap_or_default();
                assert!(
                    rel.starts_with(&format!("/granule/c{me}-")),
                    "{node} runs in {rel}"
                );
            }
            let r = Reader::for_paths(&h, &paths).unwrap();
            assert_eq!(r.memory_limit().unwrap(), mem, "{node}");
            assert_eq!(r.cfs_quota_cores().unwrap(), Some(cores), "{node}");
            assert!(r.memory_usage().unwrap() > 0, "{node} is charged");
            let info = listed.iter().find(|n| n.id == *node).unwrap();
            assert_eq!(info.cgroups.as_ref(), Some(&paths), "{node} as listed");
            dirs.extend(cluster_dirs(&h, &paths));
        }
        cluster.shutdown();
        for d in dirs {
            assert!(!d.exists(), "{} is left after shutdown", d.display());
        }
    });
}

#[test]
fn with_cgroups_off_nothing_is_created() {
    let Some(_h) = cgroups_usable() else { return };
    bounded(LIMIT, || {
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=128MiB")
            .unwrap()
            .cgroups(CgroupsMode::Off)
            .start()
            .unwrap();
        assert!(!cluster.cgroups_active());
        let spawned: Vec<(NodeId, u32)> = cluster.spawned_nodes();
        let listed = cluster.nodes().unwrap();
        for (node, pid) in spawned {
            // It may sit in whatever groups the driver was started in, not in ours.
            let paths = paths_of(pid).unwrap_or_default();
            let info = listed.iter().find(|n| n.id == node).unwrap();
            for rel in [&paths.memory, &paths.cpu]
                .into_iter()
                .chain(info.cgroups.iter().flat_map(|c| [&c.memory, &c.cpu]))
            {
                let rel = rel.as_deref().unwrap_or("/");
                assert!(!rel.starts_with("/granule/"), "{node} runs in {rel}");
            }
        }
        cluster.shutdown();
    });
}

/// Re-run of this binary by the test below: a driver that prints where its node runs and
/// then waits to be killed.
#[test]
fn driver_helper() {
    if std::env::var_os("GRANULE_TEST_CGROUP_DRIVER").is_none() {
        return; // only meaningful when re-run by the test below
    }
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=128MiB")
        .unwrap()
        .start()
        .unwrap();
    let (_, pid) = cluster.spawned_nodes()[0];
    let mem = paths_of(pid).and_then(|p| p.memory).unwrap_or_default();
    println!("NODE {pid} {mem}");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    // Killed by the test long before this; the bound only matters if that test died.
    std::thread::sleep(LIMIT);
}

/// A driver killed with SIGKILL cannot remove its groups; the next cluster started on
/// the machine does.
#[test]
fn groups_of_a_killed_driver_are_removed_by_the_next_cluster() {
    let Some(h) = cgroups_usable() else { return };
    let mut driver = Command::new(std::env::current_exe().unwrap())
        .args([
            "driver_helper",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("GRANULE_TEST_CGROUP_DRIVER", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The harness prints the test's name on the same line first, so look inside lines;
    // read on a thread so a helper that never reports cannot hang this test.
    let out = driver.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let found = BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.split_once("NODE ").map(|(_, rest)| rest.to_string()));
        let _ = tx.send(found);
    });
    let line = rx.recv_timeout(LIMIT).ok().flatten();
    let _ = driver.kill();
    let _ = driver.wait();
    let line = line.expect("the helper driver started a cluster and reported its node");
    let mut parts = line.split_whitespace();
    let node_pid: u32 = parts.next().unwrap().parse().unwrap();
    let rel = parts
        .next()
        .expect("the helper's node runs in a memory group");
    let cluster_rel = rel.rsplit_once('/').unwrap().0.to_string();
    let stale: Vec<PathBuf> = Controller::ALL
        .iter()
        .map(|&c| h.group_dir(c, &cluster_rel).unwrap())
        .collect();
    // Its node leaves on its own (its lifeline broke); its groups stay behind (unless a
    // cluster another test starts meanwhile already removed them: that is fine too).
    let t = Instant::now();
    while !process_gone(node_pid) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the node outlived its driver"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    bounded(LIMIT, move || {
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=128MiB")
            .unwrap()
            .start()
            .unwrap();
        for d in &stale {
            assert!(!d.exists(), "stale {} was not removed", d.display());
        }
        cluster.shutdown();
    });
}
