//! A seeded randomized test: for a few seconds, clients call proclets and a sharded map
//! splits and merges under their inserts and removes, while a mover moves proclets
//! around and changes the faults: the transport's fault filter delays, reorders, drops
//! and cuts frames and partitions nodes, and failpoints fail steps of moves and calls.
//! Then every faults is cleared and the outcome checked: no call was lost or run twice,
//! and every value is right.
//!
//! The seed fixes every thread's schedule of operations and faults (what each does, in
//! which order, with which fault rules); how the threads interleave stays free. A failure
//! prints the seed and the schedule with every outcome, and each node's fault report.
//!
//! - `GRANULE_CHAOS_SEED=N` runs seed N (default: a fixed one, so CI is repeatable);
//! - `GRANULE_CHAOS_RUNS=K` runs K seeds from it (N, N+1, ...), for soak runs.
//!
//! What counts as right, for each ledger call (add `x`, recorded with its id):
//! - answered with a value: applied exactly once, and the value is the ledger's total
//!   right after it;
//! - refused before running (`Refused`): not applied;
//! - failed ambiguously (the node or connection went away, a timeout, an internal
//!   error): applied at most once — it may have run, it must not have run twice;
//! - every ledger's total is the sum of what it applied, and nothing it applied was
//!   never issued.
//!
//! For the map: keys whose insert or remove was answered hold exactly what the model
//! says; keys with a failed operation hold one of the two values it was between.

mod common;

use common::bounded;
use granule::faults::{FaultAction, FaultRule, FaultRules, Partition};
use granule::sharded::{Bounds, ShardedMap};
use granule::{CallError, Cluster, Kind, NodeId, Proclet};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A proclet's record of the additions it applied: (operation id, total after it).
#[derive(Serialize, Deserialize, Default)]
struct Ledger {
    applied: Vec<(u64, u64)>,
    total: u64,
}

const LEDGERS: usize = 6;
const CLIENTS: usize = 3;
const OPS_PER_CLIENT: usize = 1000;
const MAP_OPS: usize = 2 * KEYS as usize;
const MOVER_STEPS: usize = 240;
/// A run that has not ended after this long is reported as hung (with its schedule).
const HANG_AFTER: Duration = Duration::from_secs(90);
/// Keys of the map, and the bytes of each value (600 × ~250 B: shards of 4–8 KiB split
/// as the inserts come and merge as the removes do).
const KEYS: u64 = 600;
const VALUE: usize = 200;

/// What a call's error says about whether it ran.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Outcome {
    Value(u64),
    /// Refused before running.
    NotRun,
    /// It may have run.
    Unknown,
}

fn classify(e: &CallError) -> Outcome {
    match e {
        CallError::Refused(_) | CallError::ProcletGone(_) => Outcome::NotRun,
        _ => Outcome::Unknown,
    }
}

/// What the map should hold: each key's value, and for keys whose last operations
/// failed, every value they may hold.
type MapModel = (BTreeMap<u64, Vec<u8>>, HashMap<u64, Vec<Option<Vec<u8>>>>);

/// One line of the schedule, with what happened.
#[derive(Clone, Debug)]
struct Entry {
    at: Duration,
    thread: &'static str,
    step: usize,
    what: String,
    outcome: String,
}

/// The schedule as it ran: each entry stamped with when it ended (since the start).
#[derive(Clone)]
struct Log(Arc<Mutex<Vec<Entry>>>, std::time::Instant);

impl Default for Log {
    fn default() -> Self {
        Log(Arc::default(), std::time::Instant::now())
    }
}

impl Log {
    fn push(&self, thread: &'static str, step: usize, what: String, outcome: String) {
        let at = self.1.elapsed();
        self.0.lock().unwrap().push(Entry {
            at,
            thread,
            step,
            what,
            outcome,
        });
    }

    fn render(&self) -> String {
        let mut out = String::new();
        for e in self.0.lock().unwrap().iter() {
            let _ = writeln!(
                out,
                "  {:>8.3}s {:<7} #{:<4} {:<48} {}",
                e.at.as_secs_f64(),
                e.thread,
                e.step,
                e.what,
                e.outcome
            );
        }
        out
    }
}

/// The faults of one phase of the mover's schedule.
fn fault_phase(
    rng: &mut StdRng,
    seed: u64,
    nodes: &[NodeId],
) -> (String, FaultRules, Vec<(NodeId, String)>) {
    let mut rules = FaultRules::seeded(seed);
    let mut what = Vec::new();
    let pick = |rng: &mut StdRng| nodes[rng.random_range(0..nodes.len())];
    match rng.random_range(0..7) {
        0 => what.push("no faults".to_string()),
        1 => {
            let ms = rng.random_range(1..4);
            let p = rng.random_range(0.05..0.3);
            rules = rules
                .rule(FaultRule::new(FaultAction::Delay(Duration::from_millis(ms))).probability(p));
            what.push(format!("delay {ms}ms p={p:.2} (any frame between nodes)"));
        }
        2 => {
            let after = rng.random_range(1..3);
            let p = rng.random_range(0.05..0.2);
            rules = rules.rule(
                FaultRule::new(FaultAction::Reorder { after })
                    .kind("Call")
                    .probability(p),
            );
            what.push(format!("reorder calls after {after} p={p:.2}"));
        }
        3 => {
            let n = pick(rng);
            let kind = ["Call", "Value", "Transfer"][rng.random_range(0..3)];
            rules = rules.rule(
                FaultRule::new(FaultAction::Cut)
                    .node(n)
                    .kind(kind)
                    .nth(rng.random_range(1..20)),
            );
            what.push(format!("cut a {kind} frame to/from {n}"));
        }
        4 => {
            let kind = ["Transfer", "TransferCommit", "Resolve"][rng.random_range(0..3)];
            let p = rng.random_range(0.1..0.5);
            rules = rules.rule(FaultRule::new(FaultAction::Drop).kind(kind).probability(p));
            what.push(format!("drop {kind} frames p={p:.2}"));
        }
        5 => {
            let a = pick(rng);
            let b = nodes.iter().copied().find(|n| *n != a).unwrap_or(a);
            rules = rules.partition(Partition::nodes([vec![a], vec![b]]).closing_open());
            what.push(format!("partition {a} | {b}"));
        }
        _ => what.push("no faults".to_string()),
    }
    // Failpoints (errors only: a crash would lose the node's proclets, which nothing
    // replicates yet).
    let mut points = Vec::new();
    if rng.random_bool(0.5) {
        let n = pick(rng);
        let spec = [
            "migrate.before_install=1*error",
            "migrate.installed=1*error",
            "stream.chunk_received=1*off->1*error",
            "migrate.locked=1*error",
            "call.before_run=2*off->1*error",
            "call.before_reply=3*off->1*error",
        ][rng.random_range(0..6)];
        what.push(format!("failpoint {spec} on {n}"));
        points.push((n, spec.to_string()));
    }
    (what.join("; "), rules, points)
}

fn run_seed(seed: u64) {
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=384MiB;cpu=1,mem=384MiB;cpu=1,mem=384MiB")
        .unwrap()
        .shed(false)
        .faults(true)
        // Faults must not get a node declared dead (nothing replicates its proclets).
        .failure_timeout(Duration::from_secs(10))
        .set("migration.stall_timeout", "2s")
        .unwrap()
        .start()
        .unwrap();
    let workers = cluster.worker_nodes().unwrap();
    let mut everyone = workers.clone();
    everyone.push(cluster.node_id());
    let log = Log::default();
    let mut rng = StdRng::seed_from_u64(seed);

    let ledgers: Vec<Proclet<Ledger>> = (0..LEDGERS)
        .map(|i| {
            Proclet::builder(Kind::Memory)
                .on(everyone[i % everyone.len()])
                .create((), |()| Ledger::default())
                .unwrap()
        })
        .collect();
    let map: ShardedMap<u64, Vec<u8>> =
        ShardedMap::with_bounds(Bounds::new(4 << 10, 8 << 10).unwrap()).unwrap();

    // Every schedule is drawn now, from the seed.
    let client_seeds: Vec<u64> = (0..CLIENTS).map(|_| rng.random()).collect();
    let map_seed: u64 = rng.random();
    let mover_seed: u64 = rng.random();

    type Result = (u64, usize, u64, Outcome);
    let results: Arc<Mutex<Vec<Result>>> = Arc::default();
    let map_model: Arc<Mutex<MapModel>> = Arc::default();
    let max_shards = Arc::new(Mutex::new(0usize));

    // A hang is a failure like any other: past the deadline, print the seed, the
    // schedule so far and what every node's faults did, then fail.
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let (finished, log) = (finished.clone(), log.clone());
        std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let mut deadline = started + HANG_AFTER;
            loop {
                if finished.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                if std::time::Instant::now() >= deadline {
                    eprintln!(
                        "chaos seed {seed} HUNG: no end after {:?} \
                         (rerun: GRANULE_CHAOS_SEED={seed} cargo test -p granule --test chaos)\n\
                         schedule so far:\n{}",
                        started.elapsed(),
                        log.render()
                    );
                    deadline += HANG_AFTER;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
    }
    std::thread::scope(|s| {
        for (c, cseed) in client_seeds.iter().enumerate() {
            let (ledgers, results, log) = (&ledgers, results.clone(), log.clone());
            let ctx = granule::thread_context();
            s.spawn(move || {
                ctx.enter();
                let mut r = StdRng::seed_from_u64(*cseed);
                for step in 0..OPS_PER_CLIENT {
                    let k = r.random_range(0..LEDGERS);
                    let x = r.random_range(1..1000u64);
                    let op = ((c as u64) << 32) | step as u64;
                    let p = ledgers[k].with_timeout(Duration::from_secs(5));
                    let out = p.run((op, x), |l: &mut Ledger, (op, x): (u64, u64)| {
                        l.total += x;
                        l.applied.push((op, l.total));
                        l.total
                    });
                    let o = match &out {
                        Ok(v) => Outcome::Value(*v),
                        Err(e) => classify(e),
                    };
                    log.push(
                        "client",
                        step,
                        format!("c{c} add {x} to ledger {k} (op {op:#x})"),
                        format!("{out:?}"),
                    );
                    results.lock().unwrap().push((op, k, x, o));
                }
            });
        }
        {
            let (map, model, log, max_shards) =
                (&map, map_model.clone(), log.clone(), max_shards.clone());
            let ctx = granule::thread_context();
            s.spawn(move || {
                ctx.enter();
                let mut r = StdRng::seed_from_u64(map_seed);
                // The second half removes every key, in a seeded order: the map drains.
                let mut drain: Vec<u64> = (0..KEYS).collect();
                for i in (1..drain.len()).rev() {
                    drain.swap(i, r.random_range(0..=i));
                }
                for step in 0..MAP_OPS {
                    // Mostly inserts at first (splits), removes later (merges).
                    let (removing, key) = match step.checked_sub(MAP_OPS / 2) {
                        None => (r.random_bool(0.1), r.random_range(0..KEYS)),
                        Some(i) => (true, drain[i % drain.len()]),
                    };
                    let mut m = model.lock().unwrap();
                    let before = m.0.get(&key).cloned();
                    let (what, after, out) = if removing {
                        let out = map.remove(&key).map(|_| ());
                        (format!("map remove {key}"), None, out)
                    } else {
                        let v = vec![(step % 251) as u8; VALUE];
                        let out = map.insert(key, v.clone()).map(|_| ());
                        (format!("map insert {key}"), Some(v), out)
                    };
                    match &out {
                        Ok(()) => {
                            m.1.remove(&key);
                            match &after {
                                Some(v) => m.0.insert(key, v.clone()),
                                None => m.0.remove(&key),
                            };
                        }
                        Err(_) => {
                            // Either value may be there now; later answered operations
                            // settle it again.
                            let e = m.1.entry(key).or_default();
                            e.push(before.clone());
                            e.push(after.clone());
                            match &after {
                                Some(v) => m.0.insert(key, v.clone()),
                                None => m.0.remove(&key),
                            };
                        }
                    }
                    drop(m);
                    let mut outcome = format!("{out:?}");
                    if let Err(granule::sharded::ShardError::Stuck(_)) = &out {
                        // What the shards say of themselves, to see why.
                        if let Ok(lines) = map.sharder().describe() {
                            outcome =
                                format!("{outcome}; shards:\n      {}", lines.join("\n      "));
                        }
                    }
                    log.push("map", step, what, outcome);
                    if step % 10 == 0 {
                        if let Ok(shards) = map.sharder().shards() {
                            let mut mx = max_shards.lock().unwrap();
                            *mx = (*mx).max(shards.len());
                        }
                    }
                }
            });
        }
        {
            let (cluster, ledgers, log, everyone) = (&cluster, &ledgers, log.clone(), &everyone);
            let workers = &workers;
            s.spawn(move || {
                let mut r = StdRng::seed_from_u64(mover_seed);
                for step in 0..MOVER_STEPS {
                    if step % 5 == 0 {
                        let (what, rules, points) =
                            fault_phase(&mut r, seed ^ step as u64, workers);
                        let mut outcome = String::new();
                        for n in everyone {
                            if let Err(e) = cluster.faults().filter(*n, &rules) {
                                let _ = write!(outcome, "filter on {n}: {e}; ");
                            }
                            let list = points
                                .iter()
                                .filter(|(at, _)| at == n)
                                .map(|(_, s)| s.as_str())
                                .collect::<Vec<_>>()
                                .join(";");
                            if let Err(e) = cluster.faults().failpoints(*n, &list) {
                                let _ = write!(outcome, "failpoints on {n}: {e}; ");
                            }
                        }
                        log.push("faults", step, what, outcome);
                    }
                    let k = r.random_range(0..LEDGERS);
                    let to = everyone[r.random_range(0..everyone.len())];
                    let out = cluster.move_proclet(ledgers[k].id(), to);
                    log.push(
                        "mover",
                        step,
                        format!("move ledger {k} to {to}"),
                        match out {
                            Ok(s) => format!("moved {} bytes in {} us", s.bytes, s.micros),
                            Err(e) => format!("failed: {e}"),
                        },
                    );
                }
                // The schedule of faults ends with the mover's: the last phase must not
                // stay in force while the others finish (a partition would slow every
                // operation it cuts off to its retry patience, for minutes).
                let outcome = match cluster.faults().clear() {
                    Ok(()) => String::new(),
                    Err(e) => format!("failed: {e}"),
                };
                log.push("faults", MOVER_STEPS, "faults cleared".into(), outcome);
            });
        }
    });

    // Faults off; give provisional arrivals time to resolve; then check.
    cluster.faults().clear().unwrap();
    log.push("check", 0, "faults cleared".into(), String::new());
    let mut failures = Vec::new();
    let results = results.lock().unwrap().clone();
    let mut applied: Vec<HashMap<u64, (usize, u64)>> = Vec::new();
    for (k, p) in ledgers.iter().enumerate() {
        let mut got = None;
        for _ in 0..100 {
            match p
                .with_timeout(Duration::from_secs(5))
                .run_ref((), |l: &Ledger, ()| (l.applied.clone(), l.total))
            {
                Ok(v) => {
                    got = Some(v);
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        let Some((list, total)) = got else {
            failures.push(format!("ledger {k} cannot be read after the faults"));
            applied.push(HashMap::new());
            continue;
        };
        let mut seen: HashMap<u64, (usize, u64)> = HashMap::new();
        for (i, (op, after)) in list.iter().enumerate() {
            if seen.insert(*op, (i, *after)).is_some() {
                failures.push(format!("ledger {k}: op {op:#x} applied twice"));
            }
        }
        let issued: HashSet<u64> = results.iter().filter(|r| r.1 == k).map(|r| r.0).collect();
        let mut sum = 0;
        for (op, after) in &list {
            if !issued.contains(op) {
                failures.push(format!("ledger {k}: op {op:#x} applied but never issued"));
            }
            let x = results.iter().find(|r| r.0 == *op).map_or(0, |r| r.2);
            sum += x;
            if sum != *after {
                failures.push(format!(
                    "ledger {k}: total after op {op:#x} is {after}, the ops before it sum to {sum}"
                ));
            }
        }
        if sum != total {
            failures.push(format!(
                "ledger {k}: total {total}, applied ops sum to {sum}"
            ));
        }
        applied.push(seen);
    }
    let (mut answered, mut refused, mut unknown) = (0, 0, 0);
    for (op, k, _x, o) in &results {
        let at = applied.get(*k).and_then(|m| m.get(op));
        match o {
            Outcome::Value(v) => {
                answered += 1;
                match at {
                    Some((_, after)) if after == v => {}
                    Some((_, after)) => {
                        failures.push(format!("op {op:#x} answered {v}, the ledger says {after}"))
                    }
                    None => failures.push(format!(
                        "op {op:#x} answered {v} but was not applied (lost)"
                    )),
                }
            }
            Outcome::NotRun => {
                refused += 1;
                if at.is_some() {
                    failures.push(format!("op {op:#x} was refused, yet applied"));
                }
            }
            Outcome::Unknown => unknown += 1,
        }
    }
    if answered < results.len() / 2 {
        failures.push(format!(
            "only {answered} of {} calls were answered: the faults stopped the cluster",
            results.len()
        ));
    }
    // The map, once faults are off.
    let (model, uncertain) = map_model.lock().unwrap().clone();
    for key in 0..KEYS {
        let got = match map.get(&key) {
            Ok(v) => v,
            Err(e) => {
                failures.push(format!("map get {key}: {e}"));
                continue;
            }
        };
        match uncertain.get(&key) {
            Some(options) => {
                let want = model.get(&key).cloned();
                if got != want && !options.contains(&got) {
                    failures.push(format!(
                        "map key {key} holds {:?}, expected one of {:?}",
                        got.as_ref().map(|v| v[0]),
                        options
                            .iter()
                            .map(|o| o.as_ref().map(|v| v[0]))
                            .collect::<Vec<_>>()
                    ));
                }
            }
            None => {
                if got != model.get(&key).cloned() {
                    failures.push(format!(
                        "map key {key} holds {:?}, the model {:?}",
                        got.as_ref().map(|v| v[0]),
                        model.get(&key).map(|v| v[0])
                    ));
                }
            }
        }
    }
    log.push("check", 1, "ledgers and map read".into(), String::new());
    let max_shards = *max_shards.lock().unwrap();
    if max_shards < 2 {
        failures.push(format!("the map never split (at most {max_shards} shard)"));
    }
    // The structure recovers from whatever the faults left half-done: with them off,
    // removing every key drains it and its shards merge (splits left pending by a
    // partition are finished by the next client that meets them).
    let mut drained = true;
    for key in 0..KEYS {
        let out = map.remove(&key);
        log.push("check", 2, format!("map remove {key}"), format!("{out:?}"));
        if let Err(e) = out {
            // One stuck key is enough to see (each takes the router's patience).
            let shards = match map.sharder().describe() {
                Ok(lines) => lines.join("\n  "),
                Err(e) => format!("cannot be read: {e}"),
            };
            failures.push(format!(
                "map remove {key} after the faults: {e}; its shards:\n  {shards}"
            ));
            drained = false;
            break;
        }
    }
    let end_shards = map
        .sharder()
        .shards()
        .map(|s| s.len())
        .unwrap_or(usize::MAX);
    // (A map its removes could not drain is not counted: that failure is reported.)
    match drained.then(|| map.len()) {
        None | Some(Ok(0)) => {}
        Some(other) => failures.push(format!("the drained map holds {other:?} entries")),
    }
    if drained && end_shards > 2 {
        failures.push(format!(
            "the drained map still has {end_shards} shards ({max_shards} at most): it does not merge"
        ));
    }
    finished.store(true, std::sync::atomic::Ordering::Release);
    eprintln!(
        "chaos seed {seed}: {} calls: {answered} answered, {refused} refused, {unknown} ambiguous; map up to {max_shards} shards, {end_shards} at the end",
        results.len()
    );
    if !failures.is_empty() {
        let mut reports = String::new();
        for n in &everyone {
            let _ = writeln!(
                reports,
                "--- {n}:\n{}",
                cluster
                    .faults()
                    .report(*n)
                    .unwrap_or_else(|e| e.to_string())
            );
        }
        panic!(
            "chaos seed {seed} failed (rerun: GRANULE_CHAOS_SEED={seed} cargo test -p granule --test chaos):\n{}\n\nschedule:\n{}\nfault reports:\n{reports}",
            failures.join("\n"),
            log.render()
        );
    }
}

#[test]
fn calls_moves_splits_and_merges_under_faults_lose_nothing() {
    let first: u64 = std::env::var("GRANULE_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261125);
    let runs: u64 = std::env::var("GRANULE_CHAOS_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    for seed in first..first + runs {
        bounded(Duration::from_secs(240), move || run_seed(seed));
    }
}
