//! The `granule` command: the demo, a standalone controller, a node that joins a
//! cluster, two views of a running cluster (`status`, `top`), and the memory market's,
//! the file system's and pushdown's commands. The benchmarks are a binary of their own,
//! `granule-bench` (crate `granule-bench`), so that this one does not carry them.
//!
//! This crate owns argument parsing and presentation only; everything it runs lives in
//! the library crates. Like every Granule application, this binary can also act as a
//! node: the driver it starts for `demo` (or `fs mount`, `pushdown`) spawns copies of it.

mod antagonist;
mod demo;
mod fs;
mod market;
mod pushdown;
mod status;
mod top;

use anyhow::Context;
use clap::{Parser, Subcommand};
use granule::config::Origin;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "granule",
    version,
    about = "Granule: one program over many machines, in proclets that move to where CPU and memory are free"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the demo on the embedded local cluster (3 node processes by default;
    /// GRANULE_NODES overrides, GRANULE_CONTROLLER joins an existing cluster).
    Demo {
        /// Seconds spent measuring each call rate.
        #[arg(long, default_value_t = 0.5)]
        seconds: f64,
        /// Stop the cluster and exit after the steps (for scripts and tests), instead of
        /// keeping it and its dashboard running until Ctrl-C.
        #[arg(long)]
        exit: bool,
    },
    /// Moved to the `granule-bench` binary; only says so.
    #[command(hide = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run a standalone controller (for clusters spanning machines).
    Controller {
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:7070")]
        listen: String,
        /// Silence after which a node is declared dead (cluster.failure_timeout).
        #[arg(long)]
        failure_timeout: Option<String>,
        /// Heartbeat interval nodes are told to use (cluster.heartbeat).
        #[arg(long)]
        heartbeat: Option<String>,
        /// Where to serve the dashboard, /api/cluster, /api/events and /metrics
        /// (IP:PORT, port 0 = a free one; `off`) (cluster.dashboard).
        #[arg(long)]
        dashboard: Option<String>,
        /// A TOML configuration file (instead of GRANULE_CONFIG).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Also run the memory market's broker on the controller's port.
        #[arg(long)]
        broker: bool,
    },
    /// Join a cluster as a node. Must be the same executable as the cluster's driver.
    Node {
        /// The controller (host:port) (cluster.controller, GRANULE_CONTROLLER).
        #[arg(long)]
        controller: Option<String>,
        /// Cores this node offers.
        #[arg(long, default_value_t = 1.0)]
        cpu: f64,
        /// Memory this node offers (e.g. 512MiB, 2GiB).
        #[arg(long, default_value = "1GiB")]
        mem: String,
        /// Address to listen on for other nodes; the port is chosen freely
        /// (cluster.listen_host, default 127.0.0.1).
        #[arg(long)]
        listen_host: Option<String>,
        /// A TOML configuration file (instead of GRANULE_CONFIG): every other setting.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print the configuration this machine's environment gives (every setting, its
    /// value, its variable), or check a file.
    Config {
        /// A TOML configuration file (instead of GRANULE_CONFIG).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Show the nodes of a running cluster, their largest proclets and recent events.
    Status {
        /// The controller (host:port).
        #[arg(long, env = "GRANULE_CONTROLLER")]
        controller: String,
    },
    /// A live view of a running cluster: nodes with CPU and memory bars, proclets per
    /// kind, recent events (plain snapshots when stdout is not a terminal).
    Top {
        /// The controller (host:port).
        #[arg(long, env = "GRANULE_CONTROLLER")]
        controller: String,
        /// Time between refreshes (e.g. 1s, 500ms).
        #[arg(long, default_value = "1s")]
        interval: String,
        /// Stop after this many refreshes (default: run until interrupted).
        #[arg(long)]
        iterations: Option<u64>,
    },
    /// Run the memory market's broker on its own (or use `granule controller --broker`).
    Broker(market::BrokerArgs),
    /// A memory producer: harvest a workload's idle memory and lease it out.
    #[command(subcommand)]
    Producer(market::ProducerCmd),
    /// A key-value cache over leased memory: get, put, del, stats, release.
    Kv(market::KvArgs),
    /// Put memory or CPU load into a node's cgroups (run as root on the node's machine).
    Antagonist(antagonist::Args),
    /// The scavenging file system: mount, umount, status, drain.
    #[command(subcommand)]
    Fs(fs::FsCmd),
    /// A victim store started by hand: the market's producer store in no-eviction mode,
    /// for `granule fs mount --victims`.
    Store(fs::StoreArgs),
    /// Run a pushdown query (Q6, Q1, Q14, Q12, word count) on generated tables in the
    /// embedded cluster, pulled, pushed or by the cost rule, and explain the choice.
    Pushdown(pushdown::PushdownArgs),
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("granule: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Demo { seconds, exit } => demo::run(seconds, !exit),
        Cmd::Bench { args } => anyhow::bail!(
            "the benchmarks moved to their own binary: run {} (build it with cargo build --release -p granule-cli -p granule-bench)",
            ["granule-bench".to_string()].iter().chain(&args).cloned().collect::<Vec<_>>().join(" ")
        ),
        Cmd::Controller {
            listen,
            failure_timeout,
            heartbeat,
            dashboard,
            config,
            broker,
        } => {
            let mut c = load_config(config.as_deref())?;
            for (key, flag, v) in [
                (
                    "cluster.failure_timeout",
                    "--failure-timeout",
                    &failure_timeout,
                ),
                ("cluster.heartbeat", "--heartbeat", &heartbeat),
                ("cluster.dashboard", "--dashboard", &dashboard),
            ] {
                if let Some(v) = v {
                    c.set_with_origin(key, v, Origin::Flag(flag))?;
                }
            }
            c.validate()?;
            granule::init_logging(&c.cluster.log);
            let Ok(addr) = listen.parse::<std::net::SocketAddr>() else {
                anyhow::bail!(
                    "--listen: '{listen}' is not IP:PORT (e.g. 0.0.0.0:7070 for every interface, 127.0.0.1:0 for a free local port)"
                );
            };
            // Try the address first, so a taken port or a foreign address is reported in
            // the terms of the flag (the transport would word it as a failed connection).
            // The probe socket closes at once; nothing connected to it, so the port is
            // free again for the real listener.
            if let Err(e) = std::net::TcpListener::bind(addr) {
                let hint = match e.kind() {
                    std::io::ErrorKind::AddrInUse => {
                        "another process (an earlier granule controller?) holds the port: stop it, or pick another port (port 0 = any free one)"
                    }
                    std::io::ErrorKind::AddrNotAvailable => {
                        "that IP is not an address of this machine: use one of its addresses, or 0.0.0.0 for all"
                    }
                    _ => "pick another address",
                };
                anyhow::bail!("--listen: cannot listen on {listen}: {e}; {hint}");
            }
            let config = granule_controller::ControllerConfig {
                failure_timeout: c.cluster.failure_timeout,
                forget_dead_after: c.cluster.forget_dead_after,
                heartbeat: c.cluster.heartbeat,
                dashboard: c.cluster.dashboard.clone(),
                http: granule_http::Limits::from_config(&c),
                ..Default::default()
            };
            // All the descriptors the system grants: the dashboard keeps node.fd_reserve
            // of them free for the nodes' connections.
            if let Err(e) = granule_host::os::raise_nofile_limit() {
                eprintln!("granule controller: cannot raise the limit on open files: {e}");
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let ext: Option<Arc<dyn granule_controller::Extension>> = if broker {
                    let svc = granule_market::server::BrokerService::start(&c.market);
                    println!("granule controller: the memory market's broker shares its port");
                    Some(Arc::new(granule_market::server::BrokerHandler(svc)))
                } else {
                    None
                };
                granule_controller::run_standalone_with(&listen, config, ext).await
            })
            .with_context(|| format!("granule controller cannot start on {listen}"))?;
            Ok(())
        }
        Cmd::Node {
            controller,
            cpu,
            mem,
            listen_host,
            config,
        } => {
            let mut c = load_config(config.as_deref())?;
            // Check each flag on its own first, so the message names the flag the user
            // typed rather than a spec string they never wrote.
            granule::config::parse_size(&mem)
                .map_err(anyhow::Error::msg)
                .context("--mem")?;
            if let Some(h) = &listen_host {
                granule::config::check_listen_host(h)
                    .map_err(anyhow::Error::msg)
                    .context("--listen-host")?;
                c.set_with_origin("cluster.listen_host", h, Origin::Flag("--listen-host"))?;
            }
            if let Some(a) = &controller {
                c.set_with_origin("cluster.controller", a, Origin::Flag("--controller"))?;
            }
            let Some(controller) = c.cluster.controller.clone() else {
                anyhow::bail!(
                    "--controller: which controller to join? Give --controller HOST:PORT (or \
                     GRANULE_CONTROLLER, or cluster.controller in the configuration file)"
                );
            };
            let spec = granule::config::parse_spec(&format!("cpu={cpu},mem={mem}"))
                .map_err(anyhow::Error::msg)
                .context("--cpu / --mem")?;
            let reason = granule::run_node(granule::NodeArgs {
                controller,
                spec,
                config: c,
            })?;
            eprintln!("granule node: leaving: {reason}");
            Ok(())
        }
        Cmd::Config { config } => {
            let c = load_config(config.as_deref())?;
            println!("{:<38} {:<34} variable", "setting", "value");
            for (s, v) in c.describe() {
                println!("{:<38} {:<34} {}", s.key, v, s.env);
            }
            Ok(())
        }
        Cmd::Status { controller } => status::run(&controller),
        Cmd::Top {
            controller,
            interval,
            iterations,
        } => {
            let interval = granule::config::parse_duration(&interval)
                .map_err(anyhow::Error::msg)
                .context("--interval")?;
            if interval < std::time::Duration::from_millis(50) {
                anyhow::bail!(
                    "--interval must be at least 50ms (each refresh asks the controller twice)"
                );
            }
            top::run(top::Options {
                controller,
                interval,
                iterations,
            })
        }
        Cmd::Antagonist(args) => antagonist::run(args),
        Cmd::Fs(cmd) => fs::fs(cmd),
        Cmd::Store(args) => fs::store(args),
        Cmd::Pushdown(args) => pushdown::run(args),
        Cmd::Broker(args) => market::broker(args),
        Cmd::Producer(cmd) => market::producer(cmd),
        Cmd::Kv(args) => market::kv(args),
    }
}

/// The configuration of this machine's environment: defaults, the TOML file (`--config`,
/// else `GRANULE_CONFIG`), the `GRANULE_*` variables; not yet validated (flags come next).
fn load_config(file: Option<&std::path::Path>) -> anyhow::Result<granule::Config> {
    let env = |k: &str| std::env::var(k).ok();
    let mut c = granule::Config::default();
    match file {
        Some(f) => {
            c.apply_toml_file(f)?;
            c.apply_env(env)?;
        }
        None => {
            c = granule::Config::load_over(c, env)?;
        }
    }
    Ok(c)
}
