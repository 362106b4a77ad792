//! Per-thread execution context: the current call chain, the node a thread belongs to,
//! and blocking on futures without stalling a node's cores.
//!
//! - The *chain* identifies a top-level call and everything it calls, directly or
//!   transitively. Closures run with their chain set, so nested calls carry it and the
//!   slot lock can recognise re-entry (see `slot`).
//! - The *current node* is the runtime a thread acts through: a node's worker threads
//!   belong to it; the thread that started a `Cluster` belongs to its driver node; other
//!   threads fall back to the process's default node (the first cluster started).
//! - [`block_on`] waits for a future on the calling thread: it polls, spins briefly (a
//!   reply often arrives within microseconds (`transport.spin`), and a sleeping thread costs ~50–100 µs to
//!   wake on this class of VM; while spinning, a remote call reads its reply from the
//!   socket itself), then parks. On a node worker thread it first hands the
//!   worker's core to another thread (`tokio::task::block_in_place`), so a worker blocked
//!   on a nested call never holds one of the node's cores: with `cpu=1`, A→B→A works.

use crate::node::NodeInner;
use granule_wire::ChainId;
use nix::sys::eventfd::{EfdFlags, EventFd};
use parking_lot::RwLock;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

thread_local! {
    static CHAIN: Cell<ChainId> = const { Cell::new(0) };
    static NODE: RefCell<Option<Arc<NodeCell>>> = const { RefCell::new(None) };
    static ON_WORKER: Cell<bool> = const { Cell::new(false) };
}

static DEFAULT_NODE: RwLock<Weak<NodeInner>> = RwLock::new(Weak::new());

/// The chain of the call running on this thread, if any.
pub(crate) fn current_chain() -> Option<ChainId> {
    let c = CHAIN.with(|c| c.get());
    (c != 0).then_some(c)
}

/// A fresh, process- and cluster-unique chain id.
pub(crate) fn new_chain() -> ChainId {
    static SEED: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let seed = *SEED.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        t ^ ((std::process::id() as u64) << 32)
    });
    // splitmix64 of (seed + counter): unique within the process, random across processes.
    let mut z = seed.wrapping_add(
        NEXT.fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) | 1
}

/// The chain to use for a call made from this thread now.
pub(crate) fn chain_for_call() -> ChainId {
    current_chain().unwrap_or_else(new_chain)
}

/// Sets the current chain while a closure runs; restores on drop. Also marks the thread
/// as running a shipped closure, so the panic hook reports a panic there in one line (it
/// becomes the caller's `RemotePanic`) instead of a backtrace on the node's stderr.
pub(crate) struct ChainScope {
    prev: ChainId,
}

impl ChainScope {
    pub(crate) fn enter(chain: ChainId) -> ChainScope {
        IN_CLOSURE.with(|d| d.set(d.get() + 1));
        ChainScope {
            prev: CHAIN.with(|c| c.replace(chain)),
        }
    }
}

impl Drop for ChainScope {
    fn drop(&mut self) {
        CHAIN.with(|c| c.set(self.prev));
        IN_CLOSURE.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

thread_local! {
    static IN_CLOSURE: Cell<u32> = const { Cell::new(0) };
}

/// Install (once per process) a panic hook that reports panics inside shipped closures
/// as one log line; other panics go to the previous hook unchanged.
pub(crate) fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_CLOSURE.with(|d| d.get()) > 0 {
                let msg = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                let at = info
                    .location()
                    .map(|l| format!("{}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                tracing::warn!(
                    "a closure panicked at {at}: {msg} (returned to its caller as RemotePanic)"
                );
            } else {
                prev(info);
            }
        }));
    });
}

/// A node's identity cell: filled once the node has registered. Worker threads are
/// started before that, so they keep the cell rather than the node itself.
pub(crate) type NodeCell = OnceLock<Weak<NodeInner>>;

/// Make the node in `cell` this thread's node.
pub(crate) fn set_thread_node(cell: &Arc<NodeCell>) {
    NODE.with(|n| *n.borrow_mut() = Some(cell.clone()));
}

/// The cluster a thread acts through, captured to hand to a thread it starts (a thread
/// of its own otherwise falls back to the process's first cluster).
#[derive(Clone, Default)]
pub struct ThreadContext(Option<Arc<NodeCell>>);

/// The calling thread's [`ThreadContext`].
pub fn thread_context() -> ThreadContext {
    ThreadContext(NODE.with(|n| n.borrow().clone()))
}

impl ThreadContext {
    /// Make the calling thread act through this context's cluster.
    pub fn enter(&self) {
        if let Some(c) = &self.0 {
            set_thread_node(c);
        }
    }
}

/// Mark this thread as one of a node's worker threads.
pub(crate) fn mark_worker() {
    ON_WORKER.with(|w| w.set(true));
}

/// Make `node` the process default if there is none (alive).
pub(crate) fn offer_default_node(node: &Arc<NodeInner>) {
    let mut d = DEFAULT_NODE.write();
    if d.upgrade().is_none_or(|n| n.is_stopped()) {
        *d = Arc::downgrade(node);
    }
}

/// The node this thread acts through.
pub(crate) fn current_node() -> Option<Arc<NodeInner>> {
    let mine = NODE.with(|n| n.borrow().as_ref().and_then(|c| c.get()?.upgrade()));
    if let Some(n) = mine {
        if !n.is_stopped() {
            return Some(n);
        }
    }
    DEFAULT_NODE.read().upgrade().filter(|n| !n.is_stopped())
}

thread_local! {
    /// Whether [`block_on`] may spin on this thread (see [`set_spin`]).
    static SPIN_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Let (`true`, the default) or stop [`block_on`](crate::block_on) spinning before it sleeps, on the
/// calling thread. Spinning buys latency with CPU: right for a caller that waits on its
/// reply, wrong for a background thread that only keeps work ahead of a consumer (a
/// prefetcher), whose spinning takes the CPU from the thread it works for. Returns the
/// previous setting, so a caller can restore it.
pub fn set_spin(on: bool) -> bool {
    SPIN_HERE.with(|s| s.replace(on))
}

struct ThreadWaker {
    thread: Thread,
    notified: AtomicBool,
    /// The thread sleeps in `poll(2)` on a socket (see `park_on`) rather than parked:
    /// wake it through `efd`.
    in_poll: AtomicBool,
    efd: Option<EventFd>,
}

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if !self.notified.swap(true, Ordering::SeqCst) {
            if self.in_poll.load(Ordering::SeqCst) {
                if let Some(e) = &self.efd {
                    let _ = e.write(1);
                }
            }
            self.thread.unpark();
        }
    }
}

thread_local! {
    static WAKER: (Arc<ThreadWaker>, Waker) = {
        let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC).ok();
        let tw = Arc::new(ThreadWaker {
            thread: std::thread::current(),
            notified: AtomicBool::new(false),
            in_poll: AtomicBool::new(false),
            efd,
        });
        let w = Waker::from(tw.clone());
        (tw, w)
    };
}

fn park_on<F: Future>(fut: F, deadline: Option<Instant>, spin: Duration) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    // While this thread waits, a remote call polled here reads its own reply from the
    // socket: no thread wake-up on the reply's path.
    let _reads = granule_transport::caller_reads();
    let out = WAKER.with(|(tw, waker)| {
        let mut cx = Context::from_waker(waker);
        loop {
            tw.notified.store(false, Ordering::SeqCst);
            if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                return Some(v);
            }
            // Spin briefly, polling the future again and again.
            let spin = if SPIN_HERE.with(|s| s.get()) {
                spin
            } else {
                Duration::ZERO
            };
            let spin_until = Instant::now() + spin;
            while !tw.notified.load(Ordering::Acquire) && Instant::now() < spin_until {
                if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                    return Some(v);
                }
                std::hint::spin_loop();
            }
            // Then sleep: in poll(2) on the socket a reply is awaited on (the kernel wakes
            // us when it arrives, as it would a plain blocking client), else parked.
            while !tw.notified.load(Ordering::SeqCst) {
                let timeout = match deadline {
                    Some(d) => {
                        let now = Instant::now();
                        if now >= d {
                            return None;
                        }
                        Some(d - now)
                    }
                    None => None,
                };
                if let Some(efd) = &tw.efd {
                    tw.in_poll.store(true, Ordering::SeqCst);
                    let waited = !tw.notified.load(Ordering::SeqCst)
                        && granule_transport::wait_for_reply(efd.as_fd(), timeout);
                    tw.in_poll.store(false, Ordering::SeqCst);
                    if waited {
                        let _ = efd.read();
                        break;
                    }
                }
                match timeout {
                    Some(t) => std::thread::park_timeout(t),
                    None => std::thread::park(),
                }
            }
        }
    });
    // A block_on nested inside another one's poll (a closure run by a local call inside an
    // async call) shares this thread's waker and may have consumed a wake-up meant for the
    // outer one: leave the flag set so the outer future is polled again.
    WAKER.with(|(tw, _)| tw.notified.store(true, Ordering::Release));
    out
}

/// Block the calling thread until `fut` completes or `deadline` passes (`None` = timed
/// out), polling for up to `spin` before sleeping (`transport.spin`). On a node worker
/// thread the worker's core is handed off first.
pub(crate) fn block_on<F: Future>(
    fut: F,
    deadline: Option<Instant>,
    spin: Duration,
) -> Option<F::Output> {
    if ON_WORKER.with(|w| w.get()) {
        tokio::task::block_in_place(|| park_on(fut, deadline, spin))
    } else {
        park_on(fut, deadline, spin)
    }
}

/// The node the calling code runs on: inside a closure, the proclet's node; on the
/// driver's threads, the driver. `None` outside any cluster.
pub fn here() -> Option<granule_wire::NodeId> {
    // On a replicated proclet's backup: the primary's answer (see `effects`).
    crate::effects::sync_effect(crate::effects::What::Here, || {
        Ok(current_node().map(|n| n.id))
    })
    .ok()
    .flatten()
}

/// The configuration of the node the calling code runs on (as [`here`]): libraries that
/// start something per node (a service's front door) take their settings from it. `None`
/// outside any cluster.
pub fn node_config() -> Option<Arc<crate::Config>> {
    current_node().map(|n| n.config.clone())
}

/// Wait for a future from synchronous code, Granule's way: inside a closure running on
/// a node, the worker's core is handed to another thread while waiting, so nested calls
/// (including ones back to this node) keep being served. Use it instead of other
/// executors' `block_on` inside closures.
pub fn block_on_public<F: Future>(fut: F) -> F::Output {
    let node = current_node();
    let _enter = node.as_ref().map(|n| n.handle.enter());
    let spin = node.as_ref().map_or_else(
        || granule_config::Transport::default().spin,
        |n| n.config.transport.spin,
    );
    match block_on(fut, None, spin) {
        Some(v) => v,
        None => unreachable!("block_on without a deadline always completes"),
    }
}

/// The kind of proclet `id` if it is hosted on the node the caller belongs to (inside a
/// closure: the proclet's node). Libraries use it to give a proclet split off another the
/// same kind.
pub fn hosted_kind(id: granule_wire::ProcletId) -> Option<granule_wire::Kind> {
    crate::effects::sync_effect(crate::effects::What::HostedKind, || {
        Ok(current_node().and_then(|n| n.hosting.kind_of(id)))
    })
    .ok()
    .flatten()
}

/// Run a CPU-bound section of a closure (a compute proclet working through items) on
/// the calling thread. On a node worker thread the worker's place in the node's runtime
/// is handed to another thread first, so calls to the node (a neighbour fetching
/// elements from a shard here, a probe, a move) keep being served while the section
/// runs instead of waiting behind it: with `cpu=1` the node has one worker thread.
pub fn cpu_bound<R>(f: impl FnOnce() -> R) -> R {
    if ON_WORKER.with(|w| w.get()) {
        tokio::task::block_in_place(|| {
            // A long computation takes the kernel's default slice while it runs (fewer
            // context switches on a shared core); the thread serves calls again after.
            // The guard restores the short slice even if `f` panics.
            struct Restore(Option<std::time::Duration>);
            impl Drop for Restore {
                fn drop(&mut self) {
                    if self.0.is_some() {
                        let _ = granule_host::os::set_thread_slice(self.0);
                    }
                }
            }
            let restore = Restore(current_node().and_then(|n| n.config.node.worker_slice));
            if restore.0.is_some() {
                let _ = granule_host::os::set_thread_slice(None);
            }
            f()
        })
    } else {
        f()
    }
}

/// Run `fut` in the background on the runtime of the node the caller belongs to (inside
/// a closure: the proclet's node; on the driver's threads: the driver). Used to keep a
/// fetch in flight while the caller computes. `None` outside any cluster.
pub fn spawn<F>(fut: F) -> Option<tokio::task::JoinHandle<F::Output>>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    current_node().map(|n| n.handle.spawn(fut))
}

/// Every node the controller knows, with spec, reported use and liveness, as seen from
/// the node the caller belongs to (usable inside closures, unlike `Cluster::nodes`).
pub fn cluster_nodes() -> Result<Vec<granule_wire::NodeInfo>, crate::CallError> {
    block_on_public(cluster_nodes_async())
}

/// [`cluster_nodes`] as a future (the node is chosen when it is created).
pub fn cluster_nodes_async(
) -> impl Future<Output = Result<Vec<granule_wire::NodeInfo>, crate::CallError>> + Send + 'static {
    crate::effects::async_effect(crate::effects::What::Nodes, cluster_nodes_now)
}

fn cluster_nodes_now(
) -> impl Future<Output = Result<Vec<granule_wire::NodeInfo>, crate::CallError>> + Send + 'static {
    let node = current_node();
    async move {
        let n = node.ok_or(crate::CallError::NoCluster)?;
        n.controller
            .list_nodes()
            .await
            .map_err(crate::CallError::from)
    }
}

/// Give the calling thread of a node the configured slice (`node.worker_slice`; `None`:
/// the kernel's default); a refusal is logged once per process and otherwise harmless.
pub(crate) fn apply_worker_slice(slice: Option<Duration>) {
    let Some(slice) = slice else {
        return;
    };
    if let Err(e) = granule_host::os::set_thread_slice(Some(slice)) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!("cannot ask for a {slice:?} scheduler slice for node threads: {e}")
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_are_unique_and_nonzero() {
        let mut v: Vec<ChainId> = (0..10_000).map(|_| new_chain()).collect();
        assert!(v.iter().all(|c| *c != 0));
        v.sort_unstable();
        v.dedup();
        assert_eq!(v.len(), 10_000);
    }

    #[test]
    fn chain_scope_nests_and_restores() {
        assert_eq!(current_chain(), None);
        {
            let _a = ChainScope::enter(5);
            assert_eq!(current_chain(), Some(5));
            {
                let _b = ChainScope::enter(6);
                assert_eq!(chain_for_call(), 6);
            }
            assert_eq!(current_chain(), Some(5));
        }
        assert_eq!(current_chain(), None);
    }

    #[test]
    fn block_on_waits_for_another_thread_and_times_out() {
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let _ = tx.send(7);
        });
        let spin = Duration::from_micros(50);
        assert_eq!(block_on(rx, None, spin).unwrap().unwrap(), 7);
        let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let t = Instant::now();
        assert!(block_on(rx, Some(Instant::now() + Duration::from_millis(30)), spin).is_none());
        assert!(t.elapsed() >= Duration::from_millis(30));
    }
}
