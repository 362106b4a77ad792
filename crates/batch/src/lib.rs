//! Batch computing over sharded inputs: `for_all`, `map`, `filter`, `flat_map` and
//! `reduce` over a sealed [`ShardedVec`], run by *compute proclets* that each work
//! through an index range of the input.
//!
//! This crate owns the operators, the compute proclets' work loop (`worker`), the job's
//! coordinator (`coordinator`), the sinks that take a job's output from its workers
//! (`sink`), the scaling policies ([`policy`]) and the per-node idle core probe
//! (`probe`). It does not own the data (`granule-sharded`) or placement and
//! migration (`granule-runtime` and the controller).
//!
//! A job starts with one compute proclet over the whole input. Every policy interval
//! (2 ms by default) the policy may grow the job, splitting the largest remaining range
//! into a new compute proclet on a node with idle cores, or shrink it. With the default
//! [`Greedy`] policy a worker whose core turns busy with other work (its thread waited to run more than 40 % of the last
//! 10 ms) stops and hands its range back, and the job grows back onto the node
//! when its core is idle again. A worker that finishes early takes half of the largest
//! remaining range (straggler mitigation). Workers fetch the input's elements from
//! wherever its shards live, one chunk ahead of the computation, so they run where the
//! cores are, not where the data is. A node that dies mid-job costs only the items its
//! workers had not reported: they are computed again elsewhere; every item's result is
//! counted exactly once.
//!
//! Closures capture nothing (they are shipped as code): pass what they need in `arg`.
//!
//! **Sinks.** `map`, `flat_map` and `filter` return their output as a new vector, which
//! passes through the job's driver. [`map_into`], [`flat_map_into`] and
//! [`reduce_by_key_into`] instead write it from the workers straight into a
//! [`ShardedVec`] (appended, in input order) or a [`ShardedMap`] (inserted, or merged per
//! key), in batches of one call per target shard; the driver gets a [`SinkSummary`] of
//! counts. Exactly once, even when workers are lost: each work call's output is *staged*
//! in the target tagged with the call, and only the calls the coordinator accepted (one
//! per input range) are committed when the job ends (module `sink`). A reduce-by-key
//! reduces each call's items by key on its worker, and each key is merged into the map
//! once, at the commit.
//!
//! ```no_run
//! // Applications write `use granule::batch;` and `granule::sharded::ShardedVec`.
//! use granule_batch as batch;
//! use granule_sharded::ShardedVec;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cluster = granule_runtime::Cluster::start()?;
//! let v: ShardedVec<u64> = ShardedVec::new()?;
//! v.extend((0..100_000).collect())?;
//! v.seal()?;
//! let squares = batch::map(&v, (), |_: &(), x: &u64| x * x)?;
//! let sum = batch::reduce(&squares, (), |_: &(), acc: &mut u64, x: &u64| *acc += x, 0, |a: &mut u64, b| *a += b)?;
//! let evens = batch::filter(&v, 2u64, |m: &u64, x: &u64| x % m == 0)?;
//! println!("{sum} {}", evens.len()?);
//! cluster.shutdown();
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod coordinator;
mod ledger;
pub mod policy;
mod probe;
mod sink;
mod worker;

pub use policy::{Fixed, Greedy, MinimizeQueue, NodeView, ScalingPolicy, Target, View};
pub use sink::{Sink, SinkSummary};

use coordinator::Settings;
use granule_runtime::{CallError, NodeId, Wire};
use granule_sharded::{Element, MapKey, MapValue, ShardError, ShardedMap, ShardedVec};
use ledger::Outputs;
use parking_lot::Mutex;
use sink::Put;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use worker::WorkError;

/// What can go wrong with a batch job.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// Reading the input or writing the output failed.
    #[error("sharded data: {0}")]
    Data(#[from] ShardError),
    /// A call failed in a way no retry can fix (the closure panicked, code could not be
    /// shipped, the cluster is gone).
    #[error(transparent)]
    Call(#[from] CallError),
    /// A worker reported an error (reading its input).
    #[error("a worker failed: {0}")]
    Worker(String),
    /// No node can host compute proclets (a job's workers run on node processes other
    /// than the one running the job's coordinator).
    #[error("no node to run compute proclets on (workers run on node processes other than the job's own)")]
    NoNodes,
    /// The input must be sealed (its elements must not move between shards meanwhile).
    #[error("the input is not sealed: seal it before running a job over it")]
    NotSealed,
}

/// Why the job's worker set changed (see [`JobLog`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// A worker started on the node.
    Grew,
    /// A worker stopped because its core was busy with other work.
    Contended,
    /// A worker stopped because the policy shrank the job.
    Asked,
    /// A worker had nothing left to do.
    Done,
    /// A worker was lost (its node died) or could not be created; its range is
    /// computed again.
    Lost,
}

/// One change of a job's worker set.
#[derive(Clone, Debug)]
pub struct JobEvent {
    pub at: Instant,
    pub node: NodeId,
    pub what: Trigger,
    /// The job's workers on that node after the change.
    pub workers_on_node: usize,
    /// All the job's workers after the change.
    pub workers: usize,
    /// The worker's compute proclet (`None` if it was never created). A stopped
    /// worker's proclet is destroyed right after its event.
    pub proclet: Option<granule_runtime::ProcletId>,
}

/// A record of a job's worker set over time, for timelines and tests. Pass one to
/// [`Batch::log`] and read it during or after the job.
#[derive(Default, Debug)]
pub struct JobLog {
    events: Mutex<Vec<JobEvent>>,
    calls: Mutex<CallTotals>,
}

/// What the workers' calls added up to over a job.
#[derive(Default, Debug, Clone, Copy)]
pub struct CallTotals {
    /// Work calls answered.
    pub calls: u64,
    /// Items they reported.
    pub items: u64,
    /// CPU seconds of the workers' threads inside the calls.
    pub cpu_s: f64,
    /// Wall seconds the calls ran (inside the workers).
    pub wall_s: f64,
    /// Calls that ended because the runtime was moving their worker to another node
    /// (the next call follows it there).
    pub moved: u64,
    /// Calls that ended because their worker's core was busy with other work
    /// ([`Greedy`] only); each retired its worker ([`Trigger::Contended`]).
    pub contended: u64,
}

impl JobLog {
    pub fn new() -> Arc<JobLog> {
        Arc::new(JobLog::default())
    }

    /// Every event so far, in order.
    pub fn events(&self) -> Vec<JobEvent> {
        self.events.lock().clone()
    }

    pub(crate) fn push(&self, e: JobEvent) {
        self.events.lock().push(e);
    }

    /// Totals of the workers' calls so far.
    pub fn calls(&self) -> CallTotals {
        *self.calls.lock()
    }

    pub(crate) fn add_call(&self, items: u64, cpu_s: f64, wall_s: f64, stop: worker::Stop) {
        let mut c = self.calls.lock();
        c.calls += 1;
        c.items += items;
        c.cpu_s += cpu_s;
        c.wall_s += wall_s;
        match stop {
            worker::Stop::Moving => c.moved += 1,
            worker::Stop::Contended => c.contended += 1,
            _ => {}
        }
    }
}

/// A job's options: its scaling policy and knobs. `Batch::new()` is the default
/// ([`Greedy`], 2 ms policy interval).
pub struct Batch {
    policy: Box<dyn ScalingPolicy>,
    settings: Settings,
    log: Option<Arc<JobLog>>,
}

impl Default for Batch {
    fn default() -> Self {
        Batch::new()
    }
}

impl Batch {
    /// Greedy scaling, default knobs.
    pub fn new() -> Batch {
        Batch {
            policy: Box::new(Greedy::default()),
            settings: Settings::default(),
            log: None,
        }
    }

    /// Use this scaling policy.
    pub fn policy(mut self, p: impl ScalingPolicy + 'static) -> Batch {
        self.policy = Box::new(p);
        self
    }

    /// How often the policy decides (default 2 ms).
    pub fn interval(mut self, d: Duration) -> Batch {
        self.settings.interval = d.max(Duration::from_micros(100));
        self
    }

    /// How long one work call runs before it reports (default 200 ms; a new call starts
    /// its contention window afresh, so shorter budgets slow the reaction to a busy core): bounds the work a
    /// lost node costs and how stale the coordinator's view of progress gets.
    pub fn budget(mut self, d: Duration) -> Batch {
        self.settings.budget = d.max(Duration::from_micros(100));
        self
    }

    /// When a worker counts its core as contended (Greedy): its thread waited to run
    /// more than `1 - min_share` of the last `window`, at two readings a millisecond
    /// apart (defaults 0.6 and 10 ms).
    pub fn contention(mut self, window: Duration, min_share: f64) -> Batch {
        self.settings.window = window.max(Duration::from_millis(1));
        self.settings.min_share = min_share.clamp(0.0, 1.0);
        self
    }

    /// Work a worker fetches at a time, measured in its items' compute time (default
    /// 8 ms): the next chunk is fetched while this one is computed.
    pub fn chunk(mut self, d: Duration) -> Batch {
        self.settings.chunk = d.max(Duration::from_micros(10));
        self
    }

    /// Smallest range a steal leaves or takes, in items (default 1).
    pub fn min_split(mut self, items: u64) -> Batch {
        self.settings.min_steal = items.max(1);
        self
    }

    /// Record the job's worker changes here.
    pub fn log(mut self, log: Arc<JobLog>) -> Batch {
        self.log = Some(log);
        self
    }

    fn start<T, A, O, F, W>(
        mut self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
        kernel: W,
    ) -> Result<(u64, Outputs<O>), BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        O: Wire,
        F: Copy + Send + Sync + 'static,
        W: Fn(
                &worker::Worker<T, A>,
                worker::WorkReq,
                &F,
            ) -> Result<worker::WorkReply<O>, WorkError>
            + Copy
            + Send
            + Sync
            + 'static,
    {
        let len = sealed_len(input)?;
        let (out, shelves) = self.run_over(input, vec![(0, len)], false, &arg, f, kernel);
        shelves.destroy();
        let out = out?;
        check_cover(&out, len)?;
        Ok((len, out))
    }

    /// Run the job over `ranges` of `input` (a first run covers it all; later ones
    /// compute again what a lost node took along): the outputs by range, and the shelves
    /// made (when `shelved`), whatever the outcome.
    #[allow(clippy::too_many_arguments)]
    fn run_over<T, A, O, F, W>(
        &mut self,
        input: &ShardedVec<T>,
        ranges: Vec<(u64, u64)>,
        shelved: bool,
        arg: &A,
        f: F,
        kernel: W,
    ) -> (Result<Outputs<O>, BatchError>, sink::Shelves)
    where
        T: Element,
        A: Wire + Clone + Sync,
        O: Wire,
        F: Copy + Send + Sync + 'static,
        W: Fn(
                &worker::Worker<T, A>,
                worker::WorkReq,
                &F,
            ) -> Result<worker::WorkReply<O>, WorkError>
            + Copy
            + Send
            + Sync
            + 'static,
    {
        let settings = self.settings.clone();
        let log = self.log.clone();
        let policy: &mut dyn ScalingPolicy = &mut *self.policy;
        // The coordinator sleeps between events and policy ticks; spinning before each
        // sleep (block_on's default, for callers awaiting a reply) would take CPU from
        // the job's own workers whenever the calling process shares cores with nodes.
        let spun = granule_runtime::set_spin(false);
        let out = granule_runtime::block_on(coordinator::run(
            input.clone(),
            ranges,
            shelved,
            arg.clone(),
            f,
            kernel,
            settings,
            policy,
            log,
        ));
        granule_runtime::set_spin(spun);
        out
    }

    /// Run `f(&arg, item)` for every item of the sealed `input`.
    pub fn for_all<T, A, F>(self, input: &ShardedVec<T>, arg: A, f: F) -> Result<(), BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        F: Fn(&A, &T) + Copy + Send + Sync + 'static,
    {
        self.start(input, arg, f, worker::for_all_kernel::<T, A, F>)
            .map(|_| ())
    }

    /// `f(&arg, item)` of every item, in the input's order, as a new sealed vector.
    pub fn map<T, A, U, F>(
        self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
    ) -> Result<ShardedVec<U>, BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        U: Element,
        F: Fn(&A, &T) -> U + Copy + Send + Sync + 'static,
    {
        let (_, out) = self.start(input, arg, f, worker::map_kernel::<T, A, U, F>)?;
        collect(out)
    }

    /// Every item's `f(&arg, item)` (zero or more values), concatenated in the input's
    /// order, as a new sealed vector.
    pub fn flat_map<T, A, U, F>(
        self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
    ) -> Result<ShardedVec<U>, BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        U: Element,
        F: Fn(&A, &T) -> Vec<U> + Copy + Send + Sync + 'static,
    {
        let (_, out) = self.start(input, arg, f, worker::flat_map_kernel::<T, A, U, F>)?;
        collect(out)
    }

    /// The items for which `f(&arg, item)` holds, in the input's order, as a new sealed
    /// vector.
    pub fn filter<T, A, F>(
        self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
    ) -> Result<ShardedVec<T>, BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        F: Fn(&A, &T) -> bool + Copy + Send + Sync + 'static,
    {
        let (_, out) = self.start(input, arg, f, worker::filter_kernel::<T, A, F>)?;
        collect(out)
    }

    /// Fold every item into an accumulator: each worker folds its ranges with
    /// `f(&arg, &mut acc, item)` starting from a copy of `init`, and the partial results
    /// are joined with `combine(&mut left, right)` in the input's order. `init` must be
    /// neutral for `combine` (0 for a sum, an empty map for counts), as each range
    /// starts from it; the input's order is kept, so `combine` need not commute.
    pub fn reduce<T, A, Acc, F, C>(
        self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
        init: Acc,
        combine: C,
    ) -> Result<Acc, BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        Acc: Wire + Clone + Sync,
        F: Fn(&A, &mut Acc, &T) + Copy + Send + Sync + 'static,
        C: Fn(&mut Acc, Acc),
    {
        let (_, out) = self.start(
            input,
            (arg, init.clone()),
            f,
            worker::reduce_kernel::<T, A, Acc, F>,
        )?;
        let mut parts = out.into_values().map(|(_, acc)| acc);
        let Some(mut acc) = parts.next() else {
            return Ok(init);
        };
        for p in parts {
            combine(&mut acc, p);
        }
        Ok(acc)
    }
}

impl Batch {
    /// Write `f(&arg, item)` for every item into `sink`, from the workers: a
    /// [`ShardedVec`] gets the outputs appended in the input's order; a [`ShardedMap`]
    /// gets every `(key, value)` output inserted (of outputs with the same key, the one
    /// from the latest item in input order wins, and it replaces what the map held).
    /// The output never travels to the caller: each worker stages the output of each of
    /// its work calls in batches (one call per target shard), and once every input
    /// range is accepted the output is committed, exactly once however many workers
    /// were lost and ranges computed again (see [`Sink`]). Returns counts only.
    ///
    /// The target must not be sealed. Readers see none of the job's output before the
    /// commit; a map commits shard by shard, so a reader during the commit may see it in
    /// some shards and not yet in others. If the job fails, nothing is committed; if the
    /// commit itself fails (a node holding the target's shards died), the error says so
    /// and the target may hold part of the output.
    ///
    /// ```no_run
    /// use granule_batch as batch;
    /// use granule_sharded::{ShardedMap, ShardedVec};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let cluster = granule_runtime::Cluster::start()?;
    /// let v: ShardedVec<u64> = ShardedVec::new()?;
    /// v.extend((0..1000).collect())?;
    /// v.seal()?;
    /// // Squares into a map from each number to its square.
    /// let squares: ShardedMap<u64, u64> = ShardedMap::new()?;
    /// let done = batch::Batch::new().map_into(&v, (), |_: &(), x: &u64| (*x, x * x), &squares)?;
    /// assert_eq!((done.items, done.written), (1000, 1000));
    /// assert_eq!(squares.get(&12)?, Some(144));
    /// // Appended to an existing vector, in the input's order.
    /// let log: ShardedVec<String> = ShardedVec::new()?;
    /// batch::map_into(&v, (), |_: &(), x: &u64| format!("item {x}"), &log)?;
    /// assert_eq!(log.get(3)?, Some("item 3".to_string()));
    /// # cluster.shutdown();
    /// # Ok(()) }
    /// ```
    pub fn map_into<T, A, U, F, S>(
        self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
        sink: &S,
    ) -> Result<SinkSummary, BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        U: Wire,
        S: Sink<U>,
        F: Fn(&A, &T) -> U + Copy + Send + Sync + 'static,
    {
        self.into_sink(
            input,
            arg,
            f,
            sink,
            worker::map_into_kernel::<T, A, U, S, F>,
        )
    }

    /// [`Batch::map_into`] for a closure with any number of outputs per item.
    ///
    /// ```no_run
    /// use granule_batch as batch;
    /// use granule_sharded::ShardedVec;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let cluster = granule_runtime::Cluster::start()?;
    /// let lines: ShardedVec<String> = ShardedVec::new()?;
    /// lines.extend(vec!["a b".into(), "".into(), "c".into()])?;
    /// lines.seal()?;
    /// let words: ShardedVec<String> = ShardedVec::new()?;
    /// let done = batch::flat_map_into(
    ///     &lines,
    ///     (),
    ///     |_: &(), l: &String| l.split_whitespace().map(String::from).collect(),
    ///     &words,
    /// )?;
    /// assert_eq!(done.written, 3);
    /// assert_eq!(words.read_range(0, 3)?, vec!["a", "b", "c"]);
    /// # cluster.shutdown();
    /// # Ok(()) }
    /// ```
    pub fn flat_map_into<T, A, U, F, S>(
        self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
        sink: &S,
    ) -> Result<SinkSummary, BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        U: Wire,
        S: Sink<U>,
        F: Fn(&A, &T) -> Vec<U> + Copy + Send + Sync + 'static,
    {
        self.into_sink(
            input,
            arg,
            f,
            sink,
            worker::flat_map_into_kernel::<T, A, U, S, F>,
        )
    }

    /// Group `f(&arg, item)`'s `(key, value)` outputs by key and merge each group into
    /// `target`: values of one key are combined with `merge(&mut acc, value)` in the
    /// input's order (so `merge` need not commute), and the result is merged into the
    /// key's entry the same way (or inserted when the key is absent), once per key.
    ///
    /// Each worker reduces the items of a work call by key fully and stages one value per
    /// key in the target's shards; when the job is done each shard folds the accepted
    /// calls' values into its entries in one call. A range computed twice (its worker
    /// lost) is merged once, and a repeated commit merges nothing, so the result is
    /// exact. Readers see none of the job's output before the commit; see
    /// [`Batch::map_into`] for what a failure leaves.
    ///
    /// ```no_run
    /// use granule_batch as batch;
    /// use granule_sharded::{ShardedMap, ShardedVec};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let cluster = granule_runtime::Cluster::start()?;
    /// // An inverted index: word -> the documents it appears in, in document order.
    /// let docs: ShardedVec<(u64, String)> = ShardedVec::new()?;
    /// docs.extend(vec![(1, "a b".into()), (2, "b c".into())])?;
    /// docs.seal()?;
    /// let index: ShardedMap<String, Vec<u64>> = ShardedMap::new()?;
    /// let done = batch::reduce_by_key_into(
    ///     &docs,
    ///     (),
    ///     |_: &(), (id, text): &(u64, String)| {
    ///         text.split_whitespace().map(|w| (w.to_string(), vec![*id])).collect()
    ///     },
    ///     |ids: &mut Vec<u64>, more: Vec<u64>| ids.extend(more),
    ///     &index,
    /// )?;
    /// assert_eq!(done.written, 3);
    /// assert_eq!(index.get(&"b".to_string())?, Some(vec![1, 2]));
    /// # cluster.shutdown();
    /// # Ok(()) }
    /// ```
    pub fn reduce_by_key_into<T, A, K, V, F, M>(
        self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
        merge: M,
        target: &ShardedMap<K, V>,
    ) -> Result<SinkSummary, BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        K: MapKey,
        V: MapValue + Clone,
        F: Fn(&A, &T) -> Vec<(K, V)> + Copy + Send + Sync + 'static,
        M: Fn(&mut V, V) + Copy + Send + Sync + 'static,
    {
        let job = sink::new_job_id();
        let run = self.start(
            input,
            (arg, target.clone(), job),
            (f, merge),
            worker::reduce_by_key_kernel::<T, A, K, V, F, M>,
        );
        let (items, out) = match run {
            Ok(r) => r,
            Err(e) => {
                if let Err(d) = target.discard_staged(job) {
                    tracing::warn!("dropping a failed job's staged output: {d}");
                }
                return Err(e);
            }
        };
        let accepted = accepted_in_order(&out);
        let ids = accepted.iter().map(|(_, p)| p.call).collect();
        let written = target.commit_staged(job, ids, merge)?;
        Ok(SinkSummary {
            items,
            produced: accepted.iter().map(|(_, p)| p.items).sum(),
            written,
            recomputed: 0,
        })
    }

    fn into_sink<T, A, U, S, F, W>(
        mut self,
        input: &ShardedVec<T>,
        arg: A,
        f: F,
        sink: &S,
        kernel: W,
    ) -> Result<SinkSummary, BatchError>
    where
        T: Element,
        A: Wire + Clone + Sync,
        S: Sink<U>,
        F: Copy + Send + Sync + 'static,
        W: Fn(
                &worker::Worker<T, (A, S::Stage, u64)>,
                worker::WorkReq,
                &F,
            ) -> Result<worker::WorkReply<Put>, WorkError>
            + Copy
            + Send
            + Sync
            + 'static,
    {
        let len = sealed_len(input)?;
        let job = sink::new_job_id();
        let stage = sink.open()?;
        let home = if S::SHELVED {
            let home = sink.home()?.or_else(granule_runtime::here);
            Some(home.ok_or(BatchError::NoNodes)?)
        } else {
            None
        };
        let arg = (arg, stage.clone(), job);
        let mut shelves = sink::Shelves::default();
        let mut out: Outputs<Put> = BTreeMap::new();
        let mut todo = vec![(0, len)];
        let mut recomputed = 0;
        let mut rounds = 0;
        let result = loop {
            let (more, made) = self.run_over(input, todo, S::SHELVED, &arg, f, kernel);
            shelves.extend(made);
            match more {
                Ok(more) => out.extend(more),
                Err(e) => break Err(e),
            }
            // Shelved output is gathered on the target's node first; what a node took
            // along before it could be gathered is computed again (rounds bounded: a
            // cluster losing a node per round fails).
            let lost = match home {
                Some(home) => match shelves.gather(&accepted_in_order(&out), home) {
                    Ok(l) => l,
                    Err(e) => break Err(e),
                },
                None => Vec::new(),
            };
            if lost.is_empty() {
                break Ok(());
            }
            rounds += 1;
            if rounds > MAX_RECOMPUTE_ROUNDS {
                break Err(BatchError::Worker(format!(
                    "kept output was lost {rounds} times over (nodes keep dying): giving up"
                )));
            }
            todo = lost
                .iter()
                .filter_map(|s| out.remove(s).map(|(e, _)| (*s, e)))
                .collect();
            recomputed += todo.iter().map(|(s, e)| e - s).sum::<u64>();
            tracing::info!(
                "{} ranges of kept output were lost with their node: computing them again",
                todo.len()
            );
        };
        let committed = result.and_then(|()| {
            check_cover(&out, len)?;
            let accepted = accepted_in_order(&out);
            let written = sink.close(&stage, job, &accepted, &shelves)?;
            Ok(SinkSummary {
                items: len,
                produced: accepted.iter().map(|(_, p)| p.items).sum(),
                written,
                recomputed,
            })
        });
        if committed.is_err() {
            sink.abort(&stage, job);
        }
        shelves.destroy();
        committed
    }
}

/// How many times a sink job computes again output lost with a node before it gives up.
const MAX_RECOMPUTE_ROUNDS: usize = 8;

/// The length of a sealed input (jobs run over sealed inputs only).
fn sealed_len<T: Element>(input: &ShardedVec<T>) -> Result<u64, BatchError> {
    if !input.sharder().is_sealed()? {
        return Err(BatchError::NotSealed);
    }
    Ok(input.len()?)
}

/// The accepted calls' reports, in input order, with their first input index.
fn accepted_in_order(out: &Outputs<Put>) -> Vec<(u64, Put)> {
    out.iter().map(|(s, (_, p))| (*s, *p)).collect()
}

/// The replies must cover `0..len` exactly once, in order: anything else is a bug in
/// the coordinator, reported rather than returned as a wrong result.
fn check_cover<O>(out: &Outputs<O>, len: u64) -> Result<(), BatchError> {
    let mut at = 0;
    for (&s, (e, _)) in out {
        if s != at || *e <= s {
            return Err(BatchError::Worker(format!(
                "internal: results cover ..{at} then {s}..{e}"
            )));
        }
        at = *e;
    }
    if at != len {
        return Err(BatchError::Worker(format!(
            "internal: results cover 0..{at} of 0..{len}"
        )));
    }
    Ok(())
}

/// Write outputs, in order, into a new sealed vector.
fn collect<U: Element>(out: Outputs<Vec<U>>) -> Result<ShardedVec<U>, BatchError> {
    let v = ShardedVec::new()?;
    let mut batch: Vec<U> = Vec::new();
    for (_, (_, part)) in out {
        batch.extend(part);
        if batch.len() >= 4096 {
            v.extend(std::mem::take(&mut batch))?;
        }
    }
    if !batch.is_empty() {
        v.extend(batch)?;
    }
    v.seal()?;
    Ok(v)
}

/// [`Batch::for_all`] with the default options.
pub fn for_all<T, A, F>(input: &ShardedVec<T>, arg: A, f: F) -> Result<(), BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    F: Fn(&A, &T) + Copy + Send + Sync + 'static,
{
    Batch::new().for_all(input, arg, f)
}

/// [`Batch::map`] with the default options.
pub fn map<T, A, U, F>(input: &ShardedVec<T>, arg: A, f: F) -> Result<ShardedVec<U>, BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    U: Element,
    F: Fn(&A, &T) -> U + Copy + Send + Sync + 'static,
{
    Batch::new().map(input, arg, f)
}

/// [`Batch::flat_map`] with the default options.
pub fn flat_map<T, A, U, F>(
    input: &ShardedVec<T>,
    arg: A,
    f: F,
) -> Result<ShardedVec<U>, BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    U: Element,
    F: Fn(&A, &T) -> Vec<U> + Copy + Send + Sync + 'static,
{
    Batch::new().flat_map(input, arg, f)
}

/// [`Batch::filter`] with the default options.
pub fn filter<T, A, F>(input: &ShardedVec<T>, arg: A, f: F) -> Result<ShardedVec<T>, BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    F: Fn(&A, &T) -> bool + Copy + Send + Sync + 'static,
{
    Batch::new().filter(input, arg, f)
}

/// [`Batch::map_into`] with the default options.
pub fn map_into<T, A, U, F, S>(
    input: &ShardedVec<T>,
    arg: A,
    f: F,
    sink: &S,
) -> Result<SinkSummary, BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    U: Wire,
    S: Sink<U>,
    F: Fn(&A, &T) -> U + Copy + Send + Sync + 'static,
{
    Batch::new().map_into(input, arg, f, sink)
}

/// [`Batch::flat_map_into`] with the default options.
pub fn flat_map_into<T, A, U, F, S>(
    input: &ShardedVec<T>,
    arg: A,
    f: F,
    sink: &S,
) -> Result<SinkSummary, BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    U: Wire,
    S: Sink<U>,
    F: Fn(&A, &T) -> Vec<U> + Copy + Send + Sync + 'static,
{
    Batch::new().flat_map_into(input, arg, f, sink)
}

/// [`Batch::reduce_by_key_into`] with the default options.
pub fn reduce_by_key_into<T, A, K, V, F, M>(
    input: &ShardedVec<T>,
    arg: A,
    f: F,
    merge: M,
    target: &ShardedMap<K, V>,
) -> Result<SinkSummary, BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    K: MapKey,
    V: MapValue + Clone,
    F: Fn(&A, &T) -> Vec<(K, V)> + Copy + Send + Sync + 'static,
    M: Fn(&mut V, V) + Copy + Send + Sync + 'static,
{
    Batch::new().reduce_by_key_into(input, arg, f, merge, target)
}

/// [`Batch::reduce`] with the default options.
pub fn reduce<T, A, Acc, F, C>(
    input: &ShardedVec<T>,
    arg: A,
    f: F,
    init: Acc,
    combine: C,
) -> Result<Acc, BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    Acc: Wire + Clone + Sync,
    F: Fn(&A, &mut Acc, &T) + Copy + Send + Sync + 'static,
    C: Fn(&mut Acc, Acc),
{
    Batch::new().reduce(input, arg, f, init, combine)
}
