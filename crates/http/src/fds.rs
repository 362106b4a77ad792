//! The process's reserve of file descriptors for cluster traffic: a door admits a
//! connection only if the process would still have `node.fd_reserve` descriptors free
//! below its soft limit afterwards, counting the connections of every door of the
//! process together.
//!
//! Counting the process's open descriptors means listing them (through `granule-host`),
//! which costs about a microsecond per descriptor: too much for every connection of a
//! flood. So the count of everything that is not an HTTP connection ("others": peer
//! connections, files, the runtime's own) is taken at most once per [`RECOUNT`] and the
//! HTTP connections are counted exactly as they come and go; near the limit the count is
//! retaken (at most once per [`RECOUNT_NEAR`]) before a connection is refused, so a stale
//! count does not refuse for long after descriptors were freed. Descriptors opened
//! between two counts come out of the reserve, which is what it is for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the descriptors besides HTTP connections are counted again.
const RECOUNT: Duration = Duration::from_secs(1);
/// How often they are counted again at most while connections are being refused.
const RECOUNT_NEAR: Duration = Duration::from_millis(20);

/// HTTP connections open over every door of the process.
static OPEN: AtomicU64 = AtomicU64::new(0);

/// The last count of the descriptors that are not HTTP connections.
struct Counted {
    at: Option<Instant>,
    others: u64,
}

static COUNTED: Mutex<Counted> = Mutex::new(Counted {
    at: None,
    others: 0,
});

/// An admitted connection's place in the count; given back when dropped.
pub(crate) struct Slot(());

impl Drop for Slot {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::Relaxed);
    }
}

/// HTTP connections open over every door of this process.
pub fn open_connections() -> u64 {
    OPEN.load(Ordering::Relaxed)
}

/// Whether a process with `used` descriptors open (the new connection's included) keeps
/// `reserve` free below its soft limit `soft`.
pub(crate) fn keeps_reserve(soft: u64, reserve: u64, used: u64) -> bool {
    used.saturating_add(reserve) <= soft
}

/// Admit a connection just accepted (its socket is open already) if the process keeps
/// `reserve` descriptors free with it; `None`: refuse it.
pub(crate) fn admit(reserve: u64) -> Option<Slot> {
    let soft = match granule_host::os::nofile_limit() {
        Ok((soft, _)) => soft,
        // The limit cannot be read: nothing to keep a reserve under.
        Err(_) => u64::MAX,
    };
    let take = || {
        OPEN.fetch_add(1, Ordering::Relaxed);
        Some(Slot(()))
    };
    if soft == u64::MAX {
        return take();
    }
    let mut c = COUNTED.lock().unwrap_or_else(|p| p.into_inner());
    let http = OPEN.load(Ordering::Relaxed);
    let age = c.at.map(|t| t.elapsed());
    if age.is_none_or(|a| a >= RECOUNT) {
        recount(&mut c, http);
    }
    if keeps_reserve(soft, reserve, c.others + http + 1) {
        return take();
    }
    // Refusing on an old count: count again first (descriptors may have been freed).
    if c.at.is_some_and(|t| t.elapsed() >= RECOUNT_NEAR) {
        recount(&mut c, http);
        if keeps_reserve(soft, reserve, c.others + http + 1) {
            return take();
        }
    }
    None
}

/// Count the process's descriptors again: everything open but the `http` connections
/// admitted and the one being decided on.
fn recount(c: &mut Counted, http: u64) {
    match granule_host::proc::open_fds() {
        Ok(n) => {
            c.others = n.saturating_sub(http + 1);
            c.at = Some(Instant::now());
        }
        Err(e) => {
            // Keep the last count; try again at the next connection after RECOUNT.
            c.at = Some(Instant::now());
            tracing::debug!("cannot count this process's open file descriptors: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_kept_below_the_soft_limit() {
        assert!(keeps_reserve(1024, 256, 768));
        assert!(!keeps_reserve(1024, 256, 769));
        assert!(keeps_reserve(1024, 0, 1024));
        assert!(!keeps_reserve(100, 256, 1));
        assert!(!keeps_reserve(10, u64::MAX, 0));
    }
}
