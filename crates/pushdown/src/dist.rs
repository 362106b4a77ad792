//! Tables spread over memory proclets, and queries on them run pulled, pushed, or as the
//! cost rule says: the I/O half of pushdown (the rule itself is [`crate::rule`], pure).
//!
//! A [`DistTable`] is a [`ShardedVec`] of [`RowGroup`]s: each shard a hybrid memory
//! proclet holding a run of row groups, sealed once loaded (so shards neither split nor
//! merge under a query, though they may migrate). The driver keeps a small catalog of the
//! row groups' sizes, so the rule knows each shard's bytes without asking.
//!
//! [`Executor::run`] runs a [`Query`]: its build side (if it joins), then its scan stage.
//! For each stage and each shard it runs either
//! - **pull**: one shared call per row group returns the stage's columns as [`Blob`]s
//!   (sent from the shard's memory, received as views of the reply; no copies in user
//!   space), `window` calls in flight, and the caller runs [`Stage::run`] on each as it
//!   arrives; or
//! - **push**: one pushed call per shard runs [`Stage::run`] over the shard's row groups
//!   on the data node's pushdown pool (bounded, CPU-capped, with a memory budget that a
//!   join table's build is charged to) and returns the merged partial with what it
//!   measured: bytes read, CPU time, the pool's figures.
//!
//! A word count's map side does not return its pairs: they are shuffled into a
//! [`Shuffle`] (`ShardedPartitions` by word), by the pushed call itself from the data
//! node, or by the caller for what it pulled; the reduce then sums each partition.
//!
//! Both kinds run at once (pushed calls and pulled fetches overlap), partials merge, and
//! what was measured updates the operator's [`Figures`] for the next decision. With no
//! figures yet for an operator, the executor first *calibrates*: it pushes one row group
//! and pulls another, and plans the rest with what that showed. [`Explain`] records, per
//! operator, the choice, the figures and the estimates behind it.
//!
//! Before the rule plans (and before a join's probe, forced or not), the executor asks
//! each node's pool how busy it is and what a pushed call may reserve there
//! (`granule_runtime::pushdown::load`, one ordinary read per node, answered on a worker
//! thread even while every pool thread is taken). A pool held by others' calls is a
//! rule input ([`NodeView::wait`]); a join's table is checked against a pushed call's
//! budget and the caller's build memory ([`Executor::caller_build_memory`]) before
//! anything is shipped, and decides which way each shard may run. Under the rule, a push
//! the node refuses anyway (over budget, queue full, timed out) is pulled instead.

use crate::explain::{Explain, OpExplain, ShuffleExplain};
use crate::rule::{self, Caller, Choice, Figures, Mode, NodeView, ShardWork};
use crate::Output;
use crate::{
    build_join, finalize, Columns, OpError, Partial, Query, QueryResult, RowGroup, Schema,
};
use crate::{Stage, TableName};
use futures::StreamExt;
use granule_runtime::pushdown::PoolLoad;
use granule_runtime::{Blob, CallError, PushOpts};
use granule_sharded::{Bounds, ShardError, ShardedPartitions, ShardedVec, VecPart};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Why a distributed query failed.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A shard or the structure underneath failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A call failed (timeout, panic in pushed code, over budget, node gone...).
    #[error(transparent)]
    Call(#[from] CallError),
    /// The operator itself failed (a bad stage, a join table over its budget...).
    #[error("operator: {0}")]
    Op(#[from] OpError),
    /// The operator failed on a data node: in its pushed call, or reading a row group
    /// for the caller to compute on (worded by the path that ran).
    #[error("{}", remote_message(*at, why, *mode))]
    Remote {
        /// The shard's first row group (pushed), or the row group read (pulled).
        at: u64,
        /// What the data node said.
        why: String,
        /// The path that ran: pushed, or pulled.
        mode: Mode,
    },
    /// A plan forced to push a join's probe to a node whose pushed calls' budget cannot
    /// hold its table: refused before anything was shipped.
    #[error(
        "the join table needs {need} bytes, over the {budget}-byte budget of a pushed call \
         on node {node} (PushOpts::memory, else pushdown.call_memory); nothing was shipped: \
         run it pulled or by the cost rule, or raise the budget"
    )]
    PushBudget {
        /// Bytes the join table takes.
        need: u64,
        /// A pushed call's budget there.
        budget: u64,
        /// The node.
        node: u64,
    },
    /// The caller must build a join's table for shards it pulls and its build memory
    /// cannot hold it (and pushing them is forced off or refused too).
    #[error("{}", caller_budget_message(*need, *budget, push))]
    CallerBudget {
        /// Bytes the join table takes.
        need: u64,
        /// The caller's build memory (`pushdown.caller_build_memory`).
        budget: u64,
        /// Why those shards could not be pushed instead: the node and its pushed calls'
        /// budget (`None`: the plan was forced to pull).
        push: Option<(u64, u64)>,
    },
    /// Sending a word count's pairs to its shuffle partitions failed at the caller.
    #[error("shuffle: {0}")]
    Shuffle(String),
    /// The query names a table that was not given.
    #[error("no table {0} was loaded")]
    NoTable(String),
}

fn remote_message(at: u64, why: &str, mode: Mode) -> String {
    match mode {
        Mode::Push => format!("pushed operator on shard at row group {at}: {why}"),
        Mode::Pull => format!("pulled operator, reading row group {at} from its node: {why}"),
    }
}

fn caller_budget_message(need: u64, budget: u64, push: &Option<(u64, u64)>) -> String {
    let head = format!(
        "the join table needs {need} bytes at the caller, over its build memory of {budget} \
         bytes (pushdown.caller_build_memory)"
    );
    match push {
        None => format!("{head}; the plan was forced to pull: run it pushed or by the cost rule, or raise the build memory"),
        Some((node, b)) => format!(
            "{head}, and over the {b}-byte budget of a pushed call on node {node} \
             (PushOpts::memory, else pushdown.call_memory): it fits neither way; raise one"
        ),
    }
}

/// Sizes of one stored row group, kept at the driver.
#[derive(Clone, Debug)]
struct GroupInfo {
    col_bytes: Vec<u64>,
}

/// A table whose row groups live in memory proclets across the cluster.
pub struct DistTable {
    /// Which table.
    pub name: TableName,
    /// Its schema.
    pub schema: Schema,
    groups: ShardedVec<RowGroup>,
    catalog: Vec<GroupInfo>,
    rows: u64,
}

/// Shard bounds for tables: shards of 16–64 MiB (a few row groups each).
pub const TABLE_BOUNDS: (u64, u64) = (16 << 20, 64 << 20);

impl DistTable {
    /// Store `groups` (checked against `schema`) in a new sharded vector with `bounds`,
    /// then seal it and make its shards hybrid (memory proclets that also run pushed code).
    pub fn load(
        name: TableName,
        schema: Schema,
        groups: impl IntoIterator<Item = RowGroup>,
        bounds: Bounds,
    ) -> Result<DistTable, DistError> {
        let v: ShardedVec<RowGroup> = ShardedVec::with_bounds(bounds)?;
        let mut catalog = Vec::new();
        let mut rows = 0;
        let loaded = (|| {
            for rg in groups {
                rg.check(&schema)?;
                rows += rg.rows as u64;
                catalog.push(GroupInfo {
                    col_bytes: rg.cols.iter().map(|b| b.len() as u64).collect(),
                });
                v.push(rg)?;
            }
            v.seal()?;
            v.hybridize()?;
            Ok::<(), DistError>(())
        })();
        if let Err(e) = loaded {
            let _ = v.destroy();
            return Err(e);
        }
        Ok(DistTable {
            name,
            schema,
            groups: v,
            catalog,
            rows,
        })
    }

    /// Rows stored.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Row groups stored.
    pub fn row_groups(&self) -> u64 {
        self.catalog.len() as u64
    }

    /// Bytes of columns `cols` over row groups `range`.
    pub fn bytes_of(&self, cols: &[usize], range: std::ops::Range<u64>) -> u64 {
        let r = range.start as usize..(range.end as usize).min(self.catalog.len());
        self.catalog[r]
            .iter()
            .map(|g| cols.iter().filter_map(|&c| g.col_bytes.get(c)).sum::<u64>())
            .sum()
    }

    /// The underlying sharded vector.
    pub fn vec(&self) -> &ShardedVec<RowGroup> {
        &self.groups
    }

    /// Fetch columns `cols` of every row group to the caller and drop them, `window`
    /// fetches in flight: how fast pulling moves bytes with no compute at the caller.
    /// Returns the bytes moved and the time taken.
    pub fn stream(&self, cols: &[usize], window: usize) -> Result<(u64, Duration), DistError> {
        self.stream_some(cols, window, u64::MAX)
    }

    /// [`DistTable::stream`] over at most `groups` row groups (taken from every node in
    /// turn).
    pub fn stream_some(
        &self,
        cols: &[usize],
        window: usize,
        groups: u64,
    ) -> Result<(u64, Duration), DistError> {
        let parts = self.groups.parts()?;
        let mut by_node = Vec::new();
        for p in &parts {
            let node = u64::from(p.location()?.0);
            by_node.extend((0..p.len).map(|i| (node, (p, i))));
        }
        let mut by_node = interleave(by_node.into_iter().map(|(n, x)| (n, (n, x))).collect());
        by_node.truncate(usize::try_from(groups).unwrap_or(usize::MAX));
        let start = Instant::now();
        let fetches = by_node
            .into_iter()
            .map(|(_, (p, i))| fetch(p, i, cols.to_vec()));
        let bytes = granule_runtime::block_on(async {
            let mut s = futures::stream::iter(fetches).buffer_unordered(window.max(1));
            let mut bytes = 0u64;
            while let Some(r) = s.next().await {
                let (_, blobs) = r?;
                bytes += blobs.iter().map(|b| b.len() as u64).sum::<u64>();
            }
            Ok::<u64, DistError>(bytes)
        })?;
        Ok((bytes, start.elapsed()))
    }

    /// Free its shards.
    pub fn destroy(self) -> Result<(), DistError> {
        Ok(self.groups.destroy()?)
    }
}

/// Load every table of `local` with `bounds` and spread each one's shards evenly over
/// `nodes` (round robin, moving the ones placed elsewhere): data on the data nodes, none
/// on the caller. Each table's round starts one node further than the last table's, so
/// small tables (a join's build side, often one shard) do not all sit on the first node.
/// What the benchmark, `granule pushdown` and the tests set up.
pub fn load_spread(
    cluster: &granule_runtime::Cluster,
    local: &BTreeMap<TableName, crate::Table>,
    bounds: Bounds,
    nodes: &[granule_runtime::NodeId],
) -> Result<Tables, DistError> {
    let mut tables = Tables::new();
    for (ti, (t, table)) in local.iter().enumerate() {
        let d = DistTable::load(
            *t,
            table.schema.clone(),
            table.groups.iter().cloned(),
            bounds,
        )?;
        if !nodes.is_empty() {
            for (i, (_, s)) in d.vec().sharder().shards()?.into_iter().enumerate() {
                let want = nodes[(ti + i) % nodes.len()];
                if s.location()? != want {
                    cluster.move_proclet(s.id(), want)?;
                }
            }
        }
        tables.insert(*t, d);
    }
    Ok(tables)
}

/// `items` tagged with their node, reordered to take one from each node in turn (keeping
/// each node's order), so pulls keep every data node sending at once.
fn interleave<T>(items: Vec<(u64, T)>) -> Vec<T> {
    let mut queues: BTreeMap<u64, std::collections::VecDeque<T>> = BTreeMap::new();
    for (node, t) in items {
        queues.entry(node).or_default().push_back(t);
    }
    let mut out = Vec::new();
    while !queues.is_empty() {
        queues.retain(|_, q| match q.pop_front() {
            Some(t) => {
                out.push(t);
                true
            }
            None => false,
        });
    }
    out
}

/// Fetch the columns `cols` of row group `i` of `part`.
fn fetch(
    part: &VecPart<RowGroup>,
    i: u64,
    cols: Vec<usize>,
) -> impl std::future::Future<Output = Result<(u32, Vec<Blob>), DistError>> + Send + 'static {
    let f = part.read_async(
        (i, cols),
        |a: &(u64, Vec<usize>),
         _start: u64,
         items: &[RowGroup]|
         -> Result<(u32, Vec<Blob>), String> {
            let rg = items
                .get(a.0 as usize)
                .ok_or_else(|| format!("no row group {} in this shard", a.0))?;
            Ok((rg.rows, rg.project(&a.1).map_err(|e| e.to_string())?))
        },
    );
    let at = part.start + i;
    async move {
        f.await?.map_err(|why| DistError::Remote {
            at,
            why,
            mode: Mode::Pull,
        })
    }
}

/// What a pushed call takes: the stage, the join's build rows, which row groups.
#[derive(Clone, Serialize, Deserialize)]
struct PushArg {
    stage: Stage,
    join: Option<Partial>,
    from: u64,
    to: u64,
    /// A word count's shuffle: the pushed call sends its (word, count) pairs there
    /// itself, straight from the data node, and returns an empty partial.
    shuffle: Option<Shuffle>,
}

/// Where a word count's map side sends its pairs: partitions keyed by word (Teleport's
/// map-shuffle). The reduce reads each partition and sums per word.
pub type Shuffle = ShardedPartitions<String, u64>;

/// Batches of about this many bytes of pairs go to a partition at once.
const SHUFFLE_BATCH: u64 = 256 << 10;

/// Send every (word, count) of a word count's partial to `shuffle`; the pairs sent.
fn send_buckets(shuffle: &Shuffle, p: Partial) -> Result<u64, String> {
    let Partial::Buckets(buckets) = p else {
        return Err("only a word count's buckets can be shuffled".into());
    };
    let mut pusher = shuffle
        .pusher(SHUFFLE_BATCH, 4)
        .map_err(|e| format!("shuffle: {e}"))?;
    let mut n = 0;
    for pair in buckets.into_iter().flatten() {
        pusher.push(pair).map_err(|e| format!("shuffle: {e}"))?;
        n += 1;
    }
    pusher.flush().map_err(|e| format!("shuffle: {e}"))?;
    Ok(n)
}

/// What a pushed call returns: the merged partial and what it measured.
#[derive(Serialize, Deserialize)]
struct PushOut {
    partial: Partial,
    bytes_in: u64,
    cpu: Duration,
    /// Its run time (from its start on the pool thread; not its wait in the queue).
    wall: Duration,
    /// The pool's figures where it ran (`None`: not a pushdown pool thread).
    node: Option<NodeView>,
}

/// Why a pushed call did not return a result.
#[derive(Debug, Serialize, Deserialize)]
enum PushFail {
    /// Its budget refused the join table: the caller may pull the shard instead.
    OverBudget(String),
    /// The operator failed.
    Failed(String),
}

impl From<String> for PushFail {
    fn from(why: String) -> PushFail {
        PushFail::Failed(why)
    }
}

impl PushFail {
    fn why(self) -> String {
        match self {
            PushFail::OverBudget(w) | PushFail::Failed(w) => w,
        }
    }
}

/// The body of a pushed call (runs on the data node's pool).
fn pushed(a: &PushArg, items: &[RowGroup]) -> Result<PushOut, PushFail> {
    let cpu0 = granule_host::proc::thread_cpu_time();
    let wall0 = Instant::now();
    // The join table's memory is charged to this call's budget: a build past it stops
    // with an error instead of growing the node.
    let mut held = Vec::new();
    let mut refused = false;
    let join = match &a.join {
        Some(rows) => {
            let built = build_join(rows, &mut |bytes| {
                granule_runtime::pushdown::reserve(bytes)
                    .map(|r| held.push(r))
                    .inspect_err(|_| refused = true)
            });
            match built {
                Ok(t) => Some(t),
                Err(e) if refused => return Err(PushFail::OverBudget(e.to_string())),
                Err(e) => return Err(PushFail::Failed(e.to_string())),
            }
        }
        None => None,
    };
    let (from, to) = (a.from as usize, (a.to as usize).min(items.len()));
    let mut acc = a.stage.empty();
    let mut bytes_in = 0;
    for rg in items.get(from..to).unwrap_or_default() {
        bytes_in += a.stage.bytes_in(rg);
        let p = a
            .stage
            .run(&Columns::of_group(rg), join.as_ref())
            .map_err(|e| e.to_string())?;
        acc.merge(p).map_err(|e| e.to_string())?;
    }
    if let Some(shuffle) = &a.shuffle {
        // Pre-aggregated over the shard's row groups (a combiner), then sent from here.
        send_buckets(shuffle, std::mem::replace(&mut acc, a.stage.empty()))?;
    }
    let cpu = granule_host::proc::thread_cpu_time().saturating_sub(cpu0);
    // The node's idle CPU as its monitor saw it counts this pool's own work as busy: give
    // back what this call used (its CPU time over its run time) to get what pushed work
    // could have.
    let wall = wall0.elapsed();
    let own = cpu.as_secs_f64() / wall.as_secs_f64().max(1e-9);
    // The queue it sees holds this operator's own calls: how busy the pool is with
    // others' is asked before planning (`Executor::pool_loads`), not taken from here.
    let node = granule_runtime::pushdown::here().map(|f| {
        NodeView::idle(
            f.cpu_cap,
            f.free_cores + own.min(1.0),
            f.threads,
            f.cpu_period.as_secs_f64(),
        )
    });
    Ok(PushOut {
        partial: acc,
        bytes_in,
        cpu,
        wall,
        node,
    })
}

/// One unit of work: row groups `from..to` of a shard.
#[derive(Clone)]
struct Unit {
    part: usize,
    from: u64,
    to: u64,
    node: u64,
    bytes_in: u64,
    /// The only way it may run (a join table too big for one side's memory).
    only: Option<Mode>,
}

/// Runs queries over [`DistTable`]s, remembering per operator what it measured.
pub struct Executor {
    figures: Mutex<BTreeMap<String, Figures>>,
    nodes: Mutex<BTreeMap<u64, NodeView>>,
    /// The network's bandwidth to the caller, bytes/s: one figure for every operator.
    network: Mutex<Option<f64>>,
    /// Pulled fetches in flight.
    pub window: usize,
    /// Options of pushed calls (timeout, memory budget).
    pub push: PushOpts,
    /// The memory the caller may take for a join table it builds for the shards it
    /// pulls (`pushdown.caller_build_memory`), bytes.
    pub caller_build_memory: u64,
    /// The caller's cores for pulled compute (one: the query's thread).
    pub caller_cores: f64,
    /// A round trip's fixed cost, seconds.
    pub call_cost: f64,
    /// When the caller and the data nodes share one machine (an embedded cluster), its
    /// cores (see [`Caller::shared_cores`]).
    pub shared_cores: Option<f64>,
}

impl Default for Executor {
    fn default() -> Self {
        Executor::new()
    }
}

/// The tables a query may read.
pub type Tables = BTreeMap<TableName, DistTable>;

impl Executor {
    /// An executor with nothing measured yet.
    pub fn new() -> Executor {
        Executor {
            figures: Mutex::new(BTreeMap::new()),
            nodes: Mutex::new(BTreeMap::new()),
            network: Mutex::new(None),
            window: 4,
            push: PushOpts::default(),
            caller_build_memory: granule_runtime::config::Pushdown::default().caller_build_memory,
            caller_cores: 1.0,
            call_cost: 100e-6,
            shared_cores: None,
        }
    }

    /// An executor with nothing measured yet, with the caller's limits of `config`
    /// (`pushdown.caller_build_memory`).
    pub fn configured(config: &granule_runtime::Config) -> Executor {
        Executor {
            caller_build_memory: config.pushdown.caller_build_memory,
            ..Executor::new()
        }
    }

    /// Take `figures` as what has been measured about the operator `key` (figures a
    /// past session measured, or a test's): the next plan starts from them.
    pub fn set_figures(&self, key: &str, figures: Figures) {
        lock(&self.figures).insert(key.to_string(), figures);
    }

    /// The network's measured bandwidth to the caller, bytes/s (`None` before the first
    /// query).
    pub fn network(&self) -> Option<f64> {
        *lock(&self.network)
    }

    /// What has been measured about the operator `key` (e.g. `q6 scan`).
    pub fn figures(&self, key: &str) -> Option<Figures> {
        lock(&self.figures).get(key).cloned()
    }

    /// Run `q` over `tables`, each operator as `choice` says; the result and what was
    /// chosen, why, and how long it took.
    pub fn run(
        &self,
        q: &Query,
        tables: &Tables,
        choice: Choice,
    ) -> Result<(QueryResult, Explain), DistError> {
        let table = |t: TableName| {
            tables
                .get(&t)
                .ok_or_else(|| DistError::NoTable(t.name().to_string()))
        };
        // Column numbers against the tables' schemas, before anything runs.
        if let Some(b) = &q.build {
            b.stage.check_columns(&table(b.table)?.schema)?;
        }
        q.stage.check_columns(&table(q.table)?.schema)?;
        let start = Instant::now();
        let mut explain = Explain {
            query: q.name.clone(),
            choice,
            ops: Vec::new(),
            shuffle: None,
            total: Duration::ZERO,
        };
        let join_rows = match &q.build {
            Some(b) => {
                let key = format!("{} build ({})", q.name, b.table.name());
                let (rows, op) = self.scan(&key, &b.stage, table(b.table)?, None, choice, None)?;
                explain.ops.push(op);
                Some(rows)
            }
            None => None,
        };
        let key = format!("{} scan ({})", q.name, q.table.name());
        // A word count shuffles its map side's pairs into partitions by word, and the
        // reduce sums each partition's.
        let shuffle = match q.stage.output {
            Output::WordCount { .. } => Some(Shuffle::batching()?),
            _ => None,
        };
        let scanned = self.scan(
            &key,
            &q.stage,
            table(q.table)?,
            join_rows,
            choice,
            shuffle.as_ref(),
        );
        let reduced = match (&shuffle, scanned) {
            (Some(sh), Ok((_, op))) => reduce(sh).map(|(p, e)| {
                explain.shuffle = Some(e);
                (p, op)
            }),
            (_, r) => r,
        };
        if let Some(sh) = &shuffle {
            if let Err(e) = sh.destroy() {
                tracing::warn!("freeing a word count's shuffle partitions: {e}");
            }
        }
        let (partial, op) = reduced?;
        explain.ops.push(op);
        let result = finalize(q, partial)?;
        explain.total = start.elapsed();
        Ok((result, explain))
    }

    /// Ask each node holding one of `units` how busy its pushdown pool is and what it
    /// admits: one ordinary read per node, all at once. A read runs on a worker thread,
    /// so a pool whose threads are all taken still answers. A node that cannot answer is
    /// left out (its pushed calls say what they find, and a refused one is pulled).
    fn pool_loads(&self, parts: &[VecPart<RowGroup>], units: &[Unit]) -> BTreeMap<u64, PoolLoad> {
        let mut first: BTreeMap<u64, usize> = BTreeMap::new();
        for u in units {
            first.entry(u.node).or_insert(u.part);
        }
        let asks = first.into_iter().map(|(node, i)| {
            let f = parts[i].read_async((), |_: &(), _start: u64, _items: &[RowGroup]| {
                granule_runtime::pushdown::load()
            });
            async move { (node, f.await) }
        });
        let answers = granule_runtime::block_on(futures::future::join_all(asks));
        let mut loads = BTreeMap::new();
        for (node, r) in answers {
            match r {
                Ok(Some(l)) => {
                    loads.insert(node, l);
                }
                Ok(None) => {}
                Err(e) => tracing::debug!("node {node}'s pushdown pool did not say its load: {e}"),
            }
        }
        loads
    }

    /// Run one stage over one table.
    fn scan(
        &self,
        key: &str,
        stage: &Stage,
        table: &DistTable,
        join_rows: Option<Partial>,
        choice: Choice,
        shuffle: Option<&Shuffle>,
    ) -> Result<(Partial, OpExplain), DistError> {
        stage.check()?;
        stage.check_columns(&table.schema)?;
        let started = Instant::now();
        let cols = stage.columns();
        let parts = table.groups.parts()?;
        // The join table's bytes, wherever it is built (a pushed call reserves exactly
        // this of its budget; the caller counts it against its build memory).
        let need = join_rows.as_ref().map_or(0, join_bytes);
        // The caller's own join table, for the row groups it computes: built once, and
        // only if it computes any (a pushed shard builds its own from `join_rows`).
        let join_here = std::cell::OnceCell::new();
        let join = |pulls: bool| -> Result<Option<&crate::JoinTable>, DistError> {
            match (&join_rows, pulls) {
                (Some(rows), true) => {
                    if join_here.get().is_none() {
                        let budget = self.caller_build_memory;
                        let t = build_join(rows, &mut |bytes| {
                            if bytes > budget {
                                Err(format!("{bytes} bytes over the caller's {budget}"))
                            } else {
                                Ok(())
                            }
                        });
                        let t = match t {
                            Ok(t) => t,
                            Err(_) if need > budget => {
                                return Err(DistError::CallerBudget {
                                    need,
                                    budget,
                                    push: None,
                                })
                            }
                            Err(e) => return Err(e.into()),
                        };
                        let _ = join_here.set(t);
                    }
                    Ok(join_here.get())
                }
                _ => Ok(None),
            }
        };
        let arg_bytes = join_rows.as_ref().map_or(0, Partial::bytes);
        let mut units = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let node = u64::from(p.location()?.0);
            units.push(Unit {
                part: i,
                from: 0,
                to: p.len,
                node,
                bytes_in: table.bytes_of(&cols, p.start..p.start + p.len),
                only: None,
            });
        }
        // How busy each node's pool is (for the rule) and what a pushed call may reserve
        // there (for a join): asked before anything is shipped.
        let loads = if choice == Choice::Auto || join_rows.is_some() {
            self.pool_loads(&parts, &units)
        } else {
            BTreeMap::new()
        };
        if join_rows.is_some() {
            self.place_join(&mut units, need, &loads, choice)?;
        }
        let busy = |node: u64| {
            loads
                .get(&node)
                .is_some_and(|l| l.running >= l.threads.max(1) || l.queued > 0)
        };
        let auto = choice == Choice::Auto;
        let mut acc = stage.empty();
        let mut measured = Measured::default();
        let mut calibrated = false;
        let mut fell_back = 0;
        let have = self.figures(key).unwrap_or_default();
        if auto && (have.push_rate.is_none() || have.pull_rate.is_none()) {
            // Nothing known: push one row group and pull another, and plan the rest with
            // what they showed (on a shard that may run either way, on a pool not busy).
            if let Some(u) = units
                .iter_mut()
                .find(|u| u.to - u.from >= 2 && u.only.is_none() && !busy(u.node))
            {
                let part = &parts[u.part];
                let pushed_unit = Unit {
                    to: u.from + 1,
                    ..u.clone()
                };
                let pulled_unit = Unit {
                    from: u.from + 1,
                    to: u.from + 2,
                    ..u.clone()
                };
                u.from += 2;
                u.bytes_in = table.bytes_of(&cols, part.start + u.from..part.start + u.to);
                let (p1, m1, refused) = self.execute(
                    &parts,
                    stage,
                    &cols,
                    &join_rows,
                    join(false)?,
                    vec![(pushed_unit, Mode::Push)],
                    shuffle,
                    true,
                )?;
                let mut refused: Vec<(Unit, Mode)> =
                    refused.into_iter().map(|u| (u, Mode::Pull)).collect();
                fell_back += refused.len();
                refused.push((pulled_unit, Mode::Pull));
                let (p2, m2, _) = self.execute(
                    &parts,
                    stage,
                    &cols,
                    &join_rows,
                    join(true)?,
                    refused,
                    shuffle,
                    false,
                )?;
                for (p, m) in [(p1, m1), (p2, m2)] {
                    acc.merge(p)?;
                    measured.add(&m);
                }
                self.learn(key, &measured);
                calibrated = true;
            }
        }
        units.retain(|u| u.to > u.from);
        if lock(&self.network).is_none() {
            self.probe_network(table, &cols)?;
        }
        let mut figures = self.figures(key).unwrap_or_default();
        figures.bandwidth = *lock(&self.network);
        let mut nodes = lock(&self.nodes).clone();
        // Others' calls on the pools, as the nodes just said: only a busy pool changes
        // the view (an idle one looks as its own pushed calls last reported it).
        for (n, l) in &loads {
            let idle = l.running == 0 && l.queued == 0;
            if idle && !nodes.contains_key(n) {
                continue;
            }
            let v = nodes.entry(*n).or_insert_with(|| {
                NodeView::idle(
                    l.cpu_cap,
                    l.free_cores,
                    l.threads,
                    l.cpu_period.as_secs_f64(),
                )
            });
            v.running = l.running;
            v.queued = l.queued;
            v.busy_for = l.busy_for.as_secs_f64();
        }
        let work: Vec<ShardWork> = units
            .iter()
            .map(|u| ShardWork {
                node: u.node,
                bytes_in: u.bytes_in,
                groups: u.to - u.from,
                only: u.only,
            })
            .collect();
        let caller = Caller {
            cores: self.caller_cores,
            call_cost: self.call_cost,
            push_arg_bytes: arg_bytes,
            shared_cores: self.shared_cores,
        };
        let plan = rule::plan(&work, &nodes, &caller, &figures, choice);
        let run_started = Instant::now();
        let (p, mut m, refused) = self.execute(
            &parts,
            stage,
            &cols,
            &join_rows,
            join(plan.modes.contains(&Mode::Pull))?,
            units.into_iter().zip(plan.modes.iter().copied()).collect(),
            shuffle,
            auto,
        )?;
        acc.merge(p)?;
        let planned_fell_back = !refused.is_empty();
        if planned_fell_back {
            // Pushes the nodes refused (a budget, a full queue, a timeout): pulled now.
            fell_back += refused.len();
            let (p, m2, _) = self.execute(
                &parts,
                stage,
                &cols,
                &join_rows,
                join(true)?,
                refused.into_iter().map(|u| (u, Mode::Pull)).collect(),
                shuffle,
                false,
            )?;
            acc.merge(p)?;
            m.add(&m2);
        }
        let run_time = run_started.elapsed();
        measured.add(&m);
        self.learn(key, &m);
        if !planned_fell_back {
            // A run that fell back is not the plan it was estimated as.
            self.learn_fixes(key, &work, &plan.modes, &nodes, &caller, &figures, &m);
        }
        if auto {
            // Remember the way the rule ran the whole operator (none for a split).
            let one_way = match plan.counts() {
                (_, 0) => Some(Mode::Push),
                (0, _) => Some(Mode::Pull),
                _ => None,
            };
            lock(&self.figures).entry(key.to_string()).or_default().last = one_way;
        }
        let (pushed, pulled) = plan.counts();
        Ok((
            acc,
            OpExplain {
                operator: key.to_string(),
                shards_pushed: pushed,
                shards_pulled: pulled,
                calibrated,
                fell_back,
                bytes_in: measured.pushed_bytes + measured.pulled_bytes,
                plan,
                nodes: nodes.into_iter().collect(),
                planned_part: run_time,
                took: started.elapsed(),
            },
        ))
    }

    /// Where a join's probe of `units` may run, given its table's `need` bytes: pushed
    /// only where a pushed call's budget holds the table, pulled only where the caller's
    /// build memory does. Forced modes that cannot fit, and shards that fit neither way,
    /// are refused here, before anything is shipped.
    fn place_join(
        &self,
        units: &mut [Unit],
        need: u64,
        loads: &BTreeMap<u64, PoolLoad>,
        choice: Choice,
    ) -> Result<(), DistError> {
        let caller = self.caller_build_memory;
        let pull_ok = need <= caller;
        // A pushed call's budget on `node` when it is too small for the table (a node
        // that did not say is taken to fit: it refuses the call if not, and the shard is
        // then pulled).
        let too_small = |node: u64| -> Option<u64> {
            let l = loads.get(&node);
            let budget = self.push.memory.or(l.map(|l| l.call_memory))?;
            let never_runs = l.is_some_and(|l| budget > l.memory);
            (need > budget || never_runs).then_some(budget)
        };
        for u in units.iter_mut() {
            let push_refused = too_small(u.node);
            match (choice, push_refused) {
                (Choice::Force(Mode::Push), Some(budget)) => {
                    return Err(DistError::PushBudget {
                        need,
                        budget,
                        node: u.node,
                    })
                }
                (Choice::Force(Mode::Pull), _) if !pull_ok => {
                    return Err(DistError::CallerBudget {
                        need,
                        budget: caller,
                        push: None,
                    })
                }
                (Choice::Auto, Some(budget)) if !pull_ok => {
                    return Err(DistError::CallerBudget {
                        need,
                        budget: caller,
                        push: Some((u.node, budget)),
                    })
                }
                (Choice::Auto, Some(_)) => u.only = Some(Mode::Pull),
                (Choice::Auto, None) if !pull_ok => u.only = Some(Mode::Push),
                _ => {}
            }
        }
        Ok(())
    }

    /// Run `units` as their modes say, pushed and pulled at once. With `fallback`, a
    /// pushed call the node refuses (the join table over its budget, a full queue, a
    /// budget it never admits, or a timeout) is not an error: its unit comes back, to be
    /// pulled instead. A word count's timed-out call is not given back (it may still
    /// send its pairs).
    #[allow(clippy::too_many_arguments)]
    fn execute(
        &self,
        parts: &[VecPart<RowGroup>],
        stage: &Stage,
        cols: &[usize],
        join_rows: &Option<Partial>,
        join: Option<&crate::JoinTable>,
        units: Vec<(Unit, Mode)>,
        shuffle: Option<&Shuffle>,
        fallback: bool,
    ) -> Result<(Partial, Measured, Vec<Unit>), DistError> {
        let mut push_futs = Vec::new();
        let mut pulls = Vec::new();
        for (u, m) in units {
            let part = &parts[u.part];
            match m {
                Mode::Push => {
                    let arg = PushArg {
                        stage: stage.clone(),
                        join: join_rows.clone(),
                        from: u.from,
                        to: u.to,
                        shuffle: shuffle.cloned(),
                    };
                    let f = part.push_async(
                        self.push,
                        arg,
                        |a: &PushArg, _start: u64, items: &[RowGroup]| pushed(a, items),
                    );
                    let at = part.start + u.from;
                    push_futs.push(async move { (at, u, f.await) });
                }
                Mode::Pull => {
                    for i in u.from..u.to {
                        pulls.push((u.node, (part, i)));
                    }
                }
            }
        }
        let window = self.window.max(1);
        let pulls = interleave(pulls);
        let (acc, mut m, refused) = granule_runtime::block_on(async {
            let any_pushed = !push_futs.is_empty();
            let pushed = async {
                let t0 = Instant::now();
                let r = futures::future::join_all(push_futs).await;
                (r, t0.elapsed())
            };
            let pulled = async {
                let mut acc = stage.empty();
                let mut m = Measured::default();
                let t0 = Instant::now();
                let mut s =
                    futures::stream::iter(pulls.iter().map(|(p, i)| fetch(p, *i, cols.to_vec())))
                        .buffer_unordered(window);
                while let Some(r) = s.next().await {
                    let (rows, blobs) = r?;
                    let c0 = Instant::now();
                    let view = Columns::of_pulled(rows, cols, &blobs)?;
                    acc.merge(stage.run(&view, join)?)?;
                    m.pull_compute += c0.elapsed();
                    m.pulled_bytes += blobs.iter().map(|b| b.len() as u64).sum::<u64>();
                }
                if !pulls.is_empty() {
                    m.pull_wall = t0.elapsed();
                }
                Ok::<_, DistError>((acc, m))
            };
            let ((pushed, push_phase), pulled) = futures::join!(pushed, pulled);
            let (mut acc, mut m) = pulled?;
            let mut refused = Vec::new();
            for (at, unit, r) in pushed {
                let out = match r {
                    Ok(Ok(out)) => out,
                    Ok(Err(PushFail::OverBudget(_))) if fallback => {
                        refused.push(unit);
                        continue;
                    }
                    Err(ShardError::Call(CallError::Refused(_) | CallError::NoCapacity(_)))
                        if fallback =>
                    {
                        refused.push(unit);
                        continue;
                    }
                    Err(ShardError::Call(CallError::Timeout(_)))
                        if fallback && shuffle.is_none() =>
                    {
                        refused.push(unit);
                        continue;
                    }
                    Ok(Err(fail)) => {
                        return Err(DistError::Remote {
                            at,
                            why: fail.why(),
                            mode: Mode::Push,
                        })
                    }
                    Err(e) => return Err(e.into()),
                };
                m.pushed_bytes += out.bytes_in;
                m.push_cpu += out.cpu;
                m.push_wall += out.wall;
                m.push_out += out.partial.bytes();
                if let Some(v) = out.node {
                    m.nodes.insert(unit.node, v);
                }
                acc.merge(out.partial)?;
            }
            if any_pushed && refused.is_empty() {
                m.push_phase = push_phase;
            }
            Ok::<_, DistError>((acc, m, refused))
        })?;
        match shuffle {
            // The caller sends what it computed from pulled row groups (pushed calls sent
            // theirs): part of pulling's cost, so it counts as the caller's work.
            Some(sh) if !pulls.is_empty() => {
                let t0 = Instant::now();
                let empty = stage.empty();
                send_buckets(sh, acc).map_err(DistError::Shuffle)?;
                m.pull_compute += t0.elapsed();
                m.pull_wall += t0.elapsed();
                Ok((empty, m, refused))
            }
            _ => Ok((acc, m, refused)),
        }
    }

    /// Measure the network: stream the columns `cols` of a few row groups of `table`, in
    /// the pulls' own way, and time it (what [`Executor::run`] does before its first
    /// decision; call it again after the network changed).
    pub fn probe_network(&self, table: &DistTable, cols: &[usize]) -> Result<f64, DistError> {
        let per_group = table.bytes_of(cols, 0..1).max(1);
        let groups = (NETWORK_SAMPLE * 4).div_ceil(per_group).max(2);
        let (bytes, took) = table.stream_some(cols, self.window, groups)?;
        let bw = bytes as f64 / took.as_secs_f64().max(1e-9);
        *lock(&self.network) = Some(bw);
        Ok(bw)
    }

    /// Compare the planned part's measured times with what the model (without its
    /// corrections) estimated for its pushed and its pulled shards, and fold the ratios
    /// into the operator's corrections. Call it after [`Executor::learn`] of the same run.
    ///
    /// A figure the plan had to assume (an intensity before the first run that way, a
    /// node not yet seen) is a guess, not the model's error: the estimate compared uses
    /// what this run measured in its place. Otherwise a first pull planned with the
    /// default intensity, several times off, became a correction of the same size that
    /// took a dozen runs to fade, and kept the rule pushing where pulling was twice as
    /// fast.
    #[allow(clippy::too_many_arguments)]
    fn learn_fixes(
        &self,
        key: &str,
        work: &[ShardWork],
        modes: &[Mode],
        nodes: &BTreeMap<u64, NodeView>,
        caller: &Caller,
        figures: &Figures,
        m: &Measured,
    ) {
        let network = *lock(&self.network);
        let mut nodes = nodes.clone();
        for (k, v) in &m.nodes {
            nodes.entry(*k).or_insert_with(|| v.clone());
        }
        let nodes = &nodes;
        let now = self.figures(key).unwrap_or_default();
        let raw = Figures {
            push_fix: None,
            pull_fix: None,
            push_rate: figures.push_rate.or(now.push_rate),
            pull_rate: figures.pull_rate.or(now.pull_rate),
            selectivity: figures.selectivity.or(now.selectivity),
            push_stretch: figures.push_stretch.or(now.push_stretch),
            bandwidth: figures.bandwidth.or(network),
            ..figures.clone()
        };
        let part = |mode: Mode| -> Vec<ShardWork> {
            work.iter()
                .zip(modes)
                .filter(|(_, m)| **m == mode)
                .map(|(w, _)| w.clone())
                .collect()
        };
        let mut all = lock(&self.figures);
        let f = all.entry(key.to_string()).or_default();
        let pushed = part(Mode::Push);
        if !pushed.is_empty() && !m.push_phase.is_zero() {
            let e = rule::estimate(
                &pushed,
                &vec![Mode::Push; pushed.len()],
                nodes,
                caller,
                &raw,
            );
            if e.busiest_node > FIX_MIN_ESTIMATE {
                Figures::observe(&mut f.push_fix, m.push_phase.as_secs_f64() / e.busiest_node);
            }
        }
        let pulled = part(Mode::Pull);
        if !pulled.is_empty() && !m.pull_wall.is_zero() {
            let e = rule::estimate(
                &pulled,
                &vec![Mode::Pull; pulled.len()],
                nodes,
                caller,
                &raw,
            );
            let t = e.caller_compute.max(e.network);
            if t > FIX_MIN_ESTIMATE {
                Figures::observe(&mut f.pull_fix, m.pull_wall.as_secs_f64() / t);
            }
        }
    }

    /// Fold what a run measured into the operator's figures and the nodes' views.
    fn learn(&self, key: &str, m: &Measured) {
        let mut all = lock(&self.figures);
        let f = all.entry(key.to_string()).or_default();
        if m.pushed_bytes > 0 && !m.push_cpu.is_zero() {
            Figures::observe(
                &mut f.push_rate,
                m.pushed_bytes as f64 / m.push_cpu.as_secs_f64(),
            );
            Figures::observe(
                &mut f.selectivity,
                m.push_out as f64 / m.pushed_bytes as f64,
            );
            Figures::observe(
                &mut f.push_stretch,
                m.push_wall.as_secs_f64() / m.push_cpu.as_secs_f64(),
            );
        }
        if m.pulled_bytes > 0 && !m.pull_compute.is_zero() {
            Figures::observe(
                &mut f.pull_rate,
                m.pulled_bytes as f64 / m.pull_compute.as_secs_f64(),
            );
        }
        drop(all);
        // The network's figure moves only with pulls large enough to time, that waited
        // for the network more than for the caller's compute.
        if m.pulled_bytes >= NETWORK_SAMPLE && m.pull_compute < m.pull_wall / 2 {
            Figures::observe(
                &mut lock(&self.network),
                m.pulled_bytes as f64 / m.pull_wall.as_secs_f64(),
            );
        }
        lock(&self.nodes).extend(m.nodes.iter().map(|(k, v)| (*k, v.clone())));
    }
}

/// The bytes of the join table built from `rows` (what a pushed call reserves).
fn join_bytes(rows: &Partial) -> u64 {
    match rows {
        Partial::Rows { cols } => cols
            .first()
            .map_or(0, |k| crate::JoinTable::bytes_for(k.len())),
        _ => 0,
    }
}

/// Estimates shorter than this (seconds) are too noisy to correct the model with.
const FIX_MIN_ESTIMATE: f64 = 1e-3;

/// The reduce of a word count's shuffle: every partition's pairs summed per word, as one
/// bucket of (word, count) in word order.
fn reduce(shuffle: &Shuffle) -> Result<(Partial, ShuffleExplain), DistError> {
    let t0 = Instant::now();
    shuffle.seal()?;
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let parts = shuffle.partitions()?;
    let mut pairs = 0;
    for part in &parts {
        for (w, c) in part.pairs()? {
            pairs += 1;
            *counts.entry(w).or_default() += c;
        }
    }
    let e = ShuffleExplain {
        pairs,
        partitions: parts.len(),
        reduce: t0.elapsed(),
    };
    Ok((Partial::Buckets(vec![counts.into_iter().collect()]), e))
}

/// Bytes a pull must move for its time to say something about the network.
const NETWORK_SAMPLE: u64 = 8 << 20;

/// What one execution measured.
#[derive(Default)]
struct Measured {
    pushed_bytes: u64,
    push_cpu: Duration,
    push_wall: Duration,
    /// From the first pushed call's start at the caller to the last one's answer.
    push_phase: Duration,
    push_out: u64,
    pulled_bytes: u64,
    pull_compute: Duration,
    pull_wall: Duration,
    nodes: BTreeMap<u64, NodeView>,
}

impl Measured {
    fn add(&mut self, o: &Measured) {
        self.pushed_bytes += o.pushed_bytes;
        self.push_cpu += o.push_cpu;
        self.push_wall += o.push_wall;
        self.push_out += o.push_out;
        self.pulled_bytes += o.pulled_bytes;
        self.pull_compute += o.pull_compute;
        self.pull_wall += o.pull_wall;
        self.nodes
            .extend(o.nodes.iter().map(|(k, v)| (*k, v.clone())));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
