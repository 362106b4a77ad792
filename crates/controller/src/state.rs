//! The controller's state and the decisions made on it (registration, placement, the
//! location map, failure detection). Pure logic, no I/O: the server wraps it in a lock.
//!
//! Placement policy (documented in docs/guide/programming.md):
//! - **compute** proclets go to the node with the most idle cores: spec cores − cores busy
//!   in its last heartbeat − 0.25 for each compute proclet placed on it since;
//! - **memory** proclets go to the node with the most free memory: spec memory − resident
//!   memory in its last heartbeat − the memory hints of proclets placed on it since;
//! - **hybrid** proclets go to the node with the largest sum of both, each as a fraction of
//!   the node's spec.
//!
//! Nodes close to the best (within 0.25 idle cores, 5 % of the largest node's memory, or
//! 0.1 for hybrid scores) count as equally good; among them the node hosting the fewest
//! proclets of that kind wins, then the better score, then the lower node id. So
//! proclets whose size is unknown spread evenly over similar nodes.
//! Only alive nodes are candidates, and the driver only when no other node is alive (it
//! runs the application's own thread; a proclet can still be put there by naming it).

use granule_wire::{
    BinaryHash, CgroupPaths, ClusterEvent, Epoch, EventKind, Kind, Location, NodeId, NodeInfo,
    NodeSpec, NodeState, ProcletId, ReplicaSet, Resource, Role, Usage,
};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Cores assumed taken by each compute proclet placed since a node's last heartbeat.
const PROVISIONAL_CORES: f64 = 0.25;
/// Nodes within this many idle cores of the best count as equally good for compute.
const COMPUTE_SLACK: f64 = 0.25;
/// Nodes within this fraction of the largest node's memory of the best count as equally
/// good for memory.
const MEMORY_SLACK: f64 = 0.05;
/// Same for hybrid scores (a sum of two fractions).
const HYBRID_SLACK: f64 = 0.1;

/// Tunables.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// How often nodes send heartbeats.
    pub heartbeat: Duration,
    /// A node silent for longer is declared dead.
    pub failure_timeout: Duration,
    /// How long a dead or departed node stays in the node list after it died or left
    /// (`cluster.forget_dead_after`). Only the list: see [`State::prune_dead`] for what
    /// the state keeps longer.
    pub forget_dead_after: Duration,
    /// Largest id block handed out at once.
    pub max_id_block: u32,
    /// Where to serve the dashboard, `/api/cluster` and the controller's `/metrics`
    /// (`IP:PORT`; port 0 picks a free one). `None`: no HTTP side. Default
    /// `127.0.0.1:0` (the runtime and the command pass `cluster.dashboard`).
    pub dashboard: Option<String>,
    /// The bounds of the dashboard's HTTP listener (connections, timeouts, descriptor
    /// reserve; the runtime and the command pass `http.*` and `node.fd_reserve`).
    pub http: granule_http::Limits,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            heartbeat: Duration::from_millis(100),
            failure_timeout: Duration::from_millis(1000),
            forget_dead_after: Duration::from_secs(60),
            max_id_block: 1 << 16,
            dashboard: Some("127.0.0.1:0".into()),
            http: granule_http::Limits::default(),
        }
    }
}

/// Why a proclet could not be placed.
#[derive(Clone, Debug, PartialEq)]
pub enum PlaceError {
    /// No alive node at all.
    NoNode,
    /// Nodes exist, but none has room.
    NoRoom(String),
}

/// Memory a node can still take: its budget (or its cgroup limit, if lower) minus what it
/// uses (resident memory or the cgroup's charge, whichever is larger) and what was placed
/// on it since its last heartbeat.
fn mem_room(e: &NodeEntry) -> f64 {
    let (used, limit) = e.info.memory();
    limit as f64 - (used + e.provisional_mem) as f64
}

struct NodeEntry {
    info: NodeInfo,
    last_seen: Instant,
    /// Placed since the last heartbeat (not yet visible in `usage`).
    provisional_cores: f64,
    provisional_mem: u64,
    /// Proclets placed on the node by kind (placements minus forgets seen here).
    placed: [u32; 3],
    /// When it was declared dead or left (`None` while alive).
    gone_at: Option<Instant>,
}

impl NodeEntry {
    /// How long ago it died or left (`None` while alive).
    fn gone_for(&self, now: Instant) -> Option<Duration> {
        self.gone_at.map(|t| now.saturating_duration_since(t))
    }
}

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum RegisterError {
    BinaryMismatch(String),
    Invalid(String),
}

/// The controller's whole state.
pub struct State {
    pub config: ControllerConfig,
    nodes: BTreeMap<NodeId, NodeEntry>,
    cluster_binary: Option<(BinaryHash, String)>,
    next_node: u32,
    next_proclet: u64,
    locations: HashMap<ProcletId, (NodeId, Epoch, Kind)>,
    /// The backups of replicated proclets (their primary is the location above), in the
    /// order they become primary should the primary's node die.
    backups: HashMap<ProcletId, Vec<NodeId>>,
    /// Proclets forgotten (destroyed) recently, oldest first, so that a location update
    /// overtaken by the destroy does not bring them back (see [`State::set_location`]).
    tombstones: VecDeque<(ProcletId, Instant)>,
    tombstoned: std::collections::HashSet<ProcletId>,
    members_version: u64,
    /// The most recent cluster events (at most [`EVENT_LOG`]), oldest first.
    events: VecDeque<ClusterEvent>,
    next_event: u64,
    /// Dashboard panels published by layers above (see [`crate::panels`]).
    pub panels: crate::panels::Panels,
}

/// How long a destroyed proclet's id is remembered (far longer than any location update
/// can be in flight).
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(60);

/// How many recent events the controller keeps for the dashboard and `granule top`.
pub const EVENT_LOG: usize = 2000;

impl State {
    pub fn new(config: ControllerConfig) -> Self {
        State {
            config,
            nodes: BTreeMap::new(),
            cluster_binary: None,
            next_node: 1,
            next_proclet: 1,
            locations: HashMap::new(),
            backups: HashMap::new(),
            tombstones: VecDeque::new(),
            tombstoned: std::collections::HashSet::new(),
            members_version: 1,
            events: VecDeque::new(),
            next_event: 1,
            panels: crate::panels::Panels::default(),
        }
    }

    pub fn members_version(&self) -> u64 {
        self.members_version
    }

    /// Admit a node. Proclet hosts must present the cluster's binary hash; the first host
    /// to register fixes it.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &mut self,
        role: Role,
        spec: NodeSpec,
        addr: String,
        pid: u32,
        binary: Option<BinaryHash>,
        program: &str,
        now: Instant,
    ) -> Result<NodeId, RegisterError> {
        if !role.hosts_proclets() {
            return Err(RegisterError::Invalid(format!(
                "a {role:?} cannot register as a node"
            )));
        }
        if !(spec.cores > 0.0 && spec.cores.is_finite()) || spec.mem_bytes == 0 {
            return Err(RegisterError::Invalid(format!(
                "bad node spec: cpu={} mem={} (cpu must be > 0 and mem > 0)",
                spec.cores, spec.mem_bytes
            )));
        }
        let Some(hash) = binary else {
            return Err(RegisterError::Invalid(
                "a proclet host must present the hash of its executable".into(),
            ));
        };
        match &self.cluster_binary {
            None => self.cluster_binary = Some((hash, program.to_string())),
            Some((h, first)) if *h != hash => {
                return Err(RegisterError::BinaryMismatch(format!(
                    "binary mismatch: {program} is not the executable this cluster runs \
                     ({first}); every node must run the identical binary because shipped \
                     closures are offsets into it. Start the node from the driver's build."
                )))
            }
            Some(_) => {}
        }
        let id = NodeId(self.next_node);
        self.next_node += 1;
        self.nodes.insert(
            id,
            NodeEntry {
                info: NodeInfo {
                    id,
                    role,
                    addr,
                    pid,
                    spec,
                    usage: Usage::default(),
                    state: NodeState::Alive,
                    last_seen_ms: 0,
                    cgroups: None,
                    metrics_addr: None,
                },
                last_seen: now,
                provisional_cores: 0.0,
                provisional_mem: 0,
                placed: [0; 3],
                gone_at: None,
            },
        );
        self.members_version += 1;
        let mut e = ClusterEvent::now(EventKind::NodeJoined, id, format!("{role:?} {id}"));
        e.detail = format!("cpu={} mem={} MiB", spec.cores, spec.mem_bytes >> 20);
        self.record(e);
        Ok(id)
    }

    /// Where a node serves its metrics.
    pub fn set_metrics_addr(&mut self, node: NodeId, addr: Option<String>) {
        if let Some(e) = self.nodes.get_mut(&node) {
            e.info.metrics_addr = addr;
        }
    }

    /// Keep an event (numbering it); the oldest is dropped past `EVENT_LOG`.
    pub fn record(&mut self, mut e: ClusterEvent) {
        e.seq = self.next_event;
        self.next_event += 1;
        if self.events.len() == EVENT_LOG {
            self.events.pop_front();
        }
        self.events.push_back(e);
    }

    /// Kept events numbered above `after`, oldest first, at most `limit`.
    pub fn events_after(&self, after: u64, limit: usize) -> Vec<ClusterEvent> {
        // Sequence numbers are consecutive: skip straight to the first one wanted.
        let first = self.events.front().map_or(0, |e| e.seq);
        let skip = after.saturating_add(1).saturating_sub(first) as usize;
        self.events.iter().skip(skip).take(limit).cloned().collect()
    }

    /// The number the next event will get.
    pub fn next_event_seq(&self) -> u64 {
        self.next_event
    }

    /// Record a heartbeat. Returns false if the node is unknown or already declared dead
    /// (it must then leave: its proclets are considered lost).
    pub fn heartbeat(
        &mut self,
        node: NodeId,
        usage: Usage,
        events: Vec<ClusterEvent>,
        now: Instant,
    ) -> bool {
        match self.nodes.get_mut(&node) {
            Some(e) if e.info.state == NodeState::Alive => {
                e.info.usage = usage;
                e.last_seen = now;
                e.provisional_cores = 0.0;
                e.provisional_mem = 0;
                // Events name their own node: a process hosting several nodes (tests)
                // sends them all with whichever heartbeat comes first.
                for ev in events {
                    self.record(ev);
                }
                true
            }
            _ => false,
        }
    }

    /// Hand out `count` fresh proclet ids.
    pub fn alloc_ids(&mut self, count: u32) -> (u64, u64) {
        let count = count.clamp(1, self.config.max_id_block) as u64;
        let start = self.next_proclet;
        self.next_proclet += count;
        (start, self.next_proclet)
    }

    fn alive(&self) -> impl Iterator<Item = &NodeEntry> {
        self.nodes
            .values()
            .filter(|e| e.info.state == NodeState::Alive)
    }

    /// Record the cgroups a node runs in (from its registration).
    pub fn set_cgroups(&mut self, node: NodeId, cgroups: CgroupPaths) {
        if let Some(e) = self.nodes.get_mut(&node) {
            e.info.cgroups = Some(cgroups);
        }
    }

    /// Choose a node for a new proclet (see the module doc) and record its location.
    /// Memory and hybrid proclets only go to nodes with room for their hint, preferring
    /// those without memory pressure; `NoRoom` when no node has room.
    pub fn place(
        &mut self,
        proclet: ProcletId,
        kind: Kind,
        mem_hint: u64,
    ) -> Result<Location, PlaceError> {
        let any_node = self.alive().any(|e| e.info.role == Role::Node);
        let score = |e: &NodeEntry| -> f64 {
            let spec = e.info.spec;
            let idle = spec.cores - e.info.usage.cores_busy - e.provisional_cores;
            let free = mem_room(e);
            match kind {
                Kind::Compute => idle,
                Kind::Memory => free,
                Kind::Hybrid => idle / spec.cores + free / spec.mem_bytes as f64,
            }
        };
        let hosts: Vec<&NodeEntry> = self
            .alive()
            .filter(|e| !any_node || e.info.role == Role::Node)
            .collect();
        if hosts.is_empty() {
            return Err(PlaceError::NoNode);
        }
        let candidates: Vec<&NodeEntry> = match kind {
            Kind::Compute => hosts,
            Kind::Memory | Kind::Hybrid => {
                let roomy: Vec<&NodeEntry> = hosts
                    .into_iter()
                    .filter(|e| mem_room(e) >= mem_hint as f64)
                    .collect();
                // A node under memory pressure is shedding: not where new state should go
                // while another has room. But pressure may be only predicted (memory
                // growing fast, as it does on every node while a program loads its data),
                // and refusing a proclet that fits is worse than placing it where it fits.
                let calm: Vec<&NodeEntry> = roomy
                    .iter()
                    .copied()
                    .filter(|e| !e.info.usage.mem_pressure)
                    .collect();
                if calm.is_empty() {
                    roomy
                } else {
                    calm
                }
            }
        };
        if candidates.is_empty() {
            return Err(PlaceError::NoRoom(format!(
                "no node has room for a {kind} proclet of {mem_hint} bytes (every node is \
                 out of memory budget)"
            )));
        }
        let top = candidates
            .iter()
            .map(|e| score(e))
            .fold(f64::NEG_INFINITY, f64::max);
        let slack = match kind {
            Kind::Compute => COMPUTE_SLACK,
            Kind::Memory => {
                MEMORY_SLACK
                    * candidates
                        .iter()
                        .map(|e| e.info.spec.mem_bytes as f64)
                        .fold(0.0, f64::max)
            }
            Kind::Hybrid => HYBRID_SLACK,
        };
        let best = candidates
            .iter()
            .filter(|e| score(e) >= top - slack)
            .min_by(|a, b| {
                a.placed[kind.index()]
                    .cmp(&b.placed[kind.index()])
                    .then(
                        score(b)
                            .partial_cmp(&score(a))
                            .unwrap_or(std::cmp::Ordering::Equal),
                    )
                    .then(a.info.id.cmp(&b.info.id))
            })
            .ok_or(PlaceError::NoNode)?
            .info
            .id;
        let e = self.nodes.get_mut(&best).ok_or(PlaceError::NoNode)?;
        match kind {
            Kind::Compute => e.provisional_cores += PROVISIONAL_CORES,
            Kind::Memory => e.provisional_mem += mem_hint,
            Kind::Hybrid => {
                e.provisional_cores += PROVISIONAL_CORES;
                e.provisional_mem += mem_hint;
            }
        }
        e.placed[kind.index()] += 1;
        let loc = Location {
            node: best,
            addr: e.info.addr.clone(),
            epoch: 1,
        };
        if let Some((old, _, k)) = self.locations.insert(proclet, (best, 1, kind)) {
            self.unplace(old, k);
        }
        Ok(loc)
    }

    /// A destination for `amount` of `resource` that `from` wants to shed (bytes for
    /// memory, millicores for CPU): the live node other than `from`, not under pressure
    /// for that resource, with the most room for it, if that room covers `amount`. The
    /// amount is counted as provisionally taken until the node's next heartbeat, so
    /// several shedding nodes do not all pick the same destination.
    pub fn propose(
        &mut self,
        from: NodeId,
        resource: Resource,
        amount: u64,
    ) -> Option<(NodeId, String)> {
        let any_node = self
            .alive()
            .any(|e| e.info.role == Role::Node && e.info.id != from);
        let room = |e: &NodeEntry| -> f64 {
            match resource {
                Resource::Memory => mem_room(e),
                Resource::Cpu => {
                    (e.info.spec.cores - e.info.usage.cores_busy - e.provisional_cores) * 1000.0
                }
            }
        };
        let best = self
            .alive()
            .filter(|e| e.info.id != from && (!any_node || e.info.role == Role::Node))
            .filter(|e| match resource {
                Resource::Memory => !e.info.usage.mem_pressure,
                Resource::Cpu => !e.info.usage.cpu_pressure,
            })
            .filter(|e| room(e) >= amount as f64)
            .max_by(|a, b| {
                room(a)
                    .partial_cmp(&room(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then(b.info.id.cmp(&a.info.id))
            })?
            .info
            .id;
        let e = self.nodes.get_mut(&best)?;
        match resource {
            Resource::Memory => e.provisional_mem += amount,
            Resource::Cpu => e.provisional_cores += amount as f64 / 1000.0,
        }
        Some((best, e.info.addr.clone()))
    }

    /// Record a location unless a newer epoch is already known. Returns whether it was
    /// recorded.
    pub fn set_location(
        &mut self,
        proclet: ProcletId,
        node: NodeId,
        epoch: Epoch,
        kind: Kind,
    ) -> bool {
        if !self.nodes.contains_key(&node) || self.tombstoned.contains(&proclet) {
            return false;
        }
        match self.locations.get(&proclet) {
            Some((_, e, _)) if *e > epoch => false,
            _ => {
                if let Some((old, _, k)) = self.locations.insert(proclet, (node, epoch, kind)) {
                    self.unplace(old, k);
                }
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.placed[kind.index()] += 1;
                }
                true
            }
        }
    }

    /// Where a proclet is, and whether its node is alive.
    pub fn locate(&self, proclet: ProcletId) -> Option<(Location, bool)> {
        let (node, epoch, _) = *self.locations.get(&proclet)?;
        let e = self.nodes.get(&node)?;
        Some((
            Location {
                node,
                addr: e.info.addr.clone(),
                epoch,
            },
            e.info.state == NodeState::Alive,
        ))
    }

    /// Choose `count` more backups for a proclet: live nodes (not the driver, unless no
    /// other node lives) other than its primary's and its backups' nodes, those with the
    /// most memory room first. Returns the whole configuration they would make, not yet
    /// recorded: the primary records it ([`State::record_backups`]) once the new backups
    /// hold the state — until then a failover must not pick them. A proclet that cannot
    /// get all of them gets none (`NoRoom` says how many nodes it needs).
    pub fn place_backups(
        &mut self,
        proclet: ProcletId,
        count: u32,
    ) -> Result<ReplicaSet, PlaceError> {
        let (primary, _, _) = *self.locations.get(&proclet).ok_or(PlaceError::NoNode)?;
        let have = self.backups.get(&proclet).cloned().unwrap_or_default();
        let any_node = self.alive().any(|e| e.info.role == Role::Node);
        let mut candidates: Vec<&NodeEntry> = self
            .alive()
            .filter(|e| !any_node || e.info.role == Role::Node)
            .filter(|e| e.info.id != primary && !have.contains(&e.info.id))
            .collect();
        if candidates.len() < count as usize {
            let copies = have.len() + 1 + count as usize;
            return Err(PlaceError::NoRoom(format!(
                "{copies} copies of proclet {proclet} need {copies} live nodes (one copy per \
                 node); {} node(s) can take one",
                have.len() + 1 + candidates.len()
            )));
        }
        candidates.sort_by(|a, b| {
            mem_room(b)
                .partial_cmp(&mem_room(a))
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.info.id.cmp(&b.info.id))
        });
        let chosen: Vec<NodeId> = candidates
            .iter()
            .take(count as usize)
            .map(|e| e.info.id)
            .collect();
        let mut set = self
            .replica_set_of(proclet, &have)
            .ok_or(PlaceError::NoNode)?;
        set.backups.extend(
            self.replica_set_of(proclet, &chosen)
                .ok_or(PlaceError::NoNode)?
                .backups,
        );
        Ok(set)
    }

    /// Record a replicated proclet's configuration, sent by its primary once its new
    /// backups hold the state. Refused (false) when it is not the current one: the
    /// proclet's primary or epoch changed meanwhile, or a backup's node died.
    pub fn record_backups(&mut self, set: &ReplicaSet) -> bool {
        let current = self
            .locations
            .get(&set.proclet)
            .is_some_and(|(n, e, _)| *n == set.primary.node && *e == set.epoch);
        let alive = set.backups.iter().all(|b| {
            self.nodes
                .get(&b.node)
                .is_some_and(|e| e.info.state == NodeState::Alive)
        });
        if !current || !alive {
            return false;
        }
        self.backups
            .insert(set.proclet, set.backups.iter().map(|b| b.node).collect());
        true
    }

    /// A replicated proclet's configuration (`None`: unknown, or not replicated). Its
    /// epoch is the location's.
    pub fn replica_set(&self, proclet: ProcletId) -> Option<ReplicaSet> {
        self.replica_set_of(proclet, self.backups.get(&proclet)?)
    }

    /// The configuration of `proclet` with these backups.
    fn replica_set_of(&self, proclet: ProcletId, backups: &[NodeId]) -> Option<ReplicaSet> {
        let (loc, _) = self.locate(proclet)?;
        Some(ReplicaSet {
            proclet,
            epoch: loc.epoch,
            primary: loc,
            backups: backups
                .iter()
                .filter_map(|n| {
                    Some(Location {
                        node: *n,
                        addr: self.nodes.get(n)?.info.addr.clone(),
                        epoch: 0,
                    })
                })
                .collect(),
        })
    }

    /// Whether a proclet has backups.
    pub fn is_replicated(&self, proclet: ProcletId) -> bool {
        self.backups.contains_key(&proclet)
    }

    /// A node was declared dead: every replicated proclet whose primary it held gets its
    /// first live backup as primary, and every one that had a backup there loses it —
    /// each under a new epoch. Returns the new configurations (to tell each primary).
    /// A proclet whose every copy was on dead nodes keeps its location (it is lost, and
    /// calls to it say its node is unreachable).
    pub fn fail_over(&mut self, dead: NodeId) -> Vec<ReplicaSet> {
        let alive = |st: &State, n: NodeId| {
            st.nodes
                .get(&n)
                .is_some_and(|e| e.info.state == NodeState::Alive)
        };
        let affected: Vec<ProcletId> = self
            .backups
            .iter()
            .filter(|(p, b)| {
                b.contains(&dead) || self.locations.get(p).is_some_and(|(n, _, _)| *n == dead)
            })
            .map(|(p, _)| *p)
            .collect();
        let mut changed = Vec::new();
        for p in affected {
            let Some(&(primary, epoch, kind)) = self.locations.get(&p) else {
                continue;
            };
            let mut backups = self.backups.remove(&p).unwrap_or_default();
            backups.retain(|n| *n != dead && alive(self, *n));
            let new_primary = if primary == dead || !alive(self, primary) {
                if backups.is_empty() {
                    continue;
                }
                backups.remove(0)
            } else {
                primary
            };
            self.locations.insert(p, (new_primary, epoch + 1, kind));
            if new_primary != primary {
                self.unplace(primary, kind);
                if let Some(n) = self.nodes.get_mut(&new_primary) {
                    n.placed[kind.index()] += 1;
                }
                let mut e = ClusterEvent::now(
                    EventKind::Failover,
                    primary,
                    format!("proclet {p}: its backup became the primary"),
                );
                e.to = Some(new_primary);
                self.record(e);
            }
            self.backups.insert(p, backups);
            if let Some(set) = self.replica_set(p) {
                changed.push(set);
            }
        }
        changed
    }

    /// A replicated proclet moved by its primary `from`: `set.primary` is the primary now,
    /// under `set.epoch`, with `set.backups`. Refused (`false`) unless `from` is the
    /// current primary, the epoch is the next one, and every copy is on a distinct live
    /// node.
    pub fn hand_over(&mut self, from: NodeId, set: &ReplicaSet) -> bool {
        let Some(&(primary, epoch, kind)) = self.locations.get(&set.proclet) else {
            return false;
        };
        let alive = |st: &State, n: NodeId| {
            st.nodes
                .get(&n)
                .is_some_and(|e| e.info.state == NodeState::Alive)
        };
        let mut nodes: Vec<NodeId> = set.backups.iter().map(|b| b.node).collect();
        nodes.push(set.primary.node);
        let distinct = {
            let mut n = nodes.clone();
            n.sort();
            n.dedup();
            n.len() == nodes.len()
        };
        if primary != from
            || set.epoch != epoch + 1
            || !self.backups.contains_key(&set.proclet)
            || !distinct
            || !nodes.iter().all(|n| alive(self, *n))
        {
            return false;
        }
        self.locations
            .insert(set.proclet, (set.primary.node, set.epoch, kind));
        self.unplace(from, kind);
        if let Some(n) = self.nodes.get_mut(&set.primary.node) {
            n.placed[kind.index()] += 1;
        }
        self.backups
            .insert(set.proclet, set.backups.iter().map(|b| b.node).collect());
        // The move's event comes from the node that made it, as for any move.
        true
    }

    /// A proclet of `kind` no longer counts as located on `node`.
    fn unplace(&mut self, node: NodeId, kind: Kind) {
        if let Some(n) = self.nodes.get_mut(&node) {
            n.placed[kind.index()] = n.placed[kind.index()].saturating_sub(1);
        }
    }

    /// A destroyed proclet: forget where it was, for good. Its id is never handed out
    /// again, and the last node that moved it may report its new home after the destroy
    /// (the move's source tells the controller after the destination took it, and the
    /// destination may destroy it first): such late updates are ignored for
    /// `TOMBSTONE_TTL`, or the proclet would be "located" on a node that no longer has
    /// it and every call to it would bounce there until it gave up.
    pub fn forget(&mut self, proclet: ProcletId) {
        if let Some((node, _, kind)) = self.locations.remove(&proclet) {
            self.unplace(node, kind);
        }
        self.backups.remove(&proclet);
        let now = Instant::now();
        while let Some(&(old, at)) = self.tombstones.front() {
            if now.saturating_duration_since(at) < TOMBSTONE_TTL {
                break;
            }
            self.tombstones.pop_front();
            self.tombstoned.remove(&old);
        }
        if self.tombstoned.insert(proclet) {
            self.tombstones.push_back((proclet, now));
        }
    }

    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        self.nodes.get(&id).map(|e| &e.info)
    }

    /// The node list: every live node, and the dead or departed ones for
    /// `config.forget_dead_after` after they died or left (a user sees what happened, and
    /// a long-running cluster's list does not fill with the dead), each with its age.
    pub fn list(&self, now: Instant) -> Vec<NodeInfo> {
        self.nodes
            .values()
            .filter(|e| {
                e.gone_for(now)
                    .is_none_or(|d| d <= self.config.forget_dead_after)
            })
            .map(|e| {
                let mut i = e.info.clone();
                i.last_seen_ms = now.saturating_duration_since(e.last_seen).as_millis() as u64;
                i
            })
            .collect()
    }

    /// Declare a node dead at `now`. Returns true if it was alive.
    pub fn mark_dead(&mut self, node: NodeId, now: Instant) -> bool {
        match self.nodes.get_mut(&node) {
            Some(e) if e.info.state == NodeState::Alive => {
                e.info.state = NodeState::Dead;
                e.gone_at = Some(now);
                self.members_version += 1;
                let subject = format!("{:?} {node}", e.info.role);
                self.record(ClusterEvent::now(EventKind::NodeDown, node, subject));
                true
            }
            _ => false,
        }
    }

    /// Record that a node left on purpose at `now`. Returns true if it was alive.
    pub fn mark_left(&mut self, node: NodeId, now: Instant) -> bool {
        match self.nodes.get_mut(&node) {
            Some(e) if e.info.state == NodeState::Alive => {
                e.info.state = NodeState::Left;
                e.gone_at = Some(now);
                self.members_version += 1;
                let subject = format!("{:?} {node}", e.info.role);
                self.record(ClusterEvent::now(EventKind::NodeLeft, node, subject));
                true
            }
            _ => false,
        }
    }

    /// Forget dead (and departed) nodes for good, keeping the state from growing under
    /// churn: one no proclet was located on once the list no longer shows it
    /// (`config.forget_dead_after`); one that held proclets after `retention` as well —
    /// until then a call to one of its proclets is answered "node unreachable" (the
    /// proclet was lost with it), afterwards "gone". The list itself forgets a node after
    /// `forget_dead_after` whatever it held ([`State::list`]). Node ids are never given
    /// again, and a forgotten node's heartbeats are refused like a dead one's.
    pub fn prune_dead(&mut self, now: Instant, retention: Duration) {
        let listed_for = self.config.forget_dead_after;
        let mut with_proclets = std::collections::HashSet::new();
        let doomed: Vec<NodeId> = self
            .nodes
            .values()
            .filter_map(|e| Some((e, e.gone_for(now)?)))
            .filter(|(e, gone)| *gone > listed_for && (e.placed == [0; 3] || *gone > retention))
            .map(|(e, _)| e)
            .map(|e| {
                if e.placed != [0; 3] {
                    with_proclets.insert(e.info.id);
                }
                e.info.id
            })
            .collect();
        for id in &doomed {
            self.nodes.remove(id);
        }
        // Only nodes that had proclets can appear in the location map.
        if !with_proclets.is_empty() {
            self.locations
                .retain(|_, (n, _, _)| !with_proclets.contains(n));
        }
    }

    /// Nodes silent for longer than the failure timeout (still marked alive).
    pub fn overdue(&self, now: Instant) -> Vec<NodeId> {
        self.alive()
            .filter(|e| now.saturating_duration_since(e.last_seen) > self.config.failure_timeout)
            .map(|e| e.info.id)
            .collect()
    }

    pub fn alive_ids(&self) -> Vec<NodeId> {
        self.alive().map(|e| e.info.id).collect()
    }

    pub fn locations_len(&self) -> usize {
        self.locations.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn st() -> (State, Instant) {
        (State::new(ControllerConfig::default()), Instant::now())
    }

    fn reg(s: &mut State, role: Role, cores: f64, mem: u64, now: Instant) -> NodeId {
        s.register(
            role,
            NodeSpec {
                cores,
                mem_bytes: mem,
            },
            "a:1".into(),
            1,
            Some([1; 32]),
            "/p",
            now,
        )
        .unwrap()
    }

    #[test]
    fn binary_mismatch_is_refused() {
        let (mut s, now) = st();
        reg(&mut s, Role::Driver, 1.0, GIB, now);
        let e = s
            .register(
                Role::Node,
                NodeSpec {
                    cores: 1.0,
                    mem_bytes: GIB,
                },
                "b:1".into(),
                2,
                Some([2; 32]),
                "/other",
                now,
            )
            .unwrap_err();
        assert!(matches!(e, RegisterError::BinaryMismatch(m) if m.contains("identical binary")));
        let e = s
            .register(
                Role::Node,
                NodeSpec {
                    cores: 0.0,
                    mem_bytes: GIB,
                },
                "b:1".into(),
                2,
                Some([1; 32]),
                "/p",
                now,
            )
            .unwrap_err();
        assert!(matches!(e, RegisterError::Invalid(_)));
    }

    #[test]
    fn memory_goes_to_most_free_memory_and_compute_to_idle_cores() {
        let (mut s, now) = st();
        let _d = reg(&mut s, Role::Driver, 1.0, 8 * GIB, now);
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        let b = reg(&mut s, Role::Node, 2.0, 2 * GIB, now);
        assert_eq!(
            s.place(ProcletId(1), Kind::Memory, 0).unwrap().node,
            b,
            "driver is skipped"
        );
        s.heartbeat(
            b,
            Usage {
                cores_busy: 1.9,
                mem_used: 0,
                ..Default::default()
            },
            Vec::new(),
            now,
        );
        assert_eq!(s.place(ProcletId(2), Kind::Compute, 0).unwrap().node, a);
        // Placements since the last heartbeat count provisionally: compute spreads.
        s.heartbeat(a, Usage::default(), Vec::new(), now);
        s.heartbeat(b, Usage::default(), Vec::new(), now);
        let picks: Vec<NodeId> = (10..16)
            .map(|i| s.place(ProcletId(i), Kind::Compute, 0).unwrap().node)
            .collect();
        assert!(picks.contains(&a) && picks.contains(&b), "{picks:?}");
    }

    #[test]
    fn memory_avoids_pressured_nodes_unless_only_they_have_room() {
        let (mut s, now) = st();
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        let b = reg(&mut s, Role::Node, 1.0, GIB, now);
        let pressured = |used: u64| Usage {
            mem_used: used,
            mem_pressure: true,
            ..Default::default()
        };
        // b has more room but sheds: a gets the proclet.
        s.heartbeat(
            a,
            Usage {
                mem_used: GIB / 2,
                ..Default::default()
            },
            Vec::new(),
            now,
        );
        s.heartbeat(b, pressured(0), Vec::new(), now);
        assert_eq!(
            s.place(ProcletId(1), Kind::Memory, 1 << 20).unwrap().node,
            a
        );
        // Every node predicts pressure (all are loading data fast) but b has room:
        // placed there rather than refused.
        s.heartbeat(a, pressured(GIB / 2), Vec::new(), now);
        s.heartbeat(b, pressured(0), Vec::new(), now);
        assert_eq!(
            s.place(ProcletId(2), Kind::Memory, 1 << 20).unwrap().node,
            b
        );
        // No room anywhere: refused, pressure or not.
        s.heartbeat(a, pressured(GIB), Vec::new(), now);
        s.heartbeat(
            b,
            Usage {
                mem_used: GIB,
                ..Default::default()
            },
            Vec::new(),
            now,
        );
        let e = s.place(ProcletId(3), Kind::Memory, 1 << 20).unwrap_err();
        assert!(matches!(e, PlaceError::NoRoom(m) if m.contains("no node has room")));
    }

    #[test]
    fn a_departed_node_is_recorded_as_left_and_pruned() {
        let (mut s, now) = st();
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        let b = reg(&mut s, Role::Node, 1.0, GIB, now);
        assert!(s.mark_left(a, now));
        assert!(!s.mark_left(a, now), "only once");
        assert!(
            !s.mark_dead(a, now),
            "a departed node does not die afterwards"
        );
        assert_eq!(s.node(a).unwrap().state, NodeState::Left);
        let kinds: Vec<EventKind> = s.events_after(0, 100).iter().map(|e| e.kind).collect();
        assert_eq!(kinds.last(), Some(&EventKind::NodeLeft));
        assert!(!kinds.contains(&EventKind::NodeDown));
        // Never a candidate; forgotten like a dead node.
        for i in 0..4 {
            assert_eq!(s.place(ProcletId(i), Kind::Memory, 0).unwrap().node, b);
        }
        let later = now + s.config.forget_dead_after + Duration::from_millis(1);
        s.prune_dead(later, Duration::from_secs(600));
        assert!(s.node(a).is_none());
    }

    #[test]
    fn a_move_reported_after_the_destroy_does_not_revive_the_proclet() {
        let (mut s, now) = st();
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        let b = reg(&mut s, Role::Node, 1.0, GIB, now);
        let p = ProcletId(7);
        assert!(s.set_location(p, a, 1, Kind::Memory));
        // p moved a -> b, and b destroyed it before a's report of the move arrived.
        s.forget(p);
        assert!(
            !s.set_location(p, b, 2, Kind::Memory),
            "late update ignored"
        );
        assert!(s.locate(p).is_none(), "a destroyed proclet stays gone");
        assert_eq!(s.nodes[&b].placed, [0; 3]);
        // Other proclets are not affected.
        assert!(s.set_location(ProcletId(8), b, 1, Kind::Memory));
        assert!(s.locate(ProcletId(8)).is_some());
    }

    #[test]
    fn dead_nodes_are_not_candidates_and_locations_say_so() {
        let (mut s, now) = st();
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        let b = reg(&mut s, Role::Node, 1.0, GIB, now);
        let l = s.place(ProcletId(7), Kind::Memory, 0).unwrap();
        assert!(s.mark_dead(l.node, now));
        let other = if l.node == a { b } else { a };
        assert_eq!(s.place(ProcletId(8), Kind::Memory, 0).unwrap().node, other);
        let (_, alive) = s.locate(ProcletId(7)).unwrap();
        assert!(!alive);
        assert!(
            !s.heartbeat(l.node, Usage::default(), Vec::new(), now),
            "a dead node is fenced"
        );
    }

    #[test]
    fn epochs_only_move_forward_and_ids_are_unique() {
        let (mut s, now) = st();
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        let b = reg(&mut s, Role::Node, 1.0, GIB, now);
        assert!(s.set_location(ProcletId(1), a, 3, Kind::Memory));
        assert!(!s.set_location(ProcletId(1), b, 2, Kind::Memory));
        assert_eq!(s.locate(ProcletId(1)).unwrap().0.node, a);
        s.forget(ProcletId(1));
        assert!(s.locate(ProcletId(1)).is_none());
        let (x0, x1) = s.alloc_ids(100);
        let (y0, _) = s.alloc_ids(100);
        assert_eq!(x1 - x0, 100);
        assert_eq!(y0, x1);
    }

    #[test]
    fn dead_nodes_are_pruned() {
        let (mut s, now) = st();
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        let b = reg(&mut s, Role::Node, 1.0, GIB, now);
        assert!(s.set_location(ProcletId(1), b, 1, Kind::Memory));
        s.mark_dead(a, now);
        s.mark_dead(b, now);
        s.prune_dead(now, Duration::from_secs(600));
        assert!(
            s.node(a).is_some() && s.node(b).is_some(),
            "both still listed"
        );
        let unlisted = now + s.config.forget_dead_after + Duration::from_millis(1);
        s.prune_dead(unlisted, Duration::from_secs(600));
        assert!(
            s.node(a).is_none(),
            "a dead node without proclets goes once it is no longer listed"
        );
        assert!(
            s.node(b).is_some(),
            "one with proclets stays known for a while"
        );
        assert!(matches!(s.locate(ProcletId(1)), Some((_, false))));
        s.prune_dead(now + Duration::from_secs(601), Duration::from_secs(600));
        assert!(s.node(b).is_none());
        assert!(s.locate(ProcletId(1)).is_none());
    }

    #[test]
    fn overdue_nodes_are_found() {
        let (mut s, now) = st();
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        let later = now + Duration::from_secs(5);
        assert_eq!(s.overdue(later), vec![a]);
    }

    #[test]
    fn events_are_numbered_kept_in_order_and_bounded() {
        let (mut s, now) = st();
        let a = reg(&mut s, Role::Node, 1.0, GIB, now);
        // Registration itself is an event.
        let joined = s.events_after(0, 10);
        assert_eq!(joined.len(), 1);
        assert_eq!(joined[0].kind, EventKind::NodeJoined);
        let mut moved = ClusterEvent::now(EventKind::Migration, NodeId(99), "p7");
        moved.to = Some(NodeId(3));
        assert!(s.heartbeat(a, Usage::default(), vec![moved], now));
        let after = s.events_after(joined[0].seq, 10);
        assert_eq!(after.len(), 1);
        assert_eq!(after[0].seq, joined[0].seq + 1);
        assert_eq!(
            after[0].node,
            NodeId(99),
            "an event keeps the node it names"
        );
        for i in 0..EVENT_LOG + 5 {
            s.record(ClusterEvent::now(EventKind::Split, a, format!("x{i}")));
        }
        let all = s.events_after(0, usize::MAX);
        assert_eq!(all.len(), EVENT_LOG);
        assert!(all.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        assert_eq!(all.last().unwrap().seq + 1, s.next_event_seq());
        let tail = s.events_after(all.last().unwrap().seq - 2, 100);
        assert_eq!(tail.len(), 2);
        assert!(s.mark_dead(a, now));
        assert_eq!(
            s.events_after(0, usize::MAX).last().unwrap().kind,
            EventKind::NodeDown
        );
    }

    /// The node list shows a dead or departed node for `forget_dead_after` after it died
    /// or left, then no more; the controller still answers for the dead node's proclets
    /// (lost, not unknown) and still fences it, and no id comes back.
    #[test]
    fn the_list_forgets_dead_and_departed_nodes_after_a_while() {
        let config = ControllerConfig {
            forget_dead_after: Duration::from_secs(60),
            ..ControllerConfig::default()
        };
        let mut s = State::new(config);
        let t0 = Instant::now();
        let [a, b, c] = [(); 3].map(|()| reg(&mut s, Role::Node, 1.0, GIB, t0));
        assert!(s.set_location(ProcletId(1), a, 1, Kind::Memory));
        let died = t0 + Duration::from_secs(5);
        assert!(s.mark_dead(a, died));
        assert!(s.mark_left(b, died + Duration::from_secs(10)));
        let listed = |s: &State, at: Instant| -> Vec<(NodeId, NodeState)> {
            s.list(at).iter().map(|n| (n.id, n.state)).collect()
        };
        // Listed, with what happened to them, while the sweeps run.
        for later in [0, 30, 60] {
            let at = died + Duration::from_secs(later);
            s.prune_dead(at, Duration::from_secs(600));
            assert_eq!(
                listed(&s, at),
                [
                    (a, NodeState::Dead),
                    (b, NodeState::Left),
                    (c, NodeState::Alive)
                ],
                "{later} s after the death"
            );
        }
        // A minute after its death the dead node is no longer listed; the departed one
        // (which left ten seconds later) still is, for ten more seconds.
        let at = died + Duration::from_secs(61);
        s.prune_dead(at, Duration::from_secs(600));
        assert_eq!(
            listed(&s, at),
            [(b, NodeState::Left), (c, NodeState::Alive)]
        );
        let at = died + Duration::from_secs(71);
        s.prune_dead(at, Duration::from_secs(600));
        assert_eq!(listed(&s, at), [(c, NodeState::Alive)]);
        assert!(
            s.node(b).is_none(),
            "nothing left to keep of the departed node"
        );
        // What the controller still needs of the dead node: its proclet is lost with it
        // (not gone), and its heartbeats are refused.
        assert!(matches!(s.locate(ProcletId(1)), Some((l, false)) if l.node == a));
        assert!(!s.heartbeat(a, Usage::default(), Vec::new(), at));
        assert!(!s.heartbeat(b, Usage::default(), Vec::new(), at));
        // A new node gets a new id.
        let d = reg(&mut s, Role::Node, 1.0, GIB, at);
        assert!(d > c, "{d:?} after {c:?}");
        // After the retention, the dead node is forgotten for good; still no id reused.
        let at = died + Duration::from_secs(601);
        s.prune_dead(at, Duration::from_secs(600));
        assert!(s.node(a).is_none() && s.locate(ProcletId(1)).is_none());
        assert!(!s.heartbeat(a, Usage::default(), Vec::new(), at));
        assert!(reg(&mut s, Role::Node, 1.0, GIB, at) > d);
        // With 0 s, the list shows only the living.
        let mut s = State::new(ControllerConfig {
            forget_dead_after: Duration::ZERO,
            ..ControllerConfig::default()
        });
        let a = reg(&mut s, Role::Node, 1.0, GIB, t0);
        let b = reg(&mut s, Role::Node, 1.0, GIB, t0);
        assert!(s.mark_dead(a, t0));
        assert_eq!(
            listed(&s, t0 + Duration::from_millis(1)),
            [(b, NodeState::Alive)]
        );
    }

    #[test]
    fn a_replicated_proclet_is_handed_over_only_by_its_primary_and_fails_over_to_a_backup() {
        let (mut s, now) = st();
        let n: Vec<NodeId> = (0..4)
            .map(|_| reg(&mut s, Role::Node, 1.0, GIB, now))
            .collect();
        let p = ProcletId(7);
        s.set_location(p, n[0], 1, Kind::Memory);
        let set = s.place_backups(p, 1).unwrap();
        assert_eq!(set.backups.len(), 1);
        assert_ne!(set.backups[0].node, n[0]);
        assert!(s.record_backups(&set));
        let backup = set.backups[0].node;
        let other = *n.iter().find(|x| **x != n[0] && **x != backup).unwrap();
        let to = |node: NodeId, epoch: u64, backups: Vec<NodeId>| ReplicaSet {
            proclet: p,
            epoch,
            primary: Location {
                node,
                addr: "a:1".into(),
                epoch,
            },
            backups: backups
                .into_iter()
                .map(|b| Location {
                    node: b,
                    addr: "a:1".into(),
                    epoch: 0,
                })
                .collect(),
        };
        // Only the primary, only at the next epoch, only to distinct live nodes.
        assert!(!s.hand_over(backup, &to(other, 2, vec![backup])));
        assert!(!s.hand_over(n[0], &to(other, 3, vec![backup])));
        assert!(!s.hand_over(n[0], &to(other, 2, vec![other])));
        // A swap with the backup: the old primary becomes the backup.
        assert!(s.hand_over(n[0], &to(backup, 2, vec![n[0]])));
        assert_eq!(s.replica_set(p).unwrap().primary.node, backup);
        assert_eq!(s.replica_set(p).unwrap().epoch, 2);
        // The new primary dies: its backup (the old primary) takes over at epoch 3.
        assert!(s.mark_dead(backup, now));
        let changed = s.fail_over(backup);
        assert_eq!(changed.len(), 1);
        assert_eq!(changed[0].primary.node, n[0]);
        assert_eq!(changed[0].epoch, 3);
        assert!(changed[0].backups.is_empty());
        // A hand-over to a dead node is refused.
        assert!(!s.hand_over(n[0], &to(backup, 4, vec![])));
    }
}
