//! The `granule` command against real clusters: the identical-binary rule, a standalone
//! controller with hand-started nodes, `status`, and the demo.

mod common;

use common::{start_controller, Reaped, GRANULE};
use granule::{Cluster, Kind, NodeState, Proclet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run `cmd` with its output captured; kill it if it takes longer than `limit`.
/// Returns (exit code, stdout, stderr).
fn run_bounded(cmd: &mut Command, limit: Duration) -> (Option<i32>, String, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start granule");
    let t = Instant::now();
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The separately built `granule` binary tries to join a cluster started by this test
/// binary: it is refused, and says why.
#[test]
fn a_node_from_another_binary_is_refused() {
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=128MiB")
        .unwrap()
        .start()
        .unwrap();
    let (code, _out, err) = run_bounded(
        Command::new(GRANULE).args([
            "node",
            "--controller",
            cluster.controller_addr(),
            "--cpu",
            "1",
            "--mem",
            "128MiB",
        ]),
        Duration::from_secs(20),
    );
    assert_ne!(code, Some(0), "the foreign node must not join: {err}");
    assert!(err.contains("binary mismatch"), "stderr: {err}");
    assert!(
        err.contains("identical"),
        "the error says what to do: {err}"
    );
    // The cluster is unharmed and did not admit it.
    let nodes = cluster.nodes().unwrap();
    assert_eq!(
        nodes.iter().filter(|n| n.state == NodeState::Alive).count(),
        2
    );
    let p = Proclet::create(Kind::Memory, 1u64, |x: u64| x).unwrap();
    assert_eq!(
        p.run(1u64, |s: &mut u64, x: u64| {
            *s += x;
            *s
        })
        .unwrap(),
        2
    );
}

/// `granule status` is a tool: it needs no binary hash and works against any cluster.
#[test]
fn status_lists_the_nodes_of_a_cluster() {
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=128MiB;cpu=1,mem=128MiB")
        .unwrap()
        .start()
        .unwrap();
    let (code, out, err) = run_bounded(
        Command::new(GRANULE).args(["status", "--controller", cluster.controller_addr()]),
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("driver") && out.matches(" node ").count() == 2,
        "{out}"
    );
    // An unreachable controller is a clear error.
    let (code, _out, err) = run_bounded(
        Command::new(GRANULE).args(["status", "--controller", "127.0.0.1:1"]),
        Duration::from_secs(20),
    );
    assert_ne!(code, Some(0));
    assert!(
        err.contains("unreachable") && err.contains("127.0.0.1:1"),
        "{err}"
    );
}

/// Several machines, emulated: a standalone controller, two hand-started nodes, and a
/// driver (the demo) that joins them through GRANULE_CONTROLLER.
#[test]
fn standalone_controller_manual_nodes_and_a_joining_driver() {
    let (_ctl, addr) = start_controller(&["--listen", "127.0.0.1:0"]);
    let nodes: Vec<Reaped> = (0..2)
        .map(|_| {
            Reaped(
                Command::new(GRANULE)
                    .args([
                        "node",
                        "--controller",
                        &addr,
                        "--cpu",
                        "1",
                        "--mem",
                        "256MiB",
                    ])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    // Wait for both to register.
    let t = Instant::now();
    loop {
        let out = Command::new(GRANULE)
            .args(["status", "--controller", &addr])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.matches(" node ").count() == 2 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "nodes did not register: {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, out, err) = run_bounded(
        Command::new(GRANULE)
            .args(["demo", "--seconds", "0.05", "--exit"])
            .env("GRANULE_CONTROLLER", &addr),
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "demo failed: {out}\n{err}");
    assert!(out.contains("Done"), "{out}");
    // The demo's proclets ran on the hand-started nodes (n1 and n2; the driver is n3).
    assert!(
        out.contains("memory proclet on n1") || out.contains("memory proclet on n2"),
        "{out}"
    );
    // The driver ended normally: the controller recorded a departure, not a failure.
    let out = Command::new(GRANULE)
        .args(["status", "--controller", &addr])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("node_left"), "{text}");
    assert!(
        !text.contains("node_down") && !text.contains("DEAD"),
        "{text}"
    );
    // With cgroup v1 usable (root), a hand-started node runs in cgroups of its own,
    // `granule/c<its pid>-<start>-<n>/node0`, with its spec's limits.
    let own_groups = cgroups_usable().then(|| {
        let pid = nodes[0].0.id();
        let paths = granule_host::paths_of(pid).expect("the node runs in cgroups");
        let (mem, cpu) = (
            paths.memory.clone().unwrap_or_default(),
            paths.cpu.clone().unwrap_or_default(),
        );
        assert!(mem.starts_with(&format!("/granule/c{pid}-")), "{paths:?}");
        assert!(mem.ends_with("/node0") && cpu == mem, "{paths:?}");
        let h = granule_host::Hierarchy::default();
        let memory_only = granule_host::CgroupPaths {
            memory: Some(mem.clone()),
            cpu: None,
        };
        let limit = granule_host::Reader::for_paths(&h, &memory_only)
            .and_then(|r| r.memory_limit())
            .unwrap();
        assert_eq!(limit, 256u64 << 20);
        h.group_dir(granule_host::Controller::Memory, &mem).unwrap()
    });
    // Ctrl-C on a hand-started node: it leaves cleanly too.
    let mut nodes = nodes;
    signal(nodes[0].0.id(), "-INT");
    let t = Instant::now();
    let status = loop {
        if let Some(st) = nodes[0].0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the node ignored SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    // ...and removed its cgroups on the way out.
    if let Some(dir) = own_groups {
        let cluster = dir.parent().unwrap().to_path_buf();
        assert!(!cluster.exists(), "{} is left behind", cluster.display());
    }
    let out = Command::new(GRANULE)
        .args(["status", "--controller", &addr])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(text.matches("node_left").count(), 2, "{text}");
    assert!(!text.contains("node_down"), "{text}");
    nodes.clear();
}

/// Whether nodes get real groups here: the very check a node makes (cgroup v1 memory and
/// cpu controllers mounted and writable).
fn cgroups_usable() -> bool {
    granule_host::Hierarchy::detect().is_ok()
}

/// The demo as the README runs it, on the embedded cluster: after its steps it keeps
/// the cluster and the dashboard up, says what to try, and stops cleanly on Ctrl-C.
#[test]
fn demo_runs_on_the_embedded_cluster_and_stays_until_ctrl_c() {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut demo = Reaped(
        Command::new(GRANULE)
            .args(["demo", "--seconds", "0.05"])
            .env_remove("GRANULE_CONTROLLER")
            .env_remove("GRANULE_NODES")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start granule demo"),
    );
    // Its output, line by line, read on a thread so that the test can give up on time.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = demo.0.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut out = String::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while !out.contains("Ctrl-C stops it") || !out.contains("GRANULE_CONTROLLER=") {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                out.push_str(&l);
                out.push('\n');
            }
            Err(_) => panic!("the demo did not reach its waiting point:\n{out}"),
        }
    }
    for needle in [
        "Chained calls",
        "Call rates",
        "moved",
        "panicked",
        "is gone",
    ] {
        assert!(out.contains(needle), "missing '{needle}' in:\n{out}");
    }
    assert!(!out.contains("Done"), "it must not stop by itself:\n{out}");
    // What it says to try works while it waits: the dashboard answers, `status` lists
    // the three nodes.
    let url = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("the dashboard:"))
        .map(|u| u.trim().to_string())
        .unwrap_or_else(|| panic!("no dashboard line:\n{out}"));
    let hostport = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let mut http = std::net::TcpStream::connect(&hostport).expect("the dashboard answers");
    http.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        http,
        "GET / HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut page = String::new();
    let _ = http.read_to_string(&mut page);
    assert!(page.starts_with("HTTP/1.1 200"), "dashboard: {page:.200}");
    let ctl = out
        .lines()
        .find_map(|l| l.split("GRANULE_CONTROLLER=").nth(1))
        .map(|a| a.trim().to_string())
        .unwrap_or_else(|| panic!("no controller address:\n{out}"));
    std::thread::sleep(Duration::from_secs(2));
    let status = Command::new(GRANULE)
        .args(["status", "--controller", &ctl])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    assert!(status.status.success(), "status failed: {text}");
    assert_eq!(text.matches(" node ").count(), 3, "{text}");
    // Ctrl-C: it stops the cluster and exits normally.
    interrupt(demo.0.id());
    let t = Instant::now();
    let code = loop {
        if let Some(st) = demo.0.try_wait().unwrap() {
            break st.code();
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the demo did not stop on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    reader.join().unwrap();
    out.extend(rx.try_iter().map(|l| l + "\n"));
    let mut err = String::new();
    if let Some(mut e) = demo.0.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    assert_eq!(code, Some(0), "demo failed: {out}\n{err}");
    assert!(out.contains("Interrupted: stopping the cluster"), "{out}");
    assert!(out.contains("Done"), "{out}");
    // `--exit` stops right after the steps.
    let (code, out, err) = run_bounded(
        Command::new(GRANULE)
            .args(["demo", "--seconds", "0.01", "--exit"])
            .env_remove("GRANULE_CONTROLLER")
            .env_remove("GRANULE_NODES"),
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "demo --exit failed: {out}\n{err}");
    assert!(out.contains("Done") && !out.contains("Ctrl-C"), "{out}");
}

/// SIGINT, as a terminal's Ctrl-C sends it.
fn interrupt(pid: u32) {
    let ok = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -INT {pid}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = Command::new(GRANULE)
        .args(["bench", "nosuch", "--quick"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    // The benchmarks moved to `granule-bench` (its own tests check its errors).
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "granule: error: the benchmarks moved to their own binary: run granule-bench nosuch --quick"
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(GRANULE)
        .args(["demo", "--exit"])
        .env("GRANULE_NODES", "cpu=1,mem=lots")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("GRANULE_NODES") && err.contains("lots"),
        "{err}"
    );
    let out = Command::new(GRANULE)
        .args(["node", "--controller", "127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unreachable"));
}

/// `granule status` and `granule top` show the cluster's nodes, proclets and events:
/// here nodes joining and one killed (the controller records both; node-reported events
/// such as migrations travel the same way, with heartbeats).
#[test]
fn status_and_top_show_nodes_proclets_and_recent_events() {
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=128MiB;cpu=1,mem=128MiB")
        .unwrap()
        .shed(false)
        .failure_timeout(Duration::from_millis(500))
        // The node killed below stays dead: the counts checked are those of a cluster
        // without a replacement.
        .set("cluster.replace_dead", "off")
        .unwrap()
        .start()
        .unwrap();
    let workers = cluster.worker_nodes().unwrap();
    let _p = Proclet::builder(Kind::Memory)
        .on(workers[0])
        .create(4096usize, |n: usize| vec![1u8; n])
        .unwrap();
    cluster.kill_node(workers[1]).unwrap();
    let addr = cluster.controller_addr().to_string();
    let t = Instant::now();
    let status = loop {
        let (code, out, err) = run_bounded(
            Command::new(GRANULE).args(["status", "--controller", &addr]),
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(0), "{err}");
        if out.contains("node_down") && out.contains("0/1/0") {
            break out;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "no node_down event: {out}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.contains("recent events"), "{status}");
    assert_eq!(status.matches("node_joined").count(), 3, "{status}");
    let line = status.lines().find(|l| l.contains("node_down")).unwrap();
    assert!(line.contains(&workers[1].to_string()), "{line}");
    // Not a terminal here: plain snapshots, as many as asked for.
    let (code, out, err) = run_bounded(
        Command::new(GRANULE)
            .args(["top", "--interval", "100ms", "--iterations", "3"])
            .env("GRANULE_CONTROLLER", &addr),
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.matches("granule top — controller").count(), 3, "{out}");
    // A dead node stays listed, marked, for `cluster.forget_dead_after` (60 s); its death
    // is in the events too.
    assert!(out.contains("2 of 3 nodes alive"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with(&workers[1].to_string()) && l.contains("DEAD")),
        "{out}"
    );
    assert!(
        out.contains("proclets: 0 compute, 1 memory, 0 hybrid"),
        "{out}"
    );
    assert!(
        out.contains("node_down") && out.contains("node_joined"),
        "{out}"
    );
    let row = out
        .lines()
        .find(|l| l.starts_with(&workers[0].to_string()))
        .unwrap();
    // Memory used is 0 until the node's first usage report; the limit is there at once.
    assert!(row.contains("[") && row.contains("/128.0 MiB"), "{row}");
}

/// Send a signal with kill(1), as the other tests here do.
fn signal(pid: u32, sig: &str) {
    let sent = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill {sig} {pid}");
}

/// A node as a controller lists it: (id, pid, state).
type Listed = (granule::NodeId, u32, NodeState);

/// The nodes a controller lists, asked as `granule status` does.
fn listed_nodes(controller: &str) -> Vec<Listed> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = granule_controller::ControllerClient::connect_tool(controller, "cli test")
            .await
            .unwrap();
        c.list_nodes().await.unwrap()
    })
    .into_iter()
    .filter(|n| n.role == granule_wire::Role::Node)
    .map(|n| (n.id, n.pid, n.state))
    .collect()
}

/// A hand-started node frozen past the failure timeout is declared dead; when it thaws
/// it rejoins (`cluster.rejoin`, on by default) as a new node: the same process (it
/// re-executed itself), a new id, alive — the cluster has its size again.
#[test]
fn a_hand_started_node_declared_dead_rejoins_as_a_new_node_when_it_wakes_up() {
    let (_ctl, addr) = start_controller(&[
        "--listen",
        "127.0.0.1:0",
        "--failure-timeout",
        "500ms",
        "--heartbeat",
        "100ms",
        "--dashboard",
        "off",
    ]);
    let node = Reaped(
        Command::new(GRANULE)
            .args(["node", "--controller", &addr, "--mem", "128MiB"])
            .env("GRANULE_FAILURE_TIMEOUT", "500ms")
            .env("GRANULE_HEARTBEAT", "100ms")
            .env("GRANULE_CGROUPS", "off")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = node.0.id();
    let wait = |what: &str, cond: &dyn Fn(&[Listed]) -> bool| {
        let t = Instant::now();
        loop {
            let nodes = listed_nodes(&addr);
            if cond(&nodes) {
                return nodes;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "{what}: {nodes:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let first = wait("the node registers", &|n| {
        n.iter()
            .any(|(_, p, s)| *p == pid && *s == NodeState::Alive)
    })
    .into_iter()
    .find(|(_, p, _)| *p == pid)
    .unwrap()
    .0;
    signal(pid, "-STOP");
    wait("declared dead", &|n| {
        !n.iter()
            .any(|(id, _, s)| *id == first && *s == NodeState::Alive)
    });
    signal(pid, "-CONT");
    let nodes = wait("the woken node rejoins", &|n| {
        n.iter()
            .any(|(id, p, s)| *p == pid && *id != first && *s == NodeState::Alive)
    });
    let alive: Vec<_> = nodes
        .iter()
        .filter(|(_, _, s)| *s == NodeState::Alive)
        .collect();
    assert_eq!(alive.len(), 1, "{nodes:?}");
    drop(node);
}
