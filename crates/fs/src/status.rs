//! What a mount reports: space per class and store, stripes draining, replicas missing,
//! counters — as JSON for `granule fs status` and the dashboard, as Prometheus text for
//! `/metrics` — and where a mount records its status address so the CLI finds it.

use crate::engine::Engine;
use crate::stores::StoreState;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StoreStatus {
    pub id: u32,
    /// `own` or `victim`.
    pub class: String,
    pub name: String,
    pub state: StoreState,
    pub lease: Option<u64>,
    pub capacity: u64,
    pub used: u64,
    pub stripes: u64,
    pub errors: u64,
    pub tampered: u64,
    /// Whether the mount reads the store's stripes in place (shared memory on this
    /// machine), and how many stripe reads it answered so.
    #[serde(default)]
    pub in_place: bool,
    #[serde(default)]
    pub in_place_reads: u64,
    /// Probes the store missed in a row now (0: it answered the last one), and in all.
    #[serde(default)]
    pub probes_missed_in_row: u32,
    #[serde(default)]
    pub probes_missed: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClassStatus {
    pub name: String,
    pub weight: f64,
    pub stores: usize,
    pub capacity: u64,
    pub used: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub dir: String,
    pub pid: u32,
    pub uptime_s: f64,
    pub stripe: u64,
    pub replicas: usize,
    pub classes: Vec<ClassStatus>,
    pub stores: Vec<StoreStatus>,
    /// Stripes left to move off stores being drained.
    pub draining_stripes: u64,
    /// Stripes with fewer copies than `replicas` (but at least one).
    pub replicas_missing: u64,
    /// Stripes with no copy left (their reads fail with EIO).
    pub stripes_lost: u64,
    pub inodes: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub cache_hits: u64,
    pub verification_failures: u64,
    pub stripes_moved: u64,
    /// Where the metadata's second copy is (`on n2`), or why there is none.
    #[serde(default)]
    pub metadata_copy: String,
}

/// The engine's status now.
pub fn status(e: &Engine, dir: &Path) -> Status {
    let layout = e.layout(e.current_layout());
    let stores: Vec<StoreStatus> = e
        .stores
        .all()
        .iter()
        .map(|s| StoreStatus {
            id: s.id,
            class: layout
                .classes
                .get(s.class)
                .map_or_else(|| s.class.to_string(), |c| c.name.clone()),
            name: s.name.clone(),
            state: s.state(),
            lease: s.lease,
            capacity: s.capacity.load(Ordering::Relaxed),
            used: s.used.load(Ordering::Relaxed),
            stripes: s.stripes.load(Ordering::Relaxed),
            errors: s.errors.load(Ordering::Relaxed),
            tampered: s.tampered.load(Ordering::Relaxed),
            in_place: s.reads_in_place(),
            in_place_reads: s.in_place_reads.load(Ordering::Relaxed),
            probes_missed_in_row: s.misses.load(Ordering::Relaxed),
            probes_missed: s.probes_missed.load(Ordering::Relaxed),
        })
        .collect();
    let classes = layout
        .classes
        .iter()
        .map(|c| {
            let mine: Vec<&StoreStatus> = stores
                .iter()
                .filter(|s| c.stores.contains(&s.id) && s.state != StoreState::Gone)
                .collect();
            ClassStatus {
                name: c.name.clone(),
                weight: c.weight,
                stores: mine.len(),
                capacity: mine.iter().map(|s| s.capacity).sum(),
                used: mine.iter().map(|s| s.used).sum(),
            }
        })
        .collect();
    let (missing, lost, inodes) = {
        let ns = e.ns.lock();
        let (m, l) = ns.under_replicated(e.settings.replicas);
        (m, l, ns.count())
    };
    let n = &e.n;
    Status {
        dir: dir.display().to_string(),
        pid: std::process::id(),
        uptime_s: e.started.elapsed().as_secs_f64(),
        stripe: e.settings.stripe,
        replicas: e.settings.replicas,
        classes,
        stores,
        draining_stripes: n.draining.load(Ordering::Relaxed),
        replicas_missing: missing,
        stripes_lost: lost,
        inodes,
        reads: n.reads.load(Ordering::Relaxed),
        writes: n.writes.load(Ordering::Relaxed),
        bytes_read: n.bytes_read.load(Ordering::Relaxed),
        bytes_written: n.bytes_written.load(Ordering::Relaxed),
        cache_hits: n.cache_hits.load(Ordering::Relaxed),
        verification_failures: n.verification_failures.load(Ordering::Relaxed),
        stripes_moved: n.moved.load(Ordering::Relaxed),
        metadata_copy: e.meta.describe(),
    }
}

fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"")
}

/// The status as Prometheus text (`/metrics`).
pub fn prometheus(s: &Status) -> String {
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, rows: Vec<(String, f64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (labels, v) in rows {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let per_store = |f: &dyn Fn(&StoreStatus) -> f64| {
        s.stores
            .iter()
            .map(|st| {
                (
                    format!(
                        "{{class=\"{}\",store=\"{}\",state=\"{:?}\"}}",
                        label(&st.class),
                        label(&st.name),
                        st.state
                    ),
                    f(st),
                )
            })
            .collect::<Vec<_>>()
    };
    gauge(
        "granule_fs_store_capacity_bytes",
        "Bytes the mount may keep on the store.",
        per_store(&|st| st.capacity as f64),
    );
    gauge(
        "granule_fs_store_used_bytes",
        "Bytes of stripe copies the mount keeps on the store.",
        per_store(&|st| st.used as f64),
    );
    gauge(
        "granule_fs_store_stripes",
        "Stripe copies on the store.",
        per_store(&|st| st.stripes as f64),
    );
    gauge(
        "granule_fs_store_verification_failures",
        "Copies from the store that failed verification.",
        per_store(&|st| st.tampered as f64),
    );
    gauge(
        "granule_fs_store_in_place_reads",
        "Stripe reads answered in place from the store's shared memory (own stores on this machine).",
        per_store(&|st| st.in_place_reads as f64),
    );
    gauge(
        "granule_fs_store_probes_missed",
        "Probes the store left unanswered, in all (three in a row make it lost by default).",
        per_store(&|st| st.probes_missed as f64),
    );
    let per_class = |f: &dyn Fn(&ClassStatus) -> f64| {
        s.classes
            .iter()
            .map(|c| (format!("{{class=\"{}\"}}", label(&c.name)), f(c)))
            .collect::<Vec<_>>()
    };
    gauge(
        "granule_fs_class_capacity_bytes",
        "Bytes the mount may keep on the class's stores.",
        per_class(&|c| c.capacity as f64),
    );
    gauge(
        "granule_fs_class_used_bytes",
        "Bytes kept on the class's stores.",
        per_class(&|c| c.used as f64),
    );
    let one = |v: u64| vec![(String::new(), v as f64)];
    gauge(
        "granule_fs_draining_stripes",
        "Stripes left to move off stores being drained.",
        one(s.draining_stripes),
    );
    gauge(
        "granule_fs_replicas_missing",
        "Stripes with fewer copies than the mount keeps.",
        one(s.replicas_missing),
    );
    gauge(
        "granule_fs_stripes_lost",
        "Stripes with no copy left.",
        one(s.stripes_lost),
    );
    gauge(
        "granule_fs_bytes_read",
        "Bytes read through the mount.",
        one(s.bytes_read),
    );
    gauge(
        "granule_fs_bytes_written",
        "Bytes written through the mount.",
        one(s.bytes_written),
    );
    gauge(
        "granule_fs_verification_failures",
        "Stripe copies that failed verification.",
        one(s.verification_failures),
    );
    out
}

/// The lines `granule fs status` prints.
pub fn lines(s: &Status) -> Vec<String> {
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    let mut out = vec![format!(
        "granule fs at {} (pid {}, up {:.0} s): stripe {} KiB, {} cop{} per stripe",
        s.dir,
        s.pid,
        s.uptime_s,
        s.stripe >> 10,
        s.replicas,
        if s.replicas == 1 { "y" } else { "ies" }
    )];
    out.push("class      weight  stores  used / capacity".into());
    for c in &s.classes {
        out.push(format!(
            "{:<10} {:>6.2}  {:>6}  {} / {}",
            c.name,
            c.weight,
            c.stores,
            gib(c.used),
            gib(c.capacity)
        ));
    }
    out.push(
        "store                      class    state     stripes  used / capacity  errors  tampered"
            .into(),
    );
    for st in &s.stores {
        out.push(format!(
            "{:<26} {:<8} {:<9} {:>7}  {} / {}  {:>6}  {:>8}",
            st.name,
            st.class,
            format!("{:?}", st.state).to_lowercase(),
            st.stripes,
            gib(st.used),
            gib(st.capacity),
            st.errors,
            st.tampered
        ));
    }
    let in_place: Vec<&str> = s
        .stores
        .iter()
        .filter(|st| st.in_place)
        .map(|st| st.name.as_str())
        .collect();
    if !in_place.is_empty() {
        out.push(format!(
            "read in place (shared memory on this machine): {}",
            in_place.join(", ")
        ));
    }
    let silent: Vec<String> = s
        .stores
        .iter()
        .filter(|st| st.probes_missed_in_row > 0 && st.state != StoreState::Gone)
        .map(|st| format!("{} ({} in a row)", st.name, st.probes_missed_in_row))
        .collect();
    if !silent.is_empty() {
        out.push(format!("not answering probes: {}", silent.join(", ")));
    }
    out.push(format!(
        "stripes draining: {}   replicas missing: {}   stripes lost: {}   verification failures: {}",
        s.draining_stripes, s.replicas_missing, s.stripes_lost, s.verification_failures
    ));
    out.push(format!("metadata copy: {}", s.metadata_copy));
    out
}

/// What a running mount records about itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub dir: PathBuf,
    pub pid: u32,
    /// `host:port` of its status and metrics door.
    pub http: String,
    /// The controller of its own nodes, when they are not its own embedded ones (they
    /// outlive the mount, and so does its data).
    #[serde(default)]
    pub controller: Option<String>,
    /// The handle of its metadata copy (see `metacopy`), once there is one.
    #[serde(default)]
    pub meta: Option<serde_json::Value>,
}

/// The file a mount of `dir` records itself in.
pub fn record_path(state_dir: &Path, dir: &Path) -> PathBuf {
    // Not canonicalize(): that would stat through the mount, which may be the one hung.
    let canon = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in canon.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    state_dir.join(format!("mount-{h:016x}.json"))
}
