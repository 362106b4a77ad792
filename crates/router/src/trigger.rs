//! When a range splits and when neighbours merge: the [`Trigger`] trait and its two
//! implementations, [`Bounds`] (bytes held: sharded structures) and [`CpuLoad`] (CPU
//! used: services).
//!
//! A trigger is asked in one of two ways:
//! - **per event**, by whoever just changed a range (a shard after a write):
//!   [`Trigger::should_split`] and [`Trigger::should_merge`] on that range's load, and
//!   [`Trigger::may_merge`] on a pair, checked again where the pair is locked;
//! - **per reading**, by a scaler that measures every range each window:
//!   [`Trigger::decide`] proposes at most one action for the whole table, and
//!   [`Trigger::done`] tells the trigger what was carried out (a trigger with memory, such
//!   as [`CpuLoad`]'s cooldowns and moving averages, keeps it up to date).

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;

/// One range's load in a reading of the whole table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading<L> {
    /// The range's target, by an id that stays the same while the target lives (a
    /// proclet id).
    pub id: u64,
    /// What the trigger measures: bytes held, cores used.
    pub load: L,
}

/// What a trigger proposes, by position in the reading (key order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Split range `i`.
    Split(usize),
    /// Merge range `i + 1` into range `i`.
    Merge(usize),
}

/// A proposal and the load that prompted it (the range's, or the pair's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision<L> {
    pub action: Action,
    pub load: L,
}

/// What was carried out, for triggers that remember.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Done {
    /// Range `old` split; `new` took its upper part.
    Split { old: u64, new: u64 },
    /// Range `right` merged into `left`.
    Merge { left: u64, right: u64 },
}

/// How many ranges a table may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Never merge below this many (at least 1).
    pub min_ranges: usize,
    /// Never split beyond this many.
    pub max_ranges: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            min_ranges: 1,
            max_ranges: usize::MAX,
        }
    }
}

/// Decides when a range splits and when neighbouring ranges merge, from a measure of
/// each range's load.
pub trait Trigger {
    /// What is measured of a range: bytes held (`u64`), cores used (`f64`).
    type Load: Copy + PartialOrd + fmt::Debug;

    /// Whether a range at `load` should split.
    fn should_split(&self, load: Self::Load) -> bool;

    /// Whether a range at `load` should give its keys to a neighbour.
    fn should_merge(&self, load: Self::Load) -> bool;

    /// Whether neighbours at `left` and `right` may become one range.
    fn may_merge(&self, left: Self::Load, right: Self::Load) -> bool;

    /// Given a reading of every range in key order, at most one action. The default
    /// splits the heaviest range that should split, else merges the lightest one that
    /// should merge with its lighter neighbour, if the two may merge.
    fn decide(
        &mut self,
        reading: &[Reading<Self::Load>],
        limits: Limits,
    ) -> Option<Decision<Self::Load>> {
        let n = reading.len();
        let heaviest = (0..n).max_by(|&a, &b| {
            reading[a]
                .load
                .partial_cmp(&reading[b].load)
                .unwrap_or(std::cmp::Ordering::Equal)
        })?;
        let load = reading[heaviest].load;
        if self.should_split(load) && n < limits.max_ranges {
            return Some(Decision {
                action: Action::Split(heaviest),
                load,
            });
        }
        if n <= limits.min_ranges.max(1) {
            return None;
        }
        let lightest = (0..n).min_by(|&a, &b| {
            reading[a]
                .load
                .partial_cmp(&reading[b].load)
                .unwrap_or(std::cmp::Ordering::Equal)
        })?;
        let load = reading[lightest].load;
        if !self.should_merge(load) {
            return None;
        }
        let left_pair = lightest.checked_sub(1);
        let right_pair = (lightest + 1 < n).then_some(lightest);
        let pick = match (left_pair, right_pair) {
            (Some(l), Some(r)) if reading[r + 1].load < reading[l].load => r,
            (Some(l), _) => l,
            (None, Some(r)) => r,
            (None, None) => return None,
        };
        self.may_merge(reading[pick].load, reading[pick + 1].load)
            .then_some(Decision {
                action: Action::Merge(pick),
                load,
            })
    }

    /// An action was carried out (by [`Trigger::decide`]'s proposal or by hand).
    fn done(&mut self, done: Done) {
        let _ = done;
    }
}

// ----- bytes held ----------------------------------------------------------------------

/// Size bounds of the ranges of a sharded structure, in bytes held (a shard's
/// footprint): the bytes-held [`Trigger`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bounds {
    /// A shard under this is merged with a neighbour (when the two fit, see
    /// [`Trigger::may_merge`]).
    pub lower: u64,
    /// A shard over this is split.
    pub upper: u64,
}

/// Bounds that leave no room for a split's halves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad shard bounds: lower {lower} B, upper {upper} B (need 0 < 2 × lower ≤ upper)")]
pub struct BoundsError {
    pub lower: u64,
    pub upper: u64,
}

impl Bounds {
    /// Low-latency mode's default: shards of at most 2 MiB.
    pub const LOW_LATENCY: Bounds = Bounds {
        lower: 512 << 10,
        upper: 2 << 20,
    };
    /// Batching mode's default: shards of at most 32 MiB.
    pub const BATCHING: Bounds = Bounds {
        lower: 8 << 20,
        upper: 32 << 20,
    };

    /// `lower` must be below `upper`, and their ratio leaves room for a split's halves.
    pub fn new(lower: u64, upper: u64) -> Result<Bounds, BoundsError> {
        if upper == 0 || lower.checked_mul(2).is_none_or(|twice| twice > upper) {
            return Err(BoundsError { lower, upper });
        }
        Ok(Bounds { lower, upper })
    }
}

impl Trigger for Bounds {
    type Load = u64;

    fn should_split(&self, bytes: u64) -> bool {
        bytes > self.upper
    }

    fn should_merge(&self, bytes: u64) -> bool {
        bytes < self.lower
    }

    /// Merging two shards that together exceed the upper bound is still right when one
    /// of them is under the lower bound: the result is split in halves, each at least
    /// `upper / 2 ≥ lower` (a rebalance). Beyond `upper + upper / 2` it would not be one.
    fn may_merge(&self, left: u64, right: u64) -> bool {
        left.saturating_add(right) <= self.upper.saturating_add(self.upper / 2)
    }
}

// ----- CPU used ------------------------------------------------------------------------

/// The CPU-used [`Trigger`] of a service's compute proclets, read once per window: a
/// range whose load (cores its handlers used per wall second of the window) exceeds
/// `split_above` is split, busiest first, unless it is cooling down after a split; two
/// neighbours whose summed load, averaged over the last `merge_after` windows, stays under
/// `merge_below` are merged, idlest pair first. One action per window.
#[derive(Clone, Debug)]
pub struct CpuLoad {
    /// Split a range whose load over one window exceeds this many cores.
    pub split_above: f64,
    /// Merge two neighbours whose summed load, averaged, is under this many cores.
    pub merge_below: f64,
    /// Windows a pair is watched (and averaged over) before it may merge.
    pub merge_after: u32,
    /// Windows a range is left alone after a split.
    pub cooldown: u32,
    /// Per range (by id): windows of cooldown left.
    cool: HashMap<u64, u32>,
    /// Per left range of a pair: windows watched, and the pair's summed load averaged
    /// over the last `merge_after` of them.
    low: HashMap<u64, (u32, f64)>,
}

impl CpuLoad {
    /// A trigger with these thresholds, remembering nothing yet.
    pub fn new(split_above: f64, merge_below: f64, merge_after: u32, cooldown: u32) -> CpuLoad {
        CpuLoad {
            split_above,
            merge_below,
            merge_after,
            cooldown,
            cool: HashMap::new(),
            low: HashMap::new(),
        }
    }

    fn cooling(&self, id: u64) -> bool {
        self.cool.get(&id).is_some_and(|c| *c > 0)
    }
}

impl Trigger for CpuLoad {
    type Load = f64;

    fn should_split(&self, cores: f64) -> bool {
        cores > self.split_above
    }

    fn should_merge(&self, cores: f64) -> bool {
        cores < self.merge_below
    }

    fn may_merge(&self, left: f64, right: f64) -> bool {
        left + right < self.merge_below
    }

    fn decide(&mut self, reading: &[Reading<f64>], limits: Limits) -> Option<Decision<f64>> {
        for c in self.cool.values_mut() {
            *c = c.saturating_sub(1);
        }
        // Split the busiest range over the bound that is not cooling down.
        let busiest = reading
            .iter()
            .enumerate()
            .filter(|(_, r)| !self.cooling(r.id))
            .max_by(|a, b| a.1.load.total_cmp(&b.1.load));
        if let Some((i, r)) = busiest {
            if self.should_split(r.load) && reading.len() < limits.max_ranges {
                return Some(Decision {
                    action: Action::Split(i),
                    load: r.load,
                });
            }
        }
        // Merge the idlest pair whose summed load, averaged over the last `merge_after`
        // windows (a moving average: one short window holds a handful of calls), stayed
        // under the bound.
        let span = self.merge_after.max(1);
        let mut best: Option<(usize, f64)> = None;
        for i in 0..reading.len().saturating_sub(1) {
            let (left, right) = (reading[i], reading[i + 1]);
            if self.cooling(left.id) || self.cooling(right.id) {
                self.low.remove(&left.id);
                continue;
            }
            let sum = left.load + right.load;
            let (count, avg) = self.low.entry(left.id).or_insert((0, sum));
            *count += 1;
            *avg += (sum - *avg) / span.min(*count) as f64;
            let avg = *avg;
            if *count >= span && avg < self.merge_below && best.is_none_or(|(_, b)| avg < b) {
                best = Some((i, avg));
            }
        }
        let (i, avg) = best?;
        (reading.len() > limits.min_ranges.max(1)).then_some(Decision {
            action: Action::Merge(i),
            load: avg,
        })
    }

    fn done(&mut self, done: Done) {
        // Any change of the table starts every pair's watch over.
        self.low.clear();
        match done {
            Done::Split { old, new } => {
                self.cool.insert(old, self.cooldown);
                self.cool.insert(new, self.cooldown);
            }
            Done::Merge { right, .. } => {
                self.cool.remove(&right);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading<L: Copy>(loads: &[L]) -> Vec<Reading<L>> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| Reading {
                id: i as u64 + 100,
                load,
            })
            .collect()
    }

    #[test]
    fn bounds_must_leave_room_for_halves() {
        assert!(Bounds::new(1, 2).is_ok());
        assert_eq!(Bounds::new(2, 3), Err(BoundsError { lower: 2, upper: 3 }));
        assert!(Bounds::new(0, 0).is_err());
        assert!(Bounds::new(u64::MAX, u64::MAX).is_err());
        assert!(Bounds::new(Bounds::LOW_LATENCY.lower, Bounds::LOW_LATENCY.upper).is_ok());
        assert!(Bounds::new(Bounds::BATCHING.lower, Bounds::BATCHING.upper).is_ok());
    }

    #[test]
    fn bytes_split_over_upper_merge_under_lower_and_rebalance_up_to_half_again() {
        let b = Bounds::new(100, 400).unwrap();
        assert!(!b.should_split(400) && b.should_split(401));
        assert!(b.should_merge(99) && !b.should_merge(100));
        assert!(b.may_merge(50, 550) && !b.may_merge(50, 551));
        assert!(b.may_merge(0, 0) && !b.may_merge(u64::MAX, 1));
        let huge = Bounds::new(0, u64::MAX).unwrap();
        assert!(huge.may_merge(u64::MAX - 1, 1), "no overflow");
    }

    #[test]
    fn bytes_decide_the_heaviest_split_then_the_lightest_merge() {
        let mut b = Bounds::new(100, 400).unwrap();
        let l = Limits::default();
        let d = b.decide(&reading(&[10, 500, 900, 50]), l).unwrap();
        assert_eq!(d.action, Action::Split(2));
        assert_eq!(d.load, 900);
        // No room to split: merge instead.
        let full = Limits {
            min_ranges: 1,
            max_ranges: 4,
        };
        let d = b.decide(&reading(&[300, 500, 120, 50]), full).unwrap();
        assert_eq!(d.action, Action::Merge(2), "the last shard has only a left");
        // The lightest merges with its lighter neighbour.
        let d = b.decide(&reading(&[300, 20, 200]), l).unwrap();
        assert_eq!(d.action, Action::Merge(1));
        let d = b.decide(&reading(&[20, 300]), l).unwrap();
        assert_eq!(
            d.action,
            Action::Merge(0),
            "the first shard has only a right"
        );
        // Nothing under lower, too big to merge, or at the minimum: nothing.
        assert_eq!(b.decide(&reading(&[300, 200]), l), None);
        let no_split = Limits {
            min_ranges: 1,
            max_ranges: 2,
        };
        assert_eq!(b.decide(&reading(&[50, 600]), no_split), None);
        let two = Limits {
            min_ranges: 2,
            max_ranges: 10,
        };
        assert_eq!(b.decide(&reading(&[20, 30]), two), None);
        assert_eq!(b.decide(&reading::<u64>(&[]), l), None);
    }

    fn cpu() -> CpuLoad {
        CpuLoad::new(1.0, 0.6, 4, 3)
    }

    #[test]
    fn cpu_splits_the_busiest_range_over_the_bound() {
        let mut t = cpu();
        let d = t.decide(&reading(&[0.5, 1.4, 1.2]), Limits::default());
        assert_eq!(
            d,
            Some(Decision {
                action: Action::Split(1),
                load: 1.4
            })
        );
        // At the maximum: no split (and this pair is not idle long enough to merge).
        let max = Limits {
            min_ranges: 1,
            max_ranges: 3,
        };
        assert_eq!(t.decide(&reading(&[0.5, 1.4, 1.2]), max), None);
    }

    #[test]
    fn cpu_leaves_a_split_range_alone_while_it_cools_down() {
        let mut t = cpu();
        let l = Limits::default();
        t.done(Done::Split { old: 100, new: 101 });
        // 100 and 101 cool for 3 windows (counted down at the start of each).
        for _ in 0..2 {
            let d = t.decide(&reading(&[2.0, 2.0, 1.5]), l).unwrap();
            assert_eq!(d.action, Action::Split(2), "only 102 may split");
        }
        let d = t.decide(&reading(&[2.0, 2.5, 1.5]), l).unwrap();
        assert_eq!(d.action, Action::Split(1), "cooled down");
    }

    #[test]
    fn cpu_merges_a_pair_idle_on_average_over_the_span_only() {
        let mut t = cpu();
        let l = Limits::default();
        // Three windows are not enough.
        for _ in 0..3 {
            assert_eq!(t.decide(&reading(&[0.1, 0.2, 0.9]), l), None);
        }
        let d = t.decide(&reading(&[0.1, 0.2, 0.9]), l).unwrap();
        assert_eq!(d.action, Action::Merge(0));
        assert!((d.load - 0.3).abs() < 1e-9);
        // A busy window pulls the average up; quiet ones bring it down again.
        let mut t = cpu();
        for _ in 0..4 {
            t.decide(&reading(&[0.1, 0.2]), l);
        }
        assert_eq!(
            t.decide(&reading(&[0.9, 0.95]), l),
            None,
            "0.3 + (1.85 - 0.3) / 4 ≥ 0.6"
        );
        let d = t.decide(&reading(&[0.0, 0.0]), l).unwrap();
        assert_eq!(d.action, Action::Merge(0), "0.6875 · 3/4 < 0.6");
    }

    #[test]
    fn cpu_respects_the_minimum_and_restarts_its_watch_after_any_change() {
        let mut t = cpu();
        let one = Limits {
            min_ranges: 2,
            max_ranges: 64,
        };
        for _ in 0..10 {
            assert_eq!(t.decide(&reading(&[0.0, 0.0]), one), None);
        }
        let l = Limits::default();
        let d = t.decide(&reading(&[0.0, 0.0]), l).unwrap();
        assert_eq!(d.action, Action::Merge(0));
        t.done(Done::Merge {
            left: 100,
            right: 101,
        });
        for _ in 0..3 {
            assert_eq!(t.decide(&reading(&[0.0, 0.0, 0.0]), l), None);
        }
        assert!(t.decide(&reading(&[0.0, 0.0, 0.0]), l).is_some());
        // A cooling range's pairs are not watched.
        t.done(Done::Split { old: 101, new: 102 });
        for _ in 0..3 {
            assert_eq!(t.decide(&reading(&[0.0, 0.0, 0.0]), l), None);
        }
    }

    #[test]
    fn a_trigger_is_pluggable_behind_a_box() {
        let mut triggers: Vec<Box<dyn Trigger<Load = f64>>> = vec![Box::new(cpu())];
        let d = triggers[0].decide(&reading(&[3.0]), Limits::default());
        assert_eq!(d.map(|d| d.action), Some(Action::Split(0)));
    }
}
