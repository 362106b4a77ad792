//! The job's coordinator: one async loop, in the process that started the job, that
//! creates and retires the compute proclets, keeps one work call in flight per worker,
//! hands work to workers that finish early (straggler mitigation: the largest remaining
//! range is split), and every policy interval asks the [`ScalingPolicy`] whether to
//! grow or shrink. Which worker owns which range, and what was reported, is the
//! `ledger`'s: a pure state machine this loop feeds with events and whose actions it
//! carries out (see its module doc for the accounting rule).

use crate::ledger::{Action, Ledger, Outputs, Span, Thief};
use crate::policy::{NodeView, ScalingPolicy, Target, View};
use crate::probe::{self, Probe};
use crate::sink::{self, Shelf, Shelves};
use crate::worker::{self, Watch, WorkError, WorkReply, WorkReq, Worker};
use crate::{BatchError, JobEvent, JobLog, Trigger};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use granule_runtime::{CallError, Kind, NodeId, NodeInfo, Proclet, Wire};
use granule_sharded::{Element, ShardedVec};
use granule_wire::{NodeState, Role};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Knobs of one job (see `Batch`).
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub interval: Duration,
    pub budget: Duration,
    pub chunk: Duration,
    pub window: Duration,
    pub min_share: f64,
    pub min_steal: u64,
    /// Wait this long after growing on a node before probing it again (the new worker's
    /// CPU use must show in the counters first).
    pub settle: Duration,
    pub nodes_refresh: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            interval: crate::policy::DEFAULT_INTERVAL,
            // Long: each call judges contention over a window of its own, which a new
            // call must fill again (a 50 ms budget made one shrink in three ~10 ms late).
            budget: Duration::from_millis(200),
            chunk: Duration::from_millis(8),
            window: Duration::from_millis(10),
            min_share: 0.6,
            min_steal: 1,
            settle: Duration::from_millis(8),
            nodes_refresh: Duration::from_millis(100),
        }
    }
}

type Boxed<E> = Pin<Box<dyn Future<Output = E> + Send>>;

/// A worker's constructor argument: the input, the job's argument, its range, its shelf.
type Made<T, A> = (ShardedVec<T>, A, u64, u64, Option<Proclet<Shelf>>);

enum Ev<S, O> {
    /// A worker's creation ended; with the shelf made for its node, if one was.
    Created(usize, Result<Proclet<S>, CallError>, Option<Proclet<Shelf>>),
    Reply(usize, Result<Result<WorkReply<O>, WorkError>, CallError>),
    Stolen(usize, Thief, Result<Option<(u64, u64)>, CallError>),
    ProbeReady(NodeId, Result<Proclet<Probe>, CallError>),
    /// A probe's answer, with when it was asked.
    Probed(NodeId, Instant, Result<f64, CallError>),
    Nodes(Result<Vec<NodeInfo>, CallError>),
    Nothing,
}

struct Run<'p, T: Element, A, O, F, W> {
    input: ShardedVec<T>,
    arg: A,
    f: F,
    kernel: W,
    cfg: Settings,
    policy: &'p mut dyn ScalingPolicy,
    log: Option<Arc<JobLog>>,
    me: Option<NodeId>,
    started: Instant,
    /// The range bookkeeping (pure; see `ledger`).
    ledger: Ledger<O>,
    /// Each slot's worker proclet, while it has one.
    workers: Vec<Option<Proclet<Worker<T, A>>>>,
    /// Whether workers keep their output on shelves (vector sinks): the shelf of each
    /// node in use, and every shelf made.
    shelved: bool,
    node_shelf: HashMap<NodeId, Proclet<Shelf>>,
    shelves: Shelves,
    nodes: Vec<NodeInfo>,
    nodes_at: Option<Instant>,
    nodes_asked: bool,
    probes: HashMap<NodeId, Proclet<Probe>>,
    probing: HashMap<NodeId, bool>,
    spare: HashMap<NodeId, f64>,
    settled_at: HashMap<NodeId, Instant>,
    pending: FuturesUnordered<Boxed<Ev<Worker<T, A>, O>>>,
    /// Nodes where a worker was just lost or could not be created: left out of
    /// placement until then (the controller declares a dead node only after its failure
    /// timeout, seconds later).
    quarantine: HashMap<NodeId, Instant>,
    /// Since when the job has had no worker and no node to place one on.
    stranded_since: Option<Instant>,
    /// Nodes a worker recently left for contention, not grown onto again before then.
    backoff: HashMap<NodeId, Backoff>,
    /// When a worker last started on each node.
    grew_at: HashMap<NodeId, Instant>,
    /// Whether policy ticks run; off while the policy says nothing can change before
    /// the next event (see [`ScalingPolicy::wants_ticks`]), on again at every event.
    ticking: bool,
}

/// How long a node where a worker was lost is left out of placement.
const QUARANTINE: Duration = Duration::from_millis(500);
/// How long a job waits with no node to run on before it fails.
const STRANDED_LIMIT: Duration = Duration::from_secs(10);

/// After a worker stops because its core is contended, its node is not grown onto (nor
/// probed) for a while: at first `BACKOFF_MIN`, doubled each time a worker grown there
/// stops again within `BACKOFF_RECENT` of starting (the regrowth was a mistake: the
/// core is not really free), up to `BACKOFF_MAX`. A stop long after the last growth
/// starts again from `BACKOFF_MIN`, so an antagonist that leaves is followed within
/// milliseconds; one that stays costs a stop every `BACKOFF_MAX` instead of one every
/// few policy intervals.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
const BACKOFF_RECENT: Duration = Duration::from_millis(250);

/// A node's contention back-off.
#[derive(Clone, Copy, Debug)]
struct Backoff {
    wait: Duration,
    until: Instant,
}

impl Backoff {
    /// The back-off after a contention stop at `now`, given the previous one and when a
    /// worker last started on the node.
    fn after_stop(prev: Option<Backoff>, grew_at: Option<Instant>, now: Instant) -> Backoff {
        let regrew_too_soon =
            grew_at.is_some_and(|g| now.saturating_duration_since(g) < BACKOFF_RECENT);
        let wait = match prev {
            Some(b) if regrew_too_soon => (b.wait * 2).min(BACKOFF_MAX),
            _ => BACKOFF_MIN,
        };
        Backoff {
            wait,
            until: now + wait,
        }
    }
}

/// Run a job over `ranges` of the input to the end: the outputs by range, and the
/// shelves the workers kept output on (when `shelved`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run<T, A, O, F, W>(
    input: ShardedVec<T>,
    ranges: Vec<Span>,
    shelved: bool,
    arg: A,
    f: F,
    kernel: W,
    cfg: Settings,
    policy: &mut dyn ScalingPolicy,
    log: Option<Arc<JobLog>>,
) -> (Result<Outputs<O>, BatchError>, Shelves)
where
    T: Element,
    A: Wire + Clone + Sync,
    O: Wire,
    F: Copy + Send + Sync + 'static,
    W: Fn(&Worker<T, A>, WorkReq, &F) -> Result<WorkReply<O>, WorkError>
        + Copy
        + Send
        + Sync
        + 'static,
{
    let ledger = Ledger::over(ranges, cfg.min_steal);
    let mut r = Run {
        input,
        arg,
        f,
        kernel,
        cfg,
        policy,
        log,
        me: granule_runtime::here(),
        started: Instant::now(),
        ledger,
        workers: Vec::new(),
        shelved,
        node_shelf: HashMap::new(),
        shelves: Shelves::default(),
        nodes: Vec::new(),
        nodes_at: None,
        nodes_asked: false,
        probes: HashMap::new(),
        probing: HashMap::new(),
        spare: HashMap::new(),
        settled_at: HashMap::new(),
        pending: FuturesUnordered::new(),
        quarantine: HashMap::new(),
        stranded_since: None,
        backoff: HashMap::new(),
        grew_at: HashMap::new(),
        ticking: true,
    };
    let out = r.main().await;
    r.cleanup().await;
    let shelves = std::mem::take(&mut r.shelves);
    (out.map(|()| r.ledger.into_outputs()), shelves)
}

impl<T, A, O, F, W> Run<'_, T, A, O, F, W>
where
    T: Element,
    A: Wire + Clone + Sync,
    O: Wire,
    F: Copy + Send + Sync + 'static,
    W: Fn(&Worker<T, A>, WorkReq, &F) -> Result<WorkReply<O>, WorkError>
        + Copy
        + Send
        + Sync
        + 'static,
{
    async fn main(&mut self) -> Result<(), BatchError> {
        if self.ledger.is_done() {
            return Ok(());
        }
        self.nodes = granule_runtime::cluster_nodes_async().await?;
        self.nodes_at = Some(Instant::now());
        let first = self
            .candidates()
            .into_iter()
            .max_by(|a, b| {
                let sa = a.spec.cores - a.usage.cores_busy;
                let sb = b.spec.cores - b.usage.cores_busy;
                sa.partial_cmp(&sb).unwrap_or(std::cmp::Ordering::Equal)
            })
            .map(|n| n.id)
            .ok_or(BatchError::NoNodes)?;
        self.ledger.start(first);
        self.act();
        let mut tick = tokio::time::interval(self.cfg.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.ledger.is_done() {
            // Nothing in flight and no ticks would wait forever: tick.
            let ticking = self.ticking || self.pending.is_empty();
            tokio::select! {
                ev = self.pending.next(), if !self.pending.is_empty() => {
                    if let Some(ev) = ev {
                        self.handle(ev)?;
                    }
                    self.ticking = true;
                }
                _ = tick.tick(), if ticking => self.tick()?,
            }
            self.act();
        }
        Ok(())
    }

    /// Nodes that may host workers: alive node processes other than the one running
    /// this coordinator (a call to a proclet on the caller's own node runs inline when
    /// polled, which would stall the coordinator behind the worker).
    fn candidates(&self) -> Vec<&NodeInfo> {
        self.nodes
            .iter()
            .filter(|n| n.state == NodeState::Alive && n.role == Role::Node)
            .filter(|n| Some(n.id) != self.me)
            .filter(|n| {
                self.quarantine
                    .get(&n.id)
                    .is_none_or(|until| Instant::now() >= *until)
            })
            .collect()
    }

    // ---- carrying out the ledger's actions ----

    fn act(&mut self) {
        for a in self.ledger.take_actions() {
            match a {
                Action::Create { wid, node, range } => self.create(wid, node, range),
                Action::Call { wid, call, assign } => self.call(wid, call, assign),
                Action::Steal { victim, thief } => self.steal(victim, thief),
                Action::AskStop { wid } => {
                    if let Some(p) = self.worker(wid) {
                        let fut = p.run_ref_async((), worker::ask_stop::<T, A>);
                        self.pending.push(Box::pin(async move {
                            let _ = fut.await;
                            Ev::Nothing
                        }));
                    }
                }
                Action::Destroy { wid } => {
                    if let Some(p) = self.workers.get_mut(wid).and_then(Option::take) {
                        // Fire and forget: a worker on a dead node is gone already.
                        let _ = granule_runtime::spawn(async move {
                            let _ = p.destroy_async().await;
                        });
                    }
                }
                Action::Note {
                    wid,
                    node,
                    what,
                    on_node,
                    total,
                } => {
                    let proclet = self.worker(wid).map(|p| p.id());
                    let now = Instant::now();
                    match what {
                        Trigger::Grew => {
                            self.grew_at.insert(node, now);
                        }
                        Trigger::Contended => {
                            let b = Backoff::after_stop(
                                self.backoff.get(&node).copied(),
                                self.grew_at.get(&node).copied(),
                                now,
                            );
                            self.backoff.insert(node, b);
                        }
                        _ => {}
                    }
                    if what != Trigger::Grew {
                        granule_runtime::telemetry::count_scaling("batch", false);
                    }
                    if let Some(log) = &self.log {
                        log.push(JobEvent {
                            at: now,
                            node,
                            what,
                            workers_on_node: on_node,
                            workers: total,
                            proclet,
                        });
                    }
                }
            }
        }
    }

    fn worker(&self, wid: usize) -> Option<Proclet<Worker<T, A>>> {
        self.workers.get(wid).cloned().flatten()
    }

    fn create(&mut self, wid: usize, node: NodeId, range: (u64, u64)) {
        if self.workers.len() <= wid {
            self.workers.resize_with(wid + 1, || None);
        }
        self.settled_at
            .insert(node, Instant::now() + self.cfg.settle);
        // A reading taken before this worker existed says nothing about room for another.
        self.spare.remove(&node);
        let existing = self.node_shelf.get(&node).cloned();
        let shelved = self.shelved;
        let (input, arg) = (self.input.clone(), self.arg.clone());
        self.pending.push(Box::pin(async move {
            // A vector sink's worker keeps its output on its node's shelf: made with the
            // node's first worker.
            let (shelf, made) = match existing {
                Some(s) => (Some(s), None),
                None if shelved => match sink::new_shelf(node).await {
                    Ok(s) => (Some(s.clone()), Some(s)),
                    Err(e) => return Ev::Created(wid, Err(e), None),
                },
                None => (None, None),
            };
            // Its calls are read-only ones that move its cursor (so a steal can run
            // beside its work call): a move must hold them, not serve them from the copy
            // it drops. And the job places its workers itself: a node's CPU pressure
            // policy moving a worker that fills its node's quota would only fight the
            // scaling policy.
            let created = Proclet::builder(Kind::Compute)
                .on(node)
                .mutating_reads()
                .owner_placed()
                .create_async(
                    (input, arg, range.0, range.1, shelf),
                    |(input, arg, lo, hi, shelf): Made<T, A>| {
                        Worker::new(input, arg, (lo, hi), shelf)
                    },
                )
                .await;
            Ev::Created(wid, created, made)
        }));
    }

    fn call(&mut self, wid: usize, call: u64, assign: Option<(u64, u64)>) {
        let req = WorkReq {
            call,
            assign,
            budget_us: self.cfg.budget.as_micros() as u64,
            chunk_us: self.cfg.chunk.as_micros() as u64,
            watch: self.policy.watch_contention().then_some(Watch {
                window_us: self.cfg.window.as_micros() as u64,
                min_share: self.cfg.min_share,
            }),
        };
        let fut = self
            .worker(wid)
            .map(|p| p.run_ref_with_async(req, self.f, self.kernel));
        self.pending.push(Box::pin(async move {
            let r = match fut {
                Some(fut) => fut.await,
                None => Err(CallError::Internal("the worker has no proclet".into())),
            };
            Ev::Reply(wid, r)
        }));
    }

    fn steal(&mut self, victim: usize, thief: Thief) {
        let min = self.cfg.min_steal;
        let fut = self
            .worker(victim)
            .map(|p| p.run_ref_async(min, worker::steal::<T, A>));
        if let Thief::New(node) = thief {
            self.settled_at
                .insert(node, Instant::now() + self.cfg.settle);
            self.spare.remove(&node);
        }
        self.pending.push(Box::pin(async move {
            let r = match fut {
                Some(fut) => fut.await,
                None => Err(CallError::Internal("the worker has no proclet".into())),
            };
            Ev::Stolen(victim, thief, r)
        }));
    }

    // ---- events ----

    fn handle(&mut self, ev: Ev<Worker<T, A>, O>) -> Result<(), BatchError> {
        match ev {
            Ev::Nothing => {}
            Ev::Created(wid, created, made) => {
                if let Some(shelf) = made {
                    self.node_shelf
                        .insert(self.ledger.node_of(wid), shelf.clone());
                    self.shelves.add(shelf);
                }
                self.on_created(wid, created)?;
            }
            Ev::Reply(wid, Ok(Ok(r))) => {
                if let Some(log) = &self.log {
                    log.add_call(r.end - r.start, r.cpu_s, r.wall_s, r.stop);
                }
                self.ledger
                    .replied(wid, r.start, r.end, r.stop, r.out)
                    .map_err(|m| BatchError::Worker(m.0))?;
            }
            Ev::Reply(_, Ok(Err(WorkError::Failed(msg)))) => return Err(BatchError::Worker(msg)),
            Ev::Reply(wid, Ok(Err(WorkError::Lost(msg)))) => {
                // Its output had nowhere to go: the node's shelf is gone. Its next
                // worker there gets a new one; the range is computed again.
                let node = self.ledger.node_of(wid);
                tracing::info!("a worker on {node} could not keep its output ({msg}): recomputed");
                self.node_shelf.remove(&node);
                self.quarantine.insert(node, Instant::now() + QUARANTINE);
                self.ledger.call_failed(wid);
            }
            Ev::Reply(wid, Err(e)) => self.on_call_failed(wid, e)?,
            ev => self.on_other(ev)?,
        }
        Ok(())
    }

    fn on_created(
        &mut self,
        wid: usize,
        created: Result<Proclet<Worker<T, A>>, CallError>,
    ) -> Result<(), BatchError> {
        match created {
            Ok(p) => {
                self.workers[wid] = Some(p);
                self.ledger.created(wid, true);
                // Every worker after the first took part of another's range: a split.
                if wid > 0 {
                    granule_runtime::telemetry::count_scaling("batch", true);
                }
            }
            Err(e) => {
                if fatal(&e) {
                    return Err(BatchError::Call(e));
                }
                let node = self.ledger.node_of(wid);
                tracing::debug!("creating a worker on {node} failed: {e}");
                self.quarantine.insert(node, Instant::now() + QUARANTINE);
                // A shelf there may be gone with the node.
                self.node_shelf.remove(&node);
                self.ledger.created(wid, false);
            }
        }
        Ok(())
    }

    fn on_call_failed(&mut self, wid: usize, e: CallError) -> Result<(), BatchError> {
        if fatal(&e) {
            return Err(BatchError::Call(e));
        }
        let node = self.ledger.node_of(wid);
        let (lo, hi) = self.ledger.range_of(wid);
        tracing::info!("worker on {node} lost ({e}); its range {lo}..{hi} will be recomputed");
        self.quarantine.insert(node, Instant::now() + QUARANTINE);
        self.node_shelf.remove(&node);
        self.ledger.call_failed(wid);
        // Ask the controller again soon: the node may be gone.
        self.nodes_at = None;
        Ok(())
    }

    fn on_other(&mut self, ev: Ev<Worker<T, A>, O>) -> Result<(), BatchError> {
        match ev {
            Ev::Nothing | Ev::Created(..) | Ev::Reply(..) => {}
            Ev::Stolen(victim, thief, r) => {
                let stolen = match r {
                    Ok(r) => r,
                    Err(e) if fatal(&e) => return Err(BatchError::Call(e)),
                    // The steal may have run and its answer been lost: the victim's
                    // worker then finishes early and the ledger recomputes the rest.
                    Err(_) => None,
                };
                self.ledger.stolen(victim, thief, stolen);
            }
            Ev::ProbeReady(node, Ok(p)) => {
                self.probes.insert(node, p);
                self.probing.insert(node, false);
            }
            Ev::ProbeReady(node, Err(e)) => {
                tracing::debug!("cannot place a probe on {node}: {e}");
                self.probing.insert(node, false);
            }
            Ev::Probed(node, asked, r) => {
                self.probing.insert(node, false);
                // A worker placed there since the probe was sent makes its reading stale.
                let grown_since = self
                    .settled_at
                    .get(&node)
                    .is_some_and(|t| *t > asked + self.cfg.settle);
                match r {
                    Ok(_) if grown_since => {}
                    Ok(spare) => {
                        self.spare.insert(node, spare);
                    }
                    Err(_) => {
                        self.probes.remove(&node);
                    }
                }
            }
            Ev::Nodes(r) => {
                self.nodes_asked = false;
                if let Ok(n) = r {
                    self.nodes = n;
                    self.nodes_at = Some(Instant::now());
                }
            }
        }
        Ok(())
    }

    // ---- the policy tick ----

    fn tick(&mut self) -> Result<(), BatchError> {
        let now = Instant::now();
        if !self.nodes_asked
            && self
                .nodes_at
                .is_none_or(|t| now.duration_since(t) >= self.cfg.nodes_refresh)
        {
            self.nodes_asked = true;
            let fut = granule_runtime::cluster_nodes_async();
            self.pending
                .push(Box::pin(async move { Ev::Nodes(fut.await) }));
        }
        let mut view = self.view();
        // Probes asked for by the policy (answers arrive before a later tick).
        for node in self.policy.probe(&view) {
            if self.probing.get(&node).copied().unwrap_or(false)
                || self.settled_at.get(&node).is_some_and(|t| now < *t)
                || self.backoff.get(&node).is_some_and(|b| now < b.until)
            {
                continue;
            }
            self.probing.insert(node, true);
            match self.probes.get(&node) {
                Some(p) => {
                    let fut = p.run_ref_async((), probe::spare_cores);
                    let asked = Instant::now();
                    self.pending
                        .push(Box::pin(async move { Ev::Probed(node, asked, fut.await) }));
                }
                None => {
                    let cores = view
                        .nodes
                        .iter()
                        .find(|n| n.id == node)
                        .map(|n| n.cores)
                        .unwrap_or(1.0);
                    let fut = Proclet::builder(Kind::Compute)
                        .on(node)
                        .pinned()
                        .create_async(cores, |cores: f64| Probe { cores });
                    self.pending
                        .push(Box::pin(async move { Ev::ProbeReady(node, fut.await) }));
                }
            }
        }
        for n in &mut view.nodes {
            n.spare = self.spare.remove(&n.id);
        }
        match self.policy.decide(&view) {
            Target::Hold => {}
            Target::Grow(nodes) => {
                for node in nodes {
                    if !self.ledger.grow(node) {
                        break;
                    }
                }
            }
            Target::Shrink(k) => self.shrink(k),
        }
        // Sleep until the next event when nothing can change before it: the policy
        // says so, no work waits for a worker, and no node comes out of quarantine.
        self.ticking = self.policy.wants_ticks(&self.view())
            || self.ledger.has_pool()
            || self.ledger.live_workers() == 0
            || self.quarantine.values().any(|until| now < *until);
        // Progress guarantee: work handed back with no worker left to take it goes to
        // the node with the most room, whatever the policy says.
        if self.ledger.live_workers() == 0 && self.ledger.has_pool() {
            let best = view
                .nodes
                .iter()
                .max_by(|a, b| a.cores.total_cmp(&b.cores))
                .map(|n| n.id);
            match best {
                Some(node) => {
                    self.stranded_since = None;
                    self.ledger.rescue(node);
                }
                None => {
                    let since = *self.stranded_since.get_or_insert(now);
                    if now.duration_since(since) > STRANDED_LIMIT {
                        return Err(BatchError::NoNodes);
                    }
                }
            }
        }
        Ok(())
    }

    fn view(&self) -> View {
        let nodes = self
            .candidates()
            .into_iter()
            .map(|n| NodeView {
                id: n.id,
                cores: n.spec.cores,
                workers: self.ledger.workers_on(n.id),
                spare: None,
            })
            .collect();
        View {
            nodes,
            workers: self.ledger.live_workers(),
            remaining: self.ledger.remaining(),
            elapsed: self.started.elapsed(),
        }
    }

    /// Ask `k` workers to stop, from the most crowded nodes.
    fn shrink(&mut self, k: usize) {
        for _ in 0..k {
            let mut best: Option<(usize, f64)> = None;
            for (wid, node) in self.ledger.stoppable() {
                let cores = self
                    .nodes
                    .iter()
                    .find(|n| n.id == node)
                    .map(|n| n.spec.cores.max(0.01))
                    .unwrap_or(1.0);
                let crowd = self.ledger.workers_on(node) as f64 / cores;
                if best.is_none_or(|(_, c)| crowd > c) {
                    best = Some((wid, crowd));
                }
            }
            let Some((wid, _)) = best else { return };
            // Marked in the ledger so it is not picked twice; its reply retires it.
            self.ledger.ask_stop(wid);
        }
    }

    async fn cleanup(&mut self) {
        let mut destroys: Vec<Boxed<()>> = Vec::new();
        for p in self.workers.iter_mut().filter_map(Option::take) {
            let fut = p.destroy_async();
            destroys.push(Box::pin(async move {
                let _ = fut.await;
            }));
        }
        for (_, p) in self.probes.drain() {
            let fut = p.destroy_async();
            destroys.push(Box::pin(async move {
                let _ = fut.await;
            }));
        }
        futures::future::join_all(destroys).await;
    }
}

/// Errors that no retry on another node can fix: the user's code panicked, or code
/// cannot be shipped or decoded.
fn fatal(e: &CallError) -> bool {
    matches!(
        e,
        CallError::RemotePanic { .. }
            | CallError::BinaryMismatch(_)
            | CallError::Decode(_)
            | CallError::CodeRefused(_)
            | CallError::Reentrant(_)
            | CallError::NoCluster
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_only_while_regrowths_keep_failing() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // A first stop, long after the worker started: the shortest wait.
        let b = Backoff::after_stop(None, Some(t0), t0 + ms(2000));
        assert_eq!(b.wait, BACKOFF_MIN);
        // Regrown after the wait and stopped again at once: twice as long, and so on up
        // to the cap.
        let mut b = b;
        let mut at = b.until;
        for _ in 0..20 {
            let grew = at;
            at = grew + ms(5);
            b = Backoff::after_stop(Some(b), Some(grew), at);
            at = b.until;
        }
        assert_eq!(b.wait, BACKOFF_MAX);
        // A worker that ran a while before its stop starts the back-off afresh (an
        // antagonist came and went).
        let grew = at;
        let b = Backoff::after_stop(Some(b), Some(grew), grew + ms(600));
        assert_eq!(b.wait, BACKOFF_MIN);
    }
}
