//! `granule status`: the nodes of a running cluster as a table (like `kubectl get`).

use anyhow::Context;
use granule_controller::ControllerClient;
use granule_wire::{NodeInfo, NodeState, Role};

/// Human-readable bytes (binary units).
pub fn bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// The node table as text.
pub fn table(nodes: &[NodeInfo]) -> String {
    let mut rows = vec![[
        "NODE".to_string(),
        "ROLE".into(),
        "STATE".into(),
        "ADDRESS".into(),
        "PID".into(),
        "CPU (busy/spec)".into(),
        "MEMORY (rss/spec)".into(),
        "PROCLETS c/m/h".into(),
        "CALLS SERVED".into(),
        "SEEN".into(),
    ]];
    for n in nodes {
        rows.push([
            n.id.to_string(),
            match n.role {
                Role::Driver => "driver".into(),
                Role::Node => "node".into(),
                other => format!("{other:?}").to_lowercase(),
            },
            match n.state {
                NodeState::Alive => "alive".into(),
                NodeState::Dead => "DEAD".into(),
            },
            n.addr.clone(),
            n.pid.to_string(),
            format!("{:.2}/{}", n.usage.cores_busy, n.spec.cores),
            format!("{}/{}", bytes(n.usage.mem_used), bytes(n.spec.mem_bytes)),
            format!(
                "{}/{}/{}",
                n.usage.proclets[0], n.usage.proclets[1], n.usage.proclets[2]
            ),
            n.usage.calls_served.to_string(),
            format!("{} ms ago", n.last_seen_ms),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

pub fn run(controller: &str) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let nodes = rt
        .block_on(async {
            let c = ControllerClient::connect_tool(controller, "granule status").await?;
            c.list_nodes().await
        })
        .with_context(|| format!("asking the controller at {controller}"))?;
    print!("{}", table(&nodes));
    Ok(())
}
