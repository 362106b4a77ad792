//! A victim lease revoked for real, end to end, as real processes on 127.0.0.1: a broker
//! (`granule broker`), a producer (`granule producer run -- perl ...`) harvesting the
//! idle memory of a workload it starts in a memory cgroup of its own, and a mount
//! (`granule fs mount --broker ADDR --victim-slabs N`) whose victim store is a lease of
//! that harvested memory in no-eviction mode.
//!
//! The revocation is the producer's own reclaim path, nothing simulated: the workload
//! allocates memory and leaves it idle; the harvester lowers the workload's limit (its
//! pages go to swap) and the producer offers what it harvested; the mount leases it and
//! the test writes files through the mount. Then the workload touches all of its memory
//! again: the burst of refaults makes the harvester give the whole harvest back, the
//! producer finds more leased than it may lease and revokes the no-eviction lease
//! (`market.revoke_grace`), the broker tells the mount on its consumer connection, and
//! the mount drains the store to the next store in each stripe's order and releases the
//! lease — while readers keep reading and a writer keeps writing. Every byte of every
//! file (those written during the drain too) must then read back right, after the
//! producer has dropped the store.
//!
//! Needs what fs_victims.rs needs (root, /dev/fuse, fusermount3; GRANULE_SKIP_FUSE_TESTS
//! set skips it), plus cgroup v1's memory controller and perl for the workload (skipped,
//! with the reason printed, without them). With no swap on the machine the producer
//! creates a swap file in its state directory for the test's length and removes it when
//! it stops (`market.swap_file`); zswap is left alone.

#[path = "common/fsload.rs"]
mod fsload;
#[path = "common/fsmount.rs"]
mod fsmount;

use fsload::*;
use fsmount::*;
use granule_market::client::BrokerClient;
use granule_wire::market::MarketView;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The whole test (the mount's watchdog kills the mount past it; every wait is cut to
/// what is left of it).
const LIMIT: Duration = Duration::from_secs(58);
/// The market's slab, and the slabs the mount leases.
const SLAB: &str = "16MiB";
const VICTIM_SLABS: u32 = 4;
/// How long the producer keeps a revoked lease's store (`market.revoke_grace`): long
/// enough for this debug build to move the victim's stripes under the test's I/O (about
/// two stripes a second on two CPUs), with room to spare for a busy machine.
const GRACE: Duration = Duration::from_secs(20);

/// The producer's workload: 160 MiB, written once and left idle (the harvester swaps it
/// out); a line on stdin makes it read every page again (a burst of refaults).
const WORKLOAD: &str = r#"
$| = 1;
my $x = "";
$x .= "\x01" x 1048576 for 1 .. 160;
print "workload: allocated\n";
my $go = <STDIN>;
my $s = 0;
for (my $i = 0; $i < length($x); $i += 4096) { $s += ord(substr($x, $i, 1)); }
print "workload: touched $s pages\n";
sleep 1000 while 1;
"#;

/// Why the producer cannot harvest here, if it cannot.
fn harvest_missing() -> Option<String> {
    if !granule_host::Hierarchy::default().has(granule_host::Controller::Memory) {
        return Some("no cgroup v1 memory controller (the harvester needs it)".into());
    }
    match Command::new("perl")
        .args(["-e", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => None,
        _ => Some("perl (the test's workload) is not installed".into()),
    }
}

/// A `granule` process in a process group of its own: its stdout lines on a channel,
/// its stderr in a file (shown when the test fails); SIGTERM, then SIGKILL, when dropped.
struct Proc {
    what: &'static str,
    child: Option<Child>,
    lines: Receiver<String>,
    log: tempfile::NamedTempFile,
}

impl Proc {
    fn spawn(what: &'static str, cmd: &mut Command) -> (Proc, Option<ChildStdin>) {
        let log = tempfile::NamedTempFile::new().expect("log file");
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(log.reopen().expect("log file"))
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("start {what}: {e}"));
        let out = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                let _ = tx.send(l);
            }
        });
        let p = Proc {
            what,
            child: Some(child),
            lines,
            log,
        };
        (p, stdin)
    }

    /// The first stdout line starting with `prefix` (the rest of it), within `limit`.
    fn wait_line(&self, prefix: &str, limit: Duration) -> String {
        let start = Instant::now();
        let mut seen = Vec::new();
        loop {
            let left = limit.saturating_sub(start.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(l) => match l.strip_prefix(prefix) {
                    Some(rest) => return rest.trim().to_string(),
                    None => seen.push(l),
                },
                Err(e) => panic!(
                    "{} did not print `{prefix}...` within {limit:?} ({e}); stdout: {seen:?}\n\
                     stderr:\n{}",
                    self.what,
                    self.log_tail(40)
                ),
            }
        }
    }

    fn log_tail(&self, n: usize) -> String {
        let text = fs::read_to_string(self.log.path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// SIGTERM to its group, SIGKILL after `grace`; its exit status.
    fn end(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        end_process_group(&mut c, grace)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // The producer undoes what it changed on SIGTERM (limit, cgroup, swap file).
        self.end(Duration::from_secs(15));
        if std::thread::panicking() {
            eprintln!(
                "--- {} stderr (last 60 lines) ---\n{}\n---",
                self.what,
                self.log_tail(60)
            );
        }
    }
}

/// The broker's whole market view.
fn market(rt: &tokio::runtime::Runtime, addr: &str) -> MarketView {
    rt.block_on(async {
        let c = BrokerClient::connect_tool(addr, "fs_revoke test")
            .await
            .expect("connect to the broker");
        let v = c.status().await.expect("market status");
        c.close("done");
        v
    })
}

/// The test's producer in the market view.
fn revoker(v: &MarketView) -> &granule_wire::market::ProducerView {
    v.producers
        .iter()
        .find(|p| p.name == "revoker")
        .unwrap_or_else(|| panic!("no producer 'revoker' at the broker: {v:#?}"))
}

/// Poll `f` every 100 ms until it gives a value; fail with `what` after `limit`.
fn wait_until<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let start = Instant::now();
    loop {
        match f() {
            Ok(v) => return v,
            Err(last) if start.elapsed() >= limit => {
                panic!("timed out after {limit:?} waiting for {what}; last: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// The mount's status entry of the store behind `lease`.
fn lease_store(status: &serde_json::Value, lease: u64) -> Option<&serde_json::Value> {
    status["stores"]
        .as_array()?
        .iter()
        .find(|s| s["lease"].as_u64() == Some(lease))
}

#[test]
fn a_revoked_victim_lease_is_drained_and_released_under_io() {
    let test = "a_revoked_victim_lease_is_drained_and_released_under_io";
    if !fuse_usable(test) {
        return;
    }
    if let Some(why) = harvest_missing() {
        eprintln!("skipping {test}: {why}");
        return;
    }
    let _one = serial();
    let began = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");

    // The broker, with quick producer reports.
    let (broker, _) = Proc::spawn(
        "granule broker",
        Command::new(GRANULE)
            .args(["broker", "--listen", "127.0.0.1:0"])
            .env("GRANULE_MARKET_REPORT_INTERVAL", "200ms")
            .stdin(Stdio::null()),
    );
    let deadline = began + LIMIT;
    let left = |d: Duration| d.min(deadline.saturating_duration_since(Instant::now()));
    let addr = broker.wait_line(
        "granule broker listening on ",
        left(Duration::from_secs(20)),
    );

    // The producer and its workload. A fixed state directory: a run killed with SIGKILL
    // leaves a record there that the next run's producer undoes first.
    let state = std::env::temp_dir().join("granule-fs-revoke-producer");
    fs::create_dir_all(&state).expect("state dir");
    let swap_file = state.join("harvest.swap");
    let grace = format!("{}ms", GRACE.as_millis());
    let (mut producer, stdin) = Proc::spawn(
        "granule producer",
        Command::new(GRANULE)
            .args(["producer", "run", "--name", "revoker", "--broker", &addr])
            .args(["--listen-host", "127.0.0.1", "--advertise", "127.0.0.1"])
            .args(["--", "perl", "-e", WORKLOAD])
            .env("GRANULE_LOG", "warn,granule_market=info")
            .env("GRANULE_MARKET_STATE_DIR", &state)
            .env("GRANULE_MARKET_SWAP_FILE", &swap_file)
            .env("GRANULE_MARKET_SWAP_SIZE", "256MiB")
            .env("GRANULE_MARKET_ZSWAP", "off")
            .env("GRANULE_MARKET_METRIC", "swapin")
            // Watch until the workload has surely finished allocating, even on a loaded
            // machine (in CI it took over 2 s): the harvester measures the workload's
            // size at its first step, and a size taken while it still grew leaves too
            // little to harvest for the slabs this test needs. A drop's floor holds the
            // harvest for a baseline window, kept short so such a run recovers.
            .env("GRANULE_MARKET_OBSERVE", "6s")
            .env("GRANULE_MARKET_BASELINE_WINDOW", "3s")
            .env("GRANULE_MARKET_COOLING_PERIOD", "250ms")
            .env("GRANULE_MARKET_CHUNK", "32MiB")
            .env("GRANULE_MARKET_HEADROOM", "16MiB")
            .env("GRANULE_MARKET_BURST_SWAPIN", "500")
            .env("GRANULE_MARKET_SLAB", SLAB)
            .env("GRANULE_MARKET_REVOKE_GRACE", &grace)
            .stdin(Stdio::piped()),
    );
    let mut stdin = stdin.expect("the producer's stdin (its workload's)");
    producer.wait_line("workload: allocated", left(Duration::from_secs(20)));
    let v = wait_until(
        "the producer to harvest the idle workload and offer it",
        left(Duration::from_secs(35)),
        || {
            let v = market(&rt, &addr);
            match v.producers.iter().find(|p| p.name == "revoker") {
                Some(p) if p.state.free_slabs >= VICTIM_SLABS => Ok(v),
                p => Err(format!("{:?}", p.map(|p| &p.state))),
            }
        },
    );
    let p = revoker(&v);
    eprintln!(
        "[{:.1} s] producer harvested {} MiB ({}): {} free slabs",
        began.elapsed().as_secs_f64(),
        p.state.harvested_bytes >> 20,
        p.state.policy_state,
        p.state.free_slabs
    );

    // The mount: one small own node, the victim class weighing 3 (about three stripes in
    // four on the victim), one copy, no cache (reads reach the stores).
    let slabs = VICTIM_SLABS.to_string();
    let m = Mount::start_env(
        &[
            "--broker",
            &addr,
            "--victim-slabs",
            &slabs,
            "--nodes",
            "cpu=1,mem=256MiB",
            "--victim-weight",
            "3",
            "--replicas",
            "1",
        ],
        &[
            ("GRANULE_FS_CACHE", "0"),
            ("GRANULE_LOG", "warn,granule_fs=info,granule_market=info"),
        ],
        left(LIMIT),
    );
    let status = fs_status_json(&m.dir);
    let (lease, store_addr) = status["stores"]
        .as_array()
        .and_then(|v| v.iter().find(|s| s["lease"].as_u64().is_some()))
        .map(|s| {
            (
                s["lease"].as_u64().unwrap_or_default(),
                s["name"].as_str().unwrap_or_default().to_string(),
            )
        })
        .unwrap_or_else(|| panic!("the mount has no leased victim store: {status:#}"));
    eprintln!(
        "[{:.1} s] mounted; victim store {store_addr} is lease {lease}",
        began.elapsed().as_secs_f64()
    );

    let mut rng = StdRng::seed_from_u64(7);
    let mut sizes: Vec<usize> = (0..8).map(|_| rng.random_range(1..=MIB)).collect();
    sizes.extend([1, 3 * MIB + 512 * KIB, 2 * MIB + 7]);
    let files = Arc::new(write_files(&m.dir, 1, &sizes));
    let status = fs_status_json(&m.dir);
    let on_victim = lease_store(&status, lease).map_or(0, |s| s["stripes"].as_u64().unwrap_or(0));
    assert!(
        on_victim > 0,
        "no stripe on the leased victim store: nothing to drain; {status:#}"
    );
    eprintln!(
        "[{:.1} s] wrote {} files ({} MiB); {on_victim} stripes on the victim",
        began.elapsed().as_secs_f64(),
        files.len(),
        sizes.iter().sum::<usize>() >> 20
    );

    // Readers and a writer, all through the revocation.
    let load = Load::start(&m.dir, files.clone(), 1, 2, Duration::from_millis(10));
    std::thread::sleep(Duration::from_secs(1));

    // The workload wants its memory: the harvester gives it back, the producer revokes.
    let before = load.counts();
    let revoked_at = Instant::now();
    writeln!(stdin, "go").expect("tell the workload to touch its memory");
    stdin.flush().expect("flush");
    producer.wait_line("workload: touched", left(Duration::from_secs(20)));

    // The broker ends the lease, and the producer reports nothing leased any more.
    let v = wait_until(
        "the broker to end the revoked lease",
        left(Duration::from_secs(15)),
        || {
            let v = market(&rt, &addr);
            let p = v.producers.iter().find(|p| p.name == "revoker");
            let held = v.leases.iter().any(|l| l.lease == lease);
            match p {
                Some(p) if !held && p.state.leased_slabs == 0 => Ok(v),
                _ => Err(format!("lease held: {held}; producer: {p:?}")),
            }
        },
    );
    let p = revoker(&v);
    assert!(
        p.reputation < 1.0,
        "the broker did not count an early revocation against the producer: {p:?}"
    );
    eprintln!(
        "[{:.1} s] the broker ended lease {lease} {:.1} s after the workload's burst \
         (producer harvests {} MiB now, reputation {:.2})",
        began.elapsed().as_secs_f64(),
        revoked_at.elapsed().as_secs_f64(),
        p.state.harvested_bytes >> 20,
        p.reputation
    );

    // The mount drains the store within the grace period.
    let status = wait_until("the mount to drain the revoked store", left(GRACE), || {
        let s = fs_status_json(&m.dir);
        let st = lease_store(&s, lease).cloned();
        match st {
            Some(st)
                if st["stripes"].as_u64() == Some(0)
                    && st["state"].to_string().to_lowercase().contains("gone")
                    && s["draining_stripes"].as_u64() == Some(0) =>
            {
                Ok(s)
            }
            _ => Err(format!("{st:?}")),
        }
    });
    let drained_in = revoked_at.elapsed();
    for l in m
        .log_text()
        .lines()
        .filter(|l| l.contains("revoked") || l.contains("drain"))
    {
        eprintln!("  mount: {l}");
    }
    assert_eq!(
        status["stripes_lost"].as_u64(),
        Some(0),
        "stripes lost: {status:#}"
    );
    eprintln!(
        "[{:.1} s] the revoked store is drained and gone {:.1} s after the burst ({} stripes moved)",
        began.elapsed().as_secs_f64(),
        drained_in.as_secs_f64(),
        status["stripes_moved"]
    );

    // The producer drops the store when the grace period ends: from then on, a stripe
    // left behind would be gone.
    wait_until(
        "the producer to drop the revoked lease's store",
        left(GRACE + Duration::from_secs(5)),
        || match std::net::TcpStream::connect(&store_addr) {
            Ok(_) => Err("still accepts connections".to_string()),
            Err(_) => Ok(()),
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    let done = load.stop();
    assert!(
        done.errors.is_empty(),
        "I/O during the revocation failed:\n{}",
        done.errors.join("\n")
    );
    let during = (done.writes - before.0, done.reads - before.1);
    eprintln!(
        "[{:.1} s] the store is dropped; {} writes and {} reads ran from the burst on",
        began.elapsed().as_secs_f64(),
        during.0,
        during.1
    );
    assert!(during.0 > 0 && during.1 > 0, "no I/O ran during the drain");

    all_identical(&files, "the files written before the revocation");
    all_identical(&done.written, "the files written during the revocation");
    let more = write_files(&m.dir, 2, &[2 * MIB + 1, 100]);
    all_identical(&more, "the files written after the revocation");
    let status = fs_status_json(&m.dir);
    assert_eq!(
        status["stripes_lost"].as_u64(),
        Some(0),
        "stripes lost: {status:#}"
    );
    assert!(
        m.log_text().contains("victim lease revoked"),
        "the mount never logged the revocation notice:\n{}",
        m.log_text()
    );
    m.unmount_cleanly();

    // The producer stops cleanly and undoes what it changed on the machine.
    drop(stdin);
    let st = producer.end(Duration::from_secs(15));
    assert!(
        st.is_some_and(|s| s.success()),
        "the producer exited with {st:?} on SIGTERM:\n{}",
        producer.log_tail(30)
    );
    assert!(
        !swap_file.exists(),
        "the producer left its swap file {} behind",
        swap_file.display()
    );
    drop(broker);
    // Its state directory, now without a record to undo, goes too: a passing run leaves
    // nothing in the temporary directory (a killed one leaves it for the next run).
    fs::remove_dir_all(&state).expect("remove the producer's state directory");
    eprintln!("[{:.1} s] done", began.elapsed().as_secs_f64());
}
