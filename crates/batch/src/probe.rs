//! How many idle cores a node has right now, measured on the node itself.
//!
//! The controller's view of a node (its heartbeats, every 100 ms by default) is too old
//! to grow a job onto a core within milliseconds of it freeing up, so the coordinator
//! asks the node directly, through a small pinned proclet per node. The node answers
//! from the kernel's own counters over the interval since it was last asked:
//!
//! - idle time of the CPUs the node may run on (its affinity mask, i.e. its cpuset),
//!   from the root cpu accounting group's per-CPU nanoseconds, which count every task
//!   on the machine, not only Granule's (read through `granule_host`);
//! - the node's own CPU use (process CPU clock), against the cores its spec gives it.
//!
//! Spare cores = min(idle CPU time of its CPUs, spec cores − its own use): the first says
//! whether anyone else (an antagonist, another node) is using the CPUs, the second
//! whether the node's quota has room.

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Shortest interval a reading is taken over; a first reading waits this long.
const MIN_INTERVAL: Duration = Duration::from_millis(2);
/// A previous sample older than this is not used (the answer would average too long).
const MAX_AGE: Duration = Duration::from_millis(50);

/// The pinned proclet on each node that answers probes. Its state is the node's spec.
#[derive(Serialize, Deserialize)]
pub(crate) struct Probe {
    pub cores: f64,
}

#[derive(Clone)]
struct Sample {
    at: Instant,
    /// Busy nanoseconds of each allowed CPU (None when the counters are unreadable).
    cpus: Option<Vec<u64>>,
    own: Duration,
}

static LAST: Mutex<Option<Sample>> = Mutex::new(None);

fn allowed_cpus() -> Vec<usize> {
    granule_host::os::affinity(0).unwrap_or_default()
}

fn sample() -> Sample {
    // The root cpuacct group counts every task on the machine, per CPU.
    let cpus = granule_host::cpuacct_usage_percpu(&granule_host::Hierarchy::default(), "/")
        .ok()
        .map(|all| {
            allowed_cpus()
                .into_iter()
                .map(|c| all.get(c).copied().unwrap_or(0))
                .collect()
        });
    let own = granule_host::proc::process_cpu_time();
    Sample {
        at: Instant::now(),
        cpus,
        own,
    }
}

/// Spare cores between two samples; see the module doc.
fn spare_between(a: &Sample, b: &Sample, cores: f64) -> f64 {
    let wall = b.at.duration_since(a.at).as_secs_f64().max(1e-6);
    let own = b.own.saturating_sub(a.own).as_secs_f64() / wall;
    let quota_room = (cores - own).max(0.0);
    let idle = match (&a.cpus, &b.cpus) {
        (Some(x), Some(y)) if x.len() == y.len() && !x.is_empty() => x
            .iter()
            .zip(y)
            .map(|(p, q)| (1.0 - q.saturating_sub(*p) as f64 / 1e9 / wall).clamp(0.0, 1.0))
            .sum(),
        // Without the machine's counters only the quota can be judged.
        _ => quota_room,
    };
    idle.min(quota_room)
}

/// The probe call: spare cores on this node since the previous probe here (or over the
/// next couple of milliseconds when there is no recent one).
pub(crate) fn spare_cores(p: &Probe, _: ()) -> f64 {
    let prev = LAST.lock().clone();
    let prev = match prev {
        Some(s) if s.at.elapsed() <= MAX_AGE && s.at.elapsed() >= MIN_INTERVAL => s,
        Some(s) if s.at.elapsed() < MIN_INTERVAL => {
            // Asked again too soon: wait out the interval (the worker is handed over).
            // Saturating: the clock moved on since the guard read it (a plain
            // subtraction panicked when it had passed the interval meanwhile).
            let rest = MIN_INTERVAL.saturating_sub(s.at.elapsed());
            granule_runtime::block_on(tokio::time::sleep(rest));
            s
        }
        _ => {
            let s = sample();
            granule_runtime::block_on(tokio::time::sleep(MIN_INTERVAL));
            s
        }
    };
    let now = sample();
    let spare = spare_between(&prev, &now, p.cores);
    *LAST.lock() = Some(now);
    spare
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(ms: u64, cpus: &[u64], own_ms: u64, base: Instant) -> Sample {
        Sample {
            at: base + Duration::from_millis(ms),
            cpus: Some(cpus.to_vec()),
            own: Duration::from_millis(own_ms),
        }
    }

    #[test]
    fn spare_is_the_smaller_of_idle_cpus_and_quota_room() {
        let t = Instant::now();
        // Two CPUs over 10 ms: CPU0 fully busy (by us), CPU1 idle; 1-core spec: no room.
        let a = s(0, &[0, 0], 0, t);
        let b = s(10, &[10_000_000, 0], 10, t);
        assert!(spare_between(&a, &b, 1.0) < 0.01);
        // 2-core spec: one CPU idle, one core of room.
        assert!((spare_between(&a, &b, 2.0) - 1.0).abs() < 0.01);
        // An antagonist keeps the only CPU busy; we use nothing: no spare.
        let b = s(10, &[10_000_000], 0, t);
        let a1 = s(0, &[0], 0, t);
        assert!(spare_between(&a1, &b, 1.0) < 0.01);
        // Idle CPU, idle node.
        let b = s(10, &[0], 0, t);
        assert!((spare_between(&a1, &b, 1.0) - 1.0).abs() < 0.01);
    }

    #[test]
    fn reads_this_machines_counters() {
        let a = sample();
        std::thread::sleep(Duration::from_millis(5));
        let b = sample();
        let v = spare_between(&a, &b, allowed_cpus().len() as f64);
        assert!((0.0..=allowed_cpus().len() as f64).contains(&v), "{v}");
    }
}
