//! `granule fs mount|umount|status|drain` and `granule store`: the scavenging file
//! system's commands, and a victim store started by hand.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use granule::fs::status::{self, Record, Status};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Subcommand)]
pub enum FsCmd {
    /// Mount the file system at DIR and serve it until Ctrl-C, SIGTERM or an unmount.
    Mount(MountArgs),
    /// Unmount DIR (lazily: also a mount whose process died).
    Umount { dir: PathBuf },
    /// Free what a mount of DIR that died left on its own nodes (under --controller:
    /// its stores and metadata copy) instead of adopting it with a new mount.
    Discard {
        dir: PathBuf,
        /// A TOML configuration file (for fs.state_dir).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Space per class and store, stripes draining, replicas missing.
    Status {
        dir: PathBuf,
        /// Print the status as JSON.
        #[arg(long)]
        json: bool,
        /// A TOML configuration file (for fs.state_dir).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Move every stripe off one victim store (to the next store in each stripe's
    /// order), then stop using it.
    Drain {
        dir: PathBuf,
        /// The store's address (as `status` names it).
        #[arg(long)]
        store: String,
        /// A TOML configuration file (for fs.state_dir).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[derive(Args)]
pub struct MountArgs {
    /// The mount point (an existing directory).
    pub dir: PathBuf,
    /// Bytes per stripe, e.g. 1MiB (fs.stripe).
    #[arg(long)]
    pub stripe: Option<String>,
    /// Copies of each stripe, 1 or 2 (fs.replicas).
    #[arg(long)]
    pub replicas: Option<String>,
    /// Own nodes: embedded node processes, e.g. "cpu=1,mem=1GiB;cpu=1,mem=1GiB"
    /// (cluster.nodes).
    #[arg(long)]
    pub nodes: Option<String>,
    /// Use the own nodes of the cluster this controller runs instead (host:port).
    #[arg(long)]
    pub controller: Option<String>,
    /// Victim stores started by hand: ADDR=SECRET[,ADDR=SECRET...].
    #[arg(long, value_delimiter = ',')]
    pub victims: Vec<String>,
    /// Bytes the mount may use on each listed victim store (default: its maxmemory).
    #[arg(long)]
    pub victim_bytes: Option<String>,
    /// Weight of the victim class (own weighs 1) (fs.victim_weight).
    #[arg(long)]
    pub victim_weight: Option<String>,
    /// The market's broker (host:port) (market.broker).
    #[arg(long)]
    pub broker: Option<String>,
    /// Lease this many slabs of victim memory from the broker, in no-eviction mode.
    #[arg(long, default_value_t = 0)]
    pub victim_slabs: u32,
    /// A TOML configuration file (instead of GRANULE_CONFIG).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

pub fn fs(cmd: FsCmd) -> anyhow::Result<()> {
    match cmd {
        FsCmd::Mount(a) => mount(a),
        FsCmd::Umount { dir } => {
            // A crashed mount run as root is unmounted by fusermount3's auto-unmount,
            // possibly while this runs: nothing left to do is not an error.
            if !granule::fs::is_mounted(&dir) {
                println!("granule fs: {} is not mounted", dir.display());
                return Ok(());
            }
            if let Err(e) = granule::fs::unmount(&dir) {
                if granule::fs::is_mounted(&dir) {
                    return Err(e.into());
                }
            }
            println!("granule fs: unmounted {}", dir.display());
            Ok(())
        }
        FsCmd::Discard { dir, config } => {
            let cfg = crate::load_config(config.as_deref())?;
            let d = granule::fs::discard(&dir, &cfg)?;
            if d.outside {
                println!(
                    "granule fs: discarded the mount of {} that died (pid {}): {} files and directories, {} own store(s) and its metadata copy freed; {} victim store(s) left to their leases' ends",
                    dir.display(),
                    d.pid,
                    d.files,
                    d.own_stores,
                    d.victim_stores
                );
            } else {
                println!(
                    "granule fs: the mount of {} that died (pid {}) ran on embedded nodes, which ended with it: its record is removed",
                    dir.display(),
                    d.pid
                );
            }
            Ok(())
        }
        FsCmd::Status { dir, json, config } => {
            let cfg = crate::load_config(config.as_deref())?;
            let body = get(&cfg, &dir, "GET", "/status")?;
            if json {
                println!("{body}");
            } else {
                let s: Status = serde_json::from_str(&body).context("the mount's status")?;
                for l in status::lines(&s) {
                    println!("{l}");
                }
            }
            Ok(())
        }
        FsCmd::Drain { dir, store, config } => {
            let cfg = crate::load_config(config.as_deref())?;
            let body = get(
                &cfg,
                &dir,
                "POST",
                &format!("/drain?store={}", encode(&store)),
            )?;
            println!("{body}");
            Ok(())
        }
    }
}

fn mount(a: MountArgs) -> anyhow::Result<()> {
    let mut cfg = crate::load_config(a.config.as_deref())?;
    for (key, v) in [
        ("fs.stripe", &a.stripe),
        ("fs.replicas", &a.replicas),
        ("cluster.nodes", &a.nodes),
        ("cluster.controller", &a.controller),
        ("fs.victim_weight", &a.victim_weight),
        ("market.broker", &a.broker),
    ] {
        if let Some(v) = v {
            cfg.set(key, v)
                .with_context(|| format!("--{}", flag(key)))?;
        }
    }
    cfg.validate()?;
    let mut victims = Vec::new();
    for v in &a.victims {
        let Some((addr, secret)) = v.split_once('=') else {
            bail!("--victims: '{v}' is not ADDR=SECRET");
        };
        if addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .is_none()
        {
            bail!("--victims: '{addr}' is not host:port");
        }
        if secret.is_empty() {
            bail!("--victims: the secret of {addr} is empty");
        }
        victims.push((addr.to_string(), secret.to_string()));
    }
    let victim_bytes = match &a.victim_bytes {
        Some(v) => Some(
            granule::config::parse_size(v).map_err(|e| anyhow::anyhow!("--victim-bytes: {e}"))?,
        ),
        None => None,
    };
    granule::fs::run(granule::fs::MountOptions {
        dir: a.dir,
        config: cfg,
        victims,
        victim_bytes,
        victim_slabs: a.victim_slabs,
    })?;
    Ok(())
}

fn flag(key: &str) -> &str {
    match key {
        "cluster.nodes" => "nodes",
        "cluster.controller" => "controller",
        "market.broker" => "broker",
        k => k.strip_prefix("fs.").unwrap_or(k),
    }
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One request to the status door of the mount at `dir`; the body.
fn get(cfg: &granule::Config, dir: &Path, method: &str, path: &str) -> anyhow::Result<String> {
    let file = status::record_path(Path::new(&cfg.fs.state_dir), dir);
    let text = std::fs::read_to_string(&file).with_context(|| {
        format!(
            "no mount of {} is recorded in {} (is `granule fs mount {}` running?)",
            dir.display(),
            cfg.fs.state_dir,
            dir.display()
        )
    })?;
    let rec: Record =
        serde_json::from_str(&text).with_context(|| format!("reading {}", file.display()))?;
    if !granule::fs::liveness::held(&file) {
        let adopt = match &rec.controller {
            Some(c) => format!(
                "mount {} again with `--controller {c}` to adopt its files, or ",
                dir.display()
            ),
            None => String::new(),
        };
        bail!(
            "the mount of {} (pid {}) is not running: it died. {adopt}run `granule fs discard {}` to free what it left and remove its record",
            dir.display(),
            rec.pid,
            dir.display()
        );
    }
    let mut s = std::net::TcpStream::connect(&rec.http).with_context(|| {
        format!(
            "the mount of {} (pid {}) does not answer at {}: it may be hung; `granule fs umount {}` unmounts it",
            dir.display(),
            rec.pid,
            rec.http,
            dir.display()
        )
    })?;
    // A drain may take a while; a status answers at once.
    s.set_read_timeout(Some(Duration::from_secs(if method == "POST" {
        3600
    } else {
        10
    })))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        rec.http
    )?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let resp = String::from_utf8_lossy(&resp);
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let code = head.split(' ').nth(1).unwrap_or("?");
    if code != "200" {
        bail!("the mount answered {code}: {}", body.trim());
    }
    Ok(body.to_string())
}

/// `granule store`: one producer store (no-eviction) started by hand.
#[derive(Args)]
pub struct StoreArgs {
    /// Address to listen on (port 0: a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Capacity, e.g. 256MiB.
    #[arg(long)]
    pub bytes: String,
    /// The AUTH password clients must give.
    #[arg(long, env = "GRANULE_STORE_SECRET")]
    pub secret: String,
    /// Token-bucket rate limit, bytes per second (e.g. 100MiB; default: market.store_rate).
    #[arg(long)]
    pub rate: Option<String>,
    /// Pin the store's thread to this vCPU.
    #[arg(long)]
    pub cpu: Option<usize>,
    /// A TOML configuration file (instead of GRANULE_CONFIG).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

pub fn store(a: StoreArgs) -> anyhow::Result<()> {
    use granule::market::store::{Store, StoreConfig};
    let cfg = crate::load_config(a.config.as_deref())?;
    let bytes =
        granule::config::parse_size(&a.bytes).map_err(|e| anyhow::anyhow!("--bytes: {e}"))?;
    if a.secret.is_empty() {
        bail!("--secret must not be empty");
    }
    let mut sc = StoreConfig::from_market(
        &cfg.market,
        bytes,
        a.secret.clone(),
        granule::market::wire::EvictionMode::NoEviction,
    );
    if let Some(r) = &a.rate {
        sc.rate_bps = granule::config::parse_size(r).map_err(|e| anyhow::anyhow!("--rate: {e}"))?;
    }
    sc.consumer = "hand-started".into();
    let store = match a.cpu {
        Some(cpu) => Store::start_pinned(&a.listen, sc, Some(cpu))?,
        None => Store::start(&a.listen, sc)?,
    };
    println!("granule store: listening {}", store.addr());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let why = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        anyhow::Ok(tokio::select! {
            _ = tokio::signal::ctrl_c() => "interrupted",
            _ = term.recv() => "terminated",
        })
    })?;
    let st = store.stats();
    eprintln!("granule store: {why}; {st:?}");
    store.shutdown();
    Ok(())
}
