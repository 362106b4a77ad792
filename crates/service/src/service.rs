//! The two services and what they share: the builder, the per-node front-door
//! installation, and the handle's common operations.
//!
//! - [`StatelessService`]: the handler is registered once; every call gets a random 64-bit
//!   routing key and runs on the worker serving it. The service's context (`()`, or the
//!   value it was started with) is every worker's own copy, which the handler borrows.
//! - [`StatefulService`]: every call names a client; its routing key is a hash of the
//!   client id, so a client's calls go to the same pair while the table stands (sticky).
//!   The service is a row of compute+memory *pairs*, one per routing-key range: the
//!   compute proclet receives the range's calls, its memory proclet (created on the same
//!   node) holds the range's clients in a [`ServiceState`] and runs the handler on it,
//!   in line on the compute proclet's thread while the two share a node. Handlers of
//!   one pair take turns on its state. Splitting a busy pair creates a compute proclet
//!   where the controller finds idle cores and a memory proclet next to it, and moves
//!   the upper half of the clients there with the state's own `split` (the old memory
//!   proclet stops serving their keys in the same step, so a call reaches a client's
//!   state in exactly one place, and a call turned away is routed again unrun); merging
//!   moves the right pair's clients into the left one with `merge`. [`Clients`] is the
//!   ready-made state (one `S` per client); [`ServiceBuilder::stateful_sharded`] takes
//!   your own. The service's context (`()`, or the value it was started with) is in
//!   every [`Pair`]: the memory proclet keeps a copy the handlers borrow next to the
//!   state, and a pair created by a split, or in place of one lost with its node, is
//!   given a copy of its parent's.

use crate::http::{self, encode, parse_body, parse_id, Dispatch, HttpError};
use crate::pool::{
    dead_node, node_lost, Pool, ScaleConfig, Scaler, Timeline, Unserved, Worker, WorkerInfo,
};
use crate::ServiceError;
use futures::future::BoxFuture;
use granule_runtime::{CallError, Kind, NodeId, NodeState, Proclet, ProcletState, Wire};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

// ----- the builder ---------------------------------------------------------------------

/// Options of a service; [`ServiceBuilder::stateless`] and [`ServiceBuilder::stateful`]
/// start it.
#[derive(Clone, Debug)]
pub struct ServiceBuilder {
    name: String,
    scale: ScaleConfig,
    http: bool,
    http_port: u16,
    http_ip: Option<IpAddr>,
}

impl ServiceBuilder {
    /// A service named `name` (its path in the front door: letters, digits, `-`, `_`).
    pub fn new(name: impl Into<String>) -> ServiceBuilder {
        ServiceBuilder {
            name: name.into(),
            scale: ScaleConfig::default(),
            http: true,
            http_port: 0,
            http_ip: None,
        }
    }

    /// When to split and merge (see [`ScaleConfig`]).
    pub fn scale(mut self, s: ScaleConfig) -> Self {
        self.scale = s;
        self
    }

    /// Whether to serve the service over HTTP on every node (default: yes).
    pub fn http(mut self, on: bool) -> Self {
        self.http = on;
        self
    }

    /// The front door's port on each node: used where free (a node process that already
    /// serves other services keeps its port), else an ephemeral one. Default: ephemeral.
    pub fn http_port(mut self, port: u16) -> Self {
        self.http_port = port;
        self
    }

    /// The address the front doors bind to. Default: each node's own transport address
    /// (127.0.0.1 for a local cluster).
    pub fn http_ip(mut self, ip: IpAddr) -> Self {
        self.http_ip = Some(ip);
        self
    }

    fn check_name(&self) -> Result<(), ServiceError> {
        let ok = !self.name.is_empty()
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if ok {
            Ok(())
        } else {
            Err(ServiceError::BadName(self.name.clone()))
        }
    }

    /// Start a stateless service: `handler(req)` runs on whichever compute proclet serves
    /// the call's random routing key. The handler captures nothing.
    pub fn stateless<Req, Resp, F>(
        self,
        handler: F,
    ) -> Result<StatelessService<Req, Resp>, ServiceError>
    where
        Req: Wire + Clone + Sync,
        Resp: Wire,
        F: Fn(Req) -> Resp + Copy + Send + Sync + 'static,
    {
        self.start_stateless((), Plain(handler))
    }

    /// Start a stateless service whose handlers all receive `ctx`: `handler(&ctx, req)`
    /// runs on whichever compute proclet serves the call's random routing key. The
    /// context is what requests should not have to carry (handles to the structures the
    /// service reads, settings): every compute proclet holds a copy — it travels to
    /// those that splits and healing create later — so it must be serializable, and it
    /// is read-only (a handle inside it reaches shared state). Requests, from Rust or as
    /// plain JSON over HTTP, carry only the user's own fields. The handler captures
    /// nothing.
    ///
    /// ```no_run
    /// use granule_runtime::{Kind, Proclet};
    /// use granule_service::ServiceBuilder;
    /// use std::collections::BTreeMap;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let _cluster = granule_runtime::Cluster::start()?;
    /// // Any proclet handle (or a sharded structure's) is a plain serializable value.
    /// let prices = Proclet::create(Kind::Memory, (), |()| {
    ///     BTreeMap::from([("apple".to_string(), 3u64), ("pear".to_string(), 5)])
    /// })?;
    /// let svc = ServiceBuilder::new("price").stateless_with_context(
    ///     prices,
    ///     |prices: &Proclet<BTreeMap<String, u64>>, item: String| {
    ///         // A price list that cannot be reached is an error, not "no price": the
    ///         // caller gets it (over HTTP: 503 with its text).
    ///         prices
    ///             .run_ref(item, |m: &BTreeMap<String, u64>, item: String| m.get(&item).copied())
    ///             .map_err(|e| e.to_string())
    ///     },
    /// )?;
    /// assert_eq!(svc.call("pear".into())??, Some(5));
    /// // Over HTTP the body is the request alone: curl -d '"pear"' http://ADDR/v1/services/price
    /// // answers 5 (and `null` for "kiwi").
    /// svc.destroy()?;
    /// # Ok(()) }
    /// ```
    pub fn stateless_with_context<C, Req, Resp, F>(
        self,
        ctx: C,
        handler: F,
    ) -> Result<StatelessService<Req, Resp, C>, ServiceError>
    where
        C: ProcletState + Clone,
        Req: Wire + Clone + Sync,
        Resp: Wire,
        F: Fn(&C, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        self.start_stateless(ctx, WithContext(handler))
    }

    fn start_stateless<C, Req, Resp, H>(
        self,
        ctx: C,
        handler: H,
    ) -> Result<StatelessService<Req, Resp, C>, ServiceError>
    where
        C: ProcletState + Clone,
        Req: Wire + Clone + Sync,
        Resp: Wire,
        H: StatelessHandler<C, Req, Resp>,
    {
        self.check_name()?;
        let pool = Pool::create(Shared(ctx), None, &format!("service {}", self.name))?;
        let (scaler, thread) =
            match Scaler::start(pool.clone(), self.scale.clone(), self.name.clone()) {
                Ok(s) => s,
                Err(e) => {
                    let _ = pool.destroy();
                    return Err(e);
                }
            };
        let mut common = Common {
            name: self.name.clone(),
            scaler,
            thread: Mutex::new(Some(thread)),
            doors: Vec::new(),
        };
        if self.http {
            if let Err(e) = common.install(&self, |door: &Proclet<Door>, ip, port| {
                door.run_ref_with(
                    (pool.clone(), ip, port),
                    handler,
                    install_stateless::<C, Req, Resp, H>,
                )
            }) {
                let _ = common.destroy();
                return Err(e);
            }
        }
        let p = pool;
        let invoke: Invoke<u64, Req, Resp> = Arc::new(move |key: u64, req: Req| {
            let p = p.clone();
            Box::pin(async move {
                p.call(key, req, handler, stateless_via::<C, Req, Resp, H>)
                    .await
            })
        });
        Ok(StatelessService { common, invoke })
    }

    /// Start a stateful service with a state per client: `handler(&mut state, req)`
    /// runs for a client with that client's state (created with `St::default()` on its
    /// first call). The handler captures nothing.
    pub fn stateful<Id, St, Req, Resp, F>(
        self,
        handler: F,
    ) -> Result<StatefulService<Clients<Id, St>, Req, Resp>, ServiceError>
    where
        Id: ClientId + DeserializeOwned,
        St: ProcletState + Default,
        Req: Wire + Clone + Sync,
        Resp: Wire,
        F: Fn(&mut St, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        self.start_stateful((), ByClient(handler))
    }

    /// Start a stateful service with a state per client whose handlers all receive
    /// `ctx`: `handler(&ctx, &mut state, req)` runs for a client with that client's
    /// state (created with `St::default()` on its first call), as with
    /// [`ServiceBuilder::stateful`]. The context is what requests should not have to
    /// carry (handles to the structures the service reads or writes, settings), as for
    /// [`ServiceBuilder::stateless_with_context`]: every compute+memory pair holds a copy
    /// — pairs created later by splits, and the pair that replaces one lost with its
    /// node, get theirs from an existing pair — so it must be serializable, and it is
    /// read-only (a handle inside it reaches shared state). Calls, from Rust or as plain
    /// JSON over HTTP (`POST /v1/services/{name}/clients/{id}`), carry only the client id
    /// and the user's own fields. The handler captures nothing.
    ///
    /// ```no_run
    /// use granule_runtime::{Kind, Proclet};
    /// use granule_service::ServiceBuilder;
    /// use std::collections::BTreeMap;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let _cluster = granule_runtime::Cluster::start()?;
    /// // The price list every pair reads: any proclet handle (or a sharded structure's)
    /// // is a plain serializable value.
    /// let prices = Proclet::create(Kind::Memory, (), |()| {
    ///     BTreeMap::from([("apple".to_string(), 3u64), ("pear".to_string(), 5)])
    /// })?;
    /// // Each client's state is its cart's total; a request adds one item to it.
    /// let svc = ServiceBuilder::new("cart").stateful_with_context(
    ///     prices,
    ///     |prices: &Proclet<BTreeMap<String, u64>>, total: &mut u64, item: String|
    ///      -> Result<u64, String> {
    ///         // A price list that cannot be reached fails the call (over HTTP: 503 with
    ///         // the error's text) and leaves the cart as it was.
    ///         let price = prices
    ///             .run_ref(item, |m: &BTreeMap<String, u64>, item: String| m.get(&item).copied())
    ///             .map_err(|e| e.to_string())?;
    ///         *total += price.unwrap_or(0);
    ///         Ok(*total)
    ///     },
    /// )?;
    /// assert_eq!(svc.call("alice".to_string(), "pear".into())??, 5);
    /// assert_eq!(svc.call("alice".to_string(), "apple".into())??, 8);
    /// // Over HTTP the body is the request alone:
    /// //   curl -d '"pear"' http://ADDR/v1/services/cart/clients/alice
    /// svc.destroy()?;
    /// # Ok(()) }
    /// ```
    pub fn stateful_with_context<C, Id, St, Req, Resp, F>(
        self,
        ctx: C,
        handler: F,
    ) -> Result<StatefulService<Clients<Id, St>, Req, Resp, C>, ServiceError>
    where
        C: ProcletState + Clone,
        Id: ClientId + DeserializeOwned,
        St: ProcletState + Default,
        Req: Wire + Clone + Sync,
        Resp: Wire,
        F: Fn(&C, &mut St, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        self.start_stateful(ctx, ByClientWithContext(handler))
    }

    /// Start a stateful service over your own shard state `S` (its clients, with the
    /// split and merge you give it in [`ServiceState`]): `handler(&mut shard, &id, req)`
    /// runs on the shard holding client `id`. The handler captures nothing.
    pub fn stateful_sharded<S, Req, Resp, F>(
        self,
        handler: F,
    ) -> Result<StatefulService<S, Req, Resp>, ServiceError>
    where
        S: ServiceState,
        S::Id: DeserializeOwned,
        Req: Wire + Clone + Sync,
        Resp: Wire,
        F: Fn(&mut S, &S::Id, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        self.start_stateful((), ByShard(handler))
    }

    /// [`ServiceBuilder::stateful_sharded`] whose handlers all receive `ctx` (see
    /// [`ServiceBuilder::stateful_with_context`]): `handler(&ctx, &mut shard, &id, req)`
    /// runs on the shard holding client `id`. The handler captures nothing.
    pub fn stateful_sharded_with_context<C, S, Req, Resp, F>(
        self,
        ctx: C,
        handler: F,
    ) -> Result<StatefulService<S, Req, Resp, C>, ServiceError>
    where
        C: ProcletState + Clone,
        S: ServiceState,
        S::Id: DeserializeOwned,
        Req: Wire + Clone + Sync,
        Resp: Wire,
        F: Fn(&C, &mut S, &S::Id, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        self.start_stateful(ctx, ByShardWithContext(handler))
    }

    fn start_stateful<C, S, Req, Resp, H>(
        self,
        ctx: C,
        handler: H,
    ) -> Result<StatefulService<S, Req, Resp, C>, ServiceError>
    where
        C: ProcletState + Clone,
        S: ServiceState,
        S::Id: DeserializeOwned,
        Req: Wire + Clone + Sync,
        Resp: Wire,
        H: Handler<S, Req, Resp, C>,
    {
        self.check_name()?;
        // The first pair: its memory half where the controller puts memory, its compute
        // half next to it. Both halves hold the context: the compute half's copy seeds
        // the pairs created later, the memory half's is the one handlers borrow.
        let group = format!("service {}", self.name);
        let mem =
            Proclet::builder(Kind::Memory)
                .group(group.clone())
                .create(ctx.clone(), |ctx: C| PairState {
                    lo: 0,
                    hi: u64::MAX as u128 + 1,
                    ctx,
                    state: S::default(),
                })?;
        let node = mem.location().ok();
        let pair = Pair {
            mem,
            group: group.clone(),
            ctx,
        };
        let pool = match Pool::create(pair.clone(), node, &group) {
            Ok(p) => p,
            Err(e) => {
                let _ = crate::pool::Context::release(&pair);
                return Err(e);
            }
        };
        let (scaler, thread) =
            match Scaler::start(pool.clone(), self.scale.clone(), self.name.clone()) {
                Ok(s) => s,
                Err(e) => {
                    let _ = pool.destroy();
                    return Err(e);
                }
            };
        let mut common = Common {
            name: self.name.clone(),
            scaler,
            thread: Mutex::new(Some(thread)),
            doors: Vec::new(),
        };
        if self.http {
            if let Err(e) = common.install(&self, |door: &Proclet<Door>, ip, port| {
                door.run_ref_with(
                    (pool.clone(), ip, port),
                    handler,
                    install_stateful::<C, S, Req, Resp, H>,
                )
            }) {
                let _ = common.destroy();
                return Err(e);
            }
        }
        let p = pool;
        let invoke: Invoke<S::Id, Req, Resp> = Arc::new(move |id: S::Id, req: Req| {
            let p = p.clone();
            Box::pin(async move { call_stateful(&p, id, req, handler).await })
        });
        Ok(StatefulService { common, invoke })
    }
}

/// A routed call, with the user's handler inside (kept on the caller's side only).
type Invoke<K, Req, Resp> =
    Arc<dyn Fn(K, Req) -> BoxFuture<'static, Result<Resp, ServiceError>> + Send + Sync>;

// ----- what both services share --------------------------------------------------------

/// A service's front door on one node: a small pinned proclet whose calls install and
/// remove the service there.
#[derive(Serialize, Deserialize)]
pub struct Door {
    name: String,
}

/// Where a node's front door is: the node and its HTTP address.
pub type FrontDoor = (NodeId, SocketAddr);

struct Common<C: ProcletState> {
    name: String,
    scaler: Arc<Scaler<C>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    doors: Vec<(NodeId, Proclet<Door>, SocketAddr)>,
}

/// The node's transport address (the key of its front door in the process) and the IP
/// to serve on, looked up on the node itself.
fn node_key() -> Result<(String, IpAddr), String> {
    let me = granule_runtime::here().ok_or("not on a Granule node")?;
    let nodes = granule_runtime::cluster_nodes().map_err(|e| format!("listing nodes: {e}"))?;
    let info = nodes
        .into_iter()
        .find(|n| n.id == me)
        .ok_or("this node is not in the controller's list")?;
    let ip = info
        .addr
        .parse::<SocketAddr>()
        .map(|a| a.ip())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    Ok((info.addr, ip))
}

impl<C: crate::pool::Context> Common<C> {
    /// Put a door on every live node that hosts proclets (the driver included), and
    /// install the service there with `install(door, ip, port)`.
    fn install(
        &mut self,
        b: &ServiceBuilder,
        install: impl Fn(
            &Proclet<Door>,
            Option<IpAddr>,
            u16,
        ) -> Result<Result<SocketAddr, String>, CallError>,
    ) -> Result<(), ServiceError> {
        let nodes = granule_runtime::cluster_nodes()?;
        for n in nodes {
            if n.state != NodeState::Alive
                || !matches!(
                    n.role,
                    granule_wire::Role::Driver | granule_wire::Role::Node
                )
            {
                continue;
            }
            let door = Proclet::builder(Kind::Memory)
                .on(n.id)
                .pinned()
                .create(self.name.clone(), |name: String| Door { name })?;
            let addr = match install(&door, b.http_ip, b.http_port) {
                Ok(Ok(a)) => a,
                Ok(Err(e)) => {
                    let _ = door.destroy();
                    return Err(ServiceError::Http(format!("on node {}: {e}", n.id)));
                }
                Err(e) => {
                    let _ = door.destroy();
                    return Err(e.into());
                }
            };
            self.doors.push((n.id, door, addr));
        }
        Ok(())
    }

    fn http_addrs(&self) -> Vec<FrontDoor> {
        self.doors.iter().map(|(n, _, a)| (*n, *a)).collect()
    }

    fn stop_scaler(&self) {
        self.scaler.stop();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }

    fn destroy(&self) -> Result<(), ServiceError> {
        self.stop_scaler();
        for (_, door, _) in &self.doors {
            // A door lost with its node is gone with its front door.
            let r = door.run_ref((), |d: &Door, ()| {
                if let Ok((key, _)) = node_key() {
                    http::unregister(&key, &d.name);
                }
            });
            match r {
                Ok(()) | Err(CallError::ProcletGone(_)) => {}
                Err(e) if node_lost(&e) => continue,
                Err(e) => return Err(e.into()),
            }
            match door.destroy() {
                Ok(()) | Err(CallError::ProcletGone(_)) => {}
                Err(e) if node_lost(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.scaler.destroy()
    }
}

impl<C: ProcletState> Drop for Common<C> {
    fn drop(&mut self) {
        self.scaler.stop();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

macro_rules! common_methods {
    () => {
        /// The service's name (its path in the front door).
        pub fn name(&self) -> &str {
            &self.common.name
        }

        /// Every node's front door (empty if the service was started without HTTP).
        pub fn http_addrs(&self) -> Vec<FrontDoor> {
            self.common.http_addrs()
        }

        /// The compute proclets now, in routing-key order, with their nodes.
        pub fn proclets(&self) -> Vec<WorkerInfo> {
            self.common.scaler.workers()
        }

        /// The scaler's record so far: load per window and every split and merge.
        pub fn timeline(&self) -> Timeline {
            self.common.scaler.timeline()
        }

        /// Split a compute proclet now (the one with the widest range), whatever the
        /// load. Returns whether it did.
        pub fn split_now(&self) -> Result<bool, ServiceError> {
            self.common.scaler.split_now()
        }

        /// Merge two neighbouring compute proclets now (the narrowest pair), whatever
        /// the load. Returns whether it did.
        pub fn merge_now(&self) -> Result<bool, ServiceError> {
            self.common.scaler.merge_now()
        }
    };
}

// ----- the stateless service -------------------------------------------------------------

/// A stateless service (see the [crate docs](crate)). Started with
/// [`StatelessService::start`] or [`ServiceBuilder::stateless`], or with a context `C`
/// that every handler receives ([`StatelessService::start_with_context`],
/// [`ServiceBuilder::stateless_with_context`]); the handle that started it runs its
/// scaler, which stops when the handle is dropped or destroyed.
///
/// A compute proclet lost with its node is replaced on a live node, and calls meanwhile
/// wait and are sent again: under node loss a call may run twice (once on the lost node,
/// whatever it did to other proclets before the node died, and once on the replacement;
/// see [`ServiceError::Lost`] for when they give up).
pub struct StatelessService<Req, Resp, C: ProcletState = ()> {
    common: Common<Shared<C>>,
    invoke: Invoke<u64, Req, Resp>,
}

impl<Req, Resp, C: ProcletState> fmt::Debug for StatelessService<Req, Resp, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatelessService")
            .field("name", &self.common.name)
            .finish()
    }
}

impl<Req: Wire + Clone + Sync, Resp: Wire> StatelessService<Req, Resp> {
    /// Start a service named `name` with default options (see [`ServiceBuilder`]).
    pub fn start<F>(name: impl Into<String>, handler: F) -> Result<Self, ServiceError>
    where
        F: Fn(Req) -> Resp + Copy + Send + Sync + 'static,
    {
        ServiceBuilder::new(name).stateless(handler)
    }
}

impl<Req, Resp, C> StatelessService<Req, Resp, C>
where
    Req: Wire + Clone + Sync,
    Resp: Wire,
    C: ProcletState + Clone,
{
    /// Start a service named `name` with default options whose handlers all receive
    /// `ctx` (see [`ServiceBuilder::stateless_with_context`]).
    pub fn start_with_context<F>(
        name: impl Into<String>,
        ctx: C,
        handler: F,
    ) -> Result<Self, ServiceError>
    where
        F: Fn(&C, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        ServiceBuilder::new(name).stateless_with_context(ctx, handler)
    }

    /// Call the service: a random routing key picks the compute proclet.
    pub fn call(&self, req: Req) -> Result<Resp, ServiceError> {
        granule_runtime::block_on(self.call_async(req))
    }

    /// [`StatelessService::call`] as a future (starts when first polled).
    pub fn call_async(&self, req: Req) -> BoxFuture<'static, Result<Resp, ServiceError>> {
        (self.invoke)(rand::random(), req)
    }

    common_methods!();

    /// Remove the service from every front door and destroy its proclets.
    pub fn destroy(self) -> Result<(), ServiceError> {
        self.common.destroy()
    }
}

/// A stateless service's compute proclets' context: the value the service was started
/// with (`()` without one). Every worker holds a copy, splits and healing copy it on.
#[derive(Clone, Serialize, Deserialize)]
#[serde(bound(serialize = "C: Serialize", deserialize = "C: DeserializeOwned"))]
pub(crate) struct Shared<C>(C);

impl<C: ProcletState + Clone> crate::pool::Context for Shared<C> {}

/// A stateless handler: how a call reaches the user's function, with or without the
/// service's context.
pub(crate) trait StatelessHandler<C, Req, Resp>: Copy + Send + Sync + 'static {
    fn handle(&self, ctx: &C, req: Req) -> Resp;
}

/// A handler without context: `f(req)`.
#[derive(Clone, Copy)]
pub(crate) struct Plain<F>(F);

impl<Req, Resp, F> StatelessHandler<(), Req, Resp> for Plain<F>
where
    F: Fn(Req) -> Resp + Copy + Send + Sync + 'static,
{
    fn handle(&self, (): &(), req: Req) -> Resp {
        (self.0)(req)
    }
}

/// A handler of the service's context: `f(&ctx, req)`.
#[derive(Clone, Copy)]
pub(crate) struct WithContext<F>(F);

impl<C, Req, Resp, F> StatelessHandler<C, Req, Resp> for WithContext<F>
where
    F: Fn(&C, Req) -> Resp + Copy + Send + Sync + 'static,
{
    fn handle(&self, ctx: &C, req: Req) -> Resp {
        (self.0)(ctx, req)
    }
}

fn stateless_via<C, Req, Resp, H: StatelessHandler<C, Req, Resp>>(
    w: &Worker<Shared<C>>,
    req: Req,
    h: &H,
) -> Result<Resp, Unserved<Req>>
where
    C: ProcletState,
{
    Ok(w.timed(|| h.handle(&w.ctx.0, req)))
}

/// Install a stateless service in this node's front door (runs on the node's door).
fn install_stateless<C, Req, Resp, H>(
    door: &Door,
    (pool, ip, port): (Pool<Shared<C>>, Option<IpAddr>, u16),
    h: &H,
) -> Result<SocketAddr, String>
where
    C: ProcletState + Clone,
    Req: Wire + Clone + Sync,
    Resp: Wire,
    H: StatelessHandler<C, Req, Resp>,
{
    let f = *h;
    let (key, node_ip) = node_key()?;
    let dispatch: Dispatch = Arc::new(move |_id: Option<String>, body| {
        let pool = pool.clone();
        Box::pin(async move {
            let req: Req = parse_body(&body)?;
            let resp = pool
                .call(rand::random(), req, f, stateless_via::<C, Req, Resp, H>)
                .await
                .map_err(|e| HttpError::Unavailable(e.to_string()))?;
            encode(&resp)
        })
    });
    http::register(
        &key,
        ip.unwrap_or(node_ip),
        port,
        door.name.clone(),
        "stateless",
        dispatch,
    )
}

// ----- the stateful service ---------------------------------------------------------------

/// What a client id must be: ordered, comparable, serializable (it travels, and is
/// hashed to its routing key from its encoding).
pub trait ClientId: Ord + Clone + Wire + Sync + fmt::Debug {}
impl<T: Ord + Clone + Wire + Sync + fmt::Debug> ClientId for T {}

/// The state of one shard of a stateful service: the clients whose routing keys fall in
/// one range. The user supplies how it splits and merges; the service calls these when
/// it splits a busy compute+memory pair or merges two idle ones.
pub trait ServiceState: ProcletState + Default {
    /// The client id calls are routed by.
    type Id: ClientId;
    /// Move every client for which `upper` is true into a new state and return it (the
    /// rest stays). `upper` is a pure function of the id.
    fn split(&mut self, upper: &dyn Fn(&Self::Id) -> bool) -> Self;
    /// Take in the clients of `other` (a neighbouring range: no id is in both).
    fn merge(&mut self, other: Self);
}

/// The ready-made [`ServiceState`]: a state `S` per client, created with `S::default()`
/// on the client's first call ([`ServiceBuilder::stateful`]).
#[derive(Serialize, Deserialize)]
#[serde(bound(
    serialize = "Id: Serialize, S: Serialize",
    deserialize = "Id: DeserializeOwned, S: DeserializeOwned"
))]
pub struct Clients<Id: Ord, S> {
    map: BTreeMap<Id, S>,
}

impl<Id: Ord, S> Default for Clients<Id, S> {
    fn default() -> Self {
        Clients {
            map: BTreeMap::new(),
        }
    }
}

impl<Id: ClientId, S: Default> Clients<Id, S> {
    /// Client `id`'s state, created if it has none yet.
    pub fn client(&mut self, id: &Id) -> &mut S {
        self.map.entry(id.clone()).or_default()
    }
}

impl<Id: Ord, S> Clients<Id, S> {
    /// Client `id`'s state, if it has one.
    pub fn get(&self, id: &Id) -> Option<&S> {
        self.map.get(id)
    }
    /// Clients in this shard.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// Whether the shard has no client.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl<Id: ClientId, S: ProcletState + Default> ServiceState for Clients<Id, S> {
    type Id = Id;
    fn split(&mut self, upper: &dyn Fn(&Id) -> bool) -> Self {
        let (up, keep): (BTreeMap<Id, S>, BTreeMap<Id, S>) = std::mem::take(&mut self.map)
            .into_iter()
            .partition(|(id, _)| upper(id));
        self.map = keep;
        Clients { map: up }
    }
    fn merge(&mut self, mut other: Self) {
        self.map.append(&mut other.map);
    }
}

/// A stateful handler: how a call reaches the user's function, with the service's
/// context `C` (`()` for a service started without one).
pub trait Handler<S: ServiceState, Req, Resp, C = ()>: Copy + Send + Sync + 'static {
    /// Run the call of client `id` on its shard's state, with the service's context.
    fn handle(&self, ctx: &C, state: &mut S, id: &S::Id, req: Req) -> Resp;
}

/// A handler of the whole shard state: `f(&mut shard, &id, req)`.
#[derive(Clone, Copy)]
pub struct ByShard<F>(F);

impl<S, Req, Resp, F> Handler<S, Req, Resp> for ByShard<F>
where
    S: ServiceState,
    F: Fn(&mut S, &S::Id, Req) -> Resp + Copy + Send + Sync + 'static,
{
    fn handle(&self, (): &(), state: &mut S, id: &S::Id, req: Req) -> Resp {
        (self.0)(state, id, req)
    }
}

/// A handler of one client's state: `f(&mut client_state, req)`.
#[derive(Clone, Copy)]
pub struct ByClient<F>(F);

impl<Id, St, Req, Resp, F> Handler<Clients<Id, St>, Req, Resp> for ByClient<F>
where
    Id: ClientId,
    St: ProcletState + Default,
    F: Fn(&mut St, Req) -> Resp + Copy + Send + Sync + 'static,
{
    fn handle(&self, (): &(), state: &mut Clients<Id, St>, id: &Id, req: Req) -> Resp {
        (self.0)(state.client(id), req)
    }
}

/// A handler of the whole shard state and the service's context:
/// `f(&ctx, &mut shard, &id, req)` ([`ServiceBuilder::stateful_sharded_with_context`]).
#[derive(Clone, Copy)]
pub struct ByShardWithContext<F>(F);

impl<C, S, Req, Resp, F> Handler<S, Req, Resp, C> for ByShardWithContext<F>
where
    S: ServiceState,
    F: Fn(&C, &mut S, &S::Id, Req) -> Resp + Copy + Send + Sync + 'static,
{
    fn handle(&self, ctx: &C, state: &mut S, id: &S::Id, req: Req) -> Resp {
        (self.0)(ctx, state, id, req)
    }
}

/// A handler of one client's state and the service's context:
/// `f(&ctx, &mut client_state, req)` ([`ServiceBuilder::stateful_with_context`]).
#[derive(Clone, Copy)]
pub struct ByClientWithContext<F>(F);

impl<C, Id, St, Req, Resp, F> Handler<Clients<Id, St>, Req, Resp, C> for ByClientWithContext<F>
where
    Id: ClientId,
    St: ProcletState + Default,
    F: Fn(&C, &mut St, Req) -> Resp + Copy + Send + Sync + 'static,
{
    fn handle(&self, ctx: &C, state: &mut Clients<Id, St>, id: &Id, req: Req) -> Resp {
        (self.0)(ctx, state.client(id), req)
    }
}

/// The memory half of a compute+memory pair: the state of the clients whose routing
/// keys are in `lo..hi`, and its copy of the service's context, which the handlers
/// borrow. Calls for other keys are turned away unrun (their clients were handed to
/// another pair, or not yet handed to this one).
#[derive(Serialize, Deserialize)]
#[serde(bound(
    serialize = "S: Serialize, C: Serialize",
    deserialize = "S: DeserializeOwned, C: DeserializeOwned"
))]
pub struct PairState<S, C = ()> {
    lo: u64,
    /// Exclusive; `u64::MAX + 1` for the last range.
    hi: u128,
    ctx: C,
    state: S,
}

impl<S, C> PairState<S, C> {
    fn serves(&self, key: u64) -> bool {
        self.lo <= key && (key as u128) < self.hi
    }
}

/// A stateful compute proclet's context: its memory proclet, the service's group label
/// and the service's context `C` (`()` without one), which every pair created from this
/// one — by a split, or in place of a pair lost with its node — gets a copy of.
#[derive(Serialize, Deserialize)]
#[serde(bound(serialize = "C: Serialize", deserialize = "C: DeserializeOwned"))]
pub struct Pair<S: ServiceState, C = ()> {
    mem: Proclet<PairState<S, C>>,
    /// The service's group label (`"service NAME"`), for the pairs split off later.
    group: String,
    /// The service's context, for the memory proclets of the pairs created later.
    ctx: C,
}

impl<S: ServiceState, C: Clone> Clone for Pair<S, C> {
    fn clone(&self) -> Self {
        Pair {
            mem: self.mem.clone(),
            group: self.group.clone(),
            ctx: self.ctx.clone(),
        }
    }
}

fn state_error(what: &str, e: impl fmt::Display) -> ServiceError {
    ServiceError::State(format!("{what}: {e}"))
}

impl<S: ServiceState, C: ProcletState> Pair<S, C> {
    /// A pair of the same service with a new memory proclet (on `node` if given) that
    /// serves `lo..hi` with an empty state and a copy of this pair's context.
    fn sibling(&self, lo: u64, hi: u128, node: Option<NodeId>) -> Result<Self, ServiceError>
    where
        C: Clone,
    {
        let mut b = Proclet::builder(Kind::Memory).group(self.group.clone());
        if let Some(n) = node {
            b = b.on(n);
        }
        let mem = b.create(
            (lo, hi, self.ctx.clone()),
            |(lo, hi, ctx): (u64, u128, C)| PairState {
                lo,
                hi,
                ctx,
                state: S::default(),
            },
        )?;
        Ok(Pair {
            mem,
            group: self.group.clone(),
            ctx: self.ctx.clone(),
        })
    }

    /// Put clients (encoded) and the range end `hi` into this pair's memory proclet.
    fn absorb(&self, bytes: Vec<u8>, hi: u128) -> Result<(), ServiceError> {
        self.mem
            .run(
                (bytes, hi),
                |p: &mut PairState<S, C>, (b, hi): (Vec<u8>, u128)| {
                    let other: S = postcard::from_bytes(&b).map_err(|e| e.to_string())?;
                    p.state.merge(other);
                    p.hi = p.hi.max(hi);
                    Ok::<(), String>(())
                },
            )?
            .map_err(|e| state_error("decoding clients handed over", e))
    }
}

impl<S: ServiceState, C: ProcletState + Clone> crate::pool::Context for Pair<S, C> {
    const SERIAL: bool = true;

    fn split(&self, mid: u64, node: Option<NodeId>) -> Result<Option<Self>, ServiceError> {
        // The new memory proclet first, serving nothing yet, on the new worker's node,
        // with the context.
        let new = self.sibling(mid, mid as u128, node)?;
        // Then the upper clients leave the old one (which stops serving their keys in the
        // same step), encoded, so a failed hand-over can give them back.
        let taken = self.mem.run(mid, |p: &mut PairState<S, C>, mid: u64| {
            if mid <= p.lo || mid as u128 >= p.hi {
                return Err(format!("{mid} is not inside {}..{}", p.lo, p.hi));
            }
            let up = p.state.split(&|id: &S::Id| routing_key(id) >= mid);
            let bytes = postcard::to_allocvec(&up).map_err(|e| e.to_string());
            match bytes {
                Ok(b) => {
                    let hi = p.hi;
                    p.hi = mid as u128;
                    Ok((b, hi))
                }
                Err(e) => {
                    p.state.merge(up);
                    Err(e)
                }
            }
        });
        let (bytes, hi) = match taken {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                let _ = new.mem.destroy();
                return Err(state_error("splitting the clients", e));
            }
            Err(e) => {
                let _ = new.mem.destroy();
                return Err(e.into());
            }
        };
        if let Err(e) = new.absorb(bytes.clone(), hi) {
            // Back where they were.
            self.absorb(bytes, hi)?;
            let _ = new.mem.destroy();
            return Err(e);
        }
        Ok(Some(new))
    }

    fn merge(&self, right: &Self) -> Result<(), ServiceError> {
        let taken = right.mem.run((), |p: &mut PairState<S, C>, ()| {
            let all = std::mem::take(&mut p.state);
            match postcard::to_allocvec(&all) {
                Ok(b) => {
                    let hi = p.hi;
                    p.hi = p.lo as u128;
                    Ok((b, hi))
                }
                Err(e) => {
                    p.state = all;
                    Err(e.to_string())
                }
            }
        })?;
        let (bytes, hi) = taken.map_err(|e| state_error("taking the clients to merge", e))?;
        if let Err(e) = self.absorb(bytes.clone(), hi) {
            right.absorb(bytes, hi)?;
            return Err(e);
        }
        Ok(())
    }

    fn release(&self) -> Result<(), ServiceError> {
        match self.mem.destroy() {
            Ok(()) | Err(CallError::ProcletGone(_)) => Ok(()),
            // Lost with its node: nothing left to release.
            Err(e) if node_lost(&e) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn lost(&self) -> Option<NodeId> {
        dead_node(self.mem.location())
    }

    fn renew(&self, lo: u64, hi: u128, node: Option<NodeId>) -> Result<Self, ServiceError> {
        // The lost clients' range, empty, next to the new compute proclet, with the
        // context.
        self.sibling(lo, hi, node)
    }
}

/// A stateful service (see the [crate docs](crate)): started with
/// [`StatefulService::start`] or [`ServiceBuilder::stateful`] (a state per client), or
/// [`ServiceBuilder::stateful_sharded`] (your own [`ServiceState`] with its split and
/// merge); or with a context `C` that every handler receives
/// ([`StatefulService::start_with_context`], [`ServiceBuilder::stateful_with_context`],
/// [`ServiceBuilder::stateful_sharded_with_context`]).
pub struct StatefulService<S: ServiceState, Req, Resp, C: ProcletState = ()> {
    common: Common<Pair<S, C>>,
    invoke: Invoke<S::Id, Req, Resp>,
}

impl<S: ServiceState, Req, Resp, C: ProcletState> fmt::Debug for StatefulService<S, Req, Resp, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatefulService")
            .field("name", &self.common.name)
            .finish()
    }
}

impl<Id, St, Req, Resp> StatefulService<Clients<Id, St>, Req, Resp>
where
    Id: ClientId + DeserializeOwned,
    St: ProcletState + Default + Clone,
    Req: Wire + Clone + Sync,
    Resp: Wire,
{
    /// Start a service named `name` with default options, with a state per client (see
    /// [`ServiceBuilder::stateful`]).
    pub fn start<F>(name: impl Into<String>, handler: F) -> Result<Self, ServiceError>
    where
        F: Fn(&mut St, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        ServiceBuilder::new(name).stateful(handler)
    }
}

impl<Id, St, Req, Resp, C> StatefulService<Clients<Id, St>, Req, Resp, C>
where
    Id: ClientId + DeserializeOwned,
    St: ProcletState + Default + Clone,
    Req: Wire + Clone + Sync,
    Resp: Wire,
    C: ProcletState + Clone,
{
    /// Start a service named `name` with default options, with a state per client,
    /// whose handlers all receive `ctx` (see [`ServiceBuilder::stateful_with_context`]).
    pub fn start_with_context<F>(
        name: impl Into<String>,
        ctx: C,
        handler: F,
    ) -> Result<Self, ServiceError>
    where
        F: Fn(&C, &mut St, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        ServiceBuilder::new(name).stateful_with_context(ctx, handler)
    }

    /// A copy of client `id`'s state (`None` if it never called).
    pub fn client_state(&self, id: &Id) -> Result<Option<St>, ServiceError> {
        self.read(id, |c: &Clients<Id, St>, id: &Id| c.get(id).cloned())
    }
}

impl<S, Req, Resp, C> StatefulService<S, Req, Resp, C>
where
    S: ServiceState,
    Req: Wire + Clone + Sync,
    Resp: Wire,
    C: ProcletState + Clone,
{
    /// Call the service for client `id`.
    pub fn call(&self, id: S::Id, req: Req) -> Result<Resp, ServiceError> {
        granule_runtime::block_on(self.call_async(id, req))
    }

    /// [`StatefulService::call`] as a future (starts when first polled).
    pub fn call_async(
        &self,
        id: S::Id,
        req: Req,
    ) -> BoxFuture<'static, Result<Resp, ServiceError>> {
        (self.invoke)(id, req)
    }

    /// Run `f(&shard_state, &id)` on the state of the pair serving client `id`, between
    /// calls (`f` captures nothing).
    pub fn read<R, F>(&self, id: &S::Id, f: F) -> Result<R, ServiceError>
    where
        R: Wire,
        F: Fn(&S, &S::Id) -> R + Copy + Send + Sync + 'static,
    {
        let key = routing_key(id);
        let started = Instant::now();
        let mut lost = None;
        loop {
            // The pair serving the key per the scaler's table, then its memory half. A
            // pair lost with its node: the scaler replaces it (now), then look again.
            let worker = self
                .common
                .scaler
                .worker_for(key)
                .ok_or(ServiceError::Unmapped)?;
            let pair = match worker.run_ref((), |w: &Worker<Pair<S, C>>, ()| w.ctx.clone()) {
                Ok(p) => Some(p),
                Err(CallError::ProcletGone(_)) => None,
                Err(e) if node_lost(&e) => {
                    self.common.scaler.wake();
                    lost = Some(e);
                    None
                }
                Err(e) => return Err(e.into()),
            };
            if let Some(pair) = pair {
                let r = pair.mem.run_ref_with(
                    (key, id.clone()),
                    f,
                    |p: &PairState<S, C>, (key, id): (u64, S::Id), f: &F| {
                        p.serves(key).then(|| f(&p.state, &id))
                    },
                );
                match r {
                    Ok(Some(v)) => return Ok(v),
                    Ok(None) | Err(CallError::ProcletGone(_)) => {}
                    Err(e) if node_lost(&e) => {
                        self.common.scaler.wake();
                        lost = Some(e);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if started.elapsed() > LEASE_PATIENCE {
                return Err(lost.map_or(ServiceError::Stuck, ServiceError::Lost));
            }
            pause(Duration::from_micros(200));
        }
    }

    /// The compute+memory pairs now, in routing-key order: each compute proclet with its
    /// memory proclet (both with their nodes), from one consistent view.
    pub fn pairs(&self) -> Result<Vec<(WorkerInfo, WorkerInfo)>, ServiceError> {
        Ok(self
            .common
            .scaler
            .contexts()?
            .into_iter()
            .map(|(c, pair)| {
                let m = WorkerInfo {
                    lo: c.lo,
                    id: pair.mem.id(),
                    node: pair.mem.location().ok(),
                };
                (c, m)
            })
            .collect())
    }

    common_methods!();

    /// Remove the service from every front door and destroy its proclets and state.
    pub fn destroy(self) -> Result<(), ServiceError> {
        self.common.destroy()
    }
}

/// How long [`StatefulService::read`] keeps looking for a client's pair while splits
/// and merges move it.
const LEASE_PATIENCE: Duration = Duration::from_secs(30);

/// Sleep without holding the node's worker.
fn pause(d: Duration) {
    granule_runtime::block_on(async move { tokio::time::sleep(d).await });
}

/// A client id's routing key: a hash of its encoding (the same in every process of the
/// identical binary), spread over all 64 bits.
pub fn routing_key<Id: Serialize>(id: &Id) -> u64 {
    let bytes = postcard::to_allocvec(id).unwrap_or_default();
    // FNV-1a, then the splitmix64 finalizer.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// What a pair's memory proclet answers.
#[derive(Serialize, Deserialize)]
enum PairReply<R, A> {
    /// The handler ran: its result (or panic message).
    Ran(Result<R, String>),
    /// This pair does not serve the key (any more, or yet): nothing ran.
    NotHere(A),
}

/// The call on a pair's memory proclet: check the key, run the handler on the shard's
/// state.
#[allow(clippy::type_complexity)]
fn on_pair<C, S, Req, Resp, H>(
    p: &mut PairState<S, C>,
    (key, id, req): (u64, S::Id, Req),
    h: &H,
) -> PairReply<Resp, (u64, S::Id, Req)>
where
    S: ServiceState,
    H: Handler<S, Req, Resp, C>,
{
    if !p.serves(key) {
        return PairReply::NotHere((key, id, req));
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        h.handle(&p.ctx, &mut p.state, &id, req)
    }))
    .map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "the handler panicked".into())
    });
    PairReply::Ran(r)
}

/// The wrapper a stateful call runs in on a compute proclet: the handler runs on the
/// state in the worker's memory proclet (next to it, so in line on this thread, unless
/// memory pressure moved it away). The load charged is the time the call held or waited
/// for the pair's state (see [`ScaleConfig::split_busy`]).
#[allow(clippy::type_complexity)]
fn stateful_via<C, S, Req, Resp, H>(
    w: &Worker<Pair<S, C>>,
    arg: (u64, S::Id, Req),
    h: &H,
) -> Result<Result<Resp, String>, Unserved<(u64, S::Id, Req)>>
where
    C: ProcletState,
    S: ServiceState,
    Req: Wire,
    Resp: Wire,
    H: Handler<S, Req, Resp, C>,
{
    let t = Instant::now();
    match w.ctx.mem.run_with(arg, *h, on_pair::<C, S, Req, Resp, H>) {
        Ok(PairReply::Ran(r)) => {
            w.charge(t.elapsed().as_nanos() as u64);
            Ok(r)
        }
        Ok(PairReply::NotHere(a)) => Err(Unserved::NotRun(a)),
        // The state went with its node (pressure had moved it away from this worker):
        // the scaler re-creates it, empty, and the caller sends the call again.
        Err(e) if node_lost(&e) => {
            w.context_lost();
            Err(Unserved::Lost(e))
        }
        Err(e) => Ok(Err(format!("the service's state: {e}"))),
    }
}

async fn call_stateful<C, S, Req, Resp, H>(
    pool: &Pool<Pair<S, C>>,
    id: S::Id,
    req: Req,
    h: H,
) -> Result<Resp, ServiceError>
where
    C: ProcletState + Clone,
    S: ServiceState,
    Req: Wire + Clone + Sync,
    Resp: Wire,
    H: Handler<S, Req, Resp, C>,
{
    let key = routing_key(&id);
    pool.call(key, (key, id, req), h, stateful_via::<C, S, Req, Resp, H>)
        .await?
        .map_err(ServiceError::State)
}

/// Install a stateful service in this node's front door (runs on the node's door).
fn install_stateful<C, S, Req, Resp, H>(
    door: &Door,
    (pool, ip, port): (Pool<Pair<S, C>>, Option<IpAddr>, u16),
    h: &H,
) -> Result<SocketAddr, String>
where
    C: ProcletState + Clone,
    S: ServiceState,
    S::Id: DeserializeOwned,
    Req: Wire + Clone + Sync,
    Resp: Wire,
    H: Handler<S, Req, Resp, C>,
{
    let h = *h;
    let (key, node_ip) = node_key()?;
    let dispatch: Dispatch = Arc::new(move |id: Option<String>, body| {
        let pool = pool.clone();
        Box::pin(async move {
            let id = id.ok_or_else(|| HttpError::NotFound("a client id is needed".into()))?;
            let id: S::Id = parse_id(&id)?;
            let req: Req = parse_body(&body)?;
            let resp = call_stateful(&pool, id, req, h)
                .await
                .map_err(|e| HttpError::Unavailable(e.to_string()))?;
            encode(&resp)
        })
    });
    http::register(
        &key,
        ip.unwrap_or(node_ip),
        port,
        door.name.clone(),
        "stateful",
        dispatch,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_keys_are_stable_and_spread() {
        assert_eq!(routing_key(&7u64), routing_key(&7u64));
        assert_eq!(routing_key(&"bob"), routing_key(&"bob".to_string()));
        // Consecutive ids land all over the key space: each half of it gets about half.
        let upper = (0..10_000u64).filter(|i| routing_key(i) >= 1 << 63).count();
        assert!((4_500..5_500).contains(&upper), "{upper}");
    }

    #[test]
    fn clients_split_by_the_predicate_and_merge_back() {
        let mut s = Clients::<u64, u64>::default();
        for i in 0..10 {
            *s.client(&i) = i * 10;
        }
        let right = ServiceState::split(&mut s, &|id: &u64| *id >= 6);
        assert_eq!(s.len(), 6);
        assert_eq!(right.len(), 4);
        assert_eq!(right.get(&9), Some(&90));
        assert_eq!(s.get(&9), None);
        ServiceState::merge(&mut s, right);
        assert_eq!(s.len(), 10);
        assert_eq!(s.get(&9), Some(&90));
        // By routing key, as the service splits: every client lands on exactly one side.
        let mid = 1u64 << 63;
        let up = ServiceState::split(&mut s, &|id: &u64| routing_key(id) >= mid);
        assert_eq!(up.len() + s.len(), 10);
        assert!(up.map.keys().all(|id| routing_key(id) >= mid));
        assert!(s.map.keys().all(|id| routing_key(id) < mid));
    }

    #[test]
    fn a_pair_serves_exactly_its_range() {
        let p = PairState {
            lo: 10,
            hi: 20,
            ctx: (),
            state: (),
        };
        assert!(!p.serves(9) && p.serves(10) && p.serves(19) && !p.serves(20));
        let top = PairState {
            lo: 0,
            hi: u64::MAX as u128 + 1,
            ctx: (),
            state: (),
        };
        assert!(top.serves(0) && top.serves(u64::MAX));
    }

    #[test]
    fn names_must_be_path_segments() {
        assert!(ServiceBuilder::new("ok-name_1").check_name().is_ok());
        for bad in ["", "a/b", "a b", "é"] {
            assert!(matches!(
                ServiceBuilder::new(bad).check_name(),
                Err(ServiceError::BadName(_))
            ));
        }
    }
}
