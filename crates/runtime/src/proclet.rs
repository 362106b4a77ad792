//! The proclet API: [`Proclet<S>`] handles, creation, calls, destroy.
//!
//! A proclet is a unit of state plus the computation run on it, living on one node of the
//! cluster (possibly this one) and reachable from anywhere through a handle.
//!
//! ```no_run
//! use granule_runtime::{Cluster, Kind, Proclet};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Counter { n: u64 }
//!
//! let _cluster = Cluster::start()?;
//! let c = Proclet::create(Kind::Memory, 10u64, |start: u64| Counter { n: start })?;
//! let now = c.run(5u64, |c: &mut Counter, x: u64| { c.n += x; c.n })?;
//! assert_eq!(now, 15);
//! let seen = c.run_ref((), |c: &Counter, ()| c.n)?;
//! assert_eq!(seen, 15);
//! c.destroy()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Rules for the closures given to `create`, `run`, `run_ref` and their async forms:
//! - they capture nothing (checked at compile time: the closure type must be zero-sized);
//!   everything they need travels in the argument, which is serialized when the proclet
//!   is remote and moved as is when it is local. This does not compile:
//!
//! ```compile_fail
//! use granule_runtime::{Kind, Proclet};
//! let p = Proclet::new(Kind::Memory, 0u64).unwrap();
//! let k = 5u64;
//! let _ = p.run((), move |s: &mut u64, ()| *s += k); // captures `k`
//! ```
//!
//! - the argument comes first and the closure last, everywhere in Granule's API;
//! - `run` closures get `&mut S` and are serialized per proclet; `run_ref` closures get
//!   `&S` and run concurrently with each other (see the crate docs for re-entry);
//! - a panic in a closure is returned as [`CallError::RemotePanic`]; the proclet keeps
//!   the state the closure left behind and its node keeps serving.
//!
//! [`Proclet::push`] runs a read-only closure like `run_ref`, but on the pushdown pool
//! of the proclet's node rather than on the thread that received it: for operators that
//! scan a proclet's data for a long time (see [`crate::pushdown`]).

use crate::context;
use crate::effects::{self, What};
use crate::error::CallError;
use crate::footprint::Footprint;
use crate::node::{NewProclet, NodeInner, Remote};
use crate::pushdown::{self, CancelCell, CancelOnDrop, PushCall, PushOpts, Why};
use crate::shipping::{self, panic_message, ErasedState};
use crate::slot::{Guard, LockError, TryLock};
use granule_wire::{CallMode, ChainId, Kind, Location, NodeId, ProcletId, RemoteError};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a proclet's state must be: serializable (to move between nodes), and shareable
/// between threads (calls on it may come from any thread; `run_ref` calls share it).
pub trait ProcletState: Serialize + DeserializeOwned + Send + Sync + 'static {}
impl<T: Serialize + DeserializeOwned + Send + Sync + 'static> ProcletState for T {}

/// What arguments and return values must be.
pub trait Wire: Serialize + DeserializeOwned + Send + 'static {}
impl<T: Serialize + DeserializeOwned + Send + 'static> Wire for T {}

/// A handle to a proclet with state `S`.
///
/// Handles are plain values: clone them, send them to other threads, pass them as
/// arguments to closures running on other proclets (they serialize as the proclet's id
/// plus a location hint). A handle does not keep its proclet alive or destroy it when
/// dropped; call [`Proclet::destroy`].
pub struct Proclet<S> {
    id: ProcletId,
    hint: Option<Location>,
    node: Option<Arc<NodeInner>>,
    timeout: Option<Duration>,
    _state: PhantomData<fn() -> S>,
}

impl<S> Clone for Proclet<S> {
    fn clone(&self) -> Self {
        Proclet {
            id: self.id,
            hint: self.hint.clone(),
            node: self.node.clone(),
            timeout: self.timeout,
            _state: PhantomData,
        }
    }
}

impl<S> fmt::Debug for Proclet<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Proclet<{}>({})", std::any::type_name::<S>(), self.id)
    }
}

impl<S> PartialEq for Proclet<S> {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl<S> Eq for Proclet<S> {}

#[derive(Serialize, Deserialize)]
struct HandleRepr {
    id: ProcletId,
    hint: Option<Location>,
}

impl<S> Serialize for Proclet<S> {
    fn serialize<Ser: Serializer>(&self, ser: Ser) -> Result<Ser::Ok, Ser::Error> {
        let node = self.node.clone().or_else(context::current_node);
        let hint = node
            .as_ref()
            .and_then(|n| match n.hosting.get(self.id) {
                Some(slot) => Some(Location {
                    node: n.id,
                    addr: n.addr.clone(),
                    epoch: slot.epoch,
                }),
                None => n.locations.cached(self.id),
            })
            .or_else(|| self.hint.clone());
        HandleRepr { id: self.id, hint }.serialize(ser)
    }
}

impl<'de, S> Deserialize<'de> for Proclet<S> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        let r = HandleRepr::deserialize(de)?;
        let node = context::current_node();
        if let (Some(n), Some(h)) = (&node, &r.hint) {
            if h.node != n.id {
                n.locations.learn(r.id, h);
            }
        }
        Ok(Proclet {
            id: r.id,
            hint: r.hint,
            node,
            timeout: None,
            _state: PhantomData,
        })
    }
}

/// Options for creating a proclet; see [`Proclet::builder`].
pub struct ProcletBuilder<S> {
    kind: Kind,
    on: Option<NodeId>,
    mem_hint: u64,
    pinned: bool,
    group: Option<String>,
    /// Whether its footprint is the state's own `Footprint` (else an estimate).
    exact: Option<fn(u8) -> &'static shipping::Descriptor>,
    /// State flags ([`ProcletBuilder::mutating_reads`], [`ProcletBuilder::owner_placed`]).
    flags: u8,
    /// Copies in all, the primary included (1: not replicated).
    replicas: u32,
    _state: PhantomData<fn() -> S>,
}

/// What a creation needs besides the constructor and its argument.
struct CreateOpts {
    kind: Kind,
    on: Option<NodeId>,
    mem_hint: u64,
    pinned: bool,
    group: Option<String>,
    state_desc: &'static shipping::Descriptor,
    replicas: u32,
}

/// The node a handle acts through: the one it was made or received on, else the calling
/// thread's. A handle whose cluster has shut down fails with `NoCluster` (it must not
/// silently act through another cluster, whose ids mean other proclets).
fn node_or_current(node: &Option<Arc<NodeInner>>) -> Result<Arc<NodeInner>, CallError> {
    match node {
        Some(n) if !n.is_stopped() => Ok(n.clone()),
        Some(_) => Err(CallError::NoCluster),
        None => context::current_node().ok_or(CallError::NoCluster),
    }
}

fn encode<T: Serialize>(v: &T, what: &str) -> Result<Vec<u8>, CallError> {
    postcard::to_allocvec(v).map_err(|e| {
        CallError::Decode(format!(
            "cannot encode the {what} ({}): {e}",
            std::any::type_name::<T>()
        ))
    })
}

fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, CallError> {
    postcard::from_bytes(bytes).map_err(|e| {
        CallError::Decode(format!(
            "cannot decode the {what} as {}: {e}",
            std::any::type_name::<T>()
        ))
    })
}

/// A return value, decoded so that its [`granule_wire::Blob`]s are views into the reply
/// frame rather than copies.
pub(crate) fn decode_reply<T: DeserializeOwned>(bytes: &bytes::Bytes) -> Result<T, CallError> {
    granule_wire::blob::with_source(bytes, |b| decode(b, "return value"))
}

fn run_ctor<S, A, F>(ctor: &F, arg: A, id: ProcletId) -> Result<Box<ErasedState>, CallError>
where
    S: ProcletState,
    F: Fn(A) -> S,
{
    catch_unwind(AssertUnwindSafe(|| ctor(arg)))
        .map(|s| Box::new(s) as Box<ErasedState>)
        .map_err(|p| CallError::RemotePanic {
            proclet: id,
            message: format!("the constructor panicked: {}", panic_message(p)),
        })
}

impl<S: ProcletState> ProcletBuilder<S> {
    /// Create the proclet on this node instead of where the controller would place it.
    pub fn on(mut self, node: NodeId) -> Self {
        self.on = Some(node);
        self
    }

    /// Expected memory footprint in bytes (placement takes it into account: memory and
    /// hybrid proclets only go to nodes with this much room).
    pub fn mem_hint(mut self, bytes: u64) -> Self {
        self.mem_hint = bytes;
        self
    }

    /// Keep `n` copies of the proclet, each on its own node: a primary that serves the
    /// calls and `n − 1` backups the controller places on other nodes (1, the default,
    /// is one copy). Every mutating call ([`Proclet::run`], [`Proclet::run_async`]) runs
    /// on the primary and on every backup, in the same order, and is answered once every
    /// backup applied it; read-only calls are served by the primary alone. When the
    /// primary's node dies, the controller makes a backup the primary and calls go on
    /// there; a call caught in the failure is answered from what the backups recorded
    /// if it had been applied, or runs once if not.
    ///
    /// Closures on a replicated proclet must be deterministic (see
    /// docs/guide/replication.md): a backup's result that differs from the primary's is
    /// reported. What they do outside the state (calling, creating, destroying proclets,
    /// failpoints, questions to the runtime) happens on the primary only and is replayed
    /// on the backups. Creation fails with [`CallError::NoCapacity`] when fewer than `n` nodes
    /// live. Replicated proclets move with their copies (the primary hands over to the
    /// destination; the pressure policy moves backups too).
    pub fn replicas(mut self, n: u32) -> Self {
        self.replicas = n.max(1);
        self
    }

    /// Never move this proclet: neither the pressure policy nor an explicit move will
    /// (an explicit move fails with `Refused`).
    pub fn pinned(mut self) -> Self {
        self.pinned = true;
        self
    }

    /// Name the structure or service this proclet belongs to (e.g. `"MapShard p12"`):
    /// operators see proclets summed by it (the dashboard's structures table). It
    /// follows the proclet when it moves.
    pub fn group(mut self, label: impl Into<String>) -> Self {
        self.group = Some(label.into());
        self
    }

    /// Account the proclet's memory with its state's own [`Footprint`] instead of the
    /// default estimate (the length of its encoding); see [`crate::footprint`].
    pub fn footprint(mut self) -> Self
    where
        S: Footprint,
    {
        self.exact = Some(shipping::exact_state_desc::<S>);
        self
    }

    /// Declare that the proclet's read-only calls ([`Proclet::run_ref`]) change its
    /// state through interior mutability (a lock or an atomic inside it), as a batch
    /// job's worker does when its range is split while it runs. A move then holds such
    /// calls like writes and lets them run at the destination: by default reads keep
    /// being served at the source while the state streams, and what they changed there
    /// would be lost with the source's copy.
    pub fn mutating_reads(mut self) -> Self {
        self.flags |= shipping::MUTATING_READS;
        self
    }

    /// The proclet's creator decides where it runs (a batch job's coordinator places
    /// its workers by the idle cores it measures): the nodes' pressure policy never
    /// moves it, as it would otherwise move a busy compute proclet off a node whose CPU
    /// quota it fills. Explicit moves ([`crate::Cluster::move_proclet`]) still do.
    pub fn owner_placed(mut self) -> Self {
        self.flags |= shipping::OWNER_PLACED;
        self
    }

    fn opts(&self) -> CreateOpts {
        CreateOpts {
            kind: self.kind,
            on: self.on,
            mem_hint: self.mem_hint,
            pinned: self.pinned,
            group: self.group.clone(),
            state_desc: match self.exact {
                Some(exact) => exact(self.flags),
                None => shipping::state_desc::<S>(self.flags),
            },
            replicas: self.replicas,
        }
    }

    /// Create the proclet: `ctor(arg)` runs on the chosen node and builds the state.
    pub fn create<A, F>(self, arg: A, ctor: F) -> Result<Proclet<S>, CallError>
    where
        A: Wire,
        F: Fn(A) -> S + Send + Sync + 'static,
    {
        assert_captures_nothing::<F>();
        effects::sync_effect(What::Create, || {
            let node = context::current_node().ok_or(CallError::NoCluster)?;
            let n = node.clone();
            node.block(create_flow(n, self.opts(), arg, ctor), None)
                .unwrap_or_else(|| Err(CallError::Internal("interrupted".into())))
        })
    }

    /// [`ProcletBuilder::create`], as a future.
    pub fn create_async<A, F>(
        self,
        arg: A,
        ctor: F,
    ) -> impl Future<Output = Result<Proclet<S>, CallError>> + Send + 'static
    where
        A: Wire,
        F: Fn(A) -> S + Send + Sync + 'static,
    {
        assert_captures_nothing::<F>();
        effects::async_effect(What::Create, || {
            let node = context::current_node().ok_or(CallError::NoCluster);
            let opts = self.opts();
            async move { create_flow(node?, opts, arg, ctor).await }
        })
    }
}

async fn create_flow<S, A, F>(
    node: Arc<NodeInner>,
    opts: CreateOpts,
    arg: A,
    ctor: F,
) -> Result<Proclet<S>, CallError>
where
    S: ProcletState,
    A: Wire,
    F: Fn(A) -> S + Send + Sync + 'static,
{
    let mut new: NewProclet = node
        .prepare_create(opts.kind, opts.on, opts.mem_hint)
        .await?;
    new.pinned = opts.pinned;
    new.group = opts.group;
    let state_desc = opts.state_desc;
    let result = if new.loc.node == node.id {
        let built = {
            let _scope = context::ChainScope::enter(context::chain_for_call());
            run_ctor(&ctor, arg, new.id)
        };
        match built {
            Ok(s) => node.create_here(&new, state_desc, s).await,
            Err(e) => Err(e),
        }
    } else {
        match encode(&arg, "constructor argument") {
            Ok(bytes) => {
                node.create_remote(&new, shipping::ctor_desc::<F, S, A>(), state_desc, &bytes)
                    .await
            }
            Err(e) => Err(e),
        }
    };
    if let Err(e) = result {
        node.abort_create(&new).await;
        return Err(e);
    }
    if opts.replicas > 1 {
        if let Err(e) = node.replicate_new(&new, opts.replicas).await {
            // All copies or none: the primary goes.
            let _ = node
                .destroy(new.id, Some(&new.loc), context::chain_for_call())
                .await;
            return Err(e);
        }
    }
    Ok(Proclet {
        id: new.id,
        hint: Some(new.loc),
        node: Some(node),
        timeout: None,
        _state: PhantomData,
    })
}

/// Compile-time check that a closure shipped to a proclet (a constructor or a call)
/// captures nothing: its type must be zero-sized. What it needs travels in the argument.
fn assert_captures_nothing<F>() {
    const {
        assert!(
            std::mem::size_of::<F>() == 0,
            "a closure shipped to a proclet (constructor or call) must capture nothing: pass what it needs in the argument"
        )
    };
}

/// The capture-less closure that calls `via(state, arg, &f)`: `f` and `via` are
/// conjured wherever it runs (both are zero-sized, and a value of each was handed to the
/// caller, which is what makes conjuring them sound; see `shipping::conjure`).
fn wrapped_mut<S, A, R, F, W>(f: F, via: W) -> impl Fn(&mut S, A) -> R + Send + Sync + 'static
where
    S: 'static,
    A: 'static,
    R: 'static,
    F: Send + Sync + 'static,
    W: Fn(&mut S, A, &F) -> R + Send + Sync + 'static,
{
    assert_captures_nothing::<F>();
    assert_captures_nothing::<W>();
    let _ = (f, via);
    |s: &mut S, a: A| {
        let f = shipping::conjure::<F>();
        let via = shipping::conjure::<W>();
        via(s, a, &f)
    }
}

/// [`wrapped_mut`] for read-only calls.
fn wrapped_ref<S, A, R, F, W>(f: F, via: W) -> impl Fn(&S, A) -> R + Send + Sync + 'static
where
    S: 'static,
    A: 'static,
    R: 'static,
    F: Send + Sync + 'static,
    W: Fn(&S, A, &F) -> R + Send + Sync + 'static,
{
    assert_captures_nothing::<F>();
    assert_captures_nothing::<W>();
    let _ = (f, via);
    |s: &S, a: A| {
        let f = shipping::conjure::<F>();
        let via = shipping::conjure::<W>();
        via(s, a, &f)
    }
}

/// Run `f` with `&mut S` under a granted lock, on this thread (the local fast path); a
/// panic becomes `RemotePanic`, as it would on a remote node.
fn local_mut<S: ProcletState, A, R>(
    g: &Guard,
    f: &impl Fn(&mut S, A) -> R,
    a: A,
) -> Result<R, CallError> {
    g.with_mut(|s| {
        let s = s
            .downcast_mut::<S>()
            .ok_or_else(|| CallError::Internal("state type changed".into()))?;
        caught(g, || f(s, a))
    })
}

/// [`local_mut`] for read-only calls.
fn local_ref<S: ProcletState, A, R>(
    g: &Guard,
    f: &impl Fn(&S, A) -> R,
    a: A,
) -> Result<R, CallError> {
    g.with_ref(|s| {
        let s = s
            .downcast_ref::<S>()
            .ok_or_else(|| CallError::Internal("state type changed".into()))?;
        caught(g, || f(s, a))
    })
}

fn caught<R>(g: &Guard, f: impl FnOnce() -> R) -> Result<R, CallError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| CallError::RemotePanic {
        proclet: g.slot().id,
        message: panic_message(p),
    })
}

/// The argument of a call, by value until it has to be encoded.
enum ArgState<A> {
    Value(A),
    Encoded(Vec<u8>),
}

impl<A: Wire> ArgState<A> {
    fn into_value(self) -> Result<A, CallError> {
        match self {
            ArgState::Value(a) => Ok(a),
            ArgState::Encoded(b) => decode(&b, "argument"),
        }
    }
    fn bytes(&mut self) -> Result<&[u8], CallError> {
        if let ArgState::Value(a) = self {
            *self = ArgState::Encoded(encode(a, "argument")?);
        }
        match self {
            ArgState::Encoded(b) => Ok(b),
            ArgState::Value(_) => Err(CallError::Internal("argument not encoded".into())),
        }
    }
}

/// Run a local call under its granted lock, in its call chain, and count it.
fn run_local<A: Wire, R>(
    node: &NodeInner,
    chain: ChainId,
    g: Guard,
    arg: ArgState<A>,
    local: &dyn Fn(&Guard, A) -> Result<R, CallError>,
) -> Result<R, CallError> {
    let r = {
        let _scope = context::ChainScope::enter(chain);
        arg.into_value().and_then(|a| local(&g, a))
    };
    drop(g);
    node.hosting.calls_served.fetch_add(1, Ordering::Relaxed);
    r
}

fn lock_error(id: ProcletId, e: LockError) -> Option<CallError> {
    match e {
        LockError::Reentrant => Some(CallError::Reentrant(id)),
        LockError::Destroyed => Some(CallError::ProcletGone(id)),
        // Moved away, or an uncommitted arrival withdrawn: the caller falls through to
        // the remote path.
        LockError::Moved(_) | LockError::Withdrawn => None,
    }
}

impl<S: ProcletState> Proclet<S> {
    /// Create a proclet whose state `ctor(arg)` builds on the node the controller chooses
    /// for `kind` (compute: most idle cores; memory: most free memory).
    pub fn create<A, F>(kind: Kind, arg: A, ctor: F) -> Result<Proclet<S>, CallError>
    where
        A: Wire,
        F: Fn(A) -> S + Send + Sync + 'static,
    {
        Self::builder(kind).create(arg, ctor)
    }

    /// Create a proclet from a state built here (it is shipped to the chosen node).
    pub fn new(kind: Kind, state: S) -> Result<Proclet<S>, CallError> {
        Self::builder(kind).create(state, |s: S| s)
    }

    /// Options: the node to create on, a memory hint.
    pub fn builder(kind: Kind) -> ProcletBuilder<S> {
        ProcletBuilder {
            kind,
            on: None,
            mem_hint: 0,
            pinned: false,
            group: None,
            exact: None,
            flags: 0,
            replicas: 1,
            _state: PhantomData,
        }
    }

    /// The proclet's id.
    pub fn id(&self) -> ProcletId {
        self.id
    }

    /// A handle whose calls fail with [`CallError::Timeout`] after `timeout`. A call that
    /// timed out may still run (calls are at-most-once, not exactly-once).
    pub fn with_timeout(&self, timeout: Duration) -> Proclet<S> {
        let mut p = self.clone();
        p.timeout = Some(timeout);
        p
    }

    /// The node the proclet lives on now (asks the controller, which every move updates;
    /// a cached location could be stale).
    pub fn location(&self) -> Result<NodeId, CallError> {
        effects::sync_effect(What::Locate, || self.location_now())
    }

    fn location_now(&self) -> Result<NodeId, CallError> {
        let node = node_or_current(&self.node)?;
        if node.hosting.contains(self.id) {
            return Ok(node.id);
        }
        let n = node.clone();
        let id = self.id;
        let loc = node
            .block(async move { n.controller.locate(id).await }, None)
            .ok_or_else(|| CallError::Internal("interrupted".into()))??;
        match loc {
            Some((l, true)) => {
                node.locations.learn(self.id, &l);
                Ok(l.node)
            }
            Some((l, false)) => Err(CallError::NodeUnreachable {
                node: l.node,
                reason: "the controller declared it dead".into(),
            }),
            None => Err(CallError::ProcletGone(self.id)),
        }
    }

    /// Run `f(&mut state, arg)` on the proclet, wherever it is, and return its result.
    /// Calls with `&mut S` are serialized per proclet.
    pub fn run<A, R, F>(&self, arg: A, f: F) -> Result<R, CallError>
    where
        A: Wire,
        R: Wire,
        F: Fn(&mut S, A) -> R + Send + Sync + 'static,
    {
        assert_captures_nothing::<F>();
        let code = || shipping::code_ref(shipping::call_mut_desc::<F, S, A, R>());
        self.call_sync(CallMode::Exclusive, arg, code, |g: &Guard, a: A| {
            local_mut(g, &f, a)
        })
    }

    /// Run `f(&state, arg)`: a read-only call. Read-only calls on a proclet run
    /// concurrently with each other (never with a `run`).
    pub fn run_ref<A, R, F>(&self, arg: A, f: F) -> Result<R, CallError>
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Send + Sync + 'static,
    {
        assert_captures_nothing::<F>();
        let code = || shipping::code_ref(shipping::call_ref_desc::<F, S, A, R>());
        self.call_sync(CallMode::Shared, arg, code, |g: &Guard, a: A| {
            local_ref(g, &f, a)
        })
    }

    /// [`Proclet::run`] as a future (runs on whatever executor polls it; a local proclet
    /// is called inline when it is free, a remote one through the node's connections).
    ///
    /// Nothing happens until the future is first polled. A call to a proclet on the
    /// caller's own node that must wait for its turn waits, and runs, in a task of the
    /// node's own: once granted the lock it runs at once, whether or not the caller polls
    /// the future again, so a thread may keep such futures pending and make synchronous
    /// calls meanwhile. Like a remote call once sent, it then runs even if the future is
    /// dropped.
    pub fn run_async<A, R, F>(
        &self,
        arg: A,
        f: F,
    ) -> impl Future<Output = Result<R, CallError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Fn(&mut S, A) -> R + Send + Sync + 'static,
    {
        assert_captures_nothing::<F>();
        let code = shipping::code_ref(shipping::call_mut_desc::<F, S, A, R>());
        self.call_async(CallMode::Exclusive, arg, code, move |g: &Guard, a: A| {
            local_mut(g, &f, a)
        })
    }

    /// [`Proclet::run_ref`] as a future.
    pub fn run_ref_async<A, R, F>(
        &self,
        arg: A,
        f: F,
    ) -> impl Future<Output = Result<R, CallError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Send + Sync + 'static,
    {
        assert_captures_nothing::<F>();
        let code = shipping::code_ref(shipping::call_ref_desc::<F, S, A, R>());
        self.call_async(CallMode::Shared, arg, code, move |g: &Guard, a: A| {
            local_ref(g, &f, a)
        })
    }

    /// Run `f(&state, arg)` as a *pushed call*: like [`Proclet::run_ref`] (shared access:
    /// concurrent with other read-only calls, never with a `run`; the proclet does not
    /// move while it runs), but on the pushdown pool of the node that holds the proclet —
    /// its own threads, bounded in number, memory and CPU (`pushdown.*` settings) — so a
    /// long scan never holds the node's transport or ordinary calls. A proclet hosted in
    /// the calling process goes through this process's pool too.
    ///
    /// `opts.timeout` (else the handle's timeout) bounds the whole call: when it passes
    /// the call fails with [`CallError::Timeout`] at once; a call still waiting (for a
    /// thread, memory, or the proclet's lock) never runs, a running one finishes on its
    /// thread and its answer is dropped. `opts.memory` is the call's budget: the node
    /// admits it when the budgets of its running pushed calls leave room, refuses it with
    /// [`CallError::Refused`] if they never could, and its closure takes from the budget
    /// with [`pushdown::reserve`]. A full queue is [`CallError::NoCapacity`]; a panic in
    /// the closure is [`CallError::RemotePanic`] (the pool and the node carry on). A
    /// pushed closure must not push to its own node (refused: it could wait for itself).
    ///
    /// ```no_run
    /// use granule_runtime::pushdown::{self, OverBudget};
    /// use granule_runtime::{Kind, Proclet, PushOpts};
    /// use std::time::Duration;
    ///
    /// let p = Proclet::new(Kind::Memory, (0..1_000_000u64).collect::<Vec<u64>>())?;
    /// let opts = PushOpts::default().with_timeout(Duration::from_secs(2));
    /// let evens = p.push(opts, 2u64, |v: &Vec<u64>, m: u64| -> Result<u64, OverBudget> {
    ///     let _room = pushdown::reserve(1 << 20)?; // a scratch table, say
    ///     Ok(v.iter().filter(|x| *x % m == 0).count() as u64)
    /// })??;
    /// assert_eq!(evens, 500_000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn push<A, R, F>(&self, opts: PushOpts, arg: A, f: F) -> Result<R, CallError>
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        let node = node_or_current(&self.node)?;
        let call = self.push_async(opts, arg, f);
        node.block(call, None)
            .unwrap_or_else(|| Err(CallError::Internal("interrupted".into())))
    }

    /// [`Proclet::push`] as a future. Dropping the future before it is ready cancels the
    /// call: if it has not started on its node it never runs; if it has, it finishes
    /// there and counts as a late finish. Its timeout runs from when the future is made.
    pub fn push_async<A, R, F>(
        &self,
        opts: PushOpts,
        arg: A,
        f: F,
    ) -> impl Future<Output = Result<R, CallError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        assert_captures_nothing::<F>();
        let _ = f;
        effects::async_effect(What::Call, || self.push_now(opts, arg, f))
    }

    fn push_now<A, R, F>(
        &self,
        opts: PushOpts,
        arg: A,
        _f: F,
    ) -> impl Future<Output = Result<R, CallError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        let desc = shipping::call_ref_desc::<F, S, A, R>();
        let node = node_or_current(&self.node);
        let timeout = opts.timeout.or(self.timeout);
        // Made now, inside the node's runtime, so the future can be polled by any
        // executor.
        let sleep = match (&node, timeout) {
            (Ok(n), Some(t)) => {
                let _enter = n.handle.enter();
                Some(tokio::time::sleep(t))
            }
            _ => None,
        };
        let call = PushCall {
            id: self.id,
            hint: self.hint.clone(),
            desc,
            memory: opts.memory,
            timeout,
            chain: context::chain_for_call(),
            ticket: pushdown::new_ticket(),
        };
        async move {
            let node = node?;
            let bytes = encode(&arg, "argument")?;
            let cell = Arc::new(CancelCell::default());
            // Dropped unfinished (the caller dropped this future): the node is told.
            let _cancel = CancelOnDrop(cell.clone());
            let work = pushdown::push_flow(node, call, bytes, cell.clone());
            let out = match sleep {
                None => work.await,
                Some(sleep) => {
                    let work = std::pin::pin!(work);
                    let sleep = std::pin::pin!(sleep);
                    match futures::future::select(work, sleep).await {
                        futures::future::Either::Left((r, _)) => r,
                        futures::future::Either::Right(((), _work)) => {
                            // Before the unfinished call is dropped: the node counts a
                            // timeout, not a cancel.
                            cell.cancel(Why::Timeout);
                            Err(CallError::Timeout(timeout.unwrap_or_default()))
                        }
                    }
                }
            };
            cell.disarm();
            decode_reply(&out?)
        }
    }

    /// Run `via(&mut state, arg, &f)`: a library's wrapper around its user's closure `f`
    /// (checking a shard's key range before calling `f`, say). Both must capture nothing,
    /// like any shipped closure; both travel as code, not data.
    pub fn run_with<A, R, F, W>(&self, arg: A, f: F, via: W) -> Result<R, CallError>
    where
        A: Wire,
        R: Wire,
        F: Send + Sync + 'static,
        W: Fn(&mut S, A, &F) -> R + Send + Sync + 'static,
    {
        self.run(arg, wrapped_mut::<S, A, R, F, W>(f, via))
    }

    /// [`Proclet::run_with`] for a read-only call (see [`Proclet::run_ref`]).
    pub fn run_ref_with<A, R, F, W>(&self, arg: A, f: F, via: W) -> Result<R, CallError>
    where
        A: Wire,
        R: Wire,
        F: Send + Sync + 'static,
        W: Fn(&S, A, &F) -> R + Send + Sync + 'static,
    {
        self.run_ref(arg, wrapped_ref::<S, A, R, F, W>(f, via))
    }

    /// [`Proclet::run_with`] as a future.
    pub fn run_with_async<A, R, F, W>(
        &self,
        arg: A,
        f: F,
        via: W,
    ) -> impl Future<Output = Result<R, CallError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Send + Sync + 'static,
        W: Fn(&mut S, A, &F) -> R + Send + Sync + 'static,
    {
        self.run_async(arg, wrapped_mut::<S, A, R, F, W>(f, via))
    }

    /// [`Proclet::run_ref_with`] as a future.
    pub fn run_ref_with_async<A, R, F, W>(
        &self,
        arg: A,
        f: F,
        via: W,
    ) -> impl Future<Output = Result<R, CallError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Send + Sync + 'static,
        W: Fn(&S, A, &F) -> R + Send + Sync + 'static,
    {
        self.run_ref_async(arg, wrapped_ref::<S, A, R, F, W>(f, via))
    }

    /// Free the proclet everywhere. Calls waiting on it, and every later call through any
    /// handle, fail with [`CallError::ProcletGone`].
    pub fn destroy(&self) -> Result<(), CallError> {
        effects::sync_effect(What::Destroy, || self.destroy_now())
    }

    fn destroy_now(&self) -> Result<(), CallError> {
        let node = node_or_current(&self.node)?;
        let n = node.clone();
        let (id, hint, chain) = (self.id, self.hint.clone(), context::chain_for_call());
        let deadline = self.timeout.map(|t| Instant::now() + t);
        node.block(
            async move { n.destroy(id, hint.as_ref(), chain).await },
            deadline,
        )
        .unwrap_or(Err(CallError::Timeout(self.timeout.unwrap_or_default())))
    }

    /// Change the proclet's kind where it lives: what placement, the pressure policy
    /// and the node's accounting treat it as from now on (a memory proclet that will run
    /// closures next to its data becomes `Kind::Hybrid`; see the sharded structures'
    /// `hybridize`). It keeps the kind when it moves.
    pub fn set_kind(&self, kind: Kind) -> Result<(), CallError> {
        let id = self.id;
        let found = self.run_ref((id, kind), |_: &S, (id, kind): (ProcletId, Kind)| {
            context::current_node().is_some_and(|n| n.hosting.retag(id, kind))
        })?;
        if found {
            Ok(())
        } else {
            Err(CallError::Internal(format!(
                "{id} answered a call but is not in its node's table"
            )))
        }
    }

    /// [`Proclet::destroy`] as a future.
    pub fn destroy_async(&self) -> impl Future<Output = Result<(), CallError>> + Send + 'static {
        effects::async_effect(What::Destroy, || {
            let node = node_or_current(&self.node);
            let (id, hint, chain) = (self.id, self.hint.clone(), context::chain_for_call());
            async move {
                let n = node?;
                n.destroy(id, hint.as_ref(), chain).await
            }
        })
    }

    /// The common synchronous path: local fast path (no encoding) or remote call.
    fn call_sync<A, R>(
        &self,
        mode: CallMode,
        arg: A,
        code: impl Fn() -> granule_wire::CodeRef,
        local: impl Fn(&Guard, A) -> Result<R, CallError>,
    ) -> Result<R, CallError>
    where
        A: Wire,
        R: Wire,
    {
        effects::sync_effect(What::Call, || self.call_sync_now(mode, arg, code, local))
    }

    fn call_sync_now<A, R>(
        &self,
        mode: CallMode,
        arg: A,
        code: impl Fn() -> granule_wire::CodeRef,
        local: impl Fn(&Guard, A) -> Result<R, CallError>,
    ) -> Result<R, CallError>
    where
        A: Wire,
        R: Wire,
    {
        let tmp;
        let node: &Arc<NodeInner> = match &self.node {
            Some(n) if !n.is_stopped() => n,
            Some(_) => return Err(CallError::NoCluster),
            None => {
                tmp = context::current_node().ok_or(CallError::NoCluster)?;
                &tmp
            }
        };
        let chain: ChainId = context::chain_for_call();
        let deadline = self.timeout.map(|t| Instant::now() + t);
        let timeout_err = || CallError::Timeout(self.timeout.unwrap_or_default());
        // The call's id, made when the call first leaves the local fast path (which
        // needs none, and must stay cheap) — unless it is a replicated call's effect,
        // whose id is derived from that call's (see `effects`).
        let mut call = 0u64;
        let mut arg = ArgState::Value(arg);
        loop {
            if let Some(slot) = node.hosting.get(self.id) {
                if mode == CallMode::Exclusive && slot.replicated.load(Ordering::Acquire) {
                    // A replicated proclet here: through its backups, never the fast path.
                    if call == 0 {
                        call = effects::preset_call_id_or(|| node.new_call_id());
                    }
                    let bytes = bytes::Bytes::copy_from_slice(arg.bytes()?);
                    let (n, code) = (node.clone(), code());
                    let fut =
                        async move { n.call_replicated(&slot, code, chain, call, bytes).await };
                    match node.block(fut, deadline) {
                        None => return Err(timeout_err()),
                        Some(Ok(b)) => return decode_reply(&b),
                        Some(Err(RemoteError::NotHere { .. })) => {}
                        Some(Err(e)) => return Err(CallError::from_remote(e, self.id)),
                    }
                    continue;
                }
                let guard = match slot.lock(chain, mode) {
                    Ok(TryLock::Granted(g)) => Some(g),
                    Ok(TryLock::Wait(w)) => match node.block(w, deadline) {
                        None => {
                            // Waiting here for a lock that no one releases is a bug worth
                            // evidence: say who holds it.
                            tracing::warn!(proclet = %self.id, node = %node.id,
                                "a call timed out waiting for the proclet's lock here: {}",
                                slot.describe_lock());
                            return Err(timeout_err());
                        }
                        Some(Ok(g)) => Some(g),
                        Some(Err(e)) => match lock_error(self.id, e) {
                            Some(err) => return Err(err),
                            None => None,
                        },
                    },
                    Err(e) => match lock_error(self.id, e) {
                        Some(err) => return Err(err),
                        None => None,
                    },
                };
                if let Some(g) = guard {
                    let _scope = context::ChainScope::enter(chain);
                    let r = local(&g, arg.into_value()?);
                    drop(g);
                    node.hosting.calls_served.fetch_add(1, Ordering::Relaxed);
                    return r;
                }
            }
            if call == 0 {
                call = effects::preset_call_id_or(|| node.new_call_id());
            }
            let bytes = arg.bytes()?;
            let fut = node.call_remote(
                self.id,
                self.hint.as_ref(),
                code(),
                mode,
                chain,
                call,
                bytes,
            );
            match node.block(fut, deadline) {
                None => return Err(timeout_err()),
                Some(Ok(Remote::Value(b))) => return decode_reply(&b),
                Some(Ok(Remote::Local)) => continue,
                Some(Err(e)) => return Err(e),
            }
        }
    }

    fn call_async<A, R, L>(
        &self,
        mode: CallMode,
        arg: A,
        code: granule_wire::CodeRef,
        local: L,
    ) -> impl Future<Output = Result<R, CallError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        L: Fn(&Guard, A) -> Result<R, CallError> + Send + Sync + 'static,
    {
        effects::async_effect(What::Call, || self.call_async_now(mode, arg, code, local))
    }

    fn call_async_now<A, R, L>(
        &self,
        mode: CallMode,
        arg: A,
        code: granule_wire::CodeRef,
        local: L,
    ) -> impl Future<Output = Result<R, CallError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        L: Fn(&Guard, A) -> Result<R, CallError> + Send + Sync + 'static,
    {
        let node = node_or_current(&self.node);
        let chain = context::chain_for_call();
        let local = Arc::new(local);
        let id = self.id;
        let hint = self.hint.clone();
        let timeout = self.timeout;
        let sleep = match (&node, timeout) {
            (Ok(n), Some(t)) => {
                let _enter = n.handle.enter();
                Some(tokio::time::sleep(t))
            }
            _ => None,
        };
        let preset = effects::preset_call_id();
        let work = async move {
            let node = node?;
            // Made when the call leaves the local fast path (see `call_sync`).
            let mut call = preset;
            let mut arg = ArgState::Value(arg);
            loop {
                if let Some(slot) = node.hosting.get(id) {
                    if mode == CallMode::Exclusive && slot.replicated.load(Ordering::Acquire) {
                        if call == 0 {
                            call = node.new_call_id();
                        }
                        let bytes = bytes::Bytes::copy_from_slice(arg.bytes()?);
                        match node.call_replicated(&slot, code, chain, call, bytes).await {
                            Ok(b) => return decode_reply(&b),
                            Err(RemoteError::NotHere { .. }) => continue,
                            Err(e) => return Err(CallError::from_remote(e, id)),
                        }
                    }
                    match slot.lock(chain, mode) {
                        Ok(TryLock::Granted(g)) => {
                            return run_local(&node, chain, g, arg, &*local);
                        }
                        Ok(TryLock::Wait(waiting)) => {
                            // Wait for the lock, and run, in a task of the node's own:
                            // once granted, the lock is held until the closure has run,
                            // and that must not depend on the caller polling this future
                            // again (a caller that kept it pending while making a
                            // synchronous call to the same proclet would wait forever
                            // for a lock its own future held). Like a remote call, the
                            // call then runs even if this future is dropped.
                            let (node2, local2) = (node.clone(), local.clone());
                            let task = node.handle.spawn(async move {
                                match waiting.await {
                                    Ok(g) => Ok(run_local(&node2, chain, g, arg, &*local2)),
                                    Err(e) => Err((e, arg)),
                                }
                            });
                            match task.await {
                                Ok(Ok(r)) => return r,
                                Ok(Err((e, back))) => match lock_error(id, e) {
                                    Some(err) => return Err(err),
                                    // Moved meanwhile: on to the remote path.
                                    None => arg = back,
                                },
                                Err(e) => {
                                    return Err(CallError::Internal(format!(
                                        "the local call's task failed: {e}"
                                    )))
                                }
                            }
                        }
                        Err(e) => {
                            if let Some(err) = lock_error(id, e) {
                                return Err(err);
                            }
                        }
                    }
                }
                if call == 0 {
                    call = node.new_call_id();
                }
                let bytes = arg.bytes()?;
                match node
                    .call_remote(id, hint.as_ref(), code, mode, chain, call, bytes)
                    .await?
                {
                    Remote::Value(b) => return decode_reply(&b),
                    Remote::Local => continue,
                }
            }
        };
        async move {
            match sleep {
                None => work.await,
                Some(sleep) => {
                    tokio::select! {
                        r = work => r,
                        _ = sleep => Err(CallError::Timeout(timeout.unwrap_or_default())),
                    }
                }
            }
        }
    }
}
