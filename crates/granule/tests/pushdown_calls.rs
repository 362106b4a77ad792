//! Pushed calls (`Proclet::push`) on real multi-process embedded clusters: they give what
//! `run_ref` gives but run on the data node's pushdown pool; panics come back as errors
//! and the pool, the node and the proclet carry on; timeouts answer at once, a call that
//! had not started never runs and one that had counts as a late finish; a queued call
//! that is dropped never runs; budgets are enforced (`pushdown::reserve`, admission); the
//! pool's CPU cap holds pushed calls and not ordinary ones; nodes get the driver's
//! `pushdown.*` settings.
//!
//! Side effects on the node are counted in statics of this binary, which every node
//! process runs: a later call reads them where they happened.

mod common;

use common::{bounded, cgroups_usable, http_get};
use granule::{CallError, Cluster, Kind, NodeId, Proclet, PushOpts};
use granule_runtime::pushdown::{self, OverBudget, PoolFigures};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;

/// Calls that ran on the node, by what they were for (see each test).
static QUEUED_THEN_TIMED_OUT_RAN: AtomicU64 = AtomicU64::new(0);
static DROPPED_WHILE_QUEUED_RAN: AtomicU64 = AtomicU64::new(0);
static QUEUED_AND_KEPT_RAN: AtomicU64 = AtomicU64::new(0);

/// A cluster with one node process of `spec` and these `pushdown.*` settings (no
/// shedding: the proclets stay where they are put).
fn cluster_with(spec: &str, settings: &[(&str, &str)]) -> (Cluster, NodeId) {
    let mut b = Cluster::builder()
        .nodes(spec)
        .expect("spec")
        .shed(false)
        .failure_timeout(Duration::from_millis(1500));
    for (k, v) in settings {
        b = b.set(k, v).expect("setting");
    }
    let c = b.start().expect("cluster starts");
    let nodes = c.worker_nodes().expect("nodes");
    assert_eq!(nodes.len(), 1);
    (c, nodes[0])
}

/// A memory proclet holding `0..n` on `node`.
fn numbers_on(node: NodeId, n: u64) -> Proclet<Vec<u64>> {
    Proclet::builder(Kind::Memory)
        .on(node)
        .create(n, |n: u64| (0..n).collect::<Vec<u64>>())
        .expect("create")
}

/// The figures of the pool on `p`'s node, read by a pushed call.
fn figures(p: &Proclet<Vec<u64>>) -> PoolFigures {
    p.push(PushOpts::default(), (), |_: &Vec<u64>, ()| pushdown::here())
        .expect("push")
        .expect("a pushed call has figures")
}

/// The node's `/metrics` text.
fn metrics_of(cluster: &Cluster, node: NodeId) -> String {
    let info = cluster.nodes().expect("nodes");
    let addr = info
        .iter()
        .find(|n| n.id == node)
        .and_then(|n| n.metrics_addr.clone())
        .expect("the node serves /metrics");
    http_get(&addr, "/metrics")
}

/// The value of the metric line that starts with `prefix` (name and labels).
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Wait until `f` holds (or `limit` passes); returns whether it did.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// (a) results equal run_ref's, on pool threads, remote and local; (b) panics; (e)
/// budgets; and the driver's pushdown settings on the node.
#[test]
fn pushed_calls_answer_like_run_ref_survive_panics_and_keep_budgets() {
    bounded(LIMIT, || {
        let (cluster, node) = cluster_with(
            "cpu=1,mem=512MiB",
            &[
                ("pushdown.threads", "2"),
                ("pushdown.memory", "64MiB"),
                ("pushdown.call_memory", "8MiB"),
                ("pushdown.cpu_cap", "0.5"),
            ],
        );
        let n = 200_000u64;
        let p = numbers_on(node, n);
        assert_eq!(p.location().expect("location"), node);

        // (a) The same answers as run_ref, for several arguments.
        for m in [1u64, 3, 7, 1000] {
            let pushed = p
                .push(PushOpts::default(), m, |v: &Vec<u64>, m: u64| {
                    v.iter().filter(|x| *x % m == 0).sum::<u64>()
                })
                .expect("push");
            let direct = p
                .run_ref(m, |v: &Vec<u64>, m: u64| {
                    v.iter().filter(|x| *x % m == 0).sum::<u64>()
                })
                .expect("run_ref");
            assert_eq!(pushed, direct, "m={m}");
        }
        // On a pool thread of the proclet's node, with figures; run_ref on a worker,
        // without.
        let (thread, fig) = p
            .push(PushOpts::default(), (), |_: &Vec<u64>, ()| {
                (
                    std::thread::current().name().map(str::to_string),
                    pushdown::here(),
                )
            })
            .expect("push");
        assert!(
            thread
                .as_deref()
                .is_some_and(|t| t.starts_with("granule-push")),
            "pushed call ran on {thread:?}"
        );
        let fig = fig.expect("figures inside a pushed call");
        assert_eq!(fig.node, node);
        assert_eq!(fig.threads, 2);
        assert_eq!(fig.memory, 64 * MIB);
        assert_eq!(fig.budget, 8 * MIB);
        assert!(fig.running >= 1, "{fig:?}");
        assert!(fig.free_cores >= 0.0 && fig.free_cores <= 1.0, "{fig:?}");
        let (thread, fig) = p
            .run_ref((), |_: &Vec<u64>, ()| {
                (
                    std::thread::current().name().map(str::to_string),
                    pushdown::here(),
                )
            })
            .expect("run_ref");
        assert!(fig.is_none(), "run_ref is not a pushed call");
        assert!(
            !thread.as_deref().unwrap_or("").starts_with("granule-push"),
            "run_ref ran on {thread:?}"
        );

        // The node has the driver's pushdown settings, and the cap when cgroups allow.
        let pd = p
            .run_ref((), |_: &Vec<u64>, ()| {
                granule_runtime::node_config()
                    .expect("on a node")
                    .pushdown
                    .clone()
            })
            .expect("run_ref");
        assert_eq!(pd.cpu_cap, Some(0.5));
        assert_eq!(pd.threads, Some(2));
        let capped = cluster.cgroups_active() && cgroups_usable().is_some();
        if capped {
            assert_eq!(fig_cap(&p), Some(0.5), "the node's pool is capped at 0.5");
            let m = metrics_of(&cluster, node);
            let label = format!("{{node=\"{node}\"}}");
            assert_eq!(
                metric(&m, &format!("granule_pushdown_cpu_cap_cores{label}")),
                Some(0.5),
                "{m}"
            );
            assert_eq!(
                metric(&m, &format!("granule_pushdown_cpu_cap_failed{label}")),
                Some(0.0)
            );
        } else {
            eprintln!("note: no cgroups here; the 0.5 cap is only checked in the settings");
            assert_eq!(fig_cap(&p), None, "uncapped without a cgroup");
        }

        // A proclet on the driver itself goes through the driver's pool as well.
        let local = numbers_on(cluster.node_id(), 1000);
        let (sum, thread) = local
            .push(PushOpts::default(), (), |v: &Vec<u64>, ()| {
                (
                    v.iter().sum::<u64>(),
                    std::thread::current().name().map(str::to_string),
                )
            })
            .expect("local push");
        assert_eq!(sum, (0..1000u64).sum::<u64>());
        assert!(
            thread
                .as_deref()
                .is_some_and(|t| t.starts_with("granule-push")),
            "a local pushed call ran on {thread:?}"
        );
        // A pushed closure may not push to its own pool (it could wait for itself).
        let nested = local
            .push(
                PushOpts::default(),
                local.clone(),
                |_: &Vec<u64>, me: Proclet<Vec<u64>>| {
                    me.push(PushOpts::default(), (), |v: &Vec<u64>, ()| v.len())
                },
            )
            .expect("outer push");
        assert!(
            matches!(&nested, Err(CallError::Refused(m)) if m.contains("own node")),
            "{nested:?}"
        );
        local.destroy().expect("destroy");

        // (b) Panics come back as errors, more of them than the pool has threads; the
        // pool, the node and the state carry on.
        for i in 0..3u64 {
            let t = Instant::now();
            let r = p.push(PushOpts::default(), i, |_: &Vec<u64>, i: u64| -> u64 {
                panic!("boom {i}")
            });
            match r {
                Err(CallError::RemotePanic { proclet, message }) => {
                    assert_eq!(proclet, p.id());
                    assert!(message.contains(&format!("boom {i}")), "{message}");
                }
                other => panic!("expected the panic back, got {other:?}"),
            }
            assert!(t.elapsed() < Duration::from_secs(5));
        }
        let len = p
            .push(PushOpts::default(), (), |v: &Vec<u64>, ()| v.len() as u64)
            .expect("the pool still serves");
        assert_eq!(len, n);
        let sum = p
            .run_ref((), |v: &Vec<u64>, ()| v.iter().sum::<u64>())
            .expect("the node still serves");
        assert_eq!(sum, (0..n).sum::<u64>(), "the state is intact");
        assert_eq!(figures(&p).counts.panicked, 3);

        // (e) A closure that reserves past its budget (8 MiB by default) gets OverBudget;
        // with a larger budget the same closure runs.
        let reserve_16 = |_: &Vec<u64>, mib: u64| -> Result<u64, OverBudget> {
            let r = pushdown::reserve(mib * MIB)?;
            Ok(r.bytes())
        };
        let over = p
            .push(PushOpts::default(), 16u64, reserve_16)
            .expect("push");
        assert_eq!(
            over,
            Err(OverBudget {
                budget: 8 * MIB,
                used: 0,
                requested: 16 * MIB
            })
        );
        let fits = p
            .push(PushOpts::default().with_memory(32 * MIB), 16u64, reserve_16)
            .expect("push");
        assert_eq!(fits, Ok(16 * MIB));
        // A table that grows by 1 MiB steps stops at its budget instead of growing on.
        // (1 MiB of table for each 8192 rows: 25 MiB for the 200 000 rows.)
        let grown = p
            .push(
                PushOpts::default().with_memory(5 * MIB),
                (),
                |v: &Vec<u64>, ()| -> (u64, Option<OverBudget>) {
                    let mut table = pushdown::reserve(0).expect("nothing");
                    let mut rows: Vec<u64> = Vec::new();
                    for chunk in v.chunks(8192) {
                        if let Err(e) = table.grow(MIB) {
                            return (table.bytes(), Some(e));
                        }
                        rows.extend_from_slice(chunk);
                    }
                    (table.bytes(), None)
                },
            )
            .expect("push");
        assert_eq!(grown.0, 5 * MIB, "{grown:?}");
        assert!(
            matches!(grown.1, Some(OverBudget { budget, .. }) if budget == 5 * MIB),
            "{grown:?}"
        );
        // A budget above pushdown.memory (64 MiB) can never run: refused at once.
        let t = Instant::now();
        let r = p.push(
            PushOpts::default().with_memory(128 * MIB),
            (),
            |v: &Vec<u64>, ()| v.len(),
        );
        assert!(
            matches!(&r, Err(CallError::Refused(m)) if m.contains("pushdown.memory")),
            "{r:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(2));
        let f = figures(&p);
        assert_eq!(f.counts.refused_over_budget, 1, "{f:?}");
        assert_eq!(f.reserved, 0);
        assert_eq!(
            p.push(PushOpts::default(), (), |v: &Vec<u64>, ()| v.len() as u64)
                .expect("still serving"),
            n
        );
        p.destroy().expect("destroy");
        cluster.shutdown();
    });
}

fn fig_cap(p: &Proclet<Vec<u64>>) -> Option<f64> {
    figures(p).cpu_cap
}

/// (c) A call past its timeout answers Timeout at once; its late finish is counted. A
/// call that times out while queued never runs. Pushed calls hold the proclet shared.
#[test]
fn timeouts_answer_at_once_and_late_finishes_are_counted() {
    bounded(LIMIT, || {
        let (cluster, node) = cluster_with("cpu=1,mem=512MiB", &[("pushdown.threads", "1")]);
        let p = numbers_on(node, 1000);
        let sleepy = |_: &Vec<u64>, ms: u64| {
            std::thread::sleep(Duration::from_millis(ms));
            ms
        };

        let t = Instant::now();
        let r = p.push(
            PushOpts::default().with_timeout(Duration::from_millis(200)),
            1500u64,
            sleepy,
        );
        let took = t.elapsed();
        assert_eq!(r, Err(CallError::Timeout(Duration::from_millis(200))));
        assert!(
            took >= Duration::from_millis(190) && took < Duration::from_millis(900),
            "the timeout answered after {took:?}, not at once"
        );
        // The handle's timeout applies too, and the async form answers the same way.
        let r = granule::block_on(p.with_timeout(Duration::from_millis(100)).push_async(
            PushOpts::default(),
            10u64,
            sleepy,
        ));
        assert!(matches!(r, Err(CallError::Timeout(_))), "{r:?}");

        // The sleeper keeps its thread until it returns, then counts as a late finish
        // (this call waits for the thread, so it sees the finish counted). The second
        // call timed out in the queue behind it: it never ran, so it is no late finish.
        let f = figures(&p);
        assert!(
            t.elapsed() >= Duration::from_millis(1400),
            "the running call kept its thread"
        );
        assert_eq!(f.counts.late_finishes, 1, "{f:?}");
        assert_eq!(f.counts.timed_out, 2, "{f:?}");
        let m = metrics_of(&cluster, node);
        assert_eq!(
            metric(
                &m,
                &format!("granule_pushdown_late_finishes_total{{node=\"{node}\"}}")
            ),
            Some(1.0),
            "{m}"
        );

        // A call that times out while queued behind a long one never runs.
        let holder = {
            let p = p.clone();
            let ctx = granule::thread_context();
            std::thread::spawn(move || {
                ctx.enter();
                p.push(PushOpts::default(), 800u64, sleepy)
            })
        };
        std::thread::sleep(Duration::from_millis(150));
        // Meanwhile the proclet is held shared: read-only calls go on, a `run` waits.
        let t = Instant::now();
        p.run_ref((), |v: &Vec<u64>, ()| v.len()).expect("run_ref");
        assert!(
            t.elapsed() < Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
        let r = p.push(
            PushOpts::default().with_timeout(Duration::from_millis(150)),
            (),
            |_: &Vec<u64>, ()| QUEUED_THEN_TIMED_OUT_RAN.fetch_add(1, Ordering::SeqCst),
        );
        assert!(matches!(r, Err(CallError::Timeout(_))), "{r:?}");
        let t = Instant::now();
        p.run(0u64, |v: &mut Vec<u64>, x: u64| v.push(x))
            .expect("run");
        let waited = t.elapsed();
        assert_eq!(holder.join().expect("holder"), Ok(800));
        assert!(
            waited >= Duration::from_millis(200),
            "a run went past a pushed call holding the proclet ({waited:?})"
        );
        let ran = p
            .push(PushOpts::default(), (), |_: &Vec<u64>, ()| {
                QUEUED_THEN_TIMED_OUT_RAN.load(Ordering::SeqCst)
            })
            .expect("push");
        assert_eq!(ran, 0, "a call that timed out in the queue ran");
        let f = figures(&p);
        assert_eq!(f.counts.timed_out, 3, "{f:?}");
        assert_eq!(f.counts.late_finishes, 1, "{f:?}");
        assert_eq!((f.queued, f.running), (0, 1), "{f:?}");
        p.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// (d) With one pool thread, a call queued behind a long one and then dropped never
/// runs; one kept does; a full queue refuses; one dropped while running finishes late.
#[test]
fn a_queued_call_dropped_never_runs() {
    bounded(LIMIT, || {
        let (cluster, node) = cluster_with(
            "cpu=1,mem=512MiB",
            &[("pushdown.threads", "1"), ("pushdown.queue", "2")],
        );
        let p = numbers_on(node, 10);
        let sleepy = |_: &Vec<u64>, ms: u64| {
            std::thread::sleep(Duration::from_millis(ms));
            ms
        };
        let in_background = |p: &Proclet<Vec<u64>>, ms: u64| {
            let p = p.clone();
            let ctx = granule::thread_context();
            std::thread::spawn(move || {
                ctx.enter();
                p.push(PushOpts::default(), ms, sleepy)
            })
        };
        let holder = in_background(&p, 800);
        std::thread::sleep(Duration::from_millis(150));
        // A call queued behind the holder, and kept: it runs once the holder is done.
        let kept = {
            let p = p.clone();
            let ctx = granule::thread_context();
            std::thread::spawn(move || {
                ctx.enter();
                p.push(PushOpts::default(), (), |_: &Vec<u64>, ()| {
                    QUEUED_AND_KEPT_RAN.fetch_add(1, Ordering::SeqCst) + 1
                })
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        // Another queued behind it, polled until sent, then dropped. While it waits the
        // queue (pushdown.queue = 2) is full: one more call is refused at once.
        let dropped = p.push_async(PushOpts::default(), (), |_: &Vec<u64>, ()| {
            DROPPED_WHILE_QUEUED_RAN.fetch_add(1, Ordering::SeqCst)
        });
        let p2 = p.clone();
        granule::block_on(async move {
            let mut dropped = std::pin::pin!(dropped);
            tokio::select! {
                r = &mut dropped => panic!("the queued call finished early: {r:?}"),
                _ = tokio::time::sleep(Duration::from_millis(150)) => {}
            }
            let t = Instant::now();
            let third = p2
                .push_async(PushOpts::default(), (), |v: &Vec<u64>, ()| v.len())
                .await;
            assert!(
                matches!(&third, Err(CallError::NoCapacity(m)) if m.contains("pushdown.queue")),
                "{third:?}"
            );
            assert!(
                t.elapsed() < Duration::from_millis(300),
                "{:?}",
                t.elapsed()
            );
            // `dropped` is dropped here, still queued.
        });
        assert_eq!(holder.join().expect("holder"), Ok(800));
        assert_eq!(kept.join().expect("kept"), Ok(1));
        let (dropped_ran, kept_ran) = p
            .push(PushOpts::default(), (), |_: &Vec<u64>, ()| {
                (
                    DROPPED_WHILE_QUEUED_RAN.load(Ordering::SeqCst),
                    QUEUED_AND_KEPT_RAN.load(Ordering::SeqCst),
                )
            })
            .expect("push");
        assert_eq!(
            kept_ran, 1,
            "the kept call ran (the side effect is visible)"
        );
        assert_eq!(dropped_ran, 0, "the dropped call ran");
        let f = figures(&p);
        assert_eq!(f.counts.cancelled, 1, "{f:?}");
        assert_eq!(f.counts.late_finishes, 0, "{f:?}");
        assert_eq!(f.counts.refused_queue_full, 1, "{f:?}");

        // Dropped while running: too late to stop; it finishes and counts as late.
        let running = p.push_async(PushOpts::default(), 400u64, sleepy);
        granule::block_on(async {
            tokio::select! {
                r = running => panic!("finished early: {r:?}"),
                _ = tokio::time::sleep(Duration::from_millis(150)) => {}
            }
        });
        assert!(
            eventually(Duration::from_secs(5), || figures(&p).counts.late_finishes
                == 1),
            "{:?}",
            figures(&p)
        );
        let f = figures(&p);
        assert_eq!(
            f.counts.cancelled, 1,
            "a cancel while running is not a cancel"
        );
        assert_eq!(f.counts.timed_out, 0);
        p.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// Spin for `ms` of wall time: the share of it the calling thread was on a CPU, and
/// the cpu cgroup the thread runs in.
fn spin_share(ms: u64) -> (f64, Option<String>) {
    let (t, c) = (Instant::now(), granule_host::proc::thread_cpu_time());
    let mut x = 1u64;
    while t.elapsed() < Duration::from_millis(ms) {
        for _ in 0..10_000 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
    let cpu = granule_host::proc::thread_cpu_time() - c;
    let group = granule_host::current_thread_paths().and_then(|p| p.cpu);
    (cpu.as_secs_f64() / t.elapsed().as_secs_f64(), group)
}

/// (f) With pushdown.cpu_cap = 0.2 a CPU-bound pushed loop gets about 0.2 cores, while
/// a run_ref on the same node is not capped.
#[test]
fn the_cpu_cap_holds_pushed_calls_and_not_ordinary_ones() {
    if cgroups_usable().is_none() {
        eprintln!("skipping the CPU-cap test: no cgroup v1 here, the pool would run uncapped");
        return;
    }
    bounded(LIMIT, || {
        let (cluster, node) = cluster_with(
            "cpu=1,mem=512MiB",
            &[("pushdown.threads", "1"), ("pushdown.cpu_cap", "0.2")],
        );
        if !cluster.cgroups_active() {
            eprintln!("skipping the CPU-cap test: the cluster's nodes run without cgroups");
            return;
        }
        let pid = cluster
            .spawned_nodes()
            .iter()
            .find(|(n, _)| *n == node)
            .map(|(_, pid)| *pid)
            .expect("the node's process");
        let node_group = granule_host::paths_of(pid)
            .and_then(|p| p.cpu)
            .expect("the node runs in its cpu group");
        let p = numbers_on(node, 10);
        assert_eq!(figures(&p).cpu_cap, Some(0.2));
        // The pool's threads are in a group of their own inside the node's; the workers
        // are in the node's.
        let spin = |_: &Vec<u64>, ms: u64| spin_share(ms);
        let (_, pushed_group) = p.push(PushOpts::default(), 1u64, spin).expect("push");
        let (_, worker_group) = p.run_ref(1u64, spin).expect("run_ref");
        let pushed_group = pushed_group.expect("the pool thread's group");
        assert!(
            pushed_group.starts_with(&format!("{node_group}/p{pid}-")),
            "the pool thread runs in {pushed_group}, not in a group of its own inside {node_group}"
        );
        assert_eq!(worker_group.as_deref(), Some(node_group.as_str()));
        // The shares of a CPU-bound loop, a few times over: the cap always holds; the
        // ordinary call must get above what the cap allows at least once (on a machine
        // busy with other work it may not every time).
        let mut ordinary_best = 0.0f64;
        for round in 0..3 {
            let (pushed, _) = p.push(PushOpts::default(), 1200u64, spin).expect("push");
            let (ordinary, _) = p.run_ref(1200u64, spin).expect("run_ref");
            eprintln!(
                "round {round}: CPU share over 1.2 s: pushed {pushed:.3} (cap 0.2), run_ref \
                 {ordinary:.3}"
            );
            assert!(pushed > 0.02, "the pushed loop barely ran: {pushed:.3}");
            assert!(
                pushed < 0.45,
                "the pushed loop got {pushed:.3} cores under a cap of 0.2"
            );
            ordinary_best = ordinary_best.max(ordinary);
            if ordinary_best > 0.45 {
                break;
            }
        }
        assert!(
            ordinary_best > 0.45,
            "run_ref got at most {ordinary_best:.3} cores in three tries: capped too, or the \
             machine is saturated"
        );
        let m = metrics_of(&cluster, node);
        assert_eq!(
            metric(
                &m,
                &format!("granule_pushdown_cpu_cap_cores{{node=\"{node}\"}}")
            ),
            Some(0.2),
            "{m}"
        );
        p.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// A cap that cannot be put in force (here: cgroups turned off) leaves the pool running
/// uncapped, says so in the figures, and reports it on `/metrics`.
#[test]
fn a_cap_that_cannot_be_made_leaves_the_pool_uncapped_and_says_so() {
    bounded(LIMIT, || {
        let (cluster, node) = cluster_with(
            "cpu=1,mem=512MiB",
            &[("cluster.cgroups", "off"), ("pushdown.cpu_cap", "0.3")],
        );
        let p = numbers_on(node, 100);
        let f = figures(&p);
        assert_eq!(f.cpu_cap, None, "{f:?}");
        assert_eq!(
            p.push(PushOpts::default(), (), |v: &Vec<u64>, ()| v.len())
                .expect("the pool serves uncapped"),
            100
        );
        let m = metrics_of(&cluster, node);
        let label = format!("{{node=\"{node}\"}}");
        assert_eq!(
            metric(&m, &format!("granule_pushdown_cpu_cap_failed{label}")),
            Some(1.0),
            "{m}"
        );
        assert_eq!(
            metric(&m, &format!("granule_pushdown_cpu_cap_cores{label}")),
            Some(0.0)
        );
        p.destroy().expect("destroy");
        cluster.shutdown();
    });
}
