//! The file system's metadata on two own nodes, as real processes: a standalone
//! `granule controller`, `granule node`s started by hand (own nodes that outlive a mount),
//! and `granule fs mount --controller`. The mount keeps its metadata's second copy on an
//! own node other than its own; this test SIGKILLs the mount process and mounts the same
//! directory again: every file, directory, symlink, hard link, mode and byte that was
//! fsynced is back. With `--replicas 2`, the node holding the copy is SIGKILLed too: the
//! copy moves to the other node, and after the mount is killed once more, the next mount
//! still finds everything.
//!
//! Like the other fs tests, this needs root, /dev/fuse and fusermount3, or
//! GRANULE_SKIP_FUSE_TESTS set to skip.

#[path = "common/fsmount.rs"]
mod fsmount;

use fsmount::*;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Kills the process when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A standalone controller and its address.
fn controller() -> (Proc, String) {
    let mut c = Command::new(GRANULE)
        .args(["controller", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start granule controller");
    let mut lines = BufReader::new(c.stdout.take().expect("stdout")).lines();
    let addr = loop {
        let l = lines.next().expect("controller output").expect("a line");
        if let Some(a) = l.strip_prefix("granule controller listening on ") {
            break a.trim().to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    (Proc(c), addr)
}

fn node(controller: &str) -> Proc {
    Proc(
        Command::new(GRANULE)
            .args([
                "node",
                "--controller",
                controller,
                "--cpu",
                "1",
                "--mem",
                "512MiB",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start granule node"),
    )
}

/// `granule status`'s rows for alive nodes: (name, pid).
fn alive_nodes(controller: &str) -> Vec<(String, u32)> {
    let out = run_bounded(
        Command::new(GRANULE).args(["status", "--controller", controller]),
        Duration::from_secs(20),
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() > 4 && f[1] == "node" && f[2] == "alive" {
                Some((f[0].to_string(), f[4].parse().ok()?))
            } else {
                None
            }
        })
        .collect()
}

fn wait_nodes(controller: &str, n: usize) {
    let t = Instant::now();
    while alive_nodes(controller).len() != n {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the controller does not show {n} alive nodes: {:?}",
            alive_nodes(controller)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A `granule fs mount DIR --controller ADDR ARGS` process. Dropping it kills it and
/// unmounts the directory.
struct MountProc {
    dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
}

impl MountProc {
    fn start(dir: &Path, controller: &str, args: &[&str], log: PathBuf) -> MountProc {
        MountProc::start_env(dir, controller, args, log, &[])
    }

    /// [`MountProc::start`] with environment variables (settings) for the mount.
    fn start_env(
        dir: &Path,
        controller: &str,
        args: &[&str],
        log: PathBuf,
        env: &[(&str, &str)],
    ) -> MountProc {
        let err = File::create(&log).expect("mount log");
        let mut child = Command::new(GRANULE)
            .envs(env.iter().copied())
            .args(["fs", "mount"])
            .arg(dir)
            .args(["--controller", controller])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .expect("start granule fs mount");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let mut m = MountProc {
            dir: dir.to_path_buf(),
            child: Some(child),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(l) if l.starts_with("granule fs: mounted") => break,
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let exited = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                    assert!(
                        exited.is_none() && Instant::now() < deadline,
                        "granule fs mount did not mount ({exited:?}); its log:\n{}",
                        m.log_text()
                    );
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("granule fs mount exited; its log:\n{}", m.log_text())
                }
            }
        }
        std::thread::spawn(move || rx.iter().for_each(drop));
        m
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, the way a crash ends it; then clear the dead mount point.
    fn crash(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let out = run_bounded(
            Command::new(GRANULE).args(["fs", "umount"]).arg(&self.dir),
            Duration::from_secs(30),
        );
        assert!(
            out.status.success(),
            "granule fs umount after a crash: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// SIGKILL without reaping: the dead mount's pid stays taken (a zombie) while the
    /// returned child lives; clear the dead mount point.
    fn crash_unreaped(mut self) -> Child {
        let c = self.child.take().expect("a running mount");
        let _ = Command::new("kill")
            .args(["-9", &c.id().to_string()])
            .status();
        // Dead, not reaped: the kernel released its files (and their locks) already.
        let t = Instant::now();
        let zombie = || {
            Command::new("ps")
                .args(["-o", "stat=", "-p", &c.id().to_string()])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim().starts_with('Z'))
        };
        while !zombie() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the mount did not die"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        fusermount_lazy(&self.dir);
        c
    }

    /// SIGTERM, and wait for it to unmount and exit.
    fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let t = Instant::now();
            while c.try_wait().ok().flatten().is_none() && t.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for MountProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        fusermount_lazy(&self.dir);
    }
}

/// What the test writes and expects back.
struct Tree {
    files: Vec<(&'static str, Vec<u8>, u32)>,
}

fn tree() -> Tree {
    Tree {
        files: vec![
            ("big", seeded_bytes(1, 5 * MIB + 123), 0o644),
            ("d/e/small", seeded_bytes(2, 1000), 0o600),
            ("d/exec", seeded_bytes(3, 2 * MIB), 0o755),
            ("d/renamed", seeded_bytes(4, 70 * KIB), 0o640),
        ],
    }
}

fn fsync_dir(p: &Path) {
    File::open(p).and_then(|f| f.sync_all()).expect("fsync dir");
}

fn write_tree(root: &Path, t: &Tree) {
    fs::create_dir_all(root.join("d/e")).unwrap();
    fs::create_dir(root.join("empty")).unwrap();
    for (name, data, mode) in &t.files {
        // `d/renamed` is written under another name and renamed over a file.
        let at = if *name == "d/renamed" {
            fs::write(root.join("d/old"), b"to be replaced").unwrap();
            root.join("d/tmp")
        } else {
            root.join(name)
        };
        let mut f = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&at)
            .unwrap();
        f.write_all(data).unwrap();
        f.set_permissions(fs::Permissions::from_mode(*mode))
            .unwrap();
        f.sync_all().unwrap();
        if *name == "d/renamed" {
            fs::rename(&at, root.join("d/old")).unwrap();
            fs::rename(root.join("d/old"), root.join(name)).unwrap();
        }
    }
    std::os::unix::fs::symlink("e/small", root.join("d/link")).unwrap();
    fs::hard_link(root.join("big"), root.join("d/big-again")).unwrap();
    fs::write(root.join("gone"), b"unlinked").unwrap();
    fs::remove_file(root.join("gone")).unwrap();
    for d in ["", "d", "d/e", "empty"] {
        fsync_dir(&root.join(d));
    }
}

fn check_tree(root: &Path, t: &Tree, when: &str) {
    for (name, data, mode) in &t.files {
        let p = root.join(name);
        let got = fs::read(&p).unwrap_or_else(|e| panic!("{when}: reading {name}: {e}"));
        if let Some(d) = first_difference(&got, data) {
            panic!("{when}: {name}: {d}");
        }
        let m = fs::metadata(&p).unwrap();
        assert_eq!(m.mode() & 0o7777, *mode, "{when}: mode of {name}");
    }
    assert_eq!(
        fs::read_link(root.join("d/link")).unwrap(),
        Path::new("e/small"),
        "{when}: symlink"
    );
    let big = fs::metadata(root.join("big")).unwrap();
    let again = fs::metadata(root.join("d/big-again")).unwrap();
    assert_eq!(big.ino(), again.ino(), "{when}: hard link");
    assert_eq!(big.nlink(), 2, "{when}: link count");
    assert!(root.join("empty").is_dir(), "{when}: empty directory");
    assert!(
        !root.join("gone").exists(),
        "{when}: an unlinked file came back"
    );
    assert!(
        !root.join("d/old").exists(),
        "{when}: a renamed-away name came back"
    );
    let mut names: Vec<String> = fs::read_dir(root.join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["big-again", "e", "exec", "link", "renamed"],
        "{when}: entries of d"
    );
}

fn copy_node(dir: &Path) -> String {
    let s = fs_status_json(dir);
    s["metadata_copy"].as_str().unwrap_or_default().to_string()
}

/// Wait until the mount says its copy is on a node; that node's name.
fn wait_copy_on(dir: &Path, not: Option<&str>) -> String {
    let t = Instant::now();
    loop {
        let c = copy_node(dir);
        if let Some(n) = c.strip_prefix("on ") {
            if Some(n) != not {
                return n.to_string();
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the metadata copy is not on another node: `{c}`"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A standalone controller with two own nodes, and an empty mount point in a temporary
/// directory (which also holds the mounts' logs). `None` where FUSE is missing and the
/// tests are told to skip. Bind every field: one a pattern leaves out is dropped at once,
/// and a dropped controller or node stops.
struct Setup {
    _controller: Proc,
    addr: String,
    nodes: Vec<Proc>,
    tmp: tempfile::TempDir,
    dir: PathBuf,
}

fn setup(test: &str) -> Option<Setup> {
    if !fuse_usable(test) {
        return None;
    }
    let (controller, addr) = controller();
    let nodes: Vec<Proc> = (0..2).map(|_| node(&addr)).collect();
    wait_nodes(&addr, 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mnt");
    fs::create_dir(&dir).unwrap();
    Some(Setup {
        _controller: controller,
        addr,
        nodes,
        tmp,
        dir,
    })
}

#[test]
fn a_killed_mount_comes_back_from_its_metadata_copy() {
    let Some(Setup {
        _controller: _ctl,
        addr,
        nodes: _nodes,
        tmp,
        dir,
    }) = setup("a_killed_mount_comes_back_from_its_metadata_copy")
    else {
        return;
    };
    let t = tree();

    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("1.log"));
    write_tree(&dir, &t);
    check_tree(&dir, &t, "before the crash");
    wait_copy_on(&dir, None);
    m.crash();

    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("2.log"));
    assert!(
        m.log_text().contains("adopted the"),
        "the second mount did not adopt the first one's files:\n{}",
        m.log_text()
    );
    drop_cache_tree(&dir);
    check_tree(&dir, &t, "after the crash");
    // The adopted file system takes writes, and keeps them over another crash.
    let more = seeded_bytes(9, 3 * MIB);
    {
        let mut f = File::create(dir.join("d/after")).unwrap();
        f.write_all(&more).unwrap();
        f.sync_all().unwrap();
    }
    fsync_dir(&dir.join("d"));
    m.crash();

    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("3.log"));
    drop_cache_tree(&dir);
    assert_eq!(
        fs::read(dir.join("d/after")).unwrap(),
        more,
        "after a second crash"
    );
    fs::remove_file(dir.join("d/after")).unwrap();
    check_tree(&dir, &t, "after a second crash");
    // A clean stop ends the file system: the next mount starts empty.
    m.stop();
    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("4.log"));
    assert!(
        fs::read_dir(&dir).unwrap().next().is_none(),
        "a mount after a clean unmount starts empty"
    );
    m.stop();
}

#[test]
fn the_copy_moves_when_its_node_dies_and_still_brings_the_mount_back() {
    let Some(Setup {
        _controller: _ctl,
        addr,
        mut nodes,
        tmp,
        dir,
    }) = setup("the_copy_moves_when_its_node_dies_and_still_brings_the_mount_back")
    else {
        return;
    };
    let t = tree();

    let m = MountProc::start(&dir, &addr, &["--replicas", "2"], tmp.path().join("1.log"));
    write_tree(&dir, &t);
    let first = wait_copy_on(&dir, None);
    let pid = alive_nodes(&addr)
        .into_iter()
        .find(|(n, _)| *n == first)
        .map(|(_, p)| p)
        .unwrap_or_else(|| panic!("no alive node {first}"));
    let i = nodes
        .iter()
        .position(|p| p.0.id() == pid)
        .expect("the copy's node is one this test started");
    drop(nodes.remove(i));
    let second = wait_copy_on(&dir, Some(&first));
    assert_ne!(second, first);
    // Changes after the move reach the new copy.
    fs::write(dir.join("late"), b"written after the copy moved").unwrap();
    File::open(dir.join("late")).unwrap().sync_all().unwrap();
    fsync_dir(&dir);
    drop_cache_tree(&dir);
    check_tree(&dir, &t, "after the copy's node died");
    m.crash();

    let m = MountProc::start(&dir, &addr, &["--replicas", "2"], tmp.path().join("2.log"));
    drop_cache_tree(&dir);
    check_tree(&dir, &t, "after the copy's node and the mount died");
    assert_eq!(
        fs::read(dir.join("late")).unwrap(),
        b"written after the copy moved"
    );
    m.stop();
}

/// Proclets on the controller's nodes (compute + memory + hybrid, from `granule status`).
fn proclets(controller: &str) -> u32 {
    let out = run_bounded(
        Command::new(GRANULE).args(["status", "--controller", controller]),
        Duration::from_secs(20),
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some("node"))
        .filter_map(|l| {
            l.split_whitespace().find_map(|f| {
                let parts: Vec<u32> = f.split('/').filter_map(|p| p.parse().ok()).collect();
                (parts.len() == 3 && f.split('/').count() == 3).then(|| parts.iter().sum::<u32>())
            })
        })
        .sum()
}

/// Wait (at most `within`) until the count of proclets on the controller's nodes is
/// `want`ed; that count. Fails the test with `what` otherwise.
fn wait_proclets(
    controller: &str,
    within: Duration,
    want: &dyn Fn(u32) -> bool,
    what: &str,
) -> u32 {
    let deadline = Instant::now() + within;
    loop {
        let n = proclets(controller);
        if want(n) {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {n} proclets on the nodes"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn discard(dir: &Path) -> std::process::Output {
    run_bounded(
        Command::new(GRANULE).args(["fs", "discard"]).arg(dir),
        Duration::from_secs(60),
    )
}

#[test]
fn a_dead_mounts_leftovers_are_freed_by_discard() {
    let Some(Setup {
        _controller: _ctl,
        addr,
        nodes: _nodes,
        tmp,
        dir,
    }) = setup("a_dead_mounts_leftovers_are_freed_by_discard")
    else {
        return;
    };
    let before = proclets(&addr);

    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("1.log"));
    write_tree(&dir, &tree());
    wait_copy_on(&dir, None);
    // Its stores (one per node) and its metadata copy live on the outside nodes.
    let wait_for = |want: &dyn Fn(u32) -> bool, what: &str| {
        wait_proclets(&addr, Duration::from_secs(30), want, what)
    };
    let during = wait_for(
        &|n| n >= before + 3,
        "the mount's stores and copy never showed",
    );
    let running = discard(&dir);
    assert!(
        !running.status.success()
            && String::from_utf8_lossy(&running.stderr).contains("is running"),
        "a live mount must not be discarded: {}",
        String::from_utf8_lossy(&running.stderr)
    );
    m.crash();
    // A crash leaves them there (a new mount would adopt them)...
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(proclets(&addr), during, "the crash itself freed something");
    // ...until discarded.
    let out = discard(&dir);
    assert!(
        out.status.success(),
        "granule fs discard: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("2 own store(s)"), "{said}");
    wait_for(
        &|n| n == before,
        "discard did not free the dead mount's proclets",
    );
    eprintln!("proclets on the nodes: {before} before the mount, {during} with it; {said}");
    // The next mount starts empty, and there is nothing left to discard.
    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("2.log"));
    assert!(
        fs::read_dir(&dir).unwrap().next().is_none(),
        "a mount after a discard starts empty"
    );
    m.stop();
    let again = discard(&dir);
    assert!(
        !again.status.success()
            && String::from_utf8_lossy(&again.stderr).contains("nothing to discard"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}

#[test]
fn a_clean_stop_while_the_metadata_copy_is_made_leaves_no_record_and_no_copy() {
    let Some(Setup {
        _controller: _ctl,
        addr,
        nodes: _nodes,
        tmp,
        dir,
    }) = setup("a_clean_stop_while_the_metadata_copy_is_made_leaves_no_record_and_no_copy")
    else {
        return;
    };
    let before = proclets(&addr);
    // The replicator's first turn makes the copy, then holds 5 s before recording it.
    let m = MountProc::start_env(
        &dir,
        &addr,
        &[],
        tmp.path().join("1.log"),
        &[
            ("GRANULE_FAULTS", "on"),
            ("GRANULE_FAILPOINTS", "fs.metacopy.made=1*delay(5s)"),
        ],
    );
    // Two own stores and the copy being made.
    wait_proclets(
        &addr,
        Duration::from_secs(4),
        &|n| n >= before + 3,
        &format!("the metadata copy was never made ({before} before the mount)"),
    );
    // A clean stop inside the hold: the copy's turn ends before the record goes, and the
    // copy goes with the mount. (Before, the turn recorded the copy after the record was
    // removed, and the copy stayed on its node with nothing pointing the user at it.)
    m.stop();
    std::thread::sleep(Duration::from_secs(6));
    let left = discard(&dir);
    assert!(
        !left.status.success()
            && String::from_utf8_lossy(&left.stderr).contains("nothing to discard"),
        "a cleanly stopped mount left a record: {}{}",
        String::from_utf8_lossy(&left.stdout),
        String::from_utf8_lossy(&left.stderr)
    );
    wait_proclets(
        &addr,
        Duration::from_secs(20),
        &|n| n == before,
        &format!("a cleanly stopped mount left proclets ({before} before the mount)"),
    );
}

/// The record of the mount of `dir` (in the default state directory).
fn record_of(dir: &Path) -> (PathBuf, serde_json::Value) {
    for e in fs::read_dir("/run/granule/fs").expect("the mounts' state directory") {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&fs::read(&p).unwrap()) {
                if v["dir"].as_str() == Some(dir.to_str().unwrap()) {
                    return (p, v);
                }
            }
        }
    }
    panic!("no record of the mount of {}", dir.display());
}

/// A mount SIGKILLed and not yet reaped (its pid still exists, as a zombie) is dead:
/// the next mount adopts its files instead of starting empty over its record.
#[test]
fn a_killed_mount_whose_pid_is_still_taken_is_adopted() {
    let Some(Setup {
        _controller: _ctl,
        addr,
        nodes: _nodes,
        tmp,
        dir,
    }) = setup("a_killed_mount_whose_pid_is_still_taken_is_adopted")
    else {
        return;
    };
    let t = tree();
    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("1.log"));
    write_tree(&dir, &t);
    wait_copy_on(&dir, None);
    let mut zombie = m.crash_unreaped();
    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("2.log"));
    assert!(
        m.log_text().contains("adopted the"),
        "with the dead mount's pid still taken (zombie {}), the next mount did not adopt its files:\n{}",
        zombie.id(),
        m.log_text()
    );
    drop_cache_tree(&dir);
    check_tree(&dir, &t, "adopted while the dead mount was a zombie");
    let _ = zombie.wait();

    // The pid of a dead mount reused by an unrelated live process: adopted all the same.
    m.crash();
    let mut unrelated = Command::new("sleep").arg("600").spawn().unwrap();
    let (file, mut rec) = record_of(&dir);
    rec["pid"] = serde_json::json!(unrelated.id());
    fs::write(&file, serde_json::to_vec(&rec).unwrap()).unwrap();
    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("3.log"));
    assert!(
        m.log_text().contains("adopted the"),
        "with the dead mount's pid reused by a live process, the next mount did not adopt:\n{}",
        m.log_text()
    );
    drop_cache_tree(&dir);
    check_tree(&dir, &t, "adopted over a reused pid");
    let _ = unrelated.kill();
    let _ = unrelated.wait();

    // A second mount of the directory while one lives is refused, whatever it is given.
    let out = run_bounded(
        Command::new(GRANULE)
            .args(["fs", "mount"])
            .arg(&dir)
            .args(["--controller", &addr]),
        Duration::from_secs(60),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && (err.contains("is running") || err.contains("already mounted")),
        "a second mount of a live mount's directory: {:?} {err}",
        out.status
    );
    check_tree(&dir, &t, "after the refused second mount");
    m.stop();
}

/// A dead mount's record whose data lives on on its controller's nodes is never
/// overwritten by a mount that cannot adopt it: that mount is refused, says what to do,
/// and a mount on the right controller still adopts.
#[test]
fn a_mount_that_cannot_adopt_a_dead_mounts_data_refuses_to_start_over_it() {
    let Some(Setup {
        _controller: _ctl,
        addr,
        nodes: _nodes,
        tmp,
        dir,
    }) = setup("a_mount_that_cannot_adopt_a_dead_mounts_data_refuses_to_start_over_it")
    else {
        return;
    };
    let t = tree();
    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("1.log"));
    write_tree(&dir, &t);
    wait_copy_on(&dir, None);
    m.crash();
    let (file, before) = record_of(&dir);
    // Embedded nodes this time: they cannot hold the dead mount's data.
    let out = run_bounded(
        Command::new(GRANULE)
            .args(["fs", "mount"])
            .arg(&dir)
            .args(["--nodes", "cpu=1,mem=256MiB"]),
        Duration::from_secs(60),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(&format!("--controller {addr}")) && err.contains("granule fs discard"),
        "a mount that cannot adopt the dead mount's data must refuse and say how to adopt or discard it: {:?}\n{err}",
        out.status
    );
    let after: serde_json::Value = serde_json::from_slice(&fs::read(&file).unwrap()).unwrap();
    assert_eq!(
        after, before,
        "the refused mount changed the dead mount's record"
    );
    // What `granule fs status` says of the dead mount names the commands that help.
    let out = run_bounded(
        Command::new(GRANULE).args(["fs", "status"]).arg(&dir),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("it died") && err.contains("granule fs discard"),
        "status of a dead mount: {err}"
    );
    let m = MountProc::start(&dir, &addr, &[], tmp.path().join("2.log"));
    assert!(m.log_text().contains("adopted the"), "{}", m.log_text());
    check_tree(&dir, &t, "adopted after the refused mount");
    m.stop();
}
