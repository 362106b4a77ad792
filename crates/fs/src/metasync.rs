//! How far the metadata's second copy ([`crate::metacopy`]) has caught up: what an
//! `fsync` waits on. The engine owns it; the replicator moves it on.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// The longest an fsync waits for the copy before it gives up on it (and says so).
const WAIT: Duration = Duration::from_secs(10);

/// What an fsync waits on: the change count the copy has applied.
pub struct MetaSync {
    /// Whether a replicator runs (no copy: nothing to wait for).
    pub(crate) active: AtomicBool,
    shipped: watch::Sender<u64>,
    pub(crate) poke: Notify,
    /// Where the copy is, for status.
    place: Mutex<String>,
}

impl Default for MetaSync {
    fn default() -> Self {
        MetaSync {
            active: AtomicBool::new(false),
            shipped: watch::Sender::new(0),
            poke: Notify::new(),
            place: Mutex::new("none yet".into()),
        }
    }
}

impl MetaSync {
    /// Where the copy is (`on n2`), or why there is none.
    pub fn describe(&self) -> String {
        self.place.lock().clone()
    }

    pub(crate) fn place(&self, what: String) {
        *self.place.lock() = what;
    }

    /// Wait until the copy holds change `seq` (at most 10 s, then it says so in the log).
    pub async fn wait(&self, seq: u64) {
        if !self.active.load(Ordering::Acquire) {
            return;
        }
        let mut rx = self.shipped.subscribe();
        if *rx.borrow() >= seq {
            return;
        }
        self.poke.notify_one();
        if tokio::time::timeout(WAIT, rx.wait_for(|s| *s >= seq))
            .await
            .is_err()
        {
            tracing::warn!(
                "the metadata copy did not confirm within {WAIT:?}: this fsync's metadata is on the mount's node only"
            );
        }
    }

    pub(crate) fn shipped(&self, seq: u64) {
        self.shipped.send_if_modified(|s| {
            if seq > *s {
                *s = seq;
                true
            } else {
                false
            }
        });
    }
}
