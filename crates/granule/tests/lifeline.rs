//! Node processes never outlive their driver, however the driver ends: SIGKILL, SIGINT
//! (Ctrl-C), a panic, a plain exit.
//!
//! The driver here is this test binary itself, re-run on the `driver_helper` test with
//! `GRANULE_TEST_HELPER` set: it starts a cluster, prints its node pids and then ends the
//! way it was asked to.

mod common;

use common::process_gone;
use granule::Cluster;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn driver_helper() {
    let Ok(mode) = std::env::var("GRANULE_TEST_HELPER") else {
        return; // only meaningful when re-run by the tests below
    };
    // Run in the background by a script, the suite inherits Ctrl-C ignored; the driver
    // under test must see it as a user's terminal would send it.
    granule_host::os::default_sigint();
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=128MiB;cpu=1,mem=128MiB")
        .unwrap()
        .start()
        .unwrap();
    let pids: Vec<String> = cluster
        .spawned_nodes()
        .iter()
        .map(|(_, p)| p.to_string())
        .collect();
    println!("PIDS {}", pids.join(" "));
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    match mode.as_str() {
        "panic" => panic!("driver panics on purpose"),
        "exit" => std::process::exit(0),
        "abort" => std::process::abort(),
        _ => loop {
            std::thread::sleep(Duration::from_secs(1));
        },
    }
}

/// Start the helper driver, return it with its nodes' pids.
fn start_driver(mode: &str) -> (std::process::Child, Vec<u32>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "driver_helper",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("GRANULE_TEST_HELPER", mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    let pids = loop {
        assert!(Instant::now() < deadline, "the helper driver did not start");
        match lines.next() {
            // libtest prints "test driver_helper ... " first, on the same line.
            Some(Ok(l)) if l.contains("PIDS ") => {
                let at = l.find("PIDS ").unwrap() + 5;
                break l[at..]
                    .split_whitespace()
                    .map(|p| p.parse().unwrap())
                    .collect::<Vec<u32>>();
            }
            Some(_) => continue,
            None => panic!("the helper driver exited before starting its cluster"),
        }
    };
    assert_eq!(pids.len(), 2);
    // The nodes had registered when the pids were printed; a driver told to end at once
    // may already have taken them down by now, so only a sleeping one is checked here.
    if mode == "sleep" {
        assert!(pids.iter().all(|p| !process_gone(*p)));
    }
    (child, pids)
}

/// Wait for the helper driver to end (a driver that ignores how it was told to end fails
/// the test instead of hanging it).
fn wait_bounded(child: &mut std::process::Child, what: &str) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the helper driver did not end within 30 s of {what}");
}

fn assert_nodes_gone(pids: &[u32], what: &str) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if pids.iter().all(|p| process_gone(*p)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pids {
        if !process_gone(*p) {
            let _ = kill(Pid::from_raw(*p as i32), Signal::SIGKILL);
        }
    }
    panic!("node processes {pids:?} outlived a driver that {what}");
}

#[test]
fn no_node_outlives_a_sigkilled_driver() {
    let (mut child, pids) = start_driver("sleep");
    kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL).unwrap();
    let _ = child.wait();
    assert_nodes_gone(&pids, "was SIGKILLed");
}

#[test]
fn no_node_outlives_an_interrupted_driver() {
    let (mut child, pids) = start_driver("sleep");
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    wait_bounded(&mut child, "Ctrl-C");
    assert_nodes_gone(&pids, "got Ctrl-C");
}

#[test]
fn no_node_outlives_a_panicking_or_exiting_driver() {
    for mode in ["panic", "exit", "abort"] {
        let (mut child, pids) = start_driver(mode);
        wait_bounded(&mut child, mode);
        assert_nodes_gone(&pids, mode);
    }
}
