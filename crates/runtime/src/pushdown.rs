//! Pushed calls: read-only closures shipped next to a proclet's data and run there on a
//! pool of threads of their own (Teleport-style compute pushdown).
//!
//! An ordinary call (`run_ref`) runs on the worker thread that read it, which is right for
//! short calls and wrong for an operator that scans data for hundreds of milliseconds: it
//! would hold one of the node's cores and the connection's reader. A *pushed call*
//! ([`Proclet::push`](crate::Proclet::push)) travels the same way (the shipped-closure
//! mechanism, `Msg::Push`), takes the proclet's lock shared like `run_ref` (it runs
//! concurrently with other read-only calls, never with a `run`, and the proclet cannot
//! move under it), and then waits in this module's queue for a thread of the node's
//! *pushdown pool*. Calls to a proclet hosted in the calling process go through the
//! local node's pool as well (never the local fast path), so the rules below hold
//! wherever the proclet lives.
//!
//! This module owns:
//! - the pool (`PushPool`): `pushdown.threads` threads; a queue in arrival order of at
//!   most `pushdown.queue` calls (one more is refused with `NoCapacity`); memory
//!   admission: each call has a budget (its [`PushOpts::memory`], else
//!   `pushdown.call_memory`, at most the pool's memory) and the pool starts the call at
//!   the head of the queue only while the budgets of the running calls, its own
//!   included, stay within `pushdown.memory` (default: a quarter of the node's memory in
//!   its spec). A call whose budget exceeds `pushdown.memory` could never start and is
//!   refused at once (`Refused`). The queue is strict FIFO: a large call at the head is
//!   not overtaken by smaller ones behind it, so it cannot starve;
//! - the CPU cap (`pushdown.cpu_cap`): the pool's threads live in a cpu cgroup of their
//!   own with a CFS quota, inside the node's own cpu group when it runs in one
//!   (`granule-host`'s `ThreadCpuGroup::capped`). When the group cannot be made (not
//!   root, no cgroup v1, `cluster.cgroups = off`) the node logs an error, reports it on
//!   `/metrics` (`granule_pushdown_cpu_cap_failed`) and runs the pool uncapped; [`here`]
//!   then says `cpu_cap: None`;
//! - timeouts and cancellation, by *ticket* (a random id the caller gives each pushed
//!   call): when a call's timeout ([`PushOpts::timeout`], else the handle's call
//!   timeout) passes, the caller gets [`CallError::Timeout`] at once and tells the node
//!   (`Msg::CancelPush`); the node also enforces the timeout itself, from the call's
//!   arrival, in case that notice is lost. Dropping the future of
//!   [`Proclet::push_async`](crate::Proclet::push_async) before it finishes cancels the
//!   call the same way. A call cancelled (or timed out) while still queued, or still
//!   waiting for the proclet's lock, is removed and never runs. A call already running
//!   keeps its thread until its closure returns (nothing can stop a closure halfway);
//!   its answer is dropped and it counts as a *late finish*;
//! - panics: a closure that panics is caught on its pool thread and answered as
//!   [`CallError::RemotePanic`]; the thread carries on, the proclet keeps its state (a
//!   pushed call only reads it) and the node keeps serving;
//! - accounting inside a pushed closure: [`reserve`] takes bytes from the call's budget
//!   (a hash build that would exceed it gets [`OverBudget`] and can stop instead of
//!   taking the node's memory), and [`here`] gives figures about where it runs;
//! - the pool's load as a caller sees it: [`load`], from any closure shipped to the node
//!   (an ordinary read answers on a worker thread even while every pool thread is
//!   taken), gives its queued and running calls, how long they ran, and what it admits,
//!   so a caller can choose not to push into a busy pool.
//!
//! A pushed closure may call other proclets, and push to other nodes; it must not push
//! to its own node's pool (it would wait for a pool thread while holding one: with one
//! thread, for ever), so that is refused at once. A queued call already holds its
//! proclet's shared lock (so the proclet cannot move or change between admission and
//! run): a pushed closure that calls `run` on a proclet which has pushed calls queued
//! behind it on the same pool waits for them while they wait for its thread — give
//! such calls a timeout.
//!
//! The queue's bookkeeping (`Queue`: tickets, admission, counts) is plain data with its
//! own unit tests; threads, channels and the node's lock live around it.

use crate::context::{self, NodeCell};
use crate::error::CallError;
use crate::node::{NodeInner, Remote};
use crate::shipping::{self, panic_message, CallRefFn, Descriptor, Entry};
use crate::slot::{Guard, LockError, TryLock};
use bytes::Bytes;
use granule_config::{CgroupsMode, Config};
use granule_transport::Connection;
use granule_wire::{
    CallMode, ChainId, Frame, Location, Msg, NodeId, NodeSpec, ProcletId, RemoteError,
};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Options of one pushed call ([`Proclet::push`](crate::Proclet::push)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PushOpts {
    /// Give up after this long (the caller gets [`CallError::Timeout`]; a call that had
    /// not started never runs). `None`: the handle's call timeout
    /// ([`Proclet::with_timeout`](crate::Proclet::with_timeout)), if any.
    pub timeout: Option<Duration>,
    /// The call's memory budget, bytes: what its closure may [`reserve`], and what the
    /// node's admission control counts for it while it runs. `None`: the node's default
    /// (`pushdown.call_memory`, at most `pushdown.memory`).
    pub memory: Option<u64>,
}

impl PushOpts {
    /// These options with a timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> PushOpts {
        self.timeout = Some(timeout);
        self
    }

    /// These options with a memory budget of `bytes`.
    pub fn with_memory(mut self, bytes: u64) -> PushOpts {
        self.memory = Some(bytes);
        self
    }
}

// ---- inside a pushed closure: reserve and here ------------------------------------------

/// A pushed call asked for more memory than its budget has left (see [`reserve`]).
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[error(
    "pushed call over its memory budget: asked to reserve {requested} bytes with {used} of \
     its {budget} bytes already reserved (raise PushOpts::memory or pushdown.call_memory)"
)]
pub struct OverBudget {
    /// The call's budget, bytes.
    pub budget: u64,
    /// Bytes the call had reserved before this request.
    pub used: u64,
    /// Bytes this request asked for.
    pub requested: u64,
}

/// Bytes taken from the running pushed call's budget; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    bytes: u64,
    /// The call's count of reserved bytes; `None` outside a pushed call.
    from: Option<Arc<CallBudget>>,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Take `more` bytes into this reservation (a table that grows), or fail with
    /// [`OverBudget`] and hold what it held.
    pub fn grow(&mut self, more: u64) -> Result<(), OverBudget> {
        if let Some(b) = &self.from {
            b.take(more)?;
        }
        self.bytes = self.bytes.saturating_add(more);
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(b) = &self.from {
            b.used.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

/// One running call's budget and what its closure reserved of it.
#[derive(Debug)]
struct CallBudget {
    budget: u64,
    used: AtomicU64,
}

impl CallBudget {
    fn take(&self, bytes: u64) -> Result<(), OverBudget> {
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let after = used.saturating_add(bytes);
            if after > self.budget {
                return Err(OverBudget {
                    budget: self.budget,
                    used,
                    requested: bytes,
                });
            }
            match self
                .used
                .compare_exchange(used, after, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => used = now,
            }
        }
    }
}

/// What the thread running a pushed call knows about it.
struct CurrentCall {
    pool: Arc<PoolShared>,
    budget: Arc<CallBudget>,
}

thread_local! {
    static CURRENT: RefCell<Option<CurrentCall>> = const { RefCell::new(None) };
}

/// Sets [`CURRENT`] while a pushed call runs; clears it on drop (a panic included).
struct CallScope;

impl CallScope {
    fn enter(pool: Arc<PoolShared>, budget: Arc<CallBudget>) -> CallScope {
        CURRENT.with(|c| *c.borrow_mut() = Some(CurrentCall { pool, budget }));
        CallScope
    }
}

impl Drop for CallScope {
    fn drop(&mut self) {
        let _ = CURRENT.try_with(|c| c.borrow_mut().take());
    }
}

/// Reserve `bytes` of the running pushed call's memory budget before allocating them
/// (a hash table, a buffer of rows): fails with [`OverBudget`], naming the budget and
/// the request, when the call's reservations would exceed its budget, so the closure can
/// stop and return an error instead of taking the node's memory. The bytes are given
/// back when the [`Reservation`] is dropped.
///
/// Outside a pushed call (a closure run by `run_ref`, the caller's own code computing a
/// pulled result) there is no budget: it always succeeds, holding nothing, so the same
/// operator code runs at either end.
pub fn reserve(bytes: u64) -> Result<Reservation, OverBudget> {
    let budget = CURRENT
        .try_with(|c| c.borrow().as_ref().map(|cur| cur.budget.clone()))
        .ok()
        .flatten();
    if let Some(b) = &budget {
        b.take(bytes)?;
    }
    Ok(Reservation {
        bytes,
        from: budget,
    })
}

/// What a pushed call's node counts about its pushed calls since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushCounts {
    /// Calls that ran and were answered in time (panics not included).
    pub served: u64,
    /// Calls whose timeout passed, queued (they never ran) or running.
    pub timed_out: u64,
    /// Calls cancelled by their caller before they started (they never ran).
    pub cancelled: u64,
    /// Calls whose closure panicked.
    pub panicked: u64,
    /// Calls refused because their budget exceeds the pool's memory.
    pub refused_over_budget: u64,
    /// Calls refused because the queue was full.
    pub refused_queue_full: u64,
    /// Calls that finished after their caller gave up (timeout or cancel while running).
    pub late_finishes: u64,
}

/// Figures about the pool a pushed call runs on and the call itself ([`here`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolFigures {
    /// The node it runs on.
    pub node: NodeId,
    /// The pool's threads (`pushdown.threads`).
    pub threads: usize,
    /// The pool's CPU cap in cores, `None`: uncapped (none asked, or the cgroup could
    /// not be made).
    pub cpu_cap: Option<f64>,
    /// The CPU scheduler's period the cap's quota is given per (`cluster.cfs_period`): a
    /// capped pool runs at full speed until it has used `cpu_cap × period` of a period,
    /// then waits for the next one.
    pub cpu_period: Duration,
    /// Idle CPU of the node as its monitor last saw it: the cores in its spec minus the
    /// cores its process kept busy over the last heartbeat interval (at least 0).
    pub free_cores: f64,
    /// Pushed calls waiting in the queue.
    pub queued: usize,
    /// Pushed calls running (this one included).
    pub running: usize,
    /// The memory the pool admits calls into (`pushdown.memory`), bytes.
    pub memory: u64,
    /// The budgets of the running calls together (this one's included), bytes.
    pub admitted: u64,
    /// This call's budget, bytes.
    pub budget: u64,
    /// What this call has reserved of it now, bytes.
    pub reserved: u64,
    /// The node's counts of pushed calls.
    pub counts: PushCounts,
}

/// Figures about where the calling pushed closure runs: its node's pool (threads, CPU
/// cap, queue, memory), the node's idle CPU and the call's own budget. `None` outside a
/// pushed call.
pub fn here() -> Option<PoolFigures> {
    let (pool, budget) = CURRENT
        .try_with(|c| {
            c.borrow()
                .as_ref()
                .map(|cur| (cur.pool.clone(), cur.budget.clone()))
        })
        .ok()
        .flatten()?;
    let node = context::current_node();
    let busy = node.as_ref().map_or(0.0, |n| {
        f64::from_bits(n.metrics.cores_busy.load(Ordering::Relaxed))
    });
    let q = pool.queue.lock();
    Some(PoolFigures {
        node: node.as_ref().map_or(NodeId(0), |n| n.id),
        threads: q.threads,
        cpu_cap: pool.cap(),
        cpu_period: node
            .as_ref()
            .map_or(Duration::from_millis(100), |n| n.config.cluster.cfs_period),
        free_cores: (pool.spec_cores - busy).max(0.0),
        queued: q.queued(),
        running: q.running,
        memory: q.memory,
        admitted: q.admitted,
        budget: budget.budget,
        reserved: budget.used.load(Ordering::Acquire),
        counts: q.counts,
    })
}

/// How busy the pushdown pool of a node is, and what it admits: what a caller asks
/// ([`load`]) before deciding whether to push there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolLoad {
    /// The node.
    pub node: NodeId,
    /// The pool's threads (`pushdown.threads`).
    pub threads: usize,
    /// Pushed calls waiting in its queue.
    pub queued: usize,
    /// Pushed calls running.
    pub running: usize,
    /// Of those, calls whose caller gave up on them (timed out or dropped): their answer
    /// goes nowhere, but they keep their thread until their closure returns.
    pub abandoned: usize,
    /// How long the most recently started running call has run (zero when none runs).
    pub busy_for: Duration,
    /// The budget of a call that asks for none (`pushdown.call_memory`, at most
    /// `memory`), bytes.
    pub call_memory: u64,
    /// The memory the pool admits calls into (`pushdown.memory`), bytes: a call with a
    /// larger budget is refused.
    pub memory: u64,
    /// The pool's CPU cap in force, cores (`None`: uncapped).
    pub cpu_cap: Option<f64>,
    /// The scheduler period the cap's quota is given per (`cluster.cfs_period`).
    pub cpu_period: Duration,
    /// Idle CPU of the node as its monitor last saw it, cores.
    pub free_cores: f64,
}

/// The load of the pushdown pool of the node the calling code runs on: any closure
/// shipped to a node (an ordinary read such as `run_ref`, which runs on a worker thread
/// and so answers even while every pool thread is taken, or a pushed call), or the
/// node's own threads. `None` where no node runs.
pub fn load() -> Option<PoolLoad> {
    let node = context::current_node()?;
    let shared = &node.pushdown.shared;
    let busy = f64::from_bits(node.metrics.cores_busy.load(Ordering::Relaxed));
    let q = shared.queue.lock();
    Some(PoolLoad {
        node: node.id,
        threads: q.threads,
        queued: q.queued(),
        running: q.running,
        abandoned: q.abandoned(),
        busy_for: q.youngest_running(Instant::now()).unwrap_or_default(),
        call_memory: shared.default_budget,
        memory: q.memory,
        cpu_cap: shared.cap(),
        cpu_period: node.config.cluster.cfs_period,
        free_cores: (shared.spec_cores - busy).max(0.0),
    })
}

// ---- the queue's bookkeeping (pure) ------------------------------------------------------

/// Why the pool would not take a call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Refusal {
    /// Its budget exceeds the pool's memory: it could never start.
    NeverFits { budget: u64, memory: u64 },
    /// `capacity` calls wait already.
    QueueFull { capacity: usize },
    /// Its caller cancelled it (or its timeout passed) before it was queued.
    Cancelled,
    /// The node is stopping.
    Stopped,
    /// The ticket is in use by another call.
    Duplicate(u64),
}

impl Refusal {
    /// The answer to the caller.
    pub(crate) fn to_remote(&self, node: NodeId) -> RemoteError {
        match self {
            Refusal::NeverFits { budget, memory } => RemoteError::Refused(format!(
                "the pushed call's memory budget ({budget} bytes) exceeds the {memory} bytes \
                 node {node} admits pushed calls into (pushdown.memory): it could never run"
            )),
            Refusal::QueueFull { capacity } => RemoteError::NoCapacity(format!(
                "the pushdown queue of node {node} is full ({capacity} calls wait, \
                 pushdown.queue); try again later"
            )),
            Refusal::Cancelled => {
                RemoteError::Refused("the pushed call was cancelled before it ran".into())
            }
            Refusal::Stopped => RemoteError::Internal(format!("node {node} is stopping")),
            Refusal::Duplicate(t) => {
                RemoteError::Protocol(format!("pushed-call ticket {t} is already in use"))
            }
        }
    }
}

/// Why a caller gives up on a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    /// Its timeout passed.
    Timeout,
    /// Its caller dropped it.
    Dropped,
}

/// What cancelling a call did.
#[derive(Debug, PartialEq)]
pub(crate) enum CancelOutcome<J> {
    /// It had not started: it never runs (the job, if it was queued, to drop).
    NeverRan(Option<J>),
    /// It is running: it finishes, and counts as a late finish.
    TooLate,
    /// No such call here (already finished, already cancelled, or never arrived).
    Unknown,
}

/// Where a call stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Arrived, not queued yet (waiting for the proclet's lock).
    Arrived,
    /// Cancelled before it was queued; the arrival's owner removes it.
    Cancelled,
    Queued,
    Running,
    /// Running, but its caller gave up.
    Abandoned,
}

/// A queued call.
struct Waiting<J> {
    ticket: u64,
    budget: u64,
    job: J,
}

/// The pool's queue and admission: which calls wait, which run, what their budgets
/// take. Everything here happens under the pool's one lock; it starts no thread and
/// knows nothing of proclets (`J` is what the pool runs).
pub(crate) struct Queue<J> {
    threads: usize,
    memory: u64,
    capacity: usize,
    waiting: VecDeque<Waiting<J>>,
    stages: HashMap<u64, Stage>,
    running: usize,
    /// The budgets of the running calls, together.
    admitted: u64,
    /// When each running call started (for how long the pool has been busy).
    since: HashMap<u64, Instant>,
    stopped: bool,
    counts: PushCounts,
}

impl<J> Queue<J> {
    pub(crate) fn new(threads: usize, memory: u64, capacity: usize) -> Queue<J> {
        Queue {
            threads: threads.max(1),
            memory,
            capacity: capacity.max(1),
            waiting: VecDeque::new(),
            stages: HashMap::new(),
            running: 0,
            admitted: 0,
            since: HashMap::new(),
            stopped: false,
            counts: PushCounts::default(),
        }
    }

    /// A call with this budget arrives (before it has the proclet's lock): refused at
    /// once if it could never start.
    pub(crate) fn arrive(&mut self, ticket: u64, budget: u64) -> Result<(), Refusal> {
        if self.stopped {
            return Err(Refusal::Stopped);
        }
        if budget > self.memory {
            self.counts.refused_over_budget += 1;
            return Err(Refusal::NeverFits {
                budget,
                memory: self.memory,
            });
        }
        if self.stages.contains_key(&ticket) {
            return Err(Refusal::Duplicate(ticket));
        }
        self.stages.insert(ticket, Stage::Arrived);
        Ok(())
    }

    /// Queue an arrived call (it has the proclet's lock now); gives the job back when
    /// it was cancelled meanwhile, the queue is full or the pool stopped.
    pub(crate) fn enqueue(&mut self, ticket: u64, budget: u64, job: J) -> Result<(), (Refusal, J)> {
        match self.stages.get(&ticket) {
            Some(Stage::Arrived) => {}
            Some(Stage::Cancelled) | None => {
                self.stages.remove(&ticket);
                return Err((Refusal::Cancelled, job));
            }
            Some(_) => return Err((Refusal::Duplicate(ticket), job)),
        }
        if self.stopped {
            self.stages.remove(&ticket);
            return Err((Refusal::Stopped, job));
        }
        if self.waiting.len() >= self.capacity {
            self.stages.remove(&ticket);
            self.counts.refused_queue_full += 1;
            return Err((
                Refusal::QueueFull {
                    capacity: self.capacity,
                },
                job,
            ));
        }
        self.stages.insert(ticket, Stage::Queued);
        self.waiting.push_back(Waiting {
            ticket,
            budget,
            job,
        });
        Ok(())
    }

    /// The call to start now, if a thread is free and the head of the queue fits in the
    /// memory left (in arrival order: a call that does not fit keeps those behind it
    /// waiting). Returns its ticket, budget and job; it counts as running from now.
    pub(crate) fn next(&mut self) -> Option<(u64, u64, J)> {
        if self.stopped || self.running >= self.threads {
            return None;
        }
        let head = self.waiting.front()?;
        if self.admitted.saturating_add(head.budget) > self.memory {
            return None;
        }
        let w = self.waiting.pop_front()?;
        self.running += 1;
        self.admitted += w.budget;
        self.stages.insert(w.ticket, Stage::Running);
        self.since.insert(w.ticket, Instant::now());
        Some((w.ticket, w.budget, w.job))
    }

    /// A running call finished (its closure returned or panicked); returns whether its
    /// caller had given up on it (a late finish).
    pub(crate) fn finish(&mut self, ticket: u64, budget: u64, panicked: bool) -> bool {
        self.running = self.running.saturating_sub(1);
        self.admitted = self.admitted.saturating_sub(budget);
        self.since.remove(&ticket);
        let late = self.stages.remove(&ticket) == Some(Stage::Abandoned);
        if panicked {
            self.counts.panicked += 1;
        }
        if late {
            self.counts.late_finishes += 1;
        } else if !panicked {
            self.counts.served += 1;
        }
        late
    }

    /// The caller gives up on a call (or its timeout passed at the node).
    pub(crate) fn cancel(&mut self, ticket: u64, why: Why) -> CancelOutcome<J> {
        let Some(stage) = self.stages.get(&ticket).copied() else {
            return CancelOutcome::Unknown;
        };
        let outcome = match stage {
            Stage::Arrived => {
                self.stages.insert(ticket, Stage::Cancelled);
                CancelOutcome::NeverRan(None)
            }
            Stage::Queued => {
                self.stages.remove(&ticket);
                let job = self
                    .waiting
                    .iter()
                    .position(|w| w.ticket == ticket)
                    .and_then(|i| self.waiting.remove(i))
                    .map(|w| w.job);
                CancelOutcome::NeverRan(job)
            }
            Stage::Running => {
                self.stages.insert(ticket, Stage::Abandoned);
                CancelOutcome::TooLate
            }
            Stage::Cancelled | Stage::Abandoned => return CancelOutcome::Unknown,
        };
        match (why, &outcome) {
            (Why::Timeout, _) => self.counts.timed_out += 1,
            (Why::Dropped, CancelOutcome::NeverRan(_)) => self.counts.cancelled += 1,
            // Dropped while running: counted when it finishes, as a late finish.
            (Why::Dropped, _) => {}
        }
        outcome
    }

    /// The owner of an arrival lets go of it without queueing it (the proclet was not
    /// here, the lock failed, it was cancelled): forget it unless it went on.
    pub(crate) fn leave(&mut self, ticket: u64) {
        if matches!(
            self.stages.get(&ticket),
            Some(Stage::Arrived | Stage::Cancelled)
        ) {
            self.stages.remove(&ticket);
        }
    }

    /// Stop: nothing starts any more; the queued jobs come back (to drop).
    pub(crate) fn stop(&mut self) -> Vec<J> {
        self.stopped = true;
        let jobs: Vec<J> = self.waiting.drain(..).map(|w| w.job).collect();
        self.stages
            .retain(|_, s| matches!(s, Stage::Running | Stage::Abandoned));
        jobs
    }

    pub(crate) fn queued(&self) -> usize {
        self.waiting.len()
    }

    /// Running calls whose caller gave up on them (timed out or dropped): they hold
    /// their thread until their closure returns.
    pub(crate) fn abandoned(&self) -> usize {
        self.stages
            .values()
            .filter(|s| **s == Stage::Abandoned)
            .count()
    }

    /// How long the most recently started running call has run at `now` (`None`: none
    /// runs).
    pub(crate) fn youngest_running(&self, now: Instant) -> Option<Duration> {
        self.since
            .values()
            .map(|t| now.saturating_duration_since(*t))
            .min()
    }

    pub(crate) fn counts(&self) -> PushCounts {
        self.counts
    }
}

// ---- the pool ----------------------------------------------------------------------------

/// The answer of a pushed call's trampoline: its result, the encoded return value
/// appended to the buffer it was given, and the large blobs left out of that buffer.
pub(crate) struct Done {
    pub result: Result<(), RemoteError>,
    pub out: Vec<u8>,
    pub left_out: Vec<(usize, Bytes)>,
}

/// One pushed call, ready to run: the proclet's shared lock, the closure's trampoline and
/// its encoded argument.
pub(crate) struct Job {
    guard: Guard,
    entry: CallRefFn,
    arg: Bytes,
    chain: ChainId,
    /// The buffer the result is appended to (a response frame's head, for remote calls).
    out: Vec<u8>,
    /// Leave large blobs out of `out`, for a vectored send.
    leave_blobs: bool,
    reply: tokio::sync::oneshot::Sender<Done>,
}

/// The pool's state shared by its threads, the node and the calls running on it.
pub(crate) struct PoolShared {
    queue: Mutex<Queue<Job>>,
    /// Woken when a call is queued, one finishes, or the pool stops.
    wake: Condvar,
    /// A call's budget when it asks for none.
    default_budget: u64,
    spec_cores: f64,
    /// The cap asked for and made (`None`: none asked, or the cgroup could not be made).
    cap: Option<f64>,
    /// A thread could not enter the capped group: the pool is (partly) uncapped.
    cap_broken: AtomicBool,
    /// Why the cap asked for is not in force, for `/metrics` and the log.
    cap_error: Mutex<Option<String>>,
    group: Mutex<Option<granule_host::antagonist::ThreadCpuGroup>>,
}

impl PoolShared {
    fn cap(&self) -> Option<f64> {
        self.cap
            .filter(|_| !self.cap_broken.load(Ordering::Acquire))
    }
}

/// What `/metrics` shows of a pool.
pub(crate) struct PoolSnapshot {
    pub counts: PushCounts,
    pub queued: usize,
    pub running: usize,
    pub threads: usize,
    /// The cap in force, cores (`None`: uncapped).
    pub cap: Option<f64>,
    /// A cap was asked for but is not in force.
    pub cap_failed: bool,
}

/// A node's pushdown pool (see the module doc). Owned by the node; stopped with it.
pub(crate) struct PushPool {
    shared: Arc<PoolShared>,
}

/// An arrived call's place in the pool, until it is queued: dropping it forgets the
/// arrival (the call will not be queued).
pub(crate) struct Arrival {
    pool: Arc<PoolShared>,
    ticket: u64,
    budget: u64,
}

impl Drop for Arrival {
    fn drop(&mut self) {
        self.pool.queue.lock().leave(self.ticket);
    }
}

impl PushPool {
    /// Start the pool of a node with `spec`: its threads (named `granule-push`, acting
    /// through the node in `cell`), in a capped cpu group when `pushdown.cpu_cap` asks
    /// for one and it can be made.
    pub(crate) fn start(config: &Config, spec: NodeSpec, cell: Arc<NodeCell>) -> PushPool {
        let p = &config.pushdown;
        let threads = p.threads_for(spec.cores);
        let memory = p.memory_for(spec.mem_bytes);
        let (group, cap, cap_error) = match p.cpu_cap {
            None => (None, None, None),
            Some(cores) => match capped_group(config, cores) {
                // The cap in force: a cap above the node's own quota is the node's.
                Ok(g) => {
                    let cap = g.cap_cores().ok().flatten().unwrap_or(cores);
                    (Some(g), Some(cap), None)
                }
                Err(why) => {
                    tracing::error!(
                        "pushdown.cpu_cap = {cores}: cannot make the pushdown pool's cpu cgroup \
                         ({why}); pushed calls run UNCAPPED on this node"
                    );
                    (None, None, Some(why))
                }
            },
        };
        let shared = Arc::new(PoolShared {
            queue: Mutex::new(Queue::new(threads, memory, p.queue as usize)),
            wake: Condvar::new(),
            default_budget: p.default_call_memory_for(spec.mem_bytes),
            spec_cores: spec.cores,
            cap,
            cap_broken: AtomicBool::new(false),
            cap_error: Mutex::new(cap_error),
            group: Mutex::new(group),
        });
        for i in 0..threads {
            let (s, c) = (shared.clone(), cell.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("granule-push-{i}"))
                .spawn(move || pool_thread(s, c));
            if let Err(e) = spawned {
                // Fewer threads than asked: the queue still drains through the others.
                tracing::error!("cannot start a pushdown pool thread: {e}");
            }
        }
        PushPool { shared }
    }

    /// A pushed call arrives with the budget it asks for (`None`: the default).
    pub(crate) fn arrive(&self, ticket: u64, memory: Option<u64>) -> Result<Arrival, Refusal> {
        let budget = memory.unwrap_or(self.shared.default_budget);
        self.shared.queue.lock().arrive(ticket, budget)?;
        Ok(Arrival {
            pool: self.shared.clone(),
            ticket,
            budget,
        })
    }

    /// Queue an arrived call, now that it holds the proclet's shared lock; the receiver
    /// gets its answer. The call's encoded result is appended to `frame` (a response
    /// frame's head, large blobs left out for a vectored send) when given, else to an
    /// empty buffer.
    pub(crate) fn submit(
        &self,
        arrival: Arrival,
        guard: Guard,
        entry: CallRefFn,
        arg: Bytes,
        chain: ChainId,
        frame: Option<Vec<u8>>,
    ) -> Result<tokio::sync::oneshot::Receiver<Done>, Refusal> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let leave_blobs = frame.is_some();
        let job = Job {
            guard,
            entry,
            arg,
            chain,
            out: frame.unwrap_or_default(),
            leave_blobs,
            reply: tx,
        };
        let queued = self
            .shared
            .queue
            .lock()
            .enqueue(arrival.ticket, arrival.budget, job);
        match queued {
            Ok(()) => {
                self.shared.wake.notify_all();
                Ok(rx)
            }
            // The job (and the proclet's lock it holds) is dropped here, outside the
            // queue's lock.
            Err((refusal, _job)) => Err(refusal),
        }
    }

    /// Give up on a call: removed if it has not started (it never runs), marked to count
    /// as a late finish if it runs.
    pub(crate) fn cancel(&self, ticket: u64, why: Why) -> CancelOutcome<()> {
        cancel_in(&self.shared, ticket, why)
    }

    /// Whether the calling thread runs a pushed call of this pool.
    pub(crate) fn is_current_thread(&self) -> bool {
        CURRENT
            .try_with(|c| {
                c.borrow()
                    .as_ref()
                    .is_some_and(|cur| Arc::ptr_eq(&cur.pool, &self.shared))
            })
            .unwrap_or(false)
    }

    /// What `/metrics` shows.
    pub(crate) fn snapshot(&self) -> PoolSnapshot {
        let cap = self.shared.cap();
        let cap_failed = self.shared.cap_error.lock().is_some()
            || self.shared.cap_broken.load(Ordering::Acquire);
        let q = self.shared.queue.lock();
        PoolSnapshot {
            counts: q.counts(),
            queued: q.queued(),
            running: q.running,
            threads: q.threads,
            cap,
            cap_failed,
        }
    }

    /// Stop: queued calls are dropped (their callers get an error), threads exit once
    /// idle, and the capped group goes (threads still running move back to the node's
    /// group first).
    pub(crate) fn stop(&self) {
        let jobs = self.shared.queue.lock().stop();
        self.shared.wake.notify_all();
        drop(jobs);
        if let Some(g) = self.shared.group.lock().take() {
            if let Err(e) = g.remove() {
                tracing::warn!("cannot remove the pushdown pool's cpu cgroup: {e}");
            }
        }
    }
}

fn cancel_in(shared: &PoolShared, ticket: u64, why: Why) -> CancelOutcome<()> {
    let outcome = shared.queue.lock().cancel(ticket, why);
    match outcome {
        // The job (and the proclet's lock it holds) is dropped here, outside the lock;
        // its caller's receiver sees the channel close.
        CancelOutcome::NeverRan(job) => {
            drop(job);
            CancelOutcome::NeverRan(None)
        }
        CancelOutcome::TooLate => CancelOutcome::TooLate,
        CancelOutcome::Unknown => CancelOutcome::Unknown,
    }
}

/// The pool's capped cpu group, or why it cannot be made.
fn capped_group(
    config: &Config,
    cores: f64,
) -> Result<granule_host::antagonist::ThreadCpuGroup, String> {
    if config.cluster.cgroups == CgroupsMode::Off {
        return Err("cluster.cgroups is off".into());
    }
    let h = granule_host::Hierarchy::detect().map_err(|e| e.to_string())?;
    let node_cpu = granule_host::current_paths().and_then(|p| p.cpu);
    let period = config.cluster.cfs_period.as_micros() as u64;
    granule_host::antagonist::ThreadCpuGroup::capped(&h, node_cpu.as_deref(), cores, period)
        .map_err(|e| e.to_string())
}

/// A pool thread: enter the capped group, then run calls until the pool stops.
fn pool_thread(shared: Arc<PoolShared>, cell: Arc<NodeCell>) {
    context::set_thread_node(&cell);
    if let Some(g) = shared.group.lock().as_ref() {
        if let Err(e) = g.join_current_thread() {
            tracing::error!(
                "a pushdown pool thread cannot enter the pool's cpu cgroup ({e}); it runs \
                 pushed calls UNCAPPED"
            );
            *shared.cap_error.lock() = Some(e.to_string());
            shared.cap_broken.store(true, Ordering::Release);
        }
    }
    loop {
        let (ticket, budget, job) = {
            let mut q = shared.queue.lock();
            loop {
                if q.stopped {
                    return;
                }
                if let Some(next) = q.next() {
                    break next;
                }
                shared.wake.wait(&mut q);
            }
        };
        let (done, reply) = run_job(&shared, job, budget);
        let panicked = matches!(done.result, Err(RemoteError::Panic(_)));
        shared.queue.lock().finish(ticket, budget, panicked);
        // A call finished: its thread and its memory may let the next one start.
        shared.wake.notify_all();
        // Counted first, answered after: a caller that has its answer sees it counted.
        // A late call's receiver is gone; its answer is dropped here.
        let _ = reply.send(done);
    }
}

/// Run one call on this thread: in its call chain, with its budget, under the proclet's
/// shared lock (released before answering). A panic escaping the trampoline (it catches
/// the closure's own) is caught here too, so the thread lives on.
fn run_job(
    shared: &Arc<PoolShared>,
    job: Job,
    budget: u64,
) -> (Done, tokio::sync::oneshot::Sender<Done>) {
    let Job {
        guard,
        entry,
        arg,
        chain,
        mut out,
        leave_blobs,
        reply,
    } = job;
    let call = Arc::new(CallBudget {
        budget,
        used: AtomicU64::new(0),
    });
    let outcome = {
        let _call = CallScope::enter(shared.clone(), call);
        let _chain = context::ChainScope::enter(chain);
        let out = &mut out;
        catch_unwind(AssertUnwindSafe(|| {
            let mut run = || guard.with_ref(|s| entry(s, &arg, out));
            if leave_blobs {
                shipping::with_blobs_left_out(run)
            } else {
                (run(), Vec::new())
            }
        }))
    };
    drop(guard);
    let (result, left_out) = match outcome {
        Ok(r) => r,
        Err(p) => (Err(RemoteError::Panic(panic_message(p))), Vec::new()),
    };
    (
        Done {
            result,
            out,
            left_out,
        },
        reply,
    )
}

// ---- the caller's side -------------------------------------------------------------------

/// Where a caller's pushed call can be cancelled, once it is on its way.
enum Target {
    Remote { conn: Arc<Connection>, ticket: u64 },
    Local { pool: Arc<PoolShared>, ticket: u64 },
}

/// The caller's handle on its pushed call, for cancelling it: set when the call is sent
/// (or handed to the local pool), disarmed when its answer arrives.
#[derive(Default)]
pub(crate) struct CancelCell {
    target: Mutex<Option<Target>>,
}

impl CancelCell {
    fn set(&self, t: Target) {
        *self.target.lock() = Some(t);
    }

    /// The call is answered: nothing to cancel any more.
    pub(crate) fn disarm(&self) {
        self.target.lock().take();
    }

    /// Tell the call's node the caller gives up (once).
    pub(crate) fn cancel(&self, why: Why) {
        let target = self.target.lock().take();
        match target {
            Some(Target::Remote { conn, ticket }) => {
                let msg = Msg::CancelPush {
                    ticket,
                    timed_out: why == Why::Timeout,
                };
                if let Err(e) = conn.notify(&msg, &[]) {
                    // The connection is gone, and the call with it.
                    tracing::debug!("cannot cancel pushed call {ticket}: {e}");
                }
            }
            Some(Target::Local { pool, ticket }) => {
                cancel_in(&pool, ticket, why);
            }
            None => {}
        }
    }
}

/// Cancels the call (as dropped) when the caller's future is dropped before its answer.
pub(crate) struct CancelOnDrop(pub Arc<CancelCell>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel(Why::Dropped);
    }
}

/// A fresh ticket: random across processes, unique within one.
pub(crate) fn new_ticket() -> u64 {
    context::new_chain()
}

/// What a pushed call needs besides its proclet and argument.
pub(crate) struct PushCall {
    pub id: ProcletId,
    pub hint: Option<Location>,
    pub desc: &'static Descriptor,
    pub memory: Option<u64>,
    pub timeout: Option<Duration>,
    pub chain: ChainId,
    pub ticket: u64,
}

/// How many times a pushed call follows "not here" answers before it may give up, and
/// for how long at least (as ordinary calls do).
const MAX_HOPS: u32 = 32;
const HOP_PATIENCE: Duration = Duration::from_secs(2);

/// Run a pushed call wherever its proclet lives, through that node's pool; returns the
/// encoded result.
pub(crate) async fn push_flow(
    node: Arc<NodeInner>,
    call: PushCall,
    arg: Vec<u8>,
    cell: Arc<CancelCell>,
) -> Result<Bytes, CallError> {
    let arg = Bytes::from(arg);
    loop {
        if let Some(slot) = node.hosting.get(call.id) {
            match push_here(&node, &call, &slot, arg.clone(), &cell).await {
                Ok(Some(out)) => return Ok(out),
                // Moved meanwhile: on to the remote path.
                Ok(None) => {}
                Err(e) => return Err(e),
            }
        }
        match push_remote(&node, &call, &arg, &cell).await? {
            Remote::Value(b) => return Ok(b),
            Remote::Local => continue,
        }
    }
}

/// A pushed call to a proclet hosted on the calling node: through its own pool.
/// `Ok(None)`: the proclet left meanwhile.
async fn push_here(
    node: &Arc<NodeInner>,
    call: &PushCall,
    slot: &Arc<crate::slot::Slot>,
    arg: Bytes,
    cell: &CancelCell,
) -> Result<Option<Bytes>, CallError> {
    let pool = &node.pushdown;
    if pool.is_current_thread() {
        return Err(CallError::Refused(
            "a pushed call cannot push to its own node's pool (it would wait for a pool \
             thread while holding one); call the proclet with run_ref instead"
                .into(),
        ));
    }
    let Entry::CallRef(entry) = call.desc.entry else {
        return Err(CallError::Internal(
            "a pushed call's code is not a read-only call".into(),
        ));
    };
    let arrival = pool
        .arrive(call.ticket, call.memory)
        .map_err(|r| CallError::from_remote(r.to_remote(node.id), call.id))?;
    cell.set(Target::Local {
        pool: pool.shared.clone(),
        ticket: call.ticket,
    });
    let locked = match slot.lock(call.chain, CallMode::Shared) {
        Ok(TryLock::Granted(g)) => Ok(g),
        Ok(TryLock::Wait(w)) => w.await,
        Err(e) => Err(e),
    };
    let guard = match locked {
        Ok(g) => g,
        Err(LockError::Reentrant) => return Err(CallError::Reentrant(call.id)),
        Err(LockError::Destroyed) => return Err(CallError::ProcletGone(call.id)),
        Err(LockError::Moved(_) | LockError::Withdrawn) => {
            cell.disarm();
            return Ok(None);
        }
    };
    let rx = pool
        .submit(arrival, guard, entry, arg, call.chain, None)
        .map_err(|r| CallError::from_remote(r.to_remote(node.id), call.id))?;
    let done = rx.await.map_err(|_| {
        CallError::Internal("the node stopped before the pushed call was answered".into())
    })?;
    cell.disarm();
    done.result
        .map_err(|e| CallError::from_remote(e, call.id))?;
    Ok(Some(Bytes::from(done.out)))
}

/// A pushed call to a proclet on another node: find it, send `Push`, follow "not here".
async fn push_remote(
    node: &Arc<NodeInner>,
    call: &PushCall,
    arg: &Bytes,
    cell: &CancelCell,
) -> Result<Remote, CallError> {
    let id = call.id;
    let code = shipping::code_ref(call.desc);
    // The node's own limit, from arrival: rounded up, so it never fires before the
    // caller's.
    let timeout_ms = call
        .timeout
        .map(|t| (t.as_micros().div_ceil(1000)).clamp(1, u64::MAX as u128) as u64);
    let started = Instant::now();
    let mut hops = 0u32;
    let mut loc = match node.locations.cached(id).or_else(|| call.hint.clone()) {
        Some(l) => l,
        None => node.locate_at_controller(id).await?,
    };
    loop {
        if loc.node == node.id {
            if node.hosting.contains(id) {
                return Ok(Remote::Local);
            }
            hops += 1;
            if hops > MAX_HOPS && started.elapsed() > HOP_PATIENCE {
                return Err(CallError::Internal(format!("cannot find proclet {id}")));
            }
            node.locations.forget(id);
            loc = node.locate_at_controller(id).await?;
            if loc.node == node.id && !node.hosting.contains(id) {
                tokio::time::sleep(Duration::from_micros((200 * hops as u64).min(5_000))).await;
            }
            continue;
        }
        let conn = node.peers.connect(loc.node, &loc.addr).await?;
        cell.set(Target::Remote {
            conn: conn.clone(),
            ticket: call.ticket,
        });
        let msg = Msg::Push {
            proclet: id,
            code,
            chain: call.chain,
            ticket: call.ticket,
            memory: call.memory,
            timeout_ms,
        };
        match conn.request(&msg, arg).await {
            Ok(Frame {
                msg: Msg::Value,
                tail,
                ..
            }) => {
                cell.disarm();
                return Ok(Remote::Value(tail));
            }
            Ok(Frame {
                msg: Msg::Error(RemoteError::NotHere { hint }),
                ..
            }) => {
                cell.disarm();
                hops += 1;
                if hops > MAX_HOPS && started.elapsed() > HOP_PATIENCE {
                    return Err(CallError::Internal(format!(
                        "proclet {id} kept moving; gave up after {hops} hops in {:?}",
                        started.elapsed()
                    )));
                }
                node.locations.forget(id);
                loc = match hint.filter(|h| h.epoch > loc.epoch) {
                    Some(h) => {
                        node.locations.learn(id, &h);
                        h
                    }
                    None => {
                        let fresh = node.locate_at_controller(id).await?;
                        if fresh.node == loc.node && fresh.epoch <= loc.epoch {
                            // The controller has not caught up with a move yet.
                            tokio::time::sleep(Duration::from_micros(
                                (200 * hops as u64).min(5_000),
                            ))
                            .await;
                        }
                        fresh
                    }
                };
            }
            Ok(Frame {
                msg: Msg::Error(e), ..
            }) => {
                cell.disarm();
                return Err(CallError::from_remote(e, id));
            }
            Ok(f) => {
                cell.disarm();
                return Err(CallError::Internal(format!(
                    "unexpected answer {} to a pushed call",
                    f.msg.name()
                )));
            }
            Err(e) => {
                cell.disarm();
                return Err(node.peers.transport_error(loc.node, e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn q(threads: usize, memory: u64, capacity: usize) -> Queue<&'static str> {
        Queue::new(threads, memory, capacity)
    }

    fn arrive_and_queue(q: &mut Queue<&'static str>, ticket: u64, budget: u64, job: &'static str) {
        q.arrive(ticket, budget).unwrap();
        assert!(q.enqueue(ticket, budget, job).is_ok());
    }

    #[test]
    fn the_queue_knows_how_long_its_running_calls_ran_and_which_were_abandoned() {
        let mut q = q(1, 100 * MIB, 10);
        assert_eq!(q.youngest_running(Instant::now()), None);
        arrive_and_queue(&mut q, 1, MIB, "a");
        let t0 = Instant::now();
        assert!(q.next().is_some());
        let later = t0 + Duration::from_millis(300);
        let ran = q.youngest_running(later).expect("one runs");
        assert!(ran <= Duration::from_millis(300) && ran > Duration::from_millis(250));
        assert_eq!(q.abandoned(), 0);
        assert_eq!(q.cancel(1, Why::Timeout), CancelOutcome::TooLate);
        assert_eq!(q.abandoned(), 1, "a timed-out call keeps its thread");
        assert!(q.finish(1, MIB, false));
        assert_eq!((q.abandoned(), q.youngest_running(later)), (0, None));
    }

    #[test]
    fn calls_start_in_arrival_order_up_to_the_threads() {
        let mut q = q(2, 100 * MIB, 10);
        for (t, j) in [(1, "a"), (2, "b"), (3, "c")] {
            arrive_and_queue(&mut q, t, MIB, j);
        }
        assert_eq!(q.next().map(|n| n.2), Some("a"));
        assert_eq!(q.next().map(|n| n.2), Some("b"));
        assert!(q.next().is_none(), "both threads are busy");
        assert_eq!((q.running, q.queued()), (2, 1));
        assert!(!q.finish(1, MIB, false));
        assert_eq!(q.next().map(|n| (n.0, n.2)), Some((3, "c")));
        q.finish(2, MIB, false);
        q.finish(3, MIB, false);
        assert_eq!(q.counts().served, 3);
        assert_eq!((q.running, q.admitted), (0, 0));
        assert!(q.stages.is_empty());
    }

    #[test]
    fn memory_admits_in_order_and_never_fitting_calls_are_refused_at_once() {
        let mut q = q(4, 100 * MIB, 10);
        assert_eq!(
            q.arrive(9, 101 * MIB),
            Err(Refusal::NeverFits {
                budget: 101 * MIB,
                memory: 100 * MIB
            })
        );
        assert_eq!(q.counts().refused_over_budget, 1);
        arrive_and_queue(&mut q, 1, 60 * MIB, "big");
        arrive_and_queue(&mut q, 2, 50 * MIB, "too much now");
        arrive_and_queue(&mut q, 3, 10 * MIB, "small, behind");
        assert_eq!(q.next().map(|n| n.2), Some("big"));
        // 60 + 50 > 100: the head waits, and so does the small call behind it (FIFO: the
        // large call is not starved by a stream of small ones).
        assert!(q.next().is_none());
        assert_eq!(q.admitted, 60 * MIB);
        q.finish(1, 60 * MIB, false);
        assert_eq!(q.next().map(|n| n.2), Some("too much now"));
        assert_eq!(q.next().map(|n| n.2), Some("small, behind"));
        assert_eq!(q.admitted, 60 * MIB);
        // Exactly the pool's memory fits.
        let mut q2 = super::Queue::<()>::new(1, 8 * MIB, 1);
        q2.arrive(1, 8 * MIB).unwrap();
        q2.enqueue(1, 8 * MIB, ()).ok().unwrap();
        assert!(q2.next().is_some());
    }

    #[test]
    fn a_full_queue_refuses_and_counts() {
        let mut q = q(1, 100 * MIB, 2);
        arrive_and_queue(&mut q, 1, MIB, "a");
        arrive_and_queue(&mut q, 2, MIB, "b");
        q.arrive(3, MIB).unwrap();
        let Err((r, job)) = q.enqueue(3, MIB, "c") else {
            panic!("the third call should be refused")
        };
        assert_eq!((r, job), (Refusal::QueueFull { capacity: 2 }, "c"));
        assert_eq!(q.counts().refused_queue_full, 1);
        assert!(
            !q.stages.contains_key(&3),
            "the refused ticket is forgotten"
        );
        // Once one starts, there is room again.
        q.next().unwrap();
        q.arrive(4, MIB).unwrap();
        assert!(q.enqueue(4, MIB, "d").is_ok());
    }

    #[test]
    fn a_queued_call_cancelled_never_runs() {
        let mut q = q(1, 100 * MIB, 10);
        arrive_and_queue(&mut q, 1, MIB, "long");
        arrive_and_queue(&mut q, 2, MIB, "queued");
        arrive_and_queue(&mut q, 3, MIB, "after");
        assert_eq!(q.next().map(|n| n.2), Some("long"));
        assert_eq!(
            q.cancel(2, Why::Dropped),
            CancelOutcome::NeverRan(Some("queued"))
        );
        assert_eq!(q.cancel(2, Why::Dropped), CancelOutcome::Unknown, "once");
        q.finish(1, MIB, false);
        assert_eq!(q.next().map(|n| n.2), Some("after"), "2 was skipped");
        assert!(q.next().is_none());
        let c = q.counts();
        assert_eq!((c.cancelled, c.timed_out), (1, 0));
    }

    #[test]
    fn a_call_cancelled_before_it_is_queued_is_never_queued() {
        let mut q = q(1, 100 * MIB, 10);
        q.arrive(5, MIB).unwrap();
        // The caller gives up while the call waits for the proclet's lock.
        assert_eq!(q.cancel(5, Why::Timeout), CancelOutcome::NeverRan(None));
        let Err((r, _)) = q.enqueue(5, MIB, "late") else {
            panic!("a cancelled arrival must not be queued")
        };
        assert_eq!(r, Refusal::Cancelled);
        assert!(q.next().is_none());
        assert!(q.stages.is_empty());
        assert_eq!(q.counts().timed_out, 1);
        // An arrival its owner lets go of is forgotten; a queued one is not.
        q.arrive(6, MIB).unwrap();
        q.leave(6);
        assert!(q.stages.is_empty());
        arrive_and_queue(&mut q, 7, MIB, "x");
        q.leave(7);
        assert_eq!(q.next().map(|n| n.2), Some("x"));
    }

    #[test]
    fn a_running_call_given_up_finishes_late() {
        let mut q = q(1, 100 * MIB, 10);
        arrive_and_queue(&mut q, 1, MIB, "timed out");
        arrive_and_queue(&mut q, 2, MIB, "dropped");
        q.next().unwrap();
        assert_eq!(q.cancel(1, Why::Timeout), CancelOutcome::TooLate);
        // The node's own timer after the caller's notice: counted once.
        assert_eq!(q.cancel(1, Why::Timeout), CancelOutcome::Unknown);
        assert!(q.next().is_none(), "it keeps its thread until it returns");
        assert!(q.finish(1, MIB, false), "a late finish");
        q.next().unwrap();
        assert_eq!(q.cancel(2, Why::Dropped), CancelOutcome::TooLate);
        assert!(q.finish(2, MIB, true));
        let c = q.counts();
        assert_eq!(
            (
                c.timed_out,
                c.cancelled,
                c.late_finishes,
                c.served,
                c.panicked
            ),
            (1, 0, 2, 0, 1)
        );
    }

    #[test]
    fn stopping_hands_back_queued_jobs_and_refuses_new_ones() {
        let mut q = q(1, 100 * MIB, 10);
        arrive_and_queue(&mut q, 1, MIB, "running");
        arrive_and_queue(&mut q, 2, MIB, "queued");
        q.next().unwrap();
        q.arrive(3, MIB).unwrap();
        assert_eq!(q.stop(), vec!["queued"]);
        assert!(q.next().is_none());
        assert_eq!(q.arrive(4, MIB), Err(Refusal::Stopped));
        assert!(matches!(
            q.enqueue(3, MIB, "x"),
            Err((Refusal::Cancelled, _))
        ));
        q.finish(1, MIB, false);
        assert!(q.stages.is_empty());
    }

    #[test]
    fn reservations_stay_within_the_budget_and_come_back() {
        // Outside a pushed call: no budget.
        let r = reserve(u64::MAX).unwrap();
        assert_eq!(r.bytes(), u64::MAX);
        drop(r);
        assert!(here().is_none());
        let b = Arc::new(CallBudget {
            budget: 100,
            used: AtomicU64::new(0),
        });
        let shared = Arc::new(PoolShared {
            queue: Mutex::new(Queue::new(1, 1000, 1)),
            wake: Condvar::new(),
            default_budget: 100,
            spec_cores: 2.0,
            cap: Some(0.5),
            cap_broken: AtomicBool::new(false),
            cap_error: Mutex::new(None),
            group: Mutex::new(None),
        });
        let scope = CallScope::enter(shared, b.clone());
        let mut r1 = reserve(60).unwrap();
        let e = reserve(50).unwrap_err();
        assert_eq!(
            e,
            OverBudget {
                budget: 100,
                used: 60,
                requested: 50
            }
        );
        let m = e.to_string();
        assert!(m.contains("100") && m.contains("50"), "{m}");
        assert!(r1.grow(41).is_err(), "growing past the budget fails");
        r1.grow(40).unwrap();
        assert_eq!(b.used.load(Ordering::Acquire), 100);
        let f = here().unwrap();
        assert_eq!((f.budget, f.reserved, f.threads), (100, 100, 1));
        assert_eq!(f.cpu_cap, Some(0.5));
        assert_eq!(f.free_cores, 2.0, "no node here: nothing counted busy");
        drop(r1);
        assert_eq!(b.used.load(Ordering::Acquire), 0);
        let _r2 = reserve(100).unwrap();
        drop(scope);
        assert!(here().is_none());
        assert!(reserve(1 << 40).is_ok(), "no budget after the call");
    }

    #[test]
    fn refusals_say_what_to_change() {
        let m = Refusal::NeverFits {
            budget: 2 * MIB,
            memory: MIB,
        }
        .to_remote(NodeId(3))
        .to_string();
        assert!(m.contains("pushdown.memory") && m.contains("n3"), "{m}");
        let m = Refusal::QueueFull { capacity: 7 }
            .to_remote(NodeId(3))
            .to_string();
        assert!(m.contains("pushdown.queue") && m.contains('7'), "{m}");
    }
}
