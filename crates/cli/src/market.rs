//! The memory market's commands: `granule broker`, `granule producer run` and
//! `granule kv get|put|del|stats|release`. Parsing and printing only; the work is in
//! `granule-market`.

use anyhow::Context;
use clap::{Args, Subcommand};
use granule::config::Origin;
use granule_market::client::{BrokerLeases, LeaseTerms};
use granule_market::consumer::{KvCache, LeaseSource, Protection};
use granule_market::harvester::{MetricSource, Workload};
use granule_market::producer::{Producer, ProducerOptions};
use granule_wire::market::EvictionMode;
use std::path::PathBuf;
use std::sync::Arc;

/// The broker to reach: `--broker`, else `market.broker`, else the cluster's controller.
fn broker_addr(c: &granule::Config, flag: Option<String>) -> anyhow::Result<String> {
    flag.or_else(|| c.market.broker.clone())
        .or_else(|| c.cluster.controller.clone())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--broker: which broker? Give --broker HOST:PORT (or GRANULE_MARKET_BROKER, or a controller started with --broker in GRANULE_CONTROLLER)"
            )
        })
}

#[derive(Args)]
pub struct BrokerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:7071")]
    listen: String,
    /// Also serve /metrics and /api/market over HTTP here (IP:PORT, port 0 = a free one).
    #[arg(long)]
    http: Option<String>,
    /// A TOML configuration file (instead of GRANULE_CONFIG).
    #[arg(long)]
    config: Option<PathBuf>,
}

pub fn broker(args: BrokerArgs) -> anyhow::Result<()> {
    let c = super::load_config(args.config.as_deref())?;
    c.validate()?;
    granule::init_logging(&c.cluster.log);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(granule_market::server::run_standalone(
        &args.listen,
        &c,
        args.http.as_deref(),
    ))
    .with_context(|| format!("granule broker cannot start on {}", args.listen))
}

#[derive(Subcommand)]
pub enum ProducerCmd {
    /// Harvest a workload's idle memory and lease it through the broker. Give the
    /// workload as a memory cgroup (--cgroup) or a command to start (after --), or only
    /// a fixed --offer.
    Run(ProducerRunArgs),
}

#[derive(Args)]
pub struct ProducerRunArgs {
    /// An existing memory cgroup to harvest (absolute, or relative to the memory
    /// controller's root).
    #[arg(long, conflicts_with = "command")]
    cgroup: Option<PathBuf>,
    /// Memory offered without harvesting (e.g. 512MiB), in addition to what is harvested.
    #[arg(long)]
    offer: Option<String>,
    /// The producer's name at the broker (default: host name and pid).
    #[arg(long)]
    name: Option<String>,
    /// The broker (host:port) (market.broker; else the controller).
    #[arg(long)]
    broker: Option<String>,
    /// The address consumers reach this machine's stores at.
    #[arg(long, default_value = "127.0.0.1")]
    advertise: String,
    /// The address stores listen on.
    #[arg(long, default_value = "0.0.0.0")]
    listen_host: String,
    /// The workload pushes latency samples (one number per line, in any unit) to this
    /// Unix socket (market.metric socket:PATH); without it or --metric-url, market.metric
    /// decides (swapin: the anonymous swap-in rate stands for performance).
    #[arg(long, conflicts_with = "metric_url")]
    metric_socket: Option<PathBuf>,
    /// The workload reports its latency at this HTTP URL (a number in the body).
    #[arg(long)]
    metric_url: Option<String>,
    /// A TOML configuration file (instead of GRANULE_CONFIG).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The workload to start in a memory cgroup of its own.
    #[arg(last = true, id = "command")]
    command: Vec<String>,
}

pub fn producer(cmd: ProducerCmd) -> anyhow::Result<()> {
    let ProducerCmd::Run(a) = cmd;
    let c = super::load_config(a.config.as_deref())?;
    c.validate()?;
    granule::init_logging(&c.cluster.log);
    let offer = match &a.offer {
        Some(s) => granule::config::parse_size(s)
            .map_err(anyhow::Error::msg)
            .context("--offer")?,
        None => 0,
    };
    let metric = match (&a.metric_socket, &a.metric_url) {
        (Some(p), _) => MetricSource::Socket(p.clone()),
        (None, Some(u)) => MetricSource::Http(u.clone()),
        (None, None) => MetricSource::from_setting(&c.market.metric)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("market.metric")?,
    };
    let workload = match (&a.cgroup, a.command.is_empty()) {
        (Some(g), _) => Some((Workload::Cgroup(g.clone()), metric)),
        (None, false) => Some((Workload::Command(a.command.clone()), metric)),
        (None, true) => None,
    };
    let broker = broker_addr(&c, a.broker.clone())?;
    let name = a.name.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "producer".into());
        format!("{host}-{}", std::process::id())
    });
    let opts = ProducerOptions {
        name,
        advertise: a.advertise.clone(),
        listen_host: a.listen_host.clone(),
        offer,
        broker,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let producer = Producer::start(&c, opts, workload, |lines| {
            for l in lines {
                println!("granule producer: {l}");
            }
        })?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let child = producer.child_pid();
        let why = loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break "interrupted".to_string(),
                _ = term.recv() => break "terminated".to_string(),
                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {
                    if let Some(pid) = child {
                        if granule_host::proc::process_gone(pid) {
                            break format!("the workload (pid {pid}) exited");
                        }
                    }
                }
            }
        };
        println!("granule producer: stopping ({why}); undoing what it changed");
        for l in producer.stop()? {
            println!("granule producer: {l}");
        }
        anyhow::Ok(())
    })
}

#[derive(Args)]
pub struct KvArgs {
    /// The broker (host:port) (market.broker; else the controller).
    #[arg(long)]
    broker: Option<String>,
    /// Where the cache's local metadata and keys live between commands.
    #[arg(long)]
    state: Option<PathBuf>,
    /// The consumer's name at the broker.
    #[arg(long, default_value = "kv")]
    consumer: String,
    /// Slabs to lease when the cache has none.
    #[arg(long, default_value_t = 1)]
    slabs: u32,
    /// How values are protected: encrypt, integrity or none (market.protection).
    #[arg(long)]
    protection: Option<String>,
    /// A TOML configuration file (instead of GRANULE_CONFIG).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    op: KvOp,
}

#[derive(Subcommand)]
pub enum KvOp {
    /// Print a key's value (exit status 1 on a miss).
    Get { key: String },
    /// Store a value.
    Put { key: String, value: String },
    /// Remove a key.
    Del { key: String },
    /// The cache's counters and leases.
    Stats,
    /// Give the leases back and forget the cache.
    Release,
}

pub fn kv(a: KvArgs) -> anyhow::Result<()> {
    let mut c = super::load_config(a.config.as_deref())?;
    if let Some(p) = &a.protection {
        c.set_with_origin("market.protection", p, Origin::Flag("--protection"))?;
    }
    c.validate()?;
    let protection = Protection::parse(&c.market.protection)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("market.protection")?;
    let broker = broker_addr(&c, a.broker.clone())?;
    let state = match &a.state {
        Some(p) => p.clone(),
        None => {
            let home = std::env::var("HOME").unwrap_or_else(|_| "/tmp".into());
            PathBuf::from(home)
                .join(".granule")
                .join(format!("kv-{}.json", a.consumer))
        }
    };
    if let Some(dir) = state.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let terms = LeaseTerms {
            consumer: a.consumer.clone(),
            lease_time: c.market.lease_time,
            budget: f64::MAX,
            mode: EvictionMode::Lru,
        };
        let source = Arc::new(BrokerLeases::connect(&broker, terms).await?);
        let cache = KvCache::open(&state, source.clone(), protection, a.slabs)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut miss = false;
        match &a.op {
            KvOp::Get { key } => match cache.get(key.as_bytes()).await {
                Ok(Some(v)) => println!("{}", String::from_utf8_lossy(&v)),
                Ok(None) => {
                    eprintln!("(miss)");
                    miss = true;
                }
                Err(e) => anyhow::bail!("get {key}: {e}"),
            },
            KvOp::Put { key, value } => cache
                .put(key.as_bytes(), value.as_bytes())
                .await
                .map_err(|e| anyhow::anyhow!("put {key}: {e}"))?,
            KvOp::Del { key } => {
                let was = cache
                    .delete(key.as_bytes())
                    .await
                    .map_err(|e| anyhow::anyhow!("del {key}: {e}"))?;
                println!("{}", if was { "deleted" } else { "(no such key)" });
            }
            KvOp::Stats => {
                let s = cache.stats();
                println!("{}", serde_json::to_string_pretty(&s)?);
                for l in cache.leases() {
                    println!(
                        "lease {} on {} ({}): {} slab(s), expires in {}s, price {:.6}",
                        l.lease,
                        l.producer_name,
                        l.store_addr,
                        l.slabs,
                        l.expires_unix_ms
                            .saturating_sub(granule_market::server::now_ms())
                            / 1000,
                        l.price
                    );
                }
            }
            KvOp::Release => {
                let leases = cache.leases();
                for l in &leases {
                    source
                        .release(l.lease)
                        .await
                        .map_err(|e| anyhow::anyhow!("release lease {}: {e}", l.lease))?;
                }
                println!("released {} lease(s)", leases.len());
            }
        }
        if matches!(a.op, KvOp::Release) {
            let _ = std::fs::remove_file(&state);
        } else {
            cache.save().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        if miss {
            std::process::exit(1);
        }
        anyhow::Ok(())
    })
}

/// The market as lines of text, for `granule status` and `granule top`: producers
/// (limit, harvested, policy state), leases (consumer, slabs, expiry, price) and the
/// price's recent path.
pub fn market_lines(v: &granule_wire::market::MarketView) -> Vec<String> {
    use crate::status::bytes;
    let now = granule_market::server::now_ms();
    let mut out = vec![format!(
        "memory market: price {:.6} per slab-hour, {} producer(s), {} lease(s), {} request(s) queued ({} slabs)",
        v.price,
        v.producers.len(),
        v.leases.len(),
        v.queued_requests,
        v.queued_slabs
    )];
    out.push(format!(
        "  {:<5} {:<22} {:<4} {:>10} {:>10} {:>10} {:>5} {:>6} {:>10} {:>5}  {}",
        "ID",
        "PRODUCER",
        "UP",
        "LIMIT",
        "WAS",
        "HARVESTED",
        "FREE",
        "LEASED",
        "RSS",
        "REP",
        "POLICY"
    ));
    for p in &v.producers {
        let s = &p.state;
        // 0: not reported; u64::MAX (or near it): no limit.
        let limit = |b: u64| match b {
            0 => "-".to_string(),
            b if b >= 1 << 60 => "none".to_string(),
            b => bytes(b),
        };
        out.push(format!(
            "  {:<5} {:<22} {:<4} {:>10} {:>10} {:>10} {:>5} {:>6} {:>10} {:>5.2}  {}",
            p.producer,
            p.name,
            if p.connected { "yes" } else { "NO" },
            limit(s.limit_bytes),
            limit(s.original_limit_bytes),
            bytes(s.harvested_bytes),
            s.free_slabs,
            s.leased_slabs,
            // The producer's footprint beside its leases: memory held past them (after
            // a flush or a lease's end) shows here.
            if s.resident_bytes == 0 {
                "-".to_string()
            } else {
                bytes(s.resident_bytes)
            },
            p.reputation,
            s.policy_state
        ));
    }
    if !v.leases.is_empty() {
        out.push(format!(
            "  {:<20} {:<14} {:<22} {:>5} {:>9} {:>10}  {}",
            "LEASE", "CONSUMER", "PRODUCER", "SLABS", "EXPIRES", "PRICE", "MODE"
        ));
        for l in &v.leases {
            out.push(format!(
                "  {:<20} {:<14} {:<22} {:>5} {:>8}s {:>10.6}  {}",
                l.lease,
                l.consumer,
                l.producer_name,
                l.slabs,
                l.expires_unix_ms.saturating_sub(now) / 1000,
                l.price,
                match l.mode {
                    EvictionMode::Lru => "lru",
                    EvictionMode::NoEviction => "no-eviction",
                }
            ));
        }
    }
    if v.prices.len() > 1 {
        let last: Vec<String> = v
            .prices
            .iter()
            .rev()
            .take(8)
            .rev()
            .map(|(_, p)| format!("{p:.6}"))
            .collect();
        out.push(format!("  price, oldest first: {}", last.join(" → ")));
    }
    out
}

/// The market's view from `addr` when a broker answers there; `None` when none runs
/// there (a controller without --broker).
pub async fn market_view(addr: &str, program: &str) -> Option<granule_wire::market::MarketView> {
    let c = granule_market::client::BrokerClient::connect_tool(addr, program)
        .await
        .ok()?;
    let v = c.status().await.ok();
    c.close("done");
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_wire::market::{MarketView, ProducerState, ProducerView};

    /// The producer's footprint is shown beside its leases (and `-` when not reported).
    #[test]
    fn market_lines_show_each_producers_footprint() {
        let producer = |id, resident_bytes| ProducerView {
            producer: id,
            name: format!("p{id}"),
            addr: "127.0.0.1:1".into(),
            connected: true,
            state: ProducerState {
                leased_slabs: 2,
                resident_bytes,
                ..ProducerState::default()
            },
            predicted_free_slabs: 0.0,
            reputation: 1.0,
        };
        let v = MarketView {
            producers: vec![producer(1, 150 << 20), producer(2, 0)],
            ..MarketView::default()
        };
        let lines = market_lines(&v);
        assert!(
            lines[1].contains("LEASED") && lines[1].contains("RSS"),
            "{lines:?}"
        );
        // Right-aligned under the RSS heading.
        let rss = lines[1].find("RSS").unwrap() + 3;
        assert!(lines[2][..rss].ends_with("150.0 MiB"), "{lines:?}");
        assert!(lines[3][..rss].ends_with(" -"), "{lines:?}");
    }
}
