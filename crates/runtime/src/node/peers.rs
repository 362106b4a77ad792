//! The node's peers: one connection to each other node it talks to (opened on first use,
//! reopened after a close), the membership as the controller last listed it, and the
//! nodes declared dead (calls to them fail at once instead of waiting on a socket).

use crate::error::CallError;
use dashmap::DashMap;
use granule_transport::{Connection, Handler, Identity, TransportConfig, TransportError};
use granule_wire::{NodeId, NodeInfo, NodeState};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::runtime::Handle;
use tokio::sync::OnceCell;

/// Connections, membership and dead nodes.
pub(crate) struct Peers {
    /// Who this node says it is at the hello.
    identity: Arc<Identity>,
    tconfig: Arc<TransportConfig>,
    /// Serves what peers send on connections this node opened.
    handler: Arc<super::NodeHandler>,
    /// The worker runtime: connections' tasks live there, whoever asks for them.
    workers: Handle,
    conns: Mutex<HashMap<NodeId, Arc<OnceCell<Arc<Connection>>>>>,
    dead: Mutex<HashSet<NodeId>>,
    members: Members,
    /// The node stopped: no new connections.
    closed: AtomicBool,
}

impl Peers {
    pub(super) fn new(
        identity: Arc<Identity>,
        tconfig: Arc<TransportConfig>,
        handler: Arc<super::NodeHandler>,
        workers: Handle,
    ) -> Peers {
        Peers {
            identity,
            tconfig,
            handler,
            workers,
            conns: Mutex::new(HashMap::new()),
            dead: Mutex::new(HashSet::new()),
            members: Members::default(),
            closed: AtomicBool::new(false),
        }
    }

    /// The connection to `node` at `addr`, opened on first use (one per peer, shared by
    /// every caller).
    pub(crate) async fn connect(
        &self,
        node: NodeId,
        addr: &str,
    ) -> Result<Arc<Connection>, CallError> {
        for _ in 0..2 {
            if self.is_dead(node) {
                return Err(unreachable(node, "the controller declared it dead"));
            }
            if self.closed.load(Ordering::Acquire) {
                return Err(CallError::NoCluster);
            }
            let cell = self
                .conns
                .lock()
                .entry(node)
                .or_insert_with(|| Arc::new(OnceCell::new()))
                .clone();
            let identity = self.identity.clone();
            let tconfig = self.tconfig.clone();
            let handler: Arc<dyn Handler> = self.handler.clone();
            let addr_s = addr.to_string();
            let workers = self.workers.clone();
            let conn = cell
                .get_or_try_init(|| async move {
                    // Connect on the worker runtime (its tasks must live there), whatever
                    // thread asked.
                    match workers
                        .spawn(async move {
                            Connection::connect(&addr_s, identity, tconfig, handler).await
                        })
                        .await
                    {
                        Ok(r) => r,
                        Err(e) => Err(TransportError::Closed {
                            peer: "?".into(),
                            reason: format!("connect task failed: {e}"),
                        }),
                    }
                })
                .await
                .map_err(|e| self.transport_error(node, e))?
                .clone();
            if !conn.is_closed() {
                return Ok(conn);
            }
            let mut conns = self.conns.lock();
            if conns.get(&node).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                conns.remove(&node);
            }
        }
        Err(unreachable(node, "connection keeps closing"))
    }

    /// A connection closed: the next call to its peer opens a new one.
    pub(crate) fn forget(&self, conn: &Arc<Connection>) {
        let Some(node) = conn.peer().and_then(|p| p.node) else {
            return;
        };
        let mut conns = self.conns.lock();
        if let Some(cell) = conns.get(&node) {
            if cell.get().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                conns.remove(&node);
            }
        }
    }

    /// The node stops: no new connections from here on.
    pub(super) fn close_all(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// A transport failure talking to `node`, as a call error.
    pub(crate) fn transport_error(&self, node: NodeId, e: TransportError) -> CallError {
        match e {
            TransportError::BinaryMismatch(m) => CallError::BinaryMismatch(m),
            TransportError::Wire(w) => CallError::Decode(w.to_string()),
            other => {
                if self.is_dead(node) {
                    unreachable(node, "the controller declared it dead")
                } else {
                    unreachable(node, other)
                }
            }
        }
    }

    /// A node was declared dead: fail everything waiting on it.
    pub(crate) fn on_node_down(&self, me: NodeId, node: NodeId) {
        if !self.dead.lock().insert(node) {
            return;
        }
        tracing::info!(node = %me, dead = %node, "peer declared dead");
        let cell = self.conns.lock().remove(&node);
        if let Some(conn) = cell.and_then(|c| c.get().cloned()) {
            conn.close(format!("node {node} was declared dead"));
        }
    }

    pub(crate) fn is_dead(&self, node: NodeId) -> bool {
        self.dead.lock().contains(&node)
    }

    /// Whether the controller's membership `version` is news to this node.
    pub(super) fn members_changed(&self, version: u64) -> bool {
        self.members.changed(version)
    }

    /// Take the controller's list of nodes (at membership `version`); nodes no longer
    /// alive are declared dead here too.
    pub(super) fn update_members(&self, list: Vec<NodeInfo>, version: u64) -> Vec<NodeId> {
        self.members.update(list, version)
    }

    /// A member's address, if the membership lists it.
    pub(super) fn addr_of(&self, node: NodeId) -> Option<String> {
        self.members.addr_of(node)
    }
}

/// The controller's membership as this node last saw it: every listed node and the
/// list's version.
#[derive(Default)]
struct Members {
    nodes: DashMap<NodeId, NodeInfo>,
    version: AtomicU64,
}

impl Members {
    fn changed(&self, version: u64) -> bool {
        version != self.version.load(Ordering::Relaxed)
    }

    /// Take a new list; returns the nodes it says are not alive.
    fn update(&self, list: Vec<NodeInfo>, version: u64) -> Vec<NodeId> {
        // Entries are replaced in place and those the list no longer has are removed
        // afterwards: clearing first let a concurrent `addr_of` (another creation on the
        // same node, say) miss a member listed all along, which then failed with "there
        // is no node ... in this cluster".
        let listed: HashSet<NodeId> = list.iter().map(|n| n.id).collect();
        let mut down = Vec::new();
        for n in list {
            if n.state != NodeState::Alive {
                down.push(n.id);
            }
            self.nodes.insert(n.id, n);
        }
        self.nodes.retain(|id, _| listed.contains(id));
        self.version.store(version, Ordering::Relaxed);
        down
    }

    fn addr_of(&self, node: NodeId) -> Option<String> {
        self.nodes.get(&node).map(|n| n.addr.clone())
    }
}

pub(crate) fn unreachable(node: NodeId, e: impl std::fmt::Display) -> CallError {
    CallError::NodeUnreachable {
        node,
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_wire::{NodeSpec, Role, Usage};

    fn info(id: u32) -> NodeInfo {
        NodeInfo {
            id: NodeId(id),
            addr: format!("127.0.0.1:{}", 1000 + id),
            role: Role::Node,
            state: NodeState::Alive,
            spec: NodeSpec {
                cores: 1.0,
                mem_bytes: 1 << 30,
            },
            usage: Usage::default(),
            pid: 0,
            last_seen_ms: 0,
            cgroups: None,
            metrics_addr: None,
        }
    }

    #[test]
    fn a_member_listed_all_along_is_never_missing_during_updates() {
        let m = std::sync::Arc::new(Members::default());
        m.update(vec![info(1), info(2)], 1);
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let updater = {
            let (m, stop) = (m.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut v = 1;
                while !stop.load(Ordering::Relaxed) {
                    v += 1;
                    // Node 2 comes and goes; node 1 is in every list.
                    let list = if v % 2 == 0 {
                        vec![info(1)]
                    } else {
                        vec![info(1), info(2)]
                    };
                    m.update(list, v);
                }
            })
        };
        let mut missed = 0;
        for _ in 0..200_000 {
            if m.addr_of(NodeId(1)).is_none() {
                missed += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        updater.join().unwrap();
        assert_eq!(missed, 0, "node 1 looked absent {missed} times");
        m.update(vec![info(1)], 99);
        assert_eq!(
            m.addr_of(NodeId(2)),
            None,
            "a node no longer listed is forgotten"
        );
        assert!(!m.changed(99) && m.changed(100));
    }
}
