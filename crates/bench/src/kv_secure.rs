//! `granule-bench kv-secure`: the market consumer's latency by protection mode — no
//! protection, integrity-only (keyed BLAKE3) and encrypted (AES-256-GCM) — end to end
//! over TCP to a store, at several value sizes.
//!
//! - **Stores**: one producer store per mode (each lease has its own store), Redis
//!   protocol with AUTH, LRU, large enough that nothing is evicted (see `StoreProc`).
//! - **Client**: one [`KvCache`] per mode on a current-thread tokio runtime in this
//!   process, one operation at a time (closed loop, latency of each operation).
//! - **Workload**: each cache is loaded with `KEYS` values; then rounds in which every
//!   mode in turn (the order rotating each round, so drift and the other tenants of the
//!   machine hit every mode alike) runs `BATCH` operations, half GETs of a random loaded
//!   key, half PUTs overwriting one.
//! - **Headline**: `integrity_overhead_p50` and `encrypted_overhead_p50` = p50 of all
//!   operations at 1 KiB with the mode ÷ the same without protection − 1.

use crate::BenchOpts;
use anyhow::Context;
use granule_market::consumer::{
    compare_ciphers, KvCache, LeaseGrant, LeaseSource, Protection, StaticLeases,
};
use granule_market::store::{EvictionMode as StoreEviction, Store, StoreConfig};
use granule_report::stats::Latency;
use granule_report::{Cell, Meta, Plot, Report, Table};
use granule_wire::market::EvictionMode;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MODES: [Protection; 3] = [Protection::None, Protection::Integrity, Protection::Encrypt];
const STORE_CPU: usize = 0;
const CLIENT_CPU: usize = 1;
/// The value size the headline figures are taken at.
const HEADLINE_BYTES: usize = 1024;

/// A store for benchmarks: a producer store ([`granule_market::store::Store`], the one a
/// producer serves a lease from) on a free loopback port, on its own thread in this
/// process, with a fresh secret, LRU eviction past `bytes` and no rate limit; shut down
/// on drop.
pub(crate) struct StoreProc {
    store: Store,
    pub addr: String,
    pub secret: String,
}

impl StoreProc {
    /// Start a store of `bytes` (LRU beyond that), its thread pinned to `cpu` if given.
    pub(crate) fn start(bytes: u64, tag: &str, cpu: Option<usize>) -> anyhow::Result<StoreProc> {
        let secret = format!("bench-{tag}-{:016x}", rand_u64());
        let mut cfg = StoreConfig::new(bytes, &secret, StoreEviction::Lru);
        cfg.rate_bps = 0;
        cfg.consumer = format!("bench-{tag}");
        let store =
            Store::start_pinned("127.0.0.1:0", cfg, cpu).context("starting a producer store")?;
        let addr = store.addr().to_string();
        Ok(StoreProc {
            store,
            addr,
            secret,
        })
    }

    /// A grant for this store, as the broker would hand out.
    pub(crate) fn grant(&self, lease: u64, bytes: u64) -> LeaseGrant {
        LeaseGrant {
            lease,
            producer: lease,
            producer_name: format!("bench-store-{lease}"),
            store_addr: self.addr.clone(),
            secret: self.secret.clone(),
            slabs: 1,
            slab_bytes: bytes,
            expires_unix_ms: u64::MAX / 2,
            price: 0.0,
            mode: EvictionMode::Lru,
        }
    }
}

impl Drop for StoreProc {
    fn drop(&mut self) {
        self.store.shutdown();
    }
}

pub(crate) fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

/// xorshift64*: the workload's cheap, seeded random numbers.
pub(crate) struct Rng(pub u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Latencies of one (size, mode).
#[derive(Default)]
struct Lat {
    get: Latency,
    put: Latency,
    all: Latency,
}

pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    let sizes: Vec<usize> = if opts.quick {
        vec![HEADLINE_BYTES]
    } else {
        vec![64, HEADLINE_BYTES, 4096, 16384]
    };
    let (keys, rounds, batch) = if opts.quick {
        (200, 10, 100)
    } else {
        (2000, 60, 250)
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let store_bytes: u64 = 512 << 20;
    // The stores on vCPU 0, the client (this thread) on vCPU 1: every mode crosses cores
    // alike, as a request to another machine would. Floating, a store that happened to
    // share the client's vCPU answered in a third of the time of one that did not.
    let pin = granule_host::os::affinity(0).map(|c| c.len()).unwrap_or(1) >= 2;
    let _saved = crate::affinity::SavedAffinity::save();
    let stores: Vec<StoreProc> = MODES
        .iter()
        .map(|p| StoreProc::start(store_bytes, p.as_str(), pin.then_some(STORE_CPU)))
        .collect::<anyhow::Result<_>>()?;
    if pin {
        crate::affinity::pin_current_thread(CLIENT_CPU)?;
    }
    let caches: Vec<KvCache> = rt.block_on(async {
        let mut v = Vec::new();
        for (i, (p, s)) in MODES.iter().zip(&stores).enumerate() {
            let src: Arc<dyn LeaseSource> =
                Arc::new(StaticLeases::new(vec![s.grant(i as u64 + 1, store_bytes)]));
            let c = KvCache::new(src, *p, 1).await?;
            anyhow::ensure!(c.stats().leases == 1, "no lease on {}", s.addr);
            v.push(c);
        }
        Ok(v)
    })?;

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ rand_u64() | 1);
    let mut lat: Vec<Vec<Lat>> = sizes
        .iter()
        .map(|_| MODES.iter().map(|_| Lat::default()).collect())
        .collect();
    let t_start = Instant::now();
    for (si, &size) in sizes.iter().enumerate() {
        let mut value = vec![0u8; size];
        for b in value.iter_mut() {
            *b = rng.next() as u8;
        }
        rt.block_on(async {
            for c in &caches {
                for k in 0..keys {
                    c.put(&key(si, k), &value).await?;
                }
            }
            for round in 0..rounds {
                for m in 0..MODES.len() {
                    let mi = (m + round) % MODES.len();
                    let c = &caches[mi];
                    for _ in 0..batch {
                        let r = rng.next();
                        let k = key(si, (r >> 1) as usize % keys);
                        let is_get = r & 1 == 0;
                        let t = Instant::now();
                        if is_get {
                            let got = c.get(&k).await?;
                            anyhow::ensure!(
                                got.as_ref().map(|v| v.len()) == Some(size),
                                "GET missed"
                            );
                        } else {
                            // A changed value each PUT, as an application would write.
                            value[0] = value[0].wrapping_add(1);
                            c.put(&k, &value).await?;
                        }
                        let d = t.elapsed();
                        let l = &mut lat[si][mi];
                        if is_get {
                            l.get.record(d)
                        } else {
                            l.put.record(d)
                        }
                        l.all.record(d);
                    }
                }
            }
            Ok::<_, anyhow::Error>(())
        })?;
    }
    let elapsed = t_start.elapsed();
    let stats: Vec<_> = caches.iter().map(|c| c.stats()).collect();
    drop(caches);
    drop(stores);

    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mut table = Table::new(&[
        "value_bytes",
        "protection",
        "op",
        "ops",
        "p50_us",
        "p99_us",
        "mean_us",
        "overhead_p50",
        "overhead_p99",
    ]);
    let mut plot = Plot::bars("Consumer latency by protection (p50 of a 50 % GET / 50 % PUT mix, one store per mode over loopback TCP)")
        .x_label("value bytes")
        .y_label("p50 latency (µs)")
        .categories(sizes.iter().map(|s| s.to_string()));
    for (mi, p) in MODES.iter().enumerate() {
        plot.push_bar_series(
            p.as_str(),
            sizes
                .iter()
                .enumerate()
                .map(|(si, _)| us(lat[si][mi].all.p(0.5))),
        );
    }
    for (si, &size) in sizes.iter().enumerate() {
        for (mi, p) in MODES.iter().enumerate() {
            let pick = |l: &Lat, op: &str| -> Latency {
                match op {
                    "get" => l.get.clone(),
                    "put" => l.put.clone(),
                    _ => l.all.clone(),
                }
            };
            for op in ["get", "put", "all"] {
                let l = pick(&lat[si][mi], op);
                let base = pick(&lat[si][0], op);
                table.row(vec![
                    Cell::from(size as f64),
                    Cell::from(p.as_str()),
                    Cell::from(op),
                    Cell::from(l.count() as f64),
                    Cell::from(us(l.p(0.5))),
                    Cell::from(us(l.p(0.99))),
                    Cell::from(us(l.mean())),
                    Cell::from(us(l.p(0.5)) / us(base.p(0.5)) - 1.0),
                    Cell::from(us(l.p(0.99)) / us(base.p(0.99)) - 1.0),
                ]);
            }
        }
    }
    let hi = sizes.iter().position(|&s| s == HEADLINE_BYTES).unwrap_or(0);
    let h = |mi: usize, q: f64| us(lat[hi][mi].all.p(q));
    let integrity_p50 = h(1, 0.5) / h(0, 0.5) - 1.0;
    let encrypted_p50 = h(2, 0.5) / h(0, 0.5) - 1.0;
    let ciphers = compare_ciphers(HEADLINE_BYTES, if opts.quick { 2_000 } else { 50_000 });
    let cipher_note = ciphers
        .iter()
        .map(|(n, d)| format!("{n} {:.2} µs", us(*d)))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "kv-secure: p50 at {HEADLINE_BYTES} B: none {:.1} µs, integrity {:.1} µs ({:+.1} %), encrypt {:.1} µs ({:+.1} %); seal+open of {HEADLINE_BYTES} B: {cipher_note}",
        h(0, 0.5), h(1, 0.5), integrity_p50 * 100.0, h(2, 0.5), encrypted_p50 * 100.0
    );
    for s in &stats {
        anyhow::ensure!(
            s.verification_failures == 0 && s.misses == 0,
            "unexpected failures or misses: {s:?}"
        );
    }

    let placement = if pin {
        format!(
            "the three caches on one current-thread tokio runtime on this process's main thread, one operation at a \
             time, pinned to vCPU {CLIENT_CPU}; the three producer stores (one per mode, each on its own thread in \
             this process) pinned to vCPU {STORE_CPU}: every request crosses cores alike"
        )
    } else {
        "fewer than two vCPUs available: nothing pinned".to_string()
    };
    let mut meta = Meta::collect(placement, opts.quick);
    meta.note(format!(
        "stores: producer stores (granule_market::store::Store, as a producer serves a lease) with AUTH (the lease's secret), \
         {} MiB, approximate LRU, no rate limit; the client is the `redis` crate \
         (multiplexed connection). Workload per value size: {keys} keys loaded per mode, then {rounds} rounds in which each mode \
         in turn (rotating order) runs {batch} operations, 50 % GET of a random loaded key and 50 % PUT overwriting one; \
         {:.1} s in all.",
        store_bytes >> 20,
        elapsed.as_secs_f64()
    ));
    meta.note(format!(
        "Encrypted mode is AES-256-GCM (random 96-bit nonce, the substituted key as associated data), the fastest AEAD on \
         this CPU (AES-NI, PCLMULQDQ, VAES): seal + open of one {HEADLINE_BYTES} B value in this process took {cipher_note}. \
         Integrity mode is keyed BLAKE3 over the substituted key and the value (32-byte tag)."
    ));
    meta.note(
        "Headline: overhead = p50 (or p99) of all operations of the mix at 1 KiB with the mode ÷ the same without \
         protection − 1. Every GET hit and verified; verification failures 0."
            .to_string(),
    );
    let mut rep = Report::new("kv-secure", meta);
    rep.title("Benchmark: kv-secure — consumer latency with no protection, integrity-only and encrypted values");
    rep.table(table);
    rep.plot(plot);
    rep.summary("integrity_overhead_p50", integrity_p50);
    rep.summary("encrypted_overhead_p50", encrypted_p50);
    rep.summary("integrity_overhead_p99", h(1, 0.99) / h(0, 0.99) - 1.0);
    rep.summary("encrypted_overhead_p99", h(2, 0.99) / h(0, 0.99) - 1.0);
    rep.summary("p50_us_none", h(0, 0.5));
    rep.summary("p50_us_integrity", h(1, 0.5));
    rep.summary("p50_us_encrypted", h(2, 0.5));
    rep.summary("p99_us_none", h(0, 0.99));
    rep.summary("p99_us_integrity", h(1, 0.99));
    rep.summary("p99_us_encrypted", h(2, 0.99));
    for (n, d) in &ciphers {
        let name = n.to_ascii_lowercase().replace([' ', '-'], "_");
        rep.summary(format!("seal_open_us_{name}"), us(*d));
    }
    Ok(rep.write(&opts.out)?)
}

fn key(size_index: usize, k: usize) -> Vec<u8> {
    format!("user:{size_index}:{k:08}").into_bytes()
}

pub(crate) fn redis_version() -> String {
    std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| {
            s.split_whitespace()
                .find(|w| w.starts_with("v="))
                .map(|w| w[2..].to_string())
        })
        .unwrap_or_else(|| "?".into())
}
