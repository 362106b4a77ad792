//! Typed client of the controller, used by nodes, drivers and tools.

use crate::ControllerError;
use granule_transport::{Connection, Handler, Identity, TransportConfig, TransportError};
use granule_wire::{
    BinaryHash, CgroupPaths, ClusterEvent, Kind, Location, MoveStats, Msg, NodeId, NodeInfo,
    NodeSpec, Panel, ProcletId, RemoteError, ReplicaSet, Resource, Role, Usage,
};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// What the controller answered a registration with.
#[derive(Clone, Copy, Debug)]
pub struct Registration {
    pub node: NodeId,
    pub heartbeat: Duration,
    pub failure_timeout: Duration,
}

/// A connection to the controller.
#[derive(Clone)]
pub struct ControllerClient {
    conn: Arc<Connection>,
    addr: String,
}

/// A handler for tools that expect nothing from the controller.
struct Ignore;
impl Handler for Ignore {
    fn on_request(
        &self,
        _c: &Arc<Connection>,
        _f: granule_wire::Frame,
        r: granule_transport::Responder,
    ) {
        r.error(RemoteError::Protocol(
            "this client serves no requests".into(),
        ));
    }
}

impl ControllerClient {
    /// Connect as `identity`; `handler` receives what the controller sends unprompted
    /// (node-down notices, move orders, shutdown).
    pub async fn connect(
        addr: &str,
        identity: Arc<Identity>,
        handler: Arc<dyn Handler>,
    ) -> Result<ControllerClient, ControllerError> {
        Self::connect_with(
            addr,
            identity,
            Arc::new(TransportConfig::default()),
            handler,
        )
        .await
    }

    /// [`ControllerClient::connect`] with the connection's settings (a node's own: its
    /// limits and its fault filter).
    pub async fn connect_with(
        addr: &str,
        identity: Arc<Identity>,
        config: Arc<TransportConfig>,
        handler: Arc<dyn Handler>,
    ) -> Result<ControllerClient, ControllerError> {
        let conn = Connection::connect(addr, identity, config, handler)
            .await
            .map_err(|e| match e {
                TransportError::BinaryMismatch(m) => ControllerError::BinaryMismatch(m),
                other => ControllerError::Unreachable {
                    addr: addr.to_string(),
                    reason: other.to_string(),
                },
            })?;
        Ok(ControllerClient {
            conn,
            addr: addr.to_string(),
        })
    }

    /// Connect as a tool (no proclets hosted, no binary hash needed).
    pub async fn connect_tool(
        addr: &str,
        program: &str,
    ) -> Result<ControllerClient, ControllerError> {
        Self::connect(
            addr,
            Arc::new(Identity::tool(Role::Tool, program)),
            Arc::new(Ignore),
        )
        .await
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn connection(&self) -> &Arc<Connection> {
        &self.conn
    }

    async fn call(&self, msg: &Msg) -> Result<Msg, ControllerError> {
        let frame =
            self.conn
                .request(msg, &[])
                .await
                .map_err(|e| ControllerError::Unreachable {
                    addr: self.addr.clone(),
                    reason: e.to_string(),
                })?;
        match frame.msg {
            Msg::Error(RemoteError::Refused(m)) if m.contains("binary mismatch") => {
                Err(ControllerError::BinaryMismatch(m))
            }
            Msg::Error(RemoteError::Refused(m)) => Err(ControllerError::Refused(m)),
            Msg::Error(e) => Err(ControllerError::Remote(e)),
            m => Ok(m),
        }
    }

    fn unexpected(m: Msg) -> ControllerError {
        ControllerError::Protocol(format!("unexpected answer {}", m.name()))
    }

    /// Join the cluster as a proclet host.
    #[allow(clippy::too_many_arguments)] // one per field of the registration message
    pub async fn register(
        &self,
        role: Role,
        spec: NodeSpec,
        addr: String,
        binary: BinaryHash,
        program: String,
        cgroups: Option<CgroupPaths>,
        metrics_addr: Option<String>,
    ) -> Result<Registration, ControllerError> {
        let msg = Msg::Register {
            role,
            spec,
            addr,
            pid: std::process::id(),
            binary: Some(binary),
            program,
            cgroups,
            metrics_addr,
        };
        match self.call(&msg).await? {
            Msg::Registered {
                node,
                heartbeat_ms,
                failure_timeout_ms,
            } => Ok(Registration {
                node,
                heartbeat: Duration::from_millis(heartbeat_ms),
                failure_timeout: Duration::from_millis(failure_timeout_ms),
            }),
            m => Err(Self::unexpected(m)),
        }
    }

    /// Report resource use and the events since the last heartbeat; returns the
    /// controller's membership version.
    pub async fn heartbeat(
        &self,
        node: NodeId,
        usage: Usage,
        events: Vec<ClusterEvent>,
    ) -> Result<u64, ControllerError> {
        match self
            .call(&Msg::Heartbeat {
                node,
                usage,
                events,
            })
            .await?
        {
            Msg::HeartbeatAck { members_version } => Ok(members_version),
            m => Err(Self::unexpected(m)),
        }
    }

    pub async fn alloc_ids(&self, count: u32) -> Result<Range<u64>, ControllerError> {
        match self.call(&Msg::AllocIds { count }).await? {
            Msg::IdBlock { start, end } => Ok(start..end),
            m => Err(Self::unexpected(m)),
        }
    }

    pub async fn place(
        &self,
        proclet: ProcletId,
        kind: Kind,
        mem_hint: u64,
    ) -> Result<Location, ControllerError> {
        match self
            .call(&Msg::Place {
                proclet,
                kind,
                mem_hint,
            })
            .await?
        {
            Msg::Located { location, .. } => Ok(location),
            m => Err(Self::unexpected(m)),
        }
    }

    pub async fn set_location(
        &self,
        proclet: ProcletId,
        location: Location,
        kind: Kind,
    ) -> Result<(), ControllerError> {
        match self
            .call(&Msg::SetLocation {
                proclet,
                location,
                kind,
            })
            .await?
        {
            Msg::Done => Ok(()),
            m => Err(Self::unexpected(m)),
        }
    }

    /// Where a proclet is and whether its node is alive; `None` if it does not exist.
    pub async fn locate(
        &self,
        proclet: ProcletId,
    ) -> Result<Option<(Location, bool)>, ControllerError> {
        match self.call(&Msg::Locate { proclet }).await {
            Ok(Msg::Located { location, alive }) => Ok(Some((location, alive))),
            Ok(m) => Err(Self::unexpected(m)),
            Err(ControllerError::Remote(RemoteError::Gone)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Where a proclet is, for a caller that could not reach it on `unreachable`: for a
    /// replicated proclet, once the controller has decided whether that node is dead
    /// (see `Msg::Failover`); for any other at once. The location, whether its node is
    /// alive, and whether it is a replicated proclet's live primary; `None` if the
    /// proclet does not exist.
    pub async fn failover(
        &self,
        proclet: ProcletId,
        unreachable: NodeId,
    ) -> Result<Option<(Location, bool, bool)>, ControllerError> {
        match self
            .call(&Msg::Failover {
                proclet,
                unreachable,
            })
            .await
        {
            Ok(Msg::Located { location, alive }) => Ok(Some((location, alive, false))),
            Ok(Msg::Replicas(set)) => Ok(Some((set.primary, true, true))),
            Ok(m) => Err(Self::unexpected(m)),
            Err(ControllerError::Remote(RemoteError::Gone)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Choose `count` more backups for a proclet on other nodes than its copies'; the
    /// whole configuration.
    pub async fn place_backups(
        &self,
        proclet: ProcletId,
        count: u32,
    ) -> Result<ReplicaSet, ControllerError> {
        match self.call(&Msg::PlaceBackups { proclet, count }).await? {
            Msg::Replicas(set) => Ok(set),
            m => Err(Self::unexpected(m)),
        }
    }

    /// Record a replicated proclet's configuration (its primary sends it once new
    /// backups hold the state); refused when it is no longer the current one.
    pub async fn record_backups(&self, set: ReplicaSet) -> Result<(), ControllerError> {
        match self.call(&Msg::Replicas(set)).await? {
            Msg::Done => Ok(()),
            m => Err(Self::unexpected(m)),
        }
    }

    /// Move a replicated proclet's primary (see `Msg::HandOver`).
    pub async fn hand_over(&self, set: ReplicaSet) -> Result<(), ControllerError> {
        match self.call(&Msg::HandOver(set)).await? {
            Msg::Done => Ok(()),
            m => Err(Self::unexpected(m)),
        }
    }

    pub async fn forget(&self, proclet: ProcletId) -> Result<(), ControllerError> {
        match self.call(&Msg::Forget { proclet }).await? {
            Msg::Done => Ok(()),
            m => Err(Self::unexpected(m)),
        }
    }

    /// Tell the controller this node leaves on purpose (recorded as a departure, not a
    /// failure). The node closes its connection afterwards.
    pub async fn leave(&self, reason: &str) -> Result<(), ControllerError> {
        match self
            .call(&Msg::Leave {
                reason: reason.to_string(),
            })
            .await?
        {
            Msg::Done => Ok(()),
            m => Err(Self::unexpected(m)),
        }
    }

    pub async fn list_nodes(&self) -> Result<Vec<NodeInfo>, ControllerError> {
        match self.call(&Msg::ListNodes).await? {
            Msg::Nodes(n) => Ok(n),
            m => Err(Self::unexpected(m)),
        }
    }

    /// The controller's recent events numbered above `after`, oldest first.
    pub async fn events(
        &self,
        after: u64,
        limit: u32,
    ) -> Result<Vec<ClusterEvent>, ControllerError> {
        match self.call(&Msg::Events { after, limit }).await? {
            Msg::EventList(e) => Ok(e),
            m => Err(Self::unexpected(m)),
        }
    }

    /// Move a proclet to `to` (admin API); returns once the move is done, with what it
    /// cost (all zero when the proclet already was there).
    pub async fn move_proclet(
        &self,
        proclet: ProcletId,
        to: NodeId,
    ) -> Result<MoveStats, ControllerError> {
        match self.call(&Msg::MoveProclet { proclet, to }).await? {
            Msg::Moved(s) => Ok(s),
            Msg::Done => Ok(MoveStats::default()),
            m => Err(Self::unexpected(m)),
        }
    }

    /// A destination for `amount` of `resource` that node `from` wants to shed: the live
    /// node with the most room for it, or `None` when no node has room.
    pub async fn propose(
        &self,
        from: NodeId,
        resource: Resource,
        amount: u64,
    ) -> Result<Option<(NodeId, String)>, ControllerError> {
        match self
            .call(&Msg::Propose {
                from,
                resource,
                amount,
            })
            .await?
        {
            Msg::Proposed(p) => Ok(p),
            m => Err(Self::unexpected(m)),
        }
    }

    /// Show (or refresh) a panel on the dashboard. It stays while it is refreshed within
    /// its `ttl_ms` and this connection stays open; an oversize panel is refused
    /// (`Refused`, naming the bound it breaks: see [`crate::panels`]).
    pub async fn publish_panel(&self, panel: Panel) -> Result<(), ControllerError> {
        match self.call(&Msg::PublishPanel(panel)).await? {
            Msg::Done => Ok(()),
            m => Err(Self::unexpected(m)),
        }
    }
}
