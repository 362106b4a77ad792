//! `granule-bench consumer`: a YCSB-like application (Zipfian keys, 95 % reads, 5 %
//! writes) whose working set exceeds its local memory, with and without leased memory.
//!
//! - **Application**: a child process (this binary again, `granule-bench consumer` with
//!   `GRANULE_BENCH_CONSUMER_APP` set) placed in a memory cgroup (v1, made with the host
//!   crate's `ClusterGroups`; `memory.limit_in_bytes` counts page cache) before it
//!   allocates anything. One client thread, one operation at a time. Its local memory is
//!   an in-process CLOCK cache of `local_items` values; a read that misses it goes to the
//!   leased cache ([`KvCache`], integrity-only or encrypted) if there is one, else (or on
//!   a leased miss) to the backing store; a write goes to the backing store, then updates
//!   the local and the leased cache.
//! - **Backing stores**: (a) a file on disk read and written with `O_DIRECT` (one 4 KiB
//!   aligned block per key: no page cache); (b) a service in the parent process that
//!   answers each request over loopback TCP after a fixed 1 ms (a database query).
//! - **Leased memory**: stores started by the parent (outside the cgroup), sized for the
//!   whole data set, loaded by the application before it measures (a warm cache, as
//!   after a long run).
//! - **Measured**: after warm-up operations (in every configuration alike), the latency
//!   of every operation, and of the reads that miss local memory (the *miss latency*:
//!   what leased memory changes); every value read is checked against what was written.
//! - **Headline**: `speedup_p50_encrypted` and `speedup_p99_encrypted` = miss latency
//!   p50 (p99) without leased memory ÷ with encrypted leased memory, case (b);
//!   `speedup_p50_encrypted_disk` the same p50 ratio for case (a).

use crate::kv_secure::{rand_u64, Rng, StoreProc};
use crate::zipf::Zipf;
use crate::BenchOpts;
use anyhow::Context;
use granule_host::{ClusterGroups, Hierarchy};
use granule_market::consumer::{KvCache, LeaseGrant, LeaseSource, Protection, StaticLeases};
use granule_report::stats::Latency;
use granule_report::{Cell, Meta, Plot, Report, Table};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufRead, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set in the application child: the path of its [`AppConfig`] (JSON).
const APP_ENV: &str = "GRANULE_BENCH_CONSUMER_APP";
const BLOCK: usize = 4096;
const VALUE_BYTES: usize = 1024;
const SERVER_CPU: usize = 0;
const APP_CPU: usize = 1;
const SERVICE_COST: Duration = Duration::from_millis(1);
const ZIPF_THETA: f64 = 0.99;
const READ_FRACTION: f64 = 0.95;

/// One 4 KiB-aligned block: `O_DIRECT` needs aligned buffers, and an aligned type keeps
/// that in safe code.
#[repr(C, align(4096))]
struct Block([u8; BLOCK]);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Case {
    Disk,
    Service,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Disk => "disk (O_DIRECT)",
            Case::Service => "service (1 ms)",
        }
    }
}

/// What the parent tells the application child.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct AppConfig {
    case: Case,
    /// `None`: no leased memory.
    protection: Option<String>,
    grants: Vec<LeaseGrant>,
    keys: u64,
    local_items: usize,
    warmup_ops: u64,
    ops: u64,
    seed: u64,
    disk_path: PathBuf,
    service_addr: String,
    result_path: PathBuf,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Dist {
    count: u64,
    #[serde(deserialize_with = "nan_from_null")]
    p50_us: f64,
    #[serde(deserialize_with = "nan_from_null")]
    p99_us: f64,
    #[serde(deserialize_with = "nan_from_null")]
    mean_us: f64,
}

/// An empty distribution's figures are NaN, which JSON writes as `null`: read it back.
fn nan_from_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl Dist {
    fn of(l: &Latency) -> Dist {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        if l.is_empty() {
            return Dist {
                count: 0,
                p50_us: f64::NAN,
                p99_us: f64::NAN,
                mean_us: f64::NAN,
            };
        }
        Dist {
            count: l.count(),
            p50_us: us(l.p(0.5)),
            p99_us: us(l.p(0.99)),
            mean_us: us(l.mean()),
        }
    }
}

/// What the application child reports.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct AppResult {
    all: Dist,
    reads: Dist,
    writes: Dist,
    /// Reads that missed local memory (leased hits and backing reads).
    local_misses: Dist,
    leased_hits: Dist,
    backing_reads: Dist,
    wrong_values: u64,
    verification_failures: u64,
    leased_misses: u64,
    preload_secs: f64,
    run_secs: f64,
}

pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    if let Ok(cfg) = std::env::var(APP_ENV) {
        // The application child: run, write the result, and leave without going back
        // through the CLI (which would print a report that this process did not write).
        let code = match app_main(Path::new(&cfg)) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("consumer application: {e:#}");
                1
            }
        };
        std::process::exit(code);
    }
    parent(opts)
}

// ---- the application (child) --------------------------------------------------------

fn app_main(cfg_path: &Path) -> anyhow::Result<()> {
    // Wait for the parent to have placed this process in its cgroup.
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let cfg: AppConfig = serde_json::from_str(&std::fs::read_to_string(cfg_path)?)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let res = rt.block_on(app(&cfg))?;
    std::fs::write(&cfg.result_path, serde_json::to_vec(&res)?)?;
    Ok(())
}

/// The backing store the application misses to.
enum Backing {
    Disk {
        file: std::fs::File,
        block: Box<Block>,
    },
    Service {
        conn: std::net::TcpStream,
    },
}

impl Backing {
    fn read(&mut self, key: u64) -> anyhow::Result<Vec<u8>> {
        match self {
            Backing::Disk { file, block } => {
                file.read_exact_at(&mut block.0, key * BLOCK as u64)?;
                Ok(block.0[..VALUE_BYTES].to_vec())
            }
            Backing::Service { conn } => {
                let mut req = [0u8; 17];
                req[1..9].copy_from_slice(&key.to_le_bytes());
                conn.write_all(&req)?;
                let mut v = vec![0u8; VALUE_BYTES];
                conn.read_exact(&mut v)?;
                Ok(v)
            }
        }
    }

    fn write(&mut self, key: u64, version: u64, value: &[u8]) -> anyhow::Result<()> {
        match self {
            Backing::Disk { file, block } => {
                block.0[..VALUE_BYTES].copy_from_slice(value);
                file.write_all_at(&block.0, key * BLOCK as u64)?;
                Ok(())
            }
            Backing::Service { conn } => {
                let mut req = [1u8; 17];
                req[1..9].copy_from_slice(&key.to_le_bytes());
                req[9..17].copy_from_slice(&version.to_le_bytes());
                conn.write_all(&req)?;
                let mut ack = [0u8; 1];
                conn.read_exact(&mut ack)?;
                Ok(())
            }
        }
    }
}

/// The value of `key` at `version`: its first 16 bytes say which, the rest is derived
/// from them (so a read can be checked without remembering values).
fn value_of(key: u64, version: u64) -> Vec<u8> {
    let mut v = vec![0u8; VALUE_BYTES];
    v[..8].copy_from_slice(&key.to_le_bytes());
    v[8..16].copy_from_slice(&version.to_le_bytes());
    let mut r = Rng((key.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version) | 1);
    for c in v[16..].chunks_mut(8) {
        let x = r.next().to_le_bytes();
        c.copy_from_slice(&x[..c.len()]);
    }
    v
}

/// Whether `v` is a value `key` may have now: self-consistent, of this key, and not
/// older than the last version this process wrote.
fn check(v: &[u8], key: u64, min_version: u64) -> bool {
    if v.len() != VALUE_BYTES || v[..8] != key.to_le_bytes() {
        return false;
    }
    let mut ver = [0u8; 8];
    ver.copy_from_slice(&v[8..16]);
    let ver = u64::from_le_bytes(ver);
    ver >= min_version && v == value_of(key, ver).as_slice()
}

/// The local memory: a CLOCK cache of `cap` values.
struct Clock {
    slots: Vec<(u64, Vec<u8>, bool)>,
    index: HashMap<u64, usize>,
    hand: usize,
    cap: usize,
}

impl Clock {
    fn new(cap: usize) -> Clock {
        Clock {
            slots: Vec::with_capacity(cap),
            index: HashMap::with_capacity(cap),
            hand: 0,
            cap: cap.max(1),
        }
    }

    fn get(&mut self, key: u64) -> Option<&[u8]> {
        let i = *self.index.get(&key)?;
        self.slots[i].2 = true;
        Some(&self.slots[i].1)
    }

    fn put(&mut self, key: u64, v: Vec<u8>) {
        if let Some(&i) = self.index.get(&key) {
            self.slots[i].1 = v;
            self.slots[i].2 = true;
            return;
        }
        if self.slots.len() < self.cap {
            self.index.insert(key, self.slots.len());
            self.slots.push((key, v, false));
            return;
        }
        loop {
            let s = &mut self.slots[self.hand];
            if s.2 {
                s.2 = false;
                self.hand = (self.hand + 1) % self.cap;
                continue;
            }
            self.index.remove(&s.0);
            *s = (key, v, false);
            self.index.insert(key, self.hand);
            self.hand = (self.hand + 1) % self.cap;
            return;
        }
    }
}

async fn app(cfg: &AppConfig) -> anyhow::Result<AppResult> {
    let mut backing = match cfg.case {
        Case::Disk => Backing::Disk {
            file: std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc_o_direct())
                .open(&cfg.disk_path)
                .with_context(|| format!("opening {} with O_DIRECT", cfg.disk_path.display()))?,
            block: Box::new(Block([0; BLOCK])),
        },
        Case::Service => {
            let conn = std::net::TcpStream::connect(&cfg.service_addr)?;
            conn.set_nodelay(true)?;
            Backing::Service { conn }
        }
    };
    let leased = match &cfg.protection {
        None => None,
        Some(p) => {
            let src: Arc<dyn LeaseSource> = Arc::new(StaticLeases::new(cfg.grants.clone()));
            let slabs = cfg.grants.iter().map(|g| g.slabs).sum();
            let c = KvCache::new(src, Protection::parse(p)?, slabs).await?;
            anyhow::ensure!(
                c.stats().leases as usize == cfg.grants.len(),
                "not every lease connected"
            );
            Some(c)
        }
    };
    let mut local = Clock::new(cfg.local_items);
    let mut min_version = vec![0u64; cfg.keys as usize];
    let mut res = AppResult::default();
    // Leased memory starts warm: the whole data set, read from the backing store.
    let t0 = Instant::now();
    if let Some(kv) = &leased {
        for k in 0..cfg.keys {
            let v = backing.read(k)?;
            kv.put(&k.to_le_bytes(), &v).await?;
        }
    }
    res.preload_secs = t0.elapsed().as_secs_f64();

    let zipf = Zipf::new(cfg.keys, ZIPF_THETA);
    let mut rng = Rng(cfg.seed | 1);
    let (mut all, mut reads, mut writes) = (Latency::new(), Latency::new(), Latency::new());
    let (mut misses, mut leased_hits, mut backing_reads) =
        (Latency::new(), Latency::new(), Latency::new());
    let mut version = 1u64 + (cfg.seed >> 40);
    let t_run = Instant::now();
    for op in 0..cfg.warmup_ops + cfg.ops {
        let measure = op >= cfg.warmup_ops;
        let key = zipf.next(&mut rng);
        let is_read = (rng.next() >> 11) as f64 / ((1u64 << 53) as f64) < READ_FRACTION;
        let t = Instant::now();
        if is_read {
            let (value, from) = match local.get(key).map(|v| v.to_vec()) {
                Some(v) => (v, 0),
                None => {
                    let hit = match &leased {
                        Some(kv) => kv.get(&key.to_le_bytes()).await?,
                        None => None,
                    };
                    match hit {
                        Some(v) => {
                            local.put(key, v.clone());
                            (v, 1)
                        }
                        None => {
                            let v = backing.read(key)?;
                            local.put(key, v.clone());
                            if let Some(kv) = &leased {
                                res.leased_misses += measure as u64;
                                kv.put(&key.to_le_bytes(), &v).await?;
                            }
                            (v, 2)
                        }
                    }
                }
            };
            let d = t.elapsed();
            if !check(&value, key, min_version[key as usize]) {
                res.wrong_values += 1;
            }
            if measure {
                all.record(d);
                reads.record(d);
                match from {
                    0 => {}
                    1 => {
                        misses.record(d);
                        leased_hits.record(d);
                    }
                    _ => {
                        misses.record(d);
                        backing_reads.record(d);
                    }
                }
            }
        } else {
            version += 1;
            let v = value_of(key, version);
            backing.write(key, version, &v)?;
            if let Some(kv) = &leased {
                kv.put(&key.to_le_bytes(), &v).await?;
            }
            local.put(key, v);
            let d = t.elapsed();
            min_version[key as usize] = version;
            if measure {
                all.record(d);
                writes.record(d);
            }
        }
    }
    res.run_secs = t_run.elapsed().as_secs_f64();
    res.all = Dist::of(&all);
    res.reads = Dist::of(&reads);
    res.writes = Dist::of(&writes);
    res.local_misses = Dist::of(&misses);
    res.leased_hits = Dist::of(&leased_hits);
    res.backing_reads = Dist::of(&backing_reads);
    res.verification_failures = leased
        .as_ref()
        .map_or(0, |kv| kv.stats().verification_failures);
    Ok(res)
}

fn libc_o_direct() -> i32 {
    nix::fcntl::OFlag::O_DIRECT.bits()
}

// ---- the parent -----------------------------------------------------------------------

/// The backing service: answers each request after a fixed cost; keeps each key's
/// version so reads return what was last written.
fn start_service(
    keys: u64,
    cpu: Option<usize>,
) -> anyhow::Result<(String, std::thread::JoinHandle<()>)> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?.to_string();
    let h = std::thread::spawn(move || {
        if let Some(cpu) = cpu {
            let _ = crate::affinity::pin_current_thread(cpu);
        }
        let mut versions = vec![0u64; keys as usize];
        // One application at a time; the service ends when the parent connects to stop it.
        while let Ok((mut s, _)) = l.accept() {
            let _ = s.set_nodelay(true);
            let mut req = [0u8; 17];
            let mut served = false;
            while s.read_exact(&mut req).is_ok() {
                served = true;
                let mut kb = [0u8; 8];
                kb.copy_from_slice(&req[1..9]);
                let key = u64::from_le_bytes(kb) % keys;
                std::thread::sleep(SERVICE_COST);
                let reply = if req[0] == 0 {
                    value_of(key, versions[key as usize])
                } else {
                    let mut vb = [0u8; 8];
                    vb.copy_from_slice(&req[9..17]);
                    versions[key as usize] = u64::from_le_bytes(vb);
                    vec![1]
                };
                if s.write_all(&reply).is_err() {
                    break;
                }
            }
            if !served {
                return;
            }
        }
    });
    Ok((addr, h))
}

/// Write the data set: one block per key, `O_DIRECT` (nothing left in the page cache).
fn write_disk(path: &Path, keys: u64) -> anyhow::Result<()> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc_o_direct())
        .open(path)
        .with_context(|| format!("creating {} with O_DIRECT", path.display()))?;
    // 64 blocks per write: fewer system calls.
    const CHUNK: usize = 64;
    let mut bufs: Vec<Block> = (0..CHUNK).map(|_| Block([0; BLOCK])).collect();
    let mut k = 0;
    while k < keys {
        let n = (keys - k).min(CHUNK as u64) as usize;
        for (i, b) in bufs.iter_mut().enumerate().take(n) {
            b.0[..VALUE_BYTES].copy_from_slice(&value_of(k + i as u64, 0));
        }
        for (i, b) in bufs.iter().enumerate().take(n) {
            f.write_all_at(&b.0, (k + i as u64) * BLOCK as u64)?;
        }
        k += n as u64;
    }
    f.sync_all()?;
    Ok(())
}

struct Sizes {
    keys: u64,
    local_items: usize,
    warmup_ops: u64,
    ops: u64,
    cgroup_bytes: u64,
    stores: usize,
    store_bytes: u64,
}

fn run_app(
    cfg: &AppConfig,
    dir: &Path,
    groups: Option<&(ClusterGroups, granule_host::NodeGroup, Hierarchy)>,
    cpu: Option<usize>,
) -> anyhow::Result<(AppResult, u64)> {
    let cfg_path = dir.join("app.json");
    std::fs::write(&cfg_path, serde_json::to_vec(cfg)?)?;
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe)
        .args(["consumer", "--out"])
        .arg(dir)
        .env(APP_ENV, &cfg_path)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("starting the application child")?;
    let mut peak = 0;
    let mut watch = None;
    if let Some((_, node, h)) = groups {
        node.join(child.id())?;
        // The group's own usage reading (it is Granule's group, not a foreign one).
        watch = Some(granule_host::Reader::for_paths(h, &node.paths())?);
    }
    if let Some(cpu) = cpu {
        crate::affinity::pin_pid(child.id(), cpu)?;
    }
    if let Some(stdin) = child.stdin.as_mut() {
        stdin.write_all(b"go\n")?;
    }
    drop(child.stdin.take());
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if let Some(w) = &watch {
            peak = peak.max(w.memory_usage().unwrap_or(0));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    anyhow::ensure!(status.success(), "the application child failed ({status})");
    let res: AppResult = serde_json::from_slice(&std::fs::read(&cfg.result_path)?)?;
    Ok((res, peak))
}

fn parent(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let s = if opts.quick {
        Sizes {
            keys: 20_000,
            local_items: 2_000,
            warmup_ops: 5_000,
            ops: 10_000,
            cgroup_bytes: 96 << 20,
            stores: 2,
            store_bytes: 32 << 20,
        }
    } else {
        Sizes {
            keys: 200_000,
            local_items: 20_000,
            warmup_ops: 50_000,
            ops: 100_000,
            cgroup_bytes: 128 << 20,
            stores: 2,
            store_bytes: 256 << 20,
        }
    };
    let dir = std::env::temp_dir().join(format!("granule-bench-consumer-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let _cleanup = crate_dir_guard(dir.clone());
    let disk_path = dir.join("data.blk");
    let t0 = Instant::now();
    write_disk(&disk_path, s.keys)?;
    println!(
        "consumer: wrote {} keys ({} MiB) with O_DIRECT in {:.1} s",
        s.keys,
        (s.keys * BLOCK as u64) >> 20,
        t0.elapsed().as_secs_f64()
    );
    // The stores and the backing service on vCPU 0, the application on vCPU 1: every
    // kind of miss crosses cores alike.
    let pin = granule_host::os::affinity(0).map(|c| c.len()).unwrap_or(1) >= 2;
    let _saved = crate::affinity::SavedAffinity::save();
    let (service_addr, service) = start_service(s.keys, pin.then_some(SERVER_CPU))?;

    // The application's memory cgroup.
    let groups = match Hierarchy::detect() {
        Ok(h) => {
            let cg = ClusterGroups::new(&h)?;
            let node = cg.node("consumer-app", 2.0, s.cgroup_bytes)?;
            Some((cg, node, h))
        }
        Err(e) => {
            println!("consumer: no cgroup hierarchy ({e}); the application runs uncapped");
            None
        }
    };

    let configs: [(&str, Option<Protection>); 3] = [
        ("no leased memory", None),
        ("leased, integrity", Some(Protection::Integrity)),
        ("leased, encrypted", Some(Protection::Encrypt)),
    ];
    let mut results: Vec<(Case, &str, AppResult, u64)> = Vec::new();
    let seed = rand_u64();
    for case in [Case::Service, Case::Disk] {
        for (name, p) in &configs {
            let stores: Vec<StoreProc> = match p {
                Some(_) => (0..s.stores)
                    .map(|i| {
                        StoreProc::start(
                            s.store_bytes,
                            &format!("lease{i}"),
                            pin.then_some(SERVER_CPU),
                        )
                    })
                    .collect::<anyhow::Result<_>>()?,
                None => Vec::new(),
            };
            let cfg = AppConfig {
                case,
                protection: p.map(|p| p.as_str().to_string()),
                grants: stores
                    .iter()
                    .enumerate()
                    .map(|(i, st)| st.grant(i as u64 + 1, s.store_bytes))
                    .collect(),
                keys: s.keys,
                local_items: s.local_items,
                warmup_ops: s.warmup_ops,
                ops: s.ops,
                // The same operation sequence in every configuration.
                seed,
                disk_path: disk_path.clone(),
                service_addr: service_addr.clone(),
                result_path: dir.join("result.json"),
            };
            let (r, peak) = run_app(&cfg, &dir, groups.as_ref(), pin.then_some(APP_CPU))?;
            println!(
                "consumer: {} / {name}: miss p50 {:.0} µs p99 {:.0} µs, all p50 {:.1} µs p99 {:.0} µs, wrong {}, failures {}, cgroup peak {} MiB",
                case.name(), r.local_misses.p50_us, r.local_misses.p99_us, r.all.p50_us, r.all.p99_us,
                r.wrong_values, r.verification_failures, peak >> 20
            );
            results.push((case, name, r, peak));
            drop(stores);
        }
    }
    // Stop the service: a connection that sends nothing.
    drop(std::net::TcpStream::connect(&service_addr));
    let _ = service.join();
    drop(groups);

    let mut table = Table::new(&[
        "case",
        "config",
        "ops",
        "p50_us",
        "p99_us",
        "mean_us",
        "local_miss_ratio",
        "miss_p50_us",
        "miss_p99_us",
        "miss_mean_us",
        "leased_hit_p50_us",
        "backing_read_p50_us",
        "write_p50_us",
        "leased_misses",
        "wrong_values",
        "verification_failures",
        "cgroup_peak_mib",
        "preload_s",
    ]);
    for (case, name, r, peak) in &results {
        table.row(vec![
            Cell::from(case.name()),
            Cell::from(*name),
            Cell::from(r.all.count as f64),
            Cell::from(r.all.p50_us),
            Cell::from(r.all.p99_us),
            Cell::from(r.all.mean_us),
            Cell::from(r.local_misses.count as f64 / r.reads.count.max(1) as f64),
            Cell::from(r.local_misses.p50_us),
            Cell::from(r.local_misses.p99_us),
            Cell::from(r.local_misses.mean_us),
            Cell::from(r.leased_hits.p50_us),
            Cell::from(r.backing_reads.p50_us),
            Cell::from(r.writes.p50_us),
            Cell::from(r.leased_misses as f64),
            Cell::from(r.wrong_values as f64),
            Cell::from(r.verification_failures as f64),
            Cell::from((*peak >> 20) as f64),
            Cell::from(r.preload_secs),
        ]);
    }
    let find = |case: Case, i: usize| -> &AppResult {
        results
            .iter()
            .filter(|x| x.0 == case)
            .nth(i)
            .map(|x| &x.2)
            .unwrap_or(&results[0].2)
    };
    let ratio = |a: f64, b: f64| a / b;
    let (sv0, sv1, sv2) = (
        find(Case::Service, 0),
        find(Case::Service, 1),
        find(Case::Service, 2),
    );
    let (dk0, dk1, dk2) = (
        find(Case::Disk, 0),
        find(Case::Disk, 1),
        find(Case::Disk, 2),
    );
    let wrong: u64 = results.iter().map(|r| r.2.wrong_values).sum();
    anyhow::ensure!(wrong == 0, "the application read {wrong} wrong values");

    let mut plot = Plot::bars("Read latency after a local-memory miss (p50 and p99)")
        .x_label("backing store / statistic")
        .y_label("µs")
        .log_y(true)
        .categories(["service p50", "service p99", "disk p50", "disk p99"]);
    for (i, (name, _)) in configs.iter().enumerate() {
        let (sv, dk) = (find(Case::Service, i), find(Case::Disk, i));
        plot.push_bar_series(
            *name,
            [
                sv.local_misses.p50_us,
                sv.local_misses.p99_us,
                dk.local_misses.p50_us,
                dk.local_misses.p99_us,
            ],
        );
    }

    let placement = if pin {
        format!(
            "the parent (benchmark driver, the 1 ms backing service thread, the producer stores of the leases, each on \
             its own thread) outside any limit, the service and the stores pinned to vCPU {SERVER_CPU}; the application \
             is a child process in its own memory cgroup (v1, limit counting page cache) with one client thread, pinned \
             to vCPU {APP_CPU}: every kind of miss (store, service) crosses cores alike; O_DIRECT reads go to the disk."
        )
    } else {
        "fewer than two vCPUs available: nothing pinned".to_string()
    };
    let mut meta = Meta::collect(placement, opts.quick);
    meta.note(format!(
        "data set: {} keys of {VALUE_BYTES} B ({} MiB of values; on disk one 4 KiB block per key, {} MiB, read and written \
         with O_DIRECT); local memory: a CLOCK cache of {} values inside a cgroup limited to {} MiB; leased memory: {} \
         producer stores (granule_market::store::Store) of {} MiB (AUTH with the lease's secret, approximate LRU, no rate \
         limit), loaded with the whole data set \
         before measuring; workload: YCSB-like, scrambled Zipfian θ = {ZIPF_THETA}, {:.0} % reads, {} warm-up then {} \
         measured operations, one at a time, the same sequence in every configuration; backing service: loopback TCP, \
         {} ms per request.",
        s.keys, (s.keys * VALUE_BYTES as u64) >> 20, (s.keys * BLOCK as u64) >> 20, s.local_items, s.cgroup_bytes >> 20,
        s.stores, s.store_bytes >> 20, READ_FRACTION * 100.0, s.warmup_ops, s.ops,
        SERVICE_COST.as_millis()
    ));
    meta.note(
        "miss latency = latency of the reads that missed local memory (served by leased memory or the backing store): \
         leased memory changes nothing else, local hits cost the same in every configuration. speedup_* = that latency \
         without leased memory ÷ with encrypted leased memory; the same ratios over all operations are reported as \
         speedup_*_all_ops (with about 80 % local hits the p50 of all operations is a local hit in every configuration)."
            .to_string(),
    );
    let mut rep = Report::new("consumer", meta);
    rep.title("Benchmark: consumer — a YCSB-like application with and without leased memory");
    rep.table(table);
    rep.plot(plot);
    rep.summary(
        "speedup_p50_encrypted",
        ratio(sv0.local_misses.p50_us, sv2.local_misses.p50_us),
    );
    rep.summary(
        "speedup_p99_encrypted",
        ratio(sv0.local_misses.p99_us, sv2.local_misses.p99_us),
    );
    rep.summary(
        "speedup_p50_encrypted_disk",
        ratio(dk0.local_misses.p50_us, dk2.local_misses.p50_us),
    );
    rep.summary(
        "speedup_p99_encrypted_disk",
        ratio(dk0.local_misses.p99_us, dk2.local_misses.p99_us),
    );
    rep.summary(
        "speedup_p50_integrity",
        ratio(sv0.local_misses.p50_us, sv1.local_misses.p50_us),
    );
    rep.summary(
        "speedup_p99_integrity",
        ratio(sv0.local_misses.p99_us, sv1.local_misses.p99_us),
    );
    rep.summary(
        "speedup_p50_integrity_disk",
        ratio(dk0.local_misses.p50_us, dk1.local_misses.p50_us),
    );
    rep.summary(
        "speedup_p50_encrypted_all_ops",
        ratio(sv0.all.p50_us, sv2.all.p50_us),
    );
    rep.summary(
        "speedup_p99_encrypted_all_ops",
        ratio(sv0.all.p99_us, sv2.all.p99_us),
    );
    rep.summary(
        "speedup_mean_encrypted_all_ops",
        ratio(sv0.all.mean_us, sv2.all.mean_us),
    );
    rep.summary("miss_p50_us_service_no_lease", sv0.local_misses.p50_us);
    rep.summary("miss_p50_us_service_encrypted", sv2.local_misses.p50_us);
    rep.summary("miss_p50_us_disk_no_lease", dk0.local_misses.p50_us);
    rep.summary("miss_p50_us_disk_encrypted", dk2.local_misses.p50_us);
    rep.summary(
        "local_miss_ratio",
        sv0.local_misses.count as f64 / sv0.reads.count.max(1) as f64,
    );
    rep.summary("wrong_values", wrong as f64);
    Ok(rep.write(&opts.out)?)
}

/// Removes the scratch directory (data file, configs) when the benchmark ends.
fn crate_dir_guard(dir: PathBuf) -> impl Drop {
    struct G(PathBuf);
    impl Drop for G {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    G(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The child's result crosses a JSON file: an empty distribution (no leased hits
    /// without leased memory) must come back, as NaN.
    #[test]
    fn empty_distributions_survive_json() {
        let r = AppResult::default();
        let mut r = AppResult {
            leased_hits: Dist::of(&Latency::new()),
            ..r
        };
        r.all.p50_us = 12.5;
        let back: AppResult = serde_json::from_slice(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert!(back.leased_hits.p50_us.is_nan());
        assert_eq!(back.leased_hits.count, 0);
        assert_eq!(back.all.p50_us, 12.5);
    }
}
