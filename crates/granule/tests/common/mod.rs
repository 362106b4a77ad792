//! Helpers shared by the multi-process integration tests.
#![allow(dead_code)]

use granule::{Cluster, NodeId};
use std::time::Duration;

/// Run `f` on its own thread and fail (instead of hanging) if it takes longer than
/// `limit`. The cluster must be started inside `f`: a cluster belongs to the thread that
/// started it.
pub fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => {
            let _ = h.join();
            v
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => panic!("test body ended without a result"),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("test exceeded {limit:?}: probable hang or deadlock")
        }
    }
}

/// A cluster with `n` node processes of the given spec (plus the driver). Nodes do not
/// shed proclets on their own here (tests that place and move proclets by hand must not
/// race the pressure policy); the tests of shedding build their own clusters. They take
/// fault orders (`Cluster::faults`).
pub fn cluster(n: usize, spec: &str) -> (Cluster, Vec<NodeId>) {
    let specs = vec![spec; n].join(";");
    let c = Cluster::builder()
        .nodes(&specs)
        .expect("node specs")
        .shed(false)
        .faults(true)
        .failure_timeout(Duration::from_millis(1000))
        .start()
        .expect("cluster starts");
    let workers = c.worker_nodes().expect("nodes");
    assert_eq!(workers.len(), n);
    (c, workers)
}

/// Whether a process is gone (or a zombie nobody reaped yet).
pub fn process_gone(pid: u32) -> bool {
    granule_host::proc::process_gone(pid)
}

/// A checksum of a byte state that also depends on positions (a state that moved must
/// come back byte for byte).
pub fn checksum(v: &[u8]) -> u64 {
    v.iter().enumerate().fold(0u64, |h, (i, b)| {
        h.wrapping_mul(31).wrapping_add(*b as u64 ^ i as u64)
    })
}

/// The system's cgroup v1 hierarchy, or `None` after saying why the calling test is
/// skipped (not root, no v1 controllers).
pub fn cgroups_usable() -> Option<granule_host::Hierarchy> {
    match granule_host::Hierarchy::detect() {
        Ok(h) => Some(h),
        Err(e) => {
            eprintln!("skipping: cgroup v1 not usable here ({e})");
            None
        }
    }
}

/// A bare HTTP/1.0 GET of `path` from `addr` (`host:port`, or a URL such as
/// `http://host:port/`): the whole answer, status line and headers included.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let addr = addr.trim_start_matches("http://").trim_end_matches('/');
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the HTTP server");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read the answer");
    answer
}
