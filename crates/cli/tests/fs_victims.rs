//! The scavenging file system with victim stores, as real processes: hand-started
//! `granule store`s (the victims), a `granule fs mount --victims ...`, and this test
//! process reading and writing through the mount. A victim SIGKILLed with two replicas
//! loses nothing; a victim drained under concurrent reads and writes loses nothing and
//! holds nothing afterwards; a victim SIGKILLed without replicas fails the reads of the
//! files it held with EIO and nothing else; a victim whose replies are tampered with (a
//! man-in-the-middle proxy in this process flips a byte of every GET reply) is caught:
//! EIO with one copy, the right bytes from the replica with two. Never wrong bytes.
//!
//! The mount runs with `fs.cache` 0, so reads reach the stores. Like fs_posix.rs these
//! tests need root, /dev/fuse and fusermount3, or GRANULE_SKIP_FUSE_TESTS set to skip.

#[path = "common/fsload.rs"]
mod fsload;
#[path = "common/fsmount.rs"]
mod fsmount;

use fsload::*;
use fsmount::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const STORE_BYTES: &str = "256MiB";

const LIMIT: Duration = Duration::from_secs(600);

/// The mount over `victims` (ADDR=SECRET each) with weight 2 for the victim class (about
/// two thirds of the stripes on victims) and `extra` arguments.
fn mount(victims: &[String], extra: &[&str]) -> Mount {
    let list = victims.join(",");
    let mut args = vec!["--victims", &list, "--victim-weight", "2"];
    args.extend_from_slice(extra);
    Mount::start_env(&args, &[("GRANULE_FS_CACHE", "0")], LIMIT)
}

/// Several MiB in files of one stripe or less and of several stripes (1 MiB stripes).
fn sizes(seed: u64, n_small: usize) -> Vec<usize> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut v: Vec<usize> = (0..n_small).map(|_| rng.random_range(1..=MIB)).collect();
    v.extend([1, 3 * MIB + 512 * KIB, 2 * MIB, 5 * MIB + 7]);
    v
}

/// Stripes the mount's status counts on the store named `addr`.
fn stripes_on(status: &serde_json::Value, addr: &str) -> u64 {
    store_field(status, addr, "stripes")
}

fn store_field(status: &serde_json::Value, addr: &str, field: &str) -> u64 {
    let stores = status["stores"].as_array().expect("status.stores");
    let s = stores
        .iter()
        .find(|s| s["name"].as_str() == Some(addr))
        .unwrap_or_else(|| panic!("no store {addr} in the status: {status:#}"));
    s[field]
        .as_u64()
        .unwrap_or_else(|| panic!("store {addr} has no {field}: {s}"))
}

/// Read every file: each is byte-identical or fails with EIO, never wrong bytes and never
/// another error. Returns the files that failed.
fn identical_or_eio(files: &[(PathBuf, Vec<u8>)], when: &str) -> Vec<PathBuf> {
    let mut failed = Vec::new();
    for (p, want) in files {
        match read_back(p) {
            Ok(got) => {
                if let Some(d) = first_difference(&got, want) {
                    panic!("{when}: WRONG BYTES from {}: {d}", p.display());
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EIO) => failed.push(p.clone()),
            Err(e) => panic!("{when}: reading {} failed with {e}, not EIO", p.display()),
        }
    }
    failed
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default()
}

#[test]
fn killing_a_victim_with_two_replicas_loses_nothing() {
    if !fuse_usable("killing_a_victim_with_two_replicas_loses_nothing") {
        return;
    }
    let _one = serial();
    let mut a = Store::start(STORE_BYTES, "secret-a");
    let b = Store::start(STORE_BYTES, "secret-b");
    let m = mount(&[a.victim_arg(), b.victim_arg()], &["--replicas", "2"]);
    let files = write_files(&m.dir, 1, &sizes(1, 12));
    let status = fs_status_json(&m.dir);
    let on_a = stripes_on(&status, &a.addr);
    assert!(
        on_a > 0,
        "no stripe on victim {}: nothing to lose; {status:#}",
        a.addr
    );
    eprintln!("victim {} holds {on_a} stripes; SIGKILL", a.addr);
    a.kill();
    all_identical(&files, "after SIGKILL of a victim with --replicas 2");
    let status = fs_status_json(&m.dir);
    assert_eq!(
        status["stripes_lost"].as_u64(),
        Some(0),
        "stripes lost: {status:#}"
    );
    // The mount goes on: new files land on the stores that are left.
    let more = write_files(&m.dir, 2, &[3 * MIB, 100]);
    all_identical(&more, "written after the loss");
    all_identical(&files, "after the new writes");
}

/// A victim that dies while nobody touches the mount is noticed by its probes alone:
/// within a few seconds it is gone from the status and what it held has its second copy
/// again, though no read or write went near it.
#[test]
fn a_dead_victim_is_noticed_and_re_replicated_without_io_to_it() {
    if !fuse_usable("a_dead_victim_is_noticed_and_re_replicated_without_io_to_it") {
        return;
    }
    let _one = serial();
    let mut a = Store::start(STORE_BYTES, "secret-a");
    let mut b = Store::start(STORE_BYTES, "secret-b");
    let m = mount(&[a.victim_arg(), b.victim_arg()], &["--replicas", "2"]);
    let files = write_files(&m.dir, 3, &sizes(3, 12));
    let status = fs_status_json(&m.dir);
    let on_a = stripes_on(&status, &a.addr);
    assert!(on_a > 0, "no stripe on victim {}: {status:#}", a.addr);
    assert_eq!(status["replicas_missing"].as_u64(), Some(0), "{status:#}");
    eprintln!(
        "victim {} holds {on_a} stripes; SIGKILL, then no I/O",
        a.addr
    );
    a.kill();
    let killed = Instant::now();
    // The default probes: one a second, three missed in a row make a store lost.
    let deadline = killed + Duration::from_secs(20);
    let status = loop {
        let s = fs_status_json(&m.dir);
        let gone = s["stores"]
            .as_array()
            .expect("status.stores")
            .iter()
            .any(|st| st["name"].as_str() == Some(&a.addr) && st["state"] == "Gone");
        if gone && s["replicas_missing"].as_u64() == Some(0) && s["draining_stripes"] == 0 {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "20 s after the SIGKILL, with no I/O, the dead victim is not noticed and re-replicated: {s:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "noticed and re-replicated {:.1} s after the SIGKILL",
        killed.elapsed().as_secs_f64()
    );
    assert_eq!(status["stripes_lost"].as_u64(), Some(0), "{status:#}");
    // The live victim answered every probe.
    assert_eq!(
        store_field(&status, &b.addr, "probes_missed"),
        0,
        "{status:#}"
    );
    assert!(
        store_field(&status, &a.addr, "probes_missed") >= 3,
        "the status does not show the missed probes: {status:#}"
    );
    let log = m.log_text();
    assert!(
        log.contains("probes in a row") && log.contains(&a.addr),
        "the mount's log does not say why the victim counts as lost:\n{log}"
    );
    // Every stripe has two live copies again: the other victim can go too, and
    // nothing is lost.
    b.kill();
    all_identical(
        &files,
        "after the probes re-replicated the dead victim's stripes",
    );
}

#[test]
fn draining_a_victim_loses_nothing_under_concurrent_io() {
    if !fuse_usable("draining_a_victim_loses_nothing_under_concurrent_io") {
        return;
    }
    let _one = serial();
    let mut a = Store::start(STORE_BYTES, "secret-a");
    let b = Store::start(STORE_BYTES, "secret-b");
    let m = mount(&[a.victim_arg(), b.victim_arg()], &["--replicas", "1"]);
    let files = Arc::new(write_files(&m.dir, 3, &sizes(3, 16)));
    let status = fs_status_json(&m.dir);
    let on_a = stripes_on(&status, &a.addr);
    assert!(
        on_a > 0,
        "no stripe on victim {}: nothing to drain; {status:#}",
        a.addr
    );
    eprintln!(
        "victim {} holds {on_a} stripes; draining it under reads and writes",
        a.addr
    );

    let load = Load::start(&m.dir, files.clone(), 2, 2, Duration::ZERO);
    std::thread::sleep(Duration::from_secs(2));
    let before = load.counts();
    let started = Instant::now();
    let out = run_bounded(
        Command::new(GRANULE)
            .args(["fs", "drain"])
            .arg(&m.dir)
            .args(["--store", &a.addr]),
        Duration::from_secs(300),
    );
    assert!(
        out.status.success(),
        "granule fs drain failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let drain_time = started.elapsed();
    let during = {
        let now = load.counts();
        (now.0 - before.0, now.1 - before.1)
    };
    eprintln!(
        "granule fs drain took {:.1} s ({} writes and {} reads completed meanwhile): {}",
        drain_time.as_secs_f64(),
        during.0,
        during.1,
        String::from_utf8_lossy(&out.stdout).trim()
    );
    // The drain is over when the store holds nothing and nothing is draining.
    let status = loop {
        let s = fs_status_json(&m.dir);
        if stripes_on(&s, &a.addr) == 0 && s["draining_stripes"].as_u64() == Some(0) {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "5 minutes after the drain began the store still holds stripes: {s:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    std::thread::sleep(Duration::from_secs(2));
    let done = load.stop();
    assert!(
        done.errors.is_empty(),
        "I/O during the drain failed:\n{}",
        done.errors.join("\n")
    );
    eprintln!(
        "{} writes and {} reads ran during the drain",
        done.writes, done.reads
    );
    assert!(
        done.writes > 0 && done.reads > 0,
        "no I/O ran during the drain"
    );
    let state = status["stores"]
        .as_array()
        .and_then(|v| v.iter().find(|s| s["name"].as_str() == Some(&a.addr)))
        .map(|s| s["state"].to_string())
        .unwrap_or_default();
    assert!(
        state.to_lowercase().contains("gone"),
        "the drained store is {state}, not gone: {status:#}"
    );

    // Nothing lives on the drained store any more: it can vanish.
    a.kill();
    all_identical(
        &files,
        "the files written before the drain, its store killed",
    );
    all_identical(
        &done.written,
        "the files written during the drain, its store killed",
    );
    let more = write_files(&m.dir, 4, &[2 * MIB + 1]);
    all_identical(&more, "written after the drain");
}

#[test]
fn killing_an_unreplicated_victim_fails_only_its_files_with_eio() {
    if !fuse_usable("killing_an_unreplicated_victim_fails_only_its_files_with_eio") {
        return;
    }
    let _one = serial();
    let mut a = Store::start(STORE_BYTES, "secret-a");
    let b = Store::start(STORE_BYTES, "secret-b");
    let m = mount(&[a.victim_arg(), b.victim_arg()], &[]);
    let sizes = sizes(5, 24);
    let files = write_files(&m.dir, 5, &sizes);
    let status = fs_status_json(&m.dir);
    let on_a = stripes_on(&status, &a.addr);
    assert!(
        on_a > 0,
        "no stripe on victim {}: nothing to lose; {status:#}",
        a.addr
    );
    eprintln!(
        "victim {} holds {on_a} stripes; SIGKILL without a drain",
        a.addr
    );
    a.kill();
    let failed = identical_or_eio(&files, "after SIGKILL of an unreplicated victim");
    eprintln!("{} of {} files fail with EIO", failed.len(), files.len());
    assert!(
        !failed.is_empty(),
        "{on_a} stripes were on the killed store, yet every file reads"
    );
    assert!(
        failed.len() < files.len(),
        "every file fails, not just those on the killed store"
    );
    // Files of one stripe: each that fails had its one stripe on the killed store.
    let single = files
        .iter()
        .filter(|(p, b)| b.len() <= MIB && failed.contains(p))
        .count() as u64;
    assert!(
        single <= on_a,
        "{single} one-stripe files fail, but only {on_a} stripes were lost"
    );
    // Each stripe lost is a stripe of a file that fails (at most 6 stripes per file).
    assert!(
        failed.len() as u64 * 6 >= on_a,
        "{on_a} stripes lost, {} files fail",
        failed.len()
    );
    // The log names each file that lost data.
    let log = m.log_text();
    for p in &failed {
        assert!(
            log.contains(&file_name(p)),
            "no log line names {} (which fails with EIO)",
            p.display()
        );
    }
    // A second read fails the same way (a failure is not cached as data).
    let again = identical_or_eio(&files, "reading again");
    assert_eq!(again, failed, "the second read fails other files");
    // New files go to the stores that are left.
    let more = write_files(&m.dir, 6, &[3 * MIB, 10]);
    all_identical(&more, "written after the loss");
}

// ---------------------------------------------------------------------------------------
// A man in the middle that tampers with GET replies.

/// A complete RESP command at the start of `buf`: (its length, its name upper-cased).
fn parse_command(buf: &[u8]) -> Option<(usize, String)> {
    let line_end = find_crlf(buf, 0)?;
    if buf.first() != Some(&b'*') {
        // An inline command: its first word.
        let name = String::from_utf8_lossy(&buf[..line_end]);
        let name = name
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_ascii_uppercase();
        return Some((line_end + 2, name));
    }
    let n: usize = std::str::from_utf8(&buf[1..line_end]).ok()?.parse().ok()?;
    let mut pos = line_end + 2;
    let mut name = String::new();
    for i in 0..n {
        let le = find_crlf(buf, pos)?;
        let len: usize = std::str::from_utf8(buf.get(pos + 1..le)?)
            .ok()?
            .parse()
            .ok()?;
        let start = le + 2;
        if buf.len() < start + len + 2 {
            return None;
        }
        if i == 0 {
            name = String::from_utf8_lossy(&buf[start..start + len]).to_ascii_uppercase();
        }
        pos = start + len + 2;
    }
    Some((pos, name))
}

fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|i| from + i)
}

/// A complete RESP2 reply at `pos`: its end; the (start, len) of its bulk strings go
/// into `bulks`.
fn parse_reply(buf: &[u8], pos: usize, bulks: &mut Vec<(usize, usize)>) -> Option<usize> {
    let le = find_crlf(buf, pos)?;
    let head = buf[pos];
    let n = || -> Option<i64> { std::str::from_utf8(&buf[pos + 1..le]).ok()?.parse().ok() };
    match head {
        b'$' => {
            let n = n()?;
            if n < 0 {
                return Some(le + 2);
            }
            let start = le + 2;
            let end = start + n as usize;
            if buf.len() < end + 2 {
                return None;
            }
            bulks.push((start, n as usize));
            Some(end + 2)
        }
        b'*' => {
            let n = n()?;
            let mut p = le + 2;
            for _ in 0..n.max(0) {
                p = parse_reply(buf, p, bulks)?;
            }
            Some(p)
        }
        _ => Some(le + 2),
    }
}

/// A TCP proxy to a store that, once armed, flips a byte in every bulk string of every
/// reply to GET or MGET.
struct TamperProxy {
    addr: String,
    armed: Arc<AtomicBool>,
    tampered: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl TamperProxy {
    fn start(upstream: &str) -> TamperProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr").to_string();
        let armed = Arc::new(AtomicBool::new(false));
        let tampered = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (up, a, t, s) = (
            upstream.to_string(),
            armed.clone(),
            tampered.clone(),
            stop.clone(),
        );
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        if let Ok(server) = TcpStream::connect(&up) {
                            relay(client, server, a.clone(), t.clone());
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        TamperProxy {
            addr,
            armed,
            tampered,
            stop,
        }
    }
}

impl Drop for TamperProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Relay one connection both ways on two threads.
fn relay(client: TcpStream, server: TcpStream, armed: Arc<AtomicBool>, tampered: Arc<AtomicU64>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let names: Arc<Mutex<VecDeque<String>>> = Arc::new(Mutex::new(VecDeque::new()));
    let (mut c_in, mut s_out) = (
        client.try_clone().expect("clone"),
        server.try_clone().expect("clone"),
    );
    let (mut s_in, mut c_out) = (server, client);
    let pending = names.clone();
    // Client to server: note each command's name before the server can see all of it.
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 256 * KIB];
        loop {
            let n = match c_in.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            buf.extend_from_slice(&chunk[..n]);
            while let Some((end, name)) = parse_command(&buf) {
                pending.lock().expect("lock").push_back(name);
                buf.drain(..end);
            }
            if s_out.write_all(&chunk[..n]).is_err() {
                break;
            }
        }
        let _ = s_out.shutdown(std::net::Shutdown::Write);
    });
    // Server to client: whole replies, tampered with when they answer GET or MGET.
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 256 * KIB];
        loop {
            let n = match s_in.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            buf.extend_from_slice(&chunk[..n]);
            let mut bulks = Vec::new();
            while let Some(end) = parse_reply(&buf, 0, &mut bulks) {
                let name = names.lock().expect("lock").pop_front().unwrap_or_default();
                if armed.load(Ordering::SeqCst) && (name == "GET" || name == "MGET") {
                    let mut hit = false;
                    for &(start, len) in &bulks {
                        if len > 0 {
                            buf[start + len / 2] ^= 0x01;
                            hit = true;
                        }
                    }
                    if hit {
                        tampered.fetch_add(1, Ordering::SeqCst);
                    }
                }
                bulks.clear();
                if c_out.write_all(&buf[..end]).is_err() {
                    return;
                }
                buf.drain(..end);
            }
        }
        let _ = c_out.write_all(&buf);
        let _ = c_out.shutdown(std::net::Shutdown::Write);
    });
}

#[test]
fn tampering_victim_is_caught() {
    if !fuse_usable("tampering_victim_is_caught") {
        return;
    }
    let _one = serial();
    for replicas in ["1", "2"] {
        let a = Store::start(STORE_BYTES, "secret-a");
        let b = Store::start(STORE_BYTES, "secret-b");
        let proxy = TamperProxy::start(&a.addr);
        let victims = [format!("{}={}", proxy.addr, a.secret), b.victim_arg()];
        let m = mount(&victims, &["--replicas", replicas]);
        let files = write_files(&m.dir, 7, &sizes(7, 16));
        let status = fs_status_json(&m.dir);
        let on_p = stripes_on(&status, &proxy.addr);
        assert!(
            on_p > 0,
            "no stripe behind the proxy {}: {status:#}",
            proxy.addr
        );
        eprintln!("--replicas {replicas}: {on_p} stripes behind the tampering proxy");
        proxy.armed.store(true, Ordering::SeqCst);
        let failed = identical_or_eio(&files, &format!("--replicas {replicas}, tampering"));
        let tampered = proxy.tampered.load(Ordering::SeqCst);
        eprintln!(
            "--replicas {replicas}: {tampered} replies tampered with, {} of {} files fail with EIO",
            failed.len(),
            files.len()
        );
        assert!(
            tampered > 0,
            "no GET went through the proxy: the test proved nothing"
        );
        if replicas == "1" {
            assert!(!failed.is_empty(), "tampered stripes were read as good");
            assert!(failed.len() < files.len(), "files on other stores fail too");
        } else {
            assert!(
                failed.is_empty(),
                "with a replica these files failed: {failed:?}"
            );
        }
        let status = fs_status_json(&m.dir);
        assert!(
            store_field(&status, &proxy.addr, "tampered") > 0,
            "the status does not count the tampered copies: {status:#}"
        );
        drop(m);
    }
}
