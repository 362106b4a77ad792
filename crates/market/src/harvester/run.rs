//! The control loop, on its own thread: every quarter second it reads the refault rate
//! (a burst lifts the limit at once); every cooling period it closes an epoch, asks the
//! policy, checks headroom before lowering, applies the decision, prefetches when told,
//! and publishes the status.

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
        })
    }

    /// Run until told to stop; hands the group back for the caller to restore.
    pub(crate) fn run(mut self) -> ForeignGroup {
        let mut vm_prev = refaults(&self.group).unwrap_or(0);
        let mut tick_at = Instant::now();
        let mut epoch_vm = vm_prev;
        let mut epoch_at = tick_at;
        let mut psi_epoch: Option<Reading> = self.psi.as_mut().and_then(|r| r.read().ok());
        while !self.stop.load(Ordering::Relaxed) {
            std::thread::sleep(TICK);
            let now = Instant::now();
            let vm = refaults(&self.group).unwrap_or(vm_prev);
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
        let state = match decision {
            Decision::Lower(n) => {
                if self.lower(n) {
                    "probing"
                } else {
                    "holding"
                }
            }
            Decision::Hold => "holding",
            Decision::Raise(n) => {
                self.raise(n);
                self.status.recoveries += 1;
                "recovering"
            }
            Decision::RaisePrefetch(n) => {
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

    fn burst(&mut self, rate: f64) {
        let give = self
            .cfg
            .chunk
            .saturating_mul(4)
            .max(self.harvested_limit() / 2);
        self.raise(give);
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

    /// Read the workload's swapped memory back (see `granule_host::os::prefetch_ranges`).
    fn prefetch(&mut self) {
        let pids = self.group.pids().unwrap_or_default();
        for pid in pids {
            let ranges = match granule_host::workload::swapped_ranges(pid) {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!("harvester: swapped ranges of {pid}: {e}");
                    continue;
                }
            };
            if ranges.is_empty() {
                continue;
            }
            if let Err(e) = granule_host::workload::prefetch(pid, &ranges) {
                tracing::warn!("harvester: prefetch of {pid}: {e}");
            }
        }
        self.status.prefetches += 1;
    }

    fn publish(&mut self) {
        let s = &mut self.status;
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
