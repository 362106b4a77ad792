//! Where proclets live, as far as this node knows: a cache of the locations of proclets
//! hosted elsewhere (with epochs: only a newer epoch replaces a cached one), and
//! forwarding entries for proclets that left this node (a call that still arrives here is
//! answered "not here, now at ..."). The authoritative map is the controller's.

use dashmap::DashMap;
use granule_wire::{Location, ProcletId};

/// The location cache and the forwarding entries.
#[derive(Default)]
pub(crate) struct Locations {
    /// Cached locations of proclets hosted elsewhere.
    cache: DashMap<ProcletId, Location>,
    /// Where proclets that left this node went.
    forwarding: DashMap<ProcletId, Location>,
}

impl Locations {
    /// Best known location of a proclet hosted elsewhere.
    pub(crate) fn cached(&self, id: ProcletId) -> Option<Location> {
        self.cache.get(&id).map(|l| l.clone())
    }

    /// Remember a location unless a newer one is known.
    pub(crate) fn learn(&self, id: ProcletId, loc: &Location) {
        match self.cache.get_mut(&id) {
            Some(mut cur) => {
                if cur.epoch < loc.epoch {
                    *cur = loc.clone();
                }
            }
            None => {
                self.cache.insert(id, loc.clone());
            }
        }
    }

    /// Drop the cached location (stale, or the proclet is gone).
    pub(crate) fn forget(&self, id: ProcletId) {
        self.cache.remove(&id);
    }

    /// The proclet left this node for `to`.
    pub(crate) fn forward(&self, id: ProcletId, to: Location) {
        self.forwarding.insert(id, to);
    }

    /// Where a proclet that left this node went, if known.
    pub(crate) fn forwarded_to(&self, id: ProcletId) -> Option<Location> {
        self.forwarding.get(&id).map(|l| l.clone())
    }

    /// The proclet is hosted here (again): neither cached nor forwarded.
    pub(crate) fn hosted_here(&self, id: ProcletId) {
        self.forwarding.remove(&id);
        self.cache.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_wire::NodeId;

    fn at(node: u32, epoch: u64) -> Location {
        Location {
            node: NodeId(node),
            addr: format!("127.0.0.1:{node}"),
            epoch,
        }
    }

    #[test]
    fn only_a_newer_epoch_replaces_a_cached_location() {
        let l = Locations::default();
        let p = ProcletId(1);
        l.learn(p, &at(2, 5));
        l.learn(p, &at(3, 4));
        assert_eq!(l.cached(p), Some(at(2, 5)));
        l.learn(p, &at(3, 6));
        assert_eq!(l.cached(p), Some(at(3, 6)));
        l.forget(p);
        assert_eq!(l.cached(p), None);
    }

    #[test]
    fn hosting_a_proclet_again_clears_what_pointed_elsewhere() {
        let l = Locations::default();
        let p = ProcletId(7);
        l.forward(p, at(4, 2));
        l.learn(p, &at(4, 2));
        assert_eq!(l.forwarded_to(p), Some(at(4, 2)));
        l.hosted_here(p);
        assert_eq!(l.forwarded_to(p), None);
        assert_eq!(l.cached(p), None);
    }
}
