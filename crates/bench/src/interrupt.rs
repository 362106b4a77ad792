//! Ctrl-C and SIGTERM during a benchmark that sets up what it must undo (mounts, cgroup
//! limits, swap, child processes): one handler for the whole process, shared by every
//! such benchmark (`ctrlc` allows one per process, and `granule-bench all` runs several).
//!
//! While a benchmark is [`Active`], the first signal only sets a flag: the benchmark
//! fails its next [`check_interrupted`], and its guards undo everything on the way out.
//! A second signal, or one outside a benchmark, ends the process at once.

use anyhow::bail;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// What the running benchmark prints on the first signal.
static NOTICE: Mutex<String> = Mutex::new(String::new());
static HANDLER: OnceLock<Result<(), String>> = OnceLock::new();

/// Install the handler (once per process); why it could not be, if it could not (then a
/// signal ends the process at once).
pub fn catch_signals() -> Result<(), String> {
    HANDLER
        .get_or_init(|| {
            ctrlc::set_handler(|| {
                if ACTIVE.load(Ordering::SeqCst) && !INTERRUPTED.swap(true, Ordering::SeqCst) {
                    let notice = NOTICE.lock().map(|n| n.clone()).unwrap_or_default();
                    eprintln!("{notice}");
                } else {
                    std::process::exit(130);
                }
            })
            .map_err(|e| e.to_string())
        })
        .clone()
}

/// Whether the running benchmark was interrupted.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// An error once the running benchmark was interrupted.
pub fn check_interrupted() -> anyhow::Result<()> {
    if interrupted() {
        bail!("interrupted");
    }
    Ok(())
}

/// A benchmark running: signals are caught while it lives.
pub struct Active;

impl Active {
    /// Start; `notice` is printed on the first signal (what is being undone).
    pub fn begin(notice: &str) -> Active {
        if let Ok(mut n) = NOTICE.lock() {
            *n = notice.to_string();
        }
        INTERRUPTED.store(false, Ordering::SeqCst);
        ACTIVE.store(true, Ordering::SeqCst);
        Active
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        ACTIVE.store(false, Ordering::SeqCst);
    }
}
