//! [`RangeTable`]: which target (a shard, a compute proclet) serves which range of keys.
//!
//! A range is named by its first key, `lo`; `None` is −∞, so the range starting at `None`
//! is the first one. A range ends where the next one starts (the last one at +∞). A key
//! therefore belongs to exactly one range as long as the table holds a range starting at
//! `None` ([`RangeTable::covers_every_key`]): the one with the greatest start at or below
//! it. The table knows nothing of versions or proclets; [`crate::ChangeLog`] and
//! [`crate::Replica`] version it.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Key ranges, each served by a target `T`, in key order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "K: Serialize, T: Serialize",
    deserialize = "K: Ord + Deserialize<'de>, T: Deserialize<'de>"
))]
pub struct RangeTable<K, T> {
    ranges: BTreeMap<Option<K>, T>,
}

impl<K: Ord, T> Default for RangeTable<K, T> {
    fn default() -> Self {
        RangeTable {
            ranges: BTreeMap::new(),
        }
    }
}

impl<K: Ord + Clone, T> RangeTable<K, T> {
    /// A table with no range (no key maps anywhere yet).
    pub fn new() -> Self {
        Self::default()
    }

    /// A table of one range holding every key.
    pub fn whole(target: T) -> Self {
        let mut t = Self::new();
        t.set(None, target);
        t
    }

    /// How many ranges.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether the table has no range.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Whether every key belongs to a range (the first range starts at −∞).
    pub fn covers_every_key(&self) -> bool {
        self.ranges.contains_key(&None)
    }

    /// The range holding `key`: its start and its target.
    pub fn lookup(&self, key: &K) -> Option<(&Option<K>, &T)> {
        self.ranges.range(..=Some(key.clone())).next_back()
    }

    /// The target of the range starting at `lo`.
    pub fn get(&self, lo: &Option<K>) -> Option<&T> {
        self.ranges.get(lo)
    }

    /// Whether a range starts at `lo`.
    pub fn contains(&self, lo: &Option<K>) -> bool {
        self.ranges.contains_key(lo)
    }

    /// Where the range starting at `lo` ends (exclusive): the next range's start, `None`
    /// for +∞.
    pub fn end(&self, lo: &Option<K>) -> Option<&K> {
        use std::ops::Bound::{Excluded, Unbounded};
        self.ranges
            .range((Excluded(lo), Unbounded))
            .next()
            .and_then(|(k, _)| k.as_ref())
    }

    /// The range just before the one starting at `lo` (its left neighbour).
    pub fn before(&self, lo: &Option<K>) -> Option<(&Option<K>, &T)> {
        self.ranges.range(..lo).next_back()
    }

    /// The range just after the one starting at `lo` (its right neighbour).
    pub fn after(&self, lo: &Option<K>) -> Option<(&Option<K>, &T)> {
        use std::ops::Bound::{Excluded, Unbounded};
        self.ranges.range((Excluded(lo), Unbounded)).next()
    }

    /// Every range in key order: its start and target.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&Option<K>, &T)> + '_ {
        self.ranges.iter()
    }

    /// Let `target` serve the range starting at `lo` (a new range, which takes the upper
    /// part of the range holding `lo`, or a new target for an existing one). Returns the
    /// target it replaced.
    pub fn set(&mut self, lo: Option<K>, target: T) -> Option<T> {
        self.ranges.insert(lo, target)
    }

    /// Drop the range starting at `lo`: its keys go to the range before it. Returns its
    /// target.
    pub fn remove(&mut self, lo: &Option<K>) -> Option<T> {
        self.ranges.remove(lo)
    }
}

impl<K: Ord + Clone, T: Clone> RangeTable<K, T> {
    /// Every range in key order, copied.
    pub fn to_vec(&self) -> Vec<(Option<K>, T)> {
        self.ranges
            .iter()
            .map(|(k, t)| (k.clone(), t.clone()))
            .collect()
    }
}

impl<K: Ord, T> FromIterator<(Option<K>, T)> for RangeTable<K, T> {
    fn from_iter<I: IntoIterator<Item = (Option<K>, T)>>(iter: I) -> Self {
        RangeTable {
            ranges: iter.into_iter().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> RangeTable<u32, &'static str> {
        [(None, "a"), (Some(10), "b"), (Some(20), "c")]
            .into_iter()
            .collect()
    }

    #[test]
    fn a_key_belongs_to_the_range_with_the_greatest_start_at_or_below_it() {
        let t = table();
        assert_eq!(t.lookup(&0), Some((&None, &"a")));
        assert_eq!(t.lookup(&9), Some((&None, &"a")));
        assert_eq!(t.lookup(&10), Some((&Some(10), &"b")));
        assert_eq!(t.lookup(&19), Some((&Some(10), &"b")));
        assert_eq!(t.lookup(&u32::MAX), Some((&Some(20), &"c")));
        assert!(t.covers_every_key());
    }

    #[test]
    fn without_a_first_range_low_keys_map_nowhere() {
        let t: RangeTable<u32, &str> = [(Some(10), "b")].into_iter().collect();
        assert!(!t.covers_every_key());
        assert_eq!(t.lookup(&9), None);
        assert_eq!(t.lookup(&10), Some((&Some(10), &"b")));
        assert!(RangeTable::<u32, u8>::new().lookup(&0).is_none());
    }

    #[test]
    fn neighbours_and_ends() {
        let t = table();
        assert_eq!(t.end(&None), Some(&10));
        assert_eq!(t.end(&Some(10)), Some(&20));
        assert_eq!(t.end(&Some(20)), None);
        assert_eq!(t.before(&None), None);
        assert_eq!(t.before(&Some(20)), Some((&Some(10), &"b")));
        assert_eq!(t.after(&None), Some((&Some(10), &"b")));
        assert_eq!(t.after(&Some(20)), None);
        assert_eq!(
            t.iter().map(|(_, v)| *v).collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
    }

    #[test]
    fn set_splits_and_remove_merges_into_the_left_neighbour() {
        let mut t = RangeTable::whole("a");
        assert_eq!(t.set(Some(5), "b"), None);
        assert_eq!(t.lookup(&7), Some((&Some(5), &"b")));
        assert_eq!(t.remove(&Some(5)), Some("b"));
        assert_eq!(t.lookup(&7), Some((&None, &"a")));
        assert_eq!(t.set(None, "z"), Some("a"));
        assert_eq!(t.to_vec(), vec![(None, "z")]);
    }
}
