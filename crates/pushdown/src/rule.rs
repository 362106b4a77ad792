//! The cost rule: whether each shard's part of an operator runs *pulled* (its columns
//! stream to the caller, which computes) or *pushed* (the operator runs on the data's node
//! and only its partial result travels).
//!
//! Pure logic, no I/O: [`Figures`] holds what has been measured, [`plan`] turns it and the
//! shards' sizes into a per-shard choice with the estimates behind it ([`Plan`]), which
//! `explain` prints. The executor measures and calls this; nothing here measures.
//!
//! # The model
//!
//! An operator reads `b` bytes of columns from a shard. Measured, per operator:
//! - *memory intensity*: the bytes it reads per CPU-second, at the data node (`push_rate`,
//!   from the pool thread's CPU time) and at the caller (`pull_rate`);
//! - *selectivity* `σ`: bytes out ÷ bytes in of its partial results;
//! - per data node: its pool's cap, the scheduler period the cap's quota is given per,
//!   its free CPU and its pool's threads, from the node's own figures;
//! - the network's bandwidth `B` (the executor probes it and updates it from large pulls),
//!   and the fixed cost of one call;
//! - how much longer pushed calls ran than their CPU time (`push_stretch`), and how far
//!   past runs' measured times were from this model's estimates (`push_fix`, `pull_fix`,
//!   bounded to ¼×–8×), which scale each side's estimate.
//!
//! Pulled shards cost the caller `Σb ÷ B` of network and `Σb ÷ (pull_rate × caller cores)`
//! of compute, which overlap (the fetch of one row group runs while the last is computed).
//! Pushed shards cost their node their CPU time `Σb ÷ push_rate`, stretched as measured, or
//! until that is measured, run at the node's cores under the cap's quota
//! ([`NodeView::push_time`]: full speed until a period's quota is used, then a wait for the
//! next period). Their results' transfer counts, and so does the operator's argument (a
//! join's build rows), shipped once per pushed shard. When the caller and the nodes share
//! one machine's cores, all the CPU time over those cores is a floor too.
//!
//! Nodes work in parallel with each other and with the caller: the estimate of a plan is
//! its makespan, the largest of those times. [`plan`] starts from everything pushed and
//! moves the largest shards to the caller while that lowers the makespan; it keeps that
//! split only when it is estimated at 60 % of the better of all-pull and all-push or less
//! (a split leans on both sides' figures at once), else takes that extreme — but the way
//! the operator ran last (`Figures::last`) stays unless the other is estimated more than
//! 15 % faster. Forced modes skip all this.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Where one shard's part of an operator runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Mode {
    /// The needed columns stream to the caller, which runs the operator.
    Pull,
    /// The operator runs on the data's node; only its partial result travels.
    Push,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Pull => "pull",
            Mode::Push => "push",
        })
    }
}

/// How the executor chooses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Choice {
    /// By the cost rule, per shard.
    #[default]
    Auto,
    /// Every shard this way.
    Force(Mode),
}

impl std::str::FromStr for Choice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" | "rule" => Ok(Choice::Auto),
            "pull" => Ok(Choice::Force(Mode::Pull)),
            "push" => Ok(Choice::Force(Mode::Push)),
            other => Err(format!("`{other}` is not a mode: auto, pull or push")),
        }
    }
}

/// What has been measured about one operator, and the network. `None` = not yet measured:
/// [`plan`] then uses the other side's figure or a conservative default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// Bytes of input the operator reads per CPU-second on a data node's pool thread.
    pub push_rate: Option<f64>,
    /// Bytes of input it reads per CPU-second at the caller.
    pub pull_rate: Option<f64>,
    /// Bytes of partial result per byte of input.
    pub selectivity: Option<f64>,
    /// Bytes per second from a data node to the caller.
    pub bandwidth: Option<f64>,
    /// Run time ÷ CPU time of pushed calls as the data nodes measured them (1 when
    /// nothing held them back; more under a CPU cap or a busy node). Once measured it
    /// replaces [`NodeView::push_time`]'s model of the cap.
    pub push_stretch: Option<f64>,
    /// Measured ÷ estimated time of the pushed part of past runs: what the model leaves
    /// out (encoding and decoding results, queueing, contention), folded back in.
    pub push_fix: Option<f64>,
    /// The same for the pulled part.
    pub pull_fix: Option<f64>,
    /// The way the rule last ran the whole operator, if it ran it one way: it changes
    /// its mind only for an estimate clearly better (see [`plan`]).
    pub last: Option<Mode>,
}

/// Until the network is measured: a conservative loopback-class figure (1 GB/s).
const DEFAULT_BANDWIDTH: f64 = 1e9;
/// Until either side's compute is measured: 1 GB per CPU-second.
const DEFAULT_RATE: f64 = 1e9;
/// Until selectivity is measured: assume a tenth comes back.
const DEFAULT_SELECTIVITY: f64 = 0.1;
/// A plan that splits an operator between pull and push is chosen only when estimated
/// below this share of the better of all-pull and all-push. Measured on a 2-vCPU machine
/// where caller and data nodes share the cores, splits estimated 20–35 % faster ran
/// slower than the better extreme; a split pays off where nodes differ (one busy or
/// capped hard, its shards pulled, the others' pushed).
const MIX_GAIN: f64 = 0.6;
/// How far a measured correction may move an estimate, either way.
const FIX_RANGE: (f64, f64) = (0.25, 8.0);
/// The least a busy pool's running call is expected to go on, seconds (see
/// [`NodeView::wait`]).
pub const MIN_WAIT: f64 = 1e-3;
/// Weight of a new observation in the running figures.
const SMOOTHING: f64 = 0.3;
/// The rule keeps the way it last ran an operator unless the other is estimated faster
/// by more than this share: near a tie, run times under a CPU cap swing by more than the
/// estimates differ, and flipping on every swing costs more than either way.
const STICK: f64 = 0.15;

impl Figures {
    /// Fold in a new observation (an exponentially weighted mean, so a change of conditions
    /// shows within a couple of runs).
    pub fn observe(slot: &mut Option<f64>, value: f64) {
        if !value.is_finite() || value <= 0.0 {
            return;
        }
        *slot = Some(match *slot {
            Some(old) => old + SMOOTHING * (value - old),
            None => value,
        });
    }

    fn push_rate(&self) -> f64 {
        self.push_rate.or(self.pull_rate).unwrap_or(DEFAULT_RATE)
    }

    fn pull_rate(&self) -> f64 {
        self.pull_rate.or(self.push_rate).unwrap_or(DEFAULT_RATE)
    }

    fn selectivity(&self) -> f64 {
        self.selectivity
            .unwrap_or(DEFAULT_SELECTIVITY)
            .clamp(0.0, 1.0)
    }

    fn bandwidth(&self) -> f64 {
        self.bandwidth.unwrap_or(DEFAULT_BANDWIDTH)
    }
}

/// A data node as the rule sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    /// The CPU cap of its pushdown pool, in cores (`None` = uncapped).
    pub cap: Option<f64>,
    /// Cores free on the node now, as its monitor sees them.
    pub free: f64,
    /// Its pushdown pool's threads.
    pub threads: usize,
    /// The scheduler period the cap's quota is given per, seconds (0: unknown; the cap
    /// is then taken as a steady rate).
    pub period: f64,
    /// Pushed calls of others running on its pool when the executor last looked (before
    /// planning): each holds a thread until it returns, its caller gone or not.
    #[serde(default)]
    pub running: usize,
    /// Pushed calls of others waiting in its pool's queue then.
    #[serde(default)]
    pub queued: usize,
    /// How long the most recently started of those running calls had run then, seconds.
    #[serde(default)]
    pub busy_for: f64,
}

impl NodeView {
    /// A node as pushed calls report it: `cap`, `free` cores, `threads`, `period`, its
    /// pool not known to be busy.
    pub fn idle(cap: Option<f64>, free: f64, threads: usize, period: f64) -> NodeView {
        NodeView {
            cap,
            free,
            threads,
            period,
            running: 0,
            queued: 0,
            busy_for: 0.0,
        }
    }

    /// Pool threads not taken by others' calls (at least one: this operator's calls get
    /// one once the others' return, which [`NodeView::wait`] counts).
    pub fn free_threads(&self) -> usize {
        self.threads.max(1).saturating_sub(self.running).max(1)
    }

    /// Seconds this operator's first pushed call is expected to wait for a pool thread
    /// there: none while a thread is free and nothing queues; else until a running call
    /// returns, then a turn per `threads` calls queued ahead. How long a running call
    /// goes on is unknown: one that has run for `t` is taken to run about `t` more (the
    /// longer a call has run, the likelier it is a long one, such as a call whose caller
    /// timed out and gave up), and at least [`MIN_WAIT`].
    pub fn wait(&self) -> f64 {
        let threads = self.threads.max(1);
        if self.running < threads && self.queued == 0 {
            return 0.0;
        }
        let turn = if self.busy_for.is_finite() {
            self.busy_for.max(MIN_WAIT)
        } else {
            MIN_WAIT
        };
        turn * (1.0 + self.queued as f64 / threads as f64)
    }

    /// Cores pushed work may use there now: the cap, the free CPU and the pool's free
    /// threads, whichever is least (never below a hundredth of a core, so the estimate
    /// stays finite).
    pub fn cores(&self) -> f64 {
        let mut c = self.free.min(self.free_threads() as f64);
        if let Some(cap) = self.cap {
            c = c.min(cap);
        }
        c.max(0.01)
    }

    /// Seconds to get `cpu` CPU-seconds of pushed work done there. Uncapped, at the
    /// cores it has; capped, the scheduler lets the pool run at those cores until it has
    /// used `cap × period` in a period, then holds it to the period's end: work shorter
    /// than one period's quota is not slowed at all (assuming it starts with a period's
    /// quota unused).
    pub fn push_time(&self, cpu: f64) -> f64 {
        let rate = self.free.min(self.free_threads() as f64).max(0.01);
        match self.cap {
            Some(cap) if self.period > 0.0 && cap < rate => {
                let quota = cap * self.period;
                let full = (cpu / quota).floor();
                full * self.period + (cpu - full * quota) / rate
            }
            _ => cpu / self.cores(),
        }
    }
}

/// One shard's part of an operator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardWork {
    /// The node holding the shard.
    pub node: u64,
    /// Bytes of the operator's columns in the shard.
    pub bytes_in: u64,
    /// Row groups in it (one call each when pulled).
    pub groups: u64,
    /// The only way the shard can run (`None`: either), e.g. pull where the node's
    /// per-call budget cannot hold the operator's join table, or push where the
    /// caller's build memory cannot. [`plan`] keeps to it unless forced.
    #[serde(default)]
    pub only: Option<Mode>,
}

/// What the caller brings: its cores for pulled compute, the fixed cost of a call, and
/// the bytes of the operator's argument shipped to each pushed shard (a join's table).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Caller {
    /// Cores the caller computes pulled shards on.
    pub cores: f64,
    /// Seconds of fixed cost per call (a round trip).
    pub call_cost: f64,
    /// Bytes of argument sent with each pushed call.
    pub push_arg_bytes: u64,
    /// When the caller and the data nodes share one machine's cores (an embedded
    /// cluster), how many: every part's CPU then comes out of the same cores, and the
    /// plan's estimate is at least its total CPU time over them.
    pub shared_cores: Option<f64>,
}

/// The estimated times of a plan's parts, in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// The caller's compute on pulled shards.
    pub caller_compute: f64,
    /// The network: pulled columns, pushed results and arguments.
    pub network: f64,
    /// The busiest data node's pushed compute.
    pub busiest_node: f64,
    /// All the CPU time over the cores of a machine every part shares (0 when the parts
    /// run on machines of their own).
    pub shared: f64,
}

impl Estimate {
    /// The plan's makespan: its parts overlap, so the slowest part.
    pub fn total(&self) -> f64 {
        self.caller_compute
            .max(self.network)
            .max(self.busiest_node)
            .max(self.shared)
    }
}

/// The rule's answer for one operator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Per shard, in the order given.
    pub modes: Vec<Mode>,
    /// The chosen plan's estimate.
    pub chosen: Estimate,
    /// Everything pulled.
    pub all_pull: Estimate,
    /// Everything pushed.
    pub all_push: Estimate,
    /// The figures used (defaults filled in).
    pub used: Figures,
    /// Which of `used` were not measured but assumed (a default, or the other side's).
    #[serde(default)]
    pub assumed: Assumed,
}

/// Which figures a plan assumed rather than measured (before the operator was first
/// pushed, pulled, or the network probed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assumed {
    /// The intensity at the data nodes (the caller's, or a default).
    pub push_rate: bool,
    /// The intensity at the caller (the data nodes', or a default).
    pub pull_rate: bool,
    /// The selectivity (a default).
    pub selectivity: bool,
    /// The network's bandwidth (a default).
    pub bandwidth: bool,
}

impl Plan {
    /// Shards pushed and pulled.
    pub fn counts(&self) -> (usize, usize) {
        let push = self.modes.iter().filter(|m| **m == Mode::Push).count();
        (push, self.modes.len() - push)
    }
}

/// Estimate the plan `modes` for `shards`.
pub fn estimate(
    shards: &[ShardWork],
    modes: &[Mode],
    nodes: &BTreeMap<u64, NodeView>,
    caller: &Caller,
    f: &Figures,
) -> Estimate {
    let bw = f.bandwidth();
    let mut pulled_bytes = 0.0;
    let mut pulled_calls = 0.0;
    let mut net_bytes = 0.0;
    let mut node_cpu: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    let mut pushed_cpu = 0.0;
    for (s, m) in shards.iter().zip(modes) {
        let b = s.bytes_in as f64;
        match m {
            Mode::Pull => {
                pulled_bytes += b;
                pulled_calls += s.groups as f64;
                net_bytes += b;
            }
            Mode::Push => {
                let e = node_cpu.entry(s.node).or_default();
                e.0 += b / f.push_rate();
                e.1 += caller.call_cost;
                pushed_cpu += b / f.push_rate();
                net_bytes += b * f.selectivity() + caller.push_arg_bytes as f64;
            }
        }
    }
    // Moving bytes over loopback costs CPU at both ends; the measured bandwidth is about
    // what one core on each side achieves, so count two CPU-seconds per second of it.
    let shared = caller.shared_cores.map_or(0.0, |cores| {
        (pulled_bytes / f.pull_rate() + pushed_cpu + 2.0 * net_bytes / bw) / cores.max(0.01)
    });
    let pull_fix = f.pull_fix.unwrap_or(1.0).clamp(FIX_RANGE.0, FIX_RANGE.1);
    let push_fix = f.push_fix.unwrap_or(1.0).clamp(FIX_RANGE.0, FIX_RANGE.1);
    Estimate {
        caller_compute: (pulled_bytes / (f.pull_rate() * caller.cores.max(0.01))
            + pulled_calls * caller.call_cost / 4.0)
            * pull_fix,
        network: net_bytes / bw * pull_fix,
        busiest_node: node_cpu
            .iter()
            .map(|(n, (cpu, calls))| {
                let threads = nodes.get(n).map_or(1, NodeView::free_threads) as f64;
                let t = match (f.push_stretch, nodes.get(n)) {
                    (Some(stretch), _) => cpu * stretch.max(1.0) / threads,
                    (None, Some(v)) => v.push_time(*cpu),
                    (None, None) => *cpu,
                };
                // Others' calls holding the pool delay all of it; what past runs measured
                // (the correction) does not scale that.
                let wait = nodes.get(n).map_or(0.0, NodeView::wait);
                (t + calls) * push_fix + wait
            })
            .fold(0.0, f64::max),
        shared,
    }
}

/// Choose pull or push per shard (see the module doc for the model).
pub fn plan(
    shards: &[ShardWork],
    nodes: &BTreeMap<u64, NodeView>,
    caller: &Caller,
    f: &Figures,
    choice: Choice,
) -> Plan {
    let n = shards.len();
    // Every shard `m`, but those that can run only one way, that way ("all push" and
    // "all pull" are then as far as each can go).
    let all = |m: Mode| -> Vec<Mode> { shards.iter().map(|s| s.only.unwrap_or(m)).collect() };
    let all_pull = estimate(shards, &all(Mode::Pull), nodes, caller, f);
    let all_push = estimate(shards, &all(Mode::Push), nodes, caller, f);
    let modes = match choice {
        Choice::Force(m) => vec![m; n],
        Choice::Auto => {
            // Largest shards first: moving a big one changes the most.
            let mut order: Vec<usize> = (0..n).filter(|&i| shards[i].only.is_none()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(shards[i].bytes_in));
            let mut modes = all(Mode::Push);
            let mut best = all_push.total();
            for i in order {
                modes[i] = Mode::Pull;
                let t = estimate(shards, &modes, nodes, caller, f).total();
                if t < best {
                    best = t;
                } else {
                    modes[i] = Mode::Push;
                }
            }
            // A split must beat the better of the two extremes clearly: its estimate leans
            // on both sides' figures at once, and an error on either side costs it twice.
            let time_of = |m: Mode| match m {
                Mode::Pull => all_pull.total(),
                Mode::Push => all_push.total(),
            };
            let (mut extreme, mut extreme_time) = if all_pull.total() < all_push.total() {
                (Mode::Pull, all_pull.total())
            } else {
                (Mode::Push, all_push.total())
            };
            if let Some(last) = f.last {
                if last != extreme && time_of(last) <= extreme_time * (1.0 + STICK) {
                    (extreme, extreme_time) = (last, time_of(last));
                }
            }
            if best < MIX_GAIN * extreme_time {
                modes
            } else {
                all(extreme)
            }
        }
    };
    let chosen = estimate(shards, &modes, nodes, caller, f);
    Plan {
        modes,
        chosen,
        all_pull,
        all_push,
        used: Figures {
            push_rate: Some(f.push_rate()),
            pull_rate: Some(f.pull_rate()),
            selectivity: Some(f.selectivity()),
            bandwidth: Some(f.bandwidth()),
            push_stretch: f.push_stretch,
            push_fix: f.push_fix,
            pull_fix: f.pull_fix,
            last: f.last,
        },
        assumed: Assumed {
            push_rate: f.push_rate.is_none(),
            pull_rate: f.pull_rate.is_none(),
            selectivity: f.selectivity.is_none(),
            bandwidth: f.bandwidth.is_none(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shards(n: usize, nodes: u64, bytes: u64) -> Vec<ShardWork> {
        (0..n)
            .map(|i| ShardWork {
                node: i as u64 % nodes,
                bytes_in: bytes,
                groups: 4,
                only: None,
            })
            .collect()
    }

    fn nodes(k: u64, cap: Option<f64>) -> BTreeMap<u64, NodeView> {
        (0..k)
            .map(|i| (i, NodeView::idle(cap, 1.0, 1, 0.0)))
            .collect()
    }

    fn caller() -> Caller {
        Caller {
            cores: 1.0,
            call_cost: 50e-6,
            push_arg_bytes: 0,
            shared_cores: None,
        }
    }

    fn figures(push: f64, pull: f64, sel: f64, bw: f64) -> Figures {
        Figures {
            push_rate: Some(push),
            pull_rate: Some(pull),
            selectivity: Some(sel),
            bandwidth: Some(bw),
            push_stretch: None,
            push_fix: None,
            pull_fix: None,
            last: None,
        }
    }

    #[test]
    fn near_a_tie_the_rule_keeps_the_way_it_ran_last() {
        // Push estimated 10 % faster than pull: having pulled last, the rule pulls again;
        // 40 % faster, it switches.
        let s = shards(4, 1, 10 << 20);
        let n = nodes(1, None);
        // One machine's core for everything: no split can win.
        let mut c = caller();
        c.shared_cores = Some(1.0);
        let mut f = figures(0.93e9, 1.0e9, 1e-6, 10e9);
        f.last = Some(Mode::Pull);
        let p = plan(&s, &n, &c, &f, Choice::Auto);
        assert!(
            p.all_push.total() < p.all_pull.total()
                && p.all_push.total() > 0.85 * p.all_pull.total(),
            "{p:?}"
        );
        assert_eq!(p.counts(), (0, 4), "{p:?}");
        f.push_rate = Some(1.4e9);
        let p = plan(&s, &n, &c, &f, Choice::Auto);
        assert_eq!(p.counts(), (4, 0), "{p:?}");
    }

    #[test]
    fn a_pool_held_by_others_calls_is_not_pushed_into_and_an_idle_one_is() {
        // Q6-like: pushing wins clearly on idle pools.
        let f = figures(10e9, 1e9, 1e-6, 3e9);
        let s = shards(4, 2, 10 << 20);
        let mut n = nodes(2, None);
        assert_eq!(plan(&s, &n, &caller(), &f, Choice::Auto).counts(), (4, 0));
        // Both pools' only thread is held by a call that has run 100 ms (one whose caller
        // timed out, say): pushing waits about that long again; pulling does not.
        for v in n.values_mut() {
            v.running = 1;
            v.busy_for = 0.1;
        }
        assert!((n[&0].wait() - 0.1).abs() < 1e-12);
        let p = plan(&s, &n, &caller(), &f, Choice::Auto);
        assert_eq!(p.counts(), (0, 4), "{p:?}");
        // Having pushed last does not keep it pushing into the busy pools.
        let mut sticky = f.clone();
        sticky.last = Some(Mode::Push);
        assert_eq!(
            plan(&s, &n, &caller(), &sticky, Choice::Auto).counts(),
            (0, 4)
        );
        // Only one pool busy: its shards are pulled, the other's pushed.
        n.get_mut(&1).expect("node 1").running = 0;
        let p = plan(&s, &n, &caller(), &f, Choice::Auto);
        for (w, m) in s.iter().zip(&p.modes) {
            let want = if w.node == 0 { Mode::Pull } else { Mode::Push };
            assert_eq!(*m, want, "{p:?}");
        }
        // A free thread left, and nothing queued: no wait.
        let v = NodeView {
            running: 1,
            busy_for: 5.0,
            ..NodeView::idle(None, 2.0, 2, 0.0)
        };
        assert_eq!((v.wait(), v.free_threads()), (0.0, 1));
        // Calls queued ahead add a turn each per thread.
        let v = NodeView {
            running: 2,
            queued: 4,
            busy_for: 0.01,
            ..v
        };
        assert!((v.wait() - 0.03).abs() < 1e-12, "{}", v.wait());
    }

    #[test]
    fn a_shard_that_can_run_one_way_only_runs_that_way_unless_forced() {
        let f = figures(10e9, 1e9, 1e-6, 3e9);
        let mut s = shards(4, 2, 10 << 20);
        for w in s.iter_mut().filter(|w| w.node == 0) {
            w.only = Some(Mode::Pull);
        }
        let n = nodes(2, None);
        let p = plan(&s, &n, &caller(), &f, Choice::Auto);
        for (w, m) in s.iter().zip(&p.modes) {
            let want = if w.node == 0 { Mode::Pull } else { Mode::Push };
            assert_eq!(*m, want, "{p:?}");
        }
        assert!(p.assumed == Assumed::default(), "{p:?}");
        let p = plan(&s, &n, &caller(), &f, Choice::Force(Mode::Push));
        assert_eq!(p.counts(), (4, 0));
        // Nothing measured: every figure is marked assumed.
        let p = plan(&s, &n, &caller(), &Figures::default(), Choice::Auto);
        assert!(p.assumed.push_rate && p.assumed.pull_rate && p.assumed.selectivity);
        assert!(p.assumed.bandwidth);
    }

    #[test]
    fn a_measured_stretch_replaces_the_model_of_the_cap() {
        // The model says a fifth of a core; the nodes measured pushed calls running at
        // full speed (the work fits in the scheduler's quota): push is chosen.
        let mut f = figures(1e9, 1e9, 1e-6, 1e9);
        let n = nodes(2, Some(0.2));
        let s = shards(4, 2, 10 << 20);
        assert_eq!(plan(&s, &n, &caller(), &f, Choice::Auto).counts(), (0, 4));
        f.push_stretch = Some(1.0);
        assert_eq!(plan(&s, &n, &caller(), &f, Choice::Auto).counts(), (4, 0));
    }

    #[test]
    fn a_cheap_selective_scan_is_pushed_when_the_node_has_cpu() {
        // Q6-like: 10 GB/s of scanning per core, 1e-6 comes back, a 3 GB/s network.
        let f = figures(10e9, 10e9, 1e-6, 3e9);
        let p = plan(
            &shards(8, 2, 50 << 20),
            &nodes(2, Some(1.0)),
            &caller(),
            &f,
            Choice::Auto,
        );
        assert_eq!(p.counts(), (8, 0), "{p:?}");
        assert!(p.all_pull.total() > 2.0 * p.all_push.total());
    }

    #[test]
    fn a_cpu_heavy_operator_is_pulled_when_the_node_is_capped_hard() {
        // 0.5 GB/s per core, a node capped at a fifth of a core: pushing runs at 0.1 GB/s
        // per node, the caller at 0.5 GB/s on a 3 GB/s network.
        let f = figures(0.5e9, 0.5e9, 0.01, 3e9);
        let p = plan(
            &shards(8, 2, 50 << 20),
            &nodes(2, Some(0.2)),
            &caller(),
            &f,
            Choice::Auto,
        );
        let (push, pull) = p.counts();
        assert!(pull > push, "{p:?}");
        assert!(p.chosen.total() <= p.all_pull.total() + 1e-12);
    }

    #[test]
    fn the_choice_is_never_estimated_worse_than_either_extreme() {
        for cap in [0.05, 0.2, 0.5, 1.0] {
            for push in [0.2e9, 1e9, 5e9] {
                for bw in [0.5e9, 3e9] {
                    let f = figures(push, 1e9, 0.05, bw);
                    let p = plan(
                        &shards(6, 2, 30 << 20),
                        &nodes(2, Some(cap)),
                        &caller(),
                        &f,
                        Choice::Auto,
                    );
                    let best = p.all_pull.total().min(p.all_push.total());
                    assert!(
                        p.chosen.total() <= best * (1.0 + 1e-9),
                        "{cap} {push} {bw}: {p:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_mix_wins_when_one_node_is_held_back_and_the_others_are_not() {
        // Three nodes, the third capped at a twentieth of a core: its shards are pulled,
        // the others' pushed, well ahead of either extreme.
        let f = figures(1e9, 1e9, 0.001, 10e9);
        let mut n = nodes(3, Some(1.0));
        n.get_mut(&2).expect("node 2").cap = Some(0.05);
        let s = shards(6, 3, 50 << 20);
        let p = plan(&s, &n, &caller(), &f, Choice::Auto);
        for (w, m) in s.iter().zip(&p.modes) {
            assert_eq!(
                *m,
                if w.node == 2 { Mode::Pull } else { Mode::Push },
                "{p:?}"
            );
        }
        assert!(p.chosen.total() < 0.6 * p.all_push.total().min(p.all_pull.total()));
    }

    #[test]
    fn on_one_shared_machine_a_mix_must_pay_for_the_cores_it_takes() {
        // As in `a_mix_wins...`, but caller and node share two cores: splitting the work
        // cannot beat the two cores' total CPU time.
        let f = figures(1e9, 1e9, 0.001, 10e9);
        let mut c = caller();
        c.shared_cores = Some(1.0);
        let p = plan(
            &shards(8, 1, 50 << 20),
            &nodes(1, Some(1.0)),
            &c,
            &f,
            Choice::Auto,
        );
        let cpu = 8.0 * (50 << 20) as f64 / 1e9;
        assert!(p.chosen.total() >= cpu, "{p:?}");
        assert!(p.chosen.total() <= p.all_push.total().min(p.all_pull.total()) * (1.0 + 1e-9));
    }

    #[test]
    fn forced_modes_are_obeyed_and_shipping_a_big_argument_counts_against_pushing() {
        let f = figures(10e9, 10e9, 0.001, 1e9);
        let s = shards(8, 2, 8 << 20);
        let forced = plan(
            &s,
            &nodes(2, None),
            &caller(),
            &f,
            Choice::Force(Mode::Pull),
        );
        assert_eq!(forced.counts(), (0, 8));
        let mut c = caller();
        c.push_arg_bytes = 64 << 20; // a join table eight times the shard
        let p = plan(&s, &nodes(2, None), &c, &f, Choice::Auto);
        assert_eq!(p.counts(), (0, 8), "{p:?}");
    }

    #[test]
    fn measured_corrections_scale_their_side_of_the_estimate() {
        let mut f = figures(1e9, 1e9, 1e-6, 10e9);
        let s = shards(4, 2, 10 << 20);
        let n = nodes(2, Some(1.0));
        let base = plan(&s, &n, &caller(), &f, Choice::Auto);
        assert_eq!(base.counts(), (4, 0));
        // Pushed runs took four times their estimate (say, results slow to decode):
        // pulling now wins.
        f.push_fix = Some(4.0);
        let p = plan(&s, &n, &caller(), &f, Choice::Auto);
        assert!((p.all_push.busiest_node / base.all_push.busiest_node - 4.0).abs() < 1e-9);
        assert_eq!(p.counts(), (0, 4), "{p:?}");
        // Corrections are bounded.
        f.pull_fix = Some(1e6);
        let p = plan(&s, &n, &caller(), &f, Choice::Auto);
        assert!(p.all_pull.caller_compute <= 8.0 * base.all_pull.caller_compute * (1.0 + 1e-9));
    }

    #[test]
    fn observations_smooth_and_ignore_nonsense() {
        let mut x = None;
        Figures::observe(&mut x, 10.0);
        assert_eq!(x, Some(10.0));
        Figures::observe(&mut x, 20.0);
        assert!((x.unwrap_or_default() - 13.0).abs() < 1e-9, "{x:?}");
        Figures::observe(&mut x, f64::NAN);
        Figures::observe(&mut x, -1.0);
        assert!((x.unwrap_or_default() - 13.0).abs() < 1e-9, "{x:?}");
        assert_eq!("push".parse::<Choice>(), Ok(Choice::Force(Mode::Push)));
        assert!("sideways".parse::<Choice>().is_err());
    }

    #[test]
    fn node_cores_take_the_least_of_cap_free_and_threads() {
        let v = NodeView {
            cap: Some(0.5),
            free: 2.0,
            threads: 4,
            period: 0.0,
            ..NodeView::idle(None, 0.0, 0, 0.0)
        };
        assert_eq!(v.cores(), 0.5);
        let v = NodeView {
            cap: None,
            free: 0.3,
            threads: 4,
            period: 0.0,
            ..NodeView::idle(None, 0.0, 0, 0.0)
        };
        assert_eq!(v.cores(), 0.3);
        let v = NodeView {
            cap: None,
            free: 0.0,
            threads: 0,
            period: 0.0,
            ..NodeView::idle(None, 0.0, 0, 0.0)
        };
        assert_eq!(v.cores(), 0.01);
    }

    #[test]
    fn a_capped_pool_runs_short_work_at_full_speed_and_long_work_at_the_cap() {
        let v = NodeView {
            cap: Some(0.2),
            free: 1.0,
            threads: 1,
            period: 0.1,
            ..NodeView::idle(None, 0.0, 0, 0.0)
        };
        // 10 ms of CPU fits in a period's 20 ms quota: 10 ms.
        assert!((v.push_time(0.010) - 0.010).abs() < 1e-12);
        // 50 ms: two full periods (40 ms used), then 10 ms more.
        assert!((v.push_time(0.050) - 0.210).abs() < 1e-12);
        // Long work tends to the cap's rate.
        assert!((v.push_time(10.0) / (10.0 / 0.2) - 1.0).abs() < 0.01);
        // A cap above what the node has changes nothing.
        let v = NodeView {
            cap: Some(2.0),
            ..v
        };
        assert!((v.push_time(0.5) - 0.5).abs() < 1e-12);
    }
}
