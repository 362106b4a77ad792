//! Versions of a [`RangeTable`]: the authoritative [`ChangeLog`] (what a mapping proclet
//! holds) and a client's [`Replica`], which catches up from its version.
//!
//! Version `v` of the table is the state after its first `v` changes. The log keeps only
//! the latest changes (about one per range plus [`LOG_SLACK`], dropped in bulk: amortized
//! O(1) per change), so a table that splits and merges for ever keeps a bounded log. A
//! replica at a version the log still covers catches up with the changes after it; one
//! further behind gets a snapshot of the whole table, which is no bigger than the changes
//! it missed.

use crate::table::RangeTable;
use serde::{Deserialize, Serialize};

/// One change of a table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change<K, T> {
    /// `target` serves the range starting at `lo` (a new range split off the one holding
    /// `lo`, or a new target for an existing range).
    Set { lo: Option<K>, target: T },
    /// The range starting at `lo` is gone: its keys belong to the range before it.
    Remove { lo: Option<K> },
}

impl<K: Ord + Clone, T> Change<K, T> {
    fn apply_to(self, table: &mut RangeTable<K, T>) {
        match self {
            Change::Set { lo, target } => {
                table.set(lo, target);
            }
            Change::Remove { lo } => {
                table.remove(&lo);
            }
        }
    }
}

/// Changes kept beyond one per range, so that clients a little behind catch up by delta.
pub const LOG_SLACK: usize = 64;

/// What a replica at some version needs to reach the latest one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CatchUp<K, T> {
    /// The changes after the replica's version, in order.
    Changes(Vec<Change<K, T>>),
    /// The replica's version is older than the log: the whole table as of `version`.
    Snapshot {
        version: u64,
        ranges: Vec<(Option<K>, T)>,
    },
}

/// The authoritative table and the recent end of its log of changes.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(bound(
    serialize = "K: Serialize, T: Serialize",
    deserialize = "K: Ord + Deserialize<'de>, T: Deserialize<'de>"
))]
pub struct ChangeLog<K, T> {
    /// Changes dropped from the front: `log[i]` is change number `base + i + 1`.
    base: u64,
    log: Vec<Change<K, T>>,
    current: RangeTable<K, T>,
}

impl<K: Ord, T> Default for ChangeLog<K, T> {
    fn default() -> Self {
        ChangeLog {
            base: 0,
            log: Vec::new(),
            current: RangeTable::default(),
        }
    }
}

impl<K: Ord + Clone, T: Clone> ChangeLog<K, T> {
    /// An empty table at version 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// A table whose one range, holding every key, `target` serves: version 1.
    pub fn whole(target: T) -> Self {
        let mut log = Self::new();
        log.apply(Change::Set { lo: None, target });
        log
    }

    /// The latest version (changes made since the table was empty).
    pub fn version(&self) -> u64 {
        self.base + self.log.len() as u64
    }

    /// How many of the latest changes the log still holds.
    pub fn kept(&self) -> usize {
        self.log.len()
    }

    /// The table as of the latest version.
    pub fn table(&self) -> &RangeTable<K, T> {
        &self.current
    }

    /// Make a change; returns the new version. Removing the first range (`lo` = `None`)
    /// would leave keys without a range: it is refused, and the version stays.
    pub fn apply(&mut self, change: Change<K, T>) -> u64 {
        if matches!(change, Change::Remove { lo: None }) {
            return self.version();
        }
        change.clone().apply_to(&mut self.current);
        self.log.push(change);
        self.compact();
        self.version()
    }

    /// Let `target` serve the range starting at `lo` unless a range already starts there
    /// (another client recorded the same split first). Returns the range's target: the
    /// one found, or `target`.
    pub fn set_if_absent(&mut self, lo: Option<K>, target: T) -> T {
        if let Some(existing) = self.current.get(&lo) {
            return existing.clone();
        }
        self.apply(Change::Set {
            lo,
            target: target.clone(),
        });
        target
    }

    /// Drop the range starting at `lo` if there is one (a merge recorded once, however
    /// often it is reported). Returns whether it did.
    pub fn remove_if_present(&mut self, lo: Option<K>) -> bool {
        if lo.is_none() || !self.current.contains(&lo) {
            return false;
        }
        self.apply(Change::Remove { lo });
        true
    }

    /// Drop the oldest changes once the log is more than twice what it keeps (one change
    /// per range plus [`LOG_SLACK`]): amortized O(1) per change, and the log stays
    /// proportional to the table.
    fn compact(&mut self) {
        let keep = self.current.len() + LOG_SLACK;
        if self.log.len() > 2 * keep {
            let drop = self.log.len() - keep;
            self.log.drain(..drop);
            self.base += drop as u64;
        }
    }

    /// What a replica at version `from` needs to catch up.
    pub fn since(&self, from: u64) -> CatchUp<K, T> {
        match from.checked_sub(self.base) {
            Some(skip) => CatchUp::Changes(
                usize::try_from(skip)
                    .ok()
                    .and_then(|skip| self.log.get(skip..))
                    .map(<[_]>::to_vec)
                    .unwrap_or_default(),
            ),
            None => CatchUp::Snapshot {
                version: self.version(),
                ranges: self.current.to_vec(),
            },
        }
    }
}

/// A client's copy of a table and its version.
#[derive(Clone, Debug)]
pub struct Replica<K, T> {
    version: u64,
    table: RangeTable<K, T>,
}

impl<K: Ord, T> Default for Replica<K, T> {
    fn default() -> Self {
        Replica {
            version: 0,
            table: RangeTable::default(),
        }
    }
}

impl<K: Ord + Clone, T> Replica<K, T> {
    /// An empty copy at version 0 (it catches up on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// The version this copy is at.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The table as of [`Replica::version`].
    pub fn table(&self) -> &RangeTable<K, T> {
        &self.table
    }

    /// Apply what the log sent a replica at version `from`. Another thread sharing this
    /// copy may have caught up meanwhile: only what is new to it is applied. Returns
    /// whether the version moved.
    pub fn catch_up(&mut self, from: u64, update: CatchUp<K, T>) -> bool {
        match update {
            CatchUp::Changes(changes) => {
                // The changes start at `from`; a copy behind `from` cannot use them (it
                // never is: versions only grow, and `from` was read from this copy).
                let Some(skip) = self.version.checked_sub(from) else {
                    return false;
                };
                let skip = usize::try_from(skip).unwrap_or(usize::MAX);
                let mut moved = false;
                for c in changes.into_iter().skip(skip) {
                    if !matches!(c, Change::Remove { lo: None }) {
                        c.apply_to(&mut self.table);
                    }
                    self.version += 1;
                    moved = true;
                }
                moved
            }
            CatchUp::Snapshot { version, ranges } => {
                if version <= self.version {
                    return false;
                }
                self.table = ranges.into_iter().collect();
                self.version = version;
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    type Log = ChangeLog<u16, u32>;

    #[test]
    fn versions_count_changes_and_the_log_stays_bounded() {
        let mut log = Log::whole(0);
        assert_eq!(log.version(), 1);
        // Split and merge the same range for ever: 2 changes per round.
        for i in 0..10_000u32 {
            log.apply(Change::Set {
                lo: Some(7),
                target: i + 1,
            });
            log.apply(Change::Remove { lo: Some(7) });
        }
        assert_eq!(log.version(), 20_001);
        assert!(log.kept() <= 2 * (1 + LOG_SLACK), "{}", log.kept());
        assert_eq!(log.table().to_vec(), vec![(None, 0)]);
    }

    #[test]
    fn a_replica_catches_up_by_changes_then_by_snapshot_when_far_behind() {
        let mut log = Log::whole(0);
        let mut near = Replica::new();
        assert!(near.catch_up(0, log.since(0)));
        let mut far = near.clone();
        log.apply(Change::Set {
            lo: Some(10),
            target: 1,
        });
        assert!(matches!(log.since(near.version()), CatchUp::Changes(ref c) if c.len() == 1));
        assert!(near.catch_up(1, log.since(1)));
        assert_eq!(near.table(), log.table());
        for i in 0..1000 {
            log.apply(Change::Set {
                lo: Some(20),
                target: i,
            });
        }
        let update = log.since(far.version());
        assert!(matches!(update, CatchUp::Snapshot { .. }));
        assert!(far.catch_up(1, update));
        assert_eq!(far.version(), log.version());
        assert_eq!(far.table(), log.table());
        // Up to date: nothing to do.
        assert!(!far.catch_up(far.version(), log.since(far.version())));
    }

    #[test]
    fn two_threads_catching_up_from_the_same_version_apply_each_change_once() {
        let mut log = Log::whole(0);
        let mut r = Replica::new();
        r.catch_up(0, log.since(0));
        log.apply(Change::Set {
            lo: Some(5),
            target: 1,
        });
        let first = log.since(1);
        log.apply(Change::Remove { lo: Some(5) });
        let second = log.since(1);
        // The later answer lands first; the earlier one is then old news.
        assert!(r.catch_up(1, second));
        assert!(!r.catch_up(1, first));
        assert_eq!(r.version(), 3);
        assert_eq!(r.table(), log.table());
    }

    #[test]
    fn the_first_range_is_never_removed_and_recorded_once() {
        let mut log = Log::whole(0);
        assert_eq!(log.apply(Change::Remove { lo: None }), 1);
        assert!(!log.remove_if_present(None));
        assert_eq!(log.set_if_absent(Some(3), 1), 1);
        assert_eq!(log.set_if_absent(Some(3), 2), 1, "the first record wins");
        assert!(log.remove_if_present(Some(3)));
        assert!(!log.remove_if_present(Some(3)));
        assert_eq!(log.version(), 3);
    }

    /// What a proptest does to the authoritative log.
    #[derive(Clone, Debug)]
    enum Op {
        /// Split the range holding this key there (a new range starts at it).
        Split(u16),
        /// Merge the range holding this key into its left neighbour.
        Merge(u16),
        /// Give the range holding this key a new target (a drained first range dropped
        /// into its right neighbour, a shard replaced).
        Retarget(u16),
        /// A replica records the version it is at now, to catch up later.
        Remember,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => any::<u16>().prop_map(Op::Split),
            3 => any::<u16>().prop_map(Op::Merge),
            1 => any::<u16>().prop_map(Op::Retarget),
            1 => Just(Op::Remember),
        ]
    }

    /// Each range's target by a linear scan of the table's starts, what `lookup` must
    /// agree with.
    fn owner(table: &RangeTable<u16, u32>, key: u16) -> Option<u32> {
        let mut found = None;
        for (lo, t) in table.iter() {
            if lo.is_none_or(|lo| lo <= key) {
                found = Some(*t);
            }
        }
        found
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any sequence of splits, merges and re-targets, with compaction along the way:
        /// a replica left at any earlier version catches up to exactly the authoritative
        /// table, and every key maps to exactly one range all along.
        #[test]
        fn replicas_at_any_version_catch_up_to_the_authoritative_table(
            ops in proptest::collection::vec(op(), 1..600),
            probes in proptest::collection::vec(any::<u16>(), 16),
        ) {
            let mut log = Log::whole(0);
            let mut next = 1u32;
            let mut replicas: Vec<Replica<u16, u32>> = vec![Replica::new()];
            for op in ops {
                match op {
                    Op::Split(k) => {
                        let lo = Some(k);
                        if !log.table().contains(&lo) {
                            log.apply(Change::Set { lo, target: next });
                            next += 1;
                        }
                    }
                    Op::Merge(k) => {
                        let lo = log.table().lookup(&k).and_then(|(lo, _)| *lo);
                        log.remove_if_present(lo);
                    }
                    Op::Retarget(k) => {
                        let lo = log.table().lookup(&k).map(|(lo, _)| *lo);
                        if let Some(lo) = lo {
                            log.apply(Change::Set { lo, target: next });
                            next += 1;
                        }
                    }
                    Op::Remember => {
                        let mut r = Replica::new();
                        r.catch_up(0, log.since(0));
                        prop_assert_eq!(r.version(), log.version());
                        replicas.push(r);
                    }
                }
                prop_assert!(log.table().covers_every_key());
                prop_assert!(log.kept() <= 2 * (log.table().len() + LOG_SLACK));
            }
            for mut r in replicas {
                let from = r.version();
                r.catch_up(from, log.since(from));
                prop_assert_eq!(r.version(), log.version());
                prop_assert_eq!(r.table(), log.table());
            }
            for k in probes.into_iter().chain([0, u16::MAX]) {
                let (lo, t) = log.table().lookup(&k).expect("every key has a range");
                prop_assert!(lo.is_none_or(|lo| lo <= k));
                prop_assert!(log.table().end(lo).is_none_or(|end| k < *end));
                prop_assert_eq!(Some(*t), owner(log.table(), k));
            }
        }

        /// Catching up in pieces (a replica shared by threads whose answers arrive in
        /// any order, some from before the others' changes) ends at the same table.
        #[test]
        fn catch_ups_in_any_order_end_at_the_same_table(
            splits in proptest::collection::vec(1u16.., 1..200),
            order in proptest::collection::vec(any::<prop::sample::Index>(), 1..20),
        ) {
            let mut log = Log::whole(0);
            let mut answers = Vec::new();
            for (i, k) in splits.into_iter().enumerate() {
                if i % 3 == 2 {
                    let lo = log.table().lookup(&k).and_then(|(lo, _)| *lo);
                    log.remove_if_present(lo);
                } else {
                    log.set_if_absent(Some(k), i as u32 + 1);
                }
                answers.push((0, log.since(0)));
            }
            let mut r = Replica::new();
            for i in order {
                let (from, a) = &answers[i.index(answers.len())];
                r.catch_up(*from, a.clone());
            }
            let from = r.version();
            r.catch_up(from, log.since(from));
            prop_assert_eq!(r.version(), log.version());
            prop_assert_eq!(r.table(), log.table());
        }
    }
}
