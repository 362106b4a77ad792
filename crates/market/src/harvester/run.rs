//! The control loop, on its own thread: every quarter second it reads the refault rate
//! (a burst lifts the limit at once); every cooling period it closes an epoch, asks the
//! policy, checks headroom before lowering, applies the decision, prefetches when told,
//! and publishes the status.
//!
//! Prefetch reads back the workload's *most recently* swapped-out pages (largest swap
//! slots first: see [`granule_host::workload::SwappedPage`]), at most what fits under
//! the limit just raised (less half a chunk of slack) and in the machine's available
//! memory (less the headroom): prefetching more than fits would only be reclaimed again,
//! or, with the reads still in flight, leave the kernel nothing it can reclaim. The pages
//! it advises are counted as the harvester's own refaults and left out of the
//! workload's refault rate for a moment, so that a prefetch is not taken for a burst.
//!
//! After a drop, the limit it happened at is remembered for one baseline window: the
//! harvester does not probe below a chunk above it again until the window has passed
//! (each probe past the workload's working set costs it a burst of refaults; once is
//! enough to find the edge). A burst gives the whole harvest back at once and holds
//! harvesting for a baseline window: the load changed, and its new working set is
//! unknown.
//!
//! zswap writing its pool back to the swap file (when the pool is full) reads each entry
//! into the swap cache, and the kernel counts that as a refault of the page's group
//! (measured here: one `workingset_refault_anon` per `zswpwb`). The machine's
//! writebacks (`/proc/vmstat` `zswpwb`; cgroup v1 has no per-group count) are therefore
//! subtracted from the group's refaults too. On a machine where other groups' pages are
//! written back as well this undercounts the workload's refaults, never overcounts.

use super::guard::{Floor, RefaultFilter};
use super::metric::Metric;
use super::policy::{BaselinePolicy, Decision, Epoch};
use super::psi::PsiPolicy;
use super::{HarvestError, HarvestStatus};
use granule_config::{HarvestPolicy, Market};
use granule_host::psi::{PressureReader, Reading, Resource};
use granule_host::{CgroupError, ForeignGroup, Limit};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TICK: Duration = Duration::from_millis(250);
/// How long the pages a prefetch advised are left out of the refault rate.
const PREFETCH_CREDIT_FOR: Duration = Duration::from_secs(2);

enum Policy {
    Baseline(BaselinePolicy),
    Psi(PsiPolicy),
}

pub(crate) struct Loop {
    cfg: Market,
    group: ForeignGroup,
    metric: Metric,
    policy: Policy,
    tx: tokio::sync::watch::Sender<HarvestStatus>,
    stop: Arc<AtomicBool>,
    psi: Option<PressureReader>,
    /// What harvesting is measured from: the found limit, or the usage at start when that
    /// is lower (a limit far above the usage frees nothing by coming down to it).
    reference: u64,
    zswap_at_start: u64,
    oom_at_start: u64,
    started: Instant,
    status: HarvestStatus,
    /// The workload's refaults apart from the prefetch's and zswap writeback's.
    refaults: RefaultFilter,
    /// No lowering below this limit until then (set by a drop: see the module doc).
    floor: Option<Floor>,
}

/// The workload group's anonymous refaults so far (`workingset_refault_anon` of its
/// `memory.stat`: every page faulted back from swap or zswap after reclaim pushed it out).
fn refaults(g: &ForeignGroup) -> Option<u64> {
    g.memory_stat().ok().map(|s| s.workingset_refault_anon)
}

impl Loop {
    pub(crate) fn new(
        cfg: Market,
        group: ForeignGroup,
        metric: Metric,
        tx: tokio::sync::watch::Sender<HarvestStatus>,
        stop: Arc<AtomicBool>,
    ) -> Result<Loop, HarvestError> {
        let usage = group.usage()?;
        let found = group.found_limit();
        let reference = found.bytes().map_or(usage, |l| l.min(usage));
        // With the refault rate as the signal, swap-free epochs read 0: only a rate
        // above the tolerance is a drop.
        let floor = if matches!(metric, Metric::SwapIn) {
            cfg.swapin_tolerance
        } else {
            0.0
        };
        let policy = match cfg.policy {
            HarvestPolicy::Baseline => Policy::Baseline(BaselinePolicy::new(
                cfg.baseline_window,
                cfg.slowdown_threshold,
                cfg.severe_epochs,
                cfg.chunk,
                floor,
            )),
            HarvestPolicy::Psi => Policy::Psi(PsiPolicy::new(cfg.psi_target, cfg.chunk)),
        };
        let psi = PressureReader::system(Resource::Memory).ok();
        let status = HarvestStatus {
            limit_bytes: group.limit()?.bytes().unwrap_or(u64::MAX),
            original_limit_bytes: found.bytes().unwrap_or(u64::MAX),
            usage_bytes: usage,
            policy: cfg.policy.name().to_string(),
            state: "probing".into(),
            ..HarvestStatus::default()
        };
        let zswap_at_start = granule_host::mem::meminfo().map(|m| m.zswap).unwrap_or(0);
        let oom_at_start = group.oom_kills().unwrap_or(0);
        let _ = tx.send(status.clone());
        Ok(Loop {
            cfg,
            group,
            metric,
            policy,
            tx,
            stop,
            psi,
            reference,
            zswap_at_start,
            oom_at_start,
            started: Instant::now(),
            status,
            refaults: RefaultFilter::new(granule_host::mem::vmstat().ok().map(|v| v.zswpwb)),
            floor: None,
        })
    }

    /// The group's refault counter less the refaults the harvester's prefetch and
    /// zswap's writeback caused (see the module doc).
    fn workload_refaults(&mut self, prev: u64) -> u64 {
        let Some(raw) = refaults(&self.group) else {
            return prev;
        };
        let wb = granule_host::mem::vmstat().ok().map(|v| v.zswpwb);
        self.refaults.update(raw, wb, prev, Instant::now())
    }

    /// Run until told to stop; hands the group back for the caller to restore.
    pub(crate) fn run(mut self) -> ForeignGroup {
        // Start the workload's pages' recency afresh: pages keep the referenced bit from
        // whenever they were first touched until reclaim looks at them, so the first
        // lowering would otherwise see every page as recently used and evict by list
        // order, hot pages among them. Cleared now, the first step (a cooling period
        // from now) tells the pages used since from the ones that were not.
        for pid in self.group.pids().unwrap_or_default() {
            if let Err(e) = granule_host::workload::clear_referenced(pid) {
                tracing::debug!("harvester: clearing the referenced bits of {pid}: {e}");
            }
        }
        let mut vm_prev = refaults(&self.group).unwrap_or(0);
        let mut tick_at = Instant::now();
        let mut epoch_vm = vm_prev;
        let mut epoch_at = tick_at;
        let mut psi_epoch: Option<Reading> = self.psi.as_mut().and_then(|r| r.read().ok());
        while !self.stop.load(Ordering::Relaxed) {
            std::thread::sleep(TICK);
            let now = Instant::now();
            let vm = self.workload_refaults(vm_prev);
            let dt = now.duration_since(tick_at).as_secs_f64().max(1e-3);
            let rate = vm.saturating_sub(vm_prev) as f64 / dt;
            vm_prev = vm;
            tick_at = now;
            if rate > self.cfg.burst_swapin && self.harvested_limit() > 0 {
                self.burst(rate);
                // The burst starts a new epoch: its effect shows before the next decision.
                epoch_vm = vm;
                epoch_at = now;
                psi_epoch = self.psi.as_mut().and_then(|r| r.read().ok());
                continue;
            }
            if now.duration_since(epoch_at) < self.cfg.cooling_period {
                continue;
            }
            let edt = now.duration_since(epoch_at).as_secs_f64().max(1e-3);
            let epoch_rate = vm.saturating_sub(epoch_vm) as f64 / edt;
            let psi_now = self.psi.as_mut().and_then(|r| r.read().ok());
            let stall = match (&psi_epoch, &psi_now) {
                (Some(a), Some(b)) => granule_host::psi::stall_rate(a, b).some,
                _ => 0.0,
            };
            psi_epoch = psi_now;
            epoch_vm = vm;
            epoch_at = now;
            self.epoch(epoch_rate, stall);
        }
        self.status.state = "stopped".into();
        let _ = self.tx.send(self.status.clone());
        self.group
    }

    /// How far the limit is below the reference now.
    fn harvested_limit(&self) -> u64 {
        match self.group.limit() {
            Ok(Limit::Bytes(b)) => self.reference.saturating_sub(b),
            _ => 0,
        }
    }

    fn epoch(&mut self, rate: f64, stall: f64) {
        // Until the limit is lowered below it, the reference follows the workload's usage:
        // a workload the producer has just started has not grown to its size yet when the
        // harvester begins, and a reference taken then would leave nothing to harvest.
        let lowered = matches!(self.group.limit(), Ok(Limit::Bytes(b)) if b < self.reference);
        if !lowered {
            if let Ok(usage) = self.group.usage() {
                self.reference = self
                    .group
                    .found_limit()
                    .bytes()
                    .map_or(usage, |l| l.min(usage));
            }
        }
        let value = self.metric.epoch_value(rate);
        self.status.swapin_per_s = rate;
        self.status.stall_per_s = stall;
        self.status.p99_recent = value;
        let decision = match &mut self.policy {
            Policy::Baseline(p) => {
                let d = p.step(Epoch {
                    at: self.started.elapsed(),
                    p99: value,
                    swapin: rate >= 1.0,
                });
                self.status.p99_baseline = p.baseline.p99();
                d
            }
            Policy::Psi(p) => p.step(stall),
        };
        // Before the observation is over, nothing is lowered (the referenced bits are
        // still gathering); drops still give back (there is nothing to give yet).
        let observing = self.started.elapsed() < self.cfg.observe;
        let state = match decision {
            Decision::Lower(_) if observing => "observing",
            Decision::Lower(n) => {
                if self.lower(n) {
                    "probing"
                } else {
                    "holding"
                }
            }
            Decision::Hold => "holding",
            Decision::Raise(n) => {
                self.remember_drop();
                self.raise(n);
                self.status.recoveries += 1;
                "recovering"
            }
            Decision::RaisePrefetch(n) => {
                self.remember_drop();
                self.raise(n);
                self.status.recoveries += 1;
                if self.cfg.prefetch {
                    self.prefetch();
                    "prefetching"
                } else {
                    "recovering"
                }
            }
        };
        self.status.steps += 1;
        self.status.state = state.into();
        self.publish();
    }

    /// A drop at the current limit: keep a chunk above it for a baseline window.
    fn remember_drop(&mut self) {
        if let Ok(Limit::Bytes(l)) = self.group.limit() {
            let now = Instant::now();
            self.floor = Some(Floor::after_drop(
                self.floor,
                l,
                self.cfg.chunk,
                now + self.cfg.baseline_window,
                now,
            ));
        }
    }

    /// Lower by `n` if there is headroom: free swap for what the step may push out, plus
    /// `market.headroom`. Returns whether the limit went down.
    fn lower(&mut self, n: u64) -> bool {
        let Ok(mi) = granule_host::mem::meminfo() else {
            return false;
        };
        if mi.swap_free < n.saturating_add(self.cfg.headroom) {
            return false;
        }
        let (Ok(limit), Ok(usage)) = (self.group.limit(), self.group.usage()) else {
            return false;
        };
        // From the usage when the limit is above it: that stretch frees nothing.
        let base = limit
            .bytes()
            .map_or(usage, |l| l.min(usage))
            .min(self.reference);
        let new = base.saturating_sub(n);
        // Never below one headroom: the workload must keep room to run.
        if new < self.cfg.headroom.max(self.cfg.chunk) {
            return false;
        }
        let (new, expired) = Floor::apply(self.floor, base, new, Instant::now());
        if expired {
            self.floor = None;
        }
        let Some(new) = new else {
            return false;
        };
        match self.group.set_limit(Limit::Bytes(new)) {
            Ok(_) => true,
            Err(CgroupError::LimitRefused { .. }) => false,
            Err(e) => {
                tracing::warn!("harvester: cannot lower the limit: {e}");
                false
            }
        }
    }

    /// Give `n` back; at or above the reference the found limit comes back whole.
    fn raise(&mut self, n: u64) {
        let Ok(limit) = self.group.limit() else {
            return;
        };
        let Some(cur) = limit.bytes() else {
            return;
        };
        let new = cur.saturating_add(n);
        let target = if new >= self.reference {
            self.group.found_limit()
        } else {
            Limit::Bytes(new)
        };
        if let Err(e) = self.group.set_limit(target) {
            tracing::warn!("harvester: cannot raise the limit: {e}");
        }
    }

    /// A burst: the whole harvest back at once (the found limit), prefetch, and no
    /// lowering for a baseline window (the load changed; its new working set is unknown).
    fn burst(&mut self, rate: f64) {
        let found = self.group.found_limit();
        if let Err(e) = self.group.set_limit(found) {
            tracing::warn!("harvester: cannot lift the limit: {e}");
        }
        self.floor = Some(Floor {
            limit: u64::MAX,
            until: Instant::now() + self.cfg.baseline_window,
        });
        self.status.recoveries += 1;
        self.status.swapin_per_s = rate;
        self.status.state = if self.cfg.prefetch {
            self.prefetch();
            "prefetching".into()
        } else {
            "recovering".into()
        };
        self.publish();
    }

    /// How much a prefetch may read back now (see the module doc).
    fn prefetch_budget(&self) -> u64 {
        let under_limit = match (self.group.limit(), self.group.usage()) {
            (Ok(Limit::Bytes(l)), Ok(u)) => l.saturating_sub(u).saturating_sub(self.cfg.chunk / 2),
            (Ok(Limit::Unlimited), Ok(_)) => u64::MAX,
            _ => 0,
        };
        let machine = granule_host::mem::meminfo()
            .map(|m| m.available.saturating_sub(self.cfg.headroom))
            .unwrap_or(0);
        under_limit.min(machine)
    }

    /// Read back the workload's most recently swapped-out pages, within the budget.
    fn prefetch(&mut self) {
        let budget = self.prefetch_budget();
        let page = granule_host::proc::page_size().max(1);
        let mut pages: Vec<(u64, u32, u64)> = Vec::new(); // (slot, pid, addr)
        for pid in self.group.pids().unwrap_or_default() {
            let found = granule_host::workload::swapped_ranges(pid)
                .and_then(|r| granule_host::workload::swapped_pages(pid, &r));
            match found {
                Ok(p) => pages.extend(p.into_iter().map(|p| (p.slot, pid, p.addr))),
                Err(e) => tracing::debug!("harvester: swapped pages of {pid}: {e}"),
            }
        }
        // Most recently swapped out first.
        pages.sort_unstable_by_key(|p| std::cmp::Reverse(p.0));
        pages.truncate(usize::try_from(budget / page).unwrap_or(usize::MAX));
        let mut by_pid: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
        for (_, pid, addr) in pages {
            by_pid.entry(pid).or_default().push(addr);
        }
        let mut advised = 0u64;
        for (pid, addrs) in by_pid {
            let ranges = granule_host::workload::coalesce_pages(addrs, page);
            match granule_host::workload::prefetch_exact(pid, &ranges) {
                Ok(n) => advised += n,
                Err(e) => tracing::warn!("harvester: prefetch of {pid}: {e}"),
            }
        }
        self.refaults
            .prefetched(advised / page, Instant::now() + PREFETCH_CREDIT_FOR);
        self.status.prefetches += 1;
        self.status.prefetched_bytes += advised;
    }

    fn publish(&mut self) {
        let s = &mut self.status;
        s.cpu_seconds = granule_host::proc::thread_cpu_time().as_secs_f64();
        let limit = self.group.limit().ok();
        s.limit_bytes = limit.and_then(|l| l.bytes()).unwrap_or(u64::MAX);
        s.usage_bytes = self.group.usage().unwrap_or(s.usage_bytes);
        let zswap = granule_host::mem::meminfo().map(|m| m.zswap).unwrap_or(0);
        s.zswap_pool_bytes = zswap;
        let reduction = match limit.and_then(|l| l.bytes()) {
            Some(b) => self.reference.saturating_sub(b),
            None => 0,
        };
        s.harvested_bytes = reduction.saturating_sub(zswap.saturating_sub(self.zswap_at_start));
        s.oom_kills = self
            .group
            .oom_kills()
            .unwrap_or(0)
            .saturating_sub(self.oom_at_start);
        let _ = self.tx.send(s.clone());
    }
}
