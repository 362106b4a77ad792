//! The pressure policy: what a node under pressure moves away. A trait, so it can be
//! replaced and tested alone; the default [`ArgmaxPolicy`] takes the proclet with the
//! largest use of the resource under pressure ÷ estimated migration time. Crate-private:
//! a node's policy is not a setting yet (it would have to reach node processes, which
//! get only their configuration).

use granule_wire::{Kind, ProcletId, Resource};
use std::time::Duration;

/// One hosted proclet as the policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Candidate {
    pub id: ProcletId,
    #[allow(dead_code)] // for policies that weigh kinds
    pub kind: Kind,
    /// Footprint, bytes.
    pub mem_bytes: u64,
    /// Cores used over the accounting window.
    pub cores: f64,
}

/// What the policy reads: pressure, candidates, and the cost of moving.
pub(crate) trait NodeView {
    /// The resource under pressure now, if any (memory first).
    fn pressure(&self) -> Option<Resource>;
    /// Proclets that may move (not pinned, not already moving).
    fn candidates(&self) -> Vec<Candidate>;
    /// Estimated time to move a state of `bytes`.
    fn migration_time(&self, bytes: u64) -> Duration;
}

/// A decision: move `proclet`, which uses `amount` of `resource` (bytes, or millicores),
/// to a node with room for it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Decision {
    pub proclet: ProcletId,
    pub resource: Resource,
    pub amount: u64,
}

/// Decides what a node under pressure moves away.
pub(crate) trait PressurePolicy: Send + Sync {
    /// The next move, or `None` to do nothing now.
    fn decide(&self, view: &dyn NodeView) -> Option<Decision>;
}

/// The default policy: under pressure of a resource, move the proclet with the largest
/// use of it ÷ estimated migration time (what frees the most per second spent moving).
/// Proclets using none of the resource are never chosen, nor, for CPU, proclets using
/// less than `min_cores` (moving them would not relieve the node; a node's CPU can also be
/// contended by other processes of the machine, which no move fixes).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ArgmaxPolicy {
    pub min_cores: f64,
}

impl Default for ArgmaxPolicy {
    fn default() -> Self {
        ArgmaxPolicy { min_cores: 0.1 }
    }
}

impl PressurePolicy for ArgmaxPolicy {
    fn decide(&self, view: &dyn NodeView) -> Option<Decision> {
        let resource = view.pressure()?;
        let use_of = |c: &Candidate| match resource {
            Resource::Memory => c.mem_bytes as f64,
            Resource::Cpu => c.cores,
        };
        let floor = match resource {
            Resource::Memory => 0.0,
            Resource::Cpu => self.min_cores,
        };
        let best = view
            .candidates()
            .into_iter()
            .filter(|c| use_of(c) > floor)
            .map(|c| {
                let t = view.migration_time(c.mem_bytes).as_secs_f64().max(1e-9);
                (use_of(&c) / t, c)
            })
            .max_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal))?
            .1;
        Some(Decision {
            proclet: best.id,
            resource,
            amount: match resource {
                Resource::Memory => best.mem_bytes,
                Resource::Cpu => (best.cores * 1000.0).ceil() as u64,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct FakeNode {
        pressure: Option<Resource>,
        candidates: Vec<Candidate>,
    }

    impl NodeView for FakeNode {
        fn pressure(&self) -> Option<Resource> {
            self.pressure
        }
        fn candidates(&self) -> Vec<Candidate> {
            self.candidates.clone()
        }
        fn migration_time(&self, bytes: u64) -> Duration {
            // 1 ms fixed + 1 GB/s.
            Duration::from_millis(1) + Duration::from_secs_f64(bytes as f64 / 1e9)
        }
    }

    fn c(id: u64, mem: u64, cores: f64) -> Candidate {
        Candidate {
            id: ProcletId(id),
            kind: Kind::Hybrid,
            mem_bytes: mem,
            cores,
        }
    }

    #[test]
    fn no_pressure_no_move() {
        let n = FakeNode {
            pressure: None,
            candidates: vec![c(1, 1 << 20, 1.0)],
        };
        assert_eq!(ArgmaxPolicy::default().decide(&n), None);
    }

    #[test]
    fn memory_pressure_picks_most_bytes_per_second_of_moving() {
        // 64 MiB: 64 MiB / 68 ms ≈ 0.99 GB/s; 1 MiB: 1 MiB / 2.05 ms ≈ 0.51 GB/s;
        // 0 bytes never. The biggest frees the most per second here.
        let n = FakeNode {
            pressure: Some(Resource::Memory),
            candidates: vec![c(1, 1 << 20, 0.0), c(2, 64 << 20, 0.0), c(3, 0, 2.0)],
        };
        assert_eq!(
            ArgmaxPolicy::default().decide(&n),
            Some(Decision {
                proclet: ProcletId(2),
                resource: Resource::Memory,
                amount: 64 << 20
            })
        );
    }

    #[test]
    fn cpu_pressure_prefers_cheap_to_move_cpu_users() {
        // Same cores, but proclet 5 holds 512 MiB (0.54 s to move) and 6 holds 4 KiB:
        // 6 wins. Proclet 7 uses more CPU but is pricier to move than its CPU is worth.
        let n = FakeNode {
            pressure: Some(Resource::Cpu),
            candidates: vec![
                c(5, 512 << 20, 0.9),
                c(6, 4 << 10, 0.9),
                c(7, 100 << 20, 1.0),
            ],
        };
        assert_eq!(
            ArgmaxPolicy::default().decide(&n),
            Some(Decision {
                proclet: ProcletId(6),
                resource: Resource::Cpu,
                amount: 900
            })
        );
    }

    #[test]
    fn cpu_pressure_ignores_proclets_using_little_cpu() {
        let n = FakeNode {
            pressure: Some(Resource::Cpu),
            candidates: vec![c(8, 7 << 20, 0.02), c(9, 1 << 10, 0.05)],
        };
        assert_eq!(ArgmaxPolicy::default().decide(&n), None);
    }
}
