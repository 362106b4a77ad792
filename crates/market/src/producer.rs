//! A producer: the process `granule producer run` starts beside a workload. It runs the
//! [harvester](crate::harvester) on the workload's memory cgroup, serves one
//! [store](crate::store) per lease out of the memory the harvester freed, and keeps a
//! connection to the broker: it registers, reports what it can lease every report
//! period, and opens, extends and closes stores when the broker says so.
//!
//! Why a process of its own and not a Granule node in a producer role: a producer runs
//! beside somebody else's workload, on a machine that need not belong to a Granule
//! cluster, and must stay small and independent of the cluster's binary (nodes must run
//! the driver's exact executable; a producer must not).
//!
//! What it owns: the bookkeeping between harvested bytes and leased bytes. When the
//! harvester gives memory back to the workload (a drop in its performance, a burst),
//! leased bytes above what is harvested are taken back at once: LRU stores evict in
//! proportion to their sizes (the broker learns how much in the next report), and if
//! that is not enough, no-eviction leases are revoked with the configured grace period
//! (the broker tells their consumers) and dropped when it ends. A producer may also
//! offer a fixed amount (`--offer`) without a workload: a machine donating memory.
//!
//! A store whose lease expired and that the broker did not close (the broker is down)
//! is closed by the producer itself a grace period later.

use crate::client::{BrokerClient, MarketError};
use crate::harvester::{HarvestStatus, Harvester, MetricSource, Workload};
use crate::server::now_ms;
use crate::store::{Store, StoreConfig};
use granule_transport::{Connection, Handler, Responder};
use granule_wire::market::{
    EvictionMode, HeldLease, LeaseId, MarketMsg, ProducerId, ProducerState,
};
use granule_wire::{Frame, Msg, RemoteError};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Why a producer could not start.
#[derive(Debug, thiserror::Error)]
pub enum ProducerError {
    #[error("harvester: {0}")]
    Harvest(#[from] crate::harvester::HarvestError),
    #[error("{0}")]
    Broker(#[from] MarketError),
    #[error("{0}")]
    Invalid(String),
}

/// How a producer runs.
#[derive(Clone, Debug)]
pub struct ProducerOptions {
    /// Its name at the broker (stable across restarts).
    pub name: String,
    /// The host consumers reach its stores at.
    pub advertise: String,
    /// The address its stores listen on (`0.0.0.0`, `127.0.0.1`).
    pub listen_host: String,
    /// Bytes offered without harvesting (a machine donating memory; 0: none).
    pub offer: u64,
    /// The broker's address.
    pub broker: String,
}

/// One lease's store.
struct Leased {
    store: Store,
    consumer: String,
    mode: EvictionMode,
    /// Its capacity now (shrinks when the harvester takes memory back).
    bytes: u64,
    expires_unix_ms: u64,
    price: f64,
    /// Set once the lease is being revoked: dropped at this instant.
    drop_at: Option<Instant>,
    /// The hash of the lease's secret (see `broker::holder_proof`), reported to a
    /// restarted broker.
    proof: String,
}

struct Inner {
    cfg: granule_config::Market,
    opts: ProducerOptions,
    harvester: Mutex<Option<Harvester>>,
    stores: Mutex<HashMap<LeaseId, Leased>>,
    /// Bytes each lease's store gave back since the last report.
    shrunk: Mutex<HashMap<LeaseId, u64>>,
    /// Revocations to announce (lease, grace).
    revoking: Mutex<Vec<(LeaseId, u64)>>,
    producer: Mutex<Option<ProducerId>>,
    /// The machine's CPU use, for the idle cores it reports.
    cpu: Mutex<CpuIdle>,
}

/// Idle cores from the root cgroup's CPU accounting between two reports.
struct CpuIdle {
    hierarchy: Option<granule_host::Hierarchy>,
    cpus: f64,
    last: Option<(Instant, Duration)>,
    idle: f64,
}

impl CpuIdle {
    fn new() -> CpuIdle {
        CpuIdle {
            hierarchy: granule_host::Hierarchy::detect().ok(),
            cpus: granule_host::machine::Machine::read().cpus as f64,
            last: None,
            idle: 0.0,
        }
    }

    /// Idle cores since the last reading (the last value when too little time passed).
    fn read(&mut self) -> f64 {
        let Some(h) = &self.hierarchy else {
            return 0.0;
        };
        let Ok(used) = granule_host::cpuacct_usage(h, "") else {
            return 0.0;
        };
        let now = Instant::now();
        if let Some((at, before)) = self.last {
            let wall = now.duration_since(at).as_secs_f64();
            if wall >= 0.05 {
                let busy = used.saturating_sub(before).as_secs_f64() / wall;
                self.idle = (self.cpus - busy).clamp(0.0, self.cpus);
                self.last = Some((now, used));
            }
        } else {
            self.last = Some((now, used));
        }
        self.idle
    }
}

/// A running producer.
pub struct Producer {
    inner: Arc<Inner>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// The broker's orders on the producer's connection.
struct Orders(Weak<Inner>);

impl Handler for Orders {
    fn on_request(&self, _conn: &Arc<Connection>, frame: Frame, reply: Responder) {
        let Some(inner) = self.0.upgrade() else {
            return reply.error(RemoteError::Refused("the producer is stopping".into()));
        };
        match frame.msg {
            Msg::Market(MarketMsg::OpenStore {
                lease,
                consumer,
                secret,
                bytes,
                mode,
                expires_unix_ms,
                price,
                rate_bps,
            }) => {
                tokio::spawn(async move {
                    let r = tokio::task::spawn_blocking(move || {
                        inner.open(
                            lease,
                            consumer,
                            secret,
                            bytes,
                            mode,
                            expires_unix_ms,
                            price,
                            rate_bps,
                        )
                    })
                    .await;
                    match r {
                        Ok(Ok(store_addr)) => {
                            let _ = reply
                                .send(&Msg::Market(MarketMsg::StoreOpened { store_addr }), &[]);
                        }
                        Ok(Err(e)) => reply.error(e),
                        Err(e) => reply.error(RemoteError::Internal(e.to_string())),
                    }
                });
            }
            Msg::Market(MarketMsg::ExtendStore {
                lease,
                expires_unix_ms,
                price,
            }) => match inner.stores.lock().get_mut(&lease) {
                Some(l) => {
                    l.expires_unix_ms = expires_unix_ms;
                    l.price = price;
                    let _ = reply.send(&Msg::Done, &[]);
                }
                None => reply.error(RemoteError::Refused(format!("no store for lease {lease}"))),
            },
            Msg::Market(MarketMsg::CloseStore { lease }) => {
                let gone = inner.stores.lock().remove(&lease);
                if let Some(l) = gone {
                    tracing::info!(lease, consumer = %l.consumer, "lease ended: store closed");
                    l.store.shutdown();
                }
                let _ = reply.send(&Msg::Done, &[]);
            }
            other => reply.error(RemoteError::Protocol(format!(
                "a producer does not handle {}",
                other.name()
            ))),
        }
    }
}

impl Inner {
    fn status(&self) -> Option<HarvestStatus> {
        self.harvester.lock().as_ref().map(|h| h.status())
    }

    /// Bytes it may lease now: what the harvester freed plus the fixed offer.
    fn leasable(&self) -> u64 {
        self.status().map_or(0, |s| s.harvested_bytes) + self.opts.offer
    }

    /// Bytes leased and not being revoked.
    fn leased(stores: &HashMap<LeaseId, Leased>) -> u64 {
        stores
            .values()
            .filter(|l| l.drop_at.is_none())
            .map(|l| l.bytes)
            .sum()
    }

    #[allow(clippy::too_many_arguments)]
    fn open(
        &self,
        lease: LeaseId,
        consumer: String,
        secret: String,
        bytes: u64,
        mode: EvictionMode,
        expires_unix_ms: u64,
        price: f64,
        rate_bps: u64,
    ) -> Result<String, RemoteError> {
        let leasable = self.leasable();
        {
            let stores = self.stores.lock();
            if stores.contains_key(&lease) {
                return Err(RemoteError::Refused(format!(
                    "lease {lease} already has a store"
                )));
            }
            let leased = Self::leased(&stores);
            if leased + bytes > leasable {
                return Err(RemoteError::NoCapacity(format!(
                    "{bytes} bytes asked, {} free",
                    leasable.saturating_sub(leased)
                )));
            }
        }
        let proof = crate::broker::holder_proof(&secret);
        let mut sc = StoreConfig::from_market(&self.cfg, bytes, secret, mode);
        sc.consumer = consumer.clone();
        if rate_bps > 0 {
            sc.rate_bps = rate_bps;
        }
        let store = Store::start(&format!("{}:0", self.opts.listen_host), sc)
            .map_err(|e| RemoteError::Internal(format!("cannot start a store: {e}")))?;
        let addr = format!("{}:{}", self.opts.advertise, store.addr().port());
        tracing::info!(lease, %consumer, bytes, %addr, "lease opened");
        self.stores.lock().insert(
            lease,
            Leased {
                store,
                consumer,
                mode,
                bytes,
                expires_unix_ms,
                price,
                drop_at: None,
                proof,
            },
        );
        Ok(addr)
    }

    /// Take back leased bytes above what may be leased: LRU stores evict in proportion to
    /// their sizes; then no-eviction leases are revoked, largest first.
    fn rebalance(&self) {
        let leasable = self.leasable();
        let grace = self.cfg.revoke_grace;
        let mut stores = self.stores.lock();
        let leased = Self::leased(&stores);
        if leased <= leasable {
            return;
        }
        let mut need = leased - leasable;
        let lru: u64 = stores
            .values()
            .filter(|l| l.drop_at.is_none() && l.mode == EvictionMode::Lru)
            .map(|l| l.bytes)
            .sum();
        if lru > 0 {
            let take_all = need.min(lru);
            let mut taken = 0;
            for (lease, l) in stores
                .iter_mut()
                .filter(|(_, l)| l.drop_at.is_none() && l.mode == EvictionMode::Lru)
            {
                // In proportion to its size, rounded up so the sum covers the need.
                let share = ((take_all as u128 * l.bytes as u128).div_ceil(lru as u128) as u64)
                    .min(l.bytes)
                    .min(take_all - taken);
                if share == 0 {
                    continue;
                }
                l.bytes -= share;
                l.store.resize(l.bytes);
                taken += share;
                *self.shrunk.lock().entry(*lease).or_default() += share;
            }
            need = need.saturating_sub(taken);
            tracing::info!(
                bytes = taken,
                "memory taken back: stores evicted in proportion"
            );
        }
        if need == 0 {
            return;
        }
        let mut held: Vec<(LeaseId, u64)> = stores
            .iter()
            .filter(|(_, l)| l.drop_at.is_none() && l.mode == EvictionMode::NoEviction)
            .map(|(k, l)| (*k, l.bytes))
            .collect();
        held.sort_by_key(|h| std::cmp::Reverse(h.1));
        for (lease, bytes) in held {
            if need == 0 {
                break;
            }
            if let Some(l) = stores.get_mut(&lease) {
                l.drop_at = Some(Instant::now() + grace);
                tracing::warn!(lease, consumer = %l.consumer, grace = ?grace, "memory needed back: revoking a no-eviction lease");
                self.revoking.lock().push((lease, grace.as_millis() as u64));
                need = need.saturating_sub(bytes);
            }
        }
    }

    /// Drop stores whose revocation grace ended, and stores whose lease expired long ago
    /// (the broker, which closes them normally, is away).
    fn sweep(&self) {
        let now = Instant::now();
        let now_unix = now_ms();
        let slack = self.cfg.revoke_grace.as_millis() as u64;
        let mut stores = self.stores.lock();
        let done: Vec<LeaseId> = stores
            .iter()
            .filter(|(_, l)| {
                l.drop_at.is_some_and(|t| t <= now)
                    || l.expires_unix_ms.saturating_add(slack) < now_unix
            })
            .map(|(k, _)| *k)
            .collect();
        for lease in done {
            if let Some(l) = stores.remove(&lease) {
                tracing::info!(lease, consumer = %l.consumer, "store dropped (revoked or expired)");
                l.store.shutdown();
            }
        }
    }

    fn state(&self) -> ProducerState {
        let slab = self.cfg.slab.max(1);
        let leasable = self.leasable();
        let stores = self.stores.lock();
        let leased = Self::leased(&stores);
        let s = self.status().unwrap_or_default();
        ProducerState {
            free_slabs: (leasable.saturating_sub(leased) / slab) as u32,
            leased_slabs: leased.div_ceil(slab) as u32,
            limit_bytes: s.limit_bytes,
            original_limit_bytes: s.original_limit_bytes,
            harvested_bytes: s.harvested_bytes,
            policy_state: if self.harvester.lock().is_some() {
                format!("{}: {}", s.policy, s.state)
            } else {
                "offer only".into()
            },
            cpu_idle_cores: self.cpu.lock().read(),
            // Not measured (0): the same for every producer, so it does not rank them.
            bandwidth_bps: 0,
            resident_bytes: granule_host::proc::resident_bytes(),
        }
    }

    fn held(&self) -> Vec<HeldLease> {
        self.stores
            .lock()
            .iter()
            .filter(|(_, l)| l.drop_at.is_none())
            .map(|(k, l)| HeldLease {
                lease: *k,
                consumer: l.consumer.clone(),
                slabs: l.bytes.div_ceil(self.cfg.slab.max(1)) as u32,
                store_addr: format!("{}:{}", self.opts.advertise, l.store.addr().port()),
                expires_unix_ms: l.expires_unix_ms,
                price: l.price,
                mode: l.mode,
                proof: l.proof.clone(),
            })
            .collect()
    }
}

impl Producer {
    /// Undo what a killed producer left behind, start the harvester (when there is a
    /// workload), hand `announce` the lines saying what was restored and what was changed
    /// on the machine, and then connect to the broker in the background.
    ///
    /// `announce` runs before the connection starts, so whoever prints its lines prints
    /// them before the broker registration is said (scripts and tests read the output in
    /// that order: the workload's pid comes before "registered with the broker").
    pub fn start(
        cfg: &granule_config::Config,
        opts: ProducerOptions,
        workload: Option<(Workload, MetricSource)>,
        announce: impl FnOnce(&[String]),
    ) -> Result<Producer, ProducerError> {
        if workload.is_none() && opts.offer == 0 {
            return Err(ProducerError::Invalid(
                "nothing to lease: give a workload to harvest (--cgroup PATH or -- CMD ARGS) or a fixed --offer SIZE".into(),
            ));
        }
        let market = cfg.market.clone();
        let mut lines = crate::harvester::Harvester::recover(&market)?;
        let harvester = match workload {
            Some((w, m)) => {
                let h = Harvester::start(&market, w, m)?;
                lines.extend(h.changes());
                Some(h)
            }
            None => None,
        };
        let watch = harvester.as_ref().map(|h| h.watch());
        let inner = Arc::new(Inner {
            cfg: market,
            opts,
            harvester: Mutex::new(harvester),
            stores: Mutex::new(HashMap::new()),
            shrunk: Mutex::new(HashMap::new()),
            revoking: Mutex::new(Vec::new()),
            producer: Mutex::new(None),
            cpu: Mutex::new(CpuIdle::new()),
        });
        announce(&lines);
        let task = tokio::spawn(run(Arc::downgrade(&inner), watch));
        Ok(Producer {
            inner,
            task: Some(task),
        })
    }

    /// What it reports to the broker now.
    pub fn state(&self) -> ProducerState {
        self.inner.state()
    }

    /// The harvester's status, when it harvests a workload.
    pub fn harvest_status(&self) -> Option<HarvestStatus> {
        self.inner.status()
    }

    /// The workload's process, when the producer started it.
    pub fn child_pid(&self) -> Option<u32> {
        self.inner
            .harvester
            .lock()
            .as_ref()
            .and_then(|h| h.child_pid())
    }

    /// Close every store, stop harvesting and undo what was changed on the machine;
    /// returns what was undone.
    pub fn stop(mut self) -> Result<Vec<String>, ProducerError> {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        for (_, l) in self.inner.stores.lock().drain() {
            l.store.shutdown();
        }
        let h = self.inner.harvester.lock().take();
        match h {
            Some(h) => Ok(h.stop()?),
            None => Ok(Vec::new()),
        }
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        for (_, l) in self.inner.stores.lock().drain() {
            l.store.shutdown();
        }
    }
}

/// Connect, register, report every period; reconnect when the broker goes away.
async fn run(inner: Weak<Inner>, mut watch: Option<tokio::sync::watch::Receiver<HarvestStatus>>) {
    let mut warned = false;
    loop {
        let Some(me) = inner.upgrade() else { return };
        let addr = me.opts.broker.clone();
        let orders: Arc<dyn Handler> = Arc::new(Orders(inner.clone()));
        let client = match BrokerClient::connect(&addr, "granule-producer", orders).await {
            Ok(c) => c,
            Err(e) => {
                if !warned {
                    tracing::warn!("{e}; harvesting goes on, retrying every second");
                    eprintln!("granule producer: {e}; retrying every second");
                    warned = true;
                }
                drop(me);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let hello = MarketMsg::ProducerHello {
            name: me.opts.name.clone(),
            host: me.opts.advertise.clone(),
            slab_bytes: me.cfg.slab,
            state: me.state(),
            held: me.held(),
        };
        let (id, interval) = match client.call(hello).await {
            Ok(MarketMsg::ProducerOk {
                producer,
                report_interval_ms,
            }) => (producer, Duration::from_millis(report_interval_ms.max(10))),
            Ok(other) => {
                tracing::warn!("the broker answered the hello with {}", other.name());
                drop(me);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(e) => {
                tracing::warn!("registering with the broker failed: {e}");
                drop(me);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if warned {
            eprintln!("granule producer: connected to the broker at {addr}");
        }
        warned = false;
        println!("granule producer registered with the broker at {addr} as producer {id}");
        *me.producer.lock() = Some(id);
        drop(me);
        let mut tick = tokio::time::interval(interval.min(Duration::from_millis(500)));
        let mut last_report = Instant::now() - interval;
        loop {
            // Wake on the period, or at once when the harvester changes its mind.
            match watch.as_mut() {
                Some(w) => {
                    tokio::select! {
                        _ = tick.tick() => {}
                        r = w.changed() => { if r.is_err() { watch = None; } }
                    }
                }
                None => {
                    tick.tick().await;
                }
            }
            let Some(me) = inner.upgrade() else { return };
            me.rebalance();
            me.sweep();
            let revoking = std::mem::take(&mut *me.revoking.lock());
            for (lease, grace_ms) in revoking {
                let m = MarketMsg::Revoking {
                    producer: id,
                    lease,
                    grace_ms,
                };
                if let Err(e) = client.call_done(m).await {
                    tracing::warn!(lease, "announcing a revocation failed: {e}");
                }
            }
            if client.is_closed() {
                eprintln!("granule producer: lost the broker at {addr}; reconnecting (stores keep serving)");
                break;
            }
            if last_report.elapsed() >= interval {
                last_report = Instant::now();
                let shrunk: Vec<(LeaseId, u64)> = me.shrunk.lock().drain().collect();
                let report = MarketMsg::ProducerReport {
                    producer: id,
                    state: me.state(),
                    shrunk,
                };
                if let Err(e) = client.call_done(report).await {
                    tracing::warn!("report to the broker failed: {e}");
                    if client.is_closed() {
                        break;
                    }
                }
            }
        }
    }
}
