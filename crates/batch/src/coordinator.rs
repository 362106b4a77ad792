//! The job's coordinator: one async loop, in the process that started the job, that
//! owns the job's bookkeeping. It creates and retires the compute proclets, keeps one
//! work call in flight per worker, records every reply's output under its index range,
//! hands work to workers that finish early (straggler mitigation: the largest remaining
//! range is split), and every policy interval asks the [`ScalingPolicy`] whether to
//! grow or shrink.
//!
//! Accounting rule (why no item is lost or computed twice): each worker slot owns the
//! index range `lo..hi` that nobody has reported yet. A reply moves `lo` up to what it
//! reports; a steal lowers `hi` when its answer arrives, and the stolen range becomes a
//! new slot's. A slot is *retired* only when no call of its is in flight; whatever it
//! still owns then (a worker on a node that died, a worker that handed its rest back)
//! goes to the pool of unassigned ranges and is computed again by another worker.

use crate::policy::{NodeView, ScalingPolicy, Target, View};
use crate::probe::{self, Probe};
use crate::worker::{self, Stop, Watch, WorkReply, WorkReq, Worker};
use crate::{BatchError, JobEvent, JobLog, Trigger};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use granule_runtime::{CallError, Kind, NodeId, NodeInfo, Proclet, Wire};
use granule_sharded::{Element, ShardedVec};
use granule_wire::{NodeState, Role};
use std::collections::{BTreeMap, HashMap};
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

/// Who gets a stolen range.
#[derive(Clone, Copy, Debug)]
enum Thief {
    /// A new worker on this node.
    New(NodeId),
    /// This worker, whose own range is finished.
    Slot(usize),
}

enum Ev<S, O> {
    Created(usize, Result<Proclet<S>, CallError>),
    Reply(usize, Result<Result<WorkReply<O>, String>, CallError>),
    Stolen(usize, Thief, Result<Option<(u64, u64)>, CallError>),
    ProbeReady(NodeId, Result<Proclet<Probe>, CallError>),
    /// A probe's answer, with when it was asked.
    Probed(NodeId, Instant, Result<f64, CallError>),
    Nodes(Result<Vec<NodeInfo>, CallError>),
    Nothing,
}

#[derive(PartialEq, Eq, Debug, Clone, Copy)]
enum Phase {
    Creating,
    Working,
    /// Its range is done; waiting for a steal to bring it more.
    Waiting,
    Retired,
}

struct Slot<S> {
    node: NodeId,
    proclet: Option<Proclet<S>>,
    lo: u64,
    hi: u64,
    phase: Phase,
    /// A work call is in flight.
    calling: bool,
    /// A steal from this slot is in flight.
    stealing: bool,
    /// How its last call ended, kept while a steal from it is in flight (the steal's
    /// answer says where its range ended).
    after: Option<Stop>,
    /// Asked to stop (a policy shrink); its reply retires it.
    asked: bool,
}

/// What the job produced: each reply's output under the range it covers.
pub(crate) type Outputs<O> = BTreeMap<u64, (u64, O)>;

struct Run<'p, T: Element, A, O, F, W> {
    input: ShardedVec<T>,
    arg: A,
    f: F,
    kernel: W,
    len: u64,
    cfg: Settings,
    policy: &'p mut dyn ScalingPolicy,
    log: Option<Arc<JobLog>>,
    me: Option<NodeId>,
    started: Instant,
    slots: Vec<Slot<Worker<T, A>>>,
    pool: Vec<(u64, u64)>,
    outputs: Outputs<O>,
    done: u64,
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
    /// Steals in flight whose range will start a new worker on the node: counted as
    /// workers there already, or two ticks would both grow onto the node.
    growing: HashMap<NodeId, usize>,
    /// Since when the job has had no worker and no node to place one on.
    stranded_since: Option<Instant>,
    /// Whether policy ticks run; off while the policy says nothing can change before
    /// the next event (see [`ScalingPolicy::wants_ticks`]), on again at every event.
    ticking: bool,
    /// Work calls made so far (the last call's id).
    calls: u64,
}

/// How long a node where a worker was lost is left out of placement.
const QUARANTINE: Duration = Duration::from_millis(500);
/// How long a job waits with no node to run on before it fails.
const STRANDED_LIMIT: Duration = Duration::from_secs(10);

/// Run a job to the end; the outputs by range.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run<T, A, O, F, W>(
    input: ShardedVec<T>,
    len: u64,
    arg: A,
    f: F,
    kernel: W,
    cfg: Settings,
    policy: &mut dyn ScalingPolicy,
    log: Option<Arc<JobLog>>,
) -> Result<Outputs<O>, BatchError>
where
    T: Element,
    A: Wire + Clone + Sync,
    O: Wire,
    F: Copy + Send + Sync + 'static,
    W: Fn(&Worker<T, A>, WorkReq, &F) -> Result<WorkReply<O>, String>
        + Copy
        + Send
        + Sync
        + 'static,
{
    let mut r = Run {
        input,
        arg,
        f,
        kernel,
        len,
        cfg,
        policy,
        log,
        me: granule_runtime::here(),
        started: Instant::now(),
        slots: Vec::new(),
        pool: Vec::new(),
        outputs: BTreeMap::new(),
        done: 0,
        nodes: Vec::new(),
        nodes_at: None,
        nodes_asked: false,
        probes: HashMap::new(),
        probing: HashMap::new(),
        spare: HashMap::new(),
        settled_at: HashMap::new(),
        pending: FuturesUnordered::new(),
        quarantine: HashMap::new(),
        growing: HashMap::new(),
        stranded_since: None,
        ticking: true,
        calls: 0,
    };
    let out = r.main().await;
    r.cleanup().await;
    out.map(|()| r.outputs)
}

impl<T, A, O, F, W> Run<'_, T, A, O, F, W>
where
    T: Element,
    A: Wire + Clone + Sync,
    O: Wire,
    F: Copy + Send + Sync + 'static,
    W: Fn(&Worker<T, A>, WorkReq, &F) -> Result<WorkReply<O>, String>
        + Copy
        + Send
        + Sync
        + 'static,
{
    async fn main(&mut self) -> Result<(), BatchError> {
        if self.len == 0 {
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
        self.create(first, (0, self.len));
        let mut tick = tokio::time::interval(self.cfg.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while self.done < self.len {
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

    fn note(&self, node: NodeId, what: Trigger) {
        if let Some(log) = &self.log {
            let on_node = self.workers_on(node);
            let total = self.live_workers();
            log.push(JobEvent {
                at: Instant::now(),
                node,
                what,
                workers_on_node: on_node,
                workers: total,
            });
        }
    }

    fn live(&self, s: &Slot<Worker<T, A>>) -> bool {
        s.phase != Phase::Retired
    }

    fn workers_on(&self, node: NodeId) -> usize {
        self.slots
            .iter()
            .filter(|s| self.live(s) && s.node == node)
            .count()
            + self.growing.get(&node).copied().unwrap_or(0)
    }

    fn live_workers(&self) -> usize {
        self.slots.iter().filter(|s| self.live(s)).count() + self.growing.values().sum::<usize>()
    }

    // ---- actions ----

    fn create(&mut self, node: NodeId, range: (u64, u64)) {
        let wid = self.slots.len();
        self.slots.push(Slot {
            node,
            proclet: None,
            lo: range.0,
            hi: range.1,
            phase: Phase::Creating,
            calling: false,
            stealing: false,
            after: None,
            asked: false,
        });
        self.settled_at
            .insert(node, Instant::now() + self.cfg.settle);
        // A reading taken before this worker existed says nothing about room for another.
        self.spare.remove(&node);
        let fut = Proclet::builder(Kind::Compute).on(node).create_async(
            (self.input.clone(), self.arg.clone(), range.0, range.1),
            |(input, arg, lo, hi): (ShardedVec<T>, A, u64, u64)| Worker::new(input, arg, (lo, hi)),
        );
        self.pending
            .push(Box::pin(async move { Ev::Created(wid, fut.await) }));
    }

    fn call(&mut self, wid: usize, assign: Option<(u64, u64)>) {
        self.calls += 1;
        let req = WorkReq {
            call: self.calls,
            assign,
            budget_us: self.cfg.budget.as_micros() as u64,
            chunk_us: self.cfg.chunk.as_micros() as u64,
            watch: self.policy.watch_contention().then_some(Watch {
                window_us: self.cfg.window.as_micros() as u64,
                min_share: self.cfg.min_share,
            }),
        };
        let slot = &mut self.slots[wid];
        let Some(p) = slot.proclet.clone() else {
            return;
        };
        if let Some((s, e)) = assign {
            slot.lo = s;
            slot.hi = e;
        }
        slot.calling = true;
        slot.phase = Phase::Working;
        let fut = p.run_ref_with_async(req, self.f, self.kernel);
        self.pending
            .push(Box::pin(async move { Ev::Reply(wid, fut.await) }));
    }

    fn steal(&mut self, victim: usize, thief: Thief) {
        let min = self.cfg.min_steal;
        let slot = &mut self.slots[victim];
        let Some(p) = slot.proclet.clone() else {
            return;
        };
        slot.stealing = true;
        let fut = p.run_ref_async(min, worker::steal::<T, A>);
        self.pending.push(Box::pin(
            async move { Ev::Stolen(victim, thief, fut.await) },
        ));
    }

    /// The working slot with the most unreported items (a steal candidate), other than
    /// `not`.
    fn largest(&self, not: Option<usize>) -> Option<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(i, s)| {
                Some(*i) != not
                    && s.phase == Phase::Working
                    && !s.stealing
                    && !s.asked
                    && s.proclet.is_some()
                    && s.hi - s.lo >= 2 * self.cfg.min_steal
            })
            .max_by_key(|(_, s)| s.hi - s.lo)
            .map(|(i, _)| i)
    }

    fn take_pool(&mut self) -> Option<(u64, u64)> {
        let i = self
            .pool
            .iter()
            .enumerate()
            .max_by_key(|(_, r)| r.1 - r.0)
            .map(|(i, _)| i)?;
        Some(self.pool.swap_remove(i))
    }

    /// Give a worker whose range is done more work: handed-back work first, else half of
    /// the largest remaining range; with neither, retire it.
    fn find_work(&mut self, wid: usize) {
        let s = &mut self.slots[wid];
        if s.hi > s.lo {
            // Not expected (a finished worker has reported its whole range); recompute
            // rather than lose it.
            self.pool.push((s.lo, s.hi));
            s.lo = s.hi;
        }
        if let Some(r) = self.take_pool() {
            self.call(wid, Some(r));
        } else if let Some(victim) = self.largest(Some(wid)) {
            self.slots[wid].phase = Phase::Waiting;
            self.steal(victim, Thief::Slot(wid));
        } else {
            self.retire(wid, Trigger::Done);
        }
    }

    /// Retire a slot once nothing of its is in flight: what it still owns goes back to
    /// the pool, its proclet is destroyed.
    fn retire(&mut self, wid: usize, why: Trigger) {
        let slot = &mut self.slots[wid];
        if slot.phase == Phase::Retired {
            return;
        }
        slot.phase = Phase::Retired;
        granule_runtime::telemetry::count_scaling("batch", false);
        if slot.hi > slot.lo {
            self.pool.push((slot.lo, slot.hi));
            slot.lo = slot.hi;
        }
        if let Some(p) = slot.proclet.take() {
            // Fire and forget: a worker on a dead node is gone already.
            let _ = granule_runtime::spawn(async move {
                let _ = p.destroy_async().await;
            });
        }
        let node = slot.node;
        self.note(node, why);
    }

    // ---- events ----

    fn handle(&mut self, ev: Ev<Worker<T, A>, O>) -> Result<(), BatchError> {
        match ev {
            Ev::Nothing => {}
            Ev::Created(wid, Ok(p)) => {
                let node = self.slots[wid].node;
                self.slots[wid].proclet = Some(p);
                self.call(wid, None);
                self.note(node, Trigger::Grew);
                // Every worker after the first took part of another's range: a split.
                if wid > 0 {
                    granule_runtime::telemetry::count_scaling("batch", true);
                }
            }
            Ev::Created(wid, Err(e)) => {
                if fatal(&e) {
                    return Err(BatchError::Call(e));
                }
                let node = self.slots[wid].node;
                tracing::debug!("creating a worker on {node} failed: {e}");
                self.quarantine.insert(node, Instant::now() + QUARANTINE);
                self.retire(wid, Trigger::Lost);
            }
            Ev::Reply(wid, Ok(Ok(r))) => self.on_reply(wid, r)?,
            Ev::Reply(_, Ok(Err(msg))) => return Err(BatchError::Worker(msg)),
            Ev::Reply(wid, Err(e)) => {
                if fatal(&e) {
                    return Err(BatchError::Call(e));
                }
                tracing::info!(
                    "worker on {} lost ({e}); its range {}..{} will be recomputed",
                    self.slots[wid].node,
                    self.slots[wid].lo,
                    self.slots[wid].hi
                );
                let node = self.slots[wid].node;
                self.quarantine.insert(node, Instant::now() + QUARANTINE);
                let s = &mut self.slots[wid];
                s.calling = false;
                s.proclet = None;
                if !s.stealing {
                    self.retire(wid, Trigger::Lost);
                }
                // Ask the controller again soon: the node may be gone.
                self.nodes_at = None;
            }
            Ev::Stolen(victim, thief, r) => {
                self.slots[victim].stealing = false;
                if let Thief::New(node) = thief {
                    if let Some(g) = self.growing.get_mut(&node) {
                        *g = g.saturating_sub(1);
                    }
                }
                let stolen = match r {
                    Ok(Some(range)) => {
                        self.slots[victim].hi = range.0;
                        Some(range)
                    }
                    Ok(None) => None,
                    Err(e) if fatal(&e) => return Err(BatchError::Call(e)),
                    Err(_) => None,
                };
                // A victim whose call ended (or was lost) while the steal was in flight.
                let v = &mut self.slots[victim];
                if !v.calling && v.phase != Phase::Retired {
                    match v.after.take() {
                        Some(Stop::Finished) => self.find_work(victim),
                        Some(Stop::Asked) => self.retire(victim, Trigger::Asked),
                        Some(Stop::Contended) => self.retire(victim, Trigger::Contended),
                        _ if v.proclet.is_none() => self.retire(victim, Trigger::Lost),
                        _ => {}
                    }
                }
                match (thief, stolen) {
                    (Thief::New(node), Some(range)) => self.create(node, range),
                    (Thief::Slot(wid), Some(range)) => self.call(wid, Some(range)),
                    (Thief::Slot(wid), None) => self.find_work_or_retire(wid),
                    (Thief::New(_), None) => {}
                }
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

    /// [`Self::find_work`] without stealing again (a steal just came back empty).
    fn find_work_or_retire(&mut self, wid: usize) {
        if let Some(r) = self.take_pool() {
            self.call(wid, Some(r));
        } else {
            self.retire(wid, Trigger::Done);
        }
    }

    fn on_reply(&mut self, wid: usize, r: WorkReply<O>) -> Result<(), BatchError> {
        if let Some(log) = &self.log {
            log.add_call(r.end - r.start, r.cpu_s, r.wall_s);
        }
        let slot = &mut self.slots[wid];
        slot.calling = false;
        if r.end > r.start {
            if r.start != slot.lo || r.end > slot.hi.max(r.end) {
                return Err(BatchError::Worker(format!(
                    "internal: worker reported {}..{} but owns {}..{}",
                    r.start, r.end, slot.lo, slot.hi
                )));
            }
            slot.lo = r.end;
            self.done += r.end - r.start;
            self.outputs.insert(r.start, (r.end, r.out));
        }
        match r.stop {
            Stop::Budget | Stop::Moving => self.call(wid, None),
            stop if self.slots[wid].stealing => self.slots[wid].after = Some(stop),
            Stop::Finished => self.find_work(wid),
            Stop::Contended => self.retire(wid, Trigger::Contended),
            Stop::Asked => self.retire(wid, Trigger::Asked),
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
                    if !self.grow(node) {
                        break;
                    }
                }
            }
            Target::Shrink(k) => self.shrink(k),
        }
        // Sleep until the next event when nothing can change before it: the policy
        // says so, no work waits for a worker, and no node comes out of quarantine.
        self.ticking = self.policy.wants_ticks(&self.view())
            || !self.pool.is_empty()
            || self.live_workers() == 0
            || self.quarantine.values().any(|until| now < *until);
        // Progress guarantee: work handed back with no worker left to take it goes to
        // the node with the most room, whatever the policy says.
        if self.live_workers() == 0 && !self.pool.is_empty() {
            let best = view
                .nodes
                .iter()
                .max_by(|a, b| a.cores.total_cmp(&b.cores))
                .map(|n| n.id);
            match best {
                Some(node) => {
                    self.stranded_since = None;
                    if let Some(r) = self.take_pool() {
                        self.create(node, r);
                    }
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
                workers: self.workers_on(n.id),
                spare: None,
            })
            .collect();
        View {
            nodes,
            workers: self.live_workers(),
            remaining: self.len - self.done,
            elapsed: self.started.elapsed(),
        }
    }

    /// One more worker on `node`, with handed-back work or half of the largest range.
    /// False when there is nothing to give it.
    fn grow(&mut self, node: NodeId) -> bool {
        if let Some(r) = self.take_pool() {
            self.create(node, r);
            true
        } else if let Some(victim) = self.largest(None) {
            self.settled_at
                .insert(node, Instant::now() + self.cfg.settle);
            *self.growing.entry(node).or_default() += 1;
            self.spare.remove(&node);
            self.steal(victim, Thief::New(node));
            true
        } else {
            false
        }
    }

    /// Ask `k` workers to stop, from the most crowded nodes.
    fn shrink(&mut self, k: usize) {
        for _ in 0..k {
            let mut best: Option<(usize, f64)> = None;
            for (i, s) in self.slots.iter().enumerate() {
                if s.phase != Phase::Working || !s.calling || s.asked || s.proclet.is_none() {
                    continue;
                }
                let cores = self
                    .nodes
                    .iter()
                    .find(|n| n.id == s.node)
                    .map(|n| n.spec.cores.max(0.01))
                    .unwrap_or(1.0);
                let crowd = self.workers_on(s.node) as f64 / cores;
                if best.is_none_or(|(_, c)| crowd > c) {
                    best = Some((i, crowd));
                }
            }
            let Some((wid, _)) = best else { return };
            // Mark it so it is not picked twice; its reply (Asked) retires it.
            self.slots[wid].asked = true;
            if let Some(p) = self.slots[wid].proclet.clone() {
                let fut = p.run_ref_async((), worker::ask_stop::<T, A>);
                self.pending.push(Box::pin(async move {
                    let _ = fut.await;
                    Ev::Nothing
                }));
            }
        }
    }

    async fn cleanup(&mut self) {
        let mut destroys: Vec<Boxed<()>> = Vec::new();
        for s in &mut self.slots {
            if let Some(p) = s.proclet.take() {
                let fut = p.destroy_async();
                destroys.push(Box::pin(async move {
                    let _ = fut.await;
                }));
            }
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
