//! The fault filter: rules that drop, delay, reorder or cut frames and partition nodes
//! from each other, for tests that break the network on purpose.
//!
//! This module owns the rules ([`FaultRules`]), the decision for each frame (which rule
//! fires, drawn from seeded random streams), the trace of decisions and the list of open
//! connections it may have to act on when the rules change. It does not touch sockets:
//! `conn.rs` asks it for a verdict on every frame while rules are set and carries the
//! verdict out (queueing, holding back, truncating, closing).
//!
//! One [`FaultFilter`] is shared (`Arc`) by every connection made with the same
//! [`TransportConfig`](crate::TransportConfig). With no rules set it costs one relaxed
//! atomic load per frame and nothing else.
//!
//! Determinism: every random choice comes from a ChaCha stream seeded by
//! [`FaultRules::seed`] and selected by a stable key of the *stream* the frame belongs to
//! (this process's endpoint, the peer's endpoint, the direction, and which side opened
//! the connection). Counters (`Frames::Nth`, `Frames::First`) are per stream too. So the
//! same seed and the same frames on a stream give the same decisions, whatever other
//! connections do meanwhile; streams survive reconnection (a rule for "the 2nd Transfer
//! to n2" fires once, not once per connection) and restart when the rules are replaced.
//! Thread interleavings stay free: which frames reach a stream in which order is the
//! program's business.
//!
//! ```no_run
//! use granule_transport::{
//!     Connection, FaultAction, FaultFilter, FaultRule, FaultRules, Handler, Identity,
//!     Partition, TransportConfig,
//! };
//! use granule_wire::NodeId;
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! # async fn demo(identity: Arc<Identity>, handler: Arc<dyn Handler>) -> Result<(), Box<dyn std::error::Error>> {
//! let faults = Arc::new(FaultFilter::new());
//! let config = Arc::new(TransportConfig::default().with_faults(faults.clone()));
//! let conn = Connection::connect("127.0.0.1:4000", identity, config, handler).await?;
//! faults.set_local(NodeId(1)); // once this process knows its node id
//!
//! faults.set_rules(
//!     FaultRules::seeded(42)
//!         // Cut the 2nd state transfer sent to n2 half-way (at a seeded offset).
//!         .rule(FaultRule::new(FaultAction::Cut).outgoing().node(NodeId(2)).kind("Transfer").nth(2))
//!         // Delay a tenth of all calls by 5 ms.
//!         .rule(FaultRule::new(FaultAction::Delay(Duration::from_millis(5))).kind("Call").probability(0.1))
//!         // n1 and n2 cannot talk to n3.
//!         .partition(Partition::nodes([vec![NodeId(1), NodeId(2)], vec![NodeId(3)]])),
//! )?;
//! // ... run the workload ...
//! faults.heal(); // partitions gone, other rules kept
//! faults.clear(); // inert again
//! eprintln!("{}", faults.report()); // seed, rules, one line per decision
//! # drop(conn);
//! # Ok(())
//! # }
//! ```

use crate::conn::Connection;
use granule_wire::{NodeId, Role};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Entries the trace keeps by default (the oldest are dropped first).
pub const DEFAULT_TRACE_CAPACITY: usize = 16_384;

/// A frame held back by [`FaultAction::Reorder`] is sent after this long even if fewer
/// than `after` frames followed it, so a quiet connection does not hold it forever.
pub const REORDER_MAX_HOLD: Duration = Duration::from_secs(1);

/// One end of a connection, as the filter names it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Debug)]
pub enum Endpoint {
    /// A node (the driver is a node too), by the id the controller gave it.
    Node(NodeId),
    /// The controller (found by the role it states in its hello: it has no node id).
    Controller,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Node(n) => write!(f, "{n}"),
            Endpoint::Controller => f.write_str("controller"),
        }
    }
}

impl Endpoint {
    /// The endpoint a hello describes: its node id, else the controller by role, else
    /// none (tools and not-yet-registered hosts cannot be named).
    pub fn from_hello(role: Role, node: Option<NodeId>) -> Option<Endpoint> {
        match (node, role) {
            (Some(n), _) => Some(Endpoint::Node(n)),
            (None, Role::Controller) => Some(Endpoint::Controller),
            (None, _) => None,
        }
    }
}

/// Which way a frame travels, seen from the process whose filter judges it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Debug)]
pub enum Direction {
    /// Sent by this process.
    Outgoing,
    /// Received by this process (judged after decoding, before it is handled).
    Incoming,
    /// Either (rules only; a frame is always one or the other).
    Both,
}

impl Direction {
    fn admits(self, d: Direction) -> bool {
        self == Direction::Both || self == d
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Outgoing => "out",
            Direction::Incoming => "in",
            Direction::Both => "both",
        })
    }
}

/// Which of the frames a rule selects it acts on. Counted per stream (see the module
/// doc), from 1, from the moment the rules were set; a selected frame counts even when
/// an earlier rule fired on it, so one rule's count does not depend on the others.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Debug, Default)]
pub enum Frames {
    /// Every selected frame.
    #[default]
    All,
    /// Only the n-th selected frame (n ≥ 1).
    Nth(u64),
    /// The first n selected frames (n ≥ 1).
    First(u64),
}

impl Frames {
    fn admits(self, n: u64) -> bool {
        match self {
            Frames::All => true,
            Frames::Nth(k) => n == k,
            Frames::First(k) => n <= k,
        }
    }
}

/// What a rule does to a frame it fires on.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Debug)]
pub enum FaultAction {
    /// Discard the frame silently. A dropped request is never answered: its caller
    /// waits until its own timeout or until the connection closes.
    Drop,
    /// Deliver the frame after this long, from a timer task (other frames on the same
    /// connection, and other connections, go on meanwhile and may overtake it).
    Delay(Duration),
    /// Hold the frame back and send (or handle) it right after the next `after` frames
    /// on the same connection and direction (at most [`REORDER_MAX_HOLD`] later).
    Reorder { after: u32 },
    /// Outgoing: write a prefix of the frame (its length drawn from the stream,
    /// 1..len bytes), then close the connection, so the peer reads a truncated frame.
    /// Incoming: discard the frame and close the connection.
    Cut,
}

/// One rule: a selector (direction, peer, message kind), which of the selected frames
/// it applies to, a probability, and an action.
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug)]
pub struct FaultRule {
    #[serde(default = "FaultRule::default_direction")]
    pub direction: Direction,
    /// Only frames to/from this peer; `None`: any peer.
    #[serde(default)]
    pub peer: Option<Endpoint>,
    /// Only frames whose message has this name ([`granule_wire::Msg::name`], e.g.
    /// `"Call"`, `"Transfer"`, `"Heartbeat"`); `None`: any message. Names are compared
    /// exactly. Rules never see the handshake (`Hello`, `HelloOk`): partitions judge it.
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub frames: Frames,
    /// Chance that the rule fires on a frame it selects and counts (1.0: always).
    #[serde(default = "FaultRule::default_probability")]
    pub probability: f64,
    pub action: FaultAction,
}

impl FaultRule {
    fn default_direction() -> Direction {
        Direction::Both
    }

    fn default_probability() -> f64 {
        1.0
    }

    /// A rule that applies `action` to every frame in both directions; narrow it with
    /// the builder methods.
    pub fn new(action: FaultAction) -> FaultRule {
        FaultRule {
            direction: Direction::Both,
            peer: None,
            kind: None,
            frames: Frames::All,
            probability: 1.0,
            action,
        }
    }

    /// Only frames this process sends.
    pub fn outgoing(mut self) -> Self {
        self.direction = Direction::Outgoing;
        self
    }

    /// Only frames this process receives.
    pub fn incoming(mut self) -> Self {
        self.direction = Direction::Incoming;
        self
    }

    /// Only frames to/from `peer`.
    pub fn peer(mut self, peer: Endpoint) -> Self {
        self.peer = Some(peer);
        self
    }

    /// Only frames to/from the node `node`.
    pub fn node(self, node: NodeId) -> Self {
        self.peer(Endpoint::Node(node))
    }

    /// Only frames carrying this message kind (`Msg::name()`).
    pub fn kind(mut self, kind: impl Into<String>) -> Self {
        self.kind = Some(kind.into());
        self
    }

    /// Only the n-th selected frame (from 1).
    pub fn nth(mut self, n: u64) -> Self {
        self.frames = Frames::Nth(n);
        self
    }

    /// Only the first n selected frames.
    pub fn first(mut self, n: u64) -> Self {
        self.frames = Frames::First(n);
        self
    }

    /// Fire with this probability.
    pub fn probability(mut self, p: f64) -> Self {
        self.probability = p;
        self
    }

    fn selects(&self, direction: Direction, peer: Option<Endpoint>, kind: &str) -> bool {
        self.direction.admits(direction)
            && self.peer.is_none_or(|p| Some(p) == peer)
            && self.kind.as_deref().is_none_or(|k| k == kind)
    }
}

/// A network partition: endpoints on different sides cannot talk. Frames between them
/// are dropped in both directions, and new connections between them are refused right
/// after the hello ("partitioned by the fault filter"). Endpoints named on no side are
/// not affected.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Debug)]
pub struct Partition {
    pub sides: Vec<Vec<Endpoint>>,
    /// Also close the connections already open across the partition when it is set
    /// (their pending requests fail at once) instead of leaving them open and silent.
    #[serde(default)]
    pub close_open: bool,
}

impl Partition {
    /// A partition between these sides; open connections stay open (and silent).
    pub fn new(sides: Vec<Vec<Endpoint>>) -> Partition {
        Partition {
            sides,
            close_open: false,
        }
    }

    /// A partition between sets of nodes.
    pub fn nodes<I: IntoIterator<Item = Vec<NodeId>>>(sides: I) -> Partition {
        Partition::new(
            sides
                .into_iter()
                .map(|s| s.into_iter().map(Endpoint::Node).collect())
                .collect(),
        )
    }

    /// Close connections already open across the partition when it is set.
    pub fn closing_open(mut self) -> Self {
        self.close_open = true;
        self
    }

    fn side_of(&self, e: Endpoint) -> Option<usize> {
        self.sides.iter().position(|s| s.contains(&e))
    }

    /// Whether `a` and `b` are on different sides.
    pub fn separates(&self, a: Option<Endpoint>, b: Option<Endpoint>) -> bool {
        match (
            a.and_then(|a| self.side_of(a)),
            b.and_then(|b| self.side_of(b)),
        ) {
            (Some(x), Some(y)) => x != y,
            _ => false,
        }
    }

    fn describe(&self) -> String {
        self.sides
            .iter()
            .map(|s| {
                let names: Vec<String> = s.iter().map(|e| e.to_string()).collect();
                format!("{{{}}}", names.join(", "))
            })
            .collect::<Vec<_>>()
            .join(" | ")
    }
}

/// Everything the filter does: plain data, so it can travel in a control message or a
/// configuration file (serde).
#[derive(Clone, PartialEq, Serialize, Deserialize, Debug, Default)]
pub struct FaultRules {
    /// Seeds every random choice (see the module doc).
    #[serde(default)]
    pub seed: u64,
    /// Tried in order for each frame; the first that fires decides. A frame no rule
    /// fires on passes untouched.
    #[serde(default)]
    pub rules: Vec<FaultRule>,
    /// Checked before the rules: a frame across any partition is dropped.
    #[serde(default)]
    pub partitions: Vec<Partition>,
}

impl FaultRules {
    /// No rules, with this seed; add rules with [`FaultRules::rule`] and
    /// [`FaultRules::partition`].
    pub fn seeded(seed: u64) -> FaultRules {
        FaultRules {
            seed,
            ..FaultRules::default()
        }
    }

    /// Append a rule.
    pub fn rule(mut self, rule: FaultRule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Append a partition.
    pub fn partition(mut self, p: Partition) -> Self {
        self.partitions.push(p);
        self
    }

    /// True when the rules do nothing.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.partitions.is_empty()
    }

    /// Check the rules for values that cannot be meant.
    pub fn validate(&self) -> Result<(), FaultError> {
        for (i, r) in self.rules.iter().enumerate() {
            if !(0.0..=1.0).contains(&r.probability) {
                return Err(FaultError::Probability {
                    rule: i,
                    value: r.probability,
                });
            }
            if matches!(r.frames, Frames::Nth(0) | Frames::First(0)) {
                return Err(FaultError::ZeroCount { rule: i });
            }
            if matches!(r.action, FaultAction::Reorder { after: 0 }) {
                return Err(FaultError::ZeroReorder { rule: i });
            }
        }
        for (i, p) in self.partitions.iter().enumerate() {
            if p.sides.len() < 2 {
                return Err(FaultError::OneSided { partition: i });
            }
            let mut seen = std::collections::HashSet::new();
            for e in p.sides.iter().flatten() {
                if !seen.insert(*e) {
                    return Err(FaultError::TwoSides {
                        partition: i,
                        endpoint: e.to_string(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// Rules that cannot be set.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum FaultError {
    #[error("fault rule {rule}: probability {value} is not between 0 and 1")]
    Probability { rule: usize, value: f64 },
    #[error("fault rule {rule}: frames are counted from 1; Nth(0) and First(0) select nothing")]
    ZeroCount { rule: usize },
    #[error("fault rule {rule}: Reorder needs after >= 1")]
    ZeroReorder { rule: usize },
    #[error("partition {partition} needs at least two sides")]
    OneSided { partition: usize },
    #[error("partition {partition} puts {endpoint} on two sides")]
    TwoSides { partition: usize, endpoint: String },
}

/// What the filter did (one trace entry's action).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Debug)]
pub enum TraceAction {
    Drop,
    Delay(Duration),
    Reorder {
        after: u32,
    },
    /// An outgoing frame cut after `written` of its `len` bytes, then the connection
    /// closed.
    Cut {
        written: usize,
        len: usize,
    },
    /// An incoming frame discarded and the connection closed (`Cut` on an incoming
    /// frame).
    CutIncoming,
    /// A frame dropped because a partition separates the two ends.
    Partitioned,
    /// A connection refused at the hello because a partition separates the two ends.
    Refused,
    /// An open connection closed when a `close_open` partition was set.
    Closed,
}

impl fmt::Display for TraceAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceAction::Drop => f.write_str("drop"),
            TraceAction::Delay(d) => write!(f, "delay {d:?}"),
            TraceAction::Reorder { after } => write!(f, "reorder after {after}"),
            TraceAction::Cut { written, len } => write!(f, "cut after {written} of {len} bytes"),
            TraceAction::CutIncoming => f.write_str("cut (incoming frame discarded)"),
            TraceAction::Partitioned => f.write_str("drop (partitioned)"),
            TraceAction::Refused => f.write_str("refuse connection (partitioned)"),
            TraceAction::Closed => f.write_str("close connection (partitioned)"),
        }
    }
}

/// The part of a trace entry that the seed and the frame sequence determine: equal in
/// two runs with the same seed and the same frames on each stream. Sorting a list of
/// them by stream and frame makes runs comparable whatever the interleaving.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Debug)]
pub struct Decision {
    /// This process (as set with [`FaultFilter::set_local`] or known from its hello).
    pub local: Option<Endpoint>,
    /// The other end; `None` for peers that are neither a node nor the controller.
    pub peer: Option<Endpoint>,
    pub direction: Direction,
    /// This process opened the connection.
    pub dialed: bool,
    /// Position of the frame in its stream since the rules were set (from 1; 0 for
    /// decisions about a connection rather than a frame).
    pub frame: u64,
    /// Message kind (`Msg::name()`).
    pub kind: String,
    /// Index of the rule that fired; `None` for partitions.
    pub rule: Option<usize>,
    pub action: TraceAction,
}

/// One recorded decision.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Debug)]
pub struct TraceEntry {
    /// Position in this filter's trace (never reused, even after [`FaultFilter::take_trace`]).
    pub seq: u64,
    /// Time since the filter was created.
    pub at: Duration,
    /// Process-local id of the connection ([`Connection::id`]).
    pub conn: u64,
    pub decision: Decision,
}

impl fmt::Display for TraceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.decision;
        let name = |e: Option<Endpoint>| e.map_or_else(|| "?".to_string(), |e| e.to_string());
        let arrow = match d.direction {
            Direction::Incoming => "<-",
            _ => "->",
        };
        write!(
            f,
            "#{} +{:.6}s conn {} {} {} {} {} {} #{}: {}",
            self.seq,
            self.at.as_secs_f64(),
            self.conn,
            name(d.local),
            arrow,
            name(d.peer),
            d.direction,
            d.kind,
            d.frame,
            d.action,
        )?;
        match d.rule {
            Some(r) => write!(f, " [rule {r}]"),
            None => f.write_str(" [partition]"),
        }
    }
}

/// What a connection must do with one frame.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Verdict {
    Pass,
    Drop,
    Delay(Duration),
    Reorder {
        after: u32,
    },
    /// Write this many bytes of the frame, then close.
    Cut {
        keep: usize,
    },
    /// Incoming cut: discard the frame and close.
    CutIncoming,
}

/// A frame as the filter sees it.
pub(crate) struct FrameInfo<'a> {
    pub conn: u64,
    /// What the connection's identity says this process is (see `resolve_local`).
    pub local_hint: Option<Endpoint>,
    pub peer: Option<Endpoint>,
    pub dialed: bool,
    pub direction: Direction,
    pub kind: &'a str,
    /// Encoded length (outgoing frames; needed to cut them).
    pub len: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct StreamKey {
    peer: Option<Endpoint>,
    direction: Direction,
    dialed: bool,
}

struct Stream {
    rng: ChaCha8Rng,
    /// Frames seen on the stream.
    frames: u64,
    /// Per rule: frames it selected.
    counts: Vec<u64>,
}

struct Inner {
    rules: FaultRules,
    local: Option<NodeId>,
    streams: HashMap<StreamKey, Stream>,
    trace: VecDeque<TraceEntry>,
    trace_capacity: usize,
    trace_lost: u64,
    next_seq: u64,
}

/// Drops, delays, reorders and cuts frames and partitions nodes, by rules that can be
/// replaced at any time while connections are open. Attach it to connections through
/// [`TransportConfig::faults`](crate::TransportConfig::faults); see the module doc.
pub struct FaultFilter {
    /// Rules are set: the only thing the frame path reads when they are not.
    active: AtomicBool,
    created: Instant,
    inner: Mutex<Inner>,
    /// Connections made with this filter (pruned as they go), so a rule change can
    /// release frames held back and close connections across a new partition.
    conns: Mutex<Vec<Weak<Connection>>>,
}

impl fmt::Debug for FaultFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.inner.lock();
        f.debug_struct("FaultFilter")
            .field("active", &self.is_active())
            .field("local", &inner.local)
            .field("rules", &inner.rules)
            .field("trace_len", &inner.trace.len())
            .finish()
    }
}

impl Default for FaultFilter {
    fn default() -> Self {
        FaultFilter::new()
    }
}

impl FaultFilter {
    /// A filter with no rules (inert).
    pub fn new() -> FaultFilter {
        FaultFilter::with_trace_capacity(DEFAULT_TRACE_CAPACITY)
    }

    /// A filter whose trace keeps the last `capacity` decisions.
    pub fn with_trace_capacity(capacity: usize) -> FaultFilter {
        FaultFilter {
            active: AtomicBool::new(false),
            created: Instant::now(),
            inner: Mutex::new(Inner {
                rules: FaultRules::default(),
                local: None,
                streams: HashMap::new(),
                trace: VecDeque::new(),
                trace_capacity: capacity.max(1),
                trace_lost: 0,
                next_seq: 1,
            }),
            conns: Mutex::new(Vec::new()),
        }
    }

    /// Whether any rule or partition is set. The hot path's only cost: one relaxed load.
    #[inline]
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Replace the rules (frame counters and random streams restart from the new seed).
    /// Frames held back by an earlier `Reorder` are released; connections open across a
    /// new `close_open` partition are closed.
    pub fn set_rules(&self, rules: FaultRules) -> Result<(), FaultError> {
        rules.validate()?;
        {
            let mut inner = self.inner.lock();
            self.active.store(!rules.is_empty(), Ordering::Relaxed);
            inner.rules = rules;
            inner.streams.clear();
        }
        self.rules_changed();
        Ok(())
    }

    /// Remove every rule and partition: the filter becomes inert (held frames are
    /// released; delayed frames still arrive when their delay ends).
    pub fn clear(&self) {
        {
            let mut inner = self.inner.lock();
            self.active.store(false, Ordering::Relaxed);
            let seed = inner.rules.seed;
            inner.rules = FaultRules::seeded(seed);
            inner.streams.clear();
        }
        self.rules_changed();
    }

    /// Remove the partitions, keep the other rules.
    pub fn heal(&self) {
        let mut rules = self.rules();
        rules.partitions.clear();
        // Cannot fail: the rules were valid when set, and fewer partitions stay valid.
        let _ = self.set_rules(rules);
    }

    /// The rules in force.
    pub fn rules(&self) -> FaultRules {
        self.inner.lock().rules.clone()
    }

    /// Name this process for partitions and rules: a host learns its node id only when
    /// it registers, after its first connection (to the controller) is open. Overrides
    /// what connections' identities say, except in the controller (which is always
    /// [`Endpoint::Controller`]). Random streams restart, as they are keyed by it.
    pub fn set_local(&self, node: NodeId) {
        {
            let mut inner = self.inner.lock();
            inner.local = Some(node);
            inner.streams.clear();
        }
        self.rules_changed();
    }

    /// The node id given to [`FaultFilter::set_local`].
    pub fn local(&self) -> Option<NodeId> {
        self.inner.lock().local
    }

    /// The recorded decisions, oldest first.
    pub fn trace(&self) -> Vec<TraceEntry> {
        self.inner.lock().trace.iter().cloned().collect()
    }

    /// The recorded decisions, oldest first, emptying the trace.
    pub fn take_trace(&self) -> Vec<TraceEntry> {
        self.inner.lock().trace.drain(..).collect()
    }

    /// The trace's decisions sorted by stream and frame: what two runs with the same
    /// seed and the same frames agree on (times, connection ids and the interleaving of
    /// streams left out).
    pub fn decisions(&self) -> Vec<Decision> {
        let mut d: Vec<Decision> = self
            .inner
            .lock()
            .trace
            .iter()
            .map(|e| e.decision.clone())
            .collect();
        d.sort();
        d
    }

    /// The seed, the rules and the trace as text, one decision per line: what a failing
    /// test prints.
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let inner = self.inner.lock();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "fault filter: seed {}, local {}, {} rules, {} partitions; {} decisions recorded{}",
            inner.rules.seed,
            inner
                .local
                .map_or_else(|| "?".to_string(), |n| n.to_string()),
            inner.rules.rules.len(),
            inner.rules.partitions.len(),
            inner.trace.len(),
            if inner.trace_lost > 0 {
                format!(" ({} older ones dropped)", inner.trace_lost)
            } else {
                String::new()
            }
        );
        for (i, r) in inner.rules.rules.iter().enumerate() {
            let _ = writeln!(out, "  rule {i}: {r:?}");
        }
        for p in &inner.rules.partitions {
            let _ = writeln!(out, "  partition: {}", p.describe());
        }
        for e in &inner.trace {
            let _ = writeln!(out, "  {e}");
        }
        out
    }

    // ---- used by connections ---------------------------------------------------------

    pub(crate) fn register(&self, conn: Weak<Connection>) {
        let mut conns = self.conns.lock();
        // Amortized pruning: drop dead entries whenever the list doubles.
        if conns.len() >= 64 && conns.len().is_power_of_two() {
            conns.retain(|w| w.strong_count() > 0);
        }
        conns.push(conn);
    }

    fn rules_changed(&self) {
        let live: Vec<Arc<Connection>> = {
            let mut conns = self.conns.lock();
            conns.retain(|w| w.strong_count() > 0);
            conns.iter().filter_map(Weak::upgrade).collect()
        };
        for c in live {
            c.fault_rules_changed();
        }
    }

    fn resolve_local(inner: &Inner, hint: Option<Endpoint>) -> Option<Endpoint> {
        match hint {
            Some(Endpoint::Controller) => hint,
            _ => inner.local.map(Endpoint::Node).or(hint),
        }
    }

    fn record(&self, inner: &mut Inner, conn: u64, decision: Decision) {
        if inner.trace.len() >= inner.trace_capacity {
            inner.trace.pop_front();
            inner.trace_lost += 1;
        }
        let seq = inner.next_seq;
        inner.next_seq += 1;
        tracing::debug!(conn, ?decision, "fault filter");
        inner.trace.push_back(TraceEntry {
            seq,
            at: self.created.elapsed(),
            conn,
            decision,
        });
    }

    /// The partition separating this process from `peer`, if any, as a reason.
    fn partition_between(
        inner: &Inner,
        local: Option<Endpoint>,
        peer: Option<Endpoint>,
        closing_only: bool,
    ) -> Option<String> {
        inner
            .rules
            .partitions
            .iter()
            .find(|p| (!closing_only || p.close_open) && p.separates(local, peer))
            .map(|p| {
                let name = |e: Option<Endpoint>| e.map_or_else(String::new, |e| e.to_string());
                format!(
                    "partitioned by the fault filter: {} and {} are on different sides of {}",
                    name(local),
                    name(peer),
                    p.describe()
                )
            })
    }

    /// At the hello: the reason to refuse a connection with `peer`, if a partition
    /// separates it from this process (recorded in the trace).
    pub(crate) fn refusal(
        &self,
        conn: u64,
        local_hint: Option<Endpoint>,
        peer: Option<Endpoint>,
        dialed: bool,
        kind: &str,
    ) -> Option<String> {
        let mut inner = self.inner.lock();
        let local = Self::resolve_local(&inner, local_hint);
        let reason = Self::partition_between(&inner, local, peer, false)?;
        let decision = Decision {
            local,
            peer,
            direction: if dialed {
                Direction::Incoming
            } else {
                Direction::Outgoing
            },
            dialed,
            frame: 0,
            kind: kind.to_string(),
            rule: None,
            action: TraceAction::Refused,
        };
        self.record(&mut inner, conn, decision);
        Some(reason)
    }

    /// After a rule change: the reason to close an open connection with `peer`, if a
    /// `close_open` partition now separates it from this process (recorded).
    pub(crate) fn close_reason(
        &self,
        conn: u64,
        local_hint: Option<Endpoint>,
        peer: Option<Endpoint>,
        dialed: bool,
    ) -> Option<String> {
        if !self.is_active() {
            return None;
        }
        let mut inner = self.inner.lock();
        let local = Self::resolve_local(&inner, local_hint);
        let reason = Self::partition_between(&inner, local, peer, true)?;
        let decision = Decision {
            local,
            peer,
            direction: Direction::Both,
            dialed,
            frame: 0,
            kind: String::new(),
            rule: None,
            action: TraceAction::Closed,
        };
        self.record(&mut inner, conn, decision);
        Some(reason)
    }

    /// The verdict on one frame (recorded in the trace unless it is `Pass`).
    pub(crate) fn judge(&self, f: &FrameInfo<'_>) -> Verdict {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let local = Self::resolve_local(inner, f.local_hint);
        let key = StreamKey {
            peer: f.peer,
            direction: f.direction,
            dialed: f.dialed,
        };
        let seed = inner.rules.seed;
        let nrules = inner.rules.rules.len();
        let stream = inner.streams.entry(key).or_insert_with(|| Stream {
            rng: stream_rng(seed, local, key),
            frames: 0,
            counts: vec![0; nrules],
        });
        stream.frames += 1;
        let frame = stream.frames;
        let partitioned = inner
            .rules
            .partitions
            .iter()
            .any(|p| p.separates(local, f.peer));
        let mut fired: Option<(usize, Verdict, TraceAction)> = None;
        if partitioned {
            fired = None;
        } else {
            for (i, rule) in inner.rules.rules.iter().enumerate() {
                if !rule.selects(f.direction, f.peer, f.kind) {
                    continue;
                }
                // Every selecting rule counts the frame, fired or not, so a rule's
                // count does not depend on the rules before it.
                stream.counts[i] += 1;
                if fired.is_some() || !rule.frames.admits(stream.counts[i]) {
                    continue;
                }
                if rule.probability < 1.0 && stream.rng.random::<f64>() >= rule.probability {
                    continue;
                }
                fired = Some(match rule.action {
                    FaultAction::Drop => (i, Verdict::Drop, TraceAction::Drop),
                    FaultAction::Delay(d) => (i, Verdict::Delay(d), TraceAction::Delay(d)),
                    FaultAction::Reorder { after } => (
                        i,
                        Verdict::Reorder { after },
                        TraceAction::Reorder { after },
                    ),
                    FaultAction::Cut if f.direction == Direction::Incoming => {
                        (i, Verdict::CutIncoming, TraceAction::CutIncoming)
                    }
                    FaultAction::Cut => {
                        let keep = if f.len > 1 {
                            stream.rng.random_range(1..f.len)
                        } else {
                            0
                        };
                        (
                            i,
                            Verdict::Cut { keep },
                            TraceAction::Cut {
                                written: keep,
                                len: f.len,
                            },
                        )
                    }
                });
            }
        }
        let (rule, verdict, action) = match (partitioned, fired) {
            (true, _) => (None, Verdict::Drop, TraceAction::Partitioned),
            (false, Some((i, v, a))) => (Some(i), v, a),
            (false, None) => return Verdict::Pass,
        };
        let decision = Decision {
            local,
            peer: f.peer,
            direction: f.direction,
            dialed: f.dialed,
            frame,
            kind: f.kind.to_string(),
            rule,
            action,
        };
        self.record(inner, f.conn, decision);
        verdict
    }
}

/// The random stream of one (local, peer, direction, side): the rules' seed selects the
/// key, the stream's identity selects ChaCha's stream number, so streams are independent
/// and stable across runs and processes (no process-local counter is involved).
fn stream_rng(seed: u64, local: Option<Endpoint>, key: StreamKey) -> ChaCha8Rng {
    fn code(e: Option<Endpoint>) -> u64 {
        match e {
            None => 0,
            Some(Endpoint::Controller) => 1,
            Some(Endpoint::Node(n)) => 2 + u64::from(n.0),
        }
    }
    let dir = match key.direction {
        Direction::Outgoing => 0,
        Direction::Incoming => 1,
        Direction::Both => 2,
    };
    let mut h = splitmix64(seed ^ 0x6772_616e_756c_6531);
    for part in [code(local), code(key.peer), dir, u64::from(key.dialed)] {
        h = splitmix64(h ^ part);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(h);
    rng
}

/// SplitMix64's finalizer: a fixed, well-mixed function of its input (unlike std's
/// hashers, whose output is not promised to stay the same across Rust releases).
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(dir: Direction, peer: u32, kind: &str) -> FrameInfo<'_> {
        FrameInfo {
            conn: 1,
            local_hint: Some(Endpoint::Node(NodeId(1))),
            peer: Some(Endpoint::Node(NodeId(peer))),
            dialed: true,
            direction: dir,
            kind,
            len: 100,
        }
    }

    #[test]
    fn inert_without_rules() {
        let f = FaultFilter::new();
        assert!(!f.is_active());
        assert_eq!(
            f.judge(&frame(Direction::Outgoing, 2, "Call")),
            Verdict::Pass
        );
        assert!(f.trace().is_empty());
    }

    #[test]
    fn selectors_and_counts() {
        let f = FaultFilter::new();
        f.set_rules(
            FaultRules::seeded(1)
                .rule(
                    FaultRule::new(FaultAction::Drop)
                        .outgoing()
                        .node(NodeId(2))
                        .kind("Call")
                        .nth(2),
                )
                .rule(FaultRule::new(FaultAction::Cut).incoming().first(1)),
        )
        .unwrap();
        assert!(f.is_active());
        let out = |k| f.judge(&frame(Direction::Outgoing, 2, k));
        assert_eq!(out("Call"), Verdict::Pass);
        assert_eq!(out("Value"), Verdict::Pass);
        assert_eq!(out("Call"), Verdict::Drop);
        assert_eq!(out("Call"), Verdict::Pass);
        // Another peer is another stream and is not selected anyway.
        assert_eq!(
            f.judge(&frame(Direction::Outgoing, 3, "Call")),
            Verdict::Pass
        );
        assert_eq!(
            f.judge(&frame(Direction::Incoming, 3, "Call")),
            Verdict::CutIncoming
        );
        // First(1) counts per stream: the stream from n2 has its own first frame.
        assert_eq!(
            f.judge(&frame(Direction::Incoming, 2, "Call")),
            Verdict::CutIncoming
        );
        assert_eq!(
            f.judge(&frame(Direction::Incoming, 2, "Call")),
            Verdict::Pass
        );
        let t = f.trace();
        assert_eq!(t.len(), 3);
        assert_eq!(t[0].decision.frame, 3);
        assert_eq!(t[0].decision.rule, Some(0));
        // Replacing the rules restarts the counts.
        f.set_rules(f.rules()).unwrap();
        assert_eq!(out("Call"), Verdict::Pass);
        assert_eq!(out("Call"), Verdict::Drop);
        f.clear();
        assert!(!f.is_active());
    }

    #[test]
    fn partitions_drop_both_ways_and_heal() {
        let f = FaultFilter::new();
        f.set_rules(
            FaultRules::seeded(0).partition(Partition::nodes([vec![NodeId(1)], vec![NodeId(2)]])),
        )
        .unwrap();
        assert_eq!(
            f.judge(&frame(Direction::Outgoing, 2, "Call")),
            Verdict::Drop
        );
        assert_eq!(
            f.judge(&frame(Direction::Incoming, 2, "Value")),
            Verdict::Drop
        );
        // n3 is on no side.
        assert_eq!(
            f.judge(&frame(Direction::Outgoing, 3, "Call")),
            Verdict::Pass
        );
        let r = f
            .refusal(
                9,
                Some(Endpoint::Node(NodeId(1))),
                Some(Endpoint::Node(NodeId(2))),
                false,
                "Hello",
            )
            .unwrap();
        assert!(r.contains("partitioned by the fault filter"), "{r}");
        f.heal();
        assert!(!f.is_active());
        assert_eq!(
            f.judge(&frame(Direction::Outgoing, 2, "Call")),
            Verdict::Pass
        );
    }

    #[test]
    fn set_local_overrides_identity_but_not_the_controller() {
        let f = FaultFilter::new();
        f.set_rules(FaultRules::seeded(0).partition(Partition::new(vec![
            vec![Endpoint::Node(NodeId(5))],
            vec![Endpoint::Controller],
        ])))
        .unwrap();
        let ctl = Some(Endpoint::Controller);
        assert!(f.refusal(1, None, ctl, true, "HelloOk").is_none());
        f.set_local(NodeId(5));
        assert!(f.refusal(1, None, ctl, true, "HelloOk").is_some());
        // The controller's own process stays the controller whatever set_local says.
        assert!(f
            .refusal(1, ctl, Some(Endpoint::Node(NodeId(5))), false, "Hello")
            .is_some());
    }

    fn run(seed: u64) -> Vec<Decision> {
        let f = FaultFilter::new();
        f.set_rules(
            FaultRules::seeded(seed)
                .rule(
                    FaultRule::new(FaultAction::Drop)
                        .kind("Call")
                        .probability(0.3),
                )
                .rule(FaultRule::new(FaultAction::Cut).probability(0.1)),
        )
        .unwrap();
        for i in 0..200 {
            let kind = if i % 3 == 0 { "Value" } else { "Call" };
            f.judge(&frame(Direction::Outgoing, 2 + i % 2, kind));
            f.judge(&frame(Direction::Incoming, 2, kind));
        }
        f.decisions()
    }

    #[test]
    fn same_seed_same_decisions() {
        let a = run(7);
        assert!(a.len() > 20, "{}", a.len());
        assert_eq!(a, run(7));
        assert_ne!(a, run(8));
    }

    #[test]
    fn streams_do_not_depend_on_interleaving() {
        let rules = FaultRules::seeded(3).rule(FaultRule::new(FaultAction::Drop).probability(0.5));
        let a = FaultFilter::new();
        a.set_rules(rules.clone()).unwrap();
        let b = FaultFilter::new();
        b.set_rules(rules).unwrap();
        for _ in 0..50 {
            a.judge(&frame(Direction::Outgoing, 2, "Call"));
            a.judge(&frame(Direction::Outgoing, 3, "Call"));
        }
        for _ in 0..50 {
            b.judge(&frame(Direction::Outgoing, 3, "Call"));
        }
        for _ in 0..50 {
            b.judge(&frame(Direction::Outgoing, 2, "Call"));
        }
        assert_eq!(a.decisions(), b.decisions());
    }

    #[test]
    fn invalid_rules_are_refused() {
        let f = FaultFilter::new();
        let bad = FaultRules::seeded(0).rule(FaultRule::new(FaultAction::Drop).probability(1.5));
        assert!(matches!(
            f.set_rules(bad),
            Err(FaultError::Probability { .. })
        ));
        let bad = FaultRules::seeded(0).rule(FaultRule::new(FaultAction::Drop).nth(0));
        assert!(f.set_rules(bad).is_err());
        let bad = FaultRules::seeded(0).partition(Partition::nodes([vec![NodeId(1)]]));
        assert!(f.set_rules(bad).is_err());
        let bad =
            FaultRules::seeded(0).partition(Partition::nodes([vec![NodeId(1)], vec![NodeId(1)]]));
        assert!(f.set_rules(bad).is_err());
        assert!(!f.is_active());
    }

    #[test]
    fn trace_is_bounded() {
        let f = FaultFilter::with_trace_capacity(10);
        f.set_rules(FaultRules::seeded(0).rule(FaultRule::new(FaultAction::Drop)))
            .unwrap();
        for _ in 0..25 {
            f.judge(&frame(Direction::Outgoing, 2, "Call"));
        }
        let t = f.trace();
        assert_eq!(t.len(), 10);
        assert_eq!(t[0].seq, 16);
        assert!(
            f.report().contains("15 older ones dropped"),
            "{}",
            f.report()
        );
        assert_eq!(f.take_trace().len(), 10);
        assert!(f.trace().is_empty());
    }

    #[test]
    fn rules_round_trip_through_json() {
        let rules = FaultRules::seeded(42)
            .rule(
                FaultRule::new(FaultAction::Delay(Duration::from_millis(5)))
                    .peer(Endpoint::Controller)
                    .kind("Heartbeat")
                    .first(3)
                    .probability(0.5),
            )
            .rule(FaultRule::new(FaultAction::Reorder { after: 2 }).outgoing())
            .partition(
                Partition::nodes([vec![NodeId(1)], vec![NodeId(2), NodeId(3)]]).closing_open(),
            );
        let json = serde_json::to_string(&rules).unwrap();
        let back: FaultRules = serde_json::from_str(&json).unwrap();
        assert_eq!(back, rules);
        // Omitted fields take their defaults.
        let short: FaultRules =
            serde_json::from_str(r#"{"seed":1,"rules":[{"action":"Drop","kind":"Call"}]}"#)
                .unwrap();
        assert_eq!(
            short.rules[0],
            FaultRule::new(FaultAction::Drop).kind("Call")
        );
    }
}
