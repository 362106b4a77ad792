//! The harvester's bookkeeping, free of I/O: which refaults are the workload's, and how
//! deep the limit may go after a drop.
//!
//! - [`RefaultFilter`]: the group's refault counter less the refaults the harvester's
//!   own prefetch causes (the pages it advised, for a short while) and those zswap's
//!   writeback causes (the kernel counts each page zswap writes back to the swap file as
//!   a refault of its group; cgroup v1 has no per-group writeback count, so the
//!   machine's is taken, which can only undercount the workload's refaults).
//! - [`Floor`]: after a drop, no lowering below a floor until a deadline (see
//!   `run`'s module doc).

use std::time::Instant;

/// See the module doc. Counters are monotonic; the filtered counter never goes back.
#[derive(Debug, Default)]
pub(crate) struct RefaultFilter {
    /// Refaults attributed to the harvester's prefetch or zswap's writeback so far.
    own: u64,
    /// Pages a prefetch advised that may still come in as refaults, and until when.
    credit: u64,
    credit_until: Option<Instant>,
    /// The machine's writeback counter at the last update.
    writebacks: Option<u64>,
}

impl RefaultFilter {
    pub(crate) fn new(writebacks: Option<u64>) -> RefaultFilter {
        RefaultFilter {
            writebacks,
            ..RefaultFilter::default()
        }
    }

    /// The workload's refaults so far, from the group's counter `raw` and the machine's
    /// writebacks `writebacks` (if read); `prev` is the value this returned last time.
    pub(crate) fn update(
        &mut self,
        raw: u64,
        writebacks: Option<u64>,
        prev: u64,
        now: Instant,
    ) -> u64 {
        let mut seen = raw.saturating_sub(self.own).max(prev);
        if let Some(wb) = writebacks {
            let new_wb = self.writebacks.map_or(0, |w| wb.saturating_sub(w));
            self.writebacks = Some(wb);
            let mine = (seen - prev).min(new_wb);
            self.own += mine;
            seen -= mine;
        }
        if self.credit > 0 {
            if self.credit_until.is_some_and(|u| now > u) {
                self.credit = 0;
            } else {
                let mine = (seen - prev).min(self.credit);
                self.credit -= mine;
                self.own += mine;
                seen -= mine;
            }
        }
        seen
    }

    /// A prefetch advised `pages` pages; their refaults until `until` are not the
    /// workload's.
    pub(crate) fn prefetched(&mut self, pages: u64, until: Instant) {
        self.credit += pages;
        self.credit_until = Some(until);
    }
}

/// No lowering below `limit` until `until`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Floor {
    pub(crate) limit: u64,
    pub(crate) until: Instant,
}

impl Floor {
    /// Where a lowering from `base` to `new` may go under `floor` at `now`: `None` to
    /// hold. The second value says whether the floor has expired (the caller drops it).
    pub(crate) fn apply(
        floor: Option<Floor>,
        base: u64,
        new: u64,
        now: Instant,
    ) -> (Option<u64>, bool) {
        match floor {
            None => (Some(new), false),
            Some(f) if now >= f.until => (Some(new), true),
            Some(f) => {
                let new = new.max(f.limit);
                ((new < base).then_some(new), false)
            }
        }
    }

    /// The floor after a drop at `limit` (kept `chunk` above it until `until`); a higher
    /// floor still in force stays.
    pub(crate) fn after_drop(
        current: Option<Floor>,
        limit: u64,
        chunk: u64,
        until: Instant,
        now: Instant,
    ) -> Floor {
        let new = Floor {
            limit: limit.saturating_add(chunk),
            until,
        };
        match current {
            Some(f) if f.limit >= new.limit && f.until > now => f,
            _ => new,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn writebacks_are_not_the_workloads_refaults() {
        let t = Instant::now();
        let mut f = RefaultFilter::new(Some(1000));
        // 50 refaults, no writeback: all the workload's.
        assert_eq!(f.update(50, Some(1000), 0, t), 50);
        // 6000 more refaults while zswap wrote back 5990 pages: 10 are the workload's.
        assert_eq!(f.update(6050, Some(6990), 50, t), 60);
        // Writebacks without refaults take nothing from later refaults.
        assert_eq!(f.update(6050, Some(9000), 60, t), 60);
        assert_eq!(f.update(6060, Some(9000), 60, t), 70);
        // Without a writeback reading, refaults count as they are.
        assert_eq!(f.update(6070, None, 70, t), 80);
    }

    #[test]
    fn a_prefetch_is_not_a_burst_until_its_credit_runs_out() {
        let t = Instant::now();
        let mut f = RefaultFilter::new(None);
        assert_eq!(f.update(10, None, 0, t), 10);
        f.prefetched(1000, t + Duration::from_secs(2));
        // 800 of the prefetch's pages come in, plus nothing of the workload's.
        assert_eq!(f.update(810, None, 10, t), 10);
        // 300 more: 200 of credit left, 100 are the workload's.
        assert_eq!(f.update(1110, None, 10, t), 110);
        // Credit used up: everything counts again.
        assert_eq!(f.update(1120, None, 110, t), 120);
        // Credit expires: a later prefetch's unused credit does not hide refaults.
        f.prefetched(500, t + Duration::from_secs(2));
        assert_eq!(f.update(1170, None, 120, t + Duration::from_secs(3)), 170);
    }

    #[test]
    fn the_filtered_counter_never_goes_back() {
        let t = Instant::now();
        let mut f = RefaultFilter::new(Some(0));
        assert_eq!(f.update(100, Some(100), 0, t), 0);
        // A group counter that went back (a new group?) does not make it negative.
        assert_eq!(f.update(50, Some(100), 0, t), 0);
    }

    #[test]
    fn a_floor_holds_lowering_above_it_until_it_expires() {
        let t = Instant::now();
        let later = t + Duration::from_secs(300);
        assert_eq!(Floor::apply(None, 1000, 900, t), (Some(900), false));
        let f = Some(Floor {
            limit: 950,
            until: later,
        });
        // Lowering from 1000 to 900 stops at the floor.
        assert_eq!(Floor::apply(f, 1000, 900, t), (Some(950), false));
        // Already at or under the floor: hold.
        assert_eq!(Floor::apply(f, 950, 850, t), (None, false));
        assert_eq!(Floor::apply(f, 940, 840, t), (None, false));
        // Expired: anything goes, and the caller is told to drop it.
        assert_eq!(Floor::apply(f, 950, 850, later), (Some(850), true));
    }

    #[test]
    fn a_drop_sets_a_floor_a_chunk_above_and_keeps_a_higher_one() {
        let t = Instant::now();
        let until = t + Duration::from_secs(300);
        let f = Floor::after_drop(None, 400, 64, until, t);
        assert_eq!(f.limit, 464);
        // A later drop deeper down keeps the higher floor.
        let g = Floor::after_drop(Some(f), 300, 64, until + Duration::from_secs(10), t);
        assert_eq!(g, f);
        // A drop higher up raises it.
        let h = Floor::after_drop(Some(f), 600, 64, until, t);
        assert_eq!(h.limit, 664);
        // An expired floor is replaced.
        let k = Floor::after_drop(Some(h), 300, 64, until, until + Duration::from_secs(1));
        assert_eq!(k.limit, 364);
    }
}
