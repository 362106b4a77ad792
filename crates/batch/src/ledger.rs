//! The job's range bookkeeping as a pure state machine: which worker owns which part of
//! the input, what has been reported, what waits for a worker. The coordinator (the
//! async loop in `coordinator`) feeds it events — a worker was created or not, a work
//! call answered or failed, a steal answered — and carries out the [`Action`]s it
//! returns: create a worker, send a work call, a steal or a stop request, destroy a
//! worker, log a change. It reads no clock and does no I/O, so every interleaving of
//! split, steal, report and loss can be played against it; the model test at the end of
//! this file plays thousands of them against simulated workers that follow the real
//! workers' cursor rules.
//!
//! **Accounting rule** (why no item is lost or counted twice). Every index of the input
//! is, at every moment, in exactly one of: an accepted reply's output, the range `lo..hi`
//! of a live slot (what its worker has not reported yet), or the pool of ranges no
//! worker owns. A reply moves its slot's `lo` up to what it reports, and must start at
//! `lo` and end by `hi` (anything else is a bookkeeping bug, reported, never a wrong
//! result). A steal lowers the victim's `hi` when its answer arrives, and the stolen
//! range becomes another slot's in the same step. A slot is retired only when no call
//! of its is in flight; what it still owns then goes to the pool and is computed again.
//! A steal can run at the worker and its answer be lost: the worker's cursor then ends
//! below its slot's `hi`, and the part in between is nobody's. The ledger finds it
//! either way: when a later steal's answer shows the worker's range ended below `hi`
//! (the answer's end), or when the worker finishes below `hi`; the part goes to the
//! pool. (The model test found the first case in the earlier coordinator, which only
//! knew the second.)

use crate::worker::Stop;
use crate::Trigger;
use granule_runtime::NodeId;
use std::collections::{BTreeMap, HashMap};

/// A range of input indices, `start..end`.
pub(crate) type Span = (u64, u64);

/// What the job produced: each accepted reply's output under the range it covers.
pub(crate) type Outputs<O> = BTreeMap<u64, (u64, O)>;

/// Who gets a stolen range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Thief {
    /// A new worker on this node.
    New(NodeId),
    /// This worker, whose own range is finished.
    Slot(usize),
}

/// What the coordinator must do, in order.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Action {
    /// Create worker `wid` on `node`, over `range`.
    Create {
        wid: usize,
        node: NodeId,
        range: Span,
    },
    /// Send work call `call` to worker `wid`; `assign` gives it a new range (its own is
    /// finished).
    Call {
        wid: usize,
        call: u64,
        assign: Option<Span>,
    },
    /// Ask worker `victim` for the upper half of its unclaimed range, for `thief`.
    Steal { victim: usize, thief: Thief },
    /// Ask worker `wid` to stop at its next item boundary (a policy shrink).
    AskStop { wid: usize },
    /// Free worker `wid`'s proclet (retired; it may be gone already).
    Destroy { wid: usize },
    /// The job's worker set changed on `node` (worker `wid` started or stopped):
    /// `on_node` and `total` workers after it.
    Note {
        wid: usize,
        node: NodeId,
        what: Trigger,
        on_node: usize,
        total: usize,
    },
}

#[derive(PartialEq, Eq, Debug, Clone, Copy)]
enum Phase {
    /// Its proclet is being created.
    Creating,
    /// It has a work call in flight, or is about to get one.
    Working,
    /// Its range is done; waiting for a steal to bring it more.
    Waiting,
    Retired,
}

/// One worker slot as the bookkeeping sees it.
#[derive(Debug, Clone)]
struct Book {
    node: NodeId,
    lo: u64,
    hi: u64,
    phase: Phase,
    /// Its proclet exists (created, not known lost).
    alive: bool,
    /// A work call is in flight.
    calling: bool,
    /// A steal from it is in flight.
    stealing: bool,
    /// How its last call ended, kept while a steal from it is in flight (the steal's
    /// answer says where its range ends).
    after: Option<Stop>,
    /// Asked to stop (a policy shrink); its reply retires it.
    asked: bool,
}

/// A bookkeeping violation: a reply that does not fit what the slot owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mismatch(pub String);

/// The job's bookkeeping.
pub(crate) struct Ledger<O> {
    /// The ranges the job covers (the whole input, or ranges computed again).
    ranges: Vec<Span>,
    /// Items in them.
    len: u64,
    /// Smallest range a steal leaves or takes.
    min_steal: u64,
    slots: Vec<Book>,
    pool: Vec<Span>,
    outputs: Outputs<O>,
    done: u64,
    /// Steals in flight whose range will start a new worker on the node: counted as
    /// workers there already, or two ticks would both grow onto the node.
    growing: HashMap<NodeId, usize>,
    /// Work calls made so far (the last call's id).
    calls: u64,
    actions: Vec<Action>,
}

impl<O> Ledger<O> {
    /// A job over `0..len`.
    #[cfg(test)]
    pub fn new(len: u64, min_steal: u64) -> Self {
        Self::over(vec![(0, len)], min_steal)
    }

    /// A job over these ranges (disjoint).
    pub fn over(ranges: Vec<Span>, min_steal: u64) -> Self {
        let mut ranges: Vec<Span> = ranges.into_iter().filter(|(a, b)| b > a).collect();
        ranges.sort_unstable();
        Ledger {
            len: ranges.iter().map(|(a, b)| b - a).sum(),
            ranges,
            min_steal: min_steal.max(1),
            slots: Vec::new(),
            pool: Vec::new(),
            outputs: BTreeMap::new(),
            done: 0,
            growing: HashMap::new(),
            calls: 0,
            actions: Vec::new(),
        }
    }

    /// What to do, in order; empties the list.
    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// Every index reported.
    pub fn is_done(&self) -> bool {
        self.done >= self.len
    }

    /// Indices not reported yet.
    pub fn remaining(&self) -> u64 {
        self.len - self.done
    }

    /// The accepted outputs.
    pub fn into_outputs(self) -> Outputs<O> {
        self.outputs
    }

    pub fn node_of(&self, wid: usize) -> NodeId {
        self.slots[wid].node
    }

    /// What worker `wid` still owns.
    pub fn range_of(&self, wid: usize) -> Span {
        (self.slots[wid].lo, self.slots[wid].hi)
    }

    /// Whether some range waits for a worker.
    pub fn has_pool(&self) -> bool {
        !self.pool.is_empty()
    }

    /// The job's workers on `node`, including ones being created or about to be.
    pub fn workers_on(&self, node: NodeId) -> usize {
        self.slots
            .iter()
            .filter(|s| s.phase != Phase::Retired && s.node == node)
            .count()
            + self.growing.get(&node).copied().unwrap_or(0)
    }

    /// All the job's workers, including ones being created or about to be.
    pub fn live_workers(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.phase != Phase::Retired)
            .count()
            + self.growing.values().sum::<usize>()
    }

    /// Workers a shrink may ask to stop (working, a call in flight, not asked yet), with
    /// their nodes.
    pub fn stoppable(&self) -> Vec<(usize, NodeId)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.phase == Phase::Working && s.calling && !s.asked && s.alive)
            .map(|(i, s)| (i, s.node))
            .collect()
    }

    // ---- decisions ----

    /// Start the job with one worker on `node` over its largest range; the others wait
    /// in the pool for the workers the policy adds (or the first one's next call).
    pub fn start(&mut self, node: NodeId) {
        if self.len > 0 && self.slots.is_empty() {
            self.pool = self.ranges.clone();
            if let Some(r) = self.take_pool() {
                self.create(node, r);
            }
        }
    }

    /// One more worker on `node`, with handed-back work or half of the largest range.
    /// False when there is nothing to give it.
    pub fn grow(&mut self, node: NodeId) -> bool {
        if let Some(r) = self.take_pool() {
            self.create(node, r);
            true
        } else if let Some(victim) = self.largest(None) {
            *self.growing.entry(node).or_default() += 1;
            self.steal(victim, Thief::New(node));
            true
        } else {
            false
        }
    }

    /// Work handed back and no worker left to take it: a new worker on `node` takes
    /// it (the progress guarantee, whatever the policy says). False if there is none.
    pub fn rescue(&mut self, node: NodeId) -> bool {
        if self.live_workers() > 0 {
            return false;
        }
        match self.take_pool() {
            Some(r) => {
                self.create(node, r);
                true
            }
            None => false,
        }
    }

    /// Ask worker `wid` to stop (a shrink); its reply retires it.
    pub fn ask_stop(&mut self, wid: usize) {
        let s = &mut self.slots[wid];
        if s.phase == Phase::Working && s.calling && !s.asked && s.alive {
            s.asked = true;
            self.actions.push(Action::AskStop { wid });
        }
    }

    // ---- events ----

    /// Worker `wid`'s proclet was created (`ok`), or could not be.
    pub fn created(&mut self, wid: usize, ok: bool) {
        if ok {
            self.slots[wid].alive = true;
            self.call(wid, None);
            self.note(wid, Trigger::Grew);
        } else {
            self.retire(wid, Trigger::Lost);
        }
    }

    /// Worker `wid`'s work call answered: it computed `start..end` (output `out`) and
    /// stopped for `stop`.
    pub fn replied(
        &mut self,
        wid: usize,
        start: u64,
        end: u64,
        stop: Stop,
        out: O,
    ) -> Result<(), Mismatch> {
        let s = &mut self.slots[wid];
        if !s.calling || s.phase != Phase::Working {
            return Err(Mismatch(format!(
                "internal: worker {wid} answered a call it was not making ({:?})",
                s.phase
            )));
        }
        s.calling = false;
        if end < start || start != s.lo || end > s.hi {
            return Err(Mismatch(format!(
                "internal: worker reported {start}..{end} but owns {}..{}",
                s.lo, s.hi
            )));
        }
        if end > start {
            s.lo = end;
            self.done += end - start;
            self.outputs.insert(start, (end, out));
        }
        match stop {
            Stop::Budget | Stop::Moving => self.call(wid, None),
            stop if self.slots[wid].stealing => self.slots[wid].after = Some(stop),
            Stop::Finished => self.find_work(wid),
            Stop::Contended => self.retire(wid, Trigger::Contended),
            Stop::Asked => self.retire(wid, Trigger::Asked),
        }
        Ok(())
    }

    /// Worker `wid`'s work call failed (its node died, its answer was lost): what it
    /// owns is computed again elsewhere.
    pub fn call_failed(&mut self, wid: usize) {
        let s = &mut self.slots[wid];
        s.calling = false;
        s.alive = false;
        if !s.stealing {
            self.retire(wid, Trigger::Lost);
        }
    }

    /// A steal from `victim` for `thief` answered with the stolen range (`None`: nothing
    /// to steal, or the steal failed).
    pub fn stolen(&mut self, victim: usize, thief: Thief, range: Option<Span>) {
        self.slots[victim].stealing = false;
        if let Thief::New(node) = thief {
            if let Some(g) = self.growing.get_mut(&node) {
                *g = g.saturating_sub(1);
            }
        }
        if let Some((s, e)) = range {
            let v = &mut self.slots[victim];
            // The worker's range ended at `e` before this steal: anything between it and
            // what the slot owns was taken by earlier steals whose answers were lost.
            // Nobody computes that part now: compute it again.
            if e < v.hi {
                self.pool.push((e, v.hi));
            }
            v.hi = s;
        }
        // A victim whose call ended (or was lost) while the steal was in flight.
        let v = &mut self.slots[victim];
        if !v.calling && v.phase != Phase::Retired {
            match v.after.take() {
                Some(Stop::Finished) => self.find_work(victim),
                Some(Stop::Asked) => self.retire(victim, Trigger::Asked),
                Some(Stop::Contended) => self.retire(victim, Trigger::Contended),
                _ if !v.alive => self.retire(victim, Trigger::Lost),
                _ => {}
            }
        }
        match (thief, range) {
            (Thief::New(node), Some(range)) => self.create(node, range),
            (Thief::Slot(wid), Some(range)) => self.call(wid, Some(range)),
            (Thief::Slot(wid), None) => {
                if let Some(r) = self.take_pool() {
                    self.call(wid, Some(r));
                } else {
                    self.retire(wid, Trigger::Done);
                }
            }
            (Thief::New(_), None) => {}
        }
    }

    // ---- steps ----

    fn create(&mut self, node: NodeId, range: Span) {
        let wid = self.slots.len();
        self.slots.push(Book {
            node,
            lo: range.0,
            hi: range.1,
            phase: Phase::Creating,
            alive: false,
            calling: false,
            stealing: false,
            after: None,
            asked: false,
        });
        self.actions.push(Action::Create { wid, node, range });
    }

    fn call(&mut self, wid: usize, assign: Option<Span>) {
        let s = &mut self.slots[wid];
        if !s.alive {
            // Lost before its call could go out (not expected): recompute its range.
            self.retire(wid, Trigger::Lost);
            return;
        }
        if let Some((a, b)) = assign {
            s.lo = a;
            s.hi = b;
        }
        s.calling = true;
        s.phase = Phase::Working;
        self.calls += 1;
        self.actions.push(Action::Call {
            wid,
            call: self.calls,
            assign,
        });
    }

    fn steal(&mut self, victim: usize, thief: Thief) {
        self.slots[victim].stealing = true;
        self.actions.push(Action::Steal { victim, thief });
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
                    && s.alive
                    && !s.stealing
                    && !s.asked
                    && s.hi - s.lo >= 2 * self.min_steal
            })
            .max_by_key(|(_, s)| s.hi - s.lo)
            .map(|(i, _)| i)
    }

    fn take_pool(&mut self) -> Option<Span> {
        let i = self
            .pool
            .iter()
            .enumerate()
            .max_by_key(|(_, r)| r.1 - r.0)
            .map(|(i, _)| i)?;
        Some(self.pool.swap_remove(i))
    }

    /// Give a worker whose range is done more work: handed-back work first, else half
    /// of the largest remaining range; with neither, retire it.
    fn find_work(&mut self, wid: usize) {
        let s = &mut self.slots[wid];
        if s.hi > s.lo {
            // Its worker finished below its slot's end: a steal ran there whose answer
            // was lost. The rest is nobody's: compute it again.
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
        let s = &mut self.slots[wid];
        if s.phase == Phase::Retired {
            return;
        }
        s.phase = Phase::Retired;
        s.alive = false;
        if s.hi > s.lo {
            self.pool.push((s.lo, s.hi));
            s.lo = s.hi;
        }
        self.note(wid, why);
        self.actions.push(Action::Destroy { wid });
    }

    fn note(&mut self, wid: usize, what: Trigger) {
        let node = self.slots[wid].node;
        let (on_node, total) = (self.workers_on(node), self.live_workers());
        self.actions.push(Action::Note {
            wid,
            node,
            what,
            on_node,
            total,
        });
    }

    /// The accounting rule, checked: accepted outputs, live slots' ranges and the pool
    /// partition `0..len` (for tests).
    #[cfg(test)]
    fn check(&self) -> Result<(), String> {
        let mut spans: Vec<Span> = self.outputs.iter().map(|(s, (e, _))| (*s, *e)).collect();
        spans.extend(
            self.slots
                .iter()
                .filter(|s| s.phase != Phase::Retired && s.hi > s.lo)
                .map(|s| (s.lo, s.hi)),
        );
        spans.extend(self.pool.iter().copied().filter(|(a, b)| b > a));
        spans.sort_unstable();
        // Adjacent pieces joined must give back the job's ranges exactly.
        let mut joined: Vec<Span> = Vec::new();
        for (s, e) in spans {
            match joined.last_mut() {
                Some(last) if last.1 == s => last.1 = e,
                Some(last) if last.1 > s => {
                    return Err(format!(
                        "{s}..{e} overlaps {last:?} (job {:?})",
                        self.ranges
                    ))
                }
                _ => joined.push((s, e)),
            }
        }
        let mut want: Vec<Span> = Vec::new();
        for &(s, e) in &self.ranges {
            match want.last_mut() {
                Some(last) if last.1 == s => last.1 = e,
                _ => want.push((s, e)),
            }
        }
        if joined != want {
            return Err(format!("ranges {joined:?} do not partition {want:?}"));
        }
        if self
            .slots
            .iter()
            .any(|s| s.phase == Phase::Retired && s.hi > s.lo)
        {
            return Err("a retired slot still owns a range".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::Cursor;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    use std::collections::VecDeque;

    fn n(i: u32) -> NodeId {
        NodeId(i)
    }

    #[test]
    fn a_steal_hands_the_upper_part_to_a_new_worker() {
        let mut l: Ledger<()> = Ledger::new(100, 1);
        l.start(n(1));
        assert_eq!(
            l.take_actions(),
            vec![Action::Create {
                wid: 0,
                node: n(1),
                range: (0, 100)
            }]
        );
        l.created(0, true);
        let a = l.take_actions();
        assert!(
            matches!(
                a[0],
                Action::Call {
                    wid: 0,
                    call: 1,
                    assign: None
                }
            ),
            "{a:?}"
        );
        assert!(l.grow(n(2)));
        assert_eq!(
            l.workers_on(n(2)),
            1,
            "counted while the steal is in flight"
        );
        l.take_actions();
        l.stolen(0, Thief::New(n(2)), Some((60, 100)));
        assert_eq!(
            l.take_actions(),
            vec![Action::Create {
                wid: 1,
                node: n(2),
                range: (60, 100)
            }]
        );
        assert_eq!(l.range_of(0), (0, 60));
        l.check().unwrap();
    }

    #[test]
    fn a_report_from_another_start_is_a_mismatch() {
        // What a work call served from a moving worker's dropped copy did: the next
        // report starts below what the coordinator accounted.
        let mut l: Ledger<()> = Ledger::new(100, 1);
        l.start(n(1));
        l.created(0, true);
        l.replied(0, 0, 30, Stop::Budget, ()).unwrap();
        let e = l.replied(0, 10, 40, Stop::Budget, ()).unwrap_err();
        assert!(e.0.contains("reported 10..40 but owns 30..100"), "{e:?}");
    }

    #[test]
    fn a_lost_steal_answer_is_recomputed_not_lost() {
        let mut l: Ledger<()> = Ledger::new(100, 1);
        l.start(n(1));
        l.created(0, true);
        assert!(l.grow(n(2)));
        // The steal ran at the worker (its cursor now ends at 50) but the answer is lost.
        l.stolen(0, Thief::New(n(2)), None);
        l.replied(0, 0, 50, Stop::Finished, ()).unwrap();
        l.check().unwrap();
        l.take_actions();
        // 50..100 was handed back to the pool, and the finished worker takes it.
        assert!(l.take_actions().is_empty());
        assert_eq!(l.range_of(0), (50, 100));
        l.replied(0, 50, 100, Stop::Finished, ()).unwrap();
        assert!(l.is_done());
    }

    // ---- the model: simulated workers, every interleaving ----

    /// A request on its way to a worker.
    #[derive(Debug, Clone)]
    enum Req {
        Work { assign: Option<Span>, deaf: bool },
        Steal { thief: Thief, deaf: bool },
        Stop,
        Destroy,
    }

    /// An answer on its way to the coordinator.
    #[derive(Debug, Clone)]
    enum Ans {
        Created(usize, bool),
        Work(usize, Result<(u64, u64, Stop, Vec<u64>), ()>),
        Stolen(usize, Thief, Result<Option<Span>, ()>),
    }

    /// A work call running on a simulated worker.
    #[derive(Debug, Clone)]
    struct Running {
        start: u64,
        done_to: u64,
        /// Its caller gave up on it already (a timeout): its answer goes nowhere.
        deaf: bool,
    }

    /// A worker that follows the real worker's rules (`worker.rs`): a cursor that claims
    /// forwards, steals lower its end, a stop gives back what was claimed and not done.
    #[derive(Debug)]
    struct Sim {
        cursor: Cursor,
        alive: bool,
        stop_flag: bool,
        running: Option<Running>,
        inbox: Vec<Req>,
    }

    struct World {
        ledger: Ledger<Vec<u64>>,
        workers: Vec<Option<Sim>>,
        to_coord: Vec<Ans>,
        nodes: u32,
        min_steal: u64,
        watch: bool,
        trace: VecDeque<String>,
    }

    impl World {
        fn new(len: u64, min_steal: u64, nodes: u32, watch: bool) -> World {
            Self::over(vec![(0, len)], min_steal, nodes, watch)
        }

        fn over(ranges: Vec<Span>, min_steal: u64, nodes: u32, watch: bool) -> World {
            let mut w = World {
                ledger: Ledger::over(ranges, min_steal),
                workers: Vec::new(),
                to_coord: Vec::new(),
                nodes,
                min_steal,
                watch,
                trace: VecDeque::new(),
            };
            w.ledger.start(n(1));
            w.dispatch();
            w
        }

        fn log(&mut self, s: String) {
            if self.trace.len() > 60 {
                self.trace.pop_front();
            }
            self.trace.push_back(s);
        }

        /// Carry out the ledger's actions: requests on their way to workers.
        fn dispatch(&mut self) {
            for a in self.ledger.take_actions() {
                self.log(format!("  -> {a:?}"));
                match a {
                    Action::Create { wid, range, .. } => {
                        assert_eq!(wid, self.workers.len(), "slots are numbered in order");
                        self.workers.push(Some(Sim {
                            cursor: Cursor {
                                next: range.0,
                                end: range.1,
                            },
                            alive: true,
                            stop_flag: false,
                            running: None,
                            inbox: Vec::new(),
                        }));
                        self.to_coord.push(Ans::Created(wid, true));
                    }
                    Action::Call { wid, assign, .. } => self.send(
                        wid,
                        Req::Work {
                            assign,
                            deaf: false,
                        },
                    ),
                    Action::Steal { victim, thief } => {
                        self.send(victim, Req::Steal { thief, deaf: false })
                    }
                    Action::AskStop { wid } => self.send(wid, Req::Stop),
                    Action::Destroy { wid } => self.send(wid, Req::Destroy),
                    Action::Note { .. } => {}
                }
            }
        }

        fn send(&mut self, wid: usize, r: Req) {
            let w = self.workers[wid].as_mut().expect("a created worker");
            w.inbox.push(r);
        }

        /// The answer a request to a dead worker gets.
        fn failed(wid: usize, r: &Req) -> Option<Ans> {
            match r {
                Req::Work { deaf: false, .. } => Some(Ans::Work(wid, Err(()))),
                Req::Steal { thief, deaf: false } => Some(Ans::Stolen(wid, *thief, Err(()))),
                _ => None,
            }
        }

        /// Feed one answer to the ledger.
        fn answer(&mut self, a: Ans) -> Result<(), String> {
            self.log(format!("<- {a:?}"));
            match a {
                Ans::Created(wid, ok) => self.ledger.created(wid, ok),
                Ans::Work(wid, Ok((s, e, stop, out))) => {
                    self.ledger.replied(wid, s, e, stop, out).map_err(|m| m.0)?
                }
                Ans::Work(wid, Err(())) => self.ledger.call_failed(wid),
                Ans::Stolen(v, t, r) => self.ledger.stolen(v, t, r.ok().flatten()),
            }
            self.ledger.check()?;
            self.dispatch();
            Ok(())
        }

        /// A worker takes a request from its inbox (in any order: calls run
        /// concurrently on a node).
        fn deliver(&mut self, wid: usize, pick: usize) -> Result<(), String> {
            let min = self.min_steal;
            let Some(w) = self.workers.get_mut(wid).and_then(Option::as_mut) else {
                return Ok(());
            };
            if w.inbox.is_empty() {
                return Ok(());
            }
            let r = w.inbox.remove(pick % w.inbox.len());
            if !w.alive {
                if let Some(a) = Self::failed(wid, &r) {
                    self.to_coord.push(a);
                }
                return Ok(());
            }
            match r {
                Req::Work { assign, deaf } => {
                    if w.running.is_some() {
                        return Err(format!("worker {wid} got a second work call"));
                    }
                    if let Some((s, e)) = assign {
                        if w.cursor.next < w.cursor.end {
                            return Err(format!(
                                "range {s}..{e} assigned to worker {wid} that still has {:?}",
                                w.cursor
                            ));
                        }
                        w.cursor = Cursor { next: s, end: e };
                    }
                    let start = w.cursor.next;
                    w.running = Some(Running {
                        start,
                        done_to: start,
                        deaf,
                    });
                }
                Req::Steal { thief, deaf } => {
                    let got = w.cursor.steal(min);
                    if !deaf {
                        self.to_coord.push(Ans::Stolen(wid, thief, Ok(got)));
                    }
                }
                Req::Stop => w.stop_flag = true,
                Req::Destroy => {
                    w.alive = false;
                    if w.running.take().is_some_and(|r| !r.deaf) {
                        self.to_coord.push(Ans::Work(wid, Err(())));
                    }
                    let inbox = std::mem::take(&mut w.inbox);
                    for r in inbox {
                        if let Some(a) = Self::failed(wid, &r) {
                            self.to_coord.push(a);
                        }
                    }
                }
            }
            Ok(())
        }

        /// A running call makes progress: claims a chunk or computes claimed items.
        fn progress(&mut self, wid: usize, k: u64) {
            let Some(w) = self.workers.get_mut(wid).and_then(Option::as_mut) else {
                return;
            };
            let Some(run) = w.running.as_mut() else {
                return;
            };
            if k.is_multiple_of(2) {
                w.cursor.claim(k / 2 + 1);
            } else {
                run.done_to = (run.done_to + k).min(w.cursor.next);
            }
        }

        /// A running call stops, for a reason its state allows.
        fn stop(&mut self, wid: usize, choice: u8) {
            let watch = self.watch;
            let Some(w) = self.workers.get_mut(wid).and_then(Option::as_mut) else {
                return;
            };
            let Some(run) = w.running.clone() else {
                return;
            };
            let finished = run.done_to == w.cursor.next && w.cursor.next >= w.cursor.end;
            // A stop is checked at every item boundary, the last one included: a call
            // that did everything may still stop for its budget (the next call then
            // finishes at once).
            let stop = if finished && choice & 4 == 0 {
                Stop::Finished
            } else if w.stop_flag && choice & 8 == 0 {
                w.stop_flag = false;
                Stop::Asked
            } else {
                match choice % 3 {
                    0 if watch => Stop::Contended,
                    1 => Stop::Moving,
                    _ => Stop::Budget,
                }
            };
            // Give back what was claimed and not done; a stop for good hands back all.
            w.cursor.next = w.cursor.next.min(run.done_to);
            if matches!(stop, Stop::Contended | Stop::Asked) {
                w.cursor.take_rest();
            }
            w.running = None;
            if run.deaf {
                return;
            }
            let out: Vec<u64> = (run.start..run.done_to).collect();
            self.to_coord
                .push(Ans::Work(wid, Ok((run.start, run.done_to, stop, out))));
        }

        /// The worker's node dies: its call and requests fail, answers already sent
        /// still arrive.
        fn kill(&mut self, wid: usize) {
            let Some(w) = self.workers.get_mut(wid).and_then(Option::as_mut) else {
                return;
            };
            if !w.alive {
                return;
            }
            w.alive = false;
            if w.running.take().is_some_and(|r| !r.deaf) {
                self.to_coord.push(Ans::Work(wid, Err(())));
            }
            for r in std::mem::take(&mut w.inbox) {
                if let Some(a) = Self::failed(wid, &r) {
                    self.to_coord.push(a);
                }
            }
        }

        /// One step of the adversary, chosen by `op` and `x`.
        fn step(&mut self, op: u8, x: u64) -> Result<(), String> {
            let nw = self.workers.len().max(1);
            let wid = (x as usize) % nw;
            match op % 10 {
                0 | 1 => self.deliver(wid, (x >> 8) as usize),
                2 | 3 => {
                    self.progress(wid, x % 64);
                    Ok(())
                }
                4 => {
                    self.stop(wid, (x >> 8) as u8);
                    Ok(())
                }
                5 | 6 => {
                    if self.to_coord.is_empty() {
                        return Ok(());
                    }
                    let i = (x as usize >> 4) % self.to_coord.len();
                    let a = self.to_coord.remove(i);
                    self.answer(a)
                }
                7 => {
                    // The policy: grow onto a node, or shrink.
                    if x.is_multiple_of(3) {
                        let pick = self.ledger.stoppable();
                        if let Some((w, _)) = pick.get((x as usize >> 2) % pick.len().max(1)) {
                            self.ledger.ask_stop(*w);
                        }
                    } else {
                        self.ledger.grow(n(1 + (x >> 2) as u32 % self.nodes));
                    }
                    self.ledger.check()?;
                    self.dispatch();
                    Ok(())
                }
                8 if x & (1 << 40) != 0 => {
                    // A caller that gives up before its call even ran (a timeout): the
                    // error comes back now, and the request still runs later, its
                    // answer going nowhere.
                    let Some(w) = self.workers.get_mut(wid).and_then(Option::as_mut) else {
                        return Ok(());
                    };
                    if w.inbox.is_empty() {
                        return Ok(());
                    }
                    let i = (x as usize >> 8) % w.inbox.len();
                    let gave_up = match &mut w.inbox[i] {
                        Req::Work { deaf, .. } if !*deaf => {
                            *deaf = true;
                            Ans::Work(wid, Err(()))
                        }
                        Req::Steal { thief, deaf } if !*deaf => {
                            *deaf = true;
                            Ans::Stolen(wid, *thief, Err(()))
                        }
                        _ => return Ok(()),
                    };
                    self.to_coord.push(gave_up);
                    Ok(())
                }
                8 => {
                    // An answer lost on its way (the call ran; `call.before_reply`).
                    if self.to_coord.is_empty() {
                        return Ok(());
                    }
                    let i = (x as usize >> 4) % self.to_coord.len();
                    let lost = match self.to_coord[i].clone() {
                        Ans::Work(w, Ok(_)) => Ans::Work(w, Err(())),
                        Ans::Stolen(v, t, Ok(_)) => Ans::Stolen(v, t, Err(())),
                        Ans::Created(w, true) => {
                            // The creation failed after all: no such worker.
                            if let Some(sim) = self.workers[w].as_mut() {
                                sim.alive = false;
                            }
                            Ans::Created(w, false)
                        }
                        other => other,
                    };
                    self.to_coord[i] = lost;
                    Ok(())
                }
                _ => {
                    if x.is_multiple_of(4) {
                        self.kill(wid);
                    }
                    Ok(())
                }
            }
        }

        /// After the adversary: no more faults; everything in flight arrives, workers
        /// run to the end of their calls, and the job must finish.
        fn finish(&mut self) -> Result<(), String> {
            for round in 0..100_000u64 {
                if self.ledger.is_done() {
                    return Ok(());
                }
                let mut moved = false;
                for wid in 0..self.workers.len() {
                    while self.workers[wid]
                        .as_ref()
                        .is_some_and(|w| !w.inbox.is_empty())
                    {
                        self.deliver(wid, 0)?;
                        moved = true;
                    }
                    let running = self.workers[wid]
                        .as_ref()
                        .is_some_and(|w| w.running.is_some());
                    if running {
                        // Work through everything, then stop (finished or budget).
                        let w = self.workers[wid].as_mut().expect("worker");
                        while w.cursor.claim(1 << 20).is_some() {}
                        if let Some(r) = w.running.as_mut() {
                            r.done_to = w.cursor.next;
                        }
                        self.stop(wid, 2);
                        moved = true;
                    }
                }
                if !self.to_coord.is_empty() {
                    let a = self.to_coord.remove(0);
                    self.answer(a)?;
                    moved = true;
                }
                if !moved {
                    if self.ledger.live_workers() == 0 && self.ledger.has_pool() {
                        self.ledger
                            .rescue(n(1 + (round % self.nodes as u64) as u32));
                        self.dispatch();
                    } else {
                        return Err(format!(
                            "stuck: nothing in flight, {} items left, {} workers",
                            self.ledger.remaining(),
                            self.ledger.live_workers()
                        ));
                    }
                }
            }
            Err("did not finish".into())
        }
    }

    /// Play one schedule: the ledger must never see a mismatch, must finish, and the
    /// accepted outputs must be every index once, in order.
    fn play(
        len: u64,
        min_steal: u64,
        nodes: u32,
        watch: bool,
        gaps: bool,
        ops: &[(u8, u64)],
    ) -> Result<(), String> {
        // A first run covers the whole input; a run that computes lost output again
        // covers ranges with gaps between them.
        let ranges = if gaps {
            vec![
                (len / 5, len / 3),
                (len / 2, len / 2 + len / 7),
                (len - len / 4, len),
            ]
        } else {
            vec![(0, len)]
        };
        let want: Vec<u64> = ranges.iter().flat_map(|&(a, b)| a..b).collect();
        let mut w = World::over(ranges, min_steal, nodes, watch);
        let run = (|| {
            for (op, x) in ops {
                w.step(*op, *x)?;
            }
            w.finish()
        })();
        if let Err(e) = run {
            return Err(format!(
                "{e}\nlast steps:\n{}",
                w.trace.iter().cloned().collect::<Vec<_>>().join("\n")
            ));
        }
        let got: Vec<u64> = w
            .ledger
            .into_outputs()
            .into_values()
            .flat_map(|(_, out)| out)
            .collect();
        if got != want {
            return Err(format!("outputs are not {want:?} once each: {got:?}"));
        }
        Ok(())
    }

    #[test]
    fn every_interleaving_of_split_steal_report_and_loss_accounts_each_item_once() {
        let mut runner = TestRunner::new(Config {
            cases: 4000,
            ..Config::default()
        });
        let case = (
            1u64..400,
            1u64..8,
            1u32..4,
            any::<bool>(),
            any::<bool>(),
            proptest::collection::vec((0u8..10, any::<u64>()), 0..400),
        );
        runner
            .run(&case, |(len, min_steal, nodes, watch, gaps, ops)| {
                play(len, min_steal, nodes, watch, gaps, &ops).map_err(TestCaseError::fail)
            })
            .unwrap();
    }

    #[test]
    fn a_report_from_a_stale_cursor_is_caught_by_the_model() {
        // The model itself must be able to fail: a worker whose cursor goes back (what
        // a read served from a moving worker's dropped copy did) is reported as a
        // mismatch, never accepted.
        let mut w = World::new(100, 1, 2, false);
        w.step(5, 0).unwrap(); // Created
        w.step(0, 0).unwrap(); // the work call starts
        w.step(2, 20).unwrap(); // claims 11
        w.step(3, 9).unwrap(); // computes 9
        w.step(4, 2 << 8).unwrap(); // stops (budget) at 9
        w.step(5, 0).unwrap(); // the reply: 0..9 accepted; the next call goes out
        w.workers[0].as_mut().unwrap().cursor.next = 3; // the copy that went back
        w.step(0, 0).unwrap();
        w.step(2, 20).unwrap();
        w.step(3, 5).unwrap();
        w.step(4, 2 << 8).unwrap();
        let e = w.step(5, 0).unwrap_err();
        assert!(e.contains("reported 3..8 but owns 9..100"), "{e}");
    }
}
