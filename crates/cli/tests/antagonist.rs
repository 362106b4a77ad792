//! `granule antagonist` against a real cluster whose nodes run in cgroups: the CPU
//! antagonist runs inside the node's cpu group, the memory antagonist's pages are charged
//! to the node's memory group.
//!
//! Skipped, with a printed note, when cgroup v1 is not usable here (not root).

mod common;

use common::{Reaped, GRANULE};
use granule::{Cluster, NodeId};
use granule_host::{paths_of, CgroupPaths, Hierarchy, Reader};
use std::io::{BufRead, BufReader, Lines};
use std::process::{ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// A one-node cluster with cgroups, its node and the node's groups; `None` (after saying
/// why) when cgroups are not usable.
fn cluster_with_groups() -> Option<(Cluster, NodeId, CgroupPaths, Hierarchy)> {
    let h = match Hierarchy::detect() {
        Ok(h) => h,
        Err(e) => {
            eprintln!("skipping: cgroup v1 not usable here ({e})");
            return None;
        }
    };
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=256MiB")
        .unwrap()
        .start()
        .unwrap();
    assert!(
        cluster.cgroups_active(),
        "cgroups are usable, so the cluster uses them"
    );
    let (node, _pid) = cluster.spawned_nodes()[0];
    let paths = cluster
        .nodes()
        .unwrap()
        .into_iter()
        .find(|n| n.id == node)
        .and_then(|n| n.cgroups)
        .expect("the node reports its cgroups");
    Some((cluster, node, paths, h))
}

/// Start `granule antagonist ARGS` with its stdout readable line by line.
fn antagonist(cluster: &Cluster, args: &[&str]) -> (Reaped, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(GRANULE)
        .arg("antagonist")
        .args(args)
        .args(["--controller", cluster.controller_addr()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start granule antagonist");
    let out = child.stdout.take().unwrap();
    (Reaped(child), BufReader::new(out).lines())
}

/// Read lines until one starts with `prefix`; all lines read so far on failure.
fn wait_for(lines: &mut Lines<BufReader<ChildStdout>>, prefix: &str) -> Result<String, String> {
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.map_err(|e| e.to_string())?;
        if line.starts_with(prefix) {
            return Ok(line);
        }
        seen.push_str(&line);
        seen.push('\n');
    }
    Err(seen)
}

/// Wait (bounded) for the antagonist to exit; its exit code, remaining stdout and stderr.
fn finish(mut a: Reaped, lines: Lines<BufReader<ChildStdout>>) -> (Option<i32>, String, String) {
    let t = Instant::now();
    while a.0.try_wait().ok().flatten().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the antagonist did not end"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let mut err = String::new();
    if let Some(mut e) = a.0.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    let code = a.0.wait().ok().and_then(|s| s.code());
    (code, rest.join("\n"), err)
}

#[test]
fn cpu_antagonist_spins_inside_the_nodes_cpu_group() {
    let Some((cluster, node, paths, h)) = cluster_with_groups() else {
        return;
    };
    let reader = Reader::for_paths(&h, &paths).unwrap();
    let periods_before = reader.cpu_stat().unwrap().nr_periods;
    let node_arg = node.to_string();
    let (a, mut lines) = antagonist(
        &cluster,
        &["cpu", "--node", &node_arg, "--threads", "1", "--for", "1s"],
    );
    let pid = a.0.id();
    if let Err(seen) = wait_for(&mut lines, "antagonist: in the cpu cgroup") {
        let (code, _, err) = finish(a, lines);
        panic!("the antagonist did not start ({code:?}): {seen}{err}");
    }
    // While it spins: it is in the node's cpu group, and not in its memory group.
    let inside = paths_of(pid).unwrap_or_default();
    assert_eq!(inside.cpu, paths.cpu, "the antagonist's cpu group");
    assert_ne!(
        inside.memory, paths.memory,
        "the cpu antagonist stays out of memory"
    );
    let (code, out, err) = finish(a, lines);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("done"), "{out}");
    // Its spinning ran under the node's quota: CFS counted enforcement periods.
    let periods = reader.cpu_stat().unwrap().nr_periods - periods_before;
    assert!(
        periods >= 5,
        "only {periods} CFS periods in the node's group"
    );
    cluster.shutdown();
}

#[test]
fn memory_antagonist_is_charged_to_the_nodes_memory_group() {
    let Some((cluster, node, paths, h)) = cluster_with_groups() else {
        return;
    };
    let reader = Reader::for_paths(&h, &paths).unwrap();
    let before = reader.memory_usage().unwrap();
    let node_arg = node.to_string();
    let (a, mut lines) = antagonist(
        &cluster,
        &[
            "memory", "--node", &node_arg, "--rate", "64MiB/s", "--size", "32MiB", "--hold", "3s",
        ],
    );
    let pid = a.0.id();
    if let Err(seen) = wait_for(&mut lines, "holding") {
        let (code, _, err) = finish(a, lines);
        panic!("the antagonist did not allocate ({code:?}): {seen}{err}");
    }
    let during = reader.memory_usage().unwrap();
    let inside = paths_of(pid).unwrap_or_default();
    assert_eq!(inside.memory, paths.memory, "the antagonist's memory group");
    assert_ne!(
        inside.cpu, paths.cpu,
        "the memory antagonist has a cpu group of its own"
    );
    let adj = granule_host::proc::oom_score_adj(pid);
    assert_eq!(adj, Some(1000), "it volunteers for the OOM killer");
    assert!(
        during >= before + (24 << 20),
        "the node's memory.usage_in_bytes went from {before} to {during} only"
    );
    let (code, out, err) = finish(a, lines);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("done"), "{out}");
    cluster.shutdown();
}

#[test]
fn unknown_nodes_are_clear_errors() {
    let Some((cluster, _node, _paths, _h)) = cluster_with_groups() else {
        return;
    };
    let (a, lines) = antagonist(&cluster, &["cpu", "--node", "n999", "--for", "1s"]);
    let (code, _out, err) = finish(a, lines);
    assert_ne!(code, Some(0));
    assert!(err.contains("knows no node n999"), "{err}");
    cluster.shutdown();
}
