//! One mount's life: checks before mounting (the FUSE device, the mount point), its own
//! Granule cluster and a stripe store on each own node, its victim stores (listed by
//! hand, or leased from the broker in no-eviction mode and renewed), the FUSE session,
//! the status door (`/status`, `/metrics`, `/drain`), the record `granule fs status`
//! finds it by, and the end: Ctrl-C, SIGTERM, an unmount from outside, or the cluster
//! going away all unmount, release the leases and stop the cluster.

use crate::engine::{Engine, Settings};
use crate::fuse::GranuleFs;
use crate::meta::Namespace;
use crate::metacopy::{self, MetaCopy, Replicator};
use crate::placement::StoreId;
use crate::status::{self, Record};
use crate::stores::{victim_capacity, Store, StoreState};
use granule_market::client::{BrokerLeases, LeaseTerms};
use granule_market::consumer::{LeaseSource, Protection, Sealer};
use granule_market::wire::EvictionMode;
use granule_runtime::{Cluster, Config, NodeState, Proclet};
use granule_wire::Role;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a mount could not start or ended badly.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{0}")]
    Fuse(String),
    #[error("mount point {0}: {1}")]
    MountPoint(PathBuf, String),
    #[error("starting the own nodes: {0}")]
    Cluster(String),
    #[error("victim store {0}: {1}")]
    Victim(String, String),
    #[error("broker: {0}")]
    Broker(String),
    #[error("{0}")]
    Recover(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What `granule fs mount` was asked for.
#[derive(Clone, Debug)]
pub struct MountOptions {
    pub dir: PathBuf,
    /// `[fs]`, `[cluster]` (own nodes), `[market]` (broker, lease time, protection).
    pub config: Config,
    /// Hand-started victim stores: (address, secret).
    pub victims: Vec<(String, String)>,
    /// Bytes the mount may use on each listed victim store (default: its `maxmemory`).
    pub victim_bytes: Option<u64>,
    /// Lease this many slabs of victim memory from the broker (`market.broker`).
    pub victim_slabs: u32,
}

/// Check that this process can mount at all, with a message that says what to do.
pub fn preflight(dir: &Path) -> Result<(), MountError> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(MountError::Fuse(
                "/dev/fuse is missing: load the FUSE module (`modprobe fuse`), or in a \
                 container start it with the device (`--device /dev/fuse`)"
                    .into(),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(MountError::Fuse(
                "no permission to open /dev/fuse: run as root, or add your user to the \
                 group that owns it, and install Debian's `fuse3` (fusermount3)"
                    .into(),
            ))
        }
        Err(e) => return Err(MountError::Fuse(format!("cannot open /dev/fuse: {e}"))),
    }
    let has_fusermount = match std::process::Command::new("fusermount3").arg("-V").output() {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    };
    if !has_fusermount {
        return Err(MountError::Fuse(
            "fusermount3 is not installed: install Debian's `fuse3` package \
             (apt-get install fuse3)"
                .into(),
        ));
    }
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(MountError::MountPoint(dir.into(), "not a directory".into())),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            return Err(MountError::MountPoint(
                dir.into(),
                "a mount that crashed is still attached: run `granule fs umount DIR` \
                 (or `fusermount3 -uz DIR`) first"
                    .into(),
            ))
        }
        Err(e) => return Err(MountError::MountPoint(dir.into(), e.to_string())),
    }
    if is_mounted(dir) {
        return Err(MountError::MountPoint(
            dir.into(),
            "something is already mounted there".into(),
        ));
    }
    Ok(())
}

/// Whether `dir` is a mount point now.
pub fn is_mounted(dir: &Path) -> bool {
    granule_host::mounts::is_mount_point(dir)
}

/// Unmount `dir`, lazily if it is busy or its server is gone (`fusermount3 -uz`).
pub fn unmount(dir: &Path) -> Result<(), MountError> {
    let out = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg("-z")
        .arg(dir)
        .output()
        .map_err(|e| {
            MountError::Fuse(format!("running fusermount3: {e} (install Debian's fuse3)"))
        })?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    Err(MountError::MountPoint(
        dir.into(),
        format!("fusermount3 -uz: {err}"),
    ))
}

/// The market leases behind victim stores, when they came from the broker.
struct Leases {
    source: Arc<BrokerLeases>,
    /// Lease → store.
    stores: parking_lot::Mutex<Vec<(u64, StoreId, u64)>>,
}

/// Mount and serve until the mount ends. Prints `granule fs: mounted DIR ...` on stdout
/// once the mount is usable.
pub fn run(opts: MountOptions) -> Result<(), MountError> {
    preflight(&opts.dir)?;
    let cfg = opts.config.clone();
    let fs_cfg = cfg.fs.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("granule-fs")
        .enable_all()
        .build()?;

    // The own nodes: an embedded cluster of this binary (or the one cluster.controller
    // names). The file system places every stripe itself, so nodes do not shed.
    let mut ccfg = cfg.clone();
    ccfg.pressure.shed = false;
    let cluster = Cluster::with_config(ccfg).map_err(|e| MountError::Cluster(e.to_string()))?;
    let result = serve(&opts, &cfg, &fs_cfg, &rt, &cluster);
    cluster.shutdown();
    rt.shutdown_timeout(Duration::from_secs(2));
    result
}

fn serve(
    opts: &MountOptions,
    cfg: &Config,
    fs_cfg: &granule_runtime::config::Fs,
    rt: &tokio::runtime::Runtime,
    cluster: &Cluster,
) -> Result<(), MountError> {
    let settings = Settings {
        stripe: fs_cfg.stripe,
        replicas: fs_cfg.replicas as usize,
        cache_bytes: fs_cfg.cache,
        readahead: fs_cfg.readahead,
        write_behind: fs_cfg.write_behind,
        dirty: fs_cfg.dirty,
    };
    let (uid, gid) = (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    );
    let engine = Engine::new(
        settings,
        rt.handle().clone(),
        Namespace::new(0o755, uid, gid),
    );
    let next_id = AtomicU32::new(1);
    let dir = std::path::absolute(&opts.dir).unwrap_or_else(|_| opts.dir.clone());
    let record_file = status::record_path(Path::new(&fs_cfg.state_dir), &dir);
    // Own nodes that outlive the mount (an outside controller's) keep its data, and a
    // mount of the same directory after this one died adopts it.
    let outside = cfg.cluster.controller.clone();
    // Liveness is a lock only a live mount holds (see crate::liveness): a second mount of
    // the directory is refused while the first lives, and the lock taken here proves the
    // recorded one, if any, is dead — zombie, reused pid or not. Held until `serve`
    // returns, after the record is removed; a mount without it writes no record, which
    // would otherwise look like a dead mount's to the next one.
    let alive_lock = match std::fs::create_dir_all(&fs_cfg.state_dir)
        .and_then(|()| crate::liveness::MountLock::try_take(&record_file))
    {
        Ok(Some(lock)) => Some(lock),
        Ok(None) => {
            let pid = read_record(&record_file).map_or_else(|| "?".into(), |r| r.pid.to_string());
            return Err(MountError::MountPoint(
                dir.clone(),
                format!("a mount of this directory is running (pid {pid}): stop it with `granule fs umount {}` first", dir.display()),
            ));
        }
        Err(e) => {
            tracing::warn!(
                "cannot take the mount's lock in {}: {e} (granule fs status will not find it)",
                fs_cfg.state_dir
            );
            None
        }
    };
    let adopted = match adoptable(&record_file, outside.as_deref())? {
        Some((rec, copy)) => match rt.block_on(metacopy::fetch(&copy)) {
            Ok(got) => Some((rec, copy, got)),
            Err(e) => {
                return Err(MountError::Recover(format!(
                    "the mount of {} that died (pid {}) left its metadata on the own nodes, but it cannot be read: {e}. \
                     To start an empty file system instead, delete {}",
                    dir.display(),
                    rec.pid,
                    record_file.display()
                )))
            }
        },
        None => None,
    };

    let timeout = cfg.market.store_timeout.max(Duration::from_secs(2));
    let (protection_name, master) = match &adopted {
        Some((_, _, got)) => (got.mount.protection.clone(), got.mount.master),
        None => (cfg.market.protection.clone(), rand::random()),
    };
    let protection = Protection::parse(&protection_name)
        .map_err(|e| MountError::Victim("-".into(), e.to_string()))?;
    let sealer = Arc::new(Sealer::new(protection, &master));

    let nodes = cluster
        .nodes()
        .map_err(|e| MountError::Cluster(e.to_string()))?;
    let own: Vec<_> = nodes
        .iter()
        .filter(|n| n.role == Role::Node && n.state == NodeState::Alive)
        .collect();
    if own.is_empty() {
        return Err(MountError::Cluster(
            "no own node to keep data on (cluster.nodes is empty)".into(),
        ));
    }

    // What the dead mount left: its namespace and stores, served again.
    let mut to_drain = Vec::new();
    if let Some((rec, _, got)) = &adopted {
        if got.mount.stripe != fs_cfg.stripe {
            return Err(MountError::Recover(format!(
                "the mount of {} that died (pid {}) used {} KiB stripes, not {} KiB: mount with --stripe {}",
                dir.display(),
                rec.pid,
                got.mount.stripe >> 10,
                fs_cfg.stripe >> 10,
                got.mount.stripe
            )));
        }
        let mut stores = Vec::new();
        for im in &got.mount.stores {
            let s = Store::from_image(im, sealer.clone(), timeout);
            if let Some(node) = s.node() {
                if !own.iter().any(|n| n.id == node) {
                    tracing::warn!("{}: its node is gone, and the stripes only it held", s.name);
                    s.set_state(StoreState::Gone);
                }
            }
            if s.state() == StoreState::Draining {
                // A drain the dead mount had begun: this mount finishes it.
                s.set_state(StoreState::Active);
                to_drain.push(s.id);
            } else if s.lease.is_some() && s.state() == StoreState::Active {
                // The dead mount's lease: its stripes move to this mount's stores.
                to_drain.push(s.id);
            }
            next_id.fetch_max(s.id + 1, Ordering::Relaxed);
            stores.push(s);
        }
        let (ns, orphans) = Namespace::restore(got.inodes.clone(), got.next);
        let files = ns.count();
        engine.restore(
            ns,
            orphans,
            got.mount.layouts.clone(),
            stores,
            got.mount.versions_below,
        );
        eprintln!(
            "granule fs: adopted the {files} files and directories of the mount that died (pid {}) from its metadata copy",
            rec.pid
        );
    }

    // Own stores: one per node process (an adopted one where it still lives).
    for n in &own {
        let has = engine
            .stores
            .all()
            .iter()
            .any(|s| s.node() == Some(n.id) && s.state() == StoreState::Active);
        if has {
            continue;
        }
        let cap = (n.spec.mem_bytes as f64 * fs_cfg.own_share) as u64;
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let s = rt
            .block_on(Store::own(id, n.id, cap, engine.settings.stripe))
            .map_err(|e| MountError::Cluster(e.to_string()))?;
        engine.add_store(s, "own", 1.0);
    }
    // This process is an own node too. With embedded nodes (which end with it) it keeps
    // stripes as well: reading those costs no network hop and no copy before the kernel.
    // Under an outside controller it does not: its nodes outlive it, and so should data.
    let driver_store = fs_cfg.driver_store && outside.is_none();
    if driver_store {
        let me = cluster.node_id();
        let cap = (cfg.cluster.driver.mem_bytes as f64 * fs_cfg.own_share) as u64;
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let s = rt
            .block_on(Store::own(id, me, cap, engine.settings.stripe))
            .map_err(|e| MountError::Cluster(e.to_string()))?;
        engine.add_store(s, "own", 1.0);
    }

    // Victim stores.
    for (addr, secret) in &opts.victims {
        let known = engine.stores.all().iter().any(|s| {
            s.is_victim() && s.lease.is_none() && &s.name == addr && s.state() != StoreState::Gone
        });
        if known {
            continue;
        }
        let cap = match opts.victim_bytes {
            Some(b) => b,
            None => rt
                .block_on(victim_capacity(addr, secret, timeout))
                .map_err(|e| MountError::Victim(addr.clone(), e.to_string()))?,
        };
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let s = Store::victim(id, addr, secret, cap, None, sealer.clone(), timeout);
        engine.add_store(s, "victim", fs_cfg.victim_weight);
    }
    let leases = if opts.victim_slabs > 0 {
        let broker = cfg.market.broker.clone().ok_or_else(|| {
            MountError::Broker("--victim-slabs needs a broker (--broker or market.broker)".into())
        })?;
        let terms = LeaseTerms {
            consumer: format!("granule-fs-{}", std::process::id()),
            lease_time: cfg.market.lease_time,
            budget: f64::MAX,
            mode: EvictionMode::NoEviction,
        };
        let source = Arc::new(
            rt.block_on(BrokerLeases::connect(&broker, terms))
                .map_err(|e| MountError::Broker(e.to_string()))?,
        );
        let grants = rt
            .block_on(source.acquire(opts.victim_slabs))
            .map_err(|e| MountError::Broker(e.to_string()))?;
        if grants.is_empty() {
            tracing::warn!("the broker granted no victim memory: the mount runs on own nodes only");
        }
        let l = Arc::new(Leases {
            source,
            stores: parking_lot::Mutex::new(Vec::new()),
        });
        for g in grants {
            let id = next_id.fetch_add(1, Ordering::Relaxed);
            let cap = u64::from(g.slabs) * g.slab_bytes;
            let s = Store::victim(
                id,
                &g.store_addr,
                &g.secret,
                cap,
                Some(g.lease),
                sealer.clone(),
                timeout,
            );
            engine.add_store(s, "victim", fs_cfg.victim_weight);
            l.stores.lock().push((g.lease, id, g.expires_unix_ms));
        }
        Some(l)
    } else {
        None
    };

    for id in to_drain {
        if let Err(e) = engine.start_drain(id) {
            tracing::warn!("draining a store the dead mount left: {e}");
        }
    }

    // The status door.
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let http = listener.local_addr()?.to_string();
    let app = door(engine.clone(), dir.clone());
    let limits = granule_http::Limits::from_config(cfg);
    rt.spawn(granule_http::serve(
        listener,
        app,
        limits,
        "the file system's status door",
    ));
    let record = Arc::new(parking_lot::Mutex::new(Record {
        dir: dir.clone(),
        pid: std::process::id(),
        http: http.clone(),
        controller: outside.clone(),
        meta: None,
    }));
    let adopted_copy = adopted.map(|(_, copy, _)| copy);
    if let Some(c) = &adopted_copy {
        record.lock().meta = serde_json::to_value(c).ok();
    }
    let recording = alive_lock.is_some();
    if recording {
        if let Err(e) = write_record(&record_file, &record.lock()) {
            tracing::warn!(
                "cannot record the mount in {}: {e} (granule fs status will not find it)",
                fs_cfg.state_dir
            );
        }
    }

    // The metadata's second copy, on another own node.
    let replicator = {
        let (record, file) = (record.clone(), record_file.clone());
        Replicator::new(
            engine.clone(),
            adopted_copy,
            master,
            protection_name,
            cluster.node_id(),
            Box::new(move |copy: &Proclet<MetaCopy>| {
                if !recording {
                    return;
                }
                let mut r = record.lock();
                r.meta = serde_json::to_value(copy).ok();
                if let Err(e) = write_record(&file, &r) {
                    tracing::warn!("cannot record the metadata copy in {}: {e}", file.display());
                }
            }),
        )
    };
    rt.spawn(replicator.clone().run());

    // The FUSE session.
    let root = nix::unistd::geteuid().is_root();
    let mut options = vec![
        fuser::MountOption::FSName("granule".into()),
        fuser::MountOption::Subtype("granule".into()),
        fuser::MountOption::DefaultPermissions,
    ];
    if root {
        // Other users may use it, and fusermount3 unmounts it if this process dies.
        options.push(fuser::MountOption::AutoUnmount);
    }
    let mut fcfg = fuser::Config::default();
    fcfg.mount_options = options;
    fcfg.acl = if root {
        fuser::SessionACL::All
    } else {
        fuser::SessionACL::Owner
    };
    fcfg.n_threads = Some(4);
    fcfg.clone_fd = true;
    let session = fuser::Session::new(GranuleFs::new(engine.clone()), &opts.dir, &fcfg)
        .map_err(|e| mount_error(&opts.dir, e))?;
    let bg = session.spawn().map_err(|e| mount_error(&opts.dir, e))?;
    // The kernel sends reads as large as the mount's read-ahead (128 KiB by default):
    // a stripe's worth makes a sequential read one request per stripe.
    let ra_kib = (fs_cfg.stripe >> 10).clamp(128, 16 << 10);
    if let Err(e) = granule_host::mounts::set_read_ahead(&opts.dir, ra_kib) {
        tracing::debug!("cannot raise the mount's read-ahead to {ra_kib} KiB: {e}");
    }

    let (cap, _) = engine.space();
    let victims = engine.stores.all().iter().filter(|s| s.is_victim()).count();
    println!(
        "granule fs: mounted {} ({} own store{}, {} victim store{}, {:.2} GiB; stripe {} KiB, {} cop{}; status at http://{http}/status)",
        opts.dir.display(),
        own.len() + usize::from(driver_store),
        if own.len() + usize::from(driver_store) == 1 { "" } else { "s" },
        victims,
        if victims == 1 { "" } else { "s" },
        cap as f64 / (1u64 << 30) as f64,
        fs_cfg.stripe >> 10,
        fs_cfg.replicas,
        if fs_cfg.replicas == 1 { "y" } else { "ies" },
    );

    // Wait for the end.
    let stop = Arc::new(AtomicBool::new(false));
    let why = Arc::new(parking_lot::Mutex::new(String::new()));
    {
        let (stop, why) = (stop.clone(), why.clone());
        rt.spawn(async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::warn!("cannot watch SIGTERM: {e}");
                        return;
                    }
                };
            let w = tokio::select! {
                _ = tokio::signal::ctrl_c() => "interrupted",
                _ = term.recv() => "terminated",
            };
            *why.lock() = w.to_string();
            stop.store(true, Ordering::Release);
        });
    }
    if let Some(l) = &leases {
        let (l, engine, cfg) = (l.clone(), engine.clone(), cfg.clone());
        rt.spawn(async move { maintain_leases(l, engine, cfg).await });
    }
    // Every store is probed, so a dead one is noticed without I/O to it (see crate::watch).
    rt.spawn(crate::watch::watch_stores(
        engine.clone(),
        crate::watch::Watch {
            every: fs_cfg.probe_every,
            within: fs_cfg.probe_every.max(timeout),
            misses: fs_cfg.probe_misses,
        },
    ));
    // The mount's panel on its controller's dashboard (see crate::panel).
    rt.spawn(crate::panel::publish_loop(
        engine.clone(),
        dir.clone(),
        cluster.panel_publisher(),
    ));
    let mut checks = 0u64;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        if stop.load(Ordering::Acquire) {
            break;
        }
        if bg.guard.is_finished() {
            *why.lock() = "unmounted".into();
            break;
        }
        checks += 1;
        if checks.is_multiple_of(20) {
            // The own nodes: when every one is gone, the data is gone with them.
            match cluster.nodes() {
                Ok(ns)
                    if ns
                        .iter()
                        .any(|n| n.role == Role::Node && n.state == NodeState::Alive) => {}
                Ok(_) => {
                    *why.lock() = "every own node is gone".into();
                    break;
                }
                Err(e) => {
                    *why.lock() = format!("the cluster stopped ({e})");
                    break;
                }
            }
        }
    }
    let why = why.lock().clone();
    eprintln!("granule fs: {why}: unmounting {}", opts.dir.display());
    // Unmount first (lazily, so open files do not keep it), then the session's threads
    // see the device close and end. (fuser's own unmount only hands the mount to
    // fusermount3's auto-unmount helper, which unmounts only after this process dies.)
    if is_mounted(&opts.dir) {
        if let Err(e) = unmount(&opts.dir) {
            eprintln!("granule fs: {e}");
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !bg.guard.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if bg.guard.is_finished() {
        if let Err(e) = bg.join() {
            tracing::debug!("session ended: {e}");
        }
    } else {
        // Leave its threads; the process is about to end.
        tracing::warn!("the FUSE session did not end within 10 s of the unmount");
        std::mem::forget(bg);
    }
    // The replicator's turns end first: one still making a copy would record it (and
    // bring the record back) after the removal, and the copy would leak on its node.
    rt.block_on(replicator.stop());
    let _ = std::fs::remove_file(&record_file);
    if let Some(l) = &leases {
        let ids: Vec<u64> = l.stores.lock().iter().map(|(lease, _, _)| *lease).collect();
        for lease in ids {
            let _ = rt.block_on(l.source.release(lease));
        }
    }
    rt.block_on(replicator.finish());
    rt.block_on(engine.close());
    Ok(())
}

fn write_record(file: &Path, record: &Record) -> std::io::Result<()> {
    // Written whole and renamed: a reader never sees half a record.
    let tmp = file.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(record).unwrap_or_default())?;
    std::fs::rename(&tmp, file)
}

/// What [`discard`] freed of a mount that died.
#[derive(Debug, Default)]
pub struct Discarded {
    /// The dead mount's process.
    pub pid: u32,
    /// Files and directories its metadata held.
    pub files: usize,
    /// Own stores freed (their stripes' memory back on the own nodes).
    pub own_stores: usize,
    /// Victim stores it used: left to their leases' ends (or their owners).
    pub victim_stores: usize,
    /// Whether there was anything on outside nodes (a mount with embedded nodes ends
    /// with them: only its record is removed).
    pub outside: bool,
}

/// Free what a mount of `dir` that died left on its own nodes, instead of adopting it
/// with a new mount: its own stores and its metadata copy (under an outside
/// controller, whose nodes outlived it), and its record. Refuses while that mount's
/// process lives.
pub fn discard(dir: &Path, cfg: &Config) -> Result<Discarded, MountError> {
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let record_file = status::record_path(Path::new(&cfg.fs.state_dir), &dir);
    let rec: Record = match std::fs::read(&record_file) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| {
            MountError::Recover(format!(
                "{} is not a mount record: {e}",
                record_file.display()
            ))
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(MountError::Recover(format!(
                "no mount of {} is recorded (in {}): nothing to discard",
                dir.display(),
                cfg.fs.state_dir
            )))
        }
        Err(e) => return Err(e.into()),
    };
    // Held for the whole discard, so no mount of the directory starts meanwhile.
    let _lock = match crate::liveness::MountLock::try_take(&record_file)? {
        Some(l) => l,
        None => {
            return Err(MountError::Recover(format!(
                "the mount of {} is running (pid {}): stop it with `granule fs umount {}`",
                dir.display(),
                rec.pid,
                dir.display()
            )))
        }
    };
    // A dead mount's FUSE mount point may be left behind (no auto-unmount when it did
    // not run as root): unmount it, so the directory is usable again.
    if is_mounted(&dir) {
        if let Err(e) = unmount(&dir) {
            tracing::warn!("the dead mount's mount point is left: {e}");
        }
    }
    let mut out = Discarded {
        pid: rec.pid,
        ..Discarded::default()
    };
    let copy: Option<Proclet<MetaCopy>> = rec
        .meta
        .clone()
        .and_then(|v| serde_json::from_value(v).ok());
    if let (Some(controller), Some(copy)) = (rec.controller.clone(), copy) {
        out.outside = true;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let mut ccfg = cfg.clone();
        ccfg.cluster.controller = Some(controller.clone());
        ccfg.pressure.shed = false;
        let cluster = Cluster::with_config(ccfg).map_err(|e| {
            MountError::Recover(format!(
                "joining the controller at {controller}, whose nodes hold the dead mount's data: {e}"
            ))
        })?;
        let r = rt.block_on(async {
            let got = metacopy::fetch(&copy).await.map_err(|e| {
                MountError::Recover(format!(
                    "the metadata copy of the mount that died cannot be read ({e}): its stores cannot be found. \
                     To forget the mount anyway, delete {}",
                    record_file.display()
                ))
            })?;
            out.files = got.inodes.len();
            for im in &got.mount.stores {
                match &im.own {
                    Some((node, p)) => match p.destroy_async().await {
                        Ok(()) => out.own_stores += 1,
                        // Its node is gone, and the memory with it.
                        Err(e) => tracing::info!("{} on {node}: {e}", im.name),
                    },
                    None => out.victim_stores += 1,
                }
            }
            copy.destroy_async()
                .await
                .map_err(|e| MountError::Recover(format!("freeing the metadata copy: {e}")))
        });
        cluster.shutdown();
        rt.shutdown_timeout(Duration::from_secs(2));
        r?;
    }
    std::fs::remove_file(&record_file)?;
    Ok(out)
}

/// The record at `file`, if there is a readable one.
fn read_record(file: &Path) -> Option<Record> {
    serde_json::from_slice(&std::fs::read(file).ok()?).ok()
}

/// The metadata copy a dead mount of the same directory left on own nodes that outlive
/// mounts (the same outside controller), if any. The caller holds the directory's mount
/// lock: a recorded mount is dead. A record that may still own data this mount cannot
/// adopt (its controller's nodes outlive it, and this mount is not on that controller)
/// is never overwritten: the mount is refused with what to do instead.
fn adoptable(
    record_file: &Path,
    controller: Option<&str>,
) -> Result<Option<(Record, Proclet<MetaCopy>)>, MountError> {
    let Some(rec) = read_record(record_file) else {
        return Ok(None);
    };
    let Some(theirs) = rec.controller.clone() else {
        // Embedded nodes ended with that mount, and its data with them.
        return Ok(None);
    };
    let dir = rec.dir.display();
    if controller != Some(theirs.as_str()) {
        return Err(MountError::Recover(format!(
            "the mount of {dir} that died (pid {}) left its data on the nodes of the controller at {theirs}: \
             mount with `--controller {theirs}` to adopt it, or free it with `granule fs discard {dir}`",
            rec.pid
        )));
    }
    let copy = rec
        .meta
        .clone()
        .and_then(|v| serde_json::from_value::<Proclet<MetaCopy>>(v).ok());
    match copy {
        Some(copy) => Ok(Some((rec, copy))),
        None => Err(MountError::Recover(format!(
            "the mount of {dir} that died (pid {}) left stores on the nodes of {theirs} but no metadata copy to find them by: \
             free what can be found with `granule fs discard {dir}`, then mount again",
            rec.pid
        ))),
    }
}

fn mount_error(dir: &Path, e: std::io::Error) -> MountError {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => MountError::Fuse(format!(
            "no permission to mount at {}: run as root, or install Debian's `fuse3` \
             (its setuid fusermount3 mounts for users) and own the directory ({e})",
            dir.display()
        )),
        Some(libc::ENODEV) => {
            MountError::Fuse("the kernel has no FUSE support loaded: `modprobe fuse`".into())
        }
        _ => MountError::MountPoint(dir.into(), format!("mounting failed: {e}")),
    }
}

/// Renew leases before they expire; drain stores whose lease is revoked.
async fn maintain_leases(l: Arc<Leases>, engine: Arc<Engine>, cfg: Config) {
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        for revoked in l.source.take_revoked() {
            let lease = revoked.lease;
            // The producer keeps the memory for the notice's grace: the drain's deadline.
            let deadline = Instant::now() + revoked.grace;
            // The broker ended the lease when it sent the notice: forget it here at once,
            // so it is neither renewed (a refused renewal would drain again) nor released
            // again at unmount.
            let store = {
                let mut stores = l.stores.lock();
                let at = stores.iter().position(|(x, _, _)| *x == lease);
                at.map(|i| stores.remove(i).1)
            };
            if let Some(id) = store {
                tracing::info!(
                    lease,
                    grace_ms = revoked.grace.as_millis() as u64,
                    "victim lease revoked: draining its store"
                );
                let (e, src) = (engine.clone(), l.source.clone());
                tokio::spawn(async move {
                    match e.drain(id, Some(deadline)).await {
                        Ok((moved, lost)) => {
                            tracing::info!(lease, moved, lost, "revoked store drained")
                        }
                        Err(err) => tracing::warn!(lease, "drain: {err}"),
                    }
                    let _ = src.release(lease).await;
                });
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let within = (cfg.market.lease_time / 4).as_millis() as u64;
        let expiring: Vec<(u64, StoreId)> = l
            .stores
            .lock()
            .iter()
            .filter(|(_, id, exp)| {
                *exp <= now + within
                    && engine
                        .stores
                        .get(*id)
                        .is_some_and(|s| s.state() != StoreState::Gone)
            })
            .map(|(lease, id, _)| (*lease, *id))
            .collect();
        for (lease, id) in expiring {
            match l.source.renew(lease).await {
                Ok(t) => {
                    if let Some(e) = l.stores.lock().iter_mut().find(|(x, _, _)| *x == lease) {
                        e.2 = t;
                    }
                }
                Err(err) => {
                    // This loop comes back every 250 ms and a draining store is still
                    // renewed (and refused) until it is gone: drain it only once.
                    if engine.start_drain(id).is_ok() {
                        tracing::warn!(
                            lease,
                            "renewing the lease failed ({err}): draining its store"
                        );
                    }
                }
            }
        }
    }
}

/// The status door: `/status` (JSON), `/metrics` (Prometheus), `POST /drain?store=NAME`.
fn door(engine: Arc<Engine>, dir: PathBuf) -> axum::Router {
    use axum::extract::{Query, State};
    use axum::routing::{get, post};
    use axum::Json;
    #[derive(serde::Deserialize)]
    struct DrainQ {
        store: String,
    }
    type St = State<(Arc<Engine>, PathBuf)>;
    async fn status_h(State((e, d)): St) -> Json<status::Status> {
        Json(status::status(&e, &d))
    }
    async fn metrics_h(State((e, d)): St) -> String {
        status::prometheus(&status::status(&e, &d))
    }
    async fn drain_h(
        State((e, _)): St,
        Query(q): Query<DrainQ>,
    ) -> (axum::http::StatusCode, String) {
        let found = e
            .stores
            .all()
            .into_iter()
            .find(|s| s.name == q.store || s.id.to_string() == q.store);
        let Some(s) = found else {
            return (
                axum::http::StatusCode::NOT_FOUND,
                format!("no store '{}' in this mount", q.store),
            );
        };
        match e.drain(s.id, None).await {
            Ok((moved, lost)) => (
                axum::http::StatusCode::OK,
                serde_json::json!({"store": s.name, "moved": moved, "lost": lost}).to_string(),
            ),
            Err(err) => (axum::http::StatusCode::CONFLICT, err),
        }
    }
    axum::Router::new()
        .route("/status", get(status_h))
        .route("/metrics", get(metrics_h))
        .route("/drain", post(drain_h))
        .with_state((engine, dir))
}
