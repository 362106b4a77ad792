//! The resource monitor of a node, and shedding under pressure.
//!
//! The *monitor* (mechanism) samples, every `pressure.mem_interval`, the node's
//! memory: what its cgroup is charged against the cgroup's limit when it runs in one (that
//! includes every other process in the cgroup, such as an antagonist), else its resident
//! memory against its budget (its spec's memory). Every `pressure.cpu_interval`
//! it samples CPU: the cgroup's throttling (`cpu.stat`), the run-queue delay of the
//! node's threads (`/proc/self/task/*/schedstat`), and which proclet each thread was
//! running, charging the thread's CPU time to it (see `accounting`). Per proclet it keeps
//! cores used (an exponentially weighted average with a `pressure.cpu_window`
//! time constant) and the footprint (re-measured after mutating calls, rate-limited).
//!
//! *Memory pressure*: free memory (limit − used) below a threshold. *CPU pressure*: the
//! cgroup was throttled in more than a fraction of its CFS periods, or the node's threads
//! waited on the run queue for more than a fraction of the wall time per core. (Busy cores
//! never exceed a quota, so they say nothing about pressure.)
//!
//! The *policy* (`policy.rs`: a trait, so it can be replaced and tested alone)
//! decides what to move while pressure lasts; the default [`ArgmaxPolicy`] takes the
//! proclet with the largest resource use ÷ estimated migration time. The monitor then asks
//! the controller for a destination with room for that resource and moves the proclet
//! with the migration engine, one at a time, re-sampling between moves, until the
//! pressure is gone.

use super::policy::{ArgmaxPolicy, Candidate, NodeView, PressurePolicy};
use super::NodeInner;
use crate::slot::{Slot, TryLock};
use granule_config::Pressure;
use granule_wire::{CallMode, Kind, Location, Resource};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pause after a move made for CPU pressure, before the next decision.
const CPU_SETTLE: Duration = Duration::from_millis(200);

/// The latest readings.
#[derive(Clone, Debug, Default)]
pub(crate) struct Reading {
    pub mem_used: u64,
    pub mem_limit: u64,
    pub rss: u64,
    /// Sum of the hosted proclets' footprints.
    pub proclet_bytes: u64,
    pub cgroup_limit: u64,
    pub cgroup_usage: u64,
    pub cpu_throttled: f64,
    pub runq_delay: f64,
    pub mem_pressure: bool,
    pub cpu_pressure: bool,
    /// Memory growth, bytes per second.
    pub mem_growth: f64,
}

/// Reads the cgroup files of the node's own cgroups, if it runs in any.
struct CgroupFiles {
    reader: Option<granule_host::Reader>,
    /// Recent `cpu.stat` readings, oldest first, spanning about `THROTTLE_WINDOW`.
    cpu_history: Recent<granule_host::CpuStat>,
}

/// The window over which cgroup throttling is measured (fifteen 20 ms CFS periods).
const THROTTLE_WINDOW: Duration = Duration::from_millis(300);

pub(crate) struct Monitor {
    pub config: Pressure,
    budget: u64,
    cores: f64,
    epoch: Instant,
    latest: Mutex<Reading>,
    /// Move cost model: fixed overhead (µs) and bandwidth (bytes/s), learned from moves.
    overhead_us: AtomicU64,
    bandwidth: AtomicU64,
    shedding: AtomicBool,
    /// Woken when a memory move finishes, so the next sample (and the next move, if the
    /// pressure is still there) follows at once rather than at the next tick.
    moved: tokio::sync::Notify,
    policy: Box<dyn PressurePolicy>,
}

impl Monitor {
    pub(crate) fn new(budget: u64, cores: f64, config: Pressure) -> Monitor {
        Monitor {
            config,
            budget,
            cores,
            epoch: Instant::now(),
            latest: Mutex::new(Reading {
                mem_limit: budget,
                ..Default::default()
            }),
            overhead_us: AtomicU64::new(300),
            bandwidth: AtomicU64::new(1 << 30),
            shedding: AtomicBool::new(false),
            moved: tokio::sync::Notify::new(),
            policy: Box::new(ArgmaxPolicy::default()),
        }
    }

    /// The node's memory budget (its spec).
    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    pub(crate) fn reading(&self) -> Reading {
        self.latest.lock().clone()
    }

    /// Memory this node can still take (negative when over its limit).
    pub(crate) fn mem_room(&self) -> i64 {
        let r = self.latest.lock();
        r.mem_limit as i64 - r.mem_used as i64
    }

    /// Estimated time to move a state of `bytes`.
    pub(crate) fn migration_time(&self, bytes: u64) -> Duration {
        let bw = self.bandwidth.load(Ordering::Relaxed).max(1) as f64;
        Duration::from_micros(self.overhead_us.load(Ordering::Relaxed))
            + Duration::from_secs_f64(bytes as f64 / bw)
    }

    /// Learn from a finished move (`took` excludes waiting for calls to drain).
    pub(crate) fn record_move(&self, bytes: u64, took: Duration) {
        let secs = took.as_secs_f64();
        if bytes >= (256 << 10) && secs > 0.0 {
            let bw = bytes as f64 / secs;
            let old = self.bandwidth.load(Ordering::Relaxed) as f64;
            self.bandwidth
                .store((0.7 * old + 0.3 * bw) as u64, Ordering::Relaxed);
        } else if bytes < (64 << 10) {
            let old = self.overhead_us.load(Ordering::Relaxed) as f64;
            let us = took.as_micros() as f64;
            self.overhead_us
                .store((0.7 * old + 0.3 * us) as u64, Ordering::Relaxed);
        }
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Measure a proclet's footprint now if its lock is free (skipped otherwise).
    pub(crate) fn measure_now(&self, slot: &Arc<Slot>) {
        if let Ok(TryLock::Granted(g)) = slot.lock(crate::context::new_chain(), CallMode::Shared) {
            self.measure_under(&g);
        }
    }

    /// Measure the footprint of the proclet whose lock `g` holds (any mode).
    pub(crate) fn measure_under(&self, g: &crate::slot::Guard) {
        let slot = g.slot();
        let Some(ops) = slot.state_desc.state_ops() else {
            return;
        };
        slot.stats.dirty.store(false, Ordering::Relaxed);
        let bytes = g.inspect(|s| (ops.footprint)(s));
        slot.stats.footprint.store(bytes, Ordering::Relaxed);
        slot.stats
            .measured_at
            .store(self.now_ns(), Ordering::Relaxed);
    }

    fn sample_memory(
        &self,
        cg: &mut CgroupFiles,
        growth: &mut Growth,
        node: &NodeInner,
    ) -> Reading {
        let rss = granule_host::proc::resident_bytes();
        // Only a cgroup with a limit says anything about this node's room: an unlimited
        // one (a driver started in some session's cgroup) is charged for unrelated
        // processes.
        let (cg_usage, cg_limit) = match &cg.reader {
            Some(r) => match r.memory_limit() {
                Ok(limit) if limit > 0 => (r.memory_usage().unwrap_or(0), limit),
                _ => (0, 0),
            },
            None => (0, 0),
        };
        // Free memory is the smaller of what the budget leaves (against what this
        // process holds) and what the cgroup leaves (against everything charged to it).
        let proclet_bytes = node.hosting.proclet_bytes();
        let own = rss.max(proclet_bytes);
        let budget_free = self.budget as i64 - own as i64;
        let cgroup_free = cg_limit as i64 - cg_usage as i64;
        let (used, limit, free) = if cg_limit > 0 && cgroup_free < budget_free {
            (cg_usage, cg_limit, cgroup_free)
        } else {
            (own, self.budget, budget_free)
        };
        // Memory growing fast (an antagonist allocating in the node's cgroup) leaves less
        // time than the static threshold assumes: keep enough free for `mem_horizon` of
        // the current growth. Uncapped on purpose: growth that would fill the node within
        // the horizon is pressure now, however much is still free, and every millisecond
        // of delay is one more the node's calls share a core with the allocator. A
        // one-off burst (a large proclet being built) costs at most one move: the rate
        // falls back within a growth window.
        // Proclets arriving by migration are not the growth to run from (that would send
        // them straight back): count them out. Nor is the room our own moves free: count
        // departed states back in, or each move would hide the growth it is running from
        // for a window, and shedding would stutter.
        let arrived = node.migration.received_bytes.load(Ordering::Relaxed);
        let departed = node.migration.departed_bytes.load(Ordering::Relaxed);
        let rate = growth.observe(Instant::now(), (used + departed).saturating_sub(arrived));
        let predictive = (rate * self.config.mem_horizon.as_secs_f64()) as u64;
        let threshold = self.config.free_min_for(limit).max(predictive);
        let mut r = self.latest.lock();
        r.rss = rss;
        r.proclet_bytes = proclet_bytes;
        r.cgroup_usage = cg_usage;
        r.cgroup_limit = cg_limit;
        r.mem_used = used;
        r.mem_limit = limit;
        r.mem_growth = rate;
        let was = r.mem_pressure;
        let predicted = growth.predict(Instant::now(), free, predictive);
        r.mem_pressure = free < self.config.free_min_for(limit) as i64 || predicted;
        if was != r.mem_pressure {
            tracing::debug!(
                pressure = r.mem_pressure,
                free,
                threshold,
                rate,
                "memory pressure changed"
            );
        }
        r.clone()
    }
}

/// Warn (once per proclet, after its CPU average settled) when a proclet's use does not
/// match its kind: placement and the pressure policy trust the kind, so a memory proclet
/// that burns CPU, or a compute proclet that mostly holds data, lands in the wrong place.
fn warn_if_misdeclared(slot: &Slot, cores: f64, cfg: &Pressure) {
    let (compute_min, memory_max) = (cfg.compute_min_cores_per_mib, cfg.memory_max_cores_per_mib);
    if slot.since.elapsed() < Duration::from_secs(3) || slot.stats.warned.load(Ordering::Relaxed) {
        return;
    }
    let mib = slot.stats.footprint.load(Ordering::Relaxed) as f64 / (1 << 20) as f64;
    let ratio = cores / mib.max(1e-9);
    let odd = match slot.kind() {
        Kind::Compute => mib >= 1.0 && ratio < compute_min,
        Kind::Memory => mib >= 1.0 && ratio > memory_max && cores >= 0.05,
        Kind::Hybrid => false,
    };
    if odd && !slot.stats.warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            proclet = %slot.id,
            kind = %slot.kind(),
            cores = format!("{cores:.3}"),
            mib = format!("{mib:.1}"),
            "this proclet's use does not match its kind ({:.4} cores/MiB; compute proclets \
             should use ≥ {compute_min}, memory proclets ≤ {memory_max}); \
             consider Kind::Hybrid (hybridize a sharded structure) or splitting it",
            ratio
        );
    }
}

/// Readings over a sliding window of time: what a rate over the last `span` is computed
/// from (the newest reading against the oldest one kept).
struct Recent<T> {
    span: Duration,
    samples: std::collections::VecDeque<(Instant, T)>,
}

impl<T> Recent<T> {
    fn new(span: Duration) -> Self {
        Recent {
            span,
            samples: Default::default(),
        }
    }

    /// Record a reading; returns the baseline to compare it with: the newest reading at
    /// least `span` old, or the oldest one there is (the reading itself, at first).
    fn push(&mut self, now: Instant, value: T) -> &(Instant, T) {
        self.samples.push_back((now, value));
        while self
            .samples
            .get(1)
            .is_some_and(|(t, _)| now.duration_since(*t) >= self.span)
        {
            self.samples.pop_front();
        }
        &self.samples[0]
    }
}

/// Growth rate of a node's memory use over the last [`GROWTH_WINDOW`], and whether the
/// predictive rule (free memory would not last the horizon) holds, debounced.
pub(crate) struct Growth {
    recent: Recent<u64>,
    /// The debounced verdict of the predictive rule.
    predicted: bool,
    /// Since when the raw verdict has disagreed with `predicted`.
    disagreeing_since: Option<Instant>,
}

/// How long the predictive rule's raw verdict must hold before it is believed, either way.
/// A burst (a node building a few large proclets at once grows at GB/s for a few ms) then
/// moves nothing, and shedding does not stutter when one move's freed memory makes a
/// single window's growth look small; an antagonist is detected this much later (at
/// 1 GiB/s, 20 MiB later).
const PREDICTION_DEBOUNCE: Duration = Duration::from_millis(20);

/// Once shedding for predicted exhaustion, carry on until free memory would last this
/// many horizons. An allocator's speed wavers (on this VM, with the hypervisor's page
/// faults, 250–600 MB/s within a second): without a margin each dip ended the pressure
/// for the ~50 ms it took to come back, while the allocator kept eating the node.
const LEAVE_MARGIN: f64 = 1.5;

/// The window over which memory growth is measured.
const GROWTH_WINDOW: Duration = Duration::from_millis(50);

impl Default for Growth {
    fn default() -> Self {
        Growth {
            recent: Recent::new(GROWTH_WINDOW),
            predicted: false,
            disagreeing_since: None,
        }
    }
}

impl Growth {
    /// The predictive rule's verdict at `now`, given its raw verdict `hit`: it changes
    /// only after `hit` has said otherwise for [`PREDICTION_DEBOUNCE`].
    pub(crate) fn debounce(&mut self, now: Instant, hit: bool) -> bool {
        if hit == self.predicted {
            self.disagreeing_since = None;
        } else {
            let since = *self.disagreeing_since.get_or_insert(now);
            if now.duration_since(since) >= PREDICTION_DEBOUNCE {
                self.predicted = hit;
                self.disagreeing_since = None;
            }
        }
        self.predicted
    }

    /// The predictive rule at `now`: is `free` memory short of `need` (growth over the
    /// horizon)? With hysteresis — once it holds, it ends only when free memory covers
    /// [`LEAVE_MARGIN`] × `need` — and debounced.
    pub(crate) fn predict(&mut self, now: Instant, free: i64, need: u64) -> bool {
        let margin = if self.predicted { LEAVE_MARGIN } else { 1.0 };
        self.debounce(now, (free as f64) < need as f64 * margin)
    }

    /// Record a reading; returns the growth in bytes per second (0 when shrinking).
    pub(crate) fn observe(&mut self, now: Instant, used: u64) -> f64 {
        match *self.recent.push(now, used) {
            (t, u) if now > t => {
                used.saturating_sub(u) as f64 / now.duration_since(t).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

/// Per-thread CPU bookkeeping of the CPU sampler.
#[derive(Default)]
struct CpuSampler {
    last: HashMap<i32, (u64, u64)>,
    at: Option<Instant>,
    runq_high: u32,
}

impl NodeInner {
    fn sample_cpu(&self, s: &mut CpuSampler, cg: &mut CgroupFiles) {
        let now = Instant::now();
        let wall = s.at.map(|t| now.duration_since(t).as_secs_f64());
        s.at = Some(now);
        // Which slot each registered thread is in.
        let running: HashMap<i32, u64> = crate::accounting::threads()
            .iter()
            .map(|c| (c.tid, c.current.load(Ordering::Relaxed)))
            .collect();
        let by_serial: HashMap<u64, Arc<Slot>> = self
            .hosting
            .slots()
            .into_iter()
            .map(|s| (s.serial, s))
            .collect();
        let mut delay_total = 0u64;
        let mut seen = Vec::new();
        for tid in granule_host::proc::thread_ids() {
            let Some(st) = granule_host::proc::thread_schedstat(tid) else {
                continue;
            };
            let (cpu, delay) = (st.cpu_ns, st.runq_delay_ns);
            seen.push(tid);
            if let Some((lcpu, ldelay)) = s.last.insert(tid, (cpu, delay)) {
                delay_total += delay.saturating_sub(ldelay);
                let used = cpu.saturating_sub(lcpu);
                if let Some(slot) = running
                    .get(&tid)
                    .filter(|serial| **serial != 0)
                    .and_then(|serial| by_serial.get(serial))
                {
                    slot.stats.cpu_pending_ns.fetch_add(used, Ordering::Relaxed);
                }
            }
        }
        let gone: Vec<i32> = s
            .last
            .keys()
            .filter(|t| !seen.contains(t))
            .copied()
            .collect();
        for t in &gone {
            s.last.remove(t);
        }
        let registered_gone: Vec<i32> = running
            .keys()
            .filter(|t| !seen.contains(t))
            .copied()
            .collect();
        crate::accounting::prune(&registered_gone);
        let Some(wall) = wall.filter(|w| *w > 0.0) else {
            return;
        };
        // Fold the charges into each proclet's average.
        let alpha = (wall / self.monitor.config.cpu_window.as_secs_f64()).min(1.0);
        for slot in by_serial.values() {
            let used = slot.stats.cpu_pending_ns.swap(0, Ordering::Relaxed) as f64 / 1e9;
            let rate = used / wall;
            let old = slot.stats.cores();
            let new = old + alpha * (rate - old);
            slot.stats.cores.store(new.to_bits(), Ordering::Relaxed);
            warn_if_misdeclared(slot, new, &self.monitor.config);
        }
        let runq = delay_total as f64 / 1e9 / wall;
        // CFS periods (20 ms) are counted only while the group runs: throttling is judged
        // over the last THROTTLE_WINDOW, many periods, not per sample.
        let throttled = match cg.reader.as_ref().map(|r| r.cpu_stat()) {
            Some(Ok(stat)) => match cg.cpu_history.push(now, stat) {
                (_, old) if stat.nr_periods > old.nr_periods => {
                    stat.nr_throttled.saturating_sub(old.nr_throttled) as f64
                        / (stat.nr_periods - old.nr_periods) as f64
                }
                _ => 0.0,
            },
            _ => 0.0,
        };
        let cfg = &self.monitor.config;
        // Throttling is already a 300 ms average; run-queue delay must persist for three
        // samples, so a scheduling hiccup does not move anything.
        s.runq_high = if runq / self.monitor.cores > cfg.runq_delay_max {
            s.runq_high + 1
        } else {
            0
        };
        let mut r = self.monitor.latest.lock();
        r.cpu_throttled = throttled;
        r.runq_delay = runq;
        r.cpu_pressure = throttled > cfg.cpu_throttled_max || s.runq_high >= 3;
    }

    /// Re-measure footprints of proclets mutated since their last measurement (each at
    /// most every `footprint::ESTIMATE_EVERY`).
    fn refresh_footprints(&self) {
        let now = self.monitor.now_ns();
        let every = crate::footprint::ESTIMATE_EVERY.as_nanos() as u64;
        let slots: Vec<Arc<Slot>> = self
            .hosting
            .slots()
            .into_iter()
            .filter(|s| {
                s.stats.dirty.load(Ordering::Relaxed)
                    && now.saturating_sub(s.stats.measured_at.load(Ordering::Relaxed)) >= every
            })
            .collect();
        for slot in slots {
            self.monitor.measure_now(&slot);
        }
    }

    /// The monitor loop (runs on the control runtime until the node stops).
    pub(crate) async fn monitor_loop(self: Arc<Self>) {
        let mut cg = CgroupFiles {
            reader: granule_host::Reader::for_self(),
            cpu_history: Recent::new(THROTTLE_WINDOW),
        };
        let mut cpu = CpuSampler::default();
        let mut growth = Growth::default();
        let cfg = self.monitor.config.clone();
        let mut tick = tokio::time::interval(cfg.mem_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_cpu = Instant::now();
        let mut next_refresh = Instant::now();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.monitor.moved.notified() => {}
            }
            if self.is_stopped() {
                return;
            }
            let reading = self.monitor.sample_memory(&mut cg, &mut growth, &self);
            let now = Instant::now();
            if now >= next_cpu {
                next_cpu = now + cfg.cpu_interval;
                self.sample_cpu(&mut cpu, &mut cg);
            }
            if now >= next_refresh {
                next_refresh = now + cfg.cpu_interval;
                self.refresh_footprints();
            }
            let pressured = reading.mem_pressure || self.monitor.latest.lock().cpu_pressure;
            if cfg.shed && pressured && !self.monitor.shedding.swap(true, Ordering::AcqRel) {
                let node = self.clone();
                // On the control runtime, like this loop: a worker may be busy in the
                // very closure the move must ask to yield. One move at a time.
                tokio::spawn(async move {
                    let moved_memory = node.shed_one().await;
                    node.monitor.shedding.store(false, Ordering::Release);
                    if moved_memory {
                        // Memory readings show a move at once: sample again now, up to a
                        // tick (5 ms) sooner, and move the next proclet if the pressure is
                        // still there (moves of a few MiB take about as long as a tick).
                        node.monitor.moved.notify_one();
                    }
                });
            }
        }
    }

    /// Make one move the policy asks for, if any; true when it moved a proclet away for
    /// memory.
    async fn shed_one(self: &Arc<Self>) -> bool {
        let view = LiveView { node: self };
        let t0 = Instant::now();
        let Some(d) = self.monitor.policy.decide(&view) else {
            return false;
        };
        let dest = match self.controller.propose(self.id, d.resource, d.amount).await {
            Ok(Some(dest)) => dest,
            Ok(None) => {
                tracing::warn!(node = %self.id, resource = %d.resource, amount = d.amount,
                    "under pressure, but no node has room for proclet {}", d.proclet);
                // Do not spin asking: wait a little before the next attempt.
                tokio::time::sleep(Duration::from_millis(100)).await;
                return false;
            }
            Err(e) => {
                tracing::warn!(node = %self.id, "cannot ask the controller for a destination: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                return false;
            }
        };
        let proposed = t0.elapsed();
        let to = Location {
            node: dest.0,
            addr: dest.1,
            epoch: 0,
        };
        match self
            .move_out_on_workers(d.proclet, to, Some(self.migration.config.duty))
            .await
        {
            Ok(stats) => {
                tracing::info!(node = %self.id, proclet = %d.proclet, to = %dest.0,
                    resource = %d.resource, bytes = stats.bytes, micros = stats.micros,
                    decide_micros = proposed.as_micros() as u64, "shed a proclet");
                if d.resource == Resource::Cpu {
                    // CPU readings are averages over a window: give them time to show the
                    // move before deciding the next one.
                    tokio::time::sleep(CPU_SETTLE).await;
                } else {
                    return true;
                }
            }
            Err(e) => {
                tracing::info!(node = %self.id, proclet = %d.proclet, "shedding move failed: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        false
    }
}

/// The policy's view of a live node.
struct LiveView<'a> {
    node: &'a Arc<NodeInner>,
}

impl NodeView for LiveView<'_> {
    fn pressure(&self) -> Option<Resource> {
        let r = self.node.monitor.latest.lock();
        if r.mem_pressure {
            Some(Resource::Memory)
        } else if r.cpu_pressure {
            Some(Resource::Cpu)
        } else {
            None
        }
    }

    fn candidates(&self) -> Vec<Candidate> {
        self.node
            .hosting
            .slots()
            .into_iter()
            .filter(|s| !s.pinned.load(Ordering::Relaxed) && !s.moving.load(Ordering::Relaxed))
            // Placed by their creator (batch workers): not the policy's to move.
            .filter(|s| s.state_desc.state_ops().is_none_or(|o| !o.owner_placed()))
            .map(|s| Candidate {
                id: s.id,
                kind: s.kind(),
                mem_bytes: s.stats.footprint.load(Ordering::Relaxed),
                cores: s.stats.cores(),
            })
            // Backup copies kept here weigh on its memory too (their primary moves them).
            .chain(
                self.node
                    .replication
                    .backup_sizes()
                    .into_iter()
                    .map(|(id, bytes)| Candidate {
                        id,
                        kind: Kind::Memory,
                        mem_bytes: bytes,
                        cores: 0.0,
                    }),
            )
            .collect()
    }

    fn migration_time(&self, bytes: u64) -> Duration {
        self.node.monitor.migration_time(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_is_measured_over_the_window() {
        let mut g = Growth::default();
        let t0 = Instant::now();
        assert_eq!(g.observe(t0, 100 << 20), 0.0);
        // +10 MiB in 10 ms: 1000 MiB/s.
        let r = g.observe(t0 + Duration::from_millis(10), 110 << 20);
        assert!((r - 1000.0 * (1 << 20) as f64).abs() < 1e3, "{r}");
        // Shrinking is no growth.
        assert_eq!(g.observe(t0 + Duration::from_millis(20), 50 << 20), 0.0);
        // Old samples leave the window.
        let r = g.observe(t0 + Duration::from_millis(200), 50 << 20);
        assert_eq!(r, 0.0);
    }

    #[test]
    fn the_predictive_rule_ends_only_with_a_margin() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut g = Growth::default();
        // 100 free against a need of 120: holds once debounced.
        assert!(!g.predict(at(0), 100, 120));
        assert!(g.predict(at(25), 100, 120));
        // The need dips to 80 (free would last 1.25 horizons): still shedding.
        assert!(g.predict(at(30), 100, 80));
        assert!(g.predict(at(60), 100, 80));
        // Below 2/3 of free (free lasts over 1.5 horizons): ends, once debounced.
        assert!(g.predict(at(70), 100, 60));
        assert!(!g.predict(at(95), 100, 60));
        // And starts again only when the need exceeds free.
        assert!(!g.predict(at(100), 100, 90));
        assert!(!g.predict(at(130), 100, 90));
    }

    #[test]
    fn the_predictive_rule_is_debounced_both_ways() {
        let mut g = Growth::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // A burst shorter than the debounce is not believed...
        assert!(!g.debounce(at(0), true));
        assert!(!g.debounce(at(10), true));
        assert!(!g.debounce(at(15), false));
        // ...sustained growth is, once it has held for the debounce.
        assert!(!g.debounce(at(20), true));
        assert!(!g.debounce(at(35), true));
        assert!(g.debounce(at(40), true));
        // One quiet sample (a move's freed memory) does not end it; a quiet spell does.
        assert!(g.debounce(at(45), false));
        assert!(g.debounce(at(50), true));
        assert!(g.debounce(at(55), false));
        assert!(g.debounce(at(70), false));
        assert!(!g.debounce(at(75), false));
    }

    #[test]
    fn thresholds_are_sized_by_the_limit() {
        let c = Pressure::default();
        assert_eq!(c.free_min_for(100 << 20), 32 << 20);
        assert_eq!(c.free_min_for(1 << 30), (1 << 30) / 10);
        assert_eq!(c.free_min_for(16 << 30), 256 << 20);
    }
}
