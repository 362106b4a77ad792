//! The message vocabulary: every request, response and notification Granule processes
//! exchange. One enum keeps the encoding in one place; which messages a peer may send is
//! decided by the receiving side (runtime or controller), not here.

use crate::types::{
    BinaryHash, CallMode, CgroupPaths, ChainId, ClusterEvent, CodeRef, Epoch, Kind, Location,
    MoveStats, NodeId, NodeInfo, NodeSpec, Panel, ProcletId, Resource, Role, Usage,
};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One message. Variants marked *tail* carry a raw byte tail after the encoded message.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub enum Msg {
    // ---- handshake: the first request on every connection ------------------------------
    /// Opens a connection. Proclet hosts (driver, nodes) must present the hash of their
    /// executable; a host only accepts code-carrying frames from peers whose hash equals
    /// its own.
    Hello {
        role: Role,
        node: Option<NodeId>,
        binary: Option<BinaryHash>,
        /// Human-readable program path, for error messages.
        program: String,
    },
    /// Handshake accepted. `verified` says whether the peer may ship code.
    HelloOk {
        role: Role,
        node: Option<NodeId>,
        binary: Option<BinaryHash>,
        program: String,
        verified: bool,
    },

    // ---- liveness ----------------------------------------------------------------------
    Ping,
    Pong,

    // ---- proclets, between hosts ------------------------------------------------------
    /// Run shipped code on a proclet. *tail*: the encoded argument.
    Call {
        proclet: ProcletId,
        code: CodeRef,
        mode: CallMode,
        chain: ChainId,
        /// The caller's id for this call (random; the same when it retries after a
        /// replicated proclet's failover, so a call already applied is answered with
        /// its recorded result, not run again). 0: none.
        call: u64,
    },
    /// Construct a proclet here. `ctor` builds the state from the argument; `state`
    /// describes the state type (for later moves). *tail*: the encoded constructor argument.
    Create {
        proclet: ProcletId,
        kind: Kind,
        ctor: CodeRef,
        state: CodeRef,
        epoch: Epoch,
        chain: ChainId,
        /// Whether the host must record the location at the controller itself
        /// (false when the controller already recorded it during placement).
        register: bool,
        /// Never move it.
        pinned: bool,
        /// The structure or service it belongs to (for operators), if any.
        group: Option<String>,
    },
    /// Free a proclet.
    Destroy {
        proclet: ProcletId,
    },
    /// Ask the host of a proclet to move it to another node (sent by the controller).
    /// Answered with `Moved`.
    MoveOut {
        proclet: ProcletId,
        to: Location,
    },
    /// A move finished.
    Moved(MoveStats),
    /// One piece of a moving proclet's encoded state, source → destination, in order on
    /// one connection. The piece with `last` installs the proclet. *tail*: the bytes at
    /// `offset` of the encoding. `raw` says the state is a plain byte vector sent as is;
    /// then `total` is its length, otherwise an estimate (the proclet's footprint) for the
    /// destination to reserve memory and check its room (0: unknown).
    Transfer {
        proclet: ProcletId,
        kind: Kind,
        state: CodeRef,
        epoch: Epoch,
        offset: u64,
        total: u64,
        last: bool,
        raw: bool,
        pinned: bool,
        /// The structure or service it belongs to (for operators), if any.
        group: Option<String>,
    },
    /// Source → destination: a transfer was abandoned; drop what arrived.
    TransferAbort {
        proclet: ProcletId,
    },
    /// Source → destination (one-way): the destination's confirmation of the whole
    /// state arrived and the move is final; the destination serves the proclet from now
    /// on (until then it holds calls on it).
    TransferCommit {
        proclet: ProcletId,
        epoch: Epoch,
    },
    /// Destination → source: a move whose commit never arrived — did it commit? Answered
    /// with `Resolved`.
    Resolve {
        proclet: ProcletId,
        epoch: Epoch,
    },
    /// The source's answer to `Resolve`: `Some(true)` committed, `Some(false)` abandoned,
    /// `None` not decided yet or not known here.
    Resolved {
        committed: Option<bool>,
    },
    /// Generic success without a value.
    Done,
    /// Successful call. *tail*: the encoded return value.
    Value,
    /// A request failed on the remote side.
    Error(RemoteError),

    // ---- controller ------------------------------------------------------------------
    /// Join the cluster (after Hello). Proclet hosts must send their binary hash.
    Register {
        role: Role,
        spec: NodeSpec,
        addr: String,
        pid: u32,
        binary: Option<BinaryHash>,
        program: String,
        cgroups: Option<CgroupPaths>,
        /// Where the host serves `/metrics` over HTTP, if it does.
        metrics_addr: Option<String>,
    },
    Registered {
        node: NodeId,
        heartbeat_ms: u64,
        failure_timeout_ms: u64,
    },
    Heartbeat {
        node: NodeId,
        usage: Usage,
        /// Events since the last heartbeat (moves, splits, merges), oldest first.
        events: Vec<ClusterEvent>,
    },
    /// Reply to a heartbeat: the controller's current membership version (a node refreshes
    /// its peer list when it changes).
    HeartbeatAck {
        members_version: u64,
    },
    AllocIds {
        count: u32,
    },
    IdBlock {
        start: u64,
        end: u64,
    },
    /// Choose a node for a new proclet and record its location (epoch 1).
    Place {
        proclet: ProcletId,
        kind: Kind,
        mem_hint: u64,
    },
    /// Record where a proclet is (creation on a named node, or the end of a move).
    SetLocation {
        proclet: ProcletId,
        location: Location,
        kind: Kind,
    },
    Locate {
        proclet: ProcletId,
    },
    Located {
        location: Location,
        alive: bool,
    },
    /// Drop a destroyed proclet from the location map.
    Forget {
        proclet: ProcletId,
    },
    ListNodes,
    Nodes(Vec<NodeInfo>),
    /// The controller's recent events with a sequence number above `after`, oldest
    /// first (at most `limit`).
    Events {
        after: u64,
        limit: u32,
    },
    EventList(Vec<ClusterEvent>),
    /// Propose a destination for a proclet a node under pressure wants to shed: a live
    /// node other than `from` with room for `amount` of `resource`.
    Propose {
        from: NodeId,
        resource: Resource,
        amount: u64,
    },
    /// The proposal (`None`: no node has room).
    Proposed(Option<(NodeId, String)>),
    /// Move a proclet to a node (admin API; the controller asks the host to do it).
    /// Answered with `Moved`.
    MoveProclet {
        proclet: ProcletId,
        to: NodeId,
    },
    /// Controller → hosts: a node was declared dead.
    NodeDown {
        node: NodeId,
    },
    /// Controller → hosts: leave now (cluster shutting down, or you were declared dead).
    Shutdown {
        reason: String,
        /// The node was declared dead: its proclets count as lost, and it may come back
        /// only as a new node (`cluster.rejoin`).
        declared_dead: bool,
    },
    /// Node → controller: this node is leaving on purpose (its program ends); its
    /// proclets go with it. Answered with `Done` before the node closes the connection,
    /// so the controller records a departure rather than a failure.
    Leave {
        reason: String,
    },
    /// Driver → node: fault-injection orders, for tests (refused unless the node's
    /// configuration has `faults.enabled`). Answered with `Done`, whose tail holds the
    /// node's fault report (transport filter and failpoint traces) when `report` is set.
    Faults {
        /// Replace every armed failpoint with these `name=spec;...` pairs (`""`: disarm
        /// all); `None` leaves them.
        failpoints: Option<String>,
        /// Replace the transport filter's rules with these (JSON of the transport's
        /// `FaultRules`; `""`: clear them); `None` leaves them.
        filter: Option<String>,
        report: bool,
    },

    // ---- the memory market (broker, producers, consumers) -----------------------------
    Market(crate::market::MarketMsg),

    // ---- dashboard panels (after the market: earlier variants keep their numbers) ------
    /// Any peer → controller: show (or refresh) this panel on the dashboard. Answered
    /// with `Done`, or `Refused` saying which bound an oversize panel breaks.
    PublishPanel(Panel),

    // ---- pushed calls (after the panels: earlier variants keep their numbers) ----------
    /// Run shipped read-only code on a proclet on its node's *pushdown pool* (threads of
    /// their own, bounded, with memory admission and an optional CPU cap) instead of the
    /// thread that read the request. *tail*: the encoded argument. Answered like `Call`:
    /// `Value` with the encoded result, or `Error` (`TimedOut` when `timeout_ms` passed
    /// first; `Refused` when its budget can never fit the pool; `NoCapacity` when the
    /// pool's queue is full).
    Push {
        proclet: ProcletId,
        code: CodeRef,
        chain: ChainId,
        /// The caller's id for this call (random, unique per call); a `CancelPush` names
        /// it.
        ticket: u64,
        /// Memory budget asked for, bytes (`None`: the node's default per call).
        memory: Option<u64>,
        /// The node drops the call if it has not started this long after arrival (and
        /// answers `TimedOut` at once if it has, counting its late finish); `None`: no
        /// limit of its own.
        timeout_ms: Option<u64>,
    },
    /// Caller → node (one-way, on the connection that carried the `Push`): the caller
    /// gave up on pushed call `ticket` — because its timeout passed (`timed_out`) or it
    /// dropped the call. A call still queued is removed and never runs; a running one
    /// finishes and its answer is dropped.
    CancelPush {
        ticket: u64,
        timed_out: bool,
    },

    // ---- replicated proclets (after pushed calls: earlier variants keep their numbers) --
    /// Node → controller: choose `count` backups for a proclet, each on a live node
    /// other than its primary's and each other's, and record them. Answered with
    /// `Replicas` (`Refused` when too few nodes).
    PlaceBackups {
        proclet: ProcletId,
        count: u32,
    },
    /// A replicated proclet's configuration: its primary, its backups and the epoch
    /// that numbers this configuration (it only grows). The controller's answer to
    /// `PlaceBackups` and `Failover`; as a notification (controller → node) it tells the
    /// primary its backups changed, or a backup that it is the primary now; as a
    /// request (primary → controller) it records new backups once they hold the state
    /// (answered with `Done`, or `Refused` when it is not the current configuration).
    Replicas(ReplicaSet),
    /// Creator → a proclet's primary: stream the state to these new backups and
    /// replicate every mutating call to them from now on. Answered with `Done`.
    AddBackups(ReplicaSet),
    /// Primary → a new backup: one chunk of the proclet's state (as `Transfer`); the
    /// last one installs the backup copy. *tail*: the bytes at `offset`.
    BackupChunk {
        proclet: ProcletId,
        kind: Kind,
        state: CodeRef,
        epoch: Epoch,
        offset: u64,
        total: u64,
        last: bool,
        /// How many copies the proclet has in all (the primary included).
        copies: u32,
        /// How many mutating calls the state sent has applied (the next one the backup
        /// gets is `seq + 1`).
        seq: u64,
    },
    /// Primary → backup: run mutating call number `seq` of the configuration `epoch`
    /// (the same code and argument the primary runs). *tail*: the encoded argument, then
    /// `effects` bytes: what the call did outside its state on the primary (the outcomes
    /// the backup replays; none when the call is sent before it ran there).
    /// Answered with `Applied`.
    Apply {
        proclet: ProcletId,
        epoch: Epoch,
        seq: u64,
        call: u64,
        code: CodeRef,
        chain: ChainId,
        effects: u32,
    },
    /// A backup applied call `seq`: a digest of its result, for the primary to compare.
    Applied {
        seq: u64,
        digest: u64,
    },
    /// Caller → controller: the primary on `unreachable` of a proclet did not answer.
    /// Answered with `Located` once the controller knows where it is: for a replicated
    /// proclet after it has decided whether that node is dead (and promoted a backup);
    /// for any other at once, like `Locate`.
    Failover {
        proclet: ProcletId,
        unreachable: NodeId,
    },
    /// Primary → backup: what call `seq` did outside its state, for a call sent before it
    /// ran on the primary that turned out to have such effects (the backup waits for
    /// them at the call's first effect). *tail*: the encoded effects. Answered with
    /// `Done`.
    Effects {
        proclet: ProcletId,
        epoch: Epoch,
        seq: u64,
    },
    /// A replicated proclet's primary → controller, moving it: make `set.primary` the
    /// primary under `set.epoch` (the current epoch + 1) with `set.backups`. The sender
    /// holds the proclet's lock, and the new primary holds a copy with every call
    /// applied. Answered with `Done` (the controller then tells the new primary and the
    /// backups, as after a failover) or `Refused`.
    HandOver(ReplicaSet),
    /// → a replicated proclet's primary: move its backup copy on `from` to `to` (a node
    /// with no copy): the state streams to `to`, the configuration names `to` instead of
    /// `from`, and `from` drops its copy. Answered with `Moved`.
    MoveBackup {
        proclet: ProcletId,
        from: NodeId,
        to: Location,
    },
}

/// Where the copies of a replicated proclet are (see `Msg::Replicas`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Debug)]
pub struct ReplicaSet {
    pub proclet: ProcletId,
    /// Numbers the configuration: every promotion or change of backups takes a new one.
    pub epoch: Epoch,
    pub primary: Location,
    pub backups: Vec<Location>,
}

impl Msg {
    /// Short name for logs and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "Hello",
            Msg::HelloOk { .. } => "HelloOk",
            Msg::Ping => "Ping",
            Msg::Pong => "Pong",
            Msg::Call { .. } => "Call",
            Msg::Create { .. } => "Create",
            Msg::Destroy { .. } => "Destroy",
            Msg::MoveOut { .. } => "MoveOut",
            Msg::Moved(_) => "Moved",
            Msg::Transfer { .. } => "Transfer",
            Msg::TransferAbort { .. } => "TransferAbort",
            Msg::Propose { .. } => "Propose",
            Msg::Proposed(_) => "Proposed",
            Msg::Done => "Done",
            Msg::Value => "Value",
            Msg::Error(_) => "Error",
            Msg::Register { .. } => "Register",
            Msg::Registered { .. } => "Registered",
            Msg::Heartbeat { .. } => "Heartbeat",
            Msg::Events { .. } => "Events",
            Msg::EventList(_) => "EventList",
            Msg::HeartbeatAck { .. } => "HeartbeatAck",
            Msg::AllocIds { .. } => "AllocIds",
            Msg::IdBlock { .. } => "IdBlock",
            Msg::Place { .. } => "Place",
            Msg::SetLocation { .. } => "SetLocation",
            Msg::Locate { .. } => "Locate",
            Msg::Located { .. } => "Located",
            Msg::Forget { .. } => "Forget",
            Msg::ListNodes => "ListNodes",
            Msg::Nodes(_) => "Nodes",
            Msg::MoveProclet { .. } => "MoveProclet",
            Msg::NodeDown { .. } => "NodeDown",
            Msg::Shutdown { .. } => "Shutdown",
            Msg::Leave { .. } => "Leave",
            Msg::Faults { .. } => "Faults",
            Msg::TransferCommit { .. } => "TransferCommit",
            Msg::Resolve { .. } => "Resolve",
            Msg::Resolved { .. } => "Resolved",
            Msg::Market(m) => m.name(),
            Msg::PublishPanel(_) => "PublishPanel",
            Msg::Push { .. } => "Push",
            Msg::CancelPush { .. } => "CancelPush",
            Msg::PlaceBackups { .. } => "PlaceBackups",
            Msg::Replicas(_) => "Replicas",
            Msg::AddBackups(_) => "AddBackups",
            Msg::BackupChunk { .. } => "BackupChunk",
            Msg::Apply { .. } => "Apply",
            Msg::Applied { .. } => "Applied",
            Msg::Failover { .. } => "Failover",
            Msg::Effects { .. } => "Effects",
            Msg::HandOver(_) => "HandOver",
            Msg::MoveBackup { .. } => "MoveBackup",
        }
    }
}

/// Why a request failed on the remote side.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Debug)]
pub enum RemoteError {
    /// The proclet is not hosted here (it moved, or the route was stale). `hint` is its
    /// new location when this node knows it. The call did not run: retrying is safe.
    NotHere { hint: Option<Location> },
    /// The proclet was destroyed, or never existed.
    Gone,
    /// The proclet's node is known to be dead.
    NodeDown(NodeId),
    /// The shipped closure panicked; the message is the panic payload.
    Panic(String),
    /// An argument, state or return value could not be decoded.
    Decode(String),
    /// Shipped code failed a safety check (offset outside the code, fingerprint or state
    /// type mismatch). The call did not run.
    CodeMismatch(String),
    /// The call would re-enter a proclet its own call chain already holds in a way that
    /// can never be granted (it would deadlock). The call did not run.
    Reentrant(ProcletId),
    /// The peer may not do this (e.g. ship code without a verified binary).
    Unauthorized(String),
    /// The receiver refused the request (bad registration, binary mismatch, pinned).
    Refused(String),
    /// No node has room for what was asked (a new proclet, a move).
    NoCapacity(String),
    /// The peer sent a message that makes no sense here.
    Protocol(String),
    /// Anything else that went wrong on the remote side.
    Internal(String),
    /// (After `Internal`: earlier variants keep their numbers.) No answer within the
    /// time the caller allowed (a pushed call's `timeout_ms`); a call that had not
    /// started never runs, one that had finishes and its answer is dropped.
    TimedOut { after_ms: u64 },
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteError::NotHere { hint: Some(l) } => {
                write!(
                    f,
                    "proclet not here (now on {} at epoch {})",
                    l.node, l.epoch
                )
            }
            RemoteError::NotHere { hint: None } => write!(f, "proclet not here"),
            RemoteError::Gone => write!(f, "proclet destroyed or unknown"),
            RemoteError::NodeDown(n) => write!(f, "node {n} is down"),
            RemoteError::Panic(m) => write!(f, "closure panicked: {m}"),
            RemoteError::Decode(m) => write!(f, "decode failure: {m}"),
            RemoteError::CodeMismatch(m) => write!(f, "shipped code refused: {m}"),
            RemoteError::Reentrant(p) => write!(
                f,
                "call re-enters proclet {p} which its own call chain holds; it would deadlock"
            ),
            RemoteError::Unauthorized(m) => write!(f, "unauthorized: {m}"),
            RemoteError::Refused(m) => write!(f, "refused: {m}"),
            RemoteError::NoCapacity(m) => write!(f, "no capacity: {m}"),
            RemoteError::Protocol(m) => write!(f, "protocol error: {m}"),
            RemoteError::Internal(m) => write!(f, "internal error: {m}"),
            RemoteError::TimedOut { after_ms } => write!(f, "no answer within {after_ms} ms"),
        }
    }
}
