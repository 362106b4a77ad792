//! `granule antagonist memory|cpu`: load put into a running node's cgroups from outside,
//! to watch the node react (shed proclets, get throttled, meet the OOM killer).
//!
//! The node is found through the controller (its reported cgroup paths); the antagonist
//! must run on the node's machine, as root.

use anyhow::{bail, Context};
use granule::config::{parse_duration, parse_rate, parse_size};
use granule_controller::ControllerClient;
use granule_host::antagonist::{allocate_paced, set_oom_score_adj, spin, OwnCpuGroup};
use granule_host::{join_pid, CgroupPaths, Hierarchy};
use granule_wire::{NodeId, NodeInfo, NodeState};
use std::time::Duration;

/// Progress is printed every this many bytes (and at the end).
const PROGRESS_EVERY: u64 = 64 << 20;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Allocate memory inside a node's memory cgroup at a steady rate, then hold it.
    /// This process volunteers as the OOM killer's victim (oom_score_adj 1000): if the
    /// node does not make room in time, it is the one killed.
    Memory {
        /// The node (`n3` or `3`).
        #[arg(long)]
        node: String,
        /// Allocation rate (e.g. 1GiB/s, 256MiB/s).
        #[arg(long, default_value = "1GiB/s")]
        rate: String,
        /// How much to allocate in all (e.g. 2GiB).
        #[arg(long)]
        size: String,
        /// How long to hold the memory before exiting.
        #[arg(long, default_value = "30s")]
        hold: String,
        /// CPU quota of the antagonist's own cpu cgroup, in cores (default: unlimited).
        #[arg(long)]
        cpu: Option<f64>,
        /// The controller (host:port).
        #[arg(long, env = "GRANULE_CONTROLLER")]
        controller: String,
    },
    /// Spin threads inside a node's cpu cgroup (eating its CPU quota).
    Cpu {
        /// The node (`n3` or `3`).
        #[arg(long)]
        node: String,
        /// Busy threads.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// How long to spin (e.g. 5s).
        #[arg(long = "for", default_value = "5s")]
        duration: String,
        /// The controller (host:port).
        #[arg(long, env = "GRANULE_CONTROLLER")]
        controller: String,
    },
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.what {
        What::Memory {
            node,
            rate,
            size,
            hold,
            cpu,
            controller,
        } => {
            if let Some(c) = cpu {
                if !(c.is_finite() && c > 0.0) {
                    bail!("--cpu must be a positive number of cores, got {c}");
                }
            }
            let rate = parse_rate(&rate)
                .map_err(anyhow::Error::msg)
                .context("--rate")?;
            let size = parse_size(&size)
                .map_err(anyhow::Error::msg)
                .context("--size")?;
            let hold = parse_duration(&hold)
                .map_err(anyhow::Error::msg)
                .context("--hold")?;
            let node = parse_node(&node)?;
            memory(&controller, node, rate, size, hold, cpu)
        }
        What::Cpu {
            node,
            threads,
            duration,
            controller,
        } => {
            let duration = parse_duration(&duration)
                .map_err(anyhow::Error::msg)
                .context("--for")?;
            if threads == 0 {
                bail!("--threads must be at least 1");
            }
            let node = parse_node(&node)?;
            cpu(&controller, node, threads, duration)
        }
    }
}

fn memory(
    controller: &str,
    node: NodeId,
    rate: u64,
    size: u64,
    hold: Duration,
    cpu: Option<f64>,
) -> anyhow::Result<()> {
    let h = hierarchy()?;
    let (info, paths) = node_groups(controller, node)?;
    let Some(mem) = paths.memory else {
        bail!("{node} has no memory cgroup (it reports only {paths:?})");
    };
    // A group without a limit is not the node's own (a node started without cgroups
    // reports the one it inherited, shared with unrelated processes): filling it would
    // only hurt bystanders.
    let limited = granule_host::Reader::for_paths(
        &h,
        &CgroupPaths {
            memory: Some(mem.clone()),
            cpu: None,
        },
    )
    .and_then(|r| r.memory_limit())
    .map_err(|e| anyhow::anyhow!("reading the memory limit of {mem}: {e}"))?;
    if limited == 0 {
        bail!(
            "{node}'s memory cgroup {mem} has no limit: it is not a cgroup of the node's own \
             (was the cluster started with cgroups off?); refusing to fill it"
        );
    }
    set_oom_score_adj(1000).context("volunteering for the OOM killer")?;
    // Our own cpu group first, so that the page faulting below does not eat the quota
    // of whatever cpu group we were started in.
    let own = OwnCpuGroup::enter_beside(&h, paths.cpu.as_deref())
        .context("creating the antagonist's own cpu cgroup")?;
    if let Some(c) = cpu {
        own.limit_cores(c)
            .context("setting the antagonist's CPU quota")?;
    }
    join_pid(
        &h,
        std::process::id(),
        &CgroupPaths {
            memory: Some(mem.clone()),
            cpu: None,
        },
    )
    .with_context(|| format!("joining the memory cgroup {mem} of {node}"))?;
    println!(
        "antagonist: in the memory cgroup {mem} of {node} (pid {}) and the cpu cgroup {}; allocating {} MiB at {} MiB/s",
        info.pid,
        own.dir().display(),
        size >> 20,
        rate >> 20
    );
    let mut next = PROGRESS_EVERY;
    let started = std::time::Instant::now();
    let hog = allocate_paced(size, rate, |total| {
        if total >= next || total >= size {
            // Read by `granule-bench pressure` for the rate achieved: keep the format.
            let s = started.elapsed().as_secs_f64();
            println!(
                "allocated {} MiB in {:.0} ms ({:.0} MiB/s)",
                total >> 20,
                s * 1e3,
                (total >> 20) as f64 / s.max(1e-9)
            );
            while next <= total {
                next += PROGRESS_EVERY;
            }
        }
    })
    .context("allocating")?;
    println!(
        "holding {} MiB for {:.1}s",
        hog.bytes() >> 20,
        hold.as_secs_f64()
    );
    std::thread::sleep(hold);
    drop(hog);
    own.remove()
        .context("removing the antagonist's own cpu cgroup")?;
    println!("done");
    Ok(())
}

fn cpu(controller: &str, node: NodeId, threads: usize, duration: Duration) -> anyhow::Result<()> {
    let h = hierarchy()?;
    let (_info, paths) = node_groups(controller, node)?;
    let Some(cpu) = paths.cpu else {
        bail!("{node} has no cpu cgroup (it reports only {paths:?})");
    };
    join_pid(
        &h,
        std::process::id(),
        &CgroupPaths {
            memory: None,
            cpu: Some(cpu.clone()),
        },
    )
    .with_context(|| format!("joining the cpu cgroup {cpu} of {node}"))?;
    println!(
        "antagonist: in the cpu cgroup {cpu} of {node}; spinning {threads} thread(s) for {:.1}s",
        duration.as_secs_f64()
    );
    let iterations = spin(threads, duration);
    println!("done ({} M iterations)", iterations / 1_000_000);
    Ok(())
}

/// The cgroup hierarchy, or a clear error (antagonists need to write to it).
fn hierarchy() -> anyhow::Result<Hierarchy> {
    Hierarchy::detect().map_err(|e| {
        anyhow::anyhow!(
            "cannot use cgroups here: {e} (antagonists run as root on the node's machine, \
             with the cgroup v1 memory and cpu controllers mounted under {})",
            granule_host::DEFAULT_ROOT
        )
    })
}

/// The node as the controller lists it, and its cgroups.
fn node_groups(controller: &str, node: NodeId) -> anyhow::Result<(NodeInfo, CgroupPaths)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let nodes = rt
        .block_on(async {
            let c = ControllerClient::connect_tool(controller, "granule antagonist").await?;
            c.list_nodes().await
        })
        .with_context(|| format!("asking the controller at {controller}"))?;
    let Some(info) = nodes.into_iter().find(|n| n.id == node) else {
        bail!("the controller at {controller} knows no node {node} (see `granule status`)");
    };
    match info.state {
        NodeState::Alive => {}
        NodeState::Dead => bail!("{node} is dead"),
        NodeState::Left => bail!("{node} has left the cluster"),
    }
    let Some(paths) = info.cgroups.clone() else {
        bail!(
            "{node} runs in no cgroup (its cluster runs without limits: not root, \
             GRANULE_CGROUPS=off, or no cgroup v1)"
        );
    };
    Ok((info, paths))
}

/// `n3` or `3`.
fn parse_node(s: &str) -> anyhow::Result<NodeId> {
    let t = s.trim();
    let digits = t.strip_prefix('n').unwrap_or(t);
    digits
        .parse()
        .map(NodeId)
        .map_err(|_| anyhow::anyhow!("--node: '{s}' is not a node (examples: n3, 3)"))
}

/// A rate such as `1GiB/s` or `256MiB` (per second either way), in bytes per second.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_and_rates() {
        assert_eq!(parse_node("n3").unwrap(), NodeId(3));
        assert_eq!(parse_node("7").unwrap(), NodeId(7));
        assert!(parse_node("node3").is_err());
        assert!(parse_node("n-1").is_err());
        assert_eq!(parse_rate("1GiB/s").unwrap(), 1 << 30);
        assert_eq!(parse_rate("256MiB").unwrap(), 256 << 20);
        assert!(parse_rate("0/s").is_err());
        assert!(parse_rate("fast").is_err());
    }
}
