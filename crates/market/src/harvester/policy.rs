//! The baseline policy (Memtrade's), free of I/O: a baseline of the workload's performance
//! from periods without swap-in, kept in an ordered structure whose samples expire after
//! a window; every epoch the recent p99 is compared with the baseline's p99 and the
//! policy answers lower, hold, raise or raise-and-prefetch.
//!
//! Performance is "lower is better" (a latency, or the refault rate when the application
//! reports nothing). A *drop* is the recent p99 worse than the baseline's p99 by more than
//! the threshold (and above `floor`, which keeps a zero baseline — a swap-free refault
//! rate — from calling every refault a drop); a *severe drop* is the recent p99 worse than
//! every baseline sample for `severe_epochs` epochs in a row.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// What one epoch (or the PSI policy's step) decides.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    /// Lower the limit by this many bytes.
    Lower(u64),
    /// Leave it.
    Hold,
    /// Give this many bytes back.
    Raise(u64),
    /// Give this many bytes back and read the workload's swapped memory back in.
    RaisePrefetch(u64),
}

impl Decision {
    /// The state name a status reports for it.
    pub fn state(self) -> &'static str {
        match self {
            Decision::Lower(_) => "probing",
            Decision::Hold => "holding",
            Decision::Raise(_) => "recovering",
            Decision::RaisePrefetch(_) => "prefetching",
        }
    }
}

/// Performance samples from swap-free periods, ordered by value, expiring after a window.
#[derive(Debug)]
pub struct Baseline {
    window: Duration,
    /// (value's order key, sequence number) → nothing: an ordered multiset of values.
    ordered: BTreeMap<(u64, u64), ()>,
    /// Insertion order, for expiry: (time, key).
    by_time: VecDeque<(Duration, (u64, u64))>,
    seq: u64,
}

/// An order-preserving key of a non-negative, finite f64 (negative and NaN clamp to 0).
fn key(v: f64) -> u64 {
    if v.is_nan() || v <= 0.0 {
        0
    } else {
        v.to_bits()
    }
}

impl Baseline {
    pub fn new(window: Duration) -> Baseline {
        Baseline {
            window,
            ordered: BTreeMap::new(),
            by_time: VecDeque::new(),
            seq: 0,
        }
    }

    /// Add a sample taken at `at` (times only grow).
    pub fn insert(&mut self, at: Duration, value: f64) {
        let k = (key(value), self.seq);
        self.seq += 1;
        self.ordered.insert(k, ());
        self.by_time.push_back((at, k));
    }

    /// Drop the samples older than the window as of `now`.
    pub fn expire(&mut self, now: Duration) {
        while let Some(&(at, k)) = self.by_time.front() {
            if now.saturating_sub(at) <= self.window {
                break;
            }
            self.by_time.pop_front();
            self.ordered.remove(&k);
        }
    }

    pub fn len(&self) -> usize {
        self.ordered.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ordered.is_empty()
    }

    /// The `q` quantile (0..=1) of the samples (nearest rank).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let n = self.ordered.len();
        if n == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n);
        self.ordered
            .keys()
            .nth(rank - 1)
            .map(|(k, _)| f64::from_bits(*k))
    }

    pub fn p99(&self) -> Option<f64> {
        self.quantile(0.99)
    }

    /// The worst sample.
    pub fn max(&self) -> Option<f64> {
        self.ordered
            .keys()
            .next_back()
            .map(|(k, _)| f64::from_bits(*k))
    }
}

/// One epoch's observation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Epoch {
    /// When it ended (since the harvester started).
    pub at: Duration,
    /// The workload's p99 over the epoch (`None`: no samples).
    pub p99: Option<f64>,
    /// Whether anything was swapped in during the epoch.
    pub swapin: bool,
}

/// The baseline policy's parameters and state.
#[derive(Debug)]
pub struct BaselinePolicy {
    pub baseline: Baseline,
    pub threshold: f64,
    pub severe_epochs: u32,
    pub chunk: u64,
    /// A recent p99 at or below this is never a drop.
    pub floor: f64,
    severe_run: u32,
}

impl BaselinePolicy {
    pub fn new(
        window: Duration,
        threshold: f64,
        severe_epochs: u32,
        chunk: u64,
        floor: f64,
    ) -> Self {
        BaselinePolicy {
            baseline: Baseline::new(window),
            threshold,
            severe_epochs: severe_epochs.max(1),
            chunk,
            floor,
            severe_run: 0,
        }
    }

    /// Decide after epoch `e`.
    pub fn step(&mut self, e: Epoch) -> Decision {
        self.baseline.expire(e.at);
        let Some(recent) = e.p99 else {
            return Decision::Hold;
        };
        if !e.swapin {
            self.baseline.insert(e.at, recent);
        }
        let (Some(p99), Some(max)) = (self.baseline.p99(), self.baseline.max()) else {
            // No swap-free reference in the window: nothing to compare with.
            self.severe_run = 0;
            return Decision::Hold;
        };
        let above_floor = recent > self.floor;
        if above_floor && recent > max {
            self.severe_run += 1;
        } else {
            self.severe_run = 0;
        }
        if self.severe_run >= self.severe_epochs {
            self.severe_run = 0;
            return Decision::RaisePrefetch(self.chunk.saturating_mul(2));
        }
        if above_floor && recent > p99 * (1.0 + self.threshold) {
            return Decision::Raise(self.chunk);
        }
        Decision::Lower(self.chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn baseline_samples_expire_after_the_window() {
        let mut b = Baseline::new(s(10));
        b.insert(s(0), 5.0);
        b.insert(s(4), 1.0);
        b.insert(s(8), 3.0);
        assert_eq!(b.max(), Some(5.0));
        b.expire(s(10));
        assert_eq!(b.len(), 3, "exactly the window old stays");
        b.expire(s(11));
        assert_eq!(b.len(), 2);
        assert_eq!(b.max(), Some(3.0));
        b.expire(s(19));
        assert_eq!(b.max(), None);
        assert!(b.is_empty());
    }

    #[test]
    fn quantiles_are_ordered_by_value_with_duplicates() {
        let mut b = Baseline::new(s(100));
        for (i, v) in [3.0, 1.0, 2.0, 2.0, 100.0].iter().enumerate() {
            b.insert(s(i as u64), *v);
        }
        assert_eq!(b.quantile(0.0), Some(1.0));
        assert_eq!(b.quantile(0.5), Some(2.0));
        assert_eq!(b.quantile(0.8), Some(3.0));
        assert_eq!(b.p99(), Some(100.0));
    }

    fn epoch(at: u64, p99: f64, swapin: bool) -> Epoch {
        Epoch {
            at: s(at),
            p99: Some(p99),
            swapin,
        }
    }

    #[test]
    fn probes_down_while_performance_holds_and_recovers_on_a_drop() {
        let mut p = BaselinePolicy::new(s(60), 0.01, 3, 64, 0.0);
        // Swap-free epochs build the baseline; each one lets the policy lower.
        for t in 0..100 {
            assert_eq!(
                p.step(epoch(t, 100.0 + (t % 3) as f64, false)),
                Decision::Lower(64)
            );
        }
        // Swapping, within 1 % of the baseline's p99 (102) and under its max: keep lowering.
        assert_eq!(p.step(epoch(100, 101.5, true)), Decision::Lower(64));
        // Worse by more than 1 %: a drop, give a chunk back.
        assert_eq!(p.step(epoch(101, 103.1, true)), Decision::Raise(64));
        // Worse than every sample (max 102) for 3 epochs: severe, prefetch.
        // (103.1 at 101 already counted as the first.)
        assert_eq!(p.step(epoch(102, 110.0, true)), Decision::Raise(64));
        assert_eq!(
            p.step(epoch(103, 110.0, true)),
            Decision::RaisePrefetch(128)
        );
        // The count starts again after a prefetch, and a good epoch resets it.
        assert_eq!(p.step(epoch(104, 110.0, true)), Decision::Raise(64));
        assert_eq!(p.step(epoch(105, 100.0, true)), Decision::Lower(64));
        assert_eq!(p.step(epoch(106, 110.0, true)), Decision::Raise(64));
        assert_eq!(p.step(epoch(107, 110.0, true)), Decision::Raise(64));
        assert_eq!(
            p.step(epoch(108, 110.0, true)),
            Decision::RaisePrefetch(128)
        );
    }

    #[test]
    fn swapping_epochs_do_not_enter_the_baseline_and_it_can_run_out() {
        let mut p = BaselinePolicy::new(s(10), 0.01, 3, 1, 0.0);
        assert_eq!(p.step(epoch(0, 10.0, false)), Decision::Lower(1));
        // A slow epoch with swap-in is not a baseline sample: it stays a drop.
        assert_eq!(p.step(epoch(1, 20.0, true)), Decision::Raise(1));
        assert_eq!(p.baseline.len(), 1);
        // Once the only sample expired there is no reference: hold.
        assert_eq!(p.step(epoch(20, 10.0, true)), Decision::Hold);
        // No samples at all: hold.
        let none = Epoch {
            at: s(21),
            p99: None,
            swapin: false,
        };
        assert_eq!(p.step(none), Decision::Hold);
    }

    #[test]
    fn the_floor_keeps_a_zero_baseline_from_calling_every_refault_a_drop() {
        // The refault rate as the signal: swap-free epochs have rate 0.
        let mut p = BaselinePolicy::new(s(60), 0.01, 3, 8, 100.0);
        assert_eq!(p.step(epoch(0, 0.0, false)), Decision::Lower(8));
        assert_eq!(p.step(epoch(1, 50.0, true)), Decision::Lower(8));
        assert_eq!(p.step(epoch(2, 500.0, true)), Decision::Raise(8));
    }
}
