//! The compute layer both services share: a *pool* of compute proclets, each serving one
//! range of the 64-bit routing keys, the table of those ranges, the client-side routing
//! with its cached copy of the table, and the scaler that splits a busy proclet's range
//! and merges idle neighbours, and replaces those lost with their nodes.
//!
//! **Compute proclets hold no request state.** A worker proclet holds only the service's
//! context (a stateless service's: the value it was started with, `()` by default; a
//! stateful one's: the handle of its paired memory proclet, see [`Context`]) and its
//! counters: the load its handlers caused and
//! the table version it was last told. A client whose cached table is stale still
//! reaches a live worker, which serves the call or turns it away unrun: routing is
//! *sticky* (the same key goes to the same worker while the table stands), never a
//! correctness condition.
//!
//! **The table** is `granule-router`'s: a compacted log of changes
//! ([`granule_router::ChangeLog`]) in a small memory proclet, written only by the scaler
//! of the process that started the service, and cached by every client
//! ([`granule_router::Router`]), which catches up by the changes it missed. Every reply of
//! a worker carries the table version the scaler last told that worker (it does so every
//! window, when it reads the worker's load), so a client learns of a split within a
//! window and catches up once. The scaler's decisions are the router's CPU-used trigger
//! ([`granule_router::CpuLoad`], set from [`ScaleConfig`]).
//!
//! **Exactly once.** A call is sent again only when it provably did not run: a worker
//! merged away answers *retired* without running the handler (retirement takes the
//! worker's exclusive lock, so handlers in flight finish first and later calls are
//! turned away), a worker whose context no longer serves the key (a stateful pair whose
//! memory half gave those clients away) turns the call away unrun, and a destroyed
//! worker refuses calls before running anything (`CallError::ProcletGone`). Any other
//! failure is returned to the caller, never retried. Workers answer with the router's
//! [`granule_router::Answer`] (served, or not run), and the router's loop re-sends only
//! what provably did not run. The one exception is a lost node (below).
//!
//! **Healing.** A worker whose node the controller declared dead (killed, or silent for
//! longer than the failure timeout) is replaced by the scaler: a new worker, placed by
//! the controller on a live node, takes the same key range, and the table names it.
//! The scaler notices on its own (the worker's load cannot be read; the controller
//! confirms the node is dead) and at once when a caller in any process finds the node
//! gone (the caller rings the scaler through the table proclet, which lives in the
//! scaler's process). Only the scaler writes the table, under its lock, so a lost
//! worker is replaced once however many callers saw it fail. Callers that got
//! `CallError::NodeUnreachable` wait, catch up with the table and send the call again,
//! for at most [`HEAL_PATIENCE`] ([`ServiceError::Lost`] then). So a stateless call
//! is *at least once* under node loss: a call that was running on the lost node may
//! have had effects outside it (writes to other proclets) before the node died, and
//! runs again on the replacement. A context that is lost too (a stateful pair's memory
//! proclet: its clients' state) is re-created empty through [`Context::renew`], with a
//! warning naming the service and the key range and the counter
//! `granule_service_shards_lost_total{service}`; every replacement counts in
//! `granule_service_proclets_replaced_total{service}`.
//!
//! **Load** is the thread CPU time (`CLOCK_THREAD_CPUTIME_ID`, read through
//! `granule_host::proc::thread_cpu_time`) spent inside the user's handler, summed over
//! every thread that ran it, per wall second of the window: a worker runs handlers on
//! several of its node's worker threads at once (`run_ref`), so its load can exceed one
//! core. The scaler reads every worker once per window
//! ([`ScaleConfig::window`], 5 ms by default).

use crate::ServiceError;
use granule_router::{
    Action, Answer, Change, ChangeLog, CpuLoad, Done, Limits, RangeTable, Reading, Replica,
    RetryPolicy, RouteError, Router, Trigger,
};
use granule_runtime::{CallError, Kind, NodeId, Proclet, ProcletId, ProcletState, Wire};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

/// When the scaler splits and merges, and how often it looks.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleConfig {
    /// How often every worker's load is read (the measuring window): 5 ms.
    pub window: Duration,
    /// A worker whose load over one window exceeds this many cores is split: 1.0.
    pub split_above: f64,
    /// A stateful pair whose state was busy (a handler running on it, or calls waiting
    /// for it) more than this share of one window is split: 0.9. Handlers of one pair
    /// take turns on its state, so its load cannot exceed one core: calls beyond that
    /// queue, and a pair near saturation is the one to split.
    pub split_busy: f64,
    /// Two neighbouring workers whose summed load, averaged over the last
    /// [`ScaleConfig::merge_after`] windows, is under this many cores are merged: 0.6
    /// (well under the split threshold, so a merged pair is not split again at once).
    pub merge_below: f64,
    /// Windows a pair is watched (and averaged over) before it may merge: 40 (200 ms at
    /// 5 ms windows; merging is never urgent, splitting is).
    pub merge_after: u32,
    /// Windows a worker is left alone after a split, while clients learn of the new table
    /// and its load (and the queue that built up before the split) moves: 10.
    pub cooldown: u32,
    /// Never fewer workers than this: 1.
    pub min_proclets: usize,
    /// Never more workers than this: 64.
    pub max_proclets: usize,
    /// Whether the scaler acts at all (it still measures and records when off; tests
    /// drive splits and merges by hand then).
    pub auto: bool,
}

impl Default for ScaleConfig {
    fn default() -> Self {
        ScaleConfig {
            window: Duration::from_millis(5),
            split_above: 1.0,
            split_busy: 0.9,
            merge_below: 0.6,
            merge_after: 40,
            cooldown: 10,
            min_proclets: 1,
            max_proclets: 64,
            auto: true,
        }
    }
}

/// One window of the scaler's record.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the service started.
    pub t: f64,
    /// Workers in the table at the end of the window.
    pub proclets: usize,
    /// Each worker's load over the window (cores), in key order.
    pub loads: Vec<f64>,
    /// Handler calls completed in the window, over all workers.
    pub calls: u64,
}

/// A split or a merge.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScaleEvent {
    /// Seconds since the service started.
    pub t: f64,
    /// `true` for a split, `false` for a merge.
    pub split: bool,
    /// Workers afterwards.
    pub proclets: usize,
    /// The load that triggered it (the split worker's, or the merged pair's sum).
    pub load: f64,
}

/// The record the scaler keeps: one sample per window and every split and merge.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Timeline {
    pub samples: Vec<Sample>,
    pub events: Vec<ScaleEvent>,
}

impl Timeline {
    /// Splits so far.
    pub fn splits(&self) -> usize {
        self.events.iter().filter(|e| e.split).count()
    }
    /// Merges so far.
    pub fn merges(&self) -> usize {
        self.events.iter().filter(|e| !e.split).count()
    }
}

/// At most this many samples are kept (over an hour at 5 ms windows is not needed; the
/// oldest are dropped).
const MAX_SAMPLES: usize = 1 << 20;

// ----- the worker proclet --------------------------------------------------------------

/// What a worker of a service carries besides its counters, and how it follows splits
/// and merges. A stateless service's context is `()`: nothing to split. A stateful
/// service's is the worker's memory proclet, whose clients are split and merged with
/// the worker's key range.
pub(crate) trait Context: ProcletState + Clone + Sync {
    /// Whether a worker's handlers take turns (a stateful pair's state): its load is
    /// then the share of time its state was busy, split above
    /// [`ScaleConfig::split_busy`] rather than [`ScaleConfig::split_above`].
    const SERIAL: bool = false;
    /// The context for a new worker on `node` that takes the keys from `mid` up of a
    /// worker with this context; `None`: the same context serves both.
    fn split(&self, mid: u64, node: Option<NodeId>) -> Result<Option<Self>, ServiceError> {
        let _ = (mid, node);
        Ok(None)
    }
    /// Take over `right`'s keys (its worker has retired: no handler of it runs any more).
    fn merge(&self, right: &Self) -> Result<(), ServiceError> {
        let _ = right;
        Ok(())
    }
    /// Release what the context owns; its worker is gone.
    fn release(&self) -> Result<(), ServiceError> {
        Ok(())
    }
    /// The node whose loss took what this context owns with it, if it was lost (the
    /// controller declared its node dead). Asks the controller: called only for a worker
    /// suspected lost.
    fn lost(&self) -> Option<NodeId> {
        None
    }
    /// A context serving the keys `lo..hi` in place of this lost one, on `node` (a
    /// stateful pair: a new memory proclet there, with an empty state). Called only when
    /// [`Context::lost`] said so.
    fn renew(&self, lo: u64, hi: u128, node: Option<NodeId>) -> Result<Self, ServiceError> {
        let _ = (lo, hi, node);
        Ok(self.clone())
    }
}

/// Whether a call failed because the node it went to is lost or cannot be reached.
pub(crate) fn node_lost(e: &CallError) -> bool {
    matches!(e, CallError::NodeUnreachable { .. })
}

/// The node a location lookup found dead (the controller's word: only it says a
/// proclet's node is dead), if it did.
pub(crate) fn dead_node(loc: Result<NodeId, CallError>) -> Option<NodeId> {
    match loc {
        Err(CallError::NodeUnreachable { node, .. }) => Some(node),
        _ => None,
    }
}

/// Counters a worker keeps for the scaler (not moved with the worker: a moved worker
/// starts from zero, which the scaler notices).
#[derive(Default)]
pub struct Meter {
    cpu_ns: AtomicU64,
    calls: AtomicU64,
    version: AtomicU64,
    retired: AtomicBool,
    /// A call found the context's own proclet (a stateful pair's memory half) on a lost
    /// node: the scaler checks the context at its next reading.
    ctx_lost: AtomicBool,
}

/// The state of a compute proclet of a service: the service's context and its meter.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct Worker<C: ProcletState> {
    pub(crate) ctx: C,
    #[serde(skip)]
    meter: Meter,
}

impl<C: ProcletState> Worker<C> {
    fn new(ctx: C) -> Worker<C> {
        Worker {
            ctx,
            meter: Meter::default(),
        }
    }

    /// Charge one call that cost `ns` of load (CPU time, or time a stateful call's
    /// client state was busy or waited for) to this worker.
    pub(crate) fn charge(&self, ns: u64) {
        self.meter.cpu_ns.fetch_add(ns, Ordering::Relaxed);
        self.meter.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Tell the scaler (at its next reading) that a call found the context's own proclet
    /// unreachable.
    pub(crate) fn context_lost(&self) {
        self.meter.ctx_lost.store(true, Ordering::Relaxed);
    }

    /// Run `f` and charge the CPU time the calling thread spent in it to this worker.
    pub(crate) fn timed<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Charge<'a>(&'a Meter, u64);
        impl Drop for Charge<'_> {
            fn drop(&mut self) {
                let used = thread_cpu_ns().saturating_sub(self.1);
                self.0.cpu_ns.fetch_add(used, Ordering::Relaxed);
                self.0.calls.fetch_add(1, Ordering::Relaxed);
            }
        }
        let _charge = Charge(&self.meter, thread_cpu_ns());
        f()
    }
}

/// The calling thread's CPU time in nanoseconds (read through the host crate, the only
/// one that reads the OS's clocks and files).
fn thread_cpu_ns() -> u64 {
    u64::try_from(granule_host::proc::thread_cpu_time().as_nanos()).unwrap_or(u64::MAX)
}

/// Nanoseconds on this process's monotonic clock (what a worker's readings are timed
/// with: the scaler divides CPU by the time between two readings *on the worker*, so a
/// reading that waited in a busy node's queue does not inflate the load).
fn mono_ns() -> u64 {
    static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);
    EPOCH.elapsed().as_nanos() as u64
}

/// What a worker answers a routed call: served (the result, or the context found lost,
/// and the table version the worker knows), or not run (retired, or its context no
/// longer serves the key: the argument comes back). Workers never answer stale, busy or
/// moved: a stale client still reaches a live worker, which serves or turns the call
/// away unrun.
type Reply<R, A, C> = Answer<(Result<R, CallError>, u64), A, Proclet<Worker<C>>>;

/// Why a worker did not serve a call (what `via` answers instead of a result).
pub(crate) enum Unserved<A> {
    /// The worker's context no longer serves the key: the call did not run, here is its
    /// argument.
    NotRun(A),
    /// The context's own proclet is on a lost node (the worker flagged it for the
    /// scaler): the call is sent again once the scaler replaced the pair.
    Lost(CallError),
}

/// The wrapper every routed call runs in on a worker. `via` runs the call, or hands the
/// argument back unrun when the worker's context no longer serves its key.
fn on_worker<C, A, R, F, W>(w: &Worker<C>, a: A, (f, via): &(F, W)) -> Reply<R, A, C>
where
    C: ProcletState,
    W: Fn(&Worker<C>, A, &F) -> Result<R, Unserved<A>>,
{
    let version = w.meter.version.load(Ordering::Relaxed);
    if w.meter.retired.load(Ordering::Acquire) {
        return Answer::NotRun(a);
    }
    match via(w, a, f) {
        Ok(r) => Answer::Served((Ok(r), version)),
        Err(Unserved::NotRun(a)) => Answer::NotRun(a),
        Err(Unserved::Lost(e)) => Answer::Served((Err(e), version)),
    }
}

// ----- waking a scaler -----------------------------------------------------------------

/// Wakes a scaler before its window ends: a caller found a worker's node gone, and the
/// scaler should look now rather than at its next reading (windows may be long).
#[derive(Default)]
struct Bell {
    rung: Mutex<bool>,
    cv: Condvar,
}

impl Bell {
    fn ring(&self) {
        *self.rung.lock() = true;
        self.cv.notify_one();
    }

    /// Wait up to `d` for a ring; whether it rang.
    fn wait(&self, d: Duration) -> bool {
        let mut rung = self.rung.lock();
        if !*rung {
            self.cv.wait_for(&mut rung, d);
        }
        std::mem::take(&mut *rung)
    }
}

/// The bells of the scalers of this process, by their table proclet's id: a caller in
/// any process rings one by running a closure on the table proclet, which lives next to
/// its scaler.
static BELLS: LazyLock<Mutex<HashMap<ProcletId, Arc<Bell>>>> = LazyLock::new(Default::default);

fn ring(table: ProcletId) {
    if let Some(b) = BELLS.lock().get(&table) {
        b.ring();
    }
}

// ----- the table -----------------------------------------------------------------------

/// The table of a pool, as its memory proclet holds it: routing-key ranges → workers, a
/// compacted log of changes ([`granule_router::ChangeLog`]). The first range starts at
/// `None`, which is routing key 0.
type WorkerLog<C> = ChangeLog<u64, Proclet<Worker<C>>>;

/// A worker and where its range starts (`None`: routing key 0).
type Range<C> = (Option<u64>, Proclet<Worker<C>>);

/// Where a range starting at `lo` begins, as a routing key.
fn first_key(lo: &Option<u64>) -> u64 {
    lo.unwrap_or(0)
}

/// Where the range starting at `lo` ends (exclusive), past `u64::MAX` for the last one.
fn end_key<T>(table: &RangeTable<u64, T>, lo: &Option<u64>) -> u128 {
    table.end(lo).map_or(u64::MAX as u128 + 1, |h| *h as u128)
}

// ----- the client ----------------------------------------------------------------------

/// How a routed call retries: for 30 s, calling again at once after the first unrun
/// answer (the table has the news: the scaler records a merge before it retires the
/// worker), then every 100 µs (a stateful pair hands clients over before the table
/// names their new worker). Workers are never busy.
const ROUTE: RetryPolicy = RetryPolicy {
    patience: Duration::from_secs(30),
    busy_patience: Duration::from_secs(30),
    min_wait: Duration::from_micros(100),
    max_wait: Duration::from_micros(100),
};

/// How long a call waits for a worker lost with its node to be replaced (the scaler
/// does so within a window of the controller declaring the node dead, itself within the
/// failure timeout), sending it again as soon as the table names the replacement.
pub(crate) const HEAL_PATIENCE: Duration = Duration::from_secs(30);

/// The first wait before sending a call whose worker's node was lost again; it doubles
/// up to [`HEAL_MAX_WAIT`].
const HEAL_MIN_WAIT: Duration = Duration::from_millis(1);
const HEAL_MAX_WAIT: Duration = Duration::from_millis(50);

/// A handle to a pool: routes calls. Serializable (front doors on other nodes get one;
/// they start with an empty cache). Clones share the cache.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct Pool<C: ProcletState> {
    /// The table's client: its memory proclet and the cached copy.
    router: Router<WorkerLog<C>, u64, Proclet<Worker<C>>>,
}

impl<C: ProcletState> Clone for Pool<C> {
    fn clone(&self) -> Self {
        Pool {
            router: self.router.clone(),
        }
    }
}

impl<C: ProcletState + Clone> Pool<C> {
    /// A pool of one worker covering every key, with `ctx` as its context, on `node`
    /// (`None`: where the controller places compute).
    pub(crate) fn create(
        ctx: C,
        node: Option<NodeId>,
        group: &str,
    ) -> Result<Pool<C>, ServiceError> {
        let mut b = Proclet::builder(Kind::Compute).group(group);
        if let Some(n) = node {
            b = b.on(n);
        }
        let first = b.create(ctx, |c: C| Worker::new(c))?;
        // The table lives (and stays) next to the scaler, in the process that starts the
        // service: callers ring the scaler through it, and it must not be lost with
        // another node (the service is gone with this process anyway). A node that
        // cannot host it (no memory budget): where the controller places memory; the
        // scaler then only notices lost workers at its own readings.
        let whole = |w: Proclet<Worker<C>>| WorkerLog::<C>::whole(w);
        let here = granule_runtime::here().map(|n| {
            Proclet::builder(Kind::Memory)
                .on(n)
                .pinned()
                .create(first.clone(), whole)
        });
        let table = match here {
            Some(Ok(t)) => Ok(t),
            _ => Proclet::builder(Kind::Memory).create(first.clone(), whole),
        };
        let table = match table {
            Ok(t) => t,
            Err(e) => {
                let _ = first.destroy();
                return Err(e.into());
            }
        };
        Ok(Pool {
            router: Router::new(table),
        })
    }
}

/// A routing failure as a service error.
fn route_error(e: RouteError) -> ServiceError {
    match e {
        RouteError::Call(e) => ServiceError::Call(e),
        RouteError::Unmapped => ServiceError::Unmapped,
        RouteError::Stuck(_) => ServiceError::Stuck,
    }
}

impl<C: ProcletState> Pool<C> {
    /// Run `via(&worker, arg, &f)` on the worker serving `key` (both capture nothing);
    /// `via` hands the argument back ([`Unserved::NotRun`]) to have the call routed
    /// again. A call whose worker (or its context) was lost with its node is sent again
    /// once the scaler replaced it (see the module docs: at least once), for at most
    /// [`HEAL_PATIENCE`].
    pub(crate) async fn call<A, R, F, W>(
        &self,
        key: u64,
        arg: A,
        f: F,
        via: W,
    ) -> Result<R, ServiceError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Copy + Send + Sync + 'static,
        W: Fn(&Worker<C>, A, &F) -> Result<R, Unserved<A>> + Copy + Send + Sync + 'static,
    {
        let mut healing: Option<(Instant, Duration)> = None;
        loop {
            let routed = self
                .router
                .route_async(
                    &key,
                    arg.clone(),
                    ROUTE,
                    |w: &Proclet<Worker<C>>, a| {
                        w.run_ref_with_async(a, (f, via), on_worker::<C, A, R, F, W>)
                    },
                    // Workers never answer busy: there is no change to finish.
                    |_: &Proclet<Worker<C>>| std::future::ready(Ok::<(), RouteError>(())),
                )
                .await;
            let lost = match routed {
                Ok(((Ok(r), version), _)) => {
                    // The worker knows a newer table: learn of the split or merge now, once.
                    if let Err(e) = self.router.catch_up_to(version).await {
                        tracing::debug!("refreshing a service's table failed: {e}");
                    }
                    return Ok(r);
                }
                Ok(((Err(e), _), _)) => e,
                Err(RouteError::Call(e)) if node_lost(&e) => e,
                Err(e) => return Err(route_error(e)),
            };
            let (since, wait) = healing.get_or_insert((Instant::now(), HEAL_MIN_WAIT));
            if since.elapsed() >= HEAL_PATIENCE {
                return Err(ServiceError::Lost(lost));
            }
            let pause = *wait;
            *wait = (*wait * 2).min(HEAL_MAX_WAIT);
            self.ring_scaler().await;
            tokio::time::sleep(pause).await;
            if let Err(e) = self.router.refresh_async().await {
                tracing::debug!("refreshing a service's table failed: {e}");
            }
        }
    }

    /// Ask the pool's scaler to look at its workers now (it runs in the process that
    /// holds the table proclet).
    pub(crate) async fn ring_scaler(&self) {
        let table = self.router.map();
        if let Err(e) = table
            .run_ref_async(table.id(), |_: &WorkerLog<C>, id: ProcletId| ring(id))
            .await
        {
            tracing::debug!("ringing a service's scaler failed: {e}");
        }
    }

    /// The workers in key order, with where their ranges start, as the table says now.
    pub(crate) fn workers(&self) -> Result<Vec<Range<C>>, ServiceError> {
        Ok(self.router.ranges()?)
    }

    /// Destroy every worker (and what its context owns) and the table.
    pub(crate) fn destroy(&self) -> Result<(), ServiceError>
    where
        C: Context,
    {
        for (_, w) in self.workers()? {
            // A worker lost with its node has nothing left to destroy.
            let ctx = match w.run_ref((), |w: &Worker<C>, ()| w.ctx.clone()) {
                Ok(c) => Some(c),
                Err(CallError::ProcletGone(_)) => None,
                Err(e) if node_lost(&e) => None,
                Err(e) => return Err(e.into()),
            };
            match w.destroy() {
                Ok(()) | Err(CallError::ProcletGone(_)) => {}
                Err(e) if node_lost(&e) => {}
                Err(e) => return Err(e.into()),
            }
            if let Some(c) = ctx {
                c.release()?;
            }
        }
        self.router.map().destroy()?;
        Ok(())
    }
}

/// A worker's place: where its range starts, its id and the node it runs on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The first routing key it serves.
    pub lo: u64,
    pub id: ProcletId,
    pub node: Option<NodeId>,
}

// ----- the scaler ----------------------------------------------------------------------

/// The scaler's own view: the authoritative table (it is the only writer), what it
/// measured last window, and the trigger that decides splits and merges.
struct ScalerState<C: ProcletState> {
    /// The table as of the scaler's latest change, kept in step with the table proclet.
    table: Replica<u64, Proclet<Worker<C>>>,
    /// Per worker (by id): cpu ns, calls and the worker's clock at the last reading, and
    /// the (load, calls) measured then.
    last: std::collections::HashMap<ProcletId, (u64, u64, u64, (f64, u64))>,
    /// Splits and merges by CPU used (cooldowns and the pairs' moving averages inside).
    trigger: Box<dyn Trigger<Load = f64> + Send>,
    /// Every worker's context (by id): a worker's context never changes while it is in
    /// the table, and a worker lost with its node cannot be asked for it.
    ctxs: HashMap<ProcletId, C>,
    /// The last failure to replace a lost worker (logged once, not every window).
    heal_error: Option<String>,
}

impl<C: ProcletState> ScalerState<C> {
    /// The ranges now, in key order.
    fn ranges(&self) -> Vec<Range<C>> {
        self.table.table().to_vec()
    }
}

impl ScaleConfig {
    /// The CPU-used trigger these settings describe, for workers whose handlers run at
    /// once (`serial` false) or take turns on a pair's state (`serial` true: split by
    /// the share of time the state was busy).
    fn trigger(&self, serial: bool) -> CpuLoad {
        let split_above = if serial {
            self.split_busy
        } else {
            self.split_above
        };
        CpuLoad::new(
            split_above,
            self.merge_below,
            self.merge_after,
            self.cooldown,
        )
    }

    fn limits(&self) -> Limits {
        Limits {
            min_ranges: self.min_proclets,
            max_ranges: self.max_proclets,
        }
    }
}

/// Shared between a service's handle and its scaler thread.
pub(crate) struct Scaler<C: ProcletState> {
    pool: Pool<C>,
    /// The service's name (the `service` label of its metrics).
    name: String,
    /// How operators see the service (`"service NAME"`) in events and proclet groups.
    label: String,
    /// Rung by callers that found a worker's node gone.
    bell: Arc<Bell>,
    config: ScaleConfig,
    state: Mutex<ScalerState<C>>,
    timeline: Mutex<Timeline>,
    started: Instant,
    stop: AtomicBool,
}

impl<C: ProcletState> Scaler<C> {
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        BELLS.lock().remove(&self.pool.router.map().id());
        self.bell.ring();
    }

    /// Look at the workers now (a caller in this process found a node gone).
    pub(crate) fn wake(&self) {
        self.bell.ring();
    }
}

impl<C: ProcletState> Drop for Scaler<C> {
    fn drop(&mut self) {
        BELLS.lock().remove(&self.pool.router.map().id());
    }
}

impl<C: Context> Scaler<C> {
    /// A scaler for `pool` (whose table it takes over) and its thread.
    pub(crate) fn start(
        pool: Pool<C>,
        config: ScaleConfig,
        name: String,
    ) -> Result<(Arc<Scaler<C>>, std::thread::JoinHandle<()>), ServiceError> {
        let mut table = Replica::new();
        let update = pool
            .router
            .map()
            .run_ref(0u64, |t: &WorkerLog<C>, from: u64| t.since(from))
            .map_err(ServiceError::from)?;
        table.catch_up(0, update);
        let mut ctxs = HashMap::new();
        for (_, w) in table.table().to_vec() {
            let ctx = w.run_ref((), |w: &Worker<C>, ()| w.ctx.clone())?;
            ctxs.insert(w.id(), ctx);
        }
        let trigger = Box::new(config.trigger(C::SERIAL));
        let bell = Arc::new(Bell::default());
        BELLS.lock().insert(pool.router.map().id(), bell.clone());
        let s = Arc::new(Scaler {
            label: format!("service {name}"),
            name,
            bell,
            pool,
            config,
            state: Mutex::new(ScalerState {
                table,
                last: Default::default(),
                trigger,
                ctxs,
                heal_error: None,
            }),
            timeline: Mutex::new(Timeline::default()),
            started: Instant::now(),
            stop: AtomicBool::new(false),
        });
        let me = s.clone();
        let cx = granule_runtime::thread_context();
        let h = std::thread::Builder::new()
            .name("granule-scaler".into())
            .spawn(move || {
                cx.enter();
                me.run();
            })
            .map_err(|e| ServiceError::Http(format!("cannot start the scaler thread: {e}")))?;
        Ok((s, h))
    }

    fn run(&self) {
        let mut next = Instant::now() + self.config.window;
        while !self.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            let rung = next > now && self.bell.wait(next - now);
            next += self.config.window;
            // Fell behind (a split takes longer than a window), or woken early: the next
            // window starts now.
            if rung || next < Instant::now() {
                next = Instant::now() + self.config.window;
            }
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            match self.tick() {
                Ok(()) => {}
                Err(ServiceError::Call(CallError::NoCluster)) => break,
                Err(e) => tracing::debug!("service scaler: {e}"),
            }
        }
    }

    pub(crate) fn timeline(&self) -> Timeline {
        self.timeline.lock().clone()
    }

    /// Read every worker's load (telling it the table version), replace the workers lost
    /// with their nodes, else split or merge as the trigger decides (one action per
    /// window).
    fn tick(&self) -> Result<(), ServiceError> {
        let mut st = self.state.lock();
        let ranges = st.ranges();
        let (loads, suspects) = self.measure(&mut st, &ranges)?;
        let calls: u64 = loads.iter().map(|l| l.1).sum();
        let loads: Vec<f64> = loads.into_iter().map(|l| l.0).collect();
        {
            let t = self.started.elapsed().as_secs_f64();
            let mut tl = self.timeline.lock();
            if tl.samples.len() >= MAX_SAMPLES {
                tl.samples.drain(..MAX_SAMPLES / 2);
            }
            tl.samples.push(Sample {
                t,
                proclets: ranges.len(),
                loads: loads.clone(),
                calls,
            });
        }
        if !suspects.is_empty() {
            // Healing is not scaling: it runs with `auto` off too. This window's readings
            // are not to be trusted (an unreadable worker reads as idle): no split or
            // merge on them.
            for i in suspects {
                let (lo, old) = &ranges[i];
                match self.heal_at(&mut st, *lo, old) {
                    Ok(_) => st.heal_error = None,
                    Err(ServiceError::Call(CallError::NoCluster)) => {
                        return Err(CallError::NoCluster.into())
                    }
                    Err(e) => {
                        let e = e.to_string();
                        if st.heal_error.as_ref() != Some(&e) {
                            tracing::warn!(
                                service = %self.name,
                                "a compute proclet lost with its node could not be replaced yet (retrying every window): {e}"
                            );
                            st.heal_error = Some(e);
                        }
                    }
                }
            }
            return Ok(());
        }
        if !self.config.auto {
            return Ok(());
        }
        let reading: Vec<Reading<f64>> = ranges
            .iter()
            .zip(&loads)
            .map(|((_, w), &load)| Reading { id: w.id().0, load })
            .collect();
        let Some(decision) = st.trigger.decide(&reading, self.config.limits()) else {
            return Ok(());
        };
        match decision.action {
            Action::Split(i) => {
                if self.split_at(&mut st, i)? {
                    self.record(true, st.table.table().len(), decision.load);
                }
            }
            Action::Merge(i) => {
                if self.merge_at(&mut st, i)? {
                    self.record(false, st.table.table().len(), decision.load);
                }
            }
        }
        Ok(())
    }

    fn record(&self, split: bool, proclets: usize, load: f64) {
        let t = self.started.elapsed().as_secs_f64();
        self.timeline.lock().events.push(ScaleEvent {
            t,
            split,
            proclets,
            load,
        });
    }

    /// Each worker's (load, calls) over the window since the last reading, and the
    /// workers suspected lost (by index): unreachable, or flagged by a call that found
    /// their context's proclet unreachable.
    #[allow(clippy::type_complexity)]
    fn measure(
        &self,
        st: &mut ScalerState<C>,
        ranges: &[Range<C>],
    ) -> Result<(Vec<(f64, u64)>, Vec<usize>), ServiceError> {
        let version = st.table.version();
        let reads = ranges.iter().map(|(_, w)| {
            w.run_ref_async(version, |w: &Worker<C>, v: u64| {
                w.meter.version.store(v, Ordering::Relaxed);
                (
                    w.meter.cpu_ns.load(Ordering::Relaxed),
                    w.meter.calls.load(Ordering::Relaxed),
                    mono_ns(),
                    w.meter.ctx_lost.swap(false, Ordering::Relaxed),
                )
            })
        });
        let got = granule_runtime::block_on(futures::future::join_all(reads));
        let mut out = Vec::with_capacity(got.len());
        let mut suspects = Vec::new();
        for (i, ((_, w), r)) in ranges.iter().zip(got).enumerate() {
            let (cpu, calls, at) = match r {
                Ok((cpu, calls, at, ctx_lost)) => {
                    if ctx_lost {
                        suspects.push(i);
                    }
                    (cpu, calls, at)
                }
                Err(CallError::NoCluster) => return Err(CallError::NoCluster.into()),
                Err(e) => {
                    if node_lost(&e) {
                        suspects.push(i);
                    }
                    tracing::debug!(worker = %w.id(), "reading a service worker's load: {e}");
                    out.push((0.0, 0));
                    continue;
                }
            };
            // A worker seen for the first time, or moved (its counters and clock restart),
            // counts from now on.
            let (c0, n0, t0, prev) = match st.last.get(&w.id()) {
                Some(&(c0, n0, t0, prev)) if c0 <= cpu && n0 <= calls && t0 < at => {
                    (c0, n0, t0, prev)
                }
                _ => {
                    st.last.insert(w.id(), (cpu, calls, at, (0.0, 0)));
                    out.push((0.0, 0));
                    continue;
                }
            };
            // Two readings closer than a window on the worker's clock (the first one
            // waited in a busy node's queue): a handler that straddles the boundary
            // would weigh too much. Keep the baseline, report the last load.
            let wall = at - t0;
            if (wall as f64) < self.config.window.as_nanos() as f64 * 0.9 {
                out.push((prev.0, 0));
                continue;
            }
            let now = ((cpu - c0) as f64 / wall as f64, calls - n0);
            st.last.insert(w.id(), (cpu, calls, at, now));
            out.push(now);
        }
        Ok((out, suspects))
    }

    /// Replace the worker `old` serving the range from `lo` if the controller declared
    /// its node (or its context's) dead: a new worker where the controller places
    /// compute, with the old context if it survived, else a new one ([`Context::renew`]:
    /// a stateful pair's clients start again empty, which is logged and counted). Returns
    /// whether it replaced it (not when the worker was only slow, or its node is not
    /// declared dead yet: the next window looks again).
    fn heal_at(
        &self,
        st: &mut ScalerState<C>,
        lo: Option<u64>,
        old: &Proclet<Worker<C>>,
    ) -> Result<bool, ServiceError> {
        let worker_lost = dead_node(old.location());
        let ctx = match st.ctxs.get(&old.id()) {
            Some(c) => c.clone(),
            None => old.run_ref((), |w: &Worker<C>, ()| w.ctx.clone())?,
        };
        let ctx_lost = ctx.lost();
        if worker_lost.is_none() && ctx_lost.is_none() {
            return Ok(false);
        }
        let start = first_key(&lo);
        let hi = end_key(st.table.table(), &lo);
        // Not in the table yet: no call reaches it before its context is its own.
        let w = Proclet::builder(Kind::Compute)
            .group(self.label.clone())
            .create(ctx.clone(), |c: C| Worker::new(c))?;
        let node = w.location().ok();
        let ctx = match ctx_lost {
            None => ctx,
            Some(_) => {
                let fresh = match ctx.renew(start, hi, node) {
                    Ok(f) => f,
                    Err(e) => {
                        let _ = w.destroy();
                        return Err(e);
                    }
                };
                if let Err(e) = w.run(fresh.clone(), |w: &mut Worker<C>, c: C| w.ctx = c) {
                    let _ = w.destroy();
                    let _ = fresh.release();
                    return Err(e.into());
                }
                fresh
            }
        };
        if let Err(e) = self.publish(
            st,
            Change::Set {
                lo,
                target: w.clone(),
            },
        ) {
            let _ = w.destroy();
            if ctx_lost.is_some() {
                let _ = ctx.release();
            }
            return Err(e);
        }
        st.ctxs.remove(&old.id());
        st.ctxs.insert(w.id(), ctx);
        st.last.remove(&old.id());
        if worker_lost.is_none() {
            // The old worker lives on (only its context was lost): retire it (handlers in
            // flight finish; later calls are turned away and catch up with the table).
            let v = st.table.version();
            let _ = old.run(v, |w: &mut Worker<C>, v: u64| {
                w.meter.version.store(v, Ordering::Relaxed);
                w.meter.retired.store(true, Ordering::Release);
            });
        }
        // The controller forgets it (a lost worker's destroy may fail: nothing is left).
        let _ = old.destroy();
        let range = format!("{start:#018x}..{hi:#x}");
        let lost_on = worker_lost.or(ctx_lost);
        let on = node.map_or_else(|| "?".into(), |n| n.to_string());
        tracing::warn!(
            service = %self.name,
            "compute proclet {} (key range {range}) was lost with node {}; {} on node {on} serves the range now",
            old.id(),
            lost_on.map_or_else(|| "?".into(), |n| n.to_string()),
            w.id(),
        );
        granule_telemetry::install();
        metrics::counter!("granule_service_proclets_replaced_total", "service" => self.name.clone())
            .increment(1);
        if let Some(n) = ctx_lost {
            tracing::warn!(
                service = %self.name,
                "the state of the clients in key range {range} was lost with node {n}: they start again empty (services do not replicate state)"
            );
            metrics::counter!("granule_service_shards_lost_total", "service" => self.name.clone())
                .increment(1);
        }
        Ok(true)
    }

    /// Split worker `i`'s range in halves; the upper half goes to a new worker placed by
    /// the controller (compute: the node with the most idle cores), with its share of
    /// the context (a stateful pair's upper clients, in a memory proclet on the new
    /// worker's node). Returns whether it split (a range of one key cannot).
    fn split_at(&self, st: &mut ScalerState<C>, i: usize) -> Result<bool, ServiceError> {
        let Some((lo, old)) = st.ranges().into_iter().nth(i) else {
            return Ok(false);
        };
        let start = first_key(&lo);
        let hi = end_key(st.table.table(), &lo);
        let mid = (start as u128 + (hi - start as u128) / 2) as u64;
        if mid == start {
            return Ok(false);
        }
        let ctx = old.run_ref((), |w: &Worker<C>, ()| w.ctx.clone())?;
        // Not in the table yet: no call reaches it before its context is its own.
        let w = Proclet::builder(Kind::Compute)
            .group(self.label.clone())
            .create(ctx.clone(), |c: C| Worker::new(c))?;
        let own = match ctx.split(mid, w.location().ok()) {
            Ok(own) => own,
            Err(e) => {
                let _ = w.destroy();
                return Err(e);
            }
        };
        let new_ctx = own.clone().unwrap_or_else(|| ctx.clone());
        if let Some(own) = own {
            if let Err(e) = w.run(own.clone(), |w: &mut Worker<C>, c: C| w.ctx = c) {
                // Give the upper keys back to the old worker's context.
                let _ = w.destroy();
                ctx.merge(&own)?;
                own.release()?;
                return Err(e.into());
            }
        }
        self.publish(
            st,
            Change::Set {
                lo: Some(mid),
                target: w.clone(),
            },
        )?;
        st.ctxs.insert(w.id(), new_ctx);
        st.trigger.done(Done::Split {
            old: old.id().0,
            new: w.id().0,
        });
        granule_runtime::telemetry::record_split(
            "service",
            self.label.clone(),
            format!("{} split off {}", old.id(), w.id()),
        );
        Ok(true)
    }

    /// Merge worker `i + 1`'s range into worker `i`'s: the table first, then the right
    /// worker retires (handlers in flight finish; later calls are turned away and come
    /// back to the left one) and is destroyed.
    fn merge_at(&self, st: &mut ScalerState<C>, i: usize) -> Result<bool, ServiceError> {
        let ranges = st.ranges();
        let (Some((_, left)), Some((right_lo, right))) = (ranges.get(i), ranges.get(i + 1)) else {
            return Ok(false);
        };
        self.publish(st, Change::Remove { lo: *right_lo })?;
        // The left worker learns the version at once (its callers re-read the table).
        let v = st.table.version();
        let _ = left.run_ref(v, |w: &Worker<C>, v: u64| {
            w.meter.version.store(v, Ordering::Relaxed)
        });
        let right_ctx = match right.run(v, |w: &mut Worker<C>, v: u64| {
            w.meter.version.store(v, Ordering::Relaxed);
            w.meter.retired.store(true, Ordering::Release);
            w.ctx.clone()
        }) {
            Ok(c) => Some(c),
            Err(CallError::ProcletGone(_)) => None,
            Err(e) => return Err(e.into()),
        };
        // No handler of the right worker runs any more: its context's keys move left.
        if let Some(rc) = &right_ctx {
            let left_ctx = left.run_ref((), |w: &Worker<C>, ()| w.ctx.clone())?;
            left_ctx.merge(rc)?;
        }
        match right.destroy() {
            Ok(()) | Err(CallError::ProcletGone(_)) => {}
            Err(e) => return Err(e.into()),
        }
        if let Some(rc) = right_ctx {
            rc.release()?;
        }
        st.trigger.done(Done::Merge {
            left: left.id().0,
            right: right.id().0,
        });
        st.last.remove(&right.id());
        st.ctxs.remove(&right.id());
        granule_runtime::telemetry::record_merge(
            "service",
            self.label.clone(),
            format!("{} into {}", right.id(), left.id()),
        );
        Ok(true)
    }

    /// Record `change` in the table proclet and bring the scaler's copy along (from the
    /// proclet's answer, so the two cannot drift apart).
    fn publish(
        &self,
        st: &mut ScalerState<C>,
        change: Change<u64, Proclet<Worker<C>>>,
    ) -> Result<(), ServiceError> {
        let from = st.table.version();
        let update = self.pool.router.map().run(
            (change, from),
            |t: &mut WorkerLog<C>, (change, from): (Change<u64, Proclet<Worker<C>>>, u64)| {
                t.apply(change);
                t.since(from)
            },
        )?;
        st.table.catch_up(from, update);
        Ok(())
    }

    /// Split a worker now, whatever its load: the one with the widest range. Returns
    /// whether it did (a test hook, and for operators).
    pub(crate) fn split_now(&self) -> Result<bool, ServiceError> {
        let mut st = self.state.lock();
        let ranges = st.ranges();
        if ranges.len() >= self.config.max_proclets {
            return Ok(false);
        }
        let widest = (0..ranges.len()).max_by_key(|&i| {
            let lo = &ranges[i].0;
            end_key(st.table.table(), lo) - first_key(lo) as u128
        });
        let Some(i) = widest else { return Ok(false) };
        let did = self.split_at(&mut st, i)?;
        if did {
            self.record(true, st.table.table().len(), 0.0);
        }
        Ok(did)
    }

    /// Merge two neighbouring workers now, whatever their load (the narrowest pair).
    /// Returns whether it did.
    pub(crate) fn merge_now(&self) -> Result<bool, ServiceError> {
        let mut st = self.state.lock();
        let ranges = st.ranges();
        let n = ranges.len();
        if n < 2 {
            return Ok(false);
        }
        let narrowest = (0..n - 1)
            .min_by_key(|&i| {
                end_key(st.table.table(), &ranges[i + 1].0) - first_key(&ranges[i].0) as u128
            })
            .unwrap_or(0);
        let did = self.merge_at(&mut st, narrowest)?;
        if did {
            self.record(false, st.table.table().len(), 0.0);
        }
        Ok(did)
    }

    /// The worker serving `key` per the scaler's (authoritative) table.
    pub(crate) fn worker_for(&self, key: u64) -> Option<Proclet<Worker<C>>> {
        self.state
            .lock()
            .table
            .table()
            .lookup(&key)
            .map(|(_, w)| w.clone())
    }

    /// The workers now, in key order, with their nodes.
    pub(crate) fn workers(&self) -> Vec<WorkerInfo> {
        let ranges = self.state.lock().ranges();
        ranges
            .into_iter()
            .map(|(lo, w)| WorkerInfo {
                lo: first_key(&lo),
                id: w.id(),
                node: w.location().ok(),
            })
            .collect()
    }

    /// The workers now with their contexts, in key order, read while no split or merge
    /// can run.
    pub(crate) fn contexts(&self) -> Result<Vec<(WorkerInfo, C)>, ServiceError> {
        let st = self.state.lock();
        let ranges = st.ranges();
        let mut out = Vec::with_capacity(ranges.len());
        for (lo, w) in &ranges {
            let ctx = w.run_ref((), |w: &Worker<C>, ()| w.ctx.clone())?;
            let info = WorkerInfo {
                lo: first_key(lo),
                id: w.id(),
                node: w.location().ok(),
            };
            out.push((info, ctx));
        }
        Ok(out)
    }

    /// Destroy the pool's workers and table (the scaler must be stopped first).
    pub(crate) fn destroy(&self) -> Result<(), ServiceError> {
        let _st = self.state.lock();
        self.pool.destroy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_config_is_the_cpu_trigger_and_serial_pairs_split_by_busy_share() {
        let c = ScaleConfig::default();
        let parallel = c.trigger(false);
        assert!(parallel.should_split(1.01) && !parallel.should_split(0.95));
        let serial = c.trigger(true);
        assert!(serial.should_split(0.95) && !serial.should_split(0.85));
        assert!(parallel.may_merge(0.2, 0.3) && !parallel.may_merge(0.3, 0.3));
        assert_eq!(
            c.limits(),
            Limits {
                min_ranges: 1,
                max_ranges: 64
            }
        );
    }

    #[test]
    fn only_the_controllers_word_makes_a_node_dead() {
        let down = CallError::NodeUnreachable {
            node: NodeId(4),
            reason: "the controller declared it dead".into(),
        };
        assert!(node_lost(&down));
        assert_eq!(dead_node(Err(down)), Some(NodeId(4)));
        assert_eq!(dead_node(Ok(NodeId(4))), None);
        let gone = CallError::ProcletGone(ProcletId(9));
        assert!(!node_lost(&gone));
        assert_eq!(dead_node(Err(gone)), None);
        assert!(!node_lost(&CallError::Timeout(Duration::from_secs(1))));
    }

    #[test]
    fn a_rung_bell_wakes_its_scaler_once_and_only_its_own() {
        let b = Bell::default();
        // Not rung: the wait times out.
        assert!(!b.wait(Duration::from_millis(1)));
        // Rung before the wait (the caller was faster): the wait returns at once, once.
        b.ring();
        let t = Instant::now();
        assert!(b.wait(Duration::from_secs(10)));
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(!b.wait(Duration::from_millis(1)));
        // Rung by table id, from another thread, while waiting.
        let b = Arc::new(Bell::default());
        let table = ProcletId(u64::MAX - 7);
        BELLS.lock().insert(table, b.clone());
        let ringer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            ring(ProcletId(u64::MAX - 8)); // another service's table: not ours
            ring(table);
        });
        assert!(b.wait(Duration::from_secs(10)));
        ringer.join().expect("ringer");
        BELLS.lock().remove(&table);
    }

    #[test]
    fn ranges_start_at_routing_key_zero_and_end_past_the_last_key() {
        let t: RangeTable<u64, u8> = [(None, 0), (Some(1 << 63), 1)].into_iter().collect();
        assert_eq!(first_key(&None), 0);
        assert_eq!(end_key(&t, &None), 1 << 63);
        assert_eq!(end_key(&t, &Some(1 << 63)), u64::MAX as u128 + 1);
    }
}
