//! The two services and what they share: the builder, the per-node front-door
//! installation, and the handle's common operations.
//!
//! - [`StatelessService`]: the handler is registered once; every call gets a random 64-bit
//!   routing key and runs on the worker serving it.
//! - [`StatefulService`]: every call names a client; its routing key is a hash of the
//!   client id, so a client's calls go to the same worker while the table stands
//!   (sticky). Per-client state lives in a store of memory proclets ([`ClientShard`]s of
//!   an `AutoSharder` keyed by client id, split and merged by size); a call *checks out*
//!   its client's state from the store, runs the handler on the compute proclet and
//!   checks the state back in. A client checked out is leased: a second call for the
//!   same client waits until the first checks its state back in, so calls of one client
//!   run one at a time, in some order, each exactly once, while calls of different
//!   clients run in parallel. The compute proclets hold no client state, so their splits
//!   and merges never move or lose any; the store's splits and merges move whole client
//!   entries (leased ones too: the check-in is routed by client id, to wherever the
//!   entry went).

use crate::http::{self, encode, parse_body, parse_id, Dispatch, HttpError};
use crate::pool::{Pool, ScaleConfig, Scaler, Timeline, Worker, WorkerInfo};
use crate::ServiceError;
use futures::future::BoxFuture;
use granule_runtime::{CallError, Kind, NodeId, NodeState, Proclet, ProcletState, Wire};
use granule_sharded::{AutoSharder, Bounds, Hint, Shard};
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
    bounds: Bounds,
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
            bounds: Bounds::LOW_LATENCY,
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

    /// Size bounds of a stateful service's client-state shards (default
    /// [`Bounds::LOW_LATENCY`]).
    pub fn store_bounds(mut self, b: Bounds) -> Self {
        self.bounds = b;
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
        self.check_name()?;
        let pool = Pool::create(())?;
        let (scaler, thread) = Scaler::start(pool.clone(), (), self.scale.clone())?;
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
                    install_stateless::<Req, Resp, F>,
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
                p.call(key, req, handler, stateless_via::<Req, Resp, F>)
                    .await
            })
        });
        Ok(StatelessService { common, invoke })
    }

    /// Start a stateful service: `handler(&mut state, req)` runs for a client on the
    /// compute proclet its id routes to, with that client's state (created with
    /// `State::default()` on its first call). The handler captures nothing.
    pub fn stateful<Id, State, Req, Resp, F>(
        self,
        handler: F,
    ) -> Result<StatefulService<Id, State, Req, Resp>, ServiceError>
    where
        Id: ClientId,
        State: ProcletState + Default + Clone,
        Req: Wire + Clone + Sync,
        Resp: Wire,
        F: Fn(&mut State, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        self.check_name()?;
        let store: Store<Id, State> = AutoSharder::new(self.bounds)?;
        let pool = match Pool::create(store.clone()) {
            Ok(p) => p,
            Err(e) => {
                let _ = store.destroy();
                return Err(e);
            }
        };
        let (scaler, thread) = Scaler::start(pool.clone(), store.clone(), self.scale.clone())?;
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
                    install_stateful::<Id, State, Req, Resp, F>,
                )
            }) {
                let _ = common.destroy();
                let _ = store.destroy();
                return Err(e);
            }
        }
        let p = pool;
        let invoke: Invoke<Id, Req, Resp> = Arc::new(move |id: Id, req: Req| {
            let p = p.clone();
            Box::pin(async move { call_stateful(&p, id, req, handler).await })
        });
        Ok(StatefulService {
            common,
            invoke,
            store,
        })
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

impl<C: ProcletState + Clone> Common<C> {
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
            let r = door.run_ref((), |d: &Door, ()| {
                if let Ok((key, _)) = node_key() {
                    http::unregister(&key, &d.name);
                }
            });
            match r {
                Ok(()) | Err(CallError::ProcletGone(_)) => {}
                Err(e) => return Err(e.into()),
            }
            match door.destroy() {
                Ok(()) | Err(CallError::ProcletGone(_)) => {}
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

/// A stateless service (see the [module docs](self)). Started with
/// [`StatelessService::start`] or [`ServiceBuilder::stateless`]; the handle that started
/// it runs its scaler, which stops when the handle is dropped or destroyed.
pub struct StatelessService<Req, Resp> {
    common: Common<()>,
    invoke: Invoke<u64, Req, Resp>,
}

impl<Req, Resp> fmt::Debug for StatelessService<Req, Resp> {
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

fn stateless_via<Req, Resp, F: Fn(Req) -> Resp>(w: &Worker<()>, req: Req, f: &F) -> Resp {
    w.timed(|| f(req))
}

/// Install a stateless service in this node's front door (runs on the node's door).
fn install_stateless<Req, Resp, F>(
    door: &Door,
    (pool, ip, port): (Pool<()>, Option<IpAddr>, u16),
    f: &F,
) -> Result<SocketAddr, String>
where
    Req: Wire + Clone + Sync,
    Resp: Wire,
    F: Fn(Req) -> Resp + Copy + Send + Sync + 'static,
{
    let f = *f;
    let (key, node_ip) = node_key()?;
    let dispatch: Dispatch = Arc::new(move |_id: Option<String>, body| {
        let pool = pool.clone();
        Box::pin(async move {
            let req: Req = parse_body(&body)?;
            let resp = pool
                .call(rand::random(), req, f, stateless_via::<Req, Resp, F>)
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

/// What a client id must be: ordered (the store keeps clients in id ranges),
/// serializable (it travels, and is hashed to its routing key from its encoding).
pub trait ClientId: Ord + Clone + Wire + Sync + fmt::Debug {}
impl<T: Ord + Clone + Wire + Sync + fmt::Debug> ClientId for T {}

/// One shard of a stateful service's client-state store: the clients of one id range.
/// A client whose state is checked out by a call in progress is present with `None`.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct ClientShard<Id: ClientId, State: ProcletState> {
    clients: BTreeMap<Id, Option<State>>,
}

impl<Id: ClientId, State: ProcletState> Default for ClientShard<Id, State> {
    fn default() -> Self {
        ClientShard {
            clients: BTreeMap::new(),
        }
    }
}

impl<Id: ClientId, State: ProcletState> ClientShard<Id, State> {
    /// Bytes a client's entry is counted as (for the store's size bounds).
    const ENTRY: u64 = (std::mem::size_of::<Id>() + std::mem::size_of::<State>() + 64) as u64;
}

impl<Id: ClientId, State: ProcletState + Default> Shard for ClientShard<Id, State> {
    type Key = Id;

    fn split(&mut self) -> Option<(Id, Self)> {
        let mid = self.clients.keys().nth(self.clients.len() / 2)?.clone();
        if Some(&mid) == self.clients.keys().next() {
            return None;
        }
        let right = self.clients.split_off(&mid);
        Some((mid, ClientShard { clients: right }))
    }

    fn merge(&mut self, mut right: Self) {
        self.clients.append(&mut right.clients);
    }

    fn footprint(&self) -> u64 {
        Self::ENTRY * self.clients.len() as u64
    }
}

type Store<Id, State> = AutoSharder<ClientShard<Id, State>>;

/// A stateful service (see the [module docs](self)).
pub struct StatefulService<Id: ClientId, State: ProcletState + Default, Req, Resp> {
    common: Common<Store<Id, State>>,
    invoke: Invoke<Id, Req, Resp>,
    store: Store<Id, State>,
}

impl<Id: ClientId, State: ProcletState + Default, Req, Resp> fmt::Debug
    for StatefulService<Id, State, Req, Resp>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatefulService")
            .field("name", &self.common.name)
            .finish()
    }
}

impl<Id, State, Req, Resp> StatefulService<Id, State, Req, Resp>
where
    Id: ClientId,
    State: ProcletState + Default + Clone,
    Req: Wire + Clone + Sync,
    Resp: Wire,
{
    /// Start a service named `name` with default options (see [`ServiceBuilder`]).
    pub fn start<F>(name: impl Into<String>, handler: F) -> Result<Self, ServiceError>
    where
        F: Fn(&mut State, Req) -> Resp + Copy + Send + Sync + 'static,
    {
        ServiceBuilder::new(name).stateful(handler)
    }

    /// Call the service for client `id`.
    pub fn call(&self, id: Id, req: Req) -> Result<Resp, ServiceError> {
        granule_runtime::block_on(self.call_async(id, req))
    }

    /// [`StatefulService::call`] as a future (starts when first polled).
    pub fn call_async(&self, id: Id, req: Req) -> BoxFuture<'static, Result<Resp, ServiceError>> {
        (self.invoke)(id, req)
    }

    /// A copy of client `id`'s state (`None` if it never called, or a call of it is in
    /// progress right now).
    pub fn client_state(&self, id: &Id) -> Result<Option<State>, ServiceError> {
        Ok(self
            .store
            .route_ref(id, id.clone(), |s: &ClientShard<Id, State>, id: Id| {
                s.clients.get(&id).cloned().flatten()
            })?)
    }

    /// The client-state shards: how many there are now.
    pub fn store_shards(&self) -> Result<usize, ServiceError> {
        Ok(self.store.shards()?.len())
    }

    common_methods!();

    /// Remove the service from every front door and destroy its proclets and state.
    pub fn destroy(self) -> Result<(), ServiceError> {
        self.common.destroy()?;
        self.store.destroy()?;
        Ok(())
    }
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

async fn call_stateful<Id, State, Req, Resp, F>(
    pool: &Pool<Store<Id, State>>,
    id: Id,
    req: Req,
    f: F,
) -> Result<Resp, ServiceError>
where
    Id: ClientId,
    State: ProcletState + Default + Clone,
    Req: Wire + Clone + Sync,
    Resp: Wire,
    F: Fn(&mut State, Req) -> Resp + Copy + Send + Sync + 'static,
{
    let key = routing_key(&id);
    pool.call(key, (id, req), f, stateful_via::<Id, State, Req, Resp, F>)
        .await?
        .map_err(ServiceError::State)
}

/// How long a call waits for its client's state while another call of the same client
/// holds it.
const LEASE_PATIENCE: Duration = Duration::from_secs(30);

/// Sleep without holding the node's worker.
fn pause(d: Duration) {
    granule_runtime::block_on(async move { tokio::time::sleep(d).await });
}

/// The wrapper a stateful call runs in on a compute proclet: check the client's state
/// out of the store, run the handler on it, check it back in.
fn stateful_via<Id, State, Req, Resp, F>(
    w: &Worker<Store<Id, State>>,
    (id, req): (Id, Req),
    f: &F,
) -> Result<Resp, String>
where
    Id: ClientId,
    State: ProcletState + Default + Clone,
    F: Fn(&mut State, Req) -> Resp,
{
    let store = &w.ctx;
    let started = Instant::now();
    let mut wait = Duration::from_micros(20);
    let mut state = loop {
        let got = store.route(
            &id,
            Hint::Grow,
            id.clone(),
            |s: &mut ClientShard<Id, State>, id: Id| {
                s.clients
                    .entry(id)
                    .or_insert_with(|| Some(State::default()))
                    .take()
            },
        );
        match got {
            Ok(Some(s)) => break s,
            Ok(None) => {
                if started.elapsed() > LEASE_PATIENCE {
                    return Err(format!(
                        "client {id:?}: its state stayed checked out for {LEASE_PATIENCE:?}"
                    ));
                }
                pause(wait);
                wait = (wait * 2).min(Duration::from_millis(2));
            }
            Err(e) => return Err(format!("client {id:?}: checking its state out: {e}")),
        }
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        w.timed(|| f(&mut state, req))
    }));
    // The state goes back whatever the handler did (a panic leaves what it left).
    let back = store.route(
        &id,
        Hint::Same,
        (id.clone(), state),
        |s: &mut ClientShard<Id, State>, (id, st): (Id, State)| {
            s.clients.insert(id, Some(st));
        },
    );
    match r {
        Ok(resp) => back
            .map(|()| resp)
            .map_err(|e| format!("client {id:?}: checking its state back in: {e}")),
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// Install a stateful service in this node's front door (runs on the node's door).
fn install_stateful<Id, State, Req, Resp, F>(
    door: &Door,
    (pool, ip, port): (Pool<Store<Id, State>>, Option<IpAddr>, u16),
    f: &F,
) -> Result<SocketAddr, String>
where
    Id: ClientId + DeserializeOwned,
    State: ProcletState + Default + Clone,
    Req: Wire + Clone + Sync,
    Resp: Wire,
    F: Fn(&mut State, Req) -> Resp + Copy + Send + Sync + 'static,
{
    let f = *f;
    let (key, node_ip) = node_key()?;
    let dispatch: Dispatch = Arc::new(move |id: Option<String>, body| {
        let pool = pool.clone();
        Box::pin(async move {
            let id = id.ok_or_else(|| HttpError::NotFound("a client id is needed".into()))?;
            let id: Id = parse_id(&id)?;
            let req: Req = parse_body(&body)?;
            let resp = call_stateful(&pool, id, req, f)
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
    fn client_shards_split_at_the_median_and_merge_back() {
        let mut s = ClientShard::<u64, u64>::default();
        assert!(s.split().is_none());
        for i in 0..10 {
            s.clients.insert(i, Some(i * 10));
        }
        s.clients.insert(10, None); // checked out
        let fp = s.footprint();
        let (k, right) = s.split().unwrap();
        assert_eq!(k, 5);
        assert_eq!(s.clients.len(), 5);
        assert_eq!(right.clients.len(), 6);
        assert_eq!(right.clients.get(&10), Some(&None));
        s.merge(right);
        assert_eq!(s.footprint(), fp);
        assert_eq!(s.clients.get(&9), Some(&Some(90)));
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
