//! `granule-bench scavenge`: the scavenging file system (`granule fs mount`) over own
//! nodes plus victim stores, scaled down from MemFSS's evaluation (2048 × 128 MB `dd`),
//! with a CPU- and memory-hungry tenant on the victim side.
//!
//! **The victim side (vCPU 1).** `victims` stores (`granule store --listen 127.0.0.1:0
//! --bytes SIZE --secret S`, the market's producer store in no-eviction mode), all in one
//! cpu cgroup with a CFS quota of `VICTIM_CORES` of a core (a [`ClusterGroups`] node
//! group of this benchmark's own, so removal kills what is left inside;
//! `GRANULE_BENCH_SCAVENGE_VICTIM_CORES` sets another cap, for experiments), and the
//! *tenant*: a child of this executable (`granule-bench scavenge` with
//! `GRANULE_BENCH_SCAVENGE_TENANT` set) that allocates `tenant_mib` MiB, fills it, then
//! sweeps it `tenant_passes` times in a scrambled order of 64 KiB blocks, replacing every
//! word by a hash of itself — a fixed amount of CPU and memory-bandwidth work whose run
//! time it reports, with its CPU time and its run-queue wait (schedstat) over the sweeps.
//! Stores and tenant sit in a cpuset of vCPU 1. The wait tells a slowdown the stores
//! caused (their CPU time on the vCPU) from one other programs on the machine caused
//! (wait beyond it: the cpusets keep this benchmark's own side off vCPU 1, not the
//! rest of the machine).
//!
//! **The own side (vCPU 0).** This driver (which runs the workloads: its threads and the
//! `dd` processes it starts) and two mounts, each a `granule fs mount` process with its
//! embedded own node processes, in a cpuset of vCPU 0:
//! - the *scavenging* mount: `scav_nodes` own nodes of `node_mem` each — smaller than the
//!   data — plus the victim stores with `--victim-weight W`, so that the victims hold
//!   about W/(1+W) of the stripes;
//! - the *reservation* mount: `res_nodes` own nodes of the same size, enough to hold all
//!   the data in memory, and no victims.
//!
//! **The workload, one round.** (a) A bag of `bag_tasks` writer tasks, each `dd
//! bs=1M count=bag_mib conv=fsync` of a file from one of `SOURCES` distinct random
//! sources (on tmpfs), at most `par` at a time; then every file read back with `dd
//! iflag=direct bs=1M` (past the kernel's page cache; the mount's own cache of stripes
//! read, on the own side, may still serve some) and compared byte for byte with its
//! source.
//! (b) A DAG workflow: stage 1 writes `dag_files` small files (1–8 KiB, seeded contents)
//! in groups of `dag_group` per directory; stage 2 reads each group, checks every file,
//! and writes one aggregate per group (a header with the hash of the body, then the files
//! concatenated); stage 3 reads the aggregates, checks each header, and writes one
//! result, which is read back and compared with the result computed in memory. Every
//! stage runs `par` tasks at a time. (c) The round's directory is removed.
//!
//! **The measurements.**
//! - `tenant_slowdown`: `pairs` pairs of tenant runs, one *alone* (the mounts and stores
//!   idle) and one *with* the workload rounds looping on the scavenging mount from before
//!   the tenant starts until it ends, in alternating order; (with − alone)/alone of each
//!   pair, and the median over pairs. Target ≤ 0.10. Beside it, from the tenant's
//!   schedstat: its CPU time with over alone, its run-queue wait beyond the stores' CPU
//!   time (other programs on the machine: while the own side keeps vCPU 0 busy, the
//!   scheduler moves everything else that runs to vCPU 1, so a busy machine inflates the
//!   with runs; the report says when), and `tenant_slowdown_from_stores`, the slowdown
//!   with the stores as the tenant's only neighbours (its CPU time over one less the
//!   stores' share of the vCPU).
//! - `victim_cpu_fraction`: the stores' CPU time (utime + stime of each store process)
//!   over each *with* run, divided by its wall time: a fraction of vCPU 1; median over
//!   the runs.
//! - `node_seconds_vs_reservation`: `rounds` rounds on each mount, alternating (the
//!   tenant not running): own nodes × median round time with scavenging, over own nodes ×
//!   median round time of the reservation.
//!
//! Needs two vCPUs for the placement (with fewer, nothing is pinned, and said so), root
//! and cgroup v1 for the cpu cap and the cpusets (without them the stores run uncapped
//! and placement falls back to `sched_setaffinity`, said so too), `/dev/fuse` and
//! `fusermount3`. Ctrl-C (SIGINT/SIGTERM) ends the run the normal way: mounts unmounted
//! (`fusermount3 -uz` after the mount process is gone, in every case), children stopped,
//! cgroups and cpusets removed.

use crate::interrupt::{catch_signals, check_interrupted, interrupted, Active};
use crate::BenchOpts;
use anyhow::{bail, Context};
use granule_host::{ClusterGroups, Cpuset, CpusetGroup, Hierarchy, NodeGroup, Reader};
use granule_report::{Cell, Meta, Plot, Report, Table};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Set in the tenant child: `BYTES,PASSES`.
const TENANT_ENV: &str = "GRANULE_BENCH_SCAVENGE_TENANT";
/// The own side: driver, mounts, own nodes, workload.
const OWN_CPU: usize = 0;
/// The victim side: tenant and victim stores.
const VICTIM_CPU: usize = 1;
/// The victim stores' CPU cap, cores (one CFS quota over all of them). A CPU-bound tenant that shares its vCPU with stores
/// taking a share f of it runs 1/(1-f) as long: the 0.10 target allows f ≤ 0.09, and
/// 0.08 leaves a little for what the stores cost it through caches and memory. (Under a
/// cap of 0.2 the stores of `--quick` took 0.10-0.12 of the vCPU, a slowdown of 0.11-0.14
/// from the CPU share alone, and the rounds were about a fifth shorter.)
const VICTIM_CORES: f64 = 0.08;

/// The cap in force.
fn victim_cores() -> f64 {
    VICTIM_CORES
}
/// Distinct random sources the writer tasks copy from (task k copies source k % SOURCES).
const SOURCES: usize = 8;
/// The tenant sweeps its memory in blocks of this many 8-byte words (64 KiB).
const TENANT_BLOCK_WORDS: usize = 8192;
/// How long a mount or a store may take to say it is up.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a mount process may take to exit after SIGTERM before it is unmounted from
/// outside, and after that before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
const UNMOUNT_TIMEOUT: Duration = Duration::from_secs(10);

// ---- sizes ------------------------------------------------------------------------------

/// The run's size.
#[derive(Clone, Debug)]
struct Sizes {
    bag_tasks: usize,
    bag_mib: usize,
    /// Tasks at a time, in the bag and in each DAG stage.
    par: usize,
    dag_files: usize,
    dag_group: usize,
    tenant_mib: u64,
    tenant_passes: u32,
    pairs: usize,
    rounds: usize,
    node_mem_mib: u64,
    victims: usize,
}

impl Sizes {
    fn new(quick: bool, reps: Option<usize>) -> Sizes {
        let mut s = if quick {
            Sizes {
                bag_tasks: 8,
                bag_mib: 10,
                par: 2,
                dag_files: 200,
                dag_group: 10,
                tenant_mib: 256,
                tenant_passes: 40,
                pairs: 3,
                rounds: 2,
                node_mem_mib: 96,
                victims: 2,
            }
        } else {
            Sizes {
                bag_tasks: 64,
                bag_mib: 16,
                par: 4,
                dag_files: 2000,
                dag_group: 10,
                tenant_mib: 1024,
                tenant_passes: 60,
                pairs: 5,
                rounds: 5,
                node_mem_mib: 512,
                victims: 4,
            }
        };
        if let Some(r) = reps {
            s.pairs = r.max(1);
        }
        s
    }

    fn dag_groups(&self) -> usize {
        self.dag_files.div_ceil(self.dag_group)
    }

    /// Bytes one round holds at its peak: the bag, the small files, the aggregates (the
    /// small files again, plus headers) and the result.
    fn data_bytes(&self) -> u64 {
        let small: u64 = (0..self.dag_files).map(|i| dag_file_len(i) as u64).sum();
        (self.bag_tasks * self.bag_mib) as u64 * MIB + 2 * small + 64 * self.dag_groups() as u64
    }

    /// What an own node holds of stripes: the share of its memory the mount gives its
    /// stripe store (`fs.own_share`; the rest is the node process itself).
    fn node_usable(&self) -> u64 {
        (self.node_mem_mib as f64 * MIB as f64 * own_share()) as u64
    }

    /// Own nodes of the reservation: all the data, with a quarter to spare for the hash
    /// spreading stripes unevenly.
    fn res_nodes(&self) -> usize {
        (self.data_bytes() * 5 / 4).div_ceil(self.node_usable()) as usize
    }

    /// Own nodes of the scavenging mount: one, smaller than the data.
    fn scav_nodes(&self) -> usize {
        1
    }

    /// The victim class's weight (own = 1): the own nodes' expected share, data/(1+W),
    /// at most half of what they can hold.
    fn victim_weight(&self) -> f64 {
        let own_cap = (self.scav_nodes() as u64 * self.node_usable()) as f64;
        (2.0 * self.data_bytes() as f64 / own_cap - 1.0)
            .ceil()
            .max(1.0)
    }

    /// Each store's size: the victims' expected share, half again, spread over the stores.
    fn victim_bytes(&self) -> u64 {
        let w = self.victim_weight();
        let share = self.data_bytes() as f64 * w / (1.0 + w);
        let each = (share * 1.5 / self.victims as f64).ceil() as u64;
        each.div_ceil(MIB).max(32) * MIB
    }

    fn node_spec(&self, n: usize) -> String {
        vec![format!("cpu=1,mem={}MiB", self.node_mem_mib); n].join(";")
    }
}

const MIB: u64 = 1 << 20;

/// `fs.own_share` as the mount will use it (its default: the mounts get no configuration).
fn own_share() -> f64 {
    granule_config::Config::default().fs.own_share
}

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

// ---- the tenant (child) -----------------------------------------------------------------

/// What the tenant reports (one JSON line on stdout).
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
struct TenantOut {
    /// Allocating and filling its memory.
    alloc_s: f64,
    /// The sweeps: the figure compared.
    run_s: f64,
    /// CPU time of the sweeps, and time spent runnable but waiting for the vCPU
    /// (schedstat): wait is what the other tasks on the vCPU took from it.
    cpu_s: f64,
    wait_s: f64,
    checksum: u64,
}

/// splitmix64's finalizer: the tenant's per-word work.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The tenant's work: fill `words` words, then `passes` sweeps over 64 KiB blocks in a
/// scrambled order (a stride coprime to the block count), each word replaced by a hash
/// of itself.
fn tenant_work(words: usize, passes: u32) -> TenantOut {
    let t0 = Instant::now();
    let mut v: Vec<u64> = (0..words as u64).map(mix).collect();
    let alloc = t0.elapsed();
    let sched = granule_host::proc::OwnSchedstat::open();
    let before = sched.read().unwrap_or_default();
    let t1 = Instant::now();
    let blocks = (words / TENANT_BLOCK_WORDS).max(1);
    let mut stride = (blocks * 5 / 8) | 1;
    while gcd(stride, blocks) != 1 {
        stride += 2;
    }
    let mut acc = 0u64;
    for pass in 0..passes as u64 {
        let mut b = (pass as usize * 7919) % blocks;
        for _ in 0..blocks {
            let lo = b * TENANT_BLOCK_WORDS;
            let hi = (lo + TENANT_BLOCK_WORDS).min(words);
            for x in &mut v[lo..hi] {
                *x = mix(*x ^ pass);
                acc = acc.wrapping_add(*x);
            }
            b = (b + stride) % blocks;
        }
    }
    let run = t1.elapsed();
    let after = sched.read().unwrap_or_default();
    TenantOut {
        alloc_s: alloc.as_secs_f64(),
        run_s: run.as_secs_f64(),
        cpu_s: after.cpu_ns.saturating_sub(before.cpu_ns) as f64 / 1e9,
        wait_s: after.runq_delay_ns.saturating_sub(before.runq_delay_ns) as f64 / 1e9,
        checksum: acc,
    }
}

/// The tenant child: wait for the parent's go (it is moved to the victim vCPU first), do
/// the work, print the result.
fn tenant_main(spec: &str) -> anyhow::Result<()> {
    let (bytes, passes) = spec
        .split_once(',')
        .and_then(|(b, p)| Some((b.parse::<u64>().ok()?, p.parse::<u32>().ok()?)))
        .with_context(|| format!("{TENANT_ENV}={spec}: expected BYTES,PASSES"))?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let out = tenant_work((bytes / 8) as usize, passes);
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

// ---- placement ----------------------------------------------------------------------------

/// How the two sides are kept on their vCPUs.
enum Pinning {
    /// cpusets of vCPU 0 and vCPU 1 (this driver joined the first; its children inherit).
    Cpusets {
        own: Cpuset,
        victim: Cpuset,
        // Last: the children are moved out before the groups go.
        _group: CpusetGroup,
    },
    /// sched_setaffinity: this process on vCPU 0, victims pinned to vCPU 1 thread by thread.
    Affinity,
    /// Fewer than two vCPUs: nothing pinned.
    None,
}

struct Placement {
    pinning: Pinning,
    /// Why the preferred way was not used.
    why: Option<String>,
    // Dropped after the pinning: the driver's affinity comes back last.
    _saved: crate::affinity::SavedAffinity,
}

impl Placement {
    fn set_up() -> Placement {
        let _saved = crate::affinity::SavedAffinity::save();
        let cpus = granule_host::os::affinity(0).unwrap_or_default();
        if !(cpus.contains(&OWN_CPU) && cpus.contains(&VICTIM_CPU)) {
            return Placement {
                pinning: Pinning::None,
                why: Some(format!("this process may run on vCPUs {cpus:?} only")),
                _saved,
            };
        }
        let h = Hierarchy::default();
        let cpusets = || -> anyhow::Result<Pinning> {
            let group = CpusetGroup::create(&h, &format!("{OWN_CPU},{VICTIM_CPU}"), None)?;
            let own = group.child("own", &OWN_CPU.to_string())?;
            let victim = group.child("victim", &VICTIM_CPU.to_string())?;
            own.join(std::process::id())?;
            Ok(Pinning::Cpusets {
                own,
                victim,
                _group: group,
            })
        };
        match cpusets() {
            Ok(p) => Placement {
                pinning: p,
                why: None,
                _saved,
            },
            Err(e) => {
                let _ = crate::affinity::pin_process(OWN_CPU);
                Placement {
                    pinning: Pinning::Affinity,
                    why: Some(format!("no cpusets ({e:#})")),
                    _saved,
                }
            }
        }
    }

    /// Move process `pid` to the victim side.
    fn to_victim(&self, pid: u32) -> anyhow::Result<()> {
        match &self.pinning {
            Pinning::Cpusets { victim, .. } => Ok(victim.join(pid)?),
            Pinning::Affinity => crate::affinity::pin_pid(pid, VICTIM_CPU),
            Pinning::None => Ok(()),
        }
    }

    fn describe(&self) -> String {
        let how =
            match &self.pinning {
                Pinning::Cpusets { own, victim, .. } => format!(
                    "cgroup v1 cpusets {} and {} (children inherit theirs)",
                    own.rel(),
                    victim.rel()
                ),
                Pinning::Affinity => format!(
                "sched_setaffinity (this process, inherited by its children; the victim side's \
                 threads pinned one by one){}",
                self.why.as_ref().map(|w| format!(", {w}")).unwrap_or_default()
            ),
                Pinning::None => {
                    return format!(
                        "nothing pinned: {}",
                        self.why.as_deref().unwrap_or("fewer than two vCPUs")
                    )
                }
            };
        format!(
            "vCPU {OWN_CPU}, the own side: this driver (the workload's threads and the dd processes it \
             starts), both `granule fs mount` processes and their embedded own node processes; vCPU \
             {VICTIM_CPU}, the victim side: the tenant (one thread) and the victim stores \
             (`granule store`); by {how}"
        )
    }
}

// ---- children that announce themselves on stdout ----------------------------------------

/// Start `cmd` with stdout piped and stderr appended to `log`; wait for a stdout line
/// starting with `banner` (returned), then keep draining stdout into the log.
fn spawn_announced(mut cmd: Command, banner: &str, log: &Path) -> anyhow::Result<(Child, String)> {
    let err = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err))
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let Some(stdout) = child.stdout.take() else {
        bail!("no stdout of {cmd:?}");
    };
    let (tx, rx) = mpsc::channel::<String>();
    let log_path = log.to_path_buf();
    std::thread::spawn(move || {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .ok();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(f) = log.as_mut() {
                let _ = writeln!(f, "{line}");
            }
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if interrupted() {
            let _ = child.kill();
            let _ = child.wait();
            bail!("interrupted");
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(line) if line.starts_with(banner) => return Ok((child, line)),
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
            Err(e) => {
                let _ = child.kill();
                let status = child.wait().ok();
                bail!(
                    "{cmd:?} did not print '{banner}' ({}; exit: {status:?}); its log {} ends:\n{}",
                    if matches!(e, mpsc::RecvTimeoutError::Timeout) {
                        "timed out"
                    } else {
                        "it closed stdout"
                    },
                    log.display(),
                    tail(log, 20)
                );
            }
        }
    }
}

/// The last `n` lines of a log file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// SIGTERM, then SIGKILL after `grace`; reaped either way.
fn stop_child(child: &mut Child, grace: Duration) {
    if let Ok(None) = child.try_wait() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        if !wait_exit(child, grace) {
            let _ = child.kill();
        }
    }
    let _ = child.wait();
}

// ---- victim stores ------------------------------------------------------------------------

/// The stores' CPU cap: a cpu (and memory) group of this benchmark's own.
struct CpuCap {
    node: NodeGroup,
    reader: Option<Reader>,
    // Last: removing the cluster's groups kills what is still inside.
    _cluster: ClusterGroups,
}

struct Store {
    child: Child,
    addr: String,
    secret: String,
}

/// The victim stores, stopped on drop (then their group removed).
struct Victims {
    stores: Vec<Store>,
    bytes_each: u64,
    cap: Option<CpuCap>,
    /// Why there is no cap.
    no_cap: Option<String>,
}

impl Victims {
    fn start(
        exe: &Path,
        n: usize,
        bytes_each: u64,
        placement: &Placement,
        log: &Path,
    ) -> anyhow::Result<Victims> {
        let (cap, no_cap) = match Self::cap(n, bytes_each) {
            Ok(c) => (Some(c), None),
            Err(e) => (None, Some(format!("{e:#}"))),
        };
        let mut v = Victims {
            stores: Vec::new(),
            bytes_each,
            cap,
            no_cap,
        };
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        for i in 0..n {
            check_interrupted()?;
            let secret = format!("scavenge-{}-{nonce:x}-{i}", std::process::id());
            let mut cmd = Command::new(exe);
            cmd.args(["store", "--listen", "127.0.0.1:0", "--bytes"])
                .arg(format!("{}MiB", bytes_each / MIB))
                .args(["--secret", &secret]);
            let (child, line) = spawn_announced(
                cmd,
                "granule store: listening",
                &log.join(format!("store{i}.log")),
            )
            .context("starting a victim store (`granule store`)")?;
            let addr = line
                .rsplit(' ')
                .next()
                .unwrap_or_default()
                .trim()
                .to_string();
            let pid = child.id();
            v.stores.push(Store {
                child,
                addr: addr.clone(),
                secret,
            });
            if addr.parse::<std::net::SocketAddr>().is_err() {
                bail!("cannot read the store's address from '{line}'");
            }
            if let Some(c) = &v.cap {
                c.node.join(pid)?;
            }
            placement.to_victim(pid)?;
        }
        Ok(v)
    }

    /// One group for all the stores: a CFS quota of `VICTIM_CORES`, and a memory limit
    /// well above what they hold (a guard, not a squeeze).
    fn cap(n: usize, bytes_each: u64) -> anyhow::Result<CpuCap> {
        let h = Hierarchy::detect().map_err(|e| anyhow::anyhow!("{e}"))?;
        let cluster = ClusterGroups::new(&h)?;
        let mem = n as u64 * (bytes_each * 2 + 64 * MIB);
        let node = cluster.node("victims", victim_cores(), mem)?;
        let reader = Reader::for_paths(&h, &node.paths()).ok();
        Ok(CpuCap {
            node,
            reader,
            _cluster: cluster,
        })
    }

    /// `--victims` of the mount.
    fn arg(&self) -> String {
        self.stores
            .iter()
            .map(|s| format!("{}={}", s.addr, s.secret))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// CPU time of every store so far, seconds.
    fn cpu_s(&self) -> f64 {
        self.stores
            .iter()
            .filter_map(|s| granule_host::proc::process_cpu_time_of(s.child.id()))
            .map(|d| d.as_secs_f64())
            .sum()
    }

    /// Periods throttled by the cap so far (0 without a cap).
    fn throttled(&self) -> u64 {
        self.cap
            .as_ref()
            .and_then(|c| c.reader.as_ref())
            .and_then(|r| r.cpu_stat().ok())
            .map_or(0, |s| s.nr_throttled)
    }

    /// Resident memory of every store, bytes.
    fn resident(&self) -> u64 {
        self.stores
            .iter()
            .filter_map(|s| granule_host::proc::process_resident_bytes(s.child.id()))
            .sum()
    }

    /// Fails if a store has exited.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        for s in &mut self.stores {
            if let Ok(Some(st)) = s.child.try_wait() {
                bail!("victim store {} exited ({st})", s.addr);
            }
        }
        Ok(())
    }
}

impl Drop for Victims {
    fn drop(&mut self) {
        for s in &self.stores {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(s.child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        for s in &mut self.stores {
            stop_child(&mut s.child, Duration::from_secs(5));
        }
    }
}

// ---- mounts -------------------------------------------------------------------------------

/// A `granule fs mount` process; on drop it is stopped and the mount point is detached
/// (`fusermount3 -uz`) whatever state it was left in, then removed.
struct Mount {
    child: Option<Child>,
    dir: PathBuf,
    exe: PathBuf,
    own_nodes: usize,
    banner: String,
}

impl Mount {
    fn start(
        exe: &Path,
        dir: &Path,
        nodes: &str,
        own_nodes: usize,
        victims: Option<(&Victims, f64)>,
        log: &Path,
    ) -> anyhow::Result<Mount> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut cmd = Command::new(exe);
        cmd.args(["fs", "mount"])
            .arg(dir)
            .args(["--nodes", nodes, "--replicas", "1"])
            // Data only on the node processes counted as own nodes (node-seconds), not
            // also in the mount process.
            .env("GRANULE_FS_DRIVER_STORE", "off");
        if let Some((v, weight)) = victims {
            cmd.args(["--victims", &v.arg()])
                .args(["--victim-weight", &weight.to_string()]);
        }
        // The guard exists before the process is asked to mount: a failure from here on
        // still detaches the mount point.
        let mut m = Mount {
            child: None,
            dir: dir.to_path_buf(),
            exe: exe.to_path_buf(),
            own_nodes,
            banner: String::new(),
        };
        let (child, banner) = spawn_announced(cmd, "granule fs: mounted", log)
            .context("mounting (`granule fs mount`; needs /dev/fuse and fusermount3)")?;
        m.child = Some(child);
        m.banner = banner;
        Ok(m)
    }

    /// `granule fs status DIR --json`, if it answers.
    fn status(&self) -> Option<String> {
        let out = Command::new(&self.exe)
            .args(["fs", "status"])
            .arg(&self.dir)
            .arg("--json")
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Ask the mount process to unmount and exit (SIGTERM), without waiting: dropping
    /// several mounts after this stops them side by side.
    fn signal_stop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            if let Ok(None) = c.try_wait() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(c.id() as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
        }
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(c) = self.child.as_mut() {
            if let Ok(Some(st)) = c.try_wait() {
                bail!("the mount at {} exited ({st})", self.dir.display());
            }
        }
        Ok(())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.signal_stop();
        let fusermount = |flags: &str| {
            let _ = Command::new("fusermount3")
                .arg(flags)
                .arg(&self.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        };
        if let Some(mut c) = self.child.take() {
            // SIGTERM (the mount unmounts and exits); if it is still there after a
            // while, an unmount from outside (it exits on that too); then SIGKILL.
            if !wait_exit(&mut c, STOP_TIMEOUT) {
                fusermount("-u");
                if !wait_exit(&mut c, UNMOUNT_TIMEOUT) {
                    let _ = c.kill();
                }
            }
            let _ = c.wait();
        }
        // Whatever the process did or did not do: a lazy detach of whatever is left.
        fusermount("-uz");
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Whether `child` exits within `limit`.
fn wait_exit(child: &mut Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- the workload -------------------------------------------------------------------------

/// Seconds of each part of one round.
#[derive(Clone, Copy, Debug, Default)]
struct RoundTimes {
    bag_write: f64,
    bag_read: f64,
    dag: f64,
    cleanup: f64,
}

impl RoundTimes {
    fn total(&self) -> f64 {
        self.bag_write + self.bag_read + self.dag + self.cleanup
    }
}

/// The length of DAG file `i`: 1–8 KiB.
fn dag_file_len(i: usize) -> usize {
    1024 + (mix(i as u64 ^ 0x5ca7) % 7168) as usize
}

/// The contents of DAG file `i`.
fn dag_file(i: usize) -> Vec<u8> {
    let len = dag_file_len(i);
    let mut out = Vec::with_capacity(len + 8);
    let mut s = mix(i as u64 + 1);
    while out.len() < len {
        s = mix(s);
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A 64-bit hash of bytes (FNV-style over words): checks, not security.
fn hash(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for c in b.chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w))
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }
    h ^ b.len() as u64
}

/// Run `n` tasks, `par` at a time, until all are done, one fails, or `stop` is set.
/// Returns false when stopped.
fn par_for(
    n: usize,
    par: usize,
    stop: &AtomicBool,
    f: impl Fn(usize) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<bool> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_err: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..par.max(1).min(n.max(1)) {
            s.spawn(|| loop {
                if stop.load(Ordering::SeqCst) || failed.load(Ordering::SeqCst) || interrupted() {
                    return;
                }
                let k = next.fetch_add(1, Ordering::SeqCst);
                if k >= n {
                    return;
                }
                if let Err(e) = f(k) {
                    failed.store(true, Ordering::SeqCst);
                    let mut slot = first_err.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert(e);
                    return;
                }
            });
        }
    });
    if let Some(e) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    check_interrupted()?;
    Ok(!stop.load(Ordering::SeqCst))
}

/// The workload: its sources and its expected DAG result.
struct Workload {
    s: Sizes,
    sources: Vec<Vec<u8>>,
    source_paths: Vec<PathBuf>,
    expected_result: String,
    /// Whether reads with `iflag=direct` work on the mounts (else plain reads).
    direct: AtomicBool,
    rounds_started: AtomicUsize,
}

impl Workload {
    fn new(s: &Sizes, tmp: &Path) -> anyhow::Result<Workload> {
        let mut sources = Vec::new();
        let mut source_paths = Vec::new();
        for k in 0..SOURCES.min(s.bag_tasks.max(1)) {
            let mut r = crate::kv_secure::Rng(mix(k as u64 + 0x5eed) | 1);
            let mut data = Vec::with_capacity(s.bag_mib * MIB as usize);
            while data.len() < s.bag_mib * MIB as usize {
                data.extend_from_slice(&r.next().to_le_bytes());
            }
            let path = tmp.join(format!("source{k}"));
            std::fs::write(&path, &data).with_context(|| format!("writing {}", path.display()))?;
            sources.push(data);
            source_paths.push(path);
        }
        let mut total = 0u64;
        let mut bytes = 0u64;
        for g in 0..s.dag_groups() {
            let body: Vec<u8> = Self::group(s, g).flat_map(dag_file).collect();
            total = total.wrapping_add(hash(&body).wrapping_mul(g as u64 + 1));
            bytes += body.len() as u64;
        }
        Ok(Workload {
            expected_result: format!(
                "result aggregates {} bytes {bytes} hash {total:016x}\n",
                s.dag_groups()
            ),
            s: s.clone(),
            sources,
            source_paths,
            direct: AtomicBool::new(true),
            rounds_started: AtomicUsize::new(0),
        })
    }

    /// The DAG files of group `g`.
    fn group(s: &Sizes, g: usize) -> std::ops::Range<usize> {
        g * s.dag_group..((g + 1) * s.dag_group).min(s.dag_files)
    }

    /// One round in a fresh directory below `mount`; `None` if `stop` was set before it
    /// finished (its directory is removed either way).
    fn round(&self, mount: &Path, stop: &AtomicBool) -> anyhow::Result<Option<RoundTimes>> {
        self.round_probed(mount, stop, &|| {})
    }

    /// A round that calls `after_bag` once the bag is written and read back (with all of
    /// it in the mount).
    fn round_probed(
        &self,
        mount: &Path,
        stop: &AtomicBool,
        after_bag: &dyn Fn(),
    ) -> anyhow::Result<Option<RoundTimes>> {
        let n = self.rounds_started.fetch_add(1, Ordering::SeqCst);
        let root = mount.join(format!("round{n}"));
        let r = self.round_in(&root, stop, after_bag);
        let t = Instant::now();
        let rm =
            std::fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()));
        let cleanup = t.elapsed().as_secs_f64();
        match r {
            Ok(Some(mut times)) => {
                rm?;
                times.cleanup = cleanup;
                Ok(Some(times))
            }
            other => other,
        }
    }

    fn round_in(
        &self,
        root: &Path,
        stop: &AtomicBool,
        after_bag: &dyn Fn(),
    ) -> anyhow::Result<Option<RoundTimes>> {
        let s = &self.s;
        let mut t = RoundTimes::default();
        let bag = root.join("bag");
        std::fs::create_dir_all(&bag).with_context(|| format!("mkdir {}", bag.display()))?;

        // (a) the bag: write, then read back.
        let t0 = Instant::now();
        let done = par_for(s.bag_tasks, s.par, stop, |k| {
            let src = &self.source_paths[k % self.source_paths.len()];
            let out = Command::new("dd")
                .arg(format!("if={}", src.display()))
                .arg(format!("of={}", bag.join(format!("f{k}")).display()))
                .args(["bs=1M", &format!("count={}", s.bag_mib)])
                .args(["conv=fsync", "status=none"])
                .stdin(Stdio::null())
                .output()
                .context("running dd")?;
            if !out.status.success() {
                bail!(
                    "dd writing bag file {k}: {} {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            Ok(())
        })?;
        if !done {
            return Ok(None);
        }
        t.bag_write = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let done = par_for(s.bag_tasks, s.par, stop, |k| self.read_back(&bag, k))?;
        if !done {
            return Ok(None);
        }
        t.bag_read = t0.elapsed().as_secs_f64();
        after_bag();

        // (b) the DAG.
        let t0 = Instant::now();
        let s1 = root.join("dag").join("s1");
        let s2 = root.join("dag").join("s2");
        for g in 0..s.dag_groups() {
            let d = s1.join(format!("g{g:04}"));
            std::fs::create_dir_all(&d).with_context(|| format!("mkdir {}", d.display()))?;
        }
        std::fs::create_dir_all(&s2).with_context(|| format!("mkdir {}", s2.display()))?;
        let file_path = |i: usize| {
            s1.join(format!("g{:04}", i / s.dag_group))
                .join(format!("f{i:06}"))
        };
        let done = par_for(s.dag_files, s.par, stop, |i| {
            let p = file_path(i);
            std::fs::write(&p, dag_file(i)).with_context(|| format!("writing {}", p.display()))
        })?;
        if !done {
            return Ok(None);
        }
        let done = par_for(s.dag_groups(), s.par, stop, |g| {
            let mut body = Vec::new();
            for i in Self::group(s, g) {
                let p = file_path(i);
                let got = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
                if got != dag_file(i) {
                    bail!(
                        "{}: wrong contents ({} bytes read, {} expected)",
                        p.display(),
                        got.len(),
                        dag_file_len(i)
                    );
                }
                body.extend_from_slice(&got);
            }
            let mut out = format!(
                "agg {g} files {} bytes {} hash {:016x}\n",
                Self::group(s, g).len(),
                body.len(),
                hash(&body)
            )
            .into_bytes();
            out.extend_from_slice(&body);
            let p = s2.join(format!("a{g:04}"));
            std::fs::write(&p, out).with_context(|| format!("writing {}", p.display()))
        })?;
        if !done {
            return Ok(None);
        }
        let mut total = 0u64;
        let mut bytes = 0u64;
        for g in 0..s.dag_groups() {
            let p = s2.join(format!("a{g:04}"));
            let got = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
            let Some(nl) = got.iter().position(|&b| b == b'\n') else {
                bail!("{}: no header line", p.display());
            };
            let header = String::from_utf8_lossy(&got[..nl]);
            let body = &got[nl + 1..];
            let want = format!("hash {:016x}", hash(body));
            if !header.ends_with(&want) {
                bail!(
                    "{}: header '{header}' does not match its body ({want})",
                    p.display()
                );
            }
            total = total.wrapping_add(hash(body).wrapping_mul(g as u64 + 1));
            bytes += body.len() as u64;
        }
        let result = root.join("dag").join("result");
        let text = format!(
            "result aggregates {} bytes {bytes} hash {total:016x}\n",
            s.dag_groups()
        );
        std::fs::write(&result, &text).with_context(|| format!("writing {}", result.display()))?;
        let back = std::fs::read_to_string(&result)
            .with_context(|| format!("reading {}", result.display()))?;
        if back != self.expected_result {
            bail!(
                "the DAG's result is '{}', expected '{}'",
                back.trim(),
                self.expected_result.trim()
            );
        }
        t.dag = t0.elapsed().as_secs_f64();
        Ok(Some(t))
    }

    /// Read bag file `k` back with dd (direct I/O where the mount takes it) and compare
    /// it with its source.
    fn read_back(&self, bag: &Path, k: usize) -> anyhow::Result<()> {
        let path = bag.join(format!("f{k}"));
        let direct = self.direct.load(Ordering::Relaxed);
        let mut cmd = Command::new("dd");
        cmd.arg(format!("if={}", path.display()))
            .args(["bs=1M", "status=none"]);
        if direct {
            cmd.arg("iflag=direct");
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running dd")?;
        let mut got = Vec::with_capacity(self.s.bag_mib * MIB as usize);
        if let Some(mut out) = child.stdout.take() {
            out.read_to_end(&mut got)?;
        }
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let status = child.wait()?;
        if !status.success() {
            if direct && err.contains("Invalid argument") {
                // The mount refuses O_DIRECT: plain reads from here on (said in the report).
                self.direct.store(false, Ordering::Relaxed);
                return self.read_back(bag, k);
            }
            bail!("dd reading {}: {status} {}", path.display(), err.trim());
        }
        let want = &self.sources[k % self.sources.len()];
        if got != *want {
            let at = got.iter().zip(want.iter()).position(|(a, b)| a != b);
            bail!(
                "{}: read back {} bytes that differ from the {} written (first difference at {:?})",
                path.display(),
                got.len(),
                want.len(),
                at
            );
        }
        Ok(())
    }
}

/// Bytes used by the own and the victim class, from `granule fs status --json`.
fn class_use(json: &str) -> Option<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let (mut own, mut victim) = (0, 0);
    for c in v.get("classes")?.as_array()? {
        let used = c.get("used")?.as_u64()?;
        match c.get("name")?.as_str()? {
            "own" => own += used,
            _ => victim += used,
        }
    }
    Some((own, victim))
}

// ---- the tenant (parent side) -------------------------------------------------------------

/// One tenant run, with the victims' CPU use over it.
#[derive(Clone, Copy, Debug)]
struct TenantRun {
    out: TenantOut,
    wall_s: f64,
    victim_cpu_s: f64,
    throttled: u64,
}

fn run_tenant(
    exe: &Path,
    s: &Sizes,
    placement: &Placement,
    victims: &Victims,
) -> anyhow::Result<TenantRun> {
    let mut child = Command::new(exe)
        .arg("scavenge")
        .env(
            TENANT_ENV,
            format!("{},{}", s.tenant_mib * MIB, s.tenant_passes),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the tenant")?;
    struct Reap<'a>(&'a mut Child);
    impl Drop for Reap<'_> {
        fn drop(&mut self) {
            if let Ok(None) = self.0.try_wait() {
                let _ = self.0.kill();
            }
            let _ = self.0.wait();
        }
    }
    let child = Reap(&mut child);
    placement.to_victim(child.0.id())?;
    let cpu0 = victims.cpu_s();
    let thr0 = victims.throttled();
    let t0 = Instant::now();
    if let Some(stdin) = child.0.stdin.as_mut() {
        stdin.write_all(b"go\n")?;
    }
    drop(child.0.stdin.take());
    let status = loop {
        check_interrupted()?;
        if let Some(st) = child.0.try_wait()? {
            break st;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let wall_s = t0.elapsed().as_secs_f64();
    let victim_cpu_s = victims.cpu_s() - cpu0;
    let throttled = victims.throttled().saturating_sub(thr0);
    if !status.success() {
        bail!("the tenant failed ({status})");
    }
    let mut text = String::new();
    if let Some(mut out) = child.0.stdout.take() {
        out.read_to_string(&mut text)?;
    }
    let out: TenantOut = serde_json::from_str(text.trim())
        .with_context(|| format!("the tenant's output: {text}"))?;
    Ok(TenantRun {
        out,
        wall_s,
        victim_cpu_s,
        throttled,
    })
}

/// The tenant while workload rounds loop on `mount` (from `warm` before it starts until
/// it ends). Returns the run and the rounds that completed meanwhile.
fn tenant_with_workload(
    exe: &Path,
    s: &Sizes,
    placement: &Placement,
    victims: &Victims,
    wl: &Workload,
    mount: &Path,
    warm: Duration,
) -> anyhow::Result<(TenantRun, Vec<RoundTimes>)> {
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        let h = sc.spawn(|| -> anyhow::Result<Vec<RoundTimes>> {
            let mut rounds = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                match wl.round(mount, &stop) {
                    Ok(Some(t)) => rounds.push(t),
                    Ok(None) => break,
                    Err(e) => {
                        stop.store(true, Ordering::SeqCst);
                        return Err(e);
                    }
                }
            }
            Ok(rounds)
        });
        let t0 = Instant::now();
        while t0.elapsed() < warm && !h.is_finished() && !interrupted() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let tenant = if h.is_finished() {
            Err(anyhow::anyhow!(
                "the workload ended before the tenant started"
            ))
        } else {
            run_tenant(exe, s, placement, victims)
        };
        stop.store(true, Ordering::SeqCst);
        let rounds = h
            .join()
            .map_err(|_| anyhow::anyhow!("the workload thread panicked"))?
            .context("the scavenging workload")?;
        Ok((tenant?, rounds))
    })
}

// ---- the benchmark ------------------------------------------------------------------------

/// Run the benchmark and write its report (or, in the tenant child, be the tenant).
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    if let Ok(spec) = std::env::var(TENANT_ENV) {
        // The tenant child: run, print, and leave without going back through the CLI.
        let code = match tenant_main(&spec) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("scavenge tenant: {e:#}");
                1
            }
        };
        std::process::exit(code);
    }
    if let Err(e) = catch_signals() {
        eprintln!(
            "scavenge: no Ctrl-C handler of its own ({e}); a signal ends the process at once"
        );
    }
    let _active = Active::begin(
        "scavenge: interrupted; unmounting and stopping the children (again to quit at once)",
    );
    let s = Sizes::new(opts.quick, opts.reps);
    // This executable runs the tenant; the `granule` binary beside it, the stores and
    // the mounts.
    let exe = std::env::current_exe().context("the path of this executable")?;
    let granule = crate::granule_exe()?;
    // Provenance before the pinning (it records the CPUs this process may use).
    let mut meta = Meta::collect(String::new(), opts.quick);

    // Scratch: the sources (tmpfs where there is one), logs, mount points.
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let tmp = base.join(format!("granule-bench-scavenge-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    struct RemoveDir(PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = RemoveDir(tmp.clone());
    // The children's logs, outside the scratch directory: they outlive a failed run
    // (and are removed after a successful one).
    let log = std::env::temp_dir().join(format!(
        "granule-bench-scavenge-{}-logs",
        std::process::id()
    ));
    std::fs::create_dir_all(&log).with_context(|| format!("creating {}", log.display()))?;

    let (scav_nodes, res_nodes) = (s.scav_nodes(), s.res_nodes());
    let weight = s.victim_weight();
    let steps = 3 + 2 * s.pairs + 2 * s.rounds;
    let progress = granule_report::Progress::new(steps as u64, "scavenge");
    progress.note(format!(
        "data per round {:.1} MiB; scavenging: {scav_nodes} own node(s) of {} MiB + {} stores of {} MiB \
         (victim weight {weight}); reservation: {res_nodes} own nodes of {} MiB; logs: {}",
        mib(s.data_bytes()),
        s.node_mem_mib,
        s.victims,
        s.victim_bytes() / MIB,
        s.node_mem_mib,
        log.display()
    ));

    // Declared in this order so they drop in the reverse one: mounts, then stores, then
    // the cpusets (and the driver's own affinity).
    let placement = Placement::set_up();
    let wl = Workload::new(&s, &tmp)?;
    let mut victims = Victims::start(&granule, s.victims, s.victim_bytes(), &placement, &log)?;
    progress.step("victim stores up");
    let mut scav = Mount::start(
        &granule,
        &tmp.join("mnt-scavenge"),
        &s.node_spec(scav_nodes),
        scav_nodes,
        Some((&victims, weight)),
        &log.join("mount-scavenging.log"),
    )?;
    progress.step("scavenging mount up");
    let mut res = Mount::start(
        &granule,
        &tmp.join("mnt-reservation"),
        &s.node_spec(res_nodes),
        res_nodes,
        None,
        &log.join("mount-reservation.log"),
    )?;
    progress.step("reservation mount up");

    // One untimed round on each mount: first-use costs out of the way, and a broken
    // mount fails here rather than under the tenant.
    let never = AtomicBool::new(false);
    // The scavenging mount's status with a whole bag in it: where the stripes went.
    let bag_status: Mutex<Option<String>> = Mutex::new(None);
    wl.round_probed(&scav.dir, &never, &|| {
        *bag_status.lock().unwrap_or_else(|p| p.into_inner()) = scav.status();
    })
    .context("a first round on the scavenging mount")?;
    wl.round(&res.dir, &never)
        .context("a first round on the reservation mount")?;

    // Tenant pairs.
    let warm = if s.bag_tasks > 8 {
        Duration::from_secs(2)
    } else {
        Duration::from_millis(500)
    };
    struct Pair {
        with_first: bool,
        alone: TenantRun,
        with: TenantRun,
        rounds: Vec<RoundTimes>,
    }
    let mut pairs: Vec<Pair> = Vec::new();
    for p in 0..s.pairs {
        let with_first = p % 2 == 1;
        let mut alone = None;
        let mut with = None;
        for w in [with_first, !with_first] {
            check_interrupted()?;
            victims.check_alive()?;
            scav.check_alive()?;
            if w {
                let (t, rounds) =
                    tenant_with_workload(&exe, &s, &placement, &victims, &wl, &scav.dir, warm)?;
                progress.step(format!(
                    "pair {p}: tenant with scavenging {:.2} s, victims {:.1}% of a vCPU, {} rounds",
                    t.out.run_s,
                    100.0 * t.victim_cpu_s / t.wall_s,
                    rounds.len()
                ));
                with = Some((t, rounds));
            } else {
                let t = run_tenant(&exe, &s, &placement, &victims)?;
                progress.step(format!("pair {p}: tenant alone {:.2} s", t.out.run_s));
                alone = Some(t);
            }
        }
        if let (Some(alone), Some((with, rounds))) = (alone, with) {
            pairs.push(Pair {
                with_first,
                alone,
                with,
                rounds,
            });
        }
    }

    // Node-seconds: rounds alternating between the mounts, the tenant not running.
    let mut scav_rounds: Vec<RoundTimes> = Vec::new();
    let mut res_rounds: Vec<RoundTimes> = Vec::new();
    for r in 0..s.rounds {
        let order = if r % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for is_scav in order {
            check_interrupted()?;
            let (m, out) = if is_scav {
                (&mut scav, &mut scav_rounds)
            } else {
                (&mut res, &mut res_rounds)
            };
            m.check_alive()?;
            let t = wl.round(&m.dir, &never)?.context("a round was stopped")?;
            progress.step(format!(
                "round {r} on the {} mount: {:.2} s",
                if is_scav { "scavenging" } else { "reservation" },
                t.total()
            ));
            out.push(t);
        }
    }
    // Space per class and store, as the mount reports it (between rounds).
    let bag_status = bag_status.into_inner().unwrap_or_else(|p| p.into_inner());
    let used = bag_status.as_deref().and_then(class_use);
    let victim_rss = victims.resident();
    progress.finish();

    // ---- figures
    let slowdowns: Vec<f64> = pairs
        .iter()
        .map(|p| p.with.out.run_s / p.alone.out.run_s - 1.0)
        .collect();
    let fractions: Vec<f64> = pairs
        .iter()
        .map(|p| p.with.victim_cpu_s / p.with.wall_s)
        .collect();
    let alone_fractions: Vec<f64> = pairs
        .iter()
        .map(|p| p.alone.victim_cpu_s / p.alone.wall_s)
        .collect();
    let tenant_slowdown = median(&slowdowns);
    let victim_cpu_fraction = median(&fractions);
    let alone_s = median(&pairs.iter().map(|p| p.alone.out.run_s).collect::<Vec<_>>());
    let with_s = median(&pairs.iter().map(|p| p.with.out.run_s).collect::<Vec<_>>());
    let t_scav = median(
        &scav_rounds
            .iter()
            .map(RoundTimes::total)
            .collect::<Vec<_>>(),
    );
    let t_res = median(&res_rounds.iter().map(RoundTimes::total).collect::<Vec<_>>());
    let ns_scav = scav.own_nodes as f64 * t_scav;
    let ns_res = res.own_nodes as f64 * t_res;
    let ns_ratio = ns_scav / ns_res;
    let during: Vec<RoundTimes> = pairs.iter().flat_map(|p| p.rounds.clone()).collect();
    let t_during = median(&during.iter().map(RoundTimes::total).collect::<Vec<_>>());
    // The tenant's CPU time (what interference through caches and memory bandwidth
    // changes) and its run-queue wait beyond what the stores ran (other programs).
    let cpu_slowdowns: Vec<f64> = pairs
        .iter()
        .map(|p| p.with.out.cpu_s / p.alone.out.cpu_s - 1.0)
        .collect();
    let others = |t: &TenantRun| (t.out.wait_s - t.victim_cpu_s).max(0.0);
    // The run the tenant would have had with only the stores beside it: its CPU time
    // stretched by the share of the vCPU the stores took over the run (T = cpu + f·T).
    // An estimate, for a machine where other programs got in the way.
    let stores_only = |t: &TenantRun| t.out.cpu_s / (1.0 - (t.victim_cpu_s / t.wall_s).min(0.99));
    let from_stores: Vec<f64> = pairs
        .iter()
        .map(|p| stores_only(&p.with) / stores_only(&p.alone) - 1.0)
        .collect();
    let others_with = median(&pairs.iter().map(|p| others(&p.with)).collect::<Vec<_>>());
    let others_alone = median(&pairs.iter().map(|p| others(&p.alone)).collect::<Vec<_>>());

    // ---- tables
    let mut table = Table::new(&[
        "pair",
        "order",
        "tenant alone s",
        "tenant with scavenging s",
        "slowdown",
        "victim CPU fraction (with)",
        "victim CPU fraction (alone)",
        "tenant CPU s alone",
        "tenant CPU s with",
        "tenant wait s alone",
        "tenant wait s with",
        "store CPU s (with)",
        "rounds during the run",
        "periods throttled",
        "tenant checksums agree",
    ]);
    for (i, p) in pairs.iter().enumerate() {
        table.row(vec![
            Cell::from(i as f64),
            Cell::from(if p.with_first {
                "with, alone"
            } else {
                "alone, with"
            }),
            Cell::from(p.alone.out.run_s),
            Cell::from(p.with.out.run_s),
            Cell::from(slowdowns[i]),
            Cell::from(fractions[i]),
            Cell::from(alone_fractions[i]),
            Cell::from(p.alone.out.cpu_s),
            Cell::from(p.with.out.cpu_s),
            Cell::from(p.alone.out.wait_s),
            Cell::from(p.with.out.wait_s),
            Cell::from(p.with.victim_cpu_s),
            Cell::from(p.rounds.len() as f64),
            Cell::from(p.with.throttled as f64),
            Cell::from(if p.alone.out.checksum == p.with.out.checksum {
                "yes"
            } else {
                "NO"
            }),
        ]);
    }
    let bag_mib = (s.bag_tasks * s.bag_mib) as f64;
    let mut rounds_table = Table::new(&[
        "mount",
        "when",
        "round",
        "bag write s",
        "bag write MiB/s",
        "bag read s",
        "bag read MiB/s",
        "DAG s",
        "cleanup s",
        "total s",
    ]);
    let mut add_rounds =
        |mount: &str, when: &str, v: &[RoundTimes], label: &dyn Fn(usize) -> String| {
            for (i, t) in v.iter().enumerate() {
                rounds_table.row(vec![
                    Cell::from(mount),
                    Cell::from(when),
                    Cell::from(label(i)),
                    Cell::from(t.bag_write),
                    Cell::from(bag_mib / t.bag_write),
                    Cell::from(t.bag_read),
                    Cell::from(bag_mib / t.bag_read),
                    Cell::from(t.dag),
                    Cell::from(t.cleanup),
                    Cell::from(t.total()),
                ]);
            }
        };
    let index = |i: usize| i.to_string();
    add_rounds("scavenging", "alone", &scav_rounds, &index);
    add_rounds("reservation", "alone", &res_rounds, &index);
    // Beside the tenant: one row per pair, the median of each column over its rounds.
    let medians: Vec<RoundTimes> = pairs
        .iter()
        .map(|p| {
            let m = |f: fn(&RoundTimes) -> f64| median(&p.rounds.iter().map(f).collect::<Vec<_>>());
            RoundTimes {
                bag_write: m(|t| t.bag_write),
                bag_read: m(|t| t.bag_read),
                dag: m(|t| t.dag),
                cleanup: m(|t| t.cleanup),
            }
        })
        .collect();
    add_rounds("scavenging", "beside the tenant", &medians, &|i| {
        format!("pair {i}: median of {}", pairs[i].rounds.len())
    });

    // ---- plots
    let plot = Plot::bars("tenant run time on the victim vCPU: alone vs beside scavenging")
        .y_label("seconds (fixed work)")
        .categories((0..pairs.len()).map(|i| format!("pair {i}")))
        .bar_series("alone", pairs.iter().map(|p| p.alone.out.run_s))
        .bar_series("with scavenging", pairs.iter().map(|p| p.with.out.run_s));
    let ns_plot = Plot::bars("node-seconds per round: scavenging vs a fixed reservation")
        .y_label("own nodes × median round time (s)")
        .categories([
            format!(
                "scavenging ({} own + {} victim stores)",
                scav.own_nodes, s.victims
            ),
            format!("reservation ({} own)", res.own_nodes),
        ])
        .bar_series("node-seconds", [ns_scav, ns_res]);

    // ---- report
    meta.placement = placement.describe();
    let cap = match (&victims.cap, &victims.no_cap) {
        (Some(_), _) => format!(
            "one cpu cgroup over all {} stores with a CFS quota of {} core (period {} ms)",
            s.victims,
            victim_cores(),
            granule_host::CFS_PERIOD_US / 1000
        ),
        (None, why) => format!(
            "NO CPU cap (cgroup v1 cpu unavailable: {})",
            why.as_deref().unwrap_or("?")
        ),
    };
    meta.note(format!(
        "victim side: {} stores (`granule store --bytes {}MiB`, no-eviction), {cap}; the tenant: {} MiB, \
         filled, then {} sweeps in a scrambled order of 64 KiB blocks, each word replaced by a hash of \
         itself (one thread); its sweep time is the figure (fill time excluded).",
        s.victims,
        victims.bytes_each / MIB,
        s.tenant_mib,
        s.tenant_passes
    ));
    meta.note(format!(
        "own side: the scavenging mount `granule fs mount --nodes \"{}\" --victims <{} stores> \
         --victim-weight {weight} --replicas 1` (own class weight 1: about {:.0}% of the stripes on \
         victims); the reservation mount `--nodes \"{}\"` ({res_nodes} nodes of {} MiB, sized as \
         data × 1.25 over the {} MiB of stripes a node holds: fs.own_share {} of its memory). Stripes \
         of 1 MiB (the default).",
        s.node_spec(scav_nodes),
        s.victims,
        100.0 * weight / (1.0 + weight),
        s.node_spec(res_nodes),
        s.node_mem_mib,
        s.node_usable() / MIB,
        own_share(),
    ));
    meta.note(format!(
        "one round: {} × `dd bs=1M count={} conv=fsync` ({} at a time, from {} random sources on tmpfs), \
         read back with `dd bs=1M{}` and compared; a DAG of {} small files (1-8 KiB) → {} aggregates → \
         1 result, verified; then the round's directory removed. {:.1} MiB at the peak of a round.",
        s.bag_tasks,
        s.bag_mib,
        s.par,
        wl.sources.len(),
        if wl.direct.load(Ordering::Relaxed) {
            " iflag=direct"
        } else {
            "` (plain: the mount refused O_DIRECT)`"
        },
        s.dag_files,
        s.dag_groups(),
        mib(s.data_bytes())
    ));
    meta.note(format!(
        "tenant_slowdown: median over {} pairs (alone, with) in alternating order, the mounts and \
         stores idle in the alone runs; in the with runs workload rounds loop on the scavenging \
         mount from {:.1} s before the tenant starts until it ends. victim_cpu_fraction: the stores' \
         utime+stime over a with run / its wall time (median). node_seconds_vs_reservation: \
         {scav_nodes} × {t_scav:.2} s / ({res_nodes} × {t_res:.2} s), median round times of {} rounds \
         per mount, alternating, the tenant not running (rounds beside the tenant: median {t_during:.2} s).",
        pairs.len(),
        warm.as_secs_f64(),
        s.rounds
    ));
    meta.note(format!(
        "the victim stores' resident memory at the end: {:.0} MiB; mount banners: '{}' / '{}'",
        mib(victim_rss),
        scav.banner,
        res.banner
    ));
    match (&used, &bag_status) {
        (Some((own, victim)), _) => meta.note(format!(
            "where a round's bag went on the scavenging mount (`granule fs status --json`, the bag \
             written and read back): {:.1} MiB on the own node(s), {:.1} MiB on the victim stores \
             ({:.0}% on victims).",
            mib(*own),
            mib(*victim),
            100.0 * *victim as f64 / (*own + *victim).max(1) as f64
        )),
        (None, Some(st)) => meta.note(format!(
            "`granule fs status --json` of the scavenging mount with a bag in it (unparsed): {st}"
        )),
        (None, None) => meta.note("`granule fs status --json` did not answer"),
    };
    meta.note(format!(
        "the tenant's CPU time with vs alone: median {:+.3}; its run-queue wait beyond the stores' \
         CPU time (other programs on vCPU {VICTIM_CPU}): median {others_with:.2} s in the with runs, \
         {others_alone:.2} s alone. tenant_slowdown_from_stores ({:.3}) estimates the slowdown with \
         the stores as its only neighbours: the tenant's CPU time over (1 - the stores' share of \
         the vCPU during the run), with over alone.",
        median(&cpu_slowdowns),
        median(&from_stores)
    ));
    if others_with > 0.05 * with_s || others_alone > 0.05 * alone_s {
        meta.note(format!(
            "NOISY MACHINE: programs outside this benchmark took vCPU {VICTIM_CPU} from the tenant \
             (median {others_with:.2} s of its {with_s:.2} s with scavenging, {others_alone:.2} s of \
             {alone_s:.2} s alone); the slowdown is not the stores' alone. The own side keeps vCPU \
             {OWN_CPU} busy in the with runs, so the scheduler moves other work to vCPU {VICTIM_CPU} \
             then more than in the alone runs."
        ));
    }
    if tenant_slowdown > 0.10 {
        meta.note(format!(
            "TARGET MISSED: tenant_slowdown = {tenant_slowdown:.3} > 0.10."
        ));
    }
    let mut rep = Report::new("scavenge", meta);
    rep.title("Benchmark: scavenge — a bag of writers and a DAG over own nodes plus victim stores, beside a tenant");
    rep.table(table);
    rep.plot(plot);
    rep.extra_table("rounds", rounds_table);
    rep.extra_plot("node_seconds", ns_plot);
    rep.summary("tenant_slowdown", tenant_slowdown);
    rep.summary("node_seconds_vs_reservation", ns_ratio);
    rep.summary("victim_cpu_fraction", victim_cpu_fraction);
    rep.summary("tenant_alone_s", alone_s);
    rep.summary("tenant_with_s", with_s);
    rep.summary("tenant_cpu_slowdown", median(&cpu_slowdowns));
    rep.summary("tenant_slowdown_from_stores", median(&from_stores));
    rep.summary("tenant_wait_others_s_with", others_with);
    rep.summary("tenant_wait_others_s_alone", others_alone);
    rep.summary(
        "tenant_slowdown_max",
        slowdowns.iter().copied().fold(f64::NAN, f64::max),
    );
    rep.summary("round_s_scavenging", t_scav);
    rep.summary("round_s_reservation", t_res);
    rep.summary("round_s_beside_tenant", t_during);
    rep.summary("node_seconds_scavenging", ns_scav);
    rep.summary("node_seconds_reservation", ns_res);
    rep.summary("own_nodes_scavenging", scav.own_nodes as f64);
    rep.summary("own_nodes_reservation", res.own_nodes as f64);
    rep.summary("victim_stores", s.victims as f64);
    rep.summary(
        "victim_cpu_cap_cores",
        if victims.cap.is_some() {
            victim_cores()
        } else {
            f64::NAN
        },
    );
    rep.summary("victim_weight", weight);
    rep.summary("data_mib", mib(s.data_bytes()));
    if let Some((own, victim)) = used {
        rep.summary("bag_mib_on_own", mib(own));
        rep.summary("bag_mib_on_victims", mib(victim));
    }
    res.signal_stop();
    scav.signal_stop();
    drop(res);
    drop(scav);
    drop(victims);
    let dir = rep.write(&opts.out)?;
    let _ = std::fs::remove_dir_all(&log);
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_hold_the_data() {
        for quick in [true, false] {
            let s = Sizes::new(quick, None);
            let data = s.data_bytes();
            assert!(s.res_nodes() as u64 * s.node_usable() >= data, "{s:?}");
            assert!(
                s.scav_nodes() as u64 * s.node_usable() < data || quick,
                "{s:?}"
            );
            let w = s.victim_weight();
            let own_share = data as f64 / (1.0 + w);
            assert!(own_share <= 0.5 * (s.scav_nodes() as u64 * s.node_usable()) as f64);
            let victim_share = data as f64 * w / (1.0 + w);
            assert!((s.victims as u64 * s.victim_bytes()) as f64 >= 1.4 * victim_share);
        }
    }

    #[test]
    fn dag_files_are_deterministic_and_sized() {
        for i in [0, 1, 999] {
            let f = dag_file(i);
            assert_eq!(f.len(), dag_file_len(i));
            assert!((1024..8192).contains(&f.len()));
            assert_eq!(f, dag_file(i));
        }
        assert_ne!(dag_file(1), dag_file(2));
        assert_ne!(hash(&dag_file(1)), hash(&dag_file(2)));
    }

    #[test]
    fn class_use_reads_the_status() {
        let st = r#"{"classes":[{"name":"own","weight":1.0,"stores":1,"capacity":75497472,"used":8388608},
                    {"name":"victim","weight":2.0,"stores":1,"capacity":67108864,"used":12583344}]}"#;
        assert_eq!(class_use(st), Some((8388608, 12583344)));
        assert_eq!(class_use("{}"), None);
    }

    #[test]
    fn tenant_work_is_fixed() {
        let a = tenant_work(3 * TENANT_BLOCK_WORDS + 5, 3);
        let b = tenant_work(3 * TENANT_BLOCK_WORDS + 5, 3);
        assert_eq!(a.checksum, b.checksum);
        assert!(a.cpu_s <= a.run_s + 0.01, "{a:?}");
    }

    /// A round against a plain directory: the workload itself, without a mount.
    #[test]
    fn a_round_in_a_plain_directory() {
        let t = std::env::temp_dir().join(format!("scavenge-test-{}", std::process::id()));
        std::fs::create_dir_all(&t).unwrap();
        let s = Sizes {
            bag_tasks: 3,
            bag_mib: 1,
            dag_files: 25,
            ..Sizes::new(true, None)
        };
        let wl = Workload::new(&s, &t).unwrap();
        let stop = AtomicBool::new(false);
        let r = wl.round(&t, &stop);
        let left: Vec<_> = std::fs::read_dir(&t)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        std::fs::remove_dir_all(&t).unwrap();
        let r = r.unwrap().unwrap();
        assert!(r.total() > 0.0);
        assert_eq!(
            left.len(),
            SOURCES.min(3),
            "only the sources are left: {left:?}"
        );
    }
}
