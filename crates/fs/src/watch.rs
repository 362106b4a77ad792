//! Watching the stores: every `fs.probe_every` the mount asks each active store it keeps
//! stripes on whether it is there (see [`Store::probe`](crate::stores::Store::probe)),
//! so a store that died is noticed without waiting for I/O to it. Reads prefer the
//! mount's own copies, so a dead victim holding only second copies would otherwise look
//! healthy — and its stripes stay one loss away from gone — until some write happened
//! to touch it.
//!
//! A store found unreachable (connection refused or dropped, its node gone) by
//! `fs.probe_misses` probes in a row counts as lost: [`Engine::store_lost`] drops its copies from
//! the metadata and re-replicates what it held from the copies that remain. One answer
//! resets the count. A store that answers with an error (full, rate-limited, a refused
//! command) answered: it is there. Draining stores are not probed: their drain reads
//! every stripe off them and handles a loss itself.

use crate::engine::Engine;
use crate::stores::{StoreError, StoreState};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How the stores are watched.
#[derive(Clone, Copy, Debug)]
pub struct Watch {
    /// Time between probe rounds.
    pub every: Duration,
    /// How long one probe may take to be answered (at least `every`, and at least the
    /// stores' own answer timeout: a store busy with the mount's own large writes on the
    /// same connection is slow, not dead).
    pub within: Duration,
    /// Misses in a row that make a store lost.
    pub misses: u32,
}

/// Probe the engine's active stores until the mount ends (run it on the mount's runtime).
pub async fn watch_stores(engine: Arc<Engine>, w: Watch) {
    let mut tick = tokio::time::interval(w.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        probe_round(&engine, w).await;
    }
}

/// One round: every active store probed at once; the stores declared lost by it.
pub async fn probe_round(engine: &Arc<Engine>, w: Watch) -> Vec<String> {
    let stores: Vec<_> = engine
        .stores
        .all()
        .into_iter()
        .filter(|s| s.state() == StoreState::Active)
        .collect();
    let answers = futures::future::join_all(
        stores
            .iter()
            .map(|s| async move { s.probe(w.within).await }),
    )
    .await;
    let mut lost = Vec::new();
    for (s, answer) in stores.iter().zip(answers) {
        let why = match answer {
            Ok(()) | Err(StoreError::Full) | Err(StoreError::Tampered) => {
                s.misses.store(0, Ordering::Relaxed);
                continue;
            }
            Err(StoreError::Lost(e)) => e,
            Err(e) => {
                // Slow (its probe waited behind the mount's own large writes on the same
                // connection, or its rate limit), not gone: a dead process refuses or
                // drops connections, which is what counts. A store that hangs with its
                // connections open is still caught by the I/O that times out on it.
                s.probes_missed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(store = %s.name, "a probe got no answer in time: {e}");
                continue;
            }
        };
        s.probes_missed.fetch_add(1, Ordering::Relaxed);
        let row = s.misses.fetch_add(1, Ordering::Relaxed) + 1;
        if row < w.misses {
            tracing::info!(store = %s.name, "missed a probe ({row} in a row): {why}");
            continue;
        }
        if s.state() == StoreState::Active {
            tracing::warn!(
                store = %s.name,
                "missed {row} probes in a row ({why}): counted as lost"
            );
            engine.store_lost(s.id);
            lost.push(s.name.clone());
        }
    }
    lost
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Settings;
    use crate::meta::Namespace;
    use crate::stores::Store;
    use granule_market::consumer::{Protection, Sealer};

    /// A victim at an address nobody listens on misses every probe; it counts as lost
    /// on the `misses`-th in a row, not before, and is not probed (or lost) again.
    #[test]
    fn a_store_that_never_answers_is_lost_after_the_set_misses() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        // A port that was free a moment ago: connections to it are refused.
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        let settings = Settings {
            stripe: 1 << 20,
            replicas: 1,
            cache_bytes: 0,
            readahead: 0,
            write_behind: 1,
            dirty: 1 << 20,
        };
        let engine = Engine::new(settings, rt.handle().clone(), Namespace::new(0o755, 0, 0));
        let sealer = Arc::new(Sealer::new(Protection::None, &[0; 32]));
        let s = Store::victim(1, &addr, "x", 1 << 20, None, sealer, Duration::from_secs(1));
        let s = engine.add_store(s, "victim", 1.0);
        let w = Watch {
            every: Duration::from_millis(50),
            within: Duration::from_millis(500),
            misses: 3,
        };
        for round in 1..=2 {
            let lost = rt.block_on(probe_round(&engine, w));
            assert!(lost.is_empty(), "lost after {round} misses");
            assert_eq!(s.state(), StoreState::Active);
            assert_eq!(s.misses.load(Ordering::Relaxed), round);
        }
        let lost = rt.block_on(probe_round(&engine, w));
        assert_eq!(lost, vec![addr.clone()]);
        assert_eq!(s.state(), StoreState::Gone);
        // Gone stores are no longer probed.
        assert!(rt.block_on(probe_round(&engine, w)).is_empty());
        assert_eq!(s.probes_missed.load(Ordering::Relaxed), 3);
    }
}
