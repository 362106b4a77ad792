//! Scaling policies: how many compute proclets a job runs, and where.
//!
//! The coordinator calls [`ScalingPolicy::decide`] every policy interval (2 ms by
//! default) with a [`View`] of the job and the cluster, and carries out the [`Target`]:
//! growing splits the largest remaining range (or takes work handed back earlier) into a
//! new compute proclet on the named node; shrinking asks workers to stop and hand their
//! unclaimed range back. A worker that finishes early always takes more work (the
//! largest remaining range is split): that is independent of the policy.

use granule_runtime::NodeId;
use granule_sharded::{Element, ShardedQueue};
use std::time::Duration;

/// A node as a policy sees it.
#[derive(Clone, Debug)]
pub struct NodeView {
    pub id: NodeId,
    /// Cores its spec gives it.
    pub cores: f64,
    /// The job's workers on it (including ones being created).
    pub workers: usize,
    /// Spare cores it reported when probed this tick (`None`: not probed).
    pub spare: Option<f64>,
}

/// The job and the cluster, at one tick.
#[derive(Clone, Debug)]
pub struct View {
    pub nodes: Vec<NodeView>,
    /// Workers running or being created.
    pub workers: usize,
    /// Items not yet reported done.
    pub remaining: u64,
    /// Time since the job started.
    pub elapsed: Duration,
}

/// What a policy wants this tick.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// Keep things as they are.
    Hold,
    /// Start one more worker on each of these nodes (a node may appear more than once).
    Grow(Vec<NodeId>),
    /// Stop this many workers (the coordinator picks them on the most crowded nodes).
    Shrink(usize),
}

/// A scaling policy.
pub trait ScalingPolicy: Send {
    /// Short name for logs and reports.
    fn name(&self) -> String;
    /// Whether workers stop by themselves when their core is contended (the policy
    /// then grows them back where cores are idle).
    fn watch_contention(&self) -> bool {
        false
    }
    /// Nodes whose spare cores the coordinator should measure before `decide` this tick
    /// (probing costs a call per node).
    fn probe(&self, view: &View) -> Vec<NodeId> {
        let _ = view;
        Vec::new()
    }
    /// The decision for this tick.
    fn decide(&mut self, view: &View) -> Target;
    /// Whether the coordinator should keep ticking until something happens. A policy
    /// whose decision cannot change before the next event (a worker's reply, a probe's
    /// answer, a node list) returns false, and the coordinator sleeps until that event:
    /// a job that holds all the cores it may use then costs no wake-ups every interval,
    /// each of which would preempt one of its own workers on a busy machine.
    fn wants_ticks(&self, view: &View) -> bool {
        let _ = view;
        true
    }
}

/// Use idle cores anywhere in the cluster: probe every node that has fewer workers than
/// cores, grow onto those with at least `min_spare` cores idle; workers on a contended
/// core stop by themselves (shrink).
#[derive(Clone, Debug)]
pub struct Greedy {
    /// Spare cores a node needs before a worker is added there (default 0.6).
    pub min_spare: f64,
}

impl Default for Greedy {
    fn default() -> Self {
        Greedy { min_spare: 0.6 }
    }
}

impl ScalingPolicy for Greedy {
    fn name(&self) -> String {
        "greedy".into()
    }
    fn watch_contention(&self) -> bool {
        true
    }
    fn probe(&self, view: &View) -> Vec<NodeId> {
        view.nodes
            .iter()
            .filter(|n| (n.workers as f64) < n.cores.ceil())
            .map(|n| n.id)
            .collect()
    }
    fn wants_ticks(&self, view: &View) -> bool {
        // Only a node with room for a worker can change the decision.
        !self.probe(view).is_empty()
    }
    fn decide(&mut self, view: &View) -> Target {
        let grow: Vec<NodeId> = view
            .nodes
            .iter()
            .filter(|n| (n.workers as f64) < n.cores.ceil())
            .filter(|n| n.spare.is_some_and(|s| s >= self.min_spare))
            .map(|n| n.id)
            .collect();
        if grow.is_empty() {
            Target::Hold
        } else {
            Target::Grow(grow)
        }
    }
}

/// Exactly `n` workers (as long as there is work to split), spread over the nodes in
/// proportion to their cores.
#[derive(Clone, Debug)]
pub struct Fixed(pub usize);

/// Nodes to grow onto to go from `view.workers` to `target` workers: each time the node
/// with the fewest workers per core.
fn spread(view: &View, target: usize) -> Vec<NodeId> {
    let mut counts: Vec<(NodeId, f64, usize)> = view
        .nodes
        .iter()
        .map(|n| (n.id, n.cores.max(0.01), n.workers))
        .collect();
    let mut out = Vec::new();
    for _ in view.workers..target {
        let Some(best) = counts.iter_mut().min_by(|a, b| {
            (a.2 as f64 / a.1)
                .partial_cmp(&(b.2 as f64 / b.1))
                .unwrap_or(std::cmp::Ordering::Equal)
        }) else {
            break;
        };
        best.2 += 1;
        out.push(best.0);
    }
    out
}

fn towards(view: &View, target: usize) -> Target {
    use std::cmp::Ordering::*;
    match view.workers.cmp(&target) {
        Less => Target::Grow(spread(view, target)),
        Greater => Target::Shrink(view.workers - target),
        Equal => Target::Hold,
    }
}

impl ScalingPolicy for Fixed {
    fn name(&self) -> String {
        format!("fixed({})", self.0)
    }
    fn decide(&mut self, view: &View) -> Target {
        towards(view, self.0.max(1))
    }
    fn wants_ticks(&self, view: &View) -> bool {
        view.workers != self.0.max(1)
    }
}

/// Match production to consumption of an output queue: every tick, add a worker while
/// the queue is shorter than `short`; otherwise change the worker count in proportion to
/// the queue's relative change since the last tick (a queue growing by 10 % per tick
/// loses 10 % of the workers × `gain`; a shrinking one gains them).
pub struct MinimizeQueue {
    len: Box<dyn FnMut() -> Option<u64> + Send>,
    /// Below this many queued elements, grow (default 64).
    pub short: u64,
    /// Proportional gain (default 1.0).
    pub gain: f64,
    /// Upper bound on workers (default: the cluster's cores).
    pub max_workers: Option<usize>,
    prev: Option<u64>,
    /// Fractional part of the worker count, carried between ticks.
    level: Option<f64>,
}

impl MinimizeQueue {
    /// Watch `queue` (its length is read every tick).
    pub fn new<T: Element>(queue: &ShardedQueue<T>) -> Self {
        let q = queue.clone();
        Self::with_len(move || q.len().ok())
    }

    /// Watch a queue through a length function (for queues that are not a
    /// `ShardedQueue`, and for tests).
    pub fn with_len(len: impl FnMut() -> Option<u64> + Send + 'static) -> Self {
        MinimizeQueue {
            len: Box::new(len),
            short: 64,
            gain: 1.0,
            max_workers: None,
            prev: None,
            level: None,
        }
    }
}

impl ScalingPolicy for MinimizeQueue {
    fn name(&self) -> String {
        "minimize-queue".into()
    }
    fn decide(&mut self, view: &View) -> Target {
        let cap = self.max_workers.unwrap_or_else(|| {
            view.nodes
                .iter()
                .map(|n| n.cores.ceil() as usize)
                .sum::<usize>()
                .max(1)
        });
        let Some(len) = (self.len)() else {
            return Target::Hold;
        };
        let level = self.level.unwrap_or(view.workers as f64);
        let next = if len < self.short {
            level + 1.0
        } else {
            let prev = self.prev.unwrap_or(len).max(1);
            let change = (len as f64 - prev as f64) / prev as f64;
            level * (1.0 - self.gain * change)
        };
        let next = next.clamp(1.0, cap as f64);
        self.prev = Some(len);
        self.level = Some(next);
        towards(view, next.round() as usize)
    }
}

/// Default policy interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(2);

#[cfg(test)]
mod tests {
    use super::*;

    fn view(workers: &[usize], spare: &[Option<f64>]) -> View {
        View {
            nodes: workers
                .iter()
                .zip(spare)
                .enumerate()
                .map(|(i, (w, s))| NodeView {
                    id: NodeId(i as u32 + 1),
                    cores: 1.0,
                    workers: *w,
                    spare: *s,
                })
                .collect(),
            workers: workers.iter().sum(),
            remaining: 1000,
            elapsed: Duration::ZERO,
        }
    }

    #[test]
    fn greedy_probes_nodes_with_room_and_grows_where_idle() {
        let mut g = Greedy::default();
        let v = view(&[1, 0, 0], &[None, Some(0.9), Some(0.1)]);
        assert_eq!(g.probe(&v), vec![NodeId(2), NodeId(3)]);
        assert_eq!(g.decide(&v), Target::Grow(vec![NodeId(2)]));
        assert_eq!(g.decide(&view(&[1, 1], &[None, None])), Target::Hold);
    }

    #[test]
    fn ticks_stop_only_when_nothing_can_change_before_an_event() {
        let g = Greedy::default();
        assert!(g.wants_ticks(&view(&[1, 0], &[None, None])));
        assert!(!g.wants_ticks(&view(&[1, 1], &[None, None])));
        let f = Fixed(2);
        assert!(f.wants_ticks(&view(&[1, 0], &[None, None])));
        assert!(!f.wants_ticks(&view(&[1, 1], &[None, None])));
        assert!(f.wants_ticks(&view(&[2, 1], &[None, None])));
        let m = MinimizeQueue::with_len(|| Some(0));
        assert!(m.wants_ticks(&view(&[1, 1], &[None, None])));
    }

    #[test]
    fn fixed_spreads_and_shrinks() {
        let mut f = Fixed(3);
        assert_eq!(
            f.decide(&view(&[1, 0], &[None, None])),
            Target::Grow(vec![NodeId(2), NodeId(1)])
        );
        assert_eq!(f.decide(&view(&[3, 2], &[None, None])), Target::Shrink(2));
    }

    #[test]
    fn minimize_queue_grows_while_short_and_follows_the_queue() {
        let lens = std::sync::Arc::new(parking_lot::Mutex::new(vec![1000u64, 1100, 10, 10]));
        let l = lens.clone();
        let mut m = MinimizeQueue::with_len(move || Some(l.lock().remove(0)));
        // Long and steady: hold at 2 workers.
        assert_eq!(m.decide(&view(&[1, 1], &[None, None])), Target::Hold);
        // Grew 10 %: 2 × 0.9 = 1.8 → 2 still (rounded).
        assert_eq!(m.decide(&view(&[1, 1], &[None, None])), Target::Hold);
        // Short: one more (capped at the 2 cores), so hold at the cap.
        assert_eq!(m.decide(&view(&[1, 1], &[None, None])), Target::Hold);
        assert_eq!(
            m.decide(&view(&[1, 0], &[None, None])),
            Target::Grow(vec![NodeId(2)])
        );
    }
}
