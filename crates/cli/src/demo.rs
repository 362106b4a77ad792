//! `granule demo`: a small word-count service spread over an embedded local cluster.
//!
//! Three memory proclets hold shards of a word → count map; a compute proclet routes
//! words to them (a chained call: driver → router → shard, each on its own node). The demo
//! prints where everything ran, measures call rates (local, remote, pipelined, chained),
//! moves a shard to another node while keeping its data, and shows typed errors.

use anyhow::Context;
use futures::stream::{FuturesUnordered, StreamExt};
use granule::{here, CallError, Cluster, Config, Kind, NodeId, Proclet};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// A shard of the word-count map (a memory proclet).
#[derive(Serialize, Deserialize, Default)]
struct Shard {
    counts: BTreeMap<String, u64>,
}

/// Routes words to shards (a compute proclet). Holds handles to the shards.
#[derive(Serialize, Deserialize)]
struct Router {
    shards: Vec<Proclet<Shard>>,
    routed: u64,
}

fn shard_of(word: &str, n: usize) -> usize {
    // FNV-1a: stable across processes (std's hasher is randomly keyed per process).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in word.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    (h % n as u64) as usize
}

/// Count the words of `text` into the shards; returns (router node, [(shard node, words)]).
fn route(r: &mut Router, text: String) -> Result<(NodeId, Vec<(NodeId, u64)>), CallError> {
    let n = r.shards.len();
    let mut batches: Vec<Vec<String>> = vec![Vec::new(); n];
    for w in text.split_whitespace() {
        let w = w
            .trim_matches(|c: char| !c.is_alphanumeric())
            .to_lowercase();
        if !w.is_empty() {
            batches[shard_of(&w, n)].push(w);
        }
    }
    let mut out = Vec::new();
    for (shard, words) in r.shards.iter().zip(batches) {
        let k = words.len() as u64;
        r.routed += k;
        let node = shard.run(words, |s: &mut Shard, words: Vec<String>| {
            for w in words {
                *s.counts.entry(w).or_default() += 1;
            }
            here()
        })?;
        out.push((node.unwrap_or(NodeId(0)), k));
    }
    Ok((here().unwrap_or(NodeId(0)), out))
}

const TEXT: &str = "Machines in a datacenter run out of one resource while another sits idle. \
Granule lets one program use CPU on one machine and memory on another, and move its pieces in \
milliseconds as availability changes. Proclets are units of state and compute that migrate \
fast under pressure; resource proclets split and merge; a memory market harvests idle memory; \
compute moves to the data when the data is large; a file system scavenges memory from other \
tenants. One program, many machines, no stranded resources.";

fn rate(
    seconds: f64,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<(f64, Duration)> {
    let t = Instant::now();
    let mut n = 0u64;
    let mut lat = Vec::new();
    while t.elapsed().as_secs_f64() < seconds {
        let c = Instant::now();
        f()?;
        if lat.len() < 1_000_000 {
            lat.push(c.elapsed());
        }
        n += 1;
    }
    lat.sort();
    let p50 = lat.get(lat.len() / 2).copied().unwrap_or_default();
    Ok((n as f64 / t.elapsed().as_secs_f64(), p50))
}

fn fmt_rate(r: f64) -> String {
    if r >= 1e6 {
        format!("{:.2} M/s", r / 1e6)
    } else if r >= 1e3 {
        format!("{:.1} k/s", r / 1e3)
    } else {
        format!("{r:.0} /s")
    }
}

/// Run the demo's steps; then, with `stay`, keep the cluster and its dashboard running
/// until Ctrl-C (or SIGTERM) so that they can be looked at.
pub fn run(seconds: f64, stay: bool) -> anyhow::Result<()> {
    // The demo's own default: three small nodes (cluster.nodes / GRANULE_NODES override).
    let mut defaults = Config::default();
    defaults.cluster.nodes =
        granule::config::parse_specs("cpu=1,mem=512MiB;cpu=1,mem=512MiB;cpu=1,mem=512MiB")
            .map_err(anyhow::Error::msg)?;
    println!("== Granule demo ==");
    let progress = granule_report::Progress::new(5, "demo");
    progress.step("starting the local cluster");
    let started = Instant::now();
    let cluster = Cluster::builder()
        .defaults(defaults)
        .start()
        .context("starting the local cluster")?;
    println!(
        "Started the embedded cluster in {:.0} ms: controller {}, driver {} (this process), {} node processes of this same executable.",
        started.elapsed().as_secs_f64() * 1e3,
        cluster.controller_addr(),
        cluster.node_id(),
        cluster.spawned_nodes().len()
    );
    match cluster.dashboard_url() {
        Some(url) => {
            println!("Dashboard: {url} (live nodes, proclets and events; /metrics for Prometheus)")
        }
        None => {
            println!("Dashboard: none (GRANULE_DASHBOARD=off, or joined an external controller)")
        }
    }
    print!("{}", granule_report::usage::node_table(&cluster.nodes()?));

    // 1. Proclets, placed by the controller.
    println!("\n-- 1. Create proclets (placed by the controller: memory → most free memory, compute → most idle cores)");
    let shards: Vec<Proclet<Shard>> = (0..3)
        .map(|_| Proclet::new(Kind::Memory, Shard::default()))
        .collect::<Result<_, _>>()?;
    for (i, s) in shards.iter().enumerate() {
        println!(
            "   shard {i}  {:>4}  memory proclet on {}",
            s.id().to_string(),
            s.location()?
        );
    }
    let router = Proclet::create(
        Kind::Compute,
        shards.clone(),
        |shards: Vec<Proclet<Shard>>| Router { shards, routed: 0 },
    )?;
    println!(
        "   router   {:>4}  compute proclet on {}",
        router.id().to_string(),
        router.location()?
    );

    // 2. Chained calls: driver → router → shards.
    progress.step("chained calls");
    println!("\n-- 2. Chained calls: the driver sends text to the router, which sends words to the shards");
    for (i, sentence) in TEXT.split(". ").enumerate().take(3) {
        let (rnode, parts) = router.run(sentence.to_string(), route)??;
        let hops: Vec<String> = parts
            .iter()
            .map(|(n, k)| format!("{k} words → {n}"))
            .collect();
        println!(
            "   text {i}: driver {} → router on {rnode} → [{}]",
            cluster.node_id(),
            hops.join(", ")
        );
    }
    for sentence in TEXT.split(". ").skip(3) {
        router.run(sentence.to_string(), route)??;
    }
    let mut totals: HashMap<String, u64> = HashMap::new();
    for s in &shards {
        let part = s.run_ref((), |s: &Shard, ()| s.counts.clone())?;
        for (w, c) in part {
            *totals.entry(w).or_default() += c;
        }
    }
    let mut top: Vec<(String, u64)> = totals.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let top: Vec<String> = top
        .iter()
        .take(6)
        .map(|(w, c)| format!("{w}:{c}"))
        .collect();
    println!(
        "   most frequent words (merged from the shards): {}",
        top.join("  ")
    );

    // 3. Call rates.
    progress.step("measuring call rates");
    println!("\n-- 3. Call rates ({seconds} s each)");
    let local = Proclet::builder(Kind::Memory)
        .on(cluster.node_id())
        .create((), |()| Shard::default())?;
    let bump = |s: &mut Shard, w: String| {
        *s.counts.entry(w).or_default() += 1;
    };
    let (r, p50) = rate(seconds, || Ok(local.run("x".to_string(), bump)?))?;
    println!(
        "   local proclet (on the driver), sync      {:>12}   p50 {:>8.2?}",
        fmt_rate(r),
        p50
    );
    let target = &shards[0];
    let (r, p50) = rate(seconds, || Ok(target.run("x".to_string(), bump)?))?;
    println!(
        "   remote proclet (on {}), sync              {:>12}   p50 {:>8.2?}",
        target.location()?,
        fmt_rate(r),
        p50
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(async {
        let t = Instant::now();
        let mut inflight = FuturesUnordered::new();
        for _ in 0..128 {
            inflight.push(target.run_async("x".to_string(), bump));
        }
        let mut n = 0u64;
        while let Some(r) = inflight.next().await {
            r?;
            n += 1;
            if t.elapsed().as_secs_f64() < seconds {
                inflight.push(target.run_async("x".to_string(), bump));
            }
        }
        Ok::<_, CallError>(n as f64 / t.elapsed().as_secs_f64())
    })?;
    println!(
        "   remote proclet, pipelined (128 in flight) {:>12}",
        fmt_rate(r)
    );
    let (r, p50) = rate(seconds, || {
        router.run("granule".to_string(), route)??;
        Ok(())
    })?;
    println!(
        "   chained driver → router → 3 shards        {:>12}   p50 {:>8.2?}",
        fmt_rate(r),
        p50
    );

    // 4. Move a shard through the controller; its data and callers follow.
    progress.step("moving a proclet");
    println!("\n-- 4. Move a proclet (through the controller API)");
    let s0 = &shards[0];
    let from = s0.location()?;
    let to = cluster
        .worker_nodes()?
        .into_iter()
        .find(|n| *n != from)
        .unwrap_or(cluster.node_id());
    let words_before = s0.run_ref((), |s: &Shard, ()| s.counts.len())?;
    let t = Instant::now();
    cluster.move_proclet(s0.id(), to)?;
    let took = t.elapsed();
    let words_after = s0.run_ref((), |s: &Shard, ()| s.counts.len())?;
    let (rnode, parts) = router.run("moved".to_string(), route)??;
    println!(
        "   shard 0 moved {from} → {to} in {:.2?} with its {words_before} words (now {words_after}); the router on {rnode} had it cached at {from} and was redirected: {:?}",
        took,
        parts.iter().map(|(n, _)| n.to_string()).collect::<Vec<_>>()
    );

    // 5. Typed errors.
    progress.step("typed errors");
    println!("\n-- 5. Errors are typed values, and nodes survive them");
    let r = shards[1].run((), |_s: &mut Shard, ()| -> u64 {
        panic!("a bug in a shipped closure")
    });
    println!(
        "   closure panicked on {}: {}",
        shards[1].location()?,
        r.err().map(|e| e.to_string()).unwrap_or_default()
    );
    let n = shards[1].run_ref((), |s: &Shard, ()| s.counts.len())?;
    println!("   the same proclet still answers ({n} words)");
    let doomed = Proclet::new(Kind::Memory, Shard::default())?;
    doomed.destroy()?;
    println!(
        "   a call to a destroyed proclet: {}",
        doomed
            .run_ref((), |s: &Shard, ()| s.counts.len())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    );

    println!(
        "\n-- Cluster at the end (granule status --controller {})",
        cluster.controller_addr()
    );
    std::thread::sleep(Duration::from_millis(150)); // one heartbeat, so usage is fresh
    print!("{}", granule_report::usage::node_table(&cluster.nodes()?));
    progress.finish();
    if stay {
        let why = stay_until_stopped(&cluster)?;
        println!("\n{why}: stopping the cluster.");
    }
    cluster.shutdown();
    println!("\nDone: every node process has been stopped.");
    Ok(())
}

/// Keep the cluster up for a look around, saying what to try, until Ctrl-C or SIGTERM.
/// Returns which of them came.
fn stay_until_stopped(cluster: &Cluster) -> anyhow::Result<&'static str> {
    // How this very program is started again from the caller's shell: its path as
    // written from the current directory when it lies below it (target/release/granule).
    let exe = std::env::current_exe()
        .ok()
        .map(|p| {
            std::env::current_dir()
                .ok()
                .and_then(|d| p.strip_prefix(d).ok().map(|r| r.to_path_buf()))
                .unwrap_or(p)
        })
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "granule".to_string());
    // Listening before saying so: a Ctrl-C right after the message stops it cleanly.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut interrupt, mut terminate) = {
        let _in = rt.enter();
        use tokio::signal::unix::{signal, SignalKind};
        (
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        )
    };
    let ctl = cluster.controller_addr();
    println!("\n== The cluster keeps running so that you can look at it. Ctrl-C stops it.");
    if let Some(url) = cluster.dashboard_url() {
        println!("   the dashboard:        {url}");
    }
    println!("   its nodes and usage:  {exe} status --controller {ctl}");
    println!("   live, refreshing:     {exe} top --controller {ctl}");
    println!("   a program of yours joins it with GRANULE_CONTROLLER={ctl}");
    println!("   (`granule demo --exit` runs the steps and stops at once.)");
    Ok(rt.block_on(async {
        tokio::select! {
            _ = interrupt.recv() => "Interrupted",
            _ = terminate.recv() => "Terminated",
        }
    }))
}
