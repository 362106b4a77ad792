//! Where a stripe goes, free of I/O: weighted two-level rendezvous hashing.
//!
//! Stores are grouped in classes (own nodes, victim stores; more classes are allowed).
//! For one stripe, every class gets a weighted rendezvous score (`-w / ln u`, `u` a hash
//! of the stripe and the class in (0, 1)), so a class of weight 2 wins about twice as
//! often as one of weight 1; within a class every store gets a plain rendezvous score.
//! The stripe's *order* is the classes by score, each class's stores by score: the
//! primary copy goes to the first store that can take it, a replica to the second store
//! of the same class, or to the next class when the class has one usable store. A
//! store that leaves (drained, lost) only moves its own stripes, each to the next store
//! in that stripe's order; readers walk the same order to find a stripe that moved.

use serde::{Deserialize, Serialize};

/// A store's number within one mount (never reused).
pub type StoreId = u32;

/// One class of stores and its weight.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Class {
    /// `own`, `victim`, ...
    pub name: String,
    /// Relative share of stripes (0: only when no other class can take the stripe).
    pub weight: f64,
    pub stores: Vec<StoreId>,
}

/// The classes a file's stripes were placed over (kept with the file's metadata).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    pub classes: Vec<Class>,
}

/// splitmix64's finaliser: a cheap, well-mixed 64-bit hash of a 64-bit value.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The placement key of stripe `index` of inode `ino`: the same for every version of the
/// stripe, so a rewritten stripe lands where the old one was.
pub fn stripe_key(ino: u64, index: u64) -> u64 {
    mix(mix(ino) ^ index.rotate_left(32))
}

/// A uniform number in (0, 1) from two 64-bit values.
fn unit(key: u64, salt: u64) -> f64 {
    ((mix(key ^ mix(salt ^ 0x5851_f42d_4c95_7f2d)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Weighted rendezvous score: larger wins; a weight of 0 scores 0 (always last).
fn weighted_score(key: u64, salt: u64, weight: f64) -> f64 {
    if weight <= 0.0 || !weight.is_finite() {
        return 0.0;
    }
    -weight / unit(key, salt).ln()
}

/// Class salts are distinct from store ids' salts.
const CLASS_SALT: u64 = 0xc1a5_5000_0000_0000;

impl Layout {
    /// Every store of the layout in the stripe's order, with its class index.
    pub fn order(&self, key: u64) -> Vec<(usize, StoreId)> {
        let mut classes: Vec<(f64, usize)> = self
            .classes
            .iter()
            .enumerate()
            .map(|(i, c)| (weighted_score(key, CLASS_SALT ^ i as u64, c.weight), i))
            .collect();
        // Ties (weight 0) keep the classes' own order.
        classes.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut out = Vec::new();
        for (_, ci) in classes {
            let mut stores: Vec<(f64, StoreId)> = self.classes[ci]
                .stores
                .iter()
                .map(|&s| (unit(key, u64::from(s)), s))
                .collect();
            stores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            out.extend(stores.into_iter().map(|(_, s)| (ci, s)));
        }
        out
    }

    /// The stores `copies` copies of the stripe go to, among those `usable` accepts: the
    /// first usable store of the order, then (replica) the next usable store of the same
    /// class, or the first of the next class when that class has no other. Fewer than
    /// `copies` when fewer stores are usable.
    pub fn targets(
        &self,
        key: u64,
        copies: usize,
        usable: impl Fn(StoreId) -> bool,
    ) -> Vec<StoreId> {
        let order: Vec<(usize, StoreId)> = self
            .order(key)
            .into_iter()
            .filter(|&(_, s)| usable(s))
            .collect();
        let Some(&(first_class, first)) = order.first() else {
            return Vec::new();
        };
        let mut out = vec![first];
        // Replicas: the same class first, then the order's next classes.
        let same = order
            .iter()
            .filter(|&&(c, s)| c == first_class && s != first)
            .map(|&(_, s)| s);
        let others = order
            .iter()
            .filter(|&&(c, _)| c != first_class)
            .map(|&(_, s)| s);
        for s in same.chain(others) {
            if out.len() >= copies {
                break;
            }
            out.push(s);
        }
        out
    }

    /// Every store the layout names.
    pub fn stores(&self) -> impl Iterator<Item = StoreId> + '_ {
        self.classes.iter().flat_map(|c| c.stores.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(own: &[StoreId], victims: &[StoreId], vw: f64) -> Layout {
        Layout {
            classes: vec![
                Class {
                    name: "own".into(),
                    weight: 1.0,
                    stores: own.to_vec(),
                },
                Class {
                    name: "victim".into(),
                    weight: vw,
                    stores: victims.to_vec(),
                },
            ],
        }
    }

    #[test]
    fn class_shares_follow_weights() {
        let l = layout(&[1, 2], &[10, 11, 12], 2.0);
        let n = 30_000u64;
        let victim = (0..n)
            .filter(|&i| l.targets(stripe_key(7, i), 1, |_| true)[0] >= 10)
            .count() as f64;
        let share = victim / n as f64;
        assert!((share - 2.0 / 3.0).abs() < 0.02, "victim share {share}");
    }

    #[test]
    fn stores_within_a_class_share_evenly() {
        let l = layout(&[1, 2, 3], &[], 1.0);
        let mut counts = [0u32; 4];
        for i in 0..30_000u64 {
            counts[l.targets(stripe_key(1, i), 1, |_| true)[0] as usize] += 1;
        }
        for c in &counts[1..] {
            assert!((*c as f64 - 10_000.0).abs() < 500.0, "{counts:?}");
        }
    }

    #[test]
    fn replica_goes_to_the_same_class_or_the_next() {
        let l = layout(&[1, 2], &[10], 1.0);
        for i in 0..1000u64 {
            let t = l.targets(stripe_key(3, i), 2, |_| true);
            assert_eq!(t.len(), 2);
            assert_ne!(t[0], t[1]);
            if t[0] < 10 {
                // Own has two stores: the replica stays in own.
                assert!(t[1] < 10, "{t:?}");
            } else {
                // The victim class has one store: the replica goes to own.
                assert!(t[1] < 10, "{t:?}");
            }
        }
    }

    #[test]
    fn a_store_leaving_moves_only_its_stripes_to_the_next_in_order() {
        let l = layout(&[1, 2], &[10, 11, 12], 1.5);
        for i in 0..5000u64 {
            let k = stripe_key(9, i);
            let before = l.targets(k, 1, |_| true)[0];
            let after = l.targets(k, 1, |s| s != 11)[0];
            if before != 11 {
                assert_eq!(before, after);
            } else {
                let order = l.order(k);
                let pos = order.iter().position(|&(_, s)| s == 11).unwrap();
                assert_eq!(order[pos + 1].1, after);
            }
        }
    }

    #[test]
    fn zero_weight_class_only_when_nothing_else_fits() {
        let l = layout(&[1], &[10], 0.0);
        for i in 0..1000u64 {
            assert_eq!(l.targets(stripe_key(2, i), 1, |_| true), vec![1]);
            assert_eq!(l.targets(stripe_key(2, i), 1, |s| s != 1), vec![10]);
        }
        assert!(l.targets(1, 1, |_| false).is_empty());
    }

    #[test]
    fn order_is_a_permutation_of_the_stores() {
        let l = layout(&[1, 2, 3], &[10, 11], 1.0);
        let mut o: Vec<StoreId> = l.order(12345).into_iter().map(|(_, s)| s).collect();
        o.sort_unstable();
        assert_eq!(o, vec![1, 2, 3, 10, 11]);
    }
}
